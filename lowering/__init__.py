"""pallaskit's compiler: jaxpr → IR → schedule → kernel sources. A pure function
of its inputs and a ``CompileOptions``; it keeps no state and reads no environment.

Importing the package loads only the options: the passes (and sympy, Pallas
and the rule tables they import) load on the first ``compile_jaxpr``, so a
process whose graphs all come from pallaskit's on-disk cache never imports them.
The passes themselves: ``lowering.scan_hoist.hoist_scans`` and
``lowering.attention.fuse_attention`` (jaxpr -> jaxpr),
``lowering.lower.lower``, ``lowering.scheduler.schedule``, ``lowering.codegen.program.render``."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

from lowering.errors import SymbolicUnsupported
from lowering.options import CompileOptions

if TYPE_CHECKING:
    from lowering.codegen.emitter import RenderedProgram
    from lowering.scheduler import Schedule


@dataclasses.dataclass
class CompileResult:
    program: RenderedProgram
    schedule: Schedule
    fallbacks: list[str]
    # () -> (the IR as lowered, the schedule: kernels and externs), the texts of
    # ``ir_before`` / ``ir_after``: formatted on first need (explain, debug_dir), since
    # a thousand-array graph takes a tenth of its compile to print. No pass
    # mutates the lowered graph, so the text is the same as at compile time.
    ir_texts: Callable[[], tuple[str, str]]
    # Symbolic graphs: what must hold of the dim values for the program to be
    # right (sympy booleans over ``sizes.dim_symbol``s), checked at call time.
    guards: list = dataclasses.field(default_factory=list)
    size_hints: tuple = ()  # CompileOptions.size_hints: where metrics read symbolic sizes
    # What the jaxpr -> jaxpr passes rewrote before lowering, one line each
    # (lowering/scan_hoist.py: "scan: input projection hoisted out of the loop (...)").
    rewrites: list = dataclasses.field(default_factory=list)

    @functools.cached_property
    def _ir_text(self) -> tuple[str, str]:
        return self.ir_texts()

    @property
    def ir_before(self) -> str:
        return self._ir_text[0]

    @property
    def ir_after(self) -> str:
        return self._ir_text[1]


def compile_jaxpr(closed_jaxpr, options: CompileOptions, title: str = "") -> CompileResult:
    from lowering.codegen import program as codegen_program
    from lowering.combo import combine
    from lowering.lower import lower
    from lowering.scheduler import format_schedule, schedule

    rewrites: list[str] = []
    if options.scan_hoisting:
        from lowering.scan_hoist import hoist_scans

        closed_jaxpr, rewrites = hoist_scans(closed_jaxpr)
    if options.fused_attention:
        from lowering import attention

        if attention.enabled(options):
            closed_jaxpr, more = attention.fuse_attention(closed_jaxpr)
            rewrites += more
    lowered = lower(closed_jaxpr, options)
    sched = schedule(lowered.graph, options, combine=combine)
    program = codegen_program.render(sched, options, title)
    graph = lowered.graph
    return CompileResult(program, sched, lowered.fallbacks, lambda: (graph.format(), format_schedule(sched)),
                         guards=list(program.guards), size_hints=options.size_hints, rewrites=rewrites)


__all__ = ["CompileOptions", "CompileResult", "SymbolicUnsupported", "compile_jaxpr"]
