"""SBP values: construction, parsing, printing, equality, hashing, pickling, normalisation."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import jsbp
from jsbp import sbp

# -- values ------------------------------------------------------------------------------------


def test_split_fields_and_flags():
    s = sbp.split(1)
    assert s.dim == 1
    assert (s.is_split, s.is_broadcast, s.is_partial) == (True, False, False)
    assert (sbp.broadcast.is_split, sbp.broadcast.is_broadcast, sbp.broadcast.is_partial) == (
        False,
        True,
        False,
    )
    assert (sbp.partial_sum.is_split, sbp.partial_sum.is_broadcast, sbp.partial_sum.is_partial) == (
        False,
        False,
        True,
    )


def test_split_accepts_numpy_integers():
    assert sbp.split(np.int64(2)) == sbp.split(2)
    assert type(sbp.split(np.int32(2)).dim) is int


@pytest.mark.parametrize(
    "value,r,s",
    [
        (sbp.split(0), "sbp.split(dim=0)", "S(0)"),
        (sbp.split(-1), "sbp.split(dim=-1)", "S(-1)"),
        (sbp.split(3), "sbp.split(dim=3)", "S(3)"),
        (sbp.broadcast, "sbp.broadcast", "B"),
        (sbp.partial_sum, "sbp.partial_sum", "P"),
    ],
)
def test_repr_and_str(value, r, s):
    assert repr(value) == r
    assert str(value) == s


def test_nd_str():
    assert sbp.nd_str((sbp.split(0), sbp.broadcast)) == "(S(0), B)"
    assert sbp.nd_str((sbp.partial_sum,)) == "(P)"


def test_equality_and_hash():
    assert sbp.split(0) == sbp.split(0)
    assert sbp.split(0) != sbp.split(1)
    assert sbp.split(0) != sbp.broadcast
    assert sbp.broadcast != sbp.partial_sum
    assert sbp.partial_sum != sbp.partial_max
    assert hash(sbp.split(2)) == hash(sbp.split(2))
    d = {sbp.split(0): "a", sbp.broadcast: "b", sbp.partial_sum: "c"}
    assert d[sbp.split(0)] == "a" and d[sbp.parse("B")] == "b" and d[sbp.parse("P")] == "c"
    assert len({sbp.split(0), sbp.split(0), sbp.split(1), sbp.broadcast, sbp.parse("B")}) == 3


def test_frozen():
    s = sbp.split(0)
    with pytest.raises(AttributeError):
        s.dim = 1  # type: ignore[misc]
    assert s.dim == 0


@pytest.mark.parametrize(
    "value", [sbp.split(0), sbp.split(-2), sbp.broadcast, sbp.partial_sum, sbp.partial_max]
)
def test_pickle_and_copy_roundtrip(value):
    back = pickle.loads(pickle.dumps(value))
    assert back == value and hash(back) == hash(value) and str(back) == str(value)
    assert copy.deepcopy(value) == value


def test_pickled_singletons_stay_singletons():
    assert pickle.loads(pickle.dumps(sbp.broadcast)) is sbp.broadcast
    assert pickle.loads(pickle.dumps(sbp.partial_sum)) is sbp.partial_sum
    nd = (sbp.split(0), sbp.broadcast, sbp.partial_sum)
    assert pickle.loads(pickle.dumps(nd)) == nd


def test_each_value_exists_once():
    """Every way of making an SBP value hands back the one instance (equality and hashing are by
    identity): constructors with any integer type, parsing, pickling, copying, ``replace``."""
    import dataclasses

    from jsbp._sbp import Broadcast, Partial, Split

    s1 = sbp.split(1)
    assert Split(np.int64(1)) is s1 and type(Split(np.int32(1)).dim) is int
    assert sbp.parse("S(1)") is s1 and sbp.parse("S(-1)") is sbp.split(-1)
    assert pickle.loads(pickle.dumps(s1)) is s1 and copy.deepcopy(s1) is s1 and copy.copy(s1) is s1
    assert dataclasses.replace(s1, dim=2) is sbp.split(2)
    assert (
        Broadcast() is sbp.broadcast
        and Partial() is sbp.partial_sum
        and Partial("min") is sbp.partial_min
    )
    assert pickle.loads(pickle.dumps(sbp.partial_max)) is sbp.partial_max
    with pytest.raises(jsbp.SbpError, match="integer dim"):
        Split(1.0)
    with pytest.raises(jsbp.SbpError, match="must be one of"):
        Partial("mean")


# -- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,want",
    [
        ("S(0)", sbp.split(0)),
        ("S(1)", sbp.split(1)),
        ("S(-1)", sbp.split(-1)),
        (" S( 2 ) ", sbp.split(2)),
        ("B", sbp.broadcast),
        ("P", sbp.partial_sum),
        ("Pmax", sbp.partial_max),
        ("Pmin", sbp.partial_min),
    ],
)
def test_parse_one(text, want):
    assert sbp.parse(text) == want


def test_parse_passes_values_through():
    s = sbp.split(4)
    assert sbp.parse(s) is s
    assert sbp.parse(sbp.broadcast) is sbp.broadcast
    assert sbp.parse("B") is sbp.broadcast and sbp.parse("P") is sbp.partial_sum


@pytest.mark.parametrize(
    "value,want",
    [
        ("S(0)", (sbp.split(0),)),
        ("B", (sbp.broadcast,)),
        (sbp.partial_sum, (sbp.partial_sum,)),
        (("S(0)", "B"), (sbp.split(0), sbp.broadcast)),
        (["P", sbp.split(1)], (sbp.partial_sum, sbp.split(1))),
        ("(S(0), B)", (sbp.split(0), sbp.broadcast)),
        ("(S(0),S(-1))", (sbp.split(0), sbp.split(-1))),
        ("S(1), P", (sbp.split(1), sbp.partial_sum)),
        ("(B, P, S(2))", (sbp.broadcast, sbp.partial_sum, sbp.split(2))),
        ("(P)", (sbp.partial_sum,)),
    ],
)
def test_parse_nd(value, want):
    assert sbp.parse_nd(value) == want


def test_parse_nd_checks_length_only_when_asked():
    assert sbp.parse_nd(("B", "B", "B")) == (sbp.broadcast,) * 3
    assert sbp.parse_nd(("B", "B"), 2) == (sbp.broadcast,) * 2
    with pytest.raises(jsbp.SbpError, match="2 entries but the placement has 3 axes"):
        sbp.parse_nd(("B", "B"), 3)


# -- the forms every API accepts -------------------------------------------------------------------


def _p(ranks, names=None):
    return jsbp.placement("cpu", ranks, axis_names=names)


@pytest.mark.parametrize(
    "form",
    [
        "(S(0), B)",
        ("S(0)", "B"),
        [sbp.split(0), sbp.broadcast],
        ("S(0)", sbp.broadcast),
        "S(0), B",
        ("S(-2)", "B"),
    ],
    ids=str,
)
def test_every_form_gives_the_same_tensor(form):
    q = _p([[0, 1], [2, 3]])
    value = np.arange(30, dtype=np.float32).reshape(5, 6)
    x = jsbp.tensor(value, placement=q, sbp=form)
    assert x.sbp == (sbp.split(0), sbp.broadcast)
    assert [a.shape for a in x.to_local()] == [(3, 6), (3, 6), (2, 6), (2, 6)]
    assert np.array_equal(x.numpy(), value)


def test_single_sbp_for_1d_placement_in_every_form():
    p = _p([0, 1, 2])
    for form in ("S(1)", sbp.split(1), ("S(1)",), "(S(1))", "S(-1)", sbp.split(-1)):
        x = jsbp.zeros(2, 7, placement=p, sbp=form)
        assert x.sbp == (sbp.split(1),)
        assert isinstance(x.sbp, tuple)
        assert [a.shape for a in x.to_local()] == [(2, 3), (2, 2), (2, 2)]


@pytest.mark.parametrize(
    "ndim,d,want", [(1, -1, 0), (2, -1, 1), (2, -2, 0), (3, -1, 2), (3, -3, 0), (3, 1, 1)]
)
def test_negative_dims_are_normalised_against_the_tensor(ndim, d, want):
    shape = (4, 6, 8)[:ndim]
    x = jsbp.zeros(shape, placement=_p([0, 1]), sbp=sbp.split(d))
    assert x.sbp == (sbp.split(want),)
    assert str(x.sbp[0]) == f"S({want})"
    # the same tensor boxed with the normalised form is a no-op
    assert x.to_global(sbp=f"S({want})") is x


def test_normalisation_happens_per_tensor():
    p = _p([0, 1])
    a = jsbp.zeros(4, 4, placement=p, sbp="S(-1)")
    b = jsbp.zeros(4, 4, 4, placement=p, sbp="S(-1)")
    assert a.sbp == (sbp.split(1),) and b.sbp == (sbp.split(2),)


def test_sbp_module_exports():
    for name in ("split", "broadcast", "partial_sum", "parse", "parse_nd", "Sbp", "Split"):
        assert hasattr(sbp, name), name
    assert isinstance(sbp.broadcast, sbp.Sbp) and isinstance(sbp.split(0), sbp.Split)
