"""Each kernel's tile (``heuristics.TileConfig``) from its kind, extents and
loads: the questions both dialects ask of a pointwise, reduction or mix kernel."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lowering import heuristics, ir, sizes
from lowering.codegen.emitter import columns, kernel_coords_body, whole_rows
from lowering.errors import SymbolicUnsupported
from lowering.options import CompileOptions
from lowering.scheduler import XC, XR, Kernel, Schedule


def kernel_config(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> heuristics.TileConfig:
    if sizes.is_symbolic((kernel.rows, kernel.cols)):
        return symbolic_config(kernel, schedule, options)
    if kernel.kind == "pointwise":
        if transposed_load(kernel, schedule):
            cfg = heuristics.transpose_config(kernel.rows, kernel.cols)
        else:
            cfg = heuristics.pointwise_config(kernel.rows, kernel.cols)
    elif kernel.kind == "mix":
        cfg = heuristics.mix_config(kernel.rows, kernel.cols, whole_rows=whole_rows(kernel),
                                    programs=kernel.programs, columns=columns(kernel))
    else:
        inner = reduction_is_inner(kernel, schedule)
        prod = any(m.role == "reduction" and m.node.op == "prod" for m in kernel.members)
        cfg = heuristics.reduction_config(kernel.rows, kernel.cols, max_persistent_cols=options.max_persistent_cols,
                                          inner_contiguous=inner, force_width_one=prod,
                                          long_rows=options.long_rows, itemsize=widest_read(kernel, schedule))
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    return cfg


def widest_read(kernel: Kernel, schedule: Schedule) -> int:
    """The largest itemsize among the buffers a kernel reads (4 if none)."""
    return max([np.dtype(schedule.graph.buffer_aval(b)[1]).itemsize for b in kernel.reads] or [4])


def symbolic_config(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> heuristics.TileConfig:
    """The tile of a kernel whose rows or columns are symbolic: the heuristics
    at the size hints. Only what stays right at every size: pointwise kernels,
    and row reductions whose reduced (column) extent is static."""
    rows, cols = (sizes.hint(x, options.size_hints) for x in (kernel.rows, kernel.cols))
    if kernel.kind == "pointwise":
        if transposed_load(kernel, schedule):
            cfg = heuristics.transpose_config(rows, cols)
        else:
            cfg = heuristics.pointwise_config(rows, cols)
    elif kernel.kind == "mix" and not sizes.is_symbolic(kernel.cols):
        # Dynamic rows: the persistent grid is sized at the hint (the partial
        # buffer has that many rows); each program's row-block count is a
        # runtime value (codegen/mix.py).
        cfg = heuristics.mix_config(rows, cols, whole_rows=whole_rows(kernel), programs=kernel.programs,
                                    columns=columns(kernel))
    elif kernel.kind == "reduction" and not sizes.is_symbolic(kernel.cols):
        inner = reduction_is_inner(kernel, schedule)
        prod = any(m.role == "reduction" and m.node.op == "prod" for m in kernel.members)
        cfg = heuristics.reduction_config(rows, cols, max_persistent_cols=options.max_persistent_cols,
                                          inner_contiguous=inner, force_width_one=prod)
    elif kernel.kind == "reduction":
        # Over a dynamic axis: always looped (no tile holds every size), the
        # chunk count a runtime value; chunks no wider than the hinted row.
        if any(m.role == "reduction" and m.node.op in ("argmax", "argmin") for m in kernel.members):
            raise SymbolicUnsupported(f"kernel {kernel.name}: argmax/argmin over a dynamic axis ({kernel.cols})")
        inner = reduction_is_inner(kernel, schedule)
        prod = any(m.role == "reduction" and m.node.op == "prod" for m in kernel.members)
        cfg = heuristics.reduction_config(rows, cols, max_persistent_cols=0, inner_contiguous=inner,
                                          force_width_one=prod)
        cfg = dataclasses.replace(cfg, block_cols=min(cfg.block_cols, max(16, sizes.next_power_of_2(cols))))
    else:
        raise SymbolicUnsupported(
            f"{kernel.kind} kernel {kernel.name} over symbolic sizes {kernel.rows} x {kernel.cols}")
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    return cfg


def transposed_load(kernel, schedule) -> bool:
    """Does a pointwise kernel load memory contiguously along its rows (the
    store is contiguous along its columns)? Then it is a tiled transpose."""
    for m in kernel.members:
        for ld in ir.loads(kernel_coords_body(m)):
            if ld.buffer not in kernel.reads:
                continue
            shape, _ = schedule.graph.buffer_aval(ld.buffer)
            if _rows_contiguous(tuple(ld.index), tuple(shape)):
                return True
    return False


@functools.lru_cache(maxsize=1 << 14)
def _rows_contiguous(index: tuple, shape: tuple) -> bool:
    # Memoized: a combo asks for each of its members, whose loads repeat a few indices.
    off = sizes.simplify(sizes.ravel(index, shape))
    return XC in off.free_symbols and off.coeff(XR) == 1 and off.coeff(XC) != 1


def reduction_is_inner(kernel, schedule) -> bool:
    """Is xc the fastest-moving index of the kernel's main loads?"""
    for m in kernel.members:
        if m.role != "reduction":
            continue
        for ld in ir.loads(kernel_coords_body(m)):
            if ld.buffer not in kernel.reads:
                continue
            shape, _ = schedule.graph.buffer_aval(ld.buffer)
            off = sizes.simplify(sizes.ravel(ld.index, shape))
            return off.coeff(XC) == 1 or XR not in off.free_symbols
    return True


