"""Elementwise primitives: one ``ir.Op`` over the operands loaded at the same index."""
from __future__ import annotations

import numpy as np
import sympy

from lowering import ir, sizes
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


# Written for float32 only (codegen/pallas.py's and codegen/triton.py's helpers).
_FLOAT32_ONLY = ("erf", "erfc", "erf_inv")


def _elementwise(ctx, eqn, *args):
    aval = eqn.outvars[0].aval
    if (eqn.primitive.name == "nextafter" and not ctx.options.interpret
            and np.dtype(aval.dtype).itemsize == 2):
        # Pallas' Triton lowering has nextafter for float32/float64 only, and a
        # 16-bit step cannot be taken in float32.
        raise NotImplementedError("16-bit nextafter on the GPU")
    if eqn.primitive.name in _FLOAT32_ONLY and np.dtype(aval.dtype) == np.float64:
        # The renderers' erf / erfc / erf_inv are XLA's float32 polynomials (7 digits); XLA
        # computes float64 with its double-precision expansions.
        raise NotImplementedError(f"float64 {eqn.primitive.name}")
    folded = _plus_literal_zero(ctx, eqn, args)
    if folded is not None:
        return [folded]
    idx = ctx.symbols(len(aval.shape))
    masked = _mul_by_converted_predicate(ctx, eqn, args, idx)
    if masked is not None:
        return [ctx.pointwise(aval, masked)]
    operands = tuple(ctx.load(a, idx) for a in args)
    body = ir.Op(eqn.primitive.name, operands, np.dtype(aval.dtype), op_params(eqn))
    return [ctx.pointwise(aval, body)]


register_lowering(*ELEMENTWISE, kind="pointwise")(_elementwise)


def _mul_by_converted_predicate(ctx, eqn, args, idx):
    """``x * convert(pred)`` as ``select(pred, x, 0)``, as XLA's simplifier rewrites
    it where the convert of a predicate at the product's own shape feeds the multiply
    (a mask: ``x * (y > 0)``, ``loss * mask``), also through reshapes and transposes
    of the converted mask: the False entries are +0.0 whatever x holds (inf, NaN,
    negative). A predicate broadcast before or after its convert
    (``x * (y[:, :1] > 0)``, a scalar) keeps its multiply, as in XLA, and so does
    bfloat16 in interpret mode (``ir.rewrites_mask_products``; the renderers'
    ``emitter.mul_by_converted_bool`` takes the one-hots this leaves). None where it
    is no such product."""
    aval = eqn.outvars[0].aval
    dtype = np.dtype(aval.dtype)
    if eqn.primitive.name != "mul" or not ir.rewrites_mask_products(dtype, ctx.options.interpret):
        return None
    for k, value in enumerate(args):
        if ctx.aval_of(args[1 - k])[1] != dtype:
            continue
        if isinstance(value, ir.Const):
            continue
        read = ctx.load(value, idx)  # the operand's element, followed back to the convert's
        node = ctx.nodes.get(value)
        for _ in range(4):  # through reshapes and transposes of the converted mask (XLA moves them)
            if not (isinstance(node, ir.Pointwise) and isinstance(node.body, ir.Load) and node.body.mask is None
                    and not _is_broadcast(ctx, node.name)):
                break
            read = ir.substitute_index(node.body, dict(zip(node.symbols, read.index)))
            node = ctx.nodes.get(read.buffer)
        if not (isinstance(node, ir.Pointwise) and isinstance(node.body, ir.Op)
                and node.body.op == "convert_element_type" and np.dtype(node.body.args[0].dtype) == np.bool_
                and _same_numel(node.shape, aval.shape)):
            continue
        pred = node.body.args[0]
        if isinstance(pred, ir.Load) and _is_broadcast(ctx, pred.buffer):
            continue
        pred = ir.substitute_index(pred, dict(zip(node.symbols, read.index)))
        return ir.mask_select(pred, ctx.load(args[1 - k], idx))
    return None


def _is_broadcast(ctx, value) -> bool:
    """``value`` reads fewer elements than it holds: a broadcast (XLA moves a
    convert before it, and the broadcast then blocks the select rewrite). With
    symbolic sizes, any load not provably of as many elements counts as one."""
    node = ctx.nodes.get(value)
    if not (isinstance(node, ir.Pointwise) and isinstance(node.body, ir.Load)):
        return False
    return not _same_numel(ctx.aval_of(node.body.buffer)[0], node.shape)


def _same_numel(a, b) -> bool:
    """Do shapes ``a`` and ``b`` hold as many elements? Symbolic sizes ([Note:
    symbolic dims] in lowering/symbolic.py) only where provably so."""
    return sizes.simplify(sympy.sympify(sizes.numel(a) - sizes.numel(b))) == 0


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


@register_lowering("eq_to", "le_to", "lt_to", kind="pointwise",
                   note="total order (jnp.searchsorted, sort comparators): integers as eq / le / lt, float32 "
                        "compared as sign-magnitude-flipped int32 bits (16-bit and 64-bit floats: XLA)")
def _total_order(ctx, eqn, x, y):
    """XLA's TOTALORDER comparison: -NaN < -inf < ... < -0.0 < +0.0 < ... < +inf < +NaN,
    NaNs ordered by their bits. Integers and bools compare as they do in ``eq`` / ``le`` /
    ``lt``. A float becomes its int32 bits with the magnitude bits flipped where the sign
    bit is set, ``b ^ ((b >> 31) & 0x7FFFFFFF)``, which orders as a signed int in total
    order. Other floats run through XLA: a GPU widens every 16-bit NaN to one canonical
    NaN, whose order against another NaN is then lost."""
    aval = eqn.outvars[0].aval
    dt = np.dtype(eqn.invars[0].aval.dtype)
    op = {"eq_to": "eq", "le_to": "le", "lt_to": "lt"}[eqn.primitive.name]
    is_float = dt.kind == "f" or dt.name == "bfloat16"
    if (is_float and dt != np.float32) or (not is_float and dt.kind not in "iub"):
        # 16-bit: a GPU's widening to float32 makes every NaN one canonical NaN (their order lost)
        raise NotImplementedError(f"a total-order comparison of {dt.name}")
    idx = ctx.symbols(len(aval.shape))
    a, b = ctx.load(x, idx), ctx.load(y, idx)
    if is_float:
        i32 = np.dtype(np.int32)

        def key(v):
            bits = ir.Op("bitcast_convert_type", (v,), i32, (("new_dtype", i32),))
            sign = ir.Op("shift_right_arithmetic", (bits, ir.Const(31, i32)), i32)
            return ir.Op("xor", (bits, ir.Op("and", (sign, ir.Const(0x7FFFFFFF, i32)), i32)), i32)

        a, b = key(a), key(b)
    return [ctx.pointwise(aval, ir.Op(op, (a, b), np.dtype(aval.dtype)))]
