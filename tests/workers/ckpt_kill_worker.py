"""A save that is killed half way (driven by tests/test_checkpoint.py).

    JSBP_CHECKPOINT_TEST_PAUSE=<point>:<sentinel> python tests/workers/ckpt_kill_worker.py <how> <path> <seed>

``how`` is ``step`` (``save_step(<path>, seed, tree)``) or ``overwrite`` (``save(<path>, tree,
overwrite=True)``). The test hook makes the save touch the sentinel file at ``<point>`` and sleep,
so the parent kills it with SIGKILL at a known point instead of after a guessed delay.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def tree_values(seed: int) -> dict[str, np.ndarray]:
    """A few MB of float32 in uneven and even shapes; the values depend on ``seed`` only."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((1000, 250)).astype(np.float32),
        "w": rng.standard_normal((333, 257)).astype(np.float32),
        "b": rng.standard_normal((257,)).astype(np.float32),
    }


def layouts(jsbp) -> dict:
    p8 = jsbp.placement("cpu", list(range(8)))
    q = jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]])
    return {"embed": (p8, "S(0)"), "w": (q, ("S(1)", "P")), "b": (p8, "S(0)")}


def build(jsbp, seed: int) -> dict:
    vals = tree_values(seed)
    tree = {
        k: jsbp.tensor(vals[k], placement=plc, sbp=sbp) for k, (plc, sbp) in layouts(jsbp).items()
    }
    tree["step"] = seed
    return tree


def main() -> None:
    how, path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jsbp
    from jsbp import checkpoint as ck

    tree = build(jsbp, seed)
    if how == "step":
        ck.save_step(path, seed, tree)
    else:
        ck.save(path, tree, overwrite=True)
    print("saved without being killed", flush=True)


if __name__ == "__main__":
    main()
