"""SBP values: how a tensor is laid out along ONE placement axis.

``split(dim)`` cuts the tensor along ``dim``; ``broadcast`` copies it whole; ``partial_sum`` (and
``partial_max`` / ``partial_min``) gives every device a full-shape piece whose sum (max, min) is the
value. An *nd-sbp* is a tuple with one SBP per placement axis, outer axis first.
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections.abc import Sequence

from ._errors import SbpError

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


class Sbp:
    """Base class of the SBP values. Instances are frozen, hashable and picklable.

    Each value exists once (``split(0) is split(0)``): constructors, ``copy`` and ``pickle`` hand
    back the one instance, so equality and hashing are by identity, at C speed. nd-sbp tuples key
    the compiler's tables, which look them up millions of times per program."""

    __slots__ = ()

    is_split = False
    is_broadcast = False
    is_partial = False


def _split_dim(dim) -> int:
    try:
        d = operator.index(dim)
    except TypeError:
        raise SbpError(
            f"sbp.split(dim) needs an integer dim, got {dim!r} ({type(dim).__name__}); "
            "write e.g. sbp.split(0) or sbp.split(-1)."
        ) from None
    if isinstance(dim, bool):
        raise SbpError(f"sbp.split(dim) needs an integer dim, got the bool {dim!r}.")
    return d


_INSTANCES: dict = {}  # (class, field value) -> the one instance


def _interned(cls, value, field):
    inst = _INSTANCES.get((cls, value))
    if inst is None:
        inst = object.__new__(cls)
        if field is not None:
            object.__setattr__(inst, field, value)
        inst = _INSTANCES.setdefault((cls, value), inst)
    return inst


@dataclasses.dataclass(frozen=True, slots=True, init=False, eq=False)
class Split(Sbp):
    """``S(dim)``: the tensor is cut along ``dim`` (balanced: the first ``n % k`` pieces get one more)."""

    dim: int
    is_split = True

    def __new__(cls, dim):
        return _interned(cls, _split_dim(dim), "dim")

    def __reduce__(self):
        return (Split, (self.dim,))

    def __repr__(self):
        return f"sbp.split(dim={self.dim})"

    def __str__(self):
        return f"S({self.dim})"


@dataclasses.dataclass(frozen=True, slots=True, init=False, eq=False)
class Broadcast(Sbp):
    """``B``: every device of the axis holds the whole value."""

    is_broadcast = True

    def __new__(cls):
        return _interned(cls, None, None)

    def __repr__(self):
        return "sbp.broadcast"

    def __str__(self):
        return "B"

    def __reduce__(self):
        return (_singleton, ("B",))


_PARTIAL_KINDS = {"sum": "P", "max": "Pmax", "min": "Pmin"}


@dataclasses.dataclass(frozen=True, slots=True, init=False, eq=False)
class Partial(Sbp):
    """``P``: every device holds a full-shape piece; the value is their sum (or max / min)."""

    reduce: str = "sum"
    is_partial = True

    def __new__(cls, reduce="sum"):
        if reduce not in _PARTIAL_KINDS:
            raise SbpError(
                f"partial reduce must be one of {sorted(_PARTIAL_KINDS)}, got {reduce!r}."
            )
        return _interned(cls, reduce, "reduce")

    def __repr__(self):
        return "sbp.partial_sum" if self.reduce == "sum" else f"sbp.partial_{self.reduce}"

    def __str__(self):
        return _PARTIAL_KINDS[self.reduce]

    def __reduce__(self):
        return (_singleton, (str(self),))


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")
partial_min = Partial("min")


def split(dim: int) -> Split:
    """``S(dim)``. Negative dims are normalised against the tensor when the SBP is applied."""
    return Split(dim)


_SINGLETONS = {"B": broadcast, "P": partial_sum, "Pmax": partial_max, "Pmin": partial_min}


def _singleton(name):
    return _SINGLETONS[name]


SbpLike = Sbp | str
"""An SBP or its short string: ``"S(0)"``, ``"S(-1)"``, ``"B"``, ``"P"``, ``"Pmax"``, ``"Pmin"``."""

_SPLIT_RE = re.compile(r"^\s*S\s*\(\s*(-?\d+)\s*\)\s*$")
_VALID = "'S(<int>)', 'B', 'P', 'Pmax', 'Pmin', or sbp.split(d) / sbp.broadcast / sbp.partial_sum"


def parse(value: SbpLike) -> Sbp:
    """One SBP from an ``Sbp`` or a string."""
    if isinstance(value, Sbp):
        return value
    if isinstance(value, str):
        s = value.strip()
        if s in _SINGLETONS:
            return _SINGLETONS[s]
        m = _SPLIT_RE.match(s)
        if m:
            return Split(int(m.group(1)))
        raise SbpError(f"cannot read {s!r} as an SBP; valid forms are {_VALID}.")
    if isinstance(value, (bytes, bytearray)):
        raise SbpError(
            f"cannot read {value!r} (bytes) as an SBP; give a str such as 'B' or 'S(0)', not bytes."
        )
    raise SbpError(
        f"cannot read {value!r} ({type(value).__name__}) as an SBP; valid forms are {_VALID}."
    )


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def parse_nd(value, ndim: int | None = None) -> tuple[Sbp, ...]:
    """An nd-sbp tuple from one SBP, a sequence of them, or a string like ``"(S(0), B)"``.

    A single SBP is accepted for a 1-d placement. With ``ndim`` the length is checked.
    """
    if isinstance(value, str):
        s = value.strip()
        if s.startswith("(") and not _SPLIT_RE.match(s):
            if not s.endswith(")") or s.count("(") != s.count(")"):
                raise SbpError(
                    f"cannot read {value!r} as an nd-sbp: unbalanced parentheses; write e.g. '(S(0), B)'."
                )
            inner = s[1:-1]
            items = tuple(parse(p) for p in _split_top(inner))
        elif "," in s:
            items = tuple(parse(p) for p in _split_top(s))
        else:
            items = (parse(s),)
    elif isinstance(value, Sbp):
        items = (value,)
    elif isinstance(value, (bytes, bytearray)):
        items = (parse(value),)  # an SbpError: bytes are no sequence of SBPs
    elif isinstance(value, Sequence):
        items = tuple(parse(v) for v in value)
    else:
        raise SbpError(
            f"cannot read {value!r} ({type(value).__name__}) as an nd-sbp; give one SBP per placement "
            f"axis, e.g. ('S(0)', 'B') or '(S(0), B)'."
        )
    if ndim is not None and len(items) != ndim:
        raise SbpError(
            f"nd-sbp {nd_str(items)} has {len(items)} entr{'y' if len(items) == 1 else 'ies'} but the "
            f"placement has {ndim} ax{'is' if ndim == 1 else 'es'}; give exactly one SBP per placement axis."
        )
    kinds = {x.reduce for x in items if x.is_partial}
    if len(kinds) > 1:
        raise SbpError(
            f"nd-sbp {nd_str(items)} mixes partial kinds ({', '.join(sorted(kinds))}); one tensor can be "
            "partial in one way only. Reduce one of them first (e.g. to B)."
        )
    return items


def nd_str(nd: Sequence[Sbp]) -> str:
    """Short form of an nd-sbp: ``(S(0), B)``."""
    return "(" + ", ".join(str(x) for x in nd) + ")"
