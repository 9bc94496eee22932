"""Flax NNX idioms real users write, trained through ``jflax.shard`` + ``jflax.make_train_step``
under ``dp=8`` and a ``(2, 4)`` dp x tp placement (Megatron logical axis rules) and compared with
the same steps on one device written in plain Flax / optax (``nnx.jit``, no jsbp).

Idioms: tied embeddings (``nnx.Embed.attend``), ``nnx.MultiHeadAttention`` with a causal mask,
mixed precision (``param_dtype=float32, dtype=bfloat16``), optax chains (global-norm clipping,
``optax.MultiSteps``), ``nnx.remat`` / ``nnx.jit`` inside a model, normalisation / strided SAME
convolutions / pooling, and a KV-cache decode loop.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

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


def strategy(layout, zero=0, rules=None):
    """``jflax.Strategy`` for ``layout``: the batch over dp, ``rules`` (default ``RULES``) over tp."""
    plc = placement(layout)
    logical = {"batch": "dp"}
    if "tp" in plc.axis_names:
        logical.update(RULES if rules is None else rules)
    return jflax.Strategy(plc, logical_axes=logical, zero=zero)


LAYOUTS = ("dp8", "dp2tp4")


def layouts(default: str):
    """Both layouts; the default run keeps ``default`` only (the other is ``slow``: each case
    compiles a train step, ~10-30 s on the 2-core CI machine; JSBP_FULL=1 runs every case)."""
    return [
        pytest.param(lay, id=lay, marks=() if lay == default else (pytest.mark.slow,))
        for lay in LAYOUTS
    ]


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

    losses = [float(train_step(model, optimizer, jax.tree.map(jnp.asarray, b))) for b in batches]
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
            pg[k].astype(np.float32),
            v.astype(np.float32),
            rtol=param_rtol,
            atol=param_rtol * scale,
            err_msg=k,
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
        self.norm = nnx.LayerNorm(
            D,
            scale_init=part(nnx.initializers.ones_init(), "embed"),
            bias_init=part(nnx.initializers.zeros_init(), "embed"),
            **kw,
        )
        self.up = nnx.Linear(
            D,
            HIDDEN,
            kernel_init=part(normal, "embed", "mlp"),
            bias_init=part(nnx.initializers.zeros_init(), "mlp"),
            **kw,
        )
        self.down = nnx.Linear(
            HIDDEN,
            D,
            kernel_init=part(normal, "mlp", "embed"),
            bias_init=part(nnx.initializers.zeros_init(), "embed"),
            **kw,
        )

    def __call__(self, x):
        h = jflax.constrain(self.norm(x), ACT)
        return x + jflax.constrain(self.down(nnx.gelu(self.up(h))), ACT)


class TiedLM(nnx.Module):
    def __init__(self, *, dtype=jnp.float32, rngs):
        self.embed = nnx.Embed(
            VOCAB,
            D,
            embedding_init=part(normal, "vocab", "embed"),
            dtype=dtype,
            param_dtype=jnp.float32,
            rngs=rngs,
        )
        self.block = MLPBlock(dtype=dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(D, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens):
        x = jflax.constrain(self.embed(tokens), ACT)
        x = self.block(x)
        return self.embed.attend(self.norm(x))  # the tied output head


def make_tied(rngs):
    with nnx.use_eager_sharding(False):
        return TiedLM(rngs=rngs)


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
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
            num_heads=HEADS,
            in_features=D,
            qkv_features=D,
            out_features=D,
            kernel_init=part(normal, "embed", "heads", "kv"),
            out_kernel_init=part(normal, "heads", "kv", "embed"),
            bias_init=part(nnx.initializers.zeros_init(), "heads", "kv"),
            out_bias_init=part(nnx.initializers.zeros_init(), "embed"),
            decode=decode,
            **kw,
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


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_multi_head_attention_causal(layout):
    batches = [tokens(i) for i in range(STEPS)]
    check(make_transformer, lm_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 3. mixed precision: float32 parameters, bfloat16 compute
# ------------------------------------------------------------------------------------------------


def make_bf16(rngs):
    return make_transformer(rngs, dtype=jnp.bfloat16)


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_mixed_precision_bf16_compute(layout):
    batches = [tokens(i) for i in range(STEPS)]
    # plain SGD: Adam would amplify the rounding noise of gradients that are zero in exact
    # arithmetic (the key bias's), which bfloat16 makes large
    got, ref = check(
        make_bf16, lm_loss, batches, lambda: optax.sgd(0.5), layout, loss_rtol=2e-2, param_rtol=2e-2
    )
    # parameters and optimizer state stay float32
    for k, v in params_of(got[1]).items():
        assert v.dtype == np.float32, k
    for leaf in jax.tree.leaves(nnx.state(got[2])):
        r = np.asarray(leaf)
        assert r.dtype in (np.float32, np.int32, np.uint32), r.dtype
    # the forward computes in bfloat16 on the placement, as on one device
    model = jflax.shard(make_bf16(nnx.Rngs(0)), strategy(layout))
    x = jsbp.tensor(
        batches[0][:, :-1], placement=placement(layout), sbp=strategy(layout).batch_sbp(2)
    )
    with jflax.use_strategy(strategy(layout)):
        logits = jsbp.jit(lambda m, t: m(t))(model, x)
    ref_logits = make_bf16(nnx.Rngs(0))(jnp.asarray(batches[0][:, :-1]))
    assert logits.dtype == ref_logits.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(logits.numpy(), np.float32),
        np.asarray(ref_logits, np.float32),
        rtol=2e-2,
        atol=2e-2,
    )


# ------------------------------------------------------------------------------------------------
# 4. optax chains: global-norm clipping + AdamW, gradient accumulation with optax.MultiSteps
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_optax_clip_by_global_norm_adamw(layout):
    batches = [tokens(i) for i in range(STEPS)]
    # a clip threshold below the gradient norm, so clipping really happens
    tx = lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2, weight_decay=0.1))  # noqa: E731
    check(make_tied, lm_loss, batches, tx, layout)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_optax_multisteps(layout):
    batches = [tokens(i) for i in range(4)]
    tx = lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)  # noqa: E731
    got, ref = check(make_tied, lm_loss, batches, tx, layout)
    assert int(np.asarray(got[2].opt_state.mini_step.get_value())) == 0
    assert int(np.asarray(got[2].opt_state.gradient_step.get_value())) == 2


# ------------------------------------------------------------------------------------------------
# 5. nnx.remat / nnx.jit around submodule calls inside the model
# ------------------------------------------------------------------------------------------------


class RematLM(nnx.Module):
    """Flax's activation checkpointing idiom: each block's call under ``nnx.remat``; the head
    under ``nnx.jit`` (a jitted submodule call inside the model)."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs)
        self.blocks = nnx.List([MLPBlock(rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(D, VOCAB, kernel_init=part(normal, "embed", "vocab"), rngs=rngs)

    def __call__(self, tokens):
        x = jflax.constrain(self.embed(tokens), ACT)
        for blk in self.blocks:
            x = nnx.remat(lambda b, h: b(h))(blk, x)
        return nnx.jit(lambda m, h: m(h))(self.head, x)


class RematMethodLM(nnx.Module):
    """``nnx.remat`` as a decorator on a module's method (``prevent_cse``, a static policy)."""

    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs)
        self.block = MLPBlock(rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, kernel_init=part(normal, "embed", "vocab"), rngs=rngs)

    @nnx.remat(policy=jax.checkpoint_policies.nothing_saveable)
    def body(self, x):
        return self.block(x)

    def __call__(self, tokens):
        return self.head(self.body(jflax.constrain(self.embed(tokens), ACT)))


def _eager(cls):
    def make(rngs):
        with nnx.use_eager_sharding(False):
            return cls(rngs=rngs)

    return make


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_remat_and_jit_inside_the_model(layout):
    batches = [tokens(i) for i in range(STEPS)]
    check(_eager(RematLM), lm_loss, batches, lambda: optax.adam(1e-2), layout)


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_remat_decorated_method(layout):
    batches = [tokens(i) for i in range(STEPS)]
    check(_eager(RematMethodLM), lm_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 6. LayerNorm / GroupNorm, strided SAME convolutions, max / avg pooling
# ------------------------------------------------------------------------------------------------

IMG, CH, CLASSES = 8, 12, 10
lecun = nnx.initializers.lecun_normal()


class ConvNet(nnx.Module):
    """Under tp the channels of conv1 / the depthwise conv are split 4 ways (3 per device) while
    GroupNorm's groups hold 4 channels each: groups straddle devices."""

    def __init__(self, *, rngs):
        self.conv1 = nnx.Conv(
            3,
            CH,
            kernel_size=(3, 3),
            padding="SAME",
            kernel_init=part(lecun, None, None, None, "conv"),
            bias_init=part(nnx.initializers.zeros_init(), "conv"),
            rngs=rngs,
        )
        self.gn = nnx.GroupNorm(CH, num_groups=3, rngs=rngs)
        self.dw = nnx.Conv(
            CH,
            CH,
            kernel_size=(3, 3),
            strides=2,
            padding="SAME",
            feature_group_count=CH,  # depthwise
            kernel_init=part(lecun, None, None, None, "conv"),
            rngs=rngs,
        )
        self.conv2 = nnx.Conv(
            CH,
            CH,
            kernel_size=(3, 3),
            strides=(2, 2),
            padding="SAME",
            kernel_init=part(lecun, None, None, "conv", None),
            rngs=rngs,
        )
        self.ln = nnx.LayerNorm(CH, rngs=rngs)
        self.up = nnx.ConvTranspose(CH, 6, kernel_size=(2, 2), strides=(2, 2), rngs=rngs)
        self.fc = nnx.Linear(6, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.gn(self.conv1(x)))
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(1, 1), padding="SAME")
        x = nnx.relu(self.dw(x))
        x = jflax.constrain(self.conv2(x), ("batch", None, None, None))
        x = nnx.relu(self.ln(x))
        x = nnx.avg_pool(self.up(x), window_shape=(2, 2), strides=(2, 2))
        return self.fc(x.mean(axis=(1, 2)))


def images(seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, IMG, IMG, 3)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
    return x, y


def cls_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_norms_strided_same_depthwise_transposed_convs_and_pooling(layout):
    batches = [images(i) for i in range(STEPS)]
    check(_eager(ConvNet), cls_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 7. KV-cache decoding: nnx.MultiHeadAttention(decode=True) + init_cache under jsbp.jit
# ------------------------------------------------------------------------------------------------


class DecodeLM(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs)
        self.pos = nnx.Embed(SEQ, D, embedding_init=normal, rngs=rngs)
        self.blocks = nnx.List([Block(rngs=rngs) for _ in range(2)])
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, VOCAB, kernel_init=part(normal, "embed", "vocab"), rngs=rngs)

    def __call__(self, tokens, positions, decode=False):
        x = jflax.constrain(self.embed(tokens) + self.pos(positions)[None], ACT)
        mask = None if decode else nnx.make_causal_mask(tokens)
        for blk in self.blocks:
            h = jflax.constrain(blk.ln1(x), ACT)
            x = x + jflax.constrain(blk.attn(h, mask=mask, decode=decode), ACT)
            x = blk.mlp(x)
        return self.head(jflax.constrain(self.ln(x), ACT))


def _decode_model():
    with nnx.use_eager_sharding(False):
        model = DecodeLM(rngs=nnx.Rngs(0))
    for blk in model.blocks:
        blk.attn.init_cache((BATCH, SEQ, D))
    return model


CACHE_RULES = {  # the cache's (batch, length, heads, head_dim) follows the batch and the heads
    "dp8": [(r"cached_(key|value)$", ("S(0)",))],
    "dp2tp4": [(r"cached_(key|value)$", ("S(0)", "S(2)"))],
}


def _decode_step(gdef, jit):
    """One cached decode step ``(state, tokens, position) -> (logits, state)`` under ``jit``
    (``jax.jit`` on one device, ``jsbp.jit`` on the placement)."""

    @jit
    def step(state, tok, i):
        m = nnx.merge(gdef, state)
        return m(tok, i[None], decode=True), nnx.state(m)

    return step


@pytest.mark.parametrize("cache_split", [False, True], ids=["cache_B", "cache_split"])
@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_kv_cache_decode_loop(layout, cache_split):
    toks = tokens(0)[:, :SEQ]
    # one device: the full causal forward, and Flax's own cached decode loop
    ref_model = _decode_model()
    full = np.asarray(ref_model(jnp.asarray(toks), jnp.arange(SEQ)))
    gdef, state = nnx.split(ref_model)
    ref_step = _decode_step(gdef, jax.jit)
    ref_steps = []
    for i in range(SEQ):
        logits, state = ref_step(state, jnp.asarray(toks[:, i : i + 1]), jnp.int32(i))
        ref_steps.append(np.asarray(logits[:, 0]))
    np.testing.assert_allclose(np.stack(ref_steps, 1), full, rtol=1e-5, atol=1e-5)

    # the placement: the same loop, the cache carried as global state
    plc = placement(layout)
    logical = dict(strategy(layout).logical_axes)
    strat = jflax.Strategy(
        plc, logical_axes=logical, param_sbp=CACHE_RULES[layout] if cache_split else ()
    )
    model = jflax.shard(_decode_model(), strat)
    if cache_split:
        lay = jflax.layouts(model)
        want = "(" + ", ".join(CACHE_RULES[layout][0][1]) + ")"
        assert all(v == want for k, v in lay.items() if "cached_" in k), lay
    gdef, state = nnx.split(model)
    step = _decode_step(gdef, jsbp.jit)
    got = []
    with jflax.use_strategy(strat):
        for i in range(SEQ):
            tok = jsbp.tensor(toks[:, i : i + 1], placement=plc, sbp=strat.batch_sbp(2))
            pos = jsbp.tensor(np.int32(i), placement=plc, sbp=("B",) * plc.ndim)
            logits, state = step(state, tok, pos)
            got.append(np.asarray(logits.numpy()[:, 0]))
    np.testing.assert_allclose(np.stack(got, 1), full, rtol=1e-5, atol=1e-5)
    nnx.update(model, state)
    idx = [np.asarray(jflax.gather(b.attn).cache_index.get_value()) for b in model.blocks]
    assert all(int(i) == SEQ for i in idx), idx


# ------------------------------------------------------------------------------------------------
# nnx.cond reusing the model's own layers, AdamW with a weight-decay mask
# ------------------------------------------------------------------------------------------------


class CondLM(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs)
        self.fc = nnx.Linear(D, HIDDEN, kernel_init=part(normal, "embed", "mlp"), rngs=rngs)
        self.proj = nnx.Linear(HIDDEN, D, kernel_init=part(normal, "mlp", "embed"), rngs=rngs)

    def mlp(self, x):
        return jflax.constrain(self.proj(nnx.relu(self.fc(x))), ACT)

    def __call__(self, tokens):
        x = jflax.constrain(self.embed(tokens), ACT)
        x = x + self.mlp(x)
        # a data-dependent branch that applies the same layers again (shared weights)
        x = nnx.cond(jnp.mean(x) > 0, lambda m, h: h + m.mlp(h), lambda m, h: 2.0 * h, self, x)
        return self.embed.attend(x)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_cond_with_shared_layers_and_masked_weight_decay(layout):
    batches = [tokens(i) for i in range(STEPS)]
    tx = lambda: optax.adamw(  # noqa: E731
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    )
    with warnings.catch_warnings():
        # the gradient of nnx.cond allocates residuals with lax.empty2: it has a rule
        warnings.simplefilter("error", jsbp.NoRuleWarning)
        check(_eager(CondLM), lm_loss, batches, tx, layout)
