"""Float argmax / argmin with NaNs, pallaskit's kernels compiled for the GPU.

    JAX_PLATFORMS=cuda,cpu PALLASKIT_INTERPRET=0 PYTHONPATH=. python -m benchmarks.fuzz.argmax_nan_gpu [--smoke]

jax's argmax reducer (``lax._ArgMinMaxReducer``) takes whichever NaN its
reduction tree meets (it is not commutative on two NaNs), so jax.jit on the
GPU may return any NaN's index, where jnp.argmax's documented result (NumPy's,
XLA:CPU's) is the first NaN's. This compiles pallaskit's kernels (persistent,
looped, column) and checks them against NumPy; it prints jax.jit's index
beside. Exit status 1 if pallaskit disagrees with NumPy anywhere.
"""
from __future__ import annotations

import sys

import numpy as np


def _data(rng, shape, dtype, nan_frac):
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < nan_frac] = np.nan
    x[rng.random(shape) < 0.02] = np.inf
    x[rng.random(shape) < 0.02] = -np.inf
    return x.astype(dtype)


def main(argv=None) -> int:
    smoke = "--smoke" in (sys.argv[1:] if argv is None else argv)  # a few cases (the CPU's interpret mode)
    import jax
    import jax.numpy as jnp

    import pallaskit
    pallaskit.config.update(cache=False)
    rng = np.random.default_rng(0)
    bad = 0
    cases = [((37, 100), -1, {}), ((5, 3000), -1, {"max_persistent_cols": 256}), ((1025, 64), 0, {}),
             ((100,), -1, {}), ((7, 8193), -1, {})]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)[:1 if smoke else 3]:
        for shape, axis, opts in cases[:2 if smoke else None]:
            for nan_frac in (0.0, 0.01, 0.3):
                x = jnp.asarray(_data(rng, shape, dtype, nan_frac))
                x64 = np.asarray(x, np.float64)
                for name in ("argmax", "argmin"):
                    fn = lambda x, name=name: getattr(jnp, name)(x, axis=axis)  # noqa: E731
                    before = pallaskit.metrics.counters["fallback_count"]
                    with pallaskit.config.override(**opts):
                        got = np.asarray(pallaskit.jit(fn)(x))
                    via = " (ran through XLA!)" if pallaskit.metrics.counters["fallback_count"] > before else ""
                    want = getattr(np, name)(x64, axis=axis)  # NumPy: the first NaN, else the first best
                    jit = np.asarray(jax.jit(fn)(x))
                    wrong = int((got != want).sum())
                    bad += wrong
                    print(f"{np.dtype(dtype).name:9} {name} {shape} axis={axis} {opts} nan={nan_frac}: "
                          f"pallaskit vs NumPy {wrong} differ{via}; jax.jit vs NumPy {int((jit != want).sum())} differ")
    print("pallaskit agrees with NumPy everywhere" if not bad else f"pallaskit: {bad} indices differ from NumPy")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
