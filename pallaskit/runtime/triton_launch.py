"""Raw Triton kernels launched outside XLA, on JAX arrays' buffers.

[Note: launching outside XLA]
A size-generic kernel (its sizes runtime arguments, its edges masked) compiles
once; launching it at a new size should cost a launch, not the per-shape XLA
executable (trace, lowering, XLA compile) that
``jax.jit`` needs. ``Launch`` runs a sequence of such kernels directly:

- *compile*: Triton's compile stages for the kernel's AST and the GPU that
  JAX sees (``_compile_uncached``: ``triton.compile`` without Triton's cache,
  [Note: kernel artifacts]; in a compile worker process where it can,
  ``_compile_cubin``), once per argument signature (dtypes, int widths,
  constexprs); sizes are plain ints and never specialized, pointers are
  specialized as 16-byte aligned (checked at launch; without it the matmul is
  not pipelined).
- *load and launch*: the CUDA driver API through ctypes (``cuModuleLoadData``,
  ``cuLaunchKernel`` with Triton's argument layout, see ``_Launcher``), on a
  non-blocking stream of our own in the primary context XLA uses. Triton's
  own loader and launcher are C modules it builds with gcc on first use
  (a third of a cold first call), so they are not used. Triton's
  active driver (process-wide, and its CUDA flavour imports torch) is never
  asked or replaced, so a user's own Triton kernels are unaffected and torch
  is never loaded.
- *allocate*: outputs in memory from ``cuMemAllocAsync`` on our stream,
  wrapped in a DLManagedTensor of our own and imported zero-copy; its deleter
  frees the memory on our stream after XLA's stream has passed that point.
- *fences*: inputs are ready before the first launch (``block_until_ready``)
  and our stream is synchronized before outputs are handed back.

In interpret mode (no GPU) the same kernels run in Triton's interpreter on
host numpy buffers, without torch: ``_HostTensor`` answers the few
torch-tensor calls the interpreter makes. Two interpreter limits for whoever
writes kernels for it: a bfloat16 ``tl.dot`` is wrong (widen the operands to
float32), and a runtime int cannot bound a ``range`` loop (use a constexpr).

Figures (a new size in about a millisecond, an output allocation of any size
as cheap): benchmarks/RESULTS.md, "Launching outside XLA: eager launches of
new sizes".
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import os
import sys
import threading
from dataclasses import dataclass

import jax
import numpy as np

from pallaskit.runtime import interop, triton_compile
from pallaskit.runtime.triton_compile import (  # noqa: F401 - compiling is there, jax-free for the workers
    _ALIGN, PARSE_LOCK, _Compiled, _compile_uncached, _namespace, ast_source)

_TRITON_DTYPES = {  # numpy dtype name -> Triton's pointee / scalar type
    "bool": "i1", "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
}
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}  # dlpack.h kDLInt, kDLUInt, kDLFloat, kDLBool
_KDL_BFLOAT, _KDL_CUDA = 4, 2
# CUDA driver enums (cuda.h)
_MAX_SHARED_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_FUNC_MAX_THREADS, _FUNC_STATIC_SHARED, _FUNC_MAX_DYNAMIC_SHARED = 0, 1, 8  # CU_FUNC_ATTRIBUTE_*
_PREFER_SHARED = 1  # CU_FUNC_CACHE_PREFER_SHARED
log = logging.getLogger("pallaskit")


class LaunchError(RuntimeError):
    """A kernel cannot be launched as asked (bad argument, misaligned buffer,
    too little shared memory): raised before anything reaches the GPU."""


def _triton(interpret: bool | None = None):
    """The triton module. Its interpreter is chosen when triton is first imported
    (TRITON_INTERPRET: its standard library's ``@jit`` functions, ``tl.sum`` and
    ``tl.sigmoid`` among them, become interpretable or compilable then, not
    both), so interpret mode sets it if triton is not imported yet and refuses
    a process that imported triton the other way."""
    warming = _warming
    if warming is not None and warming is not threading.current_thread():
        warming.join()  # triton imported by one thread at a time (``warm_up``)
    if interpret and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
    except ImportError as e:  # an optional dependency: only the raw-Triton path needs it
        raise LaunchError("raw Triton kernels need the 'triton' package (pip install 'pallaskit[triton]')") from e
    if interpret is not None and bool(triton.knobs.runtime.interpret) != interpret:
        raise LaunchError(
            f"triton was imported {'without' if interpret else 'with'} TRITON_INTERPRET=1, so its kernels "
            f"{'cannot' if interpret else 'can only'} run in its interpreter: set it (or not) before "
            "triton is first imported")
    if triton.knobs.runtime.interpret:
        _patch_interpreter()
    triton_compile.fast_sources()  # [Note: function sources without the tokenizer]
    return triton


# [Note: one interpreted kernel at a time]
# Triton's interpreter is process-global: a kernel's run patches triton.language
# (``_patch_lang``, restored when it ends) and keeps the program id in one
# module-level builder. XLA:CPU runs independent host callbacks on several
# threads at once, so two raw-Triton kernels of one program (a combo kernel
# beside a reduction) could interleave: one saw triton.language unpatched
# ("Did you forget to add @triton.jit?"), or read the other's program id (wrong
# values). Every interpreted run takes this lock.
_INTERPRETER_LOCK = threading.Lock()


def run_interpreted(fn, grid, args, constexprs) -> None:
    """``fn[grid](*args, **constexprs)`` in Triton's interpreter, one run at a time."""
    with _INTERPRETER_LOCK:
        fn[grid](*args, **constexprs)


_interpreter_patched = False


def _patch_interpreter() -> None:
    """Three fixes to Triton 3.6's interpreter (CPU tests run raw Triton there)
    and one speed-up. It holds a scalar kernel argument as a 1-element array and converts it with
    ``int(array)``, which NumPy 2.4 refuses, so a loop over a runtime trip count
    (``range(0, n)``: dynamic sizes) raises; Triton's later interpreter squeezes
    the array first, as this does. Its float32 -> bfloat16 cast truncates
    (``_rounding_cast``). Its atomics read their operands' memory as flat
    arrays, wrong for a broadcast one (``_contiguous_atomics``). Its
    ``tl.reduce`` with a combine function folds one element at a time
    (``_reduce_by_halves``). Where the interpreter's internals moved, nothing is patched."""
    global _interpreter_patched
    if _interpreter_patched:
        return
    _interpreter_patched = True
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is not None:
        def patched(tensor, scope):
            patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
                           if np.size(self.handle.data) == 1 else int(self.handle.data))

        interpreter._patch_lang_tensor = patched
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is not None and hasattr(builder, "cast_impl") and hasattr(interpreter, "TensorHandle"):
        builder.cast_impl = _rounding_cast(builder.cast_impl, interpreter)
    if builder is not None and hasattr(builder, "create_atomic_rmw") and hasattr(interpreter, "TensorHandle"):
        builder.create_atomic_rmw = _contiguous_atomics(builder.create_atomic_rmw, interpreter)
    if builder is not None and hasattr(builder, "create_atomic_cas") and hasattr(interpreter, "TensorHandle"):
        builder.create_atomic_cas = _contiguous_atomics(builder.create_atomic_cas, interpreter)
    ops = getattr(interpreter, "ReduceOps", None)
    if ops is not None and all(hasattr(ops, a) for a in ("generic_reduce", "unravel", "to_tensor")):
        ops.generic_reduce = _reduce_by_halves(ops.generic_reduce)


# [Note: the interpreter's reductions by halves]
# Triton's interpreter runs ``tl.reduce(x, axis, combine)`` one element at a
# time: for each element it builds interpreter tensors and calls the combine
# function, a few ``tl`` operations of a few numpy calls each. The raw-Triton
# renderer reduces every float max and min with such a combine (``_max_nan``:
# ``tl.max`` drops NaN on a GPU), so one softmax test over rows of 7 (a
# 4096-wide chunk) made 74,000 combine calls, 19.7 s of its 20.6 s under a
# profiler. Here the combine runs on the two halves of the reduced axis at once,
# then on the halves of what it returned: log2(n) calls over arrays, the same
# combine function on the same values, folded as a tree as a GPU folds its
# lanes, not left to right. For max, min and the argmax / argmin picks (ties
# broken by index) the order changes nothing; a product rounds as a tree does.
# A block is a power of two long (tl.arange's rule); any other length folds as
# the interpreter does.
def _reduce_by_halves(element_by_element):
    """``ReduceOps.generic_reduce`` with the combine on halves (``.plain``: the interpreter's own)."""
    def generic_reduce(self, input):
        import triton.language as tl

        data = input[0].handle.data
        n = data.size if self.axis is None else data.shape[self.axis]
        if n == 0 or n & (n - 1):
            return element_by_element(self, input)
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        datas = [np.moveaxis(arg.handle.data, axis, 0) for arg in input]
        dtypes = [arg.dtype for arg in input]
        while datas[0].shape[0] > 1:
            half = datas[0].shape[0] // 2
            out = self.combine_fn.fn(*[self.to_tensor(d[:half], dt) for d, dt in zip(datas, dtypes)],
                                     *[self.to_tensor(d[half:], dt) for d, dt in zip(datas, dtypes)])
            out = out if isinstance(out, tuple) else (out,)
            datas = [np.broadcast_to(o.handle.data if isinstance(o, tl.core.tensor) else np.asarray(o),
                                     d[:half].shape).astype(d.dtype) for d, o in zip(datas, out)]
        ret = []
        for d, arg in zip(datas, input):
            value = d[0]
            if self.keep_dims:  # as the interpreter keeps them (after ``unravel``)
                value = value.reshape((1,) * arg.handle.data.ndim) if original_axis is None \
                    else np.expand_dims(value, axis)
            elif original_axis is None:
                value = value.item()
            ret.append(self.to_tensor(value, arg.dtype))
        return ret

    generic_reduce.plain = element_by_element
    return generic_reduce


def _contiguous_atomics(atomic, interpreter):
    """The interpreter's atomic read-modify-write (or compare-and-swap), its
    operands made contiguous first: its C++ side walks each one's memory flat,
    so a broadcast value (an atomic scatter of a scalar update: stride 0)
    combined garbage."""
    def contiguous(h):
        if not isinstance(h, interpreter.TensorHandle):
            return h
        return interpreter.TensorHandle(np.ascontiguousarray(h.data), h.dtype)

    def op(self, *args):
        return atomic(self, *[contiguous(a) for a in args])

    return op


def _rounding_cast(cast_impl, interpreter):
    """The interpreter's casts, float32 (and integers, through float32) and
    float64 -> bfloat16 rounded to nearest even as on the GPU (Triton 3.6's
    interpreter drops float32's low bits: one bf16 ulp off for about half the
    values; it reads a float64 as the bits' integer)."""
    import triton.language as tl

    def cast(self, src, dst_type):
        scalar = src.dtype.scalar
        if dst_type.scalar == tl.bfloat16 and scalar == tl.float64:
            # The interpreter's float64 -> bfloat16 cast converts the value to the bits' uint16
            # (65519.99 became a NaN, 1.004 a subnormal): rounded once to bfloat16's 8 bits, as
            # a GPU's Triton and XLA:GPU do (XLA:CPU rounds through float32, twice). In float64
            # and integers: the host callback's thread flushes float32 subnormals.
            x = np.ascontiguousarray(src.data, np.float64)
            a = np.abs(x)
            with np.errstate(all="ignore"):
                finite = np.isfinite(a) & (a != 0)
                ulp = np.ldexp(1.0, np.maximum(np.frexp(np.where(finite, a, 1.0))[1] - 8, -133))
                r = np.where(finite, np.rint(a / ulp), 0.0)  # the 8 bits (fewer below 2^-126)
                y = np.ascontiguousarray(r * ulp).view(np.uint64)  # exact
            exp = ((y >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1023 + 127
            normal = (exp << 7) | ((y >> np.uint64(45)) & np.uint64(0x7F)).astype(np.int64)
            mag = np.where(exp >= 255, 0x7F80, np.where(exp >= 1, normal, r.astype(np.int64)))
            mag = np.where(np.isinf(a), 0x7F80, np.where(np.isnan(a), 0x7FC0, mag))
            sign = (np.ascontiguousarray(x).view(np.uint64) >> np.uint64(63)).astype(np.int64) << 15
            return interpreter.TensorHandle((sign | mag).astype(np.uint16), dst_type.scalar)
        if dst_type.scalar == tl.bfloat16 and (scalar == tl.float32 or scalar.is_int()):
            x = np.ascontiguousarray(src.data.astype(np.float32) if scalar.is_int() else src.data, np.float32)
            bits = x.view(np.uint32)
            rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
            quiet = ((bits >> 16) | np.uint32(0x40)).astype(np.uint16)  # NaN stays NaN, its sign kept
            return interpreter.TensorHandle(np.where(np.isnan(x), quiet, rounded), dst_type.scalar)
        return cast_impl(self, src, dst_type)

    return cast


class _Cuda:
    """The CUDA driver API through ctypes: XLA's primary context, our stream."""

    def __init__(self, device: jax.Device):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.ordinal = device.local_hardware_id or 0
        self.context = ctypes.c_void_p()
        dev = ctypes.c_int()
        self.check("cuInit", 0)
        self.check("cuDeviceGet", ctypes.byref(dev), self.ordinal)
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), dev)  # the context XLA uses
        self._threads = threading.local()
        self.make_current()
        self.stream = ctypes.c_void_p()
        self.check("cuStreamCreate", ctypes.byref(self.stream), 1)  # CU_STREAM_NON_BLOCKING
        self.xla_stream = interop.stream(device)
        self.deleter = _DELETER(self._free)
        self._finalizing = sys.is_finalizing  # bound now: `sys` may be gone when the last arrays drop
        self.live: dict[int, tuple] = {}  # address of our DLManagedTensor -> (struct, dims, pointer)

    def check(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise LaunchError(f"{name} failed with CUresult {rc}")

    def make_current(self) -> None:
        """A context is current per thread; the dispatcher launches from several."""
        if not getattr(self._threads, "current", False):
            self.check("cuCtxSetCurrent", self.context)
            self._threads.current = True

    def synchronize(self) -> None:
        self.check("cuStreamSynchronize", self.stream)

    def attribute(self, which: int) -> int:
        """A CU_DEVICE_ATTRIBUTE_* of our device."""
        value = ctypes.c_int()
        self.check("cuDeviceGetAttribute", ctypes.byref(value), which, self.ordinal)
        return value.value

    def load(self, name: str, cubin: bytes, shared: int) -> tuple[int, int]:
        """(CUfunction, max threads per block) of kernel ``name`` in ``cubin``,
        allowed ``shared`` bytes of dynamic shared memory: what Triton's
        ``load_binary`` does (triton/backends/nvidia/driver.c)."""
        self.make_current()
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(cubin))
        self.check("cuModuleGetFunction", ctypes.byref(function), module, name.encode())
        max_threads = ctypes.c_int()
        self.check("cuFuncGetAttribute", ctypes.byref(max_threads), _FUNC_MAX_THREADS, function)
        optin = self.attribute(_MAX_SHARED_OPTIN)
        if shared > 49152 and optin > 49152:  # above 48 KiB a kernel must opt in
            static = ctypes.c_int()
            self.check("cuFuncSetCacheConfig", function, _PREFER_SHARED)
            self.check("cuFuncGetAttribute", ctypes.byref(static), _FUNC_STATIC_SHARED, function)
            self.check("cuFuncSetAttribute", function, _FUNC_MAX_DYNAMIC_SHARED, optin - static.value)
        return function.value, max_threads.value

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
        """An uninitialized array in memory of our own, zero-copy (see the Note)."""
        self.make_current()
        nbytes = max(math.prod(shape) * dtype.itemsize, 1)
        pointer = ctypes.c_void_p()
        self.check("cuMemAllocAsync", ctypes.byref(pointer), ctypes.c_size_t(nbytes), self.stream)
        dims = (ctypes.c_int64 * len(shape))(*shape)
        code = _KDL_BFLOAT if dtype.name == "bfloat16" else _DLPACK_CODES[dtype.kind]
        managed = interop.DLManaged()
        managed.dl_tensor = interop.DLTensor(pointer.value, _KDL_CUDA, self.ordinal, len(shape), code,
                                             dtype.itemsize * 8, 1, dims, None, 0)
        managed.deleter = ctypes.cast(self.deleter, ctypes.c_void_p).value
        address = ctypes.addressof(managed)
        self.live[address] = (managed, dims, pointer.value)
        # No sync here: the allocation is ordered before our kernels on our stream, and
        # ``Launch.finish`` synchronizes before the array reaches anything else.
        capsule = _capsule_new(address, b"dltensor", None)
        return interop.import_capsule(capsule, self.device, self.xla_stream, _KDL_CUDA)

    def _free(self, address: int) -> None:
        """DLPack deleter: JAX dropped the array. Free it on our stream once XLA's
        stream has passed this point (work there may still read it). At interpreter
        exit (module globals already torn down) the process's end frees it instead."""
        _, _, pointer = self.live.pop(address)
        if self._finalizing():
            return
        self.make_current()
        if self.xla_stream:
            event = ctypes.c_void_p()
            self.check("cuEventCreate", ctypes.byref(event), 2)  # CU_EVENT_DISABLE_TIMING
            self.check("cuEventRecord", event, ctypes.c_void_p(self.xla_stream))
            self.check("cuStreamWaitEvent", self.stream, event, 0)
            self.check("cuEventDestroy_v2", event)
        self.check("cuMemFreeAsync", ctypes.c_void_p(pointer), self.stream)


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
# PyCapsule_New(pointer, name, destructor) through a prototype of our own:
# ``ctypes.pythonapi.PyCapsule_New`` is one object shared by the process, whose
# argtypes ``jax.ffi.pycapsule`` (any user's FFI registration) rewrites.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


class _HostTensor:
    """A host numpy array dressed as the torch tensor Triton's interpreter expects:
    it copies each pointer argument "to the host" and back through these calls,
    which for memory already on the host are no-ops."""

    def __init__(self, array: np.ndarray):
        self.array, self.dtype = array, array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self):
        return self

    def cpu(self):
        return self

    def copy_(self, other):
        return self

    def new_empty(self, *args, **kwargs):
        return self

    def set_(self, *args):
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return self.array.strides


# ctypes types of Triton's kernel parameters (triton/backends/nvidia/driver.py,
# ``ty_to_cpp`` and ``FLOAT_STORAGE_TYPE``): a pointer is a CUdeviceptr, an fp32
# travels as its 32 bits
_PARAM_TYPES = {"i1": ctypes.c_int8, "i8": ctypes.c_int8, "i16": ctypes.c_int16, "i32": ctypes.c_int32,
                "i64": ctypes.c_int64, "u8": ctypes.c_uint8, "u16": ctypes.c_uint16, "u32": ctypes.c_uint32,
                "u64": ctypes.c_uint64, "fp32": ctypes.c_float, "fp64": ctypes.c_double}


class _Launcher:
    """Triton's launch ABI through ``cuLaunchKernel``: the kernel's parameters
    are its non-constexpr arguments in order, then two scratch pointers
    (global and profile scratch; null, as kernels that need scratch are
    refused), with ``32 * num_warps`` threads and the kernel's dynamic shared
    memory. What Triton's generated C launcher does for a one-CTA, non-PDL,
    non-cooperative kernel, without building it."""

    def __init__(self, cuda: _Cuda, function: int, key: tuple, num_warps: int, shared: int):
        self.cuda, self.function, self.threads, self.shared = cuda, ctypes.c_void_p(function), 32 * num_warps, shared
        self.types = [ctypes.c_uint64 if entry.startswith("*") else _PARAM_TYPES[entry]
                      for entry, _ in key if entry != "constexpr"]
        self.scratch = (ctypes.c_uint64(0), ctypes.c_uint64(0))

    def __call__(self, grid: tuple, stream, args: list) -> None:
        values = [t(a) for t, a in zip(self.types, args)]
        values += self.scratch
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self.cuda.check("cuLaunchKernel", self.function, *grid, self.threads, 1, 1, self.shared, stream, params,
                        None)


@dataclass
class _Loaded:
    """One compiled kernel, loaded: its CUfunction and launcher."""
    function: int
    launcher: _Launcher


class TritonKernel:
    """A ``@triton.jit`` kernel made launchable by ``Launch``: compiled once per
    argument signature, never for a new size. ``num_warps``/``num_stages`` are
    Triton's compile options."""

    def __init__(self, fn, *, num_warps: int = 4, num_stages: int = 3, cache_dir: str | None = None):
        triton = _triton()
        from triton.runtime.interpreter import InterpretedFunction
        if not isinstance(fn, (triton.runtime.JITFunction, InterpretedFunction)):
            raise TypeError(f"TritonKernel takes a @triton.jit function, got {type(fn).__name__}")
        self.fn, self.num_warps, self.num_stages = fn, num_warps, num_stages
        self.cache_dir = cache_dir  # compiled kernels kept there too ([Note: kernel artifacts])
        self.arg_names = list(fn.arg_names)
        self._loaded: dict[tuple, _Loaded] = {}
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.fn.__name__

    def bind(self, args: tuple, constexprs: dict) -> list:
        """All arguments in the kernel's order; a clear error for a missing or unknown one."""
        names = self.arg_names
        unknown = sorted(set(constexprs) - set(names))
        if unknown:
            raise LaunchError(f"{self.name}: unknown argument(s) {unknown}; it takes {names}")
        if len(args) + len(constexprs) != len(names) or set(names[:len(args)]) & set(constexprs):
            raise LaunchError(f"{self.name} takes {names}: got {len(args)} positional and {sorted(constexprs)}")
        return list(args) + [constexprs[n] for n in names[len(args):]]

    def signature(self, bound: list, n_constexpr: int) -> tuple:
        """(Triton signature entries, constexpr values): the compile cache key."""
        entries = []
        first_constexpr = len(bound) - n_constexpr
        for i, (name, value) in enumerate(zip(self.arg_names, bound)):
            if i >= first_constexpr:
                entries.append(("constexpr", value))
            elif hasattr(value, "dtype") and hasattr(value, "shape"):
                entries.append(("*" + _triton_dtype(self.name, name, value.dtype), None))
            elif isinstance(value, (bool, np.bool_)):
                entries.append(("i1", None))
            elif isinstance(value, (int, np.integer)):
                entries.append(("i32" if -2**31 <= int(value) < 2**31 else "i64", None))
            elif isinstance(value, (float, np.floating)):
                entries.append(("fp32", None))
            else:
                raise LaunchError(f"{self.name}: argument {name!r} is a {type(value).__name__}; "
                                  "expected an array, an int or a float")
        return tuple(entries)

    def loaded(self, key: tuple, cuda: _Cuda) -> _Loaded:
        with self._lock:  # one compile per signature, even when threads launch at once
            if key not in self._loaded:
                self._loaded[key] = self._compile(key, cuda)
            return self._loaded[key]

    def _compile(self, key: tuple, cuda: _Cuda) -> _Loaded:
        triton = _triton(interpret=False)
        from triton.backends.compiler import GPUTarget

        signature = {name: entry for name, (entry, _) in zip(self.arg_names, key)}
        constexprs = {name: value for name, (entry, value) in zip(self.arg_names, key) if entry == "constexpr"}
        major, minor = map(int, cuda.device.compute_capability.split("."))
        target = GPUTarget("cuda", 10 * major + minor, 32)
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        artifact = self._artifact_path(key, target, triton.__version__) if self.cache_dir else None
        compiled = _load_artifact(artifact) if artifact else None
        if compiled is None:
            compiled = _compile_cubin(self.fn, signature, constexprs, options, target)
            if artifact:
                _store_artifact(compiled, artifact)
        meta = compiled.metadata
        if meta.num_warps != self.num_warps:
            raise LaunchError(f"{self.name}: compiled for {meta.num_warps} warps, not {self.num_warps}")
        max_shared = cuda.attribute(_MAX_SHARED_OPTIN)
        if meta.shared > max_shared:
            raise LaunchError(f"{self.name} needs {meta.shared} bytes of shared memory; "
                              f"the GPU has {max_shared}: smaller blocks or fewer stages")
        check_plain_launch(self.name, meta)
        function, max_threads = cuda.load(meta.name, compiled.cubin, meta.shared)
        if self.num_warps * 32 > max_threads:
            raise LaunchError(f"{self.name}: {self.num_warps} warps exceed the {max_threads} threads "
                              "its registers allow")
        return _Loaded(function, _Launcher(cuda, function, key, meta.num_warps, meta.shared))

    def _artifact_path(self, key: tuple, target, version: str) -> str:
        """Where this kernel compiled for ``key`` lives in the cache (no suffix)."""
        with PARSE_LOCK:  # cache_key parses the source
            source_key = self.fn.cache_key
        text = repr((_ARTIFACT_FORMAT, version, source_key, self.arg_names, key, self.num_warps,
                     self.num_stages, target.arch))
        return os.path.join(self.cache_dir, hashlib.sha256(text.encode()).hexdigest() + ".kernel")

    def interpreted(self):
        """The same kernel for Triton's interpreter (interpret mode): ``@triton.jit``
        gave one already, triton having been imported with TRITON_INTERPRET=1."""
        _triton(interpret=True)
        return self.fn


def _compile_cubin(fn, signature: dict, constexprs: dict, options: dict, target) -> _Compiled:
    """``fn``'s cubin, compiled by the calling thread's compile worker where
    it can be ([Note: compile workers] in runtime/triton_compile.py: Triton's
    frontend holds the GIL, and an eager program's kernels compile at once on
    the compile threads), else on this thread, which raises what a compile
    that fails raises."""
    from pallaskit.config import config

    def here():
        return _compile_uncached(ast_source(fn, signature, constexprs), target, options)

    module = triton_compile.module_payload(fn) if config.triton_compile_processes else None
    job = dict(name=fn.__name__, signature=signature, constexprs=constexprs, options=options,
               target=(target.backend, target.arch, target.warp_size), until="cubin")
    return triton_compile.compile_job(module, job, here)


# [Note: kernel artifacts]
# A compiled kernel is kept in pallaskit's cache (``<cache_dir>/triton_kernels/``)
# as one file per kernel and signature, ``<hash>.kernel``: a header line (JSON:
# format, the sha256 of the rest) and Triton's metadata JSON and cubin. The hash
# covers the kernel's source and dependencies (``JITFunction.cache_key``), its
# signature and constexprs, warps, stages, GPU arch and the Triton version.
# Written atomically; a file that fails its checks is logged, recompiled and
# rewritten. This is the only cache these kernels have: ``_compile_uncached``
# runs Triton's stages without Triton's own cache, whose lookup alone hashes
# Triton's package (``triton_key``, once per process: most of it reading a
# large shared library).
_ARTIFACT_FORMAT = 2


def check_plain_launch(name: str, meta) -> None:
    """Refuse a compiled kernel that needs more than a plain launch: Triton's
    global or profile scratch memory (both launchers pass null pointers),
    clusters, cooperative or PDL launches."""
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise LaunchError(f"{name} needs Triton's global scratch memory, which is not allocated")
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "launch_pdl", False)):
        raise LaunchError(f"{name}: clusters, cooperative and PDL launches are not supported")


def _load_artifact(path: str) -> _Compiled | None:
    from pallaskit import cache

    try:
        found = cache.read_checked(path, _ARTIFACT_FORMAT)
        if found is None:
            return None
        header, body = found
        metadata, cubin = body[:header["metadata_bytes"]], body[header["metadata_bytes"]:]
        return _Compiled(_namespace(json.loads(metadata)), cubin)
    except Exception as e:  # noqa: BLE001  (unreadable, torn or foreign: compile again, rewrite it)
        log.warning("pallaskit: ignoring the compiled kernel %s (%s: %s); recompiling", path, type(e).__name__, e)
        return None


def _store_artifact(compiled: _Compiled, path: str) -> None:
    from pallaskit import cache

    try:
        metadata = json.dumps(vars(compiled.metadata)).encode()
        cache._write_atomic(path, cache.pack_checked(_ARTIFACT_FORMAT, metadata + compiled.cubin,
                                                     metadata_bytes=len(metadata)))
        cache.evict()  # cache_max_bytes caps compiled kernels too
    except Exception as e:  # noqa: BLE001  (a read-only or full disk: keep running)
        log.warning("pallaskit: cannot keep the compiled kernel %s (%s: %s)", path, type(e).__name__, e)


_warming: threading.Thread | None = None
_warming_lock = threading.Lock()


def warm_up() -> None:
    """Import triton and its compiler on a thread, once per process, so that a
    program's first eager kernel compile does not wait for them. Called where
    the main thread leaves the GIL free: while XLA compiles a static program
    that a later new size may follow with eager launches (orchestrator.py), and
    before a symbolic compile. Imports hold the GIL: beside the compiler's own
    Python (the symbolic passes) they slow both. ``_triton`` on any other
    thread waits for it, so triton's modules are imported by one thread at a
    time (two threads importing one package can meet a circular wait, which
    Python breaks by handing one of them a partly initialized module)."""
    global _warming
    with _warming_lock:
        if _warming is None and "triton.compiler.code_generator" not in sys.modules:
            _warming = threading.Thread(target=_warm_up, name="pallaskit-triton-import", daemon=True)
            _warming.start()


def _warm_up() -> None:
    try:
        _triton(interpret=False)
        import triton.compiler.code_generator  # noqa: F401  (imported by a first compile's AST stage)
        import triton.compiler.compiler  # noqa: F401  (the stages' modules)
    except Exception as e:  # noqa: BLE001  (the compile that needs it will say what is wrong)
        log.debug("pallaskit: importing triton on a thread failed (%s: %s)", type(e).__name__, e)


def _triton_dtype(kernel: str, arg: str, dtype) -> str:
    name = np.dtype(dtype).name
    if name not in _TRITON_DTYPES:
        raise LaunchError(f"{kernel}: argument {arg!r} has dtype {name}, which Triton kernels do not take")
    return _TRITON_DTYPES[name]


_cudas: dict = {}
_cudas_lock = threading.Lock()


def _cuda_for(device: jax.Device) -> _Cuda:
    with _cudas_lock:
        if device not in _cudas:
            _cudas[device] = _Cuda(device)
        return _cudas[device]


class Launch:
    """One sequence of kernel launches on one device, fenced once on each side.

        run = Launch(interpret=False)
        h = run.empty((m, 4096), jnp.bfloat16)
        run(linear, grid, x, w1, b1, h, m, N=4096, ...)
        (y,) = run.finish(y)

    ``empty`` gives an output buffer; ``__call__`` launches a kernel on arrays
    (inputs or earlier outputs), ints and floats (sizes: never specialized),
    keyword constexprs; ``finish`` waits for the launches and returns the
    buffers asked for as JAX arrays. With ``interpret`` the kernels run in
    Triton's interpreter on host copies (no GPU needed)."""

    def __init__(self, *, interpret: bool, device: jax.Device | None = None):
        self.interpret = interpret
        self.device = device or jax.devices()[0]
        if not interpret and self.device.platform != "gpu":
            raise LaunchError(f"raw Triton kernels run on a CUDA GPU, not on {self.device.platform!r}; "
                              "use interpret mode there")
        _triton(interpret)
        self.cuda = None if interpret else _cuda_for(self.device)
        self._host: dict[int, np.ndarray] = {}  # interpret mode: id(array) -> its host copy
        self._fenced: set[int] = set()
        self._keep: list = []  # every array launched on, alive until finish: our stream may still read it

    def empty(self, shape, dtype):
        """An output buffer for this launch's kernels; uninitialized, and not to be
        used outside them until ``finish`` hands it back."""
        shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        _triton_dtype("empty", "dtype", dtype)  # one Triton kernels take, or a clear error
        if min(shape, default=1) < 0:
            raise LaunchError(f"empty: negative dimension in {shape}")
        if self.interpret:
            return np.empty(shape, dtype)
        return self.cuda.empty(shape, dtype)

    def __call__(self, kernel: TritonKernel, grid, *args, **constexprs) -> None:
        bound = kernel.bind(args, constexprs)
        key = kernel.signature(bound, len(constexprs))
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if min(grid) <= 0:
            return  # an empty size: nothing to launch
        self._keep.extend(a for a in args if hasattr(a, "dtype") and hasattr(a, "shape"))
        if self.interpret:
            host = [_HostTensor(self._on_host(a)) if entry.startswith("*") else a
                    for a, (entry, _) in zip(bound[:len(args)], key)]
            run_interpreted(kernel.interpreted(), grid, host, constexprs)
            return
        loaded = kernel.loaded(key, self.cuda)
        pointers = [self._pointer(kernel, name, a) if entry.startswith("*") else a
                    for name, a, (entry, _) in zip(kernel.arg_names, bound[:len(args)], key)]
        self.cuda.make_current()
        loaded.launcher(grid, self.cuda.stream, pointers)

    def finish(self, *outputs, weak=()) -> tuple[jax.Array, ...]:
        """Outputs as JAX arrays once every launch so far has finished;
        ``weak``: per output, weakly typed as jax.jit returns it (a Python
        scalar's type: it decides what the caller's next op promotes to)."""
        if self.interpret:
            results = tuple(jax.device_put(self._on_host(o), self.device) for o in outputs)
        else:
            self.cuda.synchronize()
            results = outputs
        self._keep.clear()  # with it the ids below may be reused: forget them too
        self._fenced.clear()
        self._host.clear()
        if any(weak):
            results = tuple(interop.weak_type(r) if w else r for r, w in zip(results, weak))
        return results

    def _on_host(self, array) -> np.ndarray:
        if isinstance(array, np.ndarray):
            return array
        if id(array) not in self._host:
            self._host[id(array)] = np.array(array)  # writable: the interpreter may store into it
        return self._host[id(array)]

    def _pointer(self, kernel: TritonKernel, name: str, array) -> int:
        if not isinstance(array, jax.Array):
            raise LaunchError(f"{kernel.name}: argument {name!r} is a {type(array).__name__}; "
                              "on the GPU buffers are JAX arrays")
        if array.devices() != {self.device}:
            raise LaunchError(f"{kernel.name}: argument {name!r} is on {array.devices()}, not {self.device}")
        if id(array) not in self._fenced:
            array.block_until_ready()  # written by XLA: finished before our stream reads it
            self._fenced.add(id(array))
        pointer = array.unsafe_buffer_pointer()
        if pointer % _ALIGN:
            raise LaunchError(f"{kernel.name}: argument {name!r} is not {_ALIGN}-byte aligned")
        return pointer
