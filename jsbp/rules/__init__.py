"""SBP rules, one file per primitive family, registered by decorator (see ``_registry``)."""

from . import control as control
from . import elementwise as elementwise
from . import fft as fft
from . import indexing as indexing
from . import linalg as linalg
from . import misc as misc
from . import moe as moe
from . import random as random
from . import reduce as reduce
from . import shape as shape
from . import window as window
from ._registry import AxisSignature as AxisSignature
from ._registry import LocalCost as LocalCost
from ._registry import Rule as Rule
from ._registry import RuleContext as RuleContext
from ._registry import get_rule as get_rule
from ._registry import register_sbp_rule as register_sbp_rule
from ._registry import registered as registered
