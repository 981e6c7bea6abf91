"""jax.jit's C++ dispatch in front of a ``JitFunction``.

[Note: the call fast path]
A steady-state call of a ``pallaskit.jit`` function should cost what a
``jax.jit`` call costs: the step of an optimizer over hundreds of small arrays
is host-bound, and a Python loop over the leaves (their avals, shardings, a
dict key hashing them) costs more than the dispatch itself. jax.jit's calls run
in C++ (``_jax.pjit``): it flattens the arguments, computes their signature
(dtype, shape, weak type, sharding, static arguments and jax's context) and,
for a signature it has seen, runs the executable it keeps for it; on a miss it
calls back into Python, which returns the result and, where the call can run in
C++ next time, the executable's "fast-path data".

``cpp_function`` builds one such C++ object per JitFunction whose miss callback
is pallaskit's own Python call (signatures, tracers, dynamic dims, the graph
cache, compiling). ``fastpath_data`` hands C++ the executable of a call that
went through a static program (an XLA executable taking exactly the call's
flat dynamic leaves, no hoisted constants, nothing to do after it); any other
call (a tracer, a multi-kernel dispatcher, eager launches, donated leaves
deleted by hand) returns None, so its next call comes back to Python, as jax.jit
does for what its fast path cannot take. C++'s signature is never coarser than
pallaskit's key (treedef, avals with weak types, placement, jax's trace context:
``signature.context``), so a cached signature always maps to the entry Python
chose. Where jit is disabled C++ runs the user's function itself, and under
``debug_nans`` / ``debug_infs`` jax's hook checks C++'s outputs and re-runs it
op by op (``cpp_function`` sets ``_fun``, as on jax.jit's own object).

These are jax internals (``_jax.pjit``, ``MeshExecutableFastpathData``): every
access is checked once, and where this jax differs the JitFunction keeps its
Python call (``available`` is False), which is correct and slower. Should C++
still refuse the data a miss returned, ``JitFunction.__call__`` returns the
result the Python call computed (the call is not run twice: donated buffers
are gone) and turns the fast path off for the process (``disable``).
"""
from __future__ import annotations

import functools
import logging

log = logging.getLogger("pallaskit")


@functools.lru_cache(maxsize=None)
def _internals():
    """(pjit constructor, its arguments after the static ones, fast-path data
    class, output reflattening, physical sharding, extended-dtype test), or
    None where this jax lacks one of them."""
    try:
        from jax._src import core, dtypes, sharding_impls, tree_util
        from jax._src.interpreters import pxla
        from jax._src.lib import _jax, xla_client

        fields = pxla.MeshExecutableFastpathData._fields
        want = ("xla_executable", "out_pytree_def", "in_shardings", "out_shardings", "out_avals", "out_committed",
                "kept_var_bitvec", "in_device_local_layouts", "const_args")
        if tuple(fields) != want:
            return None
        return (_jax.pjit, (pxla.JitGlobalCppCacheKeys(), tree_util.dispatch_registry, pxla.cc_shard_arg),
                pxla.MeshExecutableFastpathData, pxla.reflatten_outputs_for_dispatch,
                sharding_impls.physical_sharding, lambda a: a is not core.abstract_token and dtypes.issubdtype(
                    a.dtype, dtypes.extended), pxla.MeshExecutable, pxla.ExecuteReplicated, xla_client.ArrayImpl)
    except Exception as e:  # noqa: BLE001  (another jax: the Python call serves)
        log.debug("pallaskit: no C++ call fast path (%s: %s)", type(e).__name__, e)
        return None


_DISABLED: list = []  # why C++ refused our data once: the Python call from then on, in this process


def available() -> bool:
    return not _DISABLED and _internals() is not None


def disable(error: BaseException) -> None:
    """C++ could not take what the Python call returned (another jax's layout):
    no fast path in this process from now on, with one warning."""
    if not _DISABLED:
        _DISABLED.append(error)
        log.warning("pallaskit: jax.jit's C++ call path refused pallaskit's executable (%s: %s); calls take the "
                    "Python path from now on", type(error).__name__, error)


def cpp_function(name: str, fun, cache_miss):
    """jax.jit's C++ call object: ``cache_miss(*args, **kwargs)`` returns
    ``(outputs, fastpath_data or None, False)``; ``fun``, the user's function,
    runs op by op when jit is disabled, and again op by op when jax's
    ``debug_nans`` / ``debug_infs`` hook finds a NaN in a call's outputs (it
    reads ``_fun``, as on jax.jit's own object). None where this jax has no
    such object."""
    internals = _internals()
    if internals is None or _DISABLED:
        return None
    pjit, tail = internals[0], internals[1]
    try:
        cpp = pjit(name, fun, cache_miss, [], [], *tail)
        cpp._fun = fun
        return cpp
    except Exception as e:  # noqa: BLE001
        log.debug("pallaskit: no C++ call fast path (%s: %s)", type(e).__name__, e)
        return None


def fastpath_data(compiled, out_tree, outs):
    """C++'s data to run ``compiled`` (a ``jax.stages.Compiled`` taking the
    call's flat dynamic leaves, returning flat ``outs``) for the call's
    signature, its outputs unflattened into ``out_tree``; None where it cannot
    (another executable, effects, outputs that are not plain arrays)."""
    internals = _internals()
    if internals is None or _DISABLED:
        return None
    _, _, Data, reflatten, physical, extended, MeshExecutable, ExecuteReplicated, ArrayImpl = internals
    executable = getattr(compiled, "_executable", None)
    params = getattr(compiled, "_params", None)
    try:
        if (not isinstance(executable, MeshExecutable) or params is None or getattr(params, "is_high", False)
                or getattr(params, "const_args", None)):
            return None
        call = executable.unsafe_call
        if (not isinstance(call, ExecuteReplicated) or call.ordered_effects or call.has_unordered_effects
                or call.has_host_callbacks or getattr(executable, "_mut", None)):
            return None
        flat, tree = reflatten(out_tree, list(outs))
        if not all(isinstance(x, ArrayImpl) for x in flat):
            return None
        # One bit per flat argument, as jax.jit's own: ``in_avals`` holds only the kept
        # ones, so an unused argument (pruned by XLA) made C++ pass too few.
        kept = [i in executable._kept_var_idx for i in range(compiled.in_tree.num_leaves)]
        in_shardings = [physical(a, s) if extended(a) else s
                        for s, a in zip(executable._in_shardings, executable.in_avals)]
        return Data(executable.xla_executable, tree, in_shardings, executable._out_shardings,
                    [x.aval for x in flat], [x._committed for x in flat], kept, executable._dispatch_in_layouts, [])
    except Exception as e:  # noqa: BLE001  (an attribute this jax lacks: the call stays in Python)
        log.debug("pallaskit: no C++ fast path for this call (%s: %s)", type(e).__name__, e)
        return None
