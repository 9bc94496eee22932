"""The SBP rule registry, keyed by JAX primitive name.

A rule states the legal signatures of one primitive for ONE placement axis: a list of
``(input sbps, output sbps)`` pairs. The compiler expands them over all placement axes (the
product), drops combinations that mix partial kinds, and picks per equation the candidate that
needs no boxing, otherwise the lowest boxing cost in bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .._errors import SbpError
from .._sbp import Sbp
from .._sbp import broadcast as B
from .._sbp import parse as parse_sbp

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
    axis_names: tuple[str, ...] = ()  # the placement's axis names (given to ``cost``)

    @property
    def in_shapes(self):
        return tuple(tuple(a.shape) for a in self.in_avals)

    @property
    def out_shapes(self):
        return tuple(tuple(a.shape) for a in self.out_avals)


@dataclasses.dataclass(frozen=True)
class LocalCost:
    """What one signature's local implementation costs each device, for a rule whose ``local``
    is not one op on local shards: a fused op's FLOPs, and the collectives the implementation
    runs itself (a ring of collective-permutes). The planner, ``explain`` and the cost model
    read it instead of the default estimate (the primitive's elements at memory bandwidth)."""

    flops: float = 0.0  # matmul-class FLOPs of the local shards
    # (collective kind, bytes one device sends each time, times it runs) per collective of the
    # compiled implementation (one in a loop of n - 1 trips: one entry, n - 1 times)
    collectives: tuple[tuple[str, float, int], ...] = ()
    # the collectives' transfers run while the FLOPs compute: the time is the larger of the two
    overlapped: bool = False
    note: str = ""  # how the signature runs, for ``explain`` ("ring over 'x'")

    @property
    def moved_bytes(self) -> float:
        """Bytes one device sends in its collectives, each as often as it runs."""
        return sum(b * n for _, b, n in self.collectives)


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    signatures: Callable[[RuleContext], Iterable[AxisSignature]]
    # local(step, ins) -> out (a list when the primitive has several results): runs the primitive
    # on local shards; ``step`` is the compiler's ``Step`` (``step.eqn``, ``step.in_layouts``,
    # ``step.out_layouts``), ``ins`` the operands' local shards. None: ``primitive.bind``.
    local: Callable | None = None
    nd: bool = False  # signatures() returns nd signatures (one sbp tuple per operand) directly
    fallback: bool = False  # no rule was registered: the primitive runs replicated
    # cost(ctx, in_nd, out_nd) -> LocalCost of one nd signature (None: the default estimate)
    cost: Callable | None = None

    def local_cost(self, eqn, placement, in_nd, out_nd) -> LocalCost | None:
        """``cost`` of ``eqn`` run on the nd signature ``in_nd -> out_nd`` (None without one)."""
        if self.cost is None:
            return None
        ctx = RuleContext(
            eqn.primitive,
            dict(eqn.params),
            tuple(v.aval for v in eqn.invars),
            tuple(v.aval for v in eqn.outvars),
            placement.hierarchy,
            axis_names=tuple(placement.axis_names),
        )
        return self.cost(ctx, tuple(in_nd), tuple(out_nd))


_RULES: dict[str, Rule] = {}


def register_sbp_rule(
    *primitives: str, local: Callable | None = None, nd: bool = False, cost: Callable | None = None
):
    """Register the SBP rule of one or more JAX primitives (by ``primitive.name``).

    The decorated function takes a ``RuleContext`` and yields the legal signatures for one
    placement axis as ``(input sbps, output sbps)``. ``local``, if given, runs the primitive on
    local shards (default: ``primitive.bind(*locals, **params)``) — needed when parameters carry
    shapes or padding must be masked. ``cost(ctx, in_nd, out_nd)``, if given, returns the
    ``LocalCost`` of one nd signature (one sbp tuple per operand and result): needed when
    ``local`` runs more than one op on local shards, or communicates.

    Example — an elementwise unary op that keeps every layout::

        from jsbp import register_sbp_rule, sbp

        @register_sbp_rule("my_unary")
        def _my_unary(ctx):
            ndim = len(ctx.in_avals[0].shape)
            for d in range(ndim):
                yield (sbp.split(d),), (sbp.split(d),)
            yield (sbp.broadcast,), (sbp.broadcast,)
    """

    names = []
    for p in primitives:
        if isinstance(p, str) and p:
            names.append(p)
        elif type(p).__name__ == "Primitive" and isinstance(getattr(p, "name", None), str):
            names.append(p.name)  # a jax.extend.core.Primitive: registered under its name
        else:
            what = (
                f"the function {getattr(p, '__name__', p)!r}"
                if callable(p)
                else f"{p!r} ({type(p).__name__})"
            )
            raise SbpError(
                f"register_sbp_rule: got {what} where a JAX primitive name was expected. Rules are keyed "
                "by primitive (e.g. 'add', 'dot_general', 'reduce_sum'), not by jax.numpy function: "
                "find the primitives a function uses with jax.make_jaxpr(fn)(x), then write "
                "@jsbp.register_sbp_rule('add')."
            )
    if not names:
        raise SbpError(
            "register_sbp_rule: name at least one JAX primitive, e.g. @jsbp.register_sbp_rule('add')."
        )
    for what, f in (("local", local), ("cost", cost)):
        if f is not None and not callable(f):
            raise SbpError(
                f"register_sbp_rule({', '.join(map(repr, names))}): {what}= must be callable, "
                f"got {f!r}."
            )

    def deco(fn):
        if not callable(fn):
            raise SbpError(
                f"register_sbp_rule({', '.join(map(repr, names))}) decorates a function that yields "
                f"signatures; got {fn!r} ({type(fn).__name__})."
            )
        checked = _checked(fn, names[0], nd)
        for p in names:
            _RULES[p] = Rule(p, checked, local, nd, cost=cost)
        return fn

    return deco


def _checked(fn, name: str, nd: bool):
    """``fn`` whose signatures are checked as they are produced: strings such as ``"S(0)"`` are
    read as SBPs; anything else that is not an SBP is an ``SbpError`` naming the rule."""

    def bad(sig, why):
        form = "((in nd-sbps...), (out nd-sbps...))" if nd else "((in sbps...), (out sbps...))"
        return SbpError(
            f"SBP rule for '{name}' ({getattr(fn, '__qualname__', fn)}) yielded a malformed signature "
            f"{sig!r}: {why}. Yield {form} pairs of jsbp.sbp values, e.g. "
            "(sbp.split(0), sbp.split(0)), (sbp.split(0),) — see CONTRIBUTING.md."
        )

    def one(x, sig):
        if isinstance(x, Sbp):
            return x
        if isinstance(x, str):
            try:
                return parse_sbp(x)
            except SbpError as e:
                raise bad(sig, str(e)) from None
        raise bad(sig, f"{x!r} ({type(x).__name__}) is not an SBP")

    def side(xs, sig):
        if not nd and isinstance(xs, (Sbp, str)):  # one output given bare
            xs = (xs,)
        if not isinstance(xs, (tuple, list)):
            raise bad(sig, f"{xs!r} is not a tuple of {'nd-sbps' if nd else 'SBPs'}")
        if nd:
            for x in xs:
                if not isinstance(x, (tuple, list)):
                    raise bad(
                        sig, f"{x!r} is not an nd-sbp (a tuple with one SBP per placement axis)"
                    )
            return tuple(tuple(one(v, sig) for v in x) for x in xs)
        return tuple(one(x, sig) for x in xs)

    @functools.wraps(fn)
    def signatures(ctx):
        out = fn(ctx)
        if out is None:
            raise bad(None, "the rule returned None (it must yield or return signatures)")
        try:
            it = iter(out)
        except TypeError:
            raise bad(out, "the rule's result is not iterable") from None
        for sig in it:
            if not isinstance(sig, (tuple, list)) or len(sig) != 2:
                raise bad(sig, "a signature is a pair (inputs, outputs)")
            yield side(sig[0], sig), side(sig[1], sig)

    return signatures


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
