"""Pipeline parallelism in the consistent view: stages on sub-placements, micro-batches, schedules.

A model is cut into stages (NNX modules or layer ranges); each stage lives on its own
sub-placement, so data and tensor parallelism inside a stage are just its layouts. One
``Pipeline.step`` cuts a batch into micro-batches, runs a schedule — GPipe, 1F1B or interleaved
1F1B, all plain data (``Schedule``: a tuple of ``Action(time, stage, microbatch, kind)``) — moving
activations and their gradients between stages by boxing across placements, and applies one
optimizer update. ``Schedule`` and ``StepRecord`` draw themselves as timelines (text and HTML)
with the bubble fraction and the measured live activations of every stage.

This package needs ``flax`` and ``optax``; the core package never imports it.
"""

from ._driver import run_schedule as run_schedule
from ._pipeline import Pipeline as Pipeline
from ._pipeline import split_microbatches as split_microbatches
from ._placements import check_disjoint as check_disjoint
from ._placements import stage_placements as stage_placements
from ._record import LiveSample as LiveSample
from ._record import StepRecord as StepRecord
from ._schedule import SCHEDULES as SCHEDULES
from ._schedule import Action as Action
from ._schedule import Schedule as Schedule
from ._schedule import from_orders as from_orders
from ._schedule import gpipe as gpipe
from ._schedule import interleaved_1f1b as interleaved_1f1b
from ._schedule import make_schedule as make_schedule
from ._schedule import one_f_one_b as one_f_one_b
from ._stage import Stage as Stage
from ._timeline import timeline_html as timeline_html
from ._timeline import timeline_text as timeline_text

__all__ = [
    "Pipeline",
    "Stage",
    "Schedule",
    "Action",
    "StepRecord",
    "LiveSample",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "from_orders",
    "make_schedule",
    "SCHEDULES",
    "stage_placements",
    "check_disjoint",
    "split_microbatches",
    "run_schedule",
    "timeline_text",
    "timeline_html",
]
