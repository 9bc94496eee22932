"""Elementwise primitives: matching splits are kept; linear ops keep partial sums; monotone ops
keep partial maxima and minima.

Why each partial signature holds, with ``a_i`` the addends (pieces) on the devices of one axis:

* linear: ``f(sum a_i) = sum f(a_i)`` (neg, add/sub of two P, scaling by a B operand, select_n
  between two P, float conversions);
* monotone non-decreasing on the whole real line: ``f(max a_i) = max f(a_i)`` (exp, tanh, floor,
  ...); non-increasing swaps max and min (neg). Functions that are NaN somewhere (log, sqrt) are
  left out: a piece below the maximum may lie outside their domain;
* shifts: ``max a_i + b = max (a_i + b)`` for a B operand ``b`` (floats only: integers wrap).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._sbp import Split
from ._common import PMAX, PMIN, B, P
from ._registry import register_sbp_rule

# fmt: off
UNARY = (
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sqrt", "rsqrt", "cbrt", "sin", "cos",
    "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "abs", "sign", "floor",
    "ceil", "round", "erf", "erfc", "erf_inv", "lgamma", "digamma", "is_finite", "not", "integer_pow",
    "square", "population_count", "clz", "reduce_precision",
    "bessel_i0e", "bessel_i1e",
    "one_minus_square", "log2",  # JAX >= 0.11 (one_minus_square: 1 - x**2, the derivative of tanh)
)
# fmt: on
# fmt: off
MONOTONE = (  # non-decreasing and defined on every real number
    "exp", "exp2", "expm1", "tanh", "logistic", "cbrt", "atan", "sinh", "asinh", "erf", "floor",
    "ceil", "round", "sign", "reduce_precision",
)
# fmt: on
# fmt: off
LINEAR_UNARY = ("neg", "stop_gradient", "copy", "real", "imag", "conj")
# fmt: off
BINARY = (
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "and", "or", "xor",
    "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_logical", "shift_right_arithmetic",
    "nextafter", "igamma", "igammac", "polygamma", "zeta",
)
# fmt: on
# fmt: on
_KEEP_EXTREMES = [((PMAX,), PMAX), ((PMIN,), PMIN)]


def _elementwise(ctx, partial_sigs=()):
    """Every dim split alike on the full-rank operands, all B, and the given partial signatures.
    An operand that is broadcast along a dim (a scalar, or a size-1 dim of a rank-equal operand
    against a longer result: ``(4, 4) * (4, 1)`` is one ``mul``) stays B there: each block of the
    result needs all of it."""
    shapes = ctx.in_shapes
    rank = max((len(s) for s in shapes), default=0)
    out = ctx.out_shapes[0] if ctx.out_avals else ()
    for d in range(rank):
        yield (
            tuple(Split(d) if len(s) == rank and s[d] == out[d] else B for s in shapes),
            (Split(d),) * len(ctx.out_avals),
        )
    yield (B,) * len(shapes), (B,) * len(ctx.out_avals)
    for ins, out in partial_sigs:
        yield ins, (out,) * len(ctx.out_avals)


def _inexact(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def _float(dtype) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _real(dtype) -> bool:
    return not jnp.issubdtype(dtype, jnp.complexfloating) and not jnp.issubdtype(
        dtype, jax.dtypes.extended
    )


@register_sbp_rule(*UNARY)
def _unary(ctx):
    name = ctx.primitive.name
    extra = []
    if name in MONOTONE and _real(ctx.in_avals[0].dtype):
        extra += _KEEP_EXTREMES
    if name == "integer_pow":
        y = ctx.params.get("y")
        if y == 1:
            extra += [((P,), P)] + _KEEP_EXTREMES
        elif y % 2 == 1 and y > 0 and _float(ctx.in_avals[0].dtype):  # odd powers are monotone
            extra += _KEEP_EXTREMES
    yield from _elementwise(ctx, extra)


@register_sbp_rule(*LINEAR_UNARY)
def _linear_unary(ctx):
    extra = [((P,), P)]
    name = ctx.primitive.name
    if name in ("stop_gradient", "copy"):  # identities keep any partial
        extra += _KEEP_EXTREMES
    elif name == "neg":  # -max(a_i) = min(-a_i)
        extra += [((PMAX,), PMIN), ((PMIN,), PMAX)]
    yield from _elementwise(ctx, extra)


@register_sbp_rule("convert_element_type")
def _convert(ctx):
    src, dst = ctx.in_avals[0].dtype, ctx.out_avals[0].dtype
    extra = []
    if _inexact(src) and _inexact(dst):  # rounding aside, a float conversion is linear
        extra.append(((P,), P))
    # monotone: into a float from any real type (or to the same type)
    if src == dst or (_real(src) and _real(dst) and jnp.issubdtype(dst, jnp.floating)):
        extra += _KEEP_EXTREMES
    yield from _elementwise(ctx, extra)


@register_sbp_rule(*BINARY)
def _binary(ctx):
    name = ctx.primitive.name
    extra = []
    if name in ("add", "add_any", "sub"):
        extra.append(((P, P), P))
        if _float(ctx.in_avals[0].dtype):  # integers wrap around: not monotone
            extra += [((PMAX, B), PMAX), ((PMIN, B), PMIN)]
            if name == "sub":  # b - max(a_i) = min(b - a_i)
                extra += [((B, PMAX), PMIN), ((B, PMIN), PMAX)]
            else:
                extra += [((B, PMAX), PMAX), ((B, PMIN), PMIN)]
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
    """Choosing between partial operands with a B predicate keeps the partial kind."""
    n = len(ctx.in_avals) - 1
    yield from _elementwise(ctx, [((B,) + (x,) * n, x) for x in (P, PMAX, PMIN)])


@register_sbp_rule("clamp")
def _clamp(ctx):
    """clamp(lo, x, hi) is monotone in x: B bounds keep a partial max / min of x."""
    yield from _elementwise(ctx, [((B, x, B), x) for x in (PMAX, PMIN)])


def _identity_sigs(ctx):
    """Identities keep every layout, partial ones included; several operands move together."""
    n_in, n_out = len(ctx.in_avals), len(ctx.out_avals)
    rank = min((len(s) for s in ctx.in_shapes), default=0)
    for d in range(rank):
        yield (Split(d),) * n_in, (Split(d),) * n_out
    for x in (B, P, PMAX, PMIN):
        yield (x,) * n_in, (x,) * n_out


register_sbp_rule("optimization_barrier", "name")(_identity_sigs)


@register_sbp_rule("bitcast_convert_type")
def _bitcast(ctx):
    """Same width: elementwise. A narrower result gains a trailing dim, a wider one loses one;
    every other dim can stay split."""
    in_rank, out_rank = len(ctx.in_shapes[0]), len(ctx.out_shapes[0])
    for d in range(min(in_rank, out_rank)):
        yield (Split(d),), (Split(d),)
    yield (B,), (B,)
