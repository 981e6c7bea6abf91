"""The fusion loop ([Note: the fusion loop] in lowering/scheduler.py): the same
decisions as scoring every pair after every merge, in work that grows about
linearly with the number of groups."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lowering
from lowering import ir, scheduler
from pallaskit.api import compile_options

SHAPES = [(64,), (32, 16), (128,), (8, 8, 4), (1,), (3, 5), (0,), (17,)]


def _old_path_through_other(fuser, groups, src, dst):
    """The cycle check as a walk over the reads of every group."""
    produced = src.produces()
    group_of = {m.name: g for g in groups for m in g.members}
    stack, seen = list(dst.reads()), set()
    while stack:
        buf = stack.pop()
        if buf in seen:
            continue
        seen.add(buf)
        if buf in produced:
            continue
        g = group_of.get(buf)
        if g is not None:
            if g is src or g is dst:
                continue
            reads = g.reads()
        else:
            node = fuser.producer.get(buf)
            if node is None or isinstance(node, ir.InputNode):
                continue
            reads = set(node.reads())
        if reads & produced:
            return True
        stack.extend(reads)
    return False


def _reference_run(fuser):
    """Every pair scored after every merge; the best legal one merges (ties: the
    first pair in list order, merged groups appended)."""
    groups = list(fuser.groups)
    while True:
        best = None
        for a, b in itertools.combinations(groups, 2):
            score = fuser.fusion_score(a, b)
            if score == (0, 0) or (best is not None and score <= best[0]):
                continue
            merged = scheduler._merge(a, b, fuser.order)
            if merged is None:
                continue
            if merged.kind == "mix" and any(m.role in ("reduction", "row") for m in merged.members):
                if not fuser.options.mix_order_reduction or not scheduler.heuristics.fits_in_tile(
                        merged.cols, fuser.options.max_persistent_cols):
                    continue
            if merged.kind == "matmul" and fuser.options.matmul_template == "unfused":
                continue
            if not scheduler._in_kernel_reads_ok(merged.members):
                continue
            if _old_path_through_other(fuser, groups, a, b) or _old_path_through_other(fuser, groups, b, a):
                continue
            best = (score, a, b, merged)
        if best is None:
            return groups
        _, a, b, merged = best
        groups = [g for g in groups if g is not a and g is not b] + [merged]


def momentum(ps, ms, gs):
    ms = [0.9 * m + g for m, g in zip(ms, gs)]
    ps = [p - 1e-3 * m for p, m in zip(ps, ms)]
    return ps, ms


def adamw(params, grads, mu, nu, count):
    count = count + 1
    mu = [0.9 * m + 0.1 * g for m, g in zip(mu, grads)]
    nu = [0.999 * v + 0.001 * g * g for v, g in zip(nu, grads)]
    c = count.astype(jnp.float32)
    upd = [(m / (1 - 0.9 ** c)) / (jnp.sqrt(v / (1 - 0.999 ** c)) + 1e-8) + 1e-4 * p
           for m, v, p in zip(mu, nu, params)]
    return [p - 1e-3 * u for p, u in zip(params, upd)], mu, nu, count


def clipped_sgd(params, grads):
    """Global-norm clipping: one sum of squares over every array, read by every update."""
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
    scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
    return [p - 1e-2 * scale * g for p, g in zip(params, grads)]


def norm_block(x, w, b, g):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + 1e-5) * w + b
    return y, jnp.sum(g * y, axis=0), jnp.sum(g, axis=0), jnp.cumsum(y, axis=0)


def _arrays(rng, n, shapes=SHAPES):
    return [jnp.asarray(rng.standard_normal(shapes[k % len(shapes)]), jnp.float32) for k in range(n)]


def _cases(rng):
    yield "momentum", momentum, [_arrays(rng, 9, [(64,)]) for _ in range(3)]
    yield "adamw", adamw, (*[_arrays(rng, 11) for _ in range(4)], jnp.asarray(2, jnp.int32))
    yield "clipped_sgd", clipped_sgd, (_arrays(rng, 7), _arrays(rng, 7))
    x = jnp.asarray(rng.standard_normal((300, 96)), jnp.float32)
    yield "norm_block", norm_block, (x, x[0], x[1], x + 1)
    yield "scan", lambda v: jax.lax.associative_scan(jnp.add, v, axis=0), (x[:16, :5],)
    yield "matmul", lambda a, m: (jax.nn.gelu(a @ m) + 1.0, jnp.sum(a, axis=1)), (x[:40, :32].astype(jnp.bfloat16),
                                                                                   x[:32, :48].astype(jnp.bfloat16))


def _groups(fn, args, run, options):
    closed = jax.make_jaxpr(fn)(*args)
    graph = __import__("lowering.lower", fromlist=["lower"]).lower(closed, options).graph
    graph = scheduler.split_reductions(graph, options)
    live = scheduler.live_nodes(graph)
    keep = scheduler.materialized(graph, live)
    fuser = scheduler.Fuser(graph, scheduler.build_groups(graph, keep, live, scheduler._Inliner(graph, keep)), options)
    out = run(fuser)
    return [(g.kind, g.order, [(m.name, m.role, str(m.coords)) for m in g.members]) for g in out]


@pytest.mark.parametrize("mix_order", [True, False])
def test_same_decisions_as_scoring_every_pair(rng, mix_order):
    options = lowering.CompileOptions(**{**compile_options().__dict__, "mix_order_reduction": mix_order,
                                         "matmul_template": "fused"})
    for name, fn, args in _cases(rng):
        new = _groups(fn, args, scheduler.Fuser.run, options)
        old = _groups(fn, args, _reference_run, options)
        assert new == old, name
        assert len(new) < sum(len(g[2]) for g in new) or name == "scan", name  # something fused


def test_fusion_work_grows_linearly(monkeypatch, rng):
    """Scores and legality checks per group stay bounded as arrays are added
    (scoring every pair after every merge grows with the cube)."""
    calls = {"score": 0, "legal": 0}
    score, legal = scheduler.Fuser.fusion_score, scheduler.Fuser.can_fuse

    def counted_score(self, a, b):
        calls["score"] += 1
        return score(self, a, b)

    def counted_legal(self, a, b):
        calls["legal"] += 1
        return legal(self, a, b)

    monkeypatch.setattr(scheduler.Fuser, "fusion_score", counted_score)
    monkeypatch.setattr(scheduler.Fuser, "can_fuse", counted_legal)
    options = compile_options()
    per_group = []
    for n in (10, 40):
        calls.update(score=0, legal=0)
        args = (*[_arrays(rng, n, SHAPES[:4]) for _ in range(4)], jnp.asarray(2, jnp.int32))
        groups = _groups(adamw, args, scheduler.Fuser.run, options)
        members = sum(len(g[2]) for g in groups)
        per_group.append((calls["score"] + calls["legal"]) / members)
    # Arrays of one shape share the step count, so their pairs are scored: that
    # part grows with arrays per shape; 4x the arrays must not cost 4x per group.
    assert per_group[1] < 2.5 * per_group[0], per_group


def test_scalar_readers_are_not_walked_per_group(monkeypatch, rng):
    """Every update of an optimizer reads the step count: queueing a pointwise
    group's neighbours must not visit all n readers of that scalar (n^2 over the
    fusion loop). Counted as class lookups per group, at 12 and 96 arrays."""
    calls = [0]
    class_of = scheduler._class_of

    def counted(*a, **k):
        calls[0] += 1
        return class_of(*a, **k)

    monkeypatch.setattr(scheduler, "_class_of", counted)
    per_group = []
    for n in (12, 96):
        calls[0] = 0
        args = (*[_arrays(rng, n) for _ in range(4)], jnp.asarray(2, jnp.int32))
        groups = _groups(adamw, args, scheduler.Fuser.run, compile_options())
        per_group.append(calls[0] / sum(len(g[2]) for g in groups))
    assert per_group[1] < 2 * per_group[0], per_group


def test_ir_texts_are_the_graph_as_lowered(rng):
    """CompileResult formats its IR texts on first need, after every pass ran:
    they must still read as the graph was lowered and as it was scheduled."""
    from lowering.combo import combine

    options = compile_options()
    for name, fn, args in _cases(rng):
        closed = jax.make_jaxpr(fn)(*args)
        result = lowering.compile_jaxpr(closed, options)
        graph = __import__("lowering.lower", fromlist=["lower"]).lower(closed, options).graph
        before = graph.format()
        after = scheduler.format_schedule(scheduler.schedule(graph, options, combine=combine))
        assert (result.ir_before, result.ir_after) == (before, after), name


def test_fused_programs_match_jax(rng):
    """The optimizers above, compiled and run, against jax.jit (NaN, inf, size 1 and empty arrays included)."""
    import pallaskit
    from conftest import assert_close

    grads = _arrays(rng, 16)
    grads[3] = grads[3].at[0].set(jnp.nan)
    grads[5] = grads[5].at[0, 0].set(jnp.inf)
    args = (_arrays(rng, 16), grads, _arrays(rng, 16), [jnp.abs(a) for a in _arrays(rng, 16)],
            jnp.asarray(4, jnp.int32))
    for fn, a in ((adamw, args), (clipped_sgd, args[:2])):
        out, ref = pallaskit.jit(fn)(*a), jax.jit(fn)(*a)
        for x, y in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
            assert x.shape == y.shape and x.dtype == y.dtype
            assert_close(np.asarray(x), np.asarray(y), y.dtype)


def test_cycle_check_agrees_with_a_walk_over_every_read(rng):
    """The two-sided search of ``Fuser._path_through_other`` answers as a walk
    over every read, for every ordered pair of groups: diamonds through a
    kernel, through an XLA op (sort) and none."""
    def diamond(x, y):
        a = jnp.tanh(x) * 2.0
        b = jnp.sort(a, axis=-1) + 1.0  # an XLA op between two kernels
        c = jnp.sum(a * y, axis=-1, keepdims=True)
        return a + b + c, jnp.exp(c) * y

    x = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
    cases = list(_cases(rng)) + [("diamond", diamond, (x, x[::-1]))]
    options = compile_options()
    checked = found = 0
    for name, fn, args in cases:
        closed = jax.make_jaxpr(fn)(*args)
        graph = __import__("lowering.lower", fromlist=["lower"]).lower(closed, options).graph
        graph = scheduler.split_reductions(graph, options)
        live = scheduler.live_nodes(graph)
        keep = scheduler.materialized(graph, live)
        groups = scheduler.build_groups(graph, keep, live, scheduler._Inliner(graph, keep))
        fuser = scheduler.Fuser(graph, groups, options)
        for a, b in itertools.permutations(groups, 2):
            want = _old_path_through_other(fuser, groups, a, b)
            assert fuser._path_through_other(a, b) == want, (name, a.members[0].name, b.members[0].name)
            checked, found = checked + 1, found + want
    assert checked > 1000 and found >= 5, (checked, found)


class _CheckedFuser(scheduler.Fuser):
    """A Fuser that, at every legality check of the fusion loop, compares the
    ranked search of ``_path_through_other`` with the walk over every read of
    the live groups, and after every merge checks that the ranks still grow
    along every edge of the step graph."""

    checks = [0, 0]  # (searches compared, paths found)

    def run(self):
        self._init_steps()
        self.loop = scheduler._FusionLoop(self)
        return self.loop.run()

    def can_fuse(self, a, b):
        groups = list(self.loop.alive.values())
        for x, y in ((a, b), (b, a)):
            want = _old_path_through_other(self, groups, x, y)
            assert self._path_through_other(x, y) == want, (_labels(x), _labels(y))
            self.checks[0] += 1
            self.checks[1] += want
        return super().can_fuse(a, b)

    def _replace(self, a, b, merged):
        super()._replace(a, b, merged)
        steps = {id(s): s for s in self.step_of.values()}
        steps.update((id(s), s) for readers in self.readers.values() for s in readers.values())
        assert steps.keys() <= self.rank.keys()
        for s in steps.values():
            for c in self._consumers(s):
                assert self.rank[id(s)] < self.rank[id(c)], (_labels(s), _labels(c))


def _labels(s):
    return scheduler._label(s) if isinstance(s, scheduler._Group) else s.key


def _gpt2_step(layers):
    """benchmarks/models.py's gpt2_12layer_train at a small size, on abstract inputs."""
    from benchmarks import models

    spec = next(s for s in models.MODEL_SPECS if s["name"] == "gpt2_12layer_train")
    size = (layers, *spec["sizes"]["smoke"][1:])
    inputs = spec["make_inputs"](size, jnp.bfloat16, jax.random.key(0))
    return spec["jax_fn"], [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]


def test_ranked_cycle_check_agrees_through_the_fusion_loop(monkeypatch, rng):
    """[Note: the cycle check's ranks]: after any number of merges, the search
    bounded by rank answers as the unbounded walk, and the ranks stay a
    topological order (a group spans nodes far apart, so node positions would
    not do: that prune made a cycle in the attention gradient). Attention's
    value_and_grad in one graph and a 3-layer GPT-2 training step, with the CPU's
    and the GPU's options."""
    def attention_loss(q, k, v, w):
        s = jnp.einsum("bthd,bshd->bhts", q, k) / 2.0
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
        o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)
        return jnp.sum((o.reshape(w.shape) * w).astype(jnp.float32))

    qkv = [jax.ShapeDtypeStruct((2, 9, 3, 4), jnp.bfloat16)] * 3 + [jax.ShapeDtypeStruct((2, 9, 12), jnp.bfloat16)]
    cases = [("attention_grad", jax.value_and_grad(attention_loss, argnums=(0, 1, 2)), qkv),
             ("gpt2_3layer_train", *_gpt2_step(3))]
    gpu = lowering.CompileOptions(interpret=False, triton_available=True, kernel_backend="auto")
    monkeypatch.setattr(scheduler, "Fuser", _CheckedFuser)
    _CheckedFuser.checks = [0, 0]
    for name, fn, args in cases:
        closed = jax.make_jaxpr(fn)(*args)
        for options in (compile_options(), gpu):
            graph = __import__("lowering.lower", fromlist=["lower"]).lower(closed, options).graph
            scheduler.schedule(graph, options)
    checked, found = _CheckedFuser.checks
    assert checked > 1000 and found >= 20, (checked, found)
