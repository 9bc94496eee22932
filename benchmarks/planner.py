"""Planner benchmark: the default signature search, the global planner (``JSBP_PLANNER=global``) and the
planning problem built from the jaxpr (``jsbp/_problem.py``), side by side.

Run from the repository root::

    python benchmarks/planner.py                        # every program below, then the timing rows
    python benchmarks/planner.py --only gpt,tests       # a subset of: gpt, training, zoo, tests
    python benchmarks/planner.py --timing-only          # only the planning-time rows
    python benchmarks/planner.py --record tests/data/plan_costs.json   # today's costs, for the test

It sets up 8 simulated CPU devices itself. For every program it builds a fresh ``jsbp.jit``
function under each planner, counts the collectives of the compiled program
(``jsbp.debug.count_collectives``) and adds up ``_compiler.program_cost`` (bytes per device plus
a 1 MiB latency per collective, the boxing planner's model) and the planning time of every
``infer`` call the lowering made. Programs:

* **gpt**: ``benchmarks/compiler.py``'s GPT train step (1 block) under DP, TP and DPxTP, with and
  without the hand-written layout hints;
* **training**: ``examples/train_gpt.py``'s model under ``benchmarks/training.py``'s strategies;
* **zoo**: ``tests/models`` (cnn, vit, lstm, scan_mlp, decoder_lm, moe) under the zoo's layouts
  (``tests/test_model_zoo.py::make_strategy``);
* **tests**: ``tests/test_compiler.py``'s search cases (matmuls, transformer steps).

The timing rows plan the un-hinted GPT train step with 1, 4, 16 and 24 blocks under DPxTP on a
(2, 4) placement and TP on (8,), cold (jsbp's memo caches emptied first): ``infer`` alone,
tracing excluded, the fastest of ``--reps`` (3) plans; each planner as ``jsbp.jit`` runs it
(from 8 blocks on, repeated layers are planned once: ``jsbp/_repeat.py``) and planning the whole
program (``JSBP_REUSE_LAYERS=0``). ``--hints 1,4`` (alone: ``--only hints --hints 1,4``) adds the un-hinted TP step's plans against the hinted step's,
costed on one problem (communication and compute) and timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks", ROOT / "tests", ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from _common import fmt_coll  # noqa: E402  (benchmarks/ is on sys.path)

import jsbp  # noqa: E402
from jsbp import _compiler, _jit, _lower, _planner  # noqa: E402
from jsbp._cost import estimate  # noqa: E402
from jsbp.debug import count_collectives  # noqa: E402

PLANNERS = ("search", "global", "new")
"""``search``: ``jsbp.jit``'s default; ``global``: ``JSBP_PLANNER=global``; ``new``: the problem
built from the jaxpr (``jsbp/_problem.py``), solved (``_solve``) and lowered (``_lower``), for
comparison (programs with a loop or a branch it does not express yet are left out)."""


# -------------------------------------------------------------------------------------------
# programs: name -> () -> (factory of a fresh jitted function, its arguments)
# -------------------------------------------------------------------------------------------


def gpt_programs(layers=1):
    import compiler as bc

    out = {}
    for strat in bc.strategies():
        short = strat.name.split()[0]
        for hinted in (False, True):

            def make(strat=strat, hinted=hinted):
                case = bc.Case(strat, (256, 64, 8, layers, 16, 32))
                return (lambda: case.jsbp_fn(hinted)), case.jsbp_args()

            out[f"gpt {short}{' +hints' if hinted else ''}"] = make
    return out


def training_programs():
    import training as bt

    out = {}
    for name, (parallel, zero, accum) in bt.STRATEGIES.items():

        def make(parallel=parallel, zero=zero, accum=accum):
            import train_gpt as tg
            from flax import nnx

            import jsbp.flax as jflax

            corpus = tg.Corpus()
            cfg = tg.GPTConfig(vocab=corpus.vocab)
            strategy = tg.make_strategy(tg.parse_parallel(parallel), zero)
            model, opt = jflax.shard(tg.init(cfg, 0), strategy)
            step = jflax.make_train_step(tg.loss_fn, strategy, accum=accum)
            graphdef, state = nnx.split((model, opt))
            batch = step.put_batch(next(corpus.batches(0, 32, cfg.seq)))
            return (lambda: step.pure(graphdef, state, batch)), (state, batch)

        out[f"training {name}"] = make
    return out


def zoo_programs():
    from models import MODELS, load
    from test_model_zoo import make_strategy

    out = {}
    for m in MODELS:
        for lay in ("dp8", "tp8", "dp2tp4", "zero3"):

            def make(m=m, lay=lay):
                import optax
                from flax import nnx

                import jsbp.flax as jflax

                mod = load(m)
                strategy = make_strategy(lay, mod.RULES)
                model = mod.make(nnx.Rngs(0))
                opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
                model, opt = jflax.shard((model, opt), strategy)
                step = jflax.make_train_step(mod.loss_fn, strategy)
                graphdef, state = nnx.split((model, opt))
                batch = step.put_batch(mod.batch(0))
                return (lambda: step.pure(graphdef, state, batch)), (state, batch)

            out[f"zoo {m} {lay}"] = make
    return out


def test_programs():
    import test_compiler as tc

    out = {}
    for name, case in tc._SEARCH_CASES.items():

        def make(case=case):
            fn, *_, args = case()
            return (lambda: jsbp.jit(fn)), args

        out[f"tests {name}"] = make
    return out


GROUPS = {
    "gpt": gpt_programs,
    "training": training_programs,
    "zoo": zoo_programs,
    "tests": test_programs,
}


# -------------------------------------------------------------------------------------------
# measuring
# -------------------------------------------------------------------------------------------


class _Capture:
    """Records every ``infer`` call ``jsbp.jit`` makes: the program and the seconds it took."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.orig = _lower.plan if _NEW[0] else _jit.infer

        def infer(*a, **k):
            t = time.perf_counter()
            prog = self.orig(*a, **k)
            self.calls.append((a, k, prog, time.perf_counter() - t))
            return prog

        _jit.infer = infer
        return self

    def __exit__(self, *exc):
        _jit.infer = _compiler.infer


_NEW = [False]  # whether ``_Capture`` plans with the new formulation


def set_planner(name: str) -> None:
    _NEW[0] = name == "new"
    if name == "global":
        os.environ["JSBP_PLANNER"] = "global"
    else:
        os.environ.pop("JSBP_PLANNER", None)


def compute_cost(prog, times: float = 1.0) -> float:
    """The global planner's compute charge of ``prog`` (``_planner._work``: one byte per flop a
    device does; a loop body's once per iteration, a ``while``'s ``WHILE_TRIPS`` times)."""
    total = 0.0
    for st in prog.steps:
        if st.kind == "prim":
            lays = (*st.in_layouts, *st.out_layouts)
            sig = (tuple(l.nd_sbp for l in st.in_layouts), tuple(l.nd_sbp for l in st.out_layouts))
            total += times * float(_planner._work(st.eqn, [sig], lays[0].placement.hierarchy)[0])
        trips = (
            st.eqn.params["length"]
            if st.kind == "scan"
            else _compiler.WHILE_TRIPS
            if st.kind == "while"
            else 1
        )
        for sub in _compiler.subprograms(st):
            total += compute_cost(sub, times * trips)
    return total


def measure(make, planners=PLANNERS) -> dict:
    """Per planner: program cost, collectives of the compiled program, planning seconds."""
    row = dict.fromkeys(PLANNERS)
    for planner in planners:
        set_planner(planner)
        factory, args = make()  # fresh: a train step caches its compiled function
        with _Capture() as cap:
            coll = count_collectives(factory(), *args)
        row[planner] = {
            "cost": sum(_compiler.program_cost(c[2]) for c in cap.calls),
            # as it runs: combined collectives once, a loop body's boxings once per iteration;
            # and the planner's compute charge of the plan (the rest of its objective)
            "combined": sum(_planner.combined_cost(c[2], loops=True) for c in cap.calls),
            "compute": sum(compute_cost(c[2]) for c in cap.calls),
            "collectives": sum(coll.values()),
            "by_kind": {k: v for k, v in coll.items() if v},
            "plan_s": sum(c[3] for c in cap.calls),
        }
        # the cost model's figures as the program runs (``jsbp._cost``): bytes per device and
        # collectives launched (a combined one once, a loop body's once per iteration)
        ests = [estimate(c[2]) for c in cap.calls]
        row[planner].update(
            comm_bytes=sum(e.comm_bytes for e in ests),
            launched=sum(e.collectives for e in ests),
            compiled=sum(e.compiled_collectives for e in ests),
            seconds=sum(e.seconds for e in ests),
        )
    set_planner("search")
    return row


def planning_times(layers_list=(1, 4, 16, 24), reps=1, strategy="DPxTP") -> list[dict]:
    """Cold ``infer`` time of the un-hinted GPT step under ``strategy`` (DP, TP or DPxTP of
    ``benchmarks/compiler.py``) with this many blocks, per planner."""
    import compiler as bc

    strat = [s for s in bc.strategies() if s.name.startswith(strategy)][0]
    rows = []
    for layers in layers_list:
        case = bc.Case(strat, (256, 64, 8, layers, 16, 32))
        set_planner("search")
        with _Capture() as cap:
            case.jsbp_fn().lower_program(*case.jsbp_args())
        a, k, _, _ = cap.calls[0]
        row = {"strategy": strategy, "layers": layers, "eqns": len(_compiler._dce(a[1]).eqns)}
        best = None
        for _ in range(reps):  # the new formulation (whole program: it has no repeated-layer path)
            bc.clear_jsbp_caches()
            gc.collect()
            t = time.perf_counter()
            prog = _lower.plan(*a, **k)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        row["new"] = {
            "plan_s": best,
            "cost": _compiler.program_cost(prog),
            "combined": _planner.combined_cost(prog),
        }
        for planner in ("search", "global"):
            for whole in (False, True):  # repeated layers planned once (jsbp/_repeat.py) or not
                set_planner(planner)
                if whole:
                    os.environ["JSBP_REUSE_LAYERS"] = "0"
                best = None
                for _ in range(reps):
                    bc.clear_jsbp_caches()
                    gc.collect()  # the earlier rows' garbage, not this plan's
                    t = time.perf_counter()
                    prog = _compiler.infer(*a, **k)
                    dt = time.perf_counter() - t
                    best = dt if best is None else min(best, dt)
                os.environ.pop("JSBP_REUSE_LAYERS", None)
                row[planner + (" whole" if whole else "")] = {
                    "plan_s": best,
                    "cost": _compiler.program_cost(prog),
                    "combined": _planner.combined_cost(
                        prog
                    ),  # as it runs: combined collectives once
                }
        set_planner("search")
        rows.append(row)
        print(f"  {layers} layers: {row}", file=sys.stderr, flush=True)
    return rows


def plan_on(prob, prog) -> list[int]:
    """The candidate of each node of ``prob`` that ``prog`` chose, ``prog`` planned from another
    trace of the same function (the hinted step: the same equations plus annotations), matched
    in program order by primitive and operand shapes."""
    sigs = [
        (
            st.eqn.primitive.name,
            tuple(tuple(v.aval.shape) for v in st.eqn.invars),
            (tuple(l.nd_sbp for l in st.in_layouts), tuple(l.nd_sbp for l in st.out_layouts)),
        )
        for _, st in _compiler.iter_steps(prog)
        if st.kind == "prim"
    ]
    j, choice = 0, []
    for n in prob.nodes:
        want = (n.eqn.primitive.name, tuple(tuple(v.aval.shape) for v in n.eqn.invars))
        while j < len(sigs) and sigs[j][:2] != want:
            j += 1
        if j == len(sigs):
            raise ValueError(f"no step of the program matches {want}")
        choice.append(n.cands.index(sigs[j][2]))  # (a ValueError if not a candidate here)
        j += 1
    return choice


def hint_rows(layers_list=(1, 4), strategy="TP", steps=30, timed=True) -> list[dict]:
    """The un-hinted GPT step's plans (search, global) against the hinted step's plan (search),
    all costed on the un-hinted step's problem (``_planner.build``): communication (the edges,
    without the anchor charge: the hints convert a parameter, which the un-hinted problem charges
    ``ANCHOR_BYTES`` to keep the user's layouts) and compute (the nodes: one byte per flop a
    device does), and their step times, interleaved."""
    import compiler as bc
    from _common import interleaved_medians

    strat = [s for s in bc.strategies() if s.name.startswith(strategy)][0]
    rows = []
    for layers in layers_list:
        case = bc.Case(strat, (256, 64, 8, layers, 16, 32))
        fns, progs = {}, {}
        for name, hinted, planner in (
            ("hinted", True, "search"),
            ("search", False, "search"),
            ("global", False, "global"),
        ):
            set_planner(planner)
            fns[name] = case.jsbp_fn(hinted)
            with _Capture() as cap:
                progs[name] = fns[name].lower_program(*case.jsbp_args()).program
            if name == "search":
                a, k = cap.calls[0][:2]
        set_planner("search")
        placement, jaxpr, consts, lays, out_nd = a
        jaxpr = _compiler._dce(jaxpr)
        inf = _compiler._Inference(placement, None, {}, frozenset(jaxpr.invars))
        prob = _planner.build(inf, inf.program(jaxpr, consts, lays, out_nd), jaxpr, out_nd)
        for val in prob.values.values():
            val.anchored, val.costs = False, None
        row = {"strategy": strategy, "layers": layers}
        for name, prog in progs.items():
            choice = plan_on(prob, prog)
            compute = float(sum(n.cost[c] for n, c in zip(prob.nodes, choice)))
            row[name] = {
                "cost": _compiler.program_cost(prog),
                "combined": _planner.combined_cost(prog),
                "compute": compute,
                "objective": _planner.objective(prob, choice),
            }
        rows.append(row)
        if not timed:
            continue
        order = list(fns)

        def stepper(f):
            def step(state, tok):
                loss, p, o = f(*state, tok)
                return (p, o), loss

            return step

        args = case.jsbp_args()
        ms, _ = interleaved_medians(
            [stepper(fns[n]) for n in order], [args[:2]] * 3, [args[2]] * 3, steps=steps, warmup=3
        )
        for n, t in zip(order, ms):
            row[n]["step_ms"] = t
        print(f"  hints, {layers} layers: {row}", file=sys.stderr, flush=True)
    return rows


def hint_table(rows) -> str:
    lines = [
        "| step | blocks | plan | communication (MB-eq) | combined (MB-eq) | compute (MB-eq) | "
        "objective (MB-eq) | step (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, label in (
            ("hinted", "hinted (search)"),
            ("search", "un-hinted, search"),
            ("global", "un-hinted, global"),
        ):
            x = r[name]
            lines.append(
                f"| {r['strategy']} | {r['layers']} | {label} | {x['cost'] / 1e6:.2f} | "
                f"{x['combined'] / 1e6:.2f} | {x['compute'] / 1e6:.2f} | {x['objective'] / 1e6:.2f} | "
                f"{x['step_ms']:.2f} |"
            )
    return "\n".join(lines)


def cost_table(results: dict) -> str:
    """Per program and planner: the cost as run by the cost model (bytes per device + one
    ``latency_bytes`` per collective launched; MB-eq), the compiled collectives and the planning
    seconds. ``-``: a program the planner does not express yet."""
    lat = jsbp.CostModel().latency_bytes
    lines = [
        "| program | "
        + " | ".join(f"{p} as run (MB-eq) | {p} collectives | {p} plan (s)" for p in PLANNERS)
        + " |",
        "|---|" + "---|" * (3 * len(PLANNERS)),
    ]
    for name, r in results.items():
        cells = []
        for p in PLANNERS:
            x = r.get(p)
            if x is None:
                cells += ["-", "-", "-"]
                continue
            cells += [
                f"{(x['comm_bytes'] + lat * x['launched']) / 1e6:.3f}",
                f"{x['collectives']} ({fmt_coll(x['by_kind'])})",
                f"{x['plan_s']:.2f}",
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_table(rows) -> str:
    """Planning time and plan cost per step and depth: each planner as ``jsbp.jit`` runs it
    (repeated layers planned once, ``jsbp/_repeat.py``) and planning the whole program
    (``JSBP_REUSE_LAYERS=0``)."""
    lines = [
        "| step | blocks | equations | search plan (s) | global plan (s) | search, whole (s) | "
        "global, whole (s) | new (s) | search cost / combined (MB-eq) | global cost / combined (MB-eq) | "
        "global whole cost / combined (MB-eq) | new cost / combined (MB-eq) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:

        def cc(x):
            return f"{x['cost'] / 1e6:.2f} / {x['combined'] / 1e6:.2f}"

        lines.append(
            f"| {r['strategy']} | {r['layers']} | {r['eqns']} | {r['search']['plan_s']:.2f} | {r['global']['plan_s']:.2f} | "
            f"{r['search whole']['plan_s']:.2f} | {r['global whole']['plan_s']:.2f} | {r['new']['plan_s']:.2f} | "
            f"{cc(r['search'])} | {cc(r['global'])} | {cc(r['global whole'])} | {cc(r['new'])} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(GROUPS))
    ap.add_argument(
        "--planners",
        default=",".join(PLANNERS),
        help="comma-separated subset of " + ",".join(PLANNERS),
    )
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--layers", default="1,4,16,24", help="blocks of the timing rows")
    ap.add_argument(
        "--timing-steps", default="DPxTP,TP", help="un-hinted GPT steps of the timing rows"
    )
    ap.add_argument(
        "--reps", type=int, default=3, help="plans per timing row (the fastest is reported)"
    )
    ap.add_argument(
        "--record",
        default="",
        help="merge the search planner's costs of the programs into this JSON file",
    )
    ap.add_argument("--json", default="", help="write all results here (JSON)")
    ap.add_argument(
        "--hints",
        default="",
        help="blocks of the hinted vs un-hinted TP rows (e.g. 1,4); alone with --only hints",
    )
    args = ap.parse_args(argv)
    print(
        f"# jsbp planner benchmark: {jax.device_count()} simulated CPU devices, {os.cpu_count()} CPU cores, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results, rows = {}, []
    if not args.timing_only and args.only != "hints":
        for group in [
            g for g in (args.only.split(",") if args.only else GROUPS) if g and g != "hints"
        ]:
            for name, make in GROUPS[group]().items():
                results[name] = measure(make, tuple(args.planners.split(",")))
                r = results[name]
                print(
                    f"  {name}: "
                    + " | ".join(
                        f"{p} "
                        + (
                            "-"
                            if r[p] is None
                            else f"{r[p]['comm_bytes'] / 1e6:.3f} MB / {r[p]['launched']} "
                            f"launched / {r[p]['collectives']} compiled"
                        )
                        for p in PLANNERS
                    ),
                    file=sys.stderr,
                    flush=True,
                )
        print(cost_table(results))
    if not args.no_timing and args.only != "hints":
        rows = [
            r
            for st in args.timing_steps.split(",")
            for r in planning_times(
                tuple(int(x) for x in args.layers.split(",")), reps=args.reps, strategy=st
            )
        ]
        print()
        print(time_table(rows))
    hints = []
    if args.hints:
        hints = hint_rows(tuple(int(x) for x in args.hints.split(",")))
        print()
        print(hint_table(hints))
    if args.record:  # merged into what the file already holds
        path = pathlib.Path(args.record)
        table = json.loads(path.read_text()) if path.exists() else {}
        keep = ("cost", "collectives", "comm_bytes", "launched", "seconds")
        table.update(
            {
                name: {
                    **{k: r["search"][k] for k in keep},
                    "global": {k: r["global"][k] for k in keep},
                }
                for name, r in results.items()
            }
        )
        path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps({"costs": results, "timing": rows, "hints": hints}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
