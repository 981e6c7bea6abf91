"""``pallaskit.explain``: what pallaskit makes of a function."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class KernelInfo:
    name: str
    source: str
    equations: list[str]
    kind: str


@dataclasses.dataclass
class Explanation:
    kernels: list[KernelInfo]
    fallbacks: list[str]  # primitive names run through XLA
    jaxpr: str
    ir_before: str
    ir_after: str
    source: str  # the whole generated module

    def __str__(self):
        lines = [f"{len(self.kernels)} kernel(s), {len(self.fallbacks)} XLA fallback primitive(s)"
                 + (f": {', '.join(self.fallbacks)}" if self.fallbacks else "")]
        for k in self.kernels:
            lines.append(f"- {k.name} ({k.kind}) from {len(k.equations)} equation(s):")
            lines += [f"    {e}" for e in k.equations]
        lines += ["", "schedule:", self.ir_after]
        return "\n".join(lines)


def explain(fn, *args, **kwargs) -> Explanation:
    """Compile ``fn`` (plain or ``pallaskit.jit``-wrapped) for these arguments
    without running it, and describe the result."""
    from pallaskit.api import JitFunction

    jf = fn if isinstance(fn, JitFunction) else JitFunction(fn)
    entry = jf.lower_to_result(*args, **kwargs)
    r = entry.result
    kinds = {k.name: k.kind for k in r.schedule.kernels}
    kernels = [KernelInfo(k.name, k.source, k.equations, kinds[k.name]) for k in r.program.kernels]
    return Explanation(kernels, list(r.fallbacks), str(entry.jaxpr), r.ir_before, r.ir_after, r.program.source)
