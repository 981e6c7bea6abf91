"""pallaskit's compiler: jaxpr → IR → schedule → kernel sources. A pure function
of its inputs and a ``CompileOptions``; it keeps no state and reads no environment.

Importing the package loads only the options: the passes (and sympy, Pallas
and the rule tables they import) load on the first ``compile_jaxpr``, so a
process whose graphs all come from pallaskit's on-disk cache never imports them.
The passes themselves: ``lowering.lower.lower``, ``lowering.scheduler.schedule``,
``lowering.codegen.pallas.render``."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from lowering.options import CompileOptions

if TYPE_CHECKING:
    from lowering.codegen.pallas import RenderedProgram
    from lowering.scheduler import Schedule


class SymbolicUnsupported(NotImplementedError):
    """A graph with symbolic (dynamic) dims that cannot be compiled shape-generic;
    the message says why. Defined here (not in ``lowering.symbolic``) so the
    runtime can catch it without importing the passes. [Note: symbolic dims]"""


@dataclasses.dataclass
class CompileResult:
    program: RenderedProgram
    schedule: Schedule
    fallbacks: list[str]
    ir_before: str  # the IR as lowered
    ir_after: str  # the schedule: kernels and externs
    # Symbolic graphs: what must hold of the dim values for the program to be
    # right (sympy booleans over ``sizes.dim_symbol``s), checked at call time.
    guards: list = dataclasses.field(default_factory=list)
    size_hints: tuple = ()  # CompileOptions.size_hints: where metrics read symbolic sizes


def format_schedule(s: Schedule) -> str:
    from lowering import ir

    lines = []
    for step in s.steps:
        if isinstance(step, ir.Extern):
            lines.append(step.format())
            continue
        lines.append(f"kernel {step.name} ({step.kind} {step.rows}x{step.cols}) reads {', '.join(step.reads)}")
        for part in getattr(step, "parts", ()):  # a combo kernel: its members, each as it would run alone
            lines.append(f"  member {part.name} ({part.kind} {part.rows}x{part.cols}) reads {', '.join(part.reads)}")
            for m in part.members:
                lines.append(f"    {'store' if m.store else 'keep '} {m.role:9s} {m.name}: {ir.format_expr(m.body)}")
        for m in [] if getattr(step, "parts", ()) else step.members:
            lines.append(f"  {'store' if m.store else 'keep '} {m.role:9s} {m.name}: {ir.format_expr(m.body)}")
    return "\n".join(lines)


def compile_jaxpr(closed_jaxpr, options: CompileOptions, title: str = "") -> CompileResult:
    from lowering.codegen import pallas
    from lowering.lower import lower
    from lowering.scheduler import schedule

    lowered = lower(closed_jaxpr, options)
    sched = schedule(lowered.graph, options)
    program = pallas.render(sched, options, title)
    return CompileResult(program, sched, lowered.fallbacks, lowered.graph.format(), format_schedule(sched),
                         guards=list(program.guards), size_hints=options.size_hints)


__all__ = ["CompileOptions", "CompileResult", "SymbolicUnsupported", "compile_jaxpr", "format_schedule"]
