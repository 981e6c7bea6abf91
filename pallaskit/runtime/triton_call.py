"""Raw Triton kernels inside the XLA program (executor ``triton_xla``, lowering/executors.py).

[Note: Triton inside XLA]
Every kernel the raw Triton renderer writes (codegen/triton.py) can run
inside the XLA program instead of as a ``pallas_call``: the default on a GPU,
where Pallas's Triton backend is deprecated, and the way past what Pallas
cannot ask Triton for (``tl.range(..., num_stages=...)``: the RMSNorm
backward's mix kernel pipelines its row loads through shared memory).
Such a kernel joins the program as a JAX primitive, ``triton_call_p``,
which the generated module binds through ``TRITON_CALL`` (the loader
provides it), so it stays one XLA executable: one command buffer per call,
the on-disk cache of executables, ``jax.jit`` and ``jax.grad`` around it as
for any pallaskit program. A symbolic program's sizes are scalar kernel
parameters (ints when the program is traced for a size).

- *GPU*: the kernel compiles with Python Triton (its stages up to PTX,
  without Triton's cache: ``triton_launch._compile_uncached``), once per
  kernel, signature and GPU in this process, on compile threads started when
  the program is traced (``_start_compile``), each of which hands it to a
  worker process of its own ([Note: compile workers] in
  runtime/triton_compile.py); the lowering waits for it and
  emits the custom call jaxlib provides for Triton kernels
  (``triton_kernel_call_ffi``, what jax-triton emits, registered again under
  pallaskit's name for command buffers: [Note: Triton kernels in command buffers]
  in runtime/ffi_targets.py; a zlib-compressed ``TritonKernelCall``
  proto holding the PTX, which jaxlib assembles with ptxas on first launch).
  Every operand and result is a flat array, 16-byte aligned as XLA allocates
  them. jaxlib passes null for Triton's global and profile scratch pointers,
  so a kernel that needs scratch memory is refused at compile time.
- *Interpret mode*: the lowering is a host callback that runs the kernel in
  Triton's interpreter on numpy copies (``triton_launch._HostTensor``), so
  the CPU tests run the same kernel source.

The executable embeds the PTX: a warm process that loads it from the cache
compiles nothing, Triton included.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import weakref
import zlib

import jax
import numpy as np
from jax.experimental import io_callback
from jax.extend.core import Primitive

from pallaskit.runtime import ffi_targets, triton_compile, triton_launch

log = logging.getLogger("pallaskit")
triton_call_p = Primitive("pallaskit_triton_call")
triton_call_p.multiple_results = True


def triton_module(interpret: bool):
    """The triton module, imported in interpret mode or not (``TRITON`` in generated code)."""
    return triton_launch._triton(interpret)


class _Kernel:
    """A ``@triton.jit`` function with its launch options: a primitive parameter
    (hashed by identity), and the PTX compiled for it."""

    def __init__(self, fn, num_warps: int, num_stages: int):
        self.fn, self.num_warps, self.num_stages = fn, num_warps, num_stages
        self.name = fn.__name__
        self._ptx: dict[tuple, concurrent.futures.Future] = {}  # of triton_launch._Compiled
        self._lock = threading.Lock()
        self.assembling: set = set()  # (signature, constexprs) assembled early ([Note: assembling PTX early])

    def __repr__(self):
        return f"{self.name}(num_warps={self.num_warps}, num_stages={self.num_stages})"

    def compiled(self, signature: dict, constexprs: dict, capability: int) -> triton_launch._Compiled:
        return self.start(signature, constexprs, capability).result()

    def start(self, signature: dict, constexprs: dict, capability: int) -> concurrent.futures.Future:
        """The compile of this signature, started on the compile threads once:
        a program's kernels compile at once while JAX traces and lowers the rest."""
        key = (tuple(signature.items()), tuple(constexprs.items()), capability)
        with self._lock:
            if key not in self._ptx:
                self._ptx[key] = _compile_pool().submit(self._compile, signature, constexprs, capability)
            return self._ptx[key]

    def _compile(self, signature, constexprs, capability):
        triton_launch._triton(interpret=False)
        from triton.backends.compiler import GPUTarget

        from pallaskit.config import config

        signature = {**signature, **{c: "constexpr" for c in constexprs}}
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}

        def here():
            src = triton_launch.ast_source(self.fn, signature, constexprs)
            return triton_launch._compile_uncached(src, GPUTarget("cuda", capability, 32), options, until="ptx")

        # Triton's frontend holds the GIL: a worker process compiles it where it can ([Note: compile workers])
        module = triton_compile.module_payload(self.fn) if config.triton_compile_processes else None
        job = dict(name=self.fn.__name__, signature=signature, constexprs=constexprs, options=options,
                   target=("cuda", capability, 32), until="ptx")
        compiled = triton_compile.compile_job(module, job, here)
        triton_launch.check_plain_launch(self.name, compiled.metadata)
        return compiled


# One _Kernel per (function, launch options), so that equal calls trace to equal
# primitive parameters. Held weakly: an entry lives as long as a trace or a
# compiled program refers to it, and a program that is dropped frees its kernels.
# Keyed by the function's identity (the _Kernel holds the function, so its id is
# not reused while the entry lives): a JITFunction's own hash parses its source
# and its callees', which the compile worker does anyway.
_kernels: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_kernels_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                                 thread_name_prefix="pallaskit-triton-compile")


def _kernel(fn, num_warps: int, num_stages: int) -> _Kernel:
    with _kernels_lock:
        key = (id(fn), num_warps, num_stages)
        kernel = _kernels.get(key)
        if kernel is None:
            kernel = _kernels[key] = _Kernel(fn, num_warps, num_stages)
        return kernel


def triton_call(fn, grid: int, out_shapes, *args, scalars=(), num_warps: int, num_stages: int, interpret: bool,
                aliases=(), **constexprs) -> tuple:
    """Run ``fn`` (``@triton.jit``, parameters: ``args``' pointers, then one
    per output, then ``scalars`` (ints known when the program is traced: a
    symbolic program's sizes), then ``constexprs``) on a 1-D grid of ``grid``
    programs; the outputs (``jax.ShapeDtypeStruct``s) are fresh arrays, but
    for ``aliases``' (input index, output index) pairs: that output starts
    as that input (XLA's ``input_output_aliases``: in place where the input is
    not used after, else XLA copies it first; an atomic scatter's operand)."""
    out_avals = tuple(jax.core.ShapedArray(tuple(s.shape), np.dtype(s.dtype)) for s in out_shapes)
    kernel, scalars = _kernel(fn, num_warps, num_stages), tuple(int(v) for v in scalars)
    if not interpret:
        _start_compile(kernel, [np.dtype(a.dtype) for a in args], [a.dtype for a in out_avals], scalars, constexprs)
    return tuple(triton_call_p.bind(
        *args, kernel=kernel, grid=int(grid), out_avals=out_avals, scalars=scalars,
        constexprs=tuple(constexprs.items()), interpret=bool(interpret),
        aliases=tuple((int(i), int(o)) for i, o in aliases)))


def _signature(kernel: _Kernel, dtypes, scalars) -> dict:
    """Triton's signature of the kernel's array and scalar parameters."""
    names = list(kernel.fn.arg_names)
    signature = {n: "*" + triton_launch._triton_dtype(kernel.name, n, dt) for n, dt in zip(names, dtypes)}
    signature.update({n: _scalar_type(v) for n, v in zip(names[len(dtypes):], scalars)})
    return signature


def _start_compile(kernel: _Kernel, in_dtypes, out_dtypes, scalars, constexprs) -> None:
    """Start the kernel's compile while the program is traced (its lowering
    waits for it), then its assembly by jaxlib ([Note: assembling PTX early]);
    anything amiss is left for the lowering to raise."""
    try:
        from jax._src.lib import gpu_triton

        ffi_targets.triton_target()  # registered here, on the tracing thread, before any other thread lowers
        signature = _signature(kernel, [*in_dtypes, *out_dtypes], scalars)
        future = kernel.start(signature, dict(constexprs), gpu_triton.get_compute_capability(0))
    except Exception:  # noqa: BLE001
        return
    with kernel._lock:  # once per PTX: its signature (scalars' types, not values) and constexprs
        key = (tuple(signature.items()), tuple(constexprs.items()))
        if key in kernel.assembling:
            return
        kernel.assembling.add(key)
    job = (kernel, tuple(in_dtypes), tuple(out_dtypes), tuple(scalars), tuple(constexprs.items()))
    future.add_done_callback(lambda f: f.exception() is None and _submit_assembly(job))


_assemblies: set = set()  # assembly jobs not finished (``wait_assembly``)
_assemblies_lock = threading.Lock()


def _submit_assembly(job) -> None:
    with _assemblies_lock:
        done = _assembly_pool().submit(_assemble, *job)
        _assemblies.add(done)
    done.add_done_callback(_assemblies.discard)


def wait_assembly(timeout: float | None = None) -> None:
    """Wait for the early PTX assemblies queued so far (``wait_compiles``:
    a benchmark's steady state is timed without them holding the GIL)."""
    with _assemblies_lock:
        pending = list(_assemblies)
    concurrent.futures.wait(pending, timeout=timeout)


# [Note: assembling PTX early]
# jaxlib's Triton custom call assembles a kernel's PTX to a cubin (ptxas) when
# XLA compiles the program that calls it, one kernel after another under one
# process-wide lock, and keeps the result per (kernel name, PTX) for the
# process. For a program of a hundred distinct kernels that serial chain was
# most of XLA's compile (benchmarks/RESULTS.md, "Cold compile: jaxlib assembling PTX"). So as soon as a
# kernel's PTX is ready, a one-kernel program calling it (operands of one
# element: jaxlib's cache key holds no shapes or grid) is compiled on a
# background thread: the chain runs while the other kernels still compile to
# PTX and JAX lowers the program, and the program's own compile finds every
# cubin made. Nothing runs on the device.
@functools.lru_cache(maxsize=None)
def _assembly_pool() -> concurrent.futures.ThreadPoolExecutor:
    # Two threads: jaxlib assembles one kernel at a time; the other thread
    # meanwhile traces and lowers the next one-kernel program.
    return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="pallaskit-ptx-assembly")


def _assemble(kernel, in_dtypes, out_dtypes, scalars, constexprs) -> None:
    outs = tuple(jax.core.ShapedArray((1,), dt) for dt in out_dtypes)

    def one_kernel(*args):
        return triton_call_p.bind(*args, kernel=kernel, grid=1, out_avals=outs, scalars=scalars,
                                  constexprs=constexprs, interpret=False, aliases=())

    try:
        jax.jit(one_kernel).lower(*(jax.ShapeDtypeStruct((1,), dt) for dt in in_dtypes)).compile()
    except Exception as e:  # noqa: BLE001 - the program's own compile assembles it then
        log.debug("pallaskit: assembling %s early failed (%s: %s)", kernel.name, type(e).__name__, e)


@triton_call_p.def_abstract_eval
def _abstract_eval(*avals, out_avals, **_):
    return list(out_avals)


def _interpreted(*args, kernel, grid, out_avals, scalars, constexprs, aliases=()):
    """The kernel in Triton's interpreter, on host copies (an aliased output and
    its input one array, as on the GPU), through a callback. An
    io_callback, not a pure one: XLA:CPU hoisted a pure callback out of a while
    loop's body (the loop's gcd kernel of jnp.lcm ran once, the loop never ended)."""
    def host(*arrays):
        ins = [np.array(x) for x in arrays]
        outs = [np.empty(a.shape, a.dtype) for a in out_avals]
        for i, o in aliases:  # an aliased output is its input's memory, as on the GPU: a load after
            ins[i] = np.array(ins[i], dtype=out_avals[o].dtype)  # another program's store sees it
            outs[o] = ins[i].reshape(out_avals[o].shape)
        tensors = [triton_launch._HostTensor(x) for x in ins] + [triton_launch._HostTensor(o) for o in outs]
        triton_launch.run_interpreted(kernel.fn, (grid, 1, 1), [*tensors, *scalars], dict(constexprs))
        return tuple(outs)

    shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals)
    # The barrier keeps the callback's results apart from the tuple it returns:
    # XLA:CPU folds tuple(gte(cb, 0), gte(cb, 1), ...) into the callback, and a
    # while_loop body whose whole carry was one callback's results then fed its
    # first iteration's results to every later one (a loop that never ended).
    return jax.lax.optimization_barrier(io_callback(host, shapes, *args, ordered=False))


def _scalar_type(value: int) -> str:
    return "i32" if -2**31 <= value < 2**31 else "i64"


def _lowering(ctx, *args, kernel, grid, out_avals, scalars, constexprs, interpret, aliases=()):
    from jax._src.interpreters import mlir

    if interpret:
        return mlir.lower_fun(functools.partial(_interpreted, kernel=kernel, grid=grid, out_avals=out_avals,
                                                scalars=scalars, constexprs=constexprs, aliases=aliases),
                              multiple_results=True)(ctx, *args)
    if tuple(ctx.module_context.platforms) != ("cuda",):
        raise triton_launch.LaunchError(f"{kernel.name}: raw Triton kernels run on a CUDA GPU or in interpret "
                                        f"mode, not on {ctx.module_context.platforms}")
    from jax._src.lib import gpu_triton
    from jax._src.lib.mlir import ir

    avals = list(ctx.avals_in) + list(ctx.avals_out)
    names = list(kernel.fn.arg_names)
    if len(names) != len(avals) + len(scalars) + len(constexprs):
        raise triton_launch.LaunchError(f"{kernel.name} takes {names}: got {len(avals)} arrays, {len(scalars)} "
                                        f"scalars and {[c for c, _ in constexprs]}")
    signature = _signature(kernel, [a.dtype for a in avals], scalars)
    capability = gpu_triton.get_compute_capability(0)
    compiled = kernel.compiled(signature, dict(constexprs), capability)
    meta = compiled.metadata
    launch = gpu_triton.TritonKernelCall(
        gpu_triton.TritonKernel(meta.name, kernel.num_warps, 1, meta.shared, compiled.cubin.decode(), "", capability),
        grid, 1, 1, [gpu_triton.create_array_parameter(0, 16) for _ in avals]
        + [gpu_triton.create_scalar_parameter(v, _scalar_type(v)) for v in scalars])
    opaque = zlib.compress(launch.to_proto(meta.name, b""))

    def layouts(avs):
        return [list(reversed(range(a.ndim))) for a in avs]

    result_types = [ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(a.dtype)) for a in ctx.avals_out]
    return mlir.custom_call(
        ffi_targets.triton_target(), result_types=result_types, operands=list(args),
        backend_config=dict(name=ir.StringAttr.get(meta.name), opaque=ir.StringAttr.get(opaque)),
        operand_layouts=layouts(ctx.avals_in), result_layouts=layouts(ctx.avals_out),
        operand_output_aliases=dict(aliases) or None).results


def _register():
    from jax._src.interpreters import mlir

    mlir.register_lowering(triton_call_p, _lowering)


_register()
