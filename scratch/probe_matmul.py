"""GPU probe: the matmul template against XLA (jax.jit) on a transformer MLP
training step's products, a small-M sweep and a fused gelu(x @ w + b) layer.

    PYTHONPATH=. OUT=/tmp/out python scratch/probe_matmul.py     # H100: < 4 minutes
    PYTHONPATH=. PROBE_SMOKE=1 python scratch/probe_matmul.py    # CPU, tiny shapes, interpret mode

For each case: correctness against jax.jit (max |error| / max |reference|),
then the time per call of the template with the heuristic's tile config and a
few others, and of XLA. Both run under jax.jit (pallaskit's program staged into
the jitted function), so they pay the same dispatch; each timing is the median
over >= 50 rounds of back-to-back calls on fresh random inputs, after warm-up.
Writes $OUT/matmul.md (and .json) and prints the same table.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallaskit
from benchmarks.training_step import time_ms as step_time_ms
from lowering import heuristics as H

SMOKE = os.environ.get("PROBE_SMOKE") == "1"
OUT = os.environ.get("OUT", "/tmp")
DEADLINE_S = float(os.environ.get("PROBE_DEADLINE_S", "170"))  # skip tile alternatives after this
ROUNDS = 5 if SMOKE else 50
MIN_ROUND_S = 0.0 if SMOKE else 0.002
BF16, F32 = jnp.bfloat16, jnp.float32
START = time.perf_counter()
ROWS: list[dict] = []
ORIGINAL_CONFIG = H.matmul_config

# Tile alternatives (block_m, block_n, block_k, warps, stages) beside the heuristic's choice.
LARGE_ALTS = [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4)]
SMALL_M_ALTS = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 32, 128, 4, 4), (128, 64, 64, 4, 4)]


def scale(n: int) -> int:
    """Shapes shrink 64x in smoke mode (odd remainders kept interesting)."""
    return max(1, n // 64) if SMOKE else n


def elapsed() -> float:
    return time.perf_counter() - START


# -- timing and checks ------------------------------------------------------------------
def time_ms(fn, args) -> float:
    """Median over ROUNDS rounds of the time per call (the training benchmark's timer)."""
    return step_time_ms(lambda: fn(*args), jax.block_until_ready, ROUNDS, MIN_ROUND_S)


def rel_err(a, b) -> float:
    errs = []
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        errs.append(float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)))
    return max(errs)


def fresh(key, shapes, dtype, fan_in):
    """Random arrays on the device; the first has unit scale, the others 1/sqrt(fan_in)."""
    keys = jax.random.split(jax.random.key(key), len(shapes))
    out = []
    for i, (k, s) in enumerate(zip(keys, shapes)):
        std = 1.0 if i == 0 else fan_in ** -0.5
        out.append((jax.random.normal(k, s, F32) * std).astype(dtype))
    return jax.block_until_ready(out)


def fixed_config(bm, bn, bk, warps, stages):
    def config(m, n, k, dtype, *, batch=1, num_sms=132):
        return H.MatmulConfig(bm, bn, bk, warps, stages)
    return config


def record(row):
    ROWS.append(row)
    cells = {k: v for k, v in row.items() if k != "case"}
    print(f"{row['case']}: {json.dumps(cells)}", flush=True)


def run_case(case, fn, args, flops, *, alts=(), modes=("fused",), key=0):
    """XLA, the template with the heuristic's config (each mode in ``modes``),
    then each alternative tile config."""
    try:
        ref_fn = jax.jit(fn)
        ref = jax.block_until_ready(ref_fn(*args))
        xla_ms = time_ms(ref_fn, args)
        record(dict(case=case, variant="XLA", config="", ms=round(xla_ms, 4), tflops=round(flops / xla_ms / 1e9, 1)))
    except Exception as e:  # noqa: BLE001 - keep probing
        record(dict(case=case, variant="XLA", error=f"{type(e).__name__}: {str(e)[:300]}"))
        return
    variants = [(f"template ({mode})", mode, None) for mode in modes]
    variants += [(f"template {a[0]}x{a[1]}x{a[2]} w{a[3]} s{a[4]}", "fused", a) for a in alts]
    for name, mode, alt in variants:
        if alt is not None and elapsed() > DEADLINE_S:
            record(dict(case=case, variant=name, skipped=f"deadline {DEADLINE_S:.0f}s"))
            continue
        H.matmul_config = fixed_config(*alt) if alt is not None else ORIGINAL_CONFIG
        try:
            with pallaskit.config.override(matmul_template=mode):
                pk = pallaskit.jit(fn)
                ex = pallaskit.explain(pk, *args)
                kinds = [k.kind for k in ex.kernels]
                cfg = next((str(k.config) for k in pk.lower_to_result(*args).result.program.kernels
                            if k.name.startswith("mm")), "")
                staged = jax.jit(pk)
                t0 = time.perf_counter()
                out = jax.block_until_ready(staged(*args))
                compile_s = time.perf_counter() - t0
                err = rel_err(out, ref)
                ms = time_ms(staged, args)
            record(dict(case=case, variant=name, config=cfg, ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
                        vs_xla=round(xla_ms / ms, 3), err=float(f"{err:.3g}"), kernels=",".join(kinds),
                        fallbacks=",".join(ex.fallbacks), compile_s=round(compile_s, 2)))
        except Exception as e:  # noqa: BLE001 - keep probing
            record(dict(case=case, variant=name, error=f"{type(e).__name__}: {str(e)[:400]}"))
        finally:
            H.matmul_config = ORIGINAL_CONFIG


# -- the cases ----------------------------------------------------------------------------
def mlp_products():
    """A transformer MLP training step: x (8192 x 1024) bf16, w1 1024 x 4096,
    w2 4096 x 1024; forward products and the backward's transposed ones, in
    the forms jax's autodiff writes them."""
    R, D, H4 = scale(8192), scale(1024), scale(4096)
    cases = [
        # name, fn, shapes, (M, N, K)
        ("fwd x@w1", lambda x, w: x @ w, [(R, D), (D, H4)], (R, H4, D)),
        ("fwd h@w2", lambda h, w: h @ w, [(R, H4), (H4, D)], (R, D, H4)),
        ("bwd dy@w2.T (rhs transposed)", lambda dy, w: lax.dot_general(dy, w, (((1,), (1,)), ((), ()))),
         [(R, D), (H4, D)], (R, H4, D)),
        ("bwd dh@w1.T (rhs transposed)", lambda dh, w: lax.dot_general(dh, w, (((1,), (1,)), ((), ()))),
         [(R, H4), (D, H4)], (R, D, H4)),
        ("bwd dw2 = (dy^T h)^T (lhs transposed, transposed store)",
         lambda dy, h: lax.dot_general(dy, h, (((0,), (0,)), ((), ()))).T, [(R, D), (R, H4)], (H4, D, R)),
        ("bwd dw1 = (dh^T x)^T (lhs transposed, transposed store)",
         lambda dh, x: lax.dot_general(dh, x, (((0,), (0,)), ((), ()))).T, [(R, H4), (R, D)], (D, H4, R)),
        ("bwd dw1 = x.T @ dh (lhs transposed)", lambda x, dh: x.T @ dh, [(R, D), (R, H4)], (D, H4, R)),
    ]
    for k, (name, fn, shapes, (m, n, kk)) in enumerate(cases):
        args = fresh(100 + k, shapes, BF16, kk)
        run_case(f"{name} [{m}x{n}x{kk}] bf16", fn, args, 2.0 * m * n * kk, alts=LARGE_ALTS if k < 2 else ())


def m_sweep():
    N = K = scale(4096)
    for k, m in enumerate((scale(64), scale(256), scale(4096))):
        args = fresh(200 + k, [(m, K), (K, N)], BF16, K)
        alts = SMALL_M_ALTS if m < scale(1024) else LARGE_ALTS
        run_case(f"M sweep x@w [{m}x{N}x{K}] bf16", lambda x, w: x @ w, args, 2.0 * m * N * K, alts=alts)


def fused_layer():
    R, D, H4 = scale(8192), scale(1024), scale(4096)
    x, w = fresh(300, [(R, D), (D, H4)], BF16, D)
    b = fresh(301, [(H4,)], BF16, 1)[0]

    def layer(x, w, b):
        return jax.nn.gelu(x @ w + b, approximate=True).astype(BF16)

    run_case(f"gelu(x@w1+b) [{R}x{H4}x{D}] bf16", layer, (x, w, b), 2.0 * R * H4 * D, modes=("fused", "unfused"))


def float32_tf32():
    n = scale(4096)
    args = fresh(400, [(n, n), (n, n)], F32, n)
    run_case(f"x@w [{n}x{n}x{n}] f32 (TF32, as XLA's default)", lambda x, w: x @ w, args, 2.0 * n ** 3)


def training_step():
    """value_and_grad of the benchmark's training loss, all under jax.jit."""
    if elapsed() > DEADLINE_S:
        record(dict(case="training step", variant="all", skipped=f"deadline {DEADLINE_S:.0f}s"))
        return
    from benchmarks.training_step import inputs, loss

    args = inputs(scale(8192), scale(1024), scale(4096), BF16, key=500)
    jax.block_until_ready(args)
    flops = 6.0 * 2 * scale(8192) * scale(1024) * scale(4096)  # 2 products forward, 4 backward
    argnums = (0, 1, 2, 3)
    ref_fn = jax.jit(jax.value_and_grad(loss, argnums=argnums))
    ref = jax.block_until_ready(ref_fn(*args))
    xla_ms = time_ms(ref_fn, args)
    record(dict(case="training step (value_and_grad)", variant="XLA", ms=round(xla_ms, 4),
                tflops=round(flops / xla_ms / 1e9, 1)))
    for mode in ("fused", "off"):
        if mode == "off" and elapsed() > DEADLINE_S:
            record(dict(case="training step (value_and_grad)", variant=f"pallaskit matmul_template={mode}",
                        skipped=f"deadline {DEADLINE_S:.0f}s"))
            continue
        try:
            with pallaskit.config.override(matmul_template=mode):
                step = jax.jit(jax.value_and_grad(pallaskit.jit(loss), argnums=argnums))
                t0 = time.perf_counter()
                out = jax.block_until_ready(step(*args))
                compile_s = time.perf_counter() - t0
                ms = time_ms(step, args)
            record(dict(case="training step (value_and_grad)", variant=f"pallaskit matmul_template={mode}",
                        ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1), vs_xla=round(xla_ms / ms, 3),
                        err=float(f"{rel_err(out, ref):.3g}"), compile_s=round(compile_s, 2)))
        except Exception as e:  # noqa: BLE001
            record(dict(case="training step (value_and_grad)", variant=f"pallaskit matmul_template={mode}",
                        error=f"{type(e).__name__}: {str(e)[:400]}"))


# -- report ---------------------------------------------------------------------------------
def write_report():
    dev = jax.devices()[0]
    head = [f"# Matmul template probe ({'smoke, ' if SMOKE else ''}{dev.device_kind}, jax {jax.__version__}, "
            f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')})", "",
            "Command: `PYTHONPATH=. python scratch/probe_matmul.py` (OUT set). Median ms per call over "
            f"{ROUNDS} rounds of back-to-back calls under jax.jit, fresh random inputs; err = max |out - XLA| / "
            "max |XLA|; vs_xla > 1: faster than XLA. Total probe time "
            f"{elapsed():.0f} s.", "",
            "| case | variant | config | ms | TFLOP/s | vs XLA | err | kernels | compile s | note |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    lines = []
    for r in ROWS:
        note = r.get("error") or r.get("skipped") or (f"fallbacks: {r['fallbacks']}" if r.get("fallbacks") else "")
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in ("case", "variant", "config", "ms", "tflops",
                                                                       "vs_xla", "err", "kernels", "compile_s"))
                     + f" | {note} |")
    text = "\n".join(head + lines) + "\n"
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "matmul.md"), "w") as f:
        f.write(text)
    with open(os.path.join(OUT, "matmul.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print(text, flush=True)


def main():
    pallaskit.config.update(cache=False, log_fallbacks=False)
    print(f"devices: {jax.devices()}", flush=True)
    try:
        for part in (mlp_products, fused_layer, m_sweep, float32_tf32, training_step):
            print(f"== {part.__name__} ({elapsed():.0f} s)", flush=True)
            part()
            write_report()  # partial results survive a timeout
    finally:
        write_report()


if __name__ == "__main__":
    sys.exit(main())
