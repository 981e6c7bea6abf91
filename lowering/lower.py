"""jaxpr → IR graph: walk the equations, inline call bodies, apply one lowering
rule per equation; equations without a rule become ``Extern`` nodes."""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import numpy as np
import sympy
from jax.extend import core as jex_core

from lowering import ir, loops, sizes, symbolic, trace
from lowering.options import CompileOptions
from lowering.rules import RULES, PreferXLA, prng
from lowering.rules.matmul import gemm_operands

log = logging.getLogger("pallaskit")


class LoweringContext:
    """What rules see: value loading and node creation."""

    def __init__(self, options: CompileOptions | None = None):
        self.options = options or CompileOptions()  # rules that depend on an option (dot_general)
        self.nodes: dict[str, ir.Node] = {}
        self.inputs: list[str] = []
        self.constants: dict[str, np.ndarray] = {}
        self.current_eqn: str = ""
        self.var_names = trace.VarNames()
        self._count = 0
        self.in_loop_body = False  # lowering a loop's body ([Note: loop bodies] in loops.py)

    def child(self) -> LoweringContext:
        """A context for a nested jaxpr (a loop body, [Note: loop bodies]): a
        graph of its own, this one's names and name counter."""
        sub = LoweringContext(self.options)
        sub._count = self._count  # one counter: body names never shadow outer ones
        sub.var_names = self.var_names
        sub.in_loop_body = True
        return sub

    def const_input(self, c):
        """A constant of the jaxpr as a value: a literal, or an input holding it."""
        return _const_input(self, c)

    def lower_jaxpr(self, jaxpr, consts, args, fallbacks) -> list:
        """Lower ``jaxpr`` into this context; its outputs' values."""
        return _lower_jaxpr(self, jaxpr, consts, args, fallbacks)

    # -- names and symbols ------------------------------------------------------
    def new_name(self, prefix="buf") -> str:
        name = f"{prefix}{self._count}"
        self._count += 1
        return name

    @staticmethod
    def symbols(n: int, prefix: str = "i"):
        return sizes.index_symbols(prefix, n)

    # -- values -----------------------------------------------------------------
    def aval_of(self, value):
        if isinstance(value, ir.Const):
            return (), value.dtype
        n = self.nodes[value] if value in self.nodes else None
        if n is not None:
            return n.shape, n.dtype
        for node in self.nodes.values():
            if isinstance(node, ir.Extern) and value in node.outputs:
                a = node.out_avals[node.outputs.index(value)]
                return tuple(a.shape), np.dtype(a.dtype)
        raise KeyError(value)

    def load(self, value, index, mask=None) -> ir.Expr:
        """The expression reading ``value`` at ``index``; scalar operands of
        elementwise ops broadcast (their index is dropped)."""
        if isinstance(value, ir.Const):
            return value
        shape, dtype = self.aval_of(value)
        if len(shape) == 0:
            index = ()
        elif len(index) != len(shape):
            raise ValueError(f"index {index} does not match {value}{list(shape)}")
        try:
            index = _load_index(tuple(index), tuple(shape))
        except TypeError:  # an unhashable index entry
            index = _load_index.__wrapped__(tuple(index), tuple(shape))
        return ir.Load(value, index, dtype, mask)

    def inlined(self, e: ir.Expr, depth: int = 4) -> ir.Expr:
        """``e`` with the pointwise nodes it loads (unmasked) inlined at the loads'
        indices, ``depth`` levels deep: what a rule may look through to recognize
        a pattern (``iota == labels`` behind its broadcasts)."""
        if depth == 0:
            return e
        node = self.nodes.get(e.buffer) if isinstance(e, ir.Load) and e.mask is None else None
        if isinstance(node, ir.Pointwise):
            return self.inlined(ir.substitute_index(node.body, dict(zip(node.symbols, e.index))), depth - 1)
        if isinstance(e, ir.Op):
            return ir.Op(e.op, tuple(self.inlined(a, depth - 1) for a in e.args), e.dtype, e.params)
        return e

    # -- nodes ------------------------------------------------------------------
    def _add(self, node):
        self.nodes[node.name] = node
        return node.name

    def pointwise(self, aval, body, view=None) -> str:
        dtype = np.dtype(aval.dtype)
        if body.dtype != dtype:
            body = ir.Op("convert_element_type", (body,), dtype, (("new_dtype", dtype),))
        return self._add(ir.Pointwise(self.new_name(), tuple(aval.shape), dtype, (self.current_eqn,), body=body,
                                      view=view))

    def matmul(self, aval, body, **dims) -> str:
        return self._add(ir.Matmul(self.new_name(), tuple(aval.shape), np.dtype(aval.dtype), (self.current_eqn,),
                                   body=body, **dims))

    def reduction(self, aval, body, *, reduced, axes, op) -> str:
        node = ir.Reduction(self.new_name(), tuple(aval.shape), np.dtype(aval.dtype), (self.current_eqn,),
                            body=body, reduced=tuple(reduced), axes=tuple(axes), op=op)
        return self._add(node)

    def scatter(self, shape, dtype, operand: str, body, domain, combine: str) -> str:
        """[Note: atomic scatters] in ir.py."""
        return self._add(ir.Scatter(self.new_name(), tuple(shape), np.dtype(dtype), (self.current_eqn,),
                                    body=body, operand=operand, domain=tuple(domain), combine=combine))

    def extern(self, eqn, args, params=None) -> list[str]:
        """``params``: the equation's, unless given (a dot_general with permuted operands)."""
        if symbolic.params_symbolic(eqn.params):
            # XLA would need the concrete size inside the parameter (a gather's
            # slice sizes, a broadcast's shape): no shape-generic program.
            raise symbolic.SymbolicUnsupported(f"{eqn.primitive.name} runs through XLA with a symbolic shape parameter")
        names = [self.new_name() for _ in eqn.outvars]
        # A collective's NamedAxisEffect names the mesh axis it runs over, not a
        # side effect: it may be dropped when dead and needs no program order.
        out_avals = tuple(symbolic.aval_view(v.aval) for v in eqn.outvars)
        if out_avals:
            name, shape, dtype = names[0], tuple(getattr(out_avals[0], "shape", ())), _safe_dtype(out_avals[0])
        else:  # an effect with no results (debug_print, a callback returning nothing)
            name, shape, dtype = self.new_name("effect"), (), np.dtype("V")
        node = ir.Extern(name, shape, dtype, (self.current_eqn,),
                         primitive=eqn.primitive, params=dict(eqn.params if params is None else params),
                         inputs=tuple(args),
                         outputs=tuple(names), out_avals=out_avals,
                         effectful=any(type(e).__name__ != "NamedAxisEffect" for e in eqn.effects))
        self._add(node)
        return names

    def input(self, aval, prefix="arg") -> str:
        name = self.new_name(prefix)
        self.nodes[name] = ir.InputNode(name, tuple(aval.shape), _safe_dtype(aval))
        self.inputs.append(name)
        return name


def _safe_dtype(aval):
    try:
        return np.dtype(aval.dtype)
    except TypeError:
        return np.dtype("V")  # extended dtype: only externs touch it


@dataclasses.dataclass
class LoweredGraph:
    graph: ir.Graph
    fallbacks: list[str]  # primitive names run through XLA, in first-seen order


def lower(closed: jex_core.ClosedJaxpr, options: CompileOptions | None = None) -> LoweredGraph:
    """Lower a closed jaxpr to an IR graph. Its constants become graph inputs
    (hoisted), listed after the arguments in ``graph.constants``."""
    ctx = LoweringContext(options)
    fallbacks: list[str] = []
    args = [ctx.input(symbolic.aval_view(v.aval)) for v in closed.jaxpr.invars]
    consts = []
    for c in closed.consts:
        name = ctx.input(jax.typeof(c), prefix="const")
        ctx.constants[name] = c
        consts.append(name)
    outs = _lower_jaxpr(ctx, closed.jaxpr, consts, args, fallbacks)
    outs = [prng.key_value(ctx, o, v.aval) for o, v in zip(outs, closed.jaxpr.outvars)]  # [Note: key values]
    graph = ir.Graph(inputs=list(ctx.inputs), nodes=ctx.nodes, outputs=list(outs), constants=ctx.constants,
                     weak_outputs=tuple(bool(getattr(v.aval, "weak_type", False)) for v in closed.jaxpr.outvars))
    return LoweredGraph(graph, fallbacks)


def _literal(lit) -> ir.Const:
    return ir.Const(np.asarray(lit.val).item(), np.dtype(lit.aval.dtype))


def _lower_jaxpr(ctx, jaxpr, consts, args, fallbacks, live_outs=None):
    """The jaxpr's outputs lowered; ``live_outs``: which of them the caller reads
    (an inlined call's dead outputs come back None, their equations skipped)."""
    live_outs = [True] * len(jaxpr.outvars) if live_outs is None else live_outs
    env = {}
    for v, val in zip(jaxpr.constvars, consts):
        env[v] = val
    for v, val in zip(jaxpr.invars, args):
        env[v] = val

    def read(v):
        if isinstance(v, jex_core.Literal):
            if np.shape(v.val) == ():
                return _literal(v)
            raise NotImplementedError("non-scalar literal")
        return env[v]

    eqns, live = _live_equations(_fold_transposed_dots(jaxpr), [v for v, keep in zip(jaxpr.outvars, live_outs) if keep])
    for eqn in eqns:
        body = trace.inlined_body(eqn)
        if body is not None:
            sub_jaxpr, sub_consts, first = body
            const_vals = [_const_input(ctx, c) for c in sub_consts]
            args = [read(v) if isinstance(v, jex_core.Literal) or v in env else None  # None: dead in the body
                    for v in eqn.invars[first:]]
            outs = _lower_jaxpr(ctx, sub_jaxpr, const_vals, args, fallbacks, [v in live for v in eqn.outvars])
        else:
            outs = _lower_eqn(ctx, eqn, [read(v) for v in eqn.invars], fallbacks)
        for v, val in zip(eqn.outvars, outs):
            env[v] = val
    return [read(v) if keep else None for v, keep in zip(jaxpr.outvars, live_outs)]


def _live_equations(eqns, outvars) -> tuple[list, set]:
    """The equations an output or an effect depends on, and the variables they read or
    write that are live. The scheduler drops dead nodes anyway, but a dead extern (flax's
    RNN splits a PRNG key it never uses; a platform_dependent cond's index passed between
    the forward and backward calls of jnp.diagonal's gradient) would be logged as a
    primitive run through XLA."""
    live = {v for v in outvars if not isinstance(v, jex_core.Literal)}
    kept = []
    for eqn in reversed(eqns):
        if eqn.effects or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in _operands_read(eqn, live) if not isinstance(v, jex_core.Literal))
    return kept[::-1], live


def _operands_read(eqn, live) -> list:
    """The operands a live equation reads: an inlined body's live part may read
    fewer (a platform branch never reads its cond's index)."""
    body = trace.inlined_body(eqn)
    if body is None or eqn.effects:
        return list(eqn.invars)
    sub, _, first = body
    _, sub_live = _live_equations(sub.eqns, [o for o, v in zip(sub.outvars, eqn.outvars) if v in live])
    return [v for v, b in zip(eqn.invars[first:], sub.invars) if b in sub_live]


def _fold_transposed_dots(jaxpr) -> list:
    """The jaxpr's equations, with ``transpose(dot_general(a, b))`` that swaps
    the two operands' free dims written as ``dot_general(b, a)``.

    Reverse mode writes weight gradients that way (``dw = (dy^T x)^T``). An
    XLA extern cannot take the transpose into its output, so it would cost a
    copy kernel over the gradient; swapped operands produce it in place. Only
    when the product has no other use."""
    uses: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not isinstance(v, jex_core.Literal):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not isinstance(v, jex_core.Literal):
            uses[v] = uses.get(v, 0) + 1
    producer = {e.outvars[0]: e for e in jaxpr.eqns if e.primitive.name == "dot_general"}
    replace, drop = {}, set()
    for e in jaxpr.eqns:
        dot = producer.get(e.invars[0]) if e.primitive.name == "transpose" else None
        if dot is None or uses.get(e.invars[0]) != 1:
            continue
        (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
        lhs, rhs = (v.aval for v in dot.invars)
        nb, nl = len(lb), len(lhs.shape) - len(lc) - len(lb)
        nr = len(rhs.shape) - len(rc) - len(rb)
        swapped = tuple(range(nb)) + tuple(range(nb + nl, nb + nl + nr)) + tuple(range(nb, nb + nl))
        if tuple(e.params["permutation"]) != swapped:
            continue
        params = dict(dot.params, dimension_numbers=((rc, lc), (rb, lb)))
        if isinstance(params.get("precision"), tuple):
            params["precision"] = params["precision"][::-1]
        replace[id(dot)] = dot.replace(invars=dot.invars[::-1], outvars=e.outvars, params=params)
        drop.add(id(e))
    return [replace.get(id(e), e) for e in jaxpr.eqns if id(e) not in drop]


def _const_input(ctx, c):
    aval = jax.typeof(c)
    if np.shape(c) == () and symbolic.is_plain(aval):
        v = np.asarray(c)
        return ir.Const(v.item(), v.dtype)
    name = ctx.input(aval, prefix="const")
    ctx.constants[name] = c
    return name


@functools.lru_cache(maxsize=1 << 14)
def _load_index(index: tuple, shape: tuple) -> tuple:
    # Memoized: the loads of a program's equations repeat a few (index, shape) pairs.
    return tuple(sympy.Integer(0) if d == 1 else sizes.simplify(sympy.sympify(i)) for i, d in zip(index, shape))


def _lower_eqn(ctx, eqn, invals, fallbacks):
    ctx.current_eqn = trace.equation_text(eqn, ctx.var_names)
    xla_loop = False  # a loop left to XLA by choice (loop_bodies_heavy_only): not a fallback
    if ctx.options.loop_bodies and eqn.primitive.name in loops.KINDS:  # bodies compiled as programs of their own ([Note: loop bodies])
        xla_loop = not loops.worth_compiling(eqn, ctx.options)
        outs = None if xla_loop else loops.lower_loop(ctx, eqn, invals, fallbacks)
        if outs is not None:
            return outs
    rule = RULES.get(eqn.primitive.name)
    # Symbolic dims: rules see sympy sizes ([Note: symbolic dims]); externs get the equation itself.
    view = symbolic.EqnView(eqn) if symbolic.eqn_symbolic(eqn) else eqn
    avals = [v.aval for v in view.invars] + [v.aval for v in view.outvars]
    keys = eqn.primitive.name in prng.KEY_PRIMITIVES  # rules that take threefry keys ([Note: key values])
    if rule is not None and not eqn.effects and all(
            symbolic.is_plain(a) or (keys and prng.is_threefry_key(a)) for a in avals):
        try:
            return rule.fn(ctx, view, *invals)
        except PreferXLA:
            return _extern(ctx, eqn, invals)
        except NotImplementedError:
            pass
    if rule is not None and eqn.primitive.name in prng.KEY_SHAPE_PRIMITIVES and prng.touches_keys(eqn):
        outs = prng.lower_key_shape_eqn(ctx, eqn, invals, rule)  # split keys picked apart
        if outs is not None:
            return outs
    if prng.touches_keys(eqn):  # an extern takes keys as keys, not as the data a rule made
        invals = [prng.key_value(ctx, x, v.aval) for x, v in zip(invals, eqn.invars)]
    # Literal operands of an extern must be real arrays. An empty operand or
    # result (an optimizer's (0,)-shaped leaf) is no work for a kernel: not a fallback.
    if eqn.primitive.name not in fallbacks and not any(_empty(a) for a in avals) and not xla_loop:
        fallbacks.append(eqn.primitive.name)
    return _extern(ctx, eqn, invals)


def _empty(aval) -> bool:
    shape = getattr(aval, "shape", None)
    return shape is not None and any(isinstance(d, int) and d == 0 for d in shape)


def _extern(ctx, eqn, invals):
    if eqn.primitive.name == "dot_general" and not eqn.effects:
        lhs, rhs, params = gemm_operands(ctx, eqn, *invals)
        return ctx.extern(eqn, [lhs, rhs], params)
    return ctx.extern(eqn, invals)
