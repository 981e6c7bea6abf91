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

import functools
import logging

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
