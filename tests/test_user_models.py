"""Models written the way public Flax / JAX examples write them (Flax's examples, the JAX AI
stack tutorials, tunix), trained a few steps through jsbp under ``dp=8`` and a ``(2, 4)`` dp x tp
placement (Megatron logical axis rules) and compared with the same steps on one device written
in plain Flax / optax (``nnx.jit``, no jsbp).

Idioms: a VAE with the reparameterisation trick (call-time ``rngs.noise()``), a GAN step updating
two models with two optimizers, a CLIP-style contrastive loss over the global batch, LoRA
fine-tuning with a frozen base, a Gemma-style scanned decoder stack, sequence packing with segment
ids, a ResNet / U-Net with BatchNorm (train, then eval), dynamic loss scaling; then WGAN-GP
(second-order autodiff), an SN-GAN critic (``nnx.SpectralNorm`` / ``nnx.WeightNorm`` assign the
normalised kernel in the forward), optimizers whose state is not shaped like the parameters
(adafactor, novograd, muon, sm3), mixup across the global batch (``jax.random.beta``) and a
DDPM diffusion step (timestep embedding, a cosine noise schedule, a warmup-cosine learning rate,
gradient clipping, an EMA copy of the weights) and a Llama-style decoder (rotary embeddings,
grouped-query attention, SwiGLU, clipped adamw).
Each default run keeps one layout per idiom (the other is ``slow``: JSBP_FULL=1).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
import test_flax_idioms as idioms
from flax import nnx
from test_flax_idioms import layouts, part

import jsbp
import jsbp.flax as jflax

STEPS = 3
LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-4

# Megatron: heads / mlp / vocab / hidden channels over tp, everything else whole
RULES = {"heads": "tp", "mlp": "tp", "vocab": "tp", "conv": "tp", "latent": "tp"}

normal = nnx.initializers.normal(0.02)
lecun = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()


def strategy(layout, zero=0):
    return idioms.strategy(layout, zero, rules=RULES)


def params_of(model, wrt=nnx.Param):
    return {
        jflax.path_str(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, wrt))
    }


def _value(x):
    return float(x.numpy() if isinstance(x, jsbp.GlobalTensor) else x)


def _eager(cls, **kw):
    def make(rngs):
        with nnx.use_eager_sharding(False):
            return cls(rngs=rngs, **kw)

    return make


def train_reference(make, loss_fn, batches, tx, *, rngs=None, wrt=nnx.Param):
    """The same steps on one device: plain Flax NNX + optax, no jsbp."""
    model = make(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def train_step(model, optimizer, batch, rngs):
        args = (batch,) if rngs is None else (batch, rngs)
        diff = nnx.DiffState(0, wrt)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, *args)
        optimizer.update(model, grads)
        return loss

    losses = [
        float(train_step(model, optimizer, jax.tree.map(jnp.asarray, b), rngs)) for b in batches
    ]
    return losses, model, optimizer


def train_jsbp(make, loss_fn, batches, tx, strat, *, rngs=None, wrt=nnx.Param):
    model = make(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)
    model, optimizer = jflax.shard((model, optimizer), strat)
    step = jflax.make_train_step(loss_fn, strat)
    losses = [_value(step(model, optimizer, b, rngs)) for b in batches]
    return losses, jflax.gather(model), jflax.gather(optimizer)


def assert_close_params(pg, pr, p0=None, rtol=PARAM_RTOL):
    assert pg.keys() == pr.keys(), (sorted(pg), sorted(pr))
    scale = max(float(np.max(np.abs(v))) for v in pr.values())
    for k, v in pr.items():
        assert pg[k].dtype == v.dtype, (k, pg[k].dtype, v.dtype)
        assert pg[k].shape == v.shape, (k, pg[k].shape, v.shape)
        np.testing.assert_allclose(
            pg[k].astype(np.float32), v.astype(np.float32), rtol=rtol, atol=rtol * scale, err_msg=k
        )
    if p0 is not None:  # training moved the parameters (a frozen run would pass trivially)
        assert any(float(np.max(np.abs(pr[k] - p0[k]))) > 1e-4 for k in p0)


def assert_parity(got, ref, init, *, wrt=nnx.Param, loss_rtol=LOSS_RTOL, param_rtol=PARAM_RTOL):
    np.testing.assert_allclose(got[0], ref[0], rtol=loss_rtol, atol=0)
    assert_close_params(params_of(got[1]), params_of(ref[1]), params_of(init, wrt), param_rtol)


def check(make, loss_fn, batches, tx_fn, layout, *, rngs_fn=None, wrt=nnx.Param, **tol):
    rngs = (lambda: None) if rngs_fn is None else rngs_fn
    ref = train_reference(make, loss_fn, batches, tx_fn(), rngs=rngs(), wrt=wrt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jsbp.NoRuleWarning)
        got = train_jsbp(make, loss_fn, batches, tx_fn(), strategy(layout), rngs=rngs(), wrt=wrt)
    assert_parity(got, ref, make(nnx.Rngs(0)), wrt=wrt, **tol)
    return got, ref


def merged_step(objs, update):
    """``update(*objs, *args)`` as one ``jsbp.jit`` step over the objects' merged state, as a
    custom train step is written: (the step, the state)."""
    gdef, state = nnx.split(objs)

    @jsbp.jit
    def step(state, *args):
        objs = nnx.merge(gdef, state)
        out = update(*objs, *args)
        return nnx.state(objs), out

    return step, state


# ------------------------------------------------------------------------------------------------
# 1. VAE: reparameterisation with a call-time key (rngs.noise()), KL + reconstruction
# ------------------------------------------------------------------------------------------------

PIX, HID, LAT, BATCH = 24, 32, 8, 16


class Encoder(nnx.Module):
    def __init__(self, *, rngs):
        self.fc = nnx.Linear(PIX, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.mean = nnx.Linear(HID, LAT, kernel_init=part(lecun, "mlp", None), rngs=rngs)
        self.logvar = nnx.Linear(HID, LAT, kernel_init=part(lecun, "mlp", None), rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.fc(jflax.constrain(x, ("batch", None))))
        return self.mean(h), self.logvar(h)


class Decoder(nnx.Module):
    def __init__(self, *, rngs):
        self.fc = nnx.Linear(LAT, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.out = nnx.Linear(HID, PIX, kernel_init=part(lecun, "mlp", None), rngs=rngs)

    def __call__(self, z):
        return self.out(nnx.relu(self.fc(z)))


class VAE(nnx.Module):
    def __init__(self, *, rngs):
        self.encoder = Encoder(rngs=rngs)
        self.decoder = Decoder(rngs=rngs)

    def __call__(self, x, rngs):
        mean, logvar = self.encoder(x)
        std = jnp.exp(0.5 * logvar)
        eps = jax.random.normal(rngs.noise(), std.shape)  # the reparameterisation trick
        z = mean + std * eps
        return self.decoder(z), mean, logvar


def vae_loss(model, batch, rngs):
    logits, mean, logvar = model(batch, rngs)
    rec = optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1)
    kl = -0.5 * jnp.sum(1 + logvar - mean**2 - jnp.exp(logvar), axis=-1)
    return jnp.mean(rec + kl)


def binary_images(seed, n=BATCH):
    rng = np.random.default_rng(seed)
    return (rng.random(size=(n, PIX)) > 0.5).astype(np.float32)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_vae_reparameterisation(layout):
    batches = [binary_images(i) for i in range(STEPS)]
    got, ref = check(
        _eager(VAE),
        vae_loss,
        batches,
        lambda: optax.adam(1e-2),
        layout,
        rngs_fn=lambda: nnx.Rngs(noise=7),
    )


# ------------------------------------------------------------------------------------------------
# 2. GAN: generator and discriminator, two nnx.Optimizers, both updated in one step (jsbp.jit)
# ------------------------------------------------------------------------------------------------


class Generator(nnx.Module):
    def __init__(self, *, rngs):
        self.fc1 = nnx.Linear(LAT, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.ln = nnx.LayerNorm(HID, rngs=rngs)
        self.fc2 = nnx.Linear(HID, PIX, kernel_init=part(lecun, "mlp", None), rngs=rngs)

    def __call__(self, z):
        return jnp.tanh(self.fc2(nnx.leaky_relu(self.ln(self.fc1(z)), 0.2)))


class Discriminator(nnx.Module):
    def __init__(self, *, rngs):
        self.fc1 = nnx.Linear(PIX, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.fc2 = nnx.Linear(HID, 1, kernel_init=part(lecun, "mlp", None), rngs=rngs)

    def __call__(self, x):
        x = jflax.constrain(x, ("batch", None))
        return self.fc2(nnx.leaky_relu(self.fc1(x), 0.2))[:, 0]


def gan_update(gen, disc, g_opt, d_opt, real, z):
    """The discriminator step then the generator step (the second sees the updated D)."""

    def d_loss_fn(disc):
        fake = jax.lax.stop_gradient(gen(z))
        lr, lf = disc(real), disc(fake)
        return (
            optax.sigmoid_binary_cross_entropy(lr, jnp.ones_like(lr)).mean()
            + optax.sigmoid_binary_cross_entropy(lf, jnp.zeros_like(lf)).mean()
        )

    d_loss, d_grads = nnx.value_and_grad(d_loss_fn)(disc)
    d_opt.update(disc, d_grads)

    def g_loss_fn(gen):
        lf = disc(gen(z))
        return optax.sigmoid_binary_cross_entropy(lf, jnp.ones_like(lf)).mean()

    g_loss, g_grads = nnx.value_and_grad(g_loss_fn)(gen)
    g_opt.update(gen, g_grads)
    return d_loss, g_loss


def _gan_objects():
    with nnx.use_eager_sharding(False):
        gen, disc = Generator(rngs=nnx.Rngs(0)), Discriminator(rngs=nnx.Rngs(1))
    g_opt = nnx.Optimizer(gen, optax.adam(1e-2, b1=0.5), wrt=nnx.Param)
    d_opt = nnx.Optimizer(disc, optax.adam(1e-2, b1=0.5), wrt=nnx.Param)
    return gen, disc, g_opt, d_opt


def gan_batch(seed):
    rng = np.random.default_rng(seed)
    real = np.tanh(rng.normal(size=(BATCH, PIX))).astype(np.float32)
    return real, rng.normal(size=(BATCH, LAT)).astype(np.float32)


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_gan_two_models_two_optimizers(layout):
    batches = [gan_batch(i) for i in range(STEPS)]
    # one device
    objs = _gan_objects()
    ref_step = nnx.jit(gan_update)
    ref = [tuple(map(float, ref_step(*objs, *map(jnp.asarray, b)))) for b in batches]

    # the placement: the same update on the merged state under jsbp.jit
    strat = strategy(layout)
    objs_g = jflax.shard(_gan_objects(), strat)
    step, state = merged_step(objs_g, gan_update)

    got = []
    with jflax.use_strategy(strat), warnings.catch_warnings():
        warnings.simplefilter("error", jsbp.NoRuleWarning)
        for real, z in batches:
            real = jsbp.tensor(real, placement=strat.placement, sbp=strat.batch_sbp(2))
            z = jsbp.tensor(z, placement=strat.placement, sbp=strat.batch_sbp(2))
            state, losses = step(state, real, z)
            got.append(tuple(_value(v) for v in losses))
    nnx.update(objs_g, state)
    np.testing.assert_allclose(got, ref, rtol=LOSS_RTOL, atol=0)
    init = _gan_objects()
    for i in (0, 1):
        assert_close_params(
            params_of(jflax.gather(objs_g[i])), params_of(objs[i]), params_of(init[i])
        )
    # the optimizer states advanced once per step each
    for o in (objs_g[2], objs_g[3]):
        assert int(np.asarray(jflax.gather(o).step.get_value())) == STEPS


class Critic(nnx.Module):
    """A WGAN critic: no bias on the output (the Wasserstein loss's gradient for it is exactly zero,
    and Adam would amplify its rounding noise)."""

    def __init__(self, *, rngs):
        self.fc1 = nnx.Linear(PIX, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.fc2 = nnx.Linear(
            HID, 1, use_bias=False, kernel_init=part(lecun, "mlp", None), rngs=rngs
        )

    def __call__(self, x):
        x = jflax.constrain(x, ("batch", None))
        return self.fc2(nnx.tanh(self.fc1(x)))[:, 0]


def wgan_gp_loss(critic, batch):
    """WGAN-GP: the gradient penalty differentiates the critic's per-example input gradients
    (second-order autodiff through the model, ``jax.vmap(jax.grad(...))`` over the batch)."""
    real, fake, eps = batch
    mix = eps[:, None] * real + (1 - eps[:, None]) * fake
    g = jax.vmap(jax.grad(lambda x: critic(x[None])[0]))(mix)
    gp = jnp.mean((jnp.sqrt(jnp.sum(g**2, axis=-1) + 1e-12) - 1.0) ** 2)
    return critic(fake).mean() - critic(real).mean() + 10.0 * gp


def critic_batch(seed):
    rng = np.random.default_rng(seed)
    real, fake = rng.normal(size=(2, BATCH, PIX)).astype(np.float32)
    return real, np.tanh(fake), rng.random(BATCH).astype(np.float32)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_wgan_gradient_penalty(layout):
    batches = [critic_batch(i) for i in range(STEPS)]
    check(_eager(Critic), wgan_gp_loss, batches, lambda: optax.adam(1e-2), layout)


class SNCritic(nnx.Module):
    """An SN-GAN style discriminator: ``nnx.SpectralNorm`` (power iteration, its ``u`` / ``sigma``
    in ``batch_stats``) and ``nnx.WeightNorm`` (its scales a plain array in the module), both of
    which write the normalised kernel back into the wrapped layer during the forward pass (as
    ``nnx.grad`` writes it back, so must the step); a plain array attribute as a constant."""

    def __init__(self, *, rngs):
        self.fc1 = nnx.SpectralNorm(
            nnx.Linear(PIX, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs), rngs=rngs
        )
        self.fc2 = nnx.WeightNorm(
            nnx.Linear(HID, 1, use_bias=False, kernel_init=part(lecun, "mlp", None), rngs=rngs),
            rngs=rngs,
        )
        self.gain = jnp.linspace(0.5, 1.5, PIX)  # a plain array: NNX keeps it in the state

    def __call__(self, x):
        x = jflax.constrain(x * self.gain, ("batch", None))
        return self.fc2(nnx.leaky_relu(self.fc1(x, update_stats=True), 0.2))[:, 0]


def hinge_critic_loss(critic, batch):
    real, fake, _ = batch
    return jnp.mean(nnx.relu(1.0 - critic(real))) + jnp.mean(nnx.relu(1.0 + critic(fake)))


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_spectral_and_weight_norm_critic(layout):
    batches = [critic_batch(i) for i in range(STEPS)]
    got, ref = check(_eager(SNCritic), hinge_critic_loss, batches, lambda: optax.sgd(0.1), layout)
    # the power iteration's state and the plain array came through as on one device
    for kind in (nnx.BatchStat,):
        g = {
            jflax.path_str(p): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(got[1], kind))
        }
        r = {
            jflax.path_str(p): np.asarray(v.get_value())
            for p, v in nnx.to_flat_state(nnx.state(ref[1], kind))
        }
        assert g.keys() == r.keys() and g
        for k in r:
            np.testing.assert_allclose(g[k], r[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert isinstance(got[1].gain, jax.Array)
    np.testing.assert_array_equal(np.asarray(got[1].gain), np.asarray(ref[1].gain))


# ------------------------------------------------------------------------------------------------
# 3. CLIP-style contrastive loss: the similarity matrix of the whole global batch
# ------------------------------------------------------------------------------------------------

TXT, EMB = 20, 16


class Tower(nnx.Module):
    def __init__(self, din, *, rngs):
        self.fc1 = nnx.Linear(din, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.fc2 = nnx.Linear(HID, EMB, kernel_init=part(lecun, "mlp", None), rngs=rngs)

    def __call__(self, x):
        h = self.fc2(nnx.gelu(self.fc1(jflax.constrain(x, ("batch", None)))))
        return h / jnp.linalg.norm(h, axis=-1, keepdims=True)


class CLIP(nnx.Module):
    def __init__(self, *, rngs):
        self.image = Tower(PIX, rngs=rngs)
        self.text = Tower(TXT, rngs=rngs)
        self.log_temp = nnx.Param(jnp.log(jnp.asarray(1 / 0.07, jnp.float32)))

    def __call__(self, img, txt):
        a, b = self.image(img), self.text(txt)
        return a @ b.T * jnp.exp(self.log_temp[...])  # (global batch, global batch)


def clip_loss(model, batch):
    logits = model(*batch)
    labels = jnp.arange(logits.shape[0])  # the positives: the diagonal
    return 0.5 * (
        optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        + optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
    )


def pairs(seed, n=BATCH):
    rng = np.random.default_rng(seed)
    img = rng.normal(size=(n, PIX)).astype(np.float32)
    txt = (img[:, :TXT] + 0.3 * rng.normal(size=(n, TXT))).astype(np.float32)
    return img, txt


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_clip_contrastive_global_batch(layout):
    batches = [pairs(i) for i in range(STEPS)]
    check(_eager(CLIP), clip_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 4. LoRA fine-tuning: nnx.LoRALinear / nnx.LoRA around a frozen base, optimizer wrt=LoRAParam
# ------------------------------------------------------------------------------------------------

RANK = 4


class LoRAMLP(nnx.Module):
    def __init__(self, *, rngs):
        self.fc1 = nnx.LoRALinear(
            PIX,
            HID,
            lora_rank=RANK,
            kernel_init=part(lecun, None, "mlp"),
            b_metadata={"out_sharding": (None, "mlp")},
            rngs=rngs,
        )
        base = nnx.Linear(HID, PIX, kernel_init=part(lecun, "mlp", None), rngs=rngs)
        self.fc2 = nnx.LoRA(
            HID, RANK, PIX, base_module=base, a_metadata={"out_sharding": ("mlp", None)}, rngs=rngs
        )

    def __call__(self, x):
        x = jflax.constrain(x, ("batch", None))
        return self.fc2(nnx.relu(self.fc1(x)))


def lora_loss(model, batch):
    x, t = batch
    return jnp.mean((model(x) - t) ** 2)


def regression(seed, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, PIX)).astype(np.float32)
    return x, np.sin(x[:, ::-1]).astype(np.float32)


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_lora_frozen_base(layout):
    batches = [regression(i) for i in range(STEPS)]
    got, ref = check(
        _eager(LoRAMLP), lora_loss, batches, lambda: optax.adam(1e-2), layout, wrt=nnx.LoRAParam
    )
    # the base stayed frozen; only the adapters have optimizer state
    init = params_of(_eager(LoRAMLP)(nnx.Rngs(0)))
    lora = set(params_of(got[1], nnx.LoRAParam))
    assert lora and all("lora" in k for k in lora)
    for k, v in params_of(got[1]).items():
        if k not in lora:
            np.testing.assert_array_equal(v, init[k], err_msg=k)
    moments = [jflax.path_str(p) for p, _ in nnx.to_flat_state(nnx.state(got[2].opt_state))]
    assert not any("kernel" in m or "bias" in m for m in moments), moments


def test_lora_under_zero1_gathers_only_the_adapters():
    """ZeRO-1 updates each device's shard of the trained parameters and gathers them back at the
    step's end; the frozen base is neither sliced nor gathered."""
    batches = [regression(i) for i in range(STEPS)]
    ref = train_reference(_eager(LoRAMLP), lora_loss, batches, optax.adam(1e-2), wrt=nnx.LoRAParam)
    strat = strategy("dp8", zero=1)
    model = _eager(LoRAMLP)(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)
    model, optimizer = jflax.shard((model, optimizer), strat)
    step = jflax.make_train_step(lora_loss, strat)
    plan = step.explain(model, optimizer, batches[0])
    gathered = [b.shape for b in plan.output_boxings if b.collectives == ("all-gather",)]
    adapters = [
        np.shape(v.get_value()) for _, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    ]
    assert sorted(gathered) == sorted(adapters) and all(
        b.combined is not None for b in plan.output_boxings
    )
    losses = [_value(step(model, optimizer, b)) for b in batches]
    got = (losses, jflax.gather(model), jflax.gather(optimizer))
    assert_parity(got, ref, _eager(LoRAMLP)(nnx.Rngs(0)), wrt=nnx.LoRAParam)


# ------------------------------------------------------------------------------------------------
# 5. Gemma-style decoder: layers stacked with nnx.split_rngs + nnx.vmap, run with nnx.scan;
#    RMSNorm, GeGLU, nnx.Einsum with sharding metadata, tied embedding, logit soft-capping
# 6. sequence packing: segment ids in the attention mask, per-segment positions, a loss masked by
#    padding weights and normalised by the global count of real tokens
# ------------------------------------------------------------------------------------------------

VOCAB, SEQ, D, HEADS, HD, FF, LAYERS = 32, 8, 16, 4, 4, 32, 2
ACT = ("batch", "seq", "embed")


class GemmaLayer(nnx.Module):
    def __init__(self, *, rngs):
        self.pre_attn_norm = nnx.RMSNorm(D, rngs=rngs)
        self.qkv = nnx.Einsum(
            "BTD,SNDH->SBTNH",
            (3, HEADS, D, HD),
            kernel_init=part(normal, None, "heads", "embed", "kv"),
            rngs=rngs,
        )
        self.attn_out = nnx.Einsum(
            "BTNH,NHD->BTD",
            (HEADS, HD, D),
            kernel_init=part(normal, "heads", "kv", "embed"),
            rngs=rngs,
        )
        self.pre_ffw_norm = nnx.RMSNorm(D, rngs=rngs)
        self.gating = nnx.Einsum(
            "BTD,GDF->GBTF", (2, D, FF), kernel_init=part(normal, None, "embed", "mlp"), rngs=rngs
        )
        self.linear = nnx.Einsum(
            "BTF,FD->BTD", (FF, D), kernel_init=part(normal, "mlp", "embed"), rngs=rngs
        )
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
        h = jflax.constrain(self.pre_attn_norm(x), ACT)
        q, k, v = self.qkv(h)
        logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * HD**-0.5
        logits = jnp.where(mask[:, None], logits, -2.3819763e38)  # Gemma's K_MASK
        enc = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v)
        x = x + jflax.constrain(self.attn_out(enc), ACT)
        h = jflax.constrain(self.pre_ffw_norm(x), ACT)
        gate, up = self.gating(h)
        x = x + jflax.constrain(self.dropout(self.linear(nnx.gelu(gate) * up)), ACT)
        return x


class Gemma(nnx.Module):
    def __init__(self, *, rngs):
        self.embedder = nnx.Embed(
            VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs
        )
        self.pos = nnx.Embed(SEQ, D, embedding_init=normal, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(axis_size=LAYERS, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(rngs):
            return GemmaLayer(rngs=rngs)

        self.layers = create(rngs)
        self.final_norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens, segment_ids=None, positions=None):
        t = tokens.shape[1]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), tokens.shape)
        x = self.embedder(tokens) * jnp.sqrt(D).astype(jnp.float32) + self.pos(positions)
        x = jflax.constrain(x, ACT)
        mask = jnp.tril(jnp.ones((t, t), jnp.bool_))[None]
        if segment_ids is not None:
            mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, layer):
            return layer(x, mask)

        x = body(x, self.layers)
        logits = self.embedder.attend(self.final_norm(x))
        return jnp.tanh(logits / 30.0) * 30.0  # Gemma 2's final logit soft-capping


def tokens(seed, batch=BATCH, seq=SEQ + 1):
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, size=(batch, 1))
    steps = rng.integers(1, 4, size=(batch, seq - 1))
    return (np.concatenate([start, start + np.cumsum(steps, axis=1)], axis=1) % VOCAB).astype(
        np.int32
    )


def lm_loss(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_gemma_scanned_decoder(layout):
    batches = [tokens(i) for i in range(STEPS)]
    got, ref = check(_eager(Gemma), lm_loss, batches, lambda: optax.adamw(1e-2), layout)
    # every layer's dropout stream advanced once per step, as on one device
    counts = nnx.state(got[1], nnx.RngCount)
    ref_counts = nnx.state(ref[1], nnx.RngCount)
    assert len(nnx.to_flat_state(counts)) == len(nnx.to_flat_state(ref_counts)) > 0
    for (p, a), (_, b) in zip(nnx.to_flat_state(counts), nnx.to_flat_state(ref_counts)):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), str(p))


def packed(seed, batch=BATCH, seq=SEQ):
    """Rows packing 1-3 documents, then padding (segment 0): tokens, targets, segment ids,
    per-segment positions and loss weights (0 on padding), as packed pre-training data carries."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, VOCAB, size=(batch, seq + 1)).astype(np.int32)
    seg = np.zeros((batch, seq), np.int32)
    pos = np.zeros((batch, seq), np.int32)
    for r in range(batch):
        t, s = 0, 1
        end = int(rng.integers(seq // 2, seq + 1))  # the rest is padding
        while t < end:
            n = min(int(rng.integers(2, 5)), end - t)
            seg[r, t : t + n], pos[r, t : t + n] = s, np.arange(n)
            t, s = t + n, s + 1
    weights = (seg > 0).astype(np.float32)
    return toks[:, :-1], toks[:, 1:], seg, pos, weights


def packed_loss(model, batch):
    x, y, seg, pos, w = batch
    logits = model(x, segment_ids=seg, positions=pos)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)  # the global count of real tokens


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_sequence_packing_segment_ids(layout):
    batches = [packed(i) for i in range(STEPS)]
    # the rows hold different numbers of real tokens: a per-device mean would differ
    assert len({int(r.sum()) for r in batches[0][4]}) > 1
    check(_eager(Gemma), packed_loss, batches, lambda: optax.adam(1e-2), layout)


# ------------------------------------------------------------------------------------------------
# 7. ResNet blocks with BatchNorm (train, then eval with model.eval()), ConvTranspose, residual
#    adds and a U-Net skip concatenation
# ------------------------------------------------------------------------------------------------

IMG, CIN, CH, CLASSES = 8, 3, 8, 5


class ResBlock(nnx.Module):
    def __init__(self, ch, *, rngs):
        conv = lambda: nnx.Conv(  # noqa: E731
            ch, ch, (3, 3), padding="SAME", use_bias=False,
            kernel_init=part(lecun, None, None, None, "conv"), rngs=rngs,
        )  # fmt: skip
        self.conv1, self.bn1 = conv(), nnx.BatchNorm(ch, momentum=0.9, rngs=rngs)
        self.conv2, self.bn2 = conv(), nnx.BatchNorm(ch, momentum=0.9, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.bn1(self.conv1(x)))
        return nnx.relu(x + self.bn2(self.conv2(h)))


class UNet(nnx.Module):
    def __init__(self, *, rngs):
        self.stem = nnx.Conv(CIN, CH, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(CH, momentum=0.9, rngs=rngs)
        self.down = nnx.Conv(CH, 2 * CH, (3, 3), strides=(2, 2), padding="SAME", rngs=rngs)
        self.mid = nnx.List([ResBlock(2 * CH, rngs=rngs) for _ in range(2)])
        self.up = nnx.ConvTranspose(2 * CH, CH, (2, 2), strides=(2, 2), rngs=rngs)
        self.fuse = nnx.Conv(2 * CH, CH, (3, 3), padding="SAME", rngs=rngs)
        self.head = nnx.Conv(CH, CLASSES, (1, 1), rngs=rngs)

    def __call__(self, x):
        x = jflax.constrain(x, ("batch", None, None, None))
        skip = nnx.relu(self.stem_bn(self.stem(x)))
        h = nnx.relu(self.down(skip))
        for blk in self.mid:
            h = blk(h)
        h = self.up(h)
        h = jnp.concatenate([h, skip], axis=-1)  # the U-Net skip connection
        return self.head(nnx.relu(self.fuse(h)))


def segmentation(seed, n=BATCH):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, IMG, IMG, CIN)).astype(np.float32)
    y = (np.abs(x).argmax(-1) + (x.sum(-1) > 0) * 2).astype(np.int32) % CLASSES
    return x, y


seg_loss = idioms.cls_loss  # integer-label cross-entropy (per pixel here)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_resnet_unet_batchnorm_train_then_eval(layout):
    batches = [segmentation(i) for i in range(STEPS)]
    got, ref = check(_eager(UNet), seg_loss, batches, lambda: optax.adam(1e-2), layout)
    # the running statistics are those of the global batches
    stats_g = {
        jflax.path_str(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(got[1], nnx.BatchStat))
    }
    stats_r = {
        jflax.path_str(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(ref[1], nnx.BatchStat))
    }
    assert stats_g.keys() == stats_r.keys() and stats_g
    for k in stats_r:
        np.testing.assert_allclose(stats_g[k], stats_r[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # an eval step: model.eval() (BatchNorm's use_running_average), on the placement
    x, y = segmentation(10)
    ref_model = ref[1]
    ref_model.eval()
    want = float(nnx.jit(seg_loss)(ref_model, (jnp.asarray(x), jnp.asarray(y))))
    strat = strategy(layout)
    model = jflax.shard(got[1], strat)
    model.eval()
    batch = jflax.make_train_step(seg_loss, strat).put_batch((x, y))
    with jflax.use_strategy(strat):
        loss = jsbp.jit(seg_loss)(model, batch)
    np.testing.assert_allclose(_value(loss), want, rtol=LOSS_RTOL)
    # eval mode left the statistics alone
    after = nnx.state(jflax.gather(model), nnx.BatchStat)
    for p, v in nnx.to_flat_state(after):
        np.testing.assert_array_equal(np.asarray(v.get_value()), stats_g[jflax.path_str(p)])


# ------------------------------------------------------------------------------------------------
# 8. dynamic loss scaling: scale the loss, unscale the gradients, skip the update (and back the
#    scale off) when the gradients are not finite
# ------------------------------------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, *, rngs):
        self.fc1 = nnx.Linear(PIX, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.fc2 = nnx.Linear(HID, PIX, kernel_init=part(lecun, "mlp", None), rngs=rngs)

    def __call__(self, x):
        x = jflax.constrain(x, ("batch", None))
        return self.fc2(nnx.gelu(self.fc1(x)))


class LossScale(nnx.Module):
    def __init__(self, scale):
        self.scale = nnx.Variable(jnp.asarray(scale, jnp.float32))
        self.skipped = nnx.Variable(jnp.asarray(0, jnp.int32))


# so large that the squared gradient norm overflows float32 on the first step: that step is
# skipped and the scale backed off (by 2**-90, to reach a safe scale at once); then it grows 2x
SCALE0, BACKOFF, GROWTH = 2.0**100, 2.0**-90, 2.0


def scaled_update(model, optimizer, ls, batch):
    def scaled_loss(model):
        loss = lora_loss(model, batch)
        return loss * ls.scale[...], loss

    scaled_grads, loss = nnx.grad(scaled_loss, has_aux=True)(model)
    finite = jnp.isfinite(optax.tree.norm(scaled_grads))
    grads = jax.tree.map(lambda g: g / ls.scale[...], scaled_grads)
    before = nnx.state((model, optimizer))
    optimizer.update(model, grads)
    after = nnx.state((model, optimizer))
    nnx.update(
        (model, optimizer), jax.tree.map(lambda a, b: jnp.where(finite, a, b), after, before)
    )
    ls.scale[...] = jnp.where(finite, ls.scale[...] * GROWTH, ls.scale[...] * BACKOFF)
    ls.skipped[...] += jnp.where(finite, 0, 1)
    return loss


def _scaled_objects():
    model = _eager(MLP)(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param), LossScale(SCALE0)


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_dynamic_loss_scaling_skips_non_finite(layout):
    batches = [regression(i) for i in range(STEPS)]
    ref = _scaled_objects()
    ref_step = nnx.jit(scaled_update)
    ref_losses = [float(ref_step(*ref, jax.tree.map(jnp.asarray, b))) for b in batches]
    assert int(ref[2].skipped[...]) == 1  # the first step was skipped on one device

    strat = strategy(layout)
    objs = jflax.shard(_scaled_objects(), strat)
    step, state = merged_step(objs, scaled_update)

    put = jflax.make_train_step(lora_loss, strat).put_batch
    losses = []
    with jflax.use_strategy(strat), warnings.catch_warnings():
        warnings.simplefilter("error", jsbp.NoRuleWarning)
        for b in batches:
            state, loss = step(state, put(b))
            losses.append(_value(loss))
    nnx.update(objs, state)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    ls = jflax.gather(objs[2])
    assert int(np.asarray(ls.skipped.get_value())) == 1
    assert float(np.asarray(ls.scale.get_value())) == float(ref[2].scale[...])
    assert int(np.asarray(jflax.gather(objs[1]).step.get_value())) == int(ref[1].step[...])
    assert_close_params(
        params_of(jflax.gather(objs[0])), params_of(ref[0]), params_of(_scaled_objects()[0])
    )


# ------------------------------------------------------------------------------------------------
# 9. optimizers whose state is not shaped like the parameters: optax.adafactor's factored second
#    moments (T5 / big_vision), novograd's per-layer scalars; and state leaves that are not one
#    array: muon's masked adam branch (optax.MaskedNode), sm3's list of accumulators. Flax copies
#    each parameter's sharding metadata onto every state leaf of that parameter.
# ------------------------------------------------------------------------------------------------

FACTORED = {
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
    "novograd": lambda: optax.novograd(1e-2),
    "muon": lambda: optax.contrib.muon(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
}


@pytest.mark.parametrize("tx", sorted(FACTORED))
@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_optimizer_state_shaped_unlike_parameters(layout, tx):
    batches = [regression(i) for i in range(STEPS)]
    got, _ = check(_eager(MLP), lora_loss, batches, FACTORED[tx], layout)
    if tx == "adafactor":  # the factored row / column statistics of fc1's kernel
        v_row = nnx.state(got[2].opt_state)[0]["v_row"]["fc1"]["kernel"].get_value()
        assert np.shape(v_row) == (PIX,)


# ------------------------------------------------------------------------------------------------
# 10. mixup: partners drawn from the whole global batch, a Beta-distributed weight
# ------------------------------------------------------------------------------------------------


def mixup_loss(model, batch, rngs):
    """mixup: every example mixed with a random partner from the whole global batch (a random
    permutation of the batch dim), weight drawn from Beta(0.4, 0.4) (``random_gamma``)."""
    x, t = batch
    perm = jax.random.permutation(rngs.mix(), x.shape[0])
    lam = jax.random.beta(rngs.mix(), 0.4, 0.4)
    xm, tm = lam * x + (1 - lam) * x[perm], lam * t + (1 - lam) * t[perm]
    return jnp.mean((model(xm) - tm) ** 2)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_mixup_across_the_global_batch(layout):
    batches = [regression(i) for i in range(STEPS)]
    # check() turns a NoRuleWarning into an error: random_gamma has a rule
    check(_eager(MLP), mixup_loss, batches, lambda: optax.adam(1e-2), layout,
          rngs_fn=lambda: nnx.Rngs(mix=5))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# 11. diffusion (DDPM): a timestep-conditioned denoiser, noise and timesteps drawn per step from
#     nnx.Rngs, a cosine noise schedule gathered by timestep, optax.chain(clip_by_global_norm,
#     adamw(warmup_cosine_decay_schedule)), and an EMA copy of the weights updated after each
#     step, in one jsbp.jit step over the merged state (as the GAN's)
# ------------------------------------------------------------------------------------------------

TSTEPS, TDIM = 50, 16


def cosine_alpha_bar(n=TSTEPS, s=0.008):
    t = np.arange(n + 1) / n
    f = np.cos((t + s) / (1 + s) * np.pi / 2) ** 2
    return np.clip(f[1:] / f[0], 1e-4, 1.0).astype(np.float32)


def timestep_embedding(t, dim=TDIM):
    half = dim // 2
    freqs = jnp.exp(-jnp.log(10_000.0) * jnp.arange(half) / half)
    args = t.astype(jnp.float32)[:, None] * freqs[None, :]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


class Denoiser(nnx.Module):
    def __init__(self, *, rngs):
        self.t_mlp = nnx.Linear(TDIM, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.inp = nnx.Linear(PIX, HID, kernel_init=part(lecun, None, "mlp"), rngs=rngs)
        self.norm = nnx.LayerNorm(HID, rngs=rngs)
        self.hidden = nnx.Linear(HID, HID, kernel_init=part(lecun, "mlp", None), rngs=rngs)
        self.out = nnx.Linear(HID, PIX, kernel_init=part(zeros, None, None), rngs=rngs)

    def __call__(self, x, t):
        h = self.inp(x) + nnx.silu(self.t_mlp(timestep_embedding(t)))
        h = h + self.hidden(nnx.silu(self.norm(h)))
        return self.out(nnx.silu(h))


def ddpm_loss(model, x0, rngs):
    t = jax.random.randint(rngs.timestep(), (x0.shape[0],), 0, TSTEPS)
    noise = jax.random.normal(rngs.noise(), x0.shape)
    ab = jnp.asarray(cosine_alpha_bar())[t][:, None]
    xt = jnp.sqrt(ab) * x0 + jnp.sqrt(1.0 - ab) * noise
    return jnp.mean((model(xt, t) - noise) ** 2)


def ddpm_update(model, ema, optimizer, rngs, x0, decay=0.9):
    loss, grads = nnx.value_and_grad(ddpm_loss)(model, x0, rngs)
    optimizer.update(model, grads)
    new = jax.tree.map(
        lambda e, p: decay * e + (1.0 - decay) * p,
        nnx.state(ema, nnx.Param),
        nnx.state(model, nnx.Param),
    )
    nnx.update(ema, new)
    return loss


def _ddpm_objects():
    with nnx.use_eager_sharding(False):
        model = Denoiser(rngs=nnx.Rngs(0))
    ema = nnx.clone(model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    return model, ema, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.Rngs(timestep=3, noise=4)


@pytest.mark.parametrize("layout", layouts("dp8"))
def test_diffusion_ddpm_with_ema_and_a_schedule(layout):
    batches = [np.tanh(regression(i)[0]) for i in range(STEPS + 1)]
    objs = _ddpm_objects()  # one device
    ref_step = nnx.jit(ddpm_update)
    ref = [float(ref_step(*objs, jnp.asarray(b))) for b in batches]

    strat = strategy(layout)
    *sharded, rngs = _ddpm_objects()
    objs_g = (*jflax.shard(tuple(sharded), strat), rngs)
    step, state = merged_step(objs_g, ddpm_update)

    got = []
    with jflax.use_strategy(strat), warnings.catch_warnings():
        warnings.simplefilter("error", jsbp.NoRuleWarning)
        for b in batches:
            x0 = jsbp.tensor(b, placement=strat.placement, sbp=strat.batch_sbp(2))
            state, loss = step(state, x0)
            got.append(_value(loss))
        counts = jsbp.debug.count_collectives(step, state, x0)
        assert jsbp.explain(step, state, x0).collectives() == counts
    if layout == "dp8":  # the gradients' all-reduces, combined; noise, norm, EMA all local
        assert {k: v for k, v in counts.items() if v} == {"all-reduce": 1}
    nnx.update(objs_g, state)
    np.testing.assert_allclose(got, ref, rtol=LOSS_RTOL, atol=0)
    init = _ddpm_objects()[0]
    for i in (0, 1):  # the model and its EMA copy, which trails it
        assert_close_params(params_of(jflax.gather(objs_g[i])), params_of(objs[i]), params_of(init))
    gap = [
        float(np.max(np.abs(a - b)))
        for a, b in zip(params_of(objs[0]).values(), params_of(objs[1]).values())
    ]
    assert max(gap) > 1e-4  # (the EMA is not the model itself)
    assert int(np.asarray(jflax.gather(objs_g[2]).step.get_value())) == len(batches)


# ------------------------------------------------------------------------------------------------
# 12. Llama-style decoder (as tunix's llama3 writes it): RMSNorm, rotary position embeddings,
#     grouped-query attention (fewer key / value heads, repeated to the query heads), a SwiGLU MLP,
#     unrolled layers in an nnx.List, an untied LM head, and optax.chain(clip_by_global_norm,
#     adamw(warmup_cosine_decay_schedule, weight_decay))
# ------------------------------------------------------------------------------------------------

KV_HEADS = 2


def rotary(x, positions, base=10_000.0):
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None].astype(jnp.float32) * freq  # (batch, seq, half)
    sin, cos = jnp.sin(angle)[:, :, None], jnp.cos(angle)[:, :, None]
    first, second = x[..., :half], x[..., half:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class LlamaAttention(nnx.Module):
    def __init__(self, *, rngs):
        def proj(heads):
            return nnx.LinearGeneral(
                D, (heads, HD), use_bias=False, kernel_init=part(lecun, "embed", "heads", "kv"),
                rngs=rngs,
            )  # fmt: skip

        self.q, self.k, self.v = proj(HEADS), proj(KV_HEADS), proj(KV_HEADS)
        self.o = nnx.LinearGeneral(
            (HEADS, HD), D, axis=(-2, -1), use_bias=False,
            kernel_init=part(lecun, "heads", "kv", "embed"), rngs=rngs,
        )  # fmt: skip

    def __call__(self, x, positions):
        q = rotary(self.q(x), positions)
        k = rotary(self.k(x), positions)
        v = self.v(x)
        k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)  # each kv head serves a group of queries
        v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
        t = x.shape[1]
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / jnp.sqrt(HD).astype(x.dtype)
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, jnp.finfo(x.dtype).min)
        return self.o(jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v))


class LlamaBlock(nnx.Module):
    def __init__(self, *, rngs):
        self.attn_norm = nnx.RMSNorm(D, epsilon=1e-5, rngs=rngs)
        self.attn = LlamaAttention(rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(D, epsilon=1e-5, rngs=rngs)
        mlp_in = part(lecun, "embed", "mlp")
        self.gate = nnx.Linear(D, FF, use_bias=False, kernel_init=mlp_in, rngs=rngs)
        self.up = nnx.Linear(D, FF, use_bias=False, kernel_init=mlp_in, rngs=rngs)
        self.down = nnx.Linear(
            FF, D, use_bias=False, kernel_init=part(lecun, "mlp", "embed"), rngs=rngs
        )

    def __call__(self, x, positions):
        x = x + self.attn(self.attn_norm(x), positions)
        h = self.mlp_norm(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
    def __init__(self, *, rngs):
        self.embed = nnx.Embed(VOCAB, D, embedding_init=part(normal, "vocab", "embed"), rngs=rngs)
        self.layers = nnx.List([LlamaBlock(rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, epsilon=1e-5, rngs=rngs)
        self.lm_head = nnx.Linear(
            D, VOCAB, use_bias=False, kernel_init=part(normal, "embed", "vocab"), rngs=rngs
        )

    def __call__(self, tokens):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.lm_head(self.norm(x))


def _llama_tx():
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))


@pytest.mark.parametrize("layout", layouts("dp2tp4"))
def test_llama_gqa_rope_swiglu_clipped_adamw(layout):
    batches = [tokens(i) for i in range(STEPS)]
    make = _eager(Llama)
    ref = train_reference(make, lm_loss, batches, _llama_tx())
    strat = strategy(layout)
    model = make(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, _llama_tx(), wrt=nnx.Param)
    model, optimizer = jflax.shard((model, optimizer), strat)
    step = jflax.make_train_step(lm_loss, strat)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jsbp.NoRuleWarning)
        losses = [_value(step(model, optimizer, b)) for b in batches]
    assert step.explain(model, optimizer, batches[0]).collectives() == step.count_collectives(
        model, optimizer, batches[0]
    )
    got = (losses, jflax.gather(model), jflax.gather(optimizer))
    assert_parity(got, ref, make(nnx.Rngs(0)))
