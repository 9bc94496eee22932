"""The geometry every picture is drawn from: which device holds which tile of the logical tensor.

Nothing here knows about HTML or text. A ``TileGrid`` is the logical tensor restricted to the one or
two dims being drawn, cut into the product grid of the blocks jsbp really uses (OneFlow's balanced
splitter, so uneven and empty blocks are drawn with their true sizes). Each ``Tile`` lists its
``Layer`` s: the distinct things the devices over that tile hold.

* devices that hold the *same* data (``B`` on some axis) share one layer;
* devices that hold different *addends* of the tile (``P``) are different layers, stacked;
* devices that hold different slices along a dim that is not drawn are different layers too.

Why a product grid: the block a device holds along dim ``d`` depends only on its coordinates on the
axes that split ``d``, so the cut points of every dim are independent of the others.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence

import numpy as np

from .. import _sbp
from .._errors import SbpError
from .._layout import Layout, balanced

__all__ = [
    "Layer",
    "Tile",
    "TileGrid",
    "tile_grid",
    "choose_dims",
    "as_layout",
    "device_color",
    "fmt_bytes",
    "fmt_size",
    "axis_story",
    "header",
]


@dataclasses.dataclass(frozen=True)
class Layer:
    """One distinct piece of data over a tile and the devices (JAX ids) that hold it."""

    devices: tuple[int, ...]
    addend: int  # index of the addend (0 when the layout has no partial axis)
    hidden: tuple[
        tuple[int, int, int], ...
    ]  # (dim, offset, size) along the dims not drawn, when cut


@dataclasses.dataclass(frozen=True)
class Tile:
    """A rectangle of the drawn dims: ``rows`` / ``cols`` are ``(offset, size)`` or ``None``."""

    rows: tuple[int, int] | None
    cols: tuple[int, int] | None
    layers: tuple[Layer, ...]

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(r for layer in self.layers for r in layer.devices)

    @property
    def empty(self) -> bool:
        return any(iv is not None and iv[1] == 0 for iv in (self.rows, self.cols))

    def size_text(self) -> str:
        parts = [str(iv[1]) for iv in (self.rows, self.cols) if iv is not None]
        return "×".join(parts) if parts else "scalar"


@dataclasses.dataclass(frozen=True)
class TileGrid:
    """The drawn picture of a layout: tiles in row-major order over ``row_cuts`` x ``col_cuts``."""

    layout: Layout
    dims: tuple[int, ...]  # (), (col_dim,) or (row_dim, col_dim)
    row_cuts: tuple[tuple[int, int], ...]  # () when no row dim is drawn
    col_cuts: tuple[tuple[int, int], ...]  # () for a scalar
    tiles: tuple[Tile, ...]

    @property
    def partial(self) -> str | None:
        return self.layout.partial_kind

    @property
    def n_addends(self) -> int:
        return self.layout.n_addends if self.layout.partial_axes else 1


def as_layout(x) -> tuple[Layout, str]:
    """``(layout, dtype name)`` of a ``GlobalTensor`` (or anything with ``.layout``) or a ``Layout``."""
    if isinstance(x, Layout):
        return x, ""
    lay = getattr(x, "layout", None)
    if not isinstance(lay, Layout):
        raise TypeError(
            f"jsbp.viz draws global tensors (or their Layout); got {type(x).__name__}. "
            "Make one with jsbp.tensor(value, placement=p, sbp=...)."
        )
    try:
        dt = np.dtype(x.dtype).name
    except TypeError:
        dt = str(x.dtype)
    return lay, dt


def choose_dims(lay: Layout, dims) -> tuple[int, ...]:
    """The dims to draw: ``dims`` normalised, or by default the split dims, then the last dims.

    A 0-d tensor draws no dim (one tile), a 1-d tensor its only dim as a row; for 3 or more dims
    the default shows the (first two) split dims, completed with the last dims.
    """
    rank = len(lay.shape)
    if dims is None:
        if rank <= 2:
            return tuple(range(rank))
        pick = [d for d in range(rank) if lay.splitters[d]][:2]
        for d in reversed(range(rank)):
            if len(pick) < 2 and d not in pick:
                pick.append(d)
        return tuple(sorted(pick))
    if isinstance(dims, int):
        dims = (dims,)
    try:
        dims = tuple(operator.index(d) for d in dims)
    except TypeError:
        raise SbpError(
            f"dims must be a tuple of one or two ints, e.g. dims=(0, 1); got {dims!r}."
        ) from None
    out = tuple(d + rank if d < 0 else d for d in dims)
    if rank == 0 and not out:
        return ()
    if not 1 <= len(out) <= 2 or len(set(out)) != len(out) or not all(0 <= d < rank for d in out):
        valid = (
            f"one or two distinct dims in {list(range(-rank, rank))}"
            if rank
            else "none (a scalar has no dims)"
        )
        raise SbpError(
            f"dims={dims!r} cannot be drawn for a tensor of shape {lay.shape}; choose {valid}, "
            "e.g. dims=(0, 1) to draw dims 0 (rows) and 1 (columns)."
        )
    return out


def tile_grid(lay: Layout, dims=None) -> TileGrid:
    """Cut ``lay`` into tiles over the drawn ``dims`` (see ``choose_dims``)."""
    dims = choose_dims(lay, dims)
    ranks = lay.placement.ranks.reshape(-1).tolist()
    row_dim, col_dim = (None, dims[0]) if len(dims) == 1 else (dims + (None, None))[:2]
    hidden_dims = [d for d in range(len(lay.shape)) if d not in dims and lay.splitters[d]]

    def cuts(d):
        if d is None:
            return ()
        return tuple(sorted({blk[d] for blk in lay.blocks}))

    row_cuts, col_cuts = cuts(row_dim), cuts(col_dim)
    if not dims:
        col_cuts = ()
    groups: dict = {}
    for i, (coord, blk) in enumerate(zip(lay.coords, lay.blocks)):
        key = (
            blk[row_dim] if row_dim is not None else None,
            blk[col_dim] if col_dim is not None else None,
        )
        hidden = tuple((d, blk[d][0], blk[d][1]) for d in hidden_dims)
        addend = lay.addend_index(coord) if lay.partial_axes else 0
        groups.setdefault(key, {}).setdefault((hidden, addend), []).append(ranks[i])
    tiles = []
    for r in row_cuts or (None,):
        for c in col_cuts or (None,):
            layers = groups.get((r, c), {})
            tiles.append(
                Tile(
                    r,
                    c,
                    tuple(
                        Layer(tuple(devs), addend, hidden)
                        for (hidden, addend), devs in sorted(
                            layers.items(), key=lambda kv: (kv[0][1], kv[0][0])
                        )
                    ),
                )
            )
    return TileGrid(lay, dims, row_cuts, col_cuts, tuple(tiles))


# -------------------------------------------------------------------------------------------
# colours and words shared by the HTML and text renderings
# -------------------------------------------------------------------------------------------

_PALETTE = (  # Tableau 10: distinct, and readable as translucent fills on light and dark pages
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)


def device_color(rank: int, alpha: float = 0.4) -> str:
    """A translucent CSS colour for device ``rank`` (stable across pictures: keyed by device id)."""
    if rank < len(_PALETTE):
        r, g, b = _PALETTE[rank]
        return f"rgba({r},{g},{b},{alpha})"
    hue = (rank * 137.508) % 360
    return f"hsla({hue:.0f},65%,50%,{alpha})"


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact integers below 1 KiB (``"700 B"``)."""
    n = float(n)
    if n < 1024:
        return f"{n:.0f} B" if n == int(n) else f"{n:.1f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError


def fmt_size(shape: Sequence[int]) -> str:
    return "×".join(str(n) for n in shape) if len(shape) else "scalar"


def _axis_label(lay: Layout, a: int) -> str:
    return f"{lay.placement.axis_names[a]} ({lay.placement.hierarchy[a]})"


def axis_story(lay: Layout, a: int) -> str:
    """What axis ``a``'s SBP does, with the numbers: e.g. ``"cuts dim 0: 25 -> 7, 6, 6, 6"``."""
    h = lay.placement.hierarchy
    x = lay.nd_sbp[a]
    k = h[a]
    if x.is_split:
        d = x.dim
        before = [b for b in lay.splitters[d] if b < a]
        pieces = [lay.shape[d]]
        for b in before:
            pieces = [c for p in pieces for c in balanced(p, h[b])]
        if len(pieces) == 1:
            return f"cuts dim {d}: {pieces[0]} -> {', '.join(map(str, balanced(pieces[0], k)))}"
        shown = sorted(set(pieces), reverse=True)
        parts = "; ".join(f"{p} -> {', '.join(map(str, balanced(p, k)))}" for p in shown)
        return f"cuts each of the {len(pieces)} pieces of dim {d} again: {parts}"
    if x.is_broadcast:
        return f"broadcast: {k} devices hold the same data"
    what = {"sum": "sum", "max": "max", "min": "min"}[x.reduce]
    return f"partial {what}: {k} addends, the value is their {what}"


def header(lay: Layout, dtype: str) -> str:
    shape = ", ".join(str(n) for n in lay.shape)
    return f"{dtype}[{shape}] on {lay.placement} · sbp {_sbp.nd_str(lay.nd_sbp)}"


def layer_words(layer: Layer, grid: TileGrid, new_addend: bool) -> str:
    """One line for a layer: ``"d0 d1"``, ``"+ d4 d5"`` (the next addend), ``"dim2 0:3: d0"``."""
    devs = " ".join(f"d{r}" for r in layer.devices)
    hidden = " ".join(f"dim{d} {o}:{o + s}" for d, o, s in layer.hidden)
    prefix = ""
    if grid.partial and new_addend:
        prefix = {"sum": "+ ", "max": "· ", "min": "· "}[grid.partial]
    return f"{prefix}{hidden + ': ' if hidden else ''}{devs}"


def partial_words(grid: TileGrid) -> str:
    kind = grid.partial
    n = grid.n_addends
    return {"sum": f"P: sum of {n}", "max": f"Pmax: max of {n}", "min": f"Pmin: min of {n}"}[kind]


def n_bytes(lay: Layout, itemsize: int) -> int:
    return math.prod(lay.shape) * itemsize
