"""Triton's compile stages without its cache, in this process or in compile
worker processes ([Note: compile workers]).

Nothing here imports jax or pallaskit: a worker process loads this file alone,
by its path, and imports only triton.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pallaskit")
_ALIGN = 16  # bytes every pointer argument is specialized as aligned to


# Kernels compile on several threads (``triton_call._compile_pool``), and Triton
# parses a kernel's source (``ast.parse``) for its hash and its AST stage. Python
# before 3.11.8 and 3.12.2 keeps ast.parse's recursion depth in state the threads
# share (CPython gh-106905): two parses at once raised "SystemError: AST constructor
# recursion depth mismatch", failing a compile. Both steps are Python under the GIL
# for the most part: they take turns at no cost.
PARSE_LOCK = threading.RLock()


@dataclass
class _Compiled:
    """A compiled kernel: Triton's metadata (``name``, ``shared``, ``num_warps``,
    scratch sizes, launch flags) and its cubin."""
    metadata: Any
    cubin: bytes


# [Note: Triton's wide prototypes]
# Triton 3.6 builds a function's argument values into a tuple one argument at a
# time and recomputes the tuple's type after each (``ASTFunction.deserialize``
# through ``tuple._setitem``), and the type's name is a string naming every
# element's type: O(A^2) in the function's A arguments. A combo kernel takes
# every member's pointers, near a thousand for an optimizer's update, and there
# this was a quarter of the kernel's whole compile (H100 host: the 86-member
# AdamW combo of gpt2_adamw, 2.17 s to 1.63 s; benchmarks/RESULTS.md, "Session
# 31"). Where Triton's two functions are exactly the ones read here (their
# source's digest) and the arguments are flat (no tuple arguments), the
# replacement sets the values and computes the type once, at the end: what the
# last ``_setitem`` computed, from the same final values. Anything else keeps
# Triton's own.
_DESERIALIZE_DIGEST = "ef1c059ea0ca61a9"  # triton 3.6.0's ASTFunction.deserialize
_SETITEM_DIGEST = "3c2b02886aaee1df"  # and its tuple._setitem
_wide_prototypes: bool | None = None  # installed or not, once decided


def _source_digest(fn) -> str:
    import hashlib
    import inspect

    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def wide_prototypes() -> bool:
    """Install the linear ``deserialize`` once per process; whether it is installed."""
    global _wide_prototypes
    if _wide_prototypes is not None:
        return _wide_prototypes
    try:
        from triton import language
        from triton.compiler import code_generator

        original = code_generator.ASTFunction.deserialize
        matches = (_source_digest(original) == _DESERIALIZE_DIGEST
                   and _source_digest(language.core.tuple._setitem) == _SETITEM_DIGEST)
    except Exception:  # noqa: BLE001  (another Triton: its own code runs)
        matches = False
    _wide_prototypes = matches
    if not matches:
        return False

    def deserialize(self, fn):
        nested = (list, tuple, language.tuple_type)
        if any(isinstance(ty, nested) for ty in self.arg_types) or any(len(p) != 1 for p in self.constants):
            return original(self, fn)  # tuple arguments: Triton's own
        # flat arguments: Triton's value paths are (i,) for each non-constant, non-None type
        val_paths = [(i,) for i, ty in enumerate(self.arg_types) if (i,) not in self.constants and ty is not None]
        vals = language.tuple([language.constexpr(None) for _ in self.arg_types], self.arg_types)
        cursor = 0
        handles = [fn.args(i) for i in range(fn.get_num_args())]
        for path in val_paths:
            ty = self.arg_types[path[0]]
            for attr_name, attr_val in self.attrs.get(path, []):
                fn.set_arg_attr(cursor, attr_name, attr_val)
            val, cursor = ty._unflatten_ir(handles, cursor)
            vals.values[path[0]] = val
        for path, val in self.constants.items():
            vals.values[path[0]] = language.constexpr(val)
        if val_paths or self.constants:
            vals.type = language.core._type_for_tuple_values(vals.values, vals.type.fields)
        return vals

    code_generator.ASTFunction.deserialize = deserialize
    return True


# [Note: function sources without the tokenizer]
# ``@triton.jit`` reads its function's source with ``inspect.getsourcelines``,
# which runs Python's tokenizer over the function's lines: about 10 ms for a
# generated kernel on this repository's CPU, 1.2 of the 2.2 s a 12-layer GPT-2
# step's 106 functions took to load under a profiler (benchmarks/RESULTS.md,
# "Session 33"). pallaskit's generated modules hold top-level functions only,
# so ``register_sources`` finds their blocks by indentation (``source_blocks``)
# before the module runs, and ``fast_sources`` replaces ``inspect`` in
# ``triton.runtime.jit``, once, with ``_Sources``: ``getsourcelines`` of a
# registered function is its block, and everything else (any other function,
# every other name) is ``inspect``'s own, so a user's kernels are unaffected.
# A block ends at its last indented line before the next top-level line of
# code, comments indented at least as the body included, as inspect's
# ``BlockFinder`` ends it (test_cold_compile checks generated programs against
# it); a block holding a triple quote is not kept (a string's lines could be
# at column 0).
_blocks: dict = {}  # filename -> {first line (1-based): the function's lines}
_fast_sources: bool | None = None


def source_blocks(lines: list) -> dict:
    """{first line number, 1-based (its first decorator's): lines} of each
    top-level function of a module's ``lines``."""
    blocks, pending, start, last = {}, None, None, None
    header = body = None  # the def line ends its header (":"); the body's first line's indent
    for i, line in enumerate(lines):
        code = line.lstrip()
        if not code:
            continue
        indent = len(line) - len(code)
        if code.startswith("#"):  # a comment indented as the body is the block's (inspect's BlockFinder)
            if start is not None and body is not None and indent >= body:
                last = i
            continue
        if indent:
            if start is not None:
                last = i
                if header and body is None:
                    body = indent
                header = header or line.rstrip().endswith(":")
            continue
        if start is not None:
            blocks[start + 1] = lines[start:last + 1]
            start = None
        if code.startswith("@"):
            pending = i if pending is None else pending
        elif code.startswith(("def ", "async def ")):
            start, last, pending = (i if pending is None else pending), i, None
            header, body = line.rstrip().endswith(":"), None
        else:
            pending = None
    if start is not None:
        blocks[start + 1] = lines[start:last + 1]
    return {n: b for n, b in blocks.items() if not any('"""' in x or "'''" in x for x in b)}


def register_sources(filename: str, lines: list) -> None:
    """The top-level functions of the module ``filename`` (its ``lines``), for
    ``_Sources`` (installed with triton's import: ``fast_sources``)."""
    _blocks[filename] = source_blocks(lines)


def forget_sources(filename: str) -> None:
    _blocks.pop(filename, None)


class _Sources:
    """``inspect`` as ``triton.runtime.jit`` sees it: ``getsourcelines`` of a
    registered module's function is its block ([Note: function sources without
    the tokenizer]); the rest is ``inspect``'s."""

    def __init__(self, real):
        self._real = real

    def getsourcelines(self, fn):
        code = getattr(fn, "__code__", None)
        if code is not None:
            block = _blocks.get(code.co_filename, {}).get(code.co_firstlineno)
            if block is not None:
                return list(block), code.co_firstlineno
        return self._real.getsourcelines(fn)

    def __getattr__(self, name):
        return getattr(self._real, name)


def fast_sources() -> bool:
    """Install ``_Sources`` in ``triton.runtime.jit`` once per process (where it
    imports ``inspect`` as this module knows it); whether it is installed."""
    global _fast_sources
    if _fast_sources is None:
        import inspect

        try:
            from triton.runtime import jit

            if getattr(jit, "inspect", None) is inspect:
                jit.inspect = _Sources(inspect)
            _fast_sources = isinstance(getattr(jit, "inspect", None), _Sources)
        except Exception:  # noqa: BLE001  (another Triton: its own reads)
            _fast_sources = False
    return _fast_sources


def _compile_uncached(src, target, options: dict, until: str = "cubin") -> _Compiled:
    """What ``triton.compile`` does (triton/compiler/compiler.py, Triton 3.6)
    minus its cache: parse the options, make the IR from the kernel's AST, run
    the backend's stages (ttir, ttgir, llir, ptx, cubin) filling in the
    metadata, up to the stage ``until`` (its output is ``cubin``: ``"ptx"``
    gives the PTX text's bytes). A Triton whose internals differ from these
    gets ``triton.compile``."""
    import triton
    wide_prototypes()  # [Note: Triton's wide prototypes]
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars, ir
        from triton.compiler.compiler import make_backend

        backend = make_backend(target)
        parsed = backend.parse_options(dict(options, **src.parse_options()))
        stages: dict = {}
        backend.add_stages(stages, parsed, src.language)
        first = list(stages).index(src.ext)  # make_ir gives raw TTIR: the ttir stage runs on it too
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        log.debug("pallaskit: compiling through triton.compile (%s: %s)", type(e).__name__, e)
        with PARSE_LOCK:
            compiled = triton.compile(src, target=target, options=options)
        binary = compiled.asm[until]
        return _Compiled(_namespace(json.loads(json.dumps(compiled.metadata._asdict(), default=vars))),
                         binary.encode() if isinstance(binary, str) else bytes(binary))
    t0 = time.perf_counter()
    with PARSE_LOCK:  # both parse the kernel's source
        metadata = {"hash": src.hash(), "target": target, **parsed.__dict__, **get_cache_invalidating_env_vars(),
                    "triton_version": triton.__version__}
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module = src.make_ir(target, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(),
                             context)
    times = [f"ast {time.perf_counter() - t0:.3f}"]
    t0 = time.perf_counter()
    for ext, compile_stage in list(stages.items())[first:]:
        module = compile_stage(module, metadata)
        times.append(f"{ext} {time.perf_counter() - t0:.3f}")
        t0 = time.perf_counter()
        if ext == until:
            break
    log.debug("pallaskit: compiled %s (s: %s)", metadata.get("name"), ", ".join(times))
    return _Compiled(_namespace(json.loads(json.dumps(metadata, default=vars))),
                     module.encode() if isinstance(module, str) else bytes(module))


def ast_source(fn, signature: dict, constexprs: dict):
    """Triton's ``ASTSource`` of ``fn`` (Gluon's for a ``@gluon.jit`` function:
    [Note: staged rows] in lowering/codegen/rows.py): ``signature`` maps every
    argument to its type (``"*bf16"``, ``"i32"``, ``"constexpr"``); pointers are
    16-byte aligned."""
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", _ALIGN]] for i, entry in enumerate(signature.values())
             if entry.startswith("*")}
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn, signature, constexprs, attrs)
    return ASTSource(fn, signature, constexprs, attrs)


def _namespace(metadata: dict):
    return types.SimpleNamespace(**metadata)


# [Note: compile workers]
# Triton's frontend (the kernel's AST to TTIR: ``ASTSource.make_ir``) is Python
# and holds the GIL: a fifth of a GPT-2 kernel's compile, most of a combo
# kernel's; the stages after it (MLIR and LLVM passes, PTX) release it. On
# compile threads the frontends of a program's kernels take turns with one
# another and with JAX lowering the program on the main thread. So each
# compile thread (``triton_call._compile_pool``: raw Triton kernels inside XLA,
# ``triton_call._Kernel``, to PTX; an eager program's kernels,
# ``triton_launch.TritonKernel``, to cubin) hands its compiles to a worker
# process of its own (``compile_job``): a fresh Python (never a fork of a
# process that may hold CUDA) that imports only triton and this file, and
# compiles for the GPU target it is given, so it needs no GPU. A worker takes
# a few tenths of a second to start, so one for each compile thread starts as
# a GPU compile begins (``prestart``, from the orchestrator), beside the passes: the first compile
# threads take these spares, and a thread without one starts its own on its
# first compile. While a thread's worker starts, one thread at a time compiles
# a kernel of few parameters on its own rather than wait (a small program does
# not wait for a worker). A job carries what the worker needs to rebuild the
# kernel's module (``module_payload``: each top-level ``@triton.jit``
# function's source and first line, the module and file names, the triton
# modules and constants it names; sent once per worker and module); the worker
# defines the kernel's functions at their own lines of the same file name
# under the same module name, so the PTX or cubin it sends back with Triton's
# metadata is the bytes a compile in this process gives (line info and noinline
# functions' mangled names included), which the tests check. Anything amiss in
# a worker (a module it cannot rebuild, a compile error, a crash) sends the
# job back to a compile on the thread, which raises what it raises there; a
# worker that died is replaced on the next job. A worker exits when its pipe
# closes: at this process's exit (``_shutdown_all``) or death, or when a
# reaper thread here closes it after ``_IDLE_S`` without a job (a training
# loop's process keeps no idle workers; the next compile starts another), the
# worker itself giving up after twice that. Option ``triton_compile_processes``
# (pallaskit.config) turns workers off.
class WorkerError(RuntimeError):
    """A worker could not compile a job (the caller compiles it on its thread)."""


_BOOT = ("import importlib.util as u, sys; s = u.spec_from_file_location('_pallaskit_triton_worker', sys.argv[1]); "
         "m = sys.modules[s.name] = u.module_from_spec(s); s.loader.exec_module(m); m._worker_main()")
_BOOT_TIMEOUT_S = 120.0  # a worker's start: Python and triton's imports, on a loaded host
_MAX_BOOT_FAILURES = 3  # then this process compiles on its threads
_WORKER_MODULES = 32  # modules a worker keeps rebuilt; it asks again for one it dropped
_IDLE_S = 300.0  # a worker without a job this long is closed
_REAP_EVERY_S = 30.0


def _write_message(fd: int, message) -> None:
    _write_frame(fd, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("compile worker pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _readable(fd: int, timeout: float) -> bool:
    poller = select.poll()  # not select.select: a process may hold descriptors past FD_SETSIZE
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout * 1000))


def _read_message(fd: int):
    (n,) = struct.unpack("<Q", _read_exactly(fd, 8))
    return pickle.loads(_read_exactly(fd, n))


class Worker:
    """One compile worker process, used by one thread at a time. It starts
    in the background: ``ready`` says when it answers."""

    def __init__(self):
        import importlib.util

        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # the worker compiles for the GPU
        # the worker imports the triton this process has (or would import: found, not imported, as
        # a worker may start before this process imports triton), wherever that was found
        found = importlib.util.find_spec("triton")
        if found is None or not found.origin:
            raise ImportError("no triton package")
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(found.origin))]
                                            + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        # -P: the current folder is not put on the worker's path (a stray triton/ there)
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", _BOOT, os.path.abspath(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        self.owner = os.getpid()
        self.started = time.monotonic()
        self.is_ready = False
        self.modules: set = set()  # module keys this worker has rebuilt
        self.lock = threading.Lock()  # held while a job is in the worker
        self._starting = threading.Lock()  # one reader of the start's answer (a compile thread, the reaper)
        self.last_used = time.monotonic()

    def ready(self, timeout: float) -> bool:
        """Whether the worker has started, waiting up to ``timeout`` seconds;
        WorkerError if it failed to or takes far too long."""
        with self._starting:
            return self._ready(timeout)

    def _ready(self, timeout: float) -> bool:
        if not self.is_ready:
            try:
                if _readable(self.proc.stdout.fileno(), timeout):
                    if _read_message(self.proc.stdout.fileno()) != "ready":
                        raise EOFError("unexpected answer")
                    self.is_ready = True
                elif time.monotonic() - self.started > _BOOT_TIMEOUT_S:
                    raise TimeoutError(f"no answer in {_BOOT_TIMEOUT_S:.0f} s")
            except Exception as e:
                self.close()
                raise WorkerError(f"compile worker did not start ({type(e).__name__}: {e})") from e
        return self.is_ready

    def compile(self, module_key, payload: bytes, job: dict) -> _Compiled:
        """Compile ``job`` (``_worker_compile``'s arguments) in the worker."""
        with self.lock:
            reply = self._run(module_key, payload, job)
            self.last_used = time.monotonic()
        if reply[0] != "ok":
            raise WorkerError(reply[1])
        return _Compiled(_namespace(reply[1]), reply[2])

    def _run(self, module_key, payload: bytes, job: dict) -> tuple:
        if not self.alive:
            raise WorkerError("compile worker closed")
        self.ready(_BOOT_TIMEOUT_S)
        for send in (module_key not in self.modules, True):  # again with the module if the worker dropped it
            try:
                message = pickle.dumps((module_key, payload if send else None, job), protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # a constexpr that does not pickle: this job only
                raise WorkerError(f"job cannot go to a compile worker ({type(e).__name__}: {e})") from e
            try:
                _write_frame(self.proc.stdin.fileno(), message)
                self.modules.add(module_key)
                reply = _read_message(self.proc.stdout.fileno())
            except Exception as e:
                self.close()
                raise WorkerError(f"compile worker failed ({type(e).__name__}: {e})") from e
            if reply[0] != "missing":
                break
        return reply

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the worker: its pipe closed it exits; one still starting (it
        holds nothing yet) or that does not exit is killed."""
        if self.owner != os.getpid():  # a fork's copy: the parent's worker
            return
        if not self.is_ready and self.proc.poll() is None:
            self.proc.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_threads = threading.local()  # each compile thread's Worker
_workers: list[Worker] = []
_spares: list[Worker] = []  # started by ``prestart``, no thread's yet
_workers_lock = threading.Lock()
_boot_failures = 0
# While a thread's worker starts (a fifth of a second), one thread at a time
# compiles a kernel of few parameters on its own instead of waiting: a small
# program does not wait for a worker. A kernel of many parameters (a combo
# kernel) has a long frontend, which is what the worker keeps off the GIL.
_local_while_starting = threading.Lock()
_LOCAL_MAX_PARAMS = 32


def compile_job(module: tuple[tuple, bytes] | None, job: dict, here):
    """``job`` (``_worker_compile``'s arguments) compiled by the calling
    thread's worker, for the module ``module_payload`` gave; ``here()`` (the
    same compile on this thread) where there is no worker, while it starts and
    another thread is not already compiling, or when it fails: what ``here``
    raises is what the caller sees."""
    worker = _thread_worker() if module is not None else None
    if worker is None:
        return here()
    try:
        if len(job["signature"]) <= _LOCAL_MAX_PARAMS and not worker.ready(0) \
                and _local_while_starting.acquire(blocking=False):
            try:
                return here()
            finally:
                _local_while_starting.release()
        return worker.compile(*module, job)
    except WorkerError as e:
        if not worker.alive:
            _count_failure(worker)
        log.debug("pallaskit: %s compiles on its thread (%s)", job.get("name"), e)
        return here()


def _thread_worker() -> Worker | None:
    """The calling thread's compile worker: a spare one ``prestart`` started
    (a ready one first), else one started now (and again if it died); None
    where workers cannot run (no POSIX pipes, or they failed to start)."""
    worker = getattr(_threads, "worker", None)
    if worker is not None and worker.owner == os.getpid() and worker.alive:
        return worker
    worker = _take_spare() or _start_worker()
    _threads.worker = worker
    return worker


def _take_spare() -> Worker | None:
    """A spare worker, one that has started if any has, now the caller's alone."""
    while True:
        with _workers_lock:
            spares = [w for w in _spares if w.alive]
        if not spares:
            return None
        pick = spares[0]
        for worker in spares:
            try:
                if worker.ready(0):
                    pick = worker
                    break
            except WorkerError:  # it failed to start, and is closed
                _count_failure(worker)
        with _workers_lock:
            if pick in _spares:  # not taken by another thread meanwhile
                _spares.remove(pick)
                if pick.alive:
                    return pick


def prestart(n: int) -> None:
    """Start compile workers until this process has ``n`` (spares, taken by
    compile threads that have none), so that a program's first compiles
    find them started: called as a GPU compile begins, before its passes."""
    with _workers_lock:
        missing = n - sum(1 for w in _workers if w.owner == os.getpid() and w.alive)
    for _ in range(missing):
        worker = _start_worker()
        if worker is None:
            return
        with _workers_lock:
            _spares.append(worker)


def _start_worker() -> Worker | None:
    """A new worker, closed at exit and when idle (the reaper); None where
    workers cannot run."""
    global _reaper
    if os.name != "posix" or _boot_failures >= _MAX_BOOT_FAILURES:
        return None
    try:
        worker = Worker()
    except Exception as e:  # noqa: BLE001 - no subprocess here: compile on the threads
        _count_failure(None)
        log.debug("pallaskit: no compile worker (%s: %s)", type(e).__name__, e)
        return None
    with _workers_lock:
        if not _workers:
            import atexit

            atexit.unregister(_shutdown_all)
            atexit.register(_shutdown_all)
        _workers[:] = [w for w in _workers if w.owner == os.getpid() and w.alive] + [worker]
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="pallaskit-triton-worker-reaper", daemon=True)
            _reaper.start()
    return worker


_reaper: threading.Thread | None = None


def _reap() -> None:
    """Close workers idle for ``_IDLE_S`` and reap those that died."""
    while True:
        time.sleep(_REAP_EVERY_S)
        with _workers_lock:
            workers = list(_workers)
        for worker in workers:
            if worker.lock.acquire(blocking=False):  # not in a job
                try:
                    if not worker.alive or (worker.ready(0) and time.monotonic() - worker.last_used > _IDLE_S):
                        worker.close()
                except WorkerError:  # it failed to start, and is closed
                    pass
                finally:
                    worker.lock.release()
        with _workers_lock:
            _workers[:] = [w for w in _workers if w.alive]
            _spares[:] = [w for w in _spares if w.alive]


def _after_fork() -> None:
    """A forked child starts its own workers, with locks no parent thread holds."""
    global _threads, _workers, _spares, _workers_lock, _local_while_starting, _payloads_lock, _reaper
    _threads, _workers, _spares, _workers_lock, _reaper = threading.local(), [], [], threading.Lock(), None
    _local_while_starting, _payloads_lock = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _count_failure(worker: Worker | None) -> None:
    """A worker that never started or died counts toward turning workers off."""
    global _boot_failures
    with _workers_lock:
        if worker is None or not worker.is_ready or worker.proc.returncode not in (0, None):
            _boot_failures += 1


def _shutdown_all() -> None:
    """Close every worker of this process (at exit)."""
    with _workers_lock:
        workers, _workers[:], _spares[:] = list(_workers), [], []
    for worker in workers:
        worker.close()


# (file name, module name) -> (what the module held: its functions by identity,
# aliases, imports, constants; the payload's key and bytes). A module whose
# functions or constants changed since (reloaded, a constant reassigned) gets
# a new payload under a new key, which workers rebuild afresh.
_payloads: dict = {}
_payloads_lock = threading.Lock()
_MAX_PAYLOADS = 64


def module_payload(fn) -> tuple[tuple, bytes] | None:
    """(key, pickled payload) from which a worker rebuilds ``fn``'s module
    (``_Module``): every top-level ``@triton.jit`` function of it with its
    source and first line, the triton modules and objects and the plain
    constants it names. None when ``fn`` is not a top-level function of its
    module, or its module cannot be described (it compiles on the thread)."""
    try:
        return _module_payload(fn)
    except Exception as e:  # noqa: BLE001
        log.debug("pallaskit: %s's module cannot go to a compile worker (%s: %s)", getattr(fn, "__name__", fn),
                  type(e).__name__, e)
        return None


def _module_payload(fn) -> tuple[tuple, bytes] | None:
    import hashlib
    import weakref

    from triton.runtime.jit import JITFunction

    scope = fn.__globals__
    if scope.get(fn.__name__) is not fn:
        return None
    functions, aliases, imports, constants = {}, {}, {}, {}
    for name, value in list(scope.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, JITFunction):
            if value.__globals__ is not scope or value.__qualname__ != value.__name__:
                continue  # nested, or another module's: not rebuilt (its users compile on the thread)
            if value.__name__ == name:
                functions[name] = value
            else:
                aliases[name] = value.__name__
        elif isinstance(value, types.ModuleType):
            if value.__name__.split(".")[0] in ("triton", "math"):
                imports[name] = (value.__name__, None)
        elif getattr(value, "__module__", None) and str(value.__module__).startswith("triton") \
                and hasattr(value, "__qualname__") and "<" not in value.__qualname__:
            imports[name] = (value.__module__, value.__qualname__)  # triton.jit imported by name
        elif isinstance(value, (bool, int, float, str, type(None))) or type(value).__name__ == "constexpr":
            constants[name] = value
    where = (fn.fn.__code__.co_filename, fn.__module__)
    with _payloads_lock:
        known = _payloads.get(where)
    if known is not None:
        refs, held, key, data = known
        if held == (aliases, imports, constants) and refs.keys() == functions.keys() \
                and all(ref() is functions[name] for name, ref in refs.items()):
            return key, data
    payload = {"filename": where[0], "module": where[1], "aliases": aliases, "imports": imports,
               "constants": constants, "functions": [(name, f.starting_line_number, "".join(f.raw_src))
                                                     for name, f in functions.items()]}
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    key = (*where, hashlib.sha256(data).hexdigest())
    with _payloads_lock:
        _payloads.pop(where, None)
        if len(_payloads) >= _MAX_PAYLOADS:
            _payloads.pop(next(iter(_payloads)))
        _payloads[where] = ({name: weakref.ref(f) for name, f in functions.items()}, (aliases, imports, constants),
                            key, data)
    return key, data


class _Module:
    """A module ``module_payload`` describes, rebuilt in a worker: its file's
    lines in linecache (what ``@triton.jit`` reads), and each function defined
    when a kernel first needs it, with the functions it names (a program's
    kernel reads a few of its hundreds)."""

    def __init__(self, payload: dict):
        import importlib
        import linecache

        self.filename = payload["filename"]
        self.texts = {name: (start, text if text.endswith("\n") else text + "\n")
                      for name, start, text in payload["functions"]}
        self.aliases = payload["aliases"]
        lines: list[str] = []
        for start, text in self.texts.values():
            body = text.splitlines(True)
            end = start - 1 + len(body)
            if len(lines) < end:
                lines.extend(["\n"] * (end - len(lines)))
            lines[start - 1:end] = body
        linecache.cache[self.filename] = (sum(map(len, lines)), None, lines, self.filename)
        register_sources(self.filename, lines)  # kept: the module's functions are defined when first needed
        self.namespace: dict = {"__name__": payload["module"]}
        for name, (module, attr) in payload["imports"].items():
            value = importlib.import_module(module)
            for part in (attr.split(".") if attr else ()):
                value = getattr(value, part)
            self.namespace[name] = value
        self.namespace.update(payload["constants"])
        self.defined: set[str] = set()

    def function(self, name: str):
        """``name``'s function, defined with every function its source names, transitively."""
        import re

        todo, seen = [name], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in self.aliases:
                todo.append(self.aliases[n])
            elif n in self.texts and n not in self.defined:
                start, text = self.texts[n]
                # at its own line of the same file: Triton's line info and the PTX are the thread's
                exec(compile("\n" * (start - 1) + text, self.filename, "exec"), self.namespace)
                self.defined.add(n)
                todo.extend(w for w in set(re.findall(r"[A-Za-z_]\w*", text))
                            if w != n and (w in self.texts or w in self.aliases))
        for alias, target in self.aliases.items():
            if target in self.defined:
                self.namespace[alias] = self.namespace[target]
        return self.namespace[name]


def _worker_compile(module: _Module, name: str, signature: dict, constexprs: dict, options: dict, target: tuple,
                    until: str) -> _Compiled:
    from triton.backends.compiler import GPUTarget

    return _compile_uncached(ast_source(module.function(name), signature, constexprs), GPUTarget(*target), options,
                             until)


def _worker_main() -> None:
    """A compile worker's loop: (module key, payload or None, job) in, ("ok",
    metadata, binary) or ("error", text) out, until its input closes."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle; it closes the pipe
    out = os.dup(1)
    os.dup2(2, 1)  # anything printed goes to stderr, not into the replies
    import triton  # noqa: F401
    import triton.compiler.code_generator  # noqa: F401
    import triton.compiler.compiler  # noqa: F401

    fast_sources()  # [Note: function sources without the tokenizer]
    try:
        _serve(out)
    except (EOFError, OSError):  # the parent closed the pipe, or is gone
        pass


def _serve(out: int) -> None:
    import traceback

    modules: dict = {}
    _write_message(out, "ready")
    while True:
        if not _readable(0, 2 * _IDLE_S):
            return  # the parent should have closed it: it is stuck or gone
        key, payload, job = _read_message(0)
        if payload is None and key not in modules:
            _write_message(out, ("missing", None))
            continue
        try:
            if payload is not None:
                if len(modules) >= _WORKER_MODULES:
                    modules.pop(next(iter(modules)))
                try:
                    modules[key] = _Module(pickle.loads(payload))
                except Exception as e:  # noqa: BLE001 - every job of this module fails the same way
                    modules[key] = e
            module = modules[key]
            if isinstance(module, Exception):
                raise module
            compiled = _worker_compile(module, **job)
            reply = ("ok", vars(compiled.metadata), compiled.cubin)
        except Exception as e:  # noqa: BLE001 - sent back; the parent compiles the job itself
            reply = ("error", "".join(traceback.format_exception_only(type(e), e)).strip())
        _write_message(out, reply)
