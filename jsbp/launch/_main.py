"""``main``: start the processes, pump their output, run the watch until the job ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ._options import environments, validate
from ._options import parser as parser_
from ._ranks import Printer, Rank, say, stop
from ._watch import Job

__all__ = ["main", "CHILD"]

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
"""Run by path, so a child imports nothing of jsbp (nor JAX) before the user's script does."""


def main(argv: list[str] | None = None) -> int:
    """Run the launcher; returns the exit status (0 when every process exits with 0)."""
    parser = parser_()
    a = parser.parse_args(argv)
    validate(parser, a)
    args = list(a.script_args)
    if args and args[0] == "--":
        args = args[1:]
    kind = "module" if a.module else "path"
    cmd = [sys.executable, "-u", CHILD, kind, a.script] + args
    status_dir = tempfile.mkdtemp(prefix="jsbp-launch-")
    envs = environments(a, status_dir)

    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    lock = threading.Lock()
    printer = Printer(lock, not a.no_prefix)
    ranks: list[Rank] = []
    pumps: list[threading.Thread] = []
    job = Job(a, ranks, lock, coordinator=f"{envs[0]['MASTER_ADDR']}:{envs[0]['MASTER_PORT']}")
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
            r = Rank(int(env["RANK"]), proc, status_dir)
            ranks.append(r)
            for pipe, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=printer.pump, args=(pipe, out, r), daemon=True)
                t.start()
                pumps.append(t)

        status = 0
        while True:
            if received:
                sig = received[0]
                say(
                    f"received {signal.Signals(sig).name}; stopping {sum(not r.exited for r in ranks)} process(es)"
                )
                stop(job.procs(), sig, a.grace_period)
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
        stop(job.procs(), signal.SIGTERM, a.grace_period)
        raise
    finally:
        for t in pumps:
            t.join(timeout=2)
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(status_dir, ignore_errors=True)
    return status
