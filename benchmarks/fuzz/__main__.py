"""Long-run differential fuzzing of pallaskit.jit against jax.jit.

    python -m benchmarks.fuzz --minutes 60 --output DIR [--seed S] [--platform cpu|gpu] [--options K=V,...]

Generates programs (``benchmarks/fuzz/programs.py``) until the time is up, runs
each under both jits (``oracle.py``), and writes to DIR:

- ``<n>_<signature>.py``: per distinct failure (deduplicated by signature:
  crash type and innermost pallaskit frame, or the op and dtype of the first
  output that disagrees), the minimal program hypothesis shrank it to, as a
  runnable script; the header says what disagreed and which known bug class
  the program's generator features point at;
- ``summary.json``: programs run / passed / fell back / invalid / failed, per
  signature its count and file, the seed, platform, versions.

Rounds of ``--round-examples`` programs run under hypothesis with seeds S,
S+1, ...: by default hypothesis rounds (a new signature makes hypothesis
stop generating and shrink it, for at most ``--shrink-seconds``) alternate
with rounds of plain random programs (more varied; a failure is shrunk
greedily: outputs, options and special values dropped while it still fails).
A signature already written is counted and passed over. Without hypothesis
installed (the GPU image) every round is random.

Rerun one failure: ``python DIR/<file>.py`` (from the repository root, with
``PYTHONPATH=.``, on the same platform).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import random
import re
import sys
import time


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--output", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--round-examples", type=int, default=150, help="programs per hypothesis round")
    p.add_argument("--max-ops", type=int, default=8)
    p.add_argument("--shrink-seconds", type=float, default=150.0, help="time spent shrinking one round's failures")
    p.add_argument("--exclude-known", action="store_true",
                   help="leave out the generator features of known bug classes (programs.KNOWN_FEATURES)")
    p.add_argument("--no-long-rows", action="store_true", help="no rows longer than one tile")
    p.add_argument("--options", default="", help="pallaskit options for every program, KEY=VALUE[,...] (e.g. "
                   "kernel_backend=triton: the raw-Triton renderer, in Triton's interpreter on the CPU)")
    p.add_argument("--mode", choices=("mixed", "hypothesis", "random"), default="mixed",
                   help="rounds under hypothesis (shrinks well, explores narrowly), plain random programs (greedy "
                        "shrinking), or alternating")
    p.add_argument("--no-hypothesis", action="store_true", help="same as --mode random")
    return p.parse_args(argv)


def main(argv=None):
    args = _parse(argv)
    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")
    else:  # the CPU backend as well, for the float64 reference
        os.environ["JAX_PLATFORMS"] = "cuda,cpu"
        os.environ["PALLASKIT_INTERPRET"] = "0"
    os.environ["PALLASKIT_CACHE"] = "0"
    import jax

    import pallaskit
    from benchmarks.fuzz import oracle, programs

    logging.getLogger("pallaskit").setLevel(logging.ERROR)  # fallback lines: counted, not printed
    if args.options:
        known = sys.modules["pallaskit.config"].OPTIONS
        global_options = {k: known[k].parse(v) if k in known else v
                          for k, v in (kv.split("=", 1) for kv in args.options.split(","))}
        pallaskit.config.update(**global_options)
    else:
        global_options = {}
    os.makedirs(args.output, exist_ok=True)
    exclude = frozenset(programs.KNOWN_FEATURES) if args.exclude_known else frozenset()
    deadline = time.time() + args.minutes * 60
    stats = collections.Counter()
    found: dict = {}  # signature -> record
    fallback_prims = collections.Counter()
    t_start = time.time()

    def judge(program, shrinking=False):
        """Run one program; shrink replays count apart from generated programs."""
        v = oracle.run(program)
        if shrinking:
            stats["shrink_runs"] += 1
            return v
        stats["programs"] += 1
        stats[v.status] += 1
        if v.detail.startswith("overflow-order"):
            stats["overflow_order_passes"] += 1
        elif v.detail == "rounded-as-written":
            stats["rounded_as_written_passes"] += 1
        for p in v.fallbacks:
            fallback_prims[p] += 1
        if v.status in ("crash", "mismatch"):
            stats["failed"] += 1
            if v.signature in found:
                found[v.signature]["count"] += 1
        return v

    def record(program, v):
        n = len(found) + 1
        slug = re.sub(r"[^A-Za-z0-9]+", "_", v.signature)[:60].strip("_")
        path = os.path.join(args.output, f"{n:03d}_{slug}.py")
        known = sorted(program.features & set(programs.KNOWN_FEATURES))
        title = (f"pallaskit fuzz failure {n}: {v.signature}\n{v.status}: {v.detail}\n"
                 f"ops: {' '.join(program.ops())}\n"
                 f"known-class features: {', '.join(programs.KNOWN_FEATURES[k] for k in known) or 'none'}\n"
                 f"platform: {args.platform}; rerun: PYTHONPATH=. python {path}")
        with open(path, "w") as f:  # the written program carries --options too
            f.write(dataclasses.replace(program, options={**global_options, **program.options}).snippet(title))
        found[v.signature] = dict(count=found.get(v.signature, {}).get("count", 1), file=os.path.basename(path),
                                  status=v.status, detail=v.detail, ops=program.ops(), known_features=known)
        print(f"[fuzz] new failure {n}: {v.signature}\n       {v.detail[:200]}\n       -> {path}", flush=True)

    def write_summary():
        summary = dict(seed=args.seed, platform=args.platform, minutes=args.minutes, options=args.options,
                       elapsed_s=round(time.time() - t_start, 1), exclude_known=args.exclude_known,
                       jax=jax.__version__, python=sys.version.split()[0], device=str(jax.devices()[0]),
                       counts=dict(stats), programs_per_minute=round(stats["programs"] / max(1e-9, (time.time() - t_start) / 60), 1),
                       fallback_primitives=dict(fallback_prims), failures=found)
        with open(os.path.join(args.output, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)

    use_hypothesis = not args.no_hypothesis and args.mode != "random"
    if use_hypothesis:
        try:
            import hypothesis  # noqa: F401
        except ImportError:
            print("[fuzz] hypothesis is not installed: random programs, greedy shrinking", flush=True)
            use_hypothesis = False

    round_ = 0
    while time.time() < deadline:
        seed = args.seed + round_
        round_ += 1
        if use_hypothesis and (args.mode == "hypothesis" or (args.mode == "mixed" and round_ % 2 == 0)):
            _hypothesis_round(programs, judge, record, found, exclude, args, seed, deadline)
        if not use_hypothesis or args.mode == "random" or (args.mode == "mixed" and round_ % 2 == 1):
            # Plain random programs: more varied than hypothesis's mutations; shrunk greedily.
            rng = random.Random(seed)
            for _ in range(args.round_examples):
                if time.time() >= deadline:
                    break
                program = programs.random_program(rng, exclude, args.max_ops, not args.no_long_rows)
                v = judge(program)
                if v.status in ("crash", "mismatch") and v.signature not in found:
                    small = programs.shrink(program, lambda c: judge(c, shrinking=True).signature == v.signature,
                                            args.shrink_seconds)
                    again = oracle.run(small)
                    record(small, again if again.signature == v.signature else v)
        write_summary()
        print(f"[fuzz] round {round_} (seed {seed}): {dict(stats)}; {len(found)} distinct failures; "
              f"{(deadline - time.time()) / 60:.1f} min left", flush=True)
        pallaskit.metrics.reset()
        jax.clear_caches()  # every program is a new function: keep memory flat
    write_summary()
    return 0


def _hypothesis_round(programs, judge, record, found, exclude, args, seed, deadline):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    classes: dict = {}
    shrinking = []  # [time of this round's first failure]: later runs are hypothesis's shrinking
    failing = set()  # snippets of the programs that failed (replayed at the end)

    def failure_class(signature):
        # One exception type per signature: hypothesis shrinks each distinct one on its own.
        if signature not in classes:
            classes[signature] = type(f"FuzzFailure_{len(classes)}", (AssertionError,), {})
        return classes[signature]

    @hseed(seed)
    @settings(max_examples=args.round_examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=True, print_blob=False,
              phases=(Phase.generate, Phase.shrink))
    @given(programs.programs(exclude, args.max_ops, not args.no_long_rows))
    def round_test(program):
        if time.time() >= deadline:
            return  # the run's time is up: hypothesis's remaining examples pass at once
        if shrinking and time.time() - shrinking[0] > args.shrink_seconds and program.snippet() not in failing:
            return  # shrinking past its budget: only known failures (hypothesis's final replay) still fail
        v = judge(program, shrinking=bool(shrinking))
        if v.status in ("crash", "mismatch") and v.signature not in found:
            failing.add(program.snippet())
            if not shrinking:
                shrinking.append(time.time())
            exc = failure_class(v.signature)(f"{v.signature}: {v.detail}")
            exc.program, exc.verdict = program, v
            raise exc

    try:
        round_test()
    except BaseException as e:  # noqa: BLE001  (one failure or a group of them)
        if isinstance(e, KeyboardInterrupt):
            raise
        errors = list(getattr(e, "exceptions", [e]))
        for err in errors:
            if hasattr(err, "program"):
                if err.verdict.signature not in found:
                    record(err.program, err.verdict)
            else:
                print(f"[fuzz] round ended by {type(err).__name__}: {str(err)[:300]}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
