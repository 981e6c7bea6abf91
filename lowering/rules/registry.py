"""The registry the rule modules add to (``lowering.rules`` imports them all)."""
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
