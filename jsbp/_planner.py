"""The global planner (``JSBP_PLANNER=global``): every signature of a program chosen at once.

``_compiler._search`` (the default) chooses signatures one equation at a time and then corrects
itself with lookahead passes. This module states the choice as one optimisation over the whole
inlined program (see ``docs/planner.md``) and solves it:

* **variables**: one binary ``x[u, s]`` per node ``u`` and candidate ``s``; exactly one per node.
  A node is an equation of the program or of an inlined call (its candidates: the rule's legal
  nd signatures, ``_Inference.candidates``), an equation of an inlined ``scan`` / ``while`` /
  ``cond`` body (``_inline_loop``, ``_inline_cond``), or a boundary node joining such a body to
  the enclosing program (its candidates: every layout the boundary value may take). A value's
  layout is its producer's chosen output nd-sbp, or fixed.
* **edge costs** (``Problem.edge``): boxing a value from its producer's layout ``σ`` to a layout
  ``τ`` some consumer needs costs the boxing planner's figure (``_boxing.move_cost``: bytes per
  device plus ``COLLECTIVE_LATENCY_BYTES`` per collective) plus, per local move,
  ``LOCAL_MOVE_BYTES`` and a copy of the smallest piece, once per (value, target layout) however
  many consumers share it, as the compiler's conversion cache does (``_Inference.box_value``); a
  loop body's conversions count once per iteration.
* **node costs**: compute, ``COMPUTE_BYTES_PER_FLOP`` times the work a device does (``_work``):
  a signature that repeats a matmul on every device pays for it; ``STICKY_BYTES`` for leaving
  the search's choice (``search``).
* **constraints**: program inputs and constants keep their layouts (``ANCHOR_BYTES`` on
  converting an input with a collective); ``out_sbp`` outputs, ``to_global`` annotations and
  JAX sharding requests are fixed targets.

Solved (``solve``) exactly when the problem is small (``solve_ilp``: HiGHS, its linear
relaxation where that comes out integral, else ``scipy.optimize.milp``). Where it is not:
repeated identical layers are solved once (equations of one role, ``roles``, share one node of
the problem of roles, ``quotient``, whose answer is copied to every copy), and a problem still
too large is solved on a placement of two or more axes exactly one axis at a time (``by_axis``:
every node's signature on one axis chosen at once, the other axes held), else by OneFlow-style
graph reduction (``_Pairwise``: leaves folded, chains collapsed, parallel edges merged) and
descent (``descend``). The decisions are handed back to
the compiler's forward pass (``_Inference.fixed``), which builds an ordinary ``Program`` from them
— every candidate it follows is legal for the layouts it sees, so a plan can be costly but never
wrong.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections import Counter

import jax
import numpy as np
from jax.extend import core as jcore

from . import _sbp
from ._boxing import COLLECTIVE_LATENCY_BYTES, _best
from ._problem import flops, split_ways

_BCAST = _sbp.broadcast

COMPUTE_BYTES_PER_FLOP = 1.0
"""Byte-equivalents charged per floating-point operation a device computes (``_work``). A flop
and a byte moved cost about the same on simulated CPU devices (on NVLink GPUs a flop is ~1000x
cheaper). Lower rates let the solver trade parallelism for communication: at 1/64 it gathered a
data-parallel GPT's token slice and computed the whole step on every device to save the
gradient all-reduces."""

LOCAL_MOVE_BYTES = 4096.0
"""The fixed cost of a local move (a slice, a zero-fill) beyond the bytes it copies: an op of its
own (like ``_boxing._ZERO_FILL_COST``); slicing an operand to save less work than that is not
worth it."""

STICKY_BYTES = 8192.0
"""Byte-equivalents charged for each equation whose signature differs from the search's plan: the
global plan departs from the search's only for a gain larger than this per changed equation, so
that a few bytes do not swap one collective for another of the same count (an all-gather of an
activation for the all-reduce of a small gradient) and plans keep the shape users expect."""

ANCHOR_BYTES = float(1 << 40)
"""Charged for a conversion of a program input (parameter, optimizer state, batch) that needs a
collective. The layouts a user gives the inputs say how they want the work divided (a split
batch: data parallel; split weights: Megatron); by communication alone, gathering a small batch
and computing the whole step on every device is often "cheaper" than reducing the gradients.
Like the anchored seed of ``_compiler._search``, the plan keeps inputs as given wherever some
signature can read them so (a consumer that cannot pays the same charge whatever it chooses),
and ``search`` still returns the search's plan where that costs less."""

ILP_MAX_VARS = 6_000
"""Problems with at most this many candidate signatures in all (summed over the nodes) are solved
exactly (``solve_ilp``); larger ones through the problem of roles, one placement axis at a time
(``by_axis``) or by graph reduction and descent (``solve``, ``_solve_direct``)."""

ILP_NODE_LIMIT = 200
"""Branch-and-bound nodes HiGHS may explore: a work limit, not a time limit, so that the plan
never depends on how busy the machine is. The best solution found within it is a proposal like
any other (``solve`` keeps the cheapest)."""

MILP_MIN_GAIN = COLLECTIVE_LATENCY_BYTES
"""``solve_ilp`` goes on to branch and bound (``milp``) after a fractional relaxation only where
the relaxation leaves room for a plan cheaper than the best known by at least this much (one
collective's fixed cost, byte-equivalents). Branch and bound can spend seconds proving that a
known plan is optimal when the relaxation is only a little below it; a gain smaller than one
collective is not worth that."""

ILP_JOINT_MAX = 1024
"""``solve_ilp`` models a value with one reader by the joint (producer layout, reader layout)
choice when there are at most this many pairs."""

ILP_TIME_LIMIT = 30.0
"""A safety net only (seconds)."""


def enabled() -> bool:
    """Whether ``jsbp.jit`` plans globally (``JSBP_PLANNER=global``)."""
    return os.environ.get("JSBP_PLANNER", "").strip().lower() == "global"


# -------------------------------------------------------------------------------------------
# the problem
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Node:
    """One equation with a choice: its candidate signatures and what each costs by itself."""

    eqn: object
    cands: list  # [(in nd-sbps, out nd-sbps)]
    operands: list  # per operand: value key or None (a literal)
    outputs: list  # per output: value key or None (dropped)
    cost: np.ndarray  # per candidate: redundant compute (byte-equivalents)
    kind: object = (
        0  # equal for equations sharing one candidate list (same rule, parameters, types)
    )
    scope: int | None = (
        None  # the inlined loop / cond whose body (or boundary) it belongs to (``_Scope``)
    )


@dataclasses.dataclass
class Value:
    shape: tuple
    itemsize: int
    producer: tuple | None = None  # (node index, output index); None: fixed layout ``nd``
    nd: tuple | None = None
    anchored: bool = False  # a program input (``ANCHOR_BYTES``)
    uses: list = dataclasses.field(default_factory=list)  # (node index, operand index)
    shared: set = dataclasses.field(
        default_factory=set
    )  # fixed targets sharing the conversion cache
    own: list = dataclasses.field(default_factory=list)  # fixed targets each converting alone
    # (src, dst) -> ``Problem.edge``, one table per (shape, itemsize, anchored), set on first use
    costs: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    weight: float = 1.0  # how many values of the full problem this one stands for (``quotient``)


@dataclasses.dataclass
class Problem:
    hierarchy: tuple
    nodes: list
    values: dict
    _cost_cache: dict = dataclasses.field(default_factory=dict)
    # node index -> its candidate in the starting plan, where the plan's steps do not tell
    # (an inlined loop body's nodes, its boundary's: ``_inline_loop``)
    preset: dict = dataclasses.field(default_factory=dict)
    scopes: dict = dataclasses.field(
        default_factory=dict
    )  # scope id -> ``_Scope`` (inlined loops / conds)

    def table(self, v: Value) -> dict:
        """(src, dst) -> the unweighted ``edge`` cost, one table per (shape, itemsize, anchored)."""
        table = v.costs
        if table is None:
            table = v.costs = self._cost_cache.setdefault(
                ("edges", v.shape, v.itemsize, v.anchored), {}
            )
        return table

    def edge(self, v: Value, src, dst) -> float:
        """The cost of boxing ``v`` from ``src`` to ``dst``, times ``v.weight``: the boxing
        planner's cost (bytes per device, ``COLLECTIVE_LATENCY_BYTES`` per collective and its small
        charge per local move), plus ``LOCAL_MOVE_BYTES`` and a copy of the smallest piece per
        local move, plus ``ANCHOR_BYTES`` for a program input converted by a collective."""
        if src == dst:
            return 0.0
        table = self.table(v)
        hit = table.get((src, dst))
        if hit is None:
            # ``_compiler._moves_cost(plan(...))`` without building the moves, plus the
            # planner's small charge for a local move (a slice, a zero-fill) that it ranks by
            total = float(math.prod(v.shape) * v.itemsize)
            cost, path = _best(src, dst, len(v.shape), self.hierarchy, total)
            # a local move (slice, zero-fill) is an op of its own that copies at least the
            # smallest piece: not free
            cost += sum(
                LOCAL_MOVE_BYTES + total / math.prod(self.hierarchy)
                for m in path
                if not m.collective
            )
            if v.anchored and any(m.collective for m in path):
                cost += ANCHOR_BYTES
            hit = table[(src, dst)] = cost
        return hit * v.weight


def _work(eqn, cands, hierarchy) -> np.ndarray:
    """Per candidate: the byte-equivalent cost of the work one device does (``split_ways``)."""
    return flops(eqn) * COMPUTE_BYTES_PER_FLOP / split_ways(cands, hierarchy)


def build(inf, prog, jaxpr, out_nd, weights=None) -> Problem:
    """The problem of ``prog``, a program ``inf`` (a reference forward pass) built: its top-scope
    equations (inlined calls included) with the candidates ``inf`` recorded for them, and its
    ``scan`` / ``while`` / ``cond`` steps inlined (``_inline_loop``, ``_inline_cond``). ``out_nd``:
    the layouts asked of the outputs (fixed targets); the program's inputs are anchored.

    ``weights`` (a reduced program, ``_repeat``): id(equation) -> how many equations of the whole
    program it stands for (the last head copy of a block: itself and every removed copy). Its
    node's compute and the conversions of the values it makes count that many times (a value
    without a producer: as often as its most repeated reader), so the reduced program's problem
    weighs a block against the model's ends as the whole program does."""
    traced = {id(e[1]): e for e in inf.trace if e[0] == "prim"}
    hier = inf.placement.hierarchy
    nodes: list[Node] = []
    values: dict = {}
    preset: dict = {}
    scopes: dict = {}
    work: dict = {}  # id(candidates) -> (candidates, ``_work``): equal equations share their list

    def value(v, nd=None):
        k = inf.key(v)
        val = values.get(k)
        if val is None:
            aval = k.aval if not isinstance(k, jcore.Literal) else v.aval
            from ._compiler import _itemsize

            val = values[k] = Value(tuple(aval.shape), _itemsize(aval), nd=nd)
        return k, val

    def fixed_value(v, nd):
        if isinstance(v, (jcore.Literal, jcore.DropVar)):
            return
        _, val = value(v)
        if val.producer is None and val.nd is None:
            val.nd = nd

    def walk(p):
        for v in p.jaxpr.constvars:
            fixed_value(v, _b(hier))
        for v, lay in zip(p.jaxpr.invars, p.in_layouts):
            fixed_value(v, lay.nd_sbp)
        for st in p.steps:
            if st.kind == "call":
                walk(st.sub)
            elif (
                st.kind in _INLINE
            ):  # a loop, a cond: its bodies' equations and its boundary are nodes
                _INLINE[st.kind](inf, st, nodes, values, value, fixed_value, preset, scopes)
            elif id(st.eqn) in traced:  # a primitive with candidate signatures (its rule's)
                _, eqn, cur, cands = traced[id(st.eqn)]
                u = len(nodes)
                operands = []
                for i, v in enumerate(eqn.invars):
                    if isinstance(v, jcore.Literal):
                        operands.append(None)
                        continue
                    k, val = value(v)
                    fixed_value(v, cur[i].nd_sbp)
                    val.uses.append((u, i))
                    operands.append(k)
                outputs = []
                for j, v in enumerate(eqn.outvars):
                    if isinstance(v, jcore.DropVar):
                        outputs.append(None)
                        continue
                    k, val = value(v)
                    val.producer, val.nd = (u, j), None
                    outputs.append(k)
                w = work.get(id(cands))
                if w is None or w[0] is not cands:
                    w = work[id(cands)] = (cands, _work(eqn, cands, hier))
                nodes.append(Node(eqn, list(cands), operands, outputs, w[1].copy(), kind=id(cands)))
            else:
                shared = st.kind in ("annotate", "prim")  # boxed via the conversion cache
                for v, lay in zip(st.eqn.invars, st.in_layouts):
                    if isinstance(v, jcore.Literal):
                        continue
                    _, val = value(v)
                    (val.shared.add if shared else val.own.append)(lay.nd_sbp)
                for v, lay in zip(st.eqn.outvars, st.out_layouts):
                    fixed_value(v, lay.nd_sbp)
            # results with no producer of their own (an inlined call returning a literal)
            for v, lay in zip(st.eqn.outvars, st.out_layouts):
                fixed_value(v, lay.nd_sbp)

    walk(prog)
    walk = None  # noqa: F841 (a recursive closure: drop the cycle, so the problem is freed with its last use)
    for v in jaxpr.invars:
        values[inf.key(v)].anchored = True
    for v, want in zip(jaxpr.outvars, out_nd or ()):
        if want is not None and not isinstance(v, jcore.Literal):
            _, val = value(v)
            val.own.append(tuple(want))
    if weights:
        mult = [float(weights.get(id(n.eqn), 1)) for n in nodes]
        for n, m in zip(nodes, mult):
            n.cost *= m
        for val in values.values():
            val.weight *= (
                mult[val.producer[0]]
                if val.producer is not None
                else max((mult[f] for f, _ in val.uses), default=1.0)
            )
    return Problem(hier, nodes, values, preset=preset, scopes=scopes)


def _b(hier):
    return (_BCAST,) * len(hier)


# -------------------------------------------------------------------------------------------
# bodies inlined: a loop's or cond's body equations as nodes of the enclosing problem
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Mark:
    """The stand-in equation of a boundary node of an inlined loop or ``cond`` (``_Inliner``)."""

    eqn: object
    role: str  # a loop's "const", "carry", "xs", "ys"; a cond's "ops", "results"
    index: int


@dataclasses.dataclass
class _Scope:
    """An inlined loop or ``cond``: per body (a loop's one, a ``cond``'s branches) the reference
    pass that planned it (whose candidates and inlined calls' copies the pass following the
    decisions reuses) and the indices of its equations' nodes; per boundary role the boundary
    nodes (a loop's "const", "carry", "xs", "ys"; a cond's "ops", "results")."""

    kind: str  # "loop" or "cond"
    eqn: object  # the step's equation (its plan is keyed by its id in the pass that follows it)
    bodies: list  # [(``_compiler._Inference``, indices of the nodes directly in that body)]
    roles: dict = dataclasses.field(default_factory=dict)
    parent: tuple | None = (
        None  # (scope id, body index) of the body it is nested in; None: top scope
    )


@dataclasses.dataclass
class BodyPlan:
    """The decisions for one inlined body: the ``fixed`` and ``hubs`` maps of the pass that plans
    it (``_compiler._follow_body``) and the body's reference pass (``ref``: its candidates and
    inlined calls, which the decisions name)."""

    fixed: dict
    hubs: dict
    ref: object


@dataclasses.dataclass
class LoopPlan:
    """The decisions for one inlined loop (``decisions``): the layouts its (body's) constants,
    carry and scanned inputs enter the loop in, the layouts of its scanned outputs' slices, and
    its body's ``BodyPlan``."""

    consts: list
    carry: list
    xs: list
    ys: list
    body: BodyPlan


@dataclasses.dataclass
class CondPlan:
    """The decisions for one inlined ``cond``: the layouts its operands enter the branches in and
    its results leave them in, and a ``BodyPlan`` per branch."""

    ops: list
    results: list
    branches: list


def _layouts(aval, hier) -> list[tuple]:
    """Every nd-sbp of a value of type ``aval`` on ``hier`` that a loop or ``cond`` boundary may
    take: per axis B, P (sum; numbers only, not booleans or PRNG keys) or a split of a dim at least
    as long as the axis."""
    partial = [_sbp.partial_sum] if jax.dtypes.issubdtype(aval.dtype, np.number) else []
    per = [
        [_BCAST, *partial] + [_sbp.Split(d) for d, n in enumerate(aval.shape) if n >= size]
        for size in hier
    ]
    return list(itertools.product(*per))


_SCOPE_IDS = itertools.count()


class _Inliner:
    """Adds the bodies of a step ``st`` of the program ``build`` walks to its problem: each body
    planned afresh (the search, given the step's layouts at the body's boundary) for its
    candidates and starting choice, its problem's nodes and values merged in (keys wrapped as
    (scope id, body index, key), compute and conversions counted ``times`` over), the steps
    nested in it (which ``build`` of the body inlined) kept as scopes of their own, and boundary
    nodes joining them to the enclosing program."""

    def __init__(self, inf, st, nodes, values, value, fixed_value, preset, kind):
        self.inf, self.st, self.eqn = inf, st, st.eqn
        self.nodes, self.values, self.value, self.fixed_value, self.preset = (
            nodes,
            values,
            value,
            fixed_value,
            preset,
        )
        self.sid = next(_SCOPE_IDS)  # (not id(equation): a nested step's equation may be met twice)
        self.scope = _Scope(kind, st.eqn, [])
        self.nested: dict = {}  # the scopes of steps nested in its bodies, re-indexed
        self.hier = inf.placement.hierarchy

    def body(self, closed, in_layouts, out_nd, times, in_body):
        """Plan and merge one body; a function from its atoms to their keys here."""
        from ._compiler import _IN_BODY, _search_pass

        token = _IN_BODY.set(in_body)
        try:
            bprog, binf = _search_pass(
                self.inf.placement,
                closed.jaxpr,
                closed.consts,
                in_layouts,
                out_nd,
                strict=self.inf.strict,
            )
            q = build(binf, bprog, closed.jaxpr, None)
        finally:
            _IN_BODY.reset(token)
        start = _choice_of(q, bprog)
        b, off = len(self.scope.bodies), len(self.nodes)

        def wrap(k):
            return (self.sid, b, k)

        for n in q.nodes:
            self.nodes.append(
                dataclasses.replace(
                    n,
                    operands=[None if k is None else wrap(k) for k in n.operands],
                    outputs=[None if k is None else wrap(k) for k in n.outputs],
                    cost=n.cost * times,
                    scope=self.sid if n.scope is None else n.scope,
                )
            )
        for k, val in q.values.items():
            self.values[wrap(k)] = dataclasses.replace(
                val,
                producer=None if val.producer is None else (val.producer[0] + off, val.producer[1]),
                uses=[(u + off, i) for u, i in val.uses],
                weight=val.weight * times,
                anchored=False,
                costs=None,
            )
        self.preset.update((off + u, c) for u, c in enumerate(start))
        self.scope.bodies.append(
            (binf, [off + u for u, n in enumerate(q.nodes) if n.scope is None])
        )
        for nid, sc in q.scopes.items():  # steps nested in this body (inlined by ``build`` in turn)
            self.nested[nid] = dataclasses.replace(
                sc,
                bodies=[(bi, [off + u for u in us]) for bi, us in sc.bodies],
                roles={r: [off + u for u in us] for r, us in sc.roles.items()},
                parent=(self.sid, b) if sc.parent is None else sc.parent,
            )
        return lambda v: None if isinstance(v, jcore.Literal) else wrap(binf.key(v))

    def done(self, scopes) -> None:
        scopes.update(self.nested)
        scopes[self.sid] = self.scope

    def outer_in(self, i):
        """Operand ``i``'s key (None: a literal, in every layout at no cost)."""
        v = self.eqn.invars[i]
        if isinstance(v, jcore.Literal):
            return None
        k, _ = self.value(v)
        self.fixed_value(v, self.st.in_layouts[i].nd_sbp)
        return k

    def outer_out(self, j):
        v = self.eqn.outvars[j]
        return None if isinstance(v, jcore.DropVar) else self.value(v)[0]

    def boundary(self, role, j, cands, ref, operands, outputs):
        """A boundary node: candidates ``cands`` (``ref``, the step's own, first), reading
        ``operands`` and making ``outputs`` (keys)."""
        u = len(self.nodes)
        cands = list(dict.fromkeys([ref, *cands]))
        for i, k in enumerate(operands):
            if k is not None:
                self.values[k].uses.append((u, i))
        for i, k in enumerate(outputs):
            if k is not None:
                val = self.values[k]
                val.producer, val.nd = (u, i), None
        self.nodes.append(
            Node(
                _Mark(self.eqn, role, j),
                cands,
                list(operands),
                list(outputs),
                np.zeros(len(cands)),
                kind=("boundary", role, tuple(cands)),
                scope=self.sid,
            )
        )
        self.preset[u] = 0
        self.scope.roles.setdefault(role, []).append(u)


def _inline_loop(inf, st, nodes, values, value, fixed_value, preset, scopes) -> None:
    """Add loop step ``st``'s body (a ``scan``'s or a ``while``'s) to the problem being built
    (``build``'s ``nodes`` / ``values``): its equations as nodes whose compute and whose values'
    conversions count once per iteration (a scan's ``length``, ``WHILE_TRIPS``), and a boundary
    node per constant (the layout it enters the loop in, converted once before the loop), per
    carry (its layout ``τ``, which the init is converted to, the body reads, the body's
    carry-out is converted back to every iteration and the loop returns), per scanned input (its
    layout, the body's slice that one without the scan axis) and per scanned output. A
    ``while``'s condition reads its constants as they are and the carry in the layouts chosen
    (its few scalar equations are not in the problem). Steps nested in the body are inlined in
    turn (``build`` of the body), their iterations multiplying."""
    from ._compiler import WHILE_TRIPS, _shift_split, scan_counts

    eqn = st.eqn
    if eqn.primitive.name == "scan":
        nc, nk = scan_counts(eqn.params)
        first, trips, closed, body_prog = (
            0,
            float(eqn.params["length"]),
            eqn.params["jaxpr"],
            st.sub,
        )
    else:  # a while: operands (condition constants, body constants, carry)
        first, nc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        nk = len(eqn.invars) - first - nc
        trips, closed, body_prog = float(WHILE_TRIPS), eqn.params["body_jaxpr"], st.sub[1]
    bj = closed.jaxpr
    add = _Inliner(inf, st, nodes, values, value, fixed_value, preset, "loop")
    out_nd = [l.nd_sbp for l in st.out_layouts[:nk]] + [None] * (len(bj.outvars) - nk)
    inner = add.body(closed, body_prog.in_layouts, out_nd, trips, True)
    hier = add.hier
    for i in range(nc):
        ref = st.in_layouts[first + i].nd_sbp
        add.boundary(
            "const",
            i,
            [((t,), (t,)) for t in _layouts(bj.invars[i].aval, hier)],
            ((ref,), (ref,)),
            [add.outer_in(first + i)],
            [inner(bj.invars[i])],
        )
    for j in range(nk):
        sig = lambda t: ((t, t), (t, t))  # noqa: E731
        add.boundary(
            "carry",
            j,
            [sig(t) for t in _layouts(bj.invars[nc + j].aval, hier)],
            sig(st.out_layouts[j].nd_sbp),
            [add.outer_in(first + nc + j), inner(bj.outvars[j])],
            [inner(bj.invars[nc + j]), add.outer_out(j)],
        )
    for i in range(first + nc + nk, len(eqn.invars)):  # (a scan's: ``first`` is 0)
        ref = st.in_layouts[i].nd_sbp
        cands = [
            ((t,), (_shift_split(t, -1),))
            for t in _layouts(eqn.invars[i].aval, hier)
            if not any(x.is_split and x.dim == 0 for x in t)
        ]
        add.boundary(
            "xs",
            i - nc - nk,
            cands,
            ((ref,), (_shift_split(ref, -1),)),
            [add.outer_in(i)],
            [inner(bj.invars[i])],
        )
    for j in range(nk, len(bj.outvars)):
        ref = _shift_split(st.out_layouts[j].nd_sbp, -1)
        cands = [((t,), (_shift_split(t, +1),)) for t in _layouts(bj.outvars[j].aval, hier)]
        add.boundary(
            "ys",
            j - nk,
            cands,
            ((ref,), (_shift_split(ref, +1),)),
            [inner(bj.outvars[j])],
            [add.outer_out(j)],
        )
    add.done(scopes)


def _inline_cond(inf, st, nodes, values, value, fixed_value, preset, scopes) -> None:
    """Add ``cond`` step ``st``'s branches to the problem being built: each branch's equations as
    nodes (counted once each, as ``program_cost`` counts a ``cond``: which branch runs is not
    known), a boundary node per operand (the layout every branch reads it in, converted once
    before the ``cond``) and per result (the layout every branch leaves it in). The index is
    read replicated. Steps nested in a branch are inlined in turn."""
    eqn = st.eqn
    add = _Inliner(inf, st, nodes, values, value, fixed_value, preset, "cond")
    out_nd = [l.nd_sbp for l in st.out_layouts]
    branches = eqn.params["branches"]
    inner = [
        add.body(closed, sub.in_layouts, out_nd, 1.0, False)
        for closed, sub in zip(branches, st.sub)
    ]
    hier, nb = add.hier, len(branches)
    if (k := add.outer_in(0)) is not None:
        values[k].own.append(_b(hier))
    for i in range(1, len(eqn.invars)):
        ref = st.in_layouts[i].nd_sbp
        add.boundary(
            "ops",
            i - 1,
            [((t,), (t,) * nb) for t in _layouts(eqn.invars[i].aval, hier)],
            ((ref,), (ref,) * nb),
            [add.outer_in(i)],
            [f(closed.jaxpr.invars[i - 1]) for f, closed in zip(inner, branches)],
        )
    for j, v in enumerate(eqn.outvars):
        ref = st.out_layouts[j].nd_sbp
        add.boundary(
            "results",
            j,
            [((t,) * nb, (t,)) for t in _layouts(v.aval, hier)],
            ((ref,) * nb, (ref,)),
            [f(closed.jaxpr.outvars[j]) for f, closed in zip(inner, branches)],
            [add.outer_out(j)],
        )
    add.done(scopes)


_INLINE = {"scan": _inline_loop, "while": _inline_loop, "cond": _inline_cond}


def decisions(prob: Problem, choice: list[int]) -> tuple[dict, dict]:
    """The ``fixed`` and ``hubs`` maps of the pass that follows ``choice``: per top-scope node its
    signature (by id(equation)), per inlined loop a ``LoopPlan`` (by ("loop", id(equation))), per
    inlined ``cond`` a ``CondPlan`` (by ("cond", id(equation))), whose bodies' maps hold the
    plans of the steps nested in them alike; per value read in several layouts the hub it is
    first converted to (in the map of the body it belongs to)."""
    hubs_at: dict = {}  # (scope id, body index), None for the top scope -> {key: hub}
    for k, val in prob.values.items():
        h = conversions(prob, val, choice)[1]
        if h is None:
            continue
        at = None
        while (
            isinstance(k, tuple) and len(k) == 3 and k[0] in prob.scopes
        ):  # (unwrapped to its body's key)
            at, k = k[:2], k[2]
        hubs_at.setdefault(at, {})[k] = h
    children: dict = {}
    for sid, sc in prob.scopes.items():
        children.setdefault(sc.parent, []).append(sid)

    def fixed_of(at, us):
        fixed = {id(prob.nodes[u].eqn): prob.nodes[u].cands[choice[u]] for u in us}
        for sid in children.get(at, ()):
            sc = prob.scopes[sid]
            fixed[(sc.kind, id(sc.eqn))] = plan_of(sid, sc)
        return fixed

    def plan_of(sid, sc):
        def pick(role, side):
            return [prob.nodes[u].cands[choice[u]][side][0] for u in sc.roles.get(role, ())]

        bodies = [
            BodyPlan(fixed_of((sid, b), us), hubs_at.get((sid, b), {}), ref)
            for b, (ref, us) in enumerate(sc.bodies)
        ]
        if sc.kind == "loop":
            (body,) = bodies
            return LoopPlan(*[pick(r, 0) for r in ("const", "carry", "xs", "ys")], body)
        return CondPlan(pick("ops", 0), pick("results", 1), bodies)

    return fixed_of(None, [u for u, n in enumerate(prob.nodes) if n.scope is None]), hubs_at.get(
        None, {}
    )


# -------------------------------------------------------------------------------------------
# the objective of one assignment (for checks and local search)
# -------------------------------------------------------------------------------------------


def objective(prob: Problem, choice: list[int], hubs: bool = True) -> float:
    """The modelled cost of choosing candidate ``choice[u]`` for every node ``u`` (``hubs``:
    conversions may go through a hub layout, as the replayed program makes them; else each is
    costed from the value as produced, as ``solve_ilp`` and ``descend`` model them)."""
    total = float(sum(n.cost[c] for n, c in zip(prob.nodes, choice)))
    for val in prob.values.values():
        total += conversions(prob, val, choice, hubs)[0]
    return total


def conversions(prob: Problem, val: Value, choice, hubs: bool = True) -> tuple[float, tuple | None]:
    """(cost, hub) of converting ``val`` to every layout its readers take under ``choice``: each
    distinct target once, from the value as produced or, where that is cheaper overall, first to
    one *hub* layout (a target, or B) that the other targets are converted from where that is no
    dearer (``_Inference.box_operand`` emits it so)."""
    src = _layout_of(prob, val, choice)
    own = sum(prob.edge(val, src, t) for t in val.own)
    targets = set(val.shared)
    for u, i in val.uses:
        targets.add(prob.nodes[u].cands[choice[u]][0][i])
    targets.discard(src)
    direct = {t: prob.edge(val, src, t) for t in targets}
    best, hub = sum(direct.values()), None
    if hubs and len(targets) >= 2:
        for h in targets | {(_BCAST,) * len(src)}:
            c = direct[h] if h in direct else prob.edge(val, src, h)
            c += sum(min(direct[t], prob.edge(val, h, t)) for t in targets if t != h)
            if c < best - 1e-6:
                best, hub = c, h
    return best + own, hub


def _layout_of(prob, val, choice):
    if val.producer is None:
        return val.nd
    u, j = val.producer
    return prob.nodes[u].cands[choice[u]][1][j]


# -------------------------------------------------------------------------------------------
# exact solution: a mixed-integer program
# -------------------------------------------------------------------------------------------


def solve_ilp(
    prob: Problem,
    time_limit: float | None = None,
    quick: bool = False,
    incumbent: float | None = None,
) -> list[int] | None:
    """The optimal choice per node (``scipy.optimize.milp`` with HiGHS), or None if the solver
    found no solution in time or scipy is not installed. Formulation (one row per item):

    * ``x[u, s]`` binary, ``sum_s x[u, s] = 1``;
    * ``t[v, τ]`` in [0, 1]: value ``v`` is converted to ``τ``; ``t[v, τ] >= sum of x[f, s]`` over
      the candidates ``s`` of consumer ``f`` that read ``v`` as ``τ`` (1 for a fixed target);
    * ``z[v, τ] >= 0``, the cost of that conversion: ``z >= sum_σ c(σ, τ) l[v, σ] - C_τ (1 - t)``
      where ``l[v, σ]`` (the producer's candidates giving ``σ``) sums to 1 and ``C_τ = max_σ c``;
    * minimise compute + ``sum z`` + the conversions to fixed targets that are not shared.

    A value with a producer and readers is written by joint choices instead (``_joint_rows``)
    where there are at most ``ILP_JOINT_MAX`` (layout made, layout read) pairs: a tighter
    relaxation, usually integral at the root.

    ``quick`` (``by_axis``'s sub-problems, one per placement axis): the relaxation alone; None
    where it is fractional (branch and bound on a sub-problem as large as the program can take
    seconds). ``incumbent``: the objective (``hubs=False``) of the best choice known; None, too,
    where the relaxation bounds every plan within ``MILP_MIN_GAIN`` of it. HiGHS runs without
    its presolve, which on these problems costs more than it saves.
    """
    try:  # scipy is optional (``pip install jsbp[planner]``): without it, descent and reduction
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:
        return None

    time_limit = ILP_TIME_LIMIT if time_limit is None else time_limit

    nodes = prob.nodes
    base = np.zeros(len(nodes) + 1, dtype=np.int64)
    for u, n in enumerate(nodes):
        base[u + 1] = base[u] + len(n.cands)
    nx = int(base[-1])
    cost = [np.concatenate([n.cost for n in nodes])] if nodes else [np.zeros(0)]
    lb, ub, integ = [np.zeros(nx)], [np.ones(nx)], [np.ones(nx)]
    # one candidate per node
    rows = np.repeat(np.arange(len(nodes)), np.diff(base)).tolist()
    cols, data = list(range(nx)), [1.0] * nx
    lo, hi = [1.0] * len(nodes), [1.0] * len(nodes)
    r = len(nodes)
    nvar = nx
    extra_cost, extra_lb, extra_ub = [], [], []
    offset = 0.0  # what every choice pays (conversions of fixed values to fixed targets)
    for val in prob.values.values():
        # the layouts the value may be in: σ -> the producer's candidate columns giving it
        if val.producer is None:
            srcs = {val.nd: None}
            offset += sum(prob.edge(val, val.nd, t) for t in val.own)
        else:
            u, j = val.producer
            srcs = {}
            for s, (_, outs) in enumerate(nodes[u].cands):
                srcs.setdefault(outs[j], []).append(base[u] + s)
            for t in val.own:  # conversions of its own: linear in the producer's choice
                for sigma, colset in srcs.items():
                    c = prob.edge(val, sigma, t)
                    if c:
                        for col in colset:
                            cost[0][col] += c
        # targets asked by consumers: τ -> per use, the columns reading the value as τ
        asks: dict = {}
        readers = []  # per use: τ -> the reader's columns reading the value as τ
        for f, i in val.uses:
            per: dict = {}
            for s, (ins, _) in enumerate(nodes[f].cands):
                per.setdefault(ins[i], []).append(base[f] + s)
            readers.append(per)
            for tau, colset in per.items():
                asks.setdefault(tau, []).append(colset)
        for tau in val.shared:
            asks.setdefault(tau, []).append(None)
        if (
            val.producer is not None
            and readers
            and len(srcs) * sum(map(len, readers)) <= ILP_JOINT_MAX
        ):
            r, nvar = _joint_rows(
                prob,
                val,
                srcs,
                readers,
                r,
                nvar,
                (rows, cols, data, lo, hi),
                (extra_cost, extra_lb, extra_ub),
            )
            continue
        for tau, uses in asks.items():
            cs = {sigma: prob.edge(val, sigma, tau) for sigma in srcs}
            cmax = max(cs.values())
            if cmax == 0.0:
                continue
            if val.producer is None and all(u is None for u in uses):
                offset += cmax  # a fixed conversion of a fixed value: a constant
                continue
            t, z = nvar, nvar + 1
            nvar += 2
            forced = any(u is None for u in uses)
            extra_lb += [1.0 if forced else 0.0, 0.0]
            extra_cost += [0.0, 1.0]
            extra_ub += [1.0, np.inf]
            for colset in uses:
                if colset is None:
                    continue
                for col in colset:  # x - t <= 0
                    rows.append(r)
                    cols.append(col)
                    data.append(1.0)
                rows.append(r)
                cols.append(t)
                data.append(-1.0)
                lo.append(-np.inf)
                hi.append(0.0)
                r += 1
            if val.producer is None:  # z >= c t
                rows += [r, r]
                cols += [t, z]
                data += [cs[val.nd], -1.0]
                lo.append(-np.inf)
                hi.append(0.0)
                r += 1
                continue
            # μ[σ] in [0, l_σ] for each costly σ: at least t - (the cheap σ's share) of them, and
            # z = sum_σ c_σ μ[σ]  (tighter than one big-M row: the relaxation keeps the costs)
            mus = []
            for sigma, colset in srcs.items():
                if cs[sigma]:
                    m = nvar
                    nvar += 1
                    extra_lb.append(0.0)
                    extra_ub.append(1.0)
                    extra_cost.append(cs[sigma])
                    mus.append(m)
                    rows += [r] * (len(colset) + 1)  # μ - l_σ <= 0
                    cols += [m] + colset
                    data += [1.0] + [-1.0] * len(colset)
                    lo.append(-np.inf)
                    hi.append(0.0)
                    r += 1
            # t - sum μ - sum_{cheap σ} l_σ <= 0
            rows.append(r)
            cols.append(t)
            data.append(1.0)
            for m in mus:
                rows.append(r)
                cols.append(m)
                data.append(-1.0)
            for sigma, colset in srcs.items():
                if not cs[sigma]:
                    rows += [r] * len(colset)
                    cols += colset
                    data += [-1.0] * len(colset)
            lo.append(-np.inf)
            hi.append(0.0)
            r += 1
    n_extra = nvar - nx
    c = np.concatenate(cost + [np.asarray(extra_cost)])
    lb = np.concatenate(lb + [np.asarray(extra_lb)])
    ub = np.concatenate(ub + [np.asarray(extra_ub)])
    integ = np.concatenate(integ + [np.zeros(n_extra)])
    a = coo_matrix((data, (rows, cols)), shape=(r, nvar)).tocsr()
    x, bound = _integral_relaxation(c, a, np.asarray(lo), np.asarray(hi), lb, ub, integ, time_limit)
    if x is None and (
        quick or (incumbent is not None and bound + offset > incumbent - MILP_MIN_GAIN)
    ):
        return None
    if x is None:
        res = milp(
            c,
            constraints=LinearConstraint(a, lo, hi),
            integrality=integ,
            bounds=Bounds(lb, ub),
            options={
                "time_limit": time_limit,
                "node_limit": ILP_NODE_LIMIT,
                "disp": False,
                "mip_rel_gap": 1e-6,
            },
        )
        if res.x is None:
            return None
        x = res.x
    x = x[:nx]
    return [int(np.argmax(x[base[u] : base[u + 1]])) for u in range(len(nodes))]


def _integral_relaxation(c, a, lo, hi, lb, ub, integ, time_limit):
    """(solution, value) of ``solve_ilp``'s linear relaxation: the solution when every integer
    variable comes out 0 or 1 (then it is optimal for the mixed-integer program as well), else
    None; the value, a lower bound on the program's (-inf if HiGHS found none). With the joint
    rows the relaxation is usually integral already, and HiGHS's simplex alone takes about half
    of what ``milp`` spends around the same LP (presolve, cuts, heuristics). A fractional
    relaxation may be solved again inside ``milp`` (``MILP_MIN_GAIN``)."""
    from scipy.optimize import linprog
    from scipy.sparse import vstack

    eq = lo == hi
    up, down = ~eq & np.isfinite(hi), ~eq & np.isfinite(lo)
    a_ub = vstack([a[up], -a[down]]).tocsr() if up.any() or down.any() else None
    b_ub = np.concatenate([hi[up], -lo[down]]) if a_ub is not None else None
    res = linprog(
        c,
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=a[eq] if eq.any() else None,
        b_eq=lo[eq] if eq.any() else None,
        bounds=np.stack([lb, ub], axis=1),
        method="highs",
        options={"time_limit": time_limit, "presolve": False},
    )
    if res.status != 0 or res.x is None:
        return None, -np.inf
    xi = res.x[integ > 0]
    return (res.x if np.all(np.minimum(xi, 1.0 - xi) <= 1e-7) else None), float(res.fun)


def _joint_rows(prob, val, srcs, readers, r, nvar, mat, var):
    """``solve_ilp``'s rows for a value with a producer, by joint choices: per reader a
    ``w[σ, τ] >= 0`` whose marginals are the producer's choice (``sum_τ w[σ, τ] = l_σ``) and
    the reader's (``sum_σ w[σ, τ]`` = its candidates reading ``τ``); a conversion
    ``W[σ, τ] >= w[σ, τ]`` (``>= l_σ`` for a fixed target), paid once however many readers
    share it. Tighter than the rows per target, where in the relaxation one σ could serve every
    τ at once (a fractional relaxation, then long branch and bound). A τ that one reader alone
    asks for (and no fixed target) has no ``W``: ``w[σ, τ]`` carries its cost. ``mat``: the constraint lists
    (rows, cols, data, lo, hi); ``var``: the new variables' (cost, lb, ub) lists. Returns the next
    row and variable indices."""
    rows, cols, data, lo, hi = mat
    cost, lb, ub = var
    sig = list(srcs)

    def new_vars(costs):
        nonlocal nvar
        first = nvar
        nvar += len(costs)
        cost.extend(costs)
        lb.extend([0.0] * len(costs))
        ub.extend([1.0] * len(costs))
        return first

    def row(plus, minus, low, high):  # sum(plus columns) - sum(minus columns) in [low, high]
        nonlocal r
        rows.extend([r] * (len(plus) + len(minus)))
        cols.extend(plus)
        cols.extend(minus)
        data.extend([1.0] * len(plus) + [-1.0] * len(minus))
        lo.append(low)
        hi.append(high)
        r += 1

    # a τ that one reader alone asks for needs no W: that reader's w carries the cost (W = w at
    # the optimum); most of the W rows of a ``by_axis`` sub-problem are of this kind
    asked = Counter([t for per in readers for t in per] + list(val.shared))
    edge = {(sigma, tau): c for tau in asked for sigma in sig if (c := prob.edge(val, sigma, tau))}
    paid_once = [pair for pair in edge if asked[pair[1]] > 1 or pair[1] in val.shared]
    first = new_vars([edge[pair] for pair in paid_once])
    conv = {pair: first + i for i, pair in enumerate(paid_once)}  # (σ, τ) -> W's column
    for tau in val.shared:  # a fixed target is converted to whatever the producer gives
        for sigma in sig:
            if (sigma, tau) in conv:
                row([conv[(sigma, tau)]], srcs[sigma], 0.0, np.inf)
    for per in readers:
        taus = list(per.items())
        width = len(taus)
        first = new_vars(
            [
                0.0 if (sigma, tau) in conv else edge.get((sigma, tau), 0.0)
                for sigma in sig
                for tau, _ in taus
            ]
        )
        for a, sigma in enumerate(sig):  # sum_τ w[σ, τ] = l_σ
            row(range(first + a * width, first + (a + 1) * width), srcs[sigma], 0.0, 0.0)
        for b, (_, colset) in enumerate(taus):  # sum_σ w[σ, τ] = the reader's share of τ
            row(range(first + b, first + len(sig) * width, width), colset, 0.0, 0.0)
        # W[σ, τ] >= w[σ, τ] (the most numerous rows: two entries each, appended at once)
        pairs = [
            (w_col, first + a * width + b)
            for b, (tau, _) in enumerate(taus)
            for a, sigma in enumerate(sig)
            if (w_col := conv.get((sigma, tau))) is not None
        ]
        cols.extend(c for pair in pairs for c in pair)
        rows.extend(x for i in range(r, r + len(pairs)) for x in (i, i))
        data.extend((1.0, -1.0) * len(pairs))
        lo.extend([0.0] * len(pairs))
        hi.extend([np.inf] * len(pairs))
        r += len(pairs)
    return r, nvar


# -------------------------------------------------------------------------------------------
# local search: one node at a time, the rest held
# -------------------------------------------------------------------------------------------


def descend(prob: Problem, choice: list[int], max_visits: int = 20) -> list[int]:
    """Improve ``choice`` node by node (iterated conditional modes): a node takes the candidate
    that minimises the objective with every other node held; when it changes, the nodes whose
    costs it changed (producers and other readers of what it reads, readers of what it makes) are
    visited again, until nothing changes (or every node was visited ``max_visits`` times). Never
    increases ``objective`` (hubs aside: it costs each conversion from the value as produced).

    What a node reads is taken from the values' ``uses``, as ``objective`` takes it. In a problem
    of roles (``quotient``) they are not its operands alone: a role reads, at one position, every
    value any of its members reads there (the first block copy's input is the embedding's output,
    the others' the previous block's). Read from the operands (the members' most common reads)
    instead, a descent step would cost a candidate against the wrong reads and could raise the
    objective it is meant to lower."""
    nodes, values = prob.nodes, prob.values
    choice = list(choice)
    reads = _reads_at(prob)
    # per value: how many readers want each layout (fixed targets count once, forever)
    want: dict = {}
    for k, val in values.items():
        want[k] = {tau: 1 << 30 for tau in val.shared}
    for u in range(len(nodes)):
        for k, tau in _reads(nodes[u], reads[u], choice[u]):
            want[k][tau] = want[k].get(tau, 0) + 1
    tabs = [_Tables(n, r) for n, r in zip(nodes, reads)]

    def src_of(k):
        val = values[k]
        if val.producer is None:
            return val.nd
        u, j = val.producer
        return nodes[u].cands[choice[u]][1][j]

    def near(u):
        """The nodes whose costs depend on ``u``'s choice."""
        n = nodes[u]
        out = set()
        for k, _ in reads[u]:
            val = values[k]
            out.update(f for f, _ in val.uses)
            if val.producer is not None:
                out.add(val.producer[0])
        for k in n.outputs:
            if k is not None:
                out.update(f for f, _ in values[k].uses)
        out.discard(u)
        return out

    queue = list(range(len(nodes)))
    queued = [True] * len(nodes)
    visits = [0] * len(nodes)
    head = 0
    while head < len(queue):
        u = queue[head]
        head += 1
        queued[u] = False
        visits[u] += 1
        if visits[u] > max_visits:
            continue
        n, tab = nodes[u], tabs[u]
        if len(n.cands) < 2:
            continue
        for k, tau in _reads(n, reads[u], choice[u]):  # take this node's reads out
            want[k][tau] -= 1
        cost = n.cost.copy()
        for k, lays, idx in tab.ins:
            w, val = want[k], values[k]
            src = src_of(k)
            vec = np.array([0.0 if w.get(t, 0) > 0 else prob.edge(val, src, t) for t in lays])
            cost += vec[idx]
        for k, lays, idx in tab.outs:
            val = values[k]
            targets = [t for t, m in want[k].items() if m > 0] + val.own
            vec = np.array([sum(prob.edge(val, sg, t) for t in targets) for sg in lays])
            cost += vec[idx]
        if tab.repeated:  # a value read twice (x * x): cost those candidates exactly
            for s in tab.repeated:
                cost[s] -= _double_counted(prob, n, reads[u], s, want, src_of)
        best = int(np.argmin(cost))
        if cost[best] < cost[choice[u]] - 1e-6:
            choice[u] = best
            for f in near(u):
                if not queued[f]:
                    queued[f] = True
                    queue.append(f)
        for k, tau in _reads(n, reads[u], choice[u]):
            want[k][tau] = want[k].get(tau, 0) + 1
    return choice


def _reads_at(prob: Problem) -> list[list[tuple]]:
    """Per node: the (value, operand position) pairs it reads, from the values' ``uses``."""
    reads: list[list[tuple]] = [[] for _ in prob.nodes]
    for k, val in prob.values.items():
        for f, i in val.uses:
            reads[f].append((k, i))
    return reads


class _Tables:
    """Per value a node reads and per result: its distinct layouts over the candidates and, per
    candidate, the index of its layout (so a node is costed per layout, not per candidate)."""

    def __init__(self, n: Node, reads: list[tuple]):
        self.ins, self.outs = [], []
        for k, i in reads:
            self.ins.append((k, *_index([ins[i] for ins, _ in n.cands])))
        for j, k in enumerate(n.outputs):
            if k is not None:
                self.outs.append((k, *_index([outs[j] for _, outs in n.cands])))
        self.repeated = []
        if len({k for k, _ in reads}) < len(reads):
            self.repeated = [
                s for s in range(len(n.cands)) if len(_reads(n, reads, s)) < len(reads)
            ]


def _index(items):
    lays = list(dict.fromkeys(items))
    at = {x: i for i, x in enumerate(lays)}
    return lays, np.array([at[x] for x in items], dtype=np.int64)


def _double_counted(prob, n, reads, s, want, src_of) -> float:
    """What the per-read costing of candidate ``s`` counts twice (one value read twice in one
    layout is converted once)."""
    seen, extra = set(), 0.0
    ins = n.cands[s][0]
    for k, i in reads:
        tau = ins[i]
        if (k, tau) in seen and want[k].get(tau, 0) <= 0:
            extra += prob.edge(prob.values[k], src_of(k), tau)
        seen.add((k, tau))
    return extra


def _reads(n: Node, reads: list[tuple], s: int) -> set:
    """(value, layout) pairs node ``n`` reads under candidate ``s`` (each pair once)."""
    ins = n.cands[s][0]
    return {(k, ins[i]) for k, i in reads}


# -------------------------------------------------------------------------------------------
# graph reduction: a pairwise model, reduced OneFlow-style, then solved
# -------------------------------------------------------------------------------------------


class _Pairwise:
    """The problem as a pairwise cost graph: a unary cost vector per node and a cost matrix per
    edge. A value read by one equation is an edge from its producer to its reader; a value read
    by several (or by a fixed target that shares conversions) gets a *hub* node whose label is the
    layout it is distributed in: the producer pays for converting to it once, each reader for
    converting from it (nothing when it reads the hub's layout). That is the conversion cache's
    sharing in pairwise form (converting back from the hub, usually B, is usually free; where the
    model is off, ``descend`` on the exact objective corrects it)."""

    def __init__(self, prob: Problem):
        self.unary: list[np.ndarray] = []
        self.adj: list[dict] = []  # node -> {neighbour: cost matrix, rows = this node's labels}
        self.n_eqn = len(prob.nodes)
        for n in prob.nodes:
            self._node(n.cost.astype(float).copy())
        for val in prob.values.values():
            self._value(prob, val)

    def _node(self, unary) -> int:
        self.unary.append(unary)
        self.adj.append({})
        return len(self.unary) - 1

    def edge(self, a, b, m):
        """Add cost matrix ``m`` (rows: ``a``'s labels) between ``a`` and ``b`` (parallel edges merge)."""
        if a == b:
            self.unary[a] += np.diagonal(m)
            return
        old = self.adj[a].get(b)
        if old is not None:
            m = old + m
        self.adj[a][b] = m
        self.adj[b][a] = m.T

    def _value(self, prob: Problem, val: Value):
        nodes = prob.nodes
        readers = [(u, i) for u, i in val.uses]
        if val.producer is not None:
            u, j = val.producer
            src = [outs[j] for _, outs in nodes[u].cands]
            for t in val.own:  # conversions of its own (outputs, loop operands)
                self.unary[u] += np.array([prob.edge(val, s, t) for s in src])
        else:
            src = None
        if not readers and not val.shared:
            return
        if len(readers) == 1 and not val.shared:
            f, i = readers[0]
            dst = [ins[i] for ins, _ in nodes[f].cands]
            if src is None:
                self.unary[f] += np.array([prob.edge(val, val.nd, d) for d in dst])
            else:
                self.edge(val.producer[0], f, _matrix(prob, val, src, dst))
            return
        labels = list(
            dict.fromkeys(
                [val.nd]
                if src is None
                else src + [ins[i] for f, i in readers for ins, _ in nodes[f].cands]
            )
        )
        labels += [t for t in val.shared if t not in labels]
        hub_cost = np.array([float(sum(prob.edge(val, h, t) for t in val.shared)) for h in labels])
        if src is None:
            hub_cost += np.array([prob.edge(val, val.nd, h) for h in labels])
        hub = self._node(hub_cost)
        if src is not None:
            self.edge(val.producer[0], hub, _matrix(prob, val, src, labels))
        for f, i in readers:
            self.edge(hub, f, _matrix(prob, val, labels, [ins[i] for ins, _ in nodes[f].cands]))

    def solve(self, start: list[int] | None = None) -> list[int]:
        """A label per node: nodes of degree at most two are eliminated (a leaf folds its best
        answer into its neighbour's costs; a node between two others becomes one edge holding the
        best middle label for each pair, merged with any edge already there), repeatedly; what
        is left is solved by ``_icm`` from ``start``; the eliminated nodes are then read back."""
        unary, adj = self.unary, self.adj
        n = len(unary)
        label = [0] * n
        if start is not None:  # the hubs' best labels for the start's equations
            label[: self.n_eqn] = start
            _icm(unary, adj, range(self.n_eqn, n), label, sweeps=1)
        alive = [True] * n
        undo = []
        stack = [u for u in range(n) if len(adj[u]) <= 2]
        while stack:
            u = stack.pop()
            if not alive[u] or len(adj[u]) > 2:
                continue
            nb = list(adj[u])
            alive[u] = False
            if not nb:
                undo.append((u, ()))
            elif len(nb) == 1:
                (a,) = nb
                m = adj[a].pop(u) + unary[u][None, :]
                del adj[u][a]
                unary[a] = unary[a] + m.min(axis=1)
                undo.append((u, (a,), m.argmin(axis=1)))
                stack.append(a)
            else:
                a, b = nb
                ma, mb = adj[a].pop(u), adj[u].pop(b)  # (|a|, |u|), (|u|, |b|)
                del adj[u][a], adj[b][u]
                m3 = ma[:, :, None] + unary[u][None, :, None] + mb[None, :, :]
                arg = m3.argmin(axis=1)
                self.edge(a, b, np.take_along_axis(m3, arg[:, None, :], axis=1)[:, 0, :])
                undo.append((u, (a, b), arg))
                stack += [a, b]
        core = [u for u in range(n) if alive[u]]
        if start is None:
            for u in core:
                label[u] = int(np.argmin(unary[u]))
        _icm(unary, adj, core, label)
        for entry in reversed(undo):
            u, nb = entry[0], entry[1]
            if not nb:
                label[u] = int(np.argmin(unary[u]))
            elif len(nb) == 1:
                label[u] = int(entry[2][label[nb[0]]])
            else:
                label[u] = int(entry[2][label[nb[0]], label[nb[1]]])
        return label[: self.n_eqn]


def _matrix(prob, val, src, dst) -> np.ndarray:
    """Edge costs between candidate lists by their layouts (each distinct pair costed once)."""
    su, du = tuple(dict.fromkeys(src)), tuple(dict.fromkeys(dst))
    key = (val.shape, val.itemsize, val.anchored, su, du)
    small = prob._cost_cache.get(key)
    if (
        small is None
    ):  # unweighted (``Problem.edge`` of a value of weight 1), shared by every weight
        one = val if val.weight == 1.0 else dataclasses.replace(val, weight=1.0)
        table, rows = prob.table(one), []
        for a in su:
            row = []
            for b in du:
                hit = 0.0 if a == b else table.get((a, b))
                row.append(prob.edge(one, a, b) if hit is None else hit)
            rows.append(row)
        small = prob._cost_cache[key] = np.array(rows)
    si = {x: i for i, x in enumerate(su)}
    di = {x: i for i, x in enumerate(du)}
    m = small[np.array([si[x] for x in src])][:, np.array([di[x] for x in dst])]
    return m if val.weight == 1.0 else m * val.weight


def _icm(unary, adj, core, label, sweeps: int = 20):
    """Iterated conditional modes on the pairwise model, over the nodes in ``core``."""
    for sweep in range(sweeps):
        changed = False
        for u in core if sweep % 2 == 0 else reversed(core):
            cost = unary[u].copy()
            for b, m in adj[u].items():
                cost += m[:, label[b]]
            best = int(np.argmin(cost))
            if cost[best] < cost[label[u]] - 1e-6:
                label[u] = best
                changed = True
        if not changed:
            break


# -------------------------------------------------------------------------------------------
# repeated layers: one node per role
# -------------------------------------------------------------------------------------------

ROLE_ROUNDS = 3
"""Rounds of colour refinement behind ``roles``: two equations share a role when they look alike
this many producer / reader steps around them (the same block of an unrolled model, away from
its first and last copies)."""

QUOTIENT_MAX_FRACTION = 0.5
"""``solve`` solves the problem of roles (``quotient``) when it has at most this fraction of the
nodes: a model with repeated layers."""


def roles(prob: Problem, rounds: int = ROLE_ROUNDS) -> list[int]:
    """A role per node (colour refinement, as in the Weisfeiler-Lehman test): nodes start
    coloured by their candidate list and the fixed layouts they read; each round a node's colour
    is refined by its producers' colours and its readers' (with operand / result positions). The
    copies of a repeated block get one colour per node, but for those within ``rounds`` steps of
    something different (the first and last copies)."""
    nodes, values = prob.nodes, prob.values

    def fixed(k):
        val = values[k]
        return (
            val.nd,
            val.shape,
            val.itemsize,
            val.anchored,
            tuple(val.own),
            tuple(sorted(map(repr, val.shared))),
        )

    intern: dict = {}
    colour = []
    for n in nodes:
        ops = tuple(
            None if k is None else ("in", values[k].producer is None and fixed(k))
            for k in n.operands
        )
        outs = tuple(
            None if k is None else (tuple(values[k].own), len(values[k].shared)) for k in n.outputs
        )
        colour.append(intern.setdefault((n.kind, ops, outs), len(intern)))
    for _ in range(rounds):
        intern = {}
        new = []
        for n, c in zip(nodes, colour):
            ins = tuple(
                None
                if k is None or values[k].producer is None
                else (colour[values[k].producer[0]], values[k].producer[1])
                for k in n.operands
            )
            outs = tuple(
                None if k is None else tuple(sorted((colour[f], i) for f, i in values[k].uses))
                for k in n.outputs
            )
            new.append(intern.setdefault((c, ins, outs), len(intern)))
        done = len(intern) == len(set(colour))
        colour = new
        if done:
            break
    return colour


def quotient(prob: Problem, role: list[int]) -> tuple[Problem, list[int], list[int]]:
    """The problem of roles: one node per role (its candidates, the members' compute costs
    summed) and one value per role of value: the values its members make at one result position
    (their weights summed are its ``Value.weight``), or the fixed values (parameters) of one shape and
    layout read at the same positions of the same roles. A value of roles is read wherever any
    of its members is (so one block's input, the previous block's output, is a node's own
    result in the problem of roles); a node reads, at each position, what most of its members
    read there. Returns the problem, every node's role index and every role's middle member.

    Copied to its members, a choice per role is a choice for ``prob`` (``objective`` costs it
    exactly); the problem of roles is near it, not equal (the first and last copies of a block
    read and feed other roles), so its answers are proposals."""
    index: dict = {}
    members: list[list[int]] = []
    of = []
    for u, c in enumerate(role):
        r = index.get(c)
        if r is None:
            r = index[c] = len(members)
            members.append([])
        members[r].append(u)
        of.append(r)
    nodes, values = prob.nodes, prob.values

    def role_of_value(val):
        if val.producer is None:
            return (
                "fixed",
                val.nd,
                val.shape,
                val.itemsize,
                val.anchored,
                tuple(val.own),
                frozenset(val.shared),
                frozenset((of[f], i) for f, i in val.uses),
            )
        return ("made", of[val.producer[0]], val.producer[1])

    qvalues: dict = {}
    vrole: dict = {}
    for k, val in values.items():
        if val.producer is None and not val.uses:
            continue
        qk = vrole[k] = role_of_value(val)
        qv = qvalues.get(qk)
        if qv is None:
            qv = qvalues[qk] = dataclasses.replace(
                val,
                producer=None if val.producer is None else qk[1:],
                uses=set(),
                shared=set(val.shared),
                own=list(val.own),
                weight=0.0,
                costs=val.costs,
            )
        qv.weight += val.weight
        qv.uses.update((of[f], i) for f, i in val.uses)
    for qv in qvalues.values():
        qv.uses = sorted(qv.uses)
    rep = [ms[len(ms) // 2] for ms in members]
    qnodes = []
    for r, ms in enumerate(members):
        n = nodes[rep[r]]
        cost = np.sum([nodes[u].cost for u in ms], axis=0)
        operands = [
            None
            if k is None
            else Counter(vrole[nodes[u].operands[i]] for u in ms).most_common(1)[0][0]
            for i, k in enumerate(n.operands)
        ]
        outputs = [None if k is None else ("made", r, j) for j, k in enumerate(n.outputs)]
        qnodes.append(Node(n.eqn, n.cands, operands, outputs, cost, kind=n.kind))
    return Problem(prob.hierarchy, qnodes, qvalues, prob._cost_cache), of, rep


# -------------------------------------------------------------------------------------------
# driver
# -------------------------------------------------------------------------------------------


def search(
    placement,
    jaxpr,
    consts,
    in_layouts,
    out_nd=None,
    strict=False,
    cache=None,
    all_plans=False,
    weights=None,
):
    """The globally planned ``Program`` of ``jaxpr`` (``_compiler.infer``'s planner when
    ``JSBP_PLANNER=global``); the arguments are ``_compiler._search``'s.

    The search's plan and the forward pass that made it (``_search_pass``) are the reference:
    the pass recorded every top-scope equation with its candidates, and ``build`` makes the
    problem from them, loop and ``cond`` bodies inlined. The problem is solved from the search's
    choice (``solve``; ``STICKY_BYTES`` on every other candidate), and a new forward pass follows
    the decisions (``_Inference.fixed`` / ``hubs``). Where the chosen layouts change which
    equations exist (an ``argmax`` over a dim that is now split is decomposed, an inlined call's
    rule looks at other layouts) that pass decides those equations itself, and the next round
    (at most ``ROUNDS``) plans again from it.

    Returns, among the search's plan and each round's plan that costs no more than it by
    ``program_cost`` (loop bodies once per iteration), the cheapest by ``combined_cost``; ties:
    the search's, then the earlier round's. ``all_plans``: every plan made instead, the search's
    first, unranked (``_repeat`` ranks them for the whole program a reduced one stands for);
    ``weights``: how many equations of that whole program each equation stands for (``build``)."""
    from ._compiler import _Inference, _search_pass, program_cost

    args = (jaxpr, consts, in_layouts, out_nd)
    prog, inf = _search_pass(placement, *args, strict=strict, cache=cache)
    plans = [(program_cost(prog, loops=True), 0, prog)]  # the starting plan is kept only if cheaper
    for r in range(1, ROUNDS + 1):
        prob = build(inf, prog, jaxpr, out_nd, weights)
        start = _choice_of(prob, prog)
        for n, c in zip(prob.nodes, start):  # ``STICKY_BYTES`` for leaving the search's choice
            n.cost = n.cost + STICKY_BYTES
            n.cost[c] -= STICKY_BYTES
        choice = solve(prob, start)
        fixed, hubs = decisions(prob, choice)
        if (
            choice == start
            and not hubs
            and not any(isinstance(f, (LoopPlan, CondPlan)) for f in fixed.values())
        ):
            break  # the search's plan is the best found
        nxt = _Inference(placement, None, inf.cands_cache, strict=strict, copies=inf.copies)
        nxt.fixed, nxt.hubs = fixed, hubs
        new = nxt.program(*args)
        new.hubs = hubs
        plans.append((program_cost(new, loops=True), -r, new))
        if len(nxt.followed) == len(fixed):
            break  # every decision was followed: another round would solve the same problem
        inf, prog = nxt, new
    if all_plans:
        return [p[2] for p in plans]
    # no costlier than the search's plan by ``program_cost``; among those, the cheapest once
    # combined collectives are counted once (``combined_cost``); ties: the search's plan
    ok = [p for p in plans if p[0] <= plans[0][0]]
    if len(ok) == 1:
        return ok[0][2]  # (``infer`` combines its collectives next, as ``combined_cost`` would)
    return min(ok, key=lambda p: (combined_cost(p[2], loops=True), p[0], -p[1]))[2]


def combined_cost(prog, loops: bool = False) -> float:
    """``program_cost`` of ``prog`` as it will run: after ``_reduce_before_transposes`` and
    ``combine_collectives`` (which ``infer`` applies anyway; both idempotent), a combined
    collective pays its latency once for all its members (``loops``: a loop body's boxings
    once per iteration, ``_compiler.boxings_of``).

    ``program_cost`` (and the objective) charge every collective a latency, but ``_combine`` runs
    the gradients' all-reduces and reduce-scatters and ZeRO-3's parameter all-gathers as a few
    combined collectives. Ranked by ``program_cost`` alone, a plan that trades those for fewer,
    uncombinable collectives of activations (the weight gradients computed whole on every
    device) wins, though it runs more collectives and moves more bytes. (The objective does not
    discount combinable conversions: which conversions combine is known only once the plan is
    made, and a discount made the solver propose plans that ``program_cost`` then rejected.)
    Mutates ``prog`` as ``infer`` would; pass a copy to leave it alone."""
    from ._compiler import _reduce_before_transposes, boxings_of, combine_collectives

    _reduce_before_transposes(prog)
    combine_collectives(prog)
    total, groups = 0.0, set()
    for bx, times in boxings_of(prog, loops):
        if bx.reused:
            continue
        for m in bx.moves:
            total += times * m.bytes_per_device
            if m.collective and (bx.group is None or bx.group not in groups):
                total += times * COLLECTIVE_LATENCY_BYTES
        if bx.group is not None:
            groups.add(bx.group)
    return total


def _choice_of(prob: Problem, prog) -> list[int]:
    """The candidate ``prog`` chose for each node of ``prob`` (built from ``prog``)."""
    from ._compiler import iter_steps

    sigs = {}
    for _, st in iter_steps(prog):
        sigs[id(st.eqn)] = (
            tuple(l.nd_sbp for l in st.in_layouts),
            tuple(l.nd_sbp for l in st.out_layouts),
        )
    return [
        prob.preset[u] if u in prob.preset else n.cands.index(sigs[id(n.eqn)])
        for u, n in enumerate(prob.nodes)
    ]


ROUNDS = 2
"""Plan / forward-pass rounds (a second one only when the first pass could not follow a decision)."""


def solve(prob: Problem, start: list[int]) -> list[int]:
    """The best choice found (by ``objective``; the start when nothing beats it): the problem
    solved directly (``_solve_direct``: exactly where small, else by graph reduction) or, for a
    program with repeated layers too large for the exact solver, its problem of roles (``roles``,
    ``quotient``: each repeated block once) solved so and the answer copied to every copy. The
    problem of roles does not grow with the model's depth; solving the whole problem does."""
    best, best_obj = start, objective(prob, start)
    proposals = []
    # only where the exact solver cannot take the whole problem
    role = roles(prob) if not _exact_fits(prob) else ()
    if role and len(set(role)) <= QUOTIENT_MAX_FRACTION * len(prob.nodes):
        q, of, rep = quotient(prob, role)
        got = _solve_direct(q, [start[u] for u in rep])
        proposals.append([got[r] for r in of])
    else:
        proposals.append(_solve_direct(prob, start))
    for sol in proposals:
        obj = objective(prob, sol)
        if obj < best_obj - 1e-6:
            best, best_obj = sol, obj
    return best


AXIS_SWEEPS = 1
"""Sweeps of ``by_axis`` over the placement's axes at most. More sweeps go on until each axis is
optimal given the others; one, because each sweep is one HiGHS solve per axis of a sub-problem
as large as the program, and on ``benchmarks/planner.py``'s programs a second sweep never found
a cheaper plan."""


def restrict(prob: Problem, keep: list[list[int]], values: dict | None = None) -> Problem:
    """``prob`` with node ``u`` offered only its candidates ``keep[u]`` (a choice of the result maps
    back through ``keep``); ``values``: other values (fixed layouts, targets) in place of ``prob``'s."""
    nodes = [
        dataclasses.replace(
            n, cands=[n.cands[s] for s in ks], cost=n.cost[ks], kind=(n.kind, tuple(ks))
        )
        for n, ks in zip(prob.nodes, keep)
    ]  # (equal kinds: equal candidate lists, as in ``build``)
    return Problem(
        prob.hierarchy, nodes, prob.values if values is None else values, prob._cost_cache
    )


def by_axis(prob: Problem, start: list[int], sweeps: int = AXIS_SWEEPS) -> list[int]:
    """Block coordinate descent over the placement's axes: in turn for each axis, the signature
    of every node *on that axis* is chosen exactly (``solve_ilp``), its signature on the other
    axes held; for ``sweeps`` sweeps over the axes, or until one changes nothing. Each step is
    as large as the whole program, unlike ``descend``'s one node at a time, and each sub-problem
    has about the square root of the candidates of the whole (which the exact solver cannot
    take on a 2-d placement: a GPT block's step has 795 292 LP variables). A sub-problem with
    more than ``ILP_MAX_VARS`` candidates, or whose linear relaxation is fractional
    (``solve_ilp``'s ``quick``), is skipped. Returns a choice whose ``objective`` (without hubs)
    is no higher than ``start``'s.

    The axis with the most devices goes first (ties: the later axis, on a placement written
    (data, model) the model axis). Swept until nothing changes, any order ends where each axis
    is optimal given the others, but not always at the same plan nor after as many solves; this
    order reaches the data-times-model GPT steps' plans in the fewest solves. With one sweep
    (``AXIS_SWEEPS``) a 2-d placement takes two solves."""
    ndim = len(prob.hierarchy)
    # per node, per axis: each candidate's signature on every other axis (what a step holds)
    held = []
    for n in prob.nodes:
        parts = [
            [(tuple(nd[a] for nd in ins), tuple(nd[a] for nd in outs)) for ins, outs in n.cands]
            for a in range(ndim)
        ]
        held.append([list(zip(*(parts[b] for b in range(ndim) if b != a))) for a in range(ndim)])
    choice, obj = list(start), objective(prob, start, hubs=False)
    settled: set = set()  # axes whose sub-problem the current choice solves
    order = sorted(range(ndim), key=lambda a: (-prob.hierarchy[a], -a))
    for step in range(sweeps * ndim):
        axis = order[step % ndim]
        if len(settled) == ndim:
            break
        if axis in settled:
            continue
        settled.add(axis)
        keep = [
            [s for s, h in enumerate(hs[axis]) if h == hs[axis][c]] for hs, c in zip(held, choice)
        ]
        sub = restrict(prob, keep)
        if not _exact_fits(sub):
            continue
        got = solve_ilp(sub, quick=True)
        if got is None:
            continue
        new = [ks[g] for ks, g in zip(keep, got)]
        new_obj = objective(prob, new, hubs=False)
        if new_obj < obj - 1e-6:
            choice, obj, settled = new, new_obj, {axis}
    return choice


DESCEND_MAX_NODES = 4000
"""``_solve_direct`` polishes with ``descend`` up to this many nodes; beyond, graph reduction alone
(on deep models it found the better plans, and descent costs a second a pass there)."""


def _exact_fits(prob: Problem) -> bool:
    """Whether the exact solver takes the whole problem (at most ``ILP_MAX_VARS`` candidates)."""
    return sum(len(n.cands) for n in prob.nodes) <= ILP_MAX_VARS


def _solve_direct(prob: Problem, start: list[int]) -> list[int]:
    """The best choice found for ``prob`` itself (no problem of roles); ``start`` when nothing
    beats it by ``objective``.

    * Small enough for the exact solver (``_exact_fits``): ``solve_ilp``'s answer, final where
      it has one (descent and graph reduction never improved an exact answer on the benchmark's
      programs).
    * Too large, on a placement of two or more axes: exact one placement axis at a time
      (``by_axis``) from ``start``, and graph reduction (``_Pairwise``) only where ``by_axis``
      improved nothing; neither is polished by descent (on the benchmark's programs that never
      made a plan cheaper, at up to a second a pass).
    * Otherwise (a 1-d placement, or the exact solver had no answer): graph reduction; up to
      ``DESCEND_MAX_NODES`` nodes also descent (``descend``) from ``start`` and from each
      answer."""
    small = prob.nodes and _exact_fits(prob)
    if small and (got := solve_ilp(prob, incumbent=objective(prob, start, hubs=False))) is not None:
        return got if objective(prob, got) < objective(prob, start) - 1e-6 else start
    axes = (
        not small and prob.nodes and len(prob.hierarchy) >= 2
    )  # too large for the exact solver: exact by axis
    polish = len(prob.nodes) <= DESCEND_MAX_NODES and not axes
    best = descend(prob, start) if polish else start
    best_obj = objective(prob, best)
    reduce = lambda: _Pairwise(prob).solve(start)  # noqa: E731
    if axes:  # (``best`` is the start here, until a try beats it)
        tries = [lambda: by_axis(prob, start), lambda: reduce() if best == start else None]
    else:
        tries = [reduce]
    for make in tries:
        got = make()
        if got is None:
            continue
        for sol in (
            (got, descend(prob, got)) if polish else (got,)
        ):  # (``descend`` does not see hubs: keep both)
            obj = objective(prob, sol)
            if obj < best_obj - 1e-6:
                best, best_obj = sol, obj
    return best
