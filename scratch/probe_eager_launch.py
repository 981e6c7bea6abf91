"""GPU probe: shape-generic Triton kernels launched outside XLA, on JAX arrays' buffers.

Kernels: a gelu MLP y = gelu_tanh(x @ w1 + b1) @ w2 + b2 (x (M,1024) bf16, 1024->4096->1024;
two launches of one matmul kernel with a fused epilogue) and an RMSNorm over (M, 384) bf16,
M a runtime argument in both. After one warm-up compile (M=37), per new size M: first call
end to end, steady state (median of 50 host-timed calls; CUDA-event device time), relative
error against a float32 jax.jit reference (also on a NaN-poisoned output), Triton and XLA
compile counts. Subprocesses: jax.jit over the same sizes; Triton's stock driver's stream.
Torch is made unimportable in the eager process: the launch path must not need it.

    set -o pipefail; PYTHONUNBUFFERED=1 python scratch/probe_eager_launch.py --out $OUT \
        2>&1 | tee $OUT/eager_launch.log
"""
import argparse, ctypes, json, os, statistics, subprocess, sys, time

MODE = os.environ.get("PROBE_MODE", "eager")  # eager | xla | stream (the last two: subprocesses)
if MODE == "eager":
    sys.modules["torch"] = None  # any `import torch` now raises ImportError
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax, jax.numpy as jnp, numpy as np  # noqa: E402
import triton, triton.language as tl  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
SIZES = [int(m) for m in np.unique(np.round(np.geomspace(100, 8000, 16)))]
NORM_SIZES = SIZES + [576_000]
D_IN, D_HID, D_NORM, EPS = 1024, 4096, 384, 1e-6
WARMUP_M, CALLS = 37, 50
MM = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
NORM = dict(ROWS=8, BLOCK_D=512, num_warps=4)


@triton.jit(do_not_specialize=["M"])
def linear_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr,
                  GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c[:M] = act(a[:M] @ w + bias), row-major, fp32 accumulation, rows >= M masked."""
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
    if GELU:  # 0.5 x (1 + tanh(u)) == x * sigmoid(2u)
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["M"])
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, M, eps, D: tl.constexpr, ROWS: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    offs = rows[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, (x * inv[:, None] * w[None, :]).to(y_ptr.dtype.element_ty), mask=mask)


def mlp(x, w1, b1, w2, b2, f32_ref=False):
    """bf16 MLP with f32 accumulation; f32_ref: the same math all in float32 (the reference)."""
    dt, hp = (F32, jax.lax.Precision.HIGHEST) if f32_ref else (BF16, None)
    h = jnp.dot(x.astype(dt), w1.astype(dt), precision=hp, preferred_element_type=F32) + b1
    h = jax.nn.gelu(h, approximate=True).astype(dt)
    return (jnp.dot(h, w2.astype(dt), precision=hp, preferred_element_type=F32) + b2).astype(dt)


def rmsnorm(x, w, f32_ref=False):
    x32 = x.astype(F32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + EPS) * w.astype(F32)
    return y if f32_ref else y.astype(BF16)


def host_inputs(rng):
    """Fresh random inputs on the host: x maker, MLP params, RMSNorm weight."""
    def normal(shape, scale=1.0, dtype=BF16):
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)
    params = (normal((D_IN, D_HID), D_IN ** -0.5), normal(D_HID, 0.1, np.float32),
              normal((D_HID, D_IN), D_HID ** -0.5), normal(D_IN, 0.1, np.float32))
    return normal, params, (1 + normal(D_NORM, 0.1, np.float32)).astype(BF16)


def median_ms(fn, n=CALLS):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def first_ms(fn):
    t0 = time.perf_counter()
    out = fn()
    return 1e3 * (time.perf_counter() - t0), out


class Cuda:
    """Driver API via ctypes: JAX's primary context, one non-blocking stream, two events."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check("cuInit", 0)
        self.check("cuDeviceGet", ctypes.byref(dev), 0)
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)  # the context XLA uses
        self.check("cuCtxSetCurrent", ctx)
        self.stream = ctypes.c_void_p()
        self.check("cuStreamCreate", ctypes.byref(self.stream), 1)  # CU_STREAM_NON_BLOCKING
        self.events = [ctypes.c_void_p(), ctypes.c_void_p()]
        for ev in self.events:
            self.check("cuEventCreate", ctypes.byref(ev), 0)

    def check(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def record(self, i):
        self.check("cuEventRecord", self.events[i], self.stream)

    def sync(self):
        self.check("cuStreamSynchronize", self.stream)

    def elapsed_ms(self):
        ms = ctypes.c_float()
        self.check("cuEventElapsedTime", ctypes.byref(ms), *self.events)
        return ms.value


def use_jax_driver(cuda):
    """Make Triton's active driver torch-free: fixed device 0, our stream, JAX's capability."""
    from triton.backends.nvidia.driver import CudaDriver, CudaLauncher, CudaUtils

    major, minor = map(int, jax.devices()[0].compute_capability.split("."))

    class JaxCudaDriver(CudaDriver):
        def __init__(self):  # GPUDriver.__init__ would import torch
            self.utils, self.launcher_cls = CudaUtils(), CudaLauncher
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=None: cuda.stream.value
            self.get_device_capability = lambda device=None: (major, minor)

    triton.runtime.driver.set_active(JaxCudaDriver())


class Buf:
    """What Triton's launcher takes as a pointer: data_ptr() and a dtype it can canonicalize."""
    __slots__ = ("array", "dtype")

    def __init__(self, array):
        self.array, self.dtype = array, array.dtype  # str(np.dtype) 'bfloat16' -> 'bf16'

    def data_ptr(self):
        return self.array.unsafe_buffer_pointer()


class Eager:
    """Outputs via device_put of a pre-touched host staging view (no XLA compile), launch, sync."""

    def __init__(self, cuda):
        self.cuda, self.staging, self.hidden = cuda, np.empty(0, np.uint8), None

    def alloc(self, shape, dtype=BF16, fill=None):
        if fill is not None:
            return jax.device_put(np.full(shape, fill, dtype)).block_until_ready()
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.staging.size < n:
            self.staging = np.ones(n, np.uint8)  # touch the pages once
        return jax.device_put(self.staging[:n].view(dtype).reshape(shape)).block_until_ready()

    def run(self, launches, out):
        self.cuda.record(0)
        for launch in launches:
            launch()
        self.cuda.record(1)
        self.cuda.sync()  # results ready before they go back to JAX
        return out

    def mlp(self, x, w1, b1, w2, b2, out=None):
        m = jax.block_until_ready(x).shape[0]
        if self.hidden is None or self.hidden.shape[0] < m:  # grow-only scratch
            self.hidden = self.alloc((m, D_HID))
        out = self.alloc((m, D_IN)) if out is None else out
        def linear(a, w, b, c, gelu):
            n = w.shape[1]
            grid = (triton.cdiv(m, MM["BLOCK_M"]) * (n // MM["BLOCK_N"]),)
            return lambda: linear_kernel[grid](Buf(a), Buf(w), Buf(b), Buf(c), m, N=n,
                                               K=w.shape[0], GELU=gelu, **MM)
        return self.run([linear(x, w1, b1, self.hidden, True),
                         linear(self.hidden, w2, b2, out, False)], out)

    def rmsnorm(self, x, w, out=None):
        m = jax.block_until_ready(x).shape[0]
        out = self.alloc((m, D_NORM)) if out is None else out
        grid = (triton.cdiv(m, NORM["ROWS"]),)
        return self.run([lambda: rmsnorm_kernel[grid](Buf(x), Buf(w), Buf(out), m, EPS,
                                                      D=D_NORM, **NORM)], out)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def sweep_xla():
    """Subprocess: jax.jit of the same functions, first call and steady state per size."""
    rng = np.random.default_rng(1)
    normal, params, wn = host_inputs(rng)
    params, wn = jax.device_put(params), jax.device_put(wn)
    res = {}
    for name, fn, sizes, width, args in (("mlp", mlp, SIZES, D_IN, params),
                                         ("rmsnorm", rmsnorm, NORM_SIZES, D_NORM, (wn,))):
        f = jax.jit(fn)
        f(jax.device_put(normal((WARMUP_M, width))), *args).block_until_ready()
        rows = []
        for m in sizes:
            x = jax.device_put(normal((m, width))).block_until_ready()
            t, _ = first_ms(lambda: f(x, *args).block_until_ready())
            rows.append(dict(m=m, first_ms=t, steady_ms=median_ms(lambda: f(x, *args).block_until_ready())))
        res[name] = rows
    return res


def stream_report():
    """Subprocess: what Triton's stock driver does (torch installed, not blocked)."""
    from triton.runtime import driver
    after_import = "torch" in sys.modules
    drv = driver.active
    stream = drv.get_current_stream(drv.get_current_device())
    return dict(torch_imported_by_import_triton=after_import, driver=type(drv).__name__,
                torch_imported_by_driver="torch" in sys.modules, stream=stream,
                get_current_stream=getattr(drv.get_current_stream, "__name__", str(drv.get_current_stream)))


def subprocess_result(mode):
    proc = subprocess.run([sys.executable, __file__], env={**os.environ, "PROBE_MODE": mode},
                          capture_output=True, text=True)
    print(proc.stderr[-3000:], end="")
    if proc.returncode:
        raise RuntimeError(f"subprocess {mode} failed: {proc.stdout[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def sweep_eager(name, eager, call, ref, sizes, width, counts):
    """Per size: fresh input, first call, NaN-poisoned checked call, steady state."""
    rng = np.random.default_rng(2)
    rows = []
    for m in sizes:
        x_host = rng.standard_normal((m, width), dtype=np.float32).astype(BF16)
        expect = ref(x_host)
        x = jax.device_put(x_host).block_until_ready()
        xla0 = counts()[1]
        t_first, out = first_ms(lambda: call(x))
        poisoned = call(x, out=eager.alloc(out.shape, fill=np.nan))
        steady, dev = [], []
        for _ in range(CALLS):
            steady.append(first_ms(lambda: call(x))[0])
            dev.append(eager.cuda.elapsed_ms())
        triton_n, xla1 = counts()
        r = dict(m=m, first_ms=t_first, steady_ms=statistics.median(steady),
                 device_ms=statistics.median(dev),
                 alloc_out_ms=median_ms(lambda: eager.alloc(out.shape), 5),
                 alloc_np_empty_ms=median_ms(
                     lambda: jax.device_put(np.empty(out.shape, BF16)).block_until_ready(), 5),
                 rel_err_first=rel_err(out, expect), rel_err_poisoned=rel_err(poisoned, expect),
                 all_written=bool(np.isfinite(np.asarray(poisoned, np.float32)).all()),
                 triton_compiles=triton_n, xla_compiles=xla1 - xla0)
        rows.append(r)
        print(f"{name} M={m}: first {r['first_ms']:.2f} ms, steady {r['steady_ms']:.3f} ms, "
              f"device {r['device_ms']:.3f} ms, err {r['rel_err_poisoned']:.2e}, written "
              f"{r['all_written']}, triton compiles {triton_n}, xla compiles {r['xla_compiles']}",
              flush=True)
    return rows


def padded_ref(fn, args, width):
    """f32 reference with one compile: rows are independent, so pad every size to SIZES[-1]."""
    f = jax.jit(lambda x, *a: fn(x, *a, f32_ref=True))
    def ref(x_host):
        m = x_host.shape[0]
        padded = np.zeros((max(SIZES[-1], m), width), BF16)
        padded[:m] = x_host
        return np.asarray(f(padded, *args))[:m]
    return ref


def table(title, eager_rows, xla_rows):
    print(f"\n{title}\n{'M':>7} | {'eager 1st':>9} {'steady':>7} {'device':>7} {'alloc':>6} | "
          f"{'jit 1st':>8} {'steady':>7} | {'rel err':>8}")
    for e, x in zip(eager_rows, xla_rows):
        print(f"{e['m']:>7} | {e['first_ms']:>9.2f} {e['steady_ms']:>7.3f} {e['device_ms']:>7.3f} "
              f"{e['alloc_out_ms']:>6.2f} | {x['first_ms']:>8.1f} {x['steady_ms']:>7.3f} | "
              f"{e['rel_err_poisoned']:>8.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out_dir = ap.parse_args().out
    # Subprocesses first, while this process has not touched the GPU.
    result = {"xla": subprocess_result("xla"), "stock_triton_driver": subprocess_result("stream")}
    print("stock triton driver:", result["stock_triton_driver"], flush=True)
    result.update(device=jax.devices()[0].device_kind, sizes=SIZES, jax=jax.__version__,
                  triton=triton.__version__, matmul_config=MM, norm_config=NORM)

    xla_compiles = [0]
    def on_event(event, duration, **kw):
        xla_compiles[0] += event == "/jax/core/compile/backend_compile_duration"
    jax.monitoring.register_event_duration_secs_listener(on_event)
    jax.config.update("jax_log_compiles", True)
    kernels = (linear_kernel, rmsnorm_kernel)
    counts = lambda: (sum(len(k.device_caches[0][0]) for k in kernels), xla_compiles[0])

    cuda = Cuda()
    use_jax_driver(cuda)
    eager = Eager(cuda)
    _, params, wn = host_inputs(np.random.default_rng(0))
    params, wn = jax.device_put(params), jax.device_put(wn)
    cases = {"mlp": (lambda x, out=None: eager.mlp(x, *params, out=out),
                     padded_ref(mlp, params, D_IN), SIZES, D_IN),
             "rmsnorm": (lambda x, out=None: eager.rmsnorm(x, wn, out=out),
                         padded_ref(rmsnorm, (wn,), D_NORM), NORM_SIZES, D_NORM)}
    for name, (call, _, _, width) in cases.items():
        t = first_ms(lambda: call(jax.device_put(np.ones((WARMUP_M, width), BF16))))[0]
        result[f"{name}_warmup_ms"] = t
        print(f"{name} warm-up (compile) at M={WARMUP_M}: {t:.0f} ms", flush=True)
    result["triton_compiles_after_warmup"] = counts()[0]
    for name, (call, ref, sizes, width) in cases.items():
        result[name] = sweep_eager(name, eager, call, ref, sizes, width, counts)
        result[f"{name}_total_first_ms"] = {
            "eager": sum(r["first_ms"] for r in result[name]),
            "jax_jit": sum(r["first_ms"] for r in result["xla"][name])}
    result["torch_loaded_in_eager_process"] = sys.modules.get("torch") is not None
    with open(os.path.join(out_dir, "eager_launch.json"), "w") as f:
        json.dump(result, f, indent=1)

    print(f"\ndevice {result['device']}; triton compiles after warm-up "
          f"{result['triton_compiles_after_warmup']}, at end {counts()[0]}; torch loaded: "
          f"{result['torch_loaded_in_eager_process']}")
    table("gelu MLP 1024->4096->1024 bf16 (ms; eager steady/alloc = host wall, device = CUDA events)",
          result["mlp"], result["xla"]["mlp"])
    table("RMSNorm (M, 384) bf16 (ms)", result["rmsnorm"], result["xla"]["rmsnorm"])
    for name in cases:
        tot = result[f"{name}_total_first_ms"]
        print(f"{name}: all sizes, time to first result: eager {tot['eager']:.1f} ms "
              f"(+ one-off warm-up {result[name + '_warmup_ms']:.0f} ms), jax.jit {tot['jax_jit']:.0f} ms")


if __name__ == "__main__":
    if MODE == "eager":
        main()
    else:
        print(json.dumps(sweep_xla() if MODE == "xla" else stream_report()))
