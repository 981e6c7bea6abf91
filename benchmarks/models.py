"""The ``models`` family: whole training steps and language-model idioms, each
written once in plain JAX and once in torch (benchmarks/workloads.py explains
the Workload fields and makes ``MODEL_SPECS`` into steady workloads).

Training steps are what a JAX user jits: ``jax.value_and_grad`` of the loss
and an AdamW update with global-norm clipping, written by hand as optax writes
them, in one function. Parameters and optimizer state are float32; the row's
dtype is the compute dtype (the inputs' dtype; the forward casts parameters to
it, as mixed-precision training does). Every input is a flat tuple of arrays:

    (batch arrays..., count, params..., mu..., nu...)  ->  (loss, params..., mu..., nu...)

``count`` is the optimizer's step count before the update (an int32 scalar).

[Note: optimizer state of the inputs]
A step starts at count 10 with a warm second moment ``nu`` (about 1e-6) and a
zero first moment ``mu``. The new ``mu`` is then 0.1 x the clipped gradient, so
the agreement check compares gradients undiluted, besides the loss and the
parameters that one step barely moves; and the update is smooth in the
gradient. A first step from zero moments would update by sign(g), which
rounding flips wherever a gradient is near zero (a whole array of them for a
bias the loss is blind to), and no tolerance tells that from a wrong gradient.

The torch twin of a step is what a torch user runs: the loss (torch.compile'd
for the compile backends), autograd, ``clip_grad_norm_`` and
``torch.optim.AdamW(fused=True)``. Its parameters and optimizer state are
copies of the inputs made on the first call with each input set (the inputs
are JAX arrays shared through DLPack and must not change), so every call after
that goes on training from where the last one left off, as JAX's timed calls
go on from the same inputs: the same work either way.

Attention is written with einsum and a float32 softmax in both frameworks
(no flash kernel on either side); heads are ``width // HEAD_DIM``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


FAMILY = "models"
HEAD_DIM = 64
# AdamW as in optax.adamw, gradients clipped first as optax.clip_by_global_norm
LR, B1, B2, EPS, WEIGHT_DECAY, MAX_NORM = 3e-4, 0.9, 0.999, 1e-8, 0.1, 1.0


def _normal(key, shape, dtype, shift=0.0, scale=1.0):
    # benchmarks/workloads.py imports this module to register its workloads: import it late
    from benchmarks.workloads import _normal as normal

    return normal(key, shape, dtype, shift, scale)


# -- parameter lists -----------------------------------------------------------------
# A model's parameters are a list of (name, shape, init); init is "ones", "zeros" or a
# normal's standard deviation. The flat input tuple follows the list's order.
def gpt2_block_params(d: int, prefix: str = "") -> list:
    """15 arrays: q, k, v projections apart, and no key bias (Whisper's choice: softmax is blind to
    it, so its gradient is zero and what the check would compare is rounding noise). Biases are
    drawn like weights: a model in training, not at its initialization."""
    w = 0.02
    return [(prefix + n, s, i) for n, s, i in [
        ("ln1_w", (d,), "ones"), ("ln1_b", (d,), w),
        ("wq", (d, d), w), ("bq", (d,), w), ("wk", (d, d), w), ("wv", (d, d), w), ("bv", (d,), w),
        ("wo", (d, d), w), ("bo", (d,), w), ("ln2_w", (d,), "ones"), ("ln2_b", (d,), w),
        ("w_fc", (d, 4 * d), w), ("b_fc", (4 * d,), w), ("w_proj", (4 * d, d), w), ("b_proj", (d,), w)]]


def gpt2_lm_params(layers: int, d: int, vocab: int) -> list:
    """GPT-2 without its embedding tables (the batch is the embedded tokens): 15 arrays a
    layer, the final LayerNorm and an untied head."""
    out = []
    for i in range(layers):
        out += gpt2_block_params(d, f"h{i}.")
    return out + [("lnf_w", (d,), "ones"), ("lnf_b", (d,), "zeros"), ("w_head", (d, vocab), 0.02)]


def llama_block_params(d: int, f: int) -> list:
    w = 0.02
    return [("attn_norm", (d,), "ones"), ("wq", (d, d), w), ("wk", (d, d), w), ("wv", (d, d), w),
            ("wo", (d, d), w), ("mlp_norm", (d,), "ones"), ("w_gate", (d, f), w), ("w_up", (d, f), w),
            ("w_down", (f, d), w)]


def resnet_block_params(c: int) -> list:
    w = (9 * c) ** -0.5
    return [("conv1", (3, 3, c, c), w), ("bn1_g", (c,), "ones"), ("bn1_b", (c,), 0.02),
            ("conv2", (3, 3, c, c), w), ("bn2_g", (c,), "ones"), ("bn2_b", (c,), 0.02)]


def _init(spec, key, dtype=jnp.float32) -> tuple:
    keys = jax.random.split(key, len(spec))
    out = []
    for (_, shape, init), k in zip(spec, keys):
        if init == "ones":
            out.append(jnp.ones(shape, dtype))
        elif init == "zeros":
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append(_normal(k, shape, dtype, scale=init))
    return tuple(out)


def _named(spec, arrays) -> dict:
    return {name: a for (name, _, _), a in zip(spec, arrays)}


# -- JAX: the layers -------------------------------------------------------------------
def _layernorm(x, w, b, eps=1e-5):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w + b).astype(x.dtype)


def _rmsnorm(x, w, eps=1e-6):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w).astype(x.dtype)


def _heads(x):
    b, t, d = x.shape
    return x.reshape(b, t, d // HEAD_DIM, HEAD_DIM)


def _causal_attention(q, k, v):
    """q, k, v: [B, T, H, hd] -> [B, T, H * hd]; scores and softmax in float32."""
    b, t, h, hd = q.shape
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * hd ** -0.5
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    s = jnp.where(causal, s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, h * hd)


def gpt2_block(p: dict, x, prefix: str = ""):
    """Pre-LayerNorm GPT-2 block; parameters cast to x's dtype."""
    c = {k[len(prefix):]: v.astype(x.dtype) for k, v in p.items() if k.startswith(prefix)}
    h = _layernorm(x, p[prefix + "ln1_w"], p[prefix + "ln1_b"])
    q, k, v = _heads(h @ c["wq"] + c["bq"]), _heads(h @ c["wk"]), _heads(h @ c["wv"] + c["bv"])
    x = x + _causal_attention(q, k, v) @ c["wo"] + c["bo"]
    h = _layernorm(x, p[prefix + "ln2_w"], p[prefix + "ln2_b"])
    return x + jax.nn.gelu(h @ c["w_fc"] + c["b_fc"], approximate=True) @ c["w_proj"] + c["b_proj"]


def _rope(x):
    """Rotary embedding (rotate-half form) of [B, T, H, hd], in float32."""
    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 10000.0 ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
    angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    return (xf * cos + jnp.concatenate([-x2, x1], axis=-1) * sin).astype(x.dtype)


def llama_block(p: dict, x):
    c = {k: v.astype(x.dtype) for k, v in p.items()}
    h = _rmsnorm(x, p["attn_norm"])
    q, k, v = _heads(h @ c["wq"]), _heads(h @ c["wk"]), _heads(h @ c["wv"])
    x = x + _causal_attention(_rope(q), _rope(k), v) @ c["wo"]
    h = _rmsnorm(x, p["mlp_norm"])
    return x + (jax.nn.silu(h @ c["w_gate"]) * (h @ c["w_up"])) @ c["w_down"]


def _conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _batchnorm(x, g, b, eps=1e-5):
    """Training-mode BatchNorm of NHWC x: batch statistics over N, H, W, in float32."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=(0, 1, 2))
    var = jnp.mean(jnp.square(xf - mean), axis=(0, 1, 2))
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * g + b).astype(x.dtype)


def resnet_block(p: dict, x):
    c = {k: v.astype(x.dtype) for k, v in p.items()}
    y = jax.nn.relu(_batchnorm(_conv(x, c["conv1"]), p["bn1_g"], p["bn1_b"]))
    y = _batchnorm(_conv(y, c["conv2"]), p["bn2_g"], p["bn2_b"])
    return jax.nn.relu(y + x)


def cross_entropy_take(logits, labels):
    """Mean cross-entropy over integer labels as optax writes it (take_along_axis)."""
    lf = logits.astype(jnp.float32)
    label_logits = jnp.take_along_axis(lf, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(lf, axis=-1) - label_logits)


def cross_entropy_one_hot(logits, labels):
    lf = logits.astype(jnp.float32)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, lf.shape[-1]) * jax.nn.log_softmax(lf, axis=-1), axis=-1))


# -- JAX: losses, AdamW, steps ---------------------------------------------------------
def _mse(y, target):
    return jnp.mean(jnp.square(y.astype(jnp.float32) - target.astype(jnp.float32)))


def _block_loss(block, spec_fn):
    def loss(params, x, target):
        return _mse(block(_named(spec_fn(params), params), x), target)
    return loss


def _gpt2_lm_loss(params, x, labels):
    layers = (len(params) - 3) // 15
    p = _named(gpt2_lm_params(layers, x.shape[-1], params[-1].shape[-1]), params)
    for i in range(layers):
        x = gpt2_block(p, x, f"h{i}.")
    h = _layernorm(x, p["lnf_w"], p["lnf_b"])
    logits = h.reshape(-1, h.shape[-1]) @ p["w_head"].astype(x.dtype)
    return cross_entropy_take(logits, labels.reshape(-1))


def adamw(params, grads, mu, nu, count, clip: bool = True):
    """optax.chain(clip_by_global_norm(MAX_NORM), adamw(LR, B1, B2, EPS, WEIGHT_DECAY)) and
    optax.apply_updates, by hand, over tuples of arrays."""
    if clip:
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in grads))
        grads = tuple(jnp.where(norm < MAX_NORM, g, g / norm * MAX_NORM) for g in grads)
    mu = tuple(B1 * m + (1 - B1) * g for m, g in zip(mu, grads))
    nu = tuple(B2 * v + (1 - B2) * jnp.square(g) for v, g in zip(nu, grads))
    t = (count + 1).astype(jnp.float32)
    bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
    new = tuple(p - LR * ((m / bc1) / (jnp.sqrt(v / bc2) + EPS) + WEIGHT_DECAY * p)
                for p, m, v in zip(params, mu, nu))
    return new, mu, nu


def train_step(loss, n_batch: int):
    """The jitted step of ``loss(params, *batch)``: (batch..., count, params, mu, nu) ->
    (loss, params, mu, nu)."""
    def step(*inputs):
        batch, count, state = inputs[:n_batch], inputs[n_batch], inputs[n_batch + 1:]
        n = len(state) // 3
        params, mu, nu = state[:n], state[n:2 * n], state[2 * n:]
        value, grads = jax.value_and_grad(loss)(params, *batch)
        new, mu, nu = adamw(params, grads, mu, nu, count)
        return (value, *new, *mu, *nu)
    step.__name__ = step.__qualname__ = f"{loss.__name__}_train_step"
    return step


def adamw_step(clip: bool):
    """The optimizer alone: (count, params, grads, mu, nu) -> (params, mu, nu)."""
    def step(count, *state):
        n = len(state) // 4
        new, mu, nu = adamw(state[:n], state[n:2 * n], state[2 * n:3 * n], state[3 * n:], count, clip)
        return (*new, *mu, *nu)
    step.__name__ = step.__qualname__ = "adamw_clip_update" if clip else "adamw_update"
    return step


def gpt2_block_fwd(x, *params):
    return gpt2_block(_named(gpt2_block_params(x.shape[-1]), params), x)


def _lstm_cell(wx, wh, b):
    def cell(carry, x_t):
        h, c = carry
        gates = (x_t @ wx + h @ wh).astype(jnp.float32) + b.astype(jnp.float32)
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = (jax.nn.sigmoid(o) * jnp.tanh(c)).astype(x_t.dtype)
        return (h, c), h
    return cell


def lstm(xs, wx, wh, b):
    """An LSTM layer over xs [T, B, H] under lax.scan: (every h, the last c in float32)."""
    _, batch, hidden = xs.shape
    init = (jnp.zeros((batch, hidden), xs.dtype), jnp.zeros((batch, hidden), jnp.float32))
    (_, c), hs = jax.lax.scan(_lstm_cell(wx, wh, b), init, xs)
    return hs, c


def embedding_grad(table, ids, dy):
    """The gradient of an embedding lookup ``table[ids]`` with respect to the table,
    given the rows' cotangent ``dy`` (in the table's dtype, as jax.vjp gives it): a
    scatter-add of N rows into V, any id hitting any row (pallaskit: atomic adds,
    [Note: atomic scatters] in lowering/ir.py)."""
    return jax.vjp(lambda t: t[ids], table)[1](dy)[0]


def _xent_fwd_bwd(loss):
    def fn(logits, labels):
        return jax.value_and_grad(loss)(logits, labels)
    fn.__name__ = fn.__qualname__ = loss.__name__ + "_fwd_bwd"
    return fn


# -- torch ---------------------------------------------------------------------------
def _t_layernorm(x, w, b, eps=1e-5):
    import torch

    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    return ((xf - mean) * torch.rsqrt(var + eps) * w + b).to(x.dtype)


def _t_rmsnorm(x, w, eps=1e-6):
    import torch

    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def _t_heads(x):
    b, t, d = x.shape
    return x.reshape(b, t, d // HEAD_DIM, HEAD_DIM)


def _t_causal_attention(q, k, v):
    import torch

    b, t, h, hd = q.shape
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * hd ** -0.5
    causal = torch.ones((t, t), dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, torch.finfo(torch.float32).min)
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, t, h * hd)


def _t_gpt2_block(p: dict, x, prefix: str = ""):
    import torch.nn.functional as F

    c = {k[len(prefix):]: v.to(x.dtype) for k, v in p.items() if k.startswith(prefix)}
    h = _t_layernorm(x, p[prefix + "ln1_w"], p[prefix + "ln1_b"])
    q, k, v = _t_heads(h @ c["wq"] + c["bq"]), _t_heads(h @ c["wk"]), _t_heads(h @ c["wv"] + c["bv"])
    x = x + _t_causal_attention(q, k, v) @ c["wo"] + c["bo"]
    h = _t_layernorm(x, p[prefix + "ln2_w"], p[prefix + "ln2_b"])
    return x + F.gelu(h @ c["w_fc"] + c["b_fc"], approximate="tanh") @ c["w_proj"] + c["b_proj"]


def _t_rope(x):
    import torch

    t, hd = x.shape[1], x.shape[-1]
    inv_freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32, device=x.device) / hd)
    angles = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos()] * 2, dim=-1)[None, :, None, :]
    sin = torch.cat([angles.sin()] * 2, dim=-1)[None, :, None, :]
    xf = x.float()
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def _t_llama_block(p: dict, x):
    import torch.nn.functional as F

    c = {k: v.to(x.dtype) for k, v in p.items()}
    h = _t_rmsnorm(x, p["attn_norm"])
    q, k, v = _t_heads(h @ c["wq"]), _t_heads(h @ c["wk"]), _t_heads(h @ c["wv"])
    x = x + _t_causal_attention(_t_rope(q), _t_rope(k), v) @ c["wo"]
    h = _t_rmsnorm(x, p["mlp_norm"])
    return x + (F.silu(h @ c["w_gate"]) * (h @ c["w_up"])) @ c["w_down"]


def _t_batchnorm(x, g, b, eps=1e-5):
    import torch.nn.functional as F

    return F.batch_norm(x.float(), None, None, g, b, training=True, eps=eps).to(x.dtype)


def _t_resnet_block(p: dict, x):
    """x is NHWC; its NCHW view is channels-last, as torch runs NHWC convolutions."""
    import torch
    import torch.nn.functional as F

    xn = x.permute(0, 3, 1, 2)
    w1, w2 = (p[n].to(x.dtype).permute(3, 2, 0, 1) for n in ("conv1", "conv2"))  # HWIO -> OIHW
    y = torch.relu(_t_batchnorm(F.conv2d(xn, w1, padding=1), p["bn1_g"], p["bn1_b"]))
    y = _t_batchnorm(F.conv2d(y, w2, padding=1), p["bn2_g"], p["bn2_b"])
    return torch.relu(y + xn).permute(0, 2, 3, 1)


def _t_mse(y, target):
    return (y.float() - target.float()).pow(2).mean()


def _t_block_loss(block, spec_fn):
    def loss(x, target, *params):
        return _t_mse(block(_named(spec_fn(params), params), x), target)
    return loss


def _t_gpt2_lm_loss(x, labels, *params):
    import torch.nn.functional as F

    layers = (len(params) - 3) // 15
    p = _named(gpt2_lm_params(layers, x.shape[-1], params[-1].shape[-1]), params)
    for i in range(layers):
        x = _t_gpt2_block(p, x, f"h{i}.")
    h = _t_layernorm(x, p["lnf_w"], p["lnf_b"])
    logits = h.reshape(-1, h.shape[-1]) @ p["w_head"].to(x.dtype)
    return F.cross_entropy(logits.float(), labels.reshape(-1).long())


def _t_optimizer(torch, params, mu, nu, count, fused: bool):
    """torch.optim.AdamW over ``params`` with its state set to (mu, nu, count)."""
    device = params[0].device
    # the compiled (foreach) form is capturable on the GPU: bias corrections from a step count on the
    # device, no .item() for torch.compile to trace
    kwargs = {"fused": True} if fused else {"foreach": True, "capturable": device.type == "cuda"}
    opt = torch.optim.AdamW(params, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WEIGHT_DECAY, **kwargs)
    on_device = fused or kwargs["capturable"]
    for p, m, v in zip(params, mu, nu):
        # fused and capturable AdamW keep the step count as a float32 tensor on the parameter's device
        opt.state[p] = {"step": torch.tensor(float(count), dtype=torch.float32, device=device if on_device else "cpu"),
                        "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    return opt


def _t_state(opt, params):
    return ([opt.state[p]["exp_avg"] for p in params], [opt.state[p]["exp_avg_sq"] for p in params])


def _t_train_step(loss, n_batch: int):
    """Builder: the compiled (or eager) loss, autograd, clip_grad_norm_, AdamW(fused=True)."""
    def build(compile):
        import torch

        loss_fn = compile(loss)
        runs = {}  # first input array's address -> (params, optimizer): one per input set

        def step(*inputs):
            batch, count, state = inputs[:n_batch], inputs[n_batch], inputs[n_batch + 1:]
            n = len(state) // 3
            key = state[0].data_ptr()
            if key not in runs:
                params = [t.detach().clone().requires_grad_() for t in state[:n]]
                runs[key] = params, _t_optimizer(torch, params, state[n:2 * n], state[2 * n:], count.item(), True)
            params, opt = runs[key]
            opt.zero_grad(set_to_none=True)
            value = loss_fn(*batch, *params)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            opt.step()
            mu, nu = _t_state(opt, params)
            return (value.detach(), *params, *mu, *nu)
        return step
    return build


def _t_adamw_step(clip: bool):
    """Builder: eager is AdamW(fused=True); a compile backend compiles the step of the
    default (foreach) AdamW, torch's compiled-optimizer recipe."""
    def build(compile):
        import torch

        def update(opt, params):
            if clip:
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            opt.step()
        compiled = compile(update)
        fused = compiled is update  # eager
        runs = {}

        def step(count, *state):
            n = len(state) // 4
            key = state[0].data_ptr()
            if key not in runs:
                params = [t.detach().clone() for t in state[:n]]
                for p, g in zip(params, state[n:2 * n]):
                    p.grad = g.clone()  # clip_grad_norm_ scales gradients in place
                runs[key] = params, _t_optimizer(torch, params, state[2 * n:3 * n], state[3 * n:], count.item(),
                                                 fused)
            params, opt = runs[key]
            compiled(opt, params)
            mu, nu = _t_state(opt, params)
            return (*params, *mu, *nu)
        return step
    return build


def _t_gpt2_block_fwd(x, *params):
    return _t_gpt2_block(_named(gpt2_block_params(x.shape[-1]), params), x)


def _t_lstm(xs, wx, wh, b):
    import torch

    _, batch, hidden = xs.shape
    h = torch.zeros((batch, hidden), dtype=xs.dtype, device=xs.device)
    c = torch.zeros((batch, hidden), dtype=torch.float32, device=xs.device)
    hs = []
    for x_t in xs.unbind(0):
        gates = (x_t @ wx + h @ wh).float() + b.float()
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = (torch.sigmoid(o) * torch.tanh(c)).to(xs.dtype)
        hs.append(h)
    return torch.stack(hs), c


def _t_embedding_grad(compile):
    """torch: the same gradient by ``index_add_`` (what F.embedding's backward computes)."""
    def grad(table, ids, dy):
        import torch

        return torch.zeros_like(table).index_add_(0, ids.long(), dy)

    return compile(grad)


def _t_xent(form: str):
    def loss(logits, labels):
        import torch.nn.functional as F

        lf = logits.float()
        if form == "take":
            return F.cross_entropy(lf, labels.long())
        return -(F.one_hot(labels.long(), lf.shape[-1]) * F.log_softmax(lf, dim=-1)).sum(-1).mean()

    def build(compile):
        import torch

        loss_fn = compile(loss)

        def fn(logits, labels):
            logits = logits.detach().requires_grad_()
            value = loss_fn(logits, labels)
            return value.detach(), torch.autograd.grad(value, logits)[0]
        return fn
    return build


def _whole(fn):
    return lambda compile: compile(fn)


# -- inputs ----------------------------------------------------------------------------
def _split(key, n):
    return jax.random.split(key, n)


def _train_inputs(batch, spec, key):
    """batch arrays, count, params, mu, nu: see [Note: optimizer state of the inputs]."""
    k = _split(key, 2)
    params = _init(spec, k[0])
    mu = tuple(jnp.zeros_like(p) for p in params)
    nu = tuple(jnp.square(_normal(kk, p.shape, jnp.float32, shift=3.0, scale=3e-4))
               for kk, p in zip(_split(k[1], len(params)), params))
    return (*batch, jnp.asarray(10, jnp.int32), *params, *mu, *nu)


def _gpt2_block_inputs(size, dtype, key):
    b, t, d = size
    k = _split(key, 3)
    return _train_inputs((_normal(k[0], (b, t, d), dtype), _normal(k[1], (b, t, d), dtype)),
                         gpt2_block_params(d), k[2])


def _llama_inputs(size, dtype, key):
    b, t, d, f = size
    k = _split(key, 3)
    return _train_inputs((_normal(k[0], (b, t, d), dtype), _normal(k[1], (b, t, d), dtype)),
                         llama_block_params(d, f), k[2])


def _labels(key, shape, vocab):
    return jax.random.randint(key, shape, 0, vocab, jnp.int32)


def _gpt2_lm_inputs(size, dtype, key):
    layers, b, t, d, vocab = size
    k = _split(key, 3)
    return _train_inputs((_normal(k[0], (b, t, d), dtype), _labels(k[1], (b, t), vocab)),
                         gpt2_lm_params(layers, d, vocab), k[2])


def _resnet_inputs(size, dtype, key):
    n, h, w, c = size
    k = _split(key, 3)
    return _train_inputs((_normal(k[0], (n, h, w, c), dtype), _normal(k[1], (n, h, w, c), dtype)),
                         resnet_block_params(c), k[2])


def _adamw_inputs(size, dtype, key):
    """GPT-2's parameter shapes (size: layers, width, vocab; the smoke size has no layer, only the
    final LayerNorm and head); gradients and a warm optimizer state at count 10, all float32 (the
    workload has float32 only)."""
    layers, d, vocab = size
    spec = gpt2_lm_params(layers, d, vocab)
    k = _split(key, 4)
    params = _init(spec, k[0])
    rnd = [tuple(_normal(kk, s, jnp.float32, scale=sc) for kk, (_, s, _) in zip(_split(kj, len(spec)), spec))
           for kj, sc in ((k[1], 1e-2), (k[2], 1e-3), (k[3], 1e-2))]
    grads, mu, nu_root = rnd
    nu = tuple(jnp.square(r) + 1e-6 for r in nu_root)
    return (jnp.asarray(10, jnp.int32), *params, *grads, *mu, *nu)


def _block_fwd_inputs(size, dtype, key):
    b, t, d = size
    k = _split(key, 2)
    params = _init(gpt2_block_params(d), k[1], dtype)
    return (_normal(k[0], (b, t, d), dtype), *params)


def _lstm_inputs(size, dtype, key):
    t, b, h = size
    k = _split(key, 4)
    return (_normal(k[0], (t, b, h), dtype), _normal(k[1], (h, 4 * h), dtype, scale=h ** -0.5),
            _normal(k[2], (h, 4 * h), dtype, scale=h ** -0.5), _normal(k[3], (4 * h,), dtype, scale=0.1))


def _embedding_grad_inputs(size, dtype, key):
    vocab, d, n = size
    k = _split(key, 3)
    return _normal(k[0], (vocab, d), dtype), _labels(k[1], (n,), vocab), _normal(k[2], (n, d), dtype)


def _xent_inputs(size, dtype, key):
    n, vocab = size
    k = _split(key, 2)
    return _normal(k[0], (n, vocab), dtype, scale=2.0), _labels(k[1], (n,), vocab)


# -- FLOPs (matrix products; a training step counts the backward as twice the forward) --
def _attention_flops(b, t, d):
    return 2 * 2 * b * t * t * d  # scores and weighted sum, the whole square (no causal skipping)


def _gpt2_block_fwd_flops(b, t, d):
    return 2 * b * t * (4 * d * d + 8 * d * d) + _attention_flops(b, t, d)


def _llama_fwd_flops(b, t, d, f):
    return 2 * b * t * (4 * d * d + 3 * d * f) + _attention_flops(b, t, d)


def _resnet_fwd_flops(n, h, w, c):
    return 2 * 2 * n * h * w * 9 * c * c


def _flops_gpt2_lm(size):
    layers, b, t, d, vocab = size
    return 3 * (layers * _gpt2_block_fwd_flops(b, t, d) + 2 * b * t * d * vocab)


# -- the workloads -----------------------------------------------------------------------
def _models(**kw):
    """A workload's fields; benchmarks/workloads.py makes the Workload (steady kind)."""
    return dict(tags=frozenset({"matmul", FAMILY}), family=FAMILY, **kw)


_GPT2_BLOCK_LOSS = _block_loss(gpt2_block, lambda params: gpt2_block_params(params[0].shape[0]))
_GPT2_BLOCK_LOSS.__name__ = "gpt2_block_loss"
_LLAMA_LOSS = _block_loss(llama_block, lambda params: llama_block_params(params[0].shape[0], params[6].shape[1]))
_LLAMA_LOSS.__name__ = "llama_block_loss"
_RESNET_LOSS = _block_loss(resnet_block, lambda params: resnet_block_params(params[0].shape[-1]))
_RESNET_LOSS.__name__ = "resnet_block_loss"
_T_GPT2_BLOCK_LOSS = _t_block_loss(_t_gpt2_block, lambda params: gpt2_block_params(params[0].shape[0]))
_T_LLAMA_LOSS = _t_block_loss(_t_llama_block, lambda params: llama_block_params(params[0].shape[0],
                                                                                params[6].shape[1]))
_T_RESNET_LOSS = _t_block_loss(_t_resnet_block, lambda params: resnet_block_params(params[0].shape[-1]))

# Agreement of a training step: each output array (loss, parameters, mu = 0.1 x gradient, nu)
# against the float32 reference, norm-wise. In bfloat16 a gradient is off by ~1e-2 (jax.jit
# itself); a ResNet block's bn1 bias gets 3e-2 to 0.12: BN2 after conv2 makes the loss nearly
# blind to it, so its gradient is the small rest of a cancellation.
TRAIN_TOL, RESNET_TOL = 8e-2, 0.2
_XENT = {"full": (8192, 50257), "smoke": (24, 200)}
_GPT2_SIZES = {"full": (8, 1024, 768), "smoke": (2, 8, 128)}

MODEL_SPECS = [
    _models(name="gpt2_block_train", jax_fn=train_step(_GPT2_BLOCK_LOSS, 2),
            torch_fn=_t_train_step(_T_GPT2_BLOCK_LOSS, 2), make_inputs=_gpt2_block_inputs, sizes=_GPT2_SIZES,
            description="GPT-2-small block (pre-LN, einsum attention, GELU MLP; B x T x width) training step: "
                        "value_and_grad of an MSE loss, clipped AdamW, one jit",
            flops=lambda s: 3 * _gpt2_block_fwd_flops(*s), tol=TRAIN_TOL),
    _models(name="llama_block_train", jax_fn=train_step(_LLAMA_LOSS, 2), torch_fn=_t_train_step(_T_LLAMA_LOSS, 2),
            make_inputs=_llama_inputs, sizes={"full": (4, 2048, 1024, 2816), "smoke": (2, 8, 128, 96)},
            description="Llama block (RMSNorm, rotary, SwiGLU; B x T x width x SwiGLU width) training step: "
                        "value_and_grad of an MSE loss, clipped AdamW, one jit",
            flops=lambda s: 3 * _llama_fwd_flops(*s), tol=TRAIN_TOL),
    _models(name="gpt2_12layer_train", jax_fn=train_step(_gpt2_lm_loss, 2),
            torch_fn=_t_train_step(_t_gpt2_lm_loss, 2), make_inputs=_gpt2_lm_inputs,
            sizes={"full": (12, 8, 1024, 768, 50257), "smoke": (2, 2, 8, 128, 96)},
            description="GPT-2 small (layers x B x T x width x vocab; 15 arrays a layer + final LN + head: 183 at "
                        "12 layers) on embedded tokens, cross-entropy head, training step with clipped AdamW",
            flops=_flops_gpt2_lm, tol=TRAIN_TOL),
    _models(name="adamw_update", jax_fn=adamw_step(False), torch_fn=_t_adamw_step(False),
            make_inputs=_adamw_inputs, sizes={"full": (12, 768, 50257), "smoke": (0, 16, 24)},
            description="AdamW alone over GPT-2 small's parameter shapes (layers x width x vocab: 183 float32 "
                        "arrays, 124M at full size); floor: read params, grads, mu, nu, write params, mu, nu",
            dtypes=("float32",)),
    _models(name="adamw_clip_update", jax_fn=adamw_step(True), torch_fn=_t_adamw_step(True),
            make_inputs=_adamw_inputs, sizes={"full": (12, 768, 50257), "smoke": (0, 16, 24)},
            description="AdamW with global-norm clipping alone, as adamw_update; the floor counts gradients read "
                        "once (clipping first needs their norm: two reads unless fused across arrays)",
            dtypes=("float32",)),
    _models(name="resnet_block_train", jax_fn=train_step(_RESNET_LOSS, 2), torch_fn=_t_train_step(_T_RESNET_LOSS, 2),
            make_inputs=_resnet_inputs, sizes={"full": (128, 56, 56, 64), "smoke": (2, 6, 5, 8)},
            description="ResNet basic block, NHWC (conv3x3, BatchNorm on batch statistics, ReLU, twice, residual) "
                        "training step: value_and_grad of an MSE loss, clipped AdamW, one jit",
            flops=lambda s: 3 * _resnet_fwd_flops(*s), tol=RESNET_TOL),
    _models(name="xent_take_along_axis", jax_fn=_xent_fwd_bwd(cross_entropy_take), torch_fn=_t_xent("take"),
            make_inputs=_xent_inputs, sizes=_XENT,
            description="cross-entropy over a vocabulary (rows x vocab logits, integer labels) and its gradient "
                        "w.r.t. the logits; labels picked with take_along_axis (optax's form)"),
    _models(name="xent_one_hot", jax_fn=_xent_fwd_bwd(cross_entropy_one_hot), torch_fn=_t_xent("one_hot"),
            make_inputs=_xent_inputs, sizes=_XENT,
            description="cross-entropy and its gradient as xent_take_along_axis, labels through jax.nn.one_hot"),
    dict(name="embedding_grad", jax_fn=embedding_grad, torch_fn=_t_embedding_grad,
         make_inputs=_embedding_grad_inputs, sizes={"full": (50257, 768, 8192), "smoke": (301, 24, 97)},
         description="the gradient of GPT-2's token embedding lookup table[ids] (vocab x width x ids; uniform "
                     "ids): a scatter-add of the ids' cotangent rows into the table's shape",
         tags=frozenset({FAMILY, "scatter"}), family=FAMILY, dtypes=("bfloat16", "float32")),
    _models(name="lstm_scan", jax_fn=lstm, torch_fn=_whole(_t_lstm), make_inputs=_lstm_inputs,
            sizes={"full": (128, 256, 1024), "smoke": (4, 3, 16)},
            description="LSTM layer under lax.scan (T x B x H; x_t @ Wx + h @ Wh each step); torch: the same "
                        "cell in a Python loop",
            flops=lambda s: s[0] * 2 * 2 * s[1] * s[2] * 4 * s[2], tol=5e-2),
    _models(name="gpt2_block_fwd", jax_fn=gpt2_block_fwd, torch_fn=_whole(_t_gpt2_block_fwd),
            make_inputs=_block_fwd_inputs, sizes=_GPT2_SIZES,
            description="GPT-2-small block forward (B x T x width), parameters in the row's dtype",
            flops=lambda s: _gpt2_block_fwd_flops(*s), tol=5e-2),
]


def parameter_count(workload_name: str, size) -> tuple[int, int]:
    """(arrays, elements) of a training step's parameters or the optimizer's, for reports."""
    spec = {"gpt2_block_train": lambda: gpt2_block_params(size[2]),
            "llama_block_train": lambda: llama_block_params(size[2], size[3]),
            "gpt2_12layer_train": lambda: gpt2_lm_params(size[0], size[3], size[4]),
            "adamw_update": lambda: gpt2_lm_params(*size), "adamw_clip_update": lambda: gpt2_lm_params(*size),
            "resnet_block_train": lambda: resnet_block_params(size[3])}[workload_name]()
    return len(spec), sum(math.prod(s) for _, s, _ in spec)


__all__ = ["MODEL_SPECS", "FAMILY", "parameter_count"]
