"""Index expressions: sympy over non-negative integer index symbols.

Every index the IR holds is a sympy expression in the iteration symbols of the
node that holds it (``i0, i1, ...`` for the output dims, ``r0, r1, ...`` for the
reduced dims of a reduction). Floor division is ``FloorDiv``, a sympy function
that folds the cases views produce; a modulus is written ``a - b*FloorDiv(a, b)``
so that the unravel/ravel pairs of a reshape cancel by plain sympy addition.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import sympy


class FloorDiv(sympy.Function):
    """Floor division of non-negative integers, with the folds reshapes need."""

    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if isinstance(a, FloorDiv):
            return FloorDiv(a.args[0], a.args[1] * b)
        if b.is_Integer and a.is_Add:
            # (b*k*x + y) // b == k*x + y // b for integers.
            whole, rest = [], []
            for term in a.args:
                coeff, _ = term.as_coeff_Mul()
                (whole if coeff.is_Integer and int(coeff) % int(b) == 0 else rest).append(term)
            if whole:
                return sympy.Add(*[t / b for t in whole]) + FloorDiv(sympy.Add(*rest), b)
        if b.is_Integer and a.is_Mul:
            coeff, rest = a.as_coeff_Mul()
            if coeff.is_Integer and int(coeff) % int(b) == 0:
                return (coeff / b) * rest
        return None


def mod(a, b):
    """a mod b for non-negative integers, written so that it cancels against FloorDiv."""
    if b == 1:
        return sympy.Integer(0)
    return sympy.expand(a - b * FloorDiv(a, b))


@functools.lru_cache(maxsize=None)
def symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, integer=True, nonnegative=True)


@functools.lru_cache(maxsize=None)
def dim_symbol(name: str) -> sympy.Symbol:
    """A symbolic (dynamic) size: a positive integer. [Note: symbolic dims]"""
    return sympy.Symbol(name, integer=True, positive=True)


def is_symbolic(x) -> bool:
    """Does a size, or any size of a shape, depend on a dim symbol?"""
    if isinstance(x, (tuple, list)):
        return any(is_symbolic(d) for d in x)
    return isinstance(x, sympy.Basic) and not x.is_Integer


def dim_symbols(x) -> set:
    """The dim symbols a size, shape or index expression depends on."""
    if isinstance(x, (tuple, list)):
        return set().union(*[dim_symbols(d) for d in x]) if x else set()
    if not isinstance(x, sympy.Basic):
        return set()
    return {s for s in x.free_symbols if s.is_positive}


def hint(x, hints) -> int:
    """A size evaluated at the size hints (``{name: int}`` or ``((name, int), ...)``):
    what heuristics decide from when the size is symbolic."""
    if isinstance(x, (int,)):
        return x
    x = sympy.sympify(x)
    if x.is_Integer:
        return int(x)
    values = dict(hints)
    sub = {s: sympy.Integer(values[s.name]) for s in dim_symbols(x) if s.name in values}
    out = x.xreplace(sub)
    if not out.is_Integer:
        raise ValueError(f"no size hint for {sorted(str(s) for s in dim_symbols(out))} in {x}")
    return int(out)


@functools.lru_cache(maxsize=None)
def index_symbols(prefix: str, n: int) -> tuple[sympy.Symbol, ...]:
    return tuple(symbol(f"{prefix}{k}") for k in range(n))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def ravel(index: Sequence, shape: Sequence[int]):
    """Linear row-major position of ``index`` in ``shape``."""
    try:
        return _ravel(tuple(index), tuple(shape))
    except TypeError:  # unhashable parts
        return _ravel.__wrapped__(index, shape)


# Memoized: a renderer ravels the same loads of every part of a combo kernel,
# and the tile choice ravels them again.
@functools.lru_cache(maxsize=1 << 16)
def _ravel(index, shape):
    return sympy.expand(sum((i * s for i, s in zip(index, contiguous_strides(shape))), sympy.Integer(0)))


def unravel(linear, shape: Sequence[int]) -> tuple:
    """Row-major index in ``shape`` of the linear position ``linear``."""
    return _unravel(linear, tuple(shape))


# The scheduler asks for the same few (coordinate, shape) pairs each time it
# weighs a merge (RESULTS.md, "The 12-layer GPT-2 step's first call").
@functools.lru_cache(maxsize=1 << 16)
def _unravel(linear, shape: tuple) -> tuple:
    out = []
    for k, (d, s) in enumerate(zip(shape, contiguous_strides(shape))):
        if d == 1:
            out.append(sympy.Integer(0))
            continue
        q = FloorDiv(linear, s)
        out.append(q if k == 0 else mod(q, d))
    return tuple(out)


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def next_power_of_2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def simplify(expr):
    try:
        return _expand(expr)
    except TypeError:  # unhashable: a list or the like, which expand rejects or handles itself
        return sympy.expand(expr)


@functools.lru_cache(maxsize=1 << 16)
def _expand(expr):
    # Memoized: the same index expressions are expanded again and again.
    return sympy.expand(expr)


@functools.lru_cache(maxsize=1 << 16)
def to_source(expr) -> str:
    """Python source for an index expression over int arrays (``//`` for FloorDiv)."""
    return _Printer().doprint(expr)


@functools.lru_cache(maxsize=1 << 16)
def text(expr) -> str:
    """``str(expr)``, memoized (the IR prints the same masks and indices often)."""
    return str(expr)


class _Printer(sympy.printing.str.StrPrinter):
    def _print_Pow(self, e):
        # A product: a raw-Triton dim is a tensor, which has no ``**`` (x.shape[0] ** 2 of a square's diagonal)
        base, exp = e.args
        if exp.is_Integer and int(exp) > 1:
            b = self._print(base) if base.is_Atom else f"({self._print(base)})"
            return "(" + " * ".join([b] * int(exp)) + ")"
        return super()._print_Pow(e)

    def _print_FloorDiv(self, e):
        num, den = (self._print(a) if a.is_Atom else f"({self._print(a)})" for a in e.args)
        return f"({num} // {den})"

    def _print_Add(self, e):
        # Print ``a - b*FloorDiv(a, b)`` (what sympy makes of a modulo) as ``a % b``,
        # taking the widest ``a`` first so nested modulos print nested.
        best = None
        for term in e.args:
            coeff, f = term.as_coeff_Mul()
            if isinstance(f, FloorDiv) and f.args[1].is_Integer and coeff == -f.args[1]:
                rest = sympy.expand(e - f.args[0] - term)
                width = len(sympy.Add.make_args(f.args[0]))
                if len(sympy.Add.make_args(rest)) < len(e.args) and (best is None or width > best[0]):
                    best = (width, f, rest)
        if best is None:
            return super()._print_Add(e)
        _, f, rest = best
        a, b = f.args
        mod = f"({self._print(a) if a.is_Atom else f'({self._print(a)})'} % {int(b)})"
        return mod if rest == 0 else f"{self._print(rest)} + {mod}"

    def _print_Integer(self, e):
        return str(int(e))

    def _print_Mul(self, e):
        coeff, rest = e.as_coeff_Mul()
        if coeff < 0:
            return f"-{self._print(-e)}"
        factors = [self.parenthesize(a, 50) for a in e.as_ordered_factors()]
        return " * ".join(factors)

    def _print_Relational(self, e):
        return f"({self._print(e.lhs)} {e.rel_op} {self._print(e.rhs)})"

    def _print_And(self, e):
        return " & ".join(f"({self._print(a)})" for a in e.args)

    def _print_Or(self, e):
        return " | ".join(f"({self._print(a)})" for a in e.args)

    def _print_BooleanTrue(self, e):
        return "True"


# --------------------------------------------------------------------------- #
# Simplification with known ranges
# --------------------------------------------------------------------------- #
def value_range(expr, bounds: dict) -> tuple[int, int] | None:
    """[lo, hi] of an integer index expression whose symbols satisfy
    ``0 <= s < bounds[s]``; None when some part is unknown."""
    expr = sympy.sympify(expr)
    if expr.is_Integer:
        return int(expr), int(expr)
    if expr.is_Symbol:
        if expr not in bounds or is_symbolic(bounds[expr]):
            return None
        return 0, int(bounds[expr]) - 1
    if expr.is_Add:
        lo = hi = 0
        for term in expr.args:
            r = value_range(term, bounds)
            if r is None:
                return None
            lo, hi = lo + r[0], hi + r[1]
        return lo, hi
    if expr.is_Mul:
        coeff, rest = expr.as_coeff_Mul()
        r = value_range(rest, bounds) if coeff != 1 else None
        if r is None or not coeff.is_Integer:
            return None
        a, b = int(coeff) * r[0], int(coeff) * r[1]
        return min(a, b), max(a, b)
    if isinstance(expr, FloorDiv) and expr.args[1].is_Integer and int(expr.args[1]) > 0:
        r = value_range(expr.args[0], bounds)
        d = int(expr.args[1])
        return None if r is None else (r[0] // d, r[1] // d)
    return None


def _fold_floordiv(a, d: int, bounds: dict):
    """``a // d`` using ranges: 0 when ``0 <= a < d``; ``(q*g + r) // d`` is
    ``q // (d/g)`` when ``g`` divides ``d`` and ``0 <= r < g``."""
    r = value_range(a, bounds)
    if r is not None and r[0] >= 0 and r[1] < d:
        return sympy.Integer(0)
    if a.is_Add:
        terms = a.args
        for g in sorted(sympy.divisors(d), reverse=True):
            if g == 1:
                break
            whole = [t for t in terms if (c := t.as_coeff_Mul()[0]).is_Integer and int(c) % g == 0]
            rest = [t for t in terms if t not in whole]
            if not whole or not rest:
                continue
            rr = value_range(sympy.Add(*rest), bounds)
            if rr is not None and rr[0] >= 0 and rr[1] < g:
                return FloorDiv(sympy.expand(sympy.Add(*whole) / g), d // g)
    return None


def simplify_with_bounds(expr, bounds: dict):
    """``expr`` with floor divisions (and so moduli) folded where the ranges
    ``0 <= s < bounds[s]`` of its symbols decide them: a reshape's
    ``(5*i + j + i2 // 8) % ...`` over ``i2 < 8`` becomes ``5*i + j``."""
    expr = sympy.sympify(expr)
    if not expr.has(FloorDiv):
        return simplify(expr)
    for _ in range(8):  # each pass folds the innermost divisions; nests are shallow
        def fold(e):
            if e.args[1].is_Integer and int(e.args[1]) > 0:
                out = _fold_floordiv(e.args[0], int(e.args[1]), bounds)
                if out is not None:
                    return out
            return e

        new = simplify(expr.replace(lambda e: isinstance(e, FloorDiv), fold))
        if new == expr:
            return new
        expr = new
    return expr
