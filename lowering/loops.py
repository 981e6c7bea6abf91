"""Loops and conditionals: ``scan``, ``while`` and ``cond`` equations whose
bodies pallaskit compiles as programs of their own.

Note [loop bodies]
~~~~~~~~~~~~~~~~~~
XLA runs the loop (or the conditional); pallaskit compiles what runs inside
it. Each sub-jaxpr (a scan's body, a while loop's cond_fun and body_fun, each
branch of a cond) is lowered, scheduled and rendered with the same options as
the enclosing program, into a ``Body``; the loop becomes one ``Loop`` node in
the enclosing graph. ``Loop`` is an ``ir.Extern`` to every pass (the scheduler
keeps its operands and results in memory and orders it like any XLA call);
only the renderer writes it differently: the body as a nested function (named
after the loop, ``scan3_body``) holding the body's kernel launches and
externs, passed to ``lax.scan`` / ``lax.while_loop`` / ``lax.switch``. Body
kernels are module-level functions named after their loop (``scan3_poi_...``).

Names: a body is lowered with the enclosing context's name counter, so its
buffers never shadow a name of the function it is nested in; values the body
reads from outside (the loop's constants, a closed jaxpr's constants) keep
their outer names and are read by closure. Nested loops nest the same way.

The whole loop stays in XLA (a plain ``Extern``) where compiling it cannot
help or cannot be right: effects inside (their order is XLA's to keep),
operands a kernel cannot hold, and bodies that came out without a single
kernel. Symbolic sizes ([Note: symbolic dims]): a body's kernels take a dims
array of their own, built in the body function from the enclosing function's
size ints. Where such a loop cannot compile (a dynamic
scan length, effects, no kernel) it raises ``SymbolicUnsupported`` rather than
become an extern: its jaxprs hold the symbols, which an XLA call traced at
concrete sizes cannot take; the signature then compiles per size.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
from jax.extend import core as jex_core

from lowering import ir, sizes, symbolic
from lowering.rules import prng
from lowering.trace import scan_counts

log = logging.getLogger("pallaskit")

KINDS = ("scan", "while", "cond")


@dataclasses.dataclass
class Body:
    """One compiled sub-jaxpr of a loop: a function of ``params`` (its graph
    inputs passed by the loop), reading ``closure`` (outer names) from the
    function it is nested in."""

    name: str  # the nested function: scan3_body, while4_cond, cond5_branch1
    schedule: object  # scheduler.Schedule of the body's graph
    params: list  # graph input names the loop passes, in the sub-jaxpr's order
    closure: list  # outer names the body reads as they are

    @property
    def outputs(self) -> list:
        return list(self.schedule.graph.outputs)


@dataclasses.dataclass
class Loop(ir.Extern):
    """A scan / while / cond whose bodies pallaskit compiled ([Note: loop bodies]).
    ``inputs`` are the equation's operands followed by the outer values its
    bodies read by closure (so the scheduler keeps them)."""

    label: str = ""  # scan3: names the nested functions and their kernels
    bodies: tuple = ()
    operands: tuple = ()  # the equation's operands (names or ir.Const)
    params_text: str = ""  # the loop's own parameters, for the comment

    def format(self):
        from lowering.scheduler import format_schedule

        lines = [f"{super().format()}  # {self.label} {self.params_text}".rstrip()]
        for b in self.bodies:
            lines.append(f"  {b.name}({', '.join(b.params)}):")
            lines += ["    " + line for line in format_schedule(b.schedule).splitlines()]
            lines.append(f"    return {', '.join(o if isinstance(o, str) else str(o) for o in b.outputs)}")
        return "\n".join(lines)


def worth_compiling(eqn, options) -> bool:
    """Are this loop's bodies compiled under ``options``? All of them, unless
    ``loop_bodies_heavy_only`` (loop_bodies='auto' on a GPU): then only where a
    body holds a large 16-bit product (heuristics.loop_body_pays)."""
    from lowering import heuristics

    return not options.loop_bodies_heavy_only or heuristics.loop_body_pays(list(_dots(eqn)))


def _dots(eqn):
    """(m, n, k, itemsize) of every dot_general in ``eqn``'s sub-jaxprs, nested ones too."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(sub, "jaxpr", sub)
            for inner in getattr(jaxpr, "eqns", ()):
                if inner.primitive.name == "dot_general":
                    yield _dot_size(inner)
                yield from _dots(inner)


def _dot_size(eqn) -> tuple:
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
    if any(not isinstance(d, int) for d in lhs + rhs):  # a symbolic size: its hint is not known here
        return 0, 0, 0, 0
    k = int(np.prod([lhs[d] for d in lc], dtype=np.int64))
    batch = int(np.prod([lhs[d] for d in lb], dtype=np.int64))
    m = int(np.prod(lhs, dtype=np.int64)) // max(k * batch, 1) * batch
    n = int(np.prod(rhs, dtype=np.int64)) // max(k * batch, 1)
    itemsize = max(np.dtype(v.aval.dtype).itemsize for v in eqn.invars[:2])
    return m, n, k, itemsize


def lower_loop(ctx, eqn, invals, fallbacks):
    """Outputs of a ``scan`` / ``while`` / ``cond`` equation lowered as a ``Loop``,
    or as a plain extern where compiling its bodies brings no kernel; None when
    the loop itself must run through XLA (the caller logs it)."""
    kind = eqn.primitive.name
    dynamic = symbolic.eqn_symbolic(eqn)

    def in_xla(why):
        if dynamic:  # its jaxprs hold the symbols, which an XLA call cannot take: compile per size
            raise symbolic.SymbolicUnsupported(f"{kind} with a dynamic size runs through XLA ({why})")
        return None

    if eqn.effects:
        return in_xla("effects inside")
    if not all(_takes(symbolic.aval_view(v.aval)) for v in list(eqn.invars) + list(eqn.outvars)):
        return in_xla("an operand a kernel cannot hold")
    if kind == "scan" and symbolic.is_jax_dim(eqn.params["length"]):
        return in_xla("a dynamic length")
    # keys a rule holds as their data go in as keys: the loop is XLA's, its bodies take key values
    invals = [prng.key_value(ctx, x, v.aval) for x, v in zip(invals, eqn.invars)]
    label = ctx.new_name(kind)
    body_fallbacks: list[str] = []
    n_inputs = len(ctx.inputs)
    p = eqn.params
    try:
        if kind == "scan":
            n_consts, n_carry = scan_counts(p)
            bound = list(invals[:n_consts]) + [None] * (len(invals) - n_consts)
            bodies = [_body(ctx, f"{label}_body", p["jaxpr"], bound, body_fallbacks, carries=n_carry)]
            params_text = (f"length={p['length']} reverse={p['reverse']} unroll={p['unroll']} "
                           f"carries={n_carry} xs={len(invals) - n_consts - n_carry}")
        elif kind == "while":
            nc, nb = p["cond_nconsts"], p["body_nconsts"]
            consts_c, consts_b, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
            bodies = [_body(ctx, f"{label}_cond", p["cond_jaxpr"], list(consts_c) + [None] * len(init),
                            body_fallbacks),
                      _body(ctx, f"{label}_body", p["body_jaxpr"], list(consts_b) + [None] * len(init),
                            body_fallbacks, carries=len(init))]
            params_text = f"carries={len(init)}"
        elif kind == "cond":
            ops = invals[1:]
            bodies = [_body(ctx, f"{label}_branch{i}", br, [None] * len(ops), body_fallbacks)
                      for i, br in enumerate(p["branches"])]
            params_text = f"branches={len(bodies)}"
        else:
            return None
    except symbolic.SymbolicUnsupported:
        _drop_hoisted(ctx, n_inputs)
        raise
    except Exception as e:  # noqa: BLE001  (a body pallaskit cannot compile: the loop ran through XLA before)
        _drop_hoisted(ctx, n_inputs)
        level = logging.DEBUG if isinstance(e, NotImplementedError) else logging.WARNING
        log.log(level, "pallaskit: %s runs through XLA (its body: %s: %s)", kind, type(e).__name__, e)
        return in_xla(str(e))
    if not any(b.schedule.kernels for b in bodies):
        # Nothing to launch inside: the loop as XLA wrote it; what ran through
        # XLA is what the body held, logged by its own names.
        _drop_hoisted(ctx, n_inputs)
        in_xla("no kernel in its bodies")
        fallbacks.extend(f for f in body_fallbacks if f not in fallbacks)
        return ctx.extern(eqn, invals)
    fallbacks.extend(f for f in body_fallbacks if f not in fallbacks)
    closure = []
    for b in bodies:
        closure += [c for c in b.closure if c not in closure and c not in invals]
    names = [ctx.new_name() for _ in eqn.outvars]
    out_avals = tuple(symbolic.aval_view(v.aval) for v in eqn.outvars)
    first = np.dtype("V") if prng.is_threefry_key(out_avals[0]) else np.dtype(out_avals[0].dtype)  # a key: extern-only
    node = Loop(names[0], tuple(out_avals[0].shape), first, (ctx.current_eqn,),
                primitive=eqn.primitive, params=dict(eqn.params), inputs=tuple(invals) + tuple(closure),
                outputs=tuple(names), out_avals=out_avals, label=label, bodies=tuple(bodies),
                operands=tuple(invals), params_text=params_text)
    ctx._add(node)
    return names


def _takes(aval) -> bool:
    """Can a body program take this loop operand? What a kernel holds, and empty
    arrays of such a dtype (an optimizer's (0,)-shaped leaf in a training loop's
    carry): the bodies pass those through XLA, no work and no fallback
    (``lower._empty``), where refusing them sent the whole loop through XLA."""
    if prng.is_threefry_key(aval):  # a key: the body holds it as a key value ([Note: key values])
        return True
    shape = tuple(getattr(aval, "shape", ()))
    if any(isinstance(d, int) and d == 0 for d in shape):
        return symbolic.is_plain(symbolic.SymAval((1,) * len(shape), aval.dtype))
    return symbolic.is_plain(aval)


def _drop_hoisted(ctx, n_inputs):
    """Forget the constants bodies hoisted into ``ctx`` (the loop runs through XLA whole)."""
    for name in ctx.inputs[n_inputs:]:
        ctx.nodes.pop(name, None)
        ctx.constants.pop(name, None)
    del ctx.inputs[n_inputs:]


def _body(ctx, name, closed, bound, fallbacks, carries: int = 0) -> Body:
    """Lower and schedule one sub-jaxpr. ``bound``: per invar of the jaxpr, the
    outer value it takes from the enclosing program (a loop constant: read by
    closure, or folded in where it is a literal), or None for a parameter.
    ``carries``: its first parameters and first outputs are a loop's carry."""
    from lowering.combo import combine
    from lowering.scheduler import schedule

    if isinstance(closed, jex_core.ClosedJaxpr):
        jaxpr, consts = closed.jaxpr, list(closed.consts)
    else:
        jaxpr, consts = closed, []
    sub = ctx.child()
    closure = []

    def outer(value):
        if isinstance(value, ir.Const):
            return value
        if value not in sub.nodes:
            shape, dtype = ctx.aval_of(value)
            sub.nodes[value] = ir.InputNode(value, tuple(shape), np.dtype(dtype))
            sub.inputs.append(value)
            closure.append(value)
        return value

    # A closed jaxpr's own constants become constants of the outermost program.
    const_vals = [outer(ctx.const_input(c)) for c in consts]
    args, params = [], []
    for v, b in zip(jaxpr.invars, bound):
        if b is not None:
            args.append(outer(b))
        else:
            nm = sub.input(symbolic.aval_view(v.aval))
            params.append(nm)
            args.append(nm)
    outs = sub.lower_jaxpr(jaxpr, const_vals, args, fallbacks)
    outs = [prng.key_value(sub, o, v.aval) for o, v in zip(outs, jaxpr.outvars)]  # [Note: key values]
    outs = _distinct_outputs(sub, outs)
    ctx._count = sub._count
    # Outer constants a nested ``_const_input`` made live in ``sub``: hoist them.
    for cname, c in sub.constants.items():
        ctx.constants[cname] = c
        ctx.nodes[cname] = sub.nodes[cname]
        ctx.inputs.append(cname)
        closure.append(cname)
    graph = ir.Graph(inputs=list(sub.inputs), nodes=sub.nodes, outputs=list(outs), constants={})
    sched = schedule(graph, ctx.options, loop_body=True, combine=combine)
    for k in sched.kernels:
        k.name = f"{name}_{k.name}"
    _mark_in_place(sched, list(zip(params[:carries], graph.outputs[:carries])))
    return Body(name, sched, params, closure)


# [Note: distinct body outputs]
# A value a body returns twice (an RNN cell's new ``h``: the carry and the
# step's output) made its kernel run twice a step on the GPU: XLA's
# dynamic-slice fusion rewrites the step output's dynamic-update-slice into the
# ys buffer around the kernel's custom call, cloning the call into the fusion,
# while the carry kept reading the original (RESULTS.md, "Session 28"). Each
# repeat of a value a body node computes becomes a copy of it, which fuses into
# the producing kernel as one more store: every output of the body is then a
# value of its own.
def _distinct_outputs(sub, outs: list) -> list:
    seen, out = set(), []
    for o in outs:
        node = sub.nodes.get(o) if isinstance(o, str) else None
        if o in seen and node is not None and not isinstance(node, (ir.InputNode, ir.Extern)):
            shape, dtype = sub.aval_of(o)
            body = sub.load(o, sizes.index_symbols("i", len(shape)))
            o = sub.pointwise(symbolic.SymAval(tuple(shape), dtype), body)
        seen.add(o)
        out.append(o)
    return out


# [Note: in-place carries]
# A carry a pointwise kernel reads and writes back (an LSTM's ``c``) cost a
# copy a step: the kernel's output is a new buffer, which XLA copies into the
# loop's carry buffer. Where the carry is loaded only by the member that
# stores its new value, and only at the element it stores (the same shape, no
# mask, no other index), each element is read before it is written, by the
# same program, and by nothing after: the output may take the carry's buffer,
# and the kernel's launch aliases them (raw Triton, ``Rendered.aliases``; a
# Pallas kernel ignores it). XLA keeps the aliasing safe on its side: where
# the carry is still read after the kernel, it copies the carry before it.
def _mark_in_place(sched, pairs: list) -> None:
    for kernel in sched.kernels:
        if kernel.kind != "pointwise":
            continue
        stored = {m.name: m for m in kernel.members if m.store}
        kernel.in_place = tuple((p, o) for p, o in pairs  # carries pair distinct parameters with distinct outputs
                                if o in stored and p in kernel.reads and _reads_in_place(kernel, p, stored[o]))


def _reads_in_place(kernel, read: str, writer) -> bool:
    """Is ``read`` loaded only by member ``writer``, only at the element it stores?"""
    for m in kernel.members:
        if tuple(m.node.shape) != tuple(writer.node.shape) or not isinstance(m.node, ir.Pointwise):
            return False
        symbols = tuple(m.node.symbols)
        for ld in ir.loads(m.body):
            if ld.buffer == read and (m is not writer or ld.mask is not None or tuple(ld.index) != symbols):
                return False
    return True


def scheduled_attention(schedule, scope: str = ""):
    """(flash-attention step ([Note: fused attention]), the body function
    holding it or '') of a schedule and of every loop body in it, in order."""
    for step in schedule.steps:
        if isinstance(step, Loop):
            for b in step.bodies:
                yield from scheduled_attention(b.schedule, b.name)
        elif isinstance(step, ir.Attention):
            yield step, scope


def scheduled_kernels(schedule, scope: str = ""):
    """(kernel, its schedule, the body function holding it or '') of a
    schedule and of every loop body in it, in program order."""
    for step in schedule.steps:
        if isinstance(step, Loop):
            for b in step.bodies:
                yield from scheduled_kernels(b.schedule, b.name)
        elif not isinstance(step, ir.Extern):
            yield step, schedule, scope


# --------------------------------------------------------------------------- #
# Rendering (called by codegen.program.render)
# --------------------------------------------------------------------------- #
def _tuple(items) -> str:
    return f"({', '.join(items)}{',' if len(items) == 1 else ''})"


def _unpack(w, names, source):
    if names:
        w.line(f"{', '.join(names)}{',' if len(names) == 1 else ''} = {source}")


def write_loop(w, loop: Loop, write_steps, value):
    """The nested body functions of ``loop`` and the ``lax`` call running them.
    ``write_steps(w, schedule)`` writes a body's kernel launches and externs;
    ``value(x)`` is the source of a value (a name, or an ir.Const)."""
    p = loop.params
    ops = [value(x) for x in loop.operands]
    kind = loop.primitive.name
    w.line(f"# {loop.label}: {loop.origin[0] if loop.origin else kind}  ({loop.params_text})")

    def body(b: Body, signature: list[str], unpack: list[tuple[list, str]], ret: str):
        w.line(f"def {b.name}({', '.join(signature)}):")
        with w.indent():
            for names, source in unpack:
                _unpack(w, names, source)
            dims = symbolic.program_dims(b.schedule)
            if dims:  # the body's kernels read its own dims array; the sizes are the enclosing ints
                w.line(f"dims = jnp.asarray([{', '.join(dims)}], jnp.int32)")
            write_steps(w, b.schedule)
            w.line(f"return {ret}")

    outs = list(loop.outputs)
    if kind == "scan":
        (b,) = loop.bodies
        n_consts, n_carry = scan_counts(p)
        carry, xs = b.params[:n_carry], b.params[n_carry:]
        res = [value(o) for o in b.outputs]
        body(b, ["carry", "xs"], [(carry, "carry"), (xs, "xs")],
             f"{_tuple(res[:n_carry])}, {_tuple(res[n_carry:])}")
        init, x_ops = ops[n_consts:n_consts + n_carry], ops[n_consts + n_carry:]
        w.line(f"{_tuple(outs[:n_carry])}, {_tuple(outs[n_carry:])} = lax.scan({b.name}, {_tuple(init)}, "
               f"{_tuple(x_ops)}, length={p['length']}, reverse={p['reverse']}, unroll={p['unroll']!r})")
    elif kind == "while":
        cond, step = loop.bodies
        init = ops[p["cond_nconsts"] + p["body_nconsts"]:]
        body(cond, ["carry"], [(cond.params, "carry")], value(cond.outputs[0]))
        body(step, ["carry"], [(step.params, "carry")], _tuple([value(o) for o in step.outputs]))
        cond_fn, step_fn = cond.name, step.name
        if p["cond_jaxpr"].out_avals[0].shape:
            # A batched predicate (vmap of a while_loop): the loop runs while any
            # element's predicate holds, and a step keeps the carry of the
            # elements whose predicate was false, as jax's own lowering does.
            cond_fn, step_fn = f"{cond.name}_any", f"{step.name}_masked"
            w.line(f"def {cond_fn}(carry):")
            with w.indent():
                w.line(f"return jnp.any({cond.name}(carry))")
            w.line(f"def {step_fn}(carry):")
            with w.indent():
                w.line(f"pred = {cond.name}(carry)")
                w.line("return tuple(jnp.where(lax.expand_dims(pred, tuple(range(pred.ndim, new.ndim))), new, old)")
                w.line(f"             for new, old in zip({step.name}(carry), carry))")
        w.line(f"{_tuple(outs)} = lax.while_loop({cond_fn}, {step_fn}, {_tuple(init)})")
    else:  # cond: lax.switch clamps an index the cond primitive already holds in range
        for b in loop.bodies:
            body(b, list(b.params), [], _tuple([value(o) for o in b.outputs]))
        branches = _tuple([b.name for b in loop.bodies])
        w.line(f"{_tuple(outs)} = lax.switch({ops[0]}, {branches}{''.join(', ' + o for o in ops[1:])})")
