"""The orchestrator: one signature from its trace to an executable.

``compile_signature`` is the one path of a cold call: trace the user's function
(``trace``; ``trace_symbolic`` for dynamic dims) -> ``lowering.compile_jaxpr``
(the compiler, a pure function of the jaxpr and ``CompileOptions``) -> an
executable (``pallaskit/executable.py``: XLA's AOT compile of the generated
program, or a multi-kernel dispatcher / eager program for a symbolic graph).
A static signature asks the graph cache (``pallaskit/cache``, which only
stores and loads) for an entry before compiling and gives it the new one
after (``_serve``). ``JitFunction`` (api.py) calls in here; nothing in here
calls back into it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import time

import filelock
import jax

import lowering
from lowering import executors
from lowering.options import CompileOptions
from pallaskit import cache, executable, metrics, per_shard, shape_guards, sharding, signature
from pallaskit.config import config
from pallaskit.executable import Compiled
from pallaskit.runtime import eager, gc_pause, loader, multikernel, preload, xla_args, xla_warm

log = logging.getLogger("pallaskit")


# --------------------------------------------------------------------------- #
# Options
# --------------------------------------------------------------------------- #
def compile_options() -> CompileOptions:
    """The compiler's options from the effective configuration: every
    ``CompileOptions`` field named like a config option takes its value."""
    snap = config.snapshot()
    values = {f.name: snap[f.name] for f in dataclasses.fields(CompileOptions) if f.name in snap}
    if values.get("interpret") == "auto":
        values["interpret"] = jax.default_backend() == "cpu"
    values["num_sms"] = values.get("num_sms") or _num_sms()
    values["kernel_backend"] = _kernel_backend(snap)
    values["triton_available"] = (_triton_installed() if values["interpret"] else _cuda_with_triton())
    values["staged_rows"] = not values["interpret"] and values["triton_available"] and _staged_rows_gpu()
    loops = snap["loop_bodies"]
    values["loop_bodies"] = loops in ("on", "auto")
    values["loop_bodies_heavy_only"] = loops == "auto" and not values["interpret"]
    return CompileOptions(**values)


def _kernel_backend(snap: dict) -> str:
    """Option ``kernel_backend``, or what the deprecated ``triton_mix_kernels`` asks for."""
    old = snap["triton_mix_kernels"]
    if snap["kernel_backend"] != "auto" or old == "auto":
        return snap["kernel_backend"]
    _warn_triton_mix_kernels()
    return "triton" if old == "on" else "pallas"


@functools.lru_cache(maxsize=None)
def _warn_triton_mix_kernels():
    log.warning("pallaskit: option triton_mix_kernels is deprecated: use kernel_backend ('on' is 'triton', "
                "'off' is 'pallas')")


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def _cuda_with_triton() -> bool:
    """Is the default device a CUDA GPU and the optional ``triton`` package
    importable (checked without importing it)? Raw Triton kernels inside XLA
    go through jaxlib's CUDA Triton custom call (runtime/triton_call.py)."""
    device = jax.devices()[0]
    try:
        cuda = device.platform == "gpu" and "cuda" in device.client.platform_version.lower()
    except AttributeError:
        cuda = False
    return cuda and _triton_installed()


@functools.lru_cache(maxsize=None)
def _staged_rows_gpu() -> bool:
    """Does the default device take staged row kernels ([Note: staged rows] in
    lowering/codegen/rows.py: ``cp.async`` copies, up to 216 KB of shared
    memory a program)? Compute capability 9.x and 10.x (Hopper, data-centre
    Blackwell: 228 KB an SM, 227 KB a block); measured on the H100 and H200."""
    capability = str(getattr(jax.devices()[0], "compute_capability", "") or "")
    return capability.split(".")[0] in ("9", "10")


@functools.lru_cache(maxsize=None)
def _num_sms() -> int:
    """SMs of the default device (grid sizing); 4 on the CPU, where interpret
    mode runs programs one after another."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132) if device.platform == "gpu" else 4


# --------------------------------------------------------------------------- #
# Trace
# --------------------------------------------------------------------------- #
def trace(jf, structs, treedef, static_pos, static_kw, n_args):
    """(closed jaxpr of the flat dynamic leaves, output treedef) of the
    function at ``structs`` (one per flat dynamic leaf). Traced by
    ``jax.jit(fn).trace``, which keeps the function's signature: errors
    raised by the user's code name the function and its arguments."""
    full, kwargs = signature.full_args(structs, treedef, static_pos, static_kw, n_args)
    with signature.tracing():  # [Note: nested pallaskit functions]
        traced = jf._tracer.trace(*full, **kwargs)
    if getattr(traced, "_consts", None):  # jax lifts closed-over tracers to leading arguments
        raise signature.ClosedOverTracers("it closes over a tracer of an enclosing transformation or a mutable array")
    named = signature.batch_axes_named(traced.jaxpr)
    if named:  # only jax's own batching rules bind them (a custom_vmap rule is not told the name)
        raise signature.JaxOnly(f"a collective over the jax.vmap axis {', '.join(map(repr, named))}")
    return traced.jaxpr, jax.tree_util.tree_structure(traced.out_info)


def trace_symbolic(jf, structs, treedef, static_pos, static_kw, n_args):
    """``_trace`` at symbolic shapes, also returning the shape guards
    ([Note: shape equality guards]); raises when they cannot be recorded."""
    if not shape_guards.install_eq_recorder():
        raise lowering.SymbolicUnsupported("this jax's symbolic dims cannot be guarded")
    shape_guards.EQ_RECORD.diffs = diffs = []
    shape_guards.EQ_RECORD.hashed = hashed = []
    try:
        closed, out_tree = trace(jf, structs, treedef, static_pos, static_kw, n_args)
    finally:
        shape_guards.EQ_RECORD.diffs = shape_guards.EQ_RECORD.hashed = None
    if hashed:
        raise lowering.SymbolicUnsupported(f"the function {hashed[0]}, which no guard can check")
    return closed, out_tree, list({str(d): d for d in diffs}.values())


# --------------------------------------------------------------------------- #
# Compile one signature
# --------------------------------------------------------------------------- #
def compile_signature(jf, avals, treedef, static_pos, static_kw, n_args, aot=True, structs=None,
                      size_hints=(), variants=None, positions=(), first_sizes=None, xla=None,
                      traced=None, placement=None, compile_static=None, while_compiling=None) -> Compiled:
    """Trace and compile one signature. ``aot``: compile the executable now,
    through the on-disk graph cache (``pallaskit/cache``), where a hit skips
    the compiler and XLA (``Compiled.result`` is then None); otherwise only
    run the compiler and jit its program lazily (``explain``).
    ``structs``: symbolic input shapes ([Note: dynamic dims]); the graph is
    then compiled shape-generic, with ``size_hints`` for its heuristics,
    or once per entry of ``variants`` (size-hint tuples; ``positions``:
    (symbol, (leaf, axis)) of each symbol) behind a multi-kernel
    dispatcher when their sources differ. ``xla``: the signature's
    donation and shardings ([Note: XLA arguments]); ``traced``: (closed
    jaxpr, output treedef) when the caller traced already; ``placement``:
    the arguments' shardings ([Note: sharding] in pallaskit/sharding.py),
    which join ``xla`` for the lowering; ``compile_static``: leaves -> (executable,
    constants) of their size's static program, for an eager dispatcher's tier-up;
    ``while_compiling``: called with the closed jaxpr before JAX lowers and XLA
    compiles a static program (not on a cache hit).

    One path, no callbacks: trace -> the compiler (``build``) -> an executable
    (pallaskit/executable.py); the graph cache is asked for an entry first and
    given the new one after (``_serve``)."""
    options = compile_options()
    if size_hints:
        options = dataclasses.replace(options, size_hints=tuple(size_hints))
    t0 = time.perf_counter()
    symbolic = structs is not None
    if structs is None:
        structs = [sharding.struct_of(a) for a in avals]  # keeps shard_map's varying axes
    eq_guards = []
    if traced is not None:
        closed, out_tree = traced
    elif symbolic:
        closed, out_tree, eq_guards = trace_symbolic(jf, structs, treedef, static_pos, static_kw, n_args)
    else:
        context = sharding.trace_context(placement)

        def as_jax_traces():
            return trace(jf, [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=p)
                              for a, p in zip(avals, placement or (None,) * len(avals))], treedef, static_pos,
                         static_kw, n_args)[0]
        try:
            with context:
                closed, out_tree = trace(jf, structs, treedef, static_pos, static_kw, n_args)
        except signature.JaxOnly:
            raise
        except Exception as e:
            if isinstance(context, contextlib.nullcontext):
                raise
            # Traced over the Auto twin of an explicit mesh: code naming the explicit
            # mesh itself (a shard_map over it) refuses that context. Traced as
            # jax.jit traces it, it runs under JAX; an error there is the user's own.
            as_jax_traces()
            raise signature.JaxOnly(sharding.twin_refusal(e)) from e
        if not isinstance(context, contextlib.nullcontext) and sharding.twin_differs(closed, as_jax_traces()):
            raise signature.JaxOnly(sharding.twin_mismatch())  # [Note: the Auto twin's trace checked]
    out_tree_box = [out_tree]
    if xla is not None:
        xla = xla.for_outputs(out_tree, jf._title())
    metrics.counters["trace_seconds"] += time.perf_counter() - t0
    title = jf._title()

    def build(options=options, jaxpr=None):  # jaxpr: a per-shard plan's local one ([Note: per-shard kernels])
        start_compile_workers(options)
        preload.wait()  # [Note: compiler preload]
        with gc_pause.paused():  # [Note: no collections while compiling]
            result = lowering.compile_jaxpr(jaxpr or closed, options, title)
        call = loader.load_lazily(result.program)
        constants = [result.schedule.graph.constants[n] for n in result.schedule.graph.inputs
                     if n in result.schedule.graph.constants]
        constants = executable.uncommitted(constants)  # as jax.jit's closed-over arrays: they place nothing
        _log_fallbacks(result.fallbacks)
        if config.debug_dir:  # multi-kernel variants: a folder each, named by the hint
            hint = "_".join(f"{k}{v}" for k, v in options.size_hints) if variants and len(variants) > 1 else ""
            _dump(config.debug_dir, title + (f"_hint_{hint}" if hint else ""), closed, result)
        return result, call, constants

    if symbolic:
        # Not through the disk cache: a symbolic graph's executables are per
        # concrete size (jax.jit of the shape-generic program), so an entry
        # could hold only its source; this compiles it in-process instead.
        built = {}  # source -> [result, call, constants, [hint tuples]]; first hint of a source kept
        order = list(variants or [tuple(size_hints)])
        # Eager launches with static tier-up use one variant: build the nearest
        # first and stop at the first that renders to Triton ([Note: eager launches]).
        lazy = bool(first_sizes) and eager_wanted(options) and config.dynamic_tier_up == "static"
        if lazy:
            order.sort(key=lambda hints: multikernel.log_distance(hints, first_sizes))
        symbols, where = [n for n, _ in positions], [p for _, p in positions]
        # The eager program of a symbolic signature is kept on disk
        # ([Note: eager program cache] in runtime/eager.py): a warm process runs
        # no compiler for it.
        eager_key = None
        if lazy and cache.enabled() and not closed.consts:
            parts = cache.key_parts(closed, [v.aval for v in closed.jaxpr.invars], static_pos + static_kw, options)
            parts["eager"] = {"format": eager.CACHE_FORMAT, "hints": [list(map(list, h)) for h in order]}
            eager_key = cache.key_of(parts)
            hit = eager.load_cached(eager_key)
            if hit is not None:
                fallback = functools.partial(
                    compile_signature, jf, avals, treedef, static_pos, static_kw, n_args, aot=False,
                    structs=structs, size_hints=size_hints, variants=variants, positions=positions)
                dispatcher = multikernel.Dispatcher(
                    title, symbols, where, len(avals), [], options.interpret, eager=hit, fallback=fallback,
                    compile_static=compile_static if config.dynamic_tier_up == "static" else None)
                metrics.counters["eager_cache_hits"] += 1
                metrics.counters["compile_seconds"] += time.perf_counter() - t0
                return Compiled(None, closed, dispatcher, [], out_tree_box[-1], ran=True,
                                guards=[compile(g, "<guard>", "eval") for g in hit.guards],
                                delete_after=xla.donate if xla else (), shape_guards=eq_guards)
        if lazy and not options.interpret:
            from pallaskit.runtime import triton_launch

            # Usually started already, while XLA compiled the static program
            # (``_warm_up_for_eager``); else now, sharing the GIL with this compile.
            triton_launch.warm_up()
        eager_program = None
        for hints in order:
            result, call, constants = build(dataclasses.replace(options, size_hints=tuple(hints)))
            if not result.program.symbols:
                raise lowering.SymbolicUnsupported("no dynamic size reaches the program")
            entry = built.setdefault(result.program.source, [result, call, constants, []])
            entry[3].append(tuple(hints))
            if lazy and len(entry[3]) == 1:
                eager_program = _eager_program(title, {result.program.source: entry}, options, first_sizes)
                if eager_program is not None:
                    break
        if not lazy:
            eager_program = _eager_program(title, built, options, first_sizes or {})
        elif eager_program is not None and eager_key is not None and not eager_program[1]:
            # Not a program with constants (a nested jit's closed-over arrays are not in
            # ``closed.consts``): a hit passes none, and its launch would miss them.
            eager_program[0].guards = list(dict.fromkeys(
                g for b in built.values() for g in b[0].program.guard_source))
            eager.store_cached(eager_key, eager_program[0])
        result, call, constants, _ = next(iter(built.values()))
        deltas = metrics.graph_deltas(result)
        # The graph counts once; generated_kernel_count also counts the other
        # variants' kernels whose source differs from every kernel before.
        seen = {k.source for k in result.program.kernels}
        for other in list(built.values())[1:]:
            extra = {k.source for k in other[0].program.kernels} - seen
            deltas["generated_kernel_count"] += len(extra)
            seen |= extra
        metrics.apply_deltas(deltas)
        seconds = time.perf_counter() - t0
        metrics.counters["compile_seconds"] += seconds
        metrics.record_graph(title, deltas, metrics.kernel_stats(result), seconds, "off")
        # Every variant's guards must hold (a size one variant's int32 indexing
        # cannot take compiles statically for itself).
        guard_source = list(dict.fromkeys(g for b in built.values() for g in b[0].program.guard_source))
        guards = [compile(g, "<guard>", "eval") for g in guard_source]
        log.debug("pallaskit compiled %s shape-generic over %s in %.3fs (%d variant(s))", title,
                  ", ".join(result.program.symbols), seconds, len(built))

        if len(built) == 1 and eager_program is None:
            return Compiled(result, closed, executable.jit(call, xla, len(constants)), constants, out_tree_box[-1],
                            guards=guards, shape_guards=eq_guards)
        variants_ = [multikernel.Variant(b[3], executable.jit(b[1], None, len(constants)), b[2], src,
                                         [k.source for k in b[0].program.kernels])
                     for src, b in built.items()]
        eager_kw = {}
        if eager_program is not None:
            eager_kw = dict(eager=eager_program[0], eager_constants=eager_program[1],
                            compile_static=compile_static if config.dynamic_tier_up == "static" else None)
        dispatcher = multikernel.Dispatcher(title, symbols, where, len(avals), variants_, options.interpret,
                                            **eager_kw)
        # ran=True: the dispatcher counts kernels_compiled (distinct kernels of all variants) on its first call.
        # The dispatcher may run a size's variants on the arguments (timing), so no
        # executable under it takes donation: the donated arrays are deleted after the call.
        return Compiled(result, closed, dispatcher, constants, out_tree_box[-1], ran=True, guards=guards,
                        delete_after=xla.donate if xla else (), shape_guards=eq_guards)
    if aot:
        placement = placed(placement, closed, xla, len(avals))
        if placement is not None:
            xla = (xla or xla_args.XlaArgs()).with_placement(
                placement, signature.flat_function(jf.fn, treedef, static_pos, static_kw, n_args), avals)
            build = per_shard.attach(xla.placed, closed, avals, build, options, config.shard_kernels, title)
        hook = functools.partial(while_compiling, closed) if while_compiling is not None else None
        served = _serve(closed, avals, static_pos + static_kw, options, title, build, t0, xla, hook)
        if served.result is None and config.debug_dir:  # a cache hit: what the entry keeps
            _dump(config.debug_dir, title, closed, None, served.source)
        log.debug("pallaskit served %s in %.3fs (cache: %s)", title, time.perf_counter() - t0, served.cache)
        return Compiled(served.result, closed, served.executable, served.constants, out_tree_box[-1], ran=True)
    if placement is not None:  # the stages of a sharded signature: lowered for the arguments' shardings
        xla = (xla or xla_args.XlaArgs()).with_placement(
            placement, signature.flat_function(jf.fn, treedef, static_pos, static_kw, n_args), avals)
        build = per_shard.attach(xla.placed, closed, avals, build, options, config.shard_kernels, title)
        result, call, constants = build()
        metrics.apply_deltas(metrics.graph_deltas(result))
        return Compiled(result, closed, executable.Placed(call, xla), constants, out_tree_box[-1])
    result, call, constants = build()
    metrics.apply_deltas(metrics.graph_deltas(result))
    return Compiled(result, closed, executable.jit(call, xla, len(constants)), constants, out_tree_box[-1])


def placed(placement, closed, xla, n_leaves: int) -> tuple | None:
    """The placement a static signature is compiled for ([Note: sharding]):
    the arguments' (``placement``), or, where none is placed, every leaf
    unplaced when jax.jit's output shardings are still wanted: the jaxpr
    places values itself (``with_sharding_constraint``), the user's
    in_shardings / out_shardings name shardings, or jax.set_mesh's mesh has
    explicit axes (outputs typed on it; arrays committed to a device keep the
    unplaced path, whose lowering raises jax.jit's incompatible-devices error).
    None: the unplaced path."""
    if placement is None and (sharding.mentions_mesh(closed)
                              or (xla is not None and xla.names_shardings())
                              or (sharding.explicit_context() and not (xla is not None and xla.committed))):
        placement = (None,) * n_leaves
    return placement


# --------------------------------------------------------------------------- #
# A static signature through the graph cache: get, else compile and put
# --------------------------------------------------------------------------- #
@dataclasses.dataclass
class Served:
    """What the jit needs to run one static signature."""

    executable: executable.Executable  # flat dynamic leaves, then constants -> flat outputs
    constants: list
    result: object = None  # lowering.CompileResult; None when loaded from the cache
    cache: str = "off"  # 'hit', 'miss' or 'off'
    source: str = ""  # a hit's generated program source (debug_dir writes it)


_serialize_failures: set = set()
# Arguments from which a new entry is written behind the call ([Note: entries
# written behind the call] in pallaskit/cache): serializing pickles a description
# of each argument, 0.9 s at 4001 (adamw:1000), 0.09 s at 733 (gpt2_adamw), 3 ms at
# one (H100 host, benchmarks/RESULTS.md "Session 32"). Below this the write stays in
# the call: a thread's hand-off and its GIL time buy nothing for a few milliseconds
# (the dynamic sweep's first size ran 0.04-0.05 s slower with every entry behind),
# and the entry is on disk when the call returns.
WRITE_BEHIND_MIN_ARGS = 256
_sources_changed: list = []  # graphs compiled after this process's sources changed (logged once)


def _serve(closed_jaxpr, avals, static_args, options, title: str, build, started: float, xla=None,
           while_compiling=None) -> Served:
    """One traced static signature: from the graph cache when the option is on
    and a valid entry exists, else ``build()`` -> (CompileResult, call,
    constants), XLA's compile, and a new entry. ``started``: when the call began
    (tracing included), for ``compile_seconds``. ``xla``: the signature's
    donation and shardings (``runtime.xla_args.XlaArgs``; a sharded signature's
    placement, [Note: sharding]), part of the key."""
    if xla and xla.placed is not None:
        structs = xla.placed.structs()
    else:
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    warm = _both(_warm_up_for_eager(options), while_compiling)
    if not cache.enabled():
        return _compile_new(build, structs, title, started, "off", xla=xla, while_compiling=warm)
    t0 = time.perf_counter()
    parts = cache.key_parts(closed_jaxpr, avals, static_args, options)
    if xla:
        parts["xla_args"] = xla.key()
    key = cache.key_of(parts)
    metrics.counters["cache_key_seconds"] += time.perf_counter() - t0
    served = _from_cache(key, parts, structs, title, started, xla)
    if served is not None:
        return served
    try:
        lock = cache.key_lock(key)
        lock.acquire()
    except (filelock.Timeout, OSError) as e:
        log.warning("pallaskit cache: no lock for %s (%s); compiling without the cache", title, e)
        return _compile_new(build, structs, title, started, "off", xla=xla, while_compiling=warm)
    try:
        # Another process may have written the entry while this one waited.
        served = _from_cache(key, parts, structs, title, started, xla)
        if served is None:
            metrics.counters["cache_misses"] += 1
            served = _compile_new(build, structs, title, started, "miss", key=key, parts=parts, xla=xla,
                                  while_compiling=warm, lock=lock)
        return served
    finally:
        lock.release()  # a writer behind the call holds it on until the entry is on disk


def _from_cache(key, parts, structs, title, started, xla=None) -> Served | None:
    """The executable of the cache's entry of ``key``; None where there is none
    usable (missing, bad, or source only with externs)."""
    t0 = time.perf_counter()
    entry = cache.load(key, parts)
    t1 = time.perf_counter()
    if entry is not None and entry.executable is None:
        preload.wait()  # rebuilt from its source, which imports Pallas, as the preload does
    metrics.counters["cache_read_seconds"] += t1 - t0
    if entry is None:
        return None
    try:
        loaded = executable.from_entry(entry, structs, xla, load_program=loader.load)
    except Exception as e:  # noqa: BLE001 - an executable that does not load is a bad entry
        cache.report(cache.entry_path(entry.key), f"executable does not load: {type(e).__name__}: {e}")
        return None
    if loaded is None:
        return None
    if entry.executable is None:  # rebuilt from the entry's source: XLA compiled its kernels
        metrics.counters["kernels_compiled"] += entry.num_kernels
    served = Served(loaded[0], loaded[1], cache="hit", source=entry.source)
    metrics.counters["cache_load_seconds"] += time.perf_counter() - t1
    metrics.counters["cache_hits"] += 1
    _finish(served, title, started, entry.metric_deltas, None)
    return served


def _compile_new(build, structs, title, started, how: str, key=None, parts=None, xla=None,
                 while_compiling=None, lock=None) -> Served:
    """Run the compiler and XLA; with a ``key``, keep the result in the cache
    (a program of ``WRITE_BEHIND_MIN_ARGS`` arguments or more: written behind
    the call, the writer holding ``lock``, the key's lock, until the entry is on
    disk: [Note: entries written behind the call] in pallaskit/cache).
    ``while_compiling``: started before JAX lowers the program
    (``executable.aot_compile``)."""
    result, call, constants = build()
    where = xla.placed.replicated() if xla and xla.placed is not None else None
    ahead = autotune_ahead(result, where)
    compiled = executable.aot_compile(call, structs, constants, xla, while_compiling=while_compiling,
                                      before_xla=ahead.join if ahead else None)
    metrics.counters["kernels_compiled"] += len(result.program.kernels)
    served = Served(compiled, executable.on_device(constants, where), result, how)
    deltas, kernels = metrics.graph_deltas(result), metrics.kernel_stats(result)
    if key is not None and cache.stat_signature()[0] != cache.environment()["sources"]:
        # The key holds the hash of the sources as they were when this process
        # first made a key; the compiler that just ran may have been imported since.
        if not _sources_changed:
            _sources_changed.append(title)
            log.warning("pallaskit cache: pallaskit's sources changed while this process ran; "
                        "not caching what it compiles from now on (first: %s)", title)
        key = None
    if key is not None:
        path = cache.entry_path(key)  # the folder as of this call

        def write():
            payload, in_tree, out_tree, error = executable.serialize(compiled)
            if error and title not in _serialize_failures:
                _serialize_failures.add(title)
                log.warning("pallaskit cache: the executable of %s cannot be serialized (%s); caching its source "
                            "only", title, error)
            cache.store(cache.Entry(
                key=key, parts=parts, title=title, source=result.program.source,
                num_kernels=len(result.program.kernels), has_externs=bool(result.program.externs),
                constants=list(constants), executable=payload, in_tree=in_tree, out_tree=out_tree,
                executable_error=error, metric_deltas=deltas, kernels=kernels, created=time.time(),
                devices=executable.device_ids(compiled) if payload is not None else None), path)
        if len(structs) >= WRITE_BEHIND_MIN_ARGS:
            cache.write_behind(key, write, lock)
        else:
            write()
    _finish(served, title, started, deltas, kernels)
    return served


def autotune_ahead(result, placed):
    """XLA's autotuning of the program's matmuls and convolutions started now,
    before JAX lowers it (a single-device program on a GPU): its thread, which
    the program's XLA compile joins first, or None ([Note: autotuning ahead])."""
    if placed is None and result is not None and config.autotune_ahead and _autotunes():
        return xla_warm.start(result.schedule)
    return None


def _autotunes() -> bool:
    """Whether XLA autotunes here: on a GPU."""
    return jax.default_backend() == "gpu"


def _finish(served: Served, title, started, deltas, kernels):
    """Counters and metric-table rows of one served graph."""
    seconds = time.perf_counter() - started
    metrics.apply_deltas(deltas)
    metrics.counters["compile_seconds"] += seconds
    metrics.record_graph(title, deltas, kernels, seconds, served.cache)


def _both(first, second):
    """One callable calling both (either may be None)."""
    if first is None or second is None:
        return first or second
    return lambda: (first(), second())


def _warm_up_for_eager(options):
    """What to start beside JAX's lowering and XLA's compile of a static
    program: where a later new size of an automatic dynamic axis would run
    eager Triton kernels, triton's import (``triton_launch.warm_up``, once per
    process), which that size's compile would otherwise wait for beside its
    passes, both holding the GIL; the lowering's wait for the kernels and XLA's
    compile leave it free. None where no eager launch can follow."""
    if options.interpret or not options.triton_available or not config.automatic_dynamic:
        return None
    if not eager_wanted(options):
        return None
    from pallaskit.runtime import triton_launch

    return triton_launch.warm_up


# Compile workers started as a GPU compile begins (``start_compile_workers``),
# one for each compile thread (``triton_call._compile_pool``): each takes a few
# tenths of a second to start, so they start beside the passes rather than
# when the first kernels wait for them (two left most threads waiting: a ResNet
# block's cold compile in benchmarks/RESULTS.md, "Session 23").
PRESTART_WORKERS = 8
# Started by the compiler's preload, before any compile: enough for a small
# program's kernels and its speculative eager ones (the dynamic sweep's first
# size compiles four at once); a larger one's passes cover the rest's start.
PRELOAD_WORKERS = 4


def start_compile_workers(options, count: int | None = None) -> None:
    """On a GPU, Triton's compile workers started as the compiler begins
    (``triton_compile.prestart``): they start beside the passes, not after
    them, when the program's kernels (inside XLA or eager) compile. None where
    no raw Triton kernel compiles (Pallas kernels, no eager launches)."""
    if options.interpret or not options.triton_available or not config.triton_compile_processes:
        return
    if options.kernel_backend == "pallas" and not eager_wanted(options):
        return
    from pallaskit.runtime import triton_compile

    triton_compile.prestart(min(PRESTART_WORKERS if count is None else count, os.cpu_count() or 1))


def first_compile_facts() -> None:
    """What a first compile's cache key reads from disk once per process, read
    early by the compiler's preload ([Note: compiler preload] in
    runtime/preload.py): the sources' hash and the installed versions
    (``cache.environment``), whose hundred-odd file reads each wait for the GIL
    beside another thread's import (0.4-0.5 s of a first call on the H100 host,
    triton's import running; benchmarks/RESULTS.md, "Session 31")."""
    if cache.enabled():
        cache.environment()


def prepare_first_compile() -> tuple[str, ...]:
    """What a first compile on this platform would start, started early by the
    compiler's preload ([Note: compiler preload] in runtime/preload.py): on a
    GPU, ``PRELOAD_WORKERS`` compile workers and triton's import (which the
    loader needs before JAX lowers a program of raw Triton kernels). Returns
    the jax modules the first compile imports, for the preload to import:
    Pallas, which every generated program imports, and on the CPU jax's Pallas
    interpreter."""
    options = compile_options()
    if options.interpret:
        return preload.INTERPRET_MODULES
    start_compile_workers(options, PRELOAD_WORKERS)
    if options.triton_available:
        from pallaskit.runtime import triton_launch

        triton_launch.warm_up()
    return preload.PROGRAM_MODULES


def eager_wanted(options) -> bool:
    """Should a symbolic program run new sizes eagerly (option ``dynamic_launch``)?"""
    return executors.eager(config.dynamic_launch, options).executor == executors.TRITON_EAGER


def _eager_program(title: str, built: dict, options, first_sizes: dict):
    """(EagerProgram, its constants) of the variant nearest ``first_sizes`` among
    those whose kernels all render to raw Triton, or None ([Note: eager
    launches] in runtime/eager.py; option ``dynamic_launch``)."""
    if not eager_wanted(options):
        return None
    mode = config.dynamic_launch
    preload.wait()
    from lowering.codegen import triton as triton_codegen

    renderable, why = [], []
    for result, _, constants, hints in built.values():
        try:
            program = triton_codegen.render(result.schedule, dataclasses.replace(options, size_hints=hints[0]), title)
        except triton_codegen.TritonUnsupported as e:
            why.append(str(e))
            continue
        except Exception as e:  # noqa: BLE001  (a renderer bug must not cost the symbolic program)
            log.warning("pallaskit: %s: the Triton renderer failed (%s: %s); no eager launches", title,
                        type(e).__name__, e)
            continue
        renderable.append((multikernel.Variant(hints, None, constants, program.source, []), program))
    if not renderable:
        log.debug("pallaskit: %s: no eager launches (%s)", title, "; ".join(dict.fromkeys(why)))
        return None
    index = multikernel.nearest([v for v, _ in renderable], first_sizes) if first_sizes else 0
    variant, program = renderable[index]
    try:
        kernels = [(k.name, k.num_warps, k.num_stages) for k in program.kernels]
        return eager.EagerProgram(program.source, kernels, options.interpret, variant.hints[0]), variant.constants
    except Exception as e:  # noqa: BLE001  (no triton, or imported without its interpreter: XLA path)
        log.log(logging.WARNING if mode == "on" else logging.DEBUG,
                "pallaskit: %s: no eager launches (%s: %s)", title, type(e).__name__, e)
        return None


def _log_fallbacks(prims):
    if not config.log_fallbacks:
        return
    for p in prims:
        if p not in metrics.logged_fallbacks:
            metrics.logged_fallbacks.add(p)
            log.warning("pallaskit: %s runs through XLA (no lowering rule, or the rule cannot take these operands)", p)


def _dump(root, title, closed, result, source=None):
    """``debug_dir``'s folder of one compiled function. ``result`` None: a disk
    cache hit, where the compiler did not run: the jaxpr and the entry's
    program source, and a note saying why the IR files are missing."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in title)
    folder = os.path.join(root, f"{safe}_{metrics.counters['graphs_compiled']:03d}")
    os.makedirs(folder, exist_ok=True)
    if result is not None:
        files = {"jaxpr.txt": str(closed), "ir_before_fusion.txt": result.ir_before,
                 "ir_after_fusion.txt": result.ir_after, "program.py": result.program.source}
    else:
        files = {"jaxpr.txt": str(closed), "program.py": source or "",
                 "FROM_CACHE.txt": "Loaded from the on-disk graph cache: the compiler did not run, so there is no "
                                   "IR before/after fusion. Run with the option cache off (PALLASKIT_CACHE=0) or "
                                   "pallaskit.explain(fn, *args) to see them.\n"}
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
