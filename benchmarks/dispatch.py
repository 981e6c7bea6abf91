"""Host time per call: pallaskit.jit against jax.jit on an optimizer step over many arrays.

The workload is ``benchmarks/models.py``'s AdamW over GPT-2-like shapes (``--layers 6``: 93
arrays, 373 inputs, 279 outputs), a step whose device time is small enough that the host's
dispatch decides the step time. Rows, each the median over ``--repeats`` rounds of ``--calls``
back-to-back calls with the inputs ready (the clock stops after the last call's outputs are
ready, so a row is the per-call time of a steady loop: host time where the host is the bound),
and ``host``: the median time for one call to return with the device idle (the dispatch alone):

- ``jax.jit``: jax.jit(step)
- ``pallaskit``: pallaskit.jit(step), jax.jit's C++ dispatch in front ([Note: the call fast
  path] in pallaskit/runtime/fastpath.py)
- ``pallaskit (python call)``: the same function with the C++ dispatch off (pallaskit's
  Python call: every leaf's aval and sharding keyed in Python), what every call paid before
- ``pallaskit executable``: pallaskit's compiled program called directly with the flat
  leaves (no signature lookup): the floor of what pallaskit's dispatch can reach
- ``jax.jit executable``: jax.jit's own compiled program (``.lower(...).compile()``) called
  directly: jax.jit's floor

The dispatch overhead is a row over its floor (``pallaskit`` / ``pallaskit executable``
against ``jax.jit`` / ``jax.jit executable``). On the CPU (interpret mode) pallaskit's
program is not jax.jit's, so only those ratios compare; on a GPU compare ``pallaskit`` with
``jax.jit`` too (the rest of the gap is the executable's own launches).

    python -m benchmarks.dispatch --smoke            # the CPU: 93 tiny arrays
    python -m benchmarks.dispatch                    # a GPU: 93 arrays, width 1024 (127M parameters)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _per_call_ms(fn, args, calls: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e3


def _host_ms(fn, args, calls: int) -> float:
    """Median time for a call to return, the device idle and the inputs ready before
    each: the host's dispatch alone (the device's work runs after it returns)."""
    import jax

    out, times = fn(*args), []
    for _ in range(calls):
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        out = fn(*args)
        times.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
    return statistics.median(times) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--smoke", action="store_true", help="tiny arrays (the CPU)")
    p.add_argument("--json", default="", help="write the rows to this file")
    a = p.parse_args(argv)
    if a.smoke:
        a.width, a.vocab, a.calls, a.repeats = 16, 24, 30, 15
    import jax

    import pallaskit
    from benchmarks import models

    args = models._adamw_inputs((a.layers, a.width, a.vocab), "float32", jax.random.PRNGKey(0))
    step = models.adamw_step(False)
    fast, slow = pallaskit.jit(step), pallaskit.jit(step)
    slow._cpp = None  # the Python call alone
    jitted = jax.jit(step)
    want = jax.block_until_ready(jitted(*args))
    for f in (fast, slow):
        got = jax.block_until_ready(f(*args))
        assert len(got) == len(want)
    entry = next(iter(fast._fast.values()))
    leaves = jax.tree_util.tree_leaves(args)

    def bare(*_):
        return entry.executable(*leaves, *entry.constants)

    jax_compiled = jitted.lower(*args).compile()
    rows = {"jax.jit": jitted, "jax.jit executable": jax_compiled, "pallaskit": fast,
            "pallaskit (python call)": slow, "pallaskit executable": bare}
    times: dict = {k: [] for k in rows}
    host: dict = {k: [] for k in rows}
    for _ in range(a.repeats):  # interleaved, so a busy moment of the machine hits every row alike
        for name, fn in rows.items():
            times[name].append(_per_call_ms(fn, args, a.calls))
            host[name].append(_host_ms(fn, args, a.calls))
    n_out = len(want)
    print(f"AdamW over {(len(args) - 1) // 4} arrays: {len(args)} inputs, {n_out} outputs; "
          f"device {jax.devices()[0].device_kind}; jax {jax.__version__}; median of {a.repeats} x {a.calls} calls")
    base, base_min = statistics.median(times["jax.jit"]), min(times["jax.jit"])
    host_base = statistics.median(host["jax.jit"])
    out = []
    for name, ts in times.items():
        ms, best, h = statistics.median(ts), min(ts), statistics.median(host[name])
        out.append(dict(row=name, ms=round(ms, 4), min_ms=round(best, 4), vs_jax_jit=round(ms / base, 3),
                        min_vs_jax_jit=round(best / base_min, 3), host_ms=round(h, 4),
                        host_vs_jax_jit=round(h / host_base, 3)))
        print(f"  {name:26s} {ms:8.3f} ms/call  {ms / base:6.2f}x jax.jit   (min {best:.3f} ms, "
              f"{best / base_min:.2f}x)   host {h:.3f} ms/call {h / host_base:5.2f}x")
    # The Python call's own work (flatten, key, lookup, unflatten): its executable
    # replaced by one returning ready outputs, so no device time is in it.
    import dataclasses
    import timeit

    ready = list(entry.executable(*leaves, *entry.constants))
    stub = pallaskit.jit(step)
    stub._cpp = None
    stub(*args)
    stubbed = dataclasses.replace(entry, executable=lambda *a: ready)
    stub._fast = {k: stubbed for k in stub._fast}
    python_ms = min(timeit.repeat(lambda: stub(*args), number=a.calls, repeat=a.repeats)) / a.calls * 1e3
    print(f"  the Python call's own work per call (executable stubbed): {python_ms:.3f} ms "
          "(what the C++ path does not run)")
    out.append(dict(row="python call work (executable stubbed)", min_ms=round(python_ms, 4)))
    med = {r["row"]: r["ms"] for r in out if "ms" in r}
    low = {r["row"]: r["min_ms"] for r in out}
    for name, floor in (("jax.jit", "jax.jit executable"), ("pallaskit", "pallaskit executable"),
                        ("pallaskit (python call)", "pallaskit executable")):
        print(f"  over its floor: {name:24s} median {med[name] / med[floor]:5.2f}x   min {low[name] / low[floor]:5.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
