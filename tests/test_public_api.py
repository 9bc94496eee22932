"""Every public name DESIGN.md lists exists, with the kind of object it should be."""

from __future__ import annotations

import importlib

import pytest

import jsbp

# (module path, attribute) for every v1 public name that exists in the core
NAMES = [
    ("jsbp", "placement"),
    ("jsbp", "sbp"),
    ("jsbp.sbp", "split"),
    ("jsbp.sbp", "broadcast"),
    ("jsbp.sbp", "partial_sum"),
    ("jsbp", "tensor"),
    ("jsbp", "zeros"),
    ("jsbp", "ones"),
    ("jsbp", "full"),
    ("jsbp", "arange"),
    ("jsbp", "randn"),
    ("jsbp", "rand"),
    ("jsbp", "from_local"),
    ("jsbp", "to_global"),
    ("jsbp", "GlobalTensor"),
    ("jsbp", "SbpError"),
    ("jsbp", "PlacementError"),
    ("jsbp", "debug"),
    ("jsbp.debug", "count_collectives"),
    ("jsbp", "auto_layouts"),
    ("jsbp.debug", "measured_bytes"),
    ("jsbp.debug", "estimate"),
]


@pytest.mark.parametrize("mod,name", NAMES, ids=lambda v: v)
def test_public_name_exists(mod, name):
    m = importlib.import_module(mod)
    assert hasattr(m, name), f"{mod}.{name} is missing"
    assert getattr(m, name) is not None


def test_from_imports():
    from jsbp import (  # noqa: F401
        GlobalTensor,
        PlacementError,
        SbpError,
        arange,
        from_local,
        full,
        ones,
        placement,
        rand,
        randn,
        sbp,
        tensor,
        zeros,
    )
    from jsbp.debug import count_collectives  # noqa: F401
    from jsbp.sbp import broadcast, partial_sum, split  # noqa: F401


def test_kinds_of_objects():
    assert isinstance(jsbp.placement, type)
    assert isinstance(jsbp.GlobalTensor, type)
    assert issubclass(jsbp.SbpError, ValueError) and issubclass(jsbp.PlacementError, ValueError)
    for f in (
        jsbp.tensor,
        jsbp.zeros,
        jsbp.ones,
        jsbp.full,
        jsbp.arange,
        jsbp.randn,
        jsbp.rand,
        jsbp.from_local,
        jsbp.debug.count_collectives,
        jsbp.sbp.split,
        jsbp.placement.all,
    ):
        assert callable(f)
    assert str(jsbp.sbp.broadcast) == "B" and str(jsbp.sbp.partial_sum) == "P"
    assert str(jsbp.sbp.split(0)) == "S(0)"


def test_global_tensor_api():
    for attr in ("shape", "dtype", "ndim", "placement", "sbp", "to_local", "numpy", "to_global"):
        assert hasattr(jsbp.GlobalTensor, attr), attr
    for attr in (
        "type",
        "ranks",
        "hierarchy",
        "ndim",
        "size",
        "axis_names",
        "mesh",
        "devices",
        "all",
    ):
        assert hasattr(jsbp.placement, attr), attr


def test_py_typed_marker_ships():
    import pathlib

    assert (pathlib.Path(jsbp.__file__).parent / "py.typed").is_file()
