"""Python's cyclic garbage collector paused while a program compiles.

[Note: no collections while compiling]
A cold compile allocates millions of small objects (the IR and its sympy
indices, the generated module, JAX's trace and MLIR), nearly all freed by
reference counting, and each of them counts towards the collector's next
run. A full collection walks the whole heap (JAX, sympy's caches, the
jaxpr): tenths of a second each, a few times per large program, with every
thread stopped, the raw-Triton compile threads included. So the collector is
off through a new signature's first call (``api.JitFunction._call``: JAX's
trace of the function, the cache key, pallaskit's passes, JAX's lowering of
the generated program, XLA's compile, the cache's store, the first run) and
on again after (as it was: a collector the user turned off stays off); a
cycle made meanwhile waits for the next collection. The passes and JAX's
lowering pause it themselves too, for the entry points that do not pass
through a call (``explain``, the AOT stages). With the collector on outside
the passes, a 1000-array AdamW's first call ran 520 collections, five of
them full, over a second of this CPU's time (RESULTS.md, "Session 25"); the
first full collection after the call costs what it did.
"""
from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # compiles in progress (nested, or on several threads)
_reenable = False  # was the collector on when the first of them began?


@contextlib.contextmanager
def paused():
    """The collector off for the block; on again once every block that
    paused it has ended, if it was on when the first began."""
    global _depth, _reenable
    with _lock:
        if _depth == 0:
            _reenable = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _reenable:
                gc.enable()
