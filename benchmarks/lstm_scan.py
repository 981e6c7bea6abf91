"""An LSTM scanned over time: pallaskit (the cell's gates compiled as kernels
inside XLA's loop, [Note: loop bodies] in lowering/loops.py) against jax.jit.

    python -m benchmarks.lstm_scan [--T 128 --B 256 --H 1024 --dtype bfloat16] [--grad] [--hoist on|off] [--sweep]

Checks the two agree (bf16 tolerance), prints the body's kernels and the time per
call of each (median of rounds of back-to-back calls, host clock after
``block_until_ready``). ``--grad`` times ``jax.value_and_grad`` of a sum-of-squares
loss compiled as one graph instead of the forward. ``--hoist`` sets option
``scan_hoisting`` (default: the configuration's, on): the input projection
``x_t @ wx`` of every step as one batched matmul before the loop
([Note: scan hoisting] in lowering/scan_hoist.py). Bodies compile as kernels
inside the loop with ``PALLASKIT_LOOP_BODIES=on`` (on a GPU 'auto' leaves the
loop to XLA). ``--sweep`` times all four (scan_hoisting off/on x loop_bodies
auto/on) in one process beside jax.jit.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def lstm(params, h0, c0, xs):
    wx, wh, b = params

    def cell(carry, x):
        h, c = carry
        z = (x @ wx + h @ wh).astype(jnp.float32) + b
        i, f, g, o = jnp.split(z, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = (jax.nn.sigmoid(o) * jnp.tanh(c)).astype(h.dtype)
        return (h, c), h

    return jax.lax.scan(cell, (h0, c0), xs)


def loss(params, h0, c0, xs):
    (h, c), hs = lstm(params, h0, c0, xs)
    return jnp.sum(jnp.square(hs.astype(jnp.float32))) + jnp.sum(c)


def time_ms(fn, args, rounds=15, min_round_s=0.05):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(min_round_s / one))
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(out)


def main(argv=None):
    import pallaskit

    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--grad", action="store_true")
    ap.add_argument("--hoist", choices=("on", "off"), default=None,
                    help="option scan_hoisting (default: the configuration's)")
    ap.add_argument("--sweep", action="store_true",
                    help="time every scan_hoisting off/on x loop_bodies auto/on in one process, jax.jit before and after")
    a = ap.parse_args(argv)
    if a.hoist is not None:
        pallaskit.config.update(scan_hoisting=a.hoist == "on")
    dt = jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    scale = 1.0 / np.sqrt(a.H)
    params = (jnp.asarray(rng.standard_normal((a.H, 4 * a.H)) * scale, dt),
              jnp.asarray(rng.standard_normal((a.H, 4 * a.H)) * scale, dt),
              jnp.asarray(rng.standard_normal((4 * a.H,)) * 0.1, jnp.float32))
    h0 = jnp.asarray(rng.standard_normal((a.B, a.H)), dt)
    c0 = jnp.asarray(rng.standard_normal((a.B, a.H)), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((a.T, a.B, a.H)), dt)
    args = (params, h0, c0, xs)
    fn = jax.value_and_grad(loss) if a.grad else lstm
    ref_fn = jax.jit(fn)
    ref = ref_fn(*args)

    print(f"LSTM scan T={a.T} B={a.B} H={a.H} {a.dtype}{' value_and_grad' if a.grad else ''} "
          f"on {jax.devices()[0].device_kind}")
    if not a.sweep:
        t_pk = _run(pallaskit, fn, args, ref, verbose=True)
        t_ref = time_ms(ref_fn, args)
        print(f"jax.jit   {t_ref:.3f} ms")
        print(f"pallaskit {t_pk:.3f} ms  ({t_ref / t_pk:.2f}x)")
        return
    t_ref = time_ms(ref_fn, args)
    rows = []
    for hoist in ("off", "on"):
        for loops in ("auto", "on"):
            with pallaskit.config.override(scan_hoisting=hoist == "on", loop_bodies=loops):
                rows.append((hoist, loops, _run(pallaskit, fn, args, ref, verbose=False)))
    t_ref2 = time_ms(ref_fn, args)
    print(f"jax.jit {t_ref:.3f} ms (again after the sweep: {t_ref2:.3f} ms)")
    print("scan_hoisting loop_bodies   pallaskit ms  vs jax.jit")
    for hoist, loops, t in rows:
        print(f"{hoist:>13} {loops:>11} {t:>13.3f}  {t_ref / t:.2f}x")


def _run(pallaskit, fn, args, ref, verbose: bool) -> float:
    """Explain, check against jax.jit's ``ref`` and time a fresh ``pallaskit.jit(fn)``
    under the current options: ms per call."""
    e = pallaskit.explain(fn, *args)
    print(f"scan_hoisting={pallaskit.config.scan_hoisting} loop_bodies={pallaskit.config.loop_bodies}: "
          f"{len(e.kernels)} kernel(s), XLA fallbacks: {e.fallbacks or 'none'}")
    for line in e.rewrites:
        print(f"  {line}")
    if verbose:
        for k in e.kernels:
            print(f"  {k.name} ({k.kind}) in {k.scope or 'call'}")
    pk_fn = pallaskit.jit(fn)
    got = pk_fn(*args)
    worst = l2 = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y) / (np.abs(y) + 1.0))))
        l2 = max(l2, float(np.linalg.norm(x - y) / (np.linalg.norm(y) + 1e-30)))
    # The leaf's relative L2 error decides: a bf16 gradient over 128 steps differs from jax.jit's by
    # rounding in its near-zero entries (both are as far from a float32 reference: RESULTS.md, "Session 28").
    print(f"  vs jax.jit: max relative error {worst:.3g}, worst leaf's relative L2 error {l2:.3g} "
          f"({'ok' if l2 < 5e-2 else 'MISMATCH'})")
    return time_ms(pk_fn, args)


if __name__ == "__main__":
    main()
