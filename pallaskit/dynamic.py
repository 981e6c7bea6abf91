"""Dynamic dims ([Note: dynamic dims]): which axes of a call are symbolic, the
symbolic graph serving its concrete signatures, and ``dynamic=`` checked."""
from __future__ import annotations

import functools
import keyword
import logging
import re

import jax

from pallaskit import metrics, orchestrator, shape_guards, sharding, signature
from pallaskit.config import config
from pallaskit.executable import Compiled

log = logging.getLogger("pallaskit")

#----------------------------------------------------------
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
#
# [Note: dynamic speculation]
# Automatic dynamic compiles the symbolic program when a second size comes,
# and that size waits for it: on a GPU its trace, passes and, the most of it,
# Triton compiling the eager kernels. Option ``automatic_dynamic_speculate``
# (on by default) starts that work earlier, at a signature's first (static)
# compile, once the passes are done and before JAX lowers the program
# (``executable.aot_compile``'s ``while_compiling``): the lowering's wait for
# the raw-Triton kernels and XLA's compile after it leave the GIL free. It runs
# on a background thread (runtime/eager.py ``submit``), for a guess of the axes
# (``_guess_axes``: each argument's leading axis whose size no other axis has).
# The guess becomes the symbolic signature a second size changing exactly those
# axes would get (``_changed_axes``, same symbols), whose ``entry`` takes the
# result (waiting for it if unfinished) instead of compiling. Another second
# size compiles as usual; a guess that cannot compile is dropped silently. The
# cost is a compile that a function that never changes size does not need, off
# the calling thread: its eager kernels' Triton compiles
# (``EagerProgram.precompile``, on the compile threads, in their compile
# workers: [Note: compile workers] in runtime/triton_compile.py) off the GIL
# too, its trace and passes not: programs of more than
# ``SPECULATE_MAX_EQUATIONS`` equations are not guessed for. Measured in
# benchmarks/RESULTS.md, "Session 24": the dynamic sweep's second size no
# longer waits, and a small function's first call moves within the noise.


def entry(jf, leaves, avals, treedef, static_pos, static_kw, n_args) -> Compiled | None:
    """The symbolic graph serving this call's concrete signature, compiled
    on first use; None when the call has no dynamic axis, when the symbolic
    program cannot serve it (a guard fails: a size 0, an index past int32)
    or when the signature could not be compiled symbolically: the caller
    then compiles the concrete signature."""
    axes, automatic = _axes(jf, leaves, avals, treedef, static_pos, static_kw, n_args)
    if not axes:
        return None
    values = {}
    where = {}
    for (leaf, axis), sym in axes.items():
        size = int(avals[leaf].shape[axis])
        if sym in values and values[sym] != size:
            raise ValueError(f"pallaskit.jit: dynamic size {sym!r} is {values[sym]} for {where[sym]} but {size} "
                             f"for {_leaf_name(jf, leaf, treedef, n_args, static_pos)} axis {axis}; "
                             f"axes sharing a symbol in dynamic= must have equal sizes")
        values[sym] = size
        where.setdefault(sym, f"{_leaf_name(jf, leaf, treedef, n_args, static_pos)} axis {axis}")
    if any(v < 1 for v in values.values()):  # symbols are >= 1 (jax.export's default constraint)
        log.debug("pallaskit: %s: a dynamic size is 0; compiling this size on its own", jf._title())
        return None
    sym_key = _sym_key(avals, axes, treedef, static_pos, static_kw, n_args)
    speculated = jf._speculated.pop(sym_key, None) if sym_key not in jf._sym else None
    if speculated is not None:  # compiled in the background since the first size (``speculation``)
        entry = speculated.result()
        if entry is not None:
            metrics.counters["dynamic_speculation_hits"] += 1
            jf._sym[sym_key] = entry
    if sym_key not in jf._sym:
        options = orchestrator.compile_options()
        if automatic and not options.interpret and not orchestrator.eager_wanted(options):
            entry = None  # no eager launches possible: nothing to gain (below); compile per size
            metrics.counters["dynamic_fallbacks"] += 1
        else:
            entry = _compile_symbolic(jf, avals, axes, values, treedef, static_pos, static_kw, n_args,
                                      automatic)
        if entry is not None and automatic and not _serves_new_sizes_at_once(entry):
            # Automatic dynamic pays off where a new size runs at once (eager
            # launches) or costs no pallaskit compile for XLA to wait on (interpret
            # mode); on a GPU without eager launches a new size would still wait for
            # XLA while every size ran the size-hinted kernels: compile per size.
            metrics.counters["dynamic_fallbacks"] += 1
            log.info("pallaskit: %s: no eager launches for its dynamic program; compiling each size on its "
                     "own", jf._title())
            entry = None
        jf._sym[sym_key] = entry
    entry = jf._sym[sym_key]
    if entry is None:
        return None
    if not all(eval(g, {}, dict(values)) for g in entry.guards) or not shape_guards.hold(entry, values):
        metrics.counters["dynamic_guard_failures"] += 1
        log.info("pallaskit: %s: sizes %s break a guard of the symbolic program; compiling them on their own",
                 jf._title(), values)
        return None
    return entry


def compile_static(jf, treedef, static_pos, static_kw, n_args, context, leaves):
    """A recurring size's own static program, compiled on the background
    thread ([Note: eager launches] in runtime/eager.py); returns (executable,
    constants) for the dispatcher, and files the entry under the call's keys
    so the size's later calls skip the dispatcher, as a static signature's do.
    None where the dispatcher's calls run under a jax context of their own
    (``context``, thread-local in jax) that this thread cannot trace under."""
    if signature.context() != context:
        log.debug("pallaskit: %s: no tier-up (the call's jax context is thread-local)", jf._title())
        return None
    avals = [signature.abstractify(x, "an argument") for x in leaves]
    entry = orchestrator.compile_signature(jf, avals, treedef, static_pos, static_kw, n_args,
                                           xla=jf._xla_args(treedef, n_args))
    jf._cache[signature.call_key(treedef, avals, static_pos, static_kw, n_args, context)] = entry
    array = signature.array_type(leaves)
    if not static_pos and not static_kw and array is not None and all(type(x) is array for x in leaves):
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        fast_tree = jax.tree_util.tree_structure((tuple(dyn_args), dyn_kwargs))
        jf._fast[(fast_tree, tuple(x.aval for x in leaves), sharding.fast_placement(leaves), context)] = entry
    jf._refresh_fast_path()
    return entry.executable, entry.constants


def _leaf_name(jf, leaf, treedef, n_args, static_pos) -> str:
    paths = _leaf_paths(treedef)
    dyn_positions = jf._dynamic_positions(n_args)
    return signature.describe(paths[leaf], dyn_positions, jf._sig)

def _leaf_paths(treedef):
    dummy = jax.tree_util.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    return [p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _axes(jf, leaves, avals, treedef, static_pos, static_kw, n_args) -> tuple[dict, bool]:
    """({(leaf, axis): symbol name}, whether automatic axes are among them)
    of this call: the ``dynamic=`` axes, plus automatic ones (an axis seen
    with a second distinct size; option ``automatic_dynamic``)."""
    paths = _leaf_paths(treedef)
    dyn_positions = jf._dynamic_positions(n_args)
    axes = {}
    if jf.dynamic:
        names = list(jf._sig.parameters) if jf._sig is not None else []
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
            spec = next((jf.dynamic[i] for i in ids if i in jf.dynamic), None)
            if spec is None:
                continue
            what = signature.describe(path, dyn_positions, jf._sig)
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
        automatic = _automatic_axes(jf, avals, treedef, static_pos, static_kw, n_args, paths, dyn_positions,
                                         set(axes), set(axes.values()))
        axes.update(automatic)
    return axes, bool(automatic)

def _automatic_axes(jf, avals, treedef, static_pos, static_kw, n_args, paths, dyn_positions, taken, used):
    """Automatic dynamic: the axes whose size differs between the calls
    seen with this signature skeleton (everything but sizes equal). Axes
    whose sizes were equal in every call seen share a symbol (a fresh
    symbol each would not trace: ``x + y`` needs equal sizes)."""
    skeleton = _skeleton(avals, treedef, static_pos, static_kw, n_args)
    shape = tuple(tuple(int(d) for d in a.shape) for a in avals)
    seen = jf._seen.setdefault(skeleton, [])
    if shape not in seen:
        seen.append(shape)
    if len(seen) < 2:
        return {}
    out = _changed_axes(jf, avals, seen, paths, dyn_positions, taken, used)
    marker = (skeleton, tuple(sorted(out.items())))
    if out and marker not in jf._logged:
        jf._logged.add(marker)
        log.info("pallaskit: %s: %s seen with a second size; compiling it once with %s dynamic",
                 jf._title(), ", ".join(sorted({f"{signature.describe(paths[l], dyn_positions, jf._sig)} axis {k}"
                                                  for l, k in out})), ", ".join(sorted(set(out.values()))))
    return out


def _skeleton(avals, treedef, static_pos, static_kw, n_args):
    return (treedef, tuple((a.dtype, bool(a.weak_type), len(a.shape)) for a in avals), static_pos, static_kw, n_args)


def _sym_key(avals, axes, treedef, static_pos, static_kw, n_args):
    """A symbolic signature: the concrete one with its dynamic axes' sizes replaced by their symbols."""
    shapes = tuple((a.dtype, bool(a.weak_type), tuple(axes[(i, k)] if (i, k) in axes else int(d)
                                                    for k, d in enumerate(a.shape)))
                   for i, a in enumerate(avals))
    return (treedef, shapes, static_pos, static_kw, n_args, signature.context())


def _changed_axes(jf, avals, seen, paths, dyn_positions, taken, used) -> dict:
    """{(leaf, axis): symbol name} of the axes whose size differs between the
    shapes ``seen`` (of one skeleton), axes changing alike sharing a symbol."""
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
        base = re.sub(r"\W+", "_", signature.describe(paths[leaf], dyn_positions, jf._sig).replace("argument ", ""))
        name = f"{base.strip('_') or 'arg'}_d{axis}"
        if not _valid_symbol(name):
            name = f"s_{name}"
        while name in used:
            name += "_"
        used.add(name)
        for m in members:
            out[m] = name
    return out


def speculation(jf, avals, treedef, static_pos, static_kw, n_args):
    """Option ``automatic_dynamic_speculate`` ([Note: dynamic speculation]): at
    a function's first static compile, a callable that starts, on a background
    thread, the symbolic compile a second size changing the guessed axes would
    run, and its eager kernels' compiles; the orchestrator calls it before JAX
    lowers the static program. None where nothing is guessed or new
    sizes would not launch eagerly; the callable takes the static program's
    closed jaxpr and starts nothing for one of more than
    ``SPECULATE_MAX_EQUATIONS`` equations."""
    if not (config.automatic_dynamic and config.automatic_dynamic_speculate) or jf.dynamic:
        return None
    skeleton = _skeleton(avals, treedef, static_pos, static_kw, n_args)
    if len(jf._seen.get(skeleton, ())) != 1:  # only a signature's first size
        return None
    options = orchestrator.compile_options()
    if not orchestrator.eager_wanted(options) or config.dynamic_tier_up != "static":
        return None
    guessed = _guess_axes(avals)
    if not guessed:
        return None
    paths = _leaf_paths(treedef)
    dyn_positions = jf._dynamic_positions(n_args)
    shape = tuple(tuple(int(d) for d in a.shape) for a in avals)
    other = tuple(tuple(d + 1 if (i, k) in guessed else d for k, d in enumerate(s)) for i, s in enumerate(shape))
    # The axes and symbol names a second size changing exactly the guessed axes gets (``_automatic_axes``)
    axes = _changed_axes(jf, avals, [shape, other], paths, dyn_positions, set(), set())
    sym_key = _sym_key(avals, axes, treedef, static_pos, static_kw, n_args)
    if sym_key in jf._sym or sym_key in jf._speculated:
        return None
    values = {sym: shape[leaf][axis] for (leaf, axis), sym in axes.items()}
    context = signature.context()

    def run():
        if signature.context() != context:
            # The caller traces under a context of its own (``with jax.default_matmul_precision(...)``,
            # a rank-promotion or dtype-promotion mode: thread-local in jax) that this thread lacks.
            log.debug("pallaskit: %s: no speculative compile (the call's jax context is thread-local)", jf._title())
            return None
        try:
            return compile_and_load()
        except Exception as e:  # noqa: BLE001  (a guess that fails costs nothing but its time)
            log.debug("pallaskit: %s: speculative compile failed (%s: %s)", jf._title(), type(e).__name__, e)
            return None

    def compile_and_load():
        entry = _compile_symbolic(jf, avals, axes, values, treedef, static_pos, static_kw, n_args,
                                  automatic=True, speculative=True)
        if entry is not None and not _serves_new_sizes_at_once(entry):
            return None
        eager = getattr(entry.executable, "eager", None) if entry is not None else None
        if eager is not None:
            try:  # the kernels for these dtypes, as the first eager call would compile them
                eager.precompile([*avals, *entry.executable.eager_constants])
            except Exception as e:  # noqa: BLE001  (the first eager call compiles them and reports)
                log.debug("pallaskit: %s: speculative eager kernels failed (%s: %s)", jf._title(), type(e).__name__, e)
        return entry

    def start(closed_jaxpr):
        from pallaskit.runtime import eager

        if _equations(closed_jaxpr.jaxpr) > SPECULATE_MAX_EQUATIONS:
            return
        metrics.counters["dynamic_speculations"] += 1
        jf._speculated[sym_key] = eager.submit(run, thread="pallaskit-speculate")
        log.debug("pallaskit: %s: compiling it with %s dynamic in the background (a guess)", jf._title(),
                  ", ".join(sorted(set(axes.values()))))
    return start


# A symbolic compile's cost grows with the program: a large one's (a training
# step's) would hold the GIL for seconds beside the caller's own work, for a guess.
SPECULATE_MAX_EQUATIONS = 500


def _equations(jaxpr) -> int:
    """Equations of a jaxpr, those of the jaxprs in their parameters included."""
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _equations(inner)
    return n


def _guess_axes(avals) -> set:
    """The axes speculation makes dynamic: each array argument's leading axis
    (a batch, as a rule) of size above 1 whose size no later axis of any
    argument has (a weight's leading axis is some other array's feature axis)."""
    later = {int(d) for a in avals for d in a.shape[1:]}
    return {(i, 0) for i, a in enumerate(avals) if len(a.shape) >= 1 and int(a.shape[0]) > 1
            and int(a.shape[0]) not in later}


def _compile_symbolic(jf, avals, axes, values, treedef, static_pos, static_kw, n_args,
                      automatic=False, speculative=False) -> Compiled | None:
    """Trace with ``jax.export.symbolic_shape`` dims and compile once; None
    (the signature then compiles per size) when it cannot, with one log line
    (a warning for ``dynamic=``; for automatic axes, which the user did not
    ask for, an info line; ``speculative``: a debug line, no fallback counted)."""
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
        return orchestrator.compile_signature(
            jf, avals, treedef, static_pos, static_kw, n_args, aot=False, structs=structs, size_hints=variants[0],
            variants=variants, positions=[(n, positions[n]) for n in names], first_sizes=values,
            xla=jf._xla_args(treedef, n_args),
            compile_static=functools.partial(compile_static, jf, treedef, static_pos, static_kw, n_args,
                                             signature.context()))
    except signature.ClosedOverTracers:
        raise
    except Exception as e:  # noqa: BLE001  (anything the symbolic path cannot take: per-size compiles)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if speculative:
            log.debug("pallaskit: %s: no speculative compile with dynamic %s (%s)", jf._title(), ", ".join(names),
                      reason)
            return None
        metrics.counters["dynamic_fallbacks"] += 1
        log.log(logging.INFO if automatic else logging.WARNING,
                "pallaskit: %s cannot be compiled with dynamic %s (%s); compiling each size on its own",
                jf._title(), ", ".join(names), reason)
        return None


def _serves_new_sizes_at_once(entry: Compiled) -> bool:
    """Does this symbolic entry serve a new size without pallaskit's compiler and
    its XLA wait per size: eager launches (a GPU), or interpret mode (the CPU)?"""
    return getattr(entry.executable, "eager", None) is not None or orchestrator.compile_options().interpret


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


def resolve(sig, dynamic, static_argnums, static_argnames) -> dict:
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
