"""Where this process is: OneFlow's ``flow.env.get_rank()`` & co.

Process ranks, not devices: ``get_rank()`` is this process's index among all processes,
``get_world_size()`` the number of processes, ``get_local_rank()`` the index on its machine.
After ``jsbp.distributed.initialize()`` they are JAX's values; before, what the environment says
(``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` from ``python -m jsbp.launch``, or SLURM / Open MPI),
so a script may branch on the rank before JAX starts. A single process is rank 0 of 1.

None of them starts a JAX backend.
"""

from __future__ import annotations

__all__ = ["get_rank", "get_world_size", "get_local_rank", "is_main_process"]


def _config():
    from .distributed import _runtime

    return _runtime.config()


def _jax_state():
    import jax

    if not jax.distributed.is_initialized():
        return None
    from jax._src import distributed

    return distributed.global_state


def get_rank() -> int:
    """This process's global index, ``0 <= get_rank() < get_world_size()``."""
    st = _jax_state()
    return int(st.process_id) if st is not None else _config().rank


def get_world_size() -> int:
    """The number of processes in the run (1 without a launcher or cluster)."""
    st = _jax_state()
    if st is not None:
        return int(st.num_processes)
    n = _config().world_size
    if n is None:
        raise RuntimeError(
            "jsbp.env.get_world_size(): the number of processes of this Kubernetes job is only known "
            "after jsbp.distributed.initialize(); call it first."
        )
    return n


def get_local_rank() -> int:
    """This process's index on its machine (``LOCAL_RANK``); selects its GPU in one-process-per-GPU runs."""
    return _config().local_rank


def is_main_process() -> bool:
    """True on rank 0, the process that usually prints and saves."""
    return get_rank() == 0
