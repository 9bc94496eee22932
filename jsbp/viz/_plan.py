"""Tables of a plan (``jsbp.explain``): one row per equation, boxings highlighted, totals.

``jsbp.explain(fn, *args)`` returns a plan this module renders as is (``Plan._repr_html_`` calls
``plan_html``). The renderer is duck-typed, so any planner can feed it; the interface:

**plan**: a sequence of rows, or an object (or mapping) with ``rows`` and optionally
``output_boxings`` (boxing entries applied to the function's outputs, shown as ``(output)`` rows),
``placement`` (shown in the title) and totals: either ``totals`` (``bytes_per_device`` and
``collectives``, a mapping ``kind -> count``) or ``explain``'s ``collectives()`` method and
``total_bytes_per_device``. Totals are computed from the rows when none are given.

**row**: an object with attributes, or a mapping with keys:

=============  ========================================================================  =========
field          meaning                                                                   required
=============  ========================================================================  =========
``primitive``  the JAX primitive's name, e.g. ``"dot_general"``                          yes
``inputs``     one nd-sbp per operand as it arrives: a string such as ``"(S(0), B)"`` or  yes
               a tuple of ``Sbp`` / strings; ``None`` for an operand that is not global
               (``in_sbps`` is accepted too)
``signature``  the chosen signature; its ``str`` is shown, e.g. ``"(S(0), B) -> S(0)"``  yes
``boxings``    the boxing entries inserted before the equation (``boxing`` is accepted)  no
``outputs``    one nd-sbp per output (``out_sbps`` is accepted)                          no
``depth``      nesting level of equations of nested jaxprs (indents the primitive)       no
``name``       a label shown under the primitive (a variable, a source line)            no
``note``       how the op runs, shown with the primitive (``"ring over 'x'"``)          no
``collectives``  the collectives the op's own implementation runs (names, or tuples    no
               whose first item is the name), e.g. a ring's ``"collective-permute"``s;
               shown in their own column, counted in the totals
=============  ========================================================================  =========

**boxing entry**: an object, a mapping, or a ``(kind, axes, bytes_per_device)`` tuple, with

* the collectives: ``collectives`` (a sequence of names, empty for local work), or one ``kind``
  (or ``collective``): ``"all-gather"``, ``"all-reduce"``, ``"reduce-scatter"``, ``"all-to-all"``,
  ``None`` / ``"local"`` for no communication;
* ``axes``: placement axes (ints or names), or one tuple of axes per move;
* ``bytes_per_device``: bytes received per device;
* optionally ``operand`` (the input index), ``src`` / ``dst`` (nd-sbps or layouts) and ``reused``.

A core ``jsbp._boxing.Move`` and ``jsbp.explain``'s ``BoxingRow`` are both boxing entries.

>>> jsbp.viz.plan_text([
...     {"primitive": "dot_general", "inputs": ["(S(0))", "(B)"], "signature": "(S(0), B) -> S(0)"},
...     {"primitive": "reduce_sum", "inputs": ["(S(0))"], "signature": "(S(0)) -> P",
...      "boxings": [("all-reduce", (0,), 2048.0)]},
... ])  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from .. import _sbp
from .._layout import Layout
from ._html import RULE, frame
from ._model import fmt_bytes
from ._svg import esc

__all__ = ["plan_html", "plan_text", "PlanRow", "BoxingEntry", "normalise_plan"]

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class BoxingEntry:
    """One boxing as the tables show it."""

    kinds: tuple[str, ...]  # the collectives it runs (empty: local work only)
    axes: str  # the placement axes, as shown
    bytes_per_device: float
    operand: int | None = None
    change: str | None = None  # "(S(0), B) -> (B, B)"
    reused: bool = False

    def words(self) -> str:
        on = f"in{self.operand}: " if self.operand is not None else ""
        change = f"{self.change} " if self.change else ""
        kinds = "+".join(self.kinds) or "local"
        return f"{on}{change}{kinds} on {self.axes}{' (reused)' if self.reused else ''}"


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """A row, normalised from whatever the planner gave."""

    primitive: str
    inputs: tuple[str, ...]
    signature: str
    boxings: tuple[BoxingEntry, ...]
    outputs: tuple[str, ...] | None
    name: str | None
    depth: int
    note: str = ""  # e.g. "no rule: replicated", "ring over 'x'"
    collectives: tuple[str, ...] = ()  # run by the op itself (a ring's collective-permutes)

    @property
    def has_collective(self) -> bool:
        """A boxing before the equation runs a collective."""
        return any(b.kinds for b in self.boxings)

    @property
    def runs_collective(self) -> bool:
        """A boxing or the op itself runs a collective."""
        return self.has_collective or bool(self.collectives)

    def own_words(self) -> str:
        """The op's own collectives, grouped: ``"collective-permute ×5"``."""
        counts = Counter(self.collectives)
        return ", ".join(f"{k} ×{v}" if v > 1 else k for k, v in counts.items())

    @property
    def bytes_per_device(self) -> float:
        return float(sum(b.bytes_per_device for b in self.boxings))


def _get(obj, name, default=_MISSING, *aliases):
    for key in (name, *aliases):
        value = obj.get(key, _MISSING) if isinstance(obj, Mapping) else getattr(obj, key, _MISSING)
        if value is not _MISSING:
            return value
    if default is _MISSING:
        raise TypeError(
            f"plan row {obj!r} has no {name!r}; a row needs primitive, inputs and signature "
            "(see the interface in jsbp.viz._plan's docstring)."
        )
    return default


def _nd_words(nd) -> str:
    if nd is None:
        return "-"
    if isinstance(nd, str):
        return nd
    if isinstance(nd, Layout):
        return _sbp.nd_str(nd.nd_sbp)
    if isinstance(nd, _sbp.Sbp):
        return f"({nd})"
    return _sbp.nd_str(tuple(_sbp.parse(s) for s in nd))


def _axes_words(axes) -> str:
    if isinstance(axes, (int, str)):
        axes = (axes,)
    axes = tuple(axes)
    if axes and all(isinstance(a, (tuple, list)) for a in axes):  # one tuple per move
        return " ".join("[" + ", ".join(map(str, a)) + "]" for a in axes)
    return "[" + ", ".join(map(str, axes)) + "]"


def _entry(b) -> BoxingEntry:
    if isinstance(b, tuple):
        kind, axes, nbytes = b
        return BoxingEntry(
            () if kind in (None, "local") else (kind,), _axes_words(axes), float(nbytes)
        )
    kinds = _get(b, "collectives", None)
    if kinds is None or callable(kinds):
        kind = _get(b, "kind", None, "collective")
        kinds = () if kind in (None, "local") else (kind,)
    src, dst = _get(b, "src", None), _get(b, "dst", None)
    change = None
    if (
        src is not None and dst is not None and not isinstance(src, _sbp.Sbp)
    ):  # a Move's src is one Sbp
        change = f"{_nd_words(src)} -> {_nd_words(dst)}"
    return BoxingEntry(
        tuple(k for k in kinds if k not in (None, "local")),
        _axes_words(_get(b, "axes", ())),
        float(_get(b, "bytes_per_device", 0.0)),
        _get(b, "operand", None),
        change,
        bool(_get(b, "reused", False)),
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


def _own(kinds) -> tuple[str, ...]:
    """The op's own collectives as names (entries may be names or ``(name, ...)`` tuples)."""
    if kinds is None or callable(kinds) or isinstance(kinds, str):
        return (kinds,) if isinstance(kinds, str) and kinds != "local" else ()
    names = (k[0] if isinstance(k, (tuple, list)) and k else k for k in kinds)
    return tuple(str(k) for k in names if k not in (None, "local"))


def _row(r) -> PlanRow:
    outs = _get(r, "outputs", None, "out_sbps")
    return PlanRow(
        primitive=str(_get(r, "primitive")),
        inputs=tuple(_nd_words(s) for s in _get(r, "inputs", _MISSING, "in_sbps")),
        signature=str(_get(r, "signature")),
        boxings=tuple(_entry(b) for b in _entry_list(_get(r, "boxings", None, "boxing"))),
        outputs=None if outs is None else tuple(_nd_words(s) for s in outs),
        name=_get(r, "name", None),
        depth=int(_get(r, "depth", 0) or 0),
        note=str(_get(r, "note", "") or ""),
        collectives=_own(_get(r, "collectives", ())),
    )


def normalise_plan(plan) -> tuple[tuple[PlanRow, ...], dict]:
    """``(rows, totals)`` from a plan in the duck-typed interface (see the module docstring).

    ``totals`` has ``bytes_per_device``, ``collectives`` (kind -> count, zeros dropped) and
    ``placement`` (or None).
    """
    is_rows = isinstance(plan, Sequence) and not isinstance(plan, (str, Mapping))
    rows = [_row(r) for r in (plan if is_rows else _get(plan, "rows"))]
    if not is_rows:
        for b in _entry_list(_get(plan, "output_boxings", None)):
            e = _entry(b)
            rows.append(
                PlanRow(
                    "(output)",
                    (e.change.split(" -> ")[0],) if e.change else (),
                    "",
                    (e,),
                    None,
                    None,
                    0,
                )
            )
    kinds = Counter(k for r in rows for b in r.boxings for k in b.kinds)
    kinds.update(k for r in rows for k in r.collectives)
    totals = {
        "bytes_per_device": sum(r.bytes_per_device for r in rows),
        "collectives": dict(kinds),
        "placement": None if is_rows else _get(plan, "placement", None),
    }
    if not is_rows:
        given = _get(plan, "totals", None)
        colls = (
            _get(given, "collectives", None)
            if given is not None
            else _get(plan, "collectives", None)
        )
        nbytes = (
            _get(given, "bytes_per_device", None)
            if given is not None
            else _get(plan, "total_bytes_per_device", None)
        )
        if callable(colls):
            colls = colls()
        if colls is not None:
            totals["collectives"] = {k: v for k, v in dict(colls).items() if v}
        if nbytes is not None:
            totals["bytes_per_device"] = float(nbytes)
    return tuple(rows), totals


def _totals_words(rows, totals) -> str:
    n_box = sum(1 for r in rows if r.boxings)
    colls = totals["collectives"]
    what = ", ".join(f"{k} ×{v}" for k, v in sorted(colls.items())) or "no collectives"
    return (
        f"{len(rows)} equation{'s' if len(rows) != 1 else ''} · {n_box} with boxing · {what} · "
        f"{fmt_bytes(totals['bytes_per_device'])} received per device"
    )


def plan_text(plan) -> str:
    """The plan as an aligned text table; rows that run a collective are marked ``*``.

    A row's ``note`` follows its primitive in brackets (``jsbp_attention [ring over 'x']``); when
    some op runs collectives of its own (a ring), an ``op runs`` column lists them.
    """
    rows, totals = normalise_plan(plan)
    own = any(r.collectives for r in rows)
    head = ("", "#", "primitive", "inputs", "signature", "boxing", "bytes/device")
    head += ("op runs",) if own else ()
    table = [head]
    for i, r in enumerate(rows):
        table.append(
            (
                "*" if r.runs_collective else "",
                str(i + 1),
                "  " * r.depth + r.primitive + (f" [{r.note}]" if r.note else ""),
                ", ".join(r.inputs),
                r.signature,
                "; ".join(b.words() for b in r.boxings) or "-",
                fmt_bytes(r.bytes_per_device) if r.boxings else "-",
            )
            + ((r.own_words() or "-",) if own else ())
        )
    widths = [max(len(row[c]) for row in table) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    if totals["placement"] is not None:
        lines.insert(0, f"plan on {totals['placement']}")
    lines.append(f"total: {_totals_words(rows, totals)}")
    return "\n".join(lines)


_DASH = '<span style="opacity:0.5">-</span>'


def plan_html(plan) -> str:
    """The plan as an HTML table: rows that run a collective tinted and marked, totals at the end.

    A row's ``note`` shows under its primitive; an op that runs collectives of its own (a ring's
    collective-permutes) gets an ``op runs`` column and a violet tint (class
    ``jsbp-own-collectives``); ``data-collectives`` counts both kinds.
    """
    rows, totals = normalise_plan(plan)
    own = any(r.collectives for r in rows)
    cell = f"padding:2px 8px;border-bottom:1px solid {RULE};text-align:left;vertical-align:top"
    heads = ("#", "primitive", "inputs", "signature", "boxing", "bytes / device")
    heads += ("op runs",) if own else ()
    head = "".join(f'<th style="{cell}">{h}</th>' for h in heads)
    body = []
    for i, r in enumerate(rows):
        if r.has_collective:
            cls = "jsbp-row jsbp-boxed"
            tint = "background:rgba(255,127,14,0.16);box-shadow:inset 3px 0 rgba(255,127,14,0.9)"
        elif r.boxings:
            cls, tint = "jsbp-row jsbp-local-boxing", "background:rgba(127,127,127,0.08)"
        else:
            cls, tint = "jsbp-row", ""
        if r.collectives:
            cls += " jsbp-own-collectives"
            if not r.has_collective:
                tint = (
                    "background:rgba(148,103,189,0.16);box-shadow:inset 3px 0 rgba(148,103,189,0.9)"
                )
        prim = f'<span style="padding-left:{12 * r.depth}px">{esc(r.primitive)}</span>'
        if r.name:
            prim += f'<div style="opacity:0.7;font-size:10px">{esc(r.name)}</div>'
        if r.note:
            prim += (
                f'<div class="jsbp-note" style="color:#b35900;font-size:10px">{esc(r.note)}</div>'
            )
        sig = esc(r.signature)
        if r.outputs is not None and "->" not in r.signature:  # explain's signatures include them
            sig += f'<div style="opacity:0.7;font-size:10px">out {esc(", ".join(r.outputs))}</div>'
        box = "<br>".join(
            f"<b>{esc(b.words())}</b>" if b.kinds else esc(b.words()) for b in r.boxings
        )
        nbytes = esc(fmt_bytes(r.bytes_per_device)) if r.boxings else _DASH
        n_coll = sum(len(b.kinds) for b in r.boxings) + len(r.collectives)
        runs = ""
        if own:
            words = f"<b>{esc(r.own_words())}</b>" if r.collectives else _DASH
            runs = f'<td class="jsbp-op-runs" style="{cell}">{words}</td>'
        body.append(
            f'<tr class="{cls}" data-collectives="{n_coll}" style="{tint}">'
            f'<td style="{cell}">{i + 1}</td><td style="{cell}">{prim}</td>'
            f'<td style="{cell};white-space:nowrap">{esc(", ".join(r.inputs))}</td>'
            f'<td style="{cell};white-space:nowrap">{sig}</td>'
            f'<td style="{cell}">{box or _DASH}</td><td style="{cell}">{nbytes}</td>{runs}</tr>'
        )
    table = (
        '<table class="jsbp-plan" style="color:inherit;border-collapse:collapse;font-size:11px;'
        f'margin-top:4px"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    )
    foot = (
        f'<div class="jsbp-totals" style="margin-top:4px;font-weight:600">'
        f"{esc(_totals_words(rows, totals))}</div>"
    )
    title = "plan" + (f" on {totals['placement']}" if totals["placement"] is not None else "")
    sub = "tinted rows run a collective before the equation; bytes are received per device"
    if own:
        sub += "; violet rows run collectives inside the op (op runs)"
    return frame("plan", title, sub, table + foot)
