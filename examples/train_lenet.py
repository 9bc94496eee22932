"""OneFlow's LeNet on scikit-learn's 8x8 digits, in the consistent view and in the mirrored view.

    python examples/train_lenet.py --view consistent   # data parallel: batch S(0), parameters B
    python examples/train_lenet.py --view mirrored     # one list entry per device, gradients averaged
    python examples/train_lenet.py --view both         # both, and check they end with equal parameters

The consistent view is OneFlow's ``consistent_strategy.py``: the train step is written for the
whole batch and jsbp runs it on 8 devices (the gradient, a partial sum, is all-reduced once).
The mirrored view is OneFlow's ``mirrored_strategy.py``: the batch is cut into one piece per
device by hand, the step sees one device's piece, and ``jsbp.mirrored_mean`` averages the
gradients. With equal pieces the mean of the per-device mean losses is the global mean loss, so
both views compute the same update and end with the same parameters (to fp32 rounding).

Differences from the seed: 8x8x1 images instead of 28x28x1 (so 2x2x64 features reach the dense
layer), no dropout (its random masks would differ between the views).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time


def configure_devices(n: int) -> None:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # a backend already runs (e.g. under pytest)


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jsbp  # noqa: E402
import jsbp.flax as jflax  # noqa: E402

MOMENTUM = 0.0  # the seed's optimizer: SGD(0.1, momentum=0)


class LeNet(nnx.Module):
    """conv 5x5x32 - pool - conv 5x5x64 - pool - dense 512 - dense 10 (the seed's ``lenet``)."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.truncated_normal(0.1)
        self.conv1 = nnx.Conv(1, 32, (5, 5), padding="SAME", kernel_init=init, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (5, 5), padding="SAME", kernel_init=init, rngs=rngs)
        self.hidden = nnx.Linear(2 * 2 * 64, 512, kernel_init=init, rngs=rngs)
        self.out = nnx.Linear(512, 10, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        x = _pool(jax.nn.relu(self.conv1(x)))
        x = _pool(jax.nn.relu(self.conv2(x)))
        x = jax.nn.relu(self.hidden(x.reshape(x.shape[0], -1)))
        return self.out(x)


def _pool(x):
    """2x2 max pooling, stride 2 (``max_pool2d(ksize=2, strides=2)`` on even sizes), written as
    reshape + max: jsbp has no SBP rule for ``reduce_window_max`` yet."""
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


def loss_fn(model: LeNet, batch):
    images, labels = batch
    return jflax.softmax_cross_entropy(model(images), labels)


def load_digits(seed: int = 0):
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1]; a fixed 80/20 train/test split."""
    from sklearn.datasets import load_digits as _load

    d = _load()
    x = (d.images.astype(np.float32) / 16.0)[..., None]
    y = d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    n_test = len(y) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def batches(x, y, batch: int, seed: int):
    """Endless shuffled epochs of full batches (same order for both views)."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(y))
        for i in range(0, len(y) - batch + 1, batch):
            idx = order[i : i + batch]
            yield x[idx], y[idx]


def init(seed: int, lr: float):
    model = LeNet(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.sgd(lr, momentum=MOMENTUM), wrt=nnx.Param)


def accuracy(model: LeNet, x, y) -> float:
    logits = nnx.jit(lambda m, a: m(a))(model, jnp.asarray(x))
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


# ----------------------------------------------------------------------------------------------
# the two views
# ----------------------------------------------------------------------------------------------


def train_consistent(placement, steps: int, *, seed=0, batch=64, lr=0.1, data=None, on_step=None):
    """Data parallel in the consistent view; returns (plain model, losses)."""
    (x, y), _ = data or load_digits(seed)
    model, optimizer = init(seed, lr)
    strategy = jflax.Strategy(placement, data_axis=placement.axis_names[0])
    model, optimizer = jflax.shard((model, optimizer), strategy)
    step = jflax.make_train_step(loss_fn, strategy)
    losses = []
    for i, b in zip(range(steps), batches(x, y, batch, seed)):
        losses.append(float(step(model, optimizer, b).numpy()))
        if on_step:
            on_step(i, losses[-1])
    return jflax.gather(model), losses


def train_mirrored(placement, steps: int, *, seed=0, batch=64, lr=0.1, data=None, on_step=None):
    """The seed's mirrored strategy: lists in (one piece per device), gradients averaged."""
    (x, y), _ = data or load_digits(seed)
    n = placement.size
    if batch % n:
        raise SystemExit(
            f"--batch {batch} must be a multiple of the {n} devices in the mirrored view"
        )
    model, optimizer = init(seed, lr)
    graphdef, state = nnx.split((model, optimizer))

    def train_job(state, images, labels):  # runs on ONE device's piece
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, (images, labels))
        optimizer.update(model, jsbp.mirrored_mean(grads))  # average gradients across devices
        return nnx.state((model, optimizer)), loss

    job = jsbp.mirrored(train_job, placement=placement)
    states = [state] * n  # one mirrored copy per device
    losses = []
    for i, (bx, by) in zip(range(steps), batches(x, y, batch, seed)):
        images_list = np.split(bx, n)  # one piece per device, in placement order
        labels_list = np.split(by, n)
        states, loss_list = job(states, images_list, labels_list)
        losses.append(float(np.mean([np.asarray(v) for v in loss_list])))
        if on_step:
            on_step(i, losses[-1])
    model, _ = nnx.merge(graphdef, jax.device_get(states[0]))
    return model, losses


def max_param_diff(a: LeNet, b: LeNet) -> float:
    la = jax.tree.leaves(nnx.state(a, nnx.Param))
    lb = jax.tree.leaves(nnx.state(b, nnx.Param))
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(la, lb))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--view", choices=("consistent", "mirrored", "both"), default="consistent")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    configure_devices(args.devices)
    placement = jsbp.placement(
        jax.devices()[0].platform, [d.id for d in jax.devices()[: args.devices]], axis_names=("dp",)
    )
    data = load_digits(args.seed)
    (_, _), (xt, yt) = data
    print(f"digits: {len(data[0][1])} train / {len(yt)} test images, {placement}")
    views = ("consistent", "mirrored") if args.view == "both" else (args.view,)
    models = {}
    for view in views:
        fn = train_consistent if view == "consistent" else train_mirrored
        t = time.perf_counter()

        def report(i, loss, view=view):
            if i % 50 == 0 or i == args.steps - 1:
                print(f"[{view}] step {i:4d} loss {loss:.4f}", flush=True)

        model, _ = fn(
            placement,
            args.steps,
            seed=args.seed,
            batch=args.batch,
            lr=args.lr,
            data=data,
            on_step=report,
        )
        models[view] = model
        print(
            f"[{view}] test accuracy {accuracy(model, xt, yt):.4f} ({time.perf_counter() - t:.1f}s)"
        )
    if len(models) == 2:
        d = max_param_diff(models["consistent"], models["mirrored"])
        print(f"max |consistent - mirrored| over all parameters: {d:.2e}")
        if not math.isfinite(d) or d > 1e-4:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
