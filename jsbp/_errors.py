"""The error types of jsbp: ``SbpError`` (a ``ValueError``, so ``except ValueError`` keeps working)
and its kind ``PlacementError``; the ``NoRuleWarning`` of a primitive that ran replicated."""

from __future__ import annotations


class SbpError(ValueError):
    """A bad SBP, layout, signature or op on a global tensor.

    Messages name the op, the tensor's shape, placement and SBP, and say what to change.
    """


class PlacementError(SbpError):
    """A bad placement: unknown or duplicate devices, ragged ranks, wrong axis names, or two
    placements mixed in one op. A kind of ``SbpError`` (so ``except jsbp.SbpError`` catches every
    jsbp error) and so a ``ValueError`` too."""


class NoRuleWarning(UserWarning):
    """A primitive without an SBP rule ran replicated under ``jsbp.jit``: its operands were boxed
    to B (gathered on every device) and it was computed whole on each. Exact, but the gather and
    the repeated compute cost; register a rule (CONTRIBUTING.md) or pass ``strict=True`` to make
    this an ``SbpError``."""
