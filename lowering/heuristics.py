"""Every block-size, warp and persistence choice, in one place.

Figures behind the choices (H100, bf16, 576000x384, see benchmarks/RESULTS.md):
a persistent row reduction runs best with 2048-4096 elements per program
(rows x next_pow2(cols)); one row per program loses ~20% to launch/scheduling
overhead. Pointwise kernels reach the memory floor with 1024-8192 elements per
program, so we take 1024 with 4 warps and leave the rest to the hardware.
"""
from __future__ import annotations

import dataclasses

from lowering.sizes import next_power_of_2


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_rows: int
    block_cols: int
    num_warps: int
    persistent: bool  # reduction kernels: the whole row in one tile

    @property
    def elements(self):
        return self.block_rows * self.block_cols


def pointwise_config(rows: int, cols: int) -> TileConfig:
    bc = min(next_power_of_2(cols), 1024)
    br = min(next_power_of_2(rows), max(1, 1024 // bc))
    return TileConfig(br, bc, 4, True)


def reduction_config(rows: int, cols: int, *, max_persistent_cols: int, inner_contiguous: bool,
                     force_width_one: bool = False) -> TileConfig:
    """Persistent when the row fits; else loop over column chunks.

    ``inner_contiguous``: the reduced index is the fastest-moving one in memory
    (a row reduction). Otherwise (a column reduction) rows are contiguous, so
    the tile is made tall to keep loads coalesced along rows.
    ``force_width_one``: reductions that only combine in a loop (prod)."""
    if force_width_one:
        return TileConfig(min(next_power_of_2(rows), 128), 1, 4, False)
    width = next_power_of_2(cols)
    if width <= max_persistent_cols:
        br = max(1, min(next_power_of_2(rows), 4096 // width, 64))
        warps = 4 if br * width <= 2048 else 8
        return TileConfig(br, width, warps, True)
    if inner_contiguous:
        return TileConfig(1 if rows < 1024 else 2, 2048, 8, False)
    return TileConfig(min(next_power_of_2(rows), 64), 64, 4, False)
