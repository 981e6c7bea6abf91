"""Norm backward in one pass (mix-order reduction), split reductions, and the
NHWC layout example: results against jax.jit, kernel counts through explain."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from pallaskit import metrics

# The mix kernels' loops run long in Pallas's interpreter: compiled as XLA:CPU compiles by default
# ([Note: the suite's XLA:CPU compiles] in tests/conftest.py; 51 s from 16 s for one case without)
pytestmark = pytest.mark.usefixtures("xla_defaults")

EPS = 1e-6
M = 1100  # rows: above heuristics.MIN_SPLIT_ROWS, not a multiple of any block


# --------------------------------------------------------------------------- #
# The functions, written out by hand and through autodiff
# --------------------------------------------------------------------------- #
def rmsnorm(x, w=None):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    if w is not None:
        y = y * w.astype(jnp.float32)
    return y.astype(x.dtype)


def layernorm(x, w=None, b=None):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + EPS)
    if w is not None:
        y = y * w.astype(jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


def rmsnorm_bwd_hand(x, w, dy):
    """dx = rstd * (g - xhat * mean(g * xhat)), g = dy * w; dw = sum(dy * xhat)."""
    xf, dyf, wf = x.astype(jnp.float32), dy.astype(jnp.float32), w.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    xhat = xf * rstd
    g = dyf * wf
    dx = rstd * (g - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    dw = jnp.sum(dyf * xhat, axis=0)
    return dx.astype(x.dtype), dw.astype(w.dtype)


def layernorm_bwd_hand(x, w, dy):
    xf, dyf, wf = x.astype(jnp.float32), dy.astype(jnp.float32), w.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True) + EPS)
    xhat = (xf - mu) * rstd
    g = dyf * wf
    dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * jnp.mean(g * xhat, axis=-1, keepdims=True))
    return dx.astype(x.dtype), jnp.sum(dyf * xhat, axis=0).astype(w.dtype), jnp.sum(dyf, axis=0).astype(w.dtype)


def rmsnorm_bwd_vjp(x, w, dy):
    return jax.vjp(rmsnorm, x, w)[1](dy)


def rmsnorm_bwd_noweight(x, dy):
    return jax.vjp(rmsnorm, x)[1](dy)


def rmsnorm_grad(x, w, dy):
    loss = lambda x, w: jnp.sum(rmsnorm(x, w).astype(jnp.float32) * dy.astype(jnp.float32))  # noqa: E731
    return jax.grad(loss, argnums=(0, 1))(x, w)


def layernorm_fwd_bwd(x, w, b, dy):
    y, vjp = jax.vjp(layernorm, x, w, b)
    return (y,) + vjp(dy)


def layernorm_bwd_noaffine(x, dy):
    return jax.vjp(layernorm, x)[1](dy)


@pytest.fixture(autouse=True)
def one_sm():
    """Size grids for one SM: M = 1100 rows then fill the persistent grid, as
    576000 rows do on a 132-SM GPU (heuristics.mix_worthwhile)."""
    with pallaskit.config.override(num_sms=1):
        yield


def _inputs(rng, n, dtype, with_w=True, with_b=False):
    x = jnp.asarray(rng.standard_normal((M, n)), dtype)
    dy = jnp.asarray(rng.standard_normal((M, n)), dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, n), dtype)
    b = jnp.asarray(rng.standard_normal(n), dtype)
    return x, w, b, dy


def _check(got, want, dtype):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for g, r in zip(got, want):
        assert g.shape == r.shape and g.dtype == r.dtype
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        # Column sums over 1100 rows: scale the tolerance to the magnitude.
        scale = max(1.0, float(np.abs(r).max()))
        tol = 2e-2 * scale if dtype == jnp.bfloat16 else 2e-5 * scale
        np.testing.assert_allclose(g, r, rtol=0, atol=tol)


def _kernels(fn, *args, **opts):
    with pallaskit.config.override(**opts):
        return pallaskit.explain(fn, *args).kernels


CASES = [(384, jnp.float32), (1000, jnp.bfloat16), (8192, jnp.bfloat16)]


# N = 8192 (8 warps, 2 programs per SM) once: it is the slowest case in interpret mode.
RMS_CASES = [(f, n, d) for f in (rmsnorm_bwd_hand, rmsnorm_bwd_vjp, rmsnorm_grad) for n, d in CASES[:2]]
RMS_CASES.append((rmsnorm_bwd_vjp,) + CASES[2])


@pytest.mark.no_speculation
@pytest.mark.parametrize("fn,n,dtype", RMS_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_rmsnorm_backward_one_pass(fn, n, dtype, rng):
    x, w, _, dy = _inputs(rng, n, dtype)
    kernels = _kernels(fn, x, w, dy)
    assert [k.kind for k in kernels] == ["mix", "reduction"], [k.name for k in kernels]
    metrics.reset()
    _check(pallaskit.jit(fn)(x, w, dy), jax.jit(fn)(x, w, dy), dtype)
    assert metrics.counters["codegen_mix_order_reduction"] == 1


@pytest.mark.parametrize("n,dtype", CASES[:2], ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("fn", [layernorm_bwd_hand, layernorm_fwd_bwd], ids=lambda f: f.__name__)
def test_layernorm_backward_one_pass(fn, n, dtype, rng):
    x, w, b, dy = _inputs(rng, n, dtype)
    args = (x, w, dy) if fn is layernorm_bwd_hand else (x, w, b, dy)
    kernels = _kernels(fn, *args)
    assert [k.kind for k in kernels] == ["mix", "reduction"], [k.name for k in kernels]
    _check(pallaskit.jit(fn)(*args), jax.jit(fn)(*args), dtype)


@pytest.mark.parametrize("fn", [rmsnorm_bwd_noweight, layernorm_bwd_noaffine], ids=lambda f: f.__name__)
def test_without_weight_there_is_no_column_reduction(fn, rng):
    x, _, _, dy = _inputs(rng, 384, jnp.bfloat16)
    kernels = _kernels(fn, x, dy)
    assert len(kernels) == 1 and kernels[0].kind == "reduction"
    _check(pallaskit.jit(fn)(x, dy), jax.jit(fn)(x, dy), jnp.bfloat16)


def test_option_off_takes_more_kernels(rng):
    # The GPU's decisions for the benchmark's shape (explain compiles, runs nothing):
    # off is a row kernel, a split column sum and its finisher.
    x, w, b, dy = (jnp.zeros(s, jnp.bfloat16) for s in ((576000, 384), (384,), (384,), (576000, 384)))
    on = _kernels(rmsnorm_bwd_vjp, x, w, dy, num_sms=132)
    off = _kernels(rmsnorm_bwd_vjp, x, w, dy, mix_order_reduction=False, num_sms=132)
    assert len(on) == 2 and len(off) == 3
    lon = _kernels(layernorm_fwd_bwd, x, w, b, dy, num_sms=132)
    loff = _kernels(layernorm_fwd_bwd, x, w, b, dy, mix_order_reduction=False, num_sms=132)
    assert len(lon) == 2 and len(loff) > len(lon)
    # explain names the refusals (can_fuse's WhyNoFuse): only with the option off
    reason = "mix-order reduction is off (option mix_order_reduction)"
    with pallaskit.config.override(mix_order_reduction=False, num_sms=132):
        assert reason in str(pallaskit.explain(rmsnorm_bwd_vjp, x, w, dy))
    with pallaskit.config.override(num_sms=132):
        assert reason not in str(pallaskit.explain(rmsnorm_bwd_vjp, x, w, dy))
    x, w, b, dy = _inputs(rng, 384, jnp.float32)
    with pallaskit.config.override(mix_order_reduction=False):
        _check(pallaskit.jit(rmsnorm_bwd_vjp)(x, w, dy), jax.jit(rmsnorm_bwd_vjp)(x, w, dy), jnp.float32)


def test_few_rows_for_the_grid_keep_row_work_apart():
    """8192 x 1024 on 132 SMs: 128 programs would carry all the row work (profit says no)."""
    x = jnp.zeros((8192, 1024), jnp.bfloat16)
    w = jnp.zeros((1024,), jnp.bfloat16)
    kinds = sorted(k.kind for k in _kernels(rmsnorm_bwd_vjp, x, w, x, num_sms=132))
    assert kinds == ["mix", "reduction", "reduction"]  # split column sum, its finisher, the row kernel


def test_small_row_counts_keep_plain_reductions(rng):
    """Below MIN_SPLIT_ROWS the column reduction is not split (profit threshold)."""
    x = jnp.asarray(rng.standard_normal((64, 384)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(384), jnp.float32)
    kernels = _kernels(rmsnorm_bwd_vjp, x, w, x)
    assert all(k.kind != "mix" for k in kernels)
    _check(pallaskit.jit(rmsnorm_bwd_vjp)(x, w, x), jax.jit(rmsnorm_bwd_vjp)(x, w, x), jnp.float32)


@pytest.mark.pallas_source  # MIX_PREFETCH is the Pallas kernel's; raw Triton pipelines with tl.range
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_mix_kernel_loads_rows_ahead(depth, rng, monkeypatch):
    """The mix kernel's loop carries the row loads of the next ``depth`` row
    blocks (heuristics.MIX_PREFETCH); blocks past the last row load nothing.
    LayerNorm: a loop carrying two column accumulators and the prefetched rows."""
    from lowering import heuristics
    monkeypatch.setattr(heuristics, "MIX_PREFETCH", depth)
    x, w, b, dy = _inputs(rng, 1000, jnp.bfloat16)
    with pallaskit.config.override(cache=False):
        kernels = _kernels(layernorm_fwd_bwd, x, w, b, dy)
        assert kernels[0].kind == "mix"
        assert kernels[0].source.count("rows0 = load_rows(") == (depth > 0)
        _check(pallaskit.jit(layernorm_fwd_bwd)(x, w, b, dy), jax.jit(layernorm_fwd_bwd)(x, w, b, dy), jnp.bfloat16)


def three_sums(x, dy):
    """A row reduction and three column sums over one domain."""
    xf, dyf = x.astype(jnp.float32), dy.astype(jnp.float32)
    dx = xf * jnp.sum(xf * dyf, axis=1, keepdims=True)
    return dx.astype(x.dtype), jnp.sum(dyf * xf, 0), jnp.sum(dyf, 0), jnp.sum(xf, 0)


def _programs(kernel) -> int:
    return int(kernel.source.split("PROGRAMS = ")[1].split()[0])


def test_mix_programs_and_prefetch_follow_the_column_sums():
    """The GPU's plan at the benchmark shape: one column sum (RMSNorm's dw)
    runs 16 programs per SM, two (LayerNorm's dw, db: more registers) 12, both
    loading rows ahead; three keep 16 and load nothing ahead (not measured)."""
    x, w = jnp.zeros((576000, 384), jnp.bfloat16), jnp.zeros((384,), jnp.bfloat16)
    opts = dict(num_sms=132, kernel_backend="pallas")
    rms = _kernels(rmsnorm_bwd_vjp, x, w, x, **opts)[0]
    ln = _kernels(layernorm_fwd_bwd, x, w, w, x, **opts)[0]
    three = _kernels(three_sums, x, x, **opts)[0]
    assert rms.kind == ln.kind == three.kind == "mix"
    assert (_programs(rms), _programs(ln), _programs(three)) == (132 * 16, 132 * 12, 132 * 16)
    assert "load_rows" in rms.source and "load_rows" in ln.source and "load_rows" not in three.source


# --------------------------------------------------------------------------- #
# Raw-Triton mix kernels (kernel_backend='triton'; interpret mode: Triton's
# interpreter through a host callback; on a GPU: compiled, inside XLA)
# --------------------------------------------------------------------------- #
TRITON_CASES = [(rmsnorm_bwd_vjp, 384, jnp.bfloat16), (rmsnorm_bwd_hand, 1000, jnp.float32),
                (rmsnorm_grad, 384, jnp.float32), (rmsnorm_bwd_vjp, 2048, jnp.bfloat16)]


@pytest.mark.parametrize("fn,n,dtype", TRITON_CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_triton_mix_kernel_matches_jax_jit(fn, n, dtype, rng):
    """RMSNorm backward with its mix kernel in raw Triton: 1100 rows (not a
    multiple of the row blocks or of the 2 programs), 384 / 1000 / 2048
    columns (masked lanes; 8 / 4 / 2 rows a block), by hand, vjp and grad."""
    pytest.importorskip("triton")
    x, w, _, dy = _inputs(rng, n, dtype)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        kernels = _kernels(fn, x, w, dy)
        got = pallaskit.jit(fn)(x, w, dy)
    assert [k.kind for k in kernels] == ["mix", "reduction"]
    assert "@triton.jit" in kernels[0].source and "TRITON_CALL(" in kernels[0].source
    assert f"block {min(8, 4096 // (1 << (n - 1).bit_length()))} x " in kernels[0].source  # 8, 4, 8, 2 rows
    _check(got, jax.jit(fn)(x, w, dy), dtype)


def test_triton_mix_kernels_plan_and_limits():
    """The GPU's plan at the benchmark shape: 2 programs per SM, 8 rows a step,
    8 warps, 3 pipelined stages, one partial row per program. Two column sums
    (LayerNorm): 4 rows a step in 2 warps. Rows too long for 2 rows a tile take
    one row a step (executors kind 'mix_long_rows'): 8 warps and 2 programs per
    SM with one column sum, 4 warps and 2 programs per SM with two."""
    x, w = jnp.zeros((576000, 384), jnp.bfloat16), jnp.zeros((384,), jnp.bfloat16)
    opts = dict(num_sms=132, kernel_backend="triton")
    rms = _kernels(rmsnorm_bwd_vjp, x, w, x, **opts)
    assert [k.kind for k in rms] == ["mix", "reduction"]
    # 72000 row blocks of 8 over 264 programs: 272 full steps pipelined, then one with rows masked
    assert "tl.range(0, 272, num_stages=3)" in rms[0].source and "tl.range(272, 273, num_stages=1)" in rms[0].source
    assert "PROGRAMS = 264" in rms[0].source
    assert "num_warps=8" in rms[0].source and "384 x 264" in rms[1].source  # the finisher sums 264 partial rows
    # sums of x*x and x*dy*w need no select (0 past the last column); dw's x*rstd*dy does (rstd: a row
    # value), in the last loop only
    assert rms[0].source.count("tl.where(") == 1
    ln = _kernels(layernorm_fwd_bwd, x, w, w, x, **opts)[0]
    # two column sums (dw, db): 4 rows a step in 2 warps, 4 programs per SM
    assert ln.kind == "mix" and "@triton.jit" in ln.source and "PROGRAMS = 528" in ln.source
    assert "num_warps=2" in ln.source and "BLOCK_R=4," in ln.source
    wide = jnp.zeros((20000, 4096), jnp.bfloat16)
    long_rows = _kernels(rmsnorm_bwd_vjp, wide, wide[0], wide, **opts)[0]
    assert long_rows.kind == "mix" and "@triton.jit" in long_rows.source and "BLOCK_R=1," in long_rows.source
    assert "PROGRAMS = 264" in long_rows.source and "num_warps=8" in long_rows.source
    wide_ln = _kernels(layernorm_fwd_bwd, wide, wide[0], wide[0], wide, **opts)[0]
    assert wide_ln.kind == "mix" and "BLOCK_R=1," in wide_ln.source
    assert "PROGRAMS = 264" in wide_ln.source and "num_warps=4" in wide_ln.source
    from lowering import executors
    from lowering.options import CompileOptions
    gpu = CompileOptions(interpret=False, triton_available=True)
    assert executors.choose(executors.kernel_kind("mix", True, 1, long_rows=True), gpu).executor == "triton_xla"


def masked_lanes_matter(x, w, dy):
    """Row sums whose operand is not 0 past the last column (x / w there is
    0 / 0, exp(x) is 1), and a column sum: the selects must stay."""
    xf, wf, dyf = x.astype(jnp.float32), w.astype(jnp.float32), dy.astype(jnp.float32)
    r = jnp.sum(xf / wf, axis=1, keepdims=True) + jnp.sum(jnp.exp(xf), axis=1, keepdims=True)
    return (xf * r).astype(x.dtype), jnp.sum(dyf * xf * r, axis=0)


def test_triton_mix_kernel_keeps_the_selects_that_matter(rng):
    pytest.importorskip("triton")
    x, w, _, dy = _inputs(rng, 1000, jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        (mix, *_) = _kernels(masked_lanes_matter, x, w, dy)
        got = pallaskit.jit(masked_lanes_matter)(x, w, dy)
    # two row sums in each of the two loops, and the column sum's select in the last loop
    assert mix.kind == "mix" and "@triton.jit" in mix.source and mix.source.count("tl.where(") == 5
    _check(got, jax.jit(masked_lanes_matter)(x, w, dy), jnp.float32)


def test_triton_call_kernels_live_as_long_as_a_program_uses_them(rng):
    """Equal launches share one kernel record (equal primitive parameters; on a
    GPU, one PTX compile); once the program that launched them is gone, so is
    the record."""
    pytest.importorskip("triton")
    import gc
    import weakref

    from pallaskit.runtime import triton_call

    x, w, _, dy = _inputs(rng, 384, jnp.float32)
    known = list(triton_call._kernels.values())  # other tests' records, alive or not
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        f = pallaskit.jit(rmsnorm_bwd_hand)
        jax.block_until_ready(f(x, w, dy))
        jax.block_until_ready(f(x, w, dy))
    new = [v for v in list(triton_call._kernels.values()) if not any(v is o for o in known)]
    assert sorted(v.name.split("_")[0] for v in new) == ["mix", "red"]  # the mix kernel and its finisher
    for kernel in new:
        assert triton_call._kernel(kernel.fn, kernel.num_warps, kernel.num_stages) is kernel
    alive = [weakref.ref(kernel) for kernel in new]
    del f, kernel, new, known
    jax.clear_caches()
    gc.collect()
    assert [a() for a in alive] == [None, None]


def test_kernel_backend_option():
    """kernel_backend reaches CompileOptions as given (lowering/executors.py
    resolves 'auto'); the deprecated triton_mix_kernels still works: 'on' is
    'triton', 'off' 'pallas'. Bad values are refused."""
    from pallaskit.api import compile_options

    with pallaskit.config.override(interpret=True, kernel_backend="auto"):
        assert compile_options().kernel_backend == "auto"
    for old, new in (("on", "triton"), ("off", "pallas"), ("auto", "auto")):
        with pallaskit.config.override(interpret=True, kernel_backend="auto", triton_mix_kernels=old):
            assert compile_options().kernel_backend == new
    with pallaskit.config.override(triton_mix_kernels="on", kernel_backend="pallas"):
        assert compile_options().kernel_backend == "pallas"  # the new option wins
    with pytest.raises(ValueError, match="'auto', 'pallas' or 'triton'"):
        pallaskit.config.update(kernel_backend="sometimes")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        pallaskit.config.update(triton_mix_kernels="sometimes")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="a CUDA GPU")
def test_triton_is_available_by_default_on_a_cuda_gpu():
    pytest.importorskip("triton")
    from pallaskit.api import compile_options

    with pallaskit.config.override(interpret=False):
        assert compile_options().triton_available is True


def test_mix_kernel_with_three_column_sums_is_right(rng):
    x, dy = (jnp.asarray(rng.standard_normal((M, 300)), jnp.bfloat16) for _ in range(2))
    with pallaskit.config.override(cache=False):
        assert _kernels(three_sums, x, dy)[0].kind == "mix"
        _check(pallaskit.jit(three_sums)(x, dy), jax.jit(three_sums)(x, dy), jnp.bfloat16)


def test_mix_kernel_is_explained(rng):
    x, w, _, dy = _inputs(rng, 384, jnp.float32)
    e = pallaskit.explain(rmsnorm_bwd_vjp, x, w, dy)
    assert "(mix, " in str(e) and "PROGRAMS" in e.kernels[0].source


# --------------------------------------------------------------------------- #
# Split reductions
# --------------------------------------------------------------------------- #
SPLITS = [
    ("column_sum", lambda a: jnp.sum(a.astype(jnp.float32), axis=0), (20001, 383)),
    ("column_max", lambda a: jnp.max(a, axis=0), (4097, 129)),
    ("full_sum", lambda a: jnp.sum(a.astype(jnp.float32)), (20001, 383)),
    ("full_min", lambda a: jnp.min(a), (301, 1001)),
    ("row_sum_few_rows", lambda a: jnp.sum(a, axis=1), (3, 90001)),
    ("column_mean_3d", lambda a: jnp.mean(a, axis=(0, 1)), (41, 100, 7)),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name,fn,shape", SPLITS, ids=[s[0] for s in SPLITS])
def test_split_reduction(name, fn, shape, dtype, rng):
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    # num_sms=132 makes the CPU take the GPU's split decisions.
    with pallaskit.config.override(num_sms=132):
        kernels = pallaskit.explain(fn, x).kernels
        got = pallaskit.jit(fn)(x)
    want = jax.jit(fn)(x)
    assert len(kernels) == 2, [k.name for k in kernels]
    g, r = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.dtype == want.dtype and got.shape == want.shape
    if name.split("_")[1] in ("max", "min"):
        np.testing.assert_array_equal(g, r)
    else:
        # Summation order differs: tolerance grows with sqrt(terms).
        terms = x.size // max(1, got.size)
        eps = 1e-2 if (dtype == jnp.bfloat16 and "sum" not in name) else 1e-6
        np.testing.assert_allclose(g, r, rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
                                   atol=eps * np.sqrt(terms) * 4)


def _loss_and_grad(y):
    """A loss and its gradient side by side (what jax.value_and_grad of
    mean(y**2) leaves in a training step's joint graph)."""
    yf = y.astype(jnp.float32)
    return jnp.mean(yf * yf), (yf * (2.0 / y.size)).astype(y.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("shape", [(1000, 384), (3, 1, 77, 1001)], ids=str)
def test_full_reduction_splits_at_rows_and_takes_its_pointwise_sibling(shape, dtype, rng):
    """A full reduction over rows x cols (rows <= heuristics.MAX_FINISH_ROWS)
    splits into per-row partials, so the gradient over the same domain is
    stored by the partial's kernel: 2 kernels, not 3."""
    y = jnp.asarray(rng.standard_normal(shape), dtype)
    with pallaskit.config.override(num_sms=132):
        kernels = pallaskit.explain(_loss_and_grad, y).kernels
        got = pallaskit.jit(_loss_and_grad)(y)
    assert [k.kind for k in kernels] == ["reduction", "reduction"], [str(k) for k in kernels]
    want = jax.jit(_loss_and_grad)(y)
    np.testing.assert_allclose(np.float32(got[0]), np.float32(want[0]), rtol=1e-5)
    assert got[1].dtype == want[1].dtype
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32))


def test_split_off_is_one_kernel(rng):
    x = jnp.asarray(rng.standard_normal((20001, 383)), jnp.float32)
    f = lambda a: jnp.sum(a, axis=0)  # noqa: E731
    with pallaskit.config.override(num_sms=132, split_reductions=False, mix_order_reduction=False):
        assert len(pallaskit.explain(f, x).kernels) == 1


# --------------------------------------------------------------------------- #
# Layout: the channels-last example of nvFuser's issue
# --------------------------------------------------------------------------- #
def nhwc_block(x, s, b):
    t = jnp.transpose(x, (0, 3, 1, 2)) * s + b
    return jnp.transpose(jax.nn.relu(t), (0, 2, 3, 1)), jnp.transpose(t > 0, (0, 2, 3, 1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: d.__name__)
def test_nhwc_transposes_cancel(dtype, rng):
    x = jnp.asarray(rng.standard_normal((2, 5, 3, 96)), dtype)
    s = jnp.asarray(rng.standard_normal((1, 96, 1, 1)), dtype)
    b = jnp.asarray(rng.standard_normal((1, 96, 1, 1)), dtype)
    e = pallaskit.explain(nhwc_block, x, s, b)
    assert len(e.kernels) == 1 and e.kernels[0].kind == "pointwise"
    # Rows (n, h, w) x columns (c): the per-channel s and b are (1, BLOCK_C) loads.
    assert e.kernels[0].iteration == (2 * 5 * 3, 96)
    # Both outputs are stored in x's own (NHWC) order: the load of x is at the
    # kernel's own linear position, so nothing is transposed.
    assert "arg0[i0, i1, i2, i3]" in e.ir_after
    got, want = pallaskit.jit(nhwc_block)(x, s, b), jax.jit(nhwc_block)(x, s, b)
    # t > 0 may differ only where t is within rounding of 0: the kernel keeps
    # x * s in float32 (allow_excess_precision); with it off, bit-exact.
    t = np.transpose(np.asarray(x, np.float32), (0, 3, 1, 2)) * np.asarray(s, np.float32) + np.asarray(b, np.float32)
    near_zero = np.transpose(np.abs(t) <= 2.0 ** -7 * (np.abs(t) + 4), (0, 2, 3, 1))
    differ = np.asarray(got[1]) != np.asarray(want[1])
    assert not (differ & ~near_zero).any()
    if jax.default_backend() == "cpu":  # XLA:CPU rounds x * s and + b to bf16 as written
        with pallaskit.config.override(allow_excess_precision=False):
            exact = pallaskit.jit(nhwc_block)(x, s, b)
        np.testing.assert_array_equal(np.asarray(exact[1]), np.asarray(want[1]))
    # On a GPU XLA picks its own rounding points inside the fusion (the H100 differed from
    # both the rounded-as-written and the exact sign at one element each time): only the
    # near-zero rule above holds there.
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=1e-2 if dtype == jnp.bfloat16 else 1e-6,
                               atol=2e-2 if dtype == jnp.bfloat16 else 1e-6)  # x*s + b cancels


def test_transpose_an_output_needs_is_folded_into_the_store(rng):
    x = jnp.asarray(rng.standard_normal((37, 50)), jnp.float32)
    f = lambda a: (jnp.exp(a).T, jnp.tanh(a))  # noqa: E731
    e = pallaskit.explain(f, x)
    # No transpose (copy) kernel: exp is computed straight into the transposed output.
    kernels = [m for k in e.kernels for m in (k.members or [k])]  # a combo kernel's members, each as alone
    assert sorted(k.name.split("_")[2] for k in kernels) == ["exp", "tanh"], [k.name for k in kernels]
    got, want = pallaskit.jit(f)(x), jax.jit(f)(x)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", ["pallas", "triton"])
@pytest.mark.parametrize("op", [jnp.min, jnp.max, jnp.any, jnp.all])
def test_bool_column_reductions_of_many_rows(backend, op, rng):
    """A column reduction of bools long enough to split (partials in a mix kernel):
    its accumulator carries int32 (a bool tile cannot hold min's identity; it
    crashed as lax.min(bool, int32))."""
    if backend == "triton":
        pytest.importorskip("triton")
    x = rng.random((1025, 64)) < 0.5
    x[:, 3], x[:, 5] = True, False
    fn = lambda x: op(x, axis=0)  # noqa: E731
    with pallaskit.config.override(kernel_backend=backend, num_sms=132):  # enough programs to split
        got = pallaskit.jit(fn)(x)
        assert op in (jnp.any, jnp.all) or any(k.kind == "mix" for k in pallaskit.explain(fn, x).kernels)
    want = jax.jit(fn)(x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
