"""Many persistent reductions of one kernel written inside an always-true
region in raw Triton ([Note: reductions in a region] in lowering/codegen/rows.py):
the same values as jax.jit (Triton's interpreter, kernel_backend='triton'), the
region only past ``heuristics.REDUCTION_REGION_MIN`` reductions, and every
load still issued once."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering
import pallaskit
from conftest import assert_close
from lowering import heuristics

pytest.importorskip("triton")

REGION = "if pid >= 0:  # always: a region"


def _source(fn, args) -> str:
    from pallaskit.api import compile_options

    with pallaskit.config.override(kernel_backend="triton", cache=False):
        return lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), compile_options()).program.source


def _run(fn, args):
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        return pallaskit.jit(fn)(*args)


def _special(rng, shape, dtype):
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    if flat.size >= 4:
        flat[rng.choice(flat.size, size=4, replace=False)] = [np.nan, np.inf, -np.inf, -0.0]
    return jnp.asarray(x, dtype)


def _many(xs, b):
    """A chain over two reductions per array (a global norm's shape), plus an
    argmax, a bool any and an int min over the same rows."""
    acc = jnp.float32(0)
    for x in xs:
        acc = acc + jnp.sum(jnp.square(x.astype(jnp.float32)), -1) + jnp.max(x, -1).astype(jnp.float32)
    return jnp.sqrt(acc), jnp.argmax(xs[0], -1), jnp.any(xs[1] > 1, -1), jnp.min(b, -1)


def _args(rng, dtype, rows, cols, n=9):
    xs = [jnp.asarray(rng.standard_normal((rows, cols)), dtype) for _ in range(n)]
    xs[2] = _special(rng, (rows, cols), dtype)
    return xs, jnp.asarray(rng.integers(-5, 5, (rows, cols)), jnp.int32)


@pytest.mark.parametrize("dtype,rows,cols", [(jnp.float32, 37, 50), (jnp.bfloat16, 1, 768), (jnp.float32, 5, 3)])
def test_many_reductions_in_a_region_match_jax_jit(dtype, rows, cols, rng):
    args = _args(rng, dtype, rows, cols)
    src = _source(_many, args)
    assert REGION in src
    # each array is loaded once in the kernel holding the region
    at = src.index(REGION)
    kernel = src[src.rindex("\ndef ", 0, at):src.index("\n\n", at)]
    loads = re.findall(r"tl\.load\((\w+) \+", kernel)
    assert len(loads) == len(set(loads)) >= len(args[0]), loads
    got = _run(_many, args)
    for g, w in zip(got, jax.jit(_many)(*args)):
        assert g.dtype == w.dtype and g.shape == w.shape
        if np.issubdtype(w.dtype, np.floating):
            assert_close(g, w, jnp.float32)
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_global_norm_of_one_row_per_array(rng):
    """GPT-2's clip: the sum of squares of many 1-D arrays and of partial sums, one chain."""
    shapes = [(768,)] * 20 + [(3,), (1,), (50, 7)]

    def norm(gs):
        return jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in gs))

    gs = [_special(rng, s, jnp.bfloat16 if i % 3 else jnp.float32) for i, s in enumerate(shapes)]
    assert REGION in _source(norm, (gs,))
    got, want = _run(norm, (gs,)), jax.jit(norm)(gs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want))  # NaN in, NaN out
    gs = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    np.testing.assert_allclose(np.asarray(_run(norm, (gs,))), np.asarray(jax.jit(norm)(gs)), rtol=1e-6)


def test_few_reductions_stay_as_they_were(rng, monkeypatch):
    args = _args(rng, jnp.float32, 37, 50, n=3)  # 3 x 2 + 2 reductions in one kernel
    assert REGION not in _source(_many, args)
    monkeypatch.setattr(heuristics, "REDUCTION_REGION_MIN", 4)
    assert REGION in _source(_many, args)
