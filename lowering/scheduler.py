"""Scheduling: which buffers are materialized, and which nodes share a kernel.

[Note: fusion in pallaskit]
1. Dead code is dropped (``live_nodes``).
2. Every ``Pointwise`` node is inlined into its readers: its body replaces the
   loads of it, with the reader's index substituted (``inline_bodies``). What
   stays materialized: graph outputs, reductions, and extern operands/results.
   Inlining is vertical fusion of pointwise producers; recomputation is free
   where readers share a kernel (the renderer keeps one copy per expression).
3. Each materialized node starts as its own group. Groups merge greedily, best
   score first, until no pair can merge (``fuse_groups``). ``can_fuse`` says
   whether a merge is legal (same iteration space, no cycle through another
   kernel, every in-kernel read at the reader's own point), or why not
   (``WhyNoFuse``, kept in ``Schedule.refusals``); ``fusion_score``
   says what it is worth (bytes no longer moved, then fewer launches).
   Legality and profit never mix.
4. Groups and externs are ordered topologically into a ``Schedule``.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import itertools

import numpy as np
import sympy

from lowering import heuristics, ir, sizes
from lowering.split import split_reductions
from lowering.xla_views import run_views_in_xla
from lowering.options import CompileOptions

XR, XC = sizes.symbol("xr"), sizes.symbol("xc")


# --------------------------------------------------------------------------- #
# Schedule data
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class Member:
    """One materialized node inside a kernel.

    ``role``: "reduction", "rowwise" (a pointwise node over the kernel's whole
    iteration space), "row" (a pointwise node with one value per row, such as
    a normalization's epilogue) or "column" (a ``PartialReduction``: one value
    per column, combined over the rows a program owns). ``coords`` maps the node's own index symbols
    to the kernel coordinates ``xr`` (row) and ``xc`` (column)."""

    node: ir.Node
    role: str
    body: ir.Expr
    coords: dict
    store: bool = False

    @property
    def name(self):
        return self.node.name


@dataclasses.dataclass
class Kernel:
    name: str
    kind: str  # "pointwise" | "reduction" | "mix" (row blocks walked by a persistent grid) | "matmul" | "scatter"
    rows: int
    cols: int
    members: list[Member]
    reads: list[str]  # buffers loaded from memory
    origin: list[str]  # jaxpr equations
    programs: int = 0  # mix kernels: the grid's programs (= rows of each partial buffer)
    # (read, stored member) pairs whose output may take the read's buffer: a
    # loop body's carry updated in place ([Note: in-place carries] in lowering/loops.py)
    in_place: tuple = ()

    @property
    def mix_order(self) -> bool:
        """A mix kernel that also reduces rows: mix-order fusion."""
        return self.kind == "mix" and any(m.role in ("reduction", "row") for m in self.members)

    @property
    def stores(self) -> list[str]:
        return [m.name for m in self.members if m.store]


@dataclasses.dataclass
class Schedule:
    graph: ir.Graph
    steps: list  # Kernel | ir.Extern, in execution order
    stored: set  # buffers written to memory (kernel stores, externs, inputs)
    nodes_before: int
    nodes_after: int
    refusals: list = dataclasses.field(default_factory=list)  # WhyNoFuse of pairs worth merging that can_fuse refused

    @property
    def kernels(self) -> list[Kernel]:
        return [s for s in self.steps if isinstance(s, Kernel)]


# --------------------------------------------------------------------------- #
# 1. Dead code
# --------------------------------------------------------------------------- #
def live_nodes(graph: ir.Graph) -> set[str]:
    producer = _producers(graph)
    live, stack = set(), [o for o in graph.outputs if isinstance(o, str)]
    stack += [n.name for n in graph.nodes.values() if isinstance(n, ir.Extern) and n.effectful]
    while stack:
        buf = stack.pop()
        node = producer[buf]
        if node.name in live:
            continue
        live.add(node.name)
        stack.extend(node.reads())
    return live


def _producers(graph: ir.Graph) -> dict[str, ir.Node]:
    out = {}
    for n in graph.nodes.values():
        if isinstance(n, ir.Extern):
            out[n.name] = n  # an effect without results is known by its own name
            for o in n.outputs:
                out[o] = n
        else:
            out[n.name] = n
    return out


# --------------------------------------------------------------------------- #
# 2. Inlining
# --------------------------------------------------------------------------- #
def materialized(graph: ir.Graph, live: set[str], options: CompileOptions | None = None) -> set[str]:
    keep = {o for o in graph.outputs if isinstance(o, str)}
    for n in graph.nodes.values():
        if n.name not in live:
            continue
        if isinstance(n, (ir.InputNode, ir.Reduction, ir.PartialReduction)):
            keep.add(n.name)
        elif isinstance(n, ir.Extern):
            keep.update(n.outputs)
            keep.update(n.reads())
        elif isinstance(n, ir.Matmul):
            keep.add(n.name)
        elif isinstance(n, ir.Scatter):  # its launch aliases the operand's buffer to its output
            keep.update((n.name, n.operand))
    for n in graph.nodes.values():
        if isinstance(n, ir.Matmul) and n.name in live:
            keep.update(matmul_operand_buffers(graph, n, keep))
    if options is not None:
        keep |= broadcast_tables(graph, live, keep, options)
    return keep


# [Note: broadcast tables]
# Inlining recomputes a pointwise value at every element of its reader. Where the
# reader is larger (the value is read broadcast) and the value is costly — RoPE's
# cos/sin of position x frequency, read over batch and heads; a sinusoidal position
# table; ALiBi's slopes — the renderer cannot always evaluate it once per broadcast
# slice (a flat pointwise kernel recovers each element's position by division), and
# the kernel turns compute-bound (libdevice sin/cos/pow per element). Such a value is
# stored once instead (its own small kernel) when its op units times the reader's
# extra elements pass heuristics.BROADCAST_TABLE_OPS. Only values whose inlined body
# reads indices, graph inputs and constants qualify: a value built on a reduction
# (LayerNorm's rsqrt of a row variance) is evaluated per row by the row and mix
# writers already, and must stay in their kernel. What is cheap (compares, a causal
# mask, adds) always stays inlined. Likewise a value whose inlined body loads more
# than heuristics.MAX_INLINED_READS buffers and that larger readers read (a global-norm
# clip's scale: the sum of every parameter's sum of squares, read by every update) is
# stored once rather than summed again in each reader, and so is one whose body loads
# more than heuristics.MAX_SHARED_INLINED_READS buffers and that several nodes read (a
# deep model's residual stream, the sum of every earlier layer's outputs). And a value
# that one reader loads at several indices is inlined once per index: a gather of a
# gather, ``i = i[i]`` repeated, doubles its reader's loads at each step (2^k for k
# steps, each at its own index, so nothing is shared), so a value whose inlined body
# loads more than heuristics.MAX_INLINED_LOADS elements, over twice as many as the
# buffers they come from, is stored.
def broadcast_tables(graph: ir.Graph, live: set[str], keep: set[str], options: CompileOptions) -> set[str]:
    readers: dict[str, list] = collections.defaultdict(list)
    for n in graph.nodes.values():
        if n.name in live:
            for b in set(n.reads()):
                readers[b].append(n)
    leaf = {n.name for n in graph.nodes.values() if isinstance(n, ir.InputNode)}
    cost: dict[str, int | None] = {}  # None: reads a computed buffer (not a table)
    wide: dict[str, frozenset | None] = {}  # stored buffers an inlined body loads (None: too many to count)

    def body_reads(expr) -> frozenset | None:
        out = set()
        for ld in ir.loads(expr):
            if ld.buffer in wide:
                inner = wide[ld.buffer]
                if inner is None:
                    return None
                out |= inner
            else:
                out.add(ld.buffer)
            if len(out) > heuristics.MAX_INLINED_READS:
                return None
        return frozenset(out)

    def body_cost(expr) -> int | None:
        total = sum(heuristics.op_weight(op) * n for op, n in ir.op_counts(expr))
        for ld in ir.loads(expr):
            if ld.buffer in leaf:
                continue
            c = cost.get(ld.buffer)
            if c is None:
                return None
            total += c
        return total

    def domain(n) -> int | None:
        """Elements a node's body is evaluated at (a reduction's: its operand's)."""
        try:
            size = sizes.hint(n.numel, options.size_hints)
            if isinstance(n, ir.Reduction):
                size *= sizes.hint(sizes.numel(n.reduced), options.size_hints)
        except ValueError:  # a symbolic size without a hint
            return None
        return size

    tables = set()
    inlined_loads: dict[str, int] = {}  # at most the distinct loads an inlined body brings into its reader
    stored = set(keep)
    inliner = None

    def store(name: str) -> None:
        tables.add(name)
        stored.add(name)
        cost[name] = 0  # its readers load it
        wide[name] = frozenset((name,))
        inlined_loads[name] = 1

    seen = []
    for n in graph.nodes.values():
        if not isinstance(n, ir.Pointwise) or n.name not in live or n.name in keep:
            continue
        seen.append(n)
        bound = sum(inlined_loads.get(ld.buffer, 1) for ld in ir.loads(n.body))
        inlined_loads[n.name] = min(bound, 1 << 20)
        if inliner is not None:
            inliner.body(n)  # in graph order, as ``_Inliner.prime``: no recursion down long chains
        if bound > heuristics.MAX_INLINED_LOADS:  # the bound counts shared loads again: count them
            if inliner is None:
                inliner = _Inliner(graph, stored)
                for m in seen:
                    inliner.body(m)
            loads = ir.loads(inliner.body(n))
            inlined_loads[n.name] = len(loads)
            if len(loads) > max(heuristics.MAX_INLINED_LOADS, 2 * len({ld.buffer for ld in loads})):
                store(n.name)  # a buffer loaded at many indices: gathers of gathers
                continue
        c = cost[n.name] = body_cost(n.body)
        w = wide[n.name] = body_reads(n.body)
        many = w is None or len(w) > heuristics.MAX_SHARED_INLINED_READS
        if not c and not many:
            continue
        if many and len(readers[n.name]) > 1:  # each reader would load them all
            store(n.name)
            continue
        own = domain(n)
        if own is None:
            continue
        extra = max((domain(r) or 0) - own for r in readers[n.name]) if readers[n.name] else 0
        if (c and c * extra >= heuristics.BROADCAST_TABLE_OPS) or (w is None and extra > 0):
            store(n.name)
    return tables


class _Inliner:
    def __init__(self, graph: ir.Graph, keep: set[str]):
        self.graph, self.keep = graph, keep
        self.memo: dict = {}
        self.bodies: dict = {}  # body -> inlined body (a producer read at several indices is inlined once)

    def body(self, node) -> ir.Expr:
        return self._inline(node.body)

    def prime(self, live: set[str]):
        """Inline every pointwise node in graph (topological) order, so that a
        load's producer is always inlined already: a long chain of pointwise
        nodes would otherwise recurse once per link."""
        for node in self.graph.nodes.values():
            if isinstance(node, ir.Pointwise) and node.name in live and node.name not in self.keep:
                self._inline(node.body)

    def _inline(self, expr: ir.Expr) -> ir.Expr:
        out = self.bodies.get(expr)
        if out is None:
            def sub(e):
                if isinstance(e, ir.Load) and e.buffer not in self.keep:
                    return self._load(e)
                return None

            out = self.bodies[expr] = ir.rewrite(expr, sub)
        return out

    def _load(self, ld: ir.Load) -> ir.Expr:
        key = (ld.buffer, ld.index, ld.mask)
        if key not in self.memo:
            producer = self.graph.nodes[ld.buffer]
            mapping = dict(zip(producer.symbols, ld.index))
            body = ir.substitute_index(self._inline(producer.body), mapping)
            if ld.mask is not None:
                body = _and_mask(body, ld.mask)
            self.memo[key] = body
        return self.memo[key]


@functools.lru_cache(maxsize=1 << 14)
def _and(a, b):
    return sympy.And(a, b)


def _and_mask(expr, mask):
    def sub(e):
        if isinstance(e, ir.Load):
            m = mask if e.mask is None else _and(e.mask, mask)
            return dataclasses.replace(e, mask=m)
        return None

    return ir.rewrite(expr, sub)


# --------------------------------------------------------------------------- #
# 3. Groups
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(eq=False)
class _Group:
    kind: str  # "pointwise" | "reduction" | "mix"
    rows: int
    cols: int
    domain: tuple  # pointwise: its shape; reduction and mix: (domain, axes reduced per row)
    members: list[Member]
    order: int  # position of the first member in the graph
    # The fuser walks reads and writes on every score, so both are computed once
    # (members never change after a group is made: a merge makes a new group).
    _produces: frozenset = dataclasses.field(default=None, repr=False)
    _reads: frozenset = dataclasses.field(default=None, repr=False)
    # Its members as members of a group of another shape, per (kind, rows, cols,
    # domain): a large group is weighed against many neighbours of one shape.
    _as: dict = dataclasses.field(default=None, repr=False)

    def produces(self) -> frozenset[str]:
        if self._produces is None:
            self._produces = frozenset(m.name for m in self.members)
        return self._produces

    def reads(self) -> frozenset[str]:
        if self._reads is None:
            own = self.produces()
            self._reads = frozenset(ld.buffer for m in self.members for ld in ir.loads(m.body)) - own
        return self._reads


def _coords_pointwise(node, shape):
    return dict(zip(node.symbols, sizes.unravel(XC, shape)))


def _reduction_coords(node: ir.Reduction):
    coords = dict(zip(node.symbols, sizes.unravel(XR, node.shape)))
    coords.update(zip(node.reduction_symbols, sizes.unravel(XC, node.reduced)))
    return coords


def _partial_coords(node: ir.PartialReduction):
    coords = dict(zip(node.symbols, sizes.unravel(XC, node.kept)))
    coords.update(zip(node.reduction_symbols, sizes.unravel(XR, node.reduced)))
    return coords


def _rowwise_coords(shape, domain, axes):
    """Coordinates of a pointwise node whose shape is a reduction's domain."""
    kept = [d for k, d in enumerate(domain) if k not in axes]
    red = [domain[a] for a in axes]
    kept_idx, red_idx = iter(sizes.unravel(XR, kept)), iter(sizes.unravel(XC, red))
    syms = sizes.index_symbols("i", len(shape))
    return {s: (next(red_idx) if k in axes else next(kept_idx)) for k, s in enumerate(syms)}


def _position(member: Member, index) -> sympy.Expr:
    """Linear position, in kernel coordinates, of reading ``member`` at ``index``
    (already in kernel coordinates)."""
    return sizes.simplify(sizes.ravel(index, member.node.shape))


def _own_position(member: Member) -> sympy.Expr:
    own = tuple(member.coords.get(s, s) for s in member.node.symbols)
    return _position(member, own)


def _in_kernel_reads_ok(members: list[Member]) -> bool:
    """Every read of a buffer produced in the kernel is at the reader's own point."""
    by_name = {m.name: m for m in members}
    pointwise = all(m.role == "rowwise" for m in members)  # a pointwise group: no other role
    for m in members:
        for ld in ir.loads(m.body):
            prod = by_name.get(ld.buffer)
            if prod is not None and not _in_kernel_read_ok(m, prod, ld, pointwise):
                return False
    return True


def _reads_own_rowwise(g: _Group) -> bool:
    """Does a member of ``g`` read another member's row-wise value (a pointwise
    group's forwarded read, ``_in_kernel_read_ok``)?"""
    own = g.produces()
    return any(ld.buffer in own for m in g.members for ld in ir.loads(m.body))


def _merged_reads_ok(merged: _Group, a: _Group, b: _Group) -> bool:
    """``_in_kernel_reads_ok(merged.members)``, checking only what the merge
    can have changed: both groups' own reads were checked when they were made,
    so a read within one side is skipped unless the merge gave its reader or
    its producer another role or other coordinates (a pointwise group joining
    a reduction's iteration space)."""
    pointwise = merged.kind == "pointwise"
    if not pointwise and any(g.kind == "pointwise" and _reads_own_rowwise(g) for g in (a, b)):
        return False  # forwarded row-wise reads are for pointwise kernels only
    side, before = {}, {}
    for g in (a, b):
        for m in g.members:
            side[m.name], before[m.name] = g, m
    by_name = {m.name: m for m in merged.members}
    moved = {n for n, m in by_name.items()
             if not (before[n] is m or (before[n].role == m.role and before[n].coords == m.coords))}
    moved_side = {id(side[n]) for n in moved}
    for m in merged.members:
        g = side[m.name]
        other = b if g is a else a
        if m.name not in moved and id(g) not in moved_side and not (g.reads() & other.produces()):
            continue
        for ld in ir.loads(m.body):
            prod = by_name.get(ld.buffer)
            if prod is None:
                continue
            if side[prod.name] is g and m.name not in moved and prod.name not in moved:
                continue
            if not _in_kernel_read_ok(m, prod, ld, pointwise):
                return False
    return True


def _in_kernel_read_ok(m: Member, prod: Member, ld: ir.Load, pointwise: bool = False) -> bool:
    if prod.role == "rowwise" and not (pointwise and m.role == "rowwise"):
        return False  # row-wise values are inlined, never re-read
    # In a pointwise kernel a member may read another's value at its own point (an
    # output such as Adam's new moment, read by the parameter update): the
    # renderer forwards the value it stores (``write_pointwise``), no load.
    if ld.mask is not None:
        return False
    if m.role in ("reduction", "rowwise", "row", "column"):
        idx = tuple(sizes.simplify(sympy.sympify(i).xreplace(m.coords)) for i in ld.index)
        if sizes.simplify(_position(prod, idx) - _own_position(prod)) != 0:
            return False
    return True


def _member_for(node, body, group_kind, rows, cols, domain) -> Member | None:
    """How ``node`` would sit in a group with this iteration space, or None."""
    if isinstance(node, ir.PartialReduction):
        if group_kind != "mix" or (node.domain, node.row_axes) != domain:
            return None
        return Member(node, "column", body, _partial_coords(node))
    if isinstance(node, ir.Reduction):
        if group_kind == "pointwise" or (node.domain, node.axes) != domain:
            return None
        return Member(node, "reduction", body, _reduction_coords(node))
    if group_kind == "pointwise":
        if node.shape != domain:
            return None
        return Member(node, "rowwise", body, _coords_pointwise(node, node.shape))
    dom, axes = domain
    if node.shape == dom:
        return Member(node, "rowwise", body, _rowwise_coords(node.shape, dom, axes))
    if node.numel == rows:
        return Member(node, "row", body, dict(zip(node.symbols, sizes.unravel(XR, node.shape))))
    return None


def build_groups(graph, keep, live, inliner) -> list[_Group]:
    inliner.prime(live)
    groups = []
    for pos, node in enumerate(graph.nodes.values()):
        if node.name not in keep or node.name not in live:
            continue
        if isinstance(node, ir.Reduction):
            body = inliner.body(node)
            rows, cols = sizes.numel(node.shape), node.reduced_numel
            m = Member(node, "reduction", body, _reduction_coords(node))
            groups.append(_Group("reduction", rows, cols, (node.domain, node.axes), [m], pos))
        elif isinstance(node, ir.PartialReduction):
            m = Member(node, "column", inliner.body(node), _partial_coords(node))
            groups.append(_Group("mix", sizes.numel(node.reduced), sizes.numel(node.kept),
                                 (node.domain, node.row_axes), [m], pos))
        elif isinstance(node, ir.Pointwise):
            body = inliner.body(node)
            m = Member(node, "rowwise", body, _coords_pointwise(node, node.shape))
            groups.append(_Group("pointwise", 1, node.numel, node.shape, [m], pos))
        elif isinstance(node, ir.Matmul):
            groups.append(_matmul_group(node, inliner.body(node), pos))
        elif isinstance(node, ir.Scatter):
            groups.append(_scatter_group(node, inliner.body(node), pos))
    return groups


def _scatter_group(node: ir.Scatter, body, pos) -> _Group:
    """[Note: atomic scatters] in ir.py: a kernel of its own, flat over the
    updates' domain; it merges with nothing (its producers are inlined)."""
    member = Member(node, "scatter", body, dict(zip(node.symbols, sizes.unravel(XC, node.domain))))
    return _Group("scatter", 1, sizes.numel(node.domain), node, [member], pos)


_KIND_RANK = {"pointwise": 0, "reduction": 1, "mix": 2, "matmul": 3, "scatter": 4}


def _merge(a: _Group, b: _Group, order: dict, members_memo: dict | None = None) -> _Group | None:
    """The group holding both, if their iteration spaces agree; None otherwise.
    A mix group takes row reductions over its domain; a reduction group takes
    pointwise nodes over its domain or over its rows. ``members_memo`` keeps
    each node's member for a group shape, so that weighing many merges of a
    large group does not recompute its members' coordinates each time."""
    if _KIND_RANK[a.kind] < _KIND_RANK[b.kind]:
        a, b = b, a
    base = a
    if base.kind == "scatter":
        return None
    if base.kind == "matmul":
        return _merge_into_matmul(a, b, order)
    if base.kind == "pointwise":
        if a.domain != b.domain:
            return None
        runs = [a.members, b.members]
    else:
        if b.kind != "pointwise" and b.domain != base.domain:
            return None
        shape = (base.kind, base.rows, base.cols, base.domain)
        runs = []
        for g in (a, b):
            if g._as is None:
                g._as = {}
            if shape not in g._as:
                g._as[shape] = _members_as(g.members, shape, members_memo)
            if g._as[shape] is None:
                return None
            runs.append(g._as[shape])
    return _Group(base.kind, base.rows, base.cols, base.domain, _in_order(*runs, order), min(a.order, b.order))


def _in_order(left: list[Member], right: list[Member], order: dict) -> list[Member]:
    """Both runs' members in graph order. Each run is in that order already
    (every group's members are: a group of one, or made here or by
    ``_merge_into_matmul``), and most merges join runs over disjoint ranges of
    the graph (a 12-layer GPT-2 step: 97% of 12,000 merges), which need no sort."""
    def key(m):
        return order[m.node.name]

    if left and right:
        if key(left[-1]) < key(right[0]):
            return left + right
        if key(right[-1]) < key(left[0]):
            return right + left
    return sorted(left + right, key=key)


def _members_as(members: list[Member], shape: tuple, members_memo: dict | None) -> list[Member] | None:
    """Each member as one of a group of ``shape`` (kind, rows, cols, domain); None if one cannot be."""
    out = []
    for m in members:
        key = (id(m.node), id(m.body), *shape)
        hit = members_memo.get(key) if members_memo is not None else None
        if hit is not None and hit[0] is m.node and hit[1] is m.body:  # ids of live objects only
            mm = hit[2]
        else:
            mm = _member_for(m.node, m.body, *shape)
            if members_memo is not None:
                members_memo[key] = (m.node, m.body, mm)
        if mm is None:
            return None
        out.append(mm)
    return out


# --------------------------------------------------------------------------- #
# Matmul groups
# --------------------------------------------------------------------------- #
# [Note: matmul kernels]
# A ``Matmul`` node is a kernel of its own kind: a grid over output tiles (and
# batch), a loop over K. Kernel coordinates: ``xb`` (flat batch index, one per
# program), ``xr`` (flat row of the lhs's free dims), ``xc`` (flat column of
# the rhs's free dims); ``XK`` (the flat contraction index) exists only inside
# the operand loads. Operands: views of a materialized buffer (transpose,
# reshape, broadcast, slice) fold into the operand's index; anything that
# computes is materialized first (no prologue fusion: a pointwise producer
# would be recomputed once per column tile of the output). Epilogues: pointwise
# groups whose every member has one value per output element join the kernel
# and run on the accumulator before the store (bias, activation, residual,
# cast, a transposed copy of the product).
XB, XK = sizes.symbol("xb"), sizes.symbol("xk")


def matmul_operand_buffers(graph: ir.Graph, node: ir.Matmul, keep: set[str]) -> set[str]:
    """Buffers the matmul loads from memory: each operand followed through
    views (pointwise nodes whose body is one unmasked load) down to a buffer
    that is kept anyway or that computes."""
    out = set()
    for ld in ir.loads(node.body):
        buf = ld.buffer
        while buf not in keep:
            producer = graph.nodes.get(buf)
            if not (isinstance(producer, ir.Pointwise) and isinstance(producer.body, ir.Load)
                    and producer.body.mask is None and not producer.body.children()):  # a gather computes
                break
            buf = producer.body.buffer
        out.add(buf)
    return out


def _bounded_body(body: ir.Expr, bounds: dict) -> ir.Expr:
    """``body`` with its load indices simplified knowing each symbol's range
    (views around a matmul leave ``i // n`` terms that are 0 or cancel)."""
    def sub(e):
        if isinstance(e, ir.Load):
            return dataclasses.replace(e, index=tuple(sizes.simplify_with_bounds(i, bounds) for i in e.index))
        return None

    return ir.rewrite(body, sub)


def matmul_kernel_bounds(node: ir.Matmul) -> dict:
    """Ranges of the kernel coordinates of a matmul kernel."""
    return {XB: sizes.numel(node.batch), XR: sizes.numel(node.m), XC: sizes.numel(node.n), XK: sizes.numel(node.k)}


def _matmul_coords(node: ir.Matmul) -> dict:
    """The matmul's own symbols in kernel coordinates."""
    dims = [(node.batch, XB), (node.m, XR), (node.n, XC)]
    coords, syms = {}, iter(node.symbols)
    for shape, flat in dims:
        for s, c in zip([next(syms) for _ in shape], sizes.unravel(flat, shape)):
            coords[s] = c
    coords.update(zip(node.reduction_symbols, sizes.unravel(XK, node.k)))
    return coords


def _matmul_group(node: ir.Matmul, body, pos) -> _Group:
    bounds = dict(zip(node.symbols, node.shape)) | dict(zip(node.reduction_symbols, node.k))
    member = Member(node, "matmul", _bounded_body(body, bounds), _matmul_coords(node))
    rows = sizes.numel(node.batch) * sizes.numel(node.m)
    return _Group("matmul", rows, sizes.numel(node.n), node, [member], pos)


def _epilogue_member(mm: ir.Matmul, m: Member) -> Member | None:
    """How a pointwise node sits in the matmul kernel's epilogue, or None: one
    value per output element. Its coordinates come from its read of the
    product (so a transposed read lands on the accumulator's own element and
    the transpose folds into the store); failing that, from its shape."""
    node = m.node
    if not isinstance(node, ir.Pointwise) or node.numel != mm.numel:
        return None
    mm_coords = _matmul_coords(mm)
    body = _bounded_body(m.body, dict(zip(node.symbols, node.shape)))
    for ld in ir.loads(body):
        if ld.buffer != mm.name:
            continue
        coords = {}
        for i, s in zip(ld.index, mm.symbols):
            if i in node.symbols and i not in coords:
                coords[i] = mm_coords[s]
            elif not (i == 0 or (i in coords and coords[i] == mm_coords[s])):
                break
        else:
            if all(s in coords or d == 1 for s, d in zip(node.symbols, node.shape)):
                coords.update({s: sympy.Integer(0) for s in node.symbols if s not in coords})
                return Member(node, "rowwise", body, coords)
    if node.shape == mm.shape:
        return Member(node, "rowwise", body, {s: mm_coords[t] for s, t in zip(node.symbols, mm.symbols)})
    linear = sizes.ravel([mm_coords[s] for s in mm.symbols], mm.shape)
    kernel_bounds = matmul_kernel_bounds(mm)
    coords = {s: sizes.simplify_with_bounds(c, kernel_bounds)
              for s, c in zip(node.symbols, sizes.unravel(linear, node.shape))}
    return Member(node, "rowwise", body, coords)


def _merge_into_matmul(mm: _Group, other: _Group, order: dict) -> _Group | None:
    """The matmul group with a pointwise group as epilogue, or None."""
    if other.kind != "pointwise":
        return None
    members = list(mm.members)
    for m in other.members:
        mm_member = _epilogue_member(mm.domain, m)
        if mm_member is None:
            return None
        members.append(mm_member)
    members.sort(key=lambda m: order[m.name])
    return _Group("matmul", mm.rows, mm.cols, mm.domain, members, min(mm.order, other.order))


class _Step:
    """A step of the program that is not a group (an extern, or a node read
    by one that no group holds): what the cycle check walks through."""

    def __init__(self, key, reads, produces):
        self.key, self._reads, self._produces = key, frozenset(reads), frozenset(produces)

    def reads(self):
        return self._reads

    def produces(self):
        return self._produces


@dataclasses.dataclass(frozen=True)
class WhyNoFuse:
    """Why ``Fuser.can_fuse`` refused to merge two groups (as Inductor's
    WhyNoFuse); false, so a refusal reads as "not legal"."""
    first: str
    second: str
    reason: str

    def __bool__(self):
        return False

    def __str__(self):
        return f"{self.first} + {self.second}: {self.reason}"


def _label(g: _Group) -> str:
    """A group as explain names it: its kind and first member (and how many more)."""
    more = f" +{len(g.members) - 1}" if len(g.members) > 1 else ""
    return f"{g.kind} {g.members[0].name}{more}"


class Fuser:
    """Greedy pairwise fusion of groups; legality (``can_fuse``) and profit
    (``fusion_score``) are separate.

    [Note: the fusion loop]
    The decision rule: merge the pair with the best score (then the first pair
    in the order the groups were made: initial groups in graph order, merged
    groups after them in order of merging), if legal; repeat until no pair with
    a nonzero score is legal. The loop finds that pair without scoring every
    pair after every merge:

    - a pair with more than (0, 1) shares a buffer (one reads what the other
      reads or writes), so those pairs come from an index of who reads and who
      writes each buffer, scored once when the younger group is made, and kept
      in a heap; an entry whose group has since merged is dropped when popped.
      A score depends on the two groups alone, so it never goes stale.
    - the (0, 1) pairs (same kind and iteration space, nothing shared: one
      launch fewer) are all pairs of a class; each class offers only its first
      legal pair, recomputed when the class changed.
    - legality is checked when a pair comes up. Only the cycle check depends on
      other groups, and merges only add paths, so a pair found illegal stays
      illegal while both groups live.
    Pairs that can never merge (two pointwise groups over different shapes, two
    reductions over different domains) are not queued at all."""

    def __init__(self, graph, groups, options: CompileOptions):
        self.graph, self.groups, self.options = graph, groups, options
        self.refusals: list[WhyNoFuse] = []
        self.producer = _producers(graph)
        self.order = {name: k for k, name in enumerate(graph.nodes)}
        self._bytes: dict[str, int] = {}
        self._steps_ready = False
        self._column_sum_counts = None  # (domain, row axes) -> partial reductions over it
        self._members: dict = {}  # _merge's members_memo

    def size(self, x) -> int:
        """A size as the heuristics see it: symbolic sizes at their hints."""
        return sizes.hint(x, self.options.size_hints)

    def tiny(self, buf: str) -> bool:
        """A buffer of one element."""
        return self.bytes_of(buf) <= 8

    def bytes_of(self, buf: str) -> int:
        out = self._bytes.get(buf)
        if out is None:
            shape, dtype = self.graph.buffer_aval(buf)
            out = self._bytes[buf] = self.size(sizes.numel(shape)) * np.dtype(dtype).itemsize
        return out

    # -- the step graph (groups and externs), kept up to date through merges -------
    def _init_steps(self):
        self._steps_ready = True
        self.step_of: dict[str, object] = {}  # buffer -> the group or step writing it
        self.readers: dict[str, dict] = {}  # buffer -> {id(step): step} reading it
        # buffer -> its readers that are not pointwise groups: all a pointwise group can
        # pair with through a scalar (``_FusionLoop._queue_neighbours``), without walking
        # the thousand pointwise readers of an optimizer's step count.
        self.other_readers: dict[str, dict] = {}
        steps = list(self.groups)
        for g in self.groups:
            for name in g.produces():
                self.step_of[name] = g
        pending = [b for g in self.groups for b in g.reads()]
        done = set(self.step_of)
        # Effectful externs run in program order (``_topological`` chains
        # them): the cycle check walks those edges too, through a token each
        # one produces and the next one reads.
        token = None
        for node in sorted((n for n in self.graph.nodes.values() if isinstance(n, ir.Extern) and n.effectful),
                           key=lambda n: self.order[n.name]):
            mark = f"{node.name}#effect"
            step = _Step(node.name, set(node.reads()) | ({token} if token else set()), set(node.outputs) | {mark})
            steps.append(step)
            for o in step.produces():
                self.step_of[o] = step
                done.add(o)
            pending.extend(node.reads())
            token = mark
        while pending:
            buf = pending.pop()
            if buf in done:
                continue
            done.add(buf)
            node = self.producer.get(buf)
            if node is None or isinstance(node, ir.InputNode):
                continue
            outs = node.outputs if isinstance(node, ir.Extern) else (node.name,)
            step = _Step(node.name, node.reads(), outs)
            steps.append(step)
            for o in outs:
                self.step_of[o] = step
                done.add(o)
            pending.extend(step.reads())
        for s in steps:
            self._add_reader(s)
        self._rank_steps(steps)

    def _rank_steps(self, steps):
        """A topological order of the step graph: ``rank[id(step)]`` grows along
        every edge ([Note: the cycle check's ranks])."""
        waiting = {id(s): 0 for s in steps}
        for s in steps:
            for c in self._consumers(s):
                waiting[id(c)] += 1
        ready = [s for s in steps if not waiting[id(s)]]
        self.rank: dict[int, int] = {}
        while ready:
            s = ready.pop()
            self.rank[id(s)] = len(self.rank)
            for c in self._consumers(s):
                waiting[id(c)] -= 1
                if not waiting[id(c)]:
                    ready.append(c)
        if len(self.rank) != len(steps):
            raise AssertionError("cycle in the step graph")

    def _add_reader(self, s):
        pointwise = isinstance(s, _Group) and s.kind == "pointwise"
        for buf in s.reads():
            self.readers.setdefault(buf, {})[id(s)] = s
            if not pointwise:
                self.other_readers.setdefault(buf, {})[id(s)] = s

    def _replace(self, a, b, merged):
        self._rerank(a, b, merged)
        for s in (a, b):
            for buf in s.reads():
                self.readers[buf].pop(id(s), None)
                self.other_readers.get(buf, {}).pop(id(s), None)
        self._add_reader(merged)
        for name in merged.produces():
            self.step_of[name] = merged

    def _rerank(self, a, b, merged):
        """Ranks for the step graph once ``a`` and ``b`` become ``merged``
        (Pearce and Kelly's reordering, for a contraction rather than a new edge):
        the steps between the two in rank that the earlier one reaches move after
        ``merged``, those that reach the later one move before it, each side
        keeping its order, over the ranks they held."""
        rank = self.rank
        lo, hi = (a, b) if rank[id(a)] < rank[id(b)] else (b, a)
        r_lo, r_hi = rank[id(lo)], rank[id(hi)]
        after = self._window(lo, r_lo, r_hi, forward=True)
        before = self._window(hi, r_lo, r_hi, forward=False)
        if after.keys() & before.keys():  # can_fuse refuses such a pair
            raise AssertionError("merging two groups with a path through another")
        key = rank.__getitem__
        moved = sorted(before, key=key) + [None] + sorted(after, key=key)
        slots = sorted([r_lo, r_hi] + [rank[k] for k in before] + [rank[k] for k in after])
        slots.pop(len(before) + 1)  # two steps become one: one rank is left unused
        for k, r in zip(moved, slots):
            rank[id(merged) if k is None else k] = r
        del rank[id(a)], rank[id(b)]

    def _window(self, start, r_lo, r_hi, forward: bool) -> dict:
        """Steps ranked strictly between ``r_lo`` and ``r_hi`` that ``start``
        reaches (``forward``) or that reach it, by id."""
        rank, seen, stack = self.rank, {}, [start]
        while stack:
            s = stack.pop()
            for t in (self._consumers(s) if forward else self._producers_of(s)):
                k = id(t)
                if k not in seen and r_lo < rank[k] < r_hi:
                    seen[k] = t
                    stack.append(t)
        return seen

    def _consumers(self, s) -> list:
        return [r for buf in s.produces() for r in self.readers.get(buf, {}).values()]

    def _producers_of(self, s) -> list:
        return [p for buf in s.reads() if (p := self.step_of.get(buf)) is not None]

    # -- legality ------------------------------------------------------------------
    def can_fuse(self, a: _Group, b: _Group) -> _Group | WhyNoFuse:
        """The group holding both, or why they cannot share a kernel (a false
        ``WhyNoFuse``, also kept in ``refusals``)."""
        merged = _merge(a, b, self.order, self._members)
        if merged is None:
            return self._refuse(a, b, "their iteration spaces differ")
        if merged.kind == "mix" and any(m.role in ("reduction", "row") for m in merged.members):
            # Mix-order fusion: whole rows must fit in one tile (the row
            # reductions are persistent) and the option must allow it.
            if not self.options.mix_order_reduction:
                return self._refuse(a, b, "mix-order reduction is off (option mix_order_reduction)")
            if sizes.is_symbolic(merged.cols) or not heuristics.fits_in_tile(merged.cols,
                                                                             self.options.max_persistent_cols):
                return self._refuse(a, b, "a mix kernel's rows must fit one tile (static, at most "
                                          "max_persistent_cols)")
        if merged.kind == "matmul" and self.options.matmul_template == "unfused":
            # epilogue fusion is off: the matmul kernel stores its product alone
            return self._refuse(a, b, "epilogue fusion is off (matmul_template='unfused')")
        if not _merged_reads_ok(merged, a, b):
            return self._refuse(a, b, ("a member would read another's result inside the kernel in a way it "
                                          "cannot (a row-wise value, a masked load, another element)"))
        if self._path_through_other(a, b) or self._path_through_other(b, a):
            return self._refuse(a, b, "one depends on the other through another kernel or an XLA op")
        return merged

    def _refuse(self, a: _Group, b: _Group, reason: str) -> WhyNoFuse:
        why = WhyNoFuse(_label(a), _label(b), reason)
        self.refusals.append(why)
        return why

    def _path_through_other(self, src: _Group, dst: _Group) -> bool:
        """Does ``dst`` depend on ``src`` through a step that is neither?
        Searches forward from ``src`` and backward from ``dst`` at once,
        always widening the smaller side, until the two meet or one runs out;
        only steps ranked between the two can lie on such a path.

        [Note: the cycle check's ranks]
        ``rank`` is a topological order of the step graph (groups and the steps
        between them), so every path runs up in rank: ``dst`` can depend on
        ``src`` only if it ranks higher, and through steps ranked between them.
        Node positions cannot stand in for it: a group holds nodes from far apart
        in the graph, so a path between groups need not run forward in node
        order. A merge keeps the order valid (``_rerank``), moving only steps
        ranked between the two groups."""
        if not self._steps_ready:
            self._init_steps()
        rank = self.rank
        r_lo, r_hi = rank[id(src)], rank[id(dst)]
        if r_lo >= r_hi:
            return False
        fwd = {id(s): s for s in self._consumers(src) if r_lo < rank[id(s)] < r_hi}
        if not fwd:
            return False
        bwd = {id(s): s for s in self._producers_of(dst) if r_lo < rank[id(s)] < r_hi}
        if not bwd:
            return False
        f_front, b_front = list(fwd.values()), list(bwd.values())
        while True:
            if fwd.keys() & bwd.keys():
                return True
            if not f_front or not b_front:
                return False
            forward = len(f_front) <= len(b_front)
            seen, front = (fwd, f_front) if forward else (bwd, b_front)
            nxt = []
            for s in front:
                for t in (self._consumers(s) if forward else self._producers_of(s)):
                    k = id(t)
                    if k not in seen and r_lo < rank[k] < r_hi:
                        seen[k] = t
                        nxt.append(t)
            if forward:
                f_front = nxt
            else:
                b_front = nxt

    # -- profit ---------------------------------------------------------------------
    def fusion_score(self, a: _Group, b: _Group) -> tuple[int, int]:
        """(bytes no longer read twice or round-tripped, launches saved); (0, 0):
        not worth it. Groups over the same iteration space that share nothing
        still save a launch (the finishing sums of a norm backward's dw and db)."""
        if self._adds_row_work_to_mix(a, b) and not heuristics.mix_worthwhile(
                self.size(a.rows), self.size(a.cols), self.options.num_sms, self._column_sums(a, b)):
            return 0, 0  # too few rows to spread the row work over the persistent grid
        if "matmul" in (a.kind, b.kind):
            return self._matmul_score(a, b)
        ar, br = a.reads(), b.reads()
        shared = (ar & br) | (a.produces() & br) | (b.produces() & ar)
        if _class_of(a) is not None and _class_of(a) == _class_of(b):
            # A scalar both read (an optimizer's step count) saves nothing; the
            # class's (0, 1) pairs come from the class, not from its readers.
            shared = {s for s in shared if not self.tiny(s) or s in a.produces() or s in b.produces()}
        saved = sum(self.bytes_of(s) for s in shared)
        if saved == 0 and (a.kind, a.domain) != (b.kind, b.domain):
            return 0, 0
        if saved == 0 and len(a.members) + len(b.members) > heuristics.HORIZONTAL_MAX_MEMBERS:
            return 0, 0  # a launch saved for a body per member: combos join them with shared code
        if saved == 0 and self.options.combo_kernels and a.kind == "pointwise":
            # Nothing shared: a combo kernel (lowering/combo.py) runs both in one launch,
            # each over programs of its own, instead of every program loading both.
            return 0, 0
        return saved, 1

    def _column_sums(self, a: _Group, b: _Group) -> int:
        """Column reductions (split into partials) over the mix group's domain:
        what the finished mix kernel accumulates, as split.py counted them."""
        mix = a if a.kind == "mix" else b
        if self._column_sum_counts is None:  # the graph does not change while groups merge
            self._column_sum_counts = collections.Counter(
                (n.domain, n.row_axes) for n in self.graph.nodes.values() if isinstance(n, ir.PartialReduction))
        return self._column_sum_counts[mix.domain]

    @staticmethod
    def _adds_row_work_to_mix(a: _Group, b: _Group) -> bool:
        """Would merging make a mix kernel hold whole rows (row reductions or
        per-row values)? Row-wise pointwise work over its domain does not."""
        if "mix" not in (a.kind, b.kind) or a.kind == b.kind:
            return False
        mix, other = (a, b) if a.kind == "mix" else (b, a)
        return other.kind == "reduction" or other.domain != mix.domain[0]

    def _matmul_score(self, a: _Group, b: _Group) -> tuple[int, int]:
        """Epilogue fusion: worth the bytes of the matmul's results the other
        group reads (no longer written and read back), plus the epilogue's
        inputs both read. A group that reads none of the matmul kernel's
        results gains nothing: the operands are read tile by tile in the K
        loop, so sharing them saves no traffic."""
        mm, other = (a, b) if a.kind == "matmul" else (b, a)
        if other.kind != "pointwise":
            return 0, 0
        results = mm.produces() & other.reads()
        if not results:
            return 0, 0
        epilogue_reads = {ld.buffer for m in mm.members if m.role != "matmul" for ld in ir.loads(m.body)}
        saved = sum(self.bytes_of(s) for s in results | (epilogue_reads & other.reads()))
        return saved, 1

    # -- driver ----------------------------------------------------------------------
    def run(self) -> list[_Group]:
        if not self.options.fusion:
            return self.groups
        self._init_steps()
        return _FusionLoop(self).run()


def _class_of(g: _Group, combos: bool = False):
    """Pairs of one class score at least (0, 1) whatever they share; None: no class.
    ``combos``: pointwise groups have none (``Fuser.fusion_score``)."""
    return None if g.kind in ("matmul", "scatter") or (combos and g.kind == "pointwise") else (g.kind, g.domain)


def _never_fuse(a: _Group, b: _Group) -> bool:
    """Iteration spaces that ``_merge`` always refuses (a cheap filter: it
    only keeps pairs out of the queue that could never be chosen)."""
    if a.kind == "pointwise" and b.kind == "pointwise":
        return a.domain != b.domain
    if "scatter" in (a.kind, b.kind):
        return True
    if "pointwise" in (a.kind, b.kind):
        return False
    if "matmul" in (a.kind, b.kind):
        return True
    return a.domain != b.domain


class _FusionLoop:
    """The driver of [Note: the fusion loop]."""

    _TIE = (0, 1)

    def __init__(self, fuser: Fuser):
        self.f = fuser
        self.combos = fuser.options.combo_kernels
        self.seq: dict[int, int] = {}  # id(group) -> its place in the order groups were made
        self.alive: dict[int, _Group] = {}
        self.illegal: set[tuple[int, int]] = set()  # (seq, seq) pairs found illegal
        self.heap: list = []
        self.classes: dict = {}  # class -> [seq, ...] (may hold dead groups, dropped on refresh)
        self.dirty: set = set()
        self.offered: dict = {}  # class -> the (seq, seq) pair it offers
        self.verified: dict = {}  # (seq, seq) -> merged group, legal since the last merge
        self.next_seq = 0
        for g in fuser.groups:
            self._add(g)
        for g in fuser.groups:
            self._queue_neighbours(g, older_only=True)

    def _cls(self, g):
        return _class_of(g, self.combos)

    def _add(self, g):
        s = self.next_seq
        self.next_seq += 1
        self.seq[id(g)] = s
        self.alive[s] = g
        c = self._cls(g)
        if c is not None:
            self.classes.setdefault(c, []).append(s)
            self.dirty.add(c)
        return s

    def _queue_neighbours(self, g, older_only=False):
        """Queue ``g`` with every live group it shares a buffer with."""
        f, sg = self.f, self.seq[id(g)]
        others = {}
        cls = _class_of(g)
        for buf in g.reads():
            tiny = cls is not None and f.tiny(buf)
            # A scalar's pointwise readers: this class's are skipped below, other domains never fuse.
            readers = f.other_readers if tiny and g.kind == "pointwise" else f.readers
            for r in readers.get(buf, {}).values():
                if tiny and isinstance(r, _Group) and _class_of(r) == cls:
                    continue  # sharing a scalar read: scored as the class's pair (fusion_score)
                others[id(r)] = r
            p = f.step_of.get(buf)
            if p is not None:
                others[id(p)] = p
        for buf in g.produces():
            for r in f.readers.get(buf, {}).values():
                others[id(r)] = r
        for o in others.values():
            so = self.seq.get(id(o))
            if so is None or o is g or so not in self.alive or (older_only and so > sg):
                continue
            if _never_fuse(g, o):
                continue
            a, b = (o, g) if so < sg else (g, o)
            score = f.fusion_score(a, b)
            if score == (0, 0):
                continue
            heapq.heappush(self.heap, (-score[0], -score[1], min(so, sg), max(so, sg)))

    def _legal(self, sa, sb):
        """The merged group of a live pair if legal now, else None (remembered)."""
        if (sa, sb) in self.illegal:
            return None
        hit = self.verified.get((sa, sb))
        if hit is not None:
            return hit
        merged = self.f.can_fuse(self.alive[sa], self.alive[sb])
        if not merged:  # a WhyNoFuse
            self.illegal.add((sa, sb))
            return None
        self.verified[(sa, sb)] = merged
        return merged

    def _refresh(self, c):
        """Offer the class's first legal pair (in the order groups were made)."""
        cap = heuristics.HORIZONTAL_MAX_MEMBERS  # fusion_score's cap on pairs that share nothing
        members = [s for s in self.classes[c] if s in self.alive and len(self.alive[s].members) < cap]
        self.classes[c] = members
        self.offered.pop(c, None)
        for i, sa in enumerate(members):
            for sb in members[i + 1:]:
                if len(self.alive[sa].members) + len(self.alive[sb].members) > cap:
                    continue
                if self._legal(sa, sb) is not None:
                    self.offered[c] = (sa, sb)
                    heapq.heappush(self.heap, (-self._TIE[0], -self._TIE[1], sa, sb))
                    return

    def run(self) -> list[_Group]:
        while True:
            if self.dirty and (not self.heap or (-self.heap[0][0], -self.heap[0][1]) <= self._TIE):
                for c in self.dirty:
                    self._refresh(c)
                self.dirty.clear()
                continue
            if not self.heap:
                break
            _, _, sa, sb = heapq.heappop(self.heap)
            if sa not in self.alive or sb not in self.alive:
                continue
            a, b = self.alive[sa], self.alive[sb]
            merged = self._legal(sa, sb)
            if merged is None:
                for g in (a, b):
                    c = self._cls(g)
                    if c is not None and self.offered.get(c) == (sa, sb):
                        self.dirty.add(c)
                continue
            self._merge(a, b, merged)
        return [self.alive[s] for s in sorted(self.alive)]

    def _merge(self, a, b, merged):
        self.verified = {}
        for g in (a, b):
            del self.alive[self.seq[id(g)]]
            c = self._cls(g)
            if c is not None:
                self.dirty.add(c)
        self._add(merged)
        self.f._replace(a, b, merged)
        self._queue_neighbours(merged)


# --------------------------------------------------------------------------- #
# 4. Order
# --------------------------------------------------------------------------- #
def schedule(graph: ir.Graph, options: CompileOptions, loop_body: bool = False, combine=None) -> Schedule:
    """The graph's kernels and externs in program order. ``combine``: the combo
    pass (``lowering.combo.combine``, which builds on this module's Kernel), run
    over the fused kernels."""
    n_before = sum(1 for n in graph.nodes.values() if not isinstance(n, ir.InputNode))
    graph = split_reductions(graph, options)
    live = live_nodes(graph)
    graph = run_views_in_xla(graph, live)  # [Note: views between XLA ops]
    keep = materialized(graph, live, options)
    inliner = _Inliner(graph, keep)
    fuser = Fuser(graph, build_groups(graph, keep, live, inliner), options)
    groups = fuser.run()

    externs = [n for n in graph.nodes.values() if isinstance(n, ir.Extern) and n.name in live]
    outputs = {o for o in graph.outputs if isinstance(o, str)}
    needed_outside = set(outputs)
    for e in externs:
        needed_outside.update(e.reads())
    for g in groups:
        needed_outside.update(g.reads())
    for g in groups:
        for m in g.members:
            m.store = m.name in needed_outside

    steps = _topological(groups, externs, graph)
    kernels = []
    for k, step in enumerate(steps):
        if isinstance(step, _Group):
            kernels.append(_to_kernel(step, k, graph, keep))
        else:
            kernels.append(step)
    if combine is not None:
        kernels = combine(kernels, graph, options, loop_body)
    stored = set(graph.inputs)
    for s in kernels:
        stored.update(s.stores if isinstance(s, Kernel) else s.outputs)
    return Schedule(graph, kernels, stored, n_before, len(kernels), fuser.refusals)


def _topological(groups, externs, graph):
    """Steps in dependency order, the earliest in the graph first among those
    whose inputs are ready."""
    steps = list(groups) + list(externs)
    prod = {}
    for s in steps:
        for name in (s.produces() if isinstance(s, _Group) else s.outputs):
            prod[name] = s
    position = {name: k for k, name in enumerate(graph.nodes)}
    order_key = {id(s): (s.order if isinstance(s, _Group) else position[s.name]) for s in steps}
    deps = {id(s): {id(prod[r]) for r in s.reads() if r in prod and prod[r] is not s} for s in steps}
    # Effects run in program order (two prints print in order): each waits for the one before.
    effects = sorted((s for s in externs if s.effectful), key=lambda s: position[s.name])
    for before, after in zip(effects, effects[1:]):
        deps[id(after)].add(id(before))
    users = {id(s): [] for s in steps}
    waiting = {}
    for s in steps:
        waiting[id(s)] = len(deps[id(s)])
        for d in deps[id(s)]:
            users[d].append(s)
    ready = [(order_key[id(s)], k, s) for k, s in enumerate(steps) if not waiting[id(s)]]
    heapq.heapify(ready)
    out, tie = [], itertools.count(len(steps))  # a unique second key: steps never compare
    while ready:
        _, _, s = heapq.heappop(ready)
        out.append(s)
        for u in users[id(s)]:
            waiting[id(u)] -= 1
            if not waiting[id(u)]:
                heapq.heappush(ready, (order_key[id(u)], next(tie), u))
    if len(out) != len(steps):
        raise AssertionError("cycle in schedule")
    return out


def _to_kernel(g: _Group, index: int, graph, keep=frozenset()) -> Kernel:
    ops = []
    for m in g.members:
        for op, _ in ir.op_counts(m.body):
            if op not in ops and op not in ("convert_element_type", "dot_general"):
                ops.append(op)
        if isinstance(m.node, (ir.Reduction, ir.PartialReduction)):
            ops.append(m.node.op)
    prefix = {"reduction": "red", "pointwise": "poi", "mix": "mix", "matmul": "mm", "scatter": "sca"}[g.kind]
    name = f"{prefix}_fused_{'_'.join(ops[:4]) or 'copy'}_{index}"
    if g.kind == "matmul" and not ops:
        name = f"mm_{index}"
    if g.kind == "scatter":
        name = f"scatter_{g.members[0].node.combine}_{index}"
    origin = []
    for m in g.members:
        origin += [o for o in _origins(graph, m, keep) if o not in origin]
    programs = max((m.node.programs for m in g.members if m.role == "column"), default=0)
    rows, cols, members = g.rows, g.cols, g.members
    if g.kind == "pointwise":
        rows, cols, members = _pointwise_iteration(g, graph)
    return Kernel(name, g.kind, rows, cols, members, sorted(g.reads()), origin, programs)


def _pointwise_iteration(g: _Group, graph) -> tuple[int, int, list[Member]]:
    """Rows x columns of a pointwise kernel.

    A pointwise group iterates its shape flat (one row) unless some load
    reads memory in another order than the kernel stores it:

    - a broadcast operand: a per-channel scale ``s[c]`` read by a kernel over
      (n, h, w, c) is a ``% c`` gather in flat iteration, but a (1, BLOCK_C)
      load when the domain is split into rows (n, h, w) and columns (c). Such
      a load votes for the split that makes it depend on the rows alone or
      the columns alone (its dims are exactly a prefix or a suffix of the
      shape; size-1 dims do not count);
    - a transposed operand: its contiguous (last) dim is the domain's dim
      ``d``, not the domain's last dim. Splitting after ``d`` makes the load
      contiguous along rows and the store along columns; on a square tile
      Triton exchanges the two through shared memory (a tiled transpose).
      These votes count double: an uncoalesced load costs a memory
      transaction per element, a broadcast gather hits the cache.

    The split with the most votes wins (ties: the one with more columns)."""
    shape = g.domain
    wide = [k for k in range(len(shape)) if shape[k] != 1]
    produced = g.produces()
    votes: dict[int, int] = {}
    for m in g.members:
        pos = {s: k for k, s in enumerate(m.node.symbols)}
        for ld in ir.loads(m.body):
            if ld.buffer in produced:
                continue
            dims = [{pos[s] for s in getattr(sympy.sympify(i), "free_symbols", ()) if s in pos} & set(wide)
                    for i in ld.index]
            used = set().union(*dims) if dims else set()
            if not used:
                continue
            if used != set(wide):
                if used == set(wide[:len(used)]):  # a prefix: one value per row
                    split = wide[len(used) - 1] + 1
                elif used == set(wide[-len(used):]):  # a suffix: one value per column
                    split = wide[-len(used)]
                else:
                    continue
                votes[split] = votes.get(split, 0) + 1
                continue
            buf_shape, _ = graph.buffer_aval(ld.buffer)
            inner = [d for d, n in zip(dims, buf_shape) if n != 1]
            if inner and len(inner[-1]) == 1 and wide and min(inner[-1]) != wide[-1]:
                split = min(inner[-1]) + 1
                votes[split] = votes.get(split, 0) + 2
    if not votes:
        return g.rows, g.cols, g.members
    split = max(votes, key=lambda k: (votes[k], -k))
    rows, cols = shape[:split], shape[split:]
    members = [dataclasses.replace(m, coords=dict(zip(m.node.symbols, sizes.unravel(XR, rows) + sizes.unravel(XC, cols))))
               for m in g.members]
    return sizes.numel(rows), sizes.numel(cols), members


def _origins(graph, m: Member, keep=frozenset()) -> list[str]:
    """Equations behind a member: its own and those of the nodes inlined into
    it (not those of materialized buffers it reads: ``keep``)."""
    out = list(m.node.origin)
    seen = {m.name}
    stack = list(m.node.reads())
    while stack:
        b = stack.pop()
        if b in seen or b not in graph.nodes or b in keep:
            continue
        seen.add(b)
        n = graph.nodes[b]
        if isinstance(n, ir.Pointwise):
            out += list(n.origin)
            stack += n.reads()
    return out


def format_schedule(s: Schedule) -> str:
    """The schedule as text: each kernel with its members, each extern."""
    lines = []
    for step in s.steps:
        if isinstance(step, ir.Extern):
            lines.append(step.format())
            continue
        lines.append(f"kernel {step.name} ({step.kind} {step.rows}x{step.cols}) reads {', '.join(step.reads)}")
        for part in getattr(step, "parts", ()):  # a combo kernel: its members, each as it would run alone
            lines.append(f"  member {part.name} ({part.kind} {part.rows}x{part.cols}) reads {', '.join(part.reads)}")
            for m in part.members:
                lines.append(f"    {'store' if m.store else 'keep '} {m.role:9s} {m.name}: {ir.format_expr(m.body)}")
        for m in [] if getattr(step, "parts", ()) else step.members:
            lines.append(f"  {'store' if m.store else 'keep '} {m.role:9s} {m.name}: {ir.format_expr(m.body)}")
    return "\n".join(lines)
