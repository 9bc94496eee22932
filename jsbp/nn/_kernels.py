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
  (``lax.cond``); ``balance=True`` (used for causal attention when ``L`` is even, otherwise
  ignored) first rearranges the blocks into the zig-zag order -- device ``i`` holds half-chunks
  ``i`` and ``2n-1-i``, two collective-permutes of half-blocks -- so that every device does one
  diagonal block and ``n-1`` half blocks, and sends the results back the same way. Only K/V
  (and dk/dv) move: each device derives the source block's positions and validity from its
  ``lax.axis_index`` and the step number (static tables built from ``starts`` / ``sizes``).
  ``bias`` / ``mask`` come split along the query dim (dim 2, local length ``L``, or size 1) with
  the key dim (dim 3) either the full logical length ``S = sum(sizes)``, the padded length
  ``n * L``, or 1.

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
  Merge blocks by ``lse`` with normalised weights ``w_b = exp(lse_b - max lse) / sum(...)``;
  a row fully masked in every block then comes out exact when the blocks hold equally many
  valid keys (otherwise it is the mean of the blocks' means).
* A valid query row with no valid key at all (only possible in :func:`attention` with
  ``k_valid == 0``) gets ``out = 0`` and ``lse = -inf``. Padded query rows get ``out = 0`` and
  ``lse = 0``; they contribute nothing to ``dk`` / ``dv`` and get ``dq = 0``. Padded key rows
  never contribute and get ``dk = dv = 0``.
* The backwards give the cotangents of ``q``, ``k`` and ``v`` only; ``jsbp.nn`` differentiates a
  learned bias through the plain computation.
* Causal means key position <= query position in global positions (``T == S``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "attention",
    "attention_bwd",
    "ring_attention",
    "ring_attention_bwd",
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


# --------------------------------------------------------------------------------------------
# ring over one mesh axis
# --------------------------------------------------------------------------------------------


def _send(xs, axis_name, perm):
    """``lax.ppermute`` of a list of arrays, packed so that each dtype makes one
    collective-permute."""
    xs = list(xs)
    out = [None] * len(xs)
    groups = {}
    for idx, x in enumerate(xs):
        groups.setdefault(jnp.dtype(x.dtype), []).append(idx)
    for idxs in groups.values():
        flat = jnp.concatenate([xs[i].reshape(-1) for i in idxs])
        flat = lax.ppermute(flat, axis_name, perm)
        off = 0
        for i in idxs:
            size = xs[i].size
            out[i] = flat[off : off + size].reshape(xs[i].shape)
            off += size
    return out


def _layout(n, L, starts, sizes, zig):
    """Static ``[n, L]`` tables of the block each device holds: logical position of each row,
    whether it is valid, and its index in the padded physical sequence (device-major,
    ``d * L + row``)."""
    pos = np.zeros((n, L), np.int32)
    ok = np.zeros((n, L), bool)
    src = np.zeros((n, L), np.int32)
    if not zig:
        for j in range(n):
            pos[j] = starts[j] + np.arange(L)
            ok[j] = np.arange(L) < sizes[j]
            src[j] = j * L + np.arange(L)
    else:
        h = L // 2
        for j in range(n):
            for slot, c in enumerate((j, 2 * n - 1 - j)):
                d, half = divmod(c, 2)
                rows = slice(slot * h, (slot + 1) * h)
                pos[j, rows] = starts[d] + half * h + np.arange(h)
                ok[j, rows] = np.arange(h) < sizes[d] - half * h
                src[j, rows] = d * L + half * h + np.arange(h)
    return pos, ok, src


def _zig_perms(n):
    """Pairs for the two half-block exchanges into the zig-zag order: half 0 (chunk ``2d``) and
    half 1 (chunk ``2d+1``) of device ``d`` go to the device that holds that chunk."""

    def home(c):
        return c if c < n else 2 * n - 1 - c

    return [(d, home(2 * d)) for d in range(n)], [(d, home(2 * d + 1)) for d in range(n)]


def _to_zig(xs_axes, axis_name, n):
    """Rearrange ``[(array, seq_axis), ...]`` from contiguous blocks to zig-zag blocks."""
    if not xs_axes:
        return []
    p0, p1 = _zig_perms(n)
    halves = [jnp.split(x, 2, axis=a) for x, a in xs_axes]
    r0 = _send([h[0] for h in halves], axis_name, p0)  # chunks with even index
    r1 = _send([h[1] for h in halves], axis_name, p1)  # chunks with odd index
    even = lax.axis_index(axis_name) % 2 == 0
    res = []
    for (_, a), e, o in zip(xs_axes, r0, r1):
        # slot A holds chunk i: the even-index chunk when i is even
        res.append(jnp.where(even, jnp.concatenate([e, o], a), jnp.concatenate([o, e], a)))
    return res


def _from_zig(xs_axes, axis_name, n):
    """Inverse of :func:`_to_zig`."""
    if not xs_axes:
        return []
    p0, p1 = _zig_perms(n)
    inv0, inv1 = [(b, a) for a, b in p0], [(b, a) for a, b in p1]
    even = lax.axis_index(axis_name) % 2 == 0
    ev, od = [], []
    for x, a in xs_axes:
        sa, sb = jnp.split(x, 2, axis=a)
        ev.append(jnp.where(even, sa, sb))
        od.append(jnp.where(even, sb, sa))
    r0 = _send(ev, axis_name, inv0)
    r1 = _send(od, axis_name, inv1)
    return [jnp.concatenate([e, o], a) for (_, a), e, o in zip(xs_axes, r0, r1)]


def _key_phys(x, S, n, L, src, pos):
    """Bias/mask key columns (dim 3) re-indexed into the layout's slot order (``n * L``)."""
    if x is None or x.shape[3] == 1:
        return x
    if x.shape[3] == n * L:
        idx = src.reshape(-1)
    elif x.shape[3] == S:
        idx = np.clip(pos, 0, max(S - 1, 0)).reshape(-1)
    else:
        raise ValueError(f"bias/mask key dim {x.shape[3]} is neither 1, S={S} nor n*L={n * L}")
    return jnp.take(x, jnp.asarray(idx, jnp.int32), axis=3)


def _cols(x5, j, L):
    """Key columns of source block ``j`` (or ``x5`` itself if its key dim broadcasts)."""
    if x5 is None or x5.shape[-1] == 1:
        return x5
    return lax.dynamic_slice_in_dim(x5, j * L, L, axis=4)


def _sub(x5, rows=None, keys=None):
    """Slice a ``[b, K|1, G|1, t, s]`` bias/mask by query rows and key columns (broadcast dims
    stay)."""
    if x5 is None:
        return None
    if rows is not None and x5.shape[3] > 1:
        x5 = x5[:, :, :, rows]
    if keys is not None and x5.shape[4] > 1:
        x5 = x5[..., keys]
    return x5


class _Ring:
    """Static set-up shared by the ring forward and backward."""

    def __init__(
        self, q, k, v, bias, mask, axis_name, axis_size, starts, sizes, is_causal, balance
    ):
        B, L, N, H, K, G = _check(q, k, v)
        n = int(axis_size)
        starts, sizes = tuple(int(s) for s in starts), tuple(int(s) for s in sizes)
        if len(starts) != n or len(sizes) != n:
            raise ValueError(f"starts/sizes must have {n} entries, got {starts} / {sizes}")
        if L < max(sizes) or k.shape[1] != L:
            raise ValueError(f"local blocks of length {L} / {k.shape[1]} for sizes {sizes}")
        self.B, self.L, self.N, self.H, self.K, self.G, self.n = B, L, N, H, K, G, n
        self.S = sum(sizes)
        self.axis_name = axis_name
        self.causal = bool(is_causal)
        self.zig = bool(balance) and self.causal and L % 2 == 0 and n > 1
        pos, ok, src = _layout(n, L, starts, sizes, self.zig)
        self.pos_t, self.ok_t = jnp.asarray(pos), jnp.asarray(ok)
        self.i = lax.axis_index(axis_name)
        self.bias = _key_phys(bias, self.S, n, L, src, pos)
        self.mask = _key_phys(mask, self.S, n, L, src, pos)
        self.next = [(d, (d + 1) % n) for d in range(n)]

    def rows(self, j):
        return self.pos_t[j], self.ok_t[j]


def _ring_inputs(r, arrays):
    """The arrays of ``[(array or None, seq_axis), ...]``, moved to the zig-zag order when the
    ring runs balanced (bias/mask rows only when not broadcast)."""
    res = [x for x, _ in arrays]
    if not r.zig:
        return res
    sel = [idx for idx, (x, a) in enumerate(arrays) if x is not None and x.shape[a] == r.L]
    moved = _to_zig([arrays[idx] for idx in sel], r.axis_name, r.n)
    for idx, y in zip(sel, moved):
        res[idx] = y
    return res


def ring_attention(
    q,
    k,
    v,
    bias=None,
    mask=None,
    *,
    axis_name,
    axis_size,
    starts,
    sizes,
    scale=None,
    is_causal=False,
    balance=False,
):
    """Ring attention on local sequence blocks inside a manual ``shard_map``: ``(out, lse)``.

    ``out`` ``[B, L, N, H]`` and ``lse`` ``[B, N, L]`` (float32) are this device's block of the
    full attention, in the same contiguous padded layout as ``q`` (padded rows: ``out = 0``,
    ``lse = 0``). ``balance`` selects the zig-zag schedule for causal attention when ``L`` is
    even (ignored otherwise).
    """
    r = _Ring(q, k, v, bias, mask, axis_name, axis_size, starts, sizes, is_causal, balance)
    B, L, K, G, H, n, i = r.B, r.L, r.K, r.G, r.H, r.n, r.i
    scale = _default_scale(scale, H)
    q, k, v, bias, mask = _ring_inputs(r, [(q, 1), (k, 1), (v, 1), (r.bias, 2), (r.mask, 2)])
    q5 = q.reshape(B, L, K, G, H)
    bias5, mask5 = _to5(bias, K, G), _to5(mask, K, G)
    qpos, qok = r.rows(i)
    h = L // 2

    def full(state, k, v, j, rows=None, keys=None):
        kpos, kok = r.rows(j)
        b5, m5 = _cols(bias5, j, L), _cols(mask5, j, L)
        if rows is None and keys is None:
            return _fwd_update(state, q5, k, v, b5, m5, scale, r.causal, qpos, qok, kpos, kok)
        rs = rows if rows is not None else slice(None)
        ks = keys if keys is not None else slice(None)
        m, l, acc, vsum, cnt = state
        sub = (m[..., rs], l[..., rs], acc[:, rs], vsum, cnt)
        sub = _fwd_update(
            sub,
            q5[:, rs],
            k[:, ks],
            v[:, ks],
            _sub(b5, rs, ks),
            _sub(m5, rs, ks),
            scale,
            r.causal,
            qpos[rs],
            qok[rs],
            kpos[ks],
            kok[ks],
        )
        sm, sl, sacc, vsum, cnt = sub
        # the key columns not visited (ks) are masked for every row: only the fallback sees them
        if keys is not None:
            rest = slice(keys.stop, None)
            vs, c = _vsum(v[:, rest], kok[rest])
            vsum, cnt = vsum + vs, cnt + c
        m, l, acc = m.at[..., rs].set(sm), l.at[..., rs].set(sl), acc.at[:, rs].set(sacc)
        return m, l, acc, vsum, cnt

    def step(state, k, v, j):
        if not r.causal:
            return full(state, k, v, j)
        if r.zig:
            # j < i: the source's second chunk is in every local row's future;
            # j > i: the local first chunk precedes both source chunks.
            return lax.cond(
                j < i,
                lambda s: full(s, k, v, j, keys=slice(0, h)),
                lambda s: full(s, k, v, j, rows=slice(h, L)),
                state,
            )
        return lax.cond(
            j < i, lambda s: full(s, k, v, j), lambda s: _fwd_skip(s, v, r.ok_t[j]), state
        )

    state = full(_fwd_state(B, L, K, G, H), k, v, i)

    def body(t, carry):
        state, k, v = carry
        k, v = _send([k, v], axis_name, r.next)
        j = (i - t) % n
        return step(state, k, v, j), k, v

    if n > 1:
        state, _, _ = lax.fori_loop(1, n, body, (state, k, v))
    out, lse = _fwd_finish(state, qok, q.dtype)
    if r.zig:
        out, lse = _from_zig([(out, 1), (lse, 2)], axis_name, n)
    return out, lse


def ring_attention_bwd(
    q,
    k,
    v,
    bias,
    mask,
    out,
    lse,
    dout,
    *,
    axis_name,
    axis_size,
    starts,
    sizes,
    scale=None,
    is_causal=False,
    balance=False,
):
    """Gradients ``(dq, dk, dv)`` of :func:`ring_attention` (local blocks, same layout).

    K/V travel round the ring together with their dk/dv accumulators (one collective-permute
    per step per dtype); after the last step one more hop brings each accumulator home.
    ``bias`` is not differentiated.
    """
    r = _Ring(q, k, v, bias, mask, axis_name, axis_size, starts, sizes, is_causal, balance)
    B, L, N, K, G, H, n, i = r.B, r.L, r.N, r.K, r.G, r.H, r.n, r.i
    scale = _default_scale(scale, H)
    q, k, v, bias, mask, out, lse, dout = _ring_inputs(
        r,
        [(q, 1), (k, 1), (v, 1), (r.bias, 2), (r.mask, 2), (out, 1), (lse, 2), (dout, 1)],
    )
    q5 = q.reshape(B, L, K, G, H)
    bias5, mask5 = _to5(bias, K, G), _to5(mask, K, G)
    dout5, D, lse5 = _bwd_prep(out, lse, dout, K, G)
    qpos, qok = r.rows(i)
    h = L // 2
    # zeros_like keeps the inputs' varying-over-axis type (cond branches must agree)
    zq = jnp.zeros_like(q5, dtype=_F32)
    zk = jnp.zeros_like(k, dtype=_F32)

    def contrib(k, v, j, rows=None, keys=None):
        """This device's ``(dq5, dk, dv)`` contributions for source block ``j`` (f32)."""
        kpos, kok = r.rows(j)
        b5, m5 = _cols(bias5, j, L), _cols(mask5, j, L)
        rs = rows if rows is not None else slice(None)
        ks = keys if keys is not None else slice(None)
        dq, dk, dv = _bwd_block(
            q5[:, rs],
            k[:, ks],
            v[:, ks],
            _sub(b5, rs, ks),
            _sub(m5, rs, ks),
            dout5[:, rs],
            D[..., rs],
            lse5[..., rs],
            scale,
            r.causal,
            qpos[rs],
            qok[rs],
            kpos[ks],
            kok[ks],
        )
        if rows is not None:
            dq = zq.at[:, rs].set(dq)
        if keys is not None:
            dk, dv = zk.at[:, ks].set(dk), zk.at[:, ks].set(dv)
        return dq, dk, dv + _bwd_uniform(dout5, lse5, qok, kok, r.S)

    def skip(v, j):
        return zq, zk, _bwd_uniform(dout5, lse5, qok, r.ok_t[j], r.S)

    def step(k, v, j):
        if not r.causal:
            return contrib(k, v, j)
        if r.zig:
            return lax.cond(
                j < i,
                lambda: contrib(k, v, j, keys=slice(0, h)),
                lambda: contrib(k, v, j, rows=slice(h, L)),
            )
        return lax.cond(j < i, lambda: contrib(k, v, j), lambda: skip(v, j))

    dq, dk, dv = contrib(k, v, i)

    def body(t, carry):
        dq, k, v, dk, dv = carry
        k, v, dk, dv = _send([k, v, dk, dv], axis_name, r.next)
        a, b, c = step(k, v, (i - t) % n)
        return dq + a, k, v, dk + b, dv + c

    if n > 1:
        dq, _, _, dk, dv = lax.fori_loop(1, n, body, (dq, k, v, dk, dv))
        dk, dv = _send([dk, dv], axis_name, r.next)
    dq = dq.reshape(B, L, N, H)
    if r.zig:
        dq, dk, dv = _from_zig([(dq, 1), (dk, 1), (dv, 1)], axis_name, n)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
