"""A worker for the launcher's fault tests (issue 19): ``fault_worker.py MODE``.

Every rank joins JAX's distributed runtime and runs one collective together; then

* ``hang``: rank 1 sleeps (600 s) before the next collective, rank 0 waits in it;
* ``diverge``: rank 0 all-gathers (S -> B) while rank 1 all-reduces (P -> B);
* ``early_exit``: rank 1 leaves with ``sys.exit(0)`` while rank 0 waits in a collective;
* ``raise``: rank 1 raises while rank 0 waits in a collective (rank 0 then dies of the broken
  connection: the launcher must blame rank 1);
* ``ok``: both run the collective and exit 0.
"""

from __future__ import annotations

import sys
import time

import jsbp

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
if rank == 1:
    if mode == "hang":
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
