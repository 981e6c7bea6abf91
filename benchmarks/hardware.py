"""The machine constants every floor is computed from, in one place.

Floors are fixed numbers of the H100 80GB HBM3 the suite is run on (measured
or from the datasheet), so that results of different runs compare; each run
also measures its own copy bandwidth and prints it beside them.
"""
from __future__ import annotations

DEVICE = "H100 80GB HBM3"

# Device-to-device copy, bytes read + bytes written per second (measured on the H100: 3.0 TB/s).
COPY_BANDWIDTH = 3.0e12

# Dense matrix-unit rate, FLOP/s (datasheet, SXM). A measured 8192^3 bf16 product
# reaches about 800 TFLOP/s; the floor uses the datasheet figure.
MATMUL_FLOPS = {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}  # float32: TF32

# L2 cache. Inputs smaller than L2_ROTATE_BELOW are rotated among several sets
# (fresh random data each) whose footprint reaches L2_ROTATE_FOOTPRINT, so that a
# timed call never finds its inputs in L2 from the call before.
L2_BYTES = 50e6
L2_ROTATE_BELOW = 2 * L2_BYTES
L2_ROTATE_FOOTPRINT = 4 * L2_BYTES
MAX_INPUT_SETS = 32


def floor_ms(bytes_moved: float, flops: float = 0.0, dtype: str = "bfloat16") -> float:
    """The time no implementation beats: the larger of bytes over copy bandwidth
    and matrix FLOPs over the matrix-unit rate, in milliseconds."""
    t = bytes_moved / COPY_BANDWIDTH
    if flops:
        t = max(t, flops / MATMUL_FLOPS.get(dtype, MATMUL_FLOPS["float32"]))
    return t * 1e3


def input_sets(set_bytes: int) -> int:
    """How many input sets to rotate among so the timed loop does not run from L2."""
    if set_bytes <= 0 or set_bytes >= L2_ROTATE_BELOW:
        return 1
    return int(min(MAX_INPUT_SETS, -(-L2_ROTATE_FOOTPRINT // set_bytes)))
