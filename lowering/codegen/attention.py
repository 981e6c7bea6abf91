"""Flash attention as two raw-Triton kernels, rendered from an ``AttentionSpec``.

``render_forward`` writes one launch computing ``o`` and each query row's
log-sum-exp; ``render_backward`` one launch computing dQ, dK and dV from
``q, k, v, o, dO`` and that log-sum-exp (FlashAttention-2's backward: a
program owns one key block for dK / dV and one query block for dQ, the row
term ``D = rowsum(dO * O)`` computed where it is used). Both are pure: the
spec in, source text out; sizes and strides are literals in the source.

What they compute (``jax.jit`` of the plain program, scores in float32)::

    s = (q @ k.T) * scale;  s = where(visible, s, fill)   # visible: mask and causal
    p = softmax(s, -1);     o = p.astype(dtype) @ v;      lse = logsumexp(s, -1)
    dp = do @ v.T;  ds = where(visible, p * (dp - rowsum(do * o)), 0) * scale
    dq = ds @ k;    dk = ds.T @ q;    dv = p.T @ do

[Note: flash attention numerics]
Scores are held in log2 units (``s * scale * log2(e)``, ``exp2`` in the
softmax: one multiply fewer per score) with the fill in the same units,
clamped to float32's range (``finfo(float32).min * log2(e)`` overflows; a
masked score only ever meets other masked scores or is 0 beside a visible
one, so the clamp changes no ``p``). Keys past ``tk`` take -inf, not the fill:
they are not part of the row. Three places need more than the textbook loop:

- A row whose first key block is all masked with ``fill = -inf`` has a
  running max of -inf, and ``exp2(-inf - -inf)`` is NaN: the max used for
  the subtraction is 0 there (a row masked throughout ends 0 / 0 = NaN, as
  jax's softmax does).
- A row masked throughout with a finite fill is uniform over all ``tk`` keys
  (softmax of equal values), and its lse is ``fill + log(tk)``: in float32
  that rounds to ``fill`` once ``fill`` is large (-1e9, float32's min), so the
  backward's ``exp(fill - lse)`` would be 1, not ``1 / tk``. The forward
  writes such a row's lse as ``fill + log(l)`` in natural units (not through
  the clamped log2 fill), and the backward snaps ``fill - lse`` to
  ``-log(tk)`` where it lies within float32's rounding of that value
  (``_snap_band``): a move of at most a few ulps of ``fill``, which is the
  rounding error itself, so a row that is not fully masked is never moved
  further than its own rounding.
- Skipping key blocks above the causal diagonal is exact only if a masked
  score's ``p`` is 0, i.e. ``exp(fill - lse)`` underflows: the fill must be
  far below every visible score (``CAUSAL_SKIP_FILL``). With a tensor mask no
  block is skipped (a row masked throughout is uniform over all keys).
  Skipping also drops ``0 * NaN``: a NaN / inf in q (k) reaches every dK (dQ)
  row through the plain program's dense ``ds`` product, where masked ``ds``
  is 0; the skipping kernel leaves the rows that never see it finite.

Where a score is +inf, jax's logsumexp is +inf and this lse NaN (the row's
``o`` is NaN in both).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

# [Note: flash attention configs] Block sizes and launch options, H100.
# Forward: BLOCK_M query rows per program, BLOCK_N keys per step. Measured under
# pallaskit.jit (bf16, B=8, T=1024, 12 heads of 64, causal; device ms,
# benchmarks/RESULTS.md "Session 29"): 64 x 64, 4 warps, 3 stages 0.0578; 128 x 64
# 0.0655 (8 warps 0.0643); 64 x 64 with 4 stages 0.0622; 128 x 128, 8 warps 0.0757.
FWD_BLOCK_M, FWD_BLOCK_N, FWD_WARPS, FWD_STAGES = 64, 64, 4, 3
# Backward: Triton's fused-attention tutorial (06-fused-attention.py): dK/dV
# walk query blocks of M1 under a key block of N1; dQ walks key blocks of N2
# under a query block of M2. Forward + backward, same shapes: 3 stages 0.2369 ms,
# the tutorial's 5 stages 0.2440, 8 warps 0.2759 (3 stages 0.2736), blocks
# M1 = N2 = 64 with 8 warps and 3 stages 0.2532.
BWD_BLOCK_M1, BWD_BLOCK_N1, BWD_BLOCK_M2, BWD_BLOCK_N2 = 32, 128, 128, 32
BWD_WARPS, BWD_STAGES = 4, 3
# 8 warps where a program's float32 accumulators outgrow 4 warps' registers
# (ptxas for sm_90 spilled 100-3000 bytes a thread past these, none with 8):
# the forward's [BLOCK_M, head dim] tile in the inputs' bytes, the backward's
# dK + dV tiles [BLOCK_N1, d + dv]. At D 64 bf16 both stay at 4 (the backward
# spills ~200 bytes there, the tutorial's own ~1000).
WIDE_WARPS = 8
FWD_TILE_BYTES_4_WARPS = 128 * 64 * 2
BWD_TILE_BYTES_4_WARPS = 128 * 128 * 2
# Triton's interpreter (CPU tests) is slow per element: small blocks there.
INTERPRET_BLOCK, INTERPRET_WARPS, INTERPRET_STAGES = 16, 4, 1
# Shared memory a config may plan for (the H100 gives a program 227 KiB; the
# estimates below are upper bounds of what Triton 3.6 allocated at D 64 / 128,
# and the rest is room for its layout conversions).
SHARED_BUDGET = 192 * 1024
# tl.dot takes no dimension below 16: head dims pad to a power of two >= 16.
MIN_DOT = 16
# Causal blocks above the diagonal are skipped only when the fill is at most
# this: a masked score's exp(fill - lse) is then 0 in float32 (below e^-104)
# for any row whose visible scores exceed fill + 104.
CAUSAL_SKIP_FILL = -1e4

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
F32_MAX = float(np.finfo(np.float32).max)
DTYPES = {"bfloat16": "tl.bfloat16", "float16": "tl.float16", "float32": "tl.float32"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
PRECISIONS = ("default", "highest")
# A float32 rounded to TF32, nearest with ties away (the tensor core alone truncates).
_TF32 = ('tl.inline_asm_elementwise("cvt.rna.tf32.f32 $0, $1;", "=r,r", [{x}], dtype=tl.float32, is_pure=True, '
         'pack=1)')


@dataclasses.dataclass(frozen=True)
class Layout:
    """Element strides of one tensor's logical dims (0: broadcast)."""
    batch: tuple[int, ...]  # one per batch dim of the spec
    t: int  # the sequence: query rows for q/o/do/dq, key rows for k/v/dk/dv (query axis for a mask)
    d: int  # the head dim (key axis for a mask)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    batch: tuple[int, ...]  # batch dim sizes, e.g. (B, H); programs walk their product
    tq: int
    tk: int
    d: int  # q / k head dim
    dv: int  # v / o head dim
    scale: float  # scores = (q . k^T) * scale, in float32
    causal: bool  # key j visible to query i only where j <= i (tq == tk)
    mask: Layout | None  # bool over (batch..., tq, tk), True where visible; None: no tensor mask
    fill: float  # a masked score's value
    dtype: str  # 'bfloat16' | 'float16' | 'float32'
    q: Layout
    k: Layout
    v: Layout
    o: Layout
    do: Layout | None = None
    dq: Layout | None = None
    dk: Layout | None = None
    dv_out: Layout | None = None
    # the tensor mask is True where hidden (where(mask, fill, s): nanoGPT's mask == 0)
    mask_hides: bool = False
    # An additive bias over (batch..., tq, tk), as ``mask`` (t: the query stride, d: the key
    # stride; 0 broadcast), added to the scaled scores before the mask: scores =
    # where(visible, q·kᵀ * scale + bias, fill) (flax's ``bias=``, ALiBi, T5's relative bias)
    bias: Layout | None = None
    # float32 dots: 'default' as jax.jit on the GPU (TF32 operands, rounded to
    # nearest), 'highest' exact float32 products (lax.Precision.HIGHEST)
    precision: str = "default"


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One rendered launch: ``source`` defines ``{name}_kernel`` (``@triton.jit``;
    pointers only, then ``constexprs`` by name), run on a 1-D grid of ``grid``."""
    name: str
    source: str
    grid: int
    num_warps: int
    num_stages: int
    constexprs: dict


def render_forward(spec: AttentionSpec, name: str, interpret: bool) -> Kernel:
    """Parameters ``q, k, v, [mask], o, lse``; lse float32 ``[prod(batch), tq]``."""
    _check(spec)
    r = _Renderer(spec, interpret)
    bm, bn, warps, stages = _forward_config(spec, interpret)
    n_m = -(-spec.tq // bm)
    tensors = {"q": spec.q, "k": spec.k, "v": spec.v, "o": spec.o}
    if spec.mask is not None:
        tensors["mask"] = spec.mask
    if spec.bias is not None:
        tensors["bias"] = spec.bias
    params = (["Q", "K", "V"] + (["MASK"] if spec.mask is not None else []) + (["BIAS"] if spec.bias is not None else [])
              + ["O", "LSE"])
    w = _Writer()
    w.line("@triton.jit")
    w.line(f"def {name}_kernel({', '.join(params)}, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):")
    w.indent()
    r.header(w, "forward", {"BLOCK_M": bm, "BLOCK_N": bn})
    w.line("# Program -> (batch, query block); the last query blocks (the most keys when causal) first.")
    w.line("pid = tl.program_id(0)")
    w.line(f"mb = {n_m - 1} - pid % {n_m}" if n_m > 1 else "mb = 0")
    r.batch_bases(w, f"pid // {n_m}" if n_m > 1 else "pid", tensors)
    w.line("offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)")
    w.line("offs_n = tl.arange(0, BLOCK_N)")
    r.dim_offsets(w)
    w.line(f"q = {r.load('Q', 'q', spec.q, 'offs_m', 'offs_d', spec.tq, spec.d, bm)}")
    w.line('m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units')
    w.line("l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)")
    w.line(f"acc = tl.zeros([BLOCK_M, {r.dvp}], tl.float32)")

    def body(masked: bool):
        w.line("cols = start_n + offs_n")
        w.line(f"kt = {r.load('K', 'k', spec.k, 'cols', 'offs_d', spec.tk, spec.d, bn, transposed=True)}")
        w.line(f"s = {r.dot('q', 'kt')} * {_lit(r.qk_scale2)}  # log2 units")
        r.add_bias(w, "s", "offs_m", "cols", bm, bn, transposed=False)
        r.mask_scores(w, "s", "offs_m", "cols", masked, bm, bn, transposed=False)
        w.line("m_new = tl.maximum(m_i, tl.max(s, 1))")
        m_sub = "m_new"
        if spec.mask is not None and spec.fill == -math.inf and masked:
            w.line('m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row all -inf so far: no NaN')
            m_sub = "m_sub"
        w.line(f"p = tl.math.exp2(s - {m_sub}[:, None])")
        w.line(f"alpha = tl.math.exp2(m_i - {m_sub})")
        w.line("l_i = l_i * alpha + tl.sum(p, 1)")
        w.line(f"v = {r.load('V', 'v', spec.v, 'cols', 'offs_e', spec.tk, spec.dv, bn)}")
        w.line(f"acc = {r.dot(r.cast('p'), 'v', 'acc * alpha[:, None]')}")
        w.line("m_i = m_new")

    r.key_loops(w, body, "mb", "BLOCK_M", "BLOCK_N", bm, bn)
    w.line("o = acc / l_i[:, None]")
    lse = "(m_i + tl.math.log2(l_i)) * " + _lit(LN2)
    if r.fill_finite and spec.mask is not None:
        w.line("# A row masked throughout: fill + log(tk) in natural units ([Note: flash attention numerics]).")
        w.line(f"lse = tl.where(m_i == {_lit(r.fill2)}, {_lit(r.fill)} + tl.log(l_i), {lse})")
    else:
        w.line(f"lse = {lse}")
    w.line(r.store("O", "o", spec.o, "offs_m", "offs_e", spec.tq, spec.dv, bm, "o"))
    row_mask = ", mask=offs_m < " + str(spec.tq) if spec.tq % bm else ""
    w.line(f"tl.store(LSE + z * {spec.tq} + offs_m, lse{row_mask})")
    return Kernel(name=f"{name}_kernel", source=w.text(), grid=_prod(spec.batch) * n_m,
                  num_warps=warps, num_stages=stages,
                  constexprs={"BLOCK_M": bm, "BLOCK_N": bn})


def render_backward(spec: AttentionSpec, name: str, interpret: bool) -> Kernel:
    """Parameters ``q, k, v, o, do, lse, [mask], dq, dk, dv``; every element of
    dq / dk / dv written."""
    _check(spec)
    if None in (spec.do, spec.dq, spec.dk, spec.dv_out):
        raise ValueError("render_backward: the spec needs do, dq, dk and dv_out layouts")
    r = _Renderer(spec, interpret)
    m1, n1, m2, n2, warps, stages = _backward_config(spec, interpret)
    blocks_kv, blocks_q = -(-spec.tk // n1), -(-spec.tq // m2)
    n_blocks = max(blocks_kv, blocks_q)
    tensors = {"q": spec.q, "k": spec.k, "v": spec.v, "o": spec.o, "do": spec.do,
               "dq": spec.dq, "dk": spec.dk, "dv": spec.dv_out}
    if spec.mask is not None:
        tensors["mask"] = spec.mask
    if spec.bias is not None:
        tensors["bias"] = spec.bias
    params = (["Q", "K", "V", "O", "DO", "LSE"] + (["MASK"] if spec.mask is not None else [])
              + (["BIAS"] if spec.bias is not None else []) + ["DQ", "DK", "DV"])
    consts = {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": m2, "BLOCK_N2": n2}
    w = _Writer()
    w.line("@triton.jit")
    w.line(f"def {name}_kernel({', '.join(params)}, "
           + ", ".join(f"{c}: tl.constexpr" for c in consts) + "):")
    w.indent()
    r.header(w, "backward", consts)
    w.line("# Program -> (batch, block): key block `blk` for dK / dV, query block `blk` for dQ.")
    w.line("pid = tl.program_id(0)")
    w.line(f"blk = pid % {n_blocks}" if n_blocks > 1 else "blk = 0")
    r.batch_bases(w, f"pid // {n_blocks}" if n_blocks > 1 else "pid", tensors)
    r.dim_offsets(w)
    lse_ptr = f"LSE + z * {spec.tq}"

    def row_terms(rows: str, block: int, do_name: str, masked: bool):
        """lse (log2 units, +inf past tq: p = 0 there), the masked scores' exponent, D = rowsum(dO * O)."""
        bound = f", mask={rows} < {spec.tq}, other=float(\"inf\")" if spec.tq % block else ""
        w.line(f"lse = tl.load({lse_ptr} + {rows}{bound})")
        w.line(f"lse2 = lse * {_lit(LOG2E)}")
        if masked and r.any_masked:
            r.fill_exponent(w)
        w.line(f"o = {r.load('O', 'o', spec.o, rows, 'offs_e', spec.tq, spec.dv, block)}")
        w.line(f"delta = tl.sum({do_name}.to(tl.float32) * o.to(tl.float32), 1)")

    # dK / dV: the key block's rows against every query block that sees them.
    w.line(f"if blk < {blocks_kv}:")
    w.indent()
    w.line("cols = blk * BLOCK_N1 + tl.arange(0, BLOCK_N1)")
    w.line(f"k = {r.load('K', 'k', spec.k, 'cols', 'offs_d', spec.tk, spec.d, n1)}")
    w.line(f"v = {r.load('V', 'v', spec.v, 'cols', 'offs_e', spec.tk, spec.dv, n1)}")
    w.line(f"dk = tl.zeros([BLOCK_N1, {r.dp}], tl.float32)")
    w.line(f"dv = tl.zeros([BLOCK_N1, {r.dvp}], tl.float32)")

    def dkdv_body(masked: bool):
        w.line("rows = start_m + tl.arange(0, BLOCK_M1)")
        w.line(f"qt = {r.load('Q', 'q', spec.q, 'rows', 'offs_d', spec.tq, spec.d, m1, transposed=True)}")
        w.line(f"do = {r.load('DO', 'do', spec.do, 'rows', 'offs_e', spec.tq, spec.dv, m1)}")
        row_terms("rows", m1, "do", masked)
        w.line(f"st = {r.dot('k', 'qt')} * {_lit(r.qk_scale2)}  # scores, transposed: [keys, queries]")
        r.add_bias(w, "st", "rows", "cols", m1, n1, transposed=True)
        r.probabilities(w, "pt", "st", "rows", "cols", masked, m1, n1, transposed=True)
        w.line(f"dv = {r.dot(r.cast('pt'), 'do', 'dv')}")
        w.line(f"dpt = {r.dot('v', 'tl.trans(do)')}")
        w.line("dst = pt * (dpt - delta[None, :])")
        if masked and r.any_masked:
            w.line("dst = tl.where(visible, dst, 0.0)")
        w.line(f"dk = {r.dot(r.cast('dst'), 'tl.trans(qt)', 'dk')}")

    r.query_loops(w, dkdv_body, "blk", m1, n1)
    w.line(f"dk = dk * {_lit(spec.scale)}")
    w.line(r.store("DK", "dk", spec.dk, "cols", "offs_d", spec.tk, spec.d, n1, "dk"))
    w.line(r.store("DV", "dv", spec.dv_out, "cols", "offs_e", spec.tk, spec.dv, n1, "dv"))
    w.dedent()

    # dQ: the query block's rows against every key block they see.
    w.line(f"if blk < {blocks_q}:")
    w.indent()
    w.line("rows = blk * BLOCK_M2 + tl.arange(0, BLOCK_M2)")
    w.line("offs_n = tl.arange(0, BLOCK_N2)")
    w.line(f"q = {r.load('Q', 'q', spec.q, 'rows', 'offs_d', spec.tq, spec.d, m2)}")
    w.line(f"do = {r.load('DO', 'do', spec.do, 'rows', 'offs_e', spec.tq, spec.dv, m2)}")
    row_terms("rows", m2, "do", True)
    w.line(f"dq = tl.zeros([BLOCK_M2, {r.dp}], tl.float32)")

    def dq_body(masked: bool):
        w.line("cols = start_n + offs_n")
        w.line(f"kt = {r.load('K', 'k', spec.k, 'cols', 'offs_d', spec.tk, spec.d, n2, transposed=True)}")
        w.line(f"vt = {r.load('V', 'v', spec.v, 'cols', 'offs_e', spec.tk, spec.dv, n2, transposed=True)}")
        w.line(f"s = {r.dot('q', 'kt')} * {_lit(r.qk_scale2)}")
        r.add_bias(w, "s", "rows", "cols", m2, n2, transposed=False)
        r.probabilities(w, "p", "s", "rows", "cols", masked, m2, n2, transposed=False)
        w.line(f"dp = {r.dot('do', 'vt')}")
        w.line("ds = p * (dp - delta[:, None])")
        if masked and r.any_masked:
            w.line("ds = tl.where(visible, ds, 0.0)")
        w.line(f"dq = {r.dot(r.cast('ds'), 'tl.trans(kt)', 'dq')}")

    r.key_loops(w, dq_body, "blk", "BLOCK_M2", "BLOCK_N2", m2, n2)
    w.line(f"dq = dq * {_lit(spec.scale)}")
    w.line(r.store("DQ", "dq", spec.dq, "rows", "offs_d", spec.tq, spec.d, m2, "dq"))
    w.dedent()
    return Kernel(name=f"{name}_kernel", source=w.text(), grid=_prod(spec.batch) * n_blocks,
                  num_warps=warps, num_stages=stages, constexprs=consts)


class _Renderer:
    """The pieces both kernels write: batch bases, pointers, masks, loops."""

    def __init__(self, spec: AttentionSpec, interpret: bool):
        self.spec, self.interpret = spec, interpret
        self.dp, self.dvp = _padded(spec.d), _padded(spec.dv)
        self.tl_dtype = DTYPES[spec.dtype]
        self.qk_scale2 = float(np.float32(spec.scale)) * LOG2E
        self.fill = float(np.float32(spec.fill))
        self.fill_finite = math.isfinite(self.fill)
        fill2 = self.fill * LOG2E
        self.fill2 = max(min(fill2, F32_MAX), -F32_MAX) if self.fill_finite else self.fill
        self.any_masked = spec.causal or spec.mask is not None
        # Causal blocks above the diagonal skipped on the GPU (loop bounds from the
        # program id); in interpret mode every block is walked, masked (the
        # prototype's interpreter quirk; with triton_launch's patch the interpreter
        # takes such bounds, and the tests run the GPU's source there too).
        self.skip_above = (spec.causal and spec.mask is None and spec.bias is None and not interpret
                           and self.fill <= CAUSAL_SKIP_FILL)

    def header(self, w: _Writer, which: str, blocks: dict):
        s = self.spec
        mask = "no tensor mask" if s.mask is None else f"mask strides {_layout_text(s.mask)}"
        if s.bias is not None:
            mask += f", bias strides {_layout_text(s.bias)}"
        w.line(f"# Flash attention {which}: batch {s.batch}, tq {s.tq}, tk {s.tk}, d {s.d}, dv {s.dv}, "
               f"{s.dtype}, scale {s.scale!r}")
        w.line(f"# {'causal' if s.causal else 'not causal'}, {mask}, fill {s.fill!r}; "
               + ", ".join(f"{k} {v}" for k, v in blocks.items())
               + (", key blocks above the diagonal skipped" if self.skip_above else ""))
        for t in ("q", "k", "v", "o", "do", "dq", "dk"):
            if getattr(s, t) is not None and (which == "backward" or t in "qkvo"):
                w.line(f"# {t} strides {_layout_text(getattr(s, t))}")
        if which == "backward":
            w.line(f"# dv strides {_layout_text(s.dv_out)}")

    def batch_bases(self, w: _Writer, flat: str, tensors: dict):
        """``z`` (the flat batch index, int64) and each tensor's ``{name}_base``."""
        w.line(f"z = ({flat}).to(tl.int64)  # the flat batch index")
        dims = self.spec.batch
        idx = [f"b{i}" for i in range(len(dims))]
        rest = "z"  # the flat index of dims[:i + 1]
        for i in range(len(dims) - 1, 0, -1):
            w.line(f"b{i} = {rest} % {dims[i]}")
            if i > 1:
                w.line(f"r{i} = {rest} // {dims[i]}")
            rest = f"r{i}" if i > 1 else f"{rest} // {dims[i]}"
        if dims:
            w.line(f"b0 = {rest}")
        for t, layout in tensors.items():
            terms = [f"{b} * {st}" for b, st, n in zip(idx, layout.batch, dims) if st != 0 and n > 1]
            w.line(f"{t}_base = {' + '.join(terms) if terms else '0'}")

    def dim_offsets(self, w: _Writer):
        w.line(f"offs_d = tl.arange(0, {self.dp})  # the q / k head dim, {self.spec.d} padded")
        w.line(f"offs_e = tl.arange(0, {self.dvp})  # the v / o head dim, {self.spec.dv} padded")

    def _pointer(self, ptr: str, t: str, layout: Layout, rows: str, dims: str, n_rows: int, n_dims: int,
                 transposed: bool) -> str:
        """``ptr + base + rows * t + dims * d`` as a [rows, dims] (or [dims, rows]) block;
        int64 index math where an offset can pass int32."""
        wide = (n_rows - 1) * abs(layout.t) + (n_dims - 1) * abs(layout.d) >= 2**31
        r = f"{rows}.to(tl.int64)" if wide else rows
        r, c = (f"{r}[None, :]", f"{dims}[:, None]") if transposed else (f"{r}[:, None]", f"{dims}[None, :]")
        return f"{ptr} + {t}_base + {_times(r, layout.t)} + {_times(c, layout.d)}"

    def _bounds(self, rows: str, dims: str, n_rows: int, n_dims: int, block: int, padded: int,
                transposed: bool) -> str:
        parts = []
        if n_rows % block:
            parts.append(f"({rows}[None, :] < {n_rows})" if transposed else f"({rows}[:, None] < {n_rows})")
        if n_dims != padded:
            parts.append(f"({dims}[:, None] < {n_dims})" if transposed else f"({dims}[None, :] < {n_dims})")
        return " & ".join(parts)

    def load(self, ptr, t, layout, rows, dims, n_rows, n_dims, block, transposed=False) -> str:
        padded = self.dp if dims == "offs_d" else self.dvp
        bounds = self._bounds(rows, dims, n_rows, n_dims, block, padded, transposed)
        p = self._pointer(ptr, t, layout, rows, dims, n_rows, n_dims, transposed)
        return f"tl.load({p}, mask={bounds}, other=0.0)" if bounds else f"tl.load({p})"

    def store(self, ptr, t, layout, rows, dims, n_rows, n_dims, block, value) -> str:
        padded = self.dp if dims == "offs_d" else self.dvp
        bounds = self._bounds(rows, dims, n_rows, n_dims, block, padded, False)
        p = self._pointer(ptr, t, layout, rows, dims, n_rows, n_dims, False)
        v = f"{value}.to({self.tl_dtype})"
        return f"tl.store({p}, {v}, mask={bounds})" if bounds else f"tl.store({p}, {v})"

    def cast(self, x: str) -> str:
        """A float32 block as a dot operand of the inputs' dtype."""
        return x if self.spec.dtype == "float32" else f"{x}.to({self.tl_dtype})"

    def dot(self, a: str, b: str, acc: str | None = None) -> str:
        """``tl.dot``. Triton's interpreter multiplies 16-bit operands wrongly, so
        there they are widened to float32 first (and float32 products are exact).
        On the GPU float32 operands are TF32 rounded to nearest, as cuBLAS and
        XLA's Triton pipeline feed the tensor cores (Triton's own TF32 truncates;
        ``lowering/codegen/triton.py``'s matmul template does the same), unless
        the precision is 'highest'."""
        s, option = self.spec, ""
        if self.interpret:
            a, b = (x if x.endswith(".to(tl.float32)") else f"{x}.to(tl.float32)" for x in (a, b))
        elif s.dtype == "float32" and s.precision == "highest":
            option = ', input_precision="ieee"'
        elif s.dtype == "float32":
            a, b = _TF32.format(x=a), _TF32.format(x=b)
        return f"tl.dot({a}, {b}{', ' + acc if acc else ''}{option})"

    def visible(self, w: _Writer, rows: str, cols: str, transposed: bool, bm: int, bn: int):
        """``visible`` ([rows, cols], or [cols, rows] transposed): the tensor mask and causal."""
        s = self.spec
        r, c = (f"{rows}[None, :]", f"{cols}[:, None]") if transposed else (f"{rows}[:, None]", f"{cols}[None, :]")
        parts = []
        if s.mask is not None:
            m = s.mask
            bounds = [f"({r} < {s.tq})"] if s.tq % bm else []
            bounds += [f"({c} < {s.tk})"] if s.tk % bn else []
            wide = (s.tq - 1) * abs(m.t) + (s.tk - 1) * abs(m.d) >= 2**31
            rr, cc = (r.replace(rows, f"{rows}.to(tl.int64)"), c.replace(cols, f"{cols}.to(tl.int64)")) if wide \
                else (r, c)
            ptr = f"MASK + mask_base + {_times(rr, m.t)} + {_times(cc, m.d)}"
            hidden = int(s.mask_hides)  # past tq or tk: hidden (a NaN row's ds stays 0 there)
            load = f"tl.load({ptr}, mask={' & '.join(bounds)}, other={hidden})" if bounds else f"tl.load({ptr})"
            parts.append(f"({load} {'==' if s.mask_hides else '!='} 0)")
        if s.causal:
            parts.append(f"({r} >= {c})")
        w.line(f"visible = {' & '.join(parts)}")

    def add_bias(self, w: _Writer, s: str, rows: str, cols: str, bm: int, bn: int, transposed: bool):
        """``s += bias * log2(e)`` (scores in log2 units; [rows, cols], or [cols, rows] transposed).
        With a bias no causal block is skipped: a bias of -inf or float32's min (a padding mask
        written additively) can make a row's visible scores as low as the fill."""
        b = self.spec.bias
        if b is None:
            return
        r, c = (f"{rows}[None, :]", f"{cols}[:, None]") if transposed else (f"{rows}[:, None]", f"{cols}[None, :]")
        bounds = [f"({r} < {self.spec.tq})"] if self.spec.tq % bm else []
        bounds += [f"({c} < {self.spec.tk})"] if self.spec.tk % bn else []
        if (self.spec.tq - 1) * abs(b.t) + (self.spec.tk - 1) * abs(b.d) >= 2**31:
            r, c = r.replace(rows, f"{rows}.to(tl.int64)"), c.replace(cols, f"{cols}.to(tl.int64)")
        ptr = f"BIAS + bias_base + {_times(r, b.t)} + {_times(c, b.d)}"
        load = f"tl.load({ptr}, mask={' & '.join(bounds)}, other=0.0)" if bounds else f"tl.load({ptr})"
        # clamped as the fill is: finfo.min * log2(e) (an additive padding mask) would overflow to -inf
        w.line(f"{s} += tl.maximum({load}.to(tl.float32) * {_lit(LOG2E)}, {_lit(-F32_MAX)})  # the additive bias")

    def mask_scores(self, w: _Writer, s: str, rows: str, cols: str, masked: bool, bm: int, bn: int,
                    transposed: bool):
        """The forward's scores: the fill where not visible, -inf past tk."""
        if masked and self.any_masked:
            self.visible(w, rows, cols, transposed, bm, bn)
            w.line(f"{s} = tl.where(visible, {s}, {_lit(self.fill2)})")
        if self.spec.tk % bn:
            c = f"{cols}[:, None]" if transposed else f"{cols}[None, :]"
            w.line(f'{s} = tl.where({c} < {self.spec.tk}, {s}, float("-inf"))  # past the keys: not in the row')

    def fill_exponent(self, w: _Writer):
        """``fill2``: a masked score's ``log2(p)`` per row, ``(fill - lse) * log2(e)``,
        snapped to ``-log2(tk)`` for a row masked throughout ([Note: flash attention numerics])."""
        fill = _lit(self.fill)
        if self.fill_finite and self.spec.mask is not None:
            log_tk = math.log(self.spec.tk)
            band = _snap_band(self.fill, log_tk)
            w.line(f"t = {fill} - lse")
            w.line(f"t = tl.where(tl.abs(t + {_lit(log_tk)}) <= {_lit(band)}, {_lit(-log_tk)}, t)"
                   "  # a row masked throughout: 1 / tk")
            w.line(f"fill2 = t * {_lit(LOG2E)}")
        else:
            w.line(f"fill2 = ({fill} - lse) * {_lit(LOG2E)}")

    def probabilities(self, w: _Writer, p: str, s: str, rows: str, cols: str, masked: bool, bm: int, bn: int,
                      transposed: bool):
        """The backward's ``p = exp(s - lse)`` from log2-unit scores ``s``."""
        row = "[None, :]" if transposed else "[:, None]"
        if masked and self.any_masked:
            self.visible(w, rows, cols, transposed, bm, bn)
            w.line(f"{p} = tl.math.exp2(tl.where(visible, {s} - lse2{row}, fill2{row}))")
        else:
            w.line(f"{p} = tl.math.exp2({s} - lse2{row})")
        if self.spec.tk % bn:
            c = f"{cols}[:, None]" if transposed else f"{cols}[None, :]"
            w.line(f"{p} = tl.where({c} < {self.spec.tk}, {p}, 0.0)  # past the keys")

    def key_loops(self, w: _Writer, body, index: str, q_block: str, step: str, bm: int, bn: int):
        """Key blocks (of ``step``) for query block ``index`` (of ``q_block``; the
        forward, dQ): below the diagonal unmasked, the diagonal masked; or every
        block (masked if any mask). Bounds as ``(index + 1) * BLOCK``: written as
        ``index * BLOCK + BLOCK``, ptxas serialized the forward's wgmma (C7515)."""
        s = self.spec
        if self.skip_above:
            diag = f"{index} * {q_block}" if bm % bn == 0 else f"{index} * {q_block} // {step} * {step}"
            w.line(f"diag = {diag}  # the first key block the diagonal crosses")
            w.line("# Below the diagonal: every key visible.")
            w.line(f"for start_n in range(0, diag, {step}):")
            w.indent()
            body(False)
            w.dedent()
            w.line("# The diagonal: causal mask; blocks above it are skipped (p = 0 there).")
            w.line(f"for start_n in range(diag, tl.minimum(({index} + 1) * {q_block}, {s.tk}), {step}):")
            w.indent()
            body(True)
            w.dedent()
        else:
            w.line(f"for start_n in range(0, {s.tk}, {step}):")
            w.indent()
            body(True)
            w.dedent()

    def query_loops(self, w: _Writer, body, index: str, bm: int, bn: int):
        """Query blocks (of BLOCK_M1) for key block ``index`` (of BLOCK_N1; dK / dV):
        the diagonal masked, below it unmasked; or every block."""
        s = self.spec
        if self.skip_above:
            if bn % bm == 0:
                lo, hi = f"{index} * BLOCK_N1", f"({index} + 1) * BLOCK_N1"
            else:
                lo = f"{index} * BLOCK_N1 // BLOCK_M1 * BLOCK_M1"
                hi = f"(({index} + 1) * BLOCK_N1 + BLOCK_M1 - 1) // BLOCK_M1 * BLOCK_M1"
            w.line(f"lo = {lo}  # the first query block the diagonal crosses")
            w.line(f"hi = tl.minimum({hi}, {s.tq})  # and the first below it")
            w.line("# The diagonal: causal mask; query blocks above it see none of these keys (skipped).")
            w.line("for start_m in range(lo, hi, BLOCK_M1):")
            w.indent()
            body(True)
            w.dedent()
            w.line("# Below the diagonal: every key of the block visible.")
            w.line(f"for start_m in range(hi, {s.tq}, BLOCK_M1):")
            w.indent()
            body(False)
            w.dedent()
        else:
            w.line(f"for start_m in range(0, {s.tq}, BLOCK_M1):")
            w.indent()
            body(True)
            w.dedent()


def _snap_band(fill: float, log_tk: float) -> float:
    """How far float32 rounding can put ``fill - lse`` from ``-log(tk)`` for a row
    masked throughout: a few ulps of the fill (lse = fill + log(l)) and of log(tk)."""
    def ulp(x: float) -> float:  # float32's spacing at |x| (from below: float32's max has no next value)
        x = np.float32(abs(x))
        return 2 * float(x - np.nextafter(x, np.float32(0)))
    return 4 * (ulp(fill) + ulp(max(log_tk, 1.0)))


def _check(spec: AttentionSpec):
    if spec.dtype not in DTYPES:
        raise ValueError(f"flash attention: dtype {spec.dtype!r} is not one of {sorted(DTYPES)}")
    if spec.precision not in PRECISIONS:
        raise ValueError(f"flash attention: precision {spec.precision!r} is not one of {PRECISIONS}")
    if spec.causal and spec.tq != spec.tk:
        raise ValueError(f"flash attention: causal needs tq == tk, got {spec.tq} and {spec.tk}")
    if min(spec.tq, spec.tk, spec.d, spec.dv) < 1:
        raise ValueError("flash attention: every size must be at least 1")
    for t in ("q", "k", "v", "o", "mask", "bias", "do", "dq", "dk", "dv_out"):
        layout = getattr(spec, t)
        if layout is not None and len(layout.batch) != len(spec.batch):
            raise ValueError(f"flash attention: {t} has {len(layout.batch)} batch strides for {len(spec.batch)} dims")


def _forward_config(spec: AttentionSpec, interpret: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): the configured ones, as small as the sizes
    need, then fewer stages and smaller key blocks until the pipelined k / v tiles
    and the q tile fit ``SHARED_BUDGET`` (large head dims, float32)."""
    bm, bn = _block(FWD_BLOCK_M, spec.tq, interpret), _block(FWD_BLOCK_N, spec.tk, interpret)
    if interpret:
        return bm, bn, INTERPRET_WARPS, INTERPRET_STAGES
    size, dp, dvp, stages = _ITEMSIZE[spec.dtype], _padded(spec.d), _padded(spec.dv), FWD_STAGES
    while size * (bm * dp + stages * bn * (dp + dvp)) > SHARED_BUDGET and (stages > 2 or bn > MIN_DOT):
        stages, bn = (stages - 1, bn) if stages > 2 else (stages, bn // 2)
    warps = WIDE_WARPS if size * bm * max(dp, dvp) > FWD_TILE_BYTES_4_WARPS else FWD_WARPS
    return bm, bn, warps, stages


def _backward_config(spec: AttentionSpec, interpret: bool) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, warps, stages), fitted to ``SHARED_BUDGET``
    as the forward's: dK / dV hold a k and v tile and pipeline q, dO and O tiles;
    dQ holds q and dO and pipelines k and v."""
    m1, n1 = _block(BWD_BLOCK_M1, spec.tq, interpret), _block(BWD_BLOCK_N1, spec.tk, interpret)
    m2, n2 = _block(BWD_BLOCK_M2, spec.tq, interpret), _block(BWD_BLOCK_N2, spec.tk, interpret)
    if interpret:
        return m1, n1, m2, n2, INTERPRET_WARPS, INTERPRET_STAGES
    size, dp, dvp, stages = _ITEMSIZE[spec.dtype], _padded(spec.d), _padded(spec.dv), BWD_STAGES

    def shared():
        return size * max(n1 * (dp + dvp) + stages * m1 * (dp + 2 * dvp),
                          m2 * (dp + dvp) + stages * n2 * (dp + dvp))

    while shared() > SHARED_BUDGET and (stages > 2 or max(n1, m2) > MIN_DOT):
        if stages > 2:
            stages -= 1
        else:
            n1, m2 = max(n1 // 2, MIN_DOT), max(m2 // 2, MIN_DOT)
    warps = WIDE_WARPS if size * n1 * (dp + dvp) > BWD_TILE_BYTES_4_WARPS else BWD_WARPS
    return m1, n1, m2, n2, warps, stages


def _block(block: int, size: int, interpret: bool) -> int:
    """The configured block, no larger than the size needs (a power of two >= 16)."""
    return min(INTERPRET_BLOCK if interpret else block, _padded(size))


def _padded(n: int) -> int:
    return max(MIN_DOT, 1 << (n - 1).bit_length())


def _prod(xs) -> int:
    return int(np.prod(xs, dtype=np.int64)) if xs else 1


def _times(index: str, stride: int) -> str:
    return index if stride == 1 else f"{index} * {stride}"


def _lit(x: float) -> str:
    """A float as source text: float32's value, written exactly."""
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    return repr(float(np.float32(x)))


def _layout_text(layout: Layout) -> str:
    return f"batch {layout.batch}, t {layout.t}, d {layout.d}"


class _Writer:
    def __init__(self):
        self.lines, self.depth = [], 0

    def line(self, text: str):
        self.lines.append("    " * self.depth + text)

    def indent(self):
        self.depth += 1

    def dedent(self):
        self.depth -= 1

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
