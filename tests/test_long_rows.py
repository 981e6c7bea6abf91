"""Rows longer than one tile: online softmax (a looped max and sum of exp in one
sweep, [Note: online softmax] in lowering/codegen/rows.py) and persistent long
rows (heuristics.long_row_persistent), against jax.jit, with rows of -inf, +inf
and NaN."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering
import pallaskit
from lowering import heuristics
from lowering.options import CompileOptions

BF16 = jnp.bfloat16


def _rows(rng, cols, dtype):
    """Rows: plain; all -inf; one +inf; one NaN; -inf over the first 60% then
    plain with one -inf (the max grows chunk by chunk from nothing); plain + 500
    (exp(x) overflows without the shift)."""
    x = rng.standard_normal((6, cols)) * 3
    x[1] = -np.inf
    x[2, rng.integers(cols)] = np.inf
    x[3, rng.integers(cols)] = np.nan
    x[4, : (cols * 3) // 5] = -np.inf
    x[4, rng.integers((cols * 3) // 5, cols)] = -np.inf if cols > 1 else x[4, 0]
    x[5] += 500
    return jnp.asarray(x, dtype)


def _same(got, want, dtype=None):
    """Same NaN / ±inf positions, the rest close at ``dtype``'s tolerance (the
    outputs' own dtype unless given: a float32 loss of bf16 logits is a bf16 sum)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(g64), test(w64))
        finite = np.isfinite(w64)
        tol = dict(rtol=2e-2, atol=2e-2) if (dtype or w.dtype) == BF16 else dict(rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.where(finite, g64, 0), np.where(finite, w64, 0), **tol)


def _softmaxes(x):
    return jax.nn.softmax(x, -1), jax.nn.log_softmax(x, -1), jax.nn.logsumexp(x, -1)


# (columns, option long_rows): 8193 loops over 3 chunks or fits a 16384 tile;
# 50,257 (a GPT-2 vocabulary) loops over 13 chunks or fits a 65536 tile.
_PATHS = [(1, "auto"), (8193, "looped"), (8193, "auto"), (50257, "looped"), (50257, "persistent")]


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols,long_rows", _PATHS, ids=[f"{c}-{m}" for c, m in _PATHS])
def test_softmax_family_matches_jax(cols, long_rows, dtype, rng):
    x = _rows(rng, cols, dtype)
    with pallaskit.config.override(long_rows=long_rows, cache=False, num_sms=2):
        got = pallaskit.jit(_softmaxes)(x)
    _same(got, jax.jit(_softmaxes)(x))


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp"])
def test_each_alone_looped(fn, rng):
    """One function a kernel (its max read off the online accumulators), rows of
    8193 in 3 chunks."""
    f = getattr(jax.nn, fn)
    x = _rows(rng, 8193, jnp.float32)
    with pallaskit.config.override(long_rows="looped", cache=False):
        got = pallaskit.jit(lambda x: f(x, axis=-1))(x)
    _same(got, jax.jit(lambda x: f(x, axis=-1))(x))


def _xent(labels_by):
    def loss(logits, labels):
        ls = jax.nn.log_softmax(logits, axis=-1)
        if labels_by == "one_hot":  # optax's softmax_cross_entropy with one_hot labels
            picked = jnp.sum(ls * jax.nn.one_hot(labels, logits.shape[-1], dtype=ls.dtype), axis=-1)
        else:
            picked = jnp.take_along_axis(ls, labels[:, None], axis=-1)[:, 0]
        return -jnp.mean(picked.astype(jnp.float32))

    return jax.value_and_grad(loss)


@pytest.mark.parametrize("labels_by", ["one_hot", "take_along_axis"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols,long_rows", _PATHS[1:4:2] + _PATHS[4:], ids=["8193-looped", "50257-looped",
                                                                           "50257-persistent"])
def test_cross_entropy_matches_jax(cols, long_rows, dtype, labels_by, rng):
    """Forward and gradient; a row holds -inf logits away from its label (a
    masked vocabulary), another a NaN (loss and that row's gradient NaN)."""
    x = np.asarray(rng.standard_normal((3, cols)) * 3)
    labels = rng.integers(0, cols, 3).astype(np.int32)
    x[1, (labels[1] + 1 + np.arange(cols // 2)) % cols] = -np.inf
    f, ref = pallaskit.jit(_xent(labels_by)), jax.jit(_xent(labels_by))
    for nan in (False, True):
        if nan:
            x[2, rng.integers(cols)] = np.nan
        args = (jnp.asarray(x, dtype), jnp.asarray(labels))
        with pallaskit.config.override(long_rows=long_rows, cache=False, num_sms=2):
            got = f(*args)
        _same(got, ref(*args), dtype)


# --------------------------------------------------------------------------- #
# Which path: sweeps in the rendered source
# --------------------------------------------------------------------------- #
def _kernel_sources(fn, *args, **options):
    result = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), CompileOptions(**options))
    return [k.source for k in result.program.kernels]


@pytest.mark.parametrize("case", ["softmax", "cross_entropy"])
def test_online_softmax_is_one_sweep_for_max_and_sum(case):
    """A looped softmax kernel sweeps its rows twice (max and sum together, then
    the outputs), not three times; the cross-entropy forward+backward kernel too."""
    x = jax.ShapeDtypeStruct((64, 8193), BF16)
    if case == "softmax":
        fn, args = (lambda x: jax.nn.softmax(x, -1)), (x,)
    else:
        fn, args = _xent("one_hot"), (x, jax.ShapeDtypeStruct((64,), jnp.int32))
    loops = {}
    for online in (True, False):
        (main, *_) = _kernel_sources(fn, *args, long_rows="looped", online_softmax=online)
        loops[online] = main.count("lax.fori_loop(")
    assert loops == {True: 2, False: 3}, loops


def test_online_softmax_stays_off_for_persistent_rows():
    (src,) = _kernel_sources(lambda x: jax.nn.softmax(x, -1), jax.ShapeDtypeStruct((64, 1000), BF16))
    assert "lax.fori_loop(" not in src and "onl" not in src


def test_persistent_long_row_is_one_read():
    """long_rows='persistent': one 65536-wide tile a row, no loop, 32 warps."""
    (src,) = _kernel_sources(lambda x: jax.nn.softmax(x, -1), jax.ShapeDtypeStruct((64, 50257), BF16),
                             long_rows="persistent", num_sms=2)
    assert "lax.fori_loop(" not in src
    assert "BLOCK_R, BLOCK_C = 1, 65536" in src and "num_warps=32" in src
    assert src.count("plt.load(") == 1, src


def test_long_row_heuristics():
    p = heuristics.long_row_persistent
    assert not p(8192, 2, "auto", 8192)  # fits the ordinary tile: not a long row
    assert p(8193, 2, "auto", 8192) and p(32768, 4, "auto", 8192)
    assert not p(50257, 2, "auto", 8192)  # 65536 x 4 bytes of registers: looped, online
    assert not p(20000, 8, "auto", 8192)  # float64 halves it
    assert p(50257, 2, "persistent", 8192) and not p(65537, 2, "persistent", 8192)
    assert not p(8193, 4, "looped", 8192)
    assert not p(8193, 4, "auto", 64)  # a small max_persistent_cols asks for loops
    assert heuristics.long_row_warps(16384) == 16 and heuristics.long_row_warps(50257) == 32
    looped = heuristics.reduction_config(8192, 50257, max_persistent_cols=8192, inner_contiguous=True, itemsize=2)
    assert (looped.block_rows, looped.block_cols, looped.persistent) == (1, 4096, False)  # one 100 KB row a program


def test_small_max_persistent_cols_loops_online(rng):
    """max_persistent_cols=64 forces the looped path on rows of 300 (one chunk)."""
    x = _rows(rng, 300, jnp.float32)
    (src,) = _kernel_sources(_softmaxes, x, max_persistent_cols=64)
    assert src.count("lax.fori_loop(") == 2 and "onl0_" in src
    with pallaskit.config.override(max_persistent_cols=64, cache=False):
        got = pallaskit.jit(_softmaxes)(x)
    _same(got, jax.jit(_softmaxes)(x))


def test_sums_over_one_row_share_accumulators(rng):
    """softmax, log_softmax and logsumexp of x (three maxes, three sums over the
    same values) and the user's own max of x: one set of online accumulators, every
    max read off it (no max accumulator in the loop)."""
    def fn(x):
        return _softmaxes(x) + (jnp.max(x, -1),)

    x = np.array(_rows(rng, 8193, jnp.float32))
    x[3] = rng.standard_normal(8193)  # no NaN: jax.jit's CPU max drops it from long rows
    x = jnp.asarray(x)
    (src,) = _kernel_sources(fn, x, long_rows="looped")
    assert src.count("_m = jnp.full((BLOCK_R, 1)") == 1 and "acc0_" not in src, src
    with pallaskit.config.override(long_rows="looped", cache=False):
        got = pallaskit.jit(fn)(x)
    _same(got, jax.jit(fn)(x))


# --------------------------------------------------------------------------- #
# The raw-Triton dialect: the same row writer (codegen/rows.py), so the same sweep
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("online", [True, False], ids=["online", "two_sweeps"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols", [8193, 50257])
def test_triton_online_softmax_matches_jax(cols, dtype, online, rng, monkeypatch):
    """softmax / log_softmax / logsumexp over looped rows of 8193 (3 chunks) and
    50,257 (13) as raw Triton (Triton's interpreter), rows of -inf, +inf and NaN:
    with heuristics.TRITON_ONLINE_SOFTMAX max and sum share one sweep ([Note:
    online softmax]), as in Pallas; without it (the default) they take two."""
    pytest.importorskip("triton")
    from lowering import heuristics

    monkeypatch.setattr(heuristics, "TRITON_ONLINE_SOFTMAX", online)
    x = _rows(rng, cols, dtype)
    options = dict(long_rows="looped", num_sms=2)
    result = lowering.compile_jaxpr(jax.make_jaxpr(_softmaxes)(x),
                                    CompileOptions(interpret=True, kernel_backend="triton", triton_available=True,
                                                   **options))
    (main, *_) = result.program.kernels
    assert main.triton, main.executor
    loops = main.source.count("for chunk in range(")
    assert (loops, "onl0_0_m" in main.source) == ((2, True) if online else (3, False)), main.source
    with pallaskit.config.override(kernel_backend="triton", cache=False, **options):
        got = pallaskit.jit(_softmaxes)(x)
    _same(got, jax.jit(_softmaxes)(x))
