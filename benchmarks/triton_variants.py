"""Raw-Triton tile variants against the Pallas kernels (lowering/executors.py
``GPU_AUTO``: mix kernels with two or more column sums moved to raw Triton on
these figures, RESULTS.md "Kernel backends: the last Pallas kinds"; the matmul template: "Kernel backends: the matmul template in raw Triton"), in
one GPU process.

Each variant is the 'triton' executor with some heuristics constants set for
the compile (``VARIANTS``: rows a step, warps, programs per SM and pipeline
stages of the raw-Triton mix tile; stages / warps of the matmul tile, which
both renderers share), timed A/B/C... alternating with Pallas, raw Triton at
its defaults and jax.jit, each checked against jax.jit. ``tiny`` (a pointwise
kernel over 1024 elements) times a launch: the difference between the Pallas
and the raw-Triton row there is the per-kernel cost of jaxlib's Triton custom
call against XLA's own Triton fusion, which weighs on the 512-row MLP (two
kernels in ~0.08 ms) and not on LayerNorm (one kernel in ~0.7 ms);
``tiny_chain`` (small dependent kernels) shows whether that cost grows per
launch (e.g. a custom call that XLA's command buffers do not take).

    JAX_PLATFORMS=cuda,cpu PALLASKIT_INTERPRET=0 PYTHONPATH=. python -m benchmarks.triton_variants [--output DIR]
    PYTHONPATH=. python -m benchmarks.triton_variants --smoke      # CPU: interpret mode, tiny sizes, no timing

What differs between the renderers (rendered on the CPU with
PALLASKIT_DEBUG_DIR, kernel_backend 'pallas' vs 'triton', num_sms=132):

- LayerNorm fwd+bwd mix kernel (576000 x 384, two column sums, five row sums a
  row block): Pallas runs 1 row a step in 1-warp programs, 12 per SM (1584),
  prefetching the next two rows' loads through its loop carry; raw Triton runs
  8 rows a step in 8-warp programs, 2 per SM (264), pipelined by
  ``tl.range(num_stages=3)``. With 8 warps over a (8, 512) tile Triton's
  default layout spreads each row over several warps, so each of the five row
  sums a step goes through shared memory with a barrier; in the 1-warp Pallas
  kernel a row sum is warp shuffles only. RMSNorm backward (two row sums)
  wins in raw Triton; LayerNorm (five) loses. Variants ``ln_*`` try 1-warp
  raw-Triton tiles (Pallas's layout, Triton's pipelining).
- The matmul template: the same tiles, warps, stages, loads (no masks at
  these sizes), K loop and epilogue; what differs is the tanh (the raw-Triton
  op table's ``_tanh`` polynomial helper against Pallas's libdevice tanhf),
  the Triton that compiles it (Triton 3.6's Python compiler for raw Triton;
  XLA's own Triton pipeline for Pallas's module) and the launch (jaxlib's
  ``triton_kernel_call_ffi`` custom call against XLA's Triton fusion).
  Variants ``mm_*`` move stages and warps; ``tiny`` measures the launch.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import statistics

import jax
import jax.numpy as jnp

from benchmarks import executors as bench
from benchmarks import timing

# (label, workload, full size, smoke size)
CASES = [
    ("layernorm_fwd_bwd", "layernorm_fwd_bwd", (576000, 384), (1100, 100)),
    ("rmsnorm_bwd", "rmsnorm_bwd", (576000, 384), (1100, 100)),
    ("gelu_mlp_512", "gelu_mlp", (512, 1024, 4096, 1024), (24, 32, 64, 32)),
    ("gelu_mlp", "gelu_mlp", (8192, 1024, 4096, 1024), (24, 32, 64, 32)),
    ("tiny", "pointwise_chain", (1, 1024), (1, 100)),
    ("tiny_chain", "tiny_chain", (64, 512), (8, 100)),
]


def _tiny_chain(x):
    """Small dependent kernels (a softmax over rows, then over columns): launch
    costs and whether XLA's command buffers take every launch."""
    y = jax.nn.softmax(x.astype(jnp.float32), axis=-1)
    return (jax.nn.softmax(y, axis=0) * 2).astype(x.dtype)


def _make(workload, size, dtype, sets):
    if workload == "tiny_chain":
        key = jax.random.key(0)
        return [(jax.random.normal(jax.random.fold_in(key, i), size, dtype),) for i in range(sets)]
    return bench._inputs(workload, size, dtype, sets, 0)

# name -> (cases it applies to, heuristics constants, matmul tile change)
MIX = ("layernorm_fwd_bwd", "rmsnorm_bwd")
MM = ("gelu_mlp_512", "gelu_mlp")
VARIANTS = {
    # two or more column sums (LayerNorm): the default is 4 rows, 2 warps, 4 programs per SM
    "ln_r2_w1_p8_s3": (("layernorm_fwd_bwd",), dict(TRITON_MIX_COLUMNS_ROWS=2, TRITON_MIX_COLUMNS_WARPS=1,
                                                    TRITON_MIX_COLUMNS_PROGRAMS_PER_SM=8), {}),
    "ln_r4_w2_p6_s3": (("layernorm_fwd_bwd",), dict(TRITON_MIX_COLUMNS_PROGRAMS_PER_SM=6), {}),
    "ln_r4_w2_p4_s4": (("layernorm_fwd_bwd",), dict(TRITON_MIX_STAGES=4), {}),
    # one column sum (RMSNorm backward): the default is 8 rows, 8 warps, 2 programs per SM
    "rms_r4_w4_p4_s3": (("rmsnorm_bwd",), dict(TRITON_MIX_ROWS=4, TRITON_MIX_WARPS=4,
                                                 TRITON_MIX_PROGRAMS_PER_SM=4), {}),
    "mm_stages_up": (MM, {}, dict(num_stages=+1)),
    "mm_stages_down": (MM, {}, dict(num_stages=-1)),
    "mm_warps_x2": (MM, {}, dict(num_warps=2)),
}


@contextlib.contextmanager
def _patched(constants: dict, matmul: dict):
    """``lowering.heuristics`` with ``constants`` set, and its matmul tiles
    changed by ``matmul`` (num_stages: added; num_warps: multiplied)."""
    from lowering import heuristics

    saved = {name: getattr(heuristics, name) for name in constants}
    config = heuristics.matmul_config

    def matmul_config(*args, **kwargs):
        cfg = config(*args, **kwargs)
        if "num_stages" in matmul:
            cfg = dataclasses.replace(cfg, num_stages=max(1, cfg.num_stages + matmul["num_stages"]))
        if "num_warps" in matmul:
            cfg = dataclasses.replace(cfg, num_warps=cfg.num_warps * matmul["num_warps"])
        return cfg

    try:
        for name, value in constants.items():
            setattr(heuristics, name, value)
        if matmul:
            heuristics.matmul_config = matmul_config
        yield
    finally:
        for name, value in saved.items():
            setattr(heuristics, name, value)
        heuristics.matmul_config = config


def _tiles(f, args) -> list[str]:
    """Each kernel's executor and tile, as explain reports them."""
    import pallaskit

    out = []
    for k in pallaskit.explain(f, *args).kernels:
        head = k.source.splitlines()[0].split(": ", 1)[-1]
        extra = [m.group(0) for m in (re.search(r"num_warps=\d+", k.source), re.search(r"PROGRAMS = \d+", k.source),
                                       re.search(r"num_stages=\d+", k.source)) if m]
        out.append(f"{k.name} [{k.executor}] {head} ({', '.join(extra)})")
    return out


def run_case(label, workload, size, dtype, args) -> dict:
    import pallaskit

    fn = _tiny_chain if workload == "tiny_chain" else bench._fn(workload)
    sets = 1 if args.smoke else bench.hardware.input_sets(bench.bytes_moved(_make(workload, size, dtype, 1)[0]))
    inputs = _make(workload, size, dtype, sets)
    want = jax.jit(fn)(*inputs[0])
    tol = bench._tolerance(dtype, "column_sum" if workload == "tiny_chain" else workload)
    runs = {"pallas": ("pallas", {}, {}), "triton": ("triton", {}, {})}
    runs.update({name: ("triton", consts, mm) for name, (cases, consts, mm) in VARIANTS.items() if label in cases})
    row = {"case": label, "size": list(size), "dtype": str(jnp.dtype(dtype)), "variants": {}}
    compiled = {}
    for name, (backend, consts, mm) in runs.items():
        with _patched(consts, mm), pallaskit.config.override(kernel_backend=backend):
            f = pallaskit.jit(fn)
            try:
                err = bench._check(f(*inputs[0]), want, tol)
                row["variants"][name] = {"error": err, "kernels": _tiles(f, inputs[0]), "ms": []}
                compiled[name] = (f, backend)
            except Exception as e:  # noqa: BLE001  (a variant's failure is a row, not the end of the run)
                row["variants"][name] = {"failed": f"{type(e).__name__}: {e}"[:500]}
    if args.smoke:
        return row
    clock = timing.HostClock(jax.block_until_ready)
    xla = jax.jit(fn)
    row["xla_ms"] = []
    for _ in range(args.repeats):  # alternating, so drift hits every variant
        for name, (f, backend) in compiled.items():
            with pallaskit.config.override(kernel_backend=backend):
                t = timing.measure(lambda i, f=f: f(*inputs[i % sets]), clock, rounds=args.rounds)
            row["variants"][name]["ms"].append(t.ms)
        row["xla_ms"].append(timing.measure(lambda i: xla(*inputs[i % sets]), clock, rounds=args.rounds).ms)
    for v in row["variants"].values():
        if v.get("ms"):
            v["median_ms"] = statistics.median(v["ms"])
    row["xla_median_ms"] = statistics.median(row["xla_ms"])
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, values checked, nothing timed")
    parser.add_argument("--cases", default="", help="comma-separated case labels (default: all)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5, help="alternations; each a median of --rounds")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", default="", help="directory for triton_variants.json")
    args = parser.parse_args(argv)
    import pallaskit

    pallaskit.config.update(cache=False)
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    dtype = jnp.dtype(args.dtype)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    for label, workload, full, smoke in CASES:
        if wanted and label not in wanted:
            continue
        row = run_case(label, workload, smoke if args.smoke else full, dtype, args)
        rows.append(row)
        pallas = row["variants"].get("pallas", {}).get("median_ms")
        print(f"\n{label} {row['size']}" + ("" if args.smoke else f"  (jax.jit {row['xla_median_ms']:.4f} ms)"))
        for name, v in row["variants"].items():
            if "failed" in v:
                print(f"  {name:18s} FAILED {v['failed']}")
                continue
            ms = v.get("median_ms")
            timing_text = f"{ms:8.4f} ms  x{ms / pallas:5.3f} of pallas" if ms and pallas else "ok"
            print(f"  {name:18s} {timing_text}  err {v['error']:.2g}  {'; '.join(v['kernels'])}")
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        with open(os.path.join(args.output, "triton_variants.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
