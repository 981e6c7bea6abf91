"""GPU: the gelu MLP's steady state at the sweep's middle sizes, pallaskit static
(the program a recurring size tiers up to) vs jax.jit; the program's kernels and
XLA's ops of both executables.

    PYTHONPATH=. python scratch/probe_mid_mlp.py
"""
import re

import jax
import jax.numpy as jnp

import pallaskit
from benchmarks.workloads import WORKLOADS
from probe_eager_sweep import per_call_ms

w = WORKLOADS["dynamic_mlp_sweep"]


def ops(fn, args):
    text = fn.lower(*args).compile().as_text() if hasattr(fn, "lower") else ""
    return sorted(set(re.findall(r"custom_call_target=\"([^\"]+)\"", text))), text.count("fusion(") + text.count(
        "custom-call(")


for m in (322, 577, 1035, 1386, 3330):
    args = w.make_inputs((m, 1024, 4096, 1024), jnp.bfloat16, jax.random.key(m))
    xla = jax.jit(w.jax_fn)
    res = {"xla": per_call_ms(xla, args, calls=50, rounds=9)}
    for mode in ("auto", "on", "off"):
        with pallaskit.config.override(matmul_template=mode):
            f = pallaskit.jit(w.jax_fn)
            res[f"pk_{mode}"] = per_call_ms(f, args, calls=50, rounds=9)
            entry = f.lower_to_result(*args)
            if mode == "auto":
                kernels = [k.name for k in entry.result.program.kernels]
                externs = [str(p) for p, _ in entry.result.program.externs]
    print(f"M={m}: " + " ".join(f"{k} {v:.4f}" for k, v in res.items()) + f" | kernels {kernels} externs {externs}")
    if m == 1035:
        with pallaskit.config.override(cache=False):
            entry = pallaskit.jit(w.jax_fn).lower_to_result(*args)
        print(entry.result.program.source[:6000])
        print("XLA ops of jax.jit:", ops(xla, args))
