"""Fused attention ([Note: fused attention] in lowering/attention.py): plain
attention and its gradient found in the jaxpr and run as flash-attention
kernels. The pass is checked on its own (which programs it rewrites; the
rewritten jaxpr, run by XLA through each equation's fallback, against
jax.jit) and through pallaskit.jit with raw Triton (Triton's interpreter on
the CPU), against jax.jit."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

import pallaskit
from conftest import assert_close
from lowering import attention as attention_pass
from lowering.attention import fuse_attention

F32_MIN = float(jnp.finfo(jnp.float32).min)


def attention(q, k, v, *, causal=True, mask=None, fill=F32_MIN, layout="bthd", scale=None):
    """Attention as users write it: scores in float32, jnp.where mask, jax.nn.softmax."""
    eq = {"bthd": ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"), "bhtd": ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd")}[layout]
    d = q.shape[-1]
    s = jnp.einsum(eq[0], q, k).astype(jnp.float32) * (d ** -0.5 if scale is None else scale)
    t, u = s.shape[-2:]
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((t, u), dtype=bool)), s, fill)
    if mask is not None:
        s = jnp.where(mask, s, fill)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum(eq[1], p, v)


def flax_style(q, k, v):
    """flax.linen.dot_product_attention's order: q scaled first, no float32 cast."""
    q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    w = jnp.einsum("...qhd,...khd->...hqk", q, k)
    w = jax.nn.softmax(w).astype(q.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", w, v)


def manual_softmax(q, k, v):
    """A softmax written out: max without stop_gradient, exp, divide."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / 8.0
    e = jnp.exp(s - s.max(-1, keepdims=True))
    p = (e / e.sum(-1, keepdims=True)).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def haiku_style(q, k, v):
    """Scores left in bfloat16, divided by a scale computed in the trace
    (sqrt of the head dim), masked with haiku's fill -1e30 (jnp.where converts
    it to bfloat16: the backward's fill is that rounded value), softmax in bfloat16."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -1e30)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def nanogpt(q, k, v, mask):
    """nanoGPT's CausalSelfAttention: [B, H, T, D], bfloat16 scores, a float
    mask whose zeros hide (where(mask == 0, -inf, att): the select's operands
    the other way round)."""
    att = (q @ jnp.swapaxes(k, -2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
    att = jnp.where(mask == 0, float("-inf"), att)
    return jax.nn.softmax(att, axis=-1) @ v


def grouped_query(q, k, v):
    """k and v shared by pairs of query heads (grouped-query attention)."""
    k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    return attention(q, k, v)


def _normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def _qkv(rng, dtype, b=2, t=13, h=2, d=16, tk=None, kv_heads=None):
    tk = t if tk is None else tk
    return (_normal(rng, (b, t, h, d), dtype), _normal(rng, (b, tk, kv_heads or h, d), dtype),
            _normal(rng, (b, tk, kv_heads or h, d), dtype))


def _loss(fn):
    def loss(q, k, v, w):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
    return loss


def _grad(fn):
    return jax.value_and_grad(_loss(fn), argnums=(0, 1, 2))


def _rewrites(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    new, lines = fuse_attention(closed)
    return closed, new, lines


def _check_fallback(fn, new, args, dtype):
    """The rewritten jaxpr, each attention equation run by XLA from the equations
    it replaced, computes what jax.jit(fn) does."""
    got = jax.jit(jex_core.jaxpr_as_fun(new))(*args)
    want = jax.tree_util.tree_leaves(jax.jit(fn)(*args))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, dtype)


CASES = {
    "causal": lambda q, k, v: attention(q, k, v),
    "unmasked": lambda q, k, v: attention(q, k, v, causal=False),
    "bhtd": lambda q, k, v: attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), layout="bhtd"),
    "flax": flax_style,
    "haiku": haiku_style,
    "manual_softmax": manual_softmax,
    "causal_-inf": lambda q, k, v: attention(q, k, v, fill=-jnp.inf),
    # jax.checkpoint: the backward recomputes the scores and the mask from q and k
    "remat": jax.checkpoint(lambda q, k, v: attention(q, k, v)),
    "remat_dots_saved": jax.checkpoint(lambda q, k, v: attention(q, k, v),
                                       policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pass_rewrites_forward_and_backward(rng, case):
    """Each form of attention is found, with its gradient; where pallaskit does
    not run the kernels, XLA runs the equations they replaced (two cases: the
    check compiles the whole program)."""
    fn = CASES[case]
    args = _qkv(rng, jnp.bfloat16, t=7)
    _, new, lines = _rewrites(fn, *args)
    assert len(lines) == 1 and "forward as flash-attention" in lines[0], lines
    w = _normal(rng, fn(*args).shape, jnp.float32)
    _, new, lines = _rewrites(_grad(fn), *args, w)
    assert len(lines) == 1 and "forward and backward" in lines[0], lines
    assert not any(e.primitive.name == "exp" for e in new.jaxpr.eqns)  # no softmax left
    if case in ("causal", "flax"):
        _check_fallback(_grad(fn), new, (*args, w), jnp.bfloat16)


def test_pass_reads_causal_mask_and_views(rng, monkeypatch):
    args = _qkv(rng, jnp.bfloat16, t=8)
    evaluated = []  # the mask's own equations are evaluated, not the fill broadcast to the scores' shape
    inner = attention_pass._evaluated
    monkeypatch.setattr(attention_pass, "_evaluated", lambda graph, eqns, v: evaluated.extend(
        graph.eqns[j].outvars[0].aval.shape for j in eqns) or inner(graph, eqns, v))
    _, new, lines = _rewrites(CASES["causal"], *args)
    assert evaluated and max(math.prod(s) for s in evaluated) == 8 * 8
    (eqn,) = [e for e in new.jaxpr.eqns if e.primitive.name == "pallaskit_attention"]
    spec = eqn.params["spec"]
    assert spec.causal and spec.mask is None and spec.batch == (2, 2) and (spec.tq, spec.tk, spec.d) == (8, 8, 16)
    # q, k, v read where they are, [B, T, H, D], with no transpose before the kernel
    assert spec.q.t == 2 * 16 and spec.q.d == 1 and spec.q.batch == (8 * 2 * 16, 16)
    assert list(eqn.invars) == list(new.jaxpr.invars)


@pytest.mark.parametrize("case", ["converted", "scaled_after"])
def test_pass_reads_the_fill_as_the_program_rounds_it(rng, case):
    """jnp.where converts its fill to the scores' dtype (-1e9 is -inf in
    float16), and a scale after the mask scales it in that dtype (float16's min
    / 0.5 is -inf): a row masked throughout is then NaN (as jax.jit), not
    uniform over the keys."""
    q, k, v = _qkv(rng, jnp.float16, t=4)

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if case == "converted":
            s = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), s * 0.25, -1e9)
        else:
            s = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), s, jnp.finfo(jnp.float16).min) / 0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    _, new, _ = _rewrites(fn, q, k, v)
    (eqn,) = [e for e in new.jaxpr.eqns if e.primitive.name == "pallaskit_attention"]
    assert eqn.params["spec"].fill == -math.inf


def test_pass_reads_a_computed_fill_without_jaxs_cpu_backend(rng, monkeypatch):
    """A process started with JAX_PLATFORMS=cuda has no CPU backend: the fill
    and scale computed from literals are read on the default device (the pass
    failed there, and every attention ran as written)."""
    devices = jax.devices

    def no_cpu(backend=None):  # on a CPU host the default device stays the CPU: the name is refused
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu. Available backends are ['cuda']")
        return devices(backend)

    monkeypatch.setattr(jax, "devices", no_cpu)
    q, k, v = _qkv(rng, jnp.float16, t=4)

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1])).astype(q.dtype)
        s = jnp.where(jnp.tril(jnp.ones((4, 4), bool)), s, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    _, new, _ = _rewrites(fn, q, k, v)
    (eqn,) = [e for e in new.jaxpr.eqns if e.primitive.name == "pallaskit_attention"]
    assert eqn.params["spec"].fill == -math.inf


@pytest.mark.parametrize("case", ["weights_returned", "softmax_over_queries", "dropout", "bias_added"])
def test_pass_leaves_other_programs(rng, case):
    """What is not exactly softmax(where(mask, s * scale, fill)) · v, or whose
    scores or probabilities another value reads, stays plain attention."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=8)

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.25
        if case == "bias_added":  # a bias known only at run time (a constant, bounded one is fused)
            s = s + jnp.sum(q.astype(jnp.float32), -1).transpose(0, 2, 1)[..., None]
        p = jax.nn.softmax(s, axis=-2 if case == "softmax_over_queries" else -1)
        if case == "dropout":
            p = p * jax.random.bernoulli(jax.random.key(0), 0.9, p.shape) / 0.9
        p = p.astype(v.dtype)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return (o, p) if case == "weights_returned" else o

    assert _rewrites(fn, q, k, v)[2] == []


def test_pass_leaves_float32(rng):
    """float32 attention stays plain (lowering/attention.py ``_16BIT``: XLA's TF32 dots)."""
    assert _rewrites(CASES["causal"], *_qkv(rng, jnp.float32, t=8))[2] == []
    assert len(_rewrites(CASES["causal"], *_qkv(rng, jnp.float16, t=8))[2]) == 1


def test_pass_leaves_a_partial_gradient(rng):
    """Only q differentiated: no dK / dV dots, so nothing is rewritten (the
    forward's probabilities feed the backward)."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=8)
    w = _normal(rng, (2, 8, 2, 16), jnp.float32)
    fn = jax.grad(_loss(CASES["causal"]), argnums=0)
    _, new, lines = _rewrites(fn, q, k, v, w)
    assert lines == []


# --------------------------------------------------------------------------- #
# Through pallaskit.jit: the kernels (Triton's interpreter on the CPU)
# --------------------------------------------------------------------------- #
def _jit_check(fn, args, dtype, tol_dtype=None):
    with pallaskit.config.override(kernel_backend="triton"):
        e = pallaskit.explain(fn, *args)
        got = pallaskit.jit(fn)(*args)
    assert any("flash-attention" in r for r in e.rewrites), e.rewrites
    assert sum(k.kind == "attention" for k in e.kernels) >= 1 and e.fallbacks == []
    want = jax.jit(fn)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, tol_dtype or dtype)
    return e


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_jit_causal_forward_and_grad(rng, dtype):
    args = _qkv(rng, dtype)
    w = _normal(rng, (2, 13, 2, 16), jnp.float32)
    e = _jit_check(_grad(CASES["causal"]), (*args, w), dtype)
    assert sum(k.kind == "attention" for k in e.kernels) == 2  # forward, backward
    assert "flash attention, backward" in e.source
    from pallaskit import metrics  # the kernel_metadata rows hold both, with their bytes
    with pallaskit.config.override(kernel_backend="triton"):
        entry = pallaskit.jit(_grad(CASES["causal"])).lower_to_result(*args, w)
    rows = [r for r in metrics.kernel_stats(entry.result) if r["kind"] == "attention"]
    assert [r["kernel_name"] for r in rows] == ["att0_fwd", "att1_bwd"]
    assert rows[0]["bytes_read"] == 3 * 2 * 13 * 2 * 16 * np.dtype(dtype).itemsize


def test_jit_mask_with_an_empty_row_and_cross_lengths(rng):
    """A bool mask operand (broadcast over batch and heads) with a row whose
    keys are all masked (uniform over every key under a finite fill), and
    more keys than queries."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=5, tk=11)
    mask = rng.random((5, 11)) < 0.6
    mask[2] = False
    mask = jnp.asarray(mask)
    w = _normal(rng, (2, 5, 2, 16), jnp.float32)
    fn = _grad(lambda q, k, v: attention(q, k, v, causal=False, mask=mask))
    _jit_check(fn, (q, k, v, w), jnp.bfloat16)


def test_jit_nanogpt_mask_hides(rng):
    """A mask that is True where hidden (nanoGPT's form), read as an operand:
    a query row hidden throughout (NaN under -inf; its dQ is 0, as in jax, only
    if keys past tk read as hidden), more keys than queries. The constant
    tril's form is causal."""
    q, k, v = (_normal(rng, (2, 2, t, 16), jnp.bfloat16) for t in (5, 11, 11))
    mask = jnp.asarray(rng.random((5, 11)) < 0.6, jnp.float32).at[2].set(0)
    w = _normal(rng, (2, 2, 5, 16), jnp.float32)
    loss = lambda q, k, v, w: jnp.sum(nanogpt(q, k, v, mask).astype(jnp.float32) * w)  # noqa: E731
    _jit_check(jax.value_and_grad(loss, argnums=(0, 1, 2)), (q, k, v, w), jnp.bfloat16)
    q = q[:, :, :4]
    _, _, lines = _rewrites(lambda q: nanogpt(q, q, q, jnp.tril(jnp.ones((4, 4)))), q)
    assert len(lines) == 1 and "causal" in lines[0], lines


def test_jit_grouped_query_and_flax(rng):
    q, k, v = _qkv(rng, jnp.bfloat16, t=9, h=4, kv_heads=2)
    w = _normal(rng, (2, 9, 4, 16), jnp.float32)
    _jit_check(_grad(grouped_query), (q, k, v, w), jnp.bfloat16)
    q, k, v = _qkv(rng, jnp.bfloat16, t=7, d=8)
    _jit_check(flax_style, (q, k, v), jnp.bfloat16)


def test_jit_remat(rng):
    """jax.checkpoint around attention: the backward's recomputed scores are the
    forward's, computed again; one forward and one backward kernel."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=7)
    w = _normal(rng, (2, 7, 2, 16), jnp.float32)
    e = _jit_check(_grad(CASES["remat"]), (q, k, v, w), jnp.bfloat16)
    assert [x.kind for x in e.kernels].count("attention") == 2


def test_jit_scanned_layers(rng):
    """Layers under lax.scan, each checkpointed (flax's nn.scan over nn.remat):
    the forward body's attention and the backward body's recomputed attention
    and its gradient run as the flash kernels inside the loop bodies."""
    x = _normal(rng, (2, 6, 2, 16), jnp.bfloat16)
    ws = _normal(rng, (2, 3, 16, 16), jnp.bfloat16, 0.3)  # per layer: q, k, v projections
    w = _normal(rng, (2, 6, 2, 16), jnp.float32)

    @jax.checkpoint
    def layer(x, wl):
        return attention(x @ wl[0], x @ wl[1], x @ wl[2]) + x

    def loss(x, ws, w):  # squares: no cancellation for bf16 rounding to show through
        y, _ = jax.lax.scan(lambda y, wl: (layer(y, wl), None), x, ws)
        return jnp.mean(jnp.square(y.astype(jnp.float32) * w))

    step = jax.value_and_grad(loss, argnums=(0, 1))
    with pallaskit.config.override(loop_bodies="on"):  # on a GPU 'auto' leaves so small a loop to XLA
        e = _jit_check(step, (x, ws, w), jnp.bfloat16)
    kinds = [(x.kind, bool(x.scope)) for x in e.kernels if x.kind == "attention"]
    assert len(kinds) == 3 and all(scoped for _, scoped in kinds), kinds  # forward body; backward body: both
    _, new, lines = _rewrites(step, x, ws, w)  # a loop XLA runs: each equation's fallback (O from P where
    assert len(lines) == 2  # the recomputed forward has none)
    _check_fallback(step, new, (x, ws, w), jnp.bfloat16)


def test_jit_dot_product_attention(rng):
    """jax.nn.dot_product_attention (XLA's implementation; flax nnx's attention
    has its form): a head-group dim of size 1 in q, the scores transposed
    inside the mask's where, a causal mask and'ed with a broadcast True,
    BF16_BF16_F32 dots; in the gradient, P's cotangent transposed after
    dO · vᵀ and dQ, dK float32 products transposed, then rounded."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=9)
    w = _normal(rng, (2, 9, 2, 16), jnp.float32)
    e = _jit_check(_grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)), (q, k, v, w),
                   jnp.bfloat16)
    assert "forward and backward" in e.rewrites[0] and "causal" in e.rewrites[0]
    # unmasked: the row max read before the scores' transpose, the subtraction after it
    _, _, lines = _rewrites(_grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v)), q, k, v, w)
    assert len(lines) == 1 and "forward and backward" in lines[0] and "unmasked" in lines[0]


@pytest.mark.parametrize("bias_kind", ["alibi", "padding"])
def test_jit_additive_bias(rng, bias_kind):
    """An additive bias before the mask: ALiBi (a constant, bounded) runs in the
    kernels, forward and gradient, read broadcast over the batch; HF's padding
    mask written as 0 / float32 min (a batch entry padded throughout, whose rows
    jax makes uniform over every key) stays plain, and right."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=7)
    w = _normal(rng, (2, 7, 2, 16), jnp.float32)
    if bias_kind == "alibi":
        pos = jnp.arange(7.0)
        bias = (-jnp.abs(pos[:, None] - pos[None, :]) * jnp.asarray([0.5, 0.25])[:, None, None])[None]
    else:
        keep = rng.random((2, 7)) < 0.7
        keep[1] = False  # a row (batch entry) padded throughout
        bias = jnp.where(jnp.asarray(keep)[:, None, None, :], 0.0, F32_MIN)

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * 0.25 + bias
        s = jnp.where(jnp.tril(jnp.ones((7, 7), bool)), s, F32_MIN)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1).astype(q.dtype), v)

    if bias_kind == "padding":
        assert _rewrites(_grad(fn), q, k, v, w)[2] == []
        return
    e = _jit_check(_grad(fn), (q, k, v, w), jnp.bfloat16)
    assert "with a bias" in e.rewrites[0] and "causal" in e.rewrites[0]


def test_jit_nan_travels(rng):
    q, k, v = _qkv(rng, jnp.bfloat16, t=6)
    q = q.at[0, 3, 1, 2].set(jnp.nan)
    got = _jit_check(lambda q, k, v: attention(q, k, v), (q, k, v), jnp.bfloat16)
    assert got is not None


def test_option_off_and_pallas_leave_attention(rng):
    args = _qkv(rng, jnp.bfloat16, t=4)
    with pallaskit.config.override(kernel_backend="triton", fused_attention=False):
        assert pallaskit.explain(CASES["causal"], *args).rewrites == []
    with pallaskit.config.override(kernel_backend="pallas"):  # only raw Triton writes the kernels
        assert pallaskit.explain(CASES["causal"], *args).rewrites == []
    assert "fused_attention" in pallaskit.config.help()


def test_grad_of_a_pallaskit_function(rng):
    """jax.grad of pallaskit.jit(loss): the pass runs on the joint graph, so the
    forward half saves O and the log-sum-exp, the backward half runs the
    backward kernel."""
    q, k, v = _qkv(rng, jnp.bfloat16, t=6)
    w = _normal(rng, (2, 6, 2, 16), jnp.float32)
    loss = _loss(CASES["causal"])
    with pallaskit.config.override(kernel_backend="triton"):
        got = jax.grad(pallaskit.jit(loss), argnums=(0, 1, 2))(q, k, v, w)
        e = pallaskit.explain_grad(loss, q, k, v, w)
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, w)
    for a, b in zip(got, want):
        assert_close(a, b, jnp.bfloat16)
    assert [x.kind for x in e.forward.kernels].count("attention") == 1
    assert [x.kind for x in e.backward.kernels].count("attention") == 1
    assert not any(s.shape[-2:] == (6, 6) for s in e.saved)  # no [T, T] probabilities saved


def test_a_failing_pass_leaves_the_program(rng, monkeypatch, caplog):
    """A bug in the pass must not break the user's program: it runs as written."""
    import lowering.attention as attention_pass

    def broken(closed):
        raise RuntimeError("boom")

    monkeypatch.setattr(attention_pass, "_fuse", broken)
    args = _qkv(rng, jnp.bfloat16, t=4)
    with pallaskit.config.override(kernel_backend="triton"):
        e = pallaskit.explain(CASES["causal"], *args)
        got = pallaskit.jit(CASES["causal"])(*args)
    assert e.rewrites == [] and "attention pass failed (RuntimeError: boom)" in caplog.text
    assert_close(got, jax.jit(CASES["causal"])(*args), jnp.bfloat16)

