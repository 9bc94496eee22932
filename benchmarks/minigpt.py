"""The Flax docs' miniGPT (``tests/models/minigpt.py``, rebuilt as published) trained two ways in
one process, side by side:

* **JAX**: the tutorial's own code: the model built under ``jax.set_mesh`` of an explicit
  ``('batch', 'model')`` mesh (its ``kernel_metadata={'out_sharding': P(None, 'model')}`` place
  the parameters), ``nnx.Optimizer(model, optax.adam(1e-3))``, and the tutorial's
  ``@nnx.jit train_step`` (``nnx.value_and_grad(loss_fn, has_aux=True)``, ``optimizer.update``)
  on a batch put with ``NamedSharding(mesh, P('batch', None))`` (the tutorial's metrics are left
  out);
* **jsbp**: the same model and optimizer through ``jsbp.flax``'s documented path:
  ``Strategy(placement, data_axis='batch')``, ``shard``, ``make_train_step`` (the same
  parameter layouts: the metadata is read as layouts).

Both start from the same parameters and run the same batches; their losses are checked against
each other, then steps are timed one of each per round, in an order shuffled every round.

    python benchmarks/minigpt.py                        # dp8, tp8, dp2tp4
    python benchmarks/minigpt.py --layouts tp8 --steps 10
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

from _common import fmt_coll, interleaved_medians  # noqa: E402  (benchmarks/ is the script's directory)

LAYOUTS = {"dp8": (8, 1), "tp8": (1, 8), "dp2tp4": (2, 4)}  # ('batch', 'model') grid
# the tutorial's sizes (vocab 50257, maxlen 256, embed 256, 8 heads, ff 256, 4 blocks, batch 144),
# shrunk for 8 simulated devices on a CPU
SIZES = dict(vocab=2048, maxlen=64, embed=128, heads=8, ff=128, blocks=4, batch=32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    sys.path.insert(0, str(ROOT / "tests"))
    from models import minigpt as mg

    import jsbp
    import jsbp.flax as jflax

    s = SIZES

    def build():
        return mg.MiniGPT(
            s["maxlen"], s["vocab"], s["embed"], s["heads"], s["ff"], s["blocks"], nnx.Rngs(0)
        )

    def batch(seed):
        rng = np.random.default_rng(seed)
        inputs = rng.integers(1, s["vocab"], size=(s["batch"], s["maxlen"])).astype(np.int32)
        targets = np.concatenate([inputs[:, 1:], np.zeros((s["batch"], 1), np.int32)], axis=1)
        return inputs, targets

    def loss(model, b):
        return mg.loss_fn(model, b)[0]

    print(
        f"# miniGPT: jsbp against the tutorial's explicit-sharding jax.jit step (jax {jax.__version__}, "
        f"{os.cpu_count()} CPU cores, 8 simulated devices); sizes {s}"
    )
    print(f"# {args.steps} timed steps per side after {args.warmup} warm-up, medians\n")
    print(
        "| layout | JAX ms | jsbp ms | jsbp / JAX | first call: JAX s | jsbp s "
        "| collectives: JAX | jsbp |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for name in [x for x in args.layouts.split(",") if x]:
        grid = LAYOUTS[name]
        mesh = jax.make_mesh(grid, ("batch", "model"), axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(mesh):
            jmodel = build()
            jopt = nnx.Optimizer(jmodel, optax.adam(1e-3), wrt=nnx.Param)

            @nnx.jit
            def train_step(model, optimizer, b):
                grad_fn = nnx.value_and_grad(mg.loss_fn, has_aux=True)
                (value, _), grads = grad_fn(model, b)
                optimizer.update(model, grads)
                return value

        def jax_step(b, mesh=mesh, m=jmodel, o=jopt, f=train_step):
            with jax.set_mesh(mesh):
                return f(m, o, jax.device_put(b, NamedSharding(mesh, P("batch", None))))

        plc = jsbp.placement("cpu", np.arange(8).reshape(grid), axis_names=("batch", "model"))
        strategy = jflax.Strategy(plc, data_axis="batch")
        with nnx.use_eager_sharding(False):
            smodel = build()
        sopt = nnx.Optimizer(smodel, optax.adam(1e-3), wrt=nnx.Param)
        smodel, sopt = jflax.shard((smodel, sopt), strategy)
        step = jflax.make_train_step(loss, strategy)

        def jsbp_step(b, m=smodel, o=sopt, f=step):
            return f(m, o, b)

        first = {}
        for side, f in (("jax", jax_step), ("jsbp", jsbp_step)):
            t = time.perf_counter()
            first[side] = float(jax.block_until_ready(f(batch(0))))
            first[side + "_s"] = time.perf_counter() - t
        np.testing.assert_allclose(first["jsbp"], first["jax"], rtol=1e-4)
        counts = step.count_collectives(smodel, sopt, batch(0))
        with jax.set_mesh(mesh):
            b0 = jax.device_put(batch(0), NamedSharding(mesh, P("batch", None)))
            hlo = train_step.lower(jmodel, jopt, b0).compile().as_text()
        jcounts = jsbp.debug.collectives_in_hlo(hlo)
        # one step of each per round, shuffled (the steps update the models in place: no state)
        fns = [lambda st, b, f=f: (st, f(b)) for f in (jax_step, jsbp_step)]
        (mj, ms), _ = interleaved_medians(
            fns, [None, None], [batch(1)] * 2, args.steps, args.warmup
        )
        last = [float(f(batch(2))) for f in (jax_step, jsbp_step)]  # as many steps taken
        np.testing.assert_allclose(last[1], last[0], rtol=1e-3)
        ratio = ms / mj
        print(
            f"| {name} | {mj:.1f} | {ms:.1f} | {ratio:.2f} | {first['jax_s']:.2f} "
            f"| {first['jsbp_s']:.2f} | {fmt_coll(jcounts)} | {fmt_coll(counts)} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
