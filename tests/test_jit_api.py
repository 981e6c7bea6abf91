"""pallaskit.jit as a drop-in for jax.jit: its arguments checked as jax.jit checks
them, donation, the ahead-of-time stages, errors that name the user's function."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close


def _two(x, y):
    return x * 2.0 + y


def _outcome(make):
    """(exception type, message) of ``make()``, or None when it returns."""
    try:
        make()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None


@pytest.mark.parametrize("kwargs", [
    dict(static_argnums=5),
    dict(static_argnums="n"),
    dict(static_argnums=(0, "y")),
    dict(static_argnames="z"),
    dict(static_argnames=("x", "nope")),
    dict(donate_argnums=7),
    dict(donate_argnames="q"),
    dict(static_argnums=0, donate_argnums=0),
    dict(static_argnames="y", donate_argnames="y"),
    dict(static_argnums=1, donate_argnames="y"),
    dict(static_argnums=-1),
    dict(static_argnums=0, static_argnames="y"),
    dict(donate_argnums=(0, 1)),
], ids=str)
def test_jit_arguments_are_checked_as_jax_checks_them(kwargs):
    """Every combination jax.jit rejects, pallaskit.jit rejects with the same
    exception type and message; what jax.jit accepts, pallaskit.jit accepts."""
    expected = _outcome(lambda: jax.jit(_two, **kwargs))
    assert _outcome(lambda: pallaskit.jit(_two, **kwargs)) == expected
    assert _outcome(lambda: pallaskit.jit(**kwargs)(_two)) == expected


def test_unhashable_static_value_raises_as_jax_does():
    x = jnp.ones(3)
    expected = _outcome(lambda: jax.jit(_two, static_argnums=1)(x, [1.0]))
    assert expected is not None and expected[0] is ValueError
    assert _outcome(lambda: pallaskit.jit(_two, static_argnums=1)(x, [1.0])) == expected
    expected = _outcome(lambda: jax.jit(_two, static_argnames="y")(x, y={"a": 1}))
    assert _outcome(lambda: pallaskit.jit(_two, static_argnames="y")(x, y={"a": 1})) == expected


def test_static_arguments_resolve_as_jax_resolves_them(rng):
    """Negative static_argnums count from the end; with both static_argnums and
    static_argnames given, each applies as given (a positional ``y`` is then
    dynamic, as in jax.jit)."""
    def f(x, y, scale):
        return x * scale + y

    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    for kwargs, call in [(dict(static_argnums=-1), lambda g: g(x, y, 3.0)),
                         (dict(static_argnums=2, static_argnames="y"), lambda g: g(x, y, 2.0)),
                         (dict(static_argnames="scale"), lambda g: g(x, y, scale=0.5)),
                         (dict(static_argnames="scale"), lambda g: g(x, y, 0.5))]:
        assert_close(call(pallaskit.jit(f, **kwargs)), call(jax.jit(f, **kwargs)))


def test_negative_static_argnums_count_from_the_calls_arguments(rng):
    """jax.jit resolves a negative static argnum per call, from the end of the
    positional arguments given (``i % len(args)``): a call that leaves a
    defaulted parameter out, or a ``*args`` function, makes another argument static."""
    def defaulted(x, n, training=False):
        return sum(x * i for i in range(n)) if not training else x

    def varargs(*xs):
        return sum(xs[:-1]) * xs[-1]

    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    for fn, argnums, call in [(defaulted, -1, lambda g: g(x, 3)), (defaulted, -1, lambda g: g(x, 2)),
                              (varargs, -1, lambda g: g(x, y, 3)), (varargs, -2, lambda g: g(x, 2, y))]:
        if fn is varargs and argnums == -2:
            fn = lambda *xs: xs[0] * xs[1] + xs[2]  # noqa: E731
        assert_close(call(pallaskit.jit(fn, static_argnums=argnums)), call(jax.jit(fn, static_argnums=argnums)))


# --------------------------------------------------------------------------- #
# donation
# --------------------------------------------------------------------------- #
def _sgd(params, grads, lr):
    return jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)


def _params(rng, rows=6, cols=5, dtype=jnp.float32):
    return {"w": jnp.asarray(rng.standard_normal((rows, cols)), dtype),
            "b": jnp.asarray(rng.standard_normal((cols,)), dtype)}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_donated_pytree_is_deleted_and_results_match(rng, dtype):
    params, grads = _params(rng, dtype=dtype), _params(rng, dtype=dtype)
    ref = jax.jit(_sgd, static_argnums=2)(params, grads, 0.5)
    step = pallaskit.jit(_sgd, static_argnums=2, donate_argnums=0)
    out = step(params, grads, 0.5)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert_close(a, b, dtype)
    assert all(p.is_deleted() for p in jax.tree_util.tree_leaves(params))
    assert not any(g.is_deleted() for g in jax.tree_util.tree_leaves(grads))
    # the steady state (the fast path) donates too
    again = _params(rng, dtype=dtype)
    step(again, grads, 0.5)
    assert all(p.is_deleted() for p in jax.tree_util.tree_leaves(again))
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(again["w"])


def test_donate_argnames_and_keyword_calls(rng):
    params, grads = _params(rng), _params(rng)
    ref = jax.jit(_sgd, static_argnames="lr")(params, grads, lr=0.25)
    out = pallaskit.jit(_sgd, static_argnames="lr", donate_argnames="params")(params, grads=grads, lr=0.25)
    assert_close(out["w"], ref["w"])
    assert params["w"].is_deleted() and not grads["w"].is_deleted()
    # donate_argnums also donates the argument passed by keyword, as in jax.jit
    params = _params(rng)
    pallaskit.jit(_sgd, static_argnums=2, donate_argnums=0)(params=params, grads=grads, lr=0.25)
    assert params["w"].is_deleted()


def test_donation_survives_the_disk_cache(rng):
    params, grads = _params(rng), _params(rng)
    ref = jax.jit(_sgd, static_argnums=2)(params, grads, 0.1)
    pallaskit.jit(_sgd, static_argnums=2, donate_argnums=0)(_params(rng), grads, 0.1)
    assert pallaskit.metrics.counters["cache_misses"] == 1
    out = pallaskit.jit(_sgd, static_argnums=2, donate_argnums=0)(params, grads, 0.1)
    assert pallaskit.metrics.counters["cache_hits"] == 1
    assert_close(out["w"], ref["w"])
    assert params["w"].is_deleted()
    # a different donation is a different executable: not the entry above
    params = _params(rng)
    pallaskit.jit(_sgd, static_argnums=2)(params, grads, 0.1)
    assert pallaskit.metrics.counters["cache_hits"] == 1 and not params["w"].is_deleted()


@pytest.mark.parametrize("hints", ["", "64,256,4096"])
def test_donation_with_dynamic_shapes(rng, hints):
    pallaskit.config.update(multi_kernel_hints=hints)

    def f(x, y):
        return jnp.tanh(x) * 2.0 + y

    jf = pallaskit.jit(f, donate_argnums=0, dynamic={"x": {0: "n"}, "y": {0: "n"}})
    for n in (5, 9, 5):
        x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
        ref = jax.jit(f)(x, y)
        assert_close(jf(x, y), ref)
        assert x.is_deleted() and not y.is_deleted()
    assert pallaskit.metrics.counters["graphs_compiled"] == 1


def test_donation_with_automatic_dynamic(rng):
    """Default options: the second size makes the rows dynamic; donation holds on
    the static, the symbolic and the recurring sizes alike."""
    def f(x, y):
        return x * y + 1.0

    jf = pallaskit.jit(f, donate_argnums=0)
    for n in (5, 9, 5, 13, 9):
        x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
        ref = jax.jit(f)(x, y)
        assert_close(jf(x, y), ref)
        assert x.is_deleted() and not y.is_deleted()
    assert pallaskit.metrics.counters["graphs_compiled"] == 2


def test_automatic_dynamic_deletes_what_jax_jit_deletes(rng):
    """After the rows turn dynamic (a dispatcher of variants, no XLA donation of
    its own), a donated argument no output can take stays alive and is named
    in jax.jit's warning, as jax.jit keeps it; one an output takes is deleted
    (a typed key too). pallaskit deleted every donated argument."""
    def f(x, y, s, key):
        h = jnp.tanh(x @ s)  # (n, 4): takes y's buffer; x (n, 3) has no output of its shape or size
        return h + y, (h * y).sum(), jax.random.split(key)[0]

    jf, ref = pallaskit.jit(f, donate_argnums=(0, 1, 3)), jax.jit(f, donate_argnums=(0, 1, 3))
    s = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    for n in (5, 9, 5, 13):
        x, y = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32), jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
        x2, y2 = jnp.copy(x), jnp.copy(y)
        k, k2 = jax.random.key(n), jax.random.key(n)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            out = jf(x, y, s, k)
        with warnings.catch_warnings(record=True) as want:
            warnings.simplefilter("always")
            expected = ref(x2, y2, s, k2)
        for a, b in zip(out[:2], expected[:2]):
            assert_close(a, b)
        np.testing.assert_array_equal(jax.random.key_data(out[2]), jax.random.key_data(expected[2]))
        deleted = (x.is_deleted(), y.is_deleted(), k.is_deleted())
        assert deleted == (x2.is_deleted(), y2.is_deleted(), k2.is_deleted()) == (False, True, True), n
        assert [str(w.message) for w in got] == [str(w.message) for w in want], n
        np.asarray(x)  # still readable
    if jax.default_backend() == "cpu":  # a GPU also compiles recurring sizes' static programs (tier-up)
        assert pallaskit.metrics.counters["graphs_compiled"] == 2


def _donation_cases():
    """Fresh functions (jax.jit warns once per compile, and caches compiles by function)."""
    def cast_out(x, y):  # no output of x's or y's dtype: XLA reuses x for the int32 output (its bytes) only
        return (x + y).astype(jnp.bfloat16), x.astype(jnp.int32)

    def reads_x_only(x, y):  # y unread: jax.jit prunes it, neither donated nor named in the warning
        return jnp.tanh(x) * 2.0

    def flat_out(x, y):  # x's element count: XLA takes x; y is named in the warning
        return (x + y).reshape(-1)

    return {f.__name__: f for f in (cast_out, reads_x_only, flat_out)}


@pytest.mark.parametrize("name", ["cast_out", "reads_x_only", "flat_out"])
@pytest.mark.parametrize("keep_unused", [False, True])
def test_dynamic_donation_matches_jax_jit_per_output(name, keep_unused, rng):
    """The dispatcher's donation as jax.jit's with XLA's: aliases by shape and
    dtype, donors by element count taken where an output has their bytes,
    unread arguments pruned (unless keep_unused), one warning per size."""
    fn = _donation_cases()[name]
    jf = pallaskit.jit(fn, donate_argnums=(0, 1), keep_unused=keep_unused)
    ref = jax.jit(fn, donate_argnums=(0, 1), keep_unused=keep_unused)
    for n in (4, 6, 8, 6):
        x, y = (jnp.asarray(rng.standard_normal((n, 3)), jnp.float32) for _ in range(2))
        x2, y2 = jnp.copy(x), jnp.copy(y)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            out = jf(x, y)
        with warnings.catch_warnings(record=True) as want:
            warnings.simplefilter("always")
            expected = ref(x2, y2)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
            assert_close(a, b, b.dtype)
        assert (x.is_deleted(), y.is_deleted()) == (x2.is_deleted(), y2.is_deleted()), n
        assert [str(w.message) for w in got] == [str(w.message) for w in want], n


def test_unusable_donation_warns_as_jax_does(rng):
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    with pytest.warns(UserWarning, match="Some donated buffers were not usable"):
        out = pallaskit.jit(lambda a: jnp.sum(a * a), donate_argnums=0)(x)
    assert_close(out, jnp.sum(x * x))
    assert not x.is_deleted()  # as jax.jit: an unusable donation keeps the array


def test_negative_donate_argnums_donate_nothing_as_in_jax(rng):
    """jax.jit checks a negative donate argnum's range and then donates nothing
    for it (its ``donation_vector`` matches a call's positions, never negative);
    pallaskit counted it from the end and deleted the argument. A negative
    static argnum beyond a call's arguments raises jax.jit's error (it wrapped
    around to another argument)."""
    def varargs(x, *rest):
        return x + sum(rest)

    for fn, kw, n in [(_two, dict(donate_argnums=-1), 2), (_two, dict(donate_argnums=(-1, 0)), 2),
                      (varargs, dict(donate_argnums=-1), 3)]:
        seen = []
        for jit in (jax.jit, pallaskit.jit):
            args = [jnp.asarray(rng.standard_normal((4, 3)), jnp.float32) for _ in range(n)]
            expected = fn(*args)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # jax.jit's unusable-donation warning, where both donate
                assert_close(jit(fn, **kw)(*args), expected)
            seen.append([a.is_deleted() for a in args])
        assert seen[0] == seen[1], (kw, seen)
    x, y = jnp.ones(3), jnp.ones(3)
    expected = _outcome(lambda: jax.jit(_two, static_argnums=-3)(x, y=y))
    assert expected is not None and expected[0] is ValueError
    assert _outcome(lambda: pallaskit.jit(_two, static_argnums=-3)(x, y=y)) == expected


def test_no_donation_keeps_inputs(rng):
    params, grads = _params(rng), _params(rng)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pallaskit.jit(_sgd, static_argnums=2)(params, grads, 0.1)
    assert not params["w"].is_deleted()


def test_shardings_and_keep_unused_are_forwarded(rng):
    """The shardings reach the executable (one device here: what sharded inputs
    do across devices is tested where they are built)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",))
    rows, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())

    def f(a, b, unused):
        return a * 2.0 + b, a.sum()

    a, b, c = (jnp.asarray(rng.standard_normal((4, 3)), jnp.float32) for _ in range(3))
    ref = jax.jit(f)(a, b, c)
    jf = pallaskit.jit(f, in_shardings=(rows, None, None), out_shardings=(rows, whole), keep_unused=True)
    out = jf(a, b, c)
    assert_close(out[0], ref[0]) and assert_close(out[1], ref[1])
    assert out[0].sharding == rows and out[1].sharding == whole
    compiled = jf.lower(a, b, c).compile()
    assert compiled.input_shardings[0][0] == rows
    assert compiled.output_shardings[0] == rows
    with pytest.raises(ValueError, match="in_shardings"):
        pallaskit.jit(f, in_shardings=(rows,))(a, b, c)


# --------------------------------------------------------------------------- #
# ahead of time: trace / lower / compile, eval_shape
# --------------------------------------------------------------------------- #
def _model(x, n, *, w):
    h = jnp.tanh(x * w)
    return {"y": h[:n].sum(-1), "z": (x.max(), h.mean())}


def test_trace_lower_compile_match_jax(rng):
    x = jnp.asarray(rng.standard_normal((7, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5,)), jnp.float32)
    jf = pallaskit.jit(_model, static_argnums=1)
    jj = jax.jit(_model, static_argnums=1)
    traced, jtraced = jf.trace(x, 3, w=w), jj.trace(x, 3, w=w)
    assert str(traced.jaxpr) == str(jtraced.jaxpr)
    assert traced.out_info == jtraced.out_info
    assert traced.in_tree == jtraced.in_tree and traced.fun_name == "_model"
    assert traced.out_avals == jtraced.out_avals
    for a, b in zip(jax.tree_util.tree_leaves(traced(x, w=w)), jax.tree_util.tree_leaves(jtraced(x, w=w))):
        assert_close(a, b)  # a Traced is callable, as jax's: its jaxpr on the dynamic arguments
    lowered = jf.lower(x, 3, w=w)
    assert lowered.in_tree == jj.lower(x, 3, w=w).in_tree
    assert lowered.out_info == jtraced.out_info
    assert "func.func public @main" in lowered.as_text()
    assert "def call(" in lowered.program_source
    if jj.lower(x, 3, w=w).cost_analysis() is not None:  # jax gives None for a lowering on some GPUs
        assert lowered.cost_analysis()["flops"] > 0
    compiled = lowered.compile()
    assert compiled.out_tree == jj.lower(x, 3, w=w).compile().out_tree
    ref = jj(x, 3, w=w)
    out = compiled(x, w=w)  # as jax's Compiled: the dynamic arguments only
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert_close(a, b)
    x2 = jnp.asarray(rng.standard_normal((7, 5)), jnp.float32)
    assert_close(compiled(x2, w=w)["y"], jj(x2, 3, w=w)["y"])
    assert compiled.as_text() and isinstance(compiled.cost_analysis(), (dict, list))
    with pytest.raises(TypeError, match="pytree"):
        compiled(x, 3, w=w)
    with pytest.raises(TypeError, match="types differ"):
        compiled(x[:6], w=w)
    shapes = jax.ShapeDtypeStruct((7, 5), jnp.float32)
    assert jf.eval_shape(shapes, 3, w=w) == jj.eval_shape(shapes, 3, w=w)
    assert jf.trace(shapes, 3, w=w).out_info == jtraced.out_info  # shapes alone trace too
    # jax.export lowers for named platforms (Traced.lower(lowering_platforms=...)): jax.jit's lowering
    # of the function (it was a TypeError on the keyword)
    platform = {"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend())  # where ``call`` runs it
    exported = jax.export.export(jf, platforms=(platform,))(shapes, 3, w=w)
    assert_close(exported.call(x, w=w)["y"], ref["y"])


def test_jax_eval_shape_of_a_pallaskit_function():
    """jax.eval_shape special-cases its own jit functions (an exact type check)
    and traces any other callable under a jax.jit of its own, every argument an
    array: a pallaskit function without static arguments gives jax.jit's
    shapes; with static ones, the error a jax.jit function nested in another
    raises, and a pointer to ``f.eval_shape`` (jax.jit's, static arguments
    included), which gives the shapes ([Note: eval_shape of static arguments])."""
    shapes = jax.ShapeDtypeStruct((7, 5), jnp.float32)
    w = jax.ShapeDtypeStruct((5,), jnp.float32)
    g = functools.partial(_model, n=3)
    assert jax.eval_shape(pallaskit.jit(g), shapes, w=w) == jax.eval_shape(jax.jit(g), shapes, w=w)
    jf, jj = pallaskit.jit(_model, static_argnums=1), jax.jit(_model, static_argnums=1)
    assert jax.eval_shape(jj, shapes, 3, w=w) == jf.eval_shape(shapes, 3, w=w)
    nested = _outcome(lambda: jax.jit(jj).trace(shapes, 3, w=w))
    with pytest.raises(nested[0], match=r"(?s)Non-hashable static arguments.*use f\.eval_shape"):
        jax.eval_shape(jf, shapes, 3, w=w)


def test_compiled_shardings_and_formats_follow_the_users_pytrees(rng):
    """As jax.jit's Compiled: input shardings / formats by ((args), {kwargs}) of the dynamic arguments, output
    ones by the output's structure (a lone array's a lone sharding), hoisted constants not among them."""
    x = jnp.asarray(rng.standard_normal((7, 5)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((5,)), jnp.float32)

    def lone(x, unused):
        return x + jnp.arange(5.0)  # a constant the program may hoist into an argument

    for fn, args, kwargs, static in ((_model, (x, 3), {"w": w}, 1), (lone, (x, w), {}, None)):
        compiled = pallaskit.jit(fn, static_argnums=static).lower(*args, **kwargs).compile()
        ref = jax.jit(fn, static_argnums=static).lower(*args, **kwargs).compile()
        for name in ("input_shardings", "output_shardings", "input_formats", "output_formats"):
            got, want = getattr(compiled, name), getattr(ref, name)
            is_none = lambda v: v is None  # noqa: E731  (an argument XLA dropped)
            assert jax.tree_util.tree_structure(got, is_leaf=is_none) == \
                jax.tree_util.tree_structure(want, is_leaf=is_none), name
            if name.endswith("shardings"):
                assert jax.tree_util.tree_leaves(got, is_leaf=is_none) == \
                    jax.tree_util.tree_leaves(want, is_leaf=is_none), name


def test_compiled_stage_donates(rng):
    params, grads = _params(rng), _params(rng)
    ref = jax.jit(_sgd, static_argnums=2)(params, grads, 0.5)
    compiled = pallaskit.jit(_sgd, static_argnums=2, donate_argnums=0).lower(params, grads, 0.5).compile()
    assert compiled.args_info[0][0]["w"].donated and not compiled.args_info[0][1]["w"].donated
    out = compiled(params, grads)
    assert_close(out["w"], ref["w"])
    assert params["w"].is_deleted()


# --------------------------------------------------------------------------- #
# errors name the user's function and arguments
# --------------------------------------------------------------------------- #
def _branchy(params, x):
    if (params["w"] * x).sum() > 0:
        return x
    return -x


def _mismatch(a, b):
    return a @ b


@pytest.mark.parametrize("fn, args", [
    (_branchy, ({"w": jnp.ones(3)}, jnp.ones(3))),
    (_mismatch, (jnp.ones((2, 3)), jnp.ones((4, 5)))),
], ids=["concretization", "shape"])
def test_errors_raised_while_tracing_read_as_jax_jits(fn, args):
    expected = _outcome(lambda: jax.jit(fn)(*args))
    got = _outcome(lambda: pallaskit.jit(fn)(*args))
    assert expected is not None and got == expected
    assert "flat_fn" not in got[1] and "leaves[" not in got[1]
    if fn is _branchy:
        assert "function _branchy" in got[1] and "params['w']" in got[1]


def _add(x, batch):
    return x + batch["ys"]


@pytest.mark.parametrize("bad", ["abc", object()], ids=["str", "object"])
def test_a_non_array_argument_names_the_function_as_jax_jit_does(bad):
    """A leaf that is no array: jax.jit's TypeError names the function and the
    argument's path; pallaskit's named the argument only."""
    args = (jnp.ones(3), {"ys": bad})
    expected = _outcome(lambda: jax.jit(_add)(*args))
    got = _outcome(lambda: pallaskit.jit(_add)(*args))
    assert expected[0] is got[0] is TypeError
    for text in ("Error interpreting argument to <function _add", "as an abstract array", str(type(bad))):
        assert text in expected[1] and text in got[1], (text, got[1])
    assert "argument 'batch'['ys']" in got[1]


# --------------------------------------------------------------------------- #
# jax.jit's other keywords; closures over tracers; jax.linearize
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kwargs", [
    dict(inline=True), dict(inline=False), dict(backend="cpu"), dict(compiler_options={}),
    dict(compiler_options={"xla_cpu_enable_fast_math": False}), dict(device="first"), dict(device=None, backend=None),
    dict(backend="nonesuch"), dict(device="first", backend="cpu"),
], ids=str)
def test_jax_jit_keywords_are_accepted_as_jax_accepts_them(kwargs, rng):
    """``inline``, ``device``, ``backend`` and ``compiler_options`` as jax.jit
    takes them (with a device, a backend or XLA options, jax.jit runs the
    function); what jax.jit rejects, pallaskit.jit rejects the same way."""
    kwargs = {k: jax.devices()[0] if v == "first" else v for k, v in kwargs.items()}
    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)

    def f(a, b=2.0):
        return jnp.sin(a) * b

    expected = _outcome(lambda: jax.jit(f, **kwargs)(x))
    got = _outcome(lambda: pallaskit.jit(f, **kwargs)(x))
    assert got == expected
    if expected is None:
        assert_close(pallaskit.jit(**kwargs)(f)(x, 3.0), jax.jit(f, **kwargs)(x, 3.0))
        assert pallaskit.jit(f, **kwargs).lower(x).compile()(x).shape == (5, 3)


@pytest.mark.parametrize("where", ["jit", "grad", "vmap", "jit_grad"])
def test_function_closing_over_an_enclosing_tracer(where, rng):
    """A pallaskit function created inside a transformation that closes over
    one of its values (not an argument) is traced into the enclosing
    computation as jax.jit's is; before, the lifted value went missing
    (``call() missing 1 required positional argument``)."""
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)

    def outer(jit):
        def h(a):
            return jit(lambda b: jnp.tanh(a * b) + a)(y).sum()
        return {"jit": jax.jit(h), "grad": jax.grad(h), "vmap": jax.vmap(h),
                "jit_grad": jax.jit(jax.grad(h))}[where]

    for _ in range(2):  # a second call traces again with new values
        assert_close(outer(pallaskit.jit)(x), outer(jax.jit)(x))
        x = x + 1.0


def test_linearize(rng):
    """``jax.linearize`` of a pallaskit function evaluates (does not
    transpose) its tangent program: the forward-mode path serves it."""
    def f(a, b):
        return jnp.sin(a) * b + a.sum(0)

    a = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((3,)), jnp.float32)
    ta, tb = jnp.ones_like(a), jnp.full_like(b, 0.5)
    out, lin = jax.linearize(pallaskit.jit(f), a, b)
    ref_out, ref_lin = jax.linearize(jax.jit(f), a, b)
    assert_close(out, ref_out)
    assert_close(lin(ta, tb), ref_lin(ta, tb))
    assert_close(jax.jit(lin)(ta, tb), ref_lin(ta, tb))
    # reverse mode still takes the partitioned backward
    assert_close(jax.grad(lambda v: pallaskit.jit(f)(v, b).sum())(a), jax.grad(lambda v: f(v, b).sum())(a))


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_weakly_typed_outputs_stay_weak(kernel_backend, rng):
    """An output jax.jit returns weakly typed (from Python scalars) comes back
    weak, so it promotes as jax.jit's does: a learning rate computed from a
    Python float times bfloat16 gradients stays bfloat16. Before, the program
    returned it strongly typed float32, and the product was float32."""
    pallaskit.config.update(kernel_backend=kernel_backend)

    def schedule(step, base):
        return base * jnp.minimum(1.0, (step + 1) / 10.0), step * 2, jnp.tanh(base)

    g = jnp.asarray(rng.standard_normal((4, 3)), jnp.bfloat16)
    for args in [(3, 0.5), (jnp.int32(3), 0.5), (3, jnp.float32(0.5))]:
        ref, got = jax.jit(schedule)(*args), pallaskit.jit(schedule)(*args)
        for a, b in zip(got, ref):
            assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
            assert_close(a, b)
        assert (got[0] * g).dtype == (ref[0] * g).dtype
    # the steady state (the C++ fast path) and a grad with respect to a Python float
    f = pallaskit.jit(lambda x, s: jnp.sin(x) * s)
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    assert f(x, 2.0).weak_type is False and pallaskit.jit(lambda s: s * 2)(2.0).weak_type
    gs = jax.grad(lambda s: f(x, s).sum())(2.0)
    assert (gs.dtype, gs.weak_type) == (jnp.float32, True)


def test_compiled_stage_reads_as_jaxs(rng):
    """A ``Compiled``'s shardings and out_info have jax's structure (per
    argument and per output, not the program's flat lists), and a call with
    the wrong pytree or types raises jax's TypeError, word for word."""
    def f(x, y):
        return {"a": jnp.tanh(x) @ y, "b": x.sum()}

    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
    ours, theirs = pallaskit.jit(f).lower(x, y).compile(), jax.jit(f).lower(x, y).compile()
    assert ours.input_shardings == theirs.input_shardings
    assert ours.output_shardings == theirs.output_shardings
    assert ours.out_info == theirs.out_info
    one = pallaskit.jit(jnp.sin).lower(x).compile()
    assert one.output_shardings == jax.jit(jnp.sin).lower(x).compile().output_shardings
    for call in [lambda c: c(x[:3], y), lambda c: c(x.astype(jnp.bfloat16), y), lambda c: c(x),
                 lambda c: c(x, y, x), lambda c: c(x, y=y)]:
        expected = _outcome(lambda: call(theirs))
        assert expected is not None and expected[0] is TypeError
        assert _outcome(lambda: call(ours)) == expected


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_calling_with_a_donated_array_raises_as_jax_does(kernel_backend, rng):
    """A donated (deleted) array passed again: jax.jit's error with either
    renderer (before, Triton's eager launches raised NumPy's RuntimeError on the CPU)."""
    pallaskit.config.update(kernel_backend=kernel_backend)

    def run(jit):
        x = jnp.asarray(rng.standard_normal((5,)), jnp.float32)
        f = jit(lambda a: jnp.tanh(a) * 2, donate_argnums=0)
        f(x)
        return _outcome(lambda: f(x))

    expected = run(jax.jit)  # CPU: XLA's ValueError; GPU: jax's RuntimeError ("Array has been deleted")
    assert expected is not None and "deleted" in expected[1]
    got = run(pallaskit.jit)
    assert got is not None and got[0] is expected[0] and "deleted" in got[1]


def test_methods_copies_and_clear_cache_as_jax_jit(rng):
    """A pallaskit function in a class body binds ``self`` as jax.jit's does
    (``static_argnums=0`` makes the instance static; before, the call lost
    ``self`` and the array was taken as the static argument); ``copy`` and
    ``deepcopy`` make a new function (before: a pickling error);
    ``clear_cache`` forgets the compiled signatures and traces again (a global
    the function reads changed: before, jax's trace cache in pallaskit kept the
    old value's program)."""
    import copy
    import functools

    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)

    def make(jit):
        class Model:
            def __init__(self, scale):
                self.scale = scale

            def __hash__(self):
                return hash(self.scale)

            def __eq__(self, other):
                return isinstance(other, Model) and other.scale == self.scale

            @functools.partial(jit, static_argnums=0)
            def apply(self, v):
                return jnp.tanh(v) * self.scale

            @functools.partial(jit, static_argnames="self")
            def apply_named(self, v):
                return v + self.scale

        return Model

    ours, theirs = make(pallaskit.jit), make(jax.jit)
    for scale in (2.0, 3.0):
        assert_close(ours(scale).apply(x), theirs(scale).apply(x))
        assert_close(ours(scale).apply_named(x), theirs(scale).apply_named(x))
    assert_close(ours.apply(ours(5.0), x), theirs.apply(theirs(5.0), x))  # unbound, as a function
    factor = [2.0]
    f = pallaskit.jit(lambda v: v * factor[0])
    f(x)
    assert f._cache_size() == 1
    factor[0] = 3.0
    f.clear_cache()
    assert f._cache_size() == 0
    assert_close(f(x), x * 3.0)
    factor[0] = 2.0
    f.clear_cache()
    for g in (copy.copy(f), copy.deepcopy(f)):
        assert g is not f and isinstance(g, type(f))
        assert_close(g(x), x * 2.0)


@pytest.mark.parametrize("kernel_backend", ["pallas", "triton"])
def test_loop_counters_and_python_scalars_come_back_weak(kernel_backend, rng):
    """As jax.jit: a loop counter started at a Python 0, a returned Python scalar or a weak argument's sum come
    back weakly typed (the dtype of what the caller computes from them next: ``counter + int8`` stays int8)."""
    def f(x, s):
        y, n = jax.lax.fori_loop(0, 3, lambda i, c: (c[0] * 1.5, c[1] + 1), (x, 0))
        z, m = jax.lax.while_loop(lambda c: c[1] < 2.5, lambda c: (jnp.tanh(c[0]), c[1] + 1.0), (y, 0.0))
        return y, n, z, m, s + 1, 2.0, x.sum() * s

    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    with pallaskit.config.override(kernel_backend=kernel_backend, cache=False):
        out = pallaskit.jit(f)(x, 2.0)
    ref = jax.jit(f)(x, 2.0)
    for a, b in zip(out, ref):
        assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
        assert_close(a, b)
    assert (out[1] + jnp.int8(1)).dtype == jnp.int8


def test_weak_outputs_of_eagerly_launched_sizes(rng):
    """Sizes that a symbolic program launches eagerly (raw Triton, here in its
    interpreter) return weak outputs weak, as the compiled sizes do."""
    pytest.importorskip("triton")
    pallaskit.config.update(dynamic_launch="on")

    def schedule(x, base):
        return x * base, base * 2.0, jnp.tanh(x).sum()

    ours = pallaskit.jit(schedule)
    for n in (6, 9, 17):  # the second size makes the rows dynamic; the third launches eagerly too
        x = jnp.asarray(rng.integers(-5, 5, (n, 4)), jnp.int32)
        for a, b in zip(ours(x, 0.5), jax.jit(schedule)(x, 0.5)):
            assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
            assert_close(a, b)
    assert pallaskit.metrics.counters["eager_launches"] >= 2
