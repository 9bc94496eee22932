"""Expert parallelism: a mixture-of-experts train step with the experts split over 8 devices,
as the planner runs it (expert-parallel: tokens dispatched by all-to-all, or the weights
gathered, by cost) against every expert's weights gathered.

    python benchmarks/moe.py                      # 2048 and 8192 tokens
    python benchmarks/moe.py --tokens 1024 --reps 1

The layer is the dense GShard / Switch form of ``tests/test_moe.py`` (router, top-2, capacity
factor 1.25, one-hot dispatch, einsums over experts), model width 128, expert width 512, 8
experts. One step is the loss and the gradients of the input and every weight. Tokens are split
over the 8 devices and the expert weights along the expert dim in both rows; ``gathered`` asks
for the expert weights replicated inside the step (``jsbp.to_global(w, sbp="B")``), so each
device runs its tokens through every expert; ``planner's choice`` lets the cost model choose
(the collectives column shows which plan it took). Peak
is XLA's per-device figure; time the median of ``--reps`` steps after a warm-up. Prints one
Markdown table.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import median_seconds  # noqa: E402  (benchmarks/ is the script's directory)

import jsbp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from test_moe import dense_moe  # noqa: E402  (the layer the tests check against one device)

D, F, E = 128, 512, 8


def step_fn(gathered):
    def loss(x, wg, w1, w2):
        if gathered:
            w1, w2 = jsbp.to_global(w1, sbp="B"), jsbp.to_global(w2, sbp="B")
        return jnp.sum(dense_moe(x, wg, w1, w2) ** 2)

    return jax.value_and_grad(loss, (0, 1, 2, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    plc = jsbp.placement("cpu", list(range(8)), axis_names=("ep",))
    rng = np.random.default_rng(0)
    print("| tokens | plan | peak per device (MiB) | step (s) | collectives |")
    print("|---:|---|---:|---:|---|")
    for t in (int(s) for s in args.tokens.split(",")):
        host = [
            rng.normal(size=(t, D)),
            rng.normal(size=(D, E)) * 0.1,
            rng.normal(size=(E, D, F)) * D**-0.5,
            rng.normal(size=(E, F, D)) * F**-0.5,
        ]
        sbps = ["S(0)", "B", "S(0)", "S(0)"]
        args_ = [jsbp.tensor(h.astype(np.float32), plc, s) for h, s in zip(host, sbps)]
        ref = jax.jit(step_fn(False))(*(jnp.asarray(h, jnp.float32) for h in host))
        for gathered in (False, True):
            fn = jsbp.jit(step_fn(gathered))
            got = fn(*args_)
            np.testing.assert_allclose(got[0].numpy(), ref[0], rtol=1e-4)
            for g, r in zip(got[1], ref[1]):
                np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-4)
            seconds = median_seconds(fn, args_, args.reps)
            peak = jsbp.debug.measured_bytes(fn, *args_)["peak"]
            coll = jsbp.debug.count_collectives(fn, *args_)
            colls = ", ".join(f"{v} {k}" for k, v in coll.items() if v)
            name = "gathered experts" if gathered else "planner's choice"
            print(
                f"| {t} | {name} | {peak / 2**20:.1f} | {seconds:.3f} | {colls} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
