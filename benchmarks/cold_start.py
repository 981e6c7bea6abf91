"""Cold time of first calls and of new sizes, pallaskit against jax.jit, each
in a fresh process with empty caches (pallaskit's, Triton's; JAX's persistent
cache off).

Cases:

- ``small``: ``jnp.tanh(x) * 2 + 1`` on a (128, 256) float32: the first call
  (issue 24: at most 0.3 s of pallaskit's own time on top of jax.jit's);
- ``sweep``: benchmarks/workloads.py's ``gelu_mlp`` at the ``SWEEP_ROWS`` row
  counts (bf16 1024 x 4096 x 1024; ``--smoke``: small sizes) in turn, each
  size's first call (issue 26: all sizes at most 1.0 s under default options).

Rows: ``jax.jit``; ``pallaskit`` (default options: automatic dynamic on);
``pallaskit+pre``, the same with the compiler (lowering, sympy, triton)
imported before the clock, so that ``pallaskit`` minus it is the compiler's
import time; ``cpu`` is the process's CPU seconds over the same calls (all
threads; a loaded machine inflates wall seconds, not these); ``pallaskit dynamic=`` (sweep only: the row axis given);
``pallaskit nospeculate``: default options but ``automatic_dynamic_speculate``
off ([Note: dynamic speculation] in pallaskit/dynamic.py); ``... eager-threads``:
the same with eager kernels compiled on the compile threads themselves, not in
their compile workers ([Note: compile workers] in
pallaskit/runtime/triton_compile.py; kernels inside XLA still in workers). ``background``: the
wait, after the last call, for background work still running (a speculative
compile that the small function never uses: its cost), and the CPU seconds
with it (ptxas subprocesses not counted).

The child does what a script does: imports, defines its function
(``pallaskit.jit(fn)``, which starts importing the compiler on a thread:
[Note: compiler preload] in pallaskit/runtime/preload.py), builds its inputs
on the device; the clock starts then (``import_s`` and ``setup_s`` are
reported apart; ``first_result_s`` is from ``import jax`` to the first call's
result). ``pallaskit nopreload``: option ``preload_compiler`` off. Each pallaskit row also shows
where its time went, summed over the calls: ``trace`` (jax's trace of the
function), ``passes`` (``lowering.compile_jaxpr``; on a cold process it
includes importing the compiler), ``eager`` (building the eager program of a
symbolic graph), ``triton_sum`` / ``triton_max`` (each raw-Triton kernel's
compile, on threads: inside XLA and eager), ``xla`` (``executable.aot_compile``:
JAX's lowering, waiting for Triton, XLA's compile), ``symbolic`` (automatic
dynamic's whole symbolic compile: trace, passes, eager program), ``eager_call``
(the eager program's calls: its first waits for its kernels' compiles),
``triton_import`` (triton's import on a thread, ``triton_launch.warm_up``),
``eager_started`` (eager kernel compiles started in the call, finished or not:
a speculative compile's during size 1). The
sweep's first two sizes also print their own phases. Python bytecode is written
to a fresh ``PYTHONPYCACHEPREFIX`` by untimed smoke runs first (as an installed
package has it), unless ``--no-bytecode``.

    # GPU (about a minute on an H100)
    JAX_PLATFORMS=cuda PYTHONPATH=. python -m benchmarks.cold_start
    # CPU (interpret mode), a quick look
    PYTHONPATH=. python -m benchmarks.cold_start --smoke
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

RESULT = "RESULT "
ROWS = ("jax.jit", "pallaskit", "pallaskit nopreload", "pallaskit+pre", "pallaskit dynamic=", "pallaskit nospeculate",
        "pallaskit eager-threads")
SMOKE_ROWS, SMOKE_DIMS = (5, 17, 33, 64, 100), (32, 64, 32)


def _phases():
    """Wrap pallaskit's phases; returns the dict their seconds add up in."""
    import lowering
    from pallaskit import dynamic, executable, orchestrator

    totals: dict = {}
    lock = threading.Lock()
    kernels: list = []

    def wrap(module, name, key, per_kernel=False):
        inner = getattr(module, name)

        def timed(*a, **k):
            t = time.perf_counter()
            if key == "eager_started":
                with lock:
                    totals[key] = totals.get(key, 0) + 1
            try:
                return inner(*a, **k)
            finally:
                s = time.perf_counter() - t
                with lock:
                    if per_kernel:
                        kernels.append(s)
                    else:
                        totals[key] = totals.get(key, 0.0) + s
        setattr(module, name, timed)

    wrap(orchestrator, "trace", "trace")
    wrap(lowering, "compile_jaxpr", "passes")
    wrap(orchestrator, "_eager_program", "eager")
    wrap(executable, "aot_compile", "xla")
    wrap(dynamic, "_compile_symbolic", "symbolic")
    try:
        from pallaskit.runtime import eager, triton_call, triton_launch

        wrap(triton_call._Kernel, "_compile", "", per_kernel=True)
        wrap(triton_launch.TritonKernel, "_compile", "eager_started", per_kernel=True)
        wrap(eager.EagerProgram, "__call__", "eager_call")
        wrap(triton_launch, "_warm_up", "triton_import")
    except ImportError:  # no triton: no raw-Triton kernels to time
        pass

    def summary(since=None):
        """The phases' seconds so far; ``since``: a ``mark()`` to count from."""
        base, first = since or ({}, 0)
        out = {k: round(v - base.get(k, 0.0), 4) for k, v in totals.items() if v - base.get(k, 0.0) > 0}
        new = kernels[first:]
        if new:
            out.update(triton_n=len(new), triton_sum=round(sum(new), 4), triton_max=round(max(new), 4))
        return out

    summary.mark = lambda: (dict(totals), len(kernels))
    return summary


def child(spec: dict) -> dict:
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    row = spec["row"]
    if row != "jax.jit":
        import pallaskit
    import_s = time.perf_counter() - t0
    # As a script does: the functions are defined (decorated) first, then the inputs
    # built; pallaskit.jit starts importing the compiler there ([Note: compiler
    # preload] in pallaskit/runtime/preload.py), beside building the inputs.
    if spec["case"] == "small":
        fn = lambda x: jnp.tanh(x) * 2 + 1  # noqa: E731
    else:
        from benchmarks.workloads import SWEEP_ROWS, gelu_mlp

        fn = gelu_mlp
    summary = None
    if row == "jax.jit":
        f = jax.jit(fn)
    else:
        if row == "pallaskit nopreload":
            pallaskit.config.update(preload_compiler=False)
        if row == "pallaskit+pre":
            pallaskit.config.update(preload_compiler=False)
            import lowering.codegen.program  # noqa: F401  (the compiler and its imports, before the clock)
            import lowering.lower  # noqa: F401
            import sympy.tensor.tensor  # noqa: F401  (sympy imports it on its first addition)
            if not pallaskit.orchestrator.compile_options().interpret:
                import triton.compiler.compiler  # noqa: F401
        summary = _phases()
        if row.endswith("eager-threads"):  # eager kernels on the compile threads, as before the workers took them
            from pallaskit.runtime import triton_launch

            def on_thread(fn, signature, constexprs, options, target):
                return triton_launch._compile_uncached(triton_launch.ast_source(fn, signature, constexprs), target,
                                                       options)
            triton_launch._compile_cubin = on_thread
        f = pallaskit.jit(fn, dynamic={"x": {0: "m"}}) if row == "pallaskit dynamic=" else pallaskit.jit(fn)
    rng = np.random.default_rng(0)
    if spec["case"] == "small":
        calls = [(jnp.asarray(rng.standard_normal((128, 256)), jnp.float32),)]
        labels = ["128x256"]
    else:
        rows, (k, h, n) = (SMOKE_ROWS, SMOKE_DIMS) if spec["smoke"] else (SWEEP_ROWS, (1024, 4096, 1024))
        w1 = jnp.asarray(rng.standard_normal((k, h)) * k ** -0.5, jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((h, n)) * h ** -0.5, jnp.bfloat16)
        calls = [(jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16), w1, w2) for m in rows]
        labels = [str(m) for m in rows]
    jax.block_until_ready(calls)
    setup_s = time.perf_counter() - t0 - import_s
    per = []
    outs = []
    per_phases = []  # the first two calls' phases (size 1, and size 2: where automatic dynamic starts)
    start, cpu = time.perf_counter(), time.process_time()
    start_cpu = cpu
    for args in calls:
        mark = summary.mark() if summary is not None and len(per) < 2 else None
        t = time.perf_counter()
        outs.append(jax.block_until_ready(f(*args)))
        per.append(time.perf_counter() - t)
        if mark is not None:
            per_phases.append(summary(mark))
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    first_result_s = start + per[0] - t0  # from `import jax` to the first call's result
    background = 0.0
    if row != "jax.jit":  # work still running after the last call (a speculative compile, tier-up)
        t = time.perf_counter()
        pallaskit.wait_compiles()
        background = time.perf_counter() - t
    cpu_all = time.process_time() - start_cpu
    # Values: the first and last call against jax.jit (after the clock)
    ref = jax.jit(fn)
    err = max(float(jnp.max(jnp.abs(outs[i].astype(jnp.float32) - ref(*calls[i]).astype(jnp.float32))))
              for i in {0, len(calls) - 1})
    out = {"row": row, "case": spec["case"], "import_s": round(import_s, 3), "setup_s": round(setup_s, 3),
           "first_result_s": round(first_result_s, 3), "total_s": round(total, 3), "cpu_s": round(cpu, 3),
           "background_s": round(background, 3), "cpu_with_background_s": round(cpu_all, 3),
           "per_call_s": [round(p, 4) for p in per], "labels": labels, "max_abs_err_vs_jax": err,
           "device": jax.devices()[0].device_kind}
    if summary is not None:
        c = pallaskit.metrics.counters
        out["phases"] = summary()
        out["per_call_phases"] = per_phases
        out["counters"] = {k: c[k] for k in ("graphs_compiled", "kernels_compiled", "eager_launches",
                                             "dynamic_fallbacks") if c.get(k)}
    return out


def spawn(case: str, row: str, smoke: bool, pycache: str | None, timeout: float) -> dict:
    folder = tempfile.mkdtemp(prefix="pallaskit_cold_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PALLASKIT_CACHE", "JAX_COMPILATION_CACHE"))}
    env.update(PALLASKIT_CACHE_DIR=os.path.join(folder, "pallaskit"), TRITON_CACHE_DIR=os.path.join(folder, "triton"))
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if pycache:
        env["PYTHONPYCACHEPREFIX"] = pycache
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if row == "pallaskit nospeculate":
        env["PALLASKIT_AUTOMATIC_DYNAMIC_SPECULATE"] = "0"
    spec = {"case": case, "row": row, "smoke": smoke}
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.cold_start", "--child", json.dumps(spec)], env=env,
                              cwd=repo, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"row": row, "case": case, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-3:]
    return {"row": row, "case": case, "error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _warm_bytecode(pycache: str, timeout: float) -> None:
    """Untimed runs of the pallaskit rows at the smoke sizes: every module they
    import writes its bytecode to ``pycache``."""
    for case, row in (("small", "pallaskit"), ("sweep", "pallaskit"), ("sweep", "pallaskit dynamic=")):
        spawn(case, row, True, pycache, timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="small,sweep")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--smoke", action="store_true", help="small sweep sizes (the CPU)")
    p.add_argument("--no-bytecode", action="store_true", help="no .pyc written first (an image without bytecode)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--output", help="folder for cold_start.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(RESULT + json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    pycache = None if a.no_bytecode else tempfile.mkdtemp(prefix="pallaskit_pyc_")
    if pycache:
        _warm_bytecode(pycache, a.timeout)
    results = []
    for case in a.cases.split(","):
        for row in a.rows.split(","):
            if row == "pallaskit dynamic=" and case != "sweep":
                continue
            r = spawn(case, row, a.smoke, pycache, a.timeout)
            results.append(r)
            if "error" in r:
                print(f"{case:6s} {row:20s} ERROR {r['error']}", flush=True)
                continue
            first = r["per_call_s"][0]
            rest = sum(r["per_call_s"][1:])
            line = (f"{case:6s} {row:20s} total {r['total_s']:7.3f} s  first {first:6.3f}  rest {rest:6.3f}  "
                    f"cpu {r['cpu_s']:.2f}  import {r['import_s']:.2f}  setup {r['setup_s']:.2f}  "
                    f"to first result {r['first_result_s']:.2f}  err {r['max_abs_err_vs_jax']:.2g}")
            if r.get("background_s", 0) >= 0.001:  # after the last call, until the background work ended
                line += f"  background {r['background_s']:.3f} (cpu with it {r['cpu_with_background_s']:.2f})"
            if r.get("phases"):
                line += "  " + " ".join(f"{k} {v}" for k, v in r["phases"].items())
            print(line, flush=True)
            if case == "sweep":
                print("       per size: " + " ".join(f"{n}:{s:.3f}" for n, s in zip(r["labels"], r["per_call_s"])),
                      flush=True)
                for i, ph in enumerate(r.get("per_call_phases", [])):
                    print(f"       size {i + 1} ({r['labels'][i]}) phases: "
                          + " ".join(f"{k} {v}" for k, v in ph.items()), flush=True)
    if results:
        print("device:", next((r["device"] for r in results if "device" in r), "?"))
    if a.output:
        os.makedirs(a.output, exist_ok=True)
        with open(os.path.join(a.output, "cold_start.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
