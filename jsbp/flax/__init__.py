"""Flax NNX models and optax optimizer states in the consistent view.

A parallelism is a ``Strategy``: layouts for parameters (by path pattern or by Flax's logical
axis names), optimizer state (following its parameter, or split by ZeRO), gradients and
activations. ``shard`` puts NNX objects on the placement, ``make_train_step`` compiles the
ordinary NNX train step for it, ``gather`` brings the state back as plain NNX objects.
The core package never imports this module (it needs ``flax`` and ``optax``).
"""

from . import _auto as _auto  # registers Strategy.auto's search (jsbp.flax._strategy._AUTO)
from ._losses import softmax_cross_entropy as softmax_cross_entropy
from ._state import describe as describe
from ._state import gather as gather
from ._state import layouts as layouts
from ._state import leaf_layouts as leaf_layouts
from ._state import local_nbytes as local_nbytes
from ._state import path_str as path_str
from ._state import shard as shard
from ._strategy import LeafLayouts as LeafLayouts
from ._strategy import Strategy as Strategy
from ._strategy import active_strategy as active_strategy
from ._strategy import constrain as constrain
from ._strategy import constrain_with as constrain_with
from ._strategy import use_strategy as use_strategy
from ._train import TrainStep as TrainStep
from ._train import make_train_step as make_train_step

__all__ = [
    "Strategy",
    "LeafLayouts",
    "shard",
    "gather",
    "layouts",
    "describe",
    "local_nbytes",
    "leaf_layouts",
    "path_str",
    "constrain",
    "constrain_with",
    "use_strategy",
    "active_strategy",
    "make_train_step",
    "TrainStep",
    "softmax_cross_entropy",
]
