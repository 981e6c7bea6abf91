"""A training step with its parameters donated: peak device memory and time.

``step(params, x) -> (new params, loss)``: the RMSNorm + gelu MLP block of
``benchmarks/training_step.py``, its gradient and an SGD update, under
``jax.jit`` and ``pallaskit.jit``, each with and without
``donate_argnums=0``. Each variant runs in a fresh process (so the device's
peak memory is its own): results checked against ``jax.jit`` without
donation, the donated parameters checked deleted, then the step time, the
device's ``peak_bytes_in_use`` (GPU) and XLA's memory analysis of the
compiled step (argument / output / alias / temp bytes; ``.lower().compile()``,
so pallaskit's AOT stages are exercised too).

    python -m benchmarks.donation            # GPU: 8192 x 1024, mlp 4096, bf16
    python -m benchmarks.donation --smoke    # CPU, tiny, interpret mode
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VARIANTS = ("jax.jit", "jax.jit donate", "pallaskit.jit", "pallaskit.jit donate")


def _child(variant: str, rows: int, hidden: int, mlp: int, dtype_name: str, rounds: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallaskit
    from benchmarks.training_step import inputs, loss

    dtype = jnp.dtype(dtype_name)

    def step(params, x):
        value, grads = jax.value_and_grad(lambda p: loss(x, *p))(params)
        return jax.tree_util.tree_map(lambda p, g: (p - 0.01 * g).astype(p.dtype), params, grads), value

    x, *params = inputs(rows, hidden, mlp, dtype)
    params = tuple(params)

    kw = {"donate_argnums": 0} if variant.endswith("donate") else {}
    jitted = (pallaskit.jit if variant.startswith("pallaskit") else jax.jit)(step, **kw)

    def fresh():
        return tuple(jnp.array(p, copy=True) for p in params)

    analysis = {}
    try:
        mem = jitted.lower(fresh(), x).compile().memory_analysis()
        for name in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                     "temp_size_in_bytes"):
            analysis[name] = int(getattr(mem, name, -1))
    except Exception as e:  # noqa: BLE001
        analysis["error"] = f"{type(e).__name__}: {e}"
    p = fresh()
    out = jitted(p, x)
    got = [np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves(out)]
    deleted = all(a.is_deleted() for a in p)
    # the steady state: the step's own output feeds the next step, as in training
    state = out[0]
    for _ in range(3):
        state, value = jitted(state, x)
    jax.block_until_ready(value)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(10):
            state, value = jitted(state, x)
        jax.block_until_ready(value)
        times.append((time.perf_counter() - t0) / 10 * 1e3)
    stats = jax.devices()[0].memory_stats() or {}
    # The reference runs last, so the device's peak is the variant's own.
    ref_params, ref_loss = jax.jit(step)(params, x)
    ref = [np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves((ref_params, ref_loss))]
    err = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6)) for a, b in zip(got, ref))
    return {"variant": variant, "max_rel_err": err, "donated_deleted": deleted, "ms": float(np.median(times)),
            "peak_bytes": stats.get("peak_bytes_in_use"), "param_bytes": sum(a.nbytes for a in params),
            "memory_analysis": analysis, "device": str(jax.devices()[0])}


def main(argv):
    smoke = "--smoke" in argv
    rows, hidden, mlp, dtype, rounds = (64, 48, 96, "float32", 3) if smoke else (8192, 1024, 4096, "bfloat16", 15)
    results = []
    for variant in VARIANTS:
        code = ("import json, sys; from benchmarks.donation import _child; "
                f"print('RESULT ' + json.dumps(_child({variant!r}, {rows}, {hidden}, {mlp}, {dtype!r}, {rounds})))")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=dict(os.environ))
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            results.append({"variant": variant, "error": proc.stderr.strip().splitlines()[-1:]})
        else:
            results.append(json.loads(line[len("RESULT "):]))
    print(f"train step (params donated or not): rows={rows} hidden={hidden} mlp={mlp} {dtype}")
    print(f"{'variant':<22}{'ms':>9}{'peak MiB':>10}{'temp MiB':>10}{'alias MiB':>10}{'max rel err':>13}  deleted")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<22} failed: {r['error']}")
            continue
        mib = lambda b: f"{b / 2**20:.1f}" if isinstance(b, (int, float)) and b >= 0 else "-"  # noqa: E731
        a = r["memory_analysis"]
        print(f"{r['variant']:<22}{r['ms']:>9.3f}{mib(r['peak_bytes']):>10}{mib(a.get('temp_size_in_bytes')):>10}"
              f"{mib(a.get('alias_size_in_bytes')):>10}{r['max_rel_err']:>13.2e}  {r['donated_deleted']}")
    print(json.dumps(results, indent=1))
    bad = [r["variant"] for r in results if "error" in r or r["max_rel_err"] > (0.05 if dtype == "bfloat16" else 1e-4)
           or (r["variant"].endswith("donate") and not r["donated_deleted"])]
    if bad:
        print("FAILED:", ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
