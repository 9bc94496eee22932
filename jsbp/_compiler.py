"""The SBP compiler: jaxpr (logical shapes) -> SBP inference -> one full-manual shard_map.

``infer`` assigns an nd-sbp to every variable. A forward pass asks the rule registry, per
equation, for the legal per-axis signatures, expands them over the placement axes and keeps the
candidate that needs no boxing, otherwise the cheapest boxing (bytes per device plus a fixed
cost per collective, ``_boxing.plan_cost``). That greedy choice cannot see past one equation, so
a backward walk then collects the layouts each value's consumers want (seeded by ``out_sbp`` and
annotations) and another forward pass charges each candidate the boxing of its outputs to those
layouts as well; the cheapest whole program is kept. Conversions are shared: a value boxed once
is reused by later consumers, a later layout that is a local slice of an earlier conversion (B ->
S) is cut from it, and the lookahead charges nothing for a layout another consumer will convert
to anyway (``backward_demand``). A second seed keeps the program inputs in their given layouts
where it can (``_search``); ``JSBP_PLANNER=global`` chooses every signature at once instead
(``_planner``). Call-like primitives (``jit``, ``custom_jvp_call``,
``custom_vjp_call``, ``remat``) are inlined; ``scan`` / ``while`` carries get a fixed-point layout;
``cond`` branches are boxed to a common output layout.

``run_program`` runs the planned ``Program`` inside one ``shard_map`` body: the steps and the
combined collectives in the order ``_combine`` gave them, boxing collectives before each step
(``_boxing.run_plan``), then each primitive on local, padded shards.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from . import _planner, _repeat, _sbp
from ._boxing import COLLECTIVE_LATENCY_BYTES, plan, plan_cost, run_plan
from ._combine import combine_collectives, run_group
from ._errors import NoRuleWarning, SbpError
from ._layout import Layout, layout_of
from ._problem import CALLS, call_jaxpr, fresh_vars, legal_signatures, one_partial_kind
from ._program import (
    WHILE_TRIPS,
    Boxing,
    Program,
    Step,
    boxings_of,
    iter_steps,
    scan_counts,
    subprograms,
)
from .rules import _registry

B = _sbp.broadcast


# -------------------------------------------------------------------------------------------
# decisions
# -------------------------------------------------------------------------------------------


def _itemsize(aval) -> int:
    try:
        return np.dtype(aval.dtype).itemsize
    except TypeError:
        return 4


def _boxing(i, src: Layout, dst: Layout, aval) -> Boxing | None:
    """The planned conversion of operand ``i`` from ``src`` to ``dst`` (None if they agree)."""
    if src.nd_sbp == dst.nd_sbp:
        return None
    return Boxing(
        i,
        src,
        dst,
        plan(src.nd_sbp, dst.nd_sbp, src.shape, src.placement.hierarchy, _itemsize(aval)),
    )


def _moves_cost(moves) -> float:
    """Bytes per device plus a fixed latency per collective (what really moves)."""
    return sum(
        m.bytes_per_device + (COLLECTIVE_LATENCY_BYTES if m.collective else 0.0) for m in moves
    )


SMALL_PARTIAL_BYTES = COLLECTIVE_LATENCY_BYTES / 256
"""A partial value of at most this many bytes (4 KiB) is charged, when a signature wants it split,
what reducing it whole (all-reduce) and slicing costs: for such values a reduce-scatter saves a
few bytes of a collective that costs its latency either way, and the whole copy serves every
later consumer (BatchNorm's batch statistics: reduce-scattered for the variance, then all-gathered
back for the normalisation). Only the choice of signature sees this; the boxing itself still runs
as a reduce-scatter where it is asked for. Applied in loop bodies only (``_IN_BODY``): in the top
scope the lookahead walk sees the consumers."""

_IN_BODY = contextvars.ContextVar("jsbp_in_loop_body", default=False)


def _charge(src, dst, shape, hier, size, fixed="src") -> tuple[float, int]:
    """``plan_cost`` as signature choice sees it (``SMALL_PARTIAL_BYTES``)."""
    cn = plan_cost(src, dst, shape, hier, size, fixed)
    if (
        _IN_BODY.get()
        and any(x.is_partial for x in src)
        and math.prod(shape) * size <= SMALL_PARTIAL_BYTES
    ):
        whole = tuple(B if x.is_partial else x for x in src)
        if whole != dst:
            via = plan_cost(src, whole, shape, hier, size, fixed)
            rest = plan_cost(whole, dst, shape, hier, size, fixed)
            cn = max(cn, (via[0] + rest[0], via[1] + rest[1]))
    return cn


_NO_BUDGET = float("inf")
_CHOICES, _OPTIONS, _EQN, _AS_IS = (
    object(),
    object(),
    object(),
    object(),
)  # private keys of ``_Inference.cands_cache`` / ``.choices``


class _Inference:
    def __init__(
        self,
        placement,
        demand: dict | None = None,
        cands_cache: dict | None = None,
        anchored: frozenset = frozenset(),
        budget: float = _NO_BUDGET,
        strict: bool = False,
        copies: dict | None = None,
    ):
        self.placement = placement
        # call equation -> its jaxpr with fresh variables (``_problem.fresh_vars``); shared by the passes of
        # one ``infer`` like ``cands_cache``, so that what one pass learns of a value inside an
        # inlined call (the lookahead's demand) names the same variable in the next
        self.copies = {} if copies is None else copies
        self.strict = strict  # a primitive without a rule raises instead of running replicated
        # values that keep their layout wherever some signature allows it (the program inputs, in
        # the anchored seed of ``infer``): consumers box around them
        self.anchored = anchored
        self.cands_cache = {} if cands_cache is None else cands_cache
        # ``choose``'s rankings, shared like ``cands_cache`` (``_choice_key``)
        self.choices = self.cands_cache.setdefault(_CHOICES, {})
        self.boxed: dict = {}  # var -> the nd-sbps it was already boxed to in the current program
        # a pass stops (``_OverBudget``) once its top-scope boxings cost this much
        self.budget, self.spent = budget, 0.0
        self.alias: dict = {}  # inlined call: sub-jaxpr invar -> the caller's atom
        # lookahead: value -> the nd-sbps its consumers asked for in an earlier pass; a candidate
        # is charged the boxing of its outputs to them (see ``infer``)
        self.demand = demand or {}
        self.depth = 0  # nesting of separately scoped programs (loop / branch bodies)
        # whether some equation would convert an anchored input without the anchors; only the
        # anchored greedy pass watches for it (``_search`` sets False), others leave None
        self.diverged: bool | None = None
        self.trace: list = []  # top-scope decisions, in program order, for ``_backward_demand``
        # the global planner's decisions (``_planner``): id(top-scope equation) -> signature, and
        # the ids of those this pass could follow (a decision is followed when it is legal for
        # the layouts the pass sees)
        self.fixed: dict | None = None
        self.followed: set = set()
        # value -> the layout it is first converted to when several of its readers can be served
        # from that one conversion (``box_operand``; chosen by the global planner)
        self.hubs: dict = {}

    def key(self, v):
        while v in self.alias:
            v = self.alias[v]
        return v

    def lay(self, nd, aval) -> Layout:
        return layout_of(self.placement, tuple(nd), tuple(aval.shape))

    def lay_b(self, aval) -> Layout:
        return self.lay((B,) * self.placement.ndim, aval)

    def box(self, i, src: Layout, dst: Layout, aval) -> Boxing | None:
        return _boxing(i, src, dst, aval)

    def held(self, v) -> dict:
        """The nd-sbps atom ``v`` was already converted to in the current program (ordered)."""
        return {} if isinstance(v, jcore.Literal) else self.boxed.get(self.key(v), {})

    def box_value(self, i, cur: Layout, dst: Layout, v) -> Boxing | None:
        """The boxing of operand ``i`` (atom ``v``, produced as ``cur``) to ``dst``, recorded for
        reuse: a value already converted to ``dst`` in this program reuses that conversion, and
        one converted to another layout starts from there where that is cheaper (an all-gathered
        copy is sliced locally rather than converted again from the split)."""
        best = self.box(i, cur, dst, v.aval)
        if best is None or isinstance(v, jcore.Literal):
            return best
        held = self.boxed.setdefault(self.key(v), {})
        if dst.nd_sbp in held:
            best.reused = True
            return best
        cost = _moves_cost(best.moves)
        for nd in held:
            bx = self.box(i, self.lay(nd, v.aval), dst, v.aval)
            if (c := _moves_cost(bx.moves)) < cost:
                bx.via = True
                best, cost = bx, c
        held[dst.nd_sbp] = None
        return best

    def box_operand(self, i, cur: Layout, dst: Layout, v) -> list[Boxing]:
        """``box_value``, going through the value's hub layout (``hubs``) first where one was
        chosen and converting from it is no dearer: the conversion to the hub is then made once
        and the readers that follow slice or convert from it (one all-reduce serving a reader
        that wants ``(S(0), B)`` and one that wants ``(B, B)``, not a reduce-scatter and an
        all-reduce)."""
        hub = (
            None if self.depth != 1 or isinstance(v, jcore.Literal) else self.hubs.get(self.key(v))
        )
        # (not when the operand is in ``dst`` already: nothing to convert, through a hub or not)
        if hub is not None and hub not in (cur.nd_sbp, dst.nd_sbp) and cur.nd_sbp != dst.nd_sbp:
            held = self.held(v)
            if dst.nd_sbp not in held and hub not in held:
                h_lay = self.lay(hub, v.aval)
                then = self.box(i, h_lay, dst, v.aval)
                direct = self.box(i, cur, dst, v.aval)
                if _moves_cost(then.moves) <= _moves_cost(direct.moves):
                    pre = self.box_value(i, cur, h_lay, v)
                    then.via = True  # from the conversion just made
                    self.boxed.setdefault(self.key(v), {})[dst.nd_sbp] = None
                    return [pre, then]
        bx = self.box_value(i, cur, dst, v)
        return [] if bx is None else [bx]

    def decided(self, kind: str, eqn):
        """The global planner's plan for loop or ``cond`` ``eqn`` (``kind`` "loop" / "cond": a
        ``_planner.LoopPlan`` / ``CondPlan``) in a top-scope pass following its decisions, else
        None."""
        return None if self.fixed is None or self.depth != 1 else self.fixed.get((kind, id(eqn)))

    # ---------------------------------------------------------------------------------------
    def program(self, jaxpr, consts, in_layouts, out_nd=None, *, inline_of=None) -> Program:
        """Infer a (sub-)program. ``inline_of``: the caller's operands when the jaxpr is an inlined
        call — it then shares the caller's boxing cache (same values, same scope)."""
        if inline_of is not None:
            for sub_v, outer in zip(jaxpr.invars, inline_of):
                if not isinstance(outer, jcore.Literal):
                    self.alias[sub_v] = outer
            return self._program(jaxpr, consts, in_layouts, out_nd)
        saved, self.boxed = self.boxed, {}
        self.depth += 1
        try:
            return self._program(jaxpr, consts, in_layouts, out_nd)
        finally:
            self.boxed = saved
            self.depth -= 1

    def _program(self, jaxpr, consts, in_layouts, out_nd=None) -> Program:
        env: dict = {}
        for v in jaxpr.constvars:
            env[v] = self.lay_b(v.aval)
        for v, lay in zip(jaxpr.invars, in_layouts):
            env[v] = lay
        steps = []
        for eqn in jaxpr.eqns:
            steps.append(self.step(eqn, env))
        out_layouts, out_boxings = [], []
        made = set()  # (value, layout) of the outputs' conversions: a repeated output converts once
        for i, v in enumerate(jaxpr.outvars):
            cur = self.read(env, v)
            if out_nd is not None and out_nd[i] is not None:
                want = self.lay(out_nd[i], v.aval)
                bx = self.box(i, cur, want, v.aval)
                if bx is not None:
                    if not isinstance(v, jcore.Literal):
                        bx.reused = (self.key(v), want.nd_sbp) in made
                        made.add((self.key(v), want.nd_sbp))
                    out_boxings.append(bx)
                cur = want
            out_layouts.append(cur)
        return Program(jaxpr, list(consts), list(in_layouts), steps, out_layouts, out_boxings)

    def read(self, env, v) -> Layout:
        if isinstance(v, jcore.Literal):
            return self.lay_b(v.aval)
        return env[v]

    def step(self, eqn, env) -> Step:
        name = eqn.primitive.name
        cur = [self.read(env, v) for v in eqn.invars]
        handler = _static_handler(eqn)
        if name in _ARG_EXTREMA and any(
            x.is_split and x.dim in eqn.params["axes"] for x in cur[0].nd_sbp
        ):
            handler = _infer_arg_extremum
        elif name in _SCANS and _scan_blocks(eqn, cur[0]) > 1:
            handler = _infer_blocked_scan
        elif name in _BLOCK_REDUCTIONS and _reduce_blocks(eqn, cur[0])[1] > 1:
            handler = _infer_blocked_reduce
        if handler is not None:
            st = handler(self, eqn, cur)
            if self.depth == 1 and st.kind != "call":
                self.trace.append(("want", list(eqn.invars), [l.nd_sbp for l in st.in_layouts]))
        else:
            st = self.prim_step(eqn, cur)
        for v, lay in zip(eqn.outvars, st.out_layouts):
            if not isinstance(v, jcore.DropVar):
                env[v] = lay
        return st

    def candidates(self, eqn, cur: list[Layout]):
        """The rule of ``eqn`` and its legal nd signatures on this placement (memoised across
        the passes of one ``infer``: rules may look at the current layouts, so they are the key)."""
        key, nd_rule = self._memo((_EQN, id(eqn)), eqn, lambda: (_eqn_key(eqn), _nd_rule(eqn)))
        if nd_rule:  # an nd rule may look at the current layouts
            key = (key, tuple(l.nd_sbp for l in cur))
        hit = self.cands_cache.get(key)
        if hit is None:
            hit = self.cands_cache[key] = self._candidates(eqn, cur)
        return hit

    def _candidates(self, eqn, cur: list[Layout]):
        name = eqn.primitive.name
        rule = _registry._RULES.get(name)
        if rule is None:
            if self.strict:
                shapes = ", ".join(f"{tuple(v.aval.shape)}" for v in eqn.invars)
                _registry.get_rule(
                    name, op_desc=f" (operands of shape {shapes} on {self.placement})"
                )
            rule = _registry.replicated_rule(name)
        legal = legal_signatures(self.placement, rule, eqn, tuple(cur))
        if not legal:
            lays = ", ".join(
                f"{tuple(v.aval.shape)} {_sbp.nd_str(l.nd_sbp)}" for v, l in zip(eqn.invars, cur)
            )
            raise SbpError(
                f"no legal SBP signature for '{name}' on {self.placement} with operands {lays}; "
                "the rule offers none for these shapes. Box an operand with jsbp.to_global(..., sbp=...) "
                "to a layout the op supports (B always works)."
            )
        return rule, legal

    def choose(self, eqn, cur, cands, demand, reuse=True, avail=None):
        """The best candidate: no boxing at all first, then the lowest cost of boxing the inputs
        plus (lookahead) boxing the outputs to the layouts in ``demand``; ties prefer fewer
        collectives, fewer partial outputs, and not splitting an axis no input splits. An operand
        layout for which ``avail(value, nd)`` holds costs nothing (by default: another consumer
        asked for that conversion in the last backward walk, so it is made anyway)."""
        if self.fixed is not None and self.depth == 1:
            sig = self.fixed.get(id(eqn))
            if sig is not None and sig in cands:
                self.followed.add(id(eqn))
                return sig
        if avail is None:

            def avail(v, nd):
                return _asked_by_another(self.demand, v, nd, eqn)

        # fast path: a signature that needs no boxing (inputs as they are, outputs as wanted) wins
        # outright; only the tie-breakers rank those
        base = cands
        cur_nd = tuple(l.nd_sbp for l in cur)
        as_is = self._memo(
            (_AS_IS, id(base), cur_nd), base, lambda: [(i, o) for i, o in base if i == cur_nd]
        )
        if as_is and eqn.primitive.name in _COMPUTE_HEAVY:
            # bytes are not the whole cost here: gathering the operands of a matmul to save a
            # reduction of its result would repeat the whole product on every device
            cands = as_is
        free = [
            (ins, outs)
            for ins, outs in as_is
            if all(
                isinstance(v, jcore.DropVar) or all(w == nd for w in demand.get(v, ()))
                for nd, v in zip(outs, eqn.outvars)
            )
        ]
        if free:
            cands = free
        if len(cands) == 1:
            return cands[0]
        # (the candidates above keep every operand as it is, anchored ones included)
        pinned = [
            (i, cur_nd[i])
            for i, v in enumerate(eqn.invars)
            if self.anchored and not isinstance(v, jcore.Literal) and self.key(v) in self.anchored
        ]

        def cheapest(sub, tag):
            key = self._choice_key(eqn, base, cur_nd, demand, reuse, avail, (tag, tuple(pinned)))
            return self._memo(
                key, base, lambda: self._cheapest(eqn, cur, sub, demand, reuse, avail)
            )

        if not pinned:
            return cheapest(cands, "all")
        keep = [(ins, outs) for ins, outs in cands if all(ins[i] == nd for i, nd in pinned)]
        if keep and self.diverged is False:
            # would a pass without anchors convert an input here? (``_search``: if no equation
            # would, that pass is this one and need not run)
            best = cheapest(cands, "unpinned")
            if all(best[0][i] == nd for i, nd in pinned):
                return best
            self.diverged = True
        return cheapest(keep, "pinned") if keep else cheapest(cands, "all")

    def _memo(self, key, owner, make):
        """``make()``, memoised in ``choices`` under ``key`` (which may hold ``id(owner)``): the
        entry keeps ``owner`` alive and is used only while it is that object, so an id is never
        taken for another object's."""
        hit = self.choices.get(key)
        if hit is None or hit[0] is not owner:
            hit = self.choices[key] = (owner, make())
        return hit[1]

    def _choice_key(self, eqn, base, cur_nd, demand, reuse, avail, tag):
        """Everything ``_cheapest`` reads, as a key: the equation's candidates (``base``, one list
        per rule and operand / result types, so it stands for the primitive, its parameters and
        shapes), the operands' layouts, per operand its earlier conversions and the layouts
        ``avail`` grants for free, the layouts wanted of each output, and whether the
        small-partial charge is on (``_IN_BODY``). Equal keys rank equally: the repeated layers of
        a model are ranked once. ``tag``: which subset of ``base`` is ranked (a function of the
        rest of the key)."""
        opts = self._memo(
            (_OPTIONS, id(base)),
            base,
            lambda: [dict.fromkeys(ins[i] for ins, _ in base) for i in range(len(cur_nd))],
        )
        ops = []
        for i, v in enumerate(eqn.invars):
            if isinstance(v, jcore.Literal):
                ops.append(None)
                continue
            k = self.key(v)
            held = self.held(v) if reuse else {}
            src = cur_nd[i]
            free = tuple(nd for nd in opts[i] if nd != src and nd not in held and avail(k, nd))
            ops.append((tuple(held), free))
        wants = tuple(
            None if isinstance(v, jcore.DropVar) else tuple(demand.get(v, ())) for v in eqn.outvars
        )
        return (id(base), cur_nd, tuple(ops), wants, reuse, _IN_BODY.get(), tag)

    def _cheapest(self, eqn, cur, cands, demand, reuse, avail):
        """``choose``'s ranking of ``cands`` (see there)."""
        hier = self.placement.hierarchy
        # per operand: layout, value, bytes per element, earlier conversions; per output: the
        # layouts wanted of it. Each (operand, layout) pair is costed once, however many
        # candidates share it (``in_tabs`` / ``out_tabs``)
        ops = []
        for lay, v in zip(cur, eqn.invars):
            lit = isinstance(v, jcore.Literal)
            ops.append(
                (
                    lay.nd_sbp,
                    lay.shape,
                    _itemsize(v.aval),
                    None if lit else self.key(v),
                    self.held(v) if reuse else {},
                )
            )
        wanted = [
            ()
            if isinstance(v, jcore.DropVar)
            else (demand.get(v, ()), tuple(v.aval.shape), _itemsize(v.aval))
            for v in eqn.outvars
        ]

        def in_cost(i, nd):
            src, shape, size, k, held = ops[i]
            if src == nd:
                return 0.0, 0, True
            if nd in held:
                return 0.0, 0, False  # reuse the earlier conversion
            if k is not None and avail(k, nd):
                return 0.0, 0, False  # made anyway: another consumer needs this conversion
            # from the value as produced or, as ``box_value`` may, an earlier conversion
            cn = _charge(src, nd, shape, hier, size)
            for h in held:
                hcn = _charge(h, nd, shape, hier, size)
                if hcn < cn:
                    cn = hcn
            return cn[0], cn[1], False

        def out_cost(j, nd):
            if not wanted[j]:
                return 0.0, 0, True
            wants, shape, size = wanted[j]
            c_tot, n_tot, ex = 0.0, 0, True
            for want in wants:
                if want != nd:
                    ex = False
                    c, n = _charge(nd, want, shape, hier, size, "dst")
                    c_tot += c
                    n_tot += n
            return c_tot, n_tot, ex

        naxes = self.placement.ndim
        in_tabs = [{} for _ in ops]
        out_tabs = [{} for _ in wanted]
        best = None
        for ins, outs in cands:
            cost, o_cost, nmoves, exact = 0.0, 0.0, 0, True
            for i, nd in enumerate(ins):
                hit = in_tabs[i].get(nd)
                if hit is None:
                    hit = in_tabs[i][nd] = in_cost(i, nd)
                c, n, ex = hit
                cost += c
                nmoves += n
                exact = exact and ex
            for j, nd in enumerate(outs):
                hit = out_tabs[j].get(nd)
                if hit is None:
                    hit = out_tabs[j][nd] = out_cost(j, nd)
                c, n, ex = hit
                o_cost += c
                nmoves += n
                exact = exact and ex
            # at equal cost, convert inputs rather than outputs: the demand moves upstream, where
            # one conversion may serve several consumers (and a backward walk can carry it further)
            key = (not exact, cost + o_cost, o_cost, nmoves)
            if best is None or key < best[0]:
                best = [key, ins, outs, None]
            elif key == best[0]:  # the tie-breakers, only for ties
                if best[3] is None:
                    best[3] = _tie_break(best[1], best[2], naxes)
                tb = _tie_break(ins, outs, naxes)
                if tb < best[3]:
                    best = [key, ins, outs, tb]
        return best[1], best[2]

    def prim_step(self, eqn, cur: list[Layout]) -> Step:
        rule, cands = self.candidates(eqn, cur)
        demand = self.demand_of(eqn, self.demand)
        ins, outs = self.choose(eqn, cur, cands, demand)
        if self.depth == 1:
            self.trace.append(("prim", eqn, list(cur), cands))
        in_lays = [self.lay(nd, v.aval) for nd, v in zip(ins, eqn.invars)]
        boxings = []
        for i, (c, w, v) in enumerate(zip(cur, in_lays, eqn.invars)):
            for bx in self.box_operand(i, c, w, v):
                if self.budget != _NO_BUDGET and self.depth == 1 and not bx.reused:
                    self.spent += _moves_cost(bx.moves)
                    if self.spent >= self.budget:
                        raise _OverBudget
                boxings.append(bx)
        out_lays = [self.lay(nd, v.aval) for nd, v in zip(outs, eqn.outvars)]
        return Step(eqn, in_lays, out_lays, boxings, rule=rule)

    def demand_of(self, eqn, table) -> dict:
        """The wanted layouts of ``eqn``'s outputs, by output var, from a value -> layouts table."""
        return {
            v: table[k]
            for v in eqn.outvars
            if not isinstance(v, jcore.DropVar) and (k := self.key(v)) in table
        }

    def backward_demand(self, out_vars, out_nd) -> dict:
        """Walk the recorded top-scope decisions backwards: each equation, knowing what its
        outputs' consumers want, picks the signature it would choose with that lookahead and asks
        its inputs for the layouts of that signature. The requested output layouts seed it.

        An operand layout costs nothing when it can be had without boxing for this equation
        alone: another consumer asks for the same conversion, or the operand's producer has a
        signature giving that layout from operands that can be had so (``PRODUCER_DEPTH``
        producers back). Consumers later in the program ask first; those earlier are seen by a
        second sweep (``WALK_SWEEPS``), which reads the first sweep's asks."""
        # value -> (producing equation, its operands as (value or None for a literal, layout),
        # its candidates)
        made: dict = {}
        for entry in self.trace:
            if entry[0] == "prim" and len(entry[1].outvars) == 1:
                _, eqn, cur, cands = entry
                operands = tuple(
                    (None if isinstance(u, jcore.Literal) else self.key(u), lay.nd_sbp)
                    for u, lay in zip(eqn.invars, cur)
                )
                made[self.key(eqn.outvars[0])] = (eqn, operands, cands)
        by_out: dict = {}  # id(candidates) -> output nd-sbp -> the operand layouts giving it

        def giving(cands, nd):
            index = by_out.get(id(cands))
            if index is None:
                index = by_out[id(cands)] = {}
                for ins, (out,) in cands:
                    index.setdefault(out, []).append(ins)
            return index.get(nd, ())

        want: dict = {}
        for _ in range(WALK_SWEEPS):
            want = self._sweep(out_vars, out_nd, made, giving, want)
        return want

    def _sweep(self, out_vars, out_nd, made, giving, prior) -> dict:
        """One backward sweep of ``backward_demand``; ``prior``: the previous sweep's asks."""
        want: dict = {}
        memo: dict = {}

        def ask(v, nd, who):
            if not isinstance(v, (jcore.Literal, jcore.DropVar)):
                want.setdefault(self.key(v), {}).setdefault(tuple(nd), set()).add(who)

        def avail(depth, by, v, nd) -> bool:
            """Whether ``v`` can be had in ``nd`` without boxing it for ``by`` alone."""
            asks = want.get(v)
            if asks is not None and asks.get(nd):
                return True
            asks = prior.get(v)  # ``_asked_by_another(prior, v, nd, by)``, inlined: the hot path
            if (
                asks is not None
                and (askers := asks.get(nd))
                and (len(askers) > 1 or by not in askers)
            ):
                return True
            if depth == 0 or (m := made.get(v)) is None:
                return False
            k = (v, nd)
            hit = memo.get(k)
            if hit is None:
                memo[k] = False  # a cycle is not free
                producer, operands, cands = m
                for ins in giving(cands, nd):
                    for (u, at), w in zip(operands, ins):
                        if u is not None and w != at and not avail(depth - 1, producer, u, w):
                            break
                    else:
                        hit = True
                        break
                else:
                    hit = False
                memo[k] = hit
            return hit

        for v, nd in zip(out_vars, out_nd or ()):
            if nd is not None:
                ask(v, nd, None)
        for entry in reversed(self.trace):
            if entry[0] == "want":
                for v, nd in zip(entry[1], entry[2]):
                    ask(v, nd, id(entry))
                continue
            _, eqn, cur, cands = entry
            demand = self.demand_of(eqn, want)
            ins = _carry_through(eqn, cands, demand)
            if ins is None:
                ins, _ = self.choose(
                    eqn,
                    cur,
                    cands,
                    demand,
                    reuse=False,
                    avail=functools.partial(avail, PRODUCER_DEPTH, eqn),
                )
            for v, nd in zip(eqn.invars, ins):
                ask(v, nd, eqn)
        # ``avail`` calls itself through its closure: a reference cycle that would keep ``made``,
        # ``memo`` and ``prior`` (~100 000 objects on a 4-block model) alive until the cyclic
        # collector runs. Break it, and reference counting frees them now
        avail = None  # noqa: F811, F841
        return want


# -------------------------------------------------------------------------------------------
# higher-order primitives
# -------------------------------------------------------------------------------------------


def _tie_break(ins, outs, naxes) -> tuple[int, int]:
    """How ``choose`` ranks candidates of equal cost (lower first): fewer partial outputs, then
    fewer splits created out of nothing (an axis where no input is split: that only moves work to
    the consumers, which slice B for free anyway)."""
    n_partial_out = sum(x.is_partial for nd in outs for x in nd)
    n_new_split = sum(
        1
        for a in range(naxes)
        if any(nd[a].is_split for nd in outs) and not any(nd[a].is_split for nd in ins)
    )
    return n_partial_out, n_new_split


def _asked_by_another(want, v, nd, eqn) -> bool:
    """Whether a consumer of ``v`` other than ``eqn`` asked for it in layout ``nd``."""
    askers = want.get(v, {}).get(nd)
    return bool(askers) and (len(askers) > 1 or eqn not in askers)


def _carry_through(eqn, cands, demand):
    """An elementwise equation whose one output is wanted in one B / S layout passes that layout on
    to its operands unchanged (scalars stay B): boxing before or after it moves the same bytes, and
    passing the demand on lets the producers, where the layouts really diverge, decide."""
    if len(eqn.outvars) != 1 or isinstance(eqn.outvars[0], jcore.DropVar):
        return None
    wants = demand.get(eqn.outvars[0], ())
    if len(wants) != 1:
        return None
    (d,) = wants
    if any(x.is_partial for x in d):
        return None
    shape = tuple(eqn.outvars[0].aval.shape)
    scalar = (B,) * len(d)
    want_ins = []
    for v in eqn.invars:
        vs = tuple(v.aval.shape)
        if vs == shape:
            want_ins.append(d)
        elif vs == ():
            want_ins.append(scalar)
        else:
            return None
    want_ins = tuple(want_ins)
    for ins, outs in cands:
        if outs == (d,) and ins == want_ins:
            return ins
    return None


def _nd_rule(eqn) -> bool:
    """Whether the rule of ``eqn`` is an nd rule (it may look at the current layouts)."""
    rule = _registry._RULES.get(eqn.primitive.name)
    return rule is not None and rule.nd


def _eqn_key(eqn):
    """What a rule's signatures depend on: the primitive, its parameters and the operand types
    (equal for the many equations of a program that do the same thing to the same shapes)."""
    try:
        key = (
            eqn.primitive,
            tuple(sorted(eqn.params.items())),
            tuple(v.aval for v in eqn.invars),
            tuple(v.aval for v in eqn.outvars),
        )
        hash(key)
        return key
    except TypeError:  # an unhashable parameter: this equation alone
        return eqn


def _static_handler(eqn):
    """The handler of ``eqn`` that its primitive alone decides (a loop, a branch, an annotation, a
    call to inline: ``_infer_call``), or None for a primitive with a rule. ``_Inference.step``
    may still decompose an equation for the layouts it sees (``_infer_arg_extremum`` ...)."""
    name = eqn.primitive.name
    handler = _HIGHER_ORDER.get(name)
    if handler is None and call_jaxpr(eqn) is not None and name not in _registry.registered():
        handler = _infer_call
    return handler


def _infer_call(inf: _Inference, eqn, cur):
    jaxpr, consts = call_jaxpr(eqn)
    return _inline(inf, eqn, cur, eqn, lambda: (fresh_vars(jaxpr), consts))


def _inline(inf: _Inference, eqn, cur, key, make):
    """``eqn`` inferred as the (jaxpr, consts) that ``make`` builds, inlined in the caller's scope;
    built once per ``key`` for all the passes of one ``infer`` (``_Inference.copies``), so every
    pass names the same variables."""
    hit = inf.copies.get(key)
    if hit is None:
        hit = inf.copies[key] = make()
    jaxpr, consts = hit
    sub = inf.program(jaxpr, consts, cur, inline_of=list(eqn.invars))
    _alias_outputs(inf.alias, eqn.outvars, jaxpr.outvars)
    return Step(eqn, list(cur), sub.out_layouts, [], sub=sub, kind="call")


_ARG_EXTREMA = {"argmax": "max", "argmin": "min"}


def _arg_extremum_jaxpr(eqn):
    """``argmax`` / ``argmin`` written with reductions that have partial layouts: the extremum
    (``Pmax`` / ``Pmin`` over a split dim, one small all-reduce), then the least index that holds
    it (``Pmin``, another). Exactly JAX's answer: NaN counts as the extremum and the first of
    equal values wins (-0.0 and 0.0 are equal, as in JAX's comparisons)."""
    (d,) = eqn.params["axes"]
    index_dtype = eqn.params["index_dtype"]
    (x_aval,) = [v.aval for v in eqn.invars]
    find = jnp.max if _ARG_EXTREMA[eqn.primitive.name] == "max" else jnp.min

    def arg_extremum(x):
        m = find(x, axis=d, keepdims=True)
        hit = x == m
        if jnp.issubdtype(x.dtype, jnp.inexact):
            hit = hit | (jnp.isnan(x) & jnp.isnan(m))
        idx = lax.broadcasted_iota(index_dtype, x.shape, d)
        return jnp.min(jnp.where(hit, idx, jnp.asarray(x.shape[d], index_dtype)), axis=d)

    closed = jax.make_jaxpr(arg_extremum)(jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype))
    return closed.jaxpr, list(closed.consts)


def _infer_arg_extremum(inf: _Inference, eqn, cur):
    """``argmax`` / ``argmin`` over a split dim: inferred as ``_arg_extremum_jaxpr`` (two small
    all-reduces of the result's size) instead of gathering the whole operand."""
    return _inline(inf, eqn, cur, ("arg_extremum", eqn), lambda: _arg_extremum_jaxpr(eqn))


_SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin"})
"""Cumulative ops run blockwise along an evenly split dim (``_blocked_scan_jaxpr``)."""


def _scan_blocks(eqn, lay: Layout) -> int:
    """The number of blocks a cumulative op's dim is split into when they are even and longer
    than one element (else 1: the op is left to its rule, which gathers; the block totals of a
    decomposed scan are such a case)."""
    d = eqn.params["axis"]
    k = lay.ways(d)
    return k if k > 1 and lay.shape[d] % k == 0 and lay.shape[d] // k > 1 else 1


def _blocked_scan_jaxpr(eqn, k: int):
    """``cumsum`` / ``cumprod`` / ``cummax`` / ``cummin`` along a dim split evenly into ``k``
    blocks: each block scans its own elements, the ``k`` block totals (a small array) are
    scanned exclusively, and each block combines its offset in. Only the totals move."""
    d, reverse = eqn.params["axis"], eqn.params["reverse"]
    (x_aval,) = [v.aval for v in eqn.invars]
    name = eqn.primitive.name
    op = {"cumsum": lax.cumsum, "cumprod": lax.cumprod, "cummax": lax.cummax, "cummin": lax.cummin}[
        name
    ]
    combine = {"cumsum": lax.add, "cumprod": lax.mul, "cummax": lax.max, "cummin": lax.min}[name]

    def blocked(x):
        shape = x.shape
        y = x.reshape(shape[:d] + (k, shape[d] // k) + shape[d + 1 :])
        c = op(y, axis=d + 1, reverse=reverse)
        last = 0 if reverse else -1
        tot = lax.index_in_dim(
            c, last if last >= 0 else c.shape[d + 1] - 1, axis=d + 1, keepdims=False
        )
        incl = op(tot, axis=d, reverse=reverse)
        # exclusive: the combination of the blocks before this one (identity for the first)
        first = lax.full_like(lax.index_in_dim(incl, 0, axis=d), _scan_identity(name, x.dtype))
        if reverse:
            excl = lax.concatenate([lax.slice_in_dim(incl, 1, k, axis=d), first], d)
        else:
            excl = lax.concatenate([first, lax.slice_in_dim(incl, 0, k - 1, axis=d)], d)
        return combine(c, lax.expand_dims(excl, (d + 1,))).reshape(shape)

    closed = jax.make_jaxpr(blocked)(jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype))
    return closed.jaxpr, list(closed.consts)


def _scan_identity(name, dtype):
    from .rules._common import identity_of

    if name == "cumprod":
        return 1
    return identity_of({"cumsum": "sum", "cummax": "max", "cummin": "min"}[name], dtype)


def _infer_blocked_scan(inf: _Inference, eqn, cur):
    """A cumulative op along an evenly split dim: ``_blocked_scan_jaxpr`` (a collective of the
    block totals only) instead of gathering the operand."""
    k = _scan_blocks(eqn, cur[0])
    return _inline(inf, eqn, cur, ("blocked_scan", eqn, k), lambda: _blocked_scan_jaxpr(eqn, k))


_BLOCK_REDUCTIONS = frozenset({"reduce_prod", "reduce_and", "reduce_or", "reduce_xor"})
"""Reductions run blockwise over an evenly split dim (``_blocked_reduce_jaxpr``)."""


def _reduce_blocks(eqn, lay: Layout) -> tuple[int, int]:
    """(dim, blocks) of the first reduced dim that is split evenly into blocks longer than one
    element; (-1, 1) if none (the op is left to its rule, which gathers)."""
    for d in eqn.params["axes"]:
        k = lay.ways(d)
        if k > 1 and lay.shape[d] % k == 0 and lay.shape[d] // k > 1:
            return d, k
    return -1, 1


def _blocked_reduce_jaxpr(eqn, d: int, k: int):
    """``reduce_prod`` / ``reduce_and`` / ``reduce_or`` / ``reduce_xor`` over a dim split evenly
    into ``k`` blocks: each block reduces its own elements (and the other reduced dims), then the
    ``k`` partial results (a small array) are reduced. Only those move."""
    axes = tuple(eqn.params["axes"])
    (x_aval,) = [v.aval for v in eqn.invars]
    prim, params = eqn.primitive, dict(eqn.params)

    def blocked(x):
        shape = x.shape
        y = x.reshape(shape[:d] + (k, shape[d] // k) + shape[d + 1 :])
        inner = tuple(a + 1 if a > d else a for a in axes if a != d) + (d + 1,)
        per_block = prim.bind(y, **dict(params, axes=tuple(sorted(inner))))
        # the block dim ``d`` is now at ``d`` minus the reduced dims before it
        at = d - sum(1 for a in axes if a < d)
        return prim.bind(per_block, **dict(params, axes=(at,)))

    closed = jax.make_jaxpr(blocked)(jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype))
    return closed.jaxpr, list(closed.consts)


def _infer_blocked_reduce(inf: _Inference, eqn, cur):
    """A product / logical reduction over an evenly split dim: ``_blocked_reduce_jaxpr`` (a
    collective of the per-block results only) instead of gathering the operand."""
    d, k = _reduce_blocks(eqn, cur[0])
    return _inline(
        inf, eqn, cur, ("blocked_reduce", eqn, d, k), lambda: _blocked_reduce_jaxpr(eqn, d, k)
    )


def _alias_outputs(alias, outer_outs, inner_outs):
    """An inlined call's results are its inner values: same boxing cache keys."""
    for o, i in zip(outer_outs, inner_outs):
        if not isinstance(o, jcore.DropVar) and not isinstance(i, jcore.Literal) and o is not i:
            alias[o] = i


def _shift_split(nd, delta):
    return tuple(_sbp.Split(x.dim + delta) if x.is_split else x for x in nd)


def _unsplit_dim0(nd):
    return tuple(B if (x.is_split and x.dim == 0) else x for x in nd)


def _infer_loop_carry(
    inf, make_sub, carry_init: list[Layout], avals, n_carry_out_offset=0, trips: int = 1
):
    """Fixed point for loop carries. ``make_sub(carry, force)`` infers the body with the given carry
    layouts; ``force`` boxes the carry outputs back to them. The init layouts are kept when the
    body gives them back. Otherwise the candidates are: the layouts the body produces on its own
    when it then gives those back (e.g. a P accumulator), the init layouts forced, and, per
    placement axis, the init's SBP on some axes and the body's on the others, forced (a backward
    scan's activation gradient kept split over the data axis and partial over the model axis).
    The cheapest wins: ``trips`` times the body's cost, plus converting the init to the carry
    layouts on entry and the carry back to the init layouts after the loop. (The global planner
    chooses the carry with the body's equations and the rest of the program instead:
    ``_planner._inline_loop``.)"""
    n = len(carry_init)

    def outs_of(sub):
        return sub.out_layouts[n_carry_out_offset : n_carry_out_offset + n]

    def gives_back(sub, carry):
        return all(o.nd_sbp == c.nd_sbp for o, c in zip(outs_of(sub), carry))

    free = make_sub(carry_init, False)
    if gives_back(free, carry_init):
        return list(carry_init), free
    options = _loop_carry_options(inf, make_sub, carry_init, avals, free, outs_of, gives_back)
    hier = inf.placement.hierarchy

    def total(i):
        edges = 0.0
        for c, k, aval in zip(carry_init, options[i][0], avals):
            if c.nd_sbp != k.nd_sbp:
                size = _itemsize(aval)
                edges += plan_cost(c.nd_sbp, k.nd_sbp, c.shape, hier, size)[0]
                edges += plan_cost(k.nd_sbp, c.nd_sbp, c.shape, hier, size)[0]
        return trips * program_cost(options[i][1]) + edges

    return options[min(range(len(options)), key=total)]


def _loop_carry_options(inf, make_sub, carry_init, avals, free, outs_of, gives_back):
    """``_infer_loop_carry``'s candidates when the body does not give the init layouts back."""
    trial = list(outs_of(free))
    options = []
    free2 = make_sub(trial, False)
    if gives_back(free2, trial):
        options.append((trial, free2))
    ndim = inf.placement.ndim
    seen = {tuple(c.nd_sbp for c in carry_init), tuple(c.nd_sbp for c in trial)}
    for mask in range(1, (1 << ndim) - 1):
        mix = [
            inf.lay(tuple(t.nd_sbp[a] if mask >> a & 1 else c.nd_sbp[a] for a in range(ndim)), aval)
            for c, t, aval in zip(carry_init, trial, avals)
        ]
        key = tuple(m.nd_sbp for m in mix)
        if key in seen or not all(one_partial_kind(m.nd_sbp) for m in mix):
            continue
        seen.add(key)
        options.append((mix, make_sub(mix, True)))
    options.append((list(carry_init), make_sub(carry_init, True)))
    return options


_BODY_PLANS = contextvars.ContextVar("jsbp_body_plans", default=None)
"""Loop-body programs already planned in this ``infer`` call, by everything a plan depends on
(``_body_program``): each forward pass of the enclosing program meets the loop again, and the
carry's fixed point tries the same layouts again."""


def _body_program(inf: _Inference, jaxpr, consts, in_layouts, out_nd=None) -> Program:
    """A loop body, planned as a program of its own (``_search``: the anchored and free seeds,
    each refined by the lookahead over the body's equations): planned inside the enclosing
    program, a body would be chosen one equation at a time with no lookahead (BatchNorm's partial
    batch statistics reduce-scattered, then all-gathered back, where one all-reduce does).

    Planned once per ``infer`` call for each (body, constants, boundary layouts, wanted outputs,
    strictness): the passes of the enclosing program share the plan (read-only). (The global
    planner plans the body with the rest of the program: ``_planner._inline_loop``.)"""
    plans = _BODY_PLANS.get()
    key = (
        id(jaxpr),
        tuple(map(id, consts)),
        tuple((l.nd_sbp, l.shape) for l in in_layouts),
        None if out_nd is None else tuple(None if nd is None else tuple(nd) for nd in out_nd),
        inf.strict,
    )
    hit = None if plans is None else plans.get(key)
    if hit is not None and hit[0] is jaxpr and all(a is b for a, b in zip(hit[1], consts)):
        return hit[2]
    token = _IN_BODY.set(True)
    try:
        prog = _search(inf.placement, jaxpr, consts, in_layouts, out_nd, inf.strict)
    finally:
        _IN_BODY.reset(token)
    if plans is not None:  # (the entry holds the body and its constants: their ids stay theirs)
        plans[key] = (jaxpr, tuple(consts), prog)
    return prog


def _infer_scan(inf: _Inference, eqn, cur):
    p = eqn.params
    nc, nk = scan_counts(p)
    if (plan := inf.decided("loop", eqn)) is not None:
        return _follow_loop(inf, eqn, cur, plan)
    closed = p["jaxpr"]
    consts_l = cur[:nc]
    xs_l = cur[nc + nk :]
    boxings = []
    xs_need = []
    for i, (lay, v) in enumerate(zip(xs_l, eqn.invars[nc + nk :])):
        want = inf.lay(_unsplit_dim0(lay.nd_sbp), v.aval)
        if (bx := inf.box(nc + nk + i, lay, want, v.aval)) is not None:
            boxings.append(bx)
        xs_need.append(want)
    x_slice = [
        inf.lay(_shift_split(l.nd_sbp, -1), bv.aval)
        for l, bv in zip(xs_need, closed.jaxpr.invars[nc + nk :])
    ]

    def make_sub(carry, force):
        body_out = [None] * (len(closed.jaxpr.outvars))
        for i in range(nk):
            body_out[i] = carry[i].nd_sbp if force else None
        return _body_program(
            inf, closed.jaxpr, closed.consts, list(consts_l) + list(carry) + x_slice, body_out
        )

    def ys_of(sub):
        return [
            inf.lay(_shift_split(l.nd_sbp, +1), v.aval)
            for l, v in zip(sub.out_layouts[nk:], eqn.outvars[nk:])
        ]

    carry, sub = _infer_loop_carry(
        inf,
        make_sub,
        cur[nc : nc + nk],
        [v.aval for v in eqn.invars[nc : nc + nk]],
        trips=p["length"],
    )
    for i, (c, want, v) in enumerate(zip(cur[nc : nc + nk], carry, eqn.invars[nc : nc + nk])):
        if (bx := inf.box(nc + i, c, want, v.aval)) is not None:
            boxings.append(bx)
    in_lays = list(consts_l) + list(carry) + xs_need
    return Step(eqn, in_lays, list(carry) + ys_of(sub), boxings, sub=sub, kind="scan")


def _box_to(inf: _Inference, eqn, cur, first: int, nds) -> tuple[list[Layout], list[Boxing]]:
    """Operands ``first`` on of ``eqn`` converted to the layouts ``nds`` the global planner chose
    (through the conversion cache, as the planner's edges count them): all operands' layouts after
    (those before ``first`` as they are), and the boxings."""
    lays, boxings = list(cur[:first]), []
    for i, (v, nd) in enumerate(zip(eqn.invars[first:], nds), first):
        want = inf.lay(nd, v.aval)
        boxings += inf.box_operand(i, cur[i], want, v)
        lays.append(want)
    return lays, boxings


def _follow_body(
    inf: _Inference, plan, closed, in_layouts, out_nd, in_body: bool
) -> tuple[Program, bool]:
    """An inlined body planned by a pass following its decisions (``_planner.BodyPlan``), with the
    candidates and inlined calls of its reference pass; and whether every decision was followed."""
    body = _Inference(
        inf.placement, None, plan.ref.cands_cache, strict=inf.strict, copies=plan.ref.copies
    )
    body.fixed, body.hubs = plan.fixed, plan.hubs
    token = _IN_BODY.set(in_body)
    try:
        prog = body.program(closed.jaxpr, closed.consts, in_layouts, out_nd)
    finally:
        _IN_BODY.reset(token)
    return prog, len(body.followed) == len(plan.fixed)


def _follow_loop(inf: _Inference, eqn, cur, plan):
    """A ``scan`` or ``while`` as the global planner decided it with its body inlined
    (``_planner.LoopPlan``): the body's constants, the carry and the scanned inputs converted
    before the loop to the layouts chosen for them, the body planned following its decisions,
    its carry given back and its scanned outputs made in the layouts chosen. A ``while``'s
    condition reads its constants as they are and the carry as chosen."""
    p = eqn.params
    scan = eqn.primitive.name == "scan"
    if scan:
        first, (nc, nk), closed = 0, scan_counts(p), p["jaxpr"]
    else:
        first, nc, closed = p["cond_nconsts"], p["body_nconsts"], p["body_jaxpr"]
        nk = len(eqn.invars) - first - nc
    lays, boxings = _box_to(inf, eqn, cur, first, [*plan.consts, *plan.carry, *plan.xs])
    ins = lays[first:]
    x_slice = [
        inf.lay(_shift_split(l.nd_sbp, -1), bv.aval)
        for l, bv in zip(ins[nc + nk :], closed.jaxpr.invars[nc + nk :])
    ]
    sub, followed = _follow_body(
        inf, plan.body, closed, ins[: nc + nk] + x_slice, [*plan.carry, *plan.ys], True
    )
    if followed:
        inf.followed.add(("loop", id(eqn)))
    carry = ins[nc : nc + nk]
    if not scan:
        cj = p["cond_jaxpr"]
        cond = inf.program(
            cj.jaxpr, cj.consts, lays[:first] + carry, out_nd=[(B,) * inf.placement.ndim]
        )
        return Step(eqn, lays, carry, boxings, sub=(cond, sub), kind="while")
    ys = [
        inf.lay(_shift_split(l.nd_sbp, +1), v.aval)
        for l, v in zip(sub.out_layouts[nk:], eqn.outvars[nk:])
    ]
    return Step(eqn, lays, carry + ys, boxings, sub=sub, kind="scan")


def _infer_while(inf: _Inference, eqn, cur):
    p = eqn.params
    if (plan := inf.decided("loop", eqn)) is not None:
        return _follow_loop(inf, eqn, cur, plan)
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    cconsts, bconsts, init = cur[:cn], cur[cn : cn + bn], cur[cn + bn :]

    def make_sub(carry, force):
        return _body_program(
            inf,
            bj.jaxpr,
            bj.consts,
            list(bconsts) + list(carry),
            [c.nd_sbp for c in carry] if force else None,
        )

    carry, body = _infer_loop_carry(
        inf, make_sub, init, [v.aval for v in eqn.invars[cn + bn :]], trips=WHILE_TRIPS
    )
    cond = inf.program(
        cj.jaxpr, cj.consts, list(cconsts) + list(carry), out_nd=[(B,) * inf.placement.ndim]
    )
    boxings = []
    for i, (c, want, v) in enumerate(zip(init, carry, eqn.invars[cn + bn :])):
        if (bx := inf.box(cn + bn + i, c, want, v.aval)) is not None:
            boxings.append(bx)
    return Step(
        eqn,
        list(cconsts) + list(bconsts) + list(carry),
        list(carry),
        boxings,
        sub=(cond, body),
        kind="while",
    )


def _infer_cond(inf: _Inference, eqn, cur):
    branches = eqn.params["branches"]
    if (plan := inf.decided("cond", eqn)) is not None:
        return _follow_cond(inf, eqn, cur, plan)
    boxings = []
    idx_want = inf.lay_b(eqn.invars[0].aval)
    if (bx := inf.box(0, cur[0], idx_want, eqn.invars[0].aval)) is not None:
        boxings.append(bx)
    ops = cur[1:]
    first = _branch_program(inf, branches[0], ops)
    out_nd = [l.nd_sbp for l in first.out_layouts]
    subs = [first] + [_branch_program(inf, b, ops, out_nd) for b in branches[1:]]
    if len(branches) > 1:
        subs = _cond_results_choice(inf, eqn, cur, subs)
    return Step(
        eqn, [idx_want] + list(ops), list(subs[0].out_layouts), boxings, sub=subs, kind="cond"
    )


def _follow_cond(inf: _Inference, eqn, cur, plan):
    """A ``cond`` as the global planner decided it with its branches inlined
    (``_planner.CondPlan``): the operands converted before it to the layouts chosen for them, each
    branch planned following its decisions and leaving its results in the layouts chosen."""
    idx_want = inf.lay_b(eqn.invars[0].aval)
    lays, boxings = _box_to(inf, eqn, [idx_want, *cur[1:]], 1, plan.ops)
    if (bx := inf.box(0, cur[0], idx_want, eqn.invars[0].aval)) is not None:
        boxings.insert(0, bx)
    done = [
        _follow_body(inf, branch, closed, lays[1:], list(plan.results), False)
        for closed, branch in zip(eqn.params["branches"], plan.branches)
    ]
    if all(followed for _, followed in done):
        inf.followed.add(("cond", id(eqn)))
    subs = [sub for sub, _ in done]
    return Step(eqn, lays, list(subs[0].out_layouts), boxings, sub=subs, kind="cond")


def _cond_results_choice(inf: _Inference, eqn, cur, subs):
    """The layouts of a ``cond``'s results, chosen among the first branch's own (``subs``: the
    others forced to them), each other branch's own, and B, every branch forced to them. A
    candidate costs its branches' ``program_cost`` summed (as ``program_cost`` counts a ``cond``:
    which branch runs is not known) plus converting the results to the layouts the lookahead's
    demand wants of them; ties keep the first branch's. Which branch is written first does not
    decide: a branch whose matmul leaves a partial sum and one that passes a split operand on,
    read replicated after the ``cond``, all-reduce once (the split one zero-fills) whatever their
    order, where the first branch's layouts cost a reduce-scatter and an all-gather with the split
    one first. (The global planner chooses them with the branches' equations and the rest of the
    program instead: ``_planner._inline_cond``.)"""
    hier = inf.placement.hierarchy
    wanted = [
        () if isinstance(v, jcore.DropVar) else tuple(inf.demand.get(inf.key(v), ()))
        for v in eqn.outvars
    ]

    def exits(option):
        cost = 0.0
        for lay, wants, v in zip(option[0].out_layouts, wanted, eqn.outvars):
            for w in wants:
                if w != lay.nd_sbp:
                    cost += plan_cost(lay.nd_sbp, w, lay.shape, hier, _itemsize(v.aval))[0]
        return cost

    first_cost = sum(program_cost(sub) for sub in subs)
    if first_cost + exits(subs) == 0.0:
        return subs  # nothing to gain
    branches, ops = eqn.params["branches"], cur[1:]
    options = [subs]
    seen = {tuple(l.nd_sbp for l in subs[0].out_layouts)}
    own = [(i, _branch_program(inf, b, ops)) for i, b in enumerate(branches) if i > 0]
    own.append((None, None))  # B
    for i, sub in own:
        lays = [inf.lay_b(v.aval) for v in eqn.outvars] if sub is None else sub.out_layouts
        nd = tuple(l.nd_sbp for l in lays)
        if nd not in seen:
            seen.add(nd)
            options.append(
                [
                    sub if j == i else _branch_program(inf, b, ops, list(nd))
                    for j, b in enumerate(branches)
                ]
            )
    body = [first_cost] + [sum(program_cost(sub) for sub in o) for o in options[1:]]
    return options[min(range(len(options)), key=lambda i: body[i] + exits(options[i]))]


def _branch_program(inf: _Inference, closed, ops, out_nd=None) -> Program:
    """A ``cond`` branch, planned inside the enclosing pass (equation by equation) given the
    operand layouts (and the first branch's result layouts for the others)."""
    return inf.program(closed.jaxpr, closed.consts, ops, out_nd=out_nd)


def _infer_annotate(inf: _Inference, eqn, cur):
    nd = eqn.params["nd"]
    if nd is None:
        return Step(eqn, list(cur), list(cur), [], kind="annotate")
    want = inf.lay(nd, eqn.invars[0].aval)
    bxs = inf.box_operand(0, cur[0], want, eqn.invars[0])  # later consumers may reuse or slice it
    return Step(eqn, [want], [want], bxs, kind="annotate")


def _infer_linear_solve(inf: _Inference, eqn, cur):
    """``custom_linear_solve`` (``jnp.linalg.solve`` / ``inv``): its value is its ``solve`` jaxpr
    applied to the right-hand side, so that jaxpr is inferred like a call (the LU factors and
    triangular solves inside keep batch splits) on the operands it reads: its own constants and
    the right-hand side. Gradients need nothing more: JAX has already written the transposed
    solves into the traced program as further ``custom_linear_solve`` equations."""
    lens = eqn.params["const_lengths"]
    start, n_consts = lens.matvec + lens.vecmat, sum(lens)
    reads = list(range(start, start + lens.solve)) + list(range(n_consts, len(eqn.invars)))
    solve = eqn.params["jaxprs"].solve
    sub = inf.program(solve.jaxpr, solve.consts, [cur[i] for i in reads])
    return Step(eqn, list(cur), list(sub.out_layouts), [], sub=(sub, reads), kind="linear_solve")


def _emit_linear_solve(st, ins):
    sub, reads = st.sub
    return run_program(sub, [ins[i] for i in reads])


def _infer_sharding_request(inf: _Inference, eqn, cur):
    """JAX's own sharding calls (``reshard``, ``with_sharding_constraint``, and ``out_sharding=``,
    which ``_interop.lift_out_shardings`` turns into a ``reshard``) are layout requests, like
    ``to_global``: the value is boxed to the nd-sbp the spec names (mesh axes mapped to placement
    axes by name); on local shards an identity."""
    from ._interop import requested_nd

    nd = requested_nd(eqn, cur[0], inf.placement)
    if nd is None:
        return Step(eqn, list(cur), list(cur), [], kind="annotate")
    want = inf.lay(nd, eqn.invars[0].aval)
    return Step(
        eqn, [want], [want], inf.box_operand(0, cur[0], want, eqn.invars[0]), kind="annotate"
    )


_HIGHER_ORDER = {
    "custom_linear_solve": _infer_linear_solve,
    "scan": _infer_scan,
    "while": _infer_while,
    "cond": _infer_cond,
    "jsbp_to_global": _infer_annotate,
    **dict.fromkeys(("reshard", "sharding_constraint"), _infer_sharding_request),
}
for _n in CALLS:
    _HIGHER_ORDER.setdefault(_n, _infer_call)


# -------------------------------------------------------------------------------------------
# emission: run a Program on local shards (inside shard_map)
# -------------------------------------------------------------------------------------------


def _apply_boxings(vals, boxings, invars=None, cache=None):
    for bx in boxings:
        key = None
        if invars is not None and not isinstance(invars[bx.operand], jcore.Literal):
            key = (invars[bx.operand], bx.dst.nd_sbp)
            if key in cache:
                vals[bx.operand] = cache[key]
                continue
        if bx.via:  # start from the earlier conversion of the value to ``src``
            vals[bx.operand] = cache[(invars[bx.operand], bx.src.nd_sbp)]
        vals[bx.operand], _ = run_plan(vals[bx.operand], bx.moves, bx.src)
        if key is not None:
            cache[key] = vals[bx.operand]
    return vals


def run_program(
    prog: Program, local_inputs: list, cache: dict | None = None, alias: dict | None = None
) -> list:
    """Run ``prog`` on local shards, in the order ``prog.order`` gives (``_combine``: the steps and
    the combined collectives, each run once its operands exist), else step by step.
    ``cache``/``alias``: shared with the caller for inlined calls."""
    env: dict = {}
    for v, c in zip(prog.jaxpr.constvars, prog.consts):
        env[v] = jnp.asarray(c)
    for v, x in zip(prog.jaxpr.invars, local_inputs):
        env[v] = x

    def read(v):
        if isinstance(v, jcore.Literal):
            return jnp.asarray(v.val, dtype=v.aval.dtype) if hasattr(v.aval, "dtype") else v.val
        return env[v]

    cache = {} if cache is None else cache
    alias = {} if alias is None else alias

    def key(v):
        while v in alias:
            v = alias[v]
        return v

    members: dict = {}  # combined collective -> [(boxing, the value it converts)]
    for st in prog.steps:
        for bx in st.boxings:
            if bx.group is not None:
                members.setdefault(bx.group, []).append((bx, st.eqn.invars[bx.operand]))
    for bx in prog.out_boxings:
        if bx.group is not None:
            members.setdefault(bx.group, []).append((bx, prog.jaxpr.outvars[bx.operand]))
    order = prog.order if prog.order is not None else [("step", k) for k in range(len(prog.steps))]
    for kind, k in order:
        if kind == "group":
            outs = run_group(prog.in_layouts[0].placement, [(bx, read(v)) for bx, v in members[k]])
            for (bx, v), y in zip(members[k], outs):
                cache[(key(v), bx.dst.nd_sbp)] = y  # read by the members' steps and later reuses
            continue
        st = prog.steps[k]
        keys = [v if isinstance(v, jcore.Literal) else key(v) for v in st.eqn.invars]
        ins = [read(v) for v in st.eqn.invars]
        for bx in st.boxings:
            if bx.group is not None:
                ins[bx.operand] = cache[(keys[bx.operand], bx.dst.nd_sbp)]
        ins = _apply_boxings(ins, [bx for bx in st.boxings if bx.group is None], keys, cache)
        if st.kind == "call":
            for sub_v, outer in zip(st.sub.jaxpr.invars, keys):
                if not isinstance(outer, jcore.Literal):
                    alias[sub_v] = outer
            outs = run_program(st.sub, ins, cache, alias)
            _alias_outputs(alias, st.eqn.outvars, st.sub.jaxpr.outvars)
        else:
            outs = _EMIT[st.kind](st, ins)
        for v, o in zip(st.eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    outs = [read(v) for v in prog.jaxpr.outvars]
    keys = [v if isinstance(v, jcore.Literal) else key(v) for v in prog.jaxpr.outvars]
    made = {}
    for bx in prog.out_boxings:
        if bx.group is not None:  # (a repeated output converted to one layout twice reuses it)
            made[(keys[bx.operand], bx.dst.nd_sbp)] = outs[bx.operand] = cache[
                (keys[bx.operand], bx.dst.nd_sbp)
            ]
    return _apply_boxings(outs, [bx for bx in prog.out_boxings if bx.group is None], keys, made)


def _emit_prim(st: Step, ins):
    rule = st.rule
    eqn = st.eqn
    if rule.local is not None:
        outs = rule.local(st, ins)
    else:
        outs = eqn.primitive.bind(*ins, **eqn.params)
    if not eqn.primitive.multiple_results:
        outs = [outs]
    return list(outs)


def _emit_annotate(st, ins):
    return ins


def _emit_scan(st, ins):
    p = st.eqn.params
    nc, nk = scan_counts(p)
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    sub = st.sub

    def body(carry, x):
        out = run_program(sub, list(consts) + list(carry) + list(x))
        return out[:nk], out[nk:]

    carry, ys = lax.scan(
        body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return list(carry) + list(ys)


def _emit_while(st, ins):
    p = st.eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    cond, body = st.sub
    out = lax.while_loop(
        lambda c: run_program(cond, list(cconsts) + list(c))[0],
        lambda c: run_program(body, list(bconsts) + list(c)),
        list(init),
    )
    return list(out)


def _emit_cond(st, ins):
    idx, ops = ins[0], ins[1:]
    fns = [(lambda *a, s=s: run_program(s, list(a))) for s in st.sub]
    return list(lax.switch(idx, fns, *ops))


_EMIT = {
    "prim": _emit_prim,
    "annotate": _emit_annotate,
    "linear_solve": _emit_linear_solve,
    "scan": _emit_scan,
    "while": _emit_while,
    "cond": _emit_cond,
}


# -------------------------------------------------------------------------------------------
# walking a program (for explain / counts)
# -------------------------------------------------------------------------------------------


def _reduce_before_transposes(prog: Program, seen=None) -> None:
    """Move the reduction of a partial value to before the ``transpose`` that feeds it.

    A weight gradient is ``dot_general`` (partial over the data axis) then ``transpose``; SBP
    inference keeps the transpose partial and reduces where the optimizer needs the value, so the
    program reads dot -> transpose -> all-reduce. The bytes are the same either way, but XLA
    cannot fold a transpose into a matmul whose result must be laid out for a collective: it
    copies both operands instead (XLA:CPU: one dot per weight left unfused, ~5 % of a DP step).
    Reducing first (dot -> all-reduce -> transpose) is what GSPMD emits. Rewritten only where the
    transpose's operand and result each have that single use, the operand is computed in the
    same program, and the moved boxing costs no more; nested programs likewise (each once: two
    loops of one body and layouts share its program, ``_body_program``)."""
    seen = set() if seen is None else seen
    if id(prog) in seen:
        return
    seen.add(id(prog))
    for st in prog.steps:
        for sub in subprograms(st):
            _reduce_before_transposes(sub, seen)
    uses: dict = {}
    produced = set()
    for k, st in enumerate(prog.steps):
        produced.update(v for v in st.eqn.outvars if not isinstance(v, jcore.DropVar))
        for i, v in enumerate(st.eqn.invars):
            if not isinstance(v, jcore.Literal):
                uses.setdefault(v, []).append((k, i))
    for v in prog.jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            uses.setdefault(v, []).append((None, None))
    for st in reversed(prog.steps):
        if st.kind != "prim" or st.eqn.primitive.name != "transpose" or st.boxings:
            continue
        (x,), (y,) = st.eqn.invars, st.eqn.outvars
        lin, lout = st.in_layouts[0], st.out_layouts[0]
        if not lin.partial_axes or x not in produced or len(uses.get(x, ())) != 1:
            continue
        y_uses = uses.get(y, ())
        if len(y_uses) != 1 or y_uses[0][0] is None:
            continue
        c, i = y_uses[0]
        consumer = prog.steps[c]
        mine = [b for b in consumer.boxings if b.operand == i]
        bx = mine[0] if len(mine) == 1 else None  # (not a conversion through a hub layout)
        if (
            bx is None
            or bx.reused
            or bx.via
            or any(bx.dst.nd_sbp[a].is_partial for a in lout.partial_axes)
        ):
            continue
        perm = st.eqn.params["permutation"]
        nd = tuple(_sbp.split(perm[x_.dim]) if x_.is_split else x_ for x_ in bx.dst.nd_sbp)
        new_in = layout_of(lin.placement, nd, lin.shape)
        moved = _boxing(0, lin, new_in, x.aval)
        if _moves_cost(moved.moves) > _moves_cost(bx.moves):
            continue
        st.boxings = [moved]
        st.in_layouts, st.out_layouts = [new_in], [bx.dst]
        consumer.boxings = [b for b in consumer.boxings if b is not bx]


def _dce(jaxpr):
    """Drop equations whose results are unused (XLA would drop them and their collectives)."""
    try:
        from jax._src.interpreters import partial_eval as pe

        n_consts = len(jaxpr.constvars)
        flat = pe.convert_constvars_jaxpr(jaxpr) if n_consts else jaxpr
        new, _ = pe.dce_jaxpr(flat, [True] * len(flat.outvars), instantiate=True)
        return pe.convert_invars_to_constvars(new, n_consts) if n_consts else new
    except Exception:  # pragma: no cover - an internal API moved: plan without DCE
        return jaxpr


def program_cost(prog: Program, loops: bool = False) -> float:
    """Bytes per device plus a fixed latency per collective, over every boxing of ``prog`` (what
    really moves: the planner's tie-breaking penalties on local moves are left out). ``loops``:
    a loop body's boxings count once per iteration (``boxings_of``), as they run; else once."""
    return sum(
        times * _moves_cost(bx.moves) for bx, times in boxings_of(prog, loops) if not bx.reused
    )


_COMPUTE_HEAVY = frozenset({"dot_general", "conv_general_dilated"})
"""Primitives that keep a signature needing no input boxing whatever the lookahead says."""

PRODUCER_DEPTH = 3
"""How many producers back the backward walk looks for a layout it can have without boxing."""

WALK_SWEEPS = 2
"""Sweeps of each backward walk (the second sees what consumers earlier in the program asked)."""

LOOKAHEAD_ROUNDS = 2
"""Refinement passes after the greedy one (each: a backward demand walk, then a forward pass)."""

SEED_SLACK = 1.25
"""The free seed is refined only if its greedy program costs less than this times the anchored
seed's best (a refinement pass rarely gains more; skipping it saves first-call time)."""


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector. Inference allocates a great many small tuples that
    live until it ends; every automatic collection they trigger would walk the whole heap (JAX's
    traced programs included): about a quarter of a cold 2-d inference. Reference counting still
    frees what dies, and what is left is collected once the collector runs again."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def infer(placement, jaxpr, consts, in_layouts, out_nd=None, *, strict: bool = False) -> Program:
    """The SBP program of ``jaxpr``: the cheapest plan found by ``_search`` (or, with
    ``JSBP_PLANNER=global``, by ``_planner.search``; for a program whose layers repeat 8 times or
    more, the plan of a reduced copy followed over the whole program: ``_repeat.plan``), with
    reductions moved ahead of transposes where that costs nothing (``_reduce_before_transposes``) and small
    reduce-scatters / all-gathers batched into combined collectives (``_combine``). A primitive
    without a rule runs replicated with a ``NoRuleWarning`` (``strict``: an ``SbpError``)."""
    with _gc_paused():
        token = _BODY_PLANS.set({})
        try:
            jaxpr = _dce(jaxpr)
            search = functools.partial(_search, plan_globally=_planner.enabled())
            prog = _repeat.plan(placement, jaxpr, consts, in_layouts, out_nd, strict, search)
            if prog is None:
                prog = search(placement, jaxpr, consts, in_layouts, out_nd, strict)
        finally:
            _BODY_PLANS.reset(token)
        _reduce_before_transposes(prog)
        combine_collectives(prog)
    _warn_replicated(prog, placement)
    return prog


def _warn_replicated(prog: Program, placement) -> None:
    """One ``NoRuleWarning`` per primitive of ``prog`` that had no rule and ran replicated."""
    seen: dict = {}
    for _, st in iter_steps(prog):
        if st.kind == "prim" and st.rule is not None and st.rule.fallback:
            name = st.eqn.primitive.name
            shapes, nbytes = seen.get(name, ([], 0.0))
            shapes.append(", ".join(str(tuple(v.aval.shape)) for v in st.eqn.invars))
            seen[name] = (shapes, nbytes + sum(bx.bytes_per_device for bx in st.boxings))
    for name, (shapes, nbytes) in seen.items():
        warnings.warn(
            f"no SBP rule for JAX primitive '{name}' (operands of shape {'; '.join(shapes[:3])}"
            f"{' ...' if len(shapes) > 3 else ''}): it ran replicated on {placement}, its operands boxed to "
            f"B ({nbytes:,.0f} bytes received per device) and computed whole on every device. Register a "
            f"rule with @jsbp.register_sbp_rule('{name}') (CONTRIBUTING.md), or pass jsbp.jit(fn, "
            "strict=True) / JSBP_STRICT=1 to make this an error.",
            NoRuleWarning,
            stacklevel=6,  # the user's call of the jitted function
        )


def _search(
    placement,
    jaxpr,
    consts,
    in_layouts,
    out_nd=None,
    strict=False,
    cache=None,
    plan_globally=False,
    all_plans=False,
    weights=None,
):
    """Greedy forward inference, then up to ``LOOKAHEAD_ROUNDS`` refinements: a backward walk
    collects the layouts each value's consumers want (seeded by ``out_nd`` and annotations), and a
    new forward pass charges every candidate the boxing of its outputs to those layouts. This sees
    past one equation: an optimizer update whose result must come back replicated keeps its
    gradient's all-reduce instead of a reduce-scatter now and all-gathers later. The cheapest
    program (``program_cost``) wins.

    Two seeds: the *free* one boxes whatever is cheapest per equation; the *anchored* one keeps
    the program's inputs (parameters, optimizer state, batch) in the layouts the user gave them
    wherever a signature allows, and boxes the activations around them. One equation at a time,
    gathering a small weight often looks cheaper than gathering an activation, and the free seed
    drifts into a ZeRO-3-like plan (a collective per weight, both ways) where the user wrote
    Megatron; the anchored seed follows the annotations as GSPMD's propagation does.

    The anchored seed runs first and notes whether, without the anchors, some equation would have
    converted an input (``_Inference.diverged``). If none would, it *is* the free seed, and is
    refined as such. Otherwise its refined cost times ``SEED_SLACK`` is the free seed's budget:
    the free seed stops as soon as its boxings cost that much (a refinement pass rarely gains
    more), and is refined only if it stays within it.

    ``all_plans``: the list of every plan considered, the search's first (``_repeat`` ranks them
    for the whole program). ``weights``: id(equation) -> how many equations of the whole program
    it stands for (``_repeat``; the global planner's costs count them)."""
    if plan_globally:  # the global planner (``JSBP_PLANNER=global``) starts from this search's plan
        return _planner.search(
            placement, jaxpr, consts, in_layouts, out_nd, strict, cache, all_plans, weights
        )
    prog = _search_pass(placement, jaxpr, consts, in_layouts, out_nd, strict, cache)[0]
    return [prog] if all_plans else prog


def _search_pass(placement, jaxpr, consts, in_layouts, out_nd=None, strict=False, cache=None):
    """``_search``'s program and the inference pass that built it (``_planner`` starts there).
    ``cache``: the candidates and rankings (``_Inference.cands_cache``) to start from and add to."""
    args = (jaxpr, consts, in_layouts, out_nd)
    inputs = frozenset(jaxpr.invars)
    anch = _Inference(placement, None, {} if cache is None else cache, inputs, strict=strict)
    anch.diverged = False
    anch_prog = anch.program(*args)
    if not anch.diverged:
        # no equation would convert an input without the anchors: this is the free seed
        anch.anchored = frozenset()
        return _refine(anch, anch_prog, args)[::2]
    best, best_cost, best_inf = _refine(anch, anch_prog, args)
    free = _Inference(
        placement,
        None,
        anch.cands_cache,
        budget=best_cost * SEED_SLACK,
        strict=strict,
        copies=anch.copies,
    )
    try:
        free_prog = free.program(*args)
    except _OverBudget:
        return best, best_inf
    if program_cost(free_prog) < best_cost * SEED_SLACK:
        prog, cost, inf = _refine(free, free_prog, args)
        if cost < best_cost:
            best, best_inf = prog, inf
    return best, best_inf


def _refine(inf, prog, args) -> tuple[Program, float, _Inference]:
    """Up to ``LOOKAHEAD_ROUNDS`` lookahead passes after ``inf``'s pass (which made ``prog``);
    the cheapest program (``program_cost``; ties: ``_tie_rank``), its cost and the pass that made
    it. ``args``: ``infer``'s (jaxpr, consts, in_layouts, out_nd)."""
    jaxpr, _, _, out_nd = args
    cost = program_cost(prog)
    for _ in range(LOOKAHEAD_ROUNDS):
        if cost == 0.0 and _local_slices(prog) == 0:
            break
        demand = inf.backward_demand(jaxpr.outvars, out_nd)
        nxt = _Inference(
            inf.placement,
            demand,
            inf.cands_cache,
            inf.anchored,
            strict=inf.strict,
            copies=inf.copies,
        )
        new = nxt.program(*args)
        new_cost = program_cost(new)
        if new_cost > cost or (new_cost == cost and _tie_rank(new) >= _tie_rank(prog)):
            break
        prog, cost, inf = new, new_cost, nxt
    return prog, cost, inf


def _tie_rank(prog: Program) -> tuple[float, int]:
    """How ``_refine`` ranks programs of equal ``program_cost``: the cost as the program will run,
    its small collectives combined (``_planner.combined_cost``, on a copy), then the number of
    local slices (B -> S without communication). A slice means the value was made whole on every
    device first: a random draw (``random_bits``) that could have drawn only the device's block,
    say. Combined collectives come first: a lookahead pass can reach the same ``program_cost`` with
    fewer slices by reducing bias gradients where their reshape reads them rather than where the
    update does, which splits the step's gradient all-reduce into several."""
    return _planner.combined_cost(_copy_program(prog)), _local_slices(prog)


def _local_slices(prog: Program) -> int:
    return sum(
        1
        for _, st in iter_steps(prog)
        for bx in st.boxings
        if not bx.reused and not any(m.collective for m in bx.moves)
    )


def _copy_program(prog: Program) -> Program:
    """A copy of ``prog`` whose steps and boxings (nested programs' too) can be rewritten and
    grouped (``_reduce_before_transposes``, ``combine_collectives``) without touching ``prog``."""

    def boxings(bxs):
        return [dataclasses.replace(bx) for bx in bxs]

    def sub(x):
        if isinstance(x, Program):
            return _copy_program(x)
        if isinstance(x, (list, tuple)):
            return type(x)(sub(y) for y in x)
        return x

    steps = [
        dataclasses.replace(st, boxings=boxings(st.boxings), sub=sub(st.sub)) for st in prog.steps
    ]
    return dataclasses.replace(prog, steps=steps, out_boxings=boxings(prog.out_boxings))


class _OverBudget(Exception):
    """A free-seed pass has spent its budget (``_search``)."""


# -------------------------------------------------------------------------------------------
# rule validation support: one equation under a forced signature
# -------------------------------------------------------------------------------------------


def candidate_signatures(placement, eqn) -> list[tuple[tuple, tuple]]:
    """Every nd signature the rule of ``eqn`` offers on ``placement`` (after expansion)."""
    return legal_signatures(placement, _registry.get_rule(eqn.primitive.name), eqn)


def forced_program(placement, closed, in_nds, out_nds) -> Program:
    """A Program running the single equation of ``closed`` under the given signature."""
    (eqn,) = closed.jaxpr.eqns
    inf = _Inference(placement)
    in_lays = [inf.lay(nd, v.aval) for nd, v in zip(in_nds, eqn.invars)]
    out_lays = [inf.lay(nd, v.aval) for nd, v in zip(out_nds, eqn.outvars)]
    st = Step(eqn, in_lays, out_lays, [], rule=_registry.get_rule(eqn.primitive.name))
    jaxpr_in = (
        [inf.lay(nd, v.aval) for nd, v in zip(in_nds, closed.jaxpr.invars)]
        if closed.jaxpr.invars == eqn.invars
        else in_lays
    )
    return Program(closed.jaxpr, list(closed.consts), jaxpr_in, [st], out_lays, [])
