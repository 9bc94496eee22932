"""The mirrored view: lists in, lists out, one entry per device in placement order; devices talk
only through all_reduce / mirrored_mean; conversions to the consistent view are from_local /
to_local. The seed's mirrored training equals the consistent view and one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jsbp
import jsbp.flax as jflax


@pytest.fixture(scope="module")
def p8():
    return jsbp.placement("cpu", list(range(8)), axis_names=("dp",))


@pytest.fixture(scope="module")
def p24():
    return jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("a", "b"))


def test_lists_in_lists_out_in_placement_order(p8):
    xs = [np.full((2, 3), i, np.float32) for i in range(8)]
    w = np.arange(12, dtype=np.float32).reshape(3, 4)

    f = jsbp.mirrored(lambda x, w: x @ w + 1, placement=p8)
    ys = f(xs, w)  # w is not a list: every device sees the same value
    assert isinstance(ys, list) and len(ys) == 8
    for i, (y, dev) in enumerate(zip(ys, p8.devices.reshape(-1))):
        np.testing.assert_allclose(np.asarray(y), xs[i] @ w + 1)
        assert y.devices() == {dev}  # each entry stays on its device
    # outputs feed back in without copies and the order is kept
    zs = f(ys, np.eye(4, dtype=np.float32))
    np.testing.assert_allclose(np.asarray(zs[5]), np.asarray(ys[5]) + 1)


def test_placement_order_follows_ranks_not_device_ids():
    p = jsbp.placement("cpu", [7, 6, 5, 4, 3, 2, 1, 0])
    f = jsbp.mirrored(lambda x: x * 2, placement=p)
    ys = f([np.float32(i) for i in range(8)])
    assert [float(y) for y in ys] == [2.0 * i for i in range(8)]
    assert [next(iter(y.devices())).id for y in ys] == [7, 6, 5, 4, 3, 2, 1, 0]


def test_tuple_outputs_come_back_as_one_list_per_output(p8):
    f = jsbp.mirrored(lambda x: (x.sum(), {"twice": 2 * x}), placement=p8)
    sums, dicts = f([np.arange(3.0, dtype=np.float32) + i for i in range(8)])
    assert len(sums) == len(dicts) == 8
    assert [float(s) for s in sums] == [3.0 + 3 * i for i in range(8)]
    assert sums[0].shape == ()
    np.testing.assert_allclose(np.asarray(dicts[2]["twice"]), 2 * (np.arange(3.0) + 2))


@pytest.mark.parametrize(
    "op,ref", [("sum", np.sum), ("mean", np.mean), ("max", np.max), ("min", np.min)]
)
def test_all_reduce_matches_numpy(p8, op, ref):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(3, 2)).astype(np.float32) for _ in range(8)]
    outs = jsbp.mirrored(lambda x: jsbp.all_reduce(x, op), placement=p8)(xs)
    want = ref(np.stack(xs), axis=0)
    for o in outs:  # every device gets the result
        np.testing.assert_allclose(np.asarray(o), want, rtol=1e-6)
    # outside a mirrored function, on a mirrored list: the reduction as one value
    np.testing.assert_allclose(np.asarray(jsbp.all_reduce(xs, op)), want, rtol=1e-6)


def test_all_reduce_over_one_axis_of_a_2d_placement(p24):
    xs = [np.float32(i) for i in range(8)]
    rows = jsbp.mirrored(lambda x: jsbp.all_reduce(x, "sum", axis="b"), placement=p24)(xs)
    cols = jsbp.mirrored(lambda x: jsbp.mirrored_mean(x, axis="a"), placement=p24)(xs)
    assert [float(r) for r in rows] == [6.0] * 4 + [22.0] * 4
    assert [float(c) for c in cols] == [2.0, 3.0, 4.0, 5.0] * 2


def test_mirrored_lists_convert_to_and_from_global_tensors(p8):
    xs = [np.full((2, 3), i, np.float32) for i in range(8)]
    ys = jsbp.mirrored(lambda x: x * 10, placement=p8)(xs)
    g = jsbp.from_local(ys, placement=p8, sbp="S(0)")  # mirrored -> consistent
    assert g.shape == (16, 3) and g.sbp == (jsbp.sbp.split(0),)
    np.testing.assert_allclose(g.numpy(), np.concatenate(xs) * 10)
    total = jsbp.from_local(ys, placement=p8, sbp="P")  # the sum of the device values
    np.testing.assert_allclose(total.numpy(), sum(xs) * 10)
    # consistent -> mirrored: to_local, or pass the global tensor itself
    back = g.to_local()
    assert [b.shape for b in back] == [(2, 3)] * 8
    outs = jsbp.mirrored(lambda x: x.sum(), placement=p8)(g)
    assert [float(o) for o in outs] == [60.0 * i for i in range(8)]


def test_errors_name_the_problem(p8):
    f = jsbp.mirrored(lambda x: x, placement=p8)
    with pytest.raises(jsbp.SbpError, match="list of 3 entries, but .* has 8 devices"):
        f([np.zeros(2)] * 3)
    with pytest.raises(jsbp.SbpError, match="every entry must have the same shape"):
        f([np.zeros(2)] * 7 + [np.zeros(3)])
    with pytest.raises(jsbp.SbpError, match="inside a function run by jsbp.mirrored"):
        jsbp.mirrored_mean(jnp.ones(3))
    with pytest.raises(jsbp.SbpError, match="op must be one of"):
        jsbp.all_reduce([np.ones(2)], "prod")
    with pytest.raises(jsbp.PlacementError):
        jsbp.mirrored(lambda x: x, placement=[0, 1])


# ------------------------------------------------------------------------------------------------
# the seed's mirrored_strategy.py: dense 512 relu, dense 10, SGD(0.1), the batch cut by hand
# ------------------------------------------------------------------------------------------------


class SeedMLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.truncated_normal(0.1)
        self.dense1 = nnx.Linear(64, 512, kernel_init=init, rngs=rngs)
        self.dense2 = nnx.Linear(512, 10, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        return self.dense2(jax.nn.relu(self.dense1(x.reshape(x.shape[0], -1))))


def _loss(model, batch):
    images, labels = batch
    return jflax.softmax_cross_entropy(model(images), labels)


def _data(steps, batch=32):
    """Learnable synthetic digits: the label is the argmax of a fixed projection of the image."""
    rng = np.random.default_rng(0)
    proj = rng.normal(size=(64, 10)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(batch, 1, 8, 8)).astype(np.float32)
        out.append((x, np.argmax(x.reshape(batch, 64) @ proj, -1).astype(np.int32)))
    return out


def _fresh():
    model = SeedMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def test_seed_mirrored_training_equals_consistent_view_and_one_device(p8):
    data = _data(4)
    n = p8.size

    # mirrored: lists in (one piece of the batch per device), gradients averaged by hand
    model, opt = _fresh()
    graphdef, state = nnx.split((model, opt))

    def train_job(state, images, labels):
        model, opt = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(_loss)(model, (images, labels))
        opt.update(model, jsbp.mirrored_mean(grads))
        return nnx.state((model, opt)), loss

    job = jsbp.mirrored(train_job, placement=p8)
    states, mirrored_losses = [state] * n, []
    for images, labels in data:
        states, loss_list = job(states, np.split(images, n), np.split(labels, n))
        assert len(loss_list) == n
        mirrored_losses.append(np.mean([float(v) for v in loss_list]))
    # every device holds the same model afterwards
    leaves = [jax.tree.leaves(s) for s in states]
    for other in leaves[1:]:
        for a, b in zip(leaves[0], other):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mirrored_model, _ = nnx.merge(graphdef, jax.device_get(states[0]))

    # consistent view (data parallel) and one device, same step function
    def fit(strategy):
        model, opt = _fresh()
        if strategy is not None:
            model, opt = jflax.shard((model, opt), strategy)
        step = jflax.make_train_step(_loss, strategy)
        losses = [
            float(np.asarray(jsbp.GlobalTensor.numpy(x) if isinstance(x, jsbp.GlobalTensor) else x))
            for x in (step(model, opt, b) for b in data)
        ]
        return losses, (jflax.gather(model) if strategy is not None else model)

    consistent_losses, consistent_model = fit(jflax.Strategy(p8))
    single_losses, single_model = fit(None)
    np.testing.assert_allclose(mirrored_losses, single_losses, rtol=1e-5)
    np.testing.assert_allclose(consistent_losses, single_losses, rtol=1e-5)
    for m in (mirrored_model, consistent_model):
        for a, b in zip(
            jax.tree.leaves(nnx.state(m, nnx.Param)),
            jax.tree.leaves(nnx.state(single_model, nnx.Param)),
        ):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert single_losses[-1] < single_losses[0]


def test_mirrored_gradient_averaging_is_its_only_communication(p8):
    def step(w, x):
        g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
        return w - 0.1 * jsbp.mirrored_mean(g)

    f = jsbp.mirrored(step, placement=p8)
    ws = [np.ones((3, 2), np.float32)] * 8
    xs = [np.full((4, 3), i, np.float32) for i in range(8)]
    counts = jsbp.debug.count_collectives(f, ws, xs)
    assert counts["all-reduce"] == 1 and sum(counts.values()) == 1
    out = f(ws, xs)
    g_mean = np.mean([2 * x.T @ (x @ np.ones((3, 2))) / 8 for x in xs], axis=0)
    np.testing.assert_allclose(np.asarray(out[3]), 1 - 0.1 * g_mean, rtol=1e-6)
