"""Windowed reductions (pooling) as pointwise nodes.

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

``select_and_scatter_add`` (max pooling's gradient) stays with XLA. As
kernels (per window the element XLA's sequential fold of ``ge`` selects, then
each operand element summing the sources of the windows that selected it;
commit da5072c) it ran 4-5x slower than XLA's on the H100: 1.81 against
0.46 ms (float32), 2.89 against 0.57 (bfloat16) for a 3 x 3, stride-2 pool of
64 x 112 x 112 x 64 (benchmarks/RESULTS.md, "Session 38"). A scatter from the
window grid would do less work; not written.
"""
from __future__ import annotations

import math

import numpy as np
import sympy

from lowering import ir, sizes, split
from lowering.rules.registry import register_lowering

MAX_WINDOW = 64  # elements folded in one body; beyond, XLA's reduce-window
BOOL = np.dtype(np.bool_)


def _trivial(window, strides, padding, base_dilation, window_dilation):
    """Per dim: does the window leave it alone (extent 1, stride 1, no padding or dilation)?
    Such a dim (a batch or channel axis) is read at the output's own index, any size."""
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
    if cond is sympy.true:
        return load
    return ir.Op("select_n", (ir.IndexValue(cond, BOOL), ident, load), load.dtype)


@register_lowering("reduce_window_sum", "reduce_window_max", "reduce_window_min", kind="pointwise",
                   note="a fold over at most 64 window elements (pooling)")
def _reduce_window(ctx, eqn, x):
    reduction = {"reduce_window_sum": "sum", "reduce_window_max": "max", "reduce_window_min": "min"}[eqn.primitive.name]
    op = "add" if reduction == "sum" else reduction
    aval = eqn.outvars[0].aval
    in_shape = tuple(eqn.invars[0].aval.shape)
    p = eqn.params
    _static(_trivial(p["window_dimensions"], p["window_strides"], p["padding"], p["base_dilation"],
                     p["window_dilation"]), in_shape, aval.shape)
    dt = np.dtype(aval.dtype)
    if op == "add" and dt == BOOL:
        raise NotImplementedError("reduce_window_sum of bools")
    ident = split.identity(reduction, dt)
    out = ctx.symbols(len(aval.shape))
    body = ident
    for k in _offsets(p["window_dimensions"]):
        load, cond = _window_load(ctx, x, in_shape, out, k, p["window_strides"], p["padding"], p["base_dilation"],
                                  p["window_dilation"])
        if cond is not sympy.false:  # a window offset that only ever reads padding adds the identity
            body = ir.Op(op, (body, _or_identity(load, cond, ident)), dt)
    return [ctx.pointwise(aval, body)]
