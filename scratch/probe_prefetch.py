"""GPU probe 5: the RMSNorm-backward mix kernel, hand-written in the generated
style, with the next row's loads issued before this row's work (register
prefetch, carried through the fori_loop), at several depths, program counts
and warps. Baseline (depth 0) is the kernel pallaskit generates today.

PYTHONPATH=. python scratch/probe_prefetch.py [pps,depth,warps,stages[,kind] ...]  (writes $OUT/probe_prefetch.json)
PYTHONPATH=. python scratch/probe_prefetch.py generated  (pallaskit's own mix kernels at prefetch 0, 1, 2)
PYTHONPATH=. python scratch/probe_prefetch.py grid ln:16,0 ln:8,2 ...  (generated, programs per SM x prefetch)
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

import pallaskit
from norms import rmsnorm_bwd_vjp
from probe_mix import M, N, bench, err, norm_cases, norm_inputs, record, RESULTS

OUT = os.environ.get("OUT", "/tmp")
BC = 512
ANY = pl.BlockSpec(memory_space=pl.ANY)
SMS = 132


def _launch(kernel, programs, warps, stages, finish=True):
    """jit of ``(x, w, dy) -> (dx, dw)``: the kernel writes dx and per-program
    partial dw rows, which XLA sums (``finish=False``: the partials as they are)."""
    call = pl.pallas_call(
        kernel, grid=(programs,), in_specs=[ANY, ANY, ANY], out_specs=(ANY, ANY),
        out_shape=(jax.ShapeDtypeStruct((programs * N,), jnp.float32), jax.ShapeDtypeStruct((M * N,), jnp.bfloat16)),
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=jax.default_backend() == "cpu")

    def f(x, w, dy):
        part, dx = call(x.reshape(-1), w.astype(jnp.float32), dy.reshape(-1))
        if not finish:
            return dx, part
        return dx.reshape(M, N), jnp.sum(part.reshape(programs, N), 0).astype(w.dtype)
    return jax.jit(f)


def make(programs, depth, warps=1, stages=1, contiguous=False):
    n_iter = -(-M // programs)

    def kernel(x_ref, w_ref, dy_ref, part_ref, dx_ref):
        pid = pl.program_id(0)
        xc = lax.broadcasted_iota(jnp.int32, (1, BC), 1)
        cmask = xc < N

        def rows(step):
            row = pid * n_iter + step if contiguous else pid + step * programs
            xr = row + lax.broadcasted_iota(jnp.int32, (1, 1), 0)
            return xc + N * xr, (xr < M) & cmask

        def load(step):
            idx, m = rows(step)
            if contiguous:
                m = m & (step < n_iter)
            return plt.load(x_ref.at[idx], mask=m, other=0), plt.load(dy_ref.at[idx], mask=m, other=0)

        def work(step, xv, dyv, acc):
            idx, m = rows(step)
            if contiguous:
                m = m & (step < n_iter)
            x = xv.astype(jnp.float32)
            dy = dyv.astype(jnp.float32)
            w = plt.load(w_ref.at[xc], mask=cmask, other=0)
            ms = jnp.sum(jnp.where(cmask, x * x, 0), axis=1, keepdims=True) / N + 1e-6
            r = lax.rsqrt(ms)
            g = dy * w
            s = jnp.sum(jnp.where(cmask, x * g, 0), axis=1, keepdims=True)
            c = s * (-0.5 * r / ms) / N
            dx = g * r + 2.0 * x * c
            plt.store(dx_ref.at[idx], dx.astype(jnp.bfloat16), mask=m)
            return acc + jnp.where(m, x * r * dy, 0)

        acc = jnp.zeros((1, BC), jnp.float32)
        if depth == 0:
            acc = lax.fori_loop(0, n_iter, lambda i, a: work(i, *load(i), a), acc)
        else:
            pre = tuple(load(d) for d in range(depth))

            def body(i, carry):
                a, buf = carry[0], carry[1:]
                nxt = load(i + depth)
                a = work(i, *buf[0], a)
                return (a,) + buf[1:] + (nxt,)

            out = lax.fori_loop(0, n_iter, body, (acc,) + pre)
            acc = out[0]
        plt.store(part_ref.at[pid * N + xc], acc, mask=cmask)

    return _launch(kernel, programs, warps, stages)


CHUNKS = ((0, 256), (256, 128))  # 384 = 256 + 128: no masked lanes


def make_chunked(programs, depth, warps=1, stages=1, finish=True):
    """The same kernel with each row held as power-of-two column chunks
    (256 + 128) instead of one 512-wide tile with 128 masked lanes."""
    n_iter = -(-M // programs)

    def kernel(x_ref, w_ref, dy_ref, part_ref, dx_ref):
        pid = pl.program_id(0)
        cols = [c0 + lax.broadcasted_iota(jnp.int32, (1, w), 1) for c0, w in CHUNKS]

        def rows(step):
            xr = (pid + step * programs) + lax.broadcasted_iota(jnp.int32, (1, 1), 0)
            return [xc + N * xr for xc in cols], xr < M

        def load(step):
            idx, m = rows(step)
            return tuple((plt.load(x_ref.at[i], mask=m, other=0), plt.load(dy_ref.at[i], mask=m, other=0)) for i in idx)

        def work(step, tiles, accs):
            idx, m = rows(step)
            xs = [t[0].astype(jnp.float32) for t in tiles]
            gs = [t[1].astype(jnp.float32) * plt.load(w_ref.at[xc]) for t, xc in zip(tiles, cols)]
            ms = sum(jnp.sum(x * x, axis=1, keepdims=True) for x in xs) / N + 1e-6
            r = lax.rsqrt(ms)
            s = sum(jnp.sum(x * g, axis=1, keepdims=True) for x, g in zip(xs, gs))
            c = s * (-0.5 * r / ms) / N
            for x, g, i in zip(xs, gs, idx):
                plt.store(dx_ref.at[i], (g * r + 2.0 * x * c).astype(jnp.bfloat16), mask=m)
            return tuple(a + jnp.where(m, x * r * t[1].astype(jnp.float32), 0) for a, x, t in zip(accs, xs, tiles))

        accs = tuple(jnp.zeros((1, w), jnp.float32) for _, w in CHUNKS)
        k = len(CHUNKS)
        if depth == 0:
            accs = lax.fori_loop(0, n_iter, lambda i, a: work(i, load(i), a), accs)
        else:
            pre = tuple(load(d) for d in range(depth))

            def body(i, carry):
                a, buf = carry[:k], carry[k:]
                nxt = load(i + depth)
                a = work(i, buf[0], a)
                return tuple(a) + buf[1:] + (nxt,)

            accs = lax.fori_loop(0, n_iter, body, accs + pre)[:k]
        for a, xc in zip(accs, cols):
            plt.store(part_ref.at[pid * N + xc], a)

    return _launch(kernel, programs, warps, stages, finish)


def generated():
    """The generated mix kernels at MIX_PREFETCH 0 and 2, alternated, beside XLA."""
    from lowering import heuristics
    for name, f, args, nbytes in norm_cases(*norm_inputs(np.random.default_rng(0))).values():
        floor = nbytes * M * N * 2 / 3.0e12 * 1e3
        ref = jax.jit(f)(*args)
        record(name, "xla", bench(jax.jit(f), args), floor)
        for depth in (0, 2, 1, 0, 2):
            heuristics.MIX_PREFETCH = depth
            with pallaskit.config.override(cache=False):
                jf = pallaskit.jit(f)
                record(name, f"generated_prefetch{depth}", bench(jf, args), floor, err(jf(*args), ref))
    with open(os.path.join(OUT, "probe_prefetch_generated.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)
    for r in RESULTS:
        print(r.get("name"), r.get("variant"), r.get("ms"), r.get("frac"), r.get("err"))


def generated_grid(specs):
    """The generated norm kernels at chosen programs per SM and prefetch depth (whatever the
    column-sum count), optionally a whole-row tile: specs ``ln:12,2`` or ``rms:2,0,8,8,3``
    (pps, depth[, block rows, warps, stages])."""
    from lowering import heuristics
    from probe_mix3 import per_sm, restore, whole
    cases = norm_cases(*norm_inputs(np.random.default_rng(0)))
    refs = {}
    for spec in specs:
        kind, rest = spec.split(":")
        pps, depth, *tile = map(int, rest.split(","))
        name, f, args, nbytes = cases[kind]
        floor = nbytes * M * N * 2 / 3.0e12 * 1e3
        if kind not in refs:
            refs[kind] = jax.jit(f)(*args)
            record(name, "xla", bench(jax.jit(f), args), floor)
        restore()
        heuristics._programs_per_sm = per_sm(pps)
        heuristics.MIX_PREFETCH, heuristics.MIX_PREFETCH_MAX_COLUMNS = depth, 8
        label = f"generated_pps{pps}_prefetch{depth}"
        if tile:
            heuristics.mix_config = whole(*tile, prefetch=depth)
            label += "_rows{}_warps{}_stages{}".format(*tile)
        with pallaskit.config.override(cache=False):
            jf = pallaskit.jit(f)
            record(name, label, bench(jf, args), floor, err(jf(*args), refs[kind]))
    with open(os.path.join(OUT, "probe_prefetch_grid.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)
    for r in RESULTS:
        print(r.get("name"), r.get("variant"), r.get("ms"), r.get("frac"), r.get("err"))


def main():
    if sys.argv[1:] == ["generated"]:
        return generated()
    if sys.argv[1:2] == ["grid"]:
        return generated_grid(sys.argv[2:])
    x, dy, w, _ = norm_inputs(np.random.default_rng(0))
    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    ref = jax.jit(rmsnorm_bwd_vjp)(x, w, dy)
    record("rmsnorm_bwd", "xla", bench(jax.jit(rmsnorm_bwd_vjp), (x, w, dy)), floor)
    copy = jax.jit(lambda a: a + 1)
    record("copy_bf16", "xla", bench(copy, (x,)), 2 * M * N * 2 / 3.0e12 * 1e3)
    record("add_2in_1out_bf16", "xla", bench(jax.jit(lambda a, b: a + b), (x, dy)), floor)
    with pallaskit.config.override(cache=False):
        jf = pallaskit.jit(rmsnorm_bwd_vjp)
        record("rmsnorm_bwd", "pallaskit", bench(jf, (x, w, dy)), floor, err(jf(x, w, dy), ref))
    if os.environ.get("KERNEL_TIMES"):
        import kernel_times
        print(kernel_times.kernel_times(rmsnorm_bwd_vjp, (x, w, dy)))
    variants = [(16, 0, 1, 1), (16, 1, 1, 1), (16, 2, 1, 1), (8, 1, 1, 1), (8, 2, 1, 1), (12, 1, 1, 1),
                (24, 1, 1, 1), (4, 2, 2, 1), (8, 1, 2, 1), (4, 4, 1, 1), (16, 1, 1, 2)]
    if len(sys.argv) > 1:
        variants = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:]]
    for v in variants:
        pps, depth, warps, stages = v[:4]
        kind = v[4] if len(v) > 4 else 0  # 1 contiguous rows, 2 column chunks, 3 chunks without the finisher
        name = f"pps{pps}_d{depth}_w{warps}_st{stages}" + ("", "_contig", "_chunks", "_chunks_nofinish")[kind]
        try:
            if kind >= 2:
                f = make_chunked(pps * SMS, depth, warps, stages, finish=kind == 2)
            else:
                f = make(pps * SMS, depth, warps, stages, kind == 1)
            out = f(x, w, dy)
            if kind == 3:
                record("rmsnorm_bwd", name, bench(f, (x, w, dy)), floor)
                continue
            record("rmsnorm_bwd", name, bench(f, (x, w, dy)), floor, err(out, ref))
        except Exception as ex:  # keep probing
            RESULTS.append(dict(name="rmsnorm_bwd", variant=name, error=f"{type(ex).__name__}: {str(ex)[:400]}"))
            print("ERROR", name, type(ex).__name__, str(ex)[:400], flush=True)
    with open(os.path.join(OUT, "probe_prefetch.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)
    for r in RESULTS:
        print(r.get("variant"), r.get("ms"), r.get("frac"), r.get("err"), r.get("error", ""))


if __name__ == "__main__":
    main()
