"""Pictures of a placement: its devices as a grid, one axis across, the next one down."""

from __future__ import annotations

import numpy as np

from ._html import RULE, figure, frame
from ._svg import devices_svg, esc

__all__ = ["placement_html", "placement_text"]


def placement_html(p) -> str:
    """HTML picture of a placement: the device grid with axis names and sizes (self-contained)."""
    h = "×".join(str(n) for n in p.hierarchy)
    cell = f'style="padding:2px 8px;border-bottom:1px solid {RULE};text-align:left"'
    rows = "".join(
        f'<tr data-axis="{a}"><td {cell}>{a}</td><td {cell}>{esc(name)}</td><td {cell}>{n}</td></tr>'
        for a, (name, n) in enumerate(zip(p.axis_names, p.hierarchy))
    )
    table = (
        f'<table class="jsbp-axes" style="color:inherit;border-collapse:collapse;font-size:11px">'
        f"<thead><tr><th {cell}>axis</th><th {cell}>name</th><th {cell}>size</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )
    body = figure("dN = JAX device id N", devices_svg(p), "jsbp-placement") + table
    return frame(
        "placement", f"placement {p.type} · {h}", f"{p.size} devices · {esc(repr(p))}", body
    )


def placement_text(p) -> str:
    """Plain-text picture of a placement: the device ids in their grid (outer axes as blocks)."""
    h = p.hierarchy
    lines = [f"placement {p}: " + ", ".join(f"{n} ({k})" for n, k in zip(p.axis_names, h))]
    ranks = p.ranks
    w = max(len(f"d{r}") for r in ranks.reshape(-1).tolist())
    if p.ndim == 1:
        lines.append("  " + " ".join(f"d{r}".rjust(w) for r in ranks.tolist()))
        return "\n".join(lines)
    flat = ranks.reshape((-1,) + h[-2:])
    for k, outer in enumerate(np.ndindex(*h[:-2])):
        if outer:
            lines.append("  " + ", ".join(f"{p.axis_names[a]}={c}" for a, c in enumerate(outer)))
        for i in range(h[-2]):
            lines.append("  " + " ".join(f"d{r}".rjust(w) for r in flat[k, i].tolist()))
    return "\n".join(lines)
