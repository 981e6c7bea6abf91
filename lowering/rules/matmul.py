"""``dot_general``: an ``ir.Matmul`` node, run by the matmul template.

Every dimension placement jax produces is accepted (batch dims anywhere,
contracting and free dims in any order, so transposed operands need no copy):
the node's body loads each operand at an index built from the output symbols
and the contraction symbols, and the renderer turns those indices into tile
offsets. What the template does not do stays an XLA ``Extern`` (the rule
raises ``NotImplementedError``, ``lower`` falls back); ``unsupported`` says why.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowering import heuristics, ir, sizes, symbolic
from lowering.rules.registry import PreferXLA, register_lowering

# Operand and result dtypes the template handles: Triton's tensor-core dot takes
# 16-bit floats and float32 (TF32 or IEEE), accumulating in float32.
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


def precision_of(precision, dtype=None) -> str | None:
    """'default' or 'highest' for the precisions the template honours; None
    for the rest (they stay with XLA).

    On the GPU, XLA runs float32 dots at DEFAULT and HIGH precision in TF32 and
    at HIGHEST in IEEE float32 (``lax.Precision``'s documentation); Pallas'
    Triton lowering does the same for ``jnp.dot(..., precision=...)``. An
    operand pair that disagrees (DEFAULT with HIGHEST) and the explicit
    ``DotAlgorithmPreset`` algorithms (bf16x3, tf32x3, ...) are left to XLA:
    the template would round differently."""
    if precision is None:
        return "default"
    if isinstance(precision, lax.DotAlgorithmPreset):
        if precision == lax.DotAlgorithmPreset.DEFAULT:
            return "default"
        # The algorithm that names the template's own arithmetic for these operands (jax.nn.dot_product_attention
        # asks bf16 x bf16 -> float32 accumulation by name): no other rounding
        own = {np.dtype(jnp.bfloat16): ("BF16_BF16_F32", "default"), np.dtype(np.float16): ("F16_F16_F32", "default"),
               np.dtype(np.float32): ("F32_F32_F32", "highest")}.get(np.dtype(dtype) if dtype is not None else None)
        return own[1] if own is not None and precision == getattr(lax.DotAlgorithmPreset, own[0], None) else None
    if isinstance(precision, lax.Precision):
        precision = (precision, precision)
    if not isinstance(precision, tuple) or len(precision) != 2:
        return None
    names = set()
    for p in precision:
        if p is None:
            names.add("default")
        elif isinstance(p, lax.Precision):
            names.add("highest" if p == lax.Precision.HIGHEST else "default")
        else:
            return None
    return names.pop() if len(names) == 1 else None


def unsupported(eqn, options) -> str:
    """Why the template can't run this dot_general ('' when it can)."""
    if options.matmul_template == "off":
        return "option matmul_template is 'off'"
    lhs, rhs = (v.aval for v in eqn.invars)
    out = eqn.outvars[0].aval
    if np.dtype(lhs.dtype) != np.dtype(rhs.dtype):
        return f"mixed operand dtypes {lhs.dtype} x {rhs.dtype} (Triton's dot takes one dtype)"
    if np.dtype(lhs.dtype) not in FLOAT_DTYPES or np.dtype(out.dtype) not in FLOAT_DTYPES:
        # Integer dots (int8 x int8 -> int32 included) and float64: XLA's are exact
        # and fast; the template's float32 accumulator is neither.
        return f"{lhs.dtype} x {rhs.dtype} -> {out.dtype} is not a float16/bfloat16/float32 dot"
    if precision_of(eqn.params.get("precision"), lhs.dtype) is None:
        return f"precision {eqn.params.get('precision')} is not DEFAULT or HIGHEST on both operands"
    b, m, n, k = _sizes(eqn)
    m = sizes.hint(m, options.size_hints)
    if heuristics.matmul_needs_split_k(b, m, n, k, options.num_sms):
        return f"output {b}x{m}x{n} too small for K={k} without split-K (heuristics.matmul_needs_split_k)"
    return ""


def _sizes(eqn):
    """(batch, M, N, K), each flattened; M may be symbolic (a dynamic dim)."""
    lhs, rhs = (v.aval for v in eqn.invars)
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    b = math.prod(lhs.shape[d] for d in lb)
    k = math.prod(lhs.shape[d] for d in lc)
    m = math.prod(d for i, d in enumerate(lhs.shape) if i not in lc and i not in lb)
    return b, m, math.prod(rhs.shape) // (b * k), k


def _symbolic_m_only(eqn) -> bool:
    """Is the lhs's free side the only place a dynamic size appears? The
    template then takes it (tiles from the size hints, M a runtime value)."""
    lhs, rhs = (v.aval for v in eqn.invars)
    (lc, _), (lb, _) = eqn.params["dimension_numbers"]
    fixed = [lhs.shape[d] for d in tuple(lc) + tuple(lb)] + list(rhs.shape)
    return not sizes.is_symbolic(fixed)


@register_lowering("dot_general", kind="matmul",
                   note="matmul template (float32 accumulation, fused epilogues); integer/float64 dots, mixed "
                        "operand dtypes and precisions other than DEFAULT/HIGHEST run through XLA")
def _dot_general(ctx, eqn, lhs, rhs):
    symbolic = sizes.is_symbolic(tuple(eqn.invars[0].aval.shape) + tuple(eqn.invars[1].aval.shape))
    if symbolic and not _symbolic_m_only(eqn):
        # A dynamic N, K or batch: XLA's dot takes any size; the template's
        # grid and K loop take a runtime M only ([Note: symbolic dims]).
        raise PreferXLA("dynamic size outside the lhs's free dims")
    reason = unsupported(eqn, ctx.options)
    if reason or isinstance(lhs, ir.Const) or isinstance(rhs, ir.Const):
        raise NotImplementedError(reason or "literal operand")
    if ctx.options.matmul_template == "auto":
        b, m, n, k = _sizes(eqn)
        dtype = eqn.invars[0].aval.dtype
        m = sizes.hint(m, ctx.options.size_hints)  # a dynamic M: decided at its hint
        if not heuristics.matmul_template_wins(b, m, n, k, dtype):
            raise PreferXLA("heuristics.matmul_template_wins: XLA's matmul is faster here")
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = (tuple(int(d) for d in ds) for ds in (lc, rc, lb, rb))
    lshape, rshape = tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)
    lfree = [d for d in range(len(lshape)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rshape)) if d not in rc and d not in rb]
    nb, nm = len(lb), len(lfree)
    out_aval = eqn.outvars[0].aval
    i = ctx.symbols(len(out_aval.shape))
    r = ctx.symbols(len(lc), prefix="r")

    def operand_index(ndim, batch, contract, free, free_offset):
        idx = []
        for d in range(ndim):
            if d in batch:
                idx.append(i[batch.index(d)])
            elif d in contract:
                idx.append(r[contract.index(d)])
            else:
                idx.append(i[free_offset + free.index(d)])
        return tuple(idx)

    a = ctx.load(lhs, operand_index(len(lshape), lb, lc, lfree, nb))
    b = ctx.load(rhs, operand_index(len(rshape), rb, rc, rfree, nb + nm))
    body = ir.Op("dot_general", (a, b), np.dtype(out_aval.dtype))
    dims = dict(batch=tuple(lshape[d] for d in lb), m=tuple(lshape[d] for d in lfree),
                n=tuple(rshape[d] for d in rfree), k=tuple(lshape[d] for d in lc),
                precision=precision_of(eqn.params.get("precision"), eqn.invars[0].aval.dtype))
    # jaxprs repeat equations (``x @ w`` written twice): one node computes both.
    for node in ctx.nodes.values():
        if (isinstance(node, ir.Matmul) and node.body == body and node.shape == tuple(out_aval.shape)
                and all(getattr(node, f) == v for f, v in dims.items())):
            return [node.name]
    return [ctx.matmul(out_aval, body, **dims)]


def _gemm_order(shape, batch, free, contract, contract_first) -> tuple | None:
    """The permutation that puts an operand in an order XLA's gemm reads as it
    is (batch dims outermost in dimension-number order, then the free and the
    contracting dims, each group contiguous), or None where it is in one
    already. Size-1 dims sit anywhere."""
    wide = [d for d in range(len(shape)) if shape[d] != 1]
    b, f, c = ([d for d in g if shape[d] != 1] for g in (batch, free, contract))
    if wide in (b + f + c, b + c + f):
        return None
    return tuple(batch) + (tuple(contract) + tuple(free) if contract_first else tuple(free) + tuple(contract))


def gemm_operands(ctx, eqn, lhs, rhs):
    """A dot_general left to XLA, with operands XLA's gemm reads in place:
    (lhs, rhs, params).

    XLA's gemm wants batch dims outermost and the free and contracting dims
    each contiguous. A pallaskit kernel's output has the row-major layout the
    custom call fixes, so an operand in another order (the heads of
    ``einsum('bqhd,bkhd->bhqk', q, k)``) would cost XLA a copy after the kernel.
    A transpose view in front of the extern is folded into the kernel that
    computes the operand instead: it stores the operand permuted. Free dims
    keep their order, so the product's layout does not change; an operand XLA
    holds itself (an input, an extern's result) is permuted by XLA
    (lowering/xla_views.py)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lc, rc, lb, rb = (tuple(int(d) for d in ds) for ds in (lc, rc, lb, rb))
    lshape, rshape = tuple(eqn.invars[0].aval.shape), tuple(eqn.invars[1].aval.shape)
    # The extern gets the jaxpr's own equation: its symbolic dims are jax's, not sympy's; a permuted
    # copy of such an operand would be a kernel of jax-dim extents, which no tile heuristic can size
    if (any(isinstance(x, ir.Const) for x in (lhs, rhs)) or sizes.is_symbolic(lshape + rshape)
            or symbolic.has_symbolic(lshape + rshape)):
        return lhs, rhs, eqn.params
    pairs = sorted(zip(lc, rc))  # contracting dims in the lhs's order; the rhs's must follow
    lc, rc = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    out, dims = [], []
    for x, v, shape, batch, contract in ((lhs, eqn.invars[0], lshape, lb, lc), (rhs, eqn.invars[1], rshape, rb, rc)):
        free = tuple(d for d in range(len(shape)) if d not in batch and d not in contract)
        rest = [d for d in range(len(shape)) if d not in batch and shape[d] != 1]
        perm = _gemm_order(shape, batch, free, contract, contract_first=bool(rest) and rest[0] in contract)
        if perm is None:
            out.append(x)
            dims.append((batch, contract))
            continue
        at = ctx.symbols(len(shape))
        idx = [None] * len(shape)
        for k, p in enumerate(perm):
            idx[p] = at[k]
        aval = jax.core.ShapedArray(tuple(shape[p] for p in perm), v.aval.dtype)
        out.append(ctx.pointwise(aval, ctx.load(x, tuple(idx)), view=(lax.transpose_p, {"permutation": perm})))
        dims.append((tuple(perm.index(d) for d in batch), tuple(perm.index(d) for d in contract)))
    if out[0] is lhs and out[1] is rhs:
        return lhs, rhs, eqn.params
    (nlb, nlc), (nrb, nrc) = dims
    return out[0], out[1], dict(eqn.params, dimension_numbers=((nlc, nrc), (nlb, nrb)))
