"""``TensorSpec``: an abstract global tensor (shape, dtype, placement, nd-sbp) to load into."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from .._errors import PlacementError, SbpError
from .._layout import Layout, layout_of, normalise_nd
from .._placement import placement as Placement
from .._sbp import broadcast, nd_str
from .._tensor import is_key_dtype


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Where and how a loaded tensor should live, without any data.

    ``TensorSpec((1024, 768), "float32", placement, ("S(0)", "B"))``. ``sbp`` takes everything
    ``x.to_global`` takes; it is stored normalised (a tuple of SBP values, split dims made
    non-negative), so equal specs compare and hash equal.
    """

    shape: tuple[int, ...]
    dtype: Any
    placement: Placement
    sbp: tuple

    def __post_init__(self):
        try:
            shape = tuple(int(s) for s in self.shape)
        except TypeError:
            raise SbpError(
                f"TensorSpec: shape must be a tuple of ints, got {self.shape!r}."
            ) from None
        if any(s < 0 for s in shape):
            raise SbpError(f"TensorSpec: shape entries must be non-negative, got {shape}.")
        key = is_key_dtype(self.dtype)  # a typed PRNG key array: always B
        try:
            dtype = self.dtype if key else np.dtype(self.dtype)
        except TypeError:
            raise SbpError(f"TensorSpec: {self.dtype!r} is not a dtype.") from None
        if not isinstance(self.placement, Placement):
            raise PlacementError(
                f"TensorSpec: placement must be a jsbp.placement, got {self.placement!r}."
            )
        sbp = (broadcast,) * self.placement.ndim if key else self.sbp
        nd = normalise_nd(sbp, shape, self.placement, op="TensorSpec")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "sbp", nd)

    @classmethod
    def like(cls, x) -> TensorSpec:
        """The spec of a global tensor ``x`` (handy with ``jax.tree.map`` over a state tree)."""
        return cls(x.shape, x.dtype, x.placement, x.sbp)

    @property
    def layout(self) -> Layout:
        return layout_of(self.placement, self.sbp, self.shape)

    def __str__(self):
        return f"TensorSpec({self.shape}, {getattr(self.dtype, 'name', self.dtype)}, {self.placement}, {nd_str(self.sbp)})"
