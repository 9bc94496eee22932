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

PROGRAMS = (
    "gpt TP +hints",
    "gpt DPxTP",
    "training dp2_tp4",
    "zoo cnn dp2tp4",
    "zoo scan_mlp dp2tp4",
    "zoo moe dp2tp4",
    "tests hybrid_2x4",
)


def _on(sig, axis):
    """A signature's part on one placement axis (every operand's and result's sbp there)."""
    ins, outs = sig
    return tuple(nd[axis] for nd in (*ins, *outs))


def _axis_alone(prob, axis, time_limit):
    """``prob``'s choice with every axis but ``axis`` replicated (nodes without such a candidate
    keep all theirs), solved exactly; None where the solver has no answer. Fixed layouts (inputs,
    wanted outputs) are seen on ``axis`` only: held whole on the other axes they would be charged
    ``ANCHOR_BYTES`` (2**40) at every reader, and HiGHS then reported the data axis' relaxation
    unbounded (numerically) on the GPT step, so that only ``milp`` answered, in 6-10 s.
    ``time_limit``: ``milp``'s, where a relaxation is fractional."""
    others = [b for b in range(len(prob.hierarchy)) if b != axis]
    keep = []
    for n in prob.nodes:
        ks = [
            s
            for s, sig in enumerate(n.cands)
            if all(x == _sbp.broadcast for b in others for x in _on(sig, b))
        ]
        keep.append(ks or list(range(len(n.cands))))

    def proj(nd):  # a fixed layout as the axis alone sees it: every other axis replicated
        return (
            None
            if nd is None
            else tuple(x if b == axis else _sbp.broadcast for b, x in enumerate(nd))
        )

    values = {
        k: dataclasses.replace(
            v,
            nd=proj(v.nd),
            own=[proj(t) for t in v.own],
            shared={proj(t) for t in v.shared},
            costs=None,
        )
        for k, v in prob.values.items()
    }
    sub = _planner.restrict(prob, keep, values)
    if not _planner._exact_fits(sub):
        return None
    got = _planner.solve_ilp(sub, quick=True) or _planner.solve_ilp(sub, time_limit=time_limit)
    return None if got is None else [ks[g] for ks, g in zip(keep, got)]


def _by_axis_from_axes(orig, time_limit):
    def by_axis(prob, start, sweeps=_planner.AXIS_SWEEPS):
        best = orig(prob, start, sweeps)
        sols = [_axis_alone(prob, a, time_limit) for a in range(len(prob.hierarchy))]
        comb = []
        for u, n in enumerate(prob.nodes):
            want = [_on(n.cands[s[u]], a) if s else None for a, s in enumerate(sols)]
            comb.append(
                next(
                    (
                        c
                        for c, sig in enumerate(n.cands)
                        if all(w is None or _on(sig, a) == w for a, w in enumerate(want))
                    ),
                    start[u],
                )
            )
        other = orig(prob, comb, sweeps)
        if (
            _planner.objective(prob, other, hubs=False)
            < _planner.objective(prob, best, hubs=False) - 1e-6
        ):
            return other
        return best

    return by_axis


@contextlib.contextmanager
def start(name, time_limit=_planner.ILP_TIME_LIMIT):
    saved = (_compiler.LOOKAHEAD_ROUNDS, _compiler.SEED_SLACK, _planner.by_axis)
    try:
        if name != "search":
            # no lookahead pass; a zero budget stops the free seed at its first conversion
            # (``_compiler._search_pass``), leaving the anchored seed's greedy pass
            _compiler.LOOKAHEAD_ROUNDS, _compiler.SEED_SLACK = 0, 0.0
        if name == "greedy+axes":
            _planner.by_axis = _by_axis_from_axes(saved[2], time_limit)
        yield
    finally:
        _compiler.LOOKAHEAD_ROUNDS, _compiler.SEED_SLACK, _planner.by_axis = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(PROGRAMS), help="comma-separated program names")
    ap.add_argument(
        "--axis-time-limit",
        type=float,
        default=_planner.ILP_TIME_LIMIT,
        help="seconds for milp where an axis solved alone has a fractional relaxation",
    )
    args = ap.parse_args(argv)
    progs = {}
    for make in bp.GROUPS.values():
        progs.update(make())
    bp.set_planner("global")
    print(
        "| program | start | cost (MB-eq) | as run (MB-eq) | collectives | plan (s) |\n|---|---|---|---|---|---|"
    )
    for name in args.only.split(","):
        for s in ("search", "greedy", "greedy+axes"):
            with start(s, args.axis_time_limit):
                factory, fargs = progs[name]()
                with bp._Capture() as cap:
                    coll = count_collectives(factory(), *fargs)
            cost = sum(_compiler.program_cost(c[2]) for c in cap.calls) / 1e6
            # (``infer`` already combined them; ``combined_cost`` redoes that, idempotently, and counts)
            run = sum(_planner.combined_cost(c[2], loops=True) for c in cap.calls) / 1e6
            print(
                f"| {name} | {s} | {cost:.2f} | {run:.2f} | {sum(coll.values())} ({bp.fmt_coll({k: v for k, v in coll.items() if v})}) | {sum(c[3] for c in cap.calls):.2f} |",
                flush=True,
            )
    bp.set_planner("search")
    return 0


if __name__ == "__main__":
    sys.exit(main())
