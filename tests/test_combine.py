"""Combined collectives and the order a program runs in (``jsbp/_combine.py``).

The combining pass decides which conversions run as one collective and in which order the
program's steps and those collectives run (``Program.order``); the emitter runs that order. Each
test checks the order is a valid schedule of the program's data (every value made before it is
read, every group after its members' operands and before its readers), the values against NumPy,
and the compiled collectives against ``explain``.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore

import jsbp

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
R24 = jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("dp", "tp"))
RNG = np.random.default_rng(0)


def _addends(shape, plc):
    """A P global tensor with a different random addend on every device, and its value."""
    locs = [RNG.standard_normal(shape).astype(np.float32) for _ in range(plc.size)]
    return jsbp.from_local(locs, placement=plc, sbp=("P",) * plc.ndim), sum(
        np.asarray(x, np.float64) for x in locs
    )


def _check_order(prog):
    """``prog.order`` runs every top-level step once, each after the steps making its operands and
    the groups whose results it reads; each group after the steps making its members' operands.
    Returns the number of groups."""
    order = prog.order
    assert order is not None
    at = {item: i for i, item in enumerate(order)}
    assert len(at) == len(order)
    assert sorted(k for kind, k in order if kind == "step") == list(range(len(prog.steps)))
    made = {}
    for k, st in enumerate(prog.steps):
        for v in st.eqn.outvars:
            if not isinstance(v, jcore.DropVar):
                made[v] = at[("step", k)]
    members: dict = {}
    for k, st in enumerate(prog.steps):
        here = at[("step", k)]
        for v in st.eqn.invars:
            if not isinstance(v, jcore.Literal) and v in made:
                assert made[v] < here, (st.eqn, "reads a value made later")
        for bx in st.boxings:
            if bx.group is not None:
                assert at[("group", bx.group)] < here, (
                    st.eqn,
                    "reads its group's result before it runs",
                )
                members.setdefault(bx.group, []).append(st.eqn.invars[bx.operand])
    for bx in prog.out_boxings:
        if bx.group is not None:
            members.setdefault(bx.group, []).append(prog.jaxpr.outvars[bx.operand])
    for g, vs in members.items():
        for v in vs:
            if v in made:
                assert made[v] < at[("group", g)], (g, "runs before a member's operand is made")
    assert {k for kind, k in order if kind == "group"} == set(members)
    return len(members)


@pytest.mark.parametrize("plc", [P4, R24], ids=["4", "2x4"])
def test_gradients_read_whole_run_as_one_collective_in_a_valid_order(plc):
    """Partial sums read whole by ops that can wait (an optimizer's ``g * g``) and one made from a
    result of the group (it must run after it): the order holds the group before its readers, the
    values are NumPy's and the compiled program has the collectives ``explain`` lists."""
    (g1, r1), (g2, r2), (g3, r3) = (_addends(s, plc) for s in [(8, 4), (4,), (8, 8)])
    xv = RNG.standard_normal((8, 4)).astype(np.float32)
    x = jsbp.tensor(xv, placement=plc, sbp=("S(0)",) + ("B",) * (plc.ndim - 1))

    def f(g1, g2, g3, x):
        out = [g1 * g1, jnp.tanh(g2), jnp.tanh(g3.T)]
        late = (x * out[0].sum()).sum(0)  # made from the group's result: converted after it
        return (*out, jnp.tanh(late))

    args = (g1, g2, g3, x)
    jf = jsbp.jit(f)
    got = jf(*args)
    refs = [r1 * r1, np.tanh(r2), np.tanh(r3.T)]
    refs.append(np.tanh((xv * refs[0].sum()).sum(0)))
    for o, ref in zip(got, refs):
        np.testing.assert_allclose(o.numpy(), ref, rtol=1e-5, atol=1e-5)
    prog = jf.lower_program(*args).program
    plan = jsbp.explain(f, *args)
    groups = _check_order(prog)
    assert groups == len({b.combined for b in plan.boxings() if b.combined is not None}), str(plan)
    assert jsbp.debug.count_collectives(jf, *args) == plan.collectives()
    if plc is P4:  # the three partial sums' all-reduces: one collective
        assert groups == 1 and sum(b.combined is not None for b in plan.boxings()) == 3, str(plan)


def test_a_program_without_combined_collectives_runs_step_by_step():
    """Nothing to combine: the order is the program's own."""
    x = jsbp.tensor(RNG.standard_normal((8, 4)).astype(np.float32), placement=P4, sbp="S(0)")
    jf = jsbp.jit(lambda x: jnp.tanh(x).sum(0))
    prog = jf.lower_program(x).program
    assert prog.order == [("step", k) for k in range(len(prog.steps))]
    np.testing.assert_allclose(jf(x).numpy(), np.tanh(x.numpy()).sum(0), rtol=1e-5, atol=1e-5)


def test_a_data_parallel_train_step_runs_its_order():
    """An MLP's data-parallel SGD step: the gradients' all-reduces run as one collective, placed
    after every gradient is made and before the first update reads one. Parameters after one
    step as plain JAX's on one device."""
    import jax

    ws = [RNG.standard_normal(s).astype(np.float32) * 0.3 for s in [(6, 16), (16,), (16, 3), (3,)]]
    xv = RNG.standard_normal((16, 6)).astype(np.float32)
    yv = RNG.standard_normal((16, 3)).astype(np.float32)

    def loss(params, x, y):
        w1, b1, w2, b2 = params
        h = jnp.tanh(x @ w1 + b1)
        return jnp.mean((h @ w2 + b2 - y) ** 2)

    def step(params, x, y):
        g = jax.grad(loss)(params, x, y)
        return [p - 0.1 * gi for p, gi in zip(params, g)]

    params = [jsbp.tensor(w, placement=P4, sbp="B") for w in ws]
    x = jsbp.tensor(xv, placement=P4, sbp="S(0)")
    y = jsbp.tensor(yv, placement=P4, sbp="S(0)")
    jf = jsbp.jit(step, out_sbp="B")
    got = jf(params, x, y)
    want = jax.jit(step)([jnp.asarray(w) for w in ws], xv, yv)
    for o, ref in zip(got, want):
        np.testing.assert_allclose(o.numpy(), np.asarray(ref), rtol=1e-5, atol=1e-6)
    prog = jf.lower_program(params, x, y).program
    assert _check_order(prog) >= 1
    counts = jsbp.debug.count_collectives(jf, params, x, y)
    assert counts == jsbp.explain(jf, params, x, y).collectives()
    assert counts["all-reduce"] == 1, counts


def test_a_global_norm_of_reduced_gradients_is_not_priced_as_their_collective():
    """``optax.clip_by_global_norm`` under data parallelism: the squares of the all-reduced
    gradients could be summed on slices and their partial sums all-reduced, but that all-reduce
    reads the gradients' one and cannot join it: the cost model prices it as a second collective,
    so the plan sums the squares whole and runs one all-reduce. Parameters as plain JAX's."""
    import jax
    import optax

    shapes = [(64, 128), (128, 64), (64, 64), (64,), (64, 256), (256, 64)]
    ws = [RNG.standard_normal(s).astype(np.float32) * 0.1 for s in shapes]
    xv = RNG.standard_normal((512, 64)).astype(np.float32)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))

    def loss(ws, x):
        a, b, c, s, d, e = ws
        h = (jnp.tanh(x @ a) @ b @ c) * s
        return jnp.mean((jax.nn.relu(h @ d) @ e) ** 2)

    def step(ws, x):
        g = jax.grad(loss)(ws, x)
        u, _ = tx.update(g, tx.init(ws), ws)
        return optax.apply_updates(ws, u)

    P8 = jsbp.placement("cpu", list(range(8)))
    params = [jsbp.tensor(w, placement=P8, sbp="B") for w in ws]
    x = jsbp.tensor(xv, placement=P8, sbp="S(0)")
    jf = jsbp.jit(step, out_sbp="B")
    want = jax.jit(step)([jnp.asarray(w) for w in ws], xv)
    for o, ref in zip(jf(params, x), want):
        np.testing.assert_allclose(o.numpy(), np.asarray(ref), rtol=1e-5, atol=1e-6)
    counts = jsbp.debug.count_collectives(jf, params, x)
    assert counts == jsbp.explain(jf, params, x).collectives()
    assert counts["all-reduce"] == 1 and sum(counts.values()) == 1, counts


def test_a_branchs_inputs_gathered_before_it_run_as_one_collective():
    """A ``cond`` cannot wait for a collective, but the conversions of its own operands run right
    before it, together: two split operands both branches read whole (a sort along the split dim)
    are gathered by one combined all-gather. Values as NumPy's for both predicates; the order is a
    valid schedule and the compiled program has the one collective ``explain`` lists."""
    from jax import lax

    av, bv = (RNG.standard_normal(8).astype(np.float32) for _ in range(2))
    a, b = (jsbp.tensor(v, placement=P4, sbp="S(0)") for v in (av, bv))

    def f(p, a, b):
        def yes(a, b):
            return jnp.sort(a) * jnp.sort(b)[0]

        def no(a, b):
            return jnp.sort(b) - jnp.sort(a)[-1]

        return lax.cond(p > 0, yes, no, a, b)

    jf = jsbp.jit(f, out_sbp="B")
    for pv, want in ((1.0, np.sort(av) * np.sort(bv)[0]), (-1.0, np.sort(bv) - np.sort(av)[-1])):
        p = jsbp.tensor(np.float32(pv), placement=P4, sbp="B")
        np.testing.assert_allclose(jf(p, a, b).numpy(), want, rtol=1e-6)
    plan = jsbp.explain(jf, p, a, b)
    gathers = [x for x in plan.boxings() if x.collectives == ("all-gather",)]
    assert len(gathers) == 2 and all(x.combined is not None for x in gathers), str(plan)
    assert _check_order(jf.lower_program(p, a, b).program) == 1
    counts = jsbp.debug.count_collectives(jf, p, a, b)
    assert counts == plan.collectives() and counts["all-gather"] == 1, (counts, str(plan))


def _slicing_computations(hlo: str) -> int:
    """How many computations of an optimized HLO module hold a ``slice``."""
    count, cur = 0, False
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            cur = False
        elif " slice(" in line and not cur:
            count, cur = count + 1, True
    return count


def test_a_combined_collectives_pieces_of_one_shape_are_cut_in_one_place():
    """Six equal layers' gradients all-reduced as one collective, each read by an Adam-like update:
    the pieces of one shape are cut by one kernel, so the six updates compile to one (XLA compiles
    a kernel per distinct fusion; slices at six offsets inside them made six). Values as one
    device, one all-reduce, as ``explain`` lists."""
    import jax

    ws = [RNG.standard_normal((8, 8)).astype(np.float32) * 0.3 for _ in range(6)]
    ms = [np.zeros((8, 8), np.float32) for _ in ws]
    xv = RNG.standard_normal((16, 8)).astype(np.float32)

    def step(params, moments, x):
        def loss(params):
            h = x
            for w in params:
                h = jnp.tanh(h @ w)
            return jnp.mean(h**2)

        g = jax.grad(loss)(params)
        moments = [0.9 * m + 0.1 * gi * gi for m, gi in zip(moments, g)]
        params = [p - 0.01 * gi / (jnp.sqrt(m) + 1e-8) for p, gi, m in zip(params, g, moments)]
        return params, moments

    params = [jsbp.tensor(w, placement=P4, sbp="B") for w in ws]
    moments = [jsbp.tensor(m, placement=P4, sbp="B") for m in ms]
    x = jsbp.tensor(xv, placement=P4, sbp="S(0)")
    jf = jsbp.jit(step, out_sbp="B")
    got = jf(params, moments, x)
    want = jax.jit(step)([jnp.asarray(w) for w in ws], [jnp.asarray(m) for m in ms], xv)
    for o, ref in zip([*got[0], *got[1]], [*want[0], *want[1]]):
        np.testing.assert_allclose(o.numpy(), np.asarray(ref), rtol=1e-5, atol=1e-6)
    counts = jsbp.debug.count_collectives(jf, params, moments, x)
    assert counts == jsbp.explain(jf, params, moments, x).collectives()
    assert counts["all-reduce"] == 1 and sum(counts.values()) == 1, counts
    hlo = jf.lower(params, moments, x).compile().as_text()
    assert _slicing_computations(hlo) == 1, hlo


_MOVES = {"parameter", "constant", "slice", "bitcast", "bitcast-convert", "reshape", "pad"}
_MOVES |= {"concatenate", "copy", "transpose", "broadcast", "reduce", "tuple", "get-tuple-element"}


def _reader_ops(hlo: str, name: str) -> list[set[str]]:
    """Per instruction of an optimized HLO module's entry computation that reads ``%name``, the
    ops it runs (a fusion's: its fused computation's)."""
    bodies, cur = {}, None
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):
            cur = bodies.setdefault(line.split()[0].lstrip("%"), [])
        elif cur is not None:
            cur.append(line)
    ops = lambda line: set(re.findall(r"= \S+ ([a-z][\w\-]*)\(", line))
    out = []
    for line in hlo[hlo.index("\nENTRY") :].splitlines():
        if re.search(rf"[(,] ?%{re.escape(name)}[,)]", line):
            called = re.search(r"calls=%([\w.\-]+)", line)
            out.append(set().union(*map(ops, bodies[called.group(1)])) if called else ops(line))
    return out


def test_a_combined_all_gather_cuts_every_piece_before_its_readers():
    """ZeRO-3's forward: weights and biases of distinct shapes held split, gathered whole by one
    all-gather before the layer. An all-gather's pieces are strided blocks of its result (one per
    device); read in place they slow their readers (XLA:CPU's dots leave their fast path), so each
    piece, alone in its shape too, is cut by the cutting kernel: nothing else reads the gathered
    buffer. Values as one device, one all-gather, as ``explain`` lists."""
    import jax

    shapes = [(8, 16), (16,), (16, 12), (12,)]
    vals = [RNG.standard_normal(s).astype(np.float32) * 0.3 for s in shapes]
    xv = RNG.standard_normal((16, 8)).astype(np.float32)

    def forward(w1, b1, w2, b2, x):
        w1, b1, w2, b2 = (jsbp.to_global(p, sbp="B") for p in (w1, b1, w2, b2))
        return jnp.tanh(x @ w1 + b1) @ w2 + b2

    params = [jsbp.tensor(v, placement=P4, sbp="S(0)") for v in vals]
    x = jsbp.tensor(xv, placement=P4, sbp="S(0)")
    jf = jsbp.jit(forward)
    got = jf(*params, x)
    want = jax.jit(forward)(*vals, xv)
    np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-5, atol=1e-6)
    counts = jsbp.debug.count_collectives(jf, *params, x)
    assert counts == jsbp.explain(jf, *params, x).collectives()
    assert counts["all-gather"] == 1 and sum(counts.values()) == 1, counts
    hlo = jf.lower(*params, x).compile().as_text()
    (gathered,) = re.findall(r"%(\S+) = \S+ all-gather\(", hlo)
    readers = _reader_ops(hlo, gathered)
    assert readers and all(ops <= _MOVES for ops in readers), (readers, hlo)


def test_a_combined_all_gathers_pieces_keep_every_bit():
    """Values gathered by one combined all-gather come out bit for bit: signed zeros, a
    subnormal, NaN and infinities of float32 and bfloat16, booleans and integers."""
    special = [-0.0, 0.0, 1e-40, np.nan, np.inf, -np.inf, 1.5, -2.25]
    cases = [
        np.array(special * 2, np.float32).reshape(4, 4),
        np.array(special[::-1] * 2, np.float32).reshape(4, 4),
        np.array(special * 2, jnp.bfloat16).reshape(4, 4),
        np.array(special[::-1] * 2, jnp.bfloat16).reshape(4, 4),
        RNG.integers(-5, 5, (4, 4)).astype(np.int32),
        RNG.integers(-5, 5, (4, 4)).astype(np.int32),
        RNG.random((4, 4)) > 0.5,
        RNG.random((4, 4)) > 0.5,
    ]
    xs = [jsbp.tensor(c, placement=P4, sbp="S(0)") for c in cases]
    jf = jsbp.jit(lambda *xs: [x for x in xs], out_sbp="B")
    got = jf(*xs)
    for o, c in zip(got, cases):
        assert o.numpy().dtype == c.dtype
        assert o.numpy().tobytes() == c.tobytes(), (c.dtype, o.numpy(), c)
    counts = jsbp.debug.count_collectives(jf, *xs)
    assert counts == jsbp.explain(jf, *xs).collectives()
