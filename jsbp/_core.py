"""The exact MILPs and min-sum: a small problem solved whole (``exact``), and the pairwise
model's core, what ``_solve.eliminate`` leaves (nodes of three or more neighbours), solved
exactly as a local-polytope MILP (``exact_core``) or by min-sum message passing (``min_sum``).

A pairwise model is ``unary`` (per node, an array of its candidates' costs) and ``adj`` (per node,
neighbour -> the cost matrix of the pair, rows the node's candidates).
"""

from __future__ import annotations

import os
import sys

import numpy as np

LP_ITERATION_LIMIT = 100_000
"""Most simplex iterations HiGHS may take on one linear program (``milp`` without integrality);
without an optimum by then its answer is dropped (``exact_core``: min-sum decides instead). The
largest the 43 programs of ``benchmarks/planner.py`` take is 5,552 (about 0.13 s)."""

MIP_NODE_LIMIT = 100
"""Most branch-and-bound nodes HiGHS may explore on one MILP; without a proven optimum by then its
answer is dropped (``exact``: elimination plans instead; ``exact_core``: min-sum decides).
Every MILP of the 43 programs of ``benchmarks/planner.py`` is solved at its root node (1).

Both limits count work, not seconds, so that a plan does not depend on how busy the machine is:
every process of a multi-process run plans the same program."""

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


def milp(
    cost, rows, cols, vals, row_lo, row_hi, integral=None, warm: dict | None = None, lower=None
):
    """``min cost @ x`` subject to ``row_lo <= A @ x <= row_hi`` (``A``'s entries: ``vals`` at
    ``rows``, ``cols``), ``lower <= x <= 1`` (``lower`` default 0) and ``x[integral]`` whole, by
    HiGHS (``highspy``): ``x``, or None where HiGHS proves no optimum within ``LP_ITERATION_LIMIT``
    simplex iterations (a linear program) or ``MIP_NODE_LIMIT`` nodes (a MILP), or highspy is
    missing. ``warm``: a dict kept between calls; a linear program (no ``integral``)
    with the constraints of the one solved last through it starts from that one's optimal basis
    (only its costs changed: a few simplex steps)."""
    try:
        import highspy
    except ImportError:  # pragma: no cover - highspy is a dependency
        return None
    cost = np.asarray(cost, dtype=float)
    rows, cols = np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)
    n, m = len(cost), len(row_lo)
    key = (n, m, rows.tobytes(), cols.tobytes()) if warm is not None and integral is None else None
    h = warm.get(key) if key is not None else None
    if h is None:
        h = _highs(highspy)
        if integral is None:  # (presolve takes twice what the simplex does on the planner's cores)
            h.setOptionValue("presolve", "off")
            h.setOptionValue("simplex_iteration_limit", LP_ITERATION_LIMIT)
        else:
            h.setOptionValue("mip_max_nodes", MIP_NODE_LIMIT)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = n, m
        lp.col_cost_, lp.col_upper_ = cost, np.ones(n)
        lp.col_lower_ = np.zeros(n) if lower is None else np.asarray(lower, float)
        lp.row_lower_, lp.row_upper_ = np.asarray(row_lo, float), np.asarray(row_hi, float)
        at, inv = np.unique(cols * m + rows, return_inverse=True)  # by column, repeats summed
        lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
        lp.a_matrix_.start_ = np.searchsorted(at // m, np.arange(n + 1)).astype(np.int32)
        lp.a_matrix_.index_ = (at % m).astype(np.int32)
        lp.a_matrix_.value_ = np.bincount(inv, weights=np.asarray(vals, float), minlength=len(at))
        if integral is not None:
            lp.integrality_ = [
                highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
                for i in integral
            ]
        h.passModel(lp)
        if key is not None:
            warm.clear()
            warm[key] = h
    else:
        h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    return np.asarray(h.getSolution().col_value)


def exact(prob, max_vars: float = np.inf) -> list[int] | None:
    """The optimum of ``Problem.cost`` by HiGHS (``_core.milp``); None if the MILP would have
    more than ``max_vars`` variables or HiGHS does not prove an optimum within its limits
    (``_core.milp``)."""
    nodes = prob.nodes
    if not nodes:
        return []
    base = np.cumsum([0] + [len(n.cands) for n in nodes])
    nx = int(base[-1])
    if nx > max_vars:  # the candidates' binaries alone are too many
        return None
    cost = [float(c) for n in nodes for c in n.compute]
    integ = [1] * nx
    lo = [0.0] * nx
    rows, cols, vals, rlo, rhi = [], [], [], [], []
    r = 0

    def new_var(c, binary, low=0.0):
        cost.append(c)
        integ.append(1 if binary else 0)
        lo.append(low)
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
    group: dict = {}  # combined collective (kind, axes) -> its binary (one latency if used)
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
                c = prob.conversion(val, s, t, 0.0 if val.deferrable else None)
                joins = prob.joins(val, s, t)
                if c == 0.0 and not (val.deferrable and joins):
                    continue
                if xs is None:
                    cost[y] += c
                    made = y
                else:
                    made = new_var(c, False)  # z >= a_s + y - 1
                    row([(made, 1.0), (y, -1.0)] + [(x, -1.0) for x in xs], -1.0, np.inf)
                if val.deferrable:  # the combined collectives it joins: g >= z
                    for k in joins:
                        if k not in group:
                            group[k] = new_var(prob.model.latency_bytes, True)
                        row([(group[k], 1.0), (made, -1.0)], 0.0, np.inf)
        if len(cost) > max_vars:
            return None
    x = milp(cost, rows, cols, vals, rlo, rhi, np.array(integ, bool), lower=lo)
    if x is None:
        return None
    return [int(np.argmax(x[base[u] : base[u + 1]])) for u in range(len(nodes))]


_QUIET = []  # highspy's first solver prints a banner: once made with the output off, this is set


def _highs(highspy):
    """A new HiGHS solver that prints nothing (its first in the process writes a banner to the
    standard output at construction: made with file descriptor 1 on the null device)."""
    if _QUIET:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        try:
            h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(null)
        _QUIET.append(True)
    h.setOptionValue("output_flag", False)
    return h


def exact_core(core, unary, adj, warm=None) -> dict | None:
    """The pairwise model on ``core`` solved by HiGHS (``milp``): a binary per candidate (one per
    node) and, per edge, the joint of its two ends' candidates (``mu[a, b]``, summing to each
    end's choice: the local-polytope formulation). Its linear relaxation is solved first (warm
    from the last core of the same shape solved through ``warm``); where that is integral (the
    planner's cores mostly are) it is the optimum, else the MILP is solved. None when larger than
    ``CORE_EXACT_MAX_VARS``, HiGHS proves nothing within its limits (``milp``), or highspy is
    missing."""
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
    lo = np.zeros(r)
    lo[: len(core)] = 1.0
    problem = (np.concatenate(cost), *map(np.concatenate, (rows, cols, vals)), lo, lo)
    x = milp(*problem, warm=warm)  # the relaxation first: mostly integral
    if x is None or np.abs(x[:nvar] - np.round(x[:nvar])).max() > 1e-6:
        x = milp(*problem, integral=np.arange(n) < nvar)
    if x is None:
        return None
    return {u: int(np.argmax(x[base[u] : base[u] + len(unary[u])])) for u in core}


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
    ups = []  # the edges u < w (matrix, u's and w's places in ``core``), for the energy
    index = {u: i for i, u in enumerate(core)}
    for u in core:
        for w, m in adj[u].items():
            if u > w:
                continue
            ups.append((m, index[u], index[w]))
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
    # each message's reduced columns: one segment of ``red`` (normalised to least 0 at once)
    seg = np.array(sorted(o for es in buckets.values() for _, _, o in es), dtype=np.intp)
    seg_len = np.diff(np.append(seg, n_red))
    rows = np.repeat(np.arange(len(core)), size)
    cols = np.arange(len(flat_unary)) - np.repeat(np.array([off[u] for u in core]), size)
    padded = np.full((len(core), int(size.max())), np.inf)
    # the energy of a decoding: one entry per edge of their matrices laid end to end
    flat = np.concatenate([m.ravel() for m, _, _ in ups]) if ups else np.zeros(0)
    e_off = np.cumsum([0] + [m.size for m, _, _ in ups])[:-1].astype(np.intp)
    e_cols = np.array([m.shape[1] for m, _, _ in ups], dtype=np.intp)
    e_a = np.array([a for _, a, _ in ups], dtype=np.intp)
    e_b = np.array([b for _, _, b in ups], dtype=np.intp)
    starts_u = np.array([off[u] for u in core])
    msgs = np.zeros(pos)
    red = np.empty(n_red)
    best, best_e = None, np.inf
    for _ in range(rounds):
        belief = flat_unary + np.bincount(tgt, weights=msgs, minlength=len(flat_unary))
        padded[rows, cols] = belief
        pick = padded.argmin(1)
        e = float(flat_unary[starts_u + pick].sum())
        e += float(flat[e_off + pick[e_a] * e_cols + pick[e_b]].sum())
        if e < best_e - 1e-9:
            best, best_e = dict(zip(core, pick.tolist())), e
        h = (belief[h_src] - msgs[h_rev])[order]
        low = np.minimum.reduceat(h, starts) if len(h) else h
        for mats, g, dst, buf in plan:
            red[dst] = np.add(mats, low[g][:, :, None], out=buf).min(1)
        if len(seg):
            red -= np.repeat(np.minimum.reduceat(red, seg), seg_len)
        new = damping * msgs + (1.0 - damping) * red[expand]
        if np.array_equal(new, msgs):
            break
        msgs = new
    if best is None:
        best = {u: int(np.argmin(unary[u])) for u in core}
    return _icm(core, unary, adj, best)
