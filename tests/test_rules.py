"""Op-info-style table test of every lowering rule against ``jax.jit``.

``TABLE`` holds one small ``OpInfo`` entry per tested use of a primitive: the
function, an input generator, the dtypes and shapes to run, and a tolerance.
``test_op`` runs every (entry, dtype, shape) case through ``pallaskit.jit`` and
``jax.jit`` on fresh seeded random inputs, compares the results, and checks with
``pallaskit.explain`` that the primitive was really lowered by a rule (no XLA
fallback, at least one generated kernel). ``test_every_rule_has_an_entry``
fails when a rule in ``lowering.rules.RULES`` has no entry.

Cases that fail because of a compiler bug are marked ``xfail(strict=True)``
in the table (``OpInfo.xfail``) with a one-line reason.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jex_core

import pallaskit
from lowering.rules import RULES

F32, BF16, I32, BOOL = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.int32), np.dtype(np.bool_)
FLOAT = (F32, BF16)
INT = (I32,)
NUM = FLOAT + INT
LOGIC = (BOOL, I32)

# Default shapes: a size-1 dimension, non-power-of-two extents. Everything stays
# well under ~4000 elements (interpret mode is slow).
SHAPES = ((5, 1, 37), (3, 50))
# The default: (5, 1, 37) only. For the entries that take it, pallaskit renders the
# same program at (3, 50) but for extents (elementwise ops: one flat row; checked
# for every such entry and dtype when this default was made); entries whose
# kernels depend on the shape (transpose, slices, pads, scatters, ...) ask for SHAPES.
ONE_SHAPE = SHAPES[:1]
WITH_SCALAR = ONE_SHAPE + ((),)
RED_SHAPES = ((5, 1, 37), (6, 7, 19))

# (rtol, atol) per tolerance class for float outputs; ints and bools are always exact.
TOLS = {
    "default": {F32: (1e-5, 1e-5), BF16: (2e-2, 2e-2)},
    "trans": {F32: (2e-4, 1e-5), BF16: (2e-2, 2e-2)},  # erf, cbrt, pow, tan, erf_inv...
    # jax lowers bf16 exp2 as exp(ln2 * x) with the product rounded to bf16: a relative
    # error of |x ln2| * 2**-8 that the kernel (which computes in float32) does not make.
    "amplified": {F32: (2e-5, 1e-5), BF16: (5e-2, 2e-2)},
    "sum": {F32: (1e-5, 5e-5), BF16: (2e-2, 2e-2)},  # reductions: summation order differs
    "exact": None,  # data movement, rounding, comparisons, min/max, conversions: bit-exact
}


@dataclasses.dataclass(frozen=True)
class OpInfo:
    name: str  # unique entry name (the test id prefix)
    prim: str  # the RULES key this entry exercises; must appear in fn's jaxpr
    fn: Callable
    gen: Callable  # (rng, shape, dtype) -> list of numpy arrays (the arguments)
    dtypes: tuple = FLOAT
    shapes: tuple = ONE_SHAPE
    tol: str = "default"
    allow_nonfinite: bool = False  # reference may hold inf/nan (else it must be finite)
    xfail: tuple = ()  # ((dtype or None, shape or None, reason), ...): None matches all
    skip: str = ""  # why every case is skipped on this jax (a primitive it does not have)
    options: tuple = ()  # ((name, value), ...): pallaskit config for this entry
    dynamic: dict | None = None  # pallaskit.jit's dynamic=: traced with symbolic dims (tests/test_dynamic.py)


# --------------------------------------------------------------------------- #
# Input generators. A leaf takes (rng, shape, dtype) and returns one array of
# that dtype; ``args`` combines leaves into an argument list.
# --------------------------------------------------------------------------- #
def _isfloat(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)  # bfloat16's numpy kind is "V", not "f"


def _as(a, dtype):
    return np.asarray(a).astype(dtype)


def uniform(lo, hi, ilo=-100, ihi=100):
    """Floats in [lo, hi) for float dtypes; ints in [ilo, ihi) for int dtypes."""
    def g(rng, shape, dtype):
        if dtype == BOOL:
            return rng.random(shape) < 0.5
        if dtype.kind in "iu":
            return _as(rng.integers(ilo, ihi, size=shape), dtype)
        return _as(rng.uniform(lo, hi, size=shape), dtype)
    return g


def signed(lo, hi, ilo=1, ihi=10):
    """Magnitude in [lo, hi) (ints: [ilo, ihi)) with a random sign: never zero."""
    mag = uniform(lo, hi, ilo, ihi)

    def g(rng, shape, dtype):
        s = np.where(rng.random(shape) < 0.5, -1, 1)
        return _as(s * mag(rng, shape, dtype).astype(np.float64 if _isfloat(dtype) else np.int64), dtype)
    return g


def normal(scale=1.0, ilo=-100, ihi=100):
    def g(rng, shape, dtype):
        if dtype == BOOL:
            return rng.random(shape) < 0.5
        if dtype.kind in "iu":
            return _as(rng.integers(ilo, ihi, size=shape), dtype)
        return _as(rng.normal(0.0, scale, size=shape), dtype)
    return g


def full_int32(rng, shape, dtype):
    return _as(rng.integers(np.iinfo(np.int32).min, np.iinfo(np.int32).max, size=shape, endpoint=True), dtype)


def bools(p_true=0.5):
    def g(rng, shape, dtype=None):
        return rng.random(shape) < p_true
    return g


def logic(rng, shape, dtype):
    return bools()(rng, shape) if dtype == BOOL else full_int32(rng, shape, dtype)


def with_zeros(leaf, frac=0.2):
    def g(rng, shape, dtype):
        a = leaf(rng, shape, dtype)
        return np.where(rng.random(shape) < frac, np.zeros((), dtype), a).astype(dtype)
    return g


def with_nonfinite(leaf, frac=0.15):
    def g(rng, shape, dtype):
        a = leaf(rng, shape, dtype).astype(np.float64)
        specials = rng.choice(np.array([np.inf, -np.inf, np.nan]), size=shape)
        return _as(np.where(rng.random(shape) < frac, specials, a), dtype)
    return g


def halves(rng, shape, dtype):
    """Exact .5 ties (k/2) mixed with random fractions, for rounding."""
    k = rng.integers(-40, 41, size=shape) / 2.0
    noise = np.where(rng.random(shape) < 0.5, 0.0, rng.uniform(-0.45, 0.45, size=shape))
    return _as(k + noise, dtype)


def args(*leaves):
    def g(rng, shape, dtype):
        return [leaf(rng, shape, dtype) for leaf in leaves]
    return g


def tied_pair(leaf, p_tie=0.3, nan=False):
    """(x, y) where y equals x in ~30% of places (and optionally holds NaNs)."""
    def g(rng, shape, dtype):
        x = leaf(rng, shape, dtype)
        y = np.where(rng.random(shape) < p_tie, x, leaf(rng, shape, dtype)).astype(dtype)
        if nan and _isfloat(dtype):
            x = np.where(rng.random(shape) < 0.1, np.nan, x).astype(dtype)
            y = np.where(rng.random(shape) < 0.1, np.nan, y).astype(dtype)
        return [x, y]
    return g


def fixed_dtype(leaf, dt):
    def g(rng, shape, dtype):
        return leaf(rng, shape, np.dtype(dt))
    return g


# --------------------------------------------------------------------------- #
# The table
# --------------------------------------------------------------------------- #
TABLE: list[OpInfo] = []


def op(name, prim, fn, gen, dtypes=FLOAT, **kw):
    TABLE.append(OpInfo(name, prim, fn, gen, tuple(np.dtype(d) for d in dtypes), **kw))


N2 = args(normal(2.0), normal(2.0))

# -- arithmetic ---------------------------------------------------------------
op("add", "add", lax.add, N2, NUM, shapes=WITH_SCALAR)
op("add_bcast", "add", lambda x, y: x + y,
   lambda rng, s, d: [normal(2.0)(rng, s, d), normal(2.0)(rng, s[-1:], d)], NUM)
op("sub", "sub", lax.sub, N2, NUM)
op("mul", "mul", lax.mul, N2, NUM, shapes=WITH_SCALAR)
op("mul_literal", "mul", lambda x: x * 3, args(normal(2.0)), NUM)
op("div", "div", lax.div, args(normal(3.0, -1000, 1000), signed(0.25, 4.0, 1, 13)), NUM, shapes=WITH_SCALAR)
op("rem", "rem", lax.rem, args(normal(5.0, -1000, 1000), signed(0.3, 3.0, 1, 13)), NUM)
op("neg", "neg", lax.neg, args(normal(2.0)), NUM, tol="exact")
op("max", "max", lax.max, tied_pair(normal(2.0)), NUM, tol="exact")
op("min", "min", lax.min, tied_pair(normal(2.0)), NUM, tol="exact")
op("pow", "pow", lax.pow, args(uniform(0.1, 4.0), uniform(-2.0, 2.5)), tol="trans")
op("pow_negative_base", "pow", lax.pow,
   args(signed(0.2, 3.0), lambda rng, s, d: _as(rng.integers(-3, 4, size=s), d)), tol="trans")
op("integer_pow_3", "integer_pow", lambda x: x ** 3, args(normal(1.5, -50, 50)), NUM, tol="trans")
op("integer_pow_neg2", "integer_pow", lambda x: x ** -2, args(signed(0.3, 3.0)), tol="trans")
op("square", "square", jnp.square, args(normal(2.0, -1000, 1000)), NUM)
op("abs", "abs", jnp.abs, args(with_zeros(normal(2.0))), NUM, tol="exact")
op("sign", "sign", jnp.sign, args(with_zeros(normal(2.0))), NUM, tol="exact")
op("nextafter", "nextafter", jnp.nextafter, tied_pair(normal(2.0)), tol="exact")
op("atan2", "atan2", jnp.arctan2, args(normal(2.0), with_zeros(normal(2.0), 0.05)), tol="trans")

# -- exponential / logarithmic / special ---------------------------------------
op("exp", "exp", jnp.exp, args(normal(2.0)), shapes=WITH_SCALAR)
op("exp2", "exp2", jnp.exp2, args(normal(3.0)), tol="amplified")
op("log", "log", jnp.log, args(uniform(0.01, 20.0)))
op("log1p", "log1p", jnp.log1p, args(uniform(-0.9, 10.0)))
op("expm1", "expm1", jnp.expm1, args(normal(1.5)))
op("tanh", "tanh", jnp.tanh, args(normal(2.0)), shapes=WITH_SCALAR)
op("one_minus_square", "one_minus_square", lambda x: lax.one_minus_square(x), args(uniform(-1.5, 1.5)), shapes=SHAPES,
   skip="" if hasattr(lax, "one_minus_square") else f"jax {jax.__version__} has no one_minus_square (jax >= 0.11)")
op("logistic", "logistic", jax.nn.sigmoid, args(normal(3.0)))
op("sqrt", "sqrt", jnp.sqrt, args(uniform(0.01, 50.0)))
op("rsqrt", "rsqrt", lax.rsqrt, args(uniform(0.01, 50.0)))
op("cbrt", "cbrt", jnp.cbrt, args(normal(5.0)), tol="trans")
op("erf", "erf", lax.erf, args(normal(1.5)), tol="trans")
op("erfc", "erfc", lax.erfc, args(normal(1.5)), tol="trans")
op("erf_inv", "erf_inv", lax.erf_inv, args(uniform(-0.99, 0.99)), tol="trans")

# -- trigonometric / hyperbolic -----------------------------------------------
op("sin", "sin", jnp.sin, args(uniform(-6.0, 6.0)), shapes=WITH_SCALAR)
# add_any is autodiff's cotangent sum: y is used twice, so its gradient adds two terms.
op("add_any", "add_any", lambda x: jax.grad(lambda y: jnp.sum(jnp.sin(y) * y))(x), args(uniform(-3.0, 3.0)),
   tol="trans")
op("cos", "cos", jnp.cos, args(uniform(-6.0, 6.0)))
op("tan", "tan", jnp.tan, args(uniform(-1.4, 1.4)), tol="trans")
op("asin", "asin", jnp.arcsin, args(uniform(-0.99, 0.99)))
op("acos", "acos", jnp.arccos, args(uniform(-0.99, 0.99)))
op("atan", "atan", jnp.arctan, args(normal(3.0)))
op("sinh", "sinh", jnp.sinh, args(uniform(-4.0, 4.0)))
op("cosh", "cosh", jnp.cosh, args(uniform(-4.0, 4.0)))
op("asinh", "asinh", jnp.arcsinh, args(normal(5.0)))
op("acosh", "acosh", jnp.arccosh, args(uniform(1.01, 20.0)))
op("atanh", "atanh", jnp.arctanh, args(uniform(-0.99, 0.99)))

# -- rounding and classification ----------------------------------------------
op("floor", "floor", jnp.floor, args(halves), tol="exact")
op("ceil", "ceil", jnp.ceil, args(halves), tol="exact")
op("round_away_from_zero", "round", lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
   args(halves), tol="exact")
op("round_to_nearest_even", "round", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN),
   args(halves), tol="exact")
op("round_jnp", "round", jnp.round, args(halves), tol="exact")
op("is_finite", "is_finite", jnp.isfinite, args(with_nonfinite(normal(2.0))), tol="exact")

# -- comparisons and selection ----------------------------------------------
for _name, _fn in (("eq", lax.eq), ("ne", lax.ne), ("lt", lax.lt), ("le", lax.le), ("gt", lax.gt), ("ge", lax.ge)):
    op(_name, _name, _fn, tied_pair(normal(2.0, -5, 5), nan=True), NUM)


def total_order_pair(rng, shape, dtype):
    """A tied pair with the values total order separates: NaNs of both signs, signed zeros, infinities."""
    x, y = tied_pair(normal(2.0, -5, 5))(rng, shape, dtype)
    if _isfloat(dtype):
        special = np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf], np.float32)
        for a in (x, y):
            hit = rng.random(shape) < 0.4
            a[hit] = special[rng.integers(0, len(special), size=shape)][hit].astype(dtype)
    return [x, y]


# eq_to / le_to / lt_to: XLA's TOTALORDER comparisons (jnp.searchsorted's, sort comparators')
for _name in ("eq_to", "le_to", "lt_to"):
    op(_name, _name, getattr(lax, f"{_name}_p").bind, total_order_pair, (F32,) + INT + (np.dtype(np.uint32),),
       tol="exact")  # 16-bit floats run through XLA (lowering/rules/pointwise.py, _total_order)


def _sorted_and_queries(rng, shape, dtype):
    a, v = total_order_pair(rng, shape, dtype)
    return [np.sort(a.ravel()), v]  # numpy sorts NaNs last, as jnp.sort does


op("searchsorted", "lt_to", lambda a, v: (jnp.searchsorted(a, v), jnp.searchsorted(a, v, side="right")),
   _sorted_and_queries, (F32,) + INT, tol="exact")
op("where", "select_n", jnp.where,
   lambda rng, s, d: [bools()(rng, s), normal(2.0)(rng, s, d), normal(2.0)(rng, s, d)], NUM + (BOOL,),
   shapes=WITH_SCALAR, tol="exact")
op("select_n_3", "select_n", lax.select_n,
   lambda rng, s, d: [_as(rng.integers(0, 3, size=s), np.int32)] + [normal(2.0)(rng, s, d) for _ in range(3)],
   NUM, tol="exact")


def _clamp_arrays(rng, s, d):
    a, b = normal(2.0)(rng, s, d), normal(2.0)(rng, s, d)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    return [lo, normal(3.0)(rng, s, d), hi]


def _clamp_scalars(rng, s, d):
    lo, hi = sorted(normal(1.0, -30, 0)(rng, (2,), d))
    return [np.asarray(lo, d), normal(2.0, -60, 60)(rng, s, d), np.asarray(hi, d) + np.asarray(1, d)]


op("clamp", "clamp", lax.clamp, _clamp_arrays, NUM, tol="exact")
op("clamp_scalar_bounds", "clamp", lax.clamp, _clamp_scalars, NUM, tol="exact")

# -- logical / bitwise ---------------------------------------------------------
op("and", "and", lambda x, y: x & y, args(logic, logic), LOGIC)
op("or", "or", lambda x, y: x | y, args(logic, logic), LOGIC)
op("xor", "xor", lambda x, y: x ^ y, args(logic, logic), LOGIC)
op("not", "not", lambda x: ~x, args(logic), LOGIC)
_shift_args = lambda rng, s, d: [full_int32(rng, s, d), _as(rng.integers(0, 32, size=s), d)]  # noqa: E731
op("shift_left", "shift_left", lax.shift_left, _shift_args, INT)
op("shift_right_logical", "shift_right_logical", lax.shift_right_logical, _shift_args, INT)
op("shift_right_arithmetic", "shift_right_arithmetic", lax.shift_right_arithmetic, _shift_args, INT)
op("population_count", "population_count", lax.population_count, args(full_int32), INT)
op("clz", "clz", lax.clz, args(full_int32), INT)

# -- conversions ---------------------------------------------------------------
op("convert_f32_to_bf16", "convert_element_type", lambda x: x.astype(jnp.bfloat16),
   args(normal(100.0)), (F32,), tol="exact")
op("convert_bf16_to_f32", "convert_element_type", lambda x: x.astype(jnp.float32),
   args(normal(100.0)), (BF16,), tol="exact")
op("convert_f32_to_int32", "convert_element_type", lambda x: x.astype(jnp.int32),
   args(uniform(-1000.0, 1000.0)), (F32,), tol="exact")
op("convert_int32_to_f32", "convert_element_type", lambda x: x.astype(jnp.float32),
   args(full_int32), (I32,), tol="exact")
op("convert_bool_to_f32", "convert_element_type", lambda x: x.astype(jnp.float32),
   args(bools()), (BOOL,), tol="exact")
op("bitcast_f32_to_u32", "bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.uint32),
   args(normal(100.0)), (F32,), tol="exact")
op("bitcast_int32_to_f32", "bitcast_convert_type", lambda x: lax.bitcast_convert_type(x & 0x3FFFFFFF, jnp.float32),
   args(full_int32), (I32,), tol="exact")

# -- threefry random bits (lowering/rules/prng.py; more in tests/test_random.py) ---
_KEY = lambda rng, s, d: [rng.integers(0, 2 ** 32, size=(2,), dtype=np.uint64).astype(np.uint32),  # noqa: E731
                          normal(1.0)(rng, s, d)]
_WRAP = jax.random.wrap_key_data
op("random_bits", "random_bits", lambda kd, x: jax.random.bits(_WRAP(kd), x.shape), _KEY, (F32,), tol="exact")
op("random_wrap", "random_wrap", lambda kd, x: jnp.where(jax.random.bernoulli(_WRAP(kd), 0.7, x.shape), x, 0),
   _KEY, (F32,), tol="exact")
op("random_split", "random_split", lambda kd, x: jax.random.key_data(jax.random.split(_WRAP(kd), x.shape[:2])),
   _KEY, (F32,), tol="exact")
op("random_fold_in", "random_fold_in", lambda kd, x: jax.random.key_data(jax.random.fold_in(_WRAP(kd), 77)),
   _KEY, (F32,), tol="exact")
op("random_unwrap", "random_unwrap", lambda kd, x: jax.random.key_data(_WRAP(kd)) + 1, _KEY, (F32,), tol="exact")

# -- iota ----------------------------------------------------------------------
op("arange", "iota", lambda x: x + jnp.arange(x.shape[-1], dtype=x.dtype), args(normal(2.0)), NUM, tol="exact")
op("broadcasted_iota_dim0", "iota", lambda x: x + lax.broadcasted_iota(x.dtype, x.shape, 0),
   args(normal(2.0)), NUM, tol="exact")
op("broadcasted_iota_last", "iota", lambda x: x * lax.broadcasted_iota(x.dtype, x.shape, x.ndim - 1),
   args(normal(2.0)), NUM, tol="exact")
# -- dim_as_value: a dynamic size used as a value (only in symbolic traces) --------
op("dim_as_value", "dim_as_value", lambda x: x * x.shape[0] + x.shape[-1], args(normal(2.0)), NUM,
   dynamic={0: {0: "n"}}, shapes=SHAPES)
op("iota_only", "iota", lambda x: lax.broadcasted_iota(jnp.int32, x.shape, 0), args(normal(2.0)), INT, tol="exact")


def _plus_empty2(x):
    """2x plus ``empty2``: the uninitialized scalar a differentiated cond returns for another branch's residual
    (tests/test_loops.py has that cond), zero as XLA lowers it (the add then folds away, as XLA folds x + 0:
    the doubling keeps a kernel)."""
    from jax._src.lax import lax as lax_internal

    return x * 2 + lax_internal.empty2(x.dtype, memory_space=jax.typeof(x).memory_space)


op("empty2", "empty2", _plus_empty2, args(normal(2.0)), NUM, tol="exact")


# -- shape ops -----------------------------------------------------------------
_VIEW = NUM  # view ops move data: exact for every dtype
_X = args(normal(2.0))
_SPLIT = {(3, 50): (3, 5, 10), (6, 35): (2, 3, 5, 7)}
_MIXED = {(5, 1, 37): (37, 5), (6, 35): (14, 15)}
op("reshape_merge", "reshape", lambda x: x.reshape(-1), _X, _VIEW + (BOOL,), tol="exact")
op("reshape_split", "reshape", lambda x: x.reshape(_SPLIT[x.shape]), _X, _VIEW, shapes=tuple(_SPLIT), tol="exact")
op("reshape_split_merge", "reshape", lambda x: x.reshape(_MIXED[x.shape]), _X, _VIEW, shapes=tuple(_MIXED),
   tol="exact")
op("transpose", "transpose", lambda x: jnp.transpose(x, tuple(range(x.ndim))[::-1]), _X, _VIEW, shapes=SHAPES,
   tol="exact")
op("transpose_3d", "transpose", lambda x: jnp.transpose(x, (1, 2, 0)), _X, _VIEW,
   shapes=((5, 1, 37), (4, 6, 5)), tol="exact")
op("broadcast_leading", "broadcast_in_dim", lambda x: jnp.broadcast_to(x, (2,) + x.shape), _X, _VIEW,
   shapes=WITH_SCALAR, tol="exact")
op("broadcast_size1", "broadcast_in_dim",
   lambda x: jnp.broadcast_to(x, tuple(4 if d == 1 else d for d in x.shape)), _X, _VIEW,
   shapes=((5, 1, 37), (1, 50)), tol="exact")
op("broadcast_jnp_expand_dims", "broadcast_in_dim", lambda x: jnp.expand_dims(x, (0, 2)), _X, _VIEW, tol="exact")
op("squeeze", "squeeze", lambda x: jnp.squeeze(x, 1), _X, _VIEW, shapes=((5, 1, 37), (3, 1)), tol="exact")
op("expand_dims", "expand_dims", lambda x: jnp.expand_dims(x, (0, 2)), _X, (F32,), shapes=SHAPES, tol="exact",
   xfail=((None, None, "jax 0.10.2 has no expand_dims primitive (jnp.expand_dims traces to broadcast_in_dim): "
                       "the expand_dims rule is unreachable"),))
_SLICES = {(5, 1, 37): ((1, 0, 2), (4, 1, 35), (2, 1, 3)), (3, 50): ((0, 5), (3, 48), (2, 4))}
op("slice_strided", "slice", lambda x: lax.slice(x, *_SLICES[x.shape]), _X, _VIEW, tol="exact")
op("slice_unit_stride", "slice", lambda x: x[1:-1, ..., 3:-2], _X, _VIEW, shapes=SHAPES, tol="exact")
op("rev", "rev", lambda x: jnp.flip(x, (0, x.ndim - 1)), _X, _VIEW, tol="exact")
op("tile", "tile", lambda x: jnp.tile(x, (2,) + (1,) * (x.ndim - 2) + (3,)), _X, _VIEW, tol="exact")
_PADS = {(5, 1, 37): ((2, -1, 1), (1, 0, 0), (-3, 4, 2)), (3, 50): ((-1, 2, 2), (3, -5, 1))}
op("pad", "pad", lambda x, v: lax.pad(x, v, _PADS[x.shape]),
   lambda rng, s, d: [normal(2.0)(rng, s, d), normal(2.0, 1, 100)(rng, (), d)], _VIEW, shapes=SHAPES, tol="exact")
op("pad_literal_value", "pad", lambda x: lax.pad(x, jnp.asarray(-7, x.dtype), _PADS[x.shape]), _X, _VIEW,
   tol="exact", shapes=SHAPES)



# -- indexing by run-time values (lowering/rules/gather.py; more in tests/test_gather.py) --
def _ints(lo, hi, shape_of):
    return lambda rng, s, d: np.asarray(rng.integers(lo(s), hi(s), size=shape_of(s)), np.int32)


def _with(*leaves):
    def g(rng, shape, dtype):
        return [leaf(rng, shape, dtype) for leaf in leaves]
    return g


_IDX_LAST = _ints(lambda s: -s[-1] - 2, lambda s: s[-1] + 2, lambda s: s[:-1] + (4,))  # negative, out of bounds
_IDX_ROWS = _ints(lambda s: -s[0] - 2, lambda s: s[0] + 2, lambda s: (3,))
_ROW_UPDATES = lambda rng, s, d: normal(2.0)(rng, (3,) + s[1:], d)  # noqa: E731
_STARTS = _ints(lambda s: -3, lambda s: max(s) + 3, lambda s: (len(s),))
_HALF = lambda s: tuple(max(1, d // 2) for d in s)  # noqa: E731
op("take_along_axis", "gather", lambda x, i: jnp.take_along_axis(x, i, axis=-1, mode="clip"),
   _with(normal(2.0), _IDX_LAST), _VIEW, tol="exact")
op("dynamic_slice", "dynamic_slice", lambda x, s: lax.dynamic_slice(x, tuple(s[k] for k in range(x.ndim)), _HALF(x.shape)),
   _with(normal(2.0), _STARTS), _VIEW, shapes=SHAPES, tol="exact")
op("dynamic_update_slice", "dynamic_update_slice",
   lambda x, u, s: lax.dynamic_update_slice(x, u, tuple(s[k] for k in range(x.ndim))),
   _with(normal(2.0), lambda rng, s, d: normal(2.0)(rng, _HALF(s), d), _STARTS), _VIEW, shapes=SHAPES, tol="exact")
op("scatter_add_repeated", "scatter-add", lambda x, i, u: x.at[i].add(u), _with(normal(2.0), _IDX_ROWS, _ROW_UPDATES),
   NUM, shapes=SHAPES, tol="sum")
op("scatter_mul", "scatter-mul", lambda x, i, u: x.at[i].mul(u, mode="clip"),
   _with(normal(2.0), _IDX_ROWS, _ROW_UPDATES), NUM, shapes=SHAPES, tol="sum")
op("scatter_min", "scatter-min", lambda x, i, u: x.at[i].min(u), _with(normal(2.0), _IDX_ROWS, _ROW_UPDATES), NUM,
   tol="exact", shapes=SHAPES)
op("scatter_max", "scatter-max", lambda x, i, u: x.at[i].max(u), _with(normal(2.0), _IDX_ROWS, _ROW_UPDATES), NUM,
   tol="exact", shapes=SHAPES)
op("scatter_set_unique", "scatter", lambda x, i, u: x.at[i].set(u),
   _with(normal(2.0), lambda rng, s, d: np.asarray([0, s[0] - 1, s[0] + 5], np.int32), _ROW_UPDATES), NUM,
   shapes=SHAPES, tol="exact")


def _pieces(axis, sizes=(5, 1, 17)):
    def g(rng, s, d):
        out = []
        for n in sizes:
            sh = list(s)
            sh[axis] = n
            out.append(normal(2.0)(rng, tuple(sh), d))
        return out
    return g


op("concatenate_last", "concatenate", lambda a, b, c: jnp.concatenate([a, b, c], axis=-1), _pieces(-1),
   _VIEW, shapes=SHAPES, tol="exact")
op("concatenate_first", "concatenate", lambda a, b, c: jnp.concatenate([a, b, c], axis=0), _pieces(0),
   _VIEW, tol="exact")
op("stack_mid", "stack", lambda a, b, c: jnp.stack([a, b, c], axis=1), args(normal(2.0), normal(2.0), normal(2.0)),
   _VIEW, tol="exact")
op("stack_last", "stack", lambda a, b: jnp.stack([a, -b], axis=-1), N2, _VIEW, tol="exact")
op("stack_one", "stack", lambda a: jnp.stack([a]), _X, _VIEW, tol="exact")
op("unstack_first", "unstack", lambda x: jnp.unstack(x, axis=0), _X, _VIEW, shapes=SHAPES, tol="exact")
op("unstack_last", "unstack", lambda x: jnp.unstack(x, axis=-1), _X, _VIEW, shapes=SHAPES, tol="exact")
op("reduce_precision_own_bits", "reduce_precision",
   lambda x: lax.reduce_precision(jnp.sin(x), np.finfo(x.dtype).nexp, np.finfo(x.dtype).nmant) * 2.0, _X,
   [np.float32])
op("split_last", "split", lambda x: jnp.split(x, [7, 20], axis=-1), _X, _VIEW, tol="exact")
op("split_first", "split", lambda x: jnp.split(x, [1, 2], axis=0), _X, _VIEW, shapes=SHAPES, tol="exact")

# -- reductions ----------------------------------------------------------------
_AXES = (("last", -1), ("mid", 1), ("first", 0), ("all", None))


def _reduced_count(shape, axis):
    return int(np.prod(shape)) if axis is None else shape[axis]


def _bools_for(kind, axis):
    """Bools whose all()/any() over the reduced axis is True about half the time."""
    def g(rng, s, d):
        n = _reduced_count(s, axis)
        p = 0.5 ** (1.0 / n)
        return [bools(p if kind == "all" else 1.0 - p)(rng, s)]
    return g


_prod_gen = args(lambda rng, s, d: (signed(0.8, 1.25)(rng, s, d) if _isfloat(d)
                                    else _as(rng.choice([-3, -1, 1, 3], size=s), d)))
for _aname, _axis in _AXES:
    _ax = functools.partial
    op(f"reduce_sum_{_aname}", "reduce_sum", _ax(jnp.sum, axis=_axis), _X, NUM, shapes=RED_SHAPES, tol="sum")
    op(f"reduce_max_{_aname}", "reduce_max", _ax(jnp.max, axis=_axis), _X, NUM, shapes=RED_SHAPES, tol="exact")
    op(f"reduce_min_{_aname}", "reduce_min", _ax(jnp.min, axis=_axis), _X, NUM, shapes=RED_SHAPES, tol="exact")
    op(f"reduce_prod_{_aname}", "reduce_prod", _ax(jnp.prod, axis=_axis), _prod_gen, NUM, shapes=RED_SHAPES,
       tol="sum")
    op(f"reduce_and_{_aname}", "reduce_and", _ax(jnp.all, axis=_axis), _bools_for("all", _axis), (BOOL,),
       shapes=RED_SHAPES)
    op(f"reduce_or_{_aname}", "reduce_or", _ax(jnp.any, axis=_axis), _bools_for("any", _axis), (BOOL,),
       shapes=RED_SHAPES)
    # small int range: ties, which must resolve to the first index like jax
    op(f"argmax_{_aname}", "argmax", _ax(jnp.argmax, axis=_axis), args(normal(2.0, -20, 20)), NUM,
       shapes=RED_SHAPES)
    op(f"argmin_{_aname}", "argmin", _ax(jnp.argmin, axis=_axis), args(normal(2.0, -20, 20)), NUM,
       shapes=RED_SHAPES)


# [Note: positional collectives]: a collective over a vmapped axis name is a reduction over
# that (positional) axis; its transpose (psum over no axis) an identity.
def _centered_by_collective(collective):
    def fn(x):
        return jax.vmap(lambda r: r - collective(r, "batch"), axis_name="batch")(x)
    return fn


op("psum_vmapped_axis", "psum", _centered_by_collective(lax.psum), _X, NUM, shapes=SHAPES, tol="sum")
op("psum_vmapped_axis_grad", "psum", jax.grad(lambda x: jnp.sum(jnp.sin(_centered_by_collective(lax.psum)(x)))),
   _X, (F32,), shapes=SHAPES, tol="sum")
op("pmax_vmapped_axis", "pmax", _centered_by_collective(lax.pmax), _X, NUM, shapes=SHAPES, tol="exact")
op("pmin_vmapped_axis", "pmin", _centered_by_collective(lax.pmin), _X, NUM, shapes=SHAPES, tol="exact")

# -- pooling windows ([Note: pooling windows] in lowering/rules/windows.py) ----------------
POOL_SHAPES = ((2, 9, 11, 3),)


def _window(reducer, init, window, strides, padding, **dil):
    def fn(x):
        fill = np.array(init, x.dtype) if not jnp.issubdtype(x.dtype, jnp.integer) else np.array(
            jnp.iinfo(x.dtype).min if init == -np.inf else jnp.iinfo(x.dtype).max if init == np.inf else init, x.dtype)
        pads = ((0, 0), *padding, (0, 0)) if not isinstance(padding, str) and len(padding) == len(window) else padding
        return lax.reduce_window(x, fill, reducer, (1, *window, 1), (1, *strides, 1), pads, **dil)
    return fn


def _pool_vjp(reducer, init, window, strides, padding):
    """The pooling's vjp at a random cotangent (the second argument, as wide as the operand:
    its top-left corner is used)."""
    pool = _window(reducer, init, window, strides, padding)

    def fn(x, c):
        y, back = jax.vjp(pool, x)
        return back(c[tuple(slice(0, n) for n in y.shape)].astype(y.dtype))[0]
    return fn


def _quarters(rng, s, d):
    """Multiples of 1/4 in [-2, 2] (ints: -8..8): a window's sum of them is exact in bfloat16 too,
    whichever order and precision it is added in (XLA rounds a bf16 window sum at every step)."""
    k = rng.integers(-8, 9, size=s)
    return _as(k if d.kind in "iu" else k / 4.0, d)


def _ties_and_nans(rng, s, d):
    """Small integers (ties in every window), NaN runs and -inf rows."""
    x = _as(rng.integers(-2, 2, size=s), np.float64)
    x[0, 1:4, 2, 0] = np.nan
    x[1, 5, 5:9, 1] = np.nan
    x[0, 7, :, 2] = -np.inf
    x[1, 0, 0, :] = np.nan
    return [_as(x, d), _quarters(rng, s, d)]


POOLS = {"2x2_s2_valid": ((2, 2), (2, 2), "VALID"), "3x3_s2_same": ((3, 3), (2, 2), "SAME"),
         "3x2_s13_pad": ((3, 2), (1, 3), ((1, 0), (0, 2)))}
for _pname, _pool in POOLS.items():
    op(f"reduce_window_max_{_pname}", "reduce_window_max", _window(lax.max, -np.inf, *_pool), _X, NUM,
       shapes=POOL_SHAPES, tol="exact")
    op(f"reduce_window_sum_{_pname}", "reduce_window_sum", _window(lax.add, 0, *_pool), args(_quarters), NUM,
       shapes=POOL_SHAPES, tol="sum")
    if _pname != "2x2_s2_valid":
        # the sum's transpose pads the cotangent and sums it again
        op(f"reduce_window_sum_vjp_{_pname}", "reduce_window_sum", _pool_vjp(lax.add, 0, *_pool),
           args(normal(2.0), _quarters), (F32,), shapes=POOL_SHAPES, tol="sum")
# a dynamic batch (dims the window leaves alone may be symbolic: automatic dynamic's batch axis)
op("reduce_window_sum_vjp_dynamic_batch", "reduce_window_sum", _pool_vjp(lax.add, 0, *POOLS["3x3_s2_same"]),
   args(normal(2.0), _quarters), (F32,), shapes=POOL_SHAPES, tol="sum", dynamic={0: {0: "batch"}, 1: {0: "batch"}})
op("reduce_window_min_3x2_s13_pad", "reduce_window_min", _window(lax.min, np.inf, *POOLS["3x2_s13_pad"]), _X, NUM,
   shapes=POOL_SHAPES, tol="exact")
op("reduce_window_max_ties_nans", "reduce_window_max", _window(lax.max, -np.inf, (3, 3), (2, 2), "SAME"),
   lambda rng, s, d: _ties_and_nans(rng, s, d)[:1], (F32,), shapes=POOL_SHAPES, tol="exact", allow_nonfinite=True)
op("reduce_window_sum_dilated", "reduce_window_sum",
   _window(lax.add, 0, (2, 2), (1, 1), ((0, 0), (1, 2), (0, 1), (0, 0)), base_dilation=(1, 2, 1, 1),
           window_dilation=(1, 1, 2, 1)), args(_quarters), FLOAT, shapes=POOL_SHAPES, tol="sum")
op("reduce_window_max_dilated", "reduce_window_max",
   _window(lax.max, -np.inf, (2, 2), (3, 1), ((0, 0), (1, 2), (0, 1), (0, 0)), base_dilation=(1, 2, 1, 1),
           window_dilation=(1, 1, 2, 1)), _X, FLOAT, shapes=POOL_SHAPES, tol="exact",
   allow_nonfinite=True)  # windows over holes and padding only: -inf

# Column sums kept in an 8- / 16-bit int over enough rows to split into a partial mix kernel
# and its finisher (lowering/split.py): the mix kernel's jnp.sum / jnp.prod of such a tile is
# int32 / uint32, which Pallas's store refused.
op("reduce_sum_narrow_int_columns", "reduce_sum", lambda x: jnp.sum(x, 0, dtype=x.dtype), args(normal(2.0, -100, 100)),
   (np.int8, np.uint16), shapes=((1030, 3),), tol="exact")


# -- matmul (the template; tests/test_matmul.py has the forms and epilogues) ----------
def _matmul_args(rhs_shape):
    """x of the case's shape and a second operand of ``rhs_shape(shape)``, scaled
    so the products stay O(1)."""
    def g(rng, s, d):
        return [normal(1.0)(rng, s, d), normal(s[-1] ** -0.5)(rng, rhs_shape(s), d)]
    return g


# "fused": the template wherever it applies ("auto" leaves float32 products to XLA).
TEMPLATE = (("matmul_template", "fused"),)
op("dot_general", "dot_general", lambda x, w: x @ w, _matmul_args(lambda s: (s[-1], 6)), tol="sum",
   options=TEMPLATE)
op("dot_general_batched_transposed", "dot_general",
   lambda x, w: lax.dot_general(x, w, (((x.ndim - 1,), (2,)), ((0,), (0,)))),
   _matmul_args(lambda s: (s[0], 6, s[-1])), tol="sum", options=TEMPLATE)


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #
def _shape_id(shape):
    return "x".join(map(str, shape)) if shape else "scalar"


def _cases():
    out = []
    for info in TABLE:
        for dt in info.dtypes:
            for shape in info.shapes:
                cid = f"{info.name}-{dt.name}-{_shape_id(shape)}"
                marks = [pytest.mark.xfail(strict=True, reason=reason)
                         for xd, xs, reason in info.xfail
                         if (xd is None or np.dtype(xd) == dt) and (xs is None or tuple(xs) == shape)]
                if info.skip:
                    marks = [pytest.mark.skip(reason=info.skip)]
                out.append(pytest.param(info, dt, shape, id=cid, marks=marks[:1]))
    return out


def _primitives(jaxpr) -> set[str]:
    """Every primitive name in a jaxpr, sub-jaxprs included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for p in eqn.params.values():
            for sub in (p if isinstance(p, (tuple, list)) else (p,)):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    names |= _primitives(sub.jaxpr)
                elif isinstance(sub, jex_core.Jaxpr):
                    names |= _primitives(sub)
    return names


def _to_np(x):
    a = np.asarray(x)
    return a.astype(np.float64) if _isfloat(a.dtype) else a


def _check(out, ref, info, dt, where):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, f"{where}: shape {out.shape} != jax {ref.shape}"
    assert out.dtype == ref.dtype, f"{where}: dtype {out.dtype} != jax {ref.dtype}"
    o, r = _to_np(out), _to_np(ref)
    if _isfloat(ref.dtype):
        if not info.allow_nonfinite:
            assert np.isfinite(r).all(), f"{where}: reference is not finite (input out of the op's domain)"
        # NaN passes only where the reference is NaN too.
        np.testing.assert_array_equal(np.isnan(o), np.isnan(r), err_msg=f"{where}: NaN positions differ")
        tols = TOLS[info.tol]
        if tols is None:
            np.testing.assert_array_equal(o, r, err_msg=where)
        else:
            rtol, atol = tols[np.dtype(ref.dtype)] if np.dtype(ref.dtype) in tols else tols[dt]
            if info.prim == "dot_general" and jax.default_backend() != "cpu" and np.dtype(ref.dtype) == np.float32:
                # DEFAULT precision on an H100: TF32 products (10-bit mantissas) in the template;
                # XLA computes some of these shapes in full float32.
                rtol, atol = max(rtol, 5e-3), max(atol, 5e-3)
            np.testing.assert_allclose(o, r, rtol=rtol, atol=atol, equal_nan=True, err_msg=where)
    else:
        np.testing.assert_array_equal(o, r, err_msg=where)


@pytest.mark.parametrize("info,dtype,shape", _cases())
def test_op(info: OpInfo, dtype, shape, request):
    cid = request.node.callspec.id
    rng = np.random.default_rng(zlib.crc32(cid.encode()))
    np_args = info.gen(rng, shape, dtype)
    jargs = [jnp.asarray(a) for a in np_args]

    # The entry really exercises its primitive.
    traced = jargs
    if info.dynamic:
        dims = jax.export.symbolic_shape(", ".join(sorted({s for d in info.dynamic.values() for s in d.values()})))
        names = sorted({s for d in info.dynamic.values() for s in d.values()})
        sym = dict(zip(names, dims))
        traced = [jax.ShapeDtypeStruct(tuple(sym[info.dynamic[i][k]] if k in info.dynamic.get(i, {}) else d
                                             for k, d in enumerate(a.shape)), a.dtype) for i, a in enumerate(jargs)]
    prims = _primitives(jax.make_jaxpr(info.fn)(*traced).jaxpr)
    assert info.prim in prims, f"{info.prim} not in the traced jaxpr (primitives: {sorted(prims)})"

    ref = jax.jit(info.fn)(*jargs)
    with pallaskit.config.override(**dict(info.options)):
        jf = pallaskit.jit(info.fn, dynamic=info.dynamic)
        out = jf(*jargs)
        ex = pallaskit.explain(jf, *jargs)
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    assert out_tree == ref_tree
    for k, (o, r) in enumerate(zip(out_leaves, ref_leaves)):
        _check(o, r, info, dtype, f"{cid} output {k}")

    # Lowered by a rule, not run through XLA (16-bit nextafter: through XLA on a GPU, by design).
    gpu_16bit_nextafter = (info.prim == "nextafter" and jax.default_backend() != "cpu"
                           and np.dtype(dtype).itemsize == 2)
    assert ex.fallbacks == ([info.prim] if gpu_16bit_nextafter else []), f"primitives ran through XLA: {ex.fallbacks}"
    if gpu_16bit_nextafter:
        return
    assert len(ex.kernels) >= 1, "no kernel generated"


def test_every_rule_has_an_entry():
    tested = {info.prim for info in TABLE}
    # the attention pass's own primitive is never in a user's jaxpr: tests/test_fused_attention.py
    required = {name for name, rule in RULES.items() if rule.note != "identity" and rule.kind != "attention"}
    missing = sorted(required - tested)
    assert not missing, f"lowering rules without an entry in tests/test_rules.py TABLE: {missing}"
    unknown = sorted(tested - set(RULES))
    assert not unknown, f"TABLE entries for primitives with no rule: {unknown}"


def test_table_is_well_formed():
    names = [info.name for info in TABLE]
    assert len(names) == len(set(names)), "duplicate entry names"
    for info in TABLE:
        for shape in info.shapes:
            assert int(np.prod(shape)) < 4000, f"{info.name}: {shape} too large for interpret mode"


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_total_order_of_16bit_floats_runs_through_xla(dtype):
    """16-bit total-order comparisons run through XLA (a GPU's widening to float32
    made NaNs of different bits one NaN: eq_to of two NaNs true where XLA says
    false); values as jax.jit's, NaNs of both signs and payloads included."""
    bits = np.array([0x7E00, 0x7E01, 0xFE00, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x3C00], np.uint16)
    if dtype == jnp.bfloat16:
        bits = np.array([0x7FC0, 0x7FC1, 0xFFC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x3F80], np.uint16)
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype)
    a, b = jnp.repeat(x, len(bits)), jnp.tile(x, len(bits))
    fn = lambda a, b: (lax.eq_to_p.bind(a, b), lax.le_to_p.bind(a, b), lax.lt_to_p.bind(a, b))  # noqa: E731
    jf = pallaskit.jit(fn)
    for g, w in zip(jf(a, b), jax.jit(fn)(a, b)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert sorted(pallaskit.explain(jf, a, b).fallbacks) == ["eq_to", "le_to", "lt_to"]
