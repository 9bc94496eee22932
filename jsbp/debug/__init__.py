"""Debugging helpers: what communication a compiled program really contains."""

from ._collectives import collectives_in_hlo as collectives_in_hlo
from ._collectives import count_collectives as count_collectives

__all__ = ["count_collectives", "collectives_in_hlo"]
