"""GlobalTensor and its factories: tensor, zeros, ones, full, arange, randn, rand, from_local,
to_local, numpy, the pytree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import check_global, expected_locals, local_shape, make_value

import jsbp
from jsbp import sbp

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
P8 = jsbp.placement("cpu", range(8))
Q22 = jsbp.placement("cpu", [[0, 1], [2, 3]])
Q24 = jsbp.placement("cpu", np.arange(8).reshape(2, 4))
LAYOUTS = [
    (P4, ("S(0)",)),
    (P4, ("B",)),
    (P4, ("P",)),
    (P8, ("S(1)",)),
    (Q22, ("S(0)", "S(1)")),
    (Q22, ("S(1)", "S(1)")),
    (Q22, ("P", "S(0)")),
    (Q24, ("B", "S(0)")),
    (Q24, ("S(1)", "P")),
]


def _lid(v):
    if isinstance(v, jsbp.placement):
        return "x".join(map(str, v.hierarchy))
    return ",".join(v)


# -- jsbp.tensor ----------------------------------------------------------------------------------


@pytest.mark.parametrize("plc,nd", LAYOUTS, ids=_lid)
@pytest.mark.parametrize("shape", [(25, 33), (3, 5), (8, 8)], ids=str)
def test_tensor_layout(plc, nd, shape):
    value = make_value(shape, seed=1)
    x = jsbp.tensor(value, placement=plc, sbp=nd)
    assert x.shape == shape and x.ndim == 2 and x.dtype == np.float32
    assert x.placement == plc
    assert isinstance(x.sbp, tuple) and len(x.sbp) == plc.ndim
    if "P" in nd:
        # the value on the first device of each partial group, zeros on the others
        locs = [np.asarray(a) for a in x.to_local()]
        coords = list(np.ndindex(*plc.hierarchy))
        pax = [a for a, s in enumerate(nd) if s == "P"]
        for c, loc in zip(coords, locs):
            if any(c[a] != 0 for a in pax):
                assert not loc.any()
        assert np.array_equal(x.numpy(), value)
    check_global(x, value, nd)


def test_tensor_from_list_scalar_and_jax_array():
    x = jsbp.tensor([[1, 2, 3], [4, 5, 6]], placement=P4, sbp="S(1)")
    assert x.dtype == np.int32 and x.numpy().tolist() == [[1, 2, 3], [4, 5, 6]]
    assert [a.shape for a in x.to_local()] == [(2, 1), (2, 1), (2, 1), (2, 0)]
    s = jsbp.tensor(2.5, placement=Q22, sbp=("B", "B"))
    assert s.shape == () and float(s.numpy()) == 2.5
    j = jsbp.tensor(jnp.arange(10.0), placement=P4, sbp="S(0)")
    assert np.array_equal(j.numpy(), np.arange(10.0, dtype=np.float32))
    assert [a.shape for a in j.to_local()] == [(3,), (3,), (2,), (2,)]


def test_tensor_dtype_argument_and_canonical_dtypes():
    x = jsbp.tensor(np.arange(6, dtype=np.float64), placement=P4, sbp="S(0)")
    assert x.dtype == np.float32  # x64 is off: canonicalised like jnp.asarray
    y = jsbp.tensor(np.arange(6), placement=P4, sbp="B", dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    assert np.array_equal(y.numpy().astype(np.float32), np.arange(6, dtype=np.float32))


def test_tensor_of_a_global_tensor_boxes_it():
    x = jsbp.tensor(np.arange(12.0).reshape(3, 4), placement=P4, sbp="S(0)")
    y = jsbp.tensor(x, placement=P4, sbp="S(1)")
    assert y.sbp == (sbp.split(1),)
    assert np.array_equal(y.numpy(), x.numpy())


# -- zeros / ones / full / arange ---------------------------------------------------------------


def test_zeros_ones_shape_as_ints_or_tuple():
    a = jsbp.ones(4, 5, placement=P4, sbp="S(0)")
    b = jsbp.ones((4, 5), placement=P4, sbp="S(0)")
    c = jsbp.ones([4, 5], placement=P4, sbp="S(0)")
    assert a.shape == b.shape == c.shape == (4, 5)
    assert np.array_equal(a.numpy(), np.ones((4, 5), np.float32))
    assert np.array_equal(a.numpy(), b.numpy())
    z = jsbp.zeros(7, placement=P4, sbp="S(0)")
    assert z.shape == (7,) and np.array_equal(z.numpy(), np.zeros(7, np.float32))
    assert [a.shape for a in z.to_local()] == [(2,), (2,), (2,), (1,)]
    assert jsbp.zeros((), placement=P4, sbp="B").shape == ()


@pytest.mark.parametrize("plc,nd", LAYOUTS, ids=_lid)
def test_ones_in_every_layout(plc, nd):
    x = jsbp.ones(13, 17, placement=plc, sbp=nd, dtype=jnp.int32)
    assert x.dtype == np.int32
    check_global(x, np.ones((13, 17), np.int32), nd)


def test_ones_partial_locals_sum_to_one():
    x = jsbp.ones(3, placement=P4, sbp="P")
    locs = np.stack([np.asarray(a) for a in x.to_local()])
    assert np.array_equal(locs.sum(0), np.ones(3, np.float32))
    assert np.array_equal(x.numpy(), np.ones(3, np.float32))


@pytest.mark.parametrize(
    "value,dtype,want_dtype",
    [
        (7, None, np.int32),
        (2.5, None, np.float32),
        (True, None, np.bool_),
        (3, jnp.float32, np.float32),
        (np.float32(1.5), None, np.float32),
        (np.int8(4), None, np.int8),
    ],
)
def test_full(value, dtype, want_dtype):
    x = jsbp.full((5, 3), value, placement=Q22, sbp=("S(0)", "B"), dtype=dtype)
    assert x.dtype == want_dtype
    check_global(x, np.full((5, 3), value, dtype=want_dtype), ("S(0)", "B"))
    y = jsbp.full(5, value, placement=P4, sbp="S(0)", dtype=dtype)
    assert y.shape == (5,)


@pytest.mark.parametrize("args", [(10,), (3, 11), (2, 20, 3), (0,)], ids=str)
def test_arange(args):
    x = jsbp.arange(*args, placement=P4, sbp="S(0)")
    want = np.arange(*args)
    assert np.array_equal(x.numpy(), want.astype(x.dtype))
    assert [a.shape[0] for a in x.to_local()] == [len(c) for c in np.array_split(want, 4)]


def test_arange_dtype():
    x = jsbp.arange(6, placement=P4, sbp="B", dtype=np.float32)
    assert x.dtype == np.float32 and x.numpy().tolist() == [0, 1, 2, 3, 4, 5]


# -- random ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,ref", [(jsbp.randn, jax.random.normal), (jsbp.rand, jax.random.uniform)]
)
def test_random_value_depends_on_key_and_shape_only(fn, ref):
    key = jax.random.key(42)
    want = np.asarray(ref(key, (13, 17)))
    layouts = [
        (P4, "S(0)"),
        (P4, "B"),
        (P4, "P"),
        (P8, "S(1)"),
        (Q22, ("S(0)", "S(1)")),
        (Q22, ("P", "B")),
        (Q24, ("S(1)", "S(0)")),
        (jsbp.placement("cpu", [5]), "B"),
    ]
    for plc, nd in layouts:
        x = fn(13, 17, key=key, placement=plc, sbp=nd)
        assert x.dtype == np.float32
        got = x.numpy()
        np.testing.assert_array_equal(got, want, err_msg=f"{plc} {nd}")
    # an int key is jax.random.key(int)
    np.testing.assert_array_equal(fn((13, 17), key=42, placement=P4, sbp="S(0)").numpy(), want)
    # a different key gives different values
    other = fn(13, 17, key=jax.random.key(43), placement=P4, sbp="B").numpy()
    assert not np.array_equal(other, want)


@pytest.mark.parametrize(
    "fn,ref", [(jsbp.randn, jax.random.normal), (jsbp.rand, jax.random.uniform)]
)
def test_random_default_dtype_is_jaxs(fn, ref):
    """Without ``dtype``, the draw has ``jax.random``'s default float: float64 under
    ``jax_enable_x64`` (the same values as ``jax.random`` there), float32 otherwise."""
    key = jax.random.key(3)
    with jax.enable_x64(True):
        want = np.asarray(ref(key, (6, 5)))
        x = fn(6, 5, key=key, placement=P4, sbp="S(0)")
        assert want.dtype == np.float64 and x.dtype == np.float64
        np.testing.assert_array_equal(x.numpy(), want)
    assert fn(6, 5, key=key, placement=P4, sbp="S(0)").dtype == np.float32


def test_rand_range_and_legacy_keys():
    x = jsbp.rand(1000, key=jax.random.PRNGKey(0), placement=P8, sbp="S(0)").numpy()
    assert x.min() >= 0.0 and x.max() < 1.0
    np.testing.assert_array_equal(x, np.asarray(jax.random.uniform(jax.random.PRNGKey(0), (1000,))))


def test_random_without_key_uses_manual_seed():
    jsbp.manual_seed(7)
    a = jsbp.randn(4, 4, placement=P4, sbp="S(0)").numpy()
    b = jsbp.randn(4, 4, placement=P4, sbp="B").numpy()
    jsbp.manual_seed(7)
    a2 = jsbp.randn(4, 4, placement=Q22, sbp=("B", "S(1)")).numpy()
    assert np.array_equal(a, a2)  # the same draw, whatever the layout
    assert not np.array_equal(a, b)  # successive draws differ


# -- from_local -------------------------------------------------------------------------------------


@pytest.mark.parametrize("plc,nd", LAYOUTS, ids=_lid)
@pytest.mark.parametrize("shape", [(25, 33), (3, 5), (8, 0, 4)], ids=str)
def test_from_local_infers_the_logical_shape(plc, nd, shape):
    value = make_value(shape, seed=4)
    locs = expected_locals(value, plc.hierarchy, nd, seed=2)
    x = jsbp.from_local(locs, placement=plc, sbp=nd)
    assert x.shape == shape
    check_global(x, value, nd)
    # to_local gives back exactly what went in (P: the same addends)
    for got, want in zip(x.to_local(), locs):
        assert np.array_equal(np.asarray(got), want)


def test_from_local_uneven_inference_1d():
    locs = [np.full((n, 2), i, np.float32) for i, n in enumerate([7, 6, 6, 6])]
    x = jsbp.from_local(locs, placement=P4, sbp="S(0)")
    assert x.shape == (25, 2)
    assert np.array_equal(x.numpy(), np.concatenate(locs))
    # empty shards: 3 over 4 -> 1, 1, 1, 0
    e = jsbp.from_local([np.ones(1), np.ones(1), np.ones(1), np.ones(0)], placement=P4, sbp="S(0)")
    assert e.shape == (3,) and e.numpy().tolist() == [1.0, 1.0, 1.0]


def test_from_local_nested_split_2d():
    # (S(0), S(0)) on 2x2: 13 -> 7 | 6, then 7 -> 4, 3 and 6 -> 3, 3
    locs = [np.arange(n, dtype=np.float32) + 100 * i for i, n in enumerate([4, 3, 3, 3])]
    x = jsbp.from_local(locs, placement=Q22, sbp=("S(0)", "S(0)"))
    assert x.shape == (13,)
    assert np.array_equal(x.numpy(), np.concatenate(locs))


def test_from_local_broadcast_takes_first_device():
    locs = [np.full((2, 3), i, np.float32) for i in range(4)]
    x = jsbp.from_local(locs, placement=P4, sbp="B")
    assert np.array_equal(x.numpy(), locs[0])
    assert all(np.array_equal(np.asarray(a), locs[0]) for a in x.to_local())
    # 2-d: coordinate 0 on the broadcast axis is the truth, per split piece
    locs2 = [np.full((1, 2), v, np.float32) for v in (1, 2, 3, 4)]
    y = jsbp.from_local(locs2, placement=Q22, sbp=("S(0)", "B"))
    assert y.numpy().tolist() == [[1, 1], [3, 3]]


def test_from_local_partial_sums_addends():
    locs = [np.full((2, 3), i + 1, np.float32) for i in range(4)]
    x = jsbp.from_local(locs, placement=P4, sbp="P")
    assert np.array_equal(x.numpy(), np.full((2, 3), 10, np.float32))
    assert [float(np.asarray(a)[0, 0]) for a in x.to_local()] == [1, 2, 3, 4]
    assert np.array_equal(x.to_global(sbp="B").numpy(), np.full((2, 3), 10, np.float32))


def test_from_local_accepts_jax_arrays_and_keeps_dtype():
    locs = [jnp.full((2,), i, jnp.int32) for i in range(4)]
    x = jsbp.from_local(locs, placement=P4, sbp="S(0)")
    assert x.dtype == np.int32 and x.numpy().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


# -- to_local / numpy / to_jax / metadata -----------------------------------------------------------


def test_to_local_devices_follow_placement_order():
    p = jsbp.placement("cpu", [5, 2, 7, 0])
    x = jsbp.arange(10, placement=p, sbp="S(0)")
    locs = x.to_local()
    assert [next(iter(a.devices())).id for a in locs] == [5, 2, 7, 0]
    assert [np.asarray(a).tolist() for a in locs] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert all(isinstance(a, jax.Array) for a in locs)


def test_to_local_never_shows_padding():
    x = jsbp.tensor(make_value((25, 33), seed=9), placement=Q24, sbp=("S(1)", "S(0)"))
    for c, a in zip(np.ndindex(2, 4), x.to_local()):
        assert a.shape == local_shape((25, 33), (2, 4), ("S(1)", "S(0)"), c)


def test_numpy_and_array_protocol():
    value = make_value((5, 7), seed=3)
    x = jsbp.tensor(value, placement=Q22, sbp=("P", "S(1)"))
    assert isinstance(x.numpy(), np.ndarray)
    assert np.array_equal(np.asarray(x), value)
    assert np.array_equal(np.asarray(x, dtype=np.float64), value.astype(np.float64))
    assert len(x) == 5


def test_to_jax_is_the_logical_value_under_jit():
    value = make_value((13, 17), seed=6)
    x = jsbp.tensor(value, placement=Q24, sbp=("P", "S(0)"))
    out = jax.jit(lambda t: t.to_jax() * 2)(x)
    assert out.shape == (13, 17)
    assert np.array_equal(np.asarray(out), value * 2)


def test_metadata():
    x = jsbp.zeros(6, 4, placement=Q22, sbp="(S(0), P)", dtype=jnp.int32)
    assert x.shape == (6, 4) and x.ndim == 2 and x.size == 24 and x.dtype == np.int32
    assert x.placement == Q22 and x.sbp == (sbp.split(0), sbp.partial_sum)
    r = repr(x)
    assert "GlobalTensor" in r and "(6, 4)" in r and "int32" in r and "(S(0), P)" in r


def test_pytree_flatten_and_jit_roundtrip():
    value = make_value((13, 17), seed=8)
    x = jsbp.tensor(value, placement=Q22, sbp=("S(1)", "P"))
    leaves, treedef = jax.tree_util.tree_flatten(x)
    assert len(leaves) == 1 and isinstance(leaves[0], jax.Array)
    y = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(y, jsbp.GlobalTensor) and y.sbp == x.sbp and y.placement == x.placement
    z = jax.jit(lambda t: t)(x)
    assert isinstance(z, jsbp.GlobalTensor) and z.sbp == x.sbp
    check_global(z, value, ("S(1)", "P"))
    # tree_map over a structure of global tensors keeps their metadata
    m = jax.tree_util.tree_map(lambda a: a, {"a": x, "b": [x]})
    assert m["b"][0].sbp == x.sbp


def test_to_global_returns_self_when_nothing_changes():
    x = jsbp.zeros(4, 4, placement=Q22, sbp=("S(0)", "B"))
    assert x.to_global() is x
    assert x.to_global(sbp=("S(0)", "B")) is x
    assert x.to_global(placement=Q22) is x
    assert x.to_global(placement=jsbp.placement("cpu", [[0, 1], [2, 3]]), sbp="(S(-2), B)") is x
    assert jsbp.to_global(x, sbp=("S(0)", "B")) is x


def test_module_to_global_builds_from_data():
    value = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    x = jsbp.to_global(value, placement=P4, sbp="S(1)")
    assert isinstance(x, jsbp.GlobalTensor) and np.array_equal(x.numpy(), value)


def test_zero_size_tensors():
    for nd in ("S(0)", "S(1)", "B", "P"):
        x = jsbp.zeros(8, 0, 4, placement=P4, sbp=nd)
        assert x.shape == (8, 0, 4) and x.numpy().shape == (8, 0, 4)
        assert [a.shape for a in x.to_local()] == [
            local_shape((8, 0, 4), (4,), (nd,), (i,)) for i in range(4)
        ]
        r = jsbp.randn(8, 0, 4, key=0, placement=P4, sbp=nd)
        assert r.numpy().shape == (8, 0, 4)
