"""Atomic scatters ([Note: atomic scatters] in lowering/ir.py): scatters with
more updates per element than the dense rule unrolls (an embedding's gradient,
``x.at[idx].add(v)`` / ``.max`` / ``.min`` / ``.multiply`` / ``.set`` with a long
``idx``, ``segment_sum`` / ``segment_max`` / ``segment_prod``, ``bincount``,
masks) as a raw-Triton kernel of atomics over the updates' domain (on the CPU in
Triton's interpreter), against jax.jit; kernel counts through explain; option
``deterministic_scatter``."""
import logging
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

import pallaskit  # noqa: E402
from conftest import GPU_SPELLING_FIXTURE, assert_close, cpu_reference, run_python_on_cpu  # noqa: E402

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _raw_triton():
    pallaskit.config.update(kernel_backend="triton")  # the scatter kernel is raw Triton only


def _values(rng, shape, dt, special=True):
    dt = np.dtype(dt)
    if dt.kind in "iu":
        return jnp.asarray(rng.integers(0 if dt.kind == "u" else -50, 50, shape), dt)
    x = rng.standard_normal(shape).astype(np.float32)
    if special and x.size >= 6:
        x.flat[:6] = [np.nan, np.inf, -np.inf, -0.0, np.inf, 0.0]
    return jnp.asarray(x, dt)


def _scatter_kernels(ex):
    return [k for k in ex.kernels if k.kind == "scatter"]


def _check(fn, *args, scatters=1, reference=None, tol_dtype=None):
    """pallaskit.jit(fn) against jax.jit(fn) (or ``reference``, a float32 truth for
    16-bit sums, whose order of rounding differs); ``scatters`` atomic kernels
    and no XLA fallback."""
    out = pallaskit.jit(fn)(*args)
    want = jax.jit(fn)(*args)
    ref = want if reference is None else reference
    for a, b, w in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref),
                       jax.tree_util.tree_leaves(want)):
        assert a.dtype == w.dtype and a.shape == w.shape, (a.dtype, w.dtype, a.shape, w.shape)
        assert_close(a, b, tol_dtype or w.dtype)
    ex = pallaskit.explain(fn, *args)
    assert list(ex.fallbacks) == [], ex.fallbacks
    assert len(_scatter_kernels(ex)) == scatters, str(ex)
    return ex


# --------------------------------------------------------------------------- #
# embedding gradients
# --------------------------------------------------------------------------- #
def _embedding_loss(t, i, w):
    return jnp.sum(jnp.tanh(t[i]) * w)


@pytest.mark.parametrize("v,d,ids_shape", [(50, 16, (2, 37)), (37, 1, (23,)), (11, 7, (1,)), (13, 130, (4, 9))])
def test_embedding_gradient(rng, v, d, ids_shape):
    table = _values(rng, (v, d), jnp.float32, special=False)
    ids = jnp.asarray(rng.integers(0, max(1, v // 3), ids_shape), jnp.int32)  # many repeats
    w = jnp.asarray(rng.standard_normal(ids_shape + (d,)), jnp.float32)
    grad = jax.grad(_embedding_loss)
    n = int(np.prod(ids_shape))
    ex = _check(grad, table, ids, w, scatters=1 if n > 8 else 0)  # a few ids: the dense rule
    if n > 8:
        # The gradient's producer (tanh's derivative times w, the gather it reads) fuses into the scatter;
        # the other kernel writes the zeros it starts from.
        (k,) = _scatter_kernels(ex)
        assert any("tanh" in eq for eq in k.equations) and any("gather" in eq for eq in k.equations), k.equations
        assert len(ex.kernels) == 2, str(ex)
        assert "tl.atomic_add(" in k.source and "aliases=(" in k.source
    out = jax.grad(pallaskit.jit(_embedding_loss))(table, ids, w)  # the forward compiled, its grad traced through
    assert_close(out, grad(table, ids, w))


def test_embedding_gradient_bf16_accumulates_in_float32(rng):
    table = _values(rng, (33, 12), BF16, special=False)
    ids = jnp.asarray(rng.integers(0, 5, (3, 40)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((3, 40, 12)), BF16)
    grad = jax.grad(_embedding_loss)
    # The float32 truth of the same bf16 inputs: jax.jit rounds each bf16 add, pallaskit once at the end.
    truth = jax.jit(jax.grad(lambda t, i, w: _embedding_loss(t.astype(jnp.float32), i, w.astype(jnp.float32))))(
        table, ids, w).astype(BF16)
    ex = _check(grad, table, ids, w, reference=truth)
    assert len(ex.kernels) == 3, str(ex)  # zeros (float32 scratch), the atomic adds, the bf16 result


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="Triton's interpreter has no 16-bit atomics")
def test_16bit_atomics_on_a_gpu(rng, monkeypatch):
    """heuristics.ATOMIC_16BIT_IN_FLOAT32 off: a GPU adds bfloat16 atomically, no float32 scratch."""
    from lowering import heuristics

    monkeypatch.setattr(heuristics, "ATOMIC_16BIT_IN_FLOAT32", False)
    table = _values(rng, (33, 12), BF16, special=False)
    ids = jnp.asarray(rng.integers(0, 30, (3, 40)), jnp.int32)  # a few repeats each: bf16 sums stay close
    w = jnp.asarray(rng.standard_normal((3, 40, 12)), BF16)
    grad = jax.grad(_embedding_loss)
    truth = jax.jit(jax.grad(lambda t, i, w: _embedding_loss(t.astype(jnp.float32), i, w.astype(jnp.float32))))(
        table, ids, w).astype(BF16)
    ex = _check(grad, table, ids, w, reference=truth)
    assert len(ex.kernels) == 2, str(ex)  # zeros, the atomic adds: in bfloat16


def test_embedding_gradient_of_flax_style_lookup_with_take(rng):
    """``jnp.take(table, ids, axis=0)`` (flax's nn.Embed) under value_and_grad with
    an out-of-range id (take's default mode fills the forward, drops the gradient)."""
    table = _values(rng, (19, 6), jnp.float32, special=False)
    ids = jnp.asarray(rng.integers(-2, 22, (30,)), jnp.int32)

    def loss(t, i):
        return jnp.sum(jnp.take(t, i, axis=0) ** 2)

    _check(jax.value_and_grad(loss), table, ids)


# --------------------------------------------------------------------------- #
# x.at[idx].add(v): modes, dtypes, special values
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("mode", [None, "drop", "clip", "promise_in_bounds"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32, jnp.uint32, jnp.int8])
def test_at_add_modes(rng, mode, dtype):
    x = _values(rng, (7, 5), dtype)
    lo, hi = (0, 7) if mode == "promise_in_bounds" else (-10, 10)  # negative, out of bounds (promise: in bounds)
    idx = jnp.asarray(rng.integers(lo, hi, (40,)), jnp.int32)
    v = _values(rng, (40, 5), dtype)
    _check(lambda x, i, v: x.at[i].add(v, mode=mode) * 2, x, idx, v)


@pytest.mark.parametrize("mode", ["drop", "clip"])
def test_at_add_bf16(rng, mode):
    x = _values(rng, (6, 3), BF16)
    idx = jnp.asarray(rng.integers(-8, 8, (50,)), jnp.int32)
    v = _values(rng, (50, 3), BF16)
    f = lambda x, i, v: x.at[i].add(v, mode=mode)  # noqa: E731
    truth = jax.jit(lambda x, i, v: f(x.astype(jnp.float32), i, v.astype(jnp.float32)))(x, idx, v).astype(BF16)
    _check(f, x, idx, v, reference=truth)


def test_scalar_updates_and_operand_read_after(rng):
    """Scalar updates broadcast over a long index; the operand is also read after
    the scatter, so the aliased launch must not write over it."""
    x = _values(rng, (9,), jnp.float32, special=False)
    idx = jnp.asarray(rng.integers(-3, 12, (33,)), jnp.int32)
    _check(lambda x, i: (x.at[i].add(1.5), x * 3), x, idx)


def test_operand_computed_and_read_on_both_sides(rng):
    """The operand is a kernel's result that the scatter's updates gather from and a
    later kernel reads again: no pointwise kernel may hold both its producer and
    that reader (a cycle through the scatter), and the aliased launch must leave
    the operand's buffer intact for the reader (XLA copies it). The updates read
    the operand (so does ``x.at[p].set(x[::-1])``'s): the launch updates a copy,
    or other programs would read it half updated (a GPU race the interpreter,
    which copies aliased buffers, cannot show; hence the check on the source)."""
    x = _values(rng, (9, 3), jnp.float32)
    idx = jnp.asarray(rng.integers(-10, 10, (30,)), jnp.int32)
    v = _values(rng, (30, 3), jnp.float32)
    perm = jnp.asarray(rng.permutation(9), jnp.int32)

    def f(x, i, v, p):
        y = jnp.sin(x) * 2
        return y.at[i].add(v * y[i]) + y, jnp.cos(y), x.at[p].set(x[::-1], unique_indices=True)

    ex = _check(f, x, idx, v, perm, scatters=2)
    assert len(ex.kernels) == 4, str(ex)  # y and its copy, cos(y) / the two scatters / the sum
    for k in _scatter_kernels(ex):
        aliased = int(re.search(r"aliases=\(\((\d+), 0\),\)", k.source).group(1))
        assert f"in_ptr{aliased} +" not in k.source, k.source


def test_two_dimensional_index_and_window(rng):
    """Indices into two operand dims and a window over the third; int64-free uint8 indices."""
    x = _values(rng, (6, 8, 4), jnp.float32)
    i = jnp.asarray(rng.integers(0, 9, (3, 10)), jnp.uint8)
    j = jnp.asarray(rng.integers(-2, 8, (3, 10)), jnp.int32)
    v = _values(rng, (3, 10, 4), jnp.float32)
    _check(lambda x, i, j, v: x.at[i, j].add(v, mode="drop"), x, i, j, v)


@pytest.mark.parametrize("mode", [jax.lax.GatherScatterMode.FILL_OR_DROP, jax.lax.GatherScatterMode.CLIP])
def test_windows_wider_than_one_row(rng, mode):
    """Each index starts a 3-row window (``hi`` = rows - 3): out-of-bounds starts dropped or clamped."""
    x = _values(rng, (10, 4), jnp.float32)
    idx = jnp.asarray(rng.integers(-2, 11, (12, 1)), jnp.int32)
    v = _values(rng, (12, 3, 4), jnp.float32)
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(0,))
    _check(lambda x, i, v: jax.lax.scatter_add(x, i, v, dn, mode=mode), x, idx, v)


def test_batched_scatter_under_vmap(rng):
    """vmap of a scatter-add: operand and indices batching dims."""
    x = _values(rng, (3, 7, 2), jnp.float32)
    idx = jnp.asarray(rng.integers(-1, 8, (3, 20)), jnp.int32)
    v = _values(rng, (3, 20, 2), jnp.float32)
    _check(jax.vmap(lambda x, i, v: x.at[i].add(v)), x, idx, v)


# --------------------------------------------------------------------------- #
# segment_sum, bincount
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32])
def test_segment_sum(rng, dtype):
    data = _values(rng, (45, 3), dtype)
    seg = jnp.asarray(rng.integers(-1, 9, (45,)), jnp.int32)  # out-of-range segments are dropped
    _check(lambda d, s: jax.ops.segment_sum(d, s, num_segments=7), data, seg)
    sorted_seg = jnp.sort(jnp.abs(seg))
    _check(lambda d, s: jax.ops.segment_sum(d, s, num_segments=9, indices_are_sorted=True), data, sorted_seg)


def test_bincount(rng):
    x = jnp.asarray(rng.integers(0, 12, (100,)), jnp.int32)
    w = _values(rng, (100,), jnp.float32, special=False)
    _check(lambda x: jnp.bincount(x, length=12), x)
    _check(lambda x, w: jnp.bincount(x, w, length=10), x, w)


# --------------------------------------------------------------------------- #
# x.at[idx].max / min / multiply / set, segment_max / prod, masks
# --------------------------------------------------------------------------- #
def _specials(rng, shape, dt):
    """Values whose first ten are NaN, -NaN, +-inf, and zeros of both signs (floats)."""
    dt = np.dtype(dt)
    if dt == np.bool_:
        return jnp.asarray(rng.random(shape) < 0.5)
    if dt.kind in "iu":
        return _values(rng, shape, dt)
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[:10] = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0], np.float32)[:x.size]
    return jnp.asarray(x, dt)


def _same_bits(got, want):
    """Equal, NaN where NaN, zeros of the same sign (a max / min is exact)."""
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
    if g.dtype.kind in "biu":
        np.testing.assert_array_equal(g, w)
        return
    g, w = g.astype(np.float64), w.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    ok = ~np.isnan(w)
    np.testing.assert_array_equal(g[ok], w[ok])
    np.testing.assert_array_equal(np.signbit(g[ok]), np.signbit(w[ok]))


@pytest.mark.parametrize("dtype,mode,shape", [
    (jnp.float32, None, (7, 5)), (BF16, "clip", (6, 3)), (jnp.int32, "drop", (7, 1)),
    (jnp.uint32, "promise_in_bounds", (5, 4)), (jnp.int8, "clip", (6, 3)), (jnp.bool_, None, (1, 5))])
def test_at_max_min_multiply(rng, dtype, mode, shape):
    """Many updates an element, repeated, negative and out-of-bounds indices (promise: in bounds), NaN of
    both signs, +-inf and +-0 in operand and updates: a max and a min bit for bit as jax.jit's, a product
    within the dtype's rounding (16-bit floats: of the float32 truth, as the float32 scratch rounds once)."""
    rows = shape[0]
    lo, hi = (0, rows) if mode == "promise_in_bounds" else (-rows - 3, rows + 3)
    idx = jnp.asarray(rng.integers(lo, hi, (41,)), jnp.int32)
    x = _specials(rng, shape, dtype)
    v = _specials(rng, (41,) + shape[1:], dtype)
    floats = jnp.issubdtype(dtype, jnp.floating)
    w = jnp.asarray(1 + 0.1 * np.asarray(v, np.float32), dtype) if floats else v  # products that stay finite
    products = dtype != jnp.bool_

    def f(x, i, v, w):
        out = (x.at[i].max(v, mode=mode), x.at[i].min(v, mode=mode))
        return out + (x.at[i].multiply(w, mode=mode),) if products else out

    got = pallaskit.jit(f)(x, idx, v, w)
    want = cpu_reference(f, x, idx, v, w)  # lax.max's +-0 and NaN
    _same_bits(got[0], want[0])
    _same_bits(got[1], want[1])
    if products:
        truth = want[2]
        if dtype == BF16:
            g32 = lambda x, i, v, w: f(x.astype(jnp.float32), i, v, w.astype(jnp.float32))[2]  # noqa: E731
            truth = jax.jit(g32)(x, idx, v, w).astype(BF16)
        assert_close(got[2], truth, dtype)
    ex = pallaskit.explain(f, x, idx, v, w)
    assert ex.fallbacks == [] and len(_scatter_kernels(ex)) == len(got), str(ex)
    if dtype == jnp.int32:  # 32 bits: no scratch, the operand itself (no kernel but the scatters)
        assert len(ex.kernels) == 3, str(ex)


def test_max_min_of_signed_zeros_and_nans():
    """Where +0 and -0 meet, max is +0 and min -0 in either order; a NaN of either sign, in the operand or
    an update, wins both (jax's lax.max / lax.min)."""
    x = jnp.asarray(np.array([0.0, -0.0, 0.0, -0.0, 1.0, np.nan, -np.nan, 2.0, -2.0], np.float32))
    idx = jnp.asarray([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8], jnp.int32)
    v = jnp.asarray(np.array([-0.0, -0.0, 0.0, 0.0, np.nan, 1.0, 1.0, -np.nan, -np.nan, 2.0, 3.0, -4.0,
                              -np.nan, np.nan], np.float32))
    f = lambda x, i, v: (x.at[i].max(v), x.at[i].min(v))  # noqa: E731
    got, want = pallaskit.jit(f)(x, idx, v), cpu_reference(f, x, idx, v)
    for g, w in zip(got, want):
        _same_bits(g, w)
    assert len(_scatter_kernels(pallaskit.explain(f, x, idx, v))) == 2


def _kept(idx, rows, mode):
    """Each update's destination row after jnp's wrap of negative indices, -1 where the mode drops it."""
    i = np.where(idx < 0, idx + rows, idx)
    if mode == "clip":
        return np.clip(i, 0, rows - 1)
    return np.where((i >= 0) & (i < rows), i, -1)


@pytest.mark.parametrize("dtype,mode", [(jnp.int8, "drop")])
def test_at_set_with_repeated_indices(rng, dtype, mode):
    """Which of several updates to one element lands is unspecified: each element holds one of its
    updates' values, or the operand's where none lands."""
    x = _values(rng, (9, 4), dtype)
    idx = np.asarray(rng.integers(-12, 12, (50,)), np.int32)
    v = _values(rng, (50, 4), dtype)
    f = lambda x, i, v: x.at[i].set(v * 2, mode=mode)  # noqa: E731
    got = np.asarray(pallaskit.jit(f)(x, jnp.asarray(idx), v))
    to = _kept(idx, 9, mode)
    want, vals = np.asarray(x), np.asarray(v * 2)
    for r in range(9):
        hits = vals[to == r]
        if not len(hits):
            np.testing.assert_array_equal(got[r], want[r])
        for c in range(4):
            assert not len(hits) or got[r, c] in hits[:, c] or np.isnan(got[r, c]) and np.isnan(hits[:, c]).any()
    ex = pallaskit.explain(f, x, jnp.asarray(idx), v)
    (k,) = _scatter_kernels(ex)
    assert ex.fallbacks == [] and len(ex.kernels) == 1 and any("mul" in eq for eq in k.equations), str(ex)


def test_masks_set_at_ids(rng):
    """``.at[ids].set(True)`` (one value: the same bits whichever lands) on a computed mask, and a set with
    unique indices: exact, as jax.jit's."""
    x = _values(rng, (30,), jnp.float32)
    ids = jnp.asarray(rng.integers(-40, 40, (45,)), jnp.int32)
    perm = jnp.asarray(rng.permutation(30)[:20], jnp.int32)
    v = _values(rng, (20,), jnp.float32)
    f = lambda x, i, p, v: ((x > 0).at[i].set(True), x.at[p].set(v, unique_indices=True))  # noqa: E731
    ex = _check(f, x, ids, perm, v, scatters=2)
    assert len(ex.kernels) == 3, str(ex)  # the mask x > 0 (the buffer its scatter updates in place), two scatters


def test_segments_with_their_producer_fused(rng):
    """GNN-style pooling: the messages' pointwise producer fuses into each scatter; the other kernels write
    the identities they start from."""
    data = _specials(rng, (60, 3), jnp.float32)
    seg = jnp.asarray(rng.integers(-1, 9, (60,)), jnp.int32)

    def f(d, s):
        m = jnp.tanh(d) * 0.5
        return jax.ops.segment_max(m, s, num_segments=8), jax.ops.segment_prod(m, s, num_segments=8)

    ex = _check(f, data, seg, scatters=2)
    assert all(any("tanh" in eq for eq in k.equations) for k in _scatter_kernels(ex)), str(ex)
    assert len(ex.kernels) == 3, str(ex)  # the fills of -inf and of 1 are one combo kernel


def test_float64_under_x64(rng):
    """float64 adds and maxes (and int64 indices) under jax_enable_x64."""
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        x = jnp.asarray(rng.standard_normal((7, 3)), jnp.float64)
        idx = jnp.asarray(rng.integers(-9, 9, (30,)), jnp.int64)
        v = jnp.asarray(rng.standard_normal((30, 3)), jnp.float64)
        ex = _check(lambda x, i, v: (x.at[i].add(v), x.at[i].max(v)), x, idx, v, scatters=2)
        assert all("tl.float64" in k.source for k in _scatter_kernels(ex)), str(ex)
    finally:
        jax.config.update("jax_enable_x64", before)


# --------------------------------------------------------------------------- #
# where atomics do not run
# --------------------------------------------------------------------------- #
def test_deterministic_scatter_runs_through_xla(rng, caplog):
    pallaskit.config.update(deterministic_scatter=True)
    table = _values(rng, (21, 5), jnp.float32, special=False)
    ids = jnp.asarray(rng.integers(0, 4, (40,)), jnp.int32)
    w = jnp.asarray(rng.standard_normal((40, 5)), jnp.float32)
    grad = pallaskit.jit(jax.grad(_embedding_loss))
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        first = np.asarray(grad(table, ids, w))
    assert any("scatter-add runs through XLA" in r.getMessage() for r in caplog.records), caplog.text
    again = np.asarray(pallaskit.jit(jax.grad(_embedding_loss))(table, ids, w))
    assert first.tobytes() == again.tobytes()  # bitwise the same
    assert_close(first, jax.jit(jax.grad(_embedding_loss))(table, ids, w))
    ex = pallaskit.explain(jax.grad(_embedding_loss), table, ids, w)
    assert ex.fallbacks == ["scatter-add"] and not _scatter_kernels(ex)

    from pallaskit import executable

    assert executable.compiler_options("gpu")["xla_gpu_exclude_nondeterministic_ops"] is True
    # XLA knows the flag (DebugOptions are every platform's: an unknown one is refused here too)
    jax.jit(lambda x: x * 2).lower(table).compile(compiler_options=executable.DETERMINISTIC_OPTIONS)
    pallaskit.config.update(deterministic_scatter=False)
    assert "xla_gpu_exclude_nondeterministic_ops" not in executable.compiler_options("gpu")


def test_deterministic_scatter_keeps_the_order_free_ones(rng):
    """Under deterministic_scatter only the scatters whose bits depend on the atomics' order run through
    XLA: a float sum or product, a set with repeated indices. Integer sums and products, maxes and mins
    of any dtype, a set of one value or with unique indices stay atomic."""
    pallaskit.config.update(deterministic_scatter=True)
    xf, xi = _values(rng, (12, 3), jnp.float32), _values(rng, (12, 3), jnp.int32)
    idx = jnp.asarray(rng.integers(-15, 15, (30,)), jnp.int32)
    perm = jnp.asarray(rng.permutation(12), jnp.int32)  # more than the dense rule's 8 updates an element
    vf, vi = _values(rng, (30, 3), jnp.float32), _values(rng, (30, 3), jnp.int32)

    def f(xf, xi, i, p, vf, vi):
        return (xi.at[i].add(vi), xi.at[i].mul(vi), xi.at[i].min(vi), xf.at[i].max(vf), xf.at[i].set(1.0),
                xf.at[p].set(vf[:12], unique_indices=True),  # atomic
                xf.at[i].add(vf), xf.at[i].mul(vf), xf.at[i].set(vf))  # XLA

    ex = pallaskit.explain(f, xf, xi, idx, perm, vf, vi)
    assert sorted(ex.fallbacks) == ["scatter", "scatter-add", "scatter-mul"], ex.fallbacks
    assert len(_scatter_kernels(ex)) == 6, str(ex)


def test_pallas_backend_leaves_it_to_xla(rng):
    """Only raw Triton writes the atomic kernel: under kernel_backend='pallas' the scatter runs through XLA."""
    pallaskit.config.update(kernel_backend="pallas")
    x = _values(rng, (7, 3), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 7, (40,)), jnp.int32)
    v = _values(rng, (40, 3), jnp.float32)
    f = lambda x, i, v: x.at[i].add(v) * 2.0  # noqa: E731
    assert_close(pallaskit.jit(f)(x, idx, v), jax.jit(f)(x, idx, v))
    assert pallaskit.explain(f, x, idx, v).fallbacks == ["scatter-add"]


def test_dtypes_raw_triton_cannot_store_stay_on_xla(rng):
    """A float8 set (raw Triton neither loads nor stores float8) runs through XLA, not into a kernel the
    renderer then refuses."""
    x = jnp.asarray(rng.standard_normal((7, 3)), jnp.float8_e4m3fn)
    idx = jnp.asarray(rng.integers(0, 7, (30,)), jnp.int32)
    v = jnp.asarray(rng.standard_normal((30, 3)), jnp.float8_e4m3fn)
    f = lambda x, i, v: x.at[i].set(v)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(pallaskit.jit(f)(x, idx, v), np.float32),
                                  np.asarray(jax.jit(f)(x, idx, v), np.float32))
    assert pallaskit.explain(f, x, idx, v).fallbacks == ["scatter"]


def test_symbolic_program_with_a_scatter_keeps_its_xla_path(rng):
    """Eager launches refuse a program with an atomic scatter (Launch has no
    aliased outputs): each size runs its XLA program, right."""
    pallaskit.config.update(dynamic_launch="on")
    idx = jnp.asarray(rng.integers(0, 7, (40,)), jnp.int32)
    v = _values(rng, (40, 3), jnp.float32, special=False)

    def f(x, i, v, y):
        return x.at[i].add(v), jnp.tanh(y) * 2

    g = pallaskit.jit(f, dynamic={"y": {0: "n"}})
    x = _values(rng, (7, 3), jnp.float32, special=False)
    for n in (5, 12):
        y = _values(rng, (n, 4), jnp.float32, special=False)
        for a, b in zip(g(x, idx, v, y), jax.jit(f)(x, idx, v, y)):
            assert_close(a, b)


def test_scatter_in_a_scan_body(rng):
    """A loop body's atomic scatter ([Note: loop bodies]): the carry is the operand."""
    x = _values(rng, (9, 2), jnp.float32, special=False)
    idx = jnp.asarray(rng.integers(-2, 11, (4, 30)), jnp.int32)
    v = _values(rng, (4, 30, 2), jnp.float32, special=False)

    def f(x, idx, v):
        def body(c, iv):
            c = c.at[iv[0]].add(jnp.sin(iv[1]))
            return c, c.sum()
        return jax.lax.scan(body, x, (idx, v))

    pallaskit.config.update(loop_bodies="on")
    out, ref = pallaskit.jit(f)(x, idx, v), jax.jit(f)(x, idx, v)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert_close(a, b)
    ex = pallaskit.explain(f, x, idx, v)
    assert ex.fallbacks == [] and any(k.kind == "scatter" and k.scope for k in ex.kernels), str(ex)


_GPU_SPELLING = textwrap.dedent('''
    import os, re
    os.environ.pop("TRITON_INTERPRET", None)
    import jax, jax.numpy as jnp, numpy as np
    import lowering
    from lowering import heuristics
    from lowering.options import CompileOptions

    __GPU_SPELLING__

    opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True)
    heuristics.ATOMIC_16BIT_IN_FLOAT32 = False  # bfloat16 adds in bfloat16 on a GPU
    for dt in (jnp.float32, jnp.int32, jnp.uint32, jnp.bfloat16):
        fn = lambda t, i, w: jnp.zeros_like(t).at[i].add(w * 2, mode="drop")
        args = (jnp.ones((50, 12), dt), jnp.zeros((40,), jnp.int32), jnp.ones((40, 12), dt))
        sched = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), opts).schedule
        (k,) = [k for k in sched.kernels if k.kind == "scatter"]
        ops = sorted(set(re.findall(r"atom\\.global\\.[\\w.]+", compile_for_gpu(k, sched, opts, "ptx").cubin.decode())))
        compile_for_gpu(k, sched, opts, "cubin")
        print("ATOMICS", np.dtype(dt).name, " ".join(ops), flush=True)
    for op, dt in (("max", jnp.float32), ("mul", jnp.float32)):
        fn = lambda t, i, w: getattr(t.at[i], op)(w, mode="drop")
        args = (jnp.ones((50, 12), dt), jnp.zeros((40,), jnp.int32), jnp.ones((40, 12), dt))
        sched = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), opts).schedule
        (k,) = [k for k in sched.kernels if k.kind == "scatter"]
        ptx = compile_for_gpu(k, sched, opts, "ptx").cubin.decode()
        compile_for_gpu(k, sched, opts, "cubin")
        ops = sorted(set(re.findall(r"(?:atom|st)\.global\.[\w.]+", ptx)))
        print("ATOMICS", f"{op}:{np.dtype(dt).name}", " ".join(ops), flush=True)
''').replace("__GPU_SPELLING__", GPU_SPELLING_FIXTURE)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the GPU suite runs the kernels themselves")
def test_the_gpu_spelling_compiles():
    """The scatter kernels' GPU spelling goes through Triton's stages to a cubin
    for sm_90: relaxed atomic adds of float32, int32, uint32 and (with
    heuristics.ATOMIC_16BIT_IN_FLOAT32 off) bfloat16; a float max (a signed
    max and an unsigned min on its bits), a float product's compare-and-swap
    loop."""
    proc = run_python_on_cpu(_GPU_SPELLING, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = dict(ln.split(" ", 2)[1:] for ln in proc.stdout.splitlines() if ln.startswith("ATOMICS"))
    assert "max.s32" in lines["max:float32"] and "min.u32" in lines["max:float32"], lines
    assert "cas.b32" in lines["mul:float32"], lines
    assert "relaxed.add" in lines["float32"] and "f32" in lines["float32"], lines
    assert "relaxed.add.u32" in lines["int32"] and "relaxed.add.u32" in lines["uint32"], lines
    assert "relaxed.add.noftz" in lines["bfloat16"] and "bf16" in lines["bfloat16"], lines
