"""A symbolic program's kernels launched outside XLA, for the first calls of a
new size.

[Note: eager launches]
A new size of a dynamic dim costs ``jax.jit`` a trace, a lowering and an XLA
compile of a new executable, whatever the kernels (RESULTS.md, "Dynamic dims
and multi-kernel"). When every kernel of a symbolic program renders to raw Triton
(``lowering/codegen/triton.py``), ``EagerProgram`` runs it through
``runtime/triton_launch.Launch`` instead: its kernels compile once (sizes are
kernel arguments), and a new size costs the launches.

The multi-kernel dispatcher (runtime/multikernel.py) serves a shape key this
way until something compiled for that key is ready: a size's first call runs
eagerly; its second call (the size recurs) starts a compile on a background
thread and runs eagerly again; the calls after that compile finishes take the
compiled executable, which costs less host time per call than the Python
launcher. What compiles (option ``dynamic_tier_up``): ``static`` (default), the
size's own static program, as ``pallaskit.jit`` without ``dynamic=`` would
compile it (through the on-disk cache; figures in benchmarks/RESULTS.md);
``variant``, the usual multi-kernel choice (forced, from disk, timed or
nearest) and that variant's XLA compile. ``wait_compiles()`` waits for the
background work (benchmarks call it before timing a steady state). Why not at
first sight: the background trace and lowering hold the GIL, and the eager
calls of other new sizes then wait on it.

An eager call that fails (a launch error, a Triton compile error) is logged
once and turns eager launches off for that program: the call and the ones
after it take the XLA path, so a function ``jax.jit`` runs still runs.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import linecache
import logging
import os
import threading

from pallaskit import metrics

log = logging.getLogger("pallaskit")

_pools: dict = {}  # thread name prefix -> its one-thread pool
_pending: set = set()
_lock = threading.Lock()


class EagerProgram:
    """``(*inputs) -> outputs`` through Triton launches; ``inputs`` are the
    program's (leaves, then constants). ``source``: the Triton renderer's module
    (lowering/codegen/triton.py); ``kernels``: (name, num_warps, num_stages)."""

    def __init__(self, source: str, kernels: list, interpret: bool, hints: tuple, guards: list = ()):
        from pallaskit import cache
        from pallaskit.runtime import triton_compile
        from pallaskit.runtime.triton_launch import TritonKernel, _triton

        _triton(interpret)
        self.source, self.kernel_configs = source, [tuple(k) for k in kernels]
        self.interpret = interpret
        self.hints = tuple(tuple(h) for h in hints)  # the variant's size hints (for logs)
        self.guards = list(guards)  # Python source over the symbols: what the program assumes
        self.from_cache = False  # read from the eager program cache (its kernels: from the artifact cache)
        self._compiled = False
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        filename = f"<pallaskit-triton-{digest}>"  # Triton reads kernel source through inspect: linecache
        lines = source.splitlines(True)
        linecache.cache[filename] = (len(source), None, lines, filename)
        namespace: dict = {"__name__": f"pallaskit_triton_{digest}"}  # Triton reads helpers' __module__
        triton_compile.register_sources(filename, lines)  # [Note: function sources without the tokenizer]
        try:
            exec(compile(source, filename, "exec"), namespace)
        finally:
            triton_compile.forget_sources(filename)
        self._launch = namespace["launch"]
        artifacts = os.path.join(cache.cache_dir(), "triton_kernels") if cache.enabled() else None
        self.kernels = {name: TritonKernel(namespace[f"{name}_kernel"], num_warps=warps, num_stages=stages,
                                           cache_dir=artifacts) for name, warps, stages in self.kernel_configs}

    def __call__(self, *inputs):
        import jax
        import jax.numpy as jnp

        from pallaskit.runtime.triton_launch import Launch

        metrics.counters["eager_launches"] += 1
        inputs = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in inputs]  # numpy, Python scalars
        if not self._compiled and not self.interpret and PARALLEL_COMPILE:
            self._compile_all(inputs)
        self._compiled = True
        outputs = self._launch(Launch(interpret=self.interpret), self.kernels, *inputs)
        if any(x.committed for x in inputs):  # jax.jit's outputs are committed where an argument is
            return outputs
        from pallaskit.runtime.interop import uncommitted

        return tuple(uncommitted(o) for o in outputs)

    def precompile(self, inputs) -> None:
        """Compile (or load) every kernel for ``inputs`` before the first call,
        which then finds them loaded. Anything with the inputs' ``shape`` and
        ``dtype`` will do (a speculative compile has avals, [Note: dynamic
        speculation] in pallaskit/dynamic.py). Nothing to do in interpret mode."""
        if not self.interpret:
            self._compile_all(inputs)

    def _compile_all(self, inputs) -> None:
        """Compile (or load) every kernel at once before the first launch:
        ``launch`` runs on a recorder that notes each kernel's signature."""
        import jax

        from pallaskit.runtime.triton_launch import _cuda_for

        recorder = _Recorder()
        self._launch(recorder, self.kernels, *inputs)
        compile_kernels(recorder.keys, _cuda_for(jax.devices()[0]))  # Launch's device


def compile_kernels(keys: list, cuda) -> None:
    """Each (TritonKernel, signature) of ``keys`` compiled (or read from the
    kernel artifacts) and loaded on ``cuda``, all at once on the compile
    threads raw Triton kernels inside XLA use (``triton_call._compile_pool``),
    each through its compile worker ([Note: compile workers] in
    runtime/triton_compile.py): the wall time is about the slowest kernel's.
    Every compile finishes before this returns; the first failure, in
    ``keys``' order, is raised naming its kernel."""
    from pallaskit.runtime import triton_call
    from pallaskit.runtime.triton_launch import LaunchError

    pool = triton_call._compile_pool()
    futures = [(kernel, pool.submit(kernel.loaded, key, cuda)) for kernel, key in keys]
    concurrent.futures.wait([f for _, f in futures])
    for kernel, future in futures:
        error = future.exception()
        if error is None:
            continue
        if isinstance(error, LaunchError):  # its message starts with the kernel's name
            raise error
        raise LaunchError(f"{kernel.name}: Triton compile failed: {type(error).__name__}: {error}") from error


PARALLEL_COMPILE = True  # the kernels of a program compile on threads at its first launch


class _ArgShape:
    """What a kernel signature reads of an output buffer: its dtype and shape."""

    def __init__(self, shape, dtype):
        import numpy as np

        self.shape, self.dtype = tuple(shape), np.dtype(dtype)


class _Recorder:
    """A stand-in for ``Launch`` that records (kernel, signature) per launch."""

    def __init__(self):
        self.keys: list = []

    def empty(self, shape, dtype):
        return _ArgShape(shape, dtype)

    def __call__(self, kernel, grid, *args, **constexprs):
        key = kernel.signature(kernel.bind(args, constexprs), len(constexprs))
        if (kernel, key) not in self.keys:
            self.keys.append((kernel, key))

    def finish(self, *outputs, weak=()):
        return outputs


def submit(fn, *args, thread: str = "pallaskit-tier-up") -> concurrent.futures.Future:
    """Run ``fn(*args)`` on the background thread ``thread`` (one each: its
    compiles queue up). Speculative compiles ([Note: dynamic speculation] in
    pallaskit/dynamic.py) have a thread of their own: a second size waiting for
    one does not wait behind another function's tier-up."""
    with _lock:
        if thread not in _pools:
            _pools[thread] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=thread)
        future = _pools[thread].submit(fn, *args)
        _pending.add(future)
    future.add_done_callback(_pending.discard)
    return future


def wait_compiles(timeout: float | None = None) -> None:
    """Wait until the background choices and compiles started so far are done,
    the early PTX assemblies they queued included (exceptions there were
    logged; they never reach the caller), and XLA's autotuning ahead
    ([Note: autotuning ahead] in runtime/xla_warm.py)."""
    import time

    from pallaskit.runtime import triton_call, xla_warm

    deadline = None if timeout is None else time.monotonic() + timeout
    with _lock:
        pending = list(_pending)
    concurrent.futures.wait(pending, timeout=timeout)
    triton_call.wait_assembly(None if deadline is None else max(0.0, deadline - time.monotonic()))
    xla_warm.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))


# [Note: eager program cache]
# A symbolic signature served eagerly (static tier-up) keeps its eager program
# on disk, ``<cache_dir>/eager/<key>.json``: the Triton module's source, its
# kernels' warps and stages, the variant's hints and guards. The key is the
# graph cache's (jaxpr, avals with their symbols, static arguments, options,
# versions, pallaskit's source, device, XLA flags) plus the order the hints
# were tried in (nearest the first call's sizes first). With the compiled
# kernels kept too ([Note: kernel artifacts] in triton_launch.py), a warm
# process's first call traces, reads one file and launches: no compiler (nor
# sympy) is imported. The multi-kernel variants are then not built; a call
# under a jax transformation (or a forced variant) compiles the symbolic graph
# in full on first need (``Dispatcher.fallback``). Graphs with constants are
# not kept. A file that fails its checks is logged once and rewritten.
CACHE_FORMAT = 1


def _cache_path(key: str) -> str:
    from pallaskit import cache

    return os.path.join(cache.cache_dir(), "eager", key + ".json")


def load_cached(key: str) -> EagerProgram | None:
    import json

    from pallaskit import cache

    path = _cache_path(key)
    try:
        found = cache.read_checked(path, CACHE_FORMAT)
        if found is None:
            return None
        entry = json.loads(found[1])  # interpret mode is in the key (CompileOptions)
        program = EagerProgram(entry["source"], entry["kernels"], entry["interpret"], entry["hints"], entry["guards"])
        program.from_cache = True
        return program
    except Exception as e:  # noqa: BLE001  (unreadable, torn, foreign or stale: compile again, rewrite it)
        log.warning("pallaskit: ignoring the eager program %s (%s: %s); recompiling", path, type(e).__name__, e)
        return None


def store_cached(key: str, program: EagerProgram) -> None:
    import json

    from pallaskit import cache

    try:
        body = json.dumps({"source": program.source, "kernels": program.kernel_configs, "hints": program.hints,
                           "guards": program.guards, "interpret": program.interpret}).encode()
        cache._write_atomic(_cache_path(key), cache.pack_checked(CACHE_FORMAT, body))
        cache.evict()  # cache_max_bytes caps eager programs too
    except Exception as e:  # noqa: BLE001  (a read-only or full disk: keep running)
        log.warning("pallaskit: cannot keep the eager program %s (%s: %s)", _cache_path(key), type(e).__name__, e)
