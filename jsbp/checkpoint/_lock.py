"""One save of a path at a time: ``<path>.jsbp-lock``.

``save`` takes the lock before it touches ``<path>``, ``<path>.jsbp-partial`` or
``<path>.jsbp-old`` and releases it after the last rename; a second save of the same path (another
thread, process, or job) fails at once with a ``CheckpointError`` naming the holder, instead of
both writing into the same ``.jsbp-partial`` directory. In a multi-process run only process 0
takes it (it does all the renames).

The lock is an exclusive ``flock`` on the file ``<path>.jsbp-lock`` (which also records the
holder: host, pid, time). The kernel drops a ``flock`` when its holder dies, however it dies, so a
lock file left by a killed save is *stale*: the next save on the same machine finds the ``flock``
free and takes the lock over. Holding the lock means holding the ``flock`` on the file that is at
``<path>.jsbp-lock`` right now (checked after locking, by inode), so the release (``unlink``, then
``close``) cannot let two savers in. A lock file written on another machine whose ``flock`` is
free here is not taken over (some network file systems keep ``flock`` per machine): the error says
which host and pid hold it and that the file may be deleted by hand if no save runs there.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time

from ._errors import CheckpointError

__all__ = ["LOCK_SUFFIX", "acquire", "release", "holder"]

LOCK_SUFFIX = ".jsbp-lock"


def _me() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "thread": threading.get_ident(),
        "since_unix": time.time(),
    }


def _read(fd: int) -> dict | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096)
        return json.loads(raw) if raw else None
    except (OSError, ValueError):
        return None


def holder(root: str) -> dict | None:
    """What the lock file of ``root`` says about its holder (``None`` if there is none)."""
    try:
        fd = os.open(root + LOCK_SUFFIX, os.O_RDONLY)
    except OSError:
        return None
    try:
        return _read(fd)
    finally:
        os.close(fd)


def _describe(info: dict | None) -> str:
    if not info:
        return "a save that is just starting"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since_unix", 0)))
    return f"process {info.get('pid')} on host {info.get('host')!r} (since {when})"


def _held(root: str, info: dict | None) -> CheckpointError:
    return CheckpointError(
        f"save: another save holds {root}: {_describe(info)} is saving to it (lock "
        f"{root + LOCK_SUFFIX}). Only one save of a path runs at a time; this one wrote nothing "
        "and the checkpoint there is as it was. Save to another path, or wait and retry."
    )


def acquire(root: str) -> int:
    """Take the save lock of ``root``; returns the lock's file descriptor (for ``release``).

    Raises ``CheckpointError`` at once when another save holds it.
    """
    path = root + LOCK_SUFFIX
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for _ in range(20):
        created = True
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            created = False
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # released in the meantime: try to create it again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            info = _read(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _held(root, info) from None
            raise CheckpointError(
                f"save: cannot lock {path} ({e.strerror}); the file system must support flock "
                "for jsbp to keep two saves of one path apart."
            ) from None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            os.close(fd)  # the holder released (unlinked) it after we opened it
            continue
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            os.close(fd)  # a newer lock file took its place
            continue
        if not created:
            info = _read(fd)
            if info and info.get("host") not in (None, socket.gethostname()):
                os.close(fd)
                raise CheckpointError(
                    f"save: {path} says {_describe(info)} holds {root}, but that host is not this "
                    "one and its lock cannot be checked from here. If no save of this path runs "
                    f"there any more (it was killed), delete {path} and save again."
                )
            # else: a lock left by a save that died (the kernel dropped its flock): take it over
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(_me()).encode())
        return fd
    raise CheckpointError(f"save: could not take the lock {path} (it kept changing); retry.")


def release(root: str, fd: int) -> None:
    """Give the lock back: remove the file, then drop the ``flock`` (in that order)."""
    try:
        os.unlink(root + LOCK_SUFFIX)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)
