"""Combo kernels: independent kernels over different shapes in one launch.

[Note: combo kernels]
After fusion, a program that updates many arrays (an optimizer over a pytree of
parameters) is a row of small kernels that share nothing: one pointwise kernel
per parameter shape, one sum of squares per gradient. Each launch costs a few
microseconds and ends in a tail of idle SMs, which for arrays of a few MB is a
large part of the time. A combo kernel runs such kernels (its *members*, or
parts) as one launch: member ``m`` owns the programs ``[start_m, start_m +
programs_m)`` of one 1-D grid and runs its own kernel body on its own tile, its
program index shifted to start at 0 (the renderers branch on the program id:
``pl.when`` in Pallas, an ``if``/``elif`` chain in Triton; codegen/combo.py).
This is Inductor's combo kernels (its horizontal fusion of independent nodes),
done on our schedule after fusion, so the fusion loop is unchanged.

Legality (``can_join``), kept apart from profit (``_packs``):
- a member is a pointwise kernel or a row-reduction kernel (not a mix kernel,
  whose grid is persistent, nor a matmul), over static, nonzero sizes: each
  loads and stores over its own flat or tiled domain, exactly as alone;
- no data dependence between members, in either direction, directly or
  through other steps: members come from one *level* of the step graph (the
  longest chain of dependencies ending at the step), and two steps of one
  level have no path between them (a path would make their levels differ);
- no effects (kernels have none; effectful externs keep their program order
  through the levels), and one device (a schedule is one device's program);
- in a loop body, a one-element pointwise kernel stays alone: the renderer
  writes it as plain jnp code, no launch at all (codegen/pallas.py
  ``inline_scalar``).

Profit: members of one level are packed in program order under caps on members,
on pointer arguments and on bytes per launch (``heuristics.COMBO_*``). Grouping
by level is linear in the number of steps (no pairs are compared). When a combo
forms, the steps are ordered by level (then by their old position): each combo
sits where its first member was, a valid order since every dependency of a
level lies in a lower level.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from lowering import heuristics, ir, sizes
from lowering.options import CompileOptions
from lowering.scheduler import Kernel


@dataclasses.dataclass
class ComboKernel(Kernel):
    """A launch running ``parts`` (ordinary kernels) side by side; ``members``
    is every part's members, ``reads`` the union of their reads."""

    parts: list = dataclasses.field(default_factory=list)


def _step_reads(step) -> list[str]:
    return list(step.reads) if isinstance(step, Kernel) else step.reads()


def _step_writes(step) -> list[str]:
    if isinstance(step, Kernel):
        return [m.name for m in step.members]
    return [step.name, *step.outputs]


def levels(steps: list) -> list[int]:
    """Each step's level: 0 for a step that reads only inputs, else one more
    than the highest level it depends on. ``steps`` are in a valid order."""
    producer: dict[str, int] = {}
    out: list[int] = []
    last_effect = None
    for i, s in enumerate(steps):
        deps = {producer[r] for r in _step_reads(s) if r in producer}
        if getattr(s, "effectful", False):
            if last_effect is not None:
                deps.add(last_effect)
            last_effect = i
        out.append(1 + max(out[d] for d in deps) if deps else 0)
        for b in _step_writes(s):
            producer[b] = i
    return out


def can_join(k, loop_body: bool = False, graph: ir.Graph | None = None) -> bool:
    """Legality of one kernel as a combo member (the level grouping gives independence)."""
    if not isinstance(k, Kernel) or isinstance(k, ComboKernel) or k.kind not in ("pointwise", "reduction"):
        return False
    if sizes.is_symbolic((k.rows, k.cols)) or k.rows * k.cols == 0:
        return False
    if graph is not None and any(sizes.is_symbolic(tuple(graph.buffer_aval(b)[0])) for b in k.reads):
        return False  # its offsets would read a dynamic size at run time: the launcher's dims, which combos lack
    if k.kind == "reduction" and any(m.role not in ("reduction", "rowwise", "row") for m in k.members):
        return False
    if loop_body and k.kind == "pointwise" and k.rows * k.cols == 1:
        return False
    return bool(k.stores)


def kernel_bytes(k: Kernel, graph: ir.Graph) -> int:
    """Bytes a kernel moves: what it reads and what it stores, once each."""
    total = 0
    for b in list(k.reads) + k.stores:
        shape, dtype = graph.buffer_aval(b)
        total += sizes.numel(shape) * np.dtype(dtype).itemsize
    return total


def _packs(kernels: list[Kernel], graph: ir.Graph) -> list[list[Kernel]]:
    """Profit: consecutive members per launch under the member, argument and
    byte caps, as few launches as the caps allow; of those plans, the one whose
    distinct launches cost least to compile ([Note: balanced packs], [Note:
    periodic packs])."""
    sized = [(k, kernel_bytes(k, graph), set(k.reads) | set(k.stores)) for k in kernels]
    packs = _greedy_packs(sized, heuristics.COMBO_MAX_MEMBERS)
    low, high = -(-len(kernels) // max(len(packs), 1)), heuristics.COMBO_MAX_MEMBERS
    while low < high:  # the smallest member cap that needs no more launches
        mid = (low + high) // 2
        if len(_greedy_packs(sized, mid)) <= len(packs):
            high = mid
        else:
            low = mid + 1
    if low < heuristics.COMBO_MAX_MEMBERS:
        packs = _greedy_packs(sized, low)
    keys = _member_keys(kernels, graph)
    best = [len(p) for p in packs]
    best_cost = _compile_cost(keys, best)
    for lengths in _periodic_plans(sized, keys, len(packs)):
        cost = _compile_cost(keys, lengths)
        if cost < best_cost:
            best, best_cost = lengths, cost
    out, start = [], 0
    for n in best:
        out.append(kernels[start:start + n])
        start += n
    return out


# [Note: balanced packs]
# A level's members fill launches in order up to the caps; the greedy fill
# left the last launch with the remainder (gpt2_adamw: 86, 77 and 19 members,
# cut by the argument cap). The launches' Triton compiles run at once, on the
# compile threads, so the largest one is what a cold compile waits for: the
# members are spread over the same number of launches with the smallest
# member cap that needs no more (61, 61, 60). Launches and bytes moved are
# unchanged.
def _greedy_packs(sized: list, max_members: int) -> list[list[Kernel]]:
    packs, cur, cur_bytes, cur_args = [], [], 0, set()
    for k, b, args in sized:
        if cur and (len(cur) >= max_members or cur_bytes + b > heuristics.COMBO_MAX_BYTES
                    or len(cur_args) + len(args - cur_args) > heuristics.COMBO_MAX_ARGS):
            packs.append(cur)
            cur, cur_bytes, cur_args = [], 0, set()
        cur.append(k)
        cur_bytes += b
        cur_args |= args
    if cur:
        packs.append(cur)
    return packs


# [Note: periodic packs]
# An optimizer over a model's layers repeats one sequence of shapes, and two
# launches whose members repeat each other's shapes render to the same Triton
# function, compiled once ([Note: shared Triton functions] in codegen/program.py).
# Balanced packs break that: 1000 arrays of a period of 8 shapes in launches of
# 125 start each launch at another phase of the period, so all eight compile,
# where launches of 128 (16 periods) make two distinct ones. A plan is costed
# by its distinct launches: about half of a combo's compile runs in parallel
# with the others' (Triton's backend passes on the compile threads: the largest
# is waited for), half one after another (Triton's Python frontend holds the
# GIL, jaxlib assembles each module's PTX under one lock: the members of every
# distinct launch add up); measured per stage in benchmarks/RESULTS.md,
# "Session 31". So the cost is the largest distinct launch plus the sum of the
# distinct launches, in members, and periodic plans compete with the balanced
# one at the same number of launches: a prefix of up to COMBO_PERIOD_PREFIX
# members (the embeddings before the layers) in the first launch, then whole
# periods per launch.
def _member_keys(kernels: list[Kernel], graph: ir.Graph) -> list[int]:
    """Each member's shape of code as a small integer: equal where two members
    would likely render alike (kind, tile, the shapes and dtypes it reads and
    stores, its outputs' roles). A heuristic of profit only."""
    ids: dict = {}
    avals: dict = {}  # (shape, dtype) -> a small integer, to sort reads by

    def aval(b):
        return avals.setdefault(graph.buffer_aval(b), len(avals))

    out = []
    for k in kernels:
        key = (k.kind, k.rows, k.cols, tuple(m.role for m in k.members),  # reads as a multiset: names order them
               tuple(sorted(aval(b) for b in k.reads)), tuple(aval(b) for b in k.stores))
        out.append(ids.setdefault(key, len(ids)))
    return out


def _run_period(keys: list) -> tuple[int, int]:
    """(p, length): the longest prefix of ``keys`` made of two or more repeats
    of its first p keys (the prefix function's borders); (0, 0) if none."""
    border = [0] * len(keys)
    for i in range(1, len(keys)):
        j = border[i - 1]
        while j and keys[i] != keys[j]:
            j = border[j - 1]
        border[i] = j + 1 if keys[i] == keys[j] else 0
    for i in range(len(keys) - 1, 0, -1):
        p = i + 1 - border[i]
        if 2 * p <= i + 1:
            return p, i + 1
    return 0, 0


_PLAN_TRIES = 8


def _periodic_plans(sized: list, keys: list, launches: int):
    """Launch lengths that keep a repeating run of members in phase: for each
    prefix q (its own members in the first launch), launches of c members, c a
    whole number of periods, over the run, then the rest filled greedily; for
    each q the smallest c within the caps and ``launches``, of its first
    ``_PLAN_TRIES`` (each try is linear in the members)."""
    n, cap = len(keys), heuristics.COMBO_MAX_MEMBERS
    for q in range(min(heuristics.COMBO_PERIOD_PREFIX, n - 1) + 1):
        p, run = _run_period(keys[q:])
        if not p or p > cap:
            continue
        for c in range(p * max(1, -(-(n - q) // (launches * p))), cap + 1, p)[:_PLAN_TRIES]:
            lengths, end = [], q + run
            start = 0
            while start < end:
                size = q + p * ((c - q) // p) if not lengths and q else c
                if size <= 0 or start + size > end:
                    break
                lengths.append(size)
                start += size
            lengths += [len(pack) for pack in _greedy_packs(sized[start:], cap)]
            if len(lengths) <= launches and _within_caps(sized, lengths):
                yield lengths
                break


def _compile_cost(keys: list, lengths: list[int]) -> int:
    """[Note: periodic packs]: the largest distinct launch plus all distinct launches, in members."""
    distinct, start = {}, 0
    for n in lengths:
        distinct.setdefault(tuple(keys[start:start + n]), n)
        start += n
    return max(distinct.values()) + sum(distinct.values())


def _within_caps(sized: list, lengths: list[int]) -> bool:
    start = 0
    for n in lengths:
        part = sized[start:start + n]
        start += n
        args = set().union(*(a for _, _, a in part))
        if n > 1 and (n > heuristics.COMBO_MAX_MEMBERS or len(args) > heuristics.COMBO_MAX_ARGS
                      or sum(b for _, b, _ in part) > heuristics.COMBO_MAX_BYTES):  # one member runs alone
            return False
    return True


def combine(steps: list, graph: ir.Graph, options: CompileOptions, loop_body: bool = False) -> list:
    """``steps`` with independent kernels of one level joined into combo kernels."""
    if not options.combo_kernels:
        return steps
    if any(sizes.dim_symbols(graph.buffer_aval(name)[0]) for name in graph.inputs):
        # A symbolic program's kernels read its dims (as sizes and as values, x.shape[0] * 2):
        # the launcher passes them, a combo's parts do not.
        return steps
    level = levels(steps)
    by_level: dict[int, list[int]] = {}
    for i, s in enumerate(steps):
        if can_join(s, loop_body, graph):
            by_level.setdefault(level[i], []).append(i)
    combos: dict[int, ComboKernel] = {}  # index of its first member -> combo
    joined: set[int] = set()
    for lvl in sorted(by_level):
        index = {id(steps[i]): i for i in by_level[lvl]}
        for pack in _packs([steps[i] for i in by_level[lvl]], graph):
            if len(pack) < 2:
                continue
            first = index[id(pack[0])]
            combos[first] = _combo(pack, f"combo_{len(combos)}")
            joined.update(index[id(k)] for k in pack)
    if not combos:
        return steps
    out = []
    for i in sorted(range(len(steps)), key=lambda i: (level[i], i)):
        if i in combos:
            out.append(combos[i])
        elif i not in joined:
            out.append(steps[i])
    return out


def _combo(parts: list[Kernel], name: str) -> ComboKernel:
    members = [m for p in parts for m in p.members]
    reads = _first_use(parts)
    origin = list(dict.fromkeys(o for p in parts for o in p.origin))  # first-seen order, linear in members
    elements = sum(p.rows * p.cols for p in parts)
    return ComboKernel(name, "combo", 1, elements, members, reads, origin, parts=list(parts))


def _first_use(parts: list[Kernel]) -> list[str]:
    """The parts' reads in order of first use (each member's loads in ``ir.walk``
    order), not by name: two launches whose members repeat each other's code
    then number their pointers alike and render to one function ([Note:
    periodic packs]); sorted names ("p10" before "p9") would not."""
    out: dict[str, None] = {}
    for p in parts:
        own = set(p.reads)
        for m in p.members:
            for ld in ir.loads(m.body):
                if ld.buffer in own:
                    out.setdefault(ld.buffer)
        for r in p.reads:  # a read no body names (an index's values): after
            out.setdefault(r)
    return list(out)

