"""Signs of life for the launcher: ``heartbeat()`` and the activity a process notes.

``python -m jsbp.launch`` stops a job in which no process makes progress for ``--timeout``
seconds. Progress is a line of output, or a call of ``heartbeat()``: it touches a small file
the launcher reads (``$JSBP_LAUNCH_STATUS_DIR/rank<RANK>.beat``, JSON ``{"t", "activity",
"pid"}``). ``heartbeat("what")`` also notes what the process is doing, shown when the launcher
reports a hang. jsbp calls it itself: when it starts the runtime, in its barriers and host-side
exchanges, around checkpoint saves and loads, and (without an activity) whenever JAX finishes
tracing or compiling something. A training loop calls ``heartbeat(f"step {i}")`` once a step.

Outside the launcher (no ``JSBP_LAUNCH_STATUS_DIR``) every call is a no-op. Writes are rate
limited (at most one a second unless the activity changes), so calling it often is cheap.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

__all__ = ["heartbeat", "activity", "STATUS_ENV"]

STATUS_ENV = "JSBP_LAUNCH_STATUS_DIR"
"""The directory where the launcher reads ``rank<R>.beat`` (heartbeats) and ``rank<R>.end``."""

_MIN_INTERVAL_S = 1.0
_UNSET = object()
_lock = threading.Lock()
_st: dict = {"path": _UNSET, "last": 0.0, "activity": None, "user": None, "listener": False}


def beat_path() -> str | None:
    """This process's heartbeat file, or None outside the launcher."""
    p = _st["path"]
    if p is _UNSET:
        d, rank = os.environ.get(STATUS_ENV), os.environ.get("RANK")
        p = os.path.join(d, f"rank{rank}.beat") if d and rank is not None else None
        _st["path"] = p
    return p


def heartbeat(activity: str | None = None) -> None:
    """Tell the launcher this process is alive; with ``activity``, also what it is doing now.

    ``activity`` (a short string: ``"step 120"``, ``"loading data"``) stays the process's noted
    activity until the next call that gives one. Cheap: a no-op outside ``python -m jsbp.launch``,
    and at most one small file write a second otherwise (an activity change is written at once).
    """
    if activity is not None and beat_path() is not None:
        _st["user"] = str(activity)[:200]
    _beat(activity)


def _beat(activity: str | None) -> None:
    path = beat_path()
    if path is None:
        return
    now = time.time()
    if activity is None or activity == _st["activity"]:
        if now - _st["last"] < _MIN_INTERVAL_S:
            return
    with _lock:
        if activity is not None:
            _st["activity"] = str(activity)[:200]
        _st["last"] = now
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"t": now, "activity": _st["activity"], "pid": os.getpid()}, f)
            os.replace(tmp, path)
        except OSError:  # the launcher's directory is gone (it is shutting down): not our problem
            pass


@contextlib.contextmanager
def activity(what: str):
    """Note ``what`` as this process's activity for the duration of a ``with`` block (used by
    jsbp's barriers, exchanges and checkpoints); afterwards the activity is the last one given
    to ``heartbeat()``, or ``"after <what>"`` if there is none."""
    if beat_path() is None:
        yield
        return
    _beat(what)
    try:
        yield
    finally:
        _beat(_st["user"] if _st["user"] is not None else f"after {what}")


def _on_jax_event(*_args, **_kwargs) -> None:
    _beat(None)


def listen_to_jax() -> None:
    """Count JAX's own events (tracing, lowering, compiling done) as progress, once per process."""
    if _st["listener"] or beat_path() is None:
        return
    _st["listener"] = True
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_on_jax_event)
