"""cProfile of one cold first call (empty graph cache) of the RMSNorm backward on
the device: where a cache miss's seconds go. PYTHONPATH=. python scratch/profile_cold.py"""
import cProfile
import os
import pstats
import tempfile
import time

os.environ["PALLASKIT_CACHE_DIR"] = tempfile.mkdtemp()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallaskit  # noqa: E402
from benchmarks.workloads import rmsnorm_bwd  # noqa: E402

rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((576000, 384)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal(384), jnp.bfloat16)
jax.block_until_ready(jax.jit(lambda a: a + 1)(x))
f = pallaskit.jit(rmsnorm_bwd)
pr = cProfile.Profile()
t0 = time.perf_counter()
pr.enable()
jax.block_until_ready(f(x, w, x))
pr.disable()
print("first call", time.perf_counter() - t0)
pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
