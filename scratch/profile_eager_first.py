"""GPU: where the first call of a dynamic gelu MLP (eager launches) spends its time.

    PYTHONPATH=. python scratch/profile_eager_first.py
"""
import cProfile
import pstats
import time

t0 = time.perf_counter()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallaskit  # noqa: E402
from benchmarks.workloads import WORKLOADS  # noqa: E402

w = WORKLOADS["dynamic_mlp_sweep"]
args = w.make_inputs((100, 1024, 4096, 1024), jnp.bfloat16, jax.random.key(0))
args2 = w.make_inputs((134, 1024, 4096, 1024), jnp.bfloat16, jax.random.key(1))
jax.block_until_ready((args, args2))
print(f"imports + inputs {time.perf_counter() - t0:.2f} s")
f = pallaskit.jit(w.jax_fn, dynamic={0: (0,)})
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
jax.block_until_ready(f(*args))
prof.disable()
t1 = time.perf_counter()
jax.block_until_ready(f(*args2))
print(f"first call {t1 - t0:.3f} s, second size {1e3 * (time.perf_counter() - t1):.2f} ms;",
      {k: round(v, 3) for k, v in pallaskit.metrics.counters.items() if k.endswith("seconds") and v})
pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
