"""Sharded arguments: pallaskit programs compiled for the arguments' shardings.

[Note: sharding]
JAX's own distribution is the distributed engine. A call whose arrays are not
all on the default device (a ``NamedSharding`` over any mesh, a GSPMD sharding,
a ``SingleDeviceSharding`` on another device, a replicated array) compiles its
program ahead of time for those shardings: ``jax.jit(call, out_shardings=...)
.lower(ShapeDtypeStruct(..., sharding=s), ...)``, so XLA's SPMD partitioner
partitions the whole program, pallaskit's kernels included. The output
shardings are jax.jit's: those of the original function compiled for the same
input shardings (one extra XLA compile on a graph-cache miss; a hit's
executable has them built in), so ``with_sharding_constraint`` before an
output and everything jax.jit's propagation decides carry over. The shardings
and their devices are part of the signature (in-memory and graph-cache keys);
sharded signatures take the static path (no dynamic dims).
Meshes with ``Explicit`` axes: ``pallas_call`` takes no sharding in types, so
a concrete call's program is traced over the same mesh with ``Auto`` axes (the
same HLO shardings) and its outputs keep the explicit shardings; a traced call
over explicit axes (under ``jax.jit`` or a transformation, arguments typed on
an explicit mesh or a ``jax.set_mesh`` of one) runs the original function
through XLA, with one log line. Plain arrays under ``jax.set_mesh`` of an
explicit mesh are a placed signature too (every leaf unplaced): jax.jit's
outputs are typed on that mesh, and its output shardings are taken
(``explicit_context``).

Kernels under the partitioner: in interpret mode (the CPU) a Pallas kernel is
ordinary HLO, which SPMD partitions like any other; on the GPU a Triton custom
call is opaque to the partitioner, which gathers its operands and runs it on
every device: correct, but not per shard.

A pallaskit function staged under the user's ``jax.jit`` over sharded arrays
(the arguments' avals name a mesh with an ``Auto`` axis of several devices)
runs the original function through XLA, with one log line
(``staged_over_devices``): there no placement is known to compile for, and the
partitioner, unable to split its kernels, made its outputs replicated where
jax.jit's stay split. Shardings the trace does not show (``in_shardings`` of
arrays on one device) still meet the kernels whole.

Kernels per shard instead: option ``shard_kernels`` ([Note: per-shard kernels]
in pallaskit/per_shard.py) compiles the program at local shapes and runs it
under ``jax.shard_map`` (``Placed.per_shard``, the plan), where a call allows.

Under ``jax.shard_map`` (manual axes, ``check_vma=True``) the function is
traced with its arguments' varying manual axes (``manual_axis_type``), so
collectives (``psum``, ``all_gather``: externs, run through XLA) keep their
types; ``pallas_call`` cannot learn its outputs' varying axes, so each kernel
launch runs with the check off and its outputs are cast to vary over the union
of its operands' axes (``runtime/loader.py``, ``_manual_axes``). Two cases run
the original function through XLA instead, with one log line: interpret mode
(Pallas's HLO interpreter re-traces the kernel body with the check on, where
the body's index arithmetic is invariant and its loads vary), and
differentiation inside shard_map (the joint graph is traced without the
arguments' axes).
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
import numpy as np

_Tracer = jax.core.Tracer


def default_device():
    """Where jax.jit runs a call of uncommitted arrays: ``jax.default_device``'s
    device (a device or a platform name), else the first device (jax's
    ``pxla.get_default_device``)."""
    d = jax.config.jax_default_device
    if isinstance(d, str):
        return jax.local_devices(backend=d)[0]
    return d or jax.local_devices()[0]


def placement(leaves) -> tuple | None:
    """Per-leaf shardings of a call with a committed array off the default
    device (None for leaves that are not such arrays); None when every array
    is on the default device (the unsharded path)."""
    out, other = [], False
    default = default_device()
    for x in leaves:
        s = None
        if isinstance(x, jax.Array) and not isinstance(x, _Tracer) and getattr(x, "committed", True):
            s = x.sharding
            if not (isinstance(s, jax.sharding.SingleDeviceSharding) and next(iter(s.device_set)) == default):
                other = True
        out.append(s)
    return tuple(out) if other else None


def committed(leaves) -> bool:
    """Whether a concrete array among ``leaves`` is committed (to the default
    device, where ``placement`` is None): jax.jit's outputs are then committed."""
    return any(isinstance(x, jax.Array) and not isinstance(x, _Tracer) and x.committed for x in leaves)


def fast_placement(leaves) -> tuple:
    """The shardings of concrete arrays, for the dispatch fast path's key: a
    committed array's own; None for an uncommitted one, which goes wherever the
    program runs (jax's default device, in the key's context) as in jax.jit,
    however an earlier call of that signature with it committed was placed."""
    return tuple(x.sharding if x.committed else None for x in leaves)


def _assignment(s) -> list:
    """A sharding's devices, in the order of its device assignment."""
    da = getattr(s, "_device_assignment", None)
    return list(da) if da is not None else sorted(s.device_set, key=lambda d: d.id)


def devices_text(v) -> str:
    """The devices, in order, of each concrete mesh or sharding in ``v`` (a
    tuple or list is searched), as text for the graph cache's key; "" for
    anything else. Their reprs name axes, sizes and specs, not the devices: two
    meshes over the same devices in another order had one key, and the second
    process was served an executable for the first one's devices (an abort in
    XLA's runtime)."""
    if isinstance(v, (tuple, list)):
        return "".join(devices_text(x) for x in v)
    if isinstance(v, jax.sharding.Mesh):
        return "" if getattr(v, "empty", False) else f"@{[getattr(d, 'id', None) for d in v.devices.flat]}"
    if isinstance(v, jax.sharding.Sharding):
        try:
            return f"@{[d.id for d in _assignment(v)]}"
        except Exception:  # noqa: BLE001 - over an abstract mesh: no devices yet
            return ""
    return ""


def _explicit(mesh) -> bool:
    """Whether a mesh (concrete or abstract) has ``Explicit`` axes."""
    explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
    return explicit is not None and any(t == explicit for t in getattr(mesh, "axis_types", None) or ())


def explicit_context() -> bool:
    """Whether ``jax.set_mesh``'s mesh has ``Explicit`` axes: jax.jit's outputs
    are then typed on it, so a call of plain arrays under it takes jax.jit's
    output shardings ([Note: sharding]) rather than its program's (a reduction's
    spec came out ``P(None,)`` where jax.jit's is ``P()``)."""
    from pallaskit import signature

    mesh = signature.concrete_mesh()
    return mesh is not None and _explicit(mesh)


def _auto_mesh(mesh):
    """A concrete ``mesh`` with every axis ``Auto`` (None when it has no explicit axis)."""
    if not _explicit(mesh):
        return None
    auto = jax.sharding.AxisType.Auto
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def traceable(s):
    """A sharding ``pallas_call`` can be traced under: an explicit mesh's
    ``NamedSharding`` moved onto the same mesh with ``Auto`` axes."""
    if isinstance(s, jax.sharding.NamedSharding):
        auto = _auto_mesh(s.mesh)
        if auto is not None:
            return jax.sharding.NamedSharding(auto, s.spec, memory_kind=s.memory_kind)
    return s


def untraceable(s, placement_):
    """``s`` on the explicit mesh whose ``Auto`` twin it names (``traceable``'s
    inverse), the explicit meshes taken from ``placement_`` and jax.set_mesh's
    mesh; ``s`` itself otherwise."""
    if not isinstance(s, jax.sharding.NamedSharding):
        return s
    from pallaskit import signature

    meshes = [p.mesh for p in placement_ if isinstance(p, jax.sharding.NamedSharding)] + [signature.concrete_mesh()]
    for mesh in meshes:
        if isinstance(mesh, jax.sharding.Mesh) and _auto_mesh(mesh) == s.mesh:
            return jax.sharding.NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)
    return s


def twin_refusal(e: Exception) -> str:
    """Why a function runs with jax.jit: its trace over an explicit mesh's
    ``Auto`` twin (``trace_context``) raised ``e`` (code naming the explicit
    mesh itself, a ``shard_map`` or a ``reshard`` over it, refuses the twin)."""
    first = str(e).splitlines()[0] if str(e) else ""
    return f"cannot be traced over the Auto twin of an explicit mesh ({type(e).__name__}: {first})"


_MESH_PRIMITIVES = frozenset({"sharding_constraint", "shard_map", "reshard", "mesh_cast"})


# [Note: the Auto twin's trace checked]
# A function traced over an explicit mesh's Auto twin sees other types than
# jax.jit gives it: ``jax.typeof(x).sharding.spec`` is empty where jax.jit's
# names the explicit axes. Code that reads them (``if spec[0] == 'data'``)
# traced to another program, and its call returned another value than
# jax.jit's. So the function is also traced as jax.jit traces it, and the two
# jaxprs are compared with their shardings left out (avals' shardings,
# sharding and mesh parameters; values through a reshard / mesh_cast /
# sharding_constraint, which move no value, count as their operands); where
# they differ, the call runs through XLA (``twin_differs``).
_PLACING_ONLY = frozenset({"reshard", "mesh_cast", "sharding_constraint"})
_SHARDING_PARAMS = frozenset({"sharding", "out_sharding", "in_shardings", "out_shardings", "ctx_mesh", "mesh",
                              "dst_sharding", "src_sharding", "in_layouts", "out_layouts", "abstract_mesh"})


def _shape_only(aval) -> tuple:
    return (tuple(str(d) for d in getattr(aval, "shape", ())), str(getattr(aval, "dtype", type(aval).__name__)),
            bool(getattr(aval, "weak_type", False)))


def _param_fingerprint(value):
    import re

    inner = getattr(value, "jaxpr", None)
    if hasattr(value, "eqns"):
        return ("jaxpr", _jaxpr_fingerprint(value, ()))
    if inner is not None and hasattr(inner, "eqns"):  # a ClosedJaxpr
        return ("closed", _jaxpr_fingerprint(inner, getattr(value, "consts", ())))
    if isinstance(value, (tuple, list)):
        return tuple(_param_fingerprint(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _param_fingerprint(v)) for k, v in value.items()))
    if isinstance(value, (jax.sharding.Sharding, jax.sharding.PartitionSpec, jax.sharding.Mesh,
                          getattr(jax.sharding, "AbstractMesh", jax.sharding.Mesh))):
        return "<sharding>"
    if callable(value) and not isinstance(value, type):
        return ("callable", type(value).__name__)
    return re.sub(r" at 0x[0-9a-fA-F]+|0x[0-9a-fA-F]+", "", repr(value))


def _const_fingerprint(c) -> tuple:
    try:
        a = np.asarray(c)
        return (a.shape, str(a.dtype), a.tobytes() if a.size <= 4096 else hash(a.tobytes()))
    except Exception:  # noqa: BLE001 - a key array, a token: its type
        return (_shape_only(getattr(c, "aval", c)),)


def _jaxpr_fingerprint(jaxpr, consts) -> tuple:
    ids: dict = {}
    fresh = iter(range(1 << 62))

    def name(v):
        if type(v).__name__ == "Literal":
            return ("lit", repr(v.val), _shape_only(v.aval))
        if v not in ids:
            ids[v] = next(fresh)
        return ids[v]

    out = [tuple(_shape_only(v.aval) for v in jaxpr.invars), tuple(_const_fingerprint(c) for c in consts)]
    for v in list(jaxpr.constvars) + list(jaxpr.invars):
        name(v)
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim in _PLACING_ONLY and len(eqn.invars) == len(eqn.outvars):
            for i, o in zip(eqn.invars, eqn.outvars):
                ids[o] = name(i)
            continue
        params = tuple(sorted((k, _param_fingerprint(v)) for k, v in eqn.params.items() if k not in _SHARDING_PARAMS))
        out.append((prim, params, tuple(name(v) for v in eqn.invars),
                    tuple((name(v), _shape_only(v.aval)) for v in eqn.outvars)))
    out.append(tuple(name(v) for v in jaxpr.outvars))
    return tuple(out)


def twin_differs(twin, traced) -> bool:
    """Whether two closed jaxprs of one function (over an explicit mesh's Auto
    twin, and as jax.jit traces it) differ in more than their shardings
    ([Note: the Auto twin's trace checked])."""
    try:
        return (_jaxpr_fingerprint(twin.jaxpr, twin.consts) != _jaxpr_fingerprint(traced.jaxpr, traced.consts))
    except Exception:  # noqa: BLE001 - a jaxpr this walk does not know: not proven alike
        return True


def twin_mismatch() -> str:
    return ("its trace over the Auto twin of an explicit mesh differs from jax.jit's over the explicit mesh "
            "(code reading the arrays' sharding types)")


def mentions_mesh(closed) -> bool:
    """Whether a jaxpr places values on devices itself (a sharding
    constraint, a shard_map...): jax.jit then runs it over those devices."""
    def walk(jaxpr) -> bool:  # by duck type: jax.extend is not imported on the warm path
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _MESH_PRIMITIVES:
                return True
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns") and walk(inner):
                        return True
        return False

    return walk(closed.jaxpr)


# Tests set it to run kernels under shard_map in interpret mode anyway (kernels
# whose bodies have no gather, such as a pure pointwise one, lower there).
KERNELS_IN_INTERPRET_SHARD_MAP = False


def xla_only(leaves, transformed: bool, options) -> str:
    """Why a traced call must run the original function through XLA ('' when
    it need not): inside shard_map in interpret mode or under a
    transformation, or traced over explicit mesh axes ([Note: sharding])."""
    if not any(isinstance(x, _Tracer) for x in leaves):
        return ""
    if varying_of(leaves) and (transformed or (options().interpret and not KERNELS_IN_INTERPRET_SHARD_MAP)):
        return "inside shard_map (varying manual axes) in interpret mode or under a transformation"
    context = getattr(jax.sharding, "get_abstract_mesh", None)
    meshes = [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None) for x in leaves
              if isinstance(x, _Tracer)] + ([context()] if context is not None else [])
    if any(m is not None and _explicit(m) for m in meshes):
        # traced calls on Explicit meshes: the jaxpr's equations carry explicit
        # shardings, which Pallas kernels cannot take
        return "traced over Explicit mesh axes (jax.jit or a transformation)"
    return ""


def staged_over_devices(avals) -> str:
    """Why a call staged under ``jax.jit`` must run the original function
    through XLA ('' when it need not): its arguments are typed on a mesh of
    several devices along an ``Auto`` axis (jax.jit of sharded arrays, or the
    auto axes of a partial shard_map). The partitioner splits each of the
    original function's ops; a kernel it cannot see into (a Triton custom call;
    Pallas's interpreter loop alike) it runs whole on every device, so outputs
    came out replicated where jax.jit's stay split ([Note: sharding])."""
    auto = jax.sharding.AxisType.Auto
    for a in avals:
        mesh = getattr(getattr(a, "sharding", None), "mesh", None)
        types = getattr(mesh, "axis_types", None) or ()
        if any(t == auto and n > 1 for t, n in zip(types, getattr(mesh, "axis_sizes", ()))):
            return "staged over sharded arrays (jax.jit of arrays on a mesh), whose partitioner cannot split kernels"
    return ""


def trace_context(placement_):
    """The mesh context a sharded signature is traced and its program lowered
    in: the ``Auto`` twin of an explicit mesh (under the caller's explicit
    ``jax.set_mesh``, the jaxpr's equations would carry explicit shardings that
    clash with the program's), else none. With no argument on a mesh, the
    twin of jax.set_mesh's explicit mesh (kernels met values typed on it: a
    ``reshard`` inside crashed Pallas's interpreter)."""
    from pallaskit import signature

    meshes = [s.mesh for s in placement_ or () if isinstance(s, jax.sharding.NamedSharding)]
    for mesh in meshes or [signature.concrete_mesh()]:
        auto = _auto_mesh(mesh) if isinstance(mesh, jax.sharding.Mesh) else None
        if auto is not None:
            set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
            return set_mesh(auto)
    return contextlib.nullcontext()


class Placed:
    """A sharded signature ([Note: sharding]): the arguments' shardings
    (``placement``, None per leaf that has none) and, computed on first use,
    jax.jit's output shardings for them."""

    def __init__(self, placement_: Sequence, flat_fn, avals, user_out=None, user_in=()):
        self.placement = tuple(placement_)
        self._flat_fn, self._avals = flat_fn, avals
        self._user_out = user_out  # the user's out_shardings: one, or one per flat output (None: unspecified)
        self._user_in = frozenset(user_in)  # leaves placed by the user's in_shardings, not by their arrays
        self._reference = None
        self.per_shard = None  # a per_shard.Plan when the program runs per shard ([Note: per-shard kernels])

    def _compiled(self):
        if self._reference is None:
            # An array's sharding is in its type (an explicit mesh's outputs typed by it); a
            # sharding the user's in_shardings gives an array on no mesh is jax.jit's in_shardings.
            structs_ = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                             sharding=None if i in self._user_in else s)
                        for i, (a, s) in enumerate(zip(self._avals, self.placement))]
            out = self._user_out
            kw = {} if out is None else {"out_shardings": list(out) if isinstance(out, tuple) else out}
            if self._user_in:
                kw["in_shardings"] = [s if i in self._user_in else None for i, s in enumerate(self.placement)]
            from pallaskit import signature

            with signature.tracing():  # nested pallaskit functions as the program has them
                self._reference = jax.jit(self._flat_fn, **kw).lower(*structs_).compile()
        return self._reference

    def out_shardings(self) -> tuple:
        """jax.jit's output shardings of the function for these inputs (and the
        user's ``out_shardings``)."""
        return tuple(self._compiled().output_shardings)

    def devices(self) -> list:
        """The program's devices, in the order of its device assignment."""
        first = next((s for s in self.placement if s is not None), None)
        if first is None:  # the jaxpr alone names the devices: ask jax.jit
            compiled = self._compiled()
            first = next(iter(jax.tree_util.tree_leaves(compiled.input_shardings)
                              + list(compiled.output_shardings)))
        return _assignment(first)

    def replicated(self):
        """A replicated sharding over the program's devices (hoisted constants)."""
        first = next((s for s in self.placement if s is not None), None)
        if isinstance(first, jax.sharding.NamedSharding):
            return traceable(jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec()))
        from pallaskit import signature

        mesh = signature.concrete_mesh()
        if first is None and mesh is not None and not getattr(mesh, "empty", False):
            # No argument placed: jax.set_mesh's mesh is the program's (with explicit axes, its
            # Auto twin, where the program is lowered; a mesh of pallaskit's own clashed with it)
            return traceable(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        devs = self.devices()
        if len(devs) == 1:
            return jax.sharding.SingleDeviceSharding(devs[0])
        return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devs), ("pallaskit",)),
                                          jax.sharding.PartitionSpec())

    def structs(self) -> list:
        """ShapeDtypeStructs of the dynamic leaves with the shardings the
        program is traced under (``traceable``)."""
        return [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                     sharding=None if s is None else traceable(s))
                for a, s in zip(self._avals, self.placement)]

    def context(self):
        return trace_context(self.placement)

    def key_text(self) -> list:
        """The shardings and their devices as text, for the graph cache's key."""
        text = [None if s is None else [repr(s), [d.id for d in _assignment(s)]] for s in self.placement]
        return text + ([self.per_shard.key_text()] if self.per_shard is not None else [])


# --------------------------------------------------------------------------- #
# shard_map: varying manual axes
# --------------------------------------------------------------------------- #
def manual_axis_type(aval) -> Any:
    """The varying manual axes of an aval (``manual_axis_type``; ``vma`` in
    older jax), or None where there are none."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return None if getattr(mat, "empty", False) or not _varying(mat) else mat
    vma = getattr(aval, "vma", None)
    return vma or None


def _varying(mat) -> frozenset:
    if isinstance(mat, (frozenset, set)):
        return frozenset(mat)
    return frozenset(getattr(mat, "varying", ())) | frozenset(getattr(mat, "unreduced", ())) \
        | frozenset(getattr(mat, "reduced", ()))


def struct_of(aval) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct keeping the aval's varying manual axes."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and not getattr(mat, "empty", True):
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, sharding=aval.sharding,
                                    manual_axis_type=mat)
    vma = getattr(aval, "vma", None)
    if vma:
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type, vma=vma)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def varying_of(args) -> frozenset:
    """The union of the varying manual axes of ``args`` (tracers inside shard_map)."""
    out = frozenset()
    for x in args:
        if isinstance(x, _Tracer):
            mat = manual_axis_type(jax.typeof(x))
            if mat is not None:
                out |= _varying(mat)
    return out


def _cast_varying(x, axes: tuple):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)


def with_varying(launch, args, kwargs, varying: frozenset):
    """``launch(*args, **kwargs)`` with vma checks off, its outputs cast to vary over ``varying``."""
    from jax._src import config as jax_config

    with jax_config._check_vma(False):
        outs = launch(*args, **kwargs)
    single = not isinstance(outs, (tuple, list))
    fixed = []
    for o in ([outs] if single else outs):
        have = manual_axis_type(jax.typeof(o))
        missing = tuple(sorted(varying - (_varying(have) if have is not None else frozenset())))
        fixed.append(_cast_varying(o, missing) if missing else o)
    return fixed[0] if single else type(outs)(fixed)
