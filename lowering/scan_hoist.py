"""Scan input projections hoisted out of the loop: a jaxpr -> jaxpr pass run
before lowering (option ``scan_hoisting``).

Note [scan hoisting]
~~~~~~~~~~~~~~~~~~~~
An RNN cell under ``lax.scan`` computes ``x_t @ wx + h @ wh`` each step. The
``x_t @ wx`` half reads only the scanned input and loop constants, never the
carry, so it can run for every step at once before the loop: one [T*B, I] x
[I, N] GEMM instead of T small ones, as cuDNN and PyTorch LSTMs do. XLA's
loop-invariant code motion does not do it (``x_t`` changes every iteration).

Each body equation gets a class: loop-invariant (reads only constants),
per-step (reads a scanned input, not the carry) or carried (reads the carry).
The pass hoists the per-step ``dot_general`` / convolutions with a per-step
operand, with the per-step equations they read: those run under ``jax.vmap``
over the stacked inputs before the loop (loop-invariant inputs stay unbatched,
so a transposed weight is computed once, not T times), and the values the
rest of the body reads from them become extra scanned inputs (residuals) of a
new scan whose body is the rest. Per-step work without a matmul stays in the
body: hoisting it would only add a [T, ...] residual's memory traffic; so
would a matmul whose residual dwarfs what the scan already stacks (an outer
product: ``MAX_RESIDUAL_RATIO``). Scans with effects in their body, a symbolic length or no hoistable matmul are kept
as they are. Nested scans (in a scan body, or in a jit / closed_call body,
which the lowering inlines anyway) are rewritten inside the rebuilt body, the
outer loop first.

The rewritten program is traced again (``jax.make_jaxpr`` of an interpreter
binding every equation as it was, ``lax.scan`` for the rebuilt loops), so the
loops' parameters are written by ``lax.scan`` itself in either jax version's
form. ``vmap`` stacks residuals on the scanned axis in input order, so
``reverse=True`` needs nothing of its own. Anything the retrace cannot take
(collectives under shard_map, symbolic shapes) leaves the jaxpr unchanged.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging

import jax
import numpy as np
from jax.extend import core as jex_core

from lowering.trace import scan_counts

log = logging.getLogger("pallaskit")

# The matmuls worth a batched GEMM outside the loop.
HOISTED_MATMULS = ("dot_general", "conv_general_dilated")
# Call-like equations the pass looks (and inlines) through; the lowering inlines them too.
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}

# Residual bytes a step at most, per byte the scan already stacks (its scanned
# inputs and outputs): an RNN's projection is 1.5-4x its input; one that blows
# its inputs up more is memory-bound work (an outer product) whose [T, ...]
# residual could exhaust memory where the loop did not.
MAX_RESIDUAL_RATIO = 8

_INVARIANT, _PER_STEP, _CARRIED = 0, 1, 2


def hoist_scans(closed) -> tuple[object, list[str]]:
    """(the closed jaxpr with every qualifying scan rewritten, one note per
    rewritten scan). ``closed`` itself when no scan qualifies."""
    plans: dict[int, Plan | None] = {}
    try:
        if not _wants(closed.jaxpr, plans):
            return closed, []
    except Exception as e:  # noqa: BLE001  (an equation form the analysis does not know: leave the loops alone)
        log.debug("pallaskit: scan hoisting skipped (%s: %s)", type(e).__name__, e)
        return closed, []
    avals = [v.aval for v in closed.jaxpr.invars]
    if not all(_static(a) for a in avals):
        return closed, []
    notes: dict[int, str] = {}

    def run(*args):
        return _eval(closed.jaxpr, closed.consts, args, plans, notes)

    try:
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals]
        rewritten = jax.make_jaxpr(run)(*structs)
    except Exception as e:  # noqa: BLE001  (a retrace jax refuses: keep the loops as they were)
        log.debug("pallaskit: scan hoisting skipped (%s: %s)", type(e).__name__, e)
        return closed, []
    return rewritten, list(notes.values())


@dataclasses.dataclass
class Plan:
    """How one scan body splits: ``step`` runs under vmap before the loop and
    returns ``residuals``; ``body`` runs in the loop, reading them."""

    step: list  # equations of the hoisted part, in body order (invariant ones included)
    step_xs: list  # indices (among the scanned inputs) the hoisted part reads
    residuals: list  # body vars the loop reads from the hoisted part
    body: list  # equations left in the loop, in body order
    body_xs: list  # indices of the scanned inputs the loop still reads
    matmuls: dict  # hoisted matmul equations by primitive name

    def note(self, length: int) -> str:
        res = ", ".join(_stacked(v.aval, length) for v in self.residuals)
        what = ", ".join(f"{n} {name}" for name, n in self.matmuls.items())
        return f"scan: input projection hoisted out of the loop ({what}, residual{'s' * (len(self.residuals) > 1)} {res})"


def _stacked(aval, length: int) -> str:
    """'f32[128,256,4096]': a residual's aval with the scanned axis."""
    try:
        return aval.update(shape=(length, *aval.shape)).str_short(short_dtypes=True)
    except TypeError:  # an aval without the short spelling
        return f"{aval.dtype}[{','.join(map(str, (length, *aval.shape)))}]"


# --------------------------------------------------------------------------- #
# Analysis
# --------------------------------------------------------------------------- #
def _static(aval) -> bool:
    shape = getattr(aval, "shape", None)
    return shape is not None and hasattr(aval, "dtype") and all(isinstance(d, int) for d in shape)


def _call_body(eqn):
    """The inner open jaxpr and its consts of a call-like equation, else None."""
    param = _CALLS.get(eqn.primitive.name)
    body = eqn.params.get(param) if param else None
    if isinstance(body, jex_core.ClosedJaxpr):
        return body.jaxpr, list(body.consts)
    if isinstance(body, jex_core.Jaxpr):
        return body, []
    return None


def _has_matmul(eqn) -> bool:
    if eqn.primitive.name in HOISTED_MATMULS:
        return True
    inner = _call_body(eqn)
    return inner is not None and any(_has_matmul(e) for e in inner[0].eqns)


def _wants(jaxpr, plans) -> bool:
    """Does any scan in ``jaxpr`` (or nested in a scan / call body) get rewritten?"""
    found = False
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found |= _scan_wants(eqn, plans)
        elif _call_body(eqn) is not None:
            found |= _wants(_call_body(eqn)[0], plans)
    return found


def _scan_wants(eqn, plans) -> bool:
    if id(eqn) not in plans:
        plans[id(eqn)] = _plan(eqn)
    body = eqn.params["jaxpr"]
    return plans[id(eqn)] is not None or (not body.effects and _wants(body.jaxpr, plans))


def _plan(eqn) -> Plan | None:
    """The split of one scan's body, or None when nothing pays to hoist."""
    p = eqn.params
    closed = p["jaxpr"]
    jaxpr = closed.jaxpr
    if closed.effects or eqn.effects or not isinstance(p.get("length"), int):
        return None
    n_consts, n_carry = scan_counts(p)
    xs_vars = jaxpr.invars[n_consts + n_carry:]
    if not xs_vars:
        return None
    cls = {v: _INVARIANT for v in list(jaxpr.constvars) + list(jaxpr.invars[:n_consts])}
    cls.update({v: _CARRIED for v in jaxpr.invars[n_consts:n_consts + n_carry]})
    cls.update({v: _PER_STEP for v in xs_vars})
    for e in jaxpr.eqns:
        c = max((cls[v] for v in e.invars if not isinstance(v, jex_core.Literal)), default=_INVARIANT)
        for v in e.outvars:
            cls[v] = c
    live = _live(jaxpr.eqns, jaxpr.outvars)

    def klass(e):
        return max((cls[v] for v in e.outvars), default=_INVARIANT)

    seeds = [e for e in live if klass(e) == _PER_STEP and _has_matmul(e)]
    if not seeds:
        return None
    ancestors = _live(live, [v for e in seeds for v in e.outvars])
    hoisted = [e for e in ancestors if klass(e) == _PER_STEP]
    hoisted_ids = {id(e) for e in hoisted}
    rest = [e for e in live if id(e) not in hoisted_ids]
    body = _live(rest, jaxpr.outvars)
    read = _vars([v for e in body for v in e.invars] + list(jaxpr.outvars))
    residuals = [v for e in hoisted for v in e.outvars if v in read]
    stacked = sum(_nbytes(v.aval) for v in list(xs_vars) + list(jaxpr.outvars[n_carry:]))
    if not residuals or sum(_nbytes(v.aval) for v in residuals) > MAX_RESIDUAL_RATIO * stacked:
        return None
    step = _live(ancestors, residuals)
    step_reads = _vars(v for e in step for v in e.invars)
    return Plan(step=step, step_xs=[i for i, v in enumerate(xs_vars) if v in step_reads],
                residuals=residuals, body=body, body_xs=[i for i, v in enumerate(xs_vars) if v in read],
                matmuls=collections.Counter(e.primitive.name for e in step if id(e) in hoisted_ids and _has_matmul(e)))


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * getattr(aval.dtype, "itemsize", 4)


def _vars(atoms) -> set:
    """The variables among jaxpr atoms (literals are unhashable and never computed)."""
    return {v for v in atoms if not isinstance(v, jex_core.Literal)}


def _live(eqns, outputs) -> list:
    """The equations of ``eqns`` that ``outputs`` depend on, in order (no effects here)."""
    need = _vars(outputs)
    kept = []
    for e in reversed(eqns):
        if any(v in need for v in e.outvars):
            kept.append(e)
            need |= _vars(e.invars)
    return kept[::-1]


# --------------------------------------------------------------------------- #
# The retrace
# --------------------------------------------------------------------------- #
def _eval(jaxpr, consts, args, plans, notes, env=None):
    env = {} if env is None else env
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    _run(jaxpr.eqns, env, plans, notes)
    return [_read(env, v) for v in jaxpr.outvars]


def _read(env, v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]


def _run(eqns, env, plans, notes, rewrite=True):
    for eqn in eqns:
        invals = [_read(env, v) for v in eqn.invars]
        inner = _call_body(eqn) if rewrite else None
        if rewrite and eqn.primitive.name == "scan" and _scan_wants(eqn, plans):
            outs = _rebuild_scan(eqn, invals, plans, notes)
        elif inner is not None and _wants(inner[0], plans):
            outs = _eval(inner[0], inner[1], invals, plans, notes)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))


def _bind(eqn, invals) -> list:
    """``eqn`` applied to ``invals`` as jax's own eval_jaxpr binds it."""
    params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = ()
    if isinstance(params, tuple):  # older jax: (subfuns, params)
        subfuns, params = params
    ctx = getattr(eqn, "ctx", None)
    with getattr(ctx, "manager", None) or contextlib.nullcontext():
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _rebuild_scan(eqn, invals, plans, notes) -> list:
    """The scan as ``lax.scan`` again: the plan's hoisted part under vmap first,
    its residuals scanned beside the inputs the body still reads."""
    p = eqn.params
    closed = p["jaxpr"]
    jaxpr, jconsts = closed.jaxpr, list(closed.consts)
    n_consts, n_carry = scan_counts(p)
    consts, init, xs = invals[:n_consts], invals[n_consts:n_consts + n_carry], invals[n_consts + n_carry:]
    xs_vars = jaxpr.invars[n_consts + n_carry:]
    base = dict(zip(jaxpr.constvars, jconsts))
    base.update(zip(jaxpr.invars[:n_consts], consts))
    plan = plans.get(id(eqn))
    if plan is not None:
        def step(*x_t):
            env = dict(base)
            env.update(zip([xs_vars[i] for i in plan.step_xs], x_t))
            _run(plan.step, env, plans, notes, rewrite=False)
            return [env[v] for v in plan.residuals]

        residuals = jax.vmap(step)(*[xs[i] for i in plan.step_xs])
        notes[id(eqn)] = plan.note(p["length"])
        body_eqns, body_xs, res_vars = plan.body, plan.body_xs, plan.residuals
    else:
        residuals, body_eqns, body_xs, res_vars = [], jaxpr.eqns, list(range(len(xs))), []

    def body(carry, scanned):
        x_t, r_t = scanned
        env = dict(base)
        env.update(zip(jaxpr.invars[n_consts:n_consts + n_carry], carry))
        env.update(zip([xs_vars[i] for i in body_xs], x_t))
        env.update(zip(res_vars, r_t))
        _run(body_eqns, env, plans, notes)
        outs = [_read(env, v) for v in jaxpr.outvars]
        return outs[:n_carry], outs[n_carry:]

    extra = {"_split_transpose": p["_split_transpose"]} if "_split_transpose" in p else {}
    carry, ys = jax.lax.scan(body, list(init), ([xs[i] for i in body_xs], list(residuals)), length=p["length"],
                             reverse=p["reverse"], unroll=p["unroll"], **extra)
    return [*carry, *ys]
