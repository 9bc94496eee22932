"""Combined collectives: many small all-reduces, reduce-scatters (or all-gathers) as one.

A data-parallel step ends in one all-reduce per parameter gradient (ZeRO-2/3: a reduce-scatter);
a model has dozens of parameters, so the step ends in dozens of small collectives. Each has a
fixed start-up cost (about 0.2 ms on simulated CPU devices whatever its size, tens of
microseconds on GPUs), and XLA does not combine them on every backend: XLA:CPU combines none of
the reduce-scatters and all-gathers, and puts all-reduces in one tuple all-reduce that still runs
one reduction per operand (20 small psums: 6.6 ms as XLA's tuple all-reduce, 3.8 ms as one
all-reduce of their concatenation, on 8 simulated devices). jsbp batches them like PyTorch DDP's gradient
buckets: boxings of the same kind, axes and dtype whose results nothing reads yet are deferred
and run as one collective over the concatenated blocks, when the first of their results is read
(or the bucket is full). A read runs the group it reads from and no other: the activation
all-reduces of a Megatron x data step, each read at once, no longer cut its gradients' group into
pieces (the zoo's decoder LM under dp2 x tp4: 28 compiled all-reduces -> 21, the ViT's 13 -> 9).

The grouping is decided on the ``Program`` (``combine_collectives``), so ``jsbp.explain`` shows
it and counts each combined collective once, as the compiled program has it; the emitter
(``Groups``) only follows it.

A boxing joins a group when it is a single even all-reduce (of a partial sum: partial extrema
travel as order keys), reduce-scatter or all-gather of a value with no other conversion to that
layout, on an op that only passes its operand on: a ``to_global`` annotation (how ``jsbp.flax``
pins gradient and parameter layouts), a ``transpose`` (a weight gradient, reduced before its
transpose), a ``reshape`` / ``squeeze`` (a bias gradient, reduced before it gets the
parameter's shape) or a reduction over size-1 dims only (a scale gradient's ``(1, 1, d)`` summed
back to ``(d,)``: it used to close the open group at every layer, the zoo's decoder LM under
dp2 x tp4 ran 21 compiled all-reduces, now 13). Those ops are replayed on the combined result.

**Early groups.** A conversion read by an op that needs its result at once (an optimizer's
``g * g`` reading a gradient's all-reduce: not a pass-on op, so nothing can wait) used to run
alone, one collective per gradient. Such conversions of one kind now run as one collective at
the first of them, taking in every later one whose value is already made there (a step's
gradients all exist before its first update reads one); a value made after that read starts a
new group. The emitter runs an early group at its first member's step (``Groups.early``) and
hands the later members their results. Without it, where the planner happened to put a
reduction decided how many collectives ran: the data-parallel GPT step planned without the
lookahead passes reduced its 22 gradients at the update's ``integer_pow``, 22 collectives.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from ._boxing import blocks_first, collective_axes, collective_dtype, gathered_to_dim

COMBINE_BUCKET_BYTES = 32 << 20
"""Most input bytes per device in one combined collective (DDP's buckets are 25 MiB)."""

_KINDS = ("reduce-scatter", "all-gather", "all-reduce")


_PASS_ON = frozenset({"transpose", "reshape", "squeeze"})
"""Primitives that only rearrange their operand's elements (a weight gradient reduced before its
transpose; a bias gradient reduced before the reshape that gives it the parameter's shape)."""


_SIZE_ONE_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or"})
"""Reductions that, over dims of size 1 only, drop those dims and change no element (a bias
gradient's ``(1, 1, d)`` summed back to ``(d,)``)."""


def passes_on(st) -> bool:
    """An op that only hands its single operand on (replayable on a deferred value)."""
    if len(st.eqn.invars) != 1 or st.kind not in ("annotate", "prim"):
        return False
    name = st.kind == "prim" and st.eqn.primitive.name
    if st.kind == "annotate" or name in _PASS_ON:
        return True
    if name in _SIZE_ONE_REDUCTIONS:
        shape = st.eqn.invars[0].aval.shape
        return all(shape[d] == 1 for d in st.eqn.params["axes"])
    return False


def _group_key(bx, v):
    if bx.reused or len(bx.moves) != 1 or isinstance(v, jcore.Literal):
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
    """Assign ``Boxing.group`` ids on the top-level steps of ``prog`` and list its early groups in
    ``prog.early`` (see the module doc). Idempotent: a second call makes the same groups."""
    for bx in (*(bx for st in prog.steps for bx in st.boxings), *prog.out_boxings):
        bx.group = None
    boxed_to = Counter()
    for st in prog.steps:
        for bx in st.boxings:
            v = st.eqn.invars[bx.operand]
            if not isinstance(v, jcore.Literal):
                boxed_to[(v, bx.dst.nd_sbp)] += 1
                if bx.via:  # reads the earlier conversion to ``src``: that one must run in place
                    boxed_to[(v, bx.src.nd_sbp)] += 1
        if st.sub is not None:  # a nested program may box the same value (and reuse the boxing)
            for v in st.eqn.invars:
                if not isinstance(v, jcore.Literal):
                    boxed_to[(v, None)] += 1
    deferred: dict = {}  # value whose boxing waits in an open group -> the group's id
    ever_deferred: set = set()  # values that stood for a deferred boxing's result at some point
    open_groups: dict = {}  # key -> (group id, members, bytes)
    groups: list[list] = []

    def close(gids):  # the groups whose results a step reads: they run there
        for key in [key for key, hit in open_groups.items() if hit[0] in gids]:
            del open_groups[key]
        for v in [v for v, g in deferred.items() if g in gids]:
            del deferred[v]

    def join(key, bx):  # into the open group of ``key``, or a new one when it is full
        size = math.prod(bx.src.local_shape) * key[-1].itemsize
        hit = open_groups.get(key)
        if hit is None or hit[2] + size > COMBINE_BUCKET_BYTES:
            groups.append([])
            hit = (len(groups) - 1, groups[-1], 0)
        gid, members, nbytes = hit
        members.append(bx)
        open_groups[key] = (gid, members, nbytes + size)
        return gid

    for st in prog.steps:
        if passes_on(st):
            (v,) = st.eqn.invars
            if len(st.boxings) == 1 and not isinstance(v, jcore.Literal) and v not in deferred:
                (bx,) = st.boxings
                alone = boxed_to[(v, bx.dst.nd_sbp)] == 1 and not boxed_to[(v, None)]
                key = _group_key(bx, v) if alone else None
                if key is not None:
                    gid = join(key, bx)
                    deferred.update(dict.fromkeys(st.eqn.outvars, gid))
                    ever_deferred.update(st.eqn.outvars)
                    continue
            elif not st.boxings and not isinstance(v, jcore.Literal) and v in deferred:
                deferred.update(dict.fromkeys(st.eqn.outvars, deferred[v]))
                ever_deferred.update(st.eqn.outvars)
                continue
        read = {deferred[v] for v in st.eqn.invars if not isinstance(v, jcore.Literal) and v in deferred}
        if read:
            close(read)
    early = _early_groups(prog, boxed_to, ever_deferred, groups)
    # the outputs' conversions run after everything else (ZeRO-1/2's updated parameters gathered
    # back to B): nothing reads them in between, so each kind is one group per bucket
    seen: set = set()  # an output boxed twice (a repeated output var) runs where it is
    for bx in prog.out_boxings:
        if bx.reused:
            continue  # (runs as the conversion it repeats does)
        key = _group_key(bx, prog.jaxpr.outvars[bx.operand])
        if key is not None and bx.operand not in seen:
            join(("out",) + key, bx)
        seen.add(bx.operand)
    gid = 0
    prog.early = {}
    for n, members in enumerate(groups):
        if len(members) < 2:
            continue  # nothing to combine: runs where it is
        for bx in members:
            bx.group = gid
        if n in early:
            prog.early[gid] = early[n]
        gid += 1


def _early_groups(prog, boxed_to, ever_deferred, groups) -> dict:
    """Early groups (see the module doc), appended to ``groups``: index in ``groups`` -> the
    members' (boxing, root, pass-on steps), in program order: the value a member converts is its
    root passed through those steps (a weight gradient's transpose, replayed when the group runs
    if it comes later), and the root is made before the group's first member."""
    made_at = {v: i for i, st in enumerate(prog.steps) for v in st.eqn.outvars}

    def root_of(v):
        chain = []
        while (i := made_at.get(v)) is not None:
            st = prog.steps[i]
            if st.boxings or not passes_on(st) or isinstance(st.eqn.invars[0], jcore.Literal):
                break
            chain.append(st)
            v = st.eqn.invars[0]
        return v, tuple(reversed(chain))

    open_groups: dict = {}  # key -> (index in ``groups``, first member's step, bytes)
    early: dict = {}
    for i, st in enumerate(prog.steps):
        if st.kind != "prim" or passes_on(st) or len(st.boxings) != 1:
            continue
        (bx,) = st.boxings
        v = st.eqn.invars[bx.operand]
        if bx.via or isinstance(v, jcore.Literal) or v in ever_deferred:
            continue
        if boxed_to[(v, None)]:
            continue  # a nested program may convert the value too
        # (later readers of the value in that layout reuse this conversion: ``bx.reused`` there)
        key = _group_key(bx, v)
        if key is None:
            continue
        size = math.prod(bx.src.local_shape) * key[-1].itemsize
        root, chain = root_of(v)
        if root in ever_deferred:
            continue
        hit = open_groups.get(key)
        if hit is None or made_at.get(root, -1) >= hit[1] or hit[2] + size > COMBINE_BUCKET_BYTES:
            groups.append([])
            early[len(groups) - 1] = []
            hit = (len(groups) - 1, i, 0)
        n, first, nbytes = hit
        groups[n].append(bx)
        early[n].append((bx, root, chain))
        open_groups[key] = (n, first, nbytes + size)
    return early


def is_deferred(x) -> bool:
    return isinstance(x, _Deferred)


class _Deferred:
    """A value whose boxing waits in group ``group`` (member ``index``); ``post``: the
    pass-through ops to replay on the result."""

    __slots__ = ("group", "index", "post")

    def __init__(self, group: int, index: int, post: tuple = ()):
        self.group, self.index, self.post = group, index, post

    def then(self, fn) -> _Deferred:
        return _Deferred(self.group, self.index, self.post + (fn,))


class Groups:
    """The emitter's side: collects each group's operands and runs the group on first use."""

    def __init__(self, placement):
        self.placement = placement
        self.members: dict[int, list] = {}
        self.results: dict[int, list] = {}

    def defer(self, bx, x) -> _Deferred:
        if bx.group in self.results:
            raise AssertionError(f"combined collective {bx.group} already ran")  # planning bug
        members = self.members.setdefault(bx.group, [])
        members.append((bx, x))
        return _Deferred(bx.group, len(members) - 1)

    def early(self, bx, members: list, values):
        """``bx``'s result in its early group (``Program.early``: ``members``, in the group's
        order), which runs at the first call on the members' ``values()``."""
        if bx.group not in self.results:
            self.results[bx.group] = self._run([(m[0], x) for m, x in zip(members, values())])
        return self.results[bx.group][next(i for i, m in enumerate(members) if m[0] is bx)]

    def resolve(self, x):
        if not isinstance(x, _Deferred):
            return x
        if x.group not in self.results:
            self.results[x.group] = self._run(self.members.pop(x.group))
        y = self.results[x.group][x.index]
        for fn in x.post:
            y = fn(y)
        return y

    def _run(self, members: list) -> list:
        mv = members[0][0].moves[0]
        axis, n = collective_axes(self.placement, mv.axes)
        wide = collective_dtype(members[0][1].dtype, mv.src.is_partial)  # one dtype per group
        if wide is not None:
            members = [(bx, x.astype(wide)) for bx, x in members]
        if mv.collective == "all-reduce":
            outs = _all_reduce_many([x for _, x in members], axis)
        elif mv.collective == "reduce-scatter":
            outs = _reduce_scatter_many([(x, bx.dst.nd_sbp[mv.axes[0]].dim) for bx, x in members], axis, n)
        else:
            outs = _all_gather_many([(x, bx.src.nd_sbp[mv.axes[0]].dim) for bx, x in members], axis, n)
        return outs if wide is None else [y != 0 for y in outs]


def _all_reduce_many(xs: list, axis) -> list:
    """``psum(x, axis)`` for every x, as one."""
    red = lax.psum(jnp.concatenate([x.reshape(-1) for x in xs]), axis)
    outs, start = [], 0
    for x in xs:
        outs.append(red[start:start + x.size].reshape(x.shape))
        start += x.size
    return outs


def _reduce_scatter_many(items: list[tuple[Any, int]], axis, n: int) -> list:
    """``psum_scatter(x, axis, scatter_dimension=d, tiled=True)`` for every (x, d), as one."""
    rows, blocks = [], []
    for x, d in items:
        y = blocks_first(x, d, n)  # row i: what device i keeps
        blocks.append(y.shape[1:])
        rows.append(y.reshape(n, -1))
    red = lax.psum_scatter(jnp.concatenate(rows, axis=1), axis, scatter_dimension=0, tiled=True)
    outs, start = [], 0
    for block in blocks:
        size = math.prod(block)
        outs.append(red[0, start:start + size].reshape(block))
        start += size
    return outs


def _all_gather_many(items: list[tuple[Any, int]], axis, n: int) -> list:
    """``all_gather(x, axis, axis=d, tiled=True)`` for every (x, d), as one."""
    flat = jnp.concatenate([x.reshape(1, -1) for x, _ in items], axis=1)
    got = lax.all_gather(flat, axis, axis=0, tiled=True)  # (n, total): row i from device i
    outs, start = [], 0
    for x, d in items:
        outs.append(gathered_to_dim(got[:, start:start + x.size].reshape((n,) + x.shape), x.shape, d))
        start += x.size
    return outs
