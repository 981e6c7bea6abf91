"""GPU probe (issue 4): the gelu-MLP sweep through ``pallaskit.jit(dynamic=...)``
with eager Triton launches (runtime/eager.py) in one process:

- time to first result of each new size and of all 16 (the first includes the
  pallaskit compile of the symbolic graph and the Triton kernels' compile);
- a new size after warm-up (sizes never seen, after the sweep);
- correctness against jax.jit (relative Frobenius error, float32 reference);
- steady state per size: eager (the dispatcher's EagerProgram directly) and, after
  ``settle`` (second call + ``pallaskit.wait_compiles()``), the XLA tier, beside
  jax.jit; each as the median of 7 rounds of 20 enqueued calls + one block.

    PYTHONPATH=. python scratch/probe_eager_sweep.py [--out DIR]
"""
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallaskit
from benchmarks.workloads import SWEEP_ROWS, WORKLOADS

BF16 = jnp.bfloat16
K, H, N = 1024, 4096, 1024


def per_call_ms(fn, args, calls=20, rounds=7):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append(1e3 * (time.perf_counter() - t0) / calls)
    return statistics.median(out)


def rel_err(a, ref):
    a, ref = np.asarray(a, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def ab_steady():
    """Steady state in one process, interleaved rounds: pallaskit.jit static per size,
    the dynamic function after tier-up (static and variant), and jax.jit."""
    w = WORKLOADS["dynamic_mlp_sweep"]
    key = jax.random.key(1)
    inputs = {m: w.make_inputs((m, K, H, N), BF16, jax.random.fold_in(key, m)) for m in SWEEP_ROWS}
    fns = {"static": pallaskit.jit(w.jax_fn), "xla": jax.jit(w.jax_fn)}
    for tier in ("static", "variant"):
        with pallaskit.config.override(dynamic_tier_up=tier):
            f = pallaskit.jit(w.jax_fn, dynamic={0: (0,)})
            for m in SWEEP_ROWS:
                jax.block_until_ready(f(*inputs[m]))
            for m in SWEEP_ROWS:
                jax.block_until_ready(f(*inputs[m]))
            pallaskit.wait_compiles()
        fns["dyn_" + tier] = f
    sums = {k: 0.0 for k in fns}
    for m in SWEEP_ROWS:
        per = {k: [] for k in fns}
        for _ in range(5):
            for k, fn in fns.items():
                per[k].append(per_call_ms(fn, inputs[m], calls=20, rounds=1))
        med = {k: statistics.median(v) for k, v in per.items()}
        for k in fns:
            sums[k] += med[k]
        print(f"M={m:5d} " + " ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print("steady sums (ms):", {k: round(v, 3) for k, v in sums.items()})


def main():
    if "--ab" in sys.argv:
        return ab_steady()
    if "--serial" in sys.argv:
        import pallaskit.runtime.eager as eager_mod
        eager_mod.PARALLEL_COMPILE = False
    if "--cold" in sys.argv:  # empty pallaskit and Triton caches (set before triton is imported)
        import os
        import tempfile
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
        pallaskit.config.update(cache_dir=tempfile.mkdtemp())
    w = WORKLOADS["dynamic_mlp_sweep"]
    key = jax.random.key(0)
    inputs = {m: w.make_inputs((m, K, H, N), BF16, jax.random.fold_in(key, m)) for m in SWEEP_ROWS}
    extra = {m: w.make_inputs((m, K, H, N), BF16, jax.random.fold_in(key, m)) for m in (150, 1000, 7000)}
    jax.block_until_ready((inputs, extra))
    f = pallaskit.jit(w.jax_fn, dynamic={0: (0,)})
    firsts, t0 = {}, time.perf_counter()
    for m in SWEEP_ROWS:
        t1 = time.perf_counter()
        jax.block_until_ready(f(*inputs[m]))
        firsts[m] = 1e3 * (time.perf_counter() - t1)
    total = time.perf_counter() - t0
    c = pallaskit.metrics.counters
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"all 16 sizes to first result: {total:.3f} s; first size {firsts[SWEEP_ROWS[0]]:.0f} ms; "
          f"later sizes {min(list(firsts.values())[1:]):.2f}-{max(list(firsts.values())[1:]):.2f} ms; "
          f"eager_launches {c['eager_launches']}, kernels_compiled {c['kernels_compiled']}")
    print(f"first size: trace {c['trace_seconds']:.3f} s, pallaskit compile (all variants, incl. trace) "
          f"{c['compile_seconds']:.3f} s, the rest (Triton compile + load, launches) "
          f"{firsts[SWEEP_ROWS[0]] / 1e3 - c['compile_seconds']:.3f} s")
    if "--first-only" in sys.argv:
        return
    new = {}
    for m, args in extra.items():
        t1 = time.perf_counter()
        jax.block_until_ready(f(*args))
        new[m] = 1e3 * (time.perf_counter() - t1)
    print("new sizes after warm-up (ms):", {m: round(v, 2) for m, v in new.items()})
    dispatcher = next(iter(f._sym.values())).executable
    eager = dispatcher.eager
    print("eager variant hints:", eager.hints, "kernels:", list(eager.kernels))
    ref = jax.jit(lambda x, a, b: w.jax_fn(x.astype(jnp.float32), a.astype(jnp.float32), b.astype(jnp.float32)))
    xla = jax.jit(w.jax_fn)
    rows = []
    for m in SWEEP_ROWS:
        args = inputs[m]
        r = ref(*args)
        e_out = eager(*args, *dispatcher.eager_constants)[0]
        e_ms = per_call_ms(lambda *a: eager(*a, *dispatcher.eager_constants), args)
        x_ms = per_call_ms(xla, args)
        x_err = rel_err(xla(*args), r)
        rows.append(dict(m=m, first_ms=firsts[m], eager_ms=e_ms, xla_ms=x_ms, eager_err=rel_err(e_out, r),
                         xla_err=x_err))
    for m in SWEEP_ROWS:  # settle: the second call starts the background compile
        jax.block_until_ready(f(*inputs[m]))
    t1 = time.perf_counter()
    pallaskit.wait_compiles()
    print(f"background compiles of 16 sizes finished {time.perf_counter() - t1:.1f} s after the last settle call")
    for row in rows:
        args = inputs[row["m"]]
        row["tier_ms"] = per_call_ms(f, args)
        row["tier_err"] = rel_err(f(*args), ref(*args))
        row["variant"] = "static" if (row["m"],) in dispatcher.static else dispatcher.chosen.get((row["m"],))
        floor = (2 * row["m"] * (K + H + N) + 2 * (K * H + H * N)) / 3.0e12 * 1e3
        print(f"M={row['m']:5d} first {row['first_ms']:8.2f} ms | steady eager {row['eager_ms']:.3f} "
              f"tier {row['tier_ms']:.3f} ({row['variant']}) jax.jit {row['xla_ms']:.3f} | floor {floor:.3f} | "
              f"rel err eager {row['eager_err']:.1e} tier {row['tier_err']:.1e} jax.jit {row['xla_err']:.1e}")
    sums = {k: round(sum(r[k] for r in rows), 3) for k in ("eager_ms", "tier_ms", "xla_ms")}
    print("steady sums (ms):", sums)
    if "--out" in sys.argv:
        with open(sys.argv[sys.argv.index("--out") + 1] + "/probe_eager_sweep.json", "w") as fh:
            json.dump(dict(total_s=total, new_ms=new, rows=rows, sums=sums), fh, indent=1)


if __name__ == "__main__":
    main()
