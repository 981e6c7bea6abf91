"""Repro: the gelu MLP sweep through dynamic= with size buckets (dynamic_buckets=True),
each configuration in a fresh process (a CUDA fault poisons the process).

PYTHONPATH=. python scratch/repro_buckets.py                (all configurations)
PYTHONPATH=. python scratch/repro_buckets.py HINTS FORCE    (one: multi_kernel_hints, multi_kernel_force)
"""
import os
import subprocess
import sys
import time

CONFIGS = [("256", "-1"), ("64,256,4096", "-1"), ("64,256,4096", "0"), ("64,256,4096", "2")]


def one(hints, force):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallaskit
    from benchmarks.workloads import SWEEP_ROWS, gelu_mlp

    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.standard_normal((1024, 4096)) * 1024 ** -0.5, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((4096, 1024)) * 4096 ** -0.5, jnp.bfloat16)
    with pallaskit.config.override(dynamic_buckets=True, multi_kernel_hints=hints, multi_kernel_force=int(force),
                                   cache=False):
        f = pallaskit.jit(gelu_mlp, dynamic={0: (0,)})
        ref = jax.jit(gelu_mlp)
        for m in SWEEP_ROWS:
            x = jnp.asarray(rng.standard_normal((m, 1024)), jnp.bfloat16)
            t0 = time.perf_counter()
            out = jax.block_until_ready(f(x, w1, w2))
            dt = time.perf_counter() - t0
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref(x, w1, w2).astype(jnp.float32))))
            print(f"hints={hints} force={force} m={m} {dt * 1e3:.0f} ms max_err={err:.3g}", flush=True)
    print("counters", {k: v for k, v in pallaskit.metrics.counters.items() if "bucket" in k or "multi" in k})


if __name__ == "__main__":
    if len(sys.argv) == 3:
        one(*sys.argv[1:])
    else:
        for hints, force in CONFIGS:
            p = subprocess.run([sys.executable, __file__, hints, force], capture_output=True, text=True,
                               env=dict(os.environ), timeout=200)
            lines = [l for l in (p.stdout + p.stderr).splitlines() if "eprecat" not in l]
            print(f"== hints={hints} force={force}: rc {p.returncode}")
            print("\n".join(lines[-8:]), flush=True)
