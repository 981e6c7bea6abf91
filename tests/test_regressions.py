"""Regressions: wrong results and crashes found in review, one group per class.

1. Several reductions over the same tile (a max and a min of one row, argmax and
   argmin, any and all) shared one masked operand, padded with the first one's
   identity. Also constants that compare equal in Python (0.0 and -0.0), and
   identities past int32 (a uint32 min's 2**32 - 1) that jnp refused.
3. Effects (jax.debug.print, callbacks) crashed the lowering.
4. Complex literals crashed the renderer.
5. argmax / argmin over rows longer than one tile raised.
6. On the GPU, float max / min / clamp / argmax / argmin dropped NaN (Pallas
   lowers them to maxnum / minnum), and clz of 8-bit ints failed to compile.
9. An iota or random bits read at a run-time position (a gather, a dynamic
   slice) crashed the renderer: the position's load was no kernel input.
13. reduce_and / reduce_or of ints (bitwise) ran as min / max; a gather's fill_value and
    argmax's wrapping narrow indices were not jax's.

Every case compares with jax.jit on seeded data with special values; the
Triton renderer's cases run in Triton's interpreter."""
import contextlib

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import pallaskit
from conftest import assert_close, cpu_reference
from pallaskit import metrics

BF16 = jnp.bfloat16


def _special(rng, shape, dtype, nan=False):
    """Normal data with ±inf, ±0 (and NaN if asked) sprinkled in, as ``dtype``."""
    x = rng.standard_normal(shape) * 3
    flat = x.reshape(-1)
    k = max(1, flat.size // 50)
    for v in ([np.inf, -np.inf, 0.0, -0.0] + ([np.nan] if nan else [])):
        flat[rng.integers(0, flat.size, k)] = v
    if np.dtype(dtype) == np.bool_:
        return jnp.asarray(x > 2.5)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.asarray(np.clip(np.nan_to_num(np.round(x), posinf=50, neginf=-50), -50, 50), dtype)
    return jnp.asarray(x, dtype)


def _same(got, want, dtype=None):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w)
            continue
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        np.testing.assert_array_equal(np.isnan(g64), np.isnan(w64))
        np.testing.assert_array_equal(np.isposinf(g64), np.isposinf(w64))
        np.testing.assert_array_equal(np.isneginf(g64), np.isneginf(w64))
        finite = np.isfinite(w64)
        assert_close(np.where(finite, g64, 0), np.where(finite, w64, 0), dtype or w.dtype)


# --------------------------------------------------------------------------- #
# 1. Several reductions over one tile
# --------------------------------------------------------------------------- #
def _minmax(x):
    return x.min(-1), x.max(-1)


def _arg_both(x):
    return jnp.argmax(x, -1), jnp.argmin(x, -1)


def _any_all(x):
    m = x > 0
    return m.any(-1), m.all(-1), (~m).all(-1)


def _minmax_scale(x):
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    return (x - lo) / (hi - lo + 1.0)


def _every_kind(x):
    xf = x.astype(jnp.float32)
    return (xf.sum(-1), jnp.prod(jnp.tanh(xf) * 0.5 + 1.0, -1), x.max(-1), x.min(-1),
            jnp.argmax(x, -1), jnp.argmin(x, -1), jax.nn.logsumexp(xf, -1))


def _cumulative(x):
    return jnp.cumsum(x, -1), x.max(-1), x.min(-1)


def _softmax_and_standardize(x):
    s = jax.nn.softmax(x, -1)  # its max comes first in the kernel, then the mean's sum
    mu = x.mean(-1, keepdims=True)
    return s, (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True)), x.min(-1), x.max(-1)


ONE_TILE = {"minmax": _minmax, "argmax_argmin": _arg_both, "any_all": _any_all, "minmax_scale": _minmax_scale,
            "every_kind": _every_kind, "cumulative": _cumulative}


@pytest.mark.parametrize("max_persistent_cols", [8192, 64], ids=["persistent", "looped"])
@pytest.mark.parametrize("name", list(ONE_TILE))
def test_reductions_over_one_tile(name, max_persistent_cols, rng):
    """Rows of 100 (one masked tile, or two chunks of 64 when looped); finite
    data where min-max scaling divides by the range, ±inf and ±0 elsewhere."""
    fn = ONE_TILE[name]
    with pallaskit.config.override(max_persistent_cols=max_persistent_cols):
        for dtype in ([jnp.float32, BF16] if name in ("minmax_scale", "cumulative", "every_kind")
                      else [jnp.float32, BF16, jnp.int32]):
            x = (jnp.asarray(rng.standard_normal((5, 100)), dtype) if name == "minmax_scale"
                 else _special(rng, (5, 100), dtype))
            if name == "any_all":  # rows where all() holds either way
                x = x.at[1].set(jnp.abs(x[1]) + 1).at[2].set(-jnp.abs(x[2]) - 1)
            _same(pallaskit.jit(fn)(x), jax.jit(fn)(x), dtype)


def test_reductions_over_one_tile_bool():
    m = jnp.asarray(np.array([[True] * 50, [True] * 49 + [False], [False] * 50, [False] * 49 + [True]]))
    for cols in (8192, 16):
        with pallaskit.config.override(max_persistent_cols=cols):
            fn = lambda m: (m.any(-1), m.all(-1), jnp.argmax(m, -1), jnp.argmin(m, -1))  # noqa: E731
            _same(pallaskit.jit(fn)(m), jax.jit(fn)(m))


@pytest.mark.parametrize("dtype", [jnp.uint32, "uint64"])
def test_unsigned_min_identity(dtype, rng):
    """A min over uint32 pads its masked lanes with 2**32 - 1, which jnp reads as
    a weak int32 and refused (Pallas); uint64's under x64 likewise. Rows of 20 in
    a mix kernel (num_sms=1) beside a row reduction: masked rows and columns."""
    fn = lambda x: (x.max(-1), x.min(-1), x.min(0), (x * 3).max(0))  # noqa: E731
    with _x64() if dtype == "uint64" else contextlib.nullcontext(), pallaskit.config.override(num_sms=1, cache=False):
        bits = rng.integers(0, 2**63, (1100, 20), dtype=np.uint64) * 2 + 1
        x = jnp.asarray(bits if dtype == "uint64" else bits.astype(np.uint32))
        _same(pallaskit.jit(fn)(x), jax.jit(fn)(x))


def test_reductions_over_a_split_row(rng):
    """One long row: chunks plus a finisher over the chunks (a row the chunks
    divide evenly: no select in the chunk body, so the tiles' padding decides)."""
    x = jnp.asarray(rng.standard_normal((1, 400_000)), jnp.float32)
    _same(pallaskit.jit(_softmax_and_standardize)(x), jax.jit(_softmax_and_standardize)(x))
    # booleans' max and min over chunks that do not divide the row (their identities)
    m = jnp.asarray(rng.random((2, 400_003)) < np.array([[1e-6], [1 - 1e-6]]))
    fn = lambda m: (jnp.max(m, -1), jnp.min(m, -1), m.any(-1), m.all(-1))  # noqa: E731
    _same(pallaskit.jit(fn)(m), jax.jit(fn)(m))


def _row_and_column(x, w):
    return x.max(-1), x.min(-1), jnp.sum(x * w, 0), (x * w).max(0), (x * w).min(0)


def _rows_and_one_column(x, w):
    return x.max(-1), x.min(-1), jnp.sum(x * w, 0)


def _rows_with_argmax(x, w):
    return x.max(-1), x.min(-1), jnp.argmax(x, -1), jnp.argmin(x, -1), jnp.sum(x * w, 0)


@pytest.mark.parametrize("fn,triton_mix", [(_row_and_column, "pallas"), (_rows_with_argmax, "pallas"),
                                           (_rows_and_one_column, "triton")], ids=["columns", "argmax", "triton"])
def test_row_and_column_reductions_in_a_mix_kernel(fn, triton_mix, rng):
    """Row reductions of one tile inside a mix kernel (num_sms=1: the row work
    joins it at 1100 rows), Pallas or raw Triton (triton_call)."""
    pytest.importorskip("triton")
    x = _special(rng, (1100, 20), jnp.float32)  # 20 columns: one tile of 32 (Triton's interpreter is per element)
    w = jnp.asarray(rng.standard_normal(20), jnp.float32)
    with pallaskit.config.override(kernel_backend=triton_mix, num_sms=1, cache=False):
        jf = pallaskit.jit(fn)
        got = jf(x, w)
        kernels = pallaskit.explain(jf, x, w).kernels
    assert kernels[0].kind == "mix" and "_max" in kernels[0].name, [k.name for k in kernels]
    assert ("@triton.jit" in kernels[0].source) == (triton_mix == "triton")
    _same(got, jax.jit(fn)(x, w))


@pytest.mark.parametrize("cols", [100, 700], ids=["persistent", "looped"])
def test_triton_renderer_reductions_over_one_tile(cols, rng):
    """Eager launches (raw Triton in its interpreter) of a min and a max, and
    of any and all, over the same rows."""
    pytest.importorskip("triton")

    def fn(x):
        m = x > 0
        return x.min(-1), x.max(-1), m.any(-1), m.all(-1)

    pallaskit.config.update(dynamic_launch="on", max_persistent_cols=256)
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    for n in (3, 9):
        x = _special(rng, (n, cols), jnp.float32, nan=cols <= 128)  # XLA's CPU max drops NaN in long rows
        x = x.at[0].set(jnp.abs(x[0]) + 1.0)  # a row where all() holds
        before = metrics.counters["eager_launches"]
        got = f(x)
        assert metrics.counters["eager_launches"] == before + 1
        _same(got, jax.jit(fn)(x))


@pytest.mark.parametrize("cols", [100, 700], ids=["persistent", "looped"])
def test_triton_renderer_float_max_min_keep_nan(cols):
    """tl.max / tl.min drop NaN on the GPU (tl.maximum's default): float max and
    min reduce with a NaN-propagating combine. The interpreter keeps NaN either
    way, so this reads the source; the GPU run of the test above checks values."""
    from lowering import CompileOptions, compile_jaxpr
    from lowering.codegen import triton as triton_codegen

    fn = lambda x: (x.min(-1), x.max(-1), (x > 0).any(-1), x.astype(jnp.int32).max(-1))  # noqa: E731
    options = CompileOptions(max_persistent_cols=256)
    result = compile_jaxpr(jax.make_jaxpr(fn)(jnp.zeros((5, cols), jnp.float32)), options)
    source = triton_codegen.render(result.schedule, options).source
    assert source.count("tl.reduce(") == 2 and "def _max_nan(" in source and "def _min_nan(" in source, source
    assert "tl.max(" in source  # any() and the int max: no NaN to keep


def test_signed_zero_constants_stay_apart():
    x = jnp.arange(1.0, 6.0)
    fn = lambda x: (x * 0.0, x * -0.0, jnp.where(x > 2, 0.0, -0.0))  # noqa: E731
    got, want = pallaskit.jit(fn)(x), jax.jit(fn)(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.signbit(np.asarray(g)), np.signbit(np.asarray(w)))


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_plus_zero_keeps_negative_zero(kernel_backend):
    """XLA folds x + 0.0 to x, so jax.jit keeps x's -0.0 (IEEE's -0.0 + 0.0 is +0.0);
    Python's sum() of arrays starts at 0, accumulators at jnp.zeros. Pallas's
    interpreter computes with XLA, so on the CPU only the Triton renderer tells."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
    x = jnp.asarray([-0.0, 0.0, 1.0, -2.0, np.inf], jnp.float32)
    fn = lambda x: (x + 0.0, 1.0 / (0.0 + x * 2), sum([x, -x]), x.astype(BF16) + 0, jnp.zeros(5) + x)  # noqa: E731
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        got = pallaskit.jit(fn)(x)
    for g, w in zip(got, jax.jit(fn)(x)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(np.signbit(g), np.signbit(w))


# --------------------------------------------------------------------------- #
# 3. Effects
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("ordered", [False, True])
def test_debug_print_runs_once_per_call(ordered, capfd):
    x = jnp.arange(1.0, 5.0)

    def fn(x):
        jax.debug.print("first {}", x.sum(), ordered=ordered)
        y = jnp.exp(x) * 2.0
        jax.debug.print("second {}", y.max(), ordered=ordered)
        return y

    want = jax.block_until_ready(jax.jit(fn)(x))
    jax.effects_barrier()
    capfd.readouterr()
    f = pallaskit.jit(fn)
    got = [jax.block_until_ready(f(x)) for _ in range(2)]
    jax.effects_barrier()
    out = capfd.readouterr().out
    for g in got:
        _same(g, want)
    lines = [ln for ln in out.splitlines() if ln.startswith(("first", "second"))]
    words = [ln.split()[0] for ln in lines]
    # Unordered effects may run in any order (XLA schedules them as jax.jit's own do).
    assert words == ["first", "second"] * 2 if ordered else sorted(words) == ["first"] * 2 + ["second"] * 2, out
    first = [ln for ln in lines if ln.startswith("first")][0]
    second = [ln for ln in lines if ln.startswith("second")][0]
    assert first == "first 10.0" and abs(float(second.split()[1]) - float(jnp.exp(4.0) * 2)) < 1e-3, out
    assert metrics.counters["generated_kernel_count"] >= 1  # the rest still fuses into kernels


@pytest.mark.parametrize("ordered", [False, True])
def test_callbacks_run_once_per_call(ordered):
    seen = []
    x = jnp.arange(1.0, 7.0).reshape(2, 3)

    def fn(x):
        jax.debug.callback(lambda v: seen.append(("a", float(v))), x.max(), ordered=ordered)
        y = jnp.tanh(x).sum(-1)
        jax.debug.callback(lambda v: seen.append(("b", float(v[0]))), y, ordered=ordered)
        return y * 2

    want = jax.jit(fn)(x)
    jax.effects_barrier()
    seen.clear()
    f = pallaskit.jit(fn)
    for _ in range(2):
        _same(jax.block_until_ready(f(x)), want)
    jax.effects_barrier()
    names = [s[0] for s in seen]
    assert names == ["a", "b", "a", "b"] if ordered else sorted(names) == ["a", "a", "b", "b"], seen
    assert dict(seen) == {"a": 6.0, "b": pytest.approx(float(jnp.tanh(x[0]).sum()), abs=1e-5)}
    assert metrics.counters["generated_kernel_count"] >= 1


@pytest.mark.parametrize("ordered", [False, True])
def test_io_callback(ordered):
    x = jnp.arange(1.0, 5.0)

    def fn(x):
        y = io_callback(lambda v: np.asarray(v * 10, np.float32), jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                        ordered=ordered)
        return (jnp.exp(y * 0.01) + 1).sum()

    _same(pallaskit.jit(fn)(x), jax.jit(fn)(x))


def test_effect_without_other_work():
    seen = []

    def fn(x):
        jax.debug.callback(lambda v: seen.append(float(v)), x[1])
        return x

    x = jnp.arange(3.0)
    _same(pallaskit.jit(fn)(x), x)
    jax.effects_barrier()
    assert seen == [1.0]


def test_dynamic_program_with_effects_is_not_run_for_timing(rng):
    """A shape-generic program's multi-kernel dispatcher times its variants on a
    GPU by running them: a program with effects would print many times a call.
    It takes the nearest hint instead (the GPU branch, forced on the CPU)."""
    from pallaskit.runtime import multikernel

    seen = []

    def fn(x, w):
        jax.debug.callback(lambda v: seen.append(float(v)), x[0, 0])
        return jnp.tanh(x * 2.0 + w)

    pallaskit.config.update(multi_kernel_hints="64,4096", dynamic_launch="off")
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    x, w = jnp.asarray(rng.standard_normal((70, 4)), jnp.float32), jnp.asarray(rng.standard_normal(4), jnp.float32)
    d = f.lower_to_result(x[:5], w).executable
    assert isinstance(d, multikernel.Dispatcher) and len(d.variants) == 2
    d.interpret = False
    _same(f(x, w), jax.jit(fn)(x, w))
    jax.effects_barrier()
    assert seen == [float(x[0, 0])] * 2 and d.methods == {(70,): "nearest_hint"}  # ours and jax.jit's


# --------------------------------------------------------------------------- #
# 4. Complex numbers
# --------------------------------------------------------------------------- #
def _complex_cases(dtype, real):
    nan_inf = complex(float("nan"), float("inf"))
    return {
        "times_two": (lambda z: z * 2, "z"),
        "plus_1j": (lambda x: x * 2 + 1j, "x"),
        "nan_literal": (lambda z: z * nan_inf + jnp.exp(z), "z"),
        "abs_sum": (lambda z: jnp.abs(z * (1 - 2j)).sum() + 1.0, "z"),
        "parts": (lambda z: jnp.real(z * 3j) * 2.0 + jnp.imag(z) + jnp.tanh(jnp.abs(z)), "z"),
        "mixed": (lambda x: (jnp.exp(x) * (1 + 1j)).real.sum() + jnp.tanh(x).max(), "x"),
        "constant_output": (lambda x: (x * 2.0, jnp.asarray(1 + 2j, dtype)), "x"),
    }


@contextlib.contextmanager
def _x64():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


@pytest.mark.parametrize("x64", [False, True], ids=["complex64", "complex128"])
def test_complex_arithmetic(x64, rng):
    with _x64() if x64 else contextlib.nullcontext():
        dtype = jnp.complex128 if x64 else jnp.complex64
        real = jnp.float64 if x64 else jnp.float32
        z = jnp.asarray(rng.standard_normal(7) + 1j * rng.standard_normal(7), dtype)
        x = jnp.asarray(rng.standard_normal(7), real)
        for name, (fn, arg) in _complex_cases(dtype, real).items():
            a = z if arg == "z" else x
            got, want = pallaskit.jit(fn)(a), jax.jit(fn)(a)
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert g.dtype == w.dtype and g.shape == w.shape, name
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6, equal_nan=True,
                                           err_msg=name)


# --------------------------------------------------------------------------- #
# 5. argmax / argmin over long rows
# --------------------------------------------------------------------------- #
ARG_DTYPES = [jnp.float32, BF16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]


def _arg_input(rng, shape, dtype, kind):
    if kind == "nan":
        return _special(rng, shape, dtype, nan=True)
    x = rng.standard_normal(shape)
    if kind == "ties":
        x = np.round(x)
    elif kind == "inf":
        x = np.full(shape, -np.inf if rng.random() < 0.5 else np.inf)
        x.reshape(-1)[::7] = np.inf
    elif kind == "zeros":
        x = np.where(rng.random(shape) < 0.5, -0.0, 0.0)
    if np.dtype(dtype) == np.bool_:
        return jnp.asarray(x > 1.5)
    if jnp.issubdtype(dtype, jnp.integer):
        x = np.clip(np.nan_to_num(np.round(x * 3), posinf=9, neginf=-9), 0 if dtype == jnp.uint8 else -9, 9)
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("kind", ["nan", "ties", "inf", "zeros"])
@pytest.mark.parametrize("dtype", ARG_DTYPES, ids=lambda d: np.dtype(d).name)
def test_looped_argmax_argmin(dtype, kind, rng):
    if kind in ("nan", "inf", "zeros") and not jnp.issubdtype(dtype, jnp.floating):
        pytest.skip("no special values")

    def fn(x):
        return jnp.argmax(x, -1), jnp.argmin(x, -1), jnp.argmax(x, 0), jnp.argmin(x, 0, keepdims=True)

    with pallaskit.config.override(max_persistent_cols=64):  # rows of 300 loop over 64-wide chunks
        x = _arg_input(rng, (5, 300), dtype, kind)
        _same(pallaskit.jit(fn)(x), cpu_reference(fn, x))


@pytest.mark.parametrize("shape,axis", [((1, 8193), -1), ((8193, 2), 0), ((2, 9000, 3), 1), ((4, 1), -1),
                                        ((1, 1), 0), ((20000,), None)])
def test_argmax_argmin_at_default_tiles(shape, axis, rng):
    def fn(x):
        return jnp.argmax(x, axis), jnp.argmin(x, axis)

    x = _arg_input(rng, shape, jnp.float32, "nan")
    _same(pallaskit.jit(fn)(x), cpu_reference(fn, x))


# --------------------------------------------------------------------------- #
# 6. NaN through float max / min on the GPU; clz / population_count of narrow ints
# --------------------------------------------------------------------------- #
# The interpreter computes with XLA, which keeps NaN whatever the source says:
# the source tests check the NaN handling is there, the value tests (cases
# the GPU fuzzer found) check it for real when the suite runs on the GPU.
def _sources(fn, *args, **options):
    """The Pallas program's source and, where it renders, the raw Triton one."""
    from lowering import CompileOptions, compile_jaxpr
    from lowering.codegen import triton as triton_codegen

    options = CompileOptions(**options)
    result = compile_jaxpr(jax.make_jaxpr(fn)(*args), options)
    try:
        triton_source = triton_codegen.render(result.schedule, options).source
    except triton_codegen.TritonUnsupported:
        triton_source = None
    return result.program.source, triton_source


_NAN_CASES = {
    "max_rows": (lambda x: x.max(-1), "_reduce_fmax(", (5, 100), {}),
    "min_cols": (lambda x: jnp.min(x, 0), "_reduce_fmin(", (13, 16), {}),
    "max_looped": (lambda x: x.max(-1), "_fmax(acc", (5, 700), {"max_persistent_cols": 256}),
    "maximum": (lambda x: jnp.maximum(x, 0.0) * 2, "_fmax(", (5, 100), {}),
    "clip": (lambda x: jnp.clip(x, -1.0, 1.0), "_fmin(", (5, 100), {}),
    "clamp": (lambda x: jax.lax.clamp(-1.0, x, 1.0), "_fmin(_fmax(", (5, 100), {}),
    "argmax": (lambda x: jnp.argmax(x, -1), "_farg(", (5, 100), {}),
    "argmin_cols": (lambda x: jnp.argmin(x, 0), "_farg(", (1025, 64), {}),
}


@pytest.mark.parametrize("name", list(_NAN_CASES))
def test_float_max_min_source_keeps_nan(name):
    fn, marker, shape, options = _NAN_CASES[name]
    pallas_source, triton_source = _sources(fn, jnp.zeros(shape, jnp.float32), **options)
    assert marker in pallas_source, pallas_source
    if triton_source is not None and name.startswith("arg"):
        # _arg_pick: the first NaN's index if the row holds one; its tl.max / tl.min see no NaN
        assert "_arg_pick(" in triton_source and "anynan" in triton_source, triton_source
    elif triton_source is not None:  # its max / min: tl.maximum(..., propagate_nan=ALL) or the _max_nan combine
        assert "tl.max(" not in triton_source and "tl.min(" not in triton_source, triton_source
        assert "PropagateNan.ALL" in triton_source, triton_source


def test_int_max_min_source_unchanged():
    pallas_source, _ = _sources(lambda x: (x.max(-1), jnp.maximum(x, 3)), jnp.zeros((5, 100), jnp.int32))
    assert "_fmax" not in pallas_source and "_reduce_f" not in pallas_source, pallas_source


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["min_axis0", "relu", "max2", "clamp", "argmin_axis0", "argmax_rows",
                                  "looped_max_min"])
def test_float_max_min_keep_nan(case, dtype, rng):
    fn, shape = {
        "min_axis0": (lambda x: jnp.min(x, axis=0, keepdims=True), (13, 13, 16)),
        "relu": (lambda x: jnp.maximum(x, 0.0) * 2 + jnp.minimum(0.0, x), (37, 100)),
        "max2": (lambda x: jnp.maximum(x, x[::-1]) - jnp.minimum(x[::-1], x), (37, 100)),
        "clamp": (lambda x: jnp.clip(x, -1.0, 1.0) + jax.lax.clamp(x[::-1], x, jnp.asarray(2.0, x.dtype)), (37, 100)),
        "argmin_axis0": (lambda x: jnp.argmin(x, axis=0, keepdims=True), (1025, 64)),
        "argmax_rows": (lambda x: (jnp.argmax(x, -1), jnp.argmin(x, -1), x.max(-1)), (37, 300)),
        # rows of 700 loop over chunks (CPU XLA's own max drops NaN only in much longer rows)
        "looped_max_min": (lambda x: (x.max(-1), x.min(-1)), (9, 700)),
    }[case]
    x = _special(rng, shape, dtype, nan=True)
    with pallaskit.config.override(max_persistent_cols=256, cache=False):
        got = pallaskit.jit(fn)(x)
    if case == "looped_max_min":  # XLA's CPU reduce drops NaN in some long rows: numpy keeps it, as XLA specifies
        x32 = np.asarray(x, np.float32)
        want = tuple(jnp.asarray(r, dtype) for r in (x32.max(-1), x32.min(-1)))
    elif "arg" in case:
        want = cpu_reference(fn, x)
    else:
        want = jax.jit(fn)(x)
    assert any(np.isnan(np.asarray(w, np.float64)).any() for w in jax.tree.leaves(want)
               if jnp.issubdtype(w.dtype, jnp.floating)) or "arg" in case
    _same(got, want)


def test_float_max_min_signed_zero():
    """max / min of -0.0 and 0.0, bit for bit as jax.jit (the fuzzer compares max / min exactly)."""
    a = jnp.asarray(np.tile([-0.0, 0.0, -0.0, 0.0, np.nan, 1.0], 50), jnp.float32)
    b = jnp.asarray(np.tile([0.0, -0.0, -0.0, 0.0, -0.0, np.nan], 50), jnp.float32)
    fn = lambda a, b: (jnp.maximum(a, b), jnp.minimum(a, b), jnp.clip(a, b, 1.0))  # noqa: E731
    with pallaskit.config.override(cache=False):
        got = pallaskit.jit(fn)(a, b)
    for g, w in zip(got, jax.jit(fn)(a, b)):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_array_equal(np.signbit(g[~np.isnan(w)]), np.signbit(w[~np.isnan(w)]))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32],
                         ids=lambda d: np.dtype(d).name)
def test_clz_population_count_narrow_ints(dtype, rng):
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=(7, 512), endpoint=True).astype(dtype)
    x[0, :4] = [0, info.max, info.min, 1]
    fn = lambda x: (jax.lax.clz(x), jax.lax.population_count(x), jax.lax.clz(x) + x)  # noqa: E731
    with pallaskit.config.override(cache=False):
        got = pallaskit.jit(fn)(jnp.asarray(x))
    _same(got, jax.jit(fn)(jnp.asarray(x)))
    if np.dtype(dtype).itemsize < 4 or np.dtype(dtype).kind == "u":  # Triton's math.ctlz fallback fails on these
        source, _ = _sources(fn, jnp.asarray(x))
        assert "lax.clz(" in source and ("jnp.int32) & " in source or "bitcast_convert_type" in source), source


def test_fusion_sees_the_program_order_of_effects(capsys):
    """Two scalar groups, one read by a debug print and one reading an
    ordered callback after it: merged, the effects' program order made a
    cycle the fusion's cycle check did not see ('cycle in schedule')."""

    def f(x, y):
        a = jnp.sin(x) * 2
        jax.debug.print("a={}", a)
        c = io_callback(lambda v: np.float32(v + 1), jax.ShapeDtypeStruct((), jnp.float32), y, ordered=True)
        return a, jnp.cos(c) * 3

    x, y = jnp.float32(0.5), jnp.float32(1.5)
    got = pallaskit.jit(f)(x, y)
    want = jax.jit(f)(x, y)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    assert capsys.readouterr().out.count("a=") == 2


# --------------------------------------------------------------------------- #
# 7. Integer division and remainder by zero, and INT_MIN / -1
# --------------------------------------------------------------------------- #
# Undefined in Triton / PTX (the GPU fuzzer: uint8 x % 0 gave 255); XLA defines
# x / 0 = -1 (all ones), x % 0 = x, INT_MIN / -1 = INT_MIN, INT_MIN % -1 = 0.
# Pallas' interpret mode computes with XLA, so its value test checks the GPU
# only; the source test and the Triton interpreter check the CPU.
_INT_DTYPES = [jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32]


def _div_operands(dtype, rng, shape=(5, 37)):
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    y = rng.integers(max(info.min, -4), 5, size=shape).astype(dtype)  # many zeros (and -1s)
    x[0, :6] = [info.min, info.min, info.max, 0, 7, info.min]
    y[0, :6] = [0, -1 if info.min else 1, 0, 0, 0, 1]
    return jnp.asarray(x), jnp.asarray(y)


def _div_rem(x, y):
    return jax.lax.div(x, y), jax.lax.rem(x, y), jax.lax.rem(x, y) * 3 + jax.lax.div(x, jax.lax.rev(y, (0,)))


@pytest.mark.parametrize("dtype", _INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_int_div_rem_by_zero(dtype, rng):
    x, y = _div_operands(dtype, rng)
    assert (np.asarray(y) == 0).any()
    with pallaskit.config.override(cache=False):
        got = pallaskit.jit(_div_rem)(x, y)
    _same(got, jax.jit(_div_rem)(x, y))
    pallas_source, triton_source = _sources(_div_rem, x, y)
    assert "_idiv(" in pallas_source and "_irem(" in pallas_source and "lax.div(" not in pallas_source.split(
        "def _irem")[-1].split("def ")[0], pallas_source
    if triton_source is not None:
        assert "_idiv(" in triton_source and "_irem(" in triton_source, triton_source


@pytest.mark.parametrize("dtype", _INT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_triton_renderer_int_div_rem_by_zero(dtype, rng):
    """Eager raw-Triton launches (Triton's interpreter on the CPU: numpy gives 0 for x // 0)."""
    pytest.importorskip("triton")
    pallaskit.config.update(dynamic_launch="on")
    f = pallaskit.jit(_div_rem, dynamic={"x": {1: "n"}, "y": {1: "n"}})
    for n in (37, 6):
        x, y = _div_operands(dtype, rng, (5, n))
        before = metrics.counters["eager_launches"]
        got = f(x, y)
        assert metrics.counters["eager_launches"] == before + 1
        _same(got, jax.jit(_div_rem)(x, y))


# --------------------------------------------------------------------------- #
# 8. A one-hot times values: XLA rewrites convert(pred) * x as select(pred, x, 0)
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_one_hot_times_infinite_values_is_a_select(kernel_backend):
    """jax.jit gives 0 where the one-hot is 0, whatever x holds (inf, NaN);
    computed as written, 0 * inf is NaN (the GPU's cross-entropy with one_hot
    labels over a row with -inf logits). Triton's interpreter computes as written."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    x = jnp.asarray([[np.inf, -np.inf, np.nan, 1.0], [2.0, np.inf, 3.0, np.nan]], jnp.float32)
    labels = jnp.asarray([3, 0])
    fn = lambda l, x: (jax.nn.one_hot(l, 4) * x, x * (l[:, None] == 1))  # noqa: E731
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        got = pallaskit.jit(fn)(labels, x)
    _same(got, jax.jit(fn)(labels, x))


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float16, BF16], ids=["f16", "bf16"])
def test_one_hot_times_infinite_16bit_values(kernel_backend, dtype):
    """float16 is a type XLA:CPU computes in, so jax.jit rewrites its one-hot
    products as selects there too (0 where the one-hot is 0); bfloat16 it computes
    in float32 behind converts the rewrite does not see through (NaN). Interpret
    mode left every 16-bit product as written: NaN for float16 where jax.jit gives 0."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    x = jnp.asarray([[np.inf, -np.inf, np.nan, 1.0], [2.0, np.inf, 3.0, np.nan]], dtype)
    labels = jnp.asarray([3, 0])
    fn = lambda l, x: (jax.nn.one_hot(l, 4, dtype=x.dtype) * x,  # noqa: E731
                       x * (l[:, None] == 1).astype(x.dtype), jax.nn.one_hot(l, 4, dtype=x.dtype) * x * 2 + 1)
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        got = pallaskit.jit(fn)(labels, x)
    _same(got, jax.jit(fn)(labels, x))


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, BF16], ids=["f32", "f16", "bf16"])
def test_mask_product_is_a_select(kernel_backend, dtype):
    """XLA rewrites any ``convert(pred) * x`` with the predicate at the product's
    shape, not only a one-hot's: ``x * (y > 0)``, ``loss * mask`` give 0 (+0.0)
    where the mask is False, whatever x holds. The kernels multiplied: NaN for
    inf / NaN under a False (on the GPU; float16 also in interpret mode), -0.0
    for a negative x."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    x = jnp.asarray([[np.inf, -np.inf, np.nan, 1.0, -2.0], [2.0, np.inf, -3.0, np.nan, -0.5]], dtype)
    y = jnp.asarray([[-1.0, 1.0, -2.0, 3.0, -1.0], [1.0, -1.0, -1.0, -1.0, 2.0]], jnp.float32)
    mask = jnp.asarray([[False, False, True, False, False], [True, False, False, False, True]])
    fn = lambda x, y, m: (x * (y > 0), (y < 0).astype(x.dtype) * x, x * m * 2, jnp.sum(x * m, axis=1),  # noqa: E731
                          x[:1] * (y[1] > 0))  # the mask's convert, then a reshape to (1, 5)
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        got = pallaskit.jit(fn)(x, y, mask)
    want = jax.jit(fn)(x, y, mask)
    _same(got, want)
    for g, w in zip(got, want):  # the signs of zeros (a NaN's is no value's)
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.signbit(g) & ~np.isnan(w), np.signbit(w) & ~np.isnan(w))


# --------------------------------------------------------------------------- #
# 9. An iota or random bits read at a run-time position
# --------------------------------------------------------------------------- #
def test_index_values_at_run_time_positions(rng):
    """``arange(n)[ids]``, a dynamic slice of an iota, random bits gathered: the
    index value's position holds a loaded value (an indirect index), whose
    load the kernel did not take as an input (KeyError when rendering). A
    per-shard program slices a whole random tensor by ``axis_index`` so."""
    def f(ids, i, key, x):
        return (jnp.arange(10)[ids][ids[:3] % 4], jax.lax.dynamic_slice_in_dim(jnp.arange(8.0), i, 4) * x,
                jax.random.bits(key, (8, 3))[ids % 8])

    args = (jnp.asarray(rng.integers(0, 10, (5,)), jnp.int32), jnp.int32(3), jax.random.PRNGKey(7),
            jnp.asarray(rng.standard_normal(4), jnp.float32))
    with pallaskit.config.override(cache=False):
        got = pallaskit.jit(f)(*args)
    _same(got, jax.jit(f)(*args))


# --------------------------------------------------------------------------- #
# 10. float16 chains round every op, as jax.jit's do
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_float16_chains_round_every_op(kernel_backend, rng):
    """XLA keeps bfloat16 chains in float32 (allow_excess_precision), but float16
    is a type its backends compute in: jax.jit's x * x / x of 300 is inf, and an
    optimizer's float16 second moment g * g overflows or underflows to inf / 0
    (a loss-scaled float16 step's update is then inf). pallaskit kept float16
    chains in float32 as bfloat16's, so it gave 300 and finite updates."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    g = np.concatenate([rng.standard_normal(30) * 400, rng.standard_normal(30) * 1e-4, rng.standard_normal(30)])
    g = jnp.asarray(g, jnp.float16)
    y = jnp.asarray(rng.standard_normal(g.shape) + 3, jnp.float16)

    def fn(g, y):
        nu = 0.999 * y + 0.001 * (g * g)
        return (g * g) / y, g * g * y - g, g / (jnp.sqrt(nu) + jnp.float16(1e-3)), (g * y) * g

    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        got = pallaskit.jit(fn)(g, y)
    want = jax.jit(fn)(g, y)
    assert any(np.isinf(np.asarray(w, np.float32)).any() for w in want)
    _same(got, want)


# --------------------------------------------------------------------------- #
# 11. A NaN literal keeps its sign
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_a_negative_nan_literal_keeps_its_sign(kernel_backend, rng):
    """-NaN in the program (a literal) was written ``float('nan')``: copysign and
    signbit of it, and a select passing it through, read a positive NaN."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    neg_nan = np.copysign(np.float32(np.nan), np.float32(-1))
    x = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    fn = lambda x: (jnp.copysign(jnp.float32(2), jnp.where(x > 0, neg_nan, x)),  # noqa: E731
                    jnp.signbit(jnp.where(x > 0, neg_nan, -x)), jnp.where(x > 0, neg_nan, x) * 3)
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        got = pallaskit.jit(fn)(x)
    want = jax.jit(fn)(x)
    _same(got, want)
    np.testing.assert_array_equal(np.signbit(np.asarray(got[2])), np.signbit(np.asarray(want[2])))


# --------------------------------------------------------------------------- #
# 12. Odd programs: float64 special functions, ...
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_float64_erf_keeps_double_precision(kernel_backend, rng):
    """erf / erfc / erf_inv of float64 ran the kernels' float32 polynomials (7
    digits) where jax.jit computes them in double precision."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    with _x64():
        x = jnp.asarray(rng.standard_normal((4, 9)) * 2, jnp.float64)
        fn = lambda x: (jax.lax.erf(x) * 3.0, jax.lax.erfc(x) + 1.0, jax.lax.erf_inv(jnp.tanh(x)))  # noqa: E731
        with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
            got = pallaskit.jit(fn)(x)
        want = jax.jit(fn)(x)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_mask_product_over_a_dynamic_dim_is_a_select(kernel_backend):
    """The mask product's select (test_mask_product_is_a_select) under a symbolic
    size: the rule compares element counts without converting a symbol to an int
    (it raised, and every size compiled on its own)."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    fn = lambda x, y: (x * (y > 0), (x.T * (y.T < 0)).sum(0))  # noqa: E731
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}, "y": {0: "n"}})
    before = pallaskit.metrics.counters["dynamic_fallbacks"]
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        for n in (3, 7):
            x = jnp.asarray(np.where(np.arange(n * 5).reshape(n, 5) % 3 == 0, np.inf, -1.5), jnp.float32)
            y = jnp.asarray(np.linspace(-1, 1, n * 5).reshape(n, 5), jnp.float32)
            got, want = f(x, y), jax.jit(fn)(x, y)
            _same(got, want)
            np.testing.assert_array_equal(np.signbit(np.asarray(got[0])), np.signbit(np.asarray(want[0])))
    assert pallaskit.metrics.counters["dynamic_fallbacks"] == before


# --------------------------------------------------------------------------- #
# 13. Integer and bit-level programs
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8], ids=["int32", "uint8"])
def test_int_reduce_and_or_are_bitwise(kernel_backend, dtype, rng):
    """reduce_and / reduce_or of ints are bitwise (jnp.bitwise_and.reduce, lax.reduce_and
    of an int array); the kernels' and / or reductions are min / max over bools, so a
    row's AND came out as its minimum. Ints run through XLA; bools keep their kernel."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    info = np.iinfo(dtype)
    x = jnp.asarray(rng.integers(info.min, info.max, size=(5, 7), endpoint=True), dtype)

    def fn(x):
        return (jnp.bitwise_and.reduce(x, axis=1), jnp.bitwise_or.reduce(x, axis=0),
                jax.lax.reduce_or_p.bind(x, axes=(0, 1)), jnp.all(x > 3, axis=1), jnp.any(x > 3, axis=0))

    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        jf = pallaskit.jit(fn)
        got = jf(x)
        assert sorted(pallaskit.explain(jf, x).fallbacks) == ["reduce_and", "reduce_or"]
    _same(got, jax.jit(fn)(x))


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_gather_fill_value_cast_as_jax_casts_it(kernel_backend):
    """A gather's fill_value is a Python scalar that jax casts with NumPy (full_like):
    -7 is 249 as a uint8, 300 is 44 as an int8, 2.7 is 2, 1e10 NumPy's int32 of it. The
    rule kept the raw value: Triton's tl.full refused -7 as a uint8, Pallas wrote
    int(1e10) into an int32 (and int(nan) raised)."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    i = jnp.asarray([0, 9, -1, 3, 100], jnp.int32)

    def fn(x, i):
        return tuple(jnp.take(x.astype(dt), i, mode="fill", fill_value=v)
                     for dt, v in ((jnp.uint8, -7), (jnp.int8, 300), (jnp.int32, 2.7), (jnp.int32, 1e10)))

    x = jnp.arange(5, dtype=jnp.int32)
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False), np.errstate(invalid="ignore"):
        got = pallaskit.jit(fn)(x, i)
        want = jax.jit(fn)(x, i)
    _same(got, want)


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_argmax_with_indices_that_wrap(kernel_backend):
    """lax.argmax with an index dtype too narrow for the axis (int8 over 130
    columns): XLA's reducer compares the wrapped indices, so of the tied maxima at
    1 and 129 it returns 129's (-127); the kernels picked 1. Those run through XLA;
    an int16 index over the same axis keeps its kernel."""
    if kernel_backend == "triton":
        pytest.importorskip("triton")
        if jax.default_backend() == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton's interpreter is not on")
    x = np.zeros((2, 130), np.float32)
    x[0, 128], x[1, 1], x[1, 129] = 5, 3, 3
    x = jnp.asarray(x)

    def fn(x):
        return jax.lax.argmax(x, 1, jnp.int8), jax.lax.argmin(-x, 1, jnp.int8), jax.lax.argmax(x, 1, jnp.int16)

    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        jf = pallaskit.jit(fn)
        got = jf(x)
        assert sorted(pallaskit.explain(jf, x).fallbacks) == ["argmax", "argmin"]
    _same(got, jax.jit(fn)(x))
