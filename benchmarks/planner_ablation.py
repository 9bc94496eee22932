"""Which of the search's heuristics the global planner makes unnecessary: every program of
``benchmarks/planner.py`` planned by both planners with one heuristic switched off at a time.

Run from the repository root::

    python benchmarks/planner_ablation.py                                # all programs, all heuristics (~50 min)
    python benchmarks/planner_ablation.py --only "gpt TP +hints" --heuristics tie-breakers

Issue 20 asks to delete the heuristics of ``jsbp/_compiler.py`` that the global choice makes
unnecessary. The search (the default planner) is built of them; the global planner
(``JSBP_PLANNER=global``) starts from the search's plan. A heuristic is unnecessary to the global
planner if, switched off, no program's global plan gets dearer. Each is switched off by patching
the module (``HEURISTICS``); nothing in the library reads a switch.

Per heuristic and planner, the programs whose plan got dearer / cheaper than with every heuristic
on, by three measures: ``program_cost`` (MB-eq, what ``tests/data/plan_costs.json`` records),
**as run** (``_planner.combined_cost``: small collectives combined, a loop body's once per
iteration) and **as run + compute** (the global planner's whole objective: also one byte per
flop a device does, ``benchmarks/planner.py``'s ``compute_cost``); then, per heuristic, the
programs whose global plan got dearer as run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import compiler as bc  # benchmarks/compiler.py
import planner as bp  # benchmarks/planner.py: sets up 8 CPU devices and sys.path

from jsbp import _compiler

HEURISTICS = {
    # name: (what switching it off means, {attribute of jsbp._compiler: value})
    "lookahead": (
        "no lookahead pass (the backward demand walk and the forward pass charging "
        "each candidate the boxing of its outputs)",
        {"LOOKAHEAD_ROUNDS": 0},
    ),
    "free seed": (
        "the anchored seed alone (a zero budget stops the free seed at its first conversion)",
        {"SEED_SLACK": 0.0},
    ),
    "carry-through": (
        "an elementwise equation does not pass its output's one wanted layout on to its "
        "operands in the backward walk",
        {"_carry_through": lambda eqn, cands, demand: None},
    ),
    "producer depth": (
        "the backward walk does not look through producers for a layout had without boxing",
        {"PRODUCER_DEPTH": 0},
    ),
    "walk sweeps": ("one backward sweep per walk instead of two", {"WALK_SWEEPS": 1}),
    "made anyway": (
        "a conversion another consumer asked for is not free",
        {"_asked_by_another": lambda want, v, nd, eqn: False},
    ),
    "tie-breakers": (
        "candidates of equal cost are not ranked by partial outputs and new splits",
        {"_tie_break": lambda ins, outs, naxes: (0, 0)},
    ),
    "tie rank": (
        "a lookahead pass of equal cost is not ranked by its combined collectives and local "
        "slices (the earlier pass is kept)",
        {"_tie_rank": lambda prog: (0.0, 0)},
    ),
    "compute-heavy as is": (
        "a matmul / convolution that can run on its operands as they are may box them "
        "for the lookahead",
        {"_COMPUTE_HEAVY": frozenset()},
    ),
}

MEASURES = ("cost", "as run", "as run + compute")
TOL = 1e4  # bytes: differences below this are the same plan costed in another order


@contextlib.contextmanager
def switched_off(name):
    saved = {}
    try:
        for attr, value in HEURISTICS[name][1].items():
            saved[attr] = getattr(_compiler, attr)
            setattr(_compiler, attr, value)
        yield
    finally:
        for attr, value in saved.items():
            setattr(_compiler, attr, value)


def measures(x) -> dict:
    return {
        "cost": x["cost"],
        "as run": x["combined"],
        "as run + compute": x["combined"] + x["compute"],
    }


def plan_all(progs) -> dict:
    out = {}
    for name, make in progs.items():
        bc.clear_jsbp_caches()
        out[name] = bp.measure(make)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated program names (default: all of benchmarks/planner.py's)",
    )
    ap.add_argument(
        "--heuristics",
        default=",".join(HEURISTICS),
        help="comma-separated subset of " + ",".join(HEURISTICS),
    )
    ap.add_argument("--json", default="", help="write all results here (JSON)")
    args = ap.parse_args(argv)
    progs = {}
    for make in bp.GROUPS.values():
        progs.update(make())
    if args.only:
        progs = {name: progs[name] for name in args.only.split(",")}
    names = [h for h in args.heuristics.split(",") if h]
    unknown = [h for h in names if h not in HEURISTICS]
    if unknown:
        ap.error(f"unknown heuristics {unknown}; choose from {list(HEURISTICS)}")
    results = {"": plan_all(progs)}
    for h in names:
        with switched_off(h):
            results[h] = plan_all(progs)
        print(f"  {h}: done", file=sys.stderr, flush=True)
    base = results[""]
    print(
        f"# {len(progs)} programs; per measure: programs dearer / cheaper than with every heuristic on"
    )
    print(
        "| heuristic switched off | planner | "
        + " | ".join(MEASURES)
        + " |\n|---|---|"
        + "---|" * len(MEASURES)
    )
    worse = []
    for h in names:
        for planner in bp.PLANNERS:
            cells = []
            for m in MEASURES:
                d = [
                    measures(results[h][p][planner])[m] - measures(base[p][planner])[m]
                    for p in progs
                ]
                cells.append(f"{sum(x > TOL for x in d)} / {sum(x < -TOL for x in d)}")
            print(f"| {h} | {planner} | " + " | ".join(cells) + " |")
        for p in progs:
            a, b = measures(base[p]["global"]), measures(results[h][p]["global"])
            if b["as run"] > a["as run"] + TOL:
                worse.append(
                    f"| {h} | {p} | {a['as run'] / 1e6:.2f} -> {b['as run'] / 1e6:.2f} | "
                    f"{a['as run + compute'] / 1e6:.2f} -> {b['as run + compute'] / 1e6:.2f} |"
                )
    print(
        "\n| heuristic switched off | program | global plan as run (MB-eq) | as run + compute (MB-eq) |\n|---|---|---|---|"
    )
    print("\n".join(worse) if worse else "| (none) | | | |")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
