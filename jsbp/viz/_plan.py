"""Tables of a plan (``jsbp.explain``): one row per equation, boxings highlighted, totals.

The renderer is duck-typed, so any planner can feed it. The interface:

**plan**: a sequence of rows, or an object (or mapping) with ``rows`` and optionally ``totals``.

**row**: an object with attributes, or a mapping with keys:

=============  ========================================================================  =========
field          meaning                                                                   required
=============  ========================================================================  =========
``primitive``  the JAX primitive's name, e.g. ``"dot_general"``                          yes
``in_sbps``    one nd-sbp per input: a tuple of ``Sbp`` / strings, or a string such as    yes
               ``"(S(0), B)"``; ``None`` for an input that is not a global tensor
``signature``  the chosen signature; its ``str`` is shown, e.g. ``"(S(0), B) -> S(0)"``  yes
``boxing``     the boxings inserted before the equation (empty or ``None``: none); each   no
               is a *boxing entry* (below)
``out_sbps``   one nd-sbp per output                                                     no
``name``       a label shown under the primitive (a variable, a source line)            no
``depth``      nesting level for equations of nested jaxprs (indents the primitive)      no
=============  ========================================================================  =========

**boxing entry**: an object, a mapping or a ``(kind, axes, bytes_per_device)`` tuple, with
``kind`` (``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"``, ``"all-to-all"``, or ``None`` /
``"local"`` for no communication), ``axes`` (placement axes: ints or names) and
``bytes_per_device`` (bytes received per device). A core ``jsbp._boxing.Move`` works as is
(``collective`` is read as ``kind``), and so does an object with ``moves`` (a sequence of such
entries) and an optional ``operand`` (the input index it boxes), like the compiler's ``Boxing``.

**totals** (optional): an object or mapping with ``bytes_per_device`` and ``collectives`` (a mapping
``kind -> count``); computed from the rows when absent.

>>> jsbp.viz.plan_text([
...     {"primitive": "dot_general", "in_sbps": ["(S(0))", "(B)"], "signature": "(S(0), B) -> S(0)"},
...     {"primitive": "reduce_sum", "in_sbps": ["(S(0))"], "signature": "(S(0)) -> P",
...      "boxing": [("all-reduce", (0,), 2048.0)]},
... ])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from .. import _sbp
from ._html import RULE, frame
from ._model import fmt_bytes
from ._svg import esc

__all__ = ["plan_html", "plan_text", "PlanRow", "BoxingEntry", "normalise_plan"]

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class BoxingEntry:
    """One boxing step as the tables show it."""

    kind: str | None  # a collective's name, or None for local work
    axes: tuple
    bytes_per_device: float
    operand: int | None = None

    def words(self) -> str:
        on = f"in{self.operand}: " if self.operand is not None else ""
        axes = ", ".join(map(str, self.axes))
        return f"{on}{self.kind or 'local'} [{axes}]"


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """A row, normalised from whatever the planner gave."""

    primitive: str
    in_sbps: tuple[str, ...]
    signature: str
    boxing: tuple[BoxingEntry, ...]
    out_sbps: tuple[str, ...] | None
    name: str | None
    depth: int

    @property
    def collectives(self) -> tuple[BoxingEntry, ...]:
        return tuple(b for b in self.boxing if b.kind)

    @property
    def bytes_per_device(self) -> float:
        return float(sum(b.bytes_per_device for b in self.boxing))


def _get(obj, name, default=_MISSING):
    if isinstance(obj, Mapping):
        value = obj.get(name, default)
    else:
        value = getattr(obj, name, default)
    if value is _MISSING:
        raise TypeError(
            f"plan row {obj!r} has no {name!r}; a row needs primitive, in_sbps and signature "
            "(see jsbp.viz._plan's docstring for the interface)."
        )
    return value


def _nd_words(nd) -> str:
    if nd is None:
        return "-"
    if isinstance(nd, str):
        return nd
    if isinstance(nd, _sbp.Sbp):
        return f"({nd})"
    return _sbp.nd_str(tuple(_sbp.parse(s) for s in nd))


def _entries(b, operand=None):
    moves = None if isinstance(b, tuple) else _get(b, "moves", None)
    if moves is not None:
        op = _get(b, "operand", None)
        for mv in moves:
            yield from _entries(mv, op)
        return
    if isinstance(b, tuple):
        kind, axes, nbytes = b
    else:
        kind = _get(b, "kind", None)
        if kind is None:
            kind = _get(b, "collective", None)
        axes = _get(b, "axes", ())
        nbytes = _get(b, "bytes_per_device", 0.0)
    if kind == "local":
        kind = None
    op = (
        operand
        if operand is not None
        else (None if isinstance(b, tuple) else _get(b, "operand", None))
    )
    yield BoxingEntry(
        kind, tuple(axes) if not isinstance(axes, (int, str)) else (axes,), float(nbytes), op
    )


def _entry_list(boxing) -> list:
    """The boxing field as a list of entries (it may also be one entry, or None)."""
    if boxing is None:
        return []
    single_tuple = (
        isinstance(boxing, tuple)
        and len(boxing) == 3
        and (boxing[0] is None or isinstance(boxing[0], str))
        and isinstance(boxing[2], (int, float))
    )
    if isinstance(boxing, (list, tuple)) and not single_tuple:
        return list(boxing)
    return [boxing]


def normalise_plan(plan) -> tuple[tuple[PlanRow, ...], dict]:
    """``(rows, totals)`` from a plan in the duck-typed interface (see the module docstring)."""
    rows_in = plan if isinstance(plan, Sequence) else _get(plan, "rows")
    totals_in = None if isinstance(plan, Sequence) else _get(plan, "totals", None)
    rows = []
    for r in rows_in:
        boxing = _entry_list(_get(r, "boxing", None))
        outs = _get(r, "out_sbps", None)
        rows.append(
            PlanRow(
                primitive=str(_get(r, "primitive")),
                in_sbps=tuple(_nd_words(s) for s in _get(r, "in_sbps")),
                signature=str(_get(r, "signature")),
                boxing=tuple(e for b in boxing for e in _entries(b)),
                out_sbps=None if outs is None else tuple(_nd_words(s) for s in outs),
                name=_get(r, "name", None),
                depth=int(_get(r, "depth", 0) or 0),
            )
        )
    kinds = Counter(b.kind for r in rows for b in r.collectives)
    totals = {"bytes_per_device": sum(r.bytes_per_device for r in rows), "collectives": dict(kinds)}
    if totals_in is not None:
        nbytes = _get(totals_in, "bytes_per_device", None)
        colls = _get(totals_in, "collectives", None)
        if nbytes is not None:
            totals["bytes_per_device"] = float(nbytes)
        if colls is not None:
            totals["collectives"] = {k: v for k, v in dict(colls).items() if v}
    return tuple(rows), totals


def _totals_words(rows, totals) -> str:
    n_box = sum(1 for r in rows if r.boxing)
    colls = totals["collectives"]
    what = ", ".join(f"{k} ×{v}" for k, v in sorted(colls.items())) or "no collectives"
    return (
        f"{len(rows)} equation{'s' if len(rows) != 1 else ''} · {n_box} with boxing · {what} · "
        f"{fmt_bytes(totals['bytes_per_device'])} received per device"
    )


def plan_text(plan) -> str:
    """The plan as an aligned text table; rows with a collective are marked ``*``."""
    rows, totals = normalise_plan(plan)
    head = ("", "#", "primitive", "inputs", "signature", "boxing", "bytes/device")
    table = [head]
    for i, r in enumerate(rows):
        mark = "*" if r.collectives else ""
        box = "; ".join(b.words() for b in r.boxing) or "-"
        table.append(
            (
                mark,
                str(i + 1),
                "  " * r.depth + r.primitive,
                ", ".join(r.in_sbps),
                r.signature,
                box,
                fmt_bytes(r.bytes_per_device) if r.boxing else "-",
            )
        )
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.append(f"total: {_totals_words(rows, totals)}")
    return "\n".join(lines)


def plan_html(plan) -> str:
    """The plan as an HTML table: rows with a collective tinted and marked, totals at the end."""
    rows, totals = normalise_plan(plan)
    cell = f"padding:2px 8px;border-bottom:1px solid {RULE};text-align:left;vertical-align:top"
    head = "".join(
        f'<th style="{cell}">{h}</th>'
        for h in ("#", "primitive", "inputs", "signature", "boxing", "bytes / device")
    )
    body = []
    for i, r in enumerate(rows):
        if r.collectives:
            cls, tint = (
                "jsbp-row jsbp-boxed",
                "background:rgba(255,127,14,0.16);box-shadow:inset 3px 0 rgba(255,127,14,0.9)",
            )
        elif r.boxing:
            cls, tint = "jsbp-row jsbp-local-boxing", "background:rgba(127,127,127,0.08)"
        else:
            cls, tint = "jsbp-row", ""
        prim = f'<span style="padding-left:{12 * r.depth}px">{esc(r.primitive)}</span>'
        if r.name:
            prim += f'<div style="opacity:0.7;font-size:10px">{esc(r.name)}</div>'
        sig = esc(r.signature)
        if r.out_sbps is not None:
            sig += f'<div style="opacity:0.7;font-size:10px">out {esc(", ".join(r.out_sbps))}</div>'
        box = (
            "<br>".join(
                (f"<b>{esc(b.words())}</b>" if b.kind else esc(b.words())) for b in r.boxing
            )
            or '<span style="opacity:0.5">-</span>'
        )
        nbytes = (
            esc(fmt_bytes(r.bytes_per_device)) if r.boxing else '<span style="opacity:0.5">-</span>'
        )
        body.append(
            f'<tr class="{cls}" data-collectives="{len(r.collectives)}" style="{tint}">'
            f'<td style="{cell}">{i + 1}</td><td style="{cell}">{prim}</td>'
            f'<td style="{cell}">{esc(", ".join(r.in_sbps))}</td><td style="{cell}">{sig}</td>'
            f'<td style="{cell}">{box}</td><td style="{cell}">{nbytes}</td></tr>'
        )
    table = (
        f'<table class="jsbp-plan" style="color:inherit;border-collapse:collapse;font-size:11px;margin-top:4px">'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )
    foot = f'<div class="jsbp-totals" style="margin-top:4px;font-weight:600">{esc(_totals_words(rows, totals))}</div>'
    return frame("plan", "plan", "tinted rows run a collective before the equation", table + foot)
