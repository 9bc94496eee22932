"""Pipeline schedules as data: which stage runs which micro-batch's forward or backward, and when.

A schedule is a tuple of ``Action(time, stage, microbatch, kind)`` with ``kind`` ``"F"`` or
``"B"``. Every action takes one time slot. A *stage* is one piece of the model; it runs on a
*rank* (one sub-placement of devices). Without interleaving stage ``s`` runs on rank ``s``; with
interleaving (``chunks`` model pieces per rank) stage ``s`` runs on rank ``s % ranks``.

Schedules are written as *orders*: for each rank, the sequence of ``(stage, microbatch, kind)``
it executes. ``from_orders`` turns orders into timed actions with the only two rules a pipeline
has: a rank does one thing at a time, in its order, and an action waits for its inputs (the
forward of the previous stage, or the backward of the next stage, of the same micro-batch; a
stage's backward also waits for its own forward). The generators below only write orders:

* ``gpipe``: every forward, then every backward (GPipe, and MindSpore's figure 2);
* ``one_f_one_b``: ``p - s - 1`` warm-up forwards on stage ``s``, then alternate one forward and
  one backward, so each micro-batch's backward runs as soon as possible and at most ``p - s``
  micro-batches are in flight on stage ``s`` (MindSpore's figure 3, PipeDream-flush);
* ``interleaved_1f1b``: Megatron-LM's interleaved order over ``chunks`` stages per rank, which
  divides the bubble by ``chunks``.

With every action one slot long, GPipe and 1F1B take ``2 (m + p - 1)`` slots for ``m``
micro-batches on ``p`` ranks, so their bubble fraction is ``(p - 1) / (m + p - 1)``; 1F1B wins on
memory, not on time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NamedTuple

from .._errors import SbpError
from ._timeline import timeline_html, timeline_text

__all__ = [
    "Action",
    "Schedule",
    "from_orders",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "make_schedule",
    "SCHEDULES",
]

FORWARD = "F"
BACKWARD = "B"


class Action(NamedTuple):
    """One slot of work: at ``time``, ``stage`` runs the forward (``"F"``) or backward (``"B"``)
    of ``microbatch``."""

    time: int
    stage: int
    microbatch: int
    kind: str

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}@s{self.stage}"


Step = tuple[int, int, str]
"""An untimed action in a rank's order: ``(stage, microbatch, kind)``."""


def _deps(stage: int, mb: int, kind: str, stages: int) -> list[Step]:
    """What an action needs before it can start (see the module docstring)."""
    if kind == FORWARD:
        return [(stage - 1, mb, FORWARD)] if stage > 0 else []
    own = (stage, mb, FORWARD)
    return [own] if stage == stages - 1 else [(stage + 1, mb, BACKWARD), own]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A timed pipeline schedule (see the module docstring); validated on construction.

    ``actions`` are sorted by ``(time, stage)``; ``rank_of[s]`` is the rank stage ``s`` runs on.
    ``text()`` and the HTML form (``_repr_html_``) draw it as a stage x time timeline.
    """

    name: str
    stages: int
    microbatches: int
    actions: tuple[Action, ...]
    rank_of: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(
            self,
            "actions",
            tuple(sorted((Action(*a) for a in self.actions), key=lambda a: (a.time, a.stage))),
        )
        object.__setattr__(self, "rank_of", tuple(int(r) for r in self.rank_of))
        _validate(self)

    # -- shape -------------------------------------------------------------------------------
    @property
    def ranks(self) -> int:
        """The number of device groups (sub-placements) the schedule runs on."""
        return max(self.rank_of) + 1

    @property
    def chunks(self) -> int:
        """Stages per rank (1 unless interleaved)."""
        return self.stages // self.ranks

    @property
    def makespan(self) -> int:
        """Slots from the first action's start to the last action's end."""
        return max(a.time for a in self.actions) + 1

    @property
    def bubble(self) -> Fraction:
        """Idle slots over all ``ranks x makespan`` slots, exactly."""
        total = self.ranks * self.makespan
        return Fraction(total - len(self.actions), total)

    @property
    def bubble_fraction(self) -> float:
        """``bubble`` as a float (correctly rounded, so it compares equal to ``(p-1)/(m+p-1)``)."""
        return float(self.bubble)

    def order(self, rank: int) -> list[Action]:
        """The actions of one rank, in time order."""
        return [a for a in self.actions if self.rank_of[a.stage] == rank]

    def live_counts(self) -> list[tuple[int, ...]]:
        """Micro-batches each stage holds activations for after each slot, *as the schedule
        implies* (a forward stashes, the backward frees). The pipeline driver measures the same
        thing on real buffers; this is the prediction to compare it with."""
        live = [0] * self.stages
        out = []
        by_time: dict[int, list[Action]] = {}
        for a in self.actions:
            by_time.setdefault(a.time, []).append(a)
        for t in range(self.makespan):
            for a in by_time.get(t, ()):
                live[a.stage] += 1 if a.kind == FORWARD else -1
            out.append(tuple(live))
        return out

    # -- pictures ----------------------------------------------------------------------------
    def text(self, record=None) -> str:
        """The timeline as text (one row per rank, one column per slot)."""
        return timeline_text(self, record)

    def html(self, record=None) -> str:
        """The timeline as self-contained HTML + SVG (no script)."""
        return timeline_html(self, record)

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return (
            f"Schedule(name={self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"ranks={self.ranks}, makespan={self.makespan}, bubble_fraction={self.bubble_fraction:.4f})"
        )


def _validate(s: Schedule) -> None:
    name = f"schedule {s.name!r}"
    if s.stages < 1 or s.microbatches < 1:
        raise SbpError(
            f"{name}: needs at least one stage and one micro-batch, got stages={s.stages}, microbatches={s.microbatches}."
        )
    if len(s.rank_of) != s.stages:
        raise SbpError(f"{name}: rank_of has {len(s.rank_of)} entries for {s.stages} stages.")
    seen: dict[Step, Action] = {}
    busy: dict[tuple[int, int], Action] = {}
    for a in s.actions:
        if a.kind not in (FORWARD, BACKWARD):
            raise SbpError(f"{name}: action {a} has kind {a.kind!r}; use 'F' or 'B'.")
        if not (0 <= a.stage < s.stages and 0 <= a.microbatch < s.microbatches) or a.time < 0:
            raise SbpError(
                f"{name}: action {tuple(a)} is outside {s.stages} stages x {s.microbatches} micro-batches (or before time 0)."
            )
        key = (a.stage, a.microbatch, a.kind)
        if key in seen:
            raise SbpError(
                f"{name}: {a.kind}{a.microbatch} of stage {a.stage} is scheduled twice (times {seen[key].time} and {a.time})."
            )
        seen[key] = a
        slot = (s.rank_of[a.stage], a.time)
        if slot in busy:
            raise SbpError(
                f"{name}: rank {slot[0]} runs two actions at time {a.time}: {tuple(busy[slot])} and {tuple(a)}."
            )
        busy[slot] = a
    missing = [
        f"{k}{m}@s{st}"
        for st in range(s.stages)
        for m in range(s.microbatches)
        for k in (FORWARD, BACKWARD)
        if (st, m, k) not in seen
    ]
    if missing:
        raise SbpError(
            f"{name}: every stage must run F and B of every micro-batch once; missing {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
            + "."
        )
    for a in s.actions:
        for d in _deps(a.stage, a.microbatch, a.kind, s.stages):
            if seen[d].time >= a.time:
                raise SbpError(
                    f"{name}: {tuple(a)} starts at time {a.time} but needs {tuple(seen[d])}, which has not "
                    "finished by then; an action must start after the actions it depends on."
                )


def from_orders(
    name: str,
    stages: int,
    microbatches: int,
    orders: Sequence[Sequence[Step]],
    rank_of: Sequence[int] | None = None,
) -> Schedule:
    """Time per-rank orders: each action starts as soon as its rank is free and its inputs exist.

    ``orders[r]`` lists rank ``r``'s ``(stage, microbatch, kind)`` steps in execution order;
    ``rank_of`` maps stages to ranks (default: stage ``s`` on rank ``s``). Raises ``SbpError`` if
    the orders deadlock (a rank waits for something that can only happen after it).
    """
    rank_of = tuple(range(stages)) if rank_of is None else tuple(rank_of)
    pos = [0] * len(orders)
    free = [0] * len(orders)
    end: dict[Step, int] = {}
    actions: list[Action] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                st, mb, kind = order[pos[r]]
                if rank_of[st] != r:
                    raise SbpError(
                        f"schedule {name!r}: rank {r}'s order contains stage {st}, which runs on rank {rank_of[st]}."
                    )
                deps = _deps(st, mb, kind, stages)
                if any(d not in end for d in deps):
                    break
                t = max([free[r]] + [end[d] for d in deps])
                actions.append(Action(t, st, mb, kind))
                end[(st, mb, kind)] = t + 1
                free[r] = t + 1
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: order[pos[r]] for r, order in enumerate(orders) if pos[r] < len(order)}
            raise SbpError(
                f"schedule {name!r}: the orders deadlock; each rank waits at {stuck} (stage, microbatch, kind)."
            )
    return Schedule(name, stages, microbatches, tuple(actions), rank_of)


def _check_counts(name: str, stages, microbatches) -> tuple[int, int]:
    for what, v in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise SbpError(f"{name}: {what} must be a positive int, got {v!r}.")
    return stages, microbatches


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: every rank runs all ``m`` forwards, then all ``m`` backwards (micro-batch order).

    Every stage holds all ``m`` micro-batches' activations at the turn; bubble ``(p-1)/(m+p-1)``.
    """
    p, m = _check_counts("gpipe", stages, microbatches)
    orders = [
        [(s, i, FORWARD) for i in range(m)] + [(s, i, BACKWARD) for i in range(m)] for s in range(p)
    ]
    return from_orders("gpipe", p, m, orders)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (MindSpore's order, PipeDream-flush): stage ``s`` runs ``min(p - s - 1, m)`` warm-up
    forwards, then one forward and one backward in turn, then the remaining backwards.

    Each micro-batch's backward starts as soon as its gradient arrives, so stage ``s`` never holds
    more than ``p - s`` micro-batches' activations (``<= p``), whatever ``m`` is.
    """
    p, m = _check_counts("1f1b", stages, microbatches)
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order: list[Step] = [(s, i, FORWARD) for i in range(warm)]
        for j in range(m - warm):
            order += [(s, warm + j, FORWARD), (s, j, BACKWARD)]
        order += [(s, i, BACKWARD) for i in range(m - warm, m)]
        orders.append(order)
    return from_orders("1f1b", p, m, orders)


def interleaved_1f1b(stages: int, microbatches: int, *, chunks: int = 2) -> Schedule:
    """Megatron-LM's interleaved 1F1B: ``stages = ranks * chunks`` model pieces, stage ``s`` on
    rank ``s % ranks``; each rank cycles through its chunks in groups of ``ranks`` micro-batches.

    The bubble shrinks to ``(p - 1) / (chunks * m + p - 1)`` at the price of ``chunks`` times
    more point-to-point transfers. Needs ``m`` to be a multiple of the number of ranks.
    """
    n, m = _check_counts("interleaved_1f1b", stages, microbatches)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise SbpError(f"interleaved_1f1b: chunks must be a positive int, got {chunks!r}.")
    if n % chunks:
        raise SbpError(
            f"interleaved_1f1b: {n} stages cannot be dealt to ranks in chunks={chunks} pieces each; "
            f"give a multiple of {chunks} stages (stage s runs on rank s % (stages // chunks))."
        )
    p, v = n // chunks, chunks
    if m % p:
        raise SbpError(
            f"interleaved_1f1b: {m} micro-batches on {p} ranks; the interleaved order walks micro-batches in "
            f"groups of {p}, so use a multiple of {p} micro-batches."
        )
    total = m * v

    def step(k: int, forward: bool, r: int) -> Step:
        c = (k % (p * v)) // p
        c = c if forward else v - 1 - c
        mb = (k // (p * v)) * p + k % p
        return (c * p + r, mb, FORWARD if forward else BACKWARD)

    orders = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [step(k, True, r) for k in range(warm)]
        for j in range(total - warm):
            order += [step(warm + j, True, r), step(j, False, r)]
        order += [step(k, False, r) for k in range(total - warm, total)]
        orders.append(order)
    return from_orders(f"interleaved_1f1b(chunks={v})", n, m, orders, [s % p for s in range(n)])


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "interleaved_1f1b": interleaved_1f1b,
}
"""Schedule names accepted wherever a schedule is asked for, and their generators."""


def make_schedule(spec, stages: int, microbatches: int) -> Schedule:
    """A ``Schedule`` for ``stages`` x ``microbatches`` from a name (``"gpipe"``, ``"1f1b"``,
    ``"interleaved"``), a generator ``f(stages, microbatches)`` or a ready ``Schedule`` (checked)."""
    if isinstance(spec, Schedule):
        sched = spec
    elif isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_")
        key = {"one_f_one_b": "1f1b", "pipedream_flush": "1f1b"}.get(key, key)
        if key not in SCHEDULES:
            raise SbpError(
                f"schedule {spec!r} is unknown; use one of {sorted(SCHEDULES)} or pass a Schedule / generator."
            )
        sched = SCHEDULES[key](stages, microbatches)
    elif callable(spec):
        sched = spec(stages, microbatches)
        if not isinstance(sched, Schedule):
            raise SbpError(
                f"schedule generator {spec!r} returned {type(sched).__name__}, not a jsbp.pipeline.Schedule."
            )
    else:
        raise SbpError(f"schedule must be a name, a generator or a Schedule, got {spec!r}.")
    if (sched.stages, sched.microbatches) != (stages, microbatches):
        raise SbpError(
            f"schedule {sched.name!r} is for {sched.stages} stages x {sched.microbatches} micro-batches, but the "
            f"pipeline has {stages} stages and {microbatches} micro-batches."
        )
    return sched
