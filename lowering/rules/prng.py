"""Threefry random bits inside kernels: ``random_bits``, ``random_split`` and
``random_fold_in`` of ``key<fry>`` keys as pointwise bodies, bit-exact with jax.

[Note: key values]
A ``key<fry>`` jaxpr value reaches the rules either as the key itself (a
program input, an extern's result: dtype ``V`` to the IR, only externs touch it)
or as its data, a ``uint32[..., 2]`` buffer (what ``random_wrap`` of a legacy
``PRNGKey`` and this module's rules produce). ``key_data`` and ``key_value``
convert between the two where a consumer needs the other form, through
``random_unwrap`` / ``random_wrap`` externs that are views in XLA (the program
writes them as ``jax.random.key_data`` / ``wrap_key_data``: no extern callable).
Keys of other implementations keep today's path: every equation touching them
is an extern.

Each element's counter is its row-major position in the sampled shape, as
``jax._src.random.prng.iota_2x32_shape`` (the partitionable scheme, jax's
default: ``jax_threefry_partitionable``, recorded in the equation's context).
An equation traced with the flag off, a 64-bit width, a symbolic shape or a
shape of 2**31 elements or more keeps XLA's path: never another stream.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import sympy

from lowering import ir, sizes
from lowering.rules.registry import register_lowering

U32 = np.dtype(np.uint32)
THREEFRY = "threefry2x32"
KEY_PRIMITIVES = frozenset({"random_bits", "random_split", "random_fold_in", "random_wrap", "random_unwrap"})
# Kernel index arithmetic is int32: a counter past it would wrap.
MAX_ELEMENTS = 2 ** 31 - 1

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def is_threefry_key(aval) -> bool:
    """Is ``aval`` an array of threefry keys (``key<fry>``)?"""
    impl = getattr(getattr(aval, "dtype", None), "_impl", None)
    return getattr(impl, "name", None) == THREEFRY


def touches_keys(eqn) -> bool:
    return any(is_threefry_key(v.aval) for v in list(eqn.invars) + list(eqn.outvars))


@functools.lru_cache(maxsize=None)
def _views():
    """The ``random_wrap`` / ``random_unwrap`` equations of a threefry key (primitive, params)."""
    import jax
    import jax.numpy as jnp

    closed = jax.make_jaxpr(lambda d: jax.random.key_data(jax.random.wrap_key_data(d, impl=THREEFRY)))(
        jax.ShapeDtypeStruct((2,), jnp.uint32))
    wrap, unwrap = closed.jaxpr.eqns
    return (wrap.primitive, dict(wrap.params)), (unwrap.primitive, dict(unwrap.params))


def _is_data(ctx, value, key_aval) -> bool:
    if isinstance(value, ir.Const):
        return False
    try:
        shape, dtype = ctx.aval_of(value)
    except (KeyError, TypeError):  # a key-typed extern result
        return False
    return dtype == U32 and tuple(shape) == tuple(key_aval.shape) + (2,)


def _view(ctx, which, value, out_aval) -> str:
    (prim, params) = _views()[which]
    memo = ctx.__dict__.setdefault("_key_views", {})
    if (which, value) in memo:
        return memo[(which, value)]
    name = ctx.new_name()
    ctx._add(ir.Extern(name, tuple(out_aval.shape), np.dtype("V") if which == 0 else U32, (ctx.current_eqn,),
                       primitive=prim, params=dict(params), inputs=(value,), outputs=(name,),
                       out_avals=(out_aval,)))
    memo[(which, value)] = name
    # the other direction of the same pair needs no second view
    memo[(1 - which, name)] = value
    return name


def key_data(ctx, value, key_aval):
    """The ``uint32[..., 2]`` data of a threefry key value ([Note: key values])."""
    if _is_data(ctx, value, key_aval):
        return value
    import jax

    return _view(ctx, 1, value, jax.core.ShapedArray(tuple(key_aval.shape) + (2,), U32))


def key_value(ctx, value, aval):
    """``value`` as what a jaxpr variable of ``aval`` holds for an extern: keys
    held as their data are wrapped; anything else is returned as it is."""
    if not is_threefry_key(aval) or not _is_data(ctx, value, aval):
        return value
    return _view(ctx, 0, value, aval)


# -- threefry2x32 as IR ops ---------------------------------------------------------------
def _c(v) -> ir.Const:
    return ir.Const(int(v) & 0xFFFFFFFF, U32)


def _op(name, *args) -> ir.Op:
    return ir.Op(name, tuple(args), U32)


def _rotl(x, d):
    return _op("or", _op("shift_left", x, _c(d)), _op("shift_right_logical", x, _c(32 - d)))


def threefry2x32(k0, k1, x0, x1) -> tuple:
    """jax's ``_threefry2x32_lowering`` (unrolled) on uint32 expressions."""
    ks = (k0, k1, _op("xor", _op("xor", k0, k1), _c(0x1BD11BDA)))
    x0 = ks[0] if x0 == _c(0) else _op("add", x0, ks[0])  # the counter's high word is 0 below 2**32
    x1 = _op("add", x1, ks[1])
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = _op("add", x0, x1)
            x1 = _op("xor", x0, _rotl(x1, r))
        x0 = _op("add", x0, ks[(i + 1) % 3])
        x1 = _op("add", _op("add", x1, ks[(i + 2) % 3]), _c(i + 1))
    return x0, x1


# -- rules ---------------------------------------------------------------------------------
def _static(shape) -> tuple:
    if any(sizes.is_symbolic(d) for d in shape):
        raise NotImplementedError("random bits of a symbolic shape")
    return tuple(int(d) for d in shape)


def _partitionable(eqn) -> None:
    if getattr(getattr(eqn, "ctx", None), "threefry_partitionable", None) is not True:
        raise NotImplementedError("jax_threefry_partitionable off: the original counter layout")


def _key_words(ctx, eqn, value, index):
    """The two key words of the key at ``index`` (the key array's own dims)."""
    aval = eqn.invars[0].aval
    if not is_threefry_key(aval):
        raise NotImplementedError("not a threefry key")
    data = key_data(ctx, value, aval)
    return ctx.load(data, tuple(index) + (0,)), ctx.load(data, tuple(index) + (1,))


def _counter(index, shape) -> ir.Expr:
    """``iota_2x32_shape``'s low word (the high one is 0 below 2**32 elements)."""
    if not shape:
        return _c(0)
    return ir.IndexValue(sizes.ravel(index, shape), U32)


@register_lowering("random_bits", kind="pointwise",
                   note="threefry keys (partitionable counters, 8/16/32-bit); other keys through XLA")
def _random_bits(ctx, eqn, key):
    _partitionable(eqn)
    bit_width, shape = eqn.params["bit_width"], _static(eqn.params["shape"])
    if bit_width not in (8, 16, 32):
        raise NotImplementedError(f"{bit_width}-bit random bits")
    aval = eqn.outvars[0].aval
    kshape = _static(eqn.invars[0].aval.shape)
    if math.prod(shape) > MAX_ELEMENTS or math.prod(kshape) * 2 > MAX_ELEMENTS:
        raise NotImplementedError("random bits past int32 indexing")
    idx = ctx.symbols(len(aval.shape))
    k0, k1 = _key_words(ctx, eqn, key, idx[:len(kshape)])
    y0, y1 = threefry2x32(k0, k1, _c(0), _counter(idx[len(kshape):], shape))
    body = _op("xor", y0, y1)
    if bit_width != 32:  # the low bits, as jax's convert_element_type
        body = ir.Op("convert_element_type", (body,), np.dtype(aval.dtype), (("new_dtype", np.dtype(aval.dtype)),))
    return [ctx.pointwise(aval, body)]


def _select_word(idx_last, y0, y1):
    """A key's data: word 0 at ``idx_last == 0``, word 1 at 1."""
    first = ir.IndexValue(sympy.Eq(idx_last, 0), np.dtype(bool))
    return ir.Op("select_n", (first, y1, y0), U32)


@register_lowering("random_split", kind="pointwise", note="threefry keys (partitionable): the new keys' data")
def _random_split(ctx, eqn, key):
    _partitionable(eqn)
    shape = _static(eqn.params["shape"])
    kshape = _static(eqn.invars[0].aval.shape)
    out = eqn.outvars[0].aval
    if math.prod(shape) > MAX_ELEMENTS or math.prod(kshape + shape) * 2 > MAX_ELEMENTS:
        raise NotImplementedError("a split past int32 indexing")
    import jax

    data_aval = jax.core.ShapedArray(tuple(out.shape) + (2,), U32)
    idx = ctx.symbols(len(data_aval.shape))
    k0, k1 = _key_words(ctx, eqn, key, idx[:len(kshape)])
    y0, y1 = threefry2x32(k0, k1, _c(0), _counter(idx[len(kshape):-1], shape))
    return [ctx.pointwise(data_aval, _select_word(idx[-1], y0, y1))]


@register_lowering("random_fold_in", kind="pointwise", note="threefry keys: the new keys' data")
def _random_fold_in(ctx, eqn, key, msgs):
    out = eqn.outvars[0].aval
    kaval, maval = eqn.invars[0].aval, eqn.invars[1].aval
    oshape = _static(out.shape)
    mdt = np.dtype(maval.dtype)
    if mdt not in (U32, np.dtype(np.int32)):
        raise NotImplementedError("a fold_in message other than 32-bit")  # a wider one's high word is not 0
    if math.prod(oshape) * 2 > MAX_ELEMENTS:
        raise NotImplementedError("a fold_in past int32 indexing")
    import jax

    data_aval = jax.core.ShapedArray(oshape + (2,), U32)
    idx = ctx.symbols(len(data_aval.shape))
    # broadcasting as lax's: equal ranks, size-1 dims stretch (ctx.load reads them at 0)
    kshape, mshape = _static(kaval.shape), _static(maval.shape)
    if len(kshape) != len(oshape) or len(mshape) != len(oshape):
        raise NotImplementedError("fold_in of unequal ranks")
    k0, k1 = _key_words(ctx, eqn, key, idx[:-1])
    m = ctx.load(msgs, idx[:-1])
    if mdt != U32:  # the seed's bits: int32 -> uint32 keeps them
        m = ir.Op("convert_element_type", (m,), U32, (("new_dtype", U32),))
    y0, y1 = threefry2x32(k0, k1, _c(0), m)
    return [ctx.pointwise(data_aval, _select_word(idx[-1], y0, y1))]


@register_lowering("random_wrap", kind="view", note="threefry keys: the key is its data")
def _random_wrap(ctx, eqn, data):
    if not is_threefry_key(eqn.outvars[0].aval):
        raise NotImplementedError("not a threefry key")
    return [data]


@register_lowering("random_unwrap", kind="view", note="threefry keys: the key's data")
def _random_unwrap(ctx, eqn, key):
    aval = eqn.invars[0].aval
    if not is_threefry_key(aval):
        raise NotImplementedError("not a threefry key")
    return [key_data(ctx, key, aval)]


# -- shape primitives on keys ----------------------------------------------------------------
class _Var:
    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


class _DataEqn:
    """A shape equation on keys restated on their data (one more, trailing dim of 2)."""

    def __init__(self, eqn, params):
        self.primitive, self.effects, self.params = eqn.primitive, eqn.effects, params
        self.ctx = getattr(eqn, "ctx", None)
        self.invars = [_Var(_data_aval(v.aval)) for v in eqn.invars]
        self.outvars = [_Var(_data_aval(v.aval)) for v in eqn.outvars]


def _data_aval(aval):
    import jax

    return jax.core.ShapedArray(tuple(aval.shape) + (2,), U32)


def _data_params(eqn):
    """The params of ``eqn`` (a shape primitive on keys) on the keys' data, or None."""
    p, name = dict(eqn.params), eqn.primitive.name
    nd = len(eqn.outvars[0].aval.shape)
    if name == "slice":
        p["start_indices"] = tuple(p["start_indices"]) + (0,)
        p["limit_indices"] = tuple(p["limit_indices"]) + (2,)
        if p.get("strides") is not None:
            p["strides"] = tuple(p["strides"]) + (1,)
    elif name == "reshape":
        if p.get("dimensions") is not None:
            return None
        p["new_sizes"] = tuple(p["new_sizes"]) + (2,)
    elif name == "broadcast_in_dim":
        p["shape"] = tuple(p["shape"]) + (2,)
        p["broadcast_dimensions"] = tuple(p["broadcast_dimensions"]) + (nd,)
    elif name == "transpose":
        p["permutation"] = tuple(p["permutation"]) + (nd,)
    elif name == "squeeze":
        n_in = len(eqn.invars[0].aval.shape)
        p["dimensions"] = tuple(d % n_in for d in p["dimensions"])
    elif name in ("unstack", "split"):  # jax 0.11 unpacks ``k1, k2 = split(k)`` with unstack
        p["axis"] = p["axis"] % len(eqn.invars[0].aval.shape)
    elif name != "concatenate":  # its dimension stays
        return None
    return p


KEY_SHAPE_PRIMITIVES = frozenset({"slice", "reshape", "broadcast_in_dim", "transpose", "squeeze", "concatenate",
                                  "unstack", "split"})


def lower_key_shape_eqn(ctx, eqn, invals, rule):
    """A shape primitive whose operands and result are threefry keys, lowered
    by ``rule`` (the primitive's own) on the keys' data; None where it does not apply."""
    if eqn.effects or not all(is_threefry_key(v.aval) for v in list(eqn.invars) + list(eqn.outvars)):
        return None
    if any(sizes.is_symbolic(d) for v in list(eqn.invars) + list(eqn.outvars) for d in v.aval.shape):
        return None
    params = _data_params(eqn)
    if params is None:
        return None
    data = [key_data(ctx, x, v.aval) for x, v in zip(invals, eqn.invars)]
    try:
        return rule.fn(ctx, _DataEqn(eqn, params), *data)
    except NotImplementedError:
        return None
