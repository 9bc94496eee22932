"""The SBP rule registry, keyed by JAX primitive name.

A rule states the legal signatures of one primitive for ONE placement axis: a list of
``(input sbps, output sbps)`` pairs. The compiler expands them over all placement axes (the
product), drops combinations that mix partial kinds, and picks per equation the candidate that
needs no boxing, otherwise the lowest boxing cost in bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._errors import SbpError
from .._sbp import Sbp
from .._sbp import broadcast as B

AxisSignature = tuple[tuple[Sbp, ...], tuple[Sbp, ...]]
"""One legal (input sbps, output sbps) pair for one placement axis."""


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a rule sees of one equation (logical shapes: the rule never sees local shards)."""

    primitive: Any
    params: dict
    in_avals: tuple
    out_avals: tuple
    hierarchy: tuple[int, ...]
    in_layouts: tuple = ()  # current layouts of the inputs (jsbp._layout.Layout), for nd rules

    @property
    def in_shapes(self):
        return tuple(tuple(a.shape) for a in self.in_avals)

    @property
    def out_shapes(self):
        return tuple(tuple(a.shape) for a in self.out_avals)


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    signatures: Callable[[RuleContext], Iterable[AxisSignature]]
    local: Callable | None = None  # local(ctx, ins, in_layouts, out_layouts) -> outs
    nd: bool = False  # signatures() returns nd signatures (one sbp tuple per operand) directly
    fallback: bool = False  # no rule was registered: the primitive runs replicated


_RULES: dict[str, Rule] = {}


def register_sbp_rule(*primitives: str, local: Callable | None = None, nd: bool = False):
    """Register the SBP rule of one or more JAX primitives (by ``primitive.name``).

    The decorated function takes a ``RuleContext`` and yields the legal signatures for one
    placement axis as ``(input sbps, output sbps)``. ``local``, if given, runs the primitive on
    local shards (default: ``primitive.bind(*locals, **params)``) — needed when parameters carry
    shapes or padding must be masked.

    Example — an elementwise unary op that keeps every layout::

        from jsbp import register_sbp_rule, sbp

        @register_sbp_rule("my_unary")
        def _my_unary(ctx):
            ndim = len(ctx.in_avals[0].shape)
            for d in range(ndim):
                yield (sbp.split(d),), (sbp.split(d),)
            yield (sbp.broadcast,), (sbp.broadcast,)
    """

    def deco(fn):
        for p in primitives:
            _RULES[p] = Rule(p, fn, local, nd)
        return fn

    return deco


def get_rule(name: str, *, op_desc: str = "") -> Rule:
    """The rule of primitive ``name``; an ``SbpError`` naming it if there is none."""
    try:
        return _RULES[name]
    except KeyError:
        raise SbpError(
            f"no SBP rule for JAX primitive '{name}'{op_desc}, and strict mode is on (jsbp.jit(fn, "
            f"strict=True) or JSBP_STRICT=1). Register one with @jsbp.register_sbp_rule('{name}') (see "
            "CONTRIBUTING.md), turn strict mode off to run it replicated, or compute this part outside "
            "jsbp.jit."
        ) from None


def _replicated(ctx):
    yield (B,) * len(ctx.in_avals), (B,) * len(ctx.out_avals)


def replicated_rule(name: str) -> Rule:
    """The fallback of a primitive without a rule: every operand boxed to B, the primitive computed
    whole on every device, every result B. Exact for any deterministic primitive (see
    ``docs/rules.md``: effects such as ``debug_callback`` then run once per device)."""
    return Rule(name, _replicated, None, False, fallback=True)


def registered() -> dict[str, Rule]:
    return dict(_RULES)


def split_dims(shape: Sequence[int]) -> list[int]:
    return list(range(len(shape)))
