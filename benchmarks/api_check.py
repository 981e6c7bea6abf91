"""pallaskit.jit against jax.jit on what the CPU tests cannot reach: weakly
typed outputs of new sizes served by eager raw-Triton launches (automatic
dynamic shapes under default options on a GPU), jax.linearize, closures over
an enclosing trace, bound methods, the AOT stages' shardings. Values, dtypes
and weak types; one line per check, exit status 1 when any differs.

    python -m benchmarks.api_check
"""
from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallaskit


def _same(a, b) -> str:
    """'' when the pytrees agree in structure, dtype, weak type and value."""
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    if ta != tb:
        return f"tree {ta} vs {tb}"
    for x, y in zip(la, lb):
        if (x.shape, x.dtype, x.weak_type) != (y.shape, y.dtype, y.weak_type):
            return f"{x.shape} {x.dtype} weak={x.weak_type} vs {y.shape} {y.dtype} weak={y.weak_type}"
        tol = 2e-2 if x.dtype == jnp.bfloat16 else 1e-4
        if not np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=tol, atol=tol, equal_nan=True):
            return "values differ"
    return ""


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0

    def check(name, ours, theirs):
        nonlocal bad
        why = _same(ours, theirs)
        bad += bool(why)
        print(f"{'ok ' if not why else 'BAD'} {name}{': ' + why if why else ''}", flush=True)

    def schedule(x, base):
        return x * base, base * 2.0, jnp.tanh(x).sum()

    ours, theirs = pallaskit.jit(schedule), jax.jit(schedule)
    for n in (64, 96, 200, 96, 333):  # the second size makes the rows dynamic; later ones launch eagerly
        x = jnp.asarray(rng.standard_normal((n, 32)), jnp.int32)
        check(f"weak outputs, rows {n}", ours(x, 0.5), theirs(x, 0.5))

    def f(a, b):
        return jnp.sin(a) * b + a.sum(0)

    a = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((32,)), jnp.float32)
    (o1, l1), (o2, l2) = jax.linearize(pallaskit.jit(f), a, b), jax.linearize(jax.jit(f), a, b)
    check("linearize", (o1, l1(a, b)), (o2, l2(a, b)))

    def closing(jit):
        return jax.jit(jax.grad(lambda v: jit(lambda u: jnp.tanh(u * v))(a).sum()))(a)

    check("closure over an enclosing tracer", closing(pallaskit.jit), closing(jax.jit))

    def method(jit):
        class Scale:
            def __hash__(self):
                return 0

            def __eq__(self, other):
                return isinstance(other, Scale)

            @functools.partial(jit, static_argnums=0)
            def apply(self, v):
                return jnp.tanh(v) * 3.0

        return Scale().apply(a)

    check("bound method, static self", method(pallaskit.jit), method(jax.jit))
    c1, c2 = pallaskit.jit(f).lower(a, b).compile(), jax.jit(f).lower(a, b).compile()
    check("AOT compiled call", c1(a, b), c2(a, b))
    same = c1.input_shardings == c2.input_shardings and c1.output_shardings == c2.output_shardings
    bad += not same
    print(f"{'ok ' if same else 'BAD'} AOT shardings' structure", flush=True)
    print(f"{bad} of the checks differ on {jax.devices()[0].device_kind}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
