"""The cost model (``jsbp/_cost.py``): what a planned program costs per device as it runs.

Collectives are counted as the compiled program has them (``compiled_collectives``, what
``explain`` lists and ``count_collectives`` finds) and as they are launched (``collectives``: a
combined collective once, a loop body's once per iteration); bytes likewise per iteration.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp import CostModel
from jsbp._cost import estimate

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
RNG = np.random.default_rng(0)


def _program(jf, *args):
    return jf.lower_program(*args).program


@pytest.mark.parametrize("length", [3, 5])
def test_a_loop_body_collective_is_launched_once_per_iteration(length):
    """A scan whose body all-reduces a partial matmul (its operands' layouts pinned in the body,
    so that gathering both before the loop is not an option): one collective in the compiled
    program, ``length`` launched per step, and ``length`` times the body's bytes."""
    xs = jsbp.tensor(
        RNG.standard_normal((length, 8, 12)).astype(np.float32), placement=P4, sbp="S(2)"
    )
    w = jsbp.tensor(RNG.standard_normal((12, 5)).astype(np.float32), placement=P4, sbp="S(0)")

    def f(xs, w):
        def body(c, x):
            x, wl = jsbp.to_global(x, sbp="S(1)"), jsbp.to_global(w, sbp="S(0)")
            y = jsbp.to_global(x @ wl, sbp="B")  # P -> B: one all-reduce per iteration
            return c + jnp.tanh(y).sum(), y

        return jax.lax.scan(body, jnp.zeros(()), xs)

    jf = jsbp.jit(f)
    c, ys = jf(xs, w)
    ref = np.einsum("lij,jk->lik", xs.numpy(), w.numpy())
    np.testing.assert_allclose(ys.numpy(), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(c.numpy(), np.tanh(ref).sum(), rtol=1e-4, atol=1e-3)
    est = estimate(_program(jf, xs, w))
    counts = jsbp.debug.count_collectives(jf, xs, w)
    assert est.compiled_collectives == sum(counts.values()) == 1, counts
    assert est.collectives == length
    one = 2 * (8 * 5 * 4) * 3 / 4  # an all-reduce of an (8, 5) float32 over 4 devices
    assert est.comm_bytes == pytest.approx(length * one)


def test_combined_collectives_are_launched_once():
    """Three partial sums reduced for an op that reads them whole run as one collective: the
    estimate launches one, as the compiled program has it."""
    locs = [
        [RNG.standard_normal(s).astype(np.float32) for _ in range(4)] for s in [(8,), (4, 4), (6,)]
    ]
    gs = [jsbp.from_local(ls, placement=P4, sbp="P") for ls in locs]
    jf = jsbp.jit(lambda a, b, c: (a * a, b * b, c * c))
    outs = jf(*gs)
    for o, ls in zip(outs, locs):
        np.testing.assert_allclose(o.numpy(), sum(ls) ** 2, rtol=1e-5, atol=1e-5)
    est = estimate(_program(jf, *gs))
    counts = jsbp.debug.count_collectives(jf, *gs)
    assert est.compiled_collectives == est.collectives == sum(counts.values()) == 1, counts


def test_seconds_follow_the_model_rates():
    """The predicted step time is bytes / link bandwidth + latency per launched collective +
    compute: doubling the latency adds exactly one latency per launched collective."""
    x = jsbp.tensor(RNG.standard_normal((16, 8)).astype(np.float32), placement=P4, sbp="S(1)")
    w = jsbp.tensor(RNG.standard_normal((8, 8)).astype(np.float32), placement=P4, sbp="S(0)")
    prog = _program(jsbp.jit(lambda x, w: jsbp.to_global(x @ w, sbp="B")), x, w)
    base = CostModel()
    slow = CostModel(latency=2 * base.latency)
    a, b = estimate(prog, base), estimate(prog, slow)
    assert a.collectives == 1
    assert b.seconds - a.seconds == pytest.approx(base.latency * a.collectives)
    assert base.latency_bytes == pytest.approx(base.latency * base.link_bandwidth)


def test_explain_reports_the_compiled_collectives():
    """``explain``'s estimate counts the collectives its table lists."""
    x = jsbp.tensor(RNG.standard_normal((16, 8)).astype(np.float32), placement=P4, sbp="S(0)")
    w = jsbp.tensor(RNG.standard_normal((8, 8)).astype(np.float32), placement=P4, sbp="S(1)")

    def f(x, w):
        return jnp.tanh(x @ w).sum(0)

    plan = jsbp.explain(f, x, w)
    assert plan.estimate.compiled_collectives == sum(plan.collectives().values())
