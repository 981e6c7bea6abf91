"""The mix-kernel writer of both dialects ([Note: split reductions and mix-order
fusion] in lowering/split.py; ``em``: a ``KernelEmitter``).

A persistent grid of ``PROGRAMS`` programs (times the column blocks, for
column tiles); each walks the row blocks ``program, program + PROGRAMS, ...``,
does the row work of each block (row reductions, row values, row-wise stores:
codegen/rows.py) and folds each column member into a (BLOCK_R, BLOCK_C)
accumulator, combined element-wise; after the loop a program reduces each
accumulator over its rows and stores it as its row of the partial buffer,
which the finishing kernel reduces. What the dialects decide (their tiles stay
theirs: ``tiles.kernel_config`` for Pallas, ``heuristics.triton_mix_config`` for
raw Triton): the accumulators' dtype (``em.column_acc_dtype``), prefetching row
loads through the loop's carry (``em.prefetch_depth``: Pallas), and the loops
(``mix_loops``): raw Triton runs the row blocks every program has in full first,
pipelined (``tl.range`` with ``num_stages``), where a column accumulator needs
no select, then the last ones.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from lowering import ir, sizes
from lowering.codegen.emitter import reduction_identity, whole_rows
from lowering.codegen.rows import FULL, render_rows, zero_where_masked
from lowering.scheduler import Kernel


@dataclasses.dataclass(frozen=True)
class MixLoop:
    start: object  # first step: an int or source
    stop: object
    stages: int | None  # software pipelining (None: the dialect's plain loop)
    comment: str
    masked: bool  # its blocks may hold lanes past the edge: column members combine the identity there


def mix_loops(kernel: Kernel, cfg, *, split_full: bool) -> tuple[list[str], list[MixLoop]]:
    """(lines defining the step counts, the loops over row blocks). ``split_full``:
    first the steps every program has in full (``cfg.num_stages`` stages, no
    select), then the rest."""
    if sizes.is_symbolic(kernel.rows):  # the row-block counts are runtime values
        lines = ["steps = ((ROWS + BLOCK_R - 1) // BLOCK_R + PROGRAMS - 1) // PROGRAMS"]
        steps, full_steps = "steps", "full_steps"
        if split_full:
            lines.append("full_steps = (ROWS // BLOCK_R) // PROGRAMS")
    else:
        lines = []
        steps = -(-(-(-int(kernel.rows) // cfg.block_rows)) // kernel.programs)
        full_steps = (int(kernel.rows) // cfg.block_rows) // kernel.programs
    if not split_full:
        return lines, [MixLoop(0, steps, None, "", True)]
    loops = [MixLoop(0, full_steps, cfg.num_stages, "row blocks every program has in full", False),
             MixLoop(full_steps, steps, 1, "the last row blocks, rows past ROWS masked", True)]
    if not sizes.is_symbolic(kernel.rows):
        loops = [lp for lp in loops if lp.start < lp.stop]
    return lines, loops


def write_mix(em, kernel: Kernel, bodies, cfg, *, split_full: bool = False, skip_zero_selects: bool = False) -> None:
    """The mix kernel's body after ``pid``. ``split_full``: the loops of
    ``mix_loops``; ``skip_zero_selects``: a masked block's sum of a value
    already 0 past the edge (``rows.zero_where_masked``) needs no select."""
    w = em.w
    w.line(f"PROGRAMS = {kernel.programs}")
    lines, loops = mix_loops(kernel, cfg, split_full=split_full)
    for line in lines:
        w.line(line)
    columns = [m for m in kernel.members if m.role == "column"]
    whole = whole_rows(kernel)
    if whole:
        w.line("program = pid")
        w.line(f"xc = {em.iota_text(1, 'BLOCK_C')}")
    else:
        w.line(f"col_blocks = {-(-int(kernel.cols) // cfg.block_cols)}")
        w.line("program = pid // col_blocks")
        w.line(f"xc = (pid % col_blocks) * BLOCK_C + {em.iota_text(1, 'BLOCK_C')}")
    w.line("cmask = xc < COLS")
    accs = []
    for i, m in enumerate(columns):
        acc_dt = em.column_acc_dtype(m.node.dtype)
        ident = reduction_identity(m.node.op, m.node.dtype)
        w.line(f"acc{i} = {em.tile_text('(BLOCK_R, BLOCK_C)', ident, em.dtype_text(acc_dt))}")
        accs.append((f"acc{i}", acc_dt, m))
    depth = em.prefetch_depth(cfg) if whole else 0
    loads = row_loads(em, kernel, bodies) if depth else []
    ahead = em.write_row_loads(loads) if loads else []  # (load, extent) of each row load
    depth = depth if ahead else 0
    for d in range(depth):
        w.line(f"rows{d} = load_rows(program + {d} * PROGRAMS)")
    carried = [a for a, _, _ in accs] + [f"rows{d}" for d in range(depth)]
    # Loads that do not depend on the row (a norm's weight) stay inside the
    # loop: hoisted, they hold registers for the whole loop and cost one-warp
    # programs occupancy (slower on both norms: RESULTS.md, "Heuristics: split
    # reductions and mix kernels"); in the loop they hit L1.
    for loop in loops:
        def body(loop=loop):
            em.scopes.append({})
            em.row_values = {}
            row_block = "(program + step * PROGRAMS)"
            if ahead:  # this block's row loads came in the carry; issue those of the block `depth` steps on
                names = [f"pre{i}" for i in range(len(ahead))]
                w.line(f"{', '.join(names)}, = rows0")
                w.line(f"rows{depth} = load_rows(program + (step + {depth}) * PROGRAMS)")
                em.prefetched = {ld: (n, ext) for (ld, ext), n in zip(ahead, names)}
            if whole:
                render_rows(em, kernel, bodies, cfg, row_block=row_block, columns_ready=True)
            else:
                w.line(f"xr = {row_block} * BLOCK_R + {em.iota_text(0, 'BLOCK_R')}")
                w.line("rmask = xr < ROWS")
                for m in kernel.members:
                    if m.role == "rowwise" and m.store:
                        em.store(m, *em.value(bodies[m.name]))
            # Combined element-wise: the cross-row reduction happens once, after the loop.
            outs = [_combine_column(em, name, acc_dt, m, bodies[m.name], loop.masked and not (
                skip_zero_selects and m.node.op == "sum" and zero_where_masked(em, bodies[m.name], FULL)))
                for name, acc_dt, m in accs]
            em.scopes.pop()
            em.prefetched = {}
            return outs + [f"rows{d}" for d in range(1, depth + 1)]

        em.loop("row_block", "step", loop.start, loop.stop, carried, body, loop.stages, loop.comment)
    for name, acc_dt, m in accs:
        off = em.bind(("partial_offset",), f"program * {int(kernel.cols)} + xc", frozenset("c"), "idx")[0]
        off = em.masked_store_offset(off, "cmask", m.node.numel, frozenset("c"))
        total = em.reduce_text(m.node.op, name, acc_dt, 0)
        # jnp.sum / jnp.prod of 8- and 16-bit ints return int32 / uint32, which Pallas's store refuses
        if acc_dt != m.node.dtype or (np.dtype(acc_dt).kind in "iu" and np.dtype(acc_dt).itemsize < 4):
            total = em.cast_text(f"({total})", m.node.dtype)
        w.line(em.store_text(em.out_refs[m.name], off, total, ", mask=cmask"))


def _combine_column(em, name, acc_dt, m, body, masked: bool) -> str:
    """One row block's combine of column member ``m`` into accumulator ``name``;
    ``masked``: lanes past the edge combine the reduction's identity."""
    var, ext = em.value(body)
    v = em.broadcast(var, ext, FULL)
    if acc_dt != m.body.dtype:
        v = em.bind(("cast", v, acc_dt), em.cast_text(v, acc_dt), FULL)[0]
    if masked:
        edge = em.edge_mask(FULL)[0]
        ident = em.identity_operand(m.node.op, acc_dt)
        v = em.bind(("masked", v, edge, ident), em.where_text(edge, v, ident), FULL)[0]
    return em.combine_text(m.node.op, name, v, acc_dt)


def row_loads(em, kernel: Kernel, bodies) -> list[ir.Load]:
    """The loads of a mix kernel that move with the row block (what it
    streams: inputs indexed by the row), each once."""
    members = {m.name for m in kernel.members}
    found = {}
    for m in kernel.members:
        for ld in ir.loads(bodies[m.name]):
            if ld.buffer not in members and "r" in em.extent_of(em.offset(ld.buffer, ld.index)):
                found[ld] = None
    return list(found)
