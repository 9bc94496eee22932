"""Pictures of a boxing: before -> after, with the collective per axis and the bytes it moves.

The steps are the ones the core really runs: ``jsbp._boxing.plan`` for a conversion on one
placement (one collective, or a local step, per group of axes that change the same way), and for a
move between placements the same route as ``to_global`` (same grid shape: copy every block to the
matching device, then box; otherwise: gather to ``B``, copy the whole value, slice on arrival).
Bytes are the planner's cost model: bytes *received* per device (OneFlow's table), not measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from .. import _boxing as core_boxing
from .. import _sbp
from .._errors import PlacementError, SbpError
from .._layout import Layout, layout_of
from .._placement import placement as Placement
from ._html import RULE, frame, nd_chips, row
from ._model import as_layout, fmt_bytes, tile_grid
from ._svg import esc
from ._tensor import layout_figure
from ._text import grid_text, legend_text

__all__ = ["Step", "boxing_steps", "steps_between", "boxing_html", "boxing_text"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a boxing, between two layouts."""

    before: Layout
    after: Layout
    axes: tuple[int, ...]  # placement axes that change (of ``before.placement``); () for a copy
    change: str  # "S(0) -> B", or "cpu:4[...] -> cpu:4[...]" for a copy between placements
    collective: (
        str | None
    )  # "all-gather", "all-reduce", "reduce-scatter", "all-to-all"; None: no collective
    what: str  # the collective's name, or what happens locally ("local slice", "zero-fill", ...)
    bytes_per_device: float


def _local_words(src: _sbp.Sbp, dst: _sbp.Sbp) -> str:
    if src.is_broadcast and dst.is_split:
        return "local slice"
    if dst.is_partial and dst.reduce != "sum":
        return "relabel (no change)"
    return "zero-fill"


def _plan_steps(src: Layout, dst: Layout, dtype) -> list[Step]:
    h, size = src.placement.hierarchy, np.dtype(dtype).itemsize
    moves = core_boxing.plan(
        src.nd_sbp, dst.nd_sbp, src.shape, h, size, core_boxing.widening(np.dtype(dtype))
    )
    out, lay = [], src
    for mv in moves:
        nd = tuple(mv.dst if a in mv.axes else s for a, s in enumerate(lay.nd_sbp))
        nxt = layout_of(lay.placement, nd, lay.shape)
        what = mv.collective or _local_words(mv.src, mv.dst)
        out.append(
            Step(
                lay, nxt, mv.axes, f"{mv.src} -> {mv.dst}", mv.collective, what, mv.bytes_per_device
            )
        )
        lay = nxt
    return out


def _block_bytes(lay: Layout, itemsize: int) -> int:
    return max((math.prod(n for _, n in blk) for blk in lay.blocks), default=0) * itemsize


def steps_between(src: Layout, dst: Layout, dtype="float32") -> tuple[Step, ...]:
    """The steps from layout ``src`` to ``dst`` (same logical shape) of a tensor of ``dtype``, as
    ``to_global`` runs them: each collective's bytes at the width it carries (a 16-bit float's
    sums in float32, ``_boxing.widening``)."""
    itemsize = np.dtype(dtype).itemsize
    if src.shape != dst.shape:
        raise SbpError(f"a boxing keeps the logical shape; got {src.shape} -> {dst.shape}.")
    if src == dst:
        return ()
    sp, dp = src.placement, dst.placement
    if sp == dp:
        return tuple(_plan_steps(src, dst, dtype))
    if sp.hierarchy == dp.hierarchy:
        mid = layout_of(dp, src.nd_sbp, src.shape)
        copy = Step(
            src,
            mid,
            (),
            f"{sp} -> {dp}",
            None,
            "copy blocks to the new devices",
            _block_bytes(src, itemsize),
        )
        return (copy, *_plan_steps(mid, dst, dtype))
    allb_src = layout_of(sp, (_sbp.broadcast,) * sp.ndim, src.shape)
    allb_dst = layout_of(dp, (_sbp.broadcast,) * dp.ndim, src.shape)
    total = math.prod(src.shape) * itemsize
    copy = Step(
        allb_src,
        allb_dst,
        (),
        f"{sp} -> {dp}",
        None,
        "copy the whole value to the new devices",
        total,
    )
    return (*_plan_steps(src, allb_src, dtype), copy, *_plan_steps(allb_dst, dst, dtype))


def _target(x, sbp, placement, op) -> tuple[Layout, Layout, str]:
    lay, dtype = as_layout(x)
    if isinstance(sbp, Placement):
        raise PlacementError(
            f"{op}(x, sbp=None, placement=None): the second argument is the target sbp, got the "
            f"placement {sbp}; write {op}(x, placement=p, sbp=...)."
        )
    from .._tensor import target_layout

    return lay, target_layout(lay, placement, sbp, op), dtype


def _axes_words(lay: Layout, axes) -> str:
    if not axes:
        return "placement change"
    names = ", ".join(lay.placement.axis_names[a] for a in axes)
    return f"{names} ({'×'.join(str(lay.placement.hierarchy[a]) for a in axes)})"


def _totals(steps) -> tuple[int, Counter, float]:
    kinds = Counter(s.collective for s in steps if s.collective)
    return sum(kinds.values()), kinds, float(sum(s.bytes_per_device for s in steps))


def totals_words(steps) -> str:
    n, kinds, total = _totals(steps)
    if not steps:
        return "nothing to do: the layouts are the same"
    what = ", ".join(f"{k} ×{v}" for k, v in sorted(kinds.items()))
    coll = f"{n} collective{'s' if n != 1 else ''}" + (f" ({what})" if what else "")
    return f"{coll} · {fmt_bytes(total)} received per device"


def _step_html(i: int, st: Step) -> str:
    tint = "rgba(214,39,40,0.16)" if st.collective else "rgba(127,127,127,0.12)"
    badge = (
        f'<div class="jsbp-badge" style="background:{tint};border-radius:10px;padding:0 8px;'
        f'font-weight:{600 if st.collective else 400}">{esc(st.what)}</div>'
    )
    return (
        f'<div class="jsbp-step" data-step="{i}" data-collective="{esc(st.collective or "none")}" '
        f'data-axes="{",".join(map(str, st.axes))}" data-bytes="{st.bytes_per_device:.0f}" '
        f'style="align-self:center;text-align:center;min-width:120px">'
        f'<div style="font-size:22px;line-height:1">→</div>'
        f"<div>{esc(_axes_words(st.before, st.axes))}</div><div>{esc(st.change)}</div>{badge}"
        f'<div style="opacity:0.8">{esc(fmt_bytes(st.bytes_per_device))}/device</div></div>'
    )


def _steps_table(steps) -> str:
    cell = f'style="padding:2px 8px;border-bottom:1px solid {RULE};text-align:left"'
    head = "".join(
        f"<th {cell}>{h}</th>" for h in ("step", "axes", "change", "collective", "bytes / device")
    )
    body = "".join(
        f'<tr class="jsbp-step-row"><td {cell}>{i + 1}</td><td {cell}>{esc(_axes_words(s.before, s.axes))}</td>'
        f"<td {cell}>{esc(s.change)}</td><td {cell}>{'<b>' + esc(s.what) + '</b>' if s.collective else esc(s.what)}</td>"
        f"<td {cell}>{esc(fmt_bytes(s.bytes_per_device))}</td></tr>"
        for i, s in enumerate(steps)
    )
    return (
        f'<table class="jsbp-steps" style="color:inherit;border-collapse:collapse;margin-top:4px;font-size:11px">'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def layouts_boxing_html(src: Layout, dst: Layout, dtype: str = "", *, dims=None) -> str:
    """``boxing_html`` for two layouts (what a plan renderer needs; no tensor required; ``dtype``
    "": float32)."""
    steps = steps_between(src, dst, dtype or "float32")
    side = 200
    parts = [
        layout_figure(
            src, dims, side=side, caption=f"before: {nd_chips(src.nd_sbp)} on {esc(src.placement)}"
        )
    ]
    for i, st in enumerate(steps):
        last = i == len(steps) - 1
        lay = st.after
        cap = ("after" if last else f"after step {i + 1}") + f": {nd_chips(lay.nd_sbp)}"
        if last or lay.placement != src.placement:
            cap += f" on {esc(lay.placement)}"
        parts += [_step_html(i, st), layout_figure(lay, dims, side=side, caption=cap)]
    body = row(*parts, gap=10)
    body += _steps_table(steps) if steps else ""
    body += f'<div class="jsbp-totals" style="margin-top:4px;font-weight:600">{esc(totals_words(steps))}</div>'
    title = f"boxing {dtype}[{', '.join(map(str, src.shape))}]: {_sbp.nd_str(src.nd_sbp)} -> {_sbp.nd_str(dst.nd_sbp)}"
    sub = f"on {esc(src.placement)}" + (
        f" -> {esc(dst.placement)}" if dst.placement != src.placement else ""
    )
    sub += " · bytes: the planner's cost model (received per device)"
    return frame("boxing", title, sub, body)


def boxing_steps(x, sbp=None, placement=None) -> tuple[Step, ...]:
    """The ``Step`` s of ``x.to_global(placement, sbp)``, as data (what the pictures draw).

    ``x`` is a global tensor (or a ``Layout``: float32 assumed). Nothing is run.
    """
    src, dst, dtype = _target(x, sbp, placement, "boxing_steps")
    return steps_between(src, dst, dtype or "float32")


def boxing_html(x, sbp=None, placement=None, *, dims=None) -> str:
    """HTML picture of ``x.to_global(placement, sbp)``: before -> each step -> after.

    Every step names the placement axes it changes, the collective it uses (or the local work: slice,
    zero-fill) and the bytes received per device; the totals close the picture. Nothing is run.
    """
    src, dst, dtype = _target(x, sbp, placement, "boxing_html")
    return layouts_boxing_html(src, dst, dtype, dims=dims)


def boxing_text(x, sbp=None, placement=None, *, dims=None) -> str:
    """Plain-text ``boxing_html``: the steps with their collectives and bytes, then before / after."""
    src, dst, dtype = _target(x, sbp, placement, "boxing_text")
    steps = steps_between(src, dst, dtype or "float32")
    where = f"{src.placement}" + (f" -> {dst.placement}" if dst.placement != src.placement else "")
    lines = [
        f"boxing {dtype}[{', '.join(map(str, src.shape))}] on {where}: "
        f"{_sbp.nd_str(src.nd_sbp)} -> {_sbp.nd_str(dst.nd_sbp)}"
    ]
    for i, st in enumerate(steps):
        lines.append(
            f"  {i + 1}. {_axes_words(st.before, st.axes)}: {st.change}  {st.what}  "
            f"{fmt_bytes(st.bytes_per_device)}/device"
        )
    lines.append(f"  total: {totals_words(steps)}")
    for label, lay in (("before", src), ("after", dst)):
        lines.append(f"{label}: {_sbp.nd_str(lay.nd_sbp)} on {lay.placement}")
        lines += legend_text(lay)
        lines += grid_text(tile_grid(lay, dims))
    return "\n".join(lines)
