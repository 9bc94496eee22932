"""Elementwise primitives: matching splits are kept; linear ops keep partial sums."""

from __future__ import annotations

import numpy as np

from .._sbp import Split
from ._common import PMAX, PMIN, B, P
from ._registry import register_sbp_rule

UNARY = (
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "abs", "sign", "floor",
    "ceil", "round", "erf", "erfc", "erf_inv", "lgamma", "digamma", "is_finite", "not", "integer_pow",
    "square", "population_count", "clz", "reduce_precision",
    "bessel_i0e", "bessel_i1e",
)
LINEAR_UNARY = ("neg", "stop_gradient", "copy", "real", "imag", "conj")
BINARY = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "and", "or", "xor",
    "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "nextafter", "igamma", "igammac", "polygamma", "zeta",
)


def _elementwise(ctx, partial_sigs=()):
    shapes = ctx.in_shapes
    rank = max((len(s) for s in shapes), default=0)
    for d in range(rank):
        yield tuple(Split(d) if len(s) == rank else B for s in shapes), (Split(d),) * len(ctx.out_avals)
    yield (B,) * len(shapes), (B,) * len(ctx.out_avals)
    for ins, out in partial_sigs:
        yield ins, (out,) * len(ctx.out_avals)


def _inexact(dtype) -> bool:
    return bool(np.issubdtype(np.dtype(dtype), np.inexact)) or "float" in str(dtype)


@register_sbp_rule(*UNARY)
def _unary(ctx):
    yield from _elementwise(ctx)
    if ctx.primitive.name == "integer_pow" and ctx.params.get("y") == 1:
        yield (P,), (P,)


@register_sbp_rule(*LINEAR_UNARY)
def _linear_unary(ctx):
    extra = [((P,), P)]
    if ctx.primitive.name in ("stop_gradient", "copy"):  # identities keep any partial
        extra += [((PMAX,), PMAX), ((PMIN,), PMIN)]
    yield from _elementwise(ctx, extra)


@register_sbp_rule("convert_element_type")
def _convert(ctx):
    src = np.dtype(ctx.in_avals[0].dtype)
    dst = np.dtype(ctx.out_avals[0].dtype)
    extra = []
    if np.issubdtype(src, np.inexact) and np.issubdtype(dst, np.inexact):
        extra.append(((P,), P))
    if src == dst or (np.issubdtype(src, np.floating) and np.issubdtype(dst, np.floating)):
        extra += [((PMAX,), PMAX), ((PMIN,), PMIN)]
    yield from _elementwise(ctx, extra)


@register_sbp_rule(*BINARY)
def _binary(ctx):
    name = ctx.primitive.name
    a, b = ctx.in_shapes
    extra = []
    if name in ("add", "add_any", "sub"):
        extra.append(((P, P), P))
    elif name == "mul":
        extra += [((P, B), P), ((B, P), P)]
    elif name == "div" and _inexact(ctx.out_avals[0].dtype):  # integer division is not linear
        extra.append(((P, B), P))
    elif name == "max":
        extra += [((PMAX, PMAX), PMAX), ((PMAX, B), PMAX), ((B, PMAX), PMAX)]
    elif name == "min":
        extra += [((PMIN, PMIN), PMIN), ((PMIN, B), PMIN), ((B, PMIN), PMIN)]
    yield from _elementwise(ctx, extra)


@register_sbp_rule("select_n")
def _select_n(ctx):
    n = len(ctx.in_avals) - 1
    yield from _elementwise(ctx, [((B,) + (P,) * n, P)])


@register_sbp_rule("clamp")
def _clamp(ctx):
    yield from _elementwise(ctx)


def _annotation_local(st, ins):
    """Sharding annotations describe a *logical* mesh that the consistent view owns: on local
    shards they are identities (binding one inside the shard_map would name foreign devices)."""
    return list(ins) if st.eqn.primitive.multiple_results else ins[0]


def _identity_sigs(ctx):
    """Identities keep every layout, partial ones included; several operands move together."""
    n_in, n_out = len(ctx.in_avals), len(ctx.out_avals)
    rank = min((len(s) for s in ctx.in_shapes), default=0)
    for d in range(rank):
        yield (Split(d),) * n_in, (Split(d),) * n_out
    for x in (B, P, PMAX, PMIN):
        yield (x,) * n_in, (x,) * n_out


register_sbp_rule("sharding_constraint", local=_annotation_local)(_identity_sigs)
register_sbp_rule("optimization_barrier", "name")(_identity_sigs)


@register_sbp_rule("bitcast_convert_type")
def _bitcast(ctx):
    """Same width: elementwise. A narrower result gains a trailing dim, a wider one loses one;
    every other dim can stay split."""
    in_rank, out_rank = len(ctx.in_shapes[0]), len(ctx.out_shapes[0])
    for d in range(min(in_rank, out_rank)):
        yield (Split(d),), (Split(d),)
    yield (B,), (B,)
