"""The compiler imported on a thread by ``pallaskit.jit`` ([Note: compiler
preload] in pallaskit/runtime/preload.py): what it imports, that a compile
and a fork wait for it, that the option turns it off, and that every pallaskit
path importing one of its modules waits for it first."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap

import jax

from pallaskit.runtime import preload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a fresh process: the fork first (the thread still importing), then a
# compile right after, then the thread's modules.
_CHILD = textwrap.dedent("""
    import json, os, sys
    import jax, jax.numpy as jnp, numpy as np
    import pallaskit
    from pallaskit.runtime import preload

    x = jnp.asarray(np.random.default_rng(1).standard_normal((7, 33)), jnp.float32)
    x = x.at[0, :4].set(jnp.asarray([jnp.nan, jnp.inf, -jnp.inf, -0.0]))  # the backend starts here
    f = pallaskit.jit(lambda x: jnp.tanh(x) * 2 + 1)
    out = {"started": preload.started()}
    pid = os.fork() if out["started"] else 0
    if out["started"] and pid == 0:  # the child: the fork waited, so the compiler is whole here
        os._exit(0 if "lowering.codegen.program" in sys.modules else 3)
    if out["started"]:
        out["child_exit"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    out["environment_reads"] = pallaskit.cache.environment.cache_info().misses  # before the call: the thread's
    got, want = np.asarray(f(x)), np.asarray(jax.jit(lambda x: jnp.tanh(x) * 2 + 1)(x))
    out["equal"] = bool(np.allclose(got, want, rtol=1e-6, atol=1e-6, equal_nan=True))
    out["alive"] = preload._thread is not None and preload._thread.is_alive()
    out["modules"] = [m for m in preload.COMPILER_MODULES + ("jax.experimental.pallas",) if m in sys.modules]
    print("RESULT " + json.dumps(out))
""")


def _run_child(**env) -> dict:
    environment = {**os.environ, "PALLASKIT_CACHE": "0", "JAX_PLATFORMS": "cpu", "PALLASKIT_INTERPRET": "auto",
                   "PALLASKIT_KERNEL_BACKEND": "auto", **env}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, environment.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=environment,
                          timeout=300, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_preload_imports_the_compiler_and_a_fork_waits():
    out = _run_child()
    assert out["started"] and out["child_exit"] == 0  # the forked child had the whole compiler
    assert out["equal"] and not out["alive"]
    assert out["environment_reads"] == 0  # the disk cache off: no key, nothing read for one
    # The thread's modules, and on the CPU (the backend started first) Pallas for the interpreter.
    assert out["modules"] == list(preload.COMPILER_MODULES) + ["jax.experimental.pallas"]


def test_preload_reads_the_cache_keys_environment_first(tmp_path):
    """[Note: compiler preload]: with the disk cache on, the thread reads the
    key's environment (sources' hash, versions), so the first call does not."""
    out = _run_child(PALLASKIT_CACHE="1", PALLASKIT_CACHE_DIR=str(tmp_path))
    assert out["started"] and out["equal"] and out["environment_reads"] == 1


def test_a_failing_facts_read_leaves_the_rest_of_the_preload():
    """An unreadable cache folder while reading the key's environment costs the
    thread that read only: it still imports and prepares (here, in this thread)."""
    jax.devices()  # the backend started, as the thread asks
    prepared = []

    def facts():
        raise OSError("unreadable cache folder")

    preload._preload(lambda: prepared.append(True) or (), facts)
    assert prepared == [True]


def test_preload_off():
    out = _run_child(PALLASKIT_PRELOAD_COMPILER="0")
    assert not out["started"] and out["equal"]


# -- every pallaskit import of the thread's modules waits for it first -------- #
_IMPORTED_BY_PALLASKIT = {"lowering", "lowering.options", "lowering.errors", "lowering.executors"}


def _preloaded(module: str) -> bool:
    """Is ``module`` one the thread may be importing (sympy, the compiler's)?"""
    return module.split(".")[0] == "sympy" or (module.startswith("lowering")
                                               and module not in _IMPORTED_BY_PALLASKIT)


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "lowering"]
    return []


def _waits_first(function: ast.AST, line: int) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "wait"
               and isinstance(n.func.value, ast.Name) and n.func.value.id == "preload" and n.lineno < line
               for n in ast.walk(function))


def test_every_compiler_import_in_pallaskit_waits_for_the_preload():
    missing = []
    for folder, _, files in os.walk(os.path.join(REPO, "pallaskit")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("runtime", "preload.py")):
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in tree.body:  # module level: imported with pallaskit, before any thread
                for module in _imported(node):
                    assert not _preloaded(module), f"{path}:{node.lineno} imports {module} at module level"
            for function in ast.walk(tree):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if any(_preloaded(m) for m in _imported(node)) and not _waits_first(function, node.lineno):
                        missing.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert not missing, f"imports of the compiler without preload.wait() first: {missing}"


_MOSAIC_CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp
    import pallaskit
    MOSAIC = ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",
              "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")

    def call(fn):
        x = jax.random.normal(jax.random.key(0), (33, 5))
        got, want = pallaskit.jit(fn)(x), jax.jit(fn)(x)
        return {"equal": bool(jnp.allclose(got, want, rtol=1e-6, atol=1e-6)),
                "loaded": [m for m in MOSAIC if sys.modules.get(m) is not None],
                "hidden_left": [m for m in MOSAIC if m in sys.modules and sys.modules[m] is None]}

    out = {"first": call(lambda x: jnp.tanh(x) * 2 + 1)}
    import jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call as later  # a later import loads it
    out["later"] = later.__name__
    out["second"] = call(lambda x: jnp.exp(x) - 3)  # a new program, the user's import made before it
    out["same_module"] = sys.modules[later.__name__] is later
    out["kernels"] = pallaskit.metrics.counters["kernels_compiled"]
    print("RESULT " + json.dumps(out))
""")


def test_interpret_lowering_leaves_the_mosaic_interpreters_unimported():
    """[Note: Pallas's interpreters left unimported]: a CPU first call lowers its
    interpret-mode kernels without importing jax's Mosaic TPU / GPU interpreters
    (most of that call's time); nothing is left hidden in sys.modules, a later
    import loads them, and the next compile leaves the user's import as it is."""
    environment = {**os.environ, "PALLASKIT_CACHE": "0", "JAX_PLATFORMS": "cpu", "PALLASKIT_INTERPRET": "auto",
                   "PALLASKIT_KERNEL_BACKEND": "pallas"}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, environment.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _MOSAIC_CHILD], capture_output=True, text=True,
                          env=environment, timeout=300, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["first"] == {"equal": True, "loaded": [], "hidden_left": []}
    assert out["later"] == "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call"
    assert out["second"] == {"equal": True, "loaded": [out["later"]], "hidden_left": []}
    assert out["same_module"] and out["kernels"] >= 2
