"""What ``pallaskit.jit`` forwards to the XLA executable of a generated program.

[Note: XLA arguments]
jax.jit's ``donate_argnums`` / ``donate_argnames``, ``in_shardings`` /
``out_shardings`` and ``keep_unused`` are about the executable, not the
compiler: pallaskit resolves them per call signature into ``XlaArgs`` (one
entry per flat dynamic leaf, in the order ``jax.tree_util`` flattens
``(dynamic args, dynamic kwargs)``, which is the order of the generated
program's inputs) and every ``jax.jit`` of a generated program goes through
``XlaArgs.jit``. The hoisted constants that follow the leaves are never
donated and take no sharding. ``XlaArgs.key()`` goes into the graph cache key,
since donation and shardings change the executable. This module is the one
place sharding plumbing lives.

A call whose arrays are all on the default device, some committed to it
(``jax.device_put(x, device)``, or a committed call's outputs), is lowered
with their device's sharding (``XlaArgs.committed``), so that its outputs are
committed as jax.jit's are, and is a signature of its own.

A call whose arrays are placed off the default device ([Note: sharding] in
pallaskit/sharding.py) adds its ``sharding.Placed`` (``XlaArgs.placed``,
``with_placement``): the one object that decides how the program is lowered
(``lower``). Each leaf's sharding is then its array's; a user's
``in_shardings`` entry for a placed leaf must be that sharding (jax.jit's
error otherwise) and shards the leaves that have none; the user's
``out_shardings``, when given, replace jax.jit's propagated ones.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading
import warnings
from typing import Any, Callable

import jax
import numpy as np

from pallaskit import sharding, signature

UNSET = object()  # an option the user did not give (jax.jit's UNSPECIFIED)


@dataclasses.dataclass(frozen=True)
class XlaArgs:
    """Per-signature XLA arguments of a generated program ``call(*leaves, *constants)``."""

    donate: tuple[int, ...] = ()  # flat leaf indices of donated leaves
    in_shardings: tuple | None = None  # one per flat leaf (None: unspecified), or None for none given
    out_shardings: Any = None  # one per flat output, or None for none given
    keep_unused: bool = False
    placed: Any = None  # a sharded signature's sharding.Placed ([Note: sharding])
    committed: bool = False  # arrays committed to the default device: outputs committed too, as jax.jit's

    def __bool__(self):
        return bool(self.donate or self.in_shardings is not None or self.out_shardings is not None
                    or self.keep_unused or self.placed is not None or self.committed)

    def with_placement(self, placement, flat_fn, avals) -> XlaArgs:
        """These arguments for a call whose leaves are placed (``placement``:
        per-leaf shardings, None where a leaf has none), the user's
        ``in_shardings`` merged in; ``flat_fn(*leaves)``: the function, for
        jax.jit's output shardings."""
        from pallaskit import sharding

        merged, by_user = list(placement), []
        mesh = None
        for i, user in enumerate(self.in_shardings or ()):
            if isinstance(user, jax.sharding.PartitionSpec):  # as jax.jit: over jax.set_mesh's mesh
                mesh = mesh or signature.concrete_mesh()
                if mesh is None or getattr(mesh, "empty", False):  # jax.jit's error, word for word
                    raise RuntimeError(
                        "jit requires a non-empty mesh in context if you are passing `PartitionSpec`s to "
                        "in_shardings. You can define a context mesh via `jax.set_mesh(mesh)`. Alternatively, "
                        "provide `Sharding`s to in_shardings and then the mesh context manager is not required.")
                user = jax.sharding.NamedSharding(mesh, user)
            if not isinstance(user, jax.sharding.Sharding):
                continue  # unspecified: the array's own sharding decides
            user.shard_shape(avals[i].shape)  # jax.jit's IndivisibleError first
            have = merged[i]
            if have is None:
                merged[i] = user
                by_user.append(i)
            elif not have.is_equivalent_to(user, len(avals[i].shape)):
                raise ValueError(f"Sharding passed to jit does not match the sharding on the respective arg. "
                                 f"Got jit sharding: {user},\narg sharding: {have} for arg type: {avals[i]}")
        return dataclasses.replace(self, in_shardings=None,
                                   placed=sharding.Placed(merged, flat_fn, avals, self.out_shardings, by_user))

    def for_outputs(self, out_tree, title: str = "") -> XlaArgs:
        """These arguments with the user's ``out_shardings`` (a pytree prefix of
        the function's outputs, as jax.jit takes it) made one per flat output:
        the generated program returns the flat outputs."""
        spec = self.out_shardings
        if spec is None or _is_sharding_leaf(spec):
            return self  # one sharding: jax.jit gives it to every output
        flat = _broadcast(spec, out_tree, f"{title}: out_shardings", "the function's outputs")
        return dataclasses.replace(self, out_shardings=tuple(flat))

    def names_shardings(self) -> bool:
        """Whether the user's ``in_shardings`` / ``out_shardings`` name a sharding
        (then jax.jit's output shardings are wanted: [Note: sharding])."""
        # A PartitionSpec names the devices of jax.set_mesh's mesh.
        return any(isinstance(s, (jax.sharding.Sharding, jax.sharding.PartitionSpec))
                   for spec in (self.in_shardings, self.out_shardings) if spec is not None
                   for s in jax.tree_util.tree_leaves(spec, is_leaf=_is_sharding_leaf))

    def jit_kwargs(self, n_constants: int) -> dict:
        """``jax.jit`` keyword arguments for ``call(*leaves, *constants)``."""
        kw: dict = {}
        if self.donate:
            kw["donate_argnums"] = self.donate
        if self.in_shardings is not None:
            kw["in_shardings"] = tuple(self.in_shardings) + (None,) * n_constants
        if self.out_shardings is not None:
            kw["out_shardings"] = self.out_shardings
        if self.keep_unused:
            kw["keep_unused"] = True
        return kw

    def key(self) -> str:
        """Text for the graph cache key (empty when nothing is forwarded)."""
        if not self:
            return ""
        return repr((self.donate, _shardings_text(self.in_shardings), _shardings_text(self.out_shardings),
                     self.keep_unused, None if self.placed is None else self.placed.key_text())
                    + (("committed",) if self.committed else ()))


def _shardings_text(shardings) -> str:
    return "" if shardings is None else repr(tuple(repr(s) + sharding.devices_text(s) for s in jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda s: s is None)))


def _is_sharding_leaf(s) -> bool:
    return s is None or isinstance(s, (jax.sharding.Sharding, jax.sharding.PartitionSpec))


def resolve(treedef, n_args: int, static_argnums, donate_argnums, donate_argnames, in_shardings, out_shardings,
            keep_unused: bool, title: str) -> XlaArgs:
    """The ``XlaArgs`` of one call signature. ``treedef``: of ``(dynamic args
    list, dynamic kwargs dict)``; ``n_args``: positional arguments of the call,
    static ones included. A positional argument is donated when its position
    is in ``donate_argnums``, a keyword argument when its name is in
    ``donate_argnames`` (both completed from the signature, as jax.jit does)."""
    args_tree, kwargs_tree = treedef.children()
    dyn_positions = [i for i in range(n_args) if i not in static_argnums]
    donate, start = [], 0
    for j, sub in enumerate(args_tree.children()):
        pos = dyn_positions[j] if j < len(dyn_positions) else j
        if pos in donate_argnums:
            donate.extend(range(start, start + sub.num_leaves))
        start += sub.num_leaves
    for name, sub in zip(kwargs_tree.node_data()[1], kwargs_tree.children()):
        if name in donate_argnames:
            donate.extend(range(start, start + sub.num_leaves))
        start += sub.num_leaves
    flat_in = None
    if in_shardings is not UNSET:
        if kwargs_tree.num_leaves:
            raise ValueError(f"pallaskit.jit: {title}: keyword arguments cannot be used with in_shardings "
                             f"(as with jax.jit); pass them positionally")
        subtrees = args_tree.children()
        spec = in_shardings
        if _is_sharding_leaf(spec):  # one sharding for every argument
            spec = (spec,) * len(subtrees)
        spec = tuple(spec)
        if len(spec) != len(subtrees):
            raise ValueError(f"pallaskit.jit: {title}: in_shardings has {len(spec)} entries but the call has "
                             f"{len(subtrees)} dynamic positional argument(s)")
        flat_in = []
        for s, sub in zip(spec, subtrees):
            flat_in.extend(_broadcast(s, sub, f"{title}: in_shardings"))
        flat_in = tuple(flat_in)
    flat_out = None if out_shardings is UNSET else out_shardings
    return XlaArgs(tuple(donate), flat_in, flat_out, bool(keep_unused))


def _broadcast(spec, subtree, what, whose: str = "the argument's pytree") -> list:
    """A sharding (or None) for each leaf of ``subtree`` from ``spec``, a
    pytree prefix of it whose leaves are shardings or None."""
    if _is_sharding_leaf(spec):
        return [spec] * subtree.num_leaves
    # A pytree prefix, as jax.jit takes it: its structure (dict keys, node types), not only its
    # leaf count, must match (``{'v': s}`` for an argument ``{'w': x}`` ran unsharded).
    spec_tree = jax.tree_util.tree_structure(spec, is_leaf=_is_sharding_leaf)
    try:
        subtrees = spec_tree.flatten_up_to(subtree.unflatten(range(subtree.num_leaves)))
    except (ValueError, TypeError) as e:
        raise ValueError(f"pallaskit.jit: {what}: {spec!r} is not a pytree prefix of {whose} {subtree}: {e}") \
            from None
    return [s for s, sub in zip(jax.tree_util.tree_leaves(spec, is_leaf=_is_sharding_leaf), subtrees)
            for _ in jax.tree_util.tree_leaves(sub)]


def jit(call: Callable, xla: XlaArgs | None, n_constants: int, **kwargs):
    """``jax.jit(call)`` with the signature's XLA arguments."""
    return jax.jit(call, **(xla.jit_kwargs(n_constants) if xla else {}), **kwargs)


def lower(call: Callable, structs, constants, xla: XlaArgs | None):
    """``call(*leaves, *constants)`` lowered for ``structs`` (ShapeDtypeStructs
    of the leaves: a sharded signature's carry its shardings) with the
    signature's XLA arguments."""
    with _without_mosaic_interpreters():
        return _lower(call, structs, constants, xla)


# [Note: Pallas's interpreters left unimported]
# On the CPU every kernel is a ``pallas_call(..., interpret=True)``. jax's lowering
# of one (jax/_src/pallas/pallas_call.py, ``_pallas_call_lowering``) imports the
# Mosaic TPU and Mosaic GPU interpreters on each use, only to ask whether
# ``interpret`` is one of their parameter classes; pallaskit passes ``True``, so
# neither is used. The Mosaic GPU one imports Mosaic GPU and MLIR's LLVM dialect:
# about as long as the compiler's own import, and most of a small function's
# first call on the CPU (benchmarks/RESULTS.md, "Session 35"). While pallaskit
# lowers a program, each of the two modules that no one has imported yet reads
# as missing in ``sys.modules``: jax's lowering catches the ImportError and runs
# its plain interpreter, as where they are not installed. (Their packages'
# ``params`` modules, which Pallas's core imports, are left alone.) After, the
# entries are removed, so a later import anywhere loads the modules as usual;
# one already imported stays as it is. Nested and concurrent lowerings share one
# window (a count under a lock).
_MOSAIC_INTERPRETERS = ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",
                        "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
_hidden: list = []
_hiding = [0]
_hiding_lock = threading.Lock()


@contextlib.contextmanager
def _without_mosaic_interpreters():
    with _hiding_lock:
        if _hiding[0] == 0:
            _hidden[:] = [n for n in _MOSAIC_INTERPRETERS if n not in sys.modules]
            for n in _hidden:
                sys.modules[n] = None
        _hiding[0] += 1
    try:
        yield
    finally:
        with _hiding_lock:
            _hiding[0] -= 1
            if _hiding[0] == 0:
                for n in _hidden:
                    if n in sys.modules and sys.modules[n] is None:
                        del sys.modules[n]
                _hidden.clear()


_warned = threading.local()


@contextlib.contextmanager
def donation_warned():
    """While this thread compiles the static program of a size the dispatcher
    served before (a tier-up): jax's warning of unusable donated buffers was
    given for that size then ([Note: donation without XLA's aliasing]), and
    jax.jit gives it once per size, so its lowering here does not repeat it."""
    _warned.on = True
    try:
        yield
    finally:
        _warned.on = False


def _lower(call: Callable, structs, constants, xla: XlaArgs | None):
    placed = xla.placed if xla else None
    quiet = getattr(_warned, "on", False) and xla is not None and bool(xla.donate)
    if placed is None:
        if xla and xla.committed:  # jax.jit's outputs of committed arguments are committed
            from pallaskit import sharding

            on = jax.sharding.SingleDeviceSharding(sharding.default_device())
            structs = [jax.ShapeDtypeStruct(s.shape, s.dtype, weak_type=s.weak_type, sharding=on) for s in structs]
        with _unusable_donations_ignored(quiet):
            return jit(call, xla, len(constants)).lower(*structs, *constants)
    kw = xla.jit_kwargs(len(constants))
    if placed.per_shard is not None:  # [Note: per-shard kernels] in pallaskit/per_shard.py
        call = placed.per_shard.wrap(call, len(constants))
    if "out_shardings" not in kw:
        kw["out_shardings"] = placed.out_shardings()  # jax.jit's, for these input shardings
    else:  # the user's, with jax.jit's propagation where they say None
        kw["out_shardings"] = placed.out_shardings()
    replicated = placed.replicated()
    # c.dtype: a typed PRNG key (a closed-over jax.random.key) has no NumPy form
    const_structs = [jax.ShapeDtypeStruct(np.shape(c), c.dtype if hasattr(c, "dtype") else np.asarray(c).dtype,
                                          sharding=replicated) for c in constants]
    with placed.context(), _unusable_donations_ignored(bool(xla.donate) and (quiet or _donates_all(xla, placed))):
        return jax.jit(call, **kw).lower(*structs, *const_structs)


@contextlib.contextmanager
def _unusable_donations_ignored(ignore: bool):
    """jax's warning of unusable donated buffers left out while lowering, where ``ignore``."""
    if not ignore:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        yield


def _donates_all(xla: XlaArgs, placed) -> bool:
    """Whether jax.jit of the function donates every donated argument to XLA,
    warning of none: a program over several devices whose output shardings it
    propagates, some or all (``mlir.lower_jaxpr_to_module``). pallaskit lowers
    its program with those shardings given, for which jax warns of the
    arguments it cannot alias."""
    user = xla.out_shardings
    unset = user is None or (isinstance(user, (tuple, list)) and any(s is None for s in user))
    return unset and len(placed.devices()) > 1


# [Note: donation without XLA's aliasing]
# A dispatcher of variants or an eager launch runs the program with no XLA
# donation of its own, so pallaskit deletes the donated arrays itself. jax.jit
# deletes only the donated arguments XLA took (``mlir._set_up_aliases``, then
# XLA): an argument the program does not read is pruned, never donated; one of
# an output's shape and dtype is aliased to it (first donated argument first,
# outputs in order); one whose element count an unaliased output has is given
# to XLA as a donor, and XLA takes it where an unaliased output has its bytes
# (a float32[n, 2] for an int32[n, 2], not for a bfloat16 one); the others stay
# alive. jax.jit's warning "Some donated buffers were not usable" names the
# arguments with neither an alias nor a donor's match, once per compile. A
# call with dynamic dims runs on one device. ``donation_plan`` is that rule for
# one call's concrete avals; the entry keeps each plan by those avals
# (``Compiled.donation``), so a size warns once, as jax.jit's compile of it does.
def _used_inputs(jaxpr, n: int) -> list:
    """Which of the ``n`` inputs of a closed jaxpr jax.jit's DCE keeps (all
    where unknown)."""
    try:
        from jax._src.interpreters import partial_eval as pe

        inner = jaxpr.jaxpr
        _, used = pe.dce_jaxpr(inner, [True] * len(inner.outvars))
        return list(used)[:n] if len(used) >= n else [True] * n
    except Exception:  # noqa: BLE001 - another jax: every input counts as read
        return [True] * n


def donation_plan(leaves, donate: tuple[int, ...], outs, jaxpr=None, keep_unused: bool = False) -> tuple[int, ...]:
    """The donated leaves jax.jit would delete for a call of these leaves with
    these flat outputs; warns, as jax.jit does, naming the ones it cannot use."""
    def aval(x):
        return (tuple(np.shape(x)), x.dtype) if hasattr(x, "dtype") else None  # x.dtype: key<fry> too

    def nbytes(x):
        return int(np.size(x)) * getattr(x.dtype, "itemsize", 0)

    used_inputs = [True] * len(leaves) if keep_unused or jaxpr is None else _used_inputs(jaxpr, len(leaves))
    donate = [i for i in donate if isinstance(leaves[i], jax.Array) and used_inputs[i]]
    pending = collections.defaultdict(collections.deque)
    for i in donate:
        pending[aval(leaves[i])].append(i)
    aliased, unmatched = set(), []
    for o in outs:
        key = aval(o)
        if key is None:
            continue
        if pending.get(key):
            aliased.add(pending[key].popleft())
        else:
            unmatched.append(o)
    by_count = collections.Counter(int(np.size(o)) for o in unmatched)
    by_bytes = collections.Counter(nbytes(o) for o in unmatched)
    taken, unusable = set(aliased), []
    for i in donate:  # the rest: XLA's donors where an unaliased output has as many elements
        if i in aliased:
            continue
        if by_count[int(np.size(leaves[i]))] > 0:
            by_count[int(np.size(leaves[i]))] -= 1
            if by_bytes[nbytes(leaves[i])] > 0:  # XLA reuses a donor for an output of its bytes
                by_bytes[nbytes(leaves[i])] -= 1
                taken.add(i)
        else:
            unusable.append(i)
    if unusable:
        text = ", ".join(str(jax.core.ShapedArray(np.shape(leaves[i]), leaves[i].dtype)) for i in unusable)
        warnings.warn(f"Some donated buffers were not usable: {text}.\n"
                      "See an explanation at https://docs.jax.dev/en/latest/faq.html#buffer-donation.",
                      stacklevel=5)
    return tuple(i for i in donate if i in taken)


def delete_donated(leaves, donate: tuple[int, ...], outs, plans: dict | None = None, jaxpr=None,
                   keep_unused: bool = False) -> None:
    """Invalidate donated arrays after a call that did not go through one
    executable with XLA's donation (eager launches, multi-kernel dispatch), as
    jax.jit's donation does ([Note: donation without XLA's aliasing]); an output
    that is the argument itself stays. ``plans``: the entry's plans by the call's
    avals (each warns once)."""
    key = tuple((np.shape(leaves[i]), getattr(leaves[i], "dtype", None)) for i in donate)
    key += tuple((np.shape(o), getattr(o, "dtype", None)) for o in outs)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = donation_plan(leaves, donate, outs, jaxpr, keep_unused)
        if plans is not None:
            plans[key] = plan
    keep = {id(o) for o in outs}
    for i in plan:
        x = leaves[i]
        if id(x) not in keep and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            if not x.is_deleted():
                x.delete()
