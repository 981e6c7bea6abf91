"""The on-disk graph cache: warm starts compile nothing, bad entries are
recompiled, racing processes leave one entry, keys cover versions and options,
eviction keeps the cap."""
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering
import pallaskit
from pallaskit import cache, executable, orchestrator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh process: RMSNorm backward through jax.vjp (pytrees, a custom-jvp free
# but non-trivial jaxpr), run once; prints its counters and the compiler-side
# modules it imported (HEAVY_MODULES), saves its outputs.
HEAVY_MODULES = ("sympy", "networkx", "lowering.lower", "lowering.scheduler", "lowering.codegen.pallas",
                 "lowering.partition", "jax.extend", "jax.experimental.pallas")
_CHILD = textwrap.dedent("""
    import json, os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    import pallaskit

    def rms(x, w):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
        return (y * w).astype(x.dtype)

    def rms_bwd(x, w, g):
        return jax.vjp(rms, x, w)[1](g)

    rng = np.random.default_rng(0)
    x, g = (jnp.asarray(rng.standard_normal((37, 100)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((100,)), jnp.float32)
    dx, dw = pallaskit.jit(rms_bwd)(x, w, g)
    np.save(sys.argv[1], np.concatenate([np.asarray(dx).ravel(), np.asarray(dw)]))
    heavy = [m for m in %r if m in sys.modules]
    from pallaskit.runtime import preload
    print(json.dumps(dict(pallaskit.metrics.counters, heavy_modules=heavy, preload=preload.started())))
""" % (HEAVY_MODULES,))


def _spawn(cache_dir, out):
    # A CPU child: kernel_backend 'auto' (Pallas's interpreter), not a GPU run's 'triton'
    # (TEST_DISABLE_PALLAS_TRITON), whose interpreter host callbacks no executable can serialize.
    env = dict(os.environ, PALLASKIT_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu", PALLASKIT_INTERPRET="auto",
               PALLASKIT_KERNEL_BACKEND="auto", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(out)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc):
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _entries(cache_dir):
    cache.wait_written()  # [Note: entries written behind the call]
    folder = os.path.join(cache_dir, "graphs")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def test_warm_start_in_a_fresh_process_compiles_nothing(tmp_path):
    cold = _finish(_spawn(tmp_path, tmp_path / "cold.npy"))
    assert cold["cache_misses"] == 1 and cold["cache_hits"] == 0 and cold["kernels_compiled"] >= 1
    assert "sympy" in cold["heavy_modules"]  # the child does see a compilation's imports
    assert cold["preload"]  # a function never run: the compiler imported on a thread ([Note: compiler preload])
    warm = _finish(_spawn(tmp_path, tmp_path / "warm.npy"))
    assert warm["kernels_compiled"] == 0 and warm["cache_hits"] == 1 and warm["cache_misses"] == 0
    # A hit imports neither the compiler nor Pallas, and a function the cache holds (its
    # marker, [Note: function markers]) starts no preload: jax.extend is the preload's import.
    assert not warm["preload"] and warm["heavy_modules"] == []
    # the code statistics are replayed from the entry
    for name in pallaskit.metrics.COMPILE_DELTA_NAMES:
        assert warm[name] == cold[name], name
    np.testing.assert_array_equal(np.load(tmp_path / "warm.npy"), np.load(tmp_path / "cold.npy"))


def test_four_processes_compiling_at_once_leave_one_valid_entry(tmp_path):
    procs = [_spawn(tmp_path, tmp_path / f"out{i}.npy") for i in range(4)]
    results = [_finish(p) for p in procs]
    assert sum(r["cache_misses"] for r in results) == 1  # the others waited on the lock, then hit
    assert sum(r["cache_hits"] for r in results) == 3
    (name,) = _entries(tmp_path)  # one entry, no temporary files left behind
    with open(os.path.join(tmp_path, "graphs", name), "rb") as f:
        entry = cache.decode(f.read(), name.removesuffix(cache.SUFFIX))
    assert entry.executable is not None
    outs = [np.load(tmp_path / f"out{i}.npy") for i in range(4)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


# --------------------------------------------------------------------------- #
# In-process: a new JitFunction has an empty in-memory cache, so it goes to disk.
# --------------------------------------------------------------------------- #
def _fn(a, b):
    return jnp.exp(a).sum(-1) * b


def _args(rng, rows=5):
    return (jnp.asarray(rng.standard_normal((rows, 7)), jnp.float32),
            jnp.asarray(rng.standard_normal((rows,)), jnp.float32))


def _run(fn, *args):
    return np.asarray(pallaskit.jit(fn)(*args))


def _only_entry(tmp_path):
    (name,) = _entries(tmp_path)
    return os.path.join(tmp_path, "graphs", name)


@pytest.mark.no_speculation
def test_the_entry_is_written_behind_the_call_under_its_lock(tmp_path, rng, monkeypatch):
    """[Note: entries written behind the call]: the first call returns while its
    executable is still being serialized; the key's lock stays held (another
    process would wait, then hit) until the entry is on disk; then a new jit of
    the function hits it. A program of fewer arguments writes it in the call."""
    import threading

    import filelock

    cache.wait_written()  # an earlier test's entry
    pallaskit.config.update(cache_dir=str(tmp_path))
    go, serializing = threading.Event(), threading.Event()
    real = executable.serialize

    def slow(compiled):
        serializing.set()
        assert go.wait(60)
        return real(compiled)

    monkeypatch.setattr(executable, "serialize", slow)
    monkeypatch.setattr(orchestrator, "WRITE_BEHIND_MIN_ARGS", 2)  # a wide program's path; _fn takes two
    args = _args(rng)
    expected = _run(_fn, *args)  # returns with the serialization blocked
    assert serializing.wait(60)
    assert not os.path.isdir(os.path.join(tmp_path, "graphs")) or not os.listdir(os.path.join(tmp_path, "graphs"))
    (key,) = cache._pending
    with pytest.raises(filelock.Timeout):
        cache._lock(key[:2], timeout=0).acquire()
    pallaskit.config.update(cache_dir=str(tmp_path / "elsewhere"))  # the entry goes where the call was made
    go.set()
    cache.wait_written(key)
    pallaskit.config.update(cache_dir=str(tmp_path))
    assert len(_entries(tmp_path)) == 1 and not cache._pending
    with cache._lock(key[:2], timeout=0):  # released by the writer
        pass
    pallaskit.metrics.reset()
    np.testing.assert_array_equal(_run(_fn, *args), expected)
    assert pallaskit.metrics.counters["cache_hits"] == 1
    monkeypatch.setattr(orchestrator, "WRITE_BEHIND_MIN_ARGS", 3)
    _run(_fn, *_args(rng, rows=6))  # two arguments: written before the call returns
    assert not cache._pending and len(os.listdir(os.path.join(tmp_path, "graphs"))) == 2


@pytest.mark.no_speculation
def test_hit_skips_the_compiler_and_replays_metrics(tmp_path, rng, monkeypatch):
    pallaskit.config.update(cache_dir=str(tmp_path))
    args = _args(rng)
    cold = _run(_fn, *args)
    counters = dict(pallaskit.metrics.counters)
    assert counters["cache_misses"] == 1 and counters["kernels_compiled"] == 1

    def no_compiler(*a, **k):
        raise AssertionError("the compiler ran on a cache hit")

    monkeypatch.setattr(lowering, "compile_jaxpr", no_compiler)
    pallaskit.metrics.reset()
    jf = pallaskit.jit(_fn)
    warm = np.asarray(jf(*args))
    np.testing.assert_array_equal(warm, cold)
    c = pallaskit.metrics.counters
    assert c["cache_hits"] == 1 and c["kernels_compiled"] == 0 and c["cache_misses"] == 0
    assert c["generated_kernel_count"] == counters["generated_kernel_count"]
    assert c["bytes_accessed"] == counters["bytes_accessed"] > 0
    assert c["compile_seconds"] > 0
    monkeypatch.undo()
    e = pallaskit.explain(jf, *args)  # served from disk, yet explain runs the compiler for it
    assert len(e.kernels) == 1


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def _flip(path):
    data = bytearray(_read(path))
    data[-10] ^= 0xFF
    return bytes(data)


def _other_format(path):
    data = _read(path)
    end = data.index(b"\n", len(cache.MAGIC))
    header = json.loads(data[len(cache.MAGIC):end])
    header["format"] = cache.FORMAT + 1
    return cache.MAGIC + json.dumps(header).encode() + data[end:]


@pytest.mark.parametrize("damage,reason", [
    (_flip, "checksum mismatch"),
    (lambda p: _read(p)[:-100], "truncated"),
    (lambda p: _read(p)[:30], "truncated header"),
    (lambda p: b"", "empty file"),
    (_other_format, "entry format"),
], ids=["flipped-byte", "truncated", "truncated-header", "empty", "other-format"])
def test_bad_entry_is_recompiled_and_overwritten(tmp_path, rng, caplog, damage, reason):
    pallaskit.config.update(cache_dir=str(tmp_path))
    args = _args(rng)
    expected = _run(_fn, *args)
    path = _only_entry(tmp_path)
    bad = damage(path)
    with open(path, "wb") as f:
        f.write(bad)
    pallaskit.metrics.reset()
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        np.testing.assert_array_equal(_run(_fn, *args), expected)
    assert [r for r in caplog.records if reason in r.getMessage()], caplog.text
    c = pallaskit.metrics.counters
    assert c["cache_misses"] == 1 and c["cache_hits"] == 0 and c["kernels_compiled"] == 1
    cache.wait_written()
    with open(path, "rb") as f:  # rewritten, valid
        assert cache.decode(f.read(), os.path.basename(path).removesuffix(cache.SUFFIX)).executable
    pallaskit.metrics.reset()
    np.testing.assert_array_equal(_run(_fn, *args), expected)
    assert pallaskit.metrics.counters["cache_hits"] == 1


def test_version_option_and_constant_changes_miss(tmp_path, rng, monkeypatch):
    pallaskit.config.update(cache_dir=str(tmp_path))
    args = _args(rng)
    _run(_fn, *args)
    with pallaskit.config.override(num_warps=2):  # a compile option
        _run(_fn, *args)
    versions = dict(cache.versions(), jax="0.0.0")
    monkeypatch.setattr(cache, "versions", lambda: versions)
    _run(_fn, *args)
    monkeypatch.undo()
    assert pallaskit.metrics.counters["cache_misses"] == 3 and len(_entries(tmp_path)) == 3
    _run(_fn, *args)
    assert pallaskit.metrics.counters["cache_hits"] == 1
    # same jaxpr text, different closed-over constants: never the other's result
    x = jnp.asarray(rng.standard_normal((3,)), jnp.float32)
    for c in (np.array([1.0, 2.0, 3.0], np.float32), np.array([4.0, 5.0, 6.0], np.float32)):
        np.testing.assert_allclose(_run(lambda a, c=c: a * c, x), np.asarray(x) * c, rtol=1e-6)
        # ... also where a nested jit holds them (its closed jaxpr's constants, not the program's)
        inner = jax.jit(lambda a, c=c: a * c)
        np.testing.assert_allclose(_run(lambda a: inner(a) + 1.0, x), np.asarray(x) * c + 1.0, rtol=1e-6)
    for seed in (0, 1):  # a closed-over typed key is a constant with no NumPy form (a crash before)
        key = jax.random.key(seed, impl="rbg" if seed else None)
        noisy = lambda a: jax.random.normal(key, a.shape) + a  # noqa: E731
        np.testing.assert_allclose(_run(noisy, x), jax.jit(noisy)(x), rtol=1e-6, atol=1e-6)
        hits = pallaskit.metrics.counters["cache_hits"]  # written to disk with it (its key data and impl), read back
        np.testing.assert_allclose(_run(noisy, x), jax.jit(noisy)(x), rtol=1e-6, atol=1e-6)
        assert pallaskit.metrics.counters["cache_hits"] == hits + 1


def test_jaxpr_key_text_tells_programs_apart():
    """[Note: the jaxpr's key text]: a function traced again has the same text;
    programs that differ in a parameter, a literal (its sign, a NaN's sign and
    payload, a non-scalar one's values), which variable an equation reads, a binder's type
    or a nested jaxpr have different texts, as jax's own printer tells them apart
    and beyond it (it writes ``[...]`` for every non-scalar literal)."""
    x = jax.ShapeDtypeStruct((4, 3), jnp.float32)

    def text(f, *args):
        return cache.jaxpr_text(jax.make_jaxpr(f)(*(args or (x,))))

    scan = lambda a, k: jax.lax.scan(lambda c, r: (c * k + r, c), a[0], a)[0]  # noqa: E731
    programs = [
        lambda a: jnp.sum(a, 0), lambda a: jnp.sum(a, 1),  # a parameter
        lambda a: a * 2.0, lambda a: a * -2.0, lambda a: a * 0.0, lambda a: a * -0.0,  # literal values, signs
        lambda a: a + np.nan, lambda a: a + -np.nan,  # a NaN's sign (repr writes both as nan)
        lambda a: a + np.float32(np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]),  # its payload
        lambda a: jnp.sin(a) + jnp.cos(a), lambda a: jnp.sin(a) + jnp.sin(a),  # which variable is read
        lambda a: a.astype(jnp.bfloat16), lambda a: a.astype(jnp.float16),  # a binder's type
        lambda a: scan(a, 2.0), lambda a: scan(a, 3.0),  # a nested jaxpr
        lambda a: jax.jit(jnp.tanh)(a) + jax.jit(jnp.tanh)(a),  # one nested jaxpr read twice
    ]
    texts = [text(f) for f in programs]
    assert len(set(texts)) == len(texts)
    assert [text(f) for f in programs] == texts
    literal = jax.make_jaxpr(lambda a: a)(x)  # a non-scalar literal: jax writes its values as [...]
    eqn = jax.make_jaxpr(lambda a: a + 1.0)(x).jaxpr.eqns[0]
    lit = [type(eqn.invars[1])(np.full((4, 3), v, np.float32), eqn.invars[0].aval) for v in (1.0, 2.0)]
    with_lits = [literal.replace(jaxpr=literal.jaxpr.replace(
        eqns=[eqn.replace(invars=[literal.jaxpr.invars[0], v])], outvars=eqn.outvars)) for v in lit]
    assert str(with_lits[0]) == str(with_lits[1]) and cache.jaxpr_text(with_lits[0]) != cache.jaxpr_text(with_lits[1])


def test_jax_context_that_the_jaxpr_text_hides_is_in_the_key(tmp_path):
    """``jax.threefry_partitionable(False)`` changes random bits, yet the jaxpr's
    text is the same (the flag sits in each equation's context): a hit on the
    entry compiled outside it returned the partitionable bits."""
    pallaskit.config.update(cache_dir=str(tmp_path))

    def bits(k):
        return jax.random.uniform(k, (5, 3))

    key = jax.random.key(7)
    for partitionable in (True, False):
        with jax.threefry_partitionable(partitionable):
            np.testing.assert_array_equal(np.asarray(pallaskit.jit(bits)(key)), np.asarray(jax.jit(bits)(key)))
    assert pallaskit.metrics.counters["cache_misses"] == 2


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_devices_of_a_mesh_in_another_order_are_in_the_key(tmp_path):
    """Meshes and shardings print their axes and specs, not their devices: a
    ``with_sharding_constraint`` or ``out_shardings`` over the same devices in
    another order had one key, and the second process was served the first
    one's executable (XLA's runtime aborted: "PjRtBuffer's memory space is
    addressed by device cpu:0 vs sharding is on device cpu:7")."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    pallaskit.config.update(cache_dir=str(tmp_path))
    x = np.arange(16, dtype=np.float32)

    def ids(a):
        return [d.id for d in a.sharding._device_assignment]

    for order in (1, -1, 1):
        sharding = NamedSharding(Mesh(np.array(jax.devices()[:8][::order]), ("d",)), P("d"))

        def constrained(a):
            return jax.lax.with_sharding_constraint(a * 2, sharding) + 1

        def double(a):
            return a * 2

        for fn, kw in ((constrained, {}), (double, {"out_shardings": sharding})):
            got, want = pallaskit.jit(fn, **kw)(x), jax.jit(fn, **kw)(x)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert ids(got) == ids(want)
    c = pallaskit.metrics.counters
    assert c["cache_misses"] == 4 and c["cache_hits"] == 2


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_partition_specs_under_set_mesh_name_its_devices(tmp_path):
    """Under ``jax.set_mesh`` a PartitionSpec (in ``out_shardings``, in
    ``with_sharding_constraint``) names the concrete mesh's devices, which no
    trace-context option holds: a hit deserialized the 8-device executable on
    the default device alone (XLA aborted: "sharding's tile count and device
    count does not match"), a mesh over the same devices in another order had
    the first one's key (an abort too), and one pallaskit function called under
    both meshes ran the first mesh's program (outputs on the wrong devices)."""
    from jax.sharding import Mesh, PartitionSpec as P

    pallaskit.config.update(cache_dir=str(tmp_path))
    x = np.arange(16, dtype=np.float32)

    def double(a):
        return a * 2 + 1

    def constrained(a):
        return jax.lax.with_sharding_constraint(a, P("d")) * 2

    same = pallaskit.jit(double, out_shardings=P("d"))
    for order in (1, -1, 1):
        with jax.set_mesh(Mesh(np.array(jax.devices()[:8][::order]), ("d",))):
            for fn, kw in ((double, {"out_shardings": P("d")}), (constrained, {})):
                for got in (pallaskit.jit(fn, **kw)(x), same(x) if fn is double else None):
                    if got is None:
                        continue
                    want = jax.jit(fn, **kw)(x)
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
                    assert [d.id for d in got.sharding._device_assignment] == \
                        [d.id for d in want.sharding._device_assignment]
    assert pallaskit.metrics.counters["cache_hits"] >= 2


def test_command_buffers_are_a_gpu_compiler_option_in_the_key(tmp_path, rng, monkeypatch):
    """[Note: command buffers]: GPU executables get xla_gpu_graph_min_graph_size=1
    unless the option is off; the CPU gets nothing; the options are in the key."""
    assert executable.compiler_options("gpu") == executable.GRAPH_OPTIONS == {"xla_gpu_graph_min_graph_size": 1}
    assert executable.compiler_options("cpu") == {}
    with pallaskit.config.override(command_buffers=False):
        assert executable.compiler_options("gpu") == {}
    pallaskit.config.update(cache_dir=str(tmp_path))
    args = _args(rng)
    for options in ({}, executable.GRAPH_OPTIONS):  # XLA's CPU compiler takes (and ignores) the GPU option
        monkeypatch.setattr(executable, "compiler_options", lambda platform=None, options=options: dict(options))
        _run(_fn, *args)
    assert pallaskit.metrics.counters["cache_misses"] == 2 and len(_entries(tmp_path)) == 2


def _command_buffer_cases(rng):
    """A static, a staged, a differentiated and a dynamic call of one function,
    each against jax.jit: JAX takes compiler options on a top-level jit only, so
    the nested ones must go without."""
    def f(x, w):
        return jnp.tanh(x @ w) * 2.0

    x = jnp.asarray(rng.standard_normal((64, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
    g = pallaskit.jit(f)
    dyn = pallaskit.jit(f, dynamic={0: (0,)})
    loss = lambda fn: lambda x, w: fn(x, w).sum()  # noqa: E731
    with jax.default_matmul_precision("highest"):
        pairs = [(g(x, w), jax.jit(f)(x, w)),
                 (jax.jit(lambda a, b: g(a, b) + 1.0)(x, w), jax.jit(f)(x, w) + 1.0),
                 (jax.grad(loss(g), argnums=1)(x, w), jax.grad(loss(f), argnums=1)(x, w)),
                 (jax.jit(jax.grad(loss(g)))(x, w), jax.grad(loss(f))(x, w))]
        for rows in (5, 37, 64):  # three sizes of the dynamic axis
            pairs.append((dyn(x[:rows], w), jax.jit(f)(x[:rows], w)))
            pairs.append((jax.jit(lambda a, b: dyn(a, b) - 1.0)(x[:rows], w), jax.jit(f)(x[:rows], w) - 1.0))
        pallaskit.wait_compiles()
    for got, want in pairs:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-4)


def test_compiler_options_stay_off_nested_jits(rng, monkeypatch):
    monkeypatch.setattr(executable, "compiler_options", lambda platform=None: dict(executable.GRAPH_OPTIONS))
    _command_buffer_cases(rng)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU only: XLA's command buffers")
def test_command_buffers_on_the_gpu(rng):
    assert executable.compiler_options() == executable.GRAPH_OPTIONS
    _command_buffer_cases(rng)


@pytest.mark.no_speculation
def test_eviction_keeps_the_cap_least_recently_used_first(tmp_path, rng):
    pallaskit.config.update(cache_dir=str(tmp_path))
    names = {}
    for rows in (11, 12, 13):
        before = set(_entries(tmp_path))
        _run(_fn, *_args(rng, rows=rows))
        (names[rows],) = set(_entries(tmp_path)) - before
    sizes = [os.path.getsize(os.path.join(tmp_path, "graphs", n)) for n in names.values()]
    cap = sum(sizes) + max(sizes) // 2  # room for three entries, not four
    pallaskit.config.update(cache_max_bytes=cap)
    _run(_fn, *_args(rng, rows=11))  # a hit: rows=11 becomes the most recently used
    assert pallaskit.metrics.counters["cache_hits"] == 1
    _run(_fn, *_args(rng, rows=14))
    left = _entries(tmp_path)
    assert sum(os.path.getsize(os.path.join(tmp_path, "graphs", n)) for n in left) <= cap
    assert len(left) == 3 and names[12] not in left and {names[11], names[13]} <= set(left)


def test_eviction_caps_eager_programs_and_compiled_kernels_in_one_pool(tmp_path):
    """cache_max_bytes covers eager/ and triton_kernels/ with the graph entries,
    least recently used first; reading a file through read_checked (a hit) makes it
    the most recently used."""
    pallaskit.config.update(cache_dir=str(tmp_path))
    paths = {}
    for i, (folder, name) in enumerate([("graphs", "a" * 64 + cache.SUFFIX), ("eager", "b" * 64 + ".json"),
                                        ("triton_kernels", "c" * 64 + ".kernel"), ("eager", "d" * 64 + ".json")]):
        os.makedirs(tmp_path / folder, exist_ok=True)
        paths[name[0]] = str(tmp_path / folder / name)
        cache._write_atomic(paths[name[0]], cache.pack_checked(1, bytes(1000)))
        os.utime(paths[name[0]], (1e9 + i, 1e9 + i))  # a (oldest), b, c, d (newest)
    size = os.path.getsize(paths["a"])
    assert cache.read_checked(paths["b"], 1) is not None  # b becomes the most recently used
    assert cache.evict(max_bytes=2 * size) == 2
    assert {k for k, p in paths.items() if os.path.exists(p)} == {"b", "d"}
    assert cache.evict(max_bytes=0) == 2 and not any(os.path.exists(p) for p in paths.values())


def test_eviction_skips_what_it_cannot_delete_and_never_fails_the_call(tmp_path, rng):
    """A file eviction cannot delete (another user's, in a shared cache; here a
    folder named like an eager program) raised out of ``store`` into the
    user's call (IsADirectoryError / PermissionError from ``os.unlink``): it is
    skipped, and the files after it are evicted."""
    pallaskit.config.update(cache_dir=str(tmp_path))
    stuck = tmp_path / "eager" / ("e" * 64 + ".json")
    stuck.mkdir(parents=True)
    os.utime(stuck, (1e9, 1e9))  # the least recently used
    old = tmp_path / "eager" / ("f" * 64 + ".json")
    old.write_bytes(bytes(1000))
    os.utime(old, (1e9 + 1, 1e9 + 1))
    pallaskit.config.update(cache_max_bytes=1)
    args = _args(rng)
    np.testing.assert_allclose(_run(_fn, *args), np.asarray(jax.jit(_fn)(*args)), rtol=1e-6)
    assert stuck.is_dir() and not old.exists()


@pytest.mark.pallas_source
def test_unserializable_executable_caches_the_source(tmp_path, rng, monkeypatch, caplog):
    pallaskit.config.update(cache_dir=str(tmp_path))
    monkeypatch.setattr(executable, "serialize", lambda compiled: (None, None, None, "ValueError: not today"))
    args = _args(rng)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        expected = _run(_fn, *args)
        cache.wait_written()  # the writer thread logs it ([Note: entries written behind the call])
    assert "caching its source only" in caplog.text
    with open(_only_entry(tmp_path), "rb") as f:
        entry = cache.decode(f.read())
    assert entry.executable is None and "not today" in entry.executable_error and "pallas_call" in entry.source
    pallaskit.metrics.reset()
    np.testing.assert_array_equal(_run(_fn, *args), expected)
    c = pallaskit.metrics.counters
    assert c["cache_hits"] == 1 and c["kernels_compiled"] == 1  # the source was compiled again, not generated


def test_cache_off_writes_nothing(tmp_path, rng):
    pallaskit.config.update(cache_dir=str(tmp_path), cache=False)
    args = _args(rng)
    np.testing.assert_allclose(_run(_fn, *args), np.asarray(jax.jit(_fn)(*args)), rtol=1e-5)
    assert not os.path.exists(os.path.join(tmp_path, "graphs"))
    c = pallaskit.metrics.counters
    assert c["cache_hits"] == c["cache_misses"] == 0 and c["kernels_compiled"] == 1


def test_stats_and_clear_commands(tmp_path, rng, capsys):
    from pallaskit.cache.__main__ import main

    pallaskit.config.update(cache_dir=str(tmp_path))
    _run(_fn, *_args(rng))
    assert main(["stats"]) == 0
    assert "entries:          1 (1 with executable" in capsys.readouterr().out
    assert main(["clear", "--dir", str(tmp_path)]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert _entries(tmp_path) == []
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    for command in ("stats", "clear"):  # one line, not a traceback
        assert main([command, "--dir", str(not_a_folder)]) == 1
        assert "Not a directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# The environment part of the key (sources, distributions) and its stamp
# --------------------------------------------------------------------------- #
@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A stand-in source tree for the hash (so a test can edit "pallaskit's
    sources"), with the per-process environment forgotten before and after."""
    root = tmp_path / "src"
    for rel, text in {"pallaskit/a.py": "A = 1\n", "lowering/b.py": "B = 2\n", "lowering/rules/c.py": "C = 3\n",
                      "lowering/__pycache__/b.cpython-311.pyc": "ignored", "lowering/notes.txt": "ignored"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setattr(cache, "_PACKAGE_ROOT", str(root))
    cache.environment.cache_clear()
    yield root
    cache.environment.cache_clear()


def _stamps(cache_dir):
    folder = os.path.join(cache_dir, "env")
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def _edit_keeping_size_and_mtime(path, text):
    """What an mtime-preserving copy (cp -p, rsync -a, tar) can do: new
    content, same size, same mtime. Only ctime (and maybe the inode) tell."""
    st = os.stat(path)
    assert len(text) == st.st_size
    with open(path, "w") as f:
        f.write(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_environment_stamp_is_used_and_checked(tmp_path, sources, monkeypatch):
    pallaskit.config.update(cache_dir=str(tmp_path))
    monkeypatch.setattr(cache, "RACY_S", 0.0)  # the files were written just now
    env = cache.environment()
    assert [rel for rel, _ in cache._source_files()] == ["lowering/b.py", "lowering/rules/c.py", "pallaskit/a.py"]
    (stamp,) = _stamps(tmp_path)
    cache.environment.cache_clear()  # a new process, same files: the stamp answers, nothing is read
    with monkeypatch.context() as m:
        m.setattr(cache, "_content_hash", lambda files: pytest.fail("hashed the sources despite a stamp"))
        m.setattr(cache, "_dist_versions", lambda: pytest.fail("asked importlib despite a stamp"))
        assert cache.environment() == env
    # a damaged stamp is not believed
    path = os.path.join(tmp_path, "env", stamp)
    damaged = json.loads(_read(path))
    damaged["code"] = "0" * 64
    with open(path, "w") as f:
        json.dump(damaged, f)
    cache.environment.cache_clear()
    assert cache.environment()["code"] == env["code"]
    assert json.loads(_read(path)) == {k: v for k, v in env.items() if k != "sources"}  # and rewritten


def _install(folder, name, version):
    """A distribution as pip leaves it: <name>-<version>.dist-info/METADATA."""
    for old in folder.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_distribution_versions_are_watched_where_installed(tmp_path, sources, monkeypatch):
    """A tracked distribution outside site-packages (pip install --target into a
    PYTHONPATH directory) is watched through its own directory."""
    pallaskit.config.update(cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    target = tmp_path / "target"
    _install(target, "pallaskit_fake_plugin", "1.0")
    monkeypatch.setattr(sys, "path", sys.path + [str(target)])
    monkeypatch.setattr(cache, "_DISTRIBUTIONS", ("pallaskit_fake_plugin", "pallaskit_not_installed"))
    env = cache.environment()
    assert env["versions"] == {"pallaskit_fake_plugin": "1.0"} and str(target) in env["dist_dirs"]
    assert len(_stamps(tmp_path / "cache")) == 1
    cache.environment.cache_clear()
    assert cache.environment()["versions"] == {"pallaskit_fake_plugin": "1.0"}  # from the stamp
    _install(target, "pallaskit_fake_plugin", "2.0")  # an upgrade: the directory changes, the stamp is stale
    cache.environment.cache_clear()
    assert cache.environment()["versions"] == {"pallaskit_fake_plugin": "2.0"}
    assert cache.versions()["pallaskit_fake_plugin"] == "2.0"


def test_no_stamp_for_files_changed_within_racy_window(tmp_path, sources):
    pallaskit.config.update(cache_dir=str(tmp_path))
    assert cache.RACY_S > 0
    env = cache.environment()  # the files are seconds old: hashed, not stamped
    assert _stamps(tmp_path) == [] and len(env["code"]) == 64


def test_edited_source_changes_the_key_even_with_size_and_mtime_kept(tmp_path, sources, monkeypatch):
    pallaskit.config.update(cache_dir=str(tmp_path))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    before = cache.environment()
    cache.environment.cache_clear()
    _edit_keeping_size_and_mtime(sources / "lowering" / "b.py", "B = 3\n")
    after = cache.environment()
    assert after["sig"] != before["sig"] and after["code"] != before["code"]
    assert len(_stamps(tmp_path)) == 2
    # a source file added or removed changes the hash too
    cache.environment.cache_clear()
    (sources / "lowering" / "d.py").write_text("")
    assert cache.environment()["code"] not in (before["code"], after["code"])


def test_changed_compiler_source_misses_in_a_new_process(tmp_path, rng, sources, monkeypatch):
    """The stamp can never serve an entry compiled by other sources."""
    pallaskit.config.update(cache_dir=str(tmp_path))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    args = _args(rng)
    expected = _run(_fn, *args)
    cache.environment.cache_clear()  # a new process, same sources: a hit
    np.testing.assert_array_equal(_run(_fn, *args), expected)
    assert pallaskit.metrics.counters["cache_hits"] == 1
    _edit_keeping_size_and_mtime(sources / "pallaskit" / "a.py", "A = 2\n")
    cache.environment.cache_clear()  # a new process after the edit: a miss, a second entry
    np.testing.assert_array_equal(_run(_fn, *args), expected)
    c = pallaskit.metrics.counters
    assert c["cache_misses"] == 2 and c["cache_hits"] == 1 and len(_entries(tmp_path)) == 2


def test_sources_changed_during_the_process_are_not_cached(tmp_path, rng, sources, monkeypatch, caplog):
    """The key holds the hash made at this process's first key; a compiler
    imported (lazily) after an edit must not write under it."""
    pallaskit.config.update(cache_dir=str(tmp_path))
    monkeypatch.setattr(orchestrator, "_sources_changed", [])
    cache.environment()
    (sources / "lowering" / "b.py").write_text("B = 22\n")
    args = _args(rng)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        np.testing.assert_allclose(_run(_fn, *args), np.asarray(jax.jit(_fn)(*args)), rtol=1e-5)
        _run(_fn, *_args(rng, rows=6))
    assert _entries(tmp_path) == [] and pallaskit.metrics.counters["cache_misses"] == 2
    assert caplog.text.count("sources changed while this process ran") == 1


def test_sys_path_changed_during_the_process_still_caches(tmp_path, rng, sources, monkeypatch):
    """Only the sources decide whether this process may still write entries."""
    pallaskit.config.update(cache_dir=str(tmp_path))
    cache.environment()
    monkeypatch.setattr(sys, "path", sys.path + [str(tmp_path)])
    _run(_fn, *_args(rng))
    assert len(_entries(tmp_path)) == 1


def test_clear_and_eviction_remove_environment_stamps(tmp_path, sources, monkeypatch):
    pallaskit.config.update(cache_dir=str(tmp_path))
    monkeypatch.setattr(cache, "RACY_S", 0.0)
    cache.environment()
    old = os.path.join(tmp_path, "env", "0" * 64 + ".json")
    with open(old, "w") as f:
        f.write("{}")
    month_ago = time.time() - cache.STAMP_MAX_AGE_S - 60
    os.utime(old, (month_ago, month_ago))
    assert len(_stamps(tmp_path)) == 2
    cache.evict()
    assert len(_stamps(tmp_path)) == 1  # the old one went, the current one stays
    cache.clear()
    assert _stamps(tmp_path) == []
