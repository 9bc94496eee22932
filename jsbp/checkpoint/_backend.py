"""The storage backend: orbax-checkpoint (tensorstore, OCDBT), behind two small functions.

jsbp hands orbax only what it can hold exactly: a flat ``{name: array}`` dict whose jax arrays
have the logical shape and an even ``NamedSharding`` (see ``_storage``), numpy arrays, and nothing
of size zero (orbax refuses those; their value is all in the manifest). Orbax writes each shard
once, from the process that owns it, and reads each device's block from the files directly.
"""

from __future__ import annotations

import logging

import jax
import orbax.checkpoint as ocp

STATE = "state"
"""The orbax checkpoint's sub-directory inside a jsbp checkpoint."""


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def write(directory: str, arrays: dict) -> None:
    """Write ``arrays`` (name -> jax / numpy array) as an orbax checkpoint at ``directory``.

    Every process calls this with the same names; each writes the shards it owns.
    """
    with _quiet():
        _checkpointer().save(directory, args=ocp.args.PyTreeSave(arrays))


def read(directory: str, requests: dict) -> dict:
    """Read ``requests`` (name -> ``jax.ShapeDtypeStruct`` with a sharding, or a numpy array
    standing for "give me numpy of this shape / dtype") from the orbax checkpoint at ``directory``."""
    item, restore_args = {}, {}
    for name, want in requests.items():
        item[name] = want
        if isinstance(want, jax.ShapeDtypeStruct):
            restore_args[name] = ocp.ArrayRestoreArgs(
                restore_type=jax.Array,
                sharding=want.sharding,
                global_shape=want.shape,
                dtype=want.dtype,
            )
        else:
            restore_args[name] = ocp.RestoreArgs(restore_type=type(want), dtype=want.dtype)
    with _quiet():
        return _checkpointer().restore(
            directory,
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
        )


class _quiet:
    """Orbax logs every step at INFO / WARNING through absl; keep jsbp users' logs readable."""

    def __enter__(self):
        self._logger = logging.getLogger("absl")
        self._level = self._logger.level
        if self._level < logging.ERROR:
            self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)
