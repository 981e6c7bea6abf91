"""Where a cold first call's time goes on the GPU: imports, then a cProfile of
the first call of an RMSNorm backward (cache off)."""
import cProfile, io, os, pstats, sys, time
sys.path.insert(0, os.path.dirname(__file__))
t = time.perf_counter()
import jax, jax.numpy as jnp
jax.block_until_ready(jnp.ones(3))
print(f"jax + backend {time.perf_counter() - t:.2f}s")
for mod in ("pallaskit", "jax.experimental.pallas", "jax.experimental.pallas.triton", "sympy", "lowering.lower",
            "lowering.codegen.pallas", "lowering.scheduler"):
    t = time.perf_counter()
    __import__(mod)
    print(f"import {mod}: {time.perf_counter() - t:.2f}s")
import pallaskit
from norms import rmsnorm_bwd_vjp
x = jnp.ones((4096, 384), jnp.bfloat16); w = jnp.ones((384,), jnp.bfloat16); dy = jnp.ones((4096, 384), jnp.bfloat16)
pr = cProfile.Profile()
t = time.perf_counter()
with pallaskit.config.override(cache=False):
    pr.enable()
    jax.block_until_ready(pallaskit.jit(rmsnorm_bwd_vjp)(x, w, dy))
    pr.disable()
print(f"first call {time.perf_counter() - t:.2f}s")
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
print(s.getvalue()[:6000])
