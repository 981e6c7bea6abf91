"""``pallaskit.jit``: jax.jit's calling convention over pallaskit's compiler."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

import lowering
from lowering.options import CompileOptions
from pallaskit import cache, metrics
from pallaskit import autodiff
from pallaskit.config import config
from pallaskit.runtime import loader

log = logging.getLogger("pallaskit")


def compile_options() -> CompileOptions:
    """The compiler's options from the effective configuration: every
    ``CompileOptions`` field named like a config option takes its value."""
    snap = config.snapshot()
    values = {f.name: snap[f.name] for f in dataclasses.fields(CompileOptions) if f.name in snap}
    if values.get("interpret") == "auto":
        values["interpret"] = jax.default_backend() == "cpu"
    values["num_sms"] = values.get("num_sms") or _num_sms()
    return CompileOptions(**values)


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


class JitFunction:
    """A function compiled by pallaskit, with jax.jit's semantics."""

    def __init__(self, fn: Callable, static_argnums=(), static_argnames=()):
        if not callable(fn):
            raise TypeError(f"pallaskit.jit expects a callable, got {type(fn).__name__}")
        self.fn = fn
        self._sig = _signature(fn)
        self.static_argnums, self.static_argnames = _resolve_static(self._sig, static_argnums, static_argnames)
        self._cache: dict = {}
        self._fast: dict = {}  # _fast_key -> Compiled, filled by calls that went through _cache
        # updated=(): a function wrapping a JitFunction (jax.grad(f) of one) carries its
        # __dict__ (fn, _cache); copying that would make this one run the wrapped function.
        functools.update_wrapper(self, fn, updated=())

    # -- signature --------------------------------------------------------------
    def _split(self, args, kwargs):
        """Separate static from dynamic arguments; checks every dynamic leaf."""
        static_pos = tuple((i, _hashable(args[i], f"argument {i}")) for i in self.static_argnums if i < len(args))
        static_kw = tuple(sorted((k, _hashable(v, f"argument {k!r}")) for k, v in kwargs.items()
                                 if k in self.static_argnames))
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
        fast = self._fast_key(args, kwargs)
        if fast is not None:
            entry = self._fast.get(fast[0])
            if entry is not None:  # the steady state: a signature seen before, concrete arrays
                return jax.tree_util.tree_unflatten(entry.out_tree, entry.executable(*fast[1], *entry.constants))
        key, leaves, avals, treedef, static_pos, static_kw = self._split(args, kwargs)
        if autodiff.transformed(leaves):  # grad / jvp / vmap tracers: pallaskit/autodiff.py
            return autodiff.call(self, args, kwargs)
        if autodiff.staged(leaves):  # jax.jit tracers: the AOT executable takes none
            return autodiff.call_staged(self, args, kwargs)
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            raise TypeError("pallaskit.jit: a call needs arrays; jax.ShapeDtypeStruct arguments are for "
                            "pallaskit.explain and lower_to_result")
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(avals, treedef, static_pos, static_kw, len(args))
            self._cache[key] = entry
        outs = entry.executable(*leaves, *entry.constants)
        if not entry.ran:
            entry.ran = True
            metrics.counters["kernels_compiled"] += len(entry.result.program.kernels)
        if fast is not None:
            self._fast[fast[0]] = entry
        return jax.tree_util.tree_unflatten(entry.out_tree, outs)

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
        return (treedef, tuple(x.aval for x in leaves)), leaves

    def lower_to_result(self, *args, **kwargs) -> Compiled:
        key, leaves, avals, treedef, static_pos, static_kw = self._split(args, kwargs)
        entry = self._cache.get(key)
        if entry is not None and entry.result is None:  # loaded from the disk cache: run the compiler for it
            return self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
        if entry is None:
            entry = self._compile(avals, treedef, static_pos, static_kw, len(args), aot=False)
            self._cache[key] = entry
        return entry

    def _compile(self, avals, treedef, static_pos, static_kw, n_args, aot=True) -> Compiled:
        """Trace and compile one signature. ``aot``: compile the executable now,
        through the on-disk graph cache (``pallaskit/cache``), where a hit skips
        the compiler and XLA (``Compiled.result`` is then None); otherwise only
        run the compiler and jit its program lazily (``explain``)."""
        options = compile_options()
        out_tree_box = []
        static_pos_d = dict(static_pos)
        static_kw_d = {k: v.value if isinstance(v, _Static) else v for k, v in static_kw}

        def flat_fn(*leaves):
            dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            it = iter(dyn_args)
            full = [static_pos_d[i].value if i in static_pos_d else next(it) for i in range(n_args)]
            out = self.fn(*full, **dyn_kwargs, **static_kw_d)
            flat, tree = jax.tree_util.tree_flatten(out)
            out_tree_box.append(tree)
            return flat

        t0 = time.perf_counter()
        structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
        closed = jax.make_jaxpr(flat_fn)(*structs)
        metrics.counters["trace_seconds"] += time.perf_counter() - t0
        title = getattr(self.fn, "__qualname__", "fn")

        def build():
            result = lowering.compile_jaxpr(closed, options, title)
            call = loader.load(result.program)
            constants = [result.schedule.graph.constants[n] for n in result.schedule.graph.inputs
                         if n in result.schedule.graph.constants]
            _log_fallbacks(result.fallbacks)
            if config.debug_dir:
                _dump(config.debug_dir, title, closed, result)
            return result, call, constants

        if aot:
            served = cache.serve(closed, avals, static_pos + static_kw, options, title, build, t0)
            log.debug("pallaskit served %s in %.3fs (cache: %s)", title, time.perf_counter() - t0, served.cache)
            return Compiled(served.result, closed, served.executable, served.constants, out_tree_box[-1], ran=True)
        result, call, constants = build()
        metrics.apply_deltas(metrics.graph_deltas(result))
        return Compiled(result, closed, jax.jit(call), constants, out_tree_box[-1])


def jit(fn: Callable | None = None, *, static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = ()):
    """Compile ``fn`` with pallaskit. Usable as ``@pallaskit.jit``,
    ``@pallaskit.jit(static_argnums=...)`` or ``pallaskit.jit(fn, ...)``."""
    if fn is None:
        return lambda f: JitFunction(f, static_argnums, static_argnames)
    return JitFunction(fn, static_argnums, static_argnames)


# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #
@dataclasses.dataclass(frozen=True)
class _Static:
    value: Any

    def __hash__(self):
        return hash((type(self.value).__name__, self.value))

    def __eq__(self, other):
        return isinstance(other, _Static) and type(self.value) is type(other.value) and self.value == other.value


def _hashable(v, what):
    try:
        hash(v)
    except TypeError:
        raise TypeError(f"static {what} must be hashable, got {type(v).__name__}") from None
    return _Static(v)


def _signature(fn):
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _resolve_static(sig, argnums, argnames):
    argnums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    argnames = (argnames,) if isinstance(argnames, str) else tuple(argnames)
    if sig is not None:
        params = list(sig.parameters.values())
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        argnums = tuple(sorted({a if a >= 0 else len(names) + a for a in argnums}
                               | {names.index(n) for n in argnames if n in names}))
        argnames = tuple(sorted(set(argnames) | {names[i] for i in argnums if i < len(names)}))
    return argnums, argnames


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
    first call of every process (~15 ms), nor a ``device_put`` (~1 ms)."""
    if not _ARRAY_TYPE:
        concrete = [type(x) for x in leaves if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)]
        if not concrete:
            return None
        _ARRAY_TYPE.append(concrete[0])
    return _ARRAY_TYPE[0]


def _abstractify(leaf, where: str):
    if isinstance(leaf, jax.ShapeDtypeStruct):  # explain / lower_to_result need shapes only
        return jax.core.ShapedArray(leaf.shape, leaf.dtype, weak_type=leaf.weak_type)
    if isinstance(leaf, (jax.Array, np.ndarray)) or isinstance(leaf, _SCALARS):
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


def _dump(root, title, closed, result):
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in title)
    folder = os.path.join(root, f"{safe}_{metrics.counters['graphs_compiled']:03d}")
    os.makedirs(folder, exist_ok=True)
    files = {"jaxpr.txt": str(closed), "ir_before_fusion.txt": result.ir_before,
             "ir_after_fusion.txt": result.ir_after, "program.py": result.program.source}
    for name, text in files.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)
