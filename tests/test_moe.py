"""Mixture-of-experts layers with the expert weights split along the expert dim (expert
parallelism) against the same function on one device.

Two ways public JAX code writes an MoE layer: the dense GShard / Switch form (tokens in groups,
a one-hot dispatch tensor with a capacity factor, einsums over experts) and the dropless sort
form (top-k, ``argsort`` by expert, ``jax.lax.ragged_dot``, ``segment_sum`` back to tokens).
Values and the gradients of the input and every weight match at 1e-5 (f32) on ``ep=8`` and on
``dp=2, ep=4``; ``explain`` lists exactly the collectives of the compiled program. The dense
form's plan dispatches and combines tokens by all-to-all and never gathers the expert weights.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp

RNG = np.random.default_rng(0)
TOL = dict(rtol=1e-5, atol=1e-5)
T, D, F, E = 512, 64, 256, 8  # tokens, model width, expert width, experts


def rand(*shape, scale=1.0):
    return (RNG.normal(size=shape) * scale).astype(np.float32)


def gelu(x):
    return jax.nn.gelu(x, approximate=True)


def route(x, wg, k):
    """Softmax router, top-k experts per token, gates renormalised over the k."""
    probs = jax.nn.softmax(x @ wg, axis=-1)
    gates, idx = jax.lax.top_k(probs, k)
    return gates / jnp.sum(gates, -1, keepdims=True), idx


def dense_moe(x, wg, w1, w2, *, groups=8, k=2, capacity_factor=1.25):
    """GShard / Switch: tokens in ``groups`` groups, each with its own expert buffers of
    ``capacity`` slots (earlier tokens first, first choices before second; overflow dropped)."""
    t, d = x.shape
    e = wg.shape[1]
    s = t // groups
    c = int(np.ceil(capacity_factor * k * s / e))
    xg = x.reshape(groups, s, d)
    gates, idx = route(xg, wg, k)  # [g, s, k]
    mask = jax.nn.one_hot(idx, e, dtype=x.dtype)  # [g, s, k, e]
    m = jnp.swapaxes(mask, 1, 2).reshape(groups, k * s, e)
    pos = (jnp.cumsum(m, axis=1) - 1.0) * m  # slot of each (choice, token) in its expert
    pos = jnp.swapaxes(pos.reshape(groups, k, s, e), 1, 2)
    keep = mask * (pos < c)
    slot = jax.nn.one_hot(jnp.sum(pos * keep, -1).astype(jnp.int32), c, dtype=x.dtype)
    dispatch = jnp.einsum("gske,gskc->gsec", keep, slot)  # [g, s, e, c]
    combine = jnp.einsum("gske,gsk,gskc->gsec", keep, gates, slot)
    xe = jnp.einsum("gsec,gsd->egcd", dispatch, xg)
    h = gelu(jnp.einsum("egcd,edf->egcf", xe, w1))
    ye = jnp.einsum("egcf,efd->egcd", h, w2)
    return jnp.einsum("gsec,egcd->gsd", combine, ye).reshape(t, d)


def sort_moe(x, wg, w1, w2, *, k=2):
    """Dropless: (token, expert) pairs sorted by expert, one grouped matmul per layer
    (``ragged_dot``), gated results summed back to their tokens."""
    t, _ = x.shape
    e = wg.shape[1]
    gates, idx = route(x, wg, k)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    token = order // k
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    h = gelu(jax.lax.ragged_dot(x[token], w1, sizes))
    ys = jax.lax.ragged_dot(h, w2, sizes) * gates.reshape(-1)[order][:, None]
    return jax.ops.segment_sum(ys, token, num_segments=t)


def params():
    return rand(T, D), rand(D, E), rand(E, D, F, scale=0.1), rand(E, F, D, scale=0.1)


def placement(sizes, names):
    n = int(np.prod(sizes))
    return jsbp.placement("cpu", np.arange(n).reshape(sizes).tolist(), axis_names=names)


EP8 = (placement((8,), ("ep",)), ["S(0)", "B", "S(0)", "S(0)"])
DP2_EP4 = (
    placement((2, 4), ("dp", "ep")),
    [("S(0)", "S(0)"), ("B", "B"), ("B", "S(0)"), ("B", "S(0)")],
)


def check(fn, args, plc, sbps):
    """Values and the gradients (input and weights) of ``fn`` under ``jsbp.jit`` against one
    device; ``explain`` == the compiled collectives. Returns the gradient program's plan."""
    glob = [jsbp.tensor(a, plc, s) for a, s in zip(args, sbps)]
    np.testing.assert_allclose(jsbp.jit(fn)(*glob).numpy(), jax.jit(fn)(*args), **TOL)
    ct = rand(T, D)

    def loss(*a):
        return jnp.sum(fn(*a) * ct)

    grad = jsbp.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    v, gs = grad(*glob)
    want_v, want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*args)
    np.testing.assert_allclose(v.numpy(), want_v, rtol=1e-5)
    for g, h in zip(gs, want):
        np.testing.assert_allclose(g.numpy(), h, **TOL)
    plan = jsbp.explain(grad, *glob)
    assert plan.collectives() == jsbp.debug.count_collectives(grad, *glob)
    return plan


def expert_weight_gathers(plan, w):
    """Boxings that all-gather a value the size of an expert weight (an all-reduce over ``dp``
    of the weight gradients is data parallelism, not a gather)."""
    return [
        b for b in plan.boxings() if tuple(b.shape) == w.shape and "all-gather" in b.collectives
    ]


LAYOUTS = {"ep8": EP8, "dp2_ep4": DP2_EP4}


@pytest.mark.parametrize("where", list(LAYOUTS))
def test_dense_moe_dispatches_by_all_to_all(where):
    args = params()
    plan = check(dense_moe, args, *LAYOUTS[where])
    c = plan.collectives()
    assert c["all-to-all"] >= 4 and c["all-gather"] == 0, c  # dispatch and combine, both ways
    assert not expert_weight_gathers(plan, args[2]) and not expert_weight_gathers(plan, args[3])


@pytest.mark.parametrize("where", list(LAYOUTS))
def test_sort_moe_ragged_dot_runs_sharded(where):
    args = params()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jsbp.NoRuleWarning)  # ragged_dot has a rule
        plan = check(sort_moe, args, *LAYOUTS[where])
    assert not expert_weight_gathers(plan, args[2]) and not expert_weight_gathers(plan, args[3])
