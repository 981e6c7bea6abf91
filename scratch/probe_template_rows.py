"""GPU: where the matmul template stops beating XLA for the gelu MLP 1024->4096->1024
(bf16), pallaskit static with matmul_template on / off vs jax.jit, interleaved
rounds (median of 9 rounds of 50 calls each).

    PYTHONPATH=. python scratch/probe_template_rows.py [M ...]
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallaskit
from benchmarks.workloads import WORKLOADS

w = WORKLOADS["dynamic_mlp_sweep"]
rows = [int(a) for a in sys.argv[1:]] or [577, 1035, 1386, 1857, 2487, 3330, 4460]
for m in rows:
    args = w.make_inputs((m, 1024, 4096, 1024), jnp.bfloat16, jax.random.key(m))
    fns = {"xla": jax.jit(w.jax_fn)}
    for mode in ("on", "off"):
        with pallaskit.config.override(matmul_template=mode):
            f = pallaskit.jit(w.jax_fn)
            jax.block_until_ready(f(*args))
        fns[mode] = f
    times = {k: [] for k in fns}
    for _ in range(9):
        for k, f in fns.items():
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            for _ in range(50):
                r = f(*args)
            jax.block_until_ready(r)
            times[k].append(1e3 * (time.perf_counter() - t0) / 50)
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = 2 * m * (1024 * 4096 * 2)
    print(f"M={m:5d} " + " ".join(f"{k} {v:.4f}" for k, v in med.items())
          + f" | on/xla {med['on'] / med['xla']:.2f} | xla {flops / med['xla'] / 1e9:.0f} TFLOP/s")
