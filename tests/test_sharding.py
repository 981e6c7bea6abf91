"""Sharded arguments ([Note: sharding] in pallaskit/sharding.py): values and
output shardings against jax.jit on 8 simulated CPU devices (tests/conftest.py
sets ``--xla_force_host_platform_device_count=8``)."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import pallaskit
from conftest import assert_close

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _mesh(shape, names, explicit=False):
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    if explicit:
        types = (jax.sharding.AxisType.Explicit,) * len(names)
        return Mesh(devices, names, axis_types=types)
    return Mesh(devices, names)


def _check(out, ref, dtype=None):
    """Same values and equivalent shardings, leaf by leaf."""
    outs, refs = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert_close(o, r, dtype or r.dtype)
        assert o.sharding.is_equivalent_to(r.sharding, r.ndim), (o.sharding, r.sharding)
        assert o.sharding.device_set == r.sharding.device_set


def _special(rng, shape, dtype):
    """Random values with NaN, ±inf and ±0 in them (floats)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-50, 50, shape).astype(dtype)
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[: 5] = [np.nan, np.inf, -np.inf, 0.0, -0.0]
    return x.astype(dtype)


def _layouts():
    """(id, sharding maker of a 2-d array's shape)."""
    def named(shape, names, spec, explicit=False):
        return lambda: NamedSharding(_mesh(shape, names, explicit), P(*spec))

    out = [
        ("1d_rows", named((8,), ("x",), ("x",))),
        ("2d_both", named((2, 4), ("a", "b"), ("a", "b"))),
        ("2d_cols", named((4, 2), ("a", "b"), (None, ("a", "b")))),
        ("2d_rows_partial", named((2, 4), ("a", "b"), ("a",))),
        ("replicated", named((2, 4), ("a", "b"), ())),
        ("explicit_2d", named((2, 4), ("a", "b"), ("a", "b"), explicit=True)),
        ("device3", lambda: jax.sharding.SingleDeviceSharding(jax.devices()[3])),
    ]
    try:  # GSPMD-style (what PositionalSharding was): an HLO sharding over a device list
        from jax._src.sharding_impls import GSPMDSharding

        def gspmd():
            ref = NamedSharding(_mesh((2, 4), ("a", "b")), P("b", "a"))
            return GSPMDSharding(tuple(jax.devices()), ref._to_xla_hlo_sharding(2))
        out.append(("gspmd", gspmd))
    except ImportError:
        pass
    return out


LAYOUTS = _layouts()


@needs8
@pytest.mark.parametrize("layout", [s for _, s in LAYOUTS], ids=[n for n, _ in LAYOUTS])
def test_pointwise_and_reductions_any_sharding(layout, rng):
    """A pointwise op, a row reduction (over the sharded column axis too) and
    a full reduction: jax.jit's values and output shardings."""
    def f(x, y):
        z = jnp.tanh(x) * 2 + y
        # max over y: XLA's cross-device max drops NaN (jax.jit itself gives no NaN there)
        return z, jnp.sum(z * z, axis=1), jnp.max(y, axis=0), jnp.mean(jnp.abs(x))

    s = layout()
    x = jax.device_put(_special(rng, (16, 24), np.float32), s)
    y = jax.device_put(rng.standard_normal((16, 24)).astype(np.float32), s)
    _check(pallaskit.jit(f)(x, y), jax.jit(f)(x, y))
    _check(pallaskit.jit(f)(x, y), jax.jit(f)(x, y))  # the dispatch fast path


@needs8
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.int32, np.bool_])
def test_dtypes_sharded(dtype, rng):
    def f(x):
        if x.dtype == np.bool_:
            return jnp.logical_not(x), jnp.any(x, axis=0)
        return x * 3 - 1, jnp.sum(x, axis=1), jnp.max(jnp.nan_to_num(x))  # cross-device max drops NaN

    s = NamedSharding(_mesh((2, 4), ("a", "b")), P("b", "a"))
    x = jax.device_put(jnp.asarray(_special(rng, (12, 6), dtype), dtype), s)
    _check(pallaskit.jit(f)(x), jax.jit(f)(x), dtype)


@needs8
def test_odd_and_size_one_dims(rng):
    """Odd sizes (6 x 5 over a 2 x 4 mesh, rows sharded) and a size-1 dim."""
    mesh = _mesh((2, 4), ("a", "b"))
    f = lambda x, b: jax.nn.relu(x + b) / (1 + jnp.sum(x, axis=0, keepdims=True))  # noqa: E731
    x = jax.device_put(rng.standard_normal((6, 5)).astype(np.float32), NamedSharding(mesh, P("a")))
    b = jax.device_put(rng.standard_normal((1, 5)).astype(np.float32), NamedSharding(mesh, P()))
    _check(pallaskit.jit(f)(x, b), jax.jit(f)(x, b))


@needs8
def test_array_on_device_3(rng):
    const = rng.standard_normal((3,)).astype(np.float32)  # a hoisted constant: placed on device 3 too
    g = lambda x: (jnp.exp(x) * const) @ x.T  # noqa: E731
    x = jax.device_put(rng.standard_normal((5, 3)).astype(np.float32), jax.devices()[3])
    f = pallaskit.jit(g)
    out = f(x)
    _check(out, jax.jit(g)(x))
    assert out.devices() == {jax.devices()[3]}
    # the same shape on the default device is another signature
    y = jnp.asarray(np.asarray(x))
    _check(f(y), jax.jit(g)(y))
    assert f(y).devices() == {jax.devices()[0]}
    # committed to the default device: outputs committed, as jax.jit's (they were not); twice: the fast path
    z = jax.device_put(np.asarray(x), jax.devices()[0])
    for _ in range(2):
        assert f(z).committed and jax.jit(g)(z).committed and not f(y).committed


@needs8
def test_closed_over_arrays_on_other_devices_place_nothing(rng, tmp_path):
    """A function closing over an array committed to device 3, sharded over a
    mesh, or a key on device 3: jax.jit's outputs stay on the default device,
    uncommitted (a committed argument still places them); the graph cache's
    entry of such a program loads in a later call (``clear_cache``)."""
    mesh = _mesh((2, 4), ("a", "b"))
    w3 = jax.device_put(rng.standard_normal((3, 4)).astype(np.float32), jax.devices()[3])
    wsh = jax.device_put(rng.standard_normal((3, 4)).astype(np.float32), NamedSharding(mesh, P(None, "b")))
    key3 = jax.device_put(jax.random.key(7), jax.devices()[3])
    fns = [lambda x: jnp.tanh(x @ w3) + 1, lambda x: jnp.tanh(x @ wsh) + 1,
           lambda x: x + jax.random.normal(key3, x.shape)]
    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    y = jax.device_put(np.asarray(x), jax.devices()[5])
    with pallaskit.config.override(cache_dir=str(tmp_path)):
        for g in fns:
            f = pallaskit.jit(g)
            for _ in range(2):  # compiled, then loaded from the graph cache
                for arg in (x, y):
                    out, ref = f(arg), jax.jit(g)(arg)
                    _check(out, ref)
                    assert out.committed == ref.committed
                f.clear_cache()
            # transformed: jax.vmap's outputs stay on the default device; jax.grad's cotangents are placed
            # with the closed-over array, on its device or split as jax.jit splits them over its mesh
            # ([Note: placed residuals] in pallaskit/autodiff.py: the sharded one's came out replicated);
            # a second function's backward loads from the graph cache (on the mesh's devices: it did not load)
            xs = jnp.stack([x, -x])
            _check(jax.vmap(pallaskit.jit(g))(xs), jax.vmap(jax.jit(g))(xs))
            ref = jax.grad(jax.jit(lambda x: g(x).sum()))(x)
            for _ in range(2):
                pallaskit.metrics.reset()
                out = jax.grad(pallaskit.jit(lambda x: g(x).sum()))(x)
                _check(out, ref)
                assert out.committed == ref.committed
            assert pallaskit.metrics.counters["cache_hits"] == 2 and pallaskit.metrics.counters["cache_misses"] == 0


@needs8
def test_nested_pallaskit_function_keeps_the_split(rng):
    """A pallaskit function called inside another is traced into it
    ([Note: nested pallaskit functions] in pallaskit/signature.py): compiled
    apart, its kernels were opaque to the partitioner and the sum over the
    split rows came out replicated where jax.jit's stays split. Under the
    user's jax.jit of sharded arrays it runs through XLA
    (``sharding.staged_over_devices``)."""
    mesh = _mesh((2, 4), ("a", "b"))
    inner = pallaskit.jit(lambda x: jnp.exp(x) * 2)
    f = lambda x, y: (inner(x) + y, inner(y).sum(0))  # noqa: E731
    g = lambda x, y: (jnp.exp(x) * 2 + y, (jnp.exp(y) * 2).sum(0))  # noqa: E731
    s = NamedSharding(mesh, P("a", "b"))
    x, y = (jax.device_put(rng.standard_normal((8, 16)).astype(np.float32), s) for _ in range(2))
    ref = jax.jit(g)(x, y)
    assert ref[1].sharding.spec == P("b")
    _check(pallaskit.jit(f)(x, y), ref)
    # under the user's jax.jit the kernels would be as opaque: the original function runs there
    _check(jax.jit(f)(x, y), ref)


@needs8
def test_sharded_with_scalars_numpy_and_uncommitted_arrays(rng):
    """Beside a sharded array: a Python scalar, a numpy array and an array
    on the default device that jax.jit moves (uncommitted)."""
    mesh = _mesh((2, 4), ("a", "b"))
    f = lambda x, s, n, u: (x * s + n) - jnp.sum(u, axis=0)  # noqa: E731
    x = jax.device_put(rng.standard_normal((4, 8)).astype(np.float32), NamedSharding(mesh, P("a", "b")))
    n = rng.standard_normal((4, 8)).astype(np.float32)
    u = jnp.asarray(rng.standard_normal((3, 8)).astype(np.float32))
    _check(pallaskit.jit(f)(x, 2.5, n, u), jax.jit(f)(x, 2.5, n, u))
    _check(pallaskit.jit(f)(x, 2.5, n, u), jax.jit(f)(x, 2.5, n, u))


@needs8
def test_graph_cache_serves_sharded_executables(rng):
    """A second JitFunction of the same sharded signature loads the cached
    executable (its shardings and devices included); another sharding of the
    same shapes is another entry."""
    mesh = _mesh((2, 4), ("a", "b"))
    f = lambda x: jnp.tanh(x) * jnp.arange(8.0)  # noqa: E731  (a hoisted constant, replicated)
    x = jax.device_put(rng.standard_normal((4, 8)).astype(np.float32), NamedSharding(mesh, P("a", "b")))
    _check(pallaskit.jit(f)(x), jax.jit(f)(x))
    pallaskit.metrics.reset()
    _check(pallaskit.jit(f)(x), jax.jit(f)(x))
    assert pallaskit.metrics.counters["cache_hits"] == 1 and pallaskit.metrics.counters["cache_misses"] == 0
    y = jax.device_put(np.asarray(x), NamedSharding(mesh, P("b", "a")))
    _check(pallaskit.jit(f)(y), jax.jit(f)(y))
    assert pallaskit.metrics.counters["cache_misses"] == 1


# --------------------------------------------------------------------------- #
# MLP layouts: data-parallel, fully sharded, tensor-parallel
# --------------------------------------------------------------------------- #
def _mlp_loss(params, x, y):
    w1, b1, w2, b2 = params
    h = jax.nn.gelu(x @ w1 + b1)
    out = h @ w2 + b2
    return jnp.mean((out - y) ** 2)


def _sgd_step(params, x, y):
    loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
    return loss, jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)


def _mlp_args(rng, layout, mesh_shape=(2, 4), explicit=False):
    """(params, x, y) placed for ``layout`` on a (data, model) mesh."""
    mesh = _mesh(mesh_shape, ("data", "model"), explicit)
    batch, d_in, hidden, d_out = 16, 12, 32, 8
    specs = {
        # batch sharded, params replicated
        "dp": dict(x=P("data"), w1=P(), b1=P(), w2=P(), b2=P()),
        # batch sharded, params sharded too (FSDP: gathered for use)
        "fsdp": dict(x=P("data"), w1=P("model"), b1=P("model"), w2=P("model"), b2=P()),
        # Megatron MLP: W1 column-sharded, W2 row-sharded, the psum implicit
        "tp": dict(x=P(), w1=P(None, "model"), b1=P("model"), w2=P("model", None), b2=P()),
    }[layout]
    put = lambda a, spec: jax.device_put(a.astype(np.float32), NamedSharding(mesh, spec))  # noqa: E731
    params = (put(rng.standard_normal((d_in, hidden)) / 4, specs["w1"]),
              put(rng.standard_normal((hidden,)) / 4, specs["b1"]),
              put(rng.standard_normal((hidden, d_out)) / 4, specs["w2"]),
              put(rng.standard_normal((d_out,)) / 4, specs["b2"]))
    x = put(rng.standard_normal((batch, d_in)), specs["x"])
    y = put(rng.standard_normal((batch, d_out)), specs["x"])
    return mesh, params, x, y


@needs8
@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_mlp_training_step_whole_graph(layout, rng):
    """value_and_grad + SGD compiled as one pallaskit graph."""
    _, params, x, y = _mlp_args(rng, layout, (4, 2) if layout == "fsdp" else (2, 4))
    _check(pallaskit.jit(_sgd_step)(params, x, y), jax.jit(_sgd_step)(params, x, y))


@needs8
@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_mlp_grad_of_pallaskit_loss(layout, rng):
    """jax.value_and_grad of a pallaskit loss (the custom_vjp halves compiled
    for sharded operands), forward and grad, then an SGD update."""
    _, params, x, y = _mlp_args(rng, layout)
    loss_fn = pallaskit.jit(_mlp_loss)
    out = jax.value_and_grad(loss_fn)(params, x, y)
    ref = jax.jit(jax.value_and_grad(_mlp_loss))(params, x, y)
    _check(out, ref)
    new = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, out[1])
    _check(loss_fn(new, x, y), jax.jit(_mlp_loss)(new, x, y))


@needs8
def test_explicit_mesh(rng):
    """A mesh with Explicit axes (jax.make_mesh's default): a concrete call is
    traced over its Auto twin and keeps the explicit output shardings; traced
    calls on it (jax.jit, jax.grad, which needs jax.set_mesh there as for
    jax.jit) run the function through XLA, with one log line."""
    mesh, params, x, y = _mlp_args(rng, "dp", explicit=True)
    _check(pallaskit.jit(_sgd_step)(params, x, y), jax.jit(_sgd_step)(params, x, y))
    loss_fn = pallaskit.jit(_mlp_loss)
    _check(jax.jit(lambda *a: loss_fn(*a) * 2)(params, x, y), jax.jit(lambda *a: _mlp_loss(*a) * 2)(params, x, y))
    with jax.set_mesh(mesh):
        out = jax.value_and_grad(loss_fn)(params, x, y)
        ref = jax.jit(jax.value_and_grad(_mlp_loss))(params, x, y)
    _check(out, ref)
    assert pallaskit.metrics.counters["autodiff_fallbacks"] == 2


@needs8
@pytest.mark.parametrize("stage", ["call", "compiled"])
def test_code_reading_explicit_sharding_types(stage, rng):
    """A function that reads its arguments' types on an explicit mesh
    (``jax.typeof(x).sharding.spec``) was traced over the mesh's Auto twin,
    whose types name no axis, and returned another value than jax.jit's; it
    now runs through XLA. A function that reads nothing stays pallaskit's."""
    mesh = _mesh((2, 4), ("a", "b"), explicit=True)
    x = jax.device_put(jnp.asarray(rng.standard_normal((8, 12)), jnp.float32), NamedSharding(mesh, P("a")))

    def reads(x):
        scale = 2.0 if jax.typeof(x).sharding.spec[0] == "a" else 3.0
        return jnp.tanh(x) * scale, x.sum(0)

    def plain(x):
        return jnp.tanh(x) * 2.0, x.sum(0)

    for fn, falls_back in ((reads, 1), (plain, 0)):
        before = pallaskit.metrics.counters["autodiff_fallbacks"]
        jf = pallaskit.jit(fn)
        out = jf(x) if stage == "call" else jf.lower(x).compile()(x)
        _check(out, jax.jit(fn)(x))
        assert pallaskit.metrics.counters["autodiff_fallbacks"] - before == falls_back


# --------------------------------------------------------------------------- #
# sharding constraints, shard_map, collectives
# --------------------------------------------------------------------------- #
@needs8
@pytest.mark.parametrize("sharded_input", [False, True])
def test_with_sharding_constraint_kept(sharded_input, rng):
    mesh = _mesh((2, 4), ("a", "b"))

    def f(x):
        y = jax.lax.with_sharding_constraint(jnp.tanh(x), NamedSharding(mesh, P("b", "a")))
        return y * 2 + 1, jnp.sum(y, axis=0)

    x = rng.standard_normal((8, 16)).astype(np.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("a"))) if sharded_input else jnp.asarray(x)
    out, ref = pallaskit.jit(f)(x), jax.jit(f)(x)
    _check(out, ref)
    assert ref[0].sharding.spec == P("b", "a")  # the constraint reaches the output


@needs8
def test_shard_map_inside_jit_check_vma(rng):
    """A pallaskit function called in a shard_map body (check_vma=True) under
    jax.jit: its kernels run per shard; psum and all_gather run through XLA."""
    mesh = _mesh((2, 4), ("a", "b"))

    def body(x, w):
        h = jnp.tanh(x) * w  # w: replicated (invariant), x: varying
        total = jax.lax.psum(jnp.sum(h, axis=0), "a")  # sums over the row shards
        rows = jax.lax.all_gather(jnp.max(h, axis=1), "b", tiled=True)
        return h + total, rows

    pk_body = pallaskit.jit(body)
    specs = dict(mesh=mesh, in_specs=(P("a", "b"), P(None, "b")), out_specs=(P("a", "b"), P(("a", "b"))))
    x = jax.device_put(_special(rng, (8, 16), np.float32), NamedSharding(mesh, P("a", "b")))
    w = jax.device_put(rng.standard_normal((1, 16)).astype(np.float32), NamedSharding(mesh, P(None, "b")))
    ref = jax.jit(jax.shard_map(body, **specs))(x, w)
    out = jax.jit(jax.shard_map(pk_body, **specs))(x, w)
    _check(out, ref)
    if pallaskit.api.compile_options().interpret:  # Pallas's interpreter re-traces kernels with vma checks
        assert pallaskit.metrics.counters["autodiff_fallbacks"] == 1
    else:
        assert pallaskit.metrics.counters["graphs_compiled"] == 1


@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_kernels_vary_over_their_operands(check_vma, rng, monkeypatch):
    """Kernels launched in a shard_map body: a pointwise kernel of a varying
    and an invariant operand, then psum (a kernel output typed invariant
    would make that psum a product by the axis size) and all_gather. Runs on
    one device too (a mesh of all devices there are), for the GPU."""
    monkeypatch.setattr(pallaskit.sharding, "KERNELS_IN_INTERPRET_SHARD_MAP", True)  # pointwise: lowers there
    n = min(jax.device_count(), 4)
    mesh = _mesh((n,), ("d",))

    def body(x, w):
        y = jnp.exp(x) * w + 1
        return jax.lax.psum(y, "d"), jax.lax.all_gather(y, "d", tiled=True), y

    specs = dict(mesh=mesh, in_specs=(P("d"), P()), out_specs=(P(), P("d"), P("d")), check_vma=check_vma)
    x = jax.device_put(_special(rng, (4 * n, 3), np.float32), NamedSharding(mesh, P("d")))
    w = jax.device_put(rng.standard_normal((1, 3)).astype(np.float32), NamedSharding(mesh, P()))
    ref = jax.jit(jax.shard_map(body, **specs))(x, w)
    _check(jax.jit(jax.shard_map(pallaskit.jit(body), **specs))(x, w), ref)
    assert pallaskit.metrics.counters["autodiff_fallbacks"] == 0
    assert pallaskit.metrics.counters["graphs_compiled"] == 1


@needs8
def test_shard_map_grad_inside(rng):
    """jax.grad through a pallaskit function inside shard_map (the backward's
    psum comes from the transposed broadcast of an invariant weight)."""
    mesh = _mesh((4,), ("d",))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def per_shard(lossf):
        def g(w, x):
            return jax.lax.psum(jax.grad(lossf)(w, x), "d")
        return jax.jit(jax.shard_map(g, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))

    w = jax.device_put(rng.standard_normal((6, 5)).astype(np.float32) / 3, NamedSharding(mesh, P()))
    x = jax.device_put(rng.standard_normal((8, 6)).astype(np.float32), NamedSharding(mesh, P("d")))
    _check(per_shard(pallaskit.jit(loss))(w, x), per_shard(loss)(w, x))


@needs8
def test_shard_map_around(rng):
    """pallaskit.jit of a shard_map'd function with collectives."""
    mesh = _mesh((2, 4), ("a", "b"))
    f = jax.shard_map(lambda x: jax.lax.psum(jnp.tanh(x), "a") * 2, mesh=mesh,
                      in_specs=P("a", "b"), out_specs=P(None, "b"))
    x = jax.device_put(rng.standard_normal((8, 8)).astype(np.float32), NamedSharding(mesh, P("a", "b")))
    _check(pallaskit.jit(f)(x), jax.jit(f)(x))
    y = jnp.asarray(np.asarray(x))  # unsharded input: the shard_map names the devices
    _check(pallaskit.jit(f)(y), jax.jit(f)(y))


@needs8
def test_donated_sharded_argument(rng):
    """Donation and a sharded argument together ([Note: XLA arguments]): the
    donated sharded array is deleted, values and shardings are jax.jit's."""
    s = NamedSharding(_mesh((2, 4), ("a", "b")), P("a", "b"))
    x0, y0 = _special(rng, (6, 12), np.float32), rng.standard_normal((6, 12)).astype(np.float32)

    def f(x, y):
        return jnp.tanh(x) * 2.0 + y, jnp.sum(y, axis=0)

    ref = jax.jit(f, donate_argnums=0)(jax.device_put(x0, s), jax.device_put(y0, s))
    x, y = jax.device_put(x0, s), jax.device_put(y0, s)
    out = pallaskit.jit(f, donate_argnums=0)(x, y)
    _check(out, ref)
    assert x.is_deleted() and not y.is_deleted()


@needs8
@pytest.mark.parametrize("user_out", [False, True])
def test_sharded_donation_warns_as_jax_jit_does(user_out, rng):
    """A donated sharded argument no output can take: jax.jit of a program over
    several devices whose output shardings it propagates gives every donated
    argument to XLA and warns of none; pallaskit lowers its program with those
    shardings given and warned of it (with its shard's shape). With the user's
    out_shardings jax.jit warns too."""
    s = NamedSharding(_mesh((2, 4), ("a", "b")), P("a", "b"))
    kw = dict(donate_argnums=(0, 1), out_shardings=NamedSharding(s.mesh, P()) if user_out else None)
    kw = {k: v for k, v in kw.items() if v is not None}

    def f(x, y):
        return (x * y).sum(), jnp.tanh(y)

    x0, y0 = (rng.standard_normal((6, 12)).astype(np.float32) for _ in range(2))
    messages = []
    for jit in (jax.jit, pallaskit.jit):
        x, y = jax.device_put(x0, s), jax.device_put(y0, s)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            out = jit(f, **kw)(x, y)
        messages.append([str(w.message) for w in got if "donated" in str(w.message)])
        if jit is jax.jit:
            ref, deleted = out, (x.is_deleted(), y.is_deleted())
    _check(out, ref)
    assert (x.is_deleted(), y.is_deleted()) == deleted
    assert messages[1] == messages[0] and bool(messages[0]) == user_out


@needs8
def test_user_shardings_hold_for_every_size(rng):
    """in_shardings / out_shardings on unplaced arguments whose sizes change
    (automatic dynamic, dynamic=): every size is sharded as jax.jit shards it
    (a symbolic program takes no shardings: such a signature compiles per size)."""
    mesh = _mesh((2, 4), ("a", "b"))
    g = lambda x: jnp.tanh(x).sum(0) * 2  # noqa: E731
    for kw in (dict(in_shardings=NamedSharding(mesh, P("a"))), dict(out_shardings=NamedSharding(mesh, P())),
               dict(in_shardings=NamedSharding(mesh, P("a")), dynamic={"x": {0: "n"}})):
        f = pallaskit.jit(g, **kw)
        ref = jax.jit(g, **{k: v for k, v in kw.items() if k != "dynamic"})
        for n in (4, 6, 2, 6):
            x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
            out, expected = f(x), ref(x)
            _check(out, expected)
            assert out.committed == expected.committed


@needs8
@pytest.mark.parametrize("spec", ["other_key", "list_for_tuple", "prefix"])
def test_in_shardings_must_be_a_pytree_prefix(spec, rng):
    """in_shardings whose structure is not a prefix of the argument's (a dict
    key that differs, a list for a tuple): jax.jit's ValueError. pallaskit
    compared leaf counts only and ran the call unsharded. A true prefix
    shards every leaf under it, as in jax.jit."""
    mesh = _mesh((2, 4), ("a", "b"))
    rows, whole = NamedSharding(mesh, P("a")), NamedSharding(mesh, P())
    state = {"w": jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
             "t": (jnp.ones((8,), jnp.float32), jnp.zeros((4,), jnp.float32))}
    x = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    given = {"other_key": {"v": rows, "t": whole}, "list_for_tuple": {"w": rows, "t": [rows, whole]},
             "prefix": {"w": rows, "t": whole}}[spec]

    def f(state, x):
        return state["w"] * x + state["t"][0][:, None], state["t"][1] + 1.0

    kw = dict(in_shardings=(given, rows))
    if spec == "prefix":
        _check(pallaskit.jit(f, **kw)(state, x), jax.jit(f, **kw)(state, x))
        return
    with pytest.raises(ValueError):
        jax.jit(f, **kw)(state, x)
    with pytest.raises(ValueError, match="not a pytree prefix"):
        pallaskit.jit(f, **kw)(state, x)


@needs8
def test_in_shardings_with_sharded_argument(rng):
    """The user's in_shardings with a sharded argument: the matching sharding
    compiles for the array's, an uncommitted argument takes the given one, a
    mismatch raises jax.jit's error."""
    mesh = _mesh((8,), ("x",))
    rows, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    x0, y0 = _special(rng, (16, 5), np.float32), rng.standard_normal((16, 5)).astype(np.float32)

    def f(x, y):
        return jnp.exp(x) - y * 3.0

    ref = jax.jit(f, in_shardings=(rows, rep))(jax.device_put(x0, rows), jnp.asarray(y0))
    out = pallaskit.jit(f, in_shardings=(rows, rep))(jax.device_put(x0, rows), jnp.asarray(y0))
    _check(out, ref)
    with pytest.raises(ValueError, match="does not match the sharding"):
        jax.jit(f, in_shardings=(rep, rep))(jax.device_put(x0, rows), jnp.asarray(y0))
    with pytest.raises(ValueError, match="does not match the sharding"):
        pallaskit.jit(f, in_shardings=(rep, rep))(jax.device_put(x0, rows), jnp.asarray(y0))


@needs8
def test_out_shardings_prefix_and_in_shardings_of_unplaced_arguments(rng):
    """out_shardings is a pytree prefix of the outputs, as in jax.jit (a tuple
    over a (params dict, loss) result crashed: it went to the program of flat
    outputs as it was), None in it leaves the output to jax.jit's propagation,
    and in_shardings over arrays on the default device give jax.jit's output
    shardings (they came out replicated)."""
    mesh = _mesh((4, 2), ("data", "model"))
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    w = {"a": jax.device_put(_special(rng, (6, 4), np.float32), NamedSharding(mesh, P(None, "model"))),
         "b": jax.device_put(rng.standard_normal(4).astype(np.float32), NamedSharding(mesh, P("model")))}
    x = jax.device_put(rng.standard_normal((8, 6)).astype(np.float32), rows)

    def step(w, x):
        loss = lambda w: jnp.mean(jnp.tanh(x @ w["a"] + w["b"]) ** 2)
        val, g = jax.value_and_grad(loss)(w)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, w, g), val

    for out_shardings in ((None, rep), ({"a": rep, "b": None}, None), rep):
        ref = jax.jit(step, out_shardings=out_shardings)(w, x)
        _check(pallaskit.jit(step, out_shardings=out_shardings)(w, x), ref)

    def f(x, y):
        return {"a": jnp.exp(x) * 2.0, "b": [x.sum(0), None, (x * y).T], "c": x[0]}

    x0, y0 = jnp.asarray(_special(rng, (8, 3), np.float32)), jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
    for kw in ({"in_shardings": rows}, {"in_shardings": (rows, None)},
               {"out_shardings": {"a": rows, "b": rep, "c": None}},
               {"in_shardings": (None, rows), "out_shardings": {"a": None, "b": [rep, None, NamedSharding(mesh, P(None, "data"))],
                                                         "c": rep}}):
        _check(pallaskit.jit(f, **kw)(x0, y0), jax.jit(f, **kw)(x0, y0))
    with pytest.raises(ValueError, match="prefix"):
        pallaskit.jit(f, out_shardings=(rows, rows))(x0, y0)


@needs8
def test_set_mesh_with_plain_arguments(rng):
    """Under ``jax.set_mesh``, arrays on no mesh: jax.jit's outputs over the
    whole mesh; a second function's program loads from the graph cache on the
    mesh's devices (it was loaded on the default device alone: every process
    compiled it again, one warning each), not for an Explicit mesh over the same
    devices (its axis types are in the key), whose outputs are typed as jax.jit
    types them; a PartitionSpec in in_shardings names
    the mesh (it was ignored: outputs replicated where jax.jit's are split), and
    without a mesh raises jax.jit's error."""
    mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("a", "b"))  # loaded on these devices, in this order
    g = lambda x: (jnp.tanh(x) * 2, x.sum(0))  # noqa: E731
    x = jnp.asarray(_special(rng, (8, 6), np.float32))
    with jax.set_mesh(mesh):
        ref = jax.jit(g)(x)
        for _ in range(2):
            pallaskit.metrics.reset()
            _check(pallaskit.jit(g)(x), ref)
        assert pallaskit.metrics.counters["cache_hits"] == 1 and pallaskit.metrics.counters["cache_misses"] == 0
    explicit = Mesh(mesh.devices, ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with jax.set_mesh(explicit):  # the same devices, Explicit axes: another program, not the entry above
        out, ref = pallaskit.jit(g)(x), jax.jit(g)(x)
        _check(out, ref)
        assert [o.sharding for o in out] == [r.sharding for r in ref]  # the sum's spec was P(None,), jax.jit's P()
        with pytest.raises(ValueError, match="should match the aval mesh"):  # an Auto mesh's array: jax.jit's error
            pallaskit.jit(g)(jax.device_put(x, NamedSharding(mesh, P("a"))))
    with jax.set_mesh(mesh):
        for kw in (dict(in_shardings=P("a")), dict(in_shardings=P(("a", "b"))), dict(out_shardings=(P(None, "b"), P()))):
            ref = jax.jit(g, **kw)(x)
            _check(pallaskit.jit(g, **kw)(x), ref)
        assert ref[0].sharding.spec == P(None, "b")
        with pytest.raises(ValueError, match="does not match the sharding"):  # jax.jit's too
            pallaskit.jit(g, in_shardings=P("a"))(jax.device_put(x, NamedSharding(mesh, P("b"))))
        # an array committed to one device: jax.jit's error, naming the function's argument (not the program's)
        with pytest.raises(ValueError, match="incompatible devices.*argument x of <lambda>"):
            pallaskit.jit(g)(jax.device_put(x, jax.devices()[0]))
    with pytest.raises(RuntimeError, match="non-empty mesh in context"):
        jax.jit(g, in_shardings=P("a"))(x)
    with pytest.raises(RuntimeError, match="non-empty mesh in context"):
        pallaskit.jit(g, in_shardings=P("a"))(x)


@needs8
def test_set_mesh_explicit_axes_and_stages(rng):
    """Under jax.set_mesh: ahead of time as a call (``lower(x).compile()``
    gave replicated outputs where in_shardings split them; outputs of an
    array committed to the default device came out uncommitted); with
    Explicit axes a hoisted constant (it was typed on a mesh of pallaskit's:
    a ValueError), in_shardings on an array on no mesh (jax.jit types the
    outputs by the arrays, not by in_shardings) and a reshard inside."""
    auto = _mesh((2, 4), ("a", "b"))
    explicit = _mesh((2, 4), ("a", "b"), explicit=True)
    c = rng.standard_normal(6).astype(np.float32)
    g = lambda x: (jnp.tanh(x) * c, x.sum(0))  # noqa: E731  (c: a hoisted constant)
    x = jnp.asarray(_special(rng, (8, 6), np.float32))
    committed = jax.device_put(x, jax.devices()[0])
    out, ref = pallaskit.jit(g).lower(committed).compile()(committed), jax.jit(g)(committed)
    _check(out, ref)
    assert [o.committed for o in out] == [r.committed for r in ref] == [True, True]
    for mesh, kw, stage in [(auto, dict(in_shardings=P("a")), True), (explicit, {}, False),
                            (explicit, dict(in_shardings=P("a")), True)]:
        with jax.set_mesh(mesh):
            ref = jax.jit(g, **kw)(x)
            f = pallaskit.jit(g, **kw)
            out = f.lower(x).compile()(x) if stage else f(x)
            _check(out, ref)
            assert [o.sharding for o in out] == [r.sharding for r in ref], kw
    # a reshard onto the Explicit mesh inside: traced over its Auto twin, it refuses; jax.jit runs it (a kernel
    # met a value typed on the mesh: TypeError from Pallas's interpreter; ahead of time too)
    h = lambda x: jax.sharding.reshard(jnp.exp(x), P("b")) * 2  # noqa: E731
    with jax.set_mesh(explicit):
        ref = jax.jit(h)(x)
        for out in (pallaskit.jit(h)(x), pallaskit.jit(h).lower(x).compile()(x)):
            _check(out, ref)
            assert out.sharding == ref.sharding


# --------------------------------------------------------------------------- #
# kernels per shard ([Note: per-shard kernels] in pallaskit/per_shard.py)
# --------------------------------------------------------------------------- #
@pytest.fixture
def per_shard():
    """Option shard_kernels='per_shard': interpret-mode kernels take the GPU's
    path (the program compiled at local shapes under shard_map)."""
    pallaskit.config.update(shard_kernels="per_shard")


PER_SHARD_LAYOUTS = [(n, s) for n, s in LAYOUTS if n in ("1d_rows", "2d_cols", "explicit_2d", "gspmd")]


@needs8
@pytest.mark.parametrize("layout", [s for _, s in PER_SHARD_LAYOUTS], ids=[n for n, _ in PER_SHARD_LAYOUTS])
def test_per_shard_pointwise_and_reductions(layout, rng, per_shard):
    """Pointwise, a row reduction over a split axis (a psum), a column max
    (pmax) and a full mean: jax.jit's values and shardings. A device-3 or
    GSPMD sharding has no mesh to shard_map over: the SPMD path."""
    def f(x, y):
        z = jnp.tanh(x) * 2 + y
        return z, jnp.sum(z * z, axis=1), jnp.max(y, axis=0), jnp.mean(jnp.abs(x))

    s = layout()
    x = jax.device_put(_special(rng, (16, 24), np.float32), s)
    y = jax.device_put(rng.standard_normal((16, 24)).astype(np.float32), s)
    _check(pallaskit.jit(f)(x, y), jax.jit(f)(x, y))
    named = isinstance(s, NamedSharding)
    assert pallaskit.metrics.counters["per_shard_graphs"] == (1 if named else 0)


@needs8
@pytest.mark.parametrize("dtype", [jnp.bfloat16, np.int32, np.bool_])
def test_per_shard_dtypes(dtype, rng, per_shard):
    def f(x):
        if x.dtype == np.bool_:  # any over a split axis: no rule, gathered whole
            return jnp.logical_not(x), jnp.any(x, axis=0)
        return x * 3 - 1, jnp.sum(x, axis=1), jnp.max(jnp.nan_to_num(x))

    s = NamedSharding(_mesh((2, 4), ("a", "b")), P("b", "a"))
    x = jax.device_put(jnp.asarray(_special(rng, (12, 6), dtype), dtype), s)
    _check(pallaskit.jit(f)(x), jax.jit(f)(x), dtype)
    assert pallaskit.metrics.counters["per_shard_graphs"] == 1


@needs8
def test_per_shard_data_parallel_kernels_see_local_shapes(rng, per_shard):
    """A data-parallel pointwise + row-reduction program: no collective at
    all in the executable, and every kernel is rendered for an 8 x 24 shard
    (the SPMD path renders them for the whole 64 x 24)."""
    import re

    mesh = _mesh((8,), ("d",))

    def f(x, w):
        z = jnp.tanh(x) * w
        return z, z / (1 + jnp.sum(z * z, axis=1, keepdims=True))

    x = jax.device_put(_special(rng, (64, 24), np.float32), NamedSharding(mesh, P("d")))
    w = jax.device_put(rng.standard_normal((24,)).astype(np.float32), NamedSharding(mesh, P()))
    jf = pallaskit.jit(f)
    _check(jf(x, w), jax.jit(f)(x, w))
    (entry,) = jf._cache.values()
    text = entry.executable.as_text()
    assert "all-gather" not in text and "all-reduce" not in text and "all-to-all" not in text
    shapes = re.findall(r"out_shape=\(jax\.ShapeDtypeStruct\(\((\d+),\)", entry.result.program.source)
    assert len(shapes) == len(entry.result.program.kernels) >= 1
    assert set(shapes) == {str(8 * 24)}, shapes


@needs8
@pytest.mark.parametrize("layout", ["dp", "fsdp", "tp"])
def test_per_shard_mlp_training_step(layout, rng, per_shard):
    """value_and_grad + SGD as one graph, per shard: DP all-reduces the
    gradients, FSDP gathers the split parameters for use, TP's second
    matmul is a local product and a psum."""
    _, params, x, y = _mlp_args(rng, layout, (4, 2) if layout == "fsdp" else (2, 4))
    jf = pallaskit.jit(_sgd_step)
    _check(jf(params, x, y), jax.jit(_sgd_step)(params, x, y))
    assert pallaskit.metrics.counters["per_shard_graphs"] == 1
    if layout == "dp":  # batch-split activations are never gathered
        assert "all-gather" not in next(iter(jf._cache.values())).executable.as_text()


@needs8
@pytest.mark.parametrize("layout", ["tp"])
def test_per_shard_grad_of_pallaskit_loss(layout, rng, per_shard):
    """jax.value_and_grad of a pallaskit loss: both custom_vjp halves run per shard."""
    _, params, x, y = _mlp_args(rng, layout)
    loss_fn = pallaskit.jit(_mlp_loss)
    _check(jax.value_and_grad(loss_fn)(params, x, y), jax.jit(jax.value_and_grad(_mlp_loss))(params, x, y))
    assert pallaskit.metrics.counters["per_shard_graphs"] == 2


@needs8
def test_per_shard_constraint_and_shard_map(rng, per_shard):
    """A sharding constraint is a layout (values per shard, jax.jit's output
    shardings); a shard_map in the jaxpr takes the SPMD path."""
    mesh = _mesh((2, 4), ("a", "b"))

    def f(x):
        y = jax.lax.with_sharding_constraint(jnp.tanh(x), NamedSharding(mesh, P("b", "a")))
        return y * 2 + 1, jnp.sum(y, axis=0)

    x = jax.device_put(rng.standard_normal((8, 16)).astype(np.float32), NamedSharding(mesh, P("a")))
    _check(pallaskit.jit(f)(x), jax.jit(f)(x))
    assert pallaskit.metrics.counters["per_shard_graphs"] == 1
    g = jax.shard_map(lambda x: jax.lax.psum(jnp.tanh(x), "a") * 2, mesh=mesh, in_specs=P("a", "b"),
                      out_specs=P(None, "b"))
    _check(pallaskit.jit(g)(x), jax.jit(g)(x))
    assert pallaskit.metrics.counters["per_shard_graphs"] == 1


@needs8
def test_per_shard_constraint_in_a_loop_body(rng, per_shard):
    """A sharding constraint inside a scan / cond body (a flax ``nn.scan`` of
    layers): the body runs whole inside shard_map, where the constraint names
    manual axes, and jax refused to lower the program (a crash, the default on
    a GPU). Such a program takes the SPMD path; a loop without one stays per shard."""
    mesh = _mesh((2, 4), ("a", "b"))

    def layers(x, ws, constrain=True):
        def body(h, w):
            h = jnp.tanh(h @ w)
            if constrain:
                h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P("a", "b")))
            return h, jnp.sum(h)
        return jax.lax.scan(body, x, ws)

    def branch(x, flag):
        return jax.lax.cond(flag, lambda v: jax.lax.with_sharding_constraint(v * 2, NamedSharding(mesh, P("a"))),
                            lambda v: v - 1.0, x)

    x = jax.device_put(rng.standard_normal((8, 16)).astype(np.float32), NamedSharding(mesh, P("a")))
    ws = jax.device_put((rng.standard_normal((3, 16, 16)) * 0.3).astype(np.float32),
                        NamedSharding(mesh, P(None, None, "b")))
    _check(pallaskit.jit(layers)(x, ws), jax.jit(layers)(x, ws))
    _check(pallaskit.jit(branch)(x, True), jax.jit(branch)(x, True))
    assert pallaskit.metrics.counters["per_shard_graphs"] == 0
    plain = functools.partial(layers, constrain=False)
    _check(pallaskit.jit(plain)(x, ws), jax.jit(plain)(x, ws))
    assert pallaskit.metrics.counters["per_shard_graphs"] == 1


@needs8
def test_scheduler_fuses_per_shard_fsdp_program(rng):
    """The FSDP step's per-shard program fused: its collectives' NamedAxisEffect
    once chained them in program order, which the fusion's cycle check did not
    see ('cycle in schedule')."""
    import lowering

    _, params, x, y = _mlp_args(rng, "fsdp", (4, 2))
    leaves, tree = jax.tree_util.tree_flatten((params, x, y))
    closed = jax.make_jaxpr(lambda *a: _sgd_step(*jax.tree_util.tree_unflatten(tree, a)))(*leaves)
    plan = pallaskit.per_shard.plan(closed, [a.sharding for a in leaves], [a.aval for a in leaves])
    lowering.compile_jaxpr(plan.local, pallaskit.api.compile_options(), "fsdp_step")


@needs8
@pytest.mark.parametrize("check_vma", [True, False])
def test_shard_map_over_an_explicit_mesh(check_vma, rng):
    """pallaskit.jit of a shard_map over a mesh with Explicit axes (what
    ``jax.make_mesh`` gives by default) on arrays sharded over it: the
    program cannot be traced over the mesh's Auto twin (shard_map names the
    explicit mesh), so jax.jit runs it; before, the call raised "The context
    mesh ... should match the mesh passed to shard_map"."""
    mesh = _mesh((2, 4), ("a", "b"), explicit=True)

    def body(x, w):
        h = jnp.tanh(x) * w
        idx = jax.lax.axis_index("b").astype(h.dtype)
        shifted = jax.lax.ppermute(h, "b", [(k, (k + 1) % 4) for k in range(4)])
        return jax.lax.psum(h.sum(0), "a") + idx, jax.lax.psum(shifted, "b")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("a", "b"), P(None, "b")), out_specs=(P("b"), P("a")),
                      check_vma=check_vma)
    x = jax.device_put(_special(rng, (8, 16), np.float32), NamedSharding(mesh, P("a", "b")))
    w = jax.device_put(rng.standard_normal((1, 16)).astype(np.float32), NamedSharding(mesh, P(None, "b")))
    _check(pallaskit.jit(f)(x, w), jax.jit(f)(x, w))
    gx = jax.jit(jax.grad(lambda v: pallaskit.jit(f)(v, w)[0].sum()))(x)
    _check(gx, jax.jit(jax.grad(lambda v: jax.jit(f)(v, w)[0].sum()))(x))
    for jit in (jax.jit, pallaskit.jit):  # the user's own error still reads as jax.jit's
        with pytest.raises(ValueError, match="pytree structure error"):
            jit(lambda v: f(v, w, v))(x)


@needs8
@pytest.mark.parametrize("explicit", [False, True])
def test_ahead_of_time_stages_of_sharded_arguments(explicit, rng):
    """``lower(x).compile()`` of sharded arrays (or ShapeDtypeStructs carrying
    the sharding) compiles for those shardings, as jax.jit's stages do;
    before, the executable was compiled for the default device and calling it
    with the sharded arrays raised."""
    mesh = _mesh((2, 4), ("a", "b"), explicit)
    s = NamedSharding(mesh, P("a", "b"))

    def f(x, y):
        return jnp.exp(x) / jnp.exp(x).sum(-1, keepdims=True) + y, x.sum(0)

    x = jax.device_put(_special(rng, (8, 12), np.float32), s)
    y = jax.device_put(rng.standard_normal((8, 12)).astype(np.float32), s)
    ref = jax.jit(f)(x, y)
    for args in [(x, y), (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), y)]:
        ours, theirs = pallaskit.jit(f).lower(*args).compile(), jax.jit(f).lower(*args).compile()
        _check(ours(x, y), ref)
        assert ours.input_shardings == theirs.input_shardings
        assert all(a.is_equivalent_to(b, 2 - i) for i, (a, b) in
                   enumerate(zip(ours.output_shardings, theirs.output_shardings)))
    # called with another sharding: jax's ValueError, naming the user's argument (not the flat call's)
    other = jax.device_put(np.asarray(y), NamedSharding(mesh, P("b", "a")))
    errors = []
    for compiled in (pallaskit.jit(f).lower(x, y).compile(), jax.jit(f).lower(x, y).compile()):
        with pytest.raises(ValueError) as info:
            compiled(x, other)
        errors.append([line for line in str(info.value).splitlines() if line.startswith("Argument")])
    assert errors[0] == errors[1] and errors[0][0].startswith("Argument y ")


@needs8
def test_arguments_on_incompatible_devices_raise_as_jax_does(rng):
    """Arrays committed to different devices: jax.jit's ValueError, naming the
    user's function and arguments (before: pallaskit's ``flat_fn`` and
    ``leaves[0]``)."""
    def add(a, b):
        return a + b

    mesh = _mesh((8,), ("x",))
    a3 = jax.device_put(rng.standard_normal((8, 5)).astype(np.float32), jax.devices()[3])
    for b in [jax.device_put(np.ones((8, 5), np.float32), jax.devices()[2]),
              jax.device_put(np.ones((8, 5), np.float32), NamedSharding(mesh, P("x")))]:
        with pytest.raises(ValueError) as theirs:
            jax.jit(add)(a3, b)
        with pytest.raises(ValueError) as ours:
            pallaskit.jit(add)(a3, b)
        assert str(ours.value).startswith("Received incompatible devices for jitted computation")
        assert str(theirs.value).startswith("Received incompatible devices for jitted computation")
        assert "argument a of add" in str(ours.value) and "argument b of add" in str(ours.value)
