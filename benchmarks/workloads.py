"""Workloads, each defined once: a JAX function, the same function in torch,
how to make its inputs, its sizes, and what its floor counts.

A workload's ``kind`` says how it is measured (see ``benchmarks/suite.py``):

- ``steady``: median time per call once compiled, against its memory / FLOP floor.
- ``hint_runtime``: a matmul compiled for one size and run at others: the
  Hint x Runtime table of Inductor's multi-kernel PR. Its size is
  ``(Ms, K, N)``; every M is a runtime size and, for backends that compile with
  a size hint, a hint.
- ``sweep``: one function at many row counts (the dynamic-shape sweep): time to
  the first result of every size in a fresh process, then the steady-state sum.
- ``first_call``: time to the first result in a fresh process, with cold and
  warm compilation caches.

The torch side is a *builder*: ``torch_fn(compile)`` returns the callable to
time, where ``compile`` is the identity for eager and ``torch.compile`` (with
the backend's options) otherwise. Most builders compile the whole function
(``_whole``); training steps compile the forward and run torch autograd, as a
torch user would.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

STEADY, HINT_RUNTIME, SWEEP, FIRST_CALL = "steady", "hint_runtime", "sweep", "first_call"


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    jax_fn: Callable
    torch_fn: Callable | None  # builder: (compile) -> callable on torch tensors
    make_inputs: Callable  # (concrete size, dtype, key) -> tuple of jax arrays
    sizes: dict  # preset name ("full", "smoke") -> size
    description: str
    flops: Callable | None = None  # (concrete size) -> matrix FLOPs per call, for the FLOP floor
    tags: frozenset = frozenset()  # what backend variants apply (e.g. "norm_bwd", "matmul")
    dtypes: tuple = ("bfloat16", "float16", "float32")
    tol: float = 0.0  # tolerance floor on top of the dtype's (matmuls in float32 run as TF32)
    dynamic_arg: int = 0  # for hinted / dynamic compiles: the argument whose axis 0 varies
    torch_vjp_fn: Callable | None = None  # builder of the torch twin through torch.func.vjp (backend torch_*_vjp)
    family: str = "kernels"  # a name --workloads takes for all its members ("kernels", "models")

    def cases(self, size) -> list[tuple[str, tuple]]:
        """(label, concrete size) of every call this workload measures."""
        if self.kind == HINT_RUNTIME:
            ms, *rest = size
            return [(f"M={m}", (m, *rest)) for m in _as_tuple(ms)]
        if self.kind == SWEEP:
            rows, *rest = size
            return [(f"rows={r}", (r, *rest)) for r in _as_tuple(rows)]
        return [("", tuple(size))]

    def hints(self, size) -> tuple:
        return _as_tuple(size[0]) if self.kind == HINT_RUNTIME else ()


def _as_tuple(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


def parse_size(text: str):
    """'576000x384' -> (576000, 384); '64:256:4096x8192x8192' -> ((64, 256, 4096), 8192, 8192)."""
    fields = []
    for f in text.strip().split("x"):
        parts = [int(p) for p in f.split(":")]
        if any(p <= 0 for p in parts):
            raise ValueError(f"sizes must be positive: {text!r}")
        fields.append(tuple(parts) if len(parts) > 1 else parts[0])
    return tuple(fields)


def format_size(size) -> str:
    return "x".join(":".join(map(str, f)) if isinstance(f, tuple) else str(f) for f in size)


# -- JAX definitions ------------------------------------------------------------
def add(x, y):
    return x + y


def pointwise_chain(x, y):
    z = x * 2.0 + y
    z = jnp.tanh(z) - jnp.exp(-jnp.abs(x))
    z = jnp.maximum(z, y) * jax.nn.sigmoid(y)
    return jnp.sqrt(jnp.abs(z) + 1.0) / (1.0 + y * y)


def softmax(x):
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def layernorm(x, w, b):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-5)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def rmsnorm_bwd(x, w, dy):
    """(dx, dw) of RMSNorm, as a JAX user writes it: jax.vjp of the forward."""
    _, vjp = jax.vjp(rmsnorm, x, w)
    return vjp(dy)


def layernorm_fwd_bwd(x, w, b, dy):
    """y and (dx, dw, db) of LayerNorm in one function, through jax.vjp."""
    y, vjp = jax.vjp(layernorm, x, w, b)
    return (y, *vjp(dy))


def nhwc_affine_relu(x, s, b):
    """nvFuser issue 1756 in JAX terms: x is NHWC, the math is written NCHW."""
    t = jnp.transpose(x, (0, 3, 1, 2)) * s + b
    return jnp.transpose(jax.nn.relu(t), (0, 2, 3, 1)), jnp.transpose(t > 0, (0, 2, 3, 1))


def gelu_mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1, approximate=True) @ w2


def silu_mlp(x, w1, w2):
    return jax.nn.silu(x @ w1) @ w2


def matmul(x, w):
    return x @ w


def _train_loss(x, w, w1, w2):
    y = x + gelu_mlp(rmsnorm(x, w), w1, w2)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))


def train_step(x, w, w1, w2):
    """Loss and gradients of (x, w, w1, w2) for y = x + W2 gelu(W1 rmsnorm(x)), as issue 6
    (and benchmarks/training_step.py) define the step; here pallaskit.jit wraps the whole
    jax.value_and_grad."""
    return jax.value_and_grad(_train_loss, argnums=(0, 1, 2, 3))(x, w, w1, w2)


# -- torch definitions (torch is imported lazily: the suite runs without it) ----
def _whole(fn):
    """Builder for a function torch.compile takes whole."""
    return lambda compile: compile(fn)


def _t_add(x, y):
    return x + y


def _t_chain(x, y):
    import torch

    z = x * 2.0 + y
    z = torch.tanh(z) - torch.exp(-torch.abs(x))
    z = torch.maximum(z, y) * torch.sigmoid(y)
    return torch.sqrt(torch.abs(z) + 1.0) / (1.0 + y * y)


def _t_softmax(x):
    import torch

    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def _t_rmsnorm(x, w):
    import torch

    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return (y * w.float()).to(x.dtype)


def _t_layernorm(x, w, b):
    import torch

    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + 1e-5)
    return (y * w.float() + b.float()).to(x.dtype)


def _t_rmsnorm_bwd(x, w, dy):
    """RMSNorm backward written out (what Inductor's mix-order reduction fuses)."""
    import torch

    xf, wf, dyf = x.float(), w.float(), dy.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    xhat = xf * rstd
    g = dyf * wf
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)


def _t_layernorm_fwd_bwd(x, w, b, dy):
    import torch

    xf, wf, dyf = x.float(), w.float(), dy.float()
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5)
    xhat = xc * rstd
    y = xhat * wf + b.float()
    g = dyf * wf
    dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return y.to(x.dtype), dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype), dyf.sum(0).to(b.dtype)


def _t_rmsnorm_vjp(x, w, dy):
    """RMSNorm backward as torch.func.vjp of the forward: the graph autograd gives Inductor."""
    import torch

    _, vjp = torch.func.vjp(_t_rmsnorm, x, w)
    return vjp(dy)


def _t_layernorm_fwd_bwd_vjp(x, w, b, dy):
    import torch

    y, vjp = torch.func.vjp(_t_layernorm, x, w, b)
    return (y, *vjp(dy))


def _t_nhwc(x, s, b):
    import torch

    t = x.permute(0, 3, 1, 2) * s + b
    return torch.relu(t).permute(0, 2, 3, 1), (t > 0).permute(0, 2, 3, 1)


def _t_gelu_mlp(x, w1, w2):
    import torch.nn.functional as F

    return F.gelu(x @ w1, approximate="tanh") @ w2


def _t_silu_mlp(x, w1, w2):
    import torch.nn.functional as F

    return F.silu(x @ w1) @ w2


def _t_matmul(x, w):
    return x @ w


def _t_train_loss(x, w, w1, w2):
    y = x + _t_gelu_mlp(_t_rmsnorm(x, w), w1, w2)
    return y.float().pow(2).mean()


def _t_train_step(compile):
    """torch.compile compiles the loss; autograd runs its compiled backward."""
    import torch

    loss_fn = compile(_t_train_loss)

    def step(x, w, w1, w2):
        params = [p.detach().requires_grad_() for p in (x, w, w1, w2)]
        loss = loss_fn(*params)
        return loss.detach(), tuple(torch.autograd.grad(loss, params))
    return step


# -- inputs and FLOPs -------------------------------------------------------------
SMALL = 1 << 20  # elements: arrays up to this size are drawn with numpy (no compile per shape)


def _normal(key, shape, dtype, shift=0.0, scale=1.0):
    """Fresh standard normals from ``key``, shifted and scaled, cast to ``dtype``."""
    if math.prod(shape) <= SMALL:
        rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel().tolist())
        x = (rng.standard_normal(shape, np.float32) + shift) * scale
        return jnp.asarray(x.astype(np.dtype(dtype)))  # numpy casts to bfloat16 too (ml_dtypes)
    return ((jax.random.normal(key, shape, jnp.float32) + shift) * scale).astype(dtype)


def _two_matrices(size, dtype, key):
    k1, k2 = jax.random.split(key)
    return _normal(k1, size, dtype), _normal(k2, size, dtype)


def _rows_and_vectors(n_vectors, cotangent=False):
    """x (rows, cols), n_vectors of (cols,), and a cotangent like x if asked."""
    def make(size, dtype, key):
        r, c = size
        keys = jax.random.split(key, 2 + n_vectors)
        x = _normal(keys[0], (r, c), dtype, 0.3)
        vectors = tuple(_normal(k, (c,), dtype, 1.0, 0.5) for k in keys[2:])
        return (x,) + vectors + ((_normal(keys[1], (r, c), dtype),) if cotangent else ())
    return make


def _nhwc_inputs(size, dtype, key):
    n, h, w, c = size
    k1, k2, k3 = jax.random.split(key, 3)
    return (_normal(k1, (n, h, w, c), dtype), _normal(k2, (1, c, 1, 1), dtype, 1.0, 0.5),
            _normal(k3, (1, c, 1, 1), dtype, 0.0, 0.5))


def _mlp_inputs(size, dtype, key):
    m, k, h, n = size
    k1, k2, k3 = jax.random.split(key, 3)
    return (_normal(k1, (m, k), dtype), _normal(k2, (k, h), dtype, scale=k ** -0.5),
            _normal(k3, (h, n), dtype, scale=h ** -0.5))


def _mlp_flops(size):
    m, k, h, n = size
    return 2 * m * k * h + 2 * m * h * n


def _matmul_inputs(size, dtype, key):
    m, k, n = size
    k1, k2 = jax.random.split(key)
    return _normal(k1, (m, k), dtype), _normal(k2, (k, n), dtype, scale=k ** -0.5)


def _train_inputs(size, dtype, key):
    m, d, h = size
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return (_normal(k1, (m, d), dtype), _normal(k2, (d,), dtype, 1.0, 0.1),
            _normal(k3, (d, h), dtype, scale=d ** -0.5), _normal(k4, (h, d), dtype, scale=h ** -0.5))


def _train_flops(size):
    m, d, h = size
    return 3 * 4 * m * d * h  # forward: two matmuls; backward: twice the forward


ROWS_384 = {"full": (576000, 384), "smoke": (33, 100)}
SWEEP_ROWS = tuple(int(r) for r in np.unique(np.round(np.geomspace(100, 8000, 16))))


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("add", STEADY, add, _whole(_t_add), _two_matrices, ROWS_384, "x + y"),
    Workload("pointwise_chain", STEADY, pointwise_chain, _whole(_t_chain), _two_matrices, ROWS_384,
             "ten pointwise ops on x, y"),
    Workload("softmax", STEADY, softmax, _whole(_t_softmax), _rows_and_vectors(0),
             {"full": (32768, 4096), "smoke": (17, 300)}, "softmax over the last axis, in float32"),
    Workload("softmax_long", STEADY, softmax, _whole(_t_softmax), _rows_and_vectors(0),
             {"full": (8192, 50257), "smoke": (5, 8500)},
             "softmax over rows of a GPT-2 vocabulary (past one tile), in float32", tags=frozenset({"long_rows"}),
             dtypes=("bfloat16", "float32")),
    Workload("rmsnorm_fwd", STEADY, rmsnorm, _whole(_t_rmsnorm), _rows_and_vectors(1), ROWS_384,
             "RMSNorm forward"),
    Workload("layernorm_fwd", STEADY, layernorm, _whole(_t_layernorm), _rows_and_vectors(2), ROWS_384,
             "LayerNorm forward"),
    Workload("rmsnorm_bwd", STEADY, rmsnorm_bwd, _whole(_t_rmsnorm_bwd), _rows_and_vectors(1, cotangent=True),
             ROWS_384, "RMSNorm backward (dx, dw): jax.vjp / written out in torch", tags=frozenset({"norm_bwd"}),
             torch_vjp_fn=_whole(_t_rmsnorm_vjp)),
    Workload("layernorm_fwd_bwd", STEADY, layernorm_fwd_bwd, _whole(_t_layernorm_fwd_bwd),
             _rows_and_vectors(2, cotangent=True), ROWS_384,
             "LayerNorm y, dx, dw, db in one function: jax.vjp / written out in torch",
             tags=frozenset({"norm_bwd"}), torch_vjp_fn=_whole(_t_layernorm_fwd_bwd_vjp)),
    Workload("nhwc_layout", STEADY, nhwc_affine_relu, _whole(_t_nhwc), _nhwc_inputs,
             {"full": (32, 25, 25, 1024), "smoke": (2, 5, 3, 24)},
             "x NHWC, t = transpose(x, NCHW) * s + b; relu(t), t > 0 back in NHWC"),
    Workload("gelu_mlp", STEADY, gelu_mlp, _whole(_t_gelu_mlp), _mlp_inputs,
             {"full": (8192, 1024, 4096, 1024), "smoke": (24, 32, 64, 32)}, "gelu(x @ w1) @ w2",
             flops=_mlp_flops, tags=frozenset({"matmul"}), tol=5e-3),
    Workload("train_step", STEADY, train_step, _t_train_step, _train_inputs,
             {"full": (8192, 1024, 4096), "smoke": (24, 32, 64)},
             "value and grad (x, w, w1, w2) of mean(y^2), y = x + W2 gelu(W1 rmsnorm(x))",
             flops=_train_flops, tags=frozenset({"matmul", "norm_bwd"}), tol=5e-3),
    Workload("matmul_hint_runtime", HINT_RUNTIME, matmul, _whole(_t_matmul), _matmul_inputs,
             {"full": ((64, 256, 4096), 8192, 8192), "smoke": ((8, 40), 32, 48)},
             "x (M, K) @ w (K, N), compiled for a hint M and run at each runtime M",
             flops=lambda s: 2 * s[0] * s[1] * s[2], tags=frozenset({"matmul"}), tol=5e-3),
    Workload("dynamic_mlp_sweep", SWEEP, gelu_mlp, _whole(_t_gelu_mlp), _mlp_inputs,
             {"full": (SWEEP_ROWS, 1024, 4096, 1024), "smoke": ((5, 17), 32, 64, 32)},
             "gelu MLP at 16 new row counts: time to the first result of all, then the steady-state sum",
             flops=_mlp_flops, tags=frozenset({"matmul", "dynamic"}), tol=5e-3),
    Workload("first_call_rmsnorm_bwd", FIRST_CALL, rmsnorm_bwd, _whole(_t_rmsnorm_bwd),
             _rows_and_vectors(1, cotangent=True), ROWS_384,
             "RMSNorm backward: first call in a fresh process, cold and warm caches"),
    Workload("first_call_gelu_mlp", FIRST_CALL, gelu_mlp, _whole(_t_gelu_mlp), _mlp_inputs,
             {"full": (2048, 1024, 4096, 1024), "smoke": (24, 32, 64, 32)},
             "gelu MLP: first call in a fresh process, cold and warm caches", flops=_mlp_flops, tol=5e-3),
]}


# The models family (training steps, language-model idioms) lives in its own module, which
# builds on the definitions above.
from benchmarks.models import MODEL_SPECS  # noqa: E402

WORKLOADS.update((spec["name"], Workload(kind=STEADY, **spec)) for spec in MODEL_SPECS)
# The cross-entropy heads reduce rows of a vocabulary: the long-row backend variants apply.
for _name in ("xent_take_along_axis", "xent_one_hot"):
    WORKLOADS[_name] = dataclasses.replace(WORKLOADS[_name], tags=WORKLOADS[_name].tags | {"long_rows"})
# Other names --workloads takes for a workload.
ALIASES = {"xent_take": "xent_take_along_axis", "xent_onehot": "xent_one_hot"}
FAMILIES = tuple(dict.fromkeys(w.family for w in WORKLOADS.values()))


def family_members(names) -> list[str]:
    """The names as given, each family name replaced by its members."""
    out = []
    for name in names:
        name = name.strip()
        out += [w.name for w in WORKLOADS.values() if w.family == name] or [ALIASES.get(name, name)]
    return out


# [Note: warm process]
# A sweep is measured twice, each in a fresh process with empty caches: "cold",
# where the clock also covers the backend's first compilation in the process
# (imports, initialization), and "warm process", where the child first runs
# another function through the same backend (PROCESS_WARMUP: silu instead of
# gelu, feature sizes halved, one row count outside the sweep), so its compiler
# is imported and initialized, and only then starts the clock. Nothing the
# warm-up compiled serves the sweep (other ops and other shapes: other kernels
# and executables), so every size is still compiled for; this is the situation
# of a process whose second model meets new shapes.
PROCESS_WARMUP = {"dynamic_mlp_sweep": dataclasses.replace(
    WORKLOADS["dynamic_mlp_sweep"], name="dynamic_mlp_sweep_warmup", jax_fn=silu_mlp, torch_fn=_whole(_t_silu_mlp),
    description="silu MLP: the warm-up of a warm-process sweep")}


def warmup_size(size: tuple) -> tuple:
    """The warm-up's size for a sweep case ``size`` (rows, feature sizes...): 64 rows
    (no sweep has it), every feature size halved."""
    return (64,) + tuple(max(1, d // 2) for d in size[1:])


def bytes_moved(arrays) -> int:
    """Bytes of every leaf: each input read once, each output written once."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(arrays))
