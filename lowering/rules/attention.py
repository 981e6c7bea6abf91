"""The flash-attention equations the attention pass writes ([Note: fused
attention] in lowering/attention.py), as ``ir.Attention`` nodes."""
from __future__ import annotations

import numpy as np

from lowering import ir
from lowering.rules.registry import register_lowering


@register_lowering("pallaskit_attention", kind="attention",
                   note="flash attention written by the attention pass (lowering/attention.py)")
def _attention(ctx, eqn, *args):
    if any(not isinstance(a, str) for a in args):
        raise NotImplementedError("attention operands must be buffers")
    names = [ctx.new_name() for _ in eqn.outvars]
    avals = tuple(v.aval for v in eqn.outvars)
    node = ir.Attention(names[0], tuple(avals[0].shape), np.dtype(avals[0].dtype), (ctx.current_eqn,),
                        primitive=eqn.primitive, params=dict(eqn.params), inputs=tuple(args), outputs=tuple(names),
                        out_avals=avals)
    ctx._add(node)
    return names
