"""Kernel backends as named executors (lowering/executors.py): the one choice,
what explain says, and a slice of the kernel tests run with
kernel_backend='triton' (raw Triton inside the XLA program; on the CPU in
Triton's interpreter through a host callback) against jax.jit."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from lowering import executors
from lowering.options import CompileOptions

from conftest import DISABLE_PALLAS_TRITON, assert_close, special_values

triton = pytest.importorskip("triton")

GPU = CompileOptions(interpret=False, triton_available=True)
CPU = CompileOptions(interpret=True, triton_available=True)


# --------------------------------------------------------------------------- #
# The choice
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("kind", ["pointwise", "reduction", "column", "mix", "combo"])
def test_auto_is_raw_triton_inside_xla_on_a_gpu_and_pallas_in_interpret_mode(kind):
    choice = executors.choose(kind, GPU)
    assert choice.executor == executors.TRITON_XLA and "deprecated" in choice.reason
    choice = executors.choose(kind, CPU)
    assert choice.executor == executors.PALLAS and "interpret mode" in choice.reason


def test_the_options_and_platform_facts_decide():
    for opts in (GPU, CPU):
        pallas = executors.choose("pointwise", dataclasses.replace(opts, kernel_backend="pallas"))
        assert pallas == executors.Choice(executors.PALLAS, "kernel_backend='pallas'")
        forced = executors.choose("pointwise", dataclasses.replace(opts, kernel_backend="triton"))
        assert forced.executor == executors.TRITON_XLA
        assert ("interpreter" in forced.reason) == opts.interpret
        missing = executors.choose("pointwise", dataclasses.replace(opts, kernel_backend="triton",
                                                                    triton_available=False))
        assert missing.executor == executors.PALLAS and "not installed" in missing.reason
    # Every kind runs raw Triton on a GPU: the matmul template and mix kernels over rows too
    # long for a two-row raw-Triton tile too (nothing depends on Pallas's Triton backend)
    assert {executors.choose(kind, GPU).executor for kind in executors.GPU_AUTO} == {executors.TRITON_XLA}
    assert executors.kernel_kind("mix", True, 2) == "mix_columns"
    assert executors.choose("mix_columns", GPU).executor == executors.TRITON_XLA
    assert executors.choose("mix_columns", dataclasses.replace(GPU, kernel_backend="pallas")).executor == executors.PALLAS
    assert executors.kernel_kind("mix", False, 2) == "column"
    with pytest.raises(ValueError, match="kernel kind"):
        executors.choose("gather", GPU)


def test_eager_launches_of_new_sizes():
    assert executors.eager("auto", GPU).executor == executors.TRITON_EAGER
    assert executors.eager("on", CPU).executor == executors.TRITON_EAGER
    assert executors.eager("auto", CPU).executor == executors.XLA
    assert executors.eager("off", GPU).executor == executors.XLA


# --------------------------------------------------------------------------- #
# explain
# --------------------------------------------------------------------------- #
def _softmax(x):
    return jax.nn.softmax(x, axis=-1)


def test_explain_names_each_kernels_executor_and_why():
    x = jnp.zeros((37, 129), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        ex = pallaskit.explain(_softmax, x)
    (k,) = ex.kernels
    assert k.executor == "triton_xla" and "kernel_backend='triton'" in k.reason
    assert "executor triton_xla: kernel_backend='triton'" in str(ex)
    assert "TRITON_CALL(" in k.source and "pl.pallas_call" not in k.source
    with pallaskit.config.override(kernel_backend="auto", interpret=True, cache=False):
        ex = pallaskit.explain(_softmax, x)
    assert ex.kernels[0].executor == "pallas" and "interpret mode" in ex.kernels[0].reason
    assert "pl.pallas_call" in ex.kernels[0].source and ex.new_sizes == ""


def test_explain_says_how_new_sizes_run():
    x = jnp.zeros((37, 129), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", dynamic_launch="off", cache=False):
        ex = pallaskit.explain(pallaskit.jit(_softmax, dynamic={0: {0: "n"}}), x)
    assert ex.new_sizes.startswith("xla: dynamic_launch='off'") and "new sizes: xla" in str(ex)


def _log1p_then_sum(x):
    return jnp.log1p(jnp.abs(x)) * 2, jnp.sum(x * x, axis=-1)


# They check the fallback to Pallas, which TEST_DISABLE_PALLAS_TRITON=1 forbids.
needs_fallback = pytest.mark.skipif(DISABLE_PALLAS_TRITON, reason="TEST_DISABLE_PALLAS_TRITON=1 allows no fallback")


@pytest.fixture
def triton_refuses_log1p(monkeypatch):
    """The Triton renderer made to refuse log1p, as it refuses what it does not
    write (it writes every op of the table: tests/test_triton_ops.py)."""
    from lowering.codegen import triton as triton_codegen

    original = triton_codegen.TritonEmitter.op_template

    def op_template(self, e, names):
        if e.op == "log1p":
            raise triton_codegen.TritonUnsupported("op log1p")
        return original(self, e, names)

    monkeypatch.setattr(triton_codegen.TritonEmitter, "op_template", op_template)


@needs_fallback
def test_a_kernel_the_triton_renderer_refuses_falls_back_to_pallas(rng, triton_refuses_log1p):
    """A kernel the Triton renderer refuses (TritonUnsupported) runs in Pallas,
    explain says why; the other kernel stays raw Triton."""
    x = jnp.asarray(rng.standard_normal((33, 65)), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", fusion=False, combo_kernels=False, cache=False):
        ex = pallaskit.explain(_log1p_then_sum, x)
        got = pallaskit.jit(_log1p_then_sum)(x)
    by_executor = {}
    for k in ex.kernels:
        by_executor.setdefault(k.executor, []).append(k)
    assert set(by_executor) == {"pallas", "triton_xla"}, [(k.name, k.executor) for k in ex.kernels]
    assert all("the Triton renderer does not write it (op log1p)" in k.reason for k in by_executor["pallas"])
    for a, e in zip(got, jax.jit(_log1p_then_sum)(x)):
        assert_close(a, e)


@needs_fallback
def test_triton_and_pallas_helpers_of_one_name_share_a_program(rng, triton_refuses_log1p):
    """erf in a Pallas kernel (beside log1p, which Triton is made to refuse) and in a raw
    Triton kernel: both renderers have an ``_erf`` helper; the Triton one is
    written as ``_tl_erf``."""
    def f(x):
        return jax.scipy.special.erf(jnp.log1p(jnp.abs(x))), jnp.sum(jax.scipy.special.erf(x), axis=-1)

    x = jnp.asarray(rng.standard_normal((17, 40)), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", fusion=False, combo_kernels=False, cache=False):
        ex = pallaskit.explain(f, x)
        got = pallaskit.jit(f)(x)
    assert {k.executor for k in ex.kernels} == {"pallas", "triton_xla"}
    assert "def _tl_erf(" in ex.source and "def _erf(" in ex.source
    for a, e in zip(got, jax.jit(f)(x)):
        assert_close(a, e)


# --------------------------------------------------------------------------- #
# A slice of the kernel tests with kernel_backend='triton'
# --------------------------------------------------------------------------- #
def _rmsnorm_bwd(x, w, dy):
    def rms(x, w):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)

    return jax.vjp(rms, x, w)[1](dy)


def _layernorm_bwd(x, w, dy):
    def ln(x, w):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) * jax.lax.rsqrt(v + 1e-5) * w

    return jax.vjp(ln, x, w)[1](dy)


CASES = {
    # name: (fn, args(rng), options, kernel kinds)
    "pointwise_chain": (lambda x, y: (jnp.tanh(x) * y + jnp.exp(-x * x)).astype(x.dtype),
                        lambda r: (special_values(r, (37, 129), jnp.bfloat16),
                                   special_values(r, (37, 129), jnp.bfloat16)),
                        {}, ["pointwise"]),
    "pointwise_broadcast_rows": (lambda x, s: x * s[None, :] + 1,
                                 lambda r: (special_values(r, (9, 7, 33), jnp.float32),
                                            jnp.asarray(r.standard_normal((7, 33)), jnp.float32)),
                                 {}, ["pointwise"]),
    "pointwise_transposed": (lambda x: x.T * 2 + 1, lambda r: (special_values(r, (65, 130), jnp.float32),), {},
                             ["pointwise"]),
    "pointwise_ints_bools": (lambda a, b: ((a * 3 - b) // 2, (a > b) & (a != 0)),
                             lambda r: (jnp.asarray(r.integers(-50, 50, (31, 17)), jnp.int32),
                                        jnp.asarray(r.integers(-50, 50, (31, 17)), jnp.int32)), {}, ["pointwise"]),
    "pointwise_predicates": (lambda x: (jnp.where(jnp.isfinite(x), x, 0.0), jnp.sign(x), jnp.isfinite(x)),
                             lambda r: (special_values(r, (5, 33), jnp.float32),), {}, ["pointwise"]),
    "row_softmax": (_softmax, lambda r: (special_values(r, (37, 129), jnp.float32),), {}, ["reduction"]),
    # No NaN here: jax.jit's max over long rows on the CPU drops it.
    "row_looped": (lambda x: (jnp.max(x, -1), jnp.sum(x, -1)),
                   lambda r: (jnp.asarray(r.standard_normal((7, 700)), jnp.float32).at[0, 3].set(-jnp.inf),),
                   {"max_persistent_cols": 128}, ["reduction"]),
    "row_size1": (lambda x: jnp.sum(x, -1, keepdims=True) * x, lambda r: (special_values(r, (1, 37), jnp.float32),), {},
                  ["reduction"]),
    "column_split": (lambda x: (jnp.sum(x, 0), jnp.max(x, 0)),
                     lambda r: (jnp.asarray(r.standard_normal((3001, 9)), jnp.float32),), {"num_sms": 132},
                     ["mix", "reduction"]),
    "row_split": (lambda x: jnp.sum(x, -1), lambda r: (jnp.asarray(r.standard_normal((2, 70001)), jnp.float32),),
                  {"num_sms": 132}, ["reduction", "reduction"]),
    "rmsnorm_bwd_mix": (_rmsnorm_bwd, lambda r: (jnp.asarray(r.standard_normal((1100, 96)), jnp.bfloat16),
                                                 jnp.asarray(r.standard_normal(96), jnp.bfloat16),
                                                 jnp.asarray(r.standard_normal((1100, 96)), jnp.bfloat16)),
                        {"num_sms": 1}, ["mix", "reduction"]),
    "layernorm_bwd_mix_two_sums": (_layernorm_bwd, lambda r: (jnp.asarray(r.standard_normal((1100, 80)), jnp.float32),
                                                               jnp.asarray(r.standard_normal(80), jnp.float32),
                                                               jnp.asarray(r.standard_normal((1100, 80)), jnp.float32)),
                                   {"num_sms": 1}, None),
    "matmul_epilogue": (lambda a, b, c: jax.nn.gelu(a @ b) + c,
                        lambda r: (jnp.asarray(r.standard_normal((70, 48)), jnp.bfloat16),
                                   jnp.asarray(r.standard_normal((48, 40)), jnp.bfloat16),
                                   jnp.asarray(r.standard_normal((40,)), jnp.bfloat16)),
                        {"matmul_template": "fused"}, ["matmul"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_as_raw_triton_inside_xla_match_jax_jit(name, rng):
    fn, make, opts, kinds = CASES[name]
    args = make(rng)
    with pallaskit.config.override(kernel_backend="triton", cache=False, **opts):
        ex = pallaskit.explain(fn, *args)
        got = pallaskit.jit(fn)(*args)
    if kinds is not None:
        assert sorted(k.kind for k in ex.kernels) == sorted(kinds), [k.name for k in ex.kernels]
    assert ex.kernels and all(k.executor == "triton_xla" for k in ex.kernels), [(k.name, k.reason) for k in ex.kernels]
    assert "pl.pallas_call" not in ex.source
    want = jax.jit(fn)(*args)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, e, e.dtype)


def test_dynamic_sizes_inside_xla_take_the_sizes_as_kernel_arguments(rng):
    """A symbolic program through XLA (eager launches off): one raw Triton
    kernel source serves every size; the sizes are scalar kernel arguments."""
    f = pallaskit.jit(_softmax, dynamic={0: {0: "n"}})
    with pallaskit.config.override(kernel_backend="triton", dynamic_launch="off", automatic_dynamic=False,
                                   cache=False):
        for n in (37, 5, 1):
            x = special_values(rng, (n, 129), jnp.float32)
            assert_close(f(x), jax.jit(_softmax)(x))
        ex = pallaskit.explain(f, x)
    assert pallaskit.metrics.counters["graphs_compiled"] == 1
    (k,) = ex.kernels
    assert k.executor == "triton_xla" and "scalars=(n,)" in k.source


@pytest.mark.parametrize("num_sms,cols", [(4, 96), (132, 96), (4, 2100)], ids=["mix", "column_tiles", "long_rows"])
def test_dynamic_rows_and_axes_inside_xla_loop_runtime_counts(num_sms, cols, rng):
    """Symbolic programs as raw Triton: the norm backward's mix kernel (num_sms=4:
    one pass; rows of 2100 take one row a step), or its column-tile kernel (132:
    dw split apart), with programs sized at the hint (4096 rows) and each walking
    a runtime count of row blocks; and row reductions over a dynamic axis,
    looping a runtime count of column chunks."""
    def fn(x, w, dy, z):
        return (*_rmsnorm_bwd(x, w, dy), z.sum(-1), z.max(-1))

    f = pallaskit.jit(fn, dynamic={"x": {0: "n"}, "dy": {0: "n"}, "z": {1: "n"}})
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(cols), jnp.float32)
    with pallaskit.config.override(kernel_backend="triton", num_sms=num_sms, multi_kernel_hints="4096",
                                   dynamic_launch="off", automatic_dynamic=False, cache=False):
        for n in (70, 7, 1):  # 70: row blocks every program has in full, then a masked one
            x = special_values(rng, (n, cols), jnp.float32)
            dy = jnp.asarray(rng.standard_normal((n, cols)), jnp.float32)
            z = special_values(rng, (3, n), jnp.float32).at[0, 0].set(1.0)  # no NaN: XLA:CPU's max drops it
            got, want = f(x, w, dy, z), jax.jit(fn)(x, w, dy, z)
            assert_close(got[0], want[0])
            for a, e in zip(got[1:], want[1:]):  # sums of n rows in another order
                np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=0, atol=2e-6 * max(
                    1.0, float(np.nanmax(np.abs(np.where(np.isfinite(e), e, 0))))))
        ex = pallaskit.explain(f, x, w, dy, z)
    assert pallaskit.metrics.counters["graphs_compiled"] == 1
    assert all(k.executor == "triton_xla" for k in ex.kernels), [(k.name, k.reason) for k in ex.kernels]
    mix = [k for k in ex.kernels if k.kind == "mix"]
    assert len(mix) == 1 and "scalars=(n,)" in mix[0].source
    assert "steps = ((ROWS + BLOCK_R - 1) // BLOCK_R + PROGRAMS - 1) // PROGRAMS" in mix[0].source
    assert ("BLOCK_R=1," in mix[0].source) == (cols > 2048)
    assert any("for chunk in range(0, (COLS + BLOCK_C - 1) // BLOCK_C)" in k.source for k in ex.kernels)


def test_pallas_triton_lowering_can_be_disabled(monkeypatch):
    """What TEST_DISABLE_PALLAS_TRITON=1 does to a GPU run (tests/conftest.py),
    checked by exporting for CUDA on the CPU: a Pallas kernel's lowering raises,
    a raw Triton kernel's never reaches it."""
    from jax import export

    from conftest import PallasTritonDisabled, pallas_triton_lowering_slots, refuse_pallas_triton_lowering
    from pallaskit.runtime import loader

    for where, key in pallas_triton_lowering_slots():
        if isinstance(where, dict):
            monkeypatch.setitem(where, key, (refuse_pallas_triton_lowering, where[key][1]))
        else:
            monkeypatch.setattr(where, key, refuse_pallas_triton_lowering)
    x = jnp.zeros((37, 129), jnp.float32)
    with pallaskit.config.override(interpret=False, kernel_backend="pallas", cache=False):
        res = pallaskit.jit(_softmax).lower_to_result(x).result
    assert res.program.kernels[0].executor == "pallas"
    with pytest.raises(PallasTritonDisabled, match="fell back to Pallas"):
        export.export(jax.jit(loader.load(res.program)), platforms=["cuda"])(x)
    with pallaskit.config.override(interpret=False, kernel_backend="triton", cache=False):
        res = pallaskit.jit(_softmax).lower_to_result(x).result
    if res.program.kernels[0].executor == "triton_xla":  # a CUDA GPU with triton: compiles for it
        from pallaskit.runtime import ffi_targets

        targets = (ffi_targets.JAXLIB_TARGET, ffi_targets.COMMAND_BUFFER_TARGET)  # whichever is registered
        export.export(jax.jit(loader.load(res.program)), platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(t) for t in targets])(x)
    else:  # the CPU: raw Triton needs a CUDA GPU (or interpret mode)
        assert "not a CUDA GPU" in res.program.kernels[0].reason


def test_dynamic_rows_of_the_matmul_template_inside_xla(rng):
    """The template over a dynamic M (its row-block count from the size argument)."""
    def f(x, w, b):
        return jax.nn.gelu(x @ w + b)

    jf = pallaskit.jit(f, dynamic={"x": {0: "n"}})
    w = jnp.asarray(rng.standard_normal((40, 72)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((72,)), jnp.bfloat16)
    with pallaskit.config.override(kernel_backend="triton", matmul_template="fused", dynamic_launch="off",
                                   automatic_dynamic=False, multi_kernel_hints="", cache=False):
        for n in (19, 70):
            x = jnp.asarray(rng.standard_normal((n, 40)), jnp.bfloat16)
            assert_close(jf(x, w, b), jax.jit(f)(x, w, b), jnp.bfloat16)
        ex = pallaskit.explain(jf, x, w, b)
    assert [(k.kind, k.executor) for k in ex.kernels] == [("matmul", "triton_xla")]
    assert "scalars=(n,)" in ex.kernels[0].source


def test_bfloat16_casts_round_to_nearest_even(rng):
    """float32 -> bfloat16 in a raw Triton kernel rounds to nearest even, as
    jax.jit and the GPU do (Triton 3.6's interpreter truncates: patched in
    pallaskit/runtime/triton_launch.py): ties both ways, values that round up
    to the next binade or to inf, inf and NaN, bit for bit (NaN: any NaN).
    No subnormals: the interpreter's host callback runs on an XLA:CPU thread,
    which flushes them before any cast."""
    ties = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 1 + 2.0 ** -8 + 2.0 ** -20,
                     2 - 2.0 ** -9, 3.3895e38, -3.3895e38, np.inf, -np.inf, np.nan, 0.0, -0.0], np.float32)
    x = np.concatenate([ties, rng.standard_normal(1000 - ties.size).astype(np.float32)]).reshape(8, 125)
    f = lambda x: ((x * 1.0).astype(jnp.bfloat16), jnp.sum(x, -1).astype(jnp.bfloat16))  # noqa: E731
    with pallaskit.config.override(kernel_backend="triton", cache=False):
        ex = pallaskit.explain(f, jnp.asarray(x))
        got = pallaskit.jit(f)(jnp.asarray(x))
    assert all(k.executor == "triton_xla" for k in ex.kernels)
    for a, e in zip(got, jax.jit(f)(jnp.asarray(x))):
        a, e = np.asarray(a), np.asarray(e)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
        np.testing.assert_array_equal(a.view(np.uint16)[~np.isnan(e)], e.view(np.uint16)[~np.isnan(e)])


def test_triton_target_falls_back_to_jaxlibs_where_it_cannot_register():
    """Raw Triton kernels lower to pallaskit's command-buffer-compatible target
    where jaxlib's CUDA Triton handler can be registered again, else to
    jaxlib's own ([Note: Triton kernels in command buffers])."""
    from pallaskit.runtime import ffi_targets

    target = ffi_targets.triton_target()
    assert target in (ffi_targets.COMMAND_BUFFER_TARGET, ffi_targets.JAXLIB_TARGET)
    has_cuda_triton = getattr(getattr(jax._src.lib, "gpu_triton", None), "_cuda_triton", None) is not None
    assert (target == ffi_targets.COMMAND_BUFFER_TARGET) == has_cuda_triton


def _layernorm(x, w, b):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean((xf - mean) ** 2, axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + 1e-5) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def test_raw_triton_row_tiles_of_512_columns_take_two_warps(rng):
    """Persistent row tiles of 8 rows x 512 columns (rows of 257-512) run in 2
    warps in raw Triton (heuristics.TRITON_ROWS_512_WARPS) and keep Pallas's 8;
    values as jax.jit's, NaN and inf rows included."""
    pytest.importorskip("triton")
    x = rng.standard_normal((37, 384)).astype(np.float32)
    x[3, 5], x[7, 0] = np.nan, np.inf
    w, b = rng.standard_normal(384).astype(np.float32), rng.standard_normal(384).astype(np.float32)
    args = [jnp.asarray(a, jnp.bfloat16) for a in (x, w, b)]
    want = jax.jit(_layernorm)(*args)
    warps = {}
    for backend in ("pallas", "triton"):
        with pallaskit.config.override(kernel_backend=backend, cache=False):
            (kernel,) = pallaskit.explain(_layernorm, *args).kernels
            got = pallaskit.jit(_layernorm)(*args)
        assert_close(got, want, jnp.bfloat16)
        warps[backend] = re.findall(r"num_warps=(\d+)", kernel.source)
        assert "BLOCK_R = 8" in kernel.source or "BLOCK_R=8" in kernel.source or "BLOCK_R, BLOCK_C = 8," in kernel.source
    assert warps == {"pallas": ["8"], "triton": ["2"]}
