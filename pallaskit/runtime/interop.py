"""DLPack and stream interop with JAX: the ctypes mirrors of dlpack.h's structs,
jaxlib's DLPack import without its Python wrapper, and the stream JAX wants
external producers to signal. ``triton_launch`` hands arrays it allocated
itself to JAX through these (zero-copy)."""
from __future__ import annotations

import ctypes

import jax


class DLTensor(ctypes.Structure):  # dlpack.h, DLTensor (the head of DLManagedTensor)
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
                ("ndim", ctypes.c_int32), ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8),
                ("lanes", ctypes.c_uint16), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManaged(ctypes.Structure):  # dlpack.h, DLManagedTensor
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


try:  # jax.dlpack.from_dlpack's own import, without the Python around it
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as EXTENSION

    to_buffer = _jaxlib.dlpack_managed_tensor_to_buffer
except (ImportError, AttributeError):  # another jaxlib: the public path
    to_buffer, EXTENSION = None, 0
_streams: dict = {}  # device -> the stream JAX wants external producers to signal


def stream(device) -> int | None:
    """The stream JAX wants external producers on ``device`` to signal (None on the CPU)."""
    if device not in _streams:
        try:
            _streams[device] = device.get_stream_for_external_ready_events()
        except Exception:  # noqa: BLE001  (UNIMPLEMENTED on the CPU)
            _streams[device] = None
    return _streams[device]


def import_capsule(capsule, device, stream, device_type: int) -> jax.Array:
    """A DLPack capsule of ``device_type`` memory as a JAX array on ``device``, zero-copy."""
    if to_buffer is None:
        return jax.dlpack.from_dlpack(capsule)
    if EXTENSION >= 467:
        return to_buffer(capsule, device, stream, False, device_type)
    return to_buffer(capsule, device, stream, False)


def weak_type(x):
    """``x`` marked weakly typed, as jax.jit returns an output of Python-scalar
    type (it decides what the caller's next op promotes to): a generated
    program's ``WEAK_TYPE`` (runtime/loader.py), an eager launch's weak outputs.
    jax has no public way to do it; where its private conversion is missing,
    ``x`` stays strongly typed (its values unchanged)."""
    from jax._src.lax import lax as lax_internal

    convert = getattr(lax_internal, "_convert_element_type", None)
    return x if convert is None else convert(x, weak_type=True)


def uncommitted(x):
    """``x``, zero-copy, as an array not committed to its device, as jax.jit
    returns the outputs of uncommitted arguments (an eager launch's outputs
    come from DLPack, or in interpret mode from ``device_put`` to a device,
    both committed): a later call taking them then keys and places them as it
    would jax.jit's. Where jax's private constructor is missing or differs,
    ``x`` as it is."""
    if not getattr(x, "committed", False):
        return x
    try:
        from jax._src.array import ArrayImpl

        return ArrayImpl(x.aval, x.sharding, [x], committed=False, _skip_checks=True)
    except Exception:  # noqa: BLE001
        return x
