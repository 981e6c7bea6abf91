"""One call signature of a pallaskit function: its static arguments and the
flat function of its dynamic leaves. ``api`` builds signatures and
``autodiff`` transforms their flat functions; both import this module, not
each other."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from typing import Any, Callable

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Static:
    """A static argument's value, hashed and compared by type and value (as jax.jit does)."""
    value: Any

    def __hash__(self):
        return hash((type(self.value).__name__, self.value))

    def __eq__(self, other):
        return isinstance(other, Static) and type(self.value) is type(other.value) and self.value == other.value


class JaxOnly(Exception):
    """A signature pallaskit cannot compile, found while tracing it: the call
    runs the function under JAX instead (its message, the log line's reason)."""


class ClosedOverTracers(JaxOnly):
    """The function closes over a tracer of an enclosing transformation (a value
    of the caller's ``jax.jit`` or ``jax.grad``): its program holds a value that
    exists only in that trace, so it is no program to compile and keep; the call
    runs the function under JAX instead."""


def context() -> tuple:
    """jax's configuration a trace depends on, thread-local overrides included
    (``with jax.numpy_rank_promotion("raise")``, ``jax.enable_x64``,
    ``jax.default_matmul_precision``, ``jax.default_device``, ...): part of
    every signature key, as it is of jax.jit's, so a call under another
    context traces again instead of running a program traced outside it.

    jax registers some options only when a module of its own is first imported
    (jax 0.11's Pallas interpreter imports the TPU options while lowering the
    first ``pallas_call``): the context grows by their values. An option
    registered after the first context and still at the value it first had
    leaves the key as it was, so the program compiled before it is not compiled
    again (nor a speculative graph missed, nor a tier-up refused)."""
    from jax._src import config as jax_config

    ctx = jax_config.trace_context()
    if not isinstance(ctx, tuple):
        return ctx
    with _FIRST_SEEN_LOCK:
        if _FIRST_SEEN.length is None:
            _FIRST_SEEN.length = len(ctx)
        later = ctx[_FIRST_SEEN.length:]
        _FIRST_SEEN.later.extend(later[len(_FIRST_SEEN.later):])  # each later option's first value
    keep = len(later)
    while keep and later[keep - 1] == _FIRST_SEEN.later[keep - 1]:
        keep -= 1
    ctx = ctx[:_FIRST_SEEN.length + keep]
    mesh = concrete_mesh()
    return ctx if mesh is None else ctx + (mesh,)


def concrete_mesh():
    """``jax.set_mesh``'s concrete mesh, or None: no trace-context option (its
    abstract twin is), yet a PartitionSpec in out_shardings or
    with_sharding_constraint names its devices, in its order."""
    from jax._src import config as jax_config

    device_context = getattr(jax_config, "device_context", None)
    return device_context.value if device_context is not None else None


class _FirstContext:
    """The first context's length, and the first value of each option jax registered after it."""

    def __init__(self):
        self.length: int | None = None
        self.later: list = []


_FIRST_SEEN = _FirstContext()
_FIRST_SEEN_LOCK = threading.Lock()


def batch_axes_named(closed_jaxpr) -> list:
    """The named axes of enclosing ``jax.vmap``s (``axis_name=``; not shard_map's
    or pmap's manual axes) that a collective of the jaxpr reduces over or reads
    (``lax.psum(x, "i")``, ``lax.axis_index("i")``). A program holding one is
    no program of its own: it exists only inside that vmap's trace."""
    from jax._src import core as jax_core

    env = jax_core.get_axis_env()
    names = set(env.axis_names()) - set(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
    if not names:
        return []
    found, stack = set(), [closed_jaxpr.jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            for k, v in eqn.params.items():
                if k in ("axes", "axis_name"):
                    found.update(n for n in (v if isinstance(v, (tuple, list)) else (v,)) if _in(n, names))
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        stack.append(inner)
    return sorted(map(str, found))


def _in(name, names) -> bool:
    try:
        return name in names
    except TypeError:  # an unhashable parameter value
        return False


def call_key(treedef, avals, static_pos, static_kw, n_args, context_=None) -> tuple:
    """A call signature's key in ``JitFunction._cache`` (and autodiff's store):
    the dynamic leaves' structure and avals, the static arguments and jax's
    ``context()`` (the caller's, unless given)."""
    return (treedef, tuple(avals), static_pos, static_kw, n_args, context() if context_ is None else context_)


def hashable(v) -> Static:
    try:
        hash(v)
    except TypeError as e:  # jax.jit's error, word for word
        hint = ""
        if isinstance(v, jax.core.Tracer):
            # [Note: eval_shape of static arguments]
            # jax.eval_shape(f, *args) special-cases its own jit functions only (an exact
            # type check, jax/_src/api.py), and traces any other callable under a jax.jit
            # of its own, where every argument is an array: a static argument's value is
            # gone before pallaskit sees it (a jax.jit function inside another jax.jit
            # fails the same way). ``f.eval_shape(*args)`` is jax.jit's ``eval_shape``
            # with f's static arguments.
            hint = ("(pallaskit: a static argument was traced as an array, as jax.eval_shape and jax.jit "
                    "pass every argument of a pallaskit function; use f.eval_shape(*args) or "
                    "f.trace(*args).out_info, or close over the static arguments with functools.partial)\n")
        raise ValueError(f"Non-hashable static arguments are not supported. An error occurred while trying to "
                         f"hash an object of type {type(v)}, {v}. The error was:\n{type(e).__name__}: {e}\n"
                         + hint) from None
    return Static(v)


def full_args(leaves, treedef, static_pos, static_kw, n_args) -> tuple[list, dict]:
    """(positional, keyword) arguments of a call from its flat dynamic leaves
    and its static arguments."""
    dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, list(leaves))
    static_pos_d = dict(static_pos)
    it = iter(dyn_args)
    full = [static_pos_d[i].value if i in static_pos_d else next(it) for i in range(n_args)]
    return full, {**dyn_kwargs, **{k: v.value if isinstance(v, Static) else v for k, v in static_kw}}


def flat_function(fn: Callable, treedef, static_pos, static_kw, n_args) -> Callable:
    """``fn`` as a function of the flat dynamic leaves, returning its flat outputs."""
    def flat_fn(*leaves):
        full, kwargs = full_args(leaves, treedef, static_pos, static_kw, n_args)
        return jax.tree_util.tree_leaves(fn(*full, **kwargs))

    return flat_fn


@dataclasses.dataclass
class Signature:
    """One call signature of a JitFunction ``jf``: the flat function of its
    dynamic leaves, the avals of those leaves and of the flat outputs."""

    jf: Any
    key: Any
    avals: list
    flat: Callable  # flat leaves -> flat list of outputs
    out_tree: Any
    out_avals: list
    donate: tuple = ()  # flat indices of the leaves jf donates (derived functions donate them too)
    _jaxpr: Any = None

    def jaxpr(self):
        """The closed jaxpr of ``flat`` at ``avals``."""
        if self._jaxpr is None:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in self.avals]
            self._jaxpr = jax.make_jaxpr(self.flat)(*structs)
        return self._jaxpr


# --------------------------------------------------------------------------- #
# Leaves: their avals and their names in messages
# --------------------------------------------------------------------------- #
def describe(path, dyn_positions, sig) -> str:
    """Human name of a leaf: the argument and the path inside it."""
    first = path[0].idx if hasattr(path[0], "idx") else 0  # 0: args, 1: kwargs
    rest = path[1:]
    if first == 0 and rest:
        pos = dyn_positions[rest[0].idx] if rest[0].idx < len(dyn_positions) else rest[0].idx
        name = f"argument {pos}"
        if sig is not None:
            names = list(sig.parameters)
            if pos < len(names) and sig.parameters[names[pos]].kind != inspect.Parameter.VAR_POSITIONAL:
                name = f"argument {names[pos]!r}"
        rest = rest[1:]
    elif rest:
        name = f"argument {rest[0].key!r}"
        rest = rest[1:]
    else:
        name = "argument"
    return name + jax.tree_util.keystr(tuple(rest))


SCALARS = (bool, int, float, complex, np.generic)


_ARRAY_TYPE: list = []  # [the concrete array type], once an argument showed it


def array_type(leaves) -> type | None:
    """The type of concrete arrays (``jax.Array`` is an abstract base that
    tracers also pass), taken from the first argument that is one; None until
    an argument was. Not ``type(jnp.zeros(()))``, an XLA compilation on the
    first call of every process, nor a ``device_put``."""
    if not _ARRAY_TYPE:
        concrete = [type(x) for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
        if not concrete:
            return None
        _ARRAY_TYPE.append(concrete[0])
    return _ARRAY_TYPE[0]


def abstractify(leaf, where: str, fn=None):
    # ShapeDtypeStruct: explain / lower_to_result need shapes only
    if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or isinstance(leaf, SCALARS):
        try:
            return jax.typeof(leaf) if hasattr(jax, "typeof") else jax.api_util.shaped_abstractify(leaf)
        except OverflowError:  # a Python int past the default integer type: jax.jit's error, naming the argument
            raise OverflowError(f"An overflow was encountered while parsing an argument to a jitted computation, "
                                f"whose argument path is {where}. Got {type(leaf)} with value {leaf}") from None
    if hasattr(leaf, "__jax_array__"):
        return jax.typeof(leaf.__jax_array__())
    # jax.jit's error, naming the function as it does
    name = repr(fn) if fn is not None else "the function"
    raise TypeError(f"Error interpreting argument to {name} as an abstract "
                    f"array. The problematic value is of type {type(leaf)} and was passed to the function at path "
                    f"{where}.\nThis typically means that a jit-wrapped function was called with a non-array "
                    f"argument, and this argument was not marked as static using the static_argnums or "
                    f"static_argnames parameters of pallaskit.jit.")


# [Note: nested pallaskit functions]
# A pallaskit function called while pallaskit traces another (directly, or in a
# jax.jit / scan body inside it) is traced into it as the original function,
# as a jax.jit function would be: the outer program compiles the whole graph.
# Compiled apart, its kernels were opaque calls in the outer program, which
# neither fused across them nor let XLA's partitioner see through them (a
# sharded call's outputs came out replicated where jax.jit's keep the split).
# jax.jit's output shardings of a sharded signature (``sharding.Placed``) are
# traced so too.
_TRACING = threading.local()


@contextlib.contextmanager
def tracing():
    """pallaskit traces a function on this thread in this block."""
    _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _TRACING.depth -= 1


def inside_trace() -> bool:
    """Whether pallaskit is tracing a function on this thread ([Note: nested pallaskit functions])."""
    return getattr(_TRACING, "depth", 0) > 0
