"""jsbp.pipeline: schedules, timelines, measured activations, parity with one device, bad input.

Parity: a tiny model (input projection, pre-norm MLP blocks, classifier head) trained for 10
steps with adam is compared with the same model trained on one device with plain ``jax.jit`` on
the whole batch: every loss within 1e-5 relative, every final parameter within 1e-5 of the largest
magnitude in its tensor. The fast set covers each topology and schedule once; the full grid
(pp=2, pp=4, pp=2 x dp=2 x tp=2; 4 and 8 micro-batches; GPipe and 1F1B) runs with ``JSBP_FULL=1``.
"""

from __future__ import annotations

import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jsbp
import jsbp.flax as jflax
import jsbp.pipeline as jpp

STEPS = 10
N, D_IN, D, CLASSES, BLOCKS = 16, 6, 8, 5, 4
RTOL = 1e-5

full_grid = pytest.mark.skipif(not os.environ.get("JSBP_FULL"), reason="full grid: set JSBP_FULL=1")


# ----------------------------------------------------------------------------------------------
# the model (written once, for one device)
# ----------------------------------------------------------------------------------------------


def _linear(a, b, names, rngs):
    return nnx.Linear(
        a,
        b,
        rngs=rngs,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
        bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), names[1:]),
    )


class Block(nnx.Module):
    """Pre-norm MLP block; column-parallel ``fc1``, row-parallel ``fc2`` under tensor parallelism."""

    def __init__(self, rngs):
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = _linear(D, 2 * D, ("embed", "mlp"), rngs)
        self.fc2 = _linear(2 * D, D, ("mlp", "embed"), rngs)

    def __call__(self, x):
        h = jflax.constrain(self.ln(x), ("batch", "embed"))
        return x + jflax.constrain(self.fc2(jax.nn.gelu(self.fc1(h))), ("batch", "embed"))


class Model(nnx.Module):
    def __init__(self, seed=0, block=None):
        rngs = nnx.Rngs(seed)
        self.inp = _linear(D_IN, D, (None, "embed"), rngs)
        self.blocks = nnx.List([(block or Block)(rngs) for _ in range(BLOCKS)])
        self.head = _linear(D, CLASSES, ("embed", None), rngs)

    def __call__(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def stages(self, p):
        """``p`` layer ranges: the input layer joins the first, the head the last."""
        k = BLOCKS // p
        out = [list(self.blocks[i * k : (i + 1) * k]) for i in range(p)]
        out[0].insert(0, self.inp)
        out[-1].append(self.head)
        return out


def loss_fn(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


TX = optax.adam(1e-2)  # one object: pipelines over the same structure share compiled programs


def make_model():
    with nnx.use_eager_sharding(False):
        return Model(0)


def batch(step):
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(N, D_IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(N,)).astype(np.int32)
    return x, y


@functools.cache
def reference():
    """Losses and final parameters of 10 full-batch steps on one device (plain jax.jit)."""
    model = make_model()
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m(x), y))(model)
        opt.update(model, grads)
        return loss

    losses = [float(step(model, opt, *batch(i))) for i in range(STEPS)]
    return losses, _params(model)


def _params(model):
    return {
        jflax.path_str(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


TOPOLOGIES = {
    "pp2": dict(p=2, placements=None, logical_axes=None),
    "pp4": dict(p=4, placements=None, logical_axes=None),
    "pp2xdp2xtp2": dict(p=2, axes={"dp": 2, "tp": 2}, logical_axes={"batch": "dp", "mlp": "tp"}),
}


def train(topology, m, schedule, *, remat=False, steps=STEPS):
    cfg = TOPOLOGIES[topology]
    model = make_model()
    placements = jpp.stage_placements(cfg["p"], axes=cfg["axes"]) if "axes" in cfg else None
    pipe = jpp.Pipeline(
        model.stages(cfg["p"]),
        loss_fn,
        TX,
        microbatches=m,
        schedule=schedule,
        placements=placements,
        logical_axes=cfg["logical_axes"],
        remat=remat,
    )
    losses = [pipe.step(*batch(i)) for i in range(steps)]
    pipe.write_back()  # trained values back into `model`, in place
    return losses, model, pipe


def assert_parity(losses, model):
    ref_losses, ref_params = reference()
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i}: loss {a} vs one device {b}"
    params = _params(model)
    assert params.keys() == ref_params.keys()
    for k, ref in ref_params.items():
        err = np.abs(params[k] - ref).max()
        assert err <= RTOL * np.abs(ref).max(), f"{k}: max error {err} vs scale {np.abs(ref).max()}"


def assert_measured_peaks(pipe, m):
    rec = pipe.last_record
    p = len(pipe.stages)
    predicted = [max(c[s] for c in rec.schedule.live_counts()) for s in range(p)]
    assert list(rec.peak_live) == predicted  # the measurement agrees with what the schedule implies
    one = rec.microbatch_bytes
    assert all(b > 0 for b in one)
    if rec.schedule.name == "gpipe":
        assert rec.peak_live == (m,) * p
        assert all(rec.peak_live_bytes[s] == m * one[s] for s in range(p))
    else:  # 1F1B: stage s holds at most p - s <= p micro-batches
        assert rec.peak_live == tuple(min(p - s, m) for s in range(p))
        assert all(rec.peak_live_bytes[s] <= p * one[s] for s in range(p))


# ----------------------------------------------------------------------------------------------
# parity with one device
# ----------------------------------------------------------------------------------------------

FAST = [
    ("pp2", 4, "gpipe"),
    ("pp2", 8, "1f1b"),
    ("pp4", 4, "1f1b"),
    ("pp2xdp2xtp2", 4, "1f1b"),
    ("pp2xdp2xtp2", 8, "gpipe"),
]
FULL = [
    (t, m, s)
    for t in TOPOLOGIES
    for m in (4, 8)
    for s in ("gpipe", "1f1b")
    if (t, m, s) not in FAST
]


@pytest.mark.parametrize("topology,m,schedule", FAST, ids=[f"{t}-m{m}-{s}" for t, m, s in FAST])
def test_parity_with_one_device(topology, m, schedule):
    losses, model, pipe = train(topology, m, schedule)
    assert_parity(losses, model)
    assert_measured_peaks(pipe, m)


@pytest.mark.slow
@full_grid
@pytest.mark.parametrize("topology,m,schedule", FULL, ids=[f"{t}-m{m}-{s}" for t, m, s in FULL])
def test_parity_full_grid(topology, m, schedule):
    losses, model, pipe = train(topology, m, schedule)
    assert_parity(losses, model)
    assert_measured_peaks(pipe, m)


def test_interleaved_parity_and_smaller_bubble():
    """4 stages on 2 ranks (2 chunks each): same result, bubble (p-1)/(2m+p-1) instead of (p-1)/(m+p-1)."""
    model = make_model()
    pipe = jpp.Pipeline(model.stages(4), loss_fn, TX, microbatches=4, schedule="interleaved")
    assert [p.ranks.tolist() for p in pipe.placements] == [[0], [1], [0], [1]]
    losses = [pipe.step(*batch(i)) for i in range(STEPS)]
    pipe.write_back()
    assert_parity(losses, model)
    sch = pipe.last_record.schedule
    assert sch.ranks == 2 and sch.chunks == 2
    assert sch.bubble_fraction == 1 / (2 * 4 + 1) < jpp.one_f_one_b(2, 4).bubble_fraction


def test_remat_parity_and_less_memory():
    losses, model, pipe = train("pp2", 4, "1f1b", remat=True, steps=3)
    ref_losses, _ = reference()
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, ref_losses[:3]))
    _, _, full = train("pp2", 4, "1f1b", steps=1)
    rec, rec_full = pipe.last_record, full.last_record
    assert rec.peak_live == rec_full.peak_live == (2, 1)
    # re-materialisation keeps only the stage input: strictly fewer bytes on every stage
    assert all(a < b for a, b in zip(rec.peak_live_bytes, rec_full.peak_live_bytes))
    # exactly the stage inputs: (4, 6) float32 on stage 0; (4, 8) float32 and (4,) int32 labels on stage 1
    assert rec.microbatch_bytes == ((N // 4) * D_IN * 4, (N // 4) * D * 4 + (N // 4) * 4)


def test_data_parallel_gradients_reduced_once_per_batch():
    """With dp inside a stage, the backward adds partial gradients (no all-reduce per micro-batch);
    the update reduces them once."""
    model = make_model()
    placements = jpp.stage_placements(2, axes={"dp": 2})
    pipe = jpp.Pipeline(
        model.stages(2),
        loss_fn,
        TX,
        microbatches=4,
        placements=placements,
        logical_axes={"batch": "dp"},
    )
    counts = pipe.count_collectives(*batch(0))
    for c in counts:
        assert c["forward"]["all-reduce"] == 0 and c["backward"]["all-reduce"] == 0, c
        assert c["update"]["all-reduce"] >= 1, c
    assert pipe.steps == 0 and pipe.last_record is None


# ----------------------------------------------------------------------------------------------
# stages with mutable state: Dropout and BatchNorm in train mode
# ----------------------------------------------------------------------------------------------


class NoisyBlock(nnx.Module):
    """Linear -> BatchNorm (batch statistics, running averages) -> relu -> Dropout, residual."""

    def __init__(self, rngs):
        # no bias before the BatchNorm: its gradient is zero up to rounding, which adam would
        # turn into steps of the learning rate's size (noise, not a layout difference)
        self.fc = nnx.Linear(
            D,
            D,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
        )
        self.bn = nnx.BatchNorm(D, momentum=0.8, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.relu(self.bn(self.fc(x))))


def _noisy_reference(m, steps):
    """One device, the batch cut into the same ``m`` micro-batches in order: every micro-batch's
    forward advances the dropout RNG counts and BatchNorm's running statistics; the gradient is
    the micro-batch mean, applied once per batch."""
    with nnx.use_eager_sharding(False):
        model = Model(0, NoisyBlock)
    opt = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def micro(model, x, y):
        return nnx.value_and_grad(lambda mdl: loss_fn(mdl(x), y))(model)

    @nnx.jit
    def update(model, opt, grads):
        opt.update(model, grads)

    losses = []
    for i in range(steps):
        xs, ys = (np.split(a, m) for a in batch(i))
        total, gsum = 0.0, None
        for x, y in zip(xs, ys):
            loss, g = micro(model, x, y)
            total += float(loss)
            gsum = g if gsum is None else jax.tree.map(jnp.add, gsum, g)
        update(model, opt, jax.tree.map(lambda g: g / m, gsum))
        losses.append(total / m)
    return losses, model


def _state_arrays(model):
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    return {jflax.path_str(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}


@pytest.mark.parametrize("topology,schedule", [("pp2", "1f1b"), ("pp2xdp2xtp2", "gpipe")])
@pytest.mark.parametrize("remat", [False, True])
def test_dropout_and_batchnorm_in_stages_match_one_device(topology, schedule, remat):
    """Each stage carries its non-parameter state from micro-batch to micro-batch (new dropout
    masks, running statistics of each micro-batch, global under dp inside the stage); a backward
    uses the masks of its own forward (recomputed from the saved state under remat)."""
    m, steps = 4, 3
    cfg = TOPOLOGIES[topology]
    with nnx.use_eager_sharding(False):
        model = Model(0, NoisyBlock)
    placements = jpp.stage_placements(cfg["p"], axes=cfg["axes"]) if "axes" in cfg else None
    pipe = jpp.Pipeline(
        model.stages(cfg["p"]),
        loss_fn,
        TX,
        microbatches=m,
        schedule=schedule,
        placements=placements,
        logical_axes=cfg["logical_axes"],
        remat=remat,
    )
    losses = [pipe.step(*batch(i)) for i in range(steps)]
    pipe.write_back()
    ref_losses, ref = _noisy_reference(m, steps)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    got, want = _state_arrays(model), _state_arrays(ref)
    assert got.keys() == want.keys() and any("mean" in k for k in got)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)
    counts = {
        jflax.path_str(p): int(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.RngCount))
    }
    assert counts and all(c == steps * m for c in counts.values()), counts


# ----------------------------------------------------------------------------------------------
# schedules and timelines (no devices needed)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 16])
def test_bubble_fraction(p, m):
    g, o = jpp.gpipe(p, m), jpp.one_f_one_b(p, m)
    assert g.bubble_fraction == (p - 1) / (m + p - 1)
    assert g.makespan == o.makespan == 2 * (m + p - 1)
    assert o.bubble_fraction == g.bubble_fraction  # 1F1B wins on memory, not on time
    # the timeline shows the same bubble: idle cells over all cells of the picture
    html = g.html()
    idle = len(re.findall(r'class="jsbp-idle"', html))
    busy = len(re.findall(r'class="jsbp-action"', html))
    assert busy == 2 * p * m
    assert idle / (idle + busy) == pytest.approx((p - 1) / (m + p - 1), abs=0)
    assert f"bubble {idle}/{idle + busy}" in g.text()


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_schedule_orders(p, m):
    g, o = jpp.gpipe(p, m), jpp.one_f_one_b(p, m)
    for s in range(p):
        kinds = [a.kind for a in g.order(s)]
        assert kinds == ["F"] * m + ["B"] * m
        # 1F1B: warm-up forwards, then each backward as early as possible
        o_kinds = "".join(a.kind for a in o.order(s))
        warm = min(p - s - 1, m)
        assert o_kinds == "F" * warm + "FB" * (m - warm) + "B" * warm
    assert max(max(c) for c in g.live_counts()) == m
    assert [max(c[s] for c in o.live_counts()) for s in range(p)] == [
        min(p - s, m) for s in range(p)
    ]


def test_interleaved_schedule():
    for p, v, m in [(2, 2, 4), (4, 2, 8), (2, 3, 4)]:
        sch = jpp.interleaved_1f1b(p * v, m, chunks=v)
        assert sch.ranks == p and sch.rank_of == tuple(s % p for s in range(p * v))
        assert sch.bubble_fraction == (p - 1) / (v * m + p - 1)
    with pytest.raises(jsbp.SbpError, match="multiple of 2 micro-batches"):
        jpp.interleaved_1f1b(4, 3, chunks=2)


def test_schedule_text_snapshot():
    assert jpp.gpipe(2, 2).text() == "\n".join(
        [
            "gpipe: 2 stage(s) on 2 rank(s) x 2 micro-batch(es), 6 slots, bubble 4/12 = 33.3% (GPipe's (p-1)/(m+p-1) = 1/3)",
            "slot     0  1  2  3  4  5",
            "rank 0  F0 F1  .  . B0 B1",
            "rank 1   . F0 F1 B0 B1  .",
        ]
    )


def test_timeline_html_is_self_contained():
    sch = jpp.one_f_one_b(4, 8)
    html = sch._repr_html_()
    assert "<script" not in html.lower() and "<style" not in html.lower()
    assert 'fill="currentColor"' in html
    cells = re.findall(
        r'data-time="(\d+)" data-rank="(\d+)" data-stage="(\d+)" data-microbatch="(\d+)" data-kind="([FB])"',
        html,
    )
    got = sorted((int(t), int(s), int(mb), k) for t, _, s, mb, k in cells)
    assert got == sorted(tuple(a) for a in sch.actions)


def test_schedule_validation():
    good = jpp.gpipe(2, 1)
    acts = list(good.actions)
    with pytest.raises(jsbp.SbpError, match="scheduled twice"):
        jpp.Schedule("x", 2, 1, tuple(acts + [jpp.Action(9, 0, 0, "F")]), (0, 1))
    with pytest.raises(jsbp.SbpError, match="missing B0@s1"):
        jpp.Schedule("x", 2, 1, tuple(a for a in acts if tuple(a[1:]) != (1, 0, "B")), (0, 1))
    early = [jpp.Action(0, 1, 0, "F") if (a.stage, a.kind) == (1, "F") else a for a in acts]
    with pytest.raises(jsbp.SbpError, match="needs"):
        jpp.Schedule("x", 2, 1, tuple(early), (0, 1))
    with pytest.raises(jsbp.SbpError, match="deadlock"):
        jpp.from_orders("x", 2, 1, [[(0, 0, "B"), (0, 0, "F")], [(1, 0, "F"), (1, 0, "B")]])
    with pytest.raises(jsbp.SbpError, match="unknown"):
        jpp.make_schedule("zigzag", 2, 4)
    with pytest.raises(jsbp.SbpError, match="is for 2 stages x 4 micro-batches"):
        jpp.make_schedule(jpp.gpipe(2, 4), 2, 8)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


def _tiny_stages(n):
    return [nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(n)]


def test_more_stages_than_devices():
    n = len(jax.devices()) + 1
    with pytest.raises(jsbp.PlacementError, match=f"{n} pipeline stages need at least {n} devices"):
        jpp.Pipeline(
            _tiny_stages(n), lambda y, t: ((y - t) ** 2).mean(), optax.sgd(0.1), microbatches=2
        )
    with pytest.raises(jsbp.PlacementError, match="needs 16 devices"):
        jpp.stage_placements(4, axes={"dp": 2, "tp": 2})


def test_overlapping_stage_placements():
    p0 = jsbp.placement("cpu", [0, 1])
    p1 = jsbp.placement("cpu", [1, 2])
    with pytest.raises(jsbp.PlacementError, match=r"overlaps rank 0's .* on device\(s\) \[1\]"):
        jpp.Pipeline(
            _tiny_stages(2),
            lambda y, t: ((y - t) ** 2).mean(),
            optax.sgd(0.1),
            microbatches=2,
            placements=[p0, p1],
        )


def test_microbatches_must_divide_the_batch():
    pipe = jpp.Pipeline(
        _tiny_stages(2), lambda y, t: ((y - t) ** 2).mean(), optax.sgd(0.1), microbatches=4
    )
    x = np.ones((10, 2), np.float32)
    with pytest.raises(
        jsbp.SbpError, match=r"batch of inputs of 10 rows cannot be cut into microbatches=4"
    ):
        pipe.step(x, x)
    with pytest.raises(jsbp.SbpError, match="different batch sizes"):
        pipe.step({"a": np.ones((8, 2)), "b": np.ones((4, 2))}, x)


def test_microbatches_cannot_be_forgotten():
    loss = lambda y, t: ((y - t) ** 2).mean()
    with pytest.raises(TypeError, match="microbatches"):
        jpp.Pipeline(_tiny_stages(2), loss, optax.sgd(0.1))  # no silent default
    with pytest.raises(jsbp.SbpError, match="microbatches must be a positive int"):
        jpp.Pipeline(_tiny_stages(2), loss, optax.sgd(0.1), microbatches=0)
    with pytest.raises(jsbp.SbpError, match="stage 1 is"):
        jpp.Pipeline([_tiny_stages(1)[0], "not a module"], loss, optax.sgd(0.1), microbatches=2)


def test_stages_whose_shapes_do_not_chain_name_both_stages():
    """Stage 0 gives 12 features to a stage 1 that takes 10: a jsbp error naming both stages and
    the shapes (before: JAX's raw dot_general TypeError from inside the stage's trace)."""
    r = nnx.Rngs(0)
    loss = lambda y, t: ((y - t) ** 2).mean()
    pipe = jpp.Pipeline(
        [nnx.Linear(8, 12, rngs=r), nnx.Linear(10, 4, rngs=r)], loss, optax.sgd(0.1), microbatches=2
    )
    x, t = np.ones((8, 8), np.float32), np.ones((8, 4), np.float32)
    with pytest.raises(jsbp.SbpError) as e:
        pipe.step(x, t)
    msg = str(e.value)
    assert "stage 1 (Linear) cannot take stage 0's output of shape (4, 12) float32" in msg, msg
    assert "(12,) and (10,)" in msg and "make stage 0's output match what stage 1 takes" in msg, msg
    # stage 0 given inputs of the wrong width
    pipe = jpp.Pipeline(
        [nnx.Linear(8, 12, rngs=r), nnx.Linear(12, 4, rngs=r)], loss, optax.sgd(0.1), microbatches=2
    )
    with pytest.raises(
        jsbp.SbpError,
        match=r"stage 0 \(Linear\) cannot take the micro-batch inputs of "
        r"shape \(4, 6\) float32",
    ):
        pipe.step(np.ones((8, 6), np.float32), t)
    assert float(pipe.step(x, t)) > 0  # the right shapes still train


# ----------------------------------------------------------------------------------------------
# the GPT example
# ----------------------------------------------------------------------------------------------


def _load_example(name):
    import importlib.util
    import pathlib
    import sys

    if name in sys.modules:
        return sys.modules[name]
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpt_example_matches_one_device():
    """examples/train_gpt_pipeline.py at a tiny size: pp=2 x dp=2 x tp=2, 1F1B, 2 micro-batches,
    against train_gpt.py's one-device run (int tokens into stage 0, vocab-parallel loss on stage 1)."""
    ex = _load_example("train_gpt_pipeline")
    base = ex.base
    corpus = base.Corpus()
    cfg = base.GPTConfig(vocab=corpus.vocab, seq=8, d_model=16, n_heads=2, n_layers=1, d_mlp=32)
    losses, pipe, _ = ex.train(
        "pp=2,dp=2,tp=2", microbatches=2, schedule="1f1b", steps=2, batch=8, cfg=cfg, corpus=corpus
    )
    ref = base.train("none", steps=2, batch=8, cfg=cfg, corpus=corpus)
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, ref.losses)), (
        losses,
        ref.losses,
    )
    assert pipe.last_record.peak_live == (2, 1)
    with pytest.raises(SystemExit):  # --microbatches is required on the command line too
        ex.build_parser().parse_args(["--parallel", "pp=2"])
