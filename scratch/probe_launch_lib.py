"""GPU probe: the gelu-MLP sweep through pallaskit.runtime.triton_launch (the library
module, not the session-8 probe's own driver; its kernel and jax.jit MLP are imported
from that probe): per new size M, first call end to end
and steady state (median of 50 host-timed calls, result ready), against jax.jit over
the same sizes in the same process; relative error against a float32 reference.

    PYTHONPATH=. python scratch/probe_launch_lib.py

(The RESULTS.md figures were taken at commit 21dd1ec, when this file held its own copy of
the kernel and with XLA's memory preallocation on; importing the probe turns it off.)
"""
import statistics
import sys
import time

sys.modules["torch"] = None  # the launch path must not need torch
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402

from pallaskit.runtime.triton_launch import Launch, TritonKernel  # noqa: E402
from scratch.probe_eager_launch import BF16, D_HID, D_IN, F32, SIZES, linear_kernel  # noqa: E402
from scratch.probe_eager_launch import mlp as xla_mlp  # noqa: E402

BM, BN, BK = 64, 128, 64


LINEAR = TritonKernel(linear_kernel, num_warps=4, num_stages=4)


def eager_mlp(x, w1, b1, w2, b2):
    m = x.shape[0]
    run = Launch(interpret=False)
    h, y = run.empty((m, D_HID), BF16), run.empty((m, D_IN), BF16)
    for a, w, b, c, n, k, gelu in ((x, w1, b1, h, D_HID, D_IN, True), (h, w2, b2, y, D_IN, D_HID, False)):
        run(LINEAR, (triton.cdiv(m, BM) * (n // BN),), a, w, b, c, m, N=n, K=k, GELU=gelu,
            BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8)
    return run.finish(y)[0]


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
    ref = jax.jit(lambda x, *p: xla_mlp(x, *p, f32_ref=True))
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
