"""Workloads, each defined once: a JAX function, the same function in torch,
inputs, and the bytes it must move (its memory floor)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    jax_fn: Callable
    torch_fn: Callable | None
    make_inputs: Callable  # (size, dtype, key) -> tuple of jax arrays
    sizes: dict  # "full" / "smoke" -> size tuple
    min_bytes: Callable  # (inputs, outputs) -> bytes that must move
    rtol: float = 2e-2


def _io_bytes(inputs, outputs):
    leaves = list(inputs) + list(jax.tree_util.tree_leaves(outputs))
    return sum(x.size * x.dtype.itemsize for x in leaves)


def _normal(key, shape, dtype, shift=0.0):
    return (jax.random.normal(key, shape, jnp.float32) + shift).astype(dtype)


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


# -- torch definitions (imported lazily) ------------------------------------------
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


def _rows_cols_inputs(n_vectors):
    def make(size, dtype, key):
        r, c = size
        keys = jax.random.split(key, 1 + n_vectors)
        x = _normal(keys[0], (r, c), dtype, 0.3)
        return (x,) + tuple(_normal(k, (c,), dtype) for k in keys[1:])
    return make


def _two_matrices(size, dtype, key):
    k1, k2 = jax.random.split(key)
    return _normal(k1, size, dtype), _normal(k2, size, dtype)


WORKLOADS = {w.name: w for w in [
    Workload("add", add, _t_add, _two_matrices, {"full": (576000, 384), "smoke": (33, 100)}, _io_bytes),
    Workload("pointwise_chain", pointwise_chain, _t_chain, _two_matrices,
             {"full": (576000, 384), "smoke": (33, 100)}, _io_bytes),
    Workload("softmax", softmax, _t_softmax, _rows_cols_inputs(0), {"full": (32768, 4096), "smoke": (17, 300)},
             _io_bytes),
    Workload("rmsnorm_fwd", rmsnorm, _t_rmsnorm, _rows_cols_inputs(1), {"full": (576000, 384), "smoke": (33, 100)},
             _io_bytes),
    Workload("layernorm_fwd", layernorm, _t_layernorm, _rows_cols_inputs(2),
             {"full": (576000, 384), "smoke": (33, 100)}, _io_bytes),
]}
