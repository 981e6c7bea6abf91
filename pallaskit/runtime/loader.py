"""Turn a rendered program (Python source) into a callable."""
from __future__ import annotations

import hashlib
import linecache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowering.codegen.emitter import RenderedProgram


def _extern_callable(primitive, params):
    # A primitive holding jaxprs (shard_map, call primitives) binds with the
    # params ``get_bind_params`` makes of its equation's, as eval_jaxpr does
    # (older jax returns (subfuns, params) instead).
    bind_params = primitive.get_bind_params(dict(params))
    subfuns = ()
    if isinstance(bind_params, tuple):
        subfuns, bind_params = bind_params

    def run(*args):
        out = primitive.bind(*subfuns, *args, **bind_params)
        return tuple(out) if primitive.multiple_results else (out,)

    run.__name__ = f"extern_{primitive.name}"
    return run


def _triton_module(interpret: bool):
    """``TRITON`` of a program with raw Triton kernels (runtime/triton_call.py),
    imported only by programs that have them, also when loaded from source alone."""
    from pallaskit.runtime import triton_call

    return triton_call.triton_module(interpret)


def _weak_type(x):
    """``WEAK_TYPE``: ``interop.weak_type``."""
    from pallaskit.runtime import interop

    return interop.weak_type(x)


def _triton_call(*args, **kwargs):
    """``TRITON_CALL``: ``triton_call.triton_call``."""
    from pallaskit.runtime import triton_call

    return triton_call.triton_call(*args, **kwargs)


def load(program: RenderedProgram):
    """Execute the module source; returns its ``call`` function. The source is
    registered with linecache so tracebacks show generated lines."""
    digest = hashlib.sha256(program.source.encode()).hexdigest()[:16]
    filename = f"<pallaskit-{digest}>"
    lines = program.source.splitlines(True)
    linecache.cache[filename] = (len(program.source), None, lines, filename)
    # Triton's JIT reads the __module__ of a kernel's @triton.jit helpers (a
    # tl.reduce combine): without __name__ here it is None and compilation fails.
    namespace = {"__name__": f"pallaskit_program_{digest}",
                 "EXTERNS": [_extern_callable(p, params) for p, params in program.externs],
                 "TRITON": _triton_module, "TRITON_CALL": _triton_call,
                 "WEAK_TYPE": _weak_type}
    raw_triton = any(getattr(k, "triton", False) for k in getattr(program, "kernels", ()))
    if raw_triton:
        from pallaskit.runtime import triton_compile  # imports neither triton nor jax

        triton_compile.register_sources(filename, lines)  # [Note: function sources without the tokenizer]
    try:
        exec(compile(program.source, filename, "exec"), namespace)
    finally:
        if raw_triton:
            triton_compile.forget_sources(filename)
    for kernel in getattr(program, "kernels", ()):
        if callable(namespace.get(kernel.name)):
            namespace[kernel.name] = _manual_axes(namespace[kernel.name])
    return namespace["call"]


def _manual_axes(launch):
    """A kernel's launcher that also runs inside ``jax.shard_map`` with
    ``check_vma=True``: ``pallas_call`` cannot learn its outputs' varying
    manual axes, so it runs with the check off and its outputs vary over the
    union of its operands' axes (a kernel computes per device; collectives are
    externs, run through XLA with their own types)."""
    from pallaskit import sharding

    def run(*args, **kwargs):  # keywords: a symbolic program's dim values
        varying = sharding.varying_of((*args, *kwargs.values()))
        if not varying:
            return launch(*args, **kwargs)
        return sharding.with_varying(launch, args, kwargs, varying)

    run.__name__ = getattr(launch, "__name__", "kernel")
    return run


def load_lazily(program: RenderedProgram):
    """``load`` on the first call: a symbolic program served by eager launches
    (runtime/eager.py) may never run its Pallas module, and importing Pallas
    is a large part of a fresh process's first compile."""
    loaded = []

    def call(*args, **kwargs):
        if not loaded:
            loaded.append(load(program))
        return loaded[0](*args, **kwargs)

    return call
