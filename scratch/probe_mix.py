"""GPU probe: mix-order reduction configs, split reductions, NHWC layout, pointwise chain.

PYTHONPATH=. python scratch/probe_mix.py  (writes $OUT/probe_mix.json)
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import jax
import jax.numpy as jnp
import numpy as np

import pallaskit
from lowering import heuristics
from norms import layernorm_fwd_bwd, rmsnorm_bwd_vjp

OUT = os.environ.get("OUT", "/tmp")
QUICK = os.environ.get("QUICK") == "1"
RESULTS = []


def bench(f, args, n=40, rounds=9):
    out = f(*args)
    jax.block_until_ready(out)
    for _ in range(3):
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
    """Max relative error of each output leaf."""
    a = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(a)]
    b = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(b)]
    return [float(np.abs(x - y).max() / (np.abs(y).max() + 1e-30)) for x, y in zip(a, b)]


def err(a, b):
    return max(errs(a, b))


def record(name, variant, ms, floor_ms, e=None, extra=None):
    row = dict(name=name, variant=variant, ms=round(ms, 4), floor_ms=round(floor_ms, 4),
               frac=round(floor_ms / ms, 3), err=e, **(extra or {}))
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def run_pk(name, variant, f, args, floor, ref, **opts):
    try:
        with pallaskit.config.override(**opts):
            jf = pallaskit.jit(f)
            out = jf(*args)
            e = err(out, ref)
            ms = bench(jf, args)
            kernels = len(pallaskit.explain(f, *args).kernels)
        record(name, variant, ms, floor, e, {"kernels": kernels})
    except Exception as ex:  # keep probing
        RESULTS.append(dict(name=name, variant=variant, error=f"{type(ex).__name__}: {str(ex)[:400]}"))
        print("ERROR", name, variant, type(ex).__name__, str(ex)[:400], flush=True)


M, N = 576000, 384  # the norm probes' size (bf16)


def norm_inputs(rng):
    """x, dy (M x N) and w, b (N), bf16 standard normal."""
    bf = jnp.bfloat16
    return (jnp.asarray(rng.standard_normal((M, N)), bf), jnp.asarray(rng.standard_normal((M, N)), bf),
            jnp.asarray(rng.standard_normal(N), bf), jnp.asarray(rng.standard_normal(N), bf))


def norm_cases(x, dy, w, b):
    """{kind: (name, function, args, arrays moved)} of the two norm backwards."""
    return {"rms": ("rmsnorm_bwd", rmsnorm_bwd_vjp, (x, w, dy), 3),
            "ln": ("layernorm_fwd_bwd", layernorm_fwd_bwd, (x, w, b, dy), 4)}


def nhwc_inputs(rng):
    """The NHWC block's x (32, 25, 25, 1024) and s, b (1, 1024, 1, 1), bf16."""
    bf = jnp.bfloat16
    return (jnp.asarray(rng.standard_normal((32, 25, 25, 1024)), bf),
            jnp.asarray(rng.standard_normal((1, 1024, 1, 1)), bf), jnp.asarray(rng.standard_normal((1, 1024, 1, 1)), bf))


def nhwc(x, s, b):
    """The channels-last example of issue 3 (nvFuser's layout issue)."""
    t = jnp.transpose(x, (0, 3, 1, 2)) * s + b
    return jnp.transpose(jax.nn.relu(t), (0, 2, 3, 1)), jnp.transpose(t > 0, (0, 2, 3, 1))


def plain_relu(x, s, b):
    """The same relu with no transposes: what the NHWC block should cost."""
    return jax.nn.relu(x * s.reshape(1, 1, 1, 1024) + b.reshape(1, 1, 1, 1024))


def main():
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    x, dy, w, b = norm_inputs(rng)

    # RMSNorm backward: read x, dy; write dx (+ tiny dw)
    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(rmsnorm_bwd_vjp)(x, w, dy)
    record("rmsnorm_bwd", "xla", bench(jax.jit(rmsnorm_bwd_vjp), (x, w, dy)), floor)
    run_pk("rmsnorm_bwd", "pallaskit", rmsnorm_bwd_vjp, (x, w, dy), floor, ref)
    run_pk("rmsnorm_bwd", "pallaskit_mix_off", rmsnorm_bwd_vjp, (x, w, dy), floor, ref, mix_order_reduction=False)
    orig_cfg, orig_pps = heuristics.mix_config, heuristics._programs_per_sm
    grid = [(pps, br, wp) for pps in (1, 2, 4, 8) for br in (2, 4, 8, 16) for wp in (4, 8)]
    if QUICK:
        grid = grid[::5]
    for pps, br, wp in grid:
        heuristics._programs_per_sm = (lambda p: lambda cols: p)(pps)
        heuristics.mix_config = (lambda br_, wp_: lambda rows, cols, *, whole_rows, programs, **_: heuristics.TileConfig(
            br_, heuristics.next_power_of_2(cols), wp_, True))(br, wp)
        run_pk("rmsnorm_bwd", f"pps{pps}_br{br}_w{wp}", rmsnorm_bwd_vjp, (x, w, dy), floor, ref)
    heuristics.mix_config, heuristics._programs_per_sm = orig_cfg, orig_pps

    # LayerNorm forward + backward: read x, dy; write y, dx
    floor = 4 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(layernorm_fwd_bwd)(x, w, b, dy)
    record("layernorm_fwd_bwd", "xla", bench(jax.jit(layernorm_fwd_bwd), (x, w, b, dy)), floor)
    run_pk("layernorm_fwd_bwd", "pallaskit", layernorm_fwd_bwd, (x, w, b, dy), floor, ref)
    run_pk("layernorm_fwd_bwd", "pallaskit_mix_off", layernorm_fwd_bwd, (x, w, b, dy), floor, ref,
           mix_order_reduction=False)

    # Column sum and full sum (split reductions)
    xs = jnp.asarray(rng.standard_normal((576001, 383)), bf)
    colsum = lambda a: jnp.sum(a.astype(jnp.float32), axis=0)  # noqa: E731
    fullsum = lambda a: jnp.sum(a.astype(jnp.float32))  # noqa: E731
    floor = 576001 * 383 * 2 / 3.0e12 * 1e3
    for nm, f in (("colsum_576001x383", colsum), ("fullsum_576001x383", fullsum)):
        ref = jax.jit(f)(xs)
        record(nm, "xla", bench(jax.jit(f), (xs,)), floor)
        run_pk(nm, "pallaskit", f, (xs,), floor, ref)
        run_pk(nm, "pallaskit_nosplit", f, (xs,), floor, ref, split_reductions=False)

    # NHWC layout example
    xn, s, bb = nhwc_inputs(rng)
    n = xn.size
    floor = (n * 2 + n * 2 + n * 1) / 3.0e12 * 1e3
    ref = jax.jit(nhwc)(xn, s, bb)
    record("nhwc", "xla", bench(jax.jit(nhwc), (xn, s, bb)), floor)
    run_pk("nhwc", "pallaskit", nhwc, (xn, s, bb), floor, ref)

    # pointwise chain (float32 kept between ops)
    sys.path.insert(0, ".")
    from benchmarks import workloads
    y = jnp.asarray(rng.standard_normal((M, N)), bf)
    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(workloads.pointwise_chain)(x, y)
    record("pointwise_chain", "xla", bench(jax.jit(workloads.pointwise_chain), (x, y)), floor)
    run_pk("pointwise_chain", "pallaskit", workloads.pointwise_chain, (x, y), floor, ref)

    with open(os.path.join(OUT, "probe_mix.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
