"""A small CNN in the style of Flax's MNIST tutorial: Conv -> BatchNorm -> relu -> pooling (twice),
then Linear -> Dropout -> Linear. 8x8 single-channel images, 10 classes.

Megatron over ``tp``: conv1 splits its output channels (its BatchNorm then normalises split
channels, which is per-channel and so needs nothing), conv2 splits its input channels (a partial
sum, made whole by ``constrain``), fc1 is column-parallel, fc2 row-parallel.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import optax
from flax import nnx

import jsbp.flax as jflax

from . import part

IMG, CLASSES, BATCH = 8, 10, 16
IMAGE = ("batch", None, None, "channels")  # NHWC, channels whole

RULES = {
    "logical_axes": {"conv": "tp", "mlp": "tp", "channels": None, "embed": None},
    # batch statistics carry no logical names in Flax: conv1's follow its split channels by path
    "param_sbp": [(r"^bn1/(mean|var)$", "S(0)")],
}

lecun = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()
ones = nnx.initializers.ones_init()


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        # no conv biases before a BatchNorm: its mean subtraction would zero their gradients
        self.conv1 = nnx.Conv(
            1,
            16,
            kernel_size=(3, 3),
            use_bias=False,
            kernel_init=part(lecun, None, None, "channels", "conv"),
            rngs=rngs,
        )
        self.bn1 = nnx.BatchNorm(
            16, scale_init=part(ones, "conv"), bias_init=part(zeros, "conv"), rngs=rngs
        )
        self.conv2 = nnx.Conv(
            16,
            16,
            kernel_size=(3, 3),
            use_bias=False,
            kernel_init=part(lecun, None, None, "conv", "channels"),
            rngs=rngs,
        )
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.max_pool = partial(nnx.max_pool, window_shape=(2, 2), strides=(2, 2))
        self.fc1 = nnx.Linear(
            16 * 2 * 2,
            64,
            kernel_init=part(lecun, "embed", "mlp"),
            bias_init=part(zeros, "mlp"),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(rate=0.25, rngs=rngs)
        self.fc2 = nnx.Linear(64, CLASSES, kernel_init=part(lecun, "mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.bn1(self.conv1(x))))  # channels split over tp
        x = jflax.constrain(self.conv2(x), IMAGE)  # row-parallel: all-reduce
        x = self.max_pool(nnx.relu(self.bn2(x)))
        x = x.reshape(x.shape[0], -1)  # flatten
        x = self.dropout(nnx.relu(self.fc1(x)))
        return jflax.constrain(self.fc2(x), ("batch", None))


def make(rngs: nnx.Rngs) -> CNN:
    with nnx.use_eager_sharding(False):  # logical names are metadata only; jsbp lays values out
        return CNN(rngs=rngs)


def batch(seed: int):
    rng = np.random.default_rng(seed)
    images = rng.normal(size=(BATCH, IMG, IMG, 1)).astype(np.float32)
    labels = rng.integers(0, CLASSES, size=(BATCH,)).astype(np.int32)
    return {"image": images, "label": labels}


def loss_fn(model: CNN, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
