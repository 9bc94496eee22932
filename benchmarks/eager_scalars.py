"""Eager steps with a changing Python scalar (a learning-rate schedule) against a constant one.

Run from the repository root::

    python benchmarks/eager_scalars.py            # 150 steps, 8 simulated CPU devices
    python benchmarks/eager_scalars.py --steps 50

One eager SGD-like step on global tensors (``w - lr * g`` for three parameters, plus a weight
decay ``w * (1 - lr * wd)``) runs ``--steps`` times with a learning rate that changes every step
(warmup then cosine) and ``--steps`` times with a constant one, after one warm-up step each. The
same steps run on plain sharded ``jax.Array`` s (``jnp`` ops) as a reference. Each timed step ends
in ``block_until_ready``. It prints the total seconds, the per-step median, the ratio schedule /
constant, the XLA compilations during the timed steps (JAX's backend-compile event) and the
process's resident-memory growth over 500 distinct scalars. Exits non-zero where the schedule is
more than 2x the constant (the done-when of the eager-scalars item) or where the two runs disagree
with the reference.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jsbp  # noqa: E402

_COMPILE = "/jax/core/compile/backend_compile_duration"


def schedule(i, n, base=1e-2, warmup=10):
    if i < warmup:
        return base * (i + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(n - warmup, 1)))


def step(params, grads, lr, wd=1e-4):
    return [w * (1 - lr * wd) - lr * g for w, g in zip(params, grads)]


def rss_mb() -> float:
    """The process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run(pairs):
    """Steps of several (params, grads, lrs) runs interleaved, one step of each per round, each
    timed until its result is ready. Returns the final params and step times of each run."""
    states = [ps for ps, _, _ in pairs]
    times = [[] for _ in pairs]
    for i in range(len(pairs[0][2])):
        for k, (_, gs, lrs) in enumerate(pairs):
            t = time.perf_counter()
            states[k] = step(states[k], gs, lrs[i])
            jax.block_until_ready(
                [p.physical if isinstance(p, jsbp.GlobalTensor) else p for p in states[k]]
            )
            times[k].append(time.perf_counter() - t)
    return states, times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    n = args.steps
    plc = jsbp.placement("cpu", list(range(8)))
    shapes = [(256, 64), (64,), (64, 32)]
    sbps = ["S(0)", "B", "S(1)"]
    rng = np.random.default_rng(0)
    w0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    g0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params = [jsbp.tensor(w, placement=plc, sbp=s) for w, s in zip(w0, sbps)]
    grads = [jsbp.tensor(g, placement=plc, sbp=s) for g, s in zip(g0, sbps)]
    mesh = jax.make_mesh((8,), ("d",), devices=jax.devices()[:8])
    specs = [jax.P("d"), jax.P(), jax.P(None, "d")]
    jparams = [jax.device_put(w, jax.NamedSharding(mesh, s)) for w, s in zip(w0, specs)]
    jgrads = [jax.device_put(g, jax.NamedSharding(mesh, s)) for g, s in zip(g0, specs)]

    compiles = [0]

    def listener(event, duration, **kw):
        if event == _COMPILE:
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    sched = [schedule(i, n) for i in range(n)]
    const = [1e-2] * n
    rows = []
    results = {}
    for name, ps, gs in (("jsbp", params, grads), ("jax.Array", jparams, jgrads)):
        run([(ps, gs, [0.123])])  # warm-up: compiles the step's programs
        compiles[0] = 0
        outs, times = run([(ps, gs, sched), (ps, gs, const)])
        for label, out, ts in zip(("schedule", "constant"), outs, times):
            results[(name, label)] = out
            rows.append((name, label, sum(ts), statistics.median(ts) * 1e3))
        rows[-2] += (compiles[0],)
        rows[-1] += ("",)
    print(
        f"eager step, {n} steps, 3 parameters on {plc.size} devices (jsbp {jsbp.__version__}, jax {jax.__version__})"
    )
    print("(schedule and constant steps interleaved; compiles: both runs' timed steps together)")
    print(f"{'arrays':<10} {'learning rate':<14} {'total s':>8} {'median ms':>10} {'compiles':>9}")
    for name, label, tot, med, comp in rows:
        print(f"{name:<10} {label:<14} {tot:8.3f} {med:10.3f} {comp!s:>9}")
    ratio = rows[0][2] / rows[1][2]
    print(f"jsbp schedule / constant: {ratio:.2f}x (jax.Array: {rows[2][2] / rows[3][2]:.2f}x)")

    # memory over 500 distinct scalars
    x = params[0]
    (x * 0.5).numpy()
    before = rss_mb()
    for i in range(500):
        y = x * (1e-4 * i + 1e-7)
    y.numpy()
    print(f"resident memory growth over 500 distinct scalars: {rss_mb() - before:.1f} MB")

    ok = True
    for label in ("schedule", "constant"):
        for a, b in zip(results[("jsbp", label)], results[("jax.Array", label)]):
            if not np.allclose(a.numpy(), np.asarray(b), rtol=1e-5, atol=1e-6):
                print(f"MISMATCH: jsbp and jax.Array differ ({label})")
                ok = False
    if ratio > 2.0:
        print("FAIL: the schedule is more than 2x the constant")
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
