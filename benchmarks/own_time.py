"""pallaskit's own time in a cold first call, on the CPU with a GPU's options.

One workload per fresh process (``benchmarks.cold_breakdown``'s workloads, plus
``tiny``: ``tanh(x) * 2 + 1``), compiled as on a GPU: the raw-Triton renderer
(``kernel_backend='triton'``, ``interpret=False``, ``num_sms=132``), Triton's
compile left out (no compile workers; each raw-Triton launch lowers to a zero
constant per output on the CPU, no JAX trace of its own) and automatic-dynamic speculation off, so that what is
timed is pallaskit's host code and JAX's around it, not Triton or XLA:GPU.

Each phase is the calling thread's CPU time (``time.thread_time``: this
machine's other processes do not count), summed over its calls:
``trace`` (JAX's trace of the function), ``key`` (the graph cache's key: the
jaxpr's text), ``lower`` / ``schedule`` / ``render`` (the passes), ``load``
(executing the generated module: its Triton functions' definitions), ``jax_lower``
(JAX's trace and lowering of the generated program, ``load`` excluded),
``serialize`` (the executable for the cache), ``call`` (the whole first call).
``gc`` counts the cyclic collector's runs during the call and their wall time.

    PYTHONPATH=. python -m benchmarks.own_time adamw:1000 gpt2_adamw model:resnet_block_train tiny
    PYTHONPATH=. python -m benchmarks.own_time adamw:1000 --profile /tmp/own.prof  # cProfile, thread time
    PYTHONPATH=. python -m benchmarks.own_time adamw:1000 --dump /tmp/dump  # debug_dir: program.py, IR

The figures (this repository's CPU, before and after a change) are in
benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT = "RESULT "
PHASES = ("trace", "key", "lower", "schedule", "render", "load", "jax_lower", "serialize", "call")


def child(workload: str, profile: str, dump: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.interpreters import mlir

    import lowering
    import lowering.codegen.program
    import lowering.lower
    import lowering.scheduler
    import pallaskit
    from benchmarks.cold_breakdown import make
    from pallaskit import cache, executable, orchestrator
    from pallaskit.runtime import loader, triton_call, xla_args

    if workload == "tiny":
        x = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)

        def fn(x):
            return jnp.tanh(x) * 2 + 1

        def arrays():
            return [jnp.asarray(x)]
    else:
        fn, _, arrays = make(workload)
    args = arrays()
    jax.block_until_ready(args)

    # A GPU's options on the CPU, Triton left out.
    orchestrator._cuda_with_triton = lambda: True
    orchestrator.start_compile_workers = lambda options, count=None: None

    def launch(ctx, *args, **_):
        return [mlir.full_like_aval(ctx, 0, o) for o in ctx.avals_out]

    mlir.register_lowering(triton_call.triton_call_p, launch, platform="cpu")
    options = dict(cache_dir=tempfile.mkdtemp(prefix="pallaskit-own-"), interpret=False, kernel_backend="triton",
                   num_sms=132, automatic_dynamic_speculate=False)
    if dump:
        options["debug_dir"] = dump
    pallaskit.config.update(**options)

    totals: dict[str, float] = {}
    phase: list[str] = []

    def clock(module, name, key):
        inner = getattr(module, name)

        def timed(*a, **k):
            t = time.thread_time()
            phase.append(key)
            try:
                return inner(*a, **k)
            finally:
                phase.pop()
                totals[key] = totals.get(key, 0.0) + time.thread_time() - t
        setattr(module, name, timed)

    clock(orchestrator, "trace", "trace")
    clock(cache, "key_parts", "key")
    clock(lowering.lower, "lower", "lower")
    clock(lowering.scheduler, "schedule", "schedule")
    clock(lowering.codegen.program, "render", "render")
    clock(loader, "load", "load")
    clock(xla_args, "lower", "jax_lower")
    clock(executable, "serialize", "serialize")

    collections = {"runs": 0, "full": 0, "wall_s": 0.0}
    started = [0.0]

    def on_gc(stage, info):
        if stage == "start":
            started[0] = time.perf_counter()
            return
        collections["runs"] += 1
        collections["full"] += info["generation"] == 2
        collections["wall_s"] += time.perf_counter() - started[0]

    gc.callbacks.append(on_gc)
    jf = pallaskit.jit(fn)
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile(time.thread_time)
        prof.enable()
    t = time.thread_time()
    out = jf(*args)
    totals["call"] = time.thread_time() - t
    if prof is not None:
        prof.disable()
        prof.dump_stats(profile)
    gc.callbacks.remove(on_gc)
    jax.block_until_ready(out)
    totals["jax_lower"] = totals.get("jax_lower", 0.0) - totals.get("load", 0.0)  # load runs inside it
    row = {"workload": workload, **{f"{k}_s": round(v, 3) for k, v in totals.items()}}
    row["gc"] = {k: round(v, 3) for k, v in collections.items()}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", default=["adamw:1000", "gpt2_adamw", "model:resnet_block_train", "tiny"])
    ap.add_argument("--repeat", type=int, default=1, help="fresh processes per workload")
    ap.add_argument("--profile", default="", help="cProfile output (thread time) of one workload's call")
    ap.add_argument("--dump", default="", help="debug_dir: the generated program and the IR")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        os.environ["JAX_PLATFORMS"] = "cpu"
        print(RESULT + json.dumps(child(args.child, args.profile, args.dump)), flush=True)
        return 0
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    print("| workload | " + " | ".join(PHASES) + " | gc runs (full), wall s |")
    print("|---" * (len(PHASES) + 2) + "|")
    for w in args.workloads:
        for _ in range(args.repeat):
            cmd = [sys.executable, "-m", "benchmarks.own_time", "--child", w, "--profile", args.profile,
                   "--dump", args.dump and os.path.join(args.dump, w.replace(":", "_"))]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=repo)
            line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
            if line is None:
                print(f"| {w} | error: {proc.stderr.strip().splitlines()[-1:]} |")
                continue
            r = json.loads(line[len(RESULT):])
            cells = [f"{r.get(p + '_s', 0.0):.3f}" for p in PHASES]
            g = r["gc"]
            print(f"| {w} | " + " | ".join(cells) + f" | {g['runs']} ({g['full']}), {g['wall_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
