"""One process of a 2-process checkpoint test (4 simulated CPU devices each, gloo collectives).

    python -m jsbp.launch --nproc-per-node 2 --devices-per-process 4 \
        tests/workers/ckpt_mp_worker.py <save|load> <checkpoint dir>
    python tests/workers/ckpt_mp_worker.py <save|load> <checkpoint dir> <process id> <port>  # x2

``save``: both processes build the tensors of ``values()`` on placements that span both
processes (uneven, partial and even layouts) and save them together; each writes its own shards.
``load``: both processes load a checkpoint of ``values()`` (written by a single process) onto
cross-process placements and check every value bit-exactly and every local shape; prints
``CKPT-WORKER-OK <pid>`` on success. ``differ``: each process passes ``save`` a tree that
differs from the other's (a scalar's value, a numpy array's value, the copies of a tensor
replicated across both processes, the structure, a tensor each process holds on its own devices) and checks that each save raises the same ``CheckpointError`` on both
processes, naming the leaf, and writes nothing. The parent test (tests/test_checkpoint.py) does
the other half.
"""

from __future__ import annotations

import os
import sys

import numpy as np

NPROC = 2
LOCAL_DEVICES = 4


def values() -> dict[str, np.ndarray]:
    """The logical values both halves of the test agree on (exactly representable sums)."""
    rng = np.random.default_rng(1234)
    return {
        "w": rng.standard_normal((25, 33)).astype(np.float32),
        "b": rng.integers(-50, 50, (6, 10)).astype(np.float32),
        "e": rng.standard_normal((16, 8)).astype(np.float32),
        "i": np.arange(3 * 5, dtype=np.int32).reshape(3, 5),
    }


def save_layouts(jsbp, ids):
    """(placement, sbp) per leaf for the 2-process side; ``ids``: the 8 device ids in order (the
    first 4 on process 0). Every placement spans both processes."""
    ids = np.asarray(ids)
    p8 = jsbp.placement("cpu", ids)
    q24 = jsbp.placement("cpu", ids.reshape(2, 4))
    q42 = jsbp.placement("cpu", ids.reshape(4, 2))
    return {
        "w": (p8, ("S(0)",)),
        "b": (q24, ("P", "S(1)")),
        "e": (q42, ("S(0)", "S(1)")),
        "i": (q24, ("S(1)", "B")),
    }


def load_layouts(jsbp, ids):
    ids = np.asarray(ids)
    p8 = jsbp.placement("cpu", ids)
    q24 = jsbp.placement("cpu", ids.reshape(2, 4))
    q42 = jsbp.placement("cpu", ids.reshape(4, 2))
    return {
        "w": (q42, ("S(1)", "S(0)")),
        "b": (p8, ("S(1)",)),
        "e": (q24, ("B", "P")),
        "i": (p8, ("S(0)",)),
    }


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(sys.argv) > 3:  # our own minimal start: <process id> <coordinator port>
        pid, port = int(sys.argv[3]), int(sys.argv[4])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=NPROC, process_id=pid)
    else:  # started by python -m jsbp.launch --nproc-per-node 2 --devices-per-process 4
        import jsbp.distributed

        jsbp.distributed.initialize()
    pid = jax.process_index()
    assert jax.process_count() == NPROC and jax.device_count() == NPROC * LOCAL_DEVICES, (
        jax.devices()
    )

    import jsbp
    from jsbp import checkpoint as ck

    vals = values()
    ids = [d.id for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id))]
    if mode == "differ":
        p8 = jsbp.placement("cpu", ids)
        x = jsbp.tensor(vals["w"], placement=p8, sbp="S(0)")
        cases = {
            "['step']": {"x": x, "step": pid},
            "['n']": {"x": x, "n": np.full(3, float(pid))},
            # B across both processes, but each process's copies hold its own value
            "['b']": {
                "x": x,
                "b": jsbp.from_local(
                    [np.full(8, float(pid))] * LOCAL_DEVICES, placement=p8, sbp="B"
                ),
            },
            "structure": {"x": x, f"only_{pid}": 1},
            # each process saves its own tensor on its own devices (the same shape and sbp)
            "['local']": {
                "x": x,
                "local": jsbp.tensor(
                    vals["w"] + pid,
                    placement=jsbp.placement("cpu", [d.id for d in jax.local_devices()]),
                    sbp="S(0)",
                ),
            },
        }
        for name, tree in cases.items():
            try:
                ck.save(path, tree)
            except ck.CheckpointError as e:
                msg = str(e)
                assert "processes 0 and 1 passed different trees" in msg, msg
                if name == "structure":
                    assert "tree structures differ" in msg and "only_0" in msg, msg
                else:
                    assert f"the leaf at {name} differs" in msg, msg
                assert "nothing was written" in msg, msg
            else:
                raise AssertionError(f"{name}: different trees were saved without an error")
            assert not os.path.exists(path), path
    elif mode == "save":
        tree = {
            k: jsbp.tensor(vals[k], placement=plc, sbp=sbp)
            for k, (plc, sbp) in save_layouts(jsbp, ids).items()
        }
        tree["step"] = 7
        ck.save(path, tree)
    else:
        target = {
            k: ck.TensorSpec(vals[k].shape, vals[k].dtype, plc, sbp)
            for k, (plc, sbp) in load_layouts(jsbp, ids).items()
        }
        target["step"] = 0
        out = ck.load(path, target)
        assert out["step"] == 7, out["step"]
        for k, v in vals.items():
            x = out[k]
            assert (x.placement, x.sbp) == (target[k].placement, target[k].sbp), (k, x)
            got = x.numpy()
            assert got.dtype == v.dtype and np.array_equal(got, v), (k, got, v)
            lay = x.layout
            mine = [
                tuple(s for _, s in blk)
                for blk, dev in zip(lay.blocks, lay.placement.devices.reshape(-1))
                if dev.process_index == jax.process_index()
            ]
            assert [tuple(a.shape) for a in x.to_local()] == mine, (k, mine)
    print(f"CKPT-WORKER-OK {pid}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
