"""A symbolic program's kernels launched outside XLA, for the first calls of a
new size (issue 4).

[Note: eager launches]
A new size of a dynamic dim costs ``jax.jit`` a trace, a lowering and an XLA
compile of a new executable (~1 s for the gelu MLP on the H100, whatever the
kernels). When every kernel of a symbolic program renders to raw Triton
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
``variant``, the usual multi-kernel choice
(forced, from disk, timed or nearest) and that variant's XLA compile. ``wait_compiles()`` waits for the background work
(benchmarks call it before timing a steady state). Why not at first sight: the
background trace and lowering hold the GIL, and the eager calls of other new
sizes then wait on it.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import linecache
import os
import threading

from pallaskit import metrics

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pending: set = set()
_lock = threading.Lock()


class EagerProgram:
    """``(*inputs) -> outputs`` through Triton launches; ``inputs`` are the
    program's (leaves, then constants)."""

    def __init__(self, program, interpret: bool, hints: tuple):
        from pallaskit.runtime.triton_launch import TritonKernel, _triton

        _triton(interpret)
        self.program = program
        self.interpret = interpret
        self.hints = hints  # the variant's size hints (for logs)
        digest = hashlib.sha256(program.source.encode()).hexdigest()[:16]
        filename = f"<pallaskit-triton-{digest}>"  # Triton reads kernel source through inspect: linecache
        linecache.cache[filename] = (len(program.source), None, program.source.splitlines(True), filename)
        namespace: dict = {"__name__": f"pallaskit_triton_{digest}"}  # Triton reads helpers' __module__
        exec(compile(program.source, filename, "exec"), namespace)
        self._launch = namespace["launch"]
        from pallaskit import cache

        artifacts = os.path.join(cache.cache_dir(), "triton_kernels") if cache.enabled() else None
        self.kernels = {k.name: TritonKernel(namespace[f"{k.name}_kernel"], num_warps=k.num_warps,
                                             num_stages=k.num_stages, cache_dir=artifacts) for k in program.kernels}

    def __call__(self, *inputs):
        from pallaskit.runtime.triton_launch import Launch

        import jax
        import jax.numpy as jnp

        metrics.counters["eager_launches"] += 1
        inputs = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in inputs]  # numpy, Python scalars
        return self._launch(Launch(interpret=self.interpret), self.kernels, *inputs)


def submit(fn, *args) -> concurrent.futures.Future:
    """Run ``fn(*args)`` on the background thread (one: compiles queue up)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pallaskit-tier-up")
        future = _pool.submit(fn, *args)
        _pending.add(future)
    future.add_done_callback(_pending.discard)
    return future


def wait_compiles(timeout: float | None = None) -> None:
    """Wait until the background choices and compiles started so far are done
    (exceptions there were logged; they never reach the caller)."""
    with _lock:
        pending = list(_pending)
    concurrent.futures.wait(pending, timeout=timeout)
