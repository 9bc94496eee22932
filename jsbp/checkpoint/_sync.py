"""The few multi-process facts a checkpoint needs: who is primary, a barrier, an exchange.

All three go through ``jsbp.distributed`` (JAX's coordination service: no device computation)
and cost nothing in a single process. Every process calls them in the same order.
"""

from __future__ import annotations

import jax

from ..distributed import allgather_json
from ..distributed import barrier as _barrier

_TAG = "jsbp.checkpoint"


def is_primary() -> bool:
    """Process 0 does the file-system bookkeeping (directories, manifest, renames)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (no-op in a single process)."""
    if jax.process_count() > 1:
        _barrier(f"{_TAG}:{name}")


def allgather(value, name: str) -> list:
    """``value`` (JSON-serialisable) from every process, in process order; a barrier too."""
    if jax.process_count() == 1:
        return [value]
    return allgather_json(value, tag=_TAG, what=f"{_TAG}:{name}")


def from_primary(value, name: str):
    """Process 0's ``value`` (JSON-serialisable) on every process; a barrier too."""
    return allgather(value, name)[0]
