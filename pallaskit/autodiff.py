"""JAX transformations of pallaskit functions.

``JitFunction.__call__`` sends a call here when an argument is a tracer of a
transformation (``jax.grad``/``jax.vjp``/``jax.jvp``/``jax.vmap``), or of
``jax.jit`` (``call_staged``: the compiled program is traced into the caller's
jaxpr, inside the same ``custom_vjp`` as below, so that JAX may differentiate
the staged call later). Each transformation peels one level and calls
pallaskit again one level down, so nesting (vmap of grad, grad of vmap,
jacfwd) composes:

- reverse mode (a ``LinearizeTracer``, or a ``JVPTracer`` whose tangent is
  being partially evaluated): a ``jax.custom_vjp`` whose forward and backward
  are the two halves of the joint graph, partitioned by
  ``lowering.partition`` (option ``partitioner``) and compiled by pallaskit;
- forward mode (a ``JVPTracer``): a ``jax.custom_jvp`` whose rule is the
  compiled ``jax.jvp`` of the function;
- batching (a ``BatchTracer``): a ``jax.custom_batching.custom_vmap`` whose
  rule is the compiled ``jax.vmap`` of the function.

What pallaskit does not handle runs the original function under JAX's own
transformation (through XLA), with one log line: nested differentiation (grad
of grad, jvp of grad, hessians) and tracers of other transformations.
``jax.linearize`` (a linearize trace that is not a vjp's) takes the
forward-mode path: a ``custom_vjp`` has no rule for it.
"""
from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.custom_derivatives import SymbolicZero
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import partial_eval as _pe

from pallaskit import metrics, sharding
from pallaskit.config import config
from pallaskit.runtime import preload
from pallaskit.signature import ClosedOverTracers, JaxOnly, Signature, flat_function

# jax.extend imports all of its modules, Pallas among them, and the
# compiler's modules import sympy: both load on first use, so that a process
# whose plain calls are all served by the graph cache imports neither.
if TYPE_CHECKING:
    from lowering import partition as partition_mod

log = logging.getLogger("pallaskit")

_Tracer = jax.core.Tracer


class _Absent:  # a tracer class this jax does not have: no value is one
    pass


# The tracer classes of jax's transformations (jax has no public names for
# them; each is looked up, so a jax without one treats it as unknown).
_STAGING = getattr(_pe, "DynamicJaxprTracer", _Absent)  # jax.jit / make_jaxpr: the ordinary path handles it
_PARTIAL = getattr(_pe, "JaxprTracer", _Absent)
_REVERSE = getattr(_ad, "LinearizeTracer", _Absent)
_FORWARD = getattr(_ad, "JVPTracer", _Absent)
_BATCH = getattr(_batching, "BatchTracer", _Absent)


def transformed(leaves) -> bool:
    """Whether any argument leaf is a tracer of a transformation other than
    staging (``jax.jit``)."""
    return any(isinstance(x, _Tracer) and not isinstance(x, _STAGING) for x in leaves)


def staged(leaves) -> bool:
    """Whether any argument leaf is a ``jax.jit`` (staging) tracer."""
    return any(isinstance(x, _STAGING) for x in leaves)


def call_staged(jf, args, kwargs):
    """Trace ``jf``'s program into the caller's jaxpr (``jax.jit`` of a
    pallaskit function, and the halves of a differentiated one under
    ``jax.jit``). The ahead-of-time executable of the ordinary path (the graph
    cache's) accepts no tracers, so this keeps a jitted, not yet compiled,
    program per signature. The program is wrapped in the same ``custom_vjp``
    as a differentiated call, so a staged call that JAX differentiates later
    (``jax.grad(jax.jit(f))``, ``lax.scan`` or ``jax.checkpoint`` bodies) gets
    pallaskit's partitioned backward instead of failing on ``pallas_call``."""
    key, leaves, avals, treedef, static_pos, static_kw = jf._split(args, kwargs)
    why = sharding.staged_over_devices(avals)
    if why:
        return fallback(jf, args, kwargs, why)
    store = _store(jf)
    program = store.get(("staged", key))
    if program is None:
        try:
            program = jf._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
        except ClosedOverTracers as e:  # JAX traces it into the caller's jaxpr, as jax.jit would
            return fallback(jf, args, kwargs, str(e))
        store[("staged", key)] = program

    def run(*xs):
        return program.executable(*xs, *program.constants)

    if not all(_plain(a) for a in avals):  # PRNG keys and other extended dtypes: no custom_vjp
        return jax.tree_util.tree_unflatten(program.out_tree, run(*leaves))
    sig, leaves = _signature(jf, args, kwargs)
    return jax.tree_util.tree_unflatten(sig.out_tree, list(_call_vjp(sig, leaves, run)))


def _plain(aval) -> bool:
    try:
        dt = np.dtype(aval.dtype)
    except TypeError:
        return False
    return bool(jnp.issubdtype(dt, jnp.number) or dt == np.bool_)


# --------------------------------------------------------------------------- #
# which transformation
# --------------------------------------------------------------------------- #
def _inner(x):
    """The value one transformation level down, or None."""
    if isinstance(x, (_REVERSE, _FORWARD)):
        return x.primal
    if isinstance(x, _BATCH):
        return x.val
    return None


def _is_reverse(x) -> bool:
    if isinstance(x, _REVERSE):
        # jax.linearize evaluates the tangent program instead of transposing it,
        # and a custom_vjp has no forward-mode rule: the jvp path serves it.
        return getattr(x._trace, "is_vjp", True)
    # jvp + partial evaluation (jax without direct linearize): the tangent is unknown
    return isinstance(x, _FORWARD) and isinstance(getattr(x, "tangent", None), _PARTIAL)


def _plan(leaves) -> tuple[str, str]:
    """('vjp' | 'jvp' | 'vmap' | 'fallback', reason)."""
    ad_traces: list = []
    for leaf in leaves:
        x = leaf
        while isinstance(x, _Tracer) and not isinstance(x, _STAGING):
            if not isinstance(x, (_REVERSE, _FORWARD, _BATCH)):
                return "fallback", f"{type(x).__name__} arguments are not handled by pallaskit"
            if not isinstance(x, _BATCH) and not any(t is x._trace for t in ad_traces):
                ad_traces.append(x._trace)
            x = _inner(x)
    if len(ad_traces) > 1:
        return "fallback", "nested differentiation (e.g. grad of grad, jvp of grad)"
    top = [x for x in leaves if isinstance(x, _Tracer)]
    if any(_is_reverse(x) for x in top):
        return "vjp", ""
    if any(isinstance(x, (_FORWARD, _REVERSE)) for x in top):
        return "jvp", ""
    return "vmap", ""


_logged: set = set()


def _log_once(jf, message):
    title = _title(jf)
    metrics.counters["autodiff_fallbacks"] += 1
    if config.log_fallbacks and (title, message) not in _logged:
        _logged.add((title, message))
        log.warning("pallaskit: %s: %s", title, message)


def fallback_log(jf, message):
    """Counts a call pallaskit leaves to JAX; logs its reason once per function."""
    _log_once(jf, message)


def fallback(jf, args, kwargs, reason):
    _log_once(jf, f"{reason}; transforming the original function through XLA")
    return jf.fn(*args, **kwargs)


# --------------------------------------------------------------------------- #
# the flat function of one signature
# --------------------------------------------------------------------------- #
_STORES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _store(jf) -> dict:
    """What this module caches for one JitFunction: signatures, partitions and
    the JitFunctions of derived functions (forward, backward, jvp, vmap)."""
    store = _STORES.get(jf)
    if store is None:
        store = _STORES[jf] = {}
    return store


def forget(jf) -> None:
    """Drop what this module keeps for ``jf`` (its ``clear_cache``)."""
    _STORES.pop(jf, None)


def _title(jf) -> str:
    return getattr(jf.fn, "__qualname__", "fn")


def _signature(jf, args, kwargs) -> tuple[Signature, list]:
    key, leaves, avals, treedef, static_pos, static_kw = jf._split(args, kwargs)
    store = _store(jf)
    sig = store.get(("signature", key))
    if sig is None:
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        # Traced as jax.jit traces it, so an error in the user's code names the function and its arguments.
        closed, out_tree = jf._trace(structs, treedef, static_pos, static_kw, len(args))
        out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in closed.out_avals]
        flat = flat_function(jf.fn, treedef, static_pos, static_kw, len(args))
        donate = jf._xla_args(treedef, len(args)).donate if jf.donate_argnums or jf.donate_argnames else ()
        sig = store[("signature", key)] = Signature(jf, key, list(avals), flat, out_tree, out_avals, donate)
    return sig, leaves


def _jit(jf, fn: Callable, donate: tuple = ()):
    """A pallaskit function of ``fn`` of ``jf``'s own class (JitFunction: api
    imports this module, so this one does not import api). ``donate``: the
    positions of ``fn``'s arguments that hold ``jf``'s donated leaves: as
    jax.jit's transformation rules keep a call's donation, the derived call
    consumes them (where XLA can reuse the buffer)."""
    return type(jf)(fn, donate_argnums=donate or None)


def _compiled(sig: Signature, what: tuple, make: Callable[[], Callable], name: str, donate: tuple = ()):
    """A pallaskit.jit of a derived flat function, cached per signature."""
    store = _store(sig.jf)
    k = (what, sig.key)
    jf = store.get(k)
    if jf is None:
        fn = make()
        fn.__qualname__ = fn.__name__ = f"{_title(sig.jf)}.{name}"
        jf = store[k] = _jit(sig.jf, fn, donate)
    return jf


def _inexact(aval) -> bool:
    try:
        return jnp.issubdtype(aval.dtype, jnp.inexact)
    except TypeError:
        return False


def _float0_zeros(aval):
    return np.zeros(aval.shape, jax.dtypes.float0)


# --------------------------------------------------------------------------- #
# entry point
# --------------------------------------------------------------------------- #
def call(jf, args, kwargs):
    """Call ``jf`` on arguments holding transformation tracers."""
    _, leaves, *_ = jf._split(args, kwargs)
    mode, reason = _plan(leaves)
    if mode == "fallback":
        return fallback(jf, args, kwargs, reason)
    try:
        sig, leaves = _signature(jf, args, kwargs)
    except JaxOnly as e:
        return fallback(jf, args, kwargs, str(e))
    except Exception as e:  # noqa: BLE001  -- jax's own transformation raises what jax.jit would
        return fallback(jf, args, kwargs, f"could not trace the function ({type(e).__name__}: {e})")
    run = {"vjp": _call_vjp, "jvp": _call_jvp, "vmap": _call_vmap}[mode]
    outs = run(sig, leaves)
    return jax.tree_util.tree_unflatten(sig.out_tree, list(outs))


def _primal(sig: Signature):
    return _compiled(sig, ("primal",), lambda: (lambda *xs: sig.flat(*xs)), "primal", sig.donate)


# --------------------------------------------------------------------------- #
# reverse mode
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class GradEntry:
    """One differentiated signature: the partition and its compiled halves."""

    partition: partition_mod.Partition
    forward: Any  # JitFunction: primals -> outputs + saved
    backwards: dict  # nonzero-cotangent mask -> (JitFunction: lifted + saved + nonzero cotangents -> input
    # cotangents, lifted: the closed-over arrays it takes first, [Note: placed residuals])
    sig: Signature

    def backward(self, mask: tuple[bool, ...]):
        """(JitFunction, the arrays passed first): [Note: placed residuals]."""
        jf = self.backwards.get(mask)
        if jf is None:
            jf = self.backwards[mask] = _backward_fn(self, mask)
        return jf


def grad_entry(sig: Signature, perturbed: tuple[bool, ...], method: str) -> GradEntry:
    """Partition and compile (lazily) the signature differentiated with respect
    to the perturbed inputs."""
    store = _store(sig.jf)
    attention = _attention_fused()
    k = ("grad", sig.key, perturbed, method, attention)
    entry = store.get(k)
    if entry is None:
        from jax.extend import core as jex_core

        preload.wait()
        from lowering import partition as partition_mod

        joint = partition_mod.joint_jaxpr(sig.flat, sig.avals, perturbed)
        if attention:
            joint = _fuse_attention(joint)
        part = partition_mod.partition(joint, method)
        fwd = jex_core.jaxpr_as_fun(part.forward)
        fwd.__qualname__ = fwd.__name__ = f"{_title(sig.jf)}.forward"
        entry = store[k] = GradEntry(part, _jit(sig.jf, fwd, sig.donate), {}, sig)  # forward: the primals
    return entry


def _attention_fused() -> bool:
    """Does the compiler fuse attention here (``lowering.attention.enabled``)?"""
    preload.wait()
    from lowering import attention
    from pallaskit.orchestrator import compile_options

    return attention.enabled(compile_options())


def _fuse_attention(joint):
    """[Note: fused attention] (lowering/attention.py) on the joint graph, before it
    is partitioned: the forward half's flash kernel then saves O and the rows'
    log-sum-exp for the backward half's, as torch's SDPA does, where each half
    on its own would hold only half of the pattern (the probabilities saved)."""
    preload.wait()
    from lowering.attention import fuse_attention

    closed, lines = fuse_attention(joint.jaxpr)
    return dataclasses.replace(joint, jaxpr=closed) if lines else joint


def _backward_fn(entry: GradEntry, mask):
    """The backward half for the nonzero cotangents ``mask``, a pallaskit
    function of ``(*lifted, *saved, *given cotangents)``, and ``lifted``: the
    backward's closed-over arrays that are committed (to a device or sharded
    over a mesh), passed as arguments."""
    from jax.extend import core as jex_core

    part = entry.partition
    n_saved = len(part.saved)
    ct_avals = [entry.sig.out_avals[j] for j in part.ct_outputs]
    # [Note: placed residuals]
    # jax.grad(jax.jit(f)) transposes f's jit with its closed-over arrays among
    # the residuals, i.e. as arguments of the backward jit: one committed to a
    # device or sharded over a mesh places that computation, and jax.jit's
    # propagation decides the cotangents' shardings (a closure over an array
    # split along 'd' gives a cotangent split along 'd'). Every other pallaskit
    # program takes its closed-over arrays as jax.jit does a closure's, placing
    # nothing (executable.uncommitted); the backward takes such arrays as
    # arguments instead, so that its call is a placed signature of its own
    # ([Note: sharding]: jax.jit's output shardings, the devices in its keys).
    consts = list(part.backward.consts)
    placed = [i for i, c in enumerate(consts) if isinstance(c, jax.Array) and not isinstance(c, _Tracer)
              and getattr(c, "committed", False)]
    lifted = [consts[i] for i in placed]
    jaxpr = part.backward.jaxpr

    def backward(*xs):
        given_consts = list(consts)
        for i, c in zip(placed, xs[:len(placed)]):
            given_consts[i] = c
        xs = xs[len(placed):]
        saved, given = list(xs[:n_saved]), iter(xs[n_saved:])
        cts = [next(given) if m else jnp.zeros(a.shape, a.dtype) for m, a in zip(mask, ct_avals)]
        return jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(jaxpr, given_consts))(*saved, *cts)

    backward.__qualname__ = backward.__name__ = f"{_title(entry.sig.jf)}.backward"
    return _jit(entry.sig.jf, backward), lifted


@dataclasses.dataclass
class _XlaVjp:
    """Reverse mode through XLA for one call, when partitioning failed."""

    sig: Signature
    diff: list  # differentiated input positions
    tree: Any = None  # of the pullback

    def forward(self, *xs):
        def on_diff(*ds):
            full = list(xs)
            for i, d in zip(self.diff, ds):
                full[i] = d
            return self.sig.flat(*full)

        outs, pullback = jax.vjp(on_diff, *[xs[i] for i in self.diff])
        saved, self.tree = jax.tree_util.tree_flatten(pullback)
        return list(outs) + saved

    def backward_call(self, saved, cts):
        pullback = jax.tree_util.tree_unflatten(self.tree, saved)
        full = [c if not isinstance(c, SymbolicZero) else
                (jnp.zeros(a.shape, a.dtype) if _inexact(a) else _float0_zeros(a))
                for c, a in zip(cts, self.sig.out_avals)]
        in_cts = pullback(full)
        out = [None] * len(self.sig.avals)
        for i, c in zip(self.diff, in_cts):
            out[i] = c
        return tuple(out)


@jax.tree_util.register_static
class _Carry:
    """A Python value riding in custom_vjp residuals as pytree structure (no
    leaves): the forward's entry reaches its own backward."""

    def __init__(self, value):
        self.value = value


def _call_vjp(sig: Signature, leaves, primal: Callable | None = None):
    """``custom_vjp`` over the flat function: ``primal`` (default: the compiled
    function) when not differentiated, else the partitioned halves."""
    method = config.partitioner
    n_out = len(sig.out_avals)

    @jax.custom_vjp
    def f(*xs):
        return list((primal or _primal(sig))(*xs))

    def fwd(*xs):
        values = [x.value for x in xs]
        perturbed = tuple(bool(x.perturbed) for x in xs)
        try:
            entry = grad_entry(sig, perturbed, method)
        except Exception as e:  # noqa: BLE001  -- jax.vjp below raises what jax.jit would
            _log_once(sig.jf, f"could not partition the joint graph ({type(e).__name__}: {e}); "
                              "differentiating through XLA")
            entry = _XlaVjp(sig, [i for i, (a, p) in enumerate(zip(sig.avals, perturbed)) if p and _inexact(a)])
        res = entry.forward(*values)
        return list(res[:n_out]), (_Carry(entry), tuple(res[n_out:]))

    def bwd(res, cts):
        carry, saved = res
        entry = carry.value
        if isinstance(entry, _XlaVjp):
            return entry.backward_call(list(saved), list(cts))
        part = entry.partition
        mask = tuple(not isinstance(cts[j], SymbolicZero) for j in part.ct_outputs)
        given = [cts[j] for j, m in zip(part.ct_outputs, mask) if m]
        backward, lifted = entry.backward(mask)
        in_cts = backward(*lifted, *saved, *given)
        out = [None] * len(sig.avals)
        for i, c in zip(part.diff_inputs, in_cts):
            out[i] = c
        return tuple(out)

    f.defvjp(fwd, bwd, symbolic_zeros=True)
    return f(*leaves)


# --------------------------------------------------------------------------- #
# forward mode
# --------------------------------------------------------------------------- #
def _jvp_fn(sig: Signature, mask: tuple[bool, ...]):
    """(primals, tangents of the masked inputs) -> outputs + tangents of the
    inexact outputs, compiled by pallaskit."""
    diff = [i for i, m in enumerate(mask) if m]
    ct_outs = [j for j, a in enumerate(sig.out_avals) if _inexact(a)]
    n = len(sig.avals)

    def make():
        def jvp(*xs):
            primals, tangents = list(xs[:n]), list(xs[n:])

            def on_diff(*ds):
                full = list(primals)
                for i, d in zip(diff, ds):
                    full[i] = d
                return sig.flat(*full)

            outs, touts = jax.jvp(on_diff, [primals[i] for i in diff], tangents)
            return list(outs) + [touts[j] for j in ct_outs]

        return jvp

    donate = sig.donate + tuple(n + k for k, i in enumerate(diff) if i in sig.donate)  # primals, their tangents
    return _compiled(sig, ("jvp", mask), make, "jvp", donate)


def _call_jvp(sig: Signature, leaves):
    n_out = len(sig.out_avals)

    @jax.custom_jvp
    def f(*xs):
        return _primal(sig)(*xs)

    def rule(primals, tangents):
        mask = tuple(not isinstance(t, SymbolicZero) and _inexact(a) for t, a in zip(tangents, sig.avals))
        res = _jvp_fn(sig, mask)(*primals, *[t for t, m in zip(tangents, mask) if m])
        outs, touts = list(res[:n_out]), iter(res[n_out:])
        return outs, [next(touts) if _inexact(a) else _float0_zeros(a) for a in sig.out_avals]

    f.defjvp(rule, symbolic_zeros=True)
    return f(*leaves)


# --------------------------------------------------------------------------- #
# batching
# --------------------------------------------------------------------------- #
def _batched_outputs(sig: Signature, in_batched) -> list[bool]:
    """Which outputs depend on a batched input: those are batched, the others
    are not (``jax.jacfwd`` needs its primal output unbatched)."""
    from jax.extend import core as jex_core

    closed = sig.jaxpr()
    batched = {v for v, b in zip(closed.jaxpr.invars, in_batched) if b}
    for eqn in closed.jaxpr.eqns:
        if any(v in batched for v in eqn.invars if not isinstance(v, jex_core.Literal)):
            batched.update(eqn.outvars)
    return [not isinstance(v, jex_core.Literal) and v in batched for v in closed.jaxpr.outvars]


def _call_vmap(sig: Signature, leaves):
    placed = _donated_in_place(sig, leaves)
    if placed is not None:
        return _call_vmap_in_place(sig, leaves, *placed)
    f = custom_vmap(lambda *xs: sig.flat(*xs))  # the body only gives shapes

    @f.def_vmap
    def rule(axis_size, in_batched, *xs):
        in_axes = tuple(0 if b else None for b in in_batched)
        out_batched = _batched_outputs(sig, in_batched)
        out_axes = [0 if b else None for b in out_batched]

        def make():
            return lambda *ys: jax.vmap(sig.flat, in_axes=in_axes, out_axes=out_axes, axis_size=axis_size)(*ys)

        outs = _compiled(sig, ("vmap", in_axes, axis_size), make, "vmap", sig.donate)(*xs)
        return list(outs), out_batched

    return f(*leaves)


# [Note: donation under vmap]
# jax.vmap of a jax.jit function batches the jit where its arguments are: jax's
# rule (``batch_jaxpr2``, pjit.py's ``_pjit_batcher``) keeps each argument's batch
# axis, the outputs' axes are what its equations give, and the donated arguments
# stay donated, so XLA reuses a donated array's own buffer for an output of its
# shape, and deletes it then. ``custom_vmap`` moves every batch axis to the front
# first: an argument batched along another axis arrives as a moved copy, whose
# donation deleted the copy and left the caller's array (jax.jit deletes it). A
# signature that donates an argument batched along an axis other than 0 is
# batched as jax's rule batches it instead: the compiled program of the batched
# jaxpr takes the arrays as they are (its outputs on jax's axes), with the same
# donation; other calls keep ``custom_vmap``.
def _donated_in_place(sig: Signature, leaves):
    """(trace, the leaves' batch axes) of a vmapped call that donates a leaf
    batched along an axis other than 0, its batched leaves all of one vmap;
    None otherwise ([Note: donation under vmap])."""
    if not sig.donate:
        return None
    traces = {id(x._trace): x._trace for x in leaves if isinstance(x, _BATCH)}
    if len(traces) != 1 or any(isinstance(x, _Tracer) and not isinstance(x, _BATCH) for x in leaves):
        return None
    trace = next(iter(traces.values()))
    dims = tuple(trace.to_batch_info(x)[1] for x in leaves)
    if any(d is not None and type(d) is not int for d in dims):  # a ragged axis: custom_vmap's
        return None
    if not any(dims[i] not in (None, 0) for i in sig.donate):
        return None
    return trace, dims


def _call_vmap_in_place(sig: Signature, leaves, trace, dims):
    """The vmapped call batched as jax batches a jax.jit call ([Note: donation under vmap])."""
    from jax._src import core as jax_core
    from jax.extend import core as jex_core

    axis_data = trace.axis_data
    batched, out_dims = _batching.batch_jaxpr2(sig.jaxpr(), axis_data, dims)

    def make():
        return jex_core.jaxpr_as_fun(batched)

    jf = _compiled(sig, ("vmap_in_place", dims, axis_data.size), make, "vmap", sig.donate)
    with jax_core.set_current_trace(trace.parent_trace):
        outs = jf(*[trace.to_batch_info(x)[0] for x in leaves])
    return [_batching.BatchTracer(trace, o, d) if d is not None else o for o, d in zip(outs, out_dims)]


# --------------------------------------------------------------------------- #
# explain
# --------------------------------------------------------------------------- #
def explain_entry(jf, args, kwargs, method: str | None = None) -> GradEntry:
    """The reverse-mode entry of ``jf`` at these arguments, differentiated with
    respect to every inexact argument leaf (for ``pallaskit.explain_grad``)."""
    preload.wait()
    from lowering import partition as partition_mod

    method = method or config.partitioner
    if method not in partition_mod.PARTITIONERS:
        raise ValueError(f"unknown partitioner {method!r}; valid: {', '.join(partition_mod.PARTITIONERS)}")
    sig, _ = _signature(jf, args, kwargs)
    perturbed = tuple(_inexact(a) for a in sig.avals)
    return grad_entry(sig, perturbed, method)


def jax_saved_bytes(fn, *args) -> int:
    """Bytes JAX's own ``jax.vjp`` keeps for the backward of ``fn`` (the
    leaves of its pullback), differentiating every inexact argument leaf."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    diff = [i for i, x in enumerate(leaves) if _inexact(jax.typeof(x))]

    def on_diff(*ds):
        full = list(leaves)
        for i, d in zip(diff, ds):
            full[i] = d
        return fn(*jax.tree_util.tree_unflatten(tree, full))

    def residuals(*ds):
        return jax.tree_util.tree_leaves(jax.vjp(on_diff, *ds)[1])

    shapes = jax.eval_shape(residuals, *[leaves[i] for i in diff])
    return sum(int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize for s in shapes)
