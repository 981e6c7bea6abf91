"""Atomic scatters: the gradient of an embedding lookup (GPT-2's token table), and
``segment_max`` (a GNN's max pooling of messages into their nodes).

pallaskit writes a scatter with many updates per element as raw-Triton atomics
over the updates ([Note: atomic scatters] in lowering/ir.py). This times,
for ``jax.vjp(lambda t: t[ids], table)`` given the rows' cotangent (V x D table,
N ids, the cotangent in the table's dtype as jax gives it), or with
``--workload segment_max`` ``jax.ops.segment_max(messages, ids, V)`` (N x D
messages; ``tl.atomic_max``, exact and deterministic, 16-bit floats in a float32
scratch):

- ``jax.jit`` (XLA's scatter);
- ``pallaskit`` (defaults: 16-bit floats accumulate in a float32 scratch,
  ``heuristics.ATOMIC_16BIT_IN_FLOAT32``);
- ``pallaskit 16-bit atomics`` (that heuristic off while compiling: adds in the
  table's dtype; bfloat16 / float16 rows only);
- ``pallaskit deterministic`` (option ``deterministic_scatter``: XLA's scatter with
  ``xla_gpu_exclude_nondeterministic_ops``);
- torch ``index_add_`` (segment_max: ``scatter_reduce_(..., "amax")`` into -inf)
  eager and under ``torch.compile`` (where torch is installed).

Each row: agreement with a float32 reference (jax.jit on float32 inputs, norm-wise
relative error within the dtype's tolerance; segment_max: jax.jit's max, exactly),
whether two runs give the same bits,
ms per call (benchmarks/timing.py) and, on a GPU, device ms of its kernels.
``--law zipf`` draws ids from a Zipf law (frequent tokens: many adds on few rows,
contention on the atomics) instead of uniformly.

    PYTHONPATH=. python -m benchmarks.scatter_add                      # GPU, GPT-2 sizes
    PYTHONPATH=. python -m benchmarks.scatter_add --law zipf
    PYTHONPATH=. python -m benchmarks.scatter_add --workload segment_max --vocab 20000 --ids 500000 --width 64
    PYTHONPATH=. python -m benchmarks.scatter_add --smoke [--workload segment_max]  # CPU (Triton's interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def embedding_grad(table, ids, dy):
    import jax

    return jax.vjp(lambda t: t[ids], table)[1](dy)[0]


def pooled_max(table, ids, messages):
    """segment_max of the messages into the table's rows (the table gives only their number)."""
    import jax

    return jax.ops.segment_max(messages, ids, num_segments=table.shape[0])


WORKLOADS = {"embedding_grad": embedding_grad, "segment_max": pooled_max}


def _inputs(vocab, d, n, dtype, ids_law, seed=0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    if ids_law == "zipf":
        ids = (rng.zipf(1.2, n) - 1) % vocab
    else:
        ids = rng.integers(0, vocab, n)
    table = rng.standard_normal((vocab, d), np.float32)
    dy = rng.standard_normal((n, d), np.float32)
    return jnp.asarray(table, dtype), jnp.asarray(ids, jnp.int32), jnp.asarray(dy, dtype)


def _error(got, want) -> float:
    import numpy as np

    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    same = (g == w) | (np.isnan(g) & np.isnan(w))  # segment_max's empty segments: -inf in both
    scale = np.linalg.norm(np.where(np.isfinite(w), w, 0.0))
    with np.errstate(invalid="ignore"):  # inf - inf where they agree, left out by ``same``
        return float(np.linalg.norm(np.where(same, 0.0, g - w)) / max(scale, 1e-30))


def _torch_rows(args, table, ids, dy, want, tol, row):
    try:
        import torch
    except ImportError:
        row["torch"] = "not installed"
        return
    import numpy as np

    if not torch.cuda.is_available() and not args.smoke:
        row["torch"] = "no CUDA device"
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[table.dtype.name]
    t = torch.tensor(np.asarray(table, np.float32), device=device).to(tdt)
    i = torch.tensor(np.asarray(ids), device=device).long()
    g = torch.tensor(np.asarray(dy, np.float32), device=device).to(tdt)

    def grad(t, i, g):
        return torch.zeros_like(t).index_add_(0, i, g)

    def pooled(t, i, g):
        out = torch.full_like(t, float("-inf"))
        return out.scatter_reduce_(0, i[:, None].expand(-1, g.shape[1]), g, "amax", include_self=True)

    def sync(_):
        if device == "cuda":
            torch.cuda.synchronize()

    from benchmarks import timing

    fn = pooled if args.workload == "segment_max" else grad
    for name, fn in (("torch eager", fn), ("torch.compile", torch.compile(fn))):
        out = fn(t, i, g)
        sync(out)
        row[f"{name} error"] = _error(out.float().cpu().numpy(), want)
        row[f"{name} agrees"] = row[f"{name} error"] <= tol
        if not args.smoke:
            row[f"{name} ms"] = timing.time_ms(lambda: fn(t, i, g), sync, args.rounds)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="embedding_grad")
    ap.add_argument("--vocab", type=int, default=50257, help="table rows (segment_max: segments)")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--ids", type=int, default=8192,
                    help="ids looked up (rows of the cotangent; segment_max: messages)")
    ap.add_argument("--law", choices=["uniform", "zipf"], default="uniform", dest="law")
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, values only")
    args = ap.parse_args(argv)
    if args.smoke:  # raw Triton in its interpreter; set before triton is first imported
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallaskit
    from benchmarks import timing

    vocab, width, n = (301, 24, 997) if args.smoke else (args.vocab, args.width, args.ids)
    sync = jax.block_until_ready
    triton = dict(kernel_backend="triton") if args.smoke else {}
    variants = [("pallaskit", triton, {}),
                ("pallaskit 16-bit atomics", triton, dict(ATOMIC_16BIT_IN_FLOAT32=False)),
                # a float sum through XLA; a max is deterministic anyway: atomic still
                ("pallaskit deterministic", dict(triton, deterministic_scatter=True), {})]
    if args.workload == "segment_max":  # the heuristic is a sum's: a 16-bit max always combines in float32
        variants = [v for v in variants if not v[2]]
    fn = WORKLOADS[args.workload]
    print(json.dumps({"workload": args.workload, "vocab": vocab, "width": width, "ids": n, "law": args.law,
                      "device": str(jax.devices()[0])}), flush=True)
    out = []
    for dtype in (jnp.dtype(d) for d in args.dtypes):
        table, ids, dy = _inputs(vocab, width, n, dtype, args.law)
        want = np.asarray(jax.jit(fn)(table.astype(jnp.float32), ids, dy.astype(jnp.float32)))
        tol = 0.0 if args.workload == "segment_max" else {"bfloat16": 2e-2, "float16": 5e-3}.get(dtype.name, 1e-5)
        row = {"dtype": dtype.name, "distinct ids": int(np.unique(np.asarray(ids)).size)}
        ref = jax.jit(fn)
        row["jax.jit error"] = _error(ref(table, ids, dy), want)
        if not args.smoke:
            row["jax.jit ms"] = timing.time_ms(lambda: ref(table, ids, dy), sync, args.rounds)
            row["jax.jit device ms"] = timing.kernel_ms(lambda: ref(table, ids, dy), sync)
        for vname, opts, patch in variants:
            if patch and dtype.name not in ("bfloat16", "float16"):
                continue
            with pallaskit.config.override(cache=False, **opts), timing.heuristics_set(**patch):
                f = pallaskit.jit(fn)
                got = np.asarray(f(table, ids, dy))
                ex = pallaskit.explain(fn, table, ids, dy)
            row[f"{vname} kernels"] = [f"{k.name} ({k.executor})" for k in ex.kernels] + [
                f"{p} (xla)" for p in ex.fallbacks]
            row[f"{vname} error"] = _error(got, want)
            row[f"{vname} agrees"] = row[f"{vname} error"] <= tol
            row[f"{vname} same bits twice"] = got.tobytes() == np.asarray(f(table, ids, dy)).tobytes()
            if not args.smoke:
                row[f"{vname} ms"] = timing.time_ms(lambda: f(table, ids, dy), sync, args.rounds)
                row[f"{vname} device ms"] = timing.kernel_ms(lambda: f(table, ids, dy), sync)
        _torch_rows(args, table, ids, dy, want, tol, row)
        print(json.dumps(row), flush=True)
        out.append(row)
    bad = [r for r in out if not all(v for k, v in r.items() if k.endswith("agrees"))]
    print("AGREE" if not bad else f"DISAGREE {len(bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
