"""The matmul template, both dialects: a scheduled ``matmul`` kernel's tile, K loop
and epilogue (``pallas.render_matmul``, ``triton.render_matmul`` write the rest).

[Note: the matmul template]
One program per output tile of ``BLOCK_M x BLOCK_N`` (and per batch entry),
grid flattened to one axis (``xb``, then tile rows in groups of ``GROUP_M``
for L2 reuse, as in Triton's matmul tutorial). Each program loops over K,
``BLOCK_K`` at a time, loading an A tile (``BLOCK_M x BLOCK_K``) and a B tile
(``BLOCK_K x BLOCK_N``) with gather-style loads from flat refs (offsets
computed from the operands' index expressions, so transposed and batched
operands need no copy), and accumulates the dialect's dot (``dot_text``) in
float32. Edges:
rows past M and columns past N read row ``xr % M`` / column ``xc % N`` (in
bounds, never stored: the loads need no mask); the K tail is masked to 0.
Blocks are powers of two of at least 16 (Triton's dot), so any M, N, K works.

After the loop the accumulator is the matmul's value at ``(xb, xr, xc)``;
the epilogue (pointwise members, ``scheduler._epilogue_member``) is rendered
by the dialect's kernel emitter with ``TileValues`` mixed in, which reads the
matmul's buffer as that tile, and the stores are masked at the edges.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import sympy

from lowering import heuristics, ir, sizes
from lowering.codegen.emitter import KernelEmitter, kernel_coords_body
from lowering.options import CompileOptions
from lowering.scheduler import XC, XK, XR, Kernel, Schedule, matmul_kernel_bounds

# Names of the index variables inside the kernel (sympy symbols print as their names).
A_ROW, A_K = sizes.symbol("xra"), sizes.symbol("ka")  # A tile: (BLOCK_M, 1) rows, (1, BLOCK_K) k
B_K, B_COL = sizes.symbol("kb"), sizes.symbol("xcb")  # B tile: (BLOCK_K, 1) k, (1, BLOCK_N) columns


class TileValues(KernelEmitter):
    """A kernel emitter (either dialect, mixed in before it) reading in-kernel
    tiles (the accumulator) from ``tile_values`` instead of memory."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tile_values: dict[str, tuple[str, frozenset]] = {}

    def load(self, ld: ir.Load):
        if ld.buffer in self.tile_values:
            return self.tile_values[ld.buffer]  # legality: read at the accumulator's own element
        return super().load(ld)


def matmul_dims(node: ir.Matmul) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a matmul node, each flattened."""
    return tuple(sizes.numel(d) for d in (node.batch, node.m, node.n, node.k))


def matmul_kernel_config(kernel: Kernel, options: CompileOptions) -> heuristics.MatmulConfig:
    node = matmul_member(kernel).node
    b, m, n, k = matmul_dims(node)
    m = sizes.hint(m, options.size_hints)  # a dynamic M: the tiles of its hinted size
    cfg = heuristics.matmul_config(m, n, k, node.operands[0].dtype, batch=b, num_sms=options.num_sms)
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    return cfg


def matmul_member(kernel: Kernel):
    return next(m for m in kernel.members if m.role == "matmul")


@dataclasses.dataclass
class Plan:
    """What both dialects' matmul writers start from: the tile, the emitter,
    the matmul member and its node, (batch, M, N, K) and the block counts. A
    dynamic M (the only size the template takes symbolic) is read at run time:
    ``m_blocks`` is then the name ``M_BLOCKS``."""
    cfg: heuristics.MatmulConfig
    em: KernelEmitter
    mm: object
    node: ir.Matmul
    dims: tuple
    m_blocks: object
    n_blocks: int
    k_blocks: int
    dynamic_m: bool


def plan(emitter_cls, kernel: Kernel, schedule: Schedule, options: CompileOptions) -> Plan:
    cfg = matmul_kernel_config(kernel, options)
    em = emitter_cls(kernel, schedule, cfg, options)
    mm = matmul_member(kernel)
    em.bounds = matmul_kernel_bounds(mm.node)
    b, m, n, k = matmul_dims(mm.node)
    dynamic_m = sizes.is_symbolic(m)
    return Plan(cfg, em, mm, mm.node, (b, m, n, k), "M_BLOCKS" if dynamic_m else -(-m // cfg.block_m),
                -(-n // cfg.block_n), -(-k // cfg.block_k), dynamic_m)


def write_k_loop(em, mm, cfg, dims, k_blocks, dynamic_m: bool) -> None:
    """The K loop into the float32 tile ``acc`` (both dialects, ``em``'s): per
    step an A and a B tile, gathered at their operands' offsets (rows past M and
    columns past N read a valid row / column, the K tail masked to 0), and
    ``em.dot_text()`` added in. ``k_blocks``: the step count (a number, or the
    name of a kernel constant or argument)."""
    m, n, k = dims
    node: ir.Matmul = mm.node
    w = em.w
    lhs, rhs = (ir.substitute_index(op, mm.coords) for op in mm.body.args)
    a_rows, b_cols = XR, XC
    if dynamic_m or m % cfg.block_m:
        w.line("xra = xr % M  # rows past M read a valid row; they are never stored")
        a_rows = A_ROW
    if n % cfg.block_n:
        w.line("xcb = xc % N")
        b_cols = B_COL
    a_off = operand_offset(em, lhs, {XR: a_rows, XK: A_K})
    b_off = operand_offset(em, rhs, {XK: B_K, XC: b_cols})
    k_tail = k % cfg.block_k != 0
    w.line(f"acc = {em.zeros_text('(BLOCK_M, BLOCK_N)', em.dtype_text(np.float32))}")

    def body():
        w.line(f"ka = step * BLOCK_K + {em.iota_text(1, 'BLOCK_K')}")
        w.line(f"kb = step * BLOCK_K + {em.iota_text(0, 'BLOCK_K')}")
        for name, ref, off, free, shape, kmask in (
                ("a", em.in_refs[lhs.buffer], a_off, {a_rows, A_K}, "(BLOCK_M, BLOCK_K)", "ka < K"),
                ("b", em.in_refs[rhs.buffer], b_off, {B_K, b_cols}, "(BLOCK_K, BLOCK_N)", "kb < K")):
            text = sizes.to_source(off)
            if not free <= off.free_symbols:
                text = em.broadcast_text(text, shape) if off.free_symbols else em.tile_text(shape, text, em.index_dtype)
            mask = f", mask={em.broadcast_text(kmask, shape)}, other=0" if k_tail else ""
            w.line(f"{name} = {em.load_text(ref, text, mask)}")
        return [em.dot_text(node, lhs.dtype)]

    em.loop("k_step", "step", 0, k_blocks, ["acc"], body)


def write_tile(em, b: int, m_blocks, n_blocks: int, group_m: int, dynamic_m: bool) -> None:
    """From ``pid``: the batch entry ``xb``, the tile's row and column blocks
    (GROUP_M row blocks at a time), ``xr``/``xc`` and their masks (both
    renderers, ``em``'s dialect)."""
    w = em.w
    tiles = f"(M_BLOCKS * {n_blocks})" if dynamic_m else m_blocks * n_blocks
    tile = "pid"
    if b > 1:
        w.line(f"xb = pid // {tiles}")
        w.line(f"tile = pid % {tiles}")
        tile = "tile"
    if n_blocks == 1:
        w.line(f"pid_m = {tile}")
        w.line("pid_n = 0")
    elif m_blocks == 1:
        w.line("pid_m = 0")
        w.line(f"pid_n = {tile}")
    else:
        group = group_m * n_blocks
        w.line("# GROUP_M row blocks walk the column blocks together, sharing B tiles in L2")
        w.line(f"first_m = ({tile} // {group}) * GROUP_M")
        w.line(f"group_rows = {em.MINIMUM}({m_blocks} - first_m, GROUP_M)")
        w.line(f"pid_m = first_m + ({tile} % {group}) % group_rows")
        w.line(f"pid_n = ({tile} % {group}) // group_rows")
    w.line(f"xr = pid_m * BLOCK_M + {em.iota_text(0, 'BLOCK_M')}")
    w.line(f"xc = pid_n * BLOCK_N + {em.iota_text(1, 'BLOCK_N')}")
    w.line("rmask = xr < M")
    w.line("cmask = xc < N")


def write_epilogue(em, kernel: Kernel, mm) -> None:
    """After the K loop (the float32 tile ``acc``): the product rounded to its
    dtype, its store, and the epilogue members read at the accumulator's element
    ([Note: the matmul template]). Shared with the Triton renderer (``em``'s dialect)."""
    node = mm.node
    full = frozenset("rc")
    tile_var = "acc"
    if node.dtype != np.float32:
        em.w.line(f"mm = {em.cast_text('acc', node.dtype)}")
        tile_var = "mm"
        if node.dtype.name == "bfloat16":  # (float16 rounds: jax.jit's f16 product overflows to inf, as it does here)
            em.wide_of["mm"] = "acc"  # a bf16 product feeds its epilogue unrounded (allow_excess_precision)
    em.tile_values[node.name] = (tile_var, full)
    if mm.store:
        em.store(mm, tile_var, full)
    for member in kernel.members:
        if member is mm:
            continue
        var, ext = em.value(kernel_coords_body(member))
        if member.store:
            em.store(member, var, ext)


def operand_offset(em, load: ir.Load, names: dict) -> sympy.Expr:
    """Flat offset of an operand load, in the tile's index variables."""
    if load.mask is not None:
        raise NotImplementedError("masked operand load")  # the scheduler materializes pads and concats
    off = sizes.simplify_with_bounds(em.offset(load.buffer, load.index), em.bounds)
    return sizes.simplify(off.xreplace(names))
