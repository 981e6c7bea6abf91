"""Regressions from the long differential-fuzzer run (benchmarks/fuzz), and the
oracle rules that the run showed to be needed (XLA:CPU artifacts, not pallaskit bugs).

- erf_inv of a bf16 sum: pallaskit (excess precision on, its default, as XLA)
  fed erf_inv the rounded bf16 sum (-1, so -inf) where XLA uses the float32 sum.
- max/min over rows with NaN: XLA:CPU's reductions drop NaN over wide rows (jax.jit
  and pallaskit's interpret mode, which runs jnp.max on XLA:CPU); checked against
  NumPy. The oracle's float64 reference keeps NaN explicitly.
- a bf16 broadcast of a subnormal: XLA:CPU gives the zero of its sign; the oracle
  counts them equal.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallaskit
from benchmarks.fuzz import oracle, programs


@pytest.fixture(autouse=True)
def _no_cache():
    with pallaskit.config.override(cache=False):
        yield


def _special(rng, shape, dtype, frac):
    x = rng.standard_normal(shape)
    extremes = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 30.0, -30.0, 1.0, -1.0])
    x = np.where(rng.random(shape) < frac, rng.choice(extremes, size=shape), x)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16])  # XLA:CPU rounds each float16 op (pallaskit keeps float32)
def test_erf_family_sees_unrounded_16bit_chain(dtype):
    """erf_inv(bf16(-1) + 0.00185): the bf16 add rounds to -1 (erf_inv -inf), XLA keeps float32 (-2.2)."""
    if jax.default_backend() != "cpu":
        # XLA:GPU adds bf16 natively (rounded: -inf here) where XLA:CPU keeps float32; pallaskit
        # keeps float32 on every platform (allow_excess_precision), so jax.jit's two platforms disagree.
        pytest.skip("XLA:GPU rounds the bf16 add that XLA:CPU keeps in float32")
    rng = np.random.default_rng(5)
    ints = rng.integers(-1, 2, size=(3, 257)).astype(np.int32)
    ints[0, :4] = -1
    small = (rng.standard_normal((3, 257)) * 0.01).astype(dtype)
    small[0, :4] = np.array([0.00185394, -0.00185394, 0.0009, 0.0019]).astype(dtype)

    def f(a, b):
        v = a.astype(dtype) + b
        return lax.erf_inv(v), lax.erf(v * 3), lax.erfc(v * 2)

    want = jax.jit(f)(ints, small)
    got = pallaskit.jit(f)(ints, small)
    tol = 2e-2 if dtype == jnp.bfloat16 else 3e-3  # erf's approximations differ by an ulp or so
    for g, w in zip(got, want):  # -inf where jax.jit has -2.2 fails however loose
        np.testing.assert_allclose(np.asarray(g).astype(np.float32), np.asarray(w).astype(np.float32),
                                   rtol=tol, atol=tol)


# XLA:CPU's own max/min drop NaN in these rows: the reference is NumPy. The Pallas renderer's
# any-NaN reductions keep it.
@pytest.mark.parametrize("shape,dtype", [((3, 8193), np.float32), ((1500, 37), np.float16), ((1025, 3), np.float32)])
@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_reduction_keeps_nan(name, shape, dtype):
    """Against NumPy: jax.jit on the CPU drops NaN from these reductions itself."""
    rng = np.random.default_rng(0)
    x = _special(rng, shape, dtype, 0.05)
    b = _special(rng, shape, dtype, 0.3)
    fn = getattr(jnp, name)
    got = np.asarray(pallaskit.jit(lambda x, b: fn(jnp.minimum(x, b), axis=-1))(x, b))
    want = getattr(np, name)(np.minimum(x, b), axis=-1)
    np.testing.assert_array_equal(got, want)
    got_all = np.asarray(pallaskit.jit(lambda x: fn(x))(x))
    np.testing.assert_array_equal(got_all, getattr(np, name)(x))


def test_oracle_subnormal_equals_signed_zero():
    bf = jnp.bfloat16
    sub = float(jnp.finfo(bf).smallest_subnormal)
    w = np.array([-0.0, 0.0, 1.0, 0.0], bf)
    assert oracle.compare([np.array([-sub, sub, 1.0, 0.0], bf)], [w], [True]) is None
    assert oracle.compare([np.array([-sub, 0.0, 1.0, 0.0], bf)], [np.array([0.0, 0.0, 1.0, 0.0], bf)], [True]) is not None
    tiny = float(np.finfo(np.float32).tiny)  # the smallest normal is not flushed
    assert oracle.compare([np.array([tiny], np.float32)], [np.array([0.0], np.float32)], [True]) is not None


def _program(src_line, shape, dtype, special, exact):
    inputs = [programs.Input("x0", shape, dtype, 1, 0.05, 1.0), programs.Input("x2", shape, dtype, 0, special, 1.0)]
    lines = [programs.Line("v2", "jnp.minimum(x0, x2)", ("x0", "x2"), "min"),
             programs.Line("v3", src_line, ("v2",), "max")]
    return programs.Program(inputs, lines, ["v3"], [exact], {})


@pytest.mark.parametrize("exact", [True, False])
def test_oracle_reference_keeps_nan_of_max(exact):
    """fuzzlong 002: jax.jit and its float64 run drop the NaN; the oracle's reference keeps it."""
    p = _program("jnp.max(v2, axis=-1)", (3, 8193), "float32", 0.3, exact)
    x0, x2 = p.make_args()
    ref = oracle.reference(p)
    assert np.isnan(ref[0]).all()
    want = [np.asarray(jax.jit(p.function())(x0, x2)[0])]
    nan = [np.full(3, np.nan, np.float32)]
    assert oracle.compare(nan, want, [exact], ref) is None
    if not np.isnan(want[0]).all():  # a finite answer where the reference says NaN still fails
        assert oracle.compare(want, want, [exact], ref) is None  # (agreeing with jax.jit passes)
        assert oracle.compare([np.full(3, 7.0, np.float32)], want, [exact], ref) is not None


def test_bf16_result_converted_to_float32_is_unrounded():
    """fuzzlong 010 (and gpu3 003): bf16 log then .astype(f32). XLA computes the bf16 op in float32
    and, with excess precision, drops the f32 -> bf16 -> f32 convert pair: jax.jit's float32 is the
    unrounded log (-2.0717), where pallaskit gave the bf16-rounded one (-2.078)."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.uniform(0.05, 4.0, (7, 37)), jnp.bfloat16)
    y = jnp.asarray(rng.uniform(0.05, 4.0, (7, 37)), jnp.bfloat16)

    def f(x, y):
        return jnp.log(x).astype(jnp.float32), (x + y).astype(jnp.float32), (x * y).astype(jnp.float32) * 2

    got, want = pallaskit.jit(f)(x, y), jax.jit(f)(x, y)
    if jax.default_backend() == "cpu":
        for g, w in zip(got, want):  # bf16 rounding is ~4e-3 relative: far outside this
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    else:
        # XLA:GPU computes the bf16 log in float32 inside its fusion and rounds it to bf16
        # there (the H100 run: every jax.jit value bf16-representable), so no convert pair is
        # left to drop; pallaskit keeps the unrounded float32 log (allow_excess_precision),
        # one bf16 rounding away.
        log = np.asarray(want[0])
        assert (log == log.astype(jnp.bfloat16).astype(np.float32)).all()
        np.testing.assert_allclose(np.asarray(got[0]), np.log(np.asarray(x, np.float32)), rtol=1e-6, atol=1e-6)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2.0 ** -8, atol=0)
    # rounded as written when excess precision is off, as XLA then
    strict = jax.jit(f).lower(x, y).compile(compiler_options={"xla_allow_excess_precision": False})(x, y)
    with pallaskit.config.override(allow_excess_precision=False):
        got = pallaskit.jit(f)(x, y)
    for g, w in zip(got, strict):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["gelu", "scale"])
def test_float16_matmul_overflow_reaches_epilogue(act):
    """fuzzlong 009: a float16 product past float16's range is inf in jax.jit (its dot writes
    float16) and its epilogue sees inf (gelu(-inf) = NaN); the template fed the epilogue the
    finite float32 accumulator (gelu -> -0.0)."""
    rng = np.random.default_rng(9)
    a = rng.standard_normal((37, 20)).astype(np.float16)
    a[:5] = 300.0  # rows whose products reach +-90000 (> 65504)
    b = (np.sign(rng.standard_normal((1, 33))) * np.full((20, 33), 15.0)).astype(np.float16)  # +-inf columns
    bias = rng.standard_normal(33).astype(np.float16)
    fn = {"gelu": lambda a, b, c: jax.nn.gelu(a @ b + c), "scale": lambda a, b, c: (a @ b) * 0.5 + c}[act]
    with pallaskit.config.override(matmul_template="fused"):
        got = np.asarray(pallaskit.jit(fn)(a, b, bias), np.float32)
    want = np.asarray(jax.jit(fn)(a, b, bias), np.float32)
    assert not np.isfinite(want[:5]).all()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=4e-3, atol=4e-3)


def test_oracle_gpu_rules():
    """gpu3 001: a float32 matvec epilogue, TF32 in the template, full float32 in XLA (1.1684 vs
    1.1677); gpu3 004: jax.jit's argmin on the GPU picks the third NaN (33), pallaskit and the
    reference the first (9). Both rules apply only where the GPU's run asks for them."""
    w = [np.array([1.167669, 0.5], np.float32)]
    g = [np.array([1.1683879, 0.5], np.float32)]
    assert oracle.compare(g, w, [False]) is not None
    assert oracle.compare(g, w, [False], tf32=True) is None
    assert oracle.compare([np.array([1.19, 0.5], np.float32)], w, [False], tf32=True) is not None
    ref = [np.array(9, np.int32)]
    assert oracle.compare([np.array(9, np.int32)], [np.array(33, np.int32)], [True], ref) is not None
    assert oracle.compare([np.array(9, np.int32)], [np.array(33, np.int32)], [True], ref, arg_outputs=(0,)) is None
    assert oracle.compare([np.array(12, np.int32)], [np.array(33, np.int32)], [True], ref, arg_outputs=(0,)) is not None


def test_oracle_passes_a_bf16_result_rounded_as_written():
    """session 20 fuzz 002: a bf16 einsum then .astype(float32). XLA:CPU leaves the dot's
    result unrounded; pallaskit stores it as bf16, as written, which is jax.jit's own answer
    without excess precision: the oracle passes it (and counts why), where before it
    reported a mismatch against the float64 reference."""
    inputs = [programs.Input("x1", (31, 16), "bfloat16", 0, 0.0, 1.0),
              programs.Input("x2", (16, 3), "bfloat16", 0, 0.0, 1.0),
              programs.Input("x4", (4,), "int32", 0, 0.0, 1.0)]
    lines = [programs.Line("v0", "jnp.einsum('...k,kn->...n', x1, x2)", ("x1", "x2"), "dot_general", "bfloat16"),
             programs.Line("v2", "v0.astype(F32)", ("v0",), "convert", "float32"),
             programs.Line("v5", "v2[x4]", ("v2", "x4"), "gather", "float32")]
    p = programs.Program(inputs, lines, ["v5"], [False], {})
    verdict = oracle.run(p)
    assert verdict.status in ("pass", "fallback"), verdict
    x1, x2, x4 = p.make_args()
    got = np.asarray(pallaskit.jit(p.function())(x1, x2, x4)[0])
    want = np.asarray(jax.jit(p.function())(x1, x2, x4)[0])
    if not np.array_equal(got, want):  # XLA kept the unrounded dot: the new rule decided
        assert verdict.detail == "rounded-as-written"
