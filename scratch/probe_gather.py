"""Probe: do int-array (gather-style) Pallas loads on flat refs reach the memory floor on GPU?"""
import time, json, os
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
print(jax.__version__, jax.devices())

def bench(f, *args, n=50):
    jax.block_until_ready(f(*args))
    for _ in range(3): jax.block_until_ready(f(*args))
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n): out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / n * 1e3)
    return float(np.median(ts))

R, C = 576000, 384
x = jax.random.normal(jax.random.key(0), (R, C), jnp.bfloat16)
y = jax.random.normal(jax.random.key(1), (R, C), jnp.bfloat16)
w = jax.random.normal(jax.random.key(2), (C,), jnp.bfloat16)
floor_add = 3 * R * C * 2 / 3.0e12 * 1e3
res = {}
ANY = pl.BlockSpec(memory_space=pl.ANY)

def add_flat(XB, warps):
    N = R * C
    def k(x_ref, y_ref, o_ref):
        i = pl.program_id(0) * XB + jax.lax.broadcasted_iota(jnp.int32, (XB,), 0)
        m = i < N
        a = plt.load(x_ref.at[i], mask=m, other=0.0)
        b = plt.load(y_ref.at[i], mask=m, other=0.0)
        plt.store(o_ref.at[i], a + b, mask=m)
    call = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((N,), x.dtype), grid=(pl.cdiv(N, XB),),
        in_specs=[ANY, ANY], out_specs=ANY, compiler_params=plt.CompilerParams(num_warps=warps))
    return jax.jit(lambda a, b: call(a.reshape(-1), b.reshape(-1)).reshape(R, C))

for XB, wp in [(1024, 4), (2048, 4), (4096, 8), (8192, 8)]:
    try:
        f = add_flat(XB, wp)
        out = f(x, y); err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - (x + y).astype(jnp.float32))))
        res[f"add_flat_{XB}_{wp}"] = (bench(f, x, y), err)
    except Exception as e:
        res[f"add_flat_{XB}_{wp}"] = repr(e)[:300]
res["add_xla"] = bench(jax.jit(lambda a, b: a + b), x, y)

def add_2d(BR, BC, warps):
    def k(x_ref, y_ref, o_ref):
        r = pl.program_id(0) * BR + jax.lax.broadcasted_iota(jnp.int32, (BR, BC), 0)
        c = jax.lax.broadcasted_iota(jnp.int32, (BR, BC), 1)
        m = (r < R) & (c < C)
        a = plt.load(x_ref.at[r * C + c], mask=m, other=0.0)
        b = plt.load(y_ref.at[r * C + c], mask=m, other=0.0)
        plt.store(o_ref.at[r * C + c], a + b, mask=m)
    call = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((R * C,), x.dtype), grid=(pl.cdiv(R, BR),),
        in_specs=[ANY, ANY], out_specs=ANY, compiler_params=plt.CompilerParams(num_warps=warps))
    return jax.jit(lambda a, b: call(a.reshape(-1), b.reshape(-1)).reshape(R, C))
for BR, wp in [(4, 4), (8, 4), (16, 8)]:
    try:
        res[f"add_2d_{BR}_{wp}"] = bench(add_2d(BR, 512, wp), x, y)
    except Exception as e:
        res[f"add_2d_{BR}_{wp}"] = repr(e)[:300]

def rms_2d(BR, warps):
    BC = 512
    def k(x_ref, w_ref, o_ref):
        r = pl.program_id(0) * BR + jax.lax.broadcasted_iota(jnp.int32, (BR, BC), 0)
        c = jax.lax.broadcasted_iota(jnp.int32, (BR, BC), 1)
        m = (r < R) & (c < C)
        xv = plt.load(x_ref.at[r * C + c], mask=m, other=0.0).astype(jnp.float32)
        wv = plt.load(w_ref.at[c], mask=c < C, other=0.0).astype(jnp.float32)
        s = jnp.sum(jnp.where(m, xv * xv, 0.0), axis=1, keepdims=True)
        yv = xv * jax.lax.rsqrt(s / C + 1e-6) * wv
        plt.store(o_ref.at[r * C + c], yv.astype(o_ref.dtype), mask=m)
    call = pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct((R * C,), x.dtype), grid=(pl.cdiv(R, BR),),
        in_specs=[ANY, ANY], out_specs=ANY, compiler_params=plt.CompilerParams(num_warps=warps))
    return jax.jit(lambda a, b: call(a.reshape(-1), b).reshape(R, C))
def rms_ref(a, b):
    af = a.astype(jnp.float32)
    return (af * jax.lax.rsqrt(jnp.mean(af * af, -1, keepdims=True) + 1e-6) * b.astype(jnp.float32)).astype(a.dtype)
for BR, wp in [(1, 4), (2, 4), (4, 4), (8, 8), (16, 8)]:
    try:
        f = rms_2d(BR, wp)
        err = float(jnp.max(jnp.abs(f(x, w).astype(jnp.float32) - rms_ref(x, w).astype(jnp.float32))))
        res[f"rms_2d_{BR}_{wp}"] = (bench(f, x, w), err)
    except Exception as e:
        res[f"rms_2d_{BR}_{wp}"] = repr(e)[:300]
res["rms_xla"] = bench(jax.jit(rms_ref), x, w)
res["floor_add_ms"] = floor_add
res["floor_rms_ms"] = 2 * R * C * 2 / 3.0e12 * 1e3
for k_, v in res.items(): print(k_, v)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"), indent=1)
