"""The loop-level IR.

[Note: pallaskit IR]
A ``Graph`` is a list of ``Node``s in topological order plus its inputs and
outputs. A node computes one buffer:

* ``Pointwise``: ``value[i0..in] = body`` over the node's shape.
* ``Reduction``: ``value[kept dims] = op over reduced dims of body``; the body
  is indexed by the domain's symbols ``i*`` (kept dims, in order) and ``r*``
  (reduced dims, in order).
* ``Extern``: one primitive run through XLA; its operands and results are
  materialized buffers.

A body is a small immutable expression DAG (``Load``, ``Const``, ``IndexValue``,
``Op``). Loads name a buffer and give its logical index as sympy expressions
of the node's symbols (see ``sizes``); layout is applied only when code is
rendered. Views (reshape, transpose, slices...) are ``Pointwise`` nodes whose
body is a single load, so the scheduler folds them into index expressions by
inlining.

Everything here is plain data: it prints deterministically (``Graph.format``),
which is what the golden tests and cache keys read.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import threading
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import sympy

from lowering import sizes


# --------------------------------------------------------------------------- #
# Body expressions
# --------------------------------------------------------------------------- #
class Expr:
    """Base of body expressions: immutable, hashable, with a dtype."""

    dtype: np.dtype

    def children(self) -> tuple["Expr", ...]:
        return ()


class _EqMemo(threading.local):
    pairs = None  # (id, id) of the node pairs found equal in the comparison under way


_EQ_MEMO = _EqMemo()


def _cached_hash(cls):
    """Frozen dataclasses rehash their fields on every call; bodies are DAGs
    that get hashed often, so cache it."""
    field_names = [f.name for f in dataclasses.fields(cls)]
    fields_of = operator.attrgetter(*field_names)

    def __hash__(self):
        try:
            return self._hash  # set at construction: a walk hashes every node several times
        except AttributeError:
            h = hash((cls.__name__, *fields_of(self)))
            object.__setattr__(self, "_hash", h)
            return h

    def __eq__(self, other):
        # Unequal hashes settle most comparisons without walking the operands.
        if self is other:
            return True
        if other.__class__ is not self.__class__ or hash(self) != hash(other):
            return False
        # Two equal DAGs that are distinct objects (a body and its rewritten copy)
        # compare each pair of nodes once: walked as trees, a deep body whose
        # nodes are used twice (threefry's rounds) would take exponential time.
        memo = _EQ_MEMO.pairs
        if memo is None:
            _EQ_MEMO.pairs = set()
            try:
                return all(getattr(self, n) == getattr(other, n) for n in field_names)
            finally:
                _EQ_MEMO.pairs = None
        key = (id(self), id(other))
        if key in memo:
            return True
        eq = all(getattr(self, n) == getattr(other, n) for n in field_names)
        if eq:
            memo.add(key)
        return eq

    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        __hash__(self)  # now, while the operands' hashes are known: lazily it would recurse down a deep body
        object.__setattr__(self, "_canonical", _canonical(self))

    cls.__hash__ = __hash__
    cls.__eq__ = __eq__
    cls.__init__ = __init__
    return cls


def _canonical(e) -> bool:
    """Would ``substitute_index`` with an identity mapping give ``e`` back (every
    index already in simplified form)? Known at construction, from the operands'."""
    if isinstance(e, Load):
        return all(_simplified(i) for i in e.index)
    if isinstance(e, IndexValue):
        return isinstance(e.expr, sympy.logic.boolalg.Boolean) or _simplified(e.expr)
    # A constant has no index to substitute (without it, a body holding one never took the fast path).
    return all(isinstance(a, Const) or a.__dict__.get("_canonical", False) for a in e.children())


def _simplified(i) -> bool:
    try:
        return _simplified_cached(i)
    except TypeError:  # unhashable
        return _simplified_uncached(i)


@functools.lru_cache(maxsize=1 << 16)
def _simplified_cached(i) -> bool:
    # Memoized: every load of a body is built with the same few indices.
    return _simplified_uncached(i)


def _simplified_uncached(i) -> bool:
    try:
        return sizes.simplify(sympy.sympify(i)) == i
    except (TypeError, sympy.SympifyError):
        return False


@_cached_hash
@dataclasses.dataclass(frozen=True, eq=True)
class Load(Expr):
    buffer: str
    index: tuple  # sympy expressions, one per dim of the buffer
    dtype: np.dtype
    mask: object = None  # sympy boolean: where the load is valid (pad/concat); else 0

    def children(self):
        """The values of the indirect indices in ``index`` and ``mask`` ([Note:
        indirect indexing]): walked like operands, so their loads count as reads."""
        return _indirect_children(self)

    def indexing(self) -> tuple:
        """The index and the mask: where indirect indices can be. A padded operand
        read at a gathered position keeps one in its mask alone where its index
        simplifies away (every index of a one-element operand is 0)."""
        return self.index if self.mask is None else (*self.index, self.mask)

    def __str__(self):
        idx = ", ".join(sizes.text(i) for i in self.index)
        m = f" if {sizes.text(self.mask)}" if self.mask is not None else ""
        return f"{self.buffer}[{idx}]{m}"


def _indirect_children(e) -> tuple:
    """The values of the indirect indices in ``e.indexing()`` (a Load's or an
    IndexValue's), memoized on ``e``."""
    out = e.__dict__.get("_indirect")
    if out is None:
        out = tuple(indirect_value(a) for a in indirect_atoms(e.indexing()))
        object.__setattr__(e, "_indirect", out)
    return out


def is_finite_const(e) -> bool:
    """Is ``e`` a constant of finite value?"""
    return isinstance(e, Const) and bool(np.isfinite(np.asarray(e.value, np.float64)))


def _value_key(v):
    """What tells two constant values apart: 0.0 == -0.0 in Python, yet x * -0.0
    is not x * 0.0, so floats compare by their bits (NaN then equals NaN)."""
    if isinstance(v, (float, np.floating)):
        return ("f", np.float64(v).tobytes())
    if isinstance(v, (complex, np.complexfloating)):
        return ("c", np.complex128(v).tobytes())
    return v


@dataclasses.dataclass(frozen=True, eq=False)
class Const(Expr):
    value: object  # python bool / int / float
    dtype: np.dtype

    def _key(self):
        k = self.__dict__.get("_value")  # kept: a walk compares equal constants of many bodies
        if k is None:
            k = _value_key(self.value)
            object.__setattr__(self, "_value", k)
        return k

    def __eq__(self, other):
        return type(other) is Const and self.dtype == other.dtype and self._key() == other._key()

    def __hash__(self):
        h = self.__dict__.get("_hash")  # kept: every walk of a body hashes its constants
        if h is None:
            h = hash(("Const", self._key(), self.dtype))
            object.__setattr__(self, "_hash", h)
        return h

    def __str__(self):
        return f"{self.value!r}:{self.dtype.name}"


@_cached_hash
@dataclasses.dataclass(frozen=True, eq=True)
class IndexValue(Expr):
    """An index expression used as a value (iota, pad/concat conditions)."""

    expr: object  # sympy integer or boolean expression
    dtype: np.dtype

    def children(self):
        """The values of the indirect indices in ``expr`` (an iota read at a
        gathered or dynamic position, ``arange(n)[ids]``): walked like a load's,
        so their loads count as reads."""
        return _indirect_children(self)

    def indexing(self) -> tuple:
        return (self.expr,)

    def __str__(self):
        return f"index({sizes.text(self.expr)}):{self.dtype.name}"


@_cached_hash
@dataclasses.dataclass(frozen=True, eq=True)
class Op(Expr):
    """An elementwise primitive applied to argument expressions.

    ``op`` is the jax primitive name (``add``, ``exp``, ``select_n``...);
    ``params`` are its static parameters as a sorted tuple of (name, value)."""

    op: str
    args: tuple
    dtype: np.dtype
    params: tuple = ()

    def children(self):
        return self.args

    def param(self, name, default=None):
        return dict(self.params).get(name, default)

    def __str__(self):
        p = "".join(f", {k}={v}" for k, v in self.params)
        return f"{self.op}({', '.join(str(a) for a in self.args)}{p})"


def walk(expr: Expr, indirect: bool = True) -> Sequence[Expr]:
    """Every distinct sub-expression of ``expr``, children before parents;
    ``indirect``: the values of loads' indirect indices too. Kept on the
    expressions whose loads were asked for (``_summarize``): the scheduler's
    inlining and the renderers walk those bodies again."""
    if indirect:
        kept = expr.__dict__.get("_walk")
        if kept is not None:
            return kept
    # ``ids`` settles an object met before without hashing it; ``seen`` tells
    # equal objects apart from new ones by the hash each node keeps (no Python
    # ``__hash__`` call per node), ``collided`` holds unequal nodes of one hash.
    # A list, not a generator: every caller takes most of it, and a walk is the
    # passes' innermost loop.
    ids, seen, collided, out = set(), {}, None, []
    stack = [expr]
    push, pop = stack.append, stack.pop
    while stack:
        e = pop()
        if e is None:  # the marker pushed above a node's children: they are out
            out.append(pop())
            continue
        if id(e) in ids:
            continue
        ids.add(id(e))
        h = e.__dict__.get("_hash")
        if h is None:
            h = hash(e)
        first = seen.setdefault(h, e)
        if first is not e:
            if first == e:
                continue
            if collided is None:
                collided = set()
            if e in collided:
                continue
            collided.add(e)
        push(e)
        push(None)
        kind = type(e)
        if kind is Op:
            children = e.args
        elif (kind is Load or kind is IndexValue) and not indirect:
            continue
        else:
            children = e.children()
        for c in reversed(children):
            if id(c) not in ids:
                push(c)
    return out


def loads(expr: Expr) -> tuple[Load, ...]:
    """The distinct loads of ``expr``, children first; kept on the (immutable)
    expression, since the scheduler and renderers ask for them again and again."""
    out = expr.__dict__.get("_loads")
    if out is None:
        out = _summarize(expr)[0]
    return out


def buffers(expr: Expr) -> tuple[str, ...]:
    """The buffers ``expr`` loads, sorted: a node's ``reads``, which the passes ask
    of every node several times; kept on the expression."""
    out = expr.__dict__.get("_buffers")
    if out is None:
        out = tuple(sorted({ld.buffer for ld in loads(expr)}))
        object.__setattr__(expr, "_buffers", out)
    return out


def op_counts(expr: Expr) -> tuple[tuple[str, int], ...]:
    """(op name, how many distinct ``Op`` nodes apply it) of ``expr``, in order of
    first appearance in ``walk``; kept on the expression with its loads (one walk
    for both: the scheduler weighs and names the bodies whose loads it asks for)."""
    out = expr.__dict__.get("_op_counts")
    if out is None:
        out = _summarize(expr)[1]
    return out


def _summarize(expr: Expr) -> tuple:
    nodes = tuple(walk(expr))
    object.__setattr__(expr, "_walk", nodes)
    found, counts = [], {}
    for e in nodes:
        kind = type(e)
        if kind is Op:
            counts[e.op] = counts.get(e.op, 0) + 1
        elif kind is Load:
            found.append(e)
    out = tuple(found), tuple(counts.items())
    object.__setattr__(expr, "_loads", out[0])
    object.__setattr__(expr, "_op_counts", out[1])
    return out


def rewrite(expr: Expr, fn: Callable[[Expr], Expr | None], indirect: bool = True) -> Expr:
    """Bottom-up rewrite; ``fn`` returns a replacement or None to keep the node.
    ``indirect``: ``fn`` also rewrites the values of loads' indirect indices
    (inlining a producer into them, masks), which then get new index functions."""
    memo: dict[Expr, Expr] = {}
    for e in walk(expr, indirect):
        if isinstance(e, Op):
            args = tuple(memo[a] for a in e.args)
            # identity, not ==: equality of deep bodies recurses once per level
            new = e if all(x is y for x, y in zip(args, e.args)) else Op(e.op, args, e.dtype, e.params)
        elif indirect and isinstance(e, (Load, IndexValue)) and e.children():
            new = _rewrite_indirect(e, memo)
        else:
            new = e
        out = fn(new)
        memo[e] = new if out is None else out
    return memo[expr]


def substitute_index(expr: Expr, mapping: dict) -> Expr:
    """Substitute index symbols in every load index, mask and index value.
    Memoized: the scheduler and the renderers substitute the same bodies with
    the same coordinates many times, and sympy is slow."""
    if not mapping:
        return expr
    if expr.__dict__.get("_canonical") and all(k == v for k, v in mapping.items()):
        return expr  # what the substitution would rebuild, equal (a chain of same-shape nodes inlines in linear time)
    return _substitute(expr, tuple(mapping.items()))


@functools.lru_cache(maxsize=4096)
def _substitute(expr: Expr, items: tuple) -> Expr:
    def sub(e):
        if isinstance(e, Load):
            idx = tuple(_substitute_one(i, items) for i in e.index)
            mask = None if e.mask is None else _xreplace(e.mask, items)
            if idx == e.index and mask == e.mask:
                return None
            return Load(e.buffer, idx, e.dtype, mask)
        if isinstance(e, IndexValue):
            ex = _xreplace(e.expr, items)
            return IndexValue(sizes.simplify(ex) if not isinstance(ex, sympy.logic.boolalg.Boolean) else ex, e.dtype)
        return None

    # Indirect indices substitute through their arguments (xreplace), not their values.
    return rewrite(expr, sub, indirect=False)


@functools.lru_cache(maxsize=1 << 16)
def _substitute_one(index, items: tuple):
    if isinstance(index, int):
        index = sympy.Integer(index)
    if index.is_Integer:
        return index
    if index.is_Symbol:
        for k, v in items:
            if k == index:
                return sizes.simplify(sympy.sympify(v))
        return index
    return sizes.simplify(index.xreplace(dict(items)))


@functools.lru_cache(maxsize=1 << 14)
def _xreplace(expr, items: tuple):
    return expr.xreplace(dict(items))


# --------------------------------------------------------------------------- #
# Indirect indices
# --------------------------------------------------------------------------- #
# [Note: indirect indexing]
# A gather reads its operand at positions that are values loaded at run time
# (``table[ids[i]]``). As Inductor's ``ops.indirect_indexing`` does, such a
# value enters an index expression as an opaque sympy term, so the index
# machinery (ravel, FloorDiv, substitution, simplification) never looks inside
# it: an ``IndirectIndex`` function application ``ind_<hash>(a0, a1, ...)``,
# a non-negative integer. Its class holds the value as a body expression
# (``Expr``, int32) over formal symbols ``_a0, _a1, ...``; the application's
# arguments are the index expressions the formals stand for (the symbols the
# value depends on, e.g. ``i0`` in ``ids[i0]``). So substituting coordinates
# into an index substitutes the arguments (plain sympy), and inlining a view
# of the index into a consumer carries the value along. Rules put the value's
# bounds handling (clamping, per the primitive's mode) into the value itself:
# it is always inside the dimension it indexes, so loads through it need no
# mask. ``Load.children`` are the values of its indirect indices (with the
# arguments substituted), so ``walk``/``loads``/``reads`` see the index
# buffers, and ``rewrite`` rewrites inside them; the renderers emit each value
# and print its variable in the offset (``KernelEmitter.index`` in codegen/emitter.py). The class
# name is a hash of the value's text: equal values are one function, in every
# graph and process, and the table below is a pure memo.
class IndirectIndex(sympy.Function):
    """``ind_<hash>(args)``: an index value loaded at run time (see the Note)."""

    is_integer = True
    is_nonnegative = True
    value: Expr = None  # over the formal symbols _a0.._a{n-1}
    nargs_: int = 0


_INDIRECT_CLASSES: dict[str, type] = {}


def _formal(k: int):
    return sizes.symbol(f"_a{k}")


def _index_free_symbols(expr: Expr) -> set:
    """The index symbols (not dim symbols) a body expression depends on."""
    out = set()
    for e in walk(expr, indirect=False):
        if isinstance(e, Load):
            for i in e.index + ((e.mask,) if e.mask is not None else ()):
                out |= getattr(sympy.sympify(i), "free_symbols", set())
        elif isinstance(e, IndexValue):
            out |= getattr(e.expr, "free_symbols", set())
    return {s for s in out if not s.is_positive}


def indirect_index(value: Expr):
    """The index term whose value at run time is ``value`` (an int32 body
    expression over index symbols, already within the dimension it indexes)."""
    if isinstance(value, Const):
        return sympy.Integer(int(value.value))
    if isinstance(value, IndexValue) and not isinstance(value.expr, sympy.logic.boolalg.Boolean):
        return sizes.simplify(value.expr)
    args = sorted(_index_free_symbols(value), key=lambda s: s.name)
    template = substitute_index(value, {a: _formal(k) for k, a in enumerate(args)})
    name = "ind_" + hashlib.sha1(_structure_text(template).encode()).hexdigest()[:12]
    cls = _INDIRECT_CLASSES.get(name)
    if cls is None:
        cls = _INDIRECT_CLASSES[name] = type(name, (IndirectIndex,), {"value": template, "nargs_": len(args)})
    return cls(*args)


def _structure_text(expr: Expr) -> str:
    """Deterministic text of a body, dtypes included, each distinct node once.
    (``repr`` prints the DAG as a tree: a gather's index is clamped and wrapped
    from three references to one value, so nested gathers (a resize's index
    gradient) grew it exponentially.)"""
    names: dict[Expr, str] = {}
    lines = []
    for e in walk(expr, indirect=False):  # nested indirect indices print as their class's name
        if isinstance(e, Op):
            text = f"{e.op}({', '.join(names[a] for a in e.args)}; {e.params!r})"
        elif isinstance(e, Load):
            text = f"{e.buffer}[{', '.join(str(i) for i in e.index)}] if {e.mask}"
        else:
            text = repr(e)  # Const, IndexValue: no operands
        names[e] = f"t{len(names)}"
        lines.append(f"{names[e]} = {text}:{e.dtype}")
    return "; ".join(lines)


def indirect_atoms(index) -> list:
    """The indirect index applications in a tuple of index expressions, outermost only."""
    try:
        return list(_indirect_atoms(tuple(index)))
    except TypeError:  # an unhashable entry
        return list(_indirect_atoms.__wrapped__(index))


@functools.lru_cache(maxsize=1 << 16)
def _indirect_atoms(index) -> tuple:
    # Memoized: each new load asks, and a program's loads repeat a few indices.
    out = []
    for i in index:
        if isinstance(i, sympy.Basic) and i.has(IndirectIndex):
            for a in sympy.preorder_traversal(i):
                if isinstance(a, IndirectIndex) and a not in out:
                    out.append(a)
    return tuple(out)


def has_indirect(expr: Expr) -> bool:
    return any(e.children() for e in walk(expr, indirect=False) if isinstance(e, (Load, IndexValue)))


def indirect_value(app) -> Expr:
    """The body expression an application stands for, its arguments substituted."""
    return substitute_index(type(app).value, {_formal(k): a for k, a in enumerate(app.args)})


def _rewrite_indirect(e, memo: dict):
    """``e`` (a Load or IndexValue) with each indirect index whose value the rewrite changed replaced."""
    swap = {}
    for app, v in zip(indirect_atoms(e.indexing()), e.children()):
        nv = memo.get(v, v)
        if nv is not v:
            swap[app] = indirect_index(nv)
    if not swap:
        return e
    if isinstance(e, IndexValue):
        ex = e.expr.xreplace(swap)
        return IndexValue(ex if isinstance(ex, sympy.logic.boolalg.Boolean) else sizes.simplify(ex), e.dtype)
    return dataclasses.replace(e, index=tuple(sizes.simplify(sympy.sympify(i).xreplace(swap)) for i in e.index),
                               mask=None if e.mask is None else e.mask.xreplace(swap))


def indirect_definitions(exprs) -> list[str]:
    """Text of the indirect index functions the expressions use (for Graph.format)."""
    seen, lines = set(), []
    for expr in exprs:
        for e in walk(expr):
            if isinstance(e, (Load, IndexValue)):
                for app in indirect_atoms(e.indexing()):
                    cls = type(app)
                    if cls.__name__ not in seen:
                        seen.add(cls.__name__)
                        formals = ", ".join(str(_formal(k)) for k in range(cls.nargs_))
                        lines.append(f"{cls.__name__}({formals}) = {format_expr(cls.value)}")
    return sorted(lines)


def rewrites_mask_products(dtype, interpret: bool) -> bool:
    """Does XLA make ``convert(pred) * x`` of this dtype a select? Floats, but not
    bfloat16 on XLA:CPU (interpret mode), which multiplies it in float32 behind
    converts the rewrite does not see through."""
    dtype = np.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.floating)) and not (interpret and dtype.name == "bfloat16")


def mask_select(pred: Expr, x: Expr) -> Expr:
    """``select(pred, x, 0)``: XLA's form of ``convert(pred) * x`` (+0.0 where pred is
    False, whatever x holds)."""
    return Op("select_n", (pred, Const(0.0, np.dtype(x.dtype)), x), np.dtype(x.dtype))


def format_expr(expr: Expr) -> str:
    """Deterministic text of a body as numbered lets (shared nodes printed once)."""
    names: dict[Expr, str] = {}
    lines = []
    for e in walk(expr):
        if isinstance(e, Op):
            p = "".join(f", {k}={v}" for k, v in e.params)
            text = f"{e.op}({', '.join(names[a] for a in e.args)}{p})"
        else:
            text = str(e)
        if e is expr or isinstance(e, Op):
            name = f"t{len(names)}"
            names[e] = name
            lines.append(f"{name} = {text}")
        else:
            names[e] = text
    if not lines:
        return str(expr)
    return "; ".join(lines)


# --------------------------------------------------------------------------- #
# Nodes
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class Node:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    origin: tuple[str, ...] = ()  # jaxpr equations this node came from (text)

    def reads(self) -> list[str]:
        return []

    @property
    def numel(self) -> int:
        return sizes.numel(self.shape)


@dataclasses.dataclass
class InputNode(Node):
    """A graph input (argument or hoisted constant)."""

    def format(self):
        return f"{self.name}: {self.dtype.name}{list(self.shape)} = input"


@dataclasses.dataclass
class Pointwise(Node):
    body: Expr = None
    # A shape equation XLA can run on its own (reshape, transpose, squeeze,
    # expand_dims): its (primitive, params). Between XLA ops it runs there
    # (lowering/xla_views.py), where a copy kernel would cost a pass.
    view: tuple | None = None

    @property
    def symbols(self):
        return sizes.index_symbols("i", len(self.shape))

    def reads(self):
        return list(buffers(self.body))

    def format(self):
        return f"{self.name}: {self.dtype.name}{list(self.shape)} = pointwise {{ {format_expr(self.body)} }}"


@dataclasses.dataclass
class Reduction(Node):
    """``shape`` is the kept dims; ``reduced`` the reduced dims' sizes; ``axes`` where
    the reduced dims sat in the domain (the operand's shape)."""

    body: Expr = None
    reduced: tuple[int, ...] = ()
    axes: tuple[int, ...] = ()
    op: str = "sum"

    @property
    def symbols(self):
        return sizes.index_symbols("i", len(self.shape))

    @property
    def reduction_symbols(self):
        return sizes.index_symbols("r", len(self.reduced))

    @property
    def domain(self) -> tuple[int, ...]:
        dims, kept, red = [], iter(self.shape), iter(self.reduced)
        for k in range(len(self.shape) + len(self.reduced)):
            dims.append(next(red) if k in self.axes else next(kept))
        return tuple(dims)

    @property
    def reduced_numel(self) -> int:
        return sizes.numel(self.reduced)

    def reads(self):
        return list(buffers(self.body))

    def format(self):
        return (f"{self.name}: {self.dtype.name}{list(self.shape)} = reduce_{self.op} over "
                f"{list(self.reduced)} (axes {list(self.axes)}) {{ {format_expr(self.body)} }}")


@dataclasses.dataclass
class PartialReduction(Node):
    """Per-program partial results of a reduction over the *leading* dims of its
    domain (a column reduction): ``shape`` is ``(programs, *kept)``. Program
    ``p`` combines the rows it owns; a ``Reduction`` over axis 0 finishes the
    job. The body is the original reduction's (symbols ``i*`` for ``kept``,
    ``r*`` for ``reduced``). Made by the scheduler (split reductions and
    mix-order fusion); ``acc_dtype`` is what the partials are kept in."""

    body: Expr = None
    kept: tuple[int, ...] = ()
    reduced: tuple[int, ...] = ()
    op: str = "sum"
    programs: int = 1

    @property
    def symbols(self):
        return sizes.index_symbols("i", len(self.kept))

    @property
    def reduction_symbols(self):
        return sizes.index_symbols("r", len(self.reduced))

    @property
    def domain(self) -> tuple[int, ...]:
        return tuple(self.reduced) + tuple(self.kept)

    @property
    def row_axes(self) -> tuple[int, ...]:
        """The domain axes a row reduction fused with this one reduces."""
        return tuple(range(len(self.reduced), len(self.reduced) + len(self.kept)))

    def reads(self):
        return list(buffers(self.body))

    def format(self):
        return (f"{self.name}: {self.dtype.name}{list(self.shape)} = partial_{self.op} over "
                f"{list(self.reduced)} in {self.programs} programs {{ {format_expr(self.body)} }}")


@dataclasses.dataclass
class Matmul(Node):
    """``value[b, m, n] = sum over k of lhs * rhs``, accumulated in float32: a
    ``dot_general`` run by the matmul template (``codegen/matmul.py``).

    ``shape`` is ``batch + m + n`` (jax's output order: batch dims, the lhs's
    free dims, the rhs's free dims); ``k`` the contracting dims' sizes. The body
    is ``Op("dot_general", (lhs, rhs))``: two loads indexed by the output
    symbols ``i*`` and the contraction symbols ``r*`` (like a reduction's), so
    views of the operands fold into those indices by inlining.
    ``precision``: "default" (TF32 for float32 operands on the GPU, as XLA's
    default) or "highest" (IEEE float32)."""

    body: Expr = None
    batch: tuple[int, ...] = ()
    m: tuple[int, ...] = ()
    n: tuple[int, ...] = ()
    k: tuple[int, ...] = ()
    precision: str = "default"

    @property
    def symbols(self):
        return sizes.index_symbols("i", len(self.shape))

    @property
    def reduction_symbols(self):
        return sizes.index_symbols("r", len(self.k))

    @property
    def operands(self) -> tuple[Expr, Expr]:
        return self.body.args

    def reads(self):
        return list(buffers(self.body))

    def format(self):
        return (f"{self.name}: {self.dtype.name}{list(self.shape)} = matmul batch {list(self.batch)} m {list(self.m)} "
                f"n {list(self.n)} k {list(self.k)} ({self.precision}) {{ {format_expr(self.body)} }}")


# [Note: atomic scatters]
# A scatter with many update positions per output element (an embedding's
# gradient: any id can hit any row; ``segment_max``; a mask built by
# ``.at[ids].set(True)``) cannot be written densely, each element gathering
# its updates (rules/gather.py, MAX_SCATTER_TERMS). As Inductor's
# ``ops.store(..., mode="atomic_add")`` does, a ``Scatter`` node is a kernel
# over the *updates'* domain: its output starts as a copy of the operand (the
# raw-Triton launch aliases the operand buffer to its output, so XLA writes the
# operand there in place or copies it), then each update position combines its
# value atomically into the position it scatters to. Its body is
# ``scatter(target, update, ok)``: ``target`` a load of the operand at the
# destination (indirect indices, clamped per the primitive's mode), whose
# offset is where the update lands; ``update`` the value (inlined producers:
# the cotangent's pointwise chain fuses into it); ``ok`` false where the mode
# drops the window. Symbols ``i*`` index ``domain``, not the node's shape.
# Where the updates or the indices read the operand (``x.at[p].set(x[q])``,
# ``y.at[i].add(v * y[i])``), the operand is first copied (the rule's
# ``_reads``): updated in place, its buffer would be read half updated by other
# programs. Only the raw-Triton renderer writes it. ``combine`` says how an
# update meets the element, each with its atomic (codegen/triton.py
# ``render_scatter``); the modes (drop / clip) are the index logic's, the same
# for all:
# - ``add``: ``tl.atomic_add``. Float sums land in whatever order the atomics
#   run: not bitwise reproducible. Integer sums wrap: exact, any order.
# - ``max`` / ``min``: ``tl.atomic_max`` / ``tl.atomic_min``. Integers are
#   exact. Triton does a float's on its bits (a signed max where the update's
#   sign bit is clear, an unsigned min where it is set), which is the max under
#   IEEE's total order: -0 < +0 (jax's lax.max gives +0 for the pair, min -0,
#   in either order: the same), NaN above +inf when its sign bit is clear and
#   below -inf when set. So that any NaN wins, as in jax, the rule gives every
#   NaN of the update and of the operand's copy one sign (clear for max, set
#   for min): exact, and deterministic (a max under a total order). An element
#   only grows under max (shrinks under min), so an update first reads it,
#   plainly, and skips the atomic where it already beats the update (a stale
#   read is an older, weaker value: a needless atomic at worst, never a missed
#   one); a NaN or an equal value (±0) still goes through the atomic. A
#   segment's later updates mostly lose: without the read, a GNN's f32
#   segment_max ran 1.9x slower than XLA's scatter (RESULTS.md, "Session 25").
# - ``mul``: no atomic multiply: a compare-and-swap loop per update on the
#   element's bits (NaN compares equal to itself there). Integer products wrap:
#   exact, any order; float products round in the order the swaps win.
# - ``set``: a plain store. Where indices repeat, which update lands is
#   unspecified (jax's too, unless ``unique_indices``; XLA:CPU's last one):
#   each element holds the operand's value or one of its updates' values
#   (an aligned store is never torn), as users of ``.at[ids].set`` expect.
# Narrow dtypes have no atomics in Triton (or none in its interpreter): the rule
# combines in a 32-bit scratch (16-bit floats in float32: a max, min or
# conversion is exact there; a sum or product rounds once at the end; ints and
# bools in int32, whose wrapped sum or product truncates to the same value) and
# converts back; 64-bit dtypes (x64) combine as they are. What is deterministic
# anyway: integer and bool scatters of every combiner, float max / min, a set
# with unique indices or of one value (a mask's broadcast True); option
# ``deterministic_scatter`` runs the others (float add / mul, other sets)
# through XLA (rules/gather.py ``_deterministic``).
# Symbolic shapes run through XLA, as the dense rule's do: both write their
# clamps as constants, this kernel's extent is one too, and eager launches (a
# symbolic program's new sizes) have no aliased outputs, so each new size would
# wait for XLA's compile anyway (runtime/eager.py would need them first).


@dataclasses.dataclass
class Scatter(Node):
    """``value = operand; value[target(i)] = combine(value[target(i)], update(i))
    where ok(i)`` over the updates' ``domain``, atomically ([Note: atomic
    scatters])."""

    body: Expr = None  # Op("scatter", (target Load of ``operand``, update, ok))
    operand: str = ""
    domain: tuple[int, ...] = ()
    combine: str = "add"  # add, max, min, mul or set

    @property
    def symbols(self):
        return sizes.index_symbols("i", len(self.domain))

    @property
    def target(self) -> Load:
        return self.body.args[0]

    def reads(self):
        return list(buffers(self.body))

    def format(self):
        return (f"{self.name}: {self.dtype.name}{list(self.shape)} = scatter_{self.combine} into {self.operand} "
                f"over {list(self.domain)} {{ {format_expr(self.body)} }}")


@dataclasses.dataclass
class Extern(Node):
    """A primitive run by XLA. ``outputs`` names the buffers it defines (this node's
    own name is the first); their avals are in ``out_avals``."""

    primitive: object = None  # the jax Primitive
    params: dict = dataclasses.field(default_factory=dict)
    inputs: tuple = ()  # buffer names or Const for literals
    outputs: tuple[str, ...] = ()
    out_avals: tuple = ()
    effectful: bool = False  # has side effects: never dropped as dead code

    def reads(self):
        return sorted({i for i in self.inputs if isinstance(i, str)})

    def format(self):
        ins = ", ".join(i if isinstance(i, str) else str(i) for i in self.inputs)
        outs = ", ".join(f"{n}: {a.dtype.name}{list(a.shape)}" for n, a in zip(self.outputs, self.out_avals))
        return f"{outs + ' = ' if outs else ''}extern {self.primitive.name}({ins})"


@dataclasses.dataclass
class Attention(Extern):
    """Flash attention ([Note: fused attention] in lowering/attention.py): an
    extern whose kernel pallaskit renders (codegen/attention.py) and launches
    as raw Triton inside the XLA program; ``params["spec"]`` says what it
    computes, ``params["phase"]`` "forward" (O, lse) or "backward" (dQ, dK, dV).
    Anything that treats it as a plain extern runs the equations it replaced."""

    def format(self):
        return super().format().replace("extern pallaskit_attention", f"attention_{self.params['phase']}")


@dataclasses.dataclass
class Graph:
    inputs: list[str]
    nodes: dict[str, Node]  # insertion order is a topological order
    outputs: list  # buffer name, or Const for a literal output
    constants: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Outputs whose jaxpr aval is weakly typed (a Python scalar's dtype): the
    # program returns them weak, as jax.jit does, so they promote as jax.jit's.
    weak_outputs: tuple[bool, ...] = ()

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def format(self) -> str:
        lines = [f"inputs: {', '.join(self.inputs)}"]
        lines += [n.format() for n in self.nodes.values() if not isinstance(n, InputNode)]
        lines += indirect_definitions([n.body for n in self.nodes.values() if getattr(n, "body", None) is not None])
        lines.append("outputs: " + ", ".join(o if isinstance(o, str) else str(o) for o in self.outputs))
        return "\n".join(lines)

    def buffer_aval(self, name: str):
        """(shape, dtype) of any buffer, extern outputs included."""
        if name in self.nodes:
            n = self.nodes[name]
            return n.shape, n.dtype
        for n in self.nodes.values():
            if isinstance(n, Extern) and name in n.outputs:
                a = n.out_avals[n.outputs.index(name)]
                return tuple(a.shape), np.dtype(a.dtype)
        raise KeyError(name)
