"""GPU: does compiling a program's executable with XLA command buffers (CUDA graphs) for
every program size (``xla_gpu_graph_min_graph_size=1``; XLA's default 5 leaves 2-3 kernel
programs as plain launches) cut the per-call host time of the gelu MLP 1024->4096->1024 (bf16)?
jax.jit and pallaskit static, each with and without, interleaved rounds (median of 9 rounds
of 60 calls, rotating 3 input sets as the suite does). Prints wall and host ms per call.

    PYTHONPATH=. python scratch/probe_cmdbuf.py [M ...]
"""
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallaskit
import pallaskit.cache as pcache
from benchmarks.workloads import WORKLOADS

GRAPH = {"xla_gpu_graph_min_graph_size": 1}
w = WORKLOADS["dynamic_mlp_sweep"]
rows = [int(a) for a in sys.argv[1:]] or [100, 240, 431, 577, 1035, 1386, 2487, 4460, 8000]
pallaskit.config.update(cache=False)
plain_aot = pcache._aot_compile


def graph_aot(call, structs, constants):
    return jax.jit(call).lower(*structs, *constants).compile(compiler_options=GRAPH)


sums = {}
for m in rows:
    sets = [w.make_inputs((m, 1024, 4096, 1024), jnp.bfloat16, jax.random.key(m * 10 + i)) for i in range(3)]
    fns = {"xla": jax.jit(w.jax_fn),
           "xla_graph": jax.jit(w.jax_fn).lower(*sets[0]).compile(compiler_options=GRAPH)}
    for name, aot in (("pk", plain_aot), ("pk_graph", graph_aot)):
        pcache._aot_compile = aot
        f = pallaskit.jit(w.jax_fn)
        jax.block_until_ready(f(*sets[0]))
        fns[name] = f
    pcache._aot_compile = plain_aot
    ref = np.asarray(fns["xla"](*sets[1]), np.float32)
    for k, f in fns.items():
        got = np.asarray(f(*sets[1]), np.float32)
        err = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-9))
        assert err < 2e-2, (k, m, err)
    wall = {k: [] for k in fns}
    host = {k: [] for k in fns}
    for _ in range(9):
        for k, f in fns.items():
            jax.block_until_ready(f(*sets[0]))
            n = 60
            t0 = time.perf_counter()
            for i in range(n):
                r = f(*sets[i % 3])
            t1 = time.perf_counter()
            jax.block_until_ready(r)
            t2 = time.perf_counter()
            wall[k].append(1e3 * (t2 - t0) / n)
            host[k].append(1e3 * (t1 - t0) / n)
    med = {k: statistics.median(v) for k, v in wall.items()}
    hmed = {k: statistics.median(v) for k, v in host.items()}
    for k in med:
        sums[k] = sums.get(k, 0.0) + med[k]
    print(f"M={m:5d} " + "  ".join(f"{k} {med[k]:.4f}/{hmed[k]:.4f}" for k in med), flush=True)
print("sum " + "  ".join(f"{k} {v:.4f}" for k, v in sums.items()))
