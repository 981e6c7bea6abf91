"""Raw Triton kernels compiled in worker processes ([Note: compile workers]
in pallaskit/runtime/triton_compile.py), on the CPU. Inside XLA, to PTX: the
same PTX as a compile on the thread, a failing kernel raises what it raises
on the thread, a module whose constant changed is sent again, a killed
worker is replaced, idle workers are closed, the workers end with the
process and none start with the option off. An eager program's kernels, to
cubin (ptxas from Triton's wheel): in two workers started before the
compile, at once, to the thread's cubins, falling back to the thread."""
import os
import textwrap

import pytest

from conftest import EAGER_FIXTURE, run_python_on_cpu

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent('''
    import os, signal, time
    import jax, jax.numpy as jnp
    import lowering
    from lowering.options import CompileOptions
    import pallaskit, triton
    from pallaskit.runtime import loader, triton_call, triton_compile, triton_launch

    def f(xs, y):  # one combo kernel: noinline group functions, the _max_nan helper
        return [x * 0.5 + 1.0 for x in xs], jnp.max(y, axis=-1), jnp.sum(y * y, axis=0)

    xs = [jax.ShapeDtypeStruct((3 + i, 5 + 2 * i), jnp.float32) for i in range(20)]
    y = jax.ShapeDtypeStruct((37, 300), jnp.bfloat16)
    opts = CompileOptions(interpret=False, triton_available=True, num_sms=132, kernel_backend="auto",
                          loop_bodies=False)
    program = lowering.compile_jaxpr(jax.make_jaxpr(f)(xs, y), opts, "workers").program
    assert "noinline=True" in program.source and "def _max_nan" in program.source
    calls = []
    triton_call._start_compile = lambda kernel, ins, outs, scalars, constexprs: calls.append(
        (kernel, triton_call._signature(kernel, [*ins, *outs], scalars), dict(constexprs)))
    jax.make_jaxpr(loader.load(program))(*xs, y)
    assert calls

    OTHER = """
    import triton
    import triton.language as tl
    SCALE = tl.constexpr(2.0)

    @triton.jit
    def broken_kernel(x_ptr, n, B: tl.constexpr):
        j = tl.arange(0, B)
        tl.store(x_ptr + j, tl.no_such_op(tl.load(x_ptr + j, mask=j < n)), mask=j < n)

    @triton.jit
    def scale_kernel(x_ptr, n, B: tl.constexpr):
        j = tl.arange(0, B)
        tl.store(x_ptr + j, tl.load(x_ptr + j, mask=j < n) * SCALE, mask=j < n)
    """
    import linecache
    linecache.cache["<other>"] = (len(OTHER), None, OTHER.splitlines(True), "<other>")
    namespace = {"__name__": "other_module"}
    exec(compile(OTHER, "<other>", "exec"), namespace)
    broken = triton_call._kernel(namespace["broken_kernel"], 4, 1)
    scale = triton_call._kernel(namespace["scale_kernel"], 4, 1)

    def scaled(by):  # scale_kernel's PTX with the module's SCALE reassigned
        namespace["SCALE"] = triton.language.constexpr(by)
        scale._ptx.clear()
        return scale.compiled({"x_ptr": "*fp32", "n": "i32"}, {"B": 128}, 90).cubin

    def compile_all():
        for kernel, _, _ in calls:
            kernel._ptx.clear()
        return [kernel.compiled(sig, c, 90) for kernel, sig, c in calls]

    def error():
        broken._ptx.clear()
        try:
            broken.compiled({"x_ptr": "*fp32", "n": "i32"}, {"B": 128}, 90)
        except Exception as e:
            return type(e), str(e)
        raise AssertionError("the broken kernel compiled")

    here = []
    real = triton_launch._compile_uncached
    def counting(*a, **k):  # compiles on the thread
        here.append(a[0].fn.__name__)
        return real(*a, **k)
    triton_launch._compile_uncached = counting

    pallaskit.config.update(triton_compile_processes=False)
    try:
        threads = compile_all()
    except Exception as e:  # a Triton wheel that cannot compile for the GPU here
        print("SKIP", type(e).__name__, e)
        raise SystemExit(0)
    threads_error = error()
    threads_scaled = scaled(3.0)
    assert not triton_compile._workers, "a worker started with the option off"
    assert len(here) == len(calls) + 2, here

    pallaskit.config.update(triton_compile_processes=True)
    triton_compile._REAP_EVERY_S = 0.1
    here.clear()
    with triton_compile._local_while_starting:  # no compile on the thread while a worker starts
        workers = compile_all()
        assert here == [], here  # every kernel went to a worker
        assert len(triton_compile._workers) >= 1
        assert [w.cubin for w in workers] == [t.cubin for t in threads]
        assert [vars(w.metadata) for w in workers] == [vars(t.metadata) for t in threads]
        assert b".loc" in workers[0].cubin  # line info: same file and lines in the worker

        assert error() == threads_error, (error(), threads_error)  # the worker failed, the thread raised
        assert here == ["broken_kernel"], here

        here.clear()
        assert scaled(2.0) != threads_scaled
        key, _ = triton_compile.module_payload(namespace["scale_kernel"])
        namespace["SCALE"] = triton.language.constexpr(3.0)
        new_key, _ = triton_compile.module_payload(namespace["scale_kernel"])
        assert new_key != key  # the module changed: workers rebuild it
        for w in triton_compile._workers:
            w.modules.add(new_key)  # as if a worker had dropped it: it asks for it again
        assert scaled(3.0) == threads_scaled
        assert here == [], here

        pids = [w.proc.pid for w in triton_compile._workers]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        here.clear()
        again = compile_all()  # the dead worker's job on the thread, or a new worker
        assert [w.cubin for w in again] == [t.cubin for t in threads]
        compile_all()
        alive = [w for w in triton_compile._workers if w.alive]
        assert alive and not {w.proc.pid for w in alive} & set(pids), "no new worker"

    triton_compile._IDLE_S = 0.5  # idle workers are closed
    idle = list(triton_compile._workers)
    for _ in range(100):
        time.sleep(0.1)
        if not triton_compile._workers:
            break
    assert all(w.proc.returncode is not None for w in idle), "an idle worker still runs"
    triton_compile._IDLE_S = 300.0
    with triton_compile._local_while_starting:
        compile_all()  # new workers
    assert triton_compile._workers and here == [], here

    first = list(triton_compile._workers)
    triton_compile._shutdown_all()
    assert all(w.proc.returncode is not None for w in first), "a worker still runs"
    compile_all()  # a new worker; this one ends with the process
    print("WORKERS", " ".join(str(w.proc.pid) for w in triton_compile._workers))
    print("ok")
''')


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(os.name != "posix", reason="compile workers need POSIX pipes")
def test_compile_workers_match_threads_and_end():
    done = run_python_on_cpu(_SCRIPT, timeout=300)
    if "SKIP" in done.stdout:
        pytest.skip(done.stdout.split("SKIP", 1)[1].strip()[:200])
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
    pids = [int(p) for p in done.stdout.split("WORKERS", 1)[1].split("\n", 1)[0].split()]
    assert pids
    deadline = 50
    while any(_running(p) for p in pids) and deadline:  # orphans would be reparented, not reaped by us
        import time
        time.sleep(0.1)
        deadline -= 1
    assert not any(_running(p) for p in pids), "a worker outlived its process"


_EAGER_SCRIPT = textwrap.dedent('''
    import os, signal, tempfile, threading, time
    import jax, jax.numpy as jnp
    from lowering.options import CompileOptions
    import pallaskit
    from pallaskit import cache, orchestrator
    from pallaskit.runtime import eager, triton_call, triton_compile, triton_launch
    import concurrent.futures
    pool = concurrent.futures.ThreadPoolExecutor(2)  # two compile threads, as on a 2-core machine
    triton_call._compile_pool = lambda: pool  # (a third thread would compile while its worker starts)
    orchestrator.PRESTART_WORKERS = 2  # one for each of them (the default: one for each of up to 8)

    __EAGER_FIXTURE__

    triton_launch._cuda_for = lambda device: Cuda()
    cache.enabled = lambda: False  # every program compiles (the artifacts: at the end)
    configs = [("scale", 4, 2), ("gelu", 2, 3)]
    x = jax.ShapeDtypeStruct((1000,), jnp.bfloat16)  # avals, as a speculative compile has them

    here, compiled = [], {}
    real_uncached, real_cubin = triton_launch._compile_uncached, triton_launch._compile_cubin
    def counting(src, *a, **k):  # compiles on the thread
        here.append(src.fn.__name__)
        return real_uncached(src, *a, **k)
    def keeping(fn, *a, **k):
        compiled[fn.__name__] = c = real_cubin(fn, *a, **k)
        return c
    triton_launch._compile_uncached, triton_launch._compile_cubin = counting, keeping

    def compile_all(configs=configs):
        compiled.clear()
        eager.EagerProgram(SOURCE, configs, False, ()).precompile([x])
        return {n: (c.cubin, vars(c.metadata)) for n, c in compiled.items()}

    def error():
        try:
            compile_all(configs + [("broken", 4, 2)])
        except triton_launch.LaunchError as e:
            return str(e)
        raise AssertionError("the broken kernel compiled")

    pallaskit.config.update(triton_compile_processes=False)
    try:
        threads = compile_all()
    except Exception as e:  # a Triton wheel that cannot compile for the GPU here
        print("SKIP", type(e).__name__, e)
        raise SystemExit(0)
    assert sorted(threads) == ["gelu_kernel", "scale_kernel"] and sorted(here) == sorted(threads), here
    assert all(cubin[:4] == b"\\x7fELF" for cubin, _ in threads.values())  # ptxas ran: cubins
    threads_error = error()
    assert threads_error.startswith("broken_kernel: Triton compile failed"), threads_error
    gpu = CompileOptions(interpret=False, triton_available=True)
    orchestrator.start_compile_workers(gpu)
    assert not triton_compile._workers, "a worker started with the option off"

    pallaskit.config.update(triton_compile_processes=True)
    orchestrator.start_compile_workers(CompileOptions(interpret=True, triton_available=True))
    assert not triton_compile._workers, "a worker started in interpret mode"
    pallaskit.config.update(dynamic_launch="off")
    orchestrator.start_compile_workers(CompileOptions(interpret=False, triton_available=True,
                                                       kernel_backend="pallas"))
    assert not triton_compile._workers, "a worker started with no raw Triton kernel to compile"
    pallaskit.config.update(dynamic_launch="auto")
    orchestrator.start_compile_workers(gpu)  # as a GPU compile begins: before the kernels
    triton_compile.prestart(2)
    spares = list(triton_compile._spares)
    assert len(spares) == 2 and all(w.ready(120) for w in spares)

    jobs, together = [], threading.Barrier(2, timeout=120)
    real_job = triton_compile.Worker.compile
    def job(self, *a):
        together.wait()  # both kernels in a worker at once, or this times out
        jobs.append(self.proc.pid)
        return real_job(self, *a)
    triton_compile.Worker.compile = job
    here.clear()
    workers = compile_all()
    triton_compile.Worker.compile = real_job
    assert here == [], here  # nothing compiled on a thread: the workers had started
    assert sorted(jobs) == sorted(w.proc.pid for w in spares), (jobs, spares)  # one kernel each
    assert not triton_compile._spares and len(triton_compile._workers) == 2
    assert workers == threads  # the same cubins and metadata

    assert error() == threads_error  # the worker failed, the thread raised
    assert here == ["broken_kernel"], here

    pids = [w.proc.pid for w in triton_compile._workers]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert compile_all() == threads  # the dead workers' jobs on the thread, or new workers
    here.clear()
    assert compile_all() == threads
    alive = [w for w in triton_compile._workers if w.alive]
    assert alive and not {w.proc.pid for w in alive} & set(pids), "no new worker"

    folder = tempfile.mkdtemp()  # kernels kept, then read back
    cache.cache_dir, cache.enabled = (lambda: folder), (lambda: True)
    assert compile_all() == threads
    here.clear()
    triton_compile.Worker.compile = lambda *a: jobs.append("again")
    assert compile_all() == {} and here == [] and jobs[-1] != "again", (here, jobs)  # from the artifacts
    print("ok")
''').replace("__EAGER_FIXTURE__", EAGER_FIXTURE)


@pytest.mark.skipif(os.name != "posix", reason="compile workers need POSIX pipes")
def test_eager_kernels_compile_in_workers_started_before():
    done = run_python_on_cpu(_EAGER_SCRIPT, timeout=300)
    if "SKIP" in done.stdout:
        pytest.skip(done.stdout.split("SKIP", 1)[1].strip()[:200])
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
