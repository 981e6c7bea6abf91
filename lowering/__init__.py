"""pallaskit's compiler: jaxpr → IR → schedule → kernel sources. A pure function
of its inputs and a ``CompileOptions``; it keeps no state and reads no environment."""
from __future__ import annotations

import dataclasses

from lowering import ir
from lowering.codegen import pallas
from lowering.lower import lower
from lowering.options import CompileOptions
from lowering.scheduler import Schedule, schedule


@dataclasses.dataclass
class CompileResult:
    program: pallas.RenderedProgram
    schedule: Schedule
    fallbacks: list[str]
    ir_before: str  # the IR as lowered
    ir_after: str  # the schedule: kernels and externs


def format_schedule(s: Schedule) -> str:
    lines = []
    for step in s.steps:
        if isinstance(step, ir.Extern):
            lines.append(step.format())
            continue
        lines.append(f"kernel {step.name} ({step.kind} {step.rows}x{step.cols}) reads {', '.join(step.reads)}")
        for m in step.members:
            lines.append(f"  {'store' if m.store else 'keep '} {m.role:9s} {m.name}: {ir.format_expr(m.body)}")
    return "\n".join(lines)


def compile_jaxpr(closed_jaxpr, options: CompileOptions, title: str = "") -> CompileResult:
    lowered = lower(closed_jaxpr, options)
    sched = schedule(lowered.graph, options)
    program = pallas.render(sched, options, title)
    return CompileResult(program, sched, lowered.fallbacks, lowered.graph.format(), format_schedule(sched))


__all__ = ["CompileOptions", "CompileResult", "compile_jaxpr", "lower", "schedule"]
