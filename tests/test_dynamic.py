"""Dynamic dims (issue 4, parts 1 and 2): ``pallaskit.jit(dynamic=...)`` and
automatic dynamic compile one shape-generic program per symbolic signature;
each new size re-traces it under jax.jit only (no pallaskit compile, no new
kernel). Guards, fallbacks and errors. [Note: dynamic dims] in pallaskit/dynamic.py."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close, run_python_on_cpu
from pallaskit import metrics

BF16 = jnp.bfloat16
SIZES = (1, 7, 64, 129, 300)


@pytest.fixture(autouse=True)
def _symbolic_path(_fresh_state):
    """These tests count the symbolic program's compiles: no eager launches, whose
    tier-up (on a GPU by default) compiles recurring sizes statically
    (tests/test_triton_codegen.py covers them)."""
    pallaskit.config.update(dynamic_launch="off")


def counters():
    return dict(metrics.counters)


def delta(before, name):
    return metrics.counters[name] - before[name]


def _pointwise_broadcast(x, w, b):
    return jnp.tanh(x * w + b) * 2.0 - x


def _softmax(x, w):
    return jax.nn.softmax(x * w, axis=-1)


def _rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _shared(x, labels):
    return (x * labels[:, None] + 1.0, labels * 3.0)


CASES = {
    # name: (fn, dynamic spec, makers (rows, dtype, rng) -> args)
    "pointwise_broadcast": (_pointwise_broadcast, {"x": {0: "n"}},
                            lambda n, dt, rng: (rng.standard_normal((n, 96)), rng.standard_normal((96,)),
                                                rng.standard_normal((1, 96)))),
    "softmax": (_softmax, {"x": {0: "n"}},
                lambda n, dt, rng: (rng.standard_normal((n, 100)), rng.standard_normal((100,)))),
    "rmsnorm": (_rmsnorm, {0: {0: "rows"}},
                lambda n, dt, rng: (rng.standard_normal((n, 128)), rng.standard_normal((128,)))),
    "shared_symbol": (_shared, {"x": {0: "n"}, "labels": {0: "n"}},
                      lambda n, dt, rng: (rng.standard_normal((n, 33)), rng.standard_normal((n,)))),
}


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_compile_serves_every_size(case, dtype, rng):
    fn, spec, make = CASES[case]
    f = pallaskit.jit(fn, dynamic=spec)
    ref = jax.jit(fn)
    before = counters()
    kernels = None
    for n in SIZES:
        args = [jnp.asarray(a, dtype) for a in make(n, dtype, rng)]
        out, want = f(*args), ref(*args)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(want)):
            assert_close(a, b, dtype)
        if kernels is None:
            kernels = delta(before, "kernels_compiled")
        assert delta(before, "kernels_compiled") == kernels, f"size {n} compiled new kernels"
    assert delta(before, "graphs_compiled") == 1
    assert delta(before, "dynamic_fallbacks") == 0
    assert kernels >= 1
    # The one program is shape-generic: the size is read from the input, not baked in.
    program = f.lower_to_result(*args).result.program
    assert program.symbols == sorted(set(s for d in spec.values() for s in d.values()))
    assert f"{program.symbols[0]} = arg0.shape[0]" in program.source
    assert all(k.dims for k in program.kernels)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
def test_reductions_over_the_dynamic_axis_loop_a_runtime_count(dtype, rng):
    """Column sums, a full mean and a two-phase reduction over the dynamic axis:
    looped kernels whose chunk count is computed from the runtime size."""
    def fn(x):
        return x.sum(0), jnp.mean(x), (x - x.mean(0)).max(0), jnp.prod(x * 0.1 + 1.0, 0)

    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    before = counters()
    for n in (1, 7, 200):
        x = jnp.asarray(rng.standard_normal((n, 5)), dtype)
        for a, b in zip(f(x), jax.jit(fn)(x)):
            assert_close(a, b, dtype)
    assert delta(before, "graphs_compiled") == 1
    assert delta(before, "dynamic_fallbacks") == 0
    source = f.lower_to_result(x).result.program.source
    assert "(COLS + BLOCK_C - 1) // BLOCK_C" in source  # the chunk count, in either renderer's loop


def test_size_enters_kernels_as_a_runtime_value(rng):
    """``x.shape[0]`` used as a value (jax's dim_as_value) reads the runtime size."""
    f = pallaskit.jit(lambda x: x * x.shape[0] + x.shape[1], dynamic={"x": {0: "n"}})
    before = counters()
    for n in (3, 11, 40):
        x = jnp.asarray(rng.standard_normal((n, 5)), jnp.float32)
        assert_close(f(x), x * n + 5)
    assert delta(before, "graphs_compiled") == 1


def test_keyword_call_negative_axis_and_steady_state(rng):
    f = pallaskit.jit(lambda x, y: x + y, dynamic={"x": {-2: "n"}, "y": {0: "n"}})
    before = counters()
    for n in (2, 9, 2, 9, 33):
        x = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
        assert_close(f(x, y=y), x + y)
        assert_close(f(x, y), x + y)
    assert delta(before, "graphs_compiled") == 2  # one per calling convention (keyword / positional y), as jax.jit


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compile counts of interpret mode; on a GPU eager launches and tier-up compiles add graphs (values: the other dynamic tests)")
def test_automatic_dynamic_recompiles_once(rng, caplog):
    f = pallaskit.jit(lambda a, b: jnp.exp(a) * b + 1.0)
    before = counters()
    with caplog.at_level(logging.INFO, logger="pallaskit"):
        for n in (5, 9, 17, 33):
            a = jnp.asarray(rng.standard_normal((n, 6)), jnp.float32)
            b = jnp.asarray(rng.standard_normal((n, 6)), jnp.float32)
            assert_close(f(a, b), jnp.exp(a) * b + 1.0)
            assert delta(before, "graphs_compiled") == (1 if n == 5 else 2)
    lines = [r.getMessage() for r in caplog.records if "seen with a second size" in r.getMessage()]
    assert len(lines) == 1 and "axis 0" in lines[0], lines
    # The static dim stays static: a new size of it is a new (static) signature.
    a = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
    assert_close(f(a, a), jnp.exp(a) * a + 1.0)
    assert delta(before, "graphs_compiled") == 3
    # An inf out of the symbolic program under debug_infs: jax.jit's error naming the primitive (each
    # eager pallas_call's own check re-ran that pallas_call for its de-optimized error: RecursionError).
    a = jnp.full((40, 6), 100.0, jnp.float32)
    with jax.debug_infs(True), pytest.raises(FloatingPointError, match=r"invalid value \(inf\) encountered in exp"):
        f(a, a)


def test_automatic_dynamic_off_compiles_every_size(rng):
    """Option off: like jax.jit, one compile per size."""
    pallaskit.config.update(automatic_dynamic=False)
    f = pallaskit.jit(lambda a: a * 3.0)
    before = counters()
    for n in (5, 9, 17, 33):
        a = jnp.asarray(rng.standard_normal((n, 6)), jnp.float32)
        assert_close(f(a), a * 3.0)
    assert delta(before, "graphs_compiled") == 4


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compile counts of interpret mode; on a GPU eager launches and tier-up compiles add graphs (values: the other dynamic tests)")
def test_automatic_dynamic_keeps_unequal_axes_apart(rng):
    """Axes that varied together share a symbol; axes that did not get their own."""
    f = pallaskit.jit(lambda a, b: (a * 2.0, b.sum(-1)))
    before = counters()
    for n, m in ((3, 4), (6, 4), (6, 9), (11, 2), (7, 7)):
        a = jnp.asarray(rng.standard_normal((n, 5)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((m, 5)), jnp.float32)
        out = f(a, b)
        assert_close(out[0], a * 2.0)
        assert_close(out[1], b.sum(-1))
    # (3,4) static; (6,4): a's rows dynamic; (6,9): a's and b's rows apart (a new
    # axis set); later sizes are served by that graph.
    assert delta(before, "graphs_compiled") == 3


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compile counts of interpret mode; on a GPU eager launches and tier-up compiles add graphs (values: the other dynamic tests)")
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_automatic_dynamic_is_on_by_default(rng, dtype):
    """The second size of an axis makes it dynamic: one more compile serves every
    later size, each equal to jax.jit's (odd sizes, size 1 included)."""
    def mlp(x, w, b):
        return jnp.tanh(x @ w + b).astype(x.dtype)

    f = pallaskit.jit(mlp)
    w = jnp.asarray(rng.standard_normal((6, 10)) * 0.3, dtype)
    b = jnp.asarray(rng.standard_normal((10,)), dtype)
    before = counters()
    for n in (5, 9, 17, 1, 9, 33):
        x = jnp.asarray(rng.standard_normal((n, 6)), dtype)
        assert_close(f(x, w, b), jax.jit(mlp)(x, w, b), dtype)
    # 5: static; 9: the symbolic graph, which serves every later size (size 1
    # too: jnp's broadcasting asks ``n == 1`` inside jax, which guards nothing,
    # [Note: shape equality guards]).
    assert delta(before, "graphs_compiled") == 2
    assert delta(before, "dynamic_fallbacks") == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compile counts of interpret mode; on a GPU eager launches and tier-up compiles add graphs (values: the other dynamic tests)")
def test_a_size_equality_in_the_trace_guards_that_size(rng):
    """jax's symbolic ``x.shape[0] == 1`` is False for every size; the size that
    makes it true compiles statically instead of taking the other branch."""
    pallaskit.config.update(automatic_dynamic=True)

    def f(x):
        if x.shape[0] == 1:
            return x * 100.0
        if x.shape[0] == 12:
            return x - 1.0
        return x * 2.0

    g = pallaskit.jit(f)
    for n in (3, 5, 1, 7, 12, 1, 4):
        x = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
        assert_close(g(x), f(x))
    assert metrics.counters["dynamic_guard_failures"] == 2


_SCALE_BY_ROWS = {1: 10.0, 4: 40.0}


def test_a_lookup_keyed_by_a_size_compiles_per_size(rng, caplog):
    """``{1: a}.get(x.shape[0], b)`` and ``x.shape[0] in {1, 4}`` hash the
    symbolic dim, which equals no int key: the symbolic program took the miss
    at every size (wrong at 1 and 4). The trace is refused; sizes compile alone.
    jax's own hashes stay unrecorded, also through a generated dataclass
    ``__hash__`` (jax.vmap's axis data): such a function stays dynamic."""
    def refusals():  # (a GPU without eager launches for a program also compiles per size, for its own reason)
        return sum("hashes the dynamic size" in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger="pallaskit")
    v = pallaskit.jit(lambda x: jax.vmap(jnp.outer)(x, x).sum(-1))
    for n in (3, 5):
        x = jnp.asarray(rng.standard_normal((n, 2)), jnp.float32)
        assert_close(v(x), jax.vmap(jnp.outer)(x, x).sum(-1))
    assert refusals() == 0

    def f(x):
        y = x * _SCALE_BY_ROWS.get(x.shape[0], 1.0)
        return y - 1.0 if x.shape[0] in {1, 4} else y

    g = pallaskit.jit(f)
    for n in (3, 5, 1, 4):
        x = jnp.asarray(rng.standard_normal((n, 2)), jnp.float32)
        assert_close(g(x), f(x))
    if pallaskit.orchestrator.compile_options().interpret:  # a GPU may compile per size before any trace
        assert refusals() == 1


_SCALE_BY_TEXT = {"1": 10.0, "4": 40.0}


def test_a_lookup_keyed_by_a_size_as_text_compiles_per_size(rng, caplog):
    """``str(x.shape[0])`` and f-strings of a symbolic dim give its name ("b"),
    which is no key: the symbolic program took the miss at every size. Text of
    a dim made by the user's code refuses the trace; sizes compile alone."""
    caplog.set_level(logging.INFO, logger="pallaskit")

    def f(x):
        y = x * _SCALE_BY_TEXT.get(str(x.shape[0]), 1.0)
        return y - 1.0 if f"{x.shape[0]}" == "4" else y

    g = pallaskit.jit(f)
    for n in (3, 5, 1, 4, 6):
        x = jnp.asarray(rng.standard_normal((n, 2)), jnp.float32)
        assert_close(g(x), f(x))
    if pallaskit.orchestrator.compile_options().interpret:  # a GPU may compile per size before any trace
        assert sum("into text" in r.getMessage() for r in caplog.records) == 1


def _size_dependent(x):
    """A size-dependent branch and a shape computed from a size: no symbolic trace."""
    if x.shape[0] > 4:
        return x.reshape(x.shape[0] // 2, -1).sum(0)
    return x.sum(0) * 2.0


def test_what_cannot_trace_symbolically_compiles_per_size_and_is_remembered(rng, caplog):
    """A size-dependent branch or a shape computed from a size: the symbolic
    trace fails once (an info line, not a warning: the user did not ask for
    dynamic), and every size compiles statically after that."""
    f = _size_dependent
    g = pallaskit.jit(f)
    with caplog.at_level(logging.INFO, logger="pallaskit"):
        for n in (6, 8, 2, 10, 8, 3):
            x = jnp.asarray(rng.standard_normal((n, 4)), jnp.float32)
            assert_close(g(x), jax.jit(f)(x))
    assert metrics.counters["dynamic_fallbacks"] == 1
    assert metrics.counters["graphs_compiled"] == 5  # 6, 8, 2, 10, 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dynamic" in r.getMessage()]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compile counts of interpret mode; on a GPU eager launches and tier-up compiles add graphs (values: the other dynamic tests)")
def test_automatic_dynamic_without_fast_new_sizes_compiles_per_size(rng, monkeypatch):
    """Where a new size of the symbolic program would still wait for XLA and run
    size-hinted kernels (a GPU without eager launches), sizes compile statically."""
    from pallaskit import dynamic

    monkeypatch.setattr(dynamic, "_serves_new_sizes_at_once", lambda entry: False)
    f = pallaskit.jit(lambda a: jnp.exp(a) + 1.0)
    for n in (3, 5, 7, 5):
        a = jnp.asarray(rng.standard_normal((n, 2)), jnp.float32)
        assert_close(f(a), jnp.exp(a) + 1.0)
    # sizes 3, 5, 7 static, and the symbolic graph compiled once and set aside
    assert metrics.counters["graphs_compiled"] == 4 and metrics.counters["dynamic_fallbacks"] == 1


def test_axes_tuple_gives_each_axis_its_own_symbol(rng):
    f = pallaskit.jit(lambda a, b: (a * 2.0, b + 1.0), dynamic={0: (0,), "b": (0, 1)})
    assert f.dynamic == {"a": {0: "a_d0"}, "b": {0: "b_d0", 1: "b_d1"}}
    before = counters()
    for n, m, k in ((3, 4, 5), (8, 2, 9), (1, 1, 1)):
        a = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        out = f(a, b)
        assert_close(out[0], a * 2.0)
        assert_close(out[1], b + 1.0)
    assert delta(before, "graphs_compiled") == 1


def test_dynamic_pytree_argument_is_a_clear_error():
    f = pallaskit.jit(lambda p: p["w"] * 2, dynamic={"p": {0: "n"}})
    with pytest.raises(ValueError, match="pytree"):
        f({"w": jnp.ones((3,))})


def test_mismatched_shared_symbol_is_a_clear_error(rng):
    f = pallaskit.jit(_shared, dynamic={"x": {0: "n"}, "labels": {0: "n"}})
    x = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"'n'.*argument 'x' axis 0.*argument 'labels' axis 0"):
        f(x, jnp.ones((5,), jnp.float32))


def test_dynamic_spec_is_validated():
    with pytest.raises(ValueError, match="argument 'z'"):
        pallaskit.jit(_shared, dynamic={"z": {0: "n"}})
    with pytest.raises(ValueError, match="position 5"):
        pallaskit.jit(_shared, dynamic={5: {0: "n"}})
    with pytest.raises(TypeError, match="symbol name"):
        pallaskit.jit(_shared, dynamic={"x": {0: 3}})
    with pytest.raises(ValueError, match="not usable"):
        pallaskit.jit(_shared, dynamic={"x": {0: "i0"}})
    with pytest.raises(ValueError, match="static"):
        pallaskit.jit(lambda x, k: x * k, static_argnums=1, dynamic={"k": {0: "n"}})
    f = pallaskit.jit(lambda x: x + 1, dynamic={"x": {2: "n"}})
    with pytest.raises(ValueError, match="axis 2 of argument 'x' is out of range"):
        f(jnp.ones((3, 4)))


def test_size_zero_breaks_the_symbols_constraint_and_compiles_on_its_own(rng):
    """Symbols are >= 1 (jax.export's default); a size 0 compiles that size statically."""
    f = pallaskit.jit(lambda x: jnp.tanh(x) + 1.0, dynamic={"x": {0: "n"}})
    before = counters()
    for n in (4, 0, 9, 0):
        x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
        assert_close(f(x), jnp.tanh(x) + 1.0)
    assert delta(before, "graphs_compiled") == 2  # the symbolic one, and size 0 once


def test_broken_guard_recompiles_that_size(rng, monkeypatch):
    """A symbolic kernel indexes with int32 at its hint and guards it; sizes past
    the guard compile on their own (the limit lowered here to reach it)."""
    from lowering.codegen import emitter

    monkeypatch.setattr(emitter, "INT32_LIMIT", 2000)
    pallaskit.config.update(multi_kernel_hints="")  # one variant, hinted at the first call's size (7)
    f = pallaskit.jit(lambda x, w: x * w + 1.0, dynamic={"x": {0: "n"}})
    w = jnp.asarray(rng.standard_normal((96,)), jnp.float32)
    before = counters()
    for n in (7, 3, 64, 30, 64):  # 7*96 and 3*96 < 2000; 64*96 and 30*96 are not
        x = jnp.asarray(rng.standard_normal((n, 96)), jnp.float32)
        assert_close(f(x, w), x * w + 1.0)
    assert delta(before, "graphs_compiled") == 3
    assert delta(before, "dynamic_guard_failures") == 2
    guards = f.lower_to_result(jnp.ones((7, 96)), w).guards
    assert guards and all(eval(g, {}, {"n": 7}) for g in guards)
    assert not any(eval(g, {}, {"n": 64}) for g in guards)


@pytest.mark.parametrize("fn,cols,why", [
    (lambda x: x.reshape(-1, 2) * 2.0, (), "InconclusiveDimensionOperation"),  # the trace needs n even
    (lambda x: jnp.argmax(x, 0), (4,), "argmax/argmin over a dynamic axis"),
    # a gather over a dynamic indexed dim with slice sizes (1, n): XLA would need n in the parameter
    (lambda x: jnp.take(x[:, :1] * x[:, 0], jnp.array([0, 1]), axis=0) * 3.0, (4,), "symbolic shape parameter"),
], ids=["reshape_needs_even", "argmax_dynamic_axis", "gather"])
def test_unsupported_falls_back_to_per_size(fn, cols, why, rng, caplog):
    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    before = counters()
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        for n in (4, 6, 10):
            x = jnp.asarray(rng.standard_normal((n,) + cols), jnp.float32)
            assert_close(f(x), jax.jit(fn)(x))
    assert delta(before, "dynamic_fallbacks") == 1
    assert delta(before, "graphs_compiled") == 3
    lines = [r.getMessage() for r in caplog.records if "cannot be compiled with dynamic" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], lines


def test_matmul_with_dynamic_rows_runs_through_xla(rng):
    def layer(x, w, b):
        return jax.nn.gelu(x @ w + b)

    f = pallaskit.jit(layer, dynamic={"x": {0: "tokens"}})
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((48,)), jnp.float32)
    before = counters()
    for n in (1, 13, 70):
        x = jnp.asarray(rng.standard_normal((n, 32)), jnp.float32)
        np.testing.assert_allclose(f(x, w, b), jax.jit(layer)(x, w, b), rtol=2e-4, atol=2e-4)
    assert delta(before, "graphs_compiled") == 1
    assert delta(before, "dynamic_fallbacks") == 0


def test_explain_shows_symbolic_sizes():
    f = pallaskit.jit(_softmax, dynamic={"x": {0: "n"}})
    text = str(pallaskit.explain(f, jnp.ones((7, 100)), jnp.ones((100,))))
    assert "reduction, n x 100" in text, text


def test_disk_cache_never_serves_a_symbolic_graph_for_a_static_signature(rng):
    """Symbolic graphs bypass the disk cache; a static function on the same
    shapes compiles and caches its own entry, and a dynamic one never takes it."""
    def fn(x):
        return jnp.sin(x) * 2.0

    x = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    before = counters()
    dyn = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    assert_close(dyn(x), jnp.sin(x) * 2.0)
    assert (delta(before, "cache_hits"), delta(before, "cache_misses")) == (0, 0)
    static = pallaskit.jit(fn)
    assert_close(static(x), jnp.sin(x) * 2.0)
    assert (delta(before, "cache_hits"), delta(before, "cache_misses")) == (0, 1)
    assert pallaskit.jit(fn)(x) is not None and delta(before, "cache_hits") == 1
    dyn2 = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
    y = jnp.asarray(rng.standard_normal((9, 8)), jnp.float32)
    assert_close(dyn2(x), jnp.sin(x) * 2.0)
    assert_close(dyn2(y), jnp.sin(y) * 2.0)
    assert delta(before, "cache_hits") == 1
    assert dyn2.lower_to_result(y).result.program.symbols == ["n"]


@pytest.mark.pallas_source
def test_symbolic_program_lowers_to_triton_for_each_size():
    """Exporting for CUDA runs Pallas' Triton lowering on the CPU: the runtime
    size operand (``dims_ptr[0]``) and the wrapper-computed grid lower for any
    size. (PTX compilation does not run; see WORKSPACE.md for the device check.)"""
    from jax import export

    from pallaskit.runtime import loader

    f = pallaskit.jit(lambda x, w: (jax.nn.softmax(x * w, -1) * x.shape[0], x.sum(0)), dynamic={"x": {0: "n"}})
    w = jnp.zeros((384,), jnp.float32)
    with pallaskit.config.override(interpret=False):
        res = f.lower_to_result(jnp.zeros((7, 384)), w).result
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    call = jax.jit(loader.load(res.program))
    for n in (1, 1000):
        exported = export.export(call, platforms=["cuda"], disabled_checks=checks)(jnp.zeros((n, 384)), w)
        assert exported.mlir_module().count("__gpu$xla.gpu.triton") == len(res.program.kernels) == 2


def _rms(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)


def _rms_bwd(x, w, dy):
    return jax.vjp(_rms, x, w)[1](dy)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("num_sms,kinds", [(4, ["mix", "reduction"]), (132, ["reduction", "mix", "reduction"])],
                         ids=["mix", "split"])
def test_norm_backward_over_dynamic_rows_keeps_split_and_mix(num_sms, kinds, dtype, rng):
    """dw's column reduction over dynamic rows splits with a program count
    taken at the hint; each program walks a runtime number of row blocks.
    With few SMs (num_sms=4) the rows are enough for mix-order fusion: one
    pass plus the finishing sum; with 132 the row kernel stays apart."""
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(96), jnp.float32)
    with pallaskit.config.override(num_sms=num_sms, multi_kernel_hints="4096"):
        f = pallaskit.jit(_rms_bwd, dynamic={"x": {0: "n"}, "dy": {0: "n"}})
        before = counters()
        for n in (1500, 7, 1):
            x, dy = (jnp.asarray(rng.standard_normal((n, 96)), dtype) for _ in range(2))
            for a, b in zip(f(x, w, dy), jax.jit(_rms_bwd)(x, w, dy)):
                # dw sums n rows in another order: the tolerance scales with its magnitude.
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                scale = max(1.0, float(np.abs(b).max()))
                np.testing.assert_allclose(a, b, rtol=0, atol=(2e-2 if dtype == BF16 else 2e-6) * scale)
        assert delta(before, "graphs_compiled") == 1 and delta(before, "dynamic_fallbacks") == 0
        assert [k.kind for k in pallaskit.explain(f, x, w, dy).kernels] == kinds


@pytest.mark.pallas_source
def test_dynamic_rows_mix_kernel_lowers_to_triton_for_each_size():
    """The mix kernel's runtime row-block count lowers through Pallas' Triton
    lowering (on the CPU; PTX and the launch are not run here)."""
    from jax import export

    from pallaskit.runtime import loader

    w = jnp.zeros((96,), jnp.float32)
    with pallaskit.config.override(num_sms=4, multi_kernel_hints="4096", interpret=False):
        f = pallaskit.jit(_rms_bwd, dynamic={"x": {0: "n"}, "dy": {0: "n"}})
        res = f.lower_to_result(jnp.zeros((7, 96)), w, jnp.zeros((7, 96))).result
    assert [k.kind for k in res.schedule.kernels] == ["mix", "reduction"]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    call = jax.jit(loader.load(res.program))
    for n in (1, 5000):
        exported = export.export(call, platforms=["cuda"], disabled_checks=checks)(
            jnp.zeros((n, 96)), w, jnp.zeros((n, 96)), *[res.schedule.graph.constants[c] for c in res.schedule.graph.inputs
                                                          if c in res.schedule.graph.constants])
        assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2


def test_automatic_dynamic_asks_the_orchestrator_whether_new_sizes_launch_eagerly():
    """The GPU branch of automatic dynamic (pallaskit/dynamic.py) asks
    ``orchestrator.eager_wanted``; the H100 run found it calling a name the
    refactor had renamed, a path no CPU test reached. Its answer follows option
    dynamic_launch and the platform (interpret mode compiles each size)."""
    from lowering.options import CompileOptions
    from pallaskit import dynamic, orchestrator

    gpu, cpu = CompileOptions(interpret=False), CompileOptions(interpret=True)
    for launch, on_gpu in (("auto", True), ("on", True), ("off", False)):
        with pallaskit.config.override(dynamic_launch=launch):
            assert orchestrator.eager_wanted(gpu) is on_gpu
            assert orchestrator.eager_wanted(cpu) is (launch == "on")
    import inspect
    assert "orchestrator.eager_wanted(options)" in inspect.getsource(dynamic)


def test_a_jax_dim_is_parsed_once(monkeypatch):
    """lowering.symbolic.to_sympy: a graph converts the same few dims again and
    again (every aval and param); the text of each is parsed once, to the same
    expression; a dim the symbolic path cannot take is refused every time."""
    import sympy

    from lowering import sizes, symbolic
    from lowering.errors import SymbolicUnsupported

    parsed = []
    real = sympy.sympify

    def counting(text, *a, **k):
        parsed.append(text)
        return real(text, *a, **k)

    monkeypatch.setattr(sympy, "sympify", counting)
    for memo in [getattr(symbolic, "_parse_dim", None)]:
        if memo is not None:
            memo.cache_clear()  # parsed afresh in this test
    rows, cols = jax.export.symbolic_shape("rows_q, cols_q")
    n = sizes.dim_symbol("rows_q")
    for _ in range(3):
        assert symbolic.to_sympy(2 * rows + 1) == 2 * n + 1
        assert symbolic.to_sympy(rows * cols) == n * sizes.dim_symbol("cols_q")
        assert symbolic.to_sympy(7) == 7
        with pytest.raises(SymbolicUnsupported):
            symbolic.to_sympy(rows // 3)
    assert parsed.count(str(2 * rows + 1)) == 1 and parsed.count(str(rows * cols)) == 1, parsed


def test_aot_compile_calls_while_compiling_before_lowering(monkeypatch):
    """executable.aot_compile's hook runs once, before JAX lowers the program:
    the lowering's wait for its raw-Triton kernels and XLA's compile after it
    leave the GIL free for the thread it starts."""
    from pallaskit import executable
    from pallaskit.runtime import xla_args

    events = []
    real_lower = xla_args.lower

    class Lowered:
        def __init__(self, inner):
            self.inner = inner

        def compile(self, **kw):
            events.append("compile")
            return self.inner.compile(**kw)

    def lower(*a, **k):
        events.append("lowering")
        out = real_lower(*a, **k)
        events.append("lowered")
        return Lowered(out)

    monkeypatch.setattr(xla_args, "lower", lower)
    x = jnp.arange(6.0, dtype=jnp.float32)
    compiled = executable.aot_compile(lambda a: (a * 2.0,), [jax.ShapeDtypeStruct(x.shape, x.dtype)], [],
                                      while_compiling=lambda: events.append("hook"))
    np.testing.assert_array_equal(np.asarray(compiled(x)[0]), np.asarray(x) * 2.0)
    assert events == ["hook", "lowering", "lowered", "compile"]

    def broken():
        raise RuntimeError("a side task failed")

    compiled = executable.aot_compile(lambda a: (a + 1.0,), [jax.ShapeDtypeStruct(x.shape, x.dtype)], [],
                                      while_compiling=broken)  # the compile goes on
    np.testing.assert_array_equal(np.asarray(compiled(x)[0]), np.asarray(x) + 1.0)


def test_warm_up_for_eager_only_where_a_new_size_could_launch_eagerly():
    """Triton's import starts while XLA compiles a static program only where a
    later new size would compile eager Triton kernels: a GPU with triton,
    automatic dynamic on, eager launches wanted."""
    from lowering.options import CompileOptions
    from pallaskit import orchestrator
    from pallaskit.runtime import triton_launch

    gpu = CompileOptions(interpret=False, triton_available=True)
    with pallaskit.config.override(dynamic_launch="auto"):  # this file's fixture sets 'off'
        assert orchestrator._warm_up_for_eager(gpu) is triton_launch.warm_up
        assert orchestrator._warm_up_for_eager(CompileOptions(interpret=True, triton_available=True)) is None
        assert orchestrator._warm_up_for_eager(CompileOptions(interpret=False, triton_available=False)) is None
        with pallaskit.config.override(automatic_dynamic=False):
            assert orchestrator._warm_up_for_eager(gpu) is None
    with pallaskit.config.override(dynamic_launch="off"):
        assert orchestrator._warm_up_for_eager(gpu) is None


def test_a_static_compile_starts_the_warm_up_as_xla_compiles(rng, monkeypatch):
    """The orchestrator hands ``_warm_up_for_eager``'s answer to XLA's compile of
    every static program it compiles (cache off or a miss), and a cache hit,
    which compiles nothing, starts nothing."""
    from pallaskit import executable, orchestrator

    started, seen = [], []
    monkeypatch.setattr(orchestrator, "_warm_up_for_eager", lambda options: lambda: started.append(1))
    real = executable.aot_compile

    def aot_compile(*a, while_compiling=None, **k):
        seen.append(while_compiling is not None)
        return real(*a, while_compiling=while_compiling, **k)

    monkeypatch.setattr(executable, "aot_compile", aot_compile)
    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    for cache in (False, True, True):  # off, a miss, a hit (a new function of the same code)
        with pallaskit.config.override(cache=cache):
            assert_close(pallaskit.jit(lambda a: jnp.sin(a) * 2.0)(x), jnp.sin(x) * 2.0)
    assert seen == [True, True] and started == [1, 1]


def test_warm_up_imports_tritons_code_generator():
    """warm_up (a process without Triton's interpreter) imports what a first
    kernel compile would wait for, Triton's AST code generator included, on a
    thread; again after triton itself was imported by something else."""
    pytest.importorskip("triton")
    script = ("import sys\n"
              "import triton\n"  # imported already (as by raw Triton kernels inside XLA): still warmed
              "from pallaskit.runtime import triton_launch\n"
              "triton_launch.warm_up()\n"
              "triton_launch._warming.join()\n"
              "print('WARM', 'triton.compiler.code_generator' in sys.modules, "
              "'triton.compiler.compiler' in sys.modules)\n")
    proc = run_python_on_cpu(script, timeout=300)
    assert "WARM True True" in proc.stdout, proc.stdout + proc.stderr[-3000:]


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
def test_speculation_compiles_the_guessed_program_at_the_first_size(rng, dtype):
    """Option automatic_dynamic_speculate ([Note: dynamic speculation]): the first
    size's static compile also starts the symbolic compile of the leading axis in
    the background; the second size takes it (no compile of its own), eagerly
    (Triton's interpreter here), and every size agrees with jax.jit."""
    pallaskit.config.update(dynamic_launch="on", automatic_dynamic_speculate=True)
    fn = lambda a, b: jnp.exp(a) * b + 1.0  # noqa: E731
    f = pallaskit.jit(fn)
    for i, n in enumerate((5, 9, 17, 1)):
        a = jnp.asarray(rng.standard_normal((n, 6)), dtype)
        b = jnp.asarray(rng.standard_normal((n, 6)), dtype)
        assert_close(f(a, b), jax.jit(fn)(a, b))
        pallaskit.wait_compiles()
        assert metrics.counters["dynamic_speculations"] == 1
        assert metrics.counters["graphs_compiled"] == 2  # the first size's, and the speculative one
        assert metrics.counters["dynamic_speculation_hits"] == (i > 0)
    assert metrics.counters["eager_launches"] == 3 and not metrics.counters["dynamic_fallbacks"]


def test_speculation_off_or_a_wrong_guess_changes_nothing(rng):
    """Off: nothing compiles ahead. A guess the second size does
    not confirm (its other axis changes) is left unused: that size compiles its
    own symbolic program, as without the option."""
    pallaskit.config.update(dynamic_launch="on", cache=False)  # each run compiles its first size
    fn = lambda a: jnp.tanh(a) * 2.0  # noqa: E731
    for speculate in (False, True):
        metrics.reset()
        pallaskit.config.update(automatic_dynamic_speculate=speculate)
        f = pallaskit.jit(fn)
        for n in (5, 9):
            a = jnp.asarray(rng.standard_normal((7, n)), jnp.float32)  # axis 1 changes; axis 0 is guessed
            assert_close(f(a), jax.jit(fn)(a))
            pallaskit.wait_compiles()
        assert metrics.counters["dynamic_speculations"] == speculate
        assert metrics.counters["dynamic_speculation_hits"] == 0
        assert metrics.counters["graphs_compiled"] == 2 + speculate


def test_a_speculation_that_cannot_compile_is_silent(rng, caplog):
    """A guess whose symbolic trace fails logs nothing above debug and counts
    no fallback; the second size then goes the usual way (one info line)."""
    pallaskit.config.update(dynamic_launch="on", automatic_dynamic_speculate=True)
    f = _size_dependent
    g = pallaskit.jit(f)
    with caplog.at_level(logging.INFO, logger="pallaskit"):
        x = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
        assert_close(g(x), jax.jit(f)(x))
        pallaskit.wait_compiles()
        assert metrics.counters["dynamic_speculations"] == 1 and not metrics.counters["dynamic_fallbacks"]
        assert not [r for r in caplog.records if "dynamic" in r.getMessage()]
        x = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
        assert_close(g(x), jax.jit(f)(x))
    assert metrics.counters["dynamic_fallbacks"] == 1 and metrics.counters["dynamic_speculation_hits"] == 0


def test_no_speculation_under_a_thread_local_jax_context(rng):
    """A call under a jax context (``with jax.default_matmul_precision(...)``:
    thread-local in jax) is not speculated for: the background thread would
    trace without it. The second size compiles its own symbolic program
    under the caller's context."""
    pallaskit.config.update(dynamic_launch="on", automatic_dynamic_speculate=True)
    fn = lambda a: a @ a.T + 1.0  # noqa: E731
    f = pallaskit.jit(fn)
    with jax.default_matmul_precision("highest"):
        for n in (5, 9):
            a = jnp.asarray(rng.standard_normal((n, 6)), jnp.float32)
            assert_close(f(a), jax.jit(fn)(a))
            pallaskit.wait_compiles()
    assert metrics.counters["dynamic_speculations"] == 1
    assert metrics.counters["dynamic_speculation_hits"] == 0


def test_guessed_axes_are_leading_axes_of_sizes_found_nowhere_else():
    """_guess_axes: a batch axis (shared by arguments of the same leading size),
    never a weight's leading axis (another array's feature size), never size 1."""
    from pallaskit import dynamic

    def avals(*shapes):
        return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]

    assert dynamic._guess_axes(avals((100, 1024), (1024, 4096), (4096, 1024))) == {(0, 0)}
    assert dynamic._guess_axes(avals((8, 16), (8,), (16, 16))) == {(0, 0), (1, 0)}
    assert dynamic._guess_axes(avals((1, 16), (16, 16))) == set()
    assert dynamic._guess_axes(avals((), (3,))) == {(1, 0)}


def test_a_speculation_does_not_queue_behind_tier_up(rng):
    """Speculative compiles have a thread of their own: a second size waiting
    for one does not also wait for another function's tier-up compile."""
    import concurrent.futures
    import threading

    from pallaskit.runtime import eager

    pallaskit.config.update(dynamic_launch="on", automatic_dynamic_speculate=True)
    gate = threading.Event()
    busy = eager.submit(gate.wait, 120)  # the tier-up thread, held
    try:
        f = pallaskit.jit(lambda a: a * 2.0 + 1.0)
        a = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
        assert_close(f(a), a * 2.0 + 1.0)
        (future,) = f._speculated.values()
        concurrent.futures.wait([future], timeout=60)
        assert future.done() and future.result() is not None
    finally:
        gate.set()
        busy.result()


def test_no_speculation_for_a_large_program(rng, monkeypatch):
    """Programs of more than SPECULATE_MAX_EQUATIONS equations (those inside
    inner jits counted) are not guessed for: their symbolic compile would cost
    seconds of the GIL."""
    from pallaskit import dynamic

    inner = jax.jit(lambda a: jnp.tanh(a) + 1.0)
    fn = lambda a: inner(a) * 2.0  # noqa: E731
    a = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    n = dynamic._equations(jax.make_jaxpr(fn)(a).jaxpr)
    assert n > len(jax.make_jaxpr(fn)(a).jaxpr.eqns)
    pallaskit.config.update(dynamic_launch="on", automatic_dynamic_speculate=True, cache=False)
    for cap, started in ((n - 1, 0), (n, 1)):
        metrics.reset()
        monkeypatch.setattr(dynamic, "SPECULATE_MAX_EQUATIONS", cap)
        assert_close(pallaskit.jit(fn)(a), fn(a))
        pallaskit.wait_compiles()
        assert metrics.counters["dynamic_speculations"] == started


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="compile counts of interpret mode (values: the other dynamic tests)")
def test_automatic_dynamic_attention_einsums_over_heads(rng):
    """Flax's attention (``...qhd,...khd->...hqk`` then ``...hqk,...khd->...qhd``) at a new batch size: the
    dots' operands, computed by kernels, are stored in gemm order only in static graphs; a symbolic one
    made permuted copies of jax-dim extents, whose tile raised, and every size compiled on its own."""
    def attention(x, wq, wk, wv):
        q, k, v = (jnp.einsum("bld,dhe->blhe", jnp.tanh(x), w) for w in (wq, wk, wv))
        s = jnp.einsum("...qhd,...khd->...hqk", q * 0.5, k + 1.0)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("...hqk,...khd->...qhd", p, v * 2.0)

    f = pallaskit.jit(attention)
    ws = [jnp.asarray(rng.standard_normal((6, 3, 4)) * 0.3, jnp.float32) for _ in range(3)]
    before = counters()
    for n in (2, 3, 5, 1):
        x = jnp.asarray(rng.standard_normal((n, 7, 6)), jnp.float32)
        assert_close(f(x, *ws), jax.jit(attention)(x, *ws), jnp.float32)
    assert delta(before, "dynamic_fallbacks") == 0
    assert delta(before, "graphs_compiled") == 2
