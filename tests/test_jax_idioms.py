"""JAX idioms from real training code under ``jsbp.jit``, against plain ``jax.jit`` on one device.

Each case is a user-style function (per-example gradients, scans with mixed carries, remat
policies, data-dependent branches, attention, per-example noise, Shampoo-style linear algebra,
sorts and scans along a split dim). Its inputs are given every relevant layout (B / S(d), even
and uneven shapes) on a 1-d placement of 4 devices and a (2, 2) placement; values, dtypes and
shapes must match one device. Where jsbp cannot be exact it must raise ``jsbp.SbpError``, never
return a wrong value.

The default run samples the layout grid (deterministically: every layout of every input at least
once on (4,), a rotating window on (2, 2)); ``JSBP_FULL=1`` runs the whole grid.
"""

from __future__ import annotations

import itertools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import FULL

import jsbp

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
Q22 = jsbp.placement("cpu", [[0, 1], [2, 3]])
PLACEMENTS = {"p4": P4, "p22": Q22}


# ----------------------------------------------------------------------------------------------
# harness


def _opts(shape, split=True):
    return ([f"S({d})" for d in range(len(shape))] if split else []) + ["B"]


def layout_grid(shapes, plc, splittable=None):
    """Every combination of B / S(d) per input (nd: per axis) on ``plc``."""
    splittable = splittable or [True] * len(shapes)
    per_input = []
    for s, ok in zip(shapes, splittable):
        o = _opts(s, ok)
        per_input.append([(x,) for x in o] if plc.ndim == 1 else list(itertools.product(o, o)))
    return list(itertools.product(*per_input))


def sampled(grid, tag, k, each=True):
    """Deterministic sample of ``grid`` (all of it with JSBP_FULL=1): with ``each``, every layout
    of every input once (the others at B); then ``k`` more, spread over the grid from a start
    that depends on ``tag``."""
    if FULL:
        return grid
    n = len(grid[0])
    keep = []
    if each:
        allb = tuple(("B",) * len(grid[0][0]) for _ in range(n))
        for i in range(n):
            for g in grid:
                if all(g[j] == allb[j] for j in range(n) if j != i) and g not in keep:
                    keep.append(g)
    rest = [g for g in grid if g not in keep]
    if rest:
        start, stride = zlib.crc32(tag.encode()) % len(rest), max(1, len(rest) // max(1, k))
        keep += [rest[(start + stride * j) % len(rest)] for j in range(min(k, len(rest)))]
    return list(dict.fromkeys(keep))


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))


def _np(x):
    return np.asarray(x.numpy() if isinstance(x, jsbp.GlobalTensor) else x)


def check(fn, args, plc, layouts, *, rtol=1e-5, atol=1e-5, static=()):
    """``jsbp.jit(fn)`` on ``args`` laid out as ``layouts`` == ``jax.jit(fn)`` on one device.

    Returns "pass" or "raise" (a jsbp.SbpError: allowed, "raise instead of compute")."""
    ref = jax.jit(fn)(*[jnp.asarray(a) for a in args])
    gargs = [
        jsbp.tensor(np.asarray(a), placement=plc, sbp=lay) if lay is not None else a
        for a, lay in zip(args, layouts)
    ]
    try:
        got = jsbp.jit(fn)(*gargs)
    except jsbp.SbpError:
        return "raise"
    rl, gl = jax.tree_util.tree_leaves(ref), _leaves(got)
    assert len(rl) == len(gl), (len(rl), len(gl))
    for i, (r, g) in enumerate(zip(rl, gl)):
        r, g = np.asarray(r), _np(g)
        where = f"{plc.hierarchy} {layouts} leaf {i}"
        assert g.shape == r.shape, f"{where}: shape {g.shape} != {r.shape}"
        assert g.dtype == r.dtype, f"{where}: dtype {g.dtype} != {r.dtype}"
        if r.dtype == bool or np.issubdtype(r.dtype, np.integer):
            np.testing.assert_array_equal(g, r, err_msg=where)
        else:
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=where)
    return "pass"


def sweep(fn, args, tag, *, k1=1, k2=3, splittable=None, must_pass=True, **kw):
    """Run ``check`` over the sampled layout grid on (4,) and (2, 2)."""
    shapes = [np.shape(a) for a in args]
    results = {}
    for name, plc in PLACEMENTS.items():
        grid = layout_grid(shapes, plc, splittable)
        for lay in sampled(grid, f"{tag}-{name}", k1 if plc.ndim == 1 else k2, each=plc.ndim == 1):
            results[(name, lay)] = check(fn, args, plc, lay, **kw)
    if must_pass:
        raised = [k for k, v in results.items() if v == "raise"]
        assert not raised, f"{tag}: jsbp raised on {raised[:3]}"
    return results


def slow(v):
    """A parameter that runs only with JSBP_FULL=1 (the even shapes: the uneven ones are harder)."""
    return pytest.param(v, marks=pytest.mark.slow)


def rng_arr(seed, *shape, lo=-1.0, hi=1.0, dtype=np.float32):
    return np.random.default_rng(seed).uniform(lo, hi, shape).astype(dtype)


# ----------------------------------------------------------------------------------------------
# 1. per-example gradients (DP-SGD)


def _mlp_loss(params, x, y):
    w1, b1, w2 = params
    h = jnp.tanh(x @ w1 + b1)
    logits = h @ w2
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, logits.shape[-1]))


def _dpsgd(w1, b1, w2, x, y, clip=1.0):
    params = (w1, b1, w2)
    grads = jax.vmap(jax.grad(_mlp_loss), in_axes=(None, 0, 0))(params, x, y)
    flat = jnp.concatenate([g.reshape(g.shape[0], -1) for g in grads], axis=1)
    norms = jnp.linalg.norm(flat, axis=1)
    scale = jnp.minimum(1.0, clip / (norms + 1e-6))
    return jax.tree_util.tree_map(
        lambda g: jnp.mean(g * scale.reshape((-1,) + (1,) * (g.ndim - 1)), axis=0), grads
    )


@pytest.mark.parametrize("batch", [slow(8), 7])
def test_per_example_grads_clipped_mean(batch):
    w1, b1, w2 = rng_arr(0, 5, 6), rng_arr(1, 6), rng_arr(2, 6, 3)
    x = rng_arr(3, batch, 5, lo=-2, hi=2)
    y = np.random.default_rng(4).integers(0, 3, batch).astype(np.int32)
    sweep(
        lambda w1, b1, w2, x, y: _dpsgd(w1, b1, w2, x, y, clip=0.5),
        [w1, b1, w2, x, y],
        f"dpsgd{batch}",
    )


def test_per_example_grads_data_parallel_is_local():
    """Data parallel DP-SGD: per-example grads, norms and clipping are local to each example's
    device; the mean over the batch is left partial (P), so the step needs no collective."""
    w1, b1, w2 = rng_arr(0, 5, 6), rng_arr(1, 6), rng_arr(2, 6, 3)
    x = rng_arr(3, 7, 5)
    y = np.random.default_rng(4).integers(0, 3, 7).astype(np.int32)
    vals = [w1, b1, w2, x, y]
    args = [
        jsbp.tensor(v, placement=P4, sbp=s) for v, s in zip(vals, ["B", "B", "B", "S(0)", "S(0)"])
    ]
    f = jsbp.jit(_dpsgd)
    coll = jsbp.debug.count_collectives(f, *args)
    assert sum(coll.values()) == 0, coll
    out = f(*args)
    assert [g.sbp for g in out] == [(jsbp.sbp.partial_sum,)] * 3
    ref = jax.jit(_dpsgd)(*[jnp.asarray(v) for v in vals])
    for g, r in zip(out, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# 2. scan / fori_loop / while_loop


def _rnn(h0, w, xs):
    # carry: (split activation h, replicated step counter / running norm)
    def step(carry, x_t):
        h, state = carry
        h = jnp.tanh(h @ w + x_t)
        state = 0.9 * state + 0.1 * jnp.mean(h * h)
        return (h, state), h.sum(-1)

    (h, state), ys = jax.lax.scan(step, (h0, jnp.float32(0.0)), xs)
    return h, state, ys


@pytest.mark.parametrize("batch", [slow(8), 6])
def test_scan_mixed_carry(batch):
    h0, w, xs = rng_arr(0, batch, 4), rng_arr(1, 4, 4), rng_arr(2, 5, batch, 4)
    sweep(_rnn, [h0, w, xs], f"scan{batch}")


def _fori_buffer(x):
    n = x.shape[0]
    buf = jnp.zeros((n + 2, x.shape[1]), x.dtype)

    def body(i, buf):
        row = jax.lax.dynamic_slice_in_dim(x, i, 1, 0) * (i + 1)
        return jax.lax.dynamic_update_slice_in_dim(buf, row, i + 1, 0)

    return jax.lax.fori_loop(0, n, body, buf)


@pytest.mark.parametrize("shape", [slow((8, 4)), (7, 6)])
def test_fori_loop_dynamic_update_slice(shape):
    sweep(_fori_buffer, [rng_arr(0, *shape)], f"fori{shape}")


def _while_until_small(x):
    def cond(c):
        v, i = c
        return (jnp.max(jnp.abs(v)) > 0.1) & (i < 50)

    def body(c):
        v, i = c
        return v * 0.5, i + 1

    v, i = jax.lax.while_loop(cond, body, (x, 0))
    return v, i


@pytest.mark.parametrize("shape", [slow((8, 4)), (6, 7)])
def test_while_loop_data_dependent_stop(shape):
    x = rng_arr(0, *shape, lo=-3, hi=3)
    x.flat[5] = 40.0  # one element decides the trip count: every shard must see it
    sweep(_while_until_small, [x], f"while{shape}")


def test_scan_mixed_carry_keeps_the_batch_split():
    """h0 and xs split on the batch: the step's mean is one all-reduce of a scalar per step; the
    activation is never gathered."""
    args = [
        jsbp.tensor(rng_arr(0, 6, 4), placement=P4, sbp="S(0)"),
        jsbp.tensor(rng_arr(1, 4, 4), placement=P4, sbp="B"),
        jsbp.tensor(rng_arr(2, 5, 6, 4), placement=P4, sbp="S(1)"),
    ]
    coll = jsbp.debug.count_collectives(jsbp.jit(_rnn), *args)
    assert coll["all-gather"] == 0 and coll["all-to-all"] == 0, coll
    h, state, ys = jsbp.jit(_rnn)(*args)
    assert h.sbp == (jsbp.sbp.split(0),) and ys.sbp == (jsbp.sbp.split(1),)


def _loss(w, x, y):
    return jnp.mean((jnp.tanh(x @ w) - y) ** 2)


def _grad_accum(w, xs, ys):
    """Gradient accumulation over micro-batches with scan (the grads of a split batch are P)."""

    def step(acc, b):
        l, g = jax.value_and_grad(_loss)(w, *b)
        return (acc[0] + l, acc[1] + g), l

    (lt, gt), ls = jax.lax.scan(step, (0.0, jnp.zeros_like(w)), (xs, ys))
    return lt / xs.shape[0], gt / xs.shape[0], ls


def _adam_fori(w, x, y):
    def body(i, st):
        w, m, v = st
        g = jax.grad(_loss)(w, x, y)
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        return w - 0.1 * m / (jnp.sqrt(v) + 1e-8), m, v

    return jax.lax.fori_loop(0, 3, body, (w, jnp.zeros_like(w), jnp.zeros_like(w)))


def _early_stop(w, x, y):
    def cond(c):
        return (c[2] > 0.05) & (c[1] < 20)

    def body(c):
        w, i, _ = c
        l, g = jax.value_and_grad(_loss)(w, x, y)
        return w - 0.5 * g, i + 1, l

    return jax.lax.while_loop(cond, body, (w, 0, 1.0))


def test_grad_accumulation_scan():
    sweep(
        _grad_accum,
        [rng_arr(0, 5, 3), rng_arr(1, 3, 7, 5), rng_arr(2, 3, 7, 3)],
        "accum",
        k1=2,
        k2=4,
    )


@pytest.mark.parametrize("fn", [_adam_fori, _early_stop], ids=["adam-fori", "early-stop-while"])
def test_optimizer_loops_with_partial_grads(fn):
    sweep(
        fn,
        [rng_arr(0, 5, 3), rng_arr(1, 7, 5), rng_arr(2, 7, 3)],
        fn.__name__,
        k1=1,
        k2=2,
        rtol=1e-4,
    )


# ----------------------------------------------------------------------------------------------
# 3. remat with a policy inside a gradient


def _remat_loss(w1, w2, x):
    @jax.checkpoint
    def block(x):
        return jnp.tanh(x @ w1) @ w2

    blk = jax.checkpoint(
        lambda x: jax.nn.gelu(x @ w1) @ w2,
        policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    )
    return jnp.mean(blk(x) ** 2) + jnp.mean(block(x))


@pytest.mark.parametrize("batch", [slow(8), 6])
def test_checkpoint_policy_in_grad(batch):
    w1, w2, x = rng_arr(0, 4, 6), rng_arr(1, 6, 4), rng_arr(2, batch, 4)
    sweep(jax.grad(_remat_loss, argnums=(0, 1)), [w1, w2, x], f"remat{batch}", rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# 4. cond / switch on a global reduction


def _cond_on_norm(x, w):
    n = jnp.sum(x * x)
    y = jax.lax.cond(n > 20.0, lambda x: x @ w, lambda x: -(x @ w) * 2.0, x)
    idx = jnp.clip(jnp.argmax(jnp.sum(x, axis=0)) % 3, 0, 2)
    z = jax.lax.switch(idx, [lambda v: v + 1.0, lambda v: v * v, lambda v: jnp.sin(v)], y)
    return y, z


@pytest.mark.parametrize("shape", [slow((8, 3)), (7, 3)])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_cond_switch_on_global_reduction(shape, scale):
    x = rng_arr(0, *shape) * scale
    w = rng_arr(1, shape[1], 5)
    sweep(_cond_on_norm, [x, w], f"cond{shape}{scale}")


# ----------------------------------------------------------------------------------------------
# 5. attention, one-hot cross entropy, take_along_axis


def _attn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("shape", [slow((2, 8, 2, 4)), (3, 6, 2, 4)])
def test_causal_dot_product_attention(shape):
    q, k, v = rng_arr(0, *shape), rng_arr(1, *shape), rng_arr(2, *shape)
    # q, k, v in one layout (batch, sequence, heads or head dim split), then each alone
    for name, plc in PLACEMENTS.items():
        opts = _opts(shape)
        lays = [(o,) for o in opts] if plc.ndim == 1 else list(itertools.product(opts, opts))
        for lay in sampled(lays, f"attn{shape}{name}", 3, each=False):
            check(_attn, [q, k, v], plc, [lay, lay, lay], rtol=1e-4, atol=1e-5)
    sweep(_attn, [q, k, v], f"attn{shape}", k1=0, k2=2, rtol=1e-4, atol=1e-5)


def test_causal_attention_grad_gqa():
    q, k, v = rng_arr(0, 2, 6, 4, 4), rng_arr(1, 2, 6, 2, 4), rng_arr(2, 2, 6, 2, 4)

    def loss(q, k, v):
        return jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)

    f = jax.grad(loss, argnums=(0, 1, 2))
    if FULL:
        sweep(f, [q, k, v], "attn-grad", rtol=1e-4, atol=1e-5)
        return
    # data, sequence (q alone, and k / v alone) and head parallel; batch x heads on (2, 2)
    for plc, lays in [
        (
            P4,
            [
                [("S(0)",)] * 3,
                [("S(1)",), ("B",), ("B",)],
                [("B",), ("S(1)",), ("S(1)",)],
                [("S(2)",)] * 3,
            ],
        ),
        (Q22, [[("S(0)", "S(2)")] * 3, [("S(1)", "S(3)"), ("B", "S(1)"), ("S(2)", "B")]]),
    ]:
        for lay in lays:
            check(f, [q, k, v], plc, lay, rtol=1e-4, atol=1e-5)


def _xent(logits, labels):
    onehot = jax.nn.one_hot(labels, logits.shape[-1])
    loss = -jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]
    return (
        jnp.mean(loss),
        loss,
        picked,
        jax.grad(lambda lg: jnp.mean(-jnp.sum(onehot * jax.nn.log_softmax(lg), -1)))(logits),
    )


@pytest.mark.parametrize("shape", [slow((8, 5)), (7, 6)])
def test_one_hot_cross_entropy_take_along_axis(shape):
    logits = rng_arr(0, *shape, lo=-3, hi=3)
    labels = np.random.default_rng(1).integers(0, shape[1], shape[0]).astype(np.int32)
    sweep(_xent, [logits, labels], f"xent{shape}")


# ----------------------------------------------------------------------------------------------
# 6. randomness


def _per_example_noise(x, step):
    key = jax.random.fold_in(jax.random.key(0), step)
    keys = jax.random.split(key, x.shape[0])
    noise = jax.vmap(lambda k, r: jax.random.normal(k, r.shape))(keys, x)
    return x + 0.1 * noise, jax.random.uniform(jax.random.fold_in(key, 3), (x.shape[1],))


@pytest.mark.parametrize("shape", [slow((8, 4)), (6, 5)])
def test_per_example_noise(shape):
    x = rng_arr(0, *shape)
    step = np.int32(7)
    sweep(_per_example_noise, [x, step], f"noise{shape}", splittable=[True, False])


# ----------------------------------------------------------------------------------------------
# 7. linalg in training code


def _norms(x):
    return (
        jnp.linalg.norm(x, axis=0),
        jnp.linalg.norm(x, axis=1),
        jnp.linalg.norm(x, axis=(0, 1)),
        jnp.linalg.norm(x, ord=jnp.inf, axis=1),
    )


@pytest.mark.parametrize("shape", [slow((8, 4)), (7, 6)])
def test_linalg_norm_axes(shape):
    sweep(_norms, [rng_arr(0, *shape)], f"norm{shape}")


def _shampoo(g, l_stat):
    l_stat = 0.9 * l_stat + g @ g.T + 1e-1 * jnp.eye(g.shape[0])
    c = jnp.linalg.cholesky(l_stat)
    pre = jax.scipy.linalg.cho_solve((c, True), g)
    q, r = jnp.linalg.qr(g)
    s = jnp.linalg.solve(l_stat, g)
    return pre, jnp.abs(jnp.diagonal(r)), jnp.abs(q).sum(), s


@pytest.mark.parametrize("shape", [slow((4, 6)), slow((6, 6)), (5, 3)])
def test_shampoo_style_linalg(shape):
    g = rng_arr(0, *shape)
    a = rng_arr(1, shape[0], shape[0])
    l_stat = (a @ a.T + np.eye(shape[0], dtype=np.float32)).astype(np.float32)
    sweep(_shampoo, [g, l_stat], f"shampoo{shape}", rtol=1e-4, atol=1e-4, must_pass=False)


# ----------------------------------------------------------------------------------------------
# 8. scans and sorts along a split dim


def _scans_sorts(x):
    return (
        jax.lax.associative_scan(jnp.add, x, axis=0),
        jax.lax.associative_scan(jnp.maximum, x, axis=1),
        jnp.cumsum(x, axis=0),
        jnp.sort(x, axis=0),
        jnp.argsort(x, axis=1),
        jax.lax.top_k(x, 2),
        jax.lax.top_k(x.T, 2),
    )


@pytest.mark.parametrize("shape", [slow((8, 4)), (7, 6)])
def test_scans_and_sorts_along_split_dims(shape):
    sweep(_scans_sorts, [rng_arr(0, *shape)], f"sorts{shape}", must_pass=False)


def test_sorts_with_ties_across_blocks():
    """Ties straddle the block boundaries: stable argsort, top_k and argmax must return the
    smallest index among equals, as on one device."""
    x = np.random.default_rng(0).integers(0, 3, (7, 6)).astype(np.float32)
    sweep(
        lambda x: (
            jnp.argsort(x, axis=0),
            jnp.argsort(x, axis=1),
            jax.lax.top_k(x, 3),
            jax.lax.top_k(x.T, 3),
            jnp.argmax(x, 0),
            jnp.argmin(x, 1),
            jnp.argmax(x),
        ),
        [x],
        "ties",
        must_pass=False,
    )


def test_scan_and_sort_collectives_on_2d():
    """A split scan dim is gathered at most once; nothing crosses an axis whose split is kept."""
    x = jsbp.tensor(rng_arr(0, 7, 6), placement=P4, sbp="S(1)")
    coll = jsbp.debug.count_collectives(jsbp.jit(lambda x: (jnp.cumsum(x, 0), jnp.sort(x, 0))), x)
    assert sum(coll.values()) == 0, coll  # along the unsplit dim: purely local


# ----------------------------------------------------------------------------------------------
# 9. more training-loop shapes: loop-carried layouts that change, scatter-adds, keys as data


def _while_transpose(x):
    return jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0].T * 1.5, c[1] + 1), (x, 0))[0]


def test_while_carry_layout_changes_in_body():
    sweep(_while_transpose, [rng_arr(0, 6, 6)], "while-T")


def test_cond_branches_with_different_layouts():
    """One branch contracts a split dim (a partial result), the other a global sum (B)."""

    def f(x, w):
        pos = jax.lax.cond(
            jnp.sum(x) > 0,
            lambda a: a @ w,
            lambda a: jnp.sum(a) * jnp.ones((a.shape[0], w.shape[1])),
            x,
        )
        neg = jax.lax.cond(
            jnp.sum(x) < 0,
            lambda a: a @ w,
            lambda a: jnp.sum(a) * jnp.ones((a.shape[0], w.shape[1])),
            x,
        )
        return pos, neg

    sweep(f, [rng_arr(0, 7, 6), rng_arr(1, 6, 5)], "cond-layouts")


def test_scan_over_layers_with_remat_policy_grad():
    def loss(ws, x):
        def blk(h, w):
            return jnp.tanh(h @ w), None

        pol = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        h, _ = jax.lax.scan(jax.checkpoint(blk, policy=pol), x, ws)
        return jnp.mean(h**2)

    sweep(
        jax.value_and_grad(loss, argnums=(0, 1)),
        [rng_arr(0, 3, 6, 6), rng_arr(1, 7, 6)],
        "layers-remat",
        rtol=1e-4,
    )


def test_fori_loop_into_a_split_input_buffer_dynamic_trip_count():
    def f(buf, x, n):
        def body(i, b):
            return jax.lax.dynamic_update_slice(b, x[i][None] * i, (i + 1, 0))

        return jax.lax.fori_loop(0, n, body, buf)

    sweep(
        f,
        [rng_arr(0, 7, 5), rng_arr(1, 5, 5), np.int32(4)],
        "fori-buf",
        splittable=[True, True, False],
    )


def test_segment_sum_and_scatter_add_on_split_rows():
    seg = np.random.default_rng(1).integers(0, 4, 7).astype(np.int32)

    def f(d, s, b):
        return (
            jax.ops.segment_sum(d, s, num_segments=4),
            jax.ops.segment_max(d, s, num_segments=4),
            b.at[s].add(d[:, :3]),
        )

    sweep(f, [rng_arr(2, 7, 5), seg, rng_arr(3, 6, 3)], "segments")


def test_per_example_keys_as_data():
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 7)))

    def f(k, x):
        keys = jax.random.wrap_key_data(k)
        return jax.vmap(lambda kk, r: r + jax.random.normal(jax.random.fold_in(kk, 1), r.shape))(
            keys, x
        )

    sweep(f, [kd, rng_arr(1, 7, 5)], "keys-data", k2=2)


# ----------------------------------------------------------------------------------------------
# 10. the obvious cheapest plans: data / head parallel training steps need no collective


def _remat_grad(w1, w2, x):
    return jax.grad(_remat_loss, argnums=(0, 1))(w1, w2, x)


def _vmap_noise(x):
    keys = jax.random.split(jax.random.key(0), x.shape[0])
    return jax.vmap(lambda k, r: r + jax.random.normal(k, r.shape))(keys, x)


_Y7 = np.arange(7, dtype=np.int32) % 3
_QKV = [rng_arr(i, 3, 6, 2, 4) for i in range(3)]
_LOCAL_CASES = {
    "xent-dp": (_xent, [rng_arr(0, 7, 6), _Y7], P4, ["S(0)", "S(0)"]),
    "attn-dp": (_attn, _QKV, P4, ["S(0)"] * 3),
    "attn-heads": (_attn, _QKV, P4, ["S(2)"] * 3),
    "attn-dp-heads": (_attn, _QKV, Q22, [("S(0)", "S(2)")] * 3),
    "noise-dp": (_vmap_noise, [rng_arr(0, 7, 5)], P4, ["S(0)"]),
    "remat-grad-dp": (
        _remat_grad,
        [rng_arr(0, 4, 6), rng_arr(1, 6, 4), rng_arr(2, 7, 4)],
        P4,
        ["B", "B", "S(0)"],
    ),
    "dpsgd-2d": (
        _dpsgd,
        [rng_arr(0, 5, 6), rng_arr(1, 6), rng_arr(2, 6, 3), rng_arr(3, 7, 5), _Y7],
        Q22,
        [("B", "B")] * 3 + [("S(0)", "S(0)")] * 2,
    ),
    "accum-dp": (
        _grad_accum,
        [rng_arr(0, 5, 3), rng_arr(1, 3, 7, 5), rng_arr(2, 3, 7, 3)],
        P4,
        ["B", "S(1)", "S(1)"],
    ),
    "fori-cols": (_fori_buffer, [rng_arr(0, 7, 6)], P4, ["S(1)"]),
}


@pytest.mark.parametrize("name", list(_LOCAL_CASES))
def test_data_and_head_parallel_steps_need_no_collective(name):
    fn, vals, plc, lays = _LOCAL_CASES[name]
    args = [jsbp.tensor(np.asarray(v), placement=plc, sbp=s) for v, s in zip(vals, lays)]
    coll = jsbp.debug.count_collectives(jsbp.jit(fn), *args)
    assert sum(coll.values()) == 0, (name, coll)
    # reductions over the split batch stay partial (P) rather than being reduced eagerly
    out = _leaves(jsbp.jit(fn)(*args))
    ref = jax.tree_util.tree_leaves(jax.jit(fn)(*[jnp.asarray(v) for v in vals]))
    for g, r in zip(out, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-5)
