"""``jsbp.nn``: layers the planner places as a whole.

``dot_product_attention`` has the signature and semantics of ``jax.nn.dot_product_attention``
([batch, seq, heads, head_dim]); inside ``jsbp.jit`` it is one node of the plan, run on the
layouts its operands arrive in, with a sequence split run by one of three exact plans the cost
model chooses between (``plan=`` forces one): the key/value all-gathered, a ring of
collective-permutes, or heads split by all-to-all (Ulysses). ``flax_attention`` is the same
function with the signature ``flax.nnx.MultiHeadAttention(attention_fn=...)`` calls.
"""

from __future__ import annotations

import math

from .._errors import SbpError
from ._attention import PLANS, attend

__all__ = ["dot_product_attention", "flax_attention"]


def dot_product_attention(
    query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, plan=None
):
    """Scaled dot-product attention, as ``jax.nn.dot_product_attention``.

    ``query`` is [batch, T, heads, head_dim]; ``key`` and ``value`` [batch, S, kv_heads,
    head_dim] with ``heads`` a multiple of ``kv_heads``; ``bias`` (added to the logits) and
    ``mask`` (bool, True keeps a logit) broadcast to [batch, heads, T, S]. ``is_causal`` keeps
    key positions at or before the query's. A query row with every key masked averages the values
    uniformly, as JAX does.

    ``plan`` (None: the cost model chooses) forces one way to run, on one placement axis (the
    others replicate or split the batch): ``"gather"`` (queries split along the sequence, key and value
    all-gathered), ``"ring"`` (query, key and value split along the sequence, key/value blocks
    passed round with collective-permutes; T == S only, else the cost model chooses) or
    ``"heads"`` (the heads split: all-to-all from a sequence split, Ulysses). ``jsbp.explain``
    names the plan run.

    On global tensors it runs eagerly; inside ``jsbp.jit``, ``jax.jit`` or ``jax.grad`` it is
    traced. Differentiable in query, key, value and bias (a bias that is differentiated runs the
    plain computation); forward-mode differentiation is not supported (a ``jax.custom_vjp``).
    """
    from .._tensor import GlobalTensor

    args = (query, key, value, bias, mask)
    if any(isinstance(a, GlobalTensor) for a in args):
        from .._ops import eager

        return eager(_checked, *args, scale=scale, is_causal=is_causal, plan=plan)
    return _checked(*args, scale=scale, is_causal=is_causal, plan=plan)


def _checked(query, key, value, bias, mask, *, scale, is_causal, plan):
    import jax.numpy as jnp

    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    where = f"jsbp.nn.dot_product_attention(query {q.shape}, key {k.shape}, value {v.shape})"
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise SbpError(
            f"{where}: query, key and value must be 4-d [batch, seq, heads, head_dim] with key and "
            "value of one shape."
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise SbpError(
            f"{where}: batch and head_dim must agree and the query heads must be a multiple of "
            "the key/value heads."
        )
    if plan is not None and plan not in PLANS:
        raise SbpError(f"{where}: plan={plan!r}; use None or one of {', '.join(PLANS)}.")
    full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    bias = None if bias is None else _four_d(jnp.asarray(bias), full, "bias", where)
    mask = None if mask is None else _four_d(jnp.asarray(mask), full, "mask", where)
    if mask is not None and mask.dtype != jnp.bool_:
        raise SbpError(f"{where}: mask must be boolean (True keeps a logit), got {mask.dtype}.")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    return attend(q, k, v, bias, mask, scale, is_causal, plan)


def _four_d(x, full, what, where):
    x = x.reshape((1,) * (4 - x.ndim) + x.shape) if x.ndim <= 4 else x
    if x.ndim != 4 or any(d not in (1, f) for d, f in zip(x.shape, full)):
        raise SbpError(
            f"{where}: {what} of shape {x.shape} does not broadcast to [batch, heads, T, S] = "
            f"{list(full)}."
        )
    return x


def flax_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal=False,
):
    """``dot_product_attention`` with the signature of ``flax.nnx.dot_product_attention``, for
    ``nnx.MultiHeadAttention(..., attention_fn=jsbp.nn.flax_attention)``. Attention dropout
    (``dropout_rate > 0`` while not deterministic) and sown attention weights (``module``) need
    the weights themselves: those calls run Flax's own function."""
    from flax import nnx

    if (dropout_rate > 0.0 and not deterministic) or module is not None:
        kw = {} if promote_dtype is None else {"promote_dtype": promote_dtype}
        return nnx.dot_product_attention(
            query,
            key,
            value,
            bias,
            mask,
            broadcast_dropout,
            dropout_rng,
            dropout_rate,
            deterministic,
            dtype,
            precision,
            module,
            is_causal=is_causal,
            **kw,
        )
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    elif dtype is not None:
        query, key, value = (x.astype(dtype) for x in (query, key, value))
    if mask is not None:  # Flax's masks are often float: a nonzero entry keeps the logit
        mask = mask.astype(bool)
    return dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
