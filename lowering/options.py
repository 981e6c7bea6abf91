"""The one options object the compiler reads. Built by the runtime from
``pallaskit.config``; the compiler never looks anywhere else."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    interpret: bool = False  # render Pallas calls with interpret=True (CPU)
    fusion: bool = True  # greedy fusion of materialized groups
    max_persistent_cols: int = 8192  # larger reductions loop over column chunks
    online_softmax: bool = True  # a looped max and sum(exp(x - max)) share one sweep ([Note: online softmax])
    # Row reductions past max_persistent_cols: "auto" (heuristics.long_row_persistent),
    # "persistent" (whole rows in one tile up to heuristics.LONG_ROW_MAX_COLS), "looped".
    long_rows: str = "auto"
    num_warps: int = 0  # 0: from the heuristics
    mix_order_reduction: bool = True  # row and column reductions of one input in one kernel
    split_reductions: bool = True  # long reductions with few outputs run in two stages
    allow_excess_precision: bool = True  # bfloat16 chains round once, at the store (as XLA's flag); float16 rounds every op
    num_sms: int = 132  # streaming multiprocessors of the target GPU (grid sizing)
    # dot_general: "auto" (template + epilogues where heuristics.matmul_template_wins, else XLA),
    # "fused" (template + epilogues wherever supported), "unfused" (template alone), "off" (XLA)
    matmul_template: str = "auto"
    # Which executor runs each kernel ([Note: executors] in lowering/executors.py):
    # 'auto' (raw Triton inside XLA on a GPU, Pallas in interpret mode), 'pallas',
    # 'triton' (raw Triton inside XLA; interpret mode: Triton's interpreter).
    kernel_backend: str = "auto"
    # Platform fact resolved by the runtime: the triton package can run kernels
    # here (a CUDA GPU, or interpret mode with triton installed).
    triton_available: bool = False
    # Platform fact resolved by the runtime: the GPU takes looped rows staged in
    # shared memory by Gluon kernels ([Note: staged rows] in codegen/rows.py).
    staged_rows: bool = False
    combo_kernels: bool = True  # independent kernels of different shapes in one launch (lowering/combo.py)
    loop_bodies: bool = True  # compile scan / while / cond bodies as programs of their own (lowering/loops.py)
    # Only the loops whose bodies hold a large 16-bit product (heuristics.loop_body_pays): loop_bodies='auto' on a GPU
    loop_bodies_heavy_only: bool = False
    scan_hoisting: bool = True  # a scan body's input projections as one batched matmul before the loop (scan_hoist.py)
    fused_attention: bool = True  # plain attention and its gradient as flash-attention kernels (attention.py)
    # Scatters with many updates per element whose result depends on the order the
    # atomics land in (float add / mul, a set with repeated indices) run through XLA
    # (with its deterministic-ops flag) instead of raw Triton's atomics ([Note: atomic scatters]).
    deterministic_scatter: bool = False
    # Symbolic (dynamic) dims: (symbol name, size) pairs the heuristics read a
    # symbolic size at (the first concrete call's sizes). Index expressions,
    # masks and grids keep the symbol. Empty for static graphs.
    size_hints: tuple = ()

    def hints(self) -> dict:
        return dict(self.size_hints)

    def key(self) -> str:
        """Stable text of every field, for cache keys."""
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
