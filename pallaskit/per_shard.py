"""Kernels per shard: a sharded call's program compiled at local shapes under ``jax.shard_map``.

[Note: per-shard kernels]
Under XLA's SPMD partitioner a Triton custom call (a Pallas kernel on the GPU,
or ``triton_call_p``) is opaque: the partitioner gathers its operands and runs
it on the whole array on every device. This module partitions the program
itself, before pallaskit's compiler sees it, so that every kernel is rendered
for its shard's shape and runs on that shard alone:

1. ``plan`` evaluates the global jaxpr equation by equation inside a
   ``jax.shard_map`` over the arguments' mesh (``check_vma=False``), each value
   carrying its ``spec`` (per dim, the mesh axes that split it; ``()``:
   whole). A rule per primitive kind binds the equation on the local values
   with local shape parameters and says the output's spec:
   - pointwise ops, ``broadcast_in_dim``, ``transpose``, ``squeeze``,
     ``reshape`` (where a split dim stays the major part of its group),
     ``slice``/``pad``/``concatenate``/cumulative ops along whole dims: local;
     operands split differently are first brought to one spec (a whole
     operand is sliced locally by ``axis_index``, no communication; operands
     split over different axes along one dim are gathered);
   - reductions over a split dim: the local reduction, then ``psum`` /
     ``pmax`` / ``pmin`` over its axes (so the mean of a data-parallel loss and
     its gradients' batch sums are all-reduces, as in DDP);
   - ``dot_general``: batch dims as pointwise; a contracting dim split the
     same way on both sides gives a local product and a ``psum`` (the second
     matmul of a Megatron MLP), one split on one side only is gathered (an
     FSDP parameter gathered for use); free dims keep their split;
   - call-like equations (``pjit``, ``custom_jvp_call``...) are inlined;
   - anything else (gathers, scatters, loops, sorts...) runs on whole values:
     its split operands are all-gathered and its outputs are whole, as the
     partitioner does for an opaque op; ``gathers`` counts those values.
   Sharding constraints and reshards are layouts, not values: they pass
   their operand on (the outputs get jax.jit's shardings at the end). A
   ``shard_map`` or a collective in the jaxpr, or an argument that is not a
   ``NamedSharding`` of the one mesh or whose split dims do not divide
   evenly: no plan, and the call takes the SPMD path.
2. The body's jaxpr (local shapes, collectives as ordinary primitives) is
   what pallaskit compiles: its kernels see local shapes, its collectives are
   externs run through XLA.
3. The program runs as ``jax.jit(shard_map(call, in_specs, out_specs),
   out_shardings=jax.jit's)``: XLA moves an output whose spec differs from
   jax.jit's sharding (a sliced copy where a whole value is asked to be
   split), so values and output shardings are jax.jit's.

Option ``shard_kernels`` picks the path: 'auto' takes this one where
kernels are opaque (not interpret mode) and a plan exists; 'per_shard'
also in interpret mode (tests); 'spmd' never.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from pallaskit.runtime import preload

log = logging.getLogger("pallaskit")

Spec = tuple  # per dim: a tuple of mesh axis names (major to minor); () for a whole dim

# With lowering.rules.pointwise's ELEMENTWISE and IDENTITY (``_pointwise_names``): the compiler
# (sympy) is imported on first planning only, not by a warm process that loads executables.
_MORE_POINTWISE = frozenset({
    "add_any", "one_minus_square", "reduce_precision", "real", "imag", "conj", "lgamma", "digamma",
    "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "bessel_i0e", "bessel_i1e", "polygamma", "zeta",
    "tan", "logistic", "erf_inv", "square", "exp2"})
_REDUCE = {"reduce_sum": "psum", "reduce_max": "pmax", "reduce_min": "pmin"}
_CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})
_LAYOUT = frozenset({"sharding_constraint", "reshard", "mesh_cast"})  # same values, another layout
_NO_PLAN = frozenset({"shard_map", "psum", "pmax", "pmin", "all_gather", "all_to_all",
                      "ppermute", "axis_index", "psum_scatter", "reduce_scatter", "pbroadcast", "pvary", "pcast"})


@functools.lru_cache(maxsize=None)
def _pointwise_names() -> frozenset:
    preload.wait()
    from lowering.rules.pointwise import ELEMENTWISE, IDENTITY

    return frozenset(ELEMENTWISE) | frozenset(IDENTITY) | _MORE_POINTWISE


class NoPlan(Exception):
    """The call cannot take the per-shard path (the SPMD path takes it)."""


@dataclasses.dataclass
class Plan:
    """A sharded signature's per-shard program ([Note: per-shard kernels])."""

    mesh: Any
    in_specs: tuple  # PartitionSpec per flat leaf
    out_specs: tuple  # PartitionSpec per flat output
    local: Any  # ClosedJaxpr at local shapes, collectives included
    gathers: list  # (primitive, shape) of each split value gathered whole
    collectives: int  # all-reduces the plan added

    def wrap(self, call: Callable, n_constants: int) -> Callable:
        """``call(*leaves, *constants)`` (the program of ``local``) run per shard."""
        def body(*args):
            return tuple(call(*args))

        return jax.shard_map(body, mesh=self.mesh, in_specs=(*self.in_specs, *(P(),) * n_constants),
                             out_specs=self.out_specs, check_vma=False)

    def key_text(self) -> str:
        return f"per_shard{tuple(self.in_specs)}->{tuple(self.out_specs)}"


# --------------------------------------------------------------------------- #
# specs
# --------------------------------------------------------------------------- #
def _spec_of(pspec, ndim: int) -> Spec:
    if getattr(pspec, "unreduced", None) or getattr(pspec, "reduced", None):
        raise NoPlan("unreduced / reduced partition specs")
    out = []
    for entry in tuple(pspec) + (None,) * (ndim - len(pspec)):
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        elif isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
            out.append(tuple(entry))
        else:
            raise NoPlan(f"partition spec entry {entry!r}")
    if len(out) != ndim:
        raise NoPlan(f"partition spec {pspec} longer than rank {ndim}")
    return tuple(out)


def _pspec(spec: Spec) -> P:
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _whole(ndim: int) -> Spec:
    return ((),) * ndim


class _Val:
    __slots__ = ("x", "spec", "bcast")

    def __init__(self, x, spec: Spec, bcast=None):
        # bcast: (operand, equation) of a broadcast_in_dim, rebound at a split's
        # local shape rather than sliced from the whole broadcast
        self.x, self.spec, self.bcast = x, spec, bcast


class _Interpreter:
    """Evaluates a global jaxpr on local values inside ``shard_map`` ([Note: per-shard kernels])."""

    def __init__(self, mesh):
        self.sizes = dict(mesh.shape)
        self.gathers: list = []
        self.collectives = 0
        self.current = ""  # the primitive being evaluated, for ``gathers``

    # -- moving values between specs ------------------------------------------------
    def _n(self, axes) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def gather(self, v: _Val, dims=None) -> _Val:
        """``v`` whole along ``dims`` (default: every dim)."""
        spec = list(v.spec)
        x = v.x
        for d in (range(len(spec)) if dims is None else dims):
            if spec[d]:
                x = jax.lax.all_gather(x, spec[d], axis=d, tiled=True)
                spec[d] = ()
                self.gathers.append((self.current, tuple(np.shape(x))))
        return _Val(x, tuple(spec))

    def slice_to(self, v: _Val, want: Spec) -> _Val:
        """``v`` (whole or split as ``want`` along each dim) split as ``want``."""
        if v.bcast is not None and v.spec != want:
            operand, eqn = v.bcast
            dims, opshape = eqn.params["broadcast_dimensions"], eqn.invars[0].aval.shape
            if all(not axes or have == axes or d not in dims or opshape[dims.index(d)] == 1
                   for d, (have, axes) in enumerate(zip(v.spec, want))):
                params = {"sharding": None} if "sharding" in eqn.params else {}
                (x,) = self.bind(eqn, [operand.x], shape=self.local_shape(eqn.params["shape"], want), **params)
                return _Val(x, want)
        x = v.x
        for d, (have, axes) in enumerate(zip(v.spec, want)):
            if have == axes or not axes:
                continue
            assert not have, (v.spec, want)
            local = x.shape[d] // self._n(axes)
            index = jax.lax.axis_index(axes if len(axes) > 1 else axes[0])
            x = jax.lax.dynamic_slice_in_dim(x, index * local, local, d)
        return _Val(x, want)

    def to(self, v: _Val, want: Spec) -> _Val:
        conflict = [d for d, (h, w) in enumerate(zip(v.spec, want)) if h and h != w]
        if conflict:
            v = self.gather(v, conflict)
        return self.slice_to(v, want)

    def unify(self, vals: list[_Val], ndim: int) -> Spec:
        """One spec for operands of one shape: per dim the split they share,
        or the one split among whole operands; dims split over different
        axes, or axes used twice, are whole."""
        spec, used = [], set()
        for d in range(ndim):
            splits = {v.spec[d] for v in vals if v.spec[d]}
            axes = next(iter(splits)) if len(splits) == 1 else ()
            if axes and used.intersection(axes):
                axes = ()
            used.update(axes)
            spec.append(axes)
        return tuple(spec)

    def local_shape(self, shape, spec: Spec) -> tuple:
        return tuple(s // self._n(a) if a else s for s, a in zip(shape, spec))

    # -- evaluation ------------------------------------------------------------------
    def run(self, jaxpr, consts, args: list[_Val]) -> list[_Val]:
        env: dict = {}

        def read(v):
            if type(v).__name__ == "Literal":
                return _Val(v.val, _whole(np.ndim(v.val)))
            return env[v]

        for var, c in zip(jaxpr.constvars, consts):
            env[var] = _Val(c, _whole(np.ndim(c)))
        for var, a in zip(jaxpr.invars, args):
            env[var] = a
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.equation(eqn, ins)
            for var, o in zip(eqn.outvars, outs):
                env[var] = o
        return [read(v) for v in jaxpr.outvars]

    def equation(self, eqn, ins: list[_Val]) -> list[_Val]:
        name = self.current = eqn.primitive.name
        if name in _NO_PLAN:
            raise NoPlan(f"the jaxpr holds {name}")
        preload.wait()
        from lowering.trace import inlined_body

        body = inlined_body(eqn)
        if body is not None:
            jaxpr, consts, first = body
            return self.run(jaxpr, consts, ins[first:])
        if name in _LAYOUT:  # a layout, not a value: jax.jit's output shardings keep it
            return ins
        rule = self._RULES.get(name)
        rule = None if rule is None else getattr(self, rule)
        if name in _pointwise_names():
            rule = self._pointwise
        elif name in _REDUCE:
            rule = self._reduce
        elif name in _CUMULATIVE:
            rule = self._cumulative
        out = rule(eqn, ins) if rule is not None else None
        return self.whole(eqn, ins) if out is None else out

    def bind(self, eqn, vals, **params):
        prim = eqn.primitive
        out = prim.bind(*vals, **{**eqn.params, **params})
        return list(out) if prim.multiple_results else [out]

    def whole(self, eqn, ins):
        """The equation on whole operands: outputs whole (the opaque-op fallback)."""
        for inner in _sub_eqns(eqn):
            # A loop / branch body is bound as it is, inside shard_map: a sharding
            # constraint there names the mesh's axes, manual in the body, which jax
            # refuses when the program is lowered (a flax nn.scan of layers with
            # with_sharding_constraint crashed). The SPMD path keeps it.
            if inner.primitive.name in _LAYOUT:
                raise NoPlan(f"a {eqn.primitive.name} body holds {inner.primitive.name}")
        vals = [self.gather(v).x for v in ins]
        bind_params = eqn.primitive.get_bind_params(dict(eqn.params))
        subfuns = ()
        if isinstance(bind_params, tuple):
            subfuns, bind_params = bind_params
        out = eqn.primitive.bind(*subfuns, *vals, **bind_params)
        out = list(out) if eqn.primitive.multiple_results else [out]
        return [_Val(o, _whole(np.ndim(o))) for o in out]

    # -- rules (None: run whole) -----------------------------------------------------
    def _pointwise(self, eqn, ins):
        shape = eqn.outvars[0].aval.shape
        ndim = len(shape)
        # operands of the output's rank; a size-1 dim broadcasts (lax ops allow it) and stays whole
        shaped = [i for i, v in enumerate(eqn.invars) if ndim and len(v.aval.shape) == ndim]
        if not shaped:
            return [_Val(o, _whole(np.ndim(o))) for o in self.bind(eqn, [v.x for v in ins])]
        spec = self.unify([ins[i] for i in shaped if tuple(eqn.invars[i].aval.shape) == tuple(shape)]
                          or [ins[i] for i in shaped], ndim)
        vals = [v.x for v in ins]
        for i in shaped:
            gshape = eqn.invars[i].aval.shape
            want = tuple(a if g == n else () for a, g, n in zip(spec, gshape, shape))
            vals[i] = self.to(ins[i], want).x
        params = {"sharding": None} if "sharding" in eqn.params else {}  # convert_element_type's
        return [_Val(o, spec) for o in self.bind(eqn, vals, **params)]

    def _broadcast_in_dim(self, eqn, ins):
        if len(ins) != 1:
            return None  # dynamic shapes
        (v,) = ins
        shape, dims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
        spec = [()] * len(shape)
        for i, d in enumerate(dims):
            if v.spec[i] and np.shape(v.x)[i] * self._n(v.spec[i]) == shape[d]:
                spec[d] = v.spec[i]
            elif v.spec[i]:
                v = self.gather(v, [i])
        spec = tuple(spec)
        params = dict(shape=self.local_shape(shape, spec))
        if "sharding" in eqn.params:
            params["sharding"] = None
        return [_Val(o, spec, (v, eqn)) for o in self.bind(eqn, [v.x], **params)]

    def _transpose(self, eqn, ins):
        (v,) = ins
        perm = eqn.params["permutation"]
        return [_Val(o, tuple(v.spec[p] for p in perm)) for o in self.bind(eqn, [v.x])]

    def _squeeze(self, eqn, ins):
        (v,) = ins
        dims = set(d % len(v.spec) for d in eqn.params["dimensions"])
        spec = tuple(a for d, a in enumerate(v.spec) if d not in dims)
        return [_Val(o, spec) for o in self.bind(eqn, [v.x])]

    def _reshape(self, eqn, ins):
        if len(ins) != 1 or eqn.params.get("dimensions") is not None:
            return None
        (v,) = ins
        gshape = eqn.invars[0].aval.shape
        new = tuple(eqn.params["new_sizes"])
        spec = [()] * len(new)
        gather = []
        for i, axes in enumerate(v.spec):
            if not axes:
                continue
            k = self._n(axes)
            before = math.prod(gshape[:i])
            j = next((j for j in range(len(new)) if math.prod(new[:j]) == before and new[j] != 1), None)
            if j is None:
                gather.append(i)
                continue
            if new[j] >= gshape[i]:  # dim i is the major part of output dim j
                ok = new[j] % gshape[i] == 0 and not spec[j]
            else:  # dim i split into output dims j, j + 1, ...: its split goes to j
                ok = gshape[i] % new[j] == 0 and new[j] % k == 0 and not spec[j]
            if ok:
                spec[j] = axes
            else:
                gather.append(i)
        if gather:
            v = self.gather(v, gather)
        spec = tuple(spec)
        params = dict(new_sizes=self.local_shape(new, spec))
        if "sharding" in eqn.params:
            params["sharding"] = None
        return [_Val(o, spec) for o in self.bind(eqn, [v.x], **params)]

    def _reduce(self, eqn, ins):
        (v,) = ins
        axes = tuple(eqn.params["axes"])
        mesh_axes = tuple(a for d in axes for a in v.spec[d])
        params = {"out_sharding": None} if "out_sharding" in eqn.params else {}
        (out,) = self.bind(eqn, [v.x], **params)
        if mesh_axes:
            collective = getattr(jax.lax, _REDUCE[eqn.primitive.name])
            out = collective(out, mesh_axes)
            self.collectives += 1
        return [_Val(out, tuple(a for d, a in enumerate(v.spec) if d not in axes))]

    def _argmax(self, eqn, ins):
        (v,) = ins
        axes = tuple(eqn.params["axes"])
        if any(v.spec[d] for d in axes):
            v = self.gather(v, axes)
        return [_Val(o, tuple(a for d, a in enumerate(v.spec) if d not in axes)) for o in self.bind(eqn, [v.x])]

    _argmin = _argmax

    def _cumulative(self, eqn, ins):
        (v,) = ins
        axis = eqn.params["axis"]
        if v.spec[axis]:
            v = self.gather(v, [axis])
        return [_Val(o, v.spec) for o in self.bind(eqn, [v.x])]

    def _split(self, eqn, ins):
        (v,) = ins
        axis = eqn.params["axis"]
        if v.spec[axis]:
            v = self.gather(v, [axis])
        return [_Val(o, v.spec) for o in self.bind(eqn, [v.x])]

    def _iota(self, eqn, ins):
        return None  # whole: as a constant

    def _slice(self, eqn, ins):
        (v,) = ins
        shape = eqn.invars[0].aval.shape
        start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
        strides = eqn.params["strides"]
        partial = [d for d, a in enumerate(v.spec) if a and (start[d] != 0 or limit[d] != shape[d]
                                                              or (strides and strides[d] != 1))]
        if partial:
            v = self.gather(v, partial)
        for d, a in enumerate(v.spec):
            if a:
                limit[d] = limit[d] // self._n(a)
        return [_Val(o, v.spec) for o in self.bind(eqn, [v.x], limit_indices=tuple(limit))]

    def _pad(self, eqn, ins):
        v, pad_value = ins
        config = eqn.params["padding_config"]
        padded = [d for d, a in enumerate(v.spec) if a and tuple(config[d]) != (0, 0, 0)]
        if padded:
            v = self.gather(v, padded)
        return [_Val(o, v.spec) for o in self.bind(eqn, [v.x, self.gather(pad_value).x])]

    def _concatenate(self, eqn, ins):
        ndim = len(eqn.outvars[0].aval.shape)
        dim = eqn.params["dimension"]
        ins = [self.gather(v, [dim]) for v in ins]
        spec = self.unify(ins, ndim)
        return [_Val(o, spec) for o in self.bind(eqn, [self.to(v, spec).x for v in ins])]

    def _dot_general(self, eqn, ins):
        lhs, rhs = ins
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        # batch dims: as pointwise
        lspec, rspec = list(lhs.spec), list(rhs.spec)
        for a, b in zip(lb, rb):
            s = lspec[a] or rspec[b]
            if lspec[a] and rspec[b] and lspec[a] != rspec[b]:
                s = ()
            lspec[a] = rspec[b] = s
        # contracting dims: split alike on both sides -> psum; else whole
        reduce_axes = []
        for a, b in zip(lc, rc):
            if lspec[a] and lspec[a] == rspec[b]:
                reduce_axes.extend(lspec[a])
            else:
                lspec[a] = rspec[b] = ()
        lfree = [d for d in range(len(lspec)) if d not in lc and d not in lb]
        rfree = [d for d in range(len(rspec)) if d not in rc and d not in rb]
        used = set(reduce_axes) | {x for d in lb for x in lspec[d]}
        for side, free in ((lspec, lfree), (rspec, rfree)):
            for d in free:
                if used.intersection(side[d]):
                    side[d] = ()
                used.update(side[d])
        lhs, rhs = self.to(lhs, tuple(lspec)), self.to(rhs, tuple(rspec))
        params = {"out_sharding": None} if "out_sharding" in eqn.params else {}
        (out,) = self.bind(eqn, [lhs.x, rhs.x], **params)
        if reduce_axes:
            out = jax.lax.psum(out, tuple(reduce_axes))
            self.collectives += 1
        spec = tuple([lspec[d] for d in lb] + [lspec[d] for d in lfree] + [rspec[d] for d in rfree])
        return [_Val(out, spec)]

    _RULES = {n: "_" + n for n in ("broadcast_in_dim", "transpose", "squeeze", "reshape",
                                   "argmax", "argmin", "split", "iota", "slice", "pad", "concatenate", "dot_general")}


# --------------------------------------------------------------------------- #
# planning
# --------------------------------------------------------------------------- #
def _mesh_and_specs(placement, avals):
    """(mesh, per-leaf specs) of a placement, or NoPlan."""
    from pallaskit import sharding

    mesh, specs = None, []
    for s, a in zip(placement, avals):
        if s is None:
            specs.append(None)
            continue
        s = sharding.traceable(s)
        if not isinstance(s, jax.sharding.NamedSharding) or not isinstance(s.mesh, jax.sharding.Mesh):
            raise NoPlan(f"{type(s).__name__} is not a NamedSharding of a concrete mesh")
        if mesh is None:
            mesh = s.mesh
        elif s.mesh != mesh:
            raise NoPlan("arguments on different meshes")
        specs.append(_spec_of(s.spec, len(a.shape)))
    if mesh is None:
        raise NoPlan("no NamedSharding argument")
    sizes = dict(mesh.shape)
    out = []
    for spec, a in zip(specs, avals):
        spec = _whole(len(a.shape)) if spec is None else spec
        for n, axes in zip(a.shape, spec):
            if axes and n % math.prod(sizes[x] for x in axes):
                raise NoPlan(f"a dim of {n} does not split evenly over {axes}")
        out.append(spec)
    return mesh, out


def plan(closed, placement, avals) -> Plan:
    """The per-shard program of ``closed`` (the global jaxpr of the flat
    leaves) for the leaves' ``placement``; raises NoPlan."""
    for eqn in _all_eqns(closed.jaxpr):
        if eqn.primitive.name in _NO_PLAN:
            raise NoPlan(f"the jaxpr holds {eqn.primitive.name}")
    mesh, specs = _mesh_and_specs(placement, avals)
    interp = _Interpreter(mesh)
    recorded: list = []

    def body(*local):
        outs = interp.run(closed.jaxpr, closed.consts, [_Val(x, s) for x, s in zip(local, specs)])
        recorded[:] = [o.spec for o in outs]
        return tuple(o.x for o in outs)

    in_specs = tuple(_pspec(s) for s in specs)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    n_out = len(closed.jaxpr.outvars)
    traced = jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(),) * n_out,
                                          check_vma=False))(*structs)
    (eqn,) = [e for e in traced.jaxpr.eqns if e.primitive.name == "shard_map"]
    inner = eqn.params["jaxpr"]
    if isinstance(inner, jax.extend.core.ClosedJaxpr):
        if inner.consts:
            raise NoPlan("the per-shard body closes over constants")
        inner = inner.jaxpr
    if inner.constvars or traced.consts or list(eqn.invars) != list(traced.jaxpr.invars):
        raise NoPlan("the per-shard body closes over constants")
    local = jax.extend.core.ClosedJaxpr(inner, ())
    return Plan(mesh, in_specs, tuple(_pspec(s) for s in recorded), local, interp.gathers, interp.collectives)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        yield from _sub_eqns(eqn)


def _sub_eqns(eqn):
    """The equations of ``eqn``'s sub-jaxprs (loop and branch bodies...), nested ones too."""
    for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield from _all_eqns(inner)


def attach(placed, closed, avals, build, options, mode: str, title: str):
    """Plan a sharded signature per shard when option ``shard_kernels``
    (``mode``) asks for it: sets ``placed.per_shard`` and returns ``build``
    compiling the local jaxpr; else ``build`` unchanged (the SPMD path).
    ``build(options, jaxpr=None)``: ``orchestrator.compile_signature``'s compile of one
    signature."""
    if not (mode == "per_shard" or (mode == "auto" and not options.interpret)):
        return build
    try:
        placed.per_shard = plan(closed, placed.placement, avals)
    except NoPlan as e:
        log.info("pallaskit: %s runs through SPMD partitioning, not per shard: %s", title, e)
        return build
    except Exception as e:  # noqa: BLE001  (a rule this jaxpr breaks: the SPMD path is still right)
        log.warning("pallaskit: %s runs through SPMD partitioning, not per shard: planning failed: %s: %s", title,
                    type(e).__name__, e)
        placed.per_shard = None
        return build
    p = placed.per_shard
    from pallaskit import metrics

    metrics.counters["per_shard_graphs"] += 1
    log.debug("pallaskit: %s per shard over %s: %d collective(s), %d value(s) gathered", title,
              dict(p.mesh.shape), p.collectives, len(p.gathers))
    return lambda options=options: build(options, jaxpr=p.local)
