"""The pure-JAX attention kernels of ``jsbp.nn._kernels`` against ``jax.nn.dot_product_attention``:
single blocks at global offsets (combined by their ``lse``) and the ring over 4 and 8 devices
on padded, unevenly split sequences (padding filled with large garbage), forward values and
``jax.vjp`` gradients; the compiled ring talks only through collective-permutes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jsbp.nn._kernels import (
    attention,
    attention_bwd,
    ring_attention,
    ring_attention_bwd,
)

RNG = np.random.default_rng(0)
B, N, H = 2, 4, 8
TOL = 1e-5


def rand(*shape, scale=1.0):
    return (scale * RNG.normal(size=shape)).astype(np.float32)


# the kernels under jax.vjp: a custom_vjp of each forward with its backward


def _vjp_rule(fwd_fn, bwd_fn, n_static_arrays):
    """A ``custom_vjp`` returning ``out`` of ``fwd_fn(q, k, v, bias, mask, *extra)``; only
    ``q``, ``k``, ``v`` get cotangents (``bias``, ``mask`` and the ``extra`` arrays get none)."""

    @jax.custom_vjp
    def f(q, k, v, bias, mask, *extra):
        return fwd_fn(q, k, v, bias, mask, *extra)[0]

    def f_fwd(q, k, v, bias, mask, *extra):
        out, lse = fwd_fn(q, k, v, bias, mask, *extra)
        return out, (q, k, v, bias, mask, extra, out, lse)

    def f_bwd(res, dout):
        q, k, v, bias, mask, extra, out, lse = res
        dq, dk, dv = bwd_fn(q, k, v, bias, mask, out, lse, dout, *extra)
        return (dq, dk, dv, None, None) + (None,) * n_static_arrays

    f.defvjp(f_fwd, f_bwd)
    return f


def attention_vjp(
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
    """:func:`attention`'s ``out``, differentiable in ``q``, ``k``, ``v`` via
    :func:`attention_bwd` (``bias`` / ``mask`` get no gradient)."""
    T, S = q.shape[1], k.shape[1]
    extra = (
        jnp.asarray(q_start, jnp.int32),
        jnp.asarray(k_start, jnp.int32),
        jnp.asarray(T if q_valid is None else q_valid, jnp.int32),
        jnp.asarray(S if k_valid is None else k_valid, jnp.int32),
    )

    def kw(qs, ks, qv, kv):
        return dict(
            scale=scale, is_causal=is_causal, q_start=qs, k_start=ks, q_valid=qv, k_valid=kv
        )

    def fwd(q, k, v, bias, mask, *e):
        return attention(q, k, v, bias, mask, **kw(*e))

    def bwd(q, k, v, bias, mask, out, lse, dout, *e):
        return attention_bwd(q, k, v, bias, mask, out, lse, dout, **kw(*e))

    return _vjp_rule(fwd, bwd, len(extra))(q, k, v, bias, mask, *extra)


def ring_attention_vjp(q, k, v, bias=None, mask=None, **kw):
    """:func:`ring_attention`'s ``out``, differentiable in ``q``, ``k``, ``v`` via
    :func:`ring_attention_bwd`."""

    def fwd(q, k, v, bias, mask):
        return ring_attention(q, k, v, bias, mask, **kw)

    def bwd(q, k, v, bias, mask, out, lse, dout):
        return ring_attention_bwd(q, k, v, bias, mask, out, lse, dout, **kw)

    return _vjp_rule(fwd, bwd, 0)(q, k, v, bias, mask)


def balanced(T, n):
    sizes = tuple(T // n + (1 if i < T % n else 0) for i in range(n))
    starts = tuple(sum(sizes[:i]) for i in range(n))
    return starts, sizes


def to_phys(x, axis, starts, sizes, L):
    """Each device's balanced block padded to ``L`` with garbage, concatenated."""
    parts = []
    for s, z in zip(starts, sizes):
        blk = np.take(x, np.arange(s, s + z), axis=axis)
        pad = list(x.shape)
        pad[axis] = L - z
        garbage = rand(*pad, scale=1e3)
        parts.append(
            np.concatenate([blk, garbage.astype(x.dtype) if x.dtype != bool else garbage > 0], axis)
        )
    return np.concatenate(parts, axis)


def from_phys(x, axis, sizes, L):
    x = np.asarray(x)
    return np.concatenate(
        [np.take(x, np.arange(d * L, d * L + z), axis=axis) for d, z in enumerate(sizes)], axis
    )


# backend optimisation off: these small programs compile about twice as fast, same numerics
FAST = {"xla_backend_optimization_level": 0}


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile(compiler_options=FAST)


def reference(q, k, v, bias, mask, causal, dout):
    """``jax.nn.dot_product_attention`` on one device and its ``jax.vjp`` of ``dout``."""

    def f(q, k, v, bias, mask, dout):
        g = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, bias=bias, mask=mask, is_causal=causal
        )  # noqa: E731
        out, vjp = jax.vjp(g, q, k, v)
        return out, vjp(dout)

    out, grads = compiled(f, q, k, v, bias, mask, dout)(q, k, v, bias, mask, dout)
    return np.asarray(out), [np.asarray(g) for g in grads]


def key_padding_mask(T):
    """``[B, 1, 1, T]``: random keys dropped, key 0 always dropped, batch 0 fully masked (every
    row falls back to the uniform average, as in JAX)."""
    m = RNG.random((B, 1, 1, T)) > 0.3
    m[:, :, :, 0] = False
    m[0] = False
    m[1, :, :, -1] = True
    return m


def close(a, b, what):
    err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert err < TOL, f"{what}: max abs error {err}"


# ------------------------------------------------------------------------------------------
# single block
# ------------------------------------------------------------------------------------------


def combine(parts):
    """Merge ``[(out, lse), ...]`` of key blocks by their lse (normalised weights)."""
    lses = jnp.stack([lse for _, lse in parts])  # [b, B, N, T]
    m = jnp.max(lses, axis=0)
    w = jnp.exp(lses - m)
    tot = jnp.sum(w, axis=0)
    out = sum(jnp.transpose(wi / tot, (0, 2, 1))[..., None] * o for (o, _), wi in zip(parts, w))
    return out, m + jnp.log(tot)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("extra", ["bias", "mask"])
def test_blocks_at_offsets_combine_to_reference(causal, extra):
    """A padded query block (rows 5..11 of 16) against two padded key blocks (0..7, 8..15) with
    their global starts: outputs merged by lse, and dq / dk / dv from ``attention_bwd`` with the
    merged out / lse, equal the reference restricted to those query rows."""
    T, K, (qs, qe), Lq, Lk = 16, 2, (5, 12), 9, 10
    q, k, v = rand(B, T, N, H), rand(B, T, K, H), rand(B, T, K, H)
    bias = rand(B, N, T, T) if extra == "bias" else None
    mask = None
    if extra == "mask":
        mask = np.broadcast_to(key_padding_mask(T), (B, 1, T, T)).copy()
        mask[1, :, 7, :] = False  # a fully masked row in the other batch too
    dout = np.zeros((B, T, N, H), np.float32)
    dout[:, qs:qe] = rand(B, qe - qs, N, H)
    ref, (dq_ref, dk_ref, dv_ref) = reference(q, k, v, bias, mask, causal, dout)

    def padq(x):  # query rows qs..qe padded to Lq with garbage
        return np.concatenate([x[:, qs:qe], rand(B, Lq - (qe - qs), *x.shape[2:], scale=1e3)], 1)

    def sub(x, rows, cols, Lc):  # bias/mask block, query rows padded like q, key cols padded
        if x is None:
            return None
        blk = x[:, :, rows][..., cols]
        blk = np.concatenate(
            [
                blk,
                np.broadcast_to(blk[:, :, :1], (*blk.shape[:2], Lq - blk.shape[2], blk.shape[3])),
            ],
            2,
        )
        return np.concatenate(
            [blk, np.broadcast_to(blk[..., :1], (*blk.shape[:3], Lc - blk.shape[3]))], 3
        )

    qb, doutb = padq(q), padq(dout)
    blocks = [(0, 8), (8, 16)]
    kbs = [
        tuple(
            np.concatenate([x[:, a:b], rand(B, Lk - (b - a), K, H, scale=1e3)], 1) for x in (k, v)
        )
        for a, b in blocks
    ]
    kw = [
        dict(
            scale=None,
            is_causal=causal,
            q_start=jnp.int32(qs),
            k_start=jnp.int32(a),
            q_valid=qe - qs,
            k_valid=b - a,
        )
        for a, b in blocks
    ]
    subs = [
        (sub(bias, slice(qs, qe), slice(a, b), Lk), sub(mask, slice(qs, qe), slice(a, b), Lk))
        for a, b in blocks
    ]

    def run(qb, doutb, kbs, subs):
        parts = [attention(qb, kb, vb, bb, mb, **w) for (kb, vb), (bb, mb), w in zip(kbs, subs, kw)]
        out, lse = combine(parts)
        grads = [
            attention_bwd(qb, kb, vb, bb, mb, out, lse, doutb, k_total=T, **w)
            for (kb, vb), (bb, mb), w in zip(kbs, subs, kw)
        ]
        return out, grads

    out, grads = compiled(run, qb, doutb, kbs, subs)(qb, doutb, kbs, subs)
    close(out[:, : qe - qs], ref[:, qs:qe], "out")
    assert np.all(np.isfinite(np.asarray(out)))
    dq = 0.0
    for g, (a, b) in zip(grads, blocks):
        assert all(np.all(np.isfinite(np.asarray(x))) for x in g)
        dq = dq + g[0]
        close(g[1][:, : b - a], dk_ref[:, a:b], "dk")
        close(g[2][:, : b - a], dv_ref[:, a:b], "dv")
        close(g[1][:, b - a :], 0.0, "dk at padded keys")
        close(g[2][:, b - a :], 0.0, "dv at padded keys")
    close(dq[:, : qe - qs], dq_ref[:, qs:qe], "dq")


def test_attention_vjp_whole_sequence_gqa_causal_bias():
    """``attention_vjp`` (custom_vjp over attention / attention_bwd) under ``jax.vjp``."""
    T, K = 12, 2
    q, k, v, bias, dout = (
        rand(B, T, N, H),
        rand(B, T, K, H),
        rand(B, T, K, H),
        rand(B, 1, T, T),
        rand(B, T, N, H),
    )
    ref, gref = reference(q, k, v, bias, None, True, dout)

    def run(q, k, v, dout):
        out, vjp = jax.vjp(
            lambda q, k, v: attention_vjp(q, k, v, bias, None, is_causal=True), q, k, v
        )
        return out, vjp(dout)

    out, grads = compiled(run, q, k, v, dout)(q, k, v, dout)
    close(out, ref, "out")
    for g, r, name in zip(grads, gref, ("dq", "dk", "dv")):
        close(g, r, name)


# ------------------------------------------------------------------------------------------
# ring
# ------------------------------------------------------------------------------------------


def ring_program(n, T, causal, balance, bias_kind, mask_kind, args, use_vjp=False):
    """The compiled shard_map running forward and backward ring on padded physical arrays;
    asserts that it moves data only by collective-permute."""
    starts, sizes = balanced(T, n)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    kw = dict(
        axis_name="x", axis_size=n, starts=starts, sizes=sizes, is_causal=causal, balance=balance
    )

    def local(q, k, v, bias, mask, dout):
        if use_vjp:
            out, vjp = jax.vjp(
                lambda q, k, v: ring_attention_vjp(q, k, v, bias, mask, **kw), q, k, v
            )
            return out, vjp(dout)
        out, lse = ring_attention(q, k, v, bias, mask, **kw)
        return out, ring_attention_bwd(q, k, v, bias, mask, out, lse, dout, **kw)

    seq = P(None, "x")
    spec = {"none": None, "rows": P(None, None, "x", None), "bcast": P()}
    in_specs = (seq, seq, seq, spec[bias_kind], spec[mask_kind], seq)
    f = compiled(
        jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(seq, (seq, seq, seq))), *args
    )
    lines = f.as_text().splitlines()
    permutes = [
        ln for ln in lines if " collective-permute(" in ln or "collective-permute-start(" in ln
    ]
    assert permutes, "no collective-permute in the compiled ring"
    for bad in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
        assert not [ln for ln in lines if bad in ln], f"{bad} in the compiled ring"
    return f


RING_CASES = [
    # n, T, K, causal, balance, bias, mask
    (4, 32, 2, False, False, "none", "none"),
    (4, 29, 4, False, False, "rows", "none"),
    (8, 13, 2, False, False, "none", "bcast"),
    (4, 29, 2, True, False, "none", "rows"),
    (8, 32, 2, True, False, "rows", "none"),
    (4, 32, 2, True, True, "none", "none"),
    (4, 13, 2, True, True, "rows", "rows"),
    (8, 29, 2, True, True, "none", "bcast"),
]


@pytest.mark.parametrize("n,T,K,causal,balance,bias_kind,mask_kind", RING_CASES)
def test_ring_matches_reference(n, T, K, causal, balance, bias_kind, mask_kind):
    """Ring forward and ring backward on padded, garbage-filled local blocks equal the
    one-device reference (values and dq / dk / dv of a random cotangent); padded rows are
    finite; the compiled program's only collectives are collective-permutes. bias/mask ``rows``: split along queries with the full key dim; ``bcast``: a
    ``[B, 1, 1, S]`` key-padding mask replicated."""
    starts, sizes = balanced(T, n)
    L = max(sizes)
    q, k, v, dout = rand(B, T, N, H), rand(B, T, K, H), rand(B, T, K, H), rand(B, T, N, H)
    bias = rand(B, N, T, T) if bias_kind == "rows" else None
    mask = key_padding_mask(T) if mask_kind != "none" else None
    ref, gref = reference(q, k, v, bias, mask, causal, dout)
    if mask_kind == "rows":
        mask = np.broadcast_to(mask, (B, 1, T, T)).copy()
        mask[1, :, 3, :] = False  # one more fully masked row
        ref, gref = reference(q, k, v, bias, mask, causal, dout)
    phys = lambda x: to_phys(x, 1, starts, sizes, L)  # noqa: E731
    bp = None if bias is None else to_phys(bias, 2, starts, sizes, L)
    mp = mask if mask_kind != "rows" else to_phys(mask, 2, starts, sizes, L)
    args = (phys(q), phys(k), phys(v), bp, mp, phys(dout))
    out, grads = ring_program(n, T, causal, balance, bias_kind, mask_kind, args)(*args)
    assert np.all(np.isfinite(np.asarray(out))) and all(
        np.all(np.isfinite(np.asarray(g))) for g in grads
    )
    close(from_phys(out, 1, sizes, L), ref, "out")
    for g, r, name in zip(grads, gref, ("dq", "dk", "dv")):
        close(from_phys(g, 1, sizes, L), r, name)


def test_ring_vjp_wrapper():
    """``ring_attention_vjp`` under ``jax.vjp`` inside the shard_map gives the same gradients."""
    n, T, K = 4, 29, 2
    starts, sizes = balanced(T, n)
    L = max(sizes)
    q, k, v, dout = rand(B, T, N, H), rand(B, T, K, H), rand(B, T, K, H), rand(B, T, N, H)
    ref, gref = reference(q, k, v, None, None, True, dout)
    phys = lambda x: to_phys(x, 1, starts, sizes, L)  # noqa: E731
    args = (phys(q), phys(k), phys(v), None, None, phys(dout))
    out, grads = ring_program(n, T, True, True, "none", "none", args, use_vjp=True)(*args)
    close(from_phys(out, 1, sizes, L), ref, "out")
    for g, r, name in zip(grads, gref, ("dq", "dk", "dv")):
        close(from_phys(g, 1, sizes, L), r, name)
