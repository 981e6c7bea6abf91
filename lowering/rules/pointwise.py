"""Elementwise primitives: one ``ir.Op`` over the operands loaded at the same index."""
from __future__ import annotations

import numpy as np

from lowering import ir
from lowering.rules.registry import register_lowering

# Primitives whose body is ``Op(name, loaded operands)``. The renderer has one
# entry per name in its op table (codegen/pallas.py).
ELEMENTWISE = (
    # arithmetic
    "add", "sub", "mul", "div", "rem", "neg", "max", "min", "pow", "integer_pow", "square",
    "abs", "sign", "nextafter", "atan2",
    # exponential / logarithmic / special
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "erf", "erfc", "erf_inv",
    # trigonometric / hyperbolic
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    # rounding and classification
    "floor", "ceil", "round", "is_finite",
    # comparisons and selection
    "eq", "ne", "lt", "le", "gt", "ge", "select_n", "clamp",
    # logical / bitwise
    "and", "or", "not", "xor", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "population_count", "clz",
    # types
    "convert_element_type",
)

IDENTITY = ("copy", "copy_p", "stop_gradient", "optimization_barrier_identity", "reduce_precision_identity",
            "name")  # name: checkpoint_name's marker for remat policies

# Static parameters that change what an op computes; everything else
# (shardings, accuracy=None, out_dtype=None) is dropped.
_KEPT_PARAMS = {
    "integer_pow": ("y",),
    "convert_element_type": ("new_dtype",),
    "round": ("rounding_method",),
    "bitcast_convert_type": ("new_dtype",),
}


def op_params(eqn) -> tuple:
    keep = _KEPT_PARAMS.get(eqn.primitive.name, ())
    out = []
    for k in keep:
        v = eqn.params[k]
        if k == "new_dtype":
            v = np.dtype(v)
        elif k == "rounding_method":
            v = int(v)
        out.append((k, v))
    return tuple(out)


def _elementwise(ctx, eqn, *args):
    aval = eqn.outvars[0].aval
    if (eqn.primitive.name == "nextafter" and not ctx.options.interpret
            and np.dtype(aval.dtype).itemsize == 2):
        # Pallas' Triton lowering has nextafter for float32/float64 only, and a
        # 16-bit step cannot be taken in float32.
        raise NotImplementedError("16-bit nextafter on the GPU")
    folded = _plus_literal_zero(ctx, eqn, args)
    if folded is not None:
        return [folded]
    if eqn.primitive.name == "mul":
        selected = _one_hot_select(ctx, aval, args)
        if selected is not None:
            return [ctx.pointwise(aval, selected)]
    idx = ctx.symbols(len(aval.shape))
    operands = tuple(ctx.load(a, idx) for a in args)
    body = ir.Op(eqn.primitive.name, operands, np.dtype(aval.dtype), op_params(eqn))
    return [ctx.pointwise(aval, body)]


register_lowering(*ELEMENTWISE, kind="pointwise")(_elementwise)


# [Note: one-hot products]
# XLA's simplifier rewrites ``convert(pred) * x`` as ``select(pred, x, 0)``: the
# one-hot's zeros then hide x's NaN and infinities instead of making NaN of them
# (0 * inf); a cross-entropy with one_hot labels over a row with -inf logits is
# finite under jax.jit. It does so only where the convert feeds the multiply
# directly: a predicate computed at a smaller shape and broadcast (``x * (l ==
# 1)``) or transposed (``one_hot(l, n).T * x``) keeps its multiply, and so must
# pallaskit (the renderers used to rewrite any inlined convert-of-compare, and
# gave a value where jax.jit gives NaN). So the rule does it, where the graph
# still says what feeds what: ``jax.nn.one_hot``'s ``convert(iota == v)`` at the
# product's own shape. XLA:CPU computes 16-bit floats in float32 and does not see
# the convert through that (jax.jit gives NaN for bf16 there); XLA:GPU multiplies
# them natively and rewrites: in interpret mode only 32- and 64-bit products are.
def _one_hot_select(ctx, aval, args) -> ir.Expr | None:
    """``select(pred, x, 0)`` for a product of a one-hot ``convert(pred)`` and
    ``x`` ([Note: one-hot products]), or None."""
    dt = np.dtype(aval.dtype)
    if not (dt.kind == "f" or dt.name == "bfloat16") or (ctx.options.interpret and dt.itemsize == 2):
        return None
    shape = tuple(aval.shape)
    idx = ctx.symbols(len(shape))
    for i, a in enumerate(args):
        pred = _one_hot_predicate(ctx, a, shape)
        other = args[1 - i]
        if pred is not None and ctx.aval_of(other) == (shape, dt):
            return ir.Op("select_n", (ctx.load(pred, idx), ir.Const(0.0, dt), ctx.load(other, idx)), dt)
    return None


def _one_hot_predicate(ctx, value, shape) -> str | None:
    """The predicate ``value`` converts, where ``value`` is ``convert(iota == v)``
    computed at ``shape`` (``jax.nn.one_hot``), or None."""
    node = ctx.nodes.get(value) if isinstance(value, str) else None
    if not (isinstance(node, ir.Pointwise) and tuple(node.shape) == shape and isinstance(node.body, ir.Op)
            and node.body.op == "convert_element_type" and isinstance(node.body.args[0], ir.Load)):
        return None
    pred = ctx.nodes.get(node.body.args[0].buffer)
    if not (isinstance(pred, ir.Pointwise) and tuple(pred.shape) == shape and pred.dtype == np.bool_
            and isinstance(pred.body, ir.Op) and pred.body.op == "eq"):
        return None
    if not any(isinstance(ctx.inlined(a), ir.IndexValue) for a in pred.body.args):
        return None
    return pred.name


def _plus_literal_zero(ctx, eqn, args):
    """``x + 0.0`` as ``x``, as XLA's simplifier folds it (A + 0 => A, also where 0 is
    a broadcast constant): jax.jit keeps x's -0.0 where IEEE's -0.0 + 0.0 is +0.0
    (Python's ``sum(xs)`` starts at 0, accumulators at ``jnp.zeros``). None where
    the add stays."""
    aval = eqn.outvars[0].aval
    dt = np.dtype(aval.dtype)
    if eqn.primitive.name != "add" or not (dt.kind == "f" or dt.name == "bfloat16"):  # ints: x + 0 is x anyway
        return None
    for zero, x in (args, args[::-1]):
        if _is_zero(ctx, zero) and not _is_zero(ctx, x) and ctx.aval_of(x) == (tuple(aval.shape), dt):
            return x
    return None


def _is_zero(ctx, value) -> bool:
    """A literal 0, or an array of it (``jnp.zeros``: a broadcast literal)."""
    if isinstance(value, ir.Const):
        return value.value == 0
    node = ctx.nodes.get(value)
    return isinstance(node, ir.Pointwise) and isinstance(node.body, ir.Const) and node.body.value == 0


@register_lowering(*IDENTITY, kind="pointwise", note="identity")
def _identity(ctx, eqn, x):
    return [x]


@register_lowering("reduce_precision", kind="pointwise", note="identity at a 32/64-bit float's own precision")
def _reduce_precision(ctx, eqn, x):
    # jax.checkpoint's policies put reduce_precision at the dtype's own bits on saved residuals; a 32/64-bit
    # float kernel holds exactly that precision, a 16-bit one computes in float32 and would have to round
    dtype = np.dtype(eqn.outvars[0].aval.dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise NotImplementedError(f"reduce_precision of {dtype}")
    info = np.finfo(dtype)
    if (eqn.params["exponent_bits"], eqn.params["mantissa_bits"]) != (info.nexp, info.nmant):
        raise NotImplementedError("reduce_precision below the dtype's precision")
    return [x]


@register_lowering("add_any", kind="pointwise", note="add (autodiff's cotangent sum)")
def _add_any(ctx, eqn, x, y):
    aval = eqn.outvars[0].aval
    idx = ctx.symbols(len(aval.shape))
    return [ctx.pointwise(aval, ir.Op("add", (ctx.load(x, idx), ctx.load(y, idx)), np.dtype(aval.dtype)))]


@register_lowering("one_minus_square", kind="pointwise", note="(1 + x) * (1 - x); jax >= 0.11 (tanh's derivative)")
def _one_minus_square(ctx, eqn, x):
    # Written as XLA writes it, (1 + x) * (1 - x): it is exact near |x| = 1,
    # where 1 - x * x loses the low bits.
    aval = eqn.outvars[0].aval
    dtype = np.dtype(aval.dtype)
    idx = ctx.symbols(len(aval.shape))
    v = ctx.load(x, idx)
    one = ir.Const(1.0, dtype)
    body = ir.Op("mul", (ir.Op("add", (one, v), dtype), ir.Op("sub", (one, v), dtype)), dtype)
    return [ctx.pointwise(aval, body)]


@register_lowering("bitcast_convert_type", kind="pointwise", note="32-bit to 32-bit (random floats' bits)")
def _bitcast(ctx, eqn, x):
    # 16-bit floats live in float32 inside kernels (emitter.UPCAST_16BIT) and
    # other widths change the shape: those run through XLA.
    src, out = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
    if src.itemsize != 4 or out.itemsize != 4 or np.bool_ in (src, out):
        raise NotImplementedError("bitcast_convert_type other than 32-bit to 32-bit")
    return _elementwise(ctx, eqn, x)
