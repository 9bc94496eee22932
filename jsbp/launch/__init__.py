"""``python -m jsbp.launch``: start one process per device (or per group of devices) on this machine.

    python -m jsbp.launch --nproc-per-node 4 train.py --lr 3e-4
    python -m jsbp.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --nproc-per-node 8 train.py
    python -m jsbp.launch --nproc-per-node 2 --devices-per-process 4 train.py   # 8 simulated CPU devices

Every process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``NODE_RANK`` (the variables ``jsbp.distributed.initialize()`` reads,
the same as ``torchrun``'s); ``--devices-per-process K`` adds ``JSBP_DEVICES_PER_PROCESS=K`` and
``JAX_NUM_CPU_DEVICES=K`` (and ``JAX_PLATFORMS=cpu`` unless it is set).

Each line a process prints is prefixed with ``[rank R]`` (stdout to stdout, stderr to stderr).
When a process fails (non-zero exit or killed by a signal) the launcher stops the others
(SIGTERM, then SIGKILL after ``--grace-period`` seconds) and exits with that process's code and a
message naming its rank. Ctrl-C (SIGINT) or SIGTERM to the launcher stops every process the same
way. Each process runs in its own process group, so whatever it spawned is stopped too.

A process runs the script through ``jsbp/launch/_child.py`` (like ``python script.py``), which makes
``sys.exit(code != 0)`` after ``jsbp.distributed.initialize()`` leave at once rather than wait in
JAX's shutdown barrier for processes that may be waiting for it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["main", "free_port"]

_PREFIX = "jsbp.launch"
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
"""Run by path, so a child imports nothing of jsbp (nor JAX) before the user's script does."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jsbp.launch",
        allow_abbrev=False,
        description="Start N processes of a jsbp program on this machine, with the variables "
        "jsbp.distributed.initialize() reads (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK).",
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        required=True,
        metavar="N",
        help="processes to start on this machine (one per GPU, typically)",
    )
    p.add_argument(
        "--nnodes", type=int, default=1, metavar="M", help="machines in the run (default 1)"
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=0,
        metavar="R",
        help="this machine's index, 0..M-1 (default 0)",
    )
    p.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="A",
        help="host of rank 0's coordinator (default 127.0.0.1 for one machine; required for several)",
    )
    p.add_argument(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        metavar="P",
        help="port of rank 0's coordinator (default: a free port, one machine only)",
    )
    p.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="give every process K simulated CPU devices (for testing without accelerators)",
    )
    p.add_argument(
        "--grace-period",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping processes (default 5)",
    )
    p.add_argument(
        "--no-prefix", action="store_true", help="do not prefix output lines with the rank"
    )
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the program as a module (python -m script), like python -m",
    )
    p.add_argument("script", help="the Python script (or module with -m) every process runs")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.nproc_per_node < 1:
        p.error(f"--nproc-per-node must be >= 1, got {a.nproc_per_node}")
    if a.nnodes < 1:
        p.error(f"--nnodes must be >= 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        p.error(
            f"--node-rank must be in 0..{a.nnodes - 1} for --nnodes {a.nnodes}, got {a.node_rank}"
        )
    if a.nnodes > 1 and (a.master_addr is None or a.master_port is None):
        p.error(
            f"--nnodes {a.nnodes}: every machine must agree on rank 0's coordinator; pass --master-addr "
            "(the host of node 0) and --master-port (a free port there) on every machine"
        )
    if a.master_port is not None and not 1 <= a.master_port <= 65535:
        p.error(f"--master-port must be in 1..65535, got {a.master_port}")
    if a.devices_per_process is not None and a.devices_per_process < 1:
        p.error(f"--devices-per-process must be >= 1, got {a.devices_per_process}")
    if a.grace_period < 0:
        p.error(f"--grace-period must be >= 0, got {a.grace_period}")


def _environments(a: argparse.Namespace) -> list[dict[str, str]]:
    addr = a.master_addr or "127.0.0.1"
    port = a.master_port if a.master_port is not None else free_port()
    world = a.nnodes * a.nproc_per_node
    envs = []
    for local in range(a.nproc_per_node):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            RANK=str(a.node_rank * a.nproc_per_node + local),
            LOCAL_RANK=str(local),
            LOCAL_WORLD_SIZE=str(a.nproc_per_node),
            NODE_RANK=str(a.node_rank),
            PYTHONUNBUFFERED="1",
        )
        if a.devices_per_process is not None:
            k = str(a.devices_per_process)
            env.update(JSBP_DEVICES_PER_PROCESS=k, JAX_NUM_CPU_DEVICES=k)
            env.setdefault("JAX_PLATFORMS", "cpu")
        envs.append(env)
    return envs


class _Printer:
    """Copies a child's pipe to our stream line by line, with a ``[rank R]`` prefix."""

    def __init__(self, lock: threading.Lock, prefix: bool):
        self._lock = lock
        self._prefix = prefix

    def pump(self, pipe, out, rank: int) -> None:
        tag = f"[rank {rank}] ".encode() if self._prefix else b""
        sink = out.buffer if hasattr(out, "buffer") else None
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                with self._lock:
                    if sink is not None:
                        sink.write(tag + line)
                        sink.flush()
                    else:
                        out.write((tag + line).decode(errors="replace"))
                        out.flush()
        except (OSError, ValueError):
            pass
        finally:
            pipe.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(procs: list[subprocess.Popen], first_sig: int, grace: float) -> None:
    """``first_sig`` to every process group still running, SIGKILL to those left after ``grace``."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, first_sig)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(p, signal.SIGKILL)  # stragglers the child left in its group


def _say(msg: str) -> None:
    print(f"{_PREFIX}: {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the launcher; returns the exit status (0 when every process exits with 0)."""
    parser = _parser()
    a = parser.parse_args(argv)
    _validate(parser, a)
    args = list(a.script_args)
    if args and args[0] == "--":
        args = args[1:]
    kind = "module" if a.module else "path"
    cmd = [sys.executable, "-u", _CHILD, kind, a.script] + args
    envs = _environments(a)
    ranks = [int(e["RANK"]) for e in envs]

    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lock = threading.Lock()
    printer = _Printer(lock, not a.no_prefix)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    try:
        for env, rank in zip(envs, ranks):
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: signals reach the child's children too
            )
            procs.append(proc)
            for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=printer.pump, args=(pipe, out, rank), daemon=True)
                t.start()
                pumps.append(t)

        status = 0
        while True:
            if received:
                sig = received[0]
                _say(
                    f"received {signal.Signals(sig).name}; stopping {sum(p.poll() is None for p in procs)} process(es)"
                )
                _stop(procs, sig, a.grace_period)
                status = 128 + sig
                break
            failed = [
                (r, p.returncode)
                for r, p in zip(ranks, procs)
                if p.poll() is not None and p.returncode != 0
            ]
            if failed:
                rank, code = failed[0]
                alive = sum(p.poll() is None for p in procs)
                if alive:
                    _say(f"rank {rank} {_describe(code)}; stopping the other {alive} process(es)")
                _stop(procs, signal.SIGTERM, a.grace_period)
                _say(f"failed: rank {rank} {_describe(code)}")
                status = _exit_status(code) or 1
                break
            if all(p.poll() is not None for p in procs):
                break
            time.sleep(0.05)
    except BaseException:
        _stop(procs, signal.SIGTERM, a.grace_period)
        raise
    finally:
        for t in pumps:
            t.join(timeout=2)
        for s, h in old.items():
            signal.signal(s, h)
    return status
