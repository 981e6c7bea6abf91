"""GPU: the matmul template against XLA's dot between 512 and 4096 rows (bf16),
plain and with a tanh-gelu epilogue, to place heuristics.matmul_template_wins.
pallaskit static with matmul_template=on vs jax.jit; median of 7 interleaved
rounds of 30 calls (ms).

    PYTHONPATH=. python scratch/probe_template_mid.py
"""
import statistics
import time

import jax
import jax.numpy as jnp

import pallaskit


def timed(fns, args, rounds=7, calls=30):
    out = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f(*args))
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                r = f(*args)
            jax.block_until_ready(r)
            out[k].append(1e3 * (time.perf_counter() - t0) / calls)
    return {k: statistics.median(v) for k, v in out.items()}


plain = lambda x, w: x @ w  # noqa: E731
gelu = lambda x, w: jax.nn.gelu(x @ w, approximate=True)  # noqa: E731
key = jax.random.key(0)
print("m n k | plain: template xla ratio | gelu: template xla ratio")
for n, k in ((4096, 1024), (1024, 4096), (2048, 2048), (4096, 4096)):
    for m in (768, 1024, 1536, 2048, 3072):
        k1, k2 = jax.random.split(jax.random.fold_in(key, m * n + k))
        x = jax.random.normal(k1, (m, k), jnp.bfloat16)
        w = (jax.random.normal(k2, (k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
        row = []
        for fn in (plain, gelu):
            with pallaskit.config.override(matmul_template="on"):
                p = pallaskit.jit(fn)
                jax.block_until_ready(p(x, w))
            t = timed({"t": p, "x": jax.jit(fn)}, (x, w))
            row.append(f"{t['t']:.4f} {t['x']:.4f} {t['t'] / t['x']:.2f}")
        print(f"{m} {n} {k} | " + " | ".join(row), flush=True)
