"""Shared by the benchmarks (``training.py``, ``models.py``, ``auto.py``, ``attention.py``, ``moe.py``):
the GSPMD baselines' pins (what a jsbp strategy annotates, written as ``with_sharding_constraint``
on ``NamedSharding`` s), the interleaved step timer, the plain median timer and the short names of collectives in their
tables. Only jsbp's public API is used (``jsbp.named_sharding``, ``jsbp.debug``), so a refactor of
jsbp's private modules does not break the benchmarks."""

from __future__ import annotations

import random
import statistics
import time


def partition_spec(placement, nd, shape):
    """The ``PartitionSpec`` of nd-sbp ``nd`` for a tensor of ``shape`` on ``placement`` (S and B
    only): ``jsbp.named_sharding``'s spec, for a ``NamedSharding`` over ``placement.mesh``."""
    import jsbp

    return jsbp.named_sharding(placement, tuple(nd), len(shape)).spec


def is_even(placement, nd, shape) -> bool:
    """True when every split of nd-sbp ``nd`` divides its dim of ``shape`` (no padded block)."""
    sizes = dict(zip(placement.axis_names, placement.hierarchy))
    spec = partition_spec(placement, nd, shape)
    for n, entry in zip(shape, tuple(spec)):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        ways = 1
        for a in axes:
            ways *= sizes[a]
        if n and n % ways:
            return False
    return True


def fmt_bytes(n: float) -> str:
    """``n`` bytes in B / KiB / MiB / GiB, as jsbp's reports print them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def median_seconds(fn, args, reps):
    """Median wall time of ``fn(*args)`` over ``reps`` calls after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def interleaved_medians(fns, states, batches, steps, warmup, seed=0):
    """Median step time (ms) of each ``fn(state, batch) -> (state, loss)`` and the final states.
    One step of each per round, in an order shuffled every round (fixed ``seed``), so that neither
    a busy machine nor a function's predecessor in the round favours one of them; each step is
    timed until its state and loss are ready."""
    import jax

    rng = random.Random(seed)
    times = [[] for _ in fns]
    states = list(states)
    order = list(range(len(fns)))
    for i in range(warmup + steps):
        rng.shuffle(order)
        for k in order:
            t = time.perf_counter()
            states[k], loss = fns[k](states[k], batches[k])
            jax.block_until_ready((states[k], loss))
            if i >= warmup:
                times[k].append((time.perf_counter() - t) * 1e3)
    return [statistics.median(t) for t in times], states


def pins(strategy, plans, sharding):
    """``(wsc_names, use, pin_grad, map_flat)`` for a strategy: ``wsc_names`` stands in for
    ``jsbp.flax.constrain``; ``use`` / ``pin_grad`` pin a parameter to its ZeRO-3 use layout and a
    gradient to its strategy layout (``plans``: ``jsbp.flax.leaf_layouts``); ``map_flat`` maps a
    function of ``(path, value)`` over an ``nnx.State``. ``sharding(nd, shape)``: the
    ``NamedSharding`` of an nd-sbp."""
    import jax  # imported here: the scripts set up their devices before JAX starts
    import numpy as np
    from flax import nnx

    def wsc_names(x, names=None, *, sbp=None, grad_sbp="same"):
        nd = strategy.sbp_for_names(names, np.shape(x)) if sbp is None else sbp
        return jax.lax.with_sharding_constraint(x, sharding(nd, np.shape(x)))

    def use(path, p):
        return jax.lax.with_sharding_constraint(p, sharding(plans[(0,) + path].use, p.shape))

    def pin_grad(path, g):
        return jax.lax.with_sharding_constraint(g, sharding(plans[(0,) + path].grad, g.shape))

    def map_flat(st, f):
        return nnx.from_flat_state(
            [(p, v.replace(f(p, v.get_value()))) for p, v in nnx.to_flat_state(st)]
        )

    return wsc_names, use, pin_grad, map_flat


_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "all-to-all": "A2A",
    "collective-permute": "CP",
}


def fmt_coll(c: dict) -> str:
    """``{"all-reduce": 3, "all-gather": 1}`` -> ``"3 AR, 1 AG"`` (``"none"`` when empty)."""
    parts = [f"{v} {_SHORT.get(k, k)}" for k, v in c.items() if v]
    return ", ".join(parts) if parts else "none"
