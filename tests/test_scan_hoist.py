"""Scan hoisting ([Note: scan hoisting] in lowering/scan_hoist.py): a scan
body's carry-free matmuls (an RNN's input projection) computed for all steps
before the loop. The pass is checked on its own (the rewritten jaxpr run by
jax.jit against the original) and through pallaskit.jit, against jax.jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import pallaskit
from benchmarks.lstm_scan import loss as lstm_loss
from benchmarks.lstm_scan import lstm
from conftest import assert_close
from lowering.options import CompileOptions
from lowering.scan_hoist import hoist_scans
from test_loops import gru  # flax.linen.GRUCell's math

B, H, I, T = 3, 5, 7, 6  # odd sizes


def _close(a, b, dtype=None):
    """The dtype's matmul tolerance: on a GPU a float32 dot at DEFAULT precision
    runs as TF32, and the batched projection sums in another order than T small ones."""
    dtype = np.dtype(dtype or b.dtype)
    if dtype == np.float32 and jax.default_backend() != "cpu":
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-2, atol=1e-2)
    else:
        assert_close(a, b, dtype)


def _normal(rng, shape, dtype, scale=0.5):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _lstm_args(rng, dtype, t=T):
    params = (_normal(rng, (I, 4 * H), dtype), _normal(rng, (H, 4 * H), dtype), _normal(rng, (4 * H,), jnp.float32))
    return params, _normal(rng, (B, H), dtype), _normal(rng, (B, H), jnp.float32), _normal(rng, (t, B, I), dtype)


def _gru_args(rng, dtype):
    params = (_normal(rng, (I, 3 * H), dtype), _normal(rng, (H, 3 * H), dtype),
              _normal(rng, (3 * H,), jnp.float32), _normal(rng, (3 * H,), jnp.float32))
    return params, _normal(rng, (B, H), dtype), _normal(rng, (T, B, I), dtype)


def _hoisted(fn, *args):
    """(original closed jaxpr, rewritten one, notes)."""
    closed = jax.make_jaxpr(fn)(*args)
    new, notes = hoist_scans(closed)
    return closed, new, notes


def _check_same(fn, new, args, tol_dtype=None):
    """The rewritten jaxpr computes what jax.jit(fn) does."""
    got = jax.jit(jex_core.jaxpr_as_fun(new))(*jax.tree_util.tree_leaves(args))
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        _close(a, b, tol_dtype if tol_dtype is not None and jnp.issubdtype(b.dtype, jnp.floating) else b.dtype)


def _subjaxprs(params):
    """The open jaxprs among an equation's parameters (a scan's body, a jit's, a cond's branches)."""
    for v in params.values():
        for item in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _scans(jaxpr):
    """Every scan equation in ``jaxpr`` and in its sub-jaxprs, outer first."""
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            yield e
        for sub in _subjaxprs(e.params):
            yield from _scans(sub)


def _count(jaxpr, name="dot_general", nested=True) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == name
        if nested:
            n += sum(_count(sub, name) for sub in _subjaxprs(e.params))
    return n


def _body(scan_eqn):
    return scan_eqn.params["jaxpr"].jaxpr


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_rnn_input_projection_leaves_the_loop(rng, cell, dtype):
    fn, args = (lstm, _lstm_args(rng, dtype)) if cell == "lstm" else (gru, _gru_args(rng, dtype))
    closed, new, notes = _hoisted(fn, *args)
    (before,), (after,) = list(_scans(closed.jaxpr)), list(_scans(new.jaxpr))
    assert _count(_body(before)) == 2 and _count(_body(after)) == 1  # h @ wh stays; x @ wx left
    assert _count(new.jaxpr, nested=False) == 1  # the batched input projection, before the loop
    hidden = 4 * H if cell == "lstm" else 3 * H
    dt = "f32" if dtype == jnp.float32 else "bf16"
    assert notes == [f"scan: input projection hoisted out of the loop (1 dot_general, residual {dt}[{T},{B},{hidden}])"]
    _check_same(fn, new, args, dtype)


def test_special_values_flow_through_the_hoisted_projection(rng):
    params, h0, c0, xs = _lstm_args(rng, jnp.float32)
    xs = xs.at[1, 0, 0].set(jnp.nan).at[3, 2, 1].set(jnp.inf).at[4, 1, 2].set(-jnp.inf).at[5, 0, 3].set(-0.0)
    _, new, notes = _hoisted(lstm, params, h0, c0, xs)
    assert notes
    _check_same(lstm, new, (params, h0, c0, xs))


@pytest.mark.parametrize("t", [1, 2])
def test_short_scans(rng, t):
    args = _lstm_args(rng, jnp.float32, t)
    _, new, notes = _hoisted(lstm, *args)
    assert len(notes) == 1 and f"[{t},{B},{4 * H}]" in notes[0]
    _check_same(lstm, new, args)


@pytest.mark.parametrize("reverse,unroll", [(True, 1), (False, 2), (True, 4)])  # 4: 6 steps leave a remainder
def test_reverse_and_unroll_are_kept(rng, reverse, unroll):
    def f(w, v, c, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(x @ w + c @ v), c * 2.0), c, xs, reverse=reverse, unroll=unroll)

    args = (_normal(rng, (I, H), jnp.float32), _normal(rng, (H, H), jnp.float32), _normal(rng, (B, H), jnp.float32),
            _normal(rng, (T, B, I), jnp.float32))
    _, new, notes = _hoisted(f, *args)
    (scan,) = _scans(new.jaxpr)
    assert notes and scan.params["reverse"] == reverse and scan.params["unroll"] == unroll
    _check_same(f, new, args)


def test_a_scan_without_xs_is_left_alone(rng):
    def f(w, c):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), jnp.sum(c)), c, None, length=4)

    closed, new, notes = _hoisted(f, _normal(rng, (H, H), jnp.float32), _normal(rng, (B, H), jnp.float32))
    assert new is closed and notes == []


def test_elementwise_only_body_is_left_alone(rng):
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (c * 0.5 + jnp.sin(x) * 2.0, jnp.exp(x) + c), c, xs)

    closed, new, notes = _hoisted(f, _normal(rng, (B, H), jnp.float32), _normal(rng, (T, B, H), jnp.float32))
    assert new is closed and notes == []


def test_a_matmul_of_constants_only_is_not_hoisted(rng):
    """w @ v reads no scanned input: a loop invariant, not an input projection."""
    def f(w, v, c, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c @ (w @ v)) + x, c), c, xs)

    closed, new, notes = _hoisted(f, _normal(rng, (H, H), jnp.float32), _normal(rng, (H, H), jnp.float32),
                                  _normal(rng, (B, H), jnp.float32), _normal(rng, (T, B, H), jnp.float32))
    assert new is closed and notes == []


def test_a_projection_that_blows_its_input_up_is_not_hoisted(rng):
    """An outer product per step (K = 1): a [T, B, 64] residual from [T, B]
    inputs is memory traffic, not a GEMM worth batching."""
    def f(w, c, xs):
        def step(c, x):
            p = jax.lax.dot_general(x[:, None], w, (((1,), (0,)), ((), ())))
            return jnp.tanh(c + p), None
        return jax.lax.scan(step, c, xs)

    closed, new, notes = _hoisted(f, _normal(rng, (1, 64), jnp.float32), _normal(rng, (B, 64), jnp.float32),
                                  _normal(rng, (T, B), jnp.float32))
    assert new is closed and notes == []


def test_several_xs_only_the_projected_one_is_hoisted(rng):
    """Three scanned inputs: a float projected, a float used elementwise, an int
    flag; loop-invariant work (w's transpose, a sum of v) used both by the
    projection and by the carried part is never stacked T times."""
    def f(w, v, c, xs):
        def step(c, x):
            a, e, k = x
            wt = w.T  # invariant, read by the hoisted projection and the loop
            s = jnp.sum(v)  # invariant, read by the loop only
            z = a @ wt + c @ v
            c = jnp.where(k > 0, jnp.tanh(z) * s, z * 0.5 + e)
            return c, (c + jnp.sum(wt), e * 2.0)
        return jax.lax.scan(step, c, xs)

    xs = (_normal(rng, (T, B, I), jnp.float32), _normal(rng, (T, B, H), jnp.float32),
          jnp.asarray(rng.integers(-2, 2, (T, B, H)), jnp.int32))
    args = (_normal(rng, (H, I), jnp.float32), _normal(rng, (H, H), jnp.float32), _normal(rng, (B, H), jnp.float32), xs)
    closed, new, notes = _hoisted(f, *args)
    assert notes == [f"scan: input projection hoisted out of the loop (1 dot_general, residual f32[{T},{B},{H}])"]
    (scan,) = _scans(new.jaxpr)
    stacked = [v.aval.shape for v in scan.invars if v.aval.shape[:1] == (T,)]
    assert sorted(stacked) == sorted([(T, B, H)] * 3)  # e, k and the projection; a itself no longer
    assert _count(_body(scan)) == 1
    # No [T, ...] copy of an invariant before the loop: only the projection (and w's transpose) run there.
    outside = [e for e in new.jaxpr.eqns if e.primitive.name != "scan"]
    assert not any(e.primitive.name == "broadcast_in_dim" for e in outside), outside
    assert sum(e.primitive.name == "dot_general" for e in outside) == 1
    _check_same(f, new, args)


def test_integer_projection_is_exact(rng):
    def f(w, c, xs):
        return jax.lax.scan(lambda c, x: ((c * 3 + x @ w) % 1000, c), c, xs)

    args = (jnp.asarray(rng.integers(-9, 9, (I, H)), jnp.int32), jnp.asarray(rng.integers(-9, 9, (B, H)), jnp.int32),
            jnp.asarray(rng.integers(-9, 9, (T, B, I)), jnp.int32))
    _, new, notes = _hoisted(f, *args)
    assert notes and "i32[" in notes[0]
    _check_same(f, new, args)


def test_effects_in_the_body_keep_the_scan(rng, capfd):
    def f(w, c, xs):
        def step(c, x):
            jax.debug.print("step {}", jnp.sum(x))
            return jnp.tanh(x @ w + c), c
        return jax.lax.scan(step, c, xs)

    args = (_normal(rng, (I, H), jnp.float32), _normal(rng, (B, H), jnp.float32), _normal(rng, (T, B, I), jnp.float32))
    closed, new, notes = _hoisted(f, *args)
    assert new is closed and notes == []
    got = pallaskit.jit(f)(*args)
    jax.effects_barrier()
    assert capfd.readouterr().out.count("step ") == T
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(jax.jit(f)(*args))):
        _close(a, b)


def test_nested_scan_and_a_scan_inside_jit(rng):
    """The outer loop's projection leaves it first; the inner loop, in the
    rebuilt outer body and inside a jit, is rewritten there."""
    def f(w, u, c, xs):
        @jax.jit
        def inner(c, chunk):
            return jax.lax.scan(lambda d, x: (jnp.tanh(x @ u + d), d), c, chunk)

        def outer(c, x):
            p = x @ w  # outer projection: [chunk, B, H]
            c, ys = inner(c, p)
            return c, ys
        return jax.lax.scan(outer, c, xs)

    args = (_normal(rng, (I, H), jnp.float32), _normal(rng, (H, H), jnp.float32), _normal(rng, (B, H), jnp.float32),
            _normal(rng, (3, 4, B, I), jnp.float32))
    _, new, notes = _hoisted(f, *args)
    assert len(notes) == 2, notes
    outer, inner = list(_scans(new.jaxpr))
    assert _count(new.jaxpr, nested=False) == 1 and _count(_body(inner)) == 0
    _check_same(f, new, args)


def test_grad_through_the_scan(rng):
    """value_and_grad as one graph: the forward scan's projection is hoisted;
    the transposed scan (its dots all read the carried cotangent) is kept."""
    args = _lstm_args(rng, jnp.float32)
    fn = jax.value_and_grad(lstm_loss, argnums=(0, 1, 2, 3))
    closed, new, notes = _hoisted(fn, *args)
    assert len(notes) == 1
    fwd, bwd = list(_scans(new.jaxpr))
    assert not fwd.params["reverse"] and bwd.params["reverse"]
    assert _count(_body(fwd)) == 1
    _check_same(fn, new, args)


@pytest.mark.parametrize("dtype,whole", [(jnp.float32, False), (jnp.bfloat16, True)])
def test_pallaskit_grad_matches_jax(rng, dtype, whole):
    """jax.grad of a pallaskit function (forward and backward compiled apart),
    or value_and_grad compiled as one graph (bfloat16: the interpreted matmul
    template is slow, one variant each)."""
    args = _lstm_args(rng, dtype)
    if whole:
        fn = jax.value_and_grad(lstm_loss, argnums=(0, 3))
        got, want = pallaskit.jit(fn)(*args), jax.jit(fn)(*args)
    else:
        got = jax.grad(pallaskit.jit(lstm_loss), argnums=(0, 3))(*args)
        want = jax.jit(jax.grad(lstm_loss, argnums=(0, 3)))(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        _close(a, b, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallaskit_lstm_explain_and_option(rng, dtype):
    pallaskit.config.update(loop_bodies="on")  # 'auto' compiles bodies in interpret mode only
    args = _lstm_args(rng, dtype)
    for a, b in zip(jax.tree_util.tree_leaves(pallaskit.jit(lstm)(*args)),
                    jax.tree_util.tree_leaves(jax.jit(lstm)(*args))):
        _close(a, b, dtype)
    e = pallaskit.explain(lstm, *args)
    assert len(e.rewrites) == 1 and e.rewrites[0] in str(e) and e.fallbacks == []
    assert "input projection hoisted" in e.rewrites[0]
    assert "lax.scan(" in e.source  # the rewritten loop's body still compiles
    with pallaskit.config.override(scan_hoisting=False):
        off = pallaskit.explain(lstm, *args)
        assert off.rewrites == [] and "hoisted" not in str(off)
        for a, b in zip(jax.tree_util.tree_leaves(pallaskit.jit(lstm)(*args)),
                        jax.tree_util.tree_leaves(jax.jit(lstm)(*args))):
            _close(a, b, dtype)


def test_option_defaults_and_help():
    assert CompileOptions().scan_hoisting
    assert "scan_hoisting" in pallaskit.config.help()
    assert "scan_hoisting=False" in CompileOptions(scan_hoisting=False).key()
