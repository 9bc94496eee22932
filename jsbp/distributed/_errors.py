"""The error of ``jsbp.distributed``."""

from __future__ import annotations


class DistributedError(ValueError):
    """A partial or contradictory multi-process environment (launcher variables, cluster
    variables, ``JSBP_DEVICES_PER_PROCESS``), ``initialize()`` called too late, or processes that
    did not meet in a collective step (``from_local`` shape exchange) in time.

    A ``ValueError`` like ``jsbp.SbpError`` and ``jsbp.PlacementError``; messages name the
    variables and their values and say what to change.
    """
