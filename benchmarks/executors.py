"""Kernel executors on the GPU: raw Triton inside XLA against Pallas, per kernel kind.

``kernel_backend='auto'`` runs every kernel kind as raw Triton inside the XLA
program on a GPU (lowering/executors.py ``GPU_AUTO``), where pallaskit used to
run Pallas's (deprecated) Triton backend. No suite workload may get slower for
it: this benchmark times a handful of workloads under ``kernel_backend='pallas'``
and ``'triton'`` in one process, alternating A/B, checks each against jax.jit,
and lists which executor ran each kernel (a 'triton' row whose kernels fell back
to Pallas says so). Where 'triton' loses on a kind, ``GPU_AUTO`` names Pallas
for it, with this benchmark as its reason.

    JAX_PLATFORMS=cuda,cpu PALLASKIT_INTERPRET=0 PYTHONPATH=. python -m benchmarks.executors [--output DIR]
    PYTHONPATH=. python -m benchmarks.executors --smoke    # CPU: interpret mode, tiny sizes, no figures

The GPU tests with Pallas's Triton lowering disabled (tests/conftest.py: every
kernel must then run as raw Triton inside XLA):

    TEST_DISABLE_PALLAS_TRITON=1 JAX_PLATFORMS=cuda,cpu PALLASKIT_INTERPRET=0 python -m pytest -q tests/
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import hardware, timing
from benchmarks.workloads import WORKLOADS, bytes_moved

BACKENDS = ("pallas", "triton")

# (label, suite workload, full size, smoke size, options, dynamic axis 0 of argument 0)
CASES = [
    ("pointwise_chain", "pointwise_chain", (576000, 384), (33, 100), {}, False),
    ("softmax", "softmax", (32768, 4096), (17, 300), {}, False),
    ("rmsnorm_fwd", "rmsnorm_fwd", (576000, 384), (33, 100), {}, False),
    ("layernorm_fwd", "layernorm_fwd", (576000, 384), (33, 100), {}, False),
    ("layernorm_fwd_bwd", "layernorm_fwd_bwd", (576000, 384), (1100, 100), {}, False),
    ("rmsnorm_bwd", "rmsnorm_bwd", (576000, 384), (1100, 100), {}, False),
    # A column sum alone (split over row blocks: the 'column' kind).
    ("column_sum", "column_sum", (576001, 383), (3001, 9), {}, False),
    # Mix kernels over rows too long for a two-row raw-Triton tile (executors kind 'mix_long_rows'):
    # model widths of 4096 and 8192 (one column sum) and of 2048 and 4096 (LayerNorm's two).
    ("rmsnorm_bwd_4096", "rmsnorm_bwd", (65536, 4096), (9, 4096), {}, False),
    ("layernorm_fwd_bwd_2048", "layernorm_fwd_bwd", (131072, 2048), (9, 2048), {}, False),
    ("rmsnorm_bwd_8192", "rmsnorm_bwd", (32768, 8192), (9, 8192), {}, False),
    ("layernorm_fwd_bwd_4096", "layernorm_fwd_bwd", (65536, 4096), (9, 4096), {}, False),
    # The matmul template with its gelu epilogue (512 rows: 'auto' picks the template).
    ("gelu_mlp_512", "gelu_mlp", (512, 1024, 4096, 1024), (24, 32, 64, 32), {}, False),
    ("gelu_mlp", "gelu_mlp", (8192, 1024, 4096, 1024), (24, 32, 64, 32), {}, False),
    # A symbolic program inside XLA (eager launches off): sizes as kernel arguments.
    ("rmsnorm_fwd_dynamic", "rmsnorm_fwd", (300001, 384), (33, 100), {"dynamic_launch": "off"}, True),
]


def _column_sum(x):
    return jnp.sum(x.astype(jnp.float32), axis=0)


def _inputs(workload, size, dtype, sets, seed):
    if workload == "column_sum":
        rng = np.random.default_rng(seed)
        return [(jnp.asarray(rng.standard_normal(size, np.float32), dtype),) for _ in range(sets)]
    w = WORKLOADS[workload]
    return [w.make_inputs(size, dtype, jax.random.key(seed + i)) for i in range(sets)]


def _fn(workload):
    return _column_sum if workload == "column_sum" else WORKLOADS[workload].jax_fn


def _tolerance(dtype, workload):
    base = 2e-2 if np.dtype(dtype).itemsize == 2 else 1e-4
    extra = 0.0 if workload == "column_sum" else WORKLOADS[workload].tol
    return base + extra


def _check(got, want, tol) -> float:
    """Largest |got - want| / (1 + |want|); raises past ``tol``."""
    worst = 0.0
    for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            raise AssertionError(f"shape {a.shape} != {e.shape}")
        finite = np.isfinite(e)
        if not np.array_equal(np.isnan(a), np.isnan(e)):
            raise AssertionError("NaNs differ from jax.jit's")
        err = np.abs(a[finite] - e[finite]) / (1 + np.abs(e[finite]))
        worst = max(worst, float(err.max()) if err.size else 0.0)
    if worst > tol:
        raise AssertionError(f"differs from jax.jit: {worst:.3g} > {tol}")
    return worst


def _executors(fn, args) -> dict:
    import pallaskit

    ex = pallaskit.explain(fn, *args)
    count = collections.Counter(k.executor for k in ex.kernels)
    fallbacks = sorted({k.reason for k in ex.kernels if "does not write" in k.reason})
    return {"kernels": dict(count), "xla_primitives": list(ex.fallbacks), "triton_refused": fallbacks}


def run_case(label, workload, size, options, dynamic, dtype, args) -> dict:
    import pallaskit

    fn = _fn(workload)
    sets = hardware.input_sets(bytes_moved(_inputs(workload, size, dtype, 1, 0)[0])) if not args.smoke else 1
    inputs = _inputs(workload, size, dtype, sets, 0)
    want = jax.jit(fn)(*inputs[0])
    outputs_bytes = bytes_moved(want)
    row = {"case": label, "workload": workload, "size": list(size), "dtype": str(np.dtype(dtype)),
           "options": options, "floor_ms": hardware.floor_ms(bytes_moved(inputs[0]) + outputs_bytes,
                                                             (WORKLOADS[workload].flops or (lambda s: 0))(size)
                                                             if workload in WORKLOADS else 0, str(np.dtype(dtype)))}
    compiled = {}
    for backend in BACKENDS:
        opts = {"kernel_backend": backend, **options}
        with pallaskit.config.override(**opts):
            f = pallaskit.jit(fn, dynamic={0: {0: "n"}}) if dynamic else pallaskit.jit(fn)
            got = f(*inputs[0])
            row[f"{backend}_error"] = _check(got, want, _tolerance(dtype, workload))
            if dynamic:  # a second size through the same symbolic program
                other = _inputs(workload, (size[0] - 7,) + tuple(size[1:]), dtype, 1, 1)[0]
                _check(f(*other), jax.jit(fn)(*other), _tolerance(dtype, workload))
            row[f"{backend}_executors"] = _executors(f, inputs[0])
        compiled[backend] = (f, opts)
    if args.smoke:
        return row
    clock = timing.HostClock(jax.block_until_ready)
    samples = {b: [] for b in BACKENDS + ("xla",)}
    xla = jax.jit(fn)
    for _ in range(args.repeats):  # A/B alternating, so drift hits both
        for backend in BACKENDS:
            f, opts = compiled[backend]
            with pallaskit.config.override(**opts):
                t = timing.measure(lambda i, f=f: f(*inputs[i % sets]), clock, rounds=args.rounds)
            samples[backend].append(t.ms)
        samples["xla"].append(timing.measure(lambda i: xla(*inputs[i % sets]), clock, rounds=args.rounds).ms)
    for b, ms in samples.items():
        row[f"{b}_ms"] = statistics.median(ms)
        row[f"{b}_ms_all"] = ms
    row["triton_over_pallas"] = row["triton_ms"] / row["pallas_ms"]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, values checked, nothing timed")
    parser.add_argument("--cases", default="", help="comma-separated case labels (default: all)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="A/B alternations; each a median of --rounds")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", default="", help="directory for executors.json")
    args = parser.parse_args(argv)
    import pallaskit

    pallaskit.config.update(cache=False)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    dtype = jnp.dtype(args.dtype)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    header = f"{'case':22s} {'pallas ms':>10s} {'triton ms':>10s} {'xla ms':>9s} {'floor':>7s} {'T/P':>6s}  executors"
    print(header)
    for label, workload, full, smoke, options, dynamic in CASES:
        if wanted and label not in wanted:
            continue
        size = smoke if args.smoke else full
        try:
            row = run_case(label, workload, size, options, dynamic, dtype, args)
        except Exception as e:  # noqa: BLE001  (one case's failure is a row, not the end of the run)
            row = {"case": label, "error": f"{type(e).__name__}: {e}"}
            print(f"{label:22s} FAILED {row['error']}")
            rows.append(row)
            continue
        rows.append(row)
        ex = row["triton_executors"]
        note = f"triton run: {ex['kernels']}" + (f"; refused: {ex['triton_refused']}" if ex["triton_refused"] else "")
        if args.smoke:
            print(f"{label:22s} {'ok':>10s} {'ok':>10s} {'':>9s} {'':>7s} {'':>6s}  {note}")
        else:
            print(f"{label:22s} {row['pallas_ms']:10.4f} {row['triton_ms']:10.4f} {row['xla_ms']:9.4f} "
                  f"{row['floor_ms']:7.4f} {row['triton_over_pallas']:6.3f}  {note}")
    slower = [r["case"] for r in rows if r.get("triton_over_pallas", 0) > 1.02]
    print(f"raw Triton more than 2% slower than Pallas on: {', '.join(slower) or 'none'}")
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "executors.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
