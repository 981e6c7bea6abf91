"""``pallaskit.explain``: what pallaskit makes of a function."""
from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass
class KernelInfo:
    name: str
    source: str
    equations: list[str]
    kind: str
    iteration: tuple[int, int]  # (rows, columns) of the kernel's iteration space
    scope: str = ""  # the loop body function that launches it (e.g. scan3_body); '' for the program itself
    # A combo kernel ([Note: combo kernels] in lowering/combo.py): its members, each
    # a KernelInfo of the kernel it would have been alone (source '').
    members: list = dataclasses.field(default_factory=list)


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
            where = f" in {k.scope}" if k.scope else ""
            lines.append(f"- {k.name} ({k.kind}, {k.iteration[0]} x {k.iteration[1]}){where} "
                         f"from {len(k.equations)} equation(s):")
            if k.members:
                for i, m in enumerate(k.members):
                    lines.append(f"    member {i}: {m.name} ({m.kind}, {m.iteration[0]} x {m.iteration[1]}) "
                                 f"from {len(m.equations)} equation(s):")
                    lines += [f"      {e}" for e in m.equations]
            else:
                lines += [f"    {e}" for e in k.equations]
        lines += ["", "schedule:", self.ir_after]
        return "\n".join(lines)


def explain(fn, *args, **kwargs) -> Explanation:
    """Compile ``fn`` (plain or ``pallaskit.jit``-wrapped) for these arguments
    without running it, and describe the result."""
    from pallaskit.api import JitFunction

    jf = fn if isinstance(fn, JitFunction) else JitFunction(fn)
    return _describe(jf.lower_to_result(*args, **kwargs))


def _describe(entry) -> Explanation:
    r = entry.result
    from lowering.loops import scheduled_kernels

    sched = {k.name: k for k, _, _ in scheduled_kernels(r.schedule)}  # loop bodies' kernels too
    kernels = [KernelInfo(k.name, k.source, k.equations, sched[k.name].kind, (sched[k.name].rows, sched[k.name].cols),
                          getattr(k, "scope", ""), _members(sched[k.name]))
               for k in r.program.kernels]
    return Explanation(kernels, list(r.fallbacks), str(entry.jaxpr), r.ir_before, r.ir_after, r.program.source)


def _members(kernel) -> list[KernelInfo]:
    return [KernelInfo(p.name, "", list(p.origin), p.kind, (p.rows, p.cols)) for p in getattr(kernel, "parts", ())]


@dataclasses.dataclass
class SavedValue:
    shape: tuple
    dtype: str
    nbytes: int
    origin: str  # "argument i" or the joint-graph equation that computes it


@dataclasses.dataclass
class GradExplanation:
    """A differentiated function: what the forward saves for the backward,
    what the backward recomputes, and the two compiled halves."""

    partitioner: str
    saved: list[SavedValue]
    saved_bytes: int  # bytes the forward keeps for the backward
    default_saved_bytes: int  # what the 'default' partition (JAX's choice) keeps
    recomputed: list[str]  # forward equations the backward runs again
    forward: Explanation
    backward: Explanation

    def __str__(self):
        lines = [f"partitioner {self.partitioner}: {len(self.saved)} value(s), {self.saved_bytes} bytes saved for "
                 f"the backward (default partition: {self.default_saved_bytes} bytes)"]
        lines += [f"  saved {v.dtype}[{','.join(map(str, v.shape))}] {v.nbytes} B: {v.origin}" for v in self.saved]
        lines.append(f"{len(self.recomputed)} forward equation(s) recomputed in the backward")
        lines += [f"  {e}" for e in self.recomputed]
        for name, ex in (("forward", self.forward), ("backward", self.backward)):
            lines += ["", f"{name}: " + str(ex).split("\n\nschedule:")[0]]
        return "\n".join(lines)


def explain_grad(fn, *args, partitioner: str | None = None, **kwargs) -> GradExplanation:
    """Partition and compile the reverse mode of ``fn`` (plain or
    ``pallaskit.jit``-wrapped) at these arguments, differentiated with respect
    to every inexact argument leaf, without running it. ``partitioner``:
    'min_cut' or 'default' (else the ``partitioner`` option)."""
    import numpy as np

    from pallaskit import autodiff
    from pallaskit.api import JitFunction

    jf = fn if isinstance(fn, JitFunction) else JitFunction(fn)
    entry = autodiff.explain_entry(jf, args, kwargs, partitioner)
    default = autodiff.explain_entry(jf, args, kwargs, "default")
    part = entry.partition
    leaves = jax.tree_util.tree_leaves(jf._split(args, kwargs)[1])
    forward = _describe(entry.forward.lower_to_result(*leaves))
    mask = (True,) * len(part.ct_outputs)
    stand_ins = [np.empty(s.aval.shape, s.aval.dtype) for s in part.saved]
    stand_ins += [np.empty(entry.sig.out_avals[j].shape, entry.sig.out_avals[j].dtype) for j in part.ct_outputs]
    backward = _describe(entry.backward(mask).lower_to_result(*stand_ins))
    saved = [SavedValue(tuple(s.aval.shape), str(s.aval.dtype), s.nbytes, s.origin) for s in part.saved]
    return GradExplanation(part.method, saved, part.saved_bytes, default.partition.saved_bytes,
                           list(part.recomputed), forward, backward)
