"""Count the collectives XLA actually emits for a function of global tensors."""

from __future__ import annotations

import functools
import re

import jax

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

# "%x = f32[..] all-gather(...)", "all-gather-start(", fused async forms all count once
_OP_RE = re.compile(
    r"=\s*(?:\([^=]*\)|[^\s=]+)\s+(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


_COMMENT_RE = re.compile(r"/\*.*?\*/")


def collectives_in_hlo(hlo_text: str) -> dict[str, int]:
    """Count collective instructions in optimised HLO text (``-done`` halves are not counted)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    # tuple shapes carry "/*index=5*/" comments whose "=" would hide the op from _OP_RE
    # (XLA:CPU writes an all-to-all over 8 devices as a tuple of 8 pieces)
    text = _COMMENT_RE.sub("", hlo_text)
    for m in _OP_RE.finditer(text):
        kind = m.group(1)
        # XLA's combiners merge independent all-reduces (all-gathers, reduce-scatters) into one
        # instruction with several operands; each operand is one planned collective. An
        # all-to-all's tuple operands are the chunks of a single exchange: it counts once.
        n = _n_operands(text, m.end()) if kind in _COMBINABLE else 1
        counts[kind] += max(n, 1)
    return counts


_COMBINABLE = ("all-reduce", "all-gather", "reduce-scatter")
_OPEN, _CLOSE = "([{", ")]}"


def _n_operands(text: str, start: int) -> int:
    """Number of top-level operands in the call whose argument list starts at ``start``."""
    depth, n, seen = 0, 0, False
    for ch in text[start:]:
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            if depth == 0:
                return n + (1 if seen else 0)
            depth -= 1
        elif ch == "," and depth == 0:
            n += 1
            seen = False
            continue
        if not ch.isspace():
            seen = True
    return n + (1 if seen else 0)


def count_collectives(fn, *args, **kwargs) -> dict[str, int]:
    """Compile ``fn(*args, **kwargs)`` and count the collectives in the compiled program.

    ``fn`` is any function of global tensors (and other pytrees). A plain function is compiled
    the way ``jsbp.explain`` compiles it, with ``jsbp.jit`` (so ``jnp`` calls on global tensors
    work and the two always agree); one written with the eager API instead
    (``lambda x: x.to_global(sbp="B")``, which ``jsbp.jit`` cannot trace) is compiled with
    ``jax.jit``. A ``jsbp.jit`` function (or anything with ``lower``) is used as is. Nothing is
    executed.

    >>> count_collectives(lambda x: x.to_global(sbp="B"), x)  # doctest: +SKIP
    {'all-gather': 1, 'all-reduce': 0, 'reduce-scatter': 0, 'all-to-all': 0, 'collective-permute': 0}
    """
    lower = getattr(fn, "lower", None)
    if lower is not None:
        lowered = lower(*args, **kwargs)
    else:
        from .._jit import jit

        bound = functools.partial(fn, **kwargs) if kwargs else fn
        try:
            lowered = jit(bound).lower(*args)
        except (
            Exception
        ) as consistent:  # eager-API code (GlobalTensor methods), or no global tensor
            try:
                lowered = jax.jit(fn).lower(*args, **kwargs)
            except Exception as eager:
                consistent.add_note(
                    f"compiling it with jax.jit instead failed too: {type(eager).__name__}: {eager}"
                )
                raise consistent from None
    return collectives_in_hlo(lowered.compile().as_text())
