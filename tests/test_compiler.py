"""The SBP compiler: jsbp.jit parity with one device, plans that match the compiled program,
control flow, autodiff and errors."""

import functools
import zlib
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp import sbp

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
Q22 = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
R24 = jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("dp", "tp"))
RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def gt(value, plc, nd):
    return jsbp.tensor(value, plc, nd)


def assert_tree_close(out, ref, rtol=1e-5, atol=1e-5):
    outs = jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))
    refs = jax.tree_util.tree_leaves(ref)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        assert isinstance(o, jsbp.GlobalTensor)
        np.testing.assert_allclose(o.numpy(), np.asarray(r), rtol=rtol, atol=atol)


def assert_plan_matches_program(fn, *args):
    plan = jsbp.explain(fn, *args).collectives()
    compiled = jsbp.debug.count_collectives(jsbp.jit(fn), *args)
    assert plan == compiled, (plan, compiled)
    return compiled


# -- matmul signature table -------------------------------------------------------------------
MATMUL_TABLE = [
    (("S(0)", "B"), "S(0)"),
    (("B", "S(1)"), "S(1)"),
    (("S(1)", "S(0)"), "P"),
    (("P", "B"), "P"),
    (("B", "P"), "P"),
    (("B", "B"), "B"),
]


@pytest.mark.parametrize("ins,out", MATMUL_TABLE)
@pytest.mark.parametrize("shape", [(8, 12, 4), (7, 13, 5)], ids=["even", "uneven"])
def test_matmul_signature_table(ins, out, shape):
    m, k, n = shape
    xv, wv = rand(m, k), rand(k, n)
    x, w = gt(xv, P4, ins[0]), gt(wv, P4, ins[1])
    f = jsbp.jit(lambda a, b: a @ b)
    y = f(x, w)
    if ins == ("B", "B"):  # both whole: the planner may divide the work (a local slice)
        assert not any(x_.is_partial for x_ in y.sbp), y.sbp
    else:
        assert y.sbp == sbp.parse_nd(out)
    np.testing.assert_allclose(y.numpy(), xv @ wv, rtol=1e-5, atol=1e-5)
    assert sum(jsbp.debug.count_collectives(f, x, w).values()) == 0


def test_batched_matmul_splits_batch_dims_together():
    av, bv = rand(6, 5, 3), rand(6, 3, 4)
    f = jsbp.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))
    y = f(gt(av, P4, "S(0)"), gt(bv, P4, "S(0)"))
    assert y.sbp == (sbp.split(0),)
    np.testing.assert_allclose(y.numpy(), av @ bv, rtol=1e-5, atol=1e-5)


# -- OneFlow's examples ---------------------------------------------------------------------------
def test_reduce_sum_over_split_dim_is_partial():
    xv = rand(10, 6)
    y = jsbp.jit(lambda x: jnp.sum(x, axis=0))(gt(xv, P4, "S(0)"))
    assert y.sbp == (sbp.partial_sum,)
    np.testing.assert_allclose(y.numpy(), xv.sum(0), rtol=1e-5, atol=1e-5)


def test_uneven_mean_is_exact():
    # DTensor's bug: mean of arange(12).reshape(3, 4) split S(0) over 2 devices must be 5.5
    a = jsbp.tensor(
        np.arange(12, dtype=np.float32).reshape(3, 4), jsbp.placement("cpu", [0, 1]), "S(0)"
    )
    assert float(jsbp.jit(jnp.mean)(a).numpy()) == 5.5
    assert float(a.mean().numpy()) == 5.5


@pytest.mark.parametrize(
    "fn",
    [
        jnp.sum,
        jnp.max,
        jnp.min,
        jnp.mean,
        lambda x: jnp.linalg.norm(x),
        lambda x: jnp.argmax(x, axis=0),
        lambda x: jax.nn.softmax(x, axis=0),
        lambda x: jnp.var(x, axis=0),
    ],
    ids=["sum", "max", "min", "mean", "norm", "argmax", "softmax", "var"],
)
@pytest.mark.parametrize("nd,plc", [("S(0)", P4), (("S(0)", "S(0)"), Q22), (("S(0)", "S(1)"), R24)])
def test_uneven_reductions_never_see_padding(fn, nd, plc):
    xv = rand(7, 5) - 3.0  # negative values: a zero from padding would win a max
    out = jsbp.jit(fn)(gt(xv, plc, nd))
    np.testing.assert_allclose(out.numpy(), np.asarray(fn(jnp.asarray(xv))), rtol=1e-5, atol=1e-5)


def test_softmax_over_split_dim_boxes_and_keeps_other_split():
    xv = rand(8, 12)
    x = gt(xv, P4, "S(1)")
    c = assert_plan_matches_program(lambda x: jax.nn.softmax(x, axis=-1), x)
    assert sum(c.values()) >= 1
    x0 = gt(xv, P4, "S(0)")
    c0 = assert_plan_matches_program(lambda x: jax.nn.softmax(x, axis=-1), x0)
    assert sum(c0.values()) == 0
    y = jsbp.jit(lambda x: jax.nn.softmax(x, axis=-1))(x0)
    assert y.sbp == (sbp.split(0),)


def test_layer_norm_keeps_split():
    xv = rand(8, 16)

    def ln(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    x = gt(xv, P4, "S(0)")
    y = jsbp.jit(ln)(x)
    assert y.sbp == (sbp.split(0),)
    np.testing.assert_allclose(y.numpy(), np.asarray(ln(jnp.asarray(xv))), rtol=1e-4, atol=1e-5)
    assert sum(assert_plan_matches_program(ln, x).values()) == 0


def test_vocab_parallel_embedding_gives_partial():
    table, idx = rand(10, 4), np.array([0, 9, 3, 3, 7, 1])
    f = lambda t, i: jnp.take(t, i, axis=0)
    out = jsbp.jit(f)(gt(table, P4, "S(0)"), gt(idx, P4, "B"))
    assert out.sbp == (sbp.partial_sum,)
    np.testing.assert_array_equal(out.numpy(), table[idx])
    g = lambda t, i: jax.grad(lambda t: jnp.sum(jnp.take(t, i, axis=0) ** 2))(t)
    gv = jsbp.jit(g)(gt(table, P4, "S(0)"), gt(idx, P4, "B"))
    np.testing.assert_allclose(gv.numpy(), np.asarray(g(jnp.asarray(table), idx)), rtol=1e-5)


# -- models ------------------------------------------------------------------------------------------
def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


MLP_LAYOUTS = {
    "dp": (P4, {"w1": "B", "b1": "B", "w2": "B"}, "S(0)"),
    "tp": (P4, {"w1": "S(1)", "b1": "S(0)", "w2": "S(0)"}, "B"),
    "hybrid": (R24, {"w1": ("B", "S(1)"), "b1": ("B", "S(0)"), "w2": ("B", "S(0)")}, ("S(0)", "B")),
}


@pytest.mark.parametrize("name", list(MLP_LAYOUTS))
def test_mlp_loss_and_grads_match_single_device(name):
    plc, playout, dlayout = MLP_LAYOUTS[name]
    params = {"w1": rand(6, 16), "b1": rand(16), "w2": rand(16, 3)}
    xv, yv = rand(8, 6), rand(8, 3)
    ref = jax.value_and_grad(mlp_loss)(params, xv, yv)
    gparams = {k: gt(v, plc, playout[k]) for k, v in params.items()}
    args = (gparams, gt(xv, plc, dlayout), gt(yv, plc, dlayout))
    step = jax.value_and_grad(mlp_loss)
    out = jsbp.jit(step)(*args)
    assert_tree_close(out, ref)
    c = assert_plan_matches_program(step, *args)
    if name == "tp":  # column then row parallel: no communication between the pair in forward
        assert c["all-gather"] == 0


def test_tp_mlp_forward_needs_one_reduction():
    params = {"w1": rand(6, 16), "b1": rand(16), "w2": rand(16, 3)}
    plc, playout, _ = MLP_LAYOUTS["tp"]
    gparams = {k: gt(v, plc, playout[k]) for k, v in params.items()}
    fwd = lambda p, x: jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    x = gt(rand(8, 6), plc, "B")
    y = jsbp.jit(fwd, out_sbp="B")(gparams, x)
    c = jsbp.debug.count_collectives(jsbp.jit(fwd, out_sbp="B"), gparams, x)
    assert c == {
        "all-gather": 0,
        "all-reduce": 1,
        "reduce-scatter": 0,
        "all-to-all": 0,
        "collective-permute": 0,
    }
    np.testing.assert_allclose(y.numpy(), np.asarray(fwd(params, x.numpy())), rtol=1e-5, atol=1e-5)


def _transformer(**kw):
    flax = pytest.importorskip("flax")
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, d, h, rngs):
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=h, in_features=d, decode=False, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, 4 * d, rngs=rngs)
            self.down = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            t = x.shape[1]
            mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class Tiny(nnx.Module):
        def __init__(self, vocab=16, d=16, h=4, rngs=None):
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.block = Block(d, h, rngs)
            self.head = nnx.Linear(d, vocab, rngs=rngs)

        def __call__(self, tok):
            return self.head(self.block(self.embed(tok)))

    del flax
    return nnx, Tiny(rngs=nnx.Rngs(0), **kw)


def _tp_layout(path: str, ndim: int):
    """Megatron layout for the tiny transformer on a 1-d tp axis."""
    if "embed" in path:
        return "S(1)"
    if any(k in path for k in ("query", "key", "value")) and "kernel" in path:
        return "S(1)"  # (d, heads, head_dim): heads split = column parallel
    if any(k in path for k in ("query", "key", "value")) and "bias" in path:
        return "S(0)"
    if "out" in path and "kernel" in path:
        return "S(0)"  # (heads, head_dim, d): row parallel
    if "up" in path and "kernel" in path:
        return "S(1)"
    if "up" in path and "bias" in path:
        return "S(0)"
    if "down" in path and "kernel" in path:
        return "S(0)"
    return "B"


def _transformer_step_case(strategy):
    """The tiny NNX transformer's adamw train step under a named layout: (step, one-device
    arguments, global arguments). Layouts: dp, tp (Megatron), zero3 (parameters split on dim 0
    where it divides), hybrid on a (2, 2) and hybrid_2x4 on a (2, 4) grid (batch on dp, Megatron
    on tp)."""
    optax = pytest.importorskip("optax")
    nnx, model = _transformer()
    graphdef, state = nnx.split(model, nnx.Param)
    params = jax.tree_util.tree_map(np.asarray, state.to_pure_dict())
    tok = RNG.integers(0, 16, size=(4, 8)).astype(np.int32)
    # The key bias has an exactly-zero gradient (softmax is shift invariant): both runs see ~1e-9
    # rounding noise there, which adamw's g / (|g| + eps) would blow up to a full step with the
    # default eps=1e-8. eps=1e-4 keeps the comparison about jsbp, not about amplified noise.
    tx = optax.adamw(1e-2, eps=1e-4)
    opt_state = tx.init(params)

    def loss_pure(p, tok):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        logits = nnx.merge(graphdef, st)(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    def train_step(p, o, tok):
        loss, g = jax.value_and_grad(loss_pure)(p, tok)
        upd, o = tx.update(g, o, p)
        return loss, optax.apply_updates(p, upd), o

    paths = {
        kp: jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    plc, dlay, lay = {
        "dp": (P4, "S(0)", lambda path, v: "B"),
        "tp": (P4, "B", lambda path, v: _tp_layout(path, v.ndim)),
        "zero3": (P4, "S(0)", lambda path, v: "S(0)" if v.shape[0] % 4 == 0 else "B"),
        "hybrid": (Q22, ("S(0)", "B"), lambda path, v: ("B", _tp_layout(path, v.ndim))),
        "hybrid_2x4": (R24, ("S(0)", "B"), lambda path, v: ("B", _tp_layout(path, v.ndim))),
    }[strategy]
    gp = jax.tree_util.tree_map_with_path(lambda kp, v: gt(v, plc, lay(paths[kp], v)), params)
    gopt = jax.tree_util.tree_map(lambda v: gt(np.asarray(v), plc, ("B",) * plc.ndim), opt_state)
    return train_step, (params, opt_state, tok), (gp, gopt, gt(tok, plc, dlay))


@pytest.mark.parametrize("strategy", ["dp", "tp", "hybrid", "hybrid_2x4"])
def test_nnx_transformer_train_step_matches_single_device(strategy):
    train_step, plain, args = _transformer_step_case(strategy)
    ref_loss, ref_p, _ = train_step(*plain)
    loss, new_p, _ = jsbp.jit(train_step)(*args)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    assert_tree_close(new_p, ref_p, rtol=1e-4, atol=1e-5)
    assert_plan_matches_program(train_step, *args)


# -- control flow ---------------------------------------------------------------------------------------
CONTROL = {
    "scan": (
        lambda x, w: jax.lax.scan(lambda c, xi: (jnp.tanh(c @ w + xi), c.sum()), jnp.zeros(6), x),
        ("B", "S(1)"),
    ),
    "scan_xs_split": (
        lambda x, w: jax.lax.scan(
            lambda c, xi: (c + xi @ w, None), jnp.zeros((5, 6)), x.reshape(2, 5, 6)
        )[0],
        ("S(1)", "B"),
    ),
    "fori": (lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x), ("S(0)", "B")),
    "while": (
        lambda x, w: jax.lax.while_loop(
            lambda c: c[1] < 3, lambda c: (c[0] * 0.5 + x, c[1] + 1), (x, 0)
        )[0],
        ("S(0)", "B"),
    ),
    "cond": (lambda x, w: jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: x * 2.0), ("S(0)", "B")),
    "switch": (
        lambda x, w: jax.lax.switch(
            jnp.argmax(x.sum(1)) % 3, [lambda: x, lambda: x @ w, lambda: -x]
        ),
        ("S(0)", "B"),
    ),
    "remat": (
        lambda x, w: jax.grad(lambda w: jax.checkpoint(lambda w: jnp.sum(jnp.sin(x @ w)))(w))(w),
        ("S(0)", "B"),
    ),
    "custom_jvp": (lambda x, w: jax.nn.relu(x @ w) + jax.nn.gelu(x), ("S(0)", "B")),
    "custom_vjp": (
        lambda x, w: jax.grad(lambda x: jnp.sum(jax.nn.logsumexp(x, axis=1)))(x),
        ("S(0)", "B"),
    ),
    "nested_jit": (lambda x, w: jax.jit(lambda a: a @ w)(x) + 1.0, ("S(0)", "B")),
}


def test_scan_operand_counts_read_both_parameter_styles():
    """A scan's constants / carry counts: this JAX's own equation, and the flat-tree parameters
    (``ft_in`` = (constants, carry, xs)) that replace ``num_consts`` / ``num_carry`` in JAX 0.11."""
    from jsbp._program import scan_counts

    w, c0, xs = jnp.ones(3), jnp.zeros(3), jnp.ones((5, 3))

    def f(w, c0, xs):
        return jax.lax.scan(lambda c, x: (c + w * x, c.sum()), c0, xs)

    (eqn,) = [e for e in jax.make_jaxpr(f)(w, c0, xs).jaxpr.eqns if e.primitive.name == "scan"]
    assert scan_counts(eqn.params) == (1, 1)

    class FlatTree:  # the part of jax._src.flattree.FlatTree that scan_counts reads
        def __init__(self, *groups):
            self.groups = groups

        def unpack(self):
            return self.groups

    assert scan_counts({"ft_in": FlatTree([0, 1], [2, 3, 4], [5])}) == (2, 3)


@pytest.mark.parametrize("name", list(CONTROL))
def test_control_flow_and_calls(name):
    fn, lays = CONTROL[name]
    xv, wv = rand(10, 6), rand(6, 6)
    args = (gt(xv, P4, lays[0]), gt(wv, P4, lays[1]))
    assert_tree_close(jsbp.jit(fn)(*args), fn(xv, wv), rtol=1e-4, atol=1e-5)
    assert_plan_matches_program(fn, *args)


# -- annotations, out_sbp, static args, autodiff of jsbp.jit ---------------------------------------------
def test_to_global_inside_jit_is_honoured():
    xv = rand(8, 8)
    f = lambda x: jsbp.to_global(x * 2.0, sbp="S(1)") + 1.0
    y = jsbp.jit(f)(gt(xv, P4, "S(0)"))
    assert y.sbp == (sbp.split(1),)
    np.testing.assert_allclose(y.numpy(), xv * 2 + 1)
    c = jsbp.debug.count_collectives(jsbp.jit(f), gt(xv, P4, "S(0)"))
    assert c["all-to-all"] == 1 and sum(c.values()) == 1


def test_grad_sbp_inside_jit_sets_backward_layout():
    # Megatron "f": identity forward on B, all-reduce of the gradient in backward
    xv, wv = rand(8, 6), rand(6, 4)

    def loss(x, w):
        xb = jsbp.to_global(x, sbp="B", grad_sbp="B")
        return jnp.sum(jnp.tanh(xb @ w))

    g = jsbp.jit(jax.grad(loss))(gt(xv, P4, "B"), gt(wv, P4, "S(1)"))
    np.testing.assert_allclose(g.numpy(), np.asarray(jax.grad(loss)(xv, wv)), rtol=1e-5, atol=1e-5)
    assert g.sbp == (sbp.broadcast,)


def test_out_sbp_forces_layout():
    xv = rand(8, 6)
    y = jsbp.jit(lambda x: x.sum(0), out_sbp="B")(gt(xv, P4, "S(0)"))
    assert y.sbp == (sbp.broadcast,)
    np.testing.assert_allclose(y.numpy(), xv.sum(0), rtol=1e-5, atol=1e-6)
    a, b = jsbp.jit(lambda x: (x, x.sum(0)), out_sbp=["S(1)", None])(gt(xv, P4, "S(0)"))
    assert a.sbp == (sbp.split(1),) and b.sbp == (sbp.partial_sum,)


def test_out_sbp_follows_nested_outputs():
    """A tuple in ``out_sbp`` is an nd-sbp where it parses as one, else a container of them; a
    function of the output structure works too."""
    xv = rand(4, 6)
    x = gt(xv, Q22, ("S(0)", "B"))
    (a, b), c = jsbp.jit(
        lambda x: ((x, x * 2), x + 1), out_sbp=((("B", "B"), ("S(1)", "S(0)")), ("S(0)", "S(1)"))
    )(x)
    assert (a.sbp, b.sbp, c.sbp) == (
        (sbp.broadcast,) * 2,
        (sbp.split(1), sbp.split(0)),
        (sbp.split(0), sbp.split(1)),
    )
    np.testing.assert_allclose(b.numpy(), xv * 2)
    a, b = jsbp.jit(
        lambda x: (x, x * 2), out_sbp=lambda tree: [None] * (tree.num_leaves - 1) + [("B", "B")]
    )(x)
    assert a.sbp == (sbp.split(0), sbp.broadcast) and b.sbp == (sbp.broadcast, sbp.broadcast)


def test_static_argnums_and_plain_inputs():
    xv = rand(8, 6)
    f = jsbp.jit(lambda x, n, c: x * n + c, static_argnums=1)
    y = f(gt(xv, P4, "S(0)"), 3, np.float32(2.0))
    np.testing.assert_allclose(y.numpy(), xv * 3 + 2, rtol=1e-6, atol=1e-6)
    assert y.sbp == (sbp.split(0),)


def test_jax_grad_of_a_jsbp_jit_function():
    xv, wv = rand(8, 6), rand(6, 4)
    inner = jsbp.jit(lambda x, w: jnp.sum(jnp.sin(x @ w)))
    for lx, lw in [("S(0)", "B"), ("B", "S(1)"), ("S(1)", "S(0)"), ("P", "B")]:
        x, w = gt(xv, P4, lx), gt(wv, P4, lw)
        gx, gw = jax.grad(lambda x, w: inner(x, w).to_jax(), argnums=(0, 1))(x, w)
        rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(xv, wv)
        assert gx.sbp == x.sbp and gw.sbp == w.sbp
        np.testing.assert_allclose(gx.numpy(), rx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gw.numpy(), rw, rtol=1e-5, atol=1e-5)


def test_traced_once_per_signature():
    calls = []

    def f(x):
        calls.append(1)
        return x + 1

    jf = jsbp.jit(f)
    for _ in range(3):
        jf(gt(rand(8, 4), P4, "S(0)"))
    jf(gt(rand(8, 4), P4, "B"))
    assert len(calls) == 2


def test_repeat_calls_tell_signatures_apart():
    """Repeat calls skip the per-leaf work (a dispatch cache keyed by the argument structure, in
    which each global tensor's layout sits); every difference that changes the program still
    retraces and gives the right answer: layout, logical shape, dtype, plain-argument shape and
    type, static argument."""
    calls = []

    def g(x, c, n):
        return x * n + c

    def f(x, c, n):
        calls.append(1)
        return g(x, c, n)

    jf = jsbp.jit(f, static_argnums=2)
    xv, x7 = rand(8, 4), rand(7, 4)
    cases = [
        (gt(xv, P4, "S(0)"), np.float32(2.0), 3),
        (gt(xv, P4, "S(0)"), np.float32(2.0), 3),  # hit
        (gt(xv, P4, "S(1)"), np.float32(2.0), 3),  # layout
        (gt(x7, P4, "S(0)"), np.float32(2.0), 3),  # logical shape (same padded block)
        (gt(xv.astype(jnp.bfloat16), P4, "S(0)"), np.float32(2.0), 3),  # dtype
        (gt(xv, P4, "S(0)"), np.arange(4, dtype=np.float32), 3),  # plain argument's shape
        (gt(xv, P4, "S(0)"), 2, 3),  # Python scalar
        (gt(xv, P4, "S(0)"), 2, 5),  # static argument
        (gt(xv, P4, "S(0)"), np.arange(4, dtype=np.float32), 3),  # hit
    ]
    for x, c, n in cases:
        y, ref = jf(x, c, n), g(jnp.asarray(x.numpy()), c, n)
        # bf16: XLA may keep x * n in f32 inside the fused program; eager JAX rounds it first
        tol = dict(rtol=1e-2, atol=1e-2) if x.dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        assert (y.shape, y.dtype, y.sbp) == (ref.shape, ref.dtype, x.sbp)
        np.testing.assert_allclose(
            np.asarray(y.numpy(), np.float32), np.asarray(ref, np.float32), **tol
        )
    assert len(calls) == len(cases) - 2


def test_calls_with_global_tensors_only_dispatch_through_jax_jit(monkeypatch):
    """A call whose arguments are all global tensors runs through one ``jax.jit`` over the
    arguments' pytree (JAX's C++ dispatch: no per-leaf Python of jsbp's on a repeat call); a new
    layout, shape or dtype still retraces, a plain argument moves the function to the Python
    path, and ``jax.grad`` of a call still runs jsbp's planned backward program. Values against
    NumPy throughout."""
    from jsbp._jit import JitFunction

    lookups = []
    orig = JitFunction._lookup
    monkeypatch.setattr(
        JitFunction, "_lookup", lambda self, args: lookups.append(1) or orig(self, args)
    )

    def f(x, w):
        return jnp.tanh(x @ w)

    jf = jsbp.jit(f)
    xv, wv, x7 = rand(8, 4), rand(4, 6), rand(7, 4)
    cases = [
        (gt(xv, P4, "S(0)"), gt(wv, P4, "B"), 1),  # traced
        (gt(xv, P4, "S(0)"), gt(wv, P4, "B"), 0),  # jax.jit's cache
        (gt(xv, P4, "B"), gt(wv, P4, "S(1)"), 1),  # layouts
        (gt(x7, P4, "S(0)"), gt(wv, P4, "B"), 1),  # logical shape (uneven, same padded block)
        (gt(xv.astype(jnp.bfloat16), P4, "S(0)"), gt(wv.astype(jnp.bfloat16), P4, "B"), 1),  # dtype
        (gt(xv, P4, "S(1)"), gt(wv, P4, "S(0)"), 1),  # a partial-sum contraction
        (gt(xv, P4, "S(1)"), gt(wv, P4, "S(0)"), 0),
    ]
    for x, w, traced in cases:
        before = len(lookups)
        y = jf(x, w)
        assert len(lookups) - before == traced
        tol = 2e-2 if x.dtype == jnp.bfloat16 else 1e-5
        ref = np.tanh(np.asarray(x.numpy(), np.float32) @ np.asarray(w.numpy(), np.float32))
        np.testing.assert_allclose(np.asarray(y.numpy(), np.float32), ref, rtol=tol, atol=tol)
        assert y.dtype == x.dtype

    # gradients through the call: jsbp's backward program, values against NumPy
    x, w = gt(xv, P4, "S(0)"), gt(wv, P4, "B")
    loss = jsbp.jit(lambda x, w: jnp.sum(jnp.tanh(x @ w)))
    loss(x, w)
    gw = jax.grad(lambda w: loss(x, w).to_jax())(w)
    ref = xv.T @ (1 - np.tanh(xv @ wv) ** 2)
    assert gw.sbp == w.sbp
    np.testing.assert_allclose(gw.numpy(), ref, rtol=1e-5, atol=1e-5)

    # a plain argument: the Python path from then on, same values
    y = jf(x, jnp.asarray(wv))
    np.testing.assert_allclose(y.numpy(), np.tanh(xv @ wv), rtol=1e-5, atol=1e-5)
    before = len(lookups)
    jf(x, w)
    assert len(lookups) - before == 1


# -- eager ops -----------------------------------------------------------------------------------------------
def test_eager_operators_and_methods():
    xv, yv = rand(8, 6), rand(8, 6)
    x, y = gt(xv, P4, "S(0)"), gt(yv, P4, "S(0)")
    np.testing.assert_allclose((x + y).numpy(), xv + yv)
    np.testing.assert_allclose((x * 2 - y / 3).numpy(), xv * 2 - yv / 3, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose((-x).numpy(), -xv)
    np.testing.assert_array_equal((x > y).numpy(), xv > yv)
    np.testing.assert_allclose((x @ y.T).numpy(), xv @ yv.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x[1:3].numpy(), xv[1:3])
    np.testing.assert_allclose(x[:, 2].numpy(), xv[:, 2])
    np.testing.assert_allclose(x.sum(0).numpy(), xv.sum(0), rtol=1e-5, atol=1e-6)
    assert x.sum(0).sbp == (sbp.partial_sum,)
    np.testing.assert_allclose(x.mean().numpy(), xv.mean(), rtol=1e-5, atol=1e-7)  # a sum near 0
    np.testing.assert_allclose(x.max(1).numpy(), xv.max(1))
    np.testing.assert_allclose(x.reshape(4, 12).numpy(), xv.reshape(4, 12))
    np.testing.assert_allclose(x.transpose(1, 0).numpy(), xv.T)
    assert x.astype(jnp.int32).dtype == jnp.int32
    np.testing.assert_allclose(jsbp.numpy.exp(x).numpy(), np.exp(xv), rtol=1e-6)
    np.testing.assert_allclose(jsbp.numpy.where(x > 0, x, y).numpy(), np.where(xv > 0, xv, yv))
    assert (x + y).sbp == (sbp.split(0),)


def test_two_placements_in_one_op_is_an_error_naming_both():
    x = gt(rand(8, 4), P4, "S(0)")
    z = gt(rand(8, 4), jsbp.placement("cpu", [4, 5, 6, 7]), "S(0)")
    with pytest.raises(
        jsbp.PlacementError, match=r"two placements.*\[0, 1, 2, 3\].*\[4, 5, 6, 7\]"
    ):
        _ = x + z


def _no_rule_primitive(name):
    """A primitive jsbp has no rule for: ``x[::-1] * 2`` along dim 0 (not elementwise, so a
    fallback that kept the split would be wrong)."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive(name)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    impl = lambda x: jnp.flip(x, 0) * 2
    prim.def_impl(impl)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    return prim


def test_missing_rule_runs_replicated_with_a_warning():
    weird = _no_rule_primitive("jsbp_test_weird")
    xv = rand(7, 4)
    x = gt(xv, P4, "S(0)")
    f = lambda x: weird.bind(x * 3.0) + 1.0
    with pytest.warns(
        jsbp.NoRuleWarning, match=r"jsbp_test_weird.*\(7, 4\).*replicated.*strict=True"
    ):
        y = jsbp.jit(f)(x)
    np.testing.assert_allclose(y.numpy(), np.flip(xv * 3.0, 0) * 2 + 1.0, rtol=1e-6)
    plan = jsbp.explain(f, x)
    (row,) = [r for r in plan.rows if r.primitive == "jsbp_test_weird"]
    assert row.note == "no rule: replicated" and "[no rule: replicated]" in str(plan)
    assert row.signature == "(B) -> (B)" and [b.collectives for b in row.boxings] == [
        ("all-gather",)
    ]
    assert "no rule: replicated" in plan._repr_html_()
    assert plan.collectives() == jsbp.debug.count_collectives(jsbp.jit(f), x)


def test_missing_rule_raises_in_strict_mode(monkeypatch):
    weird = _no_rule_primitive("jsbp_test_weird_strict")
    x = gt(rand(4, 4), P4, "S(0)")
    with pytest.raises(jsbp.SbpError, match=r"jsbp_test_weird_strict.*\(4, 4\).*register_sbp_rule"):
        jsbp.jit(lambda x: weird.bind(x), strict=True)(x)
    monkeypatch.setenv("JSBP_STRICT", "1")
    with pytest.raises(jsbp.SbpError, match="strict mode"):
        jsbp.jit(lambda x: weird.bind(x) + 1.0)(x)
    with pytest.warns(jsbp.NoRuleWarning):  # an explicit strict=False wins over the variable
        jsbp.jit(lambda x: weird.bind(x) - 1.0, strict=False)(x)


def test_jit_needs_a_global_tensor():
    with pytest.raises(jsbp.SbpError, match="at least one GlobalTensor"):
        jsbp.jit(lambda x: x + 1)(np.ones(3))


def test_scan_accumulator_stays_partial_inside_the_loop():
    # gradient accumulation: a P accumulator must not be all-reduced every iteration
    plc = jsbp.placement.all("cpu")
    xv, wv = rand(4, 16, 3), rand(3, 3)
    f = lambda x, w: jax.lax.scan(lambda a, xb: (a + (xb @ w).sum(0), None), jnp.zeros(3), x)[0]
    x, w = gt(xv, plc, "S(1)"), gt(wv, plc, "B")
    y = jsbp.jit(f)(x, w)
    assert y.sbp == (sbp.partial_sum,)
    np.testing.assert_allclose(y.numpy(), np.asarray(f(xv, wv)), rtol=1e-5, atol=1e-5)
    assert sum(assert_plan_matches_program(f, x, w).values()) == 0


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_loop_carry_layout_is_chosen_by_cost(rows):
    """A carry pinned inside the body (a layer's activation, as ``jsbp.flax.constrain`` pins it)
    that a row-parallel matmul would make partial: the carry's layout is chosen with the rest of
    the program, so the small weight is gathered once before the loop and the body runs no
    collective (reducing the carry would cost an all-reduce every iteration)."""

    def f(x, w):
        def body(c, _):
            c = jsbp.to_global(c, sbp=(sbp.split(0), sbp.broadcast))
            return c @ w, None

        return jax.lax.scan(body, x, None, length=4)[0]

    xv, wv = rand(rows, 16), rand(16, 16) / 4
    x, w = gt(xv, R24, "S(0), B"), gt(wv, R24, "B, S(0)")  # w row-parallel over tp
    fn = jsbp.jit(f, out_sbp=(sbp.split(0), sbp.broadcast))
    y = fn(x, w)
    np.testing.assert_allclose(y.numpy(), np.asarray(f(xv, wv)), rtol=1e-5, atol=1e-5)
    assert y.sbp == (sbp.split(0), sbp.broadcast)
    counts = jsbp.debug.count_collectives(fn, x, w)
    assert counts["all-gather"] == 1 and sum(counts.values()) == 1, counts
    plan = jsbp.explain(fn, x, w)
    assert plan.collectives() == counts
    assert all(not b.collectives for r in plan.rows if r.depth > 0 for b in r.boxings), str(plan)


def _converted_inputs(prog, inputs) -> set:
    """The program inputs (of ``inputs``) that some equation's boxing converts, nested calls
    included (an inlined call's operands are resolved to the caller's values)."""
    from jax.extend.core import Literal

    from jsbp._program import Program

    found, alias = set(), {}

    def key(v):
        while v in alias:
            v = alias[v]
        return v

    def walk(p):
        for st in p.steps:
            for bx in st.boxings:
                v = st.eqn.invars[bx.operand]
                if not bx.reused and not isinstance(v, Literal) and key(v) in inputs:
                    found.add(key(v))
            if st.kind == "call":
                for sub_v, outer in zip(st.sub.jaxpr.invars, st.eqn.invars):
                    if not isinstance(outer, Literal):
                        alias[sub_v] = key(outer)
            subs = st.sub if isinstance(st.sub, (list, tuple)) else [st.sub]
            for s in subs:
                if isinstance(s, Program):
                    walk(s)

    walk(prog)
    return found


@pytest.mark.parametrize("shape", [(8, 12, 5), (7, 13, 5)], ids=["even", "uneven"])
def test_weight_gradient_is_reduced_before_its_transpose(shape):
    """Data parallel: the weight gradient is dot_general (P) then transpose. It is reduced before the
    transpose (dot -> all-reduce -> transpose, as GSPMD emits), not after it: XLA cannot fold the
    transpose into a matmul whose result feeds a collective and copies both operands instead."""
    m, k, n = shape
    xv, wv = rand(m, k), rand(k, n)

    def step(x, w):
        g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
        g = jsbp.to_global(g, sbp="B")  # as jsbp.flax pins data-parallel gradients
        return w - 0.1 * g

    x, w = gt(xv, P4, "S(0)"), gt(wv, P4, "B")
    f = jsbp.jit(step, out_sbp="B")  # parameters stay replicated
    out = f(x, w)
    np.testing.assert_allclose(out.numpy(), np.asarray(step(xv, wv)), rtol=1e-5, atol=1e-6)
    counts = jsbp.debug.count_collectives(f, x, w)
    plan = jsbp.explain(f, x, w)
    assert plan.collectives() == counts and sum(counts.values()) == 1, str(plan)
    if counts["all-reduce"]:  # (uneven, gathering the small activation gradient can be cheaper)
        reduced_at = [r.primitive for r in plan.rows for b in r.boxings if b.collectives]
        assert reduced_at == ["transpose"], str(plan)
    else:
        assert shape == (7, 13, 5) and counts["all-gather"] == 1, str(plan)


@pytest.mark.parametrize("m", [8, 7], ids=["even", "uneven"])
def test_a_value_gathered_once_is_sliced_not_converted_again(m):
    """``x`` (S(0)) is all-gathered by an annotation; a later matmul reads it too (its weight is
    row-split). It reads the gathered copy (or a local slice of it): no second conversion."""
    xv, wv = rand(m, 16), rand(16, 64)

    def f(x, w):
        xb = jsbp.to_global(x, sbp="B")
        return xb * 2.0, x @ w

    x, w = gt(xv, P4, "S(0)"), gt(wv, P4, "S(0)")
    fn = jsbp.jit(f)
    xb, y = fn(x, w)
    np.testing.assert_allclose(xb.numpy(), 2.0 * xv, rtol=1e-6)
    np.testing.assert_allclose(y.numpy(), xv @ wv, rtol=1e-5, atol=1e-5)
    counts = jsbp.debug.count_collectives(fn, x, w)
    assert counts == {**dict.fromkeys(counts, 0), "all-gather": 1}
    plan = jsbp.explain(fn, x, w)
    assert plan.collectives() == counts
    dot = next(r for r in plan.rows if r.primitive == "dot_general")
    assert all(not b.collectives for b in dot.boxings), str(plan)


_TANH_S1 = jax.jit(lambda x: jsbp.to_global(jnp.tanh(x), sbp="S(1)"))


@pytest.mark.parametrize("nested", [False, True], ids=["inline", "jitted-helper"])
def test_a_value_computed_twice_is_converted_once(nested):
    """The same value computed twice (the same ops on the same operands; inline, or two calls of
    one jitted helper) and converted twice to one layout: XLA would merge the copies and their
    collectives after planning, so jsbp merges them before (``_cse``), and ``explain`` lists the
    one all-to-all the compiled program runs."""

    def s1(x):
        return _TANH_S1(x) if nested else jsbp.to_global(jnp.tanh(x), sbp="S(1)")

    def f(x):
        a = jsbp.to_global(s1(x), sbp="S(0)")
        b = jsbp.to_global(s1(x), sbp="S(0)")
        return a * 2.0 + b * jnp.float32(1) + (b * 1) * True

    xv = rand(8, 16)
    x = gt(xv, P4, "S(1)")
    fn = jsbp.jit(f)
    np.testing.assert_allclose(fn(x).numpy(), 4.0 * np.tanh(xv), rtol=1e-5, atol=1e-6)
    counts = jsbp.debug.count_collectives(fn, x)
    assert counts == {**dict.fromkeys(counts, 0), "all-to-all": 1}
    assert jsbp.explain(fn, x).collectives() == counts


def test_cse_keeps_what_differs():
    """Equations that differ in a literal's value or dtype, a parameter, or an operand stay
    apart; effects are never merged."""
    from jax.extend import core as jcore

    from jsbp._cse import cse

    def f(x):
        jax.debug.callback(lambda: None)
        jax.debug.callback(lambda: None)
        return (x * 2.0, x * 2.0, x * 3.0, x.sum(0), x.sum(1), x.astype(jnp.int32), jnp.sin(x))

    closed = jax.make_jaxpr(f)(np.ones((3, 4), np.float32))
    out = cse(closed.jaxpr)
    prims = [e.primitive.name for e in out.eqns]
    assert prims.count("mul") == 2 and prims.count("reduce_sum") == 2, prims
    assert prims.count("debug_callback") == 2, prims
    assert out.outvars[0] is out.outvars[1] and out.outvars[0] is not out.outvars[2]
    got = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(out, closed.consts))(np.arange(12.0).reshape(3, 4))
    want = f(np.arange(12.0, dtype=np.float32).reshape(3, 4))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_cse_tells_float64_literals_apart_beyond_their_repr():
    """Two float64 literals that print alike (``repr`` rounds to 8 digits: both ``0.1``) are two
    values: jsbp.jit computes each, as ``jax.jit`` does."""

    def f(x):
        return x * np.float64(0.1), x * np.float64(0.100000000001)

    with jax.enable_x64(True):
        xv = np.arange(8.0)
        got = jsbp.jit(f)(gt(xv, P4, "S(0)"))
        want = jax.jit(f)(xv)
        assert got[1].dtype == np.float64
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.numpy(), np.asarray(w))
        assert not np.array_equal(got[0].numpy(), got[1].numpy())


def test_a_conversion_two_consumers_need_is_chosen_by_the_first():
    """``x`` (S(1)) feeds an elementwise op and then a matmul that needs it replicated. Alone, the
    elementwise op would run on the split; knowing the matmul gathers ``x`` anyway, inference runs
    both on one gathered copy (one all-gather, nothing else)."""
    xv, wv = rand(8, 32), rand(32, 32)

    def f(x, w):
        a = jnp.exp(x).sum(axis=1, keepdims=True)  # would stay split on its own: P -> all-reduce
        return (x @ w) * a

    x, w = gt(xv, P4, "S(1)"), gt(wv, P4, "S(1)")
    fn = jsbp.jit(f, out_sbp="S(1)")
    out = fn(x, w)
    np.testing.assert_allclose(out.numpy(), np.asarray(f(xv, wv)), rtol=1e-5, atol=1e-4)
    counts = jsbp.debug.count_collectives(fn, x, w)
    assert counts == {**dict.fromkeys(counts, 0), "all-gather": 1}, str(jsbp.explain(fn, x, w))
    assert jsbp.explain(fn, x, w).collectives() == counts


_COMBINE_CASES = [  # (shape, split dim, dtype): two dtypes -> two combined collectives
    ((8, 16), 0, np.float32),
    ((16, 8, 4), 1, np.float32),
    ((24,), 0, np.float32),
    ((8, 8), 1, jnp.bfloat16),
    ((8, 4), 0, jnp.bfloat16),
    ((7, 4), 0, np.float32),  # uneven: runs on its own
]


def _addends(shape, plc, dtype):
    """A P global tensor with a different random addend on every device, and its value."""
    locs = [RNG.standard_normal(shape).astype(dtype) for _ in range(plc.size)]
    return jsbp.from_local(locs, placement=plc, sbp=("P",) * plc.ndim), sum(
        np.asarray(x, np.float64) for x in locs
    )


def _assert_results(outs, refs, scale=1.0):
    """Each combined-collective result against its NumPy value (bf16 to its precision)."""
    for o, ref, (_, _, dt) in zip(outs, refs, _COMBINE_CASES):
        tol = 2e-2 * scale if dt == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(
            np.asarray(o.numpy(), np.float64), scale * ref, rtol=tol, atol=tol
        )


@pytest.mark.parametrize("plc", [P4, R24], ids=["4", "2x4"])
def test_small_reduce_scatters_and_all_gathers_run_combined(plc):
    """Many small reduce-scatters (ZeRO gradients) run as one collective per dtype, and so do the
    all-gathers back; results equal the separate collectives' and the compiled program has
    exactly the collectives the plan counts."""

    def nd(d):
        return (f"S({d})",) * plc.ndim

    xs, refs = zip(*[_addends(shape, plc, dt) for shape, _, dt in _COMBINE_CASES])
    scatter = jsbp.jit(
        lambda *a: [jsbp.to_global(x, sbp=nd(d)) for x, (_, d, _) in zip(a, _COMBINE_CASES)]
    )
    gather = jsbp.jit(lambda *a: [jsbp.to_global(x, sbp=("B",) * plc.ndim) for x in a])
    for f, args in [(scatter, xs), (gather, scatter(*xs))]:
        _assert_results(f(*args), refs)
        plan, counts = jsbp.explain(f, *args), jsbp.debug.count_collectives(f, *args)
        kind = "reduce-scatter" if f is scatter else "all-gather"
        assert [b.collectives for b in plan.boxings()] == [(kind,)] * len(_COMBINE_CASES), str(plan)
        assert [b.combined is not None for b in plan.boxings()] == [True] * 5 + [False]
        assert counts == plan.collectives() == {**dict.fromkeys(counts, 0), kind: 3}


@pytest.mark.parametrize("plc", [P4, R24], ids=["4", "2x4"])
def test_small_all_reduces_run_combined(plc):
    """Many small P -> B all-reduces (data-parallel gradients) run as one collective per dtype,
    the uneven shape included (an all-reduce splits nothing); XLA:CPU does not combine them."""
    xs, refs = zip(*[_addends(shape, plc, dt) for shape, _, dt in _COMBINE_CASES])
    reduce = jsbp.jit(lambda *a: [jsbp.to_global(x, sbp=("B",) * plc.ndim) for x in a])
    _assert_results(reduce(*xs), refs)
    plan, counts = jsbp.explain(reduce, *xs), jsbp.debug.count_collectives(reduce, *xs)
    assert [b.collectives for b in plan.boxings()] == [("all-reduce",)] * len(_COMBINE_CASES), str(
        plan
    )
    assert all(b.combined is not None for b in plan.boxings())
    assert counts == plan.collectives() == {**dict.fromkeys(counts, 0), "all-reduce": 2}


@pytest.mark.parametrize("plc", [P4, R24], ids=["4", "2x4"])
def test_output_conversions_run_combined(plc):
    """The outputs' conversions to ``out_sbp`` run after everything else: the conversions of many
    split results (ZeRO-1/2's updated parameters) are one collective per dtype (all-gathers, or
    all-reduces of zero-filled addends, which also take the unevenly split one in)."""
    xs, refs = zip(*[_addends(shape, plc, dt) for shape, _, dt in _COMBINE_CASES])
    scattered = jsbp.jit(
        lambda *a: [
            jsbp.to_global(x, sbp=(f"S({d})",) * plc.ndim)
            for x, (_, d, _) in zip(a, _COMBINE_CASES)
        ]
    )(*xs)
    f = jsbp.jit(lambda *a: [x * 2 for x in a], out_sbp=("B",) * plc.ndim)
    _assert_results(f(*scattered), refs, scale=2.0)
    plan, counts = jsbp.explain(f, *scattered), jsbp.debug.count_collectives(f, *scattered)
    kinds = {b.collectives for b in plan.output_boxings}
    assert len(plan.output_boxings) == len(_COMBINE_CASES) and len(kinds) == 1, str(plan)
    assert counts == plan.collectives(), str(plan)
    if kinds == {("all-gather",)}:  # the uneven one runs on its own
        assert [b.combined is not None for b in plan.output_boxings] == [True] * 5 + [False]
        assert sum(counts.values()) == counts["all-gather"] == 3
    else:
        assert kinds == {("all-reduce",)}, str(plan)
        assert all(b.combined is not None for b in plan.output_boxings)
        assert sum(counts.values()) == counts["all-reduce"] == 2


def test_partial_extrema_are_not_combined():
    """A partial max travels as order keys (NaN kept), so it is not folded into a sum."""
    xs = [RNG.standard_normal((8, 4)).astype(np.float32) for _ in range(4)]
    ys = [RNG.standard_normal((8, 4)).astype(np.float32) for _ in range(4)]
    a = jsbp.from_local(xs, placement=P4, sbp="Pmax")
    b = jsbp.from_local(ys, placement=P4, sbp="Pmax")
    f = jsbp.jit(lambda a, b: (jsbp.to_global(a, sbp="B"), jsbp.to_global(b, sbp="B")))
    got_a, got_b = f(a, b)
    np.testing.assert_array_equal(got_a.numpy(), np.max(xs, axis=0))
    np.testing.assert_array_equal(got_b.numpy(), np.max(ys, axis=0))
    assert not [bx for bx in jsbp.explain(f, a, b).boxings() if bx.combined is not None]


def test_a_conversion_made_from_a_combined_result_runs_after_it():
    """A combined collective never waits for a value made from its own result: the second partial
    sum below is computed from the first reduce-scatter's result, so the two run apart; the third,
    independent of both, joins the group still open (the second's), where it stands in the program."""
    (a, ra), (b, rb) = _addends((8, 4), P4, np.float32), _addends((8, 4), P4, np.float32)

    def f(a, b):
        a = jsbp.to_global(a, sbp="S(0)")
        s = jsbp.to_global(jnp.tanh(a).sum(0), sbp="S(0)")  # from a's result: after it
        return a, s, jsbp.to_global(b, sbp="S(0)")  # independent of both: joins s's

    got = jsbp.jit(f)(a, b)
    for o, ref in zip(got, [ra, np.tanh(ra).sum(0), rb]):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(f, a, b)
    assert [b.combined for b in plan.boxings()] == [None, 0, 0], str(plan)
    counts = jsbp.debug.count_collectives(jsbp.jit(f), a, b)
    assert counts == plan.collectives() == {**dict.fromkeys(counts, 0), "reduce-scatter": 2}, str(
        plan
    )


def test_reading_one_combined_collective_leaves_the_others_open():
    """A value needed at once closes only the groups it waits for. Between the gradient
    all-reduces of a Megatron x data step sit activation conversions whose results are needed
    right away (here: converted again); each such read used to close every open group, so the
    gradients' all-reduce was cut into pieces (the zoo's decoder LM under dp2 x tp4: 28
    all-reduces, then 21). Three gradient-like all-reduces interleaved with two reduce-scatters
    whose results are all-gathered: one all-reduce, two reduce-scatters (each needed before the
    next is made), one all-gather; values as NumPy's."""
    (g1, r1), (g2, r2), (g3, r3) = (_addends(s, P4, np.float32) for s in [(8, 4), (4,), (8, 8)])
    (h1, q1), (h2, q2) = _addends((8, 4), P4, np.float32), _addends((8, 4), P4, np.float32)

    def whole(h):
        return jsbp.to_global(jnp.tanh(jsbp.to_global(h, sbp="S(0)")), sbp="B")

    def f(g1, g2, g3, h1, h2):
        x1 = jsbp.to_global(g1, sbp="B")
        y1 = whole(h1)
        x2 = jsbp.to_global(g2, sbp="B")
        y2 = whole(h2)
        x3 = jsbp.to_global(g3, sbp="B")
        return x1, x2, x3, y1, y2

    args = (g1, g2, g3, h1, h2)
    got = jsbp.jit(f)(*args)
    for o, ref in zip(got, [r1, r2, r3, np.tanh(q1), np.tanh(q2)]):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(f, *args)
    counts = jsbp.debug.count_collectives(jsbp.jit(f), *args)
    want = {**dict.fromkeys(counts, 0), "all-reduce": 1, "reduce-scatter": 2, "all-gather": 1}
    assert counts == plan.collectives() == want, str(plan)


def test_a_call_waits_with_a_combined_collective_and_a_loop_does_not():
    """A ``jax.jit`` call that converts nothing reads a combined collective's result without
    needing it yet (the embedding gradient's scatter-add is such a call); a loop needs its operand
    at once, so the group runs there and a conversion after it starts another."""
    (g1, r1), (g2, r2), (g3, r3) = (_addends((8, 8), P4, np.float32) for _ in range(3))

    @jax.jit
    def local(x):
        return jnp.cos(x) * 2.0

    def f(g1, g2, g3):
        a = local(jsbp.to_global(g1, sbp="B"))  # the call waits
        b = jsbp.to_global(g2, sbp="B")  # joins g1's group
        c = jax.lax.fori_loop(0, 2, lambda i, v: v * 0.5 + 1.0, b)  # needs b: the group runs
        d = jsbp.to_global(g3, sbp="B")  # after that: alone
        return a, c, d

    args = (g1, g2, g3)
    got = jsbp.jit(f)(*args)
    for o, ref in zip(got, [np.cos(r1) * 2, (r2 * 0.5 + 1) * 0.5 + 1, r3]):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(f, *args)
    assert [b.combined for b in plan.boxings() if b.collectives] == [0, 0, None], str(plan)
    counts = jsbp.debug.count_collectives(jsbp.jit(f), *args)
    assert counts == plan.collectives() == {**dict.fromkeys(counts, 0), "all-reduce": 2}, str(plan)


@pytest.mark.parametrize("waits", [False, True])
def test_output_conversions_join_the_open_group_of_their_kind(waits):
    """An output converted on the way out (a loss left partial until ``out_sbp`` reduces it) joins
    the open group of its kind, as a conversion in the program would: the data-parallel GPT step
    planned without lookahead passes ran its loss's all-reduce after the gradients' (2 instead
    of 1). Here 1 all-reduce for 4 conversions (before: 2, the outputs' apart). One whose value
    waits on that group (``waits``: ``g3 * b1``) closes it and starts the next, which a later
    output joins: 2 all-reduces. Values as NumPy's."""
    (g1, r1), (g2, r2), (g3, r3), (g4, r4) = (
        _addends(s, P4, np.float32) for s in [(8, 4), (4,), (8, 4), (3,)]
    )

    def f(g1, g2, g3, g4):
        b1 = jsbp.to_global(g1, sbp="B")  # group 0
        keep = functools.partial(
            jsbp.to_global, sbp="P"
        )  # partial sums until ``out_sbp`` reduces them
        return jnp.tanh(b1), keep(g2 * 2.0), keep(g3 * (b1 if waits else 3.0)), g4

    args = (g1, g2, g3, g4)
    jf = jsbp.jit(f, out_sbp="B")
    got = jf(*args)
    for o, ref in zip(got, [np.tanh(r1), r2 * 2, r3 * (r1 if waits else 3.0), r4]):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(jf, *args)
    assert [b.combined for b in plan.boxings() if b.collectives] == (
        [0, 0, 1, 1] if waits else [0] * 4
    ), str(plan)
    counts = jsbp.debug.count_collectives(jf, *args)
    assert counts == plan.collectives() == {**dict.fromkeys(counts, 0), "all-reduce": 1 + waits}, (
        str(plan)
    )


def test_a_repeated_output_reuses_its_combined_conversion():
    """A value returned twice is converted once: the second output reuses the first's result
    (``Boxing.reused``) also when that conversion ran in a combined collective. Before, the
    reused conversion ran again on its own (2 all-reduces where the plan said 1; found by a fuzzer
    of ``out_sbp`` conversions)."""
    (g1, r1), (g2, r2) = (_addends(s, P4, np.float32) for s in [(8, 4), (4,)])
    keep = functools.partial(jsbp.to_global, sbp="P")

    def f(g1, g2):
        y = keep(g1 * 2.0)
        return y, keep(g2 + 1.0), y

    jf = jsbp.jit(f, out_sbp="B")
    got = jf(g1, g2)
    for o, ref in zip(got, [r1 * 2, r2 + 1, r1 * 2]):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(jf, g1, g2)
    assert [(b.combined, b.reused) for b in plan.output_boxings] == [
        (0, False),
        (0, False),
        (None, True),
    ], str(plan)
    counts = jsbp.debug.count_collectives(jf, g1, g2)
    assert counts == plan.collectives() == {**dict.fromkeys(counts, 0), "all-reduce": 1}, str(plan)


_PENDING_CASES = {"4": (P4, "S(0)"), "2x4": (R24, ("S(0)", "B"))}  # placement, x's sbp


@pytest.mark.parametrize("case", list(_PENDING_CASES))
def test_partial_sums_read_whole_wait_with_their_readers(case):
    """Gradients reduced where an op reads them whole (an optimizer's ``g * g``): the op waits with
    the conversion (``_combine.lazy_ok``), so the conversions of one kind run as one collective
    when a result is first needed, wherever they stand in the program; one made from such a
    result (``late``: from ``out[0]``) cannot join that collective (it reads its result): the plan
    runs it in a second one, or avoids it (x split another way first): two collectives either
    way. Values as NumPy's. The reason: a read that cannot wait would run its conversion alone,
    and a group closed at the first read would miss the conversions of values made after it (on
    2 x 4: the gradients' all-reduces as 2 collectives instead of 1)."""
    plc, x_sbp = _PENDING_CASES[case]
    (g1, r1), (g2, r2), (g3, r3) = (_addends(s, plc, np.float32) for s in [(8, 4), (4,), (8, 8)])
    xv = RNG.standard_normal((8, 4)).astype(np.float32)
    x = jsbp.tensor(xv, placement=plc, sbp=x_sbp)

    def f(g1, g2, g3, x):
        s = (x * 2.0).sum(0)
        out = [jnp.tanh(g1), jnp.tanh(g2)]
        out.append(jnp.tanh(g3.T))
        out.append(jnp.tanh(s))
        late = (x * out[0].sum()).sum(0)  # made from out[0]: its conversion runs after g1's
        return (*out, jnp.tanh(late), jnp.cos(g1))  # cos reads g1's conversion again

    args = (g1, g2, g3, x)
    got = jsbp.jit(f)(*args)
    refs = [np.tanh(r) for r in (r1, r2, r3.T, (xv * 2).sum(0))]
    refs += [np.tanh((xv * refs[0].sum()).sum(0)), np.cos(r1)]
    for o, ref in zip(got, refs):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(f, *args)
    counts = jsbp.debug.count_collectives(jsbp.jit(f), *args)
    assert counts == plan.collectives() and sum(counts.values()) == 2, str(plan)
    groups = Counter(b.combined for b in plan.boxings() if b.combined is not None)
    assert len(groups) == 1 and max(groups.values()) >= 3, str(plan)  # the 3 gradients' at least
    assert plan.boxings()[-1].reused, str(plan)  # cos: g1's again


@pytest.mark.parametrize("plc", [P4, R24], ids=["4", "2x4"])
def test_a_reduction_over_size_one_dims_does_not_cut_a_combined_collective(plc):
    """A bias gradient goes back to its shape through ``(1, 1, d)`` summed over the size-1 dims (the
    transpose of its broadcast). That sum waits with the deferred reduction it reads, so the three
    reductions below stay one combined all-reduce (the zoo's decoder LM under dp=8, planned without
    the search's tie-breakers: 10 compiled all-reduces, now 1; each sum used to close the group).
    Values as NumPy's."""
    gs = [_addends((8,), plc, np.float32) for _ in range(3)]

    def f(g1, g2, g3):
        outs = []
        for g, red in zip((g1, g2, g3), (jnp.sum, jnp.sum, jnp.max)):
            whole = jsbp.to_global(g, sbp=("B",) * plc.ndim)
            outs.append(red(whole.reshape(1, 1, 8), axis=(0, 1)))
        return [jnp.tanh(o) for o in outs]

    args = [g for g, _ in gs]
    got = jsbp.jit(f)(*args)
    for o, (_, ref) in zip(got, gs):
        np.testing.assert_allclose(o.numpy(), np.tanh(ref), rtol=1e-5, atol=1e-5)
    plan = jsbp.explain(f, *args)
    counts = jsbp.debug.count_collectives(jsbp.jit(f), *args)
    want = {**dict.fromkeys(counts, 0), "all-reduce": 1}
    assert counts == plan.collectives() == want, str(plan)
    assert all(b.combined is not None for b in plan.boxings() if b.collectives), str(plan)


def test_megatron_weights_stay_put_without_hints():
    """Megatron layouts on the weights, nothing inside the step: jsbp boxes the activations around
    the block weights (column- then row-parallel) instead of gathering them per matmul, since the
    activations outweigh them. (The 32 x 16 embedding table may be gathered: 2 KiB, less than
    one activation's all-reduce.)"""
    optax = pytest.importorskip("optax")
    nnx, model = _transformer(vocab=32, d=16, h=4)
    graphdef, state = nnx.split(model, nnx.Param)
    params = jax.tree_util.tree_map(np.asarray, state.to_pure_dict())
    tok = RNG.integers(0, 32, size=(16, 17)).astype(np.int32)  # activations 16x16x16 > weights

    def loss(p, tok):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        logits = nnx.merge(graphdef, st)(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    def step(p, tok):
        l, g = jax.value_and_grad(loss)(p, tok)
        return l, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g)

    paths = {
        kp: jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    gp = jax.tree_util.tree_map_with_path(
        lambda kp, v: gt(v, P4, _tp_layout(paths[kp], v.ndim)), params
    )
    gtok = gt(tok, P4, "B")
    p_lay = [
        x.sbp
        for x in jax.tree_util.tree_leaves(gp, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))
    ]
    f = jsbp.jit(step, out_sbp=[("B",)] + p_lay)
    ref_l, ref_p = step(params, tok)
    got_l, got_p = f(gp, gtok)
    np.testing.assert_allclose(got_l.numpy(), ref_l, rtol=1e-5)
    assert_tree_close(got_p, ref_p, rtol=1e-4, atol=1e-5)
    entry = f.lower_program(gp, gtok)
    n_params = len(p_lay)
    names = [paths[kp] for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    weights = {
        v
        for v, nd, name in zip(entry.program.jaxpr.invars[:n_params], p_lay, names)
        if any(s.is_split for s in nd) and "embed" not in name
    }
    assert weights and not _converted_inputs(entry.program, weights)
    assert_plan_matches_program(step, gp, gtok)


def test_effects_run_once_per_device_when_replicated(capfd):
    """debug_print (debug_callback before JAX 0.10) has no rule: it runs replicated, so it prints once per device (documented
    in docs/rules.md), and the value it prints is the logical one."""
    x = gt(np.arange(8.0, dtype=np.float32), P4, "S(0)")

    def f(a):
        jax.debug.print("total {s}", s=a.sum())
        return a * 2

    with pytest.warns(jsbp.NoRuleWarning, match="debug_(print|callback)"):
        y = jsbp.jit(f)(x)
    np.testing.assert_allclose(y.numpy(), np.arange(8.0) * 2)
    jax.effects_barrier()
    assert capfd.readouterr().out.count("total 28.0") == P4.size


def _scan_batchnorm(x, ws):
    """Layers in a ``lax.scan``, each a matmul, a batch normalisation (statistics over the batch)
    and tanh."""

    def layer(h, w):
        h = h @ w
        mean = h.mean(0)
        var = (h * h).mean(0) - mean * mean  # as flax's BatchNorm
        return jnp.tanh((h - mean) * jax.lax.rsqrt(var + 1e-5)), mean

    h, means = jax.lax.scan(layer, x, ws)
    return (h * jnp.arange(h.shape[1], dtype=h.dtype)).sum(), means


def test_loop_bodies_are_planned_with_lookahead():
    """A scan body is planned as a program of its own (greedy, then the lookahead): under data
    parallelism each batch statistic is all-reduced once. Planned one equation at a time, each was
    reduce-scattered (cheapest for that equation alone) and all-gathered back: 4 collectives where
    2 do. The gradient's body likewise."""
    rng = np.random.default_rng(3)
    # 2 MiB of activations: gathering them costs more than the two statistics' all-reduces
    xv = rng.standard_normal((4096, 128)).astype(np.float32)
    wv = (rng.standard_normal((3, 128, 128)) / 11).astype(np.float32)
    x = jsbp.tensor(xv, P4, "S(0)")
    ws = jsbp.tensor(wv, P4, "B")
    fwd = jsbp.jit(_scan_batchnorm)
    (loss, means) = fwd(x, ws)
    ref_loss, ref_means = _scan_batchnorm(jnp.asarray(xv), jnp.asarray(wv))
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    np.testing.assert_allclose(means.numpy(), ref_means, rtol=1e-5, atol=1e-6)
    counts = jsbp.debug.count_collectives(fwd, x, ws)
    # the two statistics (XLA may combine them into one) and the loss: all-reduces only
    assert (
        counts["all-gather"] == counts["reduce-scatter"] == 0 and 2 <= counts["all-reduce"] <= 3
    ), counts

    grad = jsbp.jit(jax.grad(lambda x, ws: _scan_batchnorm(x, ws)[0], argnums=1))
    g = grad(x, ws)
    ref_g = jax.grad(lambda x, ws: _scan_batchnorm(x, ws)[0], argnums=1)(
        jnp.asarray(xv), jnp.asarray(wv)
    )
    # float32 sums over 4096 rows in another order, through E[h^2] - E[h]^2: scale-relative
    np.testing.assert_allclose(g.numpy(), ref_g, rtol=1e-3, atol=1e-4 * float(np.abs(ref_g).max()))
    gcounts = jsbp.debug.count_collectives(grad, x, ws)
    assert gcounts["all-gather"] == 0 and gcounts["reduce-scatter"] == 0, gcounts


def _deep_mlp_step(layers):
    """A train step of ``layers`` identical tensor-parallel blocks written as a Python loop (one
    flat program, as a user's ``for`` over ``nnx.List`` layers gives)."""

    def loss(ws, x):
        for w1, w2 in ws:
            x = x + jnp.tanh(x @ w1) @ w2
        return jnp.mean(x * x)

    def step(ws, x):
        g = jax.grad(loss)(ws, x)
        return jax.tree_util.tree_map(lambda w, d: w - 0.1 * d, ws, g)

    rng = np.random.default_rng(layers)  # its own stream: the values do not depend on test order

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    ws = [(gt(r(16, 32), R24, "B, S(1)"), gt(r(32, 16), R24, "B, S(0)")) for _ in range(layers)]
    return step, (ws, gt(r(8, 16), R24, "S(0), B"))


def test_deep_tensor_parallel_step_matches_one_device():
    """Three identical tensor-parallel blocks written as a Python loop (one flat program): values as
    one device's, and ``explain`` lists the collectives the compiled program runs."""
    step, args = _deep_mlp_step(3)
    out = jsbp.jit(step)(*args)
    ref = step(
        *jax.tree_util.tree_map(
            lambda t: jnp.asarray(t.numpy()),
            args,
            is_leaf=lambda t: isinstance(t, jsbp.GlobalTensor),
        )
    )
    # float32 sums in another order through a residual stack whose values grow: scale-relative
    for o, want in zip(
        jax.tree_util.tree_leaves(out, is_leaf=lambda t: isinstance(t, jsbp.GlobalTensor)),
        jax.tree_util.tree_leaves(ref),
    ):
        want = np.asarray(want)
        np.testing.assert_allclose(
            o.numpy(), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max())
        )
    assert_plan_matches_program(step, *args)


def test_batchnorm_under_data_parallelism_reduces_statistics_not_activations():
    """Conv -> BatchNorm (training mode) -> loss with the batch split over 8 devices: the step
    all-reduces BatchNorm's per-channel statistics and gradients and never gathers an activation.
    The search used to subtract the partial batch mean from the split activation by zero-filling
    the activation into partial sums (free by its bytes), then gathered a whole activation in the
    backward pass (2 MiB per device here); zero-filling a split value is now charged the
    reduction its addends will need."""
    from flax import nnx

    p8 = jsbp.placement("cpu", np.arange(8), axis_names=("dp",))

    class ConvBN(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(16, 16, (3, 3), use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(16, use_running_average=False, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.conv(x))

    model = ConvBN(nnx.Rngs(0))
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    xv = RNG.standard_normal((128, 16, 16, 16)).astype(np.float32)

    def step(params, rest, x):
        def loss(params):
            return jnp.mean(nnx.merge(gdef, params, jax.tree.map(lambda v: v, rest))(x) ** 2)

        return jax.value_and_grad(loss)(params)

    put = functools.partial(
        jax.tree.map, lambda a: jsbp.tensor(np.asarray(a), placement=p8, sbp="B")
    )
    args = (put(params), put(rest), jsbp.tensor(xv, placement=p8, sbp="S(0)"))
    f = jsbp.jit(step)
    plan = jsbp.explain(f, *args)
    assert plan.collectives()["all-gather"] == 0, str(plan)
    assert plan.total_bytes_per_device < 4096, str(plan)  # statistics and gradients, per channel
    loss, grads = f(*args)
    ref_loss, ref_grads = jax.jit(step)(params, rest, xv)
    np.testing.assert_allclose(loss.numpy(), ref_loss, rtol=1e-5)
    for g, r in zip(
        jax.tree.leaves(grads, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor)),
        jax.tree.leaves(ref_grads),
    ):
        np.testing.assert_allclose(g.numpy(), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_draws_do_not_depend_on_test_order(request):
    """``rand`` draws from a generator restarted for each test from its id (``conftest.py``):
    a test's inputs are the same whichever tests ran before it in its worker."""
    want = np.random.default_rng(zlib.crc32(request.node.nodeid.encode())).standard_normal((3, 2))
    np.testing.assert_array_equal(rand(3, 2), want.astype(np.float32))
