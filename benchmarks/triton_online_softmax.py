"""Online softmax in the raw-Triton dialect: check against jax.jit and time.

Looped row reductions of both dialects are written once (lowering/codegen/rows.py),
so raw-Triton kernels now fold a softmax's max and sum(exp) into one sweep
([Note: online softmax]) as Pallas's did. Each row: softmax, logsumexp and a
cross-entropy forward+backward over rows of 50,257 (and 8193) with
``long_rows='looped'``, raw Triton (kernel_backend='triton') with
``online_softmax`` on and off, Pallas with it on, and jax.jit: agreement with
jax.jit (NaN / inf positions equal, the rest within the dtype's tolerance), the
time per call (benchmarks/timing.py) and, on a GPU, the device time of its
kernels (``timing.kernel_ms``).

    PYTHONPATH=. python -m benchmarks.triton_online_softmax            # GPU
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


def _xent(logits, labels):
    def loss(logits):
        ls = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(ls, labels[:, None], axis=-1)[:, 0]
        return -jnp.mean(picked.astype(jnp.float32))

    return jax.value_and_grad(loss)(logits)


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--cols", type=int, nargs="*", default=[50257, 8193])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="tiny rows on the CPU, values only")
    args = ap.parse_args(argv)
    import pallaskit
    from benchmarks import timing

    rows = 4 if args.smoke else args.rows
    sync = jax.block_until_ready
    variants = [("triton online", dict(kernel_backend="triton", online_softmax=True)),
                ("triton two sweeps", dict(kernel_backend="triton", online_softmax=False)),
                ("pallas online", dict(kernel_backend="pallas", online_softmax=True))]
    out = []
    for cols in args.cols:
        for dtype in (jnp.bfloat16, jnp.float32):
            x, labels = _inputs(rows, cols, dtype)
            for name, fn, fargs in (("softmax+logsumexp", _softmaxes, (x,)), ("cross-entropy fwd+bwd", _xent, (x, labels))):
                want = jax.jit(fn)(*fargs)
                row = {"workload": name, "cols": cols, "dtype": jnp.dtype(dtype).name}
                if not args.smoke:
                    ref = jax.jit(fn)
                    row["jax.jit ms"] = timing.time_ms(lambda: ref(*fargs), sync, args.rounds)
                for vname, opts in variants:
                    with pallaskit.config.override(long_rows="looped", cache=False, **opts):
                        f = pallaskit.jit(fn)
                        got = f(*fargs)
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
