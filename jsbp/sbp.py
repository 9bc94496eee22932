"""SBP values: ``split(dim)``, ``broadcast``, ``partial_sum`` (and ``partial_max``, ``partial_min``)."""

from ._sbp import Broadcast as Broadcast
from ._sbp import Partial as Partial
from ._sbp import Sbp as Sbp
from ._sbp import Split as Split
from ._sbp import broadcast as broadcast
from ._sbp import nd_str as nd_str
from ._sbp import parse as parse
from ._sbp import parse_nd as parse_nd
from ._sbp import partial_max as partial_max
from ._sbp import partial_min as partial_min
from ._sbp import partial_sum as partial_sum
from ._sbp import split as split

__all__ = [
    "Sbp",
    "Split",
    "Broadcast",
    "Partial",
    "split",
    "broadcast",
    "partial_sum",
    "partial_max",
    "partial_min",
    "parse",
    "parse_nd",
    "nd_str",
]
