"""Planner benchmark: the plans ``jsbp.jit`` makes for 43 programs, against the plans recorded in
``tests/data/plan_costs.json``, and the time it takes to plan deeper GPT steps.

Run from the repository root::

    python benchmarks/planner.py                    # every program below, then the timing rows
    python benchmarks/planner.py --quick            # a handful of programs, 1 and 4 blocks
    python benchmarks/planner.py --only gpt,tests   # a subset of: gpt, training, zoo, tests
    python benchmarks/planner.py --no-timing        # only the programs' table
    python benchmarks/planner.py --timing-only --layers 1,4,16,24,48 --reps 3
    python benchmarks/planner.py --json planner.json   # also write every figure as JSON

It sets up 8 simulated CPU devices itself. Only jsbp's public API is used to measure. For every
program it builds a fresh ``jsbp.jit`` function, empties jsbp's and JAX's caches and times
``lower_program`` (trace + plan, as a fresh process's first call does before compiling), then
reads the plan's figures:

* **as run**: ``jsbp.debug.estimate``: bytes received per device plus ``CostModel().latency_bytes``
  (56 000 bytes: 0.28 ms at 2e8 B/s) per collective launched (a combined collective once, a loop
  body's once per iteration), in MB-equivalents (/1e6);
* **collectives**: ``jsbp.debug.count_collectives`` of the compiled program (``jsbp.explain``'s
  count of the plan is checked against it);

beside the same two figures of the plan recorded in ``tests/data/plan_costs.json`` (``comm_bytes``,
``launched`` and ``collectives``: the recorded plans, the reference the new plans are held to).
A plan dearer as run is listed with its **predicted step** (``estimate``'s seconds, recorded as
``seconds``): the cost model's step time, which also counts the compute a layout spreads or
repeats, what the planner minimizes beside the bytes. Programs:

* **gpt**: ``benchmarks/compiler.py``'s GPT train step (1 block, d_model 64) under DP, TP and
  DPxTP, with and without the hand-written layout hints;
* **training**: ``examples/train_gpt.py``'s model under ``benchmarks/training.py``'s strategies;
* **zoo**: ``tests/models`` (cnn, vit, lstm, scan_mlp, decoder_lm, moe) under the zoo's layouts
  (``tests/test_model_zoo.py::make_strategy``);
* **tests**: matmuls and the transformer train steps of ``tests/test_compiler.py``.

The timing rows plan the un-hinted DPxTP GPT step of ``benchmarks/compiler.py`` on a (2, 4)
placement with 1, 4, 16, 24 and 48 blocks, cold (a fresh function, jsbp's and JAX's caches
emptied): the fastest of ``--reps`` (3) ``lower_program`` calls (fewer once a row has taken a
minute), and of that call the seconds spent in the planner itself (the one private hook:
``jsbp._jit.plan`` is wrapped to time it). ``--quick`` times 1 and 4 blocks, one plan each.
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
from jsbp.debug import count_collectives, estimate  # noqa: E402

RECORDED = ROOT / "tests" / "data" / "plan_costs.json"
LATENCY_BYTES = jsbp.CostModel().latency_bytes
ROW_BUDGET_S = 60.0  # a timing row plans no more once its cold plans have taken this long
QUICK = (
    "gpt DP",
    "gpt DPxTP",
    "zoo cnn dp2tp4",
    "tests matmul_dp",
    "tests matmul_zero",
    "tests tp",
)


# -------------------------------------------------------------------------------------------
# programs: name -> () -> (a fresh jsbp.jit function, its arguments)
# -------------------------------------------------------------------------------------------


def gpt_programs():
    import compiler as bc

    out = {}
    for strat in bc.strategies():
        short = strat.name.split()[0]
        for hinted in (False, True):

            def make(strat=strat, hinted=hinted):
                case = bc.Case(strat, (256, 64, 8, 1, 16, 32))
                return case.jsbp_fn(hinted), case.jsbp_args()

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
            return step.pure(graphdef, state, batch), (state, batch)

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
                return step.pure(graphdef, state, batch), (state, batch)

            out[f"zoo {m} {lay}"] = make
    return out


def test_programs():
    import jax.numpy as jnp
    import test_compiler as tc

    cases = {
        "matmul_dp": lambda: (
            lambda x, w: jnp.tanh(x @ w).sum(0),
            (tc.gt(tc.rand(32, 8), tc.P4, "S(0)"), tc.gt(tc.rand(8, 8), tc.P4, "B")),
        ),
        "matmul_zero": lambda: (
            lambda x, w: jnp.tanh(x) @ w,
            (tc.gt(tc.rand(64, 8), tc.P4, "S(0)"), tc.gt(tc.rand(8, 8), tc.P4, "S(1)")),
        ),
    }
    for s in ("dp", "tp", "zero3", "hybrid_2x4"):
        cases[s] = lambda s=s: (lambda c: (c[0], c[2]))(tc._transformer_step_case(s))
    out = {}
    for name, case in cases.items():

        def make(case=case):
            fn, args = case()
            return jsbp.jit(fn), args

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


def clear_caches() -> None:
    """A fresh process's state: JAX's caches and jsbp's module-level memo caches emptied, and the
    earlier programs' garbage collected (not charged to this plan)."""
    import compiler as bc

    jax.clear_caches()
    bc.clear_jsbp_caches()
    gc.collect()


class _PlanTimer:
    """Seconds spent in the planner (``jsbp._jit.plan``) while active: the only private hook."""

    def __enter__(self):
        from jsbp import _jit

        self.mod, self.orig, self.seconds = _jit, _jit.plan, 0.0

        def plan(*a, **k):
            t = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t

        _jit.plan = plan
        return self

    def __exit__(self, *exc):
        self.mod.plan = self.orig


def as_run(comm_bytes: float, launched: int) -> float:
    """Bytes per device plus one collective's latency in bytes per collective launched (MB-eq)."""
    return (comm_bytes + LATENCY_BYTES * launched) / 1e6


def recorded(name: str, table: dict) -> dict | None:
    r = table.get(name)
    if r is None or "comm_bytes" not in r:
        return None
    return {
        "as_run": as_run(r["comm_bytes"], r["launched"]),
        "comm_bytes": r["comm_bytes"],
        "launched": r["launched"],
        "collectives": r["collectives"],
        "seconds": r.get("seconds"),
    }


def measure(make) -> dict:
    """The plan of one program: its figures as run, its compiled collectives, its planning time."""
    fn, args = make()
    clear_caches()
    t = time.perf_counter()
    entry = fn.lower_program(*args)
    plan_s = time.perf_counter() - t
    est = estimate(fn, *args)  # the planned program (cached): nothing is planned again
    planned = jsbp.explain(fn, *args).collectives()
    coll = count_collectives(fn, *args)
    if sum(planned.values()) != sum(coll.values()):
        print(
            f"    note: jsbp.explain lists {sum(planned.values())} collectives, "
            f"the compiled program has {sum(coll.values())}",
            file=sys.stderr,
        )
    return {
        "as_run": as_run(est.comm_bytes, est.collectives),
        "comm_bytes": est.comm_bytes,
        "launched": est.collectives,
        "collectives": sum(coll.values()),
        "planned_collectives": sum(planned.values()),
        "by_kind": {k: v for k, v in coll.items() if v},
        "seconds": est.seconds,
        "equations": len(entry.program.steps),
        "plan_s": plan_s,
    }


def planning_times(layers_list, reps: int) -> list[dict]:
    """Cold ``lower_program`` of the un-hinted DPxTP GPT step with this many blocks: the fastest
    of up to ``reps`` calls (no further call once a row has taken ``ROW_BUDGET_S``), and the
    planner's share of that call."""
    import compiler as bc

    strat = [s for s in bc.strategies() if s.name.startswith("DPxTP")][0]
    rows = []
    for layers in layers_list:
        case = bc.Case(strat, (256, 64, 8, layers, 16, 32))
        best, spent, plans = None, 0.0, 0
        for _ in range(reps):
            if spent > ROW_BUDGET_S:
                break
            plans += 1
            fn = case.jsbp_fn()
            clear_caches()
            with _PlanTimer() as pt:
                t = time.perf_counter()
                entry = fn.lower_program(*case.jsbp_args())
                dt = time.perf_counter() - t
            spent += dt
            if best is None or dt < best[0]:
                best = (dt, pt.seconds)
        est = estimate(fn, *case.jsbp_args())
        row = {
            "layers": layers,
            "equations": len(entry.program.steps),
            "plans": plans,
            "lower_s": best[0],
            "plan_s": best[1],
            "as_run": as_run(est.comm_bytes, est.collectives),
            "launched": est.collectives,
        }
        rows.append(row)
        print(f"  {layers} blocks: {row}", file=sys.stderr, flush=True)
    return rows


# -------------------------------------------------------------------------------------------
# tables
# -------------------------------------------------------------------------------------------


def totals(results: dict) -> dict:
    both = [r for r in results.values() if r["recorded"] is not None]
    return {
        "programs": len(results),
        "compared": len(both),
        "recorded_as_run": sum(r["recorded"]["as_run"] for r in both),
        "new_as_run": sum(r["new"]["as_run"] for r in both),
        "recorded_collectives": sum(r["recorded"]["collectives"] for r in both),
        "new_collectives": sum(r["new"]["collectives"] for r in both),
        "plan_s": sum(r["new"]["plan_s"] for r in results.values()),
        "cheaper": sum(r["recorded"]["as_run"] - r["new"]["as_run"] > 5e-4 for r in both),
        "dearer": sum(r["new"]["as_run"] - r["recorded"]["as_run"] > 5e-4 for r in both),
    }


def cost_table(results: dict) -> str:
    lines = [
        "| program | recorded as run (MB-eq) | new as run (MB-eq) | recorded collectives | "
        "new collectives | new plan (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        old, new = r["recorded"], r["new"]
        old_run = "-" if old is None else f"{old['as_run']:.3f}"
        lines.append(
            f"| {name} | {old_run} | {new['as_run']:.3f} | "
            f"{'-' if old is None else old['collectives']} | "
            f"{new['collectives']} ({fmt_coll(new['by_kind'])}) | {new['plan_s']:.2f} |"
        )
    t = totals(results)
    lines.append(
        f"| **total** ({t['compared']} programs) | {t['recorded_as_run']:.2f} | "
        f"{t['new_as_run']:.2f} | {t['recorded_collectives']} | {t['new_collectives']} | "
        f"{t['plan_s']:.1f} |"
    )
    return "\n".join(lines)


def dearer_list(results: dict) -> str:
    rows = [
        (name, r["recorded"], r["new"])
        for name, r in results.items()
        if r["recorded"] is not None and r["new"]["as_run"] - r["recorded"]["as_run"] > 5e-4
    ]
    if not rows:
        return "no program's new plan is dearer than the recorded one"
    rows.sort(key=lambda x: x[1]["as_run"] - x[2]["as_run"])

    def step(old, new):  # the cost model's step time: bytes, latencies and the compute they save
        if old["seconds"] is None:
            return ""
        return f"; predicted step {old['seconds'] * 1e3:.2f} -> {new['seconds'] * 1e3:.2f} ms"

    return "\n".join(
        f"* {name}: {old['as_run']:.3f} -> {new['as_run']:.3f} MB-eq "
        f"(+{new['as_run'] - old['as_run']:.3f}), collectives {old['collectives']} -> "
        f"{new['collectives']}{step(old, new)}"
        for name, old, new in rows
    )


def time_table(rows) -> str:
    lines = [
        "| step | blocks | equations | cold plans | lower_program (s) | of which planning (s) | "
        "as run (MB-eq) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| DPxTP (2x4) | {r['layers']} | {r['equations']} | {r['plans']} | {r['lower_s']:.2f} | "
            f"{r['plan_s']:.2f} | {r['as_run']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(GROUPS))
    ap.add_argument("--quick", action="store_true", help="a handful of programs, 1 and 4 blocks")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--layers", default="", help="blocks of the timing rows (1,4,16,24,48)")
    ap.add_argument(
        "--reps",
        type=int,
        default=0,
        help="cold plans per timing row, at most (the fastest is kept)",
    )
    ap.add_argument("--json", default="", help="write all results here (JSON)")
    args = ap.parse_args(argv)
    layers = args.layers or ("1,4" if args.quick else "1,4,16,24,48")
    reps = args.reps or (1 if args.quick else 3)
    print(
        f"# jsbp planner benchmark: {jax.device_count()} simulated CPU devices, "
        f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}"
    )
    table = json.loads(RECORDED.read_text())
    results, rows = {}, []
    if not args.timing_only:
        groups = [g for g in (args.only.split(",") if args.only else GROUPS) if g]
        for group in groups:
            for name, make in GROUPS[group]().items():
                if args.quick and name not in QUICK:
                    continue
                results[name] = {"recorded": recorded(name, table), "new": measure(make)}
                old, new = results[name]["recorded"], results[name]["new"]
                print(
                    f"  {name}: recorded "
                    + ("-" if old is None else f"{old['as_run']:.3f} / {old['collectives']}")
                    + f", new {new['as_run']:.3f} / {new['collectives']}, "
                    f"plan {new['plan_s']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
        print()
        print(cost_table(results))
        print()
        print("New plan dearer than the recorded one (as run):")
        print(dearer_list(results))
    if not args.no_timing:
        rows = planning_times(tuple(int(x) for x in layers.split(",")), reps)
        print()
        print(time_table(rows))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "programs": results,
                    "totals": totals(results) if results else None,
                    "timing": rows,
                },
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
