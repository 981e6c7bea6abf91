"""GPU probe: L2 eviction hints on loads (heuristics.eviction_policy) on and
off, alternated, on the norm backwards and the training step (whole step in one graph).

PYTHONPATH=. python scratch/probe_evict.py   (writes $OUT/probe_evict.json)

Measured on the H100 (2026-11-23, two alternated rounds, ms): RMSNorm backward
576000x384 bf16 with hints 0.518 / 0.522, without 0.512 / 0.511; LayerNorm
forward+backward 0.754 / 0.757 vs 0.752 / 0.753; whole training step 0.739 /
0.766 vs 0.742 / 0.738. No gain, so the renderer emits no hints; the hint
function lived in heuristics (evict_first for a persistent kernel's loads of a
domain-sized buffer, evict_last for one 8x smaller) and this probe patched it.
It needs that function back to run.
"""
import json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import numpy as np
import jax, jax.numpy as jnp
from lowering import heuristics as H
from norms import layernorm_fwd_bwd, rmsnorm_bwd_vjp
import probe_mix3
from probe_mix import M, N, norm_inputs
from benchmarks.training_step import inputs, loss

OUT = os.environ.get("OUT", "/tmp")
ORIG = H.eviction_policy


def nhwc(x, s, b):
    t = jnp.transpose(x, (0, 3, 1, 2)) * s + b
    return jnp.transpose(jax.nn.relu(t), (0, 2, 3, 1)), jnp.transpose(t > 0, (0, 2, 3, 1))


def main():
    x, dy, w, b = norm_inputs(np.random.default_rng(0))
    k = jax.random.split(jax.random.key(1), 3)
    xn = jax.random.normal(k[0], (32, 25, 25, 1024), jnp.bfloat16)
    s, bb = (jax.random.normal(kk, (1, 1024, 1, 1), jnp.bfloat16) for kk in k[1:])
    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    cases = (("rmsnorm_bwd", rmsnorm_bwd_vjp, (x, w, dy), 3 * M * N * 2),
             ("layernorm_fwd_bwd", layernorm_fwd_bwd, (x, w, b, dy), 4 * M * N * 2),
             ("train_step_whole", step, inputs(8192, 1024, 4096, jnp.bfloat16), 0))
    for rep in range(2):
        for name, f, args, nbytes in cases:
            ref = jax.jit(f)(*args)
            for variant in ("evict_hints", "none"):
                H.eviction_policy = ORIG if variant == "evict_hints" else (lambda *a: None)
                probe_mix3.run(name, f"{variant}#{rep}", f, args, nbytes / 3.0e12 * 1e3, ref)
    H.eviction_policy = ORIG
    with open(os.path.join(OUT, "probe_evict.json"), "w") as fh:
        json.dump(probe_mix3.RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
