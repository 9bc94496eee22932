"""``python -m jsbp.launch``: start one process per device (or per group of devices) on this machine.

    python -m jsbp.launch --nproc-per-node 4 train.py --lr 3e-4
    python -m jsbp.launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --nproc-per-node 8 train.py
    python -m jsbp.launch --nproc-per-node 2 --devices-per-process 4 train.py   # 8 simulated CPU devices

Every process gets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``NODE_RANK`` (the variables ``jsbp.distributed.initialize()`` reads,
the same as ``torchrun``'s); ``--devices-per-process K`` adds ``JSBP_DEVICES_PER_PROCESS=K`` and
``JAX_NUM_CPU_DEVICES=K`` (and ``JAX_PLATFORMS=cpu`` unless it is set).

Each line a process prints is prefixed with ``[rank R]`` (stdout to stdout, stderr to stderr).
The launcher watches its processes and ends the job (SIGTERM, then SIGKILL after
``--grace-period`` seconds, to every process group) when

* a process fails (non-zero exit, killed by a signal, or an exit with code 0 before its script
  finished, such as ``os._exit(0)``): it exits with that process's code and blames the
  **first** rank to fail, with its last lines of output (and, for a fatal signal, where it
  was); ranks that failed after it are listed as consequences. Each rank reports the time it
  failed itself (an exception, ``sys.exit``) or ``faulthandler`` records it (SIGSEGV, SIGABRT,
  SIGBUS, SIGFPE, SIGILL, SIGTERM), before the others notice; an end without a word (SIGKILL,
  ``os._exit``) counts from ``SILENT_LAG_S`` before the launcher saw it. Rank 0 is named as
  the coordinator (it serves JAX's coordination service, which the others need);
* a process finished (exit code 0, or its script returned and it waits in JAX's shutdown
  barrier) and the processes still running make no progress for ``--exit-timeout`` seconds
  after it (default 10): it names the rank that left early and where the others are (exit
  status 124);
* no running process made progress for ``--timeout`` seconds (default 180): progress is a line
  of output or ``jsbp.distributed.heartbeat()`` (which jsbp calls in its barriers, exchanges,
  checkpoints and after each JAX compilation); it names every rank with its Python stack
  (asked with SIGUSR1, see ``_child``), its noted activity and last output (exit status 124);
* Ctrl-C (SIGINT) or SIGTERM reaches the launcher.

SIGTERM sent to one process ends that process (JAX's preemption service, which would catch it,
is off under the launcher unless ``JAX_ENABLE_PREEMPTION_SERVICE`` is set), and with it the job.
Each process runs in its own process group, so whatever it spawned is stopped too.

A process runs the script through ``jsbp/launch/_child.py`` (like ``python script.py``), which makes
``sys.exit(code != 0)`` after ``jsbp.distributed.initialize()`` leave at once rather than wait in
JAX's shutdown barrier for processes that may be waiting for it, reports how and when the script
ended, records fatal signals, and dumps its stacks on SIGUSR1.

The package: ``_options`` (command line, environments), ``_ranks`` (one process, stopping
processes), ``_stacks`` (where a rank is), ``_watch`` (the rules above), ``_main`` (the loop),
``_child`` (what each process runs).
"""

from ._main import main as main
from ._options import DEFAULT_EXIT_TIMEOUT_S as DEFAULT_EXIT_TIMEOUT_S
from ._options import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from ._options import TIMEOUT_STATUS as TIMEOUT_STATUS
from ._options import free_port as free_port
from ._ranks import SILENT_LAG_S as SILENT_LAG_S

__all__ = [
    "main",
    "free_port",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_EXIT_TIMEOUT_S",
    "TIMEOUT_STATUS",
    "SILENT_LAG_S",
]
