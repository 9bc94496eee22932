"""``fft`` (``jnp.fft.fft`` / ``ifft`` / ``rfft`` / ``irfft`` / ``fft2`` / ``fftn``): the transform
runs over the last ``len(fft_lengths)`` dims; every leading dim is a batch dim and keeps its split.
Every FFT type is (real-)linear, so ``P -> P``. A split transformed dim is gathered (``B``)."""

from __future__ import annotations

from .._sbp import Split
from ._common import B, P
from ._registry import register_sbp_rule


@register_sbp_rule("fft")
def _fft(ctx):
    rank = len(ctx.in_shapes[0])
    for d in range(rank - len(ctx.params["fft_lengths"])):
        yield (Split(d),), (Split(d),)
    yield (B,), (B,)
    yield (P,), (P,)
