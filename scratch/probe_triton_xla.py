"""GPU probe (session 13): the RMSNorm backward (576000 x 384 bf16) as a raw
Triton kernel *inside the XLA program*: compiled to PTX by Python Triton and
embedded as jaxlib's ``triton_kernel_call_ffi`` custom call (what Pallas's
Triton backend emits), so it runs in XLA's command buffer beside XLA's sum of
the partials. Question: does the raw kernel's 0.469 ms (launched from torch,
session 7) carry over, and does any tile reach the 0.465 ms goal?

PYTHONPATH=. python scratch/probe_triton_xla.py [kind:pps,bm,warps,stages ...]  (writes $OUT/probe_triton_xla.json)
kind: ``m`` (rows x 512 masked lanes), ``c`` (three 128-column chunks, no masked lanes)
"""
import json
import os
import sys
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax._src.lib import gpu_triton
from jax.extend.core import Primitive
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pallaskit

OUT = os.environ.get("OUT", "/tmp")
M, N, EPS = 576000, 384, 1e-6
SMS = 132
GRAPHS = {"xla_gpu_graph_min_graph_size": 1}
RESULTS = []
REGS = {}


@triton.jit
def rms_bwd_masked(X, W, DY, PART, DX, M, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   PROGRAMS: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr, EVICT: tl.constexpr,
                   STREAM: tl.constexpr, HOIST: tl.constexpr, ROWSUM: tl.constexpr, PREFETCH: tl.constexpr, PURE: tl.constexpr = False):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if ROWSUM:  # the column sum's accumulator summed over the step's rows every step: fewer registers
        acc = tl.zeros((BLOCK_N,), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if HOIST:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        rows = (pid + step * PROGRAMS) * BLOCK_M + tl.arange(0, BLOCK_M)
        m = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        if not HOIST:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if PREFETCH > 0:  # ask L2 for the row block PREFETCH steps ahead: one prefetch a 128-byte line
            ahead = tl.minimum((pid + (step + PREFETCH) * PROGRAMS) * BLOCK_M + tl.arange(0, BLOCK_M), M - 1)
            lines = ahead[:, None] * N + (tl.arange(0, 8) * 64)[None, :]
            lines = tl.where((tl.arange(0, 8) * 64 < N)[None, :], lines, ahead[:, None] * N)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [X + lines],
                                      dtype=tl.int32, is_pure=PURE, pack=1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [DY + lines],
                                      dtype=tl.int32, is_pure=PURE, pack=1)
        if EVICT:
            x = tl.load(X + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(DY + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, 1) / N + 1e-6)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, 1) / N
        dx = rstd[:, None] * (g - xhat * c[:, None])
        if STREAM:
            tl.store(DX + offs, dx.to(tl.bfloat16), mask=m, cache_modifier=".cs")
        else:
            tl.store(DX + offs, dx.to(tl.bfloat16), mask=m)
        if ROWSUM:
            acc += tl.sum(dy * xhat, 0)
        else:
            acc += dy * xhat
    if ROWSUM:
        tl.store(PART + pid * N + cols, acc, mask=cmask)
    else:
        tl.store(PART + pid * N + cols, tl.sum(acc, 0), mask=cmask)


@triton.jit
def rms_bwd_chunks(X, W, DY, PART, DX, M, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                   PROGRAMS: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr):
    """N = 3 * 128: three column chunks, every lane useful."""
    pid = tl.program_id(0)
    c0 = tl.arange(0, 128)
    acc0 = tl.zeros((BLOCK_M, 128), tl.float32)
    acc1 = tl.zeros((BLOCK_M, 128), tl.float32)
    acc2 = tl.zeros((BLOCK_M, 128), tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        rows = (pid + step * PROGRAMS) * BLOCK_M + tl.arange(0, BLOCK_M)
        rm = (rows < M)[:, None]
        base = rows[:, None] * N + c0[None, :]
        w0 = tl.load(W + c0).to(tl.float32)
        w1 = tl.load(W + 128 + c0).to(tl.float32)
        w2 = tl.load(W + 256 + c0).to(tl.float32)
        x0 = tl.load(X + base, mask=rm, other=0.0).to(tl.float32)
        x1 = tl.load(X + base + 128, mask=rm, other=0.0).to(tl.float32)
        x2 = tl.load(X + base + 256, mask=rm, other=0.0).to(tl.float32)
        d0 = tl.load(DY + base, mask=rm, other=0.0).to(tl.float32)
        d1 = tl.load(DY + base + 128, mask=rm, other=0.0).to(tl.float32)
        d2 = tl.load(DY + base + 256, mask=rm, other=0.0).to(tl.float32)
        ss = tl.sum(x0 * x0, 1) + tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)
        rstd = 1.0 / tl.sqrt_rn(ss / N + 1e-6)
        g0, g1, g2 = d0 * w0[None, :], d1 * w1[None, :], d2 * w2[None, :]
        gx = tl.sum(g0 * x0, 1) + tl.sum(g1 * x1, 1) + tl.sum(g2 * x2, 1)
        r = rstd[:, None]
        k = (rstd * rstd * rstd * gx / N)[:, None]  # dx = r * g - r^3 * (sum(g * x) / N) * x
        tl.store(DX + base, (r * g0 - k * x0).to(tl.bfloat16), mask=rm)
        tl.store(DX + base + 128, (r * g1 - k * x1).to(tl.bfloat16), mask=rm)
        tl.store(DX + base + 256, (r * g2 - k * x2).to(tl.bfloat16), mask=rm)
        acc0 += d0 * x0 * r
        acc1 += d1 * x1 * r
        acc2 += d2 * x2 * r
    tl.store(PART + pid * N + c0, tl.sum(acc0, 0))
    tl.store(PART + pid * N + 128 + c0, tl.sum(acc1, 0))
    tl.store(PART + pid * N + 256 + c0, tl.sum(acc2, 0))


@triton.jit
def rms_bwd_fold(X, W, DY, SCRATCH, DW, DX, M, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 PROGRAMS: tl.constexpr, STEPS: tl.constexpr, STAGES: tl.constexpr, STRIDED: tl.constexpr):
    """The finishing sum folded in: each program adds its partial row into a zeroed f32 row with
    atomics, then bumps a counter (SCRATCH[N]); the program that finds PROGRAMS - 1 there casts the
    total into DW. STRIDED: row block pid + step * PROGRAMS (persistent); else pid * STEPS + step."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    for step in tl.range(0, STEPS, num_stages=STAGES):
        if STRIDED:
            block = pid + step * PROGRAMS
        else:
            block = pid * STEPS + step
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        m = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, 1) / N + 1e-6)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, 1) / N
        dx = rstd[:, None] * (g - xhat * c[:, None])
        tl.store(DX + offs, dx.to(tl.bfloat16), mask=m)
        acc += dy * xhat
    tl.atomic_add(SCRATCH + cols, tl.sum(acc, 0), mask=cmask, sem="relaxed")
    tl.debug_barrier()
    done = tl.atomic_add(SCRATCH + N, 1.0, sem="acq_rel")
    if done == PROGRAMS - 1:
        total = tl.load(SCRATCH + cols, mask=cmask, other=0.0, cache_modifier=".cg")
        tl.store(DW + cols, total.to(tl.bfloat16), mask=cmask)


# ---- embedding a compiled Triton kernel in the XLA program ----------------
raw_triton_p = Primitive("probe_raw_triton")
raw_triton_p.multiple_results = True
raw_triton_p.def_abstract_eval(lambda *avals, out_avals, **_: list(out_avals))


def _layouts(avals):
    return [list(reversed(range(a.ndim))) for a in avals]


def _lowering(ctx, *args, out_avals, opaque, name):
    types = [ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(a.dtype)) for a in ctx.avals_out]
    return mlir.custom_call("triton_kernel_call_ffi", result_types=types, operands=list(args),
                            backend_config=dict(name=ir.StringAttr.get(name), opaque=ir.StringAttr.get(opaque)),
                            operand_layouts=_layouts(ctx.avals_in), result_layouts=_layouts(ctx.avals_out)).results


mlir.register_lowering(raw_triton_p, _lowering, platform="cuda")


def compile_ptx(fn, signature, constexprs, warps, stages, source=ASTSource):
    """PTX and metadata of ``fn`` for the H100 (``source``: GluonASTSource for a Gluon kernel)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, (k, v) in enumerate(signature.items()) if v.startswith("*")}
    src = source(fn, signature, constexprs, attrs)
    t0 = time.perf_counter()
    options = dict(num_warps=warps, num_stages=stages)
    if os.environ.get("MAXNREG"):  # cap the registers a thread (the .maxnreg directive), for more programs an SM
        options["maxnreg"] = int(os.environ["MAXNREG"])
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    secs = time.perf_counter() - t0
    try:  # registers and spills, as the driver reports them (loads the module)
        c._init_handles()
        REGS[c.metadata.name] = dict(regs=c.n_regs, spills=c.n_spills)
    except Exception as ex:  # noqa: BLE001
        REGS[c.metadata.name] = dict(regs_error=str(ex)[:200])
    return c.asm["ptx"], c.metadata, secs


def embed(meta, ptx, warps, programs, zeroed, outs):
    """The kernel as a function of its input arrays, bound as one ``triton_kernel_call_ffi``
    custom call: ``zeroed`` holds each array parameter's bytes that jaxlib zeroes before
    the launch (inputs, then ``outs``), the last parameter is M."""
    kernel = gpu_triton.TritonKernel(meta.name, warps, 1, meta.shared, ptx, "", 90)
    params = [gpu_triton.create_array_parameter(z, 16) for z in zeroed] + [gpu_triton.create_scalar_parameter(M, "i32")]
    opaque = zlib.compress(gpu_triton.TritonKernelCall(kernel, programs, 1, 1, params).to_proto(meta.name, b""))
    return lambda *args: raw_triton_p.bind(*args, out_avals=outs, opaque=opaque, name=meta.name)


def make(kind, pps, bm, warps, stages):
    """kind: m (masked) or c (chunks), then flags: e evict_first loads, s streaming stores,
    w weight hoisted out of the loop, k the kernel alone (no finishing sum)."""
    flags, kind = kind[1:], kind[0]
    if kind in "af":
        return make_fold(kind, pps, bm, warps, stages)
    programs = pps * SMS
    steps = -(-(-(-M // bm)) // programs)
    fn = rms_bwd_masked if kind == "m" else rms_bwd_chunks
    sig = {"X": "*bf16", "W": "*bf16", "DY": "*bf16", "PART": "*fp32", "DX": "*bf16", "M": "i32",
           "N": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr", "PROGRAMS": "constexpr",
           "STEPS": "constexpr", "STAGES": "constexpr"}
    ce = {"N": N, "BLOCK_N": 512, "BLOCK_M": bm, "PROGRAMS": programs, "STEPS": steps, "STAGES": stages}
    if kind == "m":
        sig.update(EVICT="constexpr", STREAM="constexpr", HOIST="constexpr", ROWSUM="constexpr", PREFETCH="constexpr")
        digits = "".join(ch for ch in flags if ch.isdigit())
        ce.update(EVICT="e" in flags, STREAM="s" in flags, HOIST="w" in flags, ROWSUM="r" in flags,
                  PREFETCH=int(digits or 0))
    ptx, meta, secs = compile_ptx(fn, sig, ce, warps, stages)
    outs = (jax.core.ShapedArray((programs, N), jnp.float32), jax.core.ShapedArray((M, N), jnp.bfloat16))
    call = embed(meta, ptx, warps, programs, [0] * 5, outs)

    def f(x, w, dy):
        part, dx = call(x, w, dy)
        if "k" in flags:
            return dx, part
        return dx, jnp.sum(part, 0).astype(w.dtype)
    return f, dict(shared=meta.shared, compile_s=round(secs, 2), **REGS.get(meta.name, {}))


def make_fold(kind, pps, bm, warps, stages):
    """a: persistent (pps programs per SM, strided blocks); f: pps = steps per program, one program
    per pps contiguous row blocks (the hardware schedules them). Both fold the finishing sum."""
    blocks = -(-M // bm)
    if kind == "a":
        programs = pps * SMS
        steps = -(-blocks // programs)
    else:
        steps = pps
        programs = -(-blocks // steps)
    sig = {"X": "*bf16", "W": "*bf16", "DY": "*bf16", "SCRATCH": "*fp32", "DW": "*bf16", "DX": "*bf16", "M": "i32",
           "N": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr", "PROGRAMS": "constexpr",
           "STEPS": "constexpr", "STAGES": "constexpr", "STRIDED": "constexpr"}
    ce = {"N": N, "BLOCK_N": 512, "BLOCK_M": bm, "PROGRAMS": programs, "STEPS": steps, "STAGES": stages,
          "STRIDED": kind == "a"}
    ptx, meta, secs = compile_ptx(rms_bwd_fold, sig, ce, warps, stages)
    outs = (jax.core.ShapedArray((N + 1,), jnp.float32), jax.core.ShapedArray((N,), jnp.bfloat16),
            jax.core.ShapedArray((M, N), jnp.bfloat16))
    call = embed(meta, ptx, warps, programs, [0, 0, 0, (N + 1) * 4, 0, 0], outs)  # SCRATCH zeroed

    def f(x, w, dy):
        _, dw, dx = call(x, w, dy)
        return dx, dw
    return f, dict(shared=meta.shared, compile_s=round(secs, 2), programs=programs, steps=steps, **REGS.get(meta.name, {}))


def rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def rmsnorm_bwd(x, w, dy):
    _, vjp = jax.vjp(rmsnorm, x, w)
    return vjp(dy)


def bench(f, sets, n=40, rounds=11):
    for a in sets:
        jax.block_until_ready(f(*a))
    ts = []
    for r in range(rounds):
        t0 = time.perf_counter()
        for i in range(n):
            out = f(*sets[i % len(sets)])
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return float(np.median(ts))


def err(a, b):
    return max(float(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)).max()
                     / np.abs(np.asarray(y, np.float32)).max()) for x, y in zip(a, b))


def main():
    keys = jax.random.split(jax.random.key(13), 6)
    sets = [(jax.random.normal(keys[3 * i], (M, N), jnp.bfloat16) * 0.3,
             (1 + 0.5 * jax.random.normal(keys[3 * i + 1], (N,), jnp.float32)).astype(jnp.bfloat16),
             jax.random.normal(keys[3 * i + 2], (M, N), jnp.bfloat16)) for i in range(2)]
    ref = jax.jit(rmsnorm_bwd)(*sets[0])
    floor = 3 * M * N * 2 / 3.0e12 * 1e3

    def rec(name, f, check=True, extra=None):
        try:
            ms = bench(f, sets)
            e = err(f(*sets[0]), ref) if check else None
            row = dict(name=name, ms=round(ms, 4), floor_ms=round(floor, 4), frac=round(floor / ms, 3), err=e,
                       **(extra or {}))
        except Exception as ex:  # noqa: BLE001 keep probing
            row = dict(name=name, error=f"{type(ex).__name__}: {str(ex)[:400]}")
        RESULTS.append(row)
        print(json.dumps(row), flush=True)

    for graphs in (True, False):
        opts = GRAPHS if graphs else {}
        tag = "graphs" if graphs else "plain"
        rec(f"xla a+b ({tag})", jax.jit(lambda x, w, dy: x + dy, compiler_options=opts), check=False)
        rec(f"xla rmsnorm_bwd ({tag})", jax.jit(rmsnorm_bwd, compiler_options=opts))
        if graphs:
            rec("pallaskit rmsnorm_bwd (graphs)", pallaskit.jit(rmsnorm_bwd))
        specs = sys.argv[1:] or ["m:2,8,8,3", "c:2,8,8,3", "m:2,4,4,3", "c:2,4,4,3", "m:4,4,4,3", "c:4,4,4,2",
                                  "m:2,16,8,3", "c:2,16,8,3", "c:2,8,4,3", "m:1,16,16,3", "c:16,1,1,1",
                                  "m:16,1,1,1"]
        if not graphs:
            specs = specs[:1]
        for spec in specs:
            kind, rest = spec.split(":")
            pps, bm, warps, stages = map(int, rest.split(","))
            try:
                f, extra = make(kind, pps, bm, warps, stages)
            except Exception as ex:  # noqa: BLE001
                RESULTS.append(dict(name=spec, error=f"compile {type(ex).__name__}: {str(ex)[:400]}"))
                print("COMPILE FAILED", spec, ex, flush=True)
                continue
            rec(f"triton {spec} ({tag})", jax.jit(f, compiler_options=opts), check="k" not in kind, extra=extra)
    # pallaskit's program with the Triton mix kernel, and its two kernels alone
    from pallaskit.runtime import loader
    x, w, dy = sets[0]
    with pallaskit.config.override(triton_mix_kernels="on", cache=False):
        rec("pallaskit triton mix (graphs)", pallaskit.jit(rmsnorm_bwd))
        program = pallaskit.explain(rmsnorm_bwd, x, w, dy)
    src = program.source
    namespace_call = loader.load(type("P", (), dict(source=src, externs=[], kernels=[]))())
    ns = namespace_call.__globals__
    mix = [k.name for k in program.kernels if k.kind == "mix"][0]
    fin = [k.name for k in program.kernels if k.kind != "mix"][0]
    import re
    src2 = re.sub(r"tl\.where\((cmask|mask1), (tmp\d+), 0\)", r"\2", src)  # no selects before the sums
    print("selects removed:", len(re.findall(r"tl\.where\((cmask|mask1), (tmp\d+), 0\)", src)), flush=True)
    ns2 = loader.load(type("P", (), dict(source=src2, externs=[], kernels=[]))()).__globals__
    rec("generated mix kernel, selects removed (graphs)",
        jax.jit(lambda x, w, dy: ns2[mix](x, w, dy), compiler_options=GRAPHS), check=False)
    mix_only = jax.jit(lambda x, w, dy: ns[mix](x, w, dy), compiler_options=GRAPHS)
    rec("generated mix kernel alone (graphs)", mix_only, check=False)
    part = mix_only(x, w, dy)[0].reshape(-1, N)
    psets = [(part, w, dy)]
    fin_only = jax.jit(lambda p, w, dy: ns[fin](p), compiler_options=GRAPHS)
    xla_sum = jax.jit(lambda p, w, dy: jnp.sum(p, 0).astype(jnp.bfloat16), compiler_options=GRAPHS)
    for name, f in (("generated finisher alone", fin_only), ("xla sum of the partials", xla_sum)):
        try:
            row = dict(name=name, ms=round(bench(f, psets, n=200), 4))
        except Exception as ex:  # noqa: BLE001
            row = dict(name=name, error=f"{type(ex).__name__}: {str(ex)[:300]}")
        RESULTS.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(OUT, "probe_triton_xla.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, triton=triton.__version__,
                       results=RESULTS), fh, indent=1)


if __name__ == "__main__":
    main()
