"""``pallaskit.jit``: jax.jit's calling convention over pallaskit's compiler."""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import keyword
import logging
import os
import re
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

import lowering
from lowering import executors
from lowering.options import CompileOptions
from pallaskit import cache, metrics
from pallaskit import autodiff
from pallaskit import per_shard, sharding, signature
from pallaskit.config import config
from pallaskit.runtime import eager, fastpath, loader, multikernel, xla_args

log = logging.getLogger("pallaskit")


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
    loops = snap["loop_bodies"]
    values["loop_bodies"] = loops == "on" or (loops == "auto" and values["interpret"])
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
def _num_sms() -> int:
    """SMs of the default device (grid sizing); 4 on the CPU, where interpret
    mode runs programs one after another."""
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 132) if device.platform == "gpu" else 4


@dataclasses.dataclass
class Compiled:
    """One compiled signature."""

    result: lowering.CompileResult
    jaxpr: Any
    executable: Callable  # jitted: flat dynamic leaves -> flat outputs
    constants: list
    out_tree: Any
    ran: bool = False
    # A symbolic graph ([Note: dynamic dims]): checks of the dim values (code
    # objects over the symbols' names), all true for the program to be right.
    guards: list = dataclasses.field(default_factory=list)
    # Donated leaves the executable does not donate itself (a dispatcher of
    # variants, eager launches): deleted after each call, as jax.jit's donation does.
    delete_after: tuple = ()
    # A symbolic graph: the differences of the symbolic sizes the trace took as
    # unequal; each must be nonzero at a call's sizes ([Note: shape equality guards]).
    shape_guards: list = dataclasses.field(default_factory=list)


class JitFunction:
    """A function compiled by pallaskit, with jax.jit's semantics."""

    def __init__(self, fn: Callable, static_argnums=None, static_argnames=None, dynamic=None, *,
                 donate_argnums=None, donate_argnames=None, keep_unused: bool = False,
                 in_shardings=xla_args.UNSET, out_shardings=xla_args.UNSET):
        if not callable(fn):
            raise TypeError(f"pallaskit.jit expects a callable, got {type(fn).__name__}")
        self.fn = fn
        self._sig = _signature(fn)
        # jax.jit checks the arguments (types, ranges, names, static/donated
        # overlap) and raises its own errors; pallaskit then resolves them the same way.
        sharding_kw = {k: v for k, v in (("in_shardings", in_shardings), ("out_shardings", out_shardings))
                       if v is not xla_args.UNSET}
        jax.jit(fn, static_argnums=static_argnums, static_argnames=static_argnames, donate_argnums=donate_argnums,
                donate_argnames=donate_argnames, keep_unused=keep_unused, **sharding_kw)
        self.static_argnums, self.static_argnames = _infer_argnums(self._sig, static_argnums, static_argnames)
        self.donate_argnums, self.donate_argnames = _infer_argnums(self._sig, donate_argnums, donate_argnames)
        self.static_argnums = tuple(sorted({i if i >= 0 or self._sig is None else i + _n_positional(self._sig)
                                            for i in self.static_argnums}))
        self.donate_argnums = tuple(sorted({i if i >= 0 or self._sig is None else i + _n_positional(self._sig)
                                            for i in self.donate_argnums}))
        self.keep_unused, self.in_shardings, self.out_shardings = bool(keep_unused), in_shardings, out_shardings
        # Traces the function: jax.jit keeps its signature and argument names
        # (debug info), so errors raised while tracing name the user's function
        # and arguments, not pallaskit's flat wrapper.
        self._tracer = jax.jit(fn, static_argnums=self.static_argnums, static_argnames=self.static_argnames)
        self.dynamic = _resolve_dynamic(self._sig, dynamic, self.static_argnums, self.static_argnames)
        self._sym: dict = {}  # symbolic signature -> Compiled, or None: compiled per size instead
        self._seen: dict = {}  # automatic dynamic: signature skeleton -> the distinct shapes seen
        self._logged: set = set()  # automatic dynamic axes already announced
        self._cache: dict = {}
        self._fast: dict = {}  # _fast_key -> Compiled, filled by calls that went through _cache
        self._xla: dict = {}  # (treedef, n_args) -> XlaArgs
        # jax.jit's C++ dispatch, with the Python call as its miss ([Note: the call fast
        # path]); static arguments keep the Python call (pallaskit tells 1 from True, C++ does not).
        self._cpp = None
        if not self.static_argnums and not self.static_argnames:
            self._cpp = fastpath.cpp_function(self._title(), _python_call(self), self._cache_miss)
        # updated=(): a function wrapping a JitFunction (jax.grad(f) of one) carries its
        # __dict__ (fn, _cache); copying that would make this one run the wrapped function.
        functools.update_wrapper(self, fn, updated=())

    def _xla_args(self, treedef, n_args) -> xla_args.XlaArgs:
        """Donation and shardings of a call signature ([Note: XLA arguments])."""
        k = (treedef, n_args)
        out = self._xla.get(k)
        if out is None:
            out = self._xla[k] = xla_args.resolve(
                treedef, n_args, self.static_argnums, self.donate_argnums, self.donate_argnames, self.in_shardings,
                self.out_shardings, self.keep_unused, self._title())
        return out

    # -- signature --------------------------------------------------------------
    def _split(self, args, kwargs):
        """Separate static from dynamic arguments; checks every dynamic leaf."""
        static_pos = tuple((i, signature.hashable(args[i])) for i in self.static_argnums if i < len(args))
        static_kw = tuple(sorted((k, signature.hashable(v)) for k, v in kwargs.items() if k in self.static_argnames))
        dyn_args = [a for i, a in enumerate(args) if i not in self.static_argnums]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path((dyn_args, dyn_kwargs))
        leaves, avals = [], []
        dyn_positions = [i for i in range(len(args)) if i not in self.static_argnums]
        for path, leaf in leaves_with_path:
            avals.append(_abstractify(leaf, _describe(path, dyn_positions, self._sig)))
            leaves.append(leaf)
        key = (treedef, tuple(avals), static_pos, static_kw, len(args))
        return key, leaves, avals, treedef, static_pos, static_kw

    def __call__(self, *args, **kwargs):
        cpp = self._cpp
        if cpp is None:
            return self._call(args, kwargs)[0]
        return cpp(*args, **kwargs)  # [Note: the call fast path] in runtime/fastpath.py

    def _cache_miss(self, *args, **kwargs):
        """The C++ call's miss: the Python call, and the executable that C++ may
        run itself for this signature from now on (None: come back here)."""
        out, entry, outs = self._call(args, kwargs)
        data = None
        if entry is not None and not entry.constants and not entry.delete_after:
            data = fastpath.fastpath_data(entry.executable, entry.out_tree, outs)
        return out, data, False

    def _call(self, args, kwargs):
        """(result, the Compiled entry that ran or None, its flat outputs)."""
        fast = self._fast_key(args, kwargs)
        if fast is not None:
            entry = self._fast.get(fast[0])
            if entry is not None:  # a signature seen before, concrete arrays
                outs = entry.executable(*fast[1], *entry.constants)
                if entry.delete_after:
                    xla_args.delete_donated(fast[1], entry.delete_after, outs)
                return jax.tree_util.tree_unflatten(entry.out_tree, outs), entry, outs
        key, leaves, avals, treedef, static_pos, static_kw = self._split(args, kwargs)
        why = sharding.xla_only(leaves, autodiff.transformed(leaves), compile_options)
        if why:  # [Note: sharding] in pallaskit/sharding.py
            return autodiff.fallback(self, args, kwargs, why), None, None
        if autodiff.transformed(leaves):  # grad / jvp / vmap tracers: pallaskit/autodiff.py
            return autodiff.call(self, args, kwargs), None, None
        if autodiff.staged(leaves):  # jax.jit tracers: the AOT executable takes none
            return autodiff.call_staged(self, args, kwargs), None, None
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise TypeError("pallaskit.jit: a call needs arrays; jax.ShapeDtypeStruct arguments are for "
                            "pallaskit.explain and lower_to_result")
        placement = sharding.placement(leaves)  # [Note: sharding] in pallaskit/sharding.py
        if placement is not None:
            key = (*key, placement)
        entry = self._cache.get(key)
        if entry is None:
            if placement is None:
                entry = self._dynamic_entry(leaves, avals, treedef, static_pos, static_kw, len(args))
            if entry is None:
                entry = self._compile(avals, treedef, static_pos, static_kw, len(args),
                                      xla=self._xla_args(treedef, len(args)), placement=placement)
            self._cache[key] = entry
        outs = entry.executable(*leaves, *entry.constants)
        if entry.delete_after:
            xla_args.delete_donated(leaves, entry.delete_after, outs)
        if not entry.ran:
            entry.ran = True
            metrics.counters["kernels_compiled"] += len(entry.result.program.kernels)
        if fast is not None:
            self._fast[fast[0]] = entry
        return jax.tree_util.tree_unflatten(entry.out_tree, outs), entry, outs

    def _fast_key(self, args, kwargs):
        """(key, leaves) of a call whose dynamic leaves are all concrete
        ``jax.Array``s and that has no static arguments, from the arrays' own
        avals; None otherwise. It skips ``_split``'s per-leaf checks and
        argument descriptions, which cost more than the dispatch itself."""
        if self.static_argnums or self.static_argnames:
            return None
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        array = _array_type(leaves)
        if array is None or not all(type(x) is array for x in leaves):
            return None
        return (treedef, tuple(x.aval for x in leaves), sharding.fast_placement(leaves)), leaves

    # -- ahead of time (jax.stages) ---------------------------------------------
    def trace(self, *args, **kwargs):
        """``jax.jit(f).trace``: a ``pallaskit.stages.Traced`` (``.jaxpr``,
        ``.out_info``, ``.lower()``); arrays or ``jax.ShapeDtypeStruct``s."""
        from pallaskit import stages

        return stages.Traced(stages._Signature(self, args, kwargs))

    def lower(self, *args, **kwargs):
        """``jax.jit(f).lower``: pallaskit's program lowered to StableHLO, a
        ``pallaskit.stages.Lowered`` (``as_text``, ``cost_analysis``, ``compile``)."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args, **kwargs):
        """The outputs' shapes and dtypes (``jax.ShapeDtypeStruct``s), nothing compiled."""
        return self._tracer.eval_shape(*args, **kwargs)

    def lower_to_result(self, *args, **kwargs) -> Compiled:
        key, leaves, avals, treedef, static_pos, static_kw = self._split(args, kwargs)
        entry = self._cache.get(key)
        if entry is not None and entry.result is None:  # loaded from the disk cache: run the compiler for it
            return self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
        if entry is None:
            entry = self._dynamic_entry(leaves, avals, treedef, static_pos, static_kw, len(args))
            if entry is not None and entry.result is None:  # an eager program from the disk cache
                return self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
            if entry is None:
                entry = self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False,
                                      xla=self._xla_args(treedef, len(args)))
            self._cache[key] = entry
        return entry

    # -- dynamic dims -------------------------------------------------------------
    # [Note: dynamic dims]
    # A call's dynamic axes (``dynamic=`` and automatic ones) map to symbol names.
    # The first call of a *symbolic signature* (the concrete one with those axes
    # replaced by their symbols) traces the function with
    # ``jax.export.symbolic_shape`` dims and compiles it once: lowering keeps the
    # sizes as sympy symbols ([Note: symbolic dims] in lowering/symbolic.py),
    # heuristics read them at hinted sizes (``size_hints``: one compiled variant
    # per ``multi_kernel_hints`` entry, a dispatcher picking one per new size,
    # [Note: multi-kernel] in runtime/multikernel.py; or the first call's), and the
    # rendered program reads each size from an input's ``.shape``, computes grids
    # and output shapes from it and hands it to kernels as an int32 operand. The
    # Compiled entry (``jax.jit`` of that program) then serves every concrete
    # signature of the symbolic one: a new size re-traces the program under
    # jax.jit (JAX's own per-shape executable) but runs no pallaskit compile and
    # makes no new kernel (``graphs_compiled`` / ``kernels_compiled``). Per
    # concrete signature, before it is served: equal symbols have equal sizes
    # (else ValueError), sizes are >= 1, and the program's guards hold (int32
    # indexing); a failing size compiles statically for itself. A symbolic
    # signature that cannot compile (a jax trace that needs more of the size, a
    # symbolic extern parameter, argmax over the dynamic axis...) is remembered
    # as None: its sizes compile one by one (``dynamic_fallbacks``, one warning).
    # Symbolic graphs bypass the disk cache (executables are per size), except
    # for the eager program of one served by eager launches ([Note: eager
    # program cache] in runtime/eager.py).
    def _dynamic_entry(self, leaves, avals, treedef, static_pos, static_kw, n_args) -> Compiled | None:
        """The symbolic graph serving this call's concrete signature, compiled
        on first use; None when the call has no dynamic axis, when the symbolic
        program cannot serve it (a guard fails: a size 0, an index past int32)
        or when the signature could not be compiled symbolically: the caller
        then compiles the concrete signature."""
        axes, automatic = self._dynamic_axes(leaves, avals, treedef, static_pos, static_kw, n_args)
        if not axes:
            return None
        values = {}
        where = {}
        for (leaf, axis), sym in axes.items():
            size = int(avals[leaf].shape[axis])
            if sym in values and values[sym] != size:
                raise ValueError(f"pallaskit.jit: dynamic size {sym!r} is {values[sym]} for {where[sym]} but {size} "
                                 f"for {self._leaf_name(leaf, treedef, n_args, static_pos)} axis {axis}; "
                                 f"axes sharing a symbol in dynamic= must have equal sizes")
            values[sym] = size
            where.setdefault(sym, f"{self._leaf_name(leaf, treedef, n_args, static_pos)} axis {axis}")
        if any(v < 1 for v in values.values()):  # symbols are >= 1 (jax.export's default constraint)
            log.debug("pallaskit: %s: a dynamic size is 0; compiling this size on its own", self._title())
            return None
        shapes = tuple((a.dtype, bool(a.weak_type), tuple(axes.get((i, k), d) if (i, k) in axes else int(d)
                                                        for k, d in enumerate(a.shape)))
                       for i, a in enumerate(avals))
        sym_key = (treedef, shapes, static_pos, static_kw, n_args)
        if sym_key not in self._sym:
            options = compile_options()
            if automatic and not options.interpret and not _eager_wanted(options):
                entry = None  # no eager launches possible: nothing to gain (below); compile per size
                metrics.counters["dynamic_fallbacks"] += 1
            else:
                entry = self._compile_symbolic(avals, axes, values, treedef, static_pos, static_kw, n_args,
                                               automatic)
            if entry is not None and automatic and not _serves_new_sizes_at_once(entry):
                # Automatic dynamic pays off where a new size runs at once (eager
                # launches) or costs no pallaskit compile for XLA to wait on (interpret
                # mode); on a GPU without eager launches a new size would still wait for
                # XLA while every size ran the size-hinted kernels: compile per size.
                metrics.counters["dynamic_fallbacks"] += 1
                log.info("pallaskit: %s: no eager launches for its dynamic program; compiling each size on its "
                         "own", self._title())
                entry = None
            self._sym[sym_key] = entry
            dispatcher = getattr(self._sym[sym_key], "executable", None)
            if getattr(dispatcher, "eager", None) is not None and config.dynamic_tier_up == "static":
                dispatcher.compile_static = functools.partial(self._compile_static, treedef, static_pos, static_kw,
                                                              n_args)
        entry = self._sym[sym_key]
        if entry is None:
            return None
        if not all(eval(g, {}, dict(values)) for g in entry.guards) or not _shape_guards_hold(entry, values):
            metrics.counters["dynamic_guard_failures"] += 1
            log.info("pallaskit: %s: sizes %s break a guard of the symbolic program; compiling them on their own",
                     self._title(), values)
            return None
        return entry

    def _compile_static(self, treedef, static_pos, static_kw, n_args, leaves):
        """A recurring size's own static program, compiled on the background
        thread ([Note: eager launches] in runtime/eager.py); returns (executable,
        constants) for the dispatcher, and files the entry under the call's keys
        so the size's later calls skip the dispatcher, as a static signature's do."""
        avals = [_abstractify(x, "an argument") for x in leaves]
        entry = self._compile(avals, treedef, static_pos, static_kw, n_args, xla=self._xla_args(treedef, n_args))
        self._cache[(treedef, tuple(avals), static_pos, static_kw, n_args)] = entry
        array = _array_type(leaves)
        if not static_pos and not static_kw and array is not None and all(type(x) is array for x in leaves):
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            fast_tree = jax.tree_util.tree_structure((tuple(dyn_args), dyn_kwargs))
            self._fast[(fast_tree, tuple(x.aval for x in leaves), sharding.fast_placement(leaves))] = entry
        return entry.executable, entry.constants

    def _title(self):
        return getattr(self.fn, "__qualname__", "fn")

    def _leaf_name(self, leaf, treedef, n_args, static_pos) -> str:
        paths = self._leaf_paths(treedef)
        dyn_positions = [i for i in range(n_args) if i not in self.static_argnums]
        return _describe(paths[leaf], dyn_positions, self._sig)

    @staticmethod
    def _leaf_paths(treedef):
        dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
        return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]

    def _dynamic_axes(self, leaves, avals, treedef, static_pos, static_kw, n_args) -> tuple[dict, bool]:
        """({(leaf, axis): symbol name}, whether automatic axes are among them)
        of this call: the ``dynamic=`` axes, plus automatic ones (an axis seen
        with a second distinct size; option ``automatic_dynamic``)."""
        paths = self._leaf_paths(treedef)
        dyn_positions = [i for i in range(n_args) if i not in self.static_argnums]
        axes = {}
        if self.dynamic:
            names = list(self._sig.parameters) if self._sig is not None else []
            for leaf, path in enumerate(paths):
                if len(path) < 2:
                    continue
                if getattr(path[0], "idx", None) == 0:
                    pos = dyn_positions[path[1].idx] if path[1].idx < len(dyn_positions) else path[1].idx
                    ids = [pos] + ([names[pos]] if pos < len(names) else [])
                else:
                    ids = [path[1].key]
                    if path[1].key in names:
                        ids.append(names.index(path[1].key))
                spec = next((self.dynamic[i] for i in ids if i in self.dynamic), None)
                if spec is None:
                    continue
                what = _describe(path, dyn_positions, self._sig)
                if len(path) > 2:
                    raise ValueError(f"pallaskit.jit: dynamic= names {what.split('[')[0]}, which is a pytree; "
                                     f"dynamic axes apply to array arguments")
                ndim = len(avals[leaf].shape)
                for axis, sym in spec.items():
                    a = axis + ndim if axis < 0 else axis
                    if not 0 <= a < ndim:
                        raise ValueError(f"pallaskit.jit: dynamic= axis {axis} of {what} is out of range for its "
                                         f"{ndim}-d shape {tuple(avals[leaf].shape)}")
                    axes[(leaf, a)] = sym
        automatic = {}
        if config.automatic_dynamic:
            automatic = self._automatic_axes(avals, treedef, static_pos, static_kw, n_args, paths, dyn_positions,
                                             set(axes), set(axes.values()))
            axes.update(automatic)
        return axes, bool(automatic)

    def _automatic_axes(self, avals, treedef, static_pos, static_kw, n_args, paths, dyn_positions, taken, used):
        """Automatic dynamic: the axes whose size differs between the calls
        seen with this signature skeleton (everything but sizes equal). Axes
        whose sizes were equal in every call seen share a symbol (a fresh
        symbol each would not trace: ``x + y`` needs equal sizes)."""
        skeleton = (treedef, tuple((a.dtype, bool(a.weak_type), len(a.shape)) for a in avals),
                    static_pos, static_kw, n_args)
        shape = tuple(tuple(int(d) for d in a.shape) for a in avals)
        seen = self._seen.setdefault(skeleton, [])
        if shape not in seen:
            seen.append(shape)
        if len(seen) < 2:
            return {}
        groups: dict = {}
        for leaf, a in enumerate(avals):
            for axis in range(len(a.shape)):
                sizes_seen = tuple(s[leaf][axis] for s in seen)
                if (leaf, axis) in taken or len(set(sizes_seen)) == 1:
                    continue
                groups.setdefault(sizes_seen, []).append((leaf, axis))
        out = {}
        for members in groups.values():
            leaf, axis = members[0]
            base = re.sub(r"\W+", "_", _describe(paths[leaf], dyn_positions, self._sig).replace("argument ", ""))
            name = f"{base.strip('_') or 'arg'}_d{axis}"
            if not _valid_symbol(name):
                name = f"s_{name}"
            while name in used:
                name += "_"
            used.add(name)
            for m in members:
                out[m] = name
        marker = (skeleton, tuple(sorted(out.items())))
        if out and marker not in self._logged:
            self._logged.add(marker)
            log.info("pallaskit: %s: %s seen with a second size; compiling it once with %s dynamic",
                     self._title(), ", ".join(sorted({f"{_describe(paths[l], dyn_positions, self._sig)} axis {k}"
                                                      for l, k in out})), ", ".join(sorted(set(out.values()))))
        return out

    def _compile_symbolic(self, avals, axes, values, treedef, static_pos, static_kw, n_args,
                          automatic=False) -> Compiled | None:
        """Trace with ``jax.export.symbolic_shape`` dims and compile once; None
        (the signature then compiles per size) when it cannot, with one log line
        (a warning for ``dynamic=``; for automatic axes, which the user did not
        ask for, an info line)."""
        names = sorted(set(axes.values()))
        try:
            dims = dict(zip(names, jax.export.symbolic_shape(", ".join(names))))
            structs = []
            for i, a in enumerate(avals):
                shape = tuple(dims[axes[(i, k)]] if (i, k) in axes else int(d) for k, d in enumerate(a.shape))
                structs.append(jax.ShapeDtypeStruct(shape, a.dtype, weak_type=a.weak_type))
            # Multi-kernel ([Note: multi-kernel] in runtime/multikernel.py): one
            # variant per hinted size, every symbol at that size; none given:
            # one variant at this call's sizes.
            hinted = [int(h) for h in config.multi_kernel_hints.split(",") if h]
            variants = [tuple((n, h) for n in names) for h in hinted] or [tuple(sorted(values.items()))]
            positions = {}
            for (leaf, axis), sym in sorted(axes.items()):
                positions.setdefault(sym, (leaf, axis))
            return self._compile(avals, treedef, static_pos, static_kw, n_args, aot=False,
                                 structs=structs, size_hints=variants[0], variants=variants,
                                 positions=[(n, positions[n]) for n in names], first_sizes=values,
                                 xla=self._xla_args(treedef, n_args))
        except Exception as e:  # noqa: BLE001  (anything the symbolic path cannot take: per-size compiles)
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            metrics.counters["dynamic_fallbacks"] += 1
            log.log(logging.INFO if automatic else logging.WARNING, "pallaskit: %s cannot be compiled with dynamic %s (%s); compiling each size on its own",
                        self._title(), ", ".join(names), reason)
            return None

    def _trace(self, structs, treedef, static_pos, static_kw, n_args):
        """(closed jaxpr of the flat dynamic leaves, output treedef) of the
        function at ``structs`` (one per flat dynamic leaf). Traced by
        ``jax.jit(fn).trace``, which keeps the function's signature: errors
        raised by the user's code name the function and its arguments."""
        full, kwargs = signature.full_args(structs, treedef, static_pos, static_kw, n_args)
        traced = self._tracer.trace(*full, **kwargs)
        return traced.jaxpr, jax.tree_util.tree_structure(traced.out_info)

    def _trace_symbolic(self, structs, treedef, static_pos, static_kw, n_args):
        """``_trace`` at symbolic shapes, also returning the shape guards
        ([Note: shape equality guards]); raises when they cannot be recorded."""
        if not _install_eq_recorder():
            raise lowering.SymbolicUnsupported("this jax's symbolic dims cannot be guarded")
        _EQ_RECORD.diffs = diffs = []
        try:
            closed, out_tree = self._trace(structs, treedef, static_pos, static_kw, n_args)
        finally:
            _EQ_RECORD.diffs = None
        return closed, out_tree, list({str(d): d for d in diffs}.values())

    def _compile(self, avals, treedef, static_pos, static_kw, n_args, aot=True, structs=None,
                 size_hints=(), variants=None, positions=(), first_sizes=None, xla=None,
                 traced=None, placement=None) -> Compiled:
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
        which join ``xla`` for the lowering."""
        options = compile_options()
        if size_hints:
            options = dataclasses.replace(options, size_hints=tuple(size_hints))
        t0 = time.perf_counter()
        symbolic = structs is not None
        if structs is None:
            structs = [sharding.struct_of(a) for a in avals]  # keeps shard_map's varying axes
        shape_guards = []
        if traced is not None:
            closed, out_tree = traced
        elif symbolic:
            closed, out_tree, shape_guards = self._trace_symbolic(structs, treedef, static_pos, static_kw, n_args)
        else:
            with sharding.trace_context(placement):
                closed, out_tree = self._trace(structs, treedef, static_pos, static_kw, n_args)
        out_tree_box = [out_tree]
        metrics.counters["trace_seconds"] += time.perf_counter() - t0
        title = getattr(self.fn, "__qualname__", "fn")

        def build(options=options, jaxpr=None):  # jaxpr: a per-shard plan's local one ([Note: per-shard kernels])
            result = lowering.compile_jaxpr(jaxpr or closed, options, title)
            call = loader.load_lazily(result.program)
            constants = [result.schedule.graph.constants[n] for n in result.schedule.graph.inputs
                         if n in result.schedule.graph.constants]
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
            lazy = bool(first_sizes) and _eager_wanted(options) and config.dynamic_tier_up == "static"
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
                    dispatcher = multikernel.Dispatcher(title, symbols, where, len(avals), [], options.interpret)
                    dispatcher.eager = hit
                    dispatcher.fallback = functools.partial(
                        self._compile, avals, treedef, static_pos, static_kw, n_args, aot=False, structs=structs,
                        size_hints=size_hints, variants=variants, positions=positions)
                    metrics.counters["eager_cache_hits"] += 1
                    metrics.counters["compile_seconds"] += time.perf_counter() - t0
                    return Compiled(None, closed, dispatcher, [], out_tree_box[-1], ran=True,
                                    guards=[compile(g, "<guard>", "eval") for g in hit.guards],
                                    delete_after=xla.donate if xla else (), shape_guards=shape_guards)
            if lazy and not options.interpret:
                from pallaskit.runtime import triton_launch

                triton_launch.warm_up()  # overlaps this compile; its kernels compile after it
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
            elif eager_program is not None and eager_key is not None:
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
                return Compiled(result, closed, cache.jit(call, xla, len(constants)), constants, out_tree_box[-1],
                                guards=guards, shape_guards=shape_guards)
            variants_ = [multikernel.Variant(b[3], cache.jit(b[1], None, len(constants)), b[2], src,
                                             [k.source for k in b[0].program.kernels])
                         for src, b in built.items()]
            dispatcher = multikernel.Dispatcher(title, symbols, where, len(avals), variants_, options.interpret)
            if eager_program is not None:
                dispatcher.eager, dispatcher.eager_constants = eager_program
            # ran=True: the dispatcher counts kernels_compiled (distinct kernels of all variants) on its first call.
            # The dispatcher may run a size's variants on the arguments (timing), so no
            # executable under it takes donation: the donated arrays are deleted after the call.
            return Compiled(result, closed, dispatcher, constants, out_tree_box[-1], ran=True, guards=guards,
                            delete_after=xla.donate if xla else (), shape_guards=shape_guards)
        if aot:
            if placement is None and sharding.mentions_mesh(closed):  # e.g. with_sharding_constraint
                placement = (None,) * len(avals)
            if placement is not None:
                xla = (xla or xla_args.XlaArgs()).with_placement(
                    placement, signature.flat_function(self.fn, treedef, static_pos, static_kw, n_args), avals)
                build = per_shard.attach(xla.placed, closed, avals, build, options, config.shard_kernels, title)
            served = cache.serve(closed, avals, static_pos + static_kw, options, title, build, t0, xla=xla,
                                 load_program=loader.load)
            if served.result is None and config.debug_dir:  # a cache hit: what the entry keeps
                _dump(config.debug_dir, title, closed, None, served.source)
            log.debug("pallaskit served %s in %.3fs (cache: %s)", title, time.perf_counter() - t0, served.cache)
            return Compiled(served.result, closed, served.executable, served.constants, out_tree_box[-1], ran=True)
        result, call, constants = build()
        metrics.apply_deltas(metrics.graph_deltas(result))
        return Compiled(result, closed, cache.jit(call, xla, len(constants)), constants, out_tree_box[-1])


# [Note: shape equality guards]
# jax's symbolic dims answer ``==`` with False when they cannot decide it (its
# ``__eq__`` may not raise: hashing uses it), so a trace at symbolic shapes
# takes the user's ``if x.shape[0] == 1`` as false for every size, and the
# symbolic program would be wrong at size 1. While pallaskit traces at symbolic
# shapes, ``_DimExpr.__eq__`` also records the difference of each pair it
# called unequal without deciding it, when the comparison comes from outside
# jax (the user's code or a library's; jax's own code is written for symbolic
# dims, where "not known equal" is what it asks, e.g. broadcasting's ``d == 1``);
# a call whose sizes make any recorded difference zero compiles statically for
# those sizes instead, as torch's guards do. Ordered comparisons (<, >=, ...)
# raise when undecidable, and the trace then falls back to static compiles.
# Recording is per thread.
_EQ_RECORD = threading.local()
_JAX_DIR = os.path.dirname(jax.__file__) + os.sep


def _asked_outside_jax() -> bool:
    """Is the innermost frame outside jax's package (past ``__eq__``/``__ne__``
    of the dims) one of the user's code or another library?"""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith("shape_poly.py"):
        frame = frame.f_back
    return frame is not None and not frame.f_code.co_filename.startswith(_JAX_DIR)


def _install_eq_recorder() -> bool:
    """Wrap ``_DimExpr.__eq__`` once; False where this jax's class is not there."""
    try:
        from jax._src.export import shape_poly
        cls = shape_poly._DimExpr
    except (ImportError, AttributeError):
        return False
    if getattr(cls.__eq__, "_pallaskit_recorder", False):
        return True
    original = cls.__eq__

    def __eq__(self, other):
        result = original(self, other)
        diffs = getattr(_EQ_RECORD, "diffs", None)
        if (diffs is not None and result is False and not getattr(_EQ_RECORD, "busy", False)
                and _asked_outside_jax()):
            _EQ_RECORD.busy = True
            try:
                diff = self - other
                if jax.export.is_symbolic_dim(diff):
                    diffs.append(diff)
            except Exception:  # noqa: BLE001  (another scope, a non-dim operand: decided, nothing to guard)
                pass
            finally:
                _EQ_RECORD.busy = False
        return result

    __eq__._pallaskit_recorder = True
    cls.__eq__ = __eq__
    return True


def _shape_guards_hold(entry: Compiled, values: dict) -> bool:
    """Does no shape guard's difference vanish at these sizes? (An expression
    that cannot be evaluated counts as broken: a static compile is always right.)"""
    for diff in entry.shape_guards:
        try:
            evaluate = getattr(diff, "_evaluate", None) or diff.evaluate
            if int(evaluate(values)) == 0:
                return False
        except Exception:  # noqa: BLE001
            return False
    return True


def _serves_new_sizes_at_once(entry: Compiled) -> bool:
    """Does this symbolic entry serve a new size without pallaskit's compiler and
    its XLA wait per size: eager launches (a GPU), or interpret mode (the CPU)?"""
    return getattr(entry.executable, "eager", None) is not None or compile_options().interpret


def _eager_wanted(options) -> bool:
    """Should a symbolic program run new sizes eagerly (option ``dynamic_launch``)?"""
    return executors.eager(config.dynamic_launch, options).executor == executors.TRITON_EAGER


def _eager_program(title: str, built: dict, options, first_sizes: dict):
    """(EagerProgram, its constants) of the variant nearest ``first_sizes`` among
    those whose kernels all render to raw Triton, or None ([Note: eager
    launches] in runtime/eager.py; option ``dynamic_launch``)."""
    if not _eager_wanted(options):
        return None
    mode = config.dynamic_launch
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


def _python_call(jf):
    """What the C++ call runs where jit is disabled: the Python call."""
    def python_call(*args, **kwargs):
        return jf._call(args, kwargs)[0]

    return python_call


def jit(fn: Callable | None = None, *, in_shardings=xla_args.UNSET, out_shardings=xla_args.UNSET,
        static_argnums: int | Sequence[int] | None = None, static_argnames: str | Sequence[str] | None = None,
        donate_argnums: int | Sequence[int] | None = None, donate_argnames: str | Sequence[str] | None = None,
        keep_unused: bool = False, dynamic: dict | None = None):
    """Compile ``fn`` with pallaskit. Usable as ``@pallaskit.jit``,
    ``@pallaskit.jit(static_argnums=...)`` or ``pallaskit.jit(fn, ...)``.

    The arguments ``jax.jit`` shares mean what they mean there, checked the
    same way (the same errors): ``static_argnums`` / ``static_argnames``,
    ``donate_argnums`` / ``donate_argnames`` (a donated argument's buffers may
    hold the outputs; the caller's array is deleted by the call),
    ``in_shardings`` / ``out_shardings`` and ``keep_unused`` (forwarded to the
    XLA executable, [Note: XLA arguments] in pallaskit/runtime/xla_args.py).
    The result has jax.jit's ``trace``, ``lower`` (then ``compile``) and
    ``eval_shape``.

    ``dynamic``: axes whose size may change between calls without a new
    compilation, ``{argument: {axis: "symbol"}}`` (argument by name or
    position; one symbol name means one size, checked at every call), e.g.
    ``dynamic={"x": {0: "n"}, "labels": {0: "n"}}``. Option
    ``automatic_dynamic`` also makes an axis dynamic once it was seen with a
    second size. [Note: dynamic dims]"""
    def make(f):
        return JitFunction(f, static_argnums, static_argnames, dynamic, donate_argnums=donate_argnums,
                           donate_argnames=donate_argnames, keep_unused=keep_unused, in_shardings=in_shardings,
                           out_shardings=out_shardings)

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


# Names generated code uses; a dim symbol (a variable in kernels and the
# wrapper) must not shadow them.
_RESERVED = frozenset({
    "pid", "xr", "xc", "xb", "xk", "rmask", "cmask", "col_blocks", "ROWS", "COLS", "BLOCK_R", "BLOCK_C", "IDX",
    "PROGRAMS", "program", "chunk", "carry", "step", "row_block", "dims_ptr", "jax", "jnp", "lax", "pl", "plt", "np",
    "ANY", "INTERPRET", "EXTERNS", "call", "sympy",
    # the matmul template's names, and the Triton renderer's (lowering/codegen/triton.py)
    "M", "N", "K", "M_BLOCKS", "K_BLOCKS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "first_m", "group_rows",
    "pid_m", "pid_n", "tile", "xra", "xcb", "ka", "kb", "a", "b", "mm", "tl", "triton", "launch", "run",
    "kernels", "range"})
_RESERVED_PATTERN = re.compile(r"^(i|r|tmp|idx|mask|cst|red|acc|phase|in_ptr|out_ptr|arg|const|buf|in)\d+$")


def _valid_symbol(name) -> bool:
    return (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)
            and not name.startswith("_") and name not in _RESERVED and not _RESERVED_PATTERN.match(name))


def _resolve_dynamic(sig, dynamic, static_argnums, static_argnames) -> dict:
    """``dynamic=`` checked and normalized: {argument name or position: {axis: symbol}}."""
    if dynamic is None:
        return {}
    if not isinstance(dynamic, dict):
        raise TypeError(f"pallaskit.jit: dynamic= must be a dict {{argument: {{axis: 'symbol'}}}}, "
                        f"got {type(dynamic).__name__}")
    params = list(sig.parameters.values()) if sig is not None else None
    positional = [p.name for p in params or [] if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = params is not None and any(p.kind == p.VAR_POSITIONAL for p in params)
    var_kw = params is not None and any(p.kind == p.VAR_KEYWORD for p in params)
    out = {}
    for arg, spec in dynamic.items():
        if isinstance(arg, bool) or not isinstance(arg, (int, str)):
            raise TypeError(f"pallaskit.jit: dynamic= keys are argument names or positions, got {arg!r}")
        if params is not None:
            if isinstance(arg, str) and arg not in sig.parameters and not var_kw:
                raise ValueError(f"pallaskit.jit: dynamic= names argument {arg!r}, but "
                                 f"{getattr(sig, 'name', 'the function')} takes ({', '.join(sig.parameters)})")
            if isinstance(arg, int) and not var_pos and not -len(positional) <= arg < len(positional):
                raise ValueError(f"pallaskit.jit: dynamic= names argument position {arg}, but the function "
                                 f"takes {len(positional)} positional argument(s)")
        if isinstance(arg, int) and arg < 0:
            arg += len(positional)
        if arg in static_argnames or arg in static_argnums:
            raise ValueError(f"pallaskit.jit: argument {arg!r} is static; it cannot have dynamic axes")
        key = arg
        if isinstance(arg, int) and arg < len(positional):
            key = positional[arg]  # by name: a keyword call of the same argument finds it too
        if isinstance(spec, (tuple, list)) and spec and all(isinstance(a, int) for a in spec):
            # Axes alone: a symbol of its own per axis, named after the argument.
            base = key if isinstance(key, str) and key.isidentifier() and not key.startswith("_") else f"arg{key}"
            spec = {a: f"{base}_d{a}" if a >= 0 else f"{base}_dm{-a}" for a in spec}
        if not isinstance(spec, dict) or not spec:
            raise TypeError(f"pallaskit.jit: dynamic=[{arg!r}] must be a non-empty dict {{axis: 'symbol'}} "
                            f"(or a tuple of axes), got {spec!r}")
        for axis, sym in spec.items():
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise TypeError(f"pallaskit.jit: dynamic=[{arg!r}] axes are ints, got {axis!r}")
            if not isinstance(sym, str):
                raise TypeError(f"pallaskit.jit: dynamic=[{arg!r}][{axis}] must be a symbol name (str), got {sym!r}")
            if not _valid_symbol(sym):
                raise ValueError(f"pallaskit.jit: dynamic symbol {sym!r} is not usable: it must be a Python "
                                 f"identifier, not a keyword, not starting with '_', and not a name generated "
                                 f"code uses (such as i0, xr, pid, jnp)")
        if key in out:
            raise ValueError(f"pallaskit.jit: dynamic= gives argument {key!r} twice")
        out[key] = dict(spec)
    return out


def _describe(path, dyn_positions, sig) -> str:
    """Human name of a leaf: the argument and the path inside it."""
    first = path[0].idx if hasattr(path[0], "idx") else 0  # 0: args, 1: kwargs
    rest = path[1:]
    if first == 0 and rest:
        pos = dyn_positions[rest[0].idx] if rest[0].idx < len(dyn_positions) else rest[0].idx
        name = f"argument {pos}"
        if sig is not None:
            names = list(sig.parameters)
            if pos < len(names) and sig.parameters[names[pos]].kind != inspect.Parameter.VAR_POSITIONAL:
                name = f"argument {names[pos]!r}"
        rest = rest[1:]
    elif rest:
        name = f"argument {rest[0].key!r}"
        rest = rest[1:]
    else:
        name = "argument"
    return name + jax.tree_util.keystr(tuple(rest))


_SCALARS = (bool, int, float, complex, np.generic)


_ARRAY_TYPE: list = []  # [the concrete array type], once an argument showed it


def _array_type(leaves) -> type | None:
    """The type of concrete arrays (``jax.Array`` is an abstract base that
    tracers also pass), taken from the first argument that is one; None until
    an argument was. Not ``type(jnp.zeros(()))``, an XLA compilation on the
    first call of every process, nor a ``device_put``."""
    if not _ARRAY_TYPE:
        concrete = [type(x) for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
        if not concrete:
            return None
        _ARRAY_TYPE.append(concrete[0])
    return _ARRAY_TYPE[0]


def _abstractify(leaf, where: str):
    # ShapeDtypeStruct: explain / lower_to_result need shapes only
    if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) or isinstance(leaf, _SCALARS):
        return jax.typeof(leaf) if hasattr(jax, "typeof") else jax.api_util.shaped_abstractify(leaf)
    if hasattr(leaf, "__jax_array__"):
        return jax.typeof(leaf.__jax_array__())
    raise TypeError(f"pallaskit.jit: {where} is a {type(leaf).__name__}, not an array or scalar; "
                    f"mark it static (static_argnums/static_argnames) or pass an array")


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
