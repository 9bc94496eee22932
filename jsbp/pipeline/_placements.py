"""Sub-placements for pipeline stages: carve the devices into one disjoint grid per rank.

A pipeline rank is an ordinary ``jsbp.placement`` over a subset of the devices; data and tensor
parallelism inside a stage are the axes of that placement (``pp=2 x dp=2 x tp=2`` on 8 devices is
two ``(dp, tp) = (2, 2)`` placements, ``[[0, 1], [2, 3]]`` and ``[[4, 5], [6, 7]]``). Two ranks
never share a device: a stage's programs would otherwise queue behind another stage's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from .._errors import PlacementError
from .._placement import placement as Placement

__all__ = ["stage_placements", "check_disjoint"]


def stage_placements(
    ranks: int,
    *,
    axes: Mapping[str, int] | None = None,
    device_type: str | None = None,
    devices: Sequence[int] | None = None,
) -> list[Placement]:
    """``ranks`` disjoint placements, each a grid of ``axes`` (e.g. ``{"dp": 2, "tp": 2}``).

    ``devices``: the device ids to use, in order (default: every device of ``device_type``, whose
    default is the default backend's). Rank ``r`` takes the ``r``-th consecutive block of
    ``prod(axes)`` ids; with no ``axes`` each rank is one device. Raises ``PlacementError`` when
    there are fewer devices than ranks (or than ``ranks x prod(axes)``).

    >>> stage_placements(2, axes={"dp": 2, "tp": 2})  # doctest: +SKIP
    [placement(type='cpu', ranks=[[0, 1], [2, 3]], ...), placement(type='cpu', ranks=[[4, 5], [6, 7]], ...)]
    """
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise PlacementError(f"stage_placements: ranks must be a positive int, got {ranks!r}.")
    axes = dict(axes or {})
    for name, size in axes.items():
        if (
            not isinstance(name, str)
            or isinstance(size, bool)
            or not isinstance(size, int)
            or size < 1
        ):
            raise PlacementError(
                f"stage_placements: axes must map names to positive ints, got {name!r}: {size!r}."
            )
    dtype = device_type or jax.default_backend()
    if devices is None:
        devices = [d.id for d in jax.devices(dtype)]
    devices = [int(d) for d in devices]
    per = math.prod(axes.values()) if axes else 1
    if ranks > len(devices):
        raise PlacementError(
            f"stage_placements: {ranks} pipeline stages need at least {ranks} devices, but there are only "
            f"{len(devices)} ({dtype}: {devices}); use fewer stages or more devices (each stage needs its own)."
        )
    if ranks * per > len(devices):
        shape = " x ".join(f"{k}={v}" for k, v in axes.items())
        raise PlacementError(
            f"stage_placements: pp={ranks} x {shape} needs {ranks * per} devices, but there are only "
            f"{len(devices)} ({dtype}); shrink the stages or the per-stage axes."
        )
    names = tuple(axes) if axes else None
    shape = tuple(axes.values()) if axes else (1,)
    out = []
    for r in range(ranks):
        ids = np.array(devices[r * per : (r + 1) * per]).reshape(shape)
        out.append(Placement(dtype, ids, axis_names=names))
    return out


def check_disjoint(placements: Sequence[Placement]) -> None:
    """Raise ``PlacementError`` if two ranks' placements share a device or differ in device type."""
    owner: dict[int, int] = {}
    for r, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise PlacementError(
                f"pipeline: rank {r}'s placement must be a jsbp.placement, got {p!r}."
            )
        if p.type != placements[0].type:
            raise PlacementError(
                f"pipeline: rank {r} is on {p.type} devices but rank 0 is on {placements[0].type}; "
                "put every stage on one device type."
            )
        shared = sorted(int(d) for d in p.ranks.reshape(-1) if int(d) in owner)
        if shared:
            other = owner[shared[0]]
            raise PlacementError(
                f"pipeline: the placement of rank {r} (devices {p.ranks.tolist()}) overlaps rank {other}'s "
                f"(devices {placements[other].ranks.tolist()}) on device(s) {shared}; every stage needs its own "
                "devices. "
                "jsbp.pipeline.stage_placements(...) carves disjoint ones."
            )
        for d in p.ranks.reshape(-1):
            owner[int(d)] = r
