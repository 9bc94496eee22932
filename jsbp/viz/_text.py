"""Plain-text pictures for terminals: a tile grid drawn with box-drawing characters.

The text rendering carries the same facts as the HTML one (who holds which tile, the tile sizes,
P addends, the per-axis legend) in a form that survives logs and ``print``. It has no colour, so
it can be compared with exact snapshots; print it through ``rich`` if you want a frame around it.
"""

from __future__ import annotations

from .._layout import Layout
from ._model import TileGrid, axis_story, header
from ._svg import tile_lines

__all__ = ["grid_text", "legend_text"]


def legend_text(lay: Layout, indent: str = "  ") -> list[str]:
    """One line per placement axis: ``"ax0 (4): S(0)  cuts dim 0: 25 -> 7, 6, 6, 6"``."""
    plc = lay.placement
    labels = [f"{plc.axis_names[a]} ({plc.hierarchy[a]}): {lay.nd_sbp[a]}" for a in range(plc.ndim)]
    w = max(len(s) for s in labels)
    return [f"{indent}{s.ljust(w)}  {axis_story(lay, a)}" for a, s in enumerate(labels)]


def dims_caption(grid: TileGrid) -> str:
    if len(grid.dims) == 2:
        return f"rows: dim {grid.dims[0]} · columns: dim {grid.dims[1]}"
    if len(grid.dims) == 1:
        return f"dim {grid.dims[0]} (as a row)"
    return "scalar"


def grid_text(grid: TileGrid) -> list[str]:
    """The tiles as a box-drawing grid, row and column cut offsets on the margins."""
    nr, nc = max(1, len(grid.row_cuts)), max(1, len(grid.col_cuts))
    cells = [[tile_lines(grid, grid.tiles[i * nc + j]) for j in range(nc)] for i in range(nr)]
    col_heads = [f"{o}:{o + s}" for o, s in grid.col_cuts]
    row_heads = [f"{o}:{o + s}" for o, s in grid.row_cuts]
    widths = [max(len(line) for i in range(nr) for line in cells[i][j]) + 2 for j in range(nc)]
    widths = [max(w, len(h) + 2) for w, h in zip(widths, col_heads)] if col_heads else widths
    heights = [max(len(cells[i][j]) for j in range(nc)) for i in range(nr)]
    rw = max((len(h) for h in row_heads), default=0)
    pad = " " * (rw + 1) if rw else ""

    def rule(left, mid, right):
        return pad + left + mid.join("─" * w for w in widths) + right

    out = []
    if col_heads:
        out.append(pad + " " + " ".join(h.center(w) for h, w in zip(col_heads, widths)).rstrip())
    out.append(rule("┌", "┬", "┐"))
    for i in range(nr):
        for k in range(heights[i]):
            head = (row_heads[i] if k == 0 else "").rjust(rw) + " " if rw else ""
            body = "│".join(
                (" " + cells[i][j][k]).ljust(w) if k < len(cells[i][j]) else " " * w
                for j, w in enumerate(widths)
            )
            out.append(f"{head}│{body}│")
        out.append(rule("├", "┼", "┤") if i < nr - 1 else rule("└", "┴", "┘"))
    return out


def layout_text(grid: TileGrid, dtype: str, title: str = "GlobalTensor") -> list[str]:
    lay = grid.layout
    return [
        f"{title} {header(lay, dtype)}",
        *legend_text(lay),
        dims_caption(grid),
        *grid_text(grid),
    ]
