"""GPU probe: pointwise tiles for the NHWC block (2-D iteration) and the flat
pointwise chain; dispatch cost of pallaskit.jit against jax.jit.

PYTHONPATH=. python scratch/probe_pointwise.py  (writes $OUT/probe_pointwise.json)
"""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp, numpy as np
import pallaskit
from lowering import heuristics as H
from benchmarks.workloads import pointwise_chain
from probe_mix import bench, errs, nhwc, nhwc_inputs, plain_relu

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []
ORIG = H.pointwise_config


def emit(row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def tiles(elems, warps):
    def cfg(rows, cols):
        bc = min(H.next_power_of_2(cols), elems)
        br = min(H.next_power_of_2(rows), max(1, elems // bc))
        return H.TileConfig(br, bc, warps, True)
    return cfg


def host_us(f, args, n=300):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(n):
        out = f(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(out)
    return (t1 - t0) / n * 1e6


K = 10


def many(f):
    """K calls on K distinct first arguments in one jax.jit: one dispatch per K
    kernels, so the host clock measures the device."""
    return jax.jit(lambda xs, *rest: [f(x, *rest) for x in xs])


def run_many(name, variant, f, args, floor, cfg=None):
    H.pointwise_config = cfg or ORIG
    xs = [args[0] * (1 + 0.01 * k) for k in range(K)]
    try:
        with pallaskit.config.override(cache=False):
            g = many(pallaskit.jit(f) if variant != "xla" else f)
            ms = bench(g, (xs,) + tuple(args[1:]), n=10, rounds=9) / K
        emit(dict(name=name + f" x{K} in one jit", variant=variant, ms=round(ms, 4), floor_ms=round(floor, 4),
                  frac=round(floor / ms, 3)))
    except Exception as ex:
        emit(dict(name=name, variant=variant, error=f"{type(ex).__name__}: {str(ex)[:300]}"))
    finally:
        H.pointwise_config = ORIG


def run(name, variant, f, args, floor, ref, cfg=None, staged=False):
    H.pointwise_config = cfg or ORIG
    try:
        with pallaskit.config.override(cache=False):
            pf = pallaskit.jit(f)
            g = jax.jit(lambda *a: pf(*a)) if staged else pf
            e = errs(g(*args), ref)
            ms = bench(g, args, n=50, rounds=9)
            hu = host_us(g, args)
        emit(dict(name=name, variant=variant, ms=round(ms, 4), floor_ms=round(floor, 4), frac=round(floor / ms, 3),
                  host_us_per_call=round(hu, 1), err=e))
    except Exception as ex:
        emit(dict(name=name, variant=variant, error=f"{type(ex).__name__}: {str(ex)[:300]}"))
    finally:
        H.pointwise_config = ORIG


def square(r, c, warps):
    return lambda rows, cols: H.TileConfig(min(H.next_power_of_2(rows), r), min(H.next_power_of_2(cols), c), warps, True)


def transposes(rng):
    """Tiled transposes: (8192, 8192) and NCHW -> NHWC, bf16."""
    orig_t = H.transpose_config
    a = jnp.asarray(rng.standard_normal((8192, 8192)), jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((32, 1024, 25, 25)), jnp.bfloat16)
    cases = (("transpose 8192^2", lambda x: x.T * 2.0 + 1.0, a),
             ("nchw->nhwc", lambda x: jnp.transpose(x, (0, 2, 3, 1)) * 2.0 + 1.0, c))
    for nm, f, x in cases:
        floor = 2 * x.size * 2 / 3.0e12 * 1e3
        run_many(nm, "xla", f, (x,), floor)
        run_many(nm, "pallaskit", f, (x,), floor)
        for r, cc, wp in ((32, 32, 4), (64, 64, 4), (64, 64, 8), (128, 32, 4), (32, 128, 4), (128, 128, 8)):
            H.transpose_config = square(r, cc, wp)
            run_many(nm, f"tile {r}x{cc}/{wp}w", f, (x,), floor)
        H.transpose_config = orig_t


def main():
    rng = np.random.default_rng(0)
    transposes(rng)
    if sys.argv[1:] == ["transposes"]:
        return dump()
    xn, s, b = nhwc_inputs(rng)
    n = xn.size
    for nm, f, nbytes in (("nhwc", nhwc, 5 * n), ("plain_relu_nhwc", plain_relu, 4 * n)):
        floor = nbytes / 3.0e12 * 1e3
        args = (xn, s, b)
        ref = jax.jit(f)(*args)
        xla = jax.jit(f)
        emit(dict(name=nm, variant="xla", ms=round(bench(xla, args, n=50, rounds=9), 4), floor_ms=round(floor, 4),
                  host_us_per_call=round(host_us(xla, args), 1)))
        run(nm, "pallaskit", f, args, floor, ref)
        run(nm, "pallaskit in jax.jit", f, args, floor, ref, staged=True)
        run_many(nm, "xla", f, args, floor)
        run_many(nm, "pallaskit", f, args, floor)
        for elems, warps in ((2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (1024, 2), (1024, 8)):
            run_many(nm, f"tiles {elems}/{warps}w", f, args, floor, cfg=tiles(elems, warps))

    M, N = 576000, 384
    x = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(pointwise_chain)(x, y)
    emit(dict(name="pointwise_chain", variant="xla", ms=round(bench(jax.jit(pointwise_chain), (x, y)), 4),
              floor_ms=round(floor, 4)))
    run("pointwise_chain", "pallaskit", pointwise_chain, (x, y), floor, ref)
    # 2026-11-23 H100: tiles of 512-8192 elements, 4 or 8 warps: 0.515-0.569 ms, none better than the default.

    small = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    add = lambda a, c: a * 2.0 + c
    emit(dict(name="dispatch 8x128", variant="xla", host_us_per_call=round(host_us(jax.jit(add), (small, small)), 1)))
    with pallaskit.config.override(cache=False):
        emit(dict(name="dispatch 8x128", variant="pallaskit",
                  host_us_per_call=round(host_us(pallaskit.jit(add), (small, small)), 1)))
    dump()


def dump():
    with open(os.path.join(OUT, "probe_pointwise.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
