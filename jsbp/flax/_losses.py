"""Losses whose layouts are part of the strategy: the vocab-parallel cross-entropy."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ._strategy import constrain

__all__ = ["softmax_cross_entropy"]


def softmax_cross_entropy(logits, labels, names: Sequence[str | None] | None = None):
    """Mean softmax cross-entropy with integer labels, written so that logits split over the
    class dim (Megatron's vocab-parallel head) are never gathered.

    Each row's statistics — the max, the sum of exponentials and the label's logit — are
    reductions over the class dim: with logits ``S(-1)`` they are partial (``Pmax`` / ``P``) and
    only those per-row scalars are all-reduced. ``names`` are the logical names of the logits'
    dims (e.g. ``("batch", "seq", "vocab")``); the row statistics are pinned to the layout of the
    leading names so the planner reduces them instead of re-splitting them. On one device this
    is ``optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()``.
    """
    row = None if names is None else tuple(names[:-1])
    if names is not None:
        logits = constrain(logits, names)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    if row is not None:
        m = constrain(m, row + (None,))
    z = logits - m
    sum_exp = jnp.sum(jnp.exp(z), axis=-1)
    label_z = jnp.sum(jnp.where(labels[..., None] == jnp.arange(logits.shape[-1]), z, 0.0), axis=-1)
    if row is not None:
        sum_exp = constrain(sum_exp, row)
        label_z = constrain(label_z, row)
    return jnp.mean(jnp.log(sum_exp) - label_z)
