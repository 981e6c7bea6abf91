"""Time to first result, in a fresh process.

The suite runs ``python -m benchmarks.first_call '<json spec>'`` once per
(workload, backend, cache state) and reads the last line, ``RESULT {json}``.
The child imports everything and makes its inputs first, then starts the clock:
building the backend's callable, tracing, compiling and running every case in
turn until its result is on hand. What a cold and a warm start mean per backend
(``cache_setup``), with a folder that is empty for "cold" and holds what
the cold run wrote for "warm":

- jax.jit: JAX's persistent compilation cache (every executable is cached:
  no minimum compile time or size).
- pallaskit: its own on-disk graph cache (pallaskit/cache: generated source
  and serialized executables) and Triton's cache (raw Triton kernels of eager
  launches compile through Triton), JAX's persistent cache off; the child
  reports pallaskit's counters (a warm start compiles no kernel).
- torch.compile: Inductor's caches (FX graph, AOTAutograd, Triton kernels),
  TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR.

In the dynamic-shape sweep, pallaskit's and torch's caches (on by default)
also start from an empty folder, and JAX's persistent cache stays off.

These are the conventions of benchmarks/compile_cache.py (issue 5's own
cold / warm benchmark, pallaskit vs jax.jit, with repeats and compile counts);
this module puts the same measurement in the suite, beside torch.compile.

For a ``sweep`` the child then times each size in steady state (no new
compilation) and checks the first size's outputs against a float32 reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

RESULT = "RESULT "


def pallaskit_cache_env(cache_dir: str) -> dict:
    """Environment that points pallaskit's own on-disk graph cache (issue 5,
    pallaskit/cache) at ``cache_dir``; empty if this pallaskit has none."""
    import pallaskit

    if "cache_dir" not in pallaskit.config.snapshot():
        return {}
    return {"PALLASKIT_CACHE": "1", "PALLASKIT_CACHE_DIR": os.path.join(cache_dir, "pallaskit")}


def jax_cache_env(cache_dir: str) -> dict:
    """JAX's persistent compilation cache in ``cache_dir``, caching every executable."""
    return {"JAX_COMPILATION_CACHE_DIR": os.path.join(cache_dir, "jax"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def cache_setup(backend, cache_dir: str, persistent: bool) -> dict:
    """Environment for the child's caches. Caches that are on by default
    (torch's, pallaskit's) always get the fresh folder ``cache_dir``, so that
    nothing from an earlier run is found; JAX's persistent cache is turned on
    only when ``persistent`` (the cold / warm measurement)."""
    if backend.framework == "torch":
        return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
                "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton")}
    if backend.name.startswith("pallaskit"):
        # raw Triton kernels (eager launches) compile through Triton, which keeps
        # its own cache (kernels and its C helpers): a fresh one too
        triton = {"TRITON_CACHE_DIR": os.path.join(cache_dir, "triton")}
        env = pallaskit_cache_env(cache_dir)
        if env or not persistent:
            return {**env, **triton}
        return {**jax_cache_env(cache_dir), **triton}
    return jax_cache_env(cache_dir) if persistent else {}


def _pallaskit_env() -> dict:
    """The parent's pallaskit options (flags included) as PALLASKIT_* variables."""
    import pallaskit
    from pallaskit.config import OPTIONS

    return {f"PALLASKIT_{k.upper()}": str(v) for k, v in pallaskit.config.snapshot().items()
            if v != OPTIONS[k].default}


def spawn(spec: dict, ctx, timeout_s: float) -> dict:
    """Run one child; its RESULT dict, or {"error": ...}."""
    from benchmarks.backends import BACKENDS

    backend = BACKENDS[spec["backend"]]
    env = dict(os.environ)
    for var in ("JAX_COMPILATION_CACHE_DIR", "PALLASKIT_CACHE", "PALLASKIT_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                "TRITON_CACHE_DIR"):  # only the caches cache_setup names
        env.pop(var, None)
    env.update(_pallaskit_env())
    for var in ("PALLASKIT_CACHE", "PALLASKIT_CACHE_DIR"):
        env.pop(var, None)
    env.update(cache_setup(backend, spec["cache_dir"], spec["caches"]))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["JAX_PLATFORMS"] = "cpu" if ctx.platform == "cpu" else env.get("JAX_PLATFORMS", "")
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.first_call", json.dumps(spec)], env=env, cwd=repo,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def child(spec: dict) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    from benchmarks import hardware, timing
    from benchmarks.backends import BACKENDS, Context, Unavailable
    from benchmarks.check import agreement, reference, seed_of
    from benchmarks.workloads import WORKLOADS, SWEEP, bytes_moved, format_size

    for name in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                 "jax_persistent_cache_min_entry_size_bytes"):
        value = os.environ.get(name.upper())
        if value is not None:
            jax.config.update(name, value if name.endswith("dir") else float(value) if "secs" in name
                              else int(value))

    workload = WORKLOADS[spec["workload"]]
    backend = BACKENDS[spec["backend"]]
    dtype = jnp.dtype(spec["dtype"])
    size = tuple(tuple(f) if isinstance(f, list) else f for f in spec["size"])
    ctx = Context(platform=jax.default_backend(), allow_cpu_compile=spec.get("allow_cpu_compile", False))

    def key(label, i):
        k = jax.random.key(spec["seed"])
        for p in (workload.name, spec["dtype"], label, i):
            k = jax.random.fold_in(k, seed_of(p))
        return k

    cases = workload.cases(size)
    inputs = [workload.make_inputs(s, dtype, key(label, 0)) for label, s in cases]
    jax.block_until_ready(inputs)
    if backend.framework == "torch":
        from benchmarks.backends import import_torch, torch_device

        try:
            torch = import_torch()
            if torch_device(ctx) == "cuda":
                torch.zeros(1, device="cuda")
                torch.cuda.synchronize()
        except Unavailable as e:
            return {"unavailable": str(e)}

    if spec.get("state") == "warm_process":  # [Note: warm process] in benchmarks/workloads.py
        from benchmarks.workloads import PROCESS_WARMUP, warmup_size

        warm = PROCESS_WARMUP[workload.name]
        try:
            warm_runner = backend.runner(warm, ctx)
        except Unavailable as e:
            return {"unavailable": str(e)}
        wsize = warmup_size(cases[0][1])
        warm_runner.sync(warm_runner.call(warm_runner.prepare(warm.make_inputs(wsize, dtype, key("warm-up", 0)))))
        del warm_runner

    # -- the clock runs from here: build, trace, compile, run every case -------------
    first = []
    import time

    if backend.name.startswith("pallaskit"):
        import pallaskit

        pallaskit.metrics.reset()
    t0 = time.perf_counter()
    try:
        runner = backend.runner(workload, ctx)
    except Unavailable as e:
        return {"unavailable": str(e)}
    native = []
    outs = []
    for (label, s), inp in zip(cases, inputs):
        x = runner.prepare(inp)
        native.append(x)
        out = runner.call(x)
        runner.sync(out)
        first.append(time.perf_counter() - t0)
        if not outs:
            outs.append(out)
    total = first[-1]
    # -- clock stopped ---------------------------------------------------------------

    result = {"total_first_s": total, "cases": []}
    if backend.name.startswith("pallaskit"):  # what the first calls compiled (a warm cache: nothing)
        counters = pallaskit.metrics.counters
        result["note"] = ", ".join(f"{k} {counters[k]}" for k in ("kernels_compiled", "cache_hits")
                                   if k in counters)
    prev = 0.0
    for (label, s), inp, x, cum in zip(cases, inputs, native, first):
        case = {"label": label, "size": format_size(s), "runtime": s[0], "first_s": cum - prev, "cumulative_s": cum}
        prev = cum
        if spec.get("steady") and workload.kind == SWEEP:
            n = hardware.input_sets(bytes_moved(inp)) if ctx.on_gpu else 1
            if runner.settle is not None:  # e.g. pallaskit's background compile of a recurring size
                runner.settle(x)
            sets = [x] + [runner.prepare(workload.make_inputs(s, dtype, key(label, i))) for i in range(1, n)]
            t = timing.measure(lambda i: runner.call(sets[i % len(sets)]), runner.clock, rounds=spec["repeats"],
                               min_round_s=spec["min_round_s"], warmup=spec["warmup"])
            outputs = jax.eval_shape(workload.jax_fn, *inp)
            flops = workload.flops(s) if workload.flops else 0
            case.update(ms=t.ms, host_ms=t.host_ms, spread=t.spread, iters=t.iters,
                        floor_ms=hardware.floor_ms(bytes_moved(inp) + bytes_moved(outputs), flops, spec["dtype"]))
            del sets
        result["cases"].append(case)
    if spec.get("check"):
        err, why = agreement(runner.leaves(outs[0]), reference(workload, inputs[0]), spec["dtype"], workload.tol)
        result["rel_err"] = err
        if why:
            result["mismatch"] = why
    return result


def main():
    spec = json.loads(sys.argv[1])
    try:
        result = child(spec)
    except Exception as e:  # reported to the parent as a failed row
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"}
    print(RESULT + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
