"""Pure-JAX attention kernels for context (sequence) parallelism.

Layout follows :func:`jax.nn.dot_product_attention`: ``q`` is ``[B, T, N, H]``, ``k`` and ``v``
are ``[B, S, K, H]`` with ``N % K == 0`` (grouped-query attention: query head ``n`` reads kv head
``n // (N // K)``). ``bias`` (float) and ``mask`` (bool, True = keep) are 4-d arrays broadcastable
to ``[B, N, T, S]`` (any dim may be 1). Results equal
``jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, is_causal=is_causal)``
(``implementation='xla'``); softmax statistics are kept in float32.

What exists:

* :func:`attention` / :func:`attention_bwd` -- one device's exact attention of a query block
  against a key block (flash-attention style forward returning ``(out, lse)``, and the matching
  backward ``(dq, dk, dv)`` from ``out``, ``lse`` and ``dout``). ``q_start`` / ``k_start`` are
  the blocks' global positions (used by the causal mask; may be traced), ``q_valid`` /
  ``k_valid`` the numbers of unpadded rows (may be traced; ``None`` = all rows).
* :func:`ring_attention` / :func:`ring_attention_bwd` -- the same over a sequence split along
  one mesh axis, called on local shards inside a manual ``jax.shard_map``. ``q``, ``k``, ``v``
  (and ``out``, ``lse``, ``dout`` in the backward) are split along the sequence with the balanced
  splitter (``starts`` / ``sizes``, static tuples); every local block has length
  ``L = ceil(T / n)`` and rows past ``sizes[i]`` are padding with arbitrary finite values. K/V
  blocks travel round the ring with ``lax.ppermute`` (one collective-permute per step per dtype:
  arrays of one dtype are packed together); the forward merges blocks by online softmax, the
  backward sends the dk/dv accumulators round with K/V and one final hop brings them home. No
  other collective is used. With ``is_causal`` the blocks above the diagonal are skipped
  (``lax.cond``); ``balance=True`` (used when ``L`` is even, otherwise ignored) first rearranges
  the blocks into the zig-zag order -- device ``i`` holds half-chunks ``i`` and ``2n-1-i`` --
  so that every device does the same causal work, and sends the results back afterwards.
  ``bias`` / ``mask`` come split along the query dim (dim 2, local length ``L``, or size 1) with
  the key dim (dim 3) either the full logical length ``S = sum(sizes)``, the padded length
  ``n * L``, or 1.
* :func:`attention_vjp` and :func:`ring_attention_vjp` -- ``jax.custom_vjp`` wrappers returning
  ``out`` only and differentiable in ``q``, ``k``, ``v`` through the kernels above.

Semantics worth knowing:

* Masked logits. ``jax.nn.dot_product_attention`` replaces masked logits (mask and causal) by
  the finite value ``-0.7 * finfo(float32).max``, so a query row whose keys are *all* masked gets
  the uniform average of all ``S`` values, while in a row with at least one kept key the masked
  keys weigh exactly 0. The kernels reproduce this: kept keys go through the online softmax,
  and for rows without a kept key the output is the mean of ``v`` over all valid keys (of the
  block in :func:`attention`, of the whole sequence in the ring). The ``lse`` of such a row is
  that fill value ``_FILL`` (``_FILL + log(count)`` rounds to it in float32); the backwards
  recognise such rows by ``lse == _FILL`` and give every valid key ``1 / k_total`` of their
  ``dout`` in ``dv`` (no ``dq`` / ``dk``, as in JAX, where masked logits are constants).
  Combining two blocks by ``lse`` in which one row is fully masked in both is exact only when
  the blocks hold the same number of valid keys.
* A valid query row with no valid key at all (only possible in :func:`attention` with
  ``k_valid == 0``) gets ``out = 0`` and ``lse = -inf``. Padded query rows get ``out = 0`` and
  ``lse = 0``; they contribute nothing to ``dk`` / ``dv`` and get ``dq = 0``. Padded key rows
  never contribute and get ``dk = dv = 0``.
* ``bias`` and ``mask`` are not differentiated (the wrappers return zero cotangents for them).
* Causal means key position <= query position in global positions (``T == S``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "attention",
    "attention_bwd",
    "attention_vjp",
    "ring_attention",
    "ring_attention_bwd",
    "ring_attention_vjp",
]

_F32 = jnp.float32
# The value jax.nn.dot_product_attention writes into masked logits (float32 softmax).
_FILL = float(np.float32(-0.7 * float(np.finfo(np.float32).max)))


# --------------------------------------------------------------------------------------------
# block math (positions and validity given per row)
# --------------------------------------------------------------------------------------------


def _to5(x, K, G):
    """``[b, n|1, t, s]`` -> ``[b, K|1, G|1, t, s]`` matching logits ``[B, K, G, T, S]``."""
    if x is None:
        return None
    if x.ndim != 4:
        raise ValueError(f"bias/mask must be 4-d [B, N, T, S], got shape {x.shape}")
    b, nh, t, s = x.shape
    if nh == 1:
        return x[:, :, None]
    if nh != K * G:
        raise ValueError(f"bias/mask head dim {nh} is neither 1 nor N={K * G}")
    return x.reshape(b, K, G, t, s)


def _logits(q5, k, bias5, mask5, scale, is_causal, qpos, qvalid, kpos, kvalid):
    """Scaled, biased logits ``[B, K, G, T, S]`` (f32) and the boolean ``ok`` of the entries
    that take part in the softmax (kept by mask and causality, both rows valid)."""
    s = jnp.einsum("btkgh,bskh->bkgts", q5, k, preferred_element_type=_F32)
    s = s * jnp.asarray(scale, _F32)
    if bias5 is not None:
        s = s + bias5.astype(_F32)
    ok = qvalid[:, None] & kvalid[None, :]
    if is_causal:
        ok = ok & (kpos[None, :] <= qpos[:, None])
    if mask5 is not None:
        ok = ok & mask5
    return s, ok


def _fwd_state(B, T, K, G, H):
    m = jnp.full((B, K, G, T), -jnp.inf, _F32)
    l = jnp.zeros((B, K, G, T), _F32)
    acc = jnp.zeros((B, T, K, G, H), _F32)
    vsum = jnp.zeros((B, K, H), _F32)
    cnt = jnp.zeros((), _F32)
    return m, l, acc, vsum, cnt


def _vsum(v, kvalid):
    """Sum over valid key rows of ``v`` (``[B, K, H]``, f32) and their count."""
    w = kvalid.astype(_F32)
    return jnp.einsum("bskh,s->bkh", v.astype(_F32), w), jnp.sum(w)


def _fwd_update(state, q5, k, v, bias5, mask5, scale, is_causal, qpos, qvalid, kpos, kvalid):
    """Online-softmax merge of one key block into the running state."""
    m, l, acc, vsum, cnt = state
    s, ok = _logits(q5, k, bias5, mask5, scale, is_causal, qpos, qvalid, kpos, kvalid)
    m_new = jnp.maximum(m, jnp.max(jnp.where(ok, s, -jnp.inf), axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.exp(m - m_safe)
    p = jnp.where(ok, jnp.exp(s - m_safe[..., None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(_F32))
    acc = acc * jnp.transpose(alpha, (0, 3, 1, 2))[..., None] + pv
    vs, c = _vsum(v, kvalid)
    return m_new, l, acc, vsum + vs, cnt + c


def _fwd_skip(state, v, kvalid):
    """A key block every query row masks entirely: only the all-masked fallback changes."""
    m, l, acc, vsum, cnt = state
    vs, c = _vsum(v, kvalid)
    return m, l, acc, vsum + vs, cnt + c


def _fwd_finish(state, qvalid, dtype):
    """``(out [B, T, N, H], lse [B, N, T])`` from the running state."""
    m, l, acc, vsum, cnt = state
    B, T, K, G, H = acc.shape
    lt = jnp.transpose(l, (0, 3, 1, 2))[..., None]  # [B, T, K, G, 1]
    out = acc / jnp.where(lt > 0, lt, 1.0)
    mean = vsum / jnp.where(cnt > 0, cnt, 1.0)  # [B, K, H]
    out = jnp.where(lt > 0, out, mean[:, None, :, None, :])
    out = jnp.where(qvalid[None, :, None, None, None], out, 0.0)
    lse = m + jnp.log(jnp.where(l > 0, l, 1.0))
    lse = jnp.where(l > 0, lse, jnp.where(cnt > 0, _FILL, -jnp.inf))
    lse = jnp.where(qvalid, lse, 0.0)
    return out.reshape(B, T, K * G, H).astype(dtype), lse.reshape(B, K * G, T)


def _bwd_prep(out, lse, dout, K, G):
    B, T, N, H = out.shape
    dout5 = dout.reshape(B, T, K, G, H).astype(_F32)
    D = jnp.einsum("btkgh,btkgh->bkgt", dout5, out.reshape(B, T, K, G, H).astype(_F32))
    lse5 = lse.reshape(B, K, G, T).astype(_F32)
    return dout5, D, lse5


def _bwd_block(
    q5, k, v, bias5, mask5, dout5, D, lse5, scale, is_causal, qpos, qvalid, kpos, kvalid
):
    """Gradient contributions of one (query block, key block) pair: ``(dq5, dk, dv)`` in f32."""
    s, ok = _logits(q5, k, bias5, mask5, scale, is_causal, qpos, qvalid, kpos, kvalid)
    p = jnp.where(ok, jnp.exp(s - lse5[..., None]), 0.0)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, dout5)
    dp = jnp.einsum("btkgh,bskh->bkgts", dout5, v.astype(_F32))
    ds = p * (dp - D[..., None]) * jnp.asarray(scale, _F32)
    dq5 = jnp.einsum("bkgts,bskh->btkgh", ds, k.astype(_F32))
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, q5.astype(_F32))
    return dq5, dk, dv


def _bwd_uniform(dout5, lse5, qvalid, kvalid, k_total):
    """``dv`` of the rows with every key masked: each valid key gets ``dout / k_total``."""
    full = (lse5 == _FILL) & qvalid
    coef = full.astype(_F32) / jnp.maximum(jnp.asarray(k_total, _F32), 1.0)
    g = jnp.einsum("bkgt,btkgh->bkh", coef, dout5)
    return jnp.where(kvalid[None, :, None, None], g[:, None], 0.0)


def _rows(start, valid, n):
    pos = jnp.asarray(start, jnp.int32) + jnp.arange(n, dtype=jnp.int32)
    if valid is None:
        ok = jnp.ones((n,), bool)
    else:
        ok = jnp.arange(n) < jnp.asarray(valid)
    return pos, ok


def _check(q, k, v):
    B, T, N, H = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != H:
        raise ValueError(f"bad shapes q{q.shape} k{k.shape} v{v.shape}")
    K = k.shape[2]
    if N % K:
        raise ValueError(f"query heads {N} not a multiple of kv heads {K}")
    return B, T, N, H, K, N // K


def _default_scale(scale, H):
    return 1.0 / math.sqrt(H) if scale is None else scale


# --------------------------------------------------------------------------------------------
# single block
# --------------------------------------------------------------------------------------------


def attention(
    q,
    k,
    v,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    q_start=0,
    k_start=0,
    q_valid=None,
    k_valid=None,
):
    """Exact attention of one query block against one key block: ``(out, lse)``.

    ``out`` is ``[B, T, N, H]`` in ``q.dtype``; ``lse`` is ``[B, N, T]`` float32, the
    log-sum-exp of the scaled, biased, masked logits (see the module docstring for fully masked
    and padded rows). ``scale=None`` means ``1/sqrt(H)``.
    """
    B, T, N, H, K, G = _check(q, k, v)
    S = k.shape[1]
    scale = _default_scale(scale, H)
    qpos, qok = _rows(q_start, q_valid, T)
    kpos, kok = _rows(k_start, k_valid, S)
    state = _fwd_state(B, T, K, G, H)
    state = _fwd_update(
        state,
        q.reshape(B, T, K, G, H),
        k,
        v,
        _to5(bias, K, G),
        _to5(mask, K, G),
        scale,
        is_causal,
        qpos,
        qok,
        kpos,
        kok,
    )
    return _fwd_finish(state, qok, q.dtype)


def attention_bwd(
    q,
    k,
    v,
    bias,
    mask,
    out,
    lse,
    dout,
    *,
    scale=None,
    is_causal=False,
    q_start=0,
    k_start=0,
    q_valid=None,
    k_valid=None,
    k_total=None,
):
    """Gradients ``(dq, dk, dv)`` of :func:`attention` given its ``out``, ``lse`` and ``dout``.

    ``out`` / ``lse`` may be those of a larger computation this block is part of (then the
    results are this block's contributions). ``k_total`` is the number of keys behind ``lse``
    (only used for rows with every key masked; default: this block's valid keys).
    ``bias`` is not differentiated.
    """
    B, T, N, H, K, G = _check(q, k, v)
    S = k.shape[1]
    scale = _default_scale(scale, H)
    qpos, qok = _rows(q_start, q_valid, T)
    kpos, kok = _rows(k_start, k_valid, S)
    if k_total is None:
        k_total = jnp.sum(kok.astype(_F32))
    dout5, D, lse5 = _bwd_prep(out, lse, dout, K, G)
    dq5, dk, dv = _bwd_block(
        q.reshape(B, T, K, G, H),
        k,
        v,
        _to5(bias, K, G),
        _to5(mask, K, G),
        dout5,
        D,
        lse5,
        scale,
        is_causal,
        qpos,
        qok,
        kpos,
        kok,
    )
    dv = dv + _bwd_uniform(dout5, lse5, qok, kok, k_total)
    return dq5.reshape(B, T, N, H).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
