"""The call fast path: jax.jit's C++ dispatch in front of pallaskit's Python call
([Note: the call fast path] in pallaskit/runtime/fastpath.py). A signature C++
serves must be exactly the one pallaskit compiled for: dtype, shape, weak type,
pytree, donation; what C++ cannot serve comes back to Python."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from pallaskit.runtime import fastpath

needs_cpp = pytest.mark.skipif(not fastpath.available(), reason="this jax has no C++ call object to reuse")


def _count_python_calls(f):
    """Wrap the Python call of a JitFunction; returns the list it appends to."""
    seen, inner = [], f._call

    def counted(args, kwargs):
        seen.append(1)
        return inner(args, kwargs)

    f._call = counted
    return seen


def _close(got, want, dtype=np.float32):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        tol = 2e-2 if g.dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol, atol=tol)


def _step(x, y, *, scale):
    return {"a": x * scale + y, "b": (jnp.sin(x), jnp.maximum(x, y))}


@needs_cpp
def test_steady_calls_do_not_enter_python(rng):
    f = pallaskit.jit(_step)
    seen = _count_python_calls(f)
    x = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    for _ in range(5):
        _close(f(x, y, scale=2.0), jax.jit(_step)(x, y, scale=2.0))
    assert len(seen) == 1  # the first call compiled; C++ ran the other four


@needs_cpp
def test_unused_arguments_in_steady_calls(rng):
    """Arguments the program never reads (an embedding gradient's table: only its
    shape) are pruned by XLA: C++ must still be told about every argument (it
    passed too few, and the second call raised INVALID_ARGUMENT)."""
    def f(table, ids, dy):
        return jax.vjp(lambda t: t[ids], table)[1](dy)[0], dy * 2

    g = pallaskit.jit(f)
    seen = _count_python_calls(g)
    table = jnp.asarray(rng.standard_normal((11, 3)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 11, (5,)), jnp.int32)
    dy = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    for _ in range(3):
        _close(g(table, ids, dy), jax.jit(f)(table, ids, dy))
        _close(g(ids=ids, dy=dy, table=table), jax.jit(f)(table, ids, dy))
    assert len(seen) == 2  # one compile per call form; C++ ran the others


@needs_cpp
def test_the_python_call_alone_gives_the_same_results(rng):
    f, g = pallaskit.jit(_step), pallaskit.jit(_step)
    g._cpp = None
    x = jnp.asarray(rng.standard_normal((1, 5)), jnp.float32)
    y = jnp.asarray([[np.nan, np.inf, -np.inf, -0.0, 0.0]], jnp.float32)
    for _ in range(3):
        _close(f(x, y, scale=0.5), g(x, y, scale=0.5))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32])
def test_signatures_alternate_without_mixing_executables(rng, dtype):
    """Shapes, dtypes, weak-typed Python scalars vs strong scalars, numpy
    arrays, pytrees and keyword arguments, each called repeatedly in turn."""
    f = pallaskit.jit(_step)
    ref = jax.jit(_step)
    a = jnp.asarray(rng.standard_normal((4, 3)) * 4, dtype)
    b = jnp.asarray(rng.standard_normal((1, 3)) * 4, dtype)
    cases = [(a, a, 2), (a, b, 2), (a[:1], b, 2), (a, 3.0, 2), (a, jnp.float32(3.0), 2),
             (np.asarray(a), a, 2), (a, a, jnp.asarray(2, dtype)), (a.astype(jnp.float32), a, 2)]
    for _ in range(3):
        for x, y, s in cases:
            _close(f(x, y, scale=s), ref(x, y, scale=s))


def test_weak_scalar_after_a_strong_one_keeps_its_dtype(rng):
    """bfloat16 * a Python float stays bfloat16; * a float32 array does not.
    XLA's own argument check ignores weak types, so the C++ signature must not."""
    f = pallaskit.jit(lambda x, s: x * s)
    x = jnp.asarray(rng.standard_normal(6), jnp.bfloat16)
    for _ in range(2):
        assert f(x, jnp.float32(1.5)).dtype == jnp.float32
        assert f(x, 1.5).dtype == jnp.bfloat16
        assert f(x, jnp.float32(1.5)).dtype == jnp.float32


def test_donated_arguments_are_consumed_on_every_call(rng):
    f = pallaskit.jit(lambda p, g: (p - 0.1 * g, g * 2), donate_argnums=0)
    g = jnp.asarray(rng.standard_normal(9), jnp.float32)
    p0 = np.asarray(rng.standard_normal(9), np.float32)
    p = jnp.asarray(p0)
    for i in range(4):
        old = p
        p, g2 = f(p, g)
        np.testing.assert_allclose(np.asarray(p), p0 - 0.1 * (i + 1) * np.asarray(g), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(g2), 2 * np.asarray(g))
        assert old.is_deleted()
    # A deleted array is refused, as jax.jit refuses it (jax 0.10's check raises
    # ValueError "deleted or donated"; jax 0.11's executable RuntimeError "has been deleted").
    with pytest.raises((ValueError, RuntimeError), match="deleted"):
        f(old, g)


@needs_cpp
@pytest.mark.parametrize("donate", [(), (0,)])
def test_unused_arguments_on_steady_calls(rng, donate):
    """Arguments the program never reads (an optimizer state's placeholder that the update replaces, as
    optax's adafactor does with its unfactored rows) are dropped by XLA: C++ must skip exactly those, and
    the second call, the first C++ runs, raised "Execution supplied 1 arguments but compiled program
    expected 2"."""
    def step(state, x):
        a, _placeholder, c = state
        return (a + x.sum(), jnp.zeros((1,), a.dtype), c * 2.0), a.sum()

    f = pallaskit.jit(step, donate_argnums=donate)
    seen = _count_python_calls(f)
    x = jnp.asarray(rng.standard_normal(5), jnp.float32)
    state = tuple(jnp.asarray(rng.standard_normal(n), jnp.float32) for n in (17, 1, 3))
    want = jax.tree_util.tree_map(np.asarray, state)
    for _ in range(4):
        want = jax.jit(step)(want, x)[0]
        state, total = f(state, x)
        _close(state, jax.tree_util.tree_map(jnp.asarray, want))
    assert len(seen) == 1
    unused_first = pallaskit.jit(lambda u, a, b: (a * 2.0, b - 1.0))
    for _ in range(3):
        _close(unused_first(x, x, state[0]), (x * 2.0, state[0] - 1.0))


def test_transformations_after_steady_calls(rng):
    f = pallaskit.jit(lambda x: jnp.sum(jnp.tanh(x) ** 2))
    x = jnp.asarray(rng.standard_normal(11), jnp.float32)
    for _ in range(3):
        f(x)
    want = jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))(x)
    _close(jax.grad(f)(x), want)
    _close(jax.jit(jax.grad(f))(x), want)
    _close(jax.vmap(f)(x[:, None]), jax.vmap(lambda v: jnp.sum(jnp.tanh(v) ** 2))(x[:, None]))
    _close(f(x), jnp.sum(jnp.tanh(x) ** 2))


def test_hoisted_constants_and_namedtuple_outputs(rng):
    Out = collections.namedtuple("Out", "y z")
    table = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)

    def fn(x):
        return Out(x @ table + 1.0, jnp.argmax(x, axis=-1))

    f = pallaskit.jit(fn)
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    for _ in range(3):
        got = f(x)
        assert isinstance(got, Out)
        _close(got, jax.jit(fn)(x))


def test_a_static_argument_function_keeps_the_python_call(rng):
    f = pallaskit.jit(_step, static_argnames="scale")
    assert f._cpp is None
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    for s in (1, True, 1.0, 2):
        _close(f(x, x, scale=s), jax.jit(_step, static_argnames="scale")(x, x, scale=s))


@needs_cpp
def test_a_graph_cache_hit_is_served_by_cpp_too(rng, tmp_path):
    """A deserialized executable (a second function, the same graph) takes the C++ path."""
    pallaskit.config.update(cache_dir=str(tmp_path))
    x = jnp.asarray(rng.standard_normal((2, 9)), jnp.float32)
    fn = lambda x: jnp.tanh(x) * 2.0 + 1.0  # noqa: E731
    pallaskit.jit(fn)(x)
    g = pallaskit.jit(fn)
    seen = _count_python_calls(g)
    for _ in range(3):
        _close(g(x), jnp.tanh(x) * 2.0 + 1.0)
    assert pallaskit.metrics.counters["cache_hits"] == 1 and len(seen) == 1


@needs_cpp
def test_data_cpp_refuses_turns_the_fast_path_off_without_running_twice(rng, monkeypatch, caplog):
    """Where C++ cannot take the fast-path data (another jax's layout), the call
    returns what the Python call computed, once (a donated argument is consumed
    once), and later calls take the Python path."""
    monkeypatch.setattr(fastpath, "_DISABLED", [])
    monkeypatch.setattr(fastpath, "fastpath_data", lambda *a: ("not", "fast-path data"))
    f = pallaskit.jit(lambda p, g: p - 0.5 * g, donate_argnums=0)
    g = jnp.asarray(rng.standard_normal(5), jnp.float32)
    p0 = np.asarray(rng.standard_normal(5), np.float32)
    p = jnp.asarray(p0)
    with caplog.at_level("WARNING", logger="pallaskit"):
        out = f(p, g)
    np.testing.assert_allclose(np.asarray(out), p0 - 0.5 * np.asarray(g), rtol=1e-6)
    assert f._cpp is None and not fastpath.available() and "refused" in caplog.text
    out2 = f(out, g)
    np.testing.assert_allclose(np.asarray(out2), p0 - np.asarray(g), rtol=1e-5, atol=1e-6)
    assert pallaskit.jit(lambda x: x + 1)._cpp is None  # new functions too, in this process


def test_an_error_after_a_nested_pallaskit_call_is_raised(rng):
    """A pallaskit function called while another one traces: an error the outer
    function raises afterwards reaches the caller (the inner call's result is
    never taken for the outer's)."""
    inner = pallaskit.jit(lambda x: x * 2.0)
    x = jnp.asarray(rng.standard_normal(3), jnp.float32)

    @pallaskit.jit
    def outer(x):
        inner(x)
        raise ValueError("boom from outer")

    for _ in range(2):
        with pytest.raises(ValueError, match="boom from outer"):
            outer(x)
    _close(inner(x), x * 2.0)


@needs_cpp
def test_a_signature_served_in_python_first_takes_cpp_after_a_refresh(rng, monkeypatch):
    """jax's C++ dispatch keeps its first answer per signature. A size whose
    first calls ran where C++ cannot (eager launches) stays on the Python call
    once its static program lands (the tier-up, pallaskit/dynamic.py) until the
    C++ object starts over, which the tier-up does; the results stay right."""
    f = pallaskit.jit(lambda x: jnp.tanh(x) * 2.0)
    seen = _count_python_calls(f)
    x = jnp.asarray(rng.standard_normal((4, 9)), jnp.float32)
    real = fastpath.fastpath_data
    monkeypatch.setattr(fastpath, "fastpath_data", lambda *a: None)  # as an eager launch's call
    f(x)
    monkeypatch.setattr(fastpath, "fastpath_data", real)  # a static program from now on
    for _ in range(3):
        _close(f(x), jnp.tanh(x) * 2.0)
    assert len(seen) == 4  # C++ kept "Python" for the signature
    f._refresh_fast_path()
    for _ in range(3):
        _close(f(x), jnp.tanh(x) * 2.0)
    assert len(seen) == 5  # one miss, then C++


def test_a_tier_up_refreshes_the_fast_path(monkeypatch):
    """``compile_static`` (a recurring size's static program) starts the C++
    object over once it has filed the entry; a dispatcher whose calls ran
    under another (thread-local) jax context gets no tier-up on this thread."""
    from pallaskit import dynamic, signature

    f = pallaskit.jit(lambda x: x * 3.0)
    calls = []
    monkeypatch.setattr(type(f), "_refresh_fast_path", lambda self: calls.append(self))
    x = jnp.arange(6.0, dtype=jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten(((x,), {}))
    assert dynamic.compile_static(f, treedef, (), (), 1, ("another context",), leaves) is None
    executable, constants = dynamic.compile_static(f, treedef, (), (), 1, signature.context(), leaves)
    np.testing.assert_allclose(np.asarray(executable(x, *constants)[0]), np.asarray(x) * 3.0)
    assert calls == [f]


def _outcome(call):
    """What a call did, to compare pallaskit with jax.jit: its error (type,
    first line) or its output's dtype, values and device."""
    try:
        out = call()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e).splitlines()[0]
    return str(out.dtype), np.asarray(out).tolist(), str(out.sharding)


@pytest.mark.parametrize("static", [False, True], ids=["cpp", "python"])
def test_jax_contexts_are_part_of_the_signature(rng, static):
    """jax.jit traces again (or runs op by op) when jax's thread-local context
    changes: a signature first called outside ``with jax.numpy_rank_promotion(
    "raise")`` raises inside it. pallaskit's signature keys ignored the context,
    so every call below reused the program traced outside it (C++ after steady
    calls; the Python call for static arguments). Under debug_nans it raised
    jax's internal error instead of jax.jit's FloatingPointError naming the
    primitive; under default_device it ran on device 0."""
    seen = []

    def fn(x, y, k=1):
        seen.append(isinstance(x, jax.core.Tracer))  # False: run op by op (disable_jit)
        return jnp.log(x) * k + y + np.float64(0.5)  # float64 under x64

    x = jnp.asarray(np.abs(rng.standard_normal((2, 3))) + 0.5, jnp.float32)
    y = jnp.asarray(rng.integers(-3, 3, (3,)), jnp.int32)
    contexts = {"rank": lambda: jax.numpy_rank_promotion("raise"),
                "strict": lambda: jax.numpy_dtype_promotion("strict"),
                "x64": lambda: jax.enable_x64(True),
                "device": lambda: jax.default_device(jax.devices()[-1]),
                "disable_jit": jax.disable_jit,
                "debug_nans": lambda: jax.debug_nans(True)}
    results = {}
    for jit in (jax.jit, pallaskit.jit):
        f = jit(fn, static_argnames="k") if static else jit(fn)
        got = results[jit] = []
        for name, context in contexts.items():
            arg = x.at[0, 0].set(-1.0) if name == "debug_nans" else x  # log(-1): NaN
            got.append(_outcome(lambda: f(x, y)))
            got.append(_outcome(lambda: f(x, y)))
            with context():
                got.append((name, _outcome(lambda: f(arg, y)), seen[-1]))
            got.append(_outcome(lambda: f(x, y)))
    for want, have in zip(results[jax.jit], results[pallaskit.jit]):
        assert have == want


def test_an_uncommitted_array_is_not_keyed_by_its_device(rng):
    """An uncommitted array runs where jax.jit runs the call (the default
    device), wherever it lives; the Python call's key held its sharding as a
    committed one's, so after a call on arrays committed to device 1 the same
    arrays' uncommitted twins ran that placed program (on device 1, outputs
    committed)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices of the default platform (the CPU's are simulated; one GPU here)")
    d1 = jax.devices()[1]
    x = np.asarray(rng.standard_normal(5), np.float32)
    with jax.default_device(d1):
        uncommitted = jnp.asarray(x) + 0
    for jit in (jax.jit, pallaskit.jit):
        f = jit(lambda a, b: a * b)
        f(jax.device_put(x, d1), jax.device_put(x, d1))
        out = f(uncommitted, uncommitted)
        assert out.sharding.device_set == {jax.devices()[0]} and not out.committed, jit
        np.testing.assert_allclose(np.asarray(out), x * x, rtol=1e-6)


def test_an_option_jax_registers_later_leaves_the_context_key(monkeypatch, rng):
    """jax 0.11 registers its TPU options when its Pallas interpreter is first imported (while lowering
    the first pallas_call), which lengthens its trace context: a call after that must find the program
    compiled before it (the GPU machine's jax: a dynamic function compiled its graph twice)."""
    from jax._src import config as jax_config

    from pallaskit import signature

    f = pallaskit.jit(lambda x: jnp.tanh(x) * 2)
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    before = signature.context()
    np.asarray(f(x))
    real = jax_config.trace_context
    kept = signature._FirstContext()  # this process's record left as it was
    kept.length, kept.later = signature._FIRST_SEEN.length, list(signature._FIRST_SEEN.later)
    monkeypatch.setattr(signature, "_FIRST_SEEN", kept)
    monkeypatch.setattr(jax_config, "trace_context", lambda: (*real(), False, None))
    assert signature.context() == before
    assert f._call((x,), {})[1] is f._cache[next(iter(f._cache))]  # the program compiled before
    with jax.numpy_rank_promotion("raise"):  # a thread-local override still changes the key
        assert signature.context() != before
