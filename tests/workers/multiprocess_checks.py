"""Run under ``python -m jsbp.launch --nproc-per-node 2 --devices-per-process 4``: one global
8-device placement over two processes, checked against a NumPy oracle on every process.

Prints one JSON line ``{"rank", "world", "checks": [...], "failures": [...]}`` and exits 1 if
any check failed. The oracle (``np.array_split`` per axis, outer axis first) is independent of
``jsbp._layout``. Partial values are built with ``from_local`` from a different addend on every
device, so a boxing step that drops or double-counts an addend shows up.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import os
import random
import sys
import time
import traceback

import jsbp

T0 = time.perf_counter()

CFG = jsbp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

RANK = jsbp.env.get_rank()
WORLD = jsbp.env.get_world_size()
IDS = np.array([d.id for d in jax.devices()])  # global device ids, process-major
MINE = {d.id for d in jax.local_devices()}

VERBOSE = bool(os.environ.get("JSBP_WORKER_VERBOSE"))
if VERBOSE:
    faulthandler.dump_traceback_later(float(os.environ["JSBP_WORKER_VERBOSE"]), exit=True)

checks: list[str] = []
failures: list[dict] = []


def check(name, fn):
    checks.append(name)
    if VERBOSE:
        print(f"check: {name} (t={time.perf_counter() - T0:.1f}s)", flush=True)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report every failure, keep going
        failures.append(
            {
                "check": name,
                "error": f"{type(e).__name__}: {e}",
                "tb": traceback.format_exc()[-1500:],
            }
        )


# -- oracle ------------------------------------------------------------------------------------


def parse(s):
    return None if s in ("B", "P") else int(s[2:-1])


def block_index(shape, hierarchy, nd, coord):
    idx = [np.arange(n) for n in shape]
    for a, s in enumerate(nd):
        d = parse(s)
        if d is not None:
            idx[d] = np.array_split(idx[d], hierarchy[a])[coord[a]]
    return np.ix_(*idx) if shape else ()


def addend_id(hierarchy, nd, coord):
    i = 0
    for a, s in enumerate(nd):
        if s == "P":
            i = i * hierarchy[a] + coord[a]
    return i


def n_addends(hierarchy, nd):
    return int(np.prod([hierarchy[a] for a, s in enumerate(nd) if s == "P"] or [1]))


def value(shape, seed):
    return np.random.default_rng(seed).integers(-9, 10, size=shape).astype(np.float32)


def addends(shape, k, seed):
    rng = np.random.default_rng(seed + 1000)
    return [rng.integers(-9, 10, size=shape).astype(np.float32) for _ in range(k)]


def coords(hierarchy):
    return list(itertools.product(*(range(h) for h in hierarchy)))


def make(plc, nd, shape, seed):
    """A global tensor of logical value ``value(shape, seed)`` built with from_local; P axes hold
    different addends (the last one chosen so the sum is the value)."""
    h = plc.hierarchy
    v = value(shape, seed)
    k = n_addends(h, nd)
    parts = addends(shape, k, seed)
    parts[-1] = v - sum(parts[:-1], np.zeros(shape, np.float32))
    locals_ = []
    for c, dev in zip(coords(h), plc.ranks.reshape(-1)):
        if int(dev) in MINE:
            locals_.append(parts[addend_id(h, nd, c)][block_index(shape, h, nd, c)])
    x = jsbp.from_local(locals_, placement=plc, sbp=nd)
    assert x.shape == tuple(shape), (x.shape, shape)
    return x, v


def expect_locals(x, v, nd):
    """to_local() on this process equals the oracle blocks of its own devices (S / B axes)."""
    plc = x.placement
    want = [
        v[block_index(v.shape, plc.hierarchy, nd, c)]
        for c, dev in zip(coords(plc.hierarchy), plc.ranks.reshape(-1))
        if int(dev) in MINE
    ]
    got = x.to_local()
    assert len(got) == len(want), (len(got), len(want))
    if "P" in nd:
        for g, w in zip(got, want):
            assert tuple(g.shape) == w.shape, (g.shape, w.shape)
        return
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def box_case(plc, src, dst, shape, seed):
    def run():
        x, v = make(plc, src, shape, seed)
        y = x.to_global(sbp=dst)
        np.testing.assert_array_equal(y.numpy(), v)
        expect_locals(y, v, dst)

    return run


# -- placements --------------------------------------------------------------------------------

P8 = jsbp.placement("cpu", IDS)
Q = jsbp.placement("cpu", IDS.reshape(2, 4), axis_names=("dp", "tp"))  # dp crosses processes
Q2 = jsbp.placement("cpu", IDS.reshape(4, 2).T, axis_names=("dp", "tp"))  # tp crosses processes
PA = jsbp.placement("cpu", IDS[:4])  # process 0 only
PB = jsbp.placement("cpu", IDS[4:])  # process 1 only
P8R = jsbp.placement("cpu", IDS[::-1])
NAMES = ("S(0)", "S(1)", "B", "P")


def env_checks():
    assert WORLD == 2 and CFG.world_size == 2 and CFG.source == "env", CFG
    assert jax.process_count() == 2 and jax.process_index() == RANK
    assert len(IDS) == 8 and len(MINE) == 4
    assert jsbp.distributed.is_initialized()
    assert jsbp.env.get_local_rank() == RANK


check("env", env_checks)

# 1-d: every SBP pair, uneven and even
for src, dst in itertools.product(NAMES, NAMES):
    check(f"box1d {src}->{dst} (7,5)", box_case(P8, (src,), (dst,), (7, 5), 1))
for src, dst in [("S(0)", "S(1)"), ("P", "S(0)")]:
    check(f"box1d {src}->{dst} (8,16)", box_case(P8, (src,), (dst,), (8, 16), 2))
check("box1d S(0)->B (3,2) empty shards", box_case(P8, ("S(0)",), ("B",), (3, 2), 3))
check("box1d P->S(0) (3,2) empty shards", box_case(P8, ("P",), ("S(0)",), (3, 2), 4))

# 2-d: a deterministic sample of nd-sbp pairs on both arrangements
ND = list(itertools.product(NAMES, NAMES))
rng = random.Random(0)
pairs = rng.sample(list(itertools.product(ND, ND)), 12) + [
    (("S(0)", "S(1)"), ("B", "B")),
    (("P", "P"), ("S(0)", "S(1)")),
    (("S(0)", "S(0)"), ("S(1)", "S(1)")),
    (("P", "S(1)"), ("S(0)", "B")),
]
for i, (src, dst) in enumerate(pairs):
    plc = Q if i % 2 == 0 else Q2
    shape = (5, 7) if i % 3 else (8, 8)
    check(
        f"box2d {plc.axis_names}{plc.hierarchy} {src}->{dst} {shape} [{'Q' if plc is Q else 'Q2'}]",
        box_case(plc, src, dst, shape, 10 + i),
    )


def tensor_roundtrip():
    v = value((7, 5), 5)
    for plc, nd in [
        (P8, "S(0)"),
        (P8, "S(1)"),
        (P8, "B"),
        (P8, "P"),
        (Q, ("S(1)", "S(0)")),
        (Q2, ("P", "S(0)")),
    ]:
        x = jsbp.tensor(v, placement=plc, sbp=nd)
        np.testing.assert_array_equal(x.numpy(), v)
        np.testing.assert_array_equal(np.asarray(x), v)


check("tensor/numpy", tensor_roundtrip)


def from_local_uneven():
    sizes = [3, 0, 2, 1, 1, 2, 0, 4]  # not the balanced split: from_local must reject it
    full = value((13, 3), 6)
    offs = np.cumsum([0] + sizes)
    mine = [full[offs[i] : offs[i + 1]] for i, d in enumerate(IDS) if int(d) in MINE]
    try:
        jsbp.from_local(mine, placement=P8, sbp="S(0)")
    except jsbp.SbpError as e:
        assert "balanced" in str(e), e
    else:
        raise AssertionError("from_local accepted unbalanced local shapes")
    sizes = [2, 2, 2, 2, 2, 1, 1, 1]  # 13 over 8, balanced
    offs = np.cumsum([0] + sizes)
    mine = [full[offs[i] : offs[i + 1]] for i, d in enumerate(IDS) if int(d) in MINE]
    x = jsbp.from_local(mine, placement=P8, sbp="S(0)")
    assert x.shape == (13, 3), x.shape
    np.testing.assert_array_equal(x.numpy(), full)
    got = x.to_local()
    assert [g.shape[0] for g in got] == sizes[4 * RANK : 4 * RANK + 4], [g.shape for g in got]


check("from_local infers shape across processes", from_local_uneven)


def from_local_partial_per_process():
    # every device holds (its flat index + 1) * ones; the value is the sum 36 * ones
    mine = [np.full((2, 3), i + 1, np.float32) for i, d in enumerate(IDS) if int(d) in MINE]
    x = jsbp.from_local(mine, placement=P8, sbp="P")
    np.testing.assert_array_equal(x.numpy(), np.full((2, 3), 36, np.float32))
    loc = x.to_local()
    np.testing.assert_array_equal(np.stack([np.asarray(a) for a in loc]), np.stack(mine))


check("from_local P addends per process", from_local_partial_per_process)


def cross_placement():
    v = value((7, 5), 7)
    a = jsbp.tensor(v, placement=PA, sbp="S(0)")
    assert len(a.to_local()) == (4 if RANK == 0 else 0)
    np.testing.assert_array_equal(a.numpy(), v)  # process 1 owns none of PA's devices
    b = a.to_global(placement=PB, sbp="S(1)")  # process 0 -> process 1 only
    np.testing.assert_array_equal(b.numpy(), v)
    expect_locals(b, v, ("S(1)",))
    c = b.to_global(placement=P8, sbp="B")
    np.testing.assert_array_equal(c.numpy(), v)
    expect_locals(c, v, ("B",))
    d = c.to_global(placement=Q2, sbp=("S(1)", "P"))  # different hierarchy
    np.testing.assert_array_equal(d.numpy(), v)
    e = d.to_global(placement=P8R, sbp="S(0)")
    np.testing.assert_array_equal(e.numpy(), v)
    expect_locals(e, v, ("S(0)",))
    f = e.to_global(placement=PA, sbp="P")  # back to process 0 only
    np.testing.assert_array_equal(f.numpy(), v)


check("cross-placement moves", cross_placement)


def from_local_placement_of_one_process():
    # PA belongs to process 0; process 1 passes no locals and still gets the tensor (no shards)
    v = value((4, 2), 8)
    mine = [v[i : i + 1] for i, d in enumerate(IDS[:4]) if int(d) in MINE]
    x = jsbp.from_local(mine, placement=PA, sbp="S(0)")
    assert x.shape == (4, 2) and x.dtype == np.float32, (x.shape, x.dtype)
    assert len(x.to_local()) == (4 if RANK == 0 else 0)
    np.testing.assert_array_equal(x.numpy(), v)
    y = x.to_global(sbp="B")  # boxing on a placement of the other process
    np.testing.assert_array_equal(y.numpy(), v)


check("from_local on a one-process placement", from_local_placement_of_one_process)


def factories():
    key = jax.random.key(3)
    want = np.asarray(jax.random.normal(key, (6, 5)))
    for plc, nd in [(P8, "S(0)"), (Q, ("S(1)", "B")), (Q2, ("B", "S(0)"))]:
        np.testing.assert_array_equal(
            jsbp.randn(6, 5, key=key, placement=plc, sbp=nd).numpy(), want
        )
    np.testing.assert_array_equal(
        jsbp.zeros(5, 3, placement=Q, sbp=("S(0)", "S(1)")).numpy(), np.zeros((5, 3))
    )
    np.testing.assert_array_equal(jsbp.ones(9, placement=P8, sbp="S(0)").numpy(), np.ones(9))
    np.testing.assert_array_equal(jsbp.arange(11, placement=P8, sbp="S(0)").numpy(), np.arange(11))
    np.testing.assert_array_equal(
        jsbp.full((3, 3), 2.5, placement=P8, sbp="P").numpy(), np.full((3, 3), 2.5)
    )


check("factories", factories)


def jax_array_input():
    import jax.numpy as jnp

    v = value((6, 4), 9)
    for plc, nd in [(P8, "S(0)"), (Q, ("S(1)", "P")), (PA, "B")]:
        np.testing.assert_array_equal(jsbp.tensor(jnp.asarray(v), placement=plc, sbp=nd).numpy(), v)


check("tensor from a jax.Array", jax_array_input)


def eager_ops():
    a, va = make(Q, ("S(0)", "B"), (6, 5), 20)
    w, vw = make(Q, ("B", "S(1)"), (5, 7), 21)
    np.testing.assert_array_equal((a @ w).numpy(), va @ vw)
    b, vb = make(Q, ("P", "S(1)"), (6, 5), 22)
    np.testing.assert_array_equal((a + b).numpy(), va + vb)
    np.testing.assert_array_equal((a * 2 - b).sum(0).numpy(), (va * 2 - vb).sum(0))


check("eager ops", eager_ops)


def compiled():
    x, vx = make(Q2, ("S(0)", "S(1)"), (8, 6), 30)
    w, vw = make(Q2, ("B", "S(0)"), (6, 4), 31)

    @jsbp.jit
    def f(x, w):
        return jax.numpy.tanh(x @ w).sum(1), (x * x).sum()

    r, t = f(x, w)
    np.testing.assert_allclose(r.numpy(), np.tanh(vx @ vw).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(t.numpy(), (vx * vx).sum())


check("jsbp.jit", compiled)

print(
    json.dumps({"rank": RANK, "world": WORLD, "checks": checks, "failures": failures}), flush=True
)
sys.exit(1 if failures else 0)
