"""Pictures of an expert dispatch: which device sends how many (token, choice) pairs to which.

A mixture-of-experts layer routes each token to its top-``k`` experts (``expert_index``, as
``jax.lax.top_k`` of the router's probabilities gives). Under expert parallelism the tokens and
the experts are split over the same ``devices`` devices of one placement axis, both as jsbp lays
out ``S(0)`` (OneFlow's balanced splitter, ``jsbp._layout.balanced``): device ``d`` holds a
contiguous block of the tokens and a contiguous block of the experts, the first devices one more
when the count does not divide (10 tokens over 4 devices: 3, 3, 2, 2; 6 experts: e0-e1, e2-e3,
e4, e5). Each (token, choice) pair travels from the device holding the token to the device
holding its expert: one all-to-all dispatches them, another brings the results back (the
transpose), and under ``jax.grad`` both run again for the cotangents.

With a ``capacity`` the rule is GShard / Switch's (``dense_moe`` in ``tests/test_moe.py``): the
tokens are cut into groups of contiguous tokens (by default the devices' blocks; ``groups=g``:
``g`` balanced blocks), and in each group every expert has ``capacity`` slots, filled by the
first choices of the group's tokens in token order, then the second choices, and so on; pairs
past the last slot are dropped. Without a capacity every pair is sent (dropless).

Everything here is NumPy on the routing; drawing runs nothing.
"""

from __future__ import annotations

import dataclasses
import operator

import numpy as np

from .._errors import SbpError
from .._layout import balanced, offsets
from ._html import frame
from ._model import device_color, fmt_bytes
from ._svg import FONT, STROKE, esc, svg_text

__all__ = ["ExpertDispatch", "expert_dispatch", "expert_dispatch_html", "expert_dispatch_text"]


@dataclasses.dataclass(frozen=True)
class ExpertDispatch:
    """An expert dispatch as data (what the pictures draw). Matrices are tuples of rows;
    ``np.asarray`` turns them into arrays."""

    devices: int
    num_experts: int
    tokens: int
    k: int  # choices per token
    capacity: int | None  # slots per expert per group; None: dropless
    token_blocks: tuple[tuple[int, int], ...]  # (offset, size) of each device's tokens
    expert_blocks: tuple[tuple[int, int], ...]  # (offset, size) of each device's experts
    groups: tuple[tuple[int, int], ...]  # (offset, size) of each capacity group of tokens
    sent: tuple[tuple[int, ...], ...]  # [source device][destination device]: pairs sent
    received_per_expert: tuple[int, ...]  # [expert]: pairs it receives
    dropped: tuple[tuple[int, ...], ...]  # [source device][expert]: pairs past the capacity

    def experts_of(self, device: int) -> range:
        """The experts device ``device`` holds."""
        o, s = self.expert_blocks[device]
        return range(o, o + s)

    @property
    def homes(self) -> tuple[int, ...]:
        """The device that holds each expert."""
        return tuple(d for d, (_, s) in enumerate(self.expert_blocks) for _ in range(s))

    @property
    def pairs(self) -> int:
        """(token, choice) pairs routed: ``tokens * k``."""
        return self.tokens * self.k

    @property
    def sent_per_device(self) -> tuple[int, ...]:
        """Pairs each source device sends (its own experts' included): the row sums."""
        return tuple(sum(row) for row in self.sent)

    @property
    def received(self) -> tuple[int, ...]:
        """Pairs each destination device receives (the column sums): its experts' load."""
        return tuple(sum(col) for col in zip(*self.sent))

    @property
    def staying(self) -> tuple[int, ...]:
        """Pairs whose expert is on the token's own device (the diagonal): they do not move."""
        return tuple(self.sent[d][d] for d in range(self.devices))

    @property
    def dropped_per_device(self) -> tuple[int, ...]:
        """Pairs dropped at each destination device (past the capacity of its experts)."""
        per_expert = [sum(col) for col in zip(*self.dropped)]
        return tuple(sum(per_expert[e] for e in self.experts_of(d)) for d in range(self.devices))

    @property
    def total_dropped(self) -> int:
        return sum(map(sum, self.dropped))

    @property
    def max_load(self) -> int:
        """The most pairs one device receives."""
        return max(self.received)

    @property
    def imbalance(self) -> float:
        """``max_load`` over the mean pairs received per device (1.0: even; 1.0 when nothing is
        received)."""
        mean = sum(self.received) / self.devices
        return self.max_load / mean if mean else 1.0

    @property
    def slots(self) -> int | None:
        """Capacity slots in all: ``groups × num_experts × capacity`` (None when dropless). A
        dense GShard layer's buffers hold this many tokens whether the slots are filled or not."""
        if self.capacity is None:
            return None
        return len(self.groups) * self.num_experts * self.capacity

    def bytes_per_device(self, bytes_per_token: int, *, combine: bool = False) -> tuple[int, ...]:
        """Bytes each device receives from the other devices in the dispatch all-to-all (the
        off-diagonal column sums × ``bytes_per_token``); ``combine=True``: in the combine
        all-to-all, which returns every result to its token's device (the off-diagonal row sums).
        Counts the routed tokens only, not a dense layer's empty capacity slots."""
        n = self.devices
        if combine:
            moved = [sum(self.sent[i][j] for j in range(n) if j != i) for i in range(n)]
        else:
            moved = [sum(self.sent[i][j] for i in range(n) if i != j) for j in range(n)]
        return tuple(m * int(bytes_per_token) for m in moved)


def _count(value, what: str, example: str, *, least: int = 1) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise SbpError(
            f"expert_dispatch: {what} must be an int, got {value!r} ({type(value).__name__}); "
            f"e.g. {example}."
        ) from None
    if n < least:
        raise SbpError(
            f"expert_dispatch: {what} must be at least {least}, got {n}; e.g. {example}."
        )
    return n


def _index(expert_index, num_experts: int) -> np.ndarray:
    idx = np.asarray(expert_index)
    if idx.ndim not in (1, 2):
        raise SbpError(
            f"expert_dispatch: expert_index must be [tokens] (top-1) or [tokens, k] (each token's "
            f"top-k experts), got shape {idx.shape}; reshape it, e.g. "
            "expert_index.reshape(-1, k) for a [batch, seq, k] routing."
        )
    if idx.ndim == 1:
        idx = idx[:, None]
    if idx.shape[1] == 0:
        raise SbpError(
            f"expert_dispatch: expert_index has shape {idx.shape}: no choices per token; pass "
            "[tokens, k] with k >= 1."
        )
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise SbpError(
            f"expert_dispatch: expert_index must hold expert numbers (integers), got dtype "
            f"{idx.dtype}; pass the indices jax.lax.top_k returns, not the probabilities."
        )
    idx = idx.astype(np.int64)
    bad = np.argwhere((idx < 0) | (idx >= num_experts))
    if len(bad):
        t, c = (int(v) for v in bad[0])
        raise SbpError(
            f"expert_dispatch: expert_index[{t}, {c}] is {idx[t, c]}, outside 0..{num_experts - 1} "
            f"for num_experts={num_experts} ({len(bad)} such entr{'y' if len(bad) == 1 else 'ies'}); "
            "pass num_experts= the router's width (the number of experts)."
        )
    return idx


def _blocks(n: int, k: int) -> tuple[tuple[int, int], ...]:
    sizes = balanced(n, k)
    return tuple(zip(offsets(sizes), sizes))


def _owner(blocks, n: int) -> np.ndarray:
    """The block each of ``0 .. n-1`` lies in."""
    return np.repeat(np.arange(len(blocks)), [s for _, s in blocks])[:n]


def _kept(idx: np.ndarray, group: np.ndarray, num_experts: int, capacity: int) -> np.ndarray:
    """The GShard / Switch rule: in each (group, expert), the first ``capacity`` pairs in the
    order (choice, token) keep their slot."""
    t, k = idx.shape
    token = np.broadcast_to(np.arange(t)[:, None], (t, k)).ravel()
    choice = np.broadcast_to(np.arange(k)[None, :], (t, k)).ravel()
    key = group[token] * num_experts + idx.ravel()
    order = np.lexsort((token, choice, key))  # by (group, expert), then choice, then token
    sorted_key = key[order]
    start = np.searchsorted(sorted_key, sorted_key, side="left")
    rank = np.empty(t * k, np.int64)
    rank[order] = np.arange(t * k) - start
    return (rank < capacity).reshape(t, k)


def expert_dispatch(
    expert_index, devices: int, num_experts: int, *, capacity=None, groups=None
) -> ExpertDispatch:
    """The dispatch of ``expert_index`` (``[tokens, k]`` or ``[tokens]``, NumPy or JAX) with
    tokens and ``num_experts`` experts split over ``devices`` devices, as data.

    ``capacity``: slots per expert in each group (GShard / Switch; ``ceil(capacity_factor * k *
    group_size / num_experts)`` in ``dense_moe``); ``None`` sends every pair. ``groups``: the
    number of capacity groups of contiguous tokens (balanced sizes, equal when it divides the
    tokens); by default one group per device, its block of tokens. Without a capacity, groups
    have no effect.
    """
    n = _count(devices, "devices", "devices=8, the size of the placement axis")
    e = _count(num_experts, "num_experts", "num_experts=8, the router's width")
    idx = _index(expert_index, e)
    t, k = idx.shape
    token_blocks, expert_blocks = _blocks(t, n), _blocks(e, n)
    if groups is None:
        group_blocks = token_blocks
    else:
        group_blocks = _blocks(t, _count(groups, "groups", "groups=8 (one per device)"))
    src = np.broadcast_to(_owner(token_blocks, t)[:, None], (t, k))
    home = _owner(expert_blocks, e)
    if capacity is None:
        cap, kept = None, np.ones((t, k), bool)
    else:
        cap = _count(capacity, "capacity", "capacity=ceil(1.25 * k * tokens_per_group / experts)")
        kept = _kept(idx, _owner(group_blocks, t), e, cap)
    sent = np.bincount((src * n + home[idx])[kept], minlength=n * n).reshape(n, n)
    received = np.bincount(idx[kept], minlength=e)
    dropped = np.bincount((src * e + idx)[~kept], minlength=n * e).reshape(n, e)
    return ExpertDispatch(
        devices=n,
        num_experts=e,
        tokens=t,
        k=k,
        capacity=cap,
        token_blocks=token_blocks,
        expert_blocks=expert_blocks,
        groups=group_blocks,
        sent=tuple(tuple(int(v) for v in row) for row in sent),
        received_per_expert=tuple(int(v) for v in received),
        dropped=tuple(tuple(int(v) for v in row) for row in dropped),
    )


# -------------------------------------------------------------------------------------------
# words shared by the text and the HTML
# -------------------------------------------------------------------------------------------


def _s(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _range(o: int, s: int, prefix: str) -> str:
    if s == 0:
        return "none"
    return f"{prefix}{o}" if s == 1 else f"{prefix}{o}-{prefix}{o + s - 1}"


def _experts_words(d: ExpertDispatch, device: int) -> str:
    return _range(*d.expert_blocks[device], "e")


def _tokens_words(d: ExpertDispatch, device: int) -> str:
    o, s = d.token_blocks[device]
    return f"t{o}:{o + s}"


def _title_words(d: ExpertDispatch) -> str:
    return (
        f"expert dispatch · {_s(d.tokens, 'token')} × top-{d.k} over {_s(d.devices, 'device')}, "
        f"{_s(d.num_experts, 'expert')}"
    )


def _capacity_words(d: ExpertDispatch) -> str:
    if d.capacity is None:
        return "dropless: every pair is sent"
    where = "; one per device" if d.groups == d.token_blocks else ""
    return (
        f"capacity {d.capacity} per expert in each of {_s(len(d.groups), 'group')} "
        f"({d.slots} slots{where}; first choices before second, earlier tokens first)"
    )


def _split_words(d: ExpertDispatch) -> str:
    tok = ", ".join(str(s) for _, s in d.token_blocks)
    exp = ", ".join(str(s) for _, s in d.expert_blocks)
    return f"tokens per device {tok}; experts per device {exp} (both split as S(0))"


def _totals_words(d: ExpertDispatch, bytes_per_token) -> str:
    kept = sum(d.received)
    moved = kept - sum(d.staying)
    load = d.received
    words = (
        f"{kept} of {d.pairs} pairs sent, {moved} to another device · "
        f"load: max {d.max_load} (device {load.index(d.max_load)}), "
        f"imbalance {d.imbalance:.2f}"
    )
    if d.capacity is not None:
        words += f" · {d.total_dropped} dropped"
    if bytes_per_token is not None:
        b = d.bytes_per_device(bytes_per_token)
        words += f" · dispatch: max {fmt_bytes(max(b))} received per device"
    return words


def _check_bytes(bytes_per_token):
    if bytes_per_token is None:
        return None
    return _count(bytes_per_token, "bytes_per_token", "bytes_per_token=4 * d_model", least=0)


# -------------------------------------------------------------------------------------------
# text
# -------------------------------------------------------------------------------------------


def expert_dispatch_text(
    expert_index,
    devices: int,
    num_experts: int,
    *,
    capacity=None,
    groups=None,
    bytes_per_token=None,
) -> str:
    """The dispatch as a table: one row per source device (its tokens), one column per
    destination device (its experts); a cell is the pairs sent, ``[n]`` on the diagonal (pairs
    whose expert is on their own device). Below: pairs received per device and per expert,
    pairs dropped (with a capacity) and bytes received (with ``bytes_per_token``)."""
    bpt = _check_bytes(bytes_per_token)
    d = expert_dispatch(expert_index, devices, num_experts, capacity=capacity, groups=groups)
    n = d.devices
    head = ["source \\ dest"] + [f"d{j}" for j in range(n)] + ["sent"]
    rows = [head, ["experts"] + [_experts_words(d, j) for j in range(n)] + [""]]
    for i in range(n):
        cells = [f"[{v}]" if j == i else str(v) for j, v in enumerate(d.sent[i])]
        rows.append([f"d{i} {_tokens_words(d, i)}"] + cells + [str(d.sent_per_device[i])])
    rows.append(["received"] + [str(v) for v in d.received] + [str(sum(d.received))])
    if d.capacity is not None:
        rows.append(["dropped"] + [str(v) for v in d.dropped_per_device] + [str(d.total_dropped)])
    if bpt is not None:
        b = d.bytes_per_device(bpt)
        rows.append(["bytes in"] + [fmt_bytes(v) for v in b] + [fmt_bytes(sum(b))])
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = [_title_words(d), f"  {_split_words(d)}", f"  {_capacity_words(d)}"]
    for r in rows:
        line = r[0].ljust(widths[0]) + "".join(
            "  " + cell.rjust(w) for cell, w in zip(r[1:], widths[1:])
        )
        lines.append("  " + line.rstrip())
    per = []
    for j in range(n):
        counts = " ".join(f"e{x}:{d.received_per_expert[x]}" for x in d.experts_of(j))
        per.append(f"d{j} {counts or 'no experts'}")
    lines.append("  per expert: " + " · ".join(per))
    lines.append("  [n]: pairs whose expert is on their own device (they do not move)")
    if bpt is not None:
        lines.append(f"  bytes in: from the other devices in the dispatch, {bpt} B per token")
    lines.append(f"total: {_totals_words(d, bpt)}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------
# HTML
# -------------------------------------------------------------------------------------------

_CW, _CH, _TOP, _RIGHT = 78, 34, 44, 70
_BAR = 40  # height of the per-expert bars under the grid


def _dispatch_svg(d: ExpertDispatch, bpt) -> str:
    n = d.devices
    top = max(d.sent_per_device + d.received + (1,))
    peak = max(max(map(max, d.sent)), 1)
    foot = ["received"] + (["dropped"] if d.capacity is not None else [])
    foot += ["bytes in"] if bpt is not None else []
    # the row labels' column: as wide as the longest "tokens t<a>:<b>" (10 px text)
    left = max(112, 12 + 6.1 * max(len(f"tokens {_tokens_words(d, i)}") for i in range(n)))
    grid_bottom = _TOP + n * _CH
    bars_top = grid_bottom + len(foot) * 16 + 22
    width = round(left + n * _CW + _RIGHT)
    height = bars_top + _BAR + 30

    def cx(j):
        return left + j * _CW

    def cy(i):
        return _TOP + i * _CH

    out = [
        f'<svg class="jsbp-dispatch" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" font-family="{esc(FONT)}" role="img">',
        svg_text(4, 14, "source ↓ / dest →", opacity=0.7, size=10),
    ]
    for j in range(n):
        out.append(
            f'<g class="jsbp-dispatch-dest" data-device="{j}" '
            f'data-experts="{",".join(map(str, d.experts_of(j)))}">'
            + svg_text(cx(j) + _CW / 2, 14, f"d{j}", anchor="middle", weight=600)
            + svg_text(
                cx(j) + _CW / 2, 30, _experts_words(d, j), anchor="middle", opacity=0.8, size=10
            )
            + "</g>"
        )
    out.append(svg_text(cx(n) + 8, 30, "sent", weight=600))
    for i in range(n):
        y = cy(i)
        out.append(svg_text(4, y + 15, f"d{i}", weight=600))
        out.append(svg_text(4, y + 28, f"tokens {_tokens_words(d, i)}", opacity=0.8, size=10))
        for j in range(n):
            v = d.sent[i][j]
            diag = i == j
            title = (
                f"device {i} sends {_s(v, 'pair')} to device {j} "
                f"(experts {_experts_words(d, j)})" + (": they stay on the device" if diag else "")
            )
            fill = device_color(j, round(0.06 + 0.6 * v / peak, 3)) if v else "none"
            stroke = (
                'stroke="currentColor" stroke-opacity="0.9" stroke-width="2.5"' if diag else STROKE
            )
            out.append(
                f'<g class="jsbp-dispatch-cell{" jsbp-diagonal" if diag else ""}" '
                f'data-source="{i}" data-dest="{j}" data-count="{v}" data-diagonal="{int(diag)}">'
                f"<title>{esc(title)}</title>"
                f'<rect x="{cx(j) + 1:.1f}" y="{y + 1:.1f}" width="{_CW - 2}" height="{_CH - 2}" '
                f'fill="{fill}" {stroke}/>'
                + svg_text(
                    cx(j) + _CW / 2, y + _CH / 2 + 4, v, anchor="middle", weight=600 if v else None
                )
                + "</g>"
            )
        s = d.sent_per_device[i]
        out.append(
            f'<g class="jsbp-dispatch-sent" data-device="{i}" data-count="{s}">'
            f'<rect x="{cx(n) + 8:.1f}" y="{y + 20:.1f}" width="{(_RIGHT - 14) * s / top:.1f}" '
            f'height="8" fill="currentColor" fill-opacity="0.35"/>'
            + svg_text(cx(n) + 8, y + 15, s)
            + "</g>"
        )
    # per destination: pairs received, dropped, bytes in
    b = d.bytes_per_device(bpt) if bpt is not None else None
    for j in range(n):
        attrs = f'data-device="{j}" data-count="{d.received[j]}"'
        lines = [str(d.received[j])]
        if d.capacity is not None:
            attrs += f' data-dropped="{d.dropped_per_device[j]}"'
            lines.append(str(d.dropped_per_device[j]))
        if b is not None:
            attrs += f' data-bytes="{b[j]}"'
            lines.append(fmt_bytes(b[j]))
        out.append(
            f'<g class="jsbp-dispatch-received" {attrs}>'
            + "".join(
                svg_text(cx(j) + _CW / 2, grid_bottom + 14 + 16 * k, s, anchor="middle")
                for k, s in enumerate(lines)
            )
            + "</g>"
        )
    for k, word in enumerate(foot):
        out.append(svg_text(4, grid_bottom + 14 + 16 * k, word, weight=600))
    # per expert: a bar each, under its device's column (the tallest: the busiest expert)
    busiest = max(d.received_per_expert + (1,))
    out.append(svg_text(4, bars_top + _BAR / 2 + 4, "per expert", weight=600))
    for j in range(n):
        experts = d.experts_of(j)
        if not experts:
            continue
        w = (_CW - 4) / len(experts)
        for m, x in enumerate(experts):
            v = d.received_per_expert[x]
            h = _BAR * v / busiest
            bx = cx(j) + 2 + m * w
            dropped = sum(row[x] for row in d.dropped)
            title = f"expert {x} on device {j}: receives {_s(v, 'pair')}"
            if d.capacity is not None:
                title += f", {dropped} dropped"
            out.append(
                f'<g class="jsbp-expert" data-expert="{x}" data-device="{j}" data-count="{v}" '
                f'data-dropped="{dropped}"><title>{esc(title)}</title>'
                f'<rect x="{bx + 1:.1f}" y="{bars_top + _BAR - h:.1f}" width="{max(w - 2, 1):.1f}" '
                f'height="{h:.1f}" fill="{device_color(j, 0.55)}"/>'
                + (  # the count above the bar, the expert under it, where they fit
                    svg_text(bx + w / 2, bars_top + _BAR - h - 3, v, anchor="middle", size=9)
                    + svg_text(bx + w / 2, bars_top + _BAR + 12, f"e{x}", anchor="middle", size=9)
                    if w >= 14
                    else ""
                )
                + "</g>"
            )
    out.append("</svg>")
    return "".join(out)


def expert_dispatch_html(
    expert_index,
    devices: int,
    num_experts: int,
    *,
    capacity=None,
    groups=None,
    bytes_per_token=None,
) -> str:
    """HTML picture of the dispatch: a device × device grid, source devices down (their tokens),
    destination devices across (the experts they hold).

    Each cell is the (token, choice) pairs a source sends to a destination, shaded by count in
    the destination's colour; the diagonal (pairs whose expert is on their own device, which do
    not move) has a heavy border. Under the grid: the pairs each destination receives, those it
    drops (with a capacity), the bytes it receives (with ``bytes_per_token``), and a bar per
    expert. A bar per source gives the pairs it sends; the caption the totals and the load
    imbalance. Self-contained (inline SVG).
    """
    bpt = _check_bytes(bytes_per_token)
    d = expert_dispatch(expert_index, devices, num_experts, capacity=capacity, groups=groups)
    sub = esc(f"{_split_words(d)} · {_capacity_words(d)}")
    legend = (
        '<div style="opacity:0.75;font-size:11px">cell: (token, choice) pairs sent from the row\'s '
        "device to the column's · heavy border: the diagonal, pairs that stay on their device · "
        "one all-to-all dispatches the pairs, another returns the results (the transpose)</div>"
    )
    foot = (
        '<div class="jsbp-totals" style="margin-top:4px;font-weight:600">'
        f"{esc(_totals_words(d, bpt))}</div>"
    )
    body = f'<div style="margin-top:4px">{_dispatch_svg(d, bpt)}</div>' + legend + foot
    return frame("dispatch", _title_words(d), sub, body)
