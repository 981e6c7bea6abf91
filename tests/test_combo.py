"""Combo kernels ([Note: combo kernels] in lowering/combo.py): independent
kernels over different shapes in one launch, against jax.jit, in the Pallas
renderer (interpret mode) and the raw Triton renderer (Triton's interpreter)."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close
from lowering import combo, ir
from lowering.options import CompileOptions

BF16 = jnp.bfloat16
SHAPES = [(64,), (32, 16), (1,), (3, 5), (2500, 3), (17,), (8, 8, 4)]  # 7500: several programs of one member


def _combos(e):
    return [k for k in e.kernels if k.kind == "combo"]


def _special(rng, shape, dtype):
    """Normal values with NaN, +-inf and +-0 sprinkled in (floats)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if x.size >= 4:
        flat = x.reshape(-1)
        idx = rng.choice(flat.size, size=4, replace=False)
        flat[idx] = [np.nan, np.inf, -np.inf, -0.0]
    return jnp.asarray(x, dtype)


def _mixed(a, b, c, d, e, n):
    """Members with different numbers of inputs and outputs, shapes and dtypes;
    a sum, a max and a (NaN-propagating) min beside pointwise work."""
    return (a * 2.0 + 1.0,
            jnp.maximum(b, c) - b * c, jnp.tanh(b),
            jnp.sum(c), jnp.max(d, axis=-1),
            jnp.where(e > 0, e, 0.5 * e), jnp.min(e),
            n * 3 + 1, n // 2)


def _mixed_args(rng, dtype):
    return (_special(rng, (1,), dtype), _special(rng, (37, 5), dtype), _special(rng, (37, 5), dtype),
            _special(rng, (9, 300), dtype), _special(rng, (3001,), dtype),
            jnp.asarray(rng.integers(-50, 50, (13,)), jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_mixed_members_match_jax_jit(dtype, rng):
    args = _mixed_args(rng, dtype)
    e = pallaskit.explain(_mixed, *args)
    assert _combos(e), [k.name for k in e.kernels]
    assert max(len(k.members) for k in _combos(e)) >= 4
    got, want = pallaskit.jit(_mixed)(*args), jax.jit(_mixed)(*args)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        assert_close(g, w, dtype)


def test_size_one_and_empty_arrays(rng):
    def f(a, b, c, d):
        return a + 1.0, b * 2.0, jnp.sum(c), d - 1, jnp.sum(b)

    args = (jnp.zeros((0,), jnp.float32), jnp.asarray(rng.standard_normal((1, 1)), jnp.float32),
            jnp.asarray(rng.standard_normal((1,)), BF16), jnp.asarray([7], jnp.int32))
    got, want = pallaskit.jit(f)(*args), jax.jit(f)(*args)
    for g, w in zip(got, want):
        assert_close(g, w, w.dtype)
    assert _combos(pallaskit.explain(f, *args))


def test_option_off_gives_separate_kernels_and_the_same_results(rng):
    args = _mixed_args(rng, jnp.float32)
    on = pallaskit.explain(_mixed, *args)
    with pallaskit.config.override(combo_kernels=False):
        off = pallaskit.explain(_mixed, *args)
    assert not _combos(off)
    assert len(on.kernels) < len(off.kernels)
    members = sorted(m.name for k in on.kernels for m in (k.members or [k]))
    assert members == sorted(k.name for k in off.kernels)
    assert "combo_kernels" in pallaskit.config.help()
    assert CompileOptions().combo_kernels


# --------------------------------------------------------------------------- #
# Optimizers over pytrees
# --------------------------------------------------------------------------- #
LR, B1, B2, EPS, WD = 1e-3, 0.9, 0.999, 1e-8, 1e-2


def sgd_momentum(params, grads, mom):
    mom = jax.tree.map(lambda m, g: 0.9 * m + g, mom, grads)
    return jax.tree.map(lambda p, m: p - LR * m, params, mom), mom


def adam(params, grads, mu, nu, count, weight_decay=0.0):
    count = count + 1
    mu = jax.tree.map(lambda m, g: B1 * m + (1 - B1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: B2 * v + (1 - B2) * jnp.square(g), nu, grads)
    c = count.astype(jnp.float32)
    bc1, bc2 = 1 - B1 ** c, 1 - B2 ** c
    new = jax.tree.map(lambda p, m, v: p - LR * ((m / bc1) / (jnp.sqrt(v / bc2) + EPS) + weight_decay * p),
                       params, mu, nu)
    return new, mu, nu, count


def adamw(params, grads, mu, nu, count):
    return adam(params, grads, mu, nu, count, weight_decay=WD)


def lion(params, grads, mu):
    upd = jax.tree.map(lambda m, g: jnp.sign(B1 * m + (1 - B1) * g), mu, grads)
    mu = jax.tree.map(lambda m, g: 0.99 * m + 0.01 * g, mu, grads)
    return jax.tree.map(lambda p, u: p - LR * (u + WD * p), params, upd), mu


def clipped_adamw(params, grads, mu, nu, count, max_norm=1.0):
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    grads = jax.tree.map(lambda g: jnp.where(norm < max_norm, g, g / norm * max_norm), grads)
    return adamw(params, grads, mu, nu, count)


SMALL = [(64,), (3, 5), (2500, 3), (1,), (8, 8, 4)]  # the optimizers run in interpret mode: fewer arrays


def _tree(rng, shapes, positive=False):
    out = {}
    for i, s in enumerate(shapes):
        x = rng.standard_normal(s).astype(np.float32)
        out[f"w{i}"] = jnp.asarray(np.abs(x) if positive else x)
    return out


OPTIMIZERS = {
    "sgd_momentum": (sgd_momentum, lambda r: (_tree(r, SMALL), _tree(r, SMALL), _tree(r, SMALL))),
    "adam": (adam, lambda r: (_tree(r, SMALL), _tree(r, SMALL), _tree(r, SMALL), _tree(r, SMALL, True),
                              jnp.asarray(4, jnp.int32))),
    "adamw": (adamw, lambda r: (_tree(r, SHAPES), _tree(r, SHAPES), _tree(r, SHAPES), _tree(r, SHAPES, True),
                                jnp.asarray(4, jnp.int32))),
    "lion": (lion, lambda r: (_tree(r, SMALL), _tree(r, SMALL), _tree(r, SMALL))),
    "clipped_adamw": (clipped_adamw, lambda r: (_tree(r, SHAPES), _tree(r, SHAPES), _tree(r, SHAPES),
                                                _tree(r, SHAPES, True), jnp.asarray(4, jnp.int32))),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_updates_over_a_pytree(name, rng):
    fn, make = OPTIMIZERS[name]
    args = make(rng)
    e = pallaskit.explain(fn, *args)
    # 7 arrays of 7 shapes: a kernel per shape (and level) alone, a handful of launches as combos.
    assert len(e.kernels) <= (4 if name == "clipped_adamw" else 2), [k.name for k in e.kernels]
    assert sum(len(k.members) for k in _combos(e)) >= len(jax.tree.leaves(args[0]))
    if name == "sgd_momentum":  # the parameter update reads the new momentum from the value it stores, no reload
        assert len(e.kernels) == 1, [k.name for k in e.kernels]
    got, want = pallaskit.jit(fn)(*args), jax.jit(fn)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("cap, arrays, sizes", [(8, 18, [6, 6, 6]), (8, 17, [6, 6, 5]), (8, 16, [8, 8]),
                                                 (5, 11, [4, 4, 3])])
def test_launches_share_a_level_evenly(cap, arrays, sizes, rng, monkeypatch):
    """[Note: balanced packs]: as many combo launches as the member cap needs,
    the members spread evenly over them (not 8, 8, 2); values as jax.jit's."""
    from lowering import heuristics

    monkeypatch.setattr(heuristics, "COMBO_MAX_MEMBERS", cap)
    shapes = [(3 + i % 4, 5 + i) for i in range(arrays)]

    def upd(ps, gs):
        return [p - 1e-2 * g for p, g in zip(ps, gs)]

    trees = [[jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes] for _ in range(2)]
    e = pallaskit.explain(upd, *trees)
    assert sorted((len(k.members) for k in _combos(e)), reverse=True) == sizes, [k.name for k in e.kernels]
    for g, w in zip(pallaskit.jit(upd)(*trees), jax.jit(upd)(*trees)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-7)


def _periodic_update(ps, gs, ms):
    ms = [0.9 * m + 0.1 * g for m, g in zip(ms, gs)]
    return [p - 1e-2 * (m + 0.1 * p) for p, m in zip(ps, ms)], ms


PERIODIC = [(3, 5), (4,), (2, 2)] * 8  # a "model" of 8 layers of 3 arrays


@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_launches_keep_a_repeating_pytree_in_phase(backend, rng, monkeypatch):
    """[Note: periodic packs]: 24 arrays repeating 3 shapes under a cap of 9
    members launch as 9, 9, 6 (whole periods), not 8, 8, 8: the two launches
    of 9 are one kernel, written and compiled once; values as jax.jit's."""
    from lowering import heuristics

    monkeypatch.setattr(heuristics, "COMBO_MAX_MEMBERS", 9)
    trees = [[_special(rng, s, jnp.float32) for s in PERIODIC] for _ in range(3)]
    want = jax.tree.leaves(jax.jit(_periodic_update)(*trees))
    if backend == "pallas":
        with pallaskit.config.override(kernel_backend="pallas"):
            e = pallaskit.explain(_periodic_update, *trees)
            got = jax.tree.leaves(pallaskit.jit(_periodic_update)(*trees))
        assert [len(k.members) for k in _combos(e)] == [9, 9, 6], [k.name for k in e.kernels]
        assert re.search(r"^combo_1 = combo_0\b", e.source, flags=re.M), e.source[-3000:]
    else:
        import lowering  # the raw-Triton program inside XLA, as a GPU renders it

        options = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True, num_sms=132)
        source = lowering.compile_jaxpr(jax.make_jaxpr(_periodic_update)(*trees), options).program.source
        assert "# combo_0_kernel runs for 2 launches: combo_0, combo_1" in source, source[-3000:]
        assert len(re.findall(r"^def combo_\d+_kernel\(", source, flags=re.M)) == 2
        if jax.default_backend() == "cpu":
            _, got = _triton_run(_periodic_update, tuple(trees))
        else:
            with pallaskit.config.override(kernel_backend="triton"):
                got = jax.tree.leaves(pallaskit.jit(_periodic_update)(*trees))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g).reshape(w.shape), w, rtol=2e-6, atol=1e-7)


def test_global_norm_is_one_reduction_launch_and_its_finisher(rng):
    """Sums of squares of every gradient: one launch of row reductions (each
    member's programs write its partial sums), one launch that finishes them."""
    shapes = [(300, 300), (70000,), (64,), (3, 5), (1,), (1000, 17)]  # the two large ones split into partials
    grads = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]

    def global_norm(*gs):
        return jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in gs))

    e = pallaskit.explain(global_norm, *grads)
    reductions = [k for k in e.kernels if k.kind in ("reduction", "combo")]
    assert len(reductions) <= 3, str(e).split("schedule:")[0]
    first = _combos(e)[0]  # the (1,) gradient's square needs no reduction
    assert len(first.members) == len(shapes) - 1 and all(m.kind == "reduction" for m in first.members)
    assert_close(pallaskit.jit(global_norm)(*grads), jax.jit(global_norm)(*grads), jnp.float32)


def test_300_array_adamw_compiles_to_at_most_4_kernels():
    """Rendered only: running 300 arrays in interpret mode is slow, the small
    pytree tests above check the values."""
    from benchmarks.compile_time import SHAPES as CT_SHAPES, adamw as ct_adamw

    n = 300
    tree = [jnp.zeros(CT_SHAPES[i % len(CT_SHAPES)], jnp.float32) for i in range(n)]
    e = pallaskit.explain(ct_adamw, tree, tree, tree, tree, jnp.asarray(0, jnp.int32))
    assert len(e.kernels) <= 4, [(k.name, len(k.members)) for k in e.kernels]
    assert sum(len(k.members) or 1 for k in e.kernels) >= 8


# --------------------------------------------------------------------------- #
# Legality
# --------------------------------------------------------------------------- #
def test_dependent_kernels_stay_apart(rng):
    """A reduction and the kernel reading it are at different levels; so are
    two kernels joined only through an XLA op between them."""
    def f(x, y, z):
        s = jnp.sum(x)  # level 0
        a = y * s  # level 1: reads s
        b = jnp.sort(z * 2.0)  # z * 2 at level 0, the sort (XLA) at 1
        return a, b + 1.0, jnp.tanh(z)  # b + 1 at level 2

    args = (jnp.asarray(rng.standard_normal((50, 3)), jnp.float32), jnp.asarray(rng.standard_normal((7,)), jnp.float32),
            jnp.asarray(rng.standard_normal((11,)), jnp.float32))
    e = pallaskit.explain(f, *args)
    for k in _combos(e):
        names = {m for ks in k.members for m in ks.equations}
        assert not any("sort" in eq for eq in names)
    sched = pallaskit.api.JitFunction(f).lower_to_result(*args).result.schedule
    steps = sched.steps
    levels = combo.levels(steps)
    for s, lvl in zip(steps, levels):  # every dependency of a step lies in a lower level, and before it
        for t, tl in zip(steps, levels):
            if t is s:
                break
            writes = {m.name for m in t.members} if hasattr(t, "members") else set(t.outputs)
            reads = set(s.reads) if hasattr(s, "members") else set(s.reads())
            if writes & reads:
                assert tl < lvl
    got, want = pallaskit.jit(f)(*args), jax.jit(f)(*args)
    for g, w in zip(got, want):
        assert_close(g, w)


def test_levels_respect_effects_and_chains():
    k = lambda name, reads, writes: type("S", (), {"reads": lambda self: reads, "name": name,  # noqa: E731
                                                     "outputs": writes, "effectful": name.startswith("fx")})()
    steps = [k("a", [], ["a"]), k("fx1", [], []), k("b", ["a"], ["b"]), k("fx2", [], []), k("c", [], ["c"])]
    assert combo.levels(steps) == [0, 0, 1, 1, 0]


@pytest.mark.pallas_source
def test_generated_source_names_each_members_equations(rng):
    args = _mixed_args(rng, jnp.float32)
    e = pallaskit.explain(_mixed, *args)
    k = _combos(e)[0]
    assert "pl.when(" in k.source
    for i, m in enumerate(k.members):
        assert f"# member {i}: {m.name}" in k.source
        assert f"def {k.name}_part{i}(pid" in k.source
        assert m.equations and all(f"#   {eq}" in k.source for eq in m.equations)
    text = str(e)
    assert "member 0:" in text and "combo" in text


# --------------------------------------------------------------------------- #
# The raw Triton renderer (Triton's interpreter on the CPU)
# --------------------------------------------------------------------------- #
def _triton_run(fn, args):
    pytest.importorskip("triton")
    from lowering.codegen import triton as triton_codegen
    from pallaskit.api import JitFunction, compile_options
    from pallaskit.runtime.eager import EagerProgram

    sched = JitFunction(fn).lower_to_result(*args).result.schedule
    assert any(k.kind == "combo" for k in sched.kernels)
    prog = triton_codegen.render(sched, compile_options())
    run = EagerProgram(prog.source, [(k.name, k.num_warps, k.num_stages) for k in prog.kernels], True, ())
    return prog, run(*jax.tree.leaves(args))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="Triton's interpreter runs these on the CPU")
@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_triton_renderer_runs_combos(dtype, rng):
    def f(a, b, c, d, n):
        return (a * 2.0 + 1.0, jnp.maximum(b, c) - b * c, jnp.sum(c), jnp.max(d, axis=-1),
                jnp.where(a > 0, a, -a), n * 3 + 1)

    args = (_special(rng, (3001,), dtype), _special(rng, (37, 5), dtype), _special(rng, (37, 5), dtype),
            _special(rng, (9, 300), dtype), jnp.asarray(rng.integers(-50, 50, (13,)), jnp.int32))
    prog, got = _triton_run(f, args)
    assert "elif pid <" in prog.source and "@triton.jit\ndef combo_" in prog.source
    for g, w in zip(got, jax.jit(f)(*args)):
        assert_close(np.asarray(g).reshape(w.shape), w, dtype)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="Triton's interpreter runs these on the CPU")
def test_triton_renderer_runs_a_clipped_update(rng):
    def upd(ps, gs, ms):
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in gs))
        gs = [jnp.where(norm < 1.0, g, g / norm) for g in gs]
        ms = [0.9 * m + 0.1 * g for m, g in zip(ms, gs)]
        return [p - 1e-2 * (m + 0.1 * p) for p, m in zip(ps, ms)], ms

    trees = [[jnp.asarray(rng.standard_normal(s), jnp.float32) for s in SHAPES] for _ in range(3)]
    _, got = _triton_run(upd, tuple(trees))
    for g, w in zip(got, jax.tree.leaves(jax.jit(upd)(*trees))):
        np.testing.assert_allclose(np.asarray(g).reshape(w.shape), w, rtol=2e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="Triton's interpreter runs these on the CPU")
def test_triton_combo_shares_one_function_per_member_code(rng):
    """Members with the same code (an update of arrays of any shape) run one
    non-inlined part function ([Note: combo compile time]), one per class of
    gcd(width, 16) ([Note: combo part extents]); the values stay each array's
    own, repeated shapes, odd sizes and size 1 included."""
    shapes = [(1,), (7, 3), (1000,), (7, 3), (1000,), (1,), (7, 3), (1000,), (33, 65), (48,), (2, 8)]

    def upd(ps, gs, ms):
        ms = [0.9 * m + 0.1 * g for m, g in zip(ms, gs)]
        return [p - 1e-2 * (m + 0.1 * p) for p, m in zip(ps, ms)], ms

    trees = [[jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes] for _ in range(3)]
    trees[1][2] = trees[1][2].at[:3].set(jnp.asarray([jnp.nan, jnp.inf, -0.0]))
    prog, got = _triton_run(upd, tuple(trees))
    functions = re.findall(r"@triton.jit\(noinline=True\)\ndef (combo_\d+_part\d+)\(", prog.source)
    members = re.findall(r"^# member \d+: ", prog.source, flags=re.M)
    # a scalar's own code, then one function per class: {1, 8, 16}: seven sizes in four functions
    classes = {math.gcd(math.prod(s), 16) if math.prod(s) > 1 else "scalar" for s in shapes}
    assert len(members) == len(shapes) and len(functions) == len(classes), (functions, len(members))
    for g, w in zip(got, jax.tree.leaves(jax.jit(upd)(*trees))):
        np.testing.assert_allclose(np.asarray(g).reshape(w.shape), w, rtol=2e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="Triton's interpreter runs these on the CPU")
@pytest.mark.parametrize("members, group_past", [(13, 3), (40, None)])
def test_triton_combo_dispatches_through_member_groups(members, group_past, rng, monkeypatch):
    """[Note: combo dispatch groups]: past ``COMBO_DISPATCH_GROUP`` members the
    kernel branches over groups of members (a last group of one member called
    directly), each group over its own; every member still gets its own
    programs and values: repeated shapes, odd sizes, size 1, several programs
    of one member, NaN / inf / -0."""
    from lowering import heuristics

    if group_past is not None:
        monkeypatch.setattr(heuristics, "COMBO_DISPATCH_GROUP", group_past)
    base = [(1,), (7, 3), (2500, 3), (33, 65), (5,), (2049,), (3, 1, 2)]
    shapes = [base[i % len(base)] for i in range(members)]

    def upd(ps, gs, ms):
        ms = [0.9 * m + 0.1 * g for m, g in zip(ms, gs)]
        return [p - 1e-2 * (m + 0.1 * p) for p, m in zip(ps, ms)], ms

    trees = [[jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes] for _ in range(3)]
    trees[1][2] = trees[1][2].at[0, :3].set(jnp.asarray([jnp.nan, jnp.inf, -0.0]))
    trees[0][5] = trees[0][5].at[-1].set(-jnp.inf)
    prog, got = _triton_run(upd, tuple(trees))
    groups = re.findall(r"@triton.jit\(noinline=True\)\ndef (combo_\d+_group\d+)\(", prog.source)
    size = math.isqrt(members - 1) + 1
    count = -(-members // size)
    alone = members - size * (count - 1) == 1  # a last group of one member is called directly
    assert len(groups) == count - alone, groups
    kernel = prog.source[prog.source.index("@triton.jit\ndef combo_"):].split("\n\n")[0]
    assert kernel.count("pid <") == count - 1, kernel  # the kernel branches over groups only
    assert len(re.findall(r"^# member \d+: ", prog.source, flags=re.M)) == members
    for g, w in zip(got, jax.tree.leaves(jax.jit(upd)(*trees))):
        np.testing.assert_allclose(np.asarray(g).reshape(w.shape), w, rtol=2e-5, atol=1e-6)


def test_combo_is_a_kernel_of_the_schedule():
    """A combo keeps the Kernel interface the wrapper, metrics and loops read."""
    x = ir.InputNode("x", (3,), np.dtype(np.float32))
    assert combo.ComboKernel("c", "combo", 1, 3, [], [], []).parts == []
    assert not combo.can_join(x)


def _schedule(fn, *args):
    import lowering
    from lowering.options import CompileOptions

    closed = jax.make_jaxpr(fn)(*args)
    return lowering.compile_jaxpr(closed, CompileOptions(interpret=True, combo_kernels=True)).schedule


def test_clip_scale_is_stored_once_not_summed_in_every_update(rng):
    """[Note: broadcast tables]: the clip's norm sums 20 arrays' sums of squares; the
    updates load it stored once instead of each summing the 20 again (a part
    function of 20+ arguments per member before). Values as jax.jit."""
    from lowering import heuristics
    from lowering.combo import ComboKernel

    shapes = [(3 + i % 5, 2 + i % 3) for i in range(20)]
    args = (_tree(rng, shapes), _tree(rng, shapes), _tree(rng, shapes), _tree(rng, shapes, True),
            jnp.asarray(3, jnp.int32))
    sched = _schedule(clipped_adamw, *args)
    steps = [p for k in sched.kernels if hasattr(k, "members")
             for p in (k.parts if isinstance(k, ComboKernel) else [k])]
    assert heuristics.MAX_INLINED_READS <= 16
    wide = [s for s in steps if len(s.reads) > 17]
    assert len(wide) <= 1, [(s.name, len(s.reads)) for s in wide]  # the one summing the norm
    got, want = pallaskit.jit(clipped_adamw)(*args), jax.jit(clipped_adamw)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unrelated_reductions_of_one_shape_are_not_one_huge_kernel(rng, dtype):
    """Same-shape reductions that share nothing merge into one kernel to save a
    launch only up to heuristics.HORIZONTAL_MAX_MEMBERS; combos join the rest."""
    from lowering import heuristics
    from lowering.combo import ComboKernel

    xs = [jnp.asarray(rng.standard_normal((5, 33)), dtype) for _ in range(20)]

    def f(*xs):
        return [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in xs]

    sched = _schedule(f, *xs)
    steps = [p for k in sched.kernels if hasattr(k, "members")
             for p in (k.parts if isinstance(k, ComboKernel) else [k])]
    assert heuristics.HORIZONTAL_MAX_MEMBERS <= 8
    assert max(len(s.members) for s in steps) <= 8, [len(s.members) for s in steps]
    assert len(sched.kernels) <= 2
    for g, w in zip(pallaskit.jit(f)(*xs), jax.jit(f)(*xs)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5)


# --------------------------------------------------------------------------- #
# Whole optimizer steps (issue 24's claim, probed with optax): what they found
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("backend", ["pallas", "triton"])
def test_a_row_value_read_only_by_another_row_value_is_written_first(backend, rng):
    """Adam's new count and ``1 - b1 ** count`` both in a reduction kernel (a
    norm beside the update, LAMB): the bias correction is read by the kernel's
    sums, the count only by the correction. The count was never written before
    the sums read the correction (KeyError in both renderers)."""
    def f(x, m, count):
        count = jnp.where(count < 100, count + 1, count)  # an int8 counter: it merges into the sums' kernel
        bc = 1 - jax.lax.pow(jnp.float32(0.9), count)
        u = m / bc
        return x + u * jnp.sum(x * x), count, jnp.sum(u * u), bc

    args = (jnp.asarray(rng.standard_normal((7, 5)), jnp.float32), jnp.asarray(rng.standard_normal((7, 5)), jnp.float32),
            jnp.asarray(3, jnp.int8))
    with pallaskit.config.override(kernel_backend=backend):
        got = pallaskit.jit(f)(*args)
    for g, w in zip(got, jax.jit(f)(*args)):
        assert g.dtype == w.dtype
        assert_close(g, w)


def test_float64_adam_in_raw_triton(rng):
    """An x64 Adam step over a pytree in raw Triton (Triton's interpreter on the
    CPU, compiled on a GPU): a float64 square root is ``tl.sqrt`` (correctly
    rounded); ``tl.sqrt_rn`` takes float32 only (it raised)."""
    with jax.enable_x64(True):
        shapes = [(7, 5), (33,), (1,)]
        params, grads, mu = ([jnp.asarray(rng.standard_normal(s), jnp.float64) for s in shapes] for _ in range(3))
        nu = [jnp.asarray(np.abs(rng.standard_normal(s)), jnp.float64) for s in shapes]
        args = (params, grads, mu, nu, jnp.asarray(2, jnp.int32))
        with pallaskit.config.override(kernel_backend="triton"):
            got = pallaskit.jit(adamw)(*args)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(adamw)(*args))):
            assert g.dtype == w.dtype
            # the bias corrections are float32 (``count.astype(float32)``): XLA:GPU's and
            # libdevice's float32 pow differ by an ulp there, 5e-9 of the float64 update
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-7, atol=1e-14)


def test_a_training_loop_with_an_empty_leaf_compiles_its_body(rng):
    """Steps under ``lax.scan`` whose carry holds a (0,)-shaped parameter: the
    loop's body compiles (its kernels in the explanation, the empty leaf passed
    through as no work), where any empty operand sent the whole loop through
    XLA, silently (an empty array is no fallback). Values as jax.jit."""
    shapes = [(0,), (7, 5), (33,)]

    def train(params, mu, grads):
        def body(carry, g):
            p, m = carry
            p, m = sgd_momentum(p, g, m)
            return (p, m), sum(jnp.sum(x) for x in p)
        return jax.lax.scan(body, (params, mu), grads)

    params, mu = ([jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes] for _ in range(2))
    grads = [jnp.asarray(rng.standard_normal((3, *s)), jnp.float32) for s in shapes]
    with pallaskit.config.override(loop_bodies="on"):  # 'auto' leaves loops to XLA on a GPU
        e = pallaskit.explain(train, params, mu, grads)
        assert any(k.scope for k in e.kernels) and not e.fallbacks, str(e).split("schedule:")[0]
        got = pallaskit.jit(train)(params, mu, grads)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(jax.jit(train)(params, mu, grads))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=1e-5)


_WIDE_PROTOTYPES_SCRIPT = '''
import os
os.environ.pop("TRITON_INTERPRET", None)
import jax, jax.numpy as jnp
import lowering
from lowering.options import CompileOptions
from pallaskit.runtime import triton_compile
from triton.compiler import code_generator
__GPU_SPELLING__
original = code_generator.ASTFunction.deserialize
shapes = [(7, 3), (2500,), (33, 65), (1,), (5,)] * 8
def upd(ps, gs, ms):
    ms = [0.9 * m + 0.1 * g for m, g in zip(ms, gs)]
    return [p - 1e-2 * m for p, m in zip(ps, ms)], ms
tree = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
opts = CompileOptions(interpret=False, kernel_backend="triton", triton_available=True, num_sms=132)
sched = lowering.compile_jaxpr(jax.make_jaxpr(upd)(tree, tree, tree), opts).schedule
k = next(k for k in sched.kernels if k.kind == "combo")
print("INSTALLED", triton_compile.wide_prototypes())
ours = compile_for_gpu(k, sched, opts, until="ptx").cubin
code_generator.ASTFunction.deserialize = original
theirs = compile_for_gpu(k, sched, opts, until="ptx").cubin
print("SAME", ours == theirs, len(ours) > 0, "PARAMS", ours.decode().count(".param .u64"))
'''


def test_triton_wide_prototypes_compile_the_same_kernel():
    """[Note: Triton's wide prototypes]: Triton 3.6's argument building replaced
    by a linear one gives the combo kernel's PTX byte for byte (compiled for
    sm_90 on this CPU, in a child without Triton's interpreter)."""
    triton = pytest.importorskip("triton")
    from conftest import GPU_SPELLING_FIXTURE, run_python_on_cpu

    proc = run_python_on_cpu(_WIDE_PROTOTYPES_SCRIPT.replace("__GPU_SPELLING__", GPU_SPELLING_FIXTURE), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.startswith(("INSTALLED", "SAME")))
    assert lines["INSTALLED"] == str(triton.__version__ == "3.6.0"), lines
    same, nonempty, _, params = lines["SAME"].split()
    assert same == "True" and nonempty == "True" and int(params) >= 200, lines
