"""Step time of train_gpt.py's model: jsbp strategies vs the same strategies written by hand in
plain JAX (NamedSharding + jax.jit, GSPMD).

    python benchmarks/training.py                    # all strategies, markdown table on stdout
    python benchmarks/training.py --steps 30 --only dp8,tp8 --json results.json

Both sides run the identical logical step (``value_and_grad`` + ``nnx.Optimizer.update``) on the
identical state, functionally (``(state, batch) -> (state, loss)``, no Python-side NNX updates in
the timed loop). The hand-written side places every leaf with the PartitionSpec of the same
strategy and pins activations and gradients with ``jax.lax.with_sharding_constraint`` where jsbp
uses ``constrain`` / gradient layouts, so XLA's partitioner gets the same information jsbp does.
Reported: median step time of ``--steps`` timed steps after warm-up (one run), the ratio
jsbp / hand-written, and the collectives in each compiled step (``count_collectives``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

STRATEGIES = {  # name: (parallel, zero, accum)
    "dp8": ("dp=8", 0, 1),
    "tp8": ("tp=8", 0, 1),
    "dp2_tp4": ("dp=2,tp=4", 0, 1),
    "zero1_dp8": ("dp=8", 1, 1),
    "zero2_dp8": ("dp=8", 2, 1),
    "zero3_dp8": ("dp=8", 3, 1),
    "accum4_dp8": ("dp=8", 0, 4),
}


from _common import fmt_coll, interleaved_medians, partition_spec, pins  # noqa: E402  (benchmarks/ is the script's directory)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per strategy and side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated subset of " + ",".join(STRATEGIES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt as tg

    names = [n for n in (args.only.split(",") if args.only else STRATEGIES) if n]
    corpus = tg.Corpus()
    cfg = tg.GPTConfig(vocab=corpus.vocab)
    print(
        f"model: {cfg}, batch {args.batch}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{args.steps} timed steps after {args.warmup} warm-up",
        file=sys.stderr,
    )
    results = []
    for name in names:
        parallel, zero, accum = STRATEGIES[name]
        r = bench_one(tg, cfg, corpus, parallel, zero, accum, args)
        r["name"] = name
        results.append(r)
        print(
            f"{name}: jsbp {r['jsbp_ms']:.2f} ms, hand {r['hand_ms']:.2f} ms, ratio {r['ratio']:.3f}; "
            f"collectives jsbp {r['jsbp_coll']} hand {r['hand_coll']}",
            file=sys.stderr,
            flush=True,
        )
    print(table(results))
    sm = [r for r in results if "shard_map_ms" in r]
    if sm:
        print(
            "\n| strategy | jsbp step (ms, median) | hand-written jax.shard_map step (ms, median) | ratio | "
            "shard_map collectives / step |\n|---|---|---|---|---|"
        )
        for r in sm:
            print(
                f"| {r['name']} | {r['jsbp_ms_vs_shard_map']:.2f} | {r['shard_map_ms']:.2f} | "
                f"{r['shard_map_ratio']:.3f} | {fmt_coll(r['shard_map_coll'])} |"
            )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def table(results) -> str:
    head = (
        "| strategy | jsbp step (ms, median) | hand-written step (ms, median) | ratio | "
        "jsbp collectives / step | hand-written collectives / step |"
    )
    lines = [head, "|" + "---|" * 6]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['jsbp_ms']:.2f} | {r['hand_ms']:.2f} | {r['ratio']:.3f} | "
            f"{fmt_coll(r['jsbp_coll'])} | {fmt_coll(r['hand_coll'])} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------


def bench_one(tg, cfg, corpus, parallel, zero, accum, args):
    import numpy as np
    from flax import nnx

    import jsbp
    import jsbp.flax as jflax
    from jsbp.debug import collectives_in_hlo, count_collectives

    strategy = tg.make_strategy(tg.parse_parallel(parallel), zero)
    host_batch = next(corpus.batches(0, args.batch, cfg.seq))

    # ---- jsbp -----------------------------------------------------------------------------
    model, opt = jflax.shard(tg.init(cfg, 0), strategy)
    step = jflax.make_train_step(tg.loss_fn, strategy, accum=accum)
    graphdef, state = nnx.split((model, opt))
    batch = step.put_batch(host_batch)
    fn = step.pure(graphdef, state, batch)

    def run_jsbp(state, batch):
        state, loss = fn(state, batch)
        return state, loss.physical

    jsbp_coll = count_collectives(fn, state, batch)

    # ---- hand-written: NamedSharding + jax.jit --------------------------------------------
    hand_fn, hstate, hbatch = hand_written(tg, cfg, strategy, accum, host_batch)
    hand_coll = collectives_in_hlo(hand_fn.lower(hstate, hbatch).compile().as_text())
    (jsbp_ms, hand_ms), _ = interleaved_medians(
        [run_jsbp, hand_fn], [state, hstate], [batch, hbatch], args.steps, args.warmup
    )
    out = {
        "parallel": parallel,
        "zero": zero,
        "accum": accum,
        "jsbp_ms": jsbp_ms,
        "hand_ms": hand_ms,
        "ratio": jsbp_ms / hand_ms,
        "jsbp_coll": jsbp_coll,
        "hand_coll": hand_coll,
    }
    if zero == 0 and accum == 1 and set(strategy.placement.axis_names) == {"dp"}:
        # diagnostic: plain data parallelism written by hand with jax.shard_map (what jsbp emits)
        sm_fn, sstate, sbatch = hand_shard_map_dp(tg, cfg, strategy, host_batch)
        out["shard_map_coll"] = collectives_in_hlo(sm_fn.lower(sstate, sbatch).compile().as_text())
        (jsbp_ms2, sm_ms), _ = interleaved_medians(
            [run_jsbp, sm_fn], [state, sstate], [batch, sbatch], args.steps, args.warmup
        )
        out.update(
            jsbp_ms_vs_shard_map=jsbp_ms2, shard_map_ms=sm_ms, shard_map_ratio=jsbp_ms2 / sm_ms
        )
    del jsbp, np
    return out


def hand_shard_map_dp(tg, cfg, strategy, host_batch):
    """Data parallelism by hand with ``jax.shard_map``: local loss, ``pmean`` of the gradients."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    mesh, axis = strategy.placement.mesh, strategy.data_axis
    graphdef, state = nnx.split(tg.init(cfg, 0))
    state = jax.device_put(state, NamedSharding(mesh, PS()))
    batch = jax.device_put(jnp.asarray(host_batch), NamedSharding(mesh, PS(axis)))

    def body(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(tg.loss_fn)(model, batch)
        optimizer.update(model, jax.lax.pmean(grads, axis))
        return nnx.state((model, optimizer)), jax.lax.pmean(loss, axis)

    sm = jax.shard_map(
        body, mesh=mesh, in_specs=(PS(), PS(axis)), out_specs=(PS(), PS()), check_vma=False
    )
    return jax.jit(sm), state, batch


def hand_written(tg, cfg, strategy, accum, host_batch):
    """The same strategy in plain JAX: every leaf placed with its PartitionSpec, activations and
    gradients pinned with with_sharding_constraint, one jax.jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    import jsbp.flax as jflax

    plc = strategy.placement
    mesh = plc.mesh

    def spec(nd, shape):
        return partition_spec(plc, nd, shape)

    def sharding(nd, shape):
        return NamedSharding(mesh, spec(nd, shape))

    model, opt = tg.init(cfg, 0)
    graphdef, state = nnx.split((model, opt))
    flat = list(nnx.to_flat_state(state))
    plans = jflax.leaf_layouts(flat, strategy)
    state_sh = nnx.from_flat_state(
        [(p, v.replace(sharding(plans[p].stored, np.shape(v.get_value())))) for p, v in flat]
    )
    state = jax.device_put(state, state_sh)

    if accum > 1:
        host_batch = host_batch.reshape(
            (accum, host_batch.shape[0] // accum) + host_batch.shape[1:]
        )
    bnd = strategy.batch_sbp(host_batch.ndim, accum=accum > 1)
    batch_sh = sharding(bnd, host_batch.shape)
    batch = jax.device_put(jnp.asarray(host_batch), batch_sh)

    wsc_names, use, pin_grad, map_flat = pins(strategy, plans, sharding)
    zero3 = strategy.zero >= 3

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        mdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_of(params, mb):
            if zero3:
                params = map_flat(params, use)
            return tg.loss_fn(nnx.merge(mdef, params, rest), mb)

        if accum == 1:
            loss, grads = jax.value_and_grad(loss_of)(params, batch)
        else:

            def body(carry, mb):
                gsum, lsum = carry
                loss_mb, g = jax.value_and_grad(loss_of)(params, mb)
                return (jax.tree.map(jnp.add, gsum, g), lsum + loss_mb), None

            (gsum, lsum), _ = jax.lax.scan(
                body, (jax.tree.map(jnp.zeros_like, params), jnp.zeros(())), batch
            )
            grads, loss = jax.tree.map(lambda g: g / accum, gsum), lsum / accum
        grads = map_flat(grads, pin_grad)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    def traced(state, batch):
        # the model's jsbp.flax.constrain calls become with_sharding_constraint for this trace
        with jflax.constrain_with(wsc_names):
            return step(state, batch)

    fn = jax.jit(traced, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None))
    return fn, state, batch


if __name__ == "__main__":
    raise SystemExit(main())
