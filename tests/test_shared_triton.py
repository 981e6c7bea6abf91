"""Raw-Triton kernels of the same code share one ``@triton.jit`` function
([Note: shared Triton functions] in lowering/codegen/program.py): a program of
repeated identical layers defines fewer kernel functions than it launches, runs
in Triton's interpreter (kernel_backend='triton') as jax.jit does, and keeps
each launch's equations in its comments."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering
import pallaskit
from conftest import assert_close
from lowering.codegen import program
from lowering.codegen.emitter import RenderedKernel

pytest.importorskip("triton")


def _layer(x, m, w, b, g):
    xf = (x @ m).astype(jnp.float32)  # a matmul between layers: they do not fuse into one kernel
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + 1e-5) * g + b
    return x + (jax.nn.gelu(y) * w).astype(x.dtype)


def _layers(x, params):
    for m, w, b, g in params:
        x = _layer(x, m, w, b, g)
    return x, jnp.sum(x.astype(jnp.float32) ** 2, axis=-1)


def _inputs(rng, dtype, rows, layers=3, width=96):
    x = rng.standard_normal((rows, width))
    x[0, 0], x[min(1, rows - 1), 3] = np.nan, np.inf
    params = [(jnp.asarray(rng.standard_normal((width, width)) / 10, dtype),
               *(jnp.asarray(rng.standard_normal((width,)), jnp.float32) for _ in range(3))) for _ in range(layers)]
    return jnp.asarray(x, dtype), params


def _source(fn, args) -> str:
    from pallaskit.api import compile_options

    with pallaskit.config.override(kernel_backend="triton", cache=False):
        return lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), compile_options()).program.source


@pytest.mark.parametrize("dtype,rows", [(jnp.float32, 37), (jnp.bfloat16, 1), (jnp.float32, 300)])
def test_repeated_layers_share_kernel_functions(rng, dtype, rows):
    args = _inputs(rng, dtype, rows)
    src = _source(_layers, args)
    launched = re.findall(r"TRITON_CALL\((\w+),", src)
    defined = re.findall(r"^@triton\.jit.*\ndef (\w+)\(", src, re.M)
    assert set(launched) <= set(defined)
    assert len(set(launched)) < len(launched), launched  # the layers' kernels are one function each
    assert len(defined) == len(set(defined))
    # every launch still names its equations: a shared function's users keep their comments
    assert src.count("# (runs ") >= len(launched) - len(set(launched))
    assert re.search(r"^# \w+ runs for \d+ launches: ", src, re.M)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        got = pallaskit.jit(_layers)(*args)
    want = jax.jit(_layers)(*args)
    # On the GPU a float32 template product runs as TF32 (XLA's dot does not): bf16's tolerance there.
    tol = jnp.bfloat16 if jax.default_backend() == "gpu" else dtype
    for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert_close(a, e, tol)


def test_gpt2_step_with_shared_functions_matches_jax():
    """benchmarks/models.py's GPT-2 training step at its smoke size (2 layers, clipped
    AdamW; combos whose parts and dispatchers are shared across launches), all raw
    Triton in the interpreter, against jax.jit (norm-wise, as the suite checks it)."""
    from benchmarks import models

    spec = next(s for s in models.MODEL_SPECS if s["name"] == "gpt2_12layer_train")
    args = spec["make_inputs"](spec["sizes"]["smoke"], jnp.float32, jax.random.key(3))
    src = _source(spec["jax_fn"], args)
    launched = re.findall(r"TRITON_CALL\((\w+),", src)
    assert len(set(launched)) < len(launched) and "noinline=True" in src
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        got = pallaskit.jit(spec["jax_fn"])(*args)
    want = jax.jit(spec["jax_fn"])(*args)
    for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape and np.isfinite(a).all()
        assert np.linalg.norm(a - e) <= 1e-4 * np.linalg.norm(e) + 1e-6


def _kernel(name, body, calls=()):
    lines = [f"# kernel {name}: from:", f"#   {name} = an equation"]
    for c in calls:
        lines += ["@triton.jit(noinline=True)", f"def {name}_{c}(pid, ref0):", f"    {body}  # {name}", ""]
    lines += ["@triton.jit", f"def {name}_kernel(in_ptr0):",
              *[f"    {name}_{c}(0, in_ptr0)  # {name} member" for c in calls], f"    {body}", "",
              f"def {name}(in0):", f"    return TRITON_CALL({name}_kernel, 1, (), in0)"]
    return RenderedKernel(name, "\n".join(lines), [], None, triton=True)


def test_only_functions_equal_but_for_names_are_shared():
    """Names that prefix one another, a constant that differs, functions that call
    shared functions, comments that differ."""
    ks = [_kernel("k1", "x = 1", ["p"]), _kernel("k11", "x = 1", ["p"]), _kernel("k2", "x = 2", ["p"]),
          _kernel("k3", "x = 1")]
    program.share_triton_functions(ks)
    src = "\n".join(k.source for k in ks)
    defined = re.findall(r"^def (\w+)\(", src, re.M)
    assert [d for d in defined if d.endswith(("_kernel", "_p"))] == ["k1_p", "k1_kernel", "k2_p", "k2_kernel",
                                                                      "k3_kernel"]
    assert "return TRITON_CALL(k1_kernel, 1, (), in0)" in ks[1].source
    assert "# (runs k1_kernel)" in ks[1].source and "# (runs k1_p)" in ks[1].source
    assert "#   k11 = an equation" in ks[1].source  # the launch's own equations stay
    assert "# k1_kernel runs for 2 launches: k1, k11" in ks[0].source
    assert "k1_p(0, in_ptr0)" in ks[0].source and "k2_p(0, in_ptr0)" in ks[2].source


# [Note: shared Pallas kernels]: Pallas kernels of the same code launch through one launcher.
def _pallas_kernel(name, body):
    lines = [f"# kernel {name}: from:", f"#   {name} = an equation", f"def {name}_kernel(in_ptr0, out_ptr0):",
             f"    {body}  # {name}", "", f"def {name}(in0):", f"    return pl.pallas_call({name}_kernel, name='{name}')(in0)"]
    return RenderedKernel(name, "\n".join(lines), [], None)


def test_only_pallas_kernels_equal_but_for_names_are_shared():
    ks = [_pallas_kernel("k1", "x = 1"), _pallas_kernel("k11", "x = 1"), _pallas_kernel("k2", "x = 2"),
          _pallas_kernel("k1_b", "x = 1")]
    program.share_pallas_kernels(ks)
    assert ks[1].source.splitlines() == ["# kernel k11: from:", "#   k11 = an equation",
                                         "k11 = k1  # the same kernel as k1: one compile"]
    assert ks[3].source.endswith("k1_b = k1  # the same kernel as k1: one compile")
    assert "def k1_kernel(" in ks[0].source and "def k2_kernel(" in ks[2].source


def test_repeated_pallas_layers_launch_one_kernel(rng):
    """Interpret mode, Pallas kernels: every layer after the first launches the first
    layer's kernels (the same pallas_call name: one XLA compile each), as jax.jit computes."""
    from pallaskit.api import compile_options

    args = _inputs(rng, jnp.float32, 37)
    with pallaskit.config.override(kernel_backend="pallas", cache=False):
        program_ = lowering.compile_jaxpr(jax.make_jaxpr(_layers)(*args), compile_options()).program
        got = pallaskit.jit(_layers)(*args)
    aliases = re.findall(r"^(\w+) = (\w+)  # the same kernel as", program_.source, re.M)
    names = re.findall(r"name='(\w+)'", program_.source)
    assert aliases and len(names) == len(set(names))
    assert {a for a, _ in aliases} <= {k.name for k in program_.kernels}
    assert {b for _, b in aliases} <= set(names)
    want = jax.jit(_layers)(*args)
    for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_close(a, e, jnp.float32)
