"""The launcher's command line and each process's environment."""

from __future__ import annotations

import argparse
import os
import socket

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_EXIT_TIMEOUT_S", "TIMEOUT_STATUS", "free_port"]

DEFAULT_TIMEOUT_S = 180.0
"""``--timeout``: seconds without progress from any running process before the job is ended."""
DEFAULT_EXIT_TIMEOUT_S = 10.0
"""``--exit-timeout``: seconds the processes still running may go without progress after a
process finished before the job is ended (a rank that left early)."""
SHUTDOWN_TIMEOUT_S = 300
"""JAX's shutdown barrier (``JSBP_SHUTDOWN_TIMEOUT``, unless set): how long a finished process
waits at exit for the others. The launcher's watch ends a job whose ranks wait for each other
first, with a clear message; the barrier is the backstop for ranks on other machines, which this
launcher does not watch, and must not cut short a rank that still makes progress."""
STATUS_ENV = "JSBP_LAUNCH_STATUS_DIR"
"""Where each process reports to the launcher (``rank<R>.end``, ``.beat``, ``.fatal``)."""
TIMEOUT_STATUS = 124
"""The launcher's exit status when it ends a job that hangs (as ``timeout(1)``)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parser() -> argparse.ArgumentParser:
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
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help="end the job when no running process makes progress (prints a line or calls "
        "jsbp.distributed.heartbeat()) for S seconds (default %(default)g; 0: never)",
    )
    p.add_argument(
        "--exit-timeout",
        type=float,
        default=DEFAULT_EXIT_TIMEOUT_S,
        metavar="S",
        help="end the job when a process finished (exit code 0) and the processes still running "
        "make no progress (a line of output or a heartbeat) for S seconds after it (default "
        "%(default)g; 0: never)",
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


def validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
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
    if a.timeout < 0:
        p.error(f"--timeout must be >= 0 (0: never), got {a.timeout}")
    if a.exit_timeout < 0:
        p.error(f"--exit-timeout must be >= 0 (0: never), got {a.exit_timeout}")


def environments(a: argparse.Namespace, status_dir: str) -> list[dict[str, str]]:
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
        env[STATUS_ENV] = status_dir
        env.setdefault(
            "JSBP_SHUTDOWN_TIMEOUT", str(max(SHUTDOWN_TIMEOUT_S, int(a.exit_timeout) + 30))
        )
        # JAX's preemption service catches SIGTERM (to let a job reach a sync point), so a
        # process sent SIGTERM would go on; under the launcher SIGTERM ends the process, and with
        # it the job. Set JAX_ENABLE_PREEMPTION_SERVICE=true to keep JAX's handling.
        env.setdefault("JAX_ENABLE_PREEMPTION_SERVICE", "false")
        if a.devices_per_process is not None:
            k = str(a.devices_per_process)
            env.update(JSBP_DEVICES_PER_PROCESS=k, JAX_NUM_CPU_DEVICES=k)
            env.setdefault("JAX_PLATFORMS", "cpu")
        envs.append(env)
    return envs
