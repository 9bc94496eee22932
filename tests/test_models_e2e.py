"""End-to-end programs built from the primitives real models emit (issue "Every primitive a JAX
program emits"): a Flax NNX CNN with BatchNorm (eval form), average and max pooling and a
depthwise conv, and a top-k MoE layer routed with ``jnp.stack``. Each runs its loss and gradients
under ``jsbp.jit`` and is compared with the same computation on one device. No primitive may fall
back to replicated here (``strict=True``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp

nnx = pytest.importorskip("flax.nnx")

P8 = jsbp.placement("cpu", list(range(8)))


def _globals(tree, layout_of):
    paths = {
        kp: jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    return jax.tree_util.tree_map_with_path(
        lambda kp, v: jsbp.tensor(
            np.asarray(v), placement=P8, sbp=layout_of(paths[kp], np.asarray(v))
        ),
        tree,
    )


def _close(got, ref, rtol=1e-4, atol=1e-5):
    g = jax.tree_util.tree_leaves(got, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))
    r = jax.tree_util.tree_leaves(ref)
    assert len(g) == len(r)
    for a, b in zip(g, r):
        np.testing.assert_allclose(a.numpy(), np.asarray(b), rtol=rtol, atol=atol)


class CNN(nnx.Module):
    """Conv -> BatchNorm -> relu -> avg pool -> depthwise conv -> max pool -> dense, NHWC."""

    def __init__(self, rngs):
        self.conv1 = nnx.Conv(3, 16, kernel_size=(3, 3), rngs=rngs)
        self.bn1 = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.dw = nnx.Conv(16, 16, kernel_size=(3, 3), feature_group_count=16, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, use_running_average=True, rngs=rngs)
        self.head = nnx.Linear(16 * 2 * 2, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        x = nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.bn2(self.dw(x)))
        x = nnx.max_pool(x, window_shape=(2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def _cnn_case():
    model = CNN(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    # non-trivial running statistics, so the eval-form BatchNorm is not an identity
    for bn in (model.bn1, model.bn2):
        bn.mean.value = jnp.asarray(rng.standard_normal(16).astype(np.float32) * 0.1)
        bn.var.value = jnp.asarray(rng.uniform(0.5, 2.0, 16).astype(np.float32))
    graphdef, state = nnx.split(model)
    params = jax.tree_util.tree_map(np.asarray, state.to_pure_dict())
    x = rng.standard_normal((16, 8, 8, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=16).astype(np.int32)

    def loss(p, x, y):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        logits = nnx.merge(graphdef, st)(x)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    return jax.value_and_grad(loss), params, x, y


def _cnn_tp(path, v):
    """Channel parallelism: every conv / BatchNorm / bias vector split on its channel (last) dim,
    the head split on its input features."""
    if "head" in path:
        return "S(0)" if "kernel" in path else "B"
    return f"S({v.ndim - 1})"


@pytest.mark.parametrize("strategy", ["dp8", "tp8"])
def test_cnn_with_batchnorm_pooling_and_depthwise_conv(strategy):
    step, params, x, y = _cnn_case()
    ref_loss, ref_grads = step(params, x, y)
    if strategy == "dp8":
        gp = _globals(params, lambda path, v: "B")
        gx, gy = jsbp.tensor(x, placement=P8, sbp="S(0)"), jsbp.tensor(y, placement=P8, sbp="S(0)")
    else:
        gp = _globals(params, _cnn_tp)
        gx, gy = jsbp.tensor(x, placement=P8, sbp="B"), jsbp.tensor(y, placement=P8, sbp="B")
    loss, grads = jsbp.jit(step, strict=True)(gp, gx, gy)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    _close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    plan = jsbp.explain(step, gp, gx, gy)
    assert plan.collectives() == jsbp.debug.count_collectives(jsbp.jit(step), gp, gx, gy)
    if strategy == "dp8":  # data parallel: only the gradients' reductions, nothing in the model
        kinds = {c for b in plan.boxings() for c in b.collectives}
        assert kinds <= {"all-reduce", "reduce-scatter", "all-gather"}
        assert not [b for b in plan.boxings() if b.shape[:1] == (16,) and b.collectives]


def _moe_case(top_k=2, n_experts=8, d=8, hidden=16, tokens=32):
    rng = np.random.default_rng(1)
    params = {
        "router": rng.standard_normal((d, n_experts)).astype(np.float32) * 0.5,
        "w_in": rng.standard_normal((n_experts, d, hidden)).astype(np.float32) * 0.3,
        "w_out": rng.standard_normal((n_experts, hidden, d)).astype(np.float32) * 0.3,
    }
    x = rng.standard_normal((tokens, d)).astype(np.float32)

    def moe(p, x):
        gates = jax.nn.softmax(x @ p["router"], axis=-1)
        weights, experts = jax.lax.top_k(gates, top_k)  # (tokens, k)
        weights = weights / weights.sum(-1, keepdims=True)
        h = jax.nn.gelu(jnp.einsum("td,edh->teh", x, p["w_in"]))
        out_all = jnp.einsum("teh,ehd->ted", h, p["w_out"])  # every expert on every token
        picked = jnp.stack(
            [
                jnp.take_along_axis(out_all, experts[:, j, None, None], axis=1)[:, 0]
                for j in range(top_k)
            ],
            axis=1,
        )  # (tokens, k, d)
        return jnp.einsum("tk,tkd->td", weights, picked)

    def loss(p, x):
        return jnp.mean(moe(p, x) ** 2)

    return jax.value_and_grad(loss), params, x


@pytest.mark.parametrize("strategy", ["dp8", "expert8"])
def test_top_k_moe_layer(strategy):
    step, params, x = _moe_case()
    ref_loss, ref_grads = step(params, x)
    if strategy == "dp8":
        gp = _globals(params, lambda path, v: "B")
        gx = jsbp.tensor(x, placement=P8, sbp="S(0)")
    else:  # expert parallel: each device holds one expert's weights
        gp = _globals(params, lambda path, v: "B" if "router" in path else "S(0)")
        gx = jsbp.tensor(x, placement=P8, sbp="B")
    loss, grads = jsbp.jit(step, strict=True)(gp, gx)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    _close(grads, ref_grads, rtol=1e-4, atol=1e-6)
    assert jsbp.explain(step, gp, gx).collectives() == jsbp.debug.count_collectives(
        jsbp.jit(step), gp, gx
    )
