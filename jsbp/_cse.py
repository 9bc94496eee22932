"""Common subexpressions of a jaxpr merged before it is planned.

Two equations that apply the same primitive with the same parameters to the same operands
compute the same value; XLA merges them after jsbp has planned, so a conversion planned for each
copy would be listed by ``explain`` and run once. ``cse`` keeps the first of each such set and
points the readers of the others at it, in every nested jaxpr too (a ``pjit``, ``scan`` or
``cond`` body; a nested jaxpr seen twice is rewritten once, so calls of one cached body stay
equal). Equations with effects, or with a parameter that cannot be hashed (an array), are kept
as they are. Constants made from literals are merged too (a causal mask each block builds): XLA
would merge their conversions as well.
"""

from __future__ import annotations

import numpy as np
from jax.extend import core as jcore

STATEFUL = frozenset({"rng_uniform"})
"""Primitives without declared effects whose every call draws new values: never merged."""


def cse(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """``jaxpr`` with its common subexpressions merged (see the module doc)."""
    return _Cse().jaxpr(jaxpr)


class _Cse:
    def __init__(self):
        self.done: dict = {}  # id(nested jaxpr) -> (it, its rewrite)

    def param(self, v):
        if isinstance(v, jcore.ClosedJaxpr):
            return self.nested(v, lambda: jcore.ClosedJaxpr(self.jaxpr(v.jaxpr), v.consts))
        if isinstance(v, jcore.Jaxpr):
            return self.nested(v, lambda: self.jaxpr(v))
        if isinstance(v, tuple) and any(isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)) for x in v):
            items = [self.param(x) for x in v]
            return v._make(items) if hasattr(v, "_make") else tuple(items)  # a namedtuple stays one
        return v

    def nested(self, v, rewrite):
        if id(v) not in self.done:
            self.done[id(v)] = (v, rewrite())  # v kept alive: its id is not reused
        return self.done[id(v)][1]

    def jaxpr(self, jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
        subst: dict = {}
        first: dict = {}
        eqns = []
        for eqn in jaxpr.eqns:
            invars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in eqn.invars]
            params = {k: self.param(p) for k, p in eqn.params.items()}
            eqn = eqn.replace(invars=invars, params=params)
            key = None if eqn.effects or eqn.primitive.name in STATEFUL else _key(eqn)
            earlier = first.get(key) if key is not None else None
            if earlier is not None and not any(isinstance(o, jcore.DropVar) for o in earlier):
                subst.update(
                    (o, e) for o, e in zip(eqn.outvars, earlier) if not isinstance(o, jcore.DropVar)
                )
                continue
            if key is not None:
                first[key] = eqn.outvars
            eqns.append(eqn)
        if not subst:
            return jaxpr.replace(eqns=eqns)
        outvars = [v if isinstance(v, jcore.Literal) else subst.get(v, v) for v in jaxpr.outvars]
        return jaxpr.replace(eqns=eqns, outvars=outvars)


def _key(eqn):
    """What makes two equations compute the same value, or None (not hashable)."""
    try:
        ins = tuple(
            ("literal", _literal(v.val), str(v.aval)) if isinstance(v, jcore.Literal) else v
            for v in eqn.invars
        )
        key = (eqn.primitive, ins, tuple(sorted(eqn.params.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _literal(val) -> tuple:
    """A literal's value, exactly: its dtype, shape and bytes (its ``repr`` rounds a float64 to
    8 digits, which would merge ``x * 0.1`` with ``x * 0.100000000001``)."""
    try:
        a = np.asarray(val)
    except Exception as e:  # (a PRNG key, say): not merged
        raise TypeError("not a plain array") from e
    if a.dtype == object:
        raise TypeError("not a plain array")
    return a.dtype.str, a.shape, a.tobytes()
