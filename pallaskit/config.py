"""pallaskit's options: one object, ``pallaskit.config``.

Each option can be set, in increasing precedence, by its default, the
environment variable ``PALLASKIT_<NAME>``, the absl flag ``--pallaskit_<name>``
(once absl has parsed flags; the library works without that), and
``pallaskit.config.update(name=value)`` or ``with pallaskit.config.override(...)``.
An unknown name or a bad value raises an error listing what is valid.
``pallaskit.config.help()`` prints every option with its value, default,
environment variable and help; ``pallaskit.config.describe(name)`` one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable

from absl import flags as absl_flags


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    help: str
    parse: Callable[[str], Any]  # from env / flag text
    check: Callable[[Any], Any] | None = None  # validate and normalize a value
    valid: str = ""  # what is valid, for error messages


def _parse_bool(text):
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _check_bool(v):
    if isinstance(v, str):
        return _parse_bool(v)
    if not isinstance(v, bool):
        raise ValueError(f"expected a bool, got {v!r}")
    return v


def _check_tier_up(v):
    if isinstance(v, str) and v.strip().lower() in ("static", "variant"):
        return v.strip().lower()
    raise ValueError(f"expected 'static' or 'variant', got {v!r}")


def _check_dynamic_launch(v):
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, str) and v.strip().lower() in ("auto", "on", "off"):
        return v.strip().lower()
    raise ValueError(f"expected 'auto', 'on' or 'off', got {v!r}")


def _check_kernel_backend(v):
    if isinstance(v, str) and v.strip().lower() in ("auto", "pallas", "triton"):
        return v.strip().lower()
    raise ValueError(f"expected 'auto', 'pallas' or 'triton', got {v!r}")


def _check_shard_kernels(v):
    if isinstance(v, str) and v.strip().lower() in ("auto", "per_shard", "spmd"):
        return v.strip().lower()
    raise ValueError(f"expected 'auto', 'per_shard' or 'spmd', got {v!r}")


def _check_interpret(v):
    if isinstance(v, str):
        v = v.strip().lower()
        if v == "auto":
            return "auto"
        return _parse_bool(v)
    if v == "auto" or isinstance(v, bool):
        return v
    raise ValueError(f"expected 'auto', True or False, got {v!r}")


def _check_long_rows(v):
    if isinstance(v, str) and v.strip().lower() in ("auto", "persistent", "looped"):
        return v.strip().lower()
    raise ValueError(f"expected 'auto', 'persistent' or 'looped', got {v!r}")


def _check_nonneg_int(v):
    if isinstance(v, str):
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected an int >= 0, got {v!r}")
    return v


def _check_int_from_minus_one(v):
    if isinstance(v, str):
        v = int(v.strip())
    if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise ValueError(f"expected an int >= -1, got {v!r}")
    return v


def _check_hints(v):
    """Comma-separated positive ints (or ints), normalized to sorted unique text;
    '' keeps one variant at the first call's sizes."""
    if isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    elif isinstance(v, (tuple, list)):
        v = ",".join(map(str, v))
    if not isinstance(v, str):
        raise ValueError(f"expected comma-separated positive ints such as '64,256,4096', got {v!r}")
    parts = [p.strip() for p in v.split(",") if p.strip()]
    values = []
    for p in parts:
        try:
            n = int(p)
        except ValueError:
            n = 0
        if n < 1 or not p.isdigit():
            raise ValueError(f"expected comma-separated positive ints such as '64,256,4096' (or '' for one "
                             f"variant at the first call's sizes), got {v!r}")
        values.append(n)
    return ",".join(map(str, sorted(set(values))))


def _check_str(v):
    if not isinstance(v, str):
        raise ValueError(f"expected a string, got {v!r}")
    return v


def _check_size(v):
    if isinstance(v, str):
        t = v.strip().upper().removesuffix("B")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
        v = int(float(t[:-1] if scale > 1 else t) * scale)
    return _check_nonneg_int(v)


def _check_metric_tables(v):
    from pallaskit.metric_tables import TABLES

    names = [n.strip() for n in _check_str(v).split(",") if n.strip()]
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        raise ValueError(f"unknown metric table(s) {', '.join(unknown)}; valid tables: {', '.join(TABLES)}")
    return ",".join(dict.fromkeys(names))


MATMUL_TEMPLATE_MODES = ("auto", "fused", "unfused", "off")


def _check_matmul_template(v):
    """A mode name; booleans (and their text forms) mean 'fused' or 'off'."""
    if isinstance(v, bool):
        return "fused" if v else "off"
    if isinstance(v, str):
        t = v.strip().lower()
        if t in MATMUL_TEMPLATE_MODES:
            return t
        try:
            return "fused" if _parse_bool(t) else "off"
        except ValueError:
            pass
    raise ValueError(f"expected one of {', '.join(MATMUL_TEMPLATE_MODES)} (or a boolean), got {v!r}")


def _check_partitioner(v):
    from pallaskit.runtime import preload

    preload.wait()
    from lowering.partition import PARTITIONERS

    if v not in PARTITIONERS:
        raise ValueError(f"expected one of {', '.join(PARTITIONERS)}, got {v!r}")
    return v


OPTIONS: dict[str, Option] = {o.name: o for o in [
    Option("interpret", "auto", "Render Pallas kernels in interpret mode: 'auto' (when JAX's backend is the CPU), "
           "true or false.", str, _check_interpret, "'auto', true, false"),
    Option("fusion", True, "Fuse materialized nodes into shared kernels.", _parse_bool, _check_bool, "true, false"),
    Option("max_persistent_cols", 8192, "Largest reduced extent kept in one tile; larger reductions loop.",
           int, _check_nonneg_int, "an int >= 0"),
    Option("online_softmax", True, "In a reduction that loops over column chunks, compute a row's max and its "
           "sum of exp(x - max) in one sweep (running max, rescaled sum) instead of two.", _parse_bool, _check_bool,
           "true, false"),
    Option("long_rows", "auto", "Row reductions longer than max_persistent_cols: 'auto' (the heuristics decide), "
           "'persistent' (a whole row in one tile, read once, up to 65536 columns), 'looped' (column chunks).",
           str, _check_long_rows, "'auto', 'persistent', 'looped'"),
    Option("num_warps", 0, "Force the warps of every kernel (0: the heuristics decide).", int, _check_nonneg_int,
           "an int >= 0"),
    Option("debug_dir", "", "If set, write the jaxpr, the IR before and after fusion and the generated source "
           "of every compiled function into a folder per function under this directory.", str, _check_str,
           "a directory path or ''"),
    Option("mix_order_reduction", True, "Fuse a per-row reduction and per-column reductions of the same input "
           "into one kernel plus a small partial-sum kernel (norm backward).", _parse_bool, _check_bool,
           "true, false"),
    Option("kernel_backend", "auto", "Which executor runs the generated kernels (lowering/executors.py; "
           "pallaskit.explain names each kernel's and why): 'auto': on a GPU raw Triton inside the XLA program "
           "(jaxlib's Triton custom call) for every kernel kind the Triton renderer writes, Pallas for the rest and "
           "where the suite measured Pallas faster; in interpret mode (the CPU) Pallas's interpreter. 'pallas': "
           "Pallas kernels (on a GPU through Pallas's Triton backend, which JAX 0.11 deprecated). 'triton': raw "
           "Triton inside XLA wherever the Triton renderer writes the kernel, also in interpret mode (Triton's "
           "interpreter through a host callback).", str, _check_kernel_backend, "'auto', 'pallas', 'triton'"),
    Option("triton_mix_kernels", "auto", "Deprecated, use kernel_backend: 'on' means kernel_backend='triton', "
           "'off' kernel_backend='pallas', 'auto' leaves kernel_backend as it is.", str, _check_dynamic_launch,
           "'auto', 'on', 'off'"),
    Option("loop_bodies", "auto", "Compile the bodies of scan / while_loop / cond as pallaskit programs whose "
           "kernels run inside XLA's loop. 'auto': every loop in interpret mode; on a GPU the loops whose bodies "
           "hold a large 16-bit matmul (an RNN cell, a transformer layer; heuristics.loop_body_pays), the others "
           "run as XLA's own loop (measured faster there, RESULTS.md 'Session 28'); 'on': every loop; 'off': loops "
           "run through XLA.", str, _check_dynamic_launch, "'auto', 'on', 'off'"),
    Option("fused_attention", True, "Run attention written as einsum / softmax / einsum (any scale, a where-mask, "
           "a causal one) and its jax.grad as flash-attention kernels that never store the [T, T] scores "
           "(lowering/attention.py), where raw Triton runs the kernels (a GPU, or kernel_backend='triton'). "
           "pallaskit.explain lists each rewrite.", _parse_bool, _check_bool, "true, false"),
    Option("scan_hoisting", True, "Compute the part of a lax.scan body that reads only the scanned inputs and "
           "loop constants, not the carry, for every step at once before the loop when it holds a matmul (an RNN "
           "cell's input projection x_t @ W becomes one batched matmul over all steps, whose results the loop "
           "scans), as cuDNN and PyTorch LSTMs do. pallaskit.explain lists each rewritten scan.", _parse_bool,
           _check_bool, "true, false"),
    Option("combo_kernels", True, "Run independent pointwise kernels and row reductions of different shapes "
           "(an optimizer update over many arrays, the sums of squares of a global-norm clip) as one launch, each "
           "member over its own range of program ids.", _parse_bool, _check_bool, "true, false"),
    Option("deterministic_scatter", False, "Keep a scatter's result the same from run to run. A scatter "
           "with many updates per element (an embedding's gradient, segment_sum / segment_max, a histogram, a "
           "mask set at many ids) is by default a raw-Triton kernel of atomics, as XLA's and Inductor's are: "
           "fast, but a float sum or product then lands in a different order on each run (results differ in "
           "the last bits), and a set with repeated indices keeps whichever update lands last. On, those "
           "scatters run through XLA (integer and bool scatters, float max / min, and sets with unique "
           "indices or one value give the same bits anyway and stay atomic), and every GPU executable "
           "compiles with XLA's xla_gpu_exclude_nondeterministic_ops (which also makes XLA's own scatters, "
           "and some GEMMs and convolutions, deterministic and slower).",
           _parse_bool, _check_bool, "true, false"),
    Option("split_reductions", True, "Run a long reduction with few outputs in two stages so it fills the GPU.",
           _parse_bool, _check_bool, "true, false"),
    Option("allow_excess_precision", True, "Keep float32 between fused bfloat16 ops and round once at the "
           "store, as XLA's xla_allow_excess_precision does (float16 ops round every step, as XLA's do); false "
           "rounds after every op like jax's semantics.",
           _parse_bool, _check_bool, "true, false"),
    Option("num_sms", 0, "Streaming multiprocessors to size grids for (0: the default device's count; "
           "4 on the CPU).", int, _check_nonneg_int, "an int >= 0"),
    Option("matmul_template", "auto", "dot_general through pallaskit's matmul template: 'auto' (the template "
           "where heuristics expect it to beat XLA: 16-bit operands, few rows; XLA elsewhere), 'fused' (the template "
           "wherever it applies, pointwise consumers such as bias, activation, residual and casts fused into its "
           "store), 'unfused' (the template alone), 'off' (XLA runs every dot_general). Integer dots and some "
           "precision configs always run through XLA.", str, _check_matmul_template,
           "'auto', 'fused', 'unfused', 'off' (true means 'fused', false 'off')"),
    Option("automatic_dynamic", True, "Make an argument axis dynamic (one shape-generic compilation serving "
           "every size) once a function is called with a second distinct size of it, everything else equal, as "
           "torch.compile does. On a GPU this holds only where the symbolic program's kernels launch eagerly "
           "(option dynamic_launch: a new size runs at once, a recurring size compiles its own static program in "
           "the background); otherwise, and wherever the function cannot be traced with a symbolic size (a "
           "size-dependent branch, a shape computed from a size), each size compiles on its own, and a size that "
           "an equality test in the trace depended on (x.shape[0] == 1) compiles on its own too. Off: one "
           "compilation per size, as jax.jit.", _parse_bool, _check_bool, "true, false"),
    Option("automatic_dynamic_speculate", True, "Automatic dynamic: while JAX and XLA compile a function's "
           "first static program, compile in the background the shape-generic program a second size would need, for "
           "a guess of its dynamic axes (each argument's leading axis whose size no other axis has), with its "
           "eager kernels; a second size that changes exactly those axes then runs at once. Only where new sizes "
           "launch eagerly (option dynamic_launch), for programs of up to 500 equations. It costs a function that "
           "never changes size one more compile, off the calling thread.", _parse_bool, _check_bool, "true, false"),
    Option("log_fallbacks", True, "Log one line per primitive run through XLA (once per primitive).",
           _parse_bool, _check_bool, "true, false"),
    Option("partitioner", "min_cut", "How a differentiated function is split into forward and backward "
           "(pallaskit/autodiff.py): 'min_cut' recomputes cheap pointwise values in the backward to save the "
           "fewest bytes; 'default' saves what JAX's partial evaluation saves.", str, _check_partitioner,
           "'min_cut', 'default'"),
    Option("multi_kernel_hints", "64,256,4096", "Multi-kernel (dynamic dims): compile a symbolic graph once per "
           "hinted size, every dim symbol read at that size by the heuristics (tiles, warps, persistent or looped, "
           "split or not); variants with identical source are kept once, and the first call of each new size picks "
           "one (GPU: timed on the real arguments; interpret mode: the nearest hint by log distance). '' compiles "
           "one variant at the first call's sizes.", str, _check_hints,
           "comma-separated positive ints such as '64,256,4096', or ''"),
    Option("dynamic_launch", "auto", "Dynamic dims: serve a new size's first calls by launching the symbolic "
           "program's kernels as raw Triton outside XLA (compiled once, sizes as kernel arguments; "
           "pallaskit/runtime/eager.py) while the size's XLA executable compiles in the background from its second "
           "call. 'auto': on a GPU when every kernel renders to Triton and triton is installed; 'on': also in "
           "interpret mode (Triton's interpreter); 'off': every new size waits for its XLA compile.",
           str, _check_dynamic_launch, "'auto', 'on', 'off'"),
    Option("dynamic_tier_up", "static", "Dynamic dims with dynamic_launch: what a recurring size (its second call) "
           "compiles in the background to replace its eager launches: 'static', its own static program (pallaskit's "
           "full compile at that size, through the on-disk cache); 'variant', the multi-kernel variant chosen for "
           "it, compiled by XLA for that size.", str, _check_tier_up, "'static', 'variant'"),
    Option("multi_kernel_force", -1, "Multi-kernel: run this variant index (in ascending hint order, after "
           "identical variants are merged) for every new size instead of choosing (-1: choose).", int,
           _check_int_from_minus_one, "an int >= -1"),
    Option("multi_kernel_disk_cache", True, "Multi-kernel: keep each size's chosen variant on disk "
           "(<cache_dir>/multi_kernel/<hash of the variants' sources>.json) so a new process reuses it; also off "
           "when the option cache is off.", _parse_bool, _check_bool, "true, false"),
    Option("command_buffers", True, "On a GPU, compile every program's XLA executable with command buffers "
           "(CUDA graphs) whatever its size (XLA's xla_gpu_graph_min_graph_size=1; XLA's default leaves "
           "programs under 5 kernels as separate launches): one graph launch per call, less host time "
           "([Note: command buffers] in pallaskit/cache). XLA_FLAGS that turn command buffers off still do.",
           _parse_bool, _check_bool, "true, false"),
    Option("autotune_ahead", True, "On a GPU, the part of a new program that XLA runs around its matmuls and "
           "convolutions is compiled on a thread as soon as the compiler has scheduled the program, so that XLA "
           "autotunes them while the raw-Triton kernels compile; the program's own compile then finds them tuned "
           "([Note: autotuning ahead] in pallaskit/runtime/xla_warm.py).", _parse_bool, _check_bool,
           "true, false"),
    Option("preload_compiler", True, "pallaskit.jit(f) of a function the cache has not run before starts "
           "reading the cache key's environment and importing the compiler (lowering's passes, sympy, Pallas; on "
           "the CPU jax's Pallas interpreter; on a GPU also triton, and four compile workers start) on a thread, "
           "so that a first compile does not wait for it: "
           "the import runs while the script builds its inputs ([Note: compiler preload] in "
           "pallaskit/runtime/preload.py). Off: imported by the first compile.", _parse_bool, _check_bool,
           "true, false"),
    Option("triton_compile_processes", True, "On a GPU, compile raw Triton kernels (to PTX inside XLA, to cubin "
           "for eager launches) in worker processes, one per compile thread, started as a GPU compile begins "
           "and more with the threads that need them: Triton's Python frontend holds the GIL, so on threads the "
           "kernels' frontends take turns with each other and with JAX lowering the program ([Note: compile "
           "workers] in pallaskit/runtime/triton_compile.py). Off: on the compile threads.", _parse_bool,
           _check_bool, "true, false"),
    Option("shard_kernels", "auto", "Sharded calls: 'per_shard' compiles the program at each shard's shapes and "
           "runs it under jax.shard_map, collectives where a reduction or a matmul crosses shards ([Note: "
           "per-shard kernels] in pallaskit/per_shard.py); 'spmd' compiles it at global shapes and leaves it to "
           "XLA's SPMD partitioner, which gathers the operands of every opaque kernel (GPU); 'auto': per_shard "
           "where kernels are opaque (not interpret mode), else spmd. Calls per_shard cannot take go spmd.",
           str, _check_shard_kernels, "'auto', 'per_shard', 'spmd'"),
    # -- graph cache and metric tables (pallaskit/cache, pallaskit/metrics.py) --
    Option("cache", True, "Keep compiled graphs (generated source and the compiled executable) in an on-disk "
           "cache, so that a new process running the same function compiles nothing.", _parse_bool, _check_bool,
           "true, false"),
    Option("cache_dir", "", "Directory of the on-disk cache ('': platformdirs.user_cache_dir('pallaskit')).",
           str, _check_str, "a directory path or ''"),
    Option("cache_max_bytes", 1 << 30, "Size cap of the on-disk graph cache; least recently used entries are "
           "evicted past it. Accepts K, M, G suffixes.", _check_size, _check_size,
           "an int >= 0, optionally with a K, M or G suffix"),
    Option("enabled_metric_tables", "", "Comma-separated metric tables to write as CSV files into metrics_dir.",
           str, _check_metric_tables, "a comma-separated subset of the metric table names "
           "(see pallaskit.metrics.TABLES)"),
    Option("metrics_dir", "", "Directory of the metric table CSV files ('': the current directory).", str,
           _check_str, "a directory path or ''"),
]}


def _define_absl_flags():
    for o in OPTIONS.values():
        name = f"pallaskit_{o.name}"
        if name in absl_flags.FLAGS:
            continue
        absl_flags.DEFINE_string(name, None, o.help)


_define_absl_flags()


class Config:
    """The options object. Attribute access reads the effective value."""

    def __init__(self):
        object.__setattr__(self, "_explicit", {})

    def _unknown(self, name):
        return AttributeError(f"unknown pallaskit option {name!r}; valid options: {', '.join(sorted(OPTIONS))}")

    @staticmethod
    def _validate(o: Option, value, source: str):
        try:
            return o.check(value) if o.check else value
        except (ValueError, TypeError) as e:
            raise ValueError(f"bad value for pallaskit option {o.name!r} from {source}: {e}. "
                             f"Valid: {o.valid}") from None

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        o = OPTIONS.get(name)
        if o is None:
            raise self._unknown(name)
        if name in self._explicit:
            return self._explicit[name]
        flag = absl_flags.FLAGS[f"pallaskit_{name}"] if absl_flags.FLAGS.is_parsed() else None
        if flag is not None and flag.value is not None:
            return self._validate(o, flag.value, f"--pallaskit_{name}")
        env = os.environ.get(f"PALLASKIT_{name.upper()}")
        if env is not None:
            return self._validate(o, env, f"PALLASKIT_{name.upper()}")
        return o.default

    def __setattr__(self, name, value):
        self.update(**{name: value})

    def update(self, **values):
        for name, value in values.items():
            o = OPTIONS.get(name)
            if o is None:
                raise self._unknown(name)
            self._explicit[name] = self._validate(o, value, "config.update")

    def reset(self, name: str | None = None):
        if name is None:
            self._explicit.clear()
        else:
            self._explicit.pop(name, None)

    @contextlib.contextmanager
    def override(self, **values):
        saved = dict(self._explicit)
        self.update(**values)
        try:
            yield self
        finally:
            self._explicit.clear()
            self._explicit.update(saved)

    def snapshot(self) -> dict:
        """Every option's effective value; also checks the environment for
        misspelled PALLASKIT_* variables."""
        for key in os.environ:
            if key.startswith("PALLASKIT_") and key[len("PALLASKIT_"):].lower() not in OPTIONS:
                raise ValueError(f"unknown environment variable {key}; valid: "
                                 f"{', '.join('PALLASKIT_' + n.upper() for n in sorted(OPTIONS))}")
        return {name: getattr(self, name) for name in OPTIONS}

    def describe(self, name: str) -> str:
        """One option: its value and where it came from, its default, the
        environment variable and absl flag that set it, what is valid, and its help."""
        o = OPTIONS.get(name)
        if o is None:
            raise self._unknown(name)
        value = getattr(self, name)
        if name in self._explicit:
            source = "config.update"
        elif absl_flags.FLAGS.is_parsed() and absl_flags.FLAGS[f"pallaskit_{name}"].value is not None:
            source = f"--pallaskit_{name}"
        elif f"PALLASKIT_{name.upper()}" in os.environ:
            source = f"PALLASKIT_{name.upper()}"
        else:
            source = "default"
        return (f"{name} = {value!r}  ({source}; default {o.default!r})\n"
                f"    env PALLASKIT_{name.upper()}, flag --pallaskit_{name}; valid: {o.valid or 'any'}\n"
                f"    {o.help}")

    def help(self, name: str | None = None) -> str:
        """Every option (or ``name``) described as ``describe`` does; the text
        is returned and printed."""
        text = self.describe(name) if name else "\n\n".join(self.describe(n) for n in OPTIONS)
        print(text)
        return text

    def __repr__(self):
        return "pallaskit.config(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in OPTIONS) + ")"


config = Config()
