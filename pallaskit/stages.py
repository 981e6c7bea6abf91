"""Ahead-of-time stages of ``pallaskit.jit``, as ``jax.stages``' Traced, Lowered and Compiled.

``f.trace(*args)`` traces the user's function (arrays or
``jax.ShapeDtypeStruct``s for the dynamic arguments, values for the static
ones); ``.lower()`` runs pallaskit's compiler on the jaxpr and lowers the
generated program (Pallas kernels and XLA ops) to StableHLO with the
signature's donation and shardings; ``.compile()`` compiles it with XLA. A
``Compiled`` is called like jax's: with the dynamic arguments only, static
ones left out. These stages do not read or write the on-disk graph cache and
always compile the call's concrete shapes (no ``dynamic=`` axes).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any

import jax

from pallaskit import orchestrator, sharding
from pallaskit.runtime import gc_pause


def _structs(avals) -> list:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]


class _Signature:
    """What each stage knows of the call: the split arguments and the trace."""

    def __init__(self, jf, args, kwargs):
        self.jf = jf
        key, leaves, self.avals, self.treedef, self.static_pos, self.static_kw = jf._split(args, kwargs)
        self.n_args = len(args)
        self.xla = jf._xla_args(self.treedef, self.n_args)
        self.placement = _placement(leaves)
        if self.placement is None and sharding.committed(leaves):  # outputs committed, as a call's
            self.xla = dataclasses.replace(self.xla, committed=True)
        self.args, self.kwargs = args, kwargs
        self.jax_only = ""  # why jax.jit lowers the function instead (a call would run it with jax.jit)
        self.jax_traced = None  # jax.jit's trace, where it does
        context = sharding.trace_context(self.placement)
        try:
            with context:
                self.jaxpr, self.out_tree = jf._trace(_structs(self.avals), self.treedef, self.static_pos,
                                                      self.static_kw, self.n_args)
        except Exception as e:
            if isinstance(context, contextlib.nullcontext):
                raise
            # As a call (orchestrator.compile_signature): code naming an explicit mesh itself (a
            # reshard) refuses its Auto twin; traced as jax.jit traces it (an error there is the
            # user's own), jax.jit lowers it.
            self.jax_traced = jf._jax.trace(*args, **kwargs)
            self.jaxpr, self.out_tree = self.jax_traced.jaxpr, self.jax_traced.out_tree
            self.jax_only = f"{sharding.twin_refusal(e)}; jax.jit lowers the function"
        else:
            if not isinstance(context, contextlib.nullcontext):  # [Note: the Auto twin's trace checked]
                traced = jf._jax.trace(*args, **kwargs)
                if sharding.twin_differs(self.jaxpr, traced.jaxpr):
                    self.jax_traced = traced
                    self.jaxpr, self.out_tree = traced.jaxpr, traced.out_tree
                    self.jax_only = f"{sharding.twin_mismatch()}; jax.jit lowers the function"
        # placed as a call of these arguments would be (jax.jit's output shardings)
        self.placement = orchestrator.placed(self.placement, self.jaxpr, self.xla, len(self.avals))
        dyn_args, dyn_kwargs = jax.tree_util.tree_unflatten(self.treedef, list(range(len(self.avals))))
        self.in_tree = jax.tree_util.tree_structure((tuple(dyn_args), dyn_kwargs))

    def out_info(self):
        if self.jax_only:
            return self.jax_traced.out_info
        return jax.tree_util.tree_unflatten(self.out_tree, _structs(self.jaxpr.out_avals))

    def args_info(self):
        donated = set(self.xla.donate)
        try:
            infos = [jax.stages.ArgInfo(a, i in donated) for i, a in enumerate(self.avals)]
        except TypeError:  # another jax's ArgInfo: (aval, donated) pairs
            infos = [(a, i in donated) for i, a in enumerate(self.avals)]
        return jax.tree_util.tree_unflatten(self.in_tree, infos)

    def in_avals(self):
        return jax.tree_util.tree_unflatten(self.in_tree, list(self.avals))


def _placement(leaves):
    """The arguments' shardings where one is off the default device, as a call
    takes them (``sharding.placement``); a ``jax.ShapeDtypeStruct``'s own."""
    placed = list(sharding.placement([None if isinstance(x, jax.ShapeDtypeStruct) else x for x in leaves])
                  or [None] * len(leaves))
    default = jax.sharding.SingleDeviceSharding(sharding.default_device())
    other = any(s is not None for s in placed)
    for i, x in enumerate(leaves):
        s = getattr(x, "sharding", None) if isinstance(x, jax.ShapeDtypeStruct) else None
        if isinstance(s, jax.sharding.Sharding):
            placed[i] = s
            other = other or not s.is_equivalent_to(default, len(x.shape))
    return tuple(placed) if other else None


class _Stage:
    _s: _Signature

    @property
    def in_tree(self):
        """Pytree of the dynamic arguments, ``((args...), {kwargs})``."""
        return self._s.in_tree

    @property
    def out_tree(self):
        return self._s.out_tree

    @property
    def out_info(self):
        """The outputs as a pytree of ``jax.ShapeDtypeStruct``."""
        return self._s.out_info()

    @property
    def in_avals(self):
        return self._s.in_avals()

    @property
    def args_info(self):
        """The dynamic arguments as a pytree of ``jax.stages.ArgInfo`` (aval, donated)."""
        return self._s.args_info()

    @property
    def donate_argnums(self):
        return self._s.jf.donate_argnums

    @property
    def fun_name(self) -> str:
        return getattr(self._s.jf.fn, "__name__", "fn")


class Traced(_Stage):
    """The function traced at one signature (``JitFunction.trace``)."""

    def __init__(self, signature: _Signature):
        self._s = signature

    @property
    def jaxpr(self):
        """The closed jaxpr of the dynamic leaves (what pallaskit compiles)."""
        return self._s.jaxpr

    @property
    def out_avals(self):
        """The outputs' avals as a pytree (jax's ``Traced.out_avals``)."""
        return jax.tree_util.tree_unflatten(self._s.out_tree, self._s.jaxpr.out_avals)

    def __call__(self, *args, **kwargs):
        """The traced jaxpr evaluated on the dynamic arguments (jax's ``Traced`` is callable so)."""
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self._s.in_tree:
            raise TypeError(_pytree_mismatch(tree, self._s.in_tree))
        from jax.extend import core as jex_core

        return jax.tree_util.tree_unflatten(self._s.out_tree, jex_core.jaxpr_as_fun(self._s.jaxpr)(*leaves))

    def lower(self, *, lowering_platforms: tuple[str, ...] | None = None, _private_parameters=None):
        """pallaskit's program lowered for this device (a ``Lowered``). With
        ``lowering_platforms`` (``jax.export``, cross-platform lowering), whose
        kernels pallaskit does not render, jax.jit's own lowering of the
        function (a ``jax.stages.Lowered``), with one log line."""
        s = self._s
        if s.jax_only:
            from pallaskit import autodiff

            autodiff.fallback_log(s.jf, s.jax_only)
            return s.jax_traced.lower(lowering_platforms=lowering_platforms, _private_parameters=_private_parameters)
        if lowering_platforms is not None or _private_parameters is not None:
            from pallaskit import autodiff, signature

            autodiff.fallback_log(s.jf, "lowered for given platforms (jax.export): jax.jit lowers the function")
            full, kwargs = signature.full_args(_structs(s.avals), s.treedef, s.static_pos, s.static_kw, s.n_args)
            return s.jf._jax.trace(*full, **kwargs).lower(lowering_platforms=lowering_platforms,
                                                           _private_parameters=_private_parameters)
        entry = s.jf._compile(s.avals, s.treedef, s.static_pos, s.static_kw, s.n_args, aot=False, xla=s.xla,
                              traced=(s.jaxpr, s.out_tree), placement=s.placement)
        ahead = orchestrator.autotune_ahead(entry.result, s.placement)  # tuned while JAX lowers, Triton compiles
        return Lowered(s, entry, ahead)


class Lowered(_Stage):
    """The generated program lowered to StableHLO (``JitFunction.lower``)."""

    def __init__(self, signature: _Signature, entry, ahead=None):
        self._s, self._entry, self._ahead = signature, entry, ahead  # ahead: [Note: autotuning ahead]
        jitted = getattr(entry.executable, "top", entry.executable)  # executable._TopLevelJit: the options' jit
        structs = _structs(signature.avals)
        if signature.xla.committed and signature.placement is None:  # committed outputs, as a call's
            on = jax.sharding.SingleDeviceSharding(sharding.default_device())
            structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type, sharding=on) for s in structs]
        with gc_pause.paused():  # [Note: no collections while compiling]
            self._lowered = jitted.lower(*structs, *entry.constants)

    @property
    def result(self):
        """pallaskit's ``lowering.CompileResult``: the schedule, kernels and generated source."""
        return self._entry.result

    @property
    def program_source(self) -> str:
        """The generated Python module (Pallas kernels and their ``call``)."""
        return self._entry.result.program.source

    def as_text(self, dialect: str | None = None, *, debug_info: bool = False) -> str:
        return self._lowered.as_text(dialect, debug_info=debug_info)

    def compiler_ir(self, dialect: str | None = None):
        return self._lowered.compiler_ir(dialect)

    def cost_analysis(self) -> Any:
        return self._lowered.cost_analysis()

    def compile(self, compiler_options: dict | None = None) -> Compiled:
        if self._ahead is not None:
            self._ahead.join()
        return Compiled(self._s, self._entry, self._lowered.compile(compiler_options))


class Compiled(_Stage):
    """The compiled executable (``Lowered.compile``); called like jax's
    ``Compiled``: dynamic arguments only, same pytree structure and types."""

    def __init__(self, signature: _Signature, entry, compiled):
        self._s, self._entry, self._compiled = signature, entry, compiled
        where = entry.executable.replicated() if hasattr(entry.executable, "replicated") else None
        self._constants = [jax.device_put(c, where) for c in entry.constants]

    def __call__(self, *args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self._s.in_tree:
            raise TypeError(_pytree_mismatch(tree, self._s.in_tree))
        errors = []
        names = _arg_names(self._s.jaxpr, len(self._s.avals))
        for x, a, name in zip(leaves, self._s.avals, names):
            aval = jax.typeof(x) if hasattr(jax, "typeof") else jax.api_util.shaped_abstractify(x)
            if aval.shape != a.shape or aval.dtype != a.dtype:
                errors.append(f"Argument {name} compiled with {a.str_short()} and called with {aval.str_short()}")
        if errors:  # jax's Compiled's message
            head = "The" if len(errors) < 5 else f"The first 5 of {len(errors)}"
            raise TypeError("Argument types differ from the types for which this computation was compiled. Perhaps "
                            "you are calling the compiled executable with a different enable_x64 mode than when it "
                            f"was AOT compiled? {head} mismatches are:\n" + "\n".join(errors[:5]))
        try:
            outs = self._compiled(*leaves, *self._constants)
        except ValueError as e:  # jax's sharding mismatch names the flat call's arguments: name the user's
            if "Argument args[" not in str(e):
                raise
            text = re.sub(r"Argument args\[(\d+)\]",
                          lambda m: f"Argument {names[int(m.group(1))][1:-1]}" if int(m.group(1)) < len(names)
                          else m.group(0), str(e))
            raise ValueError(text) from None
        return jax.tree_util.tree_unflatten(self._s.out_tree, outs)

    @property
    def out_info(self):
        """The outputs as ``jax.ShapeDtypeStruct``s with their shardings, as jax's ``Compiled.out_info``."""
        flat = jax.tree_util.tree_leaves(self._compiled.out_info)
        return jax.tree_util.tree_unflatten(self._s.out_tree, flat)

    def as_text(self) -> str | None:
        return self._compiled.as_text()

    def cost_analysis(self) -> Any:
        return self._compiled.cost_analysis()

    def memory_analysis(self) -> Any:
        return self._compiled.memory_analysis()

    def runtime_executable(self) -> Any:
        return self._compiled.runtime_executable()

    # XLA compiled the flat ``call(*leaves, *constants)``: its shardings come as that call's pytrees, which are
    # regrouped as jax.jit's Compiled gives them, by the user's argument and output structure (constants dropped)
    def _regroup_inputs(self, flat_tree):
        flat = jax.tree_util.tree_leaves(flat_tree, is_leaf=lambda v: v is None)[:len(self._s.avals)]
        return jax.tree_util.tree_unflatten(self._s.in_tree, flat)

    def _regroup_outputs(self, flat_tree):
        return jax.tree_util.tree_unflatten(self._s.out_tree,
                                            jax.tree_util.tree_leaves(flat_tree, is_leaf=lambda v: v is None))

    @property
    def input_shardings(self):
        """Per dynamic argument, as ``in_tree`` (the hoisted constants left out)."""
        flat = jax.tree_util.tree_leaves(self._compiled.input_shardings, is_leaf=lambda x: x is None)
        flat = flat[:len(self._s.avals)]
        placed = getattr(getattr(self._entry.executable, "xla", None), "placed", None)
        if placed is not None:  # an explicit mesh's, not the Auto twin the program was lowered over
            flat = [p if p is not None else sharding.untraceable(s, placed.placement)
                    for p, s in zip(placed.placement, flat)]
        return jax.tree_util.tree_unflatten(self._s.in_tree, flat)

    @property
    def output_shardings(self):
        """Per output, as ``out_tree``."""
        flat = jax.tree_util.tree_leaves(self._compiled.output_shardings, is_leaf=lambda x: x is None)
        return jax.tree_util.tree_unflatten(self._s.out_tree, flat)

    @property
    def input_formats(self):
        return self._regroup_inputs(self._compiled.input_formats)

    @property
    def output_formats(self):
        return self._regroup_outputs(self._compiled.output_formats)


def _arg_names(closed, n) -> list[str]:
    """The user's argument names of the traced jaxpr's inputs ('x', "params['w']")."""
    info = getattr(closed.jaxpr, "debug_info", None)
    names = list(getattr(info, "arg_names", None) or ())
    return [f"'{names[i]}'" if i < len(names) and names[i] else f"'args[{i}]'" for i in range(n)]


def _pytree_mismatch(given, compiled) -> str:
    """jax's ``Compiled`` message for a call whose pytree differs from the compiled one."""
    try:
        from jax._src import tree_util as _tree_util

        errs = list(_tree_util.equality_errors_pytreedef(given, compiled))
        lines = ["Function compiled with input pytree does not match the input pytree it was called with. "
                 f"There are {len(errs)} mismatches, including:"]
        for path, thing1, thing2, explanation in errs:
            fst, *rest = path
            lines.append(f"    * at {['args', 'kwargs'][fst.idx]}{jax.tree_util.keystr(tuple(rest))}, seen {thing2} "
                         f"but now given {thing1}, so {explanation}")
        return "\n".join(lines)
    except Exception:  # noqa: BLE001  (another jax's internals: pallaskit's own words)
        return (f"Function compiled with input pytree does not match the input pytree it was called with: "
                f"compiled for {compiled}, called with {given} (a compiled function takes the dynamic arguments only)")
