"""Solving a planning problem (``_problem``): one candidate per node at the least ``Problem.cost``.

* **exact**: a mixed-integer program (HiGHS through ``scipy.optimize.milp``) when the problem is
  small (``EXACT_MAX_VARS``): binaries ``x[u, c]`` (node ``u`` runs candidate ``c``, one per node),
  ``y[v, t]`` (value ``v`` is needed in layout ``t``: at least every reader's choice asks it) and
  ``z[v, s, t] >= a[v, s] + y[v, t] - 1`` (``v`` made in ``s`` and needed in ``t``: the conversion
  runs once), minimising compute plus conversions;
* otherwise a **greedy start** (each node in program order takes the candidate cheapest for the
  layouts its operands have, conversions already made for free), **local search** (sweeps that
  move one node at a time to its best candidate, the rest held, while the cost falls) and
  **windows**: runs of ``WINDOW`` consecutive nodes solved exactly with the rest held.
"""

from __future__ import annotations

import numpy as np

from ._problem import Problem

EXACT_MAX_VARS = 20_000
"""Largest number of variables (x + y + z) solved exactly; larger problems use local search."""

EXACT_TIME_LIMIT_S = 10.0
"""Seconds HiGHS may take; past them its best assignment so far is kept if cheaper."""

SWEEPS = 8
"""Most local-search sweeps over the nodes."""


def greedy(prob: Problem) -> list[int]:
    """Each node in program order takes the candidate of least compute plus conversions of its
    operands from the layouts they have (a conversion already made for an earlier reader is free)."""
    choice = [0] * len(prob.nodes)
    made: dict = {}  # id(value) -> layouts already converted to
    for u, n in enumerate(prob.nodes):
        srcs = [None if val is None else prob.layout(val, choice) for val in n.operands]
        best, best_c = None, 0
        for c, (ins, _) in enumerate(n.cands):
            cost = float(n.compute[c])
            for val, src, t in zip(n.operands, srcs, ins):
                if val is not None and t != src and t not in made.get(id(val), ()):
                    cost += prob.conversion(val, src, t)
            if best is None or cost < best - 1e-9:
                best, best_c = cost, c
        choice[u] = best_c
        for val, t in zip(n.operands, n.cands[best_c][0]):
            if val is not None:
                made.setdefault(id(val), set()).add(t)
    return choice


def local_search(prob: Problem, choice: list[int], sweeps: int = SWEEPS) -> list[int]:
    """Move one node at a time to the candidate that lowers ``Problem.cost`` most (its compute and
    the conversions of the values it reads and makes), until a sweep changes nothing."""
    choice = list(choice)
    for _ in range(sweeps):
        changed = False
        for u, n in enumerate(prob.nodes):
            if len(n.cands) < 2:
                continue
            touched = {id(v): v for v in (*n.operands, *n.outputs) if v is not None}.values()

            def local(c, u=u, n=n, touched=touched):
                choice[u] = c
                return float(n.compute[c]) + sum(prob.value_cost(v, choice) for v in touched)

            cur = choice[u]
            now = local(cur)
            best, best_c = now, cur
            for c in range(len(n.cands)):
                if c != cur:
                    cost = local(c)
                    if cost < best - 1e-6:
                        best, best_c = cost, c
            choice[u] = best_c
            changed = changed or best_c != cur
        if not changed:
            break
    return choice


def _exact(
    prob: Problem,
    time_limit: float = EXACT_TIME_LIMIT_S,
    choice: list[int] | None = None,
    free: set | None = None,
) -> list[int] | None:
    """The optimum by ``scipy.optimize.milp``; None if the problem is too large or HiGHS finds no
    assignment in time. With ``choice`` and ``free``: only the nodes in ``free`` choose, the others
    keep ``choice`` (the conversions among kept nodes alone are left out: they do not change)."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:  # pragma: no cover - scipy is a dependency of the planner extra
        return None
    nodes = prob.nodes
    base = np.cumsum([0] + [len(n.cands) for n in nodes])
    nx = int(base[-1])
    cost = [float(c) for n in nodes for c in n.compute]
    integ = [1] * nx
    lo, hi = [0.0] * nx, [1.0] * nx
    if free is not None:  # kept nodes: their candidate fixed to 1, the others to 0
        for u, n in enumerate(nodes):
            if u not in free:
                for c in range(len(n.cands)):
                    lo[int(base[u]) + c] = hi[int(base[u]) + c] = 1.0 if c == choice[u] else 0.0
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    r = 0

    def new_var(c, binary, low=0.0):
        cost.append(c)
        integ.append(1 if binary else 0)
        lo.append(low)
        hi.append(1.0)
        return len(cost) - 1

    def row(terms, low, high):
        nonlocal r
        for j, a in terms:
            rows.append(r)
            cols.append(j)
            vals.append(a)
        rlo.append(low)
        rhi.append(high)
        r += 1

    for u, n in enumerate(nodes):
        row([(int(base[u]) + c, 1.0) for c in range(len(n.cands))], 1.0, 1.0)
    for val in prob.values:
        if not val.uses and not val.wants:
            continue
        if (
            free is not None
            and not (val.producer is not None and val.producer[0] in free)
            and not any(u in free for u, _ in val.uses)
        ):
            continue
        targets: dict = {}
        for u, i in val.uses:
            for c, (ins, _) in enumerate(nodes[u].cands):
                targets.setdefault(ins[i], {}).setdefault((u, i), []).append(int(base[u]) + c)
        for t in val.wants:
            targets.setdefault(t, {})
        if val.producer is None:
            sources = {val.nd: None}
        else:
            p, j = val.producer
            sources = {}
            for c, (_, outs) in enumerate(nodes[p].cands):
                sources.setdefault(outs[j], []).append(int(base[p]) + c)
        for t, readers in targets.items():
            if len(sources) == 1 and t in sources:
                continue  # never converted
            y = new_var(0.0, True, 1.0 if t in val.wants else 0.0)
            for xs in readers.values():  # y >= sum of the reader's candidates asking t
                row([(y, 1.0)] + [(x, -1.0) for x in xs], 0.0, np.inf)
            for s, xs in sources.items():
                if s == t:
                    continue
                c = prob.conversion(val, s, t)
                if c == 0.0:
                    continue
                if xs is None:
                    cost[y] += c
                    continue
                z = new_var(c, False)  # z >= a_s + y - 1
                row([(z, 1.0), (y, -1.0)] + [(x, -1.0) for x in xs], -1.0, np.inf)
        if len(cost) > EXACT_MAX_VARS:
            return None
    if len(cost) > EXACT_MAX_VARS:
        return None
    a = coo_matrix((vals, (rows, cols)), shape=(r, len(cost))).tocsr()
    res = milp(
        np.array(cost),
        constraints=[LinearConstraint(a, rlo, rhi)],
        integrality=np.array(integ),
        bounds=Bounds(lo, hi),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        return None
    x = res.x[:nx]
    return [int(np.argmax(x[base[u] : base[u + 1]])) for u in range(len(nodes))]


WINDOW = 120
"""Nodes solved exactly at once by ``windows`` (consecutive in program order)."""

WINDOW_TIME_LIMIT_S = 3.0
"""Seconds HiGHS may take on one window (its best assignment so far is kept if cheaper)."""


def windows(prob: Problem, choice: list[int], size: int = WINDOW, rounds: int = 1) -> list[int]:
    """Large-neighbourhood search: windows of ``size`` consecutive nodes (half overlapping) each
    solved exactly with the rest held, kept where ``Problem.cost`` drops; ``rounds`` passes."""
    choice = list(choice)
    cost = prob.cost(choice)
    n = len(prob.nodes)
    for _ in range(rounds):
        improved = False
        for start in range(0, max(n - size // 2, 1), size // 2):
            free = set(range(start, min(start + size, n)))
            got = _exact(prob, WINDOW_TIME_LIMIT_S, choice, free)
            if got is None:
                continue
            c = prob.cost(got)
            if c < cost - 1e-6:
                choice, cost, improved = got, c, True
        if not improved:
            break
    return choice


def solve(prob: Problem) -> list[int]:
    """The cheapest assignment found: exact where the whole problem is small; else greedy, local
    search, then windows solved exactly (the cheapest by ``Problem.cost`` is kept)."""
    start = local_search(prob, greedy(prob))
    exact = _exact(prob)
    if exact is not None:
        return exact if prob.cost(exact) < prob.cost(start) else start
    return windows(prob, start)
