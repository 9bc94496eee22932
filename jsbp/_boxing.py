"""Boxing: converting a global tensor from one (placement, nd-sbp) to another.

The planner searches the space of nd-sbps with Dijkstra. A *move* changes the SBP of a group of
placement axes that change the same way, using exactly one collective (or none):

=============  ====================  ============================================
move           collective            when it is legal (hierarchical splits)
=============  ====================  ============================================
S(i) -> B      all-gather            the group is the innermost axes splitting i
P -> B         all-reduce            always (Pmax / Pmin: pmax / pmin)
P -> S(j)      reduce-scatter        the group becomes the innermost axes splitting j
S(i) -> S(j)   all-to-all            both of the above
B -> S(j)      none (local slice)    the group becomes the innermost axes splitting j
B -> P         none (zero-fill)      always
S(i) -> P      none (zero-fill)      the group is the innermost axes splitting i
B -> Pmax/min  none (relabel)        always
=============  ====================  ============================================

Costs are bytes received per device (OneFlow's table) plus a fixed latency per collective, so
small tensors prefer fewer collectives and large ones fewer bytes. Uneven blocks are handled by
per-device index tables ("repacks") around each collective; even layouts skip them.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _sbp
from ._layout import Layout, balanced, layout_of, offsets

__all__ = [
    "Move",
    "move_cost",
    "plan",
    "make_local_boxer",
    "widening",
    "COLLECTIVE_LATENCY_BYTES",
]

COLLECTIVE_LATENCY_BYTES = 1 << 20
"""A collective's fixed cost, in byte-equivalents, added to the bytes it moves. 1 MiB: a
collective's start-up time is worth about that many bytes of bandwidth both on simulated CPU
devices (~0.2 ms each whatever the size, measured) and on NVLink GPUs (~10-20 us at ~100 GB/s),
so for model-sized tensors one collective fewer usually beats a few hundred KiB less moved."""

_LOCAL_COST = 1.0
_ZERO_FILL_COST = 4096.0


@dataclasses.dataclass(frozen=True)
class Move:
    """One step of a boxing plan: ``axes`` go from ``src`` to ``dst`` with ``collective``."""

    axes: tuple[int, ...]
    src: _sbp.Sbp
    dst: _sbp.Sbp
    collective: str | None  # "all-gather", "all-reduce", "reduce-scatter", "all-to-all" or None
    bytes_per_device: float

    def __str__(self):
        what = self.collective or "local"
        return f"axes {self.axes}: {self.src} -> {self.dst} ({what})"


def _innermost(splitters: tuple[int, ...], group: tuple[int, ...]) -> bool:
    return len(splitters) >= len(group) and splitters[len(splitters) - len(group) :] == group


def _moves_from(state, shape, hierarchy, itemsize):
    """All legal moves out of ``state`` as (next_state, Move)."""
    n = len(state)
    total_bytes = math.prod(shape) * itemsize

    def splitters(st, d):
        return tuple(a for a in range(n) if st[a].is_split and st[a].dim == d)

    def piece_bytes(st, exclude):
        # bytes of the block a device holds at the parent level of ``exclude``
        ways = math.prod(hierarchy[a] for a in range(n) if st[a].is_split and a not in exclude)
        return total_bytes / max(ways, 1)

    # group axes by the (src) sbp they have now, then by target
    by_src = {}
    for a in range(n):
        by_src.setdefault(state[a], []).append(a)
    targets = [_sbp.broadcast, _sbp.partial_sum, _sbp.partial_max, _sbp.partial_min] + [
        _sbp.Split(d) for d in range(len(shape))
    ]
    for src, axes in by_src.items():
        for r in range(1, len(axes) + 1):
            for group in itertools.combinations(axes, r):
                k = math.prod(hierarchy[a] for a in group)
                for dst in targets:
                    if dst == src:
                        continue
                    nxt = tuple(dst if a in group else state[a] for a in range(n))
                    if (
                        any(x.is_partial for x in nxt)
                        and len({x.reduce for x in nxt if x.is_partial}) > 1
                    ):
                        continue
                    coll, cost = None, None
                    pb = piece_bytes(state, group)
                    if src.is_split and dst.is_broadcast:
                        if _innermost(splitters(state, src.dim), group):
                            coll, cost = "all-gather", pb * (k - 1) / k
                    elif src.is_partial and dst.is_broadcast:
                        coll, cost = "all-reduce", 2 * pb * (k - 1) / k
                    elif src.is_partial and dst.is_split:
                        if src.reduce == "sum" and _innermost(splitters(nxt, dst.dim), group):
                            coll, cost = "reduce-scatter", pb * (k - 1) / k
                    elif src.is_split and dst.is_split:
                        if _innermost(splitters(state, src.dim), group) and _innermost(
                            splitters(nxt, dst.dim), group
                        ):
                            coll, cost = "all-to-all", pb * (k - 1) / k / k
                    elif src.is_broadcast and dst.is_split:
                        if _innermost(splitters(nxt, dst.dim), group):
                            cost = 0.0
                    elif src.is_broadcast and dst.is_partial:
                        cost = 0.0
                    elif src.is_split and dst.is_partial and dst.reduce == "sum":
                        if _innermost(splitters(state, src.dim), group):
                            cost = 0.0
                    if cost is None:
                        continue
                    yield nxt, Move(group, src, dst, coll, float(cost))


def move_cost(mv: Move) -> float:
    """The planner's cost of one move: bytes per device plus a fixed cost per kind."""
    if mv.collective:
        step = COLLECTIVE_LATENCY_BYTES
    elif mv.dst.is_partial and mv.dst.reduce == "sum":
        # a zero-fill (-> P) is free to run but only pays off when the destination is partial:
        # as a detour (zero-fill + all-reduce instead of an all-gather) it must lose the tie, and
        # an op should not turn a split or replicated operand into addends to save a slice
        step = _ZERO_FILL_COST
    else:
        step = _LOCAL_COST
    return mv.bytes_per_device + step


def plan(
    src: tuple,
    dst: tuple,
    shape: tuple[int, ...],
    hierarchy: tuple[int, ...],
    itemsize: int,
    widen: tuple[float, float, float] = (1.0, 1.0, 1.0),
):
    """The cheapest list of ``Move`` s from nd-sbp ``src`` to ``dst`` (normalised, same placement).

    The search first allows at most one collective per axis whose SBP changes (DESIGN: "an nd
    conversion needs at most one collective per axis whose SBP changes"); by bytes alone a longer
    chain can look cheaper (e.g. three all-to-alls for (S(0), S(1)) -> (S(1), S(0)), or a
    reduce-scatter on an unchanged P axis before an all-reduce). Only when no path fits that
    budget (an outer split moving under an inner one) is the collective count left free.

    A move's cost is linear in the tensor's size T (bytes x a fraction fixed by the layouts, plus
    a fixed cost), so the search runs once per (src, dst, rank, hierarchy) and keeps every path
    that is cheapest for some T (``_frontier``); a call only picks among those for its T.

    A tensor without elements has nothing to move: its moves are local (``run_plan`` makes the
    empty blocks of each layout). ``widen``: the dtype's ``widening``; each move's
    ``bytes_per_device`` is what it moves as ``run_plan`` runs it (the path is the same).
    Layouts are planned as the devices hold them (``on_devices``: nothing moves on an axis of
    one device).
    """
    src, dst = on_devices(src, hierarchy), on_devices(dst, hierarchy)
    if src == dst:
        return ()
    total = float(math.prod(shape) * itemsize)
    _, path = _best(src, dst, len(shape), hierarchy, total)
    if total == 0:
        return tuple(dataclasses.replace(m, collective=None, bytes_per_device=0.0) for m in path)
    return tuple(
        dataclasses.replace(m, bytes_per_device=m.bytes_per_device * total * f)
        for m, f in zip(path, _factors(src, path, widen)[0])
    )


def on_devices(nd: tuple, hierarchy: tuple[int, ...]) -> tuple:
    """``nd`` as the devices hold it: on an axis of one device a split (one piece: the whole
    dim) and a partial value (one addend: the value) are B. Boxing plans, prices and runs
    conversions between these, so a change on such an axis alone moves nothing."""
    if 1 not in hierarchy:
        return nd
    return tuple(_sbp.broadcast if n == 1 else x for x, n in zip(nd, hierarchy))


@functools.lru_cache(maxsize=256)  # (read for every value the planner prices)
def widening(dtype) -> tuple[float, float, float]:
    """How many times its own size a value of ``dtype`` moves where ``run_plan`` widens it:
    (between a conversion's first and last collective that sums, a 16-bit float's partial sums
    run in float32, ``sum_dtype``; in a conversion that zero-fills a float into a partial sum,
    every move carries the value's bits as integers of at least 32 bits, ``_to_bits``; a
    collective that reduces booleans carries them as int32, ``collective_dtype``)."""
    if dtype == jnp.bool_:
        return (1.0, 1.0, float(np.dtype(collective_dtype(dtype, True)).itemsize))
    if not _real_floating(dtype):
        return (1.0, 1.0, 1.0)
    size = np.dtype(dtype).itemsize
    wide = sum_dtype(dtype)
    return (1.0 if wide is None else np.dtype(wide).itemsize / size, max(size, 4) / size, 1.0)


def _factors(src: tuple, path, widen: tuple[float, float, float]) -> tuple[list[float], float]:
    """Per move of ``path`` (from ``src``), the factor ``widen`` puts on its bytes, as
    ``run_plan`` runs it; and the factor of the width its sums run at (``_addends_cost``
    charges a zero-fill for the reduction it makes necessary)."""
    window, bits, reducing = widen
    if reducing != 1.0:
        return [reducing if mv.collective and mv.src.is_partial else 1.0 for mv in path], reducing
    if bits != 1.0 and not any(x.is_partial for x in src):
        if any(mv.dst.is_partial and not mv.src.is_partial for mv in path):
            return [bits] * len(path), bits
    summing = [
        i
        for i, mv in enumerate(path)
        if mv.collective and mv.src.is_partial and mv.src.reduce == "sum"
    ]
    if window == 1.0 or not summing:
        return [1.0] * len(path), window
    return [window if summing[0] <= i <= summing[-1] else 1.0 for i in range(len(path))], window


def _best(src, dst, ndim, hierarchy, total):
    """(cost, moves) of the path ``_pick`` picks at ``total`` bytes."""
    paths = _frontier(src, dst, ndim, hierarchy)
    k = int(_pick(np.array([a * total + b for (a, b), _ in paths])))
    return paths[k][0][0] * total + paths[k][0][1], paths[k][1]


def _pick(costs: np.ndarray) -> np.ndarray:
    """The path a conversion runs, of paths costing ``costs`` (last axis): the first within 1e-9
    byte-equivalents of the cheapest (a tie goes to the path found first)."""
    return np.argmax(costs <= costs.min(axis=-1, keepdims=True) + 1e-9, axis=-1)


def conversion_cost(
    src: tuple,
    dst: tuple,
    shape: tuple[int, ...],
    hierarchy: tuple[int, ...],
    itemsize: int,
    latency_bytes: float,
    op_bytes: float,
    widen: tuple[float, float, float] = (1.0, 1.0, 1.0),
) -> float:
    """What the conversion ``plan`` runs costs in byte-equivalents per device: the bytes each move
    receives, ``latency_bytes`` per collective, ``op_bytes`` per move (the op it runs: a slice, a
    zero-fill, a combined collective member's copies in and out), a local move's fixed charge
    and addends charge (``move_cost``, ``_addends_cost``: a zero-fill S -> P is free by its bytes
    but makes addends a later collective must reduce; the bytes as ``plan`` counts them with the
    dtype's ``widen``). A tensor without elements costs nothing."""
    n = math.prod(shape)
    src, dst = on_devices(src, hierarchy), on_devices(dst, hierarchy)
    if src == dst or n == 0:
        return 0.0
    return _conversion_cost(
        src, dst, len(shape), float(n * itemsize), hierarchy, latency_bytes, op_bytes, widen
    )


@functools.lru_cache(maxsize=1 << 18)
def _conversion_cost(src, dst, ndim, total, hierarchy, latency_bytes, op_bytes, widen) -> float:
    """``conversion_cost`` of a tensor of rank ``ndim`` and ``total`` bytes (all it depends on)."""
    lines = conversion_lines(src, dst, ndim, hierarchy, latency_bytes, op_bytes, widen)
    return float(line_cost(lines, total))


def line_cost(lines: np.ndarray, total):
    """``conversion_cost`` from ``conversion_lines`` (``...`` x paths x 4) at ``total`` bytes (a
    number, or an array broadcasting against ``lines[..., 0, 0]``): the path ``_pick`` picks at
    that size, priced by its moves' charges."""
    total = np.asarray(total, dtype=float)[..., None]
    k = _pick(lines[..., 0] * total + lines[..., 1])[..., None]
    pick = lambda j: np.take_along_axis(lines[..., j], k, axis=-1)[..., 0]
    return pick(2) * total[..., 0] + pick(3)


@functools.lru_cache(maxsize=1 << 16)
def conversion_lines(
    src, dst, ndim, hierarchy, latency_bytes, op_bytes, widen=(1.0, 1.0, 1.0)
) -> np.ndarray:
    """``_frontier``'s paths as rows (bytes coefficient, fixed cost: what picks the path at a
    size; per byte, fixed: the path's charges for ``conversion_cost``, summed over its moves: the
    bytes each receives (with the dtype's ``widen``, as ``plan`` counts them) and its
    ``_addends_cost`` per byte, ``latency_bytes`` per collective or the move's fixed
    ``move_cost``, and ``op_bytes`` per move). Read-only. Computed once per pattern of the pair
    as the devices hold it (``on_devices``): its dims renumbered as ``_renumbered`` does, at the
    rank ``_rank_searched`` (pairs of any rank with one pattern share their rows)."""
    seen: dict = {}
    pattern = tuple(
        seen.setdefault(x.dim, len(seen)) if x.is_split else x
        for x in on_devices(src, hierarchy) + on_devices(dst, hierarchy)
    )
    rank = min(ndim, _rank_searched(len(seen), hierarchy))
    return _pattern_lines(pattern, rank, hierarchy, latency_bytes, op_bytes, widen)


@functools.lru_cache(maxsize=1 << 14)
def _pattern_lines(pattern, ndim, hierarchy, latency_bytes, op_bytes, widen) -> np.ndarray:
    """``conversion_lines`` of a pattern (B, P as themselves, a split as its dim)."""
    nd = tuple(_sbp.Split(x) if isinstance(x, int) else x for x in pattern)
    src, dst = nd[: len(hierarchy)], nd[len(hierarchy) :]
    if src == dst:
        out = np.zeros((1, 4))
    else:
        rows = []
        for (a, b), path in _frontier(src, dst, ndim, hierarchy):
            state, per_byte, fixed = list(src), 0.0, 0.0
            factors, sums = _factors(src, path, widen)
            for mv, f in zip(path, factors):
                per_byte += f * mv.bytes_per_device + sums * _addends_cost(
                    tuple(state), mv, hierarchy
                )
                fixed += op_bytes + (
                    latency_bytes if mv.collective else move_cost(mv) - mv.bytes_per_device
                )
                for ax in mv.axes:
                    state[ax] = mv.dst
            rows.append((a, b, per_byte, fixed))
        out = np.array(rows, dtype=float)
    out.flags.writeable = False
    return out


def _gathers_or_reduces(a, b) -> bool:
    """Whether one grid axis's ``a -> b`` is kept or is what an all-gather (S -> B), a
    reduce-scatter (P -> S) or an all-reduce (P -> B) does on it (a conversion that changes an axis
    otherwise is never one of them)."""
    return a == b or (b.is_broadcast and not a.is_broadcast) or (a.is_partial and b.is_split)


@functools.lru_cache(maxsize=1 << 16)
def combined_collective(
    src: tuple, dst: tuple, shape: tuple[int, ...], hierarchy: tuple[int, ...], itemsize: int
) -> tuple:
    """The combined collective the conversion joins when its value can wait (``_combine``): its
    (kind, axes) as a 1-tuple where ``plan`` is one all-gather, reduce-scatter or all-reduce of a
    sum between even layouts of a tensor with elements; else ()."""
    src, dst = on_devices(src, hierarchy), on_devices(dst, hierarchy)
    if src == dst or math.prod(shape) == 0 or not all(map(_gathers_or_reduces, src, dst)):
        return ()
    total = float(math.prod(shape) * itemsize)
    _, path = _best(src, dst, len(shape), hierarchy, total)
    if len(path) != 1 or path[0].collective not in ("all-gather", "reduce-scatter", "all-reduce"):
        return ()
    mv = path[0]
    if mv.collective == "all-reduce" and mv.src.reduce != "sum":
        return ()

    def even(nd):
        ways = [1] * len(shape)
        for a, x in enumerate(nd):
            if x.is_split:
                ways[x.dim] *= hierarchy[a]
        return all(n % w == 0 for n, w in zip(shape, ways))

    return ((mv.collective, tuple(mv.axes)),) if even(src) and even(dst) else ()


def _renumbered(src, dst, ndim):
    """``(src, dst, back)`` with the dims renumbered in the order ``src`` then ``dst`` first
    split them (the others after, in order), and ``back`` the old number of each new one; None
    where that order is already theirs. Boxing's costs and paths do not depend on the dims'
    numbers (every move is priced on a tensor's bytes), so a search is run once per renumbered
    pair and its paths renamed back."""
    order: list = []
    for x in src + dst:
        if x.is_split and x.dim not in order:
            order.append(x.dim)
    if order == list(range(len(order))):
        return None
    back = (*order, *(d for d in range(ndim) if d not in order))
    new = [0] * ndim
    for k, d in enumerate(back):
        new[d] = k
    return _renamed_nd(src, new), _renamed_nd(dst, new), back


def _rank_searched(splits: int, hierarchy) -> int:
    """The rank a renumbered pair splitting ``splits`` dims is searched at: those dims, then as
    many free dims as the placement has axes. A path passes through free dims (P -> S(free) ->
    B), but never holds more of them at once than there are axes, and free dims are alike: more
    add no path."""
    return splits + len(hierarchy)


def _renamed_nd(nd, new) -> tuple:
    return tuple(_sbp.Split(new[x.dim]) if x.is_split else x for x in nd)


def _renamed(mv: Move, back) -> Move:
    src, dst = _renamed_nd((mv.src, mv.dst), back)
    return dataclasses.replace(mv, src=src, dst=dst)


@functools.lru_cache(maxsize=1 << 16)
def _frontier(src, dst, ndim, hierarchy):
    """Every path from ``src`` to ``dst`` that is the cheapest for some tensor size, as
    ((bytes coefficient, fixed cost), moves with per-byte ``bytes_per_device``); searched on the
    ``_renumbered`` pair."""
    canon = _renumbered(src, dst, ndim)
    if canon is not None:
        found = _frontier(*canon[:2], ndim, hierarchy)
        return tuple((ab, tuple(_renamed(mv, canon[2]) for mv in path)) for ab, path in found)
    rank = _rank_searched(len({x.dim for x in src + dst if x.is_split}), hierarchy)
    if ndim > rank:
        return _frontier(src, dst, rank, hierarchy)
    paths = _within_budget(_reach(src, ndim, hierarchy), dst, src, dst)
    if not paths:  # an outer split moving under an inner one: more collectives than axes
        paths = _pareto(_search(src, dst, ndim, hierarchy))
    if not paths:  # every pair is connected via B
        raise AssertionError(f"no boxing path from {src} to {dst}")
    return tuple(paths)


def _within_budget(reach, state, src, dst):
    """The Pareto front of ``reach``'s labels at ``state`` using at most one collective per axis
    that differs between ``src`` and ``dst``."""
    budget = sum(1 for a, b in zip(src, dst) if a != b)
    return _pareto([lab for used in range(budget + 1) for lab in reach.get((state, used), ())])


def _pareto(found):
    """The (cost, path) pairs that no other beats (or ties) at every tensor size."""
    if len(found) <= 1:
        return list(found)
    out = []
    for (a, b), path in sorted(found, key=lambda x: (x[0][1], x[0][0], len(x[1]))):
        if not any(a2 <= a + 1e-12 and b2 <= b + 1e-9 for (a2, b2), _ in out):
            out.append(((a, b), path))
    return out


@functools.lru_cache(maxsize=1 << 12)
def _reach(src, ndim, hierarchy):
    """Single-source search from ``src`` with at most one collective per placement axis: for
    every (nd-sbp, collectives used), the non-dominated (cost, path) labels reaching it."""
    return _labels(src, ndim, hierarchy, len(hierarchy), None)


def _search(src, dst, ndim, hierarchy):
    """Any number of collectives: the labels reaching ``dst``."""
    labels = _labels(src, ndim, hierarchy, None, dst)
    return [x for key, labs in labels.items() if key[0] == dst for x in labs]


def _labels(src, ndim, hierarchy, max_collectives, stop):
    """Label-setting search over (nd-sbp, collectives used) with two-part costs (bytes coefficient
    a, fixed cost b): a path is kept unless another reaching the same state is no worse in both.
    With ``max_collectives=None`` the count is not tracked; ``stop`` is not expanded further."""
    start = (src, 0)
    labels: dict = {start: [(0.0, 0.0, 0, ())]}  # key -> [(a, b, label id, path)]
    alive = {0}  # ids of labels not dominated since they were pushed
    next_id = 1
    heap = [(0.0, 0.0, 0, start, ())]
    while heap:
        b, a, lid, key, path = heapq.heappop(heap)
        if lid not in alive:
            continue  # superseded by a label that dominates it
        state, used = key
        if state == stop:
            continue
        # a move into partial-max/min only ends a path: the only way on is back to B by an
        # all-reduce (a wasted round trip), and other axes' moves cost the same before as after
        # the entry, so a path that needs such a state can enter it last
        if path and _enters_partial_extremum(path[-1]):
            continue
        for nxt, mv, da, db, coll in _unit_steps(state, ndim, hierarchy):
            n_used = used + coll
            if max_collectives is not None and n_used > max_collectives:
                continue
            nkey = (nxt, n_used if max_collectives is not None else 0)
            la, lb = a + da, b + db
            have = labels.get(nkey)
            if have is None:
                have = labels[nkey] = []
            elif any(x[0] <= la + 1e-12 and x[1] <= lb + 1e-9 for x in have):
                continue
            else:
                keep = []
                for x in have:
                    if la <= x[0] + 1e-12 and lb <= x[1] + 1e-9:
                        alive.discard(x[2])
                    else:
                        keep.append(x)
                have[:] = keep
            npath = path + (mv,)
            have.append((la, lb, next_id, npath))
            alive.add(next_id)
            heapq.heappush(heap, (lb, la, next_id, nkey, npath))
            next_id += 1
    return {k: [((a, b), p) for a, b, _, p in v] for k, v in labels.items()}


def _enters_partial_extremum(mv: Move) -> bool:
    return mv.dst.is_partial and mv.dst.reduce != "sum"


@functools.lru_cache(maxsize=1 << 14)
def _unit_steps(state, ndim, hierarchy):
    """``_moves_from`` for a one-byte tensor of rank ``ndim`` (byte costs become coefficients),
    each move's cost split for the search: (next, move, bytes coefficient, fixed cost, 1 if it
    is a collective)."""
    return tuple(
        (
            nxt,
            mv,
            mv.bytes_per_device + _addends_cost(state, mv, hierarchy),
            move_cost(mv) - mv.bytes_per_device,
            1 if mv.collective else 0,
        )
        for nxt, mv in _moves_from(state, (1,) * ndim, hierarchy, 1)
    )


def _addends_cost(state, mv: Move, hierarchy) -> float:
    """The planner's charge, per byte of the tensor, for zero-filling a split value into partial
    sums (S -> P): the move is local, but it makes addends as large as the tensor that some later
    collective must reduce (at least a reduce-scatter back). Free by its bytes, it led the search
    to subtract a partial batch mean from a split activation by zero-filling the activation
    (BatchNorm under data parallelism), then to reduce or gather activation-sized values where
    one all-reduce of the mean would do."""
    if not (mv.src.is_split and mv.dst.is_partial):
        return 0.0
    k = math.prod(hierarchy[a] for a in mv.axes)
    ways = math.prod(
        hierarchy[a] for a in range(len(state)) if state[a].is_split and a not in mv.axes
    )
    return (k - 1) / k / ways


# -------------------------------------------------------------------------------------------
# Local (per-device) execution inside a full-manual shard_map.
# -------------------------------------------------------------------------------------------


def _device_index(plc):
    """Flattened (row-major) mesh index of this device, inside shard_map."""
    idx = 0
    for name, size in zip(plc.axis_names, plc.hierarchy):
        idx = idx * size + lax.axis_index(name)
    return idx


def _group_index(plc, group):
    idx = 0
    for a in group:
        idx = idx * plc.hierarchy[a] + lax.axis_index(plc.axis_names[a])
    return idx


def _group_index_np(coord, group, hierarchy):
    idx = 0
    for a in group:
        idx = idx * hierarchy[a] + coord[a]
    return idx


def _contiguous_starts(table: np.ndarray, length: int) -> np.ndarray | None:
    """Per-device start when every row of ``table`` is an ascending run ``s, s+1, ...`` inside
    ``length`` (then the gather is a slice); None otherwise (e.g. padded rows)."""
    starts = table[:, 0]
    if not (starts + table.shape[1] <= length).all():
        return None
    if not np.array_equal(table, starts[:, None] + np.arange(table.shape[1])):
        return None
    return starts


def _axis_strides(starts: np.ndarray, hierarchy) -> list[int] | None:
    """Per-axis strides when each device's start is ``starts[0]`` plus the sum over placement axes
    of its index on the axis times a stride (devices in row-major order); None otherwise."""
    coords = np.indices(tuple(hierarchy)).reshape(len(hierarchy), -1)
    strides = []
    for a, n in enumerate(hierarchy):
        unit = [0] * len(hierarchy)
        unit[a] = 1 if n > 1 else 0
        strides.append(int(starts[np.ravel_multi_index(unit, hierarchy)] - starts[0]))
    if not np.array_equal(starts, starts[0] + np.asarray(strides) @ coords):
        return None
    return strides


def _take(x, dim, table, mask, plc):
    """Per-device gather along ``dim`` with a (ndev, out_len) index table and optional 0/1 mask."""
    if table.shape[1] == 0 or x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = table.shape[1]
        return jnp.zeros(shape, x.dtype)
    uniform = bool((table == table[0]).all()) and (mask is None or bool((mask == mask[0]).all()))
    if uniform:
        row = table[0]
        if (
            mask is None
            and row.shape[0] == x.shape[dim]
            and np.array_equal(row, np.arange(row.shape[0]))
        ):
            return x
    if mask is None:
        starts = _contiguous_starts(table, x.shape[dim])
        if (
            starts is not None
        ):  # every device reads one run: a slice, not a gather (a copy, no index math)
            if uniform:
                return lax.slice_in_dim(
                    x, int(starts[0]), int(starts[0]) + table.shape[1], axis=dim
                )
            strides = _axis_strides(starts, plc.hierarchy)
            if strides is not None:  # even splits: start = sum of axis index x stride, no table
                start = int(starts[0])
                for name, stride in zip(plc.axis_names, strides):
                    if stride:
                        start = start + lax.axis_index(name) * stride
            else:
                start = jnp.asarray(starts, dtype=jnp.int32)[_device_index(plc)]
            return lax.dynamic_slice_in_dim(
                x, start, table.shape[1], axis=dim, allow_negative_indices=False
            )
    if uniform:
        idx = jnp.asarray(row, dtype=jnp.int32)
        m = None if mask is None else jnp.asarray(mask[0])
    else:
        dev = _device_index(plc)
        idx = jnp.asarray(table, dtype=jnp.int32)[dev]
        m = None if mask is None else jnp.asarray(mask)[dev]
    out = jnp.take(x, idx, axis=dim, mode="clip")
    if m is not None:  # (only S -> P embeds: the fill is an addend, see ``sum_identity``)
        shape = [1] * out.ndim
        shape[dim] = out.shape[dim]
        out = jnp.where(m.reshape(shape), out, jnp.asarray(sum_identity(out.dtype), out.dtype))
    return out


def _nested(m: int, ks: tuple[int, ...]) -> list[int]:
    """Sizes of the prod(ks) chunks of m when cut hierarchically by axes of sizes ks (outer first)."""
    sizes = [int(m)]
    for k in ks:
        sizes = [c for s in sizes for c in balanced(s, k)]
    return sizes


def _split_table(parent_valid, k, L_parent, L_child):
    """Parent block (valid m, padded L_parent) -> k padded chunks of L_child, per device."""
    rows = []
    for m in parent_valid:
        sizes = _nested(m, k)
        kk = len(sizes)
        offs = offsets(sizes)
        row = np.zeros(kk * L_child, dtype=np.int64)
        for c in range(kk):
            for r in range(min(sizes[c], L_child)):
                row[c * L_child + r] = offs[c] + r
        rows.append(row)
    return np.stack(rows)


def _merge_table(parent_valid, k, L_parent, L_child):
    """k padded chunks of L_child -> parent block (valid m, padded L_parent), per device."""
    rows = []
    for m in parent_valid:
        sizes = _nested(m, k)
        kk = len(sizes)
        offs = offsets(sizes)
        row = np.zeros(L_parent, dtype=np.int64)
        for c in range(kk):
            for r in range(sizes[c]):
                row[offs[c] + r] = c * L_child + r
        rows.append(row)
    return np.stack(rows)


def _chunk_table(parent_valid, chunk, k, L_child):
    """Select chunk ``chunk[dev]`` of the parent block, padded to L_child, per device."""
    rows = []
    for m, c in zip(parent_valid, chunk):
        sizes = _nested(m, k)
        off = offsets(sizes)[c]
        row = np.zeros(L_child, dtype=np.int64)
        row[: sizes[c]] = off + np.arange(sizes[c])
        rows.append(row)
    return np.stack(rows)


def _embed_table(parent_valid, chunk, k, L_parent):
    """Place this device's chunk (padded L_child block) into a zero parent block, per device."""
    rows, masks = [], []
    for m, c in zip(parent_valid, chunk):
        sizes = _nested(m, k)
        off = offsets(sizes)[c]
        row = np.zeros(L_parent, dtype=np.int64)
        mask = np.zeros(L_parent, dtype=bool)
        row[off : off + sizes[c]] = np.arange(sizes[c])
        mask[off : off + sizes[c]] = True
        rows.append(row)
        masks.append(mask)
    return np.stack(rows), np.stack(masks)


# The collectives below exchange pieces along a dim of size n (the group) and move whole blocks
# around it. ``lax``'s own forms on a minor dim (``axis=1``) make XLA:CPU transpose every element
# of the full local array into a column-major layout and back; a block move is one copy whose inner
# runs are contiguous (S(1) -> B and P -> S(1) about 2x faster on a 4096 x 4096 float32 tensor
# over 8 devices, S(0) -> S(1) the program of XLA's own reshard).


def collective_axes(plc, axes: tuple[int, ...]):
    """(axis name(s) for ``lax`` collectives, number of devices) of a group of placement axes."""
    names = tuple(plc.axis_names[a] for a in axes)
    return (names if len(names) > 1 else names[0]), math.prod(plc.hierarchy[a] for a in axes)


def gathered_to_dim(g, shape: tuple[int, ...], dim: int):
    """Blocks gathered on a new leading dim, ``(K, *shape)`` in source order, laid along ``dim``."""
    g = jnp.moveaxis(g, 0, dim)  # (..., K, shape[dim], ...)
    return g.reshape(shape[:dim] + (g.shape[dim] * shape[dim],) + shape[dim + 1 :])


def blocks_first(x, dim: int, n: int):
    """``x`` with dim ``dim`` cut into ``n`` blocks and the block index moved first: ``(n, ...)``
    with row ``i`` the block device ``i`` keeps after a reduce-scatter (``x.shape`` with
    ``x.shape[dim] // n`` at ``dim`` after it)."""
    s = x.shape
    return jnp.moveaxis(x.reshape(s[:dim] + (n, s[dim] // n) + s[dim + 1 :]), dim, 0)


def _all_gather_dim(x, axis_name, dim):
    """``lax.all_gather(x, axis_name, axis=dim, tiled=True)``, gathering on a new leading dim."""
    if dim == 0:
        return lax.all_gather(x, axis_name, axis=0, tiled=True)
    return gathered_to_dim(lax.all_gather(x, axis_name, axis=0, tiled=False), x.shape, dim)


def _reduce_scatter_dim(x, axis_name, dim, n):
    """``lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)`` over ``n`` devices."""
    if dim == 0:
        return lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    y = blocks_first(x, dim, n)
    return lax.psum_scatter(y, axis_name, scatter_dimension=0, tiled=True).reshape(y.shape[1:])


def _all_to_all_dims(x, axis_name, split, concat, n):
    """``lax.all_to_all(x, axis_name, split, concat, tiled=True)`` over ``n`` devices.

    The pieces are exchanged along a new dim of size ``n`` cut out of ``split`` (a free reshape),
    then that dim moves next to ``concat`` in one block copy: the program XLA emits for its own
    ``reshard``.
    """
    s = x.shape
    y = x.reshape(s[:split] + (n, s[split] // n) + s[split + 1 :])
    y = lax.all_to_all(y, axis_name, split, split, tiled=True)  # dim ``split``: the source device
    y = jnp.moveaxis(y, split, concat)  # orig dims before ``concat``, then (n, s[concat]), ...
    out = list(s)
    out[split] //= n
    out[concat] *= n
    return y.reshape(out)


def collective_dtype(dtype, partial: bool):
    """The dtype a collective carries ``dtype`` in (None: as it is). JAX's collectives widen or
    refuse ``bool``: it travels as ``uint8``, or as ``int32`` where it is summed (a partial sum of
    booleans is their logical or; 8 bits would wrap at 256 devices), and comes back as ``!= 0``."""
    if dtype != jnp.bool_:
        return None
    return jnp.int32 if partial else jnp.uint8


def sum_identity(dtype):
    """The addend that changes no sum: ``-0.0`` for floating and complex types (``-0.0 + x`` is
    ``x`` for every ``x``, ``-0.0`` included; ``+0.0`` would turn a ``-0.0`` into ``+0.0``), else 0.
    What an addend that holds nothing is filled with (``B -> P``, ``S -> P``, a ``P`` tensor's
    other addends), so that a value moved through a partial sum keeps every bit."""
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def sum_dtype(dtype):
    """The dtype partial sums of ``dtype`` are reduced in (None: ``dtype`` itself). 16-bit floats
    are summed in float32 and rounded once, as one device accumulates them: addends that cancel
    (60000 + 60000 - 60000 - 60000 in float16) sum to 0, not ``inf``, and no sum is off by the
    roundings of a pairwise tree."""
    if not jnp.issubdtype(dtype, jnp.floating):  # (PRNG key dtypes are no numpy dtypes)
        return None
    return jnp.float32 if np.dtype(dtype) in _HALF else None


def _extremum_all_reduce(x, axis_name, kind: str):
    """``pmax`` / ``pmin`` that propagate NaN as ``jnp.max`` / ``jnp.min`` do. XLA:CPU's max
    all-reduce drops NaN (a NaN on one device came back as the others' maximum), so floats travel
    as integer keys in IEEE total order (``-0.0 < 0.0``, as JAX's max / min of zeros answer), with
    NaN mapped to the largest key for a max and the smallest for a min: integer extrema are exact
    on every backend, and the key maps back to the float it came from."""
    red = lax.pmax if kind == "max" else lax.pmin
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return red(x, axis_name)
    itype = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[x.dtype.itemsize]
    info = jnp.iinfo(itype)

    def flip(i):  # an involution: negative floats' magnitude bits reversed, sign kept
        return i ^ ((i >> (info.bits - 1)) & info.max)

    key = flip(lax.bitcast_convert_type(x, itype))
    key = jnp.where(jnp.isnan(x), jnp.asarray(info.max if kind == "max" else info.min, itype), key)
    return lax.bitcast_convert_type(flip(red(key, axis_name)), x.dtype)


def _apply_move(x, mv: Move, before: Layout, after: Layout):
    """Run one move on a device's local block ``x`` (padded, partial dim already squeezed)."""
    if mv.collective and (wide := collective_dtype(x.dtype, mv.src.is_partial)) is not None:
        return _apply_move(x.astype(wide), mv, before, after) != 0
    plc = before.placement
    axis_name, _ = collective_axes(plc, mv.axes)
    k = tuple(plc.hierarchy[a] for a in mv.axes)  # nested chunking over the group, outer first
    src, dst = mv.src, mv.dst
    chunk = np.array([_group_index_np(c, mv.axes, plc.hierarchy) for c in before.coords])

    if src.is_split and dst.is_broadcast:
        i = src.dim
        x = _all_gather_dim(x, axis_name, i)
        if not before.is_even or not after.is_even:
            x = _take(
                x,
                i,
                _merge_table(after.valid_sizes(i), k, after.local_shape[i], before.local_shape[i]),
                None,
                plc,
            )
        return x
    if src.is_partial and dst.is_broadcast:
        if src.reduce == "sum":
            return lax.psum(x, axis_name)
        return _extremum_all_reduce(x, axis_name, src.reduce)
    if src.is_partial and dst.is_split:
        j = dst.dim
        if not before.is_even or not after.is_even:
            x = _take(
                x,
                j,
                _split_table(before.valid_sizes(j), k, before.local_shape[j], after.local_shape[j]),
                None,
                plc,
            )
        return _reduce_scatter_dim(x, axis_name, j, math.prod(k))
    if src.is_split and dst.is_split:
        i, j = src.dim, dst.dim
        uneven = not before.is_even or not after.is_even
        if uneven:
            x = _take(
                x,
                j,
                _split_table(before.valid_sizes(j), k, before.local_shape[j], after.local_shape[j]),
                None,
                plc,
            )
        x = _all_to_all_dims(x, axis_name, j, i, math.prod(k))
        if uneven:
            x = _take(
                x,
                i,
                _merge_table(after.valid_sizes(i), k, after.local_shape[i], before.local_shape[i]),
                None,
                plc,
            )
        return x
    if src.is_broadcast and dst.is_split:
        j = dst.dim
        return _take(
            x, j, _chunk_table(before.valid_sizes(j), chunk, k, after.local_shape[j]), None, plc
        )
    if src.is_broadcast and dst.is_partial:
        if dst.reduce != "sum":
            return x
        first = _group_index(plc, mv.axes) == 0
        return jnp.where(first, x, jnp.asarray(sum_identity(x.dtype), x.dtype))
    if src.is_split and dst.is_partial:
        i = src.dim
        table, mask = _embed_table(after.valid_sizes(i), chunk, k, after.local_shape[i])
        return _take(x, i, table, mask, plc)
    raise AssertionError(f"unplanned move {mv}")


def run_plan(x, moves, src_layout: Layout):
    """Apply ``moves`` (``plan``'s) to local block ``x`` (no partial dim). Returns (x,
    final_layout: as the devices hold it, ``on_devices``)."""
    lay = src_layout
    held = on_devices(lay.nd_sbp, lay.placement.hierarchy)
    if held != lay.nd_sbp:
        lay = layout_of(lay.placement, held, lay.shape)
    empty = math.prod(lay.shape) == 0  # every block is empty: nothing to communicate
    # 16-bit floats: float32 from the first collective that sums addends to the last (one
    # rounding, see ``sum_dtype``); the collectives carry the same count of values as before
    wide = None if empty else sum_dtype(x.dtype)
    # a plan that makes a partial sum itself (S -> P or B -> P zero-fills, then one all-reduce:
    # (S(0), S(1)) -> (B, B) on a 2-d placement) sums one value with zeros for every element: it
    # runs on the values' bits, which an integer sum of them and zeros keeps exactly (a float
    # all-reduce starts from +0.0: a -0.0 would come back +0.0)
    bits = None
    if (
        not empty
        and not lay.partial_axes
        and _real_floating(x.dtype)
        and any(mv.dst.is_partial and not mv.src.is_partial for mv in moves)
    ):
        bits, wide = x.dtype, None
        x = _to_bits(x)
    summing = [
        i
        for i, mv in enumerate(moves)
        if mv.collective and mv.src.is_partial and mv.src.reduce == "sum"
    ]
    narrow = x.dtype
    for i, mv in enumerate(moves):
        if wide is not None and summing and i == summing[0]:
            x = x.astype(wide)
        nd = tuple(mv.dst if a in mv.axes else s for a, s in enumerate(lay.nd_sbp))
        nxt = layout_of(lay.placement, nd, lay.shape)
        x = jnp.zeros(nxt.local_shape, x.dtype) if empty else _apply_move(x, mv, lay, nxt)
        if wide is not None and summing and i == summing[-1]:
            x = x.astype(narrow)
        lay = nxt
    if bits is not None:
        x = _from_bits(x, bits)
    return x, lay


def _real_floating(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating)) and np.dtype(dtype).itemsize in (1, 2, 4, 8)


UINTS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
"""The unsigned integer type of each item size (bytes): a value's bits."""


def _to_bits(x):
    """A float block as unsigned integers holding its bits (at least 32 wide: collectives of
    narrower integers are not on every backend)."""
    size = np.dtype(x.dtype).itemsize
    u = lax.bitcast_convert_type(x, UINTS[size])
    return u.astype(jnp.uint32) if size < 4 else u


def _from_bits(u, dtype):
    size = np.dtype(dtype).itemsize
    if size < 4:
        u = u.astype(UINTS[size])
    return lax.bitcast_convert_type(u, dtype)


def make_local_boxer(src: Layout, dst: Layout, dtype):
    """A function local_block -> local_block (physical blocks, partial dim included) for shard_map."""
    moves = plan(
        src.nd_sbp,
        dst.nd_sbp,
        src.shape,
        src.placement.hierarchy,
        np.dtype(dtype).itemsize,
        widening(dtype),
    )
    if math.prod(src.shape) == 0:  # nothing to move: every block is empty
        out_block = ((1,) if dst.partial_axes else ()) + dst.local_shape
        return (lambda x: jnp.zeros(out_block, x.dtype)), ()

    def body(x):
        if src.partial_axes:
            x = x[0]
        x, _ = run_plan(x, moves, src)
        if dst.partial_axes:
            x = x[None]
        return x

    return body, moves
