"""GPU probe for size buckets ([Note: size buckets], pallaskit/runtime/buckets.py):
the first call of each new size and the steady state, per configuration, each
configuration in a fresh process (XLA keeps matmul autotuning results in-process).

PYTHONPATH=. python scratch/probe_buckets.py [--smoke] [--only=NAME,...]
(writes $OUT/probe_buckets.json; one child process per configuration)
"""
import json
import os
import subprocess
import sys
import time

OUT = os.environ.get("OUT", "/tmp")

# name -> (workload, backend, pallaskit options)
CONFIGS = {
    "mlp xla": ("mlp", "jax.jit", {}),
    "mlp buckets": ("mlp", "dynamic", {}),
    "mlp buckets hint 256": ("mlp", "dynamic", {"multi_kernel_hints": "256"}),
    "mlp buckets fused": ("mlp", "dynamic", {"matmul_template": "fused"}),
    "mlp per size": ("mlp", "dynamic", {"dynamic_buckets": False, "multi_kernel_hints": "256"}),
    "rms xla": ("rms", "jax.jit", {}),
    "rms buckets": ("rms", "dynamic", {}),
    "rms per size": ("rms", "dynamic", {"dynamic_buckets": False}),
}


def child(name, smoke):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallaskit
    from benchmarks.training_step import time_ms
    from benchmarks.workloads import SWEEP_ROWS, gelu_mlp

    workload, backend, options = CONFIGS[name]
    key = jax.random.key(0)

    def rmsnorm(x, w):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * w).astype(x.dtype)

    d, h = (32, 64) if smoke else (1024, 4096)
    if workload == "mlp":
        fn = gelu_mlp
        w1 = jax.random.normal(jax.random.fold_in(key, 1), (d, h), jnp.bfloat16) / d ** 0.5
        w2 = jax.random.normal(jax.random.fold_in(key, 2), (h, d), jnp.bfloat16) / h ** 0.5
        rest = (w1, w2)
        floor = lambda n: 2 * n * d * h * 2 / 800e9 * 1e3  # noqa: E731  (ms at 800 TFLOP/s)
    else:
        fn = rmsnorm
        rest = (jax.random.normal(jax.random.fold_in(key, 1), (d,), jnp.float32),)
        floor = lambda n: 2 * n * d * 2 / 3.0e9  # noqa: E731  (ms at 3 TB/s)
    sizes = (5, 17, 40, 100) if smoke else SWEEP_ROWS
    inputs = [(jax.random.normal(jax.random.fold_in(key, 100 + i), (n, d), jnp.bfloat16),) + rest
              for i, n in enumerate(sizes)]
    jax.block_until_ready(inputs)
    pallaskit.config.update(cache=False, **{"dynamic_buckets": True, **options})
    f = jax.jit(fn) if backend == "jax.jit" else pallaskit.jit(fn, dynamic={0: {0: "n"}})
    pallaskit.metrics.reset()
    firsts = []
    t0 = time.perf_counter()
    for args in inputs:
        t1 = time.perf_counter()
        jax.block_until_ready(f(*args))
        firsts.append((time.perf_counter() - t1) * 1e3)
    total = time.perf_counter() - t0
    counters = {k: pallaskit.metrics.counters[k] for k in
                ("graphs_compiled", "kernels_compiled", "bucket_compiles", "bucket_calls", "multi_kernel_choices")}
    ref = jax.jit(fn)
    errs = []
    for args in inputs:
        a, b = f(*args), ref(*args)
        errs.append(max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))) /
                              (jnp.max(jnp.abs(y.astype(jnp.float32))) + 1e-30))
                        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))))
    steady = [time_ms(lambda a=args: f(*a), jax.block_until_ready, rounds=5 if smoke else 15, min_round_s=0.02)
              for args in inputs]
    if os.environ.get("PROFILE") and backend == "dynamic":  # where a steady-state call's host time goes
        import cProfile
        import pstats
        args = inputs[5]
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            out = f(*args)
        jax.block_until_ready(out)
        prof.disable()
        with open(os.path.join(OUT, f"profile_{name.replace(' ', '_')}.txt"), "w") as fh:
            pstats.Stats(prof, stream=fh).sort_stats("tottime").print_stats(30)
    return dict(config=name, options=options, sizes=list(map(int, sizes)), total_first_s=round(total, 3),
                first_ms=[round(t, 1) for t in firsts], later_median_ms=round(float(np.median(firsts[1:])), 1),
                steady_ms=[round(t, 4) for t in steady], steady_sum_ms=round(sum(steady), 3),
                floor_sum_ms=round(sum(floor(n) for n in sizes), 3), max_rel_err=max(errs), counters=counters)


def main():
    smoke = "--smoke" in sys.argv
    if "--child" in sys.argv:
        name = sys.argv[sys.argv.index("--child") + 1]
        print("RESULT " + json.dumps(child(name, smoke)), flush=True)
        return
    only = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), list(CONFIGS))
    results = []
    for name in only:
        p = subprocess.run([sys.executable, __file__, "--child", name] + (["--smoke"] if smoke else []),
                           capture_output=True, text=True, timeout=400)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: FAILED\n{p.stderr[-3000:]}", flush=True)
            results.append(dict(config=name, error=p.stderr[-3000:]))
            continue
        r = json.loads(line[7:])
        results.append(r)
        print(f"{name:24s} all {r['total_first_s']:7.3f} s  first {r['first_ms'][0]:8.1f} ms  later median "
              f"{r['later_median_ms']:7.1f} ms  max later {max(r['first_ms'][1:]):7.1f} ms  steady sum "
              f"{r['steady_sum_ms']:7.3f} ms (floor {r['floor_sum_ms']})  err {r['max_rel_err']:.1e}  "
              f"{r['counters']}", flush=True)
        print("   first ms:", r["first_ms"], "\n   steady ms:", r["steady_ms"], flush=True)
    with open(os.path.join(OUT, "probe_buckets.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
