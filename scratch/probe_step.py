"""Where the training step's time goes (GPU): pallaskit's kernels one by one
(matmul_template=auto) beside XLA's whole step, XLA's optimized HLO of the
step (which fusions and library calls it runs), and whether this jaxlib's
Pallas still has XLA's native Triton custom call path.

PYTHONPATH=. python scratch/probe_step.py   (writes $OUT/probe_step.md, $OUT/xla_step_hlo.txt)
"""
import inspect
import os
import re
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jax
import jax.numpy as jnp

from benchmarks.training_step import inputs, loss
import kernel_times

OUT = os.environ.get("OUT", "/tmp")


def main():
    smoke = "--smoke" in sys.argv
    args = inputs(64, 48, 96, jnp.bfloat16) if smoke else inputs(8192, 1024, 4096, jnp.bfloat16)
    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))
    lines = [f"# Training step breakdown, {jax.devices()[0].device_kind}, jax {jax.__version__}", ""]
    lines.append(f"XLA whole step: {kernel_times.bench(jax.jit(step), args):.4f} ms")
    rows, whole = kernel_times.kernel_times(step, args, matmul_template="auto")
    lines += ["", f"## pallaskit (matmul_template=auto): whole step {whole:.4f} ms, sum of kernels "
              f"{sum(ms for _, ms in rows):.4f} ms", "", "| kernel | ms |", "|---|---|"]
    lines += [f"| {n} | {ms:.4f} |" for n, ms in rows]
    hlo = jax.jit(step).lower(*args).compile().as_text()
    with open(os.path.join(OUT, "xla_step_hlo.txt"), "w") as fh:
        fh.write(hlo)
    entry = hlo[hlo.rfind("ENTRY"):]
    calls = re.findall(r"= \S+ (fusion|custom-call)\(.*?(?:kind=(\w+)|custom_call_target=\"([^\"]+)\")", entry)
    lines += ["", "## XLA entry computation: fusions and custom calls", ""]
    lines += [f"- {a} {b or c}" for a, b, c in calls]
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
        src = inspect.getsource(reg)
        checks = re.findall(r"jaxlib_version [<>=]+ [(][0-9, ]+[)]", src)
        lines += ["", "## Pallas Triton registration", "",
                  f"- mentions __gpu$xla.gpu.triton: {'xla.gpu.triton' in src}",
                  f"- jaxlib_version checks: {checks}"]
    except Exception as e:  # noqa: BLE001
        lines.append(f"registration not inspected: {e!r}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(OUT, "probe_step.md"), "w") as fh:
        fh.write(text + "\n")


if __name__ == "__main__":
    main()
