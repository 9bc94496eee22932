"""``Strategy.auto``: choose a parallelism for an NNX model, optimizer and train step.

The search space is the strategies written by hand (``examples/train_gpt.py``), as data:

* the **grid**: the placement's devices (in placement order) as ``dp × tp`` for every
  factorisation of their count (``dp=8``, ``dp=4×tp=2``, ``dp=2×tp=4``, ``tp=8`` on 8 devices);
* **tensor parallelism** over ``tp``: which of the model's logical axis names (Flax's
  ``nnx.with_partitioning`` metadata: ``"heads"``, ``"mlp"``, ``"vocab"``, ``"expert"``, ...)
  are split over ``tp`` — Megatron's column / row pairs follow from the names, and an expert
  dim over ``tp`` is expert parallelism. A model without names gets a per-leaf choice instead:
  for its largest 2-d weights, split dim 0 or dim 1 over ``tp`` or not;
* **sequence and context parallelism** over ``tp``: the names only activations carry (those of
  ``jsbp.flax.constrain`` calls, recorded while the first candidate is traced: a sequence dim
  such as train_gpt.py's ``"seq"`` / ``"act_seq"``), added to the best tensor-parallel set
  (the residual stream's sequence beside the heads and MLP is Megatron-SP) or alone (every
  sequence dim split, the weights whole: context parallelism);
* **data parallelism** over ``dp``: the batch split on its first dim; names split over ``dp``
  too (the experts beside the batch: expert parallelism with the tokens dispatched by
  all-to-all; a name that shares a ``constrain`` call with ``"batch"`` cannot be); and the
  ZeRO stage (0-3: optimizer state, + gradients, + parameters split over ``dp``).

Every candidate is a ``Strategy``; its train step is planned by jsbp (abstract state: nothing is
put on devices, nothing compiled) and costed with ``jsbp._cost.estimate`` (collectives +
compute, predicted peak bytes per device). The tensor-parallel choice is made on the pure ``tp``
grid (every legal set of the parameters' names when there are at most ``EXHAUSTIVE_OPTIONS``,
else forward selection: add the option that helps most while one helps; then the activations'
names by forward selection; a set is legal where no weight and no ``constrain`` call has two of
its names, which would split two dims over one axis) and reused on the mixed grids; the names
over ``dp`` are a forward selection on each grid with a ``dp`` axis, and the ZeRO stages are
tried on top of it. The cheapest candidate whose predicted peak fits ``memory_budget`` wins
(over budget: the least excess); ties go to the earlier candidate (fixed order), so the choice
is deterministic.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from .. import _sbp
from .._cost import DEFAULT_COST, CostModel, Estimate, estimate, fmt_bytes, parse_bytes
from .._errors import SbpError
from .._layout import layout_of
from .._placement import placement as Placement
from .._tensor import GlobalTensor, is_key_dtype
from ._strategy import (
    _AUTO,
    Strategy,
    _kind,
    _names,
    _shape,
    _value,
    dim_names,
    leaf_layouts,
    path_str,
    recording_names,
)
from ._train import make_train_step

__all__ = ["auto_strategy", "estimate_strategy", "AutoReport", "Candidate"]

MAX_LEAF_CHOICES = 8
"""A model without logical names: how many of its largest 2-d weights get a per-leaf choice."""

ZERO_SLACK = 1.5
"""Without a memory budget, ZeRO stages are planned only on grids whose best ZeRO-0 step is
estimated within this factor of the best candidate's (in ``benchmarks/auto.py`` the best ZeRO
stage saved at most ~20 % of a ZeRO-0 step: its collectives are combined, the gradient
all-reduces are not)."""

EXHAUSTIVE_OPTIONS = 5
"""Up to this many tensor-parallel options (names), every legal subset is planned; above, a
forward selection."""


def _param_dim_names(flat):
    """Each parameter's per-dim logical names (``None`` where its metadata does not parse)."""
    for path, var in flat:
        if _kind(var) != "param":
            continue
        try:
            yield dim_names(_names(var), len(_shape(_value(var))), path_str(path))
        except SbpError:
            yield None


def _conflicts(flat, names) -> list[set]:
    """Per parameter, the set of its dims' names: two of one set cannot both go to ``tp``."""
    out = []
    for dn in _param_dim_names(flat):
        s = {n for n in (dn or ()) if isinstance(n, str) and n in names}
        if len(s) > 1 and s not in out:
            out.append(s)
    return out


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy ``Strategy.auto`` planned, with the cost model's figures."""

    name: str  # "dp=2×tp=4 {heads,mlp} zero-1"
    strategy: Strategy
    estimate: Estimate
    fits: bool

    def row(self, chosen: bool) -> str:
        e = self.estimate
        return (
            f"{'*' if chosen else ' '} {self.name:<40} {e.seconds * 1e3:>8.2f} {e.collectives:>5} "
            f"{fmt_bytes(e.comm_bytes):>11} {fmt_bytes(e.peak_bytes):>11} {'yes' if self.fits else 'no':>4}"
        )


@dataclasses.dataclass
class AutoReport:
    """What ``Strategy.auto`` planned and chose. ``candidates`` in the order tried; ``chosen``
    is one of them; ``state_bytes``: the predicted bytes of model + optimizer state per device
    under the chosen strategy (compare with ``jsbp.flax.local_nbytes((model, optimizer))``)."""

    candidates: list[Candidate]
    chosen: Candidate
    memory_budget: int | None
    state_bytes: int
    seconds: float  # how long the search took

    def __str__(self):
        budget = "none" if self.memory_budget is None else fmt_bytes(self.memory_budget)
        head = (
            f"  {'candidate':<40} {'ms (est)':>8} {'coll':>5} {'moved/dev':>11} "
            f"{'peak/dev':>11} {'fits':>4}"
        )
        lines = [
            f"Strategy.auto: {len(self.candidates)} candidates planned in {self.seconds:.1f}s, "
            f"memory budget {budget}",
            head,
            "-" * len(head),
        ]
        lines += [c.row(c is self.chosen) for c in self.candidates]
        e = self.chosen.estimate
        lines.append(
            f"chosen: {self.chosen.name}: predicted peak {fmt_bytes(e.peak_bytes)} per device "
            f"(state {fmt_bytes(self.state_bytes)}, batch {fmt_bytes(e.input_bytes - self.state_bytes)}, "
            f"live intermediates {fmt_bytes(e.activation_bytes)})"
        )
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------


def _grids(placement: Placement) -> list[tuple[int, int, Placement]]:
    """``(dp, tp, placement)`` for every factorisation of the device count, dp largest first."""
    ranks = np.asarray(placement.ranks).reshape(-1)
    n = ranks.size
    out = []
    for dp in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        tp = n // dp
        if tp == 1:
            plc = Placement(placement.type, ranks, axis_names=("dp",))
        elif dp == 1:
            plc = Placement(placement.type, ranks, axis_names=("tp",))
        else:
            plc = Placement(placement.type, ranks.reshape(dp, tp), axis_names=("dp", "tp"))
        out.append((dp, tp, plc))
    return out


def _model_names(flat) -> list[str]:
    """Every logical name on the parameters' sharding metadata (sorted; ``"batch"`` excluded)."""
    names: set[str] = set()
    for dn in _param_dim_names(flat):
        for n in dn or ():
            for x in n if isinstance(n, tuple) else (n,):
                if isinstance(x, str) and x != "batch":
                    names.add(x)
    return sorted(names)


def _big_matrices(flat) -> list[tuple[str, tuple[int, ...]]]:
    """The largest 2-d parameters (path, shape), at most ``MAX_LEAF_CHOICES``, largest first."""
    # paths within the model (the state is split from (model, optimizer): drop the leading 0)
    mats = [
        (path_str(p[1:]), _shape(_value(v)))
        for p, v in flat
        if _kind(v) == "param" and len(_shape(_value(v))) == 2
    ]
    mats.sort(key=lambda m: (-math.prod(m[1]), m[0]))
    return mats[:MAX_LEAF_CHOICES]


def _abstract(value, plc, nd):
    shape = tuple(np.shape(value))
    lay = layout_of(plc, nd, shape)
    return GlobalTensor(jax.ShapeDtypeStruct(lay.physical_shape, value.dtype), lay)


class _Search:
    def __init__(self, loss_fn, model, optimizer, batch, accum, cost, budget):
        self.make_train_step = make_train_step
        self.loss_fn, self.accum, self.cost, self.budget = loss_fn, accum, cost, budget
        self.graphdef, state = nnx.split((model, optimizer))
        self.flat = list(nnx.to_flat_state(state))
        for path, var in self.flat:
            if isinstance(_value(var), GlobalTensor):
                raise SbpError(
                    f"Strategy.auto: the model / optimizer is already sharded ({path_str(path)!r} is a "
                    "GlobalTensor); pass the plain NNX objects (before jsbp.flax.shard, or jsbp.flax.gather them)."
                )
        self.batch = batch
        self.candidates: list[Candidate] = []
        self.errors: list[str] = []  # candidates that could not be planned, and why
        self._seen: dict = {}
        self.names_seen: set = set()  # the logical names of every constrain call traced

    def plan(self, strategy: Strategy) -> Estimate:
        plc = strategy.placement
        lays = leaf_layouts(self.flat, strategy)
        state = nnx.from_flat_state(
            [(p, v.replace(_abstract(_value(v), plc, lays[p].stored))) for p, v in self.flat]
        )
        step = self.make_train_step(self.loss_fn, strategy, accum=self.accum)

        def put(x):
            if is_key_dtype(getattr(x, "dtype", None)):
                return _abstract(x, plc, (_sbp.broadcast,) * plc.ndim)
            x = np.asarray(x)
            if self.accum > 1:
                x = x.reshape((self.accum, x.shape[0] // self.accum) + x.shape[1:])
            return _abstract(x, plc, strategy.batch_sbp(x.ndim, accum=self.accum > 1))

        batch = jax.tree.map(put, self.batch)
        with recording_names(self.names_seen):
            entry = step.pure(self.graphdef, state, batch).lower_program(state, batch)
        return estimate(entry.program, self.cost)

    def score(self, c: Candidate):
        e = c.estimate
        over = 0 if self.budget is None else max(0, e.peak_bytes - self.budget)
        return (over, e.seconds, e.peak_bytes)

    def try_(self, name: str, strategy: Strategy) -> Candidate | None:
        if strategy in self._seen:
            return self._seen[strategy]
        try:
            est = self.plan(strategy)
        except SbpError as e:  # e.g. two names of one leaf on the tp axis: not a legal strategy
            self._seen[strategy] = None
            self.errors.append(f"{name}: {e}")
            return None
        c = Candidate(name, strategy, est, self.budget is None or est.peak_bytes <= self.budget)
        self._seen[strategy] = c
        self.candidates.append(c)
        return c


def estimate_strategy(
    strategy: Strategy,
    *,
    model,
    optimizer,
    loss_fn,
    batch,
    accum: int = 1,
    cost_model: CostModel = DEFAULT_COST,
) -> Estimate:
    """The cost model's ``Estimate`` of ``strategy``'s train step (any strategy, hand-written ones
    included), planned on abstract state exactly as ``Strategy.auto`` plans its candidates."""
    return _Search(loss_fn, model, optimizer, batch, accum, cost_model, None).plan(strategy)


def _name(dp, tp, tp_desc, zero, dp_choice=()):
    if dp == 1 and tp_desc == "{}":  # nothing split over tp and no dp: every value replicated
        return f"replicated on {tp}"
    grid = "×".join(f"{a}={n}" for a, n in (("dp", dp), ("tp", tp)) if n > 1) or "one device"
    return (
        grid
        + (f" {tp_desc}" if tp > 1 else "")
        + (f" dp{_desc(dp_choice)}" if dp_choice else "")
        + (f" zero-{zero}" if zero else "")
    )


def _desc(choice) -> str:
    """``{heads,mlp}``: logical names; ``{fc1/kernel:S(1)}``: a weight's dim (a model without names)."""
    return "{" + ",".join(o if isinstance(o, str) else f"{o[0]}:S({o[1]})" for o in choice) + "}"


def _strategy(plc, tp_choice, dp_choice, zero) -> Strategy:
    """The candidate: the batch and the ``dp_choice`` names over ``dp``; the ``tp_choice`` names
    (or weights' dims) over ``tp``; ZeRO stage ``zero``."""
    axes = plc.axis_names
    logical = {"batch": "dp"} if "dp" in axes else {}
    param_sbp = []
    for where, choice in (("dp", dp_choice), ("tp", tp_choice)):
        if where not in axes:
            continue
        for o in choice:
            if isinstance(o, str):
                logical[o] = where
            else:
                nd = [_sbp.broadcast] * plc.ndim
                nd[axes.index(where)] = _sbp.split(o[1])
                param_sbp.append(("(^|/)" + re.escape(o[0]) + "$", tuple(nd)))
    return Strategy(plc, logical_axes=logical, param_sbp=param_sbp, zero=zero)


def _activation_names(seen) -> tuple[set, set, list[set]]:
    """From the names of a trace's ``constrain`` calls: every name (``"batch"`` excluded), the
    names that share a call with ``"batch"`` (they cannot go to the batch's axis), and each
    call's names where it has two or more (two of one call cannot go to one axis)."""
    flat = [
        {x for n in names for x in (n if isinstance(n, tuple) else (n,)) if isinstance(x, str)}
        for names in seen
    ]
    every = set().union(*flat) - {"batch"}
    mates = set().union(*(f for f in flat if "batch" in f)) - {"batch"}
    return every, mates, [f - {"batch"} for f in flat if len(f - {"batch"}) > 1]


def _forward(start, options, legal, run, score):
    """Forward selection from ``start``: add the option that lowers ``score(run(choice))`` most,
    while one does (``run`` is memoised by ``_Search.try_``). Ties go to the earlier option."""
    best = start
    while True:
        tries = [tuple(sorted(best + (o,), key=str)) for o in options if o not in best]
        tries = [c for c in tries if legal(c)]
        if not tries:
            return best
        c = min(tries, key=lambda c: score(run(c)))
        if not score(run(c)) < score(run(best)):
            return best
        best = c


def auto_strategy(
    placement: Placement,
    memory_budget=None,
    *,
    model,
    optimizer,
    loss_fn: Callable,
    batch: Any,
    accum: int = 1,
    cost_model: CostModel | None = None,
) -> Strategy:
    """``Strategy.auto`` (see there and the module docstring)."""
    cost_model = cost_model or DEFAULT_COST
    import time

    t0 = time.perf_counter()
    if not isinstance(placement, Placement):
        raise SbpError(f"Strategy.auto: placement must be a jsbp.placement, got {placement!r}.")
    budget = parse_bytes(memory_budget, "Strategy.auto")
    search = _Search(loss_fn, model, optimizer, batch, accum, cost_model, budget)
    total = sum(math.prod(_shape(_value(v))) * _itemsize(_value(v)) for _, v in search.flat)
    if budget is not None and budget < total / placement.size:
        raise SbpError(
            f"Strategy.auto: memory_budget={fmt_bytes(budget)} per device is less than the model and "
            f"optimizer state alone need split evenly over {placement.size} devices ({fmt_bytes(total)} / "
            f"{placement.size} = {fmt_bytes(total / placement.size)}), so no candidate strategy fits. Raise "
            "memory_budget to at least that (plus room for activations) or use more devices."
        )
    names = _model_names(search.flat)
    grids = _grids(placement)
    # the pure dp grid first: its trace records the activations' logical names
    dp_n, _, dp_plc = grids[0]
    search.try_(_name(dp_n, 1, "{}", 0), _strategy(dp_plc, (), (), 0))
    act_names, batch_mates, act_conflicts = _activation_names(search.names_seen)
    act_only = sorted(act_names - set(names))

    def score(c):
        return search.score(c) if c is not None else (math.inf,)

    # 1) tensor parallelism on the pure tp grid (the largest tp): the parameters' names (or, a
    #    model without names, its largest weights' dims): every legal set when there are few,
    #    else forward selection; then the names only activations carry (a sequence dim: context
    #    or sequence parallelism), added by forward selection to that best set and to none
    tp_choice: tuple = ()
    if len(grids) > 1:
        _, tp_n, tp_plc = grids[-1]
        options = (
            list(names)
            if names
            else [(p, d) for p, s in _big_matrices(search.flat) for d in (0, 1) if s[d] % tp_n == 0]
        )
        conflicts = _conflicts(search.flat, names) + act_conflicts  # planned, they would raise

        def legal(choice):
            ns = {o for o in choice if isinstance(o, str)}
            leaves = [o[0] for o in choice if not isinstance(o, str)]
            return len(set(leaves)) == len(leaves) and not any(len(c & ns) > 1 for c in conflicts)

        def run(choice):
            return search.try_(_name(1, tp_n, _desc(choice), 0), _strategy(tp_plc, choice, (), 0))

        if len(options) <= EXHAUSTIVE_OPTIONS:
            subsets = (
                c
                for k in range(len(options) + 1)
                for c in itertools.combinations(options, k)
                if legal(c)
            )
            tp_choice = min(subsets, key=lambda c: score(run(c)))
        else:
            tp_choice = _forward((), options, legal, run, score)
        if act_only:
            ends = [_forward(start, act_only, legal, run, score) for start in (tp_choice, ())]
            tp_choice = min(ends, key=lambda c: score(run(c)))
    # 2) every grid with that tensor parallelism
    plain = [
        (
            dp,
            tp,
            plc,
            search.try_(_name(dp, tp, _desc(tp_choice), 0), _strategy(plc, tp_choice, (), 0)),
        )
        for dp, tp, plc in grids
    ]
    # 3) on every grid with a dp axis, names also split over dp (experts: expert parallelism over
    #    the data axis), by forward selection; a name that shares an activation with "batch"
    #    cannot be. Then the ZeRO stages on top (without a budget: only on grids whose step is
    #    estimated within ZERO_SLACK of the best)
    dp_options = sorted((set(names) | act_names) - set(tp_choice) - batch_mates)
    best = []
    for dp, tp, plc, c in plain:
        if dp == 1 or c is None:
            continue

        def run_dp(choice, zero=0, dp=dp, tp=tp, plc=plc):
            return search.try_(
                _name(dp, tp, _desc(tp_choice), zero, choice),
                _strategy(plc, tp_choice, choice, zero),
            )

        # on a grid without tp, the tp names are free for dp
        opts = (
            dp_options if tp > 1 else sorted(set(dp_options) | {o for o in tp_choice if o in names})
        )
        dp_choice = _forward((), opts, lambda c: True, run_dp, score)
        best.append((run_dp(dp_choice), dp_choice, run_dp))
    best0 = min(c.estimate.seconds for c in search.candidates)
    for c, dp_choice, run_dp in best:
        if budget is None and c.estimate.seconds > ZERO_SLACK * best0:
            continue
        for zero in (1, 2, 3):
            run_dp(dp_choice, zero)
    if not search.candidates:
        raise SbpError(
            "Strategy.auto: no candidate strategy could be planned; the first error: "
            + (search.errors[0] if search.errors else "none recorded")
        )
    chosen = min(search.candidates, key=search.score)
    if not chosen.fits:
        e = chosen.estimate
        raise SbpError(
            f"Strategy.auto: no candidate strategy on {placement.size} devices fits memory_budget="
            f"{fmt_bytes(budget)} per device; the smallest predicted peak is {fmt_bytes(e.peak_bytes)} "
            f"({chosen.name}: {fmt_bytes(e.input_bytes)} state + batch, {fmt_bytes(e.activation_bytes)} "
            "live intermediates). Raise memory_budget to at least that, use more devices, or shrink the "
            "batch (or split it into micro-batches with accum=)."
        )
    lays = leaf_layouts(search.flat, chosen.strategy)
    plc = chosen.strategy.placement
    state_bytes = sum(
        math.prod(layout_of(plc, lays[p].stored, _shape(_value(v))).local_shape)
        * _itemsize(_value(v))
        for p, v in search.flat
    )
    report = AutoReport(
        search.candidates, chosen, budget, int(state_bytes), time.perf_counter() - t0
    )
    object.__setattr__(chosen.strategy, "report", report)
    return chosen.strategy


def _itemsize(value) -> int:
    dt = getattr(value, "dtype", None)
    if is_key_dtype(dt):
        return dt.itemsize
    return np.dtype(dt).itemsize


_AUTO.append(auto_strategy)  # Strategy.auto reaches the search here (see _strategy._AUTO)
