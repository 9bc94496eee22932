"""jsbp.checkpoint: save by logical value, load onto any layout / device count, safely.

The oracle is the numpy value each tensor was built from: every load must give it back bit-exactly
(``np.array_equal`` of ``numpy()``) on the target placement and nd-sbp, with ``to_local`` blocks
that follow the target layout (OneFlow's balanced splitter). Saved tensors on a ``P`` layout are
built so that the sum of addends is exact (value + zeros, or small integers).

The grid of (save placement, save sbp) x (load placement, load sbp) is exhaustive on the save side
and sampled on the load side by default; ``JSBP_FULL=1`` runs every load layout too.
"""

from __future__ import annotations

import errno
import importlib.util
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jsbp
from jsbp import checkpoint as ck
from jsbp.checkpoint import CheckpointError, CheckpointWarning, TensorSpec
from jsbp.checkpoint._storage import storage_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")
FULL = os.environ.get("JSBP_FULL") == "1"


def _worker_module(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(WORKERS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -------------------------------------------------------------------------------------------
# the layout grid
# -------------------------------------------------------------------------------------------

PLACEMENTS = {
    "(8,)": list(range(8)),
    "(4,)": [0, 1, 2, 3],
    "(2,2)": [[4, 5], [6, 7]],
    "(2,4)": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "(1,)": [5],
}
SBPS_1D = ("S(0)", "S(1)", "B", "P")
SHAPES = [(25, 33), (3, 5), (16, 8)]


def _all_layouts() -> list[tuple[str, tuple[str, ...]]]:
    out = []
    for name, ranks in PLACEMENTS.items():
        ndim = np.ndim(ranks)
        out += [(name, nd) for nd in itertools.product(SBPS_1D, repeat=ndim)]
    return out


LAYOUTS = _all_layouts()  # 4 + 4 + 16 + 16 + 4 = 44
REQUIRED_LOADS = [("(2,2)", ("S(1)", "B")), ("(4,)", ("S(0)",)), ("(1,)", ("B",))]


def _plc(name: str) -> jsbp.placement:
    return jsbp.placement("cpu", PLACEMENTS[name])


def _value(shape, seed=0) -> np.ndarray:
    return np.random.default_rng([seed, *shape]).standard_normal(shape).astype(np.float32)


def _check(x, v: np.ndarray, plc, nd, what: str = "") -> None:
    """``x`` is ``v`` on ``plc`` / ``nd``, bit-exactly, with local blocks that follow its layout."""
    assert isinstance(x, jsbp.GlobalTensor), what
    assert x.placement == plc, what
    assert tuple(str(s) for s in x.sbp) == tuple(nd), (what, x.sbp)
    assert x.shape == v.shape and np.dtype(x.dtype) == v.dtype, (what, x)
    got = x.numpy()
    assert got.dtype == v.dtype and np.array_equal(got, v), what
    locs = x.to_local()
    assert [tuple(a.shape) for a in locs] == [tuple(s for _, s in b) for b in x.layout.blocks], what
    if not x.layout.partial_axes:
        for a, blk in zip(locs, x.layout.blocks):
            assert np.array_equal(np.asarray(a), v[tuple(slice(o, o + s) for o, s in blk)]), what


def _grid_case(tmp_path, shape, loads) -> int:
    """Save one tensor per save layout, load all of them onto each layout in ``loads``."""
    v = _value(shape)
    tree = [jsbp.tensor(v, placement=_plc(p), sbp=nd) for p, nd in LAYOUTS]
    path = ck.save(tmp_path / "grid", tree)
    checked = 0
    for p, nd in loads:
        target = [TensorSpec(shape, np.float32, _plc(p), nd) for _ in LAYOUTS]
        out = ck.load(path, target)
        for (sp, snd), x in zip(LAYOUTS, out):
            _check(x, v, _plc(p), nd, f"saved on {sp} {snd}, loaded on {p} {nd}, shape {shape}")
            checked += 1
    return checked


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip_grid_sampled(tmp_path, shape):
    rng = random.Random(f"grid-{shape}")
    loads = REQUIRED_LOADS + rng.sample([lay for lay in LAYOUTS if lay not in REQUIRED_LOADS], 3)
    assert _grid_case(tmp_path, shape, loads) == len(LAYOUTS) * len(loads)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full 44 x 44 grid runs with JSBP_FULL=1")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip_grid_full(tmp_path, shape):
    assert _grid_case(tmp_path, shape, LAYOUTS) == len(LAYOUTS) ** 2


def test_saved_from_8_split_loads_on_2x2_and_on_4(tmp_path):
    """The issue's example, spelled out: (8,) S(0) -> (2,2) (S(1), B) and -> 4 devices."""
    v = _value((1024, 64), seed=3)
    x = jsbp.tensor(v, placement=_plc("(8,)"), sbp="S(0)")
    path = ck.save(tmp_path / "c", {"w": x})
    a = ck.load(path, {"w": TensorSpec(v.shape, v.dtype, _plc("(2,2)"), ("S(1)", "B"))})["w"]
    _check(a, v, _plc("(2,2)"), ("S(1)", "B"))
    b = ck.load(path, {"w": jsbp.zeros(1024, 64, placement=_plc("(4,)"), sbp="S(0)")})["w"]
    _check(b, v, _plc("(4,)"), ("S(0)",))
    assert [tuple(t.shape) for t in b.to_local()] == [(256, 64)] * 4


_RAW_ORBAX = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")


@_RAW_ORBAX
def test_real_partial_sum_is_reduced_on_save(tmp_path):
    """Four different addends (small integers, so every summation order is exact)."""
    p4 = _plc("(4,)")
    addends = [
        np.full((5, 3), i + 1, np.float32) * np.arange(15, dtype=np.float32).reshape(5, 3)
        for i in range(4)
    ]
    x = jsbp.from_local(addends, placement=p4, sbp="P")
    want = np.sum(addends, axis=0)
    path = ck.save(tmp_path / "p", {"x": x})
    out = ck.load(path, {"x": TensorSpec((5, 3), np.float32, _plc("(2,4)"), ("S(0)", "P"))})["x"]
    _check(out, want, _plc("(2,4)"), ("S(0)", "P"))
    # the stored array is the logical value itself: readable by plain orbax, no addends, no padding
    raw = ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"))
    assert list(raw) == ["leaf_00000"]
    assert raw["leaf_00000"].shape == (5, 3) and np.array_equal(np.asarray(raw["leaf_00000"]), want)


@_RAW_ORBAX
def test_uneven_tensor_is_stored_without_padding(tmp_path):
    v = _value((25, 33))
    x = jsbp.tensor(v, placement=_plc("(2,4)"), sbp=("S(0)", "S(1)"))
    assert x.physical.shape != v.shape  # padded in memory...
    path = ck.save(tmp_path / "u", {"x": x})
    raw = ocp.PyTreeCheckpointer().restore(os.path.join(path, "state"))
    assert np.asarray(raw["leaf_00000"]).shape == (25, 33)  # ...but not on disk
    assert np.array_equal(np.asarray(raw["leaf_00000"]), v)


@pytest.mark.parametrize(
    "hierarchy, nd, shape, want",
    [
        ((8,), ("S(0)",), (1024, 64), ("S(0)",)),  # even: kept, nothing gathered
        ((8,), ("S(0)",), (25, 64), ("S(1)",)),  # uneven dim 0: moves to the even dim 1
        ((8,), ("S(0)",), (25, 33), ("B",)),  # nothing divides: gathered
        ((8,), ("P",), (24, 5), ("S(0)",)),  # P: reduce-scattered onto an even dim
        ((8,), ("P",), (3, 5), ("B",)),
        ((2, 4), ("S(0)", "S(1)"), (6, 8), ("S(0)", "S(1)")),
        ((2, 4), ("S(0)", "S(0)"), (8, 3), ("S(0)", "S(0)")),
        ((2, 4), ("S(0)", "S(0)"), (6, 3), ("S(0)", "B")),  # 6 splits in 2, not in 2 x 4
        ((2, 4), ("B", "P"), (6, 12), ("B", "S(1)")),
        ((2, 2), ("P", "P"), (), ("B", "B")),  # a scalar
    ],
)
def test_storage_layout_is_even_and_close(hierarchy, nd, shape, want):
    ranks = np.arange(int(np.prod(hierarchy))).reshape(hierarchy)
    lay = jsbp.tensor(
        np.zeros(shape, np.float32), placement=jsbp.placement("cpu", ranks), sbp=nd
    ).layout
    st = storage_layout(lay)
    assert tuple(str(s) for s in st.nd_sbp) == want
    assert st.is_even and not st.partial_axes and st.physical_shape == tuple(shape)


def test_dtypes_scalars_and_plain_arrays(tmp_path):
    p8, q = _plc("(8,)"), _plc("(2,2)")
    vals = {
        "i": np.arange(21, dtype=np.int32).reshape(3, 7),
        "h": _value((9, 4)).astype(jnp.bfloat16),
        "m": (np.arange(10) % 3 == 0),
        "u": np.arange(12, dtype=np.uint8).reshape(4, 3),
        "s": np.float32(2.5),
    }
    tree = {
        "i": jsbp.tensor(vals["i"], placement=p8, sbp="S(1)"),
        "h": jsbp.tensor(vals["h"], placement=p8, sbp="P"),
        "m": jsbp.tensor(vals["m"], placement=p8, sbp="S(0)"),
        "u": jsbp.tensor(vals["u"], placement=p8, sbp="B"),
        "s": jsbp.tensor(vals["s"], placement=p8, sbp="P"),
        "empty": jsbp.zeros(0, 4, placement=p8, sbp="S(0)"),
        "np": np.arange(6, dtype=np.int64).reshape(2, 3),
        "np_scalar": np.float64(1.25),
        "jax": jnp.arange(10.0),
        "step": 12,
        "lr": 3e-4,
        "done": False,
    }
    path = ck.save(tmp_path / "d", tree)
    target = {
        "i": TensorSpec((3, 7), np.int32, q, ("S(0)", "S(1)")),
        "h": TensorSpec((9, 4), jnp.bfloat16, q, ("B", "S(0)")),
        "m": TensorSpec((10,), np.bool_, q, ("S(0)", "P")),
        "u": TensorSpec((4, 3), np.uint8, q, ("S(1)", "S(0)")),
        "s": TensorSpec((), np.float32, q, ("B", "P")),
        "empty": TensorSpec((0, 4), np.float32, q, ("S(0)", "B")),
        "np": np.zeros((2, 3), np.int64),
        "np_scalar": np.float64(0),
        "jax": jax.ShapeDtypeStruct(
            (10,), jnp.float32, sharding=NamedSharding(q.mesh, PartitionSpec("ax1"))
        ),
        "step": 0,
        "lr": 0.0,
        "done": True,
    }
    out = ck.load(path, target)
    for k in ("i", "h", "m", "u", "s"):
        _check(out[k], np.asarray(vals[k]), q, tuple(str(s) for s in target[k].sbp), k)
    _check(out["empty"], np.zeros((0, 4), np.float32), q, ("S(0)", "B"))
    assert out["np"].dtype == np.int64 and np.array_equal(out["np"], tree["np"])
    assert isinstance(out["np_scalar"], np.float64) and out["np_scalar"] == 1.25
    assert isinstance(out["jax"], jax.Array) and out["jax"].sharding == target["jax"].sharding
    assert np.array_equal(np.asarray(out["jax"]), np.arange(10.0, dtype=np.float32))
    assert (out["step"], out["lr"], out["done"]) == (12, 3e-4, False)
    assert type(out["step"]) is int and type(out["done"]) is bool


# -------------------------------------------------------------------------------------------
# targets: trees, rules, None; NNX state
# -------------------------------------------------------------------------------------------


def test_rule_and_none_targets(tmp_path):
    v, w = _value((25, 33)), _value((7,), seed=1)
    tree = {
        "layers": [
            {"w": jsbp.tensor(v, placement=_plc("(8,)"), sbp="S(0)")},
            {"b": jsbp.tensor(w, placement=_plc("(2,2)"), sbp=("P", "S(0)"))},
        ],
        "step": 5,
        "host": np.arange(3),
    }
    path = ck.save(tmp_path / "r", tree)
    seen = []

    def rule(p, shape):
        seen.append((p, shape))
        return (_plc("(2,4)"), ("S(1)", "S(0)")) if len(shape) == 2 else (_plc("(4,)"), "S(0)")

    out = ck.load(path, rule)
    assert sorted(seen) == [("['layers'][0]['w']", (25, 33)), ("['layers'][1]['b']", (7,))]
    _check(out["layers"][0]["w"], v, _plc("(2,4)"), ("S(1)", "S(0)"))
    _check(out["layers"][1]["b"], w, _plc("(4,)"), ("S(0)",))
    assert out["step"] == 5 and np.array_equal(out["host"], np.arange(3))
    same = ck.load(path)  # as saved
    _check(same["layers"][0]["w"], v, _plc("(8,)"), ("S(0)",))
    _check(same["layers"][1]["b"], w, _plc("(2,2)"), ("P", "S(0)"))
    mixed = ck.load(
        path, lambda p, s: None if "w" in p else TensorSpec(s, np.float32, _plc("(1,)"), "B")
    )
    _check(mixed["layers"][0]["w"], v, _plc("(8,)"), ("S(0)",))
    _check(mixed["layers"][1]["b"], w, _plc("(1,)"), ("B",))
    with pytest.raises(CheckpointError, match=r"rule returned 3 for \['layers'\]"):
        ck.load(path, lambda p, s: 3)


def test_nnx_state_round_trip(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    def globalize(model, plc, sbps):
        for name, nd in sbps.items():
            var = getattr(model, name)
            var.set_value(jsbp.tensor(np.asarray(var.get_value()), placement=plc, sbp=nd))
        return model

    p8, q = _plc("(8,)"), _plc("(2,2)")
    model = globalize(nnx.Linear(5, 7, rngs=nnx.Rngs(0)), p8, {"kernel": "S(1)", "bias": "B"})
    state = nnx.state(model)
    kernel, bias = model.kernel.get_value().numpy(), model.bias.get_value().numpy()
    # stand-in optimizer state: Adam moments with the params' layouts, and a step count
    opt = {
        "mu": jax.tree.map(lambda t: t * 0.5, {"kernel": kernel, "bias": bias}),
        "count": np.int32(3),
    }
    opt_g = {
        "mu": {
            "kernel": jsbp.tensor(opt["mu"]["kernel"], placement=p8, sbp="P"),
            "bias": jsbp.tensor(opt["mu"]["bias"], placement=p8, sbp="S(0)"),
        },
        "count": opt["count"],
    }
    path = ck.save(tmp_path / "nnx", {"model": state, "opt": opt_g})

    other = globalize(
        nnx.Linear(5, 7, rngs=nnx.Rngs(1)), q, {"kernel": ("S(0)", "P"), "bias": ("S(0)", "B")}
    )
    assert not np.array_equal(other.kernel.get_value().numpy(), kernel)
    target_opt = {
        "mu": {
            "kernel": TensorSpec((5, 7), np.float32, q, ("S(1)", "S(0)")),
            "bias": TensorSpec((7,), np.float32, _plc("(1,)"), "B"),
        },
        "count": np.int32(0),
    }
    out = ck.load(path, {"model": nnx.state(other), "opt": target_opt})
    assert isinstance(out["model"], nnx.State)
    nnx.update(other, out["model"])
    _check(other.kernel.get_value(), kernel, q, ("S(0)", "P"))
    _check(other.bias.get_value(), bias, q, ("S(0)", "B"))
    _check(out["opt"]["mu"]["kernel"], opt["mu"]["kernel"], q, ("S(1)", "S(0)"))
    _check(out["opt"]["mu"]["bias"], opt["mu"]["bias"], _plc("(1,)"), ("B",))
    assert out["opt"]["count"] == 3


# -------------------------------------------------------------------------------------------
# errors
# -------------------------------------------------------------------------------------------


@pytest.fixture
def small_ckpt(tmp_path):
    tree = {
        "w": jsbp.tensor(_value((25, 33)), placement=_plc("(8,)"), sbp="S(0)"),
        "b": jsbp.ones(16, placement=_plc("(4,)"), sbp="B"),
    }
    return ck.save(tmp_path / "small", tree)


def _good_target(plc=None):
    plc = plc or _plc("(4,)")
    return {
        "w": TensorSpec((25, 33), np.float32, plc, "S(0)"),
        "b": TensorSpec((16,), np.float32, plc, "B"),
    }


def test_target_shape_and_dtype_mismatch_name_the_path(small_ckpt):
    t = _good_target()
    t["w"] = TensorSpec((33, 25), np.float32, _plc("(4,)"), "S(0)")
    with pytest.raises(
        CheckpointError,
        match=r"\['w'\].*saved with shape \(25, 33\) float32.*expects shape \(33, 25\) float32",
    ):
        ck.load(small_ckpt, t)
    t = _good_target()
    t["b"] = jsbp.ones(16, placement=_plc("(4,)"), sbp="B", dtype=jnp.int32)
    with pytest.raises(
        CheckpointError, match=r"\['b'\].*shape \(16,\) float32.*expects shape \(16,\) int32"
    ):
        ck.load(small_ckpt, t)


def test_target_structure_mismatch(small_ckpt):
    with pytest.raises(
        CheckpointError, match=r"does not have: \['bias'\].*does not ask for: \['b'\]"
    ):
        ck.load(small_ckpt, {"w": _good_target()["w"], "bias": _good_target()["b"]})
    with pytest.raises(CheckpointError, match=r"does not ask for: \['b'\].*strict=False"):
        ck.load(small_ckpt, {"w": _good_target()["w"]})
    out = ck.load(small_ckpt, {"w": _good_target()["w"]}, strict=False)
    assert list(out) == ["w"] and out["w"].shape == (25, 33)
    with pytest.raises(CheckpointError, match=r"target leaf at \['b'\] is a str"):
        ck.load(small_ckpt, {"w": _good_target()["w"], "b": "nope"})


def test_missing_checkpoint(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"no checkpoint at .*nowhere: the directory does not exist"
    ):
        ck.load(tmp_path / "nowhere", None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        CheckpointError,
        match=r"empty is not a complete jsbp checkpoint.*jsbp_manifest.json is missing",
    ):
        ck.load(tmp_path / "empty", None)


def _data_files(path) -> list[str]:
    """The tensorstore data files of a checkpoint, smallest first."""
    out = []
    for d, _, names in os.walk(os.path.join(path, "state")):
        if os.path.basename(d) == "d":
            out += [os.path.join(d, n) for n in names]
    assert out, path
    return sorted(out, key=os.path.getsize)


def test_corrupted_data_file_is_named(small_ckpt):
    victim = _data_files(small_ckpt)[-1]
    with open(victim, "r+b") as f:
        f.seek(os.path.getsize(victim) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=rf"{victim}.*does not match its SHA-256"):
        ck.load(small_ckpt, _good_target())
    with pytest.raises(CheckpointError, match=rf"{victim}"):
        ck.verify(small_ckpt)


def test_truncated_file_is_named(small_ckpt):
    victim = _data_files(small_ckpt)[-1]
    with open(victim, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=rf"{victim} has 10 bytes, but \d+ were written"):
        ck.load(small_ckpt, _good_target(), verify=False)


def test_deleted_file_is_named(small_ckpt):
    victim = _data_files(small_ckpt)[0]
    os.remove(victim)
    with pytest.raises(CheckpointError, match=rf"{victim} listed in its commit record is missing"):
        ck.load(small_ckpt, _good_target())


def test_damaged_manifest(small_ckpt):
    mpath = os.path.join(small_ckpt, "jsbp_manifest.json")
    doc = json.load(open(mpath))
    doc["jsbp_checkpoint"]["leaves"][0]["shape"] = [26, 33]  # a "plausible" edit
    json.dump(doc, open(mpath, "w"))
    with pytest.raises(CheckpointError, match=rf"{mpath} is damaged: its content does not match"):
        ck.load(small_ckpt, _good_target())
    open(mpath, "w").write('{"jsbp_checkpoint": {')
    with pytest.raises(CheckpointError, match=rf"{mpath} is damaged \(cannot read it"):
        ck.load(small_ckpt, _good_target())


def test_save_refuses_to_clobber_and_bad_leaves(tmp_path, small_ckpt):
    with pytest.raises(CheckpointError, match=r"already exists at .*small; pass overwrite=True"):
        ck.save(small_ckpt, {"x": 1})
    ck.save(small_ckpt, {"x": 1}, overwrite=True)
    assert ck.load(small_ckpt, {"x": 0}) == {"x": 1}
    with pytest.raises(CheckpointError, match=r"leaf at \['a'\]\[1\] is a str"):
        ck.save(tmp_path / "bad", {"a": [1, "text"]})
    assert not os.path.exists(tmp_path / "bad")


# -------------------------------------------------------------------------------------------
# steps, and saves killed half way
# -------------------------------------------------------------------------------------------


def test_steps_keep_and_latest(tmp_path):
    d = tmp_path / "run"
    assert ck.latest_step(d) is None and ck.all_steps(d) == []
    for s in (1, 2, 3, 10):
        ck.save_step(
            d,
            s,
            {"x": jsbp.full((3,), float(s), placement=_plc("(4,)"), sbp="S(0)"), "step": s},
            keep=3,
        )
    assert ck.all_steps(d) == [2, 3, 10] and ck.latest_step(d) == 10
    out = ck.load_step(
        d, 10, {"x": TensorSpec((3,), np.float32, _plc("(2,2)"), ("S(0)", "B")), "step": 0}
    )
    assert out["step"] == 10 and np.array_equal(out["x"].numpy(), np.full(3, 10.0, np.float32))
    assert ck.step_path(d, 10) == os.path.join(str(d), "step_10")
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*step_4"):
        ck.load_step(d, 4, None)


def _run_until_paused(tmp_path, point, args) -> None:
    """Start a save in a child process, wait until it reaches ``point``, then SIGKILL it."""
    sentinel = tmp_path / f"paused-{point}"
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.Popen(
        [
            sys.executable,
            os.path.join(WORKERS, "ckpt_kill_worker.py"),
            *map(str, args),
            f"{point}:{sentinel}",
        ],  # fmt: skip
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while not sentinel.exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"the save ended before {point}:\n{proc.stdout.read().decode()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"the save never reached {point}")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _target_of(kill_worker, plc_name, sbp_of):
    """A target for ``kill_worker.tree_values``: every tensor on ``plc_name`` with ``sbp_of(ndim)``."""
    vals = kill_worker.tree_values(0)
    t = {k: TensorSpec(v.shape, v.dtype, _plc(plc_name), sbp_of(v.ndim)) for k, v in vals.items()}
    t["step"] = 0
    return t


def _check_values(out, vals, target):
    for k, v in vals.items():
        _check(out[k], v, target[k].placement, tuple(str(s) for s in target[k].sbp), k)


def test_save_killed_before_commit_keeps_previous_step(tmp_path):
    kw = _worker_module("ckpt_kill_worker")
    d = tmp_path / "run"
    ck.save_step(d, 1, kw.build(jsbp, 1))
    _run_until_paused(tmp_path, "before_commit", ["step", d, 2])
    partial = d / "step_2.jsbp-partial"
    assert (partial / "state").is_dir() and any((partial / "state").iterdir())  # data was written
    assert not (partial / "jsbp_manifest.json").exists() and not (d / "step_2").exists()

    with pytest.warns(
        CheckpointWarning,
        match=r"step 2: .*step_2.jsbp-partial is an interrupted save.*Resuming from step 1",
    ):
        assert ck.latest_step(d) == 1
    target = _target_of(kw, "(2,2)", lambda ndim: ("S(1)", "S(0)") if ndim == 2 else ("S(0)", "B"))
    out = ck.load_step(d, 1, target)
    assert out["step"] == 1
    _check_values(out, kw.tree_values(1), target)
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint at .*step_2.*interrupted save was found at .*step_2.jsbp-partial",
    ):
        ck.load_step(d, 2, target)
    with pytest.raises(
        CheckpointError, match=r"step_2.jsbp-partial is not a complete jsbp checkpoint"
    ):
        ck.load(partial, target)

    ck.save_step(d, 2, kw.build(jsbp, 2))  # the next save of that step replaces the debris
    assert not partial.exists() and ck.all_steps(d) == [1, 2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ck.latest_step(d) == 2
    _check_values(ck.load_step(d, 2, target), kw.tree_values(2), target)


def test_overwrite_killed_between_renames_keeps_previous(tmp_path):
    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    _run_until_paused(tmp_path, "between_renames", ["overwrite", path, 2])
    assert not path.exists() and (tmp_path / "ckpt.jsbp-old").is_dir()
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    with pytest.warns(CheckpointWarning, match=r"interrupted save\(overwrite=True\)"):
        out = ck.load(path, target)
    assert out["step"] == 1
    _check_values(out, kw.tree_values(1), target)
    ck.save(path, kw.build(jsbp, 3), overwrite=True)  # repairs, then replaces
    assert not (tmp_path / "ckpt.jsbp-old").exists()
    _check_values(ck.load(path, target), kw.tree_values(3), target)


# -------------------------------------------------------------------------------------------
# two processes (4 simulated CPU devices each) <-> one process (8 devices)
# -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_launcher() -> bool:
    return importlib.util.find_spec("jsbp.launch") is not None


def _run_two_processes(mode: str, path) -> None:
    """Run ``ckpt_mp_worker.py <mode> <path>`` as 2 processes x 4 CPU devices: with
    ``python -m jsbp.launch`` when it exists, else with a minimal start of our own."""
    worker = os.path.join(WORKERS, "ckpt_mp_worker.py")
    env = dict(os.environ, PYTHONPATH=REPO)
    if _has_launcher():
        cmds = [[sys.executable, "-m", "jsbp.launch", "--nproc-per-node", "2",
                 "--devices-per-process", "4", worker, mode, str(path)]]  # fmt: skip
    else:
        port = str(_free_port())
        cmds = [[sys.executable, worker, mode, str(path), str(pid), port] for pid in range(2)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd in cmds
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=400)[0].decode())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = "\n".join(outs)
    assert all(p.returncode == 0 for p in procs), out[-6000:]
    for pid in range(2):
        assert f"CKPT-WORKER-OK {pid}" in out, out[-6000:]


def test_two_process_save_one_process_load(tmp_path):
    mw = _worker_module("ckpt_mp_worker")
    path = tmp_path / "mp"
    _run_two_processes("save", path)
    # both processes wrote their own shards (OCDBT keeps one sub-store per process)
    for pid in range(2):
        assert any((path / "state" / f"ocdbt.process_{pid}" / "d").iterdir())
    info = {e["path"]: e for e in ck.info(path)}
    assert info["['b']"]["sbp"] == "(P, S(1))" and "cpu:2x4" in info["['b']"]["placement"]
    vals = mw.values()
    q, p4 = _plc("(2,2)"), _plc("(4,)")
    target = {
        "w": TensorSpec((25, 33), np.float32, q, ("S(1)", "B")),
        "b": TensorSpec((6, 10), np.float32, p4, "S(0)"),
        "e": TensorSpec((16, 8), np.float32, _plc("(1,)"), "P"),
        "i": TensorSpec((3, 5), np.int32, q, ("S(0)", "S(1)")),
        "step": 0,
    }
    out = ck.load(path, target)
    assert out["step"] == 7
    _check_values(out, vals, target)


def test_one_process_save_two_process_load(tmp_path):
    mw = _worker_module("ckpt_mp_worker")
    vals = mw.values()
    ids = [d.id for d in jax.devices()]
    tree = {
        k: jsbp.tensor(vals[k], placement=plc, sbp=nd)
        for k, (plc, nd) in mw.save_layouts(jsbp, ids).items()
    }
    tree["step"] = 7
    path = ck.save(tmp_path / "sp", tree)
    _run_two_processes("load", path)  # the workers check every value and local shape


def test_docs_example_runs():
    """The first code block of docs/checkpoint.md executes as written (it asserts its results)."""
    with open(os.path.join(REPO, "docs", "checkpoint.md")) as f:
        block = f.read().split("```python\n", 1)[1].split("```", 1)[0]
    assert "ck.save(" in block and "ck.load(" in block
    exec(compile(block, "docs/checkpoint.md", "exec"), {})


def test_single_leaf_and_list_trees(tmp_path):
    v = np.arange(10, dtype=np.float32)
    x = jsbp.tensor(v, placement=_plc("(4,)"), sbp="S(0)")
    one = ck.save(tmp_path / "one", x)
    _check(
        ck.load(one, TensorSpec((10,), np.float32, _plc("(2,2)"), ("B", "P"))),
        v,
        _plc("(2,2)"),
        ("B", "P"),
    )
    _check(ck.load(one, lambda p, s: (_plc("(1,)"), "S(0)")), v, _plc("(1,)"), ("S(0)",))
    with pytest.raises(CheckpointError, match=r"leaf at the root .* expects shape \(11,\)"):
        ck.load(one, TensorSpec((11,), np.float32, _plc("(4,)"), "B"))
    lst = ck.save(tmp_path / "list", [x, (x, 3)])
    out = ck.load(lst, None)  # rebuilt: lists for sequence keys
    assert isinstance(out, list) and isinstance(out[1], list) and out[1][1] == 3
    _check(out[1][0], v, _plc("(4,)"), ("S(0)",))


# -------------------------------------------------------------------------------------------
# concurrent saves of one path: one wins, the other is told; the previous checkpoint survives
# -------------------------------------------------------------------------------------------

HELD = r"another save holds .*ckpt"


def _debris(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if ".jsbp-" in n)


def test_concurrent_saves_in_threads_one_wins(tmp_path, monkeypatch):
    import threading

    from jsbp.checkpoint import _backend

    kw = _worker_module("ckpt_kill_worker")
    trees = {s: kw.build(jsbp, s) for s in (1, 2)}
    write = _backend.write

    def slow_write(*a, **k):  # the winner holds the path for a while
        time.sleep(1.0)
        return write(*a, **k)

    monkeypatch.setattr(_backend, "write", slow_write)
    path = tmp_path / "ckpt"
    go, results = threading.Barrier(2), {}

    def run(seed):
        go.wait()
        try:
            ck.save(path, trees[seed])
            results[seed] = "ok"
        except Exception as e:  # noqa: BLE001 - the test looks at what it is
            results[seed] = e

    threads = [threading.Thread(target=run, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [s for s, r in results.items() if r == "ok"]
    assert len(winners) == 1, results
    (loser,) = {1, 2} - set(winners)
    assert isinstance(results[loser], CheckpointError), results[loser]
    assert re.search(HELD, str(results[loser])), results[loser]
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    _check_values(ck.load(path, target), kw.tree_values(winners[0]), target)
    assert _debris(tmp_path) == []


@pytest.mark.parametrize("point", ["locked", "before_commit", "between_renames"])
def test_overwrite_in_progress_blocks_other_saves_and_keeps_previous_loadable(
    tmp_path, monkeypatch, point
):
    """Stop an ``overwrite=True`` save (a thread) at each point of its sequence; there, a second
    save of the path fails with a clear error, and the path loads the previous checkpoint."""
    import threading

    from jsbp.checkpoint import _save

    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    new, third = kw.build(jsbp, 2), kw.build(jsbp, 3)
    reached, resume = threading.Event(), threading.Event()

    def pause(p):
        if p == point:
            reached.set()
            assert resume.wait(120)

    monkeypatch.setattr(_save, "_pause_point", pause)
    errors = []

    def overwrite():
        try:
            ck.save(path, new, overwrite=True)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=overwrite)
    t.start()
    try:
        assert reached.wait(120), errors
        for kwargs in ({"overwrite": True}, {}):
            with pytest.raises(CheckpointError) as e:
                ck.save(path, third, **kwargs)
            if kwargs:
                assert re.search(HELD, str(e.value)) and "wrote nothing" in str(e.value)
        target = _target_of(kw, "(2,2)", lambda ndim: ("S(0)", "B"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)  # between the renames: .jsbp-old
            _check_values(ck.load(path, target), kw.tree_values(1), target)
    finally:
        resume.set()
        t.join(120)
    assert not errors, errors
    _check_values(ck.load(path, target), kw.tree_values(2), target)
    assert _debris(tmp_path) == []


def _save_in_process(tmp_path, seed, path, pause=None):
    """A save of ``kill_worker.build(seed)`` in another process; ``pause``:
    ``<point>:<sentinel>[:<seconds>]`` (see ``ckpt_kill_worker.pause_at``)."""
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.Popen(
        [
            sys.executable,
            os.path.join(WORKERS, "ckpt_kill_worker.py"),
            "overwrite",
            str(path),
            str(seed),
            *([pause] if pause else []),
        ],  # fmt: skip
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_save_process_killed_while_another_saves(tmp_path):
    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    sentinel = tmp_path / "paused"
    a = _save_in_process(tmp_path, 2, path, f"before_commit:{sentinel}")
    try:
        deadline = time.monotonic() + 300
        while not sentinel.exists():  # A holds the lock, its data written, no commit yet
            assert a.poll() is None, a.communicate()[0]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        b = _save_in_process(tmp_path, 3, path)
        out = b.communicate(timeout=300)[0]
        assert b.returncode != 0 and re.search(r"CheckpointError: save: " + HELD, out), out[-3000:]
        _check_values(ck.load(path, target), kw.tree_values(1), target)
        a.kill()  # killed mid-save: its lock file stays, its flock goes
        a.wait(60)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert (tmp_path / "ckpt.jsbp-lock").exists()
    _check_values(ck.load(path, target), kw.tree_values(1), target)
    c = _save_in_process(tmp_path, 3, path)
    out = c.communicate(timeout=300)[0]
    assert c.returncode == 0, out[-3000:]
    _check_values(ck.load(path, target), kw.tree_values(3), target)
    assert _debris(tmp_path) == [] or _debris(tmp_path) == ["paused"]


def test_two_processes_save_one_path_at_once(tmp_path):
    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    # each holds the lock 2 s before writing, so the saves overlap despite start-up skew
    procs = {s: _save_in_process(tmp_path, s, path, f"locked:{tmp_path / 'x'}:2") for s in (2, 3)}
    outs = {s: p.communicate(timeout=300)[0] for s, p in procs.items()}
    ok = [s for s, p in procs.items() if p.returncode == 0]
    assert ok, outs
    for s, p in procs.items():
        if p.returncode != 0:
            assert re.search(r"CheckpointError: save: " + HELD, outs[s]), outs[s][-3000:]
            assert "Traceback" in outs[s] and "OSError" not in outs[s]
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    out = ck.load(path, target)
    assert out["step"] in ok
    _check_values(out, kw.tree_values(out["step"]), target)
    assert _debris(tmp_path) == []


# -------------------------------------------------------------------------------------------
# checkpoints readers can trust: loads during overwrites, interrupted and failed saves, x64
# -------------------------------------------------------------------------------------------


def _whole(out, kw, target) -> int:
    """The seed of the one checkpoint ``out`` wholly is (its step and every tensor); fails on a
    mix of two."""
    seed = out["step"]
    for k, v in kw.tree_values(seed).items():
        assert np.array_equal(out[k].numpy(), v), (
            f"{k} is not the {k} of the checkpoint whose step is {seed}: a mix of two checkpoints"
        )
    _check_values(out, kw.tree_values(seed), target)
    return seed


def test_load_while_another_process_overwrites_returns_one_whole_checkpoint(tmp_path, monkeypatch):
    """Another process replaces the checkpoint after this load read its commit record and
    before it read the data: the load must return the new checkpoint whole, not the old step
    with the new tensors."""
    from jsbp.checkpoint import _backend

    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    read, calls = _backend.read, []

    def read_after_an_overwrite(*a, **k):
        calls.append(a[0])
        if len(calls) == 1:
            p = _save_in_process(tmp_path, 2, path)
            out = p.communicate(timeout=300)[0]
            assert p.returncode == 0, out[-3000:]
        return read(*a, **k)

    monkeypatch.setattr(_backend, "read", read_after_an_overwrite)
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    assert _whole(ck.load(path, target), kw, target) == 2
    assert len(calls) == 2  # the first read was thrown away, the data read again


def test_load_of_a_path_replaced_on_every_attempt_says_so(tmp_path, monkeypatch):
    from jsbp.checkpoint import _backend

    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    read, seeds = _backend.read, iter(range(2, 100))

    def read_after_an_overwrite(*a, **k):
        ck.save(path, kw.build(jsbp, 1) | {"step": next(seeds)}, overwrite=True)
        return read(*a, **k)

    monkeypatch.setattr(_backend, "read", read_after_an_overwrite)
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    with pytest.raises(CheckpointError, match=r"ckpt was replaced 8 times while it was being read"):
        ck.load(path, target)


@pytest.mark.slow
def test_loads_during_overwrite_loop_are_each_whole(tmp_path):
    """A real race: another process overwrites the path again and again while this one loads."""
    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    target = _target_of(kw, "(2,2)", lambda ndim: ("S(0)", "B"))
    env = dict(os.environ, PYTHONPATH=REPO)
    writer = subprocess.Popen(
        [sys.executable, os.path.join(WORKERS, "ckpt_kill_worker.py"), "loop", str(path), "2"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = []
    try:
        deadline = time.monotonic() + 300
        while writer.poll() is None and time.monotonic() < deadline:
            seen.append(_whole(ck.load(path, target), kw, target))
    finally:
        if writer.poll() is None:
            writer.kill()
        out = writer.communicate()[0]
    assert writer.returncode == 0, out[-3000:]
    assert len(set(seen)) >= 2, seen  # the loads did overlap the overwrites


@pytest.mark.parametrize("point", ["locked", "before_commit", "between_renames"])
def test_keyboard_interrupt_during_a_save_gives_everything_back(tmp_path, monkeypatch, point):
    from jsbp.checkpoint import _save

    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))

    def interrupt(p):
        if p == point:
            raise KeyboardInterrupt

    monkeypatch.setattr(_save, "_pause_point", interrupt)
    with pytest.raises(KeyboardInterrupt):
        ck.save(path, kw.build(jsbp, 2), overwrite=True)
    assert _debris(tmp_path) == []  # no lock file, no .jsbp-partial, no .jsbp-old
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    assert _whole(ck.load(path, target), kw, target) == 1
    monkeypatch.undo()
    ck.save(path, kw.build(jsbp, 3), overwrite=True)  # the lock is free in this very process
    assert _whole(ck.load(path, target), kw, target) == 3


def _needed_bytes(kw, seed) -> int:
    return sum(v.nbytes for v in kw.tree_values(seed).values())


def _enospc(*_a, **_k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _enospc_after_writing(write):
    def fail(directory, arrays):
        write(directory, arrays)  # the data lands, then the disk fills up (e.g. at OCDBT commit)
        raise ValueError("tensorstore: writing failed") from OSError(
            errno.ENOSPC, os.strerror(errno.ENOSPC)
        )

    return fail


@pytest.mark.parametrize("where", ["data", "data_wrapped", "manifest"])
def test_full_disk_raises_names_the_bytes_and_keeps_the_previous(tmp_path, monkeypatch, where):
    from jsbp.checkpoint import _backend, _manifest

    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    if where == "data":
        monkeypatch.setattr(_backend, "write", _enospc)
    elif where == "data_wrapped":
        monkeypatch.setattr(_backend, "write", _enospc_after_writing(_backend.write))
    else:
        monkeypatch.setattr(_manifest, "write", _enospc)
    needed = _needed_bytes(kw, 2)
    with pytest.raises(CheckpointError) as e:
        ck.save(path, kw.build(jsbp, 2), overwrite=True)
    msg = str(e.value)
    assert f"the file system of {path} is full" in msg, msg
    assert f"needs about {needed:,} bytes" in msg, msg
    assert "Nothing of this save was left behind" in msg
    assert _debris(tmp_path) == []  # no partial data, no lock
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    assert _whole(ck.load(path, target), kw, target) == 1
    monkeypatch.undo()
    ck.save(path, kw.build(jsbp, 2), overwrite=True)
    assert _whole(ck.load(path, target), kw, target) == 2


def test_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    from jsbp.checkpoint import _backend, _save

    kw = _worker_module("ckpt_kill_worker")
    path = tmp_path / "ckpt"
    ck.save(path, kw.build(jsbp, 1))
    needed = _needed_bytes(kw, 2)
    real = _save.shutil.disk_usage
    monkeypatch.setattr(_save.shutil, "disk_usage", lambda p: real(p)._replace(free=needed - 1))
    monkeypatch.setattr(_backend, "write", lambda *a, **k: pytest.fail("wrote on a full disk"))
    with pytest.raises(
        CheckpointError,
        match=rf"needs about {needed:,} bytes \(the logical size of its arrays\); {needed - 1:,} "
        "bytes are free there",
    ):
        ck.save(path, kw.build(jsbp, 2), overwrite=True)
    assert _debris(tmp_path) == []
    target = _target_of(kw, "(4,)", lambda ndim: "S(0)")
    assert _whole(ck.load(path, target), kw, target) == 1


def test_checkpoint_saved_under_x64_is_not_cast_silently(tmp_path):
    v = np.arange(10, dtype=np.float64) / 3  # not representable in float32
    i = np.arange(6, dtype=np.int64) << 40
    p = _plc("(4,)")
    with jax.enable_x64(True):
        tree = {"x": jsbp.tensor(v, placement=p, sbp="S(0)"), "j": jnp.asarray(i)}
        assert tree["x"].dtype == np.float64 and tree["j"].dtype == np.int64
        path = ck.save(tmp_path / "x64", tree)
    assert not jax.config.jax_enable_x64
    for target in (None, lambda path, shape: (p, "B")):
        with pytest.raises(
            CheckpointError,
            match=r"leaf at \['(x|j)'\] .* was saved as (float64|int64) \(under jax_enable_x64\), "
            r"but JAX holds it as (float32|int32) here",
        ):
            ck.load(path, target)
    # a float32 target is a mismatch that says why
    with pytest.raises(
        CheckpointError, match=r"expects shape \(10,\) float32.*saved under jax_enable_x64"
    ):
        ck.load(path, {"x": TensorSpec((10,), np.float32, p, "S(0)"), "j": np.zeros(6, np.int64)})
    # as numpy: exact
    out = ck.load(path, {"x": np.zeros(10, np.float64), "j": np.zeros(6, np.int64)})
    assert out["x"].dtype == np.float64 and np.array_equal(out["x"], v)
    assert np.array_equal(out["j"], i)
    with jax.enable_x64(True):  # and under x64, as saved
        out = ck.load(path, None)
        assert out["x"].dtype == np.float64 and np.array_equal(out["x"].numpy(), v)
        assert np.array_equal(np.asarray(out["j"]), i)


def test_load_of_a_regular_file_says_it_is_a_file(tmp_path):
    f = tmp_path / "model.ckpt"
    f.write_bytes(b"not a checkpoint")
    with pytest.raises(
        CheckpointError, match=r"no checkpoint at .*model.ckpt: it is a file, not a directory"
    ):
        ck.load(f, None)
    with pytest.raises(CheckpointError, match=r"it is a file, not a directory"):
        ck.info(f)


def test_processes_saving_different_trees_is_an_error(tmp_path):
    """Two processes of one job pass save() different trees (a scalar, a replicated tensor's
    value, the structure): each is a CheckpointError on both processes and nothing is written."""
    _run_two_processes("differ", tmp_path / "differ")
    assert not any(n.startswith("differ") for n in os.listdir(tmp_path)), os.listdir(tmp_path)
