"""Timing done one way for every backend: warm up, then the median over
several rounds of many back-to-back calls, synchronizing at each round's end."""
from __future__ import annotations

import time

import numpy as np


def time_ms(fn, sync, *, rounds: int = 7, iters: int | None = None, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn()``; ``sync(out)`` waits for the device."""
    out = fn()
    sync(out)
    for _ in range(warmup):
        sync(fn())
    if iters is None:  # aim for ~20 ms per round
        t0 = time.perf_counter()
        sync(fn())
        one = max(time.perf_counter() - t0, 1e-6)
        iters = int(min(200, max(3, 0.02 / one)))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        sync(out)
        samples.append((time.perf_counter() - t0) / iters * 1e3)
    return float(np.median(samples))
