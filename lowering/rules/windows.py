"""Windowed reductions (pooling) and max pooling's gradient as pointwise nodes.

[Note: pooling windows]
``reduce_window_sum`` / ``_max`` / ``_min`` (avg_pool's sum, max_pool, and the
sum's transpose, which pads the cotangent and sums it again) are, per output
element, a fold over the window's elements: the reduction's identity where the
window reads padding or a base dilation's hole, the operand elsewhere. A window
of at most ``MAX_WINDOW`` elements is a pointwise node whose body folds its
loads in row-major window order from the identity, as XLA's reduce-window
emitter does; a larger one (global pooling) stays with XLA. A dim the window
leaves alone (extent 1, stride 1, no padding or dilation: batch and channels)
is read at the output's own index, so it may be symbolic (a dynamic batch);
a window over a symbolic extent stays with XLA.

``select_and_scatter_add`` (max pooling's gradient) runs on the CPU and the
GPU as jax lowers it there: the operand padded with the select's identity
(``-inf`` for ``ge``), then per window a sequential fold that keeps the
selected element while ``select(selected, next)`` holds (XLA's
SelectAndScatter; its expander's reduce-window does the same), and each
window's source added into the selected position, windows in row-major
order. With NaN the fold's choice is the last NaN when it ends the window,
else the first extreme of the elements after the last NaN (``ge(NaN, x)`` and
``ge(x, NaN)`` are both false). Three nodes on the window grid (the last NaN,
the extreme after it, the selected offset), then one over the operand that
adds, for each window offset in reverse row-major order (so windows come in
row-major order), the source of the window that starts there where that
window selected this offset.
"""
from __future__ import annotations

import math

import jax
import numpy as np
import sympy

from lowering import ir, sizes
from lowering.rules.registry import register_lowering

MAX_WINDOW = 64  # elements folded in one body; beyond, XLA's reduce-window
I32, BOOL = np.dtype(np.int32), np.dtype(np.bool_)


def _identity(op: str, dt: np.dtype):
    if op == "add":
        return False if dt == BOOL else 0
    lowest = op == "max"
    if dt.kind == "f" or dt.name == "bfloat16":
        return float("-inf") if lowest else float("inf")
    if dt == BOOL:
        return not lowest
    info = np.iinfo(dt)
    return int(info.min if lowest else info.max)


def _trivial(window, strides, padding, base_dilation=None, window_dilation=None):
    """Per dim: does the window leave it alone (extent 1, stride 1, no padding or dilation)?
    Such a dim (a batch or channel axis) is read at the output's own index, any size."""
    base_dilation = base_dilation or (1,) * len(window)
    window_dilation = window_dilation or (1,) * len(window)
    return tuple(w == 1 and s == 1 and tuple(pd) == (0, 0) and b == 1 and wd == 1
                 for w, s, pd, b, wd in zip(window, strides, padding, base_dilation, window_dilation))


def _static(trivial, *shapes) -> None:
    """Symbolic extents (dynamic dims) only along dims the window leaves alone."""
    if any(sizes.is_symbolic(d) and not t for s in shapes for d, t in zip(s, trivial)):
        raise NotImplementedError("a window over a symbolic extent")


def _offsets(window):
    """Window offsets in row-major order."""
    if math.prod(window) > MAX_WINDOW:
        raise NotImplementedError(f"a window of {math.prod(window)} elements (over {MAX_WINDOW})")
    return list(np.ndindex(*window))


def _window_load(ctx, x, in_shape, out_syms, k, strides, padding, base_dilation, window_dilation):
    """The operand element that window offset ``k`` of output ``out_syms`` reads:
    (load, sympy condition that it is no padding or hole)."""
    idx, conds = [], []
    for o, kk, n, s, (lo, hi), b, wd in zip(out_syms, k, in_shape, strides, padding, base_dilation, window_dilation):
        if (s, lo, hi, b) == (1, 0, 0, 1) and kk == 0:
            idx.append(o)  # the window's first row along an unpadded, unstrided dim: never out of range (any size)
            continue
        pos = o * s + (int(kk) if isinstance(kk, (int, np.integer)) else kk) * wd - lo  # base-dilated, unpadded
        conds += [sympy.Ge(pos, 0), sympy.Le(pos, (n - 1) * b)]
        if b != 1:
            conds.append(sympy.Eq(sizes.mod(pos, b), 0))
            pos = sizes.FloorDiv(pos, b)
        idx.append(pos)
    cond = sympy.And(*conds)
    if cond is sympy.false:
        return None, cond
    return ctx.load(x, tuple(idx), mask=None if cond is sympy.true else cond), cond


def _or_identity(load, cond, ident: ir.Const):
    if cond is sympy.false:
        return ident
    if cond is sympy.true:
        return load
    return ir.Op("select_n", (ir.IndexValue(cond, BOOL), ident, load), load.dtype)


@register_lowering("reduce_window_sum", "reduce_window_max", "reduce_window_min", kind="pointwise",
                   note="a fold over at most 64 window elements (pooling)")
def _reduce_window(ctx, eqn, x):
    op = {"reduce_window_sum": "add", "reduce_window_max": "max", "reduce_window_min": "min"}[eqn.primitive.name]
    aval = eqn.outvars[0].aval
    in_shape = tuple(eqn.invars[0].aval.shape)
    p = eqn.params
    _static(_trivial(p["window_dimensions"], p["window_strides"], p["padding"], p["base_dilation"],
                     p["window_dilation"]), in_shape, aval.shape)
    dt = np.dtype(aval.dtype)
    if op == "add" and dt == BOOL:
        raise NotImplementedError("reduce_window_sum of bools")
    ident = ir.Const(_identity(op, dt), dt)
    out = ctx.symbols(len(aval.shape))
    body = ident
    for k in _offsets(p["window_dimensions"]):
        load, cond = _window_load(ctx, x, in_shape, out, k, p["window_strides"], p["padding"], p["base_dilation"],
                                  p["window_dilation"])
        if cond is not sympy.false:  # a window offset that only ever reads padding adds the identity
            body = ir.Op(op, (body, _or_identity(load, cond, ident)), dt)
    return [ctx.pointwise(aval, body)]


@register_lowering("select_and_scatter_add", kind="pointwise",
                   note="max / min pooling's gradient: windows of at most 64 elements")
def _select_and_scatter_add(ctx, eqn, source, operand):
    p = eqn.params
    select = p["select_prim"].name
    if select not in ("ge", "le"):
        raise NotImplementedError(f"select_and_scatter_add selecting by {select}")
    extreme = "max" if select == "ge" else "min"
    window, strides, padding = tuple(p["window_dimensions"]), tuple(p["window_strides"]), tuple(p["padding"])
    in_shape = tuple(eqn.invars[1].aval.shape)
    grid = tuple(eqn.invars[0].aval.shape)
    trivial = _trivial(window, strides, padding)
    _static(trivial, in_shape, grid)
    dt = np.dtype(eqn.invars[1].aval.dtype)
    src_dt = np.dtype(eqn.invars[0].aval.dtype)
    if dt == BOOL or src_dt == BOOL:
        raise NotImplementedError("select_and_scatter_add of bools")
    size = len(_offsets(window))
    ones = (1,) * len(window)
    ident = ir.Const(_identity(extreme, dt), dt)
    floating = dt.kind == "f" or dt.name == "bfloat16"
    nd = len(grid)

    def i32(v):
        return ir.Const(int(v), I32)

    def over_window(out_dtype, op, make_body):
        """A reduction over the window's elements (axis ``nd`` of the domain, row-major offset ``r``)."""
        syms, (r,) = ctx.symbols(nd), ctx.symbols(1, prefix="r")
        k = sizes.unravel(r, window)
        x = _or_identity(*_window_load(ctx, operand, in_shape, syms, k, strides, padding, ones, ones), ident)
        body = make_body(syms, r, x)
        return ctx.reduction(jax.ShapeDtypeStruct(grid, out_dtype), body, reduced=(size,), axes=(nd,), op=op)

    def after_nan(syms, r):
        if last_nan is None:
            return None
        return ir.Op("lt", (ctx.load(last_nan, tuple(syms)), ir.IndexValue(r, I32)), BOOL)

    def key(syms, r, x):
        later = after_nan(syms, r)
        return x if later is None else ir.Op("select_n", (later, ident, x), dt)

    # the window's last NaN (-1: none); the first extreme after it; where that is
    last_nan = over_window(I32, "max", lambda syms, r, x: ir.Op(
        "select_n", (ir.Op("ne", (x, x), BOOL), i32(-1), ir.IndexValue(r, I32)), I32)) if floating else None
    arg = over_window(I32, "arg" + extreme, key)
    syms = ctx.symbols(nd)
    chosen = ctx.load(arg, tuple(syms))
    if floating:
        # no element after the last NaN beats the identity (none there, or all of them -inf):
        # the fold keeps the first element after the last NaN, or the NaN that ends the window
        best = over_window(dt, extreme, key)
        first_after = ir.Op("min", (ir.Op("add", (ctx.load(last_nan, tuple(syms)), i32(1)), I32), i32(size - 1)), I32)
        at_identity = ir.Op("eq", (ctx.load(best, tuple(syms)), ident), BOOL)
        chosen = ir.Op("select_n", (at_identity, chosen, first_after), I32)
    selected = ctx.pointwise(jax.ShapeDtypeStruct(grid, I32), chosen)

    # each window offset in reverse row-major order: the windows holding a position come in row-major order
    aval = eqn.outvars[0].aval
    pos = ctx.symbols(len(in_shape))
    zero = ir.Const(0, src_dt)
    body = zero
    for n, k in reversed(list(enumerate(np.ndindex(*window)))):
        idx, conds = [], []
        for q, kk, s_, (lo, _hi), g, alone in zip(pos, k, strides, padding, grid, trivial):
            if alone:
                idx.append(q)  # a dim the window leaves alone: the window at this position's own index
                continue
            start = q + lo - int(kk)  # where the window holding this position at offset kk starts
            conds += [sympy.Ge(start, 0), sympy.Le(start, (g - 1) * s_)]
            if s_ != 1:
                conds.append(sympy.Eq(sizes.mod(start, s_), 0))
                start = sizes.FloorDiv(start, s_)
            idx.append(start)
        cond = sympy.And(*conds)
        if cond is sympy.false:
            continue
        mask = None if cond is sympy.true else cond
        hit = ir.Op("eq", (ctx.load(selected, tuple(idx), mask=mask), i32(n)), BOOL)
        if mask is not None:
            hit = ir.Op("and", (ir.IndexValue(cond, BOOL), hit), BOOL)
        body = ir.Op("add", (body, ir.Op("select_n", (hit, zero, ctx.load(source, tuple(idx), mask=mask)), src_dt)),
                     src_dt)
    return [ctx.pointwise(aval, body)]
