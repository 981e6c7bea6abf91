"""The on-disk graph cache: a second process running the same function
compiles nothing.

[Note: graph cache]
An entry is keyed by a content hash of everything the compiled program depends
on (``key_parts``, ``key_of``): the jaxpr's text ([Note: the jaxpr's key text]) and the bytes of its constants, the input
avals (weak types included), the static arguments, every compile option
(``CompileOptions.key()``), the versions of pallaskit, jax, jaxlib, the CUDA
plugin and triton, a hash of pallaskit's own source (so an edited compiler never
serves stale code; read once per source state, see [Note: environment stamp]),
the device kind, and the XLA flags.

[Note: the warm path]
A first call on a signature traces the function (``jax.make_jaxpr``), hashes
the jaxpr's key text with the rest of the key, reads and checks the entry in one
read, and deserializes the executable. It does not lower to StableHLO (JAX's
persistent cache must, to compute its key), does not import the compiler's
passes, sympy or Pallas (``lowering`` loads them on first compilation), and
does not run the compiler. Tracing is not skipped: what the function computes
depends on the globals, closures and callees it reads, in this process, and
only a trace sees them (JAX's cache traces too). Where the time goes:
``metrics.counters`` ``trace_seconds``, ``cache_key_seconds``,
``cache_read_seconds``, ``cache_load_seconds``; ``python -m
benchmarks.compile_cache`` prints them beside jax.jit's.

An entry holds the generated source, the compiled executable (XLA's own
serialization through ``jax.experimental.serialize_executable``: on the GPU the
Triton kernels are in that executable, so it is the kernel bundle the way
Inductor's TritonBundler keeps cubins; with jaxlib newer than 0.10.2, Pallas
stores them as PTX, which jaxlib assembles with ptxas at their first launch in
each process), the hoisted constants, the
metric deltas to replay on a hit (``metrics.COMPILE_DELTA_NAMES``), the
kernel_metadata rows, and the multi-kernel choices (empty until the dispatcher
exists). If the executable cannot be serialized the entry keeps the source
only, says why in ``executable_error``, and a hit recompiles from that source.

Files: ``<cache_dir>/graphs/<key>.entry``, each ``MAGIC``, one JSON header line
(format, key, payload size and sha256) and a pickled payload. Writes go to a
temporary file in the same directory and are moved in place with
``os.replace``; a reader verifies magic, format, size, checksum, key and the key
parts, so a truncated, corrupted or foreign entry is logged once, recompiled and
overwritten. Writers of one key serialize on a lock file (``locks/``, one of 256
by key prefix) and look again under the lock, so processes racing on a function
compile it once and leave one entry. The total size is capped; hits refresh an
entry's mtime, and the oldest mtimes are evicted first (LRU).

Entries are pickles: like JAX's own executable cache, only point the cache at
directories you trust.

This package stores and loads (keys, the file format, locks, eviction); it
never compiles. ``pallaskit/compile.py`` asks it for an entry (``load``) and
gives it one to keep (``store``); ``pallaskit/executable.py`` turns an entry's
bytes into an executable and back.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import platform
import re
import sys
import threading
import time
import uuid
from typing import Any, Callable

import filelock
import jax
import numpy as np

from pallaskit import executable, sharding, signature
from pallaskit.config import config

log = logging.getLogger("pallaskit")

FORMAT = 1  # bump when the entry layout changes
MAGIC = b"pallaskit-graph-cache\n"
SUFFIX = ".entry"
LOCK_TIMEOUT_S = 600.0  # a writer waits this long for another process compiling the same key
RACY_S = 5.0  # an environment stamp vouches only for files unchanged this long (see environment())
STAMP_MAX_AGE_S = 30 * 86400.0  # eviction deletes environment stamps written longer ago than this
_SOURCE_PACKAGES = ("pallaskit", "lowering")  # their .py files are hashed into every key
_DISTRIBUTIONS = ("triton", "jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------- #
# Where
# --------------------------------------------------------------------------- #
def default_cache_dir() -> str:
    try:
        import platformdirs
    except ImportError:  # an image without it (the GPU machine): the XDG default
        return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pallaskit")
    return platformdirs.user_cache_dir("pallaskit")


def cache_dir() -> str:
    return config.cache_dir or default_cache_dir()


def graphs_dir() -> str:
    return os.path.join(cache_dir(), "graphs")


def entry_path(key: str) -> str:
    return os.path.join(graphs_dir(), key + SUFFIX)


def env_dir() -> str:
    return os.path.join(cache_dir(), "env")


def enabled() -> bool:
    return bool(config.cache)


# [Note: function markers]
# ``functions/<digest>``: an empty file per user function that has run with the
# cache on, named by the digest of its module, qualified name, file and
# bytecode. ``pallaskit.jit(f)`` asks for it to tell a process that will likely
# serve ``f`` from the cache (no compiler import wanted: [Note: compiler
# preload] in runtime/preload.py) from one that will compile it. A hint, not a
# key: a stale marker (its entries evicted, or a callee changed) only means
# the compiler is imported by the first compile, as without the preload.
def function_marker(fn) -> str | None:
    """The marker's path for ``fn``; None for a callable without bytecode (a
    ``functools.partial``, a callable object) or with the cache off."""
    code = getattr(fn, "__code__", None)
    if code is None or not enabled():
        return None
    name = f"{getattr(fn, '__module__', '')}\0{getattr(fn, '__qualname__', '')}\0{code.co_filename}\0"
    digest = hashlib.sha256(name.encode() + code.co_code).hexdigest()[:32]
    return os.path.join(cache_dir(), "functions", digest)


def holds_function(fn) -> bool:
    path = function_marker(fn)
    return path is not None and os.path.exists(path)


def mark_function(fn) -> None:
    path = function_marker(fn)
    if path is None or os.path.exists(path):
        return
    try:
        _write_atomic(path, b"")
    except OSError as e:  # a read-only or full disk: the hint is lost, nothing else
        log.debug("pallaskit cache: no marker for %s (%s)", getattr(fn, "__qualname__", fn), e)


# --------------------------------------------------------------------------- #
# The key
# --------------------------------------------------------------------------- #
def versions() -> dict:
    """Versions of what compiles and runs the program: pallaskit, jax, jaxlib,
    Python, and the installed triton / CUDA plugin distributions (these from
    the environment stamp, see ``environment``)."""
    import jaxlib

    from pallaskit.version import __version__

    return {"pallaskit": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "python": platform.python_version(), **environment()["versions"]}


def code_hash() -> str:
    """Content hash of pallaskit's and the compiler's source files."""
    return environment()["code"]


def _source_files() -> list[tuple[str, os.DirEntry]]:
    """(path relative to the root, DirEntry) of the .py files of pallaskit and the compiler, sorted."""
    files, folders = [], list(_SOURCE_PACKAGES)
    while folders:
        rel = folders.pop()
        try:
            listing = list(os.scandir(os.path.join(_PACKAGE_ROOT, rel)))
        except OSError:
            continue
        for e in listing:
            if e.name.endswith(".py"):
                files.append((f"{rel}/{e.name}", e))
            elif e.name != "__pycache__" and e.is_dir():
                folders.append(f"{rel}/{e.name}")
    return sorted(files, key=lambda f: f[0])


def _content_hash(files) -> str:
    h = hashlib.sha256()
    for rel, e in files:
        h.update(rel.encode())
        with open(e.path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _dist_versions() -> tuple[dict, list[str]]:
    """({name: version} of the tracked distributions installed, the
    directories they are installed in)."""
    versions, dirs = {}, set()
    for name in _DISTRIBUTIONS:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        versions[name] = dist.version
        dirs.add(os.path.abspath(str(dist.locate_file(""))))
    return versions, sorted(dirs)


def _site_dirs() -> list[str]:
    """The ``sys.path`` directories distributions are installed into. Not the
    script's or the working directory, nor other PYTHONPATH entries: programs
    write into those all the time, and a stamp keyed by their mtimes would
    never hold. A tracked distribution installed in one of them is watched
    through that directory, which its stamp names (``dist_dirs``)."""
    return [p for p in sys.path if os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")]


def _stat_line(path: str) -> tuple[str, int]:
    """(size, mtime, ctime and inode of ``path`` as text, its newest timestamp in ns)."""
    try:
        st = os.stat(path)
    except OSError:
        return f"{path} missing", 0
    return f"{path} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}", max(st.st_mtime_ns, st.st_ctime_ns)


def stat_signature() -> tuple[str, str, int]:
    """(sources, whole, newest) for the files ``environment`` reads: hashes of
    the size, mtime, ctime and inode of every source file, and of those with
    the site directories' (installing or removing a distribution changes its
    directory's mtime), and the newest of their timestamps (ns)."""
    lines, newest = [_PACKAGE_ROOT], 0
    for rel, e in _source_files():
        try:
            st = e.stat()
        except OSError:
            lines.append(f"{rel} missing")
            continue
        lines.append(f"{rel} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}")
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
    sources = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    lines += [sys.version, repr(sys.path)]
    for p in _site_dirs():
        line, t = _stat_line(p)
        lines.append(line)
        newest = max(newest, t)
    return sources, hashlib.sha256("\n".join(lines).encode()).hexdigest(), newest


@functools.lru_cache(maxsize=None)
def environment() -> dict:
    """The key's environment part, once per process: ``code`` (content hash of
    the sources) and ``versions`` (installed triton / CUDA plugin distributions).

    [Note: environment stamp] Reading every source file and asking
    importlib.metadata for five distributions is a visible part of every warm
    first call (RESULTS.md, "Compile cache"). A stamp ``<cache_dir>/env/<sig>.json``
    keeps the result under the stat signature of the files it depends on
    (``stat_signature``), so a process whose files are unchanged only stats
    them. An edit gives a file a new mtime/ctime (and an
    editor's save-by-rename a new inode), a new signature, a new stamp: the
    content hash is recomputed and an entry of the old sources can no longer
    match. As with git's racily clean index entries, a stamp is only written
    once every file it vouches for is older than ``RACY_S``: a file changed
    twice within one tick of the filesystem clock keeps its timestamps, and
    must not be trusted until that tick is safely past. Python's own .pyc check
    (mtime in seconds and size) is weaker than this signature."""
    sources, sig, newest = stat_signature()
    path = os.path.join(env_dir(), sig + ".json")
    try:
        with open(path) as f:
            env = json.load(f)
        if (env.get("sig") == sig and env.get("check") == _stamp_check(env)
                and all(_stat_line(d)[0] == line for d, line in env["dist_dirs"].items())):
            return dict(env, sources=sources)
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        pass  # none yet, unreadable, or a distribution directory changed: computed and written again
    versions, dirs = _dist_versions()
    dist_dirs = {d: _stat_line(d) for d in dirs}
    env = {"sig": sig, "code": _content_hash(_source_files()), "versions": versions,
           "dist_dirs": {d: line for d, (line, _) in dist_dirs.items()}}
    env["check"] = _stamp_check(env)
    newest = max([newest] + [t for _, t in dist_dirs.values()])
    if time.time_ns() - newest > RACY_S * 1e9 and stat_signature()[1] == sig:  # unchanged while hashing
        try:
            _write_atomic(path, json.dumps(env, sort_keys=True).encode())
        except OSError as e:  # a read-only cache: hash every process
            log.debug("pallaskit cache: cannot write %s (%s)", path, e)
    return dict(env, sources=sources)


def _stamp_check(env: dict) -> str:
    return hashlib.sha256(json.dumps([env["sig"], env["code"], env["versions"], env["dist_dirs"]],
                                     sort_keys=True).encode()).hexdigest()


def _write_atomic(path: str, data: bytes) -> None:
    """Write a file through a temporary one and ``os.replace``; raises OSError."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{uuid.uuid4().hex}{os.path.splitext(path)[1]}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        # No fsync: a file cut short by a crash fails its checks and is rewritten, never used.
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@functools.lru_cache(maxsize=None)
def pack_checked(fmt: int, body: bytes, **header) -> bytes:
    """A header line (JSON: ``format``, the body's sha256, ``header``) and the body:
    what the eager program and kernel caches write (runtime/eager.py, triton_launch.py)."""
    head = dict(header, format=fmt, sha256=hashlib.sha256(body).hexdigest())
    return json.dumps(head, sort_keys=True).encode() + b"\n" + body


def read_checked(path: str, fmt: int) -> tuple[dict, bytes] | None:
    """(header, body) of a ``pack_checked`` file; None when it does not exist;
    OSError when unreadable, ValueError when torn, foreign or stale."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    if header.get("format") != fmt or hashlib.sha256(body).hexdigest() != header.get("sha256"):
        raise ValueError("checksum or format mismatch")
    try:
        os.utime(path)  # recently used: eviction takes the least recently used first
    except OSError:
        pass  # a read-only cache
    return header, body


def _cpu_fingerprint() -> str:
    """XLA's CPU code is built for the host's instruction set."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name", "Features")):
                    text += line
                if line.strip() == "":
                    break  # the first processor is enough
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def device_info() -> dict:
    d = jax.devices()[0]
    info = {"platform": d.platform, "device_kind": d.device_kind,
            "platform_version": getattr(d.client, "platform_version", "")}
    if d.platform == "cpu":
        info["cpu"] = _cpu_fingerprint()
    return info


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _static_text(v) -> str:
    """Static argument text without object addresses: a static function is
    named by module and qualified name (what it computes is in the jaxpr)."""
    v = getattr(v, "value", v)
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
    return _ADDRESS.sub("", repr(v))


def _nested_consts(closed_jaxpr) -> list:
    """The constants of ``closed_jaxpr`` and of every closed jaxpr in its
    equations' parameters, at any depth. A nested ``jax.jit`` keeps the arrays
    its function closed over in its own closed jaxpr, whose text shows their
    types only: two functions differing in such a constant had one key, and the
    second got the first one's compiled result."""
    # The classes of the traced program itself (the warm path imports nothing more: [Note: the warm path]).
    closed_type, jaxpr_type = type(closed_jaxpr), type(closed_jaxpr.jaxpr)
    consts, seen = list(closed_jaxpr.consts), set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, closed_type) and id(sub) not in seen:
                        seen.add(id(sub))
                        consts.extend(sub.consts)
                        walk(sub.jaxpr)
                    elif isinstance(sub, jaxpr_type) and id(sub) not in seen:
                        seen.add(id(sub))
                        walk(sub)

    walk(closed_jaxpr.jaxpr)
    return consts


# [Note: the jaxpr's key text]
# The key hashes a text of the jaxpr written here rather than jax's pretty printer
# (``str(closed_jaxpr)``), which builds and lays out a document per equation: on a
# 1000-array optimizer update it was most of the key's time. The text holds at least
# what jax's does: each equation's primitive, every parameter (jax's custom rules
# hide some: ``accuracy=None``, a jit's defaults; here all are written, sorted by
# name, as ``str`` with object addresses masked, as jax writes the rest), its
# operands and results, each binder's type (``str_short``, as jax writes it) and weak
# type (which jax leaves out), scalar literals' values and types, a non-scalar
# literal's bytes (jax writes ``[...]``), nested jaxprs in full (each written once:
# a jaxpr met again is referred to by its number). Variables are numbered in the
# order they are bound. Only a jaxpr's text is hashed: its constants' bytes are
# hashed apart (``_consts_hash``).
def jaxpr_text(closed_jaxpr) -> str:
    """The jaxpr's text for the cache key ([Note: the jaxpr's key text])."""
    from jax._src import core as jax_core

    literal, drop, jaxpr_type = jax_core.Literal, jax_core.DropVar, jax_core.Jaxpr
    closed_type = type(closed_jaxpr)
    types: dict[int, str] = {}  # id(aval) -> text (the jaxpr keeps every aval alive while this runs)
    params_text: dict[int, str] = {}  # id(value) -> text, for the values that are not jaxprs
    jaxprs: dict[int, int] = {}  # id(jaxpr) -> its number
    out: list[str] = []
    write = out.append

    def typed(aval) -> str:
        t = types.get(id(aval))
        if t is None:
            t = aval.str_short(short_dtypes=True) + ("~w" if getattr(aval, "weak_type", False) else "")
            types[id(aval)] = t
        return t

    def atom(x, names) -> str:
        if type(x) is literal:
            v = np.asarray(x.val)
            if v.shape:
                return f"lit[{hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()}]:{typed(x.aval)}"
            item = v.item()
            if isinstance(item, (float, complex)):  # repr writes every NaN as nan: sign and payload are in the bits
                return f"{item!r}/{v.tobytes().hex()}:{typed(x.aval)}"
            return f"{item!r}:{typed(x.aval)}"
        n = names.get(x)
        return "?" if n is None else n  # a free variable: jax's own check rejects such a jaxpr

    def bind(vs, names) -> str:
        parts = []
        for v in vs:
            if isinstance(v, drop):
                parts.append("_:" + typed(v.aval))
            else:
                n = names[v] = f"v{len(names)}"
                parts.append(f"{n}:{typed(v.aval)}")
        return " ".join(parts)

    def param(v) -> None:
        if isinstance(v, closed_type):
            v = v.jaxpr
        if isinstance(v, jaxpr_type):
            sub(v)
        elif type(v) is tuple and v and all(isinstance(j, (jaxpr_type, closed_type)) for j in v):
            write("(")
            for j in v:
                param(j)
            write(")")
        else:
            t = params_text.get(id(v))
            if t is None:
                s = (f"frozenset({{{', '.join(repr(e) for e in sorted(v))}}})" if isinstance(v, frozenset)
                     else str(v))
                t = params_text[id(v)] = _ADDRESS.sub(" at 0x", s) + sharding.devices_text(v)
            write(t)

    def sub(jaxpr) -> None:
        number = jaxprs.get(id(jaxpr))
        if number is not None:
            write(f"{{#{number}}}")
            return
        jaxprs[id(jaxpr)] = len(jaxprs)
        names: dict = {}
        write("{" + bind(jaxpr.constvars, names) + "; " + bind(jaxpr.invars, names) + ".\n")
        for eqn in jaxpr.eqns:
            write(bind(eqn.outvars, names) + " = " + eqn.primitive.name + "[")
            params = eqn.params
            for k in sorted(params):
                write(k + "=")
                param(params[k])
                write(" ")
            write("] " + " ".join([atom(x, names) for x in eqn.invars]) + "\n")
        write("in " + " ".join([atom(x, names) for x in jaxpr.outvars]) + "}")

    sub(closed_jaxpr.jaxpr)
    return "".join(out)


def _consts_hash(consts) -> str:
    h = hashlib.sha256()
    for c in consts:
        a = np.asarray(jax.random.key_data(c) if executable.is_key(c) else c)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def key_parts(closed_jaxpr, avals, static_args, options) -> dict:
    """Everything the compiled program depends on, as JSON-able text."""
    return {
        "format": FORMAT,
        "jaxpr": hashlib.sha256(jaxpr_text(closed_jaxpr).encode()).hexdigest(),
        "consts": _consts_hash(_nested_consts(closed_jaxpr)),
        "avals": [f"{a.str_short()}{' weak' if getattr(a, 'weak_type', False) else ''}" for a in avals],
        "static": [[str(k), _static_text(v)] for k, v in static_args],
        "options": options.key(),
        "versions": versions(),
        "code": code_hash(),
        "device": device_info(),
        "default_device": sharding.default_device().id,  # where an executable of uncommitted arrays runs
        "xla": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "compiler_options": executable.compiler_options(),
                "matmul_precision": str(jax.config.jax_default_matmul_precision),
                "x64": bool(jax.config.jax_enable_x64)},
        "context": context_text(),
    }


def context_text() -> str:
    """jax's trace context (signature.context) as text: what JAX reads while
    lowering a program but the jaxpr's text does not show
    (``jax_threefry_partitionable`` sits in an equation's context, not its
    text; an extern's lowering reads the flags)."""
    from jax._src import config as jax_config

    values = jax_config.trace_context()
    try:
        names = jax_config.trace_context_names()
    except NotImplementedError:  # an older jaxlib: the values alone
        names = [str(i) for i in range(len(values))]
    # A mesh context is written by its names, sizes and axis types (an Explicit mesh's program
    # returns explicit shardings: a program of the Auto mesh over the same devices, served for
    # it, returned Auto ones), and its devices in order (a PartitionSpec resolved against a
    # mesh over the same devices in another order is another program); the axis environment
    # by its sizes.
    mesh = signature.concrete_mesh()
    return repr([(n, _ADDRESS.sub("", repr(v if hasattr(v, "axis_types") else getattr(v, "axis_sizes", v)))
                  + sharding.devices_text(v))
                 for n, v in zip(names, values)] + ([sharding.devices_text(mesh)] if mesh is not None else []))


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- #
# Entries
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class Entry:
    key: str
    parts: dict
    title: str
    source: str  # the generated module
    num_kernels: int
    has_externs: bool
    constants: list  # numpy arrays (typed PRNG keys as they are), passed after the dynamic leaves
    executable: bytes | None  # serialize_executable payload; None: source only
    in_tree: Any = None  # pytrees of the executable (from serialize_executable)
    out_tree: Any = None
    executable_error: str = ""  # why there is no executable
    metric_deltas: dict = dataclasses.field(default_factory=dict)
    kernels: list = dataclasses.field(default_factory=list)  # kernel_metadata rows
    multi_kernel_choices: dict = dataclasses.field(default_factory=dict)  # filled by the dispatcher, later
    created: float = 0.0
    # The executable's device ids in its assignment order (None: an older entry). A program
    # whose devices neither the default device nor the arguments name (jax.set_mesh's mesh,
    # a backward taking a sharded closure) loads on them, not on the default device.
    devices: list | None = None


class BadEntry(Exception):
    """An entry that must not be used: truncated, corrupted, or from another version."""


_reported: set = set()  # (path, reason) already logged


def report(path: str, reason: str, consequence: str = "ignoring %s (%s); recompiling and overwriting it"):
    """Log once per (path, reason); ``consequence``: the message, formatted with both."""
    if (path, reason) not in _reported:
        _reported.add((path, reason))
        log.warning("pallaskit cache: " + consequence, path, reason)


_NOT_KEPT = "cannot write in %s (%s); the program runs, its entry is not kept"


@dataclasses.dataclass(frozen=True)
class _KeyConstant:
    """A typed PRNG key among an entry's constants: it has no NumPy form, so its
    key data and its implementation's name are written instead."""
    impl: str
    data: np.ndarray


def _host_constant(c):
    if executable.is_key(c):
        return _KeyConstant(str(jax.random.key_impl(c)), np.asarray(jax.random.key_data(c)))
    return np.asarray(c)


def _constant(c):
    return jax.random.wrap_key_data(c.data, impl=c.impl) if isinstance(c, _KeyConstant) else c


def encode(entry: Entry) -> bytes:
    fields = {f.name: getattr(entry, f.name) for f in dataclasses.fields(entry)}  # shallow: no array copies
    fields["constants"] = [_host_constant(c) for c in entry.constants]
    payload = pickle.dumps(fields, protocol=pickle.HIGHEST_PROTOCOL)
    header = {"format": FORMAT, "key": entry.key, "size": len(payload),
              "sha256": hashlib.sha256(payload).hexdigest(), "title": entry.title,
              "executable": entry.executable is not None, "created": entry.created}
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def read_header(data: bytes) -> tuple[dict, bytes]:
    """Split and check an entry's bytes; raises BadEntry."""
    if not data.startswith(MAGIC):
        raise BadEntry("not a cache entry" if data else "empty file")
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        raise BadEntry("truncated header")
    try:
        header = json.loads(data[len(MAGIC):end])
    except ValueError:
        raise BadEntry("unreadable header") from None
    if header.get("format") != FORMAT:
        raise BadEntry(f"entry format {header.get('format')!r}, this pallaskit reads {FORMAT}")
    payload = data[end + 1:]
    if len(payload) != header.get("size"):
        raise BadEntry(f"truncated: {len(payload)} of {header.get('size')} payload bytes")
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise BadEntry("checksum mismatch")
    return header, payload


def decode(data: bytes, key: str | None = None, parts: dict | None = None) -> Entry:
    header, payload = read_header(data)
    if key is not None and header.get("key") != key:
        raise BadEntry("entry of another key")
    try:
        entry = Entry(**pickle.loads(payload))
        entry.constants = [_constant(c) for c in entry.constants]
    except Exception as e:  # noqa: BLE001 - anything unpicklable is a bad entry
        raise BadEntry(f"unreadable payload: {type(e).__name__}") from None
    if parts is not None and entry.parts != parts:
        diff = sorted(k for k in set(parts) | set(entry.parts) if parts.get(k) != entry.parts.get(k))
        raise BadEntry(f"written for other {', '.join(diff)}")
    return entry


def load(key: str, parts: dict | None = None) -> Entry | None:
    """The valid entry of ``key``, or None (missing, or bad: logged once).
    A hit refreshes the entry's mtime (the LRU clock)."""
    wait_written(key)
    path = entry_path(key)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        report(path, f"unreadable: {e}")
        return None
    try:
        entry = decode(data, key, parts)
    except BadEntry as e:
        report(path, str(e))
        return None
    try:
        os.utime(path)
    except OSError:
        pass
    return entry


def store(entry: Entry, path: str | None = None) -> bool:
    """Write the entry atomically (to ``path``: its ``entry_path`` when the
    write was asked for, as the cache folder may have changed since), then
    evict past the size cap."""
    path = path or entry_path(entry.key)
    folder = os.path.dirname(path)
    try:
        _write_atomic(path, encode(entry))
    except Exception as e:  # noqa: BLE001 - a cache that cannot write must not fail the user's call
        report(folder, f"{type(e).__name__}: {e}", _NOT_KEPT)
        return False
    try:
        evict()
    except Exception as e:  # noqa: BLE001 - the entry is written; an eviction that fails must not fail the call
        report(cache_dir(), f"{type(e).__name__}: {e}", "cannot evict in %s (%s); the cache may stay over its size cap")
    return True


def _lock(name: str, timeout: float = LOCK_TIMEOUT_S, thread_local: bool = True) -> filelock.FileLock:
    folder = os.path.join(cache_dir(), "locks")
    os.makedirs(folder, exist_ok=True)
    return filelock.FileLock(os.path.join(folder, name + ".lock"), timeout=timeout, thread_local=thread_local)


def key_lock(key: str, timeout: float = LOCK_TIMEOUT_S) -> filelock.FileLock:
    """The lock writers of ``key`` hold while compiling and until the entry is
    written (one of 256 files); released by the entry's writer thread
    ([Note: entries written behind the call]), hence not thread-local."""
    return _lock(key[:2], timeout, thread_local=False)


# [Note: entries written behind the call]
# A first call's new entry is serialized (``jax.experimental.serialize_executable``:
# XLA's executable, then a pickle of its argument and output descriptions) and
# written after the call has its executable. For adamw:1000 (4001 arguments)
# that serialization took 0.9 s of a 12.5 s first call on the H100 host, for
# nothing the call returns, so for a program of many arguments
# (``orchestrator.WRITE_BEHIND_MIN_ARGS``; a small one writes in the call, a few
# milliseconds) it runs on one writer thread (``write_behind``) while the call
# runs the program and returns. The writer takes its own hold on the key's
# lock (``key_lock``), so the lock stays held until the entry is on disk and another process
# compiling the same program waits and then hits, as before; the entry goes to
# the folder of the call that made it, whatever ``cache_dir`` is by then. In this process,
# ``load`` of a key waits for its pending write, ``stats`` and ``clear`` wait for
# all (``wait_written``), and so do a fork and the interpreter's exit (the
# executor's thread is joined then): an entry is lost only where the process is
# killed, and then the atomic write leaves no torn file.
_writer: concurrent.futures.ThreadPoolExecutor | None = None
_pending: dict[str, concurrent.futures.Future] = {}
_pending_lock = threading.Lock()


def write_behind(key: str, write: Callable[[], None], lock=None) -> None:
    """Run ``write()`` (which stores ``key``'s entry) on the writer thread,
    holding ``lock`` (the key's lock, held by the caller, who may release it
    now: the lock is reentrant and not thread-local) until it is done."""
    global _writer

    def job():
        try:
            write()
        except Exception as e:  # noqa: BLE001 - a cache that cannot write must not fail the user's call
            report(graphs_dir(), f"{type(e).__name__}: {e}", _NOT_KEPT)
        finally:
            if lock is not None:
                lock.release()
            with _pending_lock:  # a key has one pending write: load waits for it before compiling again
                _pending.pop(key, None)

    if lock is not None:
        lock.acquire()  # the writer's own hold
    with _pending_lock:
        if _writer is None:
            _writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="pallaskit-cache-writer")
        try:
            _pending[key] = _writer.submit(job)
            return
        except RuntimeError:  # the interpreter is shutting down: no new threads
            pass
    job()


def wait_written(key: str | None = None) -> None:
    """Return once ``key``'s pending entry (every pending entry: None) is written."""
    with _pending_lock:
        futures = list(_pending.values()) if key is None else [_pending[key]] if key in _pending else []
    for f in futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001 - reported by the job
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=wait_written)  # a child must not inherit a held key lock mid-write


def _entries() -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(graphs_dir()) if e.name.endswith(SUFFIX) and not e.name.startswith(".")]
    except FileNotFoundError:
        return []


def _evictable() -> list[os.DirEntry]:
    """What ``cache_max_bytes`` caps: graph entries, eager programs (``eager/``)
    and compiled raw-Triton kernels (``triton_kernels/``), one pool, least
    recently used first (a hit touches its file's mtime)."""
    found = _entries()
    for folder, suffix in (("eager", ".json"), ("triton_kernels", ".kernel")):
        try:
            found += [e for e in os.scandir(os.path.join(cache_dir(), folder))
                      if e.name.endswith(suffix) and not e.name.startswith(".")]
        except FileNotFoundError:
            pass
    return found


def evict(max_bytes: int | None = None) -> int:
    """Delete least recently used files (graph entries, eager programs, compiled
    kernels) until their total is within the cap; returns how many were deleted."""
    cap = config.cache_max_bytes if max_bytes is None else max_bytes
    removed = 0
    with _lock("evict"):
        _remove_old_files()
        files = []
        for e in _evictable():
            try:
                st = e.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, e.name, e.path, st.st_size))
        total = sum(f[3] for f in files)
        for _, _, path, size in sorted(files):
            if total <= cap:
                break
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as e:  # another user's file in a shared cache, a folder: kept, the next one goes
                log.debug("pallaskit cache: cannot evict %s (%s)", path, e)
                continue
            total -= size
    if removed:
        log.info("pallaskit cache: evicted %d files to stay under %d bytes", removed, cap)
    return removed


def _remove_old_files(tmp_age_s: float = 3600.0):
    """Temporary files of writers that died before their ``os.replace``, and
    environment stamps written more than ``STAMP_MAX_AGE_S`` ago (a process
    that still needs one writes it again)."""
    now = time.time()
    folders = ((graphs_dir(), None), (env_dir(), STAMP_MAX_AGE_S), (os.path.join(cache_dir(), "eager"), None),
               (os.path.join(cache_dir(), "triton_kernels"), None))
    for folder, age_s in folders:
        try:
            listing = list(os.scandir(folder))
        except FileNotFoundError:
            continue
        for e in listing:
            limit = tmp_age_s if e.name.startswith(".tmp-") else age_s
            try:
                if limit is not None and now - e.stat().st_mtime > limit:
                    os.unlink(e.path)
            except OSError:  # gone already, or not ours to delete
                pass


def stats() -> dict:
    wait_written()
    files = []
    for e in _entries():
        try:
            files.append((e.path, e.stat()))
        except FileNotFoundError:
            pass
    with_exe = bad = 0
    for path, _ in files:
        try:
            with open(path, "rb") as f:
                header, _ = read_header(f.read())
            with_exe += bool(header.get("executable"))
        except (BadEntry, OSError):
            bad += 1
    return {"dir": graphs_dir(), "entries": len(files), "bytes": sum(st.st_size for _, st in files),
            "max_bytes": config.cache_max_bytes, "with_executable": with_exe,
            "source_only": len(files) - with_exe - bad, "bad": bad}


def clear() -> int:
    """Delete every entry, environment stamp, multi-kernel choice file
    (``multi_kernel/``), compiled raw-Triton kernel (``triton_kernels/``), eager program
    (``eager/``), function marker (``functions/``) and stray temporary file; returns the
    count of entries."""
    wait_written()
    n = 0
    with _lock("evict"):
        for folder, suffix in ((graphs_dir(), SUFFIX), (env_dir(), ".json"),
                               (os.path.join(cache_dir(), "multi_kernel"), ".json"),
                               (os.path.join(cache_dir(), "triton_kernels"), ""),
                               (os.path.join(cache_dir(), "eager"), ".json"),
                               (os.path.join(cache_dir(), "functions"), "")):
            try:
                listing = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for e in listing:
                if e.name.endswith(suffix):
                    try:
                        os.unlink(e.path)
                        n += folder == graphs_dir() and not e.name.startswith(".")
                    except FileNotFoundError:
                        pass
    return n
