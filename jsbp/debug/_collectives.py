"""Count the collectives XLA actually emits for a function of global tensors."""

from __future__ import annotations

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
        counts[m.group(1)] += 1
    return counts


def count_collectives(fn, *args, **kwargs) -> dict[str, int]:
    """Compile ``fn(*args, **kwargs)`` and count the collectives in the compiled program.

    ``fn`` is any function of global tensors (and other pytrees), e.g.
    ``lambda x: x.to_global(sbp="B")``. The function is traced with ``jax.jit`` (a ``jsbp.jit``
    function is used as is) and compiled for the arguments' devices; nothing is executed.

    >>> count_collectives(lambda x: x.to_global(sbp="B"), x)  # doctest: +SKIP
    {'all-gather': 1, 'all-reduce': 0, 'reduce-scatter': 0, 'all-to-all': 0, 'collective-permute': 0}
    """
    lower = getattr(fn, "lower", None)
    lowered = lower(*args, **kwargs) if lower is not None else jax.jit(fn).lower(*args, **kwargs)
    return collectives_in_hlo(lowered.compile().as_text())
