"""A decoder-only LM in the style of Qwen3 / Llama (tunix's ``qwen3/model.py``): token embedding,
pre-norm blocks of RMSNorm -> causal self-attention with rotary position embeddings (RoPE) and
grouped-query attention (8 query heads sharing 2 key/value heads), RMSNorm -> SwiGLU MLP, residual
dropout after attention and MLP, a final RMSNorm and an untied vocabulary head.

Megatron over ``tp``: query heads, the SwiGLU gate / up projections and the head (vocab) are
column-parallel, the attention output and the down projection row-parallel, the embedding table
vocab-parallel. With fewer key/value heads than tp ranks, K and V are replicated (as Megatron
does when tp exceeds the number of query groups) and each rank repeats the heads its queries use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

import jsbp.flax as jflax

from . import ACT, part, token_stream

VOCAB, SEQ, D, HEADS, KV_HEADS, HIDDEN, LAYERS, BATCH, DROPOUT = 64, 8, 32, 8, 2, 64, 2, 16, 0.1
HEAD_DIM = D // HEADS
ROPE_THETA = 10_000

RULES = {
    "logical_axes": {
        "heads": "tp",
        "mlp": "tp",
        "vocab": "tp",
        "kv_heads": None,
        "embed": None,
        "seq": None,
    },
    "param_sbp": [],
}

normal = nnx.initializers.normal(0.02)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, name: str | None = "embed", eps: float = 1e-6, rngs: nnx.Rngs):
        self.scale = nnx.Param(part(nnx.initializers.ones_init(), name)(rngs.params(), (dim,)))
        self.eps = eps

    def __call__(self, x):
        rms = jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * (x / rms)


def apply_rope(x, positions, theta: float = ROPE_THETA):
    """Rotate the two halves of each head's features by position-dependent angles.
    ``x``: (batch, seq, heads, head_dim); ``positions``: (seq,)."""
    half = x.shape[-1] // 2
    timescale = theta ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angles = positions[:, None] / timescale[None, :]  # (seq, half)
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.q = nnx.Einsum(
            "btd,dnh->btnh",
            (D, HEADS, HEAD_DIM),
            kernel_init=part(normal, "embed", "heads", None),
            rngs=rngs,
        )
        self.k = nnx.Einsum(
            "bsd,dkh->bskh",
            (D, KV_HEADS, HEAD_DIM),
            kernel_init=part(normal, "embed", "kv_heads", None),
            rngs=rngs,
        )
        self.v = nnx.Einsum(
            "bsd,dkh->bskh",
            (D, KV_HEADS, HEAD_DIM),
            kernel_init=part(normal, "embed", "kv_heads", None),
            rngs=rngs,
        )
        self.o = nnx.Einsum(
            "btnh,nhd->btd",
            (HEADS, HEAD_DIM, D),
            kernel_init=part(normal, "heads", None, "embed"),
            rngs=rngs,
        )
        self.q_norm = RMSNorm(HEAD_DIM, name=None, rngs=rngs)  # Qwen3's per-head q / k norms
        self.k_norm = RMSNorm(HEAD_DIM, name=None, rngs=rngs)

    def __call__(self, x):
        t = x.shape[1]
        pos = jnp.arange(t, dtype=jnp.float32)
        heads = ("batch", "seq", "heads", None)
        q = apply_rope(self.q_norm(self.q(x)), pos)
        k = apply_rope(self.k_norm(self.k(x)), pos)
        v = self.v(x)
        # grouped-query attention: each key/value head serves HEADS // KV_HEADS query heads
        k = jflax.constrain(jnp.repeat(k, HEADS // KV_HEADS, axis=2), heads)
        v = jflax.constrain(jnp.repeat(v, HEADS // KV_HEADS, axis=2), heads)
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(HEAD_DIM)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), s.shape)
        causal = jflax.constrain(causal, ("batch", "heads", None, None), grad_sbp=None)
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        a = jax.nn.softmax(s, axis=-1)
        return self.o(jnp.einsum("bnts,bsnh->btnh", a, v))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, *, rngs: nnx.Rngs):
        col = dict(use_bias=False, kernel_init=part(normal, "embed", "mlp"), rngs=rngs)
        self.gate = nnx.Linear(D, HIDDEN, **col)
        self.up = nnx.Linear(D, HIDDEN, **col)
        self.down = nnx.Linear(
            HIDDEN, D, use_bias=False, kernel_init=part(normal, "mlp", "embed"), rngs=rngs
        )

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(D, rngs=rngs)
        self.attn = Attention(rngs=rngs)
        self.post_attention_norm = RMSNorm(D, rngs=rngs)
        self.mlp = MLP(rngs=rngs)
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, x):
        c = jflax.constrain
        x = x + self.dropout(c(self.attn(c(self.input_norm(x), ACT)), ACT))
        return x + self.dropout(c(self.mlp(c(self.post_attention_norm(x), ACT)), ACT))


class DecoderLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embedder = nnx.Embed(
            VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs
        )
        self.layers = nnx.List([DecoderLayer(rngs=rngs) for _ in range(LAYERS)])
        self.final_norm = RMSNorm(D, rngs=rngs)
        self.lm_head = nnx.Linear(
            D, VOCAB, use_bias=False, kernel_init=part(normal, "embed", "vocab"), rngs=rngs
        )

    def __call__(self, tokens):
        x = jflax.constrain(self.embedder(tokens), ACT)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(jflax.constrain(self.final_norm(x), ACT))


def make(rngs: nnx.Rngs) -> DecoderLM:
    with nnx.use_eager_sharding(False):
        return DecoderLM(rngs=rngs)


def batch(seed: int):
    return token_stream(seed, VOCAB, BATCH, SEQ)


def loss_fn(model: DecoderLM, batch):
    logits = model(batch[:, :-1])
    return jflax.softmax_cross_entropy(logits, batch[:, 1:], ("batch", "seq", "vocab"))
