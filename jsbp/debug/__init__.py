"""Debugging helpers: what communication a compiled program really contains, how many bytes per
device XLA allocates for it, and what jsbp's cost model predicts for it."""

from .._cost import measured_bytes as measured_bytes
from ._collectives import collectives_in_hlo as collectives_in_hlo
from ._collectives import count_collectives as count_collectives
from ._estimate import estimate as estimate

__all__ = ["count_collectives", "collectives_in_hlo", "measured_bytes", "estimate"]
