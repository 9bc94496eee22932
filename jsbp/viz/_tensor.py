"""Pictures of one global tensor: ``tensor_html`` (Jupyter) and ``tensor_text`` (terminals)."""

from __future__ import annotations

from .._layout import Layout
from ._html import figure, frame, legend_table, nd_chips, row
from ._model import as_layout, fmt_size, tile_grid
from ._svg import devices_svg, esc, tiles_svg
from ._text import dims_caption, layout_text

__all__ = ["tensor_html", "tensor_text", "layout_figure"]


def _device_info(lay: Layout) -> dict[int, str]:
    """Second label line of each device in the device grid: its block, and its addend under P."""
    out = {}
    ranks = lay.placement.ranks.reshape(-1).tolist()
    for r, coord, blk in zip(ranks, lay.coords, lay.blocks):
        s = fmt_size([n for _, n in blk])
        if lay.partial_axes and lay.n_addends > 1:
            s += f" #{lay.addend_index(coord)}"
        out[r] = s
    return out


def layout_figure(lay: Layout, dims=None, *, side: float = 320, caption: str | None = None) -> str:
    """The tiles of ``lay`` as a captioned ``<figure>`` (used by the tensor and boxing pictures)."""
    grid = tile_grid(lay, dims)
    cap = caption if caption is not None else esc(dims_caption(grid))
    return figure(cap, tiles_svg(grid, side=side), "jsbp-layout")


def tensor_html(t, dims=None) -> str:
    """HTML picture of a global tensor: its tiles, its devices and the nd-sbp legend.

    The logical tensor is drawn as tiles with their true (uneven) sizes; each tile is labelled and
    coloured by the devices holding it: devices sharing a tile hold copies (``B``), stacked cards
    are the addends of a partial value (``P``). ``dims`` picks the one or two tensor dims to draw
    (rows, columns) for tensors of 3 or more dims; the default draws the split dims.
    Self-contained: inline CSS and SVG only.
    """
    lay, dtype = as_layout(t)
    grid = tile_grid(lay, dims)
    sub = f"on {esc(lay.placement)} · sbp {nd_chips(lay.nd_sbp)}"
    if lay.partial_axes:
        sub += f' · <b class="jsbp-partial-note">{lay.n_addends} stacked addends ({esc(lay.partial_kind)})</b>'
    if grid.dims != tuple(range(len(lay.shape))):
        hidden = [d for d in range(len(lay.shape)) if d not in grid.dims]
        sub += f" · drawing dims {grid.dims}, dims {hidden} are not drawn"
    tiles = figure(esc(dims_caption(grid)), tiles_svg(grid), "jsbp-layout")
    notes = [lay.nd_sbp[a] for a in range(lay.placement.ndim)]
    devs = figure(
        "devices: colour = device, second line = its local block",
        devices_svg(lay.placement, _device_info(lay), notes),
        "jsbp-placement",
    )
    name = "GlobalTensor" if not isinstance(t, Layout) else "Layout"
    title = f"{name} {dtype}[{', '.join(map(str, lay.shape))}]"
    return frame("tensor", title, sub, row(tiles, devs) + legend_table(lay))


def tensor_text(t, dims=None) -> str:
    """Plain-text picture of a global tensor for terminals (same facts as ``tensor_html``).

    >>> print(jsbp.viz.tensor_text(jsbp.zeros(5, 2, placement=p, sbp="S(0)")))  # doctest: +SKIP
    GlobalTensor float32[5, 2] on cpu:2['ax0'] · sbp (S(0))
      ax0 (2): S(0)  cuts dim 0: 5 -> 3, 2
    rows: dim 0 · columns: dim 1
        0:2
       ┌─────┐
    0:3│ d0  │
    ...
    """
    lay, dtype = as_layout(t)
    name = "GlobalTensor" if not isinstance(t, Layout) else "Layout"
    return "\n".join(layout_text(tile_grid(lay, dims), dtype, name))
