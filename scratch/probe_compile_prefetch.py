"""First-call (compile) time of the norm mix kernels by prefetch depth, each in a
fresh process (the compile happens in XLA's Triton pipeline on the GPU).

PYTHONPATH=. python scratch/probe_compile_prefetch.py            (all)
PYTHONPATH=. python scratch/probe_compile_prefetch.py KIND DEPTH (one: rms|ln, prefetch depth)
"""
import os
import subprocess
import sys
import time


def one(kind, depth):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallaskit
    from benchmarks.workloads import layernorm_fwd_bwd, rmsnorm_bwd
    from lowering import heuristics

    heuristics.MIX_PREFETCH = int(depth)
    rng = np.random.default_rng(0)
    x, dy = (jnp.asarray(rng.standard_normal((576000, 384)), jnp.bfloat16) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(384), jnp.bfloat16)
    fn, args = (rmsnorm_bwd, (x, w, dy)) if kind == "rms" else (layernorm_fwd_bwd, (x, w, w, dy))
    jax.block_until_ready(jax.jit(lambda a: a + 1)(x))  # backend start-up outside the clock
    with pallaskit.config.override(cache=False):
        f = pallaskit.jit(fn)
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(20):
            out = f(*args)
        jax.block_until_ready(out)
        steady = (time.perf_counter() - t0) / 20
    print(f"{kind} prefetch={depth}: first call {first:.2f} s, compile_seconds "
          f"{pallaskit.metrics.counters['compile_seconds']:.2f}, steady {steady * 1e3:.3f} ms", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        one(*sys.argv[1:])
    else:
        for kind, depth in (("rms", 0), ("rms", 1), ("rms", 2), ("ln", 0), ("ln", 2), ("rms", 2)):
            p = subprocess.run([sys.executable, __file__, kind, str(depth)], capture_output=True, text=True,
                               env=dict(os.environ), timeout=120)
            print("\n".join(l for l in (p.stdout + p.stderr).splitlines() if "prefetch=" in l or "Error" in l))
