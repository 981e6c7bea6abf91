"""The benchmark suite (benchmarks/): the smoke run writes every output, flags
are validated, and the agreement check stops a backend that computes the
wrong thing before it is timed."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import backends, check, hardware, report, suite
from benchmarks.workloads import WORKLOADS, parse_size

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=170):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PALLASKIT_")}, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_smoke_run_writes_every_output(tmp_path):
    """One workload of every kind but first_call (steady, Hint x Runtime, the sweep's fresh processes, which
    first_call's cold / warm processes share; `python -m benchmarks.run --smoke` runs that one too)."""
    out = tmp_path / "out"
    proc = _run("--smoke", f"--output={out}", "--workloads=add,matmul_hint_runtime,dynamic_mlp_sweep",
                "--sizes=matmul_hint_runtime=8:24x32x48,dynamic_mlp_sweep=5:9x32x64x32",
                "--backends=pallaskit,pallaskit_dynamic,xla,torch_eager,torch_compile")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("results.json", "results.csv", "results.md", "RESULTS.md"):
        assert (out / name).stat().st_size > 0, name
    for kind, png in report.PLOTS.items():
        assert kind == "first_call" or (out / "plots" / png).stat().st_size > 0, png

    data = json.loads((out / "results.json").read_text())
    rows = data["rows"]
    assert {r["kind"] for r in rows} == {"steady", "hint_runtime", "sweep"}
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    ok = {(r["workload"], r["backend"], r["case"], r["metric"]) for r in rows}
    for b in ("pallaskit", "xla"):
        assert ("add", b, "", "ms") in ok
        assert ("matmul_hint_runtime", b, "hint=static,M=24", "ms") in ok
        assert ("dynamic_mlp_sweep", b, "all sizes", "first_result_s") in ok
        assert ("dynamic_mlp_sweep", b, "all sizes", "steady_sum_ms") in ok
        assert ("dynamic_mlp_sweep", b, "all sizes, warm process", "first_result_s") in ok
    # pallaskit's dynamic hook (multi-kernel hints): hinted and multi rows
    assert ("matmul_hint_runtime", "pallaskit", "hint=8,M=24", "ms") in ok
    assert ("matmul_hint_runtime", "pallaskit", "hint=multi,M=24", "ms") in ok
    # the sweep through dynamic=, and only the sweep
    assert ("dynamic_mlp_sweep", "pallaskit_dynamic", "all sizes", "steady_sum_ms") in ok
    assert ("dynamic_mlp_sweep", "pallaskit_dynamic", "all sizes, warm process", "first_result_s") in ok
    # a sweep's warm process starts from empty caches too (not the cold run's)
    warm = [r for r in rows if r["case"] == "all sizes, warm process" and r["backend"].startswith("pallaskit")]
    assert warm and all("kernels_compiled" in r["note"] and "cache_hits 0" in r["note"] for r in warm), warm
    assert {r["workload"] for r in rows if r["backend"] == "pallaskit_dynamic"} == {"dynamic_mlp_sweep"}
    assert all(r["rel_err"] is not None for r in rows if r["kind"] == "steady")
    meta = data["meta"]
    assert meta["copy_bandwidth_tbs"] > 0 and meta["seed"] and meta["versions"]["jax"] == jax.__version__
    try:
        import torch
        del torch
    except ImportError:  # torch backends are skipped with a note, not a crash
        assert any(n.startswith("torch_eager: skipped: torch is not installed") for n in data["notes"])
    # torch.compile on the CPU is skipped unless asked for
    assert not any(r["backend"] == "torch_compile" for r in rows)

    md = (out / "RESULTS.md").read_text()
    assert md.count(report.BEGIN) == 1 and md.count(report.END) == 1
    assert "| add | bfloat16 | 33x100 |" in md and "plots/suite_hint_runtime.png" in md
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header == ",".join(report.COLUMNS)


def test_unknown_names_are_errors_listing_the_valid_ones():
    with pytest.raises(ValueError, match="valid workloads: add, pointwise_chain"):
        suite.resolve(["softmax", "sofmax"], list(WORKLOADS), "workload")
    with pytest.raises(ValueError, match="valid backends: .*torch_compile"):
        suite.resolve(["pallas"], list(backends.BACKENDS), "backend")
    assert suite.resolve(["xla", "all"], ["pallaskit", "xla"], "backend") == ["xla", "pallaskit"]
    with pytest.raises(ValueError, match="unknown size preset 'huge'"):
        suite.parse_sizes(["huge"])
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        suite.parse_sizes(["nope=3x4"])
    with pytest.raises(ValueError, match="bad size"):
        suite.parse_sizes(["add=3xfour"])
    assert suite.parse_sizes(["full", "softmax=64x128", "matmul_hint_runtime=8:16x32x32"]) == (
        "full", {"softmax": (64, 128), "matmul_hint_runtime": ((8, 16), 32, 32)})
    assert parse_size("64:256:4096x8192x8192") == ((64, 256, 4096), 8192, 8192)

    proc = _run("--smoke", "--workloads=add,nope", timeout=60)
    assert proc.returncode != 0
    assert "unknown workload 'nope'" in proc.stderr and "layernorm_fwd_bwd" in proc.stderr
    proc = _run("--smoke", "--backends=xla,jax", timeout=60)
    assert proc.returncode != 0 and "unknown backend 'jax'" in proc.stderr and "torch_eager" in proc.stderr


def _perturbing_backend(name, perturb):
    """xla, with outputs changed after the fact: what the agreement check must catch."""
    def build(backend, workload, hint, ctx):
        runner = backends.BACKENDS["xla"].runner(workload, ctx, hint)
        inner = runner.call
        return dataclasses.replace(runner, call=lambda inputs: jax.tree_util.tree_map(perturb, inner(inputs)))
    return backends.Backend(name, backends.JAX, "test only: perturbs outputs", build)


def _scale(x):
    return x * 1.05 if jnp.issubdtype(x.dtype, jnp.floating) else x


def _one_element(x):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return ~x if x.dtype == jnp.bool_ else x
    return x.at[(0,) * x.ndim].add(100.0)


def test_agreement_check_stops_a_wrong_backend(tmp_path, monkeypatch):
    monkeypatch.setitem(backends.BACKENDS, "scaled", _perturbing_backend("scaled", _scale))
    monkeypatch.setitem(backends.BACKENDS, "one_element", _perturbing_backend("one_element", _one_element))
    cfg = suite.SuiteConfig(workloads=["rmsnorm_fwd", "nhwc_layout"], backends=["xla", "scaled", "one_element"],
                            dtypes=["bfloat16", "float32"], size_preset="smoke", repeats=2, min_round_s=0.001,
                            warmup=1, output=str(tmp_path), plots=False, seed=7, progress=False)
    results = suite.run(cfg)
    rows = {(r["workload"], r["dtype"], r["backend"]): r for r in results["rows"]}
    assert len(rows) == 12
    for (workload, dtype, backend), r in rows.items():
        if backend == "xla":
            assert r["status"] == "ok" and r["value"] > 0 and r["rel_err"] < check.TOLERANCE[dtype]
        else:
            assert r["status"] == "mismatch" and r["value"] is None, (workload, dtype, backend)
    assert rows[("rmsnorm_fwd", "float32", "scaled")]["rel_err"] == pytest.approx(0.05, rel=0.01)
    assert any("MISMATCH, not timed" in n and "one_element" in n for n in results["notes"])
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["seed"] == 7


def test_agreement_tolerances():
    ref = [jnp.linspace(-1, 1, 1000, dtype=jnp.float32), jnp.arange(10) > 4]
    same = [ref[0].astype(jnp.bfloat16), ref[1]]
    assert check.agreement(same, ref, "bfloat16")[1] is None
    assert "relative error" in check.agreement(same, ref, "float32")[1]  # bf16 rounding is too much for float32
    assert "shape" in check.agreement([ref[0][:-1], ref[1]], ref, "float32")[1]
    assert "non-finite" in check.agreement([ref[0].at[3].set(jnp.nan), ref[1]], ref, "float32")[1]
    assert "booleans differ" in check.agreement([ref[0], ~ref[1]], ref, "float32")[1]
    assert "1 outputs, expected 2" in check.agreement(ref[:1], ref, "float32")[1]


def test_results_md_section_leaves_other_text_alone(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n## Training step (someone else's)\n\nnumbers\n")
    report.write_section(str(path), "## Suite\n\nfirst")
    path.write_text(path.read_text() + "\n## Cache (another section)\n\nmore numbers\n")
    report.write_section(str(path), "## Suite\n\nsecond")
    text = path.read_text()
    assert text.count(report.BEGIN) == 1 and "second" in text and "first" not in text
    assert text.startswith("# Results\n\n## Training step (someone else's)\n\nnumbers\n")
    assert text.rstrip().endswith("more numbers")


class _FakeClock:
    """Rounds take 1 ms a call, except the first batch of several calls,
    which takes 10 ms a call (an allocator growing its pool)."""

    def __init__(self):
        self.calls, self.batches = [], 0

    def round(self, run):
        before = len(self.calls)
        run()
        n = len(self.calls) - before
        self.batches += n > 1
        per = 10.0 if n > 1 and self.batches == 1 else 1.0
        return n * per, 0.0


def test_calibration_ignores_the_first_slow_batch():
    from benchmarks import timing
    clock = _FakeClock()
    t = timing.measure(clock.calls.append, clock, rounds=3, min_round_s=0.02, warmup=1)
    assert t.iters == 20 and t.ms == 1.0  # paced by the first batch: 5 calls a round


def test_floors_and_rotation():
    assert hardware.floor_ms(3.0e9) == pytest.approx(1.0)
    assert hardware.floor_ms(1e6, flops=989e9, dtype="bfloat16") == pytest.approx(1.0)
    assert hardware.input_sets(int(1e9)) == 1
    assert hardware.input_sets(int(20e6)) == 10  # 10 sets of 20 MB: 200 MB, 4x the 50 MB L2
    assert hardware.input_sets(1000) == hardware.MAX_INPUT_SETS
    # the floor of add at full size: 3 arrays of 576000x384 bf16 at 3.0 TB/s
    assert hardware.floor_ms(3 * 576000 * 384 * 2) == pytest.approx(0.4424, abs=1e-4)


def test_every_workload_has_a_torch_twin_and_smoke_size():
    for w in WORKLOADS.values():
        assert w.torch_fn is not None and "smoke" in w.sizes and "full" in w.sizes, w.name
        for _, size in w.cases(w.sizes["smoke"]):
            inputs = w.make_inputs(size, jnp.dtype("bfloat16"), jax.random.key(1))
            assert all(np.all(np.isfinite(np.asarray(x, np.float32))) for x in inputs)


def test_compile_time_smoke_writes_json_and_plot(tmp_path):
    """benchmarks/compile_time.py --smoke: every workload, both backends, a result each."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PALLASKIT_")}, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--smoke", f"--output={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "compile_time.json").read_text())["rows"]
    assert {r["workload"] for r in rows} == {"momentum", "adamw", "chain", "scan"}
    assert {r["backend"] for r in rows} == {"pallaskit", "jax.jit"}
    assert all(r["seconds"] > 0 and r["finite"] for r in rows), rows
    assert all(r["compiler_s"] > 0 for r in rows if r["backend"] == "pallaskit")
    assert (tmp_path / "compile_time.png").stat().st_size > 0


def test_cold_breakdown_runs_each_variant(tmp_path):
    """benchmarks/cold_breakdown.py on the CPU: each variant a row with its phases;
    members=2 caps every combo at two kernels."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PALLASKIT_")}, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.cold_breakdown", "--workloads=adamw:5",
                           "--variants=jax.jit,members=2", f"--output={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((tmp_path / "cold_breakdown.json").read_text())["rows"]}
    assert rows["jax.jit"]["xla_compile_s"] > 0 and rows["jax.jit"]["first_run_s"] >= 0
    capped = rows["members=2"]
    assert capped["combo_parts"] and max(capped["combo_parts"]) <= 2, capped
    assert capped["passes_s"] > 0 and capped["own_s"] >= capped["passes_s"] and capped["xla_compile_s"] > 0
