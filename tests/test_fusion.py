"""Fusion shown by kernel counts, and every fused program checked against jax.jit."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from benchmarks.models import _rope  # RoPE's rotate-half form, cos/sin tables from iota
from conftest import assert_close


def _check(fn, *args):
    out = pallaskit.jit(fn)(*args)
    ref = jax.jit(fn)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == b.dtype
        assert_close(a, b, b.dtype)
    return pallaskit.explain(fn, *args)


def rmsnorm(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def layernorm(x, w, b, eps=1e-5):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


DTYPES = [jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_chain_of_ten_is_one_kernel(rng, dtype):
    def chain(x, y):
        z = x * 2.0 + y
        z = jnp.tanh(z) - jnp.exp(-jnp.abs(x))
        z = jnp.maximum(z, y) * jax.nn.sigmoid(y)
        return jnp.sqrt(jnp.abs(z) + 1.0) / (1.0 + y * y)

    x = jnp.asarray(rng.standard_normal((37, 129)), dtype)
    y = jnp.asarray(rng.standard_normal((37, 129)), dtype)
    e = _check(chain, x, y)
    assert len(e.kernels) == 1
    assert len(e.kernels[0].equations) >= 10


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["elementwise", "per_column", "per_row", "middle", "size1"])
def test_pointwise_iteration_follows_broadcast_operands(rng, dtype, case):
    """A pointwise kernel iterates flat unless a broadcast operand depends on a
    prefix (one value per row) or a suffix (per column) of the dims."""
    x = jnp.asarray(rng.standard_normal((5, 6, 37)), dtype)
    shaped = {"elementwise": (5, 6, 37), "per_column": (1, 1, 37), "per_row": (5, 6, 1),
              "middle": (1, 6, 1), "size1": (5, 1, 37)}[case]
    v = jnp.asarray(rng.standard_normal(shaped), dtype)
    e = _check(lambda a, b: jnp.tanh(a * b) + b, x, v)
    assert len(e.kernels) == 1
    want = {"elementwise": (1, 5 * 6 * 37), "per_column": (30, 37), "per_row": (30, 37),
            # (5, 6, 37) * (1, 6, 1): dim 1 alone is neither a prefix nor a suffix
            "middle": (1, 5 * 6 * 37),
            # (5, 1, 37) on a (5, 6, 37) domain reads dims 0 and 2: not a prefix or suffix either
            "size1": (1, 5 * 6 * 37)}[case]
    assert e.kernels[0].iteration == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("perm,shape,iteration", [
    ((1, 0), (37, 50), (50, 37)),
    ((0, 2, 3, 1), (2, 3, 5, 7), (2 * 5 * 7, 3)),  # NCHW -> NHWC
    ((0, 3, 1, 2), (2, 5, 7, 3), (2 * 3, 5 * 7)),  # NHWC -> NCHW
    ((1, 0, 2), (6, 1, 9), (1, 6 * 9)),  # moves a size-1 dim only: nothing transposed
])
@pytest.mark.pallas_source
def test_transposed_output_is_a_tiled_transpose(rng, dtype, perm, shape, iteration):
    """A kernel whose store order differs from its load order iterates rows
    (the load's contiguous dim) x columns (the store's) on a square tile."""
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    e = _check(lambda a: jnp.transpose(a, perm) * 2.0 + 1.0, x)
    assert len(e.kernels) == 1 and e.kernels[0].iteration == iteration
    tiled = "BLOCK_R, BLOCK_C = 1," not in e.kernels[0].source
    assert tiled == (iteration[0] > 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(33, 100), (4, 1, 257), (1, 7)])
def test_softmax_last_axis_is_one_kernel(rng, dtype, shape):
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    e = _check(lambda a: jax.nn.softmax(a, axis=-1), x)
    assert len(e.kernels) == 1 and e.kernels[0].kind == "reduction"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 384), (3, 5, 100), (1, 1)])
def test_rmsnorm_forward_is_one_kernel(rng, dtype, shape):
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1:]), dtype)
    e = _check(rmsnorm, x, w)
    assert len(e.kernels) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 384), (2, 9, 100)])
def test_layernorm_forward_is_one_kernel(rng, dtype, shape):
    x = jnp.asarray(rng.standard_normal(shape) + 0.5, dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1:]), dtype)
    b = jnp.asarray(rng.standard_normal(shape[-1:]), dtype)
    e = _check(layernorm, x, w, b)
    assert len(e.kernels) == 1


@pytest.mark.pallas_source
def test_mean_and_variance_take_one_pass(rng):
    x = jnp.asarray(rng.standard_normal((20, 300)) + 1.0, jnp.float32)
    e = _check(lambda a: (jnp.mean(a, axis=1), jnp.var(a, axis=1)), x)
    assert len(e.kernels) == 1
    assert e.kernels[0].source.count("plt.load(in_ptr0") == 1  # the input is read once


def test_jax_nn_layer_norm_style_and_gelu(rng):
    def block(x, w):
        h = jax.nn.gelu(x * w, approximate=False)
        return h - h.mean(-1, keepdims=True)

    x = jnp.asarray(rng.standard_normal((16, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((96,)), jnp.float32)
    e = _check(block, x, w)
    assert len(e.kernels) == 1


@pytest.mark.pallas_source
def test_looped_reduction_matches(rng):
    x = jnp.asarray(rng.standard_normal((3, 5000)), jnp.float32)
    with pallaskit.config.override(max_persistent_cols=1024):
        e = _check(lambda a: jax.nn.softmax(a, axis=-1), x)
        assert "fori_loop" in e.kernels[0].source
        _check(lambda a: (jnp.sum(a, -1), jnp.max(a, -1), jnp.min(a * 2, -1)), x)


@pytest.mark.parametrize("axes", [(0,), (1,), (0, 2), None])
def test_reductions_over_other_axes(rng, axes):
    x = jnp.asarray(rng.standard_normal((6, 7, 33)), jnp.float32)
    _check(lambda a: (jnp.sum(jnp.exp(a), axis=axes), jnp.max(a, axis=axes)), x)


def test_column_reduction_long(rng):
    x = jnp.asarray(rng.standard_normal((9001, 3)), jnp.float32)
    _check(lambda a: jnp.sum(a, axis=0), x)


def test_reduction_epilogue_and_outputs_share_a_kernel(rng):
    def f(x):
        m = jnp.max(x, -1)
        s = jnp.sum(jnp.exp(x - m[:, None]), -1)
        return jnp.log(s) + m, jnp.exp(x) * 2

    x = jnp.asarray(rng.standard_normal((13, 70)), jnp.float32)
    e = _check(f, x)
    assert len(e.kernels) == 1


def test_views_fold_into_index_expressions(rng):
    def f(x, y):
        t = jnp.transpose(x, (1, 0)).reshape(6, 35)[:, ::2]
        return jnp.concatenate([t, jnp.flip(y, 0)], axis=1) * 2.0

    x = jnp.asarray(rng.standard_normal((35, 6)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    e = _check(f, x, y)
    assert len(e.kernels) == 1


def test_fusion_off_gives_more_kernels(rng):
    x = jnp.asarray(rng.standard_normal((8, 50)), jnp.float32)
    f = lambda a: jax.nn.softmax(a, -1)
    with pallaskit.config.override(fusion=False):
        e = _check(f, x)
    assert len(e.kernels) > 1


@pytest.mark.parametrize("template", ["off", "fused"])
def test_weight_gradient_transpose_folds_into_the_product(rng, template):
    """jax writes a weight gradient as transpose(dot_general(dy, x)); the
    lowering swaps the operands instead, so no copy kernel transposes it."""
    def grad_w(x, w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    # bfloat16: on the GPU a float32 template product runs as TF32, off XLA's float32 tolerance
    x = jnp.asarray(rng.standard_normal((9, 5)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16)
    with pallaskit.config.override(matmul_template=template):
        e = _check(grad_w, x, w)
    assert "transpose" not in e.ir_after and "copy" not in " ".join(k.name for k in e.kernels)
    assert len(e.kernels) == (1 if template == "off" else 2)


def test_explain_says_why_groups_were_not_fused(rng):
    """``can_fuse`` refusals (WhyNoFuse) reach explain, grouped by reason: a
    pair that shares x but would run kernel -> XLA op -> same kernel, and a
    matmul whose epilogue fusion is off."""
    def through_xla(x):
        a = jnp.exp(x)
        return jnp.sum(jnp.sort(a, axis=-1) * x, -1)

    x = jnp.asarray(rng.standard_normal((6, 10)), jnp.float32)
    e = _check(through_xla, x)
    assert len(e.kernels) == 2
    assert e.not_fused == ["pointwise buf1 + reduction buf4: one depends on the other through another kernel "
                           "or an XLA op"]
    assert "not fused (1 pair(s) worth merging):\n- one depends on the other" in str(e)

    a = jnp.asarray(rng.standard_normal((9, 5)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((5, 7)), jnp.bfloat16)
    with pallaskit.config.override(matmul_template="unfused"):
        e = _check(lambda a, w: jnp.tanh(a @ w) + 1, a, w)
    assert len(e.kernels) == 2
    assert [r.partition(": ")[2] for r in e.not_fused] == ["epilogue fusion is off (matmul_template='unfused')"]
    with pallaskit.config.override(matmul_template="fused"):
        e = _check(lambda a, w: jnp.tanh(a @ w) + 1, a, w)
    assert len(e.kernels) == 1 and e.not_fused == [] and "not fused" not in str(e)


def test_explain_groups_many_refusals_by_reason():
    from pallaskit.explain import Explanation

    e = Explanation([], [], "", "", "", "", [f"pointwise b{i} + reduction r: the reason" for i in range(5)]
                    + ["mix m + reduction r: another"])
    text = str(e)
    assert ("not fused (6 pair(s) worth merging):\n- the reason: pointwise b0 + reduction r; pointwise b1 + "
            "reduction r; pointwise b2 + reduction r, and 2 more\n- another: mix m + reduction r") in text


def _heavy_ops_in(source: str) -> bool:
    return any(f in source for f in ("cos(", "sin(", "pow("))


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_tables_are_stored_once(rng, dtype, monkeypatch):
    """[Note: broadcast tables]: RoPE's cos/sin tables, read over batch and heads, are
    computed by a kernel of the table's size, and the kernel over the activations only
    loads them (no cos/sin/pow per element); values as jax.jit, grad included."""
    from lowering import heuristics

    x = jnp.asarray(rng.standard_normal((3, 17, 5, 12)), dtype)
    with pallaskit.config.override(cache=False, combo_kernels=False):
        before = _check(_rope, x)
        big = [k for k in before.kernels if k.iteration[0] * k.iteration[1] >= x.size]
        assert big and all(_heavy_ops_in(k.source) for k in big)  # small sizes: recomputed inline
        monkeypatch.setattr(heuristics, "BROADCAST_TABLE_OPS", 1000)
        ex = _check(_rope, x)
        big = [k for k in ex.kernels if k.iteration[0] * k.iteration[1] >= x.size]
        tables = [k for k in ex.kernels if k.iteration[0] * k.iteration[1] < x.size]
        assert big and not any(_heavy_ops_in(k.source) for k in big)
        assert tables and all(k.iteration[0] * k.iteration[1] <= 17 * 12 for k in tables)
        _check(jax.grad(lambda x: jnp.sum(_rope(x).astype(jnp.float32) ** 2)), x)


def test_broadcast_tables_leave_row_values_and_cheap_masks_inline(rng, monkeypatch):
    """A costly value built on a reduction (LayerNorm's rsqrt of the variance) stays
    in its row kernel, and a causal mask (cheap ops) is never stored, whatever the
    threshold."""
    from lowering import heuristics

    monkeypatch.setattr(heuristics, "BROADCAST_TABLE_OPS", 1)
    x = jnp.asarray(rng.standard_normal((37, 129)), jnp.float32)
    w, b = (jnp.asarray(rng.standard_normal((129,)), jnp.float32) for _ in range(2))

    def masked_softmax(s):
        t = s.shape[-1]
        causal = jnp.tril(jnp.ones((t, t), bool))
        return jax.nn.softmax(jnp.where(causal, s, -1e9), axis=-1)

    s = jnp.asarray(rng.standard_normal((2, 3, 33, 33)), jnp.float32)
    with pallaskit.config.override(cache=False):
        assert len(_check(layernorm, x, w, b).kernels) == 1
        assert len(_check(masked_softmax, s).kernels) == 1


def _loaded(source: str) -> int:
    """Buffers a kernel loads: its ``in_ptr`` parameters."""
    return len(set(re.findall(r"\bin_ptr\d+\b", source.split("):", 1)[0])))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_residual_stream_read_by_several_kernels_is_stored(rng, dtype):
    """[Note: broadcast tables]: a deep model's residual stream (x_l = x_0 + every
    earlier layer's output) that each layer's reduction also reads is stored once
    its inlined body loads more than MAX_SHARED_INLINED_READS buffers, so no kernel
    recomputes it from every earlier layer; values as jax.jit, grad included."""
    from lowering import heuristics

    layers = 14
    x = jnp.asarray(rng.standard_normal((6, 130)), dtype)
    hs = [jnp.asarray(rng.standard_normal((6, 130)), dtype) for _ in range(layers)]
    x = x.at[0, 0].set(jnp.nan).at[1, 2].set(jnp.inf)

    def deep(x, hs):
        sums = []
        for h in hs:
            x = x + jnp.tanh(h) * 0.5  # the residual add: a pointwise chain through every layer
            sums.append(jnp.sum(x * x, axis=-1))  # a second reader per layer
        return x, sums

    grad = jax.grad(lambda x, hs: jnp.sum(deep(x, hs)[1][-1].astype(jnp.float32)))
    with pallaskit.config.override(cache=False, combo_kernels=False):
        if dtype == jnp.float32:
            ex = _check(deep, x, hs)
            _check(grad, x, hs)
        else:  # 14 bf16 adds round at points of XLA's own: a chain's tolerance, not one op's
            for f in (deep, grad):
                for a, e in zip(jax.tree_util.tree_leaves(pallaskit.jit(f)(x, hs)),
                                jax.tree_util.tree_leaves(jax.jit(f)(x, hs))):
                    assert a.dtype == e.dtype
                    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32),
                                               rtol=0.05, atol=0.1)
            ex = pallaskit.explain(deep, x, hs)
        assert max(_loaded(k.source) for k in ex.kernels) <= heuristics.MAX_SHARED_INLINED_READS + 2
