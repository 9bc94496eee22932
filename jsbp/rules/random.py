"""PRNG primitives: random values must not depend on the layout, so they are made whole (B)
on every device and the consumer slices them (B -> S is free)."""

from __future__ import annotations

from ._common import B
from ._registry import register_sbp_rule

RANDOM = (
    "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap", "random_unwrap",
    "threefry2x32", "rng_bit_generator", "rng_uniform", "random_clone",
)


@register_sbp_rule(*RANDOM)
def _random(ctx):
    yield (B,) * len(ctx.in_avals), (B,) * len(ctx.out_avals)
