"""The raw-Triton renderer's op table and reductions (lowering/codegen/triton.py,
[Note: Triton math]) against jax.jit, with every kernel forced to raw Triton
(``kernel_backend='triton'``: Triton's interpreter on the CPU) and no fallback to
Pallas allowed. The regular suite runs the Pallas renderer on the CPU, so these
are what check the Triton spellings there; ``TEST_DISABLE_PALLAS_TRITON=1``
runs every test file that way.

- The Triton renderer writes every op and reduction of the Pallas renderer's table.
- Special values (NaN, +-inf, +-0, domain edges, ties) per op, float32 and
  bfloat16, and the int widths of the bit ops (on a GPU: compiled, ULP bounds
  at least GPU_FLOOR).
- The GPU spelling (libdevice calls) compiles for sm_90 through Triton's own
  stages, which run without a GPU (a subprocess: Triton's interpreter is chosen
  at its import).
"""
from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

pytest.importorskip("triton")

import lowering.executors  # noqa: E402
import pallaskit  # noqa: E402
from conftest import GPU_SPELLING_FIXTURE, cpu_reference, run_python_on_cpu, xla_default_jit  # noqa: E402
from lowering import ir  # noqa: E402
from lowering.codegen import pallas, triton as triton_codegen  # noqa: E402

BF16 = jnp.bfloat16
GPU = jax.default_backend() != "cpu"
# On a GPU the kernels compile for real: libdevice's functions, not XLA's, so every
# ULP bound is at least this (as tests/test_accuracy.py); NaN / inf positions stay exact.
GPU_FLOOR = 64

# Triton's interpreter computes with numpy, which warns on inf and NaN inputs
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture
def triton_only(monkeypatch):
    """Every kernel as raw Triton; a kernel the Triton renderer refuses fails."""
    def refuse(reason):
        raise AssertionError(f"fell back to Pallas: {reason}")

    monkeypatch.setattr(lowering.executors, "fallback", refuse)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        yield


# --------------------------------------------------------------------------- #
# Coverage of the Pallas renderer's table
# --------------------------------------------------------------------------- #
# Ops of the Pallas table that the Triton renderer leaves to XLA on purpose
# (each with the reason). Empty: it writes them all.
NOT_IN_TRITON: dict = {}

F32, I32, BOOL = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.bool_)
_INT_OPS = {"and", "or", "xor", "not", "shift_left", "shift_right_logical", "shift_right_arithmetic",
            "population_count", "clz"}
_PARAMS = {"integer_pow": (("y", 3),), "round": (("rounding_method", 1),), "convert_element_type": (("new_dtype", I32),),
           "bitcast_convert_type": (("new_dtype", I32),)}


def _op_of(name):
    template = pallas.OPS[name]
    arity = 3 if name in ("select_n", "clamp") else len({n for n in "0123" if "{%s}" % n in template})
    dt = I32 if name in _INT_OPS else F32
    args = [ir.Const(1, dt) for _ in range(arity)]
    if name == "select_n":
        args[0] = ir.Const(True, BOOL)
    out = BOOL if name in ("eq", "ne", "lt", "le", "gt", "ge", "is_finite") else dt
    return ir.Op(name, tuple(args), out, _PARAMS.get(name, ()))


@pytest.mark.parametrize("interpret", [False, True], ids=["gpu", "interpreter"])
def test_triton_renderer_writes_every_op_and_reduction_of_the_pallas_renderer(interpret):
    em = object.__new__(triton_codegen.TritonEmitter)  # op_template reads only the mode
    em.interpret = interpret
    missing = {}
    for name in pallas.OPS:
        try:
            em.op_template(_op_of(name), [f"v{i}" for i in range(3)])
        except triton_codegen.TritonUnsupported as e:
            missing[name] = str(e)
    assert set(missing) == set(NOT_IN_TRITON), missing
    assert set(pallas.REDUCE_FN) <= set(triton_codegen.REDUCE)


# --------------------------------------------------------------------------- #
# Special values, through Triton's interpreter
# --------------------------------------------------------------------------- #
_SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 2.0, -3.0, 0.999, -0.999,
            1e-30, -1e-30, 1e30, -1e30, 3e38, -3e38, 88.5, -88.5, 1e-5, 7.0, 1.0001, 0.9999]


def _float_input(rng, dtype, n=311):
    """The special values, then normal, uniform [-1.2, 1.2) and wide log-uniform
    values; no subnormals (XLA:CPU flushes them, the interpreter does not)."""
    x = np.concatenate([_SPECIAL, rng.standard_normal(n // 3) * 3, rng.uniform(-1.2, 1.2, n // 3),
                        np.exp(rng.uniform(-60, 60, n - 2 * (n // 3))) * rng.choice([-1, 1], n - 2 * (n // 3))])
    return jnp.asarray(x.astype(np.float32), dtype)


def _ulps(got, want, dtype):
    """Each float element's distance in ULPs of ``want`` (0 where both are equal,
    inf where exactly one is NaN or infinite or they differ in sign of zero)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    eps, tiny = (2.0 ** -7, 2.0 ** -126) if np.dtype(dtype) == np.dtype(BF16) else (2.0 ** -23, 2.0 ** -126)
    same = (g == w) & (np.signbit(g) == np.signbit(w)) | (np.isnan(g) & np.isnan(w))
    finite = np.isfinite(g) & np.isfinite(w)
    with np.errstate(divide="ignore", invalid="ignore"):
        spacing = 2.0 ** np.floor(np.log2(np.maximum(np.abs(np.where(finite, w, 1.0)), tiny))) * eps
        d = np.where(finite, np.abs(g - w) / spacing, np.inf)
    d = np.where((g == 0) & (w == 0), np.inf, d)  # zeros of opposite signs (equal zeros are ``same``)
    if GPU:  # compiled Triton flushes subnormal results to zero (the fuzz oracle's "subnormals flushed")
        same |= (g == 0) & (w != 0) & (np.abs(w) < tiny) & (np.signbit(g) == np.signbit(w))
    return np.where(same, 0.0, d)


# name -> (fn of one float array x, max ULPs float32, max ULPs bfloat16). Binary ops pair x
# with x reversed (specials meet specials and ordinary values).
FLOAT_OPS = {
    "atan2": (lambda x: jnp.arctan2(x, x[::-1]), 2, 1),
    "log1p": (jnp.log1p, 2, 1),
    "expm1": (jnp.expm1, 4, 1),  # jax.jit's float32 expm1 is ~3 ULP off near 0.23
    "cbrt": (jnp.cbrt, 2, 1),
    "tan": (jnp.tan, 2, 1),
    "asin": (jnp.arcsin, 2, 1),
    "acos": (jnp.arccos, 2, 1),
    "atan": (jnp.arctan, 2, 1),
    # jax.jit's float32 sinh and cosh (e^(x + log 1/2) in float32) are up to ~20 ULP off near overflow
    "sinh": (jnp.sinh, 32, 1),
    "cosh": (jnp.cosh, 32, 1),
    "asinh": (jnp.arcsinh, 2, 1),
    "acosh": (jnp.arccosh, 2, 1),
    "atanh": (jnp.arctanh, 2, 1),
    "tanh": (jnp.tanh, 4, 1),  # the interpreter's tanh (4 ULP near 2.2); tanh(-0) is -0
    "erf_inv": (lax.erf_inv, 2, 1),
    "pow": (lambda x: lax.pow(x, x[::-1]), 2, 1),
    "pow_int_exponent": (lambda x: lax.pow(x, jnp.arange(x.size, dtype=jnp.int32) % 9 - 4), 2, 1),
    "round_away": (lambda x: lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO), 0, 0),
    "round_even": (lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), 0, 0),
    "nextafter": (lambda x: jnp.nextafter(x, x[::-1]), 0, 0),
    "nextafter_self": (lambda x: jnp.nextafter(x, x), 0, 0),
    "neg": (lambda x: -x, 0, 0),
    "integer_pow_0": (lambda x: lax.integer_pow(x, 0) + x * 0, 0, 0),
}


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["float32", "bfloat16"])
def test_float_ops_with_special_values(dtype, rng, triton_only):
    """Every op of FLOAT_OPS in one program (its kernels all raw Triton), each
    within its bound of jax.jit (compiled with XLA's default options: [Note:
    the suite's XLA:CPU compiles] in tests/conftest.py), NaN, +-inf and the
    sign of zeros exact."""
    names = list(FLOAT_OPS)
    fn = lambda x: tuple(FLOAT_OPS[n][0](x) for n in names)  # noqa: E731
    x = _float_input(rng, dtype)
    failures = []
    for name, got, want in zip(names, pallaskit.jit(fn)(x), xla_default_jit(fn)(x)):
        assert got.dtype == want.dtype, name
        _, bound32, bound16 = FLOAT_OPS[name]
        bound = bound32 if dtype == jnp.float32 else bound16
        bound = max(bound, GPU_FLOOR) if GPU and bound else bound
        err = _ulps(got, want, dtype)
        worst = int(np.argmax(err))
        if err[worst] > bound:
            failures.append(f"{name}({float(x[worst])}) = {float(got[worst])}, jax.jit: {float(want[worst])} "
                            f"({err[worst]:.3g} ULP > {bound})")
    assert not failures, "\n".join(failures)


INT_DTYPES = [jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_bit_ops_every_width(dtype, rng, triton_only):
    """Shifts by amounts at and past the width (and negative ones, read as
    unsigned: every bit shifted out) and clz / population_count, exact."""
    info = np.iinfo(dtype)
    bits = 8 * np.dtype(dtype).itemsize
    x = rng.integers(info.min, info.max, size=(3, 67), endpoint=True).astype(dtype)
    x[0, :6] = [0, info.max, info.min, 1, info.max - 1, info.min + 1]
    amounts = np.arange(x.size).reshape(x.shape) % (bits + 3)
    if info.min < 0:
        amounts[2, :5] = [-1, -bits, info.min, bits - 1, bits]
    s = jnp.asarray(amounts.astype(dtype))

    def fn(x, s):
        return (lax.shift_left(x, s), lax.shift_right_logical(x, s), lax.shift_right_arithmetic(x, s),
                lax.clz(x), lax.population_count(x), x << 1, x >> 2)

    x = jnp.asarray(x)
    for g, w in zip(pallaskit.jit(fn)(x, s), jax.jit(fn)(x, s)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_sign_not_and_float_to_int_every_width(dtype, rng, triton_only):
    """sign and ~ of unsigned ints (sign compared them with -1, which Triton
    refuses; the interpreter's ~ built -1 in the unsigned type), and float32 /
    bfloat16 -> int conversion as XLA does it: NaN is 0, values past the
    range saturate (a plain cast left them undefined: INT_MIN in the interpreter)."""
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=(2, 37), endpoint=True).astype(dtype)
    x[0, :4] = [0, info.max, info.min, 1]
    edges = [np.nan, np.inf, -np.inf, 0.0, -0.0, -0.7, 0.7, 1e20, -1e20, info.max + 0.5, info.min - 0.5,
             float(info.max) * 2 + 3, float(info.min) * 2 - 3, info.max - 0.5, info.min + 0.5, 2.0 ** 31, -2.0 ** 31]
    f = (rng.standard_normal(67) * float(info.max) * 0.7).astype(np.float32)
    f[:len(edges)] = edges

    def fn(x, f):
        return jnp.sign(x), ~x, f.astype(dtype), f.astype(BF16).astype(dtype)

    x, f = jnp.asarray(x), jnp.asarray(f)
    for g, w in zip(pallaskit.jit(fn)(x, f), jax.jit(fn)(x, f)):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.float32, BF16, jnp.float16], ids=lambda d: np.dtype(d).name)
def test_neg_flips_the_sign_of_nan(dtype, triton_only):
    """Float neg is a flip of the sign bit, NaN included, as XLA:CPU's (jnp.signbit(-x)
    of a NaN x is True): written x * -1.0 it kept the NaN's sign in the interpreter
    ([Note: float neg flips the sign bit]). XLA:GPU makes every NaN the canonical +NaN,
    so the reference is the CPU's; compared are the sign bits and NaN positions."""
    x = jnp.asarray(np.array([np.nan, -np.nan, 0.0, -0.0, np.inf, -np.inf, 1.5, -2.5] * 3, np.float32), dtype)
    g, w = np.asarray(pallaskit.jit(lambda x: -x)(x), np.float32), np.asarray(cpu_reference(lambda x: -x, x), np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    np.testing.assert_array_equal(np.signbit(g), np.signbit(w))
    np.testing.assert_array_equal(g[~np.isnan(g)], w[~np.isnan(w)])


def test_float64_to_bfloat16(triton_only):
    """float64 -> bfloat16 rounds once to nearest even. Triton 3.6's interpreter read the
    float64 as the integer of bfloat16's bits (65519.99 gave a NaN, -1.004 a subnormal);
    pallaskit/runtime/triton_launch.py patches it. The last values are checked against
    their bits: subnormal results (XLA:CPU flushes them) and a double-rounding case,
    which a GPU's Triton and XLA:GPU round once (to 1.0078125) and XLA:CPU through
    float32 (to 1.0)."""
    exact = {1e-39: 0x000B, 2.0 ** -133: 0x0001, -(2.0 ** -135): 0x8000, 1 + 2 ** -8 + 2 ** -30: 0x3F81}
    with jax.enable_x64(True):
        v = np.array([65519.99, -1.0041, 3.0, -0.0, np.inf, -np.inf, np.nan, 1e30, -1e-30, 3.4e38, 0.1] + list(exact),
                     np.float64)
        x = jnp.asarray(v)
        got = np.asarray(pallaskit.jit(lambda x: x.astype(BF16))(x)).view(np.uint16)
        want = np.asarray(cpu_reference(lambda x: x.astype(BF16), x[:-len(exact)])).view(np.uint16)
    np.testing.assert_array_equal(got[:-len(exact)], want)
    np.testing.assert_array_equal(got[-len(exact):], list(exact.values()))


# --------------------------------------------------------------------------- #
# Reductions: prod, argmax, argmin (persistent and looped)
# --------------------------------------------------------------------------- #
def _reduction_input(rng, shape, dtype):
    if np.dtype(dtype) == np.bool_:
        return jnp.asarray(rng.random(shape) < 0.3)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(rng.integers(-3, 4, size=shape) if np.iinfo(dtype).min < 0 else rng.integers(0, 4, size=shape),
                           dtype)
    x = rng.choice(np.array([-1.25, -1.0, -0.8, 0.8, 1.0, 1.25, 0.0, -0.0]), size=shape)  # ties and zeros
    flat = x.reshape(-1)
    for v in (np.inf, -np.inf, np.nan):
        flat[rng.integers(0, flat.size, max(1, flat.size // 60))] = v
    flat[rng.integers(0, flat.size, max(1, flat.size // 8))] = 1.0  # rows of 1.0 ties
    x[0] = 1.0  # a row of all ties
    if shape[0] > 1:
        x[1] = np.nan  # a row of NaN
    return jnp.asarray(x, dtype)


def _reductions(x):
    out = [jnp.argmax(x, -1), jnp.argmin(x, -1), jnp.argmax(x, 0), jnp.argmin(x, 0)]
    if x.dtype != jnp.bool_:
        out += [jnp.prod(x, -1), jnp.prod(x, 0)]
    return out


@pytest.mark.parametrize("max_persistent_cols", [8192, 64], ids=["persistent", "looped"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_],
                         ids=lambda d: np.dtype(d).name)
def test_prod_argmax_argmin(dtype, max_persistent_cols, rng, triton_only):
    """NaN (the first one wins), ties (the first index), -0.0 == 0.0, rows of
    one value; rows of 150 (one tile, or three 64-wide chunks)."""
    x = _reduction_input(rng, (7, 150), dtype)
    with pallaskit.config.override(max_persistent_cols=max_persistent_cols):
        got = pallaskit.jit(_reductions)(x)
    # the CPU's jax.jit: XLA:GPU's argmax returns any NaN's index (conftest.cpu_reference)
    for g, w in zip(got, cpu_reference(_reductions, x)):
        assert g.dtype == w.dtype and g.shape == w.shape
        if jnp.issubdtype(w.dtype, jnp.floating):
            err = _ulps(g, w, w.dtype)
            bound = GPU_FLOOR if GPU else 4 if w.dtype == jnp.float32 else 1
            assert err.max() <= bound, (np.asarray(g), np.asarray(w))
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


# --------------------------------------------------------------------------- #
# The GPU spelling compiles (without a GPU)
# --------------------------------------------------------------------------- #
_COMPILE_SCRIPT = textwrap.dedent('''
    import os, sys
    os.environ.pop("TRITON_INTERPRET", None)
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import lowering
    from lowering.options import CompileOptions

    __GPU_SPELLING__

    def compile_gpu(fn, *args, max_persistent_cols=8192):
        opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True,
                              max_persistent_cols=max_persistent_cols)
        sched = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), opts).schedule
        for k in sched.kernels:
            compile_for_gpu(k, sched, opts)
        return len(sched.kernels)

    def floats(x):
        y = x[::-1]
        return (jnp.arctan2(x, y), jnp.log1p(x), jnp.expm1(x), jnp.cbrt(x), jnp.tan(x), jnp.arcsin(x),
                jnp.arccos(x), jnp.arctan(x), jnp.sinh(x), jnp.cosh(x), jnp.arcsinh(x), jnp.arccosh(x),
                jnp.arctanh(x), lax.erf_inv(x), lax.pow(x, y), lax.pow(x, jnp.arange(x.size, dtype=jnp.int32)),
                lax.round(x, 0), lax.round(x, 1), -x, lax.integer_pow(x, 0) + x, jnp.sqrt(x))

    def ints(x):
        return (lax.shift_left(x, x), lax.shift_right_logical(x, x), lax.shift_right_arithmetic(x, x),
                lax.clz(x), lax.population_count(x), jnp.sign(x), ~x,
                (x.astype(jnp.float32) * 0.5).astype(x.dtype), (x.astype(jnp.bfloat16) * 0.5).astype(x.dtype))

    def reductions(x):
        return jnp.argmax(x, -1), jnp.argmin(x, -1), jnp.prod(x, -1)

    def dropout(kd, x):  # threefry's uint32 rounds, the float bits, the mask (lowering/rules/prng.py)
        k = jax.random.wrap_key_data(kd)
        return jnp.where(jax.random.bernoulli(k, 0.9, x.shape), x / 0.9, 0), jax.random.bits(k, (7,), jnp.uint8)

    kernels = compile_gpu(dropout, jnp.zeros(2, jnp.uint32), jnp.ones((5, 150), jnp.float32))
    for dt in (jnp.float32, jnp.bfloat16):
        x = jnp.ones(300, dt)
        kernels += compile_gpu(floats, x)
        kernels += compile_gpu(lambda x: jnp.nextafter(x, x[::-1]), x.astype(jnp.float32))
    for dt in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32):
        kernels += compile_gpu(ints, jnp.ones(300, dt))
    for dt in (jnp.float32, jnp.bfloat16, jnp.int32, jnp.int8, jnp.bool_):
        for cols in (8192, 64):
            fn = reductions if dt != jnp.bool_ else (lambda x: (jnp.argmax(x, -1), jnp.argmin(x, -1)))
            kernels += compile_gpu(fn, jnp.ones((5, 150), dt), max_persistent_cols=cols)
    from lowering import heuristics
    for online in (False, True):  # two sweeps (the default) and online softmax: the loop's carried types hold
        heuristics.TRITON_ONLINE_SOFTMAX = online
        for dt in (jnp.float32, jnp.bfloat16):
            kernels += compile_gpu(lambda x: (jax.nn.softmax(x, -1), jax.nn.logsumexp(x, -1)),
                                   jnp.ones((5, 150), dt), max_persistent_cols=64)
    print("COMPILED", kernels)
''').replace("__GPU_SPELLING__", GPU_SPELLING_FIXTURE)


@pytest.mark.parametrize("dtype,spelling", [(jnp.bfloat16, "sqrt.approx.f32 $0, $1;"), (jnp.float32, "tl.sqrt_rn(")])
def test_gpu_sqrt_spelling(dtype, spelling):
    """On a GPU a 16-bit square root (computed in float32) takes PTX's
    approximate root in its subnormal-keeping form, not tl.sqrt (.ftz); a
    float32 one stays correctly rounded. (The GPU suite checks the values.)"""
    import lowering
    from lowering.codegen import triton as tc
    from lowering.options import CompileOptions

    opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True)
    sched = lowering.compile_jaxpr(jax.make_jaxpr(lambda x: jnp.sqrt(x) * 2)(jnp.ones(300, dtype)), opts).schedule
    source = "".join(tc.render_for_xla(k, sched, opts).source for k in sched.kernels)
    assert spelling in source and "tl.sqrt(" not in source
    other = "tl.sqrt_rn(" if dtype == jnp.bfloat16 else "sqrt.approx"
    assert other not in source


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cbrt_and_atan2_keep_subnormal_operands(dtype):
    """Triton compiles libdevice with FTZ: float32 cbrt of a subnormal gave NaN and
    atan2 of two tiny operands the angle of (+-0, +-0) (GPU fuzz). The GPU spelling
    scales tiny operands into the normal range first; on a GPU the values are
    checked against jax.jit (16-bit operands arrive as float32)."""
    import lowering
    from lowering.codegen import triton as tc
    from lowering.options import CompileOptions

    def f(x, y):
        return jnp.cbrt(x), jnp.arctan2(x, y), jnp.arctan2(x, jnp.cbrt(x))

    tiny = np.array([1.4e-45, -1.4e-45, 1e-40, -1e-40, 5e-39, -5e-39, 1.1e-38, 0.0, -0.0, 1.0, -2.0, np.nan,
                     np.inf, -np.inf, 3e-30, -7.0], np.float32)
    x, y = jnp.asarray(tiny, dtype), jnp.asarray(np.roll(tiny, 3), dtype)
    opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True)
    sched = lowering.compile_jaxpr(jax.make_jaxpr(f)(x, y), opts).schedule
    source = "".join(tc.render_for_xla(k, sched, opts).source for k in sched.kernels)
    assert "_cbrt32(" in source and "_atan2_32(" in source
    if GPU:
        with pallaskit.config.override(kernel_backend="triton", cache=False):
            got = pallaskit.jit(f)(x, y)
        for g, w in zip(got, jax.jit(f)(x, y)):  # libdevice on scaled operands: within an ulp or two
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=0,
                                       rtol=2e-6 if dtype == jnp.float32 else 1e-2, equal_nan=True)


@pytest.mark.skipif(GPU, reason="the GPU suite runs the kernels themselves")
def test_the_gpu_spelling_compiles():
    """libdevice's functions exist for the operand types, the bit ops and the
    argmax/argmin/prod reductions type-check: every kernel of the GPU spelling
    goes through Triton's stages to a cubin for sm_90."""
    proc = run_python_on_cpu(_COMPILE_SCRIPT, timeout=600)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr[-4000:]
    assert int(proc.stdout.split("COMPILED")[1].split()[0]) >= 20, proc.stdout
