"""GPU probe for pallaskit.jit(dynamic=...) (issue 4 parts 1-2): what a new
size costs once the symbolic program exists, beside jax.jit and pallaskit's
per-size static compile, and the 16-size gelu-MLP sweep of the suite.

PYTHONPATH=. python scratch/probe_dynamic_api.py [--smoke] [--mlp=jax.jit|pallaskit dynamic]
(writes $OUT/probe_dynamic_api.json)

The MLP sweep runs one backend per process (--mlp, default jax.jit): XLA keeps
its matmul autotuning results in-process, so a second backend on the same
shapes would skip that work and look faster than it is.
"""
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import pallaskit
from benchmarks.workloads import SWEEP_ROWS, gelu_mlp

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []


def emit(**row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


def first_ms(f, *args):
    t0 = time.perf_counter()
    out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3, out


def steady_ms(f, *args, n=20):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) * 1e3 / n


def per_size(name, fn, make, sizes, backends):
    for label, build in backends:
        f = build(fn)
        times = []
        for i, n in enumerate(sizes):
            args = make(n, i)
            jax.block_until_ready(args)
            ms, out = first_ms(f, *args)
            ref = jax.jit(fn)(*args)
            err = max(float(np.max(np.abs(np.float32(a) - np.float32(b)))) for a, b in
                      zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)))
            times.append(ms)
            emit(case=name, backend=label, size=n, first_ms=round(ms, 1), max_abs_err=err)
        emit(case=name, backend=label, total_first_s=round(sum(times) / 1e3, 3),
             later_median_ms=round(float(np.median(times[1:])), 1),
             counters={k: pallaskit.metrics.counters[k] for k in
                       ("graphs_compiled", "kernels_compiled", "dynamic_fallbacks")})


def main():
    smoke = "--smoke" in sys.argv
    key = jax.random.key(0)
    w = jnp.ones((1024,), jnp.float32)
    make_norm = lambda n, i: (jax.random.normal(jax.random.fold_in(key, i), (n, 1024), jnp.bfloat16), w)  # noqa
    norm_sizes = (64, 5, 33) if smoke else (4096, 1000, 3000, 5001, 77, 12345, 640, 2048)
    backends = (("jax.jit", jax.jit),
                ("pallaskit dynamic", lambda f: pallaskit.jit(f, dynamic={0: {0: "n"}})),
                ("pallaskit static", lambda f: pallaskit.jit(f)))
    with pallaskit.config.override(cache=False):
        for label, build in backends:
            with pallaskit.config.override(automatic_dynamic=False):
                per_size("rmsnorm", rmsnorm, make_norm, norm_sizes, [(label, build)])
        x4096 = make_norm(4096, 0)
        emit(case="rmsnorm steady 4096", **{lab: round(steady_ms(b(rmsnorm), *x4096), 4) for lab, b in backends})
        ks = jax.random.split(key, 2)
        w1 = jax.random.normal(ks[0], (1024, 4096), jnp.bfloat16) / 32
        w2 = jax.random.normal(ks[1], (4096, 1024), jnp.bfloat16) / 64
        make_mlp = lambda n, i: (jax.random.normal(jax.random.fold_in(key, i), (n, 1024), jnp.bfloat16), w1, w2)  # noqa
        mlp = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--mlp=")), "jax.jit")
        for label, build in [b for b in backends[:2] if b[0] == mlp]:
            with pallaskit.config.override(automatic_dynamic=False):
                per_size("gelu_mlp sweep", gelu_mlp, make_mlp, (5, 17) if smoke else SWEEP_ROWS, [(label, build)])
    with open(os.path.join(OUT, "probe_dynamic_api.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
