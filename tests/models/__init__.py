"""A zoo of small Flax NNX models written the way Flax's own examples write them (issue 18).

Each module exposes

* ``make(rngs) -> model``: the model in training mode (dropout on, batch statistics updated);
  dropout layers hold their own ``rngs`` stream (``nnx.Dropout(rate, rngs=rngs)``, as the
  jax-ai-stack ViT / miniGPT tutorials do), so ``loss_fn(model, batch)`` needs no key argument
  and the RNG counters travel with the model state through the train step;
* ``batch(seed) -> batch``: a host batch (numpy arrays), the same for every layout;
* ``loss_fn(model, batch) -> scalar``;
* ``RULES``: the tensor-parallel (Megatron) layout rules —
  ``{"logical_axes": {name: "tp" | None}, "param_sbp": [(regex, sbp on the tp axis)]}``;
  ``tests/test_model_zoo.py`` turns them into a ``jsbp.flax.Strategy`` for each placement.

Sizes are tiny (d_model 32, 2 layers, batch 16) so a step compiles in seconds on CPU.

``minigpt.py`` and ``gemma.py`` are not zoo members: they rebuild Flax's published miniGPT
tutorial and Gemma example (sharded variant) with their own explicit-sharding idioms, for
``tests/test_minigpt.py`` and ``tests/test_gemma_sharded.py``.
"""

from __future__ import annotations

import importlib

import numpy as np
from flax import nnx

MODELS = ("cnn", "vit", "lstm", "scan_mlp", "decoder_lm", "moe")

ACT = ("batch", "seq", "embed")  # a sequence model's residual stream


def part(init, *names):
    """Flax's logical-axis metadata on an initializer (``nnx.with_partitioning``)."""
    return nnx.with_partitioning(init, names)


def token_stream(seed: int, vocab: int, batch: int, seq: int):
    """A learnable token batch ``(batch, seq + 1)``: each token is the previous one plus a small
    step, mod ``vocab`` (the sequence models' data)."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, size=(batch, 1))
    steps = rng.integers(1, 4, size=(batch, seq))
    return (np.concatenate([start, start + np.cumsum(steps, axis=1)], axis=1) % vocab).astype(
        np.int32
    )


def load(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def param_values(model) -> dict:
    """Every ``nnx.Param`` of ``model`` as NumPy, by path (a global tensor's logical value)."""
    import jsbp

    out = {}
    for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        x = v.get_value()
        out[k] = np.asarray(x.numpy() if isinstance(x, jsbp.GlobalTensor) else x)
    return out
