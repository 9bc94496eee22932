"""jsbp.flax with non-parameter state: RNG streams (``nnx.Rngs`` keys and counts, dropout),
BatchNorm statistics, call-time RNGs, and every form of Flax's sharding metadata.

Each parity test trains the same model from the same initial state on the same batches under a
strategy and on one device (``make_train_step(loss_fn, None)``, plain ``jax.jit``); losses and
the state must agree to fp32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jsbp
import jsbp.flax as jflax
from jsbp import sbp

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast
RTOL = 1e-5


def _plc(shape, names):
    return jsbp.placement("cpu", np.arange(int(np.prod(shape))).reshape(shape), axis_names=names)


def _dp8():
    return jflax.Strategy(_plc((8,), ("dp",)))


def _dp2tp4():
    return jflax.Strategy(_plc((2, 4), ("dp", "tp")), logical_axes={"batch": "dp", "mlp": "tp"})


def _batches(n, rows=16, d_in=8, d_out=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, d_in)).astype(np.float32),
            rng.normal(size=(rows, d_out)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _mse(model, batch):
    x, t = batch
    return jnp.mean((model(x) - t) ** 2)


def _np(v):
    return v.numpy() if isinstance(v, jsbp.GlobalTensor) else np.asarray(v)


def _key_data(v):
    v = v.numpy() if isinstance(v, jsbp.GlobalTensor) else v
    return np.asarray(jax.random.key_data(v))


def _part(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


# ------------------------------------------------------------------------------------------------
# RNG streams: nnx.Rngs state, dropout
# ------------------------------------------------------------------------------------------------


class DropMLP(nnx.Module):
    """Two dropout layers drawing from ``nnx.Rngs(dropout=...)`` state held by the model."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 32, kernel_init=_part("embed", "mlp"), rngs=rngs)
        self.drop1 = nnx.Dropout(0.5, rngs=rngs)
        self.fc2 = nnx.Linear(32, 4, kernel_init=_part("mlp", "embed"), rngs=rngs)
        self.drop2 = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        h = jflax.constrain(x, ("batch", "embed"))
        h = self.drop1(jax.nn.relu(self.fc1(h)))
        return self.drop2(self.fc2(h))


def _new_drop(seed=0):
    with nnx.use_eager_sharding(False):
        model = DropMLP(nnx.Rngs(params=seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _rng_state(model):
    flat = nnx.to_flat_state(nnx.state(model, nnx.RngState))
    out = {}
    for path, var in flat:
        v = var.get_value()
        out["/".join(map(str, path))] = _key_data(v) if "key" in str(path[-1]) else _np(v)
    return out


@pytest.mark.parametrize("make_strategy", [_dp8, _dp2tp4], ids=["dp8", "dp2xtp4"])
def test_dropout_rng_streams_match_one_device(make_strategy):
    strategy = make_strategy()
    ref_model, ref_opt = _new_drop()
    model, opt = jflax.shard(_new_drop(), strategy)
    keys = [p for p, v in jflax.layouts(model).items() if "rngs" in p]
    assert keys and all(
        jflax.layouts(model)[p] == jsbp._sbp.nd_str((B,) * strategy.placement.ndim) for p in keys
    )
    ref_step = jflax.make_train_step(_mse, None)
    step = jflax.make_train_step(_mse, strategy)
    for i, batch in enumerate(_batches(3)):
        want = float(ref_step(ref_model, ref_opt, batch))
        got = float(step(model, opt, batch).numpy())
        np.testing.assert_allclose(got, want, rtol=RTOL)
        ref_rng, rng = _rng_state(ref_model), _rng_state(model)
        assert ref_rng.keys() == rng.keys()
        for k in ref_rng:
            np.testing.assert_array_equal(rng[k], ref_rng[k], err_msg=k)
        counts = [v for k, v in rng.items() if k.endswith("count")]
        assert counts and all(int(c) == i + 1 for c in counts)  # one draw per dropout per step
    # the dropout really drops: two steps on the same batch see different masks
    plain = jflax.gather(model)
    assert isinstance(plain.drop1.rngs.key.get_value(), jax.Array)
    x = _batches(1)[0][0]
    ya, yb = np.asarray(plain(x)), np.asarray(plain(x))
    assert not np.allclose(ya, yb)
    plain.eval()
    np.testing.assert_allclose(np.asarray(plain(x)), np.asarray(plain(x)))


def test_key_arrays_are_broadcast_global_tensors():
    p = _plc((2, 4), ("dp", "tp"))
    k = jax.random.key(7)
    g = jsbp.tensor(k, placement=p, sbp=("S(0)", "B"))  # a key array is never split
    assert g.sbp == (B, B) and g.shape == () and jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(_key_data(g), _key_data(k))
    assert all(np.array_equal(_key_data(x), _key_data(k)) for x in g.to_local())
    x = jsbp.tensor(np.ones((8, 4), np.float32), placement=p, sbp=("S(0)", "S(1)"))

    @jsbp.jit
    def f(key, x):
        a, b = jax.random.split(key)
        return jax.random.fold_in(a, 3), x * jax.random.normal(b, x.shape)

    k2, y = f(g, x)
    a, b = jax.random.split(k)
    assert k2.sbp == (B, B)
    np.testing.assert_array_equal(_key_data(k2), _key_data(jax.random.fold_in(a, 3)))
    np.testing.assert_allclose(y.numpy(), np.asarray(jax.random.normal(b, (8, 4))), rtol=1e-6)


def test_checkpoint_round_trip_keeps_rng_keys(tmp_path):
    from jsbp import checkpoint as ck

    strategy = _dp2tp4()
    model, opt = jflax.shard(_new_drop(), strategy)
    step = jflax.make_train_step(_mse, strategy)
    batches = _batches(3)
    step(model, opt, batches[0])
    state = nnx.state((model, opt))
    ck.save(tmp_path / "ckpt", state)
    before = _rng_state(model)

    # into a fresh sharded model (target: its own state, keys and all)
    model2, opt2 = jflax.shard(_new_drop(seed=5), strategy)
    nnx.update((model2, opt2), ck.load(tmp_path / "ckpt", nnx.state((model2, opt2))))
    after = _rng_state(model2)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    key = model2.drop1.rngs.key.get_value()
    assert isinstance(key, jsbp.GlobalTensor) and jax.dtypes.issubdtype(
        key.dtype, jax.dtypes.prng_key
    )
    # both continue identically (same dropout masks, same parameters)
    for b in batches[1:]:
        np.testing.assert_allclose(
            float(step(model2, opt2, b)), float(step(model, opt, b)), rtol=RTOL
        )
    # as saved (no target), and with key TensorSpecs
    raw = jax.tree.leaves(
        ck.load(tmp_path / "ckpt"), is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor)
    )
    keys = [x for x in raw if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert len(keys) == 2 and all(x.sbp == (B, B) for x in keys)
    spec = ck.TensorSpec.like(key)
    assert spec.sbp == (B, B)


# ------------------------------------------------------------------------------------------------
# BatchNorm: mutable statistics of the global batch
# ------------------------------------------------------------------------------------------------


class BNNet(nnx.Module):
    """A small CNN + MLP with BatchNorm after the conv and after the hidden layer. The layers
    before a BatchNorm have no bias (BatchNorm cancels it: its gradient is rounding noise, which
    Adam would blow up to +-lr, differently on one device and on eight)."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
        self.fc1 = nnx.Linear(4 * 4 * 4, 16, use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, momentum=0.8, rngs=rngs)
        self.fc2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.bn1(self.conv(x)))
        h = h.reshape(h.shape[0], -1)
        return self.fc2(jax.nn.relu(self.bn2(self.fc1(h))))


def _new_bn(seed=0):
    model = BNNet(nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _bn_batches(n, rows=16, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            (2.0 + 3.0 * rng.normal(size=(rows, 4, 4, 2))).astype(np.float32),
            rng.normal(size=(rows, 4)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _batch_stats(model):
    return {
        jflax.path_str(p): _np(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.BatchStat))
    }


def test_batchnorm_statistics_are_the_global_batch_under_dp():
    strategy = _dp8()
    ref_model, ref_opt = _new_bn()
    model, opt = jflax.shard(_new_bn(), strategy)
    ref_step = jflax.make_train_step(_mse, None)
    step = jflax.make_train_step(_mse, strategy)
    init = _batch_stats(ref_model)
    for batch in _bn_batches(3):
        want = float(ref_step(ref_model, ref_opt, batch))
        got = float(step(model, opt, batch).numpy())
        np.testing.assert_allclose(got, want, rtol=RTOL)
        ref_stats, stats = _batch_stats(ref_model), _batch_stats(model)
        assert ref_stats.keys() == stats.keys() and len(stats) == 4  # mean, var of bn1 and bn2
        for k in ref_stats:
            np.testing.assert_allclose(stats[k], ref_stats[k], rtol=RTOL, atol=1e-6, err_msg=k)
    # the statistics moved (towards the data's mean 2 / var 9 for bn1), stored B
    assert not np.allclose(_batch_stats(model)["bn1/mean"], init["bn1/mean"])
    assert all(v == "(B)" for p, v in jflax.layouts(model).items() if p.startswith("bn"))
    # the running statistics of one device's shard would differ: they really are global
    x = _bn_batches(1)[0][0]
    assert not np.allclose(x[:2].mean(axis=(0, 1, 2)), x.mean(axis=(0, 1, 2)), atol=1e-2)
    # eval mode reads the running statistics (no update)
    plain = jflax.gather(model)
    plain.eval()
    before = _batch_stats(plain)
    plain(x)
    for k, v in _batch_stats(plain).items():
        np.testing.assert_array_equal(v, before[k])


# ------------------------------------------------------------------------------------------------
# Flax's sharding metadata, every form
# ------------------------------------------------------------------------------------------------


def _meta_layouts(kernel_meta, strategy, *, bias_meta=None, shape=(16, 32)):
    class One(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(
                *shape, kernel_metadata=kernel_meta, bias_metadata=bias_meta or {}, rngs=rngs
            )

    with nnx.use_eager_sharding(False):
        model = One(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    model, opt = jflax.shard((model, opt), strategy)
    return jflax.layouts(model), jflax.layouts(opt)


P_ = jax.sharding.PartitionSpec


@pytest.mark.parametrize(
    "meta, want",
    [
        (("embed", "mlp"), "(B, S(1))"),  # logical names, mapped by logical_axes
        (P_("dp", None), "(S(0), B)"),  # mesh axis names = placement axis names
        (P_(None, "tp"), "(B, S(1))"),
        (P_("tp"), "(B, S(0))"),  # shorter than the rank (legal JAX): the rest is unsplit
        (("tp",), "(B, S(0))"),
        (P_(("dp", "tp")), "(S(0), S(0))"),  # one dim over two axes
        (P_("embed", "mlp"), "(B, S(1))"),  # a PartitionSpec of logical names
        (("vocab", "heads"), "(B, B)"),  # names nothing maps: B, no error
        (P_("data", None), "(B, B)"),
        (P_(None, P_.UNCONSTRAINED), "(B, B)"),
        ("tp", "(B, S(0))"),  # a single name
        (None, "(B, B)"),
    ],
)
def test_sharding_metadata_forms(meta, want):
    strategy = jflax.Strategy(_plc((2, 4), ("dp", "tp")), logical_axes={"mlp": "tp", "embed": None})
    lay, opt_lay = _meta_layouts({"out_sharding": meta} if meta is not None else {}, strategy)
    assert lay["fc/kernel"] == want
    assert opt_lay["opt_state/0/mu/fc/kernel"] == want  # the moments follow their parameter


def test_sharding_metadata_named_sharding_and_with_partitioning():
    plc = _plc((2, 4), ("dp", "tp"))
    mesh = plc.mesh  # a mesh whose axis names are the placement's
    other = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    strategy = jflax.Strategy(plc, logical_axes={"model": "tp"})

    class Net(nnx.Module):
        def __init__(self, rngs):
            ns = jax.sharding.NamedSharding
            init = nnx.initializers.lecun_normal()
            self.a = nnx.Linear(
                16, 32, kernel_init=nnx.with_partitioning(init, ns(mesh, P_(None, "tp"))), rngs=rngs
            )
            self.b = nnx.Linear(
                32, 16, kernel_init=nnx.with_partitioning(init, ns(mesh, P_("tp"))), rngs=rngs
            )
            # another mesh's axis names: read through logical_axes ("model" -> tp), else B
            self.c = nnx.Linear(
                16,
                16,
                kernel_init=nnx.with_partitioning(init, ns(other, P_("data", "model"))),
                rngs=rngs,
            )
            self.d = nnx.Linear(16, 8, kernel_init=nnx.with_partitioning(init, P_("dp")), rngs=rngs)

        def __call__(self, x):
            return self.d(self.c(self.b(jax.nn.relu(self.a(x)))))

    with nnx.use_eager_sharding(False):
        ref = Net(nnx.Rngs(0))
        model = Net(nnx.Rngs(0))
    lay = jflax.layouts(jflax.shard(model, strategy))
    assert (lay["a/kernel"], lay["b/kernel"], lay["c/kernel"], lay["d/kernel"]) == (
        "(B, S(1))",
        "(B, S(0))",
        "(B, S(1))",
        "(S(0), B)",
    )
    # and it trains like one device
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    model, opt = jflax.shard(
        (model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)), strategy
    )
    ref_step, step = jflax.make_train_step(_mse, None), jflax.make_train_step(_mse, strategy)
    for batch in _batches(2, d_in=16, d_out=8):
        np.testing.assert_allclose(
            float(step(model, opt, batch)), float(ref_step(ref, ref_opt, batch)), rtol=RTOL
        )


def test_sharding_metadata_errors_teach():
    strategy = jflax.Strategy(_plc((2, 4), ("dp", "tp")))
    with pytest.raises(jsbp.SbpError, match="names 3"):
        _meta_layouts({"out_sharding": ("a", "b", "c")}, strategy)
    with pytest.raises(jsbp.SbpError, match="sharding metadata"):
        _meta_layouts({"out_sharding": 3}, strategy)


# ------------------------------------------------------------------------------------------------
# call-time RNGs: step(model, optimizer, batch, rngs) -> loss_fn(model, batch, rngs)
# ------------------------------------------------------------------------------------------------


class CallDrop(nnx.Module):
    """Flax's call-time idiom: dropout layers hold no rngs, ``__call__`` takes ``rngs=``."""

    def __init__(self, rngs):
        self.fc1 = nnx.Linear(8, 32, kernel_init=_part("embed", "mlp"), rngs=rngs)
        self.drop = nnx.Dropout(0.5)
        self.fc2 = nnx.Linear(32, 4, kernel_init=_part("mlp", "embed"), rngs=rngs)

    def __call__(self, x, *, rngs=None):
        h = jflax.constrain(x, ("batch", "embed"))
        return self.fc2(self.drop(jax.nn.relu(self.fc1(h)), rngs=rngs))


def _new_call(lr=1e-2):
    with nnx.use_eager_sharding(False):
        model = CallDrop(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(lr), wrt=nnx.Param)


def _mse_rngs(model, batch, rngs):
    x, t = batch
    return jnp.mean((model(x, rngs=rngs) - t) ** 2)


@pytest.mark.parametrize("make_strategy", [_dp8, _dp2tp4], ids=["dp8", "dp2xtp4"])
def test_call_time_rngs_match_one_device(make_strategy):
    strategy = make_strategy()
    ref_model, ref_opt = _new_call()
    model, opt = jflax.shard(_new_call(), strategy)
    ref_rngs, rngs = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
    ref_step = jflax.make_train_step(_mse_rngs, None)
    step = jflax.make_train_step(_mse_rngs, strategy)
    for i, batch in enumerate(_batches(3)):
        want = float(ref_step(ref_model, ref_opt, batch, ref_rngs))
        got = float(step(model, opt, batch, rngs).numpy())
        np.testing.assert_allclose(got, want, rtol=RTOL)
        assert int(_np(rngs.dropout.count.get_value())) == i + 1  # advanced in place
    assert isinstance(rngs.dropout.key.get_value(), jsbp.GlobalTensor)
    np.testing.assert_array_equal(
        _key_data(rngs.dropout.key.get_value()), _key_data(ref_rngs.dropout.key.get_value())
    )


def test_call_time_rngs_give_a_new_mask_every_step():
    strategy = _dp8()
    model, opt = jflax.shard(_new_call(lr=0.0), strategy)  # lr 0: only the mask can change the loss
    rngs = nnx.Rngs(dropout=0)
    step = jflax.make_train_step(_mse_rngs, strategy)
    batch = _batches(1)[0]
    a, b = float(step(model, opt, batch, rngs)), float(step(model, opt, batch, rngs))
    assert a != b
    # the same rngs state gives the same mask (the stream is the step's, not the device's)
    ref_model, ref_opt = _new_call(lr=0.0)
    ref = jflax.make_train_step(_mse_rngs, None)
    r = nnx.Rngs(dropout=0)
    np.testing.assert_allclose(
        [float(ref(ref_model, ref_opt, batch, r)) for _ in range(2)], [a, b], rtol=RTOL
    )
    with pytest.raises(jsbp.SbpError, match="nnx.Rngs"):
        step(model, opt, batch, jax.random.key(0))


def _mse_key(model, batch):
    x, t, key = batch
    return jnp.mean((model(x, rngs=key) - t) ** 2)


def test_key_in_the_batch_matches_one_device():
    strategy = _dp2tp4()
    ref_model, ref_opt = _new_call()
    model, opt = jflax.shard(_new_call(), strategy)
    ref_step = jflax.make_train_step(_mse_key, None)
    step = jflax.make_train_step(_mse_key, strategy)
    base = jax.random.key(11)
    losses = []
    for i, (x, t) in enumerate(_batches(3)):
        key = jax.random.fold_in(base, i)  # one key per step, as jax.random's idiom
        want = float(ref_step(ref_model, ref_opt, (x, t, key)))
        got = float(step(model, opt, (x, t, key)).numpy())
        np.testing.assert_allclose(got, want, rtol=RTOL)
        losses.append(got)
    x, t = _batches(1)[0]
    frozen = jflax.make_train_step(_mse_key, strategy)
    m0, o0 = jflax.shard(_new_call(lr=0.0), strategy)
    assert float(frozen(m0, o0, (x, t, jax.random.key(1)))) != float(
        frozen(m0, o0, (x, t, jax.random.key(2)))
    )


def test_jax_grad_through_jsbp_jit_with_key_inputs_and_outputs():
    p = _plc((8,), ("dp",))
    k = jsbp.tensor(jax.random.key(3), placement=p, sbp="B")
    x = jsbp.tensor(np.ones((8, 4), np.float32), placement=p, sbp="S(0)")
    f = jsbp.jit(lambda k, x: (jax.random.split(k)[0], (x * jax.random.normal(k, x.shape)).sum()))

    def g(xv):  # the key output has no cotangent (float0); the backward reads only the loss's
        k2, y = f(k, jsbp.GlobalTensor(xv, x.layout))
        return y.to_jax()

    want = np.asarray(jax.random.normal(jax.random.key(3), (8, 4)))
    np.testing.assert_allclose(np.asarray(jax.grad(g)(x.physical)), want, rtol=1e-6)
