"""Counters of what the compiler did (like Inductor's metrics.py)."""
from __future__ import annotations

import collections

COUNTER_NAMES = (
    "graphs_compiled",  # functions traced and compiled (one per new signature)
    "kernels_compiled",  # kernels handed to Pallas for compilation
    "generated_kernel_count",  # kernels rendered
    "fallback_count",  # extern (XLA) nodes scheduled
    "ir_nodes_before_fusion",
    "ir_nodes_after_fusion",
)

counters: collections.Counter = collections.Counter({n: 0 for n in COUNTER_NAMES})
logged_fallbacks: set[str] = set()  # primitives already named in the log


def reset():
    """Zero the counters and forget which fallbacks were logged."""
    logged_fallbacks.clear()
    counters.clear()
    counters.update({n: 0 for n in COUNTER_NAMES})
