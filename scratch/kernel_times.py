"""Time every kernel of a pallaskit program on its own (GPU): each generated
kernel function is jitted separately and timed on the real intermediate
values while the program runs eagerly.

PYTHONPATH=. python scratch/kernel_times.py [--smoke] [--modes=auto,fused,off] [--hlo]
(writes $OUT/kernel_times.md; --hlo: also XLA's optimized HLO of the same step,
$OUT/xla_step_hlo.txt, and its fusions and library calls)
"""
import os, re, sys
sys.path.insert(0, os.path.dirname(__file__))
import jax, jax.numpy as jnp
import pallaskit
from benchmarks.training_step import inputs, loss
from pallaskit.runtime import loader
import probe_mix

OUT = os.environ.get("OUT", "/tmp")


def bench(f, args):
    return probe_mix.bench(f, args, n=20, rounds=5)


def kernel_times(fn, args, **options):
    with pallaskit.config.override(cache=False, **options):
        entry = pallaskit.jit(fn).lower_to_result(*args)
    program = entry.result.program
    ns = {"EXTERNS": [loader._extern_callable(p, params) for p, params in program.externs]}
    exec(compile(program.source, "<program>", "exec"), ns)
    rows = []
    for k in program.kernels:
        kfn = jax.jit(ns[k.name])

        def timed(*a, _name=k.name, _f=kfn):
            rows.append((_name, bench(_f, a)))
            return _f(*a)

        ns[k.name] = timed
    for i, ext in enumerate(ns["EXTERNS"]):
        efn = jax.jit(ext)

        def timed_ext(*a, _name=ext.__name__, _f=efn):
            rows.append((_name, bench(_f, a)))
            return _f(*a)

        ns["EXTERNS"][i] = timed_ext
    leaves = jax.tree_util.tree_leaves(args)
    ns["call"](*leaves, *entry.constants)
    whole = bench(pallaskit.jit(fn), args)
    return rows, whole


def kernel_table(label, rows, whole) -> list[str]:
    """Markdown lines: one program's kernels and their times."""
    return (["", f"## {label}: whole step {whole:.4f} ms, sum of kernels {sum(ms for _, ms in rows):.4f} ms", "",
             "| kernel | ms |", "|---|---|"] + [f"| {n} | {ms:.4f} |" for n, ms in rows])


def report(lines, filename):
    """Print the lines and write them to $OUT/filename."""
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, filename), "w") as fh:
        fh.write(text + "\n")


def xla_fusions(step, args) -> list[str]:
    """XLA's optimized HLO of the step, written to $OUT/xla_step_hlo.txt, and
    the fusions and library calls of its entry computation (markdown lines)."""
    hlo = jax.jit(step).lower(*args).compile().as_text()
    with open(os.path.join(OUT, "xla_step_hlo.txt"), "w") as fh:
        fh.write(hlo)
    entry = hlo[hlo.rfind("ENTRY"):]
    calls = re.findall(r"= \S+ (fusion|custom-call)\(.*?(?:kind=(\w+)|custom_call_target=\"([^\"]+)\")", entry)
    return ["", "## XLA entry computation: fusions and custom calls", ""] + [f"- {a} {b or c}" for a, b, c in calls]


def main():
    smoke = "--smoke" in sys.argv
    modes = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--modes=")), ["auto"])
    args = inputs(64, 48, 96, jnp.bfloat16) if smoke else inputs(8192, 1024, 4096, jnp.bfloat16)
    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    lines = [f"# Kernel times, training step (jax.value_and_grad inside pallaskit.jit), "
             f"{jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
    lines.append(f"XLA whole step: {bench(jax.jit(step), args):.4f} ms")
    for mode in modes:
        rows, whole = kernel_times(step, args, matmul_template=mode)
        lines += kernel_table(f"matmul_template={mode}", rows, whole)
    if "--hlo" in sys.argv:
        lines += xla_fusions(step, args)
    report(lines, "kernel_times.md")


if __name__ == "__main__":
    main()
