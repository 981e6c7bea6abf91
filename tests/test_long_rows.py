"""Rows longer than one tile: online softmax (a looped max and sum of exp in one
sweep, [Note: online softmax] in lowering/codegen/rows.py) and persistent long
rows (heuristics.long_row_persistent), against jax.jit, with rows of -inf, +inf
and NaN."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering
import pallaskit
from lowering import heuristics
from lowering.options import CompileOptions

BF16 = jnp.bfloat16


def _rows(rng, cols, dtype):
    """Rows: plain; all -inf; one +inf; one NaN; -inf over the first 60% then
    plain with one -inf (the max grows chunk by chunk from nothing); plain + 500
    (exp(x) overflows without the shift)."""
    x = rng.standard_normal((6, cols)) * 3
    x[1] = -np.inf
    x[2, rng.integers(cols)] = np.inf
    x[3, rng.integers(cols)] = np.nan
    x[4, : (cols * 3) // 5] = -np.inf
    x[4, rng.integers((cols * 3) // 5, cols)] = -np.inf if cols > 1 else x[4, 0]
    x[5] += 500
    return jnp.asarray(x, dtype)


def _same(got, want, dtype=None):
    """Same NaN / ±inf positions, the rest close at ``dtype``'s tolerance (the
    outputs' own dtype unless given: a float32 loss of bf16 logits is a bf16 sum)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        for test in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(test(g64), test(w64))
        finite = np.isfinite(w64)
        dt = jnp.dtype(dtype or w.dtype)
        tol = (dict(rtol=2e-2, atol=2e-2) if dt == BF16 else dict(rtol=2e-3, atol=2e-3) if dt == jnp.float16
               else dict(rtol=2e-5, atol=1e-6))
        np.testing.assert_allclose(np.where(finite, g64, 0), np.where(finite, w64, 0), **tol)


def _softmaxes(x):
    return jax.nn.softmax(x, -1), jax.nn.log_softmax(x, -1), jax.nn.logsumexp(x, -1)


# (columns, option long_rows): 8193 loops over 3 chunks or fits a 16384 tile;
# 50,257 (a GPT-2 vocabulary) loops over 13 chunks or fits a 65536 tile.
_PATHS = [(1, "auto"), (8193, "looped"), (8193, "auto"), (50257, "looped"), (50257, "persistent")]


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols,long_rows", _PATHS, ids=[f"{c}-{m}" for c, m in _PATHS])
def test_softmax_family_matches_jax(cols, long_rows, dtype, rng):
    x = _rows(rng, cols, dtype)
    with pallaskit.config.override(long_rows=long_rows, cache=False, num_sms=2):
        got = pallaskit.jit(_softmaxes)(x)
    _same(got, jax.jit(_softmaxes)(x))


@pytest.mark.parametrize("fn", ["softmax", "log_softmax", "logsumexp"])
def test_each_alone_looped(fn, rng):
    """One function a kernel (its max read off the online accumulators), rows of
    8193 in 3 chunks."""
    f = getattr(jax.nn, fn)
    x = _rows(rng, 8193, jnp.float32)
    with pallaskit.config.override(long_rows="looped", cache=False):
        got = pallaskit.jit(lambda x: f(x, axis=-1))(x)
    _same(got, jax.jit(lambda x: f(x, axis=-1))(x))


def _xent(labels_by):
    def loss(logits, labels):
        ls = jax.nn.log_softmax(logits, axis=-1)
        if labels_by == "one_hot":  # optax's softmax_cross_entropy with one_hot labels
            picked = jnp.sum(ls * jax.nn.one_hot(labels, logits.shape[-1], dtype=ls.dtype), axis=-1)
        else:
            picked = jnp.take_along_axis(ls, labels[:, None], axis=-1)[:, 0]
        return -jnp.mean(picked.astype(jnp.float32))

    return jax.value_and_grad(loss)


@pytest.mark.parametrize("labels_by", ["one_hot", "take_along_axis"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols,long_rows", _PATHS[1:4:2] + _PATHS[4:], ids=["8193-looped", "50257-looped",
                                                                           "50257-persistent"])
def test_cross_entropy_matches_jax(cols, long_rows, dtype, labels_by, rng):
    """Forward and gradient; a row holds -inf logits away from its label (a
    masked vocabulary), another a NaN (loss and that row's gradient NaN)."""
    x = np.asarray(rng.standard_normal((3, cols)) * 3)
    labels = rng.integers(0, cols, 3).astype(np.int32)
    x[1, (labels[1] + 1 + np.arange(cols // 2)) % cols] = -np.inf
    f, ref = pallaskit.jit(_xent(labels_by)), jax.jit(_xent(labels_by))
    for nan in (False, True):
        if nan:
            x[2, rng.integers(cols)] = np.nan
        args = (jnp.asarray(x, dtype), jnp.asarray(labels))
        with pallaskit.config.override(long_rows=long_rows, cache=False, num_sms=2):
            got = f(*args)
        _same(got, ref(*args), dtype)


# --------------------------------------------------------------------------- #
# Which path: sweeps in the rendered source
# --------------------------------------------------------------------------- #
def _kernel_sources(fn, *args, **options):
    result = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args), CompileOptions(**options))
    return [k.source for k in result.program.kernels]


@pytest.mark.parametrize("case", ["softmax", "cross_entropy"])
def test_online_softmax_is_one_sweep_for_max_and_sum(case):
    """A looped softmax kernel sweeps its rows twice (max and sum together, then
    the outputs), not three times; the cross-entropy forward+backward kernel too."""
    x = jax.ShapeDtypeStruct((64, 8193), BF16)
    if case == "softmax":
        fn, args = (lambda x: jax.nn.softmax(x, -1)), (x,)
    else:
        fn, args = _xent("one_hot"), (x, jax.ShapeDtypeStruct((64,), jnp.int32))
    loops = {}
    for online in (True, False):
        (main, *_) = _kernel_sources(fn, *args, long_rows="looped", online_softmax=online)
        loops[online] = main.count("lax.fori_loop(")
    assert loops == {True: 2, False: 3}, loops


def test_online_softmax_stays_off_for_persistent_rows():
    (src,) = _kernel_sources(lambda x: jax.nn.softmax(x, -1), jax.ShapeDtypeStruct((64, 1000), BF16))
    assert "lax.fori_loop(" not in src and "onl" not in src


def test_persistent_long_row_is_one_read():
    """long_rows='persistent': one 65536-wide tile a row, no loop, 32 warps."""
    (src,) = _kernel_sources(lambda x: jax.nn.softmax(x, -1), jax.ShapeDtypeStruct((64, 50257), BF16),
                             long_rows="persistent", num_sms=2)
    assert "lax.fori_loop(" not in src
    assert "BLOCK_R, BLOCK_C = 1, 65536" in src and "num_warps=32" in src
    assert src.count("plt.load(") == 1, src


def test_long_row_heuristics():
    p = heuristics.long_row_persistent
    assert not p(8192, 2, "auto", 8192)  # fits the ordinary tile: not a long row
    assert p(8193, 2, "auto", 8192) and p(32768, 4, "auto", 8192)
    assert not p(50257, 2, "auto", 8192)  # 65536 x 4 bytes of registers: looped, online
    assert not p(20000, 8, "auto", 8192)  # float64 halves it
    assert p(50257, 2, "persistent", 8192) and not p(65537, 2, "persistent", 8192)
    assert not p(8193, 4, "looped", 8192)
    assert not p(8193, 4, "auto", 64)  # a small max_persistent_cols asks for loops
    assert heuristics.long_row_warps(16384) == 16 and heuristics.long_row_warps(50257) == 32
    looped = heuristics.reduction_config(8192, 50257, max_persistent_cols=8192, inner_contiguous=True, itemsize=2)
    assert (looped.block_rows, looped.block_cols, looped.persistent) == (1, 4096, False)  # one 100 KB row a program


def test_small_max_persistent_cols_loops_online(rng):
    """max_persistent_cols=64 forces the looped path on rows of 300 (one chunk)."""
    x = _rows(rng, 300, jnp.float32)
    (src,) = _kernel_sources(_softmaxes, x, max_persistent_cols=64)
    assert src.count("lax.fori_loop(") == 2 and "onl0_" in src
    with pallaskit.config.override(max_persistent_cols=64, cache=False):
        got = pallaskit.jit(_softmaxes)(x)
    _same(got, jax.jit(_softmaxes)(x))


def test_sums_over_one_row_share_accumulators(rng):
    """softmax, log_softmax and logsumexp of x (three maxes, three sums over the
    same values) and the user's own max of x: one set of online accumulators, every
    max read off it (no max accumulator in the loop)."""
    def fn(x):
        return _softmaxes(x) + (jnp.max(x, -1),)

    x = np.array(_rows(rng, 8193, jnp.float32))
    x[3] = rng.standard_normal(8193)  # no NaN: jax.jit's CPU max drops it from long rows
    x = jnp.asarray(x)
    (src,) = _kernel_sources(fn, x, long_rows="looped")
    assert src.count("_m = jnp.full((BLOCK_R, 1)") == 1 and "acc0_" not in src, src
    with pallaskit.config.override(long_rows="looped", cache=False):
        got = pallaskit.jit(fn)(x)
    _same(got, jax.jit(fn)(x))


# --------------------------------------------------------------------------- #
# The raw-Triton dialect: the same row writer (codegen/rows.py), so the same sweep
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("online", [True, False], ids=["online", "two_sweeps"])
@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cols", [8193, 50257])
def test_triton_online_softmax_matches_jax(cols, dtype, online, rng, monkeypatch):
    """softmax / log_softmax / logsumexp over looped rows of 8193 (3 chunks) and
    50,257 (13) as raw Triton (Triton's interpreter), rows of -inf, +inf and NaN:
    with heuristics.TRITON_ONLINE_SOFTMAX max and sum share one sweep ([Note:
    online softmax]), as in Pallas; without it (the default) they take two."""
    pytest.importorskip("triton")
    from lowering import heuristics

    monkeypatch.setattr(heuristics, "TRITON_ONLINE_SOFTMAX", online)
    x = _rows(rng, cols, dtype)
    options = dict(long_rows="looped", num_sms=2)
    result = lowering.compile_jaxpr(jax.make_jaxpr(_softmaxes)(x),
                                    CompileOptions(interpret=True, kernel_backend="triton", triton_available=True,
                                                   **options))
    (main, *_) = result.program.kernels
    assert main.triton, main.executor
    loops = main.source.count("for chunk in range(")
    assert (loops, "onl0_0_m" in main.source) == ((2, True) if online else (3, False)), main.source
    with pallaskit.config.override(kernel_backend="triton", cache=False, **options):
        got = pallaskit.jit(_softmaxes)(x)
    _same(got, jax.jit(_softmaxes)(x))


# --------------------------------------------------------------------------- #
# Aligned row windows ([Note: aligned row windows] in lowering/codegen/rows.py):
# raw-Triton looped rows of a length that is no multiple of a 16-byte vector
# read and written from the row's start rounded down to a vector
# --------------------------------------------------------------------------- #
_TRITON = dict(kernel_backend="triton", num_sms=2)


def _triton_sources(fn, *args, **options):
    result = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*args),
                                    CompileOptions(interpret=True, triton_available=True, **{**_TRITON, **options}))
    assert all(k.triton for k in result.program.kernels), [k.executor for k in result.program.kernels]
    return [k.source for k in result.program.kernels]


def _triton_matches_jax(fn, args, dtype=None, **options):
    with pallaskit.config.override(cache=False, **_TRITON, **options):
        got = pallaskit.jit(fn)(*args)
    _same(got, jax.jit(fn)(*args), dtype)


def _windowed(src: str) -> bool:
    return "wa = tl.multiple_of(" in src


@pytest.fixture
def thirds_last(monkeypatch):
    """Triton's interpreter runs the programs of a launch one after another in
    order, so a program writing past its own row would be overwritten by the
    program of the row it wrote into: this runs the programs 1, 4, 7, ... last,
    so what they write into either neighbour's row stays. (Their rows start at
    every offset within a vector when there are 24 or more.)"""
    pytest.importorskip("triton")
    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    set_idx = type(b).set_grid_idx

    def shuffled(x, y, z):
        n = b.grid_dim[0]
        order = [i for i in range(n) if i % 3 != 1] + [i for i in range(n) if i % 3 == 1]
        set_idx(b, order[x], y, z)

    monkeypatch.setattr(b, "set_grid_idx", shuffled)


# (columns, max_persistent_cols, dtype): 7 and 10 loop over one 4096-wide chunk (a
# row shorter than a bf16 vector, or a few vectors), 8193 over three.
_ODD = [(7, 4, BF16), (10, 4, BF16), (8193, 8192, BF16), (8193, 8192, jnp.float32)]
_ODD_IDS = [f"{c}-{'bf16' if d == BF16 else 'f32'}" for c, _, d in _ODD]


@pytest.mark.parametrize("online", [False, True], ids=["two_sweeps", "online"])
@pytest.mark.parametrize("cols,mpc,dtype", _ODD, ids=_ODD_IDS)
def test_aligned_rows_softmaxes_match_jax(cols, mpc, dtype, online, rng, monkeypatch, thirds_last):
    """softmax (a row-wise store), log_softmax and logsumexp over rows of -inf,
    +inf and NaN, each row starting at another offset within a vector."""
    if online and cols != 8193:
        pytest.skip("the online sweep on the three-chunk rows")
    monkeypatch.setattr(heuristics, "TRITON_ONLINE_SOFTMAX", online)
    x = _rows(rng, cols, dtype)
    options = dict(long_rows="looped", max_persistent_cols=mpc)
    (src,) = _triton_sources(_softmaxes, x, **options)
    assert _windowed(src) and ("onl0_0_m" in src) == online, src
    _triton_matches_jax(_softmaxes, (x,), **options)


@pytest.mark.parametrize("labels_by", ["one_hot", "take_along_axis"])
@pytest.mark.parametrize("cols,mpc,dtype", [_ODD[0], _ODD[2]], ids=[_ODD_IDS[0], _ODD_IDS[2]])
def test_aligned_rows_cross_entropy_matches_jax(cols, mpc, dtype, labels_by, rng, thirds_last):
    """Loss and gradient (the gradient a row-wise store through the window)
    over 24 rows (the rows run last start at every offset within a vector),
    labels at both ends of the row, a row with -inf logits, a row with a NaN."""
    if cols == 7 and labels_by == "take_along_axis":
        pytest.skip("one label form on the short rows")
    x = np.asarray(rng.standard_normal((24, cols)) * 3)
    labels = rng.integers(0, cols, 24).astype(np.int32)
    labels[:2] = 0, cols - 1
    x[1, (labels[1] + 1 + np.arange(cols // 2)) % cols] = -np.inf
    x[2, rng.integers(cols)] = np.nan
    x[3, rng.integers(cols)] = np.inf
    args = (jnp.asarray(x, dtype), jnp.asarray(labels))
    options = dict(long_rows="looped", max_persistent_cols=mpc)
    assert _windowed(_triton_sources(_xent(labels_by), *args, **options)[0])
    _triton_matches_jax(_xent(labels_by), args, dtype, **options)


def test_aligned_rows_ints_bools_and_mixed_widths(rng, thirds_last):
    """A bool row (16-element vectors) beside a bf16 one, and int32 rows: the
    window is aligned for the narrowest; sums, max and row-wise stores."""
    def fn(b, x, i):
        return (jnp.where(b, x, 0) - jnp.max(x, -1, keepdims=True), jnp.sum(b, -1),
                i - jnp.min(i, -1, keepdims=True), jnp.any(b & (i > 0), -1))

    cols = 8193
    b = jnp.asarray(rng.random((5, cols)) < 0.5)
    x = _rows(rng, cols, BF16)[:5]
    i = jnp.asarray(rng.integers(-1000, 1000, (5, cols)), jnp.int32)
    srcs = _triton_sources(fn, b, x, i, long_rows="looped")
    assert any("(wrow // 16) * 16" in s for s in srcs), srcs
    _triton_matches_jax(fn, (b, x, i), long_rows="looped")


def test_aligned_rows_in_combo_kernels(rng, thirds_last):
    """Independent looped rows of 8193 and 8195 joined into one combo kernel
    ([Note: combo kernels]): each part windows its own rows from its own pid."""
    def fn(x, y):
        return jax.nn.softmax(x, -1), jax.nn.logsumexp(y * 2, -1), jax.nn.softmax(y, -1)

    x, y = _rows(rng, 8193, BF16), _rows(rng, 8195, BF16)
    (src,) = _triton_sources(fn, x, y, long_rows="looped")
    assert src.count("wa = tl.multiple_of(") == 2 and "combo" in src, src
    _triton_matches_jax(fn, (x, y), long_rows="looped")


def test_aligned_rows_source(monkeypatch):
    """The looped cross-entropy kernel over 50,257 bf16 (three sweeps) reads the
    logits and writes the gradient from the aligned base (and only with the
    heuristic on); the labels stay a per-row load, before the loops."""
    monkeypatch.setattr(heuristics, "TRITON_ONLINE_SOFTMAX", False)
    args = (jax.ShapeDtypeStruct((64, 50257), BF16), jax.ShapeDtypeStruct((64,), jnp.int32))
    main = _triton_sources(_xent("take_along_axis"), *args, long_rows="looped")[0]
    assert _windowed(main) and "(wrow // 8) * 8" in main, main
    assert main.count("for chunk in range(0, 13)") == 3
    assert main.count("tl.load(in_ptr0 + wo, mask=") == 3 and main.count("tl.store(out_ptr2 + wo,") == 2, main
    assert "in_ptr0 + idx" not in main and "out_ptr2 + idx" not in main, main
    assert main.count("tl.load(in_ptr1 + ") == 1 and main.index("tl.load(in_ptr1 + ") < main.index("for chunk"), main
    monkeypatch.setattr(heuristics, "TRITON_ALIGNED_ROWS", False)
    assert not _windowed(_triton_sources(_xent("take_along_axis"), *args, long_rows="looped")[0])


def test_aligned_rows_only_where_they_help(rng):
    """No window over rows that are not contiguous (a column of a (8193, 6)
    array, a looped one-row kernel reading every sixth element; its transpose's
    rows), rows a whole number of vectors long, persistent rows, argmax (its
    lanes would see columns before the row) or the Pallas renderer."""
    def strided(x):
        return jax.nn.softmax(x[:, 1]), jax.nn.logsumexp(x.T, -1)

    x = _rows(rng, 8193, jnp.float32).T
    srcs = _triton_sources(strided, x, long_rows="looped")
    assert not any(_windowed(s) for s in srcs) and any("idx0 = 6 * xc + 1" in s for s in srcs), srcs
    _triton_matches_jax(strided, (x,), long_rows="looped")
    aligned = jax.ShapeDtypeStruct((6, 8200), BF16)
    assert not _windowed(_triton_sources(_softmaxes, aligned, long_rows="looped")[0])
    assert not _windowed(_triton_sources(_softmaxes, jax.ShapeDtypeStruct((6, 1001), BF16))[0])
    y = _rows(rng, 8193, jnp.float32)
    def arg(x):
        return jnp.argmax(x, -1), jax.nn.softmax(x, -1)
    assert not any(_windowed(s) for s in _triton_sources(arg, y, long_rows="looped"))
    _triton_matches_jax(arg, (y,), long_rows="looped")
    (pallas,) = _kernel_sources(_softmaxes, jax.ShapeDtypeStruct((6, 8193), BF16), long_rows="looped", num_sms=2)
    assert "wrow" not in pallas


_PTX_SCRIPT = '''
import linecache, re, os
os.environ.pop("TRITON_INTERPRET", None)
import jax, jax.numpy as jnp, numpy as np
from triton.backends.compiler import GPUTarget
import lowering
from lowering import heuristics
from lowering.options import CompileOptions
from lowering.codegen import triton as tc
from pallaskit.runtime import triton_launch


def loss(logits, labels):
    ls = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(ls, labels[:, None], axis=-1)[:, 0].astype(jnp.float32))


opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True, long_rows="looped", num_sms=2,
                      staged_rows=True)
args = jax.ShapeDtypeStruct((64, 50257), jnp.bfloat16), jax.ShapeDtypeStruct((64,), jnp.int32)
heuristics.TRITON_ONLINE_SOFTMAX = False  # three sweeps: three loads of the logits
for aligned, staged in ((True, False), (False, False), (True, True)):
    heuristics.TRITON_ALIGNED_ROWS, heuristics.TRITON_STAGED_ROWS = aligned, staged
    sched = lowering.compile_jaxpr(jax.make_jaxpr(jax.value_and_grad(loss))(*args), opts).schedule
    k = sched.kernels[0]
    r = tc.render_for_xla(k, sched, opts)
    assert r.staged == staged, r.source
    src = (tc._PRELUDE + (tc.GLUON_IMPORTS if staged else "") + "\\n".join(tc.HELPERS[h] for h in sorted(r.helpers))
           + "\\n\\n" + r.source)
    name = f"<ptx {k.name} {aligned} {staged}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    ns = {"__name__": f"ptx_{aligned}"}
    exec(compile(src, name, "exec"), ns)
    kernel = ns[k.name + "_kernel"]
    dts = [sched.graph.buffer_aval(b)[1] for b in r.reads] + [m.node.dtype for m in k.members if m.store]
    sig = {a: "*" + triton_launch._triton_dtype(k.name, a, np.dtype(d)) for a, d in zip(kernel.arg_names, dts)}
    sig.update({a: "constexpr" for a in kernel.arg_names[len(dts):]})
    ptx = triton_launch._compile_uncached(triton_launch.ast_source(kernel, sig, dict(r.constexprs)),
                                          GPUTarget("cuda", 90, 32), {"num_warps": r.num_warps, "num_stages": 1},
                                          until="ptx").cubin.decode()
    ops = re.findall(r"\\b((?:ld|st)\\.global(?:\\.v\\d)?\\.b\\d+)", ptx)
    print("staged" if staged else aligned, sorted(set(ops)), ops.count("ld.global.b16"),
          ops.count("ld.global.v4.b32"), ops.count("st.global.v4.b32"),
          len(re.findall(r"cp\\.async\\.cg\\.shared\\.global[^;]*0x10", ptx)), r.num_warps, r.constexprs["BLOCK_C"])
'''


def test_aligned_rows_are_vector_accesses_in_ptx():
    """The point of the window: compiled for sm_90 (on the CPU), the cross-entropy
    kernel over 50,257 bf16 reads the logits with 16-byte loads (no 2-byte ones)
    and writes the gradient with 16-byte stores; without it every access is 2 bytes. Staged
    ([Note: staged rows]), the logits arrive by 16-byte copies into shared memory alone."""
    pytest.importorskip("triton")
    from conftest import run_python_on_cpu

    proc = run_python_on_cpu(_PTX_SCRIPT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()
             if line.startswith(("True", "False", "staged"))}
    on, off, staged = lines["True"], lines["False"], lines["staged"]
    # the counts: scalar 2-byte loads, 16-byte loads, 16-byte stores, 16-byte async copies; warps, chunk
    assert on.endswith(" 0 3 1 0 16 4096"), on
    assert off.split()[-5:-3] == ["0", "0"] and "st.global.b16" in off and int(off.split()[-6]) > 0, off
    # [Note: staged rows]: the logits reach the kernel once, by 16-byte copies into shared memory
    assert staged.endswith(" 0 0 1 1 8 2048"), staged


# --------------------------------------------------------------------------- #
# Rows staged in shared memory ([Note: staged rows] in lowering/codegen/rows.py)
# --------------------------------------------------------------------------- #
def _layernorm(x, w, b):
    xf = x.astype(jnp.float32)
    m = xf.mean(-1, keepdims=True)
    v = ((xf - m) ** 2).mean(-1, keepdims=True)
    return ((xf - m) * jax.lax.rsqrt(v + 1e-5) * w + b).astype(x.dtype)


# Kernels of other shapes than the softmax family's: rows read beside per-column
# vectors, integer rows, two staged inputs, float16, online softmax's carried sums.
_STAGED = {
    "layernorm": (_layernorm, lambda rng: (_rows(rng, 30001, BF16), jnp.asarray(rng.standard_normal(30001), jnp.float32),
                                           jnp.asarray(rng.standard_normal(30001), jnp.float32))),
    "int32 var, max": (lambda x: (jnp.var(x, -1), jnp.max(x, -1), jnp.sum(x * 3, -1)),
                       lambda rng: (jnp.asarray(rng.integers(-2**20, 2**20, (6, 20001)), jnp.int32),)),
    "two inputs": (lambda x, y: jax.nn.softmax(x.astype(jnp.float32) + y, -1),
                   lambda rng: (_rows(rng, 20001, BF16), _rows(rng, 20001, BF16))),
    "float16": (lambda x: (jax.nn.log_softmax(x, -1), jnp.sum(x, -1)), lambda rng: (_rows(rng, 30001, jnp.float16),)),
    "online": (_softmaxes, lambda rng: (_rows(rng, 50257, BF16),)),
    "bf16 by f32": (lambda x, y: jax.nn.logsumexp(x.astype(jnp.float32) * y, -1),
                    lambda rng: (_rows(rng, 20001, BF16), jnp.asarray(rng.standard_normal((6, 20001)), jnp.float32))),
    "uint16": (lambda x: (jnp.sum(x.astype(jnp.uint32), -1), jnp.max(x, -1), jnp.min(x, -1)),
               lambda rng: (jnp.asarray(rng.integers(0, 2**16, (6, 40001)), jnp.uint16),)),
}
_STAGED_SCRIPT = '''
import os
os.environ.pop("TRITON_INTERPRET", None)
import jax, jax.numpy as jnp, numpy as np
import lowering
from lowering import heuristics
from lowering.options import CompileOptions
from lowering.codegen import triton as tc
import sys
sys.path.insert(0, "tests")
from test_long_rows import _STAGED
__GPU_SPELLING__
opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True, long_rows="looped", num_sms=2,
                      staged_rows=True)
rng = np.random.default_rng(0)
for kind, (fn, make) in _STAGED.items():
    heuristics.TRITON_ONLINE_SOFTMAX = kind == "online"
    sched = lowering.compile_jaxpr(jax.make_jaxpr(fn)(*make(rng)), opts).schedule
    staged = [k for k in sched.kernels if tc.render_for_xla(k, sched, opts).staged]
    for k in staged:
        compile_for_gpu(k, sched, opts, until="ptx")
    print("STAGED", kind, len(staged))
'''


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="Gluon kernels: a GPU's (their spelling compiles below)")
@pytest.mark.parametrize("kind", list(_STAGED))
def test_staged_rows_match_jax(kind, rng):
    fn, make = _STAGED[kind]
    args = make(rng)
    with pallaskit.config.override(long_rows="looped", cache=False, num_sms=2), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(heuristics, "TRITON_ONLINE_SOFTMAX", kind == "online")
        jf = pallaskit.jit(fn)
        got = jf(*args)
        source = "".join(k.source for k in pallaskit.explain(jf, *args).kernels)
    if pallaskit.orchestrator.compile_options().staged_rows:
        assert "rows staged in shared memory" in source
    if kind.startswith("int32"):
        want = jax.jit(fn)(*args)
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_array_equal(got[2], want[2])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    elif kind == "uint16":
        for g, w in zip(got, jax.jit(fn)(*args)):
            np.testing.assert_array_equal(g, w)
    else:
        _same(got, jax.jit(fn)(*args))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the GPU runs the kernels themselves (above)")
def test_staged_rows_compile_for_sm90():
    """Each kind's staged kernel is a Gluon kernel that compiles for sm_90 (on the CPU)."""
    pytest.importorskip("triton")
    from conftest import GPU_SPELLING_FIXTURE, run_python_on_cpu

    proc = run_python_on_cpu(_STAGED_SCRIPT.replace("__GPU_SPELLING__", GPU_SPELLING_FIXTURE), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    staged = {line.split(None, 1)[1].rsplit(None, 1)[0]: int(line.split()[-1])
              for line in proc.stdout.splitlines() if line.startswith("STAGED")}
    assert staged == {kind: 1 for kind in _STAGED}, staged
