"""Context-parallel attention: per-device peak bytes and step time of each plan of
``jsbp.nn.dot_product_attention`` against sequence length, on 8 simulated CPU devices.

    python benchmarks/attention.py                  # 1k, 2k, 4k tokens
    python benchmarks/attention.py --lengths 1024 --reps 1

One step is the forward and the gradients of query, key and value of causal attention (batch 1,
8 heads of 32) with query, key and value split along the sequence over 8 devices. Per length,
the plans run side by side: ``gather`` (key/value all-gathered), ``ring`` (collective-permutes),
``heads`` (all-to-all, Ulysses) and the one the cost model chooses; ``one device`` is the same
step unsplit under ``jax.jit``. Peak bytes are XLA's (``jsbp.debug.measured_bytes``: arguments,
outputs and temporaries of the compiled per-device program); time is the median of ``--reps``
steps after one warm-up. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import median_seconds  # noqa: E402  (benchmarks/ is the script's directory)

import jsbp  # noqa: E402
import jsbp.nn  # noqa: E402

HEADS, HEAD_DIM = 8, 32
PLANS = ("gather", "ring", "heads", None)


def step_fn(plan):
    def loss(q, k, v):
        return jnp.sum(jsbp.nn.dot_product_attention(q, k, v, is_causal=True, plan=plan))

    return jax.grad(loss, (0, 1, 2))


def one_device(t, reps):
    x = [
        jnp.asarray(np.random.default_rng(i).normal(size=(1, t, HEADS, HEAD_DIM)), jnp.float32)
        for i in range(3)
    ]

    def step(q, k, v):
        return jax.grad(
            lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True)),
            (0, 1, 2),
        )(q, k, v)

    fn = jax.jit(step)
    peak = fn.lower(*x).compile().memory_analysis()
    peak = peak.argument_size_in_bytes + peak.output_size_in_bytes + peak.temp_size_in_bytes
    return peak, median_seconds(fn, x, reps)


def split(t, plan, reps, plc):
    rng = np.random.default_rng(0)
    x = [
        jsbp.tensor(rng.normal(size=(1, t, HEADS, HEAD_DIM)).astype(np.float32), plc, "S(1)")
        for _ in range(3)
    ]
    fn = jsbp.jit(step_fn(plan))
    notes = {r.note for r in jsbp.explain(fn, *x).rows if r.primitive.startswith("jsbp_attention")}
    peak = jsbp.debug.measured_bytes(fn, *x)["peak"]
    coll = {k: v for k, v in jsbp.debug.count_collectives(fn, *x).items() if v}
    return peak, median_seconds(fn, x, reps), notes, coll


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    plc = jsbp.placement("cpu", list(range(8)), axis_names=("x",))
    print("| tokens | plan | peak per device (MiB) | peak / one device | step (s) | collectives |")
    print("|---:|---|---:|---:|---:|---|")
    for t in (int(s) for s in args.lengths.split(",")):
        base_peak, base_time = one_device(t, args.reps)
        print(f"| {t} | one device | {base_peak / 2**20:.1f} | 1 | {base_time:.3f} | |", flush=True)
        for plan in PLANS:
            peak, sec, notes, coll = split(t, plan, args.reps, plc)
            name = plan or f"chosen: {', '.join(sorted(notes))}"
            colls = ", ".join(f"{v} {k}" for k, v in coll.items())
            print(
                f"| {t} | {name} | {peak / 2**20:.1f} | {peak / base_peak:.3f} | {sec:.3f} | {colls} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
