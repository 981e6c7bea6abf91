"""The raw-Triton renderer (lowering/codegen/triton.py) and the eager launches
of symbolic programs (pallaskit/runtime/eager.py, [Note: eager launches]).

On the CPU the kernels run in Triton's interpreter (``dynamic_launch='on'``);
``JAX_PLATFORMS=cuda PALLASKIT_INTERPRET=0`` compiles them for the GPU. Every
case checks that the call really ran eagerly (counter ``eager_launches``), so
a program that silently took its XLA path fails."""
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("triton")

import pallaskit  # noqa: E402
from conftest import assert_close  # noqa: E402
from pallaskit import metrics  # noqa: E402

BF16 = jnp.bfloat16
# Row counts of an eager program: one row, fewer than a row block, and two sizes over
# several row blocks of each case's tile (BLOCK_R 1 to 32; the transposed case's
# tile is 128 by 32, so it goes on to 300): Triton's interpreter runs every row.
SIZES = (1, 7, 37, 70)
LONG_SIZES = {"transposed": (1, 7, 37, 300)}


def _pointwise_broadcast(x, w, b):
    return jnp.tanh(x * w + b) * 2.0 - jnp.maximum(x, 0.5) / (1.0 + jnp.abs(b))


def _transposed(x, s):
    return jnp.transpose(x, (1, 0)) * s  # a (96, n) result: a tiled transpose


def _softmax(x, w):
    return jax.nn.softmax(x * w, axis=-1)


def _layernorm(x, w, b):
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    return ((xf - mu) * jax.lax.rsqrt(var + 1e-5) * w + b).astype(x.dtype), jnp.max(xf, axis=-1)


def _long_rows(x):
    # rows far longer than a persistent tile: a looped reduction, and a row-wise store in the loop
    return jnp.sum(jnp.exp(x - 1.0), axis=-1), jnp.where(x > 0, x, 0.1 * x)


def _column_sums(x):
    return jnp.sum(x.astype(jnp.float32), axis=0), x * 2


def _norm_backward(x, w, dy):
    def rms(x, w):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)

    return jax.vjp(rms, x, w)[1](dy)


def _mlp(x, w1, b1, w2, r):
    return jax.nn.gelu(x @ w1 + b1) @ w2 + r


def _mlp_erf(x, w1, w2):
    return jax.nn.gelu(jnp.einsum("nk,kh->nh", x, w1), approximate=False) @ w2


def _normal(rng, shape, dt, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dt)


CASES = {
    # name: (fn, dynamic, (n, dtype, rng) -> args)
    "pointwise_broadcast": (_pointwise_broadcast, {"x": {0: "n"}},
                            lambda n, dt, r: (_normal(r, (n, 96), dt), _normal(r, (96,), dt), _normal(r, (1, 96), dt))),
    "transposed": (_transposed, {"x": {0: "n"}}, lambda n, dt, r: (_normal(r, (n, 96), dt), _normal(r, (), dt))),
    "softmax": (_softmax, {"x": {0: "n"}}, lambda n, dt, r: (_normal(r, (n, 100), dt), _normal(r, (100,), dt))),
    "layernorm": (_layernorm, {"x": {0: "n"}},
                  lambda n, dt, r: (_normal(r, (n, 130), dt), _normal(r, (130,), dt), _normal(r, (130,), dt))),
    "long_rows": (_long_rows, {"x": {0: "n"}}, lambda n, dt, r: (_normal(r, (n, 5000), dt),)),
    # column sums over the dynamic rows, split at the hint (test_eager_split_column_sums_and_mix_kernels)
    "column_sums": (_column_sums, {"x": {0: "n"}}, lambda n, dt, r: (_normal(r, (n, 96), dt),)),
    "norm_backward": (_norm_backward, {"x": {0: "n"}, "dy": {0: "n"}},
                      lambda n, dt, r: (_normal(r, (n, 96), dt), _normal(r, (96,), dt), _normal(r, (n, 96), dt))),
    "mlp": (_mlp, {"x": {0: "n"}, "r": {0: "n"}},
            lambda n, dt, r: (_normal(r, (n, 40), dt), _normal(r, (40, 72), dt, 0.2), _normal(r, (72,), dt),
                              _normal(r, (72, 24), dt, 0.2), _normal(r, (n, 24), dt))),
    "mlp_erf": (_mlp_erf, {"x": {0: "n"}},
                lambda n, dt, r: (_normal(r, (n, 40), dt), _normal(r, (40, 72), dt, 0.2),
                                  _normal(r, (72, 24), dt, 0.2))),
}


# Products: summation order and one rounding of a bfloat16 product differ from XLA's
# (tests/test_matmul.py's tolerances); on a GPU a float32 product runs as TF32.
MATMUL_TOL = {np.dtype(jnp.float32): dict(rtol=1e-4, atol=1e-4) if jax.default_backend() == "cpu"
              else dict(rtol=1e-2, atol=1e-2), np.dtype(BF16): dict(rtol=2e-2, atol=3e-2)}


def _check(name, dtype, rng, sizes=SIZES):
    fn, dynamic, make = CASES[name]
    f = pallaskit.jit(fn, dynamic=dynamic)
    for n in sizes:
        args = make(n, dtype, rng)
        before = metrics.counters["eager_launches"]
        got = f(*args)
        assert metrics.counters["eager_launches"] == before + 1, f"{name} at n={n} did not run eagerly"
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(fn)(*args))):
            assert g.dtype == e.dtype and g.shape == e.shape
            if name.startswith("mlp"):
                np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32),
                                           **MATMUL_TOL[np.dtype(dtype)])
            else:
                assert_close(g, e, dtype)
    return f


@pytest.mark.parametrize("dtype", [jnp.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("mlp") and n not in ("column_sums",
                                                                                          "norm_backward")])
def test_eager_kernels_match_jax_jit(name, dtype, rng):
    pallaskit.config.update(dynamic_launch="on")
    _check(name, dtype, rng, LONG_SIZES.get(name, SIZES))


@pytest.mark.parametrize("name,num_sms", [("column_sums", 132), ("norm_backward", 132), ("norm_backward", 4)])
def test_eager_split_column_sums_and_mix_kernels(name, num_sms, rng):
    """Column sums over the dynamic rows split at the hint (4096 rows): partial
    sums in column tiles, or (num_sms=4) the norm backward's mix kernel; each
    program walks a runtime count of row blocks."""
    pallaskit.config.update(dynamic_launch="on", multi_kernel_hints="4096", num_sms=num_sms)
    f = _check(name, jnp.float32, rng, sizes=(1, 7, 70))
    kinds = [k.kind for k in pallaskit.explain(f, *CASES[name][2](7, jnp.float32, rng)).kernels]
    assert "mix" in kinds, kinds


@pytest.mark.parametrize("name", ["mlp", "mlp_erf"])
def test_eager_matmul_template_with_epilogue(name, rng):
    # bf16: mode 'auto' gives float32 products to XLA (not eager); 'fused' runs the template in float32 too
    pallaskit.config.update(dynamic_launch="on")
    _check(name, BF16, rng, sizes=(1, 37, 130))
    pallaskit.config.update(matmul_template="fused")
    _check(name, jnp.float32, rng, sizes=(5, 70))



def test_the_templates_k_loop_takes_its_trip_count_at_launch(rng):
    """[Note: the K loop's trip count at run time]: the raw-Triton template's K
    loop runs to a launch argument, not a literal ptxas would unroll; values
    match jax.jit inside the XLA program (a static M, and the K tail masked) and
    in eager launches of a dynamic M; one K step keeps its literal."""
    def mlp(x, w1, w2):
        return jax.nn.gelu(x @ w1, approximate=True) @ w2

    x, w1, w2 = _normal(rng, (40, 300), BF16), _normal(rng, (300, 72), BF16, 0.1), _normal(rng, (72, 24), BF16, 0.2)
    with pallaskit.config.override(kernel_backend="triton"):
        sources = [k.source for k in pallaskit.explain(mlp, x, w1, w2).kernels]
        assert len(sources) == 2, sources
        loops = sorted(line.strip() for src in sources for line in src.splitlines() if "for step in" in line)
        assert loops == ["for step in range(0, K_STEPS):", "for step in range(0, K_STEPS):"] or \
            loops == ["for step in range(0, 1):", "for step in range(0, K_STEPS):"], loops
        params = [line for src in sources for line in src.splitlines() if line.startswith("def ")]
        assert any("K_STEPS," in line for line in params), params  # a kernel parameter
        np.testing.assert_allclose(np.asarray(pallaskit.jit(mlp)(x, w1, w2), np.float32),
                                   np.asarray(jax.jit(mlp)(x, w1, w2), np.float32), **MATMUL_TOL[np.dtype(BF16)])
    pallaskit.config.update(dynamic_launch="on")
    f = pallaskit.jit(mlp, dynamic={"x": {0: "n"}})
    for n in (3, 70):
        xn = _normal(rng, (n, 300), BF16)
        before = metrics.counters["eager_launches"]
        got = f(xn, w1, w2)
        assert metrics.counters["eager_launches"] == before + 1
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(jax.jit(mlp)(xn, w1, w2), np.float32),
                                   **MATMUL_TOL[np.dtype(BF16)])

@pytest.mark.parametrize("tier_up", ["static", "variant"])
def test_one_kernel_compile_serves_every_size_and_a_recurring_size_tiers_up(tier_up, rng):
    pallaskit.config.update(dynamic_launch="on", dynamic_tier_up=tier_up)
    fn, dynamic, make = CASES["softmax"]
    f = pallaskit.jit(fn, dynamic=dynamic)
    args = {n: make(n, jnp.float32, rng) for n in (3, 50, 200)}
    for n in (3, 50, 200):
        assert_close(f(*args[n]), jax.jit(fn)(*args[n]))
    compiled = metrics.counters["kernels_compiled"]
    assert metrics.counters["eager_launches"] == 3 and metrics.counters["graphs_compiled"] == 1
    dispatcher = next(iter(f._sym.values())).executable
    assert not dispatcher.chosen and not dispatcher.static
    f(*args[50])  # the size recurs: still eager, its compile runs in the background
    assert metrics.counters["eager_launches"] == 4
    pallaskit.wait_compiles()
    if tier_up == "static":  # the size's own static program, compiled as without dynamic=
        assert list(dispatcher.static) == [(50,)] and not dispatcher.chosen
        assert metrics.counters["graphs_compiled"] == 2
        # filed under the call's own keys: the size's later calls skip the dispatcher
        assert sum(e.executable is not dispatcher for e in f._fast.values()) == 1
    else:  # the multi-kernel choice, compiled by XLA for this size: no new kernel
        assert list(dispatcher.chosen) == [(50,)] and not dispatcher.static
        assert metrics.counters["kernels_compiled"] == compiled
    assert_close(f(*args[50]), jax.jit(fn)(*args[50]))  # now compiled, not eager
    assert_close(f(*args[3]), jax.jit(fn)(*args[3]))
    assert metrics.counters["eager_launches"] == 5  # n=3 is still eager (seen twice now: compiling)



def test_a_tier_up_does_not_repeat_the_sizes_donation_warning(rng):
    """A recurring size's static program (tier-up, in the background) lowers
    with donation, for which jax warns of the unusable donated buffers; the
    size's eager call warned of them already, and jax.jit warns once per size,
    so the tier-up's lowering does not warn again (a GPU warned twice)."""
    import warnings

    def flat_out(x, y):  # x goes to the flat output (its element count); y is unusable
        return (x + y).reshape(-1)

    pallaskit.config.update(dynamic_launch="on", dynamic_tier_up="static")
    jf = pallaskit.jit(flat_out, donate_argnums=(0, 1), dynamic={"x": {0: "n"}, "y": {0: "n"}})
    ref = jax.jit(flat_out, donate_argnums=(0, 1))
    for n in (6, 6, 6):
        x, y = (_normal(rng, (n, 3), jnp.float32) for _ in range(2))
        x2, y2 = jnp.copy(x), jnp.copy(y)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            out = jf(x, y)
            pallaskit.wait_compiles()  # the tier-up's compile, started by the second call
        with warnings.catch_warnings(record=True) as want:
            warnings.simplefilter("always")
            expected = ref(x2, y2)
        assert_close(out, expected)
        assert (x.is_deleted(), y.is_deleted()) == (x2.is_deleted(), y2.is_deleted()), n
        assert [str(w.message) for w in got if "donated" in str(w.message)] == [str(w.message) for w in want], n
    assert (6,) in next(iter(jf._sym.values())).executable.static  # the tier-up ran

def test_unrenderable_programs_keep_their_xla_path(rng, caplog):
    pallaskit.config.update(dynamic_launch="on")

    def sort_rows(x):
        return jnp.sort(x, axis=-1) * 2.0  # sort runs through XLA: no eager program

    f = pallaskit.jit(sort_rows, dynamic={"x": {0: "n"}})
    for n in (4, 9):
        x = _normal(rng, (n, 16), jnp.float32)
        assert_close(f(x), jax.jit(sort_rows)(x))
    assert metrics.counters["eager_launches"] == 0


def test_dynamic_launch_off_and_auto_on_the_cpu(rng):
    fn, dynamic, make = CASES["softmax"]
    args = make(11, jnp.float32, rng)
    for mode in ("off", "auto"):  # auto: only on a GPU
        if mode == "auto" and jax.default_backend() == "gpu":
            continue
        pallaskit.config.update(dynamic_launch=mode)
        assert_close(pallaskit.jit(fn, dynamic=dynamic)(*args), jax.jit(fn)(*args))
        assert metrics.counters["eager_launches"] == 0
    with pytest.raises(ValueError, match="dynamic_launch"):
        pallaskit.config.update(dynamic_launch="sometimes")


def test_forced_variant_out_of_range_still_raises(rng):
    pallaskit.config.update(dynamic_launch="on", multi_kernel_force=7)
    fn, dynamic, make = CASES["long_rows"]
    f = pallaskit.jit(fn, dynamic=dynamic)
    with pytest.raises(ValueError, match="multi_kernel_force=7"):
        f(*make(3, jnp.float32, rng))


def test_background_failure_is_logged_and_the_size_stays_eager(rng, caplog, monkeypatch):
    pallaskit.config.update(dynamic_launch="on")
    fn, dynamic, make = CASES["pointwise_broadcast"]
    f = pallaskit.jit(fn, dynamic=dynamic)
    args = make(6, jnp.float32, rng)
    f(*args)
    dispatcher = next(iter(f._sym.values())).executable

    def broken(*a):
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(dispatcher, "compile_static", broken)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        f(*args)
        pallaskit.wait_compiles()
    assert "no compiler today" in caplog.text and not dispatcher.chosen
    assert_close(f(*args), jax.jit(fn)(*args))
    assert metrics.counters["eager_launches"] == 3


def test_generated_source_is_readable(rng):
    pallaskit.config.update(dynamic_launch="on")
    fn, dynamic, make = CASES["mlp"]
    f = pallaskit.jit(fn, dynamic=dynamic)
    f(*make(9, BF16, rng))
    source = next(iter(f._sym.values())).executable.eager.source
    assert "@triton.jit" in source and "def launch(run, kernels," in source
    assert "# epilogue:" in source and "= tanh" in source  # the jaxpr equations each kernel came from
    assert "tl.dot(" in source and "n = arg0.shape[0]" in source


def test_numpy_and_scalar_leaves_run_eagerly(rng):
    pallaskit.config.update(dynamic_launch="on")

    def scaled(x, s):
        return x * s + 1.0

    f = pallaskit.jit(scaled, dynamic={"x": {0: "n"}})
    for n in (2, 9):
        x = rng.standard_normal((n, 12)).astype(np.float32)
        assert_close(f(x, 3.0), jax.jit(scaled)(x, 3.0))
    assert metrics.counters["eager_launches"] == 2


def test_eager_outputs_are_committed_as_jax_jits(rng):
    """An eager call's outputs are committed to their device only where an
    argument is, as jax.jit's: a loop feeding them back then keeps the
    signature it had (an uncommitted call and a committed one are two)."""
    pallaskit.config.update(dynamic_launch="on")
    f = pallaskit.jit(lambda x, y: (x * 2 + y, jnp.sum(x, axis=1)), dynamic={"x": {0: "n"}, "y": {0: "n"}})
    jf = jax.jit(lambda x, y: (x * 2 + y, jnp.sum(x, axis=1)))
    for n, commit in ((3, False), (5, False), (7, True)):
        x, y = _normal(rng, (n, 6), jnp.float32), _normal(rng, (n, 6), jnp.float32)
        if commit:
            y = jax.device_put(y, jax.devices()[0])
        before = metrics.counters["eager_launches"]
        got, want = f(x, y), jf(x, y)
        assert metrics.counters["eager_launches"] == before + 1
        for g, w in zip(got, want):
            assert g.committed == w.committed == commit
            assert_close(g, w)


def test_size_used_as_a_value(rng):
    """``x.shape[0]`` as a value (dim_as_value) is the runtime size, not a mask."""
    pallaskit.config.update(dynamic_launch="on")
    f = pallaskit.jit(lambda x: x * x.shape[0] + x.shape[1], dynamic={"x": {0: "n"}})
    for n in (3, 11, 40):
        x = _normal(rng, (n, 5), jnp.float32)
        assert_close(f(x), x * n + 5)
    assert metrics.counters["eager_launches"] == 3


def test_square_dynamic_sizes(rng):
    """A square array's size is n**2: Triton's tensors have no ``**``, so index
    and extent source writes it as a product (the kernel raised TypeError)."""
    def fn(x):
        return jnp.trace(x), jnp.diag(x) * 2, x.T + x

    with pallaskit.config.override(kernel_backend="triton"):
        f = pallaskit.jit(fn)
        for n in (4, 6, 7, 1, 6):
            x = _normal(rng, (n, n), jnp.float32)
            for got, want in zip(f(x), jax.jit(fn)(x)):
                assert_close(got, want)


def _softmax_f(x, w):
    return jax.nn.softmax(x * w, axis=-1)


def test_eager_program_cache_serves_a_new_function_object_without_the_compiler(rng, tmp_path, caplog):
    """[Note: eager program cache]: a second pallaskit.jit of the same function
    (a new process's) reads the eager program from disk; a torn file is logged
    and rewritten; a traced call on a cached entry compiles the graph in full."""
    pallaskit.config.update(dynamic_launch="on")
    args = {n: (_normal(rng, (n, 100), jnp.float32), _normal(rng, (100,), jnp.float32)) for n in (4, 33)}
    first = pallaskit.jit(_softmax_f, dynamic={"x": {0: "n"}})
    assert_close(first(*args[4]), _softmax_f(*args[4]))
    folder = os.path.join(pallaskit.cache.cache_dir(), "eager")
    files = os.listdir(folder)
    assert len(files) == 1 and metrics.counters["eager_cache_hits"] == 0
    graphs = metrics.counters["graphs_compiled"]
    second = pallaskit.jit(_softmax_f, dynamic={"x": {0: "n"}})
    for n in (33, 4):
        assert_close(second(*args[n]), _softmax_f(*args[n]))
    assert metrics.counters["eager_cache_hits"] == 1 and metrics.counters["graphs_compiled"] == graphs
    # under jax.jit the eager program cannot run: the graph compiles in full, on first need
    assert_close(jax.jit(second)(*args[33]), _softmax_f(*args[33]))
    fresh = (_normal(rng, (50, 100), jnp.float32), args[4][1])  # a size never called: explain runs the compiler
    assert "kernel" in str(pallaskit.explain(second, *fresh))
    path = os.path.join(folder, files[0])
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:-10])
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        third = pallaskit.jit(_softmax_f, dynamic={"x": {0: "n"}})
        assert_close(third(*args[4]), _softmax_f(*args[4]))
    assert "ignoring the eager program" in caplog.text and metrics.counters["eager_cache_hits"] == 1
    assert open(path, "rb").read() == data  # rewritten whole


def test_eager_program_with_constants_is_not_kept(rng, tmp_path, caplog):
    """A nested jax.jit's closed-over array is none of the traced graph's
    ``consts``, yet a constant of its program: its eager program was kept, and
    a second process's hit launched it without that constant ("launch() missing
    1 required positional argument: 'const2'"), then ran through XLA."""
    pallaskit.config.update(dynamic_launch="on")
    scale = jax.jit(lambda x: x * np.linspace(0.5, 2.0, 100).astype(np.float32))

    def fn(x, w):
        return jax.nn.softmax(scale(x) * w, axis=-1)

    args = {n: (_normal(rng, (n, 100), jnp.float32), _normal(rng, (100,), jnp.float32)) for n in (4, 33)}
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        for _ in range(2):  # the second: a new process's function, were its program kept
            f = pallaskit.jit(fn, dynamic={"x": {0: "n"}})
            for n in (4, 33):
                assert_close(f(*args[n]), fn(*args[n]))
    assert not os.path.isdir(os.path.join(pallaskit.cache.cache_dir(), "eager"))
    assert metrics.counters["eager_cache_hits"] == 0 and "eager launch failed" not in caplog.text


def test_a_warm_process_serves_new_sizes_without_importing_the_compiler(tmp_path):
    script = textwrap.dedent("""
        import sys
        import jax, jax.numpy as jnp, numpy as np
        import pallaskit
        pallaskit.config.update(dynamic_launch="on", cache_dir=sys.argv[1])
        f = pallaskit.jit(lambda x, w: jax.nn.softmax(x * w, axis=-1), dynamic={"x": {0: "n"}})
        for n in (3, 17, 40):
            x = jnp.asarray(np.random.default_rng(n).standard_normal((n, 24)), jnp.float32)
            np.testing.assert_allclose(f(x, jnp.ones(24)), jax.nn.softmax(x, axis=-1), rtol=1e-5, atol=1e-6)
        c = pallaskit.metrics.counters
        heavy = [m for m in ("sympy", "lowering.scheduler", "jax.experimental.pallas") if m in sys.modules]
        print("RESULT", c["eager_cache_hits"], c["eager_launches"], c["graphs_compiled"], heavy)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    outs = [subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    for o in outs:
        assert o.returncode == 0, o.stderr[-3000:]
    results = [next(line for line in o.stdout.splitlines() if line.startswith("RESULT")) for o in outs]
    # The first process compiles (its compiler import may also bring the Pallas interpreter: [Note:
    # compiler preload]); the second starts no preload for a function it ran ([Note: function markers]).
    assert results[0].startswith("RESULT 0 3 1 ['sympy', 'lowering.scheduler'"), outs[0].stderr[-2000:]
    assert results[1] == "RESULT 1 3 0 []", outs[1].stderr[-2000:]


def test_a_failing_eager_launch_falls_back_to_xla(rng, caplog):
    """An eager call that raises (a launch or Triton compile error) is logged and the
    program takes its XLA path from then on: the call still returns jax.jit's result."""
    pallaskit.config.update(dynamic_launch="on")
    fn, dynamic, make = CASES["softmax"]
    f = pallaskit.jit(fn, dynamic=dynamic)
    f(*make(5, jnp.float32, rng))
    dispatcher = next(iter(f._sym.values())).executable

    class Broken:
        from_cache, kernels = True, {}

        def __call__(self, *args):
            raise pallaskit.runtime.triton_launch.LaunchError("argument 'in_ptr0' is not 16-byte aligned")

    dispatcher.eager = Broken()
    args = make(9, jnp.float32, rng)
    with caplog.at_level(logging.WARNING, logger="pallaskit"):
        assert_close(f(*args), jax.jit(fn)(*args))
    assert "eager launch failed" in caplog.text and dispatcher.eager is None
    args = make(12, jnp.float32, rng)
    assert_close(f(*args), jax.jit(fn)(*args))



def test_a_deleted_argument_keeps_eager_launches_on(rng):
    """An array donated earlier and passed again fails its eager launch: that is
    the caller's error, raised as jax.jit raises it; the program's later sizes
    still launch eagerly (the failure used to turn them off for good)."""
    pallaskit.config.update(dynamic_launch="on")
    f = pallaskit.jit(lambda x: x * 2.0 + 1.0, donate_argnums=0)
    for n in (3, 5):
        f(jnp.asarray(rng.standard_normal((n, 4)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((7, 4)), jnp.float32)
    x.delete()
    with pytest.raises((ValueError, RuntimeError), match="deleted"):
        f(x)
    launches = metrics.counters["eager_launches"]
    x = jnp.asarray(rng.standard_normal((9, 4)), jnp.float32)
    assert_close(f(jnp.array(x, copy=True)), x * 2.0 + 1.0)
    assert metrics.counters["eager_launches"] == launches + 1

def test_a_raw_triton_program_does_not_import_pallas_triton_module(tmp_path):
    """A program whose kernels are all raw Triton does not import
    ``jax.experimental.pallas.triton`` (0.1 s of a cold first call, its GPU
    dialect bindings); a program with a Pallas kernel still does. Both agree
    with jax.jit, special values included."""
    script = textwrap.dedent("""
        import sys
        import jax, jax.numpy as jnp, numpy as np
        import pallaskit
        pallaskit.config.update(kernel_backend=sys.argv[1], cache=False)
        x = np.random.default_rng(7).standard_normal((37, 129)).astype(np.float32)
        x[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
        for dtype in (jnp.float32, jnp.bfloat16):
            fn = lambda x: (jnp.tanh(x) * 2 + 1, jnp.sum(x * x, axis=-1))
            got, want = pallaskit.jit(fn)(jnp.asarray(x, dtype)), jax.jit(fn)(jnp.asarray(x, dtype))
            for g, w in zip(got, want):
                bf16 = dtype == jnp.bfloat16  # outputs up to 3 (tanh * 2 + 1): a bfloat16 ulp there is 1/64
                np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                           rtol=2e-2 if bf16 else 1e-5, atol=2e-2 if bf16 else 1e-5)
        print("RESULT", "jax.experimental.pallas.triton" in sys.modules)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    for backend, imported in (("triton", False), ("pallas", True)):
        out = subprocess.run([sys.executable, "-c", script, backend], capture_output=True, text=True, env=env,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"RESULT {imported}" in out.stdout, (backend, out.stdout[-500:], out.stderr[-2000:])
