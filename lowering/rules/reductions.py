"""Reductions over one or more axes: ``ir.Reduction`` nodes."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lowering import ir, sizes
from lowering.rules import register_lowering

_OPS = {
    "reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
    "reduce_and": "and", "reduce_or": "or", "argmax": "argmax", "argmin": "argmin",
}
# Compiled for the GPU, float argmax/argmin run through XLA (see the rule). A constant, not an
# option: benchmarks/fuzz/argmax_nan_gpu.py turns it off to check the kernels on the GPU.
GPU_FLOAT_ARG_THROUGH_XLA = True


@register_lowering(*_OPS, kind="reduction")
def _reduce(ctx, eqn, x):
    out_aval = eqn.outvars[0].aval
    in_shape = tuple(eqn.invars[0].aval.shape)
    axes = tuple(sorted(int(a) for a in eqn.params["axes"]))
    if not axes:
        return [x]
    kept = [d for k, d in enumerate(in_shape) if k not in axes]
    reduced = tuple(in_shape[a] for a in axes)
    i_syms = ctx.symbols(len(kept))
    r_syms = ctx.symbols(len(reduced), prefix="r")
    it_i, it_r = iter(i_syms), iter(r_syms)
    domain_index = tuple(next(it_r) if k in axes else next(it_i) for k in range(len(in_shape)))
    op = _OPS[eqn.primitive.name]
    if (op in ("argmax", "argmin") and GPU_FLOAT_ARG_THROUGH_XLA and not ctx.options.interpret
            and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.inexact)):
        # Compiled for the GPU, float argmax/argmin with NaNs picked other indices than
        # jax.jit (RESULTS.md, session 15): XLA runs them until that is found.
        raise NotImplementedError("float argmax/argmin on the GPU")
    if sizes.numel(reduced) == 1:
        # Reducing extent-1 axes (what autodiff's broadcast transposes produce)
        # is a pointwise copy, so it fuses like one.
        if op in ("argmax", "argmin"):
            return [ctx.pointwise(out_aval, ir.Const(0, np.dtype(out_aval.dtype)))]
        return [ctx.pointwise(out_aval, ctx.load(x, tuple(0 if k in axes else s for k, s in
                                                          zip(range(len(in_shape)), domain_index))))]
    body = ctx.load(x, domain_index)
    return [ctx.reduction(out_aval, body, reduced=reduced, axes=axes, op=op)]
