"""Counters and CSV metric tables."""
import csv
import os

import jax
import jax.numpy as jnp
import pytest

import pallaskit
from pallaskit import metrics


def _rms(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


def _read(folder, table):
    with open(os.path.join(folder, f"{table}.csv"), newline="") as f:
        return list(csv.reader(f))


def test_unknown_table_name_is_an_error_listing_valid_ones(monkeypatch):
    with pytest.raises(ValueError, match="unknown metric table.*no_such_table.*valid tables: kernel_metadata"):
        pallaskit.config.update(enabled_metric_tables="graph_stats,no_such_table")
    monkeypatch.setenv("PALLASKIT_ENABLED_METRIC_TABLES", "kernel_metadta")
    with pytest.raises(ValueError, match="PALLASKIT_ENABLED_METRIC_TABLES.*slow_fusion"):
        pallaskit.config.enabled_metric_tables
    with pytest.raises(ValueError, match="valid tables"):
        metrics.log_row("no_such_table", a=1)


@pytest.mark.no_speculation
def test_tables_have_their_columns_and_rows(tmp_path, rng):
    pallaskit.config.update(enabled_metric_tables=",".join(metrics.TABLES), metrics_dir=str(tmp_path))
    x = jnp.asarray(rng.standard_normal((37, 100)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((100,)), jnp.float32)
    pallaskit.jit(_rms)(x, w)
    pallaskit.jit(lambda a: jnp.sort(a) * 2 + 1)(jnp.ones((5, 6)))  # one kernel, one XLA fallback
    pallaskit.jit(_rms)(x, w)  # a new JitFunction: served by the disk cache

    for table, columns in metrics.TABLES.items():
        assert _read(tmp_path, table)[0] == list(columns), table  # every enabled table exists, header first
    assert len(_read(tmp_path, "slow_fusion")) == 1  # header only

    header, *rows = _read(tmp_path, "kernel_metadata")
    kernels = [dict(zip(header, r)) for r in rows]
    assert len(kernels) == 2  # one per generated kernel; none for the cache hit
    k = kernels[0]
    assert k["graph"] == "_rms#1" and k["kind"] == "reduction" and (k["rows"], k["cols"]) == ("37", "100")
    assert k["bytes_read"] == str(37 * 100 * 2 + 100 * 4) and k["bytes_written"] == str(37 * 100 * 2)
    assert k["persistent"] == "true" and int(k["num_warps"]) > 0 and int(k["num_equations"]) > 0

    header, *rows = _read(tmp_path, "graph_stats")
    graphs = [dict(zip(header, r)) for r in rows]
    assert [g["cache"] for g in graphs] == ["miss", "miss", "hit"]
    assert graphs[2]["graph_id"] == "_rms#2" and graphs[2]["num_kernels"] == graphs[0]["num_kernels"] == "1"
    assert graphs[1]["num_externs"] == "1"
    assert all(len(g["compile_seconds"].split(".")[1]) == 6 for g in graphs)  # floats: six decimals
    assert int(graphs[0]["num_nodes_before_fusion"]) > int(graphs[0]["num_nodes_after_fusion"]) == 1

    c = metrics.counters  # bytes_accessed: the kernels' bytes, replayed once more by the hit
    assert c["bytes_accessed"] == sum(int(g["bytes_accessed"]) for g in graphs)
    assert c["generated_kernel_count"] == 3 and c["fallback_count"] == 1 and c["graphs_compiled"] == 3


def test_log_row_appends_under_one_header(tmp_path):
    pallaskit.config.update(enabled_metric_tables="multi_kernel_choices,kernel_autotune", metrics_dir=str(tmp_path))
    metrics.log_row("kernel_autotune", kernel_name="k0", config="block 8x128, 4 warps", latency_ms=0.1234567,
                    chosen=True)
    metrics.log_row("kernel_autotune", kernel_name="k0", config="block 16x128, 8 warps", latency_ms=1 / 3,
                    chosen=False)
    metrics.log_row("multi_kernel_choices", kernel_name="k1", shape_key="(300, 384)", num_variants=3,
                    chosen_variant=1, timings_ms="0.1;0.09;0.2", method="benchmark")
    assert _read(tmp_path, "kernel_autotune") == [
        list(metrics.TABLES["kernel_autotune"]),
        ["k0", "block 8x128, 4 warps", "0.123457", "true"],
        ["k0", "block 16x128, 8 warps", "0.333333", "false"],
    ]
    assert _read(tmp_path, "multi_kernel_choices")[1] == ["k1", "(300, 384)", "3", "1", "0.1;0.09;0.2", "benchmark"]
    with pytest.raises(ValueError, match="missing: chosen"):
        metrics.log_row("kernel_autotune", kernel_name="k0", config="", latency_ms=0.0)
    with pytest.raises(ValueError, match="unknown: kernel"):  # columns are checked, enabled or not
        metrics.log_row("slow_fusion", kernel=1)
    metrics.log_row("slow_fusion", **dict.fromkeys(metrics.TABLES["slow_fusion"], 1.0))
    assert not os.path.exists(os.path.join(tmp_path, "slow_fusion.csv"))  # not enabled: nothing written
