"""The Flax docs' miniGPT (google/flax ``docs_nnx/examples/minigpt.md``), rebuilt as published:
the same layers, calls and explicit-sharding idioms — ``kernel_metadata={'out_sharding':
P(None, 'model')}`` / ``bias_metadata`` / ``scale_metadata`` on every layer,
``self.token_emb(x, out_sharding=jax.typeof(x).sharding)`` on the input batch and
``reshard(self.output_layer(x), jax.typeof(inputs).sharding)`` at the end — shrunk only in size
(the tutorial: vocab 50257, maxlen 256, embed 256, 8 heads, ff 256, 4 blocks, batch 144).

Mesh axes are the tutorial's ``('batch', 'model')``; ``loss_fn`` is the tutorial's
(``optax.softmax_cross_entropy_with_integer_labels(...).mean()``, returning ``(loss, logits)``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

VOCAB, MAXLEN, EMBED, HEADS, FF, BLOCKS, BATCH = 64, 8, 16, 4, 32, 2, 8


class TransformerBlock(nnx.Module):
    """A single Transformer block (as published)."""

    def __init__(
        self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1
    ):
        self.mha = nnx.MultiHeadAttention(
            num_heads=num_heads,
            in_features=embed_dim,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_metadata={"out_sharding": P("model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )
        self.mlp = nnx.Sequential(
            nnx.Linear(
                in_features=embed_dim,
                out_features=ff_dim,
                kernel_metadata={"out_sharding": P(None, "model")},
                bias_metadata={"out_sharding": P("model")},
                rngs=rngs,
            ),
            nnx.relu,
            nnx.Linear(
                in_features=ff_dim,
                out_features=embed_dim,
                kernel_metadata={"out_sharding": P(None, "model")},
                bias_metadata={"out_sharding": P("model")},
                rngs=rngs,
            ),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(
            epsilon=1e-6,
            num_features=embed_dim,
            scale_metadata={"out_sharding": P("model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    """Token embeddings plus positional embeddings (as published)."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x, out_sharding=jax.typeof(x).sharding)
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    """The miniGPT transformer (as published, without the text-generation helpers)."""

    def __init__(
        self,
        maxlen: int,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        feed_forward_dim: int,
        num_transformer_blocks: int,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(
            *[
                TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                for _ in range(num_transformer_blocks)
            ]
        )
        self.output_layer = nnx.Linear(
            in_features=embed_dim,
            out_features=vocab_size,
            kernel_metadata={"out_sharding": P(None, "model")},
            bias_metadata={"out_sharding": P("model")},
            rngs=rngs,
        )

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x)
        return reshard(self.output_layer(x), jax.typeof(inputs).sharding)


def create_model(rngs):
    return MiniGPT(MAXLEN, VOCAB, EMBED, HEADS, FF, num_transformer_blocks=BLOCKS, rngs=rngs)


def loss_fn(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


def batch(seed: int):
    """``(input_batch, target_batch)`` as the tutorial builds them: targets are the inputs shifted
    left by one with a 0 appended (``prep_target_batch``)."""
    rng = np.random.default_rng(seed)
    inputs = rng.integers(1, VOCAB, size=(BATCH, MAXLEN)).astype(np.int32)
    targets = np.concatenate([inputs[:, 1:], np.zeros((BATCH, 1), np.int32)], axis=1)
    return inputs, targets
