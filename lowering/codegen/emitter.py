"""The kernel emitter shared by both dialects: it walks a kernel's IR and
writes each value as source, leaving the spelling (dtype text, full / cast /
broadcast / iota text, loads and stores, op templates, reductions and loops)
to a dialect subclass: ``pallas.PallasEmitter`` and ``triton.TritonEmitter``.
Beside it, the helpers every kernel writer shares (kernel coordinates, phases,
pointwise bodies, the rendered-kernel records).

[Note: kernel shape]
Every kernel works on a 2-D tile of ``BLOCK_R x BLOCK_C`` over kernel
coordinates ``xr`` (rows) and ``xc`` (columns). Buffers are passed as flat 1-D
refs (pointers in Triton) and read with gather-style loads at computed offsets,
masked at the edges, so no array inside a kernel needs a power-of-two extent.
Each value in a kernel is one of (1, 1), (BLOCK_R, 1), (1, BLOCK_C)
or (BLOCK_R, BLOCK_C); operands are broadcast to a common shape before an op.
A reduction kernel reduces along columns, either in one tile (persistent) or
in a loop over column chunks, one loop per phase when a reduction depends on
an earlier one (e.g. variance after mean): codegen/rows.py.
"""
from __future__ import annotations

import dataclasses
import functools
import re

import jax.numpy as jnp
import numpy as np
import sympy

from lowering import heuristics, ir, sizes
from lowering.codegen.writer import SourceWriter
from lowering.errors import SymbolicUnsupported
from lowering.options import CompileOptions
from lowering.scheduler import XC, XR, Kernel, Member, Schedule
from lowering.symbolic import program_dims

UPCAST_16BIT = frozenset({
    "add", "sub", "mul", "div", "rem", "pow", "integer_pow", "square", "atan2",
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh",
    "floor", "ceil", "eq", "ne", "lt", "le", "gt", "ge", "max", "min", "clamp", "sign", "abs", "neg",
    "erf", "erfc", "erf_inv",  # XLA feeds them a 16-bit chain's unrounded float32 too
})

# Binary ops whose operands commute (IEEE add and mul do): written once either way round.
COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or", "xor", "eq", "ne"})

# Ops whose result jumps with the last bit of an operand: they see the 16-bit
# value jax.jit would, not the unrounded float32 it came from.
ROUNDING_SENSITIVE = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "floor", "ceil", "sign", "max", "min", "clamp"})


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
    gluon: bool = False  # that raw Triton is a Gluon kernel ([Note: staged rows] in codegen/rows.py)
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


def is_16bit_float(dt) -> bool:
    return is_float(dt) and np.dtype(dt).itemsize == 2


def is_float(dt) -> bool:
    return _is_float(np.dtype(dt))


@functools.lru_cache(maxsize=None)  # asked of every op of every kernel; jnp.issubdtype is slow
def _is_float(dt: np.dtype) -> bool:
    return bool(jnp.issubdtype(dt, jnp.floating))


def const_source(value, dt) -> str:
    dt = np.dtype(dt)
    if dt == np.bool_:
        return repr(bool(value))
    if jnp.issubdtype(dt, jnp.complexfloating):  # literals of XLA externs (kernels take no complex values)
        v = complex(value)
        return f"complex({const_source(v.real, np.float64)}, {const_source(v.imag, np.float64)})"
    if is_float(dt):
        v = float(value)
        if np.isnan(v):  # the sign kept (copysign, signbit and bitcasts read it), as jax.jit keeps the literal's
            return "-float('nan')" if np.signbit(v) else "float('nan')"
        if np.isinf(v):
            return "float('inf')" if v > 0 else "float('-inf')"
        return repr(v)
    return repr(int(value))


def reduction_identity(op: str, dt) -> str:
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


def acc_dtype(op, dt):
    dt = np.dtype(dt)
    if op in ("and", "or") or dt == np.bool_:
        return np.dtype(np.int32)
    if is_float(dt) and dt.itemsize < 4:
        return np.dtype(np.float32)
    return dt


def is_one_hot(p) -> bool:
    """``p`` is ``eq(iota, v)`` at the product's own shape, as jax.nn.one_hot writes it.
    XLA rewrites only where the convert of the predicate feeds the multiply
    directly: a predicate computed at a smaller shape and broadcast (``x * (l == 1)``)
    keeps its multiply, so only this, the common pattern, is rewritten."""
    return (isinstance(p, ir.Op) and p.op == "eq" and np.dtype(p.dtype) == np.bool_
            and any(isinstance(a, ir.IndexValue) for a in p.args))


def mul_by_converted_bool(e, interpret: bool):
    """``convert(pred) * x`` (a one-hot times values) as ``select(pred, x, 0)``, as
    XLA's algebraic simplifier rewrites it: the one-hot's zeros then hide x's
    NaN and infinities instead of making NaN of them (0 * inf). XLA:CPU computes
    bfloat16 in float32 and the rewrite does not see through that (jax.jit there
    gives NaN for bf16), XLA:GPU multiplies them natively and rewrites; float16 is
    native on both and rewritten: in interpret mode bfloat16 products are left as
    written. None otherwise."""
    if not (isinstance(e, ir.Op) and e.op == "mul" and ir.rewrites_mask_products(e.dtype, interpret)):
        return None
    for i, a in enumerate(e.args):
        if (isinstance(a, ir.Op) and a.op == "convert_element_type" and is_one_hot(a.args[0])
                and np.dtype(e.args[1 - i].dtype) == np.dtype(e.dtype)):
            return ir.mask_select(a.args[0], e.args[1 - i])
    return None


def select_n_template(cases: int, where: str) -> str:
    """``select_n`` over an int32 index or more than two cases as nested
    two-way selects (``where``: the dialect's select function): Pallas' Triton
    lowering takes a bool and two cases only."""
    text = "{%d}" % cases
    for k in range(cases - 2, -1, -1):
        text = f"{where}({{0}} == {k}, {{{k + 1}}}, {text})"
    return text


class KernelEmitter:
    """Writes a kernel's values as source lines into ``w``: each IR expression
    (indices in kernel coordinates) once per scope (CSE), operands broadcast to a
    common extent, 16-bit float ops computed in float32, loads and stores masked
    at the tile's edges. How each value is spelled is the dialect's: a subclass
    overrides the hooks below (``pallas.PallasEmitter``, ``triton.TritonEmitter``)."""

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
        self.index_dtype = self.index_type(self.needs_int64())

    def index_type(self, wide: bool) -> str:
        """The index dtype's text: int64 where ``wide``, else int32."""
        raise NotImplementedError

    def needs_int64(self):
        extents = [self.k.rows * self.k.cols] + [sizes.numel(self.graph.buffer_aval(b)[0]) for b in self.k.reads]
        symbolic = [e for e in extents if sizes.is_symbolic(e)]
        big = max(sizes.hint(e, self.hints) for e in extents)
        if big >= INT32_LIMIT:
            return True
        # int32 indices at the hint: a size whose extents reach 2**31 breaks the
        # guard, and that call's signature compiles for its own size.
        self.guards += [sympy.Lt(sizes.simplify(e), INT32_LIMIT) for e in symbolic]
        return False

    # -- the dialect: how values are written (PallasEmitter and TritonEmitter spell these) --
    HELPERS: dict = {}  # helper name -> source; a template calling ``name(`` adds it to ``helpers``
    MINIMUM = ""  # the element-wise minimum function
    # Plain element-wise functions the shared writers call (``fn``): exp, is_finite, and, or.
    FUNCTIONS: dict = {}

    def dtype_text(self, dt) -> str:
        raise NotImplementedError

    def full_text(self, value: str, dtype: str | None = None) -> str:
        """A (1, 1) value."""
        raise NotImplementedError

    def tile_text(self, shape: str, value: str, dtype: str) -> str:
        """A value of ``shape`` (source) filled with ``value``."""
        raise NotImplementedError

    def zeros_text(self, shape: str, dtype: str) -> str:
        raise NotImplementedError

    def cast_text(self, var: str, dt) -> str:
        raise NotImplementedError

    def broadcast_text(self, var: str, shape: str) -> str:
        raise NotImplementedError

    def where_text(self, cond: str, a: str, b: str) -> str:
        raise NotImplementedError

    def maximum_text(self, a: str, b: str) -> str:
        """The element-wise maximum of values holding no NaN."""
        raise NotImplementedError

    def fn(self, name: str, *args: str) -> str:
        return self.FUNCTIONS[name].format(*args)

    def iota_text(self, axis: int, block: str) -> str:
        """Indices 0..block-1 as a (block, 1) column (axis 0) or (1, block) row (axis 1)."""
        raise NotImplementedError

    def pid_line(self) -> str:
        """``pid = ``: the program id, in the index dtype where the dialect needs it."""
        raise NotImplementedError

    def op_template(self, e, names) -> str:
        raise NotImplementedError

    def load_text(self, ref: str, off: str, mask_arg: str) -> str:
        raise NotImplementedError

    def store_text(self, ref: str, off: str, val: str, mask_arg: str) -> str:
        raise NotImplementedError

    def masked_store_offset(self, off: str, mask: str, numel, extent) -> str:
        """The offset a masked store writes at (the dialect may move masked-off lanes)."""
        return off

    def plain_reduce_text(self, fn: str, var: str, axis: int) -> str:
        """``var`` reduced along ``axis`` (kept) by ``fn`` ('sum', 'max', 'min'),
        values holding no NaN (no NaN-propagating combine needed)."""
        raise NotImplementedError

    def reduce_text(self, op: str, var: str, acc_dt, axis: int, index: str = "xc") -> str:
        """A reduction member's ``op`` of ``var`` along ``axis`` (kept), NaN as XLA
        propagates it; argmax / argmin along axis 1, ``index`` each lane's column."""
        raise NotImplementedError

    def combine_text(self, op: str, acc: str, v: str, acc_dt) -> str:
        """One element-wise combine step of a looped reduction (NaN-propagating for floats)."""
        raise NotImplementedError

    def arg_index_dtype(self, node_dtype):
        """The dtype a looped argmax / argmin's index accumulator carries."""
        raise NotImplementedError

    def arg_finish(self, name: str, op: str, acc_dt, idx_dt) -> str:
        """Across the lanes of a looped argmax / argmin (``name``, its indices
        ``name_i``): the row's index (may write lines first)."""
        raise NotImplementedError

    def column_acc_dtype(self, dt):
        """The dtype a mix kernel's column accumulator of a ``dt`` member carries:
        int32 for bools (as ``acc_dtype``: a bool tile cannot hold min/max's identity)."""
        return np.dtype(np.int32) if np.dtype(dt) == np.bool_ else np.dtype(dt)

    def prefetch_depth(self, cfg) -> int:
        """Row blocks a mix kernel's loop loads ahead through its carry (0: none)."""
        return 0

    def write_row_loads(self, loads: list) -> list:
        """``def load_rows(block)`` (``prefetch_depth``): returns each load with its extent."""
        raise NotImplementedError

    # Skip the select of a masked sum whose operand is already 0 past the edge
    # (rows.zero_where_masked)? The raw-Triton dialect does.
    SKIP_ZERO_SELECT = False
    # Write many persistent reductions inside an always-true ``if`` (rows.py,
    # [Note: reductions in a region])? The raw-Triton dialect does.
    REDUCTION_REGION = False
    # Read and write looped one-row reductions' rows from a vector-aligned base
    # (rows.py, [Note: aligned row windows])? The raw-Triton dialect does.
    ALIGNED_ROWS = False
    STAGED_ROWS = False  # the dialect stages a window's rows in shared memory ([Note: staged rows])
    window = None  # the rows.RowWindow of the row loops being written, if any

    def window_setup(self, row_block: str) -> None:
        """Before the first row loop: the row's aligned base (``self.window``'s)."""
        raise NotImplementedError

    def window_columns(self) -> None:
        """At the top of a row loop's body: ``xc`` and ``cmask`` of the window's chunk."""
        raise NotImplementedError

    def window_stage(self) -> None:
        """After ``window_setup``: copy the window's staged buffers into shared memory."""
        raise NotImplementedError

    def window_load(self, ld: ir.Load) -> tuple[str, frozenset]:
        raise NotImplementedError

    def window_store(self, m: Member, var: str, extent) -> None:
        raise NotImplementedError

    def windowed(self, ld: ir.Load) -> bool:
        """Is ``ld`` read through the row window ([Note: aligned row windows])?
        Its lanes outside the row then hold the neighbouring rows' values, not 0."""
        return (self.window is not None and ld.mask is None and ld.buffer in self.in_refs
                and self.offset(ld.buffer, ld.index) == self.window.offset)

    def loop(self, name: str, index: str, start, stop, carried: list[str], body, stages: int | None = None,
             comment: str = "") -> None:
        """A loop of ``index`` over [start, stop) whose body ``body()`` writes
        its lines and returns the new values of ``carried`` (names bound
        before the loop, bound again after it; a new value reads no carried name
        but its own, since a dialect may rebind them one by one). ``name``: the body function's
        name where the dialect writes one; ``stages``: software-pipelining depth
        where the dialect has it."""
        raise NotImplementedError

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
        direct, ext = self.with_indirect_values(expr)
        return self.bind(("index", expr), sizes.to_source(direct), ext, "idx")

    def with_indirect_values(self, expr):
        """(``expr`` with each run-time index value emitted and its variable in its
        place, the extent of the result): indices and load masks (a padded
        operand read at a gathered position) alike."""
        swap, ext = {}, frozenset()
        for app in ir.indirect_atoms((expr,)):
            var, vext = self.value(ir.indirect_value(app))
            var = self.bind(("idxcast", var), self.cast_text(var, self.index_dtype_np), vext)[0]
            swap[app] = sympy.Symbol(var, integer=True)
            ext = ext | vext
        direct = expr.xreplace(swap)
        return direct, ext | self.extent_of(direct)  # a (1, 1) value's variable is an array: the text is one too

    @property
    def index_dtype_np(self):
        return np.dtype(np.int64) if self.index_dtype.endswith("int64") else np.dtype(np.int32)

    def condition(self, cond) -> tuple[str, frozenset]:
        if cond.has(ir.IndirectIndex):
            found = self.lookup(("cond", cond))
            if found is not None:
                return found
            direct, ext = self.with_indirect_values(cond)
            return self.bind(("cond", cond), sizes.to_source(direct), ext, "mask")
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
            return self.load(e)
        # Op
        masked = mul_by_converted_bool(e, self.interpret)
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
        if e.op in UPCAST_16BIT and any(is_16bit_float(a.dtype) for a in e.args):
            # Computed in float32. An operand that is itself a rounded float32
            # result is used unrounded (XLA's allow_excess_precision does the
            # same): chains of 16-bit ops round once, at the store.
            exact = e.op in ROUNDING_SENSITIVE or not self.excess_precision
            names = [self.widen(n, extent, exact) if is_16bit_float(a.dtype) else n for n, a in zip(names, e.args)]
            wide = dataclasses.replace(e, dtype=np.dtype(np.float32) if is_16bit_float(e.dtype) else e.dtype)
            var, ext = self._op(wide, names, extent)
            if not is_16bit_float(e.dtype):
                return var, ext
            narrow = self.bind(("narrow", var, e.dtype), self.cast_text(var, e.dtype), ext)
            if np.dtype(e.dtype).name == "bfloat16":
                # XLA keeps bf16 chains in float32 (allow_excess_precision); float16 is a type its
                # backends compute in, rounding every op (jax.jit's x * x / x of 300 is inf), so a
                # float16 result is read back rounded, as the matmul template's is.
                self.wide_of[narrow[0]] = var
            return narrow
        return self._op(e, names, extent)

    def identity_operand(self, op: str, dt) -> str:
        """The identity of reduction ``op`` over ``dt`` as a select's operand: its
        literal, or a typed (1, 1) value where the literal is an integer past int32
        (uint32's maximum, a min's identity), which jnp reads as a weak int32 and
        refuses."""
        ident = reduction_identity(op, dt)
        if is_float(dt) or -2**31 <= int(ident) < 2**31:
            return ident
        return self.bind(("ident", op, np.dtype(dt)), self.full_text(ident, self.dtype_text(dt)), frozenset(), "cst")[0]

    def widen(self, var, extent, exact=False) -> str:
        if var in self.wide_of and not exact:
            return self.wide_of[var]
        return self.bind(("f32", var), self.cast_text(var, np.float32), extent)[0]

    def _op(self, e, names, extent):
        params = {k: (self.dtype_text(v) if isinstance(v, np.dtype) else v) for k, v in e.params}
        template = self.op_template(e, names)
        for h in self.HELPERS:
            if h + "(" in template:
                self.helpers.add(h)
        text = template.format(*names, args=", ".join(names), **params)
        key = tuple(sorted(names)) if e.op in COMMUTATIVE else tuple(names)  # x * c and c * x: one value
        return self.bind(("op", e.op, key, e.params), text, extent)

    def load(self, ld: ir.Load):
        if ld.buffer in self.row_values:
            return self.row_values[ld.buffer], frozenset("r")
        if ld.buffer in self.forwarded:  # a pointwise member's value, read at its own point
            return self.forwarded[ld.buffer]
        if ld in self.prefetched:
            return self.prefetched[ld]
        if self.windowed(ld):
            return self.window_load(ld)
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

    def store_offset(self, m: Member) -> sympy.Expr:
        """The flat offset a member's store writes at, in kernel coordinates."""
        return self.offset(m.name, tuple(sizes.simplify(m.coords.get(s, s)) for s in m.node.symbols))

    def store(self, m: Member, var: str, extent):
        if self.window is not None and self.store_offset(m) == self.window.offset:
            return self.window_store(m, var, extent)
        off, off_ext = self.index(self.store_offset(m))
        full = off_ext | extent
        off = self.broadcast(off, off_ext, full)
        val = self.broadcast(var, extent, full)
        edge = self.edge_mask(full)
        mask = ""
        if edge:
            mask_var = self.broadcast(edge[0], edge[1], full)
            mask = f", mask={mask_var}"
            off = self.masked_store_offset(off, mask_var, m.node.numel, full)
        self.w.line(self.store_text(self.out_refs[m.name], off, self.cast_text(val, m.node.dtype), mask))


def kernel_coords_body(m: Member) -> ir.Expr:
    # Kept on the member: the tile choice and the writer ask for it again, and a combo's
    # thousand bodies push each other out of substitute_index's cache.
    coords = tuple(m.coords.items())
    hit = m.__dict__.get("_coords_body")
    if hit is not None and hit[0] is m.body and hit[1] == coords:
        return hit[2]
    out = ir.substitute_index(m.body, {s: sizes.simplify(v) for s, v in coords})
    m.__dict__["_coords_body"] = (m.body, coords, out)
    return out


def phases(kernel: Kernel):
    """Phase of each member: a reduction runs in the loop after every in-kernel
    row value it reads is final; row-wise stores and row values likewise."""
    names = {m.name for m in kernel.members}
    phase = {}
    for m in kernel.members:  # members are in topological order
        deps = [ld.buffer for ld in ir.loads(m.body) if ld.buffer in names]
        after = max((phase[d] + (1 if is_reduction(kernel, d) else 0) for d in deps), default=0)
        phase[m.name] = after
    return phase


def is_reduction(kernel, name):
    return any(m.name == name and m.role == "reduction" for m in kernel.members)


def cdiv_source(n, block: int, name: str, block_name: str) -> str:
    """Source of ceil(n / block): a number for a static ``n``, else an
    expression over the kernel's ``name`` / ``block_name`` constants."""
    if not sizes.is_symbolic(n):
        return str(-(-int(n) // block))
    return f"({name} + {block_name} - 1) // {block_name}"


def write_pointwise(em, kernel: Kernel, bodies, cfg, runtime_extents: bool = False) -> None:
    """A pointwise kernel's body after ``pid``: its tile of rows x columns, every
    member's value, the stores (both renderers, ``em``'s dialect).
    ``runtime_extents``: ``ROWS`` / ``COLS`` are values known only at run time
    (a shared combo part's parameters), never written into the body."""
    w = em.w
    cols = sizes.dim_symbol("COLS") if runtime_extents else kernel.cols
    w.line(f"col_blocks = {cdiv_source(cols, cfg.block_cols, 'COLS', 'BLOCK_C')}")
    w.line(f"xr = (pid // col_blocks) * BLOCK_R + {em.iota_text(0, 'BLOCK_R')}")
    w.line(f"xc = (pid % col_blocks) * BLOCK_C + {em.iota_text(1, 'BLOCK_C')}")
    w.line("rmask = xr < ROWS")
    w.line("cmask = xc < COLS")
    for m in kernel.members:  # in graph order: a member a later one reads comes first
        var, ext = em.value(bodies[m.name])
        em.forwarded[m.name] = var, ext
        if m.store:
            em.store(m, var, ext)


def write_ready_row_values(em, kernel: Kernel, bodies, only=None) -> None:
    """Row values (epilogues) whose inputs are final after the phase just
    written, each kept as a (BLOCK_R, 1) value and stored if it is stored;
    ``only``: just those named (what the next phase's members read) and the
    row values they read in turn (Adam's ``1 - b1 ** count`` of the new count,
    both kept in the kernel)."""
    if only is not None:
        only = set(only)
        for m in reversed(kernel.members):  # topological order: readers before what they read
            if m.name in only and m.role == "row":
                only.update(ld.buffer for ld in ir.loads(m.body))
    for m in kernel.members:
        if only is not None and m.name not in only:
            continue
        if m.role == "row" and m.name not in em.row_values and row_ready(m, em, kernel):
            var, ext = em.value(bodies[m.name])
            var = em.broadcast(var, ext, frozenset("r"))
            em.row_values[m.name] = var
            if m.store:
                em.store(m, var, frozenset("r"))


def store_reductions(em, kernel: Kernel) -> None:
    for m in kernel.members:
        if m.role == "reduction" and m.store:
            em.store(m, em.row_values[m.name], frozenset("r"))


def whole_rows(kernel: Kernel) -> bool:
    """Does a mix kernel need whole rows in a tile (it reduces rows)?"""
    return any(m.role in ("reduction", "row") for m in kernel.members)


def columns(kernel: Kernel) -> int:
    """Column reductions a mix kernel accumulates."""
    return sum(m.role == "column" for m in kernel.members)


def row_ready(m, em, kernel):
    names = {x.name for x in kernel.members}
    return all(ld.buffer in em.row_values for ld in ir.loads(m.body) if ld.buffer in names)


def used_dims(schedule: Schedule, text: str) -> list[str]:
    """The program's dim symbols that ``text`` (kernel source) names."""
    return [d for d in program_dims(schedule) if re.search(rf"(?<![\w.]){re.escape(d)}\b", text)]


def shape_source(shape) -> str:
    if not sizes.is_symbolic(tuple(shape)):
        return str(tuple(int(d) for d in shape))
    parts = [sizes.to_source(d) for d in shape]
    return f"({', '.join(parts)}{',' if len(parts) == 1 else ''})"


def dim_source(graph, dim: str) -> tuple[str, int]:
    """An input and axis whose size is the dim symbol ``dim``."""
    for name in graph.inputs:
        for axis, d in enumerate(graph.buffer_aval(name)[0]):
            if isinstance(d, sympy.Symbol) and d.name == dim:
                return name, axis
    raise SymbolicUnsupported(f"no input has the dynamic size {dim} as a whole dimension")
