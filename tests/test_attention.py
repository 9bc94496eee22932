"""``jsbp.nn.dot_product_attention`` against ``jax.nn.dot_product_attention`` on one device.

Values and the gradients of query, key and value (and of a learned bias) match at 1e-5 (f32)
for each plan forced and for the one the cost model chooses, with the sequence split over 4 and
8 devices, causal and not, even and uneven lengths, with a key-padding mask. ``explain`` lists
exactly the collectives the compiled program runs: the ring has collective-permutes and no
all-gather of key/value, the heads plan (Ulysses) all-to-alls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
import jsbp.nn

RNG = np.random.default_rng(0)
TOL = dict(rtol=1e-5, atol=1e-5)


def rand(*shape):
    return RNG.normal(size=shape).astype(np.float32)


def placement(*sizes, names=("x",)):
    n = int(np.prod(sizes))
    return jsbp.placement("cpu", np.arange(n).reshape(sizes).tolist(), axis_names=names)


def qkv(b, t, n, h, kv_heads=None):
    kv_heads = kv_heads or n
    return rand(b, t, n, h), rand(b, t, kv_heads, h), rand(b, t, kv_heads, h)


def key_padding(b, s):
    """[b, 1, 1, s]: the last keys of each sequence masked (a different number per sequence)."""
    keep = np.arange(s)[None, :] < (s - 1 - np.arange(b)[:, None] * 3)
    return keep[:, None, None, :]


def check(fn, ref, args, sbps, plc):
    """``fn`` under ``jsbp.jit`` on ``args`` laid out as ``sbps`` against ``ref`` on one device:
    the values, the gradients of a random cotangent and explain == the compiled collectives.
    Returns the gradient program's plan."""
    glob = [jsbp.tensor(a, plc, s) for a, s in zip(args, sbps)]
    np.testing.assert_allclose(jsbp.jit(fn)(*glob).numpy(), ref(*args), **TOL)
    w = rand(*np.shape(ref(*args)))
    argnums = tuple(range(len(args)))

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * w)

    grad = jsbp.jit(jax.grad(loss(fn), argnums))
    want = jax.grad(loss(ref), argnums)(*args)
    for g, h in zip(grad(*glob), want):
        np.testing.assert_allclose(g.numpy(), h, **TOL)
    plan = jsbp.explain(grad, *glob)
    assert plan.collectives() == jsbp.debug.count_collectives(grad, *glob)
    # the bytes it lists (the boxings', and the ring's own) are the ones the cost model prices
    est = jsbp.debug.estimate(grad, *glob)
    assert plan.total_bytes_per_device == pytest.approx(est.comm_bytes), (str(plan), est)
    return plan


def notes(plan):
    return {r.note for r in plan.rows if r.primitive.startswith("jsbp_attention")}


def assert_plan(plan, name):
    c = plan.collectives()
    if name == "ring":
        assert c["collective-permute"] > 0 and c["all-gather"] == c["all-to-all"] == 0, c
        assert notes(plan) == {"ring over 'x'"}
        text = str(plan)  # the text names the ring's own collectives on the attention's rows
        own = sum(r.collectives.count("collective-permute") for r in plan.rows)
        rows = [r for r in plan.rows if r.collectives]
        assert own > 0 and all(r.own_bytes > 0 for r in rows), text
        for r in rows:
            assert f"[own: {r.collectives.count('collective-permute')} collective-permute]" in text
    elif name == "gather":
        assert c["all-gather"] > 0 and c["collective-permute"] == 0, c
        assert notes(plan) == {"queries split over 'x', key/value whole"}
    elif name == "heads":
        assert c["all-to-all"] > 0 and c["all-gather"] == c["collective-permute"] == 0, c
        assert notes(plan) == {"heads split"}


def run_case(t, n, causal, plan, masked):
    q, k, v = qkv(2, t, 8, 4)
    mask = key_padding(2, t) if masked else None

    def fn(q, k, v):
        return jsbp.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, plan=plan)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal)

    got = check(fn, ref, (q, k, v), ["S(1)"] * 3, placement(n))
    assert_plan(got, plan)
    assert len(notes(got)) == 1  # one plan runs forward and backward


CASES = [
    (t, n, causal, plan, masked)
    for t in (32, 29, 13)
    for n in (4, 8)
    for causal in (False, True)
    for plan in (None, "gather", "ring", "heads")
    for masked in (False, True)
]
SAMPLED = {(29, 8, c, p, True) for c in (False, True) for p in (None, "gather", "ring", "heads")}
SAMPLED |= {(32, 4, True, p, False) for p in ("gather", "ring", "heads")}


@pytest.mark.parametrize(
    "t, n, causal, plan, masked",
    [c if c in SAMPLED else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
)
def test_sequence_split_matches_one_device(t, n, causal, plan, masked):
    run_case(t, n, causal, plan, masked)


@pytest.mark.parametrize("plan", ["ring", "heads", None])
def test_data_and_context_parallel_on_a_2d_placement(plan):
    q, k, v = qkv(4, 24, 4, 8)

    def fn(q, k, v):
        return jsbp.nn.dot_product_attention(q, k, v, is_causal=True, plan=plan)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    got = check(fn, ref, (q, k, v), [("S(0)", "S(1)")] * 3, placement(2, 4, names=("dp", "cp")))
    c = got.collectives()
    if plan == "ring":
        assert c["collective-permute"] > 0 and c["all-gather"] == 0, c
    if plan == "heads":
        assert c["all-to-all"] > 0 and c["collective-permute"] == 0, c


@pytest.mark.parametrize("plan", ["ring", "heads", "gather"])
def test_grouped_query_heads(plan):
    q, k, v = qkv(2, 20, 8, 4, kv_heads=2)

    def fn(q, k, v):
        return jsbp.nn.dot_product_attention(q, k, v, is_causal=True, plan=plan)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    check(fn, ref, (q, k, v), ["S(1)"] * 3, placement(4))


def test_learned_bias_gets_its_gradient():
    q, k, v = qkv(2, 16, 4, 8)
    bias = rand(1, 4, 16, 16)

    def fn(q, k, v, b):
        return jsbp.nn.dot_product_attention(q, k, v, bias=b)

    def ref(q, k, v, b):
        return jax.nn.dot_product_attention(q, k, v, bias=b)

    check(fn, ref, (q, k, v, bias), ["S(1)"] * 3 + ["B"], placement(4))


def test_fixed_bias_with_the_ring():
    q, k, v = qkv(2, 19, 4, 8)
    bias = rand(2, 1, 19, 19)

    def fn(q, k, v):
        return jsbp.nn.dot_product_attention(q, k, v, bias=bias, plan="ring")

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, bias=bias)

    assert_plan(check(fn, ref, (q, k, v), ["S(1)"] * 3, placement(4)), "ring")


def test_cross_attention_lengths():
    q, (k, v) = rand(2, 12, 4, 8), (rand(2, 20, 4, 8), rand(2, 20, 4, 8))

    def fn(q, k, v):
        return jsbp.nn.dot_product_attention(q, k, v)

    def ref(q, k, v):
        return jax.nn.dot_product_attention(q, k, v)

    check(fn, ref, (q, k, v), ["S(1)"] * 3, placement(4))


def test_long_sequence_is_not_gathered():
    """At 2k tokens over 8 devices the cost model runs the ring or the heads split, not the
    all-gather of key and value (planned only: nothing is run)."""
    shape = jax.ShapeDtypeStruct((1, 2048, 8, 64), jnp.float32)
    plc = placement(8)
    x = [jsbp.tensor(np.zeros(shape.shape, np.float32), plc, "S(1)") for _ in range(3)]

    def step(q, k, v):
        return jax.grad(
            lambda q, k, v: jnp.sum(jsbp.nn.dot_product_attention(q, k, v, is_causal=True)),
            (0, 1, 2),
        )(q, k, v)

    plan = jsbp.explain(step, *x)
    assert notes(plan) <= {"ring over 'x'", "heads split"}, notes(plan)
    assert plan.collectives()["all-gather"] == 0


def test_eager_global_tensors_and_plain_jax():
    q, k, v = qkv(2, 16, 4, 8)
    want = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    plc = placement(8)
    glob = [jsbp.tensor(a, plc, "S(1)") for a in (q, k, v)]
    got = jsbp.nn.dot_product_attention(*glob, is_causal=True)
    assert isinstance(got, jsbp.GlobalTensor)
    np.testing.assert_allclose(got.numpy(), want, **TOL)
    jitted = jax.jit(lambda q, k, v: jsbp.nn.dot_product_attention(q, k, v, is_causal=True))
    np.testing.assert_allclose(jitted(q, k, v), want, **TOL)
    batched = jax.vmap(lambda q, k, v: jsbp.nn.dot_product_attention(q, k, v))(
        q[None].repeat(3, 0), k[None].repeat(3, 0), v[None].repeat(3, 0)
    )
    np.testing.assert_allclose(batched[1], jax.nn.dot_product_attention(q, k, v), **TOL)


def test_flax_multi_head_attention_adapter():
    from flax import nnx

    def mha(fn):
        return nnx.MultiHeadAttention(
            num_heads=4, in_features=32, decode=False, attention_fn=fn, rngs=nnx.Rngs(0)
        )

    ours, theirs = mha(jsbp.nn.flax_attention), mha(nnx.dot_product_attention)
    x = rand(2, 12, 32)
    mask = nnx.make_causal_mask(np.ones((2, 12)))
    want = theirs(x, mask=mask)
    np.testing.assert_allclose(ours(x, mask=mask), want, **TOL)
    graphdef, state = nnx.split(ours)

    @jsbp.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x, mask=mask)

    plc = placement(4)
    state = jax.tree.map(lambda a: jsbp.tensor(np.asarray(a), plc, "B"), state)
    got = apply(state, jsbp.tensor(x, plc, "S(1)"))
    np.testing.assert_allclose(got.numpy(), want, **TOL)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (((2, 8, 4), (2, 8, 4, 8), (2, 8, 4, 8)), {}, "4-d"),
        (((2, 8, 3, 8), (2, 8, 2, 8), (2, 8, 2, 8)), {}, "multiple of the key/value heads"),
        (((2, 8, 4, 8),) * 3, {"plan": "flash"}, "plan='flash'"),
        (((2, 8, 4, 8),) * 3, {"mask": np.ones((2, 4, 8, 8), np.float32)}, "boolean"),
        (((2, 8, 4, 8),) * 3, {"bias": np.ones((3, 4, 8, 8), np.float32)}, "does not broadcast"),
    ],
)
def test_bad_input_is_named(args, kwargs, match):
    with pytest.raises(jsbp.SbpError, match=match) as e:
        jsbp.nn.dot_product_attention(*(np.zeros(s, np.float32) for s in args), **kwargs)
    assert "jsbp.nn.dot_product_attention" in str(e.value)
