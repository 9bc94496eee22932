"""The few multi-process facts a checkpoint needs: who is primary, and a barrier."""

from __future__ import annotations

import jax


def is_primary() -> bool:
    """Process 0 does the file-system bookkeeping (directories, manifest, renames)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (no-op in a single process): a barrier of JAX's
    distributed runtime, through ``jsbp.distributed`` (no device computation)."""
    if jax.process_count() > 1:
        from .. import distributed

        distributed.barrier(f"jsbp.checkpoint:{name}")


def from_primary(value, name: str):
    """Process 0's ``value`` (JSON-serialisable) on every process; a barrier too."""
    if jax.process_count() == 1:
        return value
    from ..distributed import allgather_json

    return allgather_json(value, tag="jsbp.checkpoint", what=f"jsbp.checkpoint:{name}")[0]
