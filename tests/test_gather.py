"""Indexing by run-time values inside kernels (lowering/rules/gather.py,
[Note: indirect indexing] in lowering/ir.py): gather, scatter-add,
dynamic_slice, dynamic_update_slice and one_hot against jax.jit, with
out-of-bounds, negative and repeated indices; kernel counts through explain."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close

BF16 = jnp.bfloat16
DTYPES = [jnp.float32, BF16, jnp.int32, jnp.int8, jnp.bool_]


def _values(rng, shape, dt):
    dt = np.dtype(dt)
    if dt == np.bool_:
        return jnp.asarray(rng.random(shape) < 0.5)
    if dt.kind == "i":
        return jnp.asarray(rng.integers(-100, 100, shape), dt)
    x = rng.standard_normal(shape).astype(np.float32)
    if x.size >= 4:
        x.flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return jnp.asarray(x, dt)


def _indices(rng, shape, n, dt=jnp.int32):
    """Indices in [-n - 3, n + 3): negative, in bounds and out of bounds, repeated."""
    return jnp.asarray(rng.integers(-n - 3, n + 3, shape), dt)


def _check(fn, *args, kernels=None, fallbacks=(), tol_dtype=None):
    out = pallaskit.jit(fn)(*args)
    ref = jax.jit(fn)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert_close(a, b, tol_dtype if tol_dtype and a.dtype.kind == "f" else b.dtype)
    ex = pallaskit.explain(fn, *args)
    assert list(ex.fallbacks) == list(fallbacks), ex.fallbacks
    if kernels is not None:
        assert len(ex.kernels) == kernels, str(ex)
    return ex


# --------------------------------------------------------------------------- #
# the IR: indirect index terms
# --------------------------------------------------------------------------- #
def test_indirect_index_substitutes_through_its_arguments():
    from lowering import ir, sizes

    i0, i1 = sizes.index_symbols("i", 2)
    i32 = np.dtype(np.int32)
    value = ir.Op("add", (ir.Load("ids", (i0, i1), i32), ir.IndexValue(i1, i32)), i32)
    ld = ir.Load("table", (ir.indirect_index(value), i0), np.dtype(np.float32))
    assert [c.buffer for c in ir.loads(ld)] == ["ids", "table"]  # the index buffer is read
    swapped = ir.substitute_index(ld, {i0: i1, i1: i0})  # once, not twice
    (v,) = swapped.children()
    assert v.args[0].index == (i1, i0) and v.args[1].expr == i0 and swapped.index[1] == i1
    # a rewrite reaches inside the value (inlining the index's producer) and makes a new term
    inlined = ir.rewrite(ld, lambda e: ir.Const(3, i32) if isinstance(e, ir.Load) and e.buffer == "ids" else None)
    assert inlined.children()[0].args[0] == ir.Const(3, i32)
    assert ir.indirect_index(ir.Const(4, i32)) == 4


# --------------------------------------------------------------------------- #
# gather
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype,mode", [(dt, None) for dt in DTYPES] + [(jnp.float32, "clip"), (jnp.int8, "fill")])
def test_take_along_axis(rng, dtype, mode):
    x = _values(rng, (6, 37), dtype)
    idx = _indices(rng, (6, 3), 37)
    _check(lambda x, i: jnp.take_along_axis(x, i, axis=-1, mode=mode), x, idx, kernels=1)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16, jnp.int8, jnp.bool_])
def test_row_gather_embedding(rng, dtype):
    table = _values(rng, (50, 33), dtype)
    ids = _indices(rng, (4, 7), 50)  # a batch of sequences: 2-d indices
    _check(lambda t, i: t[i], table, ids, kernels=1)


@pytest.mark.parametrize("mode", ["clip", "fill", "wrap"])  # wrap: jnp's modulo, then PROMISE_IN_BOUNDS
def test_take_axis1_modes_and_index_dtypes(rng, mode):
    x = _values(rng, (5, 9), jnp.float32)
    for idx in (_indices(rng, (4,), 9, jnp.int8), _indices(rng, (1,), 9, jnp.int32),
                jnp.asarray(rng.integers(0, 300, (4,)), jnp.uint8)):
        _check(lambda x, i: jnp.take(x, i, axis=1, mode=mode), x, idx, kernels=1)


def test_gather_fused_with_producer_and_consumer(rng):
    x = _values(rng, (7, 13), jnp.float32)
    idx = _indices(rng, (7,), 13)

    def f(x, i):
        y = jnp.exp(x) * 2.0  # the producer is inlined into the gather
        return jnp.take_along_axis(y, i[:, None], axis=1)[:, 0] + 1.0

    _check(f, x, idx, kernels=1)


def test_x_idx_size_one_dims(rng):
    x = _values(rng, (1, 5, 1), jnp.float32)
    idx = jnp.asarray([0, -1, 0, 0], jnp.int32)
    _check(lambda x, i: x[i], x, idx, kernels=1)
    _check(lambda x, i: x[:, i], x, _indices(rng, (3, 1), 5), kernels=1)


@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16, jnp.bool_])
def test_gather_from_a_padded_operand(rng, dtype, backend):
    """A gather of a padded operand (negative low padding, interior padding): the
    pad's in-bounds test is a load mask over the gathered position, so the mask
    holds the run-time index too (it once printed the index function's name)."""
    pad_value = jnp.asarray(True if dtype == jnp.bool_ else 7.5, dtype)
    x = _values(rng, (16,), dtype)

    def f(x, i):
        return jax.lax.pad(x, pad_value, [(-1, -3, 2)])[i]

    with pallaskit.config.override(kernel_backend=backend):
        _check(f, x, _indices(rng, (9,), 42), kernels=1)
        _check(lambda x, i: jax.lax.pad(x, pad_value, [(2, 1, 1), (0, 0, 0)])[i], _values(rng, (5, 3), dtype),
               _indices(rng, (4,), 12), kernels=1)
        # A one-element operand: its index simplifies to 0 and the gathered position
        # is in the mask alone, whose load of the indices must count as a read (GPU
        # fuzz: KeyError in the kernel writer).
        _check(lambda x, i: jax.lax.pad(x, pad_value, [(0, 3, 1)])[i], _values(rng, (1,), dtype),
               _indices(rng, (6,), 4), kernels=1)


def test_multi_dim_gather(rng):
    x = _values(rng, (6, 5, 7), jnp.float32)
    i, j = _indices(rng, (3, 4), 6), _indices(rng, (3, 4), 5)
    _check(lambda x, i, j: x[i, j], x, i, j, kernels=1)  # two indexed dims, one slice dim
    _check(lambda x, i: x[:, i, 2:5], x, i, kernels=None)


def test_gather_around_matmul(rng):
    # a gathered operand is materialized (the template's K loop loads plain views only);
    # a gather in the epilogue and of the product stay right
    pallaskit.config.update(matmul_template="fused")
    x, w = _values(rng, (16, 32), jnp.float32), _values(rng, (32, 48), jnp.float32) * 0.1
    x, w = jnp.nan_to_num(x), jnp.nan_to_num(w)
    b, ids = jnp.nan_to_num(_values(rng, (5, 48), jnp.float32)), _indices(rng, (16,), 5)
    _check(lambda x, i, w: x[i] @ w, x, ids, w, kernels=2)
    _check(lambda x, i, w, b: jnp.tanh(x @ w + b[i]), x, ids, w, b, kernels=1)
    _check(lambda x, i, w: jnp.take_along_axis(x @ w, i[:, None] * 9, axis=1), x, ids, w)


def test_gather_from_a_reduction(rng):
    # the operand is materialized by one kernel, gathered by the next
    x = _values(rng, (9, 11), jnp.float32)
    idx = _indices(rng, (5,), 9)
    _check(lambda x, i: jnp.sum(x, axis=1)[i] * 2.0, x, idx)


# --------------------------------------------------------------------------- #
# scatter-add
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype,mode", [(jnp.float32, None), (BF16, None), (jnp.int32, "clip"), (jnp.int8, "drop")])
def test_scatter_add_repeated_indices(rng, dtype, mode):
    x = _values(rng, (7, 5), dtype)
    idx = jnp.asarray([2, 2, -1, 9, 2, -9], jnp.int32)  # repeated, negative, out of bounds
    v = _values(rng, (6, 5), dtype)
    _check(lambda x, i, v: x.at[i].add(v, mode=mode), x, idx, v, kernels=1)


@pytest.mark.parametrize("op,dtype", [("set", jnp.bool_), ("set", BF16), ("mul", jnp.float32), ("min", jnp.int8),
                                      ("max", jnp.float32)])
def test_other_scatters(rng, op, dtype):
    x = _values(rng, (7, 5), dtype)
    unique = op == "set"  # a set's winner among repeated indices is unspecified: unique ones (and out of bounds)
    idx = jnp.asarray([4, 0, 9, -2] if unique else [2, 2, -1, 9, 2, -9], jnp.int32)
    v = _values(rng, (len(idx), 5), dtype)
    _check(lambda x, i, v: getattr(x.at[i], op)(v), x, idx, v, kernels=1)


def test_scatter_add_take_along_axis_grad(rng):
    x = _values(rng, (5, 37), jnp.float32)
    idx = _indices(rng, (5, 2), 37)
    g = jax.grad(lambda x, i: jnp.sum(jnp.take_along_axis(x, i, axis=1, mode="fill", fill_value=0.0) ** 2))
    _check(g, x, idx, kernels=1)


def _many_updates_fallbacks() -> tuple:
    """A scatter-add with many updates per element: raw Triton's atomics where the
    executor is raw Triton (a GPU; tests/test_scatter_atomic.py), else XLA's."""
    from lowering import executors
    from pallaskit import orchestrator

    return () if executors.wants_triton("scatter", orchestrator.compile_options()) else ("scatter-add",)


def test_scatter_add_many_updates_runs_through_xla(rng):
    x = _values(rng, (7, 3), jnp.float32)
    idx = _indices(rng, (40,), 7)
    v = _values(rng, (40, 3), jnp.float32)
    _check(lambda x, i, v: x.at[i].add(v) * 2.0, x, idx, v, fallbacks=_many_updates_fallbacks())


@pytest.mark.parametrize("ids_shape", [(3,), (2, 37)])
def test_embedding_lookup_forward_and_grad(rng, ids_shape):
    table = _values(rng, (50, 16), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 50, ids_shape), jnp.int32)
    w = jnp.asarray(rng.standard_normal(ids_shape + (16,)), jnp.float32)

    def loss(t, i, w):
        return jnp.sum(jnp.tanh(t[i]) * w)

    _check(loss, table, ids, w)
    few = len(np.asarray(ids).ravel()) <= 8  # few ids: a dense scatter-add; else atomics or XLA's
    _check(jax.grad(loss), table, ids, w, fallbacks=() if few else _many_updates_fallbacks())
    out = jax.grad(pallaskit.jit(loss))(table, ids, w)
    assert_close(out, jax.grad(loss)(table, ids, w))


# --------------------------------------------------------------------------- #
# dynamic_slice / dynamic_update_slice / one_hot
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_slice_clamped(rng, dtype):
    x = _values(rng, (9, 7), dtype)
    for s, t in [(0, 0), (3, 2), (8, 6), (-1, -20), (100, 2)]:
        s, t = jnp.int32(s), jnp.int32(t)
        _check(lambda x, s, t: jax.lax.dynamic_slice(x, (s, t), (4, 3)), x, s, t, kernels=1)
    _check(lambda x, s: jax.lax.dynamic_slice(x, (s, 2), (9, 1)), x, jnp.int32(5), kernels=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_update_slice_clamped(rng, dtype):
    x = _values(rng, (9, 7), dtype)
    u = _values(rng, (4, 3), dtype)
    for s, t in [(0, 0), (3, 2), (8, 6), (-1, -20)]:
        _check(lambda x, u, s, t: jax.lax.dynamic_update_slice(x, u, (s, t)), x, u, jnp.int32(s), jnp.int32(t),
               kernels=1)
    _check(lambda x, u, s: jax.lax.dynamic_update_slice(x, u, (s, s)), x, u, jnp.int8(-2), kernels=1)


@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_update_at_a_computed_start_beside_a_row_sum(rng, backend):
    """A one-row kernel holding a softmax's sums, the start position computed
    from an input (a row value needing no reduction) and an update read at it:
    the row value is written before the members that read it (it was read before
    it existed: KeyError in the renderer; found by a fuzz run)."""
    def f(x, i, u):
        start = i * 11
        return jax.nn.softmax(x, axis=-1), start, jax.lax.dynamic_update_slice(x.astype(jnp.bool_), u, (start[0],))

    x = _values(rng, (100,), jnp.float32).at[:4].set(jnp.asarray([0.5, 1.0, -2.0, 0.0]))
    with pallaskit.config.override(kernel_backend=backend):
        for start in (0, 3, 50):
            _check(f, x, jnp.asarray([start], jnp.int32), _values(rng, (98,), jnp.bool_), kernels=1)


def test_dynamic_slice_in_fori_loop(rng):
    pallaskit.config.update(loop_bodies="on")  # 'auto' compiles bodies in interpret mode only
    x = _values(rng, (16, 5), jnp.float32)

    def f(x):
        def body(k, acc):
            return acc + jax.lax.dynamic_slice(x, (k * 3, 0), (4, 5))
        return jax.lax.fori_loop(0, 6, body, jnp.zeros((4, 5)))

    _check(f, x)


def test_one_hot_is_pointwise(rng):
    labels = _indices(rng, (6,), 37)
    x = _values(rng, (6, 37), jnp.float32)
    _check(lambda l, x: jax.nn.one_hot(l, 37) * x, labels, x, kernels=1)


# --------------------------------------------------------------------------- #
# cross-entropy
# --------------------------------------------------------------------------- #
def _xent_take(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


def _xent_onehot(logits, labels):
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * jax.nn.log_softmax(logits), axis=-1))


@pytest.mark.parametrize("cols,loss", [(1, _xent_take), (37, _xent_take), (37, _xent_onehot), (8193, _xent_take)])
def test_cross_entropy_forward_and_grad(rng, cols, loss):
    dt = BF16 if cols == 37 else jnp.float32
    logits = jnp.asarray(rng.standard_normal((5, cols)) * 3, dt)
    labels = jnp.asarray(rng.integers(0, cols, (5,)), jnp.int32)
    labels = labels.at[0].set(-1)  # jnp counts a negative label from the end
    # the forward: the row reductions, then the mean over rows; the gradient: one kernel
    fwd = _check(loss, logits, labels, tol_dtype=dt)
    assert len(fwd.kernels) <= 2, str(fwd)
    _check(jax.grad(loss), logits, labels, kernels=1)
    out = jax.grad(pallaskit.jit(loss))(logits, labels)  # forward and backward halves (custom_vjp)
    assert_close(out, jax.grad(loss)(logits, labels), dt)


def test_gather_with_dynamic_batch_dims_compiles_once(rng):
    from pallaskit import metrics

    fn = lambda x: x[:, :2] * 3.0  # noqa: E731  (a gather with slice sizes (n, 2))
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    for n in (4, 6):
        x = _values(rng, (n, 4), jnp.float32)
        assert_close(f(x), fn(x))
    assert metrics.counters.get("dynamic_fallbacks", 0) == 0


@pytest.mark.parametrize("form", ["one_hot", "where", "scaled", "int8 iota"])
def test_one_hot_sums_are_picks(rng, form):
    """``sum(one_hot(l, n) * x, -1)``, ``sum(where(iota == l, x, 0), -1)`` and a
    gradient's ``sum(-(one_hot * x) / 4)`` are one gathered value a row ([Note:
    one-hot picks]): a pointwise kernel, no reduction, with jax.jit's values at NaN,
    inf, -0.0 and out-of-range labels."""
    x = _values(rng, (6, 37), jnp.float32)
    x = x.at[1, 3].set(jnp.nan).at[2, 4].set(-jnp.inf).at[3, 7].set(-0.0).at[0, 9].set(jnp.inf)
    labels = jnp.asarray([9, 3, 5, 7, 37, -1], jnp.int32)
    if form == "one_hot":
        fn = lambda x, l: jnp.sum(jax.nn.one_hot(l, 37) * x, -1)  # noqa: E731
    elif form == "where":
        fn = lambda x, l: jnp.sum(jnp.where(jnp.arange(37) == l[:, None], x, 0.0), -1)  # noqa: E731
    elif form == "int8 iota":  # an iota that wraps (int8 over 300) matches a label twice: no pick
        x = _values(rng, (6, 300), jnp.float32)
        labels = jnp.asarray([3, 100, 120, -3, 0, 127], jnp.int8)
        fn = lambda x, l: jnp.sum(jnp.where(jnp.arange(300, dtype=jnp.int8) == l[:, None], x, 0.0), -1)  # noqa: E731
    else:
        fn = lambda x, l: jnp.sum(-(jax.nn.one_hot(l, 37) * x) / 4.0, -1)  # noqa: E731
    with pallaskit.config.override(cache=False):
        got = pallaskit.jit(fn)(x, labels)
        kinds = [k.kind for k in pallaskit.explain(fn, x, labels).kernels]
    want = jax.jit(fn)(x, labels)
    if form == "int8 iota":
        assert_close(got, want)
        assert kinds == ["reduction"], kinds
        return
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # NaN where NaN
    if form != "scaled":  # +0.0 for the picked -0.0 (the other terms are +0.0: the sum is +0.0 in any order)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    # (scaled, every other term is -0.0: a sum of them all is +0.0 with XLA's +0 start, and XLA:GPU
    # sometimes returns -0.0; pallaskit's pick is +0.0 there)
    assert kinds == ["pointwise"], kinds


def test_take_along_axis_gradient_under_a_dynamic_batch(rng):
    """The gradient of a cross-entropy's take_along_axis under a dynamic batch: its
    scatter-add has a window over all of the dynamic rows, which lowers like any other
    (it ran through XLA), right at each size, out-of-range labels included."""
    from pallaskit import metrics

    def xent(x, labels):
        picked = jnp.take_along_axis(x, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(x, -1) - picked)

    fn = jax.value_and_grad(xent)
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}, "labels": {0: "n"}})
    before = metrics.counters.get("fallback_count", 0)
    for n in (6, 1, 9):
        x = _values(rng, (n, 37), jnp.float32)
        labels = jnp.asarray(rng.integers(-40, 40, n), jnp.int32)
        for got, want in zip(f(x, labels), fn(x, labels)):
            assert_close(got, want)
    assert metrics.counters.get("fallback_count", 0) == before
    assert metrics.counters.get("dynamic_fallbacks", 0) == 0


def test_gather_in_triton_renderer(rng):
    pytest.importorskip("triton")
    from pallaskit import metrics

    pallaskit.config.update(dynamic_launch="on")
    x = _values(rng, (6, 37), jnp.float32)

    def f(x, labels):
        return jnp.take_along_axis(jnp.exp(x), labels[:, None], axis=-1)[:, 0] * 2.0

    jf = pallaskit.jit(f, dynamic={"x": {0: "n"}, "labels": {0: "n"}})
    for n in (6, 3):  # symbolic rows: raw Triton in Triton's interpreter
        labels = _indices(rng, (n,), 37)
        before = metrics.counters.get("eager_launches", 0)
        assert_close(jf(x[:n], labels), f(x[:n], labels))
        assert metrics.counters.get("eager_launches", 0) > before


def test_gathers_of_gathers_are_stored_before_their_loads_double(rng):
    """``i = i[i]`` repeated: inlined, each step doubles the loads of the next (2^k
    gathers at distinct indices in one kernel: 12 steps did not compile in 5 minutes).
    A value whose inlined body loads over heuristics.MAX_INLINED_LOADS elements, over
    twice its buffers, is stored ([Note: broadcast tables]): every kernel keeps a few
    times that many loads (before, the whole chain was one kernel)."""
    from lowering import heuristics

    def f(i, x):
        for _ in range(12):
            i = i[i]
        return x[i] * 2

    i = jnp.asarray(rng.integers(-300, 300, 300), jnp.int32)  # negative ids too: jax wraps them
    x = jnp.asarray(rng.standard_normal(300), jnp.float32)
    assert_close(pallaskit.jit(f)(i, x), jax.jit(f)(i, x), jnp.float32)
    ex = pallaskit.explain(f, i, x)
    assert len(ex.kernels) > 1 and not ex.fallbacks
    for k in ex.kernels:
        assert k.source.count("load(") <= 4 * heuristics.MAX_INLINED_LOADS, k.name
