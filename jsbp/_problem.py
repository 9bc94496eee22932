"""The planning problem of a program, built from its jaxpr and the rule registry.

* **nodes**: one per equation that has a choice: a primitive (its candidates: the rule's legal nd
  signatures on the placement, ``legal_signatures``, but those reading a partial value that no
  operand read so can be made as, ``_reads_made``) or a layout request (``to_global``,
  ``reshard``, ``with_sharding_constraint``: its candidates are the layouts the request allows).
  Calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``remat`` ...) are inlined, and so
  is a ``custom_linear_solve``'s ``solve`` jaxpr.
* **values**: one per variable of the inlined program; a value's layout is its producer's chosen
  output nd-sbp, or fixed (a program input or constant: the layout it arrives in; a literal: B).
* **loops and branches**: a ``scan``'s or ``while``'s body and a ``cond``'s branches are part of
  the problem (their values and work counted once per iteration); their boundary is *hold* nodes,
  whose candidates are the layouts a loop keeps a constant, a carry (read on entry and given back
  by the body in one layout) or a scanned input / output in; a carry's hold also gives the loop's
  result, a value of the loop's scope.
* **repeats**: the copies of a repeated stretch of nodes (``repeats``: unrolled layers), which the
  solver ties to the first copy.
* **costs**, from one ``CostModel`` (``_cost``): converting a value to a layout its readers need
  costs the boxing planner's bytes per device plus ``latency_bytes`` per collective, once per
  (value, layout) however many readers share it; a *deferrable* value's conversion (run with
  others' before what waits for it: the program's end, a loop's entry, or the contractions its
  siblings reach too: ``_combine.deferrable``) that is one combinable collective
  (``Problem.joins``) runs combined, one latency per combined collective; a value needed in
  several layouts may reach them through one of them (``Problem.spread``); a node costs the work
  a device does under its candidate (FLOPs of a contraction, one per output element otherwise)
  at the model's rates; an output asked for in a layout (``out_sbp``) pays its conversion.

``Problem.cost(choice)`` is the objective of an assignment (one candidate per node);
``_solve`` minimises it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
from jax.extend import core as jcore

from . import _sbp
from ._boxing import combined_collective, conversion_cost, on_devices, widening
from ._combine import deferrable
from ._cost import DEFAULT_COST, CostModel, itemsize
from ._errors import SbpError
from ._layout import layout_of
from ._program import WHILE_TRIPS, scan_counts, solve_reads
from .rules import _registry
from .rules._registry import RuleContext

B = _sbp.broadcast

CALLS = frozenset(
    "jit pjit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr remat "
    "checkpoint custom_lin".split()
)
"""Call-like primitives: their jaxpr is inlined into the caller's problem."""

REQUESTS = frozenset({"jsbp_to_global", "reshard", "sharding_constraint"})
"""Layout requests: the value is boxed to the layout asked for (an identity on local shards)."""


# -------------------------------------------------------------------------------------------
# candidate signatures
# -------------------------------------------------------------------------------------------


def one_partial_kind(nd) -> bool:
    """An nd-sbp may not mix partial kinds (partial_sum on one axis, partial_max on another)."""
    return len({x.reduce for x in nd if x.is_partial}) <= 1


def _in_rank(x, rank) -> bool:
    return (not x.is_split) or 0 <= x.dim < rank


def _norm_sig(sig):
    ins, outs = sig
    return tuple(ins), (outs,) if isinstance(outs, _sbp.Sbp) else tuple(outs)


def legal_signatures(placement, rule, eqn, cur=()) -> list[tuple[tuple, tuple]]:
    """The nd signatures ``rule`` offers for ``eqn`` on ``placement`` (per-axis rules expanded over
    the axes), normalised to tuples, without those that split a missing dim or mix partial kinds;
    on an axis of one device, B (``on_devices``: S and P over one device are B there)."""
    h = placement.hierarchy
    held = tuple if 1 not in h else (lambda nds: tuple(on_devices(nd, h) for nd in nds))
    ctx = RuleContext(
        eqn.primitive,
        dict(eqn.params),
        tuple(v.aval for v in eqn.invars),
        tuple(v.aval for v in eqn.outvars),
        placement.hierarchy,
        cur,
    )
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    ranks = [len(v.aval.shape) for v in eqn.invars] + [len(v.aval.shape) for v in eqn.outvars]

    def arity(ins, outs):
        if len(ins) != n_in or len(outs) != n_out:
            raise SbpError(
                f"SBP rule for '{eqn.primitive.name}' returned a signature of the wrong arity: {ins} -> {outs}."
            )

    if rule.nd:
        legal = []
        for sig in rule.signatures(ctx):
            ins, outs = _norm_sig(sig)
            arity(ins, outs)
            nds = [tuple(nd) for nd in (*ins, *outs)]
            if all(
                one_partial_kind(nd) and all(_in_rank(x, r) for x in nd)
                for nd, r in zip(nds, ranks)
            ):
                legal.append((held(nds[:n_in]), held(nds[n_in:])))
        return list(dict.fromkeys(legal))
    per_axis = []
    for sig in dict.fromkeys(_norm_sig(s) for s in rule.signatures(ctx)):
        arity(*sig)
        if all(_in_rank(x, r) for x, r in zip((*sig[0], *sig[1]), ranks)):
            per_axis.append(sig)
    legal = []
    for combo in itertools.product(per_axis, repeat=placement.ndim):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(n_in))
        outs = tuple(tuple(c[1][i] for c in combo) for i in range(n_out))
        if all(one_partial_kind(nd) for nd in (*ins, *outs)):
            legal.append((held(ins), held(outs)))
    return list(dict.fromkeys(legal))


@functools.lru_cache(maxsize=4096)
def _partials(nd, zero_fill: bool = False) -> frozenset:
    """The (axis, reduction) pairs on which ``nd`` is a partial value; with ``zero_fill`` also a
    sum on each axis it splits (its piece zero-filled around: partial without moving data)."""
    return frozenset(
        (a, "sum" if x.is_split else x.reduce)
        for a, x in enumerate(nd)
        if x.is_partial or (zero_fill and x.is_split)
    )


def _reads_made(ins, made) -> bool:
    """Whether a candidate reading its operands as ``ins`` reads each partial value (an axis and
    reduction) as an operand that can be made so (``made``: per operand, ``_partials`` with
    ``zero_fill`` of the layouts its producer can make it in). Otherwise every operand read so
    would be replicated and made partial only to be reduced later, where reading it replicated
    computes as much for less: the candidate is left out."""
    need, have = set(), set()
    for nd, m in zip(ins, made):
        p = _partials(nd)
        need |= p
        have |= p & m
    return need <= have


def layouts(shape, ndim: int) -> list[tuple]:
    """Every nd-sbp of a tensor of ``shape`` on ``ndim`` placement axes (S of each dim, B, P)."""
    per_axis = [_sbp.split(d) for d in range(len(shape))] + [B, _sbp.partial_sum]
    return [nd for nd in itertools.product(per_axis, repeat=ndim)]


# -------------------------------------------------------------------------------------------
# the problem
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Value:
    """One variable of the inlined program."""

    aval: object
    nd: tuple | None = None  # a fixed layout (program input, constant, literal)
    producer: tuple | None = None  # (node, output index)
    uses: list = dataclasses.field(default_factory=list)  # (node, operand index)
    wants: list = dataclasses.field(default_factory=list)  # layouts asked of it as a program output
    times: float = 1.0  # runs per step of its scope (a loop body's value: the trip count)
    deferrable: bool = False  # its collectives run combined with the others' (``deferrable``)
    batch: tuple = ()  # which combined collectives (``deferrable``, ``_solve._waits``)

    @property
    def shape(self) -> tuple:
        return tuple(self.aval.shape)


@dataclasses.dataclass(eq=False)
class Node:
    """One equation with a choice: its candidate signatures and the work each costs."""

    eqn: object
    cands: list  # [(in nd-sbps, out nd-sbps)]
    operands: list  # per operand: Value, or None for a literal
    outputs: list  # per output: Value, or None for a dropped result
    compute: np.ndarray  # per candidate, in byte-equivalents
    rule: object = None
    kind: str = "prim"  # prim | annotate | hold (a loop's or branch's boundary: no equation)
    # candidate index -> (jaxpr, consts): a candidate run as its own small program (``_rewrite``)
    local: dict = dataclasses.field(default_factory=dict)
    nested: bool = False  # inside a call's program (its conversions run there, never combined)
    entry: int | None = None  # a loop's or branch's input: the loop's first such node


@dataclasses.dataclass(eq=False)
class Problem:
    placement: object
    model: CostModel
    nodes: list
    values: list
    invars: list  # the program's inputs, as Values
    outvars: list  # the program's outputs, as Values (a literal output: a Value with nd B)
    alias: dict  # variable of the inlined program -> its Value
    # the program's structure for lowering: per equation ("node", index) or ("call", equation,
    # inlined jaxpr with fresh variables, its constants, its own structure)
    structure: list = dataclasses.field(default_factory=list, repr=False)
    cache: dict = dataclasses.field(default_factory=dict, repr=False)  # the solver's tables

    # how ``conversion`` prices a deferrable value's conversion that joins a combined collective
    # (the solver's estimate of sharing its latency; ``cost`` counts one latency per combined
    # collective): (key, part) pairs, a key a combined collective (kind, axes, *batch) or a
    # ``Value.batch``, the part of a latency a member pays there (the collective's part, else its
    # batch's, else a whole latency: joining a collective costs less than opening one); None: a
    # whole latency each
    joined: frozenset | None = None

    def conversion(self, val: Value, src: tuple, dst: tuple, share: float | None = None) -> float:
        """Boxing ``val`` from ``src`` to ``dst`` (``_boxing.conversion_cost``: bytes per device,
        ``latency_bytes`` per collective, ``op_bytes`` per move), ``val.times`` times; a
        deferrable value's conversion that joins a combined collective (``combined_collective``)
        pays ``share`` of its latency (default: as ``joined`` prices it)."""
        if src == dst:
            return 0.0
        latency = self.model.latency_bytes
        hier, size = self.placement.hierarchy, itemsize(val.aval.dtype)
        cost = conversion_cost(
            src, dst, val.shape, hier, size, latency, self.model.op_bytes, widening(val.aval.dtype)
        )
        if val.deferrable:
            pricing = self.pricing(share)
            for k in self.joins(val, src, dst):
                cost -= latency * (1.0 - latency_part(k, pricing))
        return val.times * cost

    def pricing(self, share: float | None = None) -> tuple:
        """The pricing of deferrable conversions ``latency_part`` reads: (``share``, None) where
        ``share`` is given, else (1, ``self.joined``)."""
        return (share, None) if share is not None else (1.0, self.joined)

    def layout(self, val: Value, choice) -> tuple:
        if val.producer is None:
            return val.nd
        u, j = val.producer
        return self.nodes[u].cands[choice[u]][1][j]

    def wanted(self, val: Value, choice) -> set:
        """The layouts ``val``'s readers (and the program's outputs) need it in under ``choice``."""
        out = {self.nodes[u].cands[choice[u]][0][i] for u, i in val.uses}
        out.update(val.wants)
        return out

    def spread(self, val: Value, src: tuple, wanted, share: float | None = None):
        """How ``val``, made in ``src``, reaches the layouts in ``wanted``, as the lowering runs
        it (``through_hub``): (its cost, the hub or None)."""
        want = [t for t in wanted if t != src]
        direct = np.array([self.conversion(val, src, t, share) for t in want])
        between = None
        if len(want) > 1:
            between = np.array([[self.conversion(val, h, t, share) for t in want] for h in want])
        cost, h = through_hub(direct, between)
        return cost, None if h is None else want[h]

    def value_cost(self, val: Value, choice, share: float | None = None) -> float:
        return self.spread(val, self.layout(val, choice), self.wanted(val, choice), share)[0]

    def groups(self, val: Value, choice, wanted=None) -> frozenset:
        """The combined collectives a deferrable ``val``'s conversions join: (kind, axes); to
        ``wanted`` (default: the layouts ``wanted`` gives)."""
        src = self.layout(val, choice)
        wanted = frozenset(self.wanted(val, choice) if wanted is None else wanted)
        key = ("groups", val.shape, val.aval.dtype, val.batch, src, wanted)  # values alike
        hit = self.cache.get(key)
        if hit is None:
            hit = self.cache[key] = frozenset(g for t in wanted for g in self.joins(val, src, t))
        return hit

    def joins(self, val: Value, src: tuple, dst: tuple) -> tuple:
        """The combined collective a deferrable ``val``'s conversion ``src -> dst`` joins, as a
        1-tuple (kind, axes, *``val.batch``), or ()."""
        if not val.deferrable:
            return ()
        hier, size = self.placement.hierarchy, itemsize(val.aval.dtype)
        return tuple(k + val.batch for k in combined_collective(src, dst, val.shape, hier, size))

    def cost(self, choice) -> float:
        """The objective of ``choice`` (one candidate index per node), as the program runs: work,
        conversions, and one latency per combined collective of the deferrable values."""
        total = sum(float(n.compute[c]) for n, c in zip(self.nodes, choice))
        groups, seen = set(), {}  # (values alike, made, wanted) -> their conversions' cost
        for v in self.values:
            src, wanted = self.layout(v, choice), frozenset(self.wanted(v, choice))
            key = (v.shape, v.aval.dtype, v.times, v.deferrable, src, wanted)
            if key not in seen:
                seen[key] = self.spread(v, src, wanted, 0.0)[0]
            total += seen[key]
            if v.deferrable:
                groups |= self.groups(v, choice, wanted)
        return total + self.model.latency_bytes * len(groups)


def latency_part(k, pricing: tuple) -> float:
    """The part of combined collective ``k``'s latency one member conversion pays under
    ``pricing`` (``Problem.pricing``): its share where nothing is joined, else its part where
    ``joined`` has ``k``, else its batch's part (``k[2:]``), else a whole latency."""
    share, joined = pricing
    if joined is None:
        return share
    parts = _parts(joined)
    return parts.get(k, parts.get(k[2:], 1.0))


@functools.lru_cache(maxsize=64)
def _parts(joined: frozenset) -> dict:
    """``Problem.joined`` as a dict: combined collective or batch -> the part of a latency a member
    pays."""
    return dict(joined)


def through_hub(direct: np.ndarray, between: np.ndarray | None) -> tuple[float, int | None]:
    """A value's conversions to the layouts it is needed in (none of them the one it is made
    in): each from the made layout (``direct[t]``), or first to one of them, the *hub* ``h``,
    and each other from whichever of the made layout and the hub is cheaper (``between[h, t]``,
    its diagonal zero: an all-reduce, then local slices). (the least cost, the hub's index or
    None)."""
    best, hub = float(direct.sum()), None
    if between is not None and len(direct) > 1:
        through = direct + np.minimum(direct[None, :], between).sum(1)
        h = int(through.argmin())
        if through[h] < best:
            best, hub = float(through[h]), h
    return best, hub


def flops(eqn) -> float:
    """Logical work of ``eqn``: multiply-adds of a contraction, else one per output element."""
    out = sum(math.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        shape = eqn.invars[0].aval.shape
        return 2.0 * out * math.prod(shape[d] for d in lc)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        dn = eqn.params["dimension_numbers"]
        out_feat = rhs[dn.rhs_spec[0]] if dn is not None else rhs[0]
        return 2.0 * out * math.prod(rhs) / max(out_feat, 1)
    return float(out)


def split_ways(cands, hierarchy) -> np.ndarray:
    """Per candidate: how many ways it divides the work, the product of the axes some operand or
    result is split on (on an axis where everything is B or P every device repeats the work)."""
    out = np.empty(len(cands))
    for n, (ins, outs) in enumerate(cands):
        ways = 1
        for a, size in enumerate(hierarchy):
            if any(nd[a].is_split for nd in (*ins, *outs)):
                ways *= size
        out[n] = ways
    return out


def _work(eqn, cands, hierarchy, model: CostModel) -> np.ndarray:
    """Per candidate: the time one device computes, in byte-equivalents (``link_bandwidth``
    bytes per second): a contraction's FLOPs at ``flop_rate``, another op's elements at
    ``mem_bandwidth`` (about 8 bytes read and written an element), divided as ``split_ways``."""
    heavy = eqn.primitive.name in ("dot_general", "conv_general_dilated")
    rate = model.flop_rate if heavy else model.mem_bandwidth / 8.0
    return flops(eqn) / rate * model.link_bandwidth / split_ways(cands, hierarchy)


def call_jaxpr(eqn):
    """The jaxpr and constants a call-like equation runs, or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(key)
        if isinstance(j, jcore.ClosedJaxpr):
            return j.jaxpr, list(j.consts)
        if isinstance(j, jcore.Jaxpr):
            return j, []
    return None


def is_call(eqn) -> bool:
    name = eqn.primitive.name
    return name in CALLS or (
        call_jaxpr(eqn) is not None
        and name not in _registry.registered()
        and name not in ("scan", "while", "cond", "custom_linear_solve")
    )


def build(
    placement,
    jaxpr,
    consts,
    in_layouts,
    out_nd=None,
    *,
    model: CostModel = DEFAULT_COST,
    strict: bool = False,
    local=None,
) -> Problem:
    """The problem of ``jaxpr`` on ``placement``: inputs in ``in_layouts`` (Layouts), outputs
    asked in ``out_nd`` (per output an nd-sbp or None). A loop's body is part of the problem, its
    values and work counted once per iteration (``WHILE_TRIPS`` for a ``while``), and its boundary
    is nodes whose candidates are the layouts the loop holds a value in (``_boundary``); a
    ``cond``'s branches likewise; a ``custom_linear_solve`` is a call of its ``solve`` jaxpr.
    ``local(jaxpr, consts, in_nd, out_nd)``: the cost of a small program with its layouts fixed,
    the price of the candidates ``_rewrite.rewrites`` offers (None: those are not offered)."""
    from ._interop import requested_nd
    from ._rewrite import rewrites

    hier = placement.hierarchy
    nodes: list[Node] = []
    values: list[Value] = []
    alias: dict = {}
    cands_memo: dict = {}
    reach_memo: dict = {}  # ``made``'s and ``kept``'s answers
    b = (B,) * placement.ndim
    calls = [0]  # how many call programs the walk is in

    def new_value(aval, nd=None, times=1.0) -> Value:
        val = Value(aval, nd=nd, times=times)
        values.append(val)
        return val

    def read(v, times=1.0) -> Value:
        if isinstance(v, jcore.Literal):
            return new_value(v.aval, b, times)
        return alias[v]

    def add_node(node: Node, out_avals, times) -> int:
        """Append ``node``, its reads recorded, and new values for its results (None: dropped)."""
        u = len(nodes)
        node.nested = calls[0] > 0
        for i, val in enumerate(node.operands):
            if val is not None:
                val.uses.append((u, i))
        for aval in out_avals:
            if aval is None:
                node.outputs.append(None)
                continue
            val = new_value(aval, times=times)
            val.producer = (u, len(node.outputs))
            node.outputs.append(val)
        nodes.append(node)
        return u

    def hold(operands, aval, times, make=None, keep=None, out_times=None) -> int:
        """A boundary node: the value(s) ``operands`` held in one layout ``L`` (every operand read in
        ``L``), giving a value of ``aval`` in ``make(L)`` (default ``L``) that lives ``times``
        times a step. ``keep(L)``: the layouts allowed (default all). ``out_times``: a loop's
        carry, also given as a second value, the loop's result, that lives ``out_times`` times
        (its readers after the loop convert it once per step of the loop's scope, not per trip)."""
        shape = tuple(operands[0].aval.shape)
        lays = [nd for nd in layouts(shape, placement.ndim) if keep is None or keep(nd)]
        n_out = 1 if out_times is None else 2
        cands = [((nd,) * len(operands), ((make or (lambda x: x))(nd),) * n_out) for nd in lays]
        u = add_node(
            Node(None, cands, list(operands), [], np.zeros(len(cands)), kind="hold"), [aval], times
        )
        if out_times is not None:
            val = new_value(aval, times=out_times)
            val.producer = (u, 1)
            nodes[u].outputs.append(val)
        return u

    def entry(us) -> None:
        """Mark the hold nodes ``us`` as one loop's (or branch's) inputs."""
        for u in us:
            nodes[u].entry = us[0]

    def scope(jx, consts, invals, times) -> list:
        """Walk ``jx`` (fresh variables) with its inputs as ``invals``; its structure."""
        for v, val in zip(jx.invars, invals):
            alias[v] = val
        sub: list = []
        walk(jx, consts, sub, times)
        return sub

    def outvals(jx, times) -> list:
        return [read(v, times) for v in jx.outvars]

    def give(eqn, vals) -> None:
        """``eqn``'s results are ``vals`` (one per result; a dropped one's is not kept)."""
        for o, val in zip(eqn.outvars, vals):
            if not isinstance(o, jcore.DropVar):
                alias[o] = val

    def control(eqn, ins, out, times):
        name, p = eqn.primitive.name, eqn.params
        if name == "scan":
            nc, nk = scan_counts(p)
            trips = times * p["length"]
            body, bconsts = fresh_vars(p["jaxpr"].jaxpr), p["jaxpr"].consts
            ks = [hold([x], x.aval, trips) for x in ins[:nc]]
            cs = [hold([x, None], x.aval, trips, out_times=times) for x in ins[nc : nc + nk]]
            xs = [
                hold(
                    [x],
                    bv.aval,
                    trips,
                    make=lambda nd: shift(nd, -1),
                    keep=lambda nd: split_not(nd, 0),
                )
                for x, bv in zip(ins[nc + nk :], body.invars[nc + nk :])
            ]
            entry(ks + cs + xs)
            invals = [nodes[u].outputs[0] for u in ks + cs + xs]
            sub = scope(body, bconsts, invals, trips)
            outs = outvals(body, trips)
            for u, val in zip(cs, outs[:nk]):
                nodes[u].operands[1] = val
                val.uses.append((u, 1))
            ys = [
                hold([val], o.aval, times, make=lambda nd: shift(nd, +1))
                for val, o in zip(outs[nk:], eqn.outvars[nk:])
            ]
            results = [nodes[u].outputs[1] for u in cs] + [nodes[u].outputs[0] for u in ys]
            out.append(("scan", eqn, body, bconsts, sub, ks, cs, xs, ys))
        elif name == "while":
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            trips = times * WHILE_TRIPS
            cj, bj = fresh_vars(p["cond_jaxpr"].jaxpr), fresh_vars(p["body_jaxpr"].jaxpr)
            cks = [hold([x], x.aval, trips) for x in ins[:cn]]
            bks = [hold([x], x.aval, trips) for x in ins[cn : cn + bn]]
            cs = [hold([x, None], x.aval, trips, out_times=times) for x in ins[cn + bn :]]
            entry(cks + bks + cs)
            carry = [nodes[u].outputs[0] for u in cs]
            csub = scope(
                cj, p["cond_jaxpr"].consts, [nodes[u].outputs[0] for u in cks] + carry, trips
            )
            (pred,) = outvals(cj, trips)
            pred.wants.append(b)
            bsub = scope(
                bj, p["body_jaxpr"].consts, [nodes[u].outputs[0] for u in bks] + carry, trips
            )
            for u, val in zip(cs, outvals(bj, trips)):
                nodes[u].operands[1] = val
                val.uses.append((u, 1))
            results = [nodes[u].outputs[1] for u in cs]
            out.append(("while", eqn, (cj, csub, cks), (bj, bsub, bks), cs))
        else:  # cond
            idx = hold([ins[0]], ins[0].aval, times, keep=lambda nd: nd == b)
            ops = [hold([x], x.aval, times) for x in ins[1:]]
            entry([idx] + ops)
            branches = []
            for closed in p["branches"]:
                bj = fresh_vars(closed.jaxpr)
                bsub = scope(bj, closed.consts, [nodes[u].outputs[0] for u in ops], times)
                branches.append((bj, closed.consts, bsub, outvals(bj, times)))
            rs = [
                hold([br[3][i] for br in branches], o.aval, times)
                for i, o in enumerate(eqn.outvars)
            ]
            results = [nodes[u].outputs[0] for u in rs]
            out.append(("cond", eqn, idx, ops, [br[:3] for br in branches], rs))
        give(eqn, results)

    def candidates(eqn):
        try:
            key = (
                eqn.primitive,
                tuple(sorted(eqn.params.items())),
                tuple(v.aval for v in eqn.invars),
                tuple(v.aval for v in eqn.outvars),
            )
            hash(key)
        except TypeError:
            key = eqn
        hit = cands_memo.get(key)
        if hit is None:
            rule = _registry._RULES.get(eqn.primitive.name)
            if rule is None:
                if strict:
                    shapes = ", ".join(f"{tuple(v.aval.shape)}" for v in eqn.invars)
                    _registry.get_rule(
                        eqn.primitive.name, op_desc=f" (operands of shape {shapes} on {placement})"
                    )
                rule = _registry.replicated_rule(eqn.primitive.name)
            cands = legal_signatures(placement, rule, eqn)
            if not cands:
                raise SbpError(
                    f"no legal SBP signature for '{eqn.primitive.name}' on {placement}; "
                    "box an operand with jsbp.to_global(..., sbp=...) to a layout the op supports."
                )
            work = _work(eqn, cands, hier, model)
            if rule.cost is not None:
                work = np.array(
                    [
                        model.local_seconds(rule.local_cost(eqn, placement, *c))
                        * model.link_bandwidth
                        for c in cands
                    ]
                )
            extra = rewrites(eqn, placement) if local is not None else []
            for in_nd, out_nd, jx, jx_consts in extra:
                cands.append(((in_nd,), (out_nd,)))
                work = np.append(work, local(jx, jx_consts, in_nd, out_nd))
            n_rule = len(cands) - len(extra)
            jaxprs = {n_rule + i: (jx, c) for i, (_, _, jx, c) in enumerate(extra)}
            hit = cands_memo[key] = (rule, cands, work, jaxprs)
        return hit

    def made(val) -> frozenset:
        """The partial values ``val`` can be made as (``_reads_made``): as its fixed layout, or as
        some candidate of its producer gives it."""
        if val.producer is None:
            return _partials(val.nd, True)
        u, j = val.producer
        key = (id(nodes[u].cands), j)
        if key not in reach_memo:
            reach_memo[key] = frozenset().union(*(_partials(c[1][j], True) for c in nodes[u].cands))
        return reach_memo[key]

    def kept(rule, cands, work, jaxprs, ins):
        """``candidates``' answer, less the candidates that read a partial value no operand can
        be made as (``_reads_made``; all kept where that would leave none); one list per list and
        operands' partials (equations alike share theirs, as ``repeats`` needs)."""
        ms = tuple(made(v) for v in ins)
        key = (id(cands), ms)
        if key not in reach_memo:
            keep = [n for n, c in enumerate(cands) if _reads_made(c[0], ms)]
            if 0 < len(keep) < len(cands):
                at = {n: k for k, n in enumerate(keep)}
                local = {at[n]: jx for n, jx in jaxprs.items() if n in at}
                cands, work, jaxprs = [cands[n] for n in keep], work[keep], local
            reach_memo[key] = (rule, cands, work, jaxprs)
        return reach_memo[key]

    def walk(jx, consts, out: list, times=1.0):
        for v in jx.constvars[: len(consts)]:
            alias[v] = new_value(v.aval, b, times)
        for eqn in jx.eqns:
            name = eqn.primitive.name
            ins = [read(v, times) for v in eqn.invars]
            if name == "custom_linear_solve":
                # its value is its ``solve`` jaxpr applied to the right-hand side: a call of that
                # jaxpr on the operands it reads (its constants and the right-hand side); JAX has
                # already written gradients' transposed solves as further such equations
                closed = eqn.params["jaxprs"].solve
                inner = fresh_vars(closed.jaxpr)
                sub = scope(inner, closed.consts, [ins[i] for i in solve_reads(eqn)], times)
                give(eqn, outvals(inner, times))
                out.append(("linear_solve", eqn, inner, closed.consts, sub))
                continue
            if name in ("scan", "while", "cond"):
                control(eqn, ins, out, times)
                continue
            if is_call(eqn):
                inner, inner_consts = call_jaxpr(eqn)
                inner = fresh_vars(inner)  # a helper traced once and called twice: two scopes
                calls[0] += 1
                sub = scope(inner, inner_consts, ins, times)
                calls[0] -= 1
                give(eqn, outvals(inner, times))
                out.append(("call", eqn, inner, inner_consts, sub))
                continue
            u = len(nodes)
            if name in REQUESTS:
                (x,) = ins
                shape = x.shape
                if name == "jsbp_to_global":
                    nd = eqn.params["nd"]
                    allowed = layouts(shape, placement.ndim) if nd is None else [tuple(nd)]
                else:
                    allowed = []
                    for lay in layouts(shape, placement.ndim):
                        req = requested_nd(eqn, layout_of(placement, lay, shape), placement)
                        allowed.append(lay if req is None else req)
                allowed = [
                    nd
                    for nd in dict.fromkeys(allowed)
                    if one_partial_kind(nd) and all(_in_rank(s, len(shape)) for s in nd)
                ]
                cands = [((nd,), (nd,)) for nd in allowed]
                node = Node(eqn, cands, [x], [], np.zeros(len(cands)), kind="annotate")
            else:
                rule, cands, work, jaxprs = kept(*candidates(eqn), ins)
                node = Node(eqn, cands, ins, [], work * times, rule=rule, local=jaxprs)
            add_node(
                node, [None if isinstance(o, jcore.DropVar) else o.aval for o in eqn.outvars], times
            )
            give(eqn, node.outputs)
            out.append(("node", u))

    invars = []
    for v, lay in zip(jaxpr.invars, in_layouts):
        alias[v] = val = new_value(v.aval, tuple(lay.nd_sbp))
        invars.append(val)
    structure: list = []
    walk(jaxpr, consts, structure)
    walk = None  # (recursive: a cycle that would hold every node until the next collection)
    outvars = [read(v) for v in jaxpr.outvars]
    for val, want in zip(outvars, out_nd or ()):
        if want is not None:
            val.wants.append(tuple(want))
    deferrable(nodes, values)
    return Problem(placement, model, nodes, values, invars, outvars, alias, structure=structure)


REPEAT_MIN_NODES = 16
"""Fewest nodes (equations with a choice) a repeated stretch's period may have for ``repeats`` to
tie its copies: a layer, not a few elementwise operations."""


def _token(node) -> tuple:
    """What ``repeats`` compares: the node's kind and candidates (equal for equations of one
    primitive, parameters and operand types: ``build`` gives them one list)."""
    return (node.kind, id(node.cands)) if node.kind == "prim" else (node.kind, tuple(node.cands))


def repeats(nodes, min_nodes: int = REPEAT_MIN_NODES) -> list[int]:
    """Per node the node it is a copy of (itself if none): the nodes of a stretch of the program
    that repeats a period of ``min_nodes`` or more nodes (an unrolled stack of layers, their
    gradients, an optimizer's update of each layer's parameters), node for node, are tied to the
    first copy, so that the solver chooses once for all copies. Periods are tried by how many
    nodes repeat the node that distance before them, most first (at least ``min_nodes``); a node
    tied once stays tied."""
    n = len(nodes)
    ids: dict = {}
    tok = np.array([ids.setdefault(_token(nd), len(ids)) for nd in nodes], dtype=np.int64)
    rep = np.arange(n)
    if n < 2 * min_nodes:
        return rep.tolist()
    last: dict = {}
    gaps: dict = {}
    for i, t in enumerate(tok.tolist()):
        if t in last and i - last[t] >= min_nodes:
            gaps[i - last[t]] = gaps.get(i - last[t], 0) + 1
        last[t] = i
    tied = np.zeros(n, dtype=bool)
    for p in sorted(gaps, key=lambda p: (-gaps[p], -p)):
        if gaps[p] < min_nodes:
            break
        same = tok[p:] == tok[:-p]  # same[i]: node i + p repeats node i
        edges = np.diff(np.concatenate([[0], same.astype(np.int8), [0]]))
        for s, e in zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)):
            if e - s < p:  # fewer than two copies
                continue
            for i in range(s + p, s + p + (e - s) // p * p):  # whole copies only
                if not tied[i]:
                    rep[i] = i - p
                    tied[i] = True
    for i in range(n):  # each to the first of its copies (rep[i] < i for a tied node)
        rep[i] = rep[rep[i]]
    return rep.tolist()


def shift(nd, delta):
    """``nd`` with every split dim moved by ``delta`` (a scanned value and its slice)."""
    return tuple(_sbp.split(x.dim + delta) if x.is_split else x for x in nd)


def split_not(nd, dim) -> bool:
    """Whether ``nd`` leaves ``dim`` whole (a scanned dim must be: each iteration reads a slice)."""
    return not any(x.is_split and x.dim == dim for x in nd)


def fresh_vars(jaxpr):
    """A copy of ``jaxpr`` with new variables (nested jaxprs, their own scopes, stay shared)."""
    new: dict = {}

    def var(v):
        if isinstance(v, jcore.Literal):
            return v
        if isinstance(v, jcore.DropVar):
            return jcore.DropVar(v.aval)
        w = new.get(v)
        if w is None:
            w = new[v] = jcore.Var(v.aval)
        return w

    constvars = [var(v) for v in jaxpr.constvars]
    invars = [var(v) for v in jaxpr.invars]
    eqns = [
        e.replace(invars=[var(v) for v in e.invars], outvars=[var(v) for v in e.outvars])
        for e in jaxpr.eqns
    ]
    return jaxpr.replace(
        constvars=constvars, invars=invars, outvars=[var(v) for v in jaxpr.outvars], eqns=eqns
    )
