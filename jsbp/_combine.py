"""Combined collectives: many small all-reduces, reduce-scatters (or all-gathers) as one.

A data-parallel step ends in one all-reduce per parameter gradient (ZeRO-2/3: a reduce-scatter);
a model has dozens of parameters, so the step ends in dozens of small collectives. Each has a
fixed start-up cost (about 0.2 ms on simulated CPU devices whatever its size, tens of
microseconds on GPUs), and XLA does not combine them on every backend: XLA:CPU combines none of
the reduce-scatters and all-gathers, and puts all-reduces in one tuple all-reduce that still runs
one reduction per operand (20 small psums: 6.6 ms as XLA's tuple all-reduce, 3.8 ms as one
all-reduce of their concatenation, on 8 simulated devices). jsbp batches them like PyTorch DDP's gradient
buckets: boxings of the same kind, axes and dtype are deferred and run as one collective over the
concatenated blocks when the first of their results is *needed* (or the bucket is full).

**When a group runs.** XLA orders the compiled program by its data, so nothing obliges a
collective to run where its first member stands. A group takes every conversion of its kind made
before one of its results is *needed*: a result read by an op that can wait (``lazy_ok``: any op
or annotation, a call whose program runs no collective; not a loop, a branch or an op with
effects), or sliced locally for one, only makes that op wait too; it is needed where a collective
that is not a member converts it (or what was made from it), where a step that cannot wait reads it, and at the program's end. The
outputs' own conversions (a loss left partial until ``out_sbp`` reduces it, ZeRO-1/2's updated
parameters gathered back) join the open groups too. So an optimizer's ``g * g`` reading an
all-reduced gradient waits with it, and the gradients' all-reduces run as one collective whether
each is reduced at its ``to_global`` annotation, its transpose or its update; and the activation
all-reduces of a Megatron x data step, each needed at once, do not cut its gradients' group.
A step that cannot wait (a loop) takes its own operands' conversions into the open groups, which
close there: the weights a loop reads whole are gathered by one collective before it.

``combine_collectives`` decides the groups on the ``Program`` and the order its steps and groups
run in (``Program.order``, a topological order of their data), so ``jsbp.explain`` shows them and
counts each combined collective once, as the compiled program has it; the emitter
(``_emit.run_program``) runs that order and nothing else. A boxing joins a group when it
is a single even all-reduce (of a partial sum: partial extrema travel as order keys),
reduce-scatter or all-gather of a value no inlined call reads and no later conversion starts
from (``via``). The planner prices the same groups (``deferrable`` marks their values).
"""

from __future__ import annotations

import heapq
import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ._boxing import (
    UINTS,
    blocks_first,
    collective_axes,
    collective_dtype,
    gathered_to_dim,
    sum_dtype,
)
from ._program import iter_steps

COMBINE_BUCKET_BYTES = 32 << 20
"""Most input bytes per device in one combined collective (DDP's buckets are 25 MiB)."""

_KINDS = ("reduce-scatter", "all-gather", "all-reduce")

CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})


def deferrable(nodes, values) -> None:
    """Mark the values of a planning problem (``_problem.build``) whose conversions run as one
    combined collective (``combine_collectives``), and which one (``Value.batch``). Only values
    outside loops (``times`` one) read by no node inside a call's program (groups take the
    top-level conversions only) qualify, each by the first thing that waits for it:

    * nothing: no contraction (``CONTRACTIONS``), loop or branch can be reached from it (a weight
      gradient on its way through the optimizer to the outputs; a loss). Their collectives of one
      kind are one group, the program's last: ``batch`` () (a plan's conversion that reads
      another's result joins a later one: ("after", k), set by ``_solve.solve``).
    * one top-level loop or branch, which reads it as an input: its conversions of one kind run
      together right before it: ``batch`` (that loop's entry node,).
    * made by a reduction or a contraction (a partial sum's makers), the contractions, loops and
      branches first reached from it (its *front*). Values of one front and one reduction depth
      (``_depths``: BatchNorm's mean and mean of squares, not a layer norm's mean and the
      variance made from it) are made before any of them is needed: ``batch`` (front, depth).

    ``Problem.cost`` charges one latency per group, not per conversion."""
    stops = [
        n.kind == "hold" or (n.eqn is not None and n.eqn.primitive.name in CONTRACTIONS)
        for n in nodes
    ]
    fronts = [frozenset()] * len(nodes)  # the contractions, loops and branches first reached from u

    def front(val) -> frozenset:
        return frozenset().union(*({w} if stops[w] else fronts[w] for w, _ in val.uses))

    for u in range(len(nodes) - 1, -1, -1):
        fronts[u] = frozenset().union(*(front(val) for val in nodes[u].outputs if val is not None))
    depths, reduces = _depths(nodes)
    for val in values:
        if val.times != 1.0 or not (val.uses or val.wants):
            continue
        if any(nodes[w].nested for w, _ in val.uses):
            continue
        first = front(val)
        loops = {nodes[w].entry if i == 0 else None for w, i in val.uses}
        if not first:
            val.deferrable = True
        elif len(loops) == 1 and None not in loops and not val.wants:
            val.deferrable, val.batch = True, (loops.pop(),)
        elif val.producer is not None and not val.wants and reduces[val.producer[0]]:
            val.deferrable, val.batch = True, (first, depths[val.producer[0]])


def _depths(nodes) -> tuple[list[int], list[bool]]:
    """Per node, the most reductions (``reduce_*``, ``argmax``, ``argmin``) on a path of the
    program to it (itself included: a value reduced from another reduction's result is deeper),
    and whether it is a reduction or a contraction (what makes a partial sum)."""
    made = {}  # value id -> depth of its producer
    depths, reduces = [], []
    for n in nodes:
        d = max((made.get(id(v), 0) for v in n.operands if v is not None), default=0)
        name = n.eqn.primitive.name if n.eqn is not None else ""
        r = name.startswith("reduce_") or name in ("argmax", "argmin")
        depths.append(d + r)
        reduces.append(r or name in CONTRACTIONS)
        for v in n.outputs:
            if v is not None:
                made[id(v)] = d + r
    return depths, reduces


def lazy_ok(st) -> bool:
    """Whether the emitter may run ``st`` later than its place in the program (when a value it
    makes is needed): an op, an annotation, or a call whose program runs no collective, without
    effects. The others (loops, branches, calls that communicate) need their operands there."""
    if st.eqn.effects:
        return False
    if st.kind in ("prim", "annotate"):
        return True
    if st.kind != "call" or not all(_local(bx) for bx in st.sub.out_boxings):
        return False
    return all(
        all(_local(bx) for bx in s.boxings) and s.kind in ("prim", "annotate", "call")
        for _, s in iter_steps(st.sub)
    )


def _local(bx) -> bool:
    """Whether boxing ``bx`` runs no collective (a slice or zero-fill: it runs with its step)."""
    return bx.reused or all(m.collective is None for m in bx.moves)


def _group_key(bx, v):
    if bx.reused or bx.via or len(bx.moves) != 1 or isinstance(v, jcore.Literal):
        return None
    mv = bx.moves[0]
    if mv.collective not in _KINDS or not (bx.src.is_even and bx.dst.is_even):
        return None
    if math.prod(bx.src.shape) == 0:
        return None
    if mv.collective == "all-reduce" and mv.src.reduce != "sum":
        return None  # pmax / pmin travel as order keys (``_extremum_all_reduce``): left alone
    return (mv.collective, mv.axes, np.dtype(v.aval.dtype))


def combine_collectives(prog) -> None:
    """Assign ``Boxing.group`` ids on the top-level steps of ``prog`` (see the module doc).
    Idempotent: a second call makes the same groups.

    A member's result, and whatever ``lazy_ok``
    steps make from it, is *pending*; a pending value read where it is needed (converted by a
    boxing that is not a member, read by a step that must run in place) closes the open groups it
    waits for, so no group takes a member after one of its results was needed. The outputs'
    conversions come last and join the open groups alike."""
    for bx in (*(bx for st in prog.steps for bx in st.boxings), *prog.out_boxings):
        bx.group = None
    via_read, nested_read = set(), set()
    for st in prog.steps:
        for bx in st.boxings:
            v = st.eqn.invars[bx.operand]
            if bx.via and not isinstance(v, jcore.Literal):
                via_read.add((v, bx.src.nd_sbp))  # read in place by a later conversion
        if st.kind == "call":  # its program may convert the value too (and reuse it)
            nested_read.update(v for v in st.eqn.invars if not isinstance(v, jcore.Literal))
    open_groups: dict = {}  # key -> (group index, members, bytes)
    open_ids: set = set()
    waits: dict = {}  # pending value -> the open groups it waits for
    made_by: dict = {}  # (value, layout) converted by a member -> its group
    groups: list[list] = []

    def close(gids):
        gids = gids & open_ids
        if gids:
            open_ids.difference_update(gids)
            for key in [key for key, hit in open_groups.items() if hit[0] in gids]:
                del open_groups[key]

    def join(key, bx):  # into the open group of ``key``, or a new one when it is full
        size = math.prod(bx.src.local_shape) * key[-1].itemsize
        hit = open_groups.get(key)
        if hit is None or hit[2] + size > COMBINE_BUCKET_BYTES:
            if hit is not None:
                open_ids.discard(hit[0])
            groups.append([])
            hit = (len(groups) - 1, groups[-1], 0)
            open_ids.add(hit[0])
        gid, members, nbytes = hit
        members.append(bx)
        open_groups[key] = (gid, members, nbytes + size)
        return gid

    def waits_of(v):
        return set() if isinstance(v, jcore.Literal) else waits.get(v, set()) & open_ids

    for st in prog.steps:
        ok = lazy_ok(st)
        pending = [waits_of(v) for v in st.eqn.invars]
        for bx in st.boxings:
            v = st.eqn.invars[bx.operand]
            if isinstance(v, jcore.Literal):
                continue
            gid = made_by.get((v, bx.dst.nd_sbp))
            if gid is not None:  # the member's result again (the conversion cache)
                pending[bx.operand] = {gid} & open_ids
                continue
            if ok and _local(bx):  # a slice runs with its step, which waits
                continue
            close(pending[bx.operand])  # converted here: its groups run first
            key = (
                _group_key(bx, v)
                if v not in nested_read and (v, bx.dst.nd_sbp) not in via_read
                else None
            )
            if key is None:
                pending[bx.operand] = set()
                continue
            gid = join(key, bx)
            made_by[(v, bx.dst.nd_sbp)] = gid
            pending[bx.operand] = {gid}
        after = set().union(*pending) if pending else set()
        if ok and after:
            for v in st.eqn.outvars:
                waits[v] = after
        else:
            close(after)
    # the outputs' conversions (ZeRO-1/2's updated parameters gathered back to B, a loss reduced
    # at the end): nothing reads them, so each joins the open group of its kind (a loss's
    # all-reduce with the gradients') once the groups its value waits for are closed (one per
    # output; a repeated output's is ``reused``: ``_group_key``)
    for bx in prog.out_boxings:
        v = prog.jaxpr.outvars[bx.operand]
        key = _group_key(bx, v)
        if key is not None:
            close(waits_of(v))
            join(key, bx)
    gid = 0
    for members in groups:
        if len(members) < 2:
            continue  # nothing to combine: runs where it is
        for bx in members:
            bx.group = gid
        gid += 1
    prog.order = _schedule(prog)


def _schedule(prog) -> list[tuple[str, int]]:
    """The order the emitter runs ``prog``'s top-level steps and combined collectives in:
    ``("step", k)`` and ``("group", g)`` items, a topological order of their data dependencies.

    A step waits for the steps that make its operands and for the groups whose results it reads
    (as a member conversion or by reusing one); a group waits for the steps that make its members'
    operands; steps with effects keep their program order. Among what is ready, the lowest key
    goes first: a step's index, a group's first reader's, so the program keeps its order except
    where a step must wait for a group whose last member is made further on."""
    steps = prog.steps
    producer: dict = {}
    for k, st in enumerate(steps):
        for v in st.eqn.outvars:
            if not isinstance(v, jcore.DropVar):
                producer[v] = k
    members = group_members(prog)
    if not members:
        return [("step", k) for k in range(len(steps))]
    made_by = {(v, bx.dst.nd_sbp): g for g, ms in members.items() for bx, v in ms}
    deps: dict = {}
    first_reader = {g: len(steps) for g in members}
    last_effect = None
    for k, st in enumerate(steps):
        d = {
            ("step", producer[v])
            for v in st.eqn.invars
            if not isinstance(v, jcore.Literal) and v in producer
        }
        for bx in st.boxings:
            v = st.eqn.invars[bx.operand]
            if isinstance(v, jcore.Literal):
                continue
            g = bx.group if bx.group is not None else made_by.get((v, bx.dst.nd_sbp))
            if g is not None:
                d.add(("group", g))
                first_reader[g] = min(first_reader[g], k)
        if st.eqn.effects:
            if last_effect is not None:
                d.add(("step", last_effect))
            last_effect = k
        deps[("step", k)] = d
    for g, ms in members.items():
        deps[("group", g)] = {
            ("step", producer[v])
            for _, v in ms
            if not isinstance(v, jcore.Literal) and v in producer
        }
    users: dict = {}
    for node, d in deps.items():
        for u in d:
            users.setdefault(u, []).append(node)
    waiting = {node: len(d) for node, d in deps.items()}

    def key(node):
        return (node[1] if node[0] == "step" else first_reader[node[1]], node[0] == "step")

    ready = [(key(n), n) for n, c in waiting.items() if c == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for u in users.get(node, ()):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key(u), u))
    if len(order) != len(deps):
        raise AssertionError("combined collectives wait on each other")  # a planning bug
    return order


def group_members(prog) -> dict:
    """Per combined collective of ``prog``, its members in program order: (boxing, the variable
    it converts)."""
    out: dict = {}
    for bx, v in (
        *((bx, st.eqn.invars[bx.operand]) for st in prog.steps for bx in st.boxings),
        *((bx, prog.jaxpr.outvars[bx.operand]) for bx in prog.out_boxings),
    ):
        if bx.group is not None:
            out.setdefault(bx.group, []).append((bx, v))
    return out


def run_group(placement, members: list) -> list:
    """One combined collective: ``members`` is a list of (boxing, local value); the converted
    values, in order. Sums of 16-bit floats run in float32 and are rounded once."""
    mv = members[0][0].moves[0]
    axis, n = collective_axes(placement, mv.axes)
    wide = collective_dtype(members[0][1].dtype, mv.src.is_partial)  # one dtype per group
    if wide is not None:
        members = [(bx, x.astype(wide)) for bx, x in members]
    narrow = members[0][1].dtype
    half = sum_dtype(narrow) if mv.collective != "all-gather" else None  # 16-bit sums in float32
    if half is not None:
        members = [(bx, x.astype(half)) for bx, x in members]
    if mv.collective == "all-reduce":
        outs = _all_reduce_many([x for _, x in members], axis)
    elif mv.collective == "reduce-scatter":
        outs = _reduce_scatter_many(
            [(x, bx.dst.nd_sbp[mv.axes[0]].dim) for bx, x in members], axis, n
        )
    else:
        outs = _all_gather_many([(x, bx.src.nd_sbp[mv.axes[0]].dim) for bx, x in members], axis, n)
    if half is not None:
        return [y.astype(narrow) for y in outs]
    return outs if wide is None else [y != 0 for y in outs]


def _pieces(flat, sizes: list[int], axis: int = 0) -> list:
    """``flat`` cut along ``axis`` into consecutive pieces of ``sizes`` elements. The pieces of
    one shape are cut by one kernel (a variadic reduce of each with a zero pad, on the bits: exact)
    rather than by the code that reads each: XLA compiles one kernel per distinct fusion, and a
    slice at its own offset inside every reader (an optimizer's update of each gradient) would
    make each reader distinct (``docs/benchmarks.md``, first call). A piece along axis 1 (an
    all-gather's: one strided block per device) is cut even alone: read in place it slows its
    readers (XLA:CPU indexes it element by element inside an elementwise op, and a dot reading
    it leaves its fast path). The cut is a copy of those pieces."""
    starts = np.cumsum([0, *sizes]).tolist()
    pieces = [lax.slice_in_dim(flat, a, a + n, axis=axis) for a, n in zip(starts, sizes)]
    dt = np.dtype(flat.dtype)
    if dt == np.bool_:
        bits = bool
    elif jnp.issubdtype(dt, jnp.complexfloating):
        return pieces
    elif (jnp.finfo if jnp.issubdtype(dt, jnp.floating) else jnp.iinfo)(dt).bits != 8 * dt.itemsize:
        return pieces  # (a 4-bit type)
    else:
        bits = UINTS[dt.itemsize]
    classes: dict = {}
    for k, p in enumerate(pieces):
        classes.setdefault(p.shape, []).append(k)
    for ks in (ks for ks in classes.values() if len(ks) > 1 or axis != 0):
        ops = [lax.bitcast_convert_type(pieces[k], bits) for k in ks]
        zero = jnp.zeros((), bits)
        ops = [jnp.stack([x, jnp.broadcast_to(zero, x.shape)]) for x in ops]
        cut = lax.reduce(ops, [zero] * len(ks), lambda a, b: [x | y for x, y in zip(a, b)], (0,))
        for k, y in zip(ks, cut):
            pieces[k] = lax.bitcast_convert_type(y, dt)
    return pieces


def _all_reduce_many(xs: list, axis) -> list:
    """``psum(x, axis)`` for every x, as one."""
    red = lax.psum(jnp.concatenate([x.reshape(-1) for x in xs]), axis)
    return [y.reshape(x.shape) for x, y in zip(xs, _pieces(red, [x.size for x in xs]))]


def _reduce_scatter_many(items: list[tuple[Any, int]], axis, n: int) -> list:
    """``psum_scatter(x, axis, scatter_dimension=d, tiled=True)`` for every (x, d), as one."""
    rows, blocks = [], []
    for x, d in items:
        y = blocks_first(x, d, n)  # row i: what device i keeps
        blocks.append(y.shape[1:])
        rows.append(y.reshape(n, -1))
    red = lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0, tiled=True)
    pieces = _pieces(red[0], [math.prod(block) for block in blocks])
    return [y.reshape(block) for y, block in zip(pieces, blocks)]


def _all_gather_many(items: list[tuple[Any, int]], axis, n: int) -> list:
    """``all_gather(x, axis, axis=d, tiled=True)`` for every (x, d), as one."""
    flat = jnp.concatenate([x.reshape(1, -1) for x, _ in items], axis=1)
    got = lax.all_gather(flat, axis, axis=0, tiled=True)  # (n, total): row i from device i
    pieces = _pieces(got, [x.size for x, _ in items], axis=1)
    return [
        gathered_to_dim(y.reshape((n,) + x.shape), x.shape, d) for y, (x, d) in zip(pieces, items)
    ]
