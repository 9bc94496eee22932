"""Flax's Gemma example with its sharded variant (``tests/models/gemma.py``, rebuilt as published:
``ShardingConfig.fsdp_tp_sharding`` on mesh axes ``('fsdp', 'tensor')``, ``out_sharding=`` on every
einsum / linear / embedding call, frozen and unhashable ``@dataclass`` configs on the modules)
trains through jsbp's documented Flax path under dp, tp, dp×tp (the example's own FSDP × TP
layouts) and ZeRO-3, inside ``jax.set_mesh(placement.mesh)`` as the example's ``train.py`` steps
inside ``jax.set_mesh(mesh)``, matching one device.

The one-device reference: plain ``jax.jit`` under ``jax.set_mesh`` of a ``(1, 1)`` mesh with the
example's axis names. Dropout is on (0.1) through the step's call-time ``nnx.Rngs``, as
``nnx_train_step`` passes ``rngs`` to the model. Before: ``jnp.einsum(..., out_sharding=P(...))``
under ``jax.set_mesh(placement.mesh)`` raised "cannot contain axis names that are of type Auto",
and the unhashable ``SowConfig`` on the modules broke ``make_train_step``'s cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from models import gemma as gm  # tests/models (pytest puts tests/ on sys.path)
from models import param_values

import jsbp
import jsbp.flax as jflax
from jsbp import _interop

STEPS = 2
TOL = 1e-5
SHD = gm.ShardingConfig.fsdp_tp_sharding(fsdp_axis_name="fsdp", tensor_parallel_axis_name="tensor")

LAYOUTS = {  # grid over ('fsdp', 'tensor'), ZeRO stage, logical_axes
    "dp4": ((4, 1), 0, {"fsdp": None}),  # the batch split over fsdp, parameters replicated
    "tp4": ((1, 4), 0, {}),
    "fsdp2xtp2": ((2, 2), 0, {}),  # the example's own layouts: parameters split over both axes
    "dp4_zero3": ((4, 1), 3, {"fsdp": None}),
}


def _tx():
    return optax.adamw(1e-3, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.1)  # train.py's


_REF: dict = {}


def _reference():
    if not _REF:
        cfg = gm.tiny_config(SHD, dropout_rate=0.1)
        mesh = jax.make_mesh((1, 1), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh):
            model = gm.Transformer(cfg, rngs=nnx.Rngs(params=0))
            opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
            step = jflax.make_train_step(gm.loss_fn, None)
            rngs = nnx.Rngs(dropout=1)
            _REF["losses"] = [float(step(model, opt, gm.batch(i), rngs)) for i in range(STEPS)]
            _REF["params"] = param_values(model)
    return _REF


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gemma_sharded_trains_like_one_device(name):
    ref = _reference()
    grid, zero, logical = LAYOUTS[name]
    plc = jsbp.placement("cpu", np.arange(4).reshape(grid), axis_names=("fsdp", "tensor"))
    strategy = jflax.Strategy(plc, logical_axes=logical, data_axis="fsdp", zero=zero)
    with nnx.use_eager_sharding(False):
        model = gm.Transformer(gm.tiny_config(SHD, dropout_rate=0.1), rngs=nnx.Rngs(params=0))
    opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    model, opt = jflax.shard((model, opt), strategy)
    if name == "fsdp2xtp2":  # the example's metadata read as layouts: emb_vd = P('tensor', 'fsdp')
        assert jflax.layouts(model)["embedder/embedding"] == "(S(1), S(0))"
    step = jflax.make_train_step(gm.loss_fn, strategy)
    rngs = nnx.Rngs(dropout=1)
    before = len(_interop.UNTYPED)
    with jax.set_mesh(plc.mesh):  # as train.py steps inside jax.set_mesh(mesh)
        losses = [float(step(model, opt, gm.batch(i), rngs)) for i in range(STEPS)]
    assert len(_interop.UNTYPED) == before, _interop.UNTYPED
    np.testing.assert_allclose(losses, ref["losses"], rtol=TOL, atol=TOL)
    got = param_values(model)
    worst = max(float(np.max(np.abs(got[k] - ref["params"][k]))) for k in got)
    assert worst <= TOL, worst
    assert len(step._cache) == 1  # SowConfig does not hash: found by ==, compiled once


def test_explicit_sharding_code_under_the_placements_own_mesh():
    """``jnp.einsum(..., out_sharding=P(...))`` under ``jax.set_mesh(placement.mesh)`` (``Auto``
    axes) is traced under the mesh's ``Explicit`` twin: a layout request, as without a mesh."""
    plc = jsbp.placement("cpu", np.arange(4).reshape(2, 2), axis_names=("fsdp", "tensor"))
    assert all(t == AxisType.Auto for t in plc.mesh.axis_types)
    rng = np.random.default_rng(0)
    xv, wv = rng.normal(size=(8, 6)).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32)
    x = jsbp.tensor(xv, placement=plc, sbp=("S(0)", "B"))
    w = jsbp.tensor(wv, placement=plc, sbp=("B", "S(1)"))

    def f(x, w):
        y = jnp.einsum("bd,df->bf", x, w, out_sharding=P("fsdp", None))
        return jnp.tanh(y)

    for ctx in (plc.mesh, None):
        if ctx is None:
            out = jsbp.jit(f)(x, w)
        else:
            with jax.set_mesh(ctx):
                out = jsbp.jit(f)(x, w)
        assert out.sbp == (jsbp.sbp.split(0), jsbp.sbp.broadcast)
        np.testing.assert_allclose(out.numpy(), np.tanh(xv @ wv), rtol=1e-5, atol=1e-5)
