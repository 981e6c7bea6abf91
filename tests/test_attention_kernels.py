"""The flash-attention kernels of lowering/codegen/attention.py, launched alone
(runtime/triton_call.py; on the CPU in Triton's interpreter, on a GPU compiled)
against the plain float32 program under jax.jit: o and lse forward, dq / dk / dv
(jax.vjp) backward, over layouts, batch ranks, ragged sizes, head dims, causal, a
broadcast mask with a row masked throughout, fills and special values."""
import dataclasses
import hashlib
import linecache

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowering.codegen import attention as fa
from pallaskit.runtime import triton_call

F32_MIN = float(np.finfo(np.float32).min)
INTERPRET = bool(triton_call.triton_module(None).knobs.runtime.interpret)  # the conftest sets it on the CPU


def _kernel_fn(kernel: fa.Kernel):
    """The rendered source as a @triton.jit function."""
    triton = triton_call.triton_module(INTERPRET)
    filename = f"<attention-{hashlib.sha256(kernel.source.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(kernel.source), None, kernel.source.splitlines(True), filename)
    ns = {"__name__": filename, "triton": triton, "tl": triton.language}
    exec(compile(kernel.source, filename, "exec"), ns)
    return ns[kernel.name]


def _launch(fn, kernel: fa.Kernel, out_shapes, *args):
    return triton_call.triton_call(fn, kernel.grid, tuple(out_shapes), *args, num_warps=kernel.num_warps,
                                   num_stages=kernel.num_stages, interpret=INTERPRET, **kernel.constexprs)


def _physical(batch, t, d, order):
    """A tensor's logical dims (*batch, t, d) in memory ``order`` (logical axes,
    outermost first): (the physical shape, the Layout, the axes to view it logically)."""
    shape = (*batch, t, d)
    phys = tuple(shape[a] for a in order)
    strides = np.cumprod((1,) + phys[::-1])[:-1][::-1]
    logical = [int(strides[order.index(a)]) for a in range(len(shape))]
    return phys, fa.Layout(tuple(logical[:-2]), logical[-2], logical[-1]), [order.index(a) for a in range(len(shape))]


ORDERS = {  # memory orders of (*batch, t, d), by batch rank
    "bhtd": lambda n: tuple(range(n + 2)),
    "bthd": lambda n: (0, 2, 1, 3) if n == 2 else tuple(range(n + 2)),  # [B, T, H, D]
    "transposed": lambda n: (n + 1, n, *range(n)),  # [D, T, *batch]
}


def _reference(q, k, v, mask, *, scale, causal, fill, dtype):
    """The plain program in float32 (logical [*batch, t, d] operands)."""
    s = jnp.einsum("...qd,...kd->...qk", q, k, precision="highest") * scale
    visible = jnp.ones(s.shape[-2:], bool)
    if causal:
        visible = jnp.tril(visible)
    if mask is not None:
        visible = visible & mask
    s = jnp.where(visible, s, fill)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("...qk,...kd->...qd", p.astype(dtype).astype(jnp.float32), v, precision="highest")
    return o, jax.nn.logsumexp(s, axis=-1)


CASES = {  # id: (batch, tq, tk, d, dv, order, causal, mask, fill, dtype)
    "bthd-causal-t13-d8": ((2, 3), 13, 13, 8, 8, "bthd", True, None, F32_MIN, "float32"),
    "bhtd-tq5-tk33-d40-dv24-bf16": ((3,), 5, 33, 40, 24, "bhtd", False, None, F32_MIN, "bfloat16"),
    "transposed-t1": ((), 1, 1, 8, 8, "transposed", True, None, F32_MIN, "float32"),
    "transposed-b3x1x2-tq1-tk20": ((3, 1, 2), 1, 20, 16, 16, "transposed", False, None, -1e9, "float32"),
    # A mask over (tq, tk) broadcast over the batch, row 3 masked throughout (uniform over all keys).
    "mask-row-masked-fmin-tq33-tk17": ((2, 2), 33, 17, 8, 8, "bthd", False, "row", F32_MIN, "float32"),
    "mask-causal-row-masked-bf16": ((2,), 17, 17, 8, 8, "bhtd", True, "row", -1e9, "bfloat16"),
    # fill -inf: a row whose first key block is all masked, later ones not; row 3 masked throughout (NaN).
    "mask-neg-inf": ((), 9, 33, 8, 8, "bhtd", False, "late", float("-inf"), "float32"),
    # NaN and +-inf in q, k and v (SPECIAL), past a broadcast mask.
    "special-values": ((2,), 9, 9, 8, 8, "bthd", True, "row", F32_MIN, "float32"),
}
SPECIAL = {"special-values"}
# The GPU's source (float32 at precision 'highest': the interpreter's only other
# changes are its 16-bit dots and TF32 rounding) over several blocks of the GPU's
# sizes: causal blocks above the diagonal skipped, loop bounds from the program id
# (which Triton's interpreter takes, with triton_launch's patch).
GPU_CASES = {
    "gpu-causal-t150": ((2,), 150, 150, 8, 8, "bthd", True, None, F32_MIN, "float32"),
    # A moderate fill: masked scores still weigh in, so no block may be skipped.
    "gpu-causal-fill-minus-2": ((), 150, 150, 8, 8, "bhtd", True, None, -2.0, "float32"),
}


def _mask(kind, tq, tk, rng):
    if kind is None:
        return None
    m = rng.random((tq, tk)) < 0.7
    if kind == "late":
        m[:, :16] = False  # first key block (16 in interpret mode) masked throughout
        m[:, 16] = True
    m[min(3, tq - 1), :] = False
    return m


@pytest.mark.parametrize("case", list(CASES) + list(GPU_CASES))
def test_flash_attention_kernels_match_jax(case):
    batch, tq, tk, d, dv, order, causal, mask_kind, fill, dtype = CASES.get(case) or GPU_CASES[case]
    gpu_source = case in GPU_CASES or not INTERPRET
    rng = np.random.default_rng(int(hashlib.sha256(case.encode()).hexdigest()[:8], 16))
    mask = _mask(mask_kind, tq, tk, rng)
    n = len(batch)
    qp, ql, qaxes = _physical(batch, tq, d, ORDERS[order](n))
    kp, kl, kaxes = _physical(batch, tk, d, ORDERS[order](n))
    vp, vl, vaxes = _physical(batch, tk, dv, ORDERS[order](n))
    op, ol, oaxes = _physical(batch, tq, dv, ORDERS[order](n))
    mask_layout = None if mask is None else fa.Layout((0,) * n, tk, 1)
    scale = d ** -0.5
    spec = fa.AttentionSpec(batch=batch, tq=tq, tk=tk, d=d, dv=dv, scale=scale, causal=causal, mask=mask_layout,
                            fill=fill, dtype=dtype, q=ql, k=kl, v=vl, o=ol, do=ol, dq=ql, dk=kl, dv_out=vl,
                            precision="highest" if gpu_source else "default")  # the reference's products
    q, k, v, do = (rng.standard_normal(s).astype(np.float32).astype(jnp.dtype(dtype)) for s in (qp, kp, vp, op))
    if case in SPECIAL:
        for x, values in ((q, [np.nan, np.inf]), (k, [-np.inf]), (v, [np.nan, -0.0])):
            x.reshape(-1)[rng.choice(x.size, len(values), replace=False)] = values
    logical = lambda x, axes: np.transpose(np.asarray(x).astype(np.float32), axes)  # noqa: E731

    def reference(q, k, v, do):
        plain = lambda q, k, v: _reference(q, k, v, mask, scale=scale, causal=causal, fill=fill, dtype=dtype)  # noqa: E731
        (o, lse), vjp = jax.vjp(plain, q, k, v)
        return (o, lse, *vjp((do, jnp.zeros_like(lse))))

    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = jax.jit(reference)(
        logical(q, qaxes), logical(k, kaxes), logical(v, vaxes), logical(do, oaxes))

    fwd = _kernel_fn(fwd_k := fa.render_forward(spec, "attn_fwd", interpret=not gpu_source))
    bwd = _kernel_fn(bwd_k := fa.render_backward(spec, "attn_bwd", interpret=not gpu_source))
    rows = int(np.prod(batch, dtype=np.int64)) * tq
    outs = [jax.ShapeDtypeStruct((q.size // d * dv,), dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)]

    def kernels(q, k, v, do, *mask):
        o, lse = _launch(fwd, fwd_k, outs, q, k, v, *mask)
        return (o, lse, *_launch(bwd, bwd_k, [jax.ShapeDtypeStruct((x.size,), dtype) for x in (q, k, v)],
                                 q, k, v, o, do, lse, *mask))

    o, lse, dq, dk, dv_ = jax.jit(kernels)(*(x.reshape(-1) for x in (q, k, v, do)),
                                           *(() if mask is None else (mask,)))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=2e-5, atol=2e-5)
    got = {"o": logical(o.reshape(op), oaxes), "dq": logical(dq.reshape(qp), qaxes),
           "dk": logical(dk.reshape(kp), kaxes), "dv": logical(dv_.reshape(vp), vaxes),
           "lse": lse.reshape(*batch, tq)}
    want = {"o": o_ref, "dq": dq_ref, "dk": dk_ref, "dv": dv_ref, "lse": lse_ref}
    # A +inf score: jax's logsumexp is +inf, the kernel's NaN (the row's o is NaN in both).
    want["lse"] = np.where(np.isposinf(want["lse"]), np.nan, want["lse"])
    for name in got:
        np.testing.assert_allclose(np.asarray(got[name]), np.asarray(want[name]), err_msg=f"{case}: {name}",
                                   **(tol if name != "lse" else dict(rtol=2e-5, atol=2e-5)), equal_nan=True)


def test_rendered_source_reads_as_its_spec():
    """The header names the spec; the GPU path skips causal blocks above the
    diagonal (loop bounds from the program id), the interpreter walks them all;
    a tensor mask or a moderate fill skips nothing."""
    lay = fa.Layout((64 * 1024, 64), 12 * 64, 1)
    spec = fa.AttentionSpec(batch=(8, 12), tq=1024, tk=1024, d=64, dv=64, scale=0.125, causal=True, mask=None,
                            fill=F32_MIN, dtype="bfloat16", q=lay, k=lay, v=lay, o=lay, do=lay, dq=lay, dk=lay,
                            dv_out=lay)
    gpu = fa.render_forward(spec, "a", interpret=False)
    assert (gpu.grid, gpu.num_warps, gpu.num_stages, gpu.constexprs) == (
        8 * 12 * (1024 // fa.FWD_BLOCK_M), fa.FWD_WARPS, fa.FWD_STAGES,
        {"BLOCK_M": fa.FWD_BLOCK_M, "BLOCK_N": fa.FWD_BLOCK_N})
    assert "batch (8, 12), tq 1024" in gpu.source and "skipped" in gpu.source and "diag" in gpu.source
    assert "diag" not in fa.render_forward(spec, "a", interpret=True).source
    back = fa.render_backward(spec, "a", interpret=False)
    assert back.grid == 8 * 12 * 8 and (back.num_warps, back.num_stages) == (fa.BWD_WARPS, fa.BWD_STAGES)
    assert "hi = " in back.source
    for other in (dataclasses.replace(spec, fill=-2.0), dataclasses.replace(spec, mask=fa.Layout((0, 0), 1024, 1))):
        assert "diag" not in fa.render_forward(other, "a", interpret=False).source
        assert "hi = " not in fa.render_backward(other, "a", interpret=False).source


_COMPILE_SCRIPT = '''
import linecache
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from lowering.codegen import attention as fa
from pallaskit.runtime import triton_compile

TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
lay = lambda t, h, d: fa.Layout((t * h * d, d), h * d, 1)  # [B, T, H, D]
specs = [  # a mask, ragged sizes, float16; the causal GPU path (blocks above the diagonal skipped), TF32 dots
    fa.AttentionSpec(batch=(2, 3), tq=77, tk=50, d=40, dv=24, scale=0.2, causal=False,
                     mask=fa.Layout((0, 50 * 77), 50, 1), fill=-1e9, dtype="float16", q=lay(77, 3, 40),
                     k=lay(50, 3, 40), v=lay(50, 3, 24), o=lay(77, 3, 24), do=lay(77, 3, 24), dq=lay(77, 3, 40),
                     dk=lay(50, 3, 40), dv_out=lay(50, 3, 24)),
    fa.AttentionSpec(batch=(3, 1), tq=64, tk=64, d=32, dv=32, scale=0.1, causal=True, mask=None, fill=-1e9,
                     dtype="float32", q=lay(64, 1, 32), k=lay(64, 1, 32), v=lay(64, 1, 32), o=lay(64, 1, 32),
                     do=lay(64, 1, 32), dq=lay(64, 1, 32), dk=lay(64, 1, 32), dv_out=lay(64, 1, 32)),
]
for spec in specs:
    t, m = TYPES[spec.dtype], ["*i1"] if spec.mask else []
    for kernel, types in ((fa.render_forward(spec, "fwd", False), [t] * 3 + m + [t, "*fp32"]),
                          (fa.render_backward(spec, "bwd", False), [t] * 5 + ["*fp32"] + m + [t] * 3)):
        name = "<" + kernel.name + spec.dtype + ">"
        linecache.cache[name] = (len(kernel.source), None, kernel.source.splitlines(True), name)
        ns = {"__name__": name, "triton": triton, "tl": tl}
        exec(compile(kernel.source, name, "exec"), ns)
        fn = ns[kernel.name]
        signature = dict(zip(fn.arg_names, types), **{c: "constexpr" for c in kernel.constexprs})
        out = triton_compile._compile_uncached(
            triton_compile.ast_source(fn, signature, kernel.constexprs), GPUTarget("cuda", 90, 32),
            {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages}, until="ptx")
        print("SHARED", out.metadata.shared)
print("COMPILED")
'''


@pytest.mark.skipif(not INTERPRET, reason="the GPU suite runs the kernels themselves")
def test_the_gpu_source_compiles():
    """Both kernels of the GPU's source through Triton's stages to PTX for sm_90
    (Triton's interpreter takes code the compiler refuses), within an H100's
    shared memory (227 KiB)."""
    from conftest import run_python_on_cpu

    proc = run_python_on_cpu(_COMPILE_SCRIPT, timeout=300)
    assert proc.returncode == 0 and "COMPILED" in proc.stdout, proc.stderr[-4000:]
    shared = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("SHARED")]
    assert len(shared) == 4 and max(shared) <= 227 * 1024, shared
