"""GPU probe: allocating a kernel's outputs outside XLA, without a copy.

The eager-launch probe (probe_eager_launch.py) spent most of a call allocating
its outputs with ``jax.device_put(np.empty(...))``, a host-to-device copy at
~8-10 GB/s. Here, per output shape (the 16 sweep sizes x 1024 bf16 and one
576000 x 384 bf16):
- ``device_put``: the copy (baseline);
- ``dlpack``: ``cuMemAllocAsync`` on a stream of our own, the pointer wrapped in
  a DLManagedTensor of our own and imported zero-copy (jaxlib's
  ``dlpack_managed_tensor_to_buffer``); its deleter frees with
  ``cuMemFreeAsync`` when JAX drops the array;
- ``jit_empty``: ``jax.jit(lambda: jnp.empty(shape))`` (a compile per new shape).
Each: the first allocation of a shape and the steady-state median (host wall
clock, result ready). Checks: a pattern written by ``cuMemsetD16Async`` on our
stream reads back through JAX, XLA consumes the array (``x + 1``), and 2000
allocate/drop cycles free every buffer (the deleter count).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python scratch/probe_alloc.py

H100, 2026-11-24, jax 0.11.2: all checks pass (pattern read back, XLA consumes
it, zero-copy, 2000 of 2000 freed); ms, first / steady: device_put 0.6-15.7 /
0.28-2.45 for the sweep shapes and 388 / 39.5 for 576000 x 384; dlpack
0.31-0.62 / 0.07-0.10 at every size (1.7 / 0.10 for 576000 x 384); jit_empty
22-33 / 0.05-0.07 (an XLA compile per new shape).
Handing over without a host sync (the pattern written after ~3 ms of other
writes on our stream, JAX's external-ready stream made to wait on an event):
XLA read the right values 5 of 5 times, but so did the control without the
event, so this run does not show whether the import itself waits or the race
window was missed; a host sync before the import is the safe choice until a
discriminating test exists.
"""
import ctypes
import gc
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallaskit.runtime.buckets import _DLManaged, _DLTensor, _stream

SIZES = [int(m) for m in np.unique(np.round(np.geomspace(100, 8000, 16)))]
BF16_CODE, BF16_BITS = 4, 16  # dlpack.h kDLBfloat
CUDA = 2  # kDLCUDA

lib = ctypes.CDLL("libcuda.so.1")


def check(name, *args):
    rc = getattr(lib, name)(*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed with CUresult {rc}")


ctx = ctypes.c_void_p()
check("cuInit", 0)
check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)  # the context XLA uses
check("cuCtxSetCurrent", ctx)
STREAM = ctypes.c_void_p()
check("cuStreamCreate", ctypes.byref(STREAM), 1)  # CU_STREAM_NON_BLOCKING

EVENT = ctypes.c_void_p()
check("cuEventCreate", ctypes.byref(EVENT), 2)  # CU_EVENT_DISABLE_TIMING

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_owned: dict = {}  # address of our DLManagedTensor -> (struct, shape array, device pointer)
freed = [0]


@_DELETER
def _free(address):
    managed, _, ptr = _owned.pop(address)
    check("cuMemFreeAsync", ctypes.c_void_p(ptr), STREAM)
    freed[0] += 1


ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
from jax._src.lib import _jax as _jaxlib  # noqa: E402
from jax._src.lib import jaxlib_extension_version as _EXTENSION  # noqa: E402

DEVICE = jax.devices()[0]


def dlpack_empty(shape, fill=None, slow=0, wait=True):
    """A bf16 array of ``shape`` in memory from cuMemAllocAsync, zero-copy. With
    ``fill`` (16-bit pattern) the memory is written on our stream first, after
    ``slow`` passes of other patterns over it, and JAX's stream is made to wait
    for our stream by an event (the DLPack stream protocol) instead of the host
    synchronizing: a consumer that did not wait would read an earlier pattern."""
    nbytes = int(np.prod(shape)) * 2
    ptr = ctypes.c_void_p()
    check("cuMemAllocAsync", ctypes.byref(ptr), ctypes.c_size_t(max(nbytes, 2)), STREAM)
    if fill is None:
        check("cuStreamSynchronize", STREAM)  # allocated before XLA may touch it
    else:
        for i in range(slow):
            check("cuMemsetD16Async", ptr, ctypes.c_ushort(0x4000 + i), ctypes.c_size_t(nbytes // 2), STREAM)
        check("cuMemsetD16Async", ptr, ctypes.c_ushort(fill), ctypes.c_size_t(nbytes // 2), STREAM)
        if wait:  # wait=False: the negative control
            check("cuEventRecord", EVENT, STREAM)
            check("cuStreamWaitEvent", ctypes.c_void_p(_stream(DEVICE)), EVENT, 0)
    dims = (ctypes.c_int64 * len(shape))(*shape)
    managed = _DLManaged()
    managed.dl_tensor = _DLTensor(ptr.value, CUDA, 0, len(shape), BF16_CODE, BF16_BITS, 1, dims, None, 0)
    managed.deleter = ctypes.cast(_free, ctypes.c_void_p).value
    address = ctypes.addressof(managed)
    _owned[address] = (managed, dims, ptr.value)
    capsule = ctypes.pythonapi.PyCapsule_New(address, b"dltensor", None)
    stream = _stream(DEVICE)
    if _EXTENSION >= 467:
        return _jaxlib.dlpack_managed_tensor_to_buffer(capsule, DEVICE, stream, False, CUDA)
    return _jaxlib.dlpack_managed_tensor_to_buffer(capsule, DEVICE, stream, False)


def device_put_empty(shape):
    return jax.device_put(np.empty(shape, jnp.bfloat16))


_empties = {}


def jit_empty(shape):
    if shape not in _empties:
        _empties[shape] = jax.jit(lambda: jnp.empty(shape, jnp.bfloat16))
    return _empties[shape]()


def timed(fn, shape, n=30):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(shape))
    first = (time.perf_counter() - t0) * 1e3
    runs = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(shape))
        runs.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(runs)


def checks():
    x = dlpack_empty((1000, 1024))
    check("cuMemsetD16Async", ctypes.c_void_p(x.unsafe_buffer_pointer()), ctypes.c_ushort(0x3F80),  # bf16 1.0
          ctypes.c_size_t(1000 * 1024), STREAM)
    check("cuStreamSynchronize", STREAM)
    host = np.asarray(x.astype(jnp.float32))
    y = np.asarray(jax.jit(lambda a: a.astype(jnp.float32) + 1)(x))
    same_ptr = x.unsafe_buffer_pointer() == _owned[next(iter(_owned))][2]
    del x
    gc.collect()
    before = freed[0]
    for i in range(2000):
        a = dlpack_empty((SIZES[i % 16], 1024))
        del a
    gc.collect()
    check("cuStreamSynchronize", STREAM)
    # no host sync: 20 passes over 442 MB (~3 ms) on our stream, then bf16 1.0; XLA adds 1 at once
    add1 = jax.jit(lambda a: a.astype(jnp.float32) + 1)
    waits, no_wait = [], []
    for results, wait in ((waits, True), (no_wait, False)):
        for _ in range(5):
            z = add1(dlpack_empty((576000, 384), fill=0x3F80, slow=20, wait=wait))
            results.append(bool((np.asarray(z) == 2.0).all()))
            del z
        check("cuStreamSynchronize", STREAM)
    return {"pattern_reads_back": bool((host == 1.0).all()), "xla_waits_for_our_stream": waits,
            "without_the_wait (control)": no_wait, "xla_consumes": bool((y == 2.0).all()),
            "zero_copy": bool(same_ptr), "freed_of_2000": freed[0] - before, "still_owned": len(_owned)}


def main():
    print("device:", DEVICE.device_kind, "jax", jax.__version__)
    print("checks:", checks())
    print(f"{'shape':>14} | {'device_put 1st/steady':>22} | {'dlpack 1st/steady':>18} | {'jit_empty 1st/steady':>21}  (ms)")
    for shape in [(m, 1024) for m in SIZES] + [(576000, 384)]:
        cells = [timed(fn, shape) for fn in (device_put_empty, dlpack_empty, jit_empty)]
        print(f"{str(shape):>14} | " + " | ".join(f"{a:9.3f} {b:8.3f}" for a, b in cells))


if __name__ == "__main__":
    main()
