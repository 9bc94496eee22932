"""Property tests (hypothesis): any input layouts on any placement give the one-device result."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jsbp

PLACEMENTS = [
    jsbp.placement("cpu", [0, 1, 2, 3]),
    jsbp.placement("cpu", [0, 1, 2]),
    jsbp.placement("cpu", [[0, 1], [2, 3]]),
    jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    jsbp.placement("cpu", [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]),
]

PROGRAMS = {
    "mlp": (lambda x, w: jnp.tanh(x @ w).sum(0), lambda m, k, n: [(m, k), (k, n)]),
    "softmax_matmul": (
        lambda x, w: jax.nn.softmax(x @ w, axis=-1),
        lambda m, k, n: [(m, k), (k, n)],
    ),
    "norm": (lambda x, w: (x - x.mean(0)) / (x.std(0) + 1.0) @ w, lambda m, k, n: [(m, k), (k, n)]),
    "max_argmax": (
        lambda x, w: (x.max(1), jnp.argmax(x @ w, axis=0)),
        lambda m, k, n: [(m, k), (k, n)],
    ),
    "grad": (
        lambda x, w: jax.grad(lambda w: jnp.sum(jnp.sin(x @ w)))(w),
        lambda m, k, n: [(m, k), (k, n)],
    ),
    "reshape_t": (
        lambda x, w: (x.T @ x).reshape(-1) * 2.0 + w.sum(),
        lambda m, k, n: [(m, k), (k, n)],
    ),
}

SBP = st.sampled_from(["S(0)", "S(1)", "B", "P"])


@st.composite
def cases(draw):
    plc = draw(st.sampled_from(PLACEMENTS))
    name = draw(st.sampled_from(sorted(PROGRAMS)))
    m, k, n = draw(st.integers(1, 9)), draw(st.integers(1, 7)), draw(st.integers(1, 6))
    lays = [tuple(draw(SBP) for _ in range(plc.ndim)) for _ in range(2)]
    seed = draw(st.integers(0, 2**16))
    return plc, name, (m, k, n), lays, seed


def _to_np(tree):
    return [
        np.asarray(t.numpy())
        for t in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))
    ]


@settings(
    max_examples=int(__import__("os").environ.get("JSBP_HYPOTHESIS_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cases())
def test_any_layouts_match_one_device(case):
    plc, name, dims, lays, seed = case
    fn, shapes = PROGRAMS[name]
    rng = np.random.default_rng(seed)
    vals = [rng.standard_normal(s).astype(np.float32) for s in shapes(*dims)]
    args = [jsbp.tensor(v, plc, lay) for v, lay in zip(vals, lays)]
    ref = [np.asarray(r) for r in jax.tree_util.tree_leaves(fn(*[jnp.asarray(v) for v in vals]))]
    out = _to_np(jsbp.jit(fn)(*args))
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        np.testing.assert_allclose(o, r, rtol=2e-4, atol=2e-4)
    plan = jsbp.explain(fn, *args).collectives()
    compiled = jsbp.debug.count_collectives(jsbp.jit(fn), *args)
    # no hidden communication: XLA never runs a collective the plan does not list
    assert all(compiled[k] <= plan[k] for k in plan), (plan, compiled)
    if min(dims) >= plc.size:  # on degenerate shapes XLA may delete collectives of trivial size
        assert plan == compiled


# combined collectives: conversions interleaved with reads --------------------------------------

_CONVERSIONS = {  # kind -> (the operand's SBP, the annotation's SBP, the collective)
    "AR": ("P", "B", "all-reduce"),
    "RS": ("P", "S(0)", "reduce-scatter"),
    "AG": ("S(0)", "B", "all-gather"),
}


@st.composite
def interleavings(draw):
    plc = draw(st.sampled_from(PLACEMENTS[:1] + [jsbp.placement("cpu", list(range(8)))]))
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(sorted(_CONVERSIONS)), st.booleans(), st.booleans(), st.booleans()
            ),
            min_size=2,
            max_size=7,
        )
    )
    return plc, ops, draw(st.integers(0, 2**16))


@settings(
    max_examples=int(__import__("os").environ.get("JSBP_HYPOTHESIS_EXAMPLES", "10")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(interleavings())
def test_combined_collectives_run_each_group_when_first_needed(case):
    """Conversions (P -> B, P -> S, S -> B), each read (by ``tanh``, which can wait) or only
    returned, some transposed on the way, some *needed* at once (``tanh``'s result converted again,
    locally, to ``P``): the values are NumPy's, and the compiled program runs one collective per
    kind: every conversion reads an input, so each one can run in its kind's group, which runs
    when the first of its results is needed (``jsbp._combine``)."""
    plc, ops, seed = case
    rng = np.random.default_rng(seed)
    n = plc.size
    args, refs = [], []
    for kind, _, _, _ in ops:
        src = _CONVERSIONS[kind][0]
        if src == "P":
            locs = [rng.standard_normal((2 * n, 4)).astype(np.float32) for _ in range(n)]
            args.append(jsbp.from_local(locs, placement=plc, sbp="P"))
            refs.append(np.sum(locs, axis=0))
        else:
            v = rng.standard_normal((2 * n, 4)).astype(np.float32)
            args.append(jsbp.tensor(v, plc, src))
            refs.append(v)

    def f(*xs):
        outs = []
        for x, (kind, read, flip, need) in zip(xs, ops):
            y = jsbp.to_global(x, sbp=_CONVERSIONS[kind][1])
            y = y.T if flip else y
            y = jnp.tanh(y) if read or need else y
            outs.append(jsbp.to_global(y, sbp="P") if need else y)  # B / S -> P: local, at once
        return outs

    want = []
    for r, (_, read, flip, need) in zip(refs, ops):
        r = r.T if flip else r
        want.append(np.tanh(r) if read or need else r)
    got = jsbp.jit(f)(*args)
    for o, w in zip(got, want):
        np.testing.assert_allclose(o.numpy(), w, rtol=1e-5, atol=1e-5)
    # the groups: one per kind of conversion
    expected = dict.fromkeys((c for _, _, c in _CONVERSIONS.values()), 0)
    for kind in {kind for kind, _, _, _ in ops}:
        expected[_CONVERSIONS[kind][2]] += 1
    plan = jsbp.explain(f, *args).collectives()
    compiled = jsbp.debug.count_collectives(jsbp.jit(f), *args)
    assert compiled == plan and {k: plan[k] for k in expected} == expected, (ops, plan, expected)
