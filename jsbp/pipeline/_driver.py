"""The driver: execute a schedule's actions in time order and measure the live activations.

The driver knows nothing about models. It moves values between stages — a forward's output to
the next stage's input queue, a backward's input gradient to the previous stage's gradient queue,
each moved by the receiving stage (boxing across placements) — and keeps every stage's *stash*:
what a forward saved for its backward. After every action it reads the stash of every stage (how
many micro-batches, how many bytes per device) into a ``LiveSample``; the peaks reported for a
schedule are maxima over those samples, not a formula.

JAX dispatch is asynchronous and each stage runs on its own devices, so actions of different
stages that share a time slot also overlap on the devices: the loop only issues them in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .._errors import SbpError
from ._record import LiveSample, StepRecord
from ._schedule import Schedule

__all__ = ["StageLike", "run_schedule"]


class StageLike(Protocol):
    """What the driver needs of a stage (``jsbp.pipeline``'s ``Stage`` is one)."""

    def forward(self, microbatch: int, x: Any, t: Any = None) -> tuple[Any, Any]: ...
    def backward(self, stash: Any, dy: Any) -> Any: ...
    def receive(self, y: Any) -> Any: ...
    def receive_grad(self, dy: Any) -> Any: ...


def run_schedule(
    schedule: Schedule,
    stages: Sequence[StageLike],
    inputs: Sequence[Any],
    targets: Sequence[Any],
    seed,
) -> tuple[StepRecord, list[Any]]:
    """Run every action of ``schedule``; returns the measured record (losses still missing: they
    are filled by the caller once read) and the micro-batch losses as returned by the last stage.

    ``inputs[i]`` / ``targets[i]``: micro-batch ``i`` already on the first / last stage.
    ``seed(loss)``: the cotangent fed to the last stage's backward.
    """
    n, m = schedule.stages, schedule.microbatches
    if len(stages) != n or len(inputs) != m or len(targets) != m:
        raise SbpError(
            f"pipeline driver: schedule {schedule.name!r} is for {n} stages x {m} micro-batches, got "
            f"{len(stages)} stages, {len(inputs)} input and {len(targets)} target micro-batches."
        )
    x_queue: dict[tuple[int, int], Any] = {(0, i): inputs[i] for i in range(m)}
    dy_queue: dict[tuple[int, int], Any] = {}
    stash: list[dict[int, Any]] = [{} for _ in range(n)]
    nbytes: list[dict[int, int]] = [{} for _ in range(n)]
    losses: list[Any] = [None] * m
    samples: list[LiveSample] = []
    for a in schedule.actions:
        s, i = a.stage, a.microbatch
        st = stages[s]
        if a.kind == "F":
            x = x_queue.pop((s, i), None)
            if x is None:
                raise SbpError(
                    f"pipeline driver: {tuple(a)} runs before stage {s} received micro-batch {i}'s input."
                )
            if s == n - 1:
                loss, saved = st.forward(i, x, targets[i])
                losses[i] = loss
            else:
                y, saved = st.forward(i, x)
                x_queue[(s + 1, i)] = stages[s + 1].receive(y)
            stash[s][i] = saved
            nbytes[s][i] = saved.nbytes()
        else:
            saved = stash[s].pop(i, None)
            if saved is None:
                raise SbpError(
                    f"pipeline driver: {tuple(a)} runs but stage {s} holds no forward of micro-batch {i}."
                )
            nbytes[s].pop(i)
            if s == n - 1:
                dy = seed(losses[i])
            else:
                dy = dy_queue.pop((s, i), None)
                if dy is None:
                    raise SbpError(
                        f"pipeline driver: {tuple(a)} runs before stage {s + 1} sent micro-batch {i}'s gradient."
                    )
            dx = st.backward(saved, dy)
            del saved
            if s > 0:
                dy_queue[(s - 1, i)] = stages[s - 1].receive_grad(dx)
        samples.append(
            LiveSample(a, tuple(len(d) for d in stash), tuple(sum(d.values()) for d in nbytes))
        )
    left = [s for s in range(n) if stash[s]]
    if left or x_queue or dy_queue:
        raise SbpError(
            f"pipeline driver: schedule {schedule.name!r} left activations behind on stages {left}."
        )
    return StepRecord(schedule, tuple(samples), ()), losses
