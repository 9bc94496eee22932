"""How a global tensor goes to and comes from storage: an even, partial-free *storage layout*.

JAX (and so orbax / tensorstore) can only hold an even sharding of the logical shape. A jsbp
tensor may be uneven (balanced splits, padded per block) or partial (one addend per device).
Before writing, each tensor is boxed on its own placement to the closest layout JAX can represent
exactly: every split that divides its dim evenly is kept, every ``P`` axis is reduced onto an
evenly divisible dim when there is one (a reduce-scatter) and to ``B`` otherwise (an all-reduce),
and an uneven split moves to another dim that divides evenly, or becomes ``B``. In that layout the
physical array *is* the logical array (no padding, no addend dim), so orbax writes exactly the
logical value, each shard once, from the process that owns it. Big tensors with any evenly
divisible dim therefore never meet on one device. Loading runs the same idea backwards: read into
the storage layout of the target, then box locally (slice / zero-fill / all-to-all) to the target.
"""

from __future__ import annotations

import numpy as np

from .. import _sbp
from .._layout import Layout, layout_of
from .._placement import placement as Placement

__all__ = ["storage_layout", "placement_to_json", "placement_from_json"]


def storage_layout(lay: Layout) -> Layout:
    """The even, partial-free layout on ``lay.placement`` closest to ``lay`` (see module doc)."""
    h = lay.placement.hierarchy
    shape = lay.shape
    ways = [1] * len(shape)
    chosen: list[_sbp.Sbp | None] = [None] * len(h)

    def fits(d: int, a: int) -> bool:
        return shape[d] % (ways[d] * h[a]) == 0

    # 1. keep every split that stays even (in axis order: that is the hierarchical order).
    for a, s in enumerate(lay.nd_sbp):
        if s.is_split and fits(s.dim, a):
            chosen[a] = s
            ways[s.dim] *= h[a]
        elif s.is_broadcast:
            chosen[a] = s
    # 2. P and uneven S: split another dim that divides evenly (largest first), else B.
    by_size = sorted(range(len(shape)), key=lambda d: -shape[d])
    for a in range(len(h)):
        if chosen[a] is not None:
            continue
        for d in by_size:
            if shape[d] > 0 and fits(d, a):
                chosen[a] = _sbp.Split(d)
                ways[d] *= h[a]
                break
        else:
            chosen[a] = _sbp.broadcast
    out = layout_of(lay.placement, tuple(chosen), lay.shape)
    assert out.is_even and not out.partial_axes, out
    return out


def placement_to_json(plc: Placement) -> dict:
    return {"type": plc.type, "ranks": plc.ranks.tolist(), "axis_names": list(plc.axis_names)}


def placement_from_json(d: dict) -> Placement:
    return Placement(d["type"], d["ranks"], tuple(d["axis_names"]))


def describe_placement_json(d: dict) -> str:
    h = "x".join(str(n) for n in np.shape(d["ranks"]))
    return f"{d['type']}:{h}{d['axis_names']} ranks {d['ranks']}"
