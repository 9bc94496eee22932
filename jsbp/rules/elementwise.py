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
LINEAR_UNARY = ("neg", "stop_gradient", "copy", "copy_p", "real", "imag", "conj")
BINARY = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "and", "or", "xor",
    "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "nextafter", "igamma", "igammac", "random_gamma_grad", "polygamma", "zeta",
)


def _elementwise(ctx, partial_sigs=()):
    shapes = ctx.in_shapes
    rank = max((len(s) for s in shapes), default=0)
    for d in range(rank):
        yield tuple(Split(d) if len(s) == rank else B for s in shapes), (Split(d),) * len(ctx.out_avals)
    yield (B,) * len(shapes), (B,) * len(ctx.out_avals)
    for ins, out in partial_sigs:
        yield ins, (out,) * len(ctx.out_avals)


def _scalar(shape):
    return len(shape) == 0


@register_sbp_rule(*UNARY)
def _unary(ctx):
    yield from _elementwise(ctx)
    if ctx.primitive.name == "integer_pow" and ctx.params.get("y") == 1:
        yield (P,), (P,)


@register_sbp_rule(*LINEAR_UNARY)
def _linear_unary(ctx):
    extra = [((P,), P)]
    if ctx.primitive.name in ("stop_gradient", "copy", "copy_p"):  # identities keep any partial
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
    elif name == "div":
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


@register_sbp_rule("sharding_constraint", "optimization_barrier", "pvary", "mesh_cast", "reshard", "name")
def _identity(ctx):
    n = len(ctx.in_avals)
    if n == 1:
        yield from _elementwise(ctx, [((P,), P), ((PMAX,), PMAX), ((PMIN,), PMIN)])
    else:  # multi-operand identities: every operand keeps B
        yield (B,) * n, (B,) * len(ctx.out_avals)
