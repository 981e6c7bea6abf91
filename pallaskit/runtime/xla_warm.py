"""XLA's autotuning of a program's matmuls and convolutions, started while its
raw-Triton kernels compile ([Note: autotuning ahead])."""
from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time

import jax
import numpy as np
from jax._src import config as jax_config

from pallaskit import signature
from pallaskit.runtime import preload

log = logging.getLogger("pallaskit")

# [Note: autotuning ahead]
# The matmuls and convolutions pallaskit leaves to XLA (externs: the GPT-2
# step's attention and projection dots, the ResNet block's convolutions) are
# autotuned by XLA when it compiles the program: cuBLAS's and cuDNN's
# algorithms timed on the device, Triton GEMM configurations compiled and
# timed. The program reaches XLA only after every raw-Triton kernel has its PTX
# (JAX's lowering waits for them), so that tuning ran after the Triton wait.
# XLA keeps its tuning results for the process (keyed by the device and the
# fused instruction), so the program's XLA part is compiled on a thread as soon
# as the schedule is known: each group of externs joined by their own edges
# (a reshape feeding a dot) that holds a matmul or a convolution (and not mostly
# other work, which would then compile twice), on parameters for what kernels
# and the caller give it, returning what the kernels and the caller read of it,
# so that XLA fuses it as in the program. It tunes them
# while Triton compiles; the program's own compile, which joins it first, finds
# them tuned. Its executable is dropped. Static single-device programs on a GPU;
# externs holding jaxprs (loops, calls), effects and attention are left out; a
# call under a thread-local jax context (``with jax.enable_x64(True)``) tunes
# in its own compile, as the thread could not trace the same program.
AUTOTUNED = frozenset({"dot_general", "conv_general_dilated"})

_threads: list[threading.Thread] = []
_threads_lock = threading.Lock()


def _plain(step, extern, jaxprs) -> bool:
    """An extern this program can replay on its own: a jax primitive of arrays
    (not a loop or an attention, the subclasses pallaskit renders; no jaxpr in
    its parameters)."""
    if type(step) is not extern:
        return False
    if step.effectful or any(isinstance(v, jaxprs) for v in step.params.values()):
        return False
    return not any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) for a in step.out_avals)


def extern_program(schedule):
    """(function, argument structs) of ``schedule``'s XLA part around its
    matmuls and convolutions, or None where it has none (or a symbolic size)."""
    preload.wait()  # the compiler's modules: imported already by the compile that made ``schedule``
    from jax.extend import core as jex_core

    from lowering import ir
    from lowering.scheduler import Kernel

    graph = schedule.graph
    plain = [s for s in schedule.steps if _plain(s, ir.Extern, (jex_core.Jaxpr, jex_core.ClosedJaxpr))]
    made_by = {o: s for s in plain for o in s.outputs}
    group = {s.name: s.name for s in plain}  # union-find over extern-to-extern edges

    def root(n):
        while group[n] != n:
            group[n] = n = group[group[n]]
        return n

    for s in plain:
        for x in s.inputs:
            if isinstance(x, str) and x in made_by:
                group[root(s.name)] = root(made_by[x].name)
    tuned, other = collections.Counter(), collections.Counter()
    for s in plain:
        (tuned if s.primitive.name in AUTOTUNED else other)[root(s.name)] += 1
    # A group mostly of other XLA work (sorts, gathers around one dot) would compile twice: left to the program
    steps = [s for s in plain if root(s.name) in tuned and other[root(s.name)] <= 2 * tuned[root(s.name)] + 4]
    if not steps:
        return None
    kept = {s.name for s in steps}
    kept_outputs = {o for s in steps for o in s.outputs}
    extern_avals = {o: a for s in schedule.steps if isinstance(s, ir.Extern) for o, a in zip(s.outputs, s.out_avals)}
    # What the rest of the program reads of this part: the program's outputs too
    read_elsewhere = {o for o in graph.outputs if isinstance(o, str)}
    for s in schedule.steps:
        if getattr(s, "name", None) in kept:
            continue
        ins = s.reads if isinstance(s, Kernel) else getattr(s, "inputs", ())
        read_elsewhere.update(x for x in ins if isinstance(x, str))
    params, structs = {}, []
    for s in steps:
        for x in s.inputs:
            if isinstance(x, str) and x not in kept_outputs and x not in params:
                a = extern_avals.get(x)
                shape, dtype = (a.shape, a.dtype) if a is not None else (graph.nodes[x].shape, graph.nodes[x].dtype)
                if not all(isinstance(d, int) for d in shape):
                    return None
                params[x] = len(structs)
                structs.append(jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)))
    returned = [o for s in steps for o in s.outputs if o in read_elsewhere]

    def run(*args):
        env = {x: args[i] for x, i in params.items()}
        for s in steps:
            ins = [env[x] if isinstance(x, str) else jax.numpy.asarray(x.value, x.dtype) for x in s.inputs]
            out = s.primitive.bind(*ins, **s.params)
            env.update(zip(s.outputs, out if s.primitive.multiple_results else [out]))
        return [env[o] for o in returned]

    return run, structs


def start(schedule) -> threading.Thread | None:
    """Compile ``schedule``'s XLA part (``extern_program``) on a thread, returned: the
    program's XLA compile joins it first (two compiles tuning one dot at once
    would time their candidates against each other on the device)."""
    try:
        made = extern_program(schedule)
    except Exception as e:  # noqa: BLE001 - the program's own compile tunes them then
        log.debug("pallaskit: no autotuning ahead (%s: %s)", type(e).__name__, e)
        return None
    if made is None:
        return None
    fn, structs = made
    context = signature.context()

    def compile_():
        if signature.context() != context:  # a thread-local jax context (enable_x64, ...) this thread lacks
            log.debug("pallaskit: no autotuning ahead (the call's jax context is thread-local)")
            return
        t = time.perf_counter()
        try:
            with _no_persistent_cache():  # the executable is dropped: not one for the user's persistent cache
                jax.jit(fn).lower(*structs).compile()
        except Exception as e:  # noqa: BLE001 - the program's own compile tunes them then
            log.debug("pallaskit: autotuning ahead failed (%s: %s)", type(e).__name__, e)
            return
        log.debug("pallaskit: the XLA part of the program (%d arguments) autotuned ahead in %.2f s", len(structs),
                  time.perf_counter() - t)

    thread = threading.Thread(target=compile_, name="pallaskit-autotune-ahead", daemon=True)
    thread.start()
    with _threads_lock:
        _threads[:] = [t for t in _threads if t.is_alive()] + [thread]
    return thread


def _no_persistent_cache():
    state = getattr(jax_config, "enable_compilation_cache", None)  # a thread-local State in jax 0.10 and 0.11
    return state(False) if callable(state) else contextlib.nullcontext()


def wait(timeout: float | None = None) -> None:
    """Wait for the compiles started so far (``pallaskit.wait_compiles``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _threads_lock:
        threads = list(_threads)
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
