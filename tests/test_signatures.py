"""Signatures end to end: the rules' communication-free signatures are the ones ``jsbp.jit`` picks,
the plan lists exactly the collectives the compiled program has, and values match one device.

``tests/test_rules.py`` proves every signature correct in isolation; this file checks the ones that
matter in practice (OneFlow's and DTensor's examples) through the whole compiler, on the
placements (4,) and (2, 2), with even and uneven shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp import sbp
from jsbp._program import iter_steps

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
Q22 = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
RNG = np.random.default_rng(7)


def rand(*shape, lo=None):
    x = RNG.standard_normal(shape).astype(np.float32)
    return x if lo is None else (np.abs(x) + lo).astype(np.float32)


def parse(nd, plc):
    return sbp.parse_nd(nd, plc.ndim)


def run(fn, *args):
    """Run ``fn`` under jsbp.jit; return (result, plan, collective counts of the compiled program).

    The plan and the compiled program must agree: no hidden communication."""
    jf = jsbp.jit(fn)
    out = jf(*args)
    plan = jsbp.explain(fn, *args)
    compiled = jsbp.debug.count_collectives(jf, *args)
    assert plan.collectives() == compiled, (str(plan), compiled)
    return out, plan, compiled


def rows_of(plan, primitive):
    return [r for r in plan.rows if r.primitive == primitive]


def assert_close(out, ref, tol=1e-5):
    np.testing.assert_allclose(
        np.asarray(out.numpy(), np.float64), np.asarray(ref, np.float64), rtol=tol, atol=tol
    )


# -------------------------------------------------------------------------------------------
# the matmul table, 1-d and 2-d
# -------------------------------------------------------------------------------------------

MATMUL_1D = [
    ("S(0)", "B", "S(0)"),
    ("B", "S(1)", "S(1)"),
    ("S(1)", "S(0)", "P"),
    ("P", "B", "P"),
    ("B", "P", "P"),
    ("B", "B", "B"),
]
# on (2, 2) every axis picks its own row of the table: data x tensor parallel, 2-d tensor parallel
MATMUL_2D = [
    (("S(0)", "B"), ("B", "S(1)"), ("S(0)", "S(1)")),
    (("S(0)", "S(1)"), ("B", "S(0)"), ("S(0)", "P")),
    (("S(1)", "S(1)"), ("S(0)", "S(0)"), ("P", "P")),
    (("P", "S(0)"), ("B", "B"), ("P", "S(0)")),
    (("S(1)", "B"), ("S(0)", "S(1)"), ("P", "S(1)")),
]


@pytest.mark.parametrize("shape", [(8, 12, 4), (7, 5, 6)], ids=["even", "uneven"])
@pytest.mark.parametrize(
    "plc,xs,ws,want", [(P4, *r) for r in MATMUL_1D] + [(Q22, *r) for r in MATMUL_2D]
)
def test_matmul_signature_table(plc, xs, ws, want, shape):
    m, k, n = shape
    xv, wv = rand(m, k), rand(k, n)
    y, plan, coll = run(lambda a, b: a @ b, jsbp.tensor(xv, plc, xs), jsbp.tensor(wv, plc, ws))
    assert y.sbp == parse(want, plc)
    assert sum(coll.values()) == 0
    (row,) = rows_of(plan, "dot_general")
    assert not row.boxings
    assert_close(y, xv @ wv)


@pytest.mark.parametrize(
    "plc,a_nd,b_nd,want",
    [
        (P4, "S(0)", "S(0)", "S(0)"),
        (Q22, ("S(0)", "S(0)"), ("S(0)", "S(0)"), ("S(0)", "S(0)")),
        (Q22, ("S(0)", "S(2)"), ("S(0)", "S(1)"), ("S(0)", "P")),  # batch x contraction
        (Q22, ("S(0)", "S(1)"), ("S(0)", "B"), ("S(0)", "S(1)")),  # batch x rows
    ],
)
def test_batched_matmul_splits_batch_dims_together(plc, a_nd, b_nd, want):
    av, bv = rand(5, 3, 6), rand(5, 6, 7)
    y, _, coll = run(
        lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
        jsbp.tensor(av, plc, a_nd),
        jsbp.tensor(bv, plc, b_nd),
    )
    assert sum(coll.values()) == 0
    assert y.sbp == parse(want, plc)
    assert_close(y, av @ bv)


def test_conv_splits_batch_and_output_features():
    xv, wv = rand(5, 3, 6, 6), rand(8, 3, 3, 3)
    conv = lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )
    ref = conv(jnp.asarray(xv), jnp.asarray(wv))
    y, _, coll = run(conv, jsbp.tensor(xv, Q22, ("S(0)", "B")), jsbp.tensor(wv, Q22, ("B", "S(0)")))
    assert y.sbp == parse(("S(0)", "S(1)"), Q22) and sum(coll.values()) == 0
    assert_close(y, ref, 1e-4)
    # input channels split on both operands: a partial sum, padding masked (3 channels over 4)
    y, _, coll = run(conv, jsbp.tensor(xv, P4, "S(1)"), jsbp.tensor(wv, P4, "S(1)"))
    assert y.sbp == (sbp.partial_sum,) and sum(coll.values()) == 0
    assert_close(y, ref, 1e-4)


# -------------------------------------------------------------------------------------------
# OneFlow's examples
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 6), (7, 5)], ids=["even", "uneven"])
def test_reduce_over_split_dim_is_partial(shape):
    xv = rand(*shape) - 3.0  # all negative: a padding zero would win a max
    x = jsbp.tensor(xv, P4, "S(0)")
    for fn, kind, ref in (
        (lambda a: a.sum(0), sbp.partial_sum, xv.sum(0)),
        (lambda a: a.max(0), sbp.partial_max, xv.max(0)),
        (lambda a: a.min(0), sbp.partial_min, xv.min(0)),
    ):
        y, _, coll = run(fn, x)
        assert y.sbp == (kind,) and sum(coll.values()) == 0
        assert_close(y, ref)
    # over the other dim the split is kept
    y, _, coll = run(lambda a: a.sum(1), x)
    assert y.sbp == (sbp.split(0),) and sum(coll.values()) == 0
    assert_close(y, xv.sum(1))


def test_partial_max_is_reduced_on_demand():
    xv = rand(7, 5) - 3.0
    x = jsbp.tensor(xv, P4, "S(0)")
    # shifts and monotone functions keep the partial max: nothing is reduced yet
    y, _, coll = run(lambda a: jnp.exp(jnp.max(a, axis=0) - 1.0), x)
    assert y.sbp == (sbp.partial_max,) and sum(coll.values()) == 0
    assert_close(y, np.exp(xv.max(0) - 1.0))
    y, _, coll = run(lambda a: 2.0 - jnp.max(a, axis=0), x)  # b - max = min(b - a_i)
    assert y.sbp == (sbp.partial_min,) and sum(coll.values()) == 0
    assert_close(y, 2.0 - xv.max(0))
    # a scale (sign unknown) needs the value: one collective (an all-reduce of the partial max,
    # or the column split the maximum is taken over)
    y, _, coll = run(lambda a: jnp.max(a, axis=0) * 2.0, x)
    assert sum(coll.values()) == 1 and coll["all-reduce"] + coll["all-to-all"] == 1
    assert_close(y, xv.max(0) * 2.0)


def test_vocab_parallel_embedding_and_its_gradient():
    table, idx = rand(11, 6), RNG.integers(0, 11, (4, 3)).astype(np.int32)
    t, i = jsbp.tensor(table, P4, "S(0)"), jsbp.tensor(idx, P4, "B")
    y, plan, coll = run(lambda t, i: t[i], t, i)
    assert y.sbp == (sbp.partial_sum,) and sum(coll.values()) == 0
    (row,) = rows_of(plan, "gather")
    assert row.signature == "(S(0)), (B) -> (P)"
    np.testing.assert_array_equal(y.numpy(), table[idx])
    # the gradient: scatter-add of (replicated) row gradients into the split table stays split
    upd = rand(4, 3, 6)
    g, plan, coll = run(lambda t, i, u: t.at[i].add(u), t, i, jsbp.tensor(upd, P4, "B"))
    assert g.sbp == (sbp.split(0),) and sum(coll.values()) == 0
    want = table.copy()
    np.add.at(want, idx, upd)
    assert_close(g, want)
    # and through jax.grad inside jsbp.jit
    loss = lambda t, i: jnp.sum(jnp.take(t, i, axis=0) ** 2)
    gv, _, _ = run(lambda t, i: jax.grad(loss)(t, i), t, i)
    assert_close(gv, jax.grad(loss)(jnp.asarray(table), idx))


def test_vocab_parallel_embedding_on_2d_placement():
    table, idx = rand(9, 8), RNG.integers(0, 9, (6,)).astype(np.int32)
    # table rows over "dp" (vocab), columns over "tp": the output is (P, S(1))
    y, _, coll = run(
        lambda t, i: t[i],
        jsbp.tensor(table, Q22, ("S(0)", "S(1)")),
        jsbp.tensor(idx, Q22, ("B", "B")),
    )
    assert y.sbp == parse(("P", "S(1)"), Q22) and sum(coll.values()) == 0
    np.testing.assert_array_equal(y.numpy(), table[idx])


def softmax(x):
    return jax.nn.softmax(x, axis=-1)


def log_softmax(x):
    return jax.nn.log_softmax(x, axis=-1)


def layer_norm(x):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


NORMS = {
    "softmax": softmax,
    "log_softmax": log_softmax,
    "layer_norm": layer_norm,
    "standardize": lambda x: jax.nn.standardize(x, axis=-1),
}


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("plc,nd", [(P4, "S(0)"), (Q22, ("S(0)", "S(0)")), (Q22, ("S(0)", "B"))])
def test_normalisation_over_a_non_split_dim_keeps_the_split(name, plc, nd):
    fn = NORMS[name]
    xv = rand(7, 6)
    y, _, coll = run(fn, jsbp.tensor(xv, plc, nd))
    assert sum(coll.values()) == 0, coll
    assert y.sbp == parse(nd, plc)
    assert_close(y, fn(jnp.asarray(xv)), 1e-4)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm"])
@pytest.mark.parametrize("plc,nd", [(P4, "S(1)"), (Q22, ("S(0)", "S(1)"))])
def test_normalisation_over_the_split_dim_boxes(name, plc, nd):
    fn = NORMS[name]
    xv = rand(6, 7)  # 7 over the split axes: uneven
    y, plan, coll = run(fn, jsbp.tensor(xv, plc, nd))
    assert sum(coll.values()) >= 1
    assert any(r.boxings for r in plan.rows)
    assert_close(y, fn(jnp.asarray(xv)), 1e-4)


def test_uneven_mean_is_5_5():
    # DTensor's bug: mean of arange(12).reshape(3, 4) split S(0) over 2 devices must be 5.5
    x = jsbp.tensor(
        np.arange(12.0, dtype=np.float32).reshape(3, 4), jsbp.placement("cpu", [0, 1]), sbp.split(0)
    )
    assert float(jsbp.jit(jnp.mean)(x).numpy()) == 5.5


UNEVEN_FNS = {
    "sum": jnp.sum,
    "mean": jnp.mean,
    "max": jnp.max,
    "min": lambda x: jnp.min(-x),
    "max_axis0": lambda x: jnp.max(x, axis=0),
    "argmax0": lambda x: jnp.argmax(x, axis=0),
    "argmin1": lambda x: jnp.argmin(x, axis=1),
    "softmax0": lambda x: jax.nn.softmax(x, axis=0),
    "log_softmax0": lambda x: jax.nn.log_softmax(x, axis=0),
    "logsumexp": lambda x: jax.nn.logsumexp(x),
    "norm": jnp.linalg.norm,
    "norm_axis0": lambda x: jnp.linalg.norm(x, axis=0),
    "var": jnp.var,
    "std_axis0": lambda x: jnp.std(x, axis=0),
    "cumsum0": lambda x: jnp.cumsum(x, axis=0),
    "sort0": lambda x: jnp.sort(x, axis=0),
    "prod0": lambda x: jnp.prod(x * 0.1 + 1.0, axis=0),
    "gram": lambda x: x.T @ x,
}


@pytest.mark.parametrize("name", list(UNEVEN_FNS))
@pytest.mark.parametrize("plc,nd", [(P4, "S(0)"), (Q22, ("S(0)", "S(0)")), (Q22, ("S(1)", "S(0)"))])
def test_uneven_splits_are_exact(name, plc, nd):
    fn = UNEVEN_FNS[name]
    xv = rand(7, 3) - 2.0  # 7 over 4 (and 3 over 2) leave padded blocks; negative values
    y, _, _ = run(fn, jsbp.tensor(xv, plc, nd))
    ref = np.asarray(fn(jnp.asarray(xv)))
    if np.issubdtype(ref.dtype, np.integer):
        np.testing.assert_array_equal(y.numpy(), ref)
    else:
        assert_close(y, ref, 1e-4)


def test_empty_blocks_are_exact():
    xv = rand(3, 5) - 2.0  # 3 rows over 4 devices: the last block is empty
    x = jsbp.tensor(xv, P4, "S(0)")
    for fn in (
        jnp.sum,
        jnp.max,
        lambda a: a.mean(0),
        lambda a: jax.nn.softmax(a, axis=0),
        lambda a: a.T @ a,
    ):
        assert_close(run(fn, x)[0], np.asarray(fn(jnp.asarray(xv))), 1e-5)


# -------------------------------------------------------------------------------------------
# elementwise, linear and shape signatures
# -------------------------------------------------------------------------------------------


def test_linear_ops_keep_partial_sums():
    xv, yv, mv = rand(7, 5), rand(7, 5), RNG.random((7, 5)) < 0.5
    x, y = jsbp.tensor(xv, P4, "P"), jsbp.tensor(yv, P4, "P")
    m = jsbp.tensor(mv, P4, "B")
    cases = {
        "add": (lambda a, b, m: a + b, xv + yv),
        "sub": (lambda a, b, m: a - b, xv - yv),
        "neg": (lambda a, b, m: -a, -xv),
        "scale": (lambda a, b, m: 2.5 * a, 2.5 * xv),
        "div_scalar": (lambda a, b, m: a / 4.0, xv / 4.0),
        "where": (lambda a, b, m: jnp.where(m, a, b), np.where(mv, xv, yv)),
        "sum": (lambda a, b, m: a.sum(0), xv.sum(0)),
        "transpose": (lambda a, b, m: a.T, xv.T),
        "reshape": (lambda a, b, m: a.reshape(35), xv.reshape(35)),
        "slice": (lambda a, b, m: a[1:4], xv[1:4]),
        "concat": (lambda a, b, m: jnp.concatenate([a, b]), np.concatenate([xv, yv])),
        "cumsum": (lambda a, b, m: jnp.cumsum(a, axis=1), np.cumsum(xv, axis=1)),
        "pad": (lambda a, b, m: jnp.pad(a, ((1, 0), (0, 2))), np.pad(xv, ((1, 0), (0, 2)))),
    }
    for name, (fn, ref) in cases.items():
        out, _, coll = run(fn, x, y, m)
        assert out.sbp == (sbp.partial_sum,), name
        assert sum(coll.values()) == 0, (name, coll)
        assert_close(out, ref)


def test_nonlinear_ops_box_partial_sums():
    xv = rand(7, 5)
    x = jsbp.tensor(xv, P4, "P")
    for fn in (jnp.exp, jnp.tanh, lambda a: a * a, jnp.abs, lambda a: jnp.maximum(a, 0.0)):
        out, _, coll = run(fn, x)
        assert coll["all-reduce"] + coll["reduce-scatter"] >= 1
        assert_close(out, np.asarray(fn(jnp.asarray(xv))), 1e-5)


@pytest.mark.parametrize(
    "fn, nd, want",
    [
        (lambda a: jnp.tanh(a) * 2.0 + a, "S(1)", "S(1)"),
        (lambda a: a.T, "S(0)", "S(1)"),
        (lambda a: a.reshape(4, 2, 5), "S(0)", "S(0)"),
        (lambda a: a.reshape(40), "S(0)", "S(0)"),
        (lambda a: a[:, None, :], "S(1)", "S(2)"),
        (lambda a: jnp.concatenate([a, a], axis=1), "S(0)", "S(0)"),
        (lambda a: jnp.pad(a, ((0, 0), (2, 1))), "S(0)", "S(0)"),
        (lambda a: a[:, 1:3], "S(0)", "S(0)"),
        (lambda a: jnp.flip(a, axis=1), "S(0)", "S(0)"),
        (lambda a: jnp.cumsum(a, axis=1), "S(0)", "S(0)"),
        (lambda a: jnp.sort(a, axis=0), "S(1)", "S(1)"),
        (lambda a: jnp.argmax(a, axis=1), "S(0)", "S(0)"),
        (lambda a: jnp.clip(a, -0.5, 0.5), "S(0)", "S(0)"),
        (lambda a: a.astype(jnp.bfloat16), "S(1)", "S(1)"),
        (lambda a: jax.lax.top_k(a, 2)[0], "S(0)", "S(0)"),
    ],
    ids=[
        "elementwise",
        "transpose",
        "reshape",
        "flatten",
        "expand_dims",
        "concatenate",
        "pad",
        "slice",
        "rev",
        "cumsum",
        "sort",
        "argmax",
        "clamp",
        "convert",
        "top_k",
    ],
)
def test_shape_and_elementwise_ops_keep_splits(fn, nd, want):
    xv = rand(8, 5)
    out, _, coll = run(fn, jsbp.tensor(xv, P4, nd))
    assert sum(coll.values()) == 0, coll
    assert out.sbp == parse(want, P4)
    ref = np.asarray(fn(jnp.asarray(xv)))
    np.testing.assert_allclose(
        np.asarray(out.numpy(), np.float64),
        np.asarray(ref, np.float64),
        rtol=1e-2 if ref.dtype == jnp.bfloat16 else 1e-6,
    )


def test_random_values_do_not_depend_on_the_layout():
    key = jax.random.key(3)

    def noisy(x):
        return x + jax.random.normal(key, x.shape)

    xv = rand(7, 5)
    ref = np.asarray(noisy(jnp.asarray(xv)))
    for plc, nd in ((P4, "S(0)"), (P4, "S(1)"), (Q22, ("S(1)", "S(0)"))):
        out, _, coll = run(noisy, jsbp.tensor(xv, plc, nd))
        assert sum(coll.values()) == 0
        assert_close(out, ref)


def _bits_layouts(fn, *args):
    prog = jsbp.jit(fn).lower_program(*args).program
    return [
        st.out_layouts[0].nd_sbp
        for _, st in iter_steps(prog)
        if st.eqn.primitive.name == "random_bits"
    ]


@pytest.mark.parametrize("shape", [(16, 12), (7, 5), (3, 9)])
@pytest.mark.parametrize(
    "plc, nd",
    [
        (P4, "S(0)"),
        (P4, "S(1)"),
        (Q22, ("S(0)", "S(1)")),
        (Q22, ("S(1)", "S(0)")),
        (Q22, ("S(0)", "S(0)")),
        (Q22, ("B", "S(1)")),
    ],
)
def test_random_draws_are_made_split_where_they_are_used_split(plc, nd, shape):
    """Dropout on a split activation draws only the device's block of bits (threefry hashes each
    element's row-major counter), not the whole array sliced: the same bits as one device, no
    collective, no local slice of a whole draw."""

    def dropout(key, x):
        keep = jax.random.bernoulli(key, 0.7, x.shape)
        noise = jax.random.uniform(jax.random.fold_in(key, 3), x.shape)
        return jnp.where(keep, x / 0.7, 0.0) + noise

    xv = rand(*shape)
    key = jax.random.key(11)
    ref = np.asarray(dropout(key, jnp.asarray(xv)))
    gk = jsbp.tensor(key, plc, ("B",) * plc.ndim)
    gx = jsbp.tensor(xv, plc, nd)
    out, _, coll = run(dropout, gk, gx)
    np.testing.assert_array_equal(out.numpy(), ref)
    assert sum(coll.values()) == 0
    assert _bits_layouts(dropout, gk, gx) == [parse(nd, plc)] * 2


# -------------------------------------------------------------------------------------------
# pooling, grouped convs, fft, linear algebra and the JAX 0.10 shape primitives
# -------------------------------------------------------------------------------------------


def _pool(kind, window, strides, padding="VALID"):
    init, op = {"max": (-jnp.inf, jax.lax.max), "sum": (0.0, jax.lax.add)}[kind]
    w, s = (1, *window, 1), (1, *strides, 1)
    pad = padding if isinstance(padding, str) else ((0, 0), *padding, (0, 0))
    return lambda x: jax.lax.reduce_window(x, init, op, w, s, pad)


def _no_collectives(fn, xv, plc, nd, want, tol=1e-5):
    out, _, coll = run(fn, jsbp.tensor(xv, plc, nd))
    assert sum(coll.values()) == 0, coll
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = fn(jnp.asarray(xv))
    refs = refs if isinstance(refs, (tuple, list)) else (refs,)
    for o, r in zip(outs, refs):
        assert o.sbp == parse(want, plc), o.sbp
        np.testing.assert_allclose(np.asarray(o.numpy()), np.asarray(r), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "plc,nd", [(P4, "S(0)"), (P4, "S(3)"), (Q22, ("S(0)", "S(3)"))], ids=["batch", "feature", "2d"]
)
@pytest.mark.parametrize("kind", ["max", "sum"])
def test_pooling_keeps_batch_and_feature_splits(kind, plc, nd):
    """max / avg pooling (window 3, stride 2, SAME) and its gradient run on each device's images
    and channels: no communication, the split kept."""
    xv = rand(6, 7, 7, 6)  # uneven over 4 devices
    pool = _pool(kind, (3, 3), (2, 2), "SAME")
    _no_collectives(pool, xv, plc, nd, nd)
    _no_collectives(jax.grad(lambda x: (pool(x) ** 2).sum()), xv, plc, nd, nd, tol=1e-4)


def test_aligned_pooling_keeps_a_spatial_split():
    """Non-overlapping windows that tile each block (2x2 stride 2, H = 8 over 4 devices) keep a
    split of H, forward and backward; overlapping windows over a split H box instead."""
    xv = rand(2, 8, 6, 3)
    pool = _pool("max", (2, 2), (2, 2))
    _no_collectives(pool, xv, P4, "S(1)", "S(1)")
    _no_collectives(jax.grad(lambda x: (pool(x) ** 2).sum()), xv, P4, "S(1)", "S(1)")
    out, _, coll = run(_pool("max", (3, 3), (1, 1), "SAME"), jsbp.tensor(xv, P4, "S(1)"))
    assert sum(coll.values()) > 0
    assert_close(out, _pool("max", (3, 3), (1, 1), "SAME")(jnp.asarray(xv)))


def _depthwise(x, w):
    dn = ("NHWC", "HWIO", "NHWC")
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=x.shape[-1]
    )


@pytest.mark.parametrize("plc,nd", [(P4, "S(3)"), (Q22, ("S(3)", "S(3)"))], ids=["4", "2x2"])
def test_depthwise_conv_splits_channels(plc, nd):
    """A depthwise conv with its channels split (whole groups per device) and both its gradients
    (a grouped conv and a batch-grouped conv) need no communication."""
    xv, wv = rand(2, 6, 6, 8), rand(3, 3, 1, 8)
    loss = lambda x, w: (_depthwise(x, w) ** 2).sum()
    x, w = jsbp.tensor(xv, plc, nd), jsbp.tensor(wv, plc, nd)
    y, _, coll = run(_depthwise, x, w)
    assert sum(coll.values()) == 0 and y.sbp == parse(nd, plc)
    assert_close(y, _depthwise(jnp.asarray(xv), jnp.asarray(wv)), 1e-4)
    (gx, gw), _, coll = run(jax.grad(loss, argnums=(0, 1)), x, w)
    assert sum(coll.values()) == 0, coll
    assert gx.sbp == parse(nd, plc) and gw.sbp == parse(nd, plc)
    rx, rw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(xv), jnp.asarray(wv))
    assert_close(gx, rx, 1e-3)
    assert_close(gw, rw, 1e-3)


def test_depthwise_conv_kernel_gradient_over_a_split_batch_is_partial():
    xv, wv = rand(7, 5, 5, 4), rand(3, 3, 1, 4)
    loss = lambda x, w: (_depthwise(x, w) ** 2).sum()
    (gx, gw), _, coll = run(
        jax.grad(loss, argnums=(0, 1)), jsbp.tensor(xv, P4, "S(0)"), jsbp.tensor(wv, P4, "B")
    )
    assert sum(coll.values()) == 0, coll
    assert gx.sbp == parse("S(0)", P4) and gw.sbp == parse("P", P4)
    rx, rw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(xv), jnp.asarray(wv))
    assert_close(gx, rx, 1e-3)
    assert_close(gw, rw, 1e-3)


@pytest.mark.parametrize(
    "fn,dtype",
    [
        (jnp.fft.fft, np.complex64),
        (lambda x: jnp.fft.irfft(jnp.fft.rfft(x) * 2), np.float32),
        (lambda x: jnp.abs(jnp.fft.fft2(x)), np.float32),
    ],
    ids=["fft", "rfft-irfft", "fft2"],
)
def test_fft_keeps_the_batch_split(fn, dtype):
    xv = rand(7, 4, 6).astype(dtype)
    _no_collectives(fn, xv, P4, "S(0)", "S(0)", tol=1e-4)


def _spd(*batch, n=4):
    a = rand(*batch, n, n)
    return (a @ np.swapaxes(a, -1, -2) + n * np.eye(n)).astype(np.float32)


@pytest.mark.parametrize(
    "fn",
    [
        jnp.linalg.cholesky,
        lambda a: jnp.linalg.eigh(a)[0],
        jnp.linalg.det,
        lambda a: jnp.linalg.slogdet(a)[1],
        lambda a: jnp.linalg.svd(a, compute_uv=False),
        lambda a: jnp.linalg.qr(a)[1],
        jax.grad(lambda a: jnp.linalg.cholesky(a).sum()),
    ],
    ids=["cholesky", "eigh", "det", "slogdet", "svd", "qr", "grad-cholesky"],
)
def test_batched_linalg_keeps_the_batch_split(fn):
    _no_collectives(fn, _spd(7), P4, "S(0)", "S(0)", tol=1e-3)


def test_triangular_solve_splits_the_columns_of_b():
    av, bv = np.tril(_spd()), rand(4, 9)
    solve = lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True)
    x, _, coll = run(solve, jsbp.tensor(av, P4, "B"), jsbp.tensor(bv, P4, "S(1)"))
    assert sum(coll.values()) == 0 and x.sbp == parse("S(1)", P4)
    assert_close(x, solve(jnp.asarray(av), jnp.asarray(bv)), 1e-4)


def test_linalg_solve_and_inv_are_exact():
    """custom_linear_solve (jnp.linalg.solve / inv): its solve jaxpr is inferred like a call."""
    av, bv = _spd(), rand(4, 3)
    x, _, _ = run(jnp.linalg.solve, jsbp.tensor(av, P4, "B"), jsbp.tensor(bv, P4, "S(0)"))
    assert_close(x, jnp.linalg.solve(jnp.asarray(av), jnp.asarray(bv)), 1e-4)
    y, _, _ = run(jnp.linalg.inv, jsbp.tensor(av, P4, "S(0)"))
    assert_close(y, jnp.linalg.inv(jnp.asarray(av)), 1e-4)


def test_batched_solve_keeps_the_batch_split():
    """A batch of systems split over 4 devices solves locally: no collective at all, and the
    gradient (JAX's transposed solve) is exact too."""
    rng = np.random.default_rng(3)
    av = np.stack([_spd() + i * np.eye(4, dtype=np.float32) for i in range(8)])
    bv = rng.standard_normal((8, 4, 2)).astype(np.float32)
    x, _, coll = run(jnp.linalg.solve, jsbp.tensor(av, P4, "S(0)"), jsbp.tensor(bv, P4, "S(0)"))
    assert sum(coll.values()) == 0 and x.sbp == parse("S(0)", P4)
    assert_close(x, jnp.linalg.solve(jnp.asarray(av), jnp.asarray(bv)), 1e-4)
    loss = lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2)
    g, _, coll = run(
        jax.grad(loss, argnums=(0, 1)), jsbp.tensor(av, P4, "S(0)"), jsbp.tensor(bv, P4, "S(0)")
    )
    ref = jax.grad(loss, argnums=(0, 1))(jnp.asarray(av), jnp.asarray(bv))
    assert sum(coll.values()) == 0
    for a, b in zip(g, ref):
        assert_close(a, b, 1e-3)


@pytest.mark.parametrize(
    "fn,nd,want",
    [
        (lambda x: jnp.stack([x, 2 * x], 1), "S(0)", "S(0)"),
        (lambda x: jnp.stack([x, 2 * x], 0), "S(1)", "S(2)"),
        (lambda x: jnp.select([x > 0.5, x < -0.5], [x, -x], 0.0), "S(1)", "S(1)"),
        (lambda x: jnp.unstack(x, axis=1), "S(0)", "S(0)"),
        (lambda x: jnp.tile(x, (1, 3)), "S(0)", "S(0)"),
        (lambda x: jax.lax.complex(x, 2 * x), "S(1)", "S(1)"),
        (lambda x: jnp.searchsorted(jnp.linspace(-2.0, 2.0, 6), x), "S(0)", "S(0)"),
    ],
    ids=["stack", "stack0", "select", "unstack", "tile", "complex", "searchsorted"],
)
def test_jax010_primitives_keep_splits(fn, nd, want):
    _no_collectives(fn, rand(7, 5), P4, nd, want)
