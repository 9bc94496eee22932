"""Where a rank is: its Python stacks (``faulthandler`` dumps) read as one line."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from ._ranks import Rank

__all__ = ["dump_stacks", "main_stack", "where", "portrait", "ago"]

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


def main_stack(dump: list[str]) -> list[tuple[str, int, str]]:
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


def where(frames: list[tuple[str, int, str]]) -> str | None:
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


def dump_stacks(ranks: list[Rank], lock: threading.Lock, wait: float = 3.0) -> dict[int, str]:
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
        w = where(main_stack(dump))
        if w:
            out[r.rank] = w
    return out


def ago(t: float, now: float) -> str:
    return f"{now - t:.1f} s ago"


def portrait(r: Rank, stacks: dict[int, str], now: float) -> str:
    """One line on what rank ``r`` was doing: its stack, its noted activity, its last output."""
    parts = []
    if r.rank in stacks:
        parts.append(stacks[r.rank])
    b = r.beat()
    if b and b.get("activity"):
        parts.append(f"noted activity {b['activity']!r} (heartbeat {ago(r.beat_time(), now)})")
    tail = r.tail(1)
    if tail:
        parts.append(f"last output {ago(r.last_output, now)}: {tail[-1].strip()[:160]!r}")
    else:
        parts.append("no output yet")
    return f"rank {r.rank}: " + "; ".join(parts)
