"""Backends: who runs a workload, and how.

A backend builds a *runner* for a workload: ``prepare`` turns the JAX input
arrays into its own (torch tensors share the memory through DLPack), ``call``
runs it, ``sync`` waits for the device, ``leaves`` turns its outputs back into
JAX arrays for the agreement check, and ``clock`` times it (timing.py).

Variants of a backend differ by options (pallaskit config overrides,
``torch._inductor.config`` options) and apply only to workloads carrying one
of their ``tags``: mix-order reduction off says nothing about an add.
Backends can be registered from outside (the tests add one that perturbs its
outputs, to see the agreement check catch it).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax

from benchmarks import timing

JAX, TORCH = "jax", "torch"


class Unavailable(Exception):
    """The backend cannot run here (not installed, no GPU) or cannot run this case."""


@dataclasses.dataclass
class Runner:
    call: Callable  # (native inputs) -> outputs
    prepare: Callable  # (tuple of jax arrays) -> native inputs
    sync: Callable  # (outputs) -> None, waits for the device
    leaves: Callable  # (outputs) -> list of jax arrays
    clock: Any
    # JAX only: (list of native input sets) -> outputs of one call per set, all
    # inside one jax.jit (one dispatch), so the host clock measures the device.
    staged: Callable | None = None
    # (native inputs) -> None: brings a size to its steady state before it is timed
    # (pallaskit's dynamic path: a recurring size's XLA executable compiles in the
    # background, runtime/eager.py; this calls once more and waits for it).
    settle: Callable | None = None


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    framework: str
    description: str
    build: Callable  # (backend, workload, hint, ctx) -> Runner; hint: see ``runner``
    options: tuple = ()  # ((name, value), ...): pallaskit config overrides or Inductor options
    tags: frozenset | None = None  # runs only on workloads with one of these tags
    compiles: bool = True  # False: nothing to compile (no first-call / sweep measurement)
    default: bool = True  # in the default --backends list
    hinted: bool = False  # can compile for a size hint (Hint x Runtime rows)

    def applies_to(self, workload) -> bool:
        return self.tags is None or bool(self.tags & workload.tags)

    def runner(self, workload, ctx, hint=None) -> Runner:
        """hint: None compiles for the shapes it is called with; an int compiles
        once for a dynamic axis 0 of ``workload.dynamic_arg`` with that size hint;
        a tuple of ints compiles multi-kernel variants, one per hint."""
        return self.build(self, workload, hint, ctx)


@dataclasses.dataclass
class Context:
    """What the backends need to know about this run."""

    platform: str  # jax.default_backend(): "cpu", "gpu"/"cuda"
    allow_cpu_compile: bool = False  # torch.compile on the CPU (slow; off by default)

    @property
    def on_gpu(self) -> bool:
        return self.platform != "cpu"


# -- JAX ----------------------------------------------------------------------------
def _jax_runner(fn, first_call_options=None) -> Runner:
    """A JAX function's runner; ``first_call_options`` (pallaskit's, applied to the
    first call) also marks a pallaskit function, which settles before steady timing."""
    first = {"done": False}

    def call(inputs):
        if not first["done"] and first_call_options:  # options act at compile time: the first call
            import pallaskit

            with pallaskit.config.override(**first_call_options):
                out = fn(*inputs)
        else:
            out = fn(*inputs)
        first["done"] = True
        return out

    many = jax.jit(lambda sets: [fn(*s) for s in sets])

    def staged(sets):
        if first_call_options:
            import pallaskit

            with pallaskit.config.override(**first_call_options):
                return many(sets)
        return many(sets)

    def settle(inputs):
        import pallaskit

        jax.block_until_ready(call(inputs))
        pallaskit.wait_compiles()

    return Runner(call=call, prepare=tuple, sync=jax.block_until_ready, leaves=jax.tree_util.tree_leaves,
                  clock=timing.HostClock(jax.block_until_ready), staged=staged,
                  settle=settle if first_call_options is not None else None)


def _build_xla(backend, workload, hint, ctx):
    if hint is not None:
        raise Unavailable("XLA compiles for the static shape only")
    return _jax_runner(jax.jit(workload.jax_fn))


def pallaskit_dynamic_jit(fn, dynamic_arg: int, hint):
    """Hook for pallaskit's dynamic shapes (issue 4): a jit of ``fn`` whose
    argument ``dynamic_arg`` has a dynamic axis 0, compiled for ``hint`` (an
    int) or with multi-kernel variants (a tuple of hints). Returns (jitted fn,
    config overrides), or raises Unavailable while pallaskit has no such API."""
    import pallaskit

    params = inspect.signature(pallaskit.jit).parameters
    if "dynamic" not in params or "multi_kernel_hints" not in pallaskit.config.snapshot():
        raise Unavailable("pallaskit has no dynamic shapes yet (issue 4): static compile per size only")
    hints = hint if isinstance(hint, tuple) else (hint,)
    # dynamic_launch off: these rows time the hinted variants themselves, not the
    # eager launches and static tier-up that serve a dynamic dim by default
    options = {"multi_kernel_hints": ",".join(map(str, hints)), "dynamic_launch": "off"}
    return pallaskit.jit(fn, dynamic={dynamic_arg: (0,)}), options


def _build_pallaskit(backend, workload, hint, ctx):
    import pallaskit

    options = dict(backend.options)
    missing = [k for k in options if k not in pallaskit.config.snapshot()]
    if missing:
        raise Unavailable(f"pallaskit has no option {', '.join(missing)}")
    if hint is None:
        return _jax_runner(pallaskit.jit(workload.jax_fn), options)
    fn, hint_options = pallaskit_dynamic_jit(workload.jax_fn, workload.dynamic_arg, hint)
    return _jax_runner(fn, {**options, **hint_options})


def _build_pallaskit_dynamic(backend, workload, hint, ctx):
    """The sweep as a user of dynamic shapes writes it: one ``pallaskit.jit``
    with axis 0 of the varying argument dynamic, default multi-kernel hints."""
    import pallaskit
    from benchmarks.workloads import SWEEP

    if workload.kind != SWEEP or hint is not None:
        raise Unavailable("serves the dynamic-shape sweep; see pallaskit's hinted rows elsewhere")
    options = dict(backend.options)
    missing = [k for k in options if k not in pallaskit.config.snapshot()]
    if missing:
        raise Unavailable(f"pallaskit has no option {', '.join(missing)}")
    return _jax_runner(pallaskit.jit(workload.jax_fn, dynamic={workload.dynamic_arg: (0,)}), options)


# -- torch --------------------------------------------------------------------------
def import_torch():
    try:
        import torch
    except ImportError:
        raise Unavailable("torch is not installed (pip install -e '.[torch]')") from None
    return torch


def torch_device(ctx) -> str:
    torch = import_torch()
    if ctx.on_gpu:
        if not torch.cuda.is_available():
            raise Unavailable("torch has no CUDA here")
        return "cuda"
    return "cpu"


def _torch_leaves(out):
    if isinstance(out, (tuple, list)):
        return [leaf for o in out for leaf in _torch_leaves(o)]
    return [out]


def to_jax(t):
    """A torch tensor as a JAX array (through DLPack; bool through uint8)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        return jax.dlpack.from_dlpack(t.to(torch.uint8)).astype(bool)
    return jax.dlpack.from_dlpack(t)


def _torch_runner(torch, device, fn, dynamic_arg=None, hint=None) -> Runner:
    def prepare(inputs):
        jax.block_until_ready(inputs)
        tensors = tuple(torch.from_dlpack(x) for x in inputs)
        if dynamic_arg is not None:
            hint_kw = {"hint_override": hint} if isinstance(hint, int) else {}
            torch._dynamo.mark_dynamic(tensors[dynamic_arg], 0, **hint_kw)
        return tensors

    def sync(out):
        if device == "cuda":
            torch.cuda.synchronize()

    clock = timing.CudaEventClock(torch) if device == "cuda" else timing.HostClock(sync)
    return Runner(call=lambda inputs: fn(*inputs), prepare=prepare, sync=sync,
                  leaves=lambda out: [to_jax(t) for t in _torch_leaves(out)], clock=clock)


def _build_torch_eager(backend, workload, hint, ctx):
    torch = import_torch()
    device = torch_device(ctx)
    if hint is not None:
        raise Unavailable("eager compiles nothing")
    return _torch_runner(torch, device, workload.torch_fn(lambda f: f))


def _inductor_options(torch, options: dict) -> dict:
    config = torch._inductor.config
    for key in options:
        obj = config
        for part in key.split("."):
            if not hasattr(obj, part):
                raise Unavailable(f"this torch ({torch.__version__}) has no Inductor option {key}")
            obj = getattr(obj, part)
    return options


def _build_torch_compile(backend, workload, hint, ctx, dynamic=None):
    torch = import_torch()
    device = torch_device(ctx)
    if device == "cpu" and not ctx.allow_cpu_compile:
        raise Unavailable("torch.compile on the CPU is not what this suite compares (--allow_cpu_compile)")
    options = _inductor_options(torch, dict(backend.options))
    torch._dynamo.reset()  # compiled code is cached per code object: start each backend clean
    kwargs = {"dynamic": dynamic}
    if isinstance(hint, tuple):
        options = {**_inductor_options(torch, {"multi_kernel_hints": list(hint)}), **options}
    elif hint is None and workload.kind == "hint_runtime":
        kwargs["dynamic"] = False  # the "static" row: one compile per size
    if options:
        kwargs["options"] = options

    def compile(f):
        return torch.compile(f, **kwargs)
    dynamic_arg = workload.dynamic_arg if hint is not None else None
    return _torch_runner(torch, device, workload.torch_fn(compile), dynamic_arg, hint)


def _vjp_form(workload):
    """The workload with its torch twin written through torch.func.vjp."""
    if workload.torch_vjp_fn is None:
        raise Unavailable(f"{workload.name} has no torch.func.vjp form")
    return dataclasses.replace(workload, torch_fn=workload.torch_vjp_fn)


def _build_torch_compile_vjp(backend, workload, hint, ctx):
    return _build_torch_compile(backend, _vjp_form(workload), hint, ctx)


def _torch_compile_dynamic(backend, workload, hint, ctx):
    if hint is not None:
        raise Unavailable("see torch_compile's hinted rows")
    return _build_torch_compile(backend, workload, hint, ctx, dynamic=True)


# -- the registry -------------------------------------------------------------------
NORM_BWD = frozenset({"norm_bwd"})
LONG_ROWS = frozenset({"long_rows"})  # rows past one tile: softmax over a vocabulary, cross-entropy

BACKENDS: dict[str, Backend] = {b.name: b for b in [
    Backend("pallaskit", JAX, "pallaskit.jit, default options", _build_pallaskit, hinted=True),
    Backend("pallaskit_mix_order_off", JAX, "pallaskit.jit, mix_order_reduction=False", _build_pallaskit,
            options=(("mix_order_reduction", False),), tags=NORM_BWD),
    Backend("pallaskit_pallas_mix", JAX, "pallaskit.jit, kernel_backend='pallas' (mix kernels, and every other "
            "kernel, in Pallas)", _build_pallaskit, options=(("kernel_backend", "pallas"),), tags=NORM_BWD),
    Backend("pallaskit_pallas", JAX, "pallaskit.jit, kernel_backend='pallas' (every kernel through Pallas's "
            "Triton backend, as before raw Triton became the GPU default)", _build_pallaskit,
            options=(("kernel_backend", "pallas"),), default=False),
    Backend("pallaskit_triton", JAX, "pallaskit.jit, kernel_backend='triton' (every kernel raw Triton inside XLA, "
            "long-row mix kernels included)", _build_pallaskit,
            options=(("kernel_backend", "triton"),), default=False),
    Backend("pallaskit_dynamic", JAX, "pallaskit.jit, dynamic axis 0 (default multi-kernel hints)",
            _build_pallaskit_dynamic, tags=frozenset({"dynamic"})),
    Backend("pallaskit_static_sizes", JAX, "pallaskit.jit, automatic_dynamic=False (one static compile per size, "
            "as jax.jit; the 'pallaskit' row has automatic dynamic, on by default)", _build_pallaskit,
            options=(("automatic_dynamic", False),), tags=frozenset({"dynamic"})),
    Backend("pallaskit_dynamic_variant_tier", JAX, "pallaskit.jit, dynamic axis 0, dynamic_tier_up='variant' (a "
            "recurring size compiles its multi-kernel variant, not its own static program)", _build_pallaskit_dynamic,
            options=(("dynamic_tier_up", "variant"),), tags=frozenset({"dynamic"}), default=False),
    Backend("pallaskit_long_rows_persistent", JAX, "pallaskit.jit, long_rows='persistent' (a row past "
            "max_persistent_cols in one tile, up to 65536)", _build_pallaskit,
            options=(("long_rows", "persistent"),), tags=LONG_ROWS, default=False),
    Backend("pallaskit_long_rows_looped", JAX, "pallaskit.jit, long_rows='looped' (column chunks, online softmax)",
            _build_pallaskit, options=(("long_rows", "looped"),), tags=LONG_ROWS, default=False),
    Backend("pallaskit_online_softmax_off", JAX, "pallaskit.jit, long_rows='looped', online_softmax=False (max, "
            "then sum, each a sweep of the row)", _build_pallaskit,
            options=(("long_rows", "looped"), ("online_softmax", False)), tags=LONG_ROWS, default=False),
    Backend("pallaskit_deterministic_scatter", JAX, "pallaskit.jit, deterministic_scatter=True (scatter-adds "
            "with many updates per element through XLA with xla_gpu_exclude_nondeterministic_ops, not atomics)",
            _build_pallaskit, options=(("deterministic_scatter", True),), tags=frozenset({"scatter"})),
    Backend("pallaskit_attention_off", JAX, "pallaskit.jit, fused_attention=False (plain attention: the scores "
            "and probabilities stored, as before the flash-attention template)", _build_pallaskit,
            options=(("fused_attention", False),), default=False),
    Backend("xla", JAX, "jax.jit", _build_xla),
    Backend("torch_eager", TORCH, "torch eager", _build_torch_eager, compiles=False),
    Backend("torch_compile", TORCH, "torch.compile, default options", _build_torch_compile, hinted=True),
    Backend("torch_compile_mix_order_off", TORCH, "torch.compile, triton.mix_order_reduction=False",
            _build_torch_compile, options=(("triton.mix_order_reduction", False),), tags=NORM_BWD),
    Backend("torch_compile_vjp", TORCH, "torch.compile of the backward written as torch.func.vjp of the forward "
            "(what autograd hands Inductor)", _build_torch_compile_vjp, tags=NORM_BWD),
    Backend("torch_compile_dynamic", TORCH, "torch.compile(dynamic=True)", _torch_compile_dynamic,
            tags=frozenset({"dynamic"})),
    Backend("torch_compile_max_autotune", TORCH, "torch.compile, max_autotune=True (slow to compile)",
            _build_torch_compile, options=(("max_autotune", True),), tags=frozenset({"matmul"}),
            default=False, hinted=True),
]}


def default_backends() -> list[str]:
    return [n for n, b in BACKENDS.items() if b.default]
