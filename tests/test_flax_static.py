"""jsbp.flax with what third-party Flax models hold: unhashable static attributes (a ``@dataclass``
config stored on the module, as jax-ml/bonsai's models do) and optimizer states shaped unlike
their parameter (``optax.adafactor``'s factored moments) under a ``param_sbp`` rule.

Each parity test trains the same model from the same initial state on the same batches under a
strategy and on one device (``make_train_step(loss_fn, None)``, plain ``jax.jit``).
"""

from __future__ import annotations

import dataclasses

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
TOL = 1e-5


def _plc(shape, names):
    return jsbp.placement("cpu", np.arange(int(np.prod(shape))).reshape(shape), axis_names=names)


@dataclasses.dataclass  # eq=True, not frozen: instances do not hash, as in bonsai's ModelConfig
class ModelConfig:
    d_in: int = 8
    hidden: int = 16
    d_out: int = 4
    dropout: float = 0.0
    widths: list = dataclasses.field(default_factory=lambda: [16])


class ConfigMLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg  # the unhashable static attribute
        self.k = nnx.Linear(cfg.d_in, cfg.hidden, rngs=rngs)
        self.norm = nnx.LayerNorm(cfg.hidden, rngs=rngs)
        self.o = nnx.Linear(cfg.hidden, cfg.d_out, rngs=rngs)

    def __call__(self, x):
        return self.o(jax.nn.gelu(self.norm(self.k(x))))


def _mse(model, batch):
    x, t = batch
    return jnp.mean((model(x) - t) ** 2)


def _batches(n, rows=16, d_in=8, d_out=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, d_in)).astype(np.float32),
            rng.normal(size=(rows, d_out)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _np(v):
    return v.numpy() if isinstance(v, jsbp.GlobalTensor) else np.asarray(v)


def _train(strategy, tx, steps=3):
    model = ConfigMLP(ModelConfig(), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    if strategy is not None:
        model, opt = jflax.shard((model, opt), strategy)
    step = jflax.make_train_step(_mse, strategy)
    losses = [float(step(model, opt, b)) for b in _batches(steps)]
    return model, opt, step, losses


def _assert_params_match(a, b):
    fa = dict(nnx.to_flat_state(nnx.state(a, nnx.Param)))
    fb = dict(nnx.to_flat_state(nnx.state(b, nnx.Param)))
    assert fa.keys() == fb.keys()
    worst = 0.0
    for k in fa:
        x, y = _np(fa[k].get_value()), _np(fb[k].get_value())
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL, err_msg=str(k))
        worst = max(worst, float(np.max(np.abs(x - y))))
    return worst


def _tp_rule():
    return [(r"k/kernel", "S(1)"), (r"k/bias", "S(0)"), (r"o/kernel", "S(0)")]


STRATEGIES = {
    "dp4": lambda: jflax.Strategy(_plc((4,), ("dp",))),
    "tp4": lambda: jflax.Strategy(
        _plc((4,), ("tp",)), param_sbp=[(r, (s,)) for r, s in _tp_rule()]
    ),
    "dp2xtp2_zero1": lambda: jflax.Strategy(
        _plc((2, 2), ("dp", "tp")), param_sbp=[(r, ("B", s)) for r, s in _tp_rule()], zero=1
    ),
    "dp4_zero3": lambda: jflax.Strategy(_plc((4,), ("dp",)), zero=3),
}


# ------------------------------------------------------------------------------------------------
# a module holding an unhashable @dataclass config
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_unhashable_dataclass_config_trains_like_one_device(name):
    with pytest.raises(TypeError, match="unhashable"):
        hash(nnx.graphdef(ConfigMLP(ModelConfig(), rngs=nnx.Rngs(0))))  # what broke the cache
    ref, _, _, ref_losses = _train(None, optax.adamw(1e-2))
    model, _, step, losses = _train(STRATEGIES[name](), optax.adamw(1e-2))
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=TOL)
    _assert_params_match(model, ref)
    # one compiled program for the three steps: the unhashable structure is found by ==
    assert len(step._cache) == 1 and len(next(iter(step._cache.values()))) == 1
    assert isinstance(model.cfg, ModelConfig) and model.cfg == ModelConfig()


def test_unhashable_config_two_models_of_different_configs_get_two_programs():
    s = STRATEGIES["dp4"]()
    step = jflax.make_train_step(_mse, s)
    for width in (16, 24):
        cfg = ModelConfig(hidden=width)
        model = ConfigMLP(cfg, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)
        model, opt = jflax.shard((model, opt), s)
        step(model, opt, _batches(1)[0])
    assert len(next(iter(step._cache.values()))) == 2


def test_unhashable_config_in_a_pipeline_stage():
    from jsbp.pipeline import Pipeline

    class Stage0(nnx.Module):
        def __init__(self, cfg, rngs):
            self.cfg = cfg
            self.fc = nnx.Linear(cfg.d_in, cfg.hidden, rngs=rngs)

        def __call__(self, x):
            return jax.nn.relu(self.fc(x))

    class Stage1(nnx.Module):
        def __init__(self, cfg, rngs):
            self.cfg = cfg
            self.fc = nnx.Linear(cfg.hidden, cfg.d_out, rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    cfg = ModelConfig()

    def loss(y, t):
        return jnp.mean((y - t) ** 2)

    def build():
        r = nnx.Rngs(0)
        return Stage0(cfg, r), Stage1(cfg, r)

    s0, s1 = build()
    plcs = [_plc((2,), ("dp",)), jsbp.placement("cpu", [2, 3], axis_names=("dp",))]
    pipe = Pipeline([s0, s1], loss, optax.sgd(1e-1), microbatches=2, placements=plcs)
    x, t = _batches(1, rows=8)[0]
    l0 = float(pipe.step(x, t))
    l1 = float(pipe.step(x, t))
    # one device: the same two modules, one optimizer step per batch
    r0, r1 = build()
    model = nnx.List([r0, r1])
    opt = nnx.Optimizer(model, optax.sgd(1e-1), wrt=nnx.Param)

    def full(m, b):
        return loss(m[1](m[0](b[0])), b[1])

    ref_step = jflax.make_train_step(full, None)
    refs = [float(ref_step(model, opt, (x, t))) for _ in range(2)]
    np.testing.assert_allclose([l0, l1], refs, rtol=TOL, atol=TOL)


# ------------------------------------------------------------------------------------------------
# optimizer states shaped unlike their parameter: adafactor's factored moments
# ------------------------------------------------------------------------------------------------


def _adafactor():
    return optax.adafactor(1e-2, min_dim_size_to_factor=4)


@pytest.mark.parametrize("name", ["tp4", "dp2xtp2_zero1", "dp4_zero3"])
def test_adafactor_under_a_param_sbp_rule_trains_like_one_device(name):
    ref, _, _, ref_losses = _train(None, _adafactor())
    model, opt, _, losses = _train(STRATEGIES[name](), _adafactor())
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=TOL)
    _assert_params_match(model, ref)
    lay = jflax.layouts(opt)
    if name == "tp4":
        # k/kernel (8, 16) is S(1): v_row (8,) drops dim 1 -> B; v_col (16,) keeps dim 1 -> S(0);
        # v (1,) is adafactor's placeholder -> B; o/kernel (16, 4) S(0): v_row (16,) -> S(0)
        assert lay["opt_state/0/v_row/k/kernel"] == "(B)"
        assert lay["opt_state/0/v_col/k/kernel"] == "(S(0))"
        assert lay["opt_state/0/v/k/kernel"] == "(B)"
        assert lay["opt_state/0/v/k/bias"] == "(S(0))"  # shaped like its parameter: follows it
        assert lay["opt_state/0/v_col/o/kernel"] == "(S(0))"
        assert lay["opt_state/0/v_row/o/kernel"] == "(B)"


def test_adafactor_layouts_show_in_the_strategy_table():
    s = STRATEGIES["tp4"]()
    model = ConfigMLP(ModelConfig(), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _adafactor(), wrt=nnx.Param)
    table = s.table((model, opt))
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "param_sbp 'k/kernel'" in rows["0/k/kernel"] and "S(1)" in rows["0/k/kernel"]
    assert (
        "derived from 0/k/kernel (8, 16) (keeps dims (1,))" in rows["1/opt_state/0/v_col/k/kernel"]
    )
    assert (
        "derived from 0/k/kernel (8, 16) (keeps dims (0,))" in rows["1/opt_state/0/v_row/k/kernel"]
    )
    assert "B: shaped (1,), unlike 0/k/kernel (8, 16)" in rows["1/opt_state/0/v/k/kernel"]
    assert "follows 0/k/bias" in rows["1/opt_state/0/v/k/bias"]
    lays = jflax.leaf_layouts(list(nnx.to_flat_state(nnx.state((model, opt)))), s)
    assert lays[(1, "opt_state", 0, "v_col", "k", "kernel")].stored == (S0,)
    assert lays[(1, "opt_state", 0, "v_row", "k", "kernel")].stored == (B,)


def test_derived_sbp_rules():
    from jsbp.flax._strategy import derived_sbp

    # dropped dims: the splits of the dims kept, renumbered
    assert derived_sbp((S1,), (8, 16), (16,)) == ((S0,), (1,))
    assert derived_sbp((S0,), (8, 16), (8,)) == ((S0,), (0,))
    assert derived_sbp((sbp.split(2), S0), (4, 6, 8), (4, 8)) == ((S1, S0), (0, 2))
    # keepdims: the same rank with ones where a dim was reduced
    assert derived_sbp((S1,), (8, 16), (1, 16)) == ((S1,), (1,))
    assert derived_sbp((S1,), (8, 16), (8, 1)) == ((B,), (0,))
    # a square kernel: v_row and v_col have one shape, and the two readings disagree -> B
    assert derived_sbp((S1,), (16, 16), (16,)) == ((B,), None)
    # ... unless the parameter is B anyway
    assert derived_sbp((B,), (16, 16), (16,)) == ((B,), (0,))
    # no embedding: B
    assert derived_sbp((S1,), (8, 16), (1,)) == ((B,), None)
    assert derived_sbp((S1,), (8, 16), (3, 5)) == ((B,), None)


def test_param_sbp_rule_of_the_wrong_length_names_the_pattern():
    p = _plc((2, 2), ("dp", "tp"))
    with pytest.raises(jsbp.SbpError, match=r"param_sbp.*'k/kernel'.*2 axes"):
        jflax.Strategy(p, param_sbp=[(r"k/kernel", ("S(1)", "B", "B"))])
    with pytest.raises(jsbp.SbpError, match=r"param_sbp.*'o/kernel'"):
        jflax.Strategy(p, param_sbp={r"k/kernel": ("B", "S(1)"), r"o/kernel": "S(0)"})
