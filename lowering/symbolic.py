"""Symbolic (dynamic) dims: jax's ``_DimExpr`` sizes as sympy expressions.

[Note: symbolic dims]
A function traced with ``jax.export.symbolic_shape`` dims has a jaxpr whose
avals and shape parameters hold jax dimension expressions (``n``, ``2*n``).
Lowering sees them as sympy expressions over *dim symbols* (``sizes.dim_symbol``:
positive integers named like the jax symbol), so index expressions, masks and
kernel extents keep the size symbolic and one rendered program serves every
size. Heuristics (block sizes, warps, fusion profit) evaluate sizes at the
hints of ``CompileOptions.size_hints`` (``sizes.hint``).

Rules never see a jax dimension expression: ``eqn_view`` gives them an
equation whose avals and params have sympy dims. What the symbolic path
cannot take raises ``SymbolicUnsupported``; the runtime then compiles that
signature per concrete size (``pallaskit/dynamic.py``)."""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import sympy

from lowering import sizes
from lowering.errors import SymbolicUnsupported




def is_jax_dim(d) -> bool:
    """A jax symbolic dimension expression (not a constant int)."""
    return not isinstance(d, (int, np.integer)) and hasattr(d, "get_vars")


def has_symbolic(shape) -> bool:
    for d in shape:  # a loop, not any(): every equation's avals are checked, nearly all of ints
        if type(d) is not int and is_jax_dim(d):
            return True
    return False


def to_sympy(d):
    """A jax dim (int or ``_DimExpr``) as an int or a sympy expression over dim symbols."""
    if isinstance(d, (int, np.integer)):
        return int(d)
    if not is_jax_dim(d):
        return d
    return _parse_dim(str(d), tuple(sorted(d.get_vars())))


@functools.lru_cache(maxsize=1 << 12)
def _parse_dim(text: str, names: tuple):
    # Memoized by the dim's text: a graph asks for the same few dims again and
    # again (every aval and param), and sympify parses the text each time.
    symbols = {v: sizes.dim_symbol(v) for v in names}
    local = dict(symbols)
    local.update(floordiv=sizes.FloorDiv, mod=sizes.mod, max=sympy.Max, min=sympy.Min)
    expr = sympy.sympify(text, locals=local)
    if expr.has(sizes.FloorDiv, sympy.Max, sympy.Min) or not expr.is_polynomial(*symbols.values()):
        raise SymbolicUnsupported(f"the symbolic dim {text} is not a polynomial of the dim symbols")
    return sizes.simplify(expr)


def convert(value):
    """``value`` (a param: int, dim, tuple, list...) with jax dims made sympy."""
    if is_jax_dim(value):
        return to_sympy(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(convert(v) for v in value)
    if isinstance(value, list):
        return [convert(v) for v in value]
    return value


def params_symbolic(params) -> bool:
    """Do an equation's params hold a symbolic dim (then XLA cannot run it as is)?"""
    return any(_holds_jax_dim(v) for v in params.values())


def _holds_jax_dim(v) -> bool:
    # A module function, not a recursive closure: that is a reference cycle per
    # call (every equation's), garbage that only the cyclic collector frees.
    if is_jax_dim(v):
        return True
    if isinstance(v, (tuple, list)):
        return any(_holds_jax_dim(x) for x in v)
    return False


@dataclasses.dataclass(frozen=True)
class SymAval:
    """An aval with sympy dims: what rules and IR nodes see for symbolic values."""

    shape: tuple
    dtype: object
    weak_type: bool = False

    @property
    def ndim(self):
        return len(self.shape)

    def str_short(self):
        return f"{np.dtype(self.dtype).name}[{','.join(str(d) for d in self.shape)}]"


def aval_view(aval):
    """``aval`` with sympy dims when it has a symbolic one; else ``aval`` itself."""
    shape = getattr(aval, "shape", None)
    if shape is None or not has_symbolic(shape):
        return aval
    return SymAval(tuple(to_sympy(d) for d in shape), aval.dtype, getattr(aval, "weak_type", False))


class _VarView:
    __slots__ = ("aval", "var")

    def __init__(self, var):
        self.var = var
        self.aval = aval_view(var.aval)


class EqnView:
    """An equation as rules see it in a symbolic graph: avals and params with sympy dims."""

    def __init__(self, eqn):
        self.eqn = eqn
        self.primitive = eqn.primitive
        self.effects = eqn.effects
        self.params = {k: convert(v) for k, v in eqn.params.items()}
        self.invars = [_VarView(v) for v in eqn.invars]
        self.outvars = [_VarView(v) for v in eqn.outvars]


def eqn_symbolic(eqn) -> bool:
    for vs in (eqn.invars, eqn.outvars):
        for v in vs:
            if has_symbolic(getattr(v.aval, "shape", ())):
                return True
    return params_symbolic(eqn.params)


def is_plain(aval) -> bool:
    """Arrays a kernel can hold: numeric or bool, non-empty, a shape of ints or
    of sympy sizes over dim symbols (a symbolic graph: [Note: symbolic dims])."""
    if isinstance(aval, SymAval):
        return _is_plain(tuple(aval.shape), aval.dtype)
    try:  # a jax aval: its dims are ints or jax dims (canonical), which no other dim equals
        return _jax_aval_is_plain(tuple(aval.shape), aval.dtype)
    except TypeError:  # unhashable
        return _is_plain(tuple(aval.shape), aval.dtype)


@functools.lru_cache(maxsize=1 << 14)
def _jax_aval_is_plain(shape: tuple, dtype) -> bool:
    # Memoized: every equation's avals are checked, and a program has a few shapes.
    return _is_plain(shape, dtype)


def _is_plain(shape: tuple, dtype) -> bool:
    if not _plain_dtype(dtype):
        return False
    if not all(isinstance(d, int) or isinstance(d, sympy.Expr) for d in shape):
        return False
    n = sizes.numel(shape)
    return n > 0 if isinstance(n, int) else sympy.sympify(n).is_positive is True


@functools.lru_cache(maxsize=None)
def _plain_dtype(dtype) -> bool:
    # Memoized: every equation's avals are checked, and jnp.issubdtype is slow.
    try:
        dt = np.dtype(dtype)
    except TypeError:  # extended dtypes (PRNG keys, float0)
        return False
    return bool(jnp.issubdtype(dt, jnp.floating) or jnp.issubdtype(dt, jnp.integer) or dt == np.bool_)


def program_dims(schedule) -> list[str]:
    """Names of the dim symbols of a scheduled symbolic graph (its inputs'
    shapes hold them), in the order of the program's dims array. Kept on the
    schedule: the renderers ask once per kernel."""
    hit = schedule.__dict__.get("_program_dims")
    if hit is not None and hit[0] is schedule.graph:
        return list(hit[1])
    graph = schedule.graph
    found = set()
    for name in graph.inputs:
        found |= sizes.dim_symbols(graph.buffer_aval(name)[0])
    out = sorted(s.name for s in found)
    schedule.__dict__["_program_dims"] = (graph, tuple(out))
    return out
