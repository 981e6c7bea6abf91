"""One call signature of a pallaskit function: its static arguments and the
flat function of its dynamic leaves. ``api`` builds signatures and
``autodiff`` transforms their flat functions; both import this module, not
each other."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax


@dataclasses.dataclass(frozen=True)
class Static:
    """A static argument's value, hashed and compared by type and value (as jax.jit does)."""
    value: Any

    def __hash__(self):
        return hash((type(self.value).__name__, self.value))

    def __eq__(self, other):
        return isinstance(other, Static) and type(self.value) is type(other.value) and self.value == other.value


def hashable(v) -> Static:
    try:
        hash(v)
    except TypeError as e:  # jax.jit's error, word for word
        raise ValueError(f"Non-hashable static arguments are not supported. An error occurred while trying to "
                         f"hash an object of type {type(v)}, {v}. The error was:\n{type(e).__name__}: {e}\n") from None
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
    _jaxpr: Any = None

    def jaxpr(self):
        """The closed jaxpr of ``flat`` at ``avals``."""
        if self._jaxpr is None:
            structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in self.avals]
            self._jaxpr = jax.make_jaxpr(self.flat)(*structs)
        return self._jaxpr
