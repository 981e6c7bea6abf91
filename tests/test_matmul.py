"""The matmul template (``lowering/rules/matmul.py``, ``codegen/matmul.py``) and
epilogue fusion, against jax.jit on fresh random inputs (interpret mode: the
shapes stay at a few thousand elements)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallaskit
from lowering import heuristics

F32, BF16 = jnp.float32, jnp.bfloat16
DTYPES = [F32, BF16]
# float32: summation order differs from XLA's; bfloat16: one rounding of the
# product (or of the epilogue, which sees the unrounded float32 product).
TOL = {np.dtype(F32): dict(rtol=1e-4, atol=1e-4), np.dtype(BF16): dict(rtol=2e-2, atol=3e-2)}
if jax.default_backend() != "cpu":
    # Compiled for the GPU, a float32 template product at DEFAULT precision runs
    # as TF32 (10-bit mantissa), while XLA computes degenerate products (a size-1
    # M, N or K, a matvec) in full float32: ~5e-3 apart on the H100.
    TOL[np.dtype(F32)] = dict(rtol=1e-2, atol=1e-2)


@pytest.fixture(autouse=True)
def _template_everywhere():
    """These tests exercise the template itself: run it wherever it applies,
    not only where the default ("auto") expects it to beat XLA; and its Pallas
    form, not the eager launches that serve dynamic sizes on a GPU by default
    (their template: tests/test_triton_codegen.py)."""
    with pallaskit.config.override(matmul_template="fused", dynamic_launch="off"):
        yield


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _operands(rng, dtype, *shapes, k=None):
    """One array per shape; scaled by 1/sqrt(k) so products stay O(1)."""
    return [_normal(rng, s, dtype, 1.0 if k is None or i == 0 else k ** -0.5) for i, s in enumerate(shapes)]


def check(fn, *args, kernels=None, fallbacks=()):
    """Run through pallaskit and jax.jit; compare; return the explanation.
    Tolerances follow the output dtype, or bfloat16's when any input is
    bfloat16 (XLA drops a bf16 product's rounding before a cast to float32,
    the template's epilogue keeps it)."""
    low = any(a.dtype == BF16 for a in args)
    out = pallaskit.jit(fn)(*args)
    ref = jax.jit(fn)(*args)
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert o.dtype == r.dtype and o.shape == r.shape, (o.dtype, r.dtype, o.shape, r.shape)
        if jnp.issubdtype(r.dtype, jnp.integer):
            np.testing.assert_array_equal(o, r)
        else:
            np.testing.assert_allclose(np.asarray(o, np.float64), np.asarray(r, np.float64),
                                       **TOL[np.dtype(BF16 if low else r.dtype)])
    e = pallaskit.explain(fn, *args)
    assert sorted(e.fallbacks) == sorted(fallbacks), e.fallbacks
    if kernels is not None:
        assert len(e.kernels) == kernels, str(e)
    return e


def _loads(k) -> list[str]:
    """The offset text of each load of a kernel's source (``KernelInfo``), in
    either renderer: Pallas' ``plt.load(ref.at[off])``, raw Triton's ``tl.load(ptr + off)``."""
    if k.executor == "pallas":
        return [ln.split("at[", 1)[1] for ln in k.source.splitlines() if "plt.load(" in ln and "at[" in ln]
    return [ln.split("tl.load(", 1)[1] for ln in k.source.splitlines() if "tl.load(" in ln]


def _stores(k) -> int:
    """The store statements of a kernel's source, in either renderer."""
    return k.source.count("plt.store(" if k.executor == "pallas" else "tl.store(")


def _dot(dims):
    return lambda a, b: lax.dot_general(a, b, dims)


# name -> (fn, lhs shape, rhs shape); contraction size for the scale is in the name's table
FORMS = {
    "plain": (lambda a, b: a @ b, (37, 50), (50, 24)),
    "m1": (lambda a, b: a @ b, (1, 50), (50, 24)),
    "n1": (lambda a, b: a @ b, (37, 50), (50, 1)),
    "k1": (lambda a, b: a @ b, (37, 1), (1, 24)),
    "matvec": (lambda a, b: a @ b, (37, 50), (50,)),
    "lhs_transposed": (_dot((((0,), (0,)), ((), ()))), (50, 37), (50, 24)),
    "rhs_transposed": (_dot((((1,), (1,)), ((), ()))), (37, 50), (24, 50)),
    "both_transposed": (_dot((((0,), (1,)), ((), ()))), (50, 37), (24, 50)),
    "jnp_T": (lambda a, b: a @ b.T, (37, 50), (24, 50)),
    "batched": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (3, 9, 20), (3, 20, 7)),
    "batch_not_leading": (_dot((((2,), (1,)), ((1,), (0,)))), (9, 3, 20), (3, 20, 7)),
    "batch_size1": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b), (1, 9, 20), (1, 20, 7)),
    "lhs_3d": (lambda a, b: a @ b, (2, 5, 33), (33, 7)),
    "two_contracting": (_dot((((1, 2), (0, 1)), ((), ()))), (6, 4, 9), (4, 9, 11)),
    "contracting_reordered": (_dot((((1, 2), (1, 0)), ((), ()))), (6, 4, 9), (9, 4, 11)),
    "multi_batch_free": (lambda a, b: jnp.einsum("abik,bakj->abij", a, b), (2, 3, 5, 12), (3, 2, 12, 6)),
    "long_k": (lambda a, b: a @ b, (5, 300), (300, 6)),
}


def _k_of(name):
    a, b = FORMS[name][1:]
    fn = FORMS[name][0]
    jaxpr = jax.make_jaxpr(fn)(jnp.zeros(a), jnp.zeros(b)).jaxpr
    (lc, _), _ = next(e for e in jaxpr.eqns if e.primitive.name == "dot_general").params["dimension_numbers"]
    return int(np.prod([a[d] for d in lc]))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_forms_match_jax(rng, form, dtype):
    fn, a, b = FORMS[form]
    x, w = _operands(rng, dtype, a, b, k=_k_of(form))
    e = check(fn, x, w, kernels=1)
    assert e.kernels[0].kind == "matmul"


@pytest.mark.parametrize("out", [F32, BF16], ids=["to_f32", "to_bf16"])
def test_preferred_element_type(rng, out):
    x, w = _operands(rng, BF16, (37, 50), (50, 24), k=50)
    check(lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out), x, w, kernels=1)
    x, w = _operands(rng, F32, (37, 50), (50, 24), k=50)
    check(lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out), x, w, kernels=1)


def test_float16(rng):
    x, w = _operands(rng, jnp.float16, (37, 50), (50, 24), k=50)
    out, ref = pallaskit.jit(lambda a, b: jnp.tanh(a @ b))(x, w), jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)
    assert out.dtype == ref.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=5e-3, atol=5e-3)
    assert [k.kind for k in pallaskit.explain(lambda a, b: jnp.tanh(a @ b), x, w).kernels] == ["matmul"]


@pytest.mark.pallas_source
def test_precision_highest_is_honoured(rng):
    x, w = _operands(rng, F32, (37, 50), (50, 24), k=50)
    e = check(lambda a, b: jnp.dot(a, b, precision=lax.Precision.HIGHEST), x, w, kernels=1)
    assert "precision=lax.Precision.HIGHEST" in e.source
    e = check(lambda a, b: jnp.dot(a, b), x, w, kernels=1)
    assert "Precision" not in e.source


# --------------------------------------------------------------------------- #
# epilogues
# --------------------------------------------------------------------------- #
EPILOGUES = {
    "bias": lambda y, b, r: y + b,
    "relu": lambda y, b, r: jax.nn.relu(y + b),
    "gelu_tanh": lambda y, b, r: jax.nn.gelu(y + b, approximate=True),
    "gelu_erf": lambda y, b, r: jax.nn.gelu(y + b, approximate=False),
    "tanh": lambda y, b, r: jnp.tanh(y),
    "silu": lambda y, b, r: jax.nn.silu(y),
    "residual": lambda y, b, r: r + y,
    "scale": lambda y, b, r: y * 0.125,
    "to_bf16": lambda y, b, r: (y + b).astype(BF16),
    "to_f32": lambda y, b, r: y.astype(F32) * 2.0,
    "bias_row": lambda y, b, r: y + r[:, :1],  # a per-row broadcast of another buffer
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_epilogue_is_one_kernel(rng, epilogue, dtype):
    x, w = _operands(rng, dtype, (37, 50), (50, 24), k=50)
    b, r = _normal(rng, (24,), dtype), _normal(rng, (37, 24), dtype)
    e = check(lambda x, w, b, r: EPILOGUES[epilogue](x @ w, b, r), x, w, b, r, kernels=1)
    assert e.kernels[0].kind == "matmul"


def test_gelu_bias_cast_mlp_layer_is_one_kernel_and_readable(rng):
    x, w = _operands(rng, BF16, (3, 11, 40), (40, 24), k=40)
    b = _normal(rng, (24,), F32)

    def layer(x, w, b):
        return jax.nn.gelu(x @ w + b).astype(BF16)

    e = check(layer, x, w, b, kernels=1)
    k = e.kernels[0]
    assert k.kind == "matmul" and any("dot_general" in q for q in k.equations)
    assert any("tanh" in q for q in k.equations) and any("convert_element_type" in q for q in k.equations)
    src = k.source
    assert "# matmul (operand views folded into its loads):" in src and "# epilogue:" in src
    if k.executor == "pallas":  # the K loop, products accumulated in float32
        assert "lax.fori_loop(0, K_BLOCKS, k_step" in src and "preferred_element_type=jnp.float32" in src
    else:
        assert "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)" in src and "acc = tl.dot(" in src
    assert "(matmul, " in str(e) and "matmul" in e.ir_after


def test_batched_epilogue_with_batched_residual(rng):
    x, w = _operands(rng, F32, (3, 9, 20), (3, 20, 7), k=20)
    r, b = _normal(rng, (3, 9, 7), F32), _normal(rng, (3, 1, 7), F32)
    check(lambda x, w, r, b: jnp.tanh(jnp.einsum("bij,bjk->bik", x, w) + b) * r, x, w, r, b, kernels=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_transposed_result_folds_into_the_store(rng, dtype):
    """Autodiff's weight gradients: dot_general then transpose. The transpose
    reads the product at its own element in transposed coordinates."""
    x, w = _operands(rng, dtype, (30, 37), (30, 24), k=30)
    e = check(lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ()))).T, x, w, kernels=1)
    e = check(lambda a, b: jnp.transpose(jnp.einsum("bij,bjk->bik", a, b), (2, 0, 1)) * 2.0,
              *_operands(rng, dtype, (3, 9, 20), (3, 20, 7), k=20), kernels=1)
    assert e.kernels[0].kind == "matmul"


def test_product_and_epilogue_both_outputs(rng):
    x, w = _operands(rng, BF16, (37, 50), (50, 24), k=50)
    e = check(lambda x, w: (x @ w, jax.nn.relu(x @ w) * 2.0), x, w, kernels=1)
    assert _stores(e.kernels[0]) == 2


def test_two_epilogue_outputs_and_a_reduction(rng):
    """Pointwise consumers fuse; a reduction of the product stays a kernel of its own."""
    x, w = _operands(rng, F32, (37, 50), (50, 24), k=50)
    b = _normal(rng, (24,), F32)
    e = check(lambda x, w, b: (jnp.tanh(x @ w + b), jnp.sum(x @ w, axis=-1)), x, w, b)
    kinds = sorted(k.kind for k in e.kernels)
    assert kinds == ["matmul", "reduction"]


def test_read_at_another_element_is_not_fused(rng):
    x, w = _operands(rng, F32, (37, 50), (50, 24), k=50)
    e = check(lambda x, w: (x @ w) + (x @ w)[::-1], x, w, kernels=2)
    assert [k.kind for k in e.kernels] == ["matmul", "pointwise"]


def test_chained_matmuls(rng):
    x, w1, w2 = _operands(rng, BF16, (37, 40), (40, 24), (24, 19), k=40)

    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1) @ w2 + x[:, :19]

    e = check(mlp, x, w1, w2, kernels=2)
    assert [k.kind for k in e.kernels] == ["matmul", "matmul"]


def test_operand_views_fold_and_computing_producers_are_materialized(rng):
    x, w = _operands(rng, F32, (50, 37), (24, 50), k=50)
    e = check(lambda x, w: x.T @ w.reshape(50, 24), x, w, kernels=1)  # views: folded into the loads
    assert e.kernels[0].kind == "matmul"
    e = check(lambda x, w: jnp.exp(x.T) @ w.reshape(50, 24), x, w, kernels=2)  # no prologue fusion
    assert [k.kind for k in e.kernels] == ["pointwise", "matmul"]
    e = check(lambda x, w: jnp.pad(x.T, ((0, 3), (0, 0))) @ w.reshape(50, 24)[:, :21], x, w)  # a masked view

    assert [k.kind for k in e.kernels][-1] == "matmul"


def test_reshapes_around_the_matmul_fold(rng):
    """x.reshape(-1, d) @ w, then back to 3-D: the reshapes' floor divisions
    cancel (index ranges known), the loads stay affine and the output reshape
    is the epilogue's store."""
    x, w = _operands(rng, F32, (2, 5, 20), (20, 8), k=20)
    b = _normal(rng, (8,), F32)
    e = check(lambda x, w, b: (x.reshape(-1, 20) @ w).reshape(2, 5, 8) + b, x, w, b, kernels=1)
    loads = _loads(e.kernels[0])
    assert loads and not any("//" in off or "%" in off for off in loads), loads
    check(lambda x, w: jnp.tanh(x @ w).reshape(10, 8), x, w, kernels=1)


# --------------------------------------------------------------------------- #
# what stays with XLA, and the option
# --------------------------------------------------------------------------- #
def test_integer_and_mixed_dtype_dots_stay_with_xla(rng):
    xi = jnp.asarray(rng.integers(-9, 9, (7, 12)), jnp.int32)
    wi = jnp.asarray(rng.integers(-9, 9, (12, 5)), jnp.int32)
    e = check(lambda a, b: (a @ b) * 2 + 1, xi, wi, kernels=1, fallbacks=["dot_general"])
    assert e.kernels[0].kind == "pointwise"
    x, w = _normal(rng, (7, 12), BF16), _normal(rng, (12, 5), F32)
    check(lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32), x, w,
          fallbacks=["dot_general"])


def test_algorithm_precision_stays_with_xla(rng):
    x, w = _operands(rng, F32, (7, 12), (12, 5), k=12)
    check(lambda a, b: jnp.dot(a, b, precision=(lax.Precision.DEFAULT, lax.Precision.HIGHEST)), x, w,
          fallbacks=["dot_general"])
    check(lambda a, b: jnp.dot(a, b, precision=lax.DotAlgorithmPreset.BF16_BF16_F32_X3), x, w,
          fallbacks=["dot_general"])


@pytest.mark.parametrize("dtype,preset", [(BF16, "BF16_BF16_F32"), (F32, "F32_F32_F32")])  # XLA:CPU has no F16_F16_F32
def test_the_algorithm_of_the_templates_own_arithmetic_is_taken(rng, dtype, preset):
    """The preset naming what the template computes for these operands (jax.nn.dot_product_attention asks
    bf16 x bf16 with float32 accumulation by name) is its default (16-bit) or HIGHEST (float32) precision:
    the attention's dots compiled, where they all ran through XLA."""
    x, w = _operands(rng, dtype, (7, 12), (12, 5), k=12)
    alg = getattr(lax.DotAlgorithmPreset, preset)
    e = check(lambda a, b: jnp.tanh(lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=alg,
                                                    preferred_element_type=F32)), x, w)
    assert [k.kind for k in e.kernels] == ["matmul"]
    if dtype == BF16:
        q, k = (_normal(rng, (2, 7, n, 8), BF16) for n in (4, 2))
        check(lambda q, k: jax.nn.dot_product_attention(q, k, k * 0.5, is_causal=True), q, k)
    other = lax.DotAlgorithmPreset.F32_F32_F32 if dtype != F32 else lax.DotAlgorithmPreset.BF16_BF16_F32
    check(lambda a, b: jnp.dot(a, b, precision=other, preferred_element_type=F32), x, w, fallbacks=["dot_general"])


def test_long_k_with_a_tiny_output_stays_with_xla(rng):
    """No split-K in the template: such products stay with XLA on a GPU-sized grid."""
    x, w = _operands(rng, F32, (16, 4096), (4096, 16), k=4096)
    with pallaskit.config.override(num_sms=132):
        check(lambda a, b: a @ b, x, w, kernels=0, fallbacks=["dot_general"])
    check(lambda a, b: a @ b, x[:, :512], w[:512], kernels=1)


@pytest.mark.parametrize("mode,kernels,kinds", [
    ("fused", 1, ["matmul"]), ("unfused", 2, ["matmul", "pointwise"]), ("off", 1, ["pointwise"])])
def test_option_modes(rng, mode, kernels, kinds):
    x, w = _operands(rng, BF16, (37, 50), (50, 24), k=50)
    b = _normal(rng, (24,), BF16)
    with pallaskit.config.override(matmul_template=mode):
        e = check(lambda x, w, b: jax.nn.relu(x @ w + b), x, w, b, kernels=kernels,
                  fallbacks=["dot_general"] if mode == "off" else [])
    assert [k.kind for k in e.kernels] == kinds


def test_auto_mode_keeps_the_template_where_it_wins(rng):
    """The default: the template for 16-bit products with few rows, XLA's
    matmul for float32 and for large products; XLA by choice is not a fallback."""
    with pallaskit.config.override(matmul_template="auto"):
        x, w = _operands(rng, BF16, (37, 50), (50, 24), k=50)
        e = check(lambda x, w: jax.nn.relu(x @ w), x, w, kernels=1)
        assert [k.kind for k in e.kernels] == ["matmul"]
        xf, wf = _operands(rng, F32, (37, 50), (50, 24), k=50)
        e = check(lambda x, w: jax.nn.relu(x @ w), xf, wf, kernels=1, fallbacks=[])
        assert [k.kind for k in e.kernels] == ["pointwise"] and "dot_general" in e.ir_after
        xb, wb = _operands(rng, BF16, (520, 8), (8, 520), k=8)
        e = check(lambda x, w: x @ w, xb, wb, kernels=0, fallbacks=[])
    assert heuristics.matmul_template_wins(1, 64, 4096, 4096, BF16)
    assert not heuristics.matmul_template_wins(1, 8192, 4096, 1024, BF16)
    assert not heuristics.matmul_template_wins(1, 64, 4096, 4096, F32)


def test_option_values_and_cache_key():
    from pallaskit.api import compile_options

    for value, mode in ((True, "fused"), (False, "off"), ("0", "off"), ("UNFUSED", "unfused")):
        pallaskit.config.update(matmul_template=value)
        assert pallaskit.config.matmul_template == mode
    with pytest.raises(ValueError, match="fused, unfused, off"):
        pallaskit.config.update(matmul_template="sometimes")
    pallaskit.config.update(matmul_template="off")
    off = compile_options().key()
    pallaskit.config.update(matmul_template="fused")
    assert "matmul_template='fused'" in compile_options().key() and compile_options().key() != off


# --------------------------------------------------------------------------- #
# tile configs
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 24, 37), (64, 4096, 4096), (256, 4096, 4096),
                                   (8192, 4096, 1024), (1024, 4096, 8192), (4096, 4096, 4096), (3, 100000, 5)])
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_matmul_config_is_valid(m, n, k, dtype):
    itemsize = np.dtype(dtype).itemsize
    cfg = heuristics.matmul_config(m, n, k, dtype)
    for blk in (cfg.block_m, cfg.block_n, cfg.block_k):
        assert blk >= 16 and blk & (blk - 1) == 0
    assert cfg.num_stages >= 1 and cfg.num_warps in (2, 4, 8)
    assert cfg.num_stages * (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize <= heuristics.MATMUL_SMEM_BYTES
    assert heuristics.matmul_config(m, n, k, dtype) == cfg  # a pure function of the sizes


def test_small_m_fills_the_gpu():
    cfg = heuristics.matmul_config(64, 4096, 4096, BF16, num_sms=132)
    assert -(-64 // cfg.block_m) * -(-4096 // cfg.block_n) >= 128  # ~one program per SM



def test_row_blocks_of_128_run_eight_warps():
    """A 128-row tile from 64 columns on runs 8 warps (a GELU epilogue over its
    accumulator spilled with 4: heuristics.matmul_config); smaller tiles keep 4."""
    for m, n, k in ((256, 4096, 4096), (512, 4096, 1024), (256, 8192, 8192)):
        cfg = heuristics.matmul_config(m, n, k, BF16, num_sms=132)
        assert cfg.block_m == 128 and cfg.block_n >= 64 and cfg.num_warps == 8, (m, n, k, cfg)
    cfg = heuristics.matmul_config(100, 4096, 1024, BF16, num_sms=132)
    assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (64, 64, 4), cfg

# --------------------------------------------------------------------------- #
# the GPU lowering, on the CPU
# --------------------------------------------------------------------------- #
@pytest.mark.pallas_source
def test_template_lowers_to_triton_ir():
    """Exporting for CUDA runs Pallas' Triton lowering (jaxpr -> Triton IR)
    without a GPU: unsupported primitives or shape errors in the template show
    up here, not first on the device. (PTX compilation does not run.)"""
    from jax import export

    from pallaskit.runtime import loader

    def layer(x, w, b, r):
        return (jax.nn.gelu(jnp.einsum("bij,bjk->bik", x, w) + b) * r).astype(BF16)

    args = [jnp.zeros(s, BF16) for s in ((2, 40, 96), (2, 96, 130), (130,), (2, 40, 130))]
    with pallaskit.config.override(interpret=False):
        res = pallaskit.jit(layer).lower_to_result(*args).result
    assert [k.kind for k in res.schedule.kernels] == ["matmul"]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = export.export(jax.jit(loader.load(res.program)), platforms=["cuda"], disabled_checks=checks)(*args)
    assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1


# --------------------------------------------------------------------------- #
# A dynamic M ([Note: symbolic dims]): one compile serves every row count
# --------------------------------------------------------------------------- #
DYN_FORMS = {
    # name: (fn, dynamic spec, operand shapes with n rows, contraction size)
    "gelu_bias": (lambda x, w, b: jax.nn.gelu(x @ w + b), {"x": {0: "n"}},
                  lambda n: ((n, 40), (40, 72), (72,)), 40),
    "3d_tokens": (lambda x, w: jnp.tanh(jnp.einsum("bsk,kn->bsn", x, w)), {"x": {0: "n"}},
                  lambda n: ((n, 3, 24), (24, 40)), 24),
    "lhs_transposed": (lambda xt, w: xt.T @ w, {"xt": {1: "n"}}, lambda n: ((24, n), (24, 33)), 24),
    "batched": (lambda x, w: jnp.einsum("bmk,bkn->bmn", x, w) * 2.0, {"x": {1: "n"}},
                lambda n: ((2, n, 16), (2, 16, 20)), 16),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("form", sorted(DYN_FORMS))
def test_dynamic_m_runs_in_the_template_compiled_once(form, dtype, rng):
    fn, spec, shapes, k = DYN_FORMS[form]
    f = pallaskit.jit(fn, dynamic=spec)
    before = dict(pallaskit.metrics.counters)
    for n in (7, 1, 64, 129):
        args = _operands(rng, dtype, *shapes(n), k=k)
        out, ref = f(*args), jax.jit(fn)(*args)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(ref, np.float64), **TOL[np.dtype(dtype)])
    counters = pallaskit.metrics.counters
    assert counters["graphs_compiled"] - before["graphs_compiled"] == 1
    assert counters["dynamic_fallbacks"] == before["dynamic_fallbacks"]
    e = pallaskit.explain(f, *args)
    assert [k.kind for k in e.kernels] == ["matmul"], str(e)
    assert "M_BLOCKS = (M + BLOCK_M - 1) // BLOCK_M" in e.kernels[0].source


def test_dynamic_k_or_n_stays_with_xla(rng):
    """Only M may be dynamic in the template; a dynamic K (or N) is XLA's dot."""
    fn = lambda x, w: jax.nn.relu(x @ w)  # noqa: E731
    f = pallaskit.jit(fn, dynamic={"x": {1: "k"}, "w": {0: "k"}})
    for kk in (5, 33):
        x, w = _operands(rng, F32, (9, kk), (kk, 12), k=kk)
        np.testing.assert_allclose(f(x, w), jax.jit(fn)(x, w), **TOL[np.dtype(F32)])
    e = pallaskit.explain(f, x, w)
    assert [k.kind for k in e.kernels] == ["pointwise"] and "dot_general" in e.ir_after


def test_dynamic_m_auto_mode_decides_at_the_hint(rng):
    """'auto' asks heuristics.matmul_template_wins at the size hint (here the
    first call's rows: no multi-kernel hints): few rows, the template; many, XLA."""
    fn = lambda x, w: x @ w  # noqa: E731
    with pallaskit.config.override(matmul_template="auto", multi_kernel_hints=""):
        for rows, kinds in ((40, ["matmul"]), (600, [])):
            x, w = _operands(rng, BF16, (rows, 16), (16, 600), k=16)
            f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
            np.testing.assert_allclose(np.asarray(f(x, w), np.float32), np.asarray(jax.jit(fn)(x, w), np.float32),
                                       **TOL[np.dtype(BF16)])
            assert [k.kind for k in pallaskit.explain(f, x, w).kernels] == kinds


@pytest.mark.pallas_source
def test_dynamic_m_template_lowers_to_triton_ir_for_each_size():
    """Pallas' Triton lowering of the dynamic-M template (runtime M from
    ``dims_ptr``, the grid from the wrapper), on the CPU for two sizes."""
    from jax import export

    from pallaskit.runtime import loader

    fn, spec, shapes, _ = DYN_FORMS["gelu_bias"]
    f = pallaskit.jit(fn, dynamic=spec)
    with pallaskit.config.override(interpret=False):
        res = f.lower_to_result(*[jnp.zeros(s, BF16) for s in shapes(7)]).result
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    call = jax.jit(loader.load(res.program))
    for n in (1, 1000):
        exported = export.export(call, platforms=["cuda"], disabled_checks=checks)(
            *[jnp.zeros(s, BF16) for s in shapes(n)])
        assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 1


@pytest.mark.usefixtures("xla_defaults")  # the template's loops run long in Pallas's interpreter
def test_dynamic_m_multi_kernel_variants_are_template_and_xla(rng):
    """With multi-kernel hints, 'auto' gives a dynamic-M product two variants:
    the template (tiles at hint 64) and XLA's dot (hint 4096, many rows). On
    the CPU the dispatcher takes the nearest hint: few rows run the template,
    many run XLA, and both match jax.jit (N = 600: past the template's 512 at hint 4096)."""
    from pallaskit.runtime import multikernel

    fn = lambda x, w: jax.nn.relu(x @ w)  # noqa: E731
    with pallaskit.config.override(matmul_template="auto", multi_kernel_hints="64,4096"):
        f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
        for rows in (40, 3000):
            x, w = _operands(rng, BF16, (rows, 16), (16, 600), k=16)
            np.testing.assert_allclose(np.asarray(f(x, w), np.float32), np.asarray(jax.jit(fn)(x, w), np.float32),
                                       **TOL[np.dtype(BF16)])
        d = f.lower_to_result(x, w).executable
    assert isinstance(d, multikernel.Dispatcher) and len(d.variants) == 2
    assert "BLOCK_M" in d.variants[0].source and "EXTERNS" not in d.variants[0].source  # the template
    assert ("plt.load" in d.variants[0].source) != ("TRITON_CALL(" in d.variants[0].source)  # in one renderer
    assert "BLOCK_M" not in d.variants[1].source and "EXTERNS" in d.variants[1].source  # XLA's dot
    if d.interpret:  # the nearest hint; compiled for a GPU the dispatcher times the variants instead
        assert d.chosen == {(40,): 0, (3000,): 1}
    else:
        assert set(d.chosen) == {(40,), (3000,)} and set(d.methods.values()) == {"benchmark"}
