"""The pairwise model's core: what ``_solve.eliminate`` leaves (nodes of three or more
neighbours), solved exactly as a local-polytope MILP (``exact_core``) or by min-sum message passing
(``min_sum``).

A pairwise model is ``unary`` (per node, an array of its candidates' costs) and ``adj`` (per node,
neighbour -> the cost matrix of the pair, rows the node's candidates).
"""

from __future__ import annotations

import numpy as np

EXACT_TIME_LIMIT_S = 2.0
"""Seconds HiGHS may take on one MILP; without a proven optimum by then its answer is dropped
(``_solve.exact``: elimination plans instead; ``exact_core``: min-sum does)."""

CORE_EXACT_MAX_VARS = 60_000
"""Largest MILP (candidates + joint candidates of the edges) over the nodes ``eliminate`` leaves
that is solved exactly; larger cores go to min-sum."""

POLISH_SWEEPS = 32
"""Most sweeps of the greedy polish (``_icm``) after min-sum."""


MIN_SUM_ROUNDS = 40
"""Rounds of min-sum message passing on the nodes elimination leaves."""


def _icm(core, unary, adj, choice) -> dict:
    """Iterated conditional modes: each node in turn to its best candidate, the others held."""
    for _ in range(POLISH_SWEEPS):
        changed = False
        for u in core:
            tot = unary[u].copy()
            for w, m in adj[u].items():
                tot += m[:, choice[w]]
            c = int(np.argmin(tot))
            if tot[c] < tot[choice[u]] - 1e-9:
                choice[u], changed = c, True
        if not changed:
            break
    return choice


def exact_core(core, unary, adj, time_limit: float = EXACT_TIME_LIMIT_S) -> dict | None:
    """The pairwise model on ``core`` solved by ``scipy.optimize.milp``: a binary per candidate
    (one per node) and, per edge, the joint of its two ends' candidates (``mu[a, b]``, summing to
    each end's choice: the local-polytope formulation). Its linear relaxation is solved first
    (about 2.5x faster than the MILP); where that is integral (the planner's cores mostly are)
    it is the optimum, else the MILP is solved. None when larger than ``CORE_EXACT_MAX_VARS``,
    HiGHS proves nothing in ``time_limit``, or scipy is missing."""
    edges = [(u, w, m) for u in core for w, m in adj[u].items() if u < w]
    if not core:
        return {}
    base, nvar = {}, 0
    for u in core:
        base[u] = nvar
        nvar += len(unary[u])
    n = nvar + sum(m.size for _, _, m in edges)
    if n > CORE_EXACT_MAX_VARS:
        return None
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix
    except ImportError:  # pragma: no cover - scipy is a dependency of the planner extra
        return None
    cost = [np.asarray(unary[u], dtype=float) for u in core]
    rows = [np.repeat(np.arange(len(core)), [len(unary[u]) for u in core])]
    cols = [np.arange(nvar)]
    vals = [np.ones(nvar)]
    r, e0 = len(core), nvar
    for u, w, m in edges:
        cu, cw = m.shape
        cost.append(m.ravel())
        mu = e0 + np.arange(cu * cw).reshape(cu, cw)
        # sum_b mu[a, b] - x[u, a] = 0 (rows r .. r+cu), sum_a mu[a, b] - x[w, b] = 0 (the next cw)
        rows += [r + np.repeat(np.arange(cu), cw), r + cu + np.tile(np.arange(cw), cu)]
        cols += [mu.ravel(), mu.ravel()]
        vals += [np.ones(cu * cw), np.ones(cu * cw)]
        rows += [r + np.arange(cu), r + cu + np.arange(cw)]
        cols += [base[u] + np.arange(cu), base[w] + np.arange(cw)]
        vals += [-np.ones(cu), -np.ones(cw)]
        r += cu + cw
        e0 += cu * cw
    a = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, n)
    ).tocsr()
    lo = np.zeros(r)
    lo[: len(core)] = 1.0
    problem = dict(
        c=np.concatenate(cost),
        constraints=[LinearConstraint(a, lo, lo)],
        bounds=Bounds(np.zeros(n), np.ones(n)),
        options={"time_limit": time_limit, "disp": False},
    )
    res = milp(integrality=np.zeros(n), **problem)  # the relaxation first: mostly integral
    if res.status != 0 or np.abs(res.x[:nvar] - np.round(res.x[:nvar])).max() > 1e-6:
        res = milp(integrality=np.concatenate([np.ones(nvar), np.zeros(n - nvar)]), **problem)
    if res.status != 0:
        return None
    return {u: int(np.argmax(res.x[base[u] : base[u] + len(unary[u])])) for u in core}


def _classes(m: np.ndarray):
    """The distinct rows of ``m`` (equal bytes): per row its class, and a row of each class."""
    rows = np.ascontiguousarray(m).view(np.dtype((np.void, m.dtype.itemsize * m.shape[1])))
    _, first, cls = np.unique(rows[:, 0], return_index=True, return_inverse=True)
    return cls, first


def min_sum(
    core, unary, adj, rounds: int = MIN_SUM_ROUNDS, damping: float = 0.5, memo=None
) -> dict:
    """A candidate per node of ``core`` (the pairwise model left after elimination): min-sum
    belief propagation (damped), the cheapest round's decoding polished by ``_icm``. The messages
    live in one array, those into a node in its neighbours' order. A message is computed on its
    edge's distinct rows and columns (equal rows: the least of their senders' beliefs; equal
    columns: the same message entry), the edges of one such shape together; the rounds stop early
    once a round leaves every message as it was. ``memo``: id(matrix) -> its classes, kept
    between calls (``solve``'s runs share most of the core's matrices)."""
    if not core:
        return {}
    size = np.array([len(unary[u]) for u in core])
    off = dict(zip(core, np.concatenate([[0], np.cumsum(size)[:-1]]).tolist()))
    flat_unary = np.concatenate([unary[u] for u in core])
    moff, tgt, pos = {}, [], 0  # message (k, u): its offset; each entry's candidate of u
    for u in core:
        for k in adj[u]:
            moff[(k, u)] = pos
            tgt.append(off[u] + np.arange(len(unary[u])))
            pos += len(unary[u])
    tgt = np.concatenate(tgt) if tgt else np.zeros(0, np.intp)
    # per directed edge a -> b, on its matrix's distinct rows and columns (``red``): the senders'
    # beliefs less the returning message (``h_src``, ``h_rev``), their least per class of equal
    # rows (``h_cls``), and the reduced column each entry of the message is (``expand``)
    h_src, h_rev, h_cls, expand, buckets = [], [], [], np.zeros(pos, np.intp), {}
    n_cls = n_red = 0
    ups: dict = {}  # (cu, cw) -> the edges u < w of that shape, for the energy
    index = {u: i for i, u in enumerate(core)}
    for u in core:
        for w, m in adj[u].items():
            ups.setdefault(m.shape, [])
            if u > w:
                continue
            ups[m.shape].append((m, index[u], index[w]))
            hit = memo.get(id(m)) if memo is not None else None
            if hit is None or hit[0] is not m:
                (rc, rfirst), (cc, cfirst) = _classes(m), _classes(m.T)
                hit = (m, rc, cc, m[rfirst][:, cfirst])
                if memo is not None:
                    memo[id(m)] = hit
            _, rc, cc, red = hit
            for a, b, a_cls, b_cls, mat in ((u, w, rc, cc, red), (w, u, cc, rc, red.T)):
                h_src.append(off[a] + np.arange(len(unary[a])))
                h_rev.append(moff[(b, a)] + np.arange(len(unary[a])))
                h_cls.append(n_cls + a_cls)
                expand[moff[(a, b)] : moff[(a, b)] + len(unary[b])] = n_red + b_cls
                low = n_cls + np.arange(mat.shape[0])
                buckets.setdefault(mat.shape, []).append((mat, low, n_red))
                n_cls += mat.shape[0]
                n_red += mat.shape[1]
    h_src, h_rev, h_cls = (
        np.concatenate(x) if x else np.zeros(0, np.intp) for x in (h_src, h_rev, h_cls)
    )
    order = np.argsort(h_cls, kind="stable")
    starts = np.flatnonzero(np.diff(h_cls[order], prepend=-1))
    plan = []
    for (_, cw), edges in buckets.items():
        mats = np.stack([m for m, _, _ in edges])
        low = np.stack([g for _, g, _ in edges])
        dst = np.array([o for _, _, o in edges])[:, None] + np.arange(cw)
        plan.append((mats, low, dst, np.empty_like(mats)))
    rows = np.repeat(np.arange(len(core)), size)
    cols = np.arange(len(flat_unary)) - np.repeat(np.array([off[u] for u in core]), size)
    padded = np.full((len(core), int(size.max())), np.inf)
    ups = [
        (
            np.stack([m for m, _, _ in es]),
            np.array([a for _, a, _ in es], dtype=np.intp),
            np.array([b for _, _, b in es], dtype=np.intp),
        )
        for es in ups.values()
        if es
    ]
    starts_u = np.array([off[u] for u in core])
    msgs = np.zeros(pos)
    red = np.empty(n_red)
    best, best_e = None, np.inf
    for _ in range(rounds):
        belief = flat_unary + np.bincount(tgt, weights=msgs, minlength=len(flat_unary))
        padded[rows, cols] = belief
        pick = padded.argmin(1)
        e = float(flat_unary[starts_u + pick].sum())
        for mats, a, b in ups:
            e += float(mats[np.arange(len(a)), pick[a], pick[b]].sum())
        if e < best_e - 1e-9:
            best, best_e = dict(zip(core, pick.tolist())), e
        h = (belief[h_src] - msgs[h_rev])[order]
        low = np.minimum.reduceat(h, starts) if len(h) else h
        for mats, g, dst, buf in plan:
            msg = np.add(mats, low[g][:, :, None], out=buf).min(1)
            msg -= msg.min(1, keepdims=True)
            red[dst] = msg
        new = damping * msgs + (1.0 - damping) * red[expand]
        if np.array_equal(new, msgs):
            break
        msgs = new
    if best is None:
        best = {u: int(np.argmin(unary[u])) for u in core}
    return _icm(core, unary, adj, best)
