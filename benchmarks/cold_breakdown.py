"""Where a cold first compile goes: pallaskit's passes vs Triton vs JAX vs XLA, beside jax.jit.

Each (workload, variant) runs in a fresh process with an empty pallaskit cache
folder and JAX's persistent cache off. pallaskit runs through its AOT stages
(``trace`` / ``lower`` / ``compile``, the same compiler as a first call, without
the on-disk cache), timed phase by phase:

- ``trace_s``: tracing the user's function to a jaxpr;
- ``lower_s`` / ``schedule_s`` / ``render_s``: pallaskit's own passes (lowering
  to the IR; split, fusion and combo kernels; rendering the program source);
- ``load_s``: compiling and executing the generated module;
- ``jax_lower_s``: JAX lowering the generated program to StableHLO (on a GPU
  this waits for the raw-Triton kernels' compiles: ``triton_wait_s``);
- ``triton``: each raw-Triton kernel's compile through Triton's stages
  (``runtime/triton_call.py``, on compile threads, so they overlap):
  ``triton_sum_s`` (their sum), ``triton_max_s`` (the slowest), and per kernel
  its name, members and seconds (``--kernels`` prints them);
- ``xla_compile_s``: XLA compiling the executable (Pallas kernels on a GPU compile
  their Triton here: jax hands Pallas's Triton module to XLA);
- ``first_run_s``: the first execution (PTX assembly of Triton kernels, autotuning).

jax.jit runs the same stages (``trace_s``, ``jax_lower_s``, ``xla_compile_s``,
``first_run_s``). ``own_s`` is pallaskit's own time: trace + passes + load.

Variants: ``jax.jit``; ``pallaskit`` (defaults); ``members=K``
(``heuristics.COMBO_MAX_MEMBERS = K``: at most K kernels joined per combo launch);
``nocombo`` (option ``combo_kernels=False``); ``noattention`` (option ``fused_attention=False``); ``pallas`` (``kernel_backend='pallas'``); ``triton``
(``kernel_backend='triton'``: long-row mix kernels too); ``noshare`` (raw-Triton kernels of the
same code not sharing one function: [Note: shared Triton functions]); ``nosharepallas`` (Pallas
kernels of the same code each their own launch: [Note: shared Pallas kernels]); ``threads=N`` (raw-Triton
kernels compile on N threads, not ``triton_call._compile_pool``'s, each with its worker process);
``noprocs`` (option ``triton_compile_processes=False``: raw-Triton kernels compile on the threads
themselves, not in worker processes: [Note: compile workers]); ``prestart=N`` (N compile workers started as
the compile begins, ``orchestrator.PRESTART_WORKERS``); ``nograph`` (option ``command_buffers=False``);
``noahead`` (option ``autotune_ahead=False``: XLA autotunes the externs' matmuls and convolutions in the
program's own compile, not ahead of it: [Note: autotuning ahead]);
``xla:FLAGS`` (XLA_FLAGS extended by FLAGS, e.g. ``xla:--xla_gpu_autotune_level=0``); ``pretriton`` (on a
GPU, triton's compiler imported before the clock too, as the compiler preload imports it while a script sets
up; without it the load phase can wait for that import); ``warm`` (first
compiles and runs another small jax.jit program, untimed, so that XLA's one-time costs in a process are paid
before the clock). Variants combine with ``+``: ``threads=16+prestart=16``, ``jax.jit+warm``. Workloads: ``mlp:ROWS`` is the dynamic sweep's gelu
MLP (bf16 1024 x 4096 x 1024) at ROWS rows.

    # on the GPU: the 183-array AdamW of benchmarks/models.py (GPT-2 small shapes)
    JAX_PLATFORMS=cuda PYTHONPATH=. python -m benchmarks.cold_breakdown \\
        --workloads gpt2_adamw --variants jax.jit,pallaskit,members=32,members=8,nocombo --output $OUT
    # on the GPU: the 12-layer GPT-2 training step (bfloat16), kernels of the same code shared or not
    JAX_PLATFORMS=cuda PYTHONPATH=. python -m benchmarks.cold_breakdown \\
        --workloads gpt2_train --variants jax.jit,pallaskit,noshare --timeout 900 --output $OUT
    # on the GPU: raw-Triton compiles in worker processes (the default) or on the compile threads
    JAX_PLATFORMS=cuda PYTHONPATH=. python -m benchmarks.cold_breakdown \\
        --workloads gpt2_train,adamw:1000,gpt2_adamw --variants jax.jit,pallaskit,noprocs --output $OUT
    # on the CPU (interpret mode), a quick look
    PYTHONPATH=. python -m benchmarks.cold_breakdown --workloads small,adamw:100
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

RESULT = "RESULT "
WORKLOADS = ("gpt2_adamw", "mlp:ROWS", "gpt2_adamw_clip", "gpt2_train[:L]", "adamw:N", "momentum:N", "small", "model:NAME")
DEFAULT_VARIANTS = "jax.jit,pallaskit,members=32,members=8,nocombo"


def make(workload: str):
    """(function, argument structs, a function making the arguments on the default device)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    if workload.startswith("gpt2_adamw"):
        from benchmarks import models

        fn = models.adamw_step(workload.endswith("_clip"))
        shapes = [s for _, s, _ in models.gpt2_lm_params(12, 768, 50257)]
        structs = [jax.ShapeDtypeStruct((), jnp.int32)] + [jax.ShapeDtypeStruct(s, jnp.float32)
                                                           for s in shapes * 4]

        def arrays():
            key = jax.random.PRNGKey(0)
            out = [jnp.asarray(10, jnp.int32)]
            for k, s in enumerate(shapes * 4):
                x = jax.random.normal(jax.random.fold_in(key, k), s, jnp.float32) * 1e-2
                out.append(jnp.abs(x) + 1e-6 if k >= 3 * len(shapes) else x)  # nu >= 0
            return out
        return fn, structs, arrays
    if workload.startswith("gpt2_train"):
        # benchmarks/models.py's gpt2_12layer_train (bfloat16; ``gpt2_train:L``: L layers)
        from benchmarks import models

        spec = next(s for s in models.MODEL_SPECS if s["name"] == "gpt2_12layer_train")
        size = spec["sizes"]["full"]
        if ":" in workload:
            size = (int(workload.split(":", 1)[1]), *size[1:])
        inputs = spec["make_inputs"](size, jnp.bfloat16, jax.random.key(0))
        return spec["jax_fn"], [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs], lambda: inputs
    if workload.startswith("model:"):
        # any benchmarks/models.py workload at its full size (bfloat16), e.g. model:resnet_block_train
        from benchmarks import models

        name = workload.split(":", 1)[1]
        spec = next((s for s in models.MODEL_SPECS if s["name"] == name), None)
        if spec is None:
            raise ValueError(f"no models workload {name!r}; valid: "
                             f"{', '.join(s['name'] for s in models.MODEL_SPECS)}")
        inputs = spec["make_inputs"](spec["sizes"]["full"], jnp.bfloat16, jax.random.key(0))
        return spec["jax_fn"], [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs], lambda: inputs
    if workload.startswith("mlp:"):
        # the dynamic sweep's gelu MLP (benchmarks/workloads.py, bf16 1024 x 4096 x 1024) at ROWS rows
        from benchmarks.workloads import gelu_mlp

        rows = int(workload.split(":", 1)[1])
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(s) * (s[0] ** -0.5 if i else 1.0) for i, s in
              enumerate([(rows, 1024), (1024, 4096), (4096, 1024)])]
        return gelu_mlp, [jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in xs], \
            lambda: [jnp.asarray(x, jnp.bfloat16) for x in xs]
    if workload == "small":
        def fn(x):
            return jnp.tanh(x) * 2 + jnp.sum(x, -1, keepdims=True)
        x = np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32)
        return fn, [jax.ShapeDtypeStruct(x.shape, x.dtype)], lambda: [jnp.asarray(x)]
    name, _, n = workload.partition(":")
    if name in ("adamw", "momentum") and n.isdigit():
        from benchmarks import compile_time

        fn, args = compile_time.make(name, int(n))
        leaves, tree = jax.tree_util.tree_flatten(args)

        def flat(*xs):
            return fn(*jax.tree_util.tree_unflatten(tree, list(xs)))
        return flat, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves], lambda: leaves
    raise ValueError(f"unknown workload {workload!r}; valid: {', '.join(WORKLOADS)}")


class _Clock:
    """Wraps ``module.name`` so calls add their seconds to ``totals[key]``."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._undo = []

    def wrap(self, module, name: str, key: str):
        inner = getattr(module, name)
        totals = self.totals

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - t
        setattr(module, name, timed)
        self._undo.append((module, name, inner))

    def restore(self):
        for module, name, inner in reversed(self._undo):
            setattr(module, name, inner)


def _triton_probe(records: list, waits: list):
    """Time each raw-Triton compile (``triton_call._Kernel._compile``) and the
    lowering's waits for them (``_Kernel.compiled``); None without triton_call."""
    try:
        from pallaskit.runtime import triton_call
    except Exception:  # noqa: BLE001 - no triton here: nothing to time
        return None
    lock = threading.Lock()
    compile_inner, compiled_inner = triton_call._Kernel._compile, triton_call._Kernel.compiled

    def _compile(self, *a, **k):
        t = time.perf_counter()
        try:
            return compile_inner(self, *a, **k)
        finally:
            with lock:
                records.append({"kernel": self.name, "s": time.perf_counter() - t})

    def compiled(self, *a, **k):
        t = time.perf_counter()
        try:
            return compiled_inner(self, *a, **k)
        finally:
            with lock:
                waits.append(time.perf_counter() - t)
    triton_call._Kernel._compile, triton_call._Kernel.compiled = _compile, compiled
    return triton_call


def _kernels(result) -> list[dict]:
    """Each kernel of the schedule: name, kind, executor and members (combo parts)."""
    from lowering import scheduler

    executor = {k.name: k.executor for k in result.program.kernels}
    out = []
    for step in result.schedule.steps:
        if isinstance(step, scheduler.Kernel):
            parts = getattr(step, "parts", None)
            out.append({"kernel": step.name, "kind": step.kind, "parts": len(parts) if parts else 1,
                        "executor": executor.get(step.name, "")})
    return out


def _apply_variant(variant: str, lowering, heuristics, pallaskit) -> None:
    """One variant's change to the compiler or its options, in this child process."""
    if variant.startswith("members="):
        heuristics.COMBO_MAX_MEMBERS = int(variant.split("=", 1)[1])
    elif variant == "noattention":  # plain attention, not the flash kernels ([Note: fused attention])
        pallaskit.config.update(fused_attention=False)
    elif variant == "nocombo":
        pallaskit.config.update(combo_kernels=False)
    elif variant == "pallas":
        pallaskit.config.update(kernel_backend="pallas")
    elif variant == "noshare":  # every raw-Triton launch its own function ([Note: shared Triton functions])
        lowering.codegen.program.share_triton_functions = lambda kernels: None
    elif variant == "nosharepallas":  # every Pallas launch its own kernel ([Note: shared Pallas kernels])
        lowering.codegen.program.share_pallas_kernels = lambda kernels: None
    elif variant == "triton":
        pallaskit.config.update(kernel_backend="triton")
    elif variant.startswith("threads="):  # raw-Triton kernels compile on N threads (default min(8, cores))
        import concurrent.futures

        from pallaskit.runtime import triton_call as _tc
        pool = concurrent.futures.ThreadPoolExecutor(int(variant.split("=", 1)[1]))
        _tc._compile_pool = lambda: pool
    elif variant == "noahead":  # XLA autotunes the externs in the program's own compile ([Note: autotuning ahead])
        pallaskit.config.update(autotune_ahead=False)
    elif variant == "nograph":  # no command buffer for small programs ([Note: command buffers])
        pallaskit.config.update(command_buffers=False)
    elif variant == "noprocs":
        pallaskit.config.update(triton_compile_processes=False)
    elif variant.startswith("prestart="):  # compile workers started as the compile begins (default 2)
        pallaskit.orchestrator.PRESTART_WORKERS = int(variant.split("=", 1)[1])
    elif variant != "pallaskit" and not variant.startswith("xla:"):  # xla: flags set by run_child
        raise ValueError(f"unknown variant {variant!r}")


def child(workload: str, variant: str) -> dict:
    import jax
    import jax.numpy as jnp

    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    row = {"workload": workload, "variant": variant, "platform": jax.default_backend()}
    fn, structs, arrays = make(workload)
    parts = variant.split("+")
    if "warm" in parts:  # XLA's one-time costs in a process paid before the clock, by another program
        parts.remove("warm")
        jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x) * 2 + 1)(jnp.ones((8, 128))))
    cpu0 = time.process_time()
    if parts == ["jax.jit"]:
        t = time.perf_counter()
        traced = jax.jit(fn).trace(*structs)
        row["trace_s"] = time.perf_counter() - t
        t = time.perf_counter()
        lowered = traced.lower()
        row["jax_lower_s"] = time.perf_counter() - t
        t = time.perf_counter()
        compiled = lowered.compile()
        row["xla_compile_s"] = time.perf_counter() - t
    else:
        import lowering
        import lowering.codegen.program  # noqa: F401 - the passes' modules, imported before the clocks start
        import lowering.lower  # noqa: F401
        import lowering.scheduler  # noqa: F401
        import pallaskit
        pretriton = "pretriton" in parts
        if pretriton:
            parts.remove("pretriton")
        if pretriton and jax.default_backend() == "gpu":
            # triton's compiler too, as the compiler preload imports it while a script
            # sets up ([Note: compiler preload]); without it, loading the program waits
            # for that import on its thread
            from pallaskit.runtime import triton_launch

            triton_launch._triton(interpret=False)
            import triton.compiler.compiler  # noqa: F401
        from lowering import heuristics
        from pallaskit.runtime import loader

        pallaskit.config.update(cache_dir=tempfile.mkdtemp(prefix="pallaskit-cold-"))
        for part in parts:  # variants combine: threads=16+prestart=16
            _apply_variant(part, lowering, heuristics, pallaskit)
        clock = _Clock()
        clock.wrap(lowering.lower, "lower", "lower_s")
        clock.wrap(lowering.scheduler, "schedule", "schedule_s")
        clock.wrap(lowering.codegen.program, "render", "render_s")
        clock.wrap(loader, "load", "load_s")
        records, waits = [], []
        triton_call = _triton_probe(records, waits)
        try:
            jf = pallaskit.jit(fn)
            t = time.perf_counter()
            traced = jf.trace(*structs)
            row["trace_s"] = time.perf_counter() - t
            t = time.perf_counter()
            lowered = traced.lower()
            lower_total = time.perf_counter() - t
            t = time.perf_counter()
            compiled = lowered.compile()
            row["xla_compile_s"] = time.perf_counter() - t
        finally:
            clock.restore()
        row.update(clock.totals)
        passes = sum(clock.totals.get(k, 0.0) for k in ("lower_s", "schedule_s", "render_s"))
        row["passes_s"] = passes
        row["jax_lower_s"] = lower_total - passes - clock.totals.get("load_s", 0.0)
        row["own_s"] = row["trace_s"] + passes + clock.totals.get("load_s", 0.0)
        kernels = _kernels(lowered.result)
        row["kernels"] = len(kernels)
        row["executors"] = sorted({k["executor"] for k in kernels})
        row["combo_parts"] = sorted((k["parts"] for k in kernels if k["parts"] > 1), reverse=True)
        if triton_call is not None:
            parts = {k["kernel"]: k["parts"] for k in kernels}
            for r in records:
                r["parts"] = parts.get(r["kernel"].removesuffix("_kernel"), parts.get(r["kernel"], 1))
            row["triton"] = sorted(records, key=lambda r: -r["s"])
            row["triton_kernels"] = len(records)
            row["triton_sum_s"] = sum(r["s"] for r in records)
            row["triton_max_s"] = max((r["s"] for r in records), default=0.0)
            row["triton_wait_s"] = sum(waits)
    row["compile_cpu_s"] = time.process_time() - cpu0
    args = arrays()
    jax.block_until_ready(args)
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(*args))
    row["first_run_s"] = time.perf_counter() - t
    row["cold_total_s"] = sum(row.get(k, 0.0) for k in ("trace_s", "jax_lower_s", "xla_compile_s", "first_run_s")) \
        + row.get("passes_s", 0.0) + row.get("load_s", 0.0)
    t = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    row["second_run_s"] = time.perf_counter() - t
    del out
    return row


def run_child(workload: str, variant: str, timeout: float) -> dict:
    env = dict(os.environ)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    for part in variant.split("+"):
        if part.startswith("xla:"):  # e.g. xla:--xla_gpu_autotune_level=0 (space-separated flags)
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + part[4:]).strip()
    cmd = [sys.executable, "-m", "benchmarks.cold_breakdown", "--child", json.dumps([workload, variant])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=repo)
    except subprocess.TimeoutExpired:
        return {"workload": workload, "variant": variant, "error": f"timeout after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = proc.stderr.strip().splitlines()[-3:] if proc.stderr.strip() else []
    return {"workload": workload, "variant": variant, "error": f"exit {proc.returncode}: {' | '.join(tail)}"[:400]}


COLUMNS = ("trace_s", "passes_s", "load_s", "jax_lower_s", "triton_wait_s", "triton_sum_s", "triton_max_s",
           "xla_compile_s", "first_run_s", "cold_total_s", "own_s")


def table(rows: list[dict]) -> str:
    head = ["workload", "variant", "kernels", "combo parts", *[c.removesuffix("_s") for c in COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['variant']} | {r['error']} |")
            continue
        parts = r.get("combo_parts")
        cells = [r["workload"], r["variant"], str(r.get("kernels", "-")),
                 ",".join(map(str, parts[:6])) + ("..." if parts and len(parts) > 6 else "") if parts else "-"]
        cells += ["-" if r.get(c) is None else f"{r[c]:.2f}" for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="gpt2_adamw", help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help="comma-separated: jax.jit, pallaskit, members=K, nocombo, pallas, triton, noshare, "
                    "nosharepallas, threads=N, noprocs, prestart=N")
    ap.add_argument("--kernels", type=int, default=5, help="print the K slowest Triton compiles of each row")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one (workload, variant) process may take")
    ap.add_argument("--output", default="", help="folder for cold_breakdown.json")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        workload, variant = json.loads(args.child)
        print(RESULT + json.dumps(child(workload, variant)), flush=True)
        return 0
    rows = []
    for w in [w for w in args.workloads.split(",") if w]:
        for v in [v for v in args.variants.split(",") if v]:
            r = run_child(w, v, args.timeout)
            rows.append(r)
            brief = r.get("error") or " ".join(f"{c.removesuffix('_s')}={r[c]:.2f}" for c in COLUMNS if c in r)
            print(f"{w} {v}: {brief}", flush=True)
            for k in r.get("triton", [])[:args.kernels]:
                print(f"    triton {k['kernel']} ({k['parts']} members): {k['s']:.2f} s", flush=True)
    print(table(rows))
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                "load_average": os.getloadavg()}
        with open(os.path.join(args.output, "cold_breakdown.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
