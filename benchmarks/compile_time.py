"""Cold compile time of whole training-step pieces: pallaskit vs jax.jit.

Each point is one first call (trace, compile, run) in a fresh process with a
fresh, empty cache folder (pallaskit's graph cache; JAX's persistent cache
off), so nothing is shared between points:

- ``momentum``: SGD-momentum over n arrays of 64 floats
  (``ms = [0.9*m + g]; ps = [p - 1e-3*m]``), n = 10 .. 1000;
- ``adamw``: AdamW written as optax does it (mu, nu, bias correction,
  decoupled weight decay) over n arrays of mixed small shapes;
- ``chain``: one array through a long pointwise chain (200 .. 3000 equations);
- ``scan``: ``lax.associative_scan`` (a cumulative sum) over rows x 16.

``cpu_s`` is the process's CPU time over the same call (all threads): on a
shared machine it moves less than the wall time. For pallaskit the child also
reports ``compiler_s``: the time in its own
passes (``lowering.compile_jaxpr``: lower, schedule, render); the rest of its
first call is tracing, JAX lowering the generated Pallas calls (on the CPU:
the Pallas interpreter) and XLA.

    python -m benchmarks.compile_time                # every point (minutes on the CPU)
    python -m benchmarks.compile_time --smoke        # tiny points, one process per backend, < 30 s
    python -m benchmarks.compile_time --output DIR   # compile_time.json, compile_time.png there
    python -m benchmarks.compile_time --passes-only --workloads adamw,momentum
        # pallaskit's own time alone (trace, compiler passes, loading the module; no
        # JAX lowering, XLA or run), each point in a fresh process: seconds in a minute
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

RESULT = "RESULT "
SHAPES = [(64,), (32, 16), (128,), (8, 8, 4), (1,), (3, 5), (256, 3), (17,)]

# (workload, sizes): the x axis is arrays for the optimizers, equations for the
# chain, rows for the scan.
FULL = {"momentum": [10, 25, 50, 100, 300, 1000], "adamw": [10, 100, 300, 1000],
        "chain": [200, 1000, 3000], "scan": [64, 1024]}
SMOKE = {"momentum": [2, 8], "adamw": [2], "chain": [20], "scan": [8]}  # every workload, two sizes of one
X_LABEL = {"momentum": "arrays", "adamw": "arrays", "chain": "equations", "scan": "rows (x 16)"}


# --------------------------------------------------------------------------- #
# Workloads
# --------------------------------------------------------------------------- #
def momentum(ps, ms, gs):
    ms = [0.9 * m + g for m, g in zip(ms, gs)]
    ps = [p - 1e-3 * m for p, m in zip(ps, ms)]
    return ps, ms


def adamw(params, grads, mu, nu, count, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4):
    """optax.adamw's update (scale_by_adam, add_decayed_weights, scale by -lr) and apply_updates."""
    import jax
    import jax.numpy as jnp

    count = count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g), nu, grads)
    c = count.astype(jnp.float32)
    mu_hat = jax.tree.map(lambda m: m / (1 - b1 ** c), mu)
    nu_hat = jax.tree.map(lambda v: v / (1 - b2 ** c), nu)
    updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    updates = jax.tree.map(lambda u, p: u + weight_decay * p, updates, params)
    updates = jax.tree.map(lambda u: -lr * u, updates)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, mu, nu, count


def chain(n_eq):
    import jax.numpy as jnp

    def f(x):
        y = x
        for k in range(n_eq // 2):  # two equations a step
            y = jnp.sin(y) + x if k % 2 else y * 1.0001 + 0.5
        return y

    return f


def scan(x):
    import jax
    import jax.numpy as jnp

    return jax.lax.associative_scan(jnp.add, x, axis=0)


def make(workload: str, n: int, seed: int = 0):
    """(function, arguments) of one point."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    if workload == "momentum":
        return momentum, [[jnp.asarray(rng.standard_normal(64), jnp.float32) for _ in range(n)] for _ in range(3)]
    if workload == "adamw":
        def arrays():
            return [jnp.asarray(rng.standard_normal(SHAPES[k % len(SHAPES)]), jnp.float32) for k in range(n)]
        params, grads, mu, nu = arrays(), arrays(), arrays(), [abs(a) for a in arrays()]
        return adamw, (params, grads, mu, nu, jnp.asarray(3, jnp.int32))
    if workload == "chain":
        return chain(n), (jnp.asarray(rng.standard_normal((7, 9)), jnp.float32),)
    if workload == "scan":
        return scan, (jnp.asarray(rng.standard_normal((n, 16)), jnp.float32),)
    raise ValueError(workload)


# --------------------------------------------------------------------------- #
# One process: the points it is given, each with a fresh cache folder
# --------------------------------------------------------------------------- #
def passes_only(fn, args, row: dict) -> None:
    """pallaskit's own part of a first call: trace, ``lowering.compile_jaxpr`` and
    loading the generated module (``cpu_s``: their process time)."""
    import jax

    import lowering
    import pallaskit
    from pallaskit.api import compile_options
    from pallaskit.runtime import loader

    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    t, c = time.perf_counter(), time.process_time()
    closed = pallaskit.jit(fn).trace(*structs).jaxpr
    row["trace_s"] = time.perf_counter() - t
    t1 = time.perf_counter()
    result = lowering.compile_jaxpr(closed, compile_options(), getattr(fn, "__name__", "fn"))
    row["compiler_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    loader.load(result.program)
    row["load_s"] = time.perf_counter() - t2
    row["seconds"], row["cpu_s"] = time.perf_counter() - t, time.process_time() - c
    row["source_chars"] = len(result.program.source)
    row["finite"] = True


def child(backend: str, points: list) -> None:
    import jax
    import numpy as np

    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    if backend.startswith("pallaskit"):  # imports before the clock starts, as a long-running process has them
        import lowering.codegen.pallas  # noqa: F401
        import lowering.lower  # noqa: F401
        import lowering.scheduler  # noqa: F401
        from jax.experimental import pallas  # noqa: F401
    for workload, n in points:
        fn, args = make(workload, n)
        row = {"workload": workload, "n": n, "backend": backend}
        if backend == "pallaskit-passes":
            passes_only(fn, args, row)
            print(RESULT + json.dumps(row), flush=True)
            continue
        with tempfile.TemporaryDirectory() as cache:
            if backend == "pallaskit":
                import lowering
                import pallaskit

                pallaskit.config.update(cache_dir=cache)
                spent = [0.0]
                inner = lowering.compile_jaxpr

                def timed(*a, **k):
                    t = time.perf_counter()
                    try:
                        return inner(*a, **k)
                    finally:
                        spent[0] += time.perf_counter() - t

                lowering.compile_jaxpr = timed
                try:
                    t, c = time.perf_counter(), time.process_time()
                    out = jax.block_until_ready(pallaskit.jit(fn)(*args))
                    row["seconds"], row["cpu_s"] = time.perf_counter() - t, time.process_time() - c
                finally:
                    lowering.compile_jaxpr = inner
                row["compiler_s"] = spent[0]
            else:
                t, c = time.perf_counter(), time.process_time()
                out = jax.block_until_ready(jax.jit(fn)(*args))
                row["seconds"], row["cpu_s"] = time.perf_counter() - t, time.process_time() - c
            leaves = jax.tree_util.tree_leaves(out)
            row["finite"] = bool(all(np.isfinite(np.asarray(x, np.float32)).all() for x in leaves))
        print(RESULT + json.dumps(row), flush=True)


def run_child(backend: str, points: list, timeout: float) -> list[dict]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks.compile_time", "--child", json.dumps([backend, points])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=repo)
        out, err, status = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, status = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "", "timeout"
    rows = [json.loads(line[len(RESULT):]) for line in out.splitlines() if line.startswith(RESULT)]
    done = {(r["workload"], r["n"]) for r in rows}
    for w, n in points:
        if (w, n) not in done:
            rows.append({"workload": w, "n": n, "backend": backend, "seconds": None,
                         "error": f"no result (exit {status}): {err.strip().splitlines()[-1] if err.strip() else ''}"[:300]})
    return rows


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #
def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = [w for w in FULL if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for backend, style in (("pallaskit", "o-"), ("jax.jit", "s--")):
            pts = sorted((r["n"], r["seconds"]) for r in rows
                         if r["workload"] == w and r["backend"] == backend and r.get("seconds"))
            if pts:
                ax.plot(*zip(*pts), style, label=backend)
            if backend == "pallaskit":
                own = sorted((r["n"], r["compiler_s"]) for r in rows
                             if r["workload"] == w and r["backend"] == backend and r.get("compiler_s"))
                if own:
                    ax.plot(*zip(*own), "^:", label="pallaskit compiler passes")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(w)
        ax.set_xlabel(X_LABEL[w])
        ax.set_ylabel("first call, s (fresh process and cache)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows: list[dict]) -> str:
    if all(r["backend"] == "pallaskit-passes" for r in rows):
        lines = ["| workload | n | own s | cpu s | trace s | compiler passes s | load s | source chars |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (list(FULL).index(r["workload"]), r["n"])):
            if r.get("seconds") is None:
                lines.append(f"| {r['workload']} | {r['n']} | {r.get('error', '-')} |")
                continue
            lines.append(f"| {r['workload']} | {r['n']} | {r['seconds']:.2f} | {r['cpu_s']:.2f} | {r['trace_s']:.2f} | "
                         f"{r['compiler_s']:.2f} | {r['load_s']:.2f} | {r['source_chars']} |")
        return "\n".join(lines)
    lines = ["| workload | n | pallaskit s | (compiler passes s) | jax.jit s |", "|---|---|---|---|---|"]
    keys = sorted({(r["workload"], r["n"]) for r in rows}, key=lambda k: (list(FULL).index(k[0]), k[1]))
    for w, n in keys:
        by = {r["backend"]: r for r in rows if (r["workload"], r["n"]) == (w, n)}
        p, j = by.get("pallaskit", {}), by.get("jax.jit", {})

        def fmt(x):
            return "-" if x is None else f"{x:.2f}"
        lines.append(f"| {w} | {n} | {fmt(p.get('seconds'))} | {fmt(p.get('compiler_s'))} | {fmt(j.get('seconds'))} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny points, one process per backend (< 30 s)")
    ap.add_argument("--output", default="benchmarks/out", help="folder for compile_time.json / .png")
    ap.add_argument("--workloads", default="", help="comma-separated subset of " + ",".join(FULL))
    ap.add_argument("--max-n", type=int, default=0, help="skip points above this size")
    ap.add_argument("--timeout", type=float, default=900, help="seconds a point may take before it is given up")
    ap.add_argument("--passes-only", action="store_true",
                    help="pallaskit's own time only (trace, compiler passes, load); no jax.jit rows")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        backend, points = json.loads(args.child)
        child(backend, [tuple(p) for p in points])
        return 0

    grid = SMOKE if args.smoke else FULL
    chosen = [w for w in args.workloads.split(",") if w] or list(grid)
    unknown = [w for w in chosen if w not in FULL]
    if unknown:
        ap.error(f"unknown workloads {unknown}; valid: {', '.join(FULL)}")
    points = [(w, n) for w in chosen for n in grid[w] if not args.max_n or n <= args.max_n]
    rows = []
    for backend in (("pallaskit-passes",) if args.passes_only else ("jax.jit", "pallaskit")):
        if args.smoke:  # one process per backend; each point still gets its own cache folder
            rows += run_child(backend, points, args.timeout)
        else:
            for p in points:
                rows += run_child(backend, [p], args.timeout)
                r = rows[-1]
                print(f"{r['workload']:9s} {r['n']:5d} {backend:9s} "
                      + (f"{r['seconds']:.2f} s" if r.get("seconds") else r.get("error", "")), flush=True)
    os.makedirs(args.output, exist_ok=True)
    meta = {"smoke": args.smoke, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
            "cpus": os.cpu_count(), "load_average": os.getloadavg()}
    try:
        import jax

        meta["jax"] = jax.__version__
    except ImportError:
        pass
    stem = "compile_time_passes" if args.passes_only else "compile_time"
    with open(os.path.join(args.output, stem + ".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if not args.passes_only:
        plot(rows, os.path.join(args.output, "compile_time.png"))
    print(table(rows))
    return 0 if all(r.get("seconds") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
