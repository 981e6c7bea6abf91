"""GPU: where a truly cold first call of the dynamic gelu MLP (eager launches) spends
its time: fresh process, empty pallaskit and Triton caches (TRITON_CACHE_DIR too, so
Triton's gcc-built C helpers and launchers are built again).

    PYTHONPATH=. python scratch/profile_cold_eager.py [--parallel] [--noprofile] [--timeline] [--dump F] [--preload]

--preload first compiles and runs another dynamic function (a softmax) in the
same process: the compiler and Triton are then imported, the MLP's kernels and
program still compile (a process's second dynamic function).

--timeline wraps the main steps (compile, Triton render, kernel compiles on
threads, loads, launch) and prints when each ran, on which thread.
"""
import os
import sys
import tempfile
import time

T = {}
t_start = time.perf_counter()
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
os.environ["PALLASKIT_CACHE_DIR"] = tempfile.mkdtemp()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
T["import jax"] = time.perf_counter() - t_start
t = time.perf_counter()
import pallaskit  # noqa: E402
T["import pallaskit"] = time.perf_counter() - t
from benchmarks.workloads import SWEEP_ROWS, WORKLOADS  # noqa: E402

if "--parallel" not in sys.argv:
    import pallaskit.runtime.eager as eager_mod
    eager_mod.PARALLEL_COMPILE = False
EVENTS = []


def wrap(owner, name, label):
    import functools
    import threading

    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            EVENTS.append((t, time.perf_counter(), threading.current_thread().name, label))
    setattr(owner, name, timed)


if "--timeline" in sys.argv:
    import lowering
    import pallaskit.api as api
    import pallaskit.runtime.eager as eager
    import pallaskit.runtime.triton_launch as tlaunch

    wrap(lowering, "compile_jaxpr", "pallaskit compile_jaxpr")
    wrap(api, "_eager_program", "render Triton + EagerProgram")
    wrap(eager.EagerProgram, "_compile_all", "compile all kernels")
    wrap(tlaunch.TritonKernel, "_compile", "kernel compile+load")
    wrap(tlaunch._Cuda, "load", "cuModuleLoad")
    wrap(tlaunch, "_warm_up", "triton import thread")
    wrap(tlaunch.Launch, "finish", "launch finish (sync)")
w = WORKLOADS["dynamic_mlp_sweep"]
key = jax.random.key(0)
inputs = [w.make_inputs((m, 1024, 4096, 1024), jnp.bfloat16, jax.random.fold_in(key, m)) for m in SWEEP_ROWS]
jax.block_until_ready(inputs)
if "--preload" in sys.argv:
    g = pallaskit.jit(lambda x: jax.nn.softmax(x * 2.0, axis=-1), dynamic={0: (0,)})
    jax.block_until_ready(g(jax.random.normal(key, (37, 1000), jnp.float32)))
    assert pallaskit.metrics.counters["eager_launches"] == 1, pallaskit.metrics.counters
f = pallaskit.jit(w.jax_fn, dynamic={0: (0,)})
profile = "--noprofile" not in sys.argv
if profile:
    import cProfile
    import pstats
    prof = cProfile.Profile()
t0 = time.perf_counter()
if profile:
    prof.enable()
jax.block_until_ready(f(*inputs[0]))
if profile:
    prof.disable()
T["first size"] = time.perf_counter() - t0
for x in inputs[1:]:
    jax.block_until_ready(f(*x))
T["all 16"] = time.perf_counter() - t0
print({k: round(v, 3) for k, v in T.items()})
for a, b, thread, label in sorted(EVENTS):
    if a - t0 < T["first size"]:
        print(f"  {a - t0:6.3f} -> {b - t0:6.3f} s ({b - a:5.3f})  {thread[:22]:22s} {label}")
print({k: round(v, 3) for k, v in pallaskit.metrics.counters.items() if k.endswith("seconds") and v})
if profile:
    if "--dump" in sys.argv:
        prof.dump_stats(sys.argv[sys.argv.index("--dump") + 1])
    st = pstats.Stats(prof)
    wanted = ("triton_key", "__init__", "compile_module_from_src", "make_cubin", "make_ptx", "make_llir",
              "make_ttgir", "make_ttir", "_find_and_load", "compile", "load_binary", "_compile", "run")
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        if func in wanted or "triton" in fname and ct > 0.05:
            if ct > 0.03:
                rows.append((ct, f"{func} {os.path.basename(fname)}:{line} calls={nc}"))
    for ct, what in sorted(rows, reverse=True)[:45]:
        print(f"{ct:7.3f} s  {what}")
    st.sort_stats("cumulative").print_stats(40)
