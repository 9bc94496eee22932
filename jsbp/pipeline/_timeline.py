"""The timeline picture of a schedule: ranks down, time slots across, ``F3`` / ``B3`` in each cell.

Two renderings carry the same facts: ``timeline_text`` (for terminals and logs) and
``timeline_html`` (self-contained HTML with inline SVG, for Jupyter: no script, no stylesheet,
text in ``currentColor`` and translucent fills, so it reads on light and dark themes, like
``jsbp.viz``). Given a measured ``StepRecord`` both add, under each rank, the number of
micro-batches whose activations it held after each slot, and a table of the measured peaks.

Every cell of the SVG is a ``<g class="jsbp-action">`` whose ``data-*`` attributes say what it
draws (``data-time``, ``data-rank``, ``data-stage``, ``data-microbatch``, ``data-kind``), and
every idle slot a ``<rect class="jsbp-idle">``, so tests can read the picture back.
"""

from __future__ import annotations

import html
from typing import Any

__all__ = ["timeline_text", "timeline_html", "format_bytes"]

# ``sch`` below is a ``jsbp.pipeline.Schedule`` (read by its attributes: this module is imported by
# ``_schedule``, which draws itself with it, so it does not import ``_schedule``)

FONT = "ui-monospace,SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono',monospace"
RULE = "rgba(127,127,127,0.35)"
FILL = {"F": (31, 119, 180), "B": (255, 127, 14)}  # forward blue, backward orange (both themes)
_CELL_W, _CELL_H, _LEFT, _TOP, _LIVE_H = 30, 22, 64, 18, 16


def esc(s) -> str:
    return html.escape(str(s), quote=True)


def format_bytes(n: int) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _label(sch: Any, a) -> str:
    chunk = a.stage // sch.ranks
    return f"{a.kind}{a.microbatch}" + (f"/{chunk}" if sch.chunks > 1 else "")


def summary(sch: Any) -> str:
    b = sch.bubble
    p, m = sch.ranks, sch.microbatches
    idle = sch.ranks * sch.makespan - len(sch.actions)
    head = (
        f"{sch.name}: {sch.stages} stage(s) on {p} rank(s) x {m} micro-batch(es), {sch.makespan} slots, "
        f"bubble {idle}/{sch.ranks * sch.makespan} = {float(b):.1%}"
    )
    if sch.chunks == 1:
        head += f" (GPipe's (p-1)/(m+p-1) = {p - 1}/{m + p - 1})"
    return head


def _live_per_rank(sch: Any, counts) -> list[int]:
    per = [0] * sch.ranks
    for s, c in enumerate(counts):
        per[sch.rank_of[s]] += c
    return per


def _peaks_rows(record) -> list[tuple[str, ...]]:
    sch = record.schedule
    rows = []
    for s in range(sch.stages):
        rows.append(
            (
                str(s),
                str(sch.rank_of[s]),
                str(record.peak_live[s]),
                format_bytes(record.peak_live_bytes[s]),
                format_bytes(record.microbatch_bytes[s]),
            )
        )
    return rows


_PEAK_HEAD = (
    "stage",
    "rank",
    "peak live micro-batches",
    "peak live bytes/device",
    "one micro-batch",
)


def timeline_text(sch: Any, record=None) -> str:
    """One row per rank, one column per slot; ``.`` is an idle slot (the bubble)."""
    grid = [["."] * sch.makespan for _ in range(sch.ranks)]
    for a in sch.actions:
        grid[sch.rank_of[a.stage]][a.time] = _label(sch, a)
    live = record.live_by_slot() if record is not None else None
    cells = [c for row in grid for c in row] + [str(sch.makespan - 1)]
    if live is not None:
        cells += [str(x) for t in live for x in _live_per_rank(sch, t)]
    w = max(len(c) for c in cells) + 1
    labels = [f"rank {r}" for r in range(sch.ranks)] + (
        [f"live r{r}" for r in range(sch.ranks)] if live else []
    )
    left = max(len(x) for x in labels + ["slot"])
    lines = [summary(sch)]
    lines.append("slot".ljust(left) + " " + "".join(str(t).rjust(w) for t in range(sch.makespan)))
    for r in range(sch.ranks):
        lines.append(f"rank {r}".ljust(left) + " " + "".join(c.rjust(w) for c in grid[r]))
    if live is not None:
        lines.append("measured live activations (micro-batches held) after each slot:")
        for r in range(sch.ranks):
            row = [str(_live_per_rank(sch, t)[r]) for t in live]
            lines.append(f"live r{r}".ljust(left) + " " + "".join(c.rjust(w) for c in row))
        rows = [_PEAK_HEAD] + _peaks_rows(record)
        ws = [max(len(row[i]) for row in rows) for i in range(len(_PEAK_HEAD))]
        for k, row in enumerate(rows):
            lines.append("  ".join(c.ljust(ws[i]) for i, c in enumerate(row)).rstrip())
            if k == 0:
                lines.append("  ".join("-" * x for x in ws))
        lines.append(
            f"batch loss {record.loss:.6g} (mean of {len(record.losses)} micro-batch losses)"
        )
    return "\n".join(lines)


def _text(x, y, s, *, anchor="middle", size=11, opacity=None) -> str:
    op = f' fill-opacity="{opacity}"' if opacity is not None else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" '
        f'fill="currentColor"{op}>{esc(s)}</text>'
    )


def timeline_svg(sch: Any, record=None) -> str:
    n, R = sch.makespan, sch.ranks
    live = record.live_by_slot() if record is not None else None
    lane = _CELL_H + (_LIVE_H if live is not None else 0) + 6
    width = _LEFT + n * _CELL_W + 4
    height = _TOP + R * lane + 2
    scale = max([1] + [max(_live_per_rank(sch, t)) for t in live]) if live is not None else 1
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="jsbp-timeline-svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="{esc(FONT)}">'
    ]
    step = 1 if n <= 40 else 5
    for t in range(0, n, step):
        out.append(_text(_LEFT + (t + 0.5) * _CELL_W, 12, t, size=9, opacity=0.7))
    by_slot = {(sch.rank_of[a.stage], a.time): a for a in sch.actions}
    for r in range(R):
        y = _TOP + r * lane
        out.append(_text(4, y + _CELL_H / 2 + 4, f"rank {r}", anchor="start"))
        for t in range(n):
            x = _LEFT + t * _CELL_W
            a = by_slot.get((r, t))
            if a is None:
                out.append(
                    f'<rect class="jsbp-idle" data-rank="{r}" data-time="{t}" x="{x + 1:.1f}" y="{y + 1:.1f}" '
                    f'width="{_CELL_W - 2}" height="{_CELL_H - 2}" fill="none" stroke="currentColor" '
                    f'stroke-opacity="0.25" stroke-dasharray="2 3"><title>rank {r}, slot {t}: idle (bubble)</title></rect>'
                )
                continue
            rgb = FILL[a.kind]
            chunk = a.stage // R
            alpha = 0.45 if sch.chunks == 1 else 0.25 + 0.45 * (chunk + 1) / sch.chunks
            what = "forward" if a.kind == "F" else "backward"
            tip = f"slot {t}: stage {a.stage} (rank {r}) runs the {what} of micro-batch {a.microbatch}"
            out.append(
                f'<g class="jsbp-action" data-time="{t}" data-rank="{r}" data-stage="{a.stage}" '
                f'data-microbatch="{a.microbatch}" data-kind="{a.kind}"><title>{esc(tip)}</title>'
                f'<rect x="{x + 1:.1f}" y="{y + 1:.1f}" width="{_CELL_W - 2}" height="{_CELL_H - 2}" rx="3" '
                f'fill="rgba({rgb[0]},{rgb[1]},{rgb[2]},{alpha:.2f})" stroke="currentColor" stroke-opacity="0.4"/>'
                + _text(x + _CELL_W / 2, y + _CELL_H / 2 + 4, _label(sch, a), size=10)
                + "</g>"
            )
        if live is not None:
            ly = y + _CELL_H + 2
            out.append(_text(4, ly + _LIVE_H - 4, "live", anchor="start", size=9, opacity=0.7))
            for t, counts in enumerate(live):
                c = _live_per_rank(sch, counts)[r]
                x = _LEFT + t * _CELL_W
                h = (_LIVE_H - 2) * c / scale
                out.append(
                    f'<g class="jsbp-live" data-rank="{r}" data-time="{t}" data-count="{c}">'
                    f"<title>rank {r} holds {c} micro-batch(es) of activations after slot {t} (measured)</title>"
                    f'<rect x="{x + 4:.1f}" y="{ly + _LIVE_H - 2 - h:.1f}" width="{_CELL_W - 8}" height="{h:.1f}" '
                    f'fill="currentColor" fill-opacity="0.3"/>'
                    + (_text(x + _CELL_W / 2, ly + _LIVE_H - 4, c, size=8) if c else "")
                    + "</g>"
                )
    out.append("</svg>")
    return "".join(out)


def _chip(kind: str, words: str) -> str:
    if kind == "idle":
        box = f"border:1px dashed {RULE}"
    else:
        rgb = FILL[kind]
        box = f"background:rgba({rgb[0]},{rgb[1]},{rgb[2]},0.45)"
    return (
        f'<span style="display:inline-block;width:12px;height:10px;border-radius:2px;{box};'
        f'margin:0 4px 0 10px;vertical-align:middle"></span>{esc(words)}'
    )


def _table(head, rows) -> str:
    cell = f'style="padding:2px 8px;border-bottom:1px solid {RULE};text-align:left"'
    th = "".join(f"<th {cell}>{esc(h)}</th>" for h in head)
    body = "".join(
        f'<tr class="jsbp-peak-row" data-stage="{esc(row[0])}" data-peak="{esc(row[2])}">'
        + "".join(f"<td {cell}>{esc(c)}</td>" for c in row)
        + "</tr>"
        for row in rows
    )
    return (
        f'<table class="jsbp-peaks" style="color:inherit;border-collapse:collapse;margin-top:6px;font-size:11px">'
        f"<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"
    )


def timeline_html(sch: Any, record=None) -> str:
    """The timeline as one self-contained ``<div>`` (inline SVG + a table of measured peaks)."""
    legend = _chip("F", "forward") + _chip("B", "backward") + _chip("idle", "idle (bubble)")
    if sch.chunks > 1:
        legend += '<span style="margin-left:10px;opacity:0.8">F3/1: micro-batch 3, chunk 1 of the rank</span>'
    body = (
        f'<div style="margin:4px 0;font-size:11px">{legend}</div>'
        f'<div style="overflow-x:auto">{timeline_svg(sch, record)}</div>'
    )
    if record is not None:
        body += _table(_PEAK_HEAD, _peaks_rows(record))
        body += (
            f'<div style="opacity:0.8;font-size:11px;margin-top:4px">measured after each action on the real '
            f"buffers; batch loss {record.loss:.6g} (mean of {len(record.losses)} micro-batch losses)</div>"
        )
    return (
        f'<div class="jsbp-viz jsbp-timeline" data-bubble="{sch.bubble_fraction!r}" style="display:inline-block;'
        f"font-family:{esc(FONT)};font-size:12px;line-height:1.4;padding:8px 10px;border:1px solid {RULE};"
        f'border-radius:6px;max-width:100%;overflow-x:auto">'
        f'<div class="jsbp-title" style="font-weight:600">pipeline schedule {esc(sch.name)}</div>'
        f'<div class="jsbp-subtitle" style="opacity:0.8">{esc(summary(sch))}</div>'
        + body
        + "</div>"
    )
