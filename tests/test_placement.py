"""Placements: properties, equality, hashing, repr, device types, the backing Mesh."""

from __future__ import annotations

import pickle

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jsbp


def test_1d_properties():
    p = jsbp.placement("cpu", [0, 1, 2, 3])
    assert p.type == "cpu"
    assert isinstance(p.ranks, np.ndarray) and p.ranks.dtype.kind == "i"
    assert p.ranks.tolist() == [0, 1, 2, 3]
    assert p.hierarchy == (4,) and isinstance(p.hierarchy, tuple)
    assert p.ndim == 1 and p.size == 4
    assert len(p.axis_names) == 1 and all(isinstance(n, str) for n in p.axis_names)


def test_2d_properties_with_axis_names():
    q = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
    assert q.hierarchy == (2, 2) and q.ndim == 2 and q.size == 4
    assert q.axis_names == ("dp", "tp")
    assert q.ranks.tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    "ranks,hierarchy",
    [
        (range(8), (8,)),
        (range(2, 5), (3,)),
        (np.arange(8).reshape(2, 4), (2, 4)),
        (np.arange(8).reshape(2, 2, 2), (2, 2, 2)),
        ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]], (2, 2, 2)),
        ([5], (1,)),
        ([[3]], (1, 1)),
        ((4, 5, 6), (3,)),
        (np.array([7, 6], dtype=np.int32), (2,)),
    ],
    ids=str,
)
def test_ranks_forms(ranks, hierarchy):
    p = jsbp.placement("cpu", ranks)
    assert p.hierarchy == hierarchy
    assert (
        p.ranks.tolist() == np.asarray(list(ranks) if isinstance(ranks, range) else ranks).tolist()
    )
    assert p.size == int(np.prod(hierarchy))


def test_ranks_are_read_only():
    p = jsbp.placement("cpu", [0, 1])
    with pytest.raises(ValueError):
        p.ranks[0] = 5
    assert p.ranks.tolist() == [0, 1]


def test_mesh_matches_ranks_and_names():
    q = jsbp.placement("cpu", [[3, 1], [0, 2]], axis_names=("a", "b"))
    m = q.mesh
    assert isinstance(m, Mesh)
    assert m.axis_names == ("a", "b")
    assert dict(m.shape) == {"a": 2, "b": 2}
    assert [[d.id for d in row] for row in m.devices] == [[3, 1], [0, 2]]
    assert q.mesh is m  # built once


def test_devices_property():
    q = jsbp.placement("cpu", [[4, 5], [6, 7]])
    devs = q.devices
    assert devs.shape == (2, 2)
    assert all(isinstance(d, jax.Device) for d in devs.flat)
    assert [d.id for d in devs.flat] == [4, 5, 6, 7]
    assert all(d.platform == "cpu" for d in devs.flat)


def test_all():
    p = jsbp.placement.all("cpu")
    assert p.ndim == 1 and p.size == len(jax.devices("cpu")) == 8
    assert p.ranks.tolist() == sorted(d.id for d in jax.devices("cpu"))
    assert p == jsbp.placement("cpu", range(8))
    assert jsbp.placement.all("cpu", axis_names=("x",)).axis_names == ("x",)


def test_equality_and_hash():
    a = jsbp.placement("cpu", [0, 1, 2, 3])
    b = jsbp.placement("cpu", range(4))
    assert a == b and hash(a) == hash(b)
    assert a != jsbp.placement("cpu", [1, 0, 2, 3])  # order matters
    assert a != jsbp.placement("cpu", [[0, 1], [2, 3]])  # hierarchy matters
    assert a != jsbp.placement("cpu", [0, 1, 2, 3], axis_names=("other",))  # names matter
    assert a != jsbp.placement("cpu", [0, 1, 2])
    assert a != [0, 1, 2, 3] and a != "cpu"
    assert len({a, b, jsbp.placement("cpu", [4, 5])}) == 2
    assert {a: 1}[b] == 1


def test_axis_names_as_one_string_for_1d():
    p = jsbp.placement("cpu", [0, 1], axis_names="data")
    assert p.axis_names == ("data",)
    assert p.mesh.axis_names == ("data",)


def test_type_is_case_insensitive_and_normalised():
    assert jsbp.placement("CPU", [0]).type == "cpu"
    assert jsbp.placement("Cpu", [0]) == jsbp.placement("cpu", [0])


def test_cuda_is_a_synonym_of_gpu():
    from jsbp._placement import _normalise_type

    assert _normalise_type("cuda") == "gpu"
    assert _normalise_type("CUDA") == "gpu"
    assert _normalise_type("gpu") == "gpu"
    # here (CPU only) both names give the same, clear error about gpu devices
    msgs = []
    for t in ("cuda", "gpu"):
        with pytest.raises(jsbp.PlacementError, match="no 'gpu' devices") as e:
            jsbp.placement(t, [0])
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]


def test_repr_and_str():
    q = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
    r = repr(q)
    assert (
        r.startswith("placement(")
        and "'cpu'" in r
        and "[[0, 1], [2, 3]]" in r
        and "dp" in r
        and "tp" in r
    )
    s = str(q)
    assert "cpu" in s and "2x2" in s and "dp" in s
    p = jsbp.placement("cpu", [0, 1, 2])
    assert repr(p) == "placement(type='cpu', ranks=[0, 1, 2])"


def test_pickle_roundtrip():
    q = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
    back = pickle.loads(pickle.dumps(q))
    assert back == q and hash(back) == hash(q) and back.axis_names == ("dp", "tp")


def test_axis_size():
    q = jsbp.placement("cpu", np.arange(8).reshape(2, 4), axis_names=("a", "b"))
    assert q.axis_size(0) == 2 and q.axis_size("b") == 4


def test_placements_on_disjoint_devices_hold_their_own_data():
    p = jsbp.placement("cpu", [6, 7])
    x = jsbp.arange(6, placement=p, sbp="S(0)")
    locs = x.to_local()
    assert [next(iter(a.devices())).id for a in locs] == [6, 7]
    assert [np.asarray(a).tolist() for a in locs] == [[0, 1, 2], [3, 4, 5]]
