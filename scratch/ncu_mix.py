"""Run once under Nsight Compute (session 14): the hand-written RMSNorm backward tile
(probe_triton_xla ``mk:2,8,8,3``), pallaskit's generated mix kernel and XLA's ``a + b``
of the same bytes, each a few times, so ``ncu`` can profile one launch of each.

ncu --csv --page details --section SpeedOfLight ... python3 scratch/ncu_mix.py
"""
import jax
import jax.numpy as jnp

import pallaskit
from scratch import probe_triton_xla as base

M, N = base.M, base.N
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (M, N), jnp.bfloat16)
w = (1 + 0.5 * jax.random.normal(k[1], (N,), jnp.float32)).astype(jnp.bfloat16)
dy = jax.random.normal(k[2], (M, N), jnp.bfloat16)
hand, _ = base.make("mk", 2, 8, 8, 3)
fns = [jax.jit(hand), jax.jit(lambda x, w, dy: x + dy), pallaskit.jit(base.rmsnorm_bwd)]
for f in fns:
    for _ in range(2):
        jax.block_until_ready(f(x, w, dy))
