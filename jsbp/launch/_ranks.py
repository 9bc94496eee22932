"""One launched process as the launcher sees it, its output, and stopping processes.

What a rank tells the launcher goes through ``$JSBP_LAUNCH_STATUS_DIR`` (written by ``_child`` and
``jsbp.distributed.heartbeat``): ``rank<R>.end`` (how and when its script ended), ``rank<R>.beat``
(heartbeats) and ``rank<R>.fatal`` (the Python stacks ``faulthandler`` writes when the process is
killed by SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL or SIGTERM: its time is the time of death).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time

__all__ = ["Rank", "Printer", "describe", "exit_status", "stop", "say", "SILENT_LAG_S"]

PREFIX = "jsbp.launch"

SILENT_LAG_S = 1.0
"""How much earlier than the launcher sees it a rank may have ended without a word (killed by
SIGKILL, or ``os._exit``): the kernel closes a dying process's sockets before its parent learns
of the exit, so the other ranks can notice, fail and report first. Failures the others report
up to this long before such an end are counted as its consequences."""


class Rank:
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
        self.fatal_path = os.path.join(status_dir, f"rank{rank}.fatal")
        self._report: dict | None = None
        self._fatal_frozen: bool | None = None
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

    def freeze_fatal(self) -> None:
        """The launcher is about to stop the job (SIGTERM): a fatal record written from now on
        is the launcher's doing, not a failure of the rank's own."""
        if self._fatal_frozen is None:
            self._fatal_frozen = self.fatal() is not None

    def fatal(self) -> tuple[float, list[str]] | None:
        """When the process was killed by a signal ``faulthandler`` catches, and what it wrote."""
        if self._fatal_frozen is False:
            return None
        try:
            st = os.stat(self.fatal_path)
            if st.st_size == 0:
                return None
            with open(self.fatal_path, errors="replace") as f:
                return st.st_mtime, f.read().splitlines()
        except OSError:
            return None

    def vanished(self) -> bool:
        """It exited with code 0 without its script finishing (``os._exit(0)``, or its process
        ended under the script): the others may be waiting for it."""
        rep = self.report()
        return self.exited and self.code == 0 and not (rep and rep.get("state") == "finished")

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
        """When this rank failed on its own, or None: the time it reported, the time a fatal
        signal struck it, or its exit (a non-zero exit; an exit with code 0 while its script had
        not finished). An end the launcher only saw (no report, no fatal record) counts from
        ``SILENT_LAG_S`` earlier. Ends at or after ``before`` (the launcher stopping it) do not
        count."""
        times = []
        rep = self.report()
        if rep and rep.get("state") == "failed":
            times.append(rep["t"])
        fatal = self.fatal()
        if fatal is not None:
            times.append(fatal[0])
        if self.exited and (before is None or self.exit_t < before):
            if self.code != 0:
                silent = self.code < 0 and not times
                times.append(self.exit_t - (SILENT_LAG_S if silent else 0.0))
            elif self.vanished():
                times.append(self.exit_t - SILENT_LAG_S)
        if not times:
            return None
        t = min(times)
        if before is not None and t >= before:
            return None
        return t

    def progress(self) -> float:
        return max(self.started, self.last_output, self.beat_time())

    def tail(self, n: int) -> list[str]:
        return [ln for ln in list(self.lines) if ln.strip()][-n:]


class Printer:
    """Copies a child's pipe to our stream line by line, with a ``[rank R]`` prefix, and keeps
    the rank's last lines and the time of its last output."""

    def __init__(self, lock: threading.Lock, prefix: bool):
        self._lock = lock
        self._prefix = prefix

    def pump(self, pipe, out, r: Rank) -> None:
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


def describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


def exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(procs: list[subprocess.Popen], first_sig: int, grace: float) -> None:
    """``first_sig`` to every process group still running, SIGKILL to those left after ``grace``;
    then SIGKILL to every group, for what a child left behind in it."""
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


def say(msg: str) -> None:
    for line in msg.splitlines() or [""]:
        print(f"{PREFIX}: {line}", file=sys.stderr, flush=True)
