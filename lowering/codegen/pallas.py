"""Pallas renderer: each scheduled kernel becomes a readable Pallas kernel
(Triton lowering on the GPU, interpret mode on the CPU) plus a launcher; a
wrapper ``call`` runs kernels and externs in order.

[Note: kernel shape]
Every kernel works on a 2-D tile of ``BLOCK_R x BLOCK_C`` over kernel
coordinates ``xr`` (rows) and ``xc`` (columns). Buffers are passed as flat 1-D
refs in ``pl.ANY`` memory and read with gather-style loads at computed offsets,
masked at the edges, so no array inside a kernel needs a power-of-two extent.
Each value in a kernel is one of (1, 1), (BLOCK_R, 1), (1, BLOCK_C)
or (BLOCK_R, BLOCK_C); operands are broadcast to a common shape before an op.
A reduction kernel reduces along columns, either in one tile (persistent) or
in a loop over column chunks, one loop per phase when a reduction depends on
an earlier one (e.g. variance after mean).
"""
from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import sympy

from lowering import heuristics, ir, sizes
from lowering.errors import SymbolicUnsupported
from lowering.symbolic import program_dims
from lowering.codegen.writer import SourceWriter
from lowering.options import CompileOptions
from lowering.scheduler import XC, XR, Kernel, Member, Schedule

# op name -> source template over broadcast operands {0}, {1}...; params by name.
OPS = {
    "add": "lax.add({0}, {1})", "sub": "lax.sub({0}, {1})", "mul": "lax.mul({0}, {1})",
    "div": "lax.div({0}, {1})", "rem": "lax.rem({0}, {1})", "neg": "lax.neg({0})",
    "max": "lax.max({0}, {1})", "min": "lax.min({0}, {1})", "pow": "lax.pow({0}, {1})",
    "integer_pow": "lax.integer_pow({0}, {y})", "square": "lax.square({0})", "abs": "lax.abs({0})",
    "sign": "lax.sign({0})", "nextafter": "lax.nextafter({0}, {1})", "atan2": "lax.atan2({0}, {1})",
    "exp": "lax.exp({0})", "exp2": "lax.exp2({0})", "log": "lax.log({0})", "log1p": "lax.log1p({0})",
    "expm1": "lax.expm1({0})", "tanh": "lax.tanh({0})", "logistic": "lax.logistic({0})",
    "sqrt": "lax.sqrt({0})", "rsqrt": "lax.rsqrt({0})", "cbrt": "lax.cbrt({0})",
    "erf": "_erf({0})", "erfc": "_erfc({0})", "erf_inv": "_erf_inv({0})",
    "sin": "lax.sin({0})", "cos": "lax.cos({0})", "tan": "lax.tan({0})", "asin": "lax.asin({0})",
    "acos": "lax.acos({0})", "atan": "lax.atan({0})", "sinh": "lax.sinh({0})", "cosh": "lax.cosh({0})",
    "asinh": "lax.asinh({0})", "acosh": "lax.acosh({0})", "atanh": "lax.atanh({0})",
    "floor": "lax.floor({0})", "ceil": "lax.ceil({0})", "round": "_round({0}, {rounding_method})",
    "is_finite": "lax.is_finite({0})",
    "eq": "lax.eq({0}, {1})", "ne": "lax.ne({0}, {1})", "lt": "lax.lt({0}, {1})", "le": "lax.le({0}, {1})",
    "gt": "lax.gt({0}, {1})", "ge": "lax.ge({0}, {1})",
    "select_n": "lax.select_n({args})", "clamp": "lax.clamp({0}, {1}, {2})",
    "and": "lax.bitwise_and({0}, {1})", "or": "lax.bitwise_or({0}, {1})", "not": "lax.bitwise_not({0})",
    "xor": "lax.bitwise_xor({0}, {1})", "shift_left": "lax.shift_left({0}, {1})",
    "shift_right_logical": "lax.shift_right_logical({0}, {1})",
    "shift_right_arithmetic": "lax.shift_right_arithmetic({0}, {1})",
    "population_count": "lax.population_count({0})", "clz": "lax.clz({0})",
    "convert_element_type": "lax.convert_element_type({0}, {new_dtype})",
}

# Ops computed in float32 when their operands are 16-bit floats, then rounded
# back: Pallas' Triton lowering rejects bf16 division and transcendentals, and
# XLA also computes these in float32 and rounds each result.
UPCAST_16BIT = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "square", "atan2",
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    "floor", "ceil", "eq", "ne", "lt", "le", "gt", "ge", "max", "min", "clamp", "sign", "abs", "neg",
    "erf", "erfc", "erf_inv",  # XLA feeds them a 16-bit chain's unrounded float32 too
})

# Binary ops whose operands commute (IEEE add and mul do): written once either way round.
_COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})

# Ops whose result jumps with the last bit of an operand: they see the 16-bit
# value jax.jit would, not the unrounded float32 it came from.
_ROUNDING_SENSITIVE = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "floor", "ceil", "sign", "max", "min", "clamp"})

# Helpers for primitives Pallas' Triton lowering lacks, written with ops it has.
HELPERS = {
    "_erf": '''
def _erf(x):
    """erf as XLA computes float32 erf (Eigen's rational approximation, |err| < 2
    ulp): x P(x^2) / Q(x^2) with Q(0) = 1, so no product flushes for tiny x; ±1 from
    |x| = 3.8325, where erf rounds to 1."""
    xf = x.astype(jnp.float32)
    x2 = xf * xf
    p = x2 * 2.2905065861350646e-04 + 3.4082910107109506e-03
    for c in (5.0955695062380861e-02, 1.8520832239976145e-01, 1.128379143519084):
        p = p * x2 + c
    q = x2 * -1.1791602954361697e-07 + 2.3547966471313185e-05
    for c in (1.0179625278914885e-03, 1.4070470171167667e-02, 1.1098505178285362e-01, 4.9746925110067538e-01, 1.0):
        q = q * x2 + c
    return jnp.where(lax.abs(xf) >= 3.832506856900711, lax.sign(xf), xf * p / q).astype(x.dtype)
''',
    "_erfc": '''
def _erfc(x):
    """erfc as XLA expands it for float32 (CHLO's erfc, Cephes' polynomials):
    1 - x T(x^2) for |x| < 1; else exp(-x^2) / |x| times a polynomial in 1/x^2
    (P below 2, R above), 0 once exp(-x^2) underflows, 2 minus that for x < 0.
    Not 1 - erf(x), which is 0 from x ~ 3.9 where erfc is still ~1e-8."""
    xf = x.astype(jnp.float32)
    ax = lax.abs(xf)
    x2 = xf * xf
    t = x2 * 7.853861353153693e-05 + -8.010193625184903e-04
    for c in (5.188327685732524e-03, -2.685381193529856e-02, 1.128358514861418e-01,
              -3.761262582423300e-01, 1.128379165726710e+00):
        t = t * x2 + c
    small = 1.0 - xf * t
    r = 1.0 / x2
    p = r * 2.326819970068386e-02 + -1.387039388740657e-01
    for c in (3.687424674597105e-01, -5.824733027278666e-01, 6.210004621745983e-01, -4.944515323274145e-01,
              3.404879937665872e-01, -2.741127028184656e-01, 5.638259427386472e-01):
        p = p * r + c
    q = r * -1.047766399936249e+01 + 1.297719955372516e+01
    for c in (-7.495518717768503e+00, 2.921019019210786e+00, -1.015265279202700e+00, 4.218463358204948e-01,
              -2.820767439740514e-01, 5.641895067754075e-01):
        q = q * r + c
    z = -x2
    big = lax.exp(z) * (1.0 / ax) * jnp.where(ax < 2.0, p, q)
    big = jnp.where(z < -88.72283905206835, 0.0, big)
    big = jnp.where(xf < 0.0, 2.0 - big, big)
    return jnp.where(ax < 1.0, small, big).astype(x.dtype)
''',
    "_erf_inv": '''
def _erf_inv(x):
    return lax.erf_inv(x.astype(jnp.float32)).astype(x.dtype)
''',
    "_round": '''
def _round(x, method):
    """lax.round: method 0 rounds half away from zero, 1 half to even."""
    xf = x.astype(jnp.float32) if x.dtype.itemsize < 4 else x
    a = lax.abs(xf)
    fl = lax.floor(a)
    frac = a - fl
    if method == 0:
        r = jnp.where(frac >= 0.5, fl + 1.0, fl)
    else:
        odd = (fl - 2.0 * lax.floor(fl * 0.5)) != 0.0
        r = jnp.where((frac > 0.5) | ((frac == 0.5) & odd), fl + 1.0, fl)
    return (lax.sign(xf) * r).astype(x.dtype)
''',
}

# Float max / min as XLA computes them, NaN included: Pallas lowers lax.max /
# lax.min and the jnp.max / jnp.min / argmax reductions to maxnum / minnum,
# which drop a NaN on the GPU (the interpreter's XLA keeps it).
for _op in ("max", "min"):
    HELPERS[f"_f{_op}"] = f'''
def _f{_op}(a, b):
    return jnp.where((a != a) | (b != b), a + b, lax.{_op}(a, b))
'''
    # The NaN-free reduction and a separate any-NaN flag: two reductions, no custom combine.
    HELPERS[f"_reduce_f{_op}"] = f'''
def _reduce_f{_op}(x, axis):
    nan = jnp.max((x != x).astype(jnp.int32), axis=axis, keepdims=True) > 0
    return jnp.where(nan, float('nan'), jnp.{_op}(x, axis=axis, keepdims=True))
'''
HELPERS["_farg"] = '''
def _farg(x, axis, largest):
    """jnp.argmax / argmin of a float tile along axis (kept), as jax picks: the
    first NaN, else the first of the values equal to the best."""
    nan = x != x
    anynan = jnp.max(nan.astype(jnp.int32), axis=axis, keepdims=True) > 0
    fill = float('-inf') if largest else float('inf')
    clean = jnp.where(nan, fill, x)
    best = jnp.max(clean, axis=axis, keepdims=True) if largest else jnp.min(clean, axis=axis, keepdims=True)
    hit = jnp.where(anynan, nan, x == best)
    i = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, i, x.shape[axis]), axis=axis, keepdims=True)
'''
HELPERS["_idiv"] = '''
def _idiv(x, y):
    """Integer lax.div with XLA's results where the hardware's are undefined:
    x / 0 is -1 (all ones), INT_MIN / -1 is INT_MIN (-x, wrapped)."""
    zero = y == 0
    odd = zero
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        neg1 = y == -1
        odd = zero | neg1
    q = lax.div(x, jnp.where(odd, jnp.ones_like(y), y))
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        q = jnp.where(neg1, -x, q)
    return jnp.where(zero, ~jnp.zeros_like(x), q)
'''
HELPERS["_irem"] = '''
def _irem(x, y):
    """Integer lax.rem with XLA's results where the hardware's are undefined:
    x % 0 is x, INT_MIN % -1 is 0 (so is every x % -1)."""
    zero = y == 0
    odd = zero
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        odd = zero | (y == -1)
    r = lax.rem(x, jnp.where(odd, jnp.ones_like(y), y))
    return jnp.where(zero, x, r)
'''
_HELPER_DEPS = {}

PLT_IMPORT = "from jax.experimental.pallas import triton as plt"  # program.py leaves it out when unused
_PRELUDE = '''\
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
''' + PLT_IMPORT + '''

INTERPRET = {interpret}
ANY = pl.BlockSpec(memory_space=pl.ANY)
'''


INT32_LIMIT = 2**31 - 1  # extents at or past this index with int64


@dataclasses.dataclass
class RenderedKernel:
    name: str
    source: str  # kernel body + launcher
    equations: list[str]
    config: heuristics.TileConfig
    dims: list = dataclasses.field(default_factory=list)  # dim symbols the launcher takes
    guards: list = dataclasses.field(default_factory=list)  # what this kernel assumes of them
    triton: bool = False  # raw Triton run inside the XLA program (codegen/program.py), not a pallas_call
    # Which executor runs it and why ([Note: executors] in lowering/executors.py).
    executor: str = "pallas"
    reason: str = ""
    scope: str = ""  # the loop body function launching it ('' : the wrapper ``call``)
    inline: bool = False  # plain jnp code, no pallas_call (``render_inline_scalar``): not a kernel


@dataclasses.dataclass
class RenderedProgram:
    source: str  # the whole module: prelude, helpers, kernels, wrapper ``call``
    kernels: list[RenderedKernel]
    externs: list  # (primitive, params) in wrapper order; the module's ``EXTERNS``
    # Symbolic graphs ([Note: symbolic dims]): the dim symbols' names, and what
    # must hold of their values (sympy booleans) for the program to be right.
    symbols: list = dataclasses.field(default_factory=list)
    guards: list = dataclasses.field(default_factory=list)

    @property
    def guard_source(self) -> list[str]:
        """The guards as Python expressions over the symbols' names."""
        return [sizes.to_source(g) for g in self.guards]


def _is_16bit_float(dt) -> bool:
    return is_float(dt) and np.dtype(dt).itemsize == 2


def _bit_count_template(op, dt) -> str | None:
    """clz / population_count of 8- and 16-bit ints on their int32 bits, of
    unsigned ints on the signed int of their width: Triton legalizes only the
    libdevice calls (i32, i64), its math.ctlz fallback fails to compile. None:
    the op as it is."""
    dt = np.dtype(dt)
    fn = "lax.clz" if op == "clz" else "lax.population_count"
    if dt.kind in "iu" and dt.itemsize < 4:
        bits = 8 * dt.itemsize
        text = f"{fn}({{0}}.astype(jnp.int32) & {(1 << bits) - 1})"  # the zero-extended bits
        if op == "clz":
            text = f"({text} - {32 - bits})"
        return f"{text}.astype({dtype_source(dt)})"
    if dt.kind == "u":  # the signed int of its width: libdevice's __nv_clz / __nv_clzll
        return f"{fn}(lax.bitcast_convert_type({{0}}, jnp.int{8 * dt.itemsize})).astype({dtype_source(dt)})"
    return None


def is_float(dt) -> bool:
    return bool(jnp.issubdtype(np.dtype(dt), jnp.floating))


def dtype_source(dt) -> str:
    dt = np.dtype(dt)
    return "jnp.bool_" if dt == np.bool_ else f"jnp.{dt.name}"


def const_source(value, dt) -> str:
    dt = np.dtype(dt)
    if dt == np.bool_:
        return repr(bool(value))
    if jnp.issubdtype(dt, jnp.complexfloating):  # literals of XLA externs (kernels take no complex values)
        v = complex(value)
        return f"complex({const_source(v.real, np.float64)}, {const_source(v.imag, np.float64)})"
    if is_float(dt):
        v = float(value)
        if np.isnan(v):
            return "float('nan')"
        if np.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        return repr(v)
    return repr(int(value))


def _reduction_identity(op: str, dt) -> str:
    dt = np.dtype(dt)
    if op in ("sum", "or"):
        return "0"
    if op in ("prod", "and"):
        return "1"
    big = op in ("min", "argmin")
    if is_float(dt):
        return "float('inf')" if big else "float('-inf')"
    info = np.iinfo(np.int32 if dt == np.bool_ else dt)
    return str(info.max if big else info.min)


def _acc_dtype(op, dt):
    dt = np.dtype(dt)
    if op in ("and", "or") or dt == np.bool_:
        return np.dtype(np.int32)
    if is_float(dt) and dt.itemsize < 4:
        return np.dtype(np.float32)
    return dt


# --------------------------------------------------------------------------- #
# Kernel bodies
# --------------------------------------------------------------------------- #
def _is_one_hot(p) -> bool:
    """``p`` is ``eq(iota, v)`` at the product's own shape, as jax.nn.one_hot writes it.
    XLA rewrites only where the convert of the predicate feeds the multiply
    directly: a predicate computed at a smaller shape and broadcast (``x * (l == 1)``)
    keeps its multiply, so only this, the common pattern, is rewritten."""
    return (isinstance(p, ir.Op) and p.op == "eq" and np.dtype(p.dtype) == np.bool_
            and any(isinstance(a, ir.IndexValue) for a in p.args))


def _mul_by_converted_bool(e, interpret: bool):
    """``convert(pred) * x`` (a one-hot times values) as ``select(pred, x, 0)``, as
    XLA's algebraic simplifier rewrites it: the one-hot's zeros then hide x's
    NaN and infinities instead of making NaN of them (0 * inf). XLA:CPU computes
    16-bit floats in float32 and the rewrite does not see through that (jax.jit
    there gives NaN for bf16), XLA:GPU multiplies them natively and rewrites: in
    interpret mode only 32- and 64-bit products are rewritten. None otherwise."""
    if not (isinstance(e, ir.Op) and e.op == "mul" and is_float(e.dtype)):
        return None
    if interpret and _is_16bit_float(e.dtype):
        return None
    for i, a in enumerate(e.args):
        if (isinstance(a, ir.Op) and a.op == "convert_element_type" and _is_one_hot(a.args[0])
                and np.dtype(e.args[1 - i].dtype) == np.dtype(e.dtype)):
            return ir.Op("select_n", (a.args[0], ir.Const(0.0, np.dtype(e.dtype)), e.args[1 - i]), np.dtype(e.dtype))
    return None


def _select_n_template(cases: int) -> str:
    """``select_n`` over an int32 index or more than two cases as nested
    two-way selects: Pallas' Triton lowering takes a bool and two cases only."""
    text = "{%d}" % cases
    for k in range(cases - 2, -1, -1):
        text = f"jnp.where({{0}} == {k}, {{{k + 1}}}, {text})"
    return text


class _KernelEmitter:
    def __init__(self, kernel: Kernel, schedule: Schedule, cfg: heuristics.TileConfig, options: CompileOptions):
        self.k, self.schedule, self.cfg = kernel, schedule, cfg
        self.interpret = options.interpret
        self.excess_precision = options.allow_excess_precision
        self.graph = schedule.graph
        self.w = SourceWriter(1)
        self.in_refs = {b: f"in_ptr{i}" for i, b in enumerate(kernel.reads)}
        self.out_refs = {m.name: f"out_ptr{i}" for i, m in enumerate(m for m in kernel.members if m.store)}
        self.helpers: set[str] = set()
        self.row_values: dict[str, str] = {}  # in-kernel row-level buffers -> var
        self.forwarded: dict[str, tuple] = {}  # pointwise kernels: member -> (var, extent) of its value
        self.prefetched: dict[ir.Load, tuple[str, frozenset]] = {}  # mix kernels: loads issued a step ahead
        self.wide_of: dict[str, str] = {}  # 16-bit var -> the float32 var it was rounded from
        self.scopes: list[dict] = [{}]  # CSE: key -> (var, extent)
        self.counter = 0
        self.hints = options.size_hints
        self.online_softmax = getattr(options, "online_softmax", True)
        self.guards: list = []  # symbolic kernels: what the int32 index choice assumes
        self.index_dtype = "jnp.int64" if self._needs_int64() else "jnp.int32"

    def _needs_int64(self):
        extents = [self.k.rows * self.k.cols] + [sizes.numel(self.graph.buffer_aval(b)[0]) for b in self.k.reads]
        symbolic = [e for e in extents if sizes.is_symbolic(e)]
        big = max(sizes.hint(e, self.hints) for e in extents)
        if big >= INT32_LIMIT:
            return True
        # int32 indices at the hint: a size whose extents reach 2**31 breaks the
        # guard, and that call's signature compiles for its own size.
        self.guards += [sympy.Lt(sizes.simplify(e), INT32_LIMIT) for e in symbolic]
        return False

    # -- the dialect: how values are written (the Triton renderer overrides these) --
    HELPERS = HELPERS

    def dtype_text(self, dt) -> str:
        return dtype_source(dt)

    def full_text(self, value: str, dtype: str | None = None) -> str:
        return f"jnp.full((1, 1), {value}, {dtype})" if dtype else f"jnp.full((1, 1), {value})"

    def cast_text(self, var: str, dt) -> str:
        return f"{var}.astype({self.dtype_text(dt)})"

    def broadcast_text(self, var: str, shape: str) -> str:
        return f"jnp.broadcast_to({var}, {shape})"

    MINIMUM = "jnp.minimum"

    def iota_text(self, axis: int, block: str) -> str:
        """Indices 0..block-1 as a (block, 1) column (axis 0) or (1, block) row (axis 1)."""
        return f"lax.broadcasted_iota(IDX, {'(%s, 1)' % block if axis == 0 else '(1, %s)' % block}, {axis})"

    def op_template(self, e, names) -> str:
        if is_float(e.dtype):  # NaN-propagating forms (see the _fmax helper)
            if e.op in ("max", "min"):
                return f"_f{e.op}({{0}}, {{1}})"
            if e.op == "clamp":  # lax.clamp(lo, x, hi) = min(max(x, lo), hi)
                return "_fmin(_fmax({1}, {0}), {2})"
        if e.op in ("clz", "population_count"):
            return _bit_count_template(e.op, e.dtype) or OPS[e.op]
        if e.op in ("div", "rem") and np.dtype(e.dtype).kind in "iu":  # by 0, INT_MIN / -1: undefined in Triton
            return f"_i{e.op}({{0}}, {{1}})"
        if e.op == "select_n" and not (len(e.args) == 3 and e.args[0].dtype == np.bool_):
            return _select_n_template(len(e.args) - 1)
        return OPS[e.op]

    def load_text(self, ref: str, off: str, mask_arg: str) -> str:
        return f"plt.load({ref}.at[{off}]{mask_arg})"

    def store_text(self, ref: str, off: str, val: str, mask_arg: str) -> str:
        return f"plt.store({ref}.at[{off}], {val}{mask_arg})"

    # -- CSE ---------------------------------------------------------------------
    def lookup(self, key):
        for scope in reversed(self.scopes):
            if key in scope:
                return scope[key]
        return None

    def bind(self, key, text, extent, prefix="tmp"):
        found = self.lookup(key)
        if found is not None:
            return found
        name = f"{prefix}{self.counter}"
        self.counter += 1
        self.w.line(f"{name} = {text}")
        self.scopes[-1][key] = (name, extent)
        return name, extent

    def shape_of(self, extent) -> str:
        r = "BLOCK_R" if "r" in extent else "1"
        c = "BLOCK_C" if "c" in extent else "1"
        return f"({r}, {c})"

    def broadcast(self, var, extent, to) -> str:
        if extent == to:
            return var
        return self.bind(("bcast", var, to), self.broadcast_text(var, self.shape_of(to)), to)[0]

    # -- index expressions --------------------------------------------------------
    @staticmethod
    def extent_of(expr) -> frozenset:
        free = expr.free_symbols if hasattr(expr, "free_symbols") else set()
        return frozenset(({"r"} if XR in free else set()) | ({"c"} if XC in free else set()))

    def index(self, expr) -> tuple[str, frozenset]:
        expr = sizes.simplify(sympy.sympify(expr))
        if expr.has(ir.IndirectIndex):
            return self.indirect_index(expr)
        ext = self.extent_of(expr)
        if not ext:
            return self.bind(("index", expr), self.full_text(sizes.to_source(expr), self.index_dtype), ext, "idx")
        return self.bind(("index", expr), sizes.to_source(expr), ext, "idx")

    def indirect_index(self, expr) -> tuple[str, frozenset]:
        """An index holding run-time values ([Note: indirect indexing] in ir.py):
        each value emitted and cast to the index dtype, its variable printed in
        its place."""
        found = self.lookup(("index", expr))
        if found is not None:
            return found
        swap, ext = {}, frozenset()
        for app in ir.indirect_atoms((expr,)):
            var, vext = self.value(ir.indirect_value(app))
            var = self.bind(("idxcast", var), self.cast_text(var, self.index_dtype_np), vext)[0]
            swap[app] = sympy.Symbol(var, integer=True)
            ext = ext | vext
        direct = expr.xreplace(swap)
        ext = ext | self.extent_of(direct)  # a (1, 1) value's variable is an array: the text is one too
        return self.bind(("index", expr), sizes.to_source(direct), ext, "idx")

    @property
    def index_dtype_np(self):
        return np.dtype(np.int64) if self.index_dtype.endswith("int64") else np.dtype(np.int32)

    def condition(self, cond) -> tuple[str, frozenset]:
        ext = self.extent_of(cond)
        text = sizes.to_source(cond)
        if not ext:
            text = self.full_text(text)
        return self.bind(("cond", cond), text, ext, "mask")

    def edge_mask(self, extent) -> tuple[str, frozenset] | None:
        parts = [m for m, e in (("rmask", "r"), ("cmask", "c")) if e in extent]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0], frozenset(extent)
        return self.bind(("edge", "rc"), "rmask & cmask", frozenset("rc"), "mask")

    def offset(self, buffer: str, index) -> sympy.Expr:
        shape, _ = self.graph.buffer_aval(buffer)
        return sizes.simplify(sizes.ravel(index, shape))

    # -- values -------------------------------------------------------------------
    def value(self, expr: ir.Expr) -> tuple[str, frozenset]:
        """Emit ``expr`` (indices in kernel coordinates); returns (var, extent)."""
        memo = {}
        for e in ir.walk(expr):
            memo[e] = self._emit(e, memo)
        return memo[expr]

    def _emit(self, e, memo):
        if isinstance(e, ir.Const):
            return self.bind(("const", e), self.full_text(const_source(e.value, e.dtype), self.dtype_text(e.dtype)),
                             frozenset(), "cst")
        if isinstance(e, ir.IndexValue):
            if isinstance(e.expr, sympy.logic.boolalg.Boolean) and not e.expr.is_Symbol:  # a Symbol is Boolean too
                var, ext = self.condition(e.expr)
                return var, ext
            var, ext = self.index(e.expr)
            return self.bind(("iv", e), self.cast_text(var, e.dtype), ext)
        if isinstance(e, ir.Load):
            return self._load(e)
        # Op
        masked = _mul_by_converted_bool(e, getattr(self, "triton_interpret", self.interpret))
        if masked is not None:  # XLA's rewrite: convert(pred) * x is select(pred, x, 0)
            zero = masked.args[1]
            memo = {**memo, zero: self._emit(zero, memo)}
            return self._emit(masked, memo)
        args = [memo[a] for a in e.args]
        extent = frozenset().union(*[x for _, x in args]) if args else frozenset()
        names = [self.broadcast(v, x, extent) for v, x in args]
        if (e.op == "convert_element_type" and self.excess_precision and e.dtype == np.float32
                and np.dtype(e.args[0].dtype).name == "bfloat16" and names[0] in self.wide_of):
            # XLA computes bf16 ops in float32 and, with excess precision, drops the
            # f32 -> bf16 -> f32 convert pair: the float32 result is the unrounded one.
            return self.wide_of[names[0]], extent
        if e.op in UPCAST_16BIT and any(_is_16bit_float(a.dtype) for a in e.args):
            # Computed in float32. An operand that is itself a rounded float32
            # result is used unrounded (XLA's allow_excess_precision does the
            # same): chains of 16-bit ops round once, at the store.
            exact = e.op in _ROUNDING_SENSITIVE or not self.excess_precision
            names = [self._widen(n, extent, exact) if _is_16bit_float(a.dtype) else n for n, a in zip(names, e.args)]
            wide = dataclasses.replace(e, dtype=np.dtype(np.float32) if _is_16bit_float(e.dtype) else e.dtype)
            var, ext = self._op(wide, names, extent)
            if not _is_16bit_float(e.dtype):
                return var, ext
            narrow = self.bind(("narrow", var, e.dtype), self.cast_text(var, e.dtype), ext)
            self.wide_of[narrow[0]] = var
            return narrow
        return self._op(e, names, extent)

    def _widen(self, var, extent, exact=False) -> str:
        if var in self.wide_of and not exact:
            return self.wide_of[var]
        return self.bind(("f32", var), self.cast_text(var, np.float32), extent)[0]

    def _op(self, e, names, extent):
        params = {k: (self.dtype_text(v) if isinstance(v, np.dtype) else v) for k, v in e.params}
        template = self.op_template(e, names)
        for h in self.HELPERS:
            if h + "(" in template:
                self.helpers.add(h)
                self.helpers.update(_HELPER_DEPS.get(h, ()))
        text = template.format(*names, args=", ".join(names), **params)
        key = tuple(sorted(names)) if e.op in _COMMUTATIVE else tuple(names)  # x * c and c * x: one value
        return self.bind(("op", e.op, key, e.params), text, extent)

    def _load(self, ld: ir.Load):
        if ld.buffer in self.row_values:
            return self.row_values[ld.buffer], frozenset("r")
        if ld.buffer in self.forwarded:  # a pointwise member's value, read at its own point
            return self.forwarded[ld.buffer]
        if ld in self.prefetched:
            return self.prefetched[ld]
        off, off_ext = self.index(self.offset(ld.buffer, ld.index))
        extent = off_ext
        masks = []
        edge = self.edge_mask(off_ext)
        if edge is not None:
            masks.append(edge)
        if ld.mask is not None:
            cond = self.condition(ld.mask)
            masks.append(cond)
            extent = extent | cond[1]
        off = self.broadcast(off, off_ext, extent)
        mask_names = [self.broadcast(v, x, extent) for v, x in masks]
        if len(mask_names) > 1:
            mask = self.bind(("and", tuple(mask_names)), " & ".join(mask_names), extent, "mask")[0]
        else:
            mask = mask_names[0] if mask_names else None
        ref = self.in_refs[ld.buffer]
        other = "False" if ld.dtype == np.bool_ else "0"
        mask_arg = f", mask={mask}, other={other}" if mask else ""
        return self.bind(("load", ref, off, mask), self.load_text(ref, off, mask_arg), extent)

    def store(self, m: Member, var: str, extent):
        own = tuple(sizes.simplify(m.coords.get(s, s)) for s in m.node.symbols)
        off, off_ext = self.index(self.offset(m.name, own))
        full = off_ext | extent
        off = self.broadcast(off, off_ext, full)
        val = self.broadcast(var, extent, full)
        edge = self.edge_mask(full)
        mask = ""
        if edge:
            mask_var = self.broadcast(edge[0], edge[1], full)
            mask = f", mask={mask_var}"
            if self.interpret:
                # Masked-off lanes may compute offsets that alias live lanes (an
                # index folded modulo a dimension). The GPU never writes them;
                # interpret mode scatters every lane, so send them out of bounds,
                # where the scatter drops them.
                off = self.bind(("oob", off, mask_var), f"jnp.where({mask_var}, {off}, {m.node.numel})", full, "idx")[0]
        self.w.line(self.store_text(self.out_refs[m.name], off, self.cast_text(val, m.node.dtype), mask))


def _kernel_coords_body(m: Member) -> ir.Expr:
    # Kept on the member: the tile choice and the writer ask for it again, and a combo's
    # thousand bodies push each other out of substitute_index's cache.
    coords = tuple(m.coords.items())
    hit = m.__dict__.get("_coords_body")
    if hit is not None and hit[0] is m.body and hit[1] == coords:
        return hit[2]
    out = ir.substitute_index(m.body, {s: sizes.simplify(v) for s, v in coords})
    m.__dict__["_coords_body"] = (m.body, coords, out)
    return out


def _phases(kernel: Kernel):
    """Phase of each member: a reduction runs in the loop after every in-kernel
    row value it reads is final; row-wise stores and row values likewise."""
    names = {m.name for m in kernel.members}
    phase = {}
    for m in kernel.members:  # members are in topological order
        deps = [ld.buffer for ld in ir.loads(m.body) if ld.buffer in names]
        after = max((phase[d] + (1 if _is_reduction(kernel, d) else 0) for d in deps), default=0)
        phase[m.name] = after
    return phase


def _is_reduction(kernel, name):
    return any(m.name == name and m.role == "reduction" for m in kernel.members)


def kernel_config(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> heuristics.TileConfig:
    if sizes.is_symbolic((kernel.rows, kernel.cols)):
        return _symbolic_config(kernel, schedule, options)
    if kernel.kind == "pointwise":
        if _transposed_load(kernel, schedule):
            cfg = heuristics.transpose_config(kernel.rows, kernel.cols)
        else:
            cfg = heuristics.pointwise_config(kernel.rows, kernel.cols)
    elif kernel.kind == "mix":
        cfg = heuristics.mix_config(kernel.rows, kernel.cols, whole_rows=_whole_rows(kernel),
                                    programs=kernel.programs, columns=_columns(kernel))
    else:
        inner = _reduction_is_inner(kernel, schedule)
        prod = any(m.role == "reduction" and m.node.op == "prod" for m in kernel.members)
        cfg = heuristics.reduction_config(kernel.rows, kernel.cols, max_persistent_cols=options.max_persistent_cols,
                                          inner_contiguous=inner, force_width_one=prod,
                                          long_rows=options.long_rows, itemsize=_widest_read(kernel, schedule))
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    return cfg


def _widest_read(kernel: Kernel, schedule: Schedule) -> int:
    """The largest itemsize among the buffers a kernel reads (4 if none)."""
    return max([np.dtype(schedule.graph.buffer_aval(b)[1]).itemsize for b in kernel.reads] or [4])


def _symbolic_config(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> heuristics.TileConfig:
    """The tile of a kernel whose rows or columns are symbolic: the heuristics
    at the size hints. Only what stays right at every size: pointwise kernels,
    and row reductions whose reduced (column) extent is static."""
    rows, cols = (sizes.hint(x, options.size_hints) for x in (kernel.rows, kernel.cols))
    if kernel.kind == "pointwise":
        if _transposed_load(kernel, schedule):
            cfg = heuristics.transpose_config(rows, cols)
        else:
            cfg = heuristics.pointwise_config(rows, cols)
    elif kernel.kind == "mix" and not sizes.is_symbolic(kernel.cols):
        # Dynamic rows: the persistent grid is sized at the hint (the partial
        # buffer has that many rows); each program's row-block count is a
        # runtime value (_render_mix).
        cfg = heuristics.mix_config(rows, cols, whole_rows=_whole_rows(kernel), programs=kernel.programs,
                                    columns=_columns(kernel))
    elif kernel.kind == "reduction" and not sizes.is_symbolic(kernel.cols):
        inner = _reduction_is_inner(kernel, schedule)
        prod = any(m.role == "reduction" and m.node.op == "prod" for m in kernel.members)
        cfg = heuristics.reduction_config(rows, cols, max_persistent_cols=options.max_persistent_cols,
                                          inner_contiguous=inner, force_width_one=prod)
    elif kernel.kind == "reduction":
        # Over a dynamic axis: always looped (no tile holds every size), the
        # chunk count a runtime value; chunks no wider than the hinted row.
        if any(m.role == "reduction" and m.node.op in ("argmax", "argmin") for m in kernel.members):
            raise SymbolicUnsupported(f"kernel {kernel.name}: argmax/argmin over a dynamic axis ({kernel.cols})")
        inner = _reduction_is_inner(kernel, schedule)
        prod = any(m.role == "reduction" and m.node.op == "prod" for m in kernel.members)
        cfg = heuristics.reduction_config(rows, cols, max_persistent_cols=0, inner_contiguous=inner,
                                          force_width_one=prod)
        cfg = dataclasses.replace(cfg, block_cols=min(cfg.block_cols, max(16, sizes.next_power_of_2(cols))))
    else:
        raise SymbolicUnsupported(
            f"{kernel.kind} kernel {kernel.name} over symbolic sizes {kernel.rows} x {kernel.cols}")
    if options.num_warps:
        cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
    return cfg


def _cdiv_source(n, block: int, name: str, block_name: str) -> str:
    """Source of ceil(n / block): a number for a static ``n``, else an
    expression over the kernel's ``name`` / ``block_name`` constants."""
    if not sizes.is_symbolic(n):
        return str(-(-int(n) // block))
    return f"({name} + {block_name} - 1) // {block_name}"


def _grid_cdiv(n, block: int) -> str:
    """Launcher source of ceil(n / block) (Python ints when the launcher runs)."""
    if not sizes.is_symbolic(n):
        return str(-(-int(n) // block))
    return f"pl.cdiv({sizes.to_source(n)}, {block})"


def _transposed_load(kernel, schedule) -> bool:
    """Does a pointwise kernel load memory contiguously along its rows (the
    store is contiguous along its columns)? Then it is a tiled transpose."""
    for m in kernel.members:
        for ld in ir.loads(_kernel_coords_body(m)):
            if ld.buffer not in kernel.reads:
                continue
            shape, _ = schedule.graph.buffer_aval(ld.buffer)
            off = sizes.simplify(sizes.ravel(ld.index, shape))
            if XC in off.free_symbols and off.coeff(XR) == 1 and off.coeff(XC) != 1:
                return True
    return False


def _reduction_is_inner(kernel, schedule) -> bool:
    """Is xc the fastest-moving index of the kernel's main loads?"""
    for m in kernel.members:
        if m.role != "reduction":
            continue
        for ld in ir.loads(_kernel_coords_body(m)):
            if ld.buffer not in kernel.reads:
                continue
            shape, _ = schedule.graph.buffer_aval(ld.buffer)
            off = sizes.simplify(sizes.ravel(ld.index, shape))
            return off.coeff(XC) == 1 or XR not in off.free_symbols
    return True


def render_kernel(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> tuple[RenderedKernel, set]:
    cfg = kernel_config(kernel, schedule, options)
    em = _KernelEmitter(kernel, schedule, cfg, options)
    w = em.w
    bodies = {m.name: _kernel_coords_body(m) for m in kernel.members}
    w.line("pid = pl.program_id(0)")
    if kernel.kind == "pointwise":
        write_pointwise(em, kernel, bodies, cfg)
    elif kernel.kind == "mix":
        _render_mix(em, kernel, bodies, cfg)
    else:
        _render_reduction(em, kernel, bodies, cfg)
    body = w.source()
    return _wrap_kernel(kernel, schedule, cfg, em, body), em.helpers


class _InlineEmitter(_KernelEmitter):
    """The pallas dialect on plain arrays: loads index a flat jnp array, stores
    queue (offsets, value, mask) for the launcher to scatter (``_inline_*`` helpers)."""

    def load_text(self, ref: str, off: str, mask_arg: str) -> str:
        return f"_inline_load({ref}, {off}{mask_arg})"

    def store_text(self, ref: str, off: str, val: str, mask_arg: str) -> str:
        return f"{ref}.append(({off}, {val}{mask_arg.replace(', mask=', ', ') or ', None'}))"


_INLINE_HELPERS = '''\
def _inline_load(ref, off, mask=None, other=0):
    if ref.size == 1:  # no gather: the one element, at every lane
        value = jnp.broadcast_to(ref.reshape((1,) * off.ndim), off.shape)
    else:
        value = ref[off if mask is None else jnp.where(mask, off, 0)]
    return value if mask is None else jnp.where(mask, value, other)


def _inline_result(stores, numel, dtype):
    if numel == 1 and len(stores) == 1:  # no scatter: lane (0, 0) holds the element
        off, val, _ = stores[0]
        return jnp.broadcast_arrays(off, val)[1].reshape(-1)[:1].astype(dtype)
    out = jnp.zeros((numel,), dtype)
    for off, val, mask in stores:
        off = off if mask is None else jnp.where(mask, off, numel)
        off, val = jnp.broadcast_arrays(off, val)
        out = out.at[off.reshape(-1)].set(val.reshape(-1).astype(dtype), mode="drop")
    return out
'''


def inline_scalar(kernel: Kernel, scope: str) -> bool:
    """A loop body's pointwise group over one element (a loop counter's ``i + 1``,
    a while condition's ``i < n``): plain jnp code, which XLA fuses with the
    loop's own bookkeeping, rather than one kernel launch per iteration."""
    if not scope or kernel.kind != "pointwise" or sizes.is_symbolic((kernel.rows, kernel.cols)):
        return False
    return kernel.rows * kernel.cols == 1


def render_inline_scalar(kernel: Kernel, schedule: Schedule, options: CompileOptions):
    """``inline_scalar``'s group as a function of the same signature as a
    launcher: the pointwise kernel body run once on the flat arrays."""
    cfg = kernel_config(kernel, schedule, options)
    em = _InlineEmitter(kernel, schedule, cfg, options)
    em.w.line("pid = 0")
    write_pointwise(em, kernel, {m.name: _kernel_coords_body(m) for m in kernel.members}, cfg)
    w = SourceWriter()
    w.line(f"# {kernel.name}: one element, plain jnp (no kernel launch)")
    for eq in kernel.origin:
        w.line(f"#   {eq}")
    body = em.w.source()
    ins, outs, dims = _write_kernel_function(w, f"{kernel.name}_inline", kernel, schedule, cfg, em, body)
    args = (["dims"] if dims else []) + [f"in{i}" for i in range(len(ins))]
    w.line(f"def {kernel.name}({', '.join(args + (['*'] + list(dims) if dims else []))}):")
    with w.indent():
        w.line(f"outs = {'(' + ', '.join(['[]'] * len(outs)) + (',)' if len(outs) == 1 else ')')}")
        operands = (["dims"] if dims else []) + [f"{a}.reshape(-1)" for a in args if a != "dims"]
        w.line(f"{kernel.name}_inline({', '.join(operands)}, *outs)")
        results = [f"_inline_result(outs[{i}], {sizes.to_source(m.node.numel)}, {dtype_source(m.node.dtype)})"
                   for i, m in enumerate(m for m in kernel.members if m.store)]
        w.line(f"return ({', '.join(results)},)")
    return RenderedKernel(kernel.name, w.source(), list(kernel.origin), cfg, dims, em.guards, scope="",
                          inline=True), em.helpers


def write_pointwise(em, kernel: Kernel, bodies, cfg) -> None:
    """A pointwise kernel's body after ``pid``: its tile of rows x columns, every
    member's value, the stores (both renderers, ``em``'s dialect)."""
    w = em.w
    w.line(f"col_blocks = {_cdiv_source(kernel.cols, cfg.block_cols, 'COLS', 'BLOCK_C')}")
    w.line(f"xr = (pid // col_blocks) * BLOCK_R + {em.iota_text(0, 'BLOCK_R')}")
    w.line(f"xc = (pid % col_blocks) * BLOCK_C + {em.iota_text(1, 'BLOCK_C')}")
    w.line("rmask = xr < ROWS")
    w.line("cmask = xc < COLS")
    for m in kernel.members:  # in graph order: a member a later one reads comes first
        var, ext = em.value(bodies[m.name])
        em.forwarded[m.name] = var, ext
        if m.store:
            em.store(m, var, ext)


def _render_reduction(em: _KernelEmitter, kernel: Kernel, bodies, cfg, *, row_block="pid", columns_ready=False):
    """Row reductions, row values and row-wise stores of one block of rows
    (``row_block``). ``columns_ready``: ``xc``/``cmask`` are already defined."""
    w = em.w
    w.line(f"xr = {row_block} * BLOCK_R + lax.broadcasted_iota(IDX, (BLOCK_R, 1), 0)")
    w.line("rmask = xr < ROWS")
    online = _online_plans(kernel, bodies) if not cfg.persistent and em.online_softmax else {}
    phase, online = _online_phases(kernel, online) if online else (_phases(kernel), {})
    n_phases = max(phase.values()) + 1
    for p in range(n_phases):
        reds = [m for m in kernel.members if m.role == "reduction" and phase[m.name] == p]
        rowwise = [m for m in kernel.members if m.role == "rowwise" and m.store and phase[m.name] == p]
        if reds or rowwise:
            if cfg.persistent:
                if p == 0 and not columns_ready:
                    w.line("xc = lax.broadcasted_iota(IDX, (1, BLOCK_C), 1)")
                    w.line("cmask = xc < COLS")
                results = {}
                for m in reds:
                    var, ext = em.value(bodies[m.name])
                    results[m.name] = _reduce_tile(em, m, var, ext)
                for m in rowwise:
                    em.store(m, *em.value(bodies[m.name]))
                for m in reds:
                    em.row_values[m.name] = results[m.name]
            else:
                _render_loop(em, kernel, bodies, reds, rowwise, p, cfg,
                             online={m.name: online[m.name] for m in reds if m.name in online})
        write_ready_row_values(em, kernel, bodies)
    store_reductions(em, kernel)


def write_ready_row_values(em, kernel: Kernel, bodies) -> None:
    """Row values (epilogues) whose inputs are final after the phase just
    written, each kept as a (BLOCK_R, 1) value and stored if it is stored."""
    for m in kernel.members:
        if m.role == "row" and m.name not in em.row_values and _row_ready(m, em, kernel):
            var, ext = em.value(bodies[m.name])
            var = em.broadcast(var, ext, frozenset("r"))
            em.row_values[m.name] = var
            if m.store:
                em.store(m, var, frozenset("r"))


def store_reductions(em, kernel: Kernel) -> None:
    for m in kernel.members:
        if m.role == "reduction" and m.store:
            em.store(m, em.row_values[m.name], frozenset("r"))


def _whole_rows(kernel: Kernel) -> bool:
    """Does a mix kernel need whole rows in a tile (it reduces rows)?"""
    return any(m.role in ("reduction", "row") for m in kernel.members)


def _columns(kernel: Kernel) -> int:
    """Column reductions a mix kernel accumulates."""
    return sum(m.role == "column" for m in kernel.members)


def _render_mix(em: _KernelEmitter, kernel: Kernel, bodies, cfg):
    """A persistent grid of ``PROGRAMS`` programs; each walks the row blocks
    ``program, program + PROGRAMS, ...``, doing the row work of each block (row
    reductions, row values, row-wise stores) and folding each column member
    into a (1, BLOCK_C) accumulator, stored as the program's partial row.
    With ``cfg.prefetch``, the loop also carries the row loads of the next
    blocks (``load_rows``), issued that many steps before they are used."""
    w = em.w
    columns = [m for m in kernel.members if m.role == "column"]
    whole = _whole_rows(kernel)
    w.line(f"PROGRAMS = {kernel.programs}")
    if whole:
        w.line("program = pid")
        w.line("xc = lax.broadcasted_iota(IDX, (1, BLOCK_C), 1)")
    else:
        w.line(f"col_blocks = {-(-kernel.cols // cfg.block_cols)}")
        w.line("program = pid // col_blocks")
        w.line("xc = (pid % col_blocks) * BLOCK_C + lax.broadcasted_iota(IDX, (1, BLOCK_C), 1)")
    w.line("cmask = xc < COLS")
    accs = []
    for i, m in enumerate(columns):
        acc_dt = m.node.dtype
        name = f"acc{i}"
        w.line(f"{name} = jnp.full((BLOCK_R, BLOCK_C), {_reduction_identity(m.node.op, acc_dt)}, {dtype_source(acc_dt)})")
        accs.append((name, acc_dt, m))
    loads = _row_loads(em, kernel, bodies) if whole and cfg.prefetch else []
    ahead = _write_row_loads(em, loads) if loads else []  # (load, extent) of each row load
    depth = cfg.prefetch if ahead else 0
    for d in range(depth):
        w.line(f"rows{d} = load_rows(program + {d} * PROGRAMS)")
    carried = [a for a, _, _ in accs] + [f"rows{d}" for d in range(depth)]
    carry = ", ".join(carried) + ("," if len(carried) == 1 else "")
    if sizes.is_symbolic(kernel.rows):  # dynamic rows: the row-block count is computed in the kernel
        n_iter = "((ROWS + BLOCK_R - 1) // BLOCK_R + PROGRAMS - 1) // PROGRAMS"
    else:
        n_iter = -(-(-(-kernel.rows // cfg.block_rows)) // kernel.programs)
    # Loads that do not depend on the row (a norm's weight) stay inside the
    # loop: hoisted, they hold registers for the whole loop and cost one-warp
    # programs occupancy (slower on both norms: RESULTS.md, "Heuristics: split
    # reductions and mix kernels"); in the loop they hit L1.
    w.line("def row_block(step, carry):")
    with w.indent():
        w.line(f"{carry} = carry")
        em.scopes.append({})
        em.row_values = {}
        row_block = "(program + step * PROGRAMS)"
        if ahead:  # this block's row loads came in the carry; issue those of the block `depth` steps on
            names = [f"pre{i}" for i in range(len(ahead))]
            w.line(f"{', '.join(names)}, = rows0")
            w.line(f"rows{depth} = load_rows(program + (step + {depth}) * PROGRAMS)")
            em.prefetched = {ld: (n, ext) for (ld, ext), n in zip(ahead, names)}
        if whole:
            _render_reduction(em, kernel, bodies, cfg, row_block=row_block, columns_ready=True)
        else:
            w.line(f"xr = {row_block} * BLOCK_R + lax.broadcasted_iota(IDX, (BLOCK_R, 1), 0)")
            w.line("rmask = xr < ROWS")
            for m in kernel.members:
                if m.role == "rowwise" and m.store:
                    em.store(m, *em.value(bodies[m.name]))
        full = frozenset("rc")
        outs = []
        for name, acc_dt, m in accs:
            var, ext = em.value(bodies[m.name])
            v = em.broadcast(var, ext, full)
            if acc_dt != m.body.dtype:
                v = em.bind(("cast", v, acc_dt), f"{v}.astype({dtype_source(acc_dt)})", full)[0]
            edge = em.edge_mask(full)[0]
            ident = _reduction_identity(m.node.op, acc_dt)
            masked = em.bind(("masked", v, edge, ident), f"jnp.where({edge}, {v}, {ident})", full)[0]
            # Combined element-wise: the cross-row reduction happens once, after the loop.
            outs.append(_combine_text(em, m.node.op, name, masked, acc_dt))
        em.scopes.pop()
        em.prefetched = {}
        outs += [f"rows{d}" for d in range(1, depth + 1)]
        w.line(f"return ({', '.join(outs)},)")
    w.line(f"{carry} = lax.fori_loop(0, {n_iter}, row_block, ({carry}))")
    for name, acc_dt, m in accs:
        off = em.bind(("partial_offset",), f"program * {kernel.cols} + xc", frozenset("c"), "idx")[0]
        if em.interpret:
            off = em.bind(("oob", off, "cmask"), f"jnp.where(cmask, {off}, {m.node.numel})", frozenset("c"), "idx")[0]
        w.line(f"plt.store({em.out_refs[m.name]}.at[{off}], {_reduce_text(em, m.node.op, name, acc_dt, 0)}, mask=cmask)")


def _row_loads(em, kernel: Kernel, bodies) -> list[ir.Load]:
    """The loads of a mix kernel that move with the row block (what it
    streams: inputs indexed by the row), each once."""
    members = {m.name for m in kernel.members}
    found = {}
    for m in kernel.members:
        for ld in ir.loads(bodies[m.name]):
            if ld.buffer not in members and "r" in em.extent_of(em.offset(ld.buffer, ld.index)):
                found[ld] = None
    return list(found)


def _write_row_loads(em, loads: list[ir.Load]) -> list[tuple[ir.Load, frozenset]]:
    """``def load_rows(block)``: ``loads`` at one row block, returned as a
    tuple (a block past the last row loads nothing: its rows are masked).
    Returns each load with its extent."""
    w = em.w
    w.line("def load_rows(block):")
    with w.indent():
        em.scopes.append({})
        w.line("xr = block * BLOCK_R + lax.broadcasted_iota(IDX, (BLOCK_R, 1), 0)")
        w.line("rmask = xr < ROWS")
        loaded = [em._load(ld) for ld in loads]
        em.scopes.pop()
        w.line(f"return ({', '.join(v for v, _ in loaded)},)")
    return [(ld, ext) for ld, (_, ext) in zip(loads, loaded)]


def _row_ready(m, em, kernel):
    names = {x.name for x in kernel.members}
    return all(ld.buffer in em.row_values for ld in ir.loads(m.body) if ld.buffer in names)


def _reduce_tile(em, m: Member, var, ext) -> str:
    node = m.node
    full = frozenset("rc")
    acc_dt = _acc_dtype(node.op, m.body.dtype)
    v = em.broadcast(var, ext, full)
    if acc_dt != m.body.dtype:
        v = em.bind(("cast", v, acc_dt), f"{v}.astype({dtype_source(acc_dt)})", full)[0]
    ident = _reduction_identity(node.op, m.body.dtype)
    # The key holds the identity: a max and a min of one value pad it differently.
    masked = em.bind(("masked", v, "cmask", ident), f"jnp.where(cmask, {v}, {ident})", full)[0]
    text = f"{_reduce_text(em, node.op, masked, acc_dt, 1)}.astype({dtype_source(node.dtype)})"
    return em.bind(("reduce", node.name), text, frozenset("r"), "red")[0]


# Tile reductions by op (and/or run on int32 0/1 accumulators).
_REDUCE_FN = {"sum": "jnp.sum", "prod": "jnp.prod", "max": "jnp.max", "min": "jnp.min", "and": "jnp.min",
              "or": "jnp.max", "argmax": "jnp.argmax", "argmin": "jnp.argmin"}
_COMBINE = {"sum": "lax.add({a}, {v})", "prod": "lax.mul({a}, {v})", "max": "lax.max({a}, {v})",
            "min": "lax.min({a}, {v})", "and": "lax.min({a}, {v})", "or": "lax.max({a}, {v})"}


def _reduce_text(em, op, var, acc_dt, axis) -> str:
    """``var`` reduced along ``axis`` (kept); a float max / min / argmax /
    argmin through the NaN-propagating helpers."""
    if is_float(acc_dt) and op in ("max", "min"):
        em.helpers.add(f"_reduce_f{op}")
        return f"_reduce_f{op}({var}, {axis})"
    if is_float(acc_dt) and op in ("argmax", "argmin"):
        em.helpers.add("_farg")
        return f"_farg({var}, {axis}, {op == 'argmax'})"
    return f"{_REDUCE_FN[op]}({var}, axis={axis}, keepdims=True)"


def _combine_text(em, op, acc, v, acc_dt) -> str:
    """One element-wise combine step of a looped reduction (NaN-propagating for floats)."""
    if is_float(acc_dt) and op in ("max", "min"):
        em.helpers.add(f"_f{op}")
        return f"_f{op}({acc}, {v})"
    return _COMBINE[op].format(a=acc, v=v)


def _render_loop(em, kernel, bodies, reds, rowwise, p, cfg, online=None):
    w = em.w
    accs, carried = [], []
    # [Note: online softmax]: sums folded into this loop, one set of accumulators per
    # distinct A; a float max over exactly A is read off them.
    online = online or {}
    groups: dict = {}  # A -> accumulator name
    for m in reds:
        if m.name in online:
            groups.setdefault(online[m.name].shifted, f"onl{p}_{len(groups)}")
    derived = {m.name: groups[bodies[m.name]] for m in reds
               if m.node.op == "max" and is_float(m.body.dtype) and bodies[m.name] in groups}
    for i, m in enumerate(r for r in reds if r.name not in online and r.name not in derived):
        acc_dt = _acc_dtype(m.node.op, m.body.dtype)
        ident = _reduction_identity(m.node.op, m.body.dtype)
        name = f"acc{p}_{i}"
        w.line(f"{name} = jnp.full((BLOCK_R, BLOCK_C), {ident}, {dtype_source(acc_dt)})")
        carried.append(name)
        if m.node.op in ("argmax", "argmin"):  # each lane also carries the index of its best value
            w.line(f"{name}_i = jnp.zeros((BLOCK_R, BLOCK_C), {dtype_source(m.node.dtype)})")
            carried.append(f"{name}_i")
        accs.append((name, acc_dt, m))
    for a, name in groups.items():
        carried += _online_init(em, name, a)
    carry = ", ".join(carried) + ("," if len(carried) == 1 else "")
    w.line(f"def phase{p}(chunk, carry):")
    with w.indent():
        w.line(f"{carry or '_'} = carry")
        w.line("xc = chunk * BLOCK_C + lax.broadcasted_iota(IDX, (1, BLOCK_C), 1)")
        w.line("cmask = xc < COLS")
        em.scopes.append({})
        outs = []
        for name, acc_dt, m in accs:
            var, ext = em.value(bodies[m.name])
            v = em.broadcast(var, ext, frozenset("rc"))
            if acc_dt != m.body.dtype:
                v = em.bind(("cast", v, acc_dt), f"{v}.astype({dtype_source(acc_dt)})", frozenset("rc"))[0]
            ident = _reduction_identity(m.node.op, m.body.dtype)
            masked = em.bind(("masked", v, "cmask", ident), f"jnp.where(cmask, {v}, {ident})", frozenset("rc"))[0]
            if m.node.op in ("argmax", "argmin"):
                outs += _arg_combine(em, name, masked, m.node.op, acc_dt, m.node.dtype)
            else:
                outs.append(_combine_text(em, m.node.op, name, masked, acc_dt))
        for a, name in groups.items():
            outs += _online_step(em, name, a)
        for m in rowwise:
            em.store(m, *em.value(bodies[m.name]))
        em.scopes.pop()
        w.line(f"return ({', '.join(outs)}{',' if len(outs) == 1 else ''})" if outs else "return carry")
    n_chunks = _cdiv_source(kernel.cols, cfg.block_cols, "COLS", "BLOCK_C")
    init = f"({carry})" if carried else "0"
    w.line(f"{carry or '_'} = lax.fori_loop(0, {n_chunks}, phase{p}, {init})")
    for name, acc_dt, m in accs:
        if m.node.op in ("argmax", "argmin"):
            text = _arg_finish(em, name, m.node.op, acc_dt, m.node.dtype)
        elif cfg.block_cols == 1:
            text = f"{name}.astype({dtype_source(m.node.dtype)})"
        else:
            text = f"{_reduce_text(em, m.node.op, name, acc_dt, 1)}.astype({dtype_source(m.node.dtype)})"
        em.row_values[m.name] = em.bind(("reduce", m.name), text, frozenset("r"), "red")[0]
    for name in groups.values():
        _online_flags(em, name)
    for m in reds:
        if m.name in derived:
            _online_max(em, derived[m.name], m)
    for m in reds:
        if m.name in online:
            _online_sum(em, groups[online[m.name].shifted], m, online[m.name])


# --------------------------------------------------------------------------- #
# Online softmax
# --------------------------------------------------------------------------- #
# [Note: online softmax]
# A looped kernel that reduces ``M = max(row)`` and then ``S = sum(exp(A - T(M)))``
# (softmax, log_softmax, logsumexp, a cross-entropy's normalizer; ``T`` a row-level
# function of M such as jax's ``max(-inf, M)`` or logsumexp's ``M if finite else 0``)
# would read the row once per reduction. Here both share one sweep: the loop keeps,
# per row, ``m`` the running max of the finite values of A seen so far, and per lane
# ``s = sum(exp(a - m))``, rescaled by ``exp(m_old - m_new)`` when m grows (one exp
# per row per chunk; the lanes' sum is one exp per element). After the loop
# ``S = sum(s) * exp(m - T(M))``. Non-finite values of A never enter m or s: each
# lane ORs flags (1 NaN, 2 +inf, 4 -inf), and the special cases are what the direct
# sum gives: NaN if A or T(M) holds a NaN; with T(M) = +inf, NaN if A holds +inf else
# 0; with T(M) = -inf (a row of -inf under softmax), NaN if A holds -inf else +inf;
# else +inf if A holds +inf. When M's own body is A (the usual case), M is read off
# the same accumulators (NaN flag, +inf flag, else m) and costs no loop carry.
@dataclasses.dataclass(frozen=True)
class _Online:
    max: str  # the max reduction member M
    shifted: ir.Expr  # A, in kernel coordinates
    shift: ir.Expr  # T(M), a row value


def _row_only(expr: ir.Expr) -> bool:
    """Does ``expr`` (kernel coordinates) take one value per row (no ``xc``)?"""
    for e in ir.walk(expr):
        if isinstance(e, ir.IndexValue) and XC in sympy.sympify(e.expr).free_symbols:
            return False
        if isinstance(e, ir.Load):
            syms = set().union(*[sympy.sympify(i).free_symbols for i in e.index]) if e.index else set()
            if e.mask is not None:
                syms |= e.mask.free_symbols
            if XC in syms:
                return False
    return True


def _online_plans(kernel: Kernel, bodies) -> dict:
    """Sum members of ``kernel`` of the form ``sum(exp(A - T(M)))`` (float
    converts around the exp allowed) with M a float max member of the kernel,
    T(M) a row value and A free of M: sum name -> ``_Online``."""
    # T(M) may read reductions only: those of earlier phases are final when the
    # loop ends, where a row member may be written after it (write_ready_row_values).
    members = {m.name: m for m in kernel.members if m.role == "reduction"}
    maxes = {m.name for m in kernel.members
             if m.role == "reduction" and m.node.op == "max" and is_float(m.body.dtype)}
    plans = {}
    if not maxes:
        return plans
    for m in kernel.members:
        if m.role != "reduction" or m.node.op != "sum" or not is_float(m.body.dtype):
            continue
        e = bodies[m.name]
        while (isinstance(e, ir.Op) and e.op == "convert_element_type" and is_float(e.dtype)
               and is_float(e.args[0].dtype)):
            e = e.args[0]
        if not (isinstance(e, ir.Op) and e.op == "exp" and isinstance(e.args[0], ir.Op) and e.args[0].op == "sub"):
            continue
        a, t = e.args[0].args
        if not (is_float(a.dtype) and is_float(t.dtype)):
            continue
        t_reads = {ld.buffer for ld in ir.loads(t)}
        found = t_reads & maxes
        if len(found) != 1 or not t_reads <= set(members) or not _row_only(t):
            continue
        (mx,) = found
        if any(ld.buffer == mx for ld in ir.loads(a)):
            continue
        plans[m.name] = _Online(mx, a, t)
    return plans


def _online_phases(kernel: Kernel, plans: dict):
    """``_phases`` with each planned sum in its max's phase (same loop) where
    everything else it reads is final by then; returns (phase, plans kept)."""
    names = {m.name for m in kernel.members}
    phase, kept = {}, {}
    for m in kernel.members:
        deps = [ld.buffer for ld in ir.loads(m.body) if ld.buffer in names]
        plan = plans.get(m.name)
        if plan is not None:
            other = max((phase[d] + (1 if _is_reduction(kernel, d) else 0) for d in deps if d != plan.max),
                        default=0)
            if other <= phase[plan.max]:
                phase[m.name] = phase[plan.max]
                kept[m.name] = plan
                continue
        phase[m.name] = max((phase[d] + (1 if _is_reduction(kernel, d) else 0) for d in deps), default=0)
    return phase, kept


def _online_acc_dtype(e: ir.Expr):
    return np.dtype(np.float32) if np.dtype(e.dtype).itemsize < 4 else np.dtype(e.dtype)


def _online_init(em, name: str, a: ir.Expr) -> list[str]:
    w = em.w
    acc = dtype_source(_online_acc_dtype(a))
    w.line(f"{name}_m = jnp.full((BLOCK_R, 1), float('-inf'), {acc})")
    w.line(f"{name}_s = jnp.zeros((BLOCK_R, BLOCK_C), {acc})")
    w.line(f"{name}_f = jnp.zeros((BLOCK_R, BLOCK_C), jnp.int32)")
    return [f"{name}_m", f"{name}_s", f"{name}_f"]


def _online_step(em, name: str, shifted: ir.Expr) -> list[str]:
    """One chunk of the online sum of exp(A) inside the loop; returns the new carry values."""
    w = em.w
    full = frozenset("rc")
    var, ext = em.value(shifted)
    acc_dt = _online_acc_dtype(shifted)
    if _is_16bit_float(shifted.dtype):
        var = em._widen(var, ext)
    elif np.dtype(shifted.dtype) != acc_dt:
        var = em.bind(("cast", var, acc_dt), f"{var}.astype({dtype_source(acc_dt)})", ext)[0]
    a = em.broadcast(var, ext, full)
    n = f"{name}_{em.counter}"
    em.counter += 1
    w.line(f"{n}x = jnp.where(cmask, {a}, float('-inf'))")
    w.line(f"{n}fin = lax.is_finite({n}x)")
    w.line(f"{n}c = jnp.where({n}fin, {n}x, float('-inf'))  # finite values only")
    w.line(f"{n}bits = jnp.where({n}fin, 0, jnp.where(cmask, jnp.where({n}x != {n}x, 1, "
           f"jnp.where({n}x > 0, 2, 4)), 0)).astype(jnp.int32)")
    w.line(f"{n}m = jnp.maximum({name}_m, jnp.max({n}c, axis=1, keepdims=True))")
    w.line(f"{n}z = jnp.where({n}m == float('-inf'), 0.0, {n}m).astype({n}m.dtype)  # rows with no finite value yet")
    w.line(f"{n}s = {name}_s * lax.exp({name}_m - {n}z) + lax.exp({n}c - {n}z)")
    return [f"{n}m", f"{n}s", f"lax.bitwise_or({name}_f, {n}bits)"]


def _online_flags(em, name: str) -> None:
    """After the loop: does each row hold a NaN, a +inf, a -inf (any lane's bits)?"""
    for bit, flag in ((1, "nan"), (2, "pinf"), (4, "ninf")):
        em.w.line(f"{name}_{flag} = jnp.max(lax.bitwise_and({name}_f, {bit}), axis=1, keepdims=True) > 0")


def _online_max(em, name: str, mx: Member) -> None:
    """A float max over exactly A: NaN if A holds one, else +inf if it holds one,
    else the running max of its finite values (-inf if none)."""
    text = (f"jnp.where({name}_nan, float('nan'), jnp.where({name}_pinf, float('inf'), {name}_m))"
            f".astype({dtype_source(mx.node.dtype)})")
    em.row_values[mx.name] = em.bind(("reduce", mx.name), text, frozenset("r"), "red")[0]


def _online_sum(em, name: str, m: Member, plan: _Online) -> None:
    """After the loop (the max final): S = sum(exp(A - T(M))) from the accumulators."""
    acc = dtype_source(_online_acc_dtype(plan.shifted))
    tvar, text_ = em.value(plan.shift)
    if _is_16bit_float(plan.shift.dtype):
        tvar = em._widen(tvar, text_)
    t = em.bind(("cast", tvar, acc), f"{tvar}.astype({acc})", text_)[0]
    t = em.broadcast(t, text_, frozenset("r"))
    fast = em.bind(("online_fast", name, t), f"jnp.where({name}_m == float('-inf'), 0.0, "
                   f"jnp.sum({name}_s, axis=1, keepdims=True) * lax.exp({name}_m - {t}))", frozenset("r"))[0]
    text = (f"jnp.where({name}_nan | ({t} != {t}), float('nan'), "
            f"jnp.where({t} == float('inf'), jnp.where({name}_pinf, float('nan'), 0.0), "
            f"jnp.where({t} == float('-inf'), jnp.where({name}_ninf, float('nan'), float('inf')), "
            f"jnp.where({name}_pinf, float('inf'), {fast})))).astype({dtype_source(m.node.dtype)})")
    em.row_values[m.name] = em.bind(("reduce", m.name), text, frozenset("r"), "red")[0]


def _arg_combine(em, name, v, op, acc_dt, idx_dt) -> list[str]:
    """Inside a looped argmax/argmin: each lane keeps its best value so far and
    that value's index, as jax picks: the first NaN, else the first of equal
    values (-0.0 and 0.0 are equal). A lane sees its columns in increasing
    order, so a later value replaces the kept one only if strictly better; in
    the first chunk every lane takes its value."""
    w = em.w
    better = ">" if op == "argmax" else "<"
    pick = f"({v} {better} {name}) | (chunk == 0)"
    if is_float(acc_dt):
        pick += f" | (({v} != {v}) & ({name} == {name}))"
    n = em.counter
    em.counter += 1
    w.line(f"pick{n} = {pick}")
    return [f"jnp.where(pick{n}, {v}, {name})",
            f"jnp.where(pick{n}, jnp.broadcast_to(xc, (BLOCK_R, BLOCK_C)).astype({dtype_source(idx_dt)}), {name}_i)"]


def _arg_finish(em, name, op, acc_dt, idx_dt) -> str:
    """Across the lanes of a looped argmax/argmin: the smallest index among the
    lanes holding the best value (a NaN if any lane holds one). Written without
    reductions that must propagate NaN."""
    w = em.w
    big = np.iinfo(np.dtype(idx_dt)).max
    fn = "jnp.max" if op == "argmax" else "jnp.min"
    if is_float(acc_dt):
        ident = _reduction_identity(op, acc_dt)
        w.line(f"{name}_nan = {name} != {name}")
        w.line(f"{name}_best = {fn}(jnp.where({name}_nan, {ident}, {name}), axis=1, keepdims=True)")
        w.line(f"{name}_anynan = jnp.max({name}_nan.astype(jnp.int32), axis=1, keepdims=True) > 0")
        w.line(f"{name}_hit = jnp.where({name}_anynan, {name}_nan, {name} == {name}_best)")
    else:
        w.line(f"{name}_hit = {name} == {fn}({name}, axis=1, keepdims=True)")
    return f"jnp.min(jnp.where({name}_hit, {name}_i, {big}), axis=1, keepdims=True).astype({dtype_source(idx_dt)})"


def _write_kernel_function(w: SourceWriter, name: str, kernel: Kernel, schedule: Schedule, cfg, em, body: str):
    """``def name(dims_ptr?, inputs..., outputs...)``: the dim reads, extents and block
    constants, then ``body``. Returns (input refs, output refs, dims read)."""
    ins, outs = list(em.in_refs.values()), list(em.out_refs.values())
    extents = f"ROWS, COLS = {sizes.to_source(kernel.rows)}, {sizes.to_source(kernel.cols)}"
    dims = used_dims(schedule, extents + "\n" + body)
    w.line(f"def {name}({', '.join((['dims_ptr'] if dims else []) + ins + outs)}):")
    with w.indent():
        write_dim_reads(w, schedule, dims)
        w.line(extents)
        w.line(f"BLOCK_R, BLOCK_C = {cfg.block_rows}, {cfg.block_cols}")
        w.line(f"IDX = {em.index_dtype}")
    w.lines.append(body.rstrip("\n"))
    w.line()
    return ins, outs, dims


def _wrap_kernel(kernel: Kernel, schedule: Schedule, cfg, em: _KernelEmitter, body: str) -> RenderedKernel:
    w = SourceWriter()
    w.line(f"# kernel {kernel.name}: {kernel.kind}, {kernel.rows} x {kernel.cols}, "
           f"block {cfg.block_rows} x {cfg.block_cols}, {'persistent' if cfg.persistent else 'looped'}")
    w.line("# from:")
    for eq in kernel.origin:
        w.line(f"#   {eq}")
    ins, outs, dims = _write_kernel_function(w, f"{kernel.name}_kernel", kernel, schedule, cfg, em, body)
    if kernel.kind == "mix":  # a persistent grid: its program count is a number even over dynamic rows
        grid = kernel.programs * (1 if _whole_rows(kernel) else -(-kernel.cols // cfg.block_cols))
    elif sizes.is_symbolic((kernel.rows, kernel.cols)):
        if kernel.kind == "pointwise":
            grid = f"{_grid_cdiv(kernel.rows, cfg.block_rows)} * {_grid_cdiv(kernel.cols, cfg.block_cols)}"
        else:
            grid = _grid_cdiv(kernel.rows, cfg.block_rows)
    elif kernel.kind == "pointwise":
        grid = (-(-kernel.rows // cfg.block_rows)) * (-(-kernel.cols // cfg.block_cols))
    else:
        grid = -(-kernel.rows // cfg.block_rows)
    write_launcher(w, kernel, len(ins), grid, cfg.num_warps, cfg.num_stages, dims=dims)
    return RenderedKernel(kernel.name, w.source(), list(kernel.origin), cfg, dims, em.guards)


def used_dims(schedule: Schedule, text: str) -> list[str]:
    """The program's dim symbols that ``text`` (kernel source) names."""
    return [d for d in program_dims(schedule) if re.search(rf"(?<![\w.]){re.escape(d)}\b", text)]


def write_dim_reads(w: SourceWriter, schedule: Schedule, dims: list[str]):
    """``n = dims_ptr[i]`` for each dim symbol a kernel reads: ``dims_ptr``
    is the program's int32 array of all its dim values, in ``program_dims``
    order ([Note: symbolic dims])."""
    order = program_dims(schedule)
    for d in dims:  # dynamic sizes: runtime scalars, so the kernel serves every size
        w.line(f"{d} = dims_ptr[{order.index(d)}]")


def write_launcher(w: SourceWriter, kernel: Kernel, n_inputs: int, grid, num_warps: int, num_stages: int,
                   dims: list[str] = ()):
    """``def <kernel>(in0, ...)``: the ``pallas_call`` of ``<kernel>_kernel`` on
    flat refs in ``pl.ANY`` memory, one flat output per stored member.
    ``dims``: the dim symbols the kernel reads ([Note: symbolic dims]); the
    launcher then takes the program's dims array first (the values the kernel
    reads at run time) and the symbols as keyword ints: the sizes its outputs
    and grid (``grid`` is then source) are built for while jax.jit traces the
    wrapper, the concrete sizes."""
    out_shapes = [f"jax.ShapeDtypeStruct(({sizes.to_source(m.node.numel)},), {dtype_source(m.node.dtype)})"
                  for m in kernel.members if m.store]
    args = [f"in{i}" for i in range(n_inputs)]
    operands = [a + ".reshape(-1)" for a in args]
    if dims:
        args = ["dims"] + args
        operands = ["dims"] + operands
    w.line(f"def {kernel.name}({', '.join(args + (['*'] + list(dims) if dims else []))}):")
    with w.indent():
        w.line("return pl.pallas_call(")
        with w.indent():
            w.line(f"{kernel.name}_kernel,")
            w.line(f"out_shape=({', '.join(out_shapes)},),")
            w.line(f"grid=({grid},),")
            w.line(f"in_specs=[{', '.join(['ANY'] * len(operands))}],")
            w.line(f"out_specs=({', '.join(['ANY'] * len(out_shapes))},),")
            w.line("interpret=INTERPRET,")
            w.line(f"name={kernel.name!r},")
            w.line(f"compiler_params=plt.CompilerParams(num_warps={num_warps}, num_stages={num_stages}),")
        w.line(f")({', '.join(operands)})")


# --------------------------------------------------------------------------- #
# The whole program
# --------------------------------------------------------------------------- #
def _shape_source(shape) -> str:
    if not sizes.is_symbolic(tuple(shape)):
        return str(tuple(int(d) for d in shape))
    parts = [sizes.to_source(d) for d in shape]
    return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"


def _dim_source(graph, dim: str) -> tuple[str, int]:
    """An input and axis whose size is the dim symbol ``dim``."""
    for name in graph.inputs:
        for axis, d in enumerate(graph.buffer_aval(name)[0]):
            if isinstance(d, sympy.Symbol) and d.name == dim:
                return name, axis
    raise SymbolicUnsupported(f"no input has the dynamic size {dim} as a whole dimension")
