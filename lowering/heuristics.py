"""Every block-size, warp and persistence choice, in one place.

Each constant carries its reason in a line; the measurements behind them are
in benchmarks/RESULTS.md, "Heuristics" (one subsection per group below).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from lowering.sizes import next_power_of_2

ceil_div = lambda a, b: -(-a // b)  # noqa: E731


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    persistent: bool  # reduction kernels: the whole row in one tile
    num_stages: int = 1  # Triton software pipelining of the kernel's loop
    prefetch: int = 0  # mix kernels: row blocks whose loads are issued ahead of the one being computed

    @property
    def elements(self):
        return self.block_rows * self.block_cols


def pointwise_config(rows: int, cols: int) -> TileConfig:
    """1024 elements, 4 warps: larger tiles and more warps reached the memory
    floor no better (RESULTS.md, "Heuristics: pointwise and reduction tiles")."""
    bc = min(next_power_of_2(cols), 1024)
    br = min(next_power_of_2(rows), max(1, 1024 // bc))
    return TileConfig(br, bc, 4, True)


# Broadcast tables ([Note: broadcast tables] in lowering/scheduler.py): a pointwise
# value computed from indices, inputs and constants only, read broadcast by larger
# readers, is stored once when recomputing it per reader element costs more than
# this many op units (an op's weight below: libdevice sin/cos/pow ~30 instructions,
# exp/log/rsqrt a few, other ops ~free since they hide under memory time). RoPE's
# cos/sin tables read over batch and heads come to ~700M units; a bias exp over a
# batch stays under.
BROADCAST_TABLE_OPS = 1 << 26
HEAVY_OP_WEIGHT = 24
LIGHT_TRANSCENDENTAL_WEIGHT = 4
LIGHT_TRANSCENDENTALS = frozenset({"exp", "exp2", "log", "rsqrt", "sqrt", "logistic"})
HEAVY_OPS = frozenset({"sin", "cos", "tan", "pow", "tanh", "erf", "erfc", "erf_inv", "atan2", "asin", "acos",
                       "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma", "igamma",
                       "igammac", "log1p", "expm1", "cbrt", "bessel_i0e", "bessel_i1e", "polygamma",
                       "zeta", "random_gamma_grad", "nextafter"})


def op_weight(op: str) -> int:
    """Cost units of one elementwise op for the broadcast-table choice."""
    if op in HEAVY_OPS:
        return HEAVY_OP_WEIGHT
    return LIGHT_TRANSCENDENTAL_WEIGHT if op in LIGHT_TRANSCENDENTALS else 0


# A pointwise value whose inlined body loads more buffers than this, read by larger
# readers, is stored once ([Note: broadcast tables]): a global-norm clip's scale, the
# sum of every parameter's sum of squares, would otherwise be summed again inside each
# of 183 optimizer updates (a 190-argument part function a member, and Triton's compile
# time with it).
MAX_INLINED_READS = 16
# A pointwise value that several nodes read and whose inlined body loads more buffers
# than this is stored once: each reader would load them all again. A deep model's
# residual stream (x_L = x_0 + every earlier layer's outputs and biases) was otherwise
# recomputed from 4L + 1 buffers in each of layer L's norm kernels, forward and backward
# (benchmarks/RESULTS.md, "The 12-layer GPT-2 step: the residual stream stored once").
# Inductor realizes a buffer past 8 such reads.
MAX_SHARED_INLINED_READS = 8
# A pointwise value whose inlined body loads more elements than this, over twice as many
# as the buffers they come from (a gather of a gather: inlining doubled the loads at each
# step, ``i = i[i]`` 8 deep put 256 in one kernel, a minute in the kernel writer), is
# stored. Inductor realizes a node past 30 ops.
MAX_INLINED_LOADS = 32
# Groups of one iteration space that share nothing merge to save a launch; past this
# many members the kernel's code (one body per member) costs more Triton compile time
# than the launch it saves, and combo kernels join the rest with shared code.
HORIZONTAL_MAX_MEMBERS = 8


# Persistent row reductions of one phase past which the raw-Triton renderer
# writes them inside a region of their own ([Note: reductions in a region] in
# codegen/rows.py): Triton's coalescing pass grows about with the cube of a
# kernel's chained reductions; figures in benchmarks/RESULTS.md, "Session 21".
REDUCTION_REGION_MIN = 16


# Combo kernels ([Note: combo kernels] in lowering/combo.py).
# Members per launch: a program finds its member through a chain of scalar
# compares, and Triton compiles every member's code, so past ~100 the dispatch
# and the compile grow while the launches saved stop mattering.
COMBO_MAX_MEMBERS = 128
# Pointer arguments (8 bytes each) per launch: CUDA 12.1+ on Volta and newer
# takes 32764 bytes of kernel parameters (XLA packs up to 4095 arguments there);
# 1000 keeps 8 KB. Set 500 for a toolchain limited to 4 KB.
COMBO_MAX_ARGS = 1000
# Members past which a raw-Triton combo branches over groups of members, each a
# function of its own members' pointers ([Note: combo dispatch groups] in
# lowering/codegen/combo.py): Triton's frontend work per branch grows with the
# pointers live where it branches.
COMBO_DISPATCH_GROUP = 16
# Bytes a launch moves: past 1 GiB (~0.3 ms at H100 bandwidth) the launch and
# tail a combo saves are under 1% of the launch's own time.
COMBO_MAX_BYTES = 1 << 30
# Members before a repeating sequence (the embeddings before a model's layers)
# that a periodic plan puts in its first launch ([Note: periodic packs] in
# lowering/combo.py).
COMBO_PERIOD_PREFIX = 16
# Elements per program of a flat (one-row) pointwise member: 1024-4096 with a
# few warps is what approaches the memory floor on the H100 (heuristics note
# above); 2048 over 4 warps gives each thread 16 B vector accesses four deep.
COMBO_POINTWISE_BLOCK = 2048
COMBO_POINTWISE_WARPS = 4


def combo_pointwise_config(rows: int, cols: int) -> TileConfig:
    """Tile of a pointwise combo member: a flat member takes COMBO_POINTWISE_BLOCK
    elements per program; a tiled one (rows x columns) its own pointwise tile."""
    if rows != 1:
        return pointwise_config(rows, cols)
    return TileConfig(1, min(next_power_of_2(cols), COMBO_POINTWISE_BLOCK), COMBO_POINTWISE_WARPS, True)


def transpose_config(rows: int, cols: int) -> TileConfig:
    """A pointwise kernel that loads along rows and stores along columns: a
    tile long in rows (the load's 128-row side is 256 contiguous bf16 bytes)
    and 32 wide, which Triton exchanges through shared memory; 128 x 32 beat
    64 x 64 and 32 x 32 (RESULTS.md, "Heuristics: pointwise and reduction tiles")."""
    return TileConfig(min(next_power_of_2(rows), 128), min(next_power_of_2(cols), 32), 4, True)


def reduction_config(rows: int, cols: int, *, max_persistent_cols: int, inner_contiguous: bool,
                     force_width_one: bool = False, long_rows: str = "looped", itemsize: int = 4) -> TileConfig:
    """Persistent when the row fits; else loop over column chunks.

    ``inner_contiguous``: the reduced index is the fastest-moving one in memory
    (a row reduction). Otherwise (a column reduction) rows are contiguous, so
    the tile is made tall to keep loads coalesced along rows.
    ``force_width_one``: reductions that only combine in a loop (prod).
    A persistent tile holds up to 4096 elements (several rows when they are
    short): one row per program loses to scheduling overhead (RESULTS.md,
    "Heuristics: pointwise and reduction tiles"). ``long_rows``, ``itemsize``: see
    ``long_row_persistent``."""
    if force_width_one:
        return TileConfig(min(next_power_of_2(rows), 128), 1, 4, False)
    width = next_power_of_2(cols)
    if inner_contiguous and long_row_persistent(cols, itemsize, long_rows, max_persistent_cols):
        return TileConfig(1, width, long_row_warps(cols), True)
    if width <= max_persistent_cols:
        br = max(1, min(next_power_of_2(rows), 4096 // width, 64))
        warps = 4 if br * width <= 2048 else 8
        return TileConfig(br, width, warps, True)
    if inner_contiguous:
        one_row = rows < 1024 or cols * itemsize >= LOOPED_ONE_ROW_BYTES
        return TileConfig(1, 4096, LOOPED_ONE_ROW_WARPS, False) if one_row else TileConfig(2, 4096, 8, False)
    return TileConfig(min(next_power_of_2(rows), 64), 64, 4, False)


# Raw Triton's persistent row tiles of several rows over 512 columns (rows of
# 257-512 elements: 8 a tile) run in 2 warps: 4 and 8 (Pallas's count) were
# slower in Triton's own pipeline on the H200 (RESULTS.md, "Session 21").
TRITON_ROWS_512_WARPS = 2


def triton_row_warps(cfg: TileConfig) -> int:
    """Warps of a raw-Triton row reduction whose tile is ``reduction_config``'s ``cfg``."""
    if cfg.persistent and cfg.block_rows >= 2 and cfg.block_cols == 512:
        return TRITON_ROWS_512_WARPS
    return cfg.num_warps


# Rows past max_persistent_cols (a 50,257-token vocabulary's logits). Looped, a
# kernel reads the row once per sweep: two with online softmax (max and sum, then
# the outputs), the second mostly from L2 when each program owns one row.
# Persistent, one program holds the row in registers and reads it once. Triton
# keeps a tile's values in 32-bit registers whatever the input dtype (16-bit
# floats are computed in float32): at the most warps (32, 1024 threads) a
# 32768-wide float32 or bf16 tile is 32 values a thread per live array, as the
# 8192-wide tiles of 8 warps are; wider, a few live arrays fill the 64K registers
# and spill. So "auto" keeps rows up to LONG_ROW_PERSISTENT_BYTES (4-byte
# values, 8-byte for float64) persistent, and "persistent" (option long_rows)
# goes up to LONG_ROW_MAX_COLS for the benchmarks to compare
# (benchmarks/long_rows.py).
LONG_ROW_PERSISTENT_BYTES = 128 * 1024
# Looped rows of at least LOOPED_ONE_ROW_BYTES take one row a program: a kernel
# that sweeps a row twice (online softmax, then the outputs) finds it in L2 the
# second time only while the rows in flight fit there (132 SMs x 2 programs x
# a 100 KB bf16 vocabulary row is 26 MB of the H100's 50 MB; two rows a program
# would be all of it).
LOOPED_ONE_ROW_BYTES = 64 * 1024
# Warps of such a one-row program: 16 over 4096-wide chunks, the fastest raw-Triton
# tile of the 50,257-vocabulary cross-entropy (RESULTS.md, "Cross-entropy:
# pallaskit's looped tiles").
LOOPED_ONE_ROW_WARPS = 16
LONG_ROW_MAX_COLS = 65536
LONG_ROW_MAX_WARPS = 32
DEFAULT_MAX_PERSISTENT_COLS = 8192  # lowering.options' default: a smaller value asks for loops


def long_row_persistent(cols: int, itemsize: int, mode: str, max_persistent_cols: int) -> bool:
    """Is a row reduction over ``cols`` (past ``max_persistent_cols``) kept in
    one tile? ``mode``: option long_rows; ``itemsize``: its widest operand's."""
    width = next_power_of_2(cols)
    if width <= max_persistent_cols or mode == "looped":
        return False
    if mode == "persistent":
        return width <= LONG_ROW_MAX_COLS
    return (max_persistent_cols >= DEFAULT_MAX_PERSISTENT_COLS
            and width * max(4, itemsize) <= LONG_ROW_PERSISTENT_BYTES)


def long_row_warps(cols: int) -> int:
    """Warps of a persistent long row: one per 1024 columns, 8 to 32."""
    return max(8, min(LONG_ROW_MAX_WARPS, next_power_of_2(cols) // 1024))


# --------------------------------------------------------------------------- #
# Split reductions and mix-order fusion
# --------------------------------------------------------------------------- #
# A column reduction (reduced dims lead) over M rows and N columns gives each
# program a block of columns and makes it walk all M rows: with N = 384 that
# is 6 programs on a 132-SM GPU. Splitting it into per-program partial sums
# (programs x N, float32) and a second small reduction fills the GPU.
# Figures: RESULTS.md, "Heuristics: split reductions and mix kernels".

# Below this many rows the second kernel's launch costs more than the idle SMs
# of the unsplit reduction.
MIN_SPLIT_ROWS = 1024
# A mix kernel walks its rows one small tile at a time, unpipelined, so bytes in
# flight come from many resident one-warp programs: 16 per SM beat 8 per SM of
# 4 rows and 4 warps by far.
WARPS_PER_SM = 16
# Two column sums (LayerNorm's dw and db) carry two accumulators and the
# prefetched rows, so fewer one-warp programs fit an SM: 12 was the best count.
WARPS_PER_SM_TWO_COLUMNS = 12
# Each program's partial row costs N more floats written and read; 64 rows a
# program keeps that under 1/16 of the input.
MIN_ROWS_PER_PROGRAM = 64


def mix_warps(cols: int) -> int:
    """Warps of a mix kernel that holds whole rows: one per 512 columns (16
    elements per thread), at most 8."""
    return max(1, min(8, next_power_of_2(cols) // 512))


def _programs_per_sm(cols: int, columns: int = 1) -> int:
    warps = WARPS_PER_SM_TWO_COLUMNS if columns == 2 else WARPS_PER_SM
    return max(2, warps // mix_warps(cols))


def mix_worthwhile(rows: int, cols: int, num_sms: int, columns: int = 1) -> bool:
    """Is doing the row work inside the mix kernel worth it? Only when there
    are rows enough for at least half the full grid at MIN_ROWS_PER_PROGRAM
    each; with fewer, the row work would run on a fraction of the SMs (the
    training step's 8192x1024 RMSNorm backward as one mix kernel of 128
    programs was much slower than a row kernel plus a split column sum:
    RESULTS.md, "Heuristics: split reductions and mix kernels")."""
    return ceil_div(rows, MIN_ROWS_PER_PROGRAM) * 2 >= num_sms * _programs_per_sm(cols, columns)


def partial_programs(rows: int, cols: int, num_sms: int, columns: int = 1) -> int:
    """Programs (= partial rows) for a column reduction split over ``rows``;
    ``columns``: the column reductions over the same domain (they share a kernel)."""
    return max(1, min(num_sms * _programs_per_sm(cols, columns), ceil_div(rows, MIN_ROWS_PER_PROGRAM)))


def column_reduction_underfilled(rows: int, cols: int, num_sms: int) -> bool:
    """Would a column reduction (``cols`` outputs, ``rows`` reduced) leave SMs idle?"""
    return rows >= MIN_SPLIT_ROWS and ceil_div(cols, 64) < num_sms


# Programs per SM a split row reduction aims at: 8 beat 4 on a full sum (RESULTS.md,
# "Heuristics: split reductions and mix kernels").
ROW_SPLIT_PROGRAMS_PER_SM = 8


def row_split(outputs: int, reduced: int, num_sms: int) -> int:
    """Chunks to split each output's inner (contiguous) reduction into; 1: no split.

    Splits when there are fewer outputs than SMs and each would loop over at
    least 32k elements; aims at ROW_SPLIT_PROGRAMS_PER_SM programs per SM with
    chunks of >= 4096."""
    if outputs >= num_sms or reduced < 32768:
        return 1
    chunks = ceil_div(num_sms * ROW_SPLIT_PROGRAMS_PER_SM, outputs)
    return max(1, min(chunks, reduced // 4096))


# A full reduction (to a scalar) of an operand with rows splits at its rows, so
# that the partial is an ordinary row reduction over the operand's own domain,
# which a pointwise sibling joins (a loss's gradient y * 2/n beside its
# sum(y**2) reads y once; RESULTS.md, "Training step").
# One program finishes the per-row partials: at most 16384 floats (64 KB).
MAX_FINISH_ROWS = 16384
# Shorter rows make short contiguous reads: those keep row_split's flat chunks.
MIN_ROW_COLS = 256


def full_reduction_at_rows(rows: int, cols: int, num_sms: int, max_persistent_cols: int) -> bool:
    """Split a full reduction over ``rows x cols`` into per-row partials?"""
    return (num_sms <= rows <= MAX_FINISH_ROWS and cols >= MIN_ROW_COLS
            and fits_in_tile(cols, max_persistent_cols))


def fits_in_tile(cols: int, max_persistent_cols: int) -> bool:
    """Can a whole row of ``cols`` elements live in one tile (persistent)?"""
    return next_power_of_2(cols) <= max_persistent_cols


# Row blocks a whole-row mix kernel loads ahead: its loop carries the loads of
# the next MIX_PREFETCH blocks, so each one-warp program keeps loads in flight
# while it reduces and stores the current block; 2 was best, 3 and 4 slower
# (RESULTS.md, "Heuristics: split reductions and mix kernels").
MIX_PREFETCH = 2
# Two column sums prefetch too, at WARPS_PER_SM_TWO_COLUMNS; three or more are
# not measured and keep 16 per SM and no prefetch.
MIX_PREFETCH_MAX_COLUMNS = 2


def mix_config(rows: int, cols: int, *, whole_rows: bool, programs: int, columns: int = 1) -> TileConfig:
    """Tile of a mix kernel: each of ``programs`` programs walks row blocks of
    ``block_rows`` rows. ``whole_rows``: the kernel also computes row
    reductions, so a tile spans the full row (one column block): one row per
    step, ``mix_warps`` warps (faster than 2-8 rows with 2-4 warps); ``columns``
    (column reductions accumulated) decides the prefetch depth. Otherwise (a
    split column reduction) 8 x 512 tiles, 4 warps (faster than 32 x 128).
    Figures: RESULTS.md, "Heuristics: split reductions and mix kernels"."""
    if whole_rows:
        prefetch = MIX_PREFETCH if columns <= MIX_PREFETCH_MAX_COLUMNS else 0
        return TileConfig(1, next_power_of_2(cols), mix_warps(cols), True, prefetch=prefetch)
    bc = min(next_power_of_2(cols), 512)
    br = max(1, min(next_power_of_2(ceil_div(rows, programs)), 4096 // bc))
    return TileConfig(br, bc, 4, False)


# Raw-Triton mix kernels (lowering/executors.py; codegen/triton.py
# ``render_mix``): Triton pipelines a loop's loads through shared memory
# (``tl.range(num_stages=...)``), which Pallas does not expose, so a program
# can own a block of rows per step and keep three steps of loads in flight.
# Each program sums its (BLOCK_R, BLOCK_C) accumulator over rows at the end
# and stores one partial row, as the Pallas kernel does. One column sum: 8
# rows a step in 8 warps. Two or more (LayerNorm's dw and db, five row sums a
# step): 4 rows in 2 warps, 4 programs per SM, so a row's sums stay within a
# warp (8 warps over an (8, 512) tile go through shared memory for each)
# (RESULTS.md, "Heuristics: raw-Triton mix kernels"). Rows too long for two a
# step (a model width past 2048 with one column sum, past 1024 with two) take
# one row a step: 8 warps, 2 programs per SM with one column sum; 4 warps,
# 2 programs per SM with two or more (8 warps and 4 per SM were 19% slower
# there; RESULTS.md, "Session 21").
# Raw-Triton looped row reductions fold a softmax's max and sum(exp) into one
# sweep only if this is set: off, two sweeps measured faster (RESULTS.md,
# "Cross-entropy: raw Triton's online softmax").
TRITON_ONLINE_SOFTMAX = False
# Raw-Triton looped one-row reductions over rows whose length is no multiple of a
# 16-byte vector (a 50,257 vocabulary) index the row from an aligned base so
# that Triton emits vector loads and stores ([Note: aligned row windows] in
# lowering/codegen/rows.py): hand-written kernels with such accesses were the
# fastest cross-entropy (RESULTS.md, "Cross-entropy: why 0.65 ms is not met");
# benchmarks/triton_online_softmax.py times pallaskit's on and off.
TRITON_ALIGNED_ROWS = True
# Raw-Triton looped one-row reductions whose row-shaped inputs fit in shared
# memory stage the row there once, every chunk's copy in flight at once, and
# sweep it from there ([Note: staged rows] in lowering/codegen/rows.py). A
# hand-written kernel of that shape ran the 50,257-vocabulary cross-entropy
# forward+backward in 0.615 ms on the H100, 89% of the memory floor, against
# 1.05-1.12 for the looped sweeps (RESULTS.md, "Session 27"): chunks of 2048
# elements in 8 warps; two bf16 rows (100 KB each) share an SM's 228 KB (4096-wide
# chunks in 16 warps 0.745, one program an SM with the next row's copies in
# flight 0.705-0.795). A float32 row of 50,257 (201 KB) is staged alone on its SM:
# 1.16 ms against 2.23 unstaged (floor 1.10). STAGED_ROW_MAX_BYTES: what one
# program may stage, under the 227 KB a block may hold with room for the
# reductions' own scratch.
TRITON_STAGED_ROWS = True
STAGED_ROW_MAX_BYTES = 216 * 1024
STAGED_ROW_BLOCK = 2048
STAGED_ROW_WARPS = 8
# Atomic scatter-adds of 16-bit floats ([Note: atomic scatters] in lowering/ir.py)
# accumulate in a float32 scratch rounded once at the end: one rounding instead of one
# per add (a frequent token's embedding row takes many), and atomics that Triton's
# interpreter runs (the CPU tests). Off, a GPU adds in the 16-bit dtype itself, as
# jax.jit and torch do (sm_90's atom.add.noftz.v4.bf16: tests/test_scatter_atomic.py
# compiles it): no float32 scratch to fill and convert. Not measured yet:
# benchmarks/scatter_add.py times both.
ATOMIC_16BIT_IN_FLOAT32 = True
TRITON_MIX_ROWS = 8  # rows a step
TRITON_MIX_WARPS = 8
TRITON_MIX_STAGES = 3  # beat 2 and 4
TRITON_MIX_PROGRAMS_PER_SM = 2  # the register limit of this tile
TRITON_MIX_ELEMENTS = 4096  # rows x padded columns of one tile: 16 per thread at 8 warps
TRITON_MIX_COLUMNS_ROWS = 4  # two or more column sums
TRITON_MIX_COLUMNS_WARPS = 2
TRITON_MIX_COLUMNS_PROGRAMS_PER_SM = 4
TRITON_MIX_COLUMNS_ELEMENTS = 2048  # 32 per thread at 2 warps
TRITON_MIX_LONG_COLUMNS_WARPS = 4  # one row a step, two or more column sums
TRITON_MIX_LONG_COLUMNS_PROGRAMS_PER_SM = 2


def triton_mix_config(cols: int, columns: int = 1) -> TileConfig | None:
    """The tile of a raw-Triton mix kernel over rows of ``cols`` elements that
    accumulates ``columns`` column sums, or None where rows are too long for 2
    rows a tile (``triton_mix_row_config``)."""
    if columns < 1:
        return None
    several = columns >= 2
    bc = next_power_of_2(cols)
    br = TRITON_MIX_COLUMNS_ROWS if several else TRITON_MIX_ROWS
    limit = TRITON_MIX_COLUMNS_ELEMENTS if several else TRITON_MIX_ELEMENTS
    while br > 1 and br * bc > limit:
        br //= 2
    if br < 2:
        return None
    warps = TRITON_MIX_COLUMNS_WARPS if several else TRITON_MIX_WARPS
    return TileConfig(br, bc, warps, True, num_stages=TRITON_MIX_STAGES)


def triton_mix_row_config(cols: int, columns: int = 1) -> TileConfig:
    """The raw-Triton mix tile where ``triton_mix_config`` has none (rows too
    long for two a step): one row a step, pipelined as the two-row tile, in
    TRITON_MIX_WARPS warps (TRITON_MIX_LONG_COLUMNS_WARPS with two or more
    column sums)."""
    warps = TRITON_MIX_LONG_COLUMNS_WARPS if columns >= 2 else TRITON_MIX_WARPS
    return TileConfig(1, next_power_of_2(cols), warps, True, num_stages=TRITON_MIX_STAGES)


def triton_mix_programs(rows: int, num_sms: int, columns: int = 1, long_rows: bool = False) -> int:
    """Programs (= partial rows) of a raw-Triton mix kernel: a persistent grid
    of TRITON_MIX_PROGRAMS_PER_SM per SM (TRITON_MIX_COLUMNS_PROGRAMS_PER_SM
    with two or more column sums, TRITON_MIX_LONG_COLUMNS_PROGRAMS_PER_SM if
    their rows are ``long_rows``: ``triton_mix_config`` is None), each with
    at least MIN_ROWS_PER_PROGRAM rows."""
    if columns < 2:
        per_sm = TRITON_MIX_PROGRAMS_PER_SM
    else:
        per_sm = TRITON_MIX_LONG_COLUMNS_PROGRAMS_PER_SM if long_rows else TRITON_MIX_COLUMNS_PROGRAMS_PER_SM
    return max(1, min(num_sms * per_sm, ceil_div(rows, MIN_ROWS_PER_PROGRAM)))


# --------------------------------------------------------------------------- #
# Matmul template
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiles of one matmul kernel: each program computes a ``block_m x
    block_n`` output tile, looping over K ``block_k`` at a time. Programs run
    in groups of ``group_m`` tile rows (Triton's L2-friendly order)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    # the names metric tables read from every kernel config
    @property
    def block_rows(self):
        return self.block_m

    @property
    def block_cols(self):
        return self.block_n

    @property
    def persistent(self):
        return False

    def __str__(self):
        return (f"block {self.block_m} x {self.block_n} x {self.block_k}, group {self.group_m}, "
                f"{self.num_warps} warps, {self.num_stages} stages")


# Triton's tensor-core dot needs every block dim >= 16; larger tiles reuse each
# loaded element more. 128 x 256 x 64 with 8 warps and 3 stages is the Triton
# tutorial's best bf16 tile on the H100 for large products (pointer loads, as
# here). Shared memory per stage: (BM + BN) * BK * itemsize.
MIN_MATMUL_BLOCK = 16
MATMUL_SMEM_BYTES = 200 * 1024  # of the H100's 228 KB per SM, leaving room for the epilogue's layout change
# A small grid of 128 tiles on 132 SMs is one wave: halving the tiles again to
# fill the last SMs made each program's weight stream shorter and slower
# (RESULTS.md, "Heuristics: matmul template", small-M tiles).
MATMUL_WAVE_FILL = 0.9
MATMUL_ONE_WAVE_STAGES = 6  # a weight-bound grid of one wave keeps six K steps in flight


def matmul_config(m: int, n: int, k: int, dtype, *, batch: int = 1, num_sms: int = 132) -> MatmulConfig:
    """Tile config of a ``batch x (m x k) @ (k x n)`` matmul whose operands are
    of ``dtype`` (anything ``np.dtype`` takes). A pure function of the sizes:
    a multi-kernel dispatcher asks it for the config of each hinted size.

    Start from the large tile, shrink each block to its dim (rounded up to a
    power of two, at least 16), then halve the larger of block_m / block_n
    (not below 64 / 32) while the grid would leave SMs idle: a small-M
    product (M = 64, N = K = 4096: 64 column tiles of 256) is bound by reading
    the weights, which needs programs on about every SM. Such a grid (one wave
    or less) streams K through a deeper pipeline, with longer K steps where
    the row block is short."""
    itemsize = np.dtype(dtype).itemsize
    wide = itemsize <= 2
    bm = max(MIN_MATMUL_BLOCK, min(next_power_of_2(m), 128))
    bn = max(MIN_MATMUL_BLOCK, min(next_power_of_2(n), 256 if wide else 128))
    bk = max(MIN_MATMUL_BLOCK, min(next_power_of_2(k), 64 if wide else 32))

    def tiles(bm, bn):
        return batch * ceil_div(m, bm) * ceil_div(n, bn)

    while tiles(bm, bn) < MATMUL_WAVE_FILL * num_sms:
        if bn >= bm and bn > 32:
            bn //= 2
        elif bm > 64:
            bm //= 2
        else:
            break
    one_wave = tiles(bm, bn) <= num_sms
    if one_wave and wide and bm <= 64:
        bk = max(MIN_MATMUL_BLOCK, min(next_power_of_2(k), 128))
    area = bm * bn
    # Row blocks of 128 run 8 warps from 64 columns on: with 4, a pointwise epilogue
    # over the float32 accumulator (a GELU's tanh) needed 174-255 registers and
    # spilled at 128 x 128; with 8 GELU-epilogue products ran 7-27% faster, plain
    # ones within 1% (one 9% faster), and ptxas took about half as long
    # (RESULTS.md, "Session 38"). 64 x 128 was not measured.
    wide_tile = area >= 128 * 256 or (bm >= 128 and bn >= 64)
    warps = 8 if wide_tile else 4 if area >= 64 * 64 or (one_wave and bm >= 64) else 2
    per_stage = (bm + bn) * bk * itemsize
    most = MATMUL_ONE_WAVE_STAGES if one_wave else 4 if area < 128 * 256 else 3
    stages = max(1, min(most, MATMUL_SMEM_BYTES // per_stage, ceil_div(k, bk)))
    return MatmulConfig(bm, bn, bk, warps, stages)


# Where the template beats XLA (option matmul_template="auto"): 16-bit products
# with few rows, where XLA's small-M kernels leave the GPU underused; XLA wins
# on thousands of rows, on weight gradients and on float32 (TF32), and a fused
# epilogue does not make up for the slower product (RESULTS.md, "Heuristics:
# matmul template").
MATMUL_TEMPLATE_MAX_ROWS = 512


def matmul_template_wins(batch: int, m: int, n: int, k: int, dtype) -> bool:
    """Is the template expected to beat XLA on this product? 16-bit operands
    and few output rows (each batch's M, or N when the product is computed
    transposed: the smaller free side)."""
    return np.dtype(dtype).itemsize == 2 and min(m, n) <= MATMUL_TEMPLATE_MAX_ROWS


# A product whose output gives the GPU little work while K is long runs with
# one program per output tile walking all of K: XLA splits K over programs
# (split-K), the template does not, so such dots stay with XLA. "Little work":
# fewer 32 x 32 output tiles than a quarter of the SMs.
SPLIT_K_MIN_K = 4096  # K long enough that one program walking all of it leaves the GPU idle


def matmul_needs_split_k(batch: int, m: int, n: int, k: int, num_sms: int) -> bool:
    return batch * ceil_div(m, 32) * ceil_div(n, 32) * 4 < num_sms and k >= SPLIT_K_MIN_K


# --------------------------------------------------------------------------- #
# Loop bodies
# --------------------------------------------------------------------------- #
# Option loop_bodies='auto' on a GPU: a loop's bodies compile where one holds a
# 16-bit dot_general of at least this many multiply-adds a step; other loops
# run as XLA's own loop. Measured on the H100 (RESULTS.md, "Session 28"; T=128,
# B=256, H=1024): compiled bodies ran bf16 GRU and LSTM cells and a LayerNorm +
# matmul scan 5-16% faster than XLA's loop (the LSTM forward 6% slower), float32
# cells' gradients 5-14% slower, and small-step loops (no dot, or a small one)
# 9-24% slower, row writes 50-64%: each compiled step launches from the host,
# which a large product hides. The LSTM step's product is 2^30 multiply-adds.
LOOP_BODY_MIN_DOT_MACS = 1 << 26


def loop_body_pays(dots: list) -> bool:
    """Do a loop's bodies, holding these ``(m, n, k, itemsize)`` products a
    step, compile on a GPU under loop_bodies='auto'?"""
    return any(size == 2 and m * n * k >= LOOP_BODY_MIN_DOT_MACS for m, n, k, size in dots)
