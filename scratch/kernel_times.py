"""Time every kernel of a pallaskit program on its own (GPU): each generated
kernel function is jitted separately and timed on the real intermediate
values while the program runs eagerly.

PYTHONPATH=. python scratch/kernel_times.py [--smoke]  (writes $OUT/kernel_times.md)
"""
import os, sys
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


def main():
    smoke = "--smoke" in sys.argv
    args = inputs(64, 48, 96, jnp.bfloat16) if smoke else inputs(8192, 1024, 4096, jnp.bfloat16)
    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    lines = [f"# Kernel times, training step (jax.value_and_grad inside pallaskit.jit), {jax.devices()[0].device_kind}", ""]
    lines.append(f"XLA whole step: {bench(jax.jit(step), args):.4f} ms")
    for mode in ("fused", "off"):
        rows, whole = kernel_times(step, args, matmul_template=mode)
        lines += ["", f"## matmul_template={mode}: whole step {whole:.4f} ms, sum of kernels "
                  f"{sum(ms for _, ms in rows):.4f} ms", "", "| kernel | ms |", "|---|---|"]
        lines += [f"| {n} | {ms:.4f} |" for n, ms in rows]
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, "kernel_times.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()
