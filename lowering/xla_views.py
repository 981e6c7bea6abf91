"""Shape equations between XLA ops run in XLA: a graph pass before scheduling.

[Note: views between XLA ops]
A view (reshape, transpose, squeeze, expand_dims) costs nothing inside a kernel:
its readers load through it. But an extern's operand is a materialized buffer,
so a view that an extern reads would be a copy kernel of its own, and a
pallaskit kernel's output has the row-major layout XLA's custom calls fix, so
XLA cannot fold the copy into its dot either (it copies again to the layout it
wants). ``run_views_in_xla`` turns such views into ``ir.Extern`` nodes of their
own primitive, so XLA sees the program jax.jit would: a reshape is a bitcast,
a transpose between two dots is the one copy XLA would make, or none where XLA
folds it into the dot's layout. Which views:

- a view whose readers are all externs (or views that run in XLA), reading a
  buffer XLA holds anyway (an input, an extern's result, or another such view);
- a bitcast (reshape, squeeze, expand_dims) that externs alone read, whatever
  it reads: its operand is stored by the kernel that computes it instead, the
  same bytes, and the reshape is free.

A view read by a pallaskit kernel stays a view (the kernel loads through it),
and so does a permutation of a kernel's value read by an extern: the kernel
stores it permuted (``rules/matmul.gemm_operands`` puts a dot's operands in the
order XLA's gemm takes for that reason). The set is the greatest fixed point of
those conditions (removing a view from it only removes others)."""
from __future__ import annotations

import dataclasses

import jax

from lowering import ir

BITCASTS = ("reshape", "squeeze", "expand_dims")


def _source(node) -> str | None:
    """The buffer a view node reads, or None where it is not a plain view."""
    if not isinstance(node, ir.Pointwise) or node.view is None:
        return None
    body = node.body
    if not isinstance(body, ir.Load) or body.mask is not None:
        return None
    return body.buffer


def run_views_in_xla(graph: ir.Graph, live: set[str]) -> ir.Graph:
    """``graph`` with the views of [Note: views between XLA ops] as externs."""
    xla_held = set()  # buffers only XLA writes: inputs, extern results
    readers: dict[str, list] = {}
    for node in graph.nodes.values():
        if isinstance(node, ir.InputNode):
            xla_held.add(node.name)
        elif isinstance(node, ir.Extern):
            xla_held.update(node.outputs)
        if node.name not in live:
            continue
        for buf in node.reads():
            readers.setdefault(buf, []).append(node)
    outputs = {o for o in graph.outputs if isinstance(o, str)}
    chosen = {n.name for n in graph.nodes.values()
              if n.name in live and n.name not in outputs and _source(n) is not None}

    def keeps(name) -> bool:
        node = graph.nodes[name]
        users = readers.get(name, [])
        if not users or not all(isinstance(u, ir.Extern) or u.name in chosen for u in users):
            return False
        src = _source(node)
        if src in xla_held or src in chosen:
            return True
        return node.view[0].name in BITCASTS and all(isinstance(u, ir.Extern) for u in users)

    changed = True
    while changed:
        drop = {n for n in chosen if not keeps(n)}
        chosen -= drop
        changed = bool(drop)
    if not chosen:
        return graph
    nodes = dict(graph.nodes)
    for name in chosen:
        n = nodes[name]
        primitive, params = n.view
        nodes[name] = ir.Extern(name, n.shape, n.dtype, n.origin, primitive=primitive, params=dict(params),
                                inputs=(_source(n),), outputs=(name,),
                                out_avals=(jax.core.ShapedArray(tuple(n.shape), n.dtype),))
    return dataclasses.replace(graph, nodes=nodes)
