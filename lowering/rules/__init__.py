"""The lowering-rule registry: one rule per jax primitive.

A rule receives the ``LoweringContext``, the equation and its operand values
(buffer names, or ``ir.Const`` for literals) and returns one value per output
of the equation. Rules only add IR nodes; they never decide fusion.

Primitives with no rule run through XLA as ``ir.Extern`` nodes.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

RULES: dict[str, "Rule"] = {}


@dataclasses.dataclass(frozen=True)
class Rule:
    primitive: str
    fn: Callable
    kind: str  # "pointwise" | "view" | "reduction" | "matmul"
    note: str = ""


class PreferXLA(NotImplementedError):
    """Raised by a rule that could lower an equation but leaves it to XLA on
    purpose (a profit decision, e.g. a large matmul that cuBLAS runs faster):
    the equation becomes an extern without being counted as a fallback."""


def register_lowering(*primitives: str, kind: str, note: str = ""):
    def deco(fn):
        for p in primitives:
            if p in RULES:
                raise ValueError(f"duplicate lowering rule for {p}")
            RULES[p] = Rule(p, fn, kind, note)
        return fn

    return deco


def coverage_markdown() -> str:
    """docs/coverage.md: every primitive with a rule, generated from the registry."""
    lines = ["# Lowering-rule coverage", "",
             "Generated from `lowering.rules.RULES` by `python -m lowering.rules > docs/coverage.md`;",
             "a test checks it is current. Every primitive not listed runs through XLA as an",
             "`Extern` node inside the same graph (logged once per primitive), so the rest still fuses.", "",
             "| primitive | kind | note |", "|---|---|---|"]
    for name in sorted(RULES):
        r = RULES[name]
        lines.append(f"| `{name}` | {r.kind} | {r.note} |")
    return "\n".join(lines) + "\n"


from lowering.rules import matmul, pointwise, reductions, views  # noqa: E402,F401  (registration)
