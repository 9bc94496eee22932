"""A top-k mixture-of-experts layer (Qwen3-MoE / Switch style, as in tunix's ``MoELayer`` dense
fallback) inside a small token model: embedding -> RMSNorm -> MoE (a linear router, softmax,
``jax.lax.top_k`` with k=2 of 8 experts, renormalised routing weights, SwiGLU experts stored as
stacked ``(experts, ...)`` ``nnx.Param`` s, expert-output dropout) + residual -> head. The loss
adds Switch's load-balancing auxiliary loss.

Every expert runs on every token and the outputs are combined with the (mostly zero) routing
weights — the dense dispatch tunix falls back to on CPU. Megatron over ``tp``: each expert's gate
/ up projections are column-parallel and its down projection row-parallel (expert tensor
parallelism: the expert hidden dim is split), the head is vocab-parallel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import jsbp.flax as jflax

from . import ACT, part, token_stream
from .decoder_lm import RMSNorm

VOCAB, SEQ, D, HIDDEN, EXPERTS, TOP_K, BATCH, DROPOUT = 64, 8, 32, 32, 8, 2, 16, 0.1
AUX_WEIGHT = 0.01

RULES = {
    "logical_axes": {"mlp": "tp", "vocab": "tp", "experts": None, "embed": None, "seq": None},
    "param_sbp": [],
}

normal = nnx.initializers.normal(0.02)


class MoELayer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.router = nnx.Linear(D, EXPERTS, use_bias=False, kernel_init=normal, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        key = rngs.params
        self.gate_proj = nnx.Param(
            part(init, "experts", "embed", "mlp")(key(), (EXPERTS, D, HIDDEN))
        )
        self.up_proj = nnx.Param(part(init, "experts", "embed", "mlp")(key(), (EXPERTS, D, HIDDEN)))
        self.down_proj = nnx.Param(
            part(init, "experts", "mlp", "embed")(key(), (EXPERTS, HIDDEN, D))
        )
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)

    def __call__(self, x):
        probs = jax.nn.softmax(self.router(x), axis=-1)  # (b, t, e)
        weights, idx = jax.lax.top_k(probs, TOP_K)  # (b, t, k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        dispatch = jax.nn.one_hot(idx, EXPERTS, dtype=x.dtype)  # (b, t, k, e)
        combine = jnp.einsum("btke,btk->bte", dispatch, weights)
        h = nnx.silu(jnp.einsum("btd,edf->btef", x, self.gate_proj[...]))
        h = h * jnp.einsum("btd,edf->btef", x, self.up_proj[...])
        out = jnp.einsum("btef,efd->bted", h, self.down_proj[...])  # row-parallel: P over tp
        y = jflax.constrain(jnp.einsum("bted,bte->btd", out, combine), ACT)
        # Switch load balancing: EXPERTS * sum_e (fraction of routed slots to e) * (mean prob of e)
        frac = jnp.mean(jnp.sum(dispatch, axis=2), axis=(0, 1)) / TOP_K
        aux = EXPERTS * jnp.sum(frac * jnp.mean(probs, axis=(0, 1)))
        return self.dropout(y), aux


class MoEModel(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embedder = nnx.Embed(
            VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs
        )
        self.norm = RMSNorm(D, rngs=rngs)
        self.moe = MoELayer(rngs=rngs)
        self.final_norm = RMSNorm(D, rngs=rngs)
        self.head = nnx.Linear(
            D, VOCAB, use_bias=False, kernel_init=part(normal, "embed", "vocab"), rngs=rngs
        )

    def __call__(self, tokens):
        x = jflax.constrain(self.embedder(tokens), ACT)
        y, aux = self.moe(jflax.constrain(self.norm(x), ACT))
        x = x + y
        return self.head(jflax.constrain(self.final_norm(x), ACT)), aux


def make(rngs: nnx.Rngs) -> MoEModel:
    with nnx.use_eager_sharding(False):
        return MoEModel(rngs=rngs)


def batch(seed: int):
    return token_stream(seed, VOCAB, BATCH, SEQ)


def loss_fn(model: MoEModel, batch):
    logits, aux = model(batch[:, :-1])
    ce = jflax.softmax_cross_entropy(logits, batch[:, 1:], ("batch", "seq", "vocab"))
    return ce + AUX_WEIGHT * aux
