"""The row-reduction writer of both dialects (``em``: a ``KernelEmitter``):
row reductions, row values and row-wise stores of one block of rows, phase by
phase ([Note: kernel shape] in codegen/emitter.py), each phase in one tile
(persistent) or in a loop over column chunks (looped); argmax / argmin; and
online softmax (a looped max and sum(exp(x - max)) in one sweep)."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import sympy

from lowering import heuristics, ir, sizes
from lowering.codegen.emitter import (INT32_LIMIT, acc_dtype, cdiv_source, is_16bit_float, is_float, is_reduction, phases,
                                      reduction_identity, store_reductions, write_ready_row_values)
from lowering.scheduler import XC, XR, Kernel, Member

FULL = frozenset("rc")
ROW = frozenset("r")


def render_rows(em, kernel: Kernel, bodies, cfg, *, row_block="pid", columns_ready=False) -> None:
    """Row reductions, row values and row-wise stores of one block of rows
    (``row_block``). ``columns_ready``: ``xc``/``cmask`` are already defined."""
    w = em.w
    w.line(f"xr = {row_block} * BLOCK_R + {em.iota_text(0, 'BLOCK_R')}")
    w.line("rmask = xr < ROWS")
    online = online_plans(kernel, bodies) if not cfg.persistent and em.online_softmax else {}
    em.window = row_window(em, kernel, bodies, cfg) if not cfg.persistent and not columns_ready else None
    if em.window is not None:
        em.window_setup(row_block)
        if em.window.staged:
            em.window_stage()
    phase, online = online_phases(kernel, online) if online else (phases(kernel), {})
    # the last phase that reduces or stores over columns (row values may follow it)
    last = max((phase[m.name] for m in kernel.members if m.role in ("reduction", "rowwise")), default=-1)
    for p in range(max(phase.values()) + 1):
        reds = [m for m in kernel.members if m.role == "reduction" and phase[m.name] == p]
        rowwise = [m for m in kernel.members if m.role == "rowwise" and m.store and phase[m.name] == p]
        # A row value of this phase that the phase's members read (one that needs no
        # reduction: a scalar computed beside the row sums) is written first.
        write_ready_row_values(em, kernel, bodies, only={ld.buffer for m in reds + rowwise
                                                         for ld in ir.loads(bodies[m.name])})
        if reds or rowwise:
            if cfg.persistent:
                if p == 0 and not columns_ready:
                    w.line(f"xc = {em.iota_text(1, 'BLOCK_C')}")
                    w.line("cmask = xc < COLS")
                if em.REDUCTION_REGION and len(reds) >= heuristics.REDUCTION_REGION_MIN and not rowwise \
                        and p == last:
                    results = _reduce_in_region(em, reds, bodies, row_block)
                else:
                    results = {m.name: reduce_tile(em, m, bodies[m.name]) for m in reds}
                for m in rowwise:
                    em.store(m, *em.value(bodies[m.name]))
                em.row_values.update(results)
            else:
                _render_loop(em, kernel, bodies, reds, rowwise, p, cfg,
                             online={m.name: online[m.name] for m in reds if m.name in online})
        write_ready_row_values(em, kernel, bodies)
    store_reductions(em, kernel)
    em.window = None


# [Note: reductions in a region]
# Triton's coalescing pass (TritonGPUCoalesce) looks, for every load and store,
# at the whole dataflow slice around it (mlir::getSlice: the backward and forward
# slice of every op reached, to a fixed point). A kernel summing many rows into
# one chain (a global norm: ``sum(sum(g * g) for g in grads)``, over a hundred
# reductions in GPT-2's step) makes that slice the whole kernel and each op's
# slice as long as the chain: its cost grows about with the cube of the
# reductions, seconds for that one kernel. A slice stops at a region's yield, so the last phase's
# reductions, past ``heuristics.REDUCTION_REGION_MIN`` of them, are written
# inside an ``if`` that always holds (an else branch gives each result a zero
# of its type, never run): the chain after it no longer joins the loads' slices.
# The loads, the arithmetic and the reduction order are the same; row-only loads
# are issued before the region so that the code after it never loads again what
# the region loaded (its values are out of scope there).
def _reduce_in_region(em, reds: list, bodies, row_block: str) -> dict:
    for m in reds:
        for ld in ir.loads(bodies[m.name]):
            if ld.buffer not in em.row_values and "c" not in em.extent_of(em.offset(ld.buffer, ld.index)):
                em.load(ld)
    w = em.w
    w.line(f"if {row_block} >= 0:  # always: a region for Triton's coalescing ([Note: reductions in a region])")
    with w.indent():
        em.scopes.append({})
        results = {m.name: reduce_tile(em, m, bodies[m.name]) for m in reds}
        em.scopes.pop()
    w.line("else:")
    with w.indent():
        zeros = {}  # one zero tile per dtype, the other results of that dtype alias it
        for m in reds:
            dt = em.dtype_text(m.node.dtype)
            text = zeros.get(dt) or em.zeros_text("(BLOCK_R, 1)", dt)
            zeros.setdefault(dt, results[m.name])
            w.line(f"{results[m.name]} = {text}")
    return results


def masked_operand(em, m: Member, body: ir.Expr) -> str:
    """A reduction's operand over the tile, in its accumulator dtype, with the
    identity past the last column (``em.SKIP_ZERO_SELECT``: no select for a sum
    of a value that is already 0 there, ``zero_where_masked``)."""
    var, ext = em.value(body)
    acc_dt = acc_dtype(m.node.op, m.body.dtype)
    v = em.broadcast(var, ext, FULL)
    if acc_dt != m.body.dtype:
        v = em.bind(("cast", v, acc_dt), em.cast_text(v, acc_dt), FULL)[0]
    if em.SKIP_ZERO_SELECT and m.node.op == "sum" and zero_where_masked(em, body, frozenset("c")):
        return v
    ident = em.identity_operand(m.node.op, acc_dt)
    # The key holds the identity: a max and a min of one value pad it differently.
    return em.bind(("masked", v, "cmask", ident), em.where_text("cmask", v, ident), FULL)[0]


def reduce_tile(em, m: Member, body: ir.Expr) -> str:
    """A persistent reduction member: its whole row in one tile, reduced."""
    masked = masked_operand(em, m, body)
    text = em.reduce_text(m.node.op, masked, acc_dtype(m.node.op, m.body.dtype), 1)
    return em.bind(("reduce", m.name), em.cast_text(text, m.node.dtype), ROW, "red")[0]


def zero_where_masked(em, e, dims: frozenset) -> bool:
    """Is ``e`` (kernel coordinates) exactly 0 on every lane where the edge mask
    over ``dims`` ("c": columns, "rc": rows and columns) is off, so that a sum
    of it needs no select? Conservatively: a load whose offset spans ``dims``
    (the emitter loads it under that mask with ``other=0``), and casts,
    negations, sums and differences of such values, and their products with
    each other or with a finite constant. Anything else may be nonzero or NaN
    there: a row value (its masked rows hold whatever 1 / 0 gave), exp(0),
    0 / 0. Of the three selects of the RMSNorm backward's mix kernel this drops
    two, the third goes with the full-block loop (``triton.render_mix``); figures in
    RESULTS.md, "Heuristics: raw-Triton mix kernels"."""
    zero = functools.partial(zero_where_masked, em, dims=dims)
    if isinstance(e, ir.Load):
        return (e.buffer not in em.row_values and not em.windowed(e)
                and dims <= em.extent_of(em.offset(e.buffer, e.index)))
    if not isinstance(e, ir.Op):
        return False
    if e.op in ("convert_element_type", "neg"):
        return zero(e.args[0])
    if e.op in ("add", "sub"):
        return zero(e.args[0]) and zero(e.args[1])
    if e.op == "mul":
        a, b = e.args
        return (zero(a) and (zero(b) or ir.is_finite_const(b))) or (zero(b) and ir.is_finite_const(a))
    return False


def _render_loop(em, kernel, bodies, reds, rowwise, p, cfg, online=None):
    """Phase ``p``'s reductions in one loop over column chunks: a (BLOCK_R,
    BLOCK_C) accumulator per reduction, combined element-wise, reduced across
    lanes after the loop."""
    w = em.w
    accs, carried = [], []
    # [Note: online softmax]: sums folded into this loop, one set of accumulators per
    # distinct A; a float max over exactly A is read off them.
    online = online or {}
    groups: dict = {}  # A -> accumulator name
    for m in reds:
        if m.name in online:
            groups.setdefault(online[m.name].shifted, f"onl{p}_{len(groups)}")
    derived = {m.name: groups[bodies[m.name]] for m in reds
               if m.node.op == "max" and is_float(m.body.dtype) and bodies[m.name] in groups}
    for i, m in enumerate(r for r in reds if r.name not in online and r.name not in derived):
        acc_dt = acc_dtype(m.node.op, m.body.dtype)
        ident = reduction_identity(m.node.op, m.body.dtype)
        name = f"acc{p}_{i}"
        w.line(f"{name} = {em.tile_text('(BLOCK_R, BLOCK_C)', ident, em.dtype_text(acc_dt))}")
        carried.append(name)
        if m.node.op in ("argmax", "argmin"):  # each lane also carries the index of its best value
            w.line(f"{name}_i = {em.zeros_text('(BLOCK_R, BLOCK_C)', em.dtype_text(em.arg_index_dtype(m.node.dtype)))}")
            carried.append(f"{name}_i")
        accs.append((name, acc_dt, m))
    for a, name in groups.items():
        carried += online_init(em, name, a)
    if em.window is not None:
        # Row-only loads (a cross-entropy's labels) before the loop: inside it, Triton
        # gives such a (1, 1) value the chunk's vector layout and loads it once per
        # element of a thread's vector.
        for m in reds + rowwise:
            for ld in ir.loads(bodies[m.name]):
                if ld.buffer in em.in_refs and row_only(ld):
                    em.load(ld)

    def body():
        if em.window is not None:
            em.window_columns()
        else:
            w.line(f"xc = chunk * BLOCK_C + {em.iota_text(1, 'BLOCK_C')}")
            w.line("cmask = xc < COLS")
        em.scopes.append({})
        outs = []
        for name, acc_dt, m in accs:
            masked = masked_operand(em, m, bodies[m.name])
            if m.node.op in ("argmax", "argmin"):
                outs += arg_combine(em, name, masked, m.node.op, acc_dt, em.arg_index_dtype(m.node.dtype))
            else:
                outs.append(em.combine_text(m.node.op, name, masked, acc_dt))
        for a, name in groups.items():
            outs += online_step(em, name, a)
        for m in rowwise:
            em.store(m, *em.value(bodies[m.name]))
        em.scopes.pop()
        return outs

    # Over a dynamic axis the chunk count is a runtime value (the tile is always looped).
    n_chunks = cdiv_source(kernel.cols, cfg.block_cols, "COLS", "BLOCK_C") if em.window is None else em.window.chunks
    em.loop(f"phase{p}", "chunk", 0, n_chunks, carried, body)
    for name, acc_dt, m in accs:
        if m.node.op in ("argmax", "argmin"):
            text = em.arg_finish(name, m.node.op, acc_dt, m.node.dtype)
        elif cfg.block_cols == 1:
            text = name
        else:
            text = em.reduce_text(m.node.op, name, acc_dt, 1)
        em.row_values[m.name] = em.bind(("reduce", m.name), em.cast_text(text, m.node.dtype), ROW, "red")[0]
    for name in groups.values():
        online_flags(em, name)
    for m in reds:
        if m.name in derived:
            online_max(em, derived[m.name], m)
    for m in reds:
        if m.name in online:
            online_sum(em, groups[online[m.name].shifted], m, online[m.name])


# [Note: aligned row windows]
# A row of a (rows, 50257) bf16 array starts at flat offset row * 50257: for most
# rows not a multiple of 8 elements, so Triton cannot prove the 16-byte alignment
# of ``ptr + xc + COLS * xr`` and reads and writes the row one 2-byte element at
# a time (scalar ``ld.global.b16``). A looped one-row reduction (one row a
# program) over rows whose length is no multiple of a vector of ``VEC = 16 //
# itemsize`` elements (of its narrowest row-shaped buffer) instead walks a window
# that starts at the row's start rounded down to a multiple of VEC: chunk c covers
# the flat offsets ``wa + c * BLOCK_C + lane``, and the row's columns are
# ``xc = c * BLOCK_C + lane - wh`` (``wh`` the row's start less ``wa``), so
# ``cmask = 0 <= xc < COLS`` and everything written over ``xc`` is what it was.
# Only the row-shaped accesses (flat offset ``xc + COLS * xr``) change:
# - loads read the window unmasked but for the buffer's end rounded up to a
#   vector (every mask lane then holds for a whole vector, which Triton needs
#   to vectorize a masked load), so their lanes outside the row hold the
#   neighbouring rows' values, not 0: ``zero_where_masked`` says so and every
#   reduction selects with ``cmask`` as it does for any other value. The last
#   vector of the buffer is read in full (past the buffer's end for up to
#   VEC - 1 elements): pointers are 16-byte aligned (Triton's
#   ``tt.divisibility``, which pallaskit's compiles assume), so that vector
#   never crosses a page, and its lanes past the end are never used;
# - stores write whole vectors inside the row under a mask constant over each
#   vector, and the row's partial first and last vectors apart with a per-lane
#   mask, only in the chunks that hold them (a second store, of the same values).
# The loop takes ceil((COLS + VEC - 1) / BLOCK_C) chunks. Not for argmax /
# argmin (``arg_combine``: every lane takes the first chunk's value, and a
# lane before the row would keep its negative index), several rows a program,
# dynamic sizes, or a window whose offsets would pass int32.
#
# [Note: staged rows]
# A looped one-row kernel reads its row once per sweep (max, sum(exp), the
# outputs), the later sweeps from L2 at best, one chunk in flight a sweep: the
# 50,257-vocabulary cross-entropy ran at about half the memory floor however
# its chunks and warps were chosen. Where the dialect can (raw Triton on a GPU,
# written as a Gluon kernel, whose shared memory is explicit: ``STAGED_ROWS``)
# and the row-shaped buffers a program reads through the window fit in
# ``heuristics.STAGED_ROW_MAX_BYTES`` (two bf16 vocabulary rows an SM), the window is
# staged: before the first sweep every chunk of every such buffer is copied
# into shared memory at once (``cp.async``, 16 bytes a lane, the same vector
# mask as the window's loads), and every sweep's window load reads shared
# memory instead. HBM then sees each input row once, all of it in flight while
# the program waits, and the sweeps are bound by the SM. Everything else in the
# kernel is what the Triton dialect writes (Triton's ``tl`` functions run in a
# Gluon kernel); only tensors made from nothing (``arange``, ``full``,
# ``zeros``) carry the kernel's one layout. A kernel whose code would make such
# a tensor some other way (a helper building one from a shape) stays unstaged.
# The window is kept for rows that are already vector-aligned (its offset is
# then 0). Interpret mode has no Gluon: never staged there.
@dataclasses.dataclass(frozen=True)
class RowWindow:
    vec: int  # elements a vector of the narrowest row-shaped buffer
    chunks: int  # the loop's trip count over the window
    offset: sympy.Expr  # the row-shaped accesses' flat offset, xc + COLS * xr
    end: int  # the buffer's end rounded up to a vector
    staged: tuple = ()  # (buffer, dtype) of the loads staged in shared memory ([Note: staged rows])


def row_window(em, kernel: Kernel, bodies, cfg) -> RowWindow | None:
    """The aligned window of ``kernel``'s row loops ([Note: aligned row
    windows]), or None where the dialect does not write one or it would not help."""
    if not (em.ALIGNED_ROWS and heuristics.TRITON_ALIGNED_ROWS) or cfg.block_rows != 1:
        return None
    if sizes.is_symbolic((kernel.rows, kernel.cols)):
        return None
    if any(m.role == "reduction" and m.node.op in ("argmax", "argmin") for m in kernel.members):
        return None
    rows, cols = int(kernel.rows), int(kernel.cols)
    offset = sizes.simplify(XC + cols * XR)
    looped = [m for m in kernel.members if m.role in ("reduction", "rowwise")]
    row_loads = {ld.buffer: np.dtype(ld.dtype) for m in looped for ld in ir.loads(bodies[m.name])
                 if ld.buffer in em.in_refs and ld.mask is None and em.offset(ld.buffer, ld.index) == offset}
    itemsizes = [dt.itemsize for dt in row_loads.values()]
    itemsizes += [np.dtype(m.node.dtype).itemsize for m in looped
                  if m.role == "rowwise" and m.store and em.store_offset(m) == offset]
    if not itemsizes:
        return None
    vec = 16 // min(itemsizes)
    chunks = -(-(cols + vec - 1) // cfg.block_cols)
    staged = tuple(row_loads.items()) if em.STAGED_ROWS and _stages(row_loads, vec, chunks, cfg) else ()
    if (cols % vec == 0 and not staged) or cfg.block_cols % vec:
        return None  # already aligned; or a chunk is no whole number of vectors
    end = -(-(rows * cols) // vec) * vec
    if em.index_dtype_np == np.int32 and end + chunks * cfg.block_cols >= INT32_LIMIT:
        return None
    return RowWindow(vec, chunks, offset, end, staged)


def _stages(row_loads: dict, vec: int, chunks: int, cfg) -> bool:
    """Does a window over these row-shaped loads go to shared memory ([Note: staged rows])?"""
    if not row_loads or vec > 8:
        return False  # nothing to stage; 1-byte buffers (a vector wider than a chunk's lanes)
    staged_bytes = sum(chunks * cfg.block_cols * dt.itemsize for dt in row_loads.values())
    return staged_bytes <= heuristics.STAGED_ROW_MAX_BYTES


def arg_combine(em, name, v, op, acc_dt, idx_dt) -> list[str]:
    """Inside a looped argmax/argmin: each lane keeps its best value so far and
    that value's index, as jax picks: the first NaN, else the first of equal
    values (-0.0 and 0.0 are equal). A lane sees its columns in increasing
    order, so a later value replaces the kept one only if strictly better; in
    the first chunk every lane takes its value. Returns the new (value, index)."""
    better = ">" if op == "argmax" else "<"
    pick = f"({v} {better} {name}) | (chunk == 0)"
    if is_float(acc_dt):
        pick += f" | (({v} != {v}) & ({name} == {name}))"
    n = em.counter
    em.counter += 1
    em.w.line(f"pick{n} = {pick}")
    index = em.broadcast_text("xc", "(BLOCK_R, BLOCK_C)")
    if np.dtype(idx_dt) != em.index_dtype_np:
        index = em.cast_text(index, idx_dt)
    return [em.where_text(f"pick{n}", v, name), em.where_text(f"pick{n}", index, f"{name}_i")]


# --------------------------------------------------------------------------- #
# Online softmax
# --------------------------------------------------------------------------- #
# [Note: online softmax]
# A looped kernel that reduces ``M = max(row)`` and then ``S = sum(exp(A - T(M)))``
# (softmax, log_softmax, logsumexp, a cross-entropy's normalizer; ``T`` a row-level
# function of M such as jax's ``max(-inf, M)`` or logsumexp's ``M if finite else 0``)
# would read the row once per reduction. Here both share one sweep: the loop keeps,
# per row, ``m`` the running max of the finite values of A seen so far, and per lane
# ``s = sum(exp(a - m))``, rescaled by ``exp(m_old - m_new)`` when m grows (one exp
# per row per chunk; the lanes' sum is one exp per element). After the loop
# ``S = sum(s) * exp(m - T(M))``. Non-finite values of A never enter m or s: each
# lane ORs flags (1 NaN, 2 +inf, 4 -inf), and the special cases are what the direct
# sum gives: NaN if A or T(M) holds a NaN; with T(M) = +inf, NaN if A holds +inf else
# 0; with T(M) = -inf (a row of -inf under softmax), NaN if A holds -inf else +inf;
# else +inf if A holds +inf. When M's own body is A (the usual case), M is read off
# the same accumulators (NaN flag, +inf flag, else m) and costs no loop carry.
@dataclasses.dataclass(frozen=True)
class Online:
    max: str  # the max reduction member M
    shifted: ir.Expr  # A, in kernel coordinates
    shift: ir.Expr  # T(M), a row value


def row_only(expr: ir.Expr) -> bool:
    """Does ``expr`` (kernel coordinates) take one value per row (no ``xc``)?"""
    for e in ir.walk(expr):
        if isinstance(e, ir.IndexValue) and XC in sympy.sympify(e.expr).free_symbols:
            return False
        if isinstance(e, ir.Load):
            syms = set().union(*[sympy.sympify(i).free_symbols for i in e.index]) if e.index else set()
            if e.mask is not None:
                syms |= e.mask.free_symbols
            if XC in syms:
                return False
    return True


def online_plans(kernel: Kernel, bodies) -> dict:
    """Sum members of ``kernel`` of the form ``sum(exp(A - T(M)))`` (float
    converts around the exp allowed) with M a float max member of the kernel,
    T(M) a row value and A free of M: sum name -> ``Online``."""
    # T(M) may read reductions only: those of earlier phases are final when the
    # loop ends, where a row member may be written after it (write_ready_row_values).
    members = {m.name: m for m in kernel.members if m.role == "reduction"}
    maxes = {m.name for m in kernel.members
             if m.role == "reduction" and m.node.op == "max" and is_float(m.body.dtype)}
    plans = {}
    if not maxes:
        return plans
    for m in kernel.members:
        if m.role != "reduction" or m.node.op != "sum" or not is_float(m.body.dtype):
            continue
        e = bodies[m.name]
        while (isinstance(e, ir.Op) and e.op == "convert_element_type" and is_float(e.dtype)
               and is_float(e.args[0].dtype)):
            e = e.args[0]
        if not (isinstance(e, ir.Op) and e.op == "exp" and isinstance(e.args[0], ir.Op) and e.args[0].op == "sub"):
            continue
        a, t = e.args[0].args
        if not (is_float(a.dtype) and is_float(t.dtype)):
            continue
        t_reads = {ld.buffer for ld in ir.loads(t)}
        found = t_reads & maxes
        if len(found) != 1 or not t_reads <= set(members) or not row_only(t):
            continue
        (mx,) = found
        if any(ld.buffer == mx for ld in ir.loads(a)):
            continue
        plans[m.name] = Online(mx, a, t)
    return plans


def online_phases(kernel: Kernel, plans: dict):
    """``phases`` with each planned sum in its max's phase (same loop) where
    everything else it reads is final by then; returns (phase, plans kept)."""
    names = {m.name for m in kernel.members}
    phase, kept = {}, {}
    for m in kernel.members:
        deps = [ld.buffer for ld in ir.loads(m.body) if ld.buffer in names]
        plan = plans.get(m.name)
        if plan is not None:
            other = max((phase[d] + (1 if is_reduction(kernel, d) else 0) for d in deps if d != plan.max),
                        default=0)
            if other <= phase[plan.max]:
                phase[m.name] = phase[plan.max]
                kept[m.name] = plan
                continue
        phase[m.name] = max((phase[d] + (1 if is_reduction(kernel, d) else 0) for d in deps), default=0)
    return phase, kept


def online_acc_dtype(e: ir.Expr):
    return np.dtype(np.float32) if np.dtype(e.dtype).itemsize < 4 else np.dtype(e.dtype)


def online_init(em, name: str, a: ir.Expr) -> list[str]:
    w = em.w
    acc = em.dtype_text(online_acc_dtype(a))
    ninf = "float('-inf')"
    w.line(f"{name}_m = {em.tile_text('(BLOCK_R, 1)', ninf, acc)}")
    w.line(f"{name}_s = {em.zeros_text('(BLOCK_R, BLOCK_C)', acc)}")
    w.line(f"{name}_f = {em.zeros_text('(BLOCK_R, BLOCK_C)', em.dtype_text(np.int32))}")
    return [f"{name}_m", f"{name}_s", f"{name}_f"]


def online_step(em, name: str, shifted: ir.Expr) -> list[str]:
    """One chunk of the online sum of exp(A) inside the loop; returns the new carry values."""
    w, where = em.w, em.where_text
    var, ext = em.value(shifted)
    acc_dt = online_acc_dtype(shifted)
    if is_16bit_float(shifted.dtype):
        var = em.widen(var, ext)
    elif np.dtype(shifted.dtype) != acc_dt:
        var = em.bind(("cast", var, acc_dt), em.cast_text(var, acc_dt), ext)[0]
    a = em.broadcast(var, ext, FULL)
    n = f"{name}_{em.counter}"
    em.counter += 1
    ninf = "float('-inf')"
    w.line(f"{n}x = {where('cmask', a, ninf)}")
    w.line(f"{n}fin = {em.fn('is_finite', f'{n}x')}")
    w.line(f"{n}c = {where(f'{n}fin', f'{n}x', ninf)}  # finite values only")
    kind = where("cmask", where(f"{n}x != {n}x", "1", where(f"{n}x > 0", "2", "4")), "0")
    w.line(f"{n}bits = {em.cast_text(where(f'{n}fin', '0', kind), np.int32)}")
    w.line(f"{n}m = {em.maximum_text(f'{name}_m', em.plain_reduce_text('max', f'{n}c', 1))}")
    w.line(f"{n}z = {em.cast_text(where(f'{n}m == {ninf}', '0.0', f'{n}m'), acc_dt)}  # rows with no finite value yet")
    w.line(f"{n}s = {name}_s * {em.fn('exp', f'{name}_m - {n}z')} + {em.fn('exp', f'{n}c - {n}z')}")
    return [f"{n}m", f"{n}s", em.fn("or", f"{name}_f", f"{n}bits")]


def online_flags(em, name: str) -> None:
    """After the loop: does each row hold a NaN, a +inf, a -inf (any lane's bits)?"""
    for bit, flag in ((1, "nan"), (2, "pinf"), (4, "ninf")):
        em.w.line(f"{name}_{flag} = {em.plain_reduce_text('max', em.fn('and', f'{name}_f', str(bit)), 1)} > 0")


def online_max(em, name: str, mx: Member) -> None:
    """A float max over exactly A: NaN if A holds one, else +inf if it holds one,
    else the running max of its finite values (-inf if none)."""
    where = em.where_text
    text = em.cast_text(where(f"{name}_nan", "float('nan')", where(f"{name}_pinf", "float('inf')", f"{name}_m")),
                        mx.node.dtype)
    em.row_values[mx.name] = em.bind(("reduce", mx.name), text, ROW, "red")[0]


def online_sum(em, name: str, m: Member, plan: Online) -> None:
    """After the loop (the max final): S = sum(exp(A - T(M))) from the accumulators."""
    where = em.where_text
    acc_dt = online_acc_dtype(plan.shifted)
    tvar, text_ = em.value(plan.shift)
    if is_16bit_float(plan.shift.dtype):
        tvar = em.widen(tvar, text_)
    t = em.bind(("cast", tvar, acc_dt), em.cast_text(tvar, acc_dt), text_)[0]
    t = em.broadcast(t, text_, ROW)
    total = em.plain_reduce_text("sum", f"{name}_s", 1)
    fast = em.bind(("online_fast", name, t), where(f"{name}_m == float('-inf')", "0.0",
                                                   f"{total} * {em.fn('exp', f'{name}_m - {t}')}"), ROW)[0]
    nan, inf = "float('nan')", "float('inf')"
    text = where(f"{name}_nan | ({t} != {t})", nan,
                 where(f"{t} == {inf}", where(f"{name}_pinf", nan, "0.0"),
                       where(f"{t} == float('-inf')", where(f"{name}_ninf", nan, inf),
                             where(f"{name}_pinf", inf, fast))))
    em.row_values[m.name] = em.bind(("reduce", m.name), em.cast_text(text, m.node.dtype), ROW, "red")[0]
