"""The suite: every workload under every backend, in one run, on the same inputs.

``run(cfg)`` measures and writes the outputs; ``benchmarks/run.py`` is the
absl app that builds ``cfg`` from flags. For each workload and dtype:

1. inputs are made once, with fresh random data (the run's seed is recorded),
   plus more sets when one set would fit in L2 (hardware.input_sets);
2. a float32 reference is computed by jax.jit on the inputs upcast to float32;
3. each backend runs the first set; its outputs must agree with the reference
   (dtype-fit tolerances, ``agreement``) before anything is timed: a backend
   that disagrees is reported as ``mismatch`` and not timed;
4. timing.measure times it; the result is shown as a fraction of its floor
   (hardware.floor_ms).

``sweep`` and ``first_call`` workloads run in fresh subprocesses
(benchmarks/first_call.py), so compilation caches and imports start cold.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import gc
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

import pallaskit
from benchmarks import hardware, report, timing
from benchmarks.check import agreement, reference, seed_of
from benchmarks.backends import BACKENDS, Context, Unavailable
from benchmarks.workloads import (FIRST_CALL, HINT_RUNTIME, STEADY, SWEEP, WORKLOADS, bytes_moved,
                                  format_size, parse_size)

DTYPES = ("bfloat16", "float16", "float32")
SIZE_PRESETS = ("full", "smoke")
STAGED_CALLS = 10  # calls per jax.jit when a JAX row is re-timed for device time
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



@dataclasses.dataclass
class SuiteConfig:
    workloads: list
    backends: list
    dtypes: list = dataclasses.field(default_factory=lambda: ["bfloat16"])
    sizes: dict = dataclasses.field(default_factory=dict)  # workload -> size; missing: the preset's
    size_preset: str = "full"
    repeats: int = 15
    min_round_s: float = 0.02
    warmup: int = 3
    output: str = "benchmarks/out"
    results_md: str | None = None  # file whose suite section is rewritten; None: none
    plots_dir: str | None = None  # None: <output>/plots
    plots: bool = True
    seed: int = 0  # 0: a fresh seed, recorded in the results
    smoke: bool = False
    progress: bool = True
    allow_cpu_compile: bool = False
    subprocess_timeout_s: float = 300.0
    jobs: int = 1  # subprocesses run at once (only sensible on the CPU)
    time_budget_s: float = 0.0  # > 0: start no new workload after this many seconds
    command: str = ""

    def size(self, workload):
        return self.sizes.get(workload.name, workload.sizes[self.size_preset])


# -- validation -----------------------------------------------------------------------
def resolve(requested, valid, what: str) -> list[str]:
    """Names as given, with 'all' expanded; an unknown name is an error listing the valid ones."""
    out = []
    for name in requested:
        name = name.strip()
        if not name:
            continue
        if name == "all":
            out += [v for v in valid if v not in out]
        elif name not in valid:
            raise ValueError(f"unknown {what} {name!r}; valid {what}s: {', '.join(valid)} (or 'all')")
        elif name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"no {what} selected; valid {what}s: {', '.join(valid)}")
    return out


def parse_sizes(specs) -> tuple[str, dict]:
    """['full'] / ['smoke'] / ['full', 'softmax=4096x4096', ...] -> (preset, {workload: size})."""
    preset, overrides = None, {}
    for spec in specs:
        spec = spec.strip()
        if not spec:
            continue
        if "=" in spec:
            name, text = spec.split("=", 1)
            resolve([name], list(WORKLOADS), "workload")
            try:
                size = parse_size(text)
                WORKLOADS[name].cases(size)
            except ValueError as e:
                raise ValueError(f"bad size {spec!r}: {e}; sizes look like 576000x384 "
                                 f"(lists of runtime sizes: 64:256:4096x8192x8192)") from None
            overrides[name] = size
        elif spec in SIZE_PRESETS:
            preset = spec
        else:
            raise ValueError(f"unknown size preset {spec!r}; valid: {', '.join(SIZE_PRESETS)}, "
                             f"or WORKLOAD=AxB overrides")
    return preset or "full", overrides


# -- the run --------------------------------------------------------------------------
class Progress:
    """A tqdm bar when tqdm is installed and asked for; lines are printed either way."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="case", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def step(self, desc: str = ""):
        if self.bar is not None:
            self.bar.set_description(desc[:40])
            self.bar.update(1)

    def print(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


class Suite:
    def __init__(self, cfg: SuiteConfig):
        self.cfg = cfg
        self.ctx = Context(platform=jax.default_backend(), allow_cpu_compile=cfg.allow_cpu_compile)
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.seed = cfg.seed or int.from_bytes(os.urandom(4), "little") % (2 ** 31 - 1) + 1
        self.progress: Progress | None = None

    # -- bookkeeping --
    def note(self, text: str):
        if text not in self.notes:
            self.notes.append(text)

    def add(self, **row):
        base = dict(workload="", kind="", dtype="", size="", backend="", case="", hint="", runtime="",
                    metric="", value=None, unit="", floor=None, frac_of_floor=None, rel_err=None,
                    status="ok", first_call_s=None, host_ms=None, spread=None, iters=None, note="")
        base.update(row)
        if base["floor"] and base["value"] and base["status"] == "ok":
            base["frac_of_floor"] = base["floor"] / base["value"]
        self.rows.append(base)
        self.progress.print(report.row_line(base))

    def key(self, *parts) -> jax.Array:
        k = jax.random.key(self.seed)
        for p in parts:
            k = jax.random.fold_in(k, seed_of(p))
        return k

    def backends_for(self, workload, only_compiling=False):
        out = []
        for name in self.cfg.backends:
            b = BACKENDS[name]
            if not b.applies_to(workload):
                continue
            if only_compiling and not b.compiles:
                continue
            out.append(b)
        return out

    def free(self):
        if not self.ctx.on_gpu:
            return  # memory only matters on the GPU (gc.collect costs ~0.1 s)
        gc.collect()
        if "torch" in sys.modules:
            torch = sys.modules["torch"]
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def dtypes_for(self, workload) -> list[str]:
        """The run's dtypes this workload has; one that has none of them (the optimizer's float32
        state) runs once in its own first dtype rather than not at all."""
        mine = [d for d in self.cfg.dtypes if d in workload.dtypes]
        for d in self.cfg.dtypes:
            if d not in workload.dtypes:
                self.note(f"{workload.name}: no {d} version" + ("" if mine else f"; runs in {workload.dtypes[0]}"))
        return mine or [workload.dtypes[0]]

    # -- inputs --
    def input_sets(self, workload, size, dtype, label=""):
        first = workload.make_inputs(size, jnp.dtype(dtype), self.key(workload.name, dtype, label, 0))
        n = hardware.input_sets(bytes_moved(first))
        if not self.ctx.on_gpu:
            n = min(n, 2)  # nothing to keep out of a CPU cache in interpret mode; keep the path exercised
        sets = [first] + [workload.make_inputs(size, jnp.dtype(dtype), self.key(workload.name, dtype, label, i))
                          for i in range(1, n)]
        jax.block_until_ready(sets)
        return sets

    def floor(self, workload, size, dtype, inputs) -> float:
        outputs = jax.eval_shape(workload.jax_fn, *inputs)
        flops = workload.flops(size) if workload.flops else 0
        return hardware.floor_ms(bytes_moved(inputs) + bytes_moved(outputs), flops, dtype)

    # -- one backend on one case --
    def measure(self, backend, runner, wl, sets, ref, floor, **row):
        """First call, agreement, timing; adds the row."""
        dtype = row["dtype"]
        native = [runner.prepare(s) for s in sets]
        out, first_s = timing.first_result_s(lambda: runner.call(native[0]), runner.sync)
        err, why = agreement(runner.leaves(out), ref, dtype, wl.tol)
        del out
        if why is not None:
            case = f" {row['case']}" if row.get("case") else ""
            self.note(f"{wl.name}/{dtype}/{backend.name}{case}: MISMATCH, not timed: {why}")
            self.add(backend=backend.name, status="mismatch", rel_err=err, first_call_s=first_s, floor=floor,
                     metric="ms", unit="ms", note=why, **row)
            return
        if runner.settle is not None:  # background compiles land first (a recurring size's tier-up)
            runner.settle(native[0])
        t = timing.measure(lambda i: runner.call(native[i % len(native)]), runner.clock, rounds=self.cfg.repeats,
                           min_round_s=self.cfg.min_round_s, warmup=self.cfg.warmup)
        note = "host-bound: the device waited on dispatch" if t.host_bound and self.ctx.on_gpu else ""
        ms = t.ms
        if t.host_bound and self.ctx.on_gpu and runner.staged is not None:
            # Device time: STAGED_CALLS calls (rotating the input sets) in one
            # jax.jit, one dispatch; the figure alone is the host's.
            batch = [native[i % len(native)] for i in range(STAGED_CALLS)]
            ts = timing.measure(lambda i: runner.staged(batch), runner.clock, rounds=self.cfg.repeats,
                                min_round_s=self.cfg.min_round_s, warmup=self.cfg.warmup)
            ms = ts.ms / STAGED_CALLS
            note = f"device time of {STAGED_CALLS} calls in one jax.jit; called alone {t.ms:.4f} ms (host-bound)"
        self.add(backend=backend.name, metric="ms", unit="ms", value=ms, floor=floor, rel_err=err,
                 first_call_s=first_s, host_ms=t.host_ms, spread=t.spread, iters=t.iters, note=note, **row)

    def failed(self, backend, e, **row):
        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        self.note(f"{row['workload']}/{row['dtype']}/{backend.name}: FAILED: {msg}")
        self.add(backend=backend.name, status="failed", note=msg, **row)

    def skipped(self, backend, why: str):
        self.note(f"{backend.name}: skipped: {why}")

    # -- kinds --
    def run_steady(self, workload, dtype):
        size = self.cfg.size(workload)
        sets = self.input_sets(workload, size, dtype)
        ref = reference(workload, sets[0])
        floor = self.floor(workload, size, dtype, sets[0])
        common = dict(workload=workload.name, kind=STEADY, dtype=dtype, size=format_size(size))
        for backend in self.backends_for(workload):
            self.progress.step(f"{workload.name} {backend.name}")
            try:
                runner = backend.runner(workload, self.ctx)
            except Unavailable as e:
                self.skipped(backend, str(e))
                continue
            try:
                self.measure(backend, runner, workload, sets, ref, floor, **common)
            except Exception as e:  # one broken backend must not hide the others
                self.failed(backend, e, **common)
            del runner
            self.free()

    def run_hint_runtime(self, workload, dtype):
        size = self.cfg.size(workload)
        cases = workload.cases(size)
        hints = workload.hints(size)
        prepared = []
        for label, case_size in cases:
            sets = self.input_sets(workload, case_size, dtype, label)
            prepared.append((label, case_size, sets, reference(workload, sets[0]),
                             self.floor(workload, case_size, dtype, sets[0])))
        for backend in self.backends_for(workload):
            plan = [("static", None)]
            if backend.hinted:
                plan += [(str(h), h) for h in hints] + [("multi", tuple(hints))]
            for hint_label, hint in plan:
                try:
                    runner = backend.runner(workload, self.ctx, hint)
                except Unavailable as e:
                    left = len(plan) - [p[0] for p in plan].index(hint_label)
                    for _ in range(left * len(cases)):
                        self.progress.step(f"{workload.name} {backend.name}")
                    if hint is None:
                        self.skipped(backend, str(e))
                    else:
                        self.note(f"{workload.name}/{backend.name}: hinted rows skipped: {e}")
                    break
                for label, case_size, sets, ref, floor in prepared:
                    self.progress.step(f"{workload.name} {backend.name} {hint_label} {label}")
                    row = dict(workload=workload.name, kind=HINT_RUNTIME, dtype=dtype, size=format_size(case_size),
                               case=f"hint={hint_label},{label}", hint=hint_label, runtime=case_size[0])
                    try:
                        self.measure(backend, runner, workload, sets, ref, floor, **row)
                    except Exception as e:
                        self.failed(backend, e, **row)
                del runner
                self.free()

    def start_subprocess_kind(self, workload, dtype, pool) -> callable:
        """Start the fresh-process measurements of a sweep / first_call workload on ``pool``;
        returns the function that waits for them and adds their rows."""
        from benchmarks import first_call

        size = self.cfg.size(workload)
        states = ("cold", "warm_process") if workload.kind == SWEEP else ("cold", "warm")
        base = dict(workload=workload.name, kind=workload.kind, dtype=dtype, size=format_size(size))

        def job(backend):
            cache = tempfile.mkdtemp(prefix=f"pallaskit-bench-{workload.name}-{backend.name}-")
            results = []
            try:
                for state in states:
                    # first_call's warm state reads what its cold state wrote; a sweep's
                    # states each start from empty caches
                    folder = cache if workload.kind == FIRST_CALL else os.path.join(cache, state)
                    spec = dict(workload=workload.name, backend=backend.name, dtype=dtype, size=size,
                                seed=self.seed, cache_dir=folder, state=state, caches=workload.kind == FIRST_CALL,
                                steady=workload.kind == SWEEP and state == "cold", check=state == "cold",
                                repeats=self.cfg.repeats, min_round_s=self.cfg.min_round_s, warmup=self.cfg.warmup,
                                allow_cpu_compile=self.cfg.allow_cpu_compile)
                    results.append((state, first_call.spawn(spec, self.ctx, self.cfg.subprocess_timeout_s)))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            return results

        futures = [(b, pool.submit(job, b)) for b in self.backends_for(workload, only_compiling=True)]

        def collect():
            for backend, fut in futures:
                for state, res in fut.result():
                    self.progress.step(f"{workload.name} {backend.name} {state}")
                    self.add_subprocess_rows(workload, dtype, backend, state, res, base)
        return collect

    def add_subprocess_rows(self, workload, dtype, backend, state, res, base):
        if res.get("unavailable"):
            self.skipped(backend, res["unavailable"])
            return
        if res.get("error"):
            self.note(f"{workload.name}/{dtype}/{backend.name} {state}: FAILED: {res['error'][:300]}")
            self.add(backend=backend.name, case=state, status="failed", note=res["error"][:300], **base)
            return
        status, note = "ok", res.get("note", "")
        if res.get("mismatch"):
            status = "mismatch"
            self.note(f"{workload.name}/{dtype}/{backend.name}: MISMATCH: {res['mismatch']}")
        if workload.kind == FIRST_CALL:
            self.add(backend=backend.name, case=state, metric="first_result_s", unit="s", value=res["total_first_s"],
                     rel_err=res.get("rel_err"), status=status, note=res.get("mismatch") or note, **base)
            return
        cases = res["cases"]
        if state == "warm_process":  # the total only ([Note: warm process] in benchmarks/workloads.py)
            self.add(backend=backend.name, case="all sizes, warm process", metric="first_result_s", unit="s",
                     value=res["total_first_s"], status=status,
                     note=f"{len(cases)} sizes" + (f"; {note}" if note else ""), **base)
            return
        for c in cases:
            row = dict(base, size=c["size"], case=c["label"], runtime=c["runtime"])
            self.rows.append(dict(self._blank(), **row, backend=backend.name, metric="first_result_s", unit="s",
                                  value=c["first_s"], status=status))
            if c.get("ms") is not None:
                self.rows.append(dict(self._blank(), **row, backend=backend.name, metric="ms", unit="ms",
                                      value=c["ms"], floor=c["floor_ms"], frac_of_floor=c["floor_ms"] / c["ms"],
                                      host_ms=c.get("host_ms"), spread=c.get("spread"), iters=c.get("iters"),
                                      status=status))
        self.add(backend=backend.name, case="all sizes", metric="first_result_s", unit="s",
                 value=res["total_first_s"], rel_err=res.get("rel_err"), status=status,
                 note=res.get("mismatch") or f"{len(cases)} sizes", **base)
        if all(c.get("ms") is not None for c in cases) and status == "ok":
            self.add(backend=backend.name, case="all sizes", metric="steady_sum_ms", unit="ms",
                     value=sum(c["ms"] for c in cases), floor=sum(c["floor_ms"] for c in cases),
                     note=f"{len(cases)} sizes", **base)

    @staticmethod
    def _blank():
        return dict(workload="", kind="", dtype="", size="", backend="", case="", hint="", runtime="",
                    metric="", value=None, unit="", floor=None, frac_of_floor=None, rel_err=None,
                    status="ok", first_call_s=None, host_ms=None, spread=None, iters=None, note="")

    # -- whole run --
    def count_cases(self) -> int:
        n = 0
        for wname in self.cfg.workloads:
            w = WORKLOADS[wname]
            size = self.cfg.size(w)
            for _ in self.dtypes_for(w):
                bs = self.backends_for(w, only_compiling=w.kind in (SWEEP, FIRST_CALL))
                if w.kind == STEADY:
                    n += len(bs)
                elif w.kind == HINT_RUNTIME:
                    n += sum(len(w.cases(size)) * ((len(w.hints(size)) + 2) if b.hinted else 1) for b in bs)
                elif w.kind == SWEEP:
                    n += 2 * len(bs)  # cold, warm process
                else:
                    n += 2 * len(bs)
        return n

    def run(self) -> dict:
        cfg = self.cfg
        self.progress = Progress(self.count_cases(), cfg.progress)
        meta = run_meta(cfg, self.seed, self.ctx)
        self.progress.print(report.header_line(meta))
        results = {"meta": meta, "rows": self.rows, "notes": self.notes}
        runners = {STEADY: self.run_steady, HINT_RUNTIME: self.run_hint_runtime}
        t0 = time.perf_counter()
        own_cache = None
        if "cache_dir" in pallaskit.config.snapshot() and not pallaskit.config.cache_dir:
            # pallaskit's graph cache, on by default: a fresh folder, so no earlier run is found and the
            # user's cache is left alone.
            own_cache = tempfile.mkdtemp(prefix="pallaskit-bench-cache-")
            pallaskit.config.update(cache_dir=own_cache)
        # Fresh-process measurements run one at a time, after the in-process ones before them. With
        # jobs > 1 (the CPU, where timings mean little) they start at once and run beside the rest.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, cfg.jobs))
        deferred = []

        def guarded(wname, dtype, fn):
            try:
                fn()
            except Exception as e:  # inputs or reference failed: the workload is lost, not the run
                self.note(f"{wname}/{dtype}: FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                self.progress.print(f"{wname} {dtype} FAILED: {e!r}"[:2000])
            self.free()
            meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
            report.write_data(results, cfg.output)  # after each workload: a killed run keeps its rows

        try:
            for wname in cfg.workloads:
                w = WORKLOADS[wname]
                for dtype in self.dtypes_for(w):
                    if cfg.time_budget_s and time.perf_counter() - t0 > cfg.time_budget_s:
                        self.note(f"{wname}/{dtype}: not run: the time budget of {cfg.time_budget_s:.0f} s was spent")
                        continue
                    if w.kind in (SWEEP, FIRST_CALL):
                        collect = self.start_subprocess_kind(w, dtype, pool)
                        if cfg.jobs > 1:
                            deferred.append((wname, dtype, collect))
                        else:
                            guarded(wname, dtype, collect)
                    else:
                        guarded(wname, dtype, lambda: runners[w.kind](w, dtype))
            for wname, dtype, collect in deferred:
                guarded(wname, dtype, collect)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self.progress.close()
            if own_cache:
                pallaskit.config.reset("cache_dir")
                shutil.rmtree(own_cache, ignore_errors=True)
        meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
        report.write_all(results, cfg.output, results_md=cfg.results_md,
                         plots_dir=(cfg.plots_dir or os.path.join(cfg.output, "plots")) if cfg.plots else None)
        return results


# -- run metadata -------------------------------------------------------------------
def copy_bandwidth_jax() -> float:
    """Bytes read + written per second by a large device-to-device elementwise copy."""
    n = (256 << 20) if jax.default_backend() != "cpu" else (1 << 20)
    x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(f(x))
    t = timing.measure(lambda i: f(x), timing.HostClock(jax.block_until_ready), rounds=7, min_round_s=0.05)
    return 2 * n * 4 / (t.ms * 1e-3)


def copy_bandwidth_torch() -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or jax.default_backend() == "cpu":
        return None
    n = 256 << 20
    bufs = [torch.randn(n, device="cuda"), torch.empty(n, device="cuda")]
    bufs[1].copy_(bufs[0])
    t = timing.measure(lambda i: bufs[1].copy_(bufs[0]), timing.CudaEventClock(torch), rounds=7, min_round_s=0.05)
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * n * 4 / (t.ms * 1e-3)


def versions() -> dict:
    import jaxlib

    v = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
         "pallaskit": pallaskit.__version__}
    try:
        import torch

        v["torch"] = torch.__version__
        v["torch_cuda"] = bool(torch.cuda.is_available())
    except ImportError:
        pass
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def run_meta(cfg: SuiteConfig, seed: int, ctx: Context) -> dict:
    dev = jax.devices()[0]
    meta = {"device": str(getattr(dev, "device_kind", dev.platform)), "platform": ctx.platform,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "versions": versions(),
            "commit": git_commit(), "command": cfg.command, "seed": seed, "repeats": cfg.repeats,
            "size_preset": cfg.size_preset, "interpret": not ctx.on_gpu,
            "floor_bandwidth_tbs": hardware.COPY_BANDWIDTH / 1e12,
            "floor_matmul_tflops": {k: v / 1e12 for k, v in hardware.MATMUL_FLOPS.items()},
            "l2_bytes": hardware.L2_BYTES, "pallaskit_config": {k: str(v) for k, v in
                                                                 pallaskit.config.snapshot().items()},
            "workloads": {n: WORKLOADS[n].description for n in cfg.workloads},
            "backends": {n: BACKENDS[n].description for n in cfg.backends}}
    meta["copy_bandwidth_tbs"] = copy_bandwidth_jax() / 1e12
    torch_bw = copy_bandwidth_torch()
    if torch_bw:
        meta["copy_bandwidth_torch_tbs"] = torch_bw / 1e12
    return meta


def run(cfg: SuiteConfig) -> dict:
    return Suite(cfg).run()


__all__ = ["SuiteConfig", "run", "resolve", "parse_sizes", "DTYPES"]
