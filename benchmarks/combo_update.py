"""Combo kernels on an optimizer update: check against jax.jit, count kernels, time.

The workload is ``benchmarks/models.py``'s AdamW (``adamw_update`` /
``adamw_clip_update``) over GPT-2-like parameter shapes; ``--layers 6 --width
1024`` is 93 arrays and 127M float32 parameters (the issue's ~100 arrays,
~120M). Each row: pallaskit with combo kernels on and off, and jax.jit, the
kernels in the program, the time per call (benchmarks/timing.py, the host
clock around a round; host-bound at these array counts: dispatching hundreds of
arrays takes longer than the update), the device time of its kernels (on a GPU,
``timing.kernel_ms``: CUPTI through torch's profiler) and its fraction of the memory
floor; then torch.optim.AdamW(fused=True) over the same shapes (CUDA events) and the fraction of the memory
floor (read params, grads, mu, nu; write params, mu, nu; clipping reads the
gradients once more only if it cannot fuse across arrays, which the floor does
not count).

    python -m benchmarks.combo_update                       # 93 arrays, 127M params, both variants
    python -m benchmarks.combo_update --layers 12 --width 768   # GPT-2 small: 183 arrays, 124M
    python -m benchmarks.combo_update --smoke               # tiny, CPU (interpret mode), seconds
"""
from __future__ import annotations

import argparse
import json

import jax
import numpy as np


def _inputs(layers, width, vocab, seed=0):
    from benchmarks import models

    return models._adamw_inputs((layers, width, vocab), "float32", jax.random.PRNGKey(seed))


def _torch_fused_ms(args, n: int, rounds: int) -> float | None:
    """torch.optim.AdamW(fused=True).step() over the same shapes (the suite's
    torch_eager row of adamw_update), CUDA events; None without CUDA torch."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    from benchmarks import models, timing

    state = [torch.tensor(np.asarray(a)).cuda() for a in args[1:]]
    step = models._t_adamw_step(False)(lambda f: f)
    count = torch.tensor(int(args[0]))
    return timing.measure(lambda i: step(count, *state), timing.CudaEventClock(torch), rounds=rounds).ms


def _kernels(fn, args) -> tuple[int, int]:
    """(launches, combo members) of pallaskit's program."""
    import pallaskit

    e = pallaskit.explain(fn, *args)
    return len(e.kernels), sum(len(k.members) for k in e.kernels)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds (the CPU)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", default="", help="write the rows to this file")
    p.add_argument("--max_members", default="", help="comma-separated caps of members per combo launch "
                   "(heuristics.COMBO_MAX_MEMBERS), each one more pallaskit row")
    a = p.parse_args(argv)
    import pallaskit
    from benchmarks import hardware, models, timing
    from lowering import heuristics

    if a.smoke:
        a.layers, a.width, a.vocab, a.rounds = 1, 16, 24, 3
    args = _inputs(a.layers, a.width, a.vocab)
    n = (len(args) - 1) // 4
    params = sum(int(np.prod(x.shape)) for x in args[1:1 + n])
    floor = hardware.floor_ms(7 * 4 * params)
    print(f"AdamW over {n} arrays, {params / 1e6:.1f}M float32 parameters; memory floor {floor:.3f} ms "
          f"({hardware.DEVICE}, {hardware.COPY_BANDWIDTH / 1e12:.1f} TB/s); device {jax.devices()[0].device_kind}")
    rows = []
    for clip in (False, True):
        fn = models.adamw_step(clip)
        want = jax.block_until_ready(jax.jit(fn)(*args))
        variants = [("xla", jax.jit(fn), None, None)]
        for on in (True, False):
            variants.append((f"pallaskit combo_kernels={on}", pallaskit.jit(fn), on, None))
        for k in [int(k) for k in a.max_members.split(",") if k]:
            variants.append((f"pallaskit max_members={k}", pallaskit.jit(fn), True, k))
        default_members = heuristics.COMBO_MAX_MEMBERS
        for name, f, combo, members in variants:
            heuristics.COMBO_MAX_MEMBERS = members or default_members  # read when the program compiles
            with pallaskit.config.override(**({} if combo is None else {"combo_kernels": combo, "cache": False})):
                got = jax.block_until_ready(f(*args))
                err = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w)) / (np.abs(np.asarray(w)) + 1e-6)))
                          for g, w in zip(got, want))
                kernels = _kernels(fn, args) if combo is not None else ("", "")
                t = timing.measure(lambda i: f(*args), timing.HostClock(jax.block_until_ready), rounds=a.rounds)
                dev = timing.kernel_ms(lambda: f(*args), jax.block_until_ready)
            heuristics.COMBO_MAX_MEMBERS = default_members
            row = dict(workload=models.adamw_step(clip).__name__, backend=name, arrays=n, params=params,
                       ms=round(t.ms, 4), device_ms=dev and round(dev, 4), floor_ms=round(floor, 4),
                       of_floor=dev and round(floor / dev, 3), host_bound=t.host_bound, kernels=kernels[0],
                       members=kernels[1], max_rel_err=err)
            rows.append(row)
            print(f"{row['workload']:18s} {name:30s} called alone {t.ms:8.3f} ms"
                  + (" (host-bound)" if t.host_bound else "")
                  + (f"; its kernels {dev:8.3f} ms on the device, {100 * floor / dev:5.1f}% of floor  " if dev else "  ")
                  + f"kernels {kernels[0]!s:>3} (members {kernels[1]!s:>4})  max rel err {err:.1e}")
    fused = _torch_fused_ms(args, n, a.rounds)
    if fused is not None:
        rows.append(dict(workload="adamw_update", backend="torch AdamW(fused=True)", arrays=n, params=params,
                         device_ms=round(fused, 4), floor_ms=round(floor, 4), of_floor=round(floor / fused, 3)))
        print(f"{'adamw_update':18s} {'torch AdamW(fused=True)':30s} {fused:8.3f} ms on the device (CUDA events), "
              f"{100 * floor / fused:5.1f}% of floor")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
