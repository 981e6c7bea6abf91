"""Indexing by run-time values: gather, scatter-add, dynamic_slice,
dynamic_update_slice. Each is a ``Pointwise`` node whose loads read at indices
holding loaded values ([Note: indirect indexing] in ir.py), so it fuses with
its producers and consumers like a view.

Out-of-bounds indices follow the primitive's ``mode`` (``GatherScatterMode``):
``CLIP`` and ``PROMISE_IN_BOUNDS`` clamp each start into the operand, as XLA
does; ``FILL_OR_DROP`` gives a gather's ``fill_value`` for a slice whose start
is out of bounds, and drops a scatter's whole update window whose start is out
of bounds (XLA's scatter semantics), as jax does. dynamic_slice and
dynamic_update_slice clamp their starts so the slice fits. Negative indices are
normalised by jnp in the jaxpr, before the primitive.

Scatters (add, mul, min, max, set) are written densely: each output element
applies the updates that land on it, in update order, over the update
positions that can reach it (deterministic; a set's last update wins), where
there are few of those (``MAX_SCATTER_TERMS``: the gradient of
``take_along_axis`` has one per element). A scatter with more (an embedding's
gradient, ``segment_sum`` / ``segment_max``, a histogram, a mask set at many
ids) is a ``Scatter`` node, atomics over the updates' domain in raw Triton
([Note: atomic scatters] in ir.py); where raw Triton does not run, it runs
through XLA.
"""
from __future__ import annotations

import itertools
import math

import jax
import numpy as np
import sympy

from lowering import executors, heuristics, ir, sizes
from lowering.rules.registry import register_lowering

I32 = np.dtype(np.int32)
BOOL = np.dtype(bool)

# A dense scatter unrolls one select per update position that can reach an
# output element; past this many it runs through XLA.
MAX_SCATTER_TERMS = 8


def _mode(params) -> str:
    m = params.get("mode")
    name = getattr(m, "name", str(m))
    return name.rsplit(".", 1)[-1].upper()


def _int(n) -> int:
    """A bound that becomes a constant of the kernel: symbolic ones run through XLA."""
    if sizes.is_symbolic(n):
        raise NotImplementedError("an indexed dimension of symbolic size")
    return int(n)


def _whole_window(n, w) -> bool:
    """Is a window of size ``w`` over a dim of size ``n`` the whole of a dynamic dim?"""
    return sizes.is_symbolic(w) and not sizes.is_symbolic(n - w) and int(n - w) == 0


def _const(v, dt) -> ir.Const:
    return ir.Const(int(v), np.dtype(dt))


def _as_index(v: ir.Expr) -> ir.Expr:
    """An integer index value in a dtype that holds every bound below (int32
    for narrow ints; 32- and 64-bit ones keep theirs, so a huge uint32 or int64
    is not wrapped before it is compared)."""
    dt = np.dtype(v.dtype)
    if dt == BOOL or dt.itemsize < 4:
        return ir.Op("convert_element_type", (v,), I32, (("new_dtype", I32),))
    if dt.kind not in "iu":
        raise NotImplementedError(f"index dtype {dt}")
    return v


def _to_i32(v: ir.Expr) -> ir.Expr:
    return v if v.dtype == I32 else ir.Op("convert_element_type", (v,), I32, (("new_dtype", I32),))


def _clamped(v: ir.Expr, hi: int) -> ir.Expr:
    """``v`` clamped into [0, hi], as int32."""
    dt = np.dtype(v.dtype)
    return _to_i32(ir.Op("clamp", (_const(0, dt), v, _const(hi, dt)), dt))


def _in_range(v: ir.Expr, hi: int) -> ir.Expr:
    """0 <= v <= hi, as a bool value."""
    dt = np.dtype(v.dtype)
    le = ir.Op("le", (v, _const(hi, dt)), BOOL)
    if dt.kind == "u":
        return le
    return ir.Op("and", (ir.Op("ge", (v, _const(0, dt)), BOOL), le), BOOL)


def _all(conds):
    out = None
    for c in conds:
        out = c if out is None else ir.Op("and", (out, c), BOOL)
    return out


def _default_fill(dt):
    """jax's fill for an out-of-bounds gather when ``fill_value`` is None."""
    dt = np.dtype(dt)
    if dt == BOOL:
        return True
    if dt.kind == "f" or dt.name == "bfloat16":
        return float("nan")
    if dt.kind == "i":
        return int(np.iinfo(dt).min)
    if dt.kind == "u":
        return int(np.iinfo(dt).max)
    raise NotImplementedError(f"gather fill of {dt}")


# --------------------------------------------------------------------------- #
# gather
# --------------------------------------------------------------------------- #
@register_lowering("gather", kind="view",
                   note="loads at run-time indices (take_along_axis, table[ids], x[idx], take); modes clip / fill")
def _gather(ctx, eqn, operand, indices):
    dn = eqn.params["dimension_numbers"]
    slice_sizes = tuple(eqn.params["slice_sizes"])
    op_shape, idx_shape = tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)
    aval = eqn.outvars[0].aval
    if isinstance(indices, ir.Const) or not idx_shape:
        raise NotImplementedError("gather with literal or 0-d indices")
    mode = _mode(eqn.params)
    offset_dims = tuple(dn.offset_dims)
    collapsed = tuple(dn.collapsed_slice_dims)
    start_map = tuple(dn.start_index_map)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch_dims = tuple(getattr(dn, "start_indices_batching_dims", ()))
    out = ctx.symbols(len(aval.shape))
    batch = [out[p] for p in range(len(aval.shape)) if p not in offset_dims]  # one per indices dim but the last
    offset_of = dict(zip([d for d in range(len(op_shape)) if d not in collapsed and d not in op_batch],
                         [out[p] for p in offset_dims]))
    index, oks = [], []
    for d in range(len(op_shape)):
        if d in op_batch:
            index.append(batch[idx_batch_dims[op_batch.index(d)]])
            continue
        o = offset_of.get(d, sympy.Integer(0))
        if d not in start_map:
            index.append(o)
            continue
        v = _as_index(ctx.load(indices, tuple(batch) + (start_map.index(d),)))
        hi = _int(op_shape[d] - slice_sizes[d])
        index.append(ir.indirect_index(_clamped(v, hi)) + o)
        if mode == "FILL_OR_DROP":
            oks.append(_in_range(v, hi))
    body = ctx.load(operand, tuple(index))
    if oks:
        fill = eqn.params.get("fill_value")
        # jax's fill is full_like(out, fill_value): NumPy's cast of the Python value (-7 is 249 as
        # a uint8, 300 is 44 as an int8, 2.7 is 2)
        fill = _default_fill(body.dtype) if fill is None else np.asarray(fill).astype(body.dtype).item()
        fill = ir.Const(bool(fill) if body.dtype == BOOL else fill, body.dtype)
        body = ir.Op("select_n", (_all(oks), fill, body), body.dtype)
    return [ctx.pointwise(aval, body)]


# --------------------------------------------------------------------------- #
# dynamic_slice / dynamic_update_slice
# --------------------------------------------------------------------------- #
def _start(ctx, s, hi: int):
    """A start index clamped into [0, hi]: an int, or an int32 value."""
    if isinstance(s, ir.Const):
        return min(max(int(s.value), 0), hi)
    return _clamped(_as_index(ctx.load(s, ())), hi)


def _window(ctx, syms, starts, shape, window) -> tuple:
    """The operand's index of a window's position ``syms``: each start clamped so
    the window fits (``window``: its sizes), plus the position."""
    index = []
    for o, s, n, k in zip(syms, starts, shape, window):
        st = _start(ctx, s, _int(n - k))
        index.append(o + (st if isinstance(st, int) else ir.indirect_index(st)))
    return tuple(index)


@register_lowering("dynamic_slice", kind="view", note="loads at clamped run-time starts")
def _dynamic_slice(ctx, eqn, x, *starts):
    shape = tuple(eqn.invars[0].aval.shape)
    aval = eqn.outvars[0].aval
    if len(starts) != len(shape):
        raise NotImplementedError("dynamic_slice with dynamic sizes")
    out = ctx.symbols(len(shape))
    return [ctx.pointwise(aval, ctx.load(x, _window(ctx, out, starts, shape, eqn.params["slice_sizes"])))]


@register_lowering("dynamic_update_slice", kind="pointwise", note="select between operand and update at clamped starts")
def _dynamic_update_slice(ctx, eqn, x, update, *starts):
    shape, ushape = tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)
    aval = eqn.outvars[0].aval
    if _updates_in_place(ctx, eqn, x, update, starts):
        return [_update_in_place(ctx, eqn, x, update, starts)]
    out = ctx.symbols(len(shape))
    index, conds, masks = [], [], []
    for o, s, n, u in zip(out, starts, shape, ushape):
        st = _start(ctx, s, _int(n - u))
        u = _int(u)
        if isinstance(st, int):  # a literal start: a static window, as pad's
            index.append(o - st)
            masks += [sympy.Ge(o, st), sympy.Lt(o, st + u)]
            continue
        rel = ir.Op("sub", (ir.IndexValue(o, I32), st), I32)
        conds.append(_in_range(rel, u - 1))
        index.append(ir.indirect_index(_clamped(rel, u - 1)))
    mask = sympy.And(*masks)
    upd = ctx.load(update, tuple(index), mask=None if mask is sympy.true else mask)
    if mask is not sympy.true:
        conds.append(ir.IndexValue(mask, BOOL))
    cond = _all(conds)
    body = upd if cond is None else ir.Op("select_n", (cond, ctx.load(x, out), upd), upd.dtype)
    return [ctx.pointwise(aval, body)]


# [Note: updates in place in loop bodies]
# Inside a loop body, a dynamic_update_slice usually writes one step's slice
# into a buffer the loop carries (``out = out.at[i].set(row)`` in a
# ``fori_loop``). The dense form rewrites the whole buffer each step; there it
# is a ``Scatter`` node combining by "set" over the update's domain instead,
# whose raw-Triton launch aliases the buffer to its output (the buffer is dead
# after the update: XLA writes in place, or copies it first where it is not).
# Not where the update or a start reads the buffer (``buf.at[buf[i, 0]].set(row)``:
# each program computes the start itself, and would read it half written by
# the others), nor for bools.
def _updates_in_place(ctx, eqn, x, update, starts) -> bool:
    avals = (eqn.invars[0].aval, eqn.invars[1].aval)
    return (ctx.in_loop_body and isinstance(x, str) and executors.wants_triton("scatter", ctx.options)
            and not any(sizes.is_symbolic(d) for a in avals for d in a.shape) and all(avals[1].shape)
            and np.dtype(avals[0].dtype) != BOOL and not any(_reads(ctx, v, x) for v in (update, *starts)))


def _update_in_place(ctx, eqn, x, update, starts) -> str:
    shape, ushape = tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)
    dt = np.dtype(eqn.outvars[0].aval.dtype)
    u = ctx.symbols(len(ushape))
    target = ctx.load(x, _window(ctx, u, starts, shape, ushape))
    body = ir.Op("scatter", (target, ctx.load(update, u), ir.Const(True, BOOL)), dt)
    return ctx.scatter(shape, dt, x, body, ushape, "set")


# --------------------------------------------------------------------------- #
# scatter-add, scatter-mul, scatter-min, scatter-max, scatter
# --------------------------------------------------------------------------- #
_COMBINE = {"scatter-add": "add", "scatter-mul": "mul", "scatter-min": "min", "scatter-max": "max", "scatter": None}


def _combiner(eqn) -> str | None:
    """How an update meets the element: the op of the primitive (None: replaces
    it). An update computation other than that op (``lax.scatter_apply``) runs
    through XLA."""
    op = _COMBINE[eqn.primitive.name]
    jaxpr = eqn.params.get("update_jaxpr")
    if jaxpr is None:
        if op is None:
            return None
        raise NotImplementedError("scatter without its update computation")
    eqns = getattr(jaxpr, "eqns", None)
    if op is None or eqns is None or len(eqns) != 1 or len(jaxpr.invars) != 2:
        raise NotImplementedError("scatter with an update computation of its own")
    name = eqns[0].primitive.name
    if name == "add_any":
        name = "add"
    if name != op or list(eqns[0].invars) != list(jaxpr.invars):
        raise NotImplementedError(f"scatter combining with {name}")
    return op


@register_lowering("scatter-add", "scatter-mul", "scatter-min", "scatter-max", "scatter", kind="pointwise",
                   note="dense: each element applies the few updates that can reach it, in order; with more: "
                        "atomics in raw Triton (else XLA)")
def _scatter(ctx, eqn, operand, indices, updates):
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape = tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)
    upd_shape = tuple(eqn.invars[2].aval.shape)
    aval = eqn.outvars[0].aval
    if isinstance(indices, ir.Const) or not idx_shape or eqn.params.get("update_consts"):
        raise NotImplementedError("scatter with literal or 0-d indices")
    combine = _combiner(eqn)
    mode = _mode(eqn.params)
    window_dims = tuple(dn.update_window_dims)
    inserted = tuple(dn.inserted_window_dims)
    to_operand = tuple(dn.scatter_dims_to_operand_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch_dims = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    scatter_upd_dims = [p for p in range(len(upd_shape)) if p not in window_dims]  # one per indices dim but the last
    window_operand_dims = [d for d in range(len(op_shape)) if d not in inserted and d not in op_batch]
    window_size = {d: upd_shape[p] for d, p in zip(window_operand_dims, window_dims)}
    free = [j for j in range(len(idx_shape) - 1) if j not in idx_batch_dims]
    terms = _int(math.prod(idx_shape[j] for j in free))
    if terms > MAX_SCATTER_TERMS:
        return [_atomic_scatter(ctx, eqn, operand, indices, updates, mode, combine or "set")]
    out = ctx.symbols(len(op_shape))
    dt = np.dtype(aval.dtype)
    acc = ctx.load(operand, out)
    for combo in itertools.product(*[range(idx_shape[j]) for j in free]):
        at = dict(zip(free, combo))
        jidx = []  # the indices' batch coordinate of this term
        for j in range(len(idx_shape) - 1):
            jidx.append(out[op_batch[idx_batch_dims.index(j)]] if j in idx_batch_dims else sympy.Integer(at[j]))
        hits, win = [], {}
        for d in range(len(op_shape)):
            if d in op_batch:
                continue
            if _whole_window(op_shape[d], window_size.get(d, 1)):
                # A window over all of a dynamic dim (the rows of a take_along_axis's gradient
                # under a dynamic batch): every position is in it, at its own index.
                if d in to_operand and mode != "CLIP":  # XLA drops a window that does not start at 0
                    hits.append(_in_range(_as_index(ctx.load(indices, tuple(jidx) + (to_operand.index(d),))), 0))
                win[d] = out[d]
                continue
            w = _int(window_size.get(d, 1))
            hi = _int(op_shape[d] - w)
            if d in to_operand:
                v = _as_index(ctx.load(indices, tuple(jidx) + (to_operand.index(d),)))
                if mode != "CLIP":  # XLA drops a window whose start is out of bounds
                    hits.append(_in_range(v, hi))
                start = _clamped(v, hi)
            else:
                start = ir.Const(0, I32)
            rel = ir.Op("sub", (ir.IndexValue(out[d], I32), start), I32)
            # a one-element window: the position itself (one compare an element, not four ops)
            hits.append(ir.Op("eq", (ir.IndexValue(out[d], I32), start), BOOL) if w == 1 else _in_range(rel, w - 1))
            if d in window_size:
                win[d] = ir.indirect_index(_clamped(rel, w - 1))
        uidx = [None] * len(upd_shape)
        for j, p in enumerate(scatter_upd_dims):
            uidx[p] = jidx[j]
        for d, p in zip(window_operand_dims, window_dims):
            uidx[p] = win[d]
        u = ctx.load(updates, tuple(uidx))
        new = u if combine is None else ir.Op(combine, (acc, u), dt)
        acc = ir.Op("select_n", (_all(hits), acc, new), dt)
    return [ctx.pointwise(aval, acc)]


# [Note: atomic scatters] in ir.py: the dtypes raw Triton combines atomically
# (32- and 64-bit: tl.atomic_add / max / min / cas on sm_90), and the 32-bit
# scratch where a narrower one combines (none has atomics, or none in Triton's
# interpreter): 16-bit floats in float32 (a sum or product rounded once at the
# end; heuristics.ATOMIC_16BIT_IN_FLOAT32 says why a sum too), narrow ints and
# bools in int32 / uint32 (a wrapped sum or product truncates to the same
# value; a max or min converts exactly). A set stores any of these as it is
# (not float8 and the like, which raw Triton does not load or store).
_ATOMIC_DTYPES = frozenset({"float32", "float64", "int32", "uint32", "int64", "uint64"})
_SCRATCH = {"float16": "float32", "bfloat16": "float32", "int8": "int32", "int16": "int32", "uint8": "uint32",
            "uint16": "uint32", "bool": "int32"}


def _scratch_dtype(combine: str, dt: np.dtype, options) -> np.dtype:
    """The dtype an atomic scatter of ``dt`` combines in (``_SCRATCH``)."""
    if dt.name in _ATOMIC_DTYPES or combine == "set" and dt.name in _SCRATCH:
        return dt
    if dt.name not in _SCRATCH or combine == "set" or (combine == "add" and dt == BOOL):
        raise NotImplementedError(f"an atomic scatter-{combine} of {dt.name}")
    if combine == "add" and dt.name in ("float16", "bfloat16") and not heuristics.ATOMIC_16BIT_IN_FLOAT32 \
            and not options.interpret:
        return dt  # 16-bit float atomic adds on the GPU (the interpreter has none)
    return np.dtype(_SCRATCH[dt.name])


def _deterministic(combine: str, dt: np.dtype, eqn, constant_update: bool) -> bool:
    """Does the atomic scatter give the same bits whatever order its updates
    land in ([Note: atomic scatters] in ir.py)? Integer and bool combiners (a
    wrapped sum or product, a max, a min) and a float max / min (a total
    order) do; a float sum or product rounds in that order; a set where
    indices repeat keeps whichever update lands last, unless the indices are
    unique or every update is the same value."""
    if combine == "set":
        return bool(eqn.params.get("unique_indices")) or constant_update
    return combine in ("max", "min") or not (dt.kind == "f" or dt.name == "bfloat16")


def _constant(ctx, value) -> bool:
    """A literal, or a kernel value that is one everywhere (a broadcast literal)."""
    if isinstance(value, ir.Const):
        return True
    node = ctx.nodes.get(value)
    return isinstance(node, ir.Pointwise) and isinstance(node.body, ir.Const)


def _one_nan(v: ir.Expr, negative: bool) -> ir.Expr:
    """``v`` with each NaN replaced by the quiet NaN whose sign bit is set
    (``negative``) or clear: the atomic max / min of a float orders NaNs by
    that bit ([Note: atomic scatters] in ir.py)."""
    dt = np.dtype(v.dtype)
    bits = np.dtype(f"int{8 * dt.itemsize}")
    nan = int(np.array(np.nan, dt).view(bits))  # the positive quiet NaN's bits
    if negative:
        nan -= 1 << (8 * dt.itemsize - 1)  # its sign bit set, as a signed int
    nan = ir.Op("bitcast_convert_type", (ir.Const(nan, bits),), dt, (("new_dtype", dt),))
    return ir.Op("select_n", (ir.Op("ne", (v, v), BOOL), v, nan), dt)


def _reads(ctx, value, buffer: str) -> bool:
    """Can ``value``, with the pointwise producers the scheduler may inline
    into the scatter's kernel, read ``buffer``?"""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if not isinstance(v, str) or v in seen:
            continue
        if v == buffer:
            return True
        seen.add(v)
        node = ctx.nodes.get(v)
        if isinstance(node, ir.Pointwise):
            stack += [ld.buffer for ld in ir.loads(node.body)]
    return False


def _atomic_scatter(ctx, eqn, operand, indices, updates, mode: str, combine: str) -> str:
    """A scatter with many updates per element as a ``Scatter`` node ([Note:
    atomic scatters] in ir.py): the operand, then each update combined
    atomically at its destination. The index logic is the dense rule's:
    ``CLIP`` clamps a window's start into the operand, other modes drop a
    window whose start is out of bounds. Runs through XLA where raw Triton
    does not run the kernel, and under ``deterministic_scatter`` where the
    result would depend on the order the updates land in."""
    options = ctx.options
    name = eqn.primitive.name
    if not executors.wants_triton("scatter", options):
        raise NotImplementedError(f"an atomic {name} without raw Triton")
    dn = eqn.params["dimension_numbers"]
    op_shape = tuple(_int(d) for d in eqn.invars[0].aval.shape)
    _int(math.prod(eqn.invars[1].aval.shape))  # the indices' dims become kernel constants too
    upd_shape = tuple(_int(d) for d in eqn.invars[2].aval.shape)
    aval = eqn.outvars[0].aval
    dt = np.dtype(aval.dtype)
    if isinstance(operand, ir.Const) or not all(op_shape) or not all(upd_shape):
        raise NotImplementedError(f"an atomic {name} of a literal or empty operand")
    acc = _scratch_dtype(combine, dt, options)
    if options.deterministic_scatter and not _deterministic(combine, dt, eqn, _constant(ctx, updates)):
        raise NotImplementedError(f"an atomic {name} of {dt.name} under deterministic_scatter")
    window_dims = tuple(dn.update_window_dims)
    to_operand = tuple(dn.scatter_dims_to_operand_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch_dims = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    inserted = tuple(dn.inserted_window_dims)
    scatter_upd_dims = [p for p in range(len(upd_shape)) if p not in window_dims]  # one per indices dim but the last
    window_of = dict(zip([d for d in range(len(op_shape)) if d not in inserted and d not in op_batch], window_dims))
    u = ctx.symbols(len(upd_shape))
    jidx = tuple(u[p] for p in scatter_upd_dims)  # the indices' batch coordinate of update position u
    index, oks = [], []
    for d in range(len(op_shape)):
        if d in op_batch:
            index.append(jidx[idx_batch_dims[op_batch.index(d)]])
            continue
        off = u[window_of[d]] if d in window_of else sympy.Integer(0)
        if d not in to_operand:
            index.append(off)
            continue
        hi = op_shape[d] - (upd_shape[window_of[d]] if d in window_of else 1)
        v = _as_index(ctx.load(indices, jidx + (to_operand.index(d),)))
        if mode != "CLIP":  # XLA drops a window whose start is out of bounds
            oks.append(_in_range(v, hi))
        index.append(ir.indirect_index(_clamped(v, hi)) + off)
    one_nan = combine in ("max", "min") and acc.kind == "f"
    # The launch updates the operand's buffer in place: where the updates or the indices read it
    # (``x.at[p].set(x)``, ``y.at[i].add(v * y[i])``), other programs would read it half updated. A copy.
    read = _reads(ctx, updates, operand) or _reads(ctx, indices, operand)
    if acc != dt or one_nan or read:  # the operand's copy: in the scratch's dtype, its NaNs of one sign
        start = ctx.load(operand, ctx.symbols(len(op_shape)))
        if acc != dt:
            start = ir.Op("convert_element_type", (start,), acc, (("new_dtype", acc),))
        operand = ctx.pointwise(jax.core.ShapedArray(op_shape, acc),
                                _one_nan(start, combine == "min") if one_nan else start)
    update = ctx.load(updates, u)
    if update.dtype != acc:
        update = ir.Op("convert_element_type", (update,), acc, (("new_dtype", acc),))
    if one_nan:
        update = _one_nan(update, combine == "min")
    target = ctx.load(operand, tuple(index))
    ok = _all(oks) if oks else ir.Const(True, BOOL)
    out = ctx.scatter(op_shape, acc, operand, ir.Op("scatter", (target, update, ok), acc), upd_shape, combine)
    if acc == dt:
        return out
    return ctx.pointwise(aval, ctx.load(out, ctx.symbols(len(op_shape))))
