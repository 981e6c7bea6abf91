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
    return sympy.expand(sum((i * s for i, s in zip(index, contiguous_strides(shape))), sympy.Integer(0)))


def unravel(linear, shape: Sequence[int]) -> tuple:
    """Row-major index in ``shape`` of the linear position ``linear``."""
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
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def simplify(expr):
    return sympy.expand(expr)


def to_source(expr) -> str:
    """Python source for an index expression over int arrays (``//`` for FloorDiv)."""
    return _Printer().doprint(expr)


class _Printer(sympy.printing.str.StrPrinter):
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
