"""CPU (no GPU needed): compile the eager kernels of the dynamic gelu MLP for an H100
(sm_90) through ``_compile_uncached`` and print each stage's time, to see what a cold
first call's kernel compile costs. Optionally swap the renderer's ``_tanh`` helper.

    PYTHONPATH=. python scratch/kernel_compile_times.py [--repeat N] [--dump DIR]
"""
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"
import logging  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallaskit  # noqa: E402
import pallaskit.api as api  # noqa: E402
from benchmarks.workloads import gelu_mlp  # noqa: E402

captured = {}
real = api._eager_program


def capture(title, built, options, first_sizes):
    import dataclasses
    from lowering.codegen import triton as tc
    for result, _, constants, hints in built.values():
        try:
            program = tc.render(result.schedule, dataclasses.replace(options, size_hints=hints[0], interpret=False), title)
        except tc.TritonUnsupported:
            continue
        captured.setdefault("programs", []).append((hints, program))
    raise SystemExit  # stop: no launch


api._eager_program = capture
pallaskit.config.update(dynamic_launch="on", cache=False, num_sms=132)
f = pallaskit.jit(gelu_mlp, dynamic={0: (0,)})
x = jnp.ones((100, 1024), jnp.bfloat16)
w1 = jnp.ones((1024, 4096), jnp.bfloat16)
w2 = jnp.ones((4096, 1024), jnp.bfloat16)
try:
    f(x, w1, w2)
except SystemExit:
    pass
from pallaskit.runtime import eager, triton_launch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

logging.basicConfig(level=logging.DEBUG, format="%(message)s")
logging.getLogger("pallaskit").setLevel(logging.DEBUG)
print([hp[0] for hp in captured["programs"]]); hints, program = captured["programs"][0]
print("hints", hints)
if "--dump" in sys.argv:
    d = sys.argv[sys.argv.index("--dump") + 1]
    os.makedirs(d, exist_ok=True)
    open(os.path.join(d, "eager.py"), "w").write(program.source)
source = program.source
if "--fdiv" in sys.argv:
    source = source.replace("r = (1.0 - t) / (1.0 + t)", "r = tl.fdiv(1.0 - t, 1.0 + t)")
if "--approx" in sys.argv:
    source = source.replace("    a = tl.abs(x)", """    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    a = tl.abs(x)""")
stages = int(sys.argv[sys.argv.index("--stages") + 1]) if "--stages" in sys.argv else None
ep = eager.EagerProgram(source, [(k.name, k.num_warps, stages or k.num_stages) for k in program.kernels], False, hints[0])
rec = eager._Recorder()
ep._launch(rec, ep.kernels, x, w1, w2)
repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 1
for kernel, key in rec.keys:
    signature = {name: entry for name, (entry, _) in zip(kernel.arg_names, key)}
    constexprs = {name: value for name, (entry, value) in zip(kernel.arg_names, key) if entry == "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (entry, _) in enumerate(key) if entry.startswith("*")}
    for _ in range(repeat):
        src = ASTSource(kernel.fn, signature, constexprs, attrs)
        t = time.perf_counter()
        c = triton_launch._compile_uncached(src, GPUTarget("cuda", 90, 32),
                                            {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages})
        print(f"{kernel.name}: {time.perf_counter() - t:.3f} s, warps {kernel.num_warps} stages {kernel.num_stages}, "
              f"cubin {len(c.cubin)} B, constexprs {constexprs}")
