"""``pallaskit.explain``: what pallaskit makes of a function."""
from __future__ import annotations

import dataclasses
import math
import types

import jax

from pallaskit.runtime import preload


@dataclasses.dataclass
class KernelInfo:
    name: str
    source: str
    equations: list[str]
    kind: str
    iteration: tuple[int, int]  # (rows, columns) of the kernel's iteration space
    scope: str = ""  # the loop body function that launches it (e.g. scan3_body); '' for the program itself
    # Which executor runs it ('pallas', 'triton_xla') and why ([Note: executors] in lowering/executors.py).
    executor: str = "pallas"
    reason: str = ""
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
    # Pairs of kernels worth merging that the scheduler found illegal: "first + second: reason"
    # (lowering.scheduler.WhyNoFuse), in the order the fusion loop met them.
    not_fused: list[str] = dataclasses.field(default_factory=list)

    EXAMPLES = 3  # refusals shown per reason
    # A symbolic program ([Note: dynamic dims]): how a new size runs ('triton_eager' or
    # 'xla': its XLA program compiled for the size) and why; '' for static programs.
    new_sizes: str = ""
    # What the jaxpr -> jaxpr passes rewrote before lowering (a scan's hoisted input projection).
    rewrites: list[str] = dataclasses.field(default_factory=list)

    def __str__(self):
        lines = [f"{len(self.kernels)} kernel(s), {len(self.fallbacks)} XLA fallback primitive(s)"
                 + (f" (executor xla): {', '.join(self.fallbacks)}" if self.fallbacks else "")]
        if self.new_sizes:
            lines.append(f"new sizes: {self.new_sizes}")
        lines += self.rewrites
        for k in self.kernels:
            where = f" in {k.scope}" if k.scope else ""
            lines.append(f"- {k.name} ({k.kind}, {k.iteration[0]} x {k.iteration[1]}){where} "
                         f"from {len(k.equations)} equation(s):")
            lines.append(f"    executor {k.executor}: {k.reason}")
            if k.members:
                for i, m in enumerate(k.members):
                    lines.append(f"    member {i}: {m.name} ({m.kind}, {m.iteration[0]} x {m.iteration[1]}) "
                                 f"from {len(m.equations)} equation(s):")
                    lines += [f"      {e}" for e in m.equations]
            else:
                lines += [f"    {e}" for e in k.equations]
        lines += self._not_fused_lines()
        lines += ["", "schedule:", self.ir_after]
        return "\n".join(lines)


    def _not_fused_lines(self) -> list[str]:
        """The refusals grouped by reason, a few examples each."""
        if not self.not_fused:
            return []
        by_reason: dict[str, list[str]] = {}
        for text in self.not_fused:
            pair, _, reason = text.partition(": ")
            by_reason.setdefault(reason, []).append(pair)
        lines = [f"not fused ({len(self.not_fused)} pair(s) worth merging):"]
        for reason, pairs in by_reason.items():
            more = f", and {len(pairs) - self.EXAMPLES} more" if len(pairs) > self.EXAMPLES else ""
            lines.append(f"- {reason}: {'; '.join(pairs[:self.EXAMPLES])}{more}")
        return lines


def explain(fn, *args, **kwargs) -> Explanation:
    """Compile ``fn`` (plain or ``pallaskit.jit``-wrapped) for these arguments
    without running it, and describe the result."""
    from pallaskit.api import JitFunction

    jf = fn if isinstance(fn, JitFunction) else JitFunction(fn)
    return _describe(jf.lower_to_result(*args, **kwargs))


def _describe(entry) -> Explanation:
    r = entry.result
    preload.wait()
    from lowering.loops import scheduled_kernels

    sched = {k.name: k for k, _, _ in scheduled_kernels(r.schedule)}  # loop bodies' kernels too
    for k in r.program.kernels:  # flash attention: no scheduled kernel ([Note: fused attention] in lowering/attention.py)
        if k.name not in sched:
            spec = k.config
            sched[k.name] = types.SimpleNamespace(kind="attention", rows=math.prod(spec.batch) * spec.tq, cols=spec.tk)
    kernels = [KernelInfo(k.name, k.source, k.equations, sched[k.name].kind, (sched[k.name].rows, sched[k.name].cols),
                          getattr(k, "scope", ""), getattr(k, "executor", "pallas"), getattr(k, "reason", ""),
                          _members(sched[k.name]))
               for k in r.program.kernels]
    return Explanation(kernels, list(r.fallbacks), str(entry.jaxpr), r.ir_before, r.ir_after, r.program.source,
                       [str(why) for why in r.schedule.refusals], _new_sizes(entry), list(r.rewrites))


def _new_sizes(entry) -> str:
    """How a symbolic entry serves a new size, and why ('' for a static entry)."""
    if not entry.result.program.symbols:
        return ""
    from lowering import executors
    from pallaskit.api import compile_options
    from pallaskit.config import config

    choice = executors.eager(config.dynamic_launch, compile_options())
    if choice.executor == executors.TRITON_EAGER and getattr(entry.executable, "eager", None) is None:
        choice = executors.Choice(executors.XLA, "not every kernel renders to raw Triton: each new size compiles "
                                  "its XLA program")
    return f"{choice.executor}: {choice.reason}"


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
    backward_fn, lifted = entry.backward(mask)
    backward = _describe(backward_fn.lower_to_result(*lifted, *stand_ins))
    saved = [SavedValue(tuple(s.aval.shape), str(s.aval.dtype), s.nbytes, s.origin) for s in part.saved]
    return GradExplanation(part.method, saved, part.saved_bytes, default.partition.saved_bytes,
                           list(part.recomputed), forward, backward)
