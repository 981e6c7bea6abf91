"""Lower pallaskit programs for the GPU on a machine without one: the Pallas
Triton lowering (jaxpr -> Triton IR) runs on the CPU when exporting for
``cuda``, so unsupported primitives and shape errors show up before a device
run. PTX compilation (Triton's own passes) does not run.

    PYTHONPATH=. python scratch/lower_for_gpu.py
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import export, lax

import pallaskit
from pallaskit.runtime import loader


def lower_for_cuda(fn, *args):
    """Export ``fn``'s pallaskit program for CUDA; returns the Triton kernels' count."""
    with pallaskit.config.override(interpret=False, cache=False):
        res = pallaskit.jit(fn).lower_to_result(*args).result
    call = loader.load(res.program)
    consts = [res.schedule.graph.constants[n] for n in res.schedule.graph.inputs if n in res.schedule.graph.constants]
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exp = export.export(jax.jit(call), platforms=["cuda"], disabled_checks=checks)(*args, *consts)
    return exp.mlir_module().count("__gpu$xla.gpu.triton"), len(res.program.kernels)


CASES = {
    "gelu(x@w+b) bf16": (lambda x, w, b: jax.nn.gelu(x @ w + b).astype(jnp.bfloat16),
                         [(300, 200), (200, 130), (130,)], jnp.bfloat16),
    "f32 erf gelu": (lambda x, w, b: jax.nn.gelu(x @ w + b, approximate=False), [(64, 128), (128, 256), (256,)],
                     jnp.float32),
    "f32 highest": (lambda x, w: jnp.dot(x, w, precision=lax.Precision.HIGHEST), [(64, 128), (128, 256)],
                    jnp.float32),
    "transposed store": (lambda a, b: lax.dot_general(a, b, (((0,), (0,)), ((), ()))).T, [(512, 96), (512, 160)],
                         jnp.bfloat16),
    "batched": (lambda a, b: jnp.einsum("bij,bjk->bik", a, b) * 2, [(3, 90, 64), (3, 64, 70)], jnp.bfloat16),
    "matvec": (lambda a, b: a @ b, [(100, 64), (64,)], jnp.bfloat16),
    "softmax (not a matmul: checks the tool)": (lambda a: jax.nn.softmax(a, -1), [(100, 300)], jnp.bfloat16),
    "grouped tiles": (lambda a, b: a @ b, [(2048, 64), (64, 2048)], jnp.bfloat16),
    "k1": (lambda a, b: a @ b, [(37, 1), (1, 24)], jnp.float32),
}


def main():
    bad = 0
    for name, (fn, shapes, dtype) in CASES.items():
        args = [jnp.zeros(s, dtype) for s in shapes]
        try:
            calls, kernels = lower_for_cuda(fn, *args)
            print(f"ok   {name}: {kernels} kernel(s), {calls} triton call(s)")
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
