"""A small NumPy oracle for SBP layouts, written independently of ``jsbp._layout``.

The oracle answers one question: for a logical value, a placement hierarchy and an nd-sbp, which
slice of the value does every device hold? It uses ``np.array_split`` (whose section sizes are the
balanced splitter: the first ``n % k`` pieces get one more) and applies the axes outer first, each
axis cutting the piece the previous axes left.

Partial values are built with non-trivial addends (not "value on device 0, zeros elsewhere") so a
boxing bug that drops or double-counts an addend shows up.
"""

from __future__ import annotations

import itertools
import os
import random
import re

import numpy as np

import jsbp

FULL = os.environ.get("JSBP_FULL", "") not in ("", "0")
"""Run the exhaustive grids (``JSBP_FULL=1``); the default run samples them."""

SBP_NAMES = ("S(0)", "S(1)", "B", "P")

_SPLIT = re.compile(r"S\((-?\d+)\)")


def split_dim(s: str) -> int | None:
    m = _SPLIT.fullmatch(s)
    return int(m.group(1)) if m else None


def piece_sizes(n: int, k: int) -> list[int]:
    """Balanced splitter via numpy: sizes of ``np.array_split`` of ``n`` items into ``k`` parts."""
    return [len(p) for p in np.array_split(np.arange(n), k)]


def coords(hierarchy):
    """Device coordinates in placement (row-major) order."""
    return list(itertools.product(*(range(h) for h in hierarchy)))


def device_index_ranges(shape, hierarchy, nd, coord):
    """For one device: a tuple of index arrays (one per tensor dim) it holds, outer axis first."""
    idx = [np.arange(n) for n in shape]
    for a, s in enumerate(nd):
        d = split_dim(s)
        if d is None:
            continue
        d = d % len(shape)
        idx[d] = np.array_split(idx[d], hierarchy[a])[coord[a]]
    return tuple(idx)


def local_slice(value: np.ndarray, hierarchy, nd, coord) -> np.ndarray:
    """The block of ``value`` that device ``coord`` holds under ``nd`` (P/B axes: the whole piece)."""
    idx = device_index_ranges(value.shape, hierarchy, nd, coord)
    return value[np.ix_(*idx)] if value.ndim else value


def local_shape(shape, hierarchy, nd, coord) -> tuple[int, ...]:
    return tuple(len(i) for i in device_index_ranges(shape, hierarchy, nd, coord))


def partial_axes(nd):
    return [a for a, s in enumerate(nd) if s == "P"]


def addend_id(hierarchy, nd, coord) -> int:
    """Which addend a device holds: its coordinates on the partial axes, mixed radix."""
    i = 0
    for a in partial_axes(nd):
        i = i * hierarchy[a] + coord[a]
    return i


def n_addends(hierarchy, nd) -> int:
    return int(np.prod([hierarchy[a] for a in partial_axes(nd)], dtype=np.int64))


def make_value(shape, seed: int = 0, dtype=np.float32) -> np.ndarray:
    """Integer-valued floats: sums of a few addends are exact in float32."""
    rng = np.random.default_rng(seed)
    return rng.integers(-50, 50, size=shape).astype(dtype)


def addends_for(value: np.ndarray, hierarchy, nd, seed: int = 1) -> list[np.ndarray]:
    """Full-shape addends whose sum is ``value``: random integers, the first one fixing the sum."""
    n = n_addends(hierarchy, nd)
    rng = np.random.default_rng(seed)
    extra = [rng.integers(-20, 20, size=value.shape).astype(value.dtype) for _ in range(n - 1)]
    first = value - sum(extra, np.zeros_like(value))
    return [first, *extra]


def expected_locals(value: np.ndarray, hierarchy, nd, seed: int = 1) -> list[np.ndarray]:
    """What every device holds (placement order); for P, that device's addend of ``value``."""
    adds = addends_for(value, hierarchy, nd, seed) if partial_axes(nd) else [value]
    return [
        local_slice(adds[addend_id(hierarchy, nd, c)], hierarchy, nd, c) for c in coords(hierarchy)
    ]


def global_from_oracle(value: np.ndarray, plc, nd, seed: int = 1):
    """A GlobalTensor built with ``from_local`` from the oracle's locals (non-trivial P addends)."""
    return jsbp.from_local(expected_locals(value, plc.hierarchy, nd, seed), placement=plc, sbp=nd)


def check_global(x, value: np.ndarray, nd) -> None:
    """Assert that ``x`` holds ``value`` laid out as ``nd`` on its placement, per the oracle.

    * the logical value (bit-exact unless a partial is involved, then allclose);
    * every local shape follows the balanced splitter, nested outer axis first;
    * every local is the oracle's slice; for P, the locals of devices that differ only on the
      partial axes sum to that slice.
    """
    plc = x.placement
    h = plc.hierarchy
    assert x.shape == value.shape, (x.shape, value.shape)
    assert tuple(str(s) for s in x.sbp) == tuple(
        f"S({split_dim(s) % value.ndim})" if split_dim(s) is not None else s for s in nd
    ), (x.sbp, nd)
    got = x.numpy()
    assert got.dtype == value.dtype, (got.dtype, value.dtype)
    if "P" in nd:
        np.testing.assert_allclose(got, value, rtol=1e-6, atol=1e-5)
    else:
        assert np.array_equal(got, value), f"logical value differs for sbp {nd} on {h}"
    locs = [np.asarray(a) for a in x.to_local()]
    cs = coords(h)
    assert len(locs) == len(cs), (len(locs), len(cs))
    for c, loc in zip(cs, locs):
        want = local_shape(value.shape, h, nd, c)
        assert loc.shape == want, (
            f"device {c}: local shape {loc.shape}, balanced splitter gives {want}"
        )
    if "P" not in nd:
        for c, loc in zip(cs, locs):
            assert np.array_equal(loc, local_slice(value, h, nd, c)), (
                f"device {c}: wrong block for {nd}"
            )
        return
    # partial: group devices by their coordinates on the non-partial axes and sum the group
    pax = partial_axes(nd)
    groups: dict[tuple, list[np.ndarray]] = {}
    for c, loc in zip(cs, locs):
        key = tuple(v for a, v in enumerate(c) if a not in pax)
        groups.setdefault(key, []).append(loc)
    for key, members in groups.items():
        assert len(members) == n_addends(h, nd)
        c = next(cc for cc in cs if tuple(v for a, v in enumerate(cc) if a not in pax) == key)
        np.testing.assert_allclose(
            np.sum(members, axis=0),
            local_slice(value, h, nd, c),
            rtol=1e-6,
            atol=1e-5,
            err_msg=f"partial addends of group {key} do not sum to the oracle's block for {nd}",
        )


def nd_sbps(ndim: int) -> list[tuple[str, ...]]:
    return list(itertools.product(SBP_NAMES, repeat=ndim))


def sample(items, fraction: float, seed: str):
    """A deterministic sample (by a string seed) of ``fraction`` of ``items``, at least one."""
    rnd = random.Random(seed)
    k = max(1, round(len(items) * fraction))
    return sorted(rnd.sample(list(items), k), key=list(items).index)
