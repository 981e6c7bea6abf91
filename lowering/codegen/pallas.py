"""The Pallas dialect: each scheduled kernel becomes a readable Pallas kernel
(Triton lowering on the GPU, interpret mode on the CPU) plus a launcher (its
``pallas_call`` on flat refs in ``pl.ANY`` memory); codegen/program.py's
wrapper ``call`` runs kernels and externs in order.

``PallasEmitter`` spells the shared kernel emitter's values (codegen/emitter.py,
[Note: kernel shape]) in jnp / lax / ``plt.load``; loops are ``lax.fori_loop``
over nested body functions carrying their accumulators.
"""
from __future__ import annotations

import numpy as np

from lowering import heuristics, ir, sizes
from lowering.codegen import matmul
from lowering.codegen.emitter import (KernelEmitter, RenderedKernel, is_float, kernel_coords_body, reduction_identity,
                                      select_n_template, used_dims, whole_rows, write_pointwise)
from lowering.codegen.mix import write_mix
from lowering.codegen.rows import render_rows
from lowering.codegen.tiles import kernel_config
from lowering.codegen.writer import SourceWriter
from lowering.options import CompileOptions
from lowering.scheduler import Kernel, Schedule, _origins
from lowering.symbolic import program_dims

# op name -> source template over broadcast operands {0}, {1}...; params by name.
OPS = {
    "add": "lax.add({0}, {1})", "sub": "lax.sub({0}, {1})", "mul": "lax.mul({0}, {1})",
    "div": "lax.div({0}, {1})", "rem": "lax.rem({0}, {1})", "neg": "lax.neg({0})",
    "max": "lax.max({0}, {1})", "min": "lax.min({0}, {1})", "pow": "lax.pow({0}, {1})",
    "integer_pow": "lax.integer_pow({0}, {y})", "square": "lax.square({0})", "abs": "lax.abs({0})",
    "sign": "lax.sign({0})", "nextafter": "lax.nextafter({0}, {1})", "atan2": "lax.atan2({0}, {1})",
    "exp": "lax.exp({0})", "exp2": "lax.exp2({0})", "log": "lax.log({0})", "log1p": "lax.log1p({0})",
    "expm1": "lax.expm1({0})", "tanh": "lax.tanh({0})", "logistic": "lax.logistic({0})",
    "sqrt": "lax.sqrt({0})", "rsqrt": "lax.rsqrt({0})", "cbrt": "lax.cbrt({0})",
    "erf": "_erf({0})", "erfc": "_erfc({0})", "erf_inv": "_erf_inv({0})",
    "sin": "lax.sin({0})", "cos": "lax.cos({0})", "tan": "lax.tan({0})", "asin": "lax.asin({0})",
    "acos": "lax.acos({0})", "atan": "lax.atan({0})", "sinh": "lax.sinh({0})", "cosh": "lax.cosh({0})",
    "asinh": "lax.asinh({0})", "acosh": "lax.acosh({0})", "atanh": "lax.atanh({0})",
    "floor": "lax.floor({0})", "ceil": "lax.ceil({0})", "round": "_round({0}, {rounding_method})",
    "is_finite": "lax.is_finite({0})",
    "eq": "lax.eq({0}, {1})", "ne": "lax.ne({0}, {1})", "lt": "lax.lt({0}, {1})", "le": "lax.le({0}, {1})",
    "gt": "lax.gt({0}, {1})", "ge": "lax.ge({0}, {1})",
    "select_n": "lax.select_n({args})", "clamp": "lax.clamp({0}, {1}, {2})",
    "and": "lax.bitwise_and({0}, {1})", "or": "lax.bitwise_or({0}, {1})", "not": "lax.bitwise_not({0})",
    "xor": "lax.bitwise_xor({0}, {1})", "shift_left": "lax.shift_left({0}, {1})",
    "shift_right_logical": "lax.shift_right_logical({0}, {1})",
    "shift_right_arithmetic": "lax.shift_right_arithmetic({0}, {1})",
    "population_count": "lax.population_count({0})", "clz": "lax.clz({0})",
    "convert_element_type": "lax.convert_element_type({0}, {new_dtype})",
    "bitcast_convert_type": "lax.bitcast_convert_type({0}, {new_dtype})",
}

# Ops computed in float32 when their operands are 16-bit floats, then rounded
# back: Pallas' Triton lowering rejects bf16 division and transcendentals, and

# Helpers for primitives Pallas' Triton lowering lacks, written with ops it has.
HELPERS = {
    "_erf": '''
def _erf(x):
    """erf as XLA computes float32 erf (Eigen's rational approximation, |err| < 2
    ulp): x P(x^2) / Q(x^2) with Q(0) = 1, so no product flushes for tiny x; ±1 from
    |x| = 3.8325, where erf rounds to 1."""
    xf = x.astype(jnp.float32)
    x2 = xf * xf
    p = x2 * 2.2905065861350646e-04 + 3.4082910107109506e-03
    for c in (5.0955695062380861e-02, 1.8520832239976145e-01, 1.128379143519084):
        p = p * x2 + c
    q = x2 * -1.1791602954361697e-07 + 2.3547966471313185e-05
    for c in (1.0179625278914885e-03, 1.4070470171167667e-02, 1.1098505178285362e-01, 4.9746925110067538e-01, 1.0):
        q = q * x2 + c
    return jnp.where(lax.abs(xf) >= 3.832506856900711, lax.sign(xf), xf * p / q).astype(x.dtype)
''',
    "_erfc": '''
def _erfc(x):
    """erfc as XLA expands it for float32 (CHLO's erfc, Cephes' polynomials):
    1 - x T(x^2) for |x| < 1; else exp(-x^2) / |x| times a polynomial in 1/x^2
    (P below 2, R above), 0 once exp(-x^2) underflows, 2 minus that for x < 0.
    Not 1 - erf(x), which is 0 from x ~ 3.9 where erfc is still ~1e-8."""
    xf = x.astype(jnp.float32)
    ax = lax.abs(xf)
    x2 = xf * xf
    t = x2 * 7.853861353153693e-05 + -8.010193625184903e-04
    for c in (5.188327685732524e-03, -2.685381193529856e-02, 1.128358514861418e-01,
              -3.761262582423300e-01, 1.128379165726710e+00):
        t = t * x2 + c
    small = 1.0 - xf * t
    r = 1.0 / x2
    p = r * 2.326819970068386e-02 + -1.387039388740657e-01
    for c in (3.687424674597105e-01, -5.824733027278666e-01, 6.210004621745983e-01, -4.944515323274145e-01,
              3.404879937665872e-01, -2.741127028184656e-01, 5.638259427386472e-01):
        p = p * r + c
    q = r * -1.047766399936249e+01 + 1.297719955372516e+01
    for c in (-7.495518717768503e+00, 2.921019019210786e+00, -1.015265279202700e+00, 4.218463358204948e-01,
              -2.820767439740514e-01, 5.641895067754075e-01):
        q = q * r + c
    z = -x2
    big = lax.exp(z) * (1.0 / ax) * jnp.where(ax < 2.0, p, q)
    big = jnp.where(z < -88.72283905206835, 0.0, big)
    big = jnp.where(xf < 0.0, 2.0 - big, big)
    return jnp.where(ax < 1.0, small, big).astype(x.dtype)
''',
    "_erf_inv": '''
def _erf_inv(x):
    return lax.erf_inv(x.astype(jnp.float32)).astype(x.dtype)
''',
    "_round": '''
def _round(x, method):
    """lax.round: method 0 rounds half away from zero, 1 half to even."""
    xf = x.astype(jnp.float32) if x.dtype.itemsize < 4 else x
    a = lax.abs(xf)
    fl = lax.floor(a)
    frac = a - fl
    if method == 0:
        r = jnp.where(frac >= 0.5, fl + 1.0, fl)
    else:
        odd = (fl - 2.0 * lax.floor(fl * 0.5)) != 0.0
        r = jnp.where((frac > 0.5) | ((frac == 0.5) & odd), fl + 1.0, fl)
    return (lax.sign(xf) * r).astype(x.dtype)
''',
}

# Float max / min as XLA computes them, NaN included: Pallas lowers lax.max /
# lax.min and the jnp.max / jnp.min / argmax reductions to maxnum / minnum,
# which drop a NaN on the GPU (the interpreter's XLA keeps it).
for _op in ("max", "min"):
    HELPERS[f"_f{_op}"] = f'''
def _f{_op}(a, b):
    return jnp.where((a != a) | (b != b), a + b, lax.{_op}(a, b))
'''
    # The NaN-free reduction and a separate any-NaN flag: two reductions, no custom combine.
    HELPERS[f"_reduce_f{_op}"] = f'''
def _reduce_f{_op}(x, axis):
    nan = jnp.max((x != x).astype(jnp.int32), axis=axis, keepdims=True) > 0
    return jnp.where(nan, float('nan'), jnp.{_op}(x, axis=axis, keepdims=True))
'''
HELPERS["_farg"] = '''
def _farg(x, axis, largest):
    """jnp.argmax / argmin of a float tile along axis (kept), as jax picks: the
    first NaN, else the first of the values equal to the best."""
    nan = x != x
    anynan = jnp.max(nan.astype(jnp.int32), axis=axis, keepdims=True) > 0
    fill = float('-inf') if largest else float('inf')
    clean = jnp.where(nan, fill, x)
    best = jnp.max(clean, axis=axis, keepdims=True) if largest else jnp.min(clean, axis=axis, keepdims=True)
    hit = jnp.where(anynan, nan, x == best)
    i = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.min(jnp.where(hit, i, x.shape[axis]), axis=axis, keepdims=True)
'''
HELPERS["_idiv"] = '''
def _idiv(x, y):
    """Integer lax.div with XLA's results where the hardware's are undefined:
    x / 0 is -1 (all ones), INT_MIN / -1 is INT_MIN (-x, wrapped)."""
    zero = y == 0
    odd = zero
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        neg1 = y == -1
        odd = zero | neg1
    q = lax.div(x, jnp.where(odd, jnp.ones_like(y), y))
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        q = jnp.where(neg1, -x, q)
    return jnp.where(zero, ~jnp.zeros_like(x), q)
'''
HELPERS["_irem"] = '''
def _irem(x, y):
    """Integer lax.rem with XLA's results where the hardware's are undefined:
    x % 0 is x, INT_MIN % -1 is 0 (so is every x % -1)."""
    zero = y == 0
    odd = zero
    if jnp.issubdtype(x.dtype, jnp.signedinteger):
        odd = zero | (y == -1)
    r = lax.rem(x, jnp.where(odd, jnp.ones_like(y), y))
    return jnp.where(zero, x, r)
'''

PLT_IMPORT = "from jax.experimental.pallas import triton as plt"  # program.py leaves it out when unused
PRELUDE = '''\
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
''' + PLT_IMPORT + '''

INTERPRET = {interpret}
ANY = pl.BlockSpec(memory_space=pl.ANY)
'''


def dtype_source(dt) -> str:
    dt = np.dtype(dt)
    return "jnp.bool_" if dt == np.bool_ else f"jnp.{dt.name}"


def bit_count_template(op, dt) -> str | None:
    """clz / population_count of 8- and 16-bit ints on their int32 bits, of
    unsigned ints on the signed int of their width: Triton legalizes only the
    libdevice calls (i32, i64), its math.ctlz fallback fails to compile. None:
    the op as it is."""
    dt = np.dtype(dt)
    fn = "lax.clz" if op == "clz" else "lax.population_count"
    if dt.kind in "iu" and dt.itemsize < 4:
        bits = 8 * dt.itemsize
        text = f"{fn}({{0}}.astype(jnp.int32) & {(1 << bits) - 1})"  # the zero-extended bits
        if op == "clz":
            text = f"({text} - {32 - bits})"
        return f"{text}.astype({dtype_source(dt)})"
    if dt.kind == "u":  # the signed int of its width: libdevice's __nv_clz / __nv_clzll
        return f"{fn}(lax.bitcast_convert_type({{0}}, jnp.int{8 * dt.itemsize})).astype({dtype_source(dt)})"
    return None


# Tile reductions by op (and/or run on int32 0/1 accumulators).
REDUCE_FN = {"sum": "jnp.sum", "prod": "jnp.prod", "max": "jnp.max", "min": "jnp.min", "and": "jnp.min",
             "or": "jnp.max", "argmax": "jnp.argmax", "argmin": "jnp.argmin"}
COMBINE = {"sum": "lax.add({a}, {v})", "prod": "lax.mul({a}, {v})", "max": "lax.max({a}, {v})",
           "min": "lax.min({a}, {v})", "and": "lax.min({a}, {v})", "or": "lax.max({a}, {v})"}


class PallasEmitter(KernelEmitter):
    """The kernel emitter's Pallas spellings."""
    HELPERS = HELPERS
    MINIMUM = "jnp.minimum"
    FUNCTIONS = {"exp": "lax.exp({0})", "is_finite": "lax.is_finite({0})", "and": "lax.bitwise_and({0}, {1})",
                 "or": "lax.bitwise_or({0}, {1})"}

    def index_type(self, wide: bool) -> str:
        return "jnp.int64" if wide else "jnp.int32"

    def dtype_text(self, dt) -> str:
        return dtype_source(dt)

    def full_text(self, value: str, dtype: str | None = None) -> str:
        return f"jnp.full((1, 1), {value}, {dtype})" if dtype else f"jnp.full((1, 1), {value})"

    def tile_text(self, shape: str, value: str, dtype: str) -> str:
        return f"jnp.full({shape}, {value}, {dtype})"

    def zeros_text(self, shape: str, dtype: str) -> str:
        return f"jnp.zeros({shape}, {dtype})"

    def cast_text(self, var: str, dt) -> str:
        return f"{var}.astype({self.dtype_text(dt)})"

    def broadcast_text(self, var: str, shape: str) -> str:
        return f"jnp.broadcast_to({var}, {shape})"

    def where_text(self, cond: str, a: str, b: str) -> str:
        return f"jnp.where({cond}, {a}, {b})"

    def maximum_text(self, a: str, b: str) -> str:
        return f"jnp.maximum({a}, {b})"

    def iota_text(self, axis: int, block: str) -> str:
        return f"lax.broadcasted_iota(IDX, {'(%s, 1)' % block if axis == 0 else '(1, %s)' % block}, {axis})"

    def pid_line(self) -> str:
        return "pid = pl.program_id(0)"

    def op_template(self, e, names) -> str:
        if is_float(e.dtype):  # NaN-propagating forms (see the _fmax helper)
            if e.op in ("max", "min"):
                return f"_f{e.op}({{0}}, {{1}})"
            if e.op == "clamp":  # lax.clamp(lo, x, hi) = min(max(x, lo), hi)
                return "_fmin(_fmax({1}, {0}), {2})"
        if e.op in ("clz", "population_count"):
            return bit_count_template(e.op, e.dtype) or OPS[e.op]
        if e.op in ("div", "rem") and np.dtype(e.dtype).kind in "iu":  # by 0, INT_MIN / -1: undefined in Triton
            return f"_i{e.op}({{0}}, {{1}})"
        if e.op == "select_n" and not (len(e.args) == 3 and e.args[0].dtype == np.bool_):
            return select_n_template(len(e.args) - 1, "jnp.where")
        if e.op == "pow" and np.dtype(e.args[1].dtype).kind in "iu" and np.dtype(e.args[1].dtype).itemsize < 4:
            # Pallas's Triton lowering takes a 32-bit integer exponent only (math.fpowi with an i8 failed
            # to legalize on the GPU): the same value, widened
            return "lax.pow({0}, {1}.astype(jnp.int32))"
        return OPS[e.op]

    def load_text(self, ref: str, off: str, mask_arg: str) -> str:
        return f"plt.load({ref}.at[{off}]{mask_arg})"

    def store_text(self, ref: str, off: str, val: str, mask_arg: str) -> str:
        return f"plt.store({ref}.at[{off}], {val}{mask_arg})"

    def masked_store_offset(self, off: str, mask: str, numel, extent) -> str:
        if not self.interpret:
            return off
        # Masked-off lanes may compute offsets that alias live lanes (an index
        # folded modulo a dimension). The GPU never writes them; interpret mode
        # scatters every lane, so send them out of bounds, where the scatter drops them.
        return self.bind(("oob", off, mask), f"jnp.where({mask}, {off}, {numel})", extent, "idx")[0]

    def plain_reduce_text(self, fn: str, var: str, axis: int) -> str:
        return f"jnp.{fn}({var}, axis={axis}, keepdims=True)"

    def reduce_text(self, op, var, acc_dt, axis, index="xc") -> str:
        """A float max / min / argmax / argmin through the NaN-propagating helpers
        (argmax / argmin take the lane's position along ``axis`` as its index)."""
        if is_float(acc_dt) and op in ("max", "min"):
            self.helpers.add(f"_reduce_f{op}")
            return f"_reduce_f{op}({var}, {axis})"
        if is_float(acc_dt) and op in ("argmax", "argmin"):
            self.helpers.add("_farg")
            return f"_farg({var}, {axis}, {op == 'argmax'})"
        return f"{REDUCE_FN[op]}({var}, axis={axis}, keepdims=True)"

    def combine_text(self, op, acc, v, acc_dt) -> str:
        if is_float(acc_dt) and op in ("max", "min"):
            self.helpers.add(f"_f{op}")
            return f"_f{op}({acc}, {v})"
        return COMBINE[op].format(a=acc, v=v)

    def arg_index_dtype(self, node_dtype):
        return np.dtype(node_dtype)

    def arg_finish(self, name, op, acc_dt, idx_dt) -> str:
        """The smallest index among the lanes holding the best value (a NaN if
        any lane holds one), written without reductions that must propagate NaN."""
        w = self.w
        big = np.iinfo(np.dtype(idx_dt)).max
        fn = "jnp.max" if op == "argmax" else "jnp.min"
        if is_float(acc_dt):
            ident = reduction_identity(op, acc_dt)
            w.line(f"{name}_nan = {name} != {name}")
            w.line(f"{name}_best = {fn}(jnp.where({name}_nan, {ident}, {name}), axis=1, keepdims=True)")
            w.line(f"{name}_anynan = jnp.max({name}_nan.astype(jnp.int32), axis=1, keepdims=True) > 0")
            w.line(f"{name}_hit = jnp.where({name}_anynan, {name}_nan, {name} == {name}_best)")
        else:
            w.line(f"{name}_hit = {name} == {fn}({name}, axis=1, keepdims=True)")
        return f"jnp.min(jnp.where({name}_hit, {name}_i, {big}), axis=1, keepdims=True)"

    def write_row_loads(self, loads: list[ir.Load]) -> list[tuple[ir.Load, frozenset]]:
        """``def load_rows(block)``: ``loads`` at one row block, returned as a
        tuple (a block past the last row loads nothing: its rows are masked).
        Returns each load with its extent."""
        w = self.w
        w.line("def load_rows(block):")
        with w.indent():
            self.scopes.append({})
            w.line(f"xr = block * BLOCK_R + {self.iota_text(0, 'BLOCK_R')}")
            w.line("rmask = xr < ROWS")
            loaded = [self.load(ld) for ld in loads]
            self.scopes.pop()
            w.line(f"return ({', '.join(v for v, _ in loaded)},)")
        return [(ld, ext) for ld, (_, ext) in zip(loads, loaded)]

    def prefetch_depth(self, cfg) -> int:
        return cfg.prefetch

    def loop(self, name, index, start, stop, carried, body, stages=None, comment="") -> None:
        """``def name(index, carry)`` and its ``lax.fori_loop`` (Pallas has no
        pipelining knob per loop: ``stages`` is the kernel's ``num_stages``)."""
        w = self.w
        carry = ", ".join(carried) + ("," if len(carried) == 1 else "")
        w.line(f"def {name}({index}, carry):" + (f"  # {comment}" if comment else ""))
        with w.indent():
            w.line(f"{carry or '_'} = carry")
            outs = body()
            w.line(f"return ({', '.join(outs)}{',' if len(outs) == 1 else ''})" if outs else "return carry")
        init = f"({carry})" if carried else "0"
        w.line(f"{carry or '_'} = lax.fori_loop({start}, {stop}, {name}, {init})")


def render_kernel(kernel: Kernel, schedule: Schedule, options: CompileOptions) -> tuple[RenderedKernel, set]:
    cfg = kernel_config(kernel, schedule, options)
    em = PallasEmitter(kernel, schedule, cfg, options)
    w = em.w
    bodies = {m.name: kernel_coords_body(m) for m in kernel.members}
    w.line(em.pid_line())
    if kernel.kind == "pointwise":
        write_pointwise(em, kernel, bodies, cfg)
    elif kernel.kind == "mix":
        write_mix(em, kernel, bodies, cfg)
    else:
        render_rows(em, kernel, bodies, cfg)
    body = w.source()
    return wrap_kernel(kernel, schedule, cfg, em, body), em.helpers


class InlineEmitter(PallasEmitter):
    """The pallas dialect on plain arrays: loads index a flat jnp array, stores
    queue (offsets, value, mask) for the launcher to scatter (``_inline_*`` helpers)."""

    def load_text(self, ref: str, off: str, mask_arg: str) -> str:
        return f"_inline_load({ref}, {off}{mask_arg})"

    def store_text(self, ref: str, off: str, val: str, mask_arg: str) -> str:
        return f"{ref}.append(({off}, {val}{mask_arg.replace(', mask=', ', ') or ', None'}))"


INLINE_HELPERS = '''\
def _inline_load(ref, off, mask=None, other=0):
    if ref.size == 1:  # no gather: the one element, at every lane
        value = jnp.broadcast_to(ref.reshape((1,) * off.ndim), off.shape)
    else:
        value = ref[off if mask is None else jnp.where(mask, off, 0)]
    return value if mask is None else jnp.where(mask, value, other)


def _inline_result(stores, numel, dtype):
    if numel == 1 and len(stores) == 1:  # no scatter: lane (0, 0) holds the element
        off, val, _ = stores[0]
        return jnp.broadcast_arrays(off, val)[1].reshape(-1)[:1].astype(dtype)
    out = jnp.zeros((numel,), dtype)
    for off, val, mask in stores:
        off = off if mask is None else jnp.where(mask, off, numel)
        off, val = jnp.broadcast_arrays(off, val)
        out = out.at[off.reshape(-1)].set(val.reshape(-1).astype(dtype), mode="drop")
    return out
'''


def inline_scalar(kernel: Kernel, scope: str) -> bool:
    """A loop body's pointwise group over one element (a loop counter's ``i + 1``,
    a while condition's ``i < n``): plain jnp code, which XLA fuses with the
    loop's own bookkeeping, rather than one kernel launch per iteration."""
    if not scope or kernel.kind != "pointwise" or sizes.is_symbolic((kernel.rows, kernel.cols)):
        return False
    return kernel.rows * kernel.cols == 1


def render_inline_scalar(kernel: Kernel, schedule: Schedule, options: CompileOptions):
    """``inline_scalar``'s group as a function of the same signature as a
    launcher: the pointwise kernel body run once on the flat arrays."""
    cfg = kernel_config(kernel, schedule, options)
    em = InlineEmitter(kernel, schedule, cfg, options)
    em.w.line("pid = 0")
    write_pointwise(em, kernel, {m.name: kernel_coords_body(m) for m in kernel.members}, cfg)
    w = SourceWriter()
    w.line(f"# {kernel.name}: one element, plain jnp (no kernel launch)")
    for eq in kernel.origin:
        w.line(f"#   {eq}")
    body = em.w.source()
    ins, outs, dims = write_kernel_function(w, f"{kernel.name}_inline", kernel, schedule, cfg, em, body)
    args = (["dims"] if dims else []) + [f"in{i}" for i in range(len(ins))]
    w.line(f"def {kernel.name}({', '.join(args + (['*'] + list(dims) if dims else []))}):")
    with w.indent():
        w.line(f"outs = {'(' + ', '.join(['[]'] * len(outs)) + (',)' if len(outs) == 1 else ')')}")
        operands = (["dims"] if dims else []) + [f"{a}.reshape(-1)" for a in args if a != "dims"]
        w.line(f"{kernel.name}_inline({', '.join(operands + ['*outs'])})")  # no operands: a constant's group
        results = [f"_inline_result(outs[{i}], {sizes.to_source(m.node.numel)}, {dtype_source(m.node.dtype)})"
                   for i, m in enumerate(m for m in kernel.members if m.store)]
        w.line(f"return ({', '.join(results)},)")
    return RenderedKernel(kernel.name, w.source(), list(kernel.origin), cfg, dims, em.guards, scope="",
                          inline=True), em.helpers


def write_kernel_function(w: SourceWriter, name: str, kernel: Kernel, schedule: Schedule, cfg, em, body: str):
    """``def name(dims_ptr?, inputs..., outputs...)``: the dim reads, extents and block
    constants, then ``body``. Returns (input refs, output refs, dims read)."""
    ins, outs = list(em.in_refs.values()), list(em.out_refs.values())
    extents = f"ROWS, COLS = {sizes.to_source(kernel.rows)}, {sizes.to_source(kernel.cols)}"
    dims = used_dims(schedule, extents + "\n" + body)
    w.line(f"def {name}({', '.join((['dims_ptr'] if dims else []) + ins + outs)}):")
    with w.indent():
        write_dim_reads(w, schedule, dims)
        w.line(extents)
        w.line(f"BLOCK_R, BLOCK_C = {cfg.block_rows}, {cfg.block_cols}")
        w.line(f"IDX = {em.index_dtype}")
    w.lines.append(body.rstrip("\n"))
    w.line()
    return ins, outs, dims


def wrap_kernel(kernel: Kernel, schedule: Schedule, cfg, em: PallasEmitter, body: str) -> RenderedKernel:
    w = SourceWriter()
    w.line(f"# kernel {kernel.name}: {kernel.kind}, {kernel.rows} x {kernel.cols}, "
           f"block {cfg.block_rows} x {cfg.block_cols}, {'persistent' if cfg.persistent else 'looped'}")
    w.line("# from:")
    for eq in kernel.origin:
        w.line(f"#   {eq}")
    ins, outs, dims = write_kernel_function(w, f"{kernel.name}_kernel", kernel, schedule, cfg, em, body)
    if kernel.kind == "mix":  # a persistent grid: its program count is a number even over dynamic rows
        grid = kernel.programs * (1 if whole_rows(kernel) else -(-kernel.cols // cfg.block_cols))
    elif sizes.is_symbolic((kernel.rows, kernel.cols)):
        if kernel.kind == "pointwise":
            grid = f"{grid_cdiv(kernel.rows, cfg.block_rows)} * {grid_cdiv(kernel.cols, cfg.block_cols)}"
        else:
            grid = grid_cdiv(kernel.rows, cfg.block_rows)
    elif kernel.kind == "pointwise":
        grid = (-(-kernel.rows // cfg.block_rows)) * (-(-kernel.cols // cfg.block_cols))
    else:
        grid = -(-kernel.rows // cfg.block_rows)
    write_launcher(w, kernel, len(ins), grid, cfg.num_warps, cfg.num_stages, dims=dims)
    return RenderedKernel(kernel.name, w.source(), list(kernel.origin), cfg, dims, em.guards)


def write_dim_reads(w: SourceWriter, schedule: Schedule, dims: list[str]):
    """``n = dims_ptr[i]`` for each dim symbol a kernel reads: ``dims_ptr``
    is the program's int32 array of all its dim values, in ``program_dims``
    order ([Note: symbolic dims])."""
    order = program_dims(schedule)
    for d in dims:  # dynamic sizes: runtime scalars, so the kernel serves every size
        w.line(f"{d} = dims_ptr[{order.index(d)}]")


def write_launcher(w: SourceWriter, kernel: Kernel, n_inputs: int, grid, num_warps: int, num_stages: int,
                   dims: list[str] = ()):
    """``def <kernel>(in0, ...)``: the ``pallas_call`` of ``<kernel>_kernel`` on
    flat refs in ``pl.ANY`` memory, one flat output per stored member.
    ``dims``: the dim symbols the kernel reads ([Note: symbolic dims]); the
    launcher then takes the program's dims array first (the values the kernel
    reads at run time) and the symbols as keyword ints: the sizes its outputs
    and grid (``grid`` is then source) are built for while jax.jit traces the
    wrapper, the concrete sizes."""
    out_shapes = [f"jax.ShapeDtypeStruct(({sizes.to_source(m.node.numel)},), {dtype_source(m.node.dtype)})"
                  for m in kernel.members if m.store]
    args = [f"in{i}" for i in range(n_inputs)]
    operands = [a + ".reshape(-1)" for a in args]
    if dims:
        args = ["dims"] + args
        operands = ["dims"] + operands
    w.line(f"def {kernel.name}({', '.join(args + (['*'] + list(dims) if dims else []))}):")
    with w.indent():
        w.line("return pl.pallas_call(")
        with w.indent():
            w.line(f"{kernel.name}_kernel,")
            w.line(f"out_shape=({', '.join(out_shapes)},),")
            w.line(f"grid=({grid},),")
            w.line(f"in_specs=[{', '.join(['ANY'] * len(operands))}],")
            w.line(f"out_specs=({', '.join(['ANY'] * len(out_shapes))},),")
            w.line("interpret=INTERPRET,")
            w.line(f"name={kernel.name!r},")
            w.line(f"compiler_params=plt.CompilerParams(num_warps={num_warps}, num_stages={num_stages}),")
        w.line(f")({', '.join(operands)})")


def grid_cdiv(n, block: int) -> str:
    """Launcher source of ceil(n / block) (Python ints when the launcher runs)."""
    if not sizes.is_symbolic(n):
        return str(-(-int(n) // block))
    return f"pl.cdiv({sizes.to_source(n)}, {block})"


# --------------------------------------------------------------------------- #
# The matmul template (codegen/matmul.py)
# --------------------------------------------------------------------------- #
class MatmulEmitter(matmul.TileValues, PallasEmitter):
    """The matmul template's Pallas emitter."""

    def dot_text(self, node: ir.Matmul, lhs_dtype) -> str:
        """One K step's product added to ``acc`` (float32)."""
        kw = "preferred_element_type=jnp.float32"
        if node.precision == "highest" and lhs_dtype == np.float32:
            kw = "precision=lax.Precision.HIGHEST, " + kw
        return f"acc + jnp.dot(a, b, {kw})"


def render_matmul(kernel: Kernel, schedule: Schedule, options: CompileOptions):
    """(RenderedKernel, helper names) of a matmul kernel."""
    p = matmul.plan(MatmulEmitter, kernel, schedule, options)
    cfg, em, mm, node, dynamic_m = p.cfg, p.em, p.mm, p.node, p.dynamic_m
    (b, m, n, k), m_blocks, n_blocks, k_blocks = p.dims, p.m_blocks, p.n_blocks, p.k_blocks
    w = em.w

    # -- which tile -----------------------------------------------------------------
    w.line("pid = pl.program_id(0).astype(IDX)")
    matmul.write_tile(em, b, m_blocks, n_blocks, cfg.group_m, dynamic_m)

    matmul.write_k_loop(em, mm, cfg, (m, n, k), "K_BLOCKS", dynamic_m)

    # -- epilogue and stores ----------------------------------------------------------
    matmul.write_epilogue(em, kernel, mm)
    return _wrap_matmul(kernel, node, cfg, em, (b, m, n, k), (m_blocks, n_blocks, k_blocks)), em.helpers


def _wrap_matmul(kernel: Kernel, node: ir.Matmul, cfg: heuristics.MatmulConfig, em, dims, blocks) -> RenderedKernel:
    b, m, n, k = dims
    m_blocks, n_blocks, k_blocks = blocks
    dynamic_m = sizes.is_symbolic(m)
    header = f"M, N, K = {sizes.to_source(m)}, {n}, {k}"
    dim_names = used_dims(em.schedule, header + "\n" + em.w.source())
    w = SourceWriter()
    w.line(f"# kernel {kernel.name}: matmul {'%d x ' % b if b > 1 else ''}({m} x {k}) @ ({k} x {n}), {cfg}")
    own = _origins(em.graph, matmul.matmul_member(kernel), em.schedule.stored)
    w.line("# matmul (operand views folded into its loads):")
    for eq in own:
        w.line(f"#   {eq}")
    epilogue = [eq for eq in kernel.origin if eq not in own]
    if epilogue:
        w.line("# epilogue:")
        for eq in epilogue:
            w.line(f"#   {eq}")
    ins = list(em.in_refs.values())
    outs = list(em.out_refs.values())
    w.line(f"def {kernel.name}_kernel({', '.join((['dims_ptr'] if dim_names else []) + ins + outs)}):")
    with w.indent():
        write_dim_reads(w, em.schedule, dim_names)
        w.line(header)
        w.line(f"BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = {cfg.block_m}, {cfg.block_n}, {cfg.block_k}, {cfg.group_m}")
        if dynamic_m:
            w.line("M_BLOCKS = (M + BLOCK_M - 1) // BLOCK_M")
        w.line(f"K_BLOCKS = {k_blocks}")
        w.line("BLOCK_R, BLOCK_C = BLOCK_M, BLOCK_N  # the epilogue's tile")
        w.line(f"IDX = {em.index_dtype}")
    w.lines.append(em.w.source().rstrip("\n"))
    w.line()
    grid = (f"{b * n_blocks} * pl.cdiv({sizes.to_source(m)}, {cfg.block_m})" if dynamic_m
            else b * m_blocks * n_blocks)
    write_launcher(w, kernel, len(ins), grid, cfg.num_warps, cfg.num_stages, dims=dim_names)
    return RenderedKernel(kernel.name, w.source(), list(kernel.origin), cfg, dim_names, em.guards)
