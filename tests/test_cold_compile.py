"""What a cold compile saves without changing the program's kernels: the
cyclic GC paused through the passes and JAX's lowering
([Note: no collections while compiling] in pallaskit/runtime/gc_pause.py),
raw-Triton launches taking and returning arrays in their own shapes (no
reshape per operand and result), a GPU program's Triton functions loaded
without inspect's tokenizer and not hashed (tracing never waits behind a
compile thread's parse), and the passes' memos returning what they would
compute."""
import gc
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy

import pallaskit
from lowering import ir, lower, sizes
from pallaskit.runtime import gc_pause

from conftest import assert_close, run_python_on_cpu, special_values


# --------------------------------------------------------------------------- #
# The collector paused while compiling
# --------------------------------------------------------------------------- #
@pytest.fixture
def gc_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_nests_and_restores(gc_on):
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer block still runs
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with gc_pause.paused():
            raise ValueError
    assert gc.isenabled()
    gc.disable()  # a collector the user turned off stays off
    with gc_pause.paused():
        pass
    assert not gc.isenabled()


def test_paused_on_two_threads_turns_it_on_after_the_last(gc_on):
    entered, release, states = threading.Event(), threading.Event(), []

    def other():
        with gc_pause.paused():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_pause.paused():
        t.start()
        assert entered.wait(10)
    states.append(gc.isenabled())  # the other thread still compiles
    release.set()
    t.join(10)
    assert states == [False] and gc.isenabled()


@pytest.mark.no_speculation
def test_the_passes_and_jax_lowering_run_without_collections(gc_on, monkeypatch):
    """The compiler's passes and JAX's trace and lowering of the generated
    program (loaded there) run with the collector off, in ``jit``'s call and
    in ``trace(...).lower()``; a call's trace of the function too; it is on
    again after."""
    import lowering
    from pallaskit.runtime import loader, xla_args

    seen = {}

    def spy(module, name):
        inner = getattr(module, name)

        def wrapped(*a, **k):
            seen.setdefault(name, []).append(gc.isenabled())
            return inner(*a, **k)
        monkeypatch.setattr(module, name, wrapped)

    spy(lowering, "compile_jaxpr")
    spy(xla_args, "lower")
    spy(loader, "load")

    def f(x, y):
        seen.setdefault("trace", []).append(gc.isenabled())
        return jnp.tanh(x) * y + 1, jnp.sum(x * y, -1)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((9, 33)), jnp.float32)
    with pallaskit.config.override(cache=False):
        got = pallaskit.jit(f)(x, x[::-1])
        assert gc.isenabled()
        pallaskit.jit(f).trace(x, x).lower()
    assert gc.isenabled()
    assert seen["compile_jaxpr"] == [False, False], seen
    assert seen["lower"] == [False], seen
    assert seen["load"] and not any(seen["load"]), seen
    assert seen["trace"][0] is False, seen
    for a, e in zip(got, jax.jit(f)(x, x[::-1])):
        assert_close(a, e)


def test_the_passes_leave_no_cyclic_garbage_per_equation():
    """With the collector paused through a compile, garbage in reference cycles
    waits for the first collection after it: a recursive closure made per
    equation (``symbolic.params_symbolic``'s) left 60,000 objects there for a
    1000-array AdamW. The passes make none per equation."""
    import collections

    import lowering
    from pallaskit import orchestrator

    def f(x):
        for _ in range(50):
            x = jnp.sin(x) * 1.5
        return x

    closed = jax.make_jaxpr(f)(jax.ShapeDtypeStruct((8, 33), jnp.float32))
    options = orchestrator.compile_options()
    lowering.compile_jaxpr(closed, options)  # the passes' imports and first-use caches
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        lowering.compile_jaxpr(closed, options)
        gc.collect()
        made = collections.Counter(g.__qualname__ for g in gc.garbage
                                   if type(g).__name__ == "function" and g.__module__.startswith("lowering"))
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    assert sum(made.values()) < 50, made


# --------------------------------------------------------------------------- #
# Raw-Triton launches in their own shapes
# --------------------------------------------------------------------------- #
def _shapes(x, y, b, n, s):
    """Outputs of rank 0 to 3, size-1 dims, bool / int / bfloat16 / float32."""
    return (jnp.tanh(x) * y,  # (3, 1, 5) float32
            (x > 0) & b,  # bool (3, 1, 5)
            n * 3 - 1,  # int32 (7,)
            (s.astype(jnp.float32) * 2).astype(jnp.bfloat16),  # bfloat16 (2, 17)
            jnp.sum(y) + 0 * x[0, 0, 0],  # 0-d
            jnp.exp(x)[:, 0, :].T)  # (5, 3) of a (3, 1, 5)


@pytest.mark.parametrize("combo", [False, True], ids=["kernels", "combo"])
def test_triton_launches_take_and_return_arrays_in_their_shapes(combo, rng):
    """kernel_backend='triton' (Triton's interpreter on the CPU): the same
    results as jax.jit, and the program reshapes nothing around its launches."""
    import lowering
    from lowering.options import CompileOptions
    from pallaskit.runtime import loader

    args = (special_values(rng, (3, 1, 5), jnp.float32), special_values(rng, (3, 1, 5), jnp.float32),
            jnp.asarray(rng.random((3, 1, 5)) > 0.5), jnp.asarray(rng.integers(-50, 50, (7,)), jnp.int32),
            special_values(rng, (2, 17), jnp.bfloat16))
    with pallaskit.config.override(kernel_backend="triton", combo_kernels=combo, cache=False):
        ex = pallaskit.explain(_shapes, *args)
        got = pallaskit.jit(_shapes)(*args)
    assert ex.kernels and all(k.executor == "triton_xla" for k in ex.kernels), [(k.name, k.reason) for k in ex.kernels]
    assert (any(k.kind == "combo" for k in ex.kernels)) == combo, [k.kind for k in ex.kernels]
    assert ".reshape(" not in ex.source.split("\ndef call(")[1], ex.source
    for a, e in zip(got, jax.jit(_shapes)(*args)):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, e.shape, a.dtype, e.dtype)
        assert_close(a, e, e.dtype)
    # The traced program is its launches (and the externs' equations), no reshape among them.
    opts = CompileOptions(interpret=jax.default_backend() == "cpu", kernel_backend="triton", triton_available=True,
                          combo_kernels=combo)  # as the process runs Triton: its interpreter on the CPU
    result = lowering.compile_jaxpr(jax.make_jaxpr(_shapes)(*args), opts)
    jaxpr = jax.make_jaxpr(loader.load(result.program))(*args)
    assert not [e for e in jaxpr.eqns if e.primitive.name == "reshape"], jaxpr


# --------------------------------------------------------------------------- #
# A GPU program's Triton functions neither tokenized nor hashed when it loads
# --------------------------------------------------------------------------- #
_HASH_SCRIPT = '''
import inspect, os, threading
os.environ.pop("TRITON_INTERPRET", None)
import jax, jax.numpy as jnp
import lowering
from lowering.options import CompileOptions
from pallaskit.runtime import loader, triton_call, triton_launch

def f(*xs):
    return [jnp.tanh(x) * 2 + x for x in xs] + [jnp.sum(xs[0] * xs[0], -1)]

xs = [jnp.ones(s, jnp.float32) for s in [(64,), (8, 8), (128,), (3, 5), (9, 33)]]
opts = CompileOptions(interpret=False, triton_available=True, num_sms=132, combo_kernels=False, loop_bodies=False)
result = lowering.compile_jaxpr(jax.make_jaxpr(f)(*xs), opts)
triton_launch._triton(False)  # triton's own @jit functions (its standard library) read their sources on import
tokenized = []
block = inspect.getblock
inspect.getblock = lambda lines: tokenized.append(lines) or block(lines)
call = loader.load(result.program)
inspect.getblock = block
functions = [v for v in call.__globals__.values() if hasattr(type(v), "cache_key")]  # not the hash itself
kernels = [v for v in functions if v.__name__.endswith("_kernel")]
assert len(kernels) >= 2 and all(v.hash is None for v in functions), [(v.__name__, v.hash) for v in functions]
assert not tokenized, f"{len(tokenized)} functions' sources read by inspect's tokenizer"
for v in functions:  # what Triton read is what inspect reads
    assert (v.raw_src, v.starting_line_number) == inspect.getsourcelines(v.fn), v.__name__
# A compile thread parsing a kernel holds PARSE_LOCK; tracing a launch must not wait for it.
held, done = threading.Event(), threading.Event()
def parse():
    with triton_launch.PARSE_LOCK:
        held.set()
        done.wait(60)
threading.Thread(target=parse, daemon=True).start()
assert held.wait(10)
got = []
t = threading.Thread(target=lambda: got.extend(triton_call._kernel(k, 4, 1) for k in kernels), daemon=True)
t.start()
t.join(20)
done.set()
assert len(got) == len(kernels), "a launch waited for PARSE_LOCK"
assert [triton_call._kernel(k, 4, 1) for k in kernels] == got and all(v.hash is None for v in functions)
print("LOADED", len(functions))
'''


def test_a_gpu_programs_triton_functions_load_without_the_tokenizer_or_a_parse():
    proc = run_python_on_cpu(_HASH_SCRIPT, timeout=300)
    assert proc.returncode == 0 and "LOADED" in proc.stdout, proc.stderr[-4000:]


# --------------------------------------------------------------------------- #
# The passes' memos
# --------------------------------------------------------------------------- #
def test_load_indices_are_per_shape():
    i0, i1 = sizes.index_symbols("i", 2)
    assert lower._load_index((i0, i1 + 0), (1, 5)) == (sympy.Integer(0), i1)
    assert lower._load_index((i0, i1 + 0), (3, 5)) == (i0, i1)
    assert lower._load_index((i0 * 2 + i0,), (4,)) == (3 * i0,)


def test_indirect_atoms_are_per_index_and_fresh():
    i0, = sizes.index_symbols("i", 1)
    value = ir.Load("ids", (i0,), np.dtype(np.int32))
    app = ir.indirect_index(value)
    other = ir.indirect_index(ir.Load("other", (i0,), np.dtype(np.int32)))
    atoms = ir.indirect_atoms((app * 4 + 1,))
    assert atoms == [app]
    atoms.append("x")  # the caller's list: the memo keeps its own
    assert ir.indirect_atoms((app * 4 + 1,)) == [app]
    assert ir.indirect_atoms((other, app)) == [other, app]
    assert ir.indirect_atoms((i0, 3)) == []


def test_constants_compare_by_bits_with_their_key_kept():
    f32 = np.dtype(np.float32)
    zero, neg, nan = ir.Const(0.0, f32), ir.Const(-0.0, f32), ir.Const(float("nan"), f32)
    for _ in range(2):  # the first comparison keeps each key; the second reads it
        assert zero != neg and neg != zero
        assert nan == ir.Const(float("nan"), f32)
        assert zero == ir.Const(0.0, f32) and zero != ir.Const(0.0, np.dtype(np.int32))
    assert len({zero, neg, nan, ir.Const(0.0, f32)}) == 3


def test_walk_yields_equal_subexpressions_once():
    i0, = sizes.index_symbols("i", 1)
    f32 = np.dtype(np.float32)
    a, b = ir.Load("x", (i0,), f32), ir.Load("x", (i0,), f32)  # equal, not identical
    e = ir.Op("add", (ir.Op("mul", (a, a), f32), ir.Op("mul", (b, b), f32)), f32)
    out = list(ir.walk(e))
    assert out == [a, ir.Op("mul", (a, a), f32), e]
    assert ir.loads(e) == (a,)


def _update(step, xs, ys):
    # Members of one code over arrays of repeated and new shapes and dtypes, an
    # array used twice in one member (x * x), a transposed read and a bf16 one.
    out = [x * 0.9 + y * step for x, y in zip(xs, ys)]
    out += [xs[0] * xs[0] + ys[0], xs[1] * ys[1] + ys[1], xs[2].T * 2.0 + ys[2], (xs[4] * 3).astype(jnp.bfloat16)]
    return out


@pytest.mark.parametrize("interpret", [True, False], ids=["pallas", "triton"])
def test_combo_parts_of_one_structure_are_written_once(interpret, monkeypatch):
    """[Note: combo part memo] in lowering/codegen/combo.py: a combo's parts of equal
    structure take the first one's tile and code, refs mapped, and the program is
    the one written part by part."""
    import lowering
    from lowering.codegen import combo
    from lowering.options import CompileOptions

    shapes = [(64,), (8, 8), (8, 8), (3, 5), (64,), (8, 8), (9, 33), (64,), (64,), (8, 8), (3, 5)]
    xs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    closed = jax.make_jaxpr(_update)(jax.ShapeDtypeStruct((), jnp.float32), xs, xs)
    opts = CompileOptions(interpret=interpret, triton_available=True, num_sms=132, loop_bodies=False,
                          kernel_backend="pallas" if interpret else "triton")
    written = []
    write = combo._write_part
    monkeypatch.setattr(combo, "_write_part", lambda *a: written.append(a[1]) or write(*a))
    result = lowering.compile_jaxpr(closed, opts)
    parts = sum(len(k.parts) for k in result.schedule.kernels if hasattr(k, "parts"))
    assert parts >= len(shapes) and len(written) <= parts - 3
    monkeypatch.setattr(combo, "_structure", lambda *a: None)
    assert lowering.compile_jaxpr(closed, opts).program.source == result.program.source


# --------------------------------------------------------------------------- #
# Function sources without the tokenizer
# --------------------------------------------------------------------------- #
def _gpu_program_source(fn, args) -> str:
    """``fn``'s program as a GPU renders it (raw Triton, sm_90's 132 SMs), written on the CPU."""
    import dataclasses

    import lowering
    from pallaskit.api import compile_options

    opts = dataclasses.replace(compile_options(), interpret=False, triton_available=True, num_sms=132,
                               kernel_backend="triton")
    return lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), opts).program.source


@pytest.mark.parametrize("name", ["gpt2_12layer_train", "llama_block_train", "resnet_block_train",
                                  "xent_take_along_axis", "adamw_clip_update"])
def test_source_blocks_are_what_inspect_reads(name):
    """[Note: function sources without the tokenizer]: each top-level function
    of a generated GPU program has, from the indentation scan, the lines
    inspect's tokenizer gives @triton.jit (or none, where a triple quote is)."""
    import ast
    import inspect

    from benchmarks import models
    from pallaskit.runtime import triton_compile

    spec = next(s for s in models.MODEL_SPECS if s["name"] == name)
    dtype = jnp.float32 if name.startswith("adamw") else jnp.bfloat16
    args = spec["make_inputs"](spec["sizes"]["smoke"], dtype, jax.random.key(0))
    source = _gpu_program_source(spec["jax_fn"], args)
    lines = source.splitlines(True)
    blocks = triton_compile.source_blocks(lines)
    starts = {min([n.lineno] + [d.lineno for d in n.decorator_list]): n.name
              for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    assert sum("@triton.jit" in line for line in lines) >= 2
    for start, name in starts.items():
        want = inspect.getblock(lines[start - 1:])
        if any('"""' in x or "'''" in x for x in want):
            assert start not in blocks
        else:
            assert blocks.get(start) == want, name
    assert set(blocks) <= set(starts)


def test_triton_reads_a_registered_modules_sources_and_inspects_the_rest():
    import inspect
    import linecache

    from pallaskit.runtime import triton_compile

    source = ("import math\n\n\n# kernel k: a comment before it\n@staticmethod\n@functools_like(\n    x=1)\n"
              "def k(a,\n      b):\n    c = a + b\n    # inside\n    return c\n    # trailing, indented\n"
              "# top-level comment\n\ndef g():\n    return 1\n\n\nZ = 3\n")
    filename = "<pallaskit-test-sources>"
    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace = {"staticmethod": lambda f: f, "functools_like": lambda **kw: (lambda f: f)}
    exec(compile(source, filename, "exec"), namespace)
    shim = triton_compile._Sources(inspect)
    triton_compile.register_sources(filename, lines)
    try:
        for fn in (namespace["k"], namespace["g"]):
            assert shim.getsourcelines(fn) == inspect.getsourcelines(fn)
            assert fn.__code__.co_firstlineno in triton_compile._blocks[filename]
        assert shim.getsourcelines(_gpu_program_source) == inspect.getsourcelines(_gpu_program_source)
    finally:
        triton_compile.forget_sources(filename)
    assert shim.signature(namespace["k"]) == inspect.signature(namespace["k"])
    assert shim.getsourcelines(namespace["k"]) == inspect.getsourcelines(namespace["k"])  # forgotten: inspect's


# --------------------------------------------------------------------------- #
# XLA's autotuning ahead
# --------------------------------------------------------------------------- #
def _gpu_schedule(fn, args):
    """``fn``'s schedule as a GPU's compile makes it (raw Triton, sm_90's 132 SMs), on the CPU."""
    import dataclasses

    import lowering
    from pallaskit.api import compile_options

    opts = dataclasses.replace(compile_options(), interpret=False, triton_available=True, num_sms=132,
                               kernel_backend="triton")
    return lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), opts).schedule


def _scores_and_conv(q, k, x, w, v):
    s = jnp.einsum("bqd,bkd->bqk", jnp.tanh(q), k)  # a batched dot: XLA's, on a kernel's output
    y = jax.lax.conv_general_dilated(jax.nn.relu(x), w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.softmax(s, axis=-1), y * 2, jnp.sort(v) * 3  # the sort: XLA's, no matmul near it


_SHAPES = [(2, 5, 8), (2, 7, 8), (2, 6, 6, 3), (3, 3, 3, 4), (9,)]


def test_autotuning_ahead_replays_the_programs_matmuls_and_convolutions(rng):
    """[Note: autotuning ahead]: the XLA part of a GPU program around its
    matmuls and convolutions, on parameters for what kernels make (tanh(q),
    relu(x)) and what the caller gives (k, w), computes what the program's
    externs compute and returns what the kernels read of it; the sort, with no
    matmul in its group, is left out; a program without a matmul has none."""
    from pallaskit.runtime import xla_warm

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in _SHAPES]
    fn, structs = xla_warm.extern_program(_gpu_schedule(_scores_and_conv, args))
    assert [s.shape for s in structs] == _SHAPES[:4]
    vals = [jnp.asarray(rng.standard_normal(s.shape), jnp.float32) for s in structs]
    scores, conv = jax.jit(fn)(*vals)
    assert_close(scores, jnp.einsum("bqd,bkd->bqk", vals[0], vals[1]))
    assert_close(conv, jax.lax.conv_general_dilated(vals[2], vals[3], (1, 1), "SAME",
                                                    dimension_numbers=("NHWC", "HWIO", "NHWC")))
    no_matmul = [jax.ShapeDtypeStruct((9,), jnp.float32), jax.ShapeDtypeStruct((5, 3), jnp.float32)]
    assert xla_warm.extern_program(_gpu_schedule(lambda v, x: (jnp.sort(v), jnp.cumsum(x, 0) + 1), no_matmul)) \
        is None


@pytest.mark.parametrize("aot", [False, True])
def test_autotuning_ahead_runs_before_xlas_compile_of_the_program(aot, rng, monkeypatch, tmp_path):
    """Where XLA autotunes (made true here on the CPU), a new program's XLA part
    compiles on a thread started after the passes, which the program's own XLA
    compile joins first, through a call and through ``lower().compile()``;
    values as jax.jit's. Off with the option."""
    from pallaskit import orchestrator
    from pallaskit.runtime import xla_warm

    monkeypatch.setattr(orchestrator, "_autotunes", lambda: True)
    started, joined = [], []
    start = xla_warm.start

    def recorded(schedule):
        thread = start(schedule)
        started.append(thread)
        join = thread.join
        thread.join = lambda *a: joined.append(thread) or join(*a)
        return thread

    monkeypatch.setattr(xla_warm, "start", recorded)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in _SHAPES]
    with pallaskit.config.override(cache_dir=str(tmp_path), kernel_backend="triton"):
        f = pallaskit.jit(_scores_and_conv)
        got = f.lower(*args).compile()(*args) if aot else f(*args)
        assert len(started) == 1 and joined == started and not started[0].is_alive()
        for g, w in zip(got, jax.jit(_scores_and_conv)(*args)):
            assert_close(g, w)
        with pallaskit.config.override(autotune_ahead=False):
            pallaskit.jit(lambda *a: _scores_and_conv(*a)[:2])(*args)
        assert len(started) == 1


def test_autotuning_ahead_leaves_a_call_under_a_thread_local_context(rng, monkeypatch, tmp_path, caplog):
    """A call under ``jax.enable_x64`` (thread-local in jax): the thread, which
    would trace another program (float32 for float64), compiles nothing."""
    import logging

    from pallaskit import orchestrator

    monkeypatch.setattr(orchestrator, "_autotunes", lambda: True)
    with jax.enable_x64(True):
        args = [jnp.asarray(rng.standard_normal(s), jnp.float64) for s in _SHAPES]
        with caplog.at_level(logging.DEBUG, logger="pallaskit"), pallaskit.config.override(cache_dir=str(tmp_path)):
            got = pallaskit.jit(_scores_and_conv)(*args)
            pallaskit.wait_compiles()
        for g, w in zip(got, jax.jit(_scores_and_conv)(*args)):
            assert g.dtype == w.dtype == jnp.float64
            assert_close(g, w)
    assert any("the call's jax context is thread-local" in r.getMessage() for r in caplog.records)
    assert not any("autotuned ahead in" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("n_other", [5, 7])
def test_autotuning_ahead_leaves_a_matmul_amid_other_xla_work(n_other):
    """A dot whose group is mostly other XLA work (a chain of sorts and
    cumulative sums feeding it) is left to the program's compile, which would
    otherwise compile that work twice; with fewer such ops, it is tuned ahead."""
    from pallaskit.runtime import xla_warm

    def f(x, k):
        for i in range(n_other):
            x = jnp.sort(x, axis=-1) if i % 2 == 0 else jnp.cumsum(x, axis=-1)
        return jnp.einsum("bqd,bkd->bqk", x, k)

    args = [jax.ShapeDtypeStruct((2, 5, 8), jnp.float32), jax.ShapeDtypeStruct((2, 7, 8), jnp.float32)]
    made = xla_warm.extern_program(_gpu_schedule(f, args))
    if n_other == 7:
        assert made is None
    else:
        fn, structs = made
        assert [s.shape for s in structs] == [(2, 5, 8), (2, 7, 8)]
        assert sum(e.primitive.name in ("sort", "cumsum") for e in jax.make_jaxpr(fn)(*structs).eqns) == n_other
