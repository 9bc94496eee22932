"""What the global planner owes its start: the same programs planned globally from three starts.

Run from the repository root::

    python benchmarks/planner_starts.py                      # the programs below
    python benchmarks/planner_starts.py --only "gpt DPxTP"   # any of benchmarks/planner.py's programs

The global planner (``JSBP_PLANNER=global``, ``docs/planner.md``) starts from the search's plan,
which its heuristics make (``_compiler._search``: lookahead passes, two seeds); issue 20 asks to
delete the heuristics the global choice makes unnecessary. This measures whether it can do
without them. Starts:

* **search**: as ``jsbp.jit`` plans today (the search's best plan);
* **greedy**: the anchored seed's greedy pass alone (no lookahead pass, no free seed);
* **greedy+axes** (2-d placements): greedy, and ``by_axis`` run a second time from a start made
  of each placement axis solved *alone*, every other axis replicated (exactly: ``milp`` where the
  relaxation is fractional), the per-axis answers combined node by node; the cheaper of the two
  by the solver's objective.

Per start: ``program_cost`` (MB-eq), the same as the program runs (``_planner.combined_cost``:
small collectives combined, a loop body's once per iteration; what the global planner ranks its
plans by last), the compiled collectives and the seconds in ``infer``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys

import planner as bp  # benchmarks/planner.py: sets up 8 CPU devices and sys.path

from jsbp import _compiler, _planner, _sbp
from jsbp.debug import count_collectives

PROGRAMS = ("gpt TP +hints", "gpt DPxTP", "training dp2_tp4", "zoo cnn dp2tp4", "zoo scan_mlp dp2tp4",
            "zoo moe dp2tp4", "tests hybrid_2x4")


def _anchored_greedy(placement, jaxpr, consts, in_layouts, out_nd=None, strict=False, cache=None):
    """``_compiler._search_pass`` without the free seed (and, with ``LOOKAHEAD_ROUNDS = 0``, without
    lookahead passes): the anchored seed's greedy pass."""
    args = (jaxpr, consts, in_layouts, out_nd)
    inf = _compiler._Inference(placement, None, {} if cache is None else cache, frozenset(jaxpr.invars),
                               strict=strict)
    inf.diverged = False
    prog = inf.program(*args)
    if not inf.diverged:
        inf.anchored = frozenset()
    return _compiler._refine(inf, prog, args)[::2]


AXIS_TIME_LIMIT = [_planner.ILP_TIME_LIMIT]  # ``--axis-time-limit``


def _axis_alone(prob, axis):
    """``prob``'s choice with every axis but ``axis`` replicated (nodes without such a candidate
    keep all theirs), solved exactly; None where the solver has no answer. Fixed layouts (inputs,
    wanted outputs) are seen on ``axis`` only: held whole on the other axes they would be charged
    ``ANCHOR_BYTES`` (2**40) at every reader, and HiGHS then reported the data axis' relaxation
    unbounded (numerically) on the GPT step, so that only ``milp`` answered, in 6-10 s."""
    ndim = len(prob.hierarchy)
    keep = []
    for n in prob.nodes:
        ks = [s for s, (ins, outs) in enumerate(n.cands)
              if all(nd[b] == _sbp.broadcast for nd in (*ins, *outs) for b in range(ndim) if b != axis)]
        keep.append(ks or list(range(len(n.cands))))
    nodes = [dataclasses.replace(n, cands=[n.cands[s] for s in ks], cost=n.cost[ks], kind=(n.kind, "alone", tuple(ks)))
             for n, ks in zip(prob.nodes, keep)]

    def proj(nd):  # a fixed layout as the axis alone sees it: every other axis replicated
        return None if nd is None else tuple(x if b == axis else _sbp.broadcast for b, x in enumerate(nd))

    values = {k: dataclasses.replace(v, nd=proj(v.nd), own=[proj(t) for t in v.own], shared={proj(t) for t in v.shared},
                                     costs=None)
              for k, v in prob.values.items()}
    sub = _planner.Problem(prob.hierarchy, nodes, values, prob._cost_cache)
    if not _planner._exact_fits(sub):
        return None
    got = _planner.solve_ilp(sub, quick=True) or _planner.solve_ilp(sub, time_limit=AXIS_TIME_LIMIT[0])
    return None if got is None else [ks[g] for ks, g in zip(keep, got)]


def _by_axis_from_axes(orig):
    def by_axis(prob, start, sweeps=_planner.AXIS_SWEEPS):
        best = orig(prob, start, sweeps)
        sols = [_axis_alone(prob, a) for a in range(len(prob.hierarchy))]
        comb = []
        for u, n in enumerate(prob.nodes):
            want = [tuple(nd[a] for nd in (*n.cands[s[u]][0], *n.cands[s[u]][1])) if s else None
                    for a, s in enumerate(sols)]
            pick = next((c for c, (ins, outs) in enumerate(n.cands)
                         if all(w is None or tuple(nd[a] for nd in (*ins, *outs)) == w for a, w in enumerate(want))),
                        start[u])
            comb.append(pick)
        other = orig(prob, comb, sweeps)
        if _planner.objective(prob, other, hubs=False) < _planner.objective(prob, best, hubs=False) - 1e-6:
            return other
        return best
    return by_axis


@contextlib.contextmanager
def start(name):
    saved = (_compiler.LOOKAHEAD_ROUNDS, _compiler._search_pass, _planner.by_axis)
    try:
        if name != "search":
            _compiler.LOOKAHEAD_ROUNDS = 0
            _compiler._search_pass = _anchored_greedy
        if name == "greedy+axes":
            _planner.by_axis = _by_axis_from_axes(saved[2])
        yield
    finally:
        _compiler.LOOKAHEAD_ROUNDS, _compiler._search_pass, _planner.by_axis = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(PROGRAMS), help="comma-separated program names")
    ap.add_argument("--axis-time-limit", type=float, default=_planner.ILP_TIME_LIMIT,
                    help="seconds for each axis solved alone (milp); 1 and 2.5 found no plan for the GPT's data axis")
    args = ap.parse_args(argv)
    AXIS_TIME_LIMIT[0] = args.axis_time_limit
    progs = {}
    for make in bp.GROUPS.values():
        progs.update(make())
    bp.set_planner("global")
    print("| program | start | cost (MB-eq) | as run (MB-eq) | collectives | plan (s) |\n|---|---|---|---|---|---|")
    for name in args.only.split(","):
        for s in ("search", "greedy", "greedy+axes"):
            with start(s):
                factory, fargs = progs[name]()
                with bp._Capture() as cap:
                    coll = count_collectives(factory(), *fargs)
            cost = sum(_compiler.program_cost(c[2]) for c in cap.calls) / 1e6
            run = sum(_planner.combined_cost(_compiler._copy_program(c[2]), loops=True) for c in cap.calls) / 1e6
            print(f"| {name} | {s} | {cost:.2f} | {run:.2f} | {sum(coll.values())} ({bp.fmt_coll({k: v for k, v in coll.items() if v})}) | {sum(c[3] for c in cap.calls):.2f} |",
                  flush=True)
    bp.set_planner("search")
    return 0


if __name__ == "__main__":
    sys.exit(main())
