"""The ``multi_device`` family: the ``models`` training steps (benchmarks/models.py) on several devices.

Layouts of a step's inputs ``(batch..., count, params..., mu..., nu...)``:

- ``dp``: data-parallel over every device: the batch split on its first axis,
  parameters and optimizer state replicated (the gradients all-reduced);
- ``fsdp``: the batch as ``dp``, and every parameter, ``mu`` and ``nu`` split
  on its first axis over every device where it divides (ZeRO-3 / FSDP style:
  parameters gathered for use);
- ``tp``: tensor-parallel over 2 devices (Megatron): the attention's q, k, v
  projections and the MLP's first weights column-split, the attention output
  and the MLP's second weight row-split (their biases with them), the batch
  and the rest replicated.

Backends: ``jax.jit`` with the same shardings; ``pallaskit.jit`` compiled per
shard (option ``shard_kernels=per_shard``, [Note: per-shard kernels] in
pallaskit/per_shard.py) and through XLA's SPMD partitioner
(``shard_kernels=spmd``). Every row is checked against jax.jit (values
norm-wise, output shardings) before it is timed. Reported: steady-state step
time, cold compile (the first call, with pallaskit's disk cache off; jax.jit's
in-memory cache serves a signature it compiled before, e.g. fsdp on one device
after dp) and, for
``dp`` and ``fsdp``, scaling efficiency from 1 to N devices at a fixed batch
per device (weak scaling: ms on 1 device / ms on N; n/a with one device).
torch DDP / FSDP are left out: they need one process per GPU (torchrun).

    python -m benchmarks.multi_device --smoke      # 8 simulated CPU devices, tiny sizes, float32
    python -m benchmarks.multi_device              # every GPU of the machine, bfloat16
"""
from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before jax starts: 8 CPU devices
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pallaskit  # noqa: E402
from benchmarks import models  # noqa: E402
from benchmarks.timing import time_ms  # noqa: E402

FAMILY = "multi_device"
FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "8 simulated CPU devices, tiny sizes, float32, interpret mode")
flags.DEFINE_list("workloads", None, "models training steps to run (default: gpt2_block_train and "
                  "llama_block_train; --smoke: gpt2_block_train)")
flags.DEFINE_list("layouts", ["dp", "fsdp", "tp"], "layouts to run")
flags.DEFINE_list("backends", ["jax.jit", "pallaskit per_shard", "pallaskit spmd"], "backends to run")
flags.DEFINE_string("dtype", "bfloat16", "compute dtype (float32 in --smoke)")
flags.DEFINE_integer("batch_per_device", 0, "batch per data-parallel device (0: the model's full size's batch)")
flags.DEFINE_integer("rounds", 10, "timing rounds (median reported)")
flags.DEFINE_string("output", "benchmarks/out", "folder for multi_device.json / .md")

# Megatron's split of a block's parameters (benchmarks/models.py names)
_COLUMNS = frozenset({"wq", "wk", "wv", "w_fc", "w_gate", "w_up"})
_ROWS = frozenset({"wo", "w_proj", "w_down"})
_COLUMN_BIASES = frozenset({"bq", "bv", "b_fc"})
_SMOKE_SIZES = {"gpt2_block_train": (1, 8, 128), "llama_block_train": (1, 8, 128, 96)}


def param_names(workload: str, size) -> list[str]:
    spec = {"gpt2_block_train": lambda: models.gpt2_block_params(size[2]),
            "llama_block_train": lambda: models.llama_block_params(size[2], size[3])}[workload]()
    return [n for n, _, _ in spec]


def specs(layout: str, inputs, names: list[str], n_batch: int, n_data: int) -> list:
    """PartitionSpecs of a step's flat inputs for ``layout`` (``n_data``: devices on axis ``data``)."""
    out = []
    n_params = len(names)
    for i, a in enumerate(inputs):
        if i < n_batch:
            out.append(P() if layout == "tp" else P("data"))
        elif i == n_batch:
            out.append(P())  # count
        else:
            name = names[(i - n_batch - 1) % n_params]
            if layout == "fsdp" and a.ndim and a.shape[0] % n_data == 0:
                out.append(P("data"))
            elif layout == "tp" and name in _COLUMNS:
                out.append(P(None, "model"))
            elif layout == "tp" and name in (_ROWS | _COLUMN_BIASES):
                out.append(P("model"))
            else:
                out.append(P())
    return out


def mesh_for(layout: str, n: int) -> Mesh:
    if layout == "tp":
        return Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "model"))
    return Mesh(np.array(jax.devices()[:n]).reshape(n, 1), ("data", "model"))


def placed_inputs(workload: str, layout: str, n: int, size, dtype):
    spec = next(s for s in models.MODEL_SPECS if s["name"] == workload)
    mesh = mesh_for(layout, n)
    data = mesh.shape["data"]
    size = (size[0] * data,) + tuple(size[1:])  # the batch grows with the data-parallel devices
    inputs = spec["make_inputs"](size, dtype, jax.random.PRNGKey(0))
    s = specs(layout, inputs, param_names(workload, size), 2, data)
    return spec["jax_fn"], [jax.device_put(a, NamedSharding(mesh, p)) for a, p in zip(inputs, s)], size


def compiled_with(mode: str, fn):
    """pallaskit.jit(fn) whose first call (its compile) runs under option ``shard_kernels=mode``."""
    jf = pallaskit.jit(fn)
    done = []

    def call(*args):
        if done:
            return jf(*args)
        with pallaskit.config.override(shard_kernels=mode, cache=False):
            out = jf(*args)
        done.append(True)
        return out

    return call


def backend(name: str, fn):
    if name == "jax.jit":
        return jax.jit(fn)
    return compiled_with(name.split()[-1], fn)


def _rel_err(a, b) -> float:
    errs = []
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-30)))
    return max(errs)


def _shardings_agree(a, b) -> bool:
    return all(x.sharding.is_equivalent_to(y.sharding, y.ndim)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def run_row(workload, layout, n, name, size, dtype, rounds, ref=None) -> tuple[dict, object]:
    fn, args, global_size = placed_inputs(workload, layout, n, size, dtype)
    row = dict(workload=workload, layout=layout, devices=len(mesh_for(layout, n).devices.flat), backend=name,
               size=list(global_size))
    f = backend(name, fn)
    before = pallaskit.metrics.counters["per_shard_graphs"]
    t0 = time.perf_counter()
    try:
        out = jax.block_until_ready(f(*args))
    except Exception as e:  # noqa: BLE001  (a failing backend is a row, not the end of the run)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        return row, None
    row["compile_s"] = time.perf_counter() - t0
    if name != "jax.jit":
        row["per_shard"] = pallaskit.metrics.counters["per_shard_graphs"] > before
    if ref is not None:
        row["rel_err"], row["shardings_agree"] = _rel_err(out, ref), _shardings_agree(out, ref)
    if FLAGS.smoke:  # one call at a time: XLA:CPU's collectives can stall with many programs queued
        row["ms"] = time_ms(lambda: jax.block_until_ready(f(*args)), jax.block_until_ready, rounds, min_round_s=0.0)
    else:
        row["ms"] = time_ms(lambda: f(*args), jax.block_until_ready, rounds)
    return row, out


def run(workloads, layouts, backends, dtype, rounds, smoke) -> list[dict]:
    n = jax.device_count()
    rows = []
    for workload in workloads:
        spec = next(s for s in models.MODEL_SPECS if s["name"] == workload)
        size = _SMOKE_SIZES[workload] if smoke else spec["sizes"]["full"]
        if FLAGS.batch_per_device:
            size = (FLAGS.batch_per_device,) + tuple(size[1:])
        for layout in layouts:
            if layout == "tp" and n < 2:
                rows.append(dict(workload=workload, layout=layout, skipped="tensor-parallel needs 2 devices"))
                continue
            counts = [n] if layout == "tp" or n == 1 else [1, n]  # 1 device: the weak-scaling baseline
            for count in counts:
                ref = None
                for name in backends:
                    row, out = run_row(workload, layout, count, name, size, dtype, rounds, ref)
                    if name == "jax.jit":
                        ref = out
                    rows.append(row)
    _scaling(rows)
    return rows


def _scaling(rows):
    """Weak-scaling efficiency of each N-device row: its backend's 1-device ms / its ms."""
    single = {(r["workload"], r["layout"], r["backend"]): r["ms"] for r in rows if r.get("devices") == 1 and "ms" in r}
    for r in rows:
        if "ms" in r and r["devices"] > 1 and r["layout"] != "tp":
            base = single.get((r["workload"], r["layout"], r["backend"]))
            r["scaling"] = base / r["ms"] if base else None


def report(rows, dtype) -> str:
    devices = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    lines = [f"## Multi-device training steps ({FAMILY}): {devices}, {dtype}", "",
             "| workload | layout | devices | backend | ms / step | vs jax.jit | scaling 1->N | compile s | "
             "rel err | shardings = jax.jit | per shard |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    base = {(r["workload"], r["layout"], r["devices"]): r["ms"] for r in rows if r.get("backend") == "jax.jit"
            and "ms" in r}
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['workload']} | {r['layout']} | | | skipped: {r['skipped']} | | | | | | |")
            continue
        head = f"| {r['workload']} | {r['layout']} | {r['devices']} | {r['backend']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'][:120]} | | | | | | |")
            continue
        b = base.get((r["workload"], r["layout"], r["devices"]))
        scaling = r.get("scaling")
        lines.append(f"{head} {r['ms']:.3f} | {r['ms'] / b:.2f}x | "
                     f"{'n/a' if scaling is None else f'{scaling:.2f}'} | {r['compile_s']:.1f} | "
                     f"{r.get('rel_err', 0.0):.1e} | {'yes' if r.get('shardings_agree', True) else 'NO'} | "
                     f"{'' if 'per_shard' not in r else ('yes' if r['per_shard'] else 'no')} |")
    return "\n".join(lines)


def bad_rows(rows, dtype) -> list[dict]:
    tol = 1e-4 if dtype == jnp.float32 else models.TRAIN_TOL
    return [r for r in rows if "error" in r or r.get("rel_err", 0.0) > tol or not r.get("shardings_agree", True)
            or (r.get("backend") == "pallaskit per_shard" and r.get("per_shard") is False)]


def main(argv):
    del argv
    dtype = jnp.dtype("float32" if FLAGS.smoke else FLAGS.dtype)
    rounds = 3 if FLAGS.smoke else FLAGS.rounds
    workloads = FLAGS.workloads or (["gpt2_block_train"] if FLAGS.smoke else ["gpt2_block_train", "llama_block_train"])
    rows = run(workloads, FLAGS.layouts, FLAGS.backends, dtype, rounds, FLAGS.smoke)
    text = report(rows, dtype.name)
    print(text)
    os.makedirs(FLAGS.output, exist_ok=True)
    with open(os.path.join(FLAGS.output, "multi_device.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(FLAGS.output, "multi_device.json"), "w") as f:
        json.dump({"family": FAMILY, "dtype": dtype.name, "rows": rows, "devices": jax.device_count(),
                   "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f, indent=1)
    bad = bad_rows(rows, dtype)
    if bad:
        sys.exit(f"{len(bad)} row(s) disagree with jax.jit, failed or did not run per shard")


if __name__ == "__main__":
    app.run(main)
