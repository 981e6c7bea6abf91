"""A training step of an MLP block on several devices, pallaskit against
jax.jit ([Note: sharding] in pallaskit/sharding.py).

    loss(x, w, w1, w2) = mean(y²),  y = x + gelu(rmsnorm(x, w) @ w1) @ w2
    step: value_and_grad of the loss over (w, w1, w2), then SGD

Layouts on a (data, model) mesh:

- ``dp``: batch sharded over every device, parameters replicated (XLA
  all-reduces the gradients);
- ``fsdp``: batch over ``data``, parameters sharded over ``model`` too;
- ``tp``: Megatron MLP, w1 column-sharded, w2 row-sharded over ``model``,
  batch over ``data`` (the psum after w2 implicit through SPMD);
- ``dp_shard_map``: ``dp`` written with ``jax.shard_map`` (``check_vma=True``):
  per-shard grads of a pallaskit loss, ``lax.pmean`` of the grads.

Backends: ``jax.jit(step)``; ``pallaskit.jit(step)`` (the whole step one
pallaskit graph) compiled per shard (option ``shard_kernels=per_shard``: the
program at local shapes under ``shard_map``, [Note: per-shard kernels]) and
SPMD-partitioned by XLA (``shard_kernels=spmd``: on a GPU its kernels run on
gathered operands); ``jax.jit`` of the step with
``jax.value_and_grad(pallaskit.jit(loss))`` inside (staged pallaskit calls,
custom_vjp halves). Every row is checked against ``jax.jit`` (values and
output shardings) before it is timed.

    python -m benchmarks.sharded_step --smoke   # 8 simulated CPU devices, tiny sizes
    python -m benchmarks.sharded_step           # every GPU of the machine, bf16
    python -m benchmarks.sharded_step --mesh 1,1   # one GPU: per shard vs SPMD on a 1-device mesh
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
from benchmarks.timing import time_ms  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "8 simulated CPU devices, tiny sizes, interpret mode")
flags.DEFINE_integer("rows", 16384, "batch x sequence (global)")
flags.DEFINE_integer("hidden", 1024, "model width")
flags.DEFINE_integer("mlp", 4096, "MLP width")
flags.DEFINE_string("dtype", "bfloat16", "bfloat16 or float32")
flags.DEFINE_string("mesh", "", "data,model mesh shape (default: all devices, model 2 where even)")
flags.DEFINE_list("layouts", ["dp", "fsdp", "tp", "dp_shard_map"], "layouts to run")
flags.DEFINE_integer("rounds", 15, "timing rounds (median reported)")
flags.DEFINE_string("output", "benchmarks/out", "folder for sharded_step.json / .md")

LR = 1e-2


def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


def loss(x, w, w1, w2):  # benchmarks/training_step.py's block
    y = x + jax.nn.gelu(rmsnorm(x, w) @ w1, approximate=True) @ w2
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def step(x, w, w1, w2):
    value, grads = jax.value_and_grad(loss, argnums=(1, 2, 3))(x, w, w1, w2)
    return value, tuple(p - LR * g.astype(p.dtype) for p, g in zip((w, w1, w2), grads))


def step_with(loss_fn):
    def s(x, w, w1, w2):
        value, grads = jax.value_and_grad(loss_fn, argnums=(1, 2, 3))(x, w, w1, w2)
        return value, tuple(p - LR * g.astype(p.dtype) for p, g in zip((w, w1, w2), grads))
    return s


def shard_map_step(mesh, loss_fn):
    """Data-parallel step written per shard: local grads, pmean over every axis."""
    axes = tuple(mesh.axis_names)

    def local(x, w, w1, w2):
        value, grads = jax.value_and_grad(loss_fn, argnums=(1, 2, 3))(x, w, w1, w2)
        value, grads = jax.lax.pmean((value, grads), axes)
        return value, tuple(p - LR * g.astype(p.dtype) for p, g in zip((w, w1, w2), grads))

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(axes), P(), P(), P()),
                                 out_specs=(P(), (P(), P(), P()))))


def compiled_with(mode: str, fn):
    """``fn`` whose first call (its compile) runs under option ``shard_kernels=mode``."""
    done = []

    def call(*args):
        if done:
            return fn(*args)
        with pallaskit.config.override(shard_kernels=mode):
            out = fn(*args)
        done.append(True)
        return out

    return call


def make_mesh(spec: str) -> Mesh:
    n = jax.device_count()
    if spec:
        data, model = (int(v) for v in spec.split(","))
    else:
        model = 2 if n % 2 == 0 and n > 1 else 1
        data = n // model
    return Mesh(np.array(jax.devices()[: data * model]).reshape(data, model), ("data", "model"))


def placed(mesh, layout, rows, hidden, mlp, dtype):
    specs = {
        "dp": (P(("data", "model")), P(), P(), P()),
        "dp_shard_map": (P(("data", "model")), P(), P(), P()),
        "fsdp": (P("data"), P("model"), P("model"), P("model")),
        "tp": (P("data"), P(), P(None, "model"), P("model", None)),
    }[layout]
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    host = (jax.random.normal(k[0], (rows, hidden), jnp.float32),
            1 + 0.1 * jax.random.normal(k[1], (hidden,), jnp.float32),
            jax.random.normal(k[2], (hidden, mlp), jnp.float32) / np.sqrt(hidden),
            jax.random.normal(k[3], (mlp, hidden), jnp.float32) / np.sqrt(mlp))
    return tuple(jax.device_put(a.astype(dtype), NamedSharding(mesh, s)) for a, s in zip(host, specs))


def _max_rel_err(a, b) -> float:
    errs = []
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30)))
    return max(errs)


def _shardings_agree(a, b) -> bool:
    return all(x.sharding.is_equivalent_to(y.sharding, y.ndim)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def run_layout(mesh, layout, size, dtype, rounds):
    args = placed(mesh, layout, *size, dtype)
    if layout == "dp_shard_map":
        backends = {"jax.jit": shard_map_step(mesh, loss),
                    "shard_map(grad(pallaskit.jit(loss)))": shard_map_step(mesh, pallaskit.jit(loss))}
    else:
        backends = {"jax.jit": jax.jit(step),
                    "pallaskit.jit(step) per_shard": compiled_with("per_shard", pallaskit.jit(step)),
                    "pallaskit.jit(step) spmd": compiled_with("spmd", pallaskit.jit(step)),
                    "jax.jit(grad(pallaskit.jit(loss)))": jax.jit(step_with(pallaskit.jit(loss)))}
    rows = []
    ref = None
    for name, fn in backends.items():
        t0 = time.perf_counter()
        before = pallaskit.metrics.counters["per_shard_graphs"]
        try:
            out = jax.block_until_ready(fn(*args))
        except Exception as e:  # noqa: BLE001  (a failing backend is a row, not the end of the run)
            rows.append(dict(layout=layout, backend=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            continue
        first_s = time.perf_counter() - t0
        if ref is None:
            ref = out
        if FLAGS.smoke:  # one call at a time: XLA:CPU's collectives can stall with many programs queued
            ms = time_ms(lambda: jax.block_until_ready(fn(*args)), jax.block_until_ready, rounds, min_round_s=0.0)
        else:
            ms = time_ms(lambda: fn(*args), jax.block_until_ready, rounds)
        if name.endswith("per_shard") and pallaskit.metrics.counters["per_shard_graphs"] == before:
            rows.append(dict(layout=layout, backend=name, error="did not run per shard (no plan: see the log)"))
            continue
        rows.append(dict(layout=layout, backend=name, ms=ms, first_call_s=first_s,
                         max_rel_err=_max_rel_err(out, ref), shardings_agree=_shardings_agree(out, ref)))
    return rows


def report(rows, mesh, size, dtype) -> str:
    lines = [f"## Sharded MLP training step: mesh {dict(mesh.shape)} on {jax.device_count()} x "
             f"{jax.devices()[0].device_kind}, rows x hidden x mlp = {size}, {dtype}", "",
             "| layout | backend | ms / step | vs jax.jit | first call s | max rel err | shardings = jax.jit |",
             "|---|---|---:|---:|---:|---:|---|"]
    base = {r["layout"]: r["ms"] for r in rows if r["backend"] == "jax.jit" and "ms" in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['backend']} | failed: {r['error']} | | | | |")
            continue
        rel = r["ms"] / base[r["layout"]] if r["layout"] in base else float("nan")
        lines.append(f"| {r['layout']} | {r['backend']} | {r['ms']:.3f} | {rel:.2f}x | {r['first_call_s']:.1f} | "
                     f"{r['max_rel_err']:.1e} | {'yes' if r['shardings_agree'] else 'NO'} |")
    return "\n".join(lines)


def main(argv):
    del argv
    dtype = jnp.dtype("float32" if FLAGS.smoke else FLAGS.dtype)
    size = (64, 32, 64) if FLAGS.smoke else (FLAGS.rows, FLAGS.hidden, FLAGS.mlp)
    rounds = 3 if FLAGS.smoke else FLAGS.rounds
    mesh = make_mesh(FLAGS.mesh or ("4,2" if FLAGS.smoke else ""))
    rows = []
    for layout in FLAGS.layouts:
        rows += run_layout(mesh, layout, size, dtype, rounds)
    text = report(rows, mesh, size, dtype.name)
    print(text)
    os.makedirs(FLAGS.output, exist_ok=True)
    with open(os.path.join(FLAGS.output, "sharded_step.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(FLAGS.output, "sharded_step.json"), "w") as f:
        json.dump({"mesh": dict(mesh.shape), "size": size, "dtype": dtype.name, "rows": rows,
                   "device": jax.devices()[0].device_kind, "jax": jax.__version__}, f, indent=1)
    bad = [r for r in rows if "error" in r or r["max_rel_err"] > (1e-4 if dtype == jnp.float32 else 5e-2)
           or not r["shardings_agree"]]
    if bad:
        sys.exit(f"{len(bad)} row(s) disagree with jax.jit or failed")


if __name__ == "__main__":
    app.run(main)
