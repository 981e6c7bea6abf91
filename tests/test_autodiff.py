"""Transformations of pallaskit functions (pallaskit/autodiff.py) and the
forward/backward partitioner (lowering/partition.py), against jax.jit."""
import logging
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close
from lowering import partition


# --------------------------------------------------------------------------- #
# models
# --------------------------------------------------------------------------- #
def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


def layernorm(x, g, b):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(x.dtype)


def mlp_loss(params, x):
    h = rmsnorm(x, params["g1"])
    h = jax.nn.gelu(h @ params["w1"])
    y = layernorm(x + h @ params["w2"], params["g2"], params["b2"])
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def attention_loss(params, x):
    q, k, v = x @ params["wq"], x @ params["wk"], x @ params["wv"]
    s = (q @ k.T).astype(jnp.float32) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
    out = rmsnorm(x + (p @ v) @ params["wo"], params["g"])
    return jnp.sum(jnp.square(out.astype(jnp.float32))) / out.size


def cross_entropy_take(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


def cross_entropy_one_hot(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, logits.shape[-1]), axis=-1))


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def mlp_args(rng, dtype, rows=7, d=37, hidden=24):
    params = {"g1": _normal(rng, (d,), jnp.float32), "w1": _normal(rng, (d, hidden), dtype, d ** -0.5),
              "w2": _normal(rng, (hidden, d), dtype, hidden ** -0.5), "g2": _normal(rng, (d,), jnp.float32),
              "b2": _normal(rng, (d,), jnp.float32)}
    return params, _normal(rng, (rows, d), dtype)


def attention_args(rng, dtype, seq=7, d=24):
    params = {n: _normal(rng, (d, d), dtype, d ** -0.5) for n in ("wq", "wk", "wv", "wo")}
    params["g"] = _normal(rng, (d,), jnp.float32)
    return params, _normal(rng, (seq, d), dtype)


def assert_tree_close(actual, expected, dtype):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, e.dtype, a.shape, e.shape)
        if np.dtype(dtype) == np.dtype(jnp.bfloat16):  # loose: relative to the largest entry
            e64, a64 = np.asarray(e, np.float64), np.asarray(a, np.float64)
            np.testing.assert_allclose(a64, e64, rtol=5e-2, atol=5e-2 * max(np.abs(e64).max(), 1e-3))
        else:
            assert_close(a, e, dtype)


# --------------------------------------------------------------------------- #
# reverse mode
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_mlp_with_norms(rng, dtype):
    params, x = mlp_args(rng, dtype)
    grad = jax.grad(pallaskit.jit(mlp_loss), argnums=(0, 1))(params, x)
    assert_tree_close(grad, jax.jit(jax.grad(mlp_loss, argnums=(0, 1)))(params, x), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grad_attention_block(rng, dtype):
    params, x = attention_args(rng, dtype)
    value, grad = jax.value_and_grad(pallaskit.jit(attention_loss), argnums=(0, 1))(params, x)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(attention_loss, argnums=(0, 1)))(params, x)
    assert_close(value, ref_value, dtype)
    assert_tree_close(grad, ref_grad, dtype)


@pytest.mark.parametrize("loss", [cross_entropy_take, cross_entropy_one_hot])
def test_grad_cross_entropy_with_integer_labels(rng, loss):
    logits = _normal(rng, (6, 37), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 37, (6,)), jnp.int32)
    assert_tree_close(jax.grad(pallaskit.jit(loss))(logits, labels), jax.jit(jax.grad(loss))(logits, labels),
                      jnp.float32)


def test_vjp_has_aux_and_integer_outputs(rng):
    def f(x, w):
        y = jnp.tanh(x * w)
        return y.sum(-1), {"argmax": jnp.argmax(y, -1), "y": y}

    x, w = _normal(rng, (6, 37), jnp.float32), _normal(rng, (37,), jnp.float32)
    out, pullback = jax.vjp(pallaskit.jit(f), x, w)
    ref, ref_pullback = jax.vjp(f, x, w)
    assert_tree_close(out, ref, jnp.float32)
    ct = (_normal(rng, (6,), jnp.float32),
          {"argmax": np.zeros((6,), jax.dtypes.float0), "y": _normal(rng, (6, 37), jnp.float32)})
    assert_tree_close(pullback(ct), ref_pullback(ct), jnp.float32)

    def loss(x, w):
        s, aux = f(x, w)
        return s.sum(), aux  # aux: zero cotangents, a separate backward variant

    (v, aux), g = jax.value_and_grad(pallaskit.jit(loss), has_aux=True)(x, w)
    (rv, raux), rg = jax.value_and_grad(loss, has_aux=True)(x, w)
    assert_tree_close((v, aux, g), (rv, raux, rg), jnp.float32)


def test_partial_argnums_and_jit(rng):
    x, w = _normal(rng, (6, 37), jnp.float32), _normal(rng, (37,), jnp.float32)
    f = pallaskit.jit(lambda x, w: jnp.sum(jnp.exp(jnp.sin(x) * w)))
    ref = jax.grad(lambda x, w: jnp.sum(jnp.exp(jnp.sin(x) * w)), argnums=1)(x, w)
    assert_close(jax.grad(f, argnums=1)(x, w), ref)
    assert_close(jax.jit(jax.grad(f, argnums=1))(x, w), ref)
    # pallaskit.jit around a function that differentiates (a pallaskit function, or plain jax)
    assert_close(pallaskit.jit(jax.grad(f, argnums=1))(x, w), ref)


def test_staged_call_differentiated_later(rng):
    """A call traced under jax.jit, lax.scan or jax.checkpoint, then
    differentiated by JAX: the staged program carries pallaskit's custom_vjp."""
    x, w = _normal(rng, (6, 37), jnp.float32), _normal(rng, (37,), jnp.float32)

    def f(x, w):
        return jnp.sum(jnp.sin(x) * w)

    pf = pallaskit.jit(f)

    def scanned(g):
        return lambda x: jax.lax.scan(lambda c, _: (jnp.tanh(c) * g(c, w), None), x, None, length=2)[0].sum()

    assert_tree_close(jax.grad(jax.jit(pf), argnums=(0, 1))(x, w), jax.grad(f, argnums=(0, 1))(x, w), jnp.float32)
    assert_close(jax.grad(jax.checkpoint(pf))(x, w), jax.grad(f)(x, w))
    # the scan multiplies a summed scalar into every element: float32 rounding grows
    np.testing.assert_allclose(jax.grad(scanned(pf))(x), jax.grad(scanned(f))(x), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- #
# partitioners
# --------------------------------------------------------------------------- #
def test_min_cut_saves_fewer_bytes_and_agrees(rng):
    params, x = mlp_args(rng, jnp.float32)
    f = pallaskit.jit(mlp_loss)
    grads = {}
    for method in partition.PARTITIONERS:
        with pallaskit.config.override(partitioner=method):
            grads[method] = jax.grad(f, argnums=(0, 1))(params, x)
    assert_tree_close(grads["min_cut"], grads["default"], jnp.float32)
    ex = pallaskit.explain_grad(f, params, x, partitioner="min_cut")
    assert ex.saved_bytes < ex.default_saved_bytes
    assert ex.recomputed  # gelu and the norm's pointwise ops run again in the backward
    assert "bytes saved for the backward" in str(ex)
    assert ex.forward.kernels and ex.backward.kernels


def _saved(fn, *avals, method):
    joint = partition.joint_jaxpr(fn, avals, [True] * len(avals))
    return partition.partition(joint, method)


def test_min_cut_recomputes_pointwise_chain():
    x = jax.ShapeDtypeStruct((6, 37), jnp.float32)

    def f(x):
        return [jnp.sum(jnp.exp(jnp.sin(x)) * jnp.cos(x))]

    default, cut = _saved(f, x, method="default"), _saved(f, x, method="min_cut")
    assert [s.origin for s in cut.saved] == ["argument 0"]
    assert cut.saved_bytes == 6 * 37 * 4 < default.saved_bytes
    # both halves reproduce jax's gradient
    xv = jnp.linspace(-2, 2, 6 * 37, dtype=jnp.float32).reshape(6, 37)
    for p in (default, cut):
        outs_and_saved = jax.core.eval_jaxpr(p.forward.jaxpr, p.forward.consts, xv)
        (g,) = jax.core.eval_jaxpr(p.backward.jaxpr, p.backward.consts, *outs_and_saved[1:], jnp.float32(1))
        assert_close(g, jax.grad(lambda x: f(x)[0])(xv))


def test_min_cut_keeps_reductions_and_matmuls():
    x, w = jax.ShapeDtypeStruct((6, 37), jnp.float32), jax.ShapeDtypeStruct((37, 5), jnp.float32)

    def f(x, w):
        h = jnp.tanh(x @ w)  # the matmul is never recomputed: save its (smaller) output or tanh's
        return [jnp.sum(h * h)]

    cut = _saved(f, x, w, method="min_cut")
    assert not any("dot_general" in e for e in cut.recomputed)
    origins = sorted(s.origin.split(":")[0] if s.origin.startswith("argument") else s.aval.str_short()
                     for s in cut.saved)
    assert origins == ["argument 0", "argument 1", "float32[6,5]"]  # x, w and one 6x5 value
    assert cut.saved_bytes < _saved(f, x, w, method="default").saved_bytes


def test_min_cut_saves_what_matmuls_read_in_both_passes(rng):
    """gelu of a matmul feeds the next matmul in the forward and its weight
    gradient in the backward: the forward writes it anyway, so min-cut saves
    it as well as the matmul's output (gelu's derivative reads that), instead
    of saving the matmul's output alone and recomputing gelu from it
    (partition._materialized_twice)."""
    x, w1, w2 = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((6, 37), (37, 5), (5, 3)))

    def f(x, w1, w2):
        return [jnp.sum(jax.nn.gelu(x @ w1, approximate=True) @ w2)]

    cut = _saved(f, x, w1, w2, method="min_cut")
    computed = [s for s in cut.saved if not s.origin.startswith("argument")]
    assert [s.aval.shape for s in computed] == [(6, 5), (6, 5)], cut.saved  # x @ w1 and gelu of it
    assert "dot_general" in computed[0].origin
    assert cut.saved_bytes <= _saved(f, x, w1, w2, method="default").saved_bytes
    args = [_normal(rng, a.shape, jnp.float32) for a in (x, w1, w2)]
    loss = lambda *a: f(*a)[0]  # noqa: E731
    assert_tree_close(jax.grad(pallaskit.jit(loss), argnums=(0, 1, 2))(*args),
                      jax.grad(loss, argnums=(0, 1, 2))(*args), jnp.float32)


def test_partitioner_option_validated():
    with pytest.raises(ValueError, match="min_cut, default"):
        pallaskit.config.update(partitioner="greedy")


# --------------------------------------------------------------------------- #
# forward mode, batching, fallback
# --------------------------------------------------------------------------- #
def test_jvp_and_jacfwd(rng):
    params, x = mlp_args(rng, jnp.float32, rows=3, d=9, hidden=5)
    f = pallaskit.jit(mlp_loss)
    tangents = jax.tree_util.tree_map(lambda a: jnp.ones_like(a), (params, x))
    out, tout = jax.jvp(f, (params, x), tangents)
    ref, ref_tout = jax.jvp(mlp_loss, (params, x), tangents)
    assert_close(out, ref)
    assert_close(tout, ref_tout)
    g = pallaskit.jit(lambda x: jnp.tanh(x) * x)
    xv = _normal(rng, (5,), jnp.float32)
    assert_close(jax.jacfwd(g)(xv), jax.jacfwd(lambda x: jnp.tanh(x) * x)(xv))


def test_vmap(rng):
    def f(x, w):
        return rmsnorm(x, w), jnp.sum(x, -1)

    xs, w = _normal(rng, (3, 6, 37), jnp.float32), _normal(rng, (37,), jnp.float32)
    pf = pallaskit.jit(f)
    assert_tree_close(jax.vmap(pf, (0, None))(xs, w), jax.vmap(f, (0, None))(xs, w), jnp.float32)
    assert_tree_close(jax.vmap(pf, (1, None), out_axes=1)(xs, w), jax.vmap(f, (1, None), out_axes=1)(xs, w),
                      jnp.float32)
    loss = pallaskit.jit(lambda x, w: jnp.sum(rmsnorm(x, w) ** 2))
    ref = jax.vmap(jax.grad(lambda x, w: jnp.sum(rmsnorm(x, w) ** 2), argnums=1), (0, None))(xs, w)
    assert_close(jax.vmap(jax.grad(loss, argnums=1), (0, None))(xs, w), ref)


def test_collectives_over_a_vmap_axis_name(rng):
    """``lax.psum`` / ``axis_index`` over an enclosing ``jax.vmap(axis_name=)``
    inside a pallaskit function: the compiled vmap rule is not told the name,
    and the batched or unbatched call's program lowered with it unbound
    (AssertionError, NameError). Such calls run under JAX's own rules."""
    x = _normal(rng, (3, 4), jnp.float32)

    def make(jit):
        f = jit(lambda v: v / jax.lax.psum(v, "i"))
        g = jit(lambda v: v * jax.lax.psum(1, "i") + jax.lax.axis_index("i"))
        return [jax.vmap(f, axis_name="i")(x),
                jax.vmap(lambda a, b: g(b) + a, in_axes=(0, None), axis_name="i")(x, x[0]),
                jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(f(v) ** 2)), axis_name="i"))(x)]

    for got, want in zip(make(pallaskit.jit), make(jax.jit)):
        assert_close(got, want)


@pytest.mark.parametrize("transform", ["vmap", "vjp"])
def test_donation_survives_transformations(rng, transform):
    """jax.jit's batching and differentiation rules keep a call's donation: under
    ``jax.vmap`` / ``jax.vjp`` the donated array is consumed, as in a plain call.
    pallaskit's derived functions (the vmapped program, the forward half) were
    compiled without it, so the caller's array stayed alive."""
    def f(x, y):
        return jnp.sin(x) * 2 + y

    run = {"vmap": lambda g, x, y: jax.vmap(g)(x, y), "vjp": lambda g, x, y: jax.vjp(g, x, y)[0]}[transform]
    got = {}
    for jit in (jax.jit, pallaskit.jit):
        x, y = _normal(rng, (4, 3), jnp.float32), _normal(rng, (4, 3), jnp.float32)
        want = f(x, y)
        out = run(jit(f, donate_argnums=0), x, y)
        assert_close(out, want)
        got[jit] = (x.is_deleted(), y.is_deleted())
    assert got[pallaskit.jit] == got[jax.jit] == (True, False)


@pytest.mark.parametrize("in_axes", [1, (1, None), (1, 0), (None, 1)], ids=str)
def test_donation_under_vmap_of_other_axes(rng, in_axes):
    """A donated argument batched along axis 1: jax.jit's batching rule keeps
    it in place, donated, and XLA reuses its buffer for an output of its shape
    (deleting it); ``custom_vmap`` moved it to the front first, a copy whose
    donation left the caller's array alive ([Note: donation under vmap] in
    pallaskit/autodiff.py). Twice: the second call runs the compiled program."""
    def f(x, y):
        return jnp.sin(x) * 2 + y

    shapes = {1: ((3, 4), (3, 4)), (1, None): ((3, 4), (3,)), (1, 0): ((3, 4), (4, 3)), (None, 1): ((3,), (3, 4))}
    got = {}
    for jit in (jax.jit, pallaskit.jit):
        g, seen = jax.vmap(jit(f, donate_argnums=(0, 1)), in_axes=in_axes), []
        for _ in range(2):
            x, y = (_normal(rng, s, jnp.float32) for s in shapes[in_axes])
            want = jax.vmap(f, in_axes=in_axes)(x, y)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # jax.jit's unusable-donation warning, pallaskit's alike
                assert_close(g(x, y), want)
            seen.append((x.is_deleted(), y.is_deleted()))
        got[jit] = seen
    assert got[pallaskit.jit] == got[jax.jit]


def test_grad_of_grad_falls_back_to_xla(rng, caplog):
    f = pallaskit.jit(lambda x: jnp.sum(jnp.sin(x) * x))
    ref = jax.grad(lambda s: jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(s * 2.0).sum())
    x = _normal(rng, (6,), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        g = jax.grad(lambda s: jax.grad(f)(s * 2.0).sum())(x)
    assert_close(g, ref(x))
    assert any("nested differentiation" in r.message for r in caplog.records)
    assert pallaskit.metrics.counters["autodiff_fallbacks"] >= 1


def test_tanh_derivative_is_recomputed():
    """tanh's derivative (jax 0.11: ``one_minus_square``) has a lowering rule,
    so the backward recomputes tanh from the argument instead of saving it."""
    def f(x):
        return [jnp.sum(jnp.tanh(x) * 3.0)]

    x = jax.ShapeDtypeStruct((6, 37), jnp.float32)
    cut = _saved(f, x, method="min_cut")
    assert [s.origin for s in cut.saved] == ["argument 0"]
    xv = _normal(np.random.default_rng(3), (6, 37), jnp.float32)
    g = pallaskit.jit(jax.grad(lambda y: f(y)[0]))
    assert pallaskit.explain(g, xv).fallbacks == []
    assert_close(g(xv), jax.jit(jax.grad(lambda y: f(y)[0]))(xv))


@pytest.mark.parametrize("policy", ["names", "dots"])
def test_remat_policies_compile_without_fallbacks(policy, rng):
    """jax.checkpoint with a policy marks residuals with ``name`` (checkpoint_name) and rounds them with
    ``reduce_precision`` at the dtype's own bits: both identities on float32, neither a fallback."""
    from jax.ad_checkpoint import checkpoint_name

    def block(w, h):
        h = checkpoint_name(jnp.tanh(h @ w), "act")
        return jax.nn.gelu(h @ w.T) + h.sum(-1, keepdims=True) * 0.1

    pol = (jax.checkpoint_policies.save_only_these_names("act") if policy == "names"
           else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    blk = jax.checkpoint(block, policy=pol)
    step = jax.value_and_grad(lambda w, h: (blk(w, blk(w, h)) ** 2).mean(), argnums=(0, 1))
    w = jnp.asarray(rng.standard_normal((9, 9)) * 0.3, jnp.float32)
    h = jnp.asarray(rng.standard_normal((5, 9)), jnp.float32).at[0, 0].set(-0.0)
    got, want = pallaskit.jit(step)(w, h), jax.jit(step)(w, h)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
    assert pallaskit.explain(step, w, h).fallbacks == []
