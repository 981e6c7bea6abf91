"""What the compiler did, as data (the ideas of Inductor's metrics.py).

Two kinds of record:

- ``counters``: process-wide totals (kernels generated, bytes accessed, IR
  nodes before and after fusion, cache hits...). ``reset()`` zeroes them.
  Counters that describe generated code are *compile deltas*: the graph cache
  stores them with each entry and adds them again on a hit, so a warm process
  reports the same code statistics as a cold one (``kernels_compiled``,
  ``cache_*`` and ``compile_seconds`` describe this process's work and are
  not replayed).
- metric tables: CSV files, one per table, enabled by the option
  ``enabled_metric_tables`` (comma-separated names from ``TABLES``) and
  written into ``metrics_dir``. The header is written once, when the file is
  created; rows are appended; floats are written with six decimals, booleans
  as true/false, None as an empty field. Any code adds a row with
  ``log_row(table, **columns)``; a disabled table writes nothing.
"""
from __future__ import annotations

import collections
import csv
import io
import logging
import math
import os

import filelock

from pallaskit.metric_tables import TABLES

log = logging.getLogger("pallaskit")

COUNTER_NAMES = (
    "graphs_compiled",  # functions traced and compiled (one per new signature; replayed on a cache hit)
    "kernels_compiled",  # kernels handed to Pallas/XLA for compilation in this process (0 on a warm cache hit)
    "generated_kernel_count",  # kernels rendered
    "fallback_count",  # extern (XLA) nodes scheduled
    "ir_nodes_before_fusion",
    "ir_nodes_after_fusion",
    "bytes_accessed",  # bytes read + written by the generated kernels, one run of each graph
    "codegen_mix_order_reduction",  # kernels doing a row and a column reduction of one input
    "dynamic_fallbacks",  # symbolic signatures that could not compile shape-generic (then compiled per size)
    "dynamic_guard_failures",  # calls whose sizes broke a symbolic program's guard (compiled for their size)
    "multi_kernel_choices",  # multi-kernel variants chosen for a new size (any method but the in-memory dict)
    "eager_launches",  # calls of a symbolic program run as raw Triton outside XLA (runtime/eager.py)
    "dynamic_speculations",  # shape-generic programs compiled at a first size, for guessed axes
    "dynamic_speculation_hits",  # second sizes served by such a program
    "eager_cache_hits",  # symbolic signatures whose eager program came from the on-disk cache (no compiler run)
    "per_shard_graphs",  # sharded signatures compiled at local shapes under shard_map (pallaskit/per_shard.py)
    "cache_hits",  # graphs served by the on-disk cache
    "cache_misses",  # graphs compiled with the cache on and no valid entry
    "compile_seconds",  # wall time spent in pallaskit's compile path (trace, key, load or compile)
    # where compile_seconds went (the cache's parts only when the cache is on):
    "trace_seconds",  # tracing the function to a jaxpr
    "cache_key_seconds",  # hashing the jaxpr, its constants and the environment into a cache key
    "cache_read_seconds",  # reading and checking an entry (also when there is none)
    "cache_load_seconds",  # making a hit's entry runnable: deserializing the executable, constants to the device
)

# Replayed from a cache entry on a hit; everything else describes this process.
COMPILE_DELTA_NAMES = ("graphs_compiled", "generated_kernel_count", "fallback_count", "ir_nodes_before_fusion",
                       "ir_nodes_after_fusion", "bytes_accessed", "codegen_mix_order_reduction")

counters: collections.Counter = collections.Counter({n: 0 for n in COUNTER_NAMES})
logged_fallbacks: set[str] = set()  # primitives already named in the log
_graph_ids: collections.Counter = collections.Counter()  # graph_stats ids: <title>#<n>


def reset():
    """Zero the counters, forget which fallbacks were logged, restart graph ids."""
    logged_fallbacks.clear()
    _graph_ids.clear()
    counters.clear()
    counters.update({n: 0 for n in COUNTER_NAMES})


def apply_deltas(deltas: dict):
    """Add counter deltas recorded with a cache entry."""
    for name, value in deltas.items():
        counters[name] += value


# --------------------------------------------------------------------------- #
# Metric tables
# --------------------------------------------------------------------------- #
def enabled_tables() -> list[str]:
    from pallaskit.config import config

    return [n for n in config.enabled_metric_tables.split(",") if n]


def table_path(table: str) -> str:
    from pallaskit.config import config

    return os.path.join(config.metrics_dir or os.getcwd(), f"{table}.csv")


def _field(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.6f}"
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalars
        return _field(value.item())
    return str(value)


def _check_table(table: str):
    if table not in TABLES:
        raise ValueError(f"unknown metric table {table!r}; valid tables: {', '.join(TABLES)}")


def _append(table: str, rows: list[list[str]]):
    """Append rows to the table's CSV, writing the header if the file is new or
    empty. A file holding another header (an older column set) is moved aside
    to ``<name>.csv.old`` first. A lock makes concurrent processes safe."""
    path = table_path(table)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = list(TABLES[table])
    with filelock.FileLock(os.path.join(os.path.dirname(path), ".metric_tables.lock")):
        write_header = True
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, newline="") as f:
                first = next(csv.reader(f), None)
            if first == header:
                write_header = False
            else:
                log.warning("pallaskit: %s has other columns; moved to %s.old", path, path)
                os.replace(path, path + ".old")
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        if write_header:
            writer.writerow(header)
        writer.writerows(rows)
        with open(path, "a", newline="") as f:
            f.write(buf.getvalue())


def log_row(table: str, **row):
    """Add one row to a metric table if the table is enabled. The row must give
    exactly the table's columns (``TABLES[table]``), enabled or not."""
    _check_table(table)
    columns = TABLES[table]
    if set(row) != set(columns):
        missing = [c for c in columns if c not in row]
        extra = [c for c in row if c not in columns]
        raise ValueError(f"metric table {table!r} has columns {', '.join(columns)}; "
                         f"missing: {', '.join(missing) or '-'}; unknown: {', '.join(extra) or '-'}")
    enabled = enabled_tables()
    if table not in enabled:
        return
    ensure_tables(enabled)
    _append(table, [[_field(row[c]) for c in columns]])


def ensure_tables(names=None):
    """Create the CSV file (header only) of every enabled table that has none
    yet, so an enabled table always exists even when it has no rows."""
    for name in enabled_tables() if names is None else names:
        path = table_path(name)
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            _append(name, [])


# --------------------------------------------------------------------------- #
# What one compiled graph contributes
# --------------------------------------------------------------------------- #
def _nbytes(graph, name, hints=()) -> int:
    """Bytes of a buffer; a symbolic graph's sizes at its size hints."""
    import numpy as np

    shape, dtype = graph.buffer_aval(name)
    n = 1
    for d in shape:
        if not isinstance(d, int):
            from pallaskit.runtime import preload

            preload.wait()
            from lowering import sizes

            d = sizes.hint(d, hints)
        n *= int(d)
    return n * np.dtype(dtype).itemsize


def is_mix_order(kernel) -> bool:
    """A kernel fusing a row reduction with column reductions of the same input
    (Inductor's mix-order reduction; ``Kernel.mix_order`` in the scheduler)."""
    return bool(getattr(kernel, "mix_order", False))


def kernel_stats(result) -> list[dict]:
    """One dict per generated kernel of a ``lowering.CompileResult``: the
    kernel_metadata columns except ``graph``."""
    graph = result.schedule.graph
    configs = {k.name: k.config for k in result.program.kernels}
    out = []
    for k in result.schedule.kernels:
        cfg = configs.get(k.name)
        hints = getattr(result, "size_hints", ())
        read = sum(_nbytes(graph, r, hints) for r in k.reads)
        written = sum(_nbytes(graph, m.name, hints) for m in k.members if m.store)
        out.append(dict(kernel_name=k.name, kind=k.kind, rows=k.rows, cols=k.cols,
                        block_rows=getattr(cfg, "block_rows", None), block_cols=getattr(cfg, "block_cols", None),
                        num_warps=getattr(cfg, "num_warps", None), persistent=getattr(cfg, "persistent", None),
                        bytes_read=read, bytes_written=written, num_equations=len(k.origin)))
    for k in result.program.kernels:  # flash attention ([Note: fused attention] in lowering/attention.py)
        spec = k.config
        if k.name.startswith("att") and hasattr(spec, "tq") and hasattr(spec, "batch"):
            out.append(dict(kernel_name=k.name, kind="attention", rows=math.prod(spec.batch) * spec.tq, cols=spec.tk,
                            block_rows=None, block_cols=None, num_warps=None, persistent=None,
                            bytes_read=_attention_bytes(spec, k.name.endswith("_bwd"))[0],
                            bytes_written=_attention_bytes(spec, k.name.endswith("_bwd"))[1],
                            num_equations=len(k.equations)))
    return out


def _attention_bytes(spec, backward: bool) -> tuple[int, int]:
    """(bytes read, bytes written) of a flash-attention kernel: q, k, v (and O, dO,
    lse backward) read; O and lse (dQ, dK, dV backward) written; masks and biases
    not counted."""
    rows = math.prod(spec.batch)
    item = {"bfloat16": 2, "float16": 2, "float32": 4}[spec.dtype]
    q, k, v = rows * spec.tq * spec.d, rows * spec.tk * spec.d, rows * spec.tk * spec.dv
    o, lse = rows * spec.tq * spec.dv, rows * spec.tq * 4
    if backward:
        return (q + k + v + 2 * o) * item + lse, (q + k + v) * item
    return (q + k + v) * item, o * item + lse


def graph_deltas(result) -> dict:
    """The compile deltas (``COMPILE_DELTA_NAMES``) of one compiled graph."""
    kernels = kernel_stats(result)
    return {
        "graphs_compiled": 1,
        "generated_kernel_count": len(result.program.kernels),
        "fallback_count": len(result.program.externs),
        "ir_nodes_before_fusion": result.schedule.nodes_before,
        "ir_nodes_after_fusion": result.schedule.nodes_after,
        "bytes_accessed": sum(k["bytes_read"] + k["bytes_written"] for k in kernels),
        "codegen_mix_order_reduction": sum(1 for k in result.schedule.kernels if is_mix_order(k)),
    }


def record_graph(title: str, deltas: dict, kernels: list[dict] | None, compile_seconds: float, cache: str):
    """Write the graph_stats row of a graph served (compiled or loaded:
    ``cache`` is 'miss', 'hit' or 'off'), and its kernel_metadata rows when it
    was compiled here. Counters are updated by the caller."""
    enabled = enabled_tables()
    if not enabled:
        return
    ensure_tables(enabled)
    _graph_ids[title] += 1
    graph_id = f"{title}#{_graph_ids[title]}"
    if "kernel_metadata" in enabled and kernels:
        _append("kernel_metadata", [[_field(v) for v in [graph_id] + [k[c] for c in TABLES["kernel_metadata"][1:]]]
                                    for k in kernels])
    if "graph_stats" in enabled:
        log_row("graph_stats", graph_id=graph_id, graph=title,
                num_nodes_before_fusion=deltas.get("ir_nodes_before_fusion", 0),
                num_nodes_after_fusion=deltas.get("ir_nodes_after_fusion", 0),
                num_kernels=deltas.get("generated_kernel_count", 0), num_externs=deltas.get("fallback_count", 0),
                mix_order_reductions=deltas.get("codegen_mix_order_reduction", 0),
                bytes_accessed=deltas.get("bytes_accessed", 0), compile_seconds=float(compile_seconds), cache=cache)
