"""The planning problem built from the jaxpr (``jsbp/_problem.py``), its solvers (``_solve``) and
its lowering to a program (``_lower``).

The exact solver is checked against every assignment of small problems; programs planned through
the problem run under ``jsbp.jit`` (its planner swapped for ``_lower.plan``) and their values are
compared with one device, their compiled collectives with ``explain``.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp import _jit, _lower, _problem, _solve

P4 = jsbp.placement("cpu", [0, 1, 2, 3])
R22 = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
RNG = np.random.default_rng(0)


def rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _problem_of(fn, *args, out_sbp=None):
    """The planning problem ``jsbp.jit(fn, out_sbp=...)`` would solve for ``args``."""
    return _problem_of_jitted(jsbp.jit(fn, out_sbp=out_sbp), *args)


def _problem_of_jitted(jitted, *args):
    """The planning problem a ``jsbp.jit`` function would solve for ``args``."""
    got = {}

    def spy(placement, jaxpr, consts, in_layouts, out_nd=None, *, strict=False):
        got["prob"] = _problem.build(placement, _lower._dce(jaxpr), consts, in_layouts, out_nd)
        return _lower.plan(placement, jaxpr, consts, in_layouts, out_nd, strict=strict)

    orig = _jit.plan
    _jit.plan = spy
    try:
        jitted.lower_program(*args)
    finally:
        _jit.plan = orig
    return got["prob"]


_SMALL = {  # name: (fn, argument shapes, placement, input nd-sbps, out_sbp)
    "matmul_tanh": (lambda x, w: jnp.tanh(x @ w), [(8, 6), (6, 4)], P4, ["S(0)", "S(1)"], None),
    "mlp_row_col": (
        lambda x, a, b: jnp.tanh(x @ a) @ b,
        [(8, 6), (6, 8), (8, 4)],
        P4,
        ["B", "S(1)", "S(0)"],
        "B",
    ),
    "sum_then_scale": (
        lambda x, y: (x * y).sum(0) * 2.0,
        [(8, 4), (8, 4)],
        P4,
        ["S(0)", "S(1)"],
        None,
    ),
    "2d_matmul": (
        lambda x, w: (x @ w).sum(1),
        [(8, 4), (4, 6)],
        R22,
        [("S(0)", "B"), ("B", "S(1)")],
        None,
    ),
}


@pytest.mark.parametrize("name", list(_SMALL))
def test_exact_solver_finds_the_least_cost_of_every_assignment(name):
    """Small programs: the MILP's answer and elimination's (its core solved exactly, then local
    search) cost what the best of all assignments costs (``Problem.cost``: conversions, work, and
    one latency per combined collective of the deferrable values)."""
    fn, shapes, plc, nds, out_sbp = _SMALL[name]
    args = [jsbp.tensor(rand(*s), placement=plc, sbp=nd) for s, nd in zip(shapes, nds)]
    prob = _problem_of(fn, *args, out_sbp=out_sbp)
    sizes = [len(n.cands) for n in prob.nodes]
    assert 0 < np.prod(sizes, dtype=float) <= 200_000, sizes
    best = min(prob.cost(list(c)) for c in itertools.product(*(range(k) for k in sizes)))
    exact = _solve.exact(prob)
    assert exact is not None
    assert prob.cost(exact) == pytest.approx(best, rel=1e-9, abs=1e-6)
    eliminated = _solve.local_search(prob, _solve.eliminate(prob))
    assert prob.cost(eliminated) == pytest.approx(best, rel=1e-9, abs=1e-6)


def _pairwise_cost(core, unary, adj, choice):
    return sum(unary[u][choice[u]] for u in core) + sum(
        m[choice[u], choice[w]] for u in core for w, m in adj[u].items() if u < w
    )


@pytest.mark.parametrize("case", ["frustrated_triangle", "random_4_nodes", "agreeing_cycle"])
def test_the_core_solver_finds_the_optimum_whether_or_not_its_relaxation_is_integral(case):
    """``_core.exact_core`` takes the linear relaxation's answer only where it is integral: on an
    odd cycle whose edges all charge agreement the relaxation is fractional (every candidate at
    one half, cost 0) and the MILP must run; the answer costs what the best assignment does."""
    from jsbp import _core

    rng = np.random.default_rng(0)
    if case == "random_4_nodes":
        core, k = [0, 1, 2, 3], 3
        unary = [rng.uniform(0, 1, k) for _ in core]
        pairs = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2), (1, 3)]
        mats = {e: rng.uniform(0, 2, (k, k)) for e in pairs}
    else:
        core, k = [0, 1, 2], 2
        unary = [np.zeros(k) for _ in core]
        agree = np.eye(k) if case == "frustrated_triangle" else 1.0 - np.eye(k)
        mats = {e: agree for e in [(0, 1), (1, 2), (0, 2)]}
    adj = [{} for _ in core]
    for (u, w), m in mats.items():
        adj[u][w], adj[w][u] = m, m.T
    best = min(
        _pairwise_cost(core, unary, adj, c) for c in itertools.product(range(k), repeat=len(core))
    )
    got = _core.exact_core(core, unary, adj)
    assert got is not None
    assert _pairwise_cost(core, unary, adj, got) == pytest.approx(best)
    if case == "frustrated_triangle":
        assert best == pytest.approx(1.0)  # (the relaxation's optimum is 0)


def test_the_core_solver_warm_from_the_last_core_still_finds_each_optimum():
    """``exact_core`` through one ``warm`` dict: a core of the same shape with other costs starts
    from the last one's optimal basis, and each answer costs what the best assignment does, where
    the relaxation is integral (random costs) and where it is not (a frustrated triangle: the
    MILP runs); a core of another shape is solved from scratch."""
    from jsbp import _core

    rng = np.random.default_rng(1)
    core, k = [0, 1, 2, 3], 3
    pairs = [(0, 1), (1, 2), (2, 3), (3, 0), (0, 2)]
    warm: dict = {}
    for trial in range(6):
        unary = [rng.uniform(0, 1, k) for _ in core]
        mats = {e: rng.uniform(0, 2, (k, k)) for e in pairs}
        if trial == 3:  # all-agreeing edges around the triangle 0-1-2: fractional relaxation
            unary = [np.zeros(k) for _ in core]
            mats = {e: (np.eye(k) if 3 not in e else np.zeros((k, k))) for e in pairs}
        adj = [{} for _ in core]
        for (u, w), m in mats.items():
            adj[u][w], adj[w][u] = m, m.T
        got = _core.exact_core(core, unary, adj, warm=warm)
        assert got is not None
        best = min(
            _pairwise_cost(core, unary, adj, c)
            for c in itertools.product(range(k), repeat=len(core))
        )
        assert _pairwise_cost(core, unary, adj, got) == pytest.approx(best)
        assert len(warm) == 1  # the last linear program, kept for the next
    unary = [np.array([0.0, 1.0]), np.array([1.0, 0.0])]
    smaller = _core.exact_core([0, 1], unary, [{1: np.eye(2)}, {0: np.eye(2)}], warm=warm)
    assert smaller == {0: 0, 1: 1}  # the only assignment of cost 0


def _frustrated_core(n: int, k: int, seed: int):
    """A pairwise core of ``n`` nodes, ``k`` candidates each, random costs whose edges charge
    agreement (``seed`` 5 with 8 nodes: the MILP needs 3 branch-and-bound nodes)."""
    rng = np.random.default_rng(seed)
    core = list(range(n))
    unary = [rng.random(k) for _ in core]
    adj = [{} for _ in core]
    for u in core:
        for w in map(int, rng.choice(n, 3, replace=False)):
            if w != u and w not in adj[u]:
                m = rng.random((k, k)) * 3 + 2 * np.eye(k)
                adj[u][w], adj[w][u] = m, m.T
    return core, unary, adj


def test_the_solvers_limits_count_work_not_seconds(monkeypatch):
    """HiGHS stops after ``MIP_NODE_LIMIT`` branch-and-bound nodes or ``LP_ITERATION_LIMIT``
    simplex iterations, not after a time: the same problem gets the same answer however busy the
    machine is (every process of a multi-process run plans alike). A core whose MILP needs three
    nodes: solved exactly under the default limits, no answer under a limit of one node (min-sum
    decides then); its relaxation under a limit of five iterations: no answer (the MILP then
    solves it)."""
    from jsbp import _core

    core, unary, adj = _frustrated_core(8, 3, seed=5)
    best = min(
        _pairwise_cost(core, unary, adj, c) for c in itertools.product(range(3), repeat=len(core))
    )
    for _ in range(2):  # the same answer both times
        got = _core.exact_core(core, unary, adj)
        assert got is not None
        assert _pairwise_cost(core, unary, adj, got) == pytest.approx(best)
    monkeypatch.setattr(_core, "MIP_NODE_LIMIT", 1)
    assert _core.exact_core(core, unary, adj) is None
    monkeypatch.setattr(_core, "MIP_NODE_LIMIT", 100)
    monkeypatch.setattr(_core, "LP_ITERATION_LIMIT", 5)
    answers = []
    milp = _core.milp

    def spy(*args, **kwargs):
        answers.append((kwargs.get("integral") is not None, milp(*args, **kwargs)))
        return answers[-1][1]

    monkeypatch.setattr(_core, "milp", spy)
    got = _core.exact_core(core, unary, adj)
    assert [(mip, x is None) for mip, x in answers] == [(False, True), (True, False)]
    assert _pairwise_cost(core, unary, adj, got) == pytest.approx(best)


_PLAN_IN_A_PROCESS = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np, jsbp
from jsbp import sbp as S
plc = jsbp.placement("cpu", np.arange(8).reshape(2, 4), axis_names=("dp", "tp"))
rng = np.random.default_rng(0)
x = jsbp.tensor(rng.normal(size=(16, 32)).astype("float32"), placement=plc, sbp=(S.split(0), S.broadcast))
w1 = jsbp.tensor(rng.normal(size=(32, 64)).astype("float32"), placement=plc, sbp=(S.broadcast, S.split(1)))
w2 = jsbp.tensor(rng.normal(size=(64, 32)).astype("float32"), placement=plc, sbp=(S.broadcast, S.split(0)))
def loss(w1, w2, x):
    h = jax.nn.gelu(x @ w1)
    y = jax.nn.softmax(h @ w2, axis=-1)
    return jnp.mean((y - x) ** 2) + 1e-3 * (jnp.sum(w1 * w1) + jnp.sum(w2 * w2))
step = jsbp.jit(lambda w1, w2, x: jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x))
print(jsbp.explain(step, w1, w2, x))
"""


def _stdout_of_a_fresh_process(code: str, **env) -> str:
    """What ``python -c code`` prints, run in a new process (``env`` added to this one's)."""
    import os
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return run.stdout


def test_two_processes_plan_the_same_program():
    """Every process of a multi-process run plans its program on its own, so the plan must not
    depend on anything that differs between processes: string hashing (``PYTHONHASHSEED``),
    object ids, the clock. A data × tensor parallel training step planned in two fresh processes
    with different hash seeds: the same plan, op by op."""
    plans = [
        _stdout_of_a_fresh_process(_PLAN_IN_A_PROCESS, PYTHONHASHSEED=seed, JAX_PLATFORMS="cpu")
        for seed in ("1", "2")
    ]
    assert "collective" in plans[0] and "dot_general" in plans[0]
    assert plans[0] == plans[1]


def test_the_solver_prints_nothing():
    """highspy's first solver of a process writes a banner to the standard output; jsbp's is made
    silent (a fresh process, so that this one's earlier solves do not hide it)."""
    code = (
        "import numpy as np; from jsbp import _core; "
        "x = _core.milp([1.0, 2.0], [0, 0], [0, 1], [1.0, 1.0], [1.0], [1.0], "
        "integral=np.array([True, True])); print(int(round(x[0])), int(round(x[1])))"
    )
    out = _stdout_of_a_fresh_process(code)
    assert out == "1 0\n", out


def _run_and_check(fn, args, ref, out_sbp=None, rtol=1e-5, atol=1e-5):
    jf = jsbp.jit(fn, out_sbp=out_sbp)
    got = jf(*args)
    leaves = jax.tree_util.tree_leaves(got, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor))
    for o, r in zip(leaves, jax.tree_util.tree_leaves(ref)):
        np.testing.assert_allclose(o.numpy(), np.asarray(r), rtol=rtol, atol=atol)
    assert jsbp.debug.count_collectives(jf, *args) == jsbp.explain(jf, *args).collectives()


@pytest.mark.parametrize("plc", [P4, R22], ids=["4", "2x2"])
def test_planned_programs_match_one_device(plc):
    """An MLP, a helper called twice (inlined twice: two scopes of one jaxpr), literals, a layout
    request and an output asked replicated: values as plain JAX's on one device."""
    xv, w1v, w2v = rand(8, 6), rand(6, 8), rand(8, 4)
    first = ("S(0)",) + ("B",) * (plc.ndim - 1)
    x = jsbp.tensor(xv, placement=plc, sbp=first)
    w1 = jsbp.tensor(w1v, placement=plc, sbp=("B",) * (plc.ndim - 1) + ("S(1)",))
    w2 = jsbp.tensor(w2v, placement=plc, sbp=("B",) * (plc.ndim - 1) + ("S(0)",))

    @jax.jit
    def layer(h, w):
        return jnp.tanh(h @ w) + 1.0

    def f(x, w1, w2):
        h = layer(x, w1)
        h = jsbp.to_global(h, sbp=("B",) * plc.ndim)
        y = layer(h, w1.T @ w1 * 0.1)
        return (y @ w2).sum(0), y.max()

    def ref(x, w1, w2):
        h = jnp.tanh(x @ w1) + 1.0
        y = jnp.tanh(h @ (w1.T @ w1 * 0.1)) + 1.0
        return (y @ w2).sum(0), y.max()

    _run_and_check(f, (x, w1, w2), ref(xv, w1v, w2v), out_sbp=("B",) * plc.ndim)


def test_a_data_parallel_train_step_matches_one_device(monkeypatch):
    """An MLP's SGD step (``jax.grad``) under data parallelism, solved by elimination (the MILP of
    the whole problem switched off): parameters after the step as plain JAX's, and the gradients'
    reductions one combined all-reduce (deferrable values: their latency is paid once)."""
    monkeypatch.setattr(_solve, "EXACT_MAX_VARS", 0)
    ws = [rand(6, 16) * 0.3, rand(16) * 0.1, rand(16, 3) * 0.3]
    xv, yv = rand(16, 6), rand(16, 3)

    def loss(params, x, y):
        w1, b1, w2 = params
        return jnp.mean((jnp.tanh(x @ w1 + b1) @ w2 - y) ** 2)

    def step(params, x, y):
        g = jax.grad(loss)(params, x, y)
        return [p - 0.1 * gi for p, gi in zip(params, g)]

    params = [jsbp.tensor(w, placement=P4, sbp="B") for w in ws]
    x = jsbp.tensor(xv, placement=P4, sbp="S(0)")
    y = jsbp.tensor(yv, placement=P4, sbp="S(0)")
    _run_and_check(
        step,
        (params, x, y),
        jax.jit(step)([jnp.asarray(w) for w in ws], xv, yv),
        out_sbp="B",
        atol=1e-6,
    )
    counts = jsbp.debug.count_collectives(jsbp.jit(step, out_sbp="B"), params, x, y)
    assert {k: v for k, v in counts.items() if v} == {"all-reduce": 1}


@pytest.mark.parametrize("plc", [P4, R22], ids=["4", "2x2"])
def test_loops_and_branches_match_one_device(plc):
    """A ``scan`` (an RNN-like carry through a split weight, scanned inputs and outputs), a
    ``fori_loop`` (a ``while``) and a ``cond``: their bodies are part of the problem; values as
    plain JAX's on one device, compiled collectives as ``explain`` lists."""
    xsv, wv, hv = rand(5, 8, 6), rand(6, 6) * 0.3, rand(8, 6)
    first = ("S(0)",) + ("B",) * (plc.ndim - 1)
    xs = jsbp.tensor(xsv, placement=plc, sbp=("B",) * (plc.ndim - 1) + ("S(2)",))
    w = jsbp.tensor(wv, placement=plc, sbp=("B",) * (plc.ndim - 1) + ("S(1)",))
    h = jsbp.tensor(hv, placement=plc, sbp=first)

    def f(xs, w, h):
        def step(c, x):
            c = jnp.tanh(c @ w + x)
            return c, c.sum(1)

        c, ys = jax.lax.scan(step, h, xs)
        d = jax.lax.fori_loop(0, 3, lambda i, d: d * 0.5 + jnp.tanh(d @ w), c)
        e = jax.lax.cond(ys.sum() > 0, lambda a: a @ w, lambda a: a * 2.0, d)
        return c, ys, e

    _run_and_check(f, (xs, w, h), jax.jit(f)(xsv, wv, hv), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sbp", ["B", "S(0)"])
def test_a_linear_solve_is_a_call_of_its_solve(sbp):
    """``custom_linear_solve`` (``jnp.linalg.solve`` and its gradient) is planned as a call of its
    ``solve`` jaxpr on the operands that jaxpr reads; values match one device."""
    av = rand(4, 4) + 4 * np.eye(4, dtype=np.float32)
    yv = rand(4, 3)
    a = jsbp.tensor(av, placement=P4, sbp="B")
    y = jsbp.tensor(yv, placement=P4, sbp=sbp)

    def f(a, y):
        return jax.grad(lambda a: (jnp.linalg.solve(a, y) ** 2).sum())(a), jnp.linalg.solve(a, y)

    _run_and_check(f, (a, y), jax.jit(f)(av, yv), rtol=1e-4, atol=1e-5)


def test_a_primitive_without_a_rule_runs_replicated_with_a_warning():
    """A primitive jsbp has no rule for (``x[::-1] * 2`` along dim 0: not elementwise) runs
    replicated, its operand gathered, with a ``NoRuleWarning``; values as one device's."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("jsbp_test_problem_no_rule")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    impl = lambda x: jnp.flip(x, 0) * 2  # noqa: E731
    prim.def_impl(impl)
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))
    xv = rand(7, 4)
    x = jsbp.tensor(xv, placement=P4, sbp="S(0)")
    with pytest.warns(jsbp.NoRuleWarning, match=r"jsbp_test_problem_no_rule.*\(7, 4\).*replicated"):
        y = jsbp.jit(lambda x: prim.bind(x * 3.0) + 1.0)(x)
    np.testing.assert_allclose(y.numpy(), np.flip(xv * 3.0, 0) * 2 + 1.0, rtol=1e-6)


def test_a_program_without_equations_is_planned():
    """A function that returns its argument (``jnp.positive``) has an empty problem; its output
    keeps the input's layout, or is converted to the one asked."""
    xv = rand(8, 4)
    x = jsbp.tensor(xv, placement=P4, sbp="S(0)")
    assert jsbp.jit(jnp.positive)(x).sbp == x.sbp
    _run_and_check(jnp.positive, (x,), xv, out_sbp="B")


def test_a_value_wanted_in_two_layouts_is_priced_as_it_is_converted():
    """A partial sum read replicated and split: the plan all-reduces it once and slices the split
    copy locally from the replicated one (its hub), and ``Problem.cost`` charges that, not an
    all-reduce plus a reduce-scatter."""
    xv, wv = rand(8, 8), rand(8, 8)
    x = jsbp.tensor(xv, placement=P4, sbp="S(1)")
    w = jsbp.tensor(wv, placement=P4, sbp="S(0)")

    def f(x, w):
        y = x @ w
        return jsbp.to_global(y, sbp="B") * 2.0, jsbp.to_global(y, sbp="S(0)") + 1.0

    prob = _problem_of(f, x, w)
    choice = _solve.solve(prob)
    (dot,) = [n for n in prob.nodes if n.eqn is not None and n.eqn.primitive.name == "dot_general"]
    y = dot.outputs[0]
    p, b, s0 = (jsbp.sbp.partial_sum,), (jsbp.sbp.broadcast,), (jsbp.sbp.split(0),)
    assert prob.layout(y, choice) == p
    assert prob.wanted(y, choice) == {b, s0}
    through_b = prob.conversion(y, p, b) + prob.conversion(y, b, s0)
    assert prob.value_cost(y, choice) == pytest.approx(through_b)
    assert through_b < prob.conversion(y, p, b) + prob.conversion(y, p, s0)
    _run_and_check(f, (x, w), (xv @ wv * 2.0, xv @ wv + 1.0))
    counts = jsbp.debug.count_collectives(jsbp.jit(f), x, w)
    assert {k: v for k, v in counts.items() if v} == {"all-reduce": 1}


def _stack(depth):
    """A train step of ``depth`` identical pre-norm residual MLP blocks, unrolled."""

    def block(h, w1, w2):
        mu = h.mean(-1, keepdims=True)
        z = (h - mu) * jax.lax.rsqrt(((h - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
        return h + jax.nn.gelu(z @ w1) @ w2

    def loss(params, x):
        for w1, w2 in params:
            x = block(x, w1, w2)
        return (x**2).mean()

    def step(params, x):
        g = jax.grad(loss)(params, x)
        return jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, params, g)

    return step


def test_repeated_layers_are_tied_to_their_first_copy():
    """An unrolled stack of identical blocks and its gradient: ``repeats`` ties the nodes of every
    block after the first (forward, backward and update) to the first block's, so elimination
    chooses once for all copies; values as one device's, collectives as ``explain`` lists."""
    depth = 5
    pv = [(rand(16, 32) * 0.2, rand(32, 16) * 0.2) for _ in range(depth)]
    xv = rand(8, 16)
    params = [
        (
            jsbp.tensor(a, placement=R22, sbp=("B", "S(1)")),
            jsbp.tensor(b, placement=R22, sbp=("B", "S(0)")),
        )
        for a, b in pv
    ]
    x = jsbp.tensor(xv, placement=R22, sbp=("S(0)", "B"))
    step = _stack(depth)
    prob = _problem_of(step, params, x)
    rep = _problem.repeats(prob.nodes)
    tied = sum(r != u for u, r in enumerate(rep))
    assert all(r <= u and rep[r] == r for u, r in enumerate(rep))
    assert all(prob.nodes[u].cands == prob.nodes[r].cands for u, r in enumerate(rep))
    assert tied >= 0.6 * len(prob.nodes), (tied, len(prob.nodes))
    ref = jax.jit(step)([tuple(map(jnp.asarray, p)) for p in pv], xv)
    _run_and_check(step, (params, x), ref, rtol=1e-4, atol=1e-5)


def _stack_problem(depth):
    params = [
        (
            jsbp.tensor(rand(16, 32) * 0.2, placement=R22, sbp=("B", "S(1)")),
            jsbp.tensor(rand(32, 16) * 0.2, placement=R22, sbp=("B", "S(0)")),
        )
        for _ in range(depth)
    ]
    return _problem_of(
        _stack(depth), params, jsbp.tensor(rand(8, 16), placement=R22, sbp=("S(0)", "B"))
    )


def test_local_search_moves_the_copies_of_a_layer_together(monkeypatch):
    """Local search moves every copy of a repeated block with its first copy, and only where the
    copies together get cheaper: from assignments where the copies agree (elimination's, and
    random ones), the cost never rises and the copies still agree. A copy is priced only after its
    first copy wanted to move: from elimination's answer few are; from a random one most are."""
    priced = []
    made = _solve._moves

    def spy(prob):
        moves, late = made(prob)

        def counted(u):
            priced.append(u)
            return moves(u)

        return counted, late

    monkeypatch.setattr(_solve, "_moves", spy)
    rng = np.random.default_rng(1)
    prob = _stack_problem(8)
    rep = _problem.repeats(prob.nodes)
    tied = sum(r != u for u, r in enumerate(rep))
    assert tied >= 0.6 * len(prob.nodes)
    starts = [_solve.eliminate(prob)]
    for _ in range(3):
        pick = [int(rng.integers(len(n.cands))) for n in prob.nodes]
        starts.append([pick[r] for r in rep])
    for k, start in enumerate(starts):
        prob.cache.pop("moves", None)
        priced.clear()
        got = _solve.local_search(prob, start)
        assert all(got[u] == got[r] for u, r in enumerate(rep))
        copies = {u for u in priced if rep[u] != u}
        assert {rep[u] for u in copies} <= set(priced)  # each after its first copy
        if k == 0:  # elimination's answer: few first copies want to move
            assert prob.cost(got) <= prob.cost(start) + 1e-6
            assert len(copies) < tied / 4, (len(copies), tied)
        else:  # a random one: many do, together
            assert prob.cost(got) < 0.5 * prob.cost(start)
            assert len(copies) > tied / 2, (len(copies), tied)


def test_a_deeper_stack_adds_no_node_to_the_solvers_model(monkeypatch):
    """benchmarks/compiler.py's DPxTP GPT train step (optax adamw) at 3 and 5 blocks: every copy
    of a block, of its gradient and of its parameters' update folds into the first copy, and the
    parameters of one layout read by copies of the same nodes share one hub, so the pairwise model
    ``eliminate`` starts from has as many nodes with a neighbour at either depth."""
    import pathlib
    import sys

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    import compiler as bc

    sys.modules.pop("planner", None)
    strat = [s for s in bc.strategies() if s.name.startswith("DPxTP")][0]

    def linked(layers):
        case = bc.Case(strat, (256, 64, 8, layers, 16, 32))
        prob = _problem_of_jitted(case.jsbp_fn(), *case.jsbp_args())
        _, adj = _solve._pairwise(prob)
        return len(prob.nodes), sum(1 for a in adj if a)

    (n3, linked3), (n5, linked5) = linked(3), linked(5)
    assert n5 > n3 + 1000, (n3, n5)
    assert linked5 == linked3, (linked3, linked5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_solvers_conversion_tables_price_every_pair_as_the_problem_does(dtype):
    """The solver's tables (one per rank, size and dtype widening, filled a block at a time from
    each pair's paths, ``_boxing.conversion_lines``) against ``Problem.conversion`` one pair at a
    time: every pair of layouts of every value of a 2-d train step, values of one rank read after
    another size's table has seen pairs with more paths, deferrable values under both pricings
    (bfloat16: partial sums priced in float32, as they run)."""
    params = [
        (
            jsbp.tensor(rand(8, 16), placement=R22, sbp=("B", "S(1)"), dtype=dtype),
            jsbp.tensor(rand(16, 8), placement=R22, sbp=("B", "S(0)"), dtype=dtype),
        )
    ]
    x = jsbp.tensor(rand(4, 6, 8), placement=R22, sbp=("S(0)", "B"), dtype=dtype)
    prob = _problem_of(_stack(1), params, x)
    tables = _solve._Tables(prob)
    per_rank = {}
    for val in prob.values:
        r = len(val.shape)
        if r not in per_rank:
            xs = [jsbp.sbp.broadcast, jsbp.sbp.partial_sum, *map(jsbp.sbp.split, range(r))]
            per_rank[r] = list(itertools.product(xs, repeat=2))
    kinds, deferrable = set(), 0
    for val in prob.values:
        lays = per_rank[len(val.shape)]
        for share in (None, 0.0) if val.deferrable else (None,):
            kind = (val.shape, val.aval.dtype, val.times, val.deferrable, val.batch, share)
            if kind in kinds:
                continue
            kinds.add(kind)
            deferrable += val.deferrable
            index, sub = tables.of(val, share)
            rows = np.array([index(nd) for nd in lays])
            want = [[prob.conversion(val, s, d, share) for d in lays] for s in lays]
            np.testing.assert_allclose(sub(rows, rows), want, rtol=1e-12, atol=1e-6)
    assert len(per_rank) >= 3 and deferrable >= 2 and len(kinds) >= 8, (per_rank, kinds)


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_a_loop_result_is_converted_once_after_the_loop(loop):
    """A partial sum accumulated in a loop's carry (the weight gradient of data-parallel steps)
    stays partial through the trips and is all-reduced once after the loop: the loop's result is
    a value of the loop's scope, its conversion priced once, not once per trip."""
    xsv = rand(6, 256, 8)
    xs = jsbp.tensor(xsv, placement=P4, sbp="S(1)")

    def f(xs):
        if loop == "scan":
            acc, _ = jax.lax.scan(lambda a, x: (a + x.T @ x, None), jnp.zeros((8, 8)), xs)
        else:
            acc = jax.lax.fori_loop(0, 6, lambda i, a: a + xs[i].T @ xs[i], jnp.zeros((8, 8)))
        return jnp.tanh(acc)

    ref = jnp.tanh(jnp.einsum("tbi,tbj->ij", xsv, xsv))
    _run_and_check(f, (xs,), ref, out_sbp="B", rtol=1e-4, atol=1e-4)
    counts = jsbp.debug.count_collectives(jsbp.jit(f, out_sbp="B"), xs)
    assert {k: v for k, v in counts.items() if v} == {"all-reduce": 1}
    assert jsbp.debug.estimate(jsbp.jit(f, out_sbp="B"), xs).collectives == 1  # not per trip


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_a_loops_inputs_are_priced_as_the_one_collective_that_gathers_them(loop):
    """Two split inputs a loop's body reads whole (a sort along the split dim) are gathered right
    before the loop, by one combined all-gather (``_combine``): ``Problem.cost`` charges that
    collective's latency once, not once per input."""
    w1v, w2v, xv = rand(8), rand(8), rand(5)
    w1, w2 = (jsbp.tensor(w, placement=P4, sbp="S(0)") for w in (w1v, w2v))
    x = jsbp.tensor(xv, placement=P4, sbp="B")

    def f(w1, w2, x):
        def step(c, xi):
            return c + jnp.sort(w1)[0] * xi + jnp.sort(w2)[-1]

        if loop == "scan":
            return jax.lax.scan(lambda c, xi: (step(c, xi), None), jnp.float32(0), x)[0]
        return jax.lax.fori_loop(0, 5, lambda i, c: step(c, x[i]), jnp.float32(0))

    prob = _problem_of(f, w1, w2, x)
    choice = _solve.solve(prob)
    ws = prob.invars[:2]
    assert all(v.deferrable for v in ws) and ws[0].batch == ws[1].batch != ()
    (group,) = set().union(*(prob.groups(v, choice) for v in ws))
    assert group[0] == "all-gather"
    latency = prob.model.latency_bytes
    each = sum(prob.value_cost(v, choice, 1.0) for v in ws)  # a whole latency each
    once = sum(prob.value_cost(v, choice, 0.0) for v in ws) + latency
    assert each - once == pytest.approx(latency)
    want = sum(np.sort(w1v)[0] * xi + np.sort(w2v)[-1] for xi in xv)
    _run_and_check(f, (w1, w2, x), want)
    assert jsbp.debug.estimate(jsbp.jit(f), w1, w2, x).collectives == 1


def test_sibling_statistics_are_priced_as_the_one_all_reduce_that_runs_them():
    """Batch statistics under data parallelism: the mean and the mean of squares of a batch-split
    activation are two partial sums of one reduction depth, first needed by the same contraction,
    so ``_combine`` all-reduces them as one collective and the problem prices them so (one
    ``Value.batch``): the plan reduces the two small statistics rather than gathering the
    activation. A layer norm's variance, made from its all-reduced mean, is a reduction deeper
    and is priced as a collective of its own."""
    P8 = jsbp.placement("cpu", list(range(8)))
    xv, wv = rand(64, 32), rand(32, 16)
    x = jsbp.tensor(xv, placement=P8, sbp="S(0)")
    w = jsbp.tensor(wv, placement=P8, sbp="B")

    def batch_norm(x, w):
        mean, mean_sq = x.mean(0), (x * x).mean(0)
        return ((x - mean) * jax.lax.rsqrt(mean_sq - mean * mean + 1e-5)) @ w

    def layer_norm(x, w):
        mean = x.mean(1, keepdims=True)
        return ((x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(1, keepdims=True) + 1e-5)) @ w

    prob = _problem_of(batch_norm, x, w)
    sums = [
        v
        for v in prob.values
        if v.producer and prob.nodes[v.producer[0]].eqn.primitive.name == "reduce_sum"
    ]
    assert len(sums) == 2 and all(v.deferrable for v in sums) and sums[0].batch == sums[1].batch
    ln = _problem_of(layer_norm, jsbp.tensor(xv, placement=P8, sbp="S(1)"), w)
    ln_sums = [
        v
        for v in ln.values
        if v.producer and ln.nodes[v.producer[0]].eqn.primitive.name == "reduce_sum"
    ]
    assert len(ln_sums) == 2 and ln_sums[0].batch != ln_sums[1].batch

    mean = xv.mean(0)
    want = ((xv - mean) / np.sqrt((xv * xv).mean(0) - mean * mean + 1e-5)) @ wv
    _run_and_check(batch_norm, (x, w), want, rtol=1e-4, atol=1e-4)
    counts = jsbp.debug.count_collectives(jsbp.jit(batch_norm), x, w)
    assert {k: v for k, v in counts.items() if v} == {"all-reduce": 1}
    assert jsbp.debug.estimate(jsbp.jit(batch_norm), x, w).collectives == 1


@pytest.mark.parametrize(
    "fn,args",
    [
        (jnp.matmul, (jnp.ones((8, 16)), jnp.ones((16, 32)))),
        (lambda x: jnp.sum(x, axis=1), (jnp.ones((8, 16)),)),
        (lambda x, y: x + y, (jnp.ones((8, 16)), jnp.ones((8, 16)))),
    ],
    ids=["dot", "reduce_sum", "add"],
)
def test_an_axis_of_one_device_offers_only_b(fn, args):
    """S and P over one device are B (``_boxing.on_devices``): on (4, 1) a rule offers exactly
    its signatures on (4,) with B on the one-device axis, so such a mesh is planned as the one
    without that axis (not over ~(rank + 2) times as many candidates)."""
    (eqn,) = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    rule = _lower._registry.get_rule(eqn.primitive.name)
    one_d = _problem.legal_signatures(jsbp.placement("cpu", range(4)), rule, eqn)
    grid = jsbp.placement("cpu", np.arange(4).reshape(4, 1))
    two_d = _problem.legal_signatures(grid, rule, eqn)
    b = jsbp.sbp.broadcast
    widened = {
        (tuple((*nd, b) for nd in ins), tuple((*nd, b) for nd in outs)) for ins, outs in one_d
    }
    assert len(two_d) == len(set(two_d)) == len(widened) > 1
    assert set(two_d) == widened


@pytest.mark.parametrize("plc", [P4, R22], ids=["4", "2x2"])
def test_a_candidate_reads_a_partial_value_only_where_one_can_be_made(plc):
    """A row-parallel product is a partial sum: the bias added to it keeps the candidate that
    reads both as partial sums (the bias zero-filled), and a max over a split dim is a partial
    max, which the add after it may read. Two replicated inputs cannot be made partial without
    a collective to undo it: their add reads no partial value, and no other add a partial max.
    Values as one device's."""
    xv, wv, bv, cv, dv = rand(8, 6), rand(6, 4), rand(4), rand(4), rand(8)
    rest = ("B",) * (plc.ndim - 1)
    x = jsbp.tensor(xv, placement=plc, sbp=("S(1)",) + rest)
    w = jsbp.tensor(wv, placement=plc, sbp=("S(0)",) + rest)
    b, c, d = (jsbp.tensor(v, placement=plc, sbp=("B",) + rest) for v in (bv, cv, dv))

    def f(x, w, b, c, d):
        return x @ w + b, b + c, x.max(1) + d

    prob = _problem_of(f, x, w, b, c, d)
    partial = lambda nds: {(a, s.reduce) for nd in nds for a, s in enumerate(nd) if s.is_partial}
    after_dot, replicated, after_max = [
        n for n in prob.nodes if n.eqn is not None and n.eqn.primitive.name == "add"
    ]
    assert any(partial(c[0]) == {(0, "sum")} for c in after_dot.cands)
    assert all(not partial(c[0]) for c in replicated.cands)
    assert any(partial(c[0]) == {(0, "max")} for c in after_max.cands)
    assert all(
        k == "sum" for n in (after_dot, replicated) for c in n.cands for _, k in partial(c[0])
    )
    _run_and_check(f, (x, w, b, c, d), (xv @ wv + bv, bv + cv, xv.max(1) + dv))
