"""Size buckets (issue 4; [Note: size buckets] in pallaskit/runtime/buckets.py):
a symbolic program runs each size on its power-of-two bucket's executable, the
real sizes passed at run time, inputs and outputs exchanged as views."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close
from pallaskit import metrics
from pallaskit.config import OPTIONS
from pallaskit.runtime import buckets

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _buckets_on(_fresh_state):
    pallaskit.config.update(dynamic_buckets=True)  # experimental, off by default


def delta(before, name):
    return metrics.counters[name] - before[name]


def _rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _entry(f, *args):
    return f.lower_to_result(*args).executable


def test_bucket_sizes():
    assert [buckets.bucket(n) for n in (1, 15, 16, 17, 100, 128, 129, 8000)] == [16, 16, 16, 32, 128, 128, 256, 8192]


def test_view_is_a_zero_copy_prefix(rng):
    x = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    v = buckets.view(x, (3, 5))
    want = np.asarray(x)[:3].copy()
    np.testing.assert_array_equal(np.asarray(v), want)
    assert v.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
    w = buckets.view(x.reshape(5, 6), (5, 2))  # a dynamic last axis: the flat prefix, row-major (5, 2)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(x).reshape(-1)[:10].reshape(5, 2))
    del x
    jnp.ones((6, 5), jnp.float32).block_until_ready()  # a new buffer that could reuse x's memory
    np.testing.assert_array_equal(np.asarray(v), want)  # the view keeps x's buffer alive


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
def test_sizes_of_one_bucket_share_one_executable(dtype, rng):
    pallaskit.config.update(multi_kernel_hints="64")
    f = pallaskit.jit(_rmsnorm, dynamic={"x": {0: "n"}})
    w = jnp.asarray(rng.standard_normal((100,)), jnp.float32)
    before = dict(metrics.counters)
    for n in (17, 20, 31, 32, 1, 5, 16):  # bucket 32 four times, then bucket 16 three times
        x = jnp.asarray(rng.standard_normal((n, 100)), dtype)
        out = f(x, w)
        assert out.shape == (n, 100) and out.dtype == dtype
        assert_close(out, jax.jit(_rmsnorm)(x, w), dtype)
    assert delta(before, "graphs_compiled") == 1
    assert delta(before, "bucket_compiles") == 2
    assert delta(before, "bucket_calls") == 7
    exe = _entry(f, x, w)
    assert isinstance(exe, buckets.Bucketed) and sorted(exe.executables) == [(16,), (32,)]


def test_dynamic_axis_inside_and_outputs_of_other_shapes(rng):
    """A dynamic middle axis; outputs of shape (3, n, 4), (n,) and static (4,):
    each a prefix view at its real shape."""
    pallaskit.config.update(multi_kernel_hints="64")  # one variant (a GPU's tiles differ by hint)

    def fn(x, b):
        return jnp.sin(x) * b, jnp.sum(x, axis=(0, 2)), jnp.max(x, axis=(0, 1))

    f = pallaskit.jit(fn, dynamic={"x": {1: "n"}})
    b = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    before = dict(metrics.counters)
    for n in (9, 1, 13, 16):
        x = jnp.asarray(rng.standard_normal((3, n, 4)), jnp.float32)
        out, want = f(x, b), jax.jit(fn)(x, b)
        assert [o.shape for o in out] == [(3, n, 4), (n,), (4,)]
        for a, c in zip(out, want):
            assert_close(a, c)
    assert delta(before, "bucket_compiles") == 1
    assert delta(before, "bucket_calls") == 4


def test_column_sums_over_a_bucket_read_only_the_real_rows(rng):
    """Norm backward over dynamic rows: dw sums rows, so a garbage row of the
    bucket would show; split and mix-order kernels read the real count."""
    def loss(x, w):
        return jnp.sum(_rmsnorm(x, w) ** 2)

    fn = jax.grad(loss, argnums=(0, 1))
    pallaskit.config.update(multi_kernel_hints="64")
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    w = jnp.asarray(rng.standard_normal((64,)), jnp.float32)
    before = dict(metrics.counters)
    for n in (33, 40, 7):
        x = jnp.asarray(rng.standard_normal((n, 64)), jnp.float32) + 10.0  # nonzero garbage would not cancel
        for a, c in zip(f(x, w), jax.jit(fn)(x, w)):
            assert_close(a, c)
    assert delta(before, "bucket_calls") == 3


def test_matmul_template_over_dynamic_rows_is_bucketed(rng):
    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2

    w1 = jnp.asarray(rng.standard_normal((32, 64)) / 6, BF16)
    w2 = jnp.asarray(rng.standard_normal((64, 32)) / 8, BF16)
    with pallaskit.config.override(multi_kernel_hints="64"):
        f = pallaskit.jit(mlp, dynamic={"x": {0: "n"}})
        before = dict(metrics.counters)
        for n in (5, 9, 70):
            x = jnp.asarray(rng.standard_normal((n, 32)), BF16)
            np.testing.assert_allclose(np.float32(f(x, w1, w2)), np.float32(jax.jit(mlp)(x, w1, w2)),
                                       rtol=2e-2, atol=2e-2)
    assert delta(before, "bucket_compiles") == 2  # 16 and 128
    program = f.lower_to_result(x, w1, w2).result.program
    assert sum(": matmul " in k.source for k in program.kernels) == 2 and not program.externs


@pytest.mark.parametrize("fn,why", [
    (lambda x: (x, x * 2.0), "is also an output"),
    (lambda x: jnp.sort(x * 2.0, axis=0), "runs through XLA on a dynamic-sized value"),
], ids=["input_returned", "xla_op_on_dynamic"])
def test_unbucketable_programs_compile_per_size(fn, why, rng):
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    before = dict(metrics.counters)
    for n in (3, 5):
        x = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
        for a, c in zip(jax.tree_util.tree_leaves(f(x)), jax.tree_util.tree_leaves(jax.jit(fn)(x))):
            assert_close(a, c)
    assert delta(before, "bucket_calls") == 0
    assert delta(before, "graphs_compiled") == 1
    assert why in f.lower_to_result(x).result.program.unbucketable


def test_option_off_by_default_compiles_each_size(rng):
    assert OPTIONS["dynamic_buckets"].default is False
    pallaskit.config.update(dynamic_buckets=False)
    w = jnp.asarray(rng.standard_normal((8,)), jnp.float32)
    f = pallaskit.jit(_rmsnorm, dynamic={"x": {0: "n"}})
    before = dict(metrics.counters)
    for n in (3, 5):
        x = jnp.asarray(rng.standard_normal((n, 8)), jnp.float32)
        assert_close(f(x, w), jax.jit(_rmsnorm)(x, w))
    assert delta(before, "bucket_calls") == 0
    assert not isinstance(_entry(f, x, w), buckets.Bucketed)


def test_transformed_and_host_inputs(rng):
    """Under jax.jit (tracers) the program runs at the exact size; numpy
    inputs are copied into the bucket."""
    f = pallaskit.jit(_rmsnorm, dynamic={"x": {0: "n"}})
    w = rng.standard_normal((8,)).astype(np.float32)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    want = jax.jit(_rmsnorm)(x, w)
    assert_close(f(x, w), want)
    assert_close(jax.jit(f)(x, w), want)
    assert_close(jax.jit(f)(jnp.asarray(x[:3]), w), jax.jit(_rmsnorm)(x[:3], w))


def test_bucket_breaking_a_guard_runs_that_size_exactly(rng, monkeypatch):
    f = pallaskit.jit(_rmsnorm, dynamic={"x": {0: "n"}})
    w = jnp.asarray(rng.standard_normal((8,)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((20, 8)), jnp.float32)
    assert_close(f(x, w), jax.jit(_rmsnorm)(x, w))
    exe = _entry(f, x, w)
    exe.guards = [compile("n <= 20", "<guard>", "eval")]  # bucket 32 breaks it, 20 itself does not
    exe.executables.clear()
    before = dict(metrics.counters)
    x = jnp.asarray(rng.standard_normal((19, 8)), jnp.float32)
    assert_close(f(x, w), jax.jit(_rmsnorm)(x, w))
    assert delta(before, "bucket_calls") == 0 and exe.executables == {(32,): None}


def test_multi_kernel_variants_choose_per_bucket_by_nearest_hint(rng):
    """Bucketed, every variant serves buckets; the dispatcher keys its choice
    by the bucket and takes the nearest hint (untimed, also on a GPU)."""
    def fn(x, w):
        return jnp.tanh(x * 2.0 + w)

    with pallaskit.config.override(multi_kernel_hints="64,4096"):
        f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
        w = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
        for n in (70, 100, 3000, 5000):
            x = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
            assert_close(f(x, w), jax.jit(fn)(x, w))
        d = f.lower_to_result(x, w).executable
    assert isinstance(d, pallaskit.runtime.multikernel.Dispatcher) and d.bucketed
    assert d.chosen == {(128,): 0, (4096,): 1, (8192,): 1}
    assert set(d.methods.values()) == {"nearest_hint"}
    assert all(isinstance(v.fn, buckets.Bucketed) for v in d.variants)
    assert sorted(d.variants[0].fn.executables) == [(128,)]
    assert sorted(d.variants[1].fn.executables) == [(4096,), (8192,)]


def test_bucketed_dynamic_m_dot_takes_the_template_at_every_hint(rng):
    """'auto' leaves a large product to XLA, but an XLA dot on a dynamic-sized
    value would make the program per-size: bucketed, a 16-bit dynamic-M dot is
    the template at any hint."""
    def layer(x, w):
        return x @ w

    w = jnp.asarray(rng.standard_normal((32, 640)) / 6, BF16)  # N > 512: XLA's at a hint of 4096
    x = jnp.asarray(rng.standard_normal((9, 32)), BF16)
    for on, externs in ((True, 0), (False, 1)):
        with pallaskit.config.override(multi_kernel_hints="4096", dynamic_buckets=on):
            f = pallaskit.jit(layer, dynamic={"x": {0: "n"}})
            np.testing.assert_allclose(np.float32(f(x, w)), np.float32(jax.jit(layer)(x, w)), rtol=2e-2, atol=2e-2)
            assert len(f.lower_to_result(x, w).result.program.externs) == externs
