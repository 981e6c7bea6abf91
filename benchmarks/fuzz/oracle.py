"""Run one ``Program`` under ``pallaskit.jit`` and ``jax.jit`` and judge the results.

Verdicts: ``pass``, ``fallback`` (agreed, but some primitive ran through XLA),
``invalid`` (jax.jit itself rejects the program: not pallaskit's problem),
``crash`` (pallaskit raised where jax.jit ran) and ``mismatch``.

What counts as agreement:
- shapes and dtypes equal;
- integer and bool outputs, and float outputs the generator marks exact, bit
  for bit (NaN where NaN; +0 and -0 are equal; a subnormal equals the zero of
  its sign: XLA:CPU flushes some subnormals, e.g. a bf16 broadcast gives -0
  for -9.2e-41);
- other float outputs: NaN and +-inf at the same positions, finite values
  within a per-dtype tolerance (relative to each element and to the output's
  largest magnitude, which absorbs reduction-order differences). Where that
  fails the program is rerun in float64 (every float dtype of the source mapped
  to float64; the reference) and pallaskit passes if its error against the
  reference is within a few times jax.jit's own (rounding of 16-bit
  intermediates, cancellation) plus the tolerance. A NaN/inf difference passes
  only where pallaskit matches the reference's class.

XLA:CPU's max/min reductions drop NaN over wide rows (which NaN survives depends
on its position: jax.jit, and the float64 reference through jax.jit, give a
finite max where NumPy and lax's semantics give NaN). So the reference computes
``jnp.max``/``jnp.min`` with an explicit any-NaN test, and where jax.jit is not
NaN but the reference is, pallaskit's NaN passes (exact outputs too).

On the GPU (``platform="gpu"`` runs, compiled kernels) two more rules:
``TF32_TOL``: jax.jit computes float32 dots at DEFAULT precision in TF32 on an
H100 (``lax.Precision``'s documentation), and so does the matmul template
(Pallas' ``jnp.dot`` / Triton's ``tl.dot`` at DEFAULT), but XLA computes
degenerate dots (a size-1 M, N or K: a matvec) in full float32 and the order
of a TF32 sum differs: float32 outputs of programs with a float32 dot_general
get a TF32-sized tolerance there. ``_nan_index``: jax's argmax / argmin reducer
takes whichever NaN its reduction tree meets (it is not commutative on two
NaNs), so on the GPU jax.jit returns some NaN's index where jnp.argmax's
documented result, and the float64 reference's on the CPU, is the first NaN's:
pallaskit passes where it agrees with the reference.

XLA:CPU keeps 16-bit float chains in float32 (``xla_allow_excess_precision``):
``erf_inv(bf16(-1) + 0.00185)`` is -2.2 there, but -inf once the bf16 add rounds
to -1 as written. pallaskit keeps float32 the same way by default, though not at
every point XLA does (a bf16 dot's result is stored rounded); so a mismatch in a
program with 16-bit floats passes if pallaskit agrees with jax.jit compiled
without excess precision (counted as ``rounded_as_written_passes`` under the
defaults).
"""
from __future__ import annotations

import dataclasses
import re
import traceback

import numpy as np

# (rtol, atol relative to the output's largest finite magnitude) per float dtype
TOL = {"float32": (2e-4, 2e-5), "float16": (4e-3, 2e-3), "bfloat16": (3e-2, 1.6e-2)}
REF_FACTOR = 8.0  # pallaskit may be this many times further from float64 than jax.jit
# float32 outputs of a program with a float32 dot on the GPU: TF32 (10-bit mantissa) products
# on one side or both (module docstring, ``_TF32``); tests/test_matmul.py uses the same on the GPU.
TF32_TOL = (1e-2, 5e-3)


@dataclasses.dataclass
class Verdict:
    status: str  # pass | fallback | invalid | crash | mismatch
    detail: str = ""
    signature: str = ""  # dedup key of a failure
    fallbacks: tuple = ()


def _crash_signature(exc: BaseException) -> str:
    """Exception type and the innermost pallaskit/lowering frame."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/lowering/" in f.filename or "/pallaskit/" in f.filename]
    where = f"{frames[-1].filename.split('/')[-2]}/{frames[-1].filename.split('/')[-1]}:{frames[-1].name}" \
        if frames else "?"
    msg = re.sub(r"\d+", "N", (str(exc).splitlines() or [""])[0])[:80]
    return f"crash:{type(exc).__name__}:{where}:{msg}"


def _float_ok(g, w, dtype, r=None, tf32=False):
    """Element mask of agreement for one float output (w: jax.jit, r: float64 reference or None)."""
    g64, w64 = g.astype(np.float64), w.astype(np.float64)
    rtol, atol_rel = TF32_TOL if tf32 and dtype == "float32" else TOL[dtype]
    fin = np.isfinite(w64)
    scale = np.max(np.abs(w64[fin]), initial=0.0)
    atol = atol_rel * scale + (1e-30 if dtype == "float32" else 1e-6)
    same_class = (np.isnan(g64) == np.isnan(w64)) & ((g64 == w64) | ~np.isinf(g64) & ~np.isinf(w64))
    both_fin = np.isfinite(g64) & fin
    close = np.ones_like(g64, dtype=bool)
    close[both_fin] = np.abs(g64[both_fin] - w64[both_fin]) <= atol + rtol * np.abs(w64[both_fin])
    ok = same_class & close
    if r is None or ok.all():
        return ok
    # The reference rounded to the output dtype: a value past the dtype's range is inf there.
    with np.errstate(over="ignore", invalid="ignore"):
        r64 = r.astype(w.dtype).astype(np.float64)
    # class differences: pallaskit passes where it matches the reference's class, or where
    # the reference itself is not finite (overflow: which inf, or NaN, depends on the order)
    r_class = (np.isnan(g64) == np.isnan(r64)) & ((g64 == r64) | ~np.isinf(g64) & ~np.isinf(r64))
    ok |= ~same_class & r_class & ~np.isfinite(g64)
    ok |= ~same_class & ~np.isfinite(g64) & ~np.isfinite(r64)
    ok |= ~same_class & np.isfinite(g64) & np.isfinite(r64) & ~np.isfinite(w64)
    # value differences: pallaskit's error within REF_FACTOR times jax.jit's (whole-output norms)
    m = both_fin & np.isfinite(r64) & ~ok
    if m.any():
        fin_all = both_fin & np.isfinite(r64)
        err_g = np.max(np.abs(g64[fin_all] - r64[fin_all]))
        err_w = np.max(np.abs(w64[fin_all] - r64[fin_all]))
        rscale = np.max(np.abs(r64[fin_all]), initial=0.0)
        if err_g <= REF_FACTOR * err_w + atol_rel * rscale + 1e-30:
            ok |= m
    return ok


def _flushed(g, w):
    """Elements where one side is a subnormal and the other the zero of the same sign."""
    tiny = float(np.finfo(np.float32).tiny) if w.dtype.name == "bfloat16" else float(np.finfo(w.dtype).tiny)
    g64, w64 = g.astype(np.float64), w.astype(np.float64)

    def sub(x):
        return (x != 0) & (np.abs(x) < tiny)
    return ((sub(g64) & (w64 == 0)) | (sub(w64) & (g64 == 0))) & (np.signbit(g64) == np.signbit(w64))


def _nan_dropped(g, w, r):
    """Elements where jax.jit lost a NaN that pallaskit and the reference keep."""
    g64, w64, r64 = g.astype(np.float64), w.astype(np.float64), np.asarray(r).astype(np.float64)
    return np.isnan(g64) & ~np.isnan(w64) & np.isnan(r64)


def _nan_index(g, w, r):
    """argmax / argmin elements where jax.jit picked another NaN's index than the first one,
    which pallaskit and the reference (the CPU's float64 run) pick (module docstring)."""
    return (g != w) & (g == np.asarray(r).astype(g.dtype))


def compare(got, want, exact, ref=None, tf32=False, arg_outputs=()):
    """None when they agree, else a one-line description of the first disagreement.
    ``tf32``: float32 outputs get TF32_TOL; ``arg_outputs``: indices of argmax / argmin
    outputs judged with ``_nan_index`` against ``ref`` (both: the GPU's rules)."""
    if len(got) != len(want):
        return f"{len(got)} outputs, jax.jit gives {len(want)}"
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {k}: {g.dtype}{list(g.shape)} vs jax.jit {w.dtype}{list(w.shape)}"
        kind = w.dtype.kind if w.dtype.name != "bfloat16" else "f"
        if kind in "biu" or exact[k]:
            if kind == "f":
                ga, wa = g.astype(np.float64), w.astype(np.float64)
                ok = (ga == wa) | (np.isnan(ga) & np.isnan(wa)) | _flushed(g, w)
                if ref is not None:
                    ok = ok | _nan_dropped(g, w, ref[k])
            else:
                ok = g == w
                if ref is not None and k in arg_outputs:
                    ok = ok | _nan_index(g, w, ref[k])
        else:
            ok = _float_ok(g, w, w.dtype.name, None if ref is None else np.asarray(ref[k]), tf32)
            if ref is not None:
                ok = ok | _nan_dropped(g, w, ref[k])
        if not np.all(ok):
            bad = np.argwhere(~np.asarray(ok))
            idx = tuple(int(i) for i in bad[0])
            return (f"output {k} ({w.dtype}{list(w.shape)}{', exact' if exact[k] else ''}): {len(bad)} of "
                    f"{w.size} differ; at {idx}: pallaskit {g[idx]!r}, jax.jit {w[idx]!r}"
                    + (f", float64 {np.asarray(ref[k])[idx]!r}" if ref is not None and kind == "f" else ""))
    return None


def reference(program, tame=False):
    """The program in float64 on the CPU (None if it does not run there)."""
    import jax

    enable_x64 = getattr(jax, "enable_x64", None)
    if enable_x64 is None:  # older spellings
        from jax.experimental import enable_x64
    try:
        with enable_x64(True):
            cpu = jax.devices("cpu")[0]
            args = [jax.device_put(a, cpu) for a in program.make_args(float64=True, tame=tame)]
            out = jax.jit(_nan_keeping(program))(*args)
            return [np.asarray(o) for o in out]
    except Exception:  # noqa: BLE001  (a program that only types in 32 bits)
        return None


class _NanKeepingJnp:
    """``jax.numpy`` whose max/min reductions keep NaN on XLA:CPU (an explicit any-NaN test)."""

    def __getattr__(self, name):
        import jax.numpy as jnp
        return getattr(jnp, name)

    @staticmethod
    def _keep(fn, x, axis=None, keepdims=False, **kw):
        import jax.numpy as jnp
        out = fn(x, axis=axis, keepdims=keepdims, **kw)
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            return out
        return jnp.where(jnp.isnan(x).any(axis=axis, keepdims=keepdims), jnp.nan, out)

    def max(self, x, axis=None, keepdims=False, **kw):
        import jax.numpy as jnp
        return self._keep(jnp.max, x, axis, keepdims, **kw)

    def min(self, x, axis=None, keepdims=False, **kw):
        import jax.numpy as jnp
        return self._keep(jnp.min, x, axis, keepdims, **kw)


def _nan_keeping(program):
    """The program's float64 function, its ``jnp.max``/``jnp.min`` NaN-keeping."""
    from benchmarks.fuzz import programs

    ns = programs.namespace(float64=True)
    ns["jnp"] = _NanKeepingJnp()
    exec(program.source(), ns)
    return ns["f"]


def run(program) -> Verdict:
    """The verdict on one program. A mismatch is rechecked with tamed inputs (finite values
    clamped to [-1, 1], inf and NaN kept): where that agrees, the difference came from the order
    in which a sum or product overflowed (+inf in one order, NaN in another), not a bug. (A bug
    that only shows on large finite values is excused too: the price of no false positives.)"""
    v = _run(program, tame=False)
    if v.status == "mismatch" and _run(program, tame=True).status in ("pass", "fallback"):
        return Verdict("pass", "overflow-order: agrees once inputs cannot overflow", fallbacks=v.fallbacks)
    return v


def _has_16bit(program) -> bool:
    src = program.source()
    return (any(i.dtype in ("bfloat16", "float16") for i in program.live_inputs())
            or re.search(r"\b(BF16|F16)\b", src) is not None)


def _strict_jit(fn, args):
    """jax.jit's outputs with every 16-bit float op rounded as written (None if unsupported)."""
    import jax

    try:
        compiled = jax.jit(fn).lower(*args).compile(compiler_options={"xla_allow_excess_precision": False})
        return [np.asarray(o) for o in compiled(*args)]
    except Exception:  # noqa: BLE001  (an older jax without per-compile options)
        return None


def _run(program, tame) -> Verdict:
    import jax

    import pallaskit

    args = program.make_args(tame=tame)
    fn = program.function()
    try:
        want = [np.asarray(o) for o in jax.jit(fn)(*args)]
    except Exception as e:  # noqa: BLE001
        return Verdict("invalid", f"jax.jit: {type(e).__name__}: {str(e)[:200]}")
    before = pallaskit.metrics.counters["fallback_count"]
    logged = set(pallaskit.metrics.logged_fallbacks)
    try:
        with pallaskit.config.override(cache=False, log_fallbacks=True, **program.options):
            got = [np.asarray(o) for o in pallaskit.jit(program.function())(*args)]
    except Exception as e:  # noqa: BLE001  (a crash where jax.jit runs is a bug)
        return Verdict("crash", f"{type(e).__name__}: {str(e)[:300]}", _crash_signature(e))
    fell_back = pallaskit.metrics.counters["fallback_count"] > before
    fallbacks = tuple(sorted(set(pallaskit.metrics.logged_fallbacks) - logged))
    gpu = jax.default_backend() != "cpu"
    ops = {line.name: line.op for line in program.lines}
    tf32 = gpu and any(line.op == "dot_general" and line.dtype == "float32" for line in program.live_lines())
    arg_outputs = tuple(k for k, name in enumerate(program.outputs) if gpu and ops.get(name) in ("argmax", "argmin"))
    msg = compare(got, want, program.exact, tf32=tf32)
    if msg is not None and (arg_outputs or any(np.asarray(w).dtype.kind not in "biu" for w in want)):
        ref = reference(program, tame)
        if ref is not None:
            msg = compare(got, want, program.exact, ref, tf32=tf32, arg_outputs=arg_outputs)
    if msg is not None and _has_16bit(program):
        # Excess precision is XLA's option, not a duty: pallaskit rounding a 16-bit value as
        # written (a bf16 dot's result before a convert to float32, which XLA:CPU leaves
        # unrounded) agrees with jax.jit compiled without it, and that is a right answer.
        strict = _strict_jit(fn, args)
        if strict is not None and compare(got, strict, program.exact) is None:
            detail = "" if program.options.get("allow_excess_precision") is False else "rounded-as-written"
            return Verdict("fallback" if fell_back else "pass", detail, fallbacks=fallbacks)
    if msg is not None:
        k = int(msg.split()[1])
        out_name = program.outputs[k]
        op = next((line.op for line in program.lines if line.name == out_name), "input")
        dt = np.asarray(want[k]).dtype.name
        return Verdict("mismatch", msg, f"mismatch:{op}:{dt}:{'exact' if program.exact[k] else 'float'}")
    return Verdict("fallback" if fell_back else "pass", fallbacks=fallbacks)
