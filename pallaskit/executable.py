"""What runs one compiled signature.

Every runnable thing pallaskit makes is called the same way,
``executable(*flat_dynamic_leaves, *constants) -> flat outputs`` (the
``Executable`` protocol), and kept in a ``Compiled`` record with what
``explain`` and the stages read (the ``CompileResult``, the jaxpr, the output
pytree, guards). Three kinds implement it:

- a static XLA program: ``jax.stages.Compiled`` of the generated program
  (``aot_compile``), or one loaded from the graph cache (``deserialize``,
  ``from_entry``), or ``jit`` of it where it is compiled lazily (``explain``,
  a symbolic graph with one variant);
- the multi-kernel dispatcher of a symbolic graph (``runtime/multikernel.py``:
  its variants, its eager program and background tier-up, all given to its
  constructor);
- the eager program of raw Triton launches (``runtime/eager.py``), which only
  the dispatcher calls.

``pallaskit/compile.py`` makes them; ``JitFunction`` calls them. This module
imports neither, nor the cache: the cache stores bytes, this module turns
them into executables and back.
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any, Callable, Protocol

import jax
import numpy as np
from jax.experimental import serialize_executable

from pallaskit import sharding
from pallaskit.config import config
from pallaskit.runtime import gc_pause, xla_args


class Executable(Protocol):
    """``(*flat dynamic leaves, *constants) -> flat outputs``."""

    def __call__(self, *flat_args) -> Any: ...


@dataclasses.dataclass
class Compiled:
    """One compiled signature."""

    result: Any  # lowering.CompileResult; None when served from a cache without running the compiler
    jaxpr: Any
    executable: Executable  # flat dynamic leaves, then constants -> flat outputs
    constants: list
    out_tree: Any
    ran: bool = False
    # A symbolic graph ([Note: dynamic dims]): checks of the dim values (code
    # objects over the symbols' names), all true for the program to be right.
    guards: list = dataclasses.field(default_factory=list)
    # Donated leaves the executable does not donate itself (a dispatcher of
    # variants, eager launches): deleted after each call, as jax.jit's donation does.
    delete_after: tuple = ()
    # Which of them a call deletes, by the call's avals ([Note: donation without XLA's aliasing]).
    donation: dict = dataclasses.field(default_factory=dict)
    # A symbolic graph: the differences of the symbolic sizes the trace took as
    # unequal; each must be nonzero at a call's sizes ([Note: shape equality guards]).
    shape_guards: list = dataclasses.field(default_factory=list)


# [Note: command buffers]
# A program pallaskit compiles has 1-3 kernels, often with XLA's library calls
# (cuBLAS) between them. XLA runs a program of 5 or more kernels as a command
# buffer (a CUDA graph: one launch per call), smaller ones as separate
# launches. At the sizes where a call is host-bound (the dynamic MLP sweep
# below ~2500 rows on the H100) one graph launch costs less host time than 2-3
# launches: option ``command_buffers`` (default on) compiles every GPU
# executable with ``xla_gpu_graph_min_graph_size=1`` (figures in
# benchmarks/RESULTS.md, "Command buffers"). The options are in the cache key.
GRAPH_OPTIONS = {"xla_gpu_graph_min_graph_size": 1}


# Option ``deterministic_scatter``: the scatters pallaskit would run with
# atomics in an order-dependent way run through XLA, and XLA itself picks its deterministic scatter (and
# GEMM, convolution) implementations ([Note: atomic scatters] in lowering/ir.py).
DETERMINISTIC_OPTIONS = {"xla_gpu_exclude_nondeterministic_ops": True}


def compiler_options(platform: str | None = None) -> dict:
    """XLA compiler options of pallaskit's executables for ``platform`` (default:
    the default device's) under the current options ([Note: command buffers])."""
    platform = platform or jax.devices()[0].platform
    if platform != "gpu":
        return {}
    options = dict(GRAPH_OPTIONS) if config.command_buffers else {}
    if config.deterministic_scatter:
        options.update(DETERMINISTIC_OPTIONS)
    return options


def jit(call, xla=None, n_constants: int = 0):
    """``jax.jit(call)`` with pallaskit's compiler options where it runs at top
    level; traced inside another ``jax.jit`` (a staged call, a transformation),
    the outer compilation's options apply: JAX takes ``compiler_options`` on a
    top-level jit only. ``xla``: the signature's donation and shardings
    ([Note: XLA arguments] in runtime/xla_args.py; ``n_constants`` trailing
    inputs are hoisted constants)."""
    options = compiler_options()
    if options:
        return _TopLevelJit(call, options, xla, n_constants)
    return xla_args.jit(call, xla, n_constants)


class _TopLevelJit:
    """``call`` jitted twice: with ``options`` for concrete arguments, without
    for tracers (see ``jit``)."""

    def __init__(self, call, options: dict, xla=None, n_constants: int = 0):
        self.top = xla_args.jit(call, xla, n_constants, compiler_options=options)
        self.nested = xla_args.jit(call, xla, n_constants)

    def __call__(self, *args):
        if any(isinstance(a, jax.core.Tracer) for a in args):
            return self.nested(*args)
        return self.top(*args)


class Placed:
    """A sharded signature's program, not yet lowered (``pallaskit.stages``):
    ``lower`` lowers it for the placement's shardings, as a call would."""

    def __init__(self, call, xla):
        self.call, self.xla = call, xla

    def lower(self, *structs_and_constants):
        constants = structs_and_constants[len(self.xla.placed.placement):]
        with gc_pause.paused():  # [Note: no collections while compiling]
            return xla_args.lower(self.call, self.xla.placed.structs(), constants, self.xla)

    def replicated(self):
        """Where its hoisted constants go."""
        return self.xla.placed.replicated()


def aot_compile(call, structs, constants, xla=None, while_compiling: Callable | None = None,
                before_xla: Callable | None = None):
    """The generated program's ``call`` compiled by XLA now (a
    ``jax.stages.Compiled``). ``xla``: the signature's donation and shardings,
    a sharded signature's placement included ([Note: XLA arguments] in
    runtime/xla_args.py). ``while_compiling``: called before JAX lowers the
    program, whose wait for its raw-Triton kernels and XLA's compile after it
    leave the GIL free for a thread it starts. ``before_xla``: called between
    JAX's lowering and XLA's compile ([Note: autotuning ahead])."""
    if while_compiling is not None:
        try:
            while_compiling()
        except Exception as e:  # noqa: BLE001  (work beside the compile: its failure is not the program's)
            logging.getLogger("pallaskit").debug("pallaskit: work started beside XLA's compile failed (%s: %s)",
                                                 type(e).__name__, e)
    with gc_pause.paused():  # JAX traces and lowers the program ([Note: no collections while compiling])
        lowered = xla_args.lower(call, structs, constants, xla)
    if before_xla is not None:
        before_xla()
    return lowered.compile(compiler_options=compiler_options() or None)


def on_device(constants, where=None) -> list:
    """Hoisted constants, put on the device once rather than at every call
    (``where``: a sharded program's replicated sharding)."""
    return [jax.device_put(c if is_key(c) else np.asarray(c), where) for c in constants]


_TRACER = getattr(jax.core, "Tracer", ())


def uncommitted(constants) -> list:
    """Hoisted constants as jax.jit takes a function's closed-over arrays: they
    place nothing. An array committed to another device, or sharded over a mesh,
    would otherwise move the program there (its outputs committed to that
    device), and its executable would name devices that a cache entry cannot
    load in the next process. A constant already uncommitted stays as it is."""
    out = []
    for c in constants:
        if isinstance(c, jax.Array) and not isinstance(c, _TRACER) and getattr(c, "committed", False) \
                and getattr(c, "is_fully_addressable", True):  # another host's shards stay where they are
            if is_key(c):
                c = jax.random.wrap_key_data(np.asarray(jax.random.key_data(c)), impl=jax.random.key_impl(c))
            else:
                c = jax.device_put(np.asarray(c))
        out.append(c)
    return out


def is_key(c) -> bool:
    """A typed PRNG key array (``jax.random.key``), which has no NumPy form."""
    dtype = getattr(c, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


def serialize(compiled) -> tuple[bytes | None, Any, Any, str]:
    """(payload, in_tree, out_tree, error) of a ``jax.stages.Compiled``."""
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        pickle.dumps((in_tree, out_tree))
        return payload, in_tree, out_tree, ""
    except Exception as e:  # noqa: BLE001 - fall back to caching the source
        return None, None, None, f"{type(e).__name__}: {e}"


def device_ids(compiled) -> list | None:
    """The ids of a ``jax.stages.Compiled``'s devices, in its assignment order (None where unknown)."""
    try:
        return [d.id for d in compiled.runtime_executable().local_devices()]
    except Exception:  # noqa: BLE001  (another jax's executable: loaded as before, on the known devices)
        return None


def _devices_of(ids) -> list:
    """The devices of these ids on the default device's platform (KeyError: an id it lacks)."""
    by_id = {d.id: d for d in sharding.default_device().client.devices()}
    return [by_id[i] for i in ids]


def deserialize(payload: bytes, in_tree, out_tree, devices=None):
    devices = devices or [sharding.default_device()]
    if devices[0].platform == "gpu":  # the executable may name pallaskit's Triton target
        from pallaskit.runtime import ffi_targets

        ffi_targets.triton_target()
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree, backend=devices[0].client,
                                                     execution_devices=devices)


class _Program:  # what runtime.loader.load reads from a RenderedProgram
    def __init__(self, source):
        self.source, self.externs = source, []


def from_entry(entry, structs, xla=None, load_program: Callable | None = None):
    """(executable, constants on the device) of a graph cache entry, or None
    where it holds source only and cannot be rebuilt without the compiler
    (externs). Raises where its executable does not load (a bad entry).
    ``load_program``: a RenderedProgram -> its ``call`` (runtime/loader.py's
    ``load``) for a source-only entry, which XLA then compiles again."""
    placed = xla.placed if xla else None
    where = placed.replicated() if placed is not None else None
    if entry.executable is not None:
        if getattr(entry, "devices", None):
            devices = _devices_of(entry.devices)
        else:
            devices = placed.devices() if placed is not None else None
        return deserialize(entry.executable, entry.in_tree, entry.out_tree, devices), on_device(entry.constants, where)
    if entry.has_externs or load_program is None:
        return None  # extern callables are rebuilt by the compiler: recompile
    compiled = aot_compile(load_program(_Program(entry.source)), structs, entry.constants, xla)
    return compiled, on_device(entry.constants, where)
