"""Raw-Triton renderer: a schedule as ``@triton.jit`` kernels plus a Python
``launch`` that runs them outside XLA (pallaskit/runtime/eager.py).

[Note: the Triton renderer]
The same schedule, tiles and index expressions as the Pallas renderer: the
kernel emitter of ``codegen/emitter.py`` writes the values, with the Triton
dialect below (``tl.load(ptr + offset, mask=...)``, ``x.to(tl.float32)``,
an op table of ``tl`` calls). What differs is around the values: sizes are
kernel arguments (ints, never specialized by the launcher), so one compiled
kernel serves every size of a dynamic dim; tiles are constexprs; loops are
Python ``for`` loops over static trip counts. The module's ``launch(run, kernels,
*inputs)`` reads the dynamic sizes from the inputs' shapes, allocates every
stored buffer at its own shape (``run.empty``: kernels index memory flat, so
no reshape runs), launches each kernel with its grid and returns the outputs.

Rendered today: pointwise kernels (flat, rows x columns, transposed tiles), row
reductions (persistent or looped; over a dynamic axis always looped, the chunk
count a runtime value), mix kernels (``render_mix``: whole rows with column
sums; ``render_column``: split column sums in column tiles; over dynamic rows
the programs are sized at the hint and walk a runtime count of row blocks),
and the matmul template with its epilogue (a dynamic M too). Every op and row
reduction of the Pallas renderer's table is written ([Note: Triton math];
tests/test_triton_ops.py checks the tables match). Anything else raises
``TritonUnsupported`` and the program keeps its XLA path (or, inside XLA, the
kernel its Pallas form): XLA externs. Triton's interpreter multiplies bfloat16
``tl.dot`` operands wrongly, so in interpret mode the template widens them to
float32 first; its other faults are patched in pallaskit/runtime/triton_launch.py.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np

from lowering import heuristics, ir, sizes
from lowering.codegen import matmul
from lowering.codegen.emitter import (KernelEmitter, dim_source, is_16bit_float, is_float,
                                      kernel_coords_body, select_n_template, shape_source, used_dims,
                                      whole_rows, write_pointwise)
from lowering.codegen.emitter import columns as column_count
from lowering.codegen.mix import write_mix
from lowering.codegen.rows import render_rows
from lowering.codegen.tiles import kernel_config, reduction_is_inner
from lowering.codegen.writer import SourceWriter
from lowering.options import CompileOptions
from lowering.scheduler import Kernel, Schedule, _origins
from lowering.symbolic import program_dims


class TritonUnsupported(NotImplementedError):
    """The schedule has something this renderer does not write; the message says what."""


_TL_DTYPES = {"bool": "tl.int1", "int8": "tl.int8", "int16": "tl.int16", "int32": "tl.int32",
              "int64": "tl.int64", "uint8": "tl.uint8", "uint16": "tl.uint16", "uint32": "tl.uint32",
              "uint64": "tl.uint64", "float16": "tl.float16", "bfloat16": "tl.bfloat16",
              "float32": "tl.float32", "float64": "tl.float64"}


@functools.lru_cache(maxsize=None)
def _dtype_name(dt) -> str:
    return np.dtype(dt).name  # memoized: numpy computes a dtype's name in Python each time


_NAN_MAX = "tl.maximum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"
_NAN_MIN = "tl.minimum({0}, {1}, propagate_nan=tl.PropagateNan.ALL)"
# A 16-bit float's square root, computed in float32: PTX's approximate square
# root (within an ulp of float32's, far under a 16-bit result's rounding) in its
# form that keeps subnormals (tl.sqrt's is .ftz); float32 results keep sqrt_rn.
# The correctly rounded form slowed bf16 pointwise chains (RESULTS.md,
# "Session 22").
_SQRT_APPROX = ("tl.inline_asm_elementwise('sqrt.approx.f32 $0, $1;', '=f,f', [{0}], dtype=tl.float32, "
                "is_pure=True, pack=1)")
OPS = {
    "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "neg": "(-{0})",  # ints; floats: op_template
    "square": "({0} * {0})", "abs": "tl.abs({0})",
    "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})", "tanh": "_tanh({0})",
    "logistic": "tl.sigmoid({0})", "sqrt": "tl.sqrt_rn({0})", "rsqrt": "(1.0 / tl.sqrt_rn({0}))",
    "erf": "_erf({0})", "erfc": "_erfc({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
    "floor": "tl.floor({0})", "ceil": "tl.ceil({0})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
    "gt": "({0} > {1})", "ge": "({0} >= {1})",
    "and": "({0} & {1})", "or": "({0} | {1})", "xor": "({0} ^ {1})",
}

# Transcendentals ([Note: Triton math]): op -> (libdevice function on a GPU,
# float64 helper in the interpreter).
_MATH = {
    "atan2": ("atan2", "_atan2_64"), "log1p": ("log1p", "_log1p64"), "expm1": ("expm1", "_expm1_64"),
    "cbrt": ("cbrt", "_cbrt64"), "tan": ("tan", "_tan64"), "asin": ("asin", "_asin64"),
    "acos": ("acos", "_acos64"), "atan": ("atan", "_atan64"), "sinh": ("sinh", "_sinh64"),
    "cosh": ("cosh", "_cosh64"), "asinh": ("asinh", "_asinh64"), "acosh": ("acosh", "_acosh64"),
    "atanh": ("atanh", "_atanh64"),
}

HELPERS = {
    "_cbrt32": '''
@triton.jit
def _cbrt32(x):
    """libdevice's float32 cbrt, subnormals kept as XLA keeps them: Triton compiles
    libdevice with FTZ, and its cbrt gave NaN for every subnormal. Those are scaled
    into the normal range first: cbrt(x * 2^24) = cbrt(x) * 2^8, both exact."""
    tiny = tl.abs(x) < 1.1754943508222875e-38
    return tl.where(tiny, libdevice.cbrt(x * 16777216.0) * 0.00390625, libdevice.cbrt(x))
''',
    "_atan2_32": '''
@triton.jit
def _atan2_32(y, x):
    """libdevice's float32 atan2, subnormals kept as XLA keeps them: with FTZ a
    subnormal operand counted as 0 (two tiny operands gave pi where XLA gives pi/2).
    Where one operand is under 2^-100 and neither reaches 2^27, both are scaled by
    2^100 first: the angle is the same. (Past 2^27 a tiny operand moves the angle
    only below float32's normal range.)"""
    ay = tl.abs(y)
    ax = tl.abs(x)
    tiny = (tl.minimum(ay, ax) < 7.888609052210118e-31) & (tl.maximum(ay, ax) < 134217728.0)
    s = tl.where(tiny, 1.2676506002282294e30, 1.0)
    return libdevice.atan2(y * s, x * s)
''',
    "_tanh": '''
@triton.jit
def _tanh(x):
    """tanh in float32 in the interpreter (the GPU calls libdevice): its odd Taylor series up to x^15 below |x| = 0.4 (no
    cancellation; the first term left out is < 1e-10 relative there), else
    (1 - e^-2|x|) / (1 + e^-2|x|) with the sign of x (e^-2|x| < 0.45, so
    1 - e^-2|x| loses under a bit); tanh(-0) is -0, which the series' sum is not."""
    a = tl.abs(x)
    x2 = x * x
    p = x2 * (-929569.0 / 638512875.0) + 21844.0 / 6081075.0
    p = p * x2 + -1382.0 / 155925.0
    p = p * x2 + 62.0 / 2835.0
    p = p * x2 + -17.0 / 315.0
    p = p * x2 + 2.0 / 15.0
    p = p * x2 + -1.0 / 3.0
    series = x + x * (x2 * p)
    t = tl.exp(-2.0 * a)
    r = (1.0 - t) / (1.0 + t)
    return tl.where(a == 0.0, x, tl.where(a < 0.4, series, tl.where(x < 0, -r, r)))
''',
    "_erf": '''
@triton.jit
def _erf(x):
    """erf as XLA computes it for float32, as the Pallas renderer's _erf
    (tl.erf is libdevice's on a GPU, and Python's math.erf in the interpreter)."""
    x2 = x * x
    p = x2 * 2.2905065861350646e-04 + 3.4082910107109506e-03
    p = p * x2 + 5.0955695062380861e-02
    p = p * x2 + 1.8520832239976145e-01
    p = p * x2 + 1.128379143519084
    q = x2 * -1.1791602954361697e-07 + 2.3547966471313185e-05
    q = q * x2 + 1.0179625278914885e-03
    q = q * x2 + 1.4070470171167667e-02
    q = q * x2 + 1.1098505178285362e-01
    q = q * x2 + 4.9746925110067538e-01
    q = q * x2 + 1.0
    return tl.where(tl.abs(x) >= 3.832506856900711, tl.where(x < 0, -1.0, 1.0), x * p / q)
''',
    "_erfc": '''
@triton.jit
def _erfc(x):
    """erfc as XLA expands it for float32, as the Pallas renderer's _erfc
    (codegen/pallas.py says how); not 1 - erf(x), which is 0 from x ~ 3.9."""
    ax = tl.abs(x)
    x2 = x * x
    t = x2 * 7.853861353153693e-05 + -8.010193625184903e-04
    t = t * x2 + 5.188327685732524e-03
    t = t * x2 + -2.685381193529856e-02
    t = t * x2 + 1.128358514861418e-01
    t = t * x2 + -3.761262582423300e-01
    t = t * x2 + 1.128379165726710e+00
    small = 1.0 - x * t
    r = 1.0 / x2
    p = r * 2.326819970068386e-02 + -1.387039388740657e-01
    p = p * r + 3.687424674597105e-01
    p = p * r + -5.824733027278666e-01
    p = p * r + 6.210004621745983e-01
    p = p * r + -4.944515323274145e-01
    p = p * r + 3.404879937665872e-01
    p = p * r + -2.741127028184656e-01
    p = p * r + 5.638259427386472e-01
    q = r * -1.047766399936249e+01 + 1.297719955372516e+01
    q = q * r + -7.495518717768503e+00
    q = q * r + 2.921019019210786e+00
    q = q * r + -1.015265279202700e+00
    q = q * r + 4.218463358204948e-01
    q = q * r + -2.820767439740514e-01
    q = q * r + 5.641895067754075e-01
    z = -x2
    big = tl.exp(z) * (1.0 / ax) * tl.where(ax < 2.0, p, q)
    big = tl.where(z < -88.72283905206835, 0.0, big)
    big = tl.where(x < 0.0, 2.0 - big, big)
    return tl.where(ax < 1.0, small, big)
''',
    "_idiv": '''
@triton.jit
def _idiv(x, y):
    """Integer lax.div (Triton's // truncates) with XLA's results where the
    hardware's are undefined: x / 0 is -1 (all ones), INT_MIN / -1 is INT_MIN."""
    zero = y == 0
    one = (y ^ y) + 1
    if x.dtype.is_int_signed():
        neg1 = y == -1
        q = x // tl.where(zero | neg1, one, y)
        q = tl.where(neg1, (x ^ x) - x, q)
    else:
        q = x // tl.where(zero, one, y)
    return tl.where(zero, (x ^ x) - 1, q)  # all ones (~ xors with a -1 constant: not for unsigned)
''',
    "_irem": '''
@triton.jit
def _irem(x, y):
    """Integer lax.rem (C's srem / urem) with XLA's results where the hardware's
    are undefined: x % 0 is x, INT_MIN % -1 is 0."""
    zero = y == 0
    one = (y ^ y) + 1
    if x.dtype.is_int_signed():
        r = x % tl.where(zero | (y == -1), one, y)
    else:
        r = x % tl.where(zero, one, y)
    return tl.where(zero, x, r)
''',
}

for _op in ("max", "min"):
    HELPERS[f"_{_op}_nan"] = f'''
@triton.jit
def _{_op}_nan(a, b):
    return tl.{_op}imum(a, b, propagate_nan=tl.PropagateNan.ALL)
'''

HELPERS["_mul"] = """
@triton.jit
def _mul(a, b):
    return a * b
"""

# [Note: Triton math]
# On a GPU the transcendental functions are libdevice's, as Pallas's Triton
# lowering takes them (XLA:GPU calls libdevice for atan2, tan, log1p, expm1,
# pow, cbrt and builds the inverse and hyperbolic functions from such calls:
# a few ULP apart, tests/test_accuracy.py's GPU bounds); erf_inv is XLA's own
# single-precision polynomial (Giles), rounding and nextafter XLA's exact
# bit-level forms, shifts XLA's (every bit out past the width). The interpreter
# has no libdevice (extern calls raise), so there the helpers below compute in
# float64 with numpy's exp / log / sin / cos and round once: within an ULP of
# a correctly rounded float32, as accurate as jax.jit's XLA:CPU or more.
# Two Triton traps: unary minus is ``0 - x`` (+0.0 for +0.0: float neg flips
# the sign bit, [Note: float neg flips the sign bit]), and the interpreter's
# bfloat16 is not IEEE (its float32 -> bfloat16 cast truncates, its float64 one
# reads the value as bits, its compares miss NaN): pallaskit patches its casts
# to round (pallaskit/runtime/triton_launch.py ``_rounding_cast``), and 16-bit
# compares are made in float32.
HELPERS.update({
    "_log1p64": """
@triton.jit
def _log1p64(x):
    \"\"\"log1p (float64 in the interpreter): log(u) * x / (u - 1) with u = 1 + x
    rounded (Goldberg), x itself where u rounds to 1.\"\"\"
    u = x + 1.0
    d = u - 1.0
    r = tl.log(u) * (x / tl.where(d == 0.0, 1.0, d))
    r = tl.where(d == 0.0, x, r)
    return tl.where(u == float('inf'), u, r)
""",
    "_expm1_64": """
@triton.jit
def _expm1_64(x):
    \"\"\"expm1 (float64 in the interpreter): (u - 1) * x / log(u) with u = e^x
    (Kahan), x where u rounds to 1, -1 where u - 1 does.\"\"\"
    u = tl.exp(x)
    lu = tl.log(u)
    r = (u - 1.0) * (x / tl.where(lu == 0.0, 1.0, lu))
    r = tl.where(u == 1.0, x, r)
    r = tl.where(u - 1.0 == -1.0, -1.0, r)
    return tl.where(u == float('inf'), u, r)
""",
    "_atan01_64": """
@triton.jit
def _atan01_64(t):
    \"\"\"atan of t in [0, 1] in float64 (Cephes' atan: a rational function,
    about pi/4 past 0.66).\"\"\"
    big = t > 0.66
    x = tl.where(big, (t - 1.0) / (t + 1.0), t)
    z = x * x
    p = z * -8.750608600031904122785e-01 + -1.615753718733365076637e+01
    p = p * z + -7.500855792314704667340e+01
    p = p * z + -1.228866684490136173410e+02
    p = p * z + -6.485021904942025371773e+01
    q = z + 2.485846490142306297962e+01
    q = q * z + 1.650270098316988542046e+02
    q = q * z + 4.328810604912902668951e+02
    q = q * z + 4.853903996359136964868e+02
    q = q * z + 1.945506571482613964425e+02
    r = x + x * (z * p / q)
    return tl.where(big, 0.7853981633974483 + r, r)
""",
    "_atan2_64": """
@triton.jit
def _atan2_64(y, x):
    \"\"\"atan2 (float64 in the interpreter) with C's special cases: the signs of
    zeros pick the quadrant, atan2(+-inf, +-inf) is an odd multiple of pi/4.\"\"\"
    ax = tl.abs(x)
    ay = tl.abs(y)
    hi = tl.maximum(ax, ay)
    t = tl.minimum(ax, ay) / tl.where(hi == 0.0, 1.0, hi)
    t = tl.where((ax == float('inf')) & (ay == float('inf')), 1.0, t)
    r = _atan01_64(t)
    r = tl.where(ay > ax, 1.5707963267948966 - r, r)
    r = tl.where((x < 0.0) | ((x == 0.0) & (1.0 / tl.where(x == 0.0, x, 1.0) < 0.0)), 3.141592653589793 - r, r)
    r = tl.where((y < 0.0) | ((y == 0.0) & (1.0 / tl.where(y == 0.0, y, 1.0) < 0.0)), r * -1.0, r)
    return tl.where((x != x) | (y != y), x + y, r)
""",
    "_tan64": """
@triton.jit
def _tan64(x):
    return tl.sin(x) / tl.cos(x)
""",
    "_asin64": """
@triton.jit
def _asin64(x):
    \"\"\"asin as XLA expands it: 2 atan2(x, 1 + sqrt(1 - x^2)).\"\"\"
    return 2.0 * _atan2_64(x, 1.0 + tl.sqrt(1.0 - x * x))
""",
    "_acos64": """
@triton.jit
def _acos64(x):
    \"\"\"acos as XLA expands it: 2 atan2(sqrt(1 - x^2), 1 + x), pi at -1.\"\"\"
    return tl.where(x != -1.0, 2.0 * _atan2_64(tl.sqrt(1.0 - x * x), 1.0 + x), 3.141592653589793)
""",
    "_atan64": """
@triton.jit
def _atan64(x):
    return _atan2_64(x, tl.full(x.shape, 1.0, x.dtype))
""",
    "_tanh64": """
@triton.jit
def _tanh64(x):
    \"\"\"tanh (float64 in the interpreter) from expm1 (no cancellation near 0):
    -s / (2 + s) with s = e^-2|x| - 1 and the sign of x; tanh(-0) is -0.\"\"\"
    s = _expm1_64(-2.0 * tl.abs(x))
    r = (s * -1.0) / (2.0 + s)
    return tl.where(x < 0.0, r * -1.0, tl.where(x == 0.0, x, r))
""",
    "_sinh64": """
@triton.jit
def _sinh64(x):
    \"\"\"sinh from expm1 (no cancellation near 0): (s + s / (s + 1)) / 2, s = e^|x| - 1.\"\"\"
    s = _expm1_64(tl.abs(x))
    r = tl.where(s == float('inf'), s, 0.5 * (s + s / (s + 1.0)))
    return tl.where(x < 0.0, r * -1.0, tl.where(x == 0.0, x, r))
""",
    "_cosh64": """
@triton.jit
def _cosh64(x):
    return 0.5 * (tl.exp(x) + tl.exp(-x))
""",
    "_asinh64": """
@triton.jit
def _asinh64(x):
    \"\"\"asinh as XLA expands it: log1p(|x| + x^2 / (1 + sqrt(1 + x^2))) with x's
    sign, log(|x|) + log(2) for huge |x|.\"\"\"
    a = tl.abs(x)
    r = _log1p64(a + a * a / (1.0 + tl.sqrt(1.0 + a * a)))
    r = tl.where(a > 1e18, tl.log(a) + 0.6931471805599453, r)
    return tl.where(x < 0.0, r * -1.0, tl.where(x == 0.0, x, r))
""",
    "_acosh64": """
@triton.jit
def _acosh64(x):
    \"\"\"acosh: log1p((x - 1) + sqrt((x - 1)(x + 1))), log(x) + log(2) for huge x.\"\"\"
    r = _log1p64((x - 1.0) + tl.sqrt((x - 1.0) * (x + 1.0)))
    r = tl.where(x < 1.0, float('nan'), r)
    return tl.where(x > 1e18, tl.log(x) + 0.6931471805599453, r)
""",
    "_atanh64": """
@triton.jit
def _atanh64(x):
    return 0.5 * _log1p64(2.0 * x / (1.0 - x))
""",
    "_cbrt64": """
@triton.jit
def _cbrt64(x):
    a = tl.abs(x)
    r = tl.exp2(tl.log2(a) * (1.0 / 3.0))
    return tl.where(x < 0.0, r * -1.0, tl.where((x == 0.0) | (x != x), x, r))
""",
    "_pow64": """
@triton.jit
def _pow64(x, y):
    \"\"\"C's pow (float64 in the interpreter): exp2(y log2|x|), the sign of an odd
    integer power of a negative base (or -0), NaN for a non-integer one;
    pow(x, 0) and pow(1, y) are 1, pow(-1, +-inf) too.\"\"\"
    r = tl.exp2(y * tl.log2(tl.abs(x)))
    yint = tl.floor(y) == y
    yodd = yint & (tl.floor(y * 0.5) * 2.0 != y)
    xneg = (x < 0.0) | ((x == 0.0) & (1.0 / tl.where(x == 0.0, x, 1.0) < 0.0))
    r = tl.where(xneg & yodd, r * -1.0, r)
    r = tl.where((x < 0.0) & (x > float('-inf')) & ~yint, float('nan'), r)
    one = (y == 0.0) | (x == 1.0) | ((x == -1.0) & (tl.abs(y) == float('inf')))
    return tl.where(one, 1.0, r)
""",
    "_erfinv": """
@triton.jit
def _erfinv(x, w):
    \"\"\"erf_inv as XLA computes float32 erf_inv (Giles' polynomials in
    w = -log1p(-x^2), given), +-inf at +-1.\"\"\"
    lo = w - 2.5
    p = lo * 2.81022636e-08 + 3.43273939e-07
    p = p * lo + -3.5233877e-06
    p = p * lo + -4.39150654e-06
    p = p * lo + 0.00021858087
    p = p * lo + -0.00125372503
    p = p * lo + -0.00417768164
    p = p * lo + 0.246640727
    p = p * lo + 1.50140941
    hi = tl.sqrt(w) - 3.0
    q = hi * -0.000200214257 + 0.000100950558
    q = q * hi + 0.00134934322
    q = q * hi + -0.00367342844
    q = q * hi + 0.00573950773
    q = q * hi + -0.0076224613
    q = q * hi + 0.00943887047
    q = q * hi + 1.00167406
    q = q * hi + 2.83297682
    r = tl.where(w < 5.0, p, q) * x
    return tl.where(tl.abs(x) == 1.0, x * float('inf'), r)
""",
    "_tf32": """
@triton.jit
def _tf32(x):
    \"\"\"A float32 rounded to TF32 to nearest, ties away (as cuBLAS and XLA's
    Triton pipeline feed TF32 tensor cores; the tensor core alone truncates).\"\"\"
    return tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)
""",
    "_rnd": """
@triton.jit
def _rnd(x, EVEN: tl.constexpr):
    \"\"\"lax.round of a float: half away from zero, or (EVEN) half to even;
    -0, +-inf and NaN are their own rounding.\"\"\"
    a = tl.abs(x)
    fl = tl.floor(a)
    frac = a - fl
    if EVEN:
        odd = (fl - 2.0 * tl.floor(fl * 0.5)) != 0.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), fl + 1.0, fl)
    else:
        r = tl.where(frac >= 0.5, fl + 1.0, fl)
    return tl.where(x < 0.0, r * -1.0, tl.where(x > 0.0, r, x))
""",
})

# nextafter on the float's bits as XLA's elemental emitter writes it: NaN if
# either is NaN, y if x == y, the smallest subnormal toward y from +-0, else
# the bits of x one step toward y.
for _bits in (16, 32, 64):
    _wide = ".to(tl.float32)" if _bits == 16 else ""  # 16-bit floats compared in float32 (exact)
    HELPERS[f"_nextafter{_bits}"] = f"""
@triton.jit
def _nextafter{_bits}(x, y):
    xf = x{_wide}
    yf = y{_wide}
    xi = x.to(tl.int{_bits}, bitcast=True)
    yi = y.to(tl.int{_bits}, bitcast=True)
    sign = xi ^ xi | {-(1 << (_bits - 1))}
    xa = xi & ~sign
    ya = yi & ~sign
    xs = xi & sign
    ys = yi & sign
    step = tl.where((xa > ya) | (xs != ys), xi - 1, xi + 1)
    r = tl.where(xa == 0, tl.where(ya == 0, yi, ys | 1), step)
    r = tl.where(xf == yf, yi, r).to(tl.int{_bits})
    return tl.where((xf != xf) | (yf != yf), (xf + yf).to(x.dtype), r.to(x.dtype, bitcast=True))
"""

# Bit counts in the interpreter (no libdevice): SWAR population count, clz as
# the width less the population of the bits smeared right from the top one.
for _bits, _u in ((32, "tl.uint32"), (64, "tl.uint64")):
    _m1, _m2, _m4 = (int(("55", "33", "0f")[i] * (_bits // 8), 16) for i in range(3))
    HELPERS[f"_popc{_bits}"] = f"""
@triton.jit
def _popc{_bits}(x):
    v = x.to({_u}, bitcast=True)
    v = v - ((v >> 1) & {_m1})
    v = (v & {_m2}) + ((v >> 2) & {_m2})
    v = (v + (v >> 4)) & {_m4}
    v = v + (v >> 8)
    v = v + (v >> 16)
    {"v = v + (v >> 32)" if _bits == 64 else ""}
    return (v & 127).to(x.dtype, bitcast=True)
"""
    _smear = "\n    ".join(f"v = v | (v >> {s})" for s in (1, 2, 4, 8, 16, 32) if s < _bits)
    HELPERS[f"_clz{_bits}"] = f"""
@triton.jit
def _clz{_bits}(x):
    v = x.to({_u}, bitcast=True)
    {_smear}
    return {_bits} - _popc{_bits}(v.to(x.dtype, bitcast=True))
"""

HELPERS.update({
    "_arg_pick": """
@triton.jit
def _arg_pick(x, idx, LARGEST: tl.constexpr):
    \"\"\"argmax / argmin along axis 1 (kept) of a float tile whose lane j holds
    the candidate of index idx[j]: the first NaN, else the smallest index of the
    best value (-0.0 and 0.0 equal), as jax picks.\"\"\"
    nan = x != x
    anynan = tl.max(nan.to(tl.int32), 1, keep_dims=True) > 0
    if LARGEST:
        best = tl.max(tl.where(nan, float('-inf'), x), 1, keep_dims=True)
    else:
        best = tl.min(tl.where(nan, float('inf'), x), 1, keep_dims=True)
    hit = tl.where(anynan, nan, x == best)
    return tl.min(tl.where(hit, idx, 2147483647), 1, keep_dims=True)
""",
    "_arg_pick_int": """
@triton.jit
def _arg_pick_int(x, idx, LARGEST: tl.constexpr):
    \"\"\"_arg_pick of an int tile.\"\"\"
    if LARGEST:
        best = tl.max(x, 1, keep_dims=True)
    else:
        best = tl.min(x, 1, keep_dims=True)
    return tl.min(tl.where(x == best, idx, 2147483647), 1, keep_dims=True)
""",
})


def _helper_deps() -> dict:
    """Each helper's helpers (called in its source), transitively."""
    import re
    direct = {h: {g for g in HELPERS if g != h and re.search(rf"(?<![\w.]){g}\(", src)} for h, src in HELPERS.items()}
    closed = {}
    for h in HELPERS:
        seen, todo = set(), list(direct[h])
        while todo:
            g = todo.pop()
            if g not in seen:
                seen.add(g)
                todo.extend(direct[g])
        closed[h] = seen
    return closed


_HELPER_DEPS = _helper_deps()


class _HelperSet(set):
    """A kernel's helpers: adding one adds the helpers it calls."""

    def add(self, h):
        super().add(h)
        super().update(_HELPER_DEPS.get(h, ()))

    def update(self, *others):
        for hs in others:
            for h in hs:
                self.add(h)


_PRELUDE = '''\
import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice
'''
# What a module holding a Gluon kernel imports besides ([Note: staged rows] in codegen/rows.py).
GLUON_IMPORTS = '''\
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
'''


@dataclasses.dataclass
class TritonKernelSource:
    name: str
    num_warps: int
    num_stages: int


@dataclasses.dataclass
class TritonProgram:
    source: str  # the module: prelude, helpers, ``@triton.jit`` kernels, ``launch``
    kernels: list[TritonKernelSource]


class TritonEmitter(KernelEmitter):
    """The kernel emitter's Triton spellings (see the module's Note)."""
    HELPERS = HELPERS
    DECORATOR = "@triton.jit"
    staged_vec = 0  # a staged window's vector ([Note: staged rows]: StagedRowEmitter), once staged
    MINIMUM = "tl.minimum"
    FUNCTIONS = {"exp": "tl.exp({0})", "is_finite": "(({0} - {0}) == 0)", "and": "({0} & {1})", "or": "({0} | {1})"}
    SKIP_ZERO_SELECT = True
    REDUCTION_REGION = True

    def __init__(self, kernel, schedule, cfg, options):
        super().__init__(kernel, schedule, cfg, options)
        self.helpers = _HelperSet(self.helpers)
        # Two sweeps (max, then sum(exp)) measured faster than the online sweep in raw
        # Triton (heuristics.TRITON_ONLINE_SOFTMAX; RESULTS.md, "Cross-entropy: raw
        # Triton's online softmax"); Pallas keeps it.
        self.online_softmax = self.online_softmax and heuristics.TRITON_ONLINE_SOFTMAX

    def index_type(self, wide: bool) -> str:
        return "tl.int64" if wide else "tl.int32"

    def dtype_text(self, dt) -> str:
        name = _dtype_name(dt)
        if name not in _TL_DTYPES:
            raise TritonUnsupported(f"dtype {name}")
        return _TL_DTYPES[name]

    def full_text(self, value, dtype=None) -> str:
        if value == "-0.0" and dtype in ("tl.float32", "tl.bfloat16", "tl.float16"):
            # Triton folds the literal -0.0 to 0.0: a float32 with only the sign bit set.
            zero = f"{self.full_call('(1, 1)', -2147483648, 'tl.int32')}.to(tl.float32, bitcast=True)"
            return zero if dtype == "tl.float32" else f"{zero}.to({dtype})"
        if dtype in ("tl.bfloat16", "tl.float16"):  # the interpreter has no 16-bit constants: round one
            return f"{self.full_call('(1, 1)', value, 'tl.float32')}.to({dtype})"
        return self.full_call("(1, 1)", value, dtype or "tl.int1")

    def full_call(self, shape, value, dtype) -> str:
        """A tensor of ``shape`` filled with ``value``: what every constant and tile is made from."""
        return f"tl.full({shape}, {value}, {dtype})"

    def cast_text(self, var, dt) -> str:
        if np.dtype(dt) == np.bool_:
            return f"({var} != 0)"
        return f"{var}.to({self.dtype_text(dt)})"

    def broadcast_text(self, var, shape) -> str:
        return f"tl.broadcast_to({var}, {shape})"

    def tile_text(self, shape, value, dtype) -> str:
        return self.full_call(shape, value, dtype)

    def zeros_text(self, shape, dtype) -> str:
        return f"tl.zeros({shape}, dtype={dtype})"

    def where_text(self, cond, a, b) -> str:
        return f"tl.where({cond}, {a}, {b})"

    def maximum_text(self, a, b) -> str:
        return f"tl.maximum({a}, {b})"

    def plain_reduce_text(self, fn, var, axis) -> str:
        return f"tl.{fn}({var}, axis={axis}, keep_dims=True)"

    def reduce_text(self, op, var, acc_dt, axis, index="xc") -> str:
        """A float max / min reduces with a NaN-propagating combine: tl.max /
        tl.min combine with tl.maximum's default, which drops NaN on the GPU (the
        interpreter's numpy keeps it). argmax / argmin (along axis 1): ``index``
        holds each lane's column index (``xc``, or a looped reduction's index
        accumulator)."""
        if op in ("argmax", "argmin"):
            helper = "_arg_pick" if is_float(acc_dt) else "_arg_pick_int"
            self.helpers.add(helper)
            return f"{helper}({var}, {index}, {op == 'argmax'})"
        if op == "prod":
            self.helpers.add("_mul")
            return f"tl.reduce({var}, {axis}, _mul, keep_dims=True)"
        if op in ("max", "min") and is_float(acc_dt):
            self.helpers.add(f"_{op}_nan")
            return f"tl.reduce({var}, {axis}, _{op}_nan, keep_dims=True)"
        return f"{REDUCE[op]}({var}, axis={axis}, keep_dims=True)"

    def combine_text(self, op, acc, v, acc_dt) -> str:
        return COMBINE[op].format(a=acc, v=v)

    def column_acc_dtype(self, dt):
        """float32 for 16-bit floats: the loop carries one type, and XLA sums
        16-bit floats in float32 too."""
        return np.dtype(np.float32) if is_16bit_float(dt) else super().column_acc_dtype(dt)

    def arg_index_dtype(self, node_dtype):
        return self.index_dtype_np

    def arg_finish(self, name, op, acc_dt, idx_dt) -> str:
        return self.reduce_text(op, name, acc_dt, 1, index=f"{name}_i")

    def loop(self, name, index, start, stop, carried, body, stages=None, comment="") -> None:
        """A Python ``for`` over ``range`` (``tl.range`` with ``num_stages`` where
        ``stages`` is given: Triton pipelines the loads of the next iterations);
        the carried values are rebound at the end of the body."""
        w = self.w
        over = f"tl.range({start}, {stop}, num_stages={stages})" if stages else f"range({start}, {stop})"
        w.line(f"for {index} in {over}:" + (f"  # {comment}" if comment else ""))
        with w.indent():
            outs = body()
            for c, o in zip(carried, outs):
                if o != c:
                    w.line(f"{c} = {o}")

    def pid_line(self) -> str:
        return f"pid = tl.program_id(0){'' if self.index_dtype == 'tl.int32' else f'.to({self.index_dtype})'}"

    def iota_text(self, axis, block) -> str:
        text = f"tl.arange(0, {block})[{':, None' if axis == 0 else 'None, :'}]"
        return text if self.index_dtype == "tl.int32" else f"{text}.to({self.index_dtype})"

    def op_template(self, e, names) -> str:
        params = dict(e.params)
        float_op = is_float(e.dtype) or any(is_float(a.dtype) for a in e.args)
        if e.op in ("max", "min"):
            return (_NAN_MAX if e.op == "max" else _NAN_MIN) if float_op else f"tl.{e.op}imum({{0}}, {{1}})"
        if e.op in ("div", "rem") and not float_op:  # by 0, INT_MIN / -1: undefined in Triton (PTX)
            return f"_i{e.op}({{0}}, {{1}})"
        if e.op == "div":
            return "({0} / {1})" if float_op else "({0} // {1})"  # Triton's // truncates, like lax.div
        if e.op == "sqrt" and not self.interpret and is_16bit_float(e.args[0].dtype):
            return _SQRT_APPROX
        if e.op in ("sqrt", "rsqrt") and np.dtype(e.args[0].dtype) == np.float64:  # sqrt_rn is float32 only;
            return "tl.sqrt({0})" if e.op == "sqrt" else "(1.0 / tl.sqrt({0}))"  # float64's is sqrt.rn.f64
        if e.op == "tanh" and not self.interpret:  # libdevice's tanhf, as Pallas's Triton lowering
            return "libdevice.tanh({0})"
        if e.op == "tanh" and np.dtype(e.dtype) == np.float64:  # _tanh's series is float32's (1e-10 relative)
            return "_tanh64({0})"
        if e.op == "rem" and float_op and not self.interpret:  # the interpreter's % is np.fmod
            # libdevice's fmod is exact; Triton's float % (LLVM frem) divides approximately on
            # the GPU and can be one divisor off (bf16 rem gave -1.086 where XLA gives -0.0).
            return "libdevice.fmod({0}, {1})"
        if e.op == "rem":
            return "({0} % {1})"  # C's remainder (srem), like lax.rem
        if e.op in _MATH or e.op in ("pow", "erf_inv", "round", "nextafter"):
            return self.math_template(e)
        if e.op in ("shift_left", "shift_right_logical", "shift_right_arithmetic", "clz", "population_count"):
            return self.bits_template(e)
        if e.op == "integer_pow":
            y = int(params["y"])
            if y == 0:  # 1 everywhere, NaN included
                return f"tl.full({{0}}.shape, 1, {self.dtype_text(e.dtype)})"
            product = "(" + " * ".join(["{0}"] * abs(y)) + ")"
            return product if y > 0 else f"(1.0 / {product})"
        if e.op == "select_n" and len(e.args) == 3 and e.args[0].dtype == np.bool_:
            return "tl.where({0}, {2}, {1})"
        if e.op == "select_n":  # an int32 case index: nested two-way selects
            return select_n_template(len(e.args) - 1, "tl.where")
        if e.op == "clamp":
            return ("tl.minimum(tl.maximum({1}, {0}, propagate_nan=tl.PropagateNan.ALL), {2}, "
                    "propagate_nan=tl.PropagateNan.ALL)" if float_op else "tl.minimum(tl.maximum({1}, {0}), {2})")
        if e.op == "neg" and float_op:
            # [Note: float neg flips the sign bit]
            # XLA:CPU's neg flips the sign bit of every value, NaN included (eager and
            # jax.jit agree: jnp.signbit(-x) of a NaN x is True; XLA:GPU returns the
            # canonical +NaN, and a NaN's sign after arithmetic follows LLVM's folds on
            # either). Triton's unary minus is 0 - x (+0.0 for +0.0), and x * -1.0 kept a
            # NaN's sign in the interpreter's numpy (LLVM makes it an fneg on a GPU): the
            # sign bit is flipped on the bits instead, exact on both. 16-bit floats arrive
            # as float32 (emitter.UPCAST_16BIT).
            bits = 8 * np.dtype(e.dtype).itemsize
            return (f"({{0}}.to(tl.int{bits}, bitcast=True) ^ {-(1 << (bits - 1))})"
                    f".to({self.dtype_text(e.dtype)}, bitcast=True)")
        if e.op == "is_finite":  # x - x is 0 for finite x, NaN for +-inf and NaN
            if is_16bit_float(e.args[0].dtype):  # in float32 (exact): the interpreter's 16-bit math is not
                return "(({0}.to(tl.float32) - {0}.to(tl.float32)) == 0)"
            return "(({0} - {0}) == 0)"
        if e.op == "sign" and np.dtype(e.dtype).kind == "u":  # no -1 to compare an unsigned value with
            return self.cast_text("({0} != 0)", e.dtype)
        if e.op == "sign":  # 0, -0 and NaN are their own sign (integer floor division needs sign)
            return self.cast_text("tl.where({0} > 0, 1, tl.where({0} < 0, -1, {0}))", e.dtype)
        if e.op == "not" and np.dtype(e.dtype).kind == "u":  # the interpreter's ~ builds -1 in the unsigned type
            signed = self.dtype_text(np.dtype(f"int{8 * np.dtype(e.dtype).itemsize}"))
            return f"(~{{0}}.to({signed}, bitcast=True)).to({self.dtype_text(e.dtype)}, bitcast=True)"
        if e.op == "not":
            return "({0} == 0)" if e.dtype == np.bool_ else "(~{0})"
        if e.op == "convert_element_type":
            new = np.dtype(params["new_dtype"])
            if new.kind in "iu" and is_float(e.args[0].dtype):
                # XLA's float -> int: NaN is 0 and out-of-range values saturate
                # (a plain cast is undefined there: the interpreter gives INT_MIN)
                lo, hi = np.iinfo(new).min, np.iinfo(new).max
                # in float32 (exact): the interpreter's 16-bit compares are not
                x = "{0}.to(tl.float32)" if is_16bit_float(e.args[0].dtype) else "{0}"
                return self.cast_text(f"tl.where({x} != {x}, 0, tl.where({x} >= {float(hi)!r}, {hi}, "
                                      f"tl.where({x} <= {float(lo)!r}, {lo}, {x}.to({self.dtype_text(new)}))))", new)
            return self.cast_text("{0}", params["new_dtype"])
        if e.op == "bitcast_convert_type":  # same width (the rule's condition)
            return f"{{0}}.to({self.dtype_text(np.dtype(params['new_dtype']))}, bitcast=True)"
        if e.op not in OPS:
            raise TritonUnsupported(f"op {e.op}")
        if e.op in ("erf", "erfc") and is_16bit_float(e.dtype):  # not upcast by the emitter; tl.erf is f32
            return self.cast_text(OPS[e.op].format("{0}.to(tl.float32)"), e.dtype)
        return OPS[e.op]

    def math_template(self, e) -> str:
        """A transcendental, pow, erf_inv, round or nextafter ([Note: Triton math]).
        16-bit operands arrive as float32 (emitter.UPCAST_16BIT), except for
        round and nextafter, which are exact in their own width."""
        dt = self.dtype_text(e.dtype)
        if e.op == "round":
            method = int(dict(e.params)["rounding_method"])
            if is_16bit_float(e.dtype):
                return f"_rnd({{0}}.to(tl.float32), {method == 1}).to({dt})"
            return f"_rnd({{0}}, {method == 1})"
        if e.op == "nextafter":
            return f"_nextafter{8 * np.dtype(e.dtype).itemsize}({{0}}, {{1}})"
        if e.op == "pow":  # XLA converts an integer exponent to the base's type
            y = "{1}" if np.dtype(e.args[1].dtype) == np.dtype(e.dtype) else f"{{1}}.to({dt})"
            if not self.interpret:
                return f"libdevice.pow({{0}}, {y})"
            return f"_pow64({{0}}.to(tl.float64), {y}.to(tl.float64)).to({dt})"
        if e.op == "erf_inv":
            if not self.interpret:
                return "_erfinv({0}, -libdevice.log1p(-({0} * {0})))"
            return f"_erfinv({{0}}, -_log1p64((-({{0}} * {{0}})).to(tl.float64)).to({dt}))"
        name, helper = _MATH[e.op]
        if not self.interpret and e.op in ("cbrt", "atan2") and np.dtype(e.dtype) == np.float32:
            return "_cbrt32({0})" if e.op == "cbrt" else "_atan2_32({0}, {1})"  # subnormal operands
        if not self.interpret:
            return f"libdevice.{name}({', '.join('{%d}' % i for i in range(len(e.args)))})"
        args = ", ".join("{%d}.to(tl.float64)" % i for i in range(len(e.args)))
        return f"{helper}({args}).to({dt})"

    def bits_template(self, e) -> str:
        """Shifts (XLA's: an amount past the width, or negative, shifts every bit
        out) and clz / population_count (libdevice's on a GPU, 32- or 64-bit:
        narrow ints on their zero-extended int32 bits, unsigned ones on the signed
        int of their width, as pallas.bit_count_template)."""
        dt = np.dtype(e.dtype)
        bits = 8 * dt.itemsize
        t, st, ut = self.dtype_text(dt), f"tl.int{bits}", f"tl.uint{bits}"
        if e.op.startswith("shift"):  # on the unsigned bits, the amount read as unsigned
            ux = f"{{0}}.to({ut}, bitcast=True)" if dt.kind == "i" else "{0}"
            ua = f"{{1}}.to({ut}, bitcast=True)" if dt.kind == "i" else "{1}"
            out = f"({ua} >= {bits})"
            if e.op == "shift_right_arithmetic":
                sx = f"{{0}}.to({st}, bitcast=True)" if dt.kind == "u" else "{0}"
                amount = f"tl.where({out}, {bits - 1}, {ua}).to({ut}).to({st}, bitcast=True)"
                return f"({sx} >> {amount}).to({st}).to({t}, bitcast=True)"
            shift = "<<" if e.op == "shift_left" else ">>"
            amount = f"tl.where({out}, 0, {ua}).to({ut})"
            return f"tl.where({out}, 0, {ux} {shift} {amount}).to({ut}).to({t}, bitcast=True)"
        fn = ("libdevice.clz" if e.op == "clz" else "libdevice.popc") if not self.interpret else None
        if dt.kind in "iu" and bits < 32:
            wide = f"({{0}}.to(tl.int32) & {(1 << bits) - 1})"
            text = f"{fn or ('_clz32' if e.op == 'clz' else '_popc32')}({wide})"
            if e.op == "clz":
                text = f"({text} - {32 - bits})"
            return f"{text}.to({t})"
        x = f"{{0}}.to({st}, bitcast=True)" if dt.kind == "u" else "{0}"
        text = f"{fn or ('_clz' if e.op == 'clz' else '_popc') + str(bits)}({x})"
        return f"{text}.to({t}, bitcast=True)" if dt.kind == "u" else f"{text}.to({t})"

    # -- row windows ([Note: aligned row windows] in codegen/rows.py) --------------
    ALIGNED_ROWS = True

    def window_setup(self, row_block) -> None:
        vec, w = self.window.vec, self.w
        w.line(f"wrow = {row_block} * COLS  # the row's flat start ([Note: aligned row windows])")
        w.line(f"wa = tl.multiple_of((wrow // {vec}) * {vec}, {vec})  # rounded down to a {vec}-element vector")
        w.line("wh = wrow - wa  # the first chunk's lanes before the row")
        w.line("wlast = (COLS - 1 + wh) // BLOCK_C  # the chunk of the row's last column")

    def window_columns(self) -> None:
        w, lane = self.w, self.iota_text(1, "BLOCK_C")
        w.line(f"xc = chunk * BLOCK_C + {lane} - wh")
        w.line("cmask = (xc >= 0) & (xc < COLS)")
        w.line(f"wo = wa + chunk * BLOCK_C + {lane}")

    def window_load(self, ld):
        full = frozenset("rc")  # BLOCK_R is 1
        mask = self.bind(("wmask",), f"rmask & (wo < {self.window.end})", full, "mask")[0]
        ref = self.in_refs[ld.buffer]
        other = "False" if ld.dtype == np.bool_ else "0"
        return self.bind(("wload", ref), f"tl.load({ref} + wo, mask={mask}, other={other})", full)

    def window_store(self, m, var, extent) -> None:
        full, vec = frozenset("rc"), self.window.vec
        val = self.broadcast(var, extent, full)
        val = self.bind(("cast", val, m.node.dtype), self.cast_text(val, m.node.dtype), full)[0]
        starts = self.bind(("wstart",), f"chunk * BLOCK_C + ({self.iota_text(1, 'BLOCK_C')} // {vec}) * {vec} - wh",
                           full, "idx")[0]  # the column of each lane's vector's first element
        whole = self.bind(("wfull",), f"rmask & ({starts} >= 0) & ({starts} <= COLS - {vec})", full, "mask")[0]
        edge = self.bind(("wedge",), f"rmask & cmask & (({starts} < 0) | ({starts} > COLS - {vec}))", full,
                         "mask")[0]
        ref = self.out_refs[m.name]
        self.w.line(f"tl.store({ref} + wo, {val}, mask={whole})  # whole vectors")
        self.w.line("if (chunk == 0) | (chunk == wlast):  # the row's partial first and last vectors")
        with self.w.indent():
            self.w.line(f"tl.store({ref} + wo, {val}, mask={edge})")

    def load_text(self, ref, off, mask_arg) -> str:
        return f"tl.load({ref} + {off}{mask_arg})"

    def store_text(self, ref, off, val, mask_arg) -> str:
        return f"tl.store({ref} + {off}, {val}{mask_arg})"


# Made from nothing, a tensor in a Gluon kernel needs a layout: these spellings have none.
_NO_LAYOUT = re.compile(r"(?<![\w.])tl\.(full|zeros|arange|zeros_like|full_like)\(")


class StagedRowEmitter(TritonEmitter):
    """A looped one-row kernel whose window is staged in shared memory, as a
    Gluon kernel ([Note: staged rows] in codegen/rows.py): the Triton dialect's
    code, with one layout (``TILE``: a chunk's lanes in vectors of the window)
    on the tensors made from nothing, and the window's loads from shared memory."""
    DECORATOR = "@gluon.jit"
    STAGED_ROWS = True

    def layout_line(self) -> str:
        return f"TILE: gl.constexpr = gl.BlockedLayout([1, {self.staged_vec}], [1, 32], [1, gl.num_warps()], [1, 0])"

    def full_call(self, shape, value, dtype) -> str:
        return f"gl.full({shape}, {value}, {dtype}, layout=TILE)"

    def zeros_text(self, shape, dtype) -> str:
        return f"gl.zeros({shape}, {dtype}, layout=TILE)"

    def iota_text(self, axis, block) -> str:
        text = f"gl.arange(0, {block}, layout=gl.SliceLayout({1 - axis}, TILE))[{':, None' if axis == 0 else 'None, :'}]"
        return text if self.index_dtype == "tl.int32" else f"{text}.to({self.index_dtype})"

    def window_stage(self) -> None:
        w, win = self.w, self.window
        self.staged_vec = win.vec
        for i, (buffer, dt) in enumerate(win.staged):
            w.line(f"stage{i} = gl.allocate_shared_memory({self.dtype_text(dt)}, [{win.chunks}, BLOCK_C], "
                   "gl.SwizzledSharedLayout(1, 1, 1, [0]))  # " + buffer)
        lane = "gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, TILE))"
        w.line(f"for chunk in range({win.chunks}):  # every chunk's copy in flight ([Note: staged rows])")
        with w.indent():
            w.line(f"wo1 = wa + chunk * BLOCK_C + {lane}")
            for i, (buffer, _) in enumerate(win.staged):
                w.line(f"async_copy.async_copy_global_to_shared(stage{i}.index(chunk), {self.in_refs[buffer]} + wo1, "
                       f"mask=wo1 < {win.end})")
        w.line("async_copy.commit_group()")
        w.line("async_copy.wait_group(0)")
        w.line("gl.thread_barrier()  # every lane's copies, not only this one's")

    def window_load(self, ld):
        staged = [b for b, _ in self.window.staged]
        if ld.buffer not in staged:
            return super().window_load(ld)
        text = f"stage{staged.index(ld.buffer)}.index(chunk).load(gl.SliceLayout(0, TILE))[None, :]"
        return self.bind(("wload", self.in_refs[ld.buffer]), text, frozenset("rc"))


class TritonMatmulEmitter(matmul.TileValues, TritonEmitter):
    """Reads the accumulator tile from ``tile_values`` (matmul's emitter), writes Triton."""

    def dot_text(self, node: ir.Matmul, lhs_dtype) -> str:
        """One K step's ``tl.dot`` into ``acc``: float32 operands as TF32 unless
        the precision is highest, rounded to TF32 on the GPU as cuBLAS and XLA's
        Triton pipeline do (the tensor core alone truncates); Triton's
        interpreter multiplies 16-bit operands wrongly, so there they are
        widened to float32 first."""
        if lhs_dtype == np.float32 and node.precision == "highest":
            return "tl.dot(a, b, acc, input_precision='ieee')"
        if lhs_dtype == np.float32 and not self.interpret:
            self.helpers.add("_tf32")
            return "tl.dot(_tf32(a), _tf32(b), acc, input_precision='tf32')"
        if lhs_dtype == np.float32:
            return "tl.dot(a, b, acc, input_precision='tf32')"
        if self.interpret:
            return "tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision='ieee')"
        return "tl.dot(a, b, acc)"


# Row reductions this renderer writes; prod, argmax and argmin through helpers (``TritonEmitter.reduce_text``).
REDUCE = {"sum": "tl.sum", "max": "tl.max", "min": "tl.min", "and": "tl.min", "or": "tl.max",
          "prod": None, "argmax": None, "argmin": None}
COMBINE = {"sum": "({a} + {v})", "max": "tl.maximum({a}, {v}, propagate_nan=tl.PropagateNan.ALL)",
           "min": "tl.minimum({a}, {v}, propagate_nan=tl.PropagateNan.ALL)",
           "and": "tl.minimum({a}, {v})", "or": "tl.maximum({a}, {v})", "prod": "({a} * {v})"}


# --------------------------------------------------------------------------- #
# Kernels
# --------------------------------------------------------------------------- #
def _render_kernel(kernel: Kernel, schedule: Schedule, options: CompileOptions, stage_rows: bool = False):
    """``stage_rows``: a looped one-row kernel may be a Gluon kernel whose rows are
    staged in shared memory ([Note: staged rows] in codegen/rows.py)."""
    if kernel.kind == "mix":
        raise TritonUnsupported(f"mix kernel {kernel.name}")
    cfg = kernel_config(kernel, schedule, options)
    if (kernel.kind == "reduction" and not options.num_warps and not sizes.is_symbolic((kernel.rows, kernel.cols))
            and reduction_is_inner(kernel, schedule)):
        cfg = dataclasses.replace(cfg, num_warps=heuristics.triton_row_warps(cfg))
    if stage_rows and _may_stage(kernel, cfg, options):
        staged_cfg = dataclasses.replace(cfg, block_cols=heuristics.STAGED_ROW_BLOCK,
                                         num_warps=heuristics.STAGED_ROW_WARPS)
        rendered = _render_with(StagedRowEmitter(kernel, schedule, staged_cfg, options), kernel, schedule, staged_cfg)
        if rendered.staged and not _NO_LAYOUT.search(rendered.source + "".join(HELPERS[h] for h in rendered.helpers)):
            return dataclasses.replace(rendered, config=staged_cfg)
    return _render_with(TritonEmitter(kernel, schedule, cfg, options), kernel, schedule, cfg)


def _may_stage(kernel: Kernel, cfg, options: CompileOptions) -> bool:
    """Could ``kernel``'s rows be staged ([Note: staged rows])? Its window decides the rest."""
    return (heuristics.TRITON_STAGED_ROWS and options.staged_rows and not options.interpret
            and not options.num_warps  # the staged tile's layout is made for its own warps
            and kernel.kind == "reduction" and not cfg.persistent and cfg.block_rows == 1
            and not sizes.is_symbolic((kernel.rows, kernel.cols)))


def _render_with(em: TritonEmitter, kernel: Kernel, schedule: Schedule, cfg) -> Rendered:
    """``kernel`` (pointwise or row reductions) written by ``em`` with tile ``cfg``."""
    w = em.w
    bodies = {m.name: kernel_coords_body(m) for m in kernel.members}
    w.line(em.pid_line())
    if kernel.kind == "pointwise":
        write_pointwise(em, kernel, bodies, cfg)
    else:
        render_reduction(em, kernel, bodies, cfg)
    extents = [f"ROWS = {sizes.to_source(kernel.rows)}", f"COLS = {sizes.to_source(kernel.cols)}"]
    staged = ", rows staged in shared memory (Gluon)" if em.staged_vec else ""
    header = (f"# kernel {kernel.name}: {kernel.kind}, {kernel.rows} x {kernel.cols}, "
              f"block {cfg.block_rows} x {cfg.block_cols}, {'persistent' if cfg.persistent else 'looped'}{staged}\n"
              "# from:\n" + "\n".join(f"#   {eq}" for eq in kernel.origin))
    if kernel.kind == "pointwise" or sizes.is_symbolic(kernel.rows) or sizes.is_symbolic(kernel.cols):
        grid = (f"{_grid_cdiv(kernel.rows, cfg.block_rows)} * {_grid_cdiv(kernel.cols, cfg.block_cols)}"
                if kernel.kind == "pointwise" else _grid_cdiv(kernel.rows, cfg.block_rows))
    else:
        grid = _grid_cdiv(kernel.rows, cfg.block_rows)
    return _wrap(kernel, schedule, em, header, extents, {"BLOCK_R": cfg.block_rows, "BLOCK_C": cfg.block_cols},
                 grid, cfg.num_warps, cfg.num_stages)


def _grid_cdiv(n, block: int) -> str:
    """Launcher source of ceil(n / block), parenthesized (it may be a factor)."""
    if not sizes.is_symbolic(n):
        return str(-(-int(n) // block))
    return f"(({sizes.to_source(n)} + {block - 1}) // {block})"


def _check_reductions(kernel: Kernel) -> None:
    for m in kernel.members:
        if m.role == "reduction" and m.node.op not in REDUCE:
            raise TritonUnsupported(f"{m.node.op} reduction")


def render_reduction(em: TritonEmitter, kernel: Kernel, bodies, cfg, **kw) -> None:
    """Row reductions (reduced extent static) of one block of rows
    (codegen/rows.py); raises ``TritonUnsupported`` for a reduction this
    renderer does not write."""
    _check_reductions(kernel)
    render_rows(em, kernel, bodies, cfg, **kw)


def render_mix(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> Rendered:
    """A whole-row mix kernel ([Note: split reductions and mix-order fusion] in split.py) as
    one ``@triton.jit`` kernel, to run inside the XLA program
    (pallaskit/runtime/triton_call.py). A persistent grid of ``PROGRAMS``
    programs; each walks the row blocks ``pid, pid + PROGRAMS, ...`` of
    ``BLOCK_R`` rows in a ``tl.range`` loop that Triton pipelines
    (``num_stages``: the next blocks' loads are in flight while this one is
    reduced; the blocks with rows past the end run in a second, short loop),
    does the row work of each block (row reductions, row values,
    row-wise stores) and adds each column member into a (BLOCK_R, BLOCK_C)
    float accumulator. At the end a program sums its accumulator over rows
    into its row of the partial buffer (``kernel.programs`` rows, sized by
    split.py with heuristics.triton_mix_programs), which the finishing kernel
    sums. Rows too long for two a step take a one-row tile
    (heuristics.triton_mix_row_config). Dynamic rows: the partial buffer's
    rows (programs) were sized at the size hint, and the loops' trip counts
    are computed from ``ROWS`` in the kernel. Raises ``TritonUnsupported`` for
    column tiles (no row reductions: ``render_column``), dynamic columns and
    rows too long for one tile."""
    if kernel.kind != "mix" or not whole_rows(kernel):
        raise TritonUnsupported(f"kernel {kernel.name} is not a whole-row mix kernel")
    if sizes.is_symbolic(kernel.cols):
        raise TritonUnsupported(f"mix kernel {kernel.name} has dynamic columns")
    if not heuristics.fits_in_tile(kernel.cols, options.max_persistent_cols):
        raise TritonUnsupported(f"mix kernel {kernel.name}: rows too long for one tile")
    columns = [m for m in kernel.members if m.role == "column"]
    cfg = (heuristics.triton_mix_config(int(kernel.cols), len(columns))
           or heuristics.triton_mix_row_config(int(kernel.cols), len(columns)))
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    for m in columns:
        if m.node.op not in COMBINE:
            raise TritonUnsupported(f"{m.node.op} column reduction")
    _check_reductions(kernel)
    dynamic = sizes.is_symbolic(kernel.rows)
    # The grid is the partial buffer's rows: split.py sizes it for the executor that
    # runs the kernel (heuristics.triton_mix_programs for this one); an eager launch
    # of a program whose kernel XLA runs in Pallas takes Pallas's count.
    em = TritonEmitter(kernel, schedule, cfg, options)
    programs = kernel.programs
    steps = -(-(-(-int(kernel.rows) // cfg.block_rows)) // programs) if not dynamic else "steps"
    em.w.line(em.pid_line())
    # Blocks that every program has in full come first: their accumulator update
    # needs no select (a lane past the last column is never stored, and the
    # accumulator is summed over rows only); dropping it is measurable
    # (RESULTS.md, "Heuristics: raw-Triton mix kernels").
    write_mix(em, kernel, {m.name: kernel_coords_body(m) for m in kernel.members}, cfg, split_full=True,
              skip_zero_selects=True)
    extents = [f"ROWS = {sizes.to_source(kernel.rows)}", f"COLS = {int(kernel.cols)}"]
    header = (f"# kernel {kernel.name}: mix (raw Triton), {kernel.rows} x {kernel.cols}, block {cfg.block_rows} x "
              f"{cfg.block_cols}, {programs} programs x {'a runtime count of' if dynamic else steps} steps, "
              f"{cfg.num_warps} warps, "
              f"{cfg.num_stages} stages\n"
              "# from:\n" + "\n".join(f"#   {eq}" for eq in kernel.origin))
    rendered = _wrap(kernel, schedule, em, header, extents, {"BLOCK_R": cfg.block_rows, "BLOCK_C": cfg.block_cols},
                     str(programs), cfg.num_warps, cfg.num_stages)
    return dataclasses.replace(rendered, config=cfg)


def long_mix_rows(kernel: Kernel) -> bool:
    """Is ``kernel`` a whole-row mix kernel whose rows are too long for the
    two-row raw-Triton tile (lowering/executors.py kind 'mix_long_rows')?"""
    if kernel.kind != "mix" or not whole_rows(kernel) or sizes.is_symbolic(kernel.cols):
        return False
    return heuristics.triton_mix_config(int(kernel.cols), max(1, column_count(kernel))) is None


def render_column(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> Rendered:
    """A mix kernel without row work (split.py's partial column reductions,
    with any row-wise stores of the same tiles), as the Pallas kernel does it:
    ``PROGRAMS`` x column blocks programs; each walks the row blocks
    ``program, program + PROGRAMS, ...`` of its column block, folds each
    column member into a (BLOCK_R, BLOCK_C) accumulator and stores its sum
    over rows as the program's partial row."""
    if kernel.kind != "mix" or whole_rows(kernel):
        raise TritonUnsupported(f"kernel {kernel.name} is not a column-tile mix kernel")
    if sizes.is_symbolic(kernel.cols):
        raise TritonUnsupported(f"mix kernel {kernel.name} has dynamic columns")
    columns = [m for m in kernel.members if m.role == "column"]
    for m in columns:
        if m.node.op not in COMBINE:
            raise TritonUnsupported(f"{m.node.op} column reduction")
    cfg = kernel_config(kernel, schedule, options)
    em = TritonEmitter(kernel, schedule, cfg, options)
    programs, col_blocks = kernel.programs, -(-int(kernel.cols) // cfg.block_cols)
    dynamic = sizes.is_symbolic(kernel.rows)  # programs sized at the hint; the trip count a runtime value
    steps = "steps" if dynamic else -(-(-(-int(kernel.rows) // cfg.block_rows)) // programs)
    em.w.line(em.pid_line())
    write_mix(em, kernel, {m.name: kernel_coords_body(m) for m in kernel.members}, cfg)
    extents = [f"ROWS = {sizes.to_source(kernel.rows)}", f"COLS = {int(kernel.cols)}"]
    header = (f"# kernel {kernel.name}: column tiles (raw Triton), {kernel.rows} x {kernel.cols}, block "
              f"{cfg.block_rows} x {cfg.block_cols}, {programs} programs x {col_blocks} column blocks x "
              f"{'a runtime count of' if dynamic else steps} steps\n# from:\n" + "\n".join(f"#   {eq}" for eq in kernel.origin))
    rendered = _wrap(kernel, schedule, em, header, extents, {"BLOCK_R": cfg.block_rows, "BLOCK_C": cfg.block_cols},
                     str(programs * col_blocks), cfg.num_warps, cfg.num_stages)
    return dataclasses.replace(rendered, config=cfg)


def render_matmul(kernel: Kernel, schedule: Schedule, options: CompileOptions):
    """The matmul template ([Note: the matmul template] in codegen/matmul.py) in Triton."""
    p = matmul.plan(TritonMatmulEmitter, kernel, schedule, options)
    cfg, em, mm, dynamic_m = p.cfg, p.em, p.mm, p.dynamic_m
    (b, m, n, k), m_blocks, n_blocks, k_blocks = p.dims, p.m_blocks, p.n_blocks, p.k_blocks
    w = em.w
    w.line(em.pid_line())
    if dynamic_m:
        w.line("M_BLOCKS = (M + BLOCK_M - 1) // BLOCK_M")
    matmul.write_tile(em, b, m_blocks, n_blocks, cfg.group_m, dynamic_m)
    # [Note: the K loop's trip count at run time]
    # ptxas unrolls a loop whose trip count it sees, and on the template's K
    # loop (wgmma steps, the tile's accumulator live across them) that took
    # seconds: 4.5-6.5 s against 0.24-0.34 s with the count hidden, for a
    # 128 x 128 tile with 8 warps over 32 K steps (benchmarks/RESULTS.md,
    # "Session 38"), on the critical path of a cold first call (jaxlib runs it
    # before XLA's compile). So the launch passes the step count as an int
    # argument, as Triton's own matmul takes K: the loop stays rolled, and the
    # kernels ran as fast on the H100 (within 1%, some faster).
    k_steps = {"K_STEPS": k_blocks} if k_blocks > 1 else {}
    matmul.write_k_loop(em, mm, cfg, (m, n, k), "K_STEPS" if k_steps else k_blocks, dynamic_m)
    matmul.write_epilogue(em, kernel, mm)
    own = _origins(em.graph, mm, em.schedule.stored)
    header = (f"# kernel {kernel.name}: matmul {'%d x ' % b if b > 1 else ''}({m} x {k}) @ ({k} x {n}), {cfg}\n"
              "# matmul (operand views folded into its loads):\n" + "\n".join(f"#   {eq}" for eq in own))
    epilogue = [eq for eq in kernel.origin if eq not in own]
    if epilogue:
        header += "\n# epilogue:\n" + "\n".join(f"#   {eq}" for eq in epilogue)
    extents = [f"M = {sizes.to_source(m)}", f"N = {n}", f"K = {k}"]
    grid = f"{b * n_blocks} * {_grid_cdiv(m, cfg.block_m)}" if dynamic_m else str(b * (-(-m // cfg.block_m)) * n_blocks)
    blocks = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m,
              "BLOCK_R": cfg.block_m, "BLOCK_C": cfg.block_n}
    return _wrap(kernel, schedule, em, header, extents, blocks, grid, cfg.num_warps, cfg.num_stages, k_steps)


_ATOMIC_RMW = {"add": "tl.atomic_add", "max": "tl.atomic_max", "min": "tl.atomic_min"}


def render_scatter(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> Rendered:
    """An atomic scatter ([Note: atomic scatters] in lowering/ir.py): a flat
    tile of ``BLOCK_C`` update positions a program; each computes its update
    value (producers inlined), its destination's offset (indirect indices) and
    whether the mode keeps it, and combines it into the output, which the
    launch aliases to the operand's buffer (``Rendered.aliases``): with
    ``tl.atomic_add`` / ``atomic_max`` / ``atomic_min``, a compare-and-swap
    loop (mul) or a plain store (set). Relaxed order: each update only needs
    to be atomic, the launch's end publishes them."""
    (m,) = kernel.members
    node = m.node
    if kernel.kind != "scatter" or sizes.is_symbolic(kernel.cols):
        raise TritonUnsupported(f"kernel {kernel.name} is not a static scatter")
    cfg = heuristics.pointwise_config(1, int(kernel.cols))
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    em = TritonEmitter(kernel, schedule, cfg, options)
    w = em.w
    target, update, ok = kernel_coords_body(m).args
    w.line(em.pid_line())
    w.line(f"xc = pid * BLOCK_C + {em.iota_text(1, 'BLOCK_C')}")
    w.line("cmask = xc < COLS")
    full = frozenset("c")
    val = em.cast_text(em.broadcast(*em.value(update), full), node.dtype)
    off = em.broadcast(*em.index(em.offset(node.operand, target.index)), full)
    mask = "cmask"
    if not (isinstance(ok, ir.Const) and ok.value):
        keep = em.broadcast(*em.value(ok), full)
        mask = em.bind(("and", ("cmask", keep)), f"cmask & {keep}", full, "mask")[0]
    out = em.out_refs[node.name]
    if node.combine in ("max", "min"):  # skip what the element already beats ([Note: atomic scatters])
        w.line(f"val = {val}")
        val = "val"
        nan = " | (val != val)" if np.dtype(node.dtype).kind == "f" else ""  # a NaN always goes through
        w.line(f"cur = tl.load({out} + {off}, mask={mask}, other=0)")
        w.line(f"live = {mask} & ((val {'>=' if node.combine == 'max' else '<='} cur){nan})")
        mask = "live"
    if node.combine in _ATOMIC_RMW:
        w.line(f"{_ATOMIC_RMW[node.combine]}({out} + {off}, {val}, mask={mask}, sem='relaxed')")
    elif node.combine == "set":
        w.line(f"tl.store({out} + {off}, {val}, mask={mask})")
    elif node.combine == "mul":
        _write_cas_mul(em, out, off, val, mask, node.dtype)
    else:
        raise TritonUnsupported(f"a scatter combining with {node.combine}")
    header = (f"# kernel {kernel.name}: atomic scatter-{node.combine} (raw Triton) of {kernel.cols} updates "
              f"{list(node.domain)} into {list(node.shape)}, block {cfg.block_cols}\n"
              "# from:\n" + "\n".join(f"#   {eq}" for eq in kernel.origin))
    rendered = _wrap(kernel, schedule, em, header, [f"COLS = {int(kernel.cols)}"],
                     {"BLOCK_R": 1, "BLOCK_C": cfg.block_cols}, _grid_cdiv(kernel.cols, cfg.block_cols),
                     cfg.num_warps, cfg.num_stages)
    return dataclasses.replace(rendered, config=cfg, aliases=((kernel.reads.index(node.operand), 0),))


def _write_cas_mul(em, out, off, val, mask, dt) -> None:
    """``out[off] *= val`` where ``mask``, atomically: no atomic multiplies, so
    each lane swaps in its product until no other update landed in between.
    The swaps compare bits (a float's as an int: NaN equals itself there);
    lanes done or masked off swap an element with itself (no change; at
    offset 0, so the address is valid)."""
    dt = np.dtype(dt)
    bits = f"tl.int{8 * dt.itemsize}" if dt.kind == "f" else em.dtype_text(dt)
    w = em.w
    w.line(f"ptr = {out} + tl.where({mask}, {off}, 0)")
    if dt.kind == "f":
        w.line(f"ptr = ptr.to(tl.pointer_type({bits}))")
    w.line(f"old = tl.load(ptr, mask={mask}, other=0)")
    w.line(f"todo = {mask}")
    w.line("while tl.max(todo.to(tl.int32)) > 0:")
    with w.indent():
        if dt.kind == "f":
            w.line(f"new = (old.to({em.dtype_text(dt)}, bitcast=True) * {val}).to({bits}, bitcast=True)")
        else:
            w.line(f"new = old * {val}")
        w.line("seen = tl.atomic_cas(ptr, old, tl.where(todo, new, old), sem='relaxed')")
        w.line("todo = todo & (seen != old)")
        w.line("old = seen")


@dataclasses.dataclass
class Rendered:
    name: str
    source: str
    reads: list
    dims: list
    grid: str
    constexprs: dict
    num_warps: int
    num_stages: int
    helpers: set
    config: object = None  # the tile (TileConfig, or MatmulConfig for the template)
    guards: list = dataclasses.field(default_factory=list)  # symbolic kernels: what the int32 indices assume
    aliases: tuple = ()  # (read, output) pairs: that output starts as that read (an atomic scatter's operand)
    staged: bool = False  # a Gluon kernel, its rows staged in shared memory ([Note: staged rows] in codegen/rows.py)
    # Ints the launch passes after the dims, though known when rendering: values the
    # kernel must not see as constants ([Note: the K loop's trip count at run time])
    launch_ints: dict = dataclasses.field(default_factory=dict)

    @property
    def scalars(self) -> list:
        """The launch's scalar arguments, in the kernel's order: the dims' names, then the launch ints' values."""
        return [*self.dims, *(str(v) for v in self.launch_ints.values())]


def _wrap(kernel, schedule, em, header, extents, constexprs, grid, num_warps, num_stages,
          launch_ints=None) -> Rendered:
    body = em.w.source()
    dims = used_dims(schedule, "\n".join(extents) + "\n" + body)
    ins, outs = list(em.in_refs.values()), list(em.out_refs.values())
    launch_ints = dict(launch_ints or {})
    w = SourceWriter()
    w.lines.extend(header.splitlines())
    w.line(em.DECORATOR)
    params = ins + outs + dims + list(launch_ints) + [f"{c}: tl.constexpr" for c in constexprs]
    w.line(f"def {kernel.name}_kernel({', '.join(params)}):")
    staged = bool(em.staged_vec)
    with w.indent():
        for line in extents:
            w.line(line)
        if staged:
            w.line(em.layout_line())
    w.lines.append(body.rstrip("\n"))
    return Rendered(kernel.name, w.source(), list(kernel.reads), dims, grid, constexprs, num_warps, num_stages,
                     set(em.helpers), guards=list(em.guards), staged=staged, launch_ints=launch_ints)


# Kernel kinds whose renderer lives in a module built on this one, registered
# by it: codegen/combo.py's 'combo' ([Note: combo kernels]). This module does not
# import them (no import cycle); the program module (codegen/program.py) does.
KIND_RENDERERS: dict = {}


def render_for_xla(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> Rendered:
    """One kernel of any kind as a ``@triton.jit`` kernel to run inside the XLA
    program (lowering/executors.py ``triton_xla``; the program wrapper in
    codegen/program.py launches it through ``TRITON_CALL``). Raises
    ``TritonUnsupported`` for what this renderer does not write."""
    if kernel.kind in KIND_RENDERERS:
        return KIND_RENDERERS[kernel.kind](kernel, schedule, options)
    if kernel.kind == "scatter":
        return render_scatter(kernel, schedule, options)
    if kernel.kind == "matmul":
        return dataclasses.replace(render_matmul(kernel, schedule, options),
                                   config=matmul.matmul_kernel_config(kernel, options))
    if kernel.kind == "mix" and not whole_rows(kernel):
        return render_column(kernel, schedule, options)
    if kernel.kind == "mix":
        return render_mix(kernel, schedule, options)
    rendered = _render_kernel(kernel, schedule, options, stage_rows=True)
    if rendered.staged:
        return rendered
    aliases = tuple((kernel.reads.index(r), kernel.stores.index(o)) for r, o in kernel.in_place)
    return dataclasses.replace(rendered, config=kernel_config(kernel, schedule, options), aliases=aliases)


# --------------------------------------------------------------------------- #
# The whole program
# --------------------------------------------------------------------------- #
def render(schedule: Schedule, options: CompileOptions, title: str = "") -> TritonProgram:
    """The schedule as a Triton module with ``launch(run, kernels, *inputs)``; raises
    ``TritonUnsupported`` naming the first thing it cannot render."""
    graph = schedule.graph
    rendered = []
    for step in schedule.steps:
        if not isinstance(step, Kernel):
            raise TritonUnsupported(f"{step.primitive.name} runs through XLA")
        if step.kind == "scatter":  # Launch has no aliased outputs
            raise TritonUnsupported("an atomic scatter (its output starts as its operand) in eager launches")
        if step.kind == "mix":  # split column sums, alone (column tiles) or with the row work
            fn = render_mix if whole_rows(step) else render_column
        else:
            fn = KIND_RENDERERS.get(step.kind, render_matmul if step.kind == "matmul" else _render_kernel)
        rendered.append(fn(step, schedule, options))
    dims = program_dims(schedule)
    w = SourceWriter()
    w.line(f"# Generated by pallaskit (Triton){': ' + title if title else ''}")
    w.lines.extend(_PRELUDE.splitlines())
    for h in sorted(set().union(*[r.helpers for r in rendered]) if rendered else ()):
        w.lines.extend(HELPERS[h].splitlines())
    for r in rendered:
        w.line()
        w.line()
        w.lines.extend(r.source.rstrip("\n").splitlines())
    w.line()
    w.line()
    w.line(f"def launch(run, kernels, {', '.join(graph.inputs)}):")
    with w.indent():
        w.line('"""Every kernel on ``run`` (a pallaskit Launch); ``kernels``: name -> launchable kernel."""')
        for d in dims:
            name, axis = dim_source(graph, d)
            w.line(f"{d} = {name}.shape[{axis}]")
        for r, step in zip(rendered, schedule.kernels):
            for m in step.members:
                if m.store:
                    w.line(f"{m.name} = run.empty({shape_source(m.node.shape)}, "
                           f"np.dtype({np.dtype(m.node.dtype).name!r}))")
            outs = [m.name for m in step.members if m.store]
            ce = ", ".join(f"{c}={v}" for c, v in r.constexprs.items())
            w.line(f"run(kernels[{r.name!r}], ({r.grid},), {', '.join(r.reads + outs + r.scalars)}, {ce})")
        outs = []
        for o in graph.outputs:
            if isinstance(o, ir.Const):
                raise TritonUnsupported("a constant output")
            outs.append(o)
        weak = graph.weak_outputs if any(graph.weak_outputs) and len(graph.weak_outputs) == len(outs) else ()
        w.line(f"return run.finish({', '.join(outs)}{f', weak={tuple(weak)}' if weak else ''})")
    kernels = [TritonKernelSource(r.name, r.num_warps, r.num_stages) for r in rendered]
    return TritonProgram(w.source(), kernels)
