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
    debug_checks: bool = False  # validate the IR after every pass
    mix_order_reduction: bool = True  # row and column reductions of one input in one kernel
    split_reductions: bool = True  # long reductions with few outputs run in two stages
    layout_propagation: bool = True  # intermediates take their dominant input's stride order
    allow_excess_precision: bool = True  # 16-bit float chains round once, at the store (as XLA's flag)
    num_sms: int = 132  # streaming multiprocessors of the target GPU (grid sizing)
    # dot_general: "auto" (template + epilogues where heuristics.matmul_template_wins, else XLA),
    # "fused" (template + epilogues wherever supported), "unfused" (template alone), "off" (XLA)
    matmul_template: str = "auto"
    # Whole-row mix kernels as raw Triton inside the XLA program (codegen/triton.py
    # ``render_mix``, pallaskit/runtime/triton_call.py) instead of Pallas; resolved
    # by the runtime (GPU with triton installed, or asked for).
    triton_mix_kernels: bool = False
    loop_bodies: bool = True  # compile scan / while / cond bodies as programs of their own (lowering/loops.py)
    # Symbolic (dynamic) dims: (symbol name, size) pairs the heuristics read a
    # symbolic size at (the first concrete call's sizes). Index expressions,
    # masks and grids keep the symbol. Empty for static graphs.
    size_hints: tuple = ()
    # Symbolic graphs run on size buckets (pallaskit/runtime/buckets.py), which
    # only kernels may touch: "auto" then gives a 16-bit dot over a dynamic M the
    # template at every hint, since an XLA dot would make the program per-size.
    bucketed: bool = False

    def hints(self) -> dict:
        return dict(self.size_hints)

    def key(self) -> str:
        """Stable text of every field, for cache keys."""
        return ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
