"""GPU probe 2: tile/grid/pipelining grid for mix kernels, split reductions, NHWC.

PYTHONPATH=. python scratch/probe_mix2.py  (writes $OUT/probe_mix2.json)
"""
import json, os, sys, time
sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp, numpy as np
import pallaskit
from lowering import heuristics as H
from norms import layernorm_fwd_bwd, rmsnorm_bwd_vjp

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []
ORIG = dict(mix_config=H.mix_config, reduction_config=H.reduction_config, pointwise_config=H.pointwise_config,
            PROGRAMS_PER_SM=H.PROGRAMS_PER_SM, ROW_SPLIT_PROGRAMS_PER_SM=H.ROW_SPLIT_PROGRAMS_PER_SM)


def restore():
    for k, v in ORIG.items():
        setattr(H, k, v)


def bench(f, args, n=20, rounds=7):
    jax.block_until_ready(f(*args))
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return float(np.median(ts))


def errs(a, b):
    a = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(a)]
    b = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(b)]
    return [float(np.abs(x - y).max() / (np.abs(y).max() + 1e-30)) for x, y in zip(a, b)]


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


def whole(br, w, st):
    return lambda rows, cols, *, whole_rows, programs: H.TileConfig(br, H.next_power_of_2(cols), w, True, st)


def main():
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    M, N = 576000, 384
    x = jnp.asarray(rng.standard_normal((M, N)), bf)
    dy = jnp.asarray(rng.standard_normal((M, N)), bf)
    w = jnp.asarray(rng.standard_normal(N), bf)
    b = jnp.asarray(rng.standard_normal(N), bf)

    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(rmsnorm_bwd_vjp)(x, w, dy)
    for pps in (4, 8, 16):
        for br in (4, 8, 16):
            for wp in (4, 8):
                for st in (1, 3):
                    H.PROGRAMS_PER_SM, H.mix_config = pps, whole(br, wp, st)
                    run("rmsnorm_bwd", f"pps{pps}_br{br}_w{wp}_s{st}", rmsnorm_bwd_vjp, (x, w, dy), floor, ref)
    restore()

    floor = 4 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(layernorm_fwd_bwd)(x, w, b, dy)
    for pps in (8, 16):
        for br in (4, 8):
            for st in (1, 3):
                H.PROGRAMS_PER_SM, H.mix_config = pps, whole(br, 8, st)
                run("layernorm_fwd_bwd", f"pps{pps}_br{br}_w8_s{st}", layernorm_fwd_bwd, (x, w, b, dy), floor, ref)
    restore()

    xs = jnp.asarray(rng.standard_normal((576001, 383)), bf)
    floor = 576001 * 383 * 2 / 3.0e12 * 1e3
    colsum = lambda a: jnp.sum(a.astype(jnp.float32), axis=0)
    ref = jax.jit(colsum)(xs)
    for pps in (4, 8, 16):
        for br, bc in ((32, 128), (16, 256), (64, 128), (32, 256)):
            for st in (1, 3):
                H.PROGRAMS_PER_SM = pps
                H.mix_config = (lambda br_, bc_, st_: lambda rows, cols, *, whole_rows, programs:
                                H.TileConfig(br_, bc_, 4, False, st_))(br, bc, st)
                run("colsum", f"pps{pps}_br{br}_bc{bc}_s{st}", colsum, (xs,), floor, ref)
    restore()

    fullsum = lambda a: jnp.sum(a.astype(jnp.float32))
    ref = jax.jit(fullsum)(xs)
    for pps in (4, 8, 16):
        for bc in (2048, 4096, 8192):
            for st in (1, 3):
                H.ROW_SPLIT_PROGRAMS_PER_SM = pps
                def rc(rows, cols, *, max_persistent_cols, inner_contiguous, force_width_one=False, bc=bc, st=st):
                    cfg = ORIG["reduction_config"](rows, cols, max_persistent_cols=max_persistent_cols,
                                                   inner_contiguous=inner_contiguous, force_width_one=force_width_one)
                    if not cfg.persistent and inner_contiguous:
                        return H.TileConfig(1, bc, 8 if bc >= 4096 else 4, False, st)
                    return cfg
                H.reduction_config = rc
                run("fullsum", f"pps{pps}_bc{bc}_s{st}", fullsum, (xs,), floor, ref)
    restore()

    xn = jnp.asarray(rng.standard_normal((32, 25, 25, 1024)), bf)
    s = jnp.asarray(rng.standard_normal((1, 1024, 1, 1)), bf)
    bb = jnp.asarray(rng.standard_normal((1, 1024, 1, 1)), bf)
    def nhwc(x, s, b):
        t = jnp.transpose(x, (0, 3, 1, 2)) * s + b
        return jnp.transpose(jax.nn.relu(t), (0, 2, 3, 1)), jnp.transpose(t > 0, (0, 2, 3, 1))
    n = xn.size
    floor = 5 * n / 3.0e12 * 1e3
    ref = jax.jit(nhwc)(xn, s, bb)
    out = pallaskit.jit(nhwc)(xn, s, bb)
    print("nhwc bool mismatches", int((np.asarray(out[1]) != np.asarray(ref[1])).sum()), "of", n,
          "relu max err", float(np.abs(np.asarray(out[0], np.float32) - np.asarray(ref[0], np.float32)).max()), flush=True)
    for bc in (1024, 2048, 4096):
        for wp in (4, 8):
            H.pointwise_config = (lambda bc_, wp_: lambda rows, cols: H.TileConfig(1, bc_, wp_, True))(bc, wp)
            run("nhwc", f"bc{bc}_w{wp}", nhwc, (xn, s, bb), floor, ref)
    restore()
    with open(os.path.join(OUT, "probe_mix2.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
