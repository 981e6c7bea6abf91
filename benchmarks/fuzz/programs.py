"""Random jax programs over pallaskit's op table, as hypothesis strategies.

``programs()`` draws a ``Program``: typed inputs (shapes with 1, primes,
non-powers-of-two and, rarely, rows longer than one tile; values seeded, with
a fraction of special values), a straight-line body of jnp / lax calls, one or
more outputs, and the pallaskit options to compile it under. The body is
Python source text (``Program.source()``), so what runs is what a failure
prints (``Program.snippet()``: a runnable script). Every choice is a
hypothesis draw ordered simple-to-complex, so hypothesis shrinks a failing
program to a minimal one (fewer ops, smaller shapes, no special values).

Exactness. A value is *exact* when every implementation must compute it
bit-for-bit (data movement, comparisons, min/max, integer and bool ops, casts
that do not round). Discontinuous ops (comparisons, floor/round/sign, float
to int casts, argmax/argmin, isfinite) only take exact operands: applied to a
value that carries a rounding difference they would turn one ulp into a
wrong-looking bool or index, a false positive. The oracle compares exact
outputs bit-for-bit and the others within a tolerance (``oracle.py``).

Known bug classes (being fixed on other branches) are generated behind
``features``: ``KNOWN_FEATURES`` names them; ``programs(exclude=...)`` leaves
them out (the CI test does until those fixes merge).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

FLOATS = ("float32", "bfloat16", "float16")
INTS = ("int32", "int8", "uint8")
DTYPES = FLOATS + INTS + ("bool",)
DT_NAME = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int32": "I32", "int8": "I8",
           "uint8": "U8", "bool": "BOOL"}
BITS = {"int32": 32, "int8": 8, "uint8": 8}

# Generator features that produce the bug classes known today; each maps to its class.
KNOWN_FEATURES = {
    "multi_reduce": "class 1: several reductions over the same rows in one kernel (min+max, argmax+argmin, any+all)",
    "special_tails": "class 5: erfc / log_ndtr accuracy in the tails",
    "looped_argmax": "class 4: argmax/argmin in a looped (non-persistent) reduction",
}

# Extents: size 1, small primes, non-powers-of-two, one past a power of two.
SMALL_DIMS = (1, 2, 3, 5, 7, 8, 13, 16, 31, 37, 64, 100, 127, 129)
LONG_ROWS = (8193, 8200, 9001)  # one past heuristics' default max_persistent_cols (8192)
# Past heuristics.MIN_SPLIT_ROWS (split column reductions, mix-order kernels); 132..16384 rows of
# >= 256 (a full reduction splits at its rows). Those decisions need num_sms=132 on the CPU.
TALL = ((1025, 3), (1500, 37), (1025, 64), (140, 257), (300, 300))

MAKE_INPUT_SOURCE = '''\
def make_input(seed, shape, dtype, special=0.0, scale=1.0):
    """Seeded values; a fraction ``special`` of elements drawn from the dtype's special values."""
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if jnp.issubdtype(dt, jnp.integer):
        info = np.iinfo(dt)
        x = rng.integers(max(info.min, -9), min(info.max, 9) + 1, size=shape, dtype=np.int64)
        if special:
            extremes = np.array([info.min, info.max, 0, 1, info.max // 2, info.min // 2 if info.min else 1])
            x = np.where(rng.random(shape) < special, rng.choice(extremes, size=shape), x)
        return x.astype(dt)
    x = rng.standard_normal(shape) * scale
    if special:
        fi = jnp.finfo(dt)
        extremes = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, float(fi.smallest_subnormal),
                             -float(fi.smallest_subnormal), float(fi.tiny), float(fi.max), -float(fi.max),
                             1.0, -1.0, 1e-30, 30.0, -30.0, 100.0])
        x = np.where(rng.random(shape) < special, rng.choice(extremes, size=shape), x)
    return x.astype(dt)
'''


# --------------------------------------------------------------------------- #
# Choices: small specs that become hypothesis strategies (shrinkable) or plain
# random draws (the long-run driver where hypothesis is not installed).
# --------------------------------------------------------------------------- #
def integers(lo, hi):
    return ("integers", lo, hi)


def sampled_from(seq):
    return ("sampled_from", tuple(seq))


def booleans():
    return ("booleans",)


def permutations(seq):
    return ("permutations", tuple(seq))


def lists(elem, min_size, max_size):
    return ("lists", elem, min_size, max_size)


@functools.lru_cache(maxsize=None)
def _hypothesis(spec):
    from hypothesis import strategies as st

    kind = spec[0]
    if kind == "integers":
        return st.integers(spec[1], spec[2])
    if kind == "sampled_from":
        return st.sampled_from(spec[1])
    if kind == "booleans":
        return st.booleans()
    if kind == "permutations":
        return st.permutations(spec[1])
    return st.lists(_hypothesis(spec[1]), min_size=spec[2], max_size=spec[3])


def _sample(spec, rng):
    kind = spec[0]
    if kind == "integers":
        # small values more often, as hypothesis does
        return rng.randint(spec[1], spec[2]) if rng.random() < 0.7 else spec[1]
    if kind == "sampled_from":
        return spec[1][rng.randrange(len(spec[1]))]
    if kind == "booleans":
        return rng.random() < 0.5
    if kind == "permutations":
        out = list(spec[1])
        rng.shuffle(out)
        return out
    return [_sample(spec[1], rng) for _ in range(rng.randint(spec[2], spec[3]))]


@dataclasses.dataclass
class Value:
    name: str
    shape: tuple
    dtype: str
    exact: bool


@dataclasses.dataclass
class Input:
    name: str
    shape: tuple
    dtype: str
    seed: int
    special: float
    scale: float

    def expr(self) -> str:
        extra = (f", special={self.special}" if self.special else "") + (f", scale={self.scale}" if self.scale != 1 else "")
        return f"make_input({self.seed}, {self.shape!r}, {self.dtype!r}{extra})"


@dataclasses.dataclass
class Line:
    name: str  # the value it defines
    code: str  # its right-hand side
    uses: tuple  # names it reads
    op: str  # op kind, for signatures
    dtype: str = ""  # of the value it defines


@dataclasses.dataclass
class Program:
    inputs: list
    lines: list
    outputs: list  # names
    exact: list  # per output: compared bit-for-bit
    options: dict  # pallaskit.config overrides
    features: set = dataclasses.field(default_factory=set)

    def live_lines(self):
        """Lines an output depends on (the rest is dead code, dropped from the source)."""
        need = set(self.outputs)
        keep = []
        for line in reversed(self.lines):
            if line.name in need:
                keep.append(line)
                need |= set(line.uses)
        return keep[::-1]

    def live_inputs(self):
        used = set(self.outputs) | {u for line in self.live_lines() for u in line.uses}
        return [i for i in self.inputs if i.name in used]

    def ops(self):
        return [line.op for line in self.live_lines()]

    def source(self) -> str:
        args = ", ".join(i.name for i in self.live_inputs())
        body = [f"    {line.name} = {line.code}" for line in self.live_lines()]
        ret = ", ".join(self.outputs) + ("," if len(self.outputs) == 1 else "")
        return "\n".join([f"def f({args}):", *body, f"    return ({ret})"]) + "\n"

    def make_args(self, float64=False, tame=False):
        """The inputs; ``float64``: floats widened (the reference); ``tame``: finite values past
        TAME clamped to it (infinities and NaN kept): sums and products cannot overflow."""
        ns = namespace()
        exec(MAKE_INPUT_SOURCE, ns)
        args = [ns["make_input"](i.seed, i.shape, i.dtype, i.special, i.scale) for i in self.live_inputs()]
        if tame:
            args = [_tame(a) for a in args]
        if float64:
            args = [a.astype(np.float64) if np.dtype(a.dtype).kind == "f" or a.dtype.name == "bfloat16" else a
                    for a in args]
        return args

    def function(self, float64=False):
        ns = namespace(float64)
        exec(self.source(), ns)
        return ns["f"]

    def snippet(self, title="") -> str:
        """A runnable script: inputs, the function, both jits, the comparison."""
        inputs = "".join(f"    {i.expr()},\n" for i in self.live_inputs())
        opts = "".join(f", {k}={v!r}" for k, v in sorted(self.options.items()))
        head = "".join(f"# {line}\n" for line in title.splitlines())
        return (head + SNIPPET_HEAD + MAKE_INPUT_SOURCE + "\n\n" + self.source() + "\n\nargs = [\n" + inputs + "]\n"
                + f"pallaskit.config.update(cache=False{opts})\n"
                + f"exact = {list(self.exact)!r}  # outputs every implementation must compute bit for bit\n"
                + SNIPPET_TAIL)


SNIPPET_HEAD = """\
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pallaskit

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
I32, I8, U8, BOOL = jnp.int32, jnp.int8, jnp.uint8, jnp.bool_


"""

SNIPPET_TAIL = """\
want = jax.jit(f)(*args)
got = pallaskit.jit(f)(*args)
for k, (g, w) in enumerate(zip(got, want)):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
    if exact[k] or g.dtype.kind in "biu":
        np.testing.assert_array_equal(g, w, err_msg=f"output {k}")
    else:  # a loose check; benchmarks/fuzz/oracle.py has the exact rule (float64 reference)
        tol = {"float32": 2e-4, "float16": 4e-3}.get(g.dtype.name, 3e-2)
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=tol, atol=tol,
                                   err_msg=f"output {k}")
print("agree")
"""


# Magnitude bound of tamed inputs: a product over a row of 37 values of 30 overflows as surely as
# one value near the dtype's largest, and which of +inf / NaN / 0 comes out depends on the order.
TAME = {"float32": 1.0, "bfloat16": 1.0, "float16": 1.0}


def _tame(a):
    t = TAME.get(a.dtype.name)
    if t is None:
        return a
    x = a.astype(np.float64)
    return np.where(np.isfinite(x) & (np.abs(x) > t), np.sign(x) * t, x).astype(a.dtype)


def namespace(float64=False):
    import jax
    import jax.numpy as jnp
    from jax import lax

    ns = dict(jax=jax, jnp=jnp, lax=lax, np=np, I32=jnp.int32, I8=jnp.int8, U8=jnp.uint8, BOOL=jnp.bool_)
    if float64:  # the reference: every float dtype is float64
        ns.update(F32=jnp.float64, BF16=jnp.float64, F16=jnp.float64)
    else:
        ns.update(F32=jnp.float32, BF16=jnp.bfloat16, F16=jnp.float16)
    return ns


# --------------------------------------------------------------------------- #
# Op tables: (name, code template over a, b, c), simple ones first (shrinking).
# --------------------------------------------------------------------------- #
UNARY_FLOAT_CONT = [  # continuous: fine on inexact operands
    ("neg", "-{a}", True), ("abs", "jnp.abs({a})", True), ("exp", "jnp.exp({a})", False),
    ("log", "jnp.log({a})", False), ("tanh", "jnp.tanh({a})", False), ("sqrt", "jnp.sqrt({a})", False),
    ("square", "jnp.square({a})", False), ("logistic", "jax.nn.sigmoid({a})", False),
    ("rsqrt", "lax.rsqrt({a})", False), ("log1p", "jnp.log1p({a})", False), ("expm1", "jnp.expm1({a})", False),
    ("sin", "jnp.sin({a})", False), ("cos", "jnp.cos({a})", False), ("erf", "lax.erf({a})", False),
    ("integer_pow", "lax.integer_pow({a}, 3)", False), ("recip", "1.0 / {a}", False),
    ("cbrt", "jnp.cbrt({a})", False), ("atan", "jnp.arctan({a})", False), ("asinh", "jnp.arcsinh({a})", False),
    ("sinh", "jnp.sinh({a})", False), ("cosh", "jnp.cosh({a})", False), ("tan", "jnp.tan({a})", False),
    ("exp2", "jnp.exp2({a})", False), ("asin", "jnp.arcsin({a})", False), ("acos", "jnp.arccos({a})", False),
    ("atanh", "jnp.arctanh({a})", False), ("acosh", "jnp.arccosh({a})", False),
    ("erf_inv", "lax.erf_inv({a})", False), ("gelu", "jax.nn.gelu({a})", False),
    ("silu", "jax.nn.silu({a})", False), ("softplus", "jax.nn.softplus({a})", False),
    ("scale_add", "{a} * 0.5 + 1.25", False),
]
UNARY_FLOAT_SPECIAL = [("erfc", "lax.erfc({a})"), ("log_ndtr", "jax.scipy.special.log_ndtr({a}.astype(F32))")]
UNARY_FLOAT_DISC = [  # discontinuous: exact operands only
    ("floor", "jnp.floor({a})", "same"), ("ceil", "jnp.ceil({a})", "same"), ("round", "jnp.round({a})", "same"),
    ("round_away", "lax.round({a})", "same"), ("sign", "jnp.sign({a})", "same"),
    ("isfinite", "jnp.isfinite({a})", "bool"), ("isnan", "jnp.isnan({a})", "bool"),
    ("relu", "jnp.maximum({a}, 0.0)", "same"), ("clamp", "jnp.clip({a}, -1.5, 2.0)", "same"),
    ("nextafter", "jnp.nextafter({a}, jnp.zeros_like({a}))", "same"),
]
UNARY_INT = [("neg", "-{a}"), ("abs", "jnp.abs({a})"), ("not", "~{a}"), ("sign", "jnp.sign({a})"),
             ("popcnt", "lax.population_count({a})"), ("clz", "lax.clz({a})"), ("square", "{a} * {a}"),
             ("clamp", "jnp.clip({a}, 0, 5)")]
BINARY_FLOAT = [("add", "{a} + {b}"), ("sub", "{a} - {b}"), ("mul", "{a} * {b}"), ("div", "{a} / {b}"),
                ("max", "jnp.maximum({a}, {b})"), ("min", "jnp.minimum({a}, {b})"), ("pow", "jnp.power({a}, {b})"),
                ("atan2", "jnp.arctan2({a}, {b})"), ("rem", "lax.rem({a}, {b})")]
EXACT_BINARY_FLOAT = {"max", "min"}
BINARY_INT = [("add", "{a} + {b}"), ("sub", "{a} - {b}"), ("mul", "{a} * {b}"), ("max", "jnp.maximum({a}, {b})"),
              ("min", "jnp.minimum({a}, {b})"), ("and", "{a} & {b}"), ("or", "{a} | {b}"), ("xor", "{a} ^ {b}"),
              ("div", "lax.div({a}, {b})"), ("rem", "lax.rem({a}, {b})"),
              ("shl", "lax.shift_left({a}, {b})"), ("shra", "lax.shift_right_arithmetic({a}, {b})"),
              ("shrl", "lax.shift_right_logical({a}, {b})")]
BINARY_BOOL = [("and", "{a} & {b}"), ("or", "{a} | {b}"), ("xor", "{a} ^ {b}"), ("ne", "{a} != {b}")]
COMPARE = [("lt", "<"), ("gt", ">"), ("eq", "=="), ("ne", "!="), ("le", "<="), ("ge", ">=")]
# (name, jnp/lax function); op_reduce decides which dtypes each takes
REDUCTIONS = [("sum", "jnp.sum"), ("max", "jnp.max"), ("min", "jnp.min"), ("prod", "jnp.prod"),
              ("argmax", "jnp.argmax"), ("argmin", "jnp.argmin"), ("any", "jnp.any"), ("all", "jnp.all"),
              ("mean", "jnp.mean"), ("var", "jnp.var"), ("logsumexp", "jax.nn.logsumexp"),
              ("softmax", "jax.nn.softmax"), ("lse_manual", None), ("cumsum", "jnp.cumsum"),
              ("log_softmax", "jax.nn.log_softmax"),
              ("cummax", "lax.cummax"), ("cumprod", "jnp.cumprod")]


def broadcast_shapes(a, b):
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            return None
        out.append(max(x, y))
    return tuple(out)


def numel(shape):
    return int(np.prod(shape, dtype=np.int64))


class Builder:
    """The program under construction: a pool of typed values, lines and inputs."""

    def __init__(self, draw, exclude, options):
        self.draw, self.exclude, self.options = draw, exclude, options
        self.values: list[Value] = []
        self.inputs: list[Input] = []
        self.lines: list[Line] = []
        self.features: set = set()
        self.reduced: dict = {}  # (operand name, axes) -> reduction ops already applied
        self.max_elems = 1 << 17
        self.force_out: list[Value] = []
        self.long_rows = True  # softmax-family rows longer than one tile (op_long_row)

    def allowed(self, feature):
        return feature not in self.exclude

    def new_input(self, shape, dtype, plain=False):
        """``plain``: ordinary values (matmul weights: a K-long sum of values near the dtype's
        largest overflows in an order-dependent way, +inf in one order and NaN in another)."""
        d = self.draw
        name = f"x{len(self.inputs)}"
        special = d(sampled_from([0.0, 0.05, 0.3])) if dtype != "bool" and not plain else 0.0
        scale = d(sampled_from([1.0, 1e-3, 30.0, 1e4])) if dtype in FLOATS and not plain else 1.0
        self.inputs.append(Input(name, tuple(shape), dtype, d(integers(0, 2**16)), special, scale))
        v = Value(name, tuple(shape), dtype, True)
        self.values.append(v)
        return v

    def emit(self, code, uses, shape, dtype, exact, op):
        name = f"v{len(self.lines)}"
        self.lines.append(Line(name, code, tuple(u.name for u in uses), op, dtype))
        v = Value(name, tuple(shape), dtype, exact)
        self.values.append(v)
        return v

    def pick(self, pred=lambda v: True):
        cands = [v for v in self.values if pred(v)]
        if not cands:
            return None
        # Index 0 (the oldest: an input) is what shrinking reaches, so ops that a failure
        # does not need become dead code and leave the printed program.
        return cands[self.draw(integers(0, len(cands) - 1))]


def _shape(draw, long_rows):
    rank = draw(integers(1, 3))
    dims = [draw(sampled_from(SMALL_DIMS)) for _ in range(rank)]
    while numel(dims) > 4096:
        dims[dims.index(max(dims))] = draw(sampled_from(SMALL_DIMS[:8]))
    big = draw(integers(0, 11)) if long_rows else 0
    if big == 11:  # a row longer than one tile
        dims = dims[:-1][:1] + [draw(sampled_from(LONG_ROWS))]
        dims = [min(d, 3) for d in dims[:-1]] + dims[-1:]
    elif big == 10:  # tall: column reductions split, rows split at their rows, mix-order kernels (num_sms=132)
        dims = list(draw(sampled_from(TALL)))
    return tuple(dims)


def _dtype(draw):
    # float32 most often; then 16-bit floats, ints, bools.
    return draw(sampled_from(("float32", "float32", "bfloat16", "int32", "float16", "bool", "int8", "uint8")))


def _fmt_axis(axis):
    return repr(axis) if not isinstance(axis, tuple) or len(axis) != 1 else f"({axis[0]},)"


# --------------------------------------------------------------------------- #
# Op generators: each takes the builder, returns a Value or None (not applicable).
# --------------------------------------------------------------------------- #
def op_unary(b: Builder):
    d = b.draw
    v = b.pick()
    if v.dtype in FLOATS:
        kind = d(integers(0, 9))
        if kind <= 6 or not v.exact:
            table = UNARY_FLOAT_CONT + ([(n, t, False) for n, t in UNARY_FLOAT_SPECIAL]
                                        if b.allowed("special_tails") else [])
            name, tmpl, exact = d(sampled_from(table))
            if name in dict(UNARY_FLOAT_SPECIAL):
                b.features.add("special_tails")
            dtype = "float32" if name == "log_ndtr" else v.dtype
            return b.emit(tmpl.format(a=v.name), [v], v.shape, dtype, exact and v.exact, name)
        name, tmpl, out = d(sampled_from(UNARY_FLOAT_DISC))
        return b.emit(tmpl.format(a=v.name), [v], v.shape, "bool" if out == "bool" else v.dtype, True, name)
    if v.dtype == "bool":
        return b.emit(f"~{v.name}", [v], v.shape, "bool", True, "not")
    name, tmpl = d(sampled_from(UNARY_INT))
    return b.emit(tmpl.format(a=v.name), [v], v.shape, v.dtype, True, name)


def _partner(b: Builder, v: Value, same_dtype=True):
    """A second operand broadcast-compatible with v: an existing value, a scalar, or a new input."""
    d = b.draw
    choice = d(integers(0, 3))
    if choice == 0:
        w = b.pick(lambda w: w is not v and (w.dtype == v.dtype or not same_dtype)
                   and broadcast_shapes(w.shape, v.shape) is not None
                   and numel(broadcast_shapes(w.shape, v.shape)) <= b.max_elems)
        if w is not None:
            return w
    if choice == 1 and v.shape:
        # broadcast along some axes: a shape with 1s where v has extents
        shape = tuple(1 if d(booleans()) else s for s in v.shape)
        k = d(integers(0, len(shape)))
        return b.new_input(shape[k:], v.dtype)
    if choice == 2:
        return None  # a scalar literal
    return b.new_input(v.shape, v.dtype)


def _literal(b: Builder, dtype):
    d = b.draw
    if dtype in FLOATS:
        return repr(d(sampled_from([2.0, 0.5, -1.0, 0.0, 3.0, 1e-3, float("inf")]))).replace("inf", "jnp.inf")
    if dtype == "bool":
        return d(sampled_from(["True", "False"]))
    return str(d(sampled_from([1, 2, 0, 3, 7, 31, 100] if dtype == "int32" else [1, 2, 0, 3, 7])))


def op_binary(b: Builder):
    d = b.draw
    v = b.pick()
    w = _partner(b, v)
    if w is None:
        lit = _literal(b, v.dtype)
        a_code, b_code, uses, shape, wexact = v.name, f"{DT_NAME[v.dtype]}({lit})", [v], v.shape, True
        if d(booleans()):
            a_code, b_code = b_code, a_code
    else:
        a_code, b_code, uses, shape, wexact = v.name, w.name, [v, w], broadcast_shapes(v.shape, w.shape), w.exact
    exact_in = v.exact and wexact
    if d(integers(0, 4)) == 4 and (exact_in or v.dtype not in FLOATS):  # comparison
        name, sym = d(sampled_from(COMPARE))
        return b.emit(f"{a_code} {sym} {b_code}", uses, shape, "bool", True, name)
    if d(integers(0, 6)) == 6:  # select
        c = b.pick(lambda c: c.dtype == "bool" and broadcast_shapes(c.shape, shape) is not None
                   and numel(broadcast_shapes(c.shape, shape)) <= b.max_elems)
        if c is not None:
            shape = broadcast_shapes(c.shape, shape)
            return b.emit(f"jnp.where({c.name}, {a_code}, {b_code})", uses + [c], shape, v.dtype, exact_in, "select")
    if v.dtype in FLOATS:
        name, tmpl = d(sampled_from(BINARY_FLOAT))
        return b.emit(tmpl.format(a=a_code, b=b_code), uses, shape, v.dtype,
                      exact_in and name in EXACT_BINARY_FLOAT, name)
    if v.dtype == "bool":
        name, tmpl = d(sampled_from(BINARY_BOOL))
        return b.emit(tmpl.format(a=a_code, b=b_code), uses, shape, "bool", True, name)
    name, tmpl = d(sampled_from(BINARY_INT))
    if name in ("shl", "shra", "shrl") and w is not None and d(booleans()):
        # shift amounts mostly in range; the raw operand (out-of-range amounts) otherwise
        b_code = f"({b_code} & {BITS[v.dtype] - 1})" if v.dtype != "uint8" else f"({b_code} & 7)"
    return b.emit(tmpl.format(a=a_code, b=b_code), uses, shape, v.dtype, True, name)


def op_cast(b: Builder):
    d = b.draw
    v = b.pick()
    to = d(sampled_from(DTYPES))
    if v.dtype in FLOATS and not v.exact and to not in FLOATS:
        to = "float32"
    if to == v.dtype:
        return None
    # Exact unless it rounds: narrowing float casts (excess precision may skip them) and
    # int32 to a 16-bit float.
    rounds = (v.dtype in FLOATS and to in FLOATS and to != "float32") or (v.dtype == "int32" and to in FLOATS[1:])
    return b.emit(f"{v.name}.astype({DT_NAME[to]})", [v], v.shape, to, v.exact and not rounds, "convert")


def _axes(b: Builder, shape, single=False):
    d = b.draw
    r = len(shape)
    if single:
        return d(sampled_from([r - 1] + list(range(r - 1)) + [-1]))
    choice = d(integers(0, 3))
    if choice == 0:
        return -1
    if choice == 1 or r == 1:
        return d(integers(0, r - 1))
    if choice == 2:
        return None
    axes = tuple(sorted(set(d(lists(integers(0, r - 1), 1, r)))))
    return axes


def _reduce_code(name, fn, v, axis, keep):
    kd = ", keepdims=True" if keep else ""
    if name in ("argmax", "argmin"):
        return f"{fn}({v}, axis={axis}{kd})"
    if name in ("cumsum", "cumprod", "cummax"):
        return f"{fn}({v}, axis={axis})"
    if name in ("softmax", "log_softmax"):
        return f"{fn}({v}, axis={_fmt_axis(axis)})"
    if name == "lse_manual":
        ax = _fmt_axis(axis)
        return (f"jnp.log(jnp.sum(jnp.exp({v} - jnp.max({v}, axis={ax}, keepdims=True)), axis={ax}{kd}))"
                f" + jnp.max({v}, axis={ax}{kd})")
    return f"{fn}({v}, axis={_fmt_axis(axis)}{kd})"


def _reduced_shape(shape, axis, keep):
    r = len(shape)
    axes = range(r) if axis is None else (axis if isinstance(axis, tuple) else (axis,))
    axes = {a % r for a in axes}
    return tuple((1 if keep else None) if k in axes else s for k, s in enumerate(shape) if keep or k not in axes)


def op_reduce(b: Builder, v=None, axis=None, taken=()):
    d = b.draw
    v = v or b.pick(lambda v: len(v.shape) >= 1)
    if v is None:
        return None
    name, fn = d(sampled_from(REDUCTIONS))
    if name in taken:
        return None
    exact_in = v.exact
    if name in ("argmax", "argmin", "max", "min", "any", "all", "cummax") and not exact_in and v.dtype in FLOATS:
        if name in ("argmax", "argmin", "any", "all"):
            return None  # discontinuous on a rounded value
    if v.dtype == "bool" and name not in ("any", "all", "argmax", "argmin", "max", "min"):
        return None
    if v.dtype not in FLOATS and name in ("var", "logsumexp", "softmax", "log_softmax", "lse_manual", "mean"):
        return None
    if v.dtype == "uint8" and name == "cumprod":
        return None
    single = name in ("argmax", "argmin", "cumsum", "cumprod", "cummax")
    if axis is None:
        axis = _axes(b, v.shape, single=single)
    if single and (axis is None or isinstance(axis, tuple)):
        axis = -1
    if name == "cummax" and axis is not None:
        axis = axis % len(v.shape)  # lax.cummax takes no negative axis
    if name in ("argmax", "argmin", "cumsum", "cumprod", "cummax", "softmax", "log_softmax") and isinstance(axis, tuple):
        axis = axis[0]
    keep = d(booleans()) if name not in ("cumsum", "cumprod", "cummax", "softmax", "log_softmax") else True
    shape = (v.shape if name in ("cumsum", "cumprod", "cummax", "softmax", "log_softmax")
             else _reduced_shape(v.shape, axis, keep))
    if name in ("argmax", "argmin"):
        dtype = "int32"
    elif name in ("any", "all"):
        dtype = "bool"
    elif name in ("sum", "prod", "cumsum", "cumprod") and v.dtype in ("bool", "int8", "uint8"):
        dtype = "int32"
    else:
        dtype = v.dtype
    exact = exact_in and (name in ("max", "min", "argmax", "argmin", "any", "all", "cummax") or v.dtype not in FLOATS)
    key = (v.name, axis if not isinstance(axis, int) else axis % len(v.shape))
    prev = b.reduced.setdefault(key, set())
    if not b.allowed("multi_reduce") and any(b.reduced.values()):
        return None  # class 1 excluded: one reduction per program
    if prev and name not in prev:
        b.features.add("multi_reduce")
    prev.add(name)
    if name in ("argmax", "argmin"):
        extent = numel(v.shape) if axis is None else v.shape[axis]
        if 1 << (extent - 1).bit_length() > b.options.get("max_persistent_cols", 8192):  # a looped reduction
            if not b.allowed("looped_argmax"):
                return None
            b.features.add("looped_argmax")
    code = _reduce_code(name, fn, v.name, axis, keep)
    if dtype == "int32" and v.dtype in ("bool", "int8", "uint8") and name not in ("argmax", "argmin"):
        code = code[:-1] + ", dtype=I32)"  # jnp sums uint8 as uint32: keep to the tracked dtype
    return b.emit(code, [v], shape, dtype, exact, name)


def op_multi_reduce(b: Builder):
    """Two or three reductions of one operand over the same (or other) axes: a row kernel with several results."""
    d = b.draw
    v = b.pick(lambda v: len(v.shape) >= 1)
    axis = _axes(b, v.shape, single=True) if d(booleans()) else _axes(b, v.shape)
    out = None
    taken = []
    for _ in range(d(integers(2, 3))):
        ax = axis if d(integers(0, 3)) else None
        r = op_reduce(b, v, ax, taken)
        if r is not None:
            taken.append(b.lines[-1].op)
            b.force_out.append(r)  # each result an output: the kernel computes them all
            out = r
    return out


def op_view(b: Builder):
    d = b.draw
    v = b.pick()
    shape, r = v.shape, len(v.shape)
    kind = d(sampled_from(["reshape", "transpose", "slice", "broadcast", "concat", "pad", "rev", "expand",
                              "squeeze", "dynamic_slice", "iota"]))
    if kind == "reshape":
        n = numel(shape)
        divisors = [k for k in (1, 2, 3, 4, 5, 7, 8, 16, 37) if n % k == 0]
        k = d(sampled_from(divisors))
        new = d(sampled_from([(n,), (k, n // k), (n // k, k), (1, n), (k, 1, n // k)]))
        return b.emit(f"{v.name}.reshape({new!r})", [v], new, v.dtype, v.exact, "reshape")
    if kind == "transpose" and r >= 2:
        perm = tuple(d(permutations(range(r))))
        return b.emit(f"jnp.transpose({v.name}, {perm!r})", [v], tuple(shape[p] for p in perm), v.dtype, v.exact,
                      "transpose")
    if kind == "slice" and r >= 1:
        starts, limits, strides = [], [], []
        for s in shape:
            lo = d(integers(0, max(0, s - 1)))
            hi = d(integers(lo + 1, s)) if s > lo else s
            st_ = d(sampled_from([1, 1, 2, 3]))
            starts.append(lo), limits.append(hi), strides.append(st_)
        new = tuple(-(-(hi - lo) // s) for lo, hi, s in zip(starts, limits, strides))
        return b.emit(f"lax.slice({v.name}, {tuple(starts)!r}, {tuple(limits)!r}, {tuple(strides)!r})", [v], new,
                      v.dtype, v.exact, "slice")
    if kind == "broadcast":
        lead = d(sampled_from([1, 2, 3, 5]))
        new = (lead,) + shape
        if numel(new) > b.max_elems:
            return None
        return b.emit(f"jnp.broadcast_to({v.name}, {new!r})", [v], new, v.dtype, v.exact, "broadcast")
    if kind == "concat" and r >= 1:
        ax = d(integers(0, r - 1))
        w = b.pick(lambda w: w.dtype == v.dtype and len(w.shape) == r
                   and all(a == c for k, (a, c) in enumerate(zip(w.shape, shape)) if k != ax))
        parts = [v, w] if d(booleans()) else [w, v]
        if d(booleans()):
            parts.append(v)
        new = tuple(sum(p.shape[ax] for p in parts) if k == ax else s for k, s in enumerate(shape))
        if numel(new) > b.max_elems:
            return None
        return b.emit(f"jnp.concatenate([{', '.join(p.name for p in parts)}], axis={ax})", parts, new, v.dtype,
                      v.exact and w.exact, "concatenate")
    if kind == "pad" and r >= 1:
        cfg = []
        for s in shape:
            lo = d(integers(-min(s - 1, 3), 3))
            hi = d(integers(-min(s - 1, 3), 3))
            interior = d(sampled_from([0, 0, 1, 2]))
            size = lo + hi + s + max(0, s - 1) * interior
            if size < 0:
                lo, hi = 0, 0
            cfg.append((lo, hi, interior))
        new = tuple(lo + hi + s + max(0, s - 1) * i for (lo, hi, i), s in zip(cfg, shape))
        if numel(new) > b.max_elems or min(new) < 0:
            return None
        pv = _literal(b, v.dtype)
        return b.emit(f"lax.pad({v.name}, {DT_NAME[v.dtype]}({pv}), {cfg!r})", [v], new, v.dtype, v.exact, "pad")
    if kind == "rev" and r >= 1:
        dims = tuple(sorted(set(d(lists(integers(0, r - 1), 1, r)))))
        return b.emit(f"lax.rev({v.name}, {dims!r})", [v], shape, v.dtype, v.exact, "rev")
    if kind == "expand":
        ax = d(integers(0, r))
        return b.emit(f"jnp.expand_dims({v.name}, {ax})", [v], shape[:ax] + (1,) + shape[ax:], v.dtype, v.exact,
                      "expand_dims")
    if kind == "squeeze" and 1 in shape:
        ax = shape.index(1)
        return b.emit(f"jnp.squeeze({v.name}, {ax})", [v], shape[:ax] + shape[ax + 1:], v.dtype, v.exact, "squeeze")
    if kind == "dynamic_slice" and r >= 1:
        sizes_ = tuple(d(integers(1, s)) for s in shape)
        starts = tuple(d(integers(0, s + 2)) for s in shape)  # past the end: clamped
        return b.emit(f"lax.dynamic_slice({v.name}, {starts!r}, {sizes_!r})", [v], sizes_, v.dtype, v.exact,
                      "dynamic_slice")
    if kind == "iota" and r >= 1:
        dim = d(integers(0, r - 1))
        dt = d(sampled_from(["int32", "float32"]))
        io = b.emit(f"lax.broadcasted_iota({DT_NAME[dt]}, {shape!r}, {dim})", [], shape, dt, True, "iota")
        if dt == v.dtype or v.dtype == "bool":
            return io
        return b.emit(f"{v.name} + {io.name}.astype({DT_NAME[v.dtype]})", [v, io], shape, v.dtype,
                      v.exact and v.dtype not in FLOATS, "add")
    return None


def op_matmul(b: Builder):
    d = b.draw
    v = b.pick(lambda v: v.dtype in ("float32", "bfloat16", "float16") and len(v.shape) in (1, 2, 3))
    if v is None:
        return None
    shape = v.shape if len(v.shape) >= 2 else (1,) + v.shape
    k = shape[-1]
    n = d(sampled_from([1, 3, 16, 33, 64, 130]))
    w = b.new_input((k, n), v.dtype, plain=True)
    src = v.name if len(v.shape) >= 2 else f"{v.name}[None, :]"
    form = d(sampled_from(["dot", "einsum", "einsum_t", "pref"]))
    if form == "dot":
        code = f"jnp.dot({src}, {w.name})"
    elif form == "einsum":
        code = f"jnp.einsum('...k,kn->...n', {src}, {w.name})"
    elif form == "einsum_t":
        wt = b.emit(f"{w.name}.T", [w], (n, k), v.dtype, True, "transpose")
        code = f"jnp.einsum('...k,nk->...n', {src}, {wt.name})"
        w = wt
    else:
        code = f"lax.dot_general({src}, {w.name}, ((({len(shape) - 1},), (0,)), ((), ())), preferred_element_type=F32)"
    out_dtype = "float32" if form == "pref" else v.dtype
    out = b.emit(code, [v, w], shape[:-1] + (n,), out_dtype, False, "dot_general")
    if d(booleans()):  # an epilogue: bias and an activation
        bias = b.new_input((n,), out_dtype, plain=True)
        act = d(sampled_from(["{a}", "jax.nn.relu({a})", "jax.nn.gelu({a})", "jnp.tanh({a})"]))
        out = b.emit(act.format(a=f"{out.name} + {bias.name}"), [out, bias], out.shape, out_dtype, False, "epilogue")
    return out


def op_index_modes(b: Builder):
    """Indexing by run-time values: gathers, scatters, dynamic slices at traced starts.
    Index inputs are int inputs (values around 0 and, as specials, the int's extremes: out
    of bounds both ways)."""
    d = b.draw
    v = b.pick(lambda v: len(v.shape) >= 1)
    if v is None:
        return None
    shape, r = v.shape, len(v.shape)
    ax = d(integers(0, r - 1))
    kind = d(sampled_from(["take_along_axis", "take", "getitem", "scatter", "dynamic_slice", "dynamic_update_slice"]))
    mode = d(sampled_from(["None", "'clip'", "'fill'"]))
    if kind == "take_along_axis":
        ishape = shape[:ax] + (d(sampled_from([1, 2, 5])),) + shape[ax + 1:]
        if numel(ishape) > b.max_elems:
            return None
        idx = b.new_input(ishape, "int32")
        return b.emit(f"jnp.take_along_axis({v.name}, {idx.name}, axis={ax}, mode={mode})", [v, idx], ishape,
                      v.dtype, v.exact, "gather")
    if kind == "take":
        k = d(sampled_from([1, 3, 7]))
        idx = b.new_input((k,), d(sampled_from(["int32", "int8", "uint8"])))
        return b.emit(f"jnp.take({v.name}, {idx.name}, axis={ax}, mode={mode})", [v, idx],
                      shape[:ax] + (k,) + shape[ax + 1:], v.dtype, v.exact, "gather")
    if kind == "getitem":
        ishape = d(sampled_from([(2, 3), (1,), (4,)]))
        out = ishape + shape[1:]
        if numel(out) > b.max_elems:
            return None
        idx = b.new_input(ishape, "int32")
        return b.emit(f"{v.name}[{idx.name}]", [v, idx], out, v.dtype, v.exact, "gather")
    if kind == "scatter":
        if v.dtype == "bool":
            return None
        k = d(sampled_from([1, 2, 3, 9]))  # 9: past the dense scatter's unroll (XLA's scatter)
        idx = b.new_input((k,), "int32")
        upd = b.new_input((k,) + shape[1:], v.dtype)
        op = d(sampled_from(["add", "add", "max", "min", "mul"]))
        smode = d(sampled_from(["None", "'clip'", "'drop'"]))
        exact = v.exact and upd.exact and (op in ("max", "min") or v.dtype not in FLOATS)
        return b.emit(f"{v.name}.at[{idx.name}].{op}({upd.name}, mode={smode})", [v, idx, upd], shape, v.dtype,
                      exact, f"scatter_{op}")
    size = d(integers(1, shape[ax]))
    start = b.new_input((), d(sampled_from(["int32", "int8"])))
    if kind == "dynamic_slice":
        return b.emit(f"lax.dynamic_slice_in_dim({v.name}, {start.name}, {size}, axis={ax})", [v, start],
                      shape[:ax] + (size,) + shape[ax + 1:], v.dtype, v.exact, "dynamic_slice")
    upd = b.new_input(shape[:ax] + (size,) + shape[ax + 1:], v.dtype)
    return b.emit(f"lax.dynamic_update_slice_in_dim({v.name}, {upd.name}, {start.name}, axis={ax})", [v, upd, start],
                  shape, v.dtype, v.exact and upd.exact, "dynamic_update_slice")



def _index_input(b: Builder, shape, extent):
    """An int32 index input: in range, negative (from the end) and out of bounds (clamped,
    filled or dropped, as each op says), and, with special values, int32's extremes."""
    d = b.draw
    name = f"x{len(b.inputs)}"
    special = d(sampled_from([0.0, 0.1]))
    scale = 1.0
    b.inputs.append(Input(name, tuple(shape), "int32", d(integers(0, 2**16)), special, scale))
    v = Value(name, tuple(shape), "int32", True)
    b.values.append(v)
    if extent > 9 and d(booleans()):  # make_input's ints are in [-9, 9]: spread over the extent
        return b.emit(f"{name} * {max(1, extent // 9)}", [v], shape, "int32", True, "mul")
    return v


def op_index(b: Builder):
    """Gathers and scatters: take_along_axis, x[idx], table[ids], x.at[idx].add(u) with repeated
    indices, dynamic_slice with traced starts, dynamic_update_slice, one_hot."""
    d = b.draw
    kind = d(sampled_from(["index", "take_along", "table", "scatter_add", "dus", "dyn_slice", "one_hot"]))
    if kind == "table":
        vocab, dim = d(sampled_from([5, 37, 100])), d(sampled_from([1, 3, 16, 33]))
        table = b.new_input((vocab, dim), d(sampled_from(["float32", "bfloat16", "int32"])))
        ids = b.pick(lambda v: v.dtype in INTS and len(v.shape) <= 2 and numel(v.shape) * dim <= b.max_elems)
        if ids is None or d(booleans()):
            ids = _index_input(b, (d(sampled_from(SMALL_DIMS[:8])),), vocab)
        return b.emit(f"{table.name}[{ids.name}]", [table, ids], ids.shape + (dim,), table.dtype, True, "gather")
    if kind == "one_hot":
        v = b.pick(lambda v: v.dtype in INTS and numel(v.shape) * 37 <= b.max_elems)
        if v is None:
            return None
        n = d(sampled_from([1, 3, 10, 37]))
        dt = d(sampled_from(["float32", "bfloat16", "int32"]))
        return b.emit(f"jax.nn.one_hot({v.name}, {n}, dtype={DT_NAME[dt]})", [v], v.shape + (n,), dt, True, "one_hot")
    v = b.pick(lambda v: len(v.shape) >= 1)
    shape, r = v.shape, len(v.shape)
    if kind == "index":
        k = d(sampled_from(SMALL_DIMS[:8]))
        new = (k,) + shape[1:]
        if numel(new) > b.max_elems:
            return None
        idx = _index_input(b, (k,), shape[0])
        return b.emit(f"{v.name}[{idx.name}]", [v, idx], new, v.dtype, v.exact, "gather")
    if kind == "take_along":
        ax = d(integers(0, r - 1))
        k = d(sampled_from(SMALL_DIMS[:8]))
        new = tuple(k if i == ax else s for i, s in enumerate(shape))
        if numel(new) > b.max_elems:
            return None
        idx = _index_input(b, new, shape[ax])
        return b.emit(f"jnp.take_along_axis({v.name}, {idx.name}, axis={ax})", [v, idx], new, v.dtype, v.exact,
                      "take_along_axis")
    if kind == "scatter_add":
        if v.dtype == "bool":
            return None
        k = d(sampled_from(SMALL_DIMS[:8]))
        idx = _index_input(b, (k,), shape[0])
        upd = b.new_input((k,) + shape[1:], v.dtype)
        # repeated indices add up: in any order for floats (inexact), exactly (wrapping) for ints
        return b.emit(f"{v.name}.at[{idx.name}].add({upd.name})", [v, idx, upd], shape, v.dtype,
                      v.exact and v.dtype not in FLOATS, "scatter_add")
    traced = d(booleans())
    starts = [d(integers(0, s + 2)) for s in shape]  # past the end: clamped
    uses = [v]
    if traced:  # starts the kernel reads at run time
        st_in = _index_input(b, (r,), max(shape))
        uses.append(st_in)
        start_code = "(" + "".join(f"{st_in.name}[{i}], " for i in range(r)) + ")"
    else:
        start_code = repr(tuple(starts))
    if kind == "dyn_slice":
        sizes_ = tuple(d(integers(1, s)) for s in shape)
        return b.emit(f"lax.dynamic_slice({v.name}, {start_code}, {sizes_!r})", uses, sizes_, v.dtype, v.exact,
                      "dynamic_slice")
    u = b.pick(lambda u: u.dtype == v.dtype and len(u.shape) == r and all(a <= c for a, c in zip(u.shape, shape)))
    if u is None or u is v and d(booleans()):
        u = b.new_input(tuple(d(integers(1, s)) for s in shape), v.dtype)
    return b.emit(f"lax.dynamic_update_slice({v.name}, {u.name}, {start_code})", uses + [u], shape, v.dtype,
                  v.exact and u.exact, "dynamic_update_slice")


def op_long_row(b: Builder):
    """softmax / log_softmax / logsumexp over a row longer than one tile (long runs only)."""
    d = b.draw
    if not b.long_rows:
        return None
    shape = (d(sampled_from([1, 2, 3])), d(sampled_from(LONG_ROWS)))
    x = b.new_input(shape, d(sampled_from(FLOATS)))
    name, fn = d(sampled_from([("softmax", "jax.nn.softmax"), ("log_softmax", "jax.nn.log_softmax"),
                               ("logsumexp", "jax.nn.logsumexp")]))
    if name == "logsumexp":
        return b.emit(f"{fn}({x.name}, axis=-1)", [x], shape[:1], x.dtype, False, name)
    return b.emit(f"{fn}({x.name}, axis=-1)", [x], shape, x.dtype, False, name)


OPS = [("unary", op_unary), ("binary", op_binary), ("reduce", op_reduce), ("view", op_view),
       ("cast", op_cast), ("multi_reduce", op_multi_reduce), ("matmul", op_matmul), ("index", op_index), ("index_modes", op_index_modes),
       ("long_row", op_long_row)]


def programs(exclude=frozenset(), max_ops=8, long_rows=True):
    """A hypothesis strategy of ``Program``s; ``exclude``: generator features (``KNOWN_FEATURES``) to leave out."""
    from hypothesis import strategies as st

    @st.composite
    def strategy(draw):
        return build(lambda spec: draw(_hypothesis(spec)), exclude, max_ops, long_rows)

    return strategy()


def random_program(rng, exclude=frozenset(), max_ops=8, long_rows=True):
    """A ``Program`` drawn with a ``random.Random`` (no hypothesis, so no shrinking)."""
    return build(lambda spec: _sample(spec, rng), exclude, max_ops, long_rows)


def build(draw, exclude=frozenset(), max_ops=8, long_rows=True):
    options = {}
    if draw(integers(0, 3)) == 3:
        options["max_persistent_cols"] = draw(sampled_from([16, 64, 256]))  # looped reductions at small sizes
    if draw(integers(0, 3)) == 3:
        options["num_sms"] = 132  # the GPU's split / mix-order decisions
    if draw(integers(0, 4)) == 4:
        options["allow_excess_precision"] = False
    if draw(integers(0, 4)) == 4:
        options["matmul_template"] = "fused"
    b = Builder(draw, exclude, options)
    b.long_rows = long_rows
    base = _shape(draw, long_rows)
    b.new_input(base, _dtype(draw))
    if draw(booleans()):
        b.new_input(base, _dtype(draw))
    n = draw(integers(min(3, max_ops), max_ops))  # dead ops vanish from the source, so a floor costs no minimality
    ops = [o for o in OPS if o[0] != "multi_reduce" or "multi_reduce" not in exclude]
    for _ in range(n):
        _, gen = draw(sampled_from(ops))
        gen(b)
    produced = [v for v in b.values if v.name.startswith("v")]
    if not produced:
        b.emit(f"{b.values[0].name} * 1", [b.values[0]], b.values[0].shape, b.values[0].dtype, True, "mul")
        produced = b.values[-1:]
    # Outputs: the last value and, sometimes, a few earlier ones (multiple outputs).
    outs = [produced[-1]]
    for v in produced[:-1]:
        if v in b.force_out or draw(integers(0, 2)) == 2:
            outs.append(v)
    return Program(b.inputs, b.lines, [v.name for v in outs], [v.exact for v in outs], options, b.features)


def shrink(program, fails, budget_s=120.0):
    """Greedy shrinking of a program drawn without hypothesis: drop outputs, options and special
    values while ``fails(candidate)`` holds (dead code then leaves the source)."""
    import copy
    import time

    deadline = time.time() + budget_s
    best = program

    def attempt(candidate):
        nonlocal best
        if time.time() < deadline and fails(candidate):
            best = candidate
            return True
        return False

    changed = True
    while changed and time.time() < deadline:
        changed = False
        for k in range(len(best.outputs)):
            if len(best.outputs) > 1 and k < len(best.outputs):
                c = copy.deepcopy(best)
                del c.outputs[k], c.exact[k]
                changed |= attempt(c)
        for key in list(best.options):
            c = copy.deepcopy(best)
            del c.options[key]
            changed |= attempt(c)
        for i, inp in enumerate(best.inputs):
            for field, plain in (("special", 0.0), ("scale", 1.0), ("seed", 0)):
                if getattr(inp, field) != plain:
                    c = copy.deepcopy(best)
                    setattr(c.inputs[i], field, plain)
                    changed |= attempt(c)
    return best
