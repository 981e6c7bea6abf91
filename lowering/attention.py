"""Plain attention found in the jaxpr and run as flash-attention kernels: a
jaxpr -> jaxpr pass run before lowering (option ``fused_attention``).

Note [fused attention]
~~~~~~~~~~~~~~~~~~~~~~
Attention written as users write it (``einsum`` of q and k, a scale, a mask
through ``jnp.where``, ``jax.nn.softmax``, ``einsum`` with v) stores the
[batch, Tq, Tk] scores and probabilities, and its gradient reads and writes
several more such arrays: at T = 1024 that is most of a GPT-2 layer's memory
traffic. A flash-attention kernel keeps them on chip (the probabilities are
recomputed from q, k and each row's log-sum-exp), as Inductor's SDPA pattern
rewrite does for torch. The pass finds the pattern and replaces it:

- **Forward.** ``S = dot_general(q, k)`` with one contracting (head) dim, one
  free dim each side (the query and key positions) and any batch dims; then a
  chain over S of a widening convert, a scalar scale (``mul`` / ``div`` by a
  scalar of literals) and a mask (``select_n(mask, fill, s)``, ``jnp.where``'s form, with a
  scalar fill; or the operands the other way round, nanoGPT's
  ``where(mask == 0, -inf, s)``, the mask then marking the hidden scores:
  ``AttentionSpec.mask_hides``), in any order; then the softmax over the key dim as
  ``jax.nn.softmax`` writes it (``reduce_max``, ``stop_gradient``, ``sub``,
  ``exp``, ``reduce_sum``, ``div``), an optional convert, and
  ``O = dot_general(P, v)`` contracting the key dim. Its semantics are then
  known exactly: ``O = softmax(where(mask, S * scale, fill)) · v``.
- **Backward.** Whatever the user's code, the softmax gradient in the jaxpr is
  what JAX's autodiff made of that forward chain. The pass asks JAX for the
  same thing (``jax.vjp`` of the chain replayed, traced abstractly) and checks
  that the program's cotangent of S is that computation, equation by equation
  (primitives, parameters, operands; `_Isomorphism`), down to the forward's
  own values. The cotangent of P must come from ``dot_general(dO, v)``, and S's
  cotangent must feed exactly the two dots that make dQ and dK; dV is
  ``dot_general(dO, P)``. So nothing of the backward's algebra is
  pattern-matched by hand, and a form JAX writes differently in another
  version is still recognised (or, if the check fails, left alone).
- **Rewrite.** The O dot becomes ``attention_fwd(q, k, v[, mask]) -> (O, lse)``
  and the three gradient dots become ``attention_bwd(q, k, v, O, dO, lse[,
  mask]) -> (dQ, dK, dV)``. Operands are read through their views: a chain of
  transposes, reshapes that split or merge contiguous dims, and broadcasts
  (stride 0: a grouped-query k shared by several heads) becomes the strides a
  kernel reads the underlying buffer with, so no copy runs. After dead-code
  elimination every equation of the pattern must be gone (nothing else read
  the scores, the probabilities or their gradients); otherwise the match is
  dropped and the program stays as it was.
- **Masks.** A mask computed from constants alone (iotas and compares) is
  evaluated; where it is ``tril`` (``~tril`` for a hiding mask) the kernels
  skip the key blocks above the diagonal (``causal``). Any other mask is a
  bool operand read in the kernel.
- Each new equation carries its fallback, the equations it replaced: lowered
  by XLA where pallaskit does not run the kernels (``_fallback_lowering``).

- ``jax.checkpoint``: the backward recomputes the scores, mask and
  probabilities; they count as the forward's when they are the same
  equations over the same values (``_recomputed``). A recomputed forward with
  no ``P · v`` of its own gets a forward kernel for the O and lse its backward
  kernel reads.
- Scan bodies too ([Note: fused attention in scans]); the program, call
  bodies inlined, otherwise. Only static shapes, only 16-bit q, k, v, and only
  where raw Triton runs the kernels (``executors.wants_triton``). A pass that
  fails logs one line and leaves the program as it was.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import mlir

from lowering import trace
from lowering.trace import scan_counts
from lowering.codegen.attention import AttentionSpec, Layout

log = logging.getLogger("pallaskit")

# The largest constant mask (elements) evaluated at compile time to tell a causal one.
MAX_EVALUATED_MASK = 1 << 24
# Where the pass looks: only jaxprs holding both (cheap test before inlining anything).
_NEEDED = ("dot_general", "exp")
_VIEWS = ("transpose", "reshape", "broadcast_in_dim")


# --------------------------------------------------------------------------- #
# What a match hands the kernels
# --------------------------------------------------------------------------- #
class _Fallback:
    """The equations an attention equation replaced, as a callable XLA can lower
    (hashable by identity, as a primitive parameter must be)."""

    def __init__(self, run, n_eqns: int, lse: tuple | None = None, o_roles: tuple | None = None):
        # ``run``: the replayed equations (``_replayed``), bound only where XLA lowers this
        self.run, self.n_eqns, self.lse, self.o_roles = run, n_eqns, lse, o_roles

    def __call__(self, *args):
        outs = self.run(*args)
        if self.lse is None:
            return outs
        if self.o_roles is not None:  # O = P · v, P and v by their dims' roles
            p, v, *outs = outs
            letters: dict = {}
            spec = ["".join(letters.setdefault(r, chr(ord("a") + len(letters))) for r in roles)
                    for roles in self.o_roles]
            o = jax.numpy.einsum(f"{spec[0]},{spec[1]}->{spec[2]}", p, v, preferred_element_type=np.float32)
            outs = [o.astype(p.dtype), *outs]
        # the forward's row log-sum-exp from its max and sum outputs, in lse's dim order
        o, m, s = outs
        shape, order = self.lse
        lse = (m.reshape(shape) + jax.numpy.log(s.reshape(shape))).transpose(order)
        return [o, lse.astype(np.float32)]

    def __repr__(self):
        return f"<fallback of {self.n_eqns} equations>"


def _abstract(*args, spec, phase, out_avals, fallback, origin):
    return list(out_avals)


def _fallback_lowering(ctx, *args, spec, phase, out_avals, fallback, origin):
    return mlir.lower_fun(fallback, multiple_results=True)(ctx, *args)


attention_p = jex_core.Primitive("pallaskit_attention")
attention_p.multiple_results = True
attention_p.def_abstract_eval(_abstract)
mlir.register_lowering(attention_p, _fallback_lowering)


def _impl(*args, **params):
    return jax.jit(params["fallback"])(*args)


attention_p.def_impl(_impl)


# --------------------------------------------------------------------------- #
# The pass
# --------------------------------------------------------------------------- #
def enabled(options) -> bool:
    """Does the compiler fuse attention under ``options``: option ``fused_attention``,
    a static program, and raw Triton running the kernels (``executors.wants_triton``)."""
    from lowering import executors

    return options.fused_attention and not options.size_hints and executors.wants_triton("attention", options)


def fuse_attention(closed: jex_core.ClosedJaxpr) -> tuple[jex_core.ClosedJaxpr, list[str]]:
    """``closed`` with each attention it finds run by attention equations, and
    one line per rewrite; unchanged where none is found, or where the pass
    itself fails (logged: the program then runs as written)."""
    if not _may_hold(closed.jaxpr):
        return closed, []
    try:
        return _fuse(closed)
    except Exception as e:  # noqa: BLE001 - a pass that fails must not fail the user's program
        log.warning("pallaskit: the attention pass failed (%s: %s); attention runs as written",
                    type(e).__name__, str(e).splitlines()[0] if str(e) else "")
        return closed, []


def _fuse(closed: jex_core.ClosedJaxpr) -> tuple[jex_core.ClosedJaxpr, list[str]]:
    eqns, outvars = _flatten(closed.jaxpr)
    eqns = _live(eqns, outvars)
    consts = dict(zip(closed.jaxpr.constvars, closed.consts))  # a closed-over mask or bias
    graph = _Graph(eqns, outvars, consts)
    scans, lines = {}, []
    for i, e in enumerate(eqns):  # a scanned layer stack's attention ([Note: fused attention in scans])
        if e.primitive.name == "scan":
            new, more = _fused_scan(graph, e)
            if more:
                scans[i] = new
                lines += more
    if scans:
        eqns = [scans.get(i, e) for i, e in enumerate(eqns)]
        graph = _Graph(eqns, outvars, consts)
    rewrites, memo = [], {}
    used = set()
    for i, e in enumerate(eqns):
        if e.primitive.name != "dot_general" or i in used:
            continue
        try:
            r = _match(graph, i, memo)
        except _NoMatch as why:
            log.debug("attention at %s not fused: %s", e, why)
            continue
        if r is None or used & r.touched:
            continue
        rewrites.append(r)
        used |= r.touched
    while True:
        new_eqns = _apply(eqns, rewrites)
        live = _live(new_eqns, outvars)
        kept = {id(e) for e in live}
        bad = [r for r in rewrites if any(id(eqns[i]) in kept for i in r.replaced)]
        if not bad:
            lines += [f"attention: {r.describe()}" for r in rewrites]
            if not lines:
                return closed, []
            jaxpr = closed.jaxpr.replace(eqns=live, outvars=outvars)
            return jex_core.ClosedJaxpr(jaxpr, closed.consts), lines
        for r in bad:
            log.debug("attention not fused: its scores or probabilities have other readers")
        rewrites = [r for r in rewrites if r not in bad]


# [Note: fused attention in scans]
# A layer stack under lax.scan (flax's nn.scan, a scanned transformer) holds its
# attention in the scan's body, and jax hoists the body's loop-invariant values
# out as scan constants: the causal mask and the broadcast fill arrive as body
# inputs, so the body alone shows neither a scalar fill nor a constant mask. The
# scan's body is searched with the outer equations computing such constants (from
# literals alone) copied in front of it; where attention is found, the rewritten
# body replaces the scan's (its inputs and outputs unchanged, the copies that only
# the scores read dead). A checkpointed layer (nn.remat) recomputes its forward
# in the backward scan's body, which then holds the whole pattern.
def _fused_scan(graph, eqn):
    """(``eqn``, a scan, with attention fused in its body; the rewrites' lines)."""
    body, (n, _) = eqn.params["jaxpr"], scan_counts(eqn.params)
    if not isinstance(body, jex_core.ClosedJaxpr) or not _may_hold(body.jaxpr):
        return eqn, []
    env: dict = {}
    copies: list = []
    sub: dict = {}
    for inner, outer in zip(body.jaxpr.invars[:n], eqn.invars[:n]):
        need: list = []
        if isinstance(outer, jex_core.Literal) or not _constant(graph, outer, need):
            continue
        for j in sorted(need):
            f = graph.eqns[j]
            if f.outvars[0] in env:
                continue
            outs = [o if isinstance(o, jex_core.DropVar) else env.setdefault(o, jex_core.Var(o.aval))
                    for o in f.outvars]
            copies.append(f.replace(invars=[x if isinstance(x, jex_core.Literal) else env.get(x, x)
                                            for x in f.invars], outvars=outs))
        sub[inner] = env[outer]

    def get(x):
        return x if isinstance(x, jex_core.Literal) else sub.get(x, x)

    eqns = copies + [e.replace(invars=[get(x) for x in e.invars]) for e in body.jaxpr.eqns]
    augmented = body.jaxpr.replace(eqns=eqns, outvars=[get(x) for x in body.jaxpr.outvars])
    fused, lines = fuse_attention(jex_core.ClosedJaxpr(augmented, body.consts))
    if not lines:
        return eqn, []
    return eqn.replace(params={**eqn.params, "jaxpr": fused}), [f"{line} (in a scan's body)" for line in lines]


class _NoMatch(Exception):
    pass


def _may_hold(jaxpr) -> bool:
    names = set()

    def walk(j):
        for e in j.eqns:
            names.add(e.primitive.name)
            body = trace.inlined_body(e)
            if body is not None:
                walk(body[0])
            elif e.primitive.name == "scan" and isinstance(e.params.get("jaxpr"), jex_core.ClosedJaxpr):
                walk(e.params["jaxpr"].jaxpr)

    walk(jaxpr)
    return all(n in names for n in _NEEDED)


def _flatten(jaxpr) -> tuple[list, list]:
    """(equations, outputs) with call bodies (jit, custom_jvp, ...) inlined, each
    inlined equation's results given fresh variables (a body called twice)."""
    out = []

    def emit(j, env):
        def get(v):
            return v if isinstance(v, jex_core.Literal) else env.get(v, v)

        for e in j.eqns:
            body = trace.inlined_body(e)
            if body is not None and not body[1] and not e.effects:
                sub, _, first = body
                inner = {b: get(a) for b, a in zip(sub.invars, e.invars[first:])}
                emit(sub, inner)
                for o, so in zip(e.outvars, sub.outvars):
                    if not isinstance(o, jex_core.DropVar):
                        env[o] = so if isinstance(so, jex_core.Literal) else inner.get(so, so)
                continue
            outvars = e.outvars
            if j is not jaxpr:  # a body's variables: fresh ones at each call
                outvars = [o if isinstance(o, jex_core.DropVar) else env.setdefault(o, jex_core.Var(o.aval))
                           for o in e.outvars]
                for o, n in zip(e.outvars, outvars):
                    env[o] = n
            out.append(e.replace(invars=[get(v) for v in e.invars], outvars=list(outvars)))

    top: dict = {}
    emit(jaxpr, top)
    return out, [v if isinstance(v, jex_core.Literal) else top.get(v, v) for v in jaxpr.outvars]


def _live(eqns, outvars) -> list:
    live = {v for v in outvars if not isinstance(v, jex_core.Literal)}
    kept = []
    for e in reversed(eqns):
        if e.effects or any(v in live for v in e.outvars if not isinstance(v, jex_core.DropVar)):
            kept.append(e)
            live.update(v for v in e.invars if not isinstance(v, jex_core.Literal))
    return kept[::-1]


# --------------------------------------------------------------------------- #
# The program's dataflow
# --------------------------------------------------------------------------- #
class _Graph:
    def __init__(self, eqns, outvars, consts: dict | None = None):
        self.eqns = eqns
        self.consts = consts or {}  # the jaxpr's constants: constvar -> value
        self.producer: dict = {}
        self.readers: dict = {}
        for i, e in enumerate(eqns):
            for o in e.outvars:
                if not isinstance(o, jex_core.DropVar):
                    self.producer[o] = i
            for v in e.invars:
                if not isinstance(v, jex_core.Literal):
                    self.readers.setdefault(v, []).append(i)
        self.outputs = {v for v in outvars if not isinstance(v, jex_core.Literal)}

    def made_by(self, v, *names):
        """The equation (index) making ``v`` if its primitive is one of ``names``."""
        if isinstance(v, jex_core.Literal):
            return None
        i = self.producer.get(v)
        if i is None or (names and self.eqns[i].primitive.name not in names):
            return None
        return i

    def read_by(self, v) -> list:
        return self.readers.get(v, [])

    def only_reader(self, v):
        r = self.read_by(v)
        return r[0] if len(r) == 1 and v not in self.outputs else None


def _literal(x):
    """A scalar literal's value (through a broadcast of one), else None."""
    if isinstance(x, jex_core.Literal) and np.shape(x.val) == ():
        return float(np.asarray(x.val))
    return None


def _scalar(graph, x):
    """The value of ``x`` where it is one scalar computed from literals alone,
    through broadcasts and converts of it (a literal, ``sqrt(8.0)``,
    ``jnp.where``'s fill ``-1e30`` converted to bfloat16), rounded as the
    program rounds it at each convert; else None."""
    casts = []
    while not isinstance(x, jex_core.Literal) and x.aval.shape != ():
        i = graph.made_by(x, "broadcast_in_dim", "convert_element_type")
        if i is None:
            return None
        if graph.eqns[i].primitive.name == "convert_element_type":
            casts.append(x.aval.dtype)
        x = graph.eqns[i].invars[0]
    if isinstance(x, jex_core.Literal):
        if np.shape(x.val) != ():
            return None
        value = np.asarray(x.val, x.aval.dtype)
    else:
        eqns: list = []
        if not _constant(graph, x, eqns) or any(graph.eqns[j].effects for j in eqns):
            return None
        value = _evaluated(graph, eqns, x)
    for dtype in reversed(casts):
        value = np.asarray(value, dtype)
    return float(value)


# --------------------------------------------------------------------------- #
# Dots: which dim of each operand is which
# --------------------------------------------------------------------------- #
# Roles: ("b", i) the i-th batch dim, "q" query positions, "k" key positions,
# "d" the q/k head dim, "e" the v/o head dim.
def _free(ndim, contracting, batch):
    return [a for a in range(ndim) if a not in contracting and a not in batch]


def _one(role) -> bool:
    """A size-1 dim outside the pattern's own (jax.nn.dot_product_attention's head group)."""
    return isinstance(role, tuple) and role[0] == "one"


def _pick(aval, free: list):
    """Which of a dot operand's free dims is the sequence (or head) dim: the one
    larger than 1 (the last where all are 1); None where two are larger."""
    big = [a for a in free if aval.shape[a] != 1]
    return None if len(big) > 1 or not free else (big[0] if big else free[-1])


def _pair(eqn, known: int, roles: dict, free_role):
    """Given the roles of operand ``known``'s dims, the other operand's (its
    free dim taking ``free_role``, any other free dims of size 1), the
    contracted roles and the output's roles."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = (v.aval for v in eqn.invars)
    kc, oc, kb, ob = (lc, rc, lb, rb) if known == 0 else (rc, lc, rb, lb)
    other_aval = rhs if known == 0 else lhs
    other = {b: roles[a] for a, b in zip(kc, oc)}
    other.update({b: roles[a] for a, b in zip(kb, ob)})
    free = _free(other_aval.ndim, oc, ob)
    pick = _pick(other_aval, free)
    if pick is None:
        raise _NoMatch(f"{eqn.primitive.name}: the other operand has {len(free)} free dims")
    other.update({a: free_role if a == pick else ("one", id(eqn), a) for a in free})
    lroles, rroles = (roles, other) if known == 0 else (other, roles)
    out = ([lroles[a] for a in lb] + [lroles[a] for a in _free(lhs.ndim, lc, lb)]
           + [rroles[a] for a in _free(rhs.ndim, rc, rb)])
    return other, {roles[a] for a in kc if not _one(roles[a])}, out


def _dot_plain(eqn) -> bool:
    """A dot at default precision, or with the algorithm a 16-bit tl.dot runs
    (``BF16_BF16_F32``, as jax.nn.dot_product_attention asks: both operands
    rounded to bfloat16, a float32 one included, as the kernels round theirs)."""
    p = eqn.params.get("precision")
    dtypes = {str(v.aval.dtype) for v in eqn.invars}
    ok = ["DEFAULT"]
    for half, algorithm in (("bfloat16", "BF16_BF16_F32"), ("float16", "F16_F16_F32")):
        if half in dtypes and dtypes <= {half, "float32"}:
            ok.append(algorithm)
    return all(x is None or str(x).endswith(tuple(ok)) for x in (p if isinstance(p, tuple) else (p,)))


# --------------------------------------------------------------------------- #
# Views: strides of a value in the buffer it is a view of
# --------------------------------------------------------------------------- #
def _contiguous(shape) -> list:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def _reshape_strides(shape, strides, new):
    """Strides of ``reshape(x, new)`` over x's buffer, or None where the reshape
    needs a copy (numpy's no-copy reshape)."""
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    out = [0] * len(new)
    i = j = 0
    while i < len(old):
        while j < len(new) and new[j] == 1:
            j += 1
        if j == len(new):
            return None
        i0, j0, pi, pj = i, j, old[i][0], new[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i == len(old):
                    return None
                pi *= old[i][0]
            else:
                j += 1
                if j == len(new):
                    return None
                pj *= new[j]
        for a in range(i0, i):
            if old[a][1] != old[a + 1][1] * old[a + 1][0]:
                return None
        s = old[i][1]
        for a in range(j, j0 - 1, -1):
            out[a] = s
            s *= new[a]
        i, j = i + 1, j + 1
    return out


def _strided(graph, v):
    """(buffer variable, strides of ``v``'s dims in it): ``v`` followed back
    through transposes, copy-free reshapes and broadcasts."""
    chain, base = [], v
    while True:
        i = graph.made_by(base, *_VIEWS)
        if i is None or isinstance(graph.eqns[i].invars[0], jex_core.Literal):
            break
        chain.append(i)
        base = graph.eqns[i].invars[0]
    strides = _contiguous(base.aval.shape)
    for k in range(len(chain) - 1, -1, -1):
        e = graph.eqns[chain[k]]
        x, out = e.invars[0], e.outvars[0]
        if e.primitive.name == "transpose":
            new = [strides[p] for p in e.params["permutation"]]
        elif e.primitive.name == "broadcast_in_dim":
            new = [0] * out.aval.ndim
            for a, d in enumerate(e.params["broadcast_dimensions"]):
                new[d] = strides[a] if x.aval.shape[a] == out.aval.shape[d] else 0
        else:
            new = None if e.params.get("dimensions") is not None else _reshape_strides(
                x.aval.shape, strides, out.aval.shape)
        if new is None:  # read from this view's own buffer (stored by the program)
            base, strides, chain = out, _contiguous(out.aval.shape), chain[:k]
            continue
        strides = new
    return base, strides


def _absorbed(graph, v, dtype: str):
    """(value, strides of ``v``'s dims in its buffer, the absorbed equations): a
    kernel writing ``v`` writes, in ``dtype``, what a chain of sole readers makes
    of it instead: transposes (no copy after the kernel) and one convert to
    ``dtype`` (a float32 product the program rounds: jax.nn.dot_product_attention's
    gradients). No match where the value never reaches ``dtype``."""
    eqns, perm = [], list(range(v.aval.ndim))
    for _ in range(4):
        r = graph.only_reader(v)
        f = None if r is None else graph.eqns[r]
        if f is not None and f.primitive.name == "transpose":
            perm = [perm[a] for a in f.params["permutation"]]
        elif (f is not None and f.primitive.name == "convert_element_type" and str(v.aval.dtype) != dtype
              and str(f.outvars[0].aval.dtype) == dtype):
            pass
        else:
            break
        eqns.append(r)
        v = f.outvars[0]
    if str(v.aval.dtype) != dtype:
        raise _NoMatch("a product of another dtype")
    ct, strides = _contiguous(v.aval.shape), [0] * len(perm)
    for j, a in enumerate(perm):
        strides[a] = ct[j]
    return v, strides, eqns


def _layout(roles: list, strides, nb: int, t: str, d: str) -> Layout:
    where = {r: a for a, r in enumerate(roles) if not _one(r)}
    if len(where) != sum(not _one(r) for r in roles) or set(where) != {("b", i) for i in range(nb)} | {t, d}:
        raise _NoMatch(f"dims {roles} are not batch, {t}, {d}")
    return Layout(tuple(int(strides[where[("b", i)]]) for i in range(nb)), int(strides[where[t]]),
                  int(strides[where[d]]))


# --------------------------------------------------------------------------- #
# The forward: scores, softmax, values
# --------------------------------------------------------------------------- #
_FLOATS = ("bfloat16", "float16", "float32")
# q, k, v dtypes fused. Not float32: XLA runs its dots as TF32 on the GPU, and the
# kernel's own TF32 products, summed in another order, would differ from jax.jit's
# by TF32's rounding (~1e-3), far past float32's tolerance.
_16BIT = ("bfloat16", "float16")


@dataclasses.dataclass
class _Forward:
    s_dot: int
    o_dot: int
    chain: list  # the equations from S to P (P made by the last)
    s: object  # S, the scores dot's result
    p: object  # P, read by the values dot
    mask: object  # the select_n predicate (S's shape) or None
    frees: list  # variables the chain reads besides S (the mask)
    scale: float
    fill: float
    rowmax: object  # the row max and row sum (for the fallback's lse)
    rowsum: object
    q_roles: dict
    k_roles: dict
    v_roles: dict
    o_roles: list
    nb: int
    s_roles: list  # of S's dims: ("b", i), "q", "k", or a size-1 dim's ("one", ...)
    p_roles: list  # of P's dims (the chain may transpose the scores)
    mask_roles: list | None  # of the mask's dims
    row_roles: list  # of the row max's and row sum's dims
    bias: object = None  # an additive bias (S's shape) and its dims' roles, or None
    bias_roles: list | None = None
    mask_hides: bool = False  # the mask is True at the hidden scores: where(mask, fill, s)


# What may sit between a row max or sum and its use: keepdims reshapes, broadcasts,
# transposes, converts, stop_gradient, and jnp.max's floor max(m, -inf).
_ROW_STEPS = ("reshape", "broadcast_in_dim", "convert_element_type", "stop_gradient", "max", "transpose")


def _path(graph, start, through, goal, depth: int = 5):
    """The equations from ``start`` through one-operand steps named in
    ``through`` to the one equation ``goal(eqn, value)`` accepts (included);
    None where there is none or more than one."""
    found = []

    def walk(v, path, depth):
        for r in graph.read_by(v):
            e = graph.eqns[r]
            if goal(e, v):
                found.append(path + [r])
            elif depth and e.primitive.name in through and e.invars[0] is v and (
                    e.primitive.name != "max" or _literal(e.invars[1]) == -math.inf):
                walk(e.outvars[0], path + [r], depth - 1)
            elif depth and e.primitive.name == "max" and e.invars[1] is v and _literal(e.invars[0]) == -math.inf:
                walk(e.outvars[0], path + [r], depth - 1)

    walk(start, [], depth)
    return found[0] if len(found) == 1 else None


def _forward(graph, i) -> _Forward:
    e = graph.eqns[i]
    (lc, rc), (lb, rb) = e.params["dimension_numbers"]
    lhs, rhs = (v.aval for v in e.invars)
    lfree, rfree = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    qa, ka = _pick(lhs, lfree), _pick(rhs, rfree)
    if len(lc) != 1 or qa is None or ka is None:
        raise _NoMatch("not a q·kᵀ product")
    if not _dot_plain(e) or any(str(a.dtype) not in _16BIT for a in (lhs, rhs)) or lhs.dtype != rhs.dtype:
        raise _NoMatch("operand dtypes or precision")
    if not all(isinstance(n, int) for n in e.outvars[0].aval.shape):
        raise _NoMatch("symbolic sizes")
    nb = len(lb)
    q_roles = {a: ("b", n) for n, a in enumerate(lb)} | {a: "q" if a == qa else ("one", "q", a) for a in lfree}
    k_roles = {a: ("b", n) for n, a in enumerate(rb)} | {a: "k" if a == ka else ("one", "k", a) for a in rfree}
    q_roles[lc[0]], k_roles[rc[0]] = "d", "d"
    s_roles = [("b", n) for n in range(nb)] + [q_roles[a] for a in lfree] + [k_roles[a] for a in rfree]
    s = e.outvars[0]
    x, roles, chain, scale, fill, mask, mask_roles, frees = s, list(s_roles), [], 1.0, None, None, None, []
    bias, bias_roles = None, None
    hides = False

    def next_eqn(v, *names):
        j = graph.only_reader(v)
        if j is None:  # read by the backward too: the forward's next step is one of its readers
            js = [r for r in graph.read_by(v) if graph.eqns[r].primitive.name in names]
            j = js[0] if len(js) == 1 else None
        if j is None or graph.eqns[j].primitive.name not in names:
            return None
        return j

    # the scores' prologue: widening converts, a scalar scale, a mask, transposes and
    # size-1 reshapes of the scores, any order
    while True:
        j = next_eqn(x, "convert_element_type", "mul", "div", "add", "select_n", "transpose", "reshape",
                     "reduce_max")
        maxes = [r for r in graph.read_by(x) if graph.eqns[r].primitive.name == "reduce_max"]
        if j is None and len(maxes) == 1:  # the max taken before a view of the scores (dot_product_attention)
            j = maxes[0]
        if j is None:
            raise _NoMatch("no softmax over the scores")
        f = graph.eqns[j]
        name = f.primitive.name
        if name == "reduce_max":
            break
        if name == "convert_element_type":
            if np.dtype(f.params["new_dtype"]).itemsize < np.dtype(x.aval.dtype).itemsize:
                raise _NoMatch("a narrowing convert")
        elif name == "transpose":
            roles = [roles[a] for a in f.params["permutation"]]
        elif name == "reshape":
            roles = _reshaped_roles(roles, x.aval.shape, f.outvars[0].aval.shape, j)
        elif name == "add":  # an additive bias (flax's bias=, ALiBi, T5), before any mask
            other = f.invars[1] if f.invars[0] is x else f.invars[0]
            if (bias is not None or mask is not None or isinstance(other, jex_core.Literal) or other is x
                    or other.aval.ndim != x.aval.ndim
                    or any(n not in (1, m) for n, m in zip(other.aval.shape, x.aval.shape))):
                raise _NoMatch("an addition that is not one bias before the mask")
            bias, bias_roles = other, list(roles)
            frees.append(bias)
        elif name in ("mul", "div"):
            a, b = f.invars
            c = _scalar(graph, b) if a is x else (_scalar(graph, a) if name == "mul" and b is x else None)
            if c is None or c == 0 or not math.isfinite(c):
                raise _NoMatch(f"{name} by a non-scalar")
            if bias is not None:
                raise _NoMatch("a scale after the bias")
            if fill is not None:  # a scale after the mask scales the fill, rounded as the program rounds it
                with np.errstate(over="ignore"):  # float16's min / 0.5 is -inf
                    f_, c_ = (np.asarray(y, f.outvars[0].aval.dtype) for y in (fill, c))
                    fill = float(f_ * c_ if name == "mul" else f_ / c_)
            c = c if name == "mul" else 1.0 / c
            scale *= c
        else:  # select_n(pred, on_false, on_true): jnp.where(mask, s, fill), or where(mask, fill, s)
            # (nanoGPT's where(mask == 0, -inf, s)): the mask then marks the hidden scores
            if mask is not None or len(f.invars) != 3 or x not in f.invars[1:] or f.invars[1] is f.invars[2]:
                raise _NoMatch("a select that is not where(mask, scores, fill)")
            hides = f.invars[1] is x
            fill = _scalar(graph, f.invars[2 if hides else 1])
            if fill is None:
                raise _NoMatch("a mask's fill that is not a scalar")
            mask, mask_roles = f.invars[0], list(roles)
            if getattr(mask.aval, "shape", None) != x.aval.shape or str(mask.aval.dtype) != "bool":
                raise _NoMatch("a mask of another shape")
            frees.append(mask)
        chain.append(j)
        x = f.outvars[0]
    # softmax: e = exp(x - max), p = e / sum(e), over the key dim
    f = graph.eqns[j]
    key_axis = roles.index("k")
    if tuple(f.params["axes"]) != (key_axis,):
        raise _NoMatch("a max over another dim")
    rowmax = f.outvars[0]
    row_roles = roles[:key_axis] + roles[key_axis + 1:]
    chain.append(j)
    # the scores as the subtraction reads them: x, or a transpose / size-1 reshape of it
    views, v_eqns, y, y_roles = {x: (list(roles), [])}, [], x, list(roles)
    while True:
        r = [t for t in graph.read_by(y) if graph.eqns[t].primitive.name in ("transpose", "reshape")]
        if len(r) != 1:
            break
        g = graph.eqns[r[0]]
        y_roles = ([y_roles[a] for a in g.params["permutation"]] if g.primitive.name == "transpose" else
                   _reshaped_roles(y_roles, y.aval.shape, g.outvars[0].aval.shape, r[0]))
        v_eqns = v_eqns + [r[0]]
        y = g.outvars[0]
        views[y] = (list(y_roles), v_eqns)
    # max(m, -inf) (jnp.max's initial), keepdims reshape / broadcast, stop_gradient, then x - max
    path = _path(graph, rowmax, _ROW_STEPS, lambda e, v: e.primitive.name == "sub" and e.invars[1] is v
                 and not isinstance(e.invars[0], jex_core.Literal) and e.invars[0] in views)
    if path is None:
        raise _NoMatch("no x - max")
    x = graph.eqns[path[-1]].invars[0]
    roles, more = views[x]
    chain += more + path
    key_axis = roles.index("k")
    j = next_eqn(graph.eqns[path[-1]].outvars[0], "exp")
    if j is None:
        raise _NoMatch("no exp")
    chain.append(j)
    ex = graph.eqns[j].outvars[0]
    path = _path(graph, ex, ("convert_element_type",), lambda e, v: e.primitive.name == "reduce_sum"
                 and tuple(e.params["axes"]) == (key_axis,))
    if path is None:
        raise _NoMatch("no row sum of exp")
    chain += path
    rowsum = graph.eqns[path[-1]].outvars[0]
    sum_roles = roles[:key_axis] + roles[key_axis + 1:]
    if [r for r in sum_roles if not _one(r)] != [r for r in row_roles if not _one(r)]:
        raise _NoMatch("the row max and sum in other orders")
    path = _path(graph, rowsum, _ROW_STEPS, lambda e, v: e.primitive.name == "div" and e.invars == [ex, v])
    if path is None:
        raise _NoMatch("no exp / sum")
    chain += path
    div = path[-1]
    p = graph.eqns[div].outvars[0]
    # the values dot, after an optional convert to v's dtype
    o_dot = None
    for _ in range(2):
        dots = [r for r in graph.read_by(p) if graph.eqns[r].primitive.name == "dot_general"]
        conv = [r for r in graph.read_by(p) if graph.eqns[r].primitive.name == "convert_element_type"]
        if dots:
            o_dot = dots
            break
        if len(conv) != 1:
            break
        chain.append(conv[0])
        p = graph.eqns[conv[0]].outvars[0]
    if not o_dot:
        raise _NoMatch("no P · v")
    for od in o_dot:  # P · v: contracts the key dim; the dV dot contracts the query dim
        g = graph.eqns[od]
        known = 0 if g.invars[0] is p else 1
        if g.invars[1 - known] is p:
            continue
        try:
            v_roles, contracted, o_roles = _pair(g, known, dict(enumerate(roles)), "e")
        except _NoMatch:
            continue
        if contracted == {"k"} and _dot_plain(g):
            break
    else:  # no O: a backward's recomputed forward (jax.checkpoint), v from dO · vᵀ
        od, v_roles, o_roles = None, None, None
    return _Forward(i, od, chain, s, p, mask, frees, scale, -math.inf if fill is None else fill, rowmax, rowsum,
                    q_roles, k_roles, v_roles, o_roles, nb, s_roles, roles, mask_roles, row_roles,
                    bias=bias, bias_roles=bias_roles, mask_hides=hides)


def _reshaped_roles(roles: list, shape, new_shape, j) -> list:
    """The roles of a reshape that only adds or drops dims of size 1 (else no match)."""
    old = [(r, n) for r, n in zip(roles, shape) if not (_one(r) and n == 1)]
    out, k = [], 0
    for a, n in enumerate(new_shape):
        if k < len(old) and old[k][1] == n and (n != 1 or not _one(old[k][0])):
            out.append(old[k][0])
            k += 1
        elif n == 1:
            out.append(("one", "reshape", j, a))
        else:
            raise _NoMatch("a reshape of the scores")
    if k != len(old):
        raise _NoMatch("a reshape of the scores")
    return out


def _constant(graph, v, out: list) -> bool:
    """Whether ``v`` is computed from literals and the jaxpr's constants alone;
    its equations added to ``out``."""
    if isinstance(v, jex_core.Literal) or v in graph.consts:
        return True
    i = graph.made_by(v)
    if i is None:
        return False
    if i in out:
        return True
    if all(_constant(graph, x, out) for x in graph.eqns[i].invars):
        out.append(i)
        return True
    return False


def _evaluated(graph, eqns: list, v) -> np.ndarray:
    """The value of ``v``, computed by ``eqns`` from literals and constants
    (``_constant``): eagerly, even where pallaskit compiles inside an outer
    trace; on the host where this process has jax's CPU backend, else (say
    ``JAX_PLATFORMS=cuda``) on the default device, which runs the program."""
    with jax.ensure_compile_time_eval(), _host_device():
        return np.asarray(_replayed(graph, eqns, [], v)())


def _host_device():
    """``jax.default_device`` of the CPU, or no change where jax has no CPU backend."""
    try:
        cpu = jax.devices("cpu")[0]
    except RuntimeError:  # "Unknown backend cpu": the attention pass failed there (JAX_PLATFORMS=cuda)
        return contextlib.nullcontext()
    return jax.default_device(cpu)


def _closure(graph, outputs: list, inputs: list) -> list:
    """The equations computing ``outputs`` from ``inputs`` (and literals): what
    an attention equation's fallback replays. No match where they would read
    another value (the kernels' operands are all the fallback gets)."""
    stop, need, stack = set(inputs), set(), list(outputs)
    while stack:
        v = stack.pop()
        if isinstance(v, jex_core.Literal) or v in stop or v in graph.consts:
            continue
        i = graph.made_by(v)
        if i is None:
            raise _NoMatch("the replaced equations read a value the kernels do not")
        if i not in need:
            need.add(i)
            stack.extend(graph.eqns[i].invars)
    return sorted(need)


def _replayed(graph, eqns, inputs: list, output):
    """A function of ``inputs`` (variables) running ``eqns`` (indices) as the
    program does; it returns ``output`` (a variable, or a list of them)."""
    order = sorted(set(eqns))

    def run(*vals):
        env = {**graph.consts, **dict(zip(inputs, vals))}
        for j in order:
            e = graph.eqns[j]
            args = [x.val if isinstance(x, jex_core.Literal) else env[x] for x in e.invars]
            outs = e.primitive.bind(*args, **e.params)
            outs = outs if e.primitive.multiple_results else [outs]
            env.update(zip(e.outvars, outs))
        return [env[o] for o in output] if isinstance(output, list) else env[output]

    return run


# --------------------------------------------------------------------------- #
# The backward: the program's cotangent of S is JAX's own vjp of the chain
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class _Backward:
    ds: object
    dp_dot: int
    dv_dot: int
    dq_dot: int
    dk_dot: int
    do: object
    do_roles: dict
    image: set  # the program's equations the cotangent of S is made of
    p_dv: object  # the P the dV dot reads: the forward's, or computed again (jax.checkpoint)
    v: object  # v, and its dims' roles
    v_roles: dict


def _struct(x):
    return jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)


def _chain_key(graph, eqns: list, inputs: list, output):
    """A forward chain's structure, the same for two chains whose replays JAX
    differentiates alike: each equation's primitive, parameters and operands
    (which input, earlier result or literal), the inputs' types; None where it
    reads anything else (a constant array)."""
    ref = {v: ("in", n) for n, v in enumerate(inputs)}
    parts = []
    for k, j in enumerate(eqns):
        e = graph.eqns[j]
        ins = tuple(("lit", repr(np.asarray(x.val).tolist()), str(x.aval.dtype)) if isinstance(x, jex_core.Literal)
                    else ref.get(x) for x in e.invars)
        if None in ins:
            return None
        for n, o in enumerate(e.outvars):
            ref[o] = ("eq", k, n)
        parts.append((e.primitive.name, repr(sorted(e.params.items())), ins,
                      tuple((str(o.aval.dtype), tuple(o.aval.shape)) for o in e.outvars)))
    return tuple(parts), tuple((str(v.aval.dtype), tuple(v.aval.shape)) for v in inputs), ref.get(output)


def _backward(graph, fwd: _Forward, constants: list, memo: dict):
    s_eqn = graph.eqns[fwd.s_dot]
    qv, kv = s_eqn.invars
    full = fwd.s.aval.shape
    # S's cotangent: the one operand of a dot with k and of a dot with q
    cands = []
    for r in graph.read_by(kv):
        g = graph.eqns[r]
        if r == fwd.s_dot or g.primitive.name != "dot_general":
            continue
        x = g.invars[0] if g.invars[1] is kv else g.invars[1]
        if isinstance(x, jex_core.Literal) or x.aval.shape != full:
            continue
        with_q = [t for t in graph.read_by(x) if graph.eqns[t].primitive.name == "dot_general"
                  and qv in graph.eqns[t].invars and t != r]
        if len(with_q) == 1:
            cands.append((x, r, with_q[0]))
    if len(cands) != 1:
        return None
    ds, dq_dot, dk_dot = cands[0]
    inputs = [fwd.s, *fwd.frees]
    key = _chain_key(graph, sorted(set(fwd.chain + constants)), inputs, fwd.p)
    if key is None or key not in memo:  # every layer of a model has the same chain: derived once
        run = _replayed(graph, fwd.chain + constants, inputs, fwd.p)

        def vjp(s, *rest):
            frees, ct = rest[:-1], rest[-1]
            return jax.vjp(lambda s_: run(s_, *frees), s)[1](ct)[0]

        derived = jax.make_jaxpr(vjp)(*map(_struct, inputs), _struct(fwd.p))
        if derived.consts:
            return None
        d_eqns, d_outs = _flatten(derived.jaxpr)
        found = (d_eqns, d_outs, derived.jaxpr.invars)
        if key is not None:
            memo[key] = found
    else:
        found = memo[key]
    d_eqns, d_outs, d_in = found
    iso = _Isomorphism(graph, d_eqns, {d_in[0]: fwd.s, **dict(zip(d_in[1:-1], fwd.frees))}, ct=d_in[-1])
    if not iso.same(ds, d_outs[0]):
        raise _NoMatch("the scores' cotangent is not the softmax's gradient")
    ct = iso.bound.get(d_in[-1])
    views = []  # dO · vᵀ may reach P's layout through transposes (flax nnx, jax.nn.dot_product_attention)
    while graph.made_by(ct, "transpose", "reshape") is not None and len(views) < 4:
        views.insert(0, graph.made_by(ct))
        ct = graph.eqns[views[0]].invars[0]
    dp_dot = graph.made_by(ct, "dot_general")
    if dp_dot is None:
        raise _NoMatch("P's cotangent is not dO · vᵀ")
    g = graph.eqns[dp_dot]
    p_roles = [r if not _one(r) else None for r in fwd.p_roles]
    if fwd.o_dot is not None:  # v as the forward's P · v reads it
        o_eqn = graph.eqns[fwd.o_dot]
        vv = o_eqn.invars[1] if o_eqn.invars[0] is fwd.p else o_eqn.invars[0]
        if vv not in g.invars:
            raise _NoMatch("P's cotangent is not dO · vᵀ")
        known = 0 if g.invars[0] is vv else 1
        do_roles, contracted, out = _pair(g, known, fwd.v_roles, "q")
        v_roles = fwd.v_roles
    else:  # no P · v (a recomputed forward): dO's dims from dV = Pᵀ · dO, then v's from dO · vᵀ
        dv = [r for r in graph.read_by(fwd.p) if graph.eqns[r].primitive.name == "dot_general"]
        if len(dv) != 1:
            raise _NoMatch("no dV = Pᵀ · dO")
        h = graph.eqns[dv[0]]
        known_p = 0 if h.invars[0] is fwd.p else 1
        do_roles, contracted, _ = _pair(h, known_p, dict(enumerate(fwd.p_roles)), "e")
        if contracted != {"q"} or h.invars[1 - known_p] not in g.invars:
            raise _NoMatch("no dV = Pᵀ · dO")
        known = g.invars.index(h.invars[1 - known_p])
        v_roles, contracted, out = _pair(g, known, do_roles, "k")
        vv = g.invars[1 - known]
        known = 1 - known  # v's side
    for j in views:  # the dot's dims as P's cotangent has them
        f = graph.eqns[j]
        out = ([out[a] for a in f.params["permutation"]] if f.primitive.name == "transpose" else
               _reshaped_roles(out, f.invars[0].aval.shape, f.outvars[0].aval.shape, j))
    if contracted != {"e"} or [r if not _one(r) else None for r in out] != p_roles or not _dot_plain(g):
        raise _NoMatch("dO · vᵀ in another order")
    do = g.invars[1 - known]
    dv_dot, p_dv = None, None
    for r in graph.read_by(do):  # dV = Pᵀ · dO, P the forward's or recomputed (jax.checkpoint)
        h = graph.eqns[r]
        other = h.invars[0] if h.invars[1] is do else h.invars[1]
        if (r != dp_dot and h.primitive.name == "dot_general" and other is not do
                and _recomputed(graph, fwd.p, other, {})):
            dv_dot, p_dv = r, other
    if dv_dot is None:
        raise _NoMatch("no dV = Pᵀ · dO")
    return _Backward(ds, dp_dot, dv_dot, dq_dot, dk_dot, do, do_roles, iso.image, p_dv, vv, v_roles)


class _Isomorphism:
    """Whether a program value is computed as a derived one: the same
    primitives with the same parameters over operands that are the same in
    turn, down to the derived inputs (bound to program values; ``ct`` binds to
    whatever the program has in its place)."""

    def __init__(self, graph, d_eqns, bound: dict, ct):
        self.graph, self.bound, self.ct = graph, dict(bound), ct
        self.d_producer = {}
        for e in d_eqns:
            for o in e.outvars:
                self.d_producer[o] = e
        self.memo: dict = {}
        self.image: set = set()

    def same(self, ov, dv) -> bool:
        if isinstance(dv, jex_core.Literal) or isinstance(ov, jex_core.Literal):
            if isinstance(dv, jex_core.Literal) and not isinstance(ov, jex_core.Literal):
                # a constant the replay folded (a convert of a literal): the program computes it
                c = _scalar(self.graph, ov) if np.shape(dv.val) == () else None
                return c is not None and _same_value(c, dv.val) and ov.aval.dtype == dv.aval.dtype
            return (isinstance(dv, jex_core.Literal) and isinstance(ov, jex_core.Literal)
                    and _same_value(ov.val, dv.val) and ov.aval.dtype == dv.aval.dtype)
        if dv in self.bound:  # the forward's value, or the same computed again (jax.checkpoint's recompute)
            return self.bound[dv] is ov or _recomputed(self.graph, self.bound[dv], ov, {})
        if dv is self.ct:
            self.bound[dv] = ov
            return True
        key = (id(ov), id(dv))
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = False
        de, oi = self.d_producer.get(dv), self.graph.made_by(ov)
        if de is None or oi is None:
            return False
        oe = self.graph.eqns[oi]
        ok = (de.primitive is oe.primitive and len(de.invars) == len(oe.invars)
              and de.outvars.index(dv) == oe.outvars.index(ov) and _same_params(de.params, oe.params)
              and all(self.same(a, b) for a, b in zip(oe.invars, de.invars)))
        self.memo[key] = ok
        if ok:
            self.image.add(oi)
        return ok


def _recomputed(graph, a, b, memo: dict, depth: int = 64) -> bool:
    """Whether ``b`` is ``a`` computed again by the same equations from the same
    values: what ``jax.checkpoint`` makes its backward do (the remat'd forward
    recomputes the scores and the mask from the saved q and k)."""
    if a is b:
        return True
    if isinstance(a, jex_core.Literal) or isinstance(b, jex_core.Literal):
        return (isinstance(a, jex_core.Literal) and isinstance(b, jex_core.Literal)
                and _same_value(a.val, b.val) and a.aval.dtype == b.aval.dtype)
    for x, y in ((a, b), (b, a)):  # an optimization barrier (remat's prevent_cse) passes its operands through
        i = graph.made_by(y, "optimization_barrier")
        if i is not None:
            return _recomputed(graph, x, graph.eqns[i].invars[graph.eqns[i].outvars.index(y)], memo, depth - 1)
    key = (id(a), id(b))
    if key not in memo:
        ia, ib = graph.made_by(a), graph.made_by(b)
        memo[key] = False
        if ia is None or ib is None or depth == 0:
            return False
        ea, eb = graph.eqns[ia], graph.eqns[ib]
        memo[key] = (ea.primitive is eb.primitive and not ea.effects and len(ea.invars) == len(eb.invars)
                     and ea.outvars.index(a) == eb.outvars.index(b) and _same_params(ea.params, eb.params)
                     and all(_recomputed(graph, x, y, memo, depth - 1) for x, y in zip(ea.invars, eb.invars)))
    return memo[key]


def _same_value(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all((a == b) | (np.isnan(a) & np.isnan(b)) if a.dtype.kind == "f"
                                              else a == b))


def _same_params(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        try:
            if not bool(a[k] == b[k]):
                return False
        except Exception:  # arrays, jaxprs: alike only when the same object
            if a[k] is not b[k]:
                return False
    return True


# --------------------------------------------------------------------------- #
# A match and its rewrite
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(eq=False)
class _Rewrite:
    spec: AttentionSpec
    at: dict  # equation index -> the new equations taking its place
    removed: set  # the indices of the equations replaced by the new ones
    replaced: set  # equations that must be dead afterwards (the scores and their gradients)
    touched: set

    def describe(self) -> str:
        s = self.spec
        what = "forward and backward" if s.dq is not None else "forward"
        mask = "causal" if s.causal else ("masked" if s.mask is not None else "unmasked")
        mask += ", with a bias" if s.bias is not None else ""
        return (f"{what} as flash-attention kernels (batch {list(s.batch)}, {s.tq} x {s.tk} positions, "
                f"head dim {s.d}, {mask}, {s.dtype})")


def _new_var(shape, dtype):
    return jex_core.Var(jax.core.ShapedArray(tuple(shape), np.dtype(dtype)))


def _eqn(graph, invars, outvars, spec, phase, outputs, lse=None, origin=(), o_from_p=None):
    """``o_from_p``: (v, v's roles, P's roles, batch dims) where the program has no O (a
    recomputed forward): the fallback computes it from the replayed P and v."""
    o_roles = None
    if o_from_p is not None:
        v, v_roles, p_roles, nb = o_from_p
        outputs = [outputs[0], v, *outputs[1:]]
        o_roles = (list(p_roles), [v_roles[a] for a in range(v.aval.ndim)], [("b", n) for n in range(nb)] + ["q", "e"])
    run = _closure(graph, outputs, invars)
    fallback = _Fallback(_replayed(graph, run, invars, outputs), len(run), lse, o_roles)
    names = trace.VarNames()
    params = dict(spec=spec, phase=phase, out_avals=tuple(v.aval for v in outvars), fallback=fallback,
                  origin=tuple(trace.equation_text(graph.eqns[j], names) for j in origin))
    return jex_core.new_jaxpr_eqn(list(invars), list(outvars), attention_p, params, jex_core.no_effects)


def _causal(graph, mask, layout: Layout, batch: tuple, tq: int, tk: int, eqns: list, hides: bool) -> bool:
    """Whether a mask computed from constants is ``tril`` over (query, key) in
    every batch entry (``layout``: its strides in its buffer; ``hides``: True
    marks the hidden scores, so the mask must be ``~tril``); ``eqns`` gets the
    equations computing it."""
    # Its own equations alone are evaluated: ``eqns`` may hold the softmax's other
    # constants, such as the fill broadcast to the scores' shape (GPT-2's: 400 MB).
    own: list = []
    if tq != tk or _numel_of(mask) > MAX_EVALUATED_MASK or not _constant(graph, mask, own):
        return False
    eqns.extend(j for j in own if j not in eqns)
    value = _evaluated(graph, own, mask)
    batch = tuple(n if st else 1 for n, st in zip(batch, layout.batch))  # one entry of a broadcast dim
    strides = tuple(st * value.itemsize for st in (*layout.batch, layout.t, layout.d))
    logical = np.lib.stride_tricks.as_strided(value, batch + (tq, tk), strides)
    return bool(np.all(logical == (np.tri(tq, tk, dtype=bool) ^ hides)))


def _numel_of(v) -> int:
    return math.prod(v.aval.shape)


# The largest |bias| the kernels take ([Note: fused attention]): within it, a row's
# log-sum-exp keeps the precision its probabilities need.
MAX_BIAS = 1e4


def _bounded_bias(graph, bias) -> None:
    """No match unless the bias is a constant (ALiBi's slopes x distances, a fixed
    relative-position table) whose values are finite and at most ``MAX_BIAS``.
    A bias of float32's min (a padding mask written additively) makes a row
    whose keys all carry it uniform over its keys under jax, a result the
    kernels' log-sum-exp cannot hold at that magnitude; a bias known only at run
    time could be such a one."""
    eqns: list = []
    if _numel_of(bias) > MAX_EVALUATED_MASK or not _constant(graph, bias, eqns):
        raise _NoMatch("a bias computed at run time (it could hold float32's min)")
    value = _evaluated(graph, eqns, bias).astype(np.float32)
    if not np.all(np.isfinite(value)) or np.max(np.abs(value), initial=0.0) > MAX_BIAS:
        raise _NoMatch("a bias with values past MAX_BIAS")


def _size(shape, roles, role) -> int:
    return int(shape[roles.index(role)])


def _match(graph, i, memo: dict) -> _Rewrite | None:
    """The rewrite of the attention whose scores dot is equation ``i``; ``memo``:
    derived backward chains by their structure (``_chain_key``), for one program."""
    fwd = _forward(graph, i)
    nb = fwd.nb
    s_eqn = graph.eqns[fwd.s_dot]
    qv, kv = s_eqn.invars
    full = fwd.s.aval.shape
    batch = tuple(_size(full, fwd.s_roles, ("b", n)) for n in range(nb))
    tq, tk = _size(full, fwd.s_roles, "q"), _size(full, fwd.s_roles, "k")
    dtype = str(qv.aval.dtype)
    constants: list = []
    for j in fwd.chain:
        for x in graph.eqns[j].invars:
            if x is not fwd.s and x not in fwd.frees and graph.made_by(x) not in fwd.chain:
                if not _constant(graph, x, constants):
                    raise _NoMatch("the softmax reads another value")
    def operand(v, roles, t, d):
        base, strides = _strided(graph, v)
        return base, _layout([roles[a] for a in range(v.aval.ndim)], strides, nb, t, d)

    bwd = _backward(graph, fwd, constants, memo)
    if fwd.o_dot is None and bwd is None:
        raise _NoMatch("no P · v")
    qb, q = operand(qv, fwd.q_roles, "q", "d")
    kb, k = operand(kv, fwd.k_roles, "k", "d")
    if fwd.o_dot is not None:
        o_eqn = graph.eqns[fwd.o_dot]
        vv, v_roles = (o_eqn.invars[1] if o_eqn.invars[0] is fwd.p else o_eqn.invars[0]), fwd.v_roles
        o_var, o_strides, o_t = _absorbed(graph, o_eqn.outvars[0], dtype)
        o_roles, dv = fwd.o_roles, _size(o_eqn.outvars[0].aval.shape, fwd.o_roles, "e")
    else:  # a recomputed forward without O (jax.checkpoint): the kernel writes O for the backward alone
        vv, v_roles = bwd.v, bwd.v_roles
        dv = _size(vv.aval.shape, [v_roles[a] for a in range(vv.aval.ndim)], "e")
        o_roles, o_t = [("b", n) for n in range(nb)] + ["q", "e"], []
        o_var = _new_var(batch + (tq, dv), dtype)
        o_strides = _contiguous(o_var.aval.shape)
    vb, v = operand(vv, v_roles, "k", "e")
    o = _layout(o_roles, o_strides, nb, "q", "e")
    absorbed = list(o_t)
    extra_in, mask, causal = [], None, False  # the mask and bias operands the kernels read, in that order
    if fwd.mask is not None:
        mb, strides = _strided(graph, fwd.mask)
        mask = _layout(fwd.mask_roles, strides, nb, "q", "k")
        causal = _causal(graph, mb, mask, batch, tq, tk, constants, fwd.mask_hides)
        if causal:
            mask = None
        else:
            extra_in = [mb]
    bias = None
    if fwd.bias is not None:  # read after the mask: the kernels' operand order
        _bounded_bias(graph, fwd.bias)
        bb, strides = _strided(graph, fwd.bias)
        # lax's degenerate broadcasting: a size-1 dim of the bias is read with stride 0
        strides = [0 if n == 1 else st for n, st in zip(fwd.bias.aval.shape, strides)]
        bias = _layout(fwd.bias_roles, strides, nb, "q", "k")
        if str(bb.aval.dtype) not in _FLOATS:
            raise _NoMatch("a bias of another dtype")
        extra_in = extra_in + [bb]
    if any(str(x.aval.dtype) != dtype for x in (kv, vv, fwd.p, o_var)):
        raise _NoMatch("operands of several dtypes")
    spec = AttentionSpec(batch=batch, tq=tq, tk=tk, d=_size(qv.aval.shape, [fwd.q_roles[a] for a in range(
        qv.aval.ndim)], "d"), dv=dv, scale=fwd.scale,
        causal=causal, mask=mask, fill=fwd.fill, dtype=dtype, q=q, k=k, v=v, o=o,
        mask_hides=fwd.mask_hides and mask is not None, bias=bias)
    lse = _new_var(batch + (tq,), np.float32)
    # the row max's dims in lse's order ([batch..., tq]), its size-1 extras dropped
    kept = [a for a, r in enumerate(fwd.row_roles) if not _one(r)]
    order = [[fwd.row_roles[a] for a in kept].index(r) for r in [("b", n) for n in range(nb)] + ["q"]]
    lse_view = (tuple(fwd.rowmax.aval.shape[a] for a in kept), tuple(order))
    origin = [fwd.s_dot] + ([] if fwd.o_dot is None else [fwd.o_dot])
    n_full = _numel_of(fwd.s)
    full_size = [j for j in fwd.chain if _numel_of(graph.eqns[j].outvars[0]) == n_full]
    replaced = {fwd.s_dot, *full_size} | ({fwd.o_dot} if fwd.o_dot is not None else set())
    if bwd is None:
        fwd_eqn = _eqn(graph, [qb, kb, vb, *extra_in], [o_var, lse], spec, "forward",
                       [o_var, fwd.rowmax, fwd.rowsum], lse=lse_view, origin=origin)
        return _Rewrite(spec, {fwd.o_dot: [fwd_eqn]}, {fwd.o_dot, *absorbed}, replaced,
                        replaced | set(fwd.chain) | set(absorbed))
    dob, strides = _strided(graph, bwd.do)
    do = _layout([bwd.do_roles[a] for a in range(bwd.do.aval.ndim)], strides, nb, "q", "e")
    outs = {}
    for dot, t, d, operand_roles, free in ((bwd.dq_dot, "q", "d", fwd.k_roles, "d"),
                                           (bwd.dk_dot, "k", "d", fwd.q_roles, "d")):
        g = graph.eqns[dot]
        known = 0 if g.invars[0] is bwd.ds else 1
        other, contracted, out = _pair(g, known, dict(enumerate(fwd.s_roles)), free)
        if (_significant(other) != _significant(operand_roles) or contracted != ({"k"} if t == "q" else {"q"})
                or not _dot_plain(g)):
            raise _NoMatch("dQ or dK contracts another dim")
        var, strides, tr = _absorbed(graph, g.outvars[0], dtype)
        absorbed += tr
        outs[t] = (var, _layout(out, strides, nb, t, d))
    g = graph.eqns[bwd.dv_dot]
    known = 0 if g.invars[0] is bwd.p_dv else 1
    other, contracted, out = _pair(g, known, dict(enumerate(fwd.p_roles)), "e")
    if _significant(other) != _significant(bwd.do_roles) or contracted != {"q"} or not _dot_plain(g):
        raise _NoMatch("dV contracts another dim")
    dv_var, dv_strides, tr = _absorbed(graph, g.outvars[0], dtype)
    absorbed += tr
    dq_var, dk_var = outs["q"][0], outs["k"][0]
    if any(str(x.aval.dtype) != dtype for x in (bwd.do, dq_var, dk_var, dv_var)):
        raise _NoMatch("gradients of several dtypes")
    spec = dataclasses.replace(spec, do=do, dq=outs["q"][1], dk=outs["k"][1],
                               dv_out=_layout(out, dv_strides, nb, "k", "e"))
    if fwd.o_dot is not None:
        fwd_eqn = _eqn(graph, [qb, kb, vb, *extra_in], [o_var, lse], spec, "forward",
                       [o_var, fwd.rowmax, fwd.rowsum], lse=lse_view, origin=origin)
    else:  # its fallback: the row max and sum the program has, and O as P · v
        fwd_eqn = _eqn(graph, [qb, kb, vb, *extra_in], [o_var, lse], spec, "forward",
                       [fwd.p, fwd.rowmax, fwd.rowsum], lse=lse_view, origin=origin,
                       o_from_p=(vv, bwd.v_roles, fwd.p_roles, nb))
    grads = (bwd.dq_dot, bwd.dk_dot, bwd.dv_dot)
    bwd_eqn = _eqn(graph, [qb, kb, vb, o_var, dob, lse, *extra_in], [dq_var, dk_var, dv_var], spec, "backward",
                   [dq_var, dk_var, dv_var], origin=[bwd.dp_dot, *grads])
    image_full = [j for j in bwd.image if _numel_of(graph.eqns[j].outvars[0]) == n_full]
    replaced |= {bwd.dp_dot, *grads, *image_full}
    at = {min(grads): [fwd_eqn, bwd_eqn]} if fwd.o_dot is None else {fwd.o_dot: [fwd_eqn], min(grads): [bwd_eqn]}
    removed = {*grads, *absorbed} | ({fwd.o_dot} if fwd.o_dot is not None else set())
    return _Rewrite(spec, at, removed, replaced, replaced | set(fwd.chain) | bwd.image)


def _significant(roles: dict) -> dict:
    """Roles by dim without the size-1 extras (named per dot)."""
    return {a: r for a, r in roles.items() if not _one(r)}


def _apply(eqns, rewrites) -> list:
    at, removed = {}, set()
    for r in rewrites:
        at.update(r.at)
        removed |= r.removed
    out = []
    for i, e in enumerate(eqns):
        out += at.get(i, [])
        if i not in removed:
            out.append(e)
    return out
