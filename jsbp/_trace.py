"""The hook through which ``to_global`` inside ``jsbp.jit`` records a layout annotation."""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def current_tracer():
    return getattr(_state, "tracer", None)


@contextlib.contextmanager
def tracing(tracer):
    prev = getattr(_state, "tracer", None)
    _state.tracer = tracer
    try:
        yield tracer
    finally:
        _state.tracer = prev
