"""PRNG primitives: random values must not depend on the layout.

Drawing bits (``random_bits``, ``rng_bit_generator``) and deriving keys (``random_seed``,
``random_split``, ``random_fold_in``) run whole on every device (B); a consumer that wants the value
split slices it for free (B -> S). Pure re-interpretations of key data (``random_wrap``,
``random_unwrap``, ``random_clone``) and the elementwise hash ``threefry2x32`` keep splits.
"""

from __future__ import annotations

from .._sbp import Split
from ._common import B
from ._registry import register_sbp_rule

# fmt: off
WHOLE = (
    "random_seed", "random_bits", "random_split", "random_fold_in", "rng_bit_generator",
)
# fmt: on
KEY_DATA = ("random_wrap", "random_unwrap", "random_clone")


@register_sbp_rule(*WHOLE)
def _random(ctx):
    yield (B,) * len(ctx.in_avals), (B,) * len(ctx.out_avals)


@register_sbp_rule(*KEY_DATA)
def _key_data(ctx):
    # wrap drops the trailing key-data dim, unwrap adds it: the leading (batch) dims line up
    rank = min(len(ctx.in_shapes[0]), len(ctx.out_shapes[0]))
    for d in range(rank):
        yield (Split(d),), (Split(d),)
    yield (B,), (B,)


@register_sbp_rule("threefry2x32")
def _threefry(ctx):
    rank = len(ctx.out_shapes[0])
    n_out = len(ctx.out_avals)
    for d in range(rank):
        out = ctx.out_shapes[0]  # a size-1 (broadcast) dim of an operand stays B, as in elementwise
        yield tuple(Split(d) if len(s) == rank and s[d] == out[d] else B for s in ctx.in_shapes), (Split(d),) * n_out
    yield (B,) * len(ctx.in_avals), (B,) * n_out
