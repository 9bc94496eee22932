"""Flax's Gemma example (google/flax ``examples/gemma``: ``transformer_cfg.py``, ``layers.py``,
``modules.py``, ``transformer.py``, ``positional_embeddings.py``, ``sow_lib.py`` and the loss of
``train.py``), rebuilt with its sharded variant as published — ``ShardingConfig.fsdp_tp_sharding``
on mesh axes ``('fsdp', 'tensor')`` as ``train.py`` builds it, ``kernel_metadata={'out_sharding':
...}`` on every weight, ``out_sharding=`` on every ``nnx.Einsum`` / ``nnx.Linear`` / embedding call,
frozen ``@dataclass`` configs and the unhashable ``SowConfig`` stored on the modules — shrunk only
in size (2 layers, Gemma 2's grouped-query attention with 8 query and 4 key/value heads, a local
sliding-window layer and a global one, logit soft-capping, post-attention / post-FFW norms).
"""

# ruff: noqa: B008  (defaults such as sow_config=SowConfig() are the published signatures)
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, HIDDEN, HEADS, HEAD_DIM, KV_HEADS, LAYERS, SEQ, BATCH = 64, 16, 32, 8, 4, 4, 2, 8, 8
K_MASK = -2.3819763e38  # Set to a large negative number.
DEFAULT_ROPE_BASE_FREQUENCY = 10_000
DEFAULT_ROPE_SCALE_FACTOR = 1.0


# -- transformer_cfg.py ---------------------------------------------------------------------------


class QueryPreAttentionNormalisation(enum.Enum):
    BY_ONE_OVER_SQRT_HEAD_DIM = enum.auto()
    BY_EMBED_DIM_DIV_NUM_HEADS = enum.auto()
    BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS = enum.auto()


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass(slots=True, frozen=True)
class ShardingConfig:
    """Sharding configuration for gemma transformer."""

    emb_vd: P | None = None
    q_weight_ndh: P | None = None
    kv_weight_cndh: P | None = None
    qkv_weight_cndh: P | None = None
    o_weight_nhd: P | None = None
    ffw_weight_df: P | None = None
    ffw_weight_fd: P | None = None
    rms_norm_weight: P | None = None
    act_btd: P | None = None
    act_btf: P | None = None
    act_btnh: P | None = None
    act_sbtnh: P | None = None

    fsdp_axis_name: str = "fsdp"
    tensor_parallel_axis_name: str = "tensor"

    @staticmethod
    def no_sharding():
        return ShardingConfig()

    @staticmethod
    def fsdp_tp_sharding(
        is_sampling: bool = False,
        fsdp_axis_name: str = "fsdp",
        tensor_parallel_axis_name: str = "tp",
    ):
        fsdp = fsdp_axis_name if not is_sampling else None
        tp = tensor_parallel_axis_name

        return ShardingConfig(
            emb_vd=P(tp, fsdp),
            q_weight_ndh=P(tp, fsdp, None),
            kv_weight_cndh=P(None, tp, fsdp, None),
            qkv_weight_cndh=P(None, tp, fsdp, None),
            o_weight_nhd=P(tp, None, fsdp),
            ffw_weight_df=P(fsdp, tp),
            ffw_weight_fd=P(tp, fsdp),
            rms_norm_weight=P(
                tp,
            ),
            act_btd=P(fsdp, None, None if is_sampling else tp),
            act_btf=P(fsdp, None, tp),
            act_btnh=P(fsdp, None, tp, None),
            act_sbtnh=P(None, fsdp, None, tp, None),
            tensor_parallel_axis_name=tensor_parallel_axis_name,
            fsdp_axis_name=fsdp_axis_name,
        )


@dataclasses.dataclass(slots=True, frozen=True)
class TransformerConfig:
    """Configuration for the text-only gemma transformer."""

    num_layers: int
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    final_logit_softcap: float | None
    use_post_attn_norm: bool
    use_post_ffw_norm: bool
    attention_types: Iterable[AttentionType]
    query_pre_attn_norm: QueryPreAttentionNormalisation = (
        QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM
    )
    attn_logits_soft_cap: float | None = None
    transpose_gating_einsum: bool = False
    local_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    global_base_frequency: int = DEFAULT_ROPE_BASE_FREQUENCY
    local_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    global_scale_factor: float = DEFAULT_ROPE_SCALE_FACTOR
    use_qk_norm: bool = False
    sliding_window_size: int | None = None
    dtype: Any = jnp.float32
    weight_dtype: Any = jnp.float32
    dropout_rate: float = 0.0

    shd_config: ShardingConfig = ShardingConfig.no_sharding()

    def query_pre_attn_scalar(self) -> float:
        match self.query_pre_attn_norm:
            case QueryPreAttentionNormalisation.BY_EMBED_DIM_DIV_NUM_HEADS:
                return self.embed_dim // self.num_heads
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS:
                return (self.embed_dim // self.num_heads) ** -0.5
            case QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM | _:
                return self.head_dim**-0.5


def tiny_config(shd_config: ShardingConfig, dropout_rate: float = 0.0) -> TransformerConfig:
    """``TransformerConfig.gemma2_2b``'s shape of model, shrunk."""
    return TransformerConfig(
        num_layers=LAYERS,
        num_embed=VOCAB,
        embed_dim=EMBED,
        hidden_dim=HIDDEN,
        num_heads=HEADS,
        head_dim=HEAD_DIM,
        num_kv_heads=KV_HEADS,
        final_logit_softcap=30.0,
        attention_types=(AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL) * (LAYERS // 2),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        attn_logits_soft_cap=50.0,
        sliding_window_size=4,
        dropout_rate=dropout_rate,
        shd_config=shd_config,
    )


# -- sow_lib.py (no sowing configured: the calls are kept, as the modules make them) ---------------


@dataclasses.dataclass  # not frozen: unhashable, as published
class SowConfig:
    embeddings: bool = False
    rs_after_attention: bool = False
    rs_after_ffw: bool = False
    mlp_hidden_topk: int = 0
    attn_logits_topk: int = 0

    def maybe_sow_embeddings(self, embeddings, module):
        if self.embeddings:
            module.sow(nnx.Intermediate, "embeddings", embeddings)

    def maybe_sow_rs_after_attention(self, activations, module):
        if self.rs_after_attention:
            module.sow(nnx.Intermediate, "rs_after_attention", activations)

    def maybe_sow_rs_after_ffw(self, activations, module):
        if self.rs_after_ffw:
            module.sow(nnx.Intermediate, "rs_after_ffw", activations)

    def maybe_sow_mlp_hidden_topk(self, activations, module):
        if self.mlp_hidden_topk:
            values, indices = jax.lax.top_k(activations, self.mlp_hidden_topk)
            module.sow(nnx.Intermediate, "hidden_topk_values", values)
            module.sow(nnx.Intermediate, "hidden_topk_indices", indices)

    def maybe_sow_attn_logits_topk(self, logits, module):
        if self.attn_logits_topk:
            values, indices = jax.lax.top_k(logits, self.attn_logits_topk)
            module.sow(nnx.Intermediate, "logits_topk_values", values)
            module.sow(nnx.Intermediate, "logits_topk_indices", indices)


# -- positional_embeddings.py -----------------------------------------------------------------------


def apply_rope(inputs, positions, head_dim, max_wavelength=10_000, scale_factor=1.0):
    """Applies RoPE."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction

    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    if scale_factor < 1.0:
        raise ValueError(f"scale_factor must be >= 1.0, got {scale_factor}")
    sinusoid_inp /= scale_factor

    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)

    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    out = jnp.concatenate([first_part, second_part], axis=-1)
    return out.astype(inputs.dtype)


# -- layers.py --------------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    """RMSNorm layer."""

    def __init__(
        self,
        dim,
        *,
        scale_init=nnx.initializers.zeros_init(),
        scale_metadata=None,
        rngs,
        dtype=jnp.float32,
        weight_dtype=jnp.float32,
    ):
        self.dtype = dtype
        self.weight_dtype = weight_dtype
        scale_metadata = scale_metadata if scale_metadata else {}
        self.scale = nnx.Param(scale_init(rngs.params(), dim, weight_dtype), **scale_metadata)

    def __call__(self, x):
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed_inputs = jnp.asarray(x * jax.lax.rsqrt(mean2 + 1e-06), dtype=self.dtype)
        scale = jnp.asarray(self.scale, self.dtype)
        normed_inputs = normed_inputs * (1.0 + scale)
        return normed_inputs


# -- modules.py -------------------------------------------------------------------------------------


class ScaledEmbed(nnx.Embed):
    def __call__(self, x, out_sharding=None):
        x = super().__call__(x, out_sharding)
        x *= jnp.sqrt(x.shape[-1])
        return x


class Attention(nnx.Module):
    """Attention module (the grouped-query path: fewer key/value heads than query heads)."""

    def __init__(
        self,
        num_heads,
        num_kv_heads,
        features,
        head_dim,
        query_pre_attn_scalar,
        attn_type,
        *,
        rngs,
        rope_base_frequency=DEFAULT_ROPE_BASE_FREQUENCY,
        rope_scale_factor=DEFAULT_ROPE_SCALE_FACTOR,
        attn_logits_soft_cap=None,
        sliding_window_size=None,
        sow_config=SowConfig(),
        shd_config: ShardingConfig,
        dtype=jnp.float32,
        weight_dtype=jnp.float32,
        dropout_rate=0.0,
    ):
        self.shd_config = shd_config
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.attn_type = attn_type
        self.sliding_window_size = sliding_window_size
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.attn_vec_einsum = nnx.Einsum(
            einsum_str="BTNH,NHD->BTD",
            kernel_shape=(num_heads, head_dim, features),
            kernel_metadata={"out_sharding": shd_config.o_weight_nhd},
            dtype=dtype,
            param_dtype=weight_dtype,
            rngs=rngs,
        )
        self.rope_base_frequency = rope_base_frequency
        self.rope_scale_factor = rope_scale_factor
        self.sow_config = sow_config

        self.act_cbtkh_shd = None
        self.q_einsum = nnx.Einsum(
            einsum_str="BTD,NDH->BTNH",
            kernel_shape=(num_heads, features, head_dim),
            kernel_metadata={"out_sharding": shd_config.q_weight_ndh},
            dtype=dtype,
            param_dtype=weight_dtype,
            rngs=rngs,
        )
        kv_kernel_sharding = None
        if shd_config.kv_weight_cndh:
            self.act_cbtkh_shd = (
                self.shd_config.act_sbtnh
                if num_kv_heads > 1
                else jax.P(None, shd_config.fsdp_axis_name, None, None, None)
            )
            kv_kernel_sharding = (
                shd_config.kv_weight_cndh
                if num_kv_heads > 1
                else jax.P(None, None, shd_config.fsdp_axis_name, None)
            )
        self.kv_einsum = nnx.Einsum(
            einsum_str="BTD,CKDH->CBTKH",
            kernel_shape=(2, num_kv_heads, features, head_dim),
            kernel_metadata={"out_sharding": kv_kernel_sharding},
            dtype=dtype,
            param_dtype=weight_dtype,
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(self, x, segment_pos, cache, attn_mask, rngs=None):
        query_proj = self.q_einsum(x, out_sharding=self.shd_config.act_btnh)
        key_proj, value_proj = self.kv_einsum(x, out_sharding=self.act_cbtkh_shd)

        query_proj = apply_rope(
            query_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(
            key_proj,
            segment_pos,
            head_dim=self.head_dim,
            max_wavelength=self.rope_base_frequency,
            scale_factor=self.rope_scale_factor,
        )

        use_gqa = self.num_heads > self.num_kv_heads and self.num_kv_heads > 1
        if use_gqa:
            num_groups = self.num_heads // self.num_kv_heads
            batch_size, seq_size, _, head_dim = query_scaled.shape
            query_scaled = query_scaled.reshape(
                (batch_size, seq_size, self.num_kv_heads, num_groups, head_dim)
            )
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
            logits = logits.reshape((batch_size, seq_size, self.num_heads, -1))
        else:
            logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)

        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap)
            logits = logits * self.attn_logits_soft_cap
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            all_ones = jnp.ones(attn_mask.shape, dtype=attn_mask.dtype)
            sliding_mask = jnp.triu(all_ones, -1 * self.sliding_window_size + 1) * jnp.tril(
                all_ones, self.sliding_window_size - 1
            )
            attn_mask = sliding_mask * attn_mask

        padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
        self.sow_config.maybe_sow_attn_logits_topk(padded_logits, self)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        probs = self.dropout(probs, rngs=rngs)

        if use_gqa:
            num_groups = self.num_heads // self.num_kv_heads
            batch_size, seq_size1, _, _ = probs.shape
            probs = probs.reshape((batch_size, seq_size1, self.num_kv_heads, num_groups, -1))
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
            encoded = encoded.reshape((batch_size, seq_size, self.num_heads, head_dim))
        else:
            encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)
        attn_output = self.attn_vec_einsum(encoded, out_sharding=self.shd_config.act_btd)
        return None, attn_output

    @property
    def head_dim(self):
        return self.attn_vec_einsum.kernel.shape[1]

    @property
    def num_heads(self):
        return self.q_einsum.kernel.shape[0]

    @property
    def num_kv_heads(self):
        return self.kv_einsum.kernel.shape[1]


class FeedForward(nnx.Module):
    """Feed forward module."""

    def __init__(
        self,
        features,
        hidden_dim,
        *,
        kernel_init=nnx.initializers.normal(),
        rngs,
        sow_config=SowConfig(),
        shd_config: ShardingConfig,
        dtype=jnp.float32,
        weight_dtype=jnp.float32,
        dropout_rate=0.0,
    ):
        self.gate_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_df},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.up_proj = nnx.Linear(
            in_features=features,
            out_features=hidden_dim,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_df},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.down_proj = nnx.Linear(
            in_features=hidden_dim,
            out_features=features,
            use_bias=False,
            rngs=rngs,
            kernel_init=kernel_init,
            kernel_metadata={"out_sharding": shd_config.ffw_weight_fd},
            dtype=dtype,
            param_dtype=weight_dtype,
        )
        self.dropout = nnx.Dropout(dropout_rate)
        self.sow_config = sow_config
        self.shd_config = shd_config

    def __call__(self, x, rngs=None):
        ff_gate = self.gate_proj(x, out_sharding=self.shd_config.act_btf)
        gate_value = nnx.gelu(ff_gate)

        ff1 = self.up_proj(x, out_sharding=self.shd_config.act_btf)
        activations = gate_value * ff1
        self.sow_config.maybe_sow_mlp_hidden_topk(activations, self)

        activations = self.dropout(activations, rngs=rngs)
        outputs = self.down_proj(activations, out_sharding=self.shd_config.act_btd)
        return outputs


class Block(nnx.Module):
    """Transformer block."""

    def __init__(
        self, config: TransformerConfig, attn_type: AttentionType, *, rngs, sow_config=SowConfig()
    ):
        if attn_type == AttentionType.LOCAL_SLIDING:
            rope_base_frequency, rope_scale_factor = (
                config.local_base_frequency,
                config.local_scale_factor,
            )
        else:
            rope_base_frequency, rope_scale_factor = (
                config.global_base_frequency,
                config.global_scale_factor,
            )
        norm = {"out_sharding": config.shd_config.rms_norm_weight}
        self.pre_attention_norm = RMSNorm(
            config.embed_dim,
            scale_metadata=norm,
            rngs=rngs,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
        )
        self.attn = Attention(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            features=config.embed_dim,
            head_dim=config.head_dim,
            query_pre_attn_scalar=config.query_pre_attn_scalar(),
            attn_type=attn_type,
            rope_base_frequency=rope_base_frequency,
            rope_scale_factor=rope_scale_factor,
            attn_logits_soft_cap=config.attn_logits_soft_cap,
            sliding_window_size=config.sliding_window_size,
            rngs=rngs,
            sow_config=sow_config,
            shd_config=config.shd_config,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
            dropout_rate=config.dropout_rate,
        )
        self.post_attention_norm = (
            RMSNorm(
                config.embed_dim,
                scale_metadata=norm,
                rngs=rngs,
                dtype=config.dtype,
                weight_dtype=config.weight_dtype,
            )
            if config.use_post_attn_norm
            else None
        )
        self.pre_ffw_norm = RMSNorm(
            config.embed_dim,
            scale_metadata=norm,
            rngs=rngs,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
        )
        self.mlp = FeedForward(
            features=config.embed_dim,
            hidden_dim=config.hidden_dim,
            rngs=rngs,
            sow_config=sow_config,
            shd_config=config.shd_config,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
            dropout_rate=config.dropout_rate,
        )
        self.post_ffw_norm = (
            RMSNorm(
                config.embed_dim,
                scale_metadata=norm,
                rngs=rngs,
                dtype=config.dtype,
                weight_dtype=config.weight_dtype,
            )
            if config.use_post_ffw_norm
            else None
        )
        self.dropout = nnx.Dropout(config.dropout_rate)
        self.sow_config = sow_config

    def __call__(self, x, segment_pos, cache, attn_mask, rngs=None):
        attn_inputs = self.pre_attention_norm(x)
        cache, attn_output = self.attn(attn_inputs, segment_pos, cache, attn_mask, rngs=rngs)
        if self.post_attention_norm is not None:
            attn_output = self.post_attention_norm(attn_output)
        x += attn_output
        self.sow_config.maybe_sow_rs_after_attention(x, self)

        ffw_inputs = self.pre_ffw_norm(x)
        ffw_outputs = self.mlp(ffw_inputs, rngs=rngs)
        if self.post_ffw_norm is not None:
            ffw_outputs = self.post_ffw_norm(ffw_outputs)
        x += ffw_outputs
        x = self.dropout(x, rngs=rngs)
        self.sow_config.maybe_sow_rs_after_ffw(x, self)
        return cache, x


# -- transformer.py ---------------------------------------------------------------------------------


class Transformer(nnx.Module):
    """Gemma text-only transformer."""

    def __init__(self, config: TransformerConfig, *, rngs, sow_config=SowConfig()):
        self.embedder = ScaledEmbed(
            config.num_embed,
            config.embed_dim,
            dtype=config.dtype,
            param_dtype=config.weight_dtype,
            rngs=rngs,
            embedding_metadata={"out_sharding": config.shd_config.emb_vd},
        )
        self.layers = nnx.List(
            [
                Block(config=config, attn_type=attn_type, sow_config=sow_config, rngs=rngs)
                for _, attn_type in zip(range(config.num_layers), config.attention_types)
            ]
        )
        self.final_norm = RMSNorm(
            config.embed_dim,
            scale_metadata={"out_sharding": config.shd_config.rms_norm_weight},
            rngs=rngs,
            dtype=config.dtype,
            weight_dtype=config.weight_dtype,
        )
        self.final_dropout = nnx.Dropout(config.dropout_rate, deterministic=False)
        self.final_logits_softcap = config.final_logit_softcap
        self.config = config
        self.sow_config = sow_config
        self.shd_config = config.shd_config

    def __call__(self, last_tokens, positions, cache, attention_mask, rngs=None):
        new_cache = None if cache is None else {}
        x = self.embedder(last_tokens, out_sharding=self.shd_config.act_btd)
        self.sow_config.maybe_sow_embeddings(x, self)

        for i, layer in enumerate(self.layers):
            layer_cache = cache[f"layer_{i}"] if cache else None
            layer_cache, x = layer(x, positions, layer_cache, attention_mask, rngs=rngs)

        x = self.final_norm(x)
        x = self.final_dropout(x, rngs=rngs)
        logits = self.embedder.attend(x, out_sharding=self.shd_config.act_btd)

        if self.final_logits_softcap is not None:
            logits /= self.final_logits_softcap
            logits = jnp.tanh(logits) * self.final_logits_softcap
        return logits, new_cache


def make_causal_attn_mask(input_mask):
    seq_len = input_mask.shape[-1]
    attn_mask = input_mask[..., None, :]
    causal_mask = jnp.tril(jnp.ones((seq_len, seq_len), dtype=jnp.bool_))
    attn_mask *= causal_mask[None, ...]
    return attn_mask


def build_positions_from_mask(input_mask):
    positions = jnp.cumsum(input_mask, axis=-1)
    return positions - (positions >= 1)


# -- train.py's loss ----------------------------------------------------------------------------------


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(
        confidence * jnp.log(confidence)
        + (vocab_size - 1) * low_confidence * jnp.log(low_confidence + 1e-20)
    )
    soft_targets = (
        jax.nn.one_hot(targets, vocab_size) * (confidence - low_confidence) + low_confidence
    )
    loss = -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    loss_per_sample = loss.sum(axis=1) * len(loss) / normalizing_factor
    return loss_per_sample


def loss_fn(model, batch, rngs, pad_id=0, label_smoothing=0.1):
    """``nnx_train_step``'s loss: masks from the inputs, the model called with ``rngs``."""
    inputs, inputs_positions, targets = batch["inputs"], batch["inputs_position"], batch["targets"]
    input_mask = inputs > pad_id
    weights = input_mask.astype(jnp.float32)
    attention_mask = make_causal_attn_mask(input_mask)
    logits, _ = model(
        inputs, positions=inputs_positions, attention_mask=attention_mask, cache=None, rngs=rngs
    )
    loss_per_sample = compute_weighted_cross_entropy(logits, targets, weights, label_smoothing)
    return loss_per_sample.mean()


def batch(seed: int):
    """A batch as ``input_pipeline`` gives it: tokens padded with 0 at the end, targets the tokens
    shifted left, positions from the mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    lengths = rng.integers(SEQ // 2, SEQ + 2, size=BATCH)
    tokens = np.where(np.arange(SEQ + 1)[None, :] < lengths[:, None], tokens, 0).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = np.asarray(build_positions_from_mask(inputs > 0)).astype(np.int32)
    return {"inputs": inputs, "inputs_position": positions, "targets": targets}
