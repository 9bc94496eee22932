"""``python -m jsbp.launch``: variables, rank-prefixed output, failure and Ctrl-C handling.

These workers import nothing heavy (no JAX), so each launch costs a Python start; the JAX
failure case lives in ``test_distributed.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jsbp.launch as jsbp_launch

REPO = Path(__file__).resolve().parents[1]
WORKERS = REPO / "tests" / "workers"
BOUND_S = 30
"""A failed or interrupted run must be over within this many seconds (the launcher's grace
period is 5 s; the rest is process start-up on a loaded machine)."""


def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for n in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "JAX_PLATFORMS",
              "JSBP_DEVICES_PER_PROCESS", "JAX_NUM_CPU_DEVICES"):  # fmt: skip
        env.pop(n, None)
    return env


def launch(*args, timeout=120):
    cmd = [sys.executable, "-m", "jsbp.launch", *map(str, args)]
    return subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def by_rank(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        m = re.fullmatch(r"\[rank (\d+)\] (\{.*\})", line)
        if m:
            out[int(m.group(1))] = json.loads(m.group(2))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(d: Path, n: int) -> list[int]:
    return [int((d / f"rank{r}.pid").read_text()) for r in range(n)]


def test_sets_variables_and_prefixes_every_line():
    r = launch("--nproc-per-node", 3, WORKERS / "echo_env.py", "--nnodes", "5", "-m", "x")
    assert r.returncode == 0, r.stderr
    got = by_rank(r.stdout)
    assert sorted(got) == [0, 1, 2]
    ports = {got[k]["env"]["MASTER_PORT"] for k in got}
    assert len(ports) == 1 and 0 < int(ports.pop()) < 65536
    for k, g in got.items():
        e = g["env"]
        assert (
            e["RANK"],
            e["LOCAL_RANK"],
            e["WORLD_SIZE"],
            e["LOCAL_WORLD_SIZE"],
            e["NODE_RANK"],
        ) == (str(k), str(k), "3", "3", "0")
        assert e["MASTER_ADDR"] == "127.0.0.1"
        assert e["JSBP_DEVICES_PER_PROCESS"] is None
        # everything after the script belongs to the script, even launcher-like options
        assert g["argv"] == ["--nnodes", "5", "-m", "x"]
        assert f"[rank {k}] unterminated {k}" in r.stdout.splitlines()
        assert f"[rank {k}] stderr of rank {k}" in r.stderr.splitlines()
    assert all(line.startswith("[rank ") for line in r.stdout.splitlines())


def test_node_rank_offsets_global_ranks_and_devices_per_process():
    r = launch("--nnodes", 2, "--node-rank", 1, "--master-addr", "127.0.0.1", "--master-port", 29999,
               "--nproc-per-node", 2, "--devices-per-process", 4, WORKERS / "echo_env.py")  # fmt: skip
    assert r.returncode == 0, r.stderr
    got = by_rank(r.stdout)
    assert sorted(got) == [2, 3]
    for k, g in got.items():
        e = g["env"]
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["NODE_RANK"]) == (
            str(k),
            str(k - 2),
            "4",
            "1",
        )
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", "29999")
        assert (e["JSBP_DEVICES_PER_PROCESS"], e["JAX_NUM_CPU_DEVICES"], e["JAX_PLATFORMS"]) == (
            "4",
            "4",
            "cpu",
        )


def test_module_mode_runs_a_module():
    r = launch("--nproc-per-node", 2, "--no-prefix", "-m", "platform")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[0] == lines[1] and not lines[0].startswith("[rank")


@pytest.mark.parametrize(
    "mode, code, words",
    [
        ("exit", 3, "rank 1 exited with code 3"),
        ("raise", 1, "rank 1 exited with code 1"),
        ("kill", 128 + signal.SIGKILL, "rank 1 was killed by SIGKILL (exit code -9)"),
    ],
)
def test_a_failed_process_stops_the_others(tmp_path, capfd, monkeypatch, mode, code, words):
    # the launcher's main() in this process (its children are real processes): saves a start-up
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    status = jsbp_launch.main(
        ["--nproc-per-node", "2", str(WORKERS / "fail_worker.py"), mode, str(tmp_path)]
    )
    elapsed = time.monotonic() - t0
    out, err = capfd.readouterr()
    assert status == code, (status, err)
    assert elapsed < BOUND_S, f"the launcher took {elapsed:.1f} s to give up"
    assert f"jsbp.launch: {words}; stopping the other 1 process(es)" in err
    assert f"jsbp.launch: failed: {words}" in err
    assert "[rank 0] rank 0 started" in out and "[rank 1] rank 1 started" in out
    if mode == "raise":
        assert "[rank 1] RuntimeError: worker failure on purpose" in err
    rank0 = _pids(tmp_path, 2)[0]
    assert not _alive(rank0), "rank 0 (sleeping 600 s) survived the launcher"


def test_ctrl_c_stops_every_process(tmp_path):
    cmd = [sys.executable, "-m", "jsbp.launch", "--nproc-per-node", "2",
           str(WORKERS / "fail_worker.py"), "sleep", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"rank{r}.pid").exists() for r in range(2)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        time.sleep(0.5)  # the pid file is written before the pid's content is flushed
        pids = _pids(tmp_path, 2)
        assert all(_alive(p) for p in pids)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert elapsed < BOUND_S
    assert "jsbp.launch: received SIGINT; stopping 2 process(es)" in err
    assert not any(_alive(p) for p in pids)


@pytest.mark.parametrize(
    "args, words",
    [
        (
            ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2"],
            "--node-rank must be in 0..1",
        ),
        (["--nproc-per-node", "2", "--nnodes", "2"], "pass --master-addr"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1"),
        (["--nproc-per-node", "1", "--master-port", "70000"], "--master-port must be in 1..65535"),
        (
            ["--nproc-per-node", "1", "--devices-per-process", "0"],
            "--devices-per-process must be >= 1",
        ),
        (["--nproc-per-node", "two"], "invalid int value: 'two'"),
    ],
)
def test_bad_arguments_are_refused(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        jsbp_launch.main([*args, str(WORKERS / "echo_env.py")])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert words in err and "[rank" not in out


# -- the watch: ranks that leave early, jobs that make no progress (no JAX) ----------------------


def _main(monkeypatch, *args):
    for k, v in _env().items():
        monkeypatch.setenv(k, v)
    t0 = time.monotonic()
    status = jsbp_launch.main([str(a) for a in args])
    return status, time.monotonic() - t0


def test_no_progress_ends_the_job_and_says_where_each_rank_is(tmp_path, capfd, monkeypatch):
    status, elapsed = _main(monkeypatch, "--nproc-per-node", 2, "--timeout", 2,
                            WORKERS / "fail_worker.py", "sleep", tmp_path)  # fmt: skip
    out, err = capfd.readouterr()
    assert status == jsbp_launch.TIMEOUT_STATUS, err
    assert elapsed < BOUND_S
    assert "jsbp.launch: no progress for 2." in err and "(--timeout 2 s)" in err
    for r in range(2):  # the stack says where: time.sleep at the worker's last line
        assert re.search(rf"jsbp.launch:   rank {r}: in <module> \(.*fail_worker.py:\d+\)", err), (
            err
        )
        assert "last output" in err and f"'rank {r} started'" in err
    assert re.search(r"failed: no progress for [\d.]+ s: rank 0 in <module>", err)
    assert not any(_alive(p) for p in _pids(tmp_path, 2))


def test_heartbeats_are_progress(tmp_path, capfd, monkeypatch):
    # 8 s without a line of output, but heartbeats every 0.2 s: not a hang under --timeout 4
    status, _ = _main(monkeypatch, "--nproc-per-node", 2, "--timeout", 4,
                      WORKERS / "fail_worker.py", "quiet", tmp_path)  # fmt: skip
    out, err = capfd.readouterr()
    assert status == 0, err
    assert "no progress" not in err


def test_a_rank_that_leaves_early_ends_the_job(tmp_path, capfd, monkeypatch):
    status, elapsed = _main(monkeypatch, "--nproc-per-node", 2, "--exit-timeout", 1,
                            WORKERS / "fail_worker.py", "leave", tmp_path)  # fmt: skip
    out, err = capfd.readouterr()
    assert status == jsbp_launch.TIMEOUT_STATUS, err
    assert elapsed < BOUND_S
    assert (
        "jsbp.launch: rank 1 finished (exit code 0)" in err and "while rank(s) 0 still run" in err
    )
    assert "failed: rank 1 left early: it finished while rank(s) 0 kept running" in err
    assert re.search(r"jsbp.launch:   rank 0: in <module> \(.*fail_worker.py:\d+\)", err), err
    assert not _alive(_pids(tmp_path, 2)[0])


def test_ranks_finishing_apart_within_the_exit_timeout_are_fine(capfd, monkeypatch):
    status, _ = _main(monkeypatch, "--nproc-per-node", 3, WORKERS / "echo_env.py")
    assert status == 0, capfd.readouterr()[1]


# -- faults of a real JAX job: each ends within seconds, naming the right rank --------

FAULT_TIMEOUT = 10
"""``--timeout`` of the hang cases (JAX start-up counts as progress: it heartbeats)."""
FAULT_BOUND_S = 60
"""Seconds from the fault to the launcher's exit, generously (the watch's own time is 10 s)."""


def _fault_run(mode, *opts, pid_dir=None, bound=FAULT_BOUND_S):
    """Run ``fault_worker.py MODE`` as 2 JAX processes; the seconds from the fault to the
    launcher's exit must stay under ``bound``. With ``pid_dir`` every rank's pid is checked gone."""
    env = _env()
    env.pop("XLA_FLAGS", None)
    extra = [str(pid_dir)] if pid_dir else []
    cmd = [sys.executable, "-m", "jsbp.launch", "--nproc-per-node", "2", "--devices-per-process",
           "2", "--grace-period", "2", *map(str, opts), str(WORKERS / "fault_worker.py"), mode,
           *extra]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    end = time.time()
    faults = [float(m) for m in re.findall(r"\[rank \d\] fault at ([\d.]+)", r.stdout)]
    assert len(faults) == 2, (r.stdout[-3000:], r.stderr[-3000:])
    seconds = end - max(faults)
    print(f"\n{mode}: {seconds:.1f} s from the fault to the launcher's exit")
    assert seconds < bound, f"{mode}: {seconds:.1f} s\n{r.stderr[-3000:]}"
    if pid_dir:
        left = [p for p in _pids(Path(pid_dir), 2) if _alive(p)]
        assert not left, f"processes left behind: {left}"
    return r, seconds


def test_jax_rank_sleeping_before_a_collective_ends_the_job():
    r, _ = _fault_run("hang", "--timeout", FAULT_TIMEOUT)
    assert r.returncode == jsbp_launch.TIMEOUT_STATUS, r.stderr[-3000:]
    err = r.stderr
    assert "jsbp.launch: no progress for" in err
    # rank 1 sleeps in the script itself; rank 0 waits in the collective (numpy() of a gather)
    assert re.search(r"jsbp.launch:   rank 1: in <module> \(.*fault_worker.py:\d+\)", err), err
    assert re.search(
        r"jsbp.launch:   rank 0: in numpy \(.*\), called from <module> \(.*fault_worker", err
    )
    assert "second collective ok" not in r.stdout


def test_jax_ranks_in_different_collectives_end_the_job():
    r, _ = _fault_run("diverge", "--timeout", FAULT_TIMEOUT)
    assert r.returncode == jsbp_launch.TIMEOUT_STATUS, r.stderr[-3000:]
    assert "jsbp.launch: no progress for" in r.stderr
    lines = {
        k: re.search(rf"jsbp.launch:   rank {k}: in .*fault_worker.py:(\d+)\)", r.stderr)
        for k in (0, 1)
    }
    assert all(lines.values()), r.stderr
    assert lines[0].group(1) != lines[1].group(1)  # each in its own collective


QUICK_S = 30
"""Seconds from a fault to the launcher's exit for the faults that must end a job "within
seconds": the watch's own part is at most the 10 s default --exit-timeout plus the 2 s grace
period; the rest is a loaded machine. The old launcher took 60 s and more for these."""


def test_jax_sigterm_to_one_rank_ends_the_job(tmp_path):
    # JAX's preemption service used to catch the SIGTERM: rank 1 went on, rank 0 waited for it
    r, seconds = _fault_run("sigterm", "--timeout", 120, pid_dir=tmp_path, bound=QUICK_S)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr[-3000:]
    err = r.stderr
    assert "jsbp.launch: failed: rank 1 was killed by SIGTERM (exit code -15)" in err, err[-3000:]
    assert re.search(r"jsbp.launch: rank 1: in <module> \(.*fault_worker.py:\d+\)", err), err[
        -3000:
    ]
    assert re.search(r"jsbp.launch: consequences: rank 0 (exited|failed) with code 1", err) or (
        "stopped by the launcher: rank(s) 0" in err
    ), err[-3000:]


@pytest.mark.parametrize(
    "mode, status, words",
    [
        ("segv", 128 + signal.SIGSEGV, "rank 1 was killed by SIGSEGV (exit code -11)"),
        ("os_exit0", 1, "rank 1 exited with code 0 before its script finished"),
        (
            "kill_coordinator",
            128 + signal.SIGKILL,
            "rank 0 (the coordinator: it serves JAX's coordination service at 127.0.0.1:",
        ),
    ],
)
def test_jax_rank_ending_without_a_word_is_blamed(tmp_path, mode, status, words):
    # the other rank dies of the broken connection, often before the launcher reaps the victim
    r, _ = _fault_run(mode, "--timeout", 120, pid_dir=tmp_path, bound=QUICK_S)
    err = r.stderr
    assert r.returncode == status, err[-3000:]
    assert f"jsbp.launch: failed: {words}" in err, err[-3000:]
    assert "(the first rank to fail)" in err, err[-3000:]
    other = 0 if mode != "kill_coordinator" else 1
    assert re.search(rf"jsbp.launch: consequences: rank {other} (exited|failed) with code 1", err)
    if mode == "segv":
        assert re.search(
            r"jsbp.launch: rank 1: Fatal Python error: Segmentation fault, in <module> "
            r"\(.*fault_worker.py:\d+\)",
            err,
        ), err[-3000:]
    if mode == "kill_coordinator":
        assert "was killed by SIGKILL (exit code -9)" in err


def test_jax_rank_leaving_early_ends_the_job_within_seconds_by_default(tmp_path):
    # rank 1 finished (sys.exit(0)) and waits in JAX's shutdown barrier; rank 0 waits for it in a
    # collective: no progress, so the default --exit-timeout (10 s) ends the job
    r, seconds = _fault_run("early_exit", "--timeout", 120, pid_dir=tmp_path, bound=QUICK_S)
    assert r.returncode == jsbp_launch.TIMEOUT_STATUS, r.stderr[-3000:]
    assert "failed: rank 1 left early" in r.stderr
    assert "made no progress for 1" in r.stderr and "(--exit-timeout 10 s)" in r.stderr


def test_jax_rank_leaving_early_ends_the_job():
    r, _ = _fault_run("early_exit", "--exit-timeout", 5, "--timeout", 60)
    assert r.returncode == jsbp_launch.TIMEOUT_STATUS, r.stderr[-3000:]
    assert "jsbp.launch: rank 1 finished (exit code 0)" in r.stderr
    assert "failed: rank 1 left early" in r.stderr
    # rank 1 waits in JAX's shutdown barrier, rank 0 in the collective rank 1 skipped
    assert re.search(r"jsbp.launch:   rank 1: in shutdown \(jax/_src/distributed.py", r.stderr)
    assert re.search(r"jsbp.launch:   rank 0: in numpy", r.stderr)


@pytest.mark.parametrize("attempt", [1, 2])
def test_jax_first_rank_to_fail_is_blamed(attempt):
    # rank 1 raises while rank 0 waits in a collective; rank 0 then dies of the broken connection
    r, _ = _fault_run("raise")
    assert r.returncode == 1, r.stderr[-3000:]
    err = r.stderr
    assert "jsbp.launch: failed: rank 1 exited with code 1" in err, err[-3000:]
    assert "jsbp.launch:   | RuntimeError: rank 1 fails on purpose" in err
    consequence = re.search(r"jsbp.launch: consequences: rank 0 (exited|failed) with code 1", err)
    stopped = "stopped by the launcher: rank(s) 0" in err
    assert consequence or stopped, err[-2000:]


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_the_first_rank_to_fail_is_blamed_not_the_lowest(tmp_path, capfd, monkeypatch, attempt):
    # both ranks fail within milliseconds; rank 0 only because rank 1 is gone
    status, elapsed = _main(monkeypatch, "--nproc-per-node", 2, WORKERS / "fail_worker.py",
                            "chain", tmp_path)  # fmt: skip
    out, err = capfd.readouterr()
    assert status == 1, err
    # rank 1 is given a moment to finish exiting; if it is stopped, it is still the one to blame
    assert re.search(
        r"jsbp.launch: failed: rank 1 (exited with code 1|failed with code 1 \(Runt)", err
    )
    assert "(the first rank to fail)" in err
    assert "jsbp.launch:   | RuntimeError: rank 1 fails first" in err
    assert re.search(
        r"consequences: rank 0 (exited|failed) with code 1 \(RuntimeError: rank 0 fails", err
    )
    assert elapsed < BOUND_S


@pytest.mark.parametrize("attempt", [1, 2])
@pytest.mark.parametrize(
    "mode, status, words",
    [
        ("segv", 128 + signal.SIGSEGV, "rank 1 was killed by SIGSEGV (exit code -11)"),
        ("vanish", 1, "rank 1 exited with code 0 before its script finished (os._exit"),
        ("kill0", 128 + signal.SIGKILL, "rank 0 (the coordinator: it serves JAX's coordination"),
    ],
)
def test_a_rank_that_ends_without_a_word_is_blamed_not_the_peer_that_noticed(
    tmp_path, capfd, monkeypatch, mode, status, words, attempt
):
    # the peer raises within a millisecond of the victim's end, before the launcher reaps it
    status_, elapsed = _main(monkeypatch, "--nproc-per-node", 2, WORKERS / "fail_worker.py",
                             mode, tmp_path)  # fmt: skip
    out, err = capfd.readouterr()
    assert status_ == status, err
    assert f"jsbp.launch: failed: {words}" in err, err
    peer = 1 if mode == "kill0" else 0
    assert re.search(
        rf"consequences: rank {peer} (exited|failed) with code 1 \(RuntimeError: rank {peer}: "
        r"rank \d is gone\)",
        err,
    ), err
    if mode == "segv":  # faulthandler's record: the time of death, and where
        assert re.search(
            r"rank 1: Fatal Python error: Segmentation fault, in <module> \(.*fail_worker.py:\d+\)",
            err,
        ), err
    assert elapsed < BOUND_S
    assert not any(_alive(p) for p in _pids(tmp_path, 2))


def test_a_finished_rank_waits_for_peers_that_make_progress(tmp_path, capfd, monkeypatch):
    # rank 1 leaves at once; rank 0 prints a line every 0.2 s for 4 s: it makes progress, so a
    # 1 s --exit-timeout does not end the job
    status, _ = _main(monkeypatch, "--nproc-per-node", 2, "--exit-timeout", 1,
                      WORKERS / "fail_worker.py", "tail", tmp_path)  # fmt: skip
    out, err = capfd.readouterr()
    assert status == 0, err
    assert "left early" not in err
    assert "[rank 0] rank 0 still working 19" in out
