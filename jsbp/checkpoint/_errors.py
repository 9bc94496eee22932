"""The error of ``jsbp.checkpoint``: one type, a ``ValueError``, whose messages name the file."""

from __future__ import annotations

import warnings


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, damaged, or does not fit the requested target.

    Every message names the checkpoint directory and, where one file is at fault, that file;
    mismatches against ``target`` name the path in the tree and both the saved and the expected
    shape / dtype.
    """


class CheckpointWarning(UserWarning):
    """Something is odd but loading can go on (an interrupted save was found next to good ones)."""


def warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=3)
