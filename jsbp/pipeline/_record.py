"""What the driver measured while it ran one schedule: live activations per stage over time.

After every action the driver counts, for each stage, the micro-batches whose saved activations
(the residuals the backward needs) it really holds, and the bytes those buffers take on one device
of the stage. Nothing here is derived from a formula: ``Schedule.live_counts`` is the prediction,
a ``StepRecord`` is the measurement.
"""

from __future__ import annotations

import dataclasses

from ._schedule import Action, Schedule
from ._timeline import timeline_html, timeline_text

__all__ = ["LiveSample", "StepRecord"]


@dataclasses.dataclass(frozen=True)
class LiveSample:
    """The state of every stage's activation stash right after ``action`` ran.

    ``counts[s]``: micro-batches whose activations stage ``s`` holds; ``nbytes[s]``: the bytes
    those buffers take on the fullest device of stage ``s``'s placement.
    """

    action: Action
    counts: tuple[int, ...]
    nbytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One optimizer step of a pipeline: its schedule, the measured live activations and the
    per-micro-batch losses. ``text()`` / ``_repr_html_`` draw the timeline with the measurement."""

    schedule: Schedule
    samples: tuple[LiveSample, ...]
    losses: tuple[float, ...]

    @property
    def loss(self) -> float:
        """The batch loss: the mean of the micro-batch losses (each a mean over its rows)."""
        return sum(self.losses) / len(self.losses)

    @property
    def peak_live(self) -> tuple[int, ...]:
        """Per stage, the most micro-batches whose activations it held at once (measured)."""
        n = self.schedule.stages
        return tuple(max((x.counts[s] for x in self.samples), default=0) for s in range(n))

    @property
    def peak_live_bytes(self) -> tuple[int, ...]:
        """Per stage, the most bytes of held activations on one of its devices (measured)."""
        n = self.schedule.stages
        return tuple(max((x.nbytes[s] for x in self.samples), default=0) for s in range(n))

    @property
    def microbatch_bytes(self) -> tuple[int, ...]:
        """Per stage, the bytes one micro-batch's activations take on one device (the measured
        stash right after a forward, minus what was there before, at its largest)."""
        n = self.schedule.stages
        out = [0] * n
        prev = [0] * n
        for x in self.samples:
            s = x.action.stage
            if x.action.kind == "F":
                out[s] = max(out[s], x.nbytes[s] - prev[s])
            prev = list(x.nbytes)
        return tuple(out)

    @property
    def peak_live_per_rank(self) -> tuple[int, ...]:
        """Per rank, the most micro-batch activations held at once over all its stages (differs
        from ``peak_live`` only for interleaved schedules)."""
        sch = self.schedule
        out = [0] * sch.ranks
        for x in self.samples:
            per = [0] * sch.ranks
            for s, c in enumerate(x.counts):
                per[sch.rank_of[s]] += c
            out = [max(a, b) for a, b in zip(out, per)]
        return tuple(out)

    def live_by_slot(self) -> list[tuple[int, ...]]:
        """``counts`` after the last action of each time slot (what the timeline draws)."""
        sch = self.schedule
        out: list[tuple[int, ...]] = []
        cur = (0,) * sch.stages
        it = iter(self.samples)
        nxt = next(it, None)
        for t in range(sch.makespan):
            while nxt is not None and nxt.action.time == t:
                cur = nxt.counts
                nxt = next(it, None)
            out.append(cur)
        return out

    def text(self) -> str:
        return timeline_text(self.schedule, self)

    def html(self) -> str:
        return timeline_html(self.schedule, self)

    def _repr_html_(self) -> str:
        return self.html()

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return (
            f"StepRecord(schedule={self.schedule.name!r}, loss={self.loss:.6g}, peak_live={self.peak_live}, "
            f"peak_live_bytes={self.peak_live_bytes})"
        )
