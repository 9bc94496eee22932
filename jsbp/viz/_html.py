"""The HTML frame shared by every picture: a bordered box, a title, the nd-sbp legend table.

Only inline ``style`` attributes are used (no ``<style>`` block, no ``<script>``, no external
resource), so the output renders the same in JupyterLab, VS Code, nbviewer and exported HTML.
Colours are ``currentColor`` or translucent, so the box reads on light and dark themes.
"""

from __future__ import annotations

from .._layout import Layout
from ._model import axis_story, device_color
from ._svg import FONT, esc

__all__ = ["frame", "legend_table", "figure", "RULE"]

RULE = "rgba(127,127,127,0.35)"  # hairlines, visible on white and on black


def frame(kind: str, title: str, subtitle: str, body: str) -> str:
    return (
        f'<div class="jsbp-viz jsbp-{kind}" style="display:inline-block;font-family:{esc(FONT)};'
        f"font-size:12px;line-height:1.4;padding:8px 10px;border:1px solid {RULE};border-radius:6px;"
        f'max-width:100%;overflow-x:auto">'
        f'<div class="jsbp-title" style="font-weight:600">{esc(title)}</div>'
        + (f'<div class="jsbp-subtitle" style="opacity:0.8">{subtitle}</div>' if subtitle else "")
        + body
        + "</div>"
    )


def figure(caption: str, svg: str, cls: str = "") -> str:
    return (
        f'<figure class="jsbp-figure {cls}" style="margin:6px 0">{svg}'
        f'<figcaption style="opacity:0.75;font-size:11px">{caption}</figcaption></figure>'
    )


def row(*items: str, gap: int = 18, align: str = "flex-start") -> str:
    return f'<div style="display:flex;flex-wrap:wrap;gap:{gap}px;align-items:{align}">{"".join(items)}</div>'


def sbp_chip(s) -> str:
    """An SBP written with a tinted background: S blue, B green, P orange (same in both themes)."""
    text = str(s)
    hue = (
        (31, 119, 180) if text.startswith("S") else (44, 160, 44) if text == "B" else (255, 127, 14)
    )
    return (
        f'<span class="jsbp-sbp" style="background:rgba({hue[0]},{hue[1]},{hue[2]},0.22);'
        f'border-radius:3px;padding:0 4px">{esc(text)}</span>'
    )


def nd_chips(nd) -> str:
    return "(" + ", ".join(sbp_chip(s) for s in nd) + ")"


def legend_table(lay: Layout) -> str:
    """One row per placement axis: index, name, size, SBP and what the SBP does, with numbers."""
    plc = lay.placement
    cell = f'style="padding:2px 8px;border-bottom:1px solid {RULE};text-align:left"'
    head = "".join(f"<th {cell}>{h}</th>" for h in ("axis", "name", "size", "sbp", "what it does"))
    rows = "".join(
        f'<tr class="jsbp-legend-row" data-axis="{a}"><td {cell}>{a}</td><td {cell}>{esc(plc.axis_names[a])}</td>'
        f"<td {cell}>{plc.hierarchy[a]}</td><td {cell}>{sbp_chip(lay.nd_sbp[a])}</td>"
        f"<td {cell}>{esc(axis_story(lay, a))}</td></tr>"
        for a in range(plc.ndim)
    )
    return (
        f'<table class="jsbp-legend" style="color:inherit;border-collapse:collapse;margin-top:4px;font-size:11px">'
        f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    )


def swatch(rank: int) -> str:
    return (
        f'<span style="display:inline-block;width:10px;height:10px;border-radius:2px;'
        f'background:{device_color(rank, 0.7)};margin-right:3px"></span>d{rank}'
    )
