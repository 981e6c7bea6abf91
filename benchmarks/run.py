"""Benchmark runner: every workload under pallaskit, XLA, torch eager and
torch.compile, in one process, on the same inputs.

    python -m benchmarks.run                       # full sizes on the GPU
    python -m benchmarks.run --smoke               # tiny sizes, CPU interpret mode
    python -m benchmarks.run --workloads=softmax --backends=pallaskit,xla
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

import pallaskit
from benchmarks.timing import time_ms
from benchmarks.workloads import WORKLOADS

BACKENDS = ("pallaskit", "xla", "torch_eager", "torch_compile")
FLOOR_BANDWIDTH = 3.0e12  # bytes/s, H100 device-to-device copy (DESIGN.md)

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", list(WORKLOADS), f"Workloads to run; valid: {', '.join(WORKLOADS)}")
flags.DEFINE_list("backends", list(BACKENDS), f"Backends to run; valid: {', '.join(BACKENDS)}")
flags.DEFINE_list("dtypes", ["bfloat16"], "Dtypes (bfloat16, float32, float16)")
flags.DEFINE_bool("smoke", False, "Tiny sizes: runs on the CPU in interpret mode in seconds")
flags.DEFINE_integer("repeats", 7, "Timing rounds (the median is reported)")
flags.DEFINE_string("output", "benchmarks/out", "Folder for results.json and results.md")


def _validate():
    for name, valid, what in ((FLAGS.workloads, WORKLOADS, "workload"), (FLAGS.backends, BACKENDS, "backend")):
        bad = [n for n in name if n not in valid]
        if bad:
            raise app.UsageError(f"unknown {what}(s) {bad}; valid: {', '.join(valid)}")
    for d in FLAGS.dtypes:
        if d not in ("bfloat16", "float32", "float16"):
            raise app.UsageError(f"unknown dtype {d}; valid: bfloat16, float32, float16")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _jax_sync(out):
    jax.block_until_ready(out)


def _measure_copy_bandwidth() -> float:
    n = (256 << 20) // 4 if jax.default_backend() != "cpu" else 1 << 20
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    ms = time_ms(lambda: f(x), _jax_sync)
    return 2 * n * 4 / (ms * 1e-3)


def _versions():
    v = {"python": platform.python_version(), "jax": jax.__version__, "pallaskit": pallaskit.__version__,
         "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
         "date": datetime.date.today().isoformat()}
    torch = _torch()
    if torch is not None:
        import triton

        v.update(torch=torch.__version__, triton=triton.__version__)
    return v


def _backend_fns(workload, backends, notes):
    fns = {}
    torch = _torch()
    for b in backends:
        if b == "pallaskit":
            fns[b] = ("jax", pallaskit.jit(workload.jax_fn))
        elif b == "xla":
            fns[b] = ("jax", jax.jit(workload.jax_fn))
        elif torch is None:
            notes.add(f"{b}: skipped (torch with CUDA not available)")
        elif workload.torch_fn is None:
            notes.add(f"{b}: no torch definition for {workload.name}")
        elif b == "torch_eager":
            fns[b] = ("torch", workload.torch_fn)
        elif b == "torch_compile":
            fns[b] = ("torch", torch.compile(workload.torch_fn))
    return fns


def run_one(workload, dtype, backends, notes, repeats):
    size = workload.sizes["smoke" if FLAGS.smoke else "full"]
    inputs = workload.make_inputs(size, jnp.dtype(dtype), jax.random.key(hash(workload.name) % 2**31))
    reference = jax.jit(workload.jax_fn)(*inputs)
    floor_bytes = workload.min_bytes(inputs, reference)
    rows = []
    for name, (kind, fn) in _backend_fns(workload, backends, notes).items():
        if kind == "jax":
            call, sync, to_np = (lambda f=fn: f(*inputs)), _jax_sync, np.asarray
        else:
            import torch

            t_in = [torch.from_dlpack(x) for x in inputs]
            call = lambda f=fn: f(*t_in)
            sync = lambda out: torch.cuda.synchronize()
            to_np = lambda t: t.float().cpu().numpy()
        out = call()
        for got, want in zip(jax.tree_util.tree_leaves(out) if kind == "jax" else [out],
                             jax.tree_util.tree_leaves(reference)):
            got = np.asarray(to_np(got), np.float32)
            want = np.asarray(want, np.float32)
            err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-12))
            if not np.isfinite(got).all() or err > workload.rtol:
                raise AssertionError(f"{workload.name}/{name} disagrees with XLA: relative error {err:.3g}")
        ms = time_ms(call, sync, rounds=repeats)
        floor_ms = floor_bytes / FLOOR_BANDWIDTH * 1e3
        rows.append(dict(workload=workload.name, dtype=dtype, size="x".join(map(str, size)), backend=name,
                         ms=round(ms, 4), floor_ms=round(floor_ms, 4), frac_of_floor=round(floor_ms / ms, 3)))
        print(f"{workload.name:18s} {dtype:9s} {name:14s} {ms:9.4f} ms  floor {floor_ms:.4f}  "
              f"({floor_ms / ms:5.1%})", flush=True)
    return rows


def markdown(rows, meta) -> str:
    lines = [f"Device: {meta['device']} ({meta['backend']}); date {meta['date']}; "
             + ", ".join(f"{k} {meta[k]}" for k in ("jax", "torch", "triton", "pallaskit") if k in meta)
             + f"; measured copy bandwidth {meta['copy_bandwidth_tbs']:.2f} TB/s; floor at 3.0 TB/s.", "",
             "| workload | dtype | size | backend | median ms | floor ms | fraction of floor |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['dtype']} | {r['size']} | {r['backend']} | {r['ms']:.4f} | "
                     f"{r['floor_ms']:.4f} | {r['frac_of_floor']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv):
    del argv
    _validate()
    notes: set[str] = set()
    meta = _versions()
    meta["copy_bandwidth_tbs"] = _measure_copy_bandwidth() / 1e12
    meta["command"] = " ".join(sys.argv)
    print(f"{meta}", flush=True)
    rows = []
    for wname in FLAGS.workloads:
        for dtype in FLAGS.dtypes:
            try:
                rows += run_one(WORKLOADS[wname], dtype, FLAGS.backends, notes, FLAGS.repeats)
            except Exception as e:  # one broken workload must not hide the others
                notes.add(f"{wname}/{dtype}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"{wname} {dtype} FAILED: {e!r}"[:2000], flush=True)
    failed = any("FAILED" in n for n in notes)
    os.makedirs(FLAGS.output, exist_ok=True)
    with open(os.path.join(FLAGS.output, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "notes": sorted(notes)}, f, indent=1)
    md = markdown(rows, meta) + "".join(f"\n- {n}" for n in sorted(notes))
    with open(os.path.join(FLAGS.output, "results.md"), "w") as f:
        f.write(md)
    print(md)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
