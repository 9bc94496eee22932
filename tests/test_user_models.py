"""Models written the way public Flax / JAX examples write them (Flax's examples, the JAX AI
stack tutorials, tunix), trained a few steps through jsbp under ``dp=8`` and a ``(2, 4)`` dp x tp
placement (Megatron logical axis rules) and compared with the same steps on one device written
in plain Flax / optax (``nnx.jit``, no jsbp).

Idioms: a VAE with the reparameterisation trick (call-time ``rngs.noise()``), a GAN step updating
two models with two optimizers, a CLIP-style contrastive loss over the global batch, LoRA
fine-tuning with a frozen base, a Gemma-style scanned decoder stack, sequence packing with segment
ids, a ResNet / U-Net with BatchNorm (train, then eval), and dynamic loss scaling.
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

# Megatron: heads / mlp / vocab / hidden channels over tp, everything else whole
RULES = {"heads": "tp", "mlp": "tp", "vocab": "tp", "conv": "tp", "latent": "tp"}
LAYOUTS = ("dp8", "dp2tp4")

normal = nnx.initializers.normal(0.02)
lecun = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()


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


def layouts(default: str):
    """Both layouts; the default run keeps ``default`` only (the other is ``slow``; JSBP_FULL=1
    runs every case)."""
    return [
        pytest.param(lay, id=lay, marks=() if lay == default else (pytest.mark.slow,))
        for lay in LAYOUTS
    ]


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
    gdef, state = nnx.split(objs_g)

    @jsbp.jit
    def step(state, real, z):
        objs = nnx.merge(gdef, state)
        losses = gan_update(*objs, real, z)
        return nnx.state(objs), losses

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
