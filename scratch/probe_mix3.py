"""GPU probe 3: programs per SM, rows per step and warps of mix kernels; column
split tiles; where the NHWC block loses time.

PYTHONPATH=. python scratch/probe_mix3.py  (writes $OUT/probe_mix3.json)
"""
import json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp, numpy as np
import pallaskit
from lowering import heuristics as H
from norms import layernorm_fwd_bwd, rmsnorm_bwd_vjp
import probe_mix
from probe_mix import M, N, errs, nhwc, nhwc_inputs, norm_inputs, plain_relu

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []
ORIG = dict(mix_config=H.mix_config, reduction_config=H.reduction_config, pointwise_config=H.pointwise_config,
            _programs_per_sm=H._programs_per_sm, ROW_SPLIT_PROGRAMS_PER_SM=H.ROW_SPLIT_PROGRAMS_PER_SM)


def restore():
    for k, v in ORIG.items():
        setattr(H, k, v)


def bench(f, args):
    return probe_mix.bench(f, args, n=20, rounds=7)


def run(name, variant, f, args, floor, ref, **opts):
    try:
        with pallaskit.config.override(cache=False, **opts):
            jf = pallaskit.jit(f)
            e = errs(jf(*args), ref) if ref is not None else None
            ms = bench(jf, args)
        row = dict(name=name, variant=variant, ms=round(ms, 4), floor_ms=round(floor, 4), frac=round(floor / ms, 3), err=e)
    except Exception as ex:
        row = dict(name=name, variant=variant, error=f"{type(ex).__name__}: {str(ex)[:300]}")
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def per_sm(n):
    return lambda cols, columns=1: n


def whole(br, w, st, prefetch=0):
    return lambda rows, cols, *, whole_rows, programs, **_: H.TileConfig(br, H.next_power_of_2(cols), w, True, st,
                                                                         prefetch=prefetch)


def main():
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    x, dy, w, b = norm_inputs(rng)

    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(rmsnorm_bwd_vjp)(x, w, dy)
    run("rmsnorm_bwd", "default", rmsnorm_bwd_vjp, (x, w, dy), floor, ref)
    for pps in (8, 16, 32):
        for br in (1, 2, 4, 8):
            for wp in (1, 2, 4):
                H._programs_per_sm, H.mix_config = per_sm(pps), whole(br, wp, 1)
                run("rmsnorm_bwd", f"pps{pps}_br{br}_w{wp}", rmsnorm_bwd_vjp, (x, w, dy), floor, ref)
    restore()

    floor = 4 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(layernorm_fwd_bwd)(x, w, b, dy)
    run("layernorm_fwd_bwd", "default", layernorm_fwd_bwd, (x, w, b, dy), floor, ref)
    for pps in (8, 16, 32):
        for br, wp in ((1, 1), (2, 2), (4, 4), (2, 4)):
            H._programs_per_sm, H.mix_config = per_sm(pps), whole(br, wp, 1)
            run("layernorm_fwd_bwd", f"pps{pps}_br{br}_w{wp}", layernorm_fwd_bwd, (x, w, b, dy), floor, ref)
    restore()

    xs = jnp.asarray(rng.standard_normal((576001, 383)), bf)
    floor = 576001 * 383 * 2 / 3.0e12 * 1e3
    colsum = lambda a: jnp.sum(a.astype(jnp.float32), axis=0)
    ref = jax.jit(colsum)(xs)
    for pps in (8, 16, 32):
        for br, bc in ((32, 128), (16, 256), (8, 512)):
            H._programs_per_sm = per_sm(pps)
            H.mix_config = (lambda br_, bc_: lambda rows, cols, *, whole_rows, programs, **_:
                            H.TileConfig(br_, bc_, 4, False, 1))(br, bc)
            run("colsum", f"pps{pps}_br{br}_bc{bc}", colsum, (xs,), floor, ref)
    restore()

    xn, s, bb = nhwc_inputs(rng)
    def relu_only(x, s, b):
        return nhwc(x, s, b)[0]
    def bool_only(x, s, b):
        return nhwc(x, s, b)[1]
    n = xn.size
    for nm, f, floor in (("nhwc", nhwc, 5 * n), ("nhwc_relu_only", relu_only, 4 * n), ("nhwc_bool_only", bool_only, 3 * n),
                         ("plain_relu_nhwc", plain_relu, 4 * n)):
        floor = floor / 3.0e12 * 1e3
        ref = jax.jit(f)(xn, s, bb)
        r = dict(name=nm, variant="xla", ms=round(bench(jax.jit(f), (xn, s, bb)), 4), floor_ms=round(floor, 4))
        RESULTS.append(r); print(json.dumps(r), flush=True)
        run(nm, "pallaskit", f, (xn, s, bb), floor, ref)
    with open(os.path.join(OUT, "probe_mix3.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
