"""Reductions: over a split dim a sum becomes P, a max Pmax, a min Pmin (padding masked)."""

from __future__ import annotations

import jax.numpy as jnp

from .._sbp import Split
from ._common import PMAX, PMIN, B, P, identity_of, mask_padding
from ._registry import register_sbp_rule

_PARTIAL_OF = {"reduce_sum": P, "reduce_max": PMAX, "reduce_min": PMIN}
_KIND = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


def _out_dim(d, axes):
    return d - sum(1 for a in axes if a < d)


def _reduce_sigs(ctx, partial_in_ok):
    axes = tuple(ctx.params["axes"])
    rank = len(ctx.in_shapes[0])
    name = ctx.primitive.name
    partial = _PARTIAL_OF.get(name)
    if (
        partial is not None
        and partial.reduce != "sum"
        and jnp.issubdtype(ctx.in_avals[0].dtype, jnp.complexfloating)
    ):
        # XLA has no max / min collective for complex values: reduce them whole
        partial = partial_in_ok = None
    for d in range(rank):
        if d in axes:
            if partial is not None:
                yield (Split(d),), (partial,)
        else:
            yield (Split(d),), (Split(_out_dim(d, axes)),)
    yield (B,), (B,)
    if partial_in_ok is not None:
        yield (partial_in_ok,), (partial_in_ok,)


def _reduce_local(st, ins):
    (x,) = ins
    lay = st.in_layouts[0]
    axes = tuple(st.eqn.params["axes"])
    kind = _KIND.get(st.eqn.primitive.name)
    if kind is not None:
        x = mask_padding(x, lay, axes, identity_of(kind, x.dtype))
    return st.eqn.primitive.bind(x, **st.eqn.params)


@register_sbp_rule("reduce_sum", local=_reduce_local)
def _reduce_sum(ctx):
    yield from _reduce_sigs(ctx, P)


@register_sbp_rule("reduce_max", local=_reduce_local)
def _reduce_max(ctx):
    yield from _reduce_sigs(ctx, PMAX)


@register_sbp_rule("reduce_min", local=_reduce_local)
def _reduce_min(ctx):
    yield from _reduce_sigs(ctx, PMIN)


@register_sbp_rule("reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin")
def _reduce_other(ctx):
    yield from _reduce_sigs(ctx, None)


@register_sbp_rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def _cumulative(ctx):
    axis = ctx.params["axis"]
    rank = len(ctx.in_shapes[0])
    for d in range(rank):
        if d != axis:
            yield (Split(d),), (Split(d),)
    yield (B,), (B,)
    if ctx.primitive.name == "cumsum":
        yield (P,), (P,)
