"""Repeated layers planned once: a deep model's program planned from a shorter copy of itself.

A model whose blocks repeat (an unrolled 24-block transformer: 24 copies of the block's forward
equations, 24 of its backward ones, 24 of each optimizer update) is planned as the same program
with only a few copies of each repeated stretch: the first ``HEAD`` and the last ``TAIL``. Each
removed copy takes the signatures the last head copy was given, and one forward pass over the
whole program follows them (``_Inference.fixed``): a signature is followed where it is legal for
the layouts that pass sees, and chosen afresh where it is not, so the program is built by the
usual rules and can be costlier than a plan of the whole, never wrong. Planning time grows with
the number of equations only through that one pass.

Finding the copies (``_Repeats``):

1. *Flatten*: inlined calls (``jit``, ``custom_jvp_call`` ...) are opened as the compiler's
   passes open them (``_Inference.copies``: the same equation objects), so the equations read in
   program order are the ones the passes meet.
2. *Runs*: each equation gets a kind (primitive, parameters and operand / result types:
   ``_compiler._eqn_key``); a run is a stretch where the kinds repeat with some period ``p``
   (at least ``MIN_PERIOD``; the ``MAX_PERIODS`` most frequent distances between equations of
   one kind are tried) over at least ``MIN_COPIES`` copies. Runs are taken largest first,
   without overlap.
3. *Copies*: within a run, equation ``i`` and ``i + p`` are copies of each other, and so are
   their operands and results, position by position. A run must agree with itself (a value is
   never the copy of two different values) and with the runs taken before it, or run the other
   way through the same values (the backward pass visits the blocks last to first: its copies
   are counted in the forward order); a run that does neither is left whole.
4. *Windows*: a run is cut into whole windows of its period, numbered as the program's copies
   (``_align``: the forward and the backward runs start at different places in a layer).
5. *Reduce*: the middle copies are removed. A kept equation that read a removed value reads the
   matching value of the kept copy as many kept copies away instead (copy ``HEAD - 1``'s
   output feeds the tail copy, the tail copy's gradient feeds copy ``HEAD - 1``). The program is
   planned whole instead when less than ``MIN_REMOVED`` of its equations would go, or a removed
   value has no kept copy made before its reader.

The planner is told how many equations of the whole program each kept one stands for
(``weights``: copy ``HEAD - 1`` counts for itself and every copy it stands in for), so that the
global planner weighs a block against the model's ends as the whole program does; where it
returns several plans, ``_best_for_whole`` ranks them for the whole program.
"""

from __future__ import annotations

import os
from collections import Counter

from jax.extend import core as jcore

HEAD = 2
"""Copies kept at the start of each chain; the last of them stands for every removed copy (it
has kept copies on both sides, like a block in the middle of the model)."""

TAIL = 1
"""Copies kept at the end of each chain."""

MIN_COPIES = 8
"""Chains with fewer copies are planned whole (and a run must repeat this many times)."""

MIN_PERIOD = 4
"""The shortest period of a run (shorter ones are runs of elementwise ops, not layers)."""

MIN_REMOVED = 0.3
"""The reduced program must drop at least this fraction of the equations, else the whole
program is planned (the reduction and the following pass cost more than they save)."""

MAX_PERIODS = 12
"""Candidate periods tried (the most frequent distances between equations of one kind)."""


def enabled() -> bool:
    """Off with ``JSBP_REUSE_LAYERS=0`` (every equation planned on its own)."""
    return os.environ.get("JSBP_REUSE_LAYERS", "1").strip() != "0"


def plan(placement, jaxpr, consts, in_layouts, out_nd, strict, planner):
    """The program of ``jaxpr`` planned from its reduced copy by ``planner`` (``_compiler._search``'s
    signature), or None when ``JSBP_REUSE_LAYERS=0``, when it has no layers repeated often enough
    or when the reduction is not worth it (``_Repeats.reduce``): then the caller plans it whole.

    The reduced program's plan gives each kept equation's signature and hubs; each removed
    equation takes its stand-in's; one forward pass over the whole program (``_Inference.fixed``)
    follows them where they are legal for the layouts it sees and chooses afresh where not, so
    the result is a valid program by the ordinary rules."""
    from . import _compiler as C

    if not enabled():
        return None
    copies: dict = {}
    rep = _Repeats(jaxpr, copies)
    reduced = rep.reduce(consts, out_nd)
    if reduced is None:
        return None
    r_jaxpr, r_consts, r_out_nd, orig_of = reduced
    # the equation of the reduced program whose signature each removed one takes: the last head
    # copy's or, where the reduced program dropped that one, the nearest other kept copy's
    # (an equation the reduced program's DCE rebuilt, a loop with results dropped, is not among
    # them: the pass chooses it)
    planned = {id(e) for x in r_jaxpr.eqns if (e := orig_of.get(id(x))) is not None}
    used = {}
    for e, kept in rep.stand_in.items():
        r = next((r for r in kept if id(r) in planned), None)
        if r is not None:
            used[e] = r
    stands = Counter(
        id(r) for r in used.values()
    )  # id(equation) -> removed copies taking its signature
    weights = {
        id(x): 1 + stands[id(e)] for x in r_jaxpr.eqns if (e := orig_of.get(id(x))) is not None
    }
    cache: dict = {}
    plans = planner(
        placement,
        r_jaxpr,
        r_consts,
        in_layouts,
        r_out_nd,
        strict,
        cache,
        all_plans=True,
        weights=weights,
    )
    small = plans[0] if len(plans) == 1 else _best_for_whole(plans, orig_of, stands)
    decisions = {}
    for st in small.steps:
        e = orig_of.get(id(st.eqn))
        if e is not None:
            decisions[id(e)] = (
                tuple(l.nd_sbp for l in st.in_layouts),
                tuple(l.nd_sbp for l in st.out_layouts),
            )
    hubs = dict(small.hubs)
    for e, r in used.items():
        if id(r) not in decisions:
            continue
        decisions[id(e)] = decisions[id(r)]
        if hubs:  # a removed copy's values are served as its stand-in's are
            for v, w in zip([*rep.operands[e], *e.outvars], [*rep.operands[r], *r.outvars]):
                if (
                    not isinstance(v, (jcore.Literal, jcore.DropVar))
                    and v not in hubs
                    and not isinstance(w, jcore.Literal)
                    and w in hubs
                ):
                    hubs[v] = hubs[w]
    follow = C._Inference(placement, None, cache, strict=strict, copies=copies)
    follow.fixed, follow.hubs = decisions, hubs
    return follow.program(jaxpr, consts, in_layouts, out_nd)


def _best_for_whole(plans, orig_of, stands):
    """The plan of the reduced program (``plans[0]``: the search's) best for the whole one, as
    ``_planner.search`` ranks plans, but with each step's conversions counted once more for
    every removed equation that will take its signature: no costlier than the first plan by
    ``program_cost``, then the cheapest once combined collectives pay their latency once
    (``_planner.combined_cost``). A plan that saves bytes per layer but splits a combined
    collective pays that latency once per layer: on four copies it may win, on 24 not.
    ``stands``: id(equation) -> how many removed equations take its signature."""
    from ._boxing import COLLECTIVE_LATENCY_BYTES
    from ._compiler import program_cost
    from ._planner import combined_cost

    ranked = []
    for n, prog in enumerate(plans):
        combined, cost = combined_cost(prog), program_cost(prog)  # (combined_cost groups them)
        for st in prog.steps:
            w = stands.get(id(orig_of.get(id(st.eqn))))
            if not w:
                continue
            for bx in st.boxings:
                if bx.reused:
                    continue
                for m in bx.moves:
                    lat = COLLECTIVE_LATENCY_BYTES if m.collective else 0.0
                    cost += w * (m.bytes_per_device + lat)
                    combined += w * (m.bytes_per_device + (lat if bx.group is None else 0.0))
        ranked.append((cost, combined, n))
    ok = [r for r in ranked if r[0] <= ranked[0][0]]
    return plans[min(ok, key=lambda r: (r[1], r[0], r[2]))[2]]


class _Repeats:
    """The copies of ``jaxpr``'s repeated stretches (see the module docstring)."""

    def __init__(self, jaxpr, copies: dict):
        from . import _compiler as C

        self.jaxpr = jaxpr
        self.alias: dict = {}  # inlined body invar / call outvar -> the atom it stands for
        self.entries: list = []  # (equation as the passes meet it, its operands resolved)
        self.inner_consts: list = []  # (constvar, value) of inlined bodies
        self._flatten(jaxpr, copies, C)
        self.operands = {e: ins for e, ins in self.entries}
        self.made: dict = {}  # value -> (index of the entry making it, result position)
        for i, (e, _) in enumerate(self.entries):
            for j, v in enumerate(e.outvars):
                if not isinstance(v, jcore.DropVar):
                    self.made[v] = (i, j)
        self.stand_in: dict = {}  # removed equation -> the kept copy whose signature it takes
        kinds: dict = {}
        self.kind = []
        for e, _ in self.entries:
            k = C._eqn_key(e)
            self.kind.append(kinds.setdefault(k, len(kinds)) if k is not e else -1 - len(self.kind))

    def resolve(self, v):
        while not isinstance(v, jcore.Literal) and v in self.alias:
            v = self.alias[v]
        return v

    def _flatten(self, jaxpr, copies, C):
        for e in jaxpr.eqns:
            if C._static_handler(e) is C._infer_call:
                body, cs = copies.get(e) or copies.setdefault(
                    e, (C.fresh_vars(C.call_jaxpr(e)[0]), C.call_jaxpr(e)[1])
                )
                for bv, ov in zip(body.invars, e.invars):
                    self.alias[bv] = self.resolve(ov)
                self.inner_consts += list(zip(body.constvars, cs))
                self._flatten(body, copies, C)
                for ov, bv in zip(e.outvars, body.outvars):
                    if not isinstance(ov, jcore.DropVar):
                        self.alias[ov] = self.resolve(bv)
            else:
                self.entries.append((e, [self.resolve(v) for v in e.invars]))

    # ---------------------------------------------------------------------------------------
    def _runs(self) -> list[tuple[int, int, int]]:
        """(period, first, end) of each run taken: positions ``first <= i < end`` match ``i + period``."""
        kind, n = self.kind, len(self.kind)
        last: dict = {}
        dist: Counter = Counter()
        for i in range(n - 1, -1, -1):
            j = last.get(kind[i])
            if j is not None and j - i >= MIN_PERIOD:
                dist[j - i] += 1
            last[kind[i]] = i
        found = []
        for p, _ in dist.most_common(MAX_PERIODS):
            i = 0
            while i < n - p:
                if kind[i] != kind[i + p] or kind[i] < 0:
                    i += 1
                    continue
                j = i
                while j < n - p and kind[j] == kind[j + p] and kind[j] >= 0:
                    j += 1
                if j - i >= p * (MIN_COPIES - 1):
                    found.append((p, i, j))
                i = j
        # largest coverage first (a period and its multiples cover the same: the shortest first)
        found.sort(key=lambda r: (-(r[2] + r[0] - r[1]), r[0]))
        taken, used = [], []
        for p, a, b in found:
            if all(b + p <= a2 or b2 + p2 <= a for p2, a2, b2 in used):
                used.append((p, a, b))
                taken.append((p, a, b))
        return taken

    def _copies(self) -> list[tuple[int, int, int, bool]]:
        """The runs whose copies agree, as (period, first, end, reversed): ``reversed`` when
        the run visits the copies last to first (a backward pass)."""
        img: dict = {}  # value -> its next copy
        inv: dict = {}  # id(copy) -> the value it copies
        out = []
        for p, a, b in self._runs():
            pairs = [(i, i + p) for i in range(a, b)]
            m = self._value_pairs(pairs)
            if m is None:
                continue
            back = False
            if img:
                agree = sum(1 for v, w in m.items() if v is not w and img.get(v) is w)
                back = sum(1 for v, w in m.items() if v is not w and img.get(w) is v) > agree
                if back:
                    m = {w: v for v, w in m.items()}
            ok = True
            for v, w in m.items():  # a function and one-to-one, together with the runs taken
                if img.get(v, w) is not w or inv.get(id(w), v) is not v:
                    ok = False
                    break
            if not ok:
                continue
            for v, w in m.items():
                img[v] = w
                inv[id(w)] = v
            out.append((p, a, b, back))
        return out

    def _value_pairs(self, pairs):
        """value -> its copy, read off equation pairs position by position; None if a value
        would be the copy of two different ones, or two values copied to one (not a repetition
        after all)."""
        m: dict = {}
        inv: dict = {}
        entries = self.entries
        for i, j in pairs:
            (e, ins), (f, fins) = entries[i], entries[j]
            for v, w in zip([*ins, *e.outvars], [*fins, *f.outvars]):
                lv, lw = isinstance(v, jcore.Literal), isinstance(w, jcore.Literal)
                if lv or lw:
                    if not (lv and lw):
                        return None
                    continue
                if isinstance(v, jcore.DropVar) or isinstance(w, jcore.DropVar):
                    continue
                if m.setdefault(v, w) is not w or inv.setdefault(id(w), v) is not v:
                    return None
        return m

    def _align(self, runs, where):
        """Number every run's windows as the program's copies (``run[5]``, the shift): the
        forward run may start inside a layer and the backward one elsewhere in it, so window
        ``k`` of one is not window ``k`` of the other. A run's shift is the one most of the
        reads between it and the runs already numbered agree on (a layer's backward equations
        read that layer's forward values)."""
        made = self.made
        readers: dict = {}
        for i, (_, ins) in enumerate(self.entries):
            for v in ins:
                if not isinstance(v, jcore.Literal) and v in made:
                    readers.setdefault(made[v][0], []).append(i)
        done = {id(runs[0])}
        for run in runs[1:]:
            votes: Counter = Counter()
            a, end = run[1], run[2]
            for i in range(a, end):
                k = where[i][1]
                others = [
                    made[v][0]
                    for v in self.entries[i][1]
                    if not isinstance(v, jcore.Literal) and v in made
                ]
                for j in others + readers.get(i, []):
                    at = where.get(j)
                    if at is not None and id(at[0]) in done:
                        votes[at[1] + at[0][5] - k] += 1
            if votes:
                run[5] = votes.most_common(1)[0][0]
            done.add(id(run))

    # ---------------------------------------------------------------------------------------
    def reduce(self, consts, out_nd):
        """(jaxpr, consts, out_nd, id(reduced equation) -> the equation it stands for) of the
        reduced program, or None when it would not be worth it.

        A run of period ``p`` from ``a`` is cut into whole windows ``[a + k p, a + (k + 1) p)``,
        numbered in the order of the copies (the other way for a reversed run) and shifted to
        the program's copy numbers (``_align``). Of each run, the copies ``HEAD`` up to its last
        ``TAIL`` are removed, and each removed equation takes the signature of the one at its
        place in copy ``HEAD - 1`` (``stand_in``: then the other kept copies, nearest first).
        Whole windows rather than whole layers: a run need not start where a layer does."""
        entries = self.entries
        runs = []
        where: dict = {}  # flat index -> (run, its window in copy order, offset in it)
        for p, a, b, back in self._copies():
            n_win = (b + p - a) // p  # whole windows only: a last partial one is no copy
            if n_win < MIN_COPIES:
                continue
            run = [
                p,
                a,
                a + n_win * p,
                back,
                n_win,
                0,
            ]  # ..., shift: its window k is the program's copy k + shift
            for i in range(a, a + n_win * p):
                k, off = divmod(i - a, p)
                where[i] = (run, n_win - 1 - k if back else k, off)
            runs.append(run)
        if not runs:
            return None
        self._align(runs, where)
        low = min(r[5] for r in runs)
        for r in runs:
            r[5] -= low

        def kept_of(run):
            """The copies ``run`` keeps: the first ``HEAD`` of the program and its own last
            ``TAIL`` (a run may reach one copy further than another, into the model's head)."""
            end = run[5] + run[4]
            return list(range(HEAD)) + list(range(end - TAIL, end))

        def index(run, g, off):
            """The flat index at offset ``off`` of the program's copy ``g`` in ``run`` (or None)."""
            p, a, end, back, n_win, shift = run
            k = g - shift
            if not 0 <= k < n_win:
                return None
            i = a + (n_win - 1 - k if back else k) * p + off
            return i if a <= i < end else None

        removed = set()
        for i, (run, k, off) in where.items():
            g = k + run[5]
            if HEAD <= g < run[5] + run[4] - TAIL:
                removed.add(i)
                near = [
                    index(run, w, off) for w in (*range(HEAD - 1, -1, -1), *kept_of(run)[HEAD:])
                ]
                self.stand_in[entries[i][0]] = [entries[w][0] for w in near if w is not None]
        if len(removed) < MIN_REMOVED * len(entries):
            self.stand_in = {}
            return None
        made = self.made

        def substitute(u, v):
            """What kept equation ``u`` reads for value ``v`` in the reduced program (None: none)."""
            if isinstance(v, jcore.Literal) or v not in made:
                return v
            i, j = made[v]
            if i not in removed:
                return v
            run, k, off = where[i]
            g = k + run[5]
            target = index(run, HEAD - 1, off)  # the stand-in copy
            at = where.get(u)
            if at is not None:  # the same distance away, counted in kept copies
                gu = at[1] + at[0][5]
                rank = kept_of(at[0]).index(gu) + (g - gu)
                kept = kept_of(run)
                if 0 <= rank < len(kept):
                    target = index(run, kept[rank], off)
            return None if target is None or target >= u else entries[target][0].outvars[j]

        eqns, orig_of = [], {}
        for u, (e, ins) in enumerate(entries):
            if u in removed:
                continue
            new_ins = [substitute(u, v) for v in ins]
            if any(w is None for w in new_ins):
                self.stand_in = {}
                return None  # a removed value with no kept copy before its reader
            r = e if all(a is b for a, b in zip(new_ins, e.invars)) else e.replace(invars=new_ins)
            eqns.append(r)
            orig_of[id(r)] = e
        outvars, r_out_nd, out_at = [], [], []
        for k, v in enumerate(self.jaxpr.outvars):
            v = self.resolve(v)
            if not isinstance(v, jcore.Literal) and v in made and made[v][0] in removed:
                continue
            outvars.append(v)
            out_at.append(k)
            r_out_nd.append(None if out_nd is None else out_nd[k])
        constvars = list(self.jaxpr.constvars) + [v for v, _ in self.inner_consts]
        from . import _compiler as C

        try:  # the kept results' names, where this JAX's debug info can say them
            dbg = self.jaxpr.debug_info
            dbg = dbg._replace(result_paths=tuple(dbg.result_paths[k] for k in out_at))
        except Exception:
            dbg = None
        try:
            reduced = C._dce(
                self.jaxpr.replace(constvars=constvars, outvars=outvars, eqns=eqns, debug_info=dbg)
            )
        except Exception:  # pragma: no cover - a JAX whose Jaxpr will not take these: plan whole
            self.stand_in = {}
            return None
        return (
            reduced,
            list(consts) + [c for _, c in self.inner_consts],
            None if out_nd is None else r_out_nd,
            orig_of,
        )
