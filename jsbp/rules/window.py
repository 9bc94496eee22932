"""Windowed reductions (pooling) and their gradients: ``reduce_window_sum`` / ``_max`` / ``_min``,
the generic ``reduce_window``, ``select_and_scatter_add`` (the gradient of max pooling),
``select_and_gather_add`` (its forward-mode derivative) and ``select_and_scatter``.

A dim keeps its split when every output element depends only on input elements of the same block:

* an **untouched** dim (window 1, stride 1, no padding, no dilation): batch and feature dims;
* an **aligned** dim: non-overlapping windows (window == stride, no padding, no dilation) that
  tile the dim exactly (``in == out * stride``), with ``out`` divisible by the number of devices,
  so every block holds whole windows and blocks line up on both sides.

Any other split spatial dim is gathered first (``B``; no halo exchange). The window parameters
carry no shapes, so the primitive runs unchanged on local shards.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from .._sbp import Split
from ._common import PMAX, PMIN, B, P
from ._registry import register_sbp_rule


def _window_dims(ctx, in_shape, out_shape):
    """Dims of a windowed op that can stay split (untouched or aligned)."""
    p = ctx.params
    rank = len(in_shape)
    win = p["window_dimensions"]
    strides = p["window_strides"]
    pad = p["padding"]
    base = p.get("base_dilation") or (1,) * rank
    wdil = p.get("window_dilation") or (1,) * rank
    total = math.prod(ctx.hierarchy)
    out = []
    for d in range(rank):
        if tuple(pad[d]) != (0, 0) or base[d] != 1 or wdil[d] != 1:
            continue
        if win[d] == 1 and strides[d] == 1:
            out.append(d)
        elif (
            win[d] == strides[d]
            and in_shape[d] == out_shape[d] * win[d]
            and out_shape[d] % total == 0
        ):
            out.append(d)
    return out


_PARTIAL_OF = {"reduce_window_sum": P, "reduce_window_max": PMAX, "reduce_window_min": PMIN}


@register_sbp_rule("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def _reduce_window(ctx):
    for d in _window_dims(ctx, ctx.in_shapes[0], ctx.out_shapes[0]):
        yield (Split(d),), (Split(d),)
    yield (B,), (B,)
    # a sum pads with 0 (linear); a max / min pads with its identity, and max over a window of
    # max over pieces is max over pieces of max over the window (not for complex: XLA has no
    # max / min collective for them)
    part = _PARTIAL_OF[ctx.primitive.name]
    if part is P or not jnp.issubdtype(ctx.in_avals[0].dtype, jnp.complexfloating):
        yield (part,), (part,)


@register_sbp_rule("reduce_window")
def _reduce_window_generic(ctx):
    # operands then their init values (scalars, B); an arbitrary reducer: no partial
    n = len(ctx.in_avals) // 2
    n_out = len(ctx.out_avals)
    for d in _window_dims(ctx, ctx.in_shapes[0], ctx.out_shapes[0]):
        yield (Split(d),) * n + (B,) * n, (Split(d),) * n_out
    yield (B,) * len(ctx.in_avals), (B,) * n_out


@register_sbp_rule("select_and_scatter_add")
def _select_and_scatter_add(ctx):
    # (source: one value per window, operand) -> operand's shape
    source, operand = ctx.in_shapes
    for d in _window_dims(ctx, operand, source):
        yield (Split(d), Split(d)), (Split(d),)
    yield (B, B), (B,)
    yield (P, B), (P,)  # linear in the source, the selection reads the operand whole


@register_sbp_rule("select_and_gather_add")
def _select_and_gather_add(ctx):
    # (tangents, operand) of the same shape -> one value per window
    for d in _window_dims(ctx, ctx.in_shapes[1], ctx.out_shapes[0]):
        yield (Split(d), Split(d)), (Split(d),)
    yield (B, B), (B,)
    yield (P, B), (P,)  # linear in the tangents


@register_sbp_rule("select_and_scatter")
def _select_and_scatter(ctx):
    # (operand, source, init value) -> operand's shape; an arbitrary scatter reducer: no partial
    operand, source, _ = ctx.in_shapes
    for d in _window_dims(ctx, operand, source):
        yield (Split(d), Split(d), B), (Split(d),)
    yield (B, B, B), (B,)
