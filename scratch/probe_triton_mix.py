"""GPU probe 6: the RMSNorm backward (576000 x 384 bf16) as a raw Triton kernel
(Liger / Inductor style, launched from torch), to see whether raw Triton gets
closer to the memory floor than the Pallas-generated mix kernel (0.492 ms).

Each program owns rows pid, pid + P, pid + 2P... (or a contiguous range), one
row block of BLOCK_M rows per step; dw partials accumulate in registers and
are written once per program; torch sums the (P, N) float32 partials.

PYTHONPATH=. python scratch/probe_triton_mix.py [pps,block_m,warps,stages[,contig[,evict]] ...]  (writes $OUT/probe_triton_mix.json)
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl

OUT = os.environ.get("OUT", "/tmp")
M, N, EPS = 576000, 384, 1e-6


@triton.jit
def rms_bwd(X, W, DY, DX, DWP, M, N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
            PROGRAMS: tl.constexpr, STAGES: tl.constexpr, CONTIGUOUS: tl.constexpr, EVICT: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    blocks = tl.cdiv(M, BLOCK_M)
    per = tl.cdiv(blocks, PROGRAMS)
    for step in tl.range(0, per, num_stages=STAGES):
        if CONTIGUOUS:
            blk = pid * per + step
        else:
            blk = pid + step * PROGRAMS
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        m = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        if EVICT:
            x = tl.load(X + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(DY + offs, mask=m, other=0.0, eviction_policy="evict_first").to(tl.float32)
        else:
            x = tl.load(X + offs, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + 1e-6)
        xhat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * xhat, 1) / N
        dx = rstd[:, None] * (g - xhat * c[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=m)
        acc += dy * xhat
    tl.store(DWP + pid * BLOCK_N + cols, tl.sum(acc, 0), mask=cmask)


def reference(x, w, dy):
    xf, dyf, wf = x.float(), dy.float(), w.float()
    rstd = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + EPS)
    xhat = xf * rstd
    g = dyf * wf
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat).sum(0).to(w.dtype)


def make(pps, block_m, warps, stages=1, contiguous=False, evict=False, sms=132):
    programs = pps * sms
    part = torch.empty((programs, 512), device="cuda", dtype=torch.float32)

    def f(x, w, dy):
        dx = torch.empty_like(x)
        rms_bwd[(programs,)](x, w, dy, dx, part, M, N=N, BLOCK_N=512, BLOCK_M=block_m, PROGRAMS=programs,
                             STAGES=stages, CONTIGUOUS=contiguous, EVICT=evict, num_warps=warps, num_stages=stages)
        return dx, part[:, :N].sum(0).to(w.dtype)
    return f


def time_ms(f, args_sets, reps=200, rounds=9):
    for a in args_sets[:3]:
        f(*a)
    torch.cuda.synchronize()
    meds = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(reps // 10):
            f(*args_sets[i % len(args_sets)])
        e.record()
        torch.cuda.synchronize()
        meds.append(s.elapsed_time(e) / (reps // 10))
    return statistics.median(meds)


def main():
    torch.manual_seed(0)
    sets = [(torch.randn(M, N, device="cuda").bfloat16(), torch.randn(N, device="cuda").bfloat16(),
             torch.randn(M, N, device="cuda").bfloat16()) for _ in range(2)]
    results = []

    def rec(name, f, check=True):
        err = None
        if check:
            dx, dw = f(*sets[0])
            rdx, rdw = reference(*sets[0])
            err = max(float((dx.float() - rdx.float()).abs().max() / rdx.float().abs().max()),
                      float((dw.float() - rdw.float()).abs().max() / rdw.float().abs().max()))
        ms = time_ms(f, sets)
        results.append(dict(name=name, ms=ms, rel_err=err))
        print(f"{name:48s} {ms:.4f} ms  err={err}", flush=True)

    rec("torch a+b (ceiling)", lambda x, w, dy: x + dy, check=False)
    configs = [  # pps, block_m, warps, stages, contiguous, evict
        (16, 1, 1, 1, False, False), (16, 1, 1, 2, False, False), (16, 1, 1, 3, False, False),
        (16, 1, 1, 1, True, False), (16, 1, 1, 1, False, True), (16, 1, 1, 3, True, True),
        (8, 2, 2, 1, False, False), (8, 2, 2, 3, False, False), (4, 4, 4, 1, False, False),
        (4, 4, 4, 3, False, False), (2, 8, 8, 3, False, False), (4, 8, 8, 2, False, False),
        (8, 4, 4, 2, False, False), (12, 1, 1, 2, False, False), (24, 1, 1, 1, False, False),
        (32, 1, 1, 1, False, False), (8, 1, 1, 3, False, False), (16, 2, 2, 2, False, False),
    ]
    import sys
    if sys.argv[1:]:  # pps,block_m,warps,stages[,contiguous[,evict]] ...
        configs = [tuple(int(v) for v in a.split(",")) + (0, 0)[len(a.split(",")) - 4:] for a in sys.argv[1:]]
    for c in configs:
        try:
            rec("pps=%d bm=%d warps=%d stages=%d contig=%d evict=%d" % c, make(*c))
        except Exception as e:  # noqa: BLE001
            print("FAILED", c, type(e).__name__, str(e)[:300], flush=True)
            results.append(dict(name=str(c), error=f"{type(e).__name__}: {str(e)[:300]}"))
    try:
        def tfwd(x, w):
            xf = x.float()
            return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)

        def tvjp(x, w, dy):
            _, pull = torch.func.vjp(tfwd, x, w)
            return pull(dy)
        rec("torch.compile vjp", torch.compile(tvjp))
    except Exception as e:  # noqa: BLE001
        print("torch.compile vjp FAILED", type(e).__name__, str(e)[:300])
    with open(os.path.join(OUT, "probe_triton_mix.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
                       results=results), f, indent=1)


if __name__ == "__main__":
    main()
