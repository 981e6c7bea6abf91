"""Kernel backends as named executors: which one runs a kernel, and why.

[Note: executors]
A generated kernel runs through one of four executors:

- ``pallas``: a ``pallas_call`` (codegen/pallas.py): interpret mode on the
  CPU, Pallas's Triton backend on a GPU (which JAX 0.11 deprecated).
- ``triton_xla``: the raw Triton kernel (codegen/triton.py) inside the XLA
  program through jaxlib's Triton custom call (pallaskit/runtime/triton_call.py);
  in interpret mode a host callback runs it in Triton's interpreter.
- ``triton_eager``: a symbolic program's new sizes, its raw Triton kernels
  launched outside XLA (pallaskit/runtime/eager.py; option ``dynamic_launch``).
- ``xla``: what pallaskit does not compile (externs, fallbacks).

``choose`` decides for a kernel of the static or symbolic program, from its
kind and ``CompileOptions`` (``kernel_backend`` and the platform facts the
runtime resolved: ``interpret``, ``triton_available``). The renderer asks it
for every kernel; a kernel the Triton renderer refuses (``TritonUnsupported``)
falls back to ``pallas`` with that reason. ``eager`` decides for the new sizes
of a symbolic program. Nothing else picks an executor.
"""
from __future__ import annotations

import dataclasses

from lowering.options import CompileOptions

PALLAS, TRITON_XLA, TRITON_EAGER, XLA = "pallas", "triton_xla", "triton_eager", "xla"
EXECUTORS = (PALLAS, TRITON_XLA, TRITON_EAGER, XLA)
KERNEL_BACKENDS = ("auto", "pallas", "triton")

# kernel_backend='auto' on a GPU: the executor of each kernel kind and why.
# Raw Triton everywhere, so nothing depends on Pallas's deprecated Triton
# backend, except where raw Triton is not measured level with Pallas yet: that
# kind names Pallas here, with its reason.
_DEPRECATED = "kernel_backend='auto' on a GPU: raw Triton inside XLA (Pallas's Triton backend is deprecated)"
GPU_AUTO = {
    "pointwise": (TRITON_XLA, _DEPRECATED),
    "reduction": (TRITON_XLA, _DEPRECATED),
    "column": (TRITON_XLA, _DEPRECATED),  # split column reductions: partial sums over row blocks
    "mix": (TRITON_XLA, _DEPRECATED),  # row reductions and one column sum over whole rows
    # Whole-row mix kernels with two or more column sums (LayerNorm backward):
    # their raw-Triton tile (heuristics.TRITON_MIX_COLUMNS_*) beat Pallas's kernel
    # on the H100 (benchmarks/RESULTS.md, "Heuristics: raw-Triton mix kernels").
    "mix_columns": (TRITON_XLA, _DEPRECATED),
    # Whole-row mix kernels whose rows are too long for a raw-Triton tile of two
    # rows (heuristics.triton_mix_config): one row a step
    # (heuristics.triton_mix_row_config), level with Pallas's kernel or faster
    # on the H200 (benchmarks/RESULTS.md, "Session 21").
    "mix_long_rows": (TRITON_XLA, _DEPRECATED),
    # The matmul template: raw Triton level with Pallas's in steady state (within 1% on the
    # suite's MLP and model steps) and faster to a first call, now that jaxlib assembles
    # its PTX early (benchmarks/RESULTS.md, "Kernel backends: the matmul template in raw Triton").
    "matmul": (TRITON_XLA, _DEPRECATED),
    "combo": (TRITON_XLA, _DEPRECATED),  # independent kernels in one launch (lowering/combo.py)
    # Atomic scatters ([Note: atomic scatters] in lowering/ir.py): only raw Triton writes them;
    # where ``choose`` says Pallas the rule leaves the scatter to XLA (``wants_triton``).
    "scatter": (TRITON_XLA, "atomic scatter: raw Triton's atomics inside XLA"),
    # Flash attention ([Note: fused attention] in lowering/attention.py): only raw Triton writes it;
    # where ``choose`` says Pallas the pass leaves attention as it is.
    "attention": (TRITON_XLA, "flash attention: raw Triton's template inside XLA"),
}


def kernel_kind(kind: str, whole_rows: bool = True, column_sums: int = 0, long_rows: bool = False) -> str:
    """The executors' kind of a scheduled kernel (``Kernel.kind`` 'pointwise',
    'reduction', 'mix', 'matmul'): a mix kernel without row work is a split
    column reduction ('column'); one with two or more column sums is
    'mix_columns'; ``long_rows`` (rows too long for a two-row raw-Triton tile:
    ``heuristics.triton_mix_config`` is None) makes it 'mix_long_rows'."""
    if kind != "mix":
        return kind
    if not whole_rows:
        return "column"
    if column_sums >= 2:
        return "mix_columns"
    return "mix_long_rows" if long_rows else "mix"


@dataclasses.dataclass(frozen=True)
class Choice:
    executor: str
    reason: str


def choose(kind: str, options: CompileOptions) -> Choice:
    """The executor of a kernel of ``kind`` (a ``GPU_AUTO`` key: see
    ``kernel_kind``) under ``options``, and why. ``triton_xla`` is a wish: the
    renderer falls back to ``pallas`` where the Triton renderer refuses the kernel."""
    if kind not in GPU_AUTO:
        raise ValueError(f"kernel kind {kind!r}: expected one of {', '.join(GPU_AUTO)}")
    backend = options.kernel_backend
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel_backend {backend!r}: expected one of {', '.join(KERNEL_BACKENDS)}")
    if backend == "pallas":
        return Choice(PALLAS, "kernel_backend='pallas'")
    if not options.triton_available:
        return Choice(PALLAS, f"kernel_backend={backend!r}, but triton is not installed"
                      + ("" if options.interpret else " or the device is not a CUDA GPU"))
    if backend == "triton":
        where = " (interpret mode: Triton's interpreter through a host callback)" if options.interpret else ""
        return Choice(TRITON_XLA, f"kernel_backend='triton': raw Triton inside XLA{where}")
    if options.interpret:
        return Choice(PALLAS, "kernel_backend='auto' in interpret mode: Pallas's interpreter")
    executor, reason = GPU_AUTO[kind]
    return Choice(executor, reason)


def wants_triton(kind: str, options: CompileOptions) -> bool:
    """Would ``choose`` run a ``kind`` kernel as raw Triton inside XLA (split.py
    sizes a mix kernel's partial buffer for the executor that will run it)?"""
    return choose(kind, options).executor == TRITON_XLA


def fallback(reason: str) -> Choice:
    """The Pallas kernel of one the Triton renderer does not write."""
    return Choice(PALLAS, f"the Triton renderer does not write it ({reason}); Pallas")


def eager(dynamic_launch: str, options: CompileOptions) -> Choice:
    """Do a symbolic program's new sizes launch eagerly as raw Triton
    (``triton_eager``), or wait for XLA's compile of the size (``xla``:
    the program's own kernels then run as ``choose`` says)? ``dynamic_launch``:
    the option's value ('auto', 'on', 'off'). Eager launches also need every
    kernel to render to raw Triton (checked by the runtime when it builds them)."""
    if dynamic_launch == "off":
        return Choice(XLA, "dynamic_launch='off': each new size compiles its XLA program")
    if dynamic_launch == "auto" and options.interpret:
        return Choice(XLA, "dynamic_launch='auto' in interpret mode: each new size compiles its XLA program")
    return Choice(TRITON_EAGER, f"dynamic_launch={dynamic_launch!r}: a new size launches the raw Triton kernels "
                  "outside XLA at once; a recurring size tiers up to its compiled program")
