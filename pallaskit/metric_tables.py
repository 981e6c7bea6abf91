"""The metric tables and their columns (``pallaskit.metrics`` writes them;
``pallaskit.config`` checks the names of option ``enabled_metric_tables``)."""
from __future__ import annotations

TABLES: dict[str, tuple[str, ...]] = {
    # one row per generated kernel, written when a graph is compiled
    "kernel_metadata": ("graph", "kernel_name", "kind", "rows", "cols", "block_rows", "block_cols", "num_warps",
                        "persistent", "bytes_read", "bytes_written", "num_equations"),
    # one row per (kernel, runtime shape) choice among multi-kernel variants
    "multi_kernel_choices": ("kernel_name", "shape_key", "num_variants", "chosen_variant", "timings_ms", "method"),
    # one row per benchmarked kernel configuration
    "kernel_autotune": ("kernel_name", "config", "latency_ms", "chosen"),
    # one row per graph served, compiled or loaded from the cache
    "graph_stats": ("graph_id", "graph", "num_nodes_before_fusion", "num_nodes_after_fusion", "num_kernels",
                    "num_externs", "mix_order_reductions", "bytes_accessed", "compile_seconds", "cache"),
    # fusions that measured slower than the kernels they replaced
    "slow_fusion": ("kernel1_name", "kernel1_latency_ms", "kernel2_name", "kernel2_latency_ms",
                    "fused_kernel_name", "fused_latency_ms", "slow_down_ratio"),
}
