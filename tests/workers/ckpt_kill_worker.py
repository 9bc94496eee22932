"""A save that is killed half way (driven by tests/test_checkpoint.py).

    python tests/workers/ckpt_kill_worker.py <how> <path> <seed> [<point>:<sentinel>[:<seconds>]]

``how`` is ``step`` (``save_step(<path>, seed, tree)``), ``overwrite`` (``save(<path>, tree,
overwrite=True)``) or ``loop`` (8 overwrites, alternating the trees of ``seed`` and ``seed + 1``). With the last argument the worker replaces the save's ``_pause_point`` hook
(as the in-process tests do with ``monkeypatch``): at ``<point>`` the save writes its pid to the
sentinel file and sleeps, forever (the parent kills it with SIGKILL at a known point instead of
after a guessed delay) or for ``<seconds>`` (then it goes on).
"""

from __future__ import annotations

import os
import sys
import time

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


def pause_at(spec: str):
    """The ``_pause_point`` replacement for ``<point>:<sentinel>[:<seconds>]``."""
    point, sentinel, *seconds = spec.split(":")

    def pause(p: str) -> None:
        if p != point:
            return
        with open(sentinel, "w") as f:
            f.write(str(os.getpid()))
        if seconds:
            time.sleep(float(seconds[0]))
            return
        while True:  # the parent kills us here
            time.sleep(1)

    return pause


def main() -> None:
    how, path, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jsbp
    from jsbp import checkpoint as ck
    from jsbp.checkpoint import _save

    if len(sys.argv) > 4:
        _save._pause_point = pause_at(sys.argv[4])

    tree = build(jsbp, seed)
    if how == "step":
        ck.save_step(path, seed, tree)
    elif how == "loop":
        trees = [tree, build(jsbp, seed + 1)]
        for i in range(8):
            ck.save(path, trees[i % 2], overwrite=True)
    else:
        ck.save(path, tree, overwrite=True)
    print("saved without being killed", flush=True)


if __name__ == "__main__":
    main()
