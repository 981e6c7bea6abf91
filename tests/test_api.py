"""The jit API: jax.jit's calling convention, signatures, errors, options, metrics."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close


def test_decorator_forms(rng):
    x = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)

    @pallaskit.jit
    def f(a):
        return a * 2 + 1

    @pallaskit.jit(static_argnums=1)
    def g(a, n):
        return a * n

    h = pallaskit.jit(lambda a, n: a + n, static_argnames="n")
    assert_close(f(x), x * 2 + 1)
    assert_close(g(x, 3), x * 3)
    assert_close(h(x, n=2), x + 2)
    assert isinstance(f(x), jax.Array)


def test_pytrees_in_and_out(rng):
    def f(params, x):
        y = x @ params["w"] + params["b"]
        return {"y": jnp.tanh(y), "stats": (y.mean(), [y.max()])}

    params = {"w": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal((3,)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((7, 5)), jnp.float32)
    out, ref = pallaskit.jit(f)(params, x), jax.jit(f)(params, x)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_retrace_on_new_shape_and_cache_hit(rng):
    # Static retracing: with automatic dynamic on, a GPU serves the second size from a symbolic graph.
    f = pallaskit.jit(lambda a: jnp.sum(a * a, -1))
    with pallaskit.config.override(automatic_dynamic=False):
        for shape in [(3, 10), (3, 10), (5, 11), (3, 10)]:
            x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
            assert_close(f(x), jnp.sum(x * x, -1))
    assert pallaskit.metrics.counters["graphs_compiled"] == 2


@pytest.mark.no_speculation
def test_steady_state_calls_take_the_fast_path(rng):
    """Repeat calls on concrete arrays skip the argument checks: one entry per
    (structure, avals), and a new dtype, shape or pytree structure is a new
    signature, never a reuse of another one's executable."""
    f = pallaskit.jit(lambda t: {"y": t["a"] * 2.0 + t["b"]})
    a = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    cases = [{"a": a, "b": a}, {"a": a, "b": a[0]}, {"a": a.astype(jnp.bfloat16), "b": a}, {"a": a, "b": a}]
    for t in cases * 2:
        assert_close(f(t)["y"], jax.jit(lambda t: t["a"] * 2.0 + t["b"])(t))
    assert len(f._fast) == 3 and len(f._cache) == 3
    assert pallaskit.metrics.counters["graphs_compiled"] == 3


@pytest.mark.no_speculation
def test_static_args_key_the_cache(rng):
    calls = []

    def f(a, mode):
        calls.append(mode)
        return a * 2 if mode == "double" else a + 1

    jf = pallaskit.jit(f, static_argnames="mode")
    x = jnp.asarray(rng.standard_normal((3,)), jnp.float32)
    assert_close(jf(x, mode="double"), x * 2)
    assert_close(jf(x, mode="inc"), x + 1)
    assert_close(jf(x, mode="double"), x * 2)
    assert calls == ["double", "inc"]


@pytest.mark.no_speculation
def test_python_scalars_and_weak_types(rng):
    f = pallaskit.jit(lambda a, s: a * s + 1)
    x = jnp.asarray(rng.standard_normal((6,)), jnp.bfloat16)
    out = f(x, 2.5)
    ref = jax.jit(lambda a, s: a * s + 1)(x, 2.5)
    assert out.dtype == ref.dtype == jnp.bfloat16  # the weak float scalar does not promote
    assert_close(out, ref, jnp.bfloat16)
    assert_close(f(3.0, 2), jax.jit(lambda a, s: a * s + 1)(3.0, 2))
    f(x, 2.5)
    f(x, 1.5)  # same abstract signature: no retrace
    assert pallaskit.metrics.counters["graphs_compiled"] == 2


def test_non_array_argument_is_a_type_error_naming_it():
    f = pallaskit.jit(lambda x, opts: x)
    with pytest.raises(TypeError, match="'opts'"):
        f(jnp.ones(3), "fast")
    with pytest.raises(TypeError, match=r"argument 'x'\['k'\]"):
        f({"k": object()}, 1)
    with pytest.raises(OverflowError, match="path is argument 'opts'"):  # as jax.jit's, naming it
        f(jnp.ones(3), 2**40)


def test_unknown_option_lists_valid_ones():
    with pytest.raises(AttributeError, match="valid options:.*fusion"):
        pallaskit.config.update(no_such_option=1)
    with pytest.raises(ValueError, match="Valid:"):
        pallaskit.config.update(fusion="sometimes")
    with pytest.raises(ValueError, match="Valid:"):
        pallaskit.config.update(num_warps=-1)


def test_environment_variable_and_bad_value(monkeypatch):
    monkeypatch.setenv("PALLASKIT_MAX_PERSISTENT_COLS", "128")
    assert pallaskit.config.max_persistent_cols == 128
    monkeypatch.setenv("PALLASKIT_FUSION", "maybe")
    with pytest.raises(ValueError, match="PALLASKIT_FUSION"):
        _ = pallaskit.config.fusion
    monkeypatch.delenv("PALLASKIT_FUSION")
    monkeypatch.setenv("PALLASKIT_FUSOIN", "1")
    with pytest.raises(ValueError, match="PALLASKIT_FUSOIN"):
        pallaskit.config.snapshot()


def test_absl_flags_bind_to_options():
    from absl import flags

    flags.FLAGS(["prog", "--pallaskit_num_warps=8"])
    try:
        assert pallaskit.config.num_warps == 8
        pallaskit.config.update(num_warps=2)  # explicit beats the flag
        assert pallaskit.config.num_warps == 2
    finally:
        flags.FLAGS.unparse_flags()


@pytest.mark.no_speculation
def test_fallback_keeps_results_and_still_fuses(rng, caplog):
    def f(x, w):
        h = jnp.tanh(x * 2.0) + 1.0
        h = jnp.sort(h, axis=-1)
        y = h @ w
        return jax.nn.relu(y) * 3.0 - 1.0

    x = jnp.asarray(rng.standard_normal((9, 20)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((20, 7)), jnp.float32)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        out = pallaskit.jit(f)(x, w)
    np.testing.assert_allclose(out, jax.jit(f)(x, w), rtol=1e-4, atol=1e-4)
    assert pallaskit.metrics.counters["fallback_count"] == 2  # extern nodes: the sort and the (float32) matmul
    e = pallaskit.explain(f, x, w)
    assert e.fallbacks == ["sort"]
    # Before the sort; after it. The float32 matmul runs through XLA by choice
    # (matmul_template="auto"), which is not a fallback.
    assert [k.kind for k in e.kernels] == ["pointwise", "pointwise"]
    assert sum("sort" in r.message for r in caplog.records) == 1  # logged once


def test_empty_leaves_are_no_fallback(rng, caplog):
    """An optimizer over a pytree with (0,)- and (3, 0)-shaped leaves: their
    ops run through XLA (no work for a kernel) without a fallback logged, which
    named mul / sqrt / reduce_sum as if the update had not compiled."""
    def adam(p, g, m, v):
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: 0.99 * v + 0.01 * g * g, v, g)
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(g)))
        return jax.tree_util.tree_map(lambda p, m, v: p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), p, m, v), m, v, norm

    shapes = {"w": (5, 3), "b": (3,), "empty": (0,), "empty2": (3, 0)}
    p, g, m = ({k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()} for _ in range(3))
    v = jax.tree_util.tree_map(jnp.abs, m)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        out = pallaskit.jit(adam)(p, g, m, v)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(jax.jit(adam)(p, g, m, v))):
        assert a.shape == b.shape
        assert_close(a, b)
    assert pallaskit.explain(adam, p, g, m, v).fallbacks == []
    assert not [r for r in caplog.records if "runs through XLA" in r.message]


def test_dead_equations_are_no_fallback(rng, caplog):
    """A key split and never used (flax's ``nn.RNN`` makes its carry that way) or a sort whose result is
    dropped runs nowhere: no fallback named, values as jax.jit; an unused effect still runs."""
    def f(x):
        k1, k2 = jax.random.split(jax.random.key(0))  # random_seed, random_split, slice, squeeze on keys: dead
        _ = jnp.sort(x, axis=-1)
        carry = jnp.zeros((x.shape[0], 4))
        h = jax.lax.scan(lambda c, xt: (jnp.tanh(c + xt.sum()), c), carry, x.T)[0]
        return h * 2.0

    x = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    pallaskit.config.update(loop_bodies="on")  # the GPU's default leaves the scan to XLA
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        assert_close(pallaskit.jit(f)(x), jax.jit(f)(x))
    assert pallaskit.explain(f, x).fallbacks == []
    assert not [r for r in caplog.records if "runs through XLA" in r.message]

    seen = []

    def g(x):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), x.sum())  # dead result, kept effect
        return x + 1.0

    assert_close(pallaskit.jit(g)(x), x + 1.0)
    assert len(seen) == 1


def test_prng_and_control_flow_run_through_xla(rng):
    def f(key, x):
        noise = jax.random.normal(key, x.shape)
        y = jax.lax.fori_loop(0, 3, lambda i, c: c * 1.5 + 1.0, x)
        return jnp.exp(y) + noise

    key = jax.random.key(0)
    x = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
    np.testing.assert_allclose(pallaskit.jit(f)(key, x), jax.jit(f)(key, x), rtol=1e-5)


def test_inlines_pjit_custom_jvp_and_remat(rng):
    @jax.jit
    def inner(a):
        return jax.nn.relu(a) + jax.nn.softplus(a)

    @jax.checkpoint
    def ck(a):
        return jnp.sin(a) * 2

    def f(x):
        return inner(x) + ck(x)

    x = jnp.asarray(rng.standard_normal((8, 9)), jnp.float32)
    e = pallaskit.explain(f, x)
    assert e.fallbacks == [] and len(e.kernels) == 1
    assert_close(pallaskit.jit(f)(x), jax.jit(f)(x))


def test_constants_are_hoisted(rng):
    table = np.asarray(rng.standard_normal((4, 6)), np.float32)
    f = lambda x: x * jnp.asarray(table) + 1
    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    assert_close(pallaskit.jit(f)(x), x * table + 1)


def test_outputs_that_are_inputs_or_literals(rng):
    f = lambda x, y: (x, 3.0, y * 2)
    x = jnp.asarray(rng.standard_normal((3,)), jnp.float32)
    out = pallaskit.jit(f)(x, x)
    assert_close(out[0], x)
    assert float(out[1]) == 3.0
    assert_close(out[2], x * 2)


@pytest.mark.no_speculation
def test_explain_is_readable_and_metrics_count(rng):
    x = jnp.asarray(rng.standard_normal((5, 40)), jnp.float32)
    f = lambda a: jax.nn.softmax(a, -1)
    e = pallaskit.explain(f, x)
    text = str(e)
    assert "1 kernel(s)" in text and "reduce_max" in text
    k = e.kernels[0]
    assert k.name.startswith("red_fused") and "def " + k.name in k.source
    assert any("exp" in eq for eq in k.equations)
    pallaskit.metrics.reset()
    jf = pallaskit.jit(f)
    jf(x)
    jf(x)
    c = pallaskit.metrics.counters
    assert c["graphs_compiled"] == 1 and c["kernels_compiled"] == 1 and c["generated_kernel_count"] == 1
    assert c["fallback_count"] == 0


def test_explain_takes_shapes_and_a_call_does_not():
    """explain needs shapes only (jax.ShapeDtypeStruct, as jax.jit(...).lower takes);
    a call given one is a clear TypeError, not an XLA error after compiling."""
    spec = jax.ShapeDtypeStruct((7, 1, 33), jnp.bfloat16)
    f = lambda a: jnp.tanh(a) * 2  # noqa: E731
    assert "1 kernel(s)" in str(pallaskit.explain(f, spec))
    with pytest.raises(TypeError, match="needs arrays"):
        pallaskit.jit(f)(spec)


@pytest.mark.no_speculation
@pytest.mark.pallas_source
def test_debug_dump(tmp_path, rng):
    x = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    with pallaskit.config.override(debug_dir=str(tmp_path)):
        pallaskit.jit(lambda a: jnp.exp(a).sum(-1))(x)
    (folder,) = list(tmp_path.iterdir())
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["ir_after_fusion.txt", "ir_before_fusion.txt", "jaxpr.txt", "program.py"]
    assert "pallas_call" in (folder / "program.py").read_text()


@pytest.mark.pallas_source
def test_debug_dump_on_a_cache_hit(tmp_path, rng):
    """A program loaded from the disk cache still gets its folder: the jaxpr,
    the program source kept in the entry, and a note on the missing IR."""
    x = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    f = lambda a: jnp.exp(a).sum(-1)  # noqa: E731
    first = pallaskit.jit(f)(x)
    assert pallaskit.metrics.counters["cache_misses"] == 1
    with pallaskit.config.override(debug_dir=str(tmp_path)):
        assert_close(pallaskit.jit(f)(x), first)
    assert pallaskit.metrics.counters["cache_hits"] == 1
    (folder,) = list(tmp_path.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["FROM_CACHE.txt", "jaxpr.txt", "program.py"]
    assert "pallas_call" in (folder / "program.py").read_text()
    assert "exp" in (folder / "jaxpr.txt").read_text()


def test_options_help_is_reachable_from_python(monkeypatch, capsys):
    monkeypatch.setenv("PALLASKIT_NUM_WARPS", "4")
    text = pallaskit.config.describe("num_warps")
    assert text.startswith("num_warps = 4  (PALLASKIT_NUM_WARPS; default 0)")
    assert "--pallaskit_num_warps" in text and "heuristics decide" in text
    pallaskit.config.update(fusion=False)
    assert "(config.update; default True)" in pallaskit.config.describe("fusion")
    everything = pallaskit.config.help()
    assert capsys.readouterr().out.strip() == everything.strip()
    from pallaskit.config import OPTIONS

    for name, option in OPTIONS.items():
        assert f"{name} = " in everything and option.help in everything
    with pytest.raises(AttributeError, match="valid options"):
        pallaskit.config.describe("fusoin")


def test_generated_source_is_stable(rng):
    x = jnp.asarray(rng.standard_normal((6, 30)), jnp.float32)
    f = lambda a: jax.nn.softmax(a, -1)
    assert pallaskit.explain(f, x).source == pallaskit.explain(f, x).source


def test_coverage_doc_is_current():
    import json
    from pathlib import Path

    from lowering.rules import coverage_markdown

    docs = Path(__file__).resolve().parent.parent / "docs"
    runs = json.loads((docs / "accuracy.json").read_text())["runs"] if (docs / "accuracy.json").exists() else None
    assert (docs / "coverage.md").read_text() == coverage_markdown(runs), \
        "run: python -m lowering.rules > docs/coverage.md"
