"""Regression tests for the classes of silently wrong values found on programs jsbp's own tests did
not contain (issue "Never a wrong value"). Each compares with one device or says what JAX says."""

import math
import operator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jsbp
from jsbp._program import boxings_of

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
Q22 = jsbp.placement("cpu", [[0, 1], [2, 3]])
Q222 = jsbp.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]])


def t(value, plc=P4, sbp="B", **kw):
    if sbp == "B":
        sbp = ("B",) * plc.ndim
    return jsbp.tensor(np.asarray(value), placement=plc, sbp=sbp, **kw)


def leaves(tree):
    return [
        np.asarray(x.numpy())
        for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))
    ]


# ---------------------------------------------------------------------------------------------
# 1. a jitted helper called twice (JAX reuses one inner jaxpr, so its variables repeat)
# ---------------------------------------------------------------------------------------------

X16 = np.arange(16.0, dtype=np.float32).reshape(4, 4)


@pytest.mark.parametrize("sbp", ["S(0)", "S(1)", "B"])
def test_where_called_twice_fills_each_calls_value(sbp):
    x = t(X16, sbp=sbp)
    a, b = jsbp.jit(lambda v: (jnp.where(v > 4, v, 1.0), jnp.where(v > 4, v, 2.0)))(x)
    np.testing.assert_array_equal(a.numpy(), np.where(X16 > 4, X16, 1.0))
    np.testing.assert_array_equal(b.numpy(), np.where(X16 > 4, X16, 2.0))


def test_a_user_helper_called_on_two_values():
    h = jax.jit(lambda v: v * 2.0 + 1.0)
    av, bv = np.full((4, 4), 1.0, np.float32), np.full((4, 4), 3.0, np.float32)
    out = jsbp.jit(lambda a, b, x: h(a) * x + h(b) * x)(t(av), t(bv), t(X16, sbp="S(0)"))
    np.testing.assert_allclose(out.numpy(), (2 * av + 1) * X16 + (2 * bv + 1) * X16)


@pytest.mark.parametrize(
    "name", ["var", "std", "norm", "standardize", "log_sigmoid_P", "nan_to_num", "hard_tanh"]
)
def test_library_helpers_called_twice(name):
    rng = np.random.default_rng(0)
    av, bv = (
        rng.standard_normal((6, 5)).astype(np.float32),
        3 * rng.standard_normal((6, 5)).astype(np.float32),
    )
    fn = {
        "var": jnp.var,
        "std": jnp.std,
        "norm": jnp.linalg.norm,
        "standardize": lambda v: jax.nn.standardize(v, axis=0),
        "log_sigmoid_P": jax.nn.log_sigmoid,
        "nan_to_num": jnp.nan_to_num,
        "hard_tanh": jax.nn.hard_tanh,
    }[name]
    sb = "P" if name.endswith("_P") else "S(0)"
    a = t(av, sbp="B").to_global(sbp=sb) if sb == "P" else t(av, sbp=sb)
    b = t(bv, sbp="B").to_global(sbp=sb) if sb == "P" else t(bv, sbp=sb)
    got = leaves(jsbp.jit(lambda x, y: (fn(x), fn(y)))(a, b))
    np.testing.assert_allclose(got[0], np.asarray(fn(jnp.asarray(av))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], np.asarray(fn(jnp.asarray(bv))), rtol=1e-5, atol=1e-6)


def test_two_bernoulli_draws_are_two_draws():
    k1, k2 = jax.random.key(1), jax.random.key(2)
    x = t(np.ones((8, 4), np.float32), sbp="S(0)")

    def f(x, k1, k2):
        return x * jax.random.bernoulli(k1, 0.5, x.shape), x * jax.random.bernoulli(
            k2, 0.5, x.shape
        )

    ref = [np.asarray(r) for r in f(jnp.ones((8, 4)), k1, k2)]
    got = leaves(jsbp.jit(lambda x: f(x, k1, k2))(x))
    assert not np.array_equal(ref[0], ref[1])  # the two draws differ on one device
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])


def test_two_dropout_layers_under_data_parallelism():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.d1 = nnx.Dropout(0.5, rngs=rngs)
            self.d2 = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, key):
            return self.d2(self.d1(x, rngs=nnx.Rngs(key)), rngs=nnx.Rngs(key + 1))

    net = Net(nnx.Rngs(0))
    xv = np.ones((8, 6), np.float32)
    ref = np.asarray(net(jnp.asarray(xv), 7))
    got = jsbp.jit(lambda x: net(x, 7))(t(xv, sbp="S(0)")).numpy()
    np.testing.assert_array_equal(got, ref)


# ---------------------------------------------------------------------------------------------
# 2. implicit rank-equal broadcasting: (4, 4) * (4, 1) is one `mul`
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plc,layouts",
    [
        (P4, ["S(0)", "S(1)", "B", "P"]),
        (Q22, [("S(0)", "S(1)"), ("S(1)", "S(1)"), ("S(1)", "B"), ("B", "S(0)"), ("P", "S(1)")]),
    ],
)
def test_size_one_dims_broadcast_exactly(plc, layouts):
    xv = np.arange(20.0, dtype=np.float32).reshape(4, 5)
    cols, rows = (
        np.arange(1.0, 5.0, dtype=np.float32).reshape(4, 1),
        np.arange(5.0, dtype=np.float32).reshape(1, 5),
    )
    for a in layouts:
        for b in layouts:
            for other in (cols, rows):
                x = t(xv, plc, "B").to_global(sbp=a)
                y = t(other, plc, "B").to_global(sbp=b)
                np.testing.assert_allclose(
                    jsbp.jit(lambda u, v: u * v)(x, y).numpy(), xv * other, err_msg=f"{a} {b}"
                )
                np.testing.assert_allclose(
                    jsbp.jit(lambda u, v: u - v)(x, y).numpy(), xv - other, err_msg=f"{a} {b}"
                )
    # and eagerly
    np.testing.assert_allclose(
        (t(xv, plc, layouts[0]) * t(cols, plc, layouts[1])).numpy(), xv * cols
    )


# ---------------------------------------------------------------------------------------------
# 3. dtypes survive boxing (bool used to come back int32 on 2-d placements)
# ---------------------------------------------------------------------------------------------


def test_bool_boxing_on_a_2d_placement_keeps_bool():
    bv = np.array([[True, False, True], [False, True, False], [True, True, False]])
    x = t(bv, Q22, ("S(0)", "S(1)"))
    y = x.to_global(sbp=("B", "B"))
    assert y.dtype == np.bool_ and y.numpy().dtype == np.bool_
    np.testing.assert_array_equal(y.numpy(), bv)
    got = jsbp.jit(lambda v: ~jnp.any(v))(x).numpy()
    assert got.dtype == np.bool_ and bool(got) is False


def test_partial_bool_reduces_as_logical_or():
    bv = np.array([True, False, True, True, False])
    p = t(bv).to_global(sbp="P")
    for dst in ("S(0)", "B"):
        out = p.to_global(sbp=dst)
        assert out.dtype == np.bool_
        np.testing.assert_array_equal(out.numpy(), bv)


# ---------------------------------------------------------------------------------------------
# 4. caches key constants by type and sign of zero, never by equality alone
# ---------------------------------------------------------------------------------------------


def test_eager_cache_tells_false_from_zero():
    x = t(np.arange(24.0, dtype=np.float32).reshape(2, 4, 3), sbp="S(1)")
    assert x[False].shape == (0, 2, 4, 3)
    assert x[0].shape == (4, 3)
    assert x[True].shape == (1, 2, 4, 3)
    assert x[1].shape == (4, 3)


def test_eager_cache_keeps_dtypes_apart():
    xi = t(np.arange(4, dtype=np.int32), sbp="S(0)")
    assert (xi + 1).dtype == np.int32
    assert (xi + 1.0).dtype == np.float32
    h = t(np.arange(4, dtype=np.float16), sbp="S(0)")
    assert (h * 2).dtype == np.float16
    assert (h * np.float32(2)).dtype == np.float32  # a numpy scalar is not weak
    assert (h * 2.0).dtype == np.float16  # a Python float is weak, as in JAX


def test_eager_cache_keeps_the_sign_of_zero():
    x = t(np.ones(4, np.float32), sbp="S(0)")
    assert np.all((1 / (x * 0.0)).numpy() == np.inf)
    assert np.all((1 / (x * -0.0)).numpy() == -np.inf)


def test_jit_static_args_keyed_by_type():
    xi = t(np.arange(4, dtype=np.int32), sbp="S(0)")
    f = jsbp.jit(lambda a, c: a + c, static_argnums=1)
    assert f(xi, 1).dtype == np.int32
    assert f(xi, 1.0).dtype == np.float32
    g = jsbp.jit(lambda a, c: 1 / (a * c), static_argnums=1)
    xf = t(np.ones(4, np.float32), sbp="S(0)")
    assert np.all(g(xf, 0.0).numpy() == np.inf)
    assert np.all(g(xf, -0.0).numpy() == -np.inf)


def test_python_scalar_arguments_are_weakly_typed():
    h = t(np.arange(4, dtype=np.float16), sbp="S(0)")
    i8 = t(np.arange(4, dtype=np.int8), sbp="S(0)")
    f = jsbp.jit(lambda a, c: a * c)
    assert (
        f(h, 2.0).dtype
        == jax.jit(lambda a, c: a * c)(jnp.ones(4, jnp.float16), 2.0).dtype
        == np.float16
    )
    assert f(i8, 2).dtype == np.int8


# ---------------------------------------------------------------------------------------------
# 5. Python protocols behave as on a jax.Array
# ---------------------------------------------------------------------------------------------


def test_truth_values():
    assert bool(t([False])) is False
    assert bool(t([True])) is True
    assert bool(t(np.float32(0.0))) is False
    x, y = t(np.arange(3.0)), t(np.array([0.0, 1.0, 5.0]))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x == y)
    with pytest.raises(ValueError, match="ambiguous"):
        y in [x]  # noqa: B015  (membership asks for a truth value)
    with pytest.raises(ValueError, match="ambiguous"):
        bool(t(np.zeros((0,))))


def test_scalar_conversions():
    assert float(t([2.5])) == 2.5
    assert int(t(np.array(3))) == 3
    assert complex(t(np.complex64(1 + 2j))) == 1 + 2j
    assert operator.index(t(np.array([4]))) == 4
    assert [10, 20, 30, 40, 50][t(np.array(2), sbp="B")] == 30
    with pytest.raises(TypeError, match="integer"):
        operator.index(t(np.array([4.0])))
    with pytest.raises(TypeError, match="size-1"):
        float(t(np.arange(3.0)))


def test_iteration_and_bounds():
    v = np.arange(12).reshape(3, 4)
    x = t(v, sbp="S(0)")
    rows = list(x)
    assert len(rows) == 3
    for r, e in zip(rows, v):
        np.testing.assert_array_equal(r.numpy(), e)
    with pytest.raises(IndexError):
        x[3]
    with pytest.raises(IndexError):
        x[-4]
    with pytest.raises(IndexError):
        x[0, 4]
    with pytest.raises(IndexError):
        x[..., -5]
    np.testing.assert_array_equal(x[-3].numpy(), v[-3])
    np.testing.assert_array_equal(x[..., 3].numpy(), v[..., 3])
    with pytest.raises(TypeError):
        iter(t(np.float32(1.0)))


def test_truth_of_a_tracer_says_what_to_do():
    x = t(np.ones(1, np.float32))
    with pytest.raises(jsbp.SbpError, match="tracer"):
        jax.jit(lambda v: bool(v))(x)


# ---------------------------------------------------------------------------------------------
# 6. zero-size values through collectives
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plc,sbp", [(P4, "S(0)"), (P4, "B"), (Q22, ("S(0)", "S(0)")), (Q22, ("B", "S(0)"))]
)
def test_zero_size_values(plc, sbp):
    z, z2 = np.zeros((0,), np.float32), np.zeros((0, 3), np.float32)
    a, b = t(z, plc, sbp), t(z2, plc, sbp)
    cases = [
        (jnp.var, a),
        (lambda v: (jnp.mean(v), jnp.mean(v * 2)), a),
        (lambda v: jnp.dot(v, v), a),
        (jax.nn.softmax, b),
        (jnp.linalg.norm, b),
        (lambda v: jnp.einsum("ij,ij->j", v, v), b),
        (lambda v: v.sum(0), b),
        (lambda v: jnp.max(v, axis=1), b),
    ]
    for fn, arg in cases:
        ref = [np.asarray(r) for r in jax.tree_util.tree_leaves(fn(jnp.asarray(arg.numpy())))]
        got = leaves(jsbp.jit(fn)(arg))
        assert [g.shape for g in got] == [r.shape for r in ref]
        for g, r in zip(got, ref):
            np.testing.assert_array_equal(g, r)
        # nothing is communicated for a value without elements (its conversions are local)
        prog = jsbp.jit(fn).lower_program(arg).program
        empty = [bx for bx, _ in boxings_of(prog) if math.prod(bx.src.shape) == 0]
        assert not any(bx.collectives for bx in empty), fn
    assert a.to_global(sbp=("B",) * plc.ndim).numpy().shape == (0,)


# ---------------------------------------------------------------------------------------------
# 7. bfloat16 / complex reductions
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [ml_dtypes.bfloat16, np.float16, np.complex64, np.int8, np.uint8, np.bool_]
)
@pytest.mark.parametrize(
    "plc,sbp", [(P4, "S(0)"), (P4, "S(1)"), (Q22, ("S(0)", "S(1)")), (Q22, ("S(1)", "S(1)"))]
)
def test_reductions_in_every_dtype(dtype, plc, sbp):
    rng = np.random.default_rng(0)
    v = rng.standard_normal((7, 5)) * 10
    v = (
        (v > 0)
        if dtype is np.bool_
        else (v + 1j * rng.standard_normal((7, 5)) if dtype is np.complex64 else v).astype(dtype)
    )
    x = t(v, plc, sbp)
    fns = {
        "max": jnp.max,
        "min": jnp.min,
        "max0": lambda a: jnp.max(a, 0),
        "sum1": lambda a: jnp.sum(a, 1),
        "argmax": jnp.argmax,
        "softmax": jax.nn.softmax,
    }
    low = dtype in (ml_dtypes.bfloat16, np.float16)
    for name, fn in fns.items():
        try:
            ref = np.asarray(fn(jnp.asarray(v)))
        except TypeError:  # JAX itself refuses this dtype
            continue
        got = jsbp.jit(fn)(x).numpy()
        assert got.dtype == ref.dtype, name
        if low:  # float16 / bfloat16: the order of summation rounds differently
            np.testing.assert_allclose(
                got.astype(np.float32), ref.astype(np.float32), rtol=2e-2, atol=2e-2, err_msg=name
            )
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------------
# 8. creation: overflow and shapes no device can hold raise first
# ---------------------------------------------------------------------------------------------


def test_integers_that_do_not_fit_raise():
    with pytest.raises(jsbp.SbpError, match="does not fit int32"):
        jsbp.tensor([2**40, 1], placement=P4, sbp="B")
    with pytest.raises(jsbp.SbpError, match="64-bit"):
        jsbp.tensor([2**70, 1], placement=P4, sbp="B")
    with pytest.raises(jsbp.SbpError, match="does not fit int8"):
        jsbp.tensor([300], placement=P4, sbp="B", dtype=np.int8)
    with pytest.raises(jsbp.SbpError, match="does not fit int8"):
        jsbp.arange(200, placement=P4, sbp="S(0)", dtype=np.int8)
    np.testing.assert_array_equal(
        jsbp.tensor([2**31 - 1, -(2**31)], placement=P4, sbp="B").numpy(), [2**31 - 1, -(2**31)]
    )


def test_shapes_no_device_can_hold_raise():
    for make in (
        lambda: jsbp.zeros(2**62, placement=P4, sbp="S(0)"),
        lambda: jsbp.ones(2**31, 2**31, placement=P4, sbp="S(0)"),
        lambda: jsbp.randn(2**40, 2**20, placement=P4, sbp="S(0)"),
        lambda: jsbp.full((2**33, 2**33), 1.0, placement=Q22, sbp=("S(0)", "S(1)")),
    ):
        with pytest.raises(jsbp.SbpError, match="bytes"):
            make()


# ---------------------------------------------------------------------------------------------
# the net for class 3: random dtypes boxed between random layouts on 2-d and 3-d placements
# ---------------------------------------------------------------------------------------------


def test_every_dtype_survives_boxing_between_random_layouts():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    dtypes = [
        np.bool_,
        np.int8,
        np.uint8,
        np.int16,
        np.int32,
        np.uint32,
        np.float16,
        ml_dtypes.bfloat16,
        np.float32,
        np.complex64,
    ]

    @st.composite
    def cases(draw):
        plc = draw(st.sampled_from([Q22, Q222]))
        shape = tuple(draw(st.integers(0, 6)) for _ in range(draw(st.integers(1, 3))))
        one = st.sampled_from(["B", "P"] + [f"S({d})" for d in range(len(shape))])
        src = tuple(draw(one) for _ in range(plc.ndim))
        dst = tuple(draw(one) for _ in range(plc.ndim))
        return plc, shape, draw(st.sampled_from(dtypes)), src, dst, draw(st.integers(0, 2**16))

    @settings(
        max_examples=int(__import__("os").environ.get("JSBP_HYPOTHESIS_EXAMPLES", "40")),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(cases())
    def check(case):
        plc, shape, dtype, src, dst, seed = case
        rng = np.random.default_rng(seed)
        raw = rng.integers(-50, 50, size=shape)
        v = (
            (raw > 0)
            if dtype is np.bool_
            else (np.abs(raw) if np.dtype(dtype).kind == "u" else raw).astype(dtype)
        )
        x = t(v, plc, "B").to_global(sbp=src)
        y = x.to_global(sbp=dst)
        assert y.dtype == np.dtype(dtype), (src, dst, y.dtype)
        got = y.numpy()
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got, v)
        z = jsbp.jit(lambda a: a, out_sbp=dst)(x)  # the same conversion inside a program
        assert z.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(z.numpy(), v)

    check()


def test_from_local_takes_bfloat16_and_float8_locals():
    """numpy files bfloat16 under the kind letter 'V': from_local must still read it as numeric."""
    for dt in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        v = np.arange(12, dtype=np.float32).reshape(4, 3).astype(dt)
        x = jsbp.from_local([v[i : i + 1] for i in range(4)], placement=P4, sbp="S(0)")
        assert x.dtype == np.dtype(dt)
        np.testing.assert_array_equal(x.numpy(), v)
        assert jsbp.full((2,), np.asarray(1.5, dt), placement=P4, sbp="B").dtype == np.dtype(dt)


# ---------------------------------------------------------------------------------------------
# NaN through a partial max / min (XLA:CPU's max all-reduce dropped it)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_nan_survives_the_reduction_of_a_partial_max(dtype):
    v = np.arange(32.0).reshape(8, 4).astype(dtype)
    v[0, 1] = np.nan
    v[5, 3] = -np.inf
    x = t(v, sbp="S(0)")
    ref_max, ref_min = (
        np.asarray(jnp.max(jnp.asarray(v), 0)),
        np.asarray(jnp.min(jnp.asarray(v), 0)),
    )
    # reduced inside the program (all-reduce of Pmax / Pmin), not on read
    got = jsbp.jit(
        lambda a: (jnp.isnan(jnp.max(a, 0)), jnp.max(a, 0, keepdims=True) * 1, jnp.min(a, 0) + 0),
        out_sbp="B",
    )(x)
    f32 = lambda a: np.asarray(a).astype(
        np.float32
    )  # numpy's NaN == NaN check needs a float it knows
    np.testing.assert_array_equal(got[0].numpy(), np.isnan(f32(ref_max)))
    np.testing.assert_array_equal(f32(got[1].numpy()[0]), f32(ref_max))
    np.testing.assert_array_equal(f32(got[2].numpy()), f32(ref_min))
    # a partial max boxed eagerly, with signed zeros: max(-0, 0) = 0 and min(-0, 0) = -0 as in JAX
    z = np.array([-0.0, 0.0, -0.0, 0.0], np.float32)
    for kind, ref in (("max", jnp.max), ("min", jnp.min)):
        pz = jsbp.jit(lambda a, ref=ref: ref(a.reshape(4, 1), axis=0))(t(z, sbp="S(0)"))
        b = pz.to_global(sbp="B").numpy()
        assert np.signbit(b[0]) == np.signbit(np.asarray(ref(jnp.asarray(z)))), kind


@pytest.mark.parametrize("fn", [jnp.argmax, jnp.argmin])
@pytest.mark.parametrize(
    "plc,sbp", [(P4, "S(0)"), (P4, "S(1)"), (Q22, ("S(0)", "S(1)")), (Q22, ("S(1)", "S(1)"))]
)
def test_arg_extrema_over_a_split_dim(fn, plc, sbp):
    """argmax / argmin over a split dim: exact (ties: first index; NaN counts as the extremum;
    bool and ints); an operand whose move costs more than a collective's latency is not moved
    (two all-reduces of the result's size instead)."""
    rng = np.random.default_rng(5)
    for v in (
        rng.integers(-3, 3, size=(7, 5)).astype(np.float32),  # many ties
        np.where(rng.random((7, 5)) < 0.1, np.nan, rng.standard_normal((7, 5))).astype(np.float32),
        rng.integers(-3, 3, size=(7, 5)).astype(np.int32),
        rng.random((7, 5)) < 0.5,
    ):
        x = t(v, plc, sbp)
        for axis in (0, 1):
            f = lambda a, axis=axis: fn(a, axis=axis)
            np.testing.assert_array_equal(jsbp.jit(f)(x).numpy(), np.asarray(f(jnp.asarray(v))))
    big = t(rng.standard_normal((256, 1024)).astype(np.float32), plc, sbp)
    counts = jsbp.debug.count_collectives(jsbp.jit(lambda a: fn(a, axis=1)), big)
    assert counts["all-gather"] == 0 and counts["all-to-all"] == 0


@pytest.mark.parametrize(
    "plc,sbp", [(P4, "S(0)"), (P4, "S(1)"), (Q22, ("S(0)", "S(1)")), (Q22, ("S(0)", "S(0)"))]
)
def test_cumulative_ops_over_an_evenly_split_dim(plc, sbp):
    """cumsum / cumprod / cummax / cummin (forward and reverse) along a split dim: each block
    scans itself and only the block totals move."""
    from jax import lax

    rng = np.random.default_rng(7)
    ops = [
        lambda a, d: jnp.cumsum(a, axis=d),
        lambda a, d: lax.cumsum(a, axis=d, reverse=True),
        lambda a, d: jnp.cumprod(a, axis=d),
        lambda a, d: lax.cummax(a, axis=d),
        lambda a, d: lax.cummin(a, axis=d, reverse=True),
    ]
    for v in (
        rng.integers(-3, 4, size=(8, 12)).astype(np.int32),
        rng.uniform(0.5, 1.5, (8, 12)).astype(np.float32),
    ):
        x = t(v, plc, sbp)
        for op in ops:
            for d in (0, 1):
                f = lambda a, op=op, d=d: op(a, d)
                np.testing.assert_allclose(
                    jsbp.jit(f)(x).numpy(), np.asarray(f(jnp.asarray(v))), rtol=1e-5
                )
    if plc is P4:  # a long split dim: one small collective of the totals, no gather of the operand
        big = t(rng.standard_normal((512, 16)).astype(np.float32), plc, "S(0)")
        f = lambda a: jnp.tanh(jnp.cumsum(a, axis=0))
        counts = jsbp.debug.count_collectives(jsbp.jit(f), big)
        assert sum(counts.values()) == 1  # (the block totals' all-gather, not the operand's)
        assert jsbp.explain(f, big).total_bytes_per_device < 512 * 16 * 4 / 8


@pytest.mark.parametrize(
    "plc,sbp", [(P4, "S(0)"), (P4, "S(1)"), (Q22, ("S(0)", "S(1)")), (Q22, ("S(0)", "S(0)"))]
)
def test_products_and_logical_reductions_over_an_evenly_split_dim(plc, sbp):
    """reduce_prod / and / or / xor over split dims (alone or with others): each block reduces
    itself, only the per-block results move."""
    from jax import lax

    rng = np.random.default_rng(11)
    vf = rng.uniform(0.8, 1.25, size=(8, 4, 6)).astype(np.float32)
    vi = rng.integers(-2, 3, size=(8, 4, 6)).astype(np.int32)
    vb = rng.random((8, 4, 6)) < 0.8
    for axes in ((0,), (1,), (0, 1), (1, 2), (0, 2)):
        for f, v in (
            (lambda a, ax=axes: jnp.prod(a, axis=ax), vf),
            (lambda a, ax=axes: jnp.prod(a, axis=ax), vi),
            (lambda a, ax=axes: jnp.any(a, axis=ax), vb),
            (lambda a, ax=axes: jnp.all(a, axis=ax), vb),
            (lambda a, ax=axes: lax.reduce_xor(a, ax), vi),
        ):
            ref = np.asarray(f(jnp.asarray(v)))
            got = jsbp.jit(f)(t(v, plc, sbp)).numpy()
            assert got.dtype == ref.dtype
            np.testing.assert_allclose(got, ref, rtol=1e-5)
    if plc is P4:
        big = t(rng.uniform(0.9, 1.1, (512, 16)).astype(np.float32), plc, "S(0)")
        f = lambda a: jnp.prod(a, axis=0)
        counts = jsbp.debug.count_collectives(jsbp.jit(f), big)
        assert sum(counts.values()) == 1  # (the per-block products, not the operand)
        assert jsbp.explain(f, big).total_bytes_per_device <= 4 * 16 * 4
