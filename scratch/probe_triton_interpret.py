"""CPU probe: raw Triton kernels run by Triton's interpreter on numpy buffers, no torch.

Triton's interpreter (TRITON_INTERPRET=1, read when triton is imported) runs a
kernel on host memory: it takes each pointer argument's ``data_ptr()`` and only
touches torch through ``untyped_storage()`` / ``new_empty`` / ``set_`` to copy
device tensors to the host and back. ``HostTensor`` answers those calls for a
numpy array that already lives on the host, so a future raw-Triton renderer can
be checked against jax.jit in CI (CPU only, no torch) the way the Pallas
renderer is in interpret mode. Checks an elementwise kernel and a masked
matmul with a fused bias + gelu epilogue (the template's shape), float32 and
bfloat16, odd sizes (2026-11-24, triton 3.6.0, numpy 2.4, jax 0.10.2: both pass,
rel. err 1.6e-7 / 4e-3).

Two interpreter limits found (a renderer must work around them in interpret mode):
- ``tl.dot`` of bfloat16 operands is wrong (rel. err 1e11: it multiplies the raw
  16-bit patterns); widening the operands to float32 first is right.
- A runtime int cannot bound a ``range`` loop under numpy >= 2 (the interpreter
  calls ``int()`` on a 1-element array); constexpr bounds work.

    pip install triton==3.6.0 && PYTHONPATH=. python scratch/probe_triton_interpret.py
"""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


from pallaskit.runtime.triton_launch import _HostTensor as HostTensor  # noqa: E402  (the shim, kept there)


@triton.jit
def silu_mul_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.sigmoid(y)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def linear_gelu_kernel(a_ptr, w_ptr, b_ptr, c_ptr, M, N, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    """c = gelu_tanh(a @ w + b) for row-major a (M, K), w (K, N); every edge masked. K is a
    constexpr: the interpreter cannot take a runtime int as a ``range`` bound under numpy >= 2
    (it calls ``int()`` on a 1-element array), so loops must have compile-time trip counts there."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc=acc)  # see the module docstring
    acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def main():
    rng = np.random.default_rng(0)
    for dt, tol in ((np.float32, 1e-5), (ml_dtypes.bfloat16, 1e-2)):
        n = 1001
        x, y = (rng.standard_normal(n).astype(dt) for _ in range(2))
        out = np.full(n, np.nan, dt)
        silu_mul_kernel[(triton.cdiv(n, 128),)](HostTensor(x), HostTensor(y), HostTensor(out), n, BLOCK=128)
        ref = jax.jit(lambda a, b: (a.astype(jnp.float32) * jax.nn.sigmoid(b.astype(jnp.float32))).astype(a.dtype))(x, y)
        e1 = rel_err(out, ref)

        m, k, nn = 37, 100, 72
        a, w = rng.standard_normal((m, k)).astype(dt), (rng.standard_normal((k, nn)) / 10).astype(dt)
        b = rng.standard_normal(nn).astype(np.float32)
        c = np.full((m, nn), np.nan, dt)
        linear_gelu_kernel[(triton.cdiv(m, 16), triton.cdiv(nn, 32))](
            HostTensor(a), HostTensor(w), HostTensor(b), HostTensor(c), m, nn, k, BM=16, BN=32, BK=32)
        ref = jax.jit(lambda a, w, b: jax.nn.gelu(jnp.dot(a, w, preferred_element_type=jnp.float32) + b,
                                                  approximate=True).astype(a.dtype))(a, w, b)
        e2 = rel_err(c, ref)
        ok = e1 < tol and e2 < tol and not np.isnan(out).any() and not np.isnan(c).any()
        print(f"{np.dtype(dt).name:8s} elementwise rel err {e1:.2e}, linear+gelu rel err {e2:.2e}: "
              f"{'ok' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
