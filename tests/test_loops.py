"""Loop and branch bodies compiled by pallaskit ([Note: loop bodies] in
lowering/loops.py): ``lax.scan``, ``while_loop`` / ``fori_loop`` and
``cond`` / ``switch`` bodies become programs of their own whose kernels run
inside XLA's loop, each checked against jax.jit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from benchmarks.lstm_scan import lstm  # the benchmark's cell, so the test checks what is timed
from conftest import assert_close

B, H, T, I = 4, 24, 5, 7


@pytest.fixture(autouse=True)
def _bodies_compiled():
    """Bodies compile by default only in interpret mode (option loop_bodies):
    on a GPU these tests check the compiled bodies too."""
    with pallaskit.config.override(loop_bodies="on"):
        yield


def _check(fn, *args, tol_dtype=None):
    """``tol_dtype``: a program with 16-bit float inputs rounds at other points
    than XLA (allow_excess_precision), so its float32 results get that dtype's tolerance."""
    out = pallaskit.jit(fn)(*args)
    ref = jax.jit(fn)(*args)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        float_ = jnp.issubdtype(b.dtype, jnp.floating)
        assert_close(a, b, tol_dtype if tol_dtype is not None and float_ else b.dtype)
    return pallaskit.explain(fn, *args)


def _body_kernels(e, prefix):
    return [k for k in e.kernels if k.scope.startswith(prefix)]


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def gru(params, h0, xs):
    """flax.linen.GRUCell's math: r, z gates, n with r applied to h's projection."""
    wx, wh, bx, bh = params

    def cell(h, x):
        gx = (x @ wx).astype(jnp.float32) + bx
        gh = (h @ wh).astype(jnp.float32) + bh
        xr, xz, xn = jnp.split(gx, 3, axis=-1)
        hr, hz, hn = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(xr + hr)
        z = jax.nn.sigmoid(xz + hz)
        n = jnp.tanh(xn + r * hn)
        h = ((1.0 - z) * n + z * h.astype(jnp.float32)).astype(h.dtype)
        return h, h

    return jax.lax.scan(cell, h0, xs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lstm_cell_under_scan_gates_fuse(rng, dtype):
    params = (_normal(rng, (I, 4 * H), dtype, 0.3), _normal(rng, (H, 4 * H), dtype, 0.3),
              _normal(rng, (4 * H,), jnp.float32, 0.1))
    h0, c0 = _normal(rng, (B, H), dtype), _normal(rng, (B, H), jnp.float32)
    xs = _normal(rng, (T, B, I), dtype)
    e = _check(lstm, params, h0, c0, xs, tol_dtype=dtype)
    assert "scan" not in e.fallbacks
    body = _body_kernels(e, "scan")
    gates = [k for k in body if k.kind != "matmul"]  # 16-bit dots may take the matmul template
    assert 1 <= len(gates) <= 2
    # Outside the loop only the input projection x @ wx, hoisted (lowering/scan_hoist.py)
    assert all(k.kind == "matmul" for k in e.kernels if k not in body) and len(e.rewrites) == 1
    assert any("logistic" in eq for k in body for eq in k.equations)
    assert any("tanh" in eq for k in body for eq in k.equations)
    assert "lax.scan(" in e.source and "def scan" in e.source


@pytest.mark.parametrize("dtype", [jnp.float32])  # bfloat16: the LSTM test (the template's dots are slow to interpret)
def test_gru_cell_under_scan_gates_fuse(rng, dtype):
    params = (_normal(rng, (I, 3 * H), dtype, 0.3), _normal(rng, (H, 3 * H), dtype, 0.3),
              _normal(rng, (3 * H,), jnp.float32, 0.1), _normal(rng, (3 * H,), jnp.float32, 0.1))
    h0, xs = _normal(rng, (B, H), dtype), _normal(rng, (T, B, I), dtype)
    e = _check(gru, params, h0, xs, tol_dtype=dtype)
    body = _body_kernels(e, "scan")
    assert 1 <= len([k for k in body if k.kind != "matmul"]) <= 2
    assert all(k.kind == "matmul" for k in e.kernels if k not in body) and len(e.rewrites) == 1


def test_explain_lists_the_body_kernels_nested(rng):
    xs = _normal(rng, (T, 3, 5), jnp.float32)
    e = pallaskit.explain(lambda c, xs: jax.lax.scan(lambda c, x: (c * 0.5 + jnp.sin(x), jnp.exp(c)), c, xs),
                          jnp.zeros((3, 5)), xs)
    assert e.fallbacks == []
    text = str(e)
    assert " in scan" in text and "_body(" in text  # the kernel's scope, the body in the schedule
    assert all(k.name.startswith(k.scope) for k in e.kernels)


def test_scan_carries_and_xs_of_several_dtypes_and_special_values(rng):
    def f(c, xs):
        def step(carry, x):
            a, (n, flag, h) = carry
            xf, xi = x
            a = a * 0.5 + xf  # NaN / inf flow through the carry
            n = n + xi
            flag = jnp.logical_xor(flag, xi > 0)
            h = (h.astype(jnp.float32) * 0.9 + jnp.abs(xf)).astype(jnp.bfloat16)
            return (a, (n, flag, h)), {"y": jnp.where(flag, a, -a), "n2": n * 2}
        return jax.lax.scan(step, c, xs)

    a = _normal(rng, (3, 6), jnp.float32)
    a = a.at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[2, 2].set(-0.0).at[0, 5].set(-jnp.inf)
    carry = (a, (jnp.asarray(rng.integers(-9, 9, (3, 6)), jnp.int32), jnp.asarray(rng.random((3, 6)) < 0.5),
                 _normal(rng, (3, 6), jnp.bfloat16)))
    xs = (_normal(rng, (T, 3, 6), jnp.float32), jnp.asarray(rng.integers(-5, 5, (T, 3, 6)), jnp.int32))
    e = _check(f, carry, xs)
    assert _body_kernels(e, "scan")


@pytest.mark.parametrize("reverse,unroll", [(False, 2), (True, 1), (True, 3)])  # 3: 5 steps leave a remainder
def test_scan_reverse_and_unroll(rng, reverse, unroll):
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c + x), c * x), c, xs, reverse=reverse, unroll=unroll)

    e = _check(f, _normal(rng, (5, 3), jnp.float32), _normal(rng, (T, 5, 3), jnp.float32))
    assert _body_kernels(e, "scan")


def test_scan_length_without_xs(rng):
    def f(c):
        return jax.lax.scan(lambda c, _: (c * 1.5 - 0.25, jnp.sum(c, axis=-1)), c, None, length=4)

    e = _check(f, _normal(rng, (2, 9), jnp.float32))
    assert _body_kernels(e, "scan")


def test_scan_with_a_literal_carry_and_a_constant_output(rng):
    def f(xs):
        return jax.lax.scan(lambda c, x: (c + jnp.sum(x), (jnp.float32(2.0), x * c)), 0.0, xs)

    _check(f, _normal(rng, (T, 1, 4), jnp.float32))


def test_grad_through_scan(rng):
    """jax.grad of a pallaskit function: the forward scan (residuals as ys) and
    its transpose (a reverse scan) compile their bodies; so does the whole step
    compiled as one graph."""
    def loss(w, c, xs):
        def step(c, x):
            c = jnp.tanh(c * w + x)
            return c, jnp.sin(c)
        c, ys = jax.lax.scan(step, c, xs)
        return jnp.sum(ys * ys) + jnp.sum(c)

    args = (_normal(rng, (3, 8), jnp.float32), _normal(rng, (3, 8), jnp.float32), _normal(rng, (T, 3, 8), jnp.float32))
    got = jax.grad(pallaskit.jit(loss), argnums=(0, 1, 2))(*args)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
    e = pallaskit.explain(jax.value_and_grad(loss), *args)
    assert e.fallbacks == []
    assert len({k.scope for k in e.kernels if k.scope.startswith("scan")}) == 2  # forward and transposed bodies
    assert "reverse=True" in e.source


def test_nested_scan_and_cond_inside_scan(rng):
    def f(c, xs):
        def outer(c, x):
            c, ys = jax.lax.scan(lambda d, xr: (d * 0.9 + xr, jnp.cos(d)), c, x)
            c = jax.lax.cond(jnp.sum(c) > 0, lambda c: c - 1.0, lambda c: jnp.exp(-c * c), c)
            return c, ys
        return jax.lax.scan(outer, c, xs)

    e = _check(f, _normal(rng, (6,), jnp.float32), _normal(rng, (3, 4, 6), jnp.float32))
    scopes = {k.scope for k in e.kernels}
    assert any("_body" in s for s in scopes) and any("_branch" in s for s in scopes)
    assert len({s.split("_")[0] for s in scopes}) >= 3  # outer scan, inner scan, cond


@pytest.mark.parametrize("static", [True, False])
def test_fori_loop_static_and_dynamic_trip_count(rng, static):
    def f(x, n):
        stop = 4 if static else n
        return jax.lax.fori_loop(0, stop, lambda i, c: jnp.sin(c) * 1.1 + i.astype(jnp.float32), x)

    e = _check(f, _normal(rng, (3, 7), jnp.float32), jnp.int32(4))
    assert _body_kernels(e, "scan" if static else "while")
    assert e.fallbacks == []


def test_while_loop_with_a_data_dependent_condition(rng):
    def f(x, limit):
        def cond(c):
            x, k = c
            return jnp.logical_and(jnp.max(jnp.abs(x)) < limit, k < 50)

        def body(c):
            x, k = c
            return x * 1.7 + 0.1, k + 1

        return jax.lax.while_loop(cond, body, (x, jnp.int32(0)))

    e = _check(f, _normal(rng, (5, 3), jnp.float32), jnp.float32(40.0))
    assert _body_kernels(e, "while")
    assert "lax.while_loop(" in e.source


def test_while_body_of_raw_triton_runs_every_step(rng):
    """jnp.lcm: a while loop of raw-Triton kernels (jnp.gcd's), its inputs read again
    after it. In Triton's interpreter each kernel is a host callback; as a pure
    callback XLA:CPU hoisted the body's out of the loop, which then never ended."""
    pytest.importorskip("triton")
    a, b = (jnp.asarray(rng.integers(-200, 200, (6, 33)), jnp.int32) for _ in range(2))
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        got = pallaskit.jit(jnp.lcm)(a, b)
    np.testing.assert_array_equal(got, jax.jit(jnp.lcm)(a, b))


def test_while_loop_whose_carry_is_one_raw_triton_kernel(rng, monkeypatch):
    """Raw Triton in Triton's interpreter runs through a host callback. A body
    whose whole carry is one such kernel's outputs (``(x, x)``: a step of two
    results, no counter) ran its first iteration only on XLA:CPU, every later
    one reading that iteration's carry again: a loop that never ended. The
    interpreter's launches are counted so that such a loop fails, not hangs."""
    from pallaskit.runtime import triton_launch

    launches, run = [], triton_launch.run_interpreted

    def bounded(*args, **kwargs):
        launches.append(1)
        if len(launches) > 200:
            raise RuntimeError("the loop did not end")
        return run(*args, **kwargs)

    monkeypatch.setattr(triton_launch, "run_interpreted", bounded)

    def f(x):
        return jax.lax.while_loop(lambda c: jnp.sum(c[0]) < 100.0,
                                  lambda c: (c[0] * 1.5 + jnp.abs(c[1]), c[1] * 0.5), (x, x))

    with pallaskit.config.override(kernel_backend="triton"):
        e = _check(f, jnp.abs(_normal(rng, (4,), jnp.float32)) + 0.1)
    assert "TRITON_CALL" in e.source
    assert launches or jax.default_backend() != "cpu"  # a GPU compiles the kernels: no interpreter


def test_while_loop_with_a_batched_predicate(rng):
    """vmap of a while_loop whose condition depends on the batched carry leaves
    a predicate with the batch's shape: the loop runs while any element's holds,
    and an element whose predicate is false keeps its carry (a crash before)."""
    def collatz(n):
        def body(s):
            return jnp.where(s[0] % 2 == 0, s[0] // 2, 3 * s[0] + 1), s[1] + 1
        return jax.lax.while_loop(lambda s: s[0] != 1, body, (n, 0))

    def newton(x):  # a float carry of rank 2 under a predicate of rank 1
        def cond(s):
            return (s[0] < 30) & (jnp.max(jnp.abs(s[1] * s[1] - x)) > 1e-4)
        return jax.lax.while_loop(cond, lambda s: (s[0] + 1, 0.5 * (s[1] + x / s[1])), (0, jnp.ones_like(x)))

    e = _check(jax.vmap(collatz), jnp.arange(1, 12, dtype=jnp.int32))
    assert "lax.while_loop(" in e.source
    x = jnp.abs(_normal(rng, (5, 4, 3), jnp.float32, 3.0)).at[2].set(1.0)
    _check(jax.vmap(newton), x)
    _check(jax.vmap(jax.vmap(newton)), x)  # a predicate of rank 2
    _check(jax.vmap(pallaskit.jit(newton)), x)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_cond_with_operands_of_several_dtypes(rng, dtype):
    def f(p, x, y):
        def yes(x, y):
            return (x & y, x | y) if dtype == jnp.bool_ else (x * y + x, jnp.maximum(x, y))

        def no(x, y):
            return (x ^ y, ~x) if dtype == jnp.bool_ else (x - y, jnp.abs(y))
        return jax.lax.cond(p, yes, no, x, y)

    if dtype == jnp.bool_:
        x, y = jnp.asarray(rng.random((4, 5)) < 0.5), jnp.asarray(rng.random((4, 5)) < 0.5)
    elif dtype == jnp.int32:
        x, y = (jnp.asarray(rng.integers(-50, 50, (4, 5)), dtype) for _ in range(2))
    else:
        x, y = _normal(rng, (4, 5), dtype), _normal(rng, (4, 5), dtype)
    for p in (True, False):
        e = _check(f, jnp.asarray(p), x, y)
    assert _body_kernels(e, "cond")


def test_grad_of_a_cond_whose_branches_save_different_residuals(rng):
    """Each branch of a differentiated cond returns placeholders (``empty2``) for the
    other branch's residuals: they are zeros in a kernel, not an XLA fallback."""
    def f(x, p):
        return jax.grad(lambda x: jax.lax.cond(p > 0, lambda x: jnp.sin(x).sum(),
                                               lambda x: jnp.where(x > 0, x, 0.1 * x).sum(), x))(x)

    e = _check(f, _normal(rng, (3, 5), jnp.float32), jnp.int32(-1))
    assert "empty2" not in e.fallbacks


def test_a_branch_returning_a_one_element_constant(rng):
    """A branch's one-element group with no operands (``zeros_like`` of a scalar
    parameter: optax's apply_if_finite, MultiSteps) runs inline with no arguments;
    its call was written ``f(, *outs)``, a SyntaxError."""
    def f(p, x):
        return jax.lax.cond(p, lambda x: jnp.zeros_like(x), lambda x: x * 3.0, x)

    _check(f, jnp.asarray(True), _normal(rng, (1, 1), jnp.float32))


def test_platform_dependent_cond_is_its_default_branch(rng):
    """jnp.diagonal of a square matrix is a platform_dependent cond (a branch for Pallas TPU
    kernels, 'mosaic'): its default branch is lowered in place, and its index, passed from
    the forward call to the backward one, is dead; both ran through XLA (a CLIP loss)."""
    def loss(s):
        return jnp.mean(jax.nn.logsumexp(s, 1) - jnp.diagonal(s)) + jnp.trace(s)

    e = _check(jax.value_and_grad(loss), _normal(rng, (5, 5), jnp.float32))
    assert e.fallbacks == [] and not _body_kernels(e, "cond")


def test_switch_with_three_branches(rng):
    def f(i, x):
        return jax.lax.switch(i, [lambda x: jnp.sin(x), lambda x: x * x - 1.0, lambda x: jnp.exp(-x)], x)

    x = _normal(rng, (3, 1, 5), jnp.float32)
    for i in (-1, 0, 1, 2, 7):  # out of range clamps, as lax.switch does
        e = _check(f, jnp.int32(i), x)
    assert len({k.scope for k in e.kernels if k.scope}) == 3


def test_body_keeps_what_it_cannot_compile_as_externs(rng):
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.sort(c + x, axis=-1) * 2.0, jnp.cumsum(x, axis=0)), c, xs)

    e = _check(f, _normal(rng, (3, 8), jnp.float32), _normal(rng, (T, 3, 8), jnp.float32))
    assert _body_kernels(e, "scan") and "sort" in e.fallbacks and "scan" not in e.fallbacks


def test_effects_inside_a_body_keep_the_loop_in_xla(rng, capfd):
    def f(c, xs):
        def step(c, x):
            jax.debug.print("step {}", jnp.sum(x))
            return c + x, c * 2.0
        return jax.lax.scan(step, c, xs)

    xs = jnp.asarray(np.arange(3 * 2, dtype=np.float32).reshape(3, 2))
    e = _check(f, jnp.zeros(2), xs)
    assert "scan" in e.fallbacks and not e.kernels


def test_dynamic_sizes(rng):
    """A loop over a dynamic batch compiles shape-generic, its body's kernels
    reading the sizes at run time; a scan over a dynamic length compiles per
    size (its length is a loop bound XLA needs as a number)."""
    def f(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c + x), c * x), c, xs)

    def g(c, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (jnp.sin(c[0]) * 1.5, c[1] + 1), (c, 0))

    for fn, spec, make, fallbacks in [
            (f, {"c": {0: "n"}, "xs": {1: "n"}}, lambda n: (_normal(rng, (n, 4), jnp.float32),
                                                           _normal(rng, (T, n, 4), jnp.float32)), 0),
            (g, {"c": {1: "n"}}, lambda n: (_normal(rng, (2, n), jnp.float32), jnp.int32(3)), 0),
            (f, {"xs": {0: "t"}}, lambda t: (_normal(rng, (3, 4), jnp.float32),
                                            _normal(rng, (t, 3, 4), jnp.float32)), 1)]:
        pallaskit.metrics.reset()
        pf = pallaskit.jit(fn, dynamic=spec)
        for n in (3, 6):
            args = make(n)
            for a, b in zip(jax.tree_util.tree_leaves(pf(*args)), jax.tree_util.tree_leaves(jax.jit(fn)(*args))):
                assert_close(a, b)
        assert pallaskit.metrics.counters["dynamic_fallbacks"] == fallbacks


def test_a_body_that_fails_to_compile_leaves_the_loop_to_xla(rng, monkeypatch, caplog):
    from lowering import loops

    def broken(*args, **kwargs):
        raise RuntimeError("a compiler bug")

    monkeypatch.setattr(loops, "_body", broken)

    def f(c, xs):
        return jax.lax.scan(lambda c, x: (jnp.tanh(c + x), c * x), c, xs)

    e = _check(f, _normal(rng, (3, 4), jnp.float32), _normal(rng, (T, 3, 4), jnp.float32))
    assert "scan" in e.fallbacks and not e.kernels
    assert any("a compiler bug" in r.message for r in caplog.records)


def _pallas_calls(e, scope_prefix):
    """Kernels launched by pallas_call in the body functions of ``scope_prefix``."""
    return [k for k in _body_kernels(e, scope_prefix) if "pl.pallas_call(" in k.source]


@pytest.mark.pallas_source
def test_scalar_loop_counters_are_plain_jnp_not_kernels(rng):
    """A fori_loop's ``i + 1`` and a while condition's ``i < n`` run as jnp code
    XLA fuses with the loop's bookkeeping, not as one-element kernels."""
    def f(x, n):
        y = jax.lax.fori_loop(0, n, lambda i, c: jnp.sin(c) * 1.1 + i.astype(jnp.float32), x)

        def body(s):
            i, v = s
            return i + 1, v * 0.9

        return y, jax.lax.while_loop(lambda s: s[0] < n + 2, body, (jnp.int32(0), x))

    e = _check(f, _normal(rng, (3, 7), jnp.float32), jnp.int32(5))
    assert all(k.iteration != (1, 1) for k in e.kernels)  # counters and conditions: no kernel
    assert len(_pallas_calls(e, "while")) == 2  # the two (3, 7) bodies still are kernels
    assert "_inline(" in e.source and e.fallbacks == []


@pytest.mark.pallas_source
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_])
def test_scalar_carries_of_several_dtypes_inline(rng, dtype):
    """Scalar carries updated by pointwise math next to a vector carry: values
    (NaN, inf, -0 included) as jax.jit's, the scalar math without a kernel."""
    def f(s, v, xs):
        def cell(c, x):
            s, v = c
            if dtype == jnp.bool_:
                s2 = jnp.logical_xor(s, x[0] > 0)
            elif dtype == jnp.int32:
                s2 = s * 3 + (x[0] > 0).astype(s.dtype) - 1
            else:
                s2 = (s * 0.5 + jnp.tanh(x[0]).astype(s.dtype)) / jnp.asarray(1.25, s.dtype)
            return (s2, v * 0.5 + x), s2

        return jax.lax.scan(cell, (s, v), xs)

    xs = _normal(rng, (6, 5), jnp.float32)
    if dtype in (jnp.float32, jnp.bfloat16):
        xs = xs.at[2, 0].set(jnp.nan).at[4, 0].set(-jnp.inf)
        inits = [jnp.asarray(v, dtype) for v in (0.75, -0.0, jnp.inf)]
    elif dtype == jnp.int32:
        inits = [jnp.asarray(v, dtype) for v in (0, -7, 2**31 - 1)]
    else:
        inits = [jnp.asarray(v) for v in (True, False)]
    for s0 in inits:
        e = _check(f, s0, _normal(rng, (5,), jnp.float32), xs)
        assert all(k.iteration != (1, 1) for k in e.kernels)
        assert _pallas_calls(e, "scan")  # the vector carry's kernel


def test_scalar_only_program_outside_a_loop_keeps_its_kernel(rng):
    """Only loop bodies inline their scalar groups; the wrapper's are kernels."""
    e = _check(lambda a, b: jnp.sin(a) * b + 1, jnp.float32(0.3), jnp.float32(-2.0))
    assert [k.iteration for k in e.kernels] == [(1, 1)]


def _kernel_calls(source, name_part):
    """The ``TRITON_CALL(...)`` lines of kernels whose name holds ``name_part``, with their arguments."""
    lines = source.splitlines()
    return [lines[i] + lines[i + 1] for i, line in enumerate(lines) if "TRITON_CALL(" in line and name_part in line]


def test_a_value_the_body_returns_twice_is_two_stores_of_one_kernel(rng):
    """An RNN cell's new ``h`` is the carry and the step's output. Returned twice
    it made XLA's dynamic-slice fusion run the kernel twice a step on the GPU
    ([Note: distinct body outputs] in lowering/loops.py): the body returns two
    buffers, both stored by the same kernel, and no kernel is added."""
    def f(h, xs):
        return jax.lax.scan(lambda h, x: (jnp.tanh(h * 0.9 + x),) * 2, h, xs)

    h, xs = _normal(rng, (3, 5), jnp.float32), _normal(rng, (T, 3, 5), jnp.float32)
    h = h.at[0, 0].set(jnp.nan).at[1, 1].set(jnp.inf).at[2, 2].set(-0.0)
    e = _check(f, h, xs)
    body = _body_kernels(e, "scan")
    assert len(body) == 1
    ret = next(line for line in e.source.splitlines() if line.strip().startswith("return (") and "scan" not in line)
    names = [n.strip(" (),") for n in ret.split("return", 1)[1].replace("(", " ").replace(")", " ").split(",")]
    names = [n for n in names if n]
    assert len(names) == 2 and len(set(names)) == 2, ret


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_carry_a_kernel_reads_and_writes_at_each_element_is_updated_in_place(rng, dtype):
    """An LSTM's ``c``: the gate kernel reads it and writes it back at the same
    element, so its raw-Triton launch aliases the output to the carry (no copy
    a step; [Note: in-place carries] in lowering/loops.py). A carry read at
    another element (a roll) or read again after the kernel keeps its values."""
    pytest.importorskip("triton")

    def in_place(c, xs):  # c read and written at each element
        def cell(c, x):
            new = c * 0.5 + jnp.sin(x)
            return new, jnp.exp(new)
        return jax.lax.scan(cell, c, xs)

    def shifted(c, xs):  # c read at another element: not in place
        return jax.lax.scan(lambda c, x: (jnp.roll(c, 1, axis=1) * 0.5 + x, c.sum(0)), c, xs)

    def read_after(c, xs):  # c read by a later kernel of the step too (XLA copies it first)
        def cell(carry, x):
            c, acc = carry
            new = c * 0.5 + x
            return (new, acc + jnp.sum(c * c)), new - c
        return jax.lax.scan(cell, (c, jnp.zeros((), jnp.float32)), xs)

    c = _normal(rng, (3, 33), dtype)
    c = c.at[0, 0].set(jnp.nan).at[1, 1].set(-jnp.inf).at[2, 2].set(-0.0)
    xs = _normal(rng, (T, 3, 33), dtype)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        e = _check(in_place, c, xs)
        assert any("aliases=" in call for call in _kernel_calls(e.source, "scan"))
        e = _check(shifted, c, xs)
        assert not any("aliases=" in call for call in _kernel_calls(e.source, "scan"))
        _check(read_after, c, xs)


def test_a_carry_read_by_another_member_of_its_kernel_is_not_updated_in_place(rng):
    """``c`` written by one store of a kernel and read by another of its
    stores: aliased, the second could read the new ``c``. Such a carry keeps
    its own buffer ([Note: in-place carries])."""
    pytest.importorskip("triton")

    def f(c, d, xs):
        return jax.lax.scan(lambda cd, x: ((jnp.sin(x) * 2.0, cd[0] + cd[1] * 0.5), x), (c, d), xs)

    c, d = _normal(rng, (3, 33), jnp.float32), _normal(rng, (3, 33), jnp.float32)
    xs = _normal(rng, (T, 3, 33), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        e = _check(f, c, d, xs)
    calls = _kernel_calls(e.source, "scan")
    assert calls and all("aliases=((0, 0)" not in call for call in calls), calls


def test_a_row_written_into_a_carried_buffer_is_an_update_in_place(rng):
    """``out.at[i].set(row)`` in a ``fori_loop`` body: a scatter over the row,
    its launch aliasing the carried buffer ([Note: updates in place in loop
    bodies] in lowering/rules/gather.py), not a rewrite of the whole buffer a
    step. Values against jax.jit, out-of-range and negative starts clamped as
    dynamic_update_slice clamps them; a row that reads the buffer stays dense."""
    pytest.importorskip("triton")

    def rows(x, out):
        def step(i, out):
            row = jnp.tanh(x[i % x.shape[0]] * (i + 1).astype(x.dtype))
            return jax.lax.dynamic_update_slice(out, row[None], (i * 2 - 3, 0))
        return jax.lax.fori_loop(0, 9, step, out)

    def reads_itself(x, out):
        def step(i, out):
            return out.at[i].set(out[i - 1] * 0.5 + x[i])
        return jax.lax.fori_loop(1, 6, step, out)

    def start_reads_itself(x, out):  # each program of a scatter would compute the start, reading out
        def step(i, out):  # row i's first element names the row written; the row's new first element another
            return jax.lax.dynamic_update_slice(out, (x[i % 6] + 1)[None], (out[i % 6, 0], 0))
        return jax.lax.fori_loop(0, 6, step, out)

    x = _normal(rng, (6, 33), jnp.float32).at[0, 0].set(jnp.nan).at[1, 1].set(-jnp.inf)
    out = _normal(rng, (6, 33), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        e = _check(rows, x, out)
        assert any(k.kind == "scatter" for k in e.kernels if k.scope)  # in the body (a scan: static bounds)
        e = _check(reads_itself, x, out)
        assert not any(k.kind == "scatter" for k in e.kernels if k.scope)
        # rows wider than a program's block (1100 > 1024): the first program's store of out[j, 0] came
        # before the second program's load of the start (Triton's interpreter aliases as the GPU does)
        ints = jnp.asarray(np.broadcast_to(np.arange(6)[:, None], (6, 1100)), jnp.int32)
        e = _check(start_reads_itself, jnp.asarray(rng.integers(0, 5, (6, 1100)), jnp.int32), ints)
        assert not any(k.kind == "scatter" for k in e.kernels if k.scope)


def test_on_a_gpu_auto_compiles_the_loops_whose_bodies_hold_a_large_16bit_matmul():
    """loop_bodies='auto' on a GPU (``loop_bodies_heavy_only``): bf16 RNN cells at
    the benchmark's size compile their bodies; float32 ones, small products and
    loops without a product run as XLA's own loop, chosen, so not listed as a
    fallback (heuristics.loop_body_pays; RESULTS.md, "Session 28")."""
    import dataclasses

    import lowering
    from lowering import loops
    from lowering.options import CompileOptions

    def cell_scan(n, dtype, nested=False):
        w = jax.ShapeDtypeStruct((n, 4 * n), dtype)
        h, xs = jax.ShapeDtypeStruct((256, n), dtype), jax.ShapeDtypeStruct((3, 256, 4 * n), dtype)

        def f(w, h, xs):
            scan = lambda h, xs: jax.lax.scan(lambda h, x: ((jnp.tanh(h @ w + x)[:, :n]).astype(dtype),) * 2, h, xs)
            if nested:
                return jax.lax.while_loop(lambda c: jnp.sum(c[0]) < 0, lambda c: (scan(c[0], xs)[0], c[1]), (h, xs))
            return scan(h, xs)
        closed = jax.make_jaxpr(f)(w, h, xs)
        return next(e for e in closed.jaxpr.eqns if e.primitive.name in loops.KINDS), closed

    gpu_auto = dataclasses.replace(CompileOptions(), loop_bodies_heavy_only=True)
    assert loops.worth_compiling(cell_scan(1024, jnp.bfloat16)[0], gpu_auto)
    assert loops.worth_compiling(cell_scan(1024, jnp.bfloat16, nested=True)[0], gpu_auto)
    assert not loops.worth_compiling(cell_scan(1024, jnp.float32)[0], gpu_auto)
    assert not loops.worth_compiling(cell_scan(64, jnp.bfloat16)[0], gpu_auto)
    assert loops.worth_compiling(cell_scan(64, jnp.bfloat16)[0], CompileOptions())  # 'on', and interpret mode

    _, small = cell_scan(16, jnp.bfloat16)
    result = lowering.compile_jaxpr(small, dataclasses.replace(gpu_auto, interpret=True))
    assert result.fallbacks == [] and "lax.scan(" not in result.program.source
