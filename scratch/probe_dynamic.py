"""GPU probe for issue 4: what does a new size of a dynamic dim cost?

A. Pallas (Triton lowering), sizes as a runtime scalar operand: first call per
   new size, and whether the Triton module differs between sizes.
B. jax-triton, a raw Triton kernel with the size as a runtime argument.
C. Baseline: jax.jit of x * 2 for a new size (XLA's own per-shape cost).

PYTHONPATH=. python scratch/probe_dynamic.py  (needs jax_triton from scratch/wheels)
"""
import hashlib, json, os, re, time
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

OUT = os.environ.get("OUT", "/tmp")
RESULTS = []
SIZES = (1000, 5000, 100_000, 1_000_003, 4_000_037)
BLOCK = 1024


def emit(**row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def first_call_ms(f, *args):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    return round((time.perf_counter() - t0) * 1e3, 2)


def pallas_double(n_arr, x):
    def kern(n_ref, x_ref, o_ref):
        n = plt.load(n_ref.at[0])
        idx = pl.program_id(0) * BLOCK + lax.broadcasted_iota(jnp.int32, (BLOCK,), 0)
        m = idx < n
        plt.store(o_ref.at[idx], plt.load(x_ref.at[idx], mask=m, other=0) * 2, mask=m)

    any_ = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(kern, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(pl.cdiv(x.shape[0], BLOCK),),
                          in_specs=[any_, any_], out_specs=any_, compiler_params=plt.CompilerParams(num_warps=4),
                          name="double")(n_arr, x)


def part_a():
    modules = {}
    for n in SIZES:
        x = jnp.asarray(np.random.default_rng(n).standard_normal(n), jnp.float32)
        na = jnp.asarray([n], jnp.int32)
        f = jax.jit(pallas_double)
        text = f.lower(na, x).as_text()
        calls = re.findall(r"custom_call[^\n]*", text)
        digest = hashlib.sha1("".join(calls).encode()).hexdigest()[:10]
        ms = first_call_ms(f, na, x)
        ok = bool(jnp.allclose(f(na, x), x * 2))
        modules[n] = digest
        emit(part="A pallas, size as scalar operand", n=n, first_call_ms=ms, custom_call_digest=digest, ok=ok,
             custom_call_chars=sum(map(len, calls)))
    emit(part="A", distinct_custom_calls=len(set(modules.values())))


def part_b():
    try:
        import jax_triton as jt
        import triton
        import triton.language as tl
    except Exception as e:
        emit(part="B jax-triton", error=f"{type(e).__name__}: {e}")
        return

    @triton.jit
    def double(x_ptr, o_ptr, n, BLOCK_: tl.constexpr):
        idx = tl.program_id(0) * BLOCK_ + tl.arange(0, BLOCK_)
        m = idx < n
        tl.store(o_ptr + idx, tl.load(x_ptr + idx, mask=m) * 2, mask=m)

    def f(x):
        n = x.shape[0]
        return jt.triton_call(x, kernel=double, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(triton.cdiv(n, BLOCK),), n=n, BLOCK_=BLOCK, num_warps=4)

    emit(part="B", jax_triton=getattr(jt, "__version__", "?"))
    for n in SIZES:
        x = jnp.asarray(np.random.default_rng(n).standard_normal(n), jnp.float32)
        g = jax.jit(f)
        ms = first_call_ms(g, x)
        ok = bool(jnp.allclose(g(x), x * 2))
        emit(part="B jax-triton, size as runtime argument", n=n, first_call_ms=ms, ok=ok)


def part_c():
    for n in SIZES:
        x = jnp.asarray(np.random.default_rng(n).standard_normal(n), jnp.float32)
        emit(part="C jax.jit(x * 2)", n=n, first_call_ms=first_call_ms(jax.jit(lambda a: a * 2), x))


if __name__ == "__main__":
    part_c()  # first: warms up jax itself
    part_a()
    part_b()
    with open(os.path.join(OUT, "probe_dynamic.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1)
