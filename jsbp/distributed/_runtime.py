"""Starting and stopping JAX's distributed runtime from the environment.

jsbp has no transport of its own: ``initialize()`` only decides the arguments of
``jax.distributed.initialize`` (see ``_config``) and sets the two CPU options a multi-process CPU
run needs (gloo collectives and the number of simulated devices) before JAX creates its backends.
"""

from __future__ import annotations

import atexit
import os
import sys

import jax

from . import _config
from ._errors import DistributedError
from ._heartbeat import activity, listen_to_jax

__all__ = [
    "initialize",
    "is_initialized",
    "shutdown",
    "barrier",
    "config",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 300
"""Seconds to wait for the other processes: at start-up, and in every collective step of jsbp."""

_LOOPBACK = ("127.0.0.1", "localhost", "[::1]")

_state: dict = {"config": None, "barriers": 0, "failed": None, "exit_hook": False}


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _jax_distributed_state():
    from jax._src import distributed

    return distributed.global_state


def is_initialized() -> bool:
    """True once JAX's distributed runtime runs in this process (started by jsbp or by the user)."""
    return jax.distributed.is_initialized()


def config() -> _config.Config:
    """The ``Config`` this process runs with: the one ``initialize()`` used, else the environment's."""
    if _state["config"] is not None:
        return _state["config"]
    return _config.from_environ(os.environ)


def _seconds(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        val = int(float(raw))
        if val <= 0:
            raise ValueError
    except ValueError:
        raise DistributedError(
            f"jsbp.distributed: {name}={raw!r} must be a positive number of seconds."
        ) from None
    return val


def _timeout_s() -> int:
    return _seconds("JSBP_DISTRIBUTED_TIMEOUT", DEFAULT_TIMEOUT_S)


def _runtime_timeouts() -> dict:
    """JAX's heartbeat and shutdown-barrier timeouts, from ``JSBP_HEARTBEAT_TIMEOUT`` and
    ``JSBP_SHUTDOWN_TIMEOUT`` (JAX's defaults, 100 s and 300 s, when unset)."""
    out = {}
    hb = _seconds("JSBP_HEARTBEAT_TIMEOUT", None)
    if hb is not None:
        out["heartbeat_timeout_seconds"] = hb
    sd = _seconds("JSBP_SHUTDOWN_TIMEOUT", None)
    if sd is not None:
        out["shutdown_timeout_seconds"] = sd
    return out


def _set_cpu_devices(k: int) -> None:
    current = jax.config.jax_num_cpu_devices
    if current == k:
        return
    if _backends_started():
        raise DistributedError(
            f"jsbp.distributed.initialize: {k} CPU devices per process were asked for "
            f"(JSBP_DEVICES_PER_PROCESS or devices_per_process=), but JAX has already started its "
            f"backends with {current if current >= 0 else 'the default number of'} CPU devices. "
            "Call jsbp.distributed.initialize() at the top of the script, before any JAX computation."
        )
    jax.config.update("jax_num_cpu_devices", k)


def initialize(
    *, devices_per_process: int | None = None, timeout_s: int | None = None
) -> _config.Config:
    """Join the multi-process run this process was started in; a no-op for a single process.

    Call it once, at the top of the script, before any JAX computation (JAX cannot add processes
    to a backend that has started). Where the run is described:

    * ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` (set by
      ``python -m jsbp.launch`` and by ``torchrun``): rank 0 serves JAX's coordinator at
      ``MASTER_ADDR:MASTER_PORT``. With ``LOCAL_WORLD_SIZE > 1`` on GPUs each process takes the
      GPU numbered ``LOCAL_RANK`` (one process per GPU), unless ``CUDA_VISIBLE_DEVICES`` or
      ``JAX_LOCAL_DEVICE_IDS`` already choose.
    * otherwise a cluster JAX detects by itself (Open MPI's ``mpirun``, SLURM's ``srun``, a
      Kubernetes indexed Job): ``jax.distributed.initialize()`` is called with no arguments.
    * otherwise: a single process, nothing to start.

    ``devices_per_process`` (or ``JSBP_DEVICES_PER_PROCESS``) gives each process that many
    simulated CPU devices; CPU collectives across processes use gloo. ``timeout_s`` (or
    ``JSBP_DISTRIBUTED_TIMEOUT``, default 300) bounds the wait for the other processes.
    ``JSBP_HEARTBEAT_TIMEOUT`` and ``JSBP_SHUTDOWN_TIMEOUT`` (seconds) set JAX's heartbeat
    timeout (a process silent that long is declared dead and the run fails; default 100) and
    its shutdown-barrier timeout (how long a finished process waits at exit for the others;
    default 300). ``python -m jsbp.launch`` sets the latter from ``--exit-timeout``.

    Returns the ``Config`` (rank, world size, ...). Calling it again is a no-op. Raises
    ``jsbp.distributed.DistributedError`` (a ``ValueError``) naming the variables when they are
    partial or contradictory (``RANK >= WORLD_SIZE``, a missing ``MASTER_PORT``, a non-integer).
    """
    if _state["config"] is not None:
        return _state["config"]
    listen_to_jax()  # under the launcher, JAX's compilations count as progress
    cfg = _config.from_environ(os.environ)
    k = (
        devices_per_process
        if devices_per_process is not None
        else _config.devices_per_process(os.environ)
    )
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise DistributedError(
                f"jsbp.distributed.initialize: devices_per_process={k!r} must be a positive int."
            )
        _set_cpu_devices(k)
    timeout = _timeout_s() if timeout_s is None else int(timeout_s)
    if jax.distributed.is_initialized():
        # the user (or a framework) started JAX's runtime already: adopt it
        st = _jax_distributed_state()
        cfg = _config.Config(
            "jax", st.process_id, st.num_processes, cfg.local_rank, cfg.local_world_size
        )
        _state["config"] = cfg
        return cfg
    if not cfg.multi_process:
        _state["config"] = cfg
        return cfg
    if _backends_started():
        raise DistributedError(
            f"jsbp.distributed.initialize: this is process {cfg.rank} of {cfg.world_size} ({cfg.source}), "
            "but JAX has already started its backends in this process as a single process (something "
            "called jax.devices(), made an array or ran a computation first). Call "
            "jsbp.distributed.initialize() at the top of the script, before any JAX computation."
        )
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    with activity("jsbp.distributed.initialize: joining the other processes"):
        cfg = _start(cfg, k, timeout)
    _install_failure_exit()
    _state["config"] = cfg
    return cfg


def _start(cfg: _config.Config, k: int | None, timeout: int) -> _config.Config:
    """``jax.distributed.initialize`` with the arguments ``cfg`` gives."""
    if cfg.source == "env":
        local_ids = None
        if (
            cfg.local_world_size is not None
            and cfg.local_world_size > 1
            and k is None
            and not any(
                v in os.environ
                for v in (
                    "CUDA_VISIBLE_DEVICES",
                    "ROCR_VISIBLE_DEVICES",
                    "HIP_VISIBLE_DEVICES",
                    "JAX_LOCAL_DEVICE_IDS",
                )
            )
        ):
            local_ids = [cfg.local_rank]  # one accelerator per process; ignored by the CPU backend
        host = cfg.coordinator_address.rsplit(":", 1)[0]
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.world_size,
            process_id=cfg.rank,
            local_device_ids=local_ids,
            cluster_detection_method="deactivate",
            initialization_timeout=timeout,
            **_runtime_timeouts(),
            # a loopback coordinator listens on loopback only
            coordinator_bind_address=cfg.coordinator_address if host in _LOOPBACK else None,
        )
    else:
        method = cfg.source if cfg.source in ("ompi", "slurm") else None
        jax.distributed.initialize(
            cluster_detection_method=method, initialization_timeout=timeout, **_runtime_timeouts()
        )
        st = _jax_distributed_state()
        cfg = _config.Config(
            cfg.source, st.process_id, st.num_processes, cfg.local_rank, cfg.local_world_size
        )
    return cfg


def _exit_now_if_failed() -> None:
    code = _state["failed"]
    if code:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _install_failure_exit() -> None:
    """Make a process that dies of an uncaught exception exit at once.

    At exit JAX waits (up to 300 s) in a shutdown barrier for every other process. When this
    process fails while the others wait for it in a collective, that is a deadlock until the
    timeout, and a launcher never learns of the failure. So after an uncaught exception (noted by
    ``sys.excepthook``, which still prints the traceback) an ``atexit`` handler, which runs before
    JAX's, leaves with ``os._exit(1)``. A normal exit still passes the shutdown barrier.
    """
    if _state["exit_hook"]:
        return
    _state["exit_hook"] = True
    previous = sys.excepthook

    def hook(tp, value, tb):
        _state["failed"] = 130 if issubclass(tp, KeyboardInterrupt) else 1
        previous(tp, value, tb)

    sys.excepthook = hook
    atexit.register(_exit_now_if_failed)  # atexit is LIFO: runs before JAX's clean-up


def shutdown() -> None:
    """Stop JAX's distributed runtime (if jsbp or the user started it). Safe to call twice."""
    jax.distributed.shutdown()
    _state["config"] = None


def client():
    """JAX's distributed-runtime client (its key-value store and barriers), or None."""
    return _jax_distributed_state().client


def barrier(name: str | None = None, *, timeout_s: int | None = None) -> None:
    """Wait until every process reaches this call (a no-op for a single process).

    Every process must call ``barrier`` the same number of times; ``name`` (default: a counter)
    makes mismatches visible in the error.
    """
    c = client()
    if c is None:
        return
    _state["barriers"] += 1
    key = f"jsbp/barrier/{_state['barriers']}/{name or ''}"
    timeout = _timeout_s() if timeout_s is None else int(timeout_s)
    with activity(f"jsbp.distributed.barrier({name!r})" if name else "jsbp.distributed.barrier()"):
        c.wait_at_barrier(key, timeout * 1000)
