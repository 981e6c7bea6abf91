import atexit
import os
import shutil
import tempfile
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # 8 CPU devices for tests/test_sharding.py (set before jax starts); single-device programs are unaffected
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# [Note: the suite's XLA:CPU compiles]
# XLA:CPU's compiles are most of the suite's time (a test's pallaskit program and
# its jax.jit reference: 54% of tests/test_rules.py in one profile). Without
# LLVM's optimizations and with XLA:CPU's loop emitters in place of its fusion
# emitters they take a third of the time, and the suite 864 s from 1300 s
# (benchmarks/RESULTS.md, "Session 37"). Both sides of a comparison compile
# alike. Fixture ``xla_defaults`` compiles pallaskit's programs with XLA's
# defaults where that is better: a test whose bounds are XLA:CPU's default
# accuracy (under these options jax.jit's own cbrt is 11-15 ULP off near the
# float32 range's ends; it compiles its reference with ``xla_default_jit``), and
# one whose kernels' loops run long in Pallas's interpreter (unoptimized, a mix
# kernel's test takes 51 s from 16). GPU runs and pallaskit's options are untouched.
FAST_XLA = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
XLA_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
_FAST_XLA_FLAGS = [f"--{k}={str(v).lower()}" for k, v in FAST_XLA.items()]
if os.environ["JAX_PLATFORMS"] == "cpu" and not any(k in os.environ.get("XLA_FLAGS", "") for k in FAST_XLA):
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_FAST_XLA_FLAGS]).strip()
FAST_XLA_ON = os.environ["JAX_PLATFORMS"] == "cpu" and any(f in os.environ.get("XLA_FLAGS", "").split()
                                                          for f in _FAST_XLA_FLAGS)
if os.environ["JAX_PLATFORMS"] == "cpu":  # raw Triton kernels run in Triton's interpreter, chosen
    os.environ.setdefault("TRITON_INTERPRET", "1")  # when triton is first imported
# TEST_DISABLE_PALLAS_TRITON=1: kernel_backend defaults to 'triton', so every
# kernel must run as raw Triton inside XLA (lowering/executors.py; on the CPU in
# Triton's interpreter); a kernel the Triton renderer refuses (the one place that
# records it, ``executors.fallback``) fails its test, on every platform. On a GPU
# Pallas's Triton lowering also raises; a test that pins kernel_backend='pallas'
# is skipped where it reaches that lowering.
DISABLE_PALLAS_TRITON = os.environ.get("TEST_DISABLE_PALLAS_TRITON", "") not in ("", "0")
if DISABLE_PALLAS_TRITON:
    os.environ.setdefault("PALLASKIT_KERNEL_BACKEND", "triton")
# The on-disk graph cache of a test session lives in a temporary directory
# (inherited by subprocesses); each test gets its own subdirectory below it.
_CACHE_ROOT = tempfile.mkdtemp(prefix="pallaskit-test-cache-")
atexit.register(shutil.rmtree, _CACHE_ROOT, ignore_errors=True)
os.environ["PALLASKIT_CACHE_DIR"] = _CACHE_ROOT

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import pallaskit  # noqa: E402


class PallasTritonDisabled(RuntimeError):
    """A pallas_call reached Pallas's Triton lowering under TEST_DISABLE_PALLAS_TRITON."""


def refuse_pallas_triton_lowering(ctx, *args, **params):
    """Stands in for Pallas's Triton lowering of a pallas_call."""
    if pallaskit.config.kernel_backend == "pallas":
        pytest.skip("pins kernel_backend='pallas'; Pallas's Triton lowering is disabled")
    raise PallasTritonDisabled(f"pallas_call {params.get('name_and_src_info', '')} reached Pallas's Triton "
                               "lowering (TEST_DISABLE_PALLAS_TRITON=1): a kernel fell back to Pallas")


def pallas_triton_lowering_slots():
    """(namespace, key) of each place jax's pallas_call finds Pallas's Triton
    lowering: the rule registered for ``plt.CompilerParams`` (what pallaskit
    passes) and the module function used without compiler params."""
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import core as triton_core
    from jax._src.pallas.triton import pallas_call_registration

    slots = [(pallas_call_registration, "pallas_call_lowering")]
    rules = getattr(pallas_core, "_backend_lowering_rules", None)
    if rules is not None and triton_core.CompilerParams in rules:
        slots.append((rules, triton_core.CompilerParams))
    return slots


def _disable_pallas_triton_lowering():
    for where, key in pallas_triton_lowering_slots():
        if isinstance(where, dict):
            where[key] = (refuse_pallas_triton_lowering, where[key][1])
        else:
            setattr(where, key, refuse_pallas_triton_lowering)
    from jax._src.pallas import core as pallas_core
    from jax._src.pallas.triton import core as triton_core

    if hasattr(pallas_core, "get_lowering_rule"):  # what pallas_call asks for plt.CompilerParams
        assert pallas_core.get_lowering_rule(triton_core.CompilerParams, "gpu") in (
            None, refuse_pallas_triton_lowering), "Pallas's Triton lowering moved: update tests/conftest.py"


class TritonFallback(RuntimeError):
    """The Triton renderer refused a kernel under TEST_DISABLE_PALLAS_TRITON."""


def refuse_triton_fallback(reason):
    """Stands in for ``lowering.executors.fallback``: the kernel would fall back to Pallas."""
    raise TritonFallback(f"the Triton renderer does not write a kernel ({reason}); TEST_DISABLE_PALLAS_TRITON=1 "
                         "allows no fallback to Pallas")


if DISABLE_PALLAS_TRITON:
    import lowering.executors  # noqa: E402

    lowering.executors.fallback = refuse_triton_fallback
    if os.environ["JAX_PLATFORMS"] != "cpu":
        _disable_pallas_triton_lowering()


def pytest_configure(config):
    config.addinivalue_line("markers", "pallas_source: the test inspects Pallas kernels (kernel_backend='pallas')")
    config.addinivalue_line("markers", "no_speculation: the test counts what a call compiles (compiles, traces, "
                            "kernels, cache entries, metric rows, dumps) or the collector's state after it")


@pytest.fixture(autouse=True)
def _fresh_state(request):
    pallaskit.metrics.reset()
    pallaskit.config.reset()
    pallaskit.config.update(cache_dir=os.path.join(_CACHE_ROOT, f"{zlib.crc32(request.node.nodeid.encode()):08x}"))
    if request.node.get_closest_marker("pallas_source"):
        # The test reads the Pallas renderer's source (or its lowering): on a GPU, where
        # kernel_backend='auto' means raw Triton, it asks for Pallas.
        pallaskit.config.update(kernel_backend="pallas")
    if request.node.get_closest_marker("no_speculation"):
        # On a GPU a function's first compile also starts a speculative symbolic one in the
        # background ([Note: dynamic speculation] in pallaskit/dynamic.py), with its own trace,
        # kernels, cache entry, metric rows and collector pause.
        pallaskit.config.update(automatic_dynamic_speculate=False)
    yield
    pallaskit.wait_compiles()  # background tier-up compiles (runtime/eager.py) end with their test
    pallaskit.config.reset()


@pytest.fixture
def xla_defaults(monkeypatch):
    """pallaskit's CPU programs compiled with XLA's default options, not the
    suite's ([Note: the suite's XLA:CPU compiles]); the test compiles its
    reference with ``xla_default_jit``."""
    if FAST_XLA_ON:
        from pallaskit import executable

        suite = executable.compiler_options

        def with_defaults(platform=None):
            on_cpu = (platform or jax.devices()[0].platform) == "cpu"
            return {**suite(platform), **XLA_DEFAULTS} if on_cpu else suite(platform)

        monkeypatch.setattr(executable, "compiler_options", with_defaults)


def xla_default_jit(fn):
    """``jax.jit(fn)`` compiled with XLA's default options on the CPU, where the
    suite changes them ([Note: the suite's XLA:CPU compiles])."""
    if not FAST_XLA_ON:
        return jax.jit(fn)
    return lambda *args: jax.jit(fn).lower(*args).compile(compiler_options=XLA_DEFAULTS)(*args)


@pytest.fixture
def rng(request):
    """A numpy Generator seeded by the test's id: fresh data per test, reproducible."""
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)


def tolerance(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.dtype(jax.numpy.bfloat16):
        return dict(rtol=2e-2, atol=2e-2)
    if dtype == np.float16:
        return dict(rtol=2e-3, atol=2e-3)
    return dict(rtol=1e-5, atol=1e-5)


def assert_close(actual, expected, dtype=None):
    dtype = dtype or np.asarray(expected).dtype
    a = np.asarray(actual, dtype=np.float64) if np.asarray(actual).dtype != bool else np.asarray(actual)
    e = np.asarray(expected, dtype=np.float64) if np.asarray(expected).dtype != bool else np.asarray(expected)
    assert a.shape == e.shape, (a.shape, e.shape)
    if a.dtype == bool or np.issubdtype(np.dtype(dtype), np.integer):
        np.testing.assert_array_equal(a, e)
    else:
        np.testing.assert_allclose(a, e, **tolerance(dtype))


def special_values(rng, shape, dtype):
    """Normal values whose first six are NaN, +inf, -inf, 0, -0 and 1e-30 (as many as fit)."""
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30][: flat.size]
    return jax.numpy.asarray(x, dtype)


def cpu_reference(fn, *args):
    """``jax.jit(fn)`` computed on the CPU. Where several NaNs compete for
    argmax / argmin, XLA:GPU's tree reduction returns the index of any of them
    (its comparator prefers whichever NaN it meets); jax documents, NumPy and
    XLA:CPU return the first, as pallaskit's kernels do on every platform."""
    cpu = jax.devices("cpu")[0]
    return jax.jit(fn)(*[jax.device_put(a, cpu) for a in args])


def run_python_on_cpu(script: str, timeout: float):
    """``script`` in a fresh Python process on the CPU, without Triton's
    interpreter, this checkout first on its path (a ``subprocess.CompletedProcess``)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)


# An eager program (runtime/eager.py) of two kernels and one that does not compile,
# and a stand-in for the GPU TritonKernel._compile asks of (an H100: compiled for
# it, loaded nowhere): test_triton_launch's and test_compile_workers' scripts run
# it in a fresh process, this text in place of their ``__EAGER_FIXTURE__`` line.
EAGER_FIXTURE = '''
SOURCE = """
import triton
import triton.language as tl

@triton.jit
def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 3, mask=offs < n)

@triton.jit
def gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n).to(tl.float32)
    y = 0.5 * x * (1 + tl.erf(x * 0.7071067811865476))
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=offs < n)

@triton.jit
def broken_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.no_such_op(tl.load(x_ptr + offs)))

def launch(run, kernels, x):
    n = x.shape[0]
    a = run.empty((n,), x.dtype)
    run(kernels["scale"], (triton.cdiv(n, 256),), x, a, n, BLOCK=256)
    b = run.empty((n,), x.dtype)
    run(kernels["gelu"], (triton.cdiv(n, 128),), a, b, n, BLOCK=128)
    if "broken" in kernels:
        run(kernels["broken"], (1,), b, a, n, BLOCK=128)
    return run.finish(a, b)
"""

class Device:
    compute_capability = "9.0"

class Cuda:  # what TritonKernel._compile asks of the GPU: compiled for an H100, loaded nowhere
    device = Device()
    def attribute(self, which): return 232448
    def load(self, name, cubin, shared): return 1, 1024
'''

# A kernel of a schedule in the raw-Triton renderer's GPU spelling, compiled by
# Triton for an H100 (sm_90) without a GPU: test_triton_ops's and
# test_scatter_atomic's scripts run it in a fresh process (TRITON_INTERPRET
# unset), this text in place of their ``__GPU_SPELLING__`` line.
GPU_SPELLING_FIXTURE = '''
def compile_for_gpu(k, sched, opts, until="cubin"):
    """Kernel ``k`` of ``sched`` rendered for XLA and compiled for sm_90 up to ``until``."""
    import linecache

    import numpy as np
    from triton.backends.compiler import GPUTarget

    from lowering.codegen import triton as tc
    from pallaskit.runtime import triton_launch

    r = tc.render_for_xla(k, sched, opts)
    src = (tc._PRELUDE + (tc.GLUON_IMPORTS if r.staged else "") + "\\n".join(tc.HELPERS[h] for h in sorted(r.helpers))
           + "\\n\\n" + r.source)
    name = f"<gpu spelling {k.name}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    ns = {"__name__": "gpu_spelling_" + k.name}
    exec(compile(src, name, "exec"), ns)
    kernel = ns[k.name + "_kernel"]
    dts = [sched.graph.buffer_aval(b)[1] for b in r.reads] + [m.node.dtype for m in k.members if m.store]
    sig = {a: "*" + triton_launch._triton_dtype(k.name, a, np.dtype(d)) for a, d in zip(kernel.arg_names, dts)}
    sig.update({a: "constexpr" if a in r.constexprs else "i32" for a in kernel.arg_names[len(dts):]})
    return triton_launch._compile_uncached(triton_launch.ast_source(kernel, sig, dict(r.constexprs)),
                                           GPUTarget("cuda", 90, 32),
                                           {"num_warps": r.num_warps, "num_stages": r.num_stages}, until=until)
'''
