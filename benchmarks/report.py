"""Results out: JSON and CSV (the data), a markdown report, the suite's section
of benchmarks/RESULTS.md, and PNG plots. Everything is rendered from the
results dict alone, so a run made elsewhere (the GPU machine) is turned into
the committed section and plots here:

    python -m benchmarks.report OUT/results.json --results_md benchmarks/RESULTS.md \\
        --plots_dir benchmarks/plots
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import tempfile

BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"
COLUMNS = ("workload", "kind", "dtype", "size", "backend", "case", "hint", "runtime", "metric", "value", "unit",
           "floor", "frac_of_floor", "rel_err", "status", "first_call_s", "host_ms", "spread", "iters", "note")
PLOTS = {"floor": "suite_floor_fraction.png", "hint": "suite_hint_runtime.png",
         "sweep": "suite_sweep_first_result.png", "first_call": "suite_first_call.png"}


# -- lines printed while running ------------------------------------------------------
def header_line(meta: dict) -> str:
    v = meta["versions"]
    return (f"{meta['device']} ({meta['platform']}), " + ", ".join(f"{k} {v[k]}" for k in
                                                                 ("jax", "torch", "triton", "pallaskit") if k in v)
            + f"; copy {meta['copy_bandwidth_tbs']:.2f} TB/s; seed {meta['seed']}")


def row_line(r: dict) -> str:
    head = f"{r['workload']:22s} {r['dtype']:8s} {r['backend']:28s} {r['case']:18s}"
    if r["status"] != "ok":
        return f"{head} {r['status'].upper()}: {r['note'][:150]}"
    if r["value"] is None:
        return head
    text = f"{head} {r['value']:10.4f} {r['unit']}"
    if r.get("frac_of_floor"):
        text += f"  floor {r['floor']:.4g}  ({r['frac_of_floor']:.0%})"
    if r.get("first_call_s") is not None:
        text += f"  first call {r['first_call_s']:.2f} s"
    return text


# -- data ----------------------------------------------------------------------------
def _atomic_write(path: str, text: str):
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=os.path.basename(path))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _clean(v):
    if isinstance(v, float):
        return None if math.isnan(v) else (str(v) if math.isinf(v) else round(v, 6))
    return v


def write_data(results: dict, output: str) -> list[str]:
    os.makedirs(output, exist_ok=True)
    data = {"meta": results["meta"], "rows": [{k: _clean(r.get(k)) for k in COLUMNS} for r in results["rows"]],
            "notes": results["notes"], **({"commentary": results["commentary"]} if results.get("commentary") else {})}
    paths = [os.path.join(output, "results.json"), os.path.join(output, "results.csv")]
    _atomic_write(paths[0], json.dumps(data, indent=1) + "\n")
    with open(paths[1], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in data["rows"]:
            w.writerow({k: "" if r[k] is None else r[k] for k in COLUMNS})
    return paths


# -- markdown -------------------------------------------------------------------------
def _ordered(values):
    out = []
    for v in values:
        if v not in out:
            out.append(v)
    return out


def _fmt_ms(ms: float) -> str:
    return f"{ms:.4f}" if ms < 1 else f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


FRACTIONS = {"show": True}  # off for CPU runs: the floors are the H100's


def _cell(r, best: bool = False) -> str:
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"]
    text = _fmt_ms(r["value"])
    if best:
        text = f"**{text}**"
    if r.get("frac_of_floor") and FRACTIONS["show"]:
        text += f" ({r['frac_of_floor']:.0%})"
    if _staged(r):
        text += " ‡"
    elif _host_bound(r):
        text += " †"
    return text


def _staged(r) -> bool:
    """A host-bound JAX row re-timed as device time (benchmarks/suite.py, STAGED_CALLS)."""
    return FRACTIONS["show"] and str(r.get("note") or "").startswith("device time of")


def _host_bound(r) -> bool:
    """The device waited on the host: enqueueing a call took about as long as running it."""
    return (FRACTIONS["show"] and r.get("host_ms") is not None and r.get("value") is not None
            and r.get("unit") == "ms" and r["host_ms"] > 0.8 * r["value"])


def _fmt_floor(ms) -> str:
    return "" if not ms else _fmt_ms(ms) if ms >= 1e-3 else f"{ms:.2g}"


def _ok(r) -> bool:
    return r is not None and r["status"] == "ok" and r["value"] is not None


def _steady_table(rows, backends) -> list[str]:
    steady = [r for r in rows if r["kind"] == "steady"]
    if not steady:
        return []
    keys = _ordered((r["workload"], r["dtype"], r["size"]) for r in steady)
    used = [b for b in backends if any(r["backend"] == b for r in steady)]
    lines = ["### Steady state: median ms per call" + (" (fraction of the floor)" if FRACTIONS["show"] else ""), "",
             "| workload | dtype | size | floor ms | " + " | ".join(used) + " | pallaskit / best other |",
             "|---|---|---|---|" + "---|" * len(used) + "---|"]
    for w, d, s in keys:
        mine = {r["backend"]: r for r in steady if (r["workload"], r["dtype"], r["size"]) == (w, d, s)}
        floor = next((r["floor"] for r in mine.values() if r.get("floor")), None)
        timed = {b: r["value"] for b, r in mine.items() if _ok(r)}
        fastest = min(timed, key=timed.get) if timed else None
        others = [v for b, v in timed.items() if not b.startswith("pallaskit")]
        ratio = f"{timed['pallaskit'] / min(others):.2f}×" if "pallaskit" in timed and others else ""
        lines.append(f"| {w} | {d} | {s} | {_fmt_floor(floor)} | "
                     + " | ".join(_cell(mine.get(b), b == fastest) for b in used) + f" | {ratio} |")
    lines += ["", "Bold: the fastest. A blank cell: the backend does not apply to the workload (variants run on "
              "the workloads their option changes) or was not available. † host-bound: enqueueing a call took "
              "over 80% of its time, so the figure is the dispatch rate and the device time is lower (JAX has "
              "no device clock here; see benchmarks/timing.py). ‡ such a row re-timed as device time: 10 calls on "
              "rotating inputs inside one jax.jit, one dispatch (the host-bound figure is in the CSV note). Last column: pallaskit's time over the best "
              "non-pallaskit backend's (below 1: pallaskit is faster).", ""]
    return lines


def _hint_tables(rows) -> list[str]:
    hr = [r for r in rows if r["kind"] == "hint_runtime" and r["metric"] == "ms"]
    if not hr:
        return []
    lines = ["### Matmul Hint × Runtime: ms per call" + (" (fraction of the floor)" if FRACTIONS["show"] else ""), "",
             "Rows: the size the backend compiled for (`static`: compiled for each runtime size; `multi`: "
             "multi-kernel variants for every hint, picked at run time). Columns: runtime M.", ""]
    for (w, d), group in _group(hr, ("workload", "dtype")).items():
        runtimes = sorted({int(r["runtime"]) for r in group})
        size = group[0]["size"].split("x", 1)[1]
        for b, brows in _group(group, ("backend",)).items():
            lines += [f"{w}, {d}, K×N = {size}, **{b[0]}**", "",
                      "| hint \\ runtime M | " + " | ".join(map(str, runtimes)) + " |",
                      "|---|" + "---|" * len(runtimes)]
            for hint in _ordered(r["hint"] for r in brows):
                cells = {int(r["runtime"]): r for r in brows if r["hint"] == hint}
                lines.append(f"| {hint} | " + " | ".join(_cell(cells.get(m)) for m in runtimes) + " |")
            lines.append("")
    return lines


def _sweep_table(rows) -> list[str]:
    sw = [r for r in rows if r["kind"] == "sweep" and str(r["case"]).startswith("all sizes")]
    if not sw:
        return []
    lines = ["### Dynamic-shape sweep: every size new, in a fresh process", "",
             "| workload | dtype | backend | sizes | time to first result of all (s) | first size (s) | "
             "each later size, median (s) | all, warm process (s) | steady-state sum ms"
             + (" (fraction of floor)" if FRACTIONS["show"] else "") + " | host-bound sizes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (w, d, b), group in _group(sw, ("workload", "dtype", "backend")).items():
        first = next((r for r in group if r["metric"] == "first_result_s" and r["case"] == "all sizes"), None)
        warm = next((r for r in group if r["case"] == "all sizes, warm process"), None)
        warm = f"{warm['value']:.2f}" if warm and warm["status"] == "ok" else (warm or {}).get("status", "")
        steady = next((r for r in group if r["metric"] == "steady_sum_ms"), None)
        per = [r for r in rows if (r["kind"], r["workload"], r["dtype"], r["backend"]) == ("sweep", w, d, b)
               and str(r["case"]).startswith("rows=")]
        firsts = [r["value"] for r in per if r["metric"] == "first_result_s" and r["status"] == "ok"]
        timed = [r for r in per if r["metric"] == "ms" and r["status"] == "ok"]
        ok = first is not None and first["status"] == "ok"
        n = first["note"] if ok else ""
        total = f"{first['value']:.2f}" if ok else (first or {}).get("status", "")
        later = f"{sorted(firsts[1:])[len(firsts[1:]) // 2]:.3f}" if len(firsts) > 1 else ""
        bound = f"{sum(_host_bound(r) for r in timed)} of {len(timed)}" if timed and FRACTIONS["show"] else ""
        lines.append(f"| {w} | {d} | {b} | {n} | {total} | {f'{firsts[0]:.2f}' if firsts else ''} | {later} | "
                     f"{warm} | {_cell(steady)} | {bound} |")
    sizes = _ordered(r["runtime"] for r in rows if r["kind"] == "sweep" and str(r["case"]).startswith("rows="))
    lines += ["", f"Row counts: {', '.join(map(str, sizes))}. The first size's time includes the backend's "
              "first compilation in the process (torch: importing and starting Dynamo / Inductor); the warm-process "
              "column is the same in a fresh process that first ran another function through the backend "
              "([Note: warm process] in benchmarks/workloads.py). A host-bound "
              "size is timed by its dispatch, not by the device (the steady-state sum is then a dispatch figure).",
              ""]
    return lines


def _first_call_table(rows) -> list[str]:
    fc = [r for r in rows if r["kind"] == "first_call"]
    if not fc:
        return []
    lines = ["### First call in a fresh process: cold and warm caches (s)", "",
             "| workload | dtype | size | backend | cold | warm | warm / cold | warm run |",
             "|---|---|---|---|---|---|---|---|"]
    for (w, d, s, b), group in _group(fc, ("workload", "dtype", "size", "backend")).items():
        by = {r["case"]: r for r in group}

        def cell(state):
            r = by.get(state)
            return "" if r is None else f"{r['value']:.3f}" if r["status"] == "ok" else r["status"]
        ratio = ""
        if all(by.get(k) and by[k]["status"] == "ok" for k in ("cold", "warm")):
            ratio = f"{by['warm']['value'] / by['cold']['value']:.0%}"
        lines.append(f"| {w} | {d} | {s} | {b} | {cell('cold')} | {cell('warm')} | {ratio} | "
                     f"{(by.get('warm') or {}).get('note', '')} |")
    lines += ["", "Time from calling the function in a fresh process (imports done, inputs on the device) to its "
              "result. Cold: empty caches. Warm: a second process over the caches the cold one filled (jax.jit: "
              "JAX's persistent compilation cache; pallaskit: its own graph cache; torch.compile: Inductor's "
              "caches). benchmarks/compile_cache.py measures pallaskit and jax.jit alone, with repeats and "
              "compile counts.", ""]
    return lines


def _group(rows, keys) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def markdown(results: dict, plots: dict | None = None, plots_rel: str = "plots") -> str:
    meta, rows = results["meta"], results["rows"]
    FRACTIONS["show"] = meta["platform"] != "cpu"
    v = meta["versions"]
    vers = ", ".join(f"{k} {v[k]}" for k in ("jax", "jaxlib", "torch", "triton", "pallaskit", "python") if k in v)
    bw = f"{meta['copy_bandwidth_tbs']:.2f} TB/s (JAX)"
    if meta.get("copy_bandwidth_torch_tbs"):
        bw += f", {meta['copy_bandwidth_torch_tbs']:.2f} TB/s (torch)"
    tf = meta["floor_matmul_tflops"]
    lines = ["## Cross-framework suite (`python -m benchmarks.run`)", "",
             f"Device: **{meta['device']}** ({meta['platform']}{', Pallas interpret mode' if meta['interpret'] else ''})"
             f"; {meta['date']}; {vers}; commit {meta.get('commit') or '?'}.", "",
             f"Command: `{meta['command']}` (seed {meta['seed']}, sizes `{meta['size_preset']}`, median of "
             f"{meta['repeats']} rounds, {meta.get('elapsed_s', '?')} s).", "",
             f"Floors: bytes moved (each input read once, each output written once) at "
             f"{meta['floor_bandwidth_tbs']:.1f} TB/s, and matrix FLOPs at {tf['bfloat16']:.0f} TFLOP/s "
             f"(bf16 dense; TF32 {tf['float32']:.0f}), whichever is larger (benchmarks/hardware.py). "
             f"Copy bandwidth measured in this run: {bw}. Every output was checked against a float32 "
             f"reference before timing."
             + (" On the CPU the floors (the H100's) mean nothing: fractions are left out." if meta["platform"]
                == "cpu" else ""), ""]
    backends = list(meta.get("backends", {})) or _ordered(r["backend"] for r in rows)
    lines += _steady_table(rows, backends)
    lines += _hint_tables(rows)
    lines += _sweep_table(rows)
    lines += _first_call_table(rows)
    if meta.get("backends"):
        lines += ["Backends: " + "; ".join(f"`{k}`: {d}" for k, d in meta["backends"].items()) + ".", ""]
    if results.get("commentary"):
        lines += [results["commentary"].strip(), ""]
    if results["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in results["notes"]] + [""]
    if plots:
        lines += [f"![{k}]({plots_rel}/{os.path.basename(p)})" for k, p in plots.items()] + [""]
    return "\n".join(lines)


def write_section(path: str, text: str):
    """Put ``text`` between the suite's markers in ``path``; the rest of the file is left as it is."""
    block = f"{BEGIN}\n{text.rstrip()}\n{END}\n"
    old = open(path).read() if os.path.exists(path) else "# Benchmark results\n\n"
    if BEGIN in old and END in old and old.index(BEGIN) < old.index(END):
        head, rest = old.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        new = head + block + tail
    else:
        new = old.rstrip("\n") + "\n\n" + block
    _atomic_write(path, new)


# -- plots ----------------------------------------------------------------------------
def plots(results: dict, folder: str) -> dict:
    """The PNGs that have data; {name: path}. Needs matplotlib (extra 'bench')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    rows, meta = results["rows"], results["meta"]
    out = {}
    title = f"{meta['device']}, {meta['date']}"

    steady = [r for r in rows if r["kind"] == "steady" and r["status"] == "ok" and r.get("frac_of_floor")]
    if steady:
        multi_dtype = len({r["dtype"] for r in steady}) > 1
        groups = _ordered((r["workload"], r["dtype"]) for r in steady)
        bnames = _ordered(r["backend"] for r in steady)
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups) + 2), 4.8))
        width = 0.8 / len(bnames)
        for i, b in enumerate(bnames):
            mine = [next((r for r in steady if (r["workload"], r["dtype"]) == g and r["backend"] == b), None)
                    for g in groups]
            bars = ax.bar([j + i * width - 0.4 + width / 2 for j in range(len(groups))],
                          [r["frac_of_floor"] if r else 0 for r in mine], width, label=b)
            for bar, r in zip(bars, mine):
                if r is not None and _host_bound(r):
                    bar.set_hatch("///")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{w}\n{d}" if multi_dtype else w for w, d in groups], rotation=30, ha="right")
        ax.set_ylabel("fraction of floor (higher is better)")
        ax.set_title(f"Steady state vs memory / FLOP floor — {title}"
                     + (" (hatched: host-bound)" if any(_host_bound(r) for r in steady) else ""))
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        out["floor"] = os.path.join(folder, PLOTS["floor"])
        fig.savefig(out["floor"], dpi=110)
        plt.close(fig)

    hr = [r for r in rows if r["kind"] == "hint_runtime" and r["metric"] == "ms" and r["status"] == "ok"]
    if hr:
        labels = _ordered((r["backend"], r["hint"]) for r in hr)  # one heatmap row per (backend, hint)
        runtimes = sorted({int(r["runtime"]) for r in hr})
        best = {m: min(r["value"] for r in hr if int(r["runtime"]) == m) for m in runtimes}
        grid = [[math.nan] * len(runtimes) for _ in labels]
        for r in hr:
            grid[labels.index((r["backend"], r["hint"]))][runtimes.index(int(r["runtime"]))] = r["value"]
        ratio = [[v / best[m] for v, m in zip(row, runtimes)] for row in grid]
        fig, ax = plt.subplots(figsize=(2.0 * len(runtimes) + 3.5, 0.42 * len(labels) + 1.6))
        im = ax.imshow(ratio, cmap="RdYlGn_r", vmin=1.0, vmax=2.0, aspect="auto")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    mark = " †" if _host_bound(next(r for r in hr if (r["backend"], r["hint"]) == labels[i]
                                                    and int(r["runtime"]) == runtimes[j])) else ""
                    ax.text(j, i, f"{_fmt_ms(v)} ms  ×{ratio[i][j]:.2f}{mark}", ha="center", va="center",
                            fontsize=7.5)
        ax.set_xticks(range(len(runtimes)))
        ax.set_xticklabels(runtimes)
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels([f"{b}, {'static' if h == 'static' else 'hint ' + h if h != 'multi' else 'multi-kernel'}"
                            for b, h in labels], fontsize=8)
        ax.set_xlabel("runtime M")
        fig.colorbar(im, ax=ax, label="ms / best at that M (any backend)")
        ax.set_title(f"Matmul Hint × Runtime (K = N = {hr[0]['size'].split('x', 1)[1].split('x')[0]}) — {title}"
                     + (" — † host-bound" if any(_host_bound(r) for r in hr) else ""), fontsize=9)
        fig.tight_layout()
        out["hint"] = os.path.join(folder, PLOTS["hint"])
        fig.savefig(out["hint"], dpi=110)
        plt.close(fig)

    sw = [r for r in rows if r["kind"] == "sweep" and r["metric"] == "first_result_s"
          and str(r["case"]).startswith("rows=") and r["status"] == "ok"]
    if sw:
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        for b, brows in _group(sw, ("backend",)).items():
            cum, total = [], 0.0
            for r in brows:
                total += r["value"]
                cum.append(total)
            ax.plot(range(1, len(cum) + 1), cum, marker="o", ms=3, label=b[0])
        labels = _ordered(r["runtime"] for r in sw)
        ax.set_xticks(range(1, len(labels) + 1))
        ax.set_xticklabels(labels, rotation=60, fontsize=7)
        ax.set_xlabel("rows of the n-th new size")
        ax.set_ylabel("time to first result, cumulative (s)")
        ax.set_yscale("log")
        ax.set_title(f"Dynamic-shape sweep, fresh process — {title}", fontsize=10)
        ax.legend(fontsize=8)
        fig.tight_layout()
        out["sweep"] = os.path.join(folder, PLOTS["sweep"])
        fig.savefig(out["sweep"], dpi=110)
        plt.close(fig)

    fc = [r for r in rows if r["kind"] == "first_call" and r["status"] == "ok"]
    if fc:
        groups = _ordered((r["workload"], r["backend"]) for r in fc)
        fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(groups) + 2), 4.2))
        for i, state in enumerate(("cold", "warm")):
            vals = [next((r["value"] for r in fc if (r["workload"], r["backend"]) == g and r["case"] == state), 0)
                    for g in groups]
            ax.bar([j + (i - 0.5) * 0.4 for j in range(len(groups))], vals, 0.4, label=state)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{w.replace('first_call_', '')}\n{b}" for w, b in groups], rotation=30, ha="right",
                           fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("time to first result (s)")
        ax.set_title(f"First call in a fresh process — {title}", fontsize=10)
        ax.legend()
        fig.tight_layout()
        out["first_call"] = os.path.join(folder, PLOTS["first_call"])
        fig.savefig(out["first_call"], dpi=110)
        plt.close(fig)
    return out


def write_all(results: dict, output: str, results_md: str | None = None, plots_dir: str | None = None) -> dict:
    """Data, plots, results.md in ``output``, and the section in ``results_md``; {kind: path}."""
    paths = dict(zip(("json", "csv"), write_data(results, output)))
    made = {}
    if plots_dir:
        try:
            made = plots(results, plots_dir)
        except ImportError:
            note = "plots: skipped (matplotlib is not installed: pip install -e '.[bench]')"
            if note not in results["notes"]:
                results["notes"].append(note)
    paths.update({f"plot_{k}": p for k, p in made.items()})
    md_path = os.path.join(output, "results.md")
    _atomic_write(md_path, markdown(results, made, os.path.relpath(plots_dir, output) if plots_dir else "plots"))
    paths["md"] = md_path
    if results_md:
        rel = os.path.relpath(plots_dir, os.path.dirname(os.path.abspath(results_md))) if plots_dir else "plots"
        write_section(results_md, markdown(results, made, rel))
        paths["results_md"] = results_md
    return paths


def merge(parts: list[dict]) -> dict:
    """Several runs (e.g. a GPU session split in two calls) as one: the first run's
    metadata, every row (a later run's rows replace an earlier run's for the same
    workload, dtype and backend, so runs split by backend merge too), every note, the
    commands joined."""
    meta = dict(parts[0]["meta"])
    rows, notes = [], []
    for part in parts:
        redone = {(r["workload"], r["dtype"], r["backend"]) for r in part["rows"]}
        rows = [r for r in rows if (r["workload"], r["dtype"], r["backend"]) not in redone] + part["rows"]
        notes += [n for n in part["notes"] if n not in notes]
    if len(parts) > 1:
        meta["command"] = "`; `".join(p["meta"]["command"] for p in parts)
        meta["elapsed_s"] = round(sum(p["meta"].get("elapsed_s") or 0 for p in parts), 1)
        meta["backends"] = {k: v for p in parts for k, v in p["meta"].get("backends", {}).items()}
    return {"meta": meta, "rows": rows, "notes": notes}


def main(argv=None):
    p = argparse.ArgumentParser(description="Render suite runs (results.json files; several are merged) into "
                                            "tables, plots and the suite's section of RESULTS.md.")
    p.add_argument("results_json", nargs="+")
    p.add_argument("--output", help="folder for results.md / .csv / .json (default: the first json's folder)")
    p.add_argument("--results_md", help="file whose suite section is rewritten, e.g. benchmarks/RESULTS.md")
    p.add_argument("--plots_dir", help="folder for the PNGs (default: <output>/plots)")
    p.add_argument("--commentary", help="a markdown file of observations to put in the section")
    a = p.parse_args(argv)
    parts = []
    for path in a.results_json:
        with open(path) as f:
            parts.append(json.load(f))
    results = merge(parts)
    if a.commentary:
        with open(a.commentary) as f:
            results["commentary"] = f.read()
    output = a.output or os.path.dirname(os.path.abspath(a.results_json[0]))
    paths = write_all(results, output, a.results_md, a.plots_dir or os.path.join(output, "plots"))
    for k, v in paths.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
