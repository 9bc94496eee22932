"""Numerics as one device: partial sums of 16-bit floats reduced in float32 and rounded once, and
``-0.0`` kept through boxing and through max / min over a split dim.

One device sums 16-bit floats in float32 and rounds once; so must every read of a ``P`` tensor
(boxing to ``B`` or ``S``, ``numpy()``, jitted and eager reads), without changing the stored dtype.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp import sbp
from jsbp.debug import count_collectives

HALF = [jnp.float16, jnp.bfloat16]
FULL = os.environ.get("JSBP_FULL") == "1"
P1 = lambda: jsbp.placement("cpu", [0, 1, 2, 3])  # noqa: E731
P2 = lambda: jsbp.placement("cpu", [[0, 1], [2, 3]])  # noqa: E731


SHAPES = [(8, 4), (7, 3), (3, 5)]


def _grid(hier, shape):
    """(4,) for every shape and (2, 2) for the uneven (7, 3) by default; the rest is ``slow``."""
    slow = hier == "2x2" and shape != (7, 3)
    return pytest.param(
        hier, shape, marks=pytest.mark.slow if slow else (), id=f"{hier}-{shape[0]}x{shape[1]}"
    )


GRID = [_grid(h, s) for h in ("4", "2x2") for s in SHAPES]


def _exact_sum(addends, dtype):
    """One device's answer: the addends summed in float32, rounded once to ``dtype``."""
    return np.sum(np.stack([np.asarray(a, np.float32) for a in addends]), axis=0).astype(dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _partial(addends, plc, nd):
    return jsbp.from_local([np.asarray(a) for a in addends], placement=plc, sbp=nd)


def _reads(x):
    """Every way of reading the logical value of ``x`` (a P tensor), as numpy arrays."""
    plc = x.placement
    allb = ("B",) * plc.ndim
    return {
        "numpy": x.numpy(),
        "to_global B": x.to_global(sbp=allb).numpy(),
        "to_global S(0)": x.to_global(sbp=("S(0)",) * plc.ndim).numpy(),
        "jit out_sbp=B": jsbp.jit(lambda t: t, out_sbp=allb)(x).numpy(),
        "jit consumer": jsbp.jit(lambda t: jnp.maximum(t, jnp.asarray(-1e4, t.dtype)))(x).numpy(),
        "eager op": x.abs().numpy(),
        "float": np.asarray([float(x[0])], x.dtype),
    }


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_partial_reads_as_one_device_everywhere(dtype):
    """float16: 60000 + 60000 - 60000 - 60000 is 0 on one device (float32 accumulation), ``inf``
    summed in float16. bfloat16: 256 + 1 - 256 + 1 is 2 on one device, 1 summed in bfloat16 in
    any order. Every read path gives one device's answer."""
    vals = (
        (60000.0, 60000.0, -60000.0, -60000.0)
        if dtype == jnp.float16
        else (256.0, 1.0, -256.0, 1.0)
    )
    addends = [np.full((4,), v, dtype) for v in vals]
    x = _partial(addends, P1(), "P")
    want = _exact_sum(addends, dtype)
    assert float(want[0]) == (0.0 if dtype == jnp.float16 else 2.0)
    for path, got in _reads(x).items():
        got = np.asarray(got)
        if path == "eager op":
            want_p = np.abs(want)
        else:
            want_p = want[: got.size].reshape(got.shape)
        assert got.dtype == np.dtype(dtype), path
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want_p, np.float32), err_msg=path
        )
    assert x.dtype == np.dtype(dtype) and x.to_global(sbp="B").dtype == np.dtype(dtype)


@pytest.mark.parametrize(
    "dtype",
    [jnp.float16, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)],
    ids=["float16", "bfloat16"],
)
@pytest.mark.parametrize("hier,shape", [_grid(h, s) for h in ("4", "2x2") for s in SHAPES[:2]])
def test_half_partial_sums_round_once_for_every_conversion(dtype, hier, shape):
    """Random addends whose pairwise 16-bit sums round differently from one float32 sum: every
    conversion out of a partial layout (1-d and 2-d, even and uneven shapes) gives the float32
    sum rounded once, bit for bit."""
    plc = P1() if hier == "4" else P2()
    rng = np.random.default_rng(0)
    srcs = [nd for nd in itertools.product(["P", "B", "S(0)"], repeat=plc.ndim) if "P" in nd]
    if plc.ndim == 2 and not FULL:  # the default run: P on both axes and on one (JSBP_FULL=1: all)
        srcs = [("P", "P"), ("S(0)", "P")]
    dsts = list(itertools.product(["B", "S(0)", "S(1)"], repeat=plc.ndim))
    if True:
        for src in srcs:
            value = rng.standard_normal(shape).astype(np.float32) * 3
            x0 = jsbp.tensor(
                value.astype(dtype), placement=plc, sbp=tuple("B" if s == "P" else s for s in src)
            )
            # addends: the value split into n unequal pieces, each rounded to ``dtype``
            n = np.prod([plc.hierarchy[a] for a, s in enumerate(src) if s == "P"])
            pieces = [(value * w).astype(dtype) for w in rng.dirichlet(np.ones(n))]
            full = np.sum(np.stack([p.astype(np.float32) for p in pieces]), axis=0).astype(dtype)
            locals_ = []
            lay = jsbp.tensor(np.zeros(shape, dtype), placement=plc, sbp=src).layout
            for coord, blk in zip(lay.coords, lay.blocks):
                piece = pieces[lay.addend_index(coord)]
                locals_.append(piece[tuple(slice(o, o + s) for o, s in blk)])
            x = jsbp.from_local(locals_, placement=plc, sbp=src)
            assert x0.shape == x.shape
            np.testing.assert_array_equal(_bits(x.numpy()), _bits(full), err_msg=f"numpy {src}")
            for dst in dsts:
                y = x.to_global(sbp=dst)
                assert y.dtype == np.dtype(dtype)
                np.testing.assert_array_equal(
                    _bits(y.numpy()), _bits(full), err_msg=f"{src}->{dst} {shape}"
                )


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_half_reduction_adds_no_collective(dtype):
    """The float32 reduction rides in the one collective the conversion needs."""
    x = _partial([np.full((8, 4), v, dtype) for v in (1.0, 2.0, 3.0, 4.0)], P1(), "P")
    for dst, kind in (("B", "all-reduce"), ("S(0)", "reduce-scatter"), ("S(1)", "reduce-scatter")):
        counts = count_collectives(lambda t, dst=dst: t.to_global(sbp=dst), x)
        assert counts[kind] == 1 and sum(counts.values()) == 1, (dst, counts)
        assert jsbp.jit(lambda t: t, out_sbp=dst)(x).dtype == np.dtype(dtype)


def test_combined_half_all_reduces_sum_in_float32():
    """Several partial outputs reduced as one combined all-reduce (``_combine``) sum in float32
    too, and stay one collective."""
    plc = P1()
    big = 60000.0
    a = _partial([np.full((4,), v, np.float16) for v in (big, big, -big, -big)], plc, "P")
    b = _partial([np.full((6,), v, np.float16) for v in (big, -big, big, -big)], plc, "P")
    f = jsbp.jit(lambda s, t: (-s, -t), out_sbp="B")  # linear: the outputs stay P until out_sbp
    counts = count_collectives(f, a, b)
    assert counts["all-reduce"] == 1 and sum(counts.values()) == 1, counts
    ra, rb = f(a, b)
    assert ra.dtype == np.float16 and rb.dtype == np.float16
    np.testing.assert_array_equal(ra.numpy(), np.zeros(4, np.float16))
    np.testing.assert_array_equal(rb.numpy(), np.zeros(6, np.float16))


# -- signed zeros ---------------------------------------------------------------------------------


def _signed_zeros(shape, seed=0):
    rng = np.random.default_rng(seed)
    v = np.where(rng.random(shape) < 0.5, -0.0, 0.0).astype(np.float32)
    v[(0,) * len(shape)] = -0.0
    return v


def _sb(ndim):
    return list(itertools.product(["S(0)", "S(1)", "B"], repeat=ndim))


@pytest.mark.parametrize("hier,shape", GRID)
def test_negative_zero_survives_every_boxing(hier, shape):
    """Every (src, dst) pair of S / B layouts, even and uneven shapes: the sign bit of every
    zero is what it was (2-d (S(0), S(1)) -> B used to run as a zero-filled all-reduce that
    returned +0.0 for -0.0)."""
    plc = P1() if hier == "4" else P2()
    if True:
        v = _signed_zeros(shape)
        for src in _sb(plc.ndim):
            x = jsbp.tensor(v, placement=plc, sbp=src)
            np.testing.assert_array_equal(np.signbit(x.numpy()), np.signbit(v))
            for dst in _sb(plc.ndim):
                y = x.to_global(sbp=dst)
                np.testing.assert_array_equal(
                    np.signbit(y.numpy()), np.signbit(v), err_msg=f"{src}->{dst} {shape}"
                )


def test_bit_exact_boxing_keeps_its_one_collective():
    """The 2-d (S(0), S(1)) -> (B, B) plan (zero-fill, then one all-reduce) runs on the values'
    bits: still one all-reduce, and -0.0 comes back -0.0."""
    plc = P2()
    v = _signed_zeros((8, 4))
    x = jsbp.tensor(v, placement=plc, sbp=("S(0)", "S(1)"))
    counts = count_collectives(lambda t: t.to_global(sbp=("B", "B")), x)
    assert counts["all-reduce"] == 1 and sum(counts.values()) == 1, counts
    np.testing.assert_array_equal(np.signbit(x.to_global(sbp=("B", "B")).numpy()), np.signbit(v))


@pytest.mark.parametrize("hier,shape", GRID)
@pytest.mark.parametrize("red", ["max", "min"])
def test_max_min_of_signed_zeros_over_a_split_dim(hier, shape, red):
    """max / min over a split dim of a mix of -0.0 and 0.0 answer as one device's jnp.max /
    jnp.min (min -0.0, max 0.0 wherever both are present), eagerly and under jsbp.jit."""
    plc = P1() if hier == "4" else P2()
    srcs = _sb(plc.ndim)
    if plc.ndim == 2 and not FULL:  # the default run: a split of dim 0 on either axis or both
        srcs = [("S(0)", "S(0)"), ("S(0)", "S(1)"), ("B", "S(0)")]
    if True:
        v = _signed_zeros(shape, seed=1)
        for src in srcs:
            x = jsbp.tensor(v, placement=plc, sbp=src)
            for axis in (0, 1):
                want = np.asarray(getattr(jnp, red)(jnp.asarray(v), axis))
                got = getattr(x, red)(axis)
                np.testing.assert_array_equal(
                    np.signbit(got.numpy()), np.signbit(want), err_msg=f"{src} {axis}"
                )
                jitted = jsbp.jit(
                    lambda t, axis=axis: getattr(jnp, red)(t, axis), out_sbp=("B",) * plc.ndim
                )(x)
                np.testing.assert_array_equal(
                    np.signbit(jitted.numpy()), np.signbit(want), err_msg=f"jit {src} {axis}"
                )


def test_partial_max_min_numpy_reads_in_total_order():
    """``numpy()`` of a Pmax / Pmin tensor orders -0.0 below 0.0 (numpy's max / min of the two
    return either) and propagates NaN, as the devices' own all-reduce does."""
    plc = P1()
    v = _signed_zeros((4, 6))
    v[0], v[3] = -0.0, 0.0  # both zeros in every column, on different devices
    x = jsbp.tensor(v, placement=plc, sbp="S(0)")
    for red in ("max", "min"):
        p = getattr(x, red)(0)
        assert p.sbp == ((sbp.partial_max if red == "max" else sbp.partial_min),)
        np.testing.assert_array_equal(
            np.signbit(p.numpy()), np.signbit(p.to_global(sbp="B").numpy())
        )
        np.testing.assert_array_equal(np.signbit(p.numpy()), red == "min")
    v = np.ones((4, 3), np.float32)
    v[2, 1] = np.nan
    p = jsbp.tensor(v, placement=plc, sbp="S(0)").max(0)
    assert np.isnan(p.numpy()[1]) and not np.isnan(p.numpy()[0])


def test_full_keeps_the_sign_of_a_zero_fill():
    """``full`` caches its program per fill value: ``-0.0`` (equal to, and hashed as, ``0.0``)
    is its own fill."""
    plc = P1()
    assert not np.signbit(jsbp.full((4,), 0.0, placement=plc, sbp="S(0)").numpy()).any()
    assert np.signbit(jsbp.full((4,), -0.0, placement=plc, sbp="S(0)").numpy()).all()
    assert np.signbit(jsbp.full((4,), np.float32(-0.0), placement=plc, sbp="S(0)").numpy()).all()


# -- default dtypes under jax_enable_x64 ----------------------------------------------------------


def test_creation_defaults_follow_jnp_under_x64():
    """``jsbp.full / zeros / ones / arange`` take ``jnp``'s default dtypes, with and without
    ``jax_enable_x64`` (a subprocess: x64 is process-wide)."""
    code = textwrap.dedent("""
        import os
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        import jax.numpy as jnp
        import jsbp
        p = jsbp.placement("cpu", [0, 1, 2, 3])
        kw = dict(placement=p, sbp="B")
        for x64 in (False, True):
            jax.config.update("jax_enable_x64", x64)
            cases = [
                (jsbp.zeros(4, **kw), jnp.zeros(4)), (jsbp.ones(2, 3, **kw), jnp.ones((2, 3))),
                (jsbp.full((3,), 1.5, **kw), jnp.full((3,), 1.5)), (jsbp.full((3,), 2, **kw), jnp.full((3,), 2)),
                (jsbp.full((3,), True, **kw), jnp.full((3,), True)), (jsbp.full((3,), 1j, **kw), jnp.full((3,), 1j)),
                (jsbp.arange(5, **kw), jnp.arange(5)), (jsbp.arange(0.5, 3, **kw), jnp.arange(0.5, 3)),
            ]
            bad = [(str(a.dtype), str(b.dtype)) for a, b in cases if a.dtype != b.dtype]
            print(x64, "BAD" if bad else "OK", bad)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "OK", "[]", "True", "OK", "[]"], out.stdout
