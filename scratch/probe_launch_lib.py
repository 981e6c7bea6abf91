"""GPU probe: the gelu-MLP sweep through pallaskit.runtime.triton_launch (the library
module, not the session-8 probe's own driver): per new size M, first call end to end
and steady state (median of 50 host-timed calls, result ready), against jax.jit over
the same sizes in the same process; relative error against a float32 reference.

    PYTHONPATH=. python scratch/probe_launch_lib.py
"""
import statistics
import sys
import time

sys.modules["torch"] = None  # the launch path must not need torch
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pallaskit.runtime.triton_launch import Launch, TritonKernel  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
SIZES = [int(m) for m in np.unique(np.round(np.geomspace(100, 8000, 16)))]
D_IN, D_HID = 1024, 4096
BM, BN, BK = 64, 128, 64


@triton.jit(do_not_specialize=["M"])
def linear_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr,
                  GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_n = N // BLOCK_N
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = rm[:, None] < M
    a_ptrs = a_ptr + rm[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rk[:, None] * N + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(a_ptrs, mask=row_ok, other=0.0), tl.load(w_ptrs), acc=acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * N
    acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    if GELU:
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=row_ok)


LINEAR = TritonKernel(linear_kernel, num_warps=4, num_stages=4)


def eager_mlp(x, w1, b1, w2, b2):
    m = x.shape[0]
    run = Launch(interpret=False)
    h, y = run.empty((m, D_HID), BF16), run.empty((m, D_IN), BF16)
    for a, w, b, c, n, k, gelu in ((x, w1, b1, h, D_HID, D_IN, True), (h, w2, b2, y, D_IN, D_HID, False)):
        run(LINEAR, (triton.cdiv(m, BM) * (n // BN),), a, w, b, c, m, N=n, K=k, GELU=gelu,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8)
    return run.finish(y)[0]


def xla_mlp(x, w1, b1, w2, b2, f32=False):
    dt, hp = (F32, jax.lax.Precision.HIGHEST) if f32 else (BF16, None)
    h = jnp.dot(x.astype(dt), w1.astype(dt), precision=hp, preferred_element_type=F32) + b1
    h = jax.nn.gelu(h, approximate=True).astype(dt)
    return (jnp.dot(h, w2.astype(dt), precision=hp, preferred_element_type=F32) + b2).astype(dt)


def timed(fn, *args):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = 1e3 * (time.perf_counter() - t0)
    runs = []
    for _ in range(50):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(1e3 * (time.perf_counter() - t0))
    return first, statistics.median(runs), out


def main():
    rng = np.random.default_rng(0)
    normal = lambda shape, s=1.0, dt=BF16: jnp.asarray(rng.standard_normal(shape, np.float32) * s).astype(dt)  # noqa
    params = (normal((D_IN, D_HID), D_IN ** -0.5), normal(D_HID, 0.1, F32),
              normal((D_HID, D_IN), D_HID ** -0.5), normal(D_IN, 0.1, F32))
    ref = jax.jit(lambda x, *p: xla_mlp(x, *p, f32=True))
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, triton {triton.__version__}")
    t0 = time.perf_counter()
    jax.block_until_ready(eager_mlp(normal((37, D_IN)), *params))
    print(f"one-off kernel compile + load (M=37): {1e3 * (time.perf_counter() - t0):.0f} ms")
    xla = jax.jit(xla_mlp)
    rows, tot = [], {"eager_first": 0.0, "xla_first": 0.0, "eager_steady": 0.0, "xla_steady": 0.0}
    for m in SIZES:
        x = normal((m, D_IN))
        ef, es, eo = timed(eager_mlp, x, *params)
        xf, xs, xo = timed(xla, x, *params)
        r = np.asarray(ref(x, *params), np.float32)
        err = lambda o: float(np.linalg.norm(np.asarray(o, np.float32) - r) / np.linalg.norm(r))  # noqa
        tot["eager_first"] += ef; tot["xla_first"] += xf; tot["eager_steady"] += es; tot["xla_steady"] += xs  # noqa
        floor_ms = (2 * m * (D_IN + D_HID) * 2 + 2 * D_IN * D_HID * 2) / 3.0e12 * 1e3  # bytes moved
        print(f"M={m:5d}: eager first {ef:8.2f} steady {es:6.3f} | jax.jit first {xf:8.1f} steady {xs:6.3f} "
              f"| floor {floor_ms:.3f} ms | rel err eager {err(eo):.2e} xla {err(xo):.2e}")
    print("sums (ms):", {k: round(v, 2) for k, v in tot.items()}, "compiles:", len(LINEAR._loaded))


if __name__ == "__main__":
    main()
