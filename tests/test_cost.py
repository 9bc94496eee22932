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


_R22 = jsbp.placement("cpu", [[0, 1], [2, 3]])
_WIDTH_CASES = {  # (placement, from, to, whether a 16-bit float moves 32 bits wide)
    "P->B all-reduce": (P4, "P", "B", True),
    "P->S reduce-scatter": (P4, "P", "S(0)", True),
    "S->B all-gather": (P4, "S(1)", "B", False),
    "(S,S)->(B,B) zero-fill + all-reduce": (_R22, ("S(0)", "S(1)"), ("B", "B"), True),
    "(P,S)->(B,B)": (_R22, ("P", "S(1)"), ("B", "B"), True),
}


def test_boolean_sums_are_priced_at_the_width_they_move():
    """A partial sum of booleans (their logical or) is reduced as int32 (``collective_dtype``),
    an all-gather of booleans moves a byte each: ``explain``, the estimate and the planner's
    price count those bytes, which the compiled collectives carry."""
    from jsbp import _boxing
    from jsbp._cost import DEFAULT_COST

    v = np.arange(64).reshape(4, 16) % 3 == 0
    for src, dst, kind, width, coll in (
        ("S(0)", "B", "all-gather", 1, "u8"),
        ("P", "B", "all-reduce", 4, "s32"),
    ):
        x = jsbp.tensor(v, placement=P4, sbp=src)
        fn = jsbp.jit(lambda x: ~x, out_sbp=dst)
        np.testing.assert_array_equal(fn(x).numpy(), ~v)
        est = jsbp.debug.estimate(fn, x)
        assert jsbp.explain(fn, x).total_bytes_per_device == est.comm_bytes
        ring = 3 / 4 * v.size * width  # what one device receives of a ring over 4
        assert est.comm_bytes == (2 * ring if kind == "all-reduce" else ring), str(
            jsbp.explain(fn, x)
        )
        types = {
            line.split("=", 1)[1].split("[", 1)[0].strip()
            for line in fn.lower(x).compile().as_text().splitlines()
            if f" {kind}(" in line
        }
        assert types == {coll}, types
        priced = _boxing.conversion_cost(
            x.sbp,
            jsbp.tensor(v, placement=P4, sbp=dst).sbp,
            v.shape,
            P4.hierarchy,
            1,
            DEFAULT_COST.latency_bytes,
            DEFAULT_COST.op_bytes,
            _boxing.widening(jnp.dtype(bool)),
        )
        assert priced >= est.comm_bytes + DEFAULT_COST.latency_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", list(_WIDTH_CASES))
def test_16_bit_floats_are_priced_at_the_width_they_move(case, dtype):
    """A 16-bit float's partial sums are reduced in float32, and a float zero-filled into a
    partial sum travels as 32-bit integers (its bits); an all-gather moves the 16-bit blocks.
    ``explain``, the cost model's estimate and the planner's price of the conversion count the
    bytes the compiled program's collectives carry: those of float32 where it moves 32 bits wide,
    half of them where it does not."""
    from jsbp import _boxing
    from jsbp._cost import DEFAULT_COST

    plc, src, dst, wide = _WIDTH_CASES[case]
    moved, priced = {}, {}
    for dt in ("float32", dtype):
        x = jsbp.tensor(np.ones((8, 16)), placement=plc, sbp=src, dtype=dt)
        fn = jsbp.jit(lambda x: x * 2, out_sbp=dst)
        np.testing.assert_array_equal(fn(x).numpy().astype(np.float32), 2 * np.ones((8, 16)))
        plan = jsbp.explain(fn, x)
        est = jsbp.debug.estimate(fn, x)
        assert plan.total_bytes_per_device == est.comm_bytes > 0
        moved[dt] = est.comm_bytes
        types = {  # the element types the compiled collectives carry
            line.split("=", 1)[1].split("[", 1)[0].strip()
            for line in fn.lower(x).compile().as_text().splitlines()
            if any(f" {k}(" in line for k in ("all-reduce", "all-gather", "reduce-scatter"))
        }
        # (XLA:CPU itself carries a bfloat16 all-gather as float32; jsbp moves 16 bits there)
        narrow = {"float16": {"f16"}, "bfloat16": {"bf16", "f32"}}.get(dt, {"f32"})
        assert types and types <= ({"f32", "u32"} if wide else narrow), types
        priced[dt] = _boxing.conversion_cost(
            x.sbp,
            jsbp.tensor(np.ones((8, 16)), placement=plc, sbp=dst).sbp,
            (8, 16),
            plc.hierarchy,
            np.dtype(jnp.dtype(dt)).itemsize,
            DEFAULT_COST.latency_bytes,
            DEFAULT_COST.op_bytes,
            _boxing.widening(jnp.dtype(dt)),
        )
    assert moved[dtype] == (1.0 if wide else 0.5) * moved["float32"], (moved, str(plan))
    if wide:
        assert priced[dtype] == priced["float32"], priced
    else:
        assert priced[dtype] < priced["float32"], priced
