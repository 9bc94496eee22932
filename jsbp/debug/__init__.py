"""Debugging helpers: what communication a compiled program really contains, and how many bytes
per device XLA allocates for it."""

from .._cost import measured_bytes as measured_bytes
from ._collectives import collectives_in_hlo as collectives_in_hlo
from ._collectives import count_collectives as count_collectives

__all__ = ["count_collectives", "collectives_in_hlo", "measured_bytes"]
