"""Shape primitives. Each is a ``Pointwise`` node whose body loads its operand at
a mapped index, so the scheduler folds it into index expressions by inlining;
nothing is copied unless a view is an output."""
from __future__ import annotations

import numpy as np
import sympy

from lowering import ir, sizes, symbolic
from lowering.rules.registry import register_lowering


def _view(ctx, eqn, x, in_index, mask=None, other=None, xla=False):
    """``xla``: a reshape or permutation XLA may run itself between XLA ops
    (``ir.Pointwise.view``); not in a symbolic graph, whose params XLA can't take."""
    aval = eqn.outvars[0].aval
    body = ctx.load(x, tuple(in_index), mask=mask)
    if mask is not None:
        cond = ir.IndexValue(mask, np.dtype(bool))
        body = ir.Op("select_n", (cond, other, body), body.dtype)
    view = (eqn.primitive, dict(eqn.params)) if xla and not isinstance(eqn, symbolic.EqnView) else None
    return ctx.pointwise(aval, body, view=view)


def _in_shape(eqn, k=0):
    return tuple(eqn.invars[k].aval.shape)


@register_lowering("reshape", kind="view")
def _reshape(ctx, eqn, x):
    if eqn.params.get("dimensions") is not None:
        raise NotImplementedError("reshape with dimensions")
    out = ctx.symbols(len(eqn.outvars[0].aval.shape))
    linear = sizes.ravel(out, eqn.outvars[0].aval.shape)
    return [_view(ctx, eqn, x, sizes.unravel(linear, _in_shape(eqn)), xla=True)]


@register_lowering("transpose", kind="view")
def _transpose(ctx, eqn, x):
    perm = eqn.params["permutation"]
    out = ctx.symbols(len(perm))
    idx = [None] * len(perm)
    for k, p in enumerate(perm):
        idx[p] = out[k]
    return [_view(ctx, eqn, x, idx, xla=True)]


@register_lowering("broadcast_in_dim", kind="view")
def _broadcast_in_dim(ctx, eqn, x):
    shape = eqn.params["shape"]
    out = ctx.symbols(len(shape))
    in_shape = _in_shape(eqn)
    idx = [sympy.Integer(0) if in_shape[j] == 1 else out[d]
           for j, d in enumerate(eqn.params["broadcast_dimensions"])]
    return [_view(ctx, eqn, x, idx)]


@register_lowering("squeeze", kind="view")
def _squeeze(ctx, eqn, x):
    in_shape = _in_shape(eqn)
    dims = {d % len(in_shape) for d in eqn.params["dimensions"]}
    out = iter(ctx.symbols(len(in_shape) - len(dims)))
    idx = [sympy.Integer(0) if k in dims else next(out) for k in range(len(in_shape))]
    return [_view(ctx, eqn, x, idx, xla=True)]


@register_lowering("expand_dims", kind="view")
def _expand_dims(ctx, eqn, x):
    out_shape = eqn.outvars[0].aval.shape
    dims = {d % len(out_shape) for d in eqn.params["dimensions"]}
    out = ctx.symbols(len(out_shape))
    return [_view(ctx, eqn, x, [out[k] for k in range(len(out_shape)) if k not in dims], xla=True)]


@register_lowering("slice", kind="view")
def _slice(ctx, eqn, x):
    starts = eqn.params["start_indices"]
    strides = eqn.params["strides"] or (1,) * len(starts)
    out = ctx.symbols(len(starts))
    return [_view(ctx, eqn, x, [s + o * st for s, o, st in zip(starts, out, strides)])]


@register_lowering("rev", kind="view")
def _rev(ctx, eqn, x):
    in_shape = _in_shape(eqn)
    out = ctx.symbols(len(in_shape))
    dims = set(eqn.params["dimensions"])
    return [_view(ctx, eqn, x, [in_shape[k] - 1 - o if k in dims else o for k, o in enumerate(out)])]


@register_lowering("tile", kind="view", note="each index modulo the operand's extent (jnp.tile)")
def _tile(ctx, eqn, x):
    in_shape = _in_shape(eqn)
    out = ctx.symbols(len(in_shape))
    return [_view(ctx, eqn, x, [o if r == 1 or d == 0 else sizes.mod(o, d)
                                for o, d, r in zip(out, in_shape, eqn.params["reps"])])]


@register_lowering("pad", kind="view", note="masked load + select")
def _pad(ctx, eqn, x, value):
    in_shape = _in_shape(eqn)
    out = ctx.symbols(len(in_shape))
    idx, conds = [], []
    for o, d, (lo, _hi, interior) in zip(out, in_shape, eqn.params["padding_config"]):
        step = interior + 1
        shifted = o - lo
        i = shifted if step == 1 else sizes.FloorDiv(shifted, step)
        idx.append(i)
        conds += [sympy.Ge(shifted, 0), sympy.Le(shifted, (d - 1) * step)]
        if step != 1:
            conds.append(sympy.Eq(sizes.mod(shifted, step), 0))
    mask = sympy.And(*conds)
    pad_value = ctx.load(value, ())
    if mask is sympy.true:
        return [_view(ctx, eqn, x, idx)]
    return [_view(ctx, eqn, x, idx, mask=mask, other=pad_value)]


@register_lowering("concatenate", kind="view", note="select over masked loads")
def _concatenate(ctx, eqn, *xs):
    dim = eqn.params["dimension"]
    aval = eqn.outvars[0].aval
    out = ctx.symbols(len(aval.shape))
    o = out[dim]
    offsets, acc = [], 0
    for k in range(len(xs)):
        offsets.append(acc)
        acc += eqn.invars[k].aval.shape[dim]
    body = None
    for k in reversed(range(len(xs))):
        idx = list(out)
        idx[dim] = o - offsets[k]
        lo, hi = offsets[k], offsets[k] + eqn.invars[k].aval.shape[dim]
        if eqn.invars[k].aval.shape[dim] == 0:
            continue
        if body is None:
            body = ctx.load(xs[k], tuple(idx), mask=sympy.Ge(o, lo) if lo > 0 else None)
            continue
        cond = sympy.Lt(o, hi)
        mask = sympy.And(sympy.Ge(o, lo), cond) if lo > 0 else cond
        this = ctx.load(xs[k], tuple(idx), mask=mask)
        body = ir.Op("select_n", (ir.IndexValue(cond, np.dtype(bool)), body, this), body.dtype)
    return [ctx.pointwise(aval, body)]


@register_lowering("stack", kind="view", note="select over loads")
def _stack(ctx, eqn, *xs):
    # jnp.stack binds its own primitive in newer jax (no concatenate of expand_dims): operand k at index k of
    # the new axis, every operand loaded at the other indices
    aval = eqn.outvars[0].aval
    axis = eqn.params["axis"] % len(aval.shape)
    out = ctx.symbols(len(aval.shape))
    o = out[axis]
    idx = tuple(out[:axis]) + tuple(out[axis + 1:])
    body = ctx.load(xs[-1], idx)
    for k in reversed(range(len(xs) - 1)):
        cond = ir.IndexValue(sympy.Eq(o, k), np.dtype(bool))
        body = ir.Op("select_n", (cond, body, ctx.load(xs[k], idx)), body.dtype)
    return [ctx.pointwise(aval, body)]


@register_lowering("unstack", kind="view")
def _unstack(ctx, eqn, x):
    axis = eqn.params["axis"] % len(_in_shape(eqn))
    outs = []
    for k, v in enumerate(eqn.outvars):
        sym = list(ctx.symbols(len(v.aval.shape)))
        outs.append(ctx.pointwise(v.aval, ctx.load(x, tuple(sym[:axis] + [sympy.Integer(k)] + sym[axis:]))))
    return outs


@register_lowering("split", kind="view")
def _split(ctx, eqn, x):
    axis = eqn.params["axis"]
    outs, start = [], 0
    for v in eqn.outvars:
        shape = v.aval.shape
        sym = ctx.symbols(len(shape))
        idx = list(sym)
        idx[axis] = sym[axis] + start
        outs.append(ctx.pointwise(v.aval, ctx.load(x, tuple(idx))))
        start += shape[axis]
    return outs


@register_lowering("iota", kind="view")
def _iota(ctx, eqn):
    aval = eqn.outvars[0].aval
    out = ctx.symbols(len(aval.shape))
    body = ir.IndexValue(out[eqn.params["dimension"]], np.dtype(aval.dtype))
    return [ctx.pointwise(aval, body)]


@register_lowering("empty2", kind="view",
                   note="an uninitialized scalar (a differentiated cond's placeholder for another branch's "
                        "residual): zero, as XLA lowers it")
def _empty2(ctx, eqn):
    aval = eqn.outvars[0].aval
    dtype = np.dtype(aval.dtype)  # a key's extended dtype raises TypeError: it runs through XLA
    return [ctx.pointwise(aval, ir.Const(dtype.type(0).item(), dtype))]


@register_lowering("dim_as_value", kind="view",
                   note="a symbolic dim used as a value (``x.shape[0]`` under dynamic dims): the size itself")
def _dim_as_value(ctx, eqn):
    aval = eqn.outvars[0].aval
    dim = eqn.params["dim"]
    return [ctx.pointwise(aval, ir.IndexValue(sympy.sympify(dim), np.dtype(aval.dtype)))]
