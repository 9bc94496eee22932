"""Elementwise primitives that JAX 0.10 added or that live outside ``lax``'s arithmetic:
``complex`` (linear in its two real operands together), the total-order comparisons ``eq_to``,
``le_to``, ``lt_to`` (from ``jnp.searchsorted`` and sorting), ``platform_index`` (the selector
of ``lax.platform_dependent``, which ``jnp.linalg.det`` uses: a scalar, ``B``) and ``empty2`` (an
uninitialised scalar buffer, ``B``)."""

from __future__ import annotations

from ._common import B, P
from ._registry import register_sbp_rule
from .elementwise import _elementwise


@register_sbp_rule("complex")
def _complex(ctx):
    # complex(a, b) = a + i b: linear in (a, b) together
    yield from _elementwise(ctx, [((P, P), P)])


@register_sbp_rule("eq_to", "le_to", "lt_to")
def _total_order_compare(ctx):
    yield from _elementwise(ctx)


@register_sbp_rule("platform_index")
def _platform_index(ctx):
    yield (), (B,)


@register_sbp_rule("empty2")
def _empty2(ctx):
    # lax.empty2: an uninitialised scalar (JAX 0.10's scan partial evaluation allocates its
    # residual buffers with it, e.g. under the gradient of a scan or of nnx.cond); nothing reads
    # its value before it is overwritten, and a scalar is whole on every device
    yield (), (B,)
