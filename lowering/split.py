"""Two-stage reductions: a graph rewrite run before scheduling.

[Note: split reductions and mix-order fusion]
A reduction with few outputs and a long reduced extent leaves the GPU idle
when one program owns each block of outputs. Two rewrites fix that, each
ending in an ordinary ``Reduction`` (the *finisher*) that keeps the original
node's name, so its readers do not change:

* Column reductions (the reduced dims lead, e.g. ``dw = sum(dy * xhat, 0)``)
  become a ``PartialReduction``: a grid of programs each combining the rows it
  owns into one row of a ``programs x N`` float32 buffer, then the finisher
  sums that buffer over its rows. The scheduler may put the partial into the
  same kernel as row reductions over the same domain (``dx``'s row sums):
  that is mix-order fusion, and the reason a norm backward reads its inputs
  once. It is done when mix-order fusion could apply (a row reduction over the
  same domain exists) or when the unsplit kernel would leave SMs idle.
* Row reductions (the reduced dims trail, or a full reduction to a scalar)
  with fewer outputs than SMs split their reduced extent into chunks: an
  ordinary ``Reduction`` over ``(*kept, chunks, chunk)`` with the tail masked,
  then the finisher over the chunks. A full reduction of an operand with a
  moderate number of rows splits at the rows instead (``_full_at_rows``): its
  partial is a row reduction over the operand's own domain, so pointwise
  nodes over that domain (a loss gradient beside the loss) share its kernel.

Legality lives here (which ops combine, which axes lead or trail); the size
thresholds are in ``heuristics``.
"""
from __future__ import annotations

import collections
import dataclasses

import jax.numpy as jnp
import numpy as np
import sympy

from lowering import executors, heuristics, ir, sizes
from lowering.options import CompileOptions

# Ops whose partial results combine with the same op.
COMBINABLE = ("sum", "max", "min")


def split_reductions(graph: ir.Graph, options: CompileOptions) -> ir.Graph:
    """The graph with long, narrow reductions in two stages (a new graph)."""
    if not (options.split_reductions or options.mix_order_reduction):
        return graph
    row_domains = {(n.domain, n.axes) for n in graph.nodes.values() if isinstance(n, ir.Reduction)}
    # Column reductions over one domain end in one mix kernel: how many it
    # accumulates decides its programs per SM (registers).
    columns = collections.Counter((n.domain, len(n.reduced)) for n in graph.nodes.values()
                                  if isinstance(n, ir.Reduction) and n.op in COMBINABLE and _leading(n))
    nodes: dict[str, ir.Node] = {}
    for node in graph.nodes.values():
        parts = None
        # Symbolic sizes ([Note: symbolic dims]): a column reduction over dynamic
        # rows splits with a program count taken at the size hint (each program
        # then walks a runtime number of row blocks); row splits and full
        # reductions would need a size-dependent chunking and stay unsplit
        # (always legal, only slower).
        if isinstance(node, ir.Reduction) and node.op in COMBINABLE:
            symbolic = sizes.is_symbolic(node.domain)
            if _leading(node) and node.shape and not sizes.is_symbolic(node.shape):
                if sizes.hint(node.reduced_numel, options.size_hints) > 1:
                    parts = _column(node, row_domains, columns[(node.domain, len(node.reduced))], options)
            elif _trailing(node) and not symbolic and node.reduced_numel > 1:
                parts = _row(node, options)
        for n in parts or [node]:
            nodes[n.name] = n
    if len(nodes) == len(graph.nodes):
        return graph
    return dataclasses.replace(graph, nodes=nodes)


def _leading(n: ir.Reduction) -> bool:
    return n.axes == tuple(range(len(n.reduced)))


def _trailing(n: ir.Reduction) -> bool:
    return n.axes == tuple(range(len(n.shape), len(n.domain)))


def acc_dtype(op: str, dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if op == "sum" and _is_float(dt) and dt.itemsize < 4:
        return np.dtype(np.float32)
    return dt


def _column(node: ir.Reduction, row_domains, columns: int, options: CompileOptions):
    rows, cols = sizes.hint(node.reduced_numel, options.size_hints), node.numel
    row_axes = tuple(range(len(node.reduced), len(node.domain)))
    mix = (options.mix_order_reduction and (node.domain, row_axes) in row_domains
           and rows >= heuristics.MIN_SPLIT_ROWS
           and heuristics.mix_worthwhile(rows, cols, options.num_sms, columns)
           and heuristics.fits_in_tile(cols, options.max_persistent_cols))
    split = options.split_reductions and heuristics.column_reduction_underfilled(rows, cols, options.num_sms)
    if not (mix or split):
        return None
    long_rows = heuristics.triton_mix_config(cols, columns) is None
    if mix and executors.wants_triton(executors.kernel_kind("mix", True, columns, long_rows), options):
        # codegen/triton.py render_mix writes that kernel (dynamic rows: programs at the hint)
        programs = heuristics.triton_mix_programs(rows, options.num_sms, columns, long_rows)
    else:
        programs = heuristics.partial_programs(rows, cols, options.num_sms, columns)
    acc = acc_dtype(node.op, node.body.dtype)
    part = ir.PartialReduction(f"{node.name}_part", (programs,) + node.shape, acc, node.origin,
                               body=node.body, kept=node.shape, reduced=node.reduced, op=node.op,
                               programs=programs)
    return [part, _finisher(node, part.name, (programs,), acc, leading=True)]


def _row(node: ir.Reduction, options: CompileOptions):
    if not options.split_reductions:
        return None
    if not node.shape and len(node.reduced) >= 2 and heuristics.full_reduction_at_rows(
            sizes.numel(node.reduced[:-1]), node.reduced[-1], options.num_sms, options.max_persistent_cols):
        return _full_at_rows(node)
    total = node.reduced_numel
    chunks = heuristics.row_split(node.numel, total, options.num_sms)
    if chunks <= 1:
        return None
    chunk = heuristics.ceil_div(total, chunks)
    chunks = heuristics.ceil_div(total, chunk)
    k = len(node.shape)
    split_sym, inner = sizes.index_symbols("i", k + 1)[k], sizes.index_symbols("r", 1)[0]
    flat = split_sym * chunk + inner
    mapping = dict(zip(node.reduction_symbols, sizes.unravel(flat, node.reduced)))
    body = ir.substitute_index(node.body, mapping)
    acc = acc_dtype(node.op, node.body.dtype)
    if acc != body.dtype:
        body = ir.Op("convert_element_type", (body,), acc, (("new_dtype", acc),))
    if chunks * chunk != total:
        inside = sympy.Lt(flat, total)
        body = ir.Op("select_n", (ir.IndexValue(inside, np.dtype(np.bool_)), identity(node.op, acc),
                                  _masked(body, inside)), acc)
    part = ir.Reduction(f"{node.name}_part", node.shape + (chunks,), acc, node.origin, body=body,
                        reduced=(chunk,), axes=(k + 1,), op=node.op)
    return [part, _finisher(node, part.name, (chunks,), acc, leading=False)]


def _full_at_rows(node: ir.Reduction):
    """A full reduction over ``(*rows, cols)`` as a reduction over ``cols`` per
    row (its partial keeps the operand's leading dims, so pointwise nodes over
    the operand's domain fuse with it), then one over the rows."""
    rows = node.reduced[:-1]
    i, r = sizes.index_symbols("i", len(rows)), sizes.index_symbols("r", 1)
    old = node.reduction_symbols
    body = ir.substitute_index(node.body, dict(zip(old, i + r)))
    acc = acc_dtype(node.op, node.body.dtype)
    if acc != body.dtype:
        body = ir.Op("convert_element_type", (body,), acc, (("new_dtype", acc),))
    part = ir.Reduction(f"{node.name}_part", rows, acc, node.origin, body=body, reduced=node.reduced[-1:],
                        axes=(len(rows),), op=node.op)
    finish = ir.Reduction(node.name, (), node.dtype, node.origin, body=ir.Load(part.name, tuple(old[:-1]), acc),
                          reduced=rows, axes=tuple(range(len(rows))), op=node.op)
    return [part, finish]


def _finisher(node: ir.Reduction, part: str, reduced, acc, *, leading: bool) -> ir.Reduction:
    i = sizes.index_symbols("i", len(node.shape))
    r = sizes.index_symbols("r", 1)
    index = tuple(r) + tuple(i) if leading else tuple(i) + tuple(r)
    body = ir.Load(part, index, acc)
    axes = (0,) if leading else (len(node.shape),)
    return ir.Reduction(node.name, node.shape, node.dtype, node.origin, body=body, reduced=tuple(reduced),
                        axes=axes, op=node.op)


def identity(op: str, dtype) -> ir.Const:
    dt = np.dtype(dtype)
    if op == "sum":
        return ir.Const(0, dt)
    big = op == "min"
    if dt == np.bool_:  # reduce_max / reduce_min of booleans (jnp.max of a mask)
        return ir.Const(big, dt)
    if _is_float(dt):
        return ir.Const(float("inf") if big else float("-inf"), dt)
    info = np.iinfo(dt)
    return ir.Const(int(info.max if big else info.min), dt)


def _is_float(dt) -> bool:
    return bool(jnp.issubdtype(dt, jnp.floating))


def _masked(expr: ir.Expr, cond) -> ir.Expr:
    """``expr`` with every load valid only where ``cond`` holds (no stray reads)."""
    def sub(e):
        if isinstance(e, ir.Load):
            return dataclasses.replace(e, mask=cond if e.mask is None else sympy.And(e.mask, cond))
        return None

    return ir.rewrite(expr, sub)
