"""Solving a planning problem (``_problem``): one candidate per node at the least ``Problem.cost``.

* **exact** (``_core.exact``): a mixed-integer program (HiGHS through ``_core.milp``) for a
  small problem (``EXACT_MAX_VARS``): binaries ``x[u, c]`` (node ``u`` runs candidate ``c``, one
  per node), ``y[v, t]`` (value ``v`` is needed in layout ``t``: at least every reader's choice
  asks it), ``z[v, s, t] >= a[v, s] + y[v, t] - 1`` (``v`` made in ``s`` and needed in ``t``: the
  conversion runs once) and ``g[k] >= z`` for each combined collective ``k`` a deferrable
  value's conversion joins (one latency per group);
* **elimination** (``eliminate``) otherwise: the problem as a pairwise model (``_pairwise``),
  the copies of repeated layers folded into their first copy (``_problem.repeats``),
  nodes of one or two neighbours eliminated exactly, the core left solved as a local-polytope
  MILP (``_core.exact_core``) or by min-sum message passing (``_core.min_sum``), run under
  two pricings of the deferrable values (``solve``);
* **local search** (``local_search``) polishes the answer on ``Problem.cost`` itself.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np

from ._boxing import combined_collective, conversion_lines, line_cost, widening
from ._core import exact, exact_core, min_sum
from ._cost import itemsize
from ._problem import Problem, latency_part, repeats, through_hub

EXACT_MAX_VARS = 3_000
"""Largest MILP (variables x + y + z) ``solve`` hands to ``exact``; larger problems are
eliminated (``eliminate``)."""

SWEEPS = 8
"""Most local-search sweeps over the nodes."""


def local_search(prob: Problem, choice: list[int], sweeps: int = SWEEPS) -> list[int]:
    """Move one node at a time to the candidate that lowers ``Problem.cost`` most (its compute,
    the conversions of the values it reads and makes, and the combined collectives their
    deferrable conversions join), until a sweep changes nothing. The copies of a repeated layer
    (``_problem.repeats``) move together: their first copy is priced, and a move it wants is made
    for every copy, one after the other, each priced as the others stand then, and kept only if
    their sum lowers the cost. A node's candidates are priced at once from the conversion tables
    (``_moves``); a node is priced again only once a node it shares a value with has moved (or,
    touching a deferrable value, once the combined collectives have changed): until then its
    best move is the one it had. The layouts each value's readers ask are counted as the nodes
    move (``asked``), and the combined collectives each deferrable value joins kept (``held``), so
    that pricing a node reads those, not every other reader of a value read by many."""
    choice = list(choice)
    latency = prob.model.latency_bytes
    nodes = prob.nodes
    asked = {  # id(value) -> layout -> how many of its readers ask it under ``choice``
        id(v): Counter(nodes[w].cands[choice[w]][0][i] for w, i in v.uses) for v in prob.values
    }

    def joined(v):  # ``Problem.groups`` from the counts
        wanted = {t for t, k in asked[id(v)].items() if k > 0}.union(v.wants)
        return prob.groups(v, choice, wanted)

    held = {id(v): joined(v) for v in prob.values if v.deferrable}  # as of the last move
    groups = Counter()  # combined collective -> deferrable values joining it
    for g in held.values():
        groups.update(g)
    moves, late_nodes = _moves(prob)
    rep = _repeats(prob)
    copies: dict = {}  # first copy -> every copy (itself first)
    for u, r in enumerate(rep):
        copies.setdefault(r, []).append(u)
    dirty = [len(n.cands) > 1 and rep[u] == u for u, n in enumerate(nodes)]

    def priced(u):  # u's cost per candidate, the other nodes as they stand
        _, fns, late, late_vals = moves(u)
        cost = nodes[u].compute + sum(price(choice, asked) for price in fns)
        if not late:
            return cost
        for v in late_vals:  # the groups without u's deferrable values
            groups.subtract(held[id(v)])
        each = [joins(choice, asked) for joins in late]
        per = each[0] if len(each) == 1 else [set().union(*p) for p in zip(*each)]
        cost = cost + [latency * sum(groups[g] <= 0 for g in gs) if gs else 0.0 for gs in per]
        for v in late_vals:
            groups.update(held[id(v)])
        return cost

    def move(u, c):  # u to candidate c; the nodes whose prices it changes are dirty
        near, _, _, late_vals = moves(u)
        n, cur = nodes[u], choice[u]
        choice[u] = c
        for i, v in enumerate(n.operands):
            if v is not None:
                asked[id(v)][n.cands[cur][0][i]] -= 1
                asked[id(v)][n.cands[c][0][i]] += 1
        for w in near:
            dirty[rep[w]] = True
        before = [held[id(v)] for v in late_vals]
        after = [joined(v) for v in late_vals]
        if after != before:
            for v, g0, g1 in zip(late_vals, before, after):
                groups.subtract(g0)
                groups.update(g1)
                held[id(v)] = g1
            for w in late_nodes:
                if w != u:
                    dirty[rep[w]] = True

    for _ in range(sweeps):
        changed = False
        for u in range(len(nodes)):
            if not dirty[u]:
                continue
            dirty[u] = False
            cost, cur = priced(u), choice[u]
            best, best_c = cost[cur], cur
            if cost.min() < best - 1e-6:  # the first cheaper by 1e-6 than the best before it
                for c in range(len(cost)):
                    if c != cur and cost[c] < best - 1e-6:
                        best, best_c = cost[c], c
            if best_c == cur:
                continue
            gain, done = cost[cur] - best, [(u, cur)]
            move(u, best_c)
            for w in copies[u][1:]:
                was = choice[w]
                if was != best_c:
                    there = priced(w)
                    gain += there[was] - there[best_c]
                    done.append((w, was))
                    move(w, best_c)
            if gain > 1e-6:
                changed = True
            else:  # the copies together are no cheaper: back as they were
                for w, was in reversed(done):
                    move(w, was)
        if not changed:
            break
    return choice


def _moves(prob: Problem):
    """For ``local_search``: ``moves(u)``, node ``u``'s nodes sharing a value with it (with more
    than one candidate), a function per value it touches giving that value's conversions per
    candidate of the node (the others held, ``_pricer``), one per deferrable value it touches
    giving the combined collectives that value joins per candidate (``_joins``), and those
    values, made when first asked; and the nodes touching a deferrable value. Kept in
    ``Problem.cache``."""
    hit = prob.cache.get("moves")
    if hit is not None:
        return hit
    tables = prob.cache.setdefault("tables", _Tables(prob))
    nodes = prob.nodes
    made: dict = {}

    def touched(n):
        return list({id(v): v for v in (*n.operands, *n.outputs) if v is not None}.values())

    def moves(u):
        hit = made.get(u)
        if hit is not None:
            return hit
        vals = touched(nodes[u])
        near = {v.producer[0] for v in vals if v.producer is not None}
        near.update(w for v in vals for w, _ in v.uses)
        near = [w for w in near - {u} if len(nodes[w].cands) > 1]
        priced = [_pricer(prob, tables, u, v) for v in vals if v.uses or v.wants]
        late_vals = [v for v in vals if v.deferrable]
        hit = made[u] = (near, priced, [_joins(prob, u, v) for v in late_vals], late_vals)
        return hit

    late_nodes = [
        u for u, n in enumerate(nodes) if len(n.cands) > 1 and any(v.deferrable for v in touched(n))
    ]
    return prob.cache.setdefault("moves", (moves, late_nodes))


def _others(n, u: int, val):
    """A function of the assignment and ``local_search``'s counts: the layouts the readers of
    ``val`` other than node ``u`` (``n``) ask."""
    own = [i for w, i in val.uses if w == u]

    def others(choice, asked):
        mine = [n.cands[choice[u]][0][i] for i in own]
        return [t for t, k in asked[id(val)].items() if k > mine.count(t)]

    return others


def _joins(prob: Problem, u: int, val):
    """A function of the assignment: the combined collectives (``Problem.groups``) a deferrable
    ``val`` joins, per candidate of node ``u``, the other nodes as assigned."""
    n = prob.nodes[u]
    src = None
    if val.producer is not None and val.producer[0] == u:
        src = [outs[val.producer[1]] for _, outs in n.cands]
    mine = [[ins[i] for ins, _ in n.cands] for i in dict.fromkeys(i for w, i in val.uses if w == u)]
    others = _others(n, u, val)
    memo = prob.cache.setdefault("joins", {})  # answers: copies of one layer ask the same
    kind = (
        id(n.cands),
        None if src is None else val.producer[1],
        tuple(i for w, i in val.uses if w == u),
        val.shape,
        val.aval.dtype,
        val.batch,
    )

    def groups(s, wanted):
        return {g for t in wanted for g in prob.joins(val, s, t)}

    def joins(choice, asked):
        fixed = frozenset(val.wants).union(others(choice, asked))
        s = prob.layout(val, choice) if src is None else None
        key = (kind, s, fixed)
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = answer(s, fixed)
        return hit

    def answer(s, fixed):
        if src is None and not mine:
            return [groups(s, fixed)] * len(n.cands)
        out, seen = [], {}  # (layout made, layouts u reads): its groups (candidates share them)
        for c in range(len(n.cands)):
            key = (s if src is None else src[c], *(r[c] for r in mine))
            hit = seen.get(key)
            if hit is None:
                hit = seen[key] = groups(key[0], fixed.union(key[1:]))
            out.append(hit)
        return out

    return joins


def _pricer(prob: Problem, tables, u: int, val):
    """A function of the assignment: ``val``'s conversions (``Problem.value_cost``: each wanted
    layout from the made one or through a hub; a deferrable value's latency not charged) per
    candidate of node ``u``, the other nodes as assigned."""
    index, sub = tables.of(val, share=0.0)
    n = prob.nodes[u]
    src = None
    if val.producer is not None and val.producer[0] == u:
        src = tables.columns(val, n.cands, 1, val.producer[1])
    mine = [
        tables.columns(val, n.cands, 0, i) for i in dict.fromkeys(i for w, i in val.uses if w == u)
    ]
    others = _others(n, u, val)
    wants = {index(nd) for nd in val.wants}
    memo = prob.cache.setdefault("prices", {})  # answers: copies of one layer ask the same
    kind = (id(sub), None if src is None else id(src), *map(id, mine))

    def price(choice, asked):
        fixed = set(wants)
        for t in others(choice, asked):
            fixed.add(index(t))
        made = None if src is not None else index(prob.layout(val, choice))
        key = (kind, made, frozenset(fixed))
        hit = memo.get(key)
        if hit is None:
            hit = memo[key] = answer(np.array([made]) if src is None else src, fixed)
        return hit

    def answer(s, fixed):
        cols = np.fromiter(fixed, np.intp, len(fixed))
        cost = sub(s, cols).sum(1)
        for k, r in enumerate(mine):  # a layout u asks that no other reader or operand does
            new = ~np.isin(r, cols)
            for q in mine[:k]:
                new &= r != q
            extra = np.diagonal(sub(src, r)) if src is not None else sub(s, r)[0]
            cost = cost + np.where(new, extra, 0.0)
        if len(fixed) + len(mine) < 2:
            return cost
        spread = {}  # (made, wanted): ``through_hub``'s least (``Problem.spread``)
        for c in range(len(n.cands)):
            made = int(s[c] if src is not None else s[0])
            wanted = fixed.union(int(r[c]) for r in mine)
            wanted.discard(made)
            if len(wanted) < 2:
                continue
            key = (made, frozenset(wanted))
            if key not in spread:
                w = np.fromiter(wanted, np.intp, len(wanted))
                spread[key] = through_hub(sub(np.array([made]), w)[0], sub(w, w))[0]
            cost[c] = spread[key]
        return cost

    return price


class _Tables:
    """Conversion costs of the values of ``prob`` as matrices over layouts, filled as they are
    read and scaled by each value's ``times``. A conversion's cost depends only on the tensor's
    rank, bytes and dtype's widening (``_boxing.conversion_cost``), so values of one rank share
    their layouts' rows and columns, and values of one rank, size and widening one table. A pair
    of layouts' cheapest paths (``_boxing.conversion_lines``: cost linear in the bytes, one line
    per path) are found once per rank and widening; a table's missing entries are then priced
    together (``line_cost``). A deferrable value's pricing (``Problem.joined``) takes off part of
    the latency of the combined collective each conversion joins: per shape and item size, a
    table of those collectives (``combined_collective``; -1: none). Kept in ``Problem.cache``
    (as are ``of``'s functions, which refer to it): ``solve``'s runs share them."""

    def __init__(self, prob: Problem):
        self.prob = prob
        self.costs: dict = {}  # (rank, bytes, widening) -> [table]
        self.groups: dict = {}  # (shape, item size) -> [table of collectives' indices]
        self.keys: dict = {}  # combined collective (kind, axes) -> its index in the group tables
        self.layouts: dict = {}  # rank -> {layout: its row and column}
        self.cols: dict = {}  # ``columns``' arrays
        self.lines: dict = {}  # (rank, widening) -> [layouts x layouts x paths x 4]
        self.parts: dict = {}  # (pricing, batch) -> ``_member_parts``' array

    def of(self, val, share: float | None = None):
        """Functions of ``val``'s kind: ``index(nd)``, a layout's row and column, and
        ``sub(rows, cols)``, that table's block scaled by ``val.times`` (a deferrable value's
        latency priced as ``Problem.conversion``'s ``share``)."""
        kind = _kind(val)
        pricing = None  # ``Problem.pricing``: how the combined collectives' latency is shared
        if val.deferrable:
            kind += (val.batch,)
            pricing = self.prob.pricing(share)
        made = self.prob.cache.setdefault("of", {})  # (kind, pricing, times) -> the functions
        hit = made.get((kind, pricing, val.times))
        if hit is None:
            index = self._index(len(val.shape))
            sub = self._sub(val, kind, pricing)
            hit = made[(kind, pricing, val.times)] = (index, sub)
        return hit

    def columns(self, val, cands, side: int, pos: int) -> np.ndarray:
        """The rows (``index``) of the layouts ``cands`` (a node's candidates) give operand
        (``side`` 0) or result (``side`` 1) ``pos``, the value ``val``; one array per list of
        candidates (identical equations share theirs)."""
        key = (id(cands), side, pos)
        hit = self.cols.get(key)
        if hit is None or hit[0] is not cands:
            index = self._index(len(val.shape))
            rows = np.array([index(c[side][pos]) for c in cands], dtype=np.intp)
            hit = self.cols[key] = (cands, rows)
        return hit[1]

    def _index(self, rank: int):
        """``index(nd)``: a layout's row and column in the tables of tensors of ``rank``."""
        lays = self.layouts.setdefault(rank, {})
        return lambda nd: lays.setdefault(nd, len(lays))

    def _sub(self, val, kind, pricing):
        """``sub(rows, cols)``: the block of ``val``'s table, filled where not yet read, its
        combined collectives priced as ``pricing`` (None: not deferrable), scaled by
        ``val.times``."""
        prob, rank, times = self.prob, len(val.shape), val.times
        lays = self.layouts.setdefault(rank, {})
        costs = self.costs.setdefault(kind[:3], [np.zeros((0, 0))])
        groups = self.groups.setdefault(kind[3:5], [np.zeros((0, 0))])

        def cost(a, b):  # the conversions a[i] -> b[i] of a tensor of this rank, size and dtype
            if kind[1] == 0:
                return np.zeros(len(a))
            return line_cost(self._lines(rank, kind[2], a, b), kind[1])

        def group(a, b):  # the (kind, axes) of ``Problem.joins``, as indices in ``keys``
            nds, hier, keys = list(lays), prob.placement.hierarchy, self.keys
            out = []
            for i, j in zip(a.tolist(), b.tolist()):
                ks = combined_collective(nds[i], nds[j], kind[3], hier, kind[4])
                out.append(keys.setdefault(ks[0], len(keys)) if ks else -1)
            return out

        def sub(rows, cols):
            block = _filled(costs, lays, rows, cols, cost)
            if pricing is None:
                return block * times
            g = _filled(groups, lays, rows, cols, group).astype(np.intp)
            parts = self._member_parts(pricing, val.batch)
            return (block - prob.model.latency_bytes * (1.0 - parts[g])) * times

        return sub

    def _member_parts(self, pricing, batch) -> np.ndarray:
        """Per combined collective (kind, axes) of ``keys``, the part of a latency a member of its
        ``batch`` pays under ``pricing``, then a 1 (index -1: none); grown as keys are added."""
        at = (pricing, batch)
        have = self.parts.get(at)
        if have is None or len(have) != len(self.keys) + 1:
            n = 0 if have is None else len(have) - 1
            more = [latency_part(k + batch, pricing) for k in itertools.islice(self.keys, n, None)]
            have = self.parts[at] = np.concatenate([[] if have is None else have[:-1], more, [1.0]])
        return have

    def _lines(self, rank: int, widen: tuple, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``_boxing.conversion_lines`` of the layout pairs (a[i], b[i]) of tensors of ``rank``
        (rows and columns of ``_index``) and a dtype's ``widen``, padded to one number of paths
        (a padding path is never the cheapest)."""
        lays = self.layouts[rank]
        entry = self.lines.setdefault((rank, widen), [np.full((0, 0, 1, 4), np.nan)])
        miss = np.isnan(_grown(entry, len(lays))[a, b, 0, 0])
        if miss.any():
            nds, model, hier = list(lays), self.prob.model, self.prob.placement.hierarchy
            for i, j in set(zip(a[miss].tolist(), b[miss].tolist())):
                got = conversion_lines(
                    nds[i], nds[j], rank, hier, model.latency_bytes, model.op_bytes, widen
                )
                if len(got) > entry[0].shape[2]:
                    wide = np.empty(entry[0].shape[:2] + (len(got), 4))
                    wide[:, :, : entry[0].shape[2]] = entry[0]
                    wide[:, :, entry[0].shape[2] :] = (np.inf, np.inf, 0.0, 0.0)
                    entry[0] = wide
                row = entry[0][i, j]
                row[:] = (np.inf, np.inf, 0.0, 0.0)
                row[: len(got)] = got
        return entry[0][a, b]


def _kind(val) -> tuple:
    """A value's table, but for a deferrable value's batch: (rank, bytes, the dtype's
    ``_boxing.widening``), and a deferrable value's shape and item size (the combined
    collectives its conversions join)."""
    dtype = val.aval.dtype
    size = itemsize(dtype)
    kind = (len(val.shape), math.prod(val.shape) * size, widening(dtype))
    return kind + (val.shape, size) if val.deferrable else kind


def _grown(entry, n: int) -> np.ndarray:
    """``entry[0]`` with at least ``n`` rows and columns (twice that once it grows; the new
    entries NaN: not yet read)."""
    old = entry[0]
    if old.shape[0] < n:
        entry[0] = np.full((2 * n, 2 * n) + old.shape[2:], np.nan)
        entry[0][: old.shape[0], : old.shape[1]] = old
    return entry[0]


def _filled(entry, lays, rows, cols, fill) -> np.ndarray:
    """The block ``rows`` x ``cols`` of the table ``entry[0]`` (grown to the layouts ``lays``
    index), its entries not yet read (NaN) filled by ``fill(srcs, dsts)`` (arrays of rows and
    columns: their entries)."""
    table = _grown(entry, len(lays))
    block = table[rows[:, None], cols]
    miss = np.nonzero(np.isnan(block))
    if len(miss[0]):
        n = table.shape[1]
        src, dst = np.divmod(np.unique(rows[miss[0]] * n + cols[miss[1]]), n)
        entry[0][src, dst] = fill(src, dst)
        block = entry[0][rows[:, None], cols]
    return block


def _pairwise(prob: Problem):
    """The problem as unary costs per node and cost matrices per pair of nodes (a pairwise model),
    for ``eliminate``. A value read by one node is an edge from its producer to that node; a
    value read by several (or asked as an output as well) gets a *hub*: an extra node choosing
    the one layout the value is converted to first, each reader converting from there. Exact
    where the readers agree (one conversion, paid once); otherwise an upper bound of
    ``Problem.cost``. The copies of repeated layers (``_repeats``) are folded into their first
    copy: their work and conversions are its own, so that they choose alike; a copy keeps no
    cost and no neighbour."""
    rep = _repeats(prob)
    static = prob.cache.get("pairwise")
    if static is None:  # the values whose pricing does not change between ``solve``'s runs
        unary = [np.asarray(n.compute, dtype=float).copy() for n in prob.nodes]
        for u, r in enumerate(rep):  # a copy's work is its first copy's, chosen once for both
            if r != u:
                unary[r], unary[u] = unary[r] + unary[u], np.zeros_like(unary[u])
        adj: list[dict] = [{} for _ in prob.nodes]
        hubs: dict = {}
        _add_values(prob, [v for v in prob.values if not v.deferrable], unary, adj, hubs, rep)
        static = prob.cache["pairwise"] = (unary, adj, hubs)
    unary = list(static[0])  # (arrays never changed in place: ``eliminate`` reuses its steps)
    adj = [dict(a) for a in static[1]]
    _add_values(prob, [v for v in prob.values if v.deferrable], unary, adj, dict(static[2]), rep)
    return unary, adj


def _repeats(prob: Problem) -> list[int]:
    """``_problem.repeats`` of the problem's nodes, kept in ``Problem.cache``."""
    if "repeats" not in prob.cache:
        prob.cache["repeats"] = repeats(prob.nodes)
    return prob.cache["repeats"]


def _add_values(prob: Problem, values, unary, adj, hubs, rep) -> None:
    """Add the conversions of ``values`` to the pairwise model (``unary``, ``adj``, ``hubs``:
    per output of a node, the first hub of the values it makes and that hub's rows), in place,
    each reader and producer taken as the first of its copies (``rep``). Values of one class add
    up to one of them times their number, priced once: one table, made by
    copies of one node's output (or inputs of one layout), read by copies of the same operands and
    asked as the same outputs. The values one node's copies make share a hub where their rows
    agree."""
    nodes = prob.nodes
    tables = prob.cache.setdefault("tables", _Tables(prob))

    def edge(u, w, m):
        if u == w:  # a copy of the node reads it: both choose alike
            unary[u] = unary[u] + np.diagonal(m)
            return
        adj[u][w] = adj[u][w] + m if w in adj[u] else m
        adj[w][u] = adj[u][w].T

    by_batch: dict = {}  # batch -> the entries of ``Problem.joined`` its values' pricing reads
    for e in prob.joined or ():
        for b in {e[0], e[0][2:]}:
            by_batch.setdefault(b, []).append(e)
    by_batch = {b: frozenset(es) for b, es in by_batch.items()}
    classes: dict = {}  # class -> [its first value, how many]
    for val in values:
        if not val.uses and not val.wants:
            continue
        at = ("in", val.nd) if val.producer is None else (rep[val.producer[0]], val.producer[1])
        readers = tuple(sorted((rep[u], i) for u, i in val.uses))
        # what its table is priced by (a deferrable value's batch only through the parts of
        # ``Problem.joined`` it reads), where it is made, who reads it, as what it is asked
        klass = (_kind(val), val.times, val.deferrable and by_batch.get(val.batch))
        key = (klass, at, readers, tuple(val.wants))
        classes.setdefault(key, [val, 0])[1] += 1
    for val, times in classes.values():
        readers: dict = {}  # node -> its operand indices reading val
        for u, i in val.uses:
            readers.setdefault(u, []).append(i)
        index, sub = tables.of(val)

        def idx(nds, index=index):
            return np.array([index(nd) for nd in nds], dtype=np.intp)

        if val.producer is None:
            p, src = None, idx([val.nd])
        else:
            p, j = val.producer
            src = tables.columns(val, nodes[p].cands, 1, j)
            p = rep[p]
        asked = {
            u: [tables.columns(val, nodes[u].cands, 0, i) for i in dict.fromkeys(ii)]
            for u, ii in readers.items()
        }
        want = idx(val.wants)
        every = np.unique(np.concatenate([src, want, *(c for cs in asked.values() for c in cs)]))

        def out(rows, cols, sub=sub, times=times):  # the class's conversions rows -> cols
            m = sub(rows, cols)
            return m * times if times > 1 else m

        def reads(u, rows, asked=asked, out=out):  # (rows, u's candidates): to what u reads
            cols = asked[u]
            m = out(rows, cols[0])
            for k in range(1, len(cols)):  # two operands reading val: a second layout only
                extra = out(rows, cols[k])
                m = m + np.where(cols[k][None, :] == cols[0][None, :], 0.0, extra)
            return m

        if p is None and len(readers) <= 1:
            for u in readers:
                unary[rep[u]] = unary[rep[u]] + reads(u, src)[0]
            continue
        if p is not None and len(readers) + bool(val.wants) <= 1:
            if val.wants:
                unary[p] = unary[p] + out(src, want).sum(1)
            for u in readers:
                edge(p, rep[u], reads(u, src))
            continue
        h = len(unary)
        if p is not None:  # the values one node's output makes: one hub where their rows agree
            first = hubs.setdefault((p, val.producer[1]), (h, every))
            h = first[0] if np.array_equal(first[1], every) else h
        if h == len(unary):
            unary.append(np.zeros(len(every)))
            adj.append({})
        if p is not None:
            edge(p, h, out(src, every))
        else:
            unary[h] = unary[h] + out(src, every)[0]
        unary[h] = unary[h] + out(every, want).sum(1)
        for u in readers:
            edge(h, rep[u], reads(u, every))


CHAIN_MAX = 1 << 22
"""Largest ``C1 * C * C2`` table a chain elimination builds (floats), else the node stays."""


def _same(a, b) -> bool:
    """Whether two of the pairwise model's arrays (or None) hold the same numbers."""
    if a is b:
        return True
    return a is not None and b is not None and a.shape == b.shape and np.array_equal(a, b)


def eliminate(prob: Problem) -> list[int]:
    """Graph elimination on the pairwise model (``_pairwise``), as OneFlow's SBP graph does: a
    node with one neighbour folds into it (its best candidate per the neighbour's), a node with two
    becomes an edge between them (parallel edges add up); what is left, nodes of three or more
    neighbours, is solved exactly (``_core.exact_core``) or by min-sum (``_core.min_sum``); then the
    eliminated nodes take their recorded best candidates, last eliminated first."""
    unary, adj = _pairwise(prob)
    n = len(unary)
    alive = [True] * n
    record: list = []
    queue = [u for u in range(n) if len(adj[u]) <= 2]
    # per step: the arrays it read and what it made; a later run (``solve``'s other pricings)
    # whose step reads the same numbers takes what that step made
    steps = prob.cache.setdefault("steps", {})
    k = 0

    def made(at, arrays, fold):
        nonlocal k
        hit = steps.get(k)
        if (
            hit is None
            or hit[0] != at
            or len(hit[1]) != len(arrays)
            or not all(_same(a, b) for a, b in zip(hit[1], arrays))
        ):
            hit = steps[k] = (at, arrays, fold())
        k += 1
        return hit[2]

    while queue:
        u = queue.pop()
        if not alive[u] or len(adj[u]) > 2:
            continue
        nb = list(adj[u])
        if len(nb) == 0:
            record.append((u, None, None, None))
        elif len(nb) == 1:
            (w,) = nb

            def fold(m=adj[w][u], a=unary[u], b=unary[w]):
                tot = m + a[None, :]
                arg = tot.argmin(1)
                return arg, b + np.take_along_axis(tot, arg[:, None], 1)[:, 0]

            arg, unary[w] = made(u, (adj[w][u], unary[u], unary[w]), fold)
            record.append((u, w, None, arg))
            del adj[w][u]
            if len(adj[w]) <= 2:
                queue.append(w)
        else:
            w1, w2 = nb
            m1, m2 = adj[w1][u], adj[u][w2]
            if m1.shape[0] * m1.shape[1] * m2.shape[1] > CHAIN_MAX:
                continue

            old = adj[w1].get(w2)

            def chain(m1=m1, m2=m2, a=unary[u], old=old):
                tot = (m1 + a[None, :])[:, :, None] + m2[None, :, :]
                arg = tot.argmin(1)
                best = np.take_along_axis(tot, arg[:, None, :], 1)[:, 0, :]
                joined = old + best if old is not None else best
                return arg, joined, joined.T

            arg, adj[w1][w2], adj[w2][w1] = made(u, (m1, unary[u], m2, old), chain)
            record.append((u, w1, w2, arg))
            del adj[w1][u], adj[w2][u]
            for w in (w1, w2):
                if len(adj[w]) <= 2:
                    queue.append(w)
        alive[u] = False
        adj[u] = {}
    choice = [0] * n
    core = [u for u in range(n) if alive[u]]
    inputs = (*(unary[u] for u in core), *(m for u in core for m in adj[u].values()))

    def solve_core():
        got = exact_core(core, unary, adj, warm=prob.cache.setdefault("highs", {}))
        if got is not None:
            return got
        return min_sum(core, unary, adj, memo=prob.cache.setdefault("classes", {}))

    got = made(tuple(core), inputs, solve_core)
    for u, c in got.items():
        choice[u] = c
    for u, w1, w2, arg in reversed(record):
        if w1 is None:
            choice[u] = int(np.argmin(unary[u]))
        elif w2 is None:
            choice[u] = int(arg[choice[w1]])
        else:
            choice[u] = int(arg[choice[w1], choice[w2]])
    rep = _repeats(prob)
    return [choice[rep[u]] for u in range(len(prob.nodes))]


def _plan_parts(prob: Problem, choice, late) -> frozenset:
    """The combined collectives ``choice`` runs, each with the part of its latency a member pays
    (one over its members)."""
    members = Counter(g for v in late for g in prob.groups(v, choice))
    return frozenset((g, 1.0 / n) for g, n in members.items())


def solve(prob: Problem) -> list[int]:
    """The cheapest assignment found: the exact optimum where the problem is small
    (``EXACT_MAX_VARS``); else elimination (``eliminate``) under two pricings of the deferrable
    conversions: a share of a latency each (one over the number of deferrable values of their
    ``Value.batch``); then a part of one where they join a combined collective the first answer
    runs (one over its members there), a whole one where they open another. An answer is priced
    as it runs (``_waits``: a conversion of the last combined collectives that reads another's
    result runs in a later one), and the cheaper of the two so priced is kept; an exact answer
    that waits is solved once more with those waits priced (a global norm summed on slices of
    all-reduced gradients pays for its second all-reduce). The answer is polished by local
    search."""
    last = [v for v in prob.values if v.deferrable and v.batch == ()]
    waits: dict = {}  # answer -> the batches of ``last`` as it runs them
    cost: dict = {}  # answer -> its ``Problem.cost``, so priced

    def priced(choice) -> float:  # (``last``'s batches left set as ``choice`` runs them)
        t = tuple(choice)
        if t not in waits:
            waits[t] = _waits(prob, last, choice)
        for v, b in zip(last, waits[t]):
            v.batch = b
        if t not in cost:
            cost[t] = prob.cost(choice)
        return cost[t]

    tries = [exact(prob, max_vars=EXACT_MAX_VARS)]
    if tries[0] is not None:
        priced(tries[0])
        if any(v.batch and prob.groups(v, tries[0]) for v in last):  # it waits
            tries.append(exact(prob, max_vars=EXACT_MAX_VARS))
    else:
        late = [v for v in prob.values if v.deferrable]
        prob.joined = frozenset((b, 1.0 / n) for b, n in Counter(v.batch for v in late).items())
        tries = [eliminate(prob)]
        if late:
            prob.joined = _plan_parts(prob, tries[0], late)
            tries.append(eliminate(prob))
        prob.joined = None
    best = min((t for t in tries if t is not None), key=priced)
    priced(best)
    choice = local_search(prob, list(best))
    prob.cache.clear()  # (closures that refer to prob: freed with it, not by a collection)
    return choice


def _waits(prob: Problem, last, choice) -> tuple:
    """The ``Value.batch`` of each of the values ``last`` (the last combined collectives') as
    ``choice`` runs them: ("after", k) where k conversions joining those collectives lie on a path
    to the value, each read converted by the next step (a global norm summed from all-reduced
    gradients: a collective cannot take a result of its own), else ()."""
    member = {id(v) for v in last}
    waits: dict = {}  # id(value) -> conversions of ``last`` it waits for
    for u, n in enumerate(prob.nodes):
        k = 0
        for v, t in zip(n.operands, n.cands[choice[u]][0]):
            if v is None:
                continue
            at = waits.get(id(v), 0)
            if id(v) in member:
                src = prob.layout(v, choice)
                at += src != t and bool(prob.joins(v, src, t))
            k = max(k, at)
        for v in n.outputs:
            if v is not None:
                waits[id(v)] = k
    return tuple(("after", waits[id(v)]) if waits.get(id(v)) else () for v in last)
