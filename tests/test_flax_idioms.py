"""Flax NNX idioms real users write, trained through ``jflax.shard`` + ``jflax.make_train_step``
under ``dp=8`` and a ``(2, 4)`` dp x tp placement (Megatron logical axis rules) and compared with
the same steps on one device written in plain Flax / optax (``nnx.jit``, no jsbp).

Idioms: tied embeddings (``nnx.Embed.attend``), ``nnx.MultiHeadAttention`` with a causal mask,
mixed precision (``param_dtype=float32, dtype=bfloat16``), optax chains (global-norm clipping,
``optax.MultiSteps``), ``nnx.remat`` / ``nnx.jit`` inside a model, normalisation / strided SAME
convolutions / pooling, and a KV-cache decode loop.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jax
import jax.numpy as jnp
import jsbp
import jsbp.flax as jflax

STEPS = 3
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4

VOCAB, SEQ, D, HEADS, HIDDEN, BATCH = 32, 8, 16, 4, 32, 16
ACT = ("batch", "seq", "embed")

# Megatron: heads / mlp / vocab over tp, everything else whole
RULES = {"heads": "tp", "mlp": "tp", "vocab": "tp", "conv": "tp"}

normal = nnx.initializers.normal(0.02)


def part(init, *names):
    return nnx.with_partitioning(init, names)


def placement(layout):
    if layout == "dp8":
        return jsbp.placement("cpu", np.arange(8), axis_names=("dp",))
    return jsbp.placement("cpu", np.arange(8).reshape(2, 4), axis_names=("dp", "tp"))


def strategy(layout, zero=0):
    plc = placement(layout)
    logical = {"batch": "dp"}
    if "tp" in plc.axis_names:
        logical.update(RULES)
    return jflax.Strategy(plc, logical_axes=logical, zero=zero)


LAYOUTS = ("dp8", "dp2tp4")


def tokens(seed, batch=BATCH, seq=SEQ):
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(batch, 1))
    steps = rng.integers(1, 4, size=(batch, seq))
    return (np.concatenate([start, start + np.cumsum(steps, axis=1)], axis=1) % VOCAB).astype(
        np.int32
    )


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch[:, 1:]
    ).mean()


def params_of(model):
    return {
        jflax.path_str(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _value(x):
    return float(x.numpy() if isinstance(x, jsbp.GlobalTensor) else x)


def train_reference(make, loss_fn, batches, tx):
    """The same steps on one device: plain Flax NNX + optax, no jsbp."""
    model = make(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, jnp.asarray(b))) for b in batches]
    return losses, model, optimizer


def train_jsbp(make, loss_fn, batches, tx, strat):
    model = make(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    model, optimizer = jflax.shard((model, optimizer), strat)
    step = jflax.make_train_step(loss_fn, strat)
    losses = [_value(step(model, optimizer, b)) for b in batches]
    return losses, jflax.gather(model), jflax.gather(optimizer)


def assert_parity(got, ref, init, loss_rtol=LOSS_RTOL, param_rtol=PARAM_RTOL):
    (gl, gm), (rl, rm) = got[:2], ref[:2]
    np.testing.assert_allclose(gl, rl, rtol=loss_rtol, atol=0)
    pg, pr, p0 = params_of(gm), params_of(rm), params_of(init)
    assert pg.keys() == pr.keys()
    scale = max(float(np.max(np.abs(v))) for v in pr.values())
    for k, v in pr.items():
        assert pg[k].dtype == v.dtype, (k, pg[k].dtype, v.dtype)
        assert pg[k].shape == v.shape, (k, pg[k].shape, v.shape)
        np.testing.assert_allclose(
            pg[k].astype(np.float32), v.astype(np.float32), rtol=param_rtol,
            atol=param_rtol * scale, err_msg=k,
        )
    # training moved the parameters (a frozen run would pass trivially)
    assert any(float(np.max(np.abs(pr[k] - p0[k]))) > 1e-4 for k in pr)


def check(make, loss_fn, batches, tx_fn, layout, **tol):
    ref = train_reference(make, loss_fn, batches, tx_fn())
    got = train_jsbp(make, loss_fn, batches, tx_fn(), strategy(layout))
    assert_parity(got, ref, make(nnx.Rngs(0)), **tol)
    return got, ref


# ------------------------------------------------------------------------------------------------
# 1. tied embeddings: nnx.Embed as the output head through embed.attend
# ------------------------------------------------------------------------------------------------


class MLPBlock(nnx.Module):
    def __init__(self, *, dtype=jnp.float32, rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.norm = nnx.LayerNorm(D, scale_init=part(nnx.initializers.ones_init(), "embed"),
                                  bias_init=part(nnx.initializers.zeros_init(), "embed"), **kw)
        self.up = nnx.Linear(D, HIDDEN, kernel_init=part(normal, "embed", "mlp"),
                             bias_init=part(nnx.initializers.zeros_init(), "mlp"), **kw)
        self.down = nnx.Linear(HIDDEN, D, kernel_init=part(normal, "mlp", "embed"),
                               bias_init=part(nnx.initializers.zeros_init(), "embed"), **kw)

    def __call__(self, x):
        h = jflax.constrain(self.norm(x), ACT)
        return x + jflax.constrain(self.down(nnx.gelu(self.up(h))), ACT)


class TiedLM(nnx.Module):
    def __init__(self, *, dtype=jnp.float32, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"),
                               dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.block = MLPBlock(dtype=dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(D, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):
        x = jflax.constrain(self.embed(tokens), ACT)
        x = self.block(x)
        return self.embed.attend(self.norm(x))  # the tied output head


def make_tied(rngs):
    with nnx.use_eager_sharding(False):
        return TiedLM(rngs=rngs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tied_embeddings(layout):
    batches = [tokens(i) for i in range(STEPS)]
    check(make_tied, lm_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 2. nnx.MultiHeadAttention with a causal mask in a small transformer
# ------------------------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, *, dtype=jnp.float32, decode=False, rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = nnx.LayerNorm(D, **kw)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, qkv_features=D, out_features=D,
            kernel_init=part(normal, "embed", "heads", "kv"),
            out_kernel_init=part(normal, "heads", "kv", "embed"),
            bias_init=part(nnx.initializers.zeros_init(), "heads", "kv"),
            out_bias_init=part(nnx.initializers.zeros_init(), "embed"),
            decode=decode, **kw,
        )
        self.mlp = MLPBlock(dtype=dtype, rngs=rngs)

    def __call__(self, x, mask=None):
        h = jflax.constrain(self.ln1(x), ACT)
        x = x + jflax.constrain(self.attn(h, mask=mask), ACT)
        return self.mlp(x)


class Transformer(nnx.Module):
    def __init__(self, *, dtype=jnp.float32, decode=False, rngs):
        kw = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"), **kw)
        self.pos = nnx.Embed(SEQ, D, embedding_init=normal, **kw)
        self.blocks = nnx.List([Block(dtype=dtype, decode=decode, rngs=rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(D, **kw)
        self.head = nnx.Linear(D, VOCAB, kernel_init=part(normal, "embed", "vocab"), **kw)

    def __call__(self, tokens):
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(jnp.arange(t))[None]
        x = jflax.constrain(x, ACT)
        mask = nnx.make_causal_mask(tokens)  # (batch, 1, t, t)
        for blk in self.blocks:
            x = blk(x, mask=mask)
        return self.head(jflax.constrain(self.ln(x), ACT))


def make_transformer(rngs, dtype=jnp.float32):
    with nnx.use_eager_sharding(False):
        return Transformer(dtype=dtype, rngs=rngs)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_head_attention_causal(layout):
    batches = [tokens(i) for i in range(STEPS)]
    check(make_transformer, lm_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 3. mixed precision: float32 parameters, bfloat16 compute
# ------------------------------------------------------------------------------------------------


def make_bf16(rngs):
    return make_transformer(rngs, dtype=jnp.bfloat16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mixed_precision_bf16_compute(layout):
    batches = [tokens(i) for i in range(STEPS)]
    # plain SGD: Adam would amplify the rounding noise of gradients that are zero in exact
    # arithmetic (the key bias's), which bfloat16 makes large
    got, ref = check(make_bf16, lm_loss, batches, lambda: optax.sgd(0.5), layout,
                     loss_rtol=2e-2, param_rtol=2e-2)
    # parameters and optimizer state stay float32
    for k, v in params_of(got[1]).items():
        assert v.dtype == np.float32, k
    for leaf in jax.tree.leaves(nnx.state(got[2])):
        r = np.asarray(leaf)
        assert r.dtype in (np.float32, np.int32, np.uint32), r.dtype
    # the forward computes in bfloat16 on the placement, as on one device
    model = jflax.shard(make_bf16(nnx.Rngs(0)), strategy(layout))
    x = jsbp.tensor(batches[0][:, :-1], placement=placement(layout),
                    sbp=strategy(layout).batch_sbp(2))
    with jflax.use_strategy(strategy(layout)):
        logits = jsbp.jit(lambda m, t: m(t))(model, x)
    ref_logits = make_bf16(nnx.Rngs(0))(jnp.asarray(batches[0][:, :-1]))
    assert logits.dtype == ref_logits.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(logits.numpy(), np.float32), np.asarray(ref_logits, np.float32),
        rtol=2e-2, atol=2e-2,
    )


# ------------------------------------------------------------------------------------------------
# 4. optax chains: global-norm clipping + AdamW, gradient accumulation with optax.MultiSteps
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_optax_clip_by_global_norm_adamw(layout):
    batches = [tokens(i) for i in range(STEPS)]
    # a clip threshold below the gradient norm, so clipping really happens
    tx = lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1))  # noqa: E731
    check(make_tied, lm_loss, batches, tx, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_optax_multisteps(layout):
    batches = [tokens(i) for i in range(4)]
    tx = lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)  # noqa: E731
    got, ref = check(make_tied, lm_loss, batches, tx, layout)
    assert int(np.asarray(got[2].opt_state.mini_step.get_value())) == 0
    assert int(np.asarray(got[2].opt_state.gradient_step.get_value())) == 2
