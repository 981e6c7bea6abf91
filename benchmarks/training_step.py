"""One training step through ``@pallaskit.jit``: forward and backward of a
transformer MLP block with RMSNorm, gradients of the parameters and the input.

    loss(x, w, w1, w2) = mean(y²),  y = x + gelu(rmsnorm(x, w) @ w1) @ w2

Backends: pallaskit (``jax.value_and_grad`` of a ``pallaskit.jit`` loss, under
``jax.jit`` and eagerly), ``jax.jit`` and ``torch.compile`` (compiled loss,
torch autograd for the backward) on the same inputs. Besides time, the bytes
the forward keeps for the backward: pallaskit's min-cut and default
partitions, JAX's own ``jax.vjp`` residuals and torch.compile's saved tensors;
and XLA's temp-buffer size of the whole step (the step's peak scratch memory).

    python -m benchmarks.training_step           # GPU: bf16, 8192 x 1024, MLP 4096
    python -m benchmarks.training_step --smoke   # CPU, tiny sizes, interpret mode
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import time

from absl import app, flags

import jax
import jax.numpy as jnp
import numpy as np

import pallaskit
from benchmarks.timing import time_ms
from pallaskit import autodiff

FLAGS = flags.FLAGS
flags.DEFINE_bool("smoke", False, "Tiny sizes: runs on the CPU in interpret mode in seconds")
flags.DEFINE_integer("rows", 8192, "batch x sequence")
flags.DEFINE_integer("hidden", 1024, "model width")
flags.DEFINE_integer("mlp", 4096, "MLP width")
flags.DEFINE_string("dtype", "bfloat16", "bfloat16 or float32")
flags.DEFINE_integer("rounds", 15, "Timing rounds (the median is reported)")
flags.DEFINE_string("output", "benchmarks/out", "Folder for training_step.json and training_step.md")

GRAD_ARGNUMS = (0, 1, 2, 3)  # x, w, w1, w2


# -- the block, once for JAX and once for torch ------------------------------------
def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


def loss(x, w, w1, w2):
    y = x + jax.nn.gelu(rmsnorm(x, w) @ w1, approximate=True) @ w2
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def torch_loss(x, w, w1, w2):
    import torch
    import torch.nn.functional as F

    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(x.dtype)
    y = x + F.gelu(h @ w1, approximate="tanh") @ w2
    return y.float().pow(2).mean()


def inputs(rows, hidden, mlp, dtype, key=0):
    k = jax.random.split(jax.random.key(key), 4)
    return (jax.random.normal(k[0], (rows, hidden), jnp.float32).astype(dtype),
            (1.0 + 0.1 * jax.random.normal(k[1], (hidden,), jnp.float32)).astype(dtype),
            (jax.random.normal(k[2], (hidden, mlp), jnp.float32) * hidden ** -0.5).astype(dtype),
            (jax.random.normal(k[3], (mlp, hidden), jnp.float32) * mlp ** -0.5).astype(dtype))


# -- timing ---------------------------------------------------------------------------
def _max_rel_err(a, b):
    errs = []
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return max(errs)


def _xla_temp_bytes(fn, args):
    try:
        stats = jax.jit(fn).lower(*args).compile().memory_analysis()
        return int(stats.temp_size_in_bytes) if stats is not None else None
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


# -- torch ----------------------------------------------------------------------------
def _torch_rows(args, rounds, notes):
    try:
        import torch
    except ImportError:
        notes.append("torch not installed: no torch.compile row")
        return {}
    if not torch.cuda.is_available():
        notes.append("no CUDA device for torch: no torch.compile row")
        return {}
    tx = [torch.from_dlpack(jax.device_get(a).astype(np.float32)).cuda() for a in args]
    tdtype = torch.bfloat16 if args[0].dtype == jnp.bfloat16 else torch.float32
    tx = [t.to(tdtype).requires_grad_() for t in tx]
    compiled = torch.compile(torch_loss)

    def step():
        value = compiled(*tx)
        return value.detach(), torch.autograd.grad(value, tx)

    def sync(_):
        torch.cuda.synchronize()

    step()  # compile
    saved = {}

    def pack(t):
        saved[(t.data_ptr(), tuple(t.shape), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = compiled(*tx)
    del value
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sync(step())
    peak = torch.cuda.max_memory_allocated() - base
    ms = time_ms(step, sync, rounds)
    return {"torch.compile": {"ms": ms, "saved_bytes": sum(saved.values()), "peak_extra_bytes": int(peak)}}


# -- main -----------------------------------------------------------------------------
def run(rows, hidden, mlp, dtype, rounds):
    args = inputs(rows, hidden, mlp, dtype)
    jax.block_until_ready(args)
    notes: list[str] = []
    pk_loss = pallaskit.jit(loss)
    pk_loss.__qualname__ = "training_loss"
    results: dict = {}

    ref_step = jax.jit(jax.value_and_grad(loss, argnums=GRAD_ARGNUMS))
    ref = ref_step(*args)
    jax.block_until_ready(ref)

    def sync(out):
        jax.block_until_ready(out)

    # bytes kept for the backward: from the partitions and from JAX's own vjp
    saved = {}
    for method in ("min_cut", "default"):
        entry = autodiff.explain_entry(pk_loss, args, {}, method)
        saved[method] = entry.partition
    jax_saved = autodiff.jax_saved_bytes(loss, *args)

    variants = (("pallaskit, min-cut, jax.jit", "min_cut", True), ("pallaskit, default partition, jax.jit",
                                                                   "default", True),
                ("pallaskit, min-cut, eager", "min_cut", False))
    for name, method, jitted in variants:
        grad_fn = jax.value_and_grad(pk_loss, argnums=GRAD_ARGNUMS)
        step_fn = jax.jit(grad_fn) if jitted else grad_fn
        try:
            with pallaskit.config.override(partitioner=method):
                t0 = time.perf_counter()
                out = step_fn(*args)
                sync(out)
                first = time.perf_counter() - t0
                ms = time_ms(lambda: step_fn(*args), sync, rounds)
                results[name] = {"ms": ms, "saved_bytes": saved[method].saved_bytes,
                                 "max_rel_err": _max_rel_err(out, ref), "first_call_s": first}
                if jitted:
                    results[name]["xla_temp_bytes"] = _xla_temp_bytes(grad_fn, args)
        except Exception as e:  # noqa: BLE001 - report and go on
            notes.append(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    # The whole step in one pallaskit graph: pallaskit.jit around jax.value_and_grad,
    # as a JAX user writes jax.jit(jax.value_and_grad(loss)). No forward/backward
    # boundary, so nothing is "saved" across one: its memory figure is the step's
    # XLA temp buffers (the pallaskit program's intermediates live there).
    name = "pallaskit.jit(value_and_grad), whole step"
    try:
        pk_step = pallaskit.jit(jax.value_and_grad(loss, argnums=GRAD_ARGNUMS))
        t0 = time.perf_counter()
        out = pk_step(*args)
        sync(out)
        first = time.perf_counter() - t0
        results[name] = {"ms": time_ms(lambda: pk_step(*args), sync, rounds), "saved_bytes": None,
                         "max_rel_err": _max_rel_err(out, ref), "first_call_s": first,
                         "xla_temp_bytes": _xla_temp_bytes(pk_step, args)}
    except Exception as e:  # noqa: BLE001 - report and go on
        notes.append(f"{name} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
    results["jax.jit"] = {"ms": time_ms(lambda: ref_step(*args), sync, rounds), "saved_bytes": jax_saved,
                          "xla_temp_bytes": _xla_temp_bytes(jax.value_and_grad(loss, argnums=GRAD_ARGNUMS), args)}
    results.update(_torch_rows(args, rounds, notes))
    return results, saved, jax_saved, notes


def _versions():
    v = {"python": platform.python_version(), "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
         "backend": jax.default_backend(), "date": datetime.date.today().isoformat()}
    try:
        import torch
        import triton

        v.update(torch=torch.__version__, triton=triton.__version__)
    except ImportError:
        pass
    return v


def _size(n):
    if n is None:
        return "—"
    for unit, scale in (("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def report(results, saved, jax_saved, notes, size, versions) -> str:
    rows, hidden, mlp, dtype = size
    lines = [f"Training step, {dtype} x {rows}x{hidden}, MLP {mlp}: loss and gradients of (x, w, w1, w2).", "",
             "| backend | median ms | saved for backward | XLA temp buffers | max rel. err vs jax.jit |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        err = f"{r['max_rel_err']:.1e}" if "max_rel_err" in r else "—"
        lines.append(f"| {name} | {r['ms']:.3f} | {_size(r.get('saved_bytes'))} | {_size(r.get('xla_temp_bytes'))} "
                     f"| {err} |")
    lines += ["", "Saved for the backward:", ""]
    for method, part in saved.items():
        lines.append(f"- pallaskit `{method}`: {_size(part.saved_bytes)} in {len(part.saved)} values "
                     f"({len(part.recomputed)} forward equations recomputed in the backward)")
        lines += [f"    - {s.aval.str_short()} {_size(s.nbytes)}: {s.origin}" for s in part.saved]
    lines.append(f"- jax.jit (`jax.vjp` residuals): {_size(jax_saved)}")
    if "torch.compile" in results:
        lines.append(f"- torch.compile (saved tensors): {_size(results['torch.compile']['saved_bytes'])}; "
                     f"peak extra memory of one step {_size(results['torch.compile']['peak_extra_bytes'])}")
    lines += [f"- note: {n}" for n in notes]
    lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items())]
    return "\n".join(lines)


def main(argv):
    del argv
    if FLAGS.dtype not in ("bfloat16", "float32"):
        raise app.UsageError(f"unknown dtype {FLAGS.dtype}; valid: bfloat16, float32")
    size = (64, 48, 96) if FLAGS.smoke else (FLAGS.rows, FLAGS.hidden, FLAGS.mlp)
    rounds = 3 if FLAGS.smoke else FLAGS.rounds
    dtype = jnp.dtype(FLAGS.dtype)
    results, saved, jax_saved, notes = run(*size, dtype, rounds)
    versions = _versions()
    text = report(results, saved, jax_saved, notes, size + (FLAGS.dtype,), versions)
    print(text)
    os.makedirs(FLAGS.output, exist_ok=True)
    with open(os.path.join(FLAGS.output, "training_step.md"), "w") as f:
        f.write(text + "\n")
    payload = {"size": size, "dtype": FLAGS.dtype, "versions": versions, "results": results, "notes": notes,
               "saved_bytes": {m: p.saved_bytes for m, p in saved.items()} | {"jax.jit": jax_saved}}
    with open(os.path.join(FLAGS.output, "training_step.json"), "w") as f:
        json.dump(payload, f, indent=1)
    try:  # the kernels of both halves, for reading
        text = str(pallaskit.explain_grad(loss, *inputs(*size, dtype)))
    except Exception as e:  # noqa: BLE001
        text = f"explain_grad failed: {type(e).__name__}: {e}"
    with open(os.path.join(FLAGS.output, "training_step_explain.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
