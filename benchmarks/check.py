"""The agreement check: every backend's outputs against one float32 reference,
before anything is timed."""
from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import SMALL

# Norm-wise relative error allowed per dtype (||got - ref|| / ||ref||), and for
# boolean outputs the fraction of elements allowed to differ (a sign test near 0).
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
BOOL_TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
LOCAL_FACTOR = 10  # max |got - ref| may reach LOCAL_FACTOR * tolerance * max |ref|


def upcast(arrays):
    return tuple(a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in arrays)


def reference(workload, inputs):
    """The workload's outputs from jax.jit on float32 inputs: what every backend is checked against."""
    return jax.tree_util.tree_leaves(jax.jit(lambda *a: workload.jax_fn(*upcast(a)))(*inputs))


@jax.jit
def _errors(got, want):
    d = got.astype(jnp.float32) - want.astype(jnp.float32)
    w = want.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(d * d)) / jnp.maximum(jnp.sqrt(jnp.sum(w * w)), 1e-30)
    local = jnp.max(jnp.abs(d)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30)
    bad = jnp.any(~jnp.isfinite(got.astype(jnp.float32)) & jnp.isfinite(w))
    return norm, local, bad


def _errors_small(got, want):
    g = np.asarray(got, np.float64)
    w = np.asarray(want, np.float64)
    d = g - w
    norm = np.sqrt(np.sum(d * d)) / max(np.sqrt(np.sum(w * w)), 1e-30)
    local = np.max(np.abs(d), initial=0.0) / max(np.max(np.abs(w), initial=0.0), 1e-30)
    return norm, local, bool(np.any(~np.isfinite(g) & np.isfinite(w)))


def agreement(got: list, want: list, dtype: str, tol_floor: float = 0.0) -> tuple[float, str | None]:
    """(worst norm-wise relative error, None if the outputs agree else why not)."""
    if len(got) != len(want):
        return float("inf"), f"{len(got)} outputs, expected {len(want)}"
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want)):
        if tuple(g.shape) != tuple(w.shape):
            return float("inf"), f"output {i} has shape {tuple(g.shape)}, expected {tuple(w.shape)}"
        if w.dtype == jnp.bool_:
            err = float(jnp.mean(g.astype(bool) != w))
            limit = BOOL_TOLERANCE[dtype]
            worst = max(worst, err)
            if err > limit:
                return worst, f"output {i}: {err:.3g} of booleans differ (allowed {limit:g})"
            continue
        errors = _errors_small if w.size <= SMALL else _errors  # small: no compile per shape
        norm, local, bad = (float(v) for v in errors(g, w))
        limit = max(TOLERANCE[dtype], tol_floor)
        worst = max(worst, norm)
        if bad or not np.isfinite(norm):
            return float("inf"), f"output {i} has non-finite values where the reference has none"
        if norm > limit or local > LOCAL_FACTOR * limit:
            return worst, (f"output {i}: relative error {norm:.3g} (allowed {limit:g}), "
                           f"largest element error {local:.3g} of max |ref|")
    return worst, None


def seed_of(part) -> int:
    """A stable 31-bit number for folding a name into a random key."""
    return zlib.crc32(str(part).encode()) & 0x7FFFFFFF
