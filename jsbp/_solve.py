"""Solving a planning problem (``_problem``): one candidate per node at the least ``Problem.cost``.

* **exact**: a mixed-integer program (HiGHS through ``scipy.optimize.milp``) when the problem is
  small (``EXACT_MAX_VARS``): binaries ``x[u, c]`` (node ``u`` runs candidate ``c``, one per node),
  ``y[v, t]`` (value ``v`` is needed in layout ``t``: at least every reader's choice asks it) and
  ``z[v, s, t] >= a[v, s] + y[v, t] - 1`` (``v`` made in ``s`` and needed in ``t``: the conversion
  runs once), minimising compute plus conversions;
* otherwise a **greedy start** (each node in program order takes the candidate cheapest for the
  layouts its operands have, conversions already made for free) followed by **local search**:
  sweeps that move one node at a time to its best candidate, the rest held, while the cost falls.
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


def _exact(prob: Problem, time_limit: float = EXACT_TIME_LIMIT_S) -> list[int] | None:
    """The optimum by ``scipy.optimize.milp``; None if the problem is too large or HiGHS finds no
    assignment in time."""
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
    res = milp(np.array(cost), constraints=[LinearConstraint(a, rlo, rhi)], integrality=np.array(integ),
               bounds=Bounds(lo, hi), options={"time_limit": time_limit, "disp": False})
    if res.x is None:
        return None
    x = res.x[:nx]
    return [int(np.argmax(x[base[u]:base[u + 1]])) for u in range(len(nodes))]


def solve(prob: Problem) -> list[int]:
    """The cheapest assignment found: exact where small, else greedy plus local search (the
    cheaper of the exact answer and the search's is kept, by ``Problem.cost``)."""
    start = local_search(prob, greedy(prob))
    exact = _exact(prob)
    if exact is not None and prob.cost(exact) < prob.cost(start):
        return exact
    return start
