"""The custom-call target raw Triton kernels lower to (runtime/triton_call.py).

[Note: Triton kernels in command buffers]
jaxlib registers its Triton kernel handler (``triton_kernel_call_ffi``)
without XLA's command-buffer trait, so XLA launches each such kernel from the
host between the CUDA graphs it builds of the rest: a program of small raw
Triton kernels paid several microseconds a kernel that Pallas's kernels, XLA
fusions to XLA, did not. The handler launches exactly one kernel on the
stream it is given, which is what the trait asks, so pallaskit registers the
same handler a second time under its own name with the trait, and lowers to
that name where the registration worked (jaxlib's name otherwise). Measured
in benchmarks/RESULTS.md, "Kernel backends: the command-buffer target". An executable read back from the
cache names the target, so ``executable.deserialize`` registers it first.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import threading

log = logging.getLogger("pallaskit")

JAXLIB_TARGET = "triton_kernel_call_ffi"
COMMAND_BUFFER_TARGET = "pallaskit_triton_kernel_call"


@functools.lru_cache(maxsize=None)
def triton_target() -> str:
    """The target name for a raw Triton kernel on a CUDA GPU (registering
    pallaskit's command-buffer-compatible one on first use)."""
    try:
        from jax._src.lib import gpu_triton
        from jaxlib import xla_client

        handler = gpu_triton._cuda_triton.registrations()[JAXLIB_TARGET]
        xla_client.register_custom_call_target(
            COMMAND_BUFFER_TARGET, handler, platform="CUDA", api_version=1,
            traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    except Exception as e:  # noqa: BLE001  (another jaxlib: its own target still works)
        log.debug("pallaskit: raw Triton kernels use %s (%s: %s)", JAXLIB_TARGET, type(e).__name__, e)
        return JAXLIB_TARGET
    return COMMAND_BUFFER_TARGET


# [Note: cubin launches]
# jaxlib's Triton handler takes a kernel's PTX and assembles it with ptxas
# when XLA compiles the program (or first runs it), one kernel at a time under
# one process-wide lock. Even started early ([Note: assembling PTX early] in
# runtime/triton_call.py), that chain ran on after the last of our compile
# workers finished: 0.36 s of a small MLP's cold call, 0.82 s of a ResNet
# block's (benchmarks/RESULTS.md, "Where a cold compile waits for jaxlib's
# ptxas"). So pallaskit has a target of its own, ``pallaskit_cubin_launch``
# (runtime/cubin_launch.c: a C handler of XLA's FFI), that takes the cubin
# the compile workers made in parallel: XLA assembles nothing, and the
# one-kernel programs that assembled PTX early are no longer compiled. The
# handler is built with the C compiler Triton itself needs (``$CC``, gcc or
# clang) against jaxlib's FFI headers, once per source and jaxlib, into the
# cache folder (``native/``), on a thread started with the first kernel's
# compile; where it cannot be built or registered, or option
# ``cubin_launch`` is off, kernels go to jaxlib's handler with their PTX as
# before. An executable read from the cache that names the target registers
# it first (``executable.deserialize``).
CUBIN_TARGET = "pallaskit_cubin_launch"
_native: list = []  # the loaded library, kept for the process


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")


def cubin_launch_wanted() -> bool:
    """Whether kernels should compile to cubin for ``cubin_target`` (its
    build is started here; ``cubin_target`` waits for it)."""
    from pallaskit.config import config

    if not config.cubin_launch or _compiler() is None:
        return False
    _build_pool().submit(cubin_target)
    return True


@functools.lru_cache(maxsize=None)
def _build_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pallaskit-native-build")


def _build() -> str:
    """The handler's shared library (built when missing); raises where it cannot be."""
    import jax.ffi

    from pallaskit.config import cache_folder

    source_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cubin_launch.c")
    include = jax.ffi.include_dir()
    with open(source_path, "rb") as f:
        source = f.read()
    with open(os.path.join(include, "xla", "ffi", "api", "c_api.h"), "rb") as f:
        digest = hashlib.sha256(source + f.read()).hexdigest()[:20]
    path = os.path.join(cache_folder(), "native", f"cubin_launch-{digest}.so")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        done = subprocess.run([_compiler(), "-O2", "-shared", "-fPIC", "-I", include, source_path, "-o", tmp,
                               "-ldl", "-lpthread"], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"building {os.path.basename(source_path)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, path)  # whole or absent, whichever process wins
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


_register_lock = threading.Lock()
_decided: list = []  # [the target or None], once decided


def cubin_target() -> str | None:
    """``pallaskit_cubin_launch``, built and registered for CUDA, or None where
    it cannot be ([Note: cubin launches]; the reason logged once)."""
    with _register_lock:
        if not _decided:
            _decided.append(_register_cubin_target())
        return _decided[0]


# PyCapsule_New through a prototype of our own: ``jax.ffi.pycapsule`` rewrites the
# argtypes of the process's one ``ctypes.pythonapi.PyCapsule_New``.
_CAPSULE_NEW = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def _capsule(pointer: int):
    """A function pointer as XLA takes a custom-call target (as ``jax.ffi.pycapsule`` makes it)."""
    return _CAPSULE_NEW(pointer, None, None)


def _register_cubin_target() -> str | None:
    try:
        from jaxlib import xla_client

        lib = ctypes.CDLL(_build())
        lib.pallaskit_cubin_launch_init.restype = ctypes.c_char_p
        missing = lib.pallaskit_cubin_launch_init()
        if missing:
            raise OSError(f"the CUDA driver lacks {missing.decode()}")
        xla_client.register_custom_call_target(
            CUBIN_TARGET, _capsule(ctypes.cast(lib.pallaskit_cubin_launch, ctypes.c_void_p).value),
            platform="CUDA", api_version=1,
            traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    except Exception as e:  # noqa: BLE001  (jaxlib's handler takes the PTX instead)
        log.info("pallaskit: raw Triton kernels take jaxlib's PTX handler, not cubin launches (%s: %s)",
                 type(e).__name__, e)
        return None
    _native.append(lib)
    return CUBIN_TARGET
