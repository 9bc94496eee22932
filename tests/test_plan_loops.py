"""Plans of whole programs with loops, ``cond``s and shared values, as ``jsbp.jit`` makes them.

Loop bodies (``scan``, ``while``) and ``cond`` branches are planned together with the program
around them. Each test checks what a user sees: results equal to one device (plain JAX / NumPy),
the layouts of the results, and the collectives of the plan (``jsbp.explain(...).collectives()``,
which equal ``jsbp.debug.count_collectives`` of the compiled program): a loop invariant converted
once before the loop rather than every iteration, a loop carry kept in the layout the output
wants, PRNG keys and booleans carried through a loop, ``cond`` results whose layouts do not depend
on the order of the branches, shared values converted once, and train steps (transformers, a
scan-over-layers MLP, a GPT under ZeRO) that match one device.
"""

import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_compiler import P4, _transformer_step_case, assert_tree_close, gt, rand
from test_compiler import Q22 as P2x2

import jsbp
from jsbp._program import boxings_of, iter_steps, subprograms

P8 = jsbp.placement("cpu", list(range(8)))


def _collectives(fn, *args):
    """The plan's collectives by kind (the nonzero ones), checked against the compiled program."""
    planned = jsbp.explain(fn, *args).collectives()
    compiled = jsbp.debug.count_collectives(fn, *args)
    assert planned == compiled, (planned, compiled)
    return {k: v for k, v in compiled.items() if v}


def _loop_bodies(prog):
    return [
        sub for _, st in iter_steps(prog) if st.kind in ("scan", "while") for sub in subprograms(st)
    ]


def _loop_collectives(prog):
    """(collectives made once, collectives made every iteration) of ``prog``'s boxings."""
    once = sum(len(bx.collectives) for bx, _ in boxings_of(prog))
    every = sum(len(bx.collectives) for sub in _loop_bodies(prog) for bx, _ in boxings_of(sub))
    return once - every, every


def test_readers_of_one_value_share_a_conversion():
    """A partial value read as (S(0), B) and as (B, B): one all-reduce to (B, B), the other sliced
    from it, not a reduce-scatter and an all-reduce."""

    def fn(x, w):
        y = x @ w  # (B, S(1)) @ (B, S(0)) -> (B, P)
        return jnp.tanh(jsbp.to_global(y, sbp=("S(0)", "B"))), jnp.exp(
            jsbp.to_global(y, sbp=("B", "B"))
        )

    xv, wv = rand(8, 6), rand(6, 4)
    args = (gt(xv, P2x2, ("B", "S(1)")), gt(wv, P2x2, ("B", "S(0)")))
    f = jsbp.jit(fn)
    a, b = f(*args)
    # (float32 partial sums: an entry near 0 needs an absolute tolerance too)
    np.testing.assert_allclose(a.numpy(), np.tanh(xv @ wv), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b.numpy(), np.exp(xv @ wv), rtol=1e-5, atol=1e-6)
    counts = _collectives(f, *args)
    assert sum(counts.values()) == 1, counts


@pytest.mark.parametrize("name", ["hybrid_2x4", "zero3"])
def test_transformer_step_matches_one_device(name):
    """The tiny NNX transformer's adamw train step, Megatron x batch on a (2, 4) grid and ZeRO-3
    on 4 devices: loss and updated parameters as on one device."""
    train_step, plain, args = _transformer_step_case(name)
    ref_loss, ref_p, _ = train_step(*plain)
    loss, new_p, _ = jsbp.jit(train_step)(*args)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    assert_tree_close(new_p, ref_p, rtol=1e-4, atol=1e-5)


def test_unhinted_gpt_step_needs_no_more_collectives_than_megatron(monkeypatch):
    """benchmarks/compiler.py's un-hinted DPxTP GPT train step (no layout hints inside the step):
    at most the 29 collectives of the hand-written Megatron step."""
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    import compiler as bc

    sys.modules.pop("planner", None)
    strat = [s for s in bc.strategies() if s.name.startswith("DPxTP")][0]
    case = bc.Case(strat, (256, 64, 8, 1, 16, 32))
    counts = _collectives(case.jsbp_fn(), *case.jsbp_args())
    assert sum(counts.values()) <= 29, counts


def test_scan_over_layers_step_matches_one_device():
    """The zoo's scan-over-layers MLP (BatchNorm in the scanned body) on dp=2 x tp=4: the forward
    and backward loop bodies are planned with the rest of the step. Two train steps (the second
    reads the first update) give one device's losses; the plan's collectives are the compiled
    program's, at most 6."""
    from flax import nnx
    from models import load
    from test_model_zoo import RTOL, _init, make_strategy, train

    import jsbp.flax as jflax

    mod = load("scan_mlp")
    strategy = make_strategy("dp2tp4", mod.RULES)
    got, _ = train(mod, strategy, steps=2)
    want, _ = train(mod, None, steps=2)
    np.testing.assert_allclose(got, want, rtol=RTOL)

    model, optimizer = jflax.shard(_init(mod), strategy)
    step = jflax.make_train_step(mod.loss_fn, strategy)
    graphdef, state = nnx.split((model, optimizer))
    batch = step.put_batch(mod.batch(0))
    fn = step.pure(graphdef, state, batch)
    assert len(_loop_bodies(fn.lower_program(state, batch).program)) >= 2
    counts = _collectives(fn, state, batch)
    assert sum(counts.values()) <= 6, counts


@pytest.mark.parametrize("rows", [64, 60])
def test_loop_carry_is_chosen_with_the_rest_of_the_program(rows):
    """A scan over one micro-batch adds a batch-split slice to a replicated carry, and the result
    is asked for split: the carry is chosen with the output's layout in view and stays split, so
    the program needs no collective (not an all-gather after the loop and a slice). Values match
    one device, also where the rows do not divide evenly."""

    def f(c0, xs):
        return jax.lax.scan(lambda c, x: (c + x, None), c0, xs)[0]

    cv, xv = rand(rows, 32), rand(1, rows, 32)
    c, xs = gt(cv, P8, "B"), gt(xv, P8, "S(1)")
    fn = jsbp.jit(f, out_sbp=jsbp.sbp.split(0))
    y = fn(c, xs)
    np.testing.assert_allclose(y.numpy(), np.asarray(f(cv, xv)), rtol=1e-6)
    assert y.sbp == (jsbp.sbp.split(0),)
    assert _collectives(fn, c, xs) == {}


def _recurrence(a, h0, xs):
    """An RNN-like scan: a weight made in the program (not an input, so not anchored) read by
    every iteration, a carry, a scanned input and a scanned output."""
    w = jnp.tanh(a)

    def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum(axis=1)

    return jax.lax.scan(body, h0, xs)


def _while_recurrence(a, h0):
    """``_recurrence`` as a ``while`` loop of 5 steps (its trip count unknown to the planner)."""
    w = jnp.tanh(a)

    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ w + 0.1)

    return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, h0))[1]


@pytest.mark.parametrize("loop", ["scan", "while"])
def test_loop_invariant_is_converted_once(loop):
    """A column-split weight read by every iteration of a loop is all-gathered once before the
    loop, and the iterations run with no communication (not the new hidden state all-gathered
    every iteration). Values match one device."""
    av, hv, xv = rand(32, 32) * 0.2, rand(16, 32), rand(8, 16, 32)
    if loop == "scan":
        fn_of, vals, lays = _recurrence, (av, hv, xv), ("S(1)", "B", "B")
    else:
        fn_of, vals, lays = _while_recurrence, (av, hv), ("S(1)", "B")
    args = [gt(v, P8, lay) for v, lay in zip(vals, lays)]
    fn = jsbp.jit(fn_of)
    assert_tree_close(fn(*args), fn_of(*vals), rtol=1e-5, atol=1e-5)
    prog = fn.lower_program(*args).program
    assert any(st.kind == loop for st in prog.steps)
    assert _loop_collectives(prog) == (1, 0)
    assert sum(_collectives(fn, *args).values()) == 1


def _nested(a, h0, xs):
    """A scan whose body runs a scan of its own and a ``cond``: the weight made in the program
    is read by the inner body and one branch, 4 x 3 inner iterations."""
    w = jnp.tanh(a)

    def outer(h, x):
        g, _ = jax.lax.scan(lambda g, _: (jnp.tanh(g @ w + x), None), h, None, length=3)
        g = jax.lax.cond(g.sum() > 0, lambda g: g * 0.5, lambda g: g @ w, g)
        return g, g.sum(axis=1)

    return jax.lax.scan(outer, h0, xs)


def test_nested_bodies_convert_a_loop_invariant_once():
    """A loop and a ``cond`` inside a loop body are planned with the whole nest: the column-split
    weight read in the inner scan and in a branch is all-gathered once, before the outer loop
    (not the inner loop's hidden state and the branch's result every iteration). Values match
    one device."""
    av, hv, xv = rand(32, 32) * 0.2, rand(16, 32), rand(4, 16, 32)
    args = (gt(av, P8, "S(1)"), gt(hv, P8, "B"), gt(xv, P8, "B"))
    fn = jsbp.jit(_nested)
    assert_tree_close(fn(*args), _nested(av, hv, xv), rtol=1e-4, atol=1e-4)
    assert sum(_collectives(fn, *args).values()) == 1
    rows = jsbp.explain(fn, *args).rows
    assert [r.depth for r in rows for b in r.boxings if b.collectives] == [0], str(
        jsbp.explain(fn, *args)
    )


def _noisy_decay(x, key):
    """A scan carrying a PRNG key, a float state and a boolean flag."""

    def body(c, _):
        k, h, flag = c
        k, sub = jax.random.split(k)
        h = h * 0.9 + jax.random.normal(sub, h.shape) * 0.01
        return (k, h, jnp.logical_or(flag, h.sum() > 0)), h.mean()

    (k, h, flag), ys = jax.lax.scan(body, (key, x, False), None, length=4)
    return h, flag, ys, jax.random.key_data(k)


@pytest.mark.parametrize("layout", ["B", "S(0)", "S(1)"])
def test_loop_carries_keys_and_booleans(layout):
    """A PRNG key and a boolean carried through a scan come out as on one device, whatever the
    state's layout: neither is ever carried as a partial value."""
    xv = rand(16, 8)
    want = jax.jit(_noisy_decay)(xv, jax.random.key(1))
    fn = jsbp.jit(_noisy_decay)
    got = fn(gt(xv, P8, layout), jax.random.key(1))
    for o, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(o.numpy()), np.asarray(r), rtol=1e-5, atol=1e-6)
    prog = fn.lower_program(gt(xv, P8, layout), jax.random.key(1)).program
    (scan,) = [st for _, st in iter_steps(prog) if st.kind == "scan"]
    for v, lay in zip(scan.eqn.outvars, scan.out_layouts):
        if not jnp.issubdtype(v.aval.dtype, jnp.inexact):  # the key and the flag
            assert not lay.partial_axes, (v.aval, lay.nd_sbp)


_INLINE_LAYOUTS_1D = list(
    itertools.product(["B", "S(0)", "S(1)"], ["B", "S(0)", "S(1)"], ["B", "S(0)", "S(1)", "S(2)"])
)
_INLINE_LAYOUTS_2D = [
    (a, h, x)
    for a, h, x in itertools.product(
        itertools.product(["B", "S(0)", "S(1)"], repeat=2),
        itertools.product(["B", "S(0)", "S(1)"], repeat=2),
        itertools.product(["B", "S(1)", "S(2)"], repeat=2),
    )
][::37]
_INLINE_CASES = [
    pytest.param(P4, lay, id=f"1d-{'-'.join(lay)}", marks=() if k % 6 == 0 else pytest.mark.slow)
    for k, lay in enumerate(_INLINE_LAYOUTS_1D)
] + [
    pytest.param(
        P2x2,
        lay,
        id=f"2d-{'-'.join(map(','.join, lay))}",
        marks=() if k % 3 == 0 else pytest.mark.slow,
    )
    for k, lay in enumerate(_INLINE_LAYOUTS_2D)
]


def _controlled(a, h0, xs, p):
    """A scan (with a scan and a ``cond`` in its body: ``_nested``), a ``cond`` and a ``while`` in
    a row (a branch on ``p``'s sign, ``_while_recurrence``)."""
    h, ys = _nested(a, h0, xs)
    z = jax.lax.cond(p > 0, lambda h: (h - h.mean(0)) * 2.0, lambda h: h @ jnp.tanh(a).T, h)
    return _while_recurrence(a, z), ys


@pytest.mark.parametrize("placement,layouts", _INLINE_CASES)
def test_loops_and_branches_match_one_device(placement, layouts):
    """Oracle: a scan (a scan and a ``cond`` nested in its body), a ``cond`` (both branches
    taken) and a ``while``, planned with the program around them, the weight, initial carry and
    scanned input in every layout on 4 devices (and a sample of the pairs on 2 x 2), shapes that
    do not divide evenly (6 rows, 10 features, 5 steps): results as plain JAX's, in the layouts
    the planner chose."""
    av, hv, xv = rand(10, 10) * 0.3, rand(6, 10), rand(5, 6, 10)
    args = [gt(v, placement, lay) for v, lay in zip((av, hv, xv), layouts)]
    flag = [jsbp.tensor(np.float32(s), placement, ("B",) * placement.ndim) for s in (1, -1)]
    fn = jsbp.jit(_controlled)
    for f, s in zip(flag, (1, -1)):
        assert_tree_close(
            fn(*args, f), _controlled(av, hv, xv, np.float32(s)), rtol=1e-5, atol=1e-5
        )
    prog = fn.lower_program(*args, flag[0]).program
    assert {st.kind for st in prog.steps} >= {"scan", "cond", "while"}


@pytest.mark.parametrize("partial_first", [True, False])
def test_cond_result_layouts_do_not_depend_on_the_branch_order(partial_first):
    """A ``cond`` whose one branch contracts a split dim (its result a partial sum) and whose other
    passes the split operand on, its result read replicated. The results' layouts are chosen with
    both branches in view, not taken from the first branch: one collective in either order (the
    result all-reduced, or the two operands gathered together before the ``cond``: the same
    bytes). Values match one device for both predicates."""
    mm, th = (lambda x, w: x.T @ w), (lambda x, w: jnp.tanh(x))

    def f(p, x, w):  # branches = (false, true)
        return (
            jax.lax.cond(p > 0, th, mm, x, w)
            if partial_first
            else jax.lax.cond(p > 0, mm, th, x, w)
        )

    xv, wv = rand(32, 32), rand(32, 32)
    x, w = gt(xv, P8, "S(0)"), gt(wv, P8, "S(0)")
    fn = jsbp.jit(f, out_sbp=jsbp.sbp.broadcast)
    for pv in (1.0, -1.0):
        p = gt(np.float32(pv), P8, "B")
        np.testing.assert_allclose(
            fn(p, x, w).numpy(), np.asarray(f(pv, xv, wv)), rtol=1e-4, atol=1e-4
        )
    counts = _collectives(fn, p, x, w)
    assert sum(counts.values()) == 1 and set(counts) <= {"all-reduce", "all-gather"}, counts


def test_cond_branch_reduces_each_statistic_once():
    """A batch-normalising ``cond`` branch on (2, 2), batch split over the first axis, features
    over the second: each partial statistic is all-reduced once (at most 2 collectives), not
    reduce-scattered and gathered back. Values match one device for both predicates."""

    def bn(x, g):
        m = x.mean(0)
        v = ((x - m) ** 2).mean(0)
        return (x - m) / jnp.sqrt(v + 1e-5) * g

    def fn(p, x, w, g):
        return jax.lax.cond(p.sum() > 0, bn, lambda h, g: h * g, x @ w, g)

    vals = (rand(4), rand(16, 8), rand(8, 32), rand(32))
    args = tuple(
        gt(v, P2x2, nd)
        for v, nd in zip(vals, [("B", "B"), ("S(0)", "B"), ("B", "S(1)"), ("B", "S(0)")])
    )
    planned = jsbp.jit(fn)
    counts = _collectives(planned, *args)
    assert "reduce-scatter" not in counts and sum(counts.values()) <= 2, counts
    np.testing.assert_allclose(planned(*args).numpy(), jax.jit(fn)(*vals), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        planned(*(gt(-vals[0], P2x2, ("B", "B")),) + args[1:]).numpy(),
        jax.jit(fn)(-vals[0], *vals[1:]),
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_gpt_step_matches_one_device(zero):
    """examples/train_gpt.py's GPT on dp=8 under ZeRO-2 / ZeRO-3 (as ``tests/test_flax.py`` plans
    it), gradients' reduce-scatters (and ZeRO-3's parameter all-gathers) combined into one
    collective each: the plan's collectives, combined ones counted once, are the compiled
    program's, and two steps give one device's losses and parameters."""
    from _examples import load_example
    from flax import nnx

    tg = load_example("train_gpt")
    cfg = tg.GPTConfig(vocab=56, seq=16, d_model=32, n_heads=8, n_layers=1, d_mlp=64)
    run = tg.train("dp=8", zero=zero, steps=2, cfg=cfg, batch=16)
    model, opt = run.sharded
    batch = next(tg.Corpus().batches(0, 16, cfg.seq))
    planned = run.step_fn.explain(model, opt, batch).collectives()
    assert planned == run.step_fn.count_collectives(model, opt, batch), planned
    ref = tg.train("none", steps=2, cfg=cfg, batch=16)  # one device
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)
    got, want = (dict(nnx.to_flat_state(nnx.state(r.model, nnx.Param))) for r in (run, ref))
    assert got.keys() == want.keys()
    for path, v in want.items():
        np.testing.assert_allclose(
            np.asarray(got[path].get_value()),
            np.asarray(v.get_value()),
            rtol=1e-5,
            atol=1e-5,
            err_msg=str(path),
        )
