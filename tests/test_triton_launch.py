"""Raw Triton kernels launched outside XLA (pallaskit/runtime/triton_launch.py).

On the CPU the kernels run in Triton's interpreter; on a GPU (JAX_PLATFORMS=cuda) they
are compiled and launched for real on memory of our own.
Each is checked against jax.jit on fresh random inputs, odd and size-1 sizes,
float32 and bfloat16.
"""
import gc
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import EAGER_FIXTURE, assert_close, run_python_on_cpu

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from pallaskit.runtime import triton_launch  # noqa: E402
from pallaskit.runtime.triton_launch import Launch, LaunchError, TritonKernel  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1: the conftest sets it on the CPU
DTYPES = [jnp.float32, jnp.bfloat16]


@triton.jit
def _silu_mul(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.sigmoid(x) * y).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _linear(a_ptr, w_ptr, b_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr, GELU: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[:M] = act(a[:M] @ w + b), row-major, every edge masked, fp32 accumulation. The
    operands are widened to float32 before tl.dot (the interpreter's bf16 dot is wrong), which
    multiplies in full float32 ("ieee", not the GPU's default tf32), and
    K is a constexpr (the interpreter cannot bound a range by a runtime int)."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc=acc, input_precision="ieee")
    acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GELU:  # tanh gelu: 0.5 x (1 + tanh(u)) == x * sigmoid(2u)
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


SILU_MUL = TritonKernel(_silu_mul)


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _silu_mul_ref(x, y):
    x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
    return (jax.nn.silu(x32) * y32).astype(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 1000, 4099])
def test_pointwise_kernel_matches_jax(rng, dtype, n):
    x, y = _normal(rng, (n,), dtype), _normal(rng, (n,), dtype)
    run = Launch(interpret=INTERPRET)
    out = run.empty((n,), dtype)
    run(SILU_MUL, (triton.cdiv(n, 256),), x, y, out, n, BLOCK=256)
    (out,) = run.finish(out)
    assert isinstance(out, jax.Array) and out.shape == (n,) and out.dtype == dtype
    assert_close(out, jax.jit(_silu_mul_ref)(x, y), dtype)


def _mlp(run, linear, x, w1, b1, w2, b2, block=(16, 32, 32)):
    """gelu(x @ w1 + b1) @ w2 + b2 as two launches of one kernel; the hidden
    activation is an output of the first that the second reads."""
    bm, bn, bk = block
    m, k = x.shape
    hidden, n = w1.shape[1], w2.shape[1]
    h = run.empty((m, hidden), x.dtype)
    y = run.empty((m, n), x.dtype)
    run(linear, (triton.cdiv(m, bm), triton.cdiv(hidden, bn)), x, w1, b1, h, m,
        N=hidden, K=k, GELU=True, BM=bm, BN=bn, BK=bk)
    run(linear, (triton.cdiv(m, bm), triton.cdiv(n, bn)), h, w2, b2, y, m,
        N=n, K=hidden, GELU=False, BM=bm, BN=bn, BK=bk)
    return run.finish(y)[0]


def _mlp_ref(x, w1, b1, w2, b2):
    hp = jax.lax.Precision.HIGHEST  # float32 products on the GPU too, as the kernel's
    h = jnp.dot(x, w1, precision=hp, preferred_element_type=jnp.float32) + b1
    h = jax.nn.gelu(h, approximate=True).astype(x.dtype)
    return (jnp.dot(h, w2, precision=hp, preferred_element_type=jnp.float32) + b2).astype(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_kernels_chain_and_one_compile_serves_every_size(rng, dtype):
    k, hidden, n = 40, 72, 24  # none a multiple of the blocks: every edge masked
    w1, w2 = _normal(rng, (k, hidden), dtype, k ** -0.5), _normal(rng, (hidden, n), dtype, hidden ** -0.5)
    b1, b2 = _normal(rng, (hidden,), jnp.float32, 0.1), _normal(rng, (n,), jnp.float32, 0.1)
    linear = TritonKernel(_linear, num_warps=4, num_stages=2)  # a fresh compile cache
    for m in (1, 37, 100):
        x = _normal(rng, (m, k), dtype)
        y = _mlp(Launch(interpret=INTERPRET), linear, x, w1, b1, w2, b2)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_close(y, jax.jit(_mlp_ref)(x, w1, b1, w2, b2), dtype)
    if not INTERPRET:  # sizes are runtime ints: two signatures (GELU on/off), none per size
        assert len(linear._loaded) == 2


def test_bad_launches_are_clear_errors(rng):
    x = _normal(rng, (8,), jnp.float32)
    run = Launch(interpret=INTERPRET)
    out = run.empty((8,), jnp.float32)
    with pytest.raises(LaunchError, match=r"unknown argument\(s\) \['BLOK'\]"):
        run(SILU_MUL, (1,), x, x, out, 8, BLOK=256)
    with pytest.raises(LaunchError, match="_silu_mul takes"):
        run(SILU_MUL, (1,), x, x, out, BLOCK=256)
    with pytest.raises(LaunchError, match="'n' is a str"):
        run(SILU_MUL, (1,), x, x, out, "8", BLOCK=256)
    with pytest.raises(LaunchError, match="dtype complex64"):
        run(SILU_MUL, (1,), x.astype(jnp.complex64), x, out, 8, BLOCK=256)
    with pytest.raises(LaunchError, match="dtype complex64"):
        run.empty((8,), jnp.complex64)
    with pytest.raises(TypeError, match="@triton.jit"):
        TritonKernel(lambda x: x)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU refuses a real launch")
def test_a_real_launch_off_the_gpu_is_refused():
    with pytest.raises(LaunchError, match="interpret mode"):
        Launch(interpret=False)


@pytest.mark.skipif(INTERPRET, reason="GPU only: memory of our own, freed by its deleter")
def test_outputs_are_freed_when_jax_drops_them(rng):
    run = Launch(interpret=False)
    cuda = triton_launch._cuda_for(run.device)
    before = len(cuda.live)
    for n in (1, 1000, 4099) * 20:
        x = _normal(rng, (n,), jnp.float32)
        out = run.empty((n,), jnp.float32)
        run(SILU_MUL, (triton.cdiv(n, 256),), x, x, out, n, BLOCK=256)
        (out,) = run.finish(out)
        assert_close(out + 1, jax.jit(lambda a: _silu_mul_ref(a, a) + 1)(x))  # XLA reads our memory
        del out
    gc.collect()
    assert len(cuda.live) == before


@pytest.mark.skipif(INTERPRET, reason="GPU only")
def test_the_gpu_path_never_imports_torch_and_exits_cleanly():
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import jax, jax.numpy as jnp, numpy as np
        from tests import test_triton_launch as t
        x = jnp.asarray(np.random.default_rng(1).standard_normal(777, dtype=np.float32))
        run = t.Launch(interpret=False)
        out = run.empty((777,), jnp.float32)
        run(t.SILU_MUL, (4,), x, x, out, 777, BLOCK=256)
        (out,) = run.finish(out)
        np.testing.assert_allclose(np.asarray(out), np.asarray(t._silu_mul_ref(x, x)), rtol=1e-5, atol=1e-6)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]  # `out` is still alive at exit


@pytest.mark.skipif(INTERPRET, reason="GPU only: compiled kernels")
def test_compiled_kernels_are_kept_and_a_bad_file_is_recompiled(rng, tmp_path, monkeypatch, caplog):
    """[Note: kernel artifacts]: a second TritonKernel (a new process's) loads the
    compiled kernel from the cache without compiling; a corrupt file is
    logged, recompiled and rewritten."""
    x, y = _normal(rng, (1000,), jnp.float32), _normal(rng, (1000,), jnp.float32)

    def run(kernel):
        launch = Launch(interpret=False)
        out = launch.empty((1000,), jnp.float32)
        launch(kernel, (4,), x, y, out, 1000, BLOCK=256)
        return launch.finish(out)[0]

    assert_close(run(TritonKernel(_silu_mul, cache_dir=str(tmp_path))), _silu_mul_ref(x, y))
    (path,) = tmp_path.glob("*.kernel")
    real_compile = triton_launch._compile_uncached

    def no_compile(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(triton_launch, "_compile_uncached", no_compile)
    assert_close(run(TritonKernel(_silu_mul, cache_dir=str(tmp_path))), _silu_mul_ref(x, y))
    monkeypatch.setattr(triton_launch, "_compile_uncached", real_compile)
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # torn
    with caplog.at_level("WARNING", logger="pallaskit"):
        assert_close(run(TritonKernel(_silu_mul, cache_dir=str(tmp_path))), _silu_mul_ref(x, y))
    assert "ignoring the compiled kernel" in caplog.text
    assert path.read_bytes() == data  # rewritten whole


@pytest.mark.skipif(sys.platform != "linux", reason="Triton compiles for CUDA on Linux")
def test_the_uncached_compile_is_triton_compile(tmp_path):
    """``_compile_uncached`` runs Triton's stages without its cache: the same cubin
    and metadata as ``triton.compile`` for a pointwise kernel and a matmul with
    tl.dot, compiled for an H100 (sm_90). No GPU needed: a process without
    Triton's interpreter compiles, it does not launch."""
    script = textwrap.dedent("""
        import json
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from pallaskit.runtime import triton_launch
        from tests import test_triton_launch as t

        target = GPUTarget("cuda", 90, 32)
        cases = [
            (t._silu_mul, {"x_ptr": "*bf16", "y_ptr": "*bf16", "out_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"},
             {"BLOCK": 1024}, {"num_warps": 4, "num_stages": 3}),
            (t._linear, {"a_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*bf16", "M": "i32",
                         "N": "constexpr", "K": "constexpr", "GELU": "constexpr", "BM": "constexpr",
                         "BN": "constexpr", "BK": "constexpr"},
             {"N": 96, "K": 80, "GELU": True, "BM": 64, "BN": 32, "BK": 16}, {"num_warps": 4, "num_stages": 2}),
        ]
        for fn, signature, constexprs, options in cases:
            attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(signature.values()) if v.startswith("*")}
            src = ASTSource(fn, signature, constexprs, attrs)
            ours = triton_launch._compile_uncached(src, target, options)
            theirs = triton.compile(src, target=target, options=options)
            assert ours.cubin == bytes(theirs.kernel), fn
            a = vars(ours.metadata)
            b = json.loads(json.dumps(theirs.metadata._asdict(), default=vars))
            diff = {k for k in set(a) | set(b) if k != "hash" and a.get(k) != b.get(k)}
            assert not diff, (fn, diff)
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))  # the conftest keeps a set value
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(sys.platform != "linux", reason="Triton compiles for CUDA on Linux")
def test_an_eager_programs_kernels_compile_at_once_on_the_compile_threads(tmp_path):
    """[Note: eager launches]: an eager program's first launch compiles all its
    kernels at once on ``triton_call``'s compile threads (one pool for the
    process), to the same cubins as one after another; a kernel that does not
    compile fails the program naming that kernel, after the others finished;
    compiled kernels are kept, and a second program (a new process's) loads them.
    Compiled for an H100 (sm_90) without a GPU: a stand-in device loads nothing."""
    script = textwrap.dedent('''
        import os
        import threading
        import jax.numpy as jnp
        import triton
        from triton.backends.compiler import GPUTarget
        import pallaskit
        from pallaskit import cache
        from pallaskit.runtime import eager, triton_call, triton_launch

        # on the threads themselves (in their compile workers: tests/test_compile_workers.py)
        pallaskit.config.update(triton_compile_processes=False)

        __EAGER_FIXTURE__

        threads, compiles = set(), []
        real = triton_launch._compile_uncached
        def counting(src, target, options, until="cubin"):
            threads.add(threading.current_thread().name)
            compiles.append(src.fn.__name__)
            return real(src, target, options, until)
        triton_launch._compile_uncached = counting
        triton_launch._cuda_for = lambda device: Cuda()
        cache.cache_dir = lambda: os.environ["ARTIFACTS"]  # the kernels are kept in a fresh folder
        cache.enabled = lambda: True
        x = jnp.zeros((1000,), jnp.bfloat16)
        configs = [("scale", 4, 2), ("gelu", 2, 3)]
        target = GPUTarget("cuda", 90, 32)

        program = eager.EagerProgram(SOURCE, configs, False, ())
        program._compile_all([x])
        assert sorted(compiles) == ["gelu_kernel", "scale_kernel"], compiles
        assert threads == {t.name for t in triton_call._compile_pool()._threads}, threads
        assert all(t.startswith("pallaskit-triton-compile") for t in threads), threads
        recorder = eager._Recorder()
        program._launch(recorder, program.kernels, x)
        for kernel, key in recorder.keys:  # the same cubin as a compile on this thread alone
            signature = {n: e for n, (e, _) in zip(kernel.arg_names, key)}
            constexprs = {n: v for n, (e, v) in zip(kernel.arg_names, key) if e == "constexpr"}
            alone = real(triton_launch.ast_source(kernel.fn, signature, constexprs), target,
                         {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
            kept = triton_launch._load_artifact(kernel._artifact_path(key, target, triton.__version__))
            assert kept is not None and kept.cubin == alone.cubin, kernel.name

        compiles.clear()  # a new process's program: every kernel from the artifacts
        eager.EagerProgram(SOURCE, configs, False, ())._compile_all([x])
        assert compiles == [], compiles

        broken = eager.EagerProgram(SOURCE, configs + [("broken", 4, 2)], False, ())
        try:
            broken._compile_all([x])
        except triton_launch.LaunchError as e:
            assert str(e).startswith("broken_kernel: Triton compile failed"), e
        else:
            raise AssertionError("no error")
        print("ok")
    ''').replace("__EAGER_FIXTURE__", EAGER_FIXTURE)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               ARTIFACTS=str(tmp_path / "pallaskit"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


_PARSE_SCRIPT = textwrap.dedent('''
    import ast, os, sys, threading
    os.environ.pop("TRITON_INTERPRET", None)
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from pallaskit.runtime import triton_call, triton_launch

    held = []
    real = ast.parse

    def parse(*a, **k):  # Triton parses a kernel's source for its hash and its AST stage
        held.append(triton_launch.PARSE_LOCK._is_owned())
        return real(*a, **k)

    ast.parse = parse
    kernels = []
    for i in range(6):
        src = (f"def k{i}(x_ptr, n, B: tl.constexpr):\\n"
               f"    j = tl.arange(0, B)\\n"
               f"    tl.store(x_ptr + j, tl.load(x_ptr + j, mask=j < n) * {i + 2}.0, mask=j < n)\\n")
        name = f"<parse probe {i}>"
        import linecache
        linecache.cache[name] = (len(src), None, src.splitlines(True), name)
        ns = {"tl": tl}
        exec(compile(src, name, "exec"), ns)
        kernels.append(triton.jit(ns[f"k{i}"]))

    def one(fn):
        kernel = triton_launch.TritonKernel(fn, num_warps=4, num_stages=1, cache_dir="/tmp")
        key = (("*fp32", None), ("i32", None), ("constexpr", 128))
        kernel._artifact_path(key, GPUTarget("cuda", 90, 32), triton.__version__)
        src = triton_launch.ast_source(fn, {"x_ptr": "*fp32", "n": "i32", "B": "constexpr"}, {"B": 128})
        return triton_launch._compile_uncached(src, GPUTarget("cuda", 90, 32), {"num_warps": 4}, until="ptx")

    pool = triton_call._compile_pool()
    [f.result() for f in [pool.submit(one, k) for k in kernels]]
    print("PARSES", len(held), all(held))
''')


def test_triton_parses_kernel_sources_one_thread_at_a_time():
    """Kernels compile on several threads; Triton's ast.parse of their sources
    (for the artifact key, the hash, the AST stage) runs under PARSE_LOCK: Python
    before 3.11.8 / 3.12.2 raised SystemError on two at once (gh-106905), which
    failed an eager program's first call (it then ran through XLA)."""
    done = run_python_on_cpu(_PARSE_SCRIPT, timeout=300)
    assert "PARSES" in done.stdout, done.stderr[-3000:]
    n, ok = done.stdout.split("PARSES")[1].split()[:2]
    assert int(n) >= 12 and ok == "True", done.stdout


def test_each_launch_signature_is_assembled_early_once(monkeypatch):
    """[Note: assembling PTX early]: when a kernel's PTX compile finishes, one
    one-kernel program per launch signature is queued for jaxlib's assembly (other
    launches of those dtypes share it); a failed PTX compile queues nothing. The
    GPU facts are stood in for: this checks the bookkeeping, the GPU suite the rest."""
    import concurrent.futures
    import types

    from jax._src import lib as jax_lib

    from pallaskit.runtime import ffi_targets, triton_call

    queued = []

    class Pool:  # records the jobs; a real pool's submit returns a Future (wait_compiles waits on it)
        def submit(self, fn, *args):
            queued.append((fn, args))
            return finished()

    def finished(result=None, error=None):
        f = concurrent.futures.Future()
        f.set_exception(error) if error else f.set_result(result)
        return f

    monkeypatch.setattr(jax_lib, "gpu_triton", types.SimpleNamespace(get_compute_capability=lambda device: 90),
                        raising=False)
    monkeypatch.setattr(ffi_targets, "triton_target", lambda: "target")
    monkeypatch.setattr(triton_call, "_assembly_pool", lambda: Pool())

    @triton.jit
    def copy(in_ptr, out_ptr, BLOCK: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, BLOCK), tl.load(in_ptr + tl.arange(0, BLOCK)))

    kernel = triton_call._Kernel(copy, 4, 1)
    monkeypatch.setattr(kernel, "start", lambda *a: finished("ptx"))
    f32, bf16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
    for _ in range(3):  # the same signature again (another grid or shape): queued once
        triton_call._start_compile(kernel, [f32], [f32], (), {"BLOCK": 16})
    triton_call._start_compile(kernel, [bf16], [bf16], (), {"BLOCK": 16})
    assert [args[1:] for _, args in queued] == [((f32,), (f32,), (), (("BLOCK", 16),)),
                                                ((bf16,), (bf16,), (), (("BLOCK", 16),))]
    del queued[:]
    assert all(fn is triton_call._assemble and args[0] is kernel for fn, args in queued)
    monkeypatch.setattr(kernel, "start", lambda *a: finished(error=RuntimeError("no PTX")))
    triton_call._start_compile(kernel, [f32], [f32], (), {"BLOCK": 32})
    assert queued == []


def test_early_assembly_is_keyed_by_scalar_types_not_values(monkeypatch):
    """A symbolic program's sizes are scalar arguments: other values of one type are
    the same PTX, assembled once; an int64 value is another signature."""
    import concurrent.futures
    import types

    from jax._src import lib as jax_lib

    from pallaskit.runtime import ffi_targets, triton_call

    queued = []
    monkeypatch.setattr(jax_lib, "gpu_triton", types.SimpleNamespace(get_compute_capability=lambda device: 90),
                        raising=False)
    monkeypatch.setattr(ffi_targets, "triton_target", lambda: "target")
    done = concurrent.futures.Future()
    done.set_result(None)
    monkeypatch.setattr(triton_call, "_assembly_pool",
                        lambda: types.SimpleNamespace(submit=lambda fn, *args: queued.append(args) or done))

    @triton.jit
    def scale(in_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, tl.load(in_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    kernel = triton_call._Kernel(scale, 4, 1)
    done = concurrent.futures.Future()
    done.set_result("ptx")
    monkeypatch.setattr(kernel, "start", lambda *a: done)
    f32 = np.dtype(np.float32)
    for n in (7, 100, 2**31 - 1, 2**31):
        triton_call._start_compile(kernel, [f32], [f32], (n,), {"BLOCK": 16})
    assert [args[3] for args in queued] == [(7,), (2**31,)]


def test_independent_kernels_of_one_program_run_one_at_a_time_in_the_interpreter(rng):
    """XLA:CPU runs independent host callbacks on several threads at once, and Triton's
    interpreter is process-global ([Note: one interpreted kernel at a time]): ten
    independent raw-Triton reductions crashed ("Did you forget to add @triton.jit?")."""
    if not INTERPRET:
        pytest.skip("Triton's interpreter (the CPU)")
    import pallaskit

    pallaskit.config.update(kernel_backend="triton", combo_kernels=False)

    def sums(*xs):
        return [jnp.sum(jnp.sin(x), axis=1) for x in xs]

    xs = [jnp.asarray(rng.standard_normal((8 + i, 17)), jnp.float32) for i in range(10)]
    for got, want in zip(pallaskit.jit(sums)(*xs), jax.jit(sums)(*xs)):
        assert_close(got, want)


def test_dlpack_capsules_survive_jax_ffi_pycapsule():
    """``jax.ffi.pycapsule`` (any FFI registration in the user's process) rewrites the
    argtypes of the shared ``ctypes.pythonapi.PyCapsule_New`` to take a CFUNCTYPE
    destructor; the eager launcher's DLPack capsules take a prototype of their own
    (on the GPU every eager launch failed after it)."""
    import ctypes

    from pallaskit.runtime import triton_launch

    jax.ffi.pycapsule(ctypes.CDLL(None).free)
    value = ctypes.c_int(5)
    assert "dltensor" in repr(triton_launch._capsule_new(ctypes.addressof(value), b"dltensor", None))


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _first_max(a, ia, b, ib):  # argmax: the larger value, of equal ones the first index
    take_b = (b > a) | ((b == a) & (ib < ia))
    return tl.where(take_b, b, a), tl.where(take_b, ib, ia)


@triton.jit
def _reductions(x_ptr, rowmax_ptr, colmax_ptr, allmax_ptr, prod_ptr, arg_ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + r * C + c)
    tl.store(rowmax_ptr + r, tl.reduce(x, 1, _max_nan, keep_dims=True))
    tl.store(colmax_ptr + tl.arange(0, C), tl.reduce(x, 0, _max_nan))
    tl.store(allmax_ptr, tl.reduce(x, None, _max_nan))
    tl.store(prod_ptr + tl.arange(0, R), tl.reduce(x, 1, _mul))
    _, arg = tl.reduce((x, c + r * 0), 1, _first_max)
    tl.store(arg_ptr + tl.arange(0, R), arg)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="Triton's interpreter")
def test_the_interpreters_reductions_by_halves_fold_as_it_does(rng, monkeypatch):
    """[Note: the interpreter's reductions by halves]: row, column and whole-block
    reductions with the renderer's combines (NaN max, product, argmax's first of
    ties) give what the interpreter's element-by-element fold gives."""
    from triton.runtime import interpreter

    triton_launch._triton(interpret=True)
    halving = interpreter.ReduceOps.generic_reduce
    assert hasattr(halving, "plain"), "the interpreter's reductions are not patched"
    x = rng.integers(-3, 4, (8, 32)).astype(np.float32)  # small integers: ties, exact products
    x[5] = 2.0  # a row of one value: every position ties
    x[2, 7] = x[6, 3] = np.nan

    def run():
        outs = [np.zeros((8, 1), np.float32), np.zeros(32, np.float32), np.zeros(1, np.float32),
                np.zeros(8, np.float32), np.zeros(8, np.int32)]
        triton_launch.run_interpreted(_reductions, (1,), [triton_launch._HostTensor(a) for a in (x, *outs)],
                                      dict(R=8, C=32))
        return outs

    halves = run()
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", halving.plain)
    for got, want in zip(halves, run()):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(halves[4], np.argmax(np.where(np.isnan(x), -np.inf, x), 1))
    assert np.isnan(halves[0][[2, 6]]).all() and np.isnan(halves[2]).all() and halves[4][5] == 0
