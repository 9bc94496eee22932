"""Every bad input raises SbpError / PlacementError (both ValueError) whose message names the
offending value and says what would be valid."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

import jsbp
from jsbp import sbp

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
Q22 = jsbp.placement("cpu", [[0, 1], [2, 3]])


def raises(err, *fragments):
    """pytest.raises for ``err`` whose message contains every fragment (literally)."""
    return pytest.raises(err, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def test_error_types_are_value_errors():
    assert issubclass(jsbp.SbpError, ValueError)
    assert issubclass(jsbp.PlacementError, ValueError)
    assert not issubclass(jsbp.SbpError, jsbp.PlacementError)
    with pytest.raises(ValueError):
        sbp.parse("Q")


# -- SBP values and strings -------------------------------------------------------------------------


@pytest.mark.parametrize("dim,shown", [(1.5, "1.5"), ("0", "'0'"), (None, "None"), (True, "True")])
def test_split_needs_an_integer(dim, shown):
    with raises(jsbp.SbpError, "integer dim", shown):
        sbp.split(dim)


@pytest.mark.parametrize("text", ["S(x)", "Q", "S(1.5)", "S()", "split(0)", "", "b"])
def test_unreadable_sbp_strings(text):
    with raises(jsbp.SbpError, f"cannot read {text!r}", "'S(<int>)', 'B', 'P'"):
        sbp.parse(text)


def test_non_string_sbp():
    with raises(jsbp.SbpError, "cannot read 3 (int)", "valid forms"):
        sbp.parse(3)


def test_bad_entry_inside_nd_string_is_named():
    with raises(jsbp.SbpError, "cannot read 'Q'", "valid forms"):
        jsbp.zeros(4, 4, placement=Q22, sbp="(S(0), Q)")


def test_unbalanced_nd_string():
    with raises(jsbp.SbpError, "'(S(0), B'", "unbalanced", "(S(0), B)"):
        jsbp.zeros(4, 4, placement=Q22, sbp="(S(0), B")


def test_nd_sbp_of_wrong_type():
    with raises(jsbp.SbpError, "cannot read 3 (int) as an nd-sbp", "one SBP per placement axis"):
        jsbp.zeros(4, placement=P4, sbp=3)


def test_unknown_partial_kind():
    with raises(jsbp.SbpError, "'prod'", "['max', 'min', 'sum']"):
        sbp.Partial("prod")


def test_mixing_partial_kinds():
    with raises(jsbp.SbpError, "(P, Pmax)", "mixes partial kinds", "max, sum"):
        jsbp.zeros(4, 4, placement=Q22, sbp=(sbp.partial_sum, sbp.partial_max))
    with raises(jsbp.SbpError, "mixes partial kinds"):
        sbp.parse_nd("(Pmin, P)")


# -- placements -------------------------------------------------------------------------------------


def test_duplicate_device_ids():
    with raises(jsbp.PlacementError, "[0, 1, 1]", "repeat device id(s) [1]"):
        jsbp.placement("cpu", [0, 1, 1])
    with raises(jsbp.PlacementError, "repeat device id(s) [2]"):
        jsbp.placement("cpu", [[0, 2], [2, 3]])


@pytest.mark.parametrize("bad", [99, -1, 8])
def test_unknown_device_ids(bad):
    with raises(jsbp.PlacementError, f"[{bad}]", "valid cpu ids are [0, 1, 2, 3, 4, 5, 6, 7]"):
        jsbp.placement("cpu", [0, bad])


def test_ragged_ranks():
    with raises(jsbp.PlacementError, "[[0, 1], [2]]", "ragged"):
        jsbp.placement("cpu", [[0, 1], [2]])
    with raises(jsbp.PlacementError, "ragged"):
        jsbp.placement("cpu", [[0, 1], 2])


@pytest.mark.parametrize(
    "ranks,shown",
    [
        ([0, 1.0], "1.0 (float)"),
        (["0", "1"], "'0' (str)"),
        ([True, False], "True (bool)"),
        ([0, None], "None"),
    ],
)
def test_non_integer_ranks(ranks, shown):
    with raises(jsbp.PlacementError, "integer JAX device ids", shown):
        jsbp.placement("cpu", ranks)


def test_empty_ranks():
    with raises(jsbp.PlacementError, "[]", "at least one"):
        jsbp.placement("cpu", [])


def test_wrong_number_of_axis_names():
    with raises(jsbp.PlacementError, "('a',)", "(2, 2)", "one name per axis"):
        jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("a",))
    with raises(jsbp.PlacementError, "('a', 'b', 'c')", "one name per axis"):
        jsbp.placement("cpu", [0, 1], axis_names=("a", "b", "c"))


def test_bad_axis_names():
    with raises(jsbp.PlacementError, "('a', 'a')", "distinct non-empty strings"):
        jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("a", "a"))
    with raises(jsbp.PlacementError, "distinct non-empty strings"):
        jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("a", 1))


def test_unknown_device_type():
    with raises(jsbp.PlacementError, "'npu'", "'cpu', 'gpu' (or 'cuda'), 'tpu'"):
        jsbp.placement("npu", [0])


def test_device_type_not_on_this_machine():
    with raises(jsbp.PlacementError, "no 'tpu' devices", "cpu: 8 devices"):
        jsbp.placement("tpu", [0])
    with raises(jsbp.PlacementError, "no 'tpu' devices"):
        jsbp.placement.all("tpu")


# -- layouts against tensors ----------------------------------------------------------------------


@pytest.mark.parametrize("dim", [2, 5, -3])
def test_split_dim_out_of_range(dim):
    with raises(
        jsbp.SbpError,
        f"split dim {dim} is out of range",
        "(4, 4)",
        "valid split dims are [-2, -1, 0, 1]",
    ):
        jsbp.zeros(4, 4, placement=P4, sbp=sbp.split(dim))


def test_split_a_scalar():
    with raises(jsbp.SbpError, "shape ()", "a scalar cannot be split; use B or P"):
        jsbp.tensor(1.0, placement=P4, sbp="S(0)")


def test_split_dim_out_of_range_when_boxing():
    x = jsbp.zeros(4, 4, placement=P4, sbp="B")
    with raises(jsbp.SbpError, "to_global", "split dim 2", "valid split dims"):
        x.to_global(sbp="S(2)")
    with raises(jsbp.SbpError, "grad_sbp", "split dim 3"):
        x.to_global(sbp="S(0)", grad_sbp="S(3)")


@pytest.mark.parametrize("nd,n", [("S(0)", 1), (("S(0)", "B", "B"), 3), ((), 0)])
def test_nd_sbp_length_differs_from_placement(nd, n):
    with raises(
        jsbp.SbpError, f"has {n} entr", "placement has 2 axes", "one SBP per placement axis"
    ):
        jsbp.zeros(4, 4, placement=Q22, sbp=nd)


def test_nd_sbp_length_when_boxing():
    x = jsbp.zeros(4, 4, placement=Q22, sbp=("B", "B"))
    with raises(jsbp.SbpError, "has 1 entry but the placement has 2 axes"):
        x.to_global(sbp="S(0)")


def test_moving_to_another_rank_without_sbp():
    x = jsbp.zeros(4, placement=P4, sbp="B")
    with raises(jsbp.SbpError, "2-d placement", "pass sbp="):
        x.to_global(placement=Q22)


# -- non-global objects ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "obj", [np.ones(3), [1, 2], jax.numpy.ones(2)], ids=lambda o: type(o).__name__
)
def test_module_to_global_on_non_global_without_layout(obj):
    with raises(
        jsbp.SbpError, "to_global needs a jsbp GlobalTensor", type(obj).__name__, "jsbp.tensor("
    ):
        jsbp.to_global(obj)


def test_to_global_with_placement_only_on_non_global():
    with raises(jsbp.SbpError, "needs a jsbp GlobalTensor", "ndarray of shape (3,)"):
        jsbp.to_global(np.ones(3), placement=P4)


def test_to_local_on_non_global():
    with raises(jsbp.SbpError, "to_local needs a jsbp GlobalTensor", "ndarray of shape (3,)"):
        jsbp.GlobalTensor.to_local(np.ones(3))


def test_to_local_and_numpy_under_jit():
    x = jsbp.zeros(4, placement=P4, sbp="S(0)")
    with raises(jsbp.SbpError, "to_local()", "jax.jit"):
        jax.jit(lambda t: t.to_local())(x)
    with raises(jsbp.SbpError, "numpy()", "to_jax()"):
        jax.jit(lambda t: t.numpy())(x)


def test_placement_argument_of_wrong_type():
    x = jsbp.zeros(4, placement=P4, sbp="B")
    with raises(jsbp.PlacementError, "to_global", "[0, 1]", "jsbp.placement"):
        x.to_global(placement=[0, 1])
    with raises(jsbp.PlacementError, "tensor", "None", "jsbp.placement('cpu'"):
        jsbp.tensor(np.ones(3), sbp="B")
    with raises(jsbp.PlacementError, "full", "jsbp.placement"):
        jsbp.full((2, 2), 1.0, sbp="B")


def test_missing_sbp():
    with raises(jsbp.SbpError, "tensor", "pass sbp="):
        jsbp.tensor(np.ones(3), placement=P4)
    with raises(jsbp.SbpError, "from_local", "pass sbp="):
        jsbp.from_local([np.ones(1)] * 4, placement=P4)


# -- factories -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,shown", [((-1, 3), "(-1, 3)"), ((2.5,), "(2.5,)"), ((2, "a"), "(2, 'a')")]
)
def test_bad_shapes(shape, shown):
    with raises(jsbp.SbpError, "zeros", "non-negative ints", shown):
        jsbp.zeros(*shape, placement=P4, sbp="B")
    with raises(jsbp.SbpError, "randn", "non-negative ints"):
        jsbp.randn(shape, key=0, placement=P4, sbp="B")


def test_bad_fill_value():
    with raises(jsbp.SbpError, "full", "'x' (str)", "number"):
        jsbp.full((2, 2), "x", placement=P4, sbp="B")


@pytest.mark.parametrize("key", ["abc", 1.5, True, [1, 2]], ids=str)
def test_bad_random_key(key):
    with raises(jsbp.SbpError, "rand", "key must be an int seed or a JAX PRNG key", repr(key)):
        jsbp.rand(3, key=key, placement=P4, sbp="B")


def test_tensor_from_objects():
    with raises(jsbp.SbpError, "tensor", "cannot make a tensor"):
        jsbp.tensor([object()], placement=P4, sbp="B")


# -- from_local -------------------------------------------------------------------------------------


def test_from_local_wrong_count():
    with raises(
        jsbp.SbpError, "got 3 local arrays", "owns 4 device(s)", "one array per owned device"
    ):
        jsbp.from_local([np.ones((2, 2))] * 3, placement=P4, sbp="S(0)")


def test_from_local_shapes_not_balanced():
    locs = [np.ones((n, 2)) for n in (6, 7, 6, 6)]  # 25 over 4 must be 7, 6, 6, 6
    with raises(jsbp.SbpError, "device 0", "(6, 2)", "(7, 2)", "(25, 2)", "balanced split"):
        jsbp.from_local(locs, placement=P4, sbp="S(0)")


def test_from_local_mismatched_non_split_dim():
    locs = [np.ones((2, 2)), np.ones((2, 3)), np.ones((2, 2)), np.ones((2, 2))]
    with raises(jsbp.SbpError, "device 1", "(2, 3)", "(2, 2)"):
        jsbp.from_local(locs, placement=P4, sbp="S(0)")


def test_from_local_broadcast_shapes_differ():
    locs = [np.ones(3), np.ones(3), np.ones(3), np.ones(4)]
    with raises(jsbp.SbpError, "device 3", "(4,)", "(3,)"):
        jsbp.from_local(locs, placement=P4, sbp="B")


def test_from_local_names_the_device_id_not_the_index():
    p = jsbp.placement("cpu", [4, 5, 6, 7])
    locs = [np.ones(2), np.ones(2), np.ones(2), np.ones(5)]
    with raises(jsbp.SbpError, "device 7", "(5,)"):
        jsbp.from_local(locs, placement=p, sbp="P")


def test_from_local_different_dtypes():
    locs = [np.ones(2, np.float32)] * 3 + [np.ones(2, np.int32)]
    with raises(jsbp.SbpError, "different dtypes", "float32", "int32"):
        jsbp.from_local(locs, placement=P4, sbp="S(0)")


def test_from_local_different_ranks():
    locs = [np.ones((2, 2))] * 3 + [np.ones(2)]
    with raises(jsbp.SbpError, "different ranks [1, 2]"):
        jsbp.from_local(locs, placement=P4, sbp="S(0)")


def test_from_local_placement_of_wrong_type():
    with raises(jsbp.PlacementError, "from_local", "[0, 1, 2, 3]", "jsbp.placement"):
        jsbp.from_local([np.ones(2)] * 4, placement=[0, 1, 2, 3], sbp="S(0)")


# -- mixing placements ------------------------------------------------------------------------------


def test_two_placements_in_one_op_name_both():
    a = jsbp.zeros(4, placement=P4, sbp="B")
    b = jsbp.zeros(4, placement=jsbp.placement("cpu", [4, 5, 6, 7]), sbp="B")
    with raises(
        jsbp.PlacementError, "ranks=[0, 1, 2, 3]", "ranks=[4, 5, 6, 7]", "to_global(placement="
    ):
        a + b
