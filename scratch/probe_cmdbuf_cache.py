"""GPU: does an executable read back from pallaskit's cache keep its command buffers?
Per-call wall/host ms of the gelu MLP (bf16) at a host-bound size, pallaskit static:

    PYTHONPATH=. python scratch/probe_cmdbuf_cache.py CACHE_DIR LABEL [M]

Run it twice on one empty CACHE_DIR (compile, then a cache hit), and once more with
PALLASKIT_COMMAND_BUFFERS=false on another folder for the plain launches.
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import pallaskit
from benchmarks.workloads import WORKLOADS

cache_dir, label = sys.argv[1], sys.argv[2]
m = int(sys.argv[3]) if len(sys.argv) > 3 else 1035
pallaskit.config.update(cache_dir=cache_dir)
w = WORKLOADS["dynamic_mlp_sweep"]
sets = [w.make_inputs((m, 1024, 4096, 1024), jnp.bfloat16, jax.random.key(i)) for i in range(3)]
f = pallaskit.jit(w.jax_fn)
jax.block_until_ready(f(*sets[0]))
walls, hosts = [], []
for _ in range(15):
    t0 = time.perf_counter()
    for i in range(60):
        r = f(*sets[i % 3])
    t1 = time.perf_counter()
    jax.block_until_ready(r)
    t2 = time.perf_counter()
    walls.append(1e3 * (t2 - t0) / 60)
    hosts.append(1e3 * (t1 - t0) / 60)
c = pallaskit.metrics.counters
print(f"{label}: M={m} wall {statistics.median(walls):.4f} ms host {statistics.median(hosts):.4f} ms "
      f"(cache hits {c['cache_hits']}, misses {c['cache_misses']})")
