"""Import the compiler on a thread while the user's script sets up.

[Note: compiler preload]
The compiler (``lowering``'s passes, its rule tables, sympy) is imported on
first need, so that a process whose programs all come from the on-disk cache
never imports it (lowering/__init__.py). A process that compiles paid that
import in its first call: about 0.5 s, most of a small function's cold first
call (issue 24 asks for at most 0.3 s of pallaskit's own time on top of
jax.jit's). So ``pallaskit.jit(f)`` starts importing it on a thread
(``start``), unless the cache has run ``f`` before ([Note: function markers]
in pallaskit/cache: its program is likely on disk, and a warm process should
not pay for an import it will not use). Scripts define their functions, then
build inputs and parameters; JAX's backend start and the XLA compiles of that
setup leave the GIL free, and the import runs there. If JAX has started its
backend by the time the import is done, the thread also does what that
platform's first compile would: it imports Pallas, which every generated
program imports (~0.15 s on the H100 host); on the CPU also the modules jax's
lowering of an interpreted ``pallas_call`` imports (its Mosaic interpreters,
~0.3 s); on a GPU it starts four Triton compile workers and triton's import
(``orchestrator.prepare_first_compile``): worker processes take a few tenths
of a second to start, which the passes' import used to cover, and the loader
needs triton before JAX lowers the program. Before all that it reads what the
first compile's cache key reads from disk (``orchestrator.first_compile_facts``):
on the first call, with triton's import running on its own thread, those
hundred-odd file reads took 0.4-0.5 s of the call on the H100 host, each read
waiting for the GIL.

The thread costs a call that runs while it still imports: each return of that
call to Python waits up to a switch interval for the GIL. A warm process's
first call (served from the disk cache), 0.025 s alone, took 0.06-0.25 s on
the H100 host beside the import (benchmarks/RESULTS.md, session 30), which
there takes over a second; hence the markers: a process that will likely
compile nothing starts none of it.

One importer at a time. Two threads importing modules of one package can meet
a circular wait, which Python ends with a ``_DeadlockError`` (or a partly
initialized module) in the thread that closes it. So:
- every pallaskit path that imports the compiler's modules calls ``wait()``
  first (the compile, autodiff's joint-graph passes, explain, per-shard plans,
  the options' help; on the CPU, a program loaded from the cache, which
  imports Pallas); tests/test_preload.py checks each such import;
- ``jax.extend``, which the compiler imports and which imports all its modules
  (Pallas's among them), is imported by ``start`` in the caller (~20 ms), since
  run-time paths that do not wait import it too (a GPU program loaded from the
  cache, a gradient's trace); the thread then imports no jax module but
  Pallas (and on the CPU its interpreter), which only generated programs
  import, after a wait;
- the thread imports packages before their modules (``COMPILER_MODULES``).
  Importing ``a.b`` takes ``a.b``'s lock before ``a``'s; a thread holding a
  module while waiting for its package can make the other thread's import
  fail. Packages first, a main thread entering the same package by one of its
  modules waits and the thread's own import is the one that fails (logged at
  debug level; the compile then imports what it needs). A user's own import of
  sympy's modules in that window takes the risk any two importing threads take.
A disk-cache hit on a GPU imports none of the thread's modules (an entry
rebuilt from its source waits) and does not wait: there the thread only
competes for the GIL. A fork waits for the thread
(``os.register_at_fork``): a child forked mid-import would inherit its import
locks. Option ``preload_compiler`` turns it off (``PALLASKIT_PRELOAD_COMPILER=0``).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
from typing import Callable

log = logging.getLogger("pallaskit")

# What a first compile imports (lowering/__init__.py's compile_jaxpr and what its
# passes import in turn; sympy imports sympy.tensor.tensor on its first addition),
# packages before their modules (see the note).
COMPILER_MODULES = ("sympy", "sympy.tensor.tensor", "lowering.rules", "lowering.codegen", "lowering.lower",
                    "lowering.scheduler", "lowering.combo", "lowering.codegen.program", "lowering.scan_hoist",
                    "lowering.attention", "lowering.partition")
# What every generated program imports (lowering/codegen/program.py's header).
PROGRAM_MODULES = ("jax.experimental.pallas",)
# On the CPU (interpret mode) the same: jax's lowering of ``pallas_call(interpret=True)``
# would also import the Mosaic interpreters, which pallaskit's lowering leaves
# unimported ([Note: Pallas's interpreters left unimported] in runtime/xla_args.py).
INTERPRET_MODULES = PROGRAM_MODULES

_thread: threading.Thread | None = None
_lock = threading.Lock()


def start(prepare: Callable[[], tuple], facts: Callable[[], None] | None = None) -> None:
    """Start the import thread, once per process. ``facts``: called first on
    the thread; reads what the first compile would read from disk
    (``orchestrator.first_compile_facts``). ``prepare``: called on the thread
    once JAX's backend has started; starts what the platform's first compile
    would wait for and returns the jax modules it would import
    (``orchestrator.prepare_first_compile``)."""
    global _thread
    if _thread is not None:
        return
    with _lock:
        if _thread is not None:
            return
        try:
            import jax.extend  # noqa: F401  (here, not on the thread: see "One importer at a time")

            thread = threading.Thread(target=_preload, args=(prepare, facts), name="pallaskit-compiler-import",
                                      daemon=True)
            thread.start()
        except (ImportError, RuntimeError) as e:  # another jax; no new threads (interpreter shutdown)
            log.debug("pallaskit: no compiler preload (%s: %s)", type(e).__name__, e)
            return
        _thread = thread


def started() -> bool:
    return _thread is not None


def wait() -> None:
    """Return once the import thread (if any) is done; called before a path
    imports any module the thread imports."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread() and thread.is_alive():
        thread.join()


def _preload(prepare, facts=None) -> None:
    if facts is not None:
        try:
            facts()
        except Exception as e:  # noqa: BLE001  (the first compile reads them itself and says what is wrong)
            log.debug("pallaskit: reading the first compile's facts on a thread failed (%s: %s)", type(e).__name__, e)
    try:
        for name in COMPILER_MODULES:
            _import(name)
        if _backend_started():
            for name in prepare():
                try:
                    _import(name)
                except ImportError:  # another jax: its lowering imports what it has
                    pass
    except Exception as e:  # noqa: BLE001  (the compile that needs it will say what is wrong)
        log.debug("pallaskit: preparing the compiler on a thread failed (%s: %s)", type(e).__name__, e)


def _import(name: str) -> None:
    """Import ``name`` after each of its packages, outermost first (see the note)."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        importlib.import_module(".".join(parts[:i]))


def _backend_started() -> bool:
    """Has JAX started its backends? Asked once, never starting them (that
    stays the script's to do), and never polled: a thread waking every few
    milliseconds takes the GIL from the script each time."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # another jax: skip the platform's part
        return False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=wait)
