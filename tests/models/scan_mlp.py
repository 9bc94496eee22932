"""A scan-over-layers MLP in the style of Flax's ``nnx_toy_examples/06_scan_over_layers.py``:
``Block`` (Linear -> BatchNorm -> gelu -> Dropout -> Linear, residual) is created once per layer
with ``nnx.split_rngs`` + ``nnx.vmap`` (parameters, batch statistics and dropout RNG state gain a
leading ``layers`` axis, named through ``transform_metadata``) and applied with ``nnx.scan``,
which threads the updated batch statistics and RNG counters out of the loop. A regression task.

Megatron over ``tp``: each block's first linear is column-parallel (its BatchNorm normalises
split features), the second row-parallel; the scanned carry is whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jsbp.flax as jflax

from . import part

DIN, D, HIDDEN, LAYERS, BATCH, DROPOUT = 8, 32, 64, 2, 16, 0.1

RULES = {
    "logical_axes": {"mlp": "tp", "embed": None, "layers": None},
    # BatchStat leaves carry no logical names: the hidden BatchNorm's follow its split features
    "param_sbp": [(r"^layers/bn/(mean|var)$", "S(1)")],
}

lecun = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()
ones = nnx.initializers.ones_init()


class Block(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        # no bias before the BatchNorm: its mean subtraction would zero that gradient
        self.fc1 = nnx.Linear(
            dim, hidden, use_bias=False, kernel_init=part(lecun, "embed", "mlp"), rngs=rngs
        )
        self.bn = nnx.BatchNorm(
            hidden, scale_init=part(ones, "mlp"), bias_init=part(zeros, "mlp"), rngs=rngs
        )
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)
        self.fc2 = nnx.Linear(
            hidden,
            dim,
            kernel_init=part(lecun, "mlp", "embed"),
            bias_init=part(zeros, "embed"),
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.dropout(nnx.gelu(self.bn(self.fc1(x))))
        return x + jflax.constrain(self.fc2(h), ("batch", "embed"))


class ScanMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(DIN, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(axis_size=LAYERS, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_block(rngs: nnx.Rngs):
            return Block(D, HIDDEN, rngs=rngs)

        self.layers = create_block(rngs)
        self.out = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan
        def scan_fn(x: jax.Array, block: Block):
            return block(x), None

        x = jflax.constrain(self.inp(x), ("batch", "embed"))
        x, _ = scan_fn(x, self.layers)
        return self.out(x)[:, 0]


def make(rngs: nnx.Rngs) -> ScanMLP:
    with nnx.use_eager_sharding(False):
        return ScanMLP(rngs=rngs)


def batch(seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(BATCH, DIN)).astype(np.float32)
    y = np.sin(x.sum(axis=1)).astype(np.float32)
    return x, y


def loss_fn(model: ScanMLP, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)
