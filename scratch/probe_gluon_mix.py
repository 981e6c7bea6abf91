"""GPU probe (session 14): the RMSNorm backward (576000 x 384 bf16) written in Gluon, Triton's
explicit-layout dialect, embedded in the XLA program like scratch/probe_triton_xla.py.

Question: Triton's default layout for an [8, 512] tile splits every row over 2 warps, so each row
sum crosses warps (shared memory and a barrier). With the layout chosen by hand (one warp a row,
``warps_per_cta=[W, 1]``) the sums stay in a warp. Does that, with loads issued ahead (in registers,
or by cp.async into a shared ring), close the last ~1.5% to the 0.465 ms goal?

PYTHONPATH=. python scratch/probe_gluon_mix.py [kind:pps,bm,warps,stages ...]
kind ``r``: loads of the next row block issued into registers before the current one is used
(stages unused); ``s``: cp.async into a ring of ``stages`` shared buffers, one barrier a step;
``n``: the same ring with no barrier (each thread reads back only what its own copies wrote);
``t``: the session-13 Triton tile (probe_triton_xla ``m``) in the same process.
Writes $OUT/probe_gluon_mix.json.
"""
import json
import os
import sys

import jax
import jax.numpy as jnp
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from scratch import probe_triton_xla as base

M, N, SMS = base.M, base.N, base.SMS


@gluon.jit
def _row_block(pid, step, r0, cols, PROGRAMS: gl.constexpr, BLOCK_M: gl.constexpr, N: gl.constexpr, M):
    rows = (pid + step * PROGRAMS) * BLOCK_M + r0
    offs = gl.expand_dims(rows, 1) * N + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(rows < M, 1) & gl.expand_dims(cols < N, 0)
    return offs, mask


@gluon.jit
def _math(x, dy, w, acc, N: gl.constexpr):
    x = x.to(gl.float32)
    dy = dy.to(gl.float32)
    rstd = 1.0 / gl.sqrt_rn(gl.sum(x * x, 1) / N + 1e-6)
    xhat = x * gl.expand_dims(rstd, 1)
    g = dy * w
    c = gl.sum(g * xhat, 1) / N
    dx = gl.expand_dims(rstd, 1) * (g - xhat * gl.expand_dims(c, 1))
    return dx.to(gl.bfloat16), acc + dy * xhat


@gluon.jit
def rms_bwd_regs(X, W, DY, PART, DX, M, N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                 PROGRAMS: gl.constexpr, STEPS: gl.constexpr, WARPS: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    pid = gl.program_id(0)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L))
    r0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
    w = gl.expand_dims(gl.load(W + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, L)
    offs, mask = _row_block(pid, 0, r0, cols, PROGRAMS, BLOCK_M, N, M)
    x_next = gl.load(X + offs, mask=mask, other=0.0)
    dy_next = gl.load(DY + offs, mask=mask, other=0.0)
    for step in range(STEPS):
        x = x_next
        dy = dy_next
        here = offs
        here_mask = mask
        offs, mask = _row_block(pid, step + 1, r0, cols, PROGRAMS, BLOCK_M, N, M)
        x_next = gl.load(X + offs, mask=mask, other=0.0)
        dy_next = gl.load(DY + offs, mask=mask, other=0.0)
        dx, acc = _math(x, dy, w, acc, N)
        gl.store(DX + here, dx, mask=here_mask)
    gl.store(PART + pid * N + cols, gl.sum(acc, 0), mask=cols < N)


@gluon.jit
def rms_bwd_ring(X, W, DY, PART, DX, M, N: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                 PROGRAMS: gl.constexpr, STEPS: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr,
                 BARRIER: gl.constexpr):
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
    S: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    pid = gl.program_id(0)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L))
    r0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L))
    w = gl.expand_dims(gl.load(W + cols, mask=cols < N, other=0.0).to(gl.float32), 0)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, L)
    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_N], S)
    ds = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, BLOCK_N], S)
    for s in gl.static_range(STAGES - 1):
        offs, mask = _row_block(pid, s, r0, cols, PROGRAMS, BLOCK_M, N, M)
        async_copy.async_copy_global_to_shared(xs.index(s), X + offs, mask=mask)
        async_copy.async_copy_global_to_shared(ds.index(s), DY + offs, mask=mask)
        async_copy.commit_group()
    for step in range(STEPS):
        async_copy.wait_group(STAGES - 2)  # this step's copies are in
        if BARRIER:  # ... for every thread, and the slot read last step is free. Without: every thread
            gl.thread_barrier()  # reads back only what its own copies wrote (one layout for both)
        nxt = step + STAGES - 1
        offs, mask = _row_block(pid, nxt, r0, cols, PROGRAMS, BLOCK_M, N, M)
        async_copy.async_copy_global_to_shared(xs.index(nxt % STAGES), X + offs, mask=mask)
        async_copy.async_copy_global_to_shared(ds.index(nxt % STAGES), DY + offs, mask=mask)
        async_copy.commit_group()
        x = xs.index(step % STAGES).load(L)
        dy = ds.index(step % STAGES).load(L)
        dx, acc = _math(x, dy, w, acc, N)
        here, here_mask = _row_block(pid, step, r0, cols, PROGRAMS, BLOCK_M, N, M)
        gl.store(DX + here, dx, mask=here_mask)
    async_copy.wait_group(0)
    gl.store(PART + pid * N + cols, gl.sum(acc, 0), mask=cols < N)


def _without_loop_barriers(ptx):
    """The ring's loop without ``bar.sync``: each thread waits on its own copies
    (cp.async.wait_group) and reads back only what they wrote, so no thread needs another's."""
    lines, out, inside, removed = ptx.split("\n"), [], False, 0
    for line in lines:
        if "Inner Loop Header" in line:
            inside = True
        elif inside and line.strip().startswith("@") and "bra" in line:
            inside = False
        if inside and line.strip().startswith("bar.sync"):
            removed += 1
            continue
        out.append(line)
    return "\n".join(out), removed


def make(kind, pps, bm, warps, stages):
    programs = pps * SMS
    steps = -(-(-(-M // bm)) // programs)
    sig = {"X": "*bf16", "W": "*bf16", "DY": "*bf16", "PART": "*fp32", "DX": "*bf16", "M": "i32",
           "N": "constexpr", "BLOCK_N": "constexpr", "BLOCK_M": "constexpr", "PROGRAMS": "constexpr",
           "STEPS": "constexpr", "WARPS": "constexpr"}
    ce = {"N": N, "BLOCK_N": 512, "BLOCK_M": bm, "PROGRAMS": programs, "STEPS": steps, "WARPS": warps}
    fn = rms_bwd_regs
    if kind in "sn":
        fn = rms_bwd_ring
        sig["STAGES"] = sig["BARRIER"] = "constexpr"
        ce["STAGES"], ce["BARRIER"] = stages, kind == "s"
    ptx, meta, secs = base.compile_ptx(fn, sig, ce, warps, 1, source=GluonASTSource)
    extra = dict(shared=meta.shared, compile_s=round(secs, 2), **base.REGS.get(meta.name, {}))
    if kind == "n":  # Triton's membar pass puts barriers in the loop anyway: take them out of the PTX
        ptx, extra["barriers_removed"] = _without_loop_barriers(ptx)
    outs = (jax.core.ShapedArray((programs, N), jnp.float32), jax.core.ShapedArray((M, N), jnp.bfloat16))
    call = base.embed(meta, ptx, warps, programs, [0] * 5, outs)

    def f(x, w, dy):
        part, dx = call(x, w, dy)
        return dx, jnp.sum(part, 0).astype(w.dtype)
    return f, extra


def main():
    keys = jax.random.split(jax.random.key(14), 6)
    sets = [(jax.random.normal(keys[3 * i], (M, N), jnp.bfloat16) * 0.3,
             (1 + 0.5 * jax.random.normal(keys[3 * i + 1], (N,), jnp.float32)).astype(jnp.bfloat16),
             jax.random.normal(keys[3 * i + 2], (M, N), jnp.bfloat16)) for i in range(2)]
    ref = jax.jit(base.rmsnorm_bwd)(*sets[0])
    floor = 3 * M * N * 2 / 3.0e12 * 1e3
    rows = []

    def rec(name, f, extra=None, check=True):
        try:
            ms = base.bench(f, sets)
            row = dict(name=name, ms=round(ms, 4), frac=round(floor / ms, 3),
                       err=base.err(f(*sets[0]), ref) if check else None, **(extra or {}))
        except Exception as ex:  # noqa: BLE001 keep probing
            row = dict(name=name, error=f"{type(ex).__name__}: {str(ex)[:400]}", **(extra or {}))
        rows.append(row)
        print(json.dumps(row), flush=True)

    opts = base.GRAPHS
    rec("xla a+b", jax.jit(lambda x, w, dy: x + dy, compiler_options=opts), check=False)
    for spec in sys.argv[1:]:
        kind, rest = spec.split(":")
        try:
            if kind == "t":  # the session-13 Triton tile, for comparison in the same process
                f, extra = base.make("m", *map(int, rest.split(",")))
            else:
                f, extra = make(kind, *map(int, rest.split(",")))
        except Exception as ex:  # noqa: BLE001
            rows.append(dict(name=spec, error=f"compile {type(ex).__name__}: {str(ex)[:600]}"))
            print("COMPILE FAILED", spec, str(ex)[:2000], flush=True)
            continue
        rec(spec, jax.jit(f, compiler_options=opts), extra)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_gluon_mix.json"), "w") as fh:
        json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, triton=triton.__version__,
                       floor_ms=round(floor, 4), results=rows), fh, indent=1)


if __name__ == "__main__":
    main()
