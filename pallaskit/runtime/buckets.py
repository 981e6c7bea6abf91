"""Size buckets: one XLA executable serves every size of a bucket (issue 4).

[Note: size buckets]
A symbolic program's kernels read their dim values at run time from one int32
array (``dims``) and mask their edges, so the same kernels serve every size; but
an XLA executable has static shapes, and compiling one per new size costs JAX's
trace, Pallas's lowering and XLA's compile (55-150 ms on the H100, and more
where XLA autotunes a matmul). ``Bucketed`` compiles the program once per
*bucket* instead: each dim symbol's value rounded up to a power of two
(``bucket``), the executable's buffers and grids sized for the bucket, the real
values passed in ``dims``. A later size in the same bucket costs a dispatch.

Data layout: every dynamic-sized buffer holds its real data as a row-major
*prefix* (the kernels compute flat offsets from the real sizes), the rest of
the bucket being garbage the kernels never read unmasked. So:

- an input already of the bucket's shape is passed as it is; another is
  passed as a zero-copy DLPack view of its own buffer with the bucket's shape
  (``view``; on a GPU), a view that runs past the end of its allocation, which
  only the masked kernels touch; off the GPU (interpret mode, whose loads read
  the whole ref) it is copied into a bucket-sized host buffer instead;
- each dynamic-shaped output comes back as a zero-copy view of its prefix at
  the real shape.

Status (H100, 2026-11-23; benchmarks/RESULTS.md, "Size buckets"): a size in a
compiled bucket costs ~1 ms, a new bucket what a new size cost before (RMSNorm
~0.12-0.23 s, the gelu MLP ~0.65-1.1 s). XLA compiles each executable's Triton
kernels anew: even byte-identical (canonicalized) modules were not reused.
Each bucketed call costs ~0.2 ms more host time than jax.jit: ~70 us calling
the AOT executable, ~140 us for an input and an output view, ~25 us in the
views' deleters (cProfile, which inflates each). PJRT's fatal "Non-zero type 1
hold on destruction" (a view's external reference outliving the viewed buffer)
aborted two runs, and the benchmark suite's MLP sweep with buckets dies with
CUDA_ERROR_ILLEGAL_ADDRESS (session 7; the same 16 sizes and hints in a plain
loop, scratch/repro_buckets.py, pass with correct results; suspects: a view's
hold released while a kernel still reads it, or a read past an input's
allocation). Hence the option is off by default, and a GPU run with it on
logs a warning (``Bucketed`` below). Tried: a DLManagedTensor of our own (no external
reference) read wrong data on the CPU; one jax.jit over every bucket instead
of AOT executables was slower (0.26-0.41 against 0.21-0.29 ms per call).

Legal only when nothing but the program's kernels touches a dynamic-sized
buffer (``RenderedProgram.unbucketable`` says why not: an XLA op on one, an
input returned as an output); otherwise, and for sizes whose bucket fails a
guard of the program (int32 indexing), for tracers and for arrays spread over
several devices, the call goes to ``exact``: ``jax.jit`` of the program, one
executable per concrete size as before. Option ``dynamic_buckets`` turns the
buckets off. Counters: ``bucket_compiles`` (executables built),
``bucket_calls`` (calls served by one).
"""
from __future__ import annotations

import ctypes
import logging
import math
import time
from typing import Callable

import jax
import numpy as np

from pallaskit import metrics

log = logging.getLogger("pallaskit")

SMALLEST = 16  # the smallest bucket: below it a bucket per power of two buys nothing


def bucket(n: int) -> int:
    """The bucket of a dim value: the next power of two, at least ``SMALLEST``."""
    return max(SMALLEST, 1 << max(0, int(n) - 1).bit_length())


# -- zero-copy views through DLPack -----------------------------------------------
class _DLTensor(ctypes.Structure):  # dlpack.h, DLTensor (the head of DLManagedTensor)
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DLManaged(ctypes.Structure):  # dlpack.h, DLManagedTensor
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_live: dict = {}  # address of a view's DLManagedTensor -> (JAX's deleter, the array viewed)
_released: list = []  # arrays whose views are gone, dropped at the next view (not inside a PJRT callback)


@_DELETER
def _deleter(address):
    """A view's buffer is gone: JAX's own deleter releases its hold on the
    viewed array's buffer, and only then is the array let go (a buffer
    destroyed while held is a fatal error in PJRT)."""
    entry = _live.pop(address, None)
    if entry is not None:
        _DELETER(entry[0])(address)
        _released.append(entry[1])


# Never freed, not even at interpreter exit, when module globals are cleared in
# no particular order: views still alive then call _deleter, and the arrays
# they view must outlive them.
ctypes.pythonapi.Py_IncRef(ctypes.py_object([_deleter, _live, _released]))


class _Reshaped:
    """A DLPack producer: ``array``'s own capsule with its shape (and strides,
    row-major) rewritten to ``shape``, same rank, and its deleter wrapped so
    that ``array`` stays alive until the consumer lets the view go."""

    def __init__(self, array, shape):
        self.array, self.shape = array, shape

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, stream=None, **kwargs):
        capsule = self.array.__dlpack__(stream=stream)
        address = _capsule_pointer(capsule, b"dltensor")
        managed = _DLManaged.from_address(address)
        t = managed.dl_tensor
        if t.ndim != len(self.shape) or t.byte_offset:
            raise ValueError(f"cannot view a {t.ndim}-d DLPack tensor (byte offset {t.byte_offset}) "
                             f"as {self.shape}")
        stride = 1
        for i in reversed(range(t.ndim)):
            t.shape[i] = self.shape[i]
            if t.strides:
                t.strides[i] = stride
            stride *= self.shape[i]
        _live[address] = (managed.deleter, self.array)
        managed.deleter = ctypes.cast(_deleter, ctypes.c_void_p).value
        return capsule


try:  # jax.dlpack.from_dlpack's own import, without its ~80 us of Python around it
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _EXTENSION

    _to_buffer = _jaxlib.dlpack_managed_tensor_to_buffer
except (ImportError, AttributeError):  # another jaxlib: the public path
    _to_buffer = None
_streams: dict = {}  # device -> the stream JAX wants external producers to signal


def _stream(device):
    if device not in _streams:
        try:
            _streams[device] = device.get_stream_for_external_ready_events()
        except Exception:  # noqa: BLE001  (UNIMPLEMENTED on the CPU)
            _streams[device] = None
    return _streams[device]


def view(array: jax.Array, shape: tuple, device=None) -> jax.Array:
    """``array``'s buffer (row-major, on one device) seen with ``shape`` of the
    same rank, zero-copy: its first ``prod(shape)`` elements, or, where that is
    more than ``array`` holds, a view past its end (for masked kernels only)."""
    _released.clear()
    producer = _Reshaped(array, tuple(int(d) for d in shape))
    if _to_buffer is not None:
        device = device or next(iter(array.devices()))
        stream = _stream(device)
        capsule = producer.__dlpack__(stream=stream)
        if _EXTENSION >= 467:
            return _to_buffer(capsule, device, stream, False, int(array.__dlpack_device__()[0]))
        return _to_buffer(capsule, device, stream, False)
    return jax.dlpack.from_dlpack(producer, copy=False)


def _padded(leaf, shape, device):
    """A bucket-shaped copy of ``leaf`` on ``device``, its data the flat prefix;
    the rest NaN (or the dtype's largest value), so that a kernel reading past
    the real size shows in results rather than adding zeros."""
    host = np.asarray(leaf).reshape(-1)
    dtype = host.dtype
    if dtype == np.bool_:
        fill = True
    elif np.issubdtype(dtype, np.integer):
        fill = np.iinfo(dtype).max
    else:  # numpy floats and the ml_dtypes ones (bfloat16...)
        fill = np.nan
    buf = np.full(math.prod(shape), fill, dtype)
    buf[:host.size] = host
    return jax.device_put(buf.reshape(shape), device)


def _device(args):
    """The device of the call's first array (the default device if none)."""
    for x in args:
        if isinstance(x, jax.Array):
            return next(iter(x.devices()))
    return jax.devices()[0]


_warned = []


def _warn_unsafe():
    if not _warned and jax.default_backend() == "gpu":
        _warned.append(True)
        log.warning("pallaskit: option dynamic_buckets is experimental and not safe on a GPU: runs with it have "
                    "died with CUDA_ERROR_ILLEGAL_ADDRESS and PJRT hold aborts (pallaskit/runtime/buckets.py)")


class Bucketed:
    """Callable as a symbolic program: ``(*leaves, *constants) -> outputs``.

    ``call``: the program's ``call`` (its keyword ``dims`` takes the values);
    ``positions``: (leaf, axis) of each dim symbol; ``input_shapes`` /
    ``output_shapes``: shapes as source over the symbols (every program
    input, constants included, and every output); ``guards``: code objects
    over the symbols that must hold for a bucket's executable."""

    def __init__(self, title: str, call: Callable, symbols: list[str], positions: list[tuple[int, int]],
                 n_leaves: int, input_shapes: list[str], output_shapes: list[str], guards: list):
        self.title = title
        self.call = call
        self.exact = jax.jit(call)
        self.symbols = list(symbols)
        self.positions = list(positions)
        self.n_leaves = n_leaves
        self._in_shapes = [compile(s, "<shape>", "eval") for s in input_shapes]
        self._out_shapes = [compile(s, "<shape>", "eval") for s in output_shapes]
        self.guards = guards
        self.executables: dict = {}  # bucket key -> compiled executable, or None (its guards fail)
        self._dims: dict = {}  # value key -> the int32 dims array on the device
        _warn_unsafe()

    def shape_key(self, leaves) -> tuple:
        return tuple(int(leaves[l].shape[a]) for l, a in self.positions)

    def __call__(self, *args):
        leaves = args[:self.n_leaves]
        if not self._servable(args):
            return self.exact(*args)
        key = self.shape_key(leaves)
        buckets = tuple(bucket(v) for v in key)
        exe = self.executables.get(buckets, False)
        if exe is False:
            exe = self._build(buckets, args)
        if exe is None:
            return self.exact(*args)
        metrics.counters["bucket_calls"] += 1
        device = _device(args)
        dims = self._dims_array(key, device)
        if buckets == key:  # exactly a bucket: no views to make
            return exe(*args, dims)
        env = dict(zip(self.symbols, buckets))
        outs = exe(*[self._fit(x, tuple(eval(s, {}, env)), device) for x, s in zip(args, self._in_shapes)], dims)
        env = dict(zip(self.symbols, key))
        return tuple(o if tuple(o.shape) == (want := tuple(eval(s, {}, env))) else view(o, want, device)
                     for o, s in zip(outs, self._out_shapes))

    @staticmethod
    def _servable(args) -> bool:
        """Concrete arrays (or host values), each on one device."""
        for x in args:
            if isinstance(x, jax.core.Tracer):
                return False
            if isinstance(x, jax.Array) and len(x.devices()) != 1:
                return False
        return True

    @staticmethod
    def _fit(x, shape, device):
        if tuple(np.shape(x)) == shape:
            return x
        if isinstance(x, jax.Array) and device.platform == "gpu":
            return view(x, shape, device)
        return _padded(x, shape, device)

    def _dims_array(self, key, device):
        d = self._dims.get(key)
        if d is None:
            d = jax.device_put(np.asarray(key, np.int32), device)
            if len(self._dims) < 4096:
                self._dims[key] = d
        return d

    def _build(self, buckets: tuple, args):
        """The executable of a bucket (None when the bucket breaks a guard)."""
        env = dict(zip(self.symbols, buckets))
        if not all(eval(g, {}, env) for g in self.guards):
            log.info("pallaskit: %s: bucket %s breaks a guard of the program; its sizes compile one by one",
                     self.title, env)
            self.executables[buckets] = None
            return None
        t0 = time.perf_counter()
        structs = []
        for x, s in zip(args, self._in_shapes):
            dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
            weak = bool(getattr(x, "weak_type", False))
            structs.append(jax.ShapeDtypeStruct(tuple(eval(s, {}, env)), dtype, weak_type=weak))
        n = len(structs)
        call = self.call

        def at_bucket(*a):
            return call(*a[:n], dims=a[n])

        exe = jax.jit(at_bucket).lower(*structs, jax.ShapeDtypeStruct((len(buckets),), np.int32)).compile()
        self.executables[buckets] = exe
        metrics.counters["bucket_compiles"] += 1
        log.debug("pallaskit: %s: compiled bucket %s in %.3fs", self.title, env, time.perf_counter() - t0)
        return exe
