"""PRNG primitives: random values must not depend on the layout.

Deriving keys (``random_seed``, ``random_split``, ``random_fold_in``) and ``rng_bit_generator``
run whole on every device (B); a consumer that wants the value split slices it for free (B -> S).
``random_gamma`` keeps splits of its batch of keys (with the matching dims of its shapes). Pure
re-interpretations of key data (``random_wrap``, ``random_unwrap``, ``random_clone``) and the
elementwise hash ``threefry2x32`` keep splits.

``random_bits`` keeps the splits of a batch of keys, and with JAX's partitionable threefry (the
default: ``jax_threefry_partitionable``) it also draws a split block of bits directly: bit ``i``
of a threefry key is the hash of the 64-bit counter ``i`` (its row-major index), so a device hashes
only its own block's counters — the same bits as one device, without drawing the whole array on
every device and slicing it (XLA's SPMD partitioner does the same).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._boxing import _device_index
from .._sbp import Split
from ._common import B
from ._registry import register_sbp_rule

# fmt: off
WHOLE = (
    "random_seed", "random_split", "random_fold_in", "rng_bit_generator",
)
# fmt: on
KEY_DATA = ("random_wrap", "random_unwrap", "random_clone")


@register_sbp_rule(*WHOLE)
def _random(ctx):
    yield (B,) * len(ctx.in_avals), (B,) * len(ctx.out_avals)


@register_sbp_rule("random_gamma")
def _gamma(ctx):
    # random_gamma(keys, a): keys are a's leading dims (a batch), each key split into one key per
    # element of its trailing block of a (jax.random.gamma / beta / dirichlet). Splitting a key
    # dim with a keeps every key with its own block: the same values as one device. A split of
    # the trailing dims would change how each key is divided, so those stay whole.
    for d in range(len(ctx.in_shapes[0])):
        yield (Split(d), Split(d)), (Split(d),)
    yield (B, B), (B,)


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
        yield (
            tuple(Split(d) if len(s) == rank and s[d] == out[d] else B for s in ctx.in_shapes),
            (Split(d),) * n_out,
        )
    yield (B,) * len(ctx.in_avals), (B,) * n_out


def _split_bits_ok(ctx) -> bool:
    """Whether a block of ``random_bits`` can be drawn on its own: a threefry key, partitionable
    counters (JAX's default), and a per-key size whose counters fit in 32 bits (the block's
    counters are computed in uint32; the high words are then zero, as on one device)."""
    impl = getattr(ctx.in_avals[0].dtype, "_impl", None)
    return (
        getattr(impl, "name", None) == "threefry2x32"
        and bool(jax.config.jax_threefry_partitionable)
        and math.prod(ctx.params["shape"]) < 2**32
    )


def _bits_sigs(ctx):
    nk = len(ctx.in_shapes[0])  # a batch of keys: one array of bits per key
    for d in range(nk):
        yield (Split(d),), (Split(d),)
    if _split_bits_ok(ctx):
        for d in range(len(ctx.params["shape"])):
            yield (B,), (Split(nk + d),)
    yield (B,), (B,)


def _bits_local(st, ins):
    (key,) = ins
    params = st.eqn.params
    lay = st.out_layouts[0]
    nk = key.ndim
    if not any(lay.splitters[d] for d in range(nk, len(lay.shape))):
        return st.eqn.primitive.bind(key, **params)  # whole per-key arrays (key batch maybe split)
    from jax.extend.random import threefry2x32_p

    shape = tuple(params["shape"])
    local = tuple(lay.local_shape[nk:])
    strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
    me = _device_index(lay.placement)
    counts = jnp.zeros(local, jnp.uint32)
    for j, stride in enumerate(strides):
        idx = lax.broadcasted_iota(jnp.uint32, local, j)
        if lay.splitters[nk + j]:
            offs = np.array([blk[nk + j][0] for blk in lay.blocks], dtype=np.uint32)
            idx = idx + jnp.asarray(offs)[me]
        counts = counts + idx * np.uint32(stride)  # < 2**32 (``_split_bits_ok``): no wrap
    hi = jnp.zeros(local, jnp.uint32)

    def draw(kd):
        b1, b2 = threefry2x32_p.bind(kd[0], kd[1], hi, counts)
        width = params["bit_width"]
        if width == 64:
            dt = jnp.uint64
            return lax.shift_left(b1.astype(dt), jnp.asarray(32, dt)) | b2.astype(dt)
        return lax.convert_element_type(b1 ^ b2, np.dtype(f"uint{width}"))

    data = jax.random.key_data(key)  # (..., 2) uint32
    for _ in range(nk):
        draw = jax.vmap(draw)
    return draw(data)


register_sbp_rule("random_bits", local=_bits_local)(_bits_sigs)
