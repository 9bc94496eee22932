"""Repeated layers planned once (``jsbp/_repeat.py``): a deep model's program is planned from a
copy of itself with only a few of its repeated blocks, and one pass over the whole program
follows that plan. Values match one device; the plan costs what planning the whole program
costs; the copies are found in the forward pass, the backward pass (visited the other way) and
the optimizer's per-leaf updates."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_flax_idioms as idioms
from flax import nnx
from test_compiler import R24, assert_tree_close, gt

import jsbp
from jsbp import _compiler as C
from jsbp import _jit, _repeat

LAYERS = 10


@pytest.fixture
def reductions(monkeypatch):
    """(equations of the whole program, equations of the reduced one) of each reduced plan."""
    seen = []
    real = _repeat._Repeats.reduce

    def reduce(self, *a):
        out = real(self, *a)
        if out is not None:
            seen.append((len(self.entries), len(out[0].eqns)))
        return out

    monkeypatch.setattr(_repeat._Repeats, "reduce", reduce)
    return seen


class DeepLM(nnx.Module):
    """A GPT written as the Flax examples write one: ``nnx.List`` of blocks (LayerNorm,
    ``nnx.MultiHeadAttention`` with a causal mask, GELU MLP), run by a Python ``for``."""

    def __init__(self, *, rngs):
        kw = dict(param_dtype=jnp.float32, rngs=rngs)
        part, normal = idioms.part, nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            idioms.VOCAB, idioms.D, embedding_init=part(normal, "vocab", "embed"), **kw
        )
        self.pos = nnx.Embed(idioms.SEQ, idioms.D, embedding_init=normal, **kw)
        self.blocks = nnx.List([idioms.Block(rngs=rngs) for _ in range(LAYERS)])
        self.ln = nnx.LayerNorm(idioms.D, **kw)
        self.head = nnx.Linear(
            idioms.D, idioms.VOCAB, kernel_init=part(normal, "embed", "vocab"), **kw
        )

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        mask = nnx.make_causal_mask(tokens)
        for blk in self.blocks:
            x = blk(x, mask=mask)
        return self.head(self.ln(x))


def make_deep(rngs):
    with nnx.use_eager_sharding(False):
        return DeepLM(rngs=rngs)


@pytest.mark.parametrize("layout", idioms.layouts("dp2tp4"))
def test_deep_flax_model_matches_one_device(layout, reductions):
    """Ten blocks, AdamW with global-norm clipping, three steps under dp=8 or Megatron dp2 x tp4:
    losses and parameters as on one device, and the step was planned from a reduced program of
    well under half its equations."""
    batches = [idioms.tokens(i) for i in range(idioms.STEPS)]
    tx = lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(1e-2))  # noqa: E731
    idioms.check(make_deep, idioms.lm_loss, batches, tx, layout)
    assert reductions, "the train step was planned whole"
    whole, reduced = reductions[0]
    assert reduced < 0.5 * whole, reductions


def _dict_mlp_step(layers, padded=False):
    """A train step over a dict of layers. Unpadded, the keys sort otherwise than the layers run
    (``layer_10`` before ``layer_2``): the optimizer's per-leaf updates come in key order, the
    forward and backward passes in layer order; padded (``layer_02``), in the same order."""
    names = [f"layer_{i:02d}" if padded else f"layer_{i}" for i in range(layers)]

    def loss(ws, x):
        for n in names:
            x = x + jnp.tanh(x @ ws[n]["w1"]) @ ws[n]["w2"]
        return jnp.mean(x * x)

    def step(ws, x):
        g = jax.grad(loss)(ws, x)
        return jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, ws, g)

    rng = np.random.default_rng(layers)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.3

    ws = {
        n: {"w1": gt(r(16, 32), R24, "B, S(1)"), "w2": gt(r(32, 16), R24, "S(0), B")} for n in names
    }
    return step, (ws, gt(r(8, 16), R24, "S(0), B"))


def _plain(args):
    return jax.tree_util.tree_map(
        lambda t: jnp.asarray(t.numpy()), args, is_leaf=lambda t: isinstance(t, jsbp.GlobalTensor)
    )


@pytest.mark.parametrize("padded", [True, False])
def test_dict_of_layers_matches_one_device(padded, reductions):
    step, args = _dict_mlp_step(12, padded)
    out = jsbp.jit(step)(*args)
    assert_tree_close(out, step(*_plain(args)), rtol=1e-5, atol=1e-5)
    assert reductions and reductions[0][1] < 0.5 * reductions[0][0], reductions


def _captured(fn, args, monkeypatch):
    seen = []
    with monkeypatch.context() as m:
        m.setattr(_jit, "infer", lambda *a, **k: seen.append(a) or C.infer(*a, **k))
        jsbp.jit(fn).lower_program(*args)
    ((placement, jaxpr, consts, lays, out_nd),) = seen
    return placement, C._dce(jaxpr), consts, lays, out_nd


@pytest.mark.parametrize("padded", [True, False])
def test_forward_backward_and_update_copies_are_found(padded, monkeypatch):
    """The copies of each layer: the forward pass's run and the backward pass's (visited last
    layer first, so counted the other way), each with a window per layer; the per-leaf updates'
    run too when the leaves come in layer order. In key order (``layer_10`` before ``layer_2``)
    the updates' run would make layer 10 the copy after layer 1, against the forward run: it is
    found, and left whole."""
    step, args = _dict_mlp_step(12, padded)
    placement, jaxpr, consts, lays, out_nd = _captured(step, args, monkeypatch)
    rep = _repeat._Repeats(jaxpr, {})
    found, taken = rep._runs(), rep._copies()
    assert len(found) == 3, found
    windows = [-(-(b + p - a) // p) for p, a, b, _ in taken]
    assert all(w >= 11 for w in windows), taken  # (a run may begin inside the first layer)
    assert {back for *_, back in taken} == {False, True}, taken
    covered = sum(b + p - a for p, a, b, _ in taken)
    if padded:
        assert len(taken) == 3 and covered > 0.9 * len(rep.entries), (taken, len(rep.entries))
    else:
        assert len(taken) == 2 and covered < 0.8 * len(rep.entries), (taken, len(rep.entries))


def test_short_models_are_planned_whole(monkeypatch, reductions):
    """Fewer than ``MIN_COPIES`` layers: the whole program is planned, as before."""
    step, args = _dict_mlp_step(_repeat.MIN_COPIES - 1)
    placement, jaxpr, consts, lays, out_nd = _captured(step, args, monkeypatch)
    assert C.program_cost(C.infer(placement, jaxpr, consts, lays, out_nd)) == C.program_cost(
        C._search(placement, jaxpr, consts, lays, out_nd)
    )
    assert not reductions


def test_switched_off_by_the_environment(monkeypatch, reductions):
    step, args = _dict_mlp_step(12)
    monkeypatch.setenv("JSBP_REUSE_LAYERS", "0")
    out = jsbp.jit(step)(*args)
    assert_tree_close(out, step(*_plain(args)), rtol=1e-5, atol=1e-5)
    assert not reductions


RECORDED = pathlib.Path(__file__).parent / "data" / "plan_costs.json"


@pytest.mark.parametrize("strategy", ["DPxTP", "TP"])
@pytest.mark.parametrize("planner", ["search", "global"])
def test_benchmark_gpt_plans_as_well_as_whole(strategy, planner, monkeypatch, reductions):
    """benchmarks/compiler.py's un-hinted 8-block GPT train step on (2, 4) and tp=8: planned from
    its reduced program, it costs no more than the whole program's plan (recorded in
    ``tests/data/plan_costs.json`` with ``JSBP_REUSE_LAYERS=0``), by ``program_cost`` and once
    collectives are combined. (Measured: equal on all four; without ``_best_for_whole`` the
    global planner's DPxTP plan was 1.5 % dearer combined, without ``_align`` the search's TP
    plan 2.7 %.)"""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    from test_planner import _benchmark_gpt

    from jsbp import _planner as G

    placement, jaxpr, consts, lays, out_nd = _benchmark_gpt(monkeypatch, strategy, 8)
    if planner == "global":
        monkeypatch.setenv("JSBP_PLANNER", "global")
    prog = C.infer(placement, jaxpr, consts, lays, out_nd)
    assert reductions, "planned whole"
    want = json.loads(RECORDED.read_text())[f"gpt8 {strategy} {planner} whole"]
    assert C.program_cost(prog) <= want["cost"], (C.program_cost(prog), want)
    assert G.combined_cost(prog) <= want["combined"], (G.combined_cost(prog), want)


def test_reduced_program_weighs_a_block_as_the_copies_it_stands_for(monkeypatch, reductions):
    """The 8-block DPxTP step's reduced program keeps 3 of its 8 blocks; the last head copy
    stands for itself and the 5 removed ones, and the global planner's problem counts its
    equations (their compute, the conversions of what they make) 6 times, the rest once. So
    weighed, the plan costs 115.04 / 45.83 MB-eq (``program_cost`` / combined, recorded as
    ``gpt8 DPxTP global``); with every kept equation counted once it was 158.19 / 80.60, the
    plan best for a 3-block model (measured both ways)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    from test_planner import _benchmark_gpt

    from jsbp import _planner as G

    placement, jaxpr, consts, lays, out_nd = _benchmark_gpt(monkeypatch, "DPxTP", 8)
    monkeypatch.setenv("JSBP_PLANNER", "global")
    seen = []
    build = G.build

    def spy(inf, prog, jaxpr, out_nd, weights=None):
        seen.append(weights)
        return build(inf, prog, jaxpr, out_nd, weights)

    monkeypatch.setattr(G, "build", spy)
    prog = C.infer(placement, jaxpr, consts, lays, out_nd)
    assert reductions, "planned whole"
    assert seen and all(w is not None and sorted(set(w.values())) == [1, 6] for w in seen), [
        None if w is None else sorted(set(w.values())) for w in seen
    ]
    want = json.loads(RECORDED.read_text())["gpt8 DPxTP global"]
    assert C.program_cost(prog) <= want["cost"], (C.program_cost(prog), want)
    assert G.combined_cost(prog) <= want["combined"], (G.combined_cost(prog), want)
