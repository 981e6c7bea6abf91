"""Forward/backward partition of a joint jaxpr: what the forward saves for the
backward, and what the backward recomputes.

[Note: partitioning] (AOTAutograd's idea, on jaxprs.) ``joint_jaxpr`` traces
``jax.vjp`` of a flat function together with the call of its pullback, so one
flat jaxpr holds both passes: ``(primals, cotangents) -> (outputs, input
cotangents)``. Every value that does not depend on a cotangent is a *forward
value*; every equation that does is a *backward equation*. A partition picks
the forward values the forward pass returns as residuals ("saved"); the
backward pass gets the saved values and the cotangents and recomputes every
other forward value it reads.

- ``default``: save every forward value a backward equation reads (what JAX's
  own partial evaluation saves); only values computed from constants alone are
  recomputed.
- ``min_cut``: a minimum s-t cut (max-flow) on the forward values. Each value
  ``v`` is an edge ``v.in -> v.out`` whose capacity is its size in bytes; the
  source feeds the primal inputs and every value that must not be recomputed
  (outputs of reductions, matmuls and anything lowered as an XLA extern: see
  ``recomputable``); values read by the backward drain into the sink. The cut
  edges are the values to save: the smallest set of bytes from which the
  backward can recompute everything it reads with pointwise and view
  equations only. Ties go to primal inputs (the caller holds them anyway).
  One exception to "recompute what is cheap": a value that a matmul or an
  XLA extern reads in the forward and another reads in the backward is
  written to memory by the forward anyway, so it is saved rather than
  recomputed (``_materialized_twice``): recomputing it would cost the
  backward a pass that writes it again, for no memory the forward had not
  already spent (in an MLP block, gelu(h), which feeds the second matmul and
  its weight gradient).

Both passes are built by evaluating a slice of the joint jaxpr under
``jax.make_jaxpr``, so they are ordinary closed jaxprs the compiler takes like
any other. Pure: no runtime state, no environment reads.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from lowering import trace
from lowering.rules import RULES

PARTITIONERS = ("min_cut", "default")


@dataclasses.dataclass(frozen=True)
class Joint:
    """The joint forward+backward jaxpr of a flat function, call-like
    equations inlined. Inputs: every primal, then one cotangent per output in
    ``ct_outputs``. Outputs: every primal output, then one cotangent per input
    in ``diff_inputs``."""

    jaxpr: jex_core.ClosedJaxpr
    num_primals: int
    num_outputs: int
    diff_inputs: tuple[int, ...]  # primal positions that get a cotangent
    ct_outputs: tuple[int, ...]  # output positions that take a cotangent (inexact dtypes)


@dataclasses.dataclass(frozen=True)
class Saved:
    """One residual: a forward value the forward pass returns for the backward."""

    aval: Any
    origin: str  # "argument 3" or the equation that computes it

    @property
    def nbytes(self) -> int:
        return _nbytes(self.aval)


@dataclasses.dataclass(frozen=True)
class Partition:
    method: str
    forward: jex_core.ClosedJaxpr  # primals -> outputs + saved
    backward: jex_core.ClosedJaxpr  # saved + cotangents -> input cotangents
    saved: tuple[Saved, ...]
    recomputed: tuple[str, ...]  # forward equations the backward evaluates again
    num_outputs: int
    diff_inputs: tuple[int, ...]
    ct_outputs: tuple[int, ...]

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self.saved)


# --------------------------------------------------------------------------- #
# the joint graph
# --------------------------------------------------------------------------- #
def _inexact(aval) -> bool:
    try:
        return jnp.issubdtype(aval.dtype, jnp.inexact)
    except TypeError:  # extended dtypes
        return False


def _struct(aval):
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def joint_jaxpr(fn: Callable, avals: Sequence[Any], perturbed: Sequence[bool]) -> Joint:
    """Trace ``fn`` (flat arrays -> flat list of arrays) differentiated with
    respect to the perturbed inexact inputs, forward and backward in one jaxpr."""
    structs = [_struct(a) for a in avals]
    diff = tuple(i for i, (a, p) in enumerate(zip(avals, perturbed)) if p and _inexact(a))
    out_avals = list(jax.eval_shape(lambda *xs: list(fn(*xs)), *structs))
    ct_outs = tuple(j for j, a in enumerate(out_avals) if _inexact(a))

    def joint(*args):
        primals, cts = list(args[:len(avals)]), args[len(avals):]

        def on_diff(*xs):
            full = list(primals)
            for i, x in zip(diff, xs):
                full[i] = x
            return list(fn(*full))

        outs, pullback = jax.vjp(on_diff, *[primals[i] for i in diff])
        given = dict(zip(ct_outs, cts))
        full_cts = [given[j] if j in given else np.zeros(a.shape, jax.dtypes.float0)
                    for j, a in enumerate(out_avals)]
        return list(outs) + list(pullback(full_cts))

    ct_structs = [jax.ShapeDtypeStruct(out_avals[j].shape, out_avals[j].dtype) for j in ct_outs]
    nested = jax.make_jaxpr(joint)(*structs, *ct_structs)
    flat = jax.make_jaxpr(lambda *xs: _eval_inlined(nested.jaxpr, nested.consts, xs))(*structs, *ct_structs)
    for eqn in flat.jaxpr.eqns:
        if eqn.effects:
            raise NotImplementedError(f"effectful equation {eqn.primitive.name} in a differentiated function")
    return Joint(flat, len(avals), len(out_avals), diff, ct_outs)


def _bind(eqn, invals):
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    if ctx is not None:
        with ctx:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _vars(atoms) -> list:
    """The variables among jaxpr atoms (literals dropped)."""
    return [v for v in atoms if not isinstance(v, jex_core.Literal)]


def _read(env, v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]


def _eval_inlined(jaxpr, consts, args):
    """Evaluate a jaxpr, evaluating call-like equations' bodies in place."""
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        body = trace.inlined_body(eqn)
        if body is not None:
            outs = _eval_inlined(body[0], body[1], invals[body[2]:])
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [_read(env, v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------- #
# partitioning
# --------------------------------------------------------------------------- #
def _nbytes(aval) -> int:
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        itemsize = 8
    return int(np.prod(aval.shape, dtype=np.int64)) * itemsize


def recomputable(eqn) -> bool:
    """Pointwise and view equations on plain arrays may run again in the
    backward; reductions, matmuls and every XLA extern may not."""
    rule = RULES.get(eqn.primitive.name)
    if rule is None or rule.kind not in ("pointwise", "view") or eqn.effects:
        return False
    for v in list(eqn.invars) + list(eqn.outvars):
        try:
            dt = np.dtype(v.aval.dtype)
        except TypeError:
            return False
        if not (jnp.issubdtype(dt, jnp.number) or dt == np.bool_):
            return False
    return True


@dataclasses.dataclass
class _Graph:
    """Dataflow facts of the joint jaxpr."""

    jaxpr: Any
    producer: dict  # var -> equation index
    on_ct: set  # vars that depend on a cotangent
    on_primal: set  # vars that depend on a primal
    bwd_reads: list  # forward vars read by the backward, in first-read order


def _analyse(joint: Joint) -> _Graph:
    jaxpr = joint.jaxpr.jaxpr
    primals, cts = jaxpr.invars[:joint.num_primals], jaxpr.invars[joint.num_primals:]
    on_ct, on_primal, producer = set(cts), set(primals), {}
    reads: dict = {}  # ordered set
    for k, eqn in enumerate(jaxpr.eqns):
        ins = _vars(eqn.invars)
        ct = any(v in on_ct for v in ins)
        for v in eqn.outvars:
            producer[v] = k
            if ct:
                on_ct.add(v)
            if any(v2 in on_primal for v2 in ins):
                on_primal.add(v)
        if ct:
            for v in ins:
                if v not in on_ct:
                    reads.setdefault(v, None)
    for v in _vars(jaxpr.outvars[joint.num_outputs:]):
        if v not in on_ct:
            reads.setdefault(v, None)
    return _Graph(jaxpr, producer, on_ct, on_primal, list(reads))


def _default_saved(g: _Graph) -> list:
    return [v for v in g.bwd_reads if v in g.on_primal]


def materializes(eqn) -> bool:
    """Does ``eqn`` read its operands from memory whatever produced them? A
    matmul (the template folds views, not computations, into its loads) and
    an XLA extern do; pointwise, view and reduction kernels inline pointwise
    producers instead."""
    rule = RULES.get(eqn.primitive.name)
    return rule is None or rule.kind == "matmul"


def _materialized_twice(g: _Graph) -> set:
    """Forward values that a materializing equation reads in the forward and
    another reads in the backward: the forward writes them to memory anyway,
    so saving them costs memory only, while recomputing them would cost the
    backward a kernel that writes them again (gelu(h) for the weight gradient
    of the matmul it feeds)."""
    fwd_readers, bwd_readers = set(), set()
    for eqn in g.jaxpr.eqns:
        if not materializes(eqn):
            continue
        backward = any(v in g.on_ct for v in eqn.outvars)
        for v in _vars(eqn.invars):
            if v not in g.on_ct:
                (bwd_readers if backward else fwd_readers).add(v)
    return fwd_readers & bwd_readers


def _min_cut_saved(g: _Graph, joint: Joint) -> list:
    import networkx as nx

    jaxpr = g.jaxpr
    primals = jaxpr.invars[:joint.num_primals]
    fwd_vars = list(primals) + [v for e in jaxpr.eqns for v in e.outvars
                                if v not in g.on_ct and v in g.on_primal and not isinstance(v, jex_core.DropVar)]
    scale = len(fwd_vars) + 1  # bytes dominate; the +1 per non-input only breaks ties
    graph = nx.DiGraph()
    graph.add_node("source")
    graph.add_node("sink")
    primal_set = set(primals)
    for v in fwd_vars:
        graph.add_edge(("in", v), ("out", v), capacity=_nbytes(v.aval) * scale + (v not in primal_set))
    for v in primals:
        graph.add_edge("source", ("in", v))  # no capacity: infinite
    fwd_set = set(fwd_vars)
    written_anyway = _materialized_twice(g)
    for eqn in jaxpr.eqns:
        outs = [v for v in eqn.outvars if v in fwd_set]
        if not outs:
            continue
        banned = not recomputable(eqn)
        for v in outs:
            if banned or v in written_anyway:
                graph.add_edge("source", ("in", v))
            for u in _vars(eqn.invars):
                if u in fwd_set:
                    graph.add_edge(("out", u), ("in", v))
    for v in g.bwd_reads:
        if v in fwd_set:
            graph.add_edge(("out", v), "sink")
    _, (reachable, _) = nx.minimum_cut(graph, "source", "sink")
    saved = {v for v in fwd_vars if ("in", v) in reachable and ("out", v) not in reachable}
    order = {v: k for k, v in enumerate(fwd_vars)}
    return sorted(saved, key=order.__getitem__)


def _slice(jaxpr, consts, in_vars, out_atoms) -> tuple[jex_core.ClosedJaxpr, list[int]]:
    """The closed jaxpr computing ``out_atoms`` from ``in_vars`` by the joint's
    equations, and the indices of the equations it evaluates."""
    avail = set(in_vars) | set(jaxpr.constvars)
    producer = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
    needed: set[int] = set()
    stack = _vars(out_atoms)
    seen = set()
    while stack:
        v = stack.pop()
        if v in avail or v in seen:
            continue
        seen.add(v)
        if v not in producer:
            raise AssertionError(f"partition: {v} is neither saved nor computable")
        k = producer[v]
        if k not in needed:
            needed.add(k)
            stack += _vars(jaxpr.eqns[k].invars)
    order = sorted(needed)

    def run(*args):
        env = dict(zip(jaxpr.constvars, consts))
        env.update(zip(in_vars, args))
        for k in order:
            eqn = jaxpr.eqns[k]
            env.update(zip(eqn.outvars, _bind(eqn, [_read(env, v) for v in eqn.invars])))
        return [_read(env, v) for v in out_atoms]

    return jax.make_jaxpr(run)(*[_struct(v.aval) for v in in_vars]), order


def partition(joint: Joint, method: str = "min_cut") -> Partition:
    """Split the joint jaxpr into a forward and a backward pass."""
    if method not in PARTITIONERS:
        raise ValueError(f"unknown partitioner {method!r}; valid: {', '.join(PARTITIONERS)}")
    g = _analyse(joint)
    saved = _default_saved(g) if method == "default" else _min_cut_saved(g, joint)
    jaxpr, consts = joint.jaxpr.jaxpr, joint.jaxpr.consts
    primals, cts = jaxpr.invars[:joint.num_primals], jaxpr.invars[joint.num_primals:]
    outs, in_cts = jaxpr.outvars[:joint.num_outputs], jaxpr.outvars[joint.num_outputs:]
    forward, _ = _slice(jaxpr, consts, list(primals), list(outs) + saved)
    backward, bwd_eqns = _slice(jaxpr, consts, saved + list(cts), list(in_cts))

    names = trace.VarNames()
    for v in jaxpr.invars:
        names(v)
    texts = {v: trace.equation_text(jaxpr.eqns[g.producer[v]], names) for v in saved if v in g.producer}
    position = {v: i for i, v in enumerate(primals)}
    records = tuple(Saved(v.aval, f"argument {position[v]}" if v in position else texts[v]) for v in saved)
    recomputed = tuple(trace.equation_text(jaxpr.eqns[k], names) for k in bwd_eqns
                       if not any(v in g.on_ct for v in jaxpr.eqns[k].outvars))
    return Partition(method, forward, backward, records, recomputed, joint.num_outputs,
                     joint.diff_inputs, joint.ct_outputs)


__all__ = ["PARTITIONERS", "Joint", "Partition", "Saved", "joint_jaxpr", "partition", "recomputable"]
