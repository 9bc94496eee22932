"""What every launched process runs first: ``python .../jsbp/launch/_child.py {path|module} TARGET ARGS``.

It runs the user's script exactly as ``python TARGET ARGS`` (or ``python -m TARGET ARGS``) would,
with three additions:

* a process that leaves with ``sys.exit(code)``, ``code != 0``, after JAX's distributed runtime
  started, exits at once instead of waiting in JAX's shutdown barrier for the other processes
  (up to 300 s, or forever if they wait for it in a collective), so the launcher sees the failure
  within seconds. Uncaught exceptions get the same treatment from
  ``jsbp.distributed.initialize`` itself.
* when the script ends it tells the launcher how and when, in ``$JSBP_LAUNCH_STATUS_DIR/
  rank<R>.end`` (JSON: ``state`` ``finished`` or ``failed``, ``code``, ``t``, ``error``): the
  time a rank failed (before its traceback is printed or the others notice) decides which rank
  the launcher blames, and a rank that finished while the others still run is a rank that left
  early, even while it still waits in JAX's shutdown barrier.
* a fatal signal (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL, and SIGTERM) makes ``faulthandler``
  write every thread's Python stack to ``$JSBP_LAUNCH_STATUS_DIR/rank<R>.fatal`` as it strikes,
  before the process dies of it (with the same signal): the file's time is the time of death
  (the other ranks may notice the death before the launcher does) and its stack says where.
* ``SIGUSR1`` makes it print every thread's Python stack to stderr (``faulthandler``): the
  launcher asks for it to say where a hung rank is.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import time


def _distributed_running() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _report(state: str, code: int, error: str | None = None) -> None:
    d, rank = os.environ.get("JSBP_LAUNCH_STATUS_DIR"), os.environ.get("RANK")
    if not d or rank is None:
        return
    path = os.path.join(d, f"rank{rank}.end")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump({"state": state, "code": code, "t": time.time(), "error": error}, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _exit_code(code) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


_fatal_file = None  # kept open for the process's life: faulthandler writes to its descriptor


def _record_fatal_signals() -> None:
    global _fatal_file
    d, rank = os.environ.get("JSBP_LAUNCH_STATUS_DIR"), os.environ.get("RANK")
    if not d or rank is None:
        return
    try:
        _fatal_file = open(os.path.join(d, f"rank{rank}.fatal"), "w")  # noqa: SIM115
    except OSError:
        return
    faulthandler.enable(file=_fatal_file, all_threads=True)
    if hasattr(signal, "SIGTERM") and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # dump, then the default action (the process dies of SIGTERM)
        faulthandler.register(signal.SIGTERM, file=_fatal_file, all_threads=True, chain=True)


def run(argv: list[str]) -> None:
    kind, target, *args = argv
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    _record_fatal_signals()
    try:
        if kind == "module":
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()  # as `python -m target` does
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python target` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = e.code
        _report("finished" if code in (None, 0) else "failed", _exit_code(code),
                None if code in (None, 0) else f"sys.exit({code!r})")  # fmt: skip
        if code not in (None, 0) and _distributed_running():
            if not isinstance(code, int):
                print(code, file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise
    except BaseException as e:
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
        first = str(e).splitlines()[0] if str(e) else ""
        _report("failed", code, f"{type(e).__name__}: {first}"[:300])
        if _distributed_running():  # the traceback, then out at once (no shutdown barrier)
            sys.excepthook(type(e), e, e.__traceback__)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        raise
    _report("finished", 0)


if __name__ == "__main__":
    run(sys.argv[1:])
