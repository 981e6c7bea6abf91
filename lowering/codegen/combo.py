"""Combo kernels in both renderers ([Note: combo kernels] in lowering/combo.py).

Each member (part) is written as a function of its own, ``<combo>_part<i>(pid,
refs...)``, whose body is exactly what the part's kernel would run alone after
``pid`` (``write_pointwise`` / the row-reduction writer of the dialect), with
its own extents and tile; the kernel function only dispatches on the program
id. Pallas: flat refs in ``pl.ANY`` memory as every kernel here (no BlockSpecs),
one ``@pl.when`` per member (``lax.cond`` under the hood); Triton: the parts
are ``@triton.jit(noinline=True)`` functions called from an ``if``/``elif``
chain. Members whose code is the same but for the arrays they touch (refs
renamed positionally: an optimizer's update of every array of one shape) share
one function. A comment on each part names its member's kernel, tile, program
range and equations.

[Note: combo compile time]
Triton inlines a called ``@triton.jit`` function at each call site, and its
compile time grows faster than the kernel's size: an optimizer's combo over a
hundred arrays took over a minute to reach PTX. Parts not inlined, and shared
by members of the same code, bring it to seconds (benchmarks/RESULTS.md,
"Combo kernels: compile time").
"""
from __future__ import annotations

import dataclasses
import math
import re

from lowering import heuristics, ir
from lowering.codegen import pallas, triton
from lowering.codegen.emitter import RenderedKernel, kernel_coords_body, write_pointwise
from lowering.codegen.rows import render_rows
from lowering.codegen.tiles import kernel_config, transposed_load
from lowering.codegen.writer import SourceWriter
from lowering.options import CompileOptions
from lowering.scheduler import Kernel, Schedule


@dataclasses.dataclass
class Part:
    kernel: Kernel
    config: heuristics.TileConfig
    start: int  # first program id of this member
    programs: int
    # (the kernel's structure, its buffers in that structure's order) or None ([Note: combo part memo])
    structure: tuple | None = None


# [Note: combo part memo]
# An optimizer's combos hold a thousand members, most of them the same code
# over other arrays, which ``write_parts`` writes once and shares. Writing each
# member only to find its code equal to an earlier one was most of rendering
# (a coordinate substitution, the tile choice and the emitter per member). So a
# pointwise part is first reduced to its structure: every member's node (type,
# shape, dtype, role, store, coordinates) and body, each body as a tuple in
# ``ir.walk``'s order with every buffer replaced by its position in order of
# first appearance, and each buffer's role (member, read) and aval. Parts of
# equal structure are the same kernel over renamed buffers, so they get the same
# tile and the same code, the refs mapped through the positions: the tile and
# the code are computed for the first part of each structure in the program
# (kept on the schedule) and reused. Anything the structure does not cover
# (indirect indices, a read no body loads, other kinds) is written as before.
def _structure(k: Kernel, schedule: Schedule) -> tuple | None:
    if k.kind != "pointwise":
        return None
    positions: dict[str, int] = {}
    for m in k.members:
        positions.setdefault(m.name, len(positions))
    members = []
    for m in k.members:
        body = _body_structure(m.body, positions)
        if body is None:
            return None
        node = m.node
        members.append((positions[m.name], type(node).__name__, tuple(node.shape), node.dtype, m.role, m.store,
                        tuple(m.coords.items()), body))
    reads = set(k.reads)
    if not reads <= positions.keys():
        return None
    member_names = {m.name for m in k.members}
    buffers = tuple((b in member_names, b in reads, schedule.graph.buffer_aval(b)) for b in positions)
    return (k.kind, k.rows, k.cols, tuple(members), buffers), list(positions)


def _body_structure(expr: ir.Expr, positions: dict) -> tuple | None:
    """``expr`` as a tuple of its nodes in ``ir.walk`` order (operands by their
    place in it, buffers by their place in ``positions``, which grows)."""
    place, out = {}, []
    for e in ir.walk(expr):
        kind = type(e)
        if kind is ir.Load:
            if e.children():  # indirect indices name other values inside the index
                return None
            item = ("L", positions.setdefault(e.buffer, len(positions)), e.index, e.dtype, e.mask)
        elif kind is ir.Op:
            item = ("O", e.op, tuple(place[a] for a in e.args), e.dtype, e.params)
        elif kind is ir.Const:
            item = ("C", e._key(), e.dtype)
        elif kind is ir.IndexValue:
            if e.children():  # as a load's indirect indices
                return None
            item = ("I", e.expr, e.dtype)
        else:
            return None
        place[e] = len(out)
        out.append(item)
    return tuple(out)


def _memo(schedule: Schedule, name: str) -> dict:
    """A memo of the program being rendered ([Note: combo part memo]), kept on its schedule."""
    return schedule.__dict__.setdefault(name, {})


def part_config(part: Kernel, schedule: Schedule, options: CompileOptions,
                structure: tuple | None = None) -> heuristics.TileConfig:
    if structure is not None:  # [Note: combo part memo]
        memo = _memo(schedule, "_combo_part_configs")
        key = (structure[0], options)
        cfg = memo.get(key)
        if cfg is None:
            cfg = memo[key] = part_config(part, schedule, options)
        return cfg
    if part.kind == "pointwise" and not transposed_load(part, schedule):
        cfg = heuristics.combo_pointwise_config(int(part.rows), int(part.cols))
        if options.num_warps:
            cfg = dataclasses.replace(cfg, num_warps=options.num_warps)
        return cfg
    return kernel_config(part, schedule, options)


def layout(kernel, schedule: Schedule, options: CompileOptions) -> list[Part]:
    """Each part with its tile and its range of program ids, in launch order."""
    out, start = [], 0
    for p in kernel.parts:
        structure = _structure(p, schedule)
        cfg = part_config(p, schedule, options, structure)
        n = -(-int(p.rows) // cfg.block_rows)
        if p.kind == "pointwise":
            n *= -(-int(p.cols) // cfg.block_cols)
        out.append(Part(p, cfg, start, n, structure))
        start += n
    return out


def combo_config(parts: list[Part], options: CompileOptions) -> heuristics.TileConfig:
    """One launch's warps: the most any member asks for (a branch runs on all of them)."""
    warps = options.num_warps or max(p.config.num_warps for p in parts)
    big = max(parts, key=lambda p: p.config.elements).config
    return heuristics.TileConfig(big.block_rows, big.block_cols, warps, True)


def _refs(kernel) -> tuple[dict, dict]:
    ins = {b: f"in_ptr{i}" for i, b in enumerate(kernel.reads)}
    outs = {m.name: f"out_ptr{i}" for i, m in enumerate(m for m in kernel.members if m.store)}
    return ins, outs


def _describe(w: SourceWriter, i: int, part: Part) -> None:
    k, cfg = part.kernel, part.config
    w.line(f"# member {i}: {k.name} ({k.kind}, {k.rows} x {k.cols}, block {cfg.block_rows} x {cfg.block_cols}), "
           f"programs [{part.start}, {part.start + part.programs}), from:")
    for eq in k.origin:
        w.line(f"#   {eq}")


def _header(w: SourceWriter, kernel, parts: list[Part], cfg) -> None:
    total = parts[-1].start + parts[-1].programs
    w.line(f"# kernel {kernel.name}: combo of {len(parts)} independent kernels, {total} programs, "
           f"{cfg.num_warps} warps; each member owns a range of program ids")


def _part_emitter(emitter_cls, part: Part, schedule, options, ins, outs, indent=1):
    em = emitter_cls(part.kernel, schedule, part.config, options)
    em.in_refs = {b: ins[b] for b in part.kernel.reads}
    em.out_refs = {m.name: outs[m.name] for m in part.kernel.members if m.store}
    em.w = SourceWriter(indent)
    return em


def _bodies(part: Part) -> dict:
    return {m.name: kernel_coords_body(m) for m in part.kernel.members}


def write_parts(w: SourceWriter, emitter_cls, kernel, parts: list[Part], schedule, options, ins, outs,
                part_function, runtime_extents: bool = False) -> tuple[set, list]:
    """Each part as a function (both dialects): its body is what the part's
    kernel would run alone after ``pid``; ``part_function(w, name, params,
    part, em)`` writes the dialect's signature and constants. Parts of the same
    code share one function ([Note: combo compile time]); ``runtime_extents``:
    a pointwise part's extents are parameters, so that members differing only
    in size share it too. Returns (helpers, [(function name, refs in its
    parameters' order)])."""
    helpers, calls, shared = set(), [], {}
    memo = _memo(schedule, "_combo_part_code")
    for i, part in enumerate(parts):
        key = None if part.structure is None else (part.structure[0], part.config, emitter_cls, options,
                                                   part_function, runtime_extents)
        hit = memo.get(key) if key is not None else None
        if hit is not None:  # [Note: combo part memo]
            code, part_helpers, named = hit
            refs = _mapped_refs(part, named, ins, outs)
        else:
            code, part_helpers, refs, n_named = _write_part(emitter_cls, part, schedule, options, ins, outs,
                                                            part_function, runtime_extents)
            named = _ref_places(part, refs[:n_named], ins, outs) if key is not None else None
            if named is not None:
                memo[key] = code, part_helpers, named
        helpers |= part_helpers
        _describe(w, i, part)
        fn = shared.get(code)
        if fn is None:
            fn = shared[code] = f"{kernel.name}_part{len(shared)}"
            w.lines.append(code.replace(_NAME, fn, 1))
        else:
            w.line(f"# (runs {fn})")
        w.line()
        w.line()
        calls.append((fn, refs))
    return helpers, calls


def _write_part(emitter_cls, part: Part, schedule, options, ins, outs, part_function, runtime_extents):
    """(the part's function with positional refs and name ``_NAME``, its helpers,
    its refs in order, how many of them its code names)."""
    em = _part_emitter(emitter_cls, part, schedule, options, ins, outs)
    k = part.kernel
    if k.kind == "pointwise":
        write_pointwise(em, k, _bodies(part), part.config, runtime_extents)
    else:
        render_rows(em, k, _bodies(part), part.config)
    body = em.w.source().rstrip("\n")
    refs = _refs_in_order(body, list(em.in_refs.values()) + list(em.out_refs.values()))
    head = SourceWriter()
    part_function(head, _NAME, [f"ref{j}" for j in range(len(refs))], part, em)
    n_named = len({m.group(0) for m in _REF.finditer(body)})
    return head.source() + _positional_refs(body, refs), set(em.helpers), refs, n_named


def _part_refs(part: Part, ins, outs) -> list[str]:
    """Every ref a part's function takes: reads, then stored members (``_part_emitter``'s order)."""
    k = part.kernel
    return [ins[b] for b in k.reads] + [outs[m.name] for m in k.members if m.store]


def _ref_places(part: Part, named_refs: list[str], ins, outs) -> list | None:
    """Each ref a part's code names, in order, as (in or out, the buffer's place
    in the part's structure); None where one is not there."""
    place = {b: j for j, b in enumerate(part.structure[1])}
    buffer = {ins[b]: ("in", b) for b in part.kernel.reads}
    buffer.update({outs[m.name]: ("out", m.name) for m in part.kernel.members if m.store})
    named = []
    for r in named_refs:
        side, b = buffer[r]
        if b not in place:
            return None
        named.append((side, place[b]))
    return named


def _mapped_refs(part: Part, named: list, ins, outs) -> list[str]:
    """The refs of a part whose code an equal structure wrote: the named ones
    through their places, then the rest in the order ``_refs_in_order`` gives them."""
    order = part.structure[1]
    refs = [(ins if side == "in" else outs)[order[j]] for side, j in named]
    return refs + [r for r in _part_refs(part, ins, outs) if r not in refs]


_NAME = "__part__"  # the function's name while its code is compared
_REF = re.compile(r"\b(?:in|out)_ptr\d+\b")


def _refs_in_order(code: str, refs: list[str]) -> list[str]:
    """``refs`` in the order ``code`` first names them (unnamed ones last), so
    that the same code over other arrays gets the same positional names."""
    seen = list(dict.fromkeys(m.group(0) for m in _REF.finditer(code)))
    return seen + [r for r in refs if r not in seen]


def _positional_refs(code: str, refs: list[str]) -> str:
    names = {r: f"ref{j}" for j, r in enumerate(refs)}
    return _REF.sub(lambda m: names[m.group(0)], code)


# --------------------------------------------------------------------------- #
# Pallas
# --------------------------------------------------------------------------- #
def _pallas_part_function(w, fn, refs, part, em) -> None:
    w.line(f"def {fn}(pid, {', '.join(refs)}):")
    with w.indent():
        w.line(f"ROWS, COLS = {int(part.kernel.rows)}, {int(part.kernel.cols)}")
        w.line(f"BLOCK_R, BLOCK_C = {part.config.block_rows}, {part.config.block_cols}")
        w.line(f"IDX = {em.index_dtype}")


def render_pallas(kernel, schedule: Schedule, options: CompileOptions):
    """(RenderedKernel, helpers) of a combo kernel as one ``pallas_call``."""
    parts = layout(kernel, schedule, options)
    cfg = combo_config(parts, options)
    ins, outs = _refs(kernel)
    w = SourceWriter()
    _header(w, kernel, parts, cfg)
    helpers, calls = write_parts(w, pallas.PallasEmitter, kernel, parts, schedule, options, ins, outs,
                                 _pallas_part_function)
    all_refs = list(ins.values()) + list(outs.values())
    w.line(f"def {kernel.name}_kernel({', '.join(all_refs)}):")
    with w.indent():
        w.line("pid = pl.program_id(0)")
        for i, (part, (fn, refs)) in enumerate(zip(parts, calls)):
            end = part.start + part.programs
            cond = f"pid < {end}" if i == 0 else (f"pid >= {part.start}" if i == len(parts) - 1
                                                 else f"(pid >= {part.start}) & (pid < {end})")
            w.line()
            w.line(f"@pl.when({cond})")
            w.line(f"def _member{i}():  # {part.kernel.name}")
            with w.indent():
                shifted = "pid" if part.start == 0 else f"pid - {part.start}"
                w.line(f"{fn}({shifted}, {', '.join(refs)})")
    w.line()
    total = parts[-1].start + parts[-1].programs
    pallas.write_launcher(w, kernel, len(ins), total, cfg.num_warps, 1)
    return RenderedKernel(kernel.name, w.source(), list(kernel.origin), cfg), helpers


# --------------------------------------------------------------------------- #
# Triton
# --------------------------------------------------------------------------- #
def _triton_part_function(w, fn, refs, part, em) -> None:
    w.line("@triton.jit(noinline=True)")
    if _runtime_extents(part):
        w.line(f"def {fn}(pid, {', '.join(refs)}, ROWS, COLS, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):")
    else:
        w.line(f"def {fn}(pid, {', '.join(refs)}, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):")
    with w.indent():
        if _runtime_extents(part):
            w.line(f"# [Note: combo part extents]: COLS a multiple of {math.gcd(int(part.kernel.cols), _VECTOR)}")
        else:
            w.line(f"ROWS = {int(part.kernel.rows)}")
            w.line(f"COLS = {int(part.kernel.cols)}")
        if em.index_dtype != "tl.int32":
            w.line(f"pid = pid.to({em.index_dtype})")


# [Note: combo part extents]
# Members of one code but different sizes (an optimizer's update of arrays of
# many shapes) share one Triton part function: its ROWS and COLS are runtime
# arguments, not constants (Triton specializes a called function on constant
# arguments), so Triton's frontend and backend compile the body once per code,
# not once per size. Triton's axis analysis takes an argument's divisibility
# from every call site, so one member of odd width would cost every member of
# the function its vector accesses: members share only within one class of
# gcd(COLS, 16), which the body's first line names (the class is part of the
# code compared).
_VECTOR = 16


def _runtime_extents(part: Part) -> bool:
    return part.kernel.kind == "pointwise"


def render_triton(kernel, schedule: Schedule, options: CompileOptions):
    """A combo kernel for codegen/triton.py (its ``_Rendered``)."""
    parts = layout(kernel, schedule, options)
    cfg = combo_config(parts, options)
    ins, outs = _refs(kernel)
    w = SourceWriter()
    for part in parts:
        k = part.kernel
        if k.kind == "reduction" and any(m.role == "reduction" and m.node.op not in triton.REDUCE
                                         for m in k.members):
            raise triton.TritonUnsupported(f"{k.name}: a reduction the Triton renderer does not write")
    helpers, calls = write_parts(w, triton.TritonEmitter, kernel, parts, schedule, options, ins, outs,
                                 _triton_part_function, runtime_extents=True)
    _header(w, kernel, parts, cfg)
    members = [(part.start, part.start + part.programs, _member_call(part, fn, refs), list(dict.fromkeys(refs)))
               for part, (fn, refs) in zip(parts, calls)]
    groups = _dispatch_groups(members)
    if len(groups) > 1:  # [Note: combo dispatch groups]
        members = [_write_group(w, f"{kernel.name}_group{j}", group) for j, group in enumerate(groups)]
    all_refs = list(ins.values()) + list(outs.values())
    w.line("@triton.jit")
    w.line(f"def {kernel.name}_kernel({', '.join(all_refs)}):")
    with w.indent():
        w.line("pid = tl.program_id(0)")
        _write_dispatch(w, members)
    total = parts[-1].start + parts[-1].programs
    return triton.Rendered(kernel.name, w.source(), list(kernel.reads), [], str(total), {}, cfg.num_warps, 1,
                            helpers, cfg)


# [Note: combo dispatch groups]
# Triton's frontend copies every live value of the enclosing scope at each
# ``if`` (to merge what the branches redefine), so a chain of M member branches
# in a kernel of A pointer parameters costs it M x A copies (an optimizer's
# combo: a hundred members, near a thousand pointers), on a thread holding the
# GIL. Past ``COMBO_DISPATCH_GROUP`` members the chain is split into about
# sqrt(M) groups of consecutive members, each a ``noinline`` function taking
# only its members' pointers: the kernel branches over the groups and each
# group over its members, about 2 sqrt(M) x A copies in all. Every program
# still runs exactly its member's code on its member's tile; a program pays
# one more call.
def _member_call(part: Part, fn: str, refs: list[str]) -> str:
    shifted = "pid" if part.start == 0 else f"pid - {part.start}"
    blocks = f"{part.config.block_rows}, {part.config.block_cols}"
    if _runtime_extents(part):  # tensors, not constants: constants would specialize the function
        rows, cols = int(part.kernel.rows), int(part.kernel.cols)
        dtype = "tl.int32" if max(rows, cols) < 2 ** 31 else "tl.int64"
        blocks = f"tl.full((), {rows}, {dtype}), tl.full((), {cols}, {dtype}), {blocks}"
    return f"{fn}({shifted}, {', '.join(refs)}, {blocks})  # {part.kernel.name}"


def _dispatch_groups(members: list) -> list[list]:
    """Consecutive members in about sqrt(M) groups of about sqrt(M) each; one
    group (a flat chain) up to ``heuristics.COMBO_DISPATCH_GROUP`` members."""
    n = len(members)
    if n <= heuristics.COMBO_DISPATCH_GROUP:
        return [members]
    size = math.isqrt(n - 1) + 1
    return [members[i:i + size] for i in range(0, n, size)]


def _write_group(w: SourceWriter, name: str, group: list) -> tuple:
    """A group's dispatch as a ``noinline`` function of its members' pointers;
    returns the kernel's member entry that calls it."""
    if len(group) == 1:
        return group[0]
    refs = list(dict.fromkeys(r for *_, rs in group for r in rs))
    w.line("@triton.jit(noinline=True)")
    w.line(f"def {name}(pid, {', '.join(refs)}):")
    with w.indent():
        _write_dispatch(w, group)
    w.line()
    w.line()
    return group[0][0], group[-1][1], f"{name}(pid, {', '.join(refs)})", refs


def _write_dispatch(w: SourceWriter, members: list) -> None:
    """The ``if``/``elif`` chain over (start, end, call, refs) on program ids."""
    for i, (_, end, call, _) in enumerate(members):
        if i == len(members) - 1:
            w.line("else:" if i else "if True:")
        else:
            w.line(f"{'if' if i == 0 else 'elif'} pid < {end}:")
        with w.indent():
            w.line(call)


def is_combo(kernel) -> bool:
    return kernel.kind == "combo"


triton.KIND_RENDERERS["combo"] = render_triton
