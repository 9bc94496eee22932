"""A worker for the launcher's failure tests: ``fail_worker.py MODE [PIDFILE_DIR]``.

Rank 1 fails (MODE ``exit``: exit code 3; ``kill``: SIGKILL itself; ``raise``: an uncaught
exception; ``jax``: exit code 3 after a cross-process collective). Rank 0 never finishes on its
own: it sleeps (or, for ``jax``, waits in a barrier for rank 1), so only the launcher can stop it.
``chain`` mode: rank 1 raises and takes 0.5 s to exit; rank 0 raises as soon as rank 1 starts to
go, so it exits first (the launcher must still blame rank 1). ``sleep`` mode: every rank sleeps (for the Ctrl-C and no-progress tests). ``leave`` mode:
rank 1 exits 0 at once, rank 0 sleeps (a rank that leaves early). ``quiet`` mode: every rank
works silently for 8 s (after a line saying it imported jsbp), calling ``jsbp.distributed.heartbeat`` (not a hang). Every rank writes its
pid to ``PIDFILE_DIR/rank<R>.pid`` when given.

``tail`` mode: rank 1 exits 0 at once, rank 0 prints a line every 0.2 s for 4 s, then exits 0.
``segv`` / ``vanish`` / ``kill0`` modes: a victim (rank 1: SIGSEGV, or ``os._exit(0)``; rank 0:
SIGKILL) ends without a word, and the other rank raises the moment it notices, as a rank waiting
in a collective does when its peer's sockets close: it holds no lock of its own but polls the
``flock`` the victim holds on ``PIDFILE_DIR/alive<R>``, which the kernel drops as the victim
dies, before the launcher can reap it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

mode = sys.argv[1]
rank = int(os.environ["RANK"])
if len(sys.argv) > 2:
    with open(os.path.join(sys.argv[2], f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))

if mode == "jax":
    import jsbp

    jsbp.distributed.initialize()
    import jax
    import numpy as np

    p = jsbp.placement("cpu", [d.id for d in jax.devices()])
    x = jsbp.tensor(np.arange(16.0), placement=p, sbp="S(0)")
    assert (x.to_global(sbp="B").numpy() == np.arange(16.0)).all()
    print("collective ok", flush=True)
    jsbp.distributed.barrier("both-done")  # rank 0's side of the collective has finished too
    if rank == 1:
        print("rank 1 fails now", flush=True)
        sys.exit(3)
    jsbp.distributed.barrier("never-reached-by-rank-1")
    print("rank 0 passed a barrier rank 1 never reached", flush=True)
    sys.exit(0)

if mode == "quiet":
    from jsbp.distributed import heartbeat

    print(f"rank {rank} imported jsbp", flush=True)
    for i in range(40):
        heartbeat(f"quiet step {i}")
        time.sleep(0.2)
    sys.exit(0)

print(f"rank {rank} started", flush=True)
if mode in ("segv", "vanish", "kill0"):
    import fcntl

    victim = 0 if mode == "kill0" else 1
    alive = os.path.join(sys.argv[2], f"alive{victim}")
    if rank == victim:
        fd = os.open(alive + ".tmp", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(alive + ".tmp", alive)
        time.sleep(0.5)
        if mode == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif mode == "vanish":
            os._exit(0)
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    while not os.path.exists(alive):
        time.sleep(0.01)
    fd = os.open(alive, os.O_RDWR)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError:
            time.sleep(0.0005)
    raise RuntimeError(f"rank {rank}: rank {victim} is gone")
if mode == "chain":  # rank 1 raises but is slow to exit; rank 0 fails meanwhile, a consequence
    gone = os.path.join(sys.argv[2], "rank1.failing")
    if rank == 1:
        import atexit

        def slow_teardown():  # like a big process whose sockets close before it is reaped
            open(gone, "w").close()
            time.sleep(0.5)

        atexit.register(slow_teardown)
        time.sleep(0.5)
        raise RuntimeError("rank 1 fails first")
    while not os.path.exists(gone):
        time.sleep(0.001)
    raise RuntimeError("rank 0 fails because rank 1 is going")
if mode == "leave" and rank == 1:
    sys.exit(0)
if mode == "tail":  # rank 1 leaves at once; rank 0 goes on for 4 s, printing
    if rank == 0:
        for i in range(20):
            print(f"rank 0 still working {i}", flush=True)
            time.sleep(0.2)
    sys.exit(0)
if rank == 1 and mode not in ("sleep", "leave"):
    time.sleep(0.5)
    if mode == "exit":
        sys.exit(3)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "raise":
        raise RuntimeError("worker failure on purpose")
time.sleep(600)
