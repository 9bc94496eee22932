"""Inline SVG for tile grids and device grids, readable on light and dark pages.

Theme safety comes from two choices, so no stylesheet or script is needed: every stroke and every
piece of text uses ``currentColor`` (the notebook's own text colour), and every fill is a
translucent device colour that reads on white and on black alike.

Each tile is a ``<g class="jsbp-tile">`` whose ``data-*`` attributes state what it draws
(``data-devices``, ``data-rows``, ``data-cols``, ``data-size``, ``data-layers``), so the picture can be
checked by parsing it; its ``<title>`` is the full description shown on hover.
"""

from __future__ import annotations

import html

import numpy as np

from ._model import Tile, TileGrid, device_color, layer_words, partial_words

__all__ = ["esc", "tiles_svg", "devices_svg", "FONT"]

FONT = "ui-monospace,SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono',monospace"
_FS = 11  # font size of labels (px)
_CH = 6.7  # approximate advance of one monospace character at _FS
_LINE = 13
_STACK = 5  # offset between stacked cards (px)
_MAX_CARDS = 4
STROKE = 'stroke="currentColor" stroke-opacity="0.55"'


def esc(s) -> str:
    return html.escape(str(s), quote=True)


def _wrap(words: str, width_px: float) -> list[str]:
    """Wrap a space separated line into lines of at most ``width_px`` (keeps a leading '+ ')."""
    cap = max(3, int(width_px // _CH))
    out, cur = [], ""
    for w in words.split(" "):
        if cur and len(cur) + 1 + len(w) > cap:
            out.append(cur)
            cur = "  " + w if words[:2] in ("+ ", "· ") else w
        else:
            cur = f"{cur} {w}" if cur else w
    out.append(cur)
    return out


def tile_lines(grid: TileGrid, tile: Tile) -> list[str]:
    """The label lines of a tile, unwrapped (also used by the text rendering)."""
    lines = [partial_words(grid)] if grid.partial else []
    prev = None
    for layer in tile.layers:
        lines.append(layer_words(layer, grid, new_addend=prev is not None and layer.addend != prev))
        prev = layer.addend
    size = tile.size_text()
    lines.append(f"{size} empty" if tile.empty else size)
    return lines


def _tracks(sizes: list[int], total_px: float, min_px: float) -> list[float]:
    n = sum(sizes)
    return [max(min_px, total_px * s / n) if n else min_px for s in sizes]


def svg_text(x, y, s, *, anchor="start", opacity=None, weight=None, size=_FS) -> str:
    """An SVG ``<text>`` in the current colour (``opacity``, ``weight``: optional)."""
    extra = f' fill-opacity="{opacity}"' if opacity is not None else ""
    extra += f' font-weight="{weight}"' if weight else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'fill="currentColor"{extra}>{esc(s)}</text>'
    )


def _card_fill(devices, x, y, w, h) -> str:
    """Vertical stripes, one per device holding the card (one stripe: a plain fill)."""
    if not devices or w <= 0 or h <= 0:
        return ""
    sw = w / len(devices)
    return "".join(
        f'<rect x="{x + i * sw:.1f}" y="{y:.1f}" width="{sw:.1f}" height="{h:.1f}" fill="{device_color(r)}"/>'
        for i, r in enumerate(devices)
    )


def _tile_svg(grid: TileGrid, tile: Tile, x, y, w, h) -> str:
    layers = tile.layers
    m = min(len(layers), _MAX_CARDS)
    o = _STACK if m > 1 else 0
    cw, chh = w - (m - 1) * o - 2, h - (m - 1) * o - 2
    x, y = x + 1, y + 1
    cls = ["jsbp-tile"]
    if grid.partial:
        cls.append("jsbp-partial")
    if tile.empty:
        cls.append("jsbp-empty")
    lines = tile_lines(grid, tile)
    title = f"{' / '.join(lines)}"
    if tile.rows is not None or tile.cols is not None:
        where = ", ".join(
            f"{o_}:{o_ + s}" for o_, s in (iv for iv in (tile.rows, tile.cols) if iv is not None)
        )
        title = f"[{where}] {title}"
    attrs = {
        "class": " ".join(cls),
        "data-devices": " ".join(str(r) for r in tile.devices),
        "data-size": tile.size_text(),
        "data-layers": str(len(layers)),
    }
    if tile.rows is not None:
        attrs["data-rows"] = f"{tile.rows[0]}:{sum(tile.rows)}"
    if tile.cols is not None:
        attrs["data-cols"] = f"{tile.cols[0]}:{sum(tile.cols)}"
    out = [
        "<g "
        + " ".join(f'{k}="{esc(v)}"' for k, v in attrs.items())
        + f"><title>{esc(title)}</title>"
    ]
    dash = ' stroke-dasharray="4 3"' if tile.empty else ""
    # back cards first: only their visible L-shaped rim (top and right strips), so fills never stack
    for k in range(m - 1):
        xk, yk = x + (m - 1 - k) * o, y + k * o
        pts = [
            (xk, yk),
            (xk + cw, yk),
            (xk + cw, yk + chh),
            (xk + cw - o, yk + chh),
            (xk + cw - o, yk + o),
            (xk, yk + o),
        ]
        fill = device_color(layers[m - 1 - k].devices[0])  # the front card is layer 0
        out.append(
            f'<polygon class="jsbp-card" points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in pts)}" '
            f'fill="{fill}" {STROKE}/>'
        )
    fx, fy = x, y + (m - 1) * o
    if not tile.empty:
        out.append(_card_fill(layers[0].devices if layers else (), fx, fy, cw, chh))
    out.append(
        f'<rect class="jsbp-card" x="{fx:.1f}" y="{fy:.1f}" width="{cw:.1f}" height="{chh:.1f}" '
        f'fill="none" {STROKE}{dash}/>'
    )
    # labels: wrapped to the card, cut to its height (the <title> keeps the full text)
    wrapped = []
    for i, line in enumerate(lines):
        bold = i == 0 and grid.partial is not None
        wrapped.extend((s, bold) for s in _wrap(line, cw - 8))
    fit = max(1, int((chh - 4) // _LINE))
    if len(wrapped) > fit:  # keep what fits and end with an ellipsis
        if fit > 1:
            wrapped = wrapped[: fit - 1] + [("…", False)]
        else:
            first, bold = wrapped[0]
            wrapped = [(first[: max(1, int((cw - 8) // _CH) - 1)] + "…", bold)]
    for i, (s, bold) in enumerate(wrapped):
        out.append(svg_text(fx + 4, fy + 4 + _FS + i * _LINE, s, weight="600" if bold else None))
    out.append("</g>")
    return "".join(out)


def tiles_svg(grid: TileGrid, *, side: float = 320) -> str:
    """The logical tensor as tiles: proportional sizes (a minimum keeps small tiles readable)."""
    rows = [s for _, s in grid.row_cuts]
    cols = [s for _, s in grid.col_cuts]
    m = min(max((len(t.layers) for t in grid.tiles), default=1), _MAX_CARDS)
    stack = (m - 1) * _STACK
    min_row = 2 * _LINE + 10 + stack
    if grid.partial:
        min_row += _LINE * min(len(grid.tiles[0].layers), 3)
    # columns wide enough for the longest label line (up to 24 characters; longer lines wrap)
    longest = max((len(line) for t in grid.tiles for line in tile_lines(grid, t)), default=0)
    min_col = max(46, min(longest, 24) * _CH + 12) + stack
    R, C = sum(rows), sum(cols)
    if rows and cols:
        if R >= C:
            H, W = side, max(side * C / R if R else side, 140)
        else:
            W, H = side, max(side * R / C if C else side, 90)
    else:
        W, H = (side if cols else 150), 0
    ws = _tracks(cols, W, min_col) if cols else [150.0]
    hs = _tracks(rows, H, min_row) if rows else [max(min_row, 46.0)]
    left = (
        (max(len(str(n)) for n in [0] + [o + s for o, s in grid.row_cuts]) * _CH + 8) if rows else 4
    )
    top = 16 if cols else 4
    width, height = left + sum(ws) + 4, top + sum(hs) + 4
    out = [
        f'<svg class="jsbp-tiles" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.1f} {height:.1f}" font-family="{esc(FONT)}" role="img">'
    ]
    # ticks: cut offsets along each drawn dim
    if cols:
        xs = [left] + [left + v for v in _cumsum(ws)]
        for (o, _), xv in zip(grid.col_cuts, xs):
            out.append(svg_text(xv + 2, top - 4, o, opacity="0.7", size=9))
        out.append(svg_text(xs[-1], top - 4, C, anchor="end", opacity="0.7", size=9))
    if rows:
        ys = [top] + [top + v for v in _cumsum(hs)]
        for (o, _), yv in zip(grid.row_cuts, ys):
            out.append(svg_text(left - 4, yv + 9, o, anchor="end", opacity="0.7", size=9))
        out.append(svg_text(left - 4, ys[-1], R, anchor="end", opacity="0.7", size=9))
    nc = len(ws)
    y = top
    for i, h in enumerate(hs):
        x = left
        for j, w in enumerate(ws):
            out.append(_tile_svg(grid, grid.tiles[i * nc + j], x, y, w, h))
            x += w
        y += h
    out.append("</svg>")
    return "".join(out)


def _cumsum(xs):
    acc, out = 0.0, []
    for v in xs:
        acc += v
        out.append(acc)
    return out


def devices_svg(plc, info=None, axis_notes=None) -> str:
    """The placement's devices as a grid: axis -1 across, axis -2 down, outer axes as blocks.

    ``info`` maps a device id to a second label line (e.g. its local block); ``axis_notes`` gives a
    note per axis (e.g. its SBP), printed next to the axis name.
    """
    h = plc.hierarchy
    names = plc.axis_names
    ranks = plc.ranks
    n = len(h)
    cols = h[-1] if n else 1
    rows = h[-2] if n >= 2 else 1
    outer = list(np.ndindex(*h[:-2])) if n > 2 else [()]
    cw = max([40.0] + [(len(s) + 2) * _CH for s in (info or {}).values()])
    ch = 2 * _LINE + 10 if info else _LINE + 14

    def note(a):
        s = f"{names[a]} ({h[a]})"
        if axis_notes is not None:
            s += f": {axis_notes[a]}"
        return s

    heads = [f"→ {note(n - 1)}"] if n else []
    if n >= 2:
        heads.append(f"↓ {note(n - 2)}")
    heads += [f"▦ {note(a)}: one block per index" for a in range(n - 2)]
    left, top = 4, len(heads) * _LINE + 6
    block_gap = 8
    width = max(left + cols * cw + 4, left + max((len(t) for t in heads), default=0) * _CH + 8)
    per_block = rows * ch + (_LINE + 2 + block_gap if n > 2 else 0)
    height = top + len(outer) * per_block + 4
    out = [
        f'<svg class="jsbp-devices" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.1f} {height:.1f}" font-family="{esc(FONT)}" role="img">'
    ]
    for k, t in enumerate(heads):
        out.append(svg_text(left, _LINE * (k + 1), t, opacity="0.85"))
    y0 = top
    for oc in outer:
        if n > 2:
            label = ", ".join(f"{names[a]}={c}" for a, c in enumerate(oc))
            out.append(svg_text(left, y0 + _LINE - 2, label, opacity="0.7", size=10))
            y0 += _LINE + 2
        for i in range(rows):
            for j in range(cols):
                idx = tuple(oc) + ((i, j) if n >= 2 else (j,) if n == 1 else ())
                r = int(ranks[idx])
                x, y = left + j * cw, y0 + i * ch
                out.append(
                    f'<g class="jsbp-device" data-device="{r}" data-coord="{",".join(map(str, idx))}">'
                    f"<title>device {r} at {esc(', '.join(f'{names[a]}={c}' for a, c in enumerate(idx)))}</title>"
                    f'<rect x="{x + 1:.1f}" y="{y + 1:.1f}" width="{cw - 2:.1f}" height="{ch - 2:.1f}" rx="4" '
                    f'fill="{device_color(r)}" {STROKE}/>'
                )
                out.append(
                    svg_text(x + cw / 2, y + 4 + _FS, f"d{r}", anchor="middle", weight="600")
                )
                if info and r in info and info[r]:
                    out.append(
                        svg_text(
                            x + cw / 2,
                            y + 4 + _FS + _LINE,
                            info[r],
                            anchor="middle",
                            opacity="0.85",
                            size=10,
                        )
                    )
                out.append("</g>")
        y0 += rows * ch + (block_gap if n > 2 else 0)
    out.append("</svg>")
    return "".join(out)
