"""``Pipeline``: stages of an NNX model on disjoint sub-placements, trained one batch at a time.

>>> pipe = jsbp.pipeline.Pipeline(                                   # doctest: +SKIP
...     [model.layers[:2], model.layers[2:]],     # stage 0 and stage 1 (modules or layer ranges)
...     loss_fn=lambda y, t: ((y - t) ** 2).mean(),
...     optimizer=optax.adam(1e-3),
...     microbatches=4,                           # required: there is no silent default
...     schedule="1f1b",                          # or "gpipe", "interleaved", a Schedule, a generator
...     placements=jsbp.pipeline.stage_placements(2, axes={"dp": 2, "tp": 2}),
... )
>>> loss = pipe.step(x, t)     # cut into 4 micro-batches, 1F1B, one optimizer update
>>> pipe.last_record           # the timeline with the measured live activations

OneFlow's semantics: one ``step`` takes the whole batch, cuts it into ``microbatches`` equal
micro-batches along dim 0, sums their gradients and applies one optimizer update, so the result
equals training on the whole batch at once (the loss is the mean of the micro-batch means).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .._errors import PlacementError, SbpError
from .._placement import placement as Placement
from .._tensor import GlobalTensor
from ..flax import Strategy
from ._driver import run_schedule
from ._placements import check_disjoint, stage_placements
from ._record import StepRecord
from ._schedule import Schedule, make_schedule
from ._stage import Stage, as_module, loss_seed

__all__ = ["Pipeline", "split_microbatches"]


def _is_global(x) -> bool:
    return isinstance(x, GlobalTensor)


def split_microbatches(tree, microbatches: int, *, what: str = "batch") -> list:
    """Cut every leaf of ``tree`` into ``microbatches`` equal pieces along dim 0.

    Host arrays are sliced on the host; global tensors are sliced in place (eager ops). Raises
    ``SbpError`` if the leaves disagree on the batch size or it is not a multiple of
    ``microbatches``.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_global)
    if not leaves:
        raise SbpError(
            f"pipeline: the {what} is empty ({tree!r}); pass arrays with a leading batch dim."
        )
    sizes = set()
    for x in leaves:
        shape = x.shape if _is_global(x) else np.shape(x)
        if len(shape) == 0:
            raise SbpError(
                f"pipeline: a {what} leaf is a scalar; every leaf needs a leading batch dim to cut micro-batches from."
            )
        sizes.add(shape[0])
    if len(sizes) != 1:
        raise SbpError(
            f"pipeline: the {what} leaves have different batch sizes {sorted(sizes)}; they must agree on dim 0."
        )
    n = sizes.pop()
    if n % microbatches:
        raise SbpError(
            f"pipeline: a {what} of {n} rows cannot be cut into microbatches={microbatches} equal micro-batches "
            f"along dim 0 ({n} % {microbatches} = {n % microbatches}); make the batch size a multiple of "
            f"{microbatches} (e.g. {n - n % microbatches} or {n - n % microbatches + microbatches}) or change microbatches."
        )
    k = n // microbatches
    out = []
    for i in range(microbatches):
        piece = [
            x[i * k : (i + 1) * k] if _is_global(x) else np.asarray(x)[i * k : (i + 1) * k]
            for x in leaves
        ]
        out.append(jax.tree_util.tree_unflatten(treedef, piece))
    return out


def _strategy(spec, rank: int, logical_axes) -> Strategy:
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, Placement):
        names = set(spec.axis_names)
        la = {}
        for k, v in dict(logical_axes or {}).items():
            axes = (v,) if isinstance(v, str) else tuple(v or ())
            la[k] = v if all(a in names for a in axes) else None
        return Strategy(spec, logical_axes=la)
    raise PlacementError(
        f"pipeline: placements[{rank}] is {spec!r}; give a jsbp.placement or a jsbp.flax.Strategy per rank "
        "(jsbp.pipeline.stage_placements(ranks, axes=...) makes disjoint placements)."
    )


class Pipeline:
    """Train a model cut into stages, each on its own sub-placement (see the module docstring).

    Arguments:
        stages: one entry per stage, each an ``nnx.Module`` or a list of modules applied in order.
            Stage ``s`` is called on stage ``s - 1``'s output; stage 0 on the micro-batch inputs.
            The entries may share sub-modules with a larger model: ``write_back()`` copies the
            trained values into them.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` (or ``loss_fn(outputs)`` when ``step`` gets
            no targets), run on the last stage; a mean over the micro-batch's rows.
        optimizer: an optax ``GradientTransformation``; each stage gets its own ``nnx.Optimizer``
            over its parameters (transforms that couple all parameters, such as global-norm
            clipping, see one stage at a time).
        microbatches: how many micro-batches a batch is cut into. Required.
        schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved"``, a ``Schedule`` or a
            generator ``f(stages, microbatches) -> Schedule``.
        placements: one ``jsbp.placement`` or ``jsbp.flax.Strategy`` per rank (per stage unless the
            schedule interleaves), pairwise disjoint; default one device per rank.
        logical_axes: Flax logical axis names -> placement axes, for ranks given as placements
            (names whose axes a placement lacks are not split there).
        remat: keep only each stage's input between forward and backward and recompute the rest.
    """

    def __init__(
        self,
        stages: Sequence[Any],
        loss_fn: Callable,
        optimizer,
        *,
        microbatches: int,
        schedule: Any = "1f1b",
        placements: Sequence[Any] | None = None,
        logical_axes: Mapping[str, Any] | None = None,
        remat: bool = False,
    ):
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise SbpError(f"Pipeline: microbatches must be a positive int, got {microbatches!r}.")
        if not isinstance(stages, (list, tuple)) or not stages:
            raise SbpError(
                f"Pipeline: stages must be a non-empty list (one entry per stage), got {stages!r:.80}."
            )
        if not callable(loss_fn):
            raise SbpError(f"Pipeline: loss_fn must be callable, got {loss_fn!r}.")
        if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
            raise SbpError(
                f"Pipeline: optimizer must be an optax GradientTransformation, got {optimizer!r}."
            )
        self.microbatches = microbatches
        modules = [as_module(s, i) for i, s in enumerate(stages)]
        self._schedule = make_schedule(schedule, len(modules), microbatches)
        ranks = self._schedule.ranks
        if placements is None:
            placements = stage_placements(ranks)
        placements = list(placements)
        if len(placements) != ranks:
            raise PlacementError(
                f"Pipeline: {len(placements)} placements for {ranks} ranks (schedule {self._schedule.name!r} runs "
                f"{len(modules)} stages on {ranks} ranks); give one placement per rank."
            )
        strategies = [_strategy(p, r, logical_axes) for r, p in enumerate(placements)]
        check_disjoint([s.placement for s in strategies])
        rank_of = self._schedule.rank_of
        self.stages = [
            Stage(i, len(modules), m, strategies[rank_of[i]], optimizer, loss_fn, remat=remat)
            for i, m in enumerate(modules)
        ]
        self.last_record: StepRecord | None = None
        self.steps = 0

    # -- schedule ----------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule:
        """The schedule the next ``step`` runs (assign a name, generator or Schedule to change it)."""
        return self._schedule

    @schedule.setter
    def schedule(self, spec) -> None:
        new = make_schedule(spec, len(self.stages), self.microbatches)
        if new.rank_of != self._schedule.rank_of:
            raise SbpError(
                f"Pipeline: schedule {new.name!r} puts stages on ranks {new.rank_of}, but this pipeline was built "
                f"with {self._schedule.rank_of}; build a new Pipeline for it."
            )
        self._schedule = new

    @property
    def placements(self) -> list[Placement]:
        """The placement of each stage."""
        return [s.placement for s in self.stages]

    # -- training ----------------------------------------------------------------------------
    def step(self, inputs, targets=None) -> float:
        """One optimizer update from a whole batch; returns the batch loss (a float).

        ``inputs`` (and ``targets``) are arrays or pytrees of arrays with the batch on dim 0 —
        host arrays or global tensors; they are cut into ``microbatches`` pieces, the pieces of
        ``inputs`` go to the first stage and those of ``targets`` to the last, and the schedule
        runs. The measured timeline is kept in ``last_record``.
        """
        m = self.microbatches
        xs = split_microbatches(inputs, m, what="batch of inputs")
        ts = (
            [None] * m
            if targets is None
            else split_microbatches(targets, m, what="batch of targets")
        )
        if targets is not None:
            nx = jax.tree_util.tree_leaves(inputs, is_leaf=_is_global)[0].shape[0]
            nt = jax.tree_util.tree_leaves(targets, is_leaf=_is_global)[0].shape[0]
            if nx != nt:
                raise SbpError(
                    f"Pipeline.step: inputs have {nx} rows but targets have {nt}; they must match on dim 0."
                )
        first, last = self.stages[0], self.stages[-1]
        xs = [first.put(x) for x in xs]
        ts = [None if t is None else last.put(t) for t in ts]
        for st in self.stages:
            st.begin_step()
        record, losses = run_schedule(
            self._schedule, self.stages, xs, ts, lambda loss: loss_seed(loss, m)
        )
        for st in self.stages:
            st.update()
        values = tuple(float(np.asarray(v.numpy() if _is_global(v) else v)) for v in losses)
        self.last_record = StepRecord(record.schedule, record.samples, values)
        self.steps += 1
        return self.last_record.loss

    def count_collectives(self, inputs, targets=None) -> list[dict[str, dict[str, int]]]:
        """Per stage, the collectives XLA emits in its ``"forward"``, ``"backward"`` and ``"update"``
        programs (``jsbp.debug.count_collectives``), compiled for the first micro-batch of this
        batch. Runs that micro-batch's forwards and backwards to get real arguments; parameters,
        optimizer state and ``last_record`` are left unchanged.

        Under data parallelism the backward has no all-reduce for parameter gradients (they stay
        partial sums across micro-batches); the update has them, once per batch.
        """
        m = self.microbatches
        x = self.stages[0].put(split_microbatches(inputs, m, what="batch of inputs")[0])
        t = None
        if targets is not None:
            t = self.stages[-1].put(split_microbatches(targets, m, what="batch of targets")[0])
        for st in self.stages:
            st.begin_step()
        n = len(self.stages)
        ins = []
        for s, st in enumerate(self.stages):  # each stage's input: the previous stage's output
            ins.append(x)
            if s < n - 1:
                y, _ = st.forward(0, x)
                x = self.stages[s + 1].receive(y)
        out: list = [None] * n
        dy = None
        for s in reversed(range(n)):  # backwards from the loss
            st = self.stages[s]
            seed = (lambda y: loss_seed(y, m)) if s == n - 1 else (lambda _y, dy=dy: dy)
            out[s], (_, dx) = st.count_collectives(ins[s], t if s == n - 1 else None, seed)
            if s > 0:
                dy = self.stages[s - 1].receive_grad(dx)
        for st in self.stages:
            st.begin_step()  # drop the probe's references
        return out

    # -- state -------------------------------------------------------------------------------
    @property
    def modules(self) -> list:
        """Each stage's module as trained (values are global tensors on the stage's placement)."""
        return [s.module for s in self.stages]

    def gather(self) -> list:
        """Each stage's module with plain logical values (e.g. to evaluate or save)."""
        return [s.gathered() for s in self.stages]

    def write_back(self) -> None:
        """Copy the trained values into the modules given to the constructor, in place (and so into
        the model they belong to)."""
        for s in self.stages:
            s.write_back()

    def __repr__(self) -> str:
        plcs = ", ".join(str(p.ranks.tolist()) for p in self.placements)
        return (
            f"Pipeline({len(self.stages)} stages on [{plcs}], microbatches={self.microbatches}, "
            f"schedule={self._schedule.name!r})"
        )
