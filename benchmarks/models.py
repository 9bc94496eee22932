"""Issue 18's model zoo (tests/models: cnn, vit, lstm, scan_mlp, decoder_lm, moe) under the zoo's
layouts (dp8, tp8, dp2tp4, zero3): the jsbp train step vs a GSPMD ``jax.jit`` step with the same
parameter shardings, side by side in one process.

    python benchmarks/models.py                                  # every model x layout
    python benchmarks/models.py --models cnn,scan_mlp --layouts tp8,zero3 --steps 10

Both sides run the identical logical step (``value_and_grad`` of the zoo's ``loss_fn`` +
``nnx.Optimizer.update``, BatchNorm statistics and dropout RNG counters threaded through) on the
identical initial state, functionally (``(state, batch) -> (state, loss)``). The GSPMD side places
every state leaf with the PartitionSpec of the jsbp layout it is *stored* in (``leaf_layouts``),
the batch with the strategy's batch layout, pins ZeRO-3's gathered parameters and every gradient
with ``with_sharding_constraint`` (the ``use`` / ``grad`` layouts), and turns the models'
``jsbp.flax.constrain`` calls into ``with_sharding_constraint`` — so XLA's partitioner gets the
information jsbp plans with. Uneven splits (a dim not divisible by its axes, which jsbp pads) cannot
be placed with ``jax.device_put``: the baseline keeps such a dim whole (the nearest pad-free
layout; column ``uneven`` counts the state leaves jsbp stores padded).

Reported per case: first call (trace + compile + run, wall ms) and the median steady-state step
(``--steps`` timed steps after ``--warmup``, jsbp and GSPMD one step each per round in an order
shuffled every round, so a busy machine slows both alike), their ratios, and the collectives in
each compiled step.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYOUT_NAMES = ("dp8", "tp8", "dp2tp4", "zero3")


from _common import fmt_coll, interleaved_medians, is_even, partition_spec, pins  # noqa: E402  (benchmarks/ is the script's directory)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="", help="comma-separated subset (default: all six)")
    ap.add_argument(
        "--layouts", default="", help="comma-separated subset of " + ",".join(LAYOUT_NAMES)
    )
    ap.add_argument("--steps", type=int, default=50, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument(
        "--program",
        action="store_true",
        help="also time both compiled programs alone (jsbp's entry over its physical arrays, GSPMD's "
        "step as one jax.jit over its flat leaves: no pytree handling on either side) in the same "
        "interleaving: the programs compared without the per-call work",
    )
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT / "tests"))
    from models import MODELS

    models = [m for m in (args.models.split(",") if args.models else MODELS) if m]
    layouts = [x for x in (args.layouts.split(",") if args.layouts else LAYOUT_NAMES) if x]
    load0 = os.getloadavg()
    print(
        f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, "
        f"load average {load0[0]:.2f}; {args.steps} timed steps after {args.warmup} warm-up",
        file=sys.stderr,
    )
    results = []
    for m in models:
        for lay in layouts:
            r = bench_one(m, lay, args)
            results.append(r)
            print(
                f"{m} {lay}: step jsbp {r['jsbp_ms']:.2f} ms GSPMD {r['gspmd_ms']:.2f} ms "
                f"(x{r['ratio']:.2f}); first call jsbp {r['jsbp_first_ms']:.0f} ms GSPMD "
                f"{r['gspmd_first_ms']:.0f} ms (x{r['first_ratio']:.2f}); collectives jsbp "
                f"{fmt_coll(r['jsbp_coll'])} | GSPMD {fmt_coll(r['gspmd_coll'])}; "
                f"load {r['load']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    print(table(results))
    ratios = sorted(r["ratio"] for r in results)
    if ratios:
        print(
            f"\nstep ratio: median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}; "
            f"first-call ratio median {statistics.median(r['first_ratio'] for r in results):.2f}; "
            f"load average at start {load0[0]:.2f}, at end {os.getloadavg()[0]:.2f}"
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def table(results) -> str:
    head = (
        "| model | layout | jsbp step (ms) | GSPMD step (ms) | step ratio | jsbp first call (ms) | "
        "GSPMD first call (ms) | first-call ratio | jsbp collectives / step | "
        "GSPMD collectives / step | uneven leaves |"
    )
    program = any(r.get("program_ms") for r in results)
    if program:
        head += " jsbp program alone (ms) | GSPMD program alone (ms) | program ratio |"
    lines = [head, "|" + "---|" * (14 if program else 11)]
    for r in results:
        line = (
            f"| {r['model']} | {r['layout']} | {r['jsbp_ms']:.2f} | {r['gspmd_ms']:.2f} | "
            f"{r['ratio']:.2f} | {r['jsbp_first_ms']:.0f} | {r['gspmd_first_ms']:.0f} | "
            f"{r['first_ratio']:.2f} | {fmt_coll(r['jsbp_coll'])} | {fmt_coll(r['gspmd_coll'])} | "
            f"{r['uneven']} |"
        )
        if program:
            pm, gm = r.get("program_ms"), r.get("gspmd_program_ms")
            line += f" {pm:.2f} | {gm:.2f} | {pm / gm:.2f} |" if pm and gm else " - | - | - |"
        lines.append(line)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------


def _init(mod):
    import optax
    from flax import nnx

    model = mod.make(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def bench_one(name, layout, args):
    import jax
    from flax import nnx
    from models import load
    from test_model_zoo import make_strategy

    import jsbp.flax as jflax
    from jsbp.debug import collectives_in_hlo, count_collectives

    mod = load(name)
    strategy = make_strategy(layout, mod.RULES)
    host_batch = mod.batch(0)

    # ---- jsbp: first call = build + trace + compile + run --------------------------------------
    model, opt = jflax.shard(_init(mod), strategy)
    step = jflax.make_train_step(mod.loss_fn, strategy)
    graphdef, state = nnx.split((model, opt))
    batch = step.put_batch(host_batch)
    t = time.perf_counter()
    fn = step.pure(graphdef, state, batch)
    state, loss = fn(state, batch)
    jax.block_until_ready(loss.physical)
    jsbp_first = (time.perf_counter() - t) * 1e3

    def run_jsbp(state, batch):
        state, loss = fn(state, batch)
        return state, loss.physical

    # ---- GSPMD ---------------------------------------------------------------------------------
    gfn, gstate, gbatch, uneven = gspmd_step(mod, strategy, host_batch)
    t = time.perf_counter()
    gstate, gloss = gfn(gstate, gbatch)
    jax.block_until_ready(gloss)
    gspmd_first = (time.perf_counter() - t) * 1e3

    fns, states, batches = [run_jsbp, gfn], [state, gstate], [batch, gbatch]
    if getattr(args, "program", False):
        entry, phys = fn._lookup((state, batch))

        def run_program(phys, _):
            outs = entry.fn(*phys)
            return phys, outs[-1]  # the loss is the last output leaf

        gleaves, gtree = jax.tree_util.tree_flatten(gstate)

        @jax.jit
        def gspmd_program(leaves, batch):  # the same step, traced over the flat leaves
            new, loss = gfn(jax.tree_util.tree_unflatten(gtree, leaves), batch)
            return jax.tree_util.tree_leaves(new), loss

        jax.block_until_ready(gspmd_program(gleaves, gbatch))  # compiled outside the timing
        fns += [run_program, gspmd_program]
        states += [phys, gleaves]
        batches += [None, gbatch]
    medians, states = interleaved_medians(fns, states, batches, args.steps, args.warmup)
    (jsbp_ms, gspmd_ms), (state, gstate) = medians[:2], states[:2]
    program_ms, gspmd_program_ms = medians[2:4] if len(medians) > 2 else (None, None)
    jsbp_coll = count_collectives(fn, state, batch)
    gspmd_coll = collectives_in_hlo(gfn.lower(gstate, gbatch).compile().as_text())
    return {
        "model": name,
        "layout": layout,
        "jsbp_ms": jsbp_ms,
        "gspmd_ms": gspmd_ms,
        "ratio": jsbp_ms / gspmd_ms,
        "jsbp_first_ms": jsbp_first,
        "gspmd_first_ms": gspmd_first,
        "first_ratio": jsbp_first / gspmd_first,
        "jsbp_coll": jsbp_coll,
        "gspmd_coll": gspmd_coll,
        "uneven": uneven,
        "load": os.getloadavg()[0],
        "program_ms": program_ms,
        "gspmd_program_ms": gspmd_program_ms,
    }


def gspmd_step(mod, strategy, host_batch):
    """The same step in plain JAX: every leaf placed with its PartitionSpec, ZeRO-3 uses and
    gradients pinned with with_sharding_constraint, the model's constrain calls too, one jax.jit.
    Returns ``(fn, state, batch, number of unevenly split state leaves)``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jsbp.flax as jflax

    plc = strategy.placement
    mesh = plc.mesh

    sizes = dict(zip(plc.axis_names, plc.mesh.devices.shape))

    def sharding(nd, shape):
        # jax.device_put refuses uneven splits: a dim its axes do not divide stays whole (the
        # nearest pad-free layout), in the stored layouts and in every pin alike
        spec = partition_spec(plc, nd, shape)
        entries = []
        for d, e in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
            axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            n = int(np.prod([sizes[a] for a in axes])) if axes else 1
            entries.append(e if shape[d] % n == 0 else None)
        return NamedSharding(mesh, PartitionSpec(*entries))

    model, opt = _init(mod)
    graphdef, state = nnx.split((model, opt))
    flat = list(nnx.to_flat_state(state))
    plans = jflax.leaf_layouts(flat, strategy)
    uneven = sum(not is_even(plc, plans[p].stored, np.shape(v.get_value())) for p, v in flat)
    state_sh = nnx.from_flat_state(
        [(p, v.replace(sharding(plans[p].stored, np.shape(v.get_value())))) for p, v in flat]
    )
    state = jax.device_put(state, state_sh)

    def put(x):
        x = np.asarray(x)
        sh = sharding(strategy.batch_sbp(x.ndim), x.shape)
        return jax.device_put(jnp.asarray(x), sh), sh

    pairs = jax.tree.map(put, host_batch)
    is_pair = lambda t: isinstance(t, tuple) and len(t) == 2 and isinstance(t[1], NamedSharding)  # noqa: E731
    batch = jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair)
    batch_sh = jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair)

    wsc_names, use, pin_grad, map_flat = pins(strategy, plans, sharding)
    zero3 = strategy.zero >= 3

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        mdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(params, rest, mb):
            if zero3:
                params = map_flat(params, use)
            rest = jax.tree.map(lambda v: v, rest)  # fresh Variables at this trace level
            m = nnx.merge(mdef, params, rest)
            loss = mod.loss_fn(m, mb)
            return loss, nnx.state(m, nnx.Not(nnx.Param))  # BatchNorm stats, RNG counters

        (loss, rest), grads = jax.value_and_grad(loss_of, has_aux=True)(params, rest, batch)
        nnx.update(model, rest)
        grads = map_flat(grads, pin_grad)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def traced(state, batch):
        with jflax.constrain_with(wsc_names):
            return step(state, batch)

    fn = jax.jit(traced, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None))
    return fn, state, batch, uneven


if __name__ == "__main__":
    raise SystemExit(main())
