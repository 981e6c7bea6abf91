"""Norm forward/backward functions used to probe the scheduler (scratch)."""
import jax, jax.numpy as jnp

EPS = 1e-6

def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (xf * r * w.astype(jnp.float32)).astype(x.dtype)

def rmsnorm_bwd_vjp(x, w, dy):
    _, vjp = jax.vjp(rmsnorm, x, w)
    return vjp(dy)

def layernorm(x, w, b):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + EPS) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)

def layernorm_fwd_bwd(x, w, b, dy):
    y, vjp = jax.vjp(layernorm, x, w, b)
    return (y,) + vjp(dy)
