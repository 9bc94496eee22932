"""A worker for the launcher's fault tests: ``fault_worker.py MODE [PIDFILE_DIR]``.

Every rank joins JAX's distributed runtime and runs one collective together; then

* ``hang``: rank 1 sleeps (600 s) before the next collective, rank 0 waits in it;
* ``diverge``: rank 0 all-gathers (S -> B) while rank 1 all-reduces (P -> B);
* ``early_exit``: rank 1 leaves with ``sys.exit(0)`` while rank 0 waits in a collective;
* ``raise``: rank 1 raises while rank 0 waits in a collective (rank 0 then dies of the broken
  connection: the launcher must blame rank 1);
* ``segv``: rank 1 dies of SIGSEGV while rank 0 waits in a collective;
* ``os_exit0``: rank 1 leaves with ``os._exit(0)`` (no clean-up, no shutdown barrier) while
  rank 0 waits in a collective;
* ``sigterm``: rank 1 is sent SIGTERM (as a cluster manager or a user would) while rank 0 waits
  in a collective;
* ``kill_coordinator``: rank 0 (which serves JAX's coordination service) is SIGKILLed while
  rank 1 waits in a collective;
* ``ok``: both run the collective and exit 0.

With ``PIDFILE_DIR`` every rank writes its pid to ``PIDFILE_DIR/rank<R>.pid`` first.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jsbp

if len(sys.argv) > 2:
    with open(os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))
jsbp.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

mode = sys.argv[1]
rank = jsbp.env.get_rank()
p = jsbp.placement("cpu", [d.id for d in jax.devices()])
x = jsbp.tensor(np.arange(16.0), placement=p, sbp="S(0)")
assert (x.to_global(sbp="B").numpy() == np.arange(16.0)).all()
print("first collective ok", flush=True)
jsbp.distributed.barrier("warm")
t = time.time()
print(f"fault at {t:.3f}", flush=True)
if rank == 0 and mode == "kill_coordinator":
    time.sleep(0.5)  # rank 1 is in the collective by now
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1:
    if mode in ("segv", "os_exit0", "sigterm"):
        time.sleep(0.5)  # rank 0 is in the collective by now
    if mode == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif mode == "os_exit0":
        os._exit(0)
    elif mode == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(600)  # a rank that ignores SIGTERM stays here
    elif mode == "hang":
        time.sleep(600)
    elif mode == "early_exit":
        sys.exit(0)
    elif mode == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    elif mode == "diverge":
        y = jsbp.tensor(np.ones(16), placement=p, sbp="P").to_global(sbp="B")
        print(y.numpy().sum(), flush=True)
y = x.to_global(sbp="B").numpy()
print("second collective ok", flush=True)
