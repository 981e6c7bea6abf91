"""GPU probe 4: mix kernels' software pipelining (num_stages) and programs per
SM. Measured 2026-11-23 with loop-invariant loads hoisted out of the row loop,
which made things slower (0.512 vs 0.503 ms RMSNorm backward; LayerNorm
0.90 vs 0.80 ms) and was taken back; no variant was better on both norms.

PYTHONPATH=. python scratch/probe_mix4.py [pps,rows,warps,stages ...]  (writes $OUT/probe_mix4.json)
"""
import json, os, sys
sys.path.insert(0, os.path.dirname(__file__))
import numpy as np
import jax
from lowering import heuristics as H
import probe_mix3
from probe_mix import M, N, norm_cases, norm_inputs
from probe_mix3 import per_sm, restore, run, whole

OUT = os.environ.get("OUT", "/tmp")


# (programs per SM, rows per tile, warps, stages); argv: "16,2,1,1 8,2,1,1 ..." instead
VARIANTS = ((16, 1, 1, 2), (16, 1, 1, 3), (12, 1, 1, 1), (20, 1, 1, 1), (24, 1, 1, 1),
            (16, 2, 2, 1), (8, 2, 2, 2), (16, 1, 2, 1))
if len(sys.argv) > 1:
    VARIANTS = tuple(tuple(int(v) for v in a.split(",")) for a in sys.argv[1:])


def main():
    for name, f, args, nbytes in norm_cases(*norm_inputs(np.random.default_rng(0))).values():
        floor = nbytes * M * N * 2 / 3.0e12 * 1e3
        ref = jax.jit(f)(*args)
        run(name, "default", f, args, floor, ref)
        for pps, br, wp, st in VARIANTS:
            H._programs_per_sm, H.mix_config = per_sm(pps), whole(br, wp, st)
            run(name, f"pps{pps}_br{br}_w{wp}_st{st}", f, args, floor, ref)
        restore()
    with open(os.path.join(OUT, "probe_mix4.json"), "w") as fh:
        json.dump(probe_mix3.RESULTS, fh, indent=1)


if __name__ == "__main__":
    main()
