"""Automatic parallelism: ``jsbp.flax.Strategy.auto``'s choice against the hand-picked strategies.

    python benchmarks/auto.py                       # three model shapes, markdown table on stdout
    python benchmarks/auto.py --only gpt --steps 20 --json auto.json
    python benchmarks/auto.py --budget-quarter      # also: auto under a budget of (params + opt) / 4
    python benchmarks/auto.py --plan-only           # auto's planning time against a first call

On 8 simulated CPU devices, for the GPT of ``examples/train_gpt.py`` and two other shapes
(wide-shallow, narrow-deep), every hand-picked strategy (``dp=8``, ``tp=8``, ``dp=2×tp=4``,
ZeRO-1/2/3 over ``dp=8``) and the strategy ``Strategy.auto`` chooses with no memory budget run
the same functional train step on the same state (its first two losses are checked against one
device at 1e-5 before timing); their step times are measured interleaved
(one step of each in turn, so a busy machine slows all alike) and reported as medians. Each row
also shows what the cost model predicted (step time, peak bytes per device) and what XLA reports
for the compiled per-device program (``jsbp.debug.measured_bytes``), and the bytes of model +
optimizer state each device holds (``jsbp.flax.local_nbytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

from _common import fmt_bytes, interleaved_medians  # noqa: E402  (benchmarks/ is the script's directory)

SHAPES = {  # name: GPTConfig overrides (vocab comes from the corpus)
    "gpt": {},
    "wide_shallow": {"d_model": 256, "n_heads": 8, "n_layers": 1, "d_mlp": 1024},
    "narrow_deep": {"d_model": 32, "n_heads": 4, "n_layers": 8, "d_mlp": 128},
}

HAND = {  # name: (parallel, zero)
    "dp8": ("dp=8", 0),
    "tp8": ("tp=8", 0),
    "dp2_tp4": ("dp=2,tp=4", 0),
    "zero1": ("dp=8", 1),
    "zero2": ("dp=8", 2),
    "zero3": ("dp=8", 3),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per strategy")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--budget-quarter",
        action="store_true",
        help="also run auto with a budget of (parameters + optimizer state) / 4",
    )
    ap.add_argument(
        "--budget-frac",
        type=float,
        default=0.0,
        help="also run auto with a budget of this fraction of the unbudgeted choice's predicted peak",
    )
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="time Strategy.auto against the first call of the strategy it chooses (no steps)",
    )
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument(
        "--fit",
        default="",
        help="fit the CostModel rates to the hand-picked rows of this "
        "--json file (no timing) and print them",
    )
    args = ap.parse_args(argv)
    if args.fit:
        print(fit(json.loads(pathlib.Path(args.fit).read_text())))
        return 0

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt as tg

    names = [n for n in (args.only.split(",") if args.only else SHAPES) if n]
    corpus = tg.Corpus()
    if args.plan_only:
        rows = [
            plan_time(tg, tg.GPTConfig(vocab=corpus.vocab, **SHAPES[n]), corpus, args)
            for n in names
        ]
        for n, r in zip(names, rows):
            r["shape"] = n
        print(plan_table(rows), flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    results = []
    for name in names:
        cfg = tg.GPTConfig(vocab=corpus.vocab, **SHAPES[name])
        rows, auto_info = bench_shape(tg, cfg, corpus, args)
        results.append({"shape": name, "config": str(cfg), "rows": rows, "auto": auto_info})
        print(table(name, cfg, rows, auto_info), flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def fit(results) -> str:
    """Non-negative least squares on relative error: step time ~ comm_bytes / link_bandwidth +
    collectives * latency + flops / flop_rate + traffic / mem_bandwidth, over the hand-picked rows."""
    import numpy as np
    from scipy.optimize import nnls

    X, y = [], []
    for shape in results:
        for r in shape["rows"]:
            if r["name"] in HAND:
                X.append([r["comm_bytes"], r["collectives"], r["flops"], r["traffic"]])
                y.append(r["ms"] / 1e3)
    X, y = np.array(X, float), np.array(y, float)
    W = X / y[:, None]
    scale = np.where(W.max(0) > 0, W.max(0), 1.0)
    coef, _ = nnls(W / scale, np.ones(len(y)))
    coef = coef / scale
    err = np.abs(X @ coef / y - 1).mean()

    def inv(c):
        return f"{1 / c:.3g}" if c > 0 else "inf"

    return (
        f"CostModel(link_bandwidth={inv(coef[0])}, latency={coef[1]:.3g}, flop_rate={inv(coef[2])}, "
        f"mem_bandwidth={inv(coef[3])})  # mean relative error {err:.2f} over {len(y)} rows"
    )


def _prepare(tg, cfg, strategy, host_batch):
    """The compiled functional step, its state and batch, and the plan's estimate."""
    from flax import nnx

    import jsbp.flax as jflax
    from jsbp.debug import estimate, measured_bytes

    model, opt = jflax.shard(tg.init(cfg, 0), strategy)
    state_bytes = max(jflax.local_nbytes((model, opt)))
    layouts = (
        tuple(strategy.placement.hierarchy),
        tuple(sorted(jflax.layouts((model, opt)).items())),
    )
    step = jflax.make_train_step(tg.loss_fn, strategy)
    graphdef, state = nnx.split((model, opt))
    batch = step.put_batch(host_batch)
    fn = step.pure(graphdef, state, batch)
    est = estimate(fn, state, batch)
    mem = measured_bytes(fn, state, batch)

    def run(state, batch):
        state, loss = fn(state, batch)
        return state, loss.physical

    # parity: the first two steps' losses (the second reads the first update) from this state
    s1, l1 = fn(state, batch)
    _, l2 = fn(s1, batch)
    losses = [float(l1.numpy()), float(l2.numpy())]
    return run, state, batch, est, mem, state_bytes, layouts, losses


def _one_device_losses(tg, cfg, host_batch):
    import jsbp.flax as jflax

    model, opt = tg.init(cfg, 0)
    step = jflax.make_train_step(tg.loss_fn, None)
    return [float(step(model, opt, host_batch)) for _ in range(2)]


def bench_shape(tg, cfg, corpus, args):
    import numpy as np

    import jsbp
    import jsbp.flax as jflax

    host_batch = next(corpus.batches(0, args.batch, cfg.seq))
    strategies = {n: tg.make_strategy(tg.parse_parallel(p), z) for n, (p, z) in HAND.items()}
    plc = jsbp.placement("cpu", np.arange(8))
    model, opt = tg.init(cfg, 0)
    t = time.perf_counter()
    auto = jflax.Strategy.auto(
        plc, model=model, optimizer=opt, loss_fn=tg.loss_fn, batch=host_batch
    )
    auto_info = {
        "seconds": time.perf_counter() - t,
        "chosen": auto.report.chosen.name,
        "candidates": len(auto.report.candidates),
        "report": str(auto.report),
    }
    print(auto.report, file=sys.stderr, flush=True)
    strategies["auto"] = auto
    budgets = {}
    if args.budget_quarter:
        budgets["auto_quarter"] = (
            sum(int(np.prod(np.shape(v))) * 4 for v in jax_leaves((model, opt))) // 4
        )
    if args.budget_frac:
        budgets["auto_budget"] = int(args.budget_frac * auto.report.chosen.estimate.peak_bytes)
    auto_info["budgets"] = {}
    for name, budget in budgets.items():
        try:
            s = jflax.Strategy.auto(
                plc, budget, model=model, optimizer=opt, loss_fn=tg.loss_fn, batch=host_batch
            )
        except jsbp.SbpError as e:
            auto_info["budgets"][name] = (budget, f"none fits: {e}")
            print(e, file=sys.stderr, flush=True)
            continue
        strategies[name] = s
        auto_info["budgets"][name] = (budget, s.report.chosen.name)
    prepared = {n: _prepare(tg, cfg, s, host_batch) for n, s in strategies.items()}
    ref = _one_device_losses(tg, cfg, host_batch)
    for n, p in prepared.items():
        if not np.allclose(p[-1], ref, rtol=1e-5, atol=0):
            raise SystemExit(f"{n}: losses {p[-1]} differ from one device's {ref} beyond 1e-5")
    names = list(prepared)
    fns = [prepared[n][0] for n in names]
    ms, _ = interleaved_medians(
        fns,
        [prepared[n][1] for n in names],
        [prepared[n][2] for n in names],
        args.steps,
        args.warmup,
    )
    rows = []
    for n, t_ms in zip(names, ms):
        _, state, batch, est, mem, state_bytes, layouts, _ = prepared[n]
        s = strategies[n]
        # hand-picked strategies storing the same layouts (ZeRO-1 and -2 do: the gradients
        # differ), the one with auto's ZeRO level first
        same = sorted(
            (h for h in HAND if h != n and prepared[h][6] == layouts),
            key=lambda h: getattr(strategies[h], "zero", 0) != getattr(s, "zero", 0),
        )
        rows.append(
            {
                "name": n,
                "strategy": s.report.chosen.name if s.report is not None else _hand_name(n),
                "ms": t_ms,
                "predicted_ms": est.seconds * 1e3,
                "collectives": est.collectives,
                "comm_bytes": est.comm_bytes,
                "flops": est.flops,
                "traffic": est.traffic,
                "predicted_peak": est.peak_bytes,
                "measured_peak": mem.get("in_place"),
                "state_bytes": state_bytes,
                "same_as": same[0] if same and n not in HAND else "",
            }
        )
    return rows, auto_info


def plan_time(tg, cfg, corpus, args) -> dict:
    """``Strategy.auto``'s wall time (no budget) against the first call of the strategy it
    chooses: shard, build the train step, trace, plan, compile and run one step, JAX's caches
    emptied first (jsbp's memo caches of layouts and conversions stay as the search left them)."""
    import jax
    import numpy as np

    import jsbp
    import jsbp.flax as jflax

    host_batch = next(corpus.batches(0, args.batch, cfg.seq))
    plc = jsbp.placement("cpu", np.arange(8))
    model, opt = tg.init(cfg, 0)
    t = time.perf_counter()
    auto = jflax.Strategy.auto(
        plc, model=model, optimizer=opt, loss_fn=tg.loss_fn, batch=host_batch
    )
    auto_s = time.perf_counter() - t
    jax.clear_caches()
    t = time.perf_counter()
    model, opt = jflax.shard(tg.init(cfg, 0), auto)
    loss = jflax.make_train_step(tg.loss_fn, auto)(model, opt, host_batch)
    jax.block_until_ready(loss.physical if isinstance(loss, jsbp.GlobalTensor) else loss)
    first_s = time.perf_counter() - t
    return {
        "chosen": auto.report.chosen.name,
        "candidates": len(auto.report.candidates),
        "auto_s": auto_s,
        "first_call_s": first_s,
    }


def plan_table(rows) -> str:
    lines = [
        "| shape | auto chose | candidates planned | Strategy.auto (s) | its first call (s) | ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['chosen']} | {r['candidates']} | {r['auto_s']:.1f} | "
            f"{r['first_call_s']:.2f} | {r['auto_s'] / r['first_call_s']:.1f} |"
        )
    return "\n".join(lines)


def jax_leaves(objs):
    import jax
    from flax import nnx

    return [x for x in jax.tree.leaves(nnx.state(objs)) if hasattr(x, "dtype")]


def _hand_name(n):
    p, z = HAND[n]
    return p.replace(",", "×") + (f" zero-{z}" if z else "")


def table(name, cfg, rows, auto_info) -> str:
    best = min(r["ms"] for r in rows if r["name"] in HAND)
    lines = [
        f"\n### {name}: d_model {cfg.d_model}, {cfg.n_layers} layer(s), d_mlp {cfg.d_mlp}, "
        f"{cfg.n_heads} heads, vocab {cfg.vocab}, seq {cfg.seq}",
        "",
        f"auto chose **{auto_info['chosen']}** ({auto_info['candidates']} candidates planned in "
        f"{auto_info['seconds']:.1f} s)"
        + "".join(
            f"; {n} (budget {fmt_bytes(b)} per device): **{c}**"
            for n, (b, c) in auto_info["budgets"].items()
        ),
        "",
        "| strategy | step (ms, median) | vs best hand-picked | predicted (ms) | collectives (plan) | "
        "predicted peak / device | XLA in-place peak / device | state / device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = r["name"] if r["name"] in HAND else f"**{r['name']}**: {r['strategy']}"
        if r.get("same_as"):
            label += f" (the layouts of {r['same_as']})"
        lines.append(
            f"| {label} | {r['ms']:.2f} | {r['ms'] / best:.3f} | {r['predicted_ms']:.1f} | "
            f"{r['collectives']} | {fmt_bytes(r['predicted_peak'])} | "
            f"{fmt_bytes(r['measured_peak']) if r['measured_peak'] is not None else '-'} | "
            f"{fmt_bytes(r['state_bytes'])} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
