"""jsbp: OneFlow's SBP consistent view for JAX.

Say where a few tensors live (a ``placement``) and how they are laid out on it (an ``sbp``), and
jsbp runs the program on many devices, inserting the cheapest layout conversions (boxing).
"""

from . import _ops  # noqa: F401  (eager operators on GlobalTensor)
from . import debug as debug
from . import distributed as distributed
from . import env as env
from . import numpy as numpy
from . import sbp as sbp
from ._auto import AutoLayouts as AutoLayouts
from ._auto import auto_layouts as auto_layouts
from ._cost import CostModel as CostModel
from ._errors import NoRuleWarning as NoRuleWarning
from ._errors import PlacementError as PlacementError
from ._errors import SbpError as SbpError
from ._explain import explain as explain
from ._interop import named_sharding as named_sharding
from ._jit import jit as jit
from ._mirrored import all_reduce as all_reduce
from ._mirrored import mirrored as mirrored
from ._mirrored import mirrored_mean as mirrored_mean
from ._placement import placement as placement
from ._tensor import GlobalTensor as GlobalTensor
from ._tensor import arange as arange
from ._tensor import from_local as from_local
from ._tensor import full as full
from ._tensor import manual_seed as manual_seed
from ._tensor import ones as ones
from ._tensor import rand as rand
from ._tensor import randn as randn
from ._tensor import tensor as tensor
from ._tensor import to_global as to_global
from ._tensor import zeros as zeros
from .rules import register_sbp_rule as register_sbp_rule

__version__ = "0.1.0"


def _register_outer_packages():
    """Plug the outer packages into the core's registration points (``jsbp._hooks``): the core
    never imports them (``tests/test_layering.py``). ``jsbp.viz`` stays lazy: its renderers are
    imported the first time a ``_repr_html_`` runs."""
    from . import _hooks
    from .distributed import _transfer

    def viz(name):
        def render(obj):
            from . import viz as _viz

            return getattr(_viz, name)(obj)

        return render

    _hooks.html_renderers.setdefault("tensor", viz("tensor_html"))
    _hooks.html_renderers.setdefault("placement", viz("placement_html"))
    _hooks.html_renderers.setdefault("plan", viz("plan_html"))
    _hooks.multiprocess.update(
        spans_all_processes=_transfer.spans_all_processes,
        one_device_per_process=_transfer.one_device_per_process,
        send_blocks=_transfer.send_blocks,
        nearest_sources=_transfer.nearest_sources,
        gather_local_meta=distributed.gather_local_meta,
    )


_register_outer_packages()

_LAZY = ("viz", "checkpoint", "flax", "pipeline", "launch", "nn")


def __getattr__(name):
    """``jsbp.viz`` / ``jsbp.checkpoint`` / ``jsbp.flax`` / ``jsbp.pipeline`` import on first use, so
    ``import jsbp`` never pulls in Flax, orbax or the renderers."""
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'jsbp' has no attribute {name!r}")
