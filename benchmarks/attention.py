"""What a fused attention template would gain: a hand-written flash-attention
forward in raw Triton inside the XLA program, beside plain attention.

Plain attention (einsum, scale, causal mask, softmax, einsum; ``models._causal_attention``,
what the GPT-2 block runs) writes the scores and the probabilities, [B, H, T, T],
to memory. The prototype is one kernel, the fused attention of Triton's
tutorial: a program owns BLOCK_M query rows of one head, walks the key blocks
up to the diagonal (QK^T on tensor cores, online softmax in float32 registers,
P·V accumulated), and writes O once. It reads q, k, v in the [B, T, H, D]
layout the projections produce and writes O as [B, T, H * D], so no head
transpose runs either. It runs inside the XLA program through pallaskit's
Triton call (pallaskit/runtime/triton_call.py, jaxlib's Triton custom call),
as a template chosen by pattern would.

Rows (bf16; B=8, H=12, T=1024, D=64 by default; median ms, host clock around
rounds of calls, inputs rotated out of L2; device ms of the kernels through
CUPTI where torch is present):

- plain attention under jax.jit, and under pallaskit.jit;
- the Triton prototype (each block config; the best is the one to read);
- jax.nn.dot_product_attention(implementation=None), and 'cudnn' where it runs;
- torch's scaled_dot_product_attention (is_causal=True) where torch has CUDA;
- the GPT-2 block forward (``models.gpt2_block_fwd``, 8 x 1024 x 768) under jax.jit and
  pallaskit.jit (``--no-block`` leaves it out).

Each result is checked against plain attention under jax.jit. The floor is
the larger of the causal half of the FLOPs at the matrix-unit rate and q, k, v
read plus O written at the copy bandwidth (benchmarks/hardware.py).

    python -m benchmarks.attention                 # the GPU
    python -m benchmarks.attention --smoke         # CPU: Triton's interpreter, tiny sizes, values only
"""

# No ``from __future__ import annotations``: Triton reads the kernel's ``tl.constexpr`` annotations as objects.
import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried on the GPU; the smoke run takes the first
# with 16 x 16 blocks. BLOCK_M must be a multiple of BLOCK_N (the diagonal loop's start).
CONFIGS = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4)]


@functools.lru_cache(maxsize=None)
def _flash_kernel(interpret: bool):
    """The causal flash-attention forward as a ``@triton.jit`` function (defined
    once the triton module is imported, interpreted or not)."""
    from pallaskit.runtime import triton_call

    triton = triton_call.triton_module(interpret)
    tl = triton.language

    @triton.jit
    def flash_attention_fwd(Q, K, V, O, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, QK_SCALE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_ABOVE: tl.constexpr):
        # SKIP_ABOVE: loop bounds from the program's query block, so no key block above the
        # diagonal is read (the GPU). Triton's interpreter cannot take a loop bound that
        # depends on the program id: it walks every key block, masked.
        # Program -> (batch, head, query block); the longest query blocks (most keys) first.
        pid = tl.program_id(0)
        n_m = (T + BLOCK_M - 1) // BLOCK_M
        bh = pid // n_m
        mb = n_m - 1 - pid % n_m
        b = bh // H
        h = bh % H
        stride_t = H * D  # q, k, v, O: [B, T, H, D] row-major
        base = b.to(tl.int64) * T * stride_t + h * D
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        q = tl.load(Q + base + offs_m[:, None] * stride_t + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # Below the diagonal block: every key is visible, no mask.
        if SKIP_ABOVE:
            for start in range(0, mb * BLOCK_M, BLOCK_N):
                cols = start + offs_n
                k = tl.load(K + base + cols[None, :] * stride_t + offs_d[:, None])
                s = tl.dot(q, k) * QK_SCALE  # log2 units: exp2 below
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + base + cols[:, None] * stride_t + offs_d[None, :])
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
        # The diagonal block: causal mask, and the sequence's end.
        if SKIP_ABOVE:
            for start in range(mb * BLOCK_M, tl.minimum((mb + 1) * BLOCK_M, T), BLOCK_N):
                cols = start + offs_n
                k = tl.load(K + base + cols[None, :] * stride_t + offs_d[:, None], mask=cols[None, :] < T, other=0.0)
                s = tl.dot(q, k) * QK_SCALE
                s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + base + cols[:, None] * stride_t + offs_d[None, :], mask=cols[:, None] < T, other=0.0)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
        else:  # the interpreter: every key block, masked; its 16-bit tl.dot is wrong, so float32 operands
            for start in tl.static_range(0, T, BLOCK_N):
                cols = start + offs_n
                k = tl.load(K + base + cols[None, :] * stride_t + offs_d[:, None], mask=cols[None, :] < T, other=0.0)
                s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * QK_SCALE
                s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.math.exp2(s - m_new[:, None])
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(V + base + cols[:, None] * stride_t + offs_d[None, :], mask=cols[:, None] < T, other=0.0)
                acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
                m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(O + base + offs_m[:, None] * stride_t + offs_d[None, :], acc.to(O.dtype.element_ty),
                 mask=offs_m[:, None] < T)

    return flash_attention_fwd


def flash_attention(q, k, v, *, config=CONFIGS[0], interpret: bool = False):
    """Causal attention of q, k, v [B, T, H, D] -> [B, T, H * D], one Triton kernel."""
    from pallaskit.runtime import triton_call

    b, t, h, d = q.shape
    block_m, block_n, warps, stages = config
    grid = b * h * -(-t // block_m)
    (out,) = triton_call.triton_call(
        _flash_kernel(interpret), grid, (jax.ShapeDtypeStruct((b * t * h * d,), q.dtype),),
        q.reshape(-1), k.reshape(-1), v.reshape(-1), num_warps=warps, num_stages=stages, interpret=interpret,
        T=t, H=h, D=d, QK_SCALE=float(d ** -0.5 * 1.4426950408889634), BLOCK_M=block_m, BLOCK_N=block_n,
        SKIP_ABOVE=not interpret)
    return out.reshape(b, t, h * d)


def plain_attention(q, k, v):
    from benchmarks import models

    return models._causal_attention(q, k, v)


def _dpa(implementation):
    def fn(q, k, v):
        b, t, h, d = q.shape
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation).reshape(b, t, h * d)
    return fn


def _inputs(shape, dtype, sets, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3 * sets)
    return [tuple(jax.random.normal(keys[3 * s + j], shape, jnp.float32).astype(dtype) for j in range(3))
            for s in range(sets)]


def _err(got, want) -> float:
    """Largest |got - want| / (1 + |want|): absolute near zero, relative on large values."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(g - w) / (1 + np.abs(w))))


def _torch_sdpa_ms(qkv, rounds) -> tuple[float | None, float | None]:
    """(ms, max error vs the first set's reference) of torch's SDPA, CUDA events; None without CUDA torch."""
    try:
        import torch
    except ImportError:
        return None, None
    if not torch.cuda.is_available():
        return None, None
    from benchmarks import timing

    sets = [tuple(torch.from_dlpack(x).transpose(1, 2) for x in s) for s in qkv]  # [B, H, T, D] views
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def call(i):
        q, k, v = sets[i % len(sets)]
        return sdpa(q, k, v, is_causal=True)

    out = call(0)
    torch.cuda.synchronize()
    t = timing.measure(call, timing.CudaEventClock(torch), rounds=rounds)
    b, h, tt, d = out.shape
    return t.ms, out.transpose(1, 2).reshape(b, tt, h * d).float().cpu().numpy()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--smoke", action="store_true", help="CPU: Triton's interpreter, tiny sizes, values only")
    p.add_argument("--no-block", action="store_true", help="leave the GPT-2 block forward out")
    p.add_argument("--grad", action="store_true", help="also value_and_grad over q, k, v (forward and backward)")
    p.add_argument("--json", default="", help="write the rows to this file")
    a = p.parse_args(argv)
    import pallaskit
    from benchmarks import hardware, timing

    interpret = a.smoke or jax.devices()[0].platform != "gpu"
    configs = [(16, 16, 4, 1)] if interpret else CONFIGS
    if a.smoke:
        a.batch, a.heads, a.seq, a.head_dim, a.rounds = 2, 3, 40, 16, 0
    shape = (a.batch, a.seq, a.heads, a.head_dim)
    dtype = jnp.dtype(a.dtype)
    set_bytes = 3 * int(np.prod(shape)) * dtype.itemsize
    qkv = _inputs(shape, dtype, 1 if interpret else hardware.input_sets(set_bytes))
    b, t, h, d = shape
    flops = 4 * b * h * d * t * (t + 1) / 2  # QK^T and P·V over the causal half (diagonal included)
    floor = hardware.floor_ms(4 * int(np.prod(shape)) * dtype.itemsize, flops, a.dtype)
    print(f"causal attention B={b} T={t} H={h} D={d} {a.dtype}: floor {floor:.4f} ms (causal FLOPs "
          f"{flops / 1e9:.2f} G at {hardware.MATMUL_FLOPS.get(a.dtype, 0) / 1e12:.0f} TFLOP/s, q/k/v/O at "
          f"{hardware.COPY_BANDWIDTH / 1e12:.1f} TB/s); device {jax.devices()[0].device_kind}")
    want = jax.block_until_ready(jax.jit(plain_attention)(*qkv[0]))
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
    variants = [("plain, jax.jit", jax.jit(plain_attention)), ("plain, pallaskit.jit", pallaskit.jit(plain_attention))]
    for cfg in configs:
        fn = jax.jit(functools.partial(flash_attention, config=cfg, interpret=interpret))
        variants.append((f"triton flash {cfg[0]}x{cfg[1]} w{cfg[2]} s{cfg[3]}", fn))
    if not interpret:
        variants += [("jax.nn.dot_product_attention", jax.jit(_dpa(None))),
                     ("jax.nn.dot_product_attention cudnn", jax.jit(_dpa("cudnn")))]
    rows, failed = [], []
    for name, fn in variants:
        try:
            got = jax.block_until_ready(fn(*qkv[0]))
        except Exception as e:  # noqa: BLE001  (cuDNN absent or refusing the shape: a row says so)
            print(f"{name:42s} did not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(dict(backend=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        err = _err(got, want)
        row = dict(backend=name, max_err=err, floor_ms=round(floor, 4))
        if err > tol or not np.all(np.isfinite(np.asarray(got, np.float32))):
            failed.append(name)
        if a.rounds:
            tm = timing.measure(lambda i: fn(*qkv[i % len(qkv)]), timing.HostClock(jax.block_until_ready),
                                rounds=a.rounds)
            dev = timing.kernel_ms(lambda: fn(*qkv[0]), jax.block_until_ready)
            row.update(ms=round(tm.ms, 4), device_ms=dev and round(dev, 4), of_floor=round(floor / tm.ms, 3))
        rows.append(row)
        print(f"{name:42s} max err {err:.1e}" + (f"  {row['ms']:8.4f} ms ({100 * row['of_floor']:5.1f}% of floor)"
                                                     + (f"; kernels {dev:.4f} ms on the device" if dev else "")
                                                     if a.rounds else ""))
    if not interpret:
        ms, out = _torch_sdpa_ms(qkv, a.rounds)
        if ms is not None:
            err = _err(out, want)
            rows.append(dict(backend="torch sdpa (is_causal)", max_err=err, ms=round(ms, 4),
                             of_floor=round(floor / ms, 3), floor_ms=round(floor, 4)))
            print(f"{'torch sdpa (is_causal), CUDA events':42s} max err {err:.1e}  {ms:8.4f} ms "
                  f"({100 * floor / ms:5.1f}% of floor)")
    if a.grad:
        rows += _grad_rows(qkv, a, floor, failed)
    if not a.no_block and not a.smoke:
        rows += _gpt2_block(a.rounds)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if failed:
        raise SystemExit(f"values differ from plain attention under jax.jit: {', '.join(failed)}")
    return rows


def _loss(attn):
    def loss(q, k, v, w):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * w)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _grad_rows(qkv, a, floor_fwd, failed) -> list:
    """value_and_grad over q, k, v of sum(attention * w): forward and backward.
    Floor: three times the forward's matrix FLOPs (QK^T and P·V forward; dP, dV,
    dQ, dK backward), q, k, v, O, dO read and dq, dk, dv written."""
    import pallaskit
    from benchmarks import hardware, timing

    b, t, h, d = qkv[0][0].shape
    w = jax.random.normal(jax.random.PRNGKey(1), (b, t, h * d), jnp.float32)
    flops = 3 * 4 * b * h * d * t * (t + 1) / 2
    floor = hardware.floor_ms(8 * b * t * h * d * qkv[0][0].dtype.itemsize, flops, a.dtype)
    want = jax.block_until_ready(jax.jit(_loss(plain_attention))(*qkv[0], w))
    variants = [("grad: plain, jax.jit", jax.jit(_loss(plain_attention))),
                ("grad: plain, pallaskit.jit", pallaskit.jit(_loss(plain_attention)))]
    if jax.devices()[0].platform == "gpu" and not a.smoke:
        variants.append(("grad: dot_product_attention cudnn", jax.jit(_loss(_dpa("cudnn")))))
    print(f"value_and_grad: floor {floor:.4f} ms")
    rows = []
    for name, fn in variants:
        try:
            got = jax.block_until_ready(fn(*qkv[0], w))
        except Exception as e:  # noqa: BLE001
            print(f"{name:42s} did not run: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(dict(backend=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        # each gradient's error relative to its own scale (bf16 gradients of a float32 loss)
        err = max(_err(g / (np.abs(np.asarray(x, np.float32)).max() + 1e-30),
                       x / (np.abs(np.asarray(x, np.float32)).max() + 1e-30))
                  for g, x in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])))
        row = dict(backend=name, max_err=err, floor_ms=round(floor, 4))
        if err > 5e-2:
            failed.append(name)
        if a.rounds:
            tm = timing.measure(lambda i: fn(*qkv[i % len(qkv)], w), timing.HostClock(jax.block_until_ready),
                                rounds=a.rounds)
            dev = timing.kernel_ms(lambda: fn(*qkv[0], w), jax.block_until_ready)
            row.update(ms=round(tm.ms, 4), device_ms=dev and round(dev, 4), of_floor=round(floor / tm.ms, 3))
        rows.append(row)
        print(f"{name:42s} max err {err:.1e}" + (f"  {row['ms']:8.4f} ms ({100 * row['of_floor']:5.1f}% of floor)"
                                                     + (f"; kernels {row['device_ms']} ms on the device"
                                                        if row.get("device_ms") else "") if a.rounds else ""))
    ms = _torch_sdpa_grad_ms(qkv, w, a.rounds) if not a.smoke else None
    if ms is not None:
        rows.append(dict(backend="grad: torch sdpa (is_causal)", ms=round(ms, 4), of_floor=round(floor / ms, 3),
                         floor_ms=round(floor, 4)))
        print(f"{'grad: torch sdpa (is_causal), CUDA events':42s} {ms:8.4f} ms ({100 * floor / ms:5.1f}% of floor)")
    return rows


def _torch_sdpa_grad_ms(qkv, w, rounds) -> float | None:
    """ms of torch's SDPA forward and backward (CUDA events); None without CUDA torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not rounds:
        return None
    from benchmarks import timing

    sets = [tuple(torch.from_dlpack(x).transpose(1, 2).detach().clone().requires_grad_() for x in s) for s in qkv]
    b, t, h, d = qkv[0][0].shape
    tw = torch.from_dlpack(w).reshape(b, t, h, d).transpose(1, 2).to(sets[0][0].dtype)

    def call(i):
        q, k, v = sets[i % len(sets)]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(tw)
        return q.grad

    call(0)
    torch.cuda.synchronize()
    return timing.measure(call, timing.CudaEventClock(torch), rounds=rounds).ms


def _gpt2_block(rounds) -> list:
    """GPT-2 block forward (8 x 1024 x 768, bf16) under jax.jit and pallaskit.jit: kernels and ms."""
    import pallaskit
    from benchmarks import timing
    from benchmarks.workloads import WORKLOADS

    w = WORKLOADS["gpt2_block_fwd"]
    args = w.make_inputs((8, 1024, 768), "bfloat16", jax.random.PRNGKey(0))
    want = jax.block_until_ready(jax.jit(w.jax_fn)(*args))
    rows = []
    for name, fn in (("gpt2_block_fwd jax.jit", jax.jit(w.jax_fn)), ("gpt2_block_fwd pallaskit.jit", pallaskit.jit(w.jax_fn))):
        err = _err(jax.block_until_ready(fn(*args)), want)
        tm = timing.measure(lambda i: fn(*args), timing.HostClock(jax.block_until_ready), rounds=rounds)
        dev = timing.kernel_ms(lambda: fn(*args), jax.block_until_ready)
        kernels = len(pallaskit.explain(w.jax_fn, *args).kernels) if "pallaskit" in name else ""
        rows.append(dict(backend=name, max_err=err, ms=round(tm.ms, 4), device_ms=dev and round(dev, 4),
                         kernels=kernels))
        print(f"{name:42s} max err {err:.1e}  {tm.ms:8.4f} ms" + (f"; kernels {dev:.4f} ms on the device" if dev else "")
              + (f"; {kernels} pallaskit kernels" if kernels != "" else ""))
    return rows


if __name__ == "__main__":
    main()
