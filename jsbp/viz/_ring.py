"""Pictures of the ring schedule of ``jsbp.nn.dot_product_attention``'s ``"ring"`` plan.

The sequence is split over ``n`` devices of one placement axis (device ``i`` is position ``i``
on that axis). Each device holds one block of the query, key and value; in step ``t``
(``t = 0 .. n-1``) device ``i`` computes its queries against the key/value block that started
on device ``j = (i - t) mod n``, then passes that K/V block on to device ``i + 1`` (one
collective-permute per step, K and V packed together). The rules are the kernel's
(``jsbp.nn._kernels.ring_attention``), restated here in plain Python so that drawing runs
nothing:

* not causal: every step is a full block;
* causal: step 0 is the diagonal block (computed whole, the causal mask inside it); a source
  block ``j < i`` is full, ``j > i`` lies above the diagonal and is skipped. Device ``i`` does
  ``i + 1`` blocks: the last device ``n``, the first 1;
* causal with ``balance`` (zig-zag; the kernel uses it when the local length is even): the
  sequence is cut into ``2n`` half-chunks and two collective-permutes of half-blocks first move
  chunks ``i`` and ``2n-1-i`` to device ``i`` (two more bring the results back). Then a source
  ``j < i`` is half a block (all local queries against the source's first chunk ``j``), a
  source ``j > i`` is half a block too (only the local second chunk ``2n-1-i`` against the whole
  source): every device does ``1 + (n-1)/2`` blocks.

A block of work is one local query block against one local key block.
"""

from __future__ import annotations

import dataclasses

from ._html import frame
from ._model import device_color
from ._svg import FONT, STROKE, esc, svg_text

__all__ = ["RingCell", "RingSchedule", "ring_schedule", "ring_schedule_html", "ring_schedule_text"]


@dataclasses.dataclass(frozen=True)
class RingCell:
    """What device ``device`` computes in step ``step``."""

    device: int
    step: int
    source: int  # the device whose key/value block it is (where the block started)
    keys: tuple[int, ...]  # the sequence chunks of the keys it computes against
    queries: tuple[int, ...]  # the sequence chunks of its own queries that take part
    work: str  # "full", "half" or "skip"
    diagonal: bool = False  # the block on the diagonal (computed whole, causal mask inside)

    @property
    def blocks(self) -> float:
        """Blocks of work: 1, 0.5 or 0."""
        return {"full": 1.0, "half": 0.5, "skip": 0.0}[self.work]

    def words(self) -> str:
        """``"full"``, ``"diagonal"``, ``"half: queries c7"``, ``"half: keys c0"``, ``"skip"``."""
        if self.diagonal:
            return "diagonal"
        if self.work != "half":
            return self.work
        return f"half: {self.half_words()}"

    def half_words(self) -> str:
        if len(self.queries) == 1:
            return "queries " + _chunks(self.queries)
        return "keys " + _chunks(self.keys)


@dataclasses.dataclass(frozen=True)
class RingSchedule:
    """The schedule as data: ``cells[i][t]`` for device ``i`` and step ``t``."""

    n: int
    causal: bool
    zigzag: bool  # the balanced (zig-zag) order is used
    chunks: int  # the sequence is cut into this many chunks (n, or 2n half-chunks)
    holds: tuple[tuple[int, ...], ...]  # the chunks of query/key/value each device holds
    cells: tuple[tuple[RingCell, ...], ...]
    ring_pairs: tuple[tuple[int, int], ...]  # (source, target) of the permute between steps
    # the two half-block permutes into the zig-zag order ((source, target) pairs); () if none
    zig_pairs: tuple[tuple[tuple[int, int], ...], ...] = ()

    @property
    def steps(self) -> int:
        return self.n

    @property
    def ring_permutes(self) -> int:
        """Collective-permutes round the ring (one between consecutive steps)."""
        return self.n - 1

    @property
    def zig_permutes(self) -> int:
        """Collective-permutes of the zig-zag re-arrangement: 2 in (of the inputs) and 2 back
        (of the results); 0 without it."""
        return 4 if self.zigzag else 0

    @property
    def permutes(self) -> int:
        return self.ring_permutes + self.zig_permutes

    def work(self) -> tuple[float, ...]:
        """Blocks of work per device."""
        return tuple(sum(c.blocks for c in row) for row in self.cells)


def _chunks(cs) -> str:
    return ",".join(f"c{c}" for c in cs)


def _home(c: int, n: int) -> int:
    """The device that holds half-chunk ``c`` in the zig-zag order."""
    return c if c < n else 2 * n - 1 - c


def ring_schedule(n: int, *, causal: bool = False, balance: bool = False) -> RingSchedule:
    """The ring schedule on ``n`` devices, as data (what the pictures draw).

    ``balance`` takes effect for causal attention on more than one device (the kernel also needs
    an even local length; the ``"ring"`` plan asks for it whenever the attention is causal).
    """
    n = int(n)
    if n < 1:
        raise ValueError(f"ring_schedule: n must be at least 1, got {n}")
    causal = bool(causal)
    zig = bool(balance) and causal and n > 1
    if zig:
        holds = tuple((i, 2 * n - 1 - i) for i in range(n))
        zig_pairs = (
            tuple((d, _home(2 * d, n)) for d in range(n)),
            tuple((d, _home(2 * d + 1, n)) for d in range(n)),
        )
    else:
        holds = tuple((i,) for i in range(n))
        zig_pairs = ()
    cells = []
    for i in range(n):
        row = []
        for t in range(n):
            j = (i - t) % n
            mine, theirs = holds[i], holds[j]
            if t == 0:
                cell = RingCell(i, t, j, theirs, mine, "full", diagonal=causal)
            elif not causal or (j < i and not zig):
                cell = RingCell(i, t, j, theirs, mine, "full")
            elif not zig:
                cell = RingCell(i, t, j, (), (), "skip")
            elif j < i:  # the source's second chunk is in every local row's future
                cell = RingCell(i, t, j, theirs[:1], mine, "half")
            else:  # the local first chunk precedes both source chunks
                cell = RingCell(i, t, j, theirs, mine[1:], "half")
            row.append(cell)
        cells.append(tuple(row))
    return RingSchedule(
        n,
        causal,
        zig,
        2 * n if zig else n,
        holds,
        tuple(cells),
        tuple((d, (d + 1) % n) for d in range(n)),
        zig_pairs,
    )


def _fmt_blocks(x: float) -> str:
    return f"{x:g}"


def _mode_words(s: RingSchedule, balance: bool) -> str:
    words = "causal" if s.causal else "not causal"
    if s.zigzag:
        words += ", balanced (zig-zag)"
    elif balance:
        words += ", balance has no effect" + ("" if s.causal else " without causal")
    return words


def _permute_words(s: RingSchedule) -> str:
    if s.n == 1:
        return "no collective-permute (one device)"
    words = f"{s.ring_permutes} collective-permute{'s' if s.ring_permutes != 1 else ''} of K/V"
    if s.zigzag:
        words += " + 2 into the zig-zag order + 2 back"
    return words


def _work_words(s: RingSchedule) -> str:
    work = s.work()
    if len(set(work)) == 1:
        return f"{_fmt_blocks(work[0])} block{'s' if work[0] != 1 else ''} of work on every device"
    hi, lo = max(work), min(work)
    return (
        f"blocks of work per device: busiest {_fmt_blocks(hi)} (device {work.index(hi)}), "
        f"idlest {_fmt_blocks(lo)} (device {work.index(lo)})"
    )


def _totals_words(s: RingSchedule) -> str:
    return f"{s.steps} step{'s' if s.steps != 1 else ''} · {_permute_words(s)} · {_work_words(s)}"


def _holds_words(s: RingSchedule) -> str:
    if s.zigzag:
        return (
            f"the sequence in {s.chunks} half-chunks c0..c{s.chunks - 1}; device i holds "
            f"c(i) and c({s.chunks - 1}-i) of query, key and value"
        )
    if s.n == 1:
        return "the sequence in 1 block c0"
    return f"the sequence in {s.n} blocks c0..c{s.n - 1}; device i holds block c(i)"


# -------------------------------------------------------------------------------------------
# text
# -------------------------------------------------------------------------------------------


def _cell_text(c: RingCell) -> str:
    if c.work == "skip":
        return f"{c.source} skip"
    if c.diagonal:
        return f"{c.source} diag"
    if c.work == "half":
        if len(c.queries) == 1:
            return f"{c.source} ½ q:{_chunks(c.queries)}"
        return f"{c.source} ½ k:{_chunks(c.keys)}"
    return f"{c.source} full"


def ring_schedule_text(n: int, *, causal: bool = False, balance: bool = False) -> str:
    """The ring schedule as a compact table: one row per device, one column per step.

    A cell is ``<source> <work>``: the device whose key/value block is computed against, and
    ``full``, ``diag`` (the diagonal block), ``½ q:c7`` (half: only query chunk c7), ``½ k:c0``
    (half: only key chunk c0) or ``skip``; ``→`` between steps is the collective-permute that
    passes every K/V block on to the next device.
    """
    s = ring_schedule(n, causal=causal, balance=balance)
    head = ["device", "holds"] + [f"step {t}" for t in range(s.n)] + ["blocks"]
    rows = [head]
    for i, cells in enumerate(s.cells):
        rows.append(
            [str(i), _chunks(s.holds[i])]
            + [_cell_text(c) for c in cells]
            + [_fmt_blocks(s.work()[i])]
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = [
        f"ring attention schedule on {s.n} device{'s' if s.n != 1 else ''} · {_mode_words(s, balance)}",
        f"  {_holds_words(s)}",
    ]
    for k, r in enumerate(rows):
        seps = ["  "] + ["  "] + [("   " if k == 0 else " → ")] * (s.n - 1) + ["  "]
        line = r[0].ljust(widths[0])
        for cell, w, sep in zip(r[1:], widths[1:], seps):
            line += sep + cell.ljust(w)
        lines.append("  " + line.rstrip())
    lines.append("  cell: the device the K/V block started on, then the work: full, skip,")
    lines.append(
        "        diag (the diagonal block, causal mask inside), ½ q:/k: (half a block: only"
    )
    lines.append("        those query / key chunks)")
    if s.n > 1:
        lines.append(
            "  → collective-permute: every device passes its K/V block to device i+1 (mod n)"
        )
    lines.append(f"total: {_totals_words(s)}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------
# HTML
# -------------------------------------------------------------------------------------------

_CW, _CH, _GAP, _LEFT, _RIGHT, _TOP = 118, 52, 26, 96, 110, 30


def _arrow(x0, y0, x1, y1) -> str:
    """A line with a filled head at ``(x1, y1)`` (no ``marker``: no ``url()`` references)."""
    dx, dy = x1 - x0, y1 - y0
    d = (dx * dx + dy * dy) ** 0.5 or 1.0
    ux, uy = dx / d, dy / d
    bx, by = x1 - 6 * ux, y1 - 6 * uy
    px, py = -uy * 3, ux * 3
    return (
        f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{bx:.1f}" y2="{by:.1f}" {STROKE}/>'
        f'<polygon points="{x1:.1f},{y1:.1f} {bx + px:.1f},{by + py:.1f} {bx - px:.1f},{by - py:.1f}" '
        f'fill="currentColor" fill-opacity="0.55"/>'
    )


def _cell_svg(s: RingSchedule, c: RingCell, x: float, y: float) -> str:
    w, h = _CW, _CH
    title = (
        f"device {c.device}, step {c.step}: K/V block of device {c.source} "
        f"({_chunks(s.holds[c.source])}) · {c.words()}"
    )
    if c.work != "skip":
        title += f" · queries {_chunks(c.queries)} × keys {_chunks(c.keys)} · {_fmt_blocks(c.blocks)} block"
    attrs = (
        f'class="jsbp-ring-cell jsbp-{c.work}" data-device="{c.device}" data-step="{c.step}" '
        f'data-source="{c.source}" data-work="{c.work}" data-diagonal="{int(c.diagonal)}" '
        f'data-keys="{_chunks(c.keys)}" data-queries="{_chunks(c.queries)}" '
        f'data-blocks="{_fmt_blocks(c.blocks)}"'
    )
    out = [f"<g {attrs}><title>{esc(title)}</title>"]
    fill = device_color(c.source, 0.45)
    if c.work == "full":
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w}" height="{h}" fill="{fill}"/>')
    elif (
        c.work == "half" and len(c.queries) == 1
    ):  # half: rows are queries, its second chunk (the lower half)
        out.append(
            f'<rect x="{x:.1f}" y="{y + h / 2:.1f}" width="{w}" height="{h / 2:.1f}" fill="{fill}"/>'
        )
    elif c.work == "half":  # half: columns are keys, the source's first chunk (the left half)
        out.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w / 2:.1f}" height="{h}" fill="{fill}"/>'
        )
    dash = ' stroke-dasharray="4 3"' if c.work == "skip" else ""
    out.append(
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{w}" height="{h}" fill="none" {STROKE}{dash}/>'
    )
    if c.diagonal:  # the causal mask inside the block
        out.append(
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + w:.1f}" y2="{y + h:.1f}" '
            'stroke="currentColor" stroke-opacity="0.2"/>'
        )
    dim = 0.5 if c.work == "skip" else None
    out.append(svg_text(x + 5, y + 14, f"K/V {c.source}", weight=600, opacity=dim))
    out.append(svg_text(x + 5, y + 28, _chunks(s.holds[c.source]), opacity=dim))
    out.append(
        svg_text(x + 5, y + 43, c.words(), opacity=0.5 if c.work == "skip" else 0.85, size=10)
    )
    out.append("</g>")
    return "".join(out)


def _schedule_svg(s: RingSchedule) -> str:
    n = s.n
    x0 = _LEFT
    width = _LEFT + n * _CW + (n - 1) * _GAP + _RIGHT
    height = _TOP + n * _CH + (n - 1) * 8 + 16

    def cx(t):
        return x0 + t * (_CW + _GAP)

    def cy(i):
        return _TOP + i * (_CH + 8)

    out = [
        f'<svg class="jsbp-ring" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" font-family="{esc(FONT)}" role="img">'
    ]
    for t in range(n):
        out.append(svg_text(cx(t) + _CW / 2, 14, f"step {t}", anchor="middle", weight=600))
        if t < n - 1:
            out.append(
                svg_text(cx(t) + _CW + _GAP / 2, 14, "⇢", anchor="middle", opacity=0.7, size=13)
            )
    out.append(svg_text(cx(n - 1) + _CW + 12, 14, "blocks", weight=600))
    work = s.work()
    for i in range(n):
        y = cy(i)
        out.append(svg_text(4, y + 16, f"device {i}", weight=600))
        out.append(svg_text(4, y + 31, f"holds {_chunks(s.holds[i])}", opacity=0.8, size=10))
        for t in range(n):
            out.append(_cell_svg(s, s.cells[i][t], cx(t), y))
        # the per-device total, as a bar (the longest: n blocks)
        bx = cx(n - 1) + _CW + 12
        bw = (_RIGHT - 20) * work[i] / n
        out.append(
            f'<g class="jsbp-ring-work" data-device="{i}" data-blocks="{_fmt_blocks(work[i])}">'
            f'<rect x="{bx:.1f}" y="{y + 22:.1f}" width="{bw:.1f}" height="10" '
            f'fill="currentColor" fill-opacity="0.35"/>'
            + svg_text(bx, y + 16, _fmt_blocks(work[i]))
            + "</g>"
        )
    # the permutes: device i's block goes to device i+1 for the next step (the last wraps round)
    for t in range(n - 1):
        gx0, gx1 = cx(t) + _CW + 2, cx(t + 1) - 2
        parts = []
        for i in range(n):
            ya = cy(i) + _CH / 2
            if i + 1 < n:
                parts.append(_arrow(gx0, ya, gx1, cy(i + 1) + _CH / 2))
            else:  # wraps round to device 0
                parts.append(_arrow(gx0, ya, gx0 + (gx1 - gx0) / 2, cy(i) + _CH + 10))
                parts.append(_arrow(gx0 + (gx1 - gx0) / 2, _TOP - 8, gx1, cy(0) + _CH / 2))
        out.append(
            f'<g class="jsbp-permute" data-after-step="{t}"><title>collective-permute after step '
            f"{t}: device i sends the K/V block it holds to device i+1 (mod {n})</title>"
            + "".join(parts)
            + "</g>"
        )
    out.append("</svg>")
    return "".join(out)


def ring_schedule_html(n: int, *, causal: bool = False, balance: bool = False) -> str:
    """HTML picture of the ring schedule on ``n`` devices: a grid with one row per device and
    one column per step.

    Each cell names the key/value block the device computes against (the device it started on,
    and its sequence chunks) and is filled in that device's colour: whole for a full block, half
    for half a block (zig-zag), empty and dashed when skipped (causal, above the diagonal); the
    diagonal block carries a diagonal line (the causal mask inside it). Arrows between the
    columns are the collective-permutes (device i to i+1, the last one wrapping round); a bar
    per device gives its blocks of work, and the caption the totals. Self-contained (inline SVG).
    """
    s = ring_schedule(n, causal=causal, balance=balance)
    sub = esc(_holds_words(s))
    if s.zigzag:
        sub += (
            " · before step 0, two collective-permutes of half-blocks move the chunks there "
            "(two more move the results back)"
        )
    legend = (
        '<div style="opacity:0.75;font-size:11px">K/V j: the key/value block that started on '
        "device j · filled: full block, half filled: half a block, dashed: skipped · arrows: "
        "collective-permute of K/V to the next device</div>"
    )
    foot = (
        '<div class="jsbp-totals" style="margin-top:4px;font-weight:600">'
        f"{esc(_totals_words(s))}</div>"
    )
    title = f"ring attention schedule · {s.n} device{'s' if s.n != 1 else ''} · {_mode_words(s, balance)}"
    body = f'<div style="margin-top:4px">{_schedule_svg(s)}</div>' + legend + foot
    return frame("ring", title, sub, body)
