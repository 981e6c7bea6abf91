"""Looped raw-Triton row reductions over long rows: online softmax and aligned row windows.

Looped row reductions of both dialects are written once (lowering/codegen/rows.py).
Three raw-Triton choices are timed here, each a heuristic patched while pallaskit
compiles: ``heuristics.TRITON_STAGED_ROWS`` (the row staged once in shared memory,
a Gluon kernel: [Note: staged rows]), ``heuristics.TRITON_ONLINE_SOFTMAX`` (a
softmax's max and sum(exp) in one sweep, [Note: online softmax]; off: two sweeps)
and ``heuristics.TRITON_ALIGNED_ROWS`` (rows of odd length read and written from a
vector-aligned base, so that Triton emits 16-byte accesses: [Note: aligned row windows]). Workloads over rows of 50,257
(and 8193) columns with ``long_rows='looped'``: softmax + logsumexp, and a
cross-entropy's value and gradient w.r.t. the logits with take_along_axis labels
and with one_hot labels. Rows: raw Triton (kernel_backend='triton') staged, and unstaged
under the four combinations of the other two, Pallas with its online softmax (``--pallas``), and jax.jit.
Each row: agreement with jax.jit (NaN / inf positions equal, the rest within the
dtype's tolerance), time per call (benchmarks/timing.py) and, on a GPU, the device
time of its kernels (``timing.kernel_ms``), and the main kernel's tile and whether
it reads through the aligned window ("window"). The window needs one row a
program; looped rows under 64 KB take two (``heuristics.LOOPED_ONE_ROW_BYTES``):
``--one-row`` patches that to 0, so that 8193 columns take one row a program too.

    PYTHONPATH=. python -m benchmarks.triton_online_softmax            # GPU
    PYTHONPATH=. python -m benchmarks.triton_online_softmax --cols 8193 --one-row
    PYTHONPATH=. python -m benchmarks.triton_online_softmax --smoke    # CPU (Triton's interpreter), values only
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np


def _softmaxes(x):
    return jax.nn.softmax(x, -1), jax.nn.logsumexp(x, -1)


def _xent(labels_by):
    def fwd_bwd(logits, labels):
        def loss(logits):
            ls = jax.nn.log_softmax(logits, axis=-1)
            if labels_by == "one_hot":
                picked = jnp.sum(ls * jax.nn.one_hot(labels, logits.shape[-1], dtype=ls.dtype), axis=-1)
            else:
                picked = jnp.take_along_axis(ls, labels[:, None], axis=-1)[:, 0]
            return -jnp.mean(picked.astype(jnp.float32))

        return jax.value_and_grad(loss)(logits)

    return fwd_bwd


WORKLOADS = {"softmax_lse": (_softmaxes, False), "xent_take": (_xent("take"), True),
             "xent_one_hot": (_xent("one_hot"), True)}


def _inputs(rows, cols, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 3
    x[1 % rows] = -np.inf  # a row of -inf, one +inf, one NaN
    x[2 % rows, rng.integers(cols)] = np.inf
    x[3 % rows, rng.integers(cols)] = np.nan
    labels = rng.integers(0, cols, rows).astype(np.int32)
    return jnp.asarray(x, dtype), jnp.asarray(labels)


def _agree(got, want, dtype) -> bool:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        for test in (np.isnan, np.isposinf, np.isneginf):
            if not np.array_equal(test(g64), test(w64)):
                return False
        finite = np.isfinite(w64)
        tol = 2e-2 if dtype == jnp.bfloat16 else 2e-5
        if not np.allclose(np.where(finite, g64, 0), np.where(finite, w64, 0), rtol=tol, atol=tol):
            return False
    return True


def _main_kernel(fn, args) -> str:
    """The first looped kernel of pallaskit's program under the current options and
    heuristics: its tile, and "window" where it reads through the aligned window."""
    import lowering
    from pallaskit import api

    result = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), api.compile_options())
    for k in result.program.kernels:
        c = k.config
        if not getattr(c, "persistent", True):
            window = ("staged" if "rows staged in shared memory" in k.source
                      else "window" if "wa = tl.multiple_of(" in k.source else "no window")
            return f"{c.block_rows} x {c.block_cols}, {c.num_warps} warps, {window}"
    return "no looped kernel"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, nargs="*", default=[50257, 8193])
    ap.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--pallas", action="store_true", help="also Pallas with its online softmax")
    ap.add_argument("--one-row", action="store_true", help="one row a program for every looped row "
                    "(heuristics.LOOPED_ONE_ROW_BYTES = 0)")
    ap.add_argument("--smoke", action="store_true", help="tiny rows on the CPU, values only")
    args = ap.parse_args(argv)
    import pallaskit
    from benchmarks import timing
    from lowering import heuristics

    rows = 4 if args.smoke else args.rows
    sync = jax.block_until_ready
    one_row = dict(LOOPED_ONE_ROW_BYTES=0) if args.one_row else {}
    variants = [("triton staged", dict(kernel_backend="triton"), dict(TRITON_STAGED_ROWS=True))]
    variants += [(f"triton {'online' if online else 'two sweeps'}{', aligned' if aligned else ''}",
                  dict(kernel_backend="triton"),
                  dict(TRITON_STAGED_ROWS=False, TRITON_ONLINE_SOFTMAX=online, TRITON_ALIGNED_ROWS=aligned))
                 for online in (False, True) for aligned in (True, False)]
    if args.pallas:
        variants.append(("pallas online", dict(kernel_backend="pallas", online_softmax=True), {}))
    print(json.dumps({"defaults": {"TRITON_ONLINE_SOFTMAX": heuristics.TRITON_ONLINE_SOFTMAX,
                                   "TRITON_ALIGNED_ROWS": heuristics.TRITON_ALIGNED_ROWS}, "rows": rows,
                      "one_row": args.one_row}), flush=True)
    out = []
    for cols in args.cols:
        for dtype in (jnp.dtype(d) for d in args.dtypes):
            x, labels = _inputs(rows, cols, dtype)
            for name in args.workloads:
                fn, takes_labels = WORKLOADS[name]
                fargs = (x, labels) if takes_labels else (x,)
                ref = jax.jit(fn)
                want = ref(*fargs)
                row = {"workload": name, "cols": cols, "dtype": dtype.name}
                if not args.smoke:
                    row["jax.jit ms"] = timing.time_ms(lambda: ref(*fargs), sync, args.rounds)
                    row["jax.jit device ms"] = timing.kernel_ms(lambda: ref(*fargs), sync)
                for vname, opts, patch in variants:
                    with pallaskit.config.override(long_rows="looped", cache=False, **opts), \
                            timing.heuristics_set(**one_row, **patch):
                        f = pallaskit.jit(fn)
                        got = f(*fargs)
                        row[f"{vname} kernel"] = _main_kernel(fn, fargs)
                    row[f"{vname} agrees"] = _agree(got, want, dtype)
                    if not args.smoke:
                        row[f"{vname} ms"] = timing.time_ms(lambda: f(*fargs), sync, args.rounds)
                        row[f"{vname} device ms"] = timing.kernel_ms(lambda: f(*fargs), sync)
                print(json.dumps(row), flush=True)
                out.append(row)
    bad = [r for r in out if not all(v for k, v in r.items() if k.endswith("agrees"))]
    print("AGREE" if not bad else f"DISAGREE {len(bad)}")
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
