"""Multi-kernel dispatch for symbolic (dynamic-dim) graphs.

[Note: multi-kernel]
A symbolic graph is compiled once per hinted size (option
``multi_kernel_hints``): each *variant* is a whole program whose kernels all
take their tiles, warps, persistent-or-looped choice... from the heuristics at
that size. In one symbolic graph every kernel iterates the same dynamic dims,
so the hint that suits one kernel suits the others, and a whole program per
hint is also what JAX builds anyway (one XLA executable per concrete size and
variant). Variants with identical source are merged (keeping each source's
first hint), so a program whose tiles do not depend on the size has one
variant and no dispatcher.

``Dispatcher`` is the symbolic ``Compiled`` entry's executable. Per call it
reads the shape key (the symbols' values, from known (leaf, axis) positions)
and looks the variant up in a dict; the first call of a key selects one:
the forced index (option ``multi_kernel_force``), else the disk choice cache,
else a choice: on a GPU (not interpret mode) each variant is timed on the real
arguments (one warm-up call, which also compiles it for this size, the
variants' warm-ups in parallel threads; then the median of ``TIMED_RUNS``
calls, host wall clock around ``jax.block_until_ready``); in interpret mode
(the CPU) the variant of the nearest hint by log distance, untimed. A choice
is kept in memory, written to ``<cache_dir>/multi_kernel/<digest>.json``
(digest: sha256 of the variants' sources and the device kind), logged as a
``multi_kernel_choices`` metric row and counted (counter ``multi_kernel_choices``).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import os
import statistics
import time
from typing import Callable

import jax

from pallaskit import metrics
from pallaskit.config import config

log = logging.getLogger("pallaskit")

TIMED_RUNS = 5
FORMAT = 1


@dataclasses.dataclass
class Variant:
    hints: list  # the hint tuples ((symbol, size), ...) that produced this source, first its own
    fn: Callable  # jax.jit of the program's ``call``
    constants: list
    source: str
    kernel_sources: list  # to count distinct kernels compiled across variants


def log_distance(hints, key: dict) -> float:
    """Sum over symbols of |log size - log hint|: how far a hint tuple
    ((symbol, size), ...) is from ``key`` ({symbol: size})."""
    return sum(abs(math.log(key[s]) - math.log(h)) for s, h in hints if s in key)


def nearest(variants: list[Variant], key: dict) -> int:
    """Index of the variant holding the hint nearest ``key`` ({symbol: size})
    by ``log_distance``; ties go to the first."""
    best, best_d = 0, math.inf
    for i, v in enumerate(variants):
        for hints in v.hints:
            d = log_distance(hints, key)
            if d < best_d - 1e-12:
                best, best_d = i, d
    return best


def _choice_dir() -> str:
    from pallaskit import cache

    return os.path.join(cache.cache_dir(), "multi_kernel")


def disk_enabled() -> bool:
    """The choice cache is on disk when ``multi_kernel_disk_cache`` and the
    graph cache option ``cache`` are both on (cache off: nothing on disk)."""
    return bool(config.multi_kernel_disk_cache and config.cache)


class Dispatcher:
    """Callable as the program: ``(*leaves, *constants) -> outputs``; the
    constants passed are the first variant's and are replaced by the chosen one's."""

    def __init__(self, title: str, symbols: list[str], positions: list[tuple[int, int]], n_leaves: int,
                 variants: list[Variant], interpret: bool, *, eager=None, eager_constants=(), fallback=None,
                 compile_static=None):
        self.title = title
        self.symbols = list(symbols)
        self.positions = list(positions)  # (leaf, axis) of each symbol
        self.n_leaves = n_leaves
        self.variants = variants
        self.interpret = interpret
        # A program with effects (a debug print, a callback) runs once per call: its
        # variants are not run for timing. The renderer marks such externs "# effect:".
        self.effectful = any("# effect: " in v.source for v in variants)
        self.chosen: dict = {}  # shape key -> variant index
        self.eager = eager  # EagerProgram serving keys with no compiled variant yet ([Note: eager launches])
        self.eager_constants: list = list(eager_constants)
        self.sightings: dict = {}  # shape key -> eager calls so far
        self.tier_up_errors: dict = {}  # shape key -> why its background choice failed (it stays eager)
        # leaves -> (executable, constants) of their static program (option dynamic_tier_up)
        self.compile_static = compile_static
        self.static: dict = {}  # shape key -> (executable, constants) compiled by compile_static
        self.fallback = fallback  # () -> the symbolic graph's Compiled in full, when built without variants
        self._fallback_entry = None
        self._eager_ran = False  # the eager program's kernels counted in kernels_compiled
        self.methods: dict = {}  # shape key -> how it was chosen (for tests and debugging)
        self._ran = False  # kernels_compiled counted
        self._warned = False
        try:
            device = jax.devices()[0].device_kind
        except Exception:  # noqa: BLE001
            device = "?"
        h = hashlib.sha256(f"{FORMAT}\0{device}\0{int(interpret)}".encode())
        for v in variants:
            h.update(b"\0variant\0" + v.source.encode())
        self.digest = h.hexdigest()

    # -- per call ---------------------------------------------------------------
    def __call__(self, *args):
        leaves = args[:self.n_leaves]
        key = self.shape_key(leaves)
        static = self.static.get(key)
        if static is not None:  # a recurring size's static program (runtime/eager.py)
            return static[0](*leaves, *static[1])
        index = self.chosen.get(key)
        if index is None:
            if self.eager is not None and not any(isinstance(x, jax.core.Tracer) for x in leaves):
                return self._eager_call(key, leaves)
            if not self.variants:  # served from the eager program cache: compile in full now
                return self._full(leaves)
            index = self.select(key, leaves)
        v = self.variants[index]
        if not self._ran:
            # kernels_compiled: the distinct kernels of all variants, once (so it
            # does not grow over sizes, as for a one-variant symbolic graph).
            self._ran = True
            metrics.counters["kernels_compiled"] += len({s for w in self.variants for s in w.kernel_sources})
        return v.fn(*leaves, *v.constants)

    def shape_key(self, leaves) -> tuple:
        return tuple(int(leaves[l].shape[a]) for l, a in self.positions)

    def _key_text(self, key: tuple) -> str:
        return ",".join(f"{s}={n}" for s, n in zip(self.symbols, key))

    # -- choosing -----------------------------------------------------------------
    # -- eager launches ([Note: eager launches] in runtime/eager.py) ------------------
    def _full(self, leaves):
        """The symbolic graph compiled in full (``fallback``), for what the eager
        program alone cannot serve (runtime/eager.py, [Note: eager program cache])."""
        if self._fallback_entry is None:
            self._fallback_entry = self.fallback()
        entry = self._fallback_entry
        return entry.executable(*leaves, *entry.constants)

    def _eager_call(self, key: tuple, leaves):
        if self.variants and config.multi_kernel_force >= len(self.variants):
            self.select(key, leaves)  # raises: the forced index is out of range
        seen = self.sightings.get(key, 0) + 1
        self.sightings[key] = seen
        if seen == 2 and key not in self.tier_up_errors:  # the size recurs: compile for it in the background
            from pallaskit.runtime import eager

            eager.submit(self._tier_up, key, leaves)
        if not self._ran:
            self._ran = True
            metrics.counters["kernels_compiled"] += len({s for w in self.variants for s in w.kernel_sources})
        if not self._eager_ran:
            self._eager_ran = True
            if not self.eager.from_cache:
                metrics.counters["kernels_compiled"] += len(self.eager.kernels)
        try:
            return self.eager(*leaves, *self.eager_constants)
        except Exception as e:  # noqa: BLE001  (never break a call jax.jit runs: take the XLA path)
            if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
                raise  # the caller's error (a donated array passed again), raised as jax.jit does; launches stay on
            log.warning("pallaskit: %s: eager launch failed (%s: %s); running it through XLA from now on",
                        self.title, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.eager = None
            return self(*leaves)

    def _tier_up(self, key: tuple, leaves) -> None:
        """Background: compile the key's static program (``compile_static``), or
        choose the key's variant and compile it for the key's sizes and record
        the choice; later calls of the key take it."""
        from pallaskit.runtime import xla_args

        try:
            if self.compile_static is not None:
                with xla_args.donation_warned():  # the size's eager calls warned of unusable donations
                    self.static[key] = self.compile_static(leaves)  # compiled ahead of time: ready to run
                return
            index, method, timings = self._choose(key, leaves)
            v = self.variants[index]
            jax.block_until_ready(v.fn(*leaves, *v.constants))  # XLA's compile for these sizes
            self._record(key, index, method, timings)
        except Exception as e:  # noqa: BLE001  (the key keeps running eagerly)
            self.tier_up_errors[key] = f"{type(e).__name__}: {e}"
            log.warning("pallaskit: %s: compiling %s in the background failed (%s); it keeps running eagerly",
                        self.title, self._key_text(key), self.tier_up_errors[key])

    def select(self, key: tuple, leaves) -> int:
        """The variant for a shape key seen for the first time: forced, from
        disk, or chosen; recorded in memory (and on disk when chosen)."""
        index, method, timings = self._choose(key, leaves)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):  # under a transformation: no record
            return index
        self._record(key, index, method, timings)
        return index

    def _choose(self, key: tuple, leaves) -> tuple[int, str, list | None]:
        n = len(self.variants)
        timings = None
        force = config.multi_kernel_force
        traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
        if force >= 0:
            if force >= n:
                raise ValueError(f"pallaskit option multi_kernel_force={force}, but {self.title} has {n} "
                                 f"multi-kernel variant(s) (indices 0..{n - 1}; hints "
                                 f"{', '.join(self.hint_text(i) for i in range(n))})")
            index, method = force, "forced"
        else:
            index = None
            use_disk = disk_enabled() and not traced
            if use_disk:
                index = self._read().get(self._key_text(key))
                method = "disk"
            if index is None:
                if self.interpret or traced or self.effectful:
                    index, method = nearest(self.variants, dict(zip(self.symbols, key))), "nearest_hint"
                else:
                    timings = self._time(leaves)
                    index, method = min(range(n), key=lambda i: timings[i]), "benchmark"
                if use_disk:
                    self._write(self._key_text(key), index)
        return index, method, timings

    def _record(self, key: tuple, index: int, method: str, timings) -> None:
        n = len(self.variants)
        self.chosen[key] = index
        self.methods[key] = method
        metrics.counters["multi_kernel_choices"] += 1
        metrics.log_row("multi_kernel_choices", kernel_name=self.title, shape_key=self._key_text(key),
                        num_variants=n, chosen_variant=index,
                        timings_ms=";".join(f"{t:.4f}" for t in timings) if timings else "", method=method)
        log.debug("pallaskit: %s: %s -> variant %d (%s, %s)", self.title, self._key_text(key), index,
                  self.hint_text(index), method)

    def hint_text(self, i: int) -> str:
        return "/".join(",".join(f"{s}={h}" for s, h in hints) for hints in self.variants[i].hints)

    def _time(self, leaves) -> list[float]:
        # Warm-up: one call of each variant compiles it for this size. The calls run
        # in threads, so XLA compiles the variants at once (its compiler releases
        # the GIL) and a new size waits for the slowest compile, not the sum
        # (RESULTS.md, "Dynamic dims and multi-kernel"). Then the variants are timed one after another.
        with concurrent.futures.ThreadPoolExecutor(len(self.variants)) as pool:
            list(pool.map(lambda v: jax.block_until_ready(v.fn(*leaves, *v.constants)), self.variants))
        out = []
        for v in self.variants:
            runs = []
            for _ in range(TIMED_RUNS):
                t0 = time.perf_counter()
                jax.block_until_ready(v.fn(*leaves, *v.constants))
                runs.append((time.perf_counter() - t0) * 1e3)
            out.append(statistics.median(runs))
        return out

    # -- the disk choice cache -------------------------------------------------------
    def path(self) -> str:
        return os.path.join(_choice_dir(), self.digest + ".json")

    def _read(self) -> dict:
        """{key text: index} from disk; {} when absent; a corrupt or unreadable
        file is logged (once per dispatcher) and ignored."""
        path = self.path()
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read().decode())
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("choices"), dict):
                raise ValueError("not a choice file of this format")
            choices = data["choices"]
            if not all(isinstance(k, str) and isinstance(i, int) and not isinstance(i, bool)
                       and 0 <= i < len(self.variants) for k, i in choices.items()):
                raise ValueError("a choice out of range")
            return choices
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, UnicodeDecodeError) as e:
            if not self._warned:
                self._warned = True
                log.warning("pallaskit: ignoring the multi-kernel choice file %s (%s: %s); it will be rewritten",
                            path, type(e).__name__, e)
            return {}

    def _write(self, key_text: str, index: int):
        """Add one choice to the file: re-read under a lock (other processes'
        choices are kept), then write atomically. Failures are logged, never raised."""
        from pallaskit import cache

        try:
            with cache._lock("multi_kernel-" + self.digest[:2]):
                choices = dict(self._read())
                choices[key_text] = index
                data = {"format": FORMAT, "title": self.title, "symbols": self.symbols,
                        "hints": [self.hint_text(i) for i in range(len(self.variants))], "choices": choices}
                cache._write_atomic(self.path(), json.dumps(data, sort_keys=True, indent=1).encode())
        except Exception as e:  # noqa: BLE001  (a read-only or full disk, a lock timeout: keep running)
            if not self._warned:
                self._warned = True
                log.warning("pallaskit: cannot write the multi-kernel choice file %s (%s: %s)", self.path(),
                            type(e).__name__, e)
