"""Attention written plainly (einsum, scale, mask, softmax, einsum) and the views
around XLA's dots ([Note: views between XLA ops] in lowering/xla_views.py):
kernel structure through explain / the schedule, values against jax.jit."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallaskit
from conftest import assert_close
from lowering import ir, lower, scheduler
from lowering.options import CompileOptions


def _attention(q, k, v):
    """q, k, v: [B, T, H, D] -> [B, T, H * D]; scores and softmax in float32, causal."""
    b, t, h, d = q.shape
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * d ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, h * d)


def _projected(x, wq, bq, wk, wv, bv, wo):
    """GPT-2's attention: projections (bias on q and v), heads of 4."""
    b, t, c = x.shape
    heads = lambda y: y.reshape(b, t, c // 4, 4)  # noqa: E731
    return _attention(heads(x @ wq + bq), heads(x @ wk), heads(x @ wv + bv)) @ wo


def _inputs(rng, shapes, dtype, special=False):
    out = [np.asarray(rng.standard_normal(s) * 0.5, np.float32) for s in shapes]
    if special:  # NaN, +-inf, -0 in the first operand: they must travel as under jax.jit
        flat = out[0].reshape(-1)
        flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return [jnp.asarray(a, dtype) for a in out]


def _check(fn, *args, tol_dtype=None):
    """pallaskit.jit vs jax.jit; ``tol_dtype``: the tolerance's dtype where an
    output is wider than what it was computed from (a float32 loss of bf16 math)."""
    out = pallaskit.jit(fn)(*args)
    ref = jax.jit(fn)(*args)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, tol_dtype or b.dtype)


def _schedule(fn, *args, **options):
    closed = jax.make_jaxpr(fn)(*args)
    opts = CompileOptions(**options)
    return scheduler.schedule(lower.lower(closed, opts).graph, opts)


def _gemm_reads_in_place(shape, batch, contract) -> bool:
    """XLA's gemm reads a row-major operand as it is when its batch dims are
    outermost (in dimension-number order) and its free and contracting dims
    each contiguous; size-1 dims sit anywhere."""
    wide = [d for d in range(len(shape)) if shape[d] != 1]
    b = [d for d in batch if shape[d] != 1]
    c = [d for d in contract if shape[d] != 1]
    f = [d for d in wide if d not in b and d not in c]
    return wide in (b + f + c, b + c + f)


def _dot_operands_in_gemm_order(s) -> list:
    """The dot_general externs XLA would have to copy an operand of."""
    bad = []
    for step in s.steps:
        if not isinstance(step, ir.Extern) or step.primitive.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = step.params["dimension_numbers"]
        for x, batch, contract in zip(step.inputs, (lb, rb), (lc, rc)):
            shape, _ = s.graph.buffer_aval(x)
            if not _gemm_reads_in_place(shape, batch, contract):
                bad.append(step.format())
    return bad


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_heads_need_no_copy_kernel(rng, dtype):
    """The head split and merge around the two einsums: no copy kernel, and no
    dot operand XLA would copy (q and v are stored permuted by the bias kernels;
    k and the merged heads are XLA's own transposes, as under jax.jit)."""
    b, t, c = 2, 24, 12
    args = _inputs(rng, [(b, t, c), (c, c), (c,), (c, c), (c, c), (c,), (c, c)], dtype)
    _check(_projected, *args)
    e = pallaskit.explain(_projected, *args)
    names = [k.name for k in e.kernels] + [m.name for k in e.kernels for m in (k.members or ())]
    assert not [n for n in names if "copy" in n], names
    s = _schedule(_projected, *args, matmul_template="off")
    assert not _dot_operands_in_gemm_order(s)
    views = [st.primitive.name for st in s.steps if isinstance(st, ir.Extern) and st.primitive.name != "dot_general"]
    assert sorted(views) == ["reshape", "reshape", "transpose", "transpose"], views  # k's and the merged heads'


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 3, 5), (1, 1, 1, 4), (3, 17, 1, 8)])
def test_plain_attention_values(rng, dtype, shape):
    _check(_attention, *_inputs(rng, [shape] * 3, dtype))


def test_plain_attention_special_values(rng):
    _check(_attention, *_inputs(rng, [(2, 6, 3, 4)] * 3, jnp.float32, special=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_plain_attention_grads(rng, dtype):
    b, t, h, d = 2, 9, 3, 4
    q, k, v, w = _inputs(rng, [(b, t, h, d)] * 3 + [(b, t, h * d)], dtype)

    def loss(q, k, v):
        return jnp.sum((_attention(q, k, v) * w).astype(jnp.float32))

    f = jax.value_and_grad(loss, argnums=(0, 1, 2))
    _check(f, q, k, v, tol_dtype=dtype)
    out, ref = jax.grad(pallaskit.jit(loss), argnums=(0, 1, 2))(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for a, r in zip(out, ref):
        assert_close(a, r, dtype)


def test_attention_backward_softmax_is_one_kernel(rng):
    """value_and_grad of plain attention in one graph: the softmax forward and its
    backward (dS = P * (dP - rowsum(dP * P)) * scale, masked) are one reduction
    kernel between the dots."""
    b, t, h, d = 2, 16, 2, 8
    q, k, v, w = _inputs(rng, [(b, t, h, d)] * 3 + [(b, t, h * d)], jnp.float32)
    f = jax.value_and_grad(lambda q, k, v: jnp.sum(_attention(q, k, v) * w), argnums=(0, 1, 2))
    e = pallaskit.explain(f, q, k, v)
    softmax = [x for x in e.kernels if any("exp" in eq for eq in x.equations)]
    assert len(softmax) == 1 and softmax[0].kind == "reduction"
    assert any("integer_pow" in eq for eq in softmax[0].equations)  # the backward's 1 / sum^2 is there too


# -- the views pass on its own -------------------------------------------------------
def _externs(s):
    return [st.primitive.name for st in s.steps if isinstance(st, ir.Extern)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transposed_input_into_an_xla_dot_is_xla_transpose(rng, dtype):
    x, w = _inputs(rng, [(13, 7), (13, 5)], dtype)
    fn = lambda x, w: jnp.transpose(x) @ w  # noqa: E731
    _check(fn, x, w)
    s = _schedule(fn, x, w, matmul_template="off")
    assert not s.kernels and _externs(s) == ["transpose", "dot_general"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_value_reshaped_into_a_dot_is_stored_unreshaped(rng, dtype):
    x, w = _inputs(rng, [(3, 5, 7), (7, 11)], dtype)
    fn = lambda x, w: jnp.tanh(x).reshape(15, 7) @ w  # noqa: E731
    _check(fn, x, w)
    s = _schedule(fn, x, w, matmul_template="off")
    assert len(s.kernels) == 1 and s.kernels[0].members[0].node.shape == (3, 5, 7)
    assert _externs(s) == ["reshape", "dot_general"]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_value_permuted_into_a_dot_is_stored_permuted(rng, dtype):
    """A permutation of a kernel's value stays a view: the kernel stores it permuted."""
    x, y = _inputs(rng, [(2, 6, 3, 5), (2, 6, 3, 5)], dtype)
    fn = lambda x, y: jnp.einsum("bqhd,bkhd->bhqk", jnp.exp(x), y + 1)  # noqa: E731
    _check(fn, x, y)
    s = _schedule(fn, x, y, matmul_template="off")
    assert not _dot_operands_in_gemm_order(s)
    assert _externs(s) == ["dot_general"]
    assert sorted(m.node.shape for k in s.kernels for m in k.members if m.store) == [(2, 3, 6, 5)] * 2


def test_view_read_by_a_kernel_too_stays_a_view(rng):
    x, w = _inputs(rng, [(6, 4), (6, 3)], jnp.float32)
    def fn(x, w):
        t = x.T  # one transpose equation, two readers
        return t @ w, jnp.sin(t)

    _check(fn, x, w)
    s = _schedule(fn, x, w, matmul_template="off")
    assert "transpose" not in _externs(s)


def test_reshaped_output_stays_a_kernel(rng):
    """Outputs are not XLA views: eager launches (runtime/eager.py) need a program of kernels alone."""
    (x,) = _inputs(rng, [(6, 4)], jnp.float32)
    fn = lambda x: jnp.exp(x).reshape(24)  # noqa: E731
    _check(fn, x)
    assert not _externs(_schedule(fn, x))


@pytest.mark.parametrize("case", [
    # (lhs shape, rhs shape, ((lc, rc), (lb, rb)))
    ((2, 5, 3, 4), (2, 6, 3, 4), (((3,), (3,)), ((0, 2), (0, 2)))),  # q k^T per head
    ((2, 3, 5, 6), (2, 6, 3, 4), (((3,), (1,)), ((0, 1), (0, 2)))),  # p v per head
    ((4, 5, 7), (7, 3, 4), (((2, 0), (0, 2)), ((), ()))),  # two contracting dims, swapped order
    ((5, 2, 7), (2, 7, 3), (((2,), (1,)), ((1,), (0,)))),  # batch in the middle
    ((7, 1, 5), (7, 3), (((0,), (0,)), ((), ()))),  # a size-1 free dim
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("operands", ["kernel", "input"])
def test_dot_operands_in_gemm_order(rng, case, dtype, operands):
    """Every placement of batch and contracting dims, the operands computed by a
    kernel or passed in: values as jax.jit's, and XLA's gemm reads them as they are."""
    ls, rs, dims = case
    a, b = _inputs(rng, [ls, rs], dtype)
    pre = (lambda x: jnp.sin(x)) if operands == "kernel" else (lambda x: x)

    def fn(a, b):
        return jax.lax.dot_general(pre(a), pre(b), dims)

    _check(fn, a, b)
    with pallaskit.config.override(matmul_template="off"):
        _check(fn, a, b)
    assert not _dot_operands_in_gemm_order(_schedule(fn, a, b, matmul_template="off"))


# -- the flash-attention prototype (benchmarks/attention.py) -------------------------
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the smoke runs in Triton's interpreter (the CPU suite); a GPU runs the benchmark itself")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flash_prototype_smoke(dtype):
    """The prototype's smoke run (Triton's interpreter, sequence 40 over blocks of 16,
    3 heads): the raw Triton kernel inside the XLA program agrees with plain attention."""
    from benchmarks import attention

    rows = attention.main(["--smoke", "--dtype", dtype])  # raises SystemExit when a row disagrees
    flash = [r for r in rows if r["backend"].startswith("triton flash")]
    assert flash and all("error" not in r and r["max_err"] < (2e-2 if dtype == "bfloat16" else 1e-5) for r in flash)
