"""Rows longer than one tile: a softmax and a cross-entropy over a GPT-2
vocabulary (rows x 50,257), pallaskit's long-row paths side by side.

    python -m benchmarks.long_rows [--rows 8192 --vocab 50257 --dtype bfloat16]
        [--cases softmax,xent_one_hot,xent_take] [--variants default,persistent,...] [--json OUT]
    python -m benchmarks.long_rows --smoke        # CPU, interpret mode: tiny sizes, checks only

Variants (pallaskit config overrides at compile time, the first call):

- ``default``: the heuristics (heuristics.long_row_persistent: rows up to 32768
  columns of 4-byte values persistent; a 50,257 row loops, online softmax).
- ``persistent``: option long_rows='persistent' (a 65536-wide tile a row, read once,
  32 warps); ``persistent_w16``: the same with 16 warps (option num_warps).
- ``looped_online``: long_rows='looped' (4096-wide chunks; the max and the sum of
  exp share the first sweep, the outputs the second).
- ``looped_3sweep``: long_rows='looped', online_softmax=False (max, sum, outputs:
  three sweeps; the path before online softmax).

Each is checked against jax.jit (NaN positions equal, the rest within the dtype's
tolerance) and timed beside jax.jit and torch.compile (when torch with CUDA is
installed): median over rounds of back-to-back calls (benchmarks/timing.py; the
host clock after block_until_ready for JAX, CUDA events for torch). The floor is
the bytes each case must move (inputs read once, outputs written once) over
benchmarks/hardware.py's copy bandwidth. Each pallaskit variant's kernels are
listed with their tiles (block, warps, persistent or looped).
"""
from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import hardware, timing

VARIANTS = {
    "default": {},
    "persistent": {"long_rows": "persistent"},
    "persistent_w16": {"long_rows": "persistent", "num_warps": 16},
    "looped_online": {"long_rows": "looped"},
    "looped_3sweep": {"long_rows": "looped", "online_softmax": False},
}


def softmax(x):
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def _xent_loss(form):
    def loss(logits, labels):
        lf = logits.astype(jnp.float32)
        if form == "take":  # optax.softmax_cross_entropy_with_integer_labels
            picked = jnp.take_along_axis(lf, labels[:, None], axis=-1)[:, 0]
            return jnp.mean(jax.nn.logsumexp(lf, axis=-1) - picked)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, lf.shape[-1]) * jax.nn.log_softmax(lf, axis=-1), axis=-1))
    return loss


def xent_fn(form):
    fn = jax.value_and_grad(_xent_loss(form))
    fn.__name__ = f"xent_{form}_fwd_bwd"
    return fn


CASES = {
    "softmax": (softmax, "softmax over the last axis in float32, output in the input dtype"),
    "xent_one_hot": (xent_fn("one_hot"), "cross-entropy (one_hot labels) and its gradient w.r.t. the logits"),
    "xent_take": (xent_fn("take"), "cross-entropy (take_along_axis labels) and its gradient w.r.t. the logits"),
}


def _torch_case(name):
    import torch
    import torch.nn.functional as F

    if name == "softmax":
        return lambda x: torch.softmax(x.float(), dim=-1).to(x.dtype)

    def loss(logits, labels):
        lf = logits.float()
        if name == "xent_take":
            return F.cross_entropy(lf, labels.long())
        return -(F.one_hot(labels.long(), lf.shape[-1]) * F.log_softmax(lf, dim=-1)).sum(-1).mean()

    compiled = torch.compile(loss)

    def fwd_bwd(logits, labels):
        logits = logits.detach().requires_grad_()
        value = compiled(logits, labels)
        return value.detach(), torch.autograd.grad(value, logits)[0]
    return fwd_bwd


def inputs(name, rows, vocab, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(k1, (rows, vocab), jnp.float32) * 2.0).astype(dtype)
    if name == "softmax":
        return (x,)
    return x, jax.random.randint(k2, (rows,), 0, vocab, jnp.int32)


def nbytes(tree) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))


def agreement(got, want, dtype) -> tuple[bool, float]:
    """(ok, worst error): NaN positions equal; elsewhere max |g - w| over max |w|
    (float32, on the device: the arrays are a gigabyte each)."""
    tol = 2e-2 if np.dtype(dtype).itemsize == 2 else 1e-4
    worst, ok = 0.0, True
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        if g.shape != w.shape:
            return False, float("inf")
        g, w = jnp.asarray(g, jnp.float32), jnp.asarray(w, jnp.float32)
        if bool(jnp.any(jnp.isnan(g) != jnp.isnan(w))):
            return False, float("inf")
        fin = jnp.isfinite(w)
        scale = float(jnp.max(jnp.where(fin, jnp.abs(w), 0.0))) + 1e-30
        err = float(jnp.max(jnp.where(fin, jnp.abs(g - w), 0.0))) / scale
        worst = max(worst, err)
        ok &= err <= tol
    return ok, worst


def kernels_of(fn, args, overrides) -> list[str]:
    """One line per kernel of the pallaskit program: name, kind, tile, warps."""
    import lowering
    import pallaskit
    from pallaskit import api

    with pallaskit.config.override(**overrides):
        options = api.compile_options()
    result = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), options)
    lines = []
    for k in result.program.kernels:
        c = k.config
        mode = "persistent" if getattr(c, "persistent", False) else "looped"
        lines.append(f"{k.name}: block {c.block_rows} x {c.block_cols}, {c.num_warps} warps, {mode}")
    lines += [f"XLA: {p.name}" for p, _ in result.program.externs]
    return lines


def time_jax(fn, args, rounds):
    clock = timing.HostClock(jax.block_until_ready)
    return timing.measure(lambda i: fn(*args), clock, rounds=rounds).ms


def time_torch(fn, args, rounds):
    import torch

    clock = timing.CudaEventClock(torch)
    return timing.measure(lambda i: fn(*args), clock, rounds=rounds).ms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, checks only (the CPU)")
    ap.add_argument("--json", default="", help="write the rows here")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.vocab, a.rounds = 5, 33000, 3  # 65536 wide: the default loops
    import pallaskit

    dtype = jnp.dtype(a.dtype)
    on_gpu = jax.default_backend() == "gpu"
    print(f"long rows: {a.rows} x {a.vocab} {a.dtype} on {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = []
    for case in a.cases.split(","):
        fn, what = CASES[case]
        args = inputs(case, a.rows, a.vocab, dtype)
        ref_fn = jax.jit(fn)
        want = jax.block_until_ready(ref_fn(*args))
        floor = hardware.floor_ms(nbytes(args) + nbytes(want))
        print(f"\n== {case}: {what}; floor {floor:.3f} ms (read inputs, write outputs at "
              f"{hardware.COPY_BANDWIDTH / 1e12:.1f} TB/s)")

        def report(name, ms, ok=True, err=0.0, kernels=()):
            pct = f"{100 * floor / ms:5.1f}% of floor" if ms else ""
            status = "ok" if ok else f"MISMATCH (worst relative error {err:.3g})"
            print(f"  {name:24s} {ms:8.3f} ms  {pct}  {status}")
            for line in kernels:
                print(f"      {line}")
            rows.append(dict(case=case, variant=name, ms=ms, floor_ms=floor, ok=bool(ok), rel_err=err,
                             kernels=list(kernels), rows=a.rows, vocab=a.vocab, dtype=a.dtype))

        report("jax.jit", time_jax(ref_fn, args, a.rounds))
        for variant in a.variants.split(","):
            overrides = {"cache": False, **VARIANTS[variant]}
            missing = [k for k in overrides if k not in pallaskit.config.snapshot()]
            if missing:
                print(f"  {'pallaskit ' + variant:24s} skipped: no option {', '.join(missing)}")
                continue
            pk = pallaskit.jit(fn)
            with pallaskit.config.override(**overrides):  # options act at compile time
                got = jax.block_until_ready(pk(*args))
            ok, err = agreement(got, want, dtype)
            report(f"pallaskit {variant}", time_jax(pk, args, a.rounds), ok, err, kernels_of(fn, args, overrides))
        if on_gpu and not a.no_torch:
            try:
                import torch

                if not torch.cuda.is_available():
                    raise ImportError("no CUDA in torch")
                targs = [torch.from_dlpack(x) for x in args]
                tfn = _torch_case(case)
                tfn = torch.compile(tfn) if case == "softmax" else tfn
                tout = tfn(*targs)
                torch.cuda.synchronize()
                from benchmarks.backends import to_jax

                ok, err = agreement([to_jax(t) for t in (tout if isinstance(tout, tuple) else (tout,))],
                                    jax.tree_util.tree_leaves(want), dtype)
                report("torch.compile", time_torch(tfn, targs, a.rounds), ok, err)
            except ImportError as e:
                print(f"  torch.compile skipped: {e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"\nwrote {a.json}")
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise SystemExit(f"{len(bad)} variant(s) disagree with jax.jit: "
                         + ", ".join(f"{r['case']}/{r['variant']}" for r in bad))


if __name__ == "__main__":
    main()
