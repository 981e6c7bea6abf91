"""Multi-kernel variants of symbolic graphs (issue 4, part 3; [Note: multi-kernel]
in pallaskit/runtime/multikernel.py)."""
from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import pytest

import pallaskit
from pallaskit.runtime import multikernel
from conftest import assert_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (1, 7, 70, 300, 3000)


def _fn(x, w):
    # pointwise over (n, 4): BLOCK_R is min(next_pow2(rows), 256) at the hint,
    # so 64 and 4096 give different tiles (64 x 4 and 256 x 4).
    return jnp.tanh(x * 2.0 + w)


def _args(n, rng):
    return (jnp.asarray(rng.standard_normal((n, 4)), jnp.float32), jnp.asarray(rng.standard_normal((4,)), jnp.float32))


@pytest.fixture(autouse=True)
def _per_size(_fresh_state):
    """No eager launches: on a GPU they would serve new sizes before any
    variant (tests/test_triton_codegen.py)."""
    pallaskit.config.update(dynamic_launch="off")


# Tests that expect interpret mode's untimed choice (the nearest hint); compiled
# for a GPU (PALLASKIT_INTERPRET=0) the dispatcher times the variants instead.
untimed = pytest.mark.skipif(not pallaskit.api.compile_options().interpret,
                             reason="compiled for a GPU the dispatcher times the variants")


def _jit():
    return pallaskit.jit(_fn, dynamic={"x": {0: "n"}})


def _dispatcher(f, rng, n=5):
    entry = f.lower_to_result(*_args(n, rng))
    assert isinstance(entry.executable, multikernel.Dispatcher), type(entry.executable)
    return entry.executable


def _rows(tmp_path):
    with open(tmp_path / "multi_kernel_choices.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.mark.pallas_source
def test_variants_differ_and_each_matches_jax_for_every_size(rng):
    pallaskit.config.update(multi_kernel_hints="64,4096")
    d = _dispatcher(_jit(), rng)
    assert [v.hints for v in d.variants] == [[(("n", 64),)], [(("n", 4096),)]]
    assert "BLOCK_R, BLOCK_C = 64, 4" in d.variants[0].source
    assert "BLOCK_R, BLOCK_C = 256, 4" in d.variants[1].source
    for force in (0, 1):
        pallaskit.config.update(multi_kernel_force=force)
        f = _jit()
        for n in SIZES:
            args = _args(n, rng)
            assert_close(f(*args), jax.jit(_fn)(*args))
        d = f.lower_to_result(*args).executable
        assert set(d.chosen.values()) == {force} and set(d.methods.values()) == {"forced"}
        assert len(d.chosen) == len(SIZES)


@untimed
def test_cpu_chooses_the_nearest_hint_and_logs_a_metric_row(rng, tmp_path):
    pallaskit.config.update(multi_kernel_hints="64,4096", enabled_metric_tables="multi_kernel_choices",
                            metrics_dir=str(tmp_path))
    f = _jit()
    for n in (70, 3000, 70):
        args = _args(n, rng)
        assert_close(f(*args), jax.jit(_fn)(*args))
    d = f.lower_to_result(*args).executable
    assert d.chosen == {(70,): 0, (3000,): 1}
    assert d.methods == {(70,): "nearest_hint", (3000,): "nearest_hint"}
    rows = _rows(tmp_path)  # one row per new size: the second 70 is a dict hit
    assert [(r["kernel_name"], r["shape_key"], r["num_variants"], r["chosen_variant"], r["method"])
            for r in rows] == [("_fn", "n=70", "2", "0", "nearest_hint"), ("_fn", "n=3000", "2", "1", "nearest_hint")]
    assert pallaskit.metrics.counters["multi_kernel_choices"] == 2
    assert pallaskit.metrics.counters["graphs_compiled"] == 1


def test_nearest_is_by_log_distance():
    v = [multikernel.Variant([(("n", 64),)], None, [], "", []), multikernel.Variant([(("n", 4096),)], None, [], "", [])]
    assert multikernel.nearest(v, {"n": 511}) == 0  # log midpoint is 512; linear distance would pick 4096
    assert multikernel.nearest(v, {"n": 513}) == 1


def test_force_applies_to_every_size_and_out_of_range_is_an_error(rng):
    pallaskit.config.update(multi_kernel_hints="64,4096", multi_kernel_force=2)
    f = _jit()
    with pytest.raises(ValueError, match=r"multi_kernel_force=2.*2 multi-kernel variant\(s\)"):
        f(*_args(70, rng))
    with pytest.raises(ValueError, match="int >= -1"):
        pallaskit.config.update(multi_kernel_force=-2)


def test_gpu_path_times_the_variants_and_takes_the_fastest(rng, tmp_path):
    """The timing branch (GPU, not interpret) run on the CPU by flipping the
    dispatcher's mode: the measured timings decide, not the hint."""
    pallaskit.config.update(multi_kernel_hints="64,4096", enabled_metric_tables="multi_kernel_choices",
                            metrics_dir=str(tmp_path))
    f = _jit()
    d = _dispatcher(f, rng)
    args = _args(70, rng)
    timings = d._time(args)
    assert len(timings) == 2 and all(t > 0 for t in timings)
    d.interpret = False
    d._time = lambda leaves: [5.0, 1.0]  # the 4096 variant "faster" at 70 rows
    assert_close(f(*args), jax.jit(_fn)(*args))
    assert d.chosen == {(70,): 1} and d.methods == {(70,): "benchmark"}
    (row,) = _rows(tmp_path)
    assert row["method"] == "benchmark" and row["timings_ms"] == "5.0000;1.0000" and row["chosen_variant"] == "1"


def test_gpu_path_compiles_the_variants_at_once(rng):
    """The warm-up calls (each an XLA compile of a variant for the new size) run
    concurrently: every variant's first call waits at a barrier that only opens
    when all of them are in flight, so calls made one after another break it."""
    pallaskit.config.update(multi_kernel_hints="64,4096")
    d = _dispatcher(_jit(), rng)
    barrier = threading.Barrier(len(d.variants), timeout=10)
    first_calls = []

    def wrap(fn):
        def call(*args):
            if fn not in first_calls:
                first_calls.append(fn)
                barrier.wait()
            return fn(*args)
        return call

    for v in d.variants:
        v.fn = wrap(v.fn)
    timings = d._time(_args(70, rng))
    assert len(first_calls) == 2 and len(timings) == 2 and all(t > 0 for t in timings)


def test_identical_variants_are_merged(rng):
    # default hints 64,256,4096: (n, 4) pointwise tiles are 64 x 4 at 64 and 256 x 4 at both 256 and 4096
    d = _dispatcher(_jit(), rng)
    assert [v.hints for v in d.variants] == [[(("n", 64),)], [(("n", 256),), (("n", 4096),)]]
    assert pallaskit.metrics.counters["generated_kernel_count"] == 2
    # a softmax over 16 columns has the same tiles at every hint: one variant, no dispatcher
    soft = pallaskit.jit(lambda x: jax.nn.softmax(x, axis=-1), dynamic={0: {0: "n"}})
    x = jnp.asarray(rng.standard_normal((70, 16)), jnp.float32)
    entry = soft.lower_to_result(x)
    assert not isinstance(entry.executable, multikernel.Dispatcher)
    assert_close(soft(x), jax.nn.softmax(x, axis=-1))
    # and a static function never has one
    static = pallaskit.jit(_fn)
    args = _args(70, rng)
    assert_close(static(*args), _fn(*args))
    assert not isinstance(static.lower_to_result(*args).executable, multikernel.Dispatcher)


def test_kernels_compiled_counts_distinct_kernels_once(rng):
    f = _jit()
    for n in SIZES:
        f(*_args(n, rng))
    assert pallaskit.metrics.counters["kernels_compiled"] == 2  # 64 x 4 and 256 x 4 tiles
    assert pallaskit.metrics.counters["graphs_compiled"] == 1


_CHILD = textwrap.dedent("""
    import json, sys
    import jax.numpy as jnp, numpy as np
    import pallaskit
    pallaskit.config.update(multi_kernel_hints="64,4096")
    f = pallaskit.jit(lambda x, w: jnp.tanh(x * 2.0 + w), dynamic={"x": {0: "n"}})
    w = jnp.ones((4,), jnp.float32)
    for n in (70, 3000):
        np.asarray(f(jnp.ones((n, 4), jnp.float32), w))
    d = f.lower_to_result(jnp.ones((70, 4), jnp.float32), w).executable
    print(json.dumps({"path": d.path(), "chosen": {str(k[0]): v for k, v in d.chosen.items()},
                      "methods": {str(k[0]): v for k, v in d.methods.items()}}))
""")


def _child(cache_dir, **env):
    env = dict(os.environ, PALLASKIT_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu", PALLASKIT_INTERPRET="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_disk_choice_cache_is_read_back_by_a_new_process(tmp_path):
    first = _child(tmp_path)
    assert first["methods"] == {"70": "nearest_hint", "3000": "nearest_hint"}
    assert first["chosen"] == {"70": 0, "3000": 1}
    path = first["path"]
    assert os.path.dirname(path) == str(tmp_path / "multi_kernel")
    with open(path) as fh:
        data = json.load(fh)
    assert data["choices"] == {"n=70": 0, "n=3000": 1}
    # swap the stored choices: the second process must take them from disk
    data["choices"] = {"n=70": 1, "n=3000": 0}
    with open(path, "w") as fh:
        json.dump(data, fh)
    second = _child(tmp_path)
    assert second["path"] == path
    assert second["methods"] == {"70": "disk", "3000": "disk"}
    assert second["chosen"] == {"70": 1, "3000": 0}
    # the env var turns it off: chosen again, nothing read
    third = _child(tmp_path, PALLASKIT_MULTI_KERNEL_DISK_CACHE="0")
    assert third["methods"] == {"70": "nearest_hint", "3000": "nearest_hint"}


@untimed
@pytest.mark.parametrize("how", ["option", "env", "cache_off"])
def test_disk_cache_off_writes_nothing(how, rng, tmp_path, monkeypatch):
    pallaskit.config.update(cache_dir=str(tmp_path), multi_kernel_hints="64,4096")
    if how == "option":
        pallaskit.config.update(multi_kernel_disk_cache=False)
    elif how == "env":
        monkeypatch.setenv("PALLASKIT_MULTI_KERNEL_DISK_CACHE", "0")
    else:
        pallaskit.config.update(cache=False)
    f = _jit()
    for n in (70, 3000):
        f(*_args(n, rng))
    assert f.lower_to_result(*_args(70, rng)).executable.chosen == {(70,): 0, (3000,): 1}
    assert not os.path.exists(tmp_path / "multi_kernel")


@untimed
def test_disk_cache_on_writes_the_choices(rng, tmp_path):
    pallaskit.config.update(cache_dir=str(tmp_path), multi_kernel_hints="64,4096")
    f = _jit()
    f(*_args(70, rng))
    (name,) = os.listdir(tmp_path / "multi_kernel")
    with open(tmp_path / "multi_kernel" / name) as fh:
        assert json.load(fh)["choices"] == {"n=70": 0}
    pallaskit.cache.clear()
    assert os.listdir(tmp_path / "multi_kernel") == []


@untimed
@pytest.mark.parametrize("garbage", [b"{not json", b"\xff\xfe", b'{"format": 1, "choices": {"n=70": 9}}'])
def test_corrupt_choice_file_is_ignored_and_rewritten(garbage, rng, tmp_path, caplog):
    pallaskit.config.update(cache_dir=str(tmp_path), multi_kernel_hints="64,4096")
    f = _jit()
    d = _dispatcher(f, rng, n=70)
    os.makedirs(os.path.dirname(d.path()))
    with open(d.path(), "wb") as fh:
        fh.write(garbage)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        args = _args(70, rng)
        assert_close(f(*args), jax.jit(_fn)(*args))
    assert d.methods == {(70,): "nearest_hint"}
    assert sum("ignoring the multi-kernel choice file" in r.getMessage() for r in caplog.records) == 1
    with open(d.path()) as fh:
        assert json.load(fh)["choices"] == {"n=70": 0}


@pytest.mark.parametrize("bad", ["64,abc", "0", "64,-1", "1.5"])
def test_bad_hints_are_a_clear_error(bad, monkeypatch):
    with pytest.raises(ValueError, match=r"multi_kernel_hints.*comma-separated positive ints such as '64,256,4096'"):
        pallaskit.config.update(multi_kernel_hints=bad)
    monkeypatch.setenv("PALLASKIT_MULTI_KERNEL_HINTS", bad)
    with pytest.raises(ValueError, match="PALLASKIT_MULTI_KERNEL_HINTS"):
        pallaskit.config.snapshot()


def test_hints_are_normalized():
    pallaskit.config.update(multi_kernel_hints=" 4096, 64,64 ")
    assert pallaskit.config.multi_kernel_hints == "64,4096"
    pallaskit.config.update(multi_kernel_hints=(256, 64))
    assert pallaskit.config.multi_kernel_hints == "64,256"
    pallaskit.config.update(multi_kernel_hints="")
    assert pallaskit.config.multi_kernel_hints == ""


def test_empty_hints_keep_one_variant_at_the_first_call(rng):
    pallaskit.config.update(multi_kernel_hints="")
    f = _jit()
    entry = f.lower_to_result(*_args(70, rng))
    assert not isinstance(entry.executable, multikernel.Dispatcher)
    assert entry.result.size_hints == (("n", 70),)


@pytest.mark.pallas_source
def test_debug_dir_has_a_folder_per_variant(rng, tmp_path):
    pallaskit.config.update(multi_kernel_hints="64,4096", debug_dir=str(tmp_path))
    _jit()(*_args(70, rng))
    folders = sorted(os.listdir(tmp_path))
    assert folders == ["_fn_hint_n4096_000", "_fn_hint_n64_000"], folders
    assert "BLOCK_R, BLOCK_C = 64, 4" in (tmp_path / folders[1] / "program.py").read_text()
