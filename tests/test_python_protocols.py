"""A global tensor answers Python's protocols as a ``jax.Array`` does: ``format`` of a 0-d tensor,
pickling; and a ragged nested list is a jsbp error naming the argument."""

from __future__ import annotations

import itertools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp


@pytest.fixture
def p1():
    return jsbp.placement("cpu", [0, 1, 2, 3])


@pytest.mark.parametrize(
    "dtype,specs",
    [
        (np.float32, [".2f", ".3e", ">10.4f", "g", "+.1%"]),
        (jnp.bfloat16, [".2f", "g"]),
        (np.float16, [".3f"]),
        (np.int32, ["d", ">5d", "x", ".2f"]),
        (np.bool_, ["", "d"]),
    ],
)
def test_format_of_a_0d_tensor_is_the_values(p1, dtype, specs):
    value = np.asarray(-2.375 if dtype != np.bool_ else True).astype(dtype)
    ref = jnp.asarray(value)
    for nd in ("B", "P"):
        x = jsbp.tensor(value, placement=p1, sbp=nd)
        for spec in specs:
            if spec == "":
                continue
            assert format(x, spec) == format(ref, spec), (nd, spec)
    # a 0-d partial sum (a sum over a split dim), formatted as its reduced value
    v = jsbp.tensor(np.arange(10.0, dtype=np.float32), placement=p1, sbp="S(0)").sum()
    assert v.sbp == (jsbp.sbp.partial_sum,)
    assert f"{v:.2f}" == "45.00" == f"{jnp.arange(10.0).sum():.2f}"


def test_format_of_other_shapes_as_jax(p1):
    x = jsbp.tensor(np.ones((2, 3), np.float32), placement=p1, sbp="S(1)")
    with pytest.raises(TypeError):
        format(jnp.ones((2, 3)), ".2f")
    with pytest.raises(TypeError):
        format(x, ".2f")
    assert format(x, "") == str(x) == f"{x}"


def test_format_of_a_tracer_is_a_jsbp_error(p1):
    x = jsbp.tensor(np.float32(1.5), placement=p1, sbp="B")
    with pytest.raises(jsbp.SbpError, match="tracer"):
        jax.jit(lambda t: format(t, ".2f"))(x)


def _layouts(plc):
    return list(itertools.product(["S(0)", "S(1)", "B", "P"], repeat=plc.ndim))


@pytest.mark.parametrize("hier", ["4", "2x2"])
def test_pickle_round_trip(hier):
    """Every layout on 1-d and 2-d placements, uneven shapes, several dtypes: the unpickled tensor
    has the value, dtype, placement and nd-sbp it was pickled with."""
    plc = jsbp.placement("cpu", [0, 1, 2, 3] if hier == "4" else [[0, 1], [2, 3]])
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jnp.bfloat16, np.int32, np.bool_):
        v = (rng.standard_normal((5, 3)) * 4).astype(dtype)
        for nd in _layouts(plc):
            x = jsbp.tensor(v, placement=plc, sbp=nd)
            y = pickle.loads(pickle.dumps(x))
            assert isinstance(y, jsbp.GlobalTensor)
            assert (y.placement, y.sbp, y.shape, y.dtype) == (x.placement, x.sbp, x.shape, x.dtype)
            np.testing.assert_array_equal(y.numpy(), v)
    # as a jax.Array pickles
    assert np.array_equal(pickle.loads(pickle.dumps(jnp.arange(3))), np.arange(3))


def test_pickle_inside_a_pytree(p1):
    tree = {"w": jsbp.randn(6, 4, key=0, placement=p1, sbp="S(0)"), "step": 3}
    back = pickle.loads(pickle.dumps(tree))
    np.testing.assert_array_equal(back["w"].numpy(), tree["w"].numpy())
    assert back["step"] == 3


def test_unpicklable_tensors_say_to_use_checkpoint(p1):
    key = jsbp.tensor(jax.random.key(0), placement=p1, sbp="B")
    with pytest.raises(jsbp.SbpError, match="jsbp.checkpoint"):
        pickle.dumps(key)
    x = jsbp.tensor(np.ones(4, np.float32), placement=p1, sbp="S(0)")

    def traced(t):
        pickle.dumps(jsbp.GlobalTensor(t, x.layout))
        return t

    with pytest.raises(jsbp.SbpError, match="tracer"):
        jax.jit(traced)(x.physical)


@pytest.mark.parametrize(
    "data,where",
    [
        ([[1, 2], [3]], "data[0] has length 2 but data[1] has length 1"),
        ([[1, 2], 3], "data[0] is a sequence but data[1] is a scalar"),
        ([[[1, 2], [3, 4]], [[5, 6], [7]]], "data[1][0] has length 2 but data[1][1] has length 1"),
    ],
)
def test_ragged_nested_list_names_the_argument(p1, data, where):
    with pytest.raises(jsbp.SbpError) as err:
        jsbp.tensor(data, placement=p1, sbp="B")
    msg = str(err.value)
    assert "argument data" in msg and "ragged" in msg and where in msg
    assert "inhomogeneous" not in msg
