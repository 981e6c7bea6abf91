"""The benchmark suite: every workload under pallaskit, XLA, torch eager and
torch.compile, in one process, on the same inputs (see benchmarks/suite.py).

    python -m benchmarks.run --smoke               # tiny sizes, CPU, interpret mode, well under a minute
    python -m benchmarks.run                       # the kernels family at full size (on the GPU)
    python -m benchmarks.run --flagfile=benchmarks/experiments/models.flags   # training steps, LM idioms
    python -m benchmarks.run --flagfile=benchmarks/experiments/norms.flags
    python -m benchmarks.run --workloads=softmax,rmsnorm_bwd --backends=pallaskit,xla --dtypes=bfloat16,float32
    python -m benchmarks.run --sizes=full,softmax=4096x4096 --repeats=30

Outputs go to --output (results.json, results.csv, results.md, plots/) and,
for full runs, into the suite's section of benchmarks/RESULTS.md. pallaskit's
own options are flags too (--pallaskit_num_warps=4 ...).
"""
from __future__ import annotations

import os
import shlex
import sys

from absl import app, flags

from benchmarks.backends import BACKENDS, default_backends
from benchmarks.workloads import FAMILIES, WORKLOADS, family_members

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", ["kernels"], f"Workloads to run, a family ({', '.join(FAMILIES)}: all its members; "
                  f"the default is the kernels) or 'all'. Valid: {', '.join(WORKLOADS)}")
flags.DEFINE_list("backends", ["default"], "Backends, 'default' (all but the slow-to-compile ones) or 'all'. "
                  f"Valid: {', '.join(BACKENDS)}")
flags.DEFINE_list("dtypes", ["bfloat16"], "Dtypes: bfloat16, float16, float32")
flags.DEFINE_list("sizes", ["full"], "A preset (full, smoke) and/or per-workload overrides WORKLOAD=AxB, e.g. "
                  "'full,softmax=4096x4096,matmul_hint_runtime=64:256:4096x8192x8192'")
flags.DEFINE_bool("smoke", False, "Tiny sizes on the CPU in Pallas interpret mode, few rounds: checks the "
                  "whole suite runs, in well under a minute")
flags.DEFINE_integer("repeats", 15, "Timing rounds per measurement (the median is reported)")
flags.DEFINE_float("min_round_ms", 20.0, "Each timing round runs back-to-back calls for at least this long")
flags.DEFINE_string("output", "benchmarks/out", "Folder for results.json, results.csv, results.md and plots/")
flags.DEFINE_string("results_md", "auto", "File whose suite section (between <!-- suite:begin/end --> markers) "
                    "is rewritten; 'auto': benchmarks/RESULTS.md, or <output>/RESULTS.md with --smoke; 'none'")
flags.DEFINE_string("plots_dir", "", "Folder for the PNG plots (default <output>/plots)")
flags.DEFINE_bool("plots", True, "Draw PNG plots (needs matplotlib)")
flags.DEFINE_integer("seed", 0, "Random seed for the inputs; 0: a fresh one each run (recorded)")
flags.DEFINE_bool("progress", True, "Show a progress bar (tqdm) on a terminal")
flags.DEFINE_bool("allow_cpu_compile", False, "Also run torch.compile on the CPU (slow)")
flags.DEFINE_float("subprocess_timeout_s", 300, "Limit for each fresh-process measurement")
flags.DEFINE_integer("jobs", 0, "Fresh-process measurements run at once (0: 1 on a GPU, 2 on the CPU)")
flags.DEFINE_float("time_budget_s", 0, "If > 0, start no new workload after this many seconds (the outputs are "
                   "still written; skipped workloads are named in the notes)")


def config_from_flags(argv):
    """SuiteConfig from the parsed flags; ValueError on an unknown name."""
    from benchmarks import suite

    workloads = suite.resolve(family_members(FLAGS.workloads), list(WORKLOADS), "workload")
    requested = [n for b in FLAGS.backends for n in (default_backends() if b.strip() == "default" else [b])]
    backends = suite.resolve(requested, list(BACKENDS), "backend")
    dtypes = suite.resolve(FLAGS.dtypes, list(suite.DTYPES), "dtype")
    preset, overrides = suite.parse_sizes(FLAGS.sizes)
    if FLAGS.smoke:
        preset = "smoke"  # overrides still apply
    results_md = FLAGS.results_md
    if results_md == "auto":
        results_md = os.path.join(FLAGS.output, "RESULTS.md") if FLAGS.smoke else "benchmarks/RESULTS.md"
    elif results_md in ("none", ""):
        results_md = None
    repeats = FLAGS.repeats if FLAGS["repeats"].present or not FLAGS.smoke else 3
    min_round_s = FLAGS.min_round_ms / 1e3 if FLAGS["min_round_ms"].present or not FLAGS.smoke else 0.002
    return suite.SuiteConfig(
        workloads=workloads, backends=backends, dtypes=dtypes, sizes=overrides, size_preset=preset,
        repeats=repeats, min_round_s=min_round_s, warmup=1 if FLAGS.smoke else 3, output=FLAGS.output,
        results_md=results_md, plots_dir=FLAGS.plots_dir or None, plots=FLAGS.plots, seed=FLAGS.seed,
        smoke=FLAGS.smoke, progress=FLAGS.progress and sys.stderr.isatty(), allow_cpu_compile=FLAGS.allow_cpu_compile,
        subprocess_timeout_s=FLAGS.subprocess_timeout_s,
        jobs=FLAGS.jobs or (2 if FLAGS.smoke else 1), time_budget_s=FLAGS.time_budget_s,
        command="python -m benchmarks.run " + " ".join(shlex.quote(a) for a in argv[1:]))


def main(argv):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too
    if FLAGS.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_platforms", "cpu")
    try:
        cfg = config_from_flags(sys.argv)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    from benchmarks import suite

    results = suite.run(cfg)
    bad = [n for n in results["notes"] if "FAILED" in n or "MISMATCH" in n]
    print(f"\n{len(results['rows'])} rows in {results['meta']['elapsed_s']} s; wrote {cfg.output}"
          + (f" and {cfg.results_md}" if cfg.results_md else ""))
    for n in results["notes"]:
        print(f"- {n}")
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
