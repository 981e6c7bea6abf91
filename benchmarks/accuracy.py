"""Accuracy of pallaskit's transcendental and special functions against jax.jit.

    python -m benchmarks.accuracy [--dtypes float32,bfloat16] [--points N] [--paths pallas,triton]
                                  [--functions erfc,log_ndtr] [--output DIR] [--write-docs]
    python -m benchmarks.accuracy --tables a.json b.json --write-docs   # re-render saved runs

Every function of the op table whose result is not exact (exp, log1p, erf,
erfc, erf_inv, pow, ...), and a few jax composites built on them (log_ndtr,
norm.logsf, gelu...), runs once through ``pallaskit.jit`` on one grid per dtype
(one compile per function, dtype and path) and once through ``jax.jit``:

- float32: ``--points`` values evenly spaced in bit pattern over the positive
  finite floats (so log-spaced: every binade, subnormals to the largest finite)
  and their negatives; bfloat16: every finite value. Both add ±0, ±inf, NaN,
  ±1, the smallest subnormal and normal and the largest finite. Binary
  functions (pow, atan2) run on the outer product of a sqrt-sized subgrid.
- paths: ``pallas`` is the Pallas renderer (interpret mode on the CPU, Pallas'
  Triton lowering on a GPU); ``triton`` is the raw-Triton renderer
  (lowering/codegen/triton.py), reached as an eager launch of a symbolic
  program (Triton's interpreter on the CPU). A function a path does not
  compile (an extern in the program, or a Triton program that keeps its XLA
  path) is reported as ``xla``, not measured.

Per function: the worst error in ULPs of the dtype against jax.jit's result
(the distance between the two values' ordered bit patterns, counted as if
subnormals flushed: ±0 and every subnormal are one point, one ULP from the
smallest normal; see ``ordered``),
the input where it happens, and the number of positions where one result is
NaN or ±inf and the other is not the same non-finite value. Subnormal inputs
are left out of both and counted apart (``subnormal_input_diffs``: where the
results differ at all): XLA's kernels read them as 0, Triton's interpreter
does not. Where scipy has the
function, ``jit_vs_f64`` is jax.jit's own worst error against float64 truth
rounded to the dtype (on finite inputs whose truth is finite), and
``pk_vs_f64`` pallaskit's: it tells whether an error against jax.jit is
pallaskit's or XLA's.

The table is printed; ``--output DIR`` writes ``DIR/accuracy.json``;
``--write-docs`` writes ``docs/accuracy.json`` and regenerates
``docs/coverage.md`` (its accuracy section is rendered from that file, so
``python -m lowering.rules > docs/coverage.md`` keeps it). On a GPU run with
``JAX_PLATFORMS=cuda``; the Pallas path compiles for real there, where Triton's
libdevice math differs from interpret mode's XLA.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DOCS_JSON = ROOT / "docs" / "accuracy.json"
COVERAGE_MD = ROOT / "docs" / "coverage.md"


@dataclasses.dataclass(frozen=True)
class Fn:
    name: str
    fn: Callable  # jax function of `arity` arrays
    arity: int = 1
    ref: Callable | None = None  # float64 numpy/scipy truth, when there is one
    composite: bool = False  # a jax composite of several primitives, not one op


def functions() -> list[Fn]:
    import jax
    import scipy.special as sp
    import scipy.stats as st
    from jax import lax
    from jax.scipy import special as jsp
    from jax.scipy import stats as jst

    def ipow(y):
        return Fn(f"integer_pow_{y}".replace("-", "m"), lambda x: lax.integer_pow(x, y), ref=lambda x: x ** float(y))

    return [
        Fn("exp", lax.exp, ref=np.exp), Fn("exp2", lax.exp2, ref=np.exp2), Fn("expm1", lax.expm1, ref=np.expm1),
        Fn("log", lax.log, ref=np.log), Fn("log1p", lax.log1p, ref=np.log1p),
        Fn("sin", lax.sin, ref=np.sin), Fn("cos", lax.cos, ref=np.cos), Fn("tan", lax.tan, ref=np.tan),
        Fn("asin", lax.asin, ref=np.arcsin), Fn("acos", lax.acos, ref=np.arccos), Fn("atan", lax.atan, ref=np.arctan),
        Fn("sinh", lax.sinh, ref=np.sinh), Fn("cosh", lax.cosh, ref=np.cosh), Fn("tanh", lax.tanh, ref=np.tanh),
        Fn("asinh", lax.asinh, ref=np.arcsinh), Fn("acosh", lax.acosh, ref=np.arccosh),
        Fn("atanh", lax.atanh, ref=np.arctanh),
        Fn("logistic", lax.logistic, ref=sp.expit),
        Fn("sqrt", lax.sqrt, ref=np.sqrt), Fn("rsqrt", lax.rsqrt, ref=lambda x: 1.0 / np.sqrt(x)),
        Fn("cbrt", lax.cbrt, ref=np.cbrt),
        Fn("erf", lax.erf, ref=sp.erf), Fn("erfc", lax.erfc, ref=sp.erfc), Fn("erf_inv", lax.erf_inv, ref=sp.erfinv),
        ipow(2), ipow(3), ipow(-1), ipow(-2), ipow(7),
        # division is exact in IEEE arithmetic, but Triton's f32 `/` on a GPU is div.full (2 ulp)
        Fn("div", lax.div, arity=2, ref=np.divide), Fn("reciprocal", lambda x: 1.0 / x, ref=lambda x: 1.0 / x),
        Fn("pow", lax.pow, arity=2, ref=np.power), Fn("atan2", lax.atan2, arity=2, ref=np.arctan2),
        # composites (several primitives; jax's formulas, pallaskit's ops)
        Fn("log_ndtr", jsp.log_ndtr, ref=sp.log_ndtr, composite=True),
        Fn("ndtr", jsp.ndtr, ref=sp.ndtr, composite=True),
        Fn("ndtri", jsp.ndtri, ref=sp.ndtri, composite=True),
        Fn("norm.logcdf", jst.norm.logcdf, ref=st.norm.logcdf, composite=True),
        Fn("norm.logsf", jst.norm.logsf, ref=st.norm.logsf, composite=True),
        Fn("norm.sf", jst.norm.sf, ref=st.norm.sf, composite=True),
        Fn("gelu_erf", lambda x: jax.nn.gelu(x, approximate=False),
           ref=lambda x: 0.5 * x * sp.erfc(-x / np.sqrt(2.0)), composite=True),
        Fn("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True),
           ref=lambda x: 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3))), composite=True),
        Fn("softplus", jax.nn.softplus, ref=lambda x: np.logaddexp(0.0, x), composite=True),
        Fn("log_sigmoid", jax.nn.log_sigmoid, ref=lambda x: -np.logaddexp(0.0, -x), composite=True),
        Fn("logit", jsp.logit, ref=sp.logit, composite=True),
        Fn("xlogy", jsp.xlogy, arity=2, ref=sp.xlogy, composite=True),
    ]


# --------------------------------------------------------------------------- #
# Grids and ULP distances
# --------------------------------------------------------------------------- #
_INT = {"float32": np.int32, "bfloat16": np.int16, "float16": np.int16}
_MAX_FINITE_BITS = {"float32": 0x7F7FFFFF, "bfloat16": 0x7F7F, "float16": 0x7BFF}


def _np_dtype(name):
    import jax.numpy as jnp
    return np.dtype(jnp.bfloat16) if name == "bfloat16" else np.dtype(name)


def _from_bits(bits, dtype_name):
    return np.asarray(bits, _INT[dtype_name]).view(_np_dtype(dtype_name))


def special_values(dtype_name) -> np.ndarray:
    dt = _np_dtype(dtype_name)
    top = _MAX_FINITE_BITS[dtype_name]
    bits = [1, 0x00800000 if dtype_name == "float32" else (0x0080 if dtype_name == "bfloat16" else 0x0400), top]
    mag = _from_bits(np.array(bits), dtype_name).astype(np.float32)
    vals = np.concatenate([[0.0, np.inf, np.nan, 1.0], mag])
    vals = np.concatenate([vals, -vals])
    return vals.astype(np.float32).astype(dt)


def _min_normal(dtype_name) -> float:
    import jax.numpy as jnp
    return float(jnp.finfo(_np_dtype(dtype_name)).smallest_normal)


def grid(dtype_name, points: int) -> np.ndarray:
    """Values evenly spaced in bit pattern over the positive finite numbers (every
    finite value when ``points`` covers them all), their negatives, and specials."""
    top = _MAX_FINITE_BITS[dtype_name]
    half = max(points // 2, 1)
    bits = np.arange(1, top + 1) if half >= top else np.unique(np.linspace(1, top, half).round().astype(np.int64))
    pos = _from_bits(bits, dtype_name)
    return np.concatenate([pos, -pos, special_values(dtype_name)])



def ordered(a: np.ndarray) -> np.ndarray:
    """The float's bit pattern as an integer that orders like the value, counting
    in a format that flushes subnormals: every |v| below the smallest normal is
    0 (±0 too) and the smallest normal is 1. XLA's kernels flush subnormal
    results (CPU and GPU), Triton's interpreter does not; that is the
    platform's, not the formula's."""
    if a.dtype.itemsize == 4:
        b, min_normal = a.view(np.int32).astype(np.int64), 0x00800000
    else:
        b = a.view(np.int16).astype(np.int64)
        min_normal = 0x0400 if a.dtype == np.float16 else 0x0080
    sign_bit = 1 << (8 * a.dtype.itemsize - 1)
    neg = b < 0
    mag = np.where(neg, b + sign_bit, b)
    mag = np.maximum(mag - (min_normal - 1), 0)
    return np.where(neg, -mag, mag)


def compare(got: np.ndarray, want: np.ndarray):
    """(ulp distance where both are finite (0 elsewhere), mask of non-finite mismatches)."""
    gf, wf = np.isfinite(got.astype(np.float32)), np.isfinite(want.astype(np.float32))
    g32, w32 = got.astype(np.float32), want.astype(np.float32)
    same_nonfinite = (~gf & ~wf) & ((np.isnan(g32) & np.isnan(w32)) | (g32 == w32))
    mismatch = (gf != wf) | (~gf & ~wf & ~same_nonfinite)
    ulps = np.where(gf & wf, np.abs(ordered(got) - ordered(want)), 0)
    return ulps, mismatch


def _fmt(v) -> str:
    v = float(v)
    return repr(v) if not np.isfinite(v) else f"{v:.6g}"


# --------------------------------------------------------------------------- #
# Running one function
# --------------------------------------------------------------------------- #
def _inputs(f: Fn, dtype_name, points):
    if f.arity == 1:
        return [grid(dtype_name, points)]
    side = grid(dtype_name, max(int(np.sqrt(points)), 8))
    a, b = np.meshgrid(side, side, indexing="ij")
    return [a.ravel(), b.ravel()]


def _run(f: Fn, args, path: str):
    """pallaskit's result on ``path`` and whether that path really compiled it."""
    import jax
    import jax.numpy as jnp

    import pallaskit
    from pallaskit import metrics
    pallaskit.config.reset()
    pallaskit.config.update(cache=False)
    jargs = [jnp.asarray(a) for a in args]
    names = ["x", "y"][:f.arity]
    fn = (lambda x: f.fn(x)) if f.arity == 1 else (lambda x, y: f.fn(x, y))
    if path == "pallas":
        before = metrics.counters["fallback_count"]
        out = pallaskit.jit(fn)(*jargs)
        lowered = metrics.counters["fallback_count"] == before
    else:
        pallaskit.config.update(dynamic_launch="on")
        before = metrics.counters["eager_launches"]
        out = pallaskit.jit(fn, dynamic={n: {0: "n"} for n in names})(*jargs)
        lowered = metrics.counters["eager_launches"] == before + 1
    pallaskit.wait_compiles()
    return np.asarray(jax.block_until_ready(out)), lowered


def _truth(f: Fn, args, dt):
    """float64 truth rounded to ``dt`` (None without a reference)."""
    if f.ref is None:
        return None
    with np.errstate(all="ignore"):
        t = np.asarray(f.ref(*[a.astype(np.float64) for a in args]), np.float64)
    return t.astype(np.float32).astype(dt) if dt != np.float32 else t.astype(np.float32)


def _worst(ulps, args):
    i = int(np.argmax(ulps))
    return int(ulps[i]), [_fmt(a[i]) for a in args], i


def measure(f: Fn, dtype_name: str, points: int, paths) -> dict:
    import jax
    import jax.numpy as jnp
    dt = _np_dtype(dtype_name)
    args = [a.astype(dt) for a in _inputs(f, dtype_name, points)]
    try:
        want = np.asarray(jax.jit(f.fn)(*[jnp.asarray(a) for a in args]))
    except TypeError as e:  # jax has no such dtype for it (log_ndtr of bfloat16)
        return {"points": int(args[0].size), "unsupported": str(e).splitlines()[0][:200]}
    truth = _truth(f, args, dt)
    # XLA's kernels read subnormal inputs as 0, Triton's interpreter does not: such
    # positions are counted apart (subnormal_input_diffs), not in the error.
    subnormal_in = np.any([(a != 0) & (np.abs(a.astype(np.float32)) < _min_normal(dtype_name)) for a in args], axis=0)
    row = {"points": int(args[0].size)}
    if truth is not None:
        finite_in = np.all([np.isfinite(a.astype(np.float32)) for a in args], axis=0)
        ok = finite_in & np.isfinite(truth.astype(np.float32)) & ~subnormal_in
        ulps, _ = compare(want, truth)
        row["jit_vs_f64"] = int(np.max(np.where(ok, ulps, 0)))
    for path in paths:
        t0 = time.perf_counter()
        try:
            got, lowered = _run(f, args, path)
        except Exception as e:  # a crash is a finding, not the end of the sweep
            row[path] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            continue
        if not lowered:
            row[path] = {"xla": True}
            continue
        ulps, mismatch = compare(got, want)
        daz = (ulps > 0) | mismatch
        ulps, mismatch = np.where(subnormal_in, 0, ulps), mismatch & ~subnormal_in
        worst, at, i = _worst(ulps, args)
        r = {"max_ulp": worst, "at": at, "got": _fmt(got[i]), "want": _fmt(want[i]),
             "nonfinite_mismatch": int(mismatch.sum()), "subnormal_input_diffs": int((daz & subnormal_in).sum()),
             "seconds": round(time.perf_counter() - t0, 2)}
        if mismatch.any():
            j = np.flatnonzero(mismatch)[:3]
            r["mismatch_at"] = [[_fmt(a[k]) for a in args] + [_fmt(got[k]), _fmt(want[k])] for k in j]
        if truth is not None:
            u, _ = compare(got, truth)
            r["pk_vs_f64"] = int(np.max(np.where(ok, u, 0)))
        row[path] = r
    return row


def sweep(dtypes, points, paths, names=None, log=print) -> dict:
    import jax
    fns = [f for f in functions() if not names or f.name in names]
    backend = jax.default_backend()
    interpret = backend == "cpu"
    run = {"platform": f"{backend}{' (interpret mode)' if interpret else ''}",
           "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
           "python": platform.python_version(), "points": points, "paths": list(paths), "results": {}}
    try:
        import triton
        run["triton"] = triton.__version__
    except ImportError:
        paths = [p for p in paths if p != "triton"]
        run["paths"] = list(paths)
    for dtype_name in dtypes:
        res = run["results"].setdefault(dtype_name, {})
        for f in fns:
            with warnings.catch_warnings(), np.errstate(all="ignore"):  # overflow in the interpreter's numpy
                warnings.simplefilter("ignore", RuntimeWarning)
                res[f.name] = measure(f, dtype_name, points, paths)
            if "unsupported" in res[f.name]:
                del res[f.name]
                continue
            res[f.name]["composite"] = f.composite
            log(f"{dtype_name:9s} {f.name:14s} " + "  ".join(
                f"{p}: {_cell(res[f.name].get(p))}" for p in paths), file=sys.stderr)
    return run


# --------------------------------------------------------------------------- #
# Tables
# --------------------------------------------------------------------------- #
def _cell(r) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "error"
    if r.get("xla"):
        return "xla"
    s = str(r["max_ulp"])
    if r["nonfinite_mismatch"]:
        s += f" ({r['nonfinite_mismatch']} non-finite)"
    return s


def markdown(runs: list[dict]) -> str:
    from lowering.rules import accuracy_markdown
    return accuracy_markdown(runs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--points", type=int, default=1 << 17, help="float32 grid size (bfloat16: every value)")
    p.add_argument("--paths", default="pallas,triton", help="pallas, triton (raw-Triton renderer)")
    p.add_argument("--functions", default="", help="comma-separated names (default: all)")
    p.add_argument("--output", default="", help="directory for accuracy.json")
    p.add_argument("--tables", nargs="*", help="render saved accuracy.json runs instead of measuring")
    p.add_argument("--write-docs", action="store_true", help="write docs/accuracy.json and regenerate docs/coverage.md")
    a = p.parse_args(argv)
    if a.tables:
        runs = []
        for t in a.tables:
            data = json.loads(Path(t).read_text())
            runs.extend(data["runs"] if "runs" in data else [data])
    else:
        import jax
        if jax.default_backend() == "cpu":  # raw Triton in Triton's interpreter; set before triton's import
            os.environ.setdefault("TRITON_INTERPRET", "1")
        names = set(filter(None, a.functions.split(",")))
        run = sweep(a.dtypes.split(","), a.points, a.paths.split(","), names)
        runs = [run]
        if a.output:
            Path(a.output).mkdir(parents=True, exist_ok=True)
            (Path(a.output) / "accuracy.json").write_text(json.dumps(run, indent=1) + "\n")
    print(markdown(runs))
    if a.write_docs:
        from lowering.rules import coverage_markdown
        DOCS_JSON.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
        COVERAGE_MD.write_text(coverage_markdown(runs))


if __name__ == "__main__":
    main()
