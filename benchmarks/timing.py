"""Timing done one way for every backend.

Each round runs ``iters`` back-to-back calls (rotating among the input sets)
and waits for the device once at its end; the result is the median over the
rounds of the time per call. ``iters`` is chosen so a round takes about
``min_round_s``, which hides launch latency and the final synchronization.

The clock differs by framework:

- torch on CUDA: CUDA events recorded on the current stream around the round
  (device time).
- JAX: JAX exposes no device events, so the host clock runs from before the
  first call to after ``block_until_ready`` on the last output. Because calls
  are enqueued asynchronously, this is device time whenever the device is the
  bottleneck. To show when it is not, each round also records how long the
  host took to *enqueue* its calls (``host_ms``): when ``host_ms`` is close to
  ``ms``, the device was waiting on Python dispatch and the figure is a host
  figure (the report marks such rows).
- anything on the CPU: the host clock.

Profiler-based device time for JAX (parsing an XLA trace) was left out: it is
brittle across jax versions, and for the multi-kernel programs measured here
it would also hide the gaps between kernels that a user does pay. Where a
program is host-bound and a per-call device figure is still wanted (an
optimizer update over hundreds of arrays), ``kernel_ms`` sums the device time
of every CUDA kernel a call launches, through torch's profiler (CUPTI sees
XLA's launches too): a lower bound of the device time (gaps left out).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
    ms: float  # median time per call
    spread: float  # (p75 - p25) / median over rounds
    host_ms: float  # median host time to enqueue one call
    iters: int  # calls per round
    rounds: int

    @property
    def host_bound(self) -> bool:
        return self.host_ms > 0.8 * self.ms


class HostClock:
    """Host clock around the round; ``sync`` waits for the device."""

    def __init__(self, sync: Callable[[Any], None]):
        self.sync = sync

    def round(self, run: Callable[[], Any]) -> tuple[float, float]:
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        self.sync(out)
        t2 = time.perf_counter()
        return (t2 - t0) * 1e3, (t1 - t0) * 1e3


class CudaEventClock:
    """CUDA events on torch's current stream: device time."""

    def __init__(self, torch):
        self.torch = torch

    def round(self, run: Callable[[], Any]) -> tuple[float, float]:
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), (t1 - t0) * 1e3


def measure(call: Callable[[int], Any], clock, *, rounds: int = 15, min_round_s: float = 0.02,
            warmup: int = 3, min_iters: int = 5, max_iters: int = 2000) -> Timing:
    """Time ``call(i)`` (i picks the input set); the first call must already have run."""
    state = {"i": 0}

    def calls(n):
        def run():
            out = None
            for _ in range(n):
                out = call(state["i"])
                state["i"] += 1
            return out
        return run

    for _ in range(warmup):
        clock.round(calls(1))
    # The pace from a batch (one slow call must not set it), the second of two:
    # the first batch is the first time min_iters calls' outputs are alive at
    # once, and growing the allocator's pool for them made it ~5x slow on the
    # H100 (LayerNorm fwd+bwd: 5 calls a round instead of ~25, whose fixed
    # cost per round then showed as +0.08 ms a call).
    clock.round(calls(min_iters))
    one_ms = clock.round(calls(min_iters))[0] / min_iters
    iters = int(min(max_iters, max(min_iters, min_round_s * 1e3 / max(one_ms, 1e-4))))
    samples, host = [], []
    for _ in range(rounds):
        total, enqueue = clock.round(calls(iters))
        samples.append(total / iters)
        host.append(enqueue / iters)
    med = float(np.median(samples))
    p25, p75 = np.percentile(samples, [25, 75])
    return Timing(ms=med, spread=float((p75 - p25) / med) if med else 0.0, host_ms=float(np.median(host)),
                  iters=iters, rounds=rounds)


def first_result_s(fn: Callable[[], Any], sync: Callable[[Any], None]) -> tuple[Any, float]:
    """Seconds from calling ``fn`` to its result being on hand (compilation included)."""
    t0 = time.perf_counter()
    out = fn()
    sync(out)
    return out, time.perf_counter() - t0


def time_ms(step: Callable[[], Any], sync: Callable[[Any], None], rounds: int, min_round_s: float = 0.05) -> float:
    """The training-step scripts' clock (benchmarks/training_step.py, sharded_step.py, multi_device.py):
    median over rounds of the time per call; each round runs enough calls back to back to take about
    ``min_round_s`` and waits once at its end."""
    for _ in range(3):
        sync(step())
    t0 = time.perf_counter()
    sync(step())
    iters = max(1, int(min_round_s / max(time.perf_counter() - t0, 1e-6)))
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = step()
        sync(out)
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return float(np.median(samples))


def kernel_ms(call: Callable[[], Any], sync: Callable[[Any], None], calls: int = 10) -> float | None:
    """Device time of the CUDA kernels one ``call()`` launches (any framework in
    the process), summed over its kernels, mean over ``calls`` calls, through
    torch's profiler; None without torch or CUDA."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    sync(call())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            out = call()
        sync(out)
    # Host events carry no device time: summing every event's own device time is the kernels'.
    total_us = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                   for e in prof.key_averages())
    return total_us / calls / 1e3


@contextlib.contextmanager
def heuristics_set(**values):
    """``lowering.heuristics`` constants set while pallaskit compiles (its first
    call), restored after: an experiment's variant of a heuristic."""
    from lowering import heuristics

    old = {k: getattr(heuristics, k) for k in values}
    for k, v in values.items():
        setattr(heuristics, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(heuristics, k, v)
