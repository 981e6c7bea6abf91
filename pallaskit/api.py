"""``pallaskit.jit``: jax.jit's calling convention over pallaskit's compiler.

[Note: one call, end to end]
``JitFunction.__call__`` is jax.jit's C++ dispatch (runtime/fastpath.py): a
signature seen before runs its XLA executable without entering Python. A miss
runs ``_call``: split the arguments into the signature (static arguments, the
flat dynamic leaves and their avals: ``_split``, signature.py), send tracers to
autodiff.py, look the signature up, and on a cold signature ask dynamic.py
whether a symbolic graph serves it, else ``orchestrator.compile_signature``:
trace -> ``lowering.compile_jaxpr`` -> an executable (executable.py), through
the graph cache (cache/, which only stores). The entry (``executable.Compiled``)
is kept under the signature; ``_cache_miss`` hands its executable to C++.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import sys
import threading
import types
from typing import Callable, Sequence

import jax

from pallaskit import autodiff, cache, metrics, orchestrator, sharding, signature
from pallaskit import dynamic as dynamic_dims
from pallaskit.config import config
from pallaskit.executable import Compiled
from pallaskit.orchestrator import compile_options  # noqa: F401  (the public name: tests, benchmarks, explain)
from pallaskit.runtime import fastpath, gc_pause, preload, xla_args

log = logging.getLogger("pallaskit")

# The last C++ miss's result, per thread (see JitFunction.__call__).
_MISS = threading.local()

try:  # what an executable's output check raises under jax.debug_nans / debug_infs
    from jax._src.api_util import InternalFloatingPointError as _InternalFloatingPointError
except ImportError:  # another jax: its own error passes through unchanged
    class _InternalFloatingPointError(Exception):
        pass


def _deleted_as_jax_does(call):
    """``call`` (``JitFunction._call``) raising jax.jit's error for a deleted
    (donated) array, whichever step met it first (its placement, an eager
    launch reading it as a NumPy array: RuntimeError): on the CPU jax.jit
    raises XLA's ValueError, on a GPU its own RuntimeError."""
    @functools.wraps(call)
    def checked(self, args, kwargs):
        try:
            return call(self, args, kwargs)
        except RuntimeError:
            if jax.default_backend() != "cpu":  # jax.jit's own RuntimeError there: "Array has been deleted"
                raise
            for i, x in enumerate(jax.tree_util.tree_leaves((args, kwargs))):
                if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
                    raise ValueError(f"INVALID_ARGUMENT: Invalid buffer passed to Execute() as argument {i} to "
                                     "replica 0: INVALID_ARGUMENT: Buffer has been deleted or donated.") from None
            raise
    return checked


def _nan_check_as_jax_does(call):
    """``call`` (``JitFunction._call``) under ``jax.debug_nans`` / ``jax.debug_infs``:
    an executable whose output holds a NaN (an inf) raises jax's internal error;
    as jax.jit, the function then runs again op by op, whose FloatingPointError
    names the primitive (or says that only the compiled program made it). The
    C++ call's outputs are checked by jax's own hook (``fastpath.cpp_function``)."""
    @functools.wraps(call)
    def checked(self, args, kwargs):
        try:
            return call(self, args, kwargs)
        except _InternalFloatingPointError as e:
            from jax._src import api_util

            api_util.maybe_recursive_nan_check(e, self.fn, args, kwargs)
            raise  # not reached: that check always raises
    return checked


def _execute(entry: Compiled, leaves) -> list:
    """The entry's executable on a call's leaves. Under ``jax.debug_nans`` /
    ``debug_infs`` it runs with the checks off and its outputs are checked
    after, as jax.jit checks a call's: a symbolic program's kernels launched one
    by one would each be checked as an eager ``pallas_call``, whose NaN re-runs
    the same ``pallas_call`` for jax's de-optimized error, forever."""
    if not (jax.config.jax_debug_nans or jax.config.jax_debug_infs):
        return entry.executable(*leaves, *entry.constants)
    from jax._src import dispatch

    with jax.debug_nans(False), jax.debug_infs(False):
        outs = entry.executable(*leaves, *entry.constants)
    dispatch.check_special("jit", [x for x in outs if isinstance(x, jax.Array)])  # _nan_check_as_jax_does catches
    return outs


class JitFunction:
    """A function compiled by pallaskit, with jax.jit's semantics."""

    def __init__(self, fn: Callable, static_argnums=None, static_argnames=None, dynamic=None, *,
                 donate_argnums=None, donate_argnames=None, keep_unused: bool = False,
                 in_shardings=xla_args.UNSET, out_shardings=xla_args.UNSET, device=None, backend=None,
                 inline: bool = False, compiler_options: dict | None = None):
        if not callable(fn):
            raise TypeError(f"pallaskit.jit expects a callable, got {type(fn).__name__}")
        self.fn = fn
        self._init = dict(static_argnums=static_argnums, static_argnames=static_argnames, dynamic=dynamic,
                          donate_argnums=donate_argnums, donate_argnames=donate_argnames, keep_unused=keep_unused,
                          in_shardings=in_shardings, out_shardings=out_shardings, device=device, backend=backend,
                          inline=inline, compiler_options=compiler_options)
        self._sig = _signature(fn)
        # jax.jit checks the arguments (types, ranges, names, static/donated
        # overlap) and raises its own errors; pallaskit then resolves them the same way.
        sharding_kw = {k: v for k, v in (("in_shardings", in_shardings), ("out_shardings", out_shardings))
                       if v is not xla_args.UNSET}
        checked = jax.jit(fn, static_argnums=static_argnums, static_argnames=static_argnames,
                          donate_argnums=donate_argnums, donate_argnames=donate_argnames, keep_unused=keep_unused,
                          device=device, backend=backend, inline=inline, compiler_options=compiler_options,
                          **sharding_kw)
        # ``inline`` only shapes the caller's jaxpr: nothing to do. A device, a
        # backend or XLA options of the user's: pallaskit's executables take
        # none of them, so jax.jit runs the function (one log line per call site).
        self._jax = checked  # jax.jit of the function, for what pallaskit leaves to JAX
        self._xla_instead = None
        if device is not None or backend is not None or compiler_options:
            given = [k for k, v in (("device", device), ("backend", backend), ("compiler_options", compiler_options))
                     if v]
            self._xla_instead = (checked, f"{'/'.join(given)} given: jax.jit runs the function")
        self.static_argnums, self.static_argnames = _infer_argnums(self._sig, static_argnums, static_argnames)
        self.donate_argnums, self.donate_argnames = _infer_argnums(self._sig, donate_argnums, donate_argnames)
        # A negative static argnum counts from the end of the call's positional arguments, as
        # jax.jit resolves it per call (``i % len(args)``): a call leaving a defaulted parameter
        # out, or a ``*args`` function, moves it. ``static_argnums`` is its resolution at the
        # signature's positional parameters; ``_static_at(n_args)`` a call's.
        self._static_raw = tuple(self.static_argnums)
        self.static_argnums = tuple(sorted({i if i >= 0 or self._sig is None else i + _n_positional(self._sig)
                                            for i in self.static_argnums}))
        # A negative donate argnum donates nothing: jax.jit checks its range (above) and then
        # matches only a call's non-negative positions against it (jax's ``donation_vector``).
        self.donate_argnums = tuple(sorted(i for i in set(self.donate_argnums) if i >= 0))
        self.keep_unused, self.in_shardings, self.out_shardings = bool(keep_unused), in_shardings, out_shardings
        # Traces the function: jax.jit keeps its signature and argument names
        # (debug info), so errors raised while tracing name the user's function
        # and arguments, not pallaskit's flat wrapper.
        self._tracer = jax.jit(fn, static_argnums=self._static_raw, static_argnames=self.static_argnames)
        self.dynamic = dynamic_dims.resolve(self._sig, dynamic, self.static_argnums, self.static_argnames)
        self._sym: dict = {}  # symbolic signature -> Compiled, or None: compiled per size instead
        self._seen: dict = {}  # automatic dynamic: signature skeleton -> the distinct shapes seen
        self._speculated: dict = {}  # symbolic signature -> Future of its speculative compile (dynamic.speculation)
        self._logged: set = set()  # automatic dynamic axes already announced
        self._cache: dict = {}
        self._fast: dict = {}  # _fast_key -> Compiled, filled by calls that went through _cache
        self._xla: dict = {}  # (treedef, n_args) -> XlaArgs
        # jax.jit's C++ dispatch, with the Python call as its miss ([Note: the call fast
        # path]); static arguments keep the Python call (pallaskit tells 1 from True, C++ does not).
        self._cpp = None
        if not self.static_argnums and not self.static_argnames and self._xla_instead is None:
            self._cpp = fastpath.cpp_function(self._title(), fn, self._cache_miss)
        # updated=(): a function wrapping a JitFunction (jax.grad(f) of one) carries its
        # __dict__ (fn, _cache); copying that would make this one run the wrapped function.
        functools.update_wrapper(self, fn, updated=())
        # [Note: compiler preload]: unless this function's program is likely on disk ([Note: function markers]).
        if config.preload_compiler and not preload.started() and not cache.holds_function(fn):
            preload.start(orchestrator.prepare_first_compile, orchestrator.first_compile_facts)

    def __get__(self, obj, objtype=None):
        """As jax.jit's: a method's ``self`` is the first argument (``static_argnums=0`` makes it static)."""
        return self if obj is None else types.MethodType(self, obj)

    def __copy__(self):
        return type(self)(self.fn, **self._init)

    def __deepcopy__(self, memo):
        return type(self)(copy.deepcopy(self.fn, memo), **self._init)

    def clear_cache(self) -> None:
        """Forget every compiled signature of this function (jax.jit's
        ``clear_cache``); the on-disk graph cache keeps its entries."""
        for d in (self._cache, self._fast, self._sym, self._seen, self._speculated, self._xla):
            d.clear()
        for traced_by_jax in (self._tracer, self._jax):  # their traces: the function runs again, as jax.jit's does
            traced_by_jax.clear_cache()
        autodiff.forget(self)
        self._refresh_fast_path()

    def _cache_size(self) -> int:
        return len(self._cache)

    def _refresh_fast_path(self) -> None:
        """Start jax's C++ dispatch over. It keeps its first answer per
        signature: a signature whose first calls C++ could not run (eager
        launches of a new size) would stay on the Python call after a static
        program for it lands (a recurring size's tier-up, pallaskit/dynamic.py),
        unless the C++ object is new. Each signature then misses once more."""
        if self._cpp is not None:
            self._cpp = fastpath.cpp_function(self._title(), self.fn, self._cache_miss)

    def _static_at(self, n_args: int) -> tuple[int, ...]:
        """The static positions of a call of ``n_args`` positional arguments (jax.jit's resolution)."""
        if not any(i < 0 for i in self._static_raw):
            return self.static_argnums
        for i in self._static_raw:
            if i < -n_args:  # jax.jit's error, word for word (a call of fewer arguments than the argnum counts back)
                raise ValueError("Positional argument indices, e.g. for `static_argnums`, must have value greater "
                                 "than or equal to -len(args) and less than len(args), but got value "
                                 f"{i} for len(args) == {n_args}.")
        return tuple(sorted({i % n_args if i < 0 else i for i in self._static_raw})) if n_args else ()

    def _dynamic_positions(self, n_args: int) -> list[int]:
        """The positional arguments of a call of ``n_args`` that are not static."""
        static = self._static_at(n_args)
        return [i for i in range(n_args) if i not in static]

    def _xla_args(self, treedef, n_args) -> xla_args.XlaArgs:
        """Donation and shardings of a call signature ([Note: XLA arguments])."""
        k = (treedef, n_args)
        out = self._xla.get(k)
        if out is None:
            out = self._xla[k] = xla_args.resolve(
                treedef, n_args, self._static_at(n_args), self.donate_argnums, self.donate_argnames, self.in_shardings,
                self.out_shardings, self.keep_unused, self._title())
        return out

    # -- signature --------------------------------------------------------------
    def _split(self, args, kwargs):
        """Separate static from dynamic arguments; checks every dynamic leaf."""
        static_argnums = self._static_at(len(args))
        static_pos = tuple((i, signature.hashable(args[i])) for i in static_argnums if i < len(args))
        static_kw = tuple(sorted((k, signature.hashable(v)) for k, v in kwargs.items() if k in self.static_argnames))
        dyn_args = [a for i, a in enumerate(args) if i not in static_argnums]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))
        leaves, avals = [], []
        dyn_positions = self._dynamic_positions(len(args))
        for path, leaf in leaves_with_path:
            avals.append(signature.abstractify(leaf, signature.describe(path, dyn_positions, self._sig), self.fn))
            leaves.append(leaf)
        key = signature.call_key(treedef, avals, static_pos, static_kw, len(args))
        return key, leaves, avals, treedef, static_pos, static_kw

    def __call__(self, *args, **kwargs):
        cpp = self._cpp
        if cpp is None:
            return self._call(args, kwargs)[0]
        _MISS.out = _MISS  # [Note: the call fast path] in runtime/fastpath.py
        try:
            result = cpp(*args, **kwargs)
            _MISS.out = _MISS  # holds no outputs past the call
            return result
        except Exception:
            out, _MISS.out = _MISS.out, _MISS
            if out is _MISS:  # raised by the call itself (Python or the executable)
                raise
            # The Python call returned, and C++ could not take what it returned:
            # this jax's fast path differs from the one fastpath.py knows.
            fastpath.disable(sys.exc_info()[1])
            self._cpp = None
            return out

    def _cache_miss(self, *args, **kwargs):
        """The C++ call's miss: the Python call, and the executable that C++ may
        run itself for this signature from now on (None: come back here)."""
        try:
            out, entry, outs = self._call(args, kwargs)
        except BaseException:
            _MISS.out = _MISS  # a nested pallaskit call may have set it: this error is the call's own
            raise
        data = None
        if entry is not None and not entry.constants and not entry.delete_after:
            data = fastpath.fastpath_data(entry.executable, entry.out_tree, outs)
        _MISS.out = out
        return out, data, False

    @_nan_check_as_jax_does
    @_deleted_as_jax_does
    def _call(self, args, kwargs):
        """(result, the Compiled entry that ran or None, its flat outputs)."""
        if jax.config.jax_disable_jit:  # as jax.jit: the function runs op by op (C++ runs it itself)
            return self.fn(*args, **kwargs), None, None
        if self._xla_instead is not None:
            checked, why = self._xla_instead
            autodiff.fallback_log(self, why)
            return checked(*args, **kwargs), None, None
        fast = self._fast_key(args, kwargs)
        if fast is not None:
            entry = self._fast.get(fast[0])
            if entry is not None:  # a signature seen before, concrete arrays
                outs = _execute(entry, fast[1])
                if entry.delete_after:
                    xla_args.delete_donated(fast[1], entry.delete_after, outs, entry.donation, entry.jaxpr,
                                             self.keep_unused)
                return jax.tree_util.tree_unflatten(entry.out_tree, outs), entry, outs
        key, leaves, avals, treedef, static_pos, static_kw = self._split(args, kwargs)
        why = sharding.xla_only(leaves, autodiff.transformed(leaves), compile_options)
        if why:  # [Note: sharding] in pallaskit/sharding.py
            return autodiff.fallback(self, args, kwargs, why), None, None
        if autodiff.transformed(leaves):  # grad / jvp / vmap tracers: pallaskit/autodiff.py
            return autodiff.call(self, args, kwargs), None, None
        if autodiff.staged(leaves) and signature.inside_trace():  # [Note: nested pallaskit functions]
            return self._jax(*args, **kwargs), None, None
        if autodiff.staged(leaves):  # jax.jit tracers: the AOT executable takes none
            return autodiff.call_staged(self, args, kwargs), None, None
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise TypeError("pallaskit.jit: a call needs arrays; jax.ShapeDtypeStruct arguments are for "
                            "pallaskit.explain and lower_to_result")
        placement = sharding.placement(leaves)  # [Note: sharding] in pallaskit/sharding.py
        committed = placement is None and sharding.committed(leaves)  # [Note: XLA arguments]
        if committed:
            key = (*key, "committed")
        if placement is not None:
            key = (*key, placement)
            if key not in self._cache and len({frozenset(s.device_set) for s in placement if s is not None}) > 1:
                # Arrays on different devices: jax.jit's error, naming the function and its arguments.
                self._jax.lower(*args, **kwargs)
        entry = self._cache.get(key)
        if entry is None:
            # A new signature's first call: trace, compile and first run with no
            # collections ([Note: no collections while compiling]).
            with gc_pause.paused():
                try:
                    entry = self._miss(key, leaves, avals, treedef, static_pos, static_kw, len(args), placement,
                                       committed)
                except signature.JaxOnly as e:  # jax.jit runs it (traced into an enclosing trace, if any)
                    autodiff.fallback_log(self, f"{e}; running it with jax.jit")
                    return self._jax(*args, **kwargs), None, None
                except ValueError as e:
                    if not str(e).startswith("Received incompatible devices for jitted computation"):
                        raise
                    # Met by JAX lowering the flat program (an array committed to one device under
                    # jax.set_mesh's mesh): jax.jit's own error names the function and its arguments.
                    self._jax.lower(*args, **kwargs)
                    raise
                outs = _execute(entry, leaves)
        else:
            outs = _execute(entry, leaves)
        if entry.delete_after:
            xla_args.delete_donated(leaves, entry.delete_after, outs, entry.donation, entry.jaxpr, self.keep_unused)
        if not entry.ran:
            entry.ran = True
            metrics.counters["kernels_compiled"] += len(entry.result.program.kernels)
        if fast is not None:
            # A recurring size's static program, filed by its tier-up on the background thread
            # while this call ran the dispatcher (dynamic.compile_static), is kept.
            self._fast.setdefault(fast[0], entry)
        return jax.tree_util.tree_unflatten(entry.out_tree, outs), entry, outs

    def _miss(self, key, leaves, avals, treedef, static_pos, static_kw, n_args, placement,
              committed=False) -> Compiled:
        """The entry of a signature not in ``_cache``, compiled (or served by a symbolic graph) and kept."""
        entry = None
        xla = self._xla_args(treedef, n_args)
        if committed:
            xla = dataclasses.replace(xla, committed=True)
        # A sharded signature compiles per size ([Note: sharding]): arrays placed off the default
        # device, or the user's in_shardings / out_shardings, which a symbolic program does not take.
        sharded = placement is not None or xla.names_shardings()
        if not sharded:
            entry = dynamic_dims.entry(self, leaves, avals, treedef, static_pos, static_kw, n_args)
        if entry is None:
            speculate = (dynamic_dims.speculation(self, avals, treedef, static_pos, static_kw, n_args)
                         if not sharded else None)
            entry = self._compile(avals, treedef, static_pos, static_kw, n_args,
                                  xla=xla, placement=placement, while_compiling=speculate)
        self._cache[key] = entry
        cache.mark_function(self.fn)  # a later process likely finds it on disk ([Note: function markers])
        return entry

    def _fast_key(self, args, kwargs):
        """(key, leaves) of a call whose dynamic leaves are all concrete
        ``jax.Array``s and that has no static arguments, from the arrays' own
        avals; None otherwise. It skips ``_split``'s per-leaf checks and
        argument descriptions, which cost more than the dispatch itself."""
        if self.static_argnums or self.static_argnames:
            return None
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        array = signature.array_type(leaves)
        if array is None or not all(type(x) is array for x in leaves):
            return None
        return (treedef, tuple(x.aval for x in leaves), sharding.fast_placement(leaves), signature.context()), leaves

    # -- ahead of time (jax.stages) ---------------------------------------------
    def trace(self, *args, **kwargs):
        """``jax.jit(f).trace``: a ``pallaskit.stages.Traced`` (``.jaxpr``,
        ``.out_info``, ``.lower()``); arrays or ``jax.ShapeDtypeStruct``s."""
        from pallaskit import stages

        if self._xla_instead is not None:
            return self._xla_instead[0].trace(*args, **kwargs)
        return stages.Traced(stages._Signature(self, args, kwargs))

    def lower(self, *args, **kwargs):
        """``jax.jit(f).lower``: pallaskit's program lowered to StableHLO, a
        ``pallaskit.stages.Lowered`` (``as_text``, ``cost_analysis``, ``compile``)."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args, **kwargs):
        """The outputs' shapes and dtypes (``jax.ShapeDtypeStruct``s), nothing compiled: jax.jit's
        ``eval_shape``, static arguments included (what ``jax.eval_shape(f, ...)`` cannot take)."""
        return self._tracer.eval_shape(*args, **kwargs)

    def lower_to_result(self, *args, **kwargs) -> Compiled:
        key, leaves, avals, treedef, static_pos, static_kw = self._split(args, kwargs)
        entry = self._cache.get(key)
        if entry is not None and entry.result is None:  # loaded from the disk cache: run the compiler for it
            return self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
        if entry is None:
            entry = dynamic_dims.entry(self, leaves, avals, treedef, static_pos, static_kw, len(args))
            if entry is not None and entry.result is None:  # an eager program from the disk cache
                return self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
            if entry is None:
                entry = self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False,
                                      xla=self._xla_args(treedef, len(args)))
            self._cache[key] = entry
        return entry

    def _title(self):
        return getattr(self.fn, "__qualname__", "fn")

    # -- for the orchestrator, the stages and autodiff ----------------------------
    def _trace(self, structs, treedef, static_pos, static_kw, n_args):
        """(closed jaxpr, output treedef) at ``structs``: ``orchestrator.trace``."""
        return orchestrator.trace(self, structs, treedef, static_pos, static_kw, n_args)

    def _compile(self, avals, treedef, static_pos, static_kw, n_args, **kw) -> Compiled:
        """One signature traced and compiled: ``orchestrator.compile_signature``."""
        return orchestrator.compile_signature(self, avals, treedef, static_pos, static_kw, n_args, **kw)


def jit(fn: Callable | None = None, *, in_shardings=xla_args.UNSET, out_shardings=xla_args.UNSET,
        static_argnums: int | Sequence[int] | None = None, static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None, donate_argnames: str | Sequence[str] | None = None,
        keep_unused: bool = False, device=None, backend: str | None = None, inline: bool = False,
        compiler_options: dict | None = None, dynamic: dict | None = None):
    """Compile ``fn`` with pallaskit. Usable as ``@pallaskit.jit``,
    ``@pallaskit.jit(static_argnums=...)`` or ``pallaskit.jit(fn, ...)``.

    The arguments ``jax.jit`` shares mean what they mean there, checked the
    same way (the same errors): ``static_argnums`` / ``static_argnames``,
    ``donate_argnums`` / ``donate_argnames`` (a donated argument's buffers may
    hold the outputs; the caller's array is deleted by the call),
    ``in_shardings`` / ``out_shardings`` and ``keep_unused`` (forwarded to the
    XLA executable, [Note: XLA arguments] in pallaskit/runtime/xla_args.py);
    ``inline`` is accepted; with ``device``, ``backend`` or
    ``compiler_options``, jax.jit runs the function (a log line says so).
    The result has jax.jit's ``trace``, ``lower`` (then ``compile``) and
    ``eval_shape``. ``jax.eval_shape(f, ...)`` traces ``f`` under a jax.jit
    of its own, where every argument is an array: with static arguments, use
    ``f.eval_shape(...)`` ([Note: eval_shape of static arguments] in
    pallaskit/signature.py).

    ``dynamic``: axes whose size may change between calls without a new
    compilation, ``{argument: {axis: "symbol"}}`` (argument by name or
    position; one symbol name means one size, checked at every call), e.g.
    ``dynamic={"x": {0: "n"}, "labels": {0: "n"}}``. Option
    ``automatic_dynamic`` also makes an axis dynamic once it was seen with a
    second size. [Note: dynamic dims]"""
    def make(f):
        return JitFunction(f, static_argnums, static_argnames, dynamic, donate_argnums=donate_argnums,
                           donate_argnames=donate_argnames, keep_unused=keep_unused, in_shardings=in_shardings,
                           out_shardings=out_shardings, device=device, backend=backend, inline=inline,
                           compiler_options=compiler_options)

    return make if fn is None else make(fn)


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _n_positional(sig) -> int:
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig.parameters.values())


def _infer_argnums(sig, argnums, argnames) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """jax.jit's completion of argnums from argnames and back (jax's
    ``api_util.infer_argnums_and_argnames``): when only one is given, the other
    is read from the signature; when both are, each is taken as given."""
    if argnums is None and argnames is None:
        return (), ()
    nums = None if argnums is None else ((argnums,) if isinstance(argnums, int) else tuple(argnums))
    names = None if argnames is None else ((argnames,) if isinstance(argnames, str) else tuple(argnames))
    if sig is None or (nums is not None and names is not None):
        return nums or (), names or ()
    params = [(k, p) for k, p in sig.parameters.items()]
    if nums is None:
        nums = tuple(i for i, (k, p) in enumerate(params) if p.kind == p.POSITIONAL_OR_KEYWORD and k in names)
    else:
        names = tuple(k for i, (k, p) in enumerate(params) if p.kind == p.POSITIONAL_OR_KEYWORD and i in nums)
    return nums, names


