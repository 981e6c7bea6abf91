"""Cold vs warm time to first result, in fresh processes: pallaskit's graph
cache beside JAX's persistent compilation cache, on the same functions.

    python -m benchmarks.compile_cache                       # sizes for the device JAX finds
    python -m benchmarks.compile_cache --size cpu --repeats 3 --output /tmp/cc.json

For each workload and backend, each repeat runs fresh processes on one empty
cache directory: "cold" (the cache is empty) and then ``--warm_runs`` "warm"
ones (the cold run filled it). One untimed process imports jax and pallaskit
first, so that the first timed one does not pay for reading them from disk. A child imports jax and pallaskit and makes its inputs first;
the clock covers only the first call, from calling the function to its
result being ready (tracing, cache lookup, compilation, the run). Before it,
``gc.freeze()`` moves the objects made so far out of the collector's reach, so
that a collection of the imports' garbage, pending at a point that depends on
import order, does not land in one backend's clock and not the other's.

- pallaskit: its own graph cache (``PALLASKIT_CACHE_DIR``); JAX's persistent
  cache off.
- xla: ``jax.jit`` with JAX's persistent compilation cache in that directory
  (``jax_compilation_cache_dir``, ``jax_persistent_cache_min_compile_time_secs=0``,
  ``jax_persistent_cache_min_entry_size_bytes=0``).

Each child also counts what was compiled during the first call: XLA compile
events (``/jax/core/compile/backend_compile_duration``; JAX records one around
its persistent-cache lookup too, so a jax.jit warm start shows 1 beside its
cache hit), Pallas Triton lowerings (``lower_jaxpr_to_triton_module`` calls) and
JAX persistent-cache hits; pallaskit children report their counters
(``kernels_compiled``, ``cache_hits``). A pallaskit warm start must show no
compile event, no Triton lowering and ``kernels_compiled`` 0 (else the run
exits 1). A digest of the outputs checks that a warm run returns exactly the
cold run's result. "overhead" is the first call minus the fastest of three
later calls.

Where a first call's time goes (the breakdown table, warm starts):

- trace: to a jaxpr. pallaskit: ``metrics.counters["trace_seconds"]``; jax.jit:
  the ``/jax/core/compile/jaxpr_trace_duration`` event.
- lower: jaxpr to StableHLO (jax.jit: ``jaxpr_to_mlir_module_duration``;
  pallaskit does not lower on a hit).
- key: pallaskit's ``cache_key_seconds`` (jaxpr text, constants, environment
  stamp); jax.jit: its compile event minus its cache retrieval (hashing the
  StableHLO module, compile options, versions).
- load: reading, checking and deserializing the entry. pallaskit:
  ``cache_read_seconds + cache_load_seconds``; jax.jit:
  ``/jax/compilation_cache/cache_retrieval_time_sec``.
- compile: a cold start's compiler and XLA (pallaskit: ``compile_seconds``
  minus the parts above; jax.jit: the compile event minus its retrieval).
- dispatch: the rest until the call returns (argument handling, the first
  dispatch of the loaded executable, unflattening the outputs).
- run: from the call returning to the result being ready: the first execution
  and its one-time set-up (on the GPU: loading kernels; with jaxlib newer than
  0.10.2, jaxlib assembles a Pallas kernel's PTX with ptxas at its first launch
  in each process). On the CPU, pallaskit's run is its interpret-mode kernels.
- process: from spawning the child to its first result: interpreter start,
  ``import jax`` (+ ``import pallaskit``), making the inputs, the first call.
  The jax.jit child does not import pallaskit.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RESULT = "RESULT "
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (shapes, dtype) per size preset; "gpu" are the suite's GPU sizes (benchmarks/workloads.py).
SIZES = {
    "rms_bwd": {"gpu": ((576000, 384), "bfloat16"), "cpu": ((1024, 384), "bfloat16")},
    "gelu_mlp": {"gpu": ((8192, 1024, 4096), "bfloat16"), "cpu": ((256, 256, 1024), "bfloat16")},
}
WORKLOADS = tuple(SIZES)
BACKENDS = ("pallaskit", "xla")


# --------------------------------------------------------------------------- #
# Workloads (module level: stable names, so the jaxpr text is the same in every process)
# --------------------------------------------------------------------------- #
def rms_forward(x, w):
    import jax
    import jax.numpy as jnp

    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


def rms_backward(x, w, dy):
    """(dx, dw) of RMSNorm, through jax.vjp of the forward."""
    import jax

    _, vjp = jax.vjp(rms_forward, x, w)
    return vjp(dy)


def gelu_mlp(x, w1, w2):
    import jax

    return jax.nn.gelu(x @ w1) @ w2


def _inputs(workload: str, size: str):
    import jax
    import jax.numpy as jnp

    shape, dtype = SIZES[workload][size]
    dtype = jnp.dtype(dtype)
    keys = jax.random.split(jax.random.key(0), 3)
    if workload == "rms_bwd":
        n, d = shape
        args = (jax.random.normal(keys[0], (n, d), dtype), 1 + 0.1 * jax.random.normal(keys[1], (d,), jnp.float32),
                jax.random.normal(keys[2], (n, d), dtype))
        return rms_backward, args
    m, d, h = shape
    args = (jax.random.normal(keys[0], (m, d), dtype), jax.random.normal(keys[1], (d, h), dtype) / d ** 0.5,
            jax.random.normal(keys[2], (h, d), dtype) / h ** 0.5)
    return gelu_mlp, args


# --------------------------------------------------------------------------- #
# Child: one first call in a fresh process
# --------------------------------------------------------------------------- #
# jax.monitoring events of a jax.jit first call -> breakdown phase
JAX_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
              "/jax/core/compile/backend_compile_duration": "backend_compile",
              "/jax/compilation_cache/cache_retrieval_time_sec": "load"}
PHASES = ("trace", "lower", "key", "load", "compile", "dispatch", "run")


def _prewarm(*args):
    """The workload's matmuls alone (``--prewarm_blas``), run before the clock
    starts so that loading cuBLAS is not part of the first call."""
    import jax.numpy as jnp

    if len(args) == 3 and args[1].ndim == 2 and args[2].ndim == 2 and args[1].shape[1] == args[2].shape[0]:
        return (args[0] @ args[1]) @ args[2]
    return jnp.zeros(())


def _enable_jax_cache(jax, cache_dir: str):
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def child(spec: dict) -> dict:
    t_start = time.perf_counter()
    import jax
    import numpy as np

    pallaskit = None
    if spec["backend"] == "pallaskit":
        import pallaskit
    # jax.jit's persistent cache is enabled after making the inputs, so that both
    # backends compile their inputs' random-number programs (the process column)
    # and only the function comes from a cache. JAX decides at its first
    # compilation whether there is a cache: reset_cache() makes it look again
    # (without it, the cache is enabled first and caches the inputs too).
    from jax.experimental.compilation_cache import compilation_cache

    reset = getattr(compilation_cache, "reset_cache", None)
    if spec["backend"] == "xla" and reset is None:
        _enable_jax_cache(jax, spec["cache_dir"])

    size = spec["size"]
    fn, args = _inputs(spec["workload"], size)
    jax.block_until_ready(args)
    if spec["backend"] == "xla" and reset is not None:
        _enable_jax_cache(jax, spec["cache_dir"])
        reset()
    if spec.get("prewarm_blas"):  # load the BLAS libraries first: what remains is the backend's own first call
        jax.block_until_ready(jax.jit(_prewarm)(*args))
    import_s = time.perf_counter() - t_start

    counts = {"backend_compiles": 0, "triton_lowerings": 0, "jax_cache_hits": 0}
    jax_seconds = dict.fromkeys(JAX_EVENTS.values(), 0.0)

    def on_duration(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            counts["backend_compiles"] += 1
        if event in JAX_EVENTS:
            jax_seconds[JAX_EVENTS[event]] += duration

    def on_event(event, **kwargs):
        if event == "/jax/compilation_cache/cache_hits":
            counts["jax_cache_hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        from jax._src.pallas.triton import lowering as triton_lowering

        original = triton_lowering.lower_jaxpr_to_triton_module

        def counting(*a, **k):
            counts["triton_lowerings"] += 1
            return original(*a, **k)

        triton_lowering.lower_jaxpr_to_triton_module = counting
    except Exception:  # noqa: BLE001 - no Triton lowering in this jaxlib: nothing to count
        pass

    run = pallaskit.jit(fn) if pallaskit else jax.jit(fn)
    if pallaskit:
        pallaskit.metrics.reset()
    # Imports leave a collection of the whole heap pending (~50 ms of jax's
    # objects on the 2-core CPU); where it lands is chance, and it landed in one
    # backend's first call and not the other's. Freezing the heap (no collection)
    # keeps the clock on the first call's own work, for both backends.
    gc.freeze()
    t0 = time.perf_counter()
    out = run(*args)
    returned_s = time.perf_counter() - t0
    jax.block_until_ready(out)
    first_call_s = time.perf_counter() - t0
    process_to_result_s = time.time() - spec["spawned_at"]
    compiled = dict(counts)  # what the first call compiled (the listeners keep counting)
    if pallaskit:
        c = dict(pallaskit.metrics.counters)
        if "trace_seconds" in c:
            phases = {"trace": c["trace_seconds"], "lower": 0.0, "key": c["cache_key_seconds"],
                      "load": c["cache_read_seconds"] + c["cache_load_seconds"]}
            phases["compile"] = max(0.0, c["compile_seconds"] - sum(phases.values())) if c["cache_misses"] else 0.0
        else:  # a pallaskit without the phase counters: only the whole compile path
            phases = {"compile": c["compile_seconds"]}
    else:
        c = {"kernels_compiled": 0, "cache_hits": 0, "cache_misses": 0}
        j = dict(jax_seconds)
        hit = compiled["jax_cache_hits"] > 0
        phases = {"trace": j["trace"], "lower": j["lower"], "key": j["backend_compile"] - j["load"] if hit else 0.0,
                  "load": j["load"] if hit else 0.0, "compile": 0.0 if hit else j["backend_compile"]}
    phases["dispatch"] = max(0.0, returned_s - sum(phases.values()))
    phases["run"] = first_call_s - returned_s
    phases = {k: phases.get(k) for k in PHASES}
    steady = []  # the same call once compiled: what the first call costs beyond it is compilation / loading
    for _ in range(3):
        t1 = time.perf_counter()
        jax.block_until_ready(run(*args))
        steady.append(time.perf_counter() - t1)

    digest = hashlib.sha256()
    sums = []
    for leaf in jax.tree_util.tree_leaves(out):
        a = np.asarray(leaf)
        digest.update(a.tobytes())
        sums.append(float(np.sum(a, dtype=np.float64)))
    return {"first_call_s": first_call_s, "steady_s": min(steady), "import_s": import_s,
            "process_to_result_s": process_to_result_s, "phases_s": phases, **compiled,
            "kernels_compiled": c["kernels_compiled"], "cache_hits": c["cache_hits"],
            "cache_misses": c["cache_misses"], "digest": digest.hexdigest()[:16], "sums": sums,
            "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform}


def spawn(spec: dict, timeout_s: float = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("JAX_COMPILATION_CACHE_DIR", "PALLASKIT_CACHE", "PALLASKIT_CACHE_DIR"):
        env.pop(var, None)
    if spec["backend"] == "pallaskit":
        env["PALLASKIT_CACHE_DIR"] = spec["cache_dir"]
    t0 = time.perf_counter()
    spec = spec | {"spawned_at": time.time()}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.compile_cache", "--child", json.dumps(spec)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {spec} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):]) | {"process_s": wall}


# --------------------------------------------------------------------------- #
# Parent
# --------------------------------------------------------------------------- #
def measure(workloads, backends, size: str, repeats: int, budget_s: float, partial: str = "",
            warm_runs: int = 1, prewarm_blas: bool = False) -> list[dict]:
    """All (cold, warm...) runs; each row is also written to ``partial`` (JSON
    lines) as it comes, so a run cut short keeps what it measured."""
    subprocess.run([sys.executable, "-c", "import jax, pallaskit; jax.devices()"], cwd=REPO, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
    rows, started = [], time.perf_counter()
    for r in range(repeats):
        for workload in workloads:
            for backend in backends:
                if r > 0 and time.perf_counter() - started > budget_s:
                    print(f"budget of {budget_s:.0f} s spent: skipping repeat {r + 1} of {workload}/{backend}",
                          flush=True)
                    continue
                with tempfile.TemporaryDirectory(prefix="compile-cache-bench-") as d:
                    spec = {"backend": backend, "workload": workload, "size": size, "cache_dir": d,
                            "prewarm_blas": prewarm_blas}
                    for state in ("cold",) + ("warm",) * warm_runs:
                        res = spawn(spec) | {"workload": workload, "backend": backend, "state": state, "repeat": r}
                        rows.append(res)
                        if partial:
                            with open(partial, "a") as f:
                                f.write(json.dumps(res) + "\n")
                        parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res["phases_s"].items() if v is not None)
                        print(f"{workload:9s} {backend:9s} {state}: first call {res['first_call_s'] * 1e3:9.1f} ms"
                              f" ({parts})"
                              f"  (process {res['process_s']:.1f} s; backend compiles {res['backend_compiles']}, "
                              f"triton lowerings {res['triton_lowerings']}, kernels_compiled "
                              f"{res['kernels_compiled']}, pallaskit cache hits {res['cache_hits']}, "
                              f"jax cache hits {res['jax_cache_hits']})", flush=True)
    return rows


def summarize(rows: list[dict]) -> tuple[str, list[str]]:
    """A markdown table (medians over repeats) and a list of problems found."""
    problems = []
    by = {}
    for row in rows:
        by.setdefault((row["workload"], row["backend"], row["state"]), []).append(row)
    for (workload, backend, state), group in by.items():
        if state != "warm":
            continue
        for w in group:
            cold = next(c for c in by[(workload, backend, "cold")] if c["repeat"] == w["repeat"])
            if w["digest"] != cold["digest"]:
                problems.append(f"{workload}/{backend}: warm result differs from cold")
            if backend == "pallaskit" and (w["kernels_compiled"] or w["backend_compiles"] or w["triton_lowerings"]):
                problems.append(f"{workload}/pallaskit: the warm run compiled something: {w}")
    lines = ["| workload | backend | cold first call (ms) | warm first call (ms) | warm / cold | "
             "steady call (ms) | cold / warm overhead (ms) | warm: XLA compile events, Triton lowerings, "
             "cache hits | cold / warm process (s) | cold / warm runs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    for workload in workloads:
        for backend in backends:
            cold, warm = by.get((workload, backend, "cold")), by.get((workload, backend, "warm"))
            if not cold or not warm:
                continue
            med = lambda g, k: statistics.median(r[k] for r in g)  # noqa: E731
            c_ms, w_ms = med(cold, "first_call_s") * 1e3, med(warm, "first_call_s") * 1e3
            label = "pallaskit (graph cache)" if backend == "pallaskit" else "jax.jit (persistent cache)"
            steady = med(cold + warm, "steady_s") * 1e3
            lines.append(f"| {workload} | {label} | {c_ms:.1f} | {w_ms:.1f} | {w_ms / c_ms:.1%} | {steady:.1f} | "
                         f"{c_ms - steady:.1f} / {w_ms - steady:.1f} | "
                         f"{warm[0]['backend_compiles']}, {warm[0]['triton_lowerings']}, "
                         f"{warm[0]['cache_hits'] if backend == 'pallaskit' else warm[0]['jax_cache_hits']} | "
                         f"{med(cold, 'process_s'):.2f} / {med(warm, 'process_s'):.2f} | {len(cold)} / {len(warm)} |")
    return "\n".join(lines) + "\n\n" + breakdown(rows), problems


def breakdown(rows: list[dict]) -> str:
    """Where the first call's time goes (medians of each part, so they need not
    add up exactly), beside the whole fresh process."""
    head = ("| workload | backend | start | first call (ms) | " + " | ".join(PHASES) + " | steady call (ms) | "
            "import + inputs (s) | process → first result (s) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    by = {}
    for row in rows:
        if "phases_s" in row:
            by.setdefault((row["workload"], row["backend"], row["state"]), []).append(row)

    def ms(group, phase):
        values = [r["phases_s"].get(phase) for r in group]
        return "–" if None in values else f"{statistics.median(values) * 1e3:.1f}"

    for (workload, backend, state), g in by.items():
        med = lambda k: statistics.median(r[k] for r in g)  # noqa: E731
        label = "pallaskit" if backend == "pallaskit" else "jax.jit"
        lines.append(f"| {workload} | {label} | {state} | {med('first_call_s') * 1e3:.1f} | "
                     + " | ".join(ms(g, p) for p in PHASES)
                     + f" | {med('steady_s') * 1e3:.1f} | {med('import_s'):.2f} | {med('process_to_result_s'):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated: {', '.join(WORKLOADS)}")
    parser.add_argument("--backends", default=",".join(BACKENDS), help=f"comma-separated: {', '.join(BACKENDS)}")
    parser.add_argument("--size", default="auto", choices=("auto", "cpu", "gpu"),
                        help="size preset; auto: gpu sizes when JAX's default backend is a GPU")
    parser.add_argument("--repeats", type=int, default=3, help="cold runs per workload and backend (median)")
    parser.add_argument("--warm_runs", type=int, default=1, help="warm runs after each cold one (median)")
    parser.add_argument("--prewarm_blas", action="store_true", help="run the workload's matmuls in each process "
                        "before the clock starts (separates loading cuBLAS from the rest of the first call)")
    parser.add_argument("--budget_s", type=float, default=1e9, help="start no new repeat after this many seconds")
    parser.add_argument("--output", default="", help="write the rows (JSON) and the table (.md beside it) here")
    parser.add_argument("--tables", nargs="+", metavar="JSON", help="print the tables of earlier --output files "
                        "or their .partial.jsonl (rows of several files together) and measure nothing")
    args = parser.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    if args.tables:
        rows = []
        for path in args.tables:
            with open(path) as f:
                if path.endswith(".jsonl"):  # the rows a run cut short had written
                    rows += [json.loads(line) for line in f if line.strip()]
                    continue
                data = json.load(f)
            print(data["info"])
            rows += data["rows"]
        table, problems = summarize(rows)
        print(table)
        for p in problems:
            print("PROBLEM:", p)
        return 1 if problems else 0
    for name, valid, given in (("workload", WORKLOADS, args.workloads), ("backend", BACKENDS, args.backends)):
        bad = [x for x in given.split(",") if x not in valid]
        if bad:
            parser.error(f"unknown {name}(s) {', '.join(bad)}; valid: {', '.join(valid)}")
    size = args.size
    if size == "auto":
        import jax

        size = "cpu" if jax.default_backend() == "cpu" else "gpu"
    partial = os.path.splitext(args.output)[0] + ".partial.jsonl" if args.output else ""
    if partial:
        os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
    rows = measure(args.workloads.split(","), args.backends.split(","), size, args.repeats, args.budget_s, partial,
                   args.warm_runs, args.prewarm_blas)
    table, problems = summarize(rows)
    import jax
    import jaxlib

    info = (f"device: {rows[0]['device']} ({rows[0]['platform']}), size preset {size}; jax {jax.__version__}, "
            f"jaxlib {jaxlib.__version__}; medians over fresh processes ({args.warm_runs} warm per cold)")
    print()
    print(info)
    print(table)
    for p in problems:
        print("PROBLEM:", p)
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump({"info": info, "rows": rows, "problems": problems}, f, indent=1)
        with open(os.path.splitext(args.output)[0] + ".md", "w") as f:
            f.write(info + "\n\n" + table + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
