"""``jsbp.distributed`` and ``jsbp.env``: the environment contract, and jsbp across processes.

The environment is parsed by pure functions, tested here in-process without starting JAX's
runtime. The multi-process behaviour is tested for real: ``python -m jsbp.launch`` with
2 processes x 4 simulated CPU devices (one global 8-device placement) runs
``tests/workers/multiprocess_checks.py``, which checks boxing pairs, ``from_local``,
``to_local``, ``numpy()``, cross-placement moves and factories against a NumPy oracle on both
processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jsbp
from jsbp.distributed import DistributedError, _config, _runtime
from jsbp.distributed._transfer import _rounds, send_blocks

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"

GOOD = {
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "WORLD_SIZE": "4",
    "RANK": "3",
    "LOCAL_RANK": "1",
}
SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "8",
         "SLURM_PROCID": "5", "SLURM_LOCALID": "1"}  # fmt: skip


# -- the environment contract (pure) -------------------------------------------------------------


def test_launcher_variables_give_the_coordinator_and_ranks():
    cfg = _config.from_environ(dict(GOOD, LOCAL_WORLD_SIZE="2"))
    assert cfg == _config.Config("env", 3, 4, 1, 2, "127.0.0.1:29500")
    assert cfg.multi_process


def test_no_variables_is_a_single_process():
    assert _config.from_environ({}) == _config.Config("single", 0, 1, 0, 1)
    # one process described by the launcher variables needs no coordinator
    assert _config.from_environ({"WORLD_SIZE": "1", "RANK": "0"}).source == "single"


def test_rank_not_below_world_size_is_refused():
    with pytest.raises(
        DistributedError, match=r"RANK=4 is not smaller than WORLD_SIZE=4.*0 to WORLD_SIZE - 1 = 3"
    ):
        _config.from_environ(dict(GOOD, RANK="4"))


def test_missing_master_port_is_named():
    env = {k: v for k, v in GOOD.items() if k != "MASTER_PORT"}
    with pytest.raises(
        DistributedError, match=r"WORLD_SIZE=4 processes need MASTER_PORT, which is not set"
    ) as e:
        _config.from_environ(env)
    assert "MASTER_PORT unset" in str(e.value) and isinstance(e.value, ValueError)


def test_partial_variables_name_what_is_missing():
    with pytest.raises(DistributedError, match=r"WORLD_SIZE and RANK are not"):
        _config.from_environ({"MASTER_ADDR": "10.0.0.1"})
    with pytest.raises(DistributedError, match=r"RANK is not"):
        _config.from_environ({"WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"})
    with pytest.raises(DistributedError, match=r"need MASTER_ADDR and MASTER_PORT"):
        _config.from_environ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})


@pytest.mark.parametrize(
    "change, words",
    [
        ({"WORLD_SIZE": "four"}, "WORLD_SIZE='four' is not an integer"),
        ({"RANK": "-1"}, "RANK=-1 is out of range"),
        (
            {"MASTER_PORT": "70000"},
            "MASTER_PORT=70000 is out of range; MASTER_PORT must be the TCP port",
        ),
        ({"LOCAL_RANK": "2", "RANK": "1"}, "LOCAL_RANK=2 is larger than RANK=1"),
        ({"LOCAL_WORLD_SIZE": "1"}, "LOCAL_RANK=1 is not smaller than LOCAL_WORLD_SIZE=1"),
        ({"LOCAL_WORLD_SIZE": "8"}, "LOCAL_WORLD_SIZE=8 is larger than WORLD_SIZE=4"),
        ({"MASTER_ADDR": "10.0.0.1:29500"}, "set MASTER_ADDR to the host only ('10.0.0.1')"),
    ],
)
def test_contradictory_variables_are_refused(change, words):
    with pytest.raises(DistributedError) as e:
        _config.from_environ(dict(GOOD, **change))
    assert words in str(e.value)


def test_ipv6_master_address_is_bracketed():
    assert (
        _config.from_environ(dict(GOOD, MASTER_ADDR="fe80::1")).coordinator_address
        == "[fe80::1]:29500"
    )
    assert (
        _config.from_environ(dict(GOOD, MASTER_ADDR="[::1]")).coordinator_address == "[::1]:29500"
    )


def test_clusters_jax_detects():
    assert _config.from_environ(SLURM) == _config.Config("slurm", 5, 8, 1)
    assert _config.from_environ(dict(SLURM, SLURM_NTASKS="1", SLURM_PROCID="0")).source == "single"
    # an salloc shell (no job step) is not a multi-process run
    assert _config.from_environ({"SLURM_JOB_ID": "77"}).source == "single"
    ompi = {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}  # fmt: skip
    assert _config.from_environ(ompi) == _config.Config("ompi", 2, 4, 0)
    # the launcher's variables win over a surrounding cluster
    assert _config.from_environ(dict(SLURM, **GOOD)).source == "env"


@pytest.mark.skipif(
    importlib.util.find_spec("kubernetes") is not None, reason="kubernetes is installed"
)
def test_kubernetes_without_its_client_is_explained():
    with pytest.raises(DistributedError, match=r"needs the `kubernetes` package"):
        _config.from_environ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"})
    assert _config.from_environ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}).source == "single"


@pytest.fixture
def fresh_state(monkeypatch):
    """Forget any Config a previous test made initialize() adopt, and clear launcher variables."""
    monkeypatch.setattr(
        _runtime, "_state", {"config": None, "barriers": 0, "failed": None, "exit_hook": False}
    )
    for n in _config.LAUNCH_VARS + (
        "LOCAL_WORLD_SIZE",
        "JSBP_DEVICES_PER_PROCESS",
        "JSBP_DISTRIBUTED_TIMEOUT",
    ):
        monkeypatch.delenv(n, raising=False)
    return monkeypatch


def test_initialize_refuses_a_bad_environment_before_touching_jax(fresh_state):
    for k, v in dict(GOOD, RANK="7").items():
        fresh_state.setenv(k, v)
    with pytest.raises(DistributedError, match="RANK=7 is not smaller than WORLD_SIZE=4"):
        jsbp.distributed.initialize()
    fresh_state.delenv("MASTER_PORT")
    fresh_state.setenv("RANK", "0")
    with pytest.raises(DistributedError, match="MASTER_PORT"):
        jsbp.distributed.initialize()
    assert not jsbp.distributed.is_initialized()


def test_initialize_single_process_is_a_no_op(fresh_state):
    cfg = jsbp.distributed.initialize()
    assert cfg.source == "single" and not jsbp.distributed.is_initialized()
    assert (jsbp.env.get_rank(), jsbp.env.get_world_size(), jsbp.env.get_local_rank()) == (0, 1, 0)
    assert jsbp.env.is_main_process()
    jsbp.distributed.barrier()  # a single process never waits


def test_initialize_after_jax_started_explains_the_order(fresh_state):
    jax.devices()  # the backend runs with the 8 devices of conftest
    fresh_state.setenv("JSBP_DEVICES_PER_PROCESS", "3")
    with pytest.raises(
        DistributedError, match=r"3 CPU devices per process.*already started its backends with 8"
    ):
        jsbp.distributed.initialize()
    fresh_state.delenv("JSBP_DEVICES_PER_PROCESS")
    for k, v in GOOD.items():
        fresh_state.setenv(k, v)
    with pytest.raises(
        DistributedError, match=r"process 3 of 4 \(env\).*before any JAX computation"
    ):
        jsbp.distributed.initialize()


def test_env_reads_the_launcher_variables_before_initialize(fresh_state):
    for k, v in dict(GOOD, LOCAL_WORLD_SIZE="2").items():
        fresh_state.setenv(k, v)
    assert (jsbp.env.get_rank(), jsbp.env.get_world_size(), jsbp.env.get_local_rank()) == (3, 4, 1)
    assert not jsbp.env.is_main_process()


def test_allgather_local_shapes_single_process_checks_coverage():
    assert jsbp.distributed.allgather_local_shapes({0: (2, 3), 1: (1, 3)}, 2) == {
        0: (2, 3),
        1: (1, 3),
    }
    with pytest.raises(jsbp.SbpError, match=r"device index\(es\) \[1\]"):
        jsbp.distributed.allgather_local_shapes({0: (2, 3)}, 2)
    with pytest.raises(jsbp.SbpError, match="has 2 devices"):
        jsbp.distributed.allgather_local_shapes({0: (2,), 1: (2,), 5: (2,)}, 2)


def test_rounds_send_from_each_source_once_per_round():
    rounds = _rounds([(0, 4), (0, 5), (1, 6), (0, 7)])
    assert rounds == (((0, 4), (1, 6)), ((0, 5),), ((0, 7),))


def test_send_blocks_moves_between_disjoint_device_sets():
    # the multi-process mechanism (ppermute over the union mesh) also works in one process
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devs = jax.devices()
    src = NamedSharding(Mesh(np.array(devs[:4]), ("a",)), PartitionSpec("a"))
    dst = NamedSharding(Mesh(np.array(devs[4:]), ("a",)), PartitionSpec("a"))
    value = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    x = jax.device_put(value, src)
    # dst device i takes src block (3 - i): reversed
    y = send_blocks(x, [devs[3 - i] for i in range(4)], dst, (8, 3))
    assert y.sharding == dst
    want = np.concatenate([value[6:8], value[4:6], value[2:4], value[0:2]])
    np.testing.assert_array_equal(np.asarray(y), want)
    # a replicated value copied to a larger set: one source serves several devices (rounds)
    rep = jax.device_put(value, NamedSharding(Mesh(np.array(devs[:1]), ("a",)), PartitionSpec()))
    six = NamedSharding(Mesh(np.array(devs[2:8]), ("a",)), PartitionSpec())
    z = send_blocks(rep, [devs[0]] * 6, six, (8, 3))
    assert len(z.addressable_shards) == 6
    for s in z.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), value)


# -- many processes, for real --------------------------------------------------------------------


def _launch(*args, timeout):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for n in _config.LAUNCH_VARS + ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS"):
        env.pop(n, None)
    cmd = [
        sys.executable,
        "-m",
        "jsbp.launch",
        "--nproc-per-node",
        "2",
        "--devices-per-process",
        "4",
        *map(str, args),
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_processes_of_four_devices_match_the_oracle():
    r = _launch(WORKERS / "multiprocess_checks.py", timeout=400)
    reports = {}
    for line in r.stdout.splitlines():
        m = re.fullmatch(r"\[rank (\d)\] (\{\"rank\".*)", line)
        if m:
            reports[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(reports) == [0, 1], (r.stdout[-3000:], r.stderr[-6000:])
    failures = [
        f"rank {k}: {f['check']}: {f['error']}\n{f['tb']}"
        for k, rep in reports.items()
        for f in rep["failures"]
    ]
    assert not failures, "\n".join(failures)
    assert r.returncode == 0, r.stderr[-3000:]
    assert reports[0]["checks"] == reports[1]["checks"]
    names = reports[0]["checks"]
    assert len(names) >= 40
    assert (
        sum(n.startswith("box1d") for n in names) >= 16
        and sum(n.startswith("box2d") for n in names) >= 16
    )
    assert {"env", "cross-placement moves", "from_local infers shape across processes"} <= set(
        names
    )
    assert reports[0]["world"] == reports[1]["world"] == 2


def test_a_process_failing_inside_jax_stops_the_run_quickly():
    # rank 1 leaves with sys.exit(3) right after a cross-process collective while rank 0 waits
    # for it in a barrier: without the launcher and jsbp's fast exit this waits for minutes
    t0 = time.monotonic()
    r = _launch(WORKERS / "fail_worker.py", "jax", timeout=200)
    elapsed = time.monotonic() - t0
    assert r.returncode == 3, r.stderr[-3000:]
    assert "[rank 0] collective ok" in r.stdout and "[rank 1] collective ok" in r.stdout
    assert "jsbp.launch: failed: rank 1 exited with code 3" in r.stderr
    assert "passed a barrier" not in r.stdout
    assert elapsed < 45, f"{elapsed:.1f} s"
