"""A small Vision Transformer in the style of the jax-ai-stack ViT tutorial: a strided ``nnx.Conv``
patch embedding, a learned CLS token and position embeddings (``nnx.Param``), embedding dropout,
pre-norm encoder blocks (``nnx.MultiHeadAttention`` with attention dropout, an MLP with dropout),
a final LayerNorm and a classifier on the CLS token. 8x8x3 images in 2x2 patches, 10 classes.

Megatron over ``tp``: Q/K/V split by heads (column-parallel), the attention output and the MLP's
second linear row-parallel, the MLP's first linear column-parallel; the residual stream is pinned
whole with ``constrain`` (Megatron's f/g pair).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jsbp.flax as jflax

from . import ACT, part

IMG, PATCH, CHANNELS, CLASSES, BATCH = 8, 2, 3, 10, 16
D, HEADS, MLP_DIM, LAYERS, DROPOUT = 32, 8, 64, 2, 0.1

RULES = {
    "logical_axes": {"heads": "tp", "mlp": "tp", "embed": None, "seq": None},
    "param_sbp": [],
}

init = nnx.initializers.xavier_uniform()
zeros = nnx.initializers.zeros_init()


class EncoderBlock(nnx.Module):
    def __init__(self, d: int, mlp_dim: int, heads: int, rate: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=heads,
            in_features=d,
            dropout_rate=rate,
            broadcast_dropout=False,
            decode=False,
            kernel_init=part(init, "embed", "heads", None),  # Q, K, V: (d, heads, head_dim)
            bias_init=part(zeros, "heads", None),
            out_kernel_init=part(init, "heads", None, "embed"),  # out: (heads, head_dim, d)
            out_bias_init=part(zeros, "embed"),
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(
                d,
                mlp_dim,
                kernel_init=part(init, "embed", "mlp"),
                bias_init=part(zeros, "mlp"),
                rngs=rngs,
            ),
            nnx.gelu,
            nnx.Dropout(rate, rngs=rngs),
            nnx.Linear(
                mlp_dim,
                d,
                kernel_init=part(init, "mlp", "embed"),
                bias_init=part(zeros, "embed"),
                rngs=rngs,
            ),
            nnx.Dropout(rate, rngs=rngs),
        )

    def __call__(self, x):
        c = jflax.constrain
        x = x + c(self.attn(c(self.norm1(x), ACT)), ACT)
        return x + c(self.mlp(c(self.norm2(x), ACT)), ACT)


class VisionTransformer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        n_patches = (IMG // PATCH) ** 2
        self.patch_embeddings = nnx.Conv(
            CHANNELS,
            D,
            kernel_size=(PATCH, PATCH),
            strides=(PATCH, PATCH),
            padding="VALID",
            rngs=rngs,
        )
        trunc = jax.nn.initializers.truncated_normal(stddev=0.02)
        self.position_embeddings = nnx.Param(trunc(rngs.params(), (1, n_patches + 1, D)))
        self.cls_token = nnx.Param(trunc(rngs.params(), (1, 1, D)))
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)
        self.encoder = nnx.Sequential(
            *[EncoderBlock(D, MLP_DIM, HEADS, DROPOUT, rngs=rngs) for _ in range(LAYERS)]
        )
        self.final_norm = nnx.LayerNorm(D, rngs=rngs)
        self.classifier = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, x):
        patches = self.patch_embeddings(x)
        b = patches.shape[0]
        patches = patches.reshape(b, -1, patches.shape[-1])
        cls_token = jnp.tile(self.cls_token[...], [b, 1, 1])
        x = jnp.concatenate([cls_token, patches], axis=1)
        x = self.dropout(x + self.position_embeddings[...])
        x = self.encoder(jflax.constrain(x, ACT))
        x = self.final_norm(x)
        return self.classifier(x[:, 0])  # the CLS token's representation


def make(rngs: nnx.Rngs) -> VisionTransformer:
    with nnx.use_eager_sharding(False):
        model = VisionTransformer(rngs=rngs)
    model.train()  # attention dropout on (nnx.MultiHeadAttention defaults to deterministic=None)
    return model


def batch(seed: int):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(BATCH, IMG, IMG, CHANNELS)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
    return {"image": images, "label": labels}


def loss_fn(model: VisionTransformer, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
