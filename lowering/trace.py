"""Tracing: a function and abstract arguments to a closed jaxpr, and the
call-like equations whose bodies the lowering inlines."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jex_core

# Equations that only wrap another jaxpr: their bodies are lowered in place.
# Each entry: primitive name -> parameter holding the body.
_CALL_BODIES = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_lin": None,  # never primal; left to XLA
}


def trace(fn: Callable, avals: Sequence[jax.ShapeDtypeStruct]) -> jex_core.ClosedJaxpr:
    """Trace ``fn`` over flat abstract arguments."""
    return jax.make_jaxpr(fn)(*avals)


# Lowering platforms of ``platform_dependent`` branches that never hold the
# program pallaskit compiles: "mosaic" is the lowering inside a Pallas TPU
# kernel (jnp.diagonal of a square matrix has such a branch); pallaskit's
# program runs on the CPU or a GPU, where the default branch is taken.
_KERNEL_ONLY_PLATFORMS = frozenset({"mosaic"})


def inlined_body(eqn) -> tuple[Any, Sequence[Any], int] | None:
    """(jaxpr, consts, first operand) of a call-like equation whose body should be
    inlined, else None: the body takes the equation's operands from ``first`` on."""
    if eqn.primitive.name == "cond":
        return _platform_branch(eqn)
    param = _CALL_BODIES.get(eqn.primitive.name)
    if param is None or param not in eqn.params:
        return None
    body = eqn.params[param]
    if isinstance(body, jex_core.ClosedJaxpr):
        return body.jaxpr, body.consts, 0
    if isinstance(body, jex_core.Jaxpr):
        return body, (), 0
    return None


def _platform_branch(eqn):
    """A ``platform_dependent`` cond whose named platforms are all kernel-only: its
    default branch, which is what XLA runs (its ``platform_index`` is left dead)."""
    platforms = eqn.params.get("branches_platforms")
    if not platforms or platforms[-1] is not None:
        return None
    if not all(set(ps) <= _KERNEL_ONLY_PLATFORMS for ps in platforms[:-1]):
        return None
    default = eqn.params["branches"][-1]
    return default.jaxpr, default.consts, 1


class VarNames:
    """Short, stable names for jaxpr variables (a, b, ..., z, ba, ...) in order of first sight."""

    def __init__(self):
        self.names: dict[int, str] = {}

    def __call__(self, v) -> str:
        if isinstance(v, jex_core.Literal):
            return repr(v.val.item()) if hasattr(v.val, "item") else repr(v.val)
        key = id(v)
        name = self.names.get(key)
        if name is None:
            n, name = len(self.names), ""
            while True:
                name = chr(ord("a") + n % 26) + name
                n = n // 26
                if n == 0:
                    break
            self.names[key] = name
        return name


_SHOWN_PARAMS = ("axes", "dimension", "dimensions", "permutation", "y", "new_dtype", "shape",
                 "broadcast_dimensions", "start_indices", "limit_indices")


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    # numpy computes ``dtype.name`` in Python on each access; a program names a few dtypes many times.
    return getattr(dtype, "name", str(dtype))


@functools.lru_cache(maxsize=1 << 12)
def _aval_text(dtype, shape: tuple) -> str:
    # Memoized: every equation's outputs are typed, and a program has a few shapes.
    return f"{_dtype_name(dtype)}[{','.join(str(d) for d in shape)}]"


def equation_text(eqn, names: VarNames) -> str:
    """One line naming a jaxpr equation, like jaxpr's own printing."""
    def typed(v):
        a = v.aval
        try:
            return f"{names(v)}:{_aval_text(a.dtype, tuple(a.shape))}"
        except TypeError:  # unhashable
            return f"{names(v)}:{_aval_text.__wrapped__(a.dtype, tuple(a.shape))}"

    outs = " ".join(typed(v) for v in eqn.outvars)
    params = [f"{k}={eqn.params[k]}" for k in _SHOWN_PARAMS if k in eqn.params]
    p = f"[{' '.join(params)}]" if params else ""
    ins = " ".join(names(v) for v in eqn.invars)
    return f"{outs} = {eqn.primitive.name}{p} {ins}".strip()


def scan_counts(params) -> tuple[int, int]:
    """(constants, carries) of a scan equation. jax 0.10 names the counts;
    jax 0.11 packs the operand layout (consts, carry, xs) into a flat tree
    ``ft_in`` instead. The body's invars are consts, carry, xs either way."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
