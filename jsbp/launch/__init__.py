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
The launcher watches its processes and ends the job (SIGTERM, then SIGKILL after
``--grace-period`` seconds, to every process group) when

* a process fails (non-zero exit, killed by a signal): it exits with that process's code and
  blames the **first** rank to fail (the time each rank failed is reported by the rank itself,
  before the others notice), with its last lines of output; ranks that failed after it are
  listed as consequences;
* a process finished (exit code 0, or its script returned and it waits in JAX's shutdown
  barrier) while others still run ``--exit-timeout`` seconds later (default 60): it names the
  rank that left early and where the others are (exit status 124);
* no running process made progress for ``--timeout`` seconds (default 180): progress is a line
  of output or ``jsbp.distributed.heartbeat()`` (which jsbp calls in its barriers, exchanges,
  checkpoints and after each JAX compilation); it names every rank with its Python stack
  (asked with SIGUSR1, see ``_child``), its noted activity and last output (exit status 124);
* Ctrl-C (SIGINT) or SIGTERM reaches the launcher.

Each process runs in its own process group, so whatever it spawned is stopped too.

A process runs the script through ``jsbp/launch/_child.py`` (like ``python script.py``), which makes
``sys.exit(code != 0)`` after ``jsbp.distributed.initialize()`` leave at once rather than wait in
JAX's shutdown barrier for processes that may be waiting for it, reports how and when the script
ended, and dumps its stacks on SIGUSR1.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

__all__ = ["main", "free_port", "DEFAULT_TIMEOUT_S", "DEFAULT_EXIT_TIMEOUT_S"]

_PREFIX = "jsbp.launch"
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
"""Run by path, so a child imports nothing of jsbp (nor JAX) before the user's script does."""

DEFAULT_TIMEOUT_S = 180.0
"""``--timeout``: seconds without progress from any running process before the job is ended."""
DEFAULT_EXIT_TIMEOUT_S = 60.0
"""``--exit-timeout``: seconds a finished process may wait for the others before the job is ended."""
_SHUTDOWN_MARGIN_S = 30
"""JAX's shutdown barrier (``JSBP_SHUTDOWN_TIMEOUT``) waits this much longer than
``--exit-timeout``: the launcher's watch ends the job first, with a clear message; JAX's barrier
is the backstop for ranks on other machines, which this launcher does not watch."""
_STATUS_ENV = "JSBP_LAUNCH_STATUS_DIR"
TIMEOUT_STATUS = 124
"""The launcher's exit status when it ends a job that hangs (as ``timeout(1)``)."""


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
        help="end the job when a process finished (exit code 0) and others still run S seconds "
        "later (default %(default)g; 0: never)",
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
    if a.timeout < 0:
        p.error(f"--timeout must be >= 0 (0: never), got {a.timeout}")
    if a.exit_timeout < 0:
        p.error(f"--exit-timeout must be >= 0 (0: never), got {a.exit_timeout}")


def _environments(a: argparse.Namespace, status_dir: str) -> list[dict[str, str]]:
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
        env[_STATUS_ENV] = status_dir
        if a.exit_timeout > 0:
            env.setdefault("JSBP_SHUTDOWN_TIMEOUT", str(int(a.exit_timeout) + _SHUTDOWN_MARGIN_S))
        if a.devices_per_process is not None:
            k = str(a.devices_per_process)
            env.update(JSBP_DEVICES_PER_PROCESS=k, JAX_NUM_CPU_DEVICES=k)
            env.setdefault("JAX_PLATFORMS", "cpu")
        envs.append(env)
    return envs


class _Rank:
    """One process and what the launcher knows of it: exit, output, heartbeats, end report."""

    def __init__(self, rank: int, proc: subprocess.Popen, status_dir: str):
        self.rank = rank
        self.proc = proc
        self.started = time.time()
        self.code: int | None = None
        self.exit_t: float | None = None  # wall-clock time of the exit (set by a waiter thread)
        self.last_output = self.started
        self.lines: collections.deque[str] = collections.deque(maxlen=40)
        self.capture: list[str] | None = None  # output after a SIGUSR1 (the stack dump)
        self.capture_t = 0.0
        self._beat = os.path.join(status_dir, f"rank{rank}.beat")
        self._end = os.path.join(status_dir, f"rank{rank}.end")
        self._report: dict | None = None
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self) -> None:
        code = self.proc.wait()
        self.code = code
        self.exit_t = time.time()

    @property
    def exited(self) -> bool:
        return self.exit_t is not None

    def report(self) -> dict | None:
        """The end report the child wrote (``finished`` / ``failed``, ``code``, ``t``, ``error``)."""
        if self._report is None:
            try:
                with open(self._end) as f:
                    self._report = json.load(f)
            except (OSError, ValueError):
                return None
        return self._report

    def beat(self) -> dict | None:
        try:
            with open(self._beat) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def beat_time(self) -> float:
        try:
            return os.stat(self._beat).st_mtime
        except OSError:
            return 0.0

    def finished_at(self) -> float | None:
        """When this rank's script ended without error, or None."""
        if self.exited and self.code == 0:
            rep = self.report()
            return rep["t"] if rep and rep.get("state") == "finished" else self.exit_t
        if self.exited:
            return None
        rep = self.report()
        return rep["t"] if rep and rep.get("state") == "finished" else None

    def failed_at(self, before: float | None = None) -> float | None:
        """When this rank failed on its own (its report, else its non-zero exit), or None;
        exits at or after ``before`` (the launcher stopping it) do not count."""
        rep = self.report()
        t = rep["t"] if rep and rep.get("state") == "failed" else None
        if self.exited and self.code != 0 and (before is None or self.exit_t < before):
            t = self.exit_t if t is None else min(t, self.exit_t)
        if t is not None and before is not None and t >= before:
            return None
        return t

    def progress(self) -> float:
        return max(self.started, self.last_output, self.beat_time())

    def tail(self, n: int) -> list[str]:
        return [ln for ln in list(self.lines) if ln.strip()][-n:]


class _Printer:
    """Copies a child's pipe to our stream line by line, with a ``[rank R]`` prefix, and keeps
    the rank's last lines and the time of its last output."""

    def __init__(self, lock: threading.Lock, prefix: bool):
        self._lock = lock
        self._prefix = prefix

    def pump(self, pipe, out, r: _Rank) -> None:
        tag = f"[rank {r.rank}] ".encode() if self._prefix else b""
        sink = out.buffer if hasattr(out, "buffer") else None
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                text = line[:-1].decode(errors="replace").rstrip("\r")
                with self._lock:
                    if r.capture is not None:  # a stack dump we asked for: not the rank's output
                        r.capture.append(text)
                        r.capture_t = time.time()
                    else:
                        r.last_output = time.time()
                        r.lines.append(text)
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
    for line in msg.splitlines() or [""]:
        print(f"{_PREFIX}: {line}", file=sys.stderr, flush=True)


# -- where a hung rank is -------------------------------------------------------------------------

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ .*most recent call first")


def _short(path: str) -> str:
    if "site-packages" + os.sep in path:
        return path.split("site-packages" + os.sep, 1)[1]
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith(".." + os.sep + "..") else rel


def _main_stack(dump: list[str]) -> list[tuple[str, int, str]]:
    """The main thread's frames (innermost first) in a ``faulthandler`` dump."""
    blocks: list[list[tuple[str, int, str]]] = []
    for line in dump:
        if _THREAD.match(line.strip()):
            blocks.append([])
            continue
        m = _FRAME.match(line)
        if m and blocks:
            blocks[-1].append((m["file"], int(m["line"]), m["func"]))
    for b in blocks:  # the main thread is the one that runs the launcher's child module
        if b and b[-1][0].endswith(os.path.join("launch", "_child.py")):
            return b
    return blocks[-1] if blocks else []


def _is_library(path: str) -> bool:
    return (
        path.startswith("<")
        or "site-packages" in path
        or path.startswith(os.path.dirname(os.__file__))
        or path.endswith(os.path.join("launch", "_child.py"))
    )


def _where(frames: list[tuple[str, int, str]]) -> str | None:
    frames = [f for f in frames if not f[0].endswith(os.path.join("launch", "_child.py"))]
    frames = [f for f in frames if not f[0].startswith("<frozen runpy")]
    if not frames:
        return None
    f, ln, fn = frames[0]
    out = f"in {fn} ({_short(f)}:{ln})"
    jsbp_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    user = [x for x in frames if not _is_library(x[0]) and not x[0].startswith(jsbp_dir)]
    if user and user[0] != frames[0]:
        uf, uln, ufn = user[0]
        out += f", called from {ufn} ({_short(uf)}:{uln})"
    return out


def _dump_stacks(ranks: list[_Rank], lock: threading.Lock, wait: float = 3.0) -> dict[int, str]:
    """Ask every running rank for its Python stacks (SIGUSR1) and say where each main thread is."""
    asked = []
    for r in ranks:
        if r.exited:
            continue
        with lock:
            r.capture = []
        try:
            os.kill(r.proc.pid, signal.SIGUSR1)
            asked.append(r)
        except (ProcessLookupError, PermissionError, AttributeError):
            pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        with lock:
            done = all(
                any(_FRAME.match(x) for x in r.capture or []) and time.time() - r.capture_t > 0.3
                for r in asked
            )
        if done:
            break
        time.sleep(0.05)
    out = {}
    for r in asked:
        with lock:
            dump, r.capture = list(r.capture or []), None
        w = _where(_main_stack(dump))
        if w:
            out[r.rank] = w
    return out


def _ago(t: float, now: float) -> str:
    return f"{now - t:.1f} s ago"


def _portrait(r: _Rank, stacks: dict[int, str], now: float) -> str:
    """One line on what rank ``r`` was doing: its stack, its noted activity, its last output."""
    parts = []
    if r.rank in stacks:
        parts.append(stacks[r.rank])
    b = r.beat()
    if b and b.get("activity"):
        parts.append(f"noted activity {b['activity']!r} (heartbeat {_ago(r.beat_time(), now)})")
    tail = r.tail(1)
    if tail:
        parts.append(f"last output {_ago(r.last_output, now)}: {tail[-1].strip()[:160]!r}")
    else:
        parts.append("no output yet")
    return f"rank {r.rank}: " + "; ".join(parts)


# -- the watch ------------------------------------------------------------------------------------


class _Job:
    def __init__(self, a: argparse.Namespace, ranks: list[_Rank], lock: threading.Lock):
        self.a = a
        self.ranks = ranks
        self.lock = lock
        self._next_read = 0.0
        self._finished: dict[int, float] = {}

    def procs(self) -> list[subprocess.Popen]:
        return [r.proc for r in self.ranks]

    def stop(self, sig: int = signal.SIGTERM) -> float:
        t = time.time()
        _stop(self.procs(), sig, self.a.grace_period)
        return t

    def failure(self) -> int | None:
        """If a rank failed (exited non-zero): stop the others, blame the first; the status."""
        if not any(r.exited and r.code != 0 for r in self.ranks):
            return None
        first = min(
            (r for r in self.ranks if r.failed_at() is not None), key=lambda r: r.failed_at()
        )
        if not first.exited:  # it noted its failure and is exiting: let it finish, briefly
            deadline = time.monotonic() + min(2.0, self.a.grace_period)
            while not first.exited and time.monotonic() < deadline:
                time.sleep(0.02)
        alive = sum(not r.exited for r in self.ranks)
        if alive:
            what = _describe(first.code) if first.exited else self._words(first, float("inf"))
            others = "the other " if first.exited else ""
            _say(f"rank {first.rank} {what}; stopping {others}{alive} process(es)")
        stopped_at = self.stop()
        fails = sorted(
            (
                (r.failed_at(before=stopped_at), r)
                for r in self.ranks
                if r.failed_at(before=stopped_at)
            ),
            key=lambda tr: (tr[0], tr[1].rank),
        )
        t0, first = fails[0]
        rep = first.report()
        if first.exit_t is not None and first.exit_t < stopped_at:
            code = first.code
            what = _describe(code)
        else:  # stopped while it was exiting after its failure
            code = (rep or {}).get("code") or 1
            what = self._words(first, stopped_at) + ", stopped while exiting"
        lines = [
            f"failed: rank {first.rank} {what}"
            + (" (the first rank to fail)" if len(fails) > 1 else "")
        ]
        tail = first.tail(8)
        if tail:
            lines.append(f"last lines of rank {first.rank}:")
            lines += [f"  | {ln}" for ln in tail]
        rest = [f"rank {r.rank} {self._words(r, stopped_at)} {t - t0:.3f} s after rank {first.rank}"
                for t, r in fails[1:]]  # fmt: skip
        others = [r.rank for r in self.ranks if r is not first and r.failed_at(before=stopped_at) is None
                  and r.exit_t is not None and r.exit_t >= stopped_at]  # fmt: skip
        if rest:
            lines.append("consequences: " + "; ".join(rest))
        if others:
            lines.append(f"stopped by the launcher: rank(s) {', '.join(map(str, others))}")
        _say("\n".join(lines))
        return _exit_status(code) or 1

    @staticmethod
    def _words(r: _Rank, stopped_at: float) -> str:
        """How a rank that failed after the first one failed."""
        rep = r.report()
        error = (
            f" ({rep['error']})"
            if rep and rep.get("state") == "failed" and rep.get("error")
            else ""
        )
        if r.exit_t is not None and r.exit_t < stopped_at:
            return _describe(r.code) + error
        code = rep.get("code") if rep else None
        return f"failed with code {code}{error}"

    def _refresh(self, now: float) -> None:
        if now < self._next_read:
            return
        self._next_read = now + 0.25
        for r in self.ranks:
            if r.rank not in self._finished:
                t = r.finished_at()
                if t is not None:
                    self._finished[r.rank] = t

    def watch(self, now: float) -> int | None:
        """End the job if a rank left early or nothing moves; the status, or None to go on."""
        self._refresh(now)
        a = self.a
        running = [r for r in self.ranks if not r.exited and r.rank not in self._finished]
        if not running:
            return None
        if self._finished and a.exit_timeout > 0:
            rank, t = min(self._finished.items(), key=lambda kv: kv[1])
            if now - t >= a.exit_timeout:
                left = next(r for r in self.ranks if r.rank == rank)
                names = ", ".join(str(r.rank) for r in running)
                _say(
                    f"rank {rank} finished (exit code 0) {now - t:.1f} s ago while rank(s) {names} "
                    f"still run (--exit-timeout {a.exit_timeout:g} s): a rank that leaves early "
                    "makes the others wait for it in their next collective. Stopping "
                    f"{sum(not r.exited for r in self.ranks)} process(es). Where they were:"
                )
                self._explain(running, now, also=[left])
                _say(
                    f"failed: rank {rank} left early: it finished while rank(s) {names} kept "
                    f"running for {now - t:.1f} s"
                )
                return TIMEOUT_STATUS
        if a.timeout > 0:
            last = max(r.progress() for r in running)
            if now - last >= a.timeout:
                names = ", ".join(str(r.rank) for r in running)
                _say(
                    f"no progress for {now - last:.1f} s (--timeout {a.timeout:g} s): no running rank "
                    f"({names}) printed a line or called jsbp.distributed.heartbeat(). Hung or "
                    "deadlocked (a rank that skipped a collective, or ranks in different "
                    f"collectives); stopping {sum(not r.exited for r in self.ranks)} process(es). "
                    "Where they were:"
                )
                stacks = self._explain(running, now)
                where = "; ".join(
                    f"rank {r.rank} {stacks.get(r.rank, '(no stack)')}" for r in running
                )
                _say(f"failed: no progress for {now - last:.1f} s: {where}")
                return TIMEOUT_STATUS
        return None

    def _explain(self, running: list[_Rank], now: float, also: list[_Rank] = ()) -> dict[int, str]:
        stacks = _dump_stacks(running + [r for r in also if not r.exited], self.lock)
        now = time.time()
        for r in list(also) + running:
            _say("  " + _portrait(r, stacks, now))
        self.stop()
        return stacks


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
    status_dir = tempfile.mkdtemp(prefix="jsbp-launch-")
    envs = _environments(a, status_dir)

    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lock = threading.Lock()
    printer = _Printer(lock, not a.no_prefix)
    ranks: list[_Rank] = []
    pumps: list[threading.Thread] = []
    job = _Job(a, ranks, lock)
    try:
        for env in envs:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # own process group: signals reach the child's children too
            )
            r = _Rank(int(env["RANK"]), proc, status_dir)
            ranks.append(r)
            for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=printer.pump, args=(pipe, out, r), daemon=True)
                t.start()
                pumps.append(t)

        status = 0
        while True:
            if received:
                sig = received[0]
                _say(
                    f"received {signal.Signals(sig).name}; stopping {sum(not r.exited for r in ranks)} process(es)"
                )
                _stop(job.procs(), sig, a.grace_period)
                status = 128 + sig
                break
            all_done = all(r.exited for r in ranks)
            failed = job.failure()
            if failed is not None:
                status = failed
                break
            if all_done:
                break
            hung = job.watch(time.time())
            if hung is not None:
                status = hung
                break
            time.sleep(0.05)
    except BaseException:
        _stop(job.procs(), signal.SIGTERM, a.grace_period)
        raise
    finally:
        for t in pumps:
            t.join(timeout=2)
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(status_dir, ignore_errors=True)
    return status
