"""Reductions over one or more axes: ``ir.Reduction`` nodes."""
from __future__ import annotations

import numpy as np

from lowering import ir, sizes
from lowering.rules.registry import register_lowering

_OPS = {
    "reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
    "reduce_and": "and", "reduce_or": "or", "argmax": "argmax", "argmin": "argmin",
}


@register_lowering(*(p for p in _OPS if p not in ("reduce_and", "reduce_or")), kind="reduction")
@register_lowering("reduce_and", "reduce_or", kind="reduction", note="bools (bitwise, of ints: XLA)")
def _reduce(ctx, eqn, x):
    return _reduce_axes(ctx, eqn, x, _OPS[eqn.primitive.name], eqn.params["axes"])


# [Note: positional collectives]
# ``jax.vmap(f, axis_name='batch')`` of a ``lax.psum(x, 'batch')`` (equinox's and
# haiku's BatchNorm over a vmapped batch, ``axis_name=`` in flax) batches the named
# axis into a positional one: the jaxpr holds ``psum[axes=(0,)]``, which jax lowers
# as ``reduce_sum`` over those axes, and its transpose ``psum[axes=()]``, an identity.
# pmax / pmin likewise reduce_max / reduce_min. A named axis left (shard_map) or
# replica groups stay collectives, for XLA.
@register_lowering("psum", "pmax", "pmin", kind="reduction", note="positional axes only (vmap's batched axis names)")
def _positional_collective(ctx, eqn, x):
    axes = eqn.params["axes"]
    if eqn.params.get("axis_index_groups") is not None or not all(isinstance(a, int) for a in axes):
        raise NotImplementedError(f"{eqn.primitive.name} over a named axis")
    return _reduce_axes(ctx, eqn, x, {"psum": "sum", "pmax": "max", "pmin": "min"}[eqn.primitive.name], axes)


def _reduce_axes(ctx, eqn, x, op: str, axes):
    out_aval = eqn.outvars[0].aval
    in_shape = tuple(eqn.invars[0].aval.shape)
    axes = tuple(sorted(int(a) for a in axes))
    if not axes:
        return [x]
    kept = [d for k, d in enumerate(in_shape) if k not in axes]
    reduced = tuple(in_shape[a] for a in axes)
    i_syms = ctx.symbols(len(kept))
    r_syms = ctx.symbols(len(reduced), prefix="r")
    it_i, it_r = iter(i_syms), iter(r_syms)
    domain_index = tuple(next(it_r) if k in axes else next(it_i) for k in range(len(in_shape)))
    if op in ("and", "or") and np.dtype(eqn.invars[0].aval.dtype) != np.bool_:
        # reduce_and / reduce_or of an int are bitwise (jnp.bitwise_and.reduce); the kernels'
        # and / or reductions are min / max over 0 / 1 (bools only)
        raise NotImplementedError(f"bitwise {eqn.primitive.name} of {np.dtype(eqn.invars[0].aval.dtype).name}")
    if op in ("argmax", "argmin"):
        # An index dtype too narrow for the axis (lax.argmax(x, 1, jnp.uint8) over 300 columns):
        # XLA's reducer compares the wrapped indices, so of tied values at 5 and 260 it returns
        # 260's (4); the kernels pick the first position and wrap it after (5)
        index = np.dtype(out_aval.dtype)
        if index.itemsize < 4 and any(sizes.is_symbolic(in_shape[a]) or int(in_shape[a]) > np.iinfo(index).max + 1
                                      for a in axes):
            raise NotImplementedError(f"{eqn.primitive.name} with {index.name} indices that wrap")
    if sizes.numel(reduced) == 1:
        # Reducing extent-1 axes (what autodiff's broadcast transposes produce)
        # is a pointwise copy, so it fuses like one.
        if op in ("argmax", "argmin"):
            return [ctx.pointwise(out_aval, ir.Const(0, np.dtype(out_aval.dtype)))]
        return [ctx.pointwise(out_aval, ctx.load(x, tuple(0 if k in axes else s for k, s in
                                                          zip(range(len(in_shape)), domain_index))))]
    if op == "sum" and len(axes) == 1 and not sizes.is_symbolic(reduced[0]):
        picked = _one_hot_pick(ctx, x, domain_index, domain_index[axes[0]], int(reduced[0]))
        if picked is not None:
            return [ctx.pointwise(out_aval, picked)]
    body = ctx.load(x, domain_index)
    return [ctx.reduction(out_aval, body, reduced=reduced, axes=axes, op=op)]


# [Note: one-hot picks]
# ``sum(one_hot(labels, n) * x, axis)`` (a cross-entropy with one-hot labels, its
# gradient's ``sum(where(iota == label, g, 0))``) adds n - 1 zeros to one value:
# it is ``x`` at ``label``. Where the summed operand is ``select(iota == idx, x,
# 0)`` along the reduced axis (or ``convert(iota == idx) * x``, which XLA's
# simplifier and the renderers make that select: ``mul_by_converted_bool`` in
# codegen/emitter.py, whose conditions apply here too), with ``idx`` not depending on the reduced
# index (and an iota that does not wrap over the axis), the sum is
# ``x[..., idx, ...]`` where idx is in range and 0 elsewhere:
# exactly the sum's value (every other lane is +0: a picked -0.0 sums to +0.0, and
# is picked as +0.0). So is ``f(select(...))`` for an ``f`` that keeps a zero zero
# (negation, a product or quotient by a finite constant: a gradient's -1 / N),
# picked as ``f(x[..., idx, ...])`` (its other terms are then -0.0 where f
# negates: their sum from XLA's +0.0 start is +0.0, as picked; XLA:GPU's own
# reduction sometimes returns -0.0 for such a row). The reduction becomes a
# pointwise gather, and a row kernel loses a sweep's worth of work per element.
def _one_hot_pick(ctx, x, domain_index, r, n: int) -> ir.Expr | None:
    """The one-hot sum of ``x`` over the index ``r`` (extent ``n``) as one
    gathered value ([Note: one-hot picks]), or None where it is no such sum."""
    from lowering.codegen.emitter import mul_by_converted_bool
    from lowering.rules.gather import _as_index, _clamped, _in_range

    node = ctx.nodes.get(x)
    if not (isinstance(node, ir.Pointwise) and isinstance(node.body, ir.Op)):
        return None
    body = ctx.inlined(ir.substitute_index(node.body, dict(zip(node.symbols, domain_index))), depth=12)
    outer = []  # ops around the select that keep its zeros zero (a gradient's negation, its 1 / N)
    while isinstance(body, ir.Op) and body.op != "select_n":
        selected = mul_by_converted_bool(body, ctx.options.interpret)  # a one-hot product: the renderers' select
        if selected is not None:
            body = selected
        elif body.op == "neg":
            outer.append(body)
            body = body.args[0]
        elif body.op in ("mul", "div") and ir.is_finite_const(body.args[1]) and (body.op == "mul" or body.args[1].value):
            outer.append(body)
            body = body.args[0]
        elif body.op == "mul" and ir.is_finite_const(body.args[0]):
            outer.append(ir.Op("mul", (body.args[1], body.args[0]), body.dtype, body.params))
            body = body.args[1]
        else:
            return None
    if not (isinstance(body, ir.Op) and len(body.args) == 3):
        return None
    pred, zero, value = body.args
    while isinstance(zero, ir.Op) and zero.op == "convert_element_type":  # jnp.where's 0.0, converted
        zero = zero.args[0]
    if not (isinstance(zero, ir.Const) and float(zero.value) == 0.0 and np.dtype(pred.dtype) == np.bool_
            and isinstance(pred, ir.Op) and pred.op == "eq"):
        return None
    for here, other in (pred.args, pred.args[::-1]):
        if (isinstance(here, ir.IndexValue) and sizes.simplify(here.expr - r) == 0 and _holds(here.dtype, n - 1)
                and np.dtype(other.dtype).kind in "iu" and r not in ir._index_free_symbols(other)):
            idx = _as_index(other)
            picked = ir.substitute_index(value, {r: ir.indirect_index(_clamped(idx, n - 1))})
            for op in reversed(outer):
                picked = ir.Op(op.op, (picked,) + op.args[1:], op.dtype, op.params)
            dt = np.dtype(picked.dtype)
            z = ir.Const(0, dt)
            # +0.0 for a picked zero of either sign, as the sum gives (``picked + 0`` would be folded
            # by XLA:CPU's simplifier in interpret mode)
            picked = ir.Op("select_n", (ir.Op("eq", (picked, z), np.dtype(np.bool_)), picked, z), dt)
            return ir.Op("select_n", (_in_range(idx, n - 1), z, picked), dt)
    return None


def _holds(dt, hi: int) -> bool:
    """Does an iota of dtype ``dt`` count to ``hi`` without wrapping? (An int8 iota
    over 300 positions matches a label at two of them: no single pick.)"""
    dt = np.dtype(dt)
    return dt.kind in "iu" and np.iinfo(dt).max >= hi
