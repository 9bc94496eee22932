"""Layout geometry: nd-sbp + placement + logical shape -> per-device blocks, padding, PartitionSpec.

Physical representation of a global tensor (one ``jax.Array``):

* Each tensor dim ``d`` split by axes ``A_d`` (in axis order, outer first) is cut hierarchically with
  OneFlow's balanced splitter; every device's block is padded at its end to the largest block size
  ``ceil(n_d / K_d)`` (``K_d`` = product of the sizes of ``A_d``), so JAX sees an even sharding of
  ``ceil(n_d / K_d) * K_d`` along ``d`` with ``PartitionSpec`` entry ``A_d``. Padding never carries
  meaning: readers slice it off, reductions mask it.
* Partial axes (``P``, ``Pmax``, ``Pmin``) add one leading dim of size ``prod(sizes of partial axes)``
  sharded over those axes: every device stores its own addend, so the array never claims to be
  replicated while its devices hold different values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _sbp
from ._errors import SbpError
from ._placement import placement as Placement

__all__ = ["Layout", "balanced", "normalise_nd", "layout_of"]


def balanced(n: int, k: int) -> list[int]:
    """OneFlow's balanced splitter: ``n`` over ``k`` gives the first ``n % k`` pieces one more."""
    q, r = divmod(n, k)
    return [q + 1 if i < r else q for i in range(k)]


def offsets(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def normalise_nd(
    nd, shape: Sequence[int], plc: Placement, *, op: str = "layout"
) -> tuple[_sbp.Sbp, ...]:
    """Parse ``nd`` for ``plc`` and normalise split dims against ``shape`` (raising a clear error)."""
    items = _sbp.parse_nd(nd, plc.ndim)
    out = []
    rank = len(shape)
    for x in items:
        if x.is_split:
            d = x.dim + rank if x.dim < 0 else x.dim
            if not 0 <= d < rank:
                raise SbpError(
                    f"{op}: split dim {x.dim} is out of range for a tensor of shape {tuple(shape)} "
                    f"({rank} dim{'s' if rank != 1 else ''}) in nd-sbp {_sbp.nd_str(items)} on {plc}; "
                    f"valid split dims are {list(range(-rank, rank)) if rank else 'none (a scalar cannot be split; use B or P)'}."
                )
            x = _sbp.Split(d)
        out.append(x)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A (placement, normalised nd-sbp, logical shape) triple and everything derived from it."""

    placement: Placement
    nd_sbp: tuple[_sbp.Sbp, ...]
    shape: tuple[int, ...]

    # Layouts key every compiled program (they sit in the pytree structure of each argument), so
    # hashing and comparing them is on the dispatch path of every jsbp.jit call: hash once,
    # compare by identity first.
    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.placement, self.nd_sbp, self.shape))
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return (self.shape, self.nd_sbp, self.placement) == (
            other.shape,
            other.nd_sbp,
            other.placement,
        )

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_hash", None)  # string hashes differ between processes
        return state

    # -- per dim ---------------------------------------------------------------------------
    @functools.cached_property
    def splitters(self) -> tuple[tuple[int, ...], ...]:
        """For each tensor dim, the placement axes that split it, outer first."""
        return tuple(
            tuple(a for a, x in enumerate(self.nd_sbp) if x.is_split and x.dim == d)
            for d in range(len(self.shape))
        )

    @functools.cached_property
    def partial_axes(self) -> tuple[int, ...]:
        return tuple(a for a, x in enumerate(self.nd_sbp) if x.is_partial)

    @property
    def partial_kind(self) -> str | None:
        ax = self.partial_axes
        return self.nd_sbp[ax[0]].reduce if ax else None

    def ways(self, d: int) -> int:
        h = self.placement.hierarchy
        return math.prod(h[a] for a in self.splitters[d])

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        """The padded per-device block shape (without the partial dim)."""
        return tuple(-(-n // self.ways(d)) if n else 0 for d, n in enumerate(self.shape))

    @functools.cached_property
    def n_addends(self) -> int:
        h = self.placement.hierarchy
        return math.prod(h[a] for a in self.partial_axes)

    @functools.cached_property
    def physical_shape(self) -> tuple[int, ...]:
        body = tuple(L * self.ways(d) for d, L in enumerate(self.local_shape))
        return ((self.n_addends,) if self.partial_axes else ()) + body

    @functools.cached_property
    def spec(self) -> PartitionSpec:
        names = self.placement.axis_names
        entries = []
        if self.partial_axes:
            entries.append(tuple(names[a] for a in self.partial_axes))
        for sp in self.splitters:
            entries.append(tuple(names[a] for a in sp) if sp else None)
        return PartitionSpec(*entries)

    @functools.cached_property
    def sharding(self) -> NamedSharding:
        return NamedSharding(self.placement.mesh, self.spec)

    @functools.cached_property
    def is_even(self) -> bool:
        """True when no block is padded (every split is exact at every level)."""
        return all((n == 0) or (n % self.ways(d) == 0) for d, n in enumerate(self.shape))

    # -- per device (coordinates in hierarchy order, flattened row-major) --------------------
    @functools.cached_property
    def coords(self) -> list[tuple[int, ...]]:
        return list(np.ndindex(*self.placement.hierarchy))

    def block(self, coord: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """(offset, size) along every dim of the block device ``coord`` holds."""
        h = self.placement.hierarchy
        out = []
        for d, n in enumerate(self.shape):
            off, size = 0, n
            for a in self.splitters[d]:
                sizes = balanced(size, h[a])
                off += sum(sizes[: coord[a]])
                size = sizes[coord[a]]
            out.append((off, size))
        return tuple(out)

    @functools.cached_property
    def blocks(self) -> list[tuple[tuple[int, int], ...]]:
        return [self.block(c) for c in self.coords]

    def valid_sizes(self, d: int) -> np.ndarray:
        """Valid (unpadded) size of dim ``d`` on every device, flattened mesh order."""
        return np.array([b[d][1] for b in self.blocks], dtype=np.int64)

    def addend_index(self, coord: Sequence[int]) -> int:
        h = self.placement.hierarchy
        idx = 0
        for a in self.partial_axes:
            idx = idx * h[a] + coord[a]
        return idx

    def block_index(self, coord: Sequence[int], d: int) -> int:
        h = self.placement.hierarchy
        idx = 0
        for a in self.splitters[d]:
            idx = idx * h[a] + coord[a]
        return idx

    def physical_slices(self, coord: Sequence[int]) -> tuple[slice, ...]:
        """Where device ``coord``'s padded block sits in the physical array."""
        out = []
        if self.partial_axes:
            i = self.addend_index(coord)
            out.append(slice(i, i + 1))
        for d, L in enumerate(self.local_shape):
            i = self.block_index(coord, d)
            out.append(slice(i * L, (i + 1) * L))
        return tuple(out)

    def describe(self) -> str:
        return f"shape {self.shape} on {self.placement} with sbp {_sbp.nd_str(self.nd_sbp)}"

    # -- host-side encode / decode (numpy) --------------------------------------------------
    def encode(self, value: np.ndarray) -> np.ndarray:
        """Logical numpy value -> physical numpy array (P: the value in addend 0, zeros elsewhere)."""
        phys = np.zeros(self.physical_shape, dtype=value.dtype)
        for coord, blk in zip(self.coords, self.blocks):
            src = value[tuple(slice(o, o + s) for o, s in blk)]
            if self.partial_axes and self.addend_index(coord) != 0:
                continue
            sl = self.physical_slices(coord)
            dst = phys[sl]
            if self.partial_axes:
                dst = dst[0, ...]  # a view even for a 0-d tensor (dst[0] would copy a scalar)
            dst[tuple(slice(0, s) for _, s in blk)] = src
        return phys

    def decode(self, phys: np.ndarray) -> np.ndarray:
        """Physical numpy array -> logical numpy value (partials reduced)."""
        n = self.n_addends if self.partial_axes else 1
        addends = np.zeros((n,) + self.shape, dtype=phys.dtype)
        for coord, blk in zip(self.coords, self.blocks):
            loc = phys[self.physical_slices(coord)]
            a = 0
            if self.partial_axes:
                a = self.addend_index(coord)
                loc = loc[0]
            tgt = (a,) + tuple(slice(o, o + s) for o, s in blk)
            addends[tgt] = loc[tuple(slice(0, s) for _, s in blk)]
        kind = self.partial_kind
        if kind is None:
            return addends[0]
        if kind == "sum":
            return np.asarray(np.sum(addends.astype(_sum_dtype(addends.dtype)), axis=0)).astype(
                phys.dtype
            )
        return np.asarray(_extremum(addends, kind)).astype(phys.dtype)  # an array even for 0-d


def _floating(dtype) -> bool:
    import jax.numpy as jnp  # numpy does not know bfloat16 as floating

    return bool(jnp.issubdtype(dtype, jnp.floating))


def _sum_dtype(dtype):
    """What the addends of a partial sum of ``dtype`` are summed in: float32 for 16-bit floats
    (one device accumulates them in float32 and rounds once; ``_boxing.sum_dtype``)."""
    return np.float32 if _floating(dtype) and np.dtype(dtype).itemsize == 2 else dtype


def _extremum(addends: np.ndarray, kind: str) -> np.ndarray:
    """max / min over dim 0 in IEEE total order (``-0.0 < 0.0``; NaN wins), as the devices'
    ``Pmax`` / ``Pmin`` reduction (``_boxing._extremum_all_reduce``) and one device's ``jnp.max`` /
    ``jnp.min`` answer: numpy's own max / min of a ``-0.0`` and a ``0.0`` returns either."""
    red = np.max if kind == "max" else np.min
    if not _floating(addends.dtype) or addends.dtype.itemsize not in (2, 4, 8):
        return red(addends, axis=0)
    itype = {2: np.int16, 4: np.int32, 8: np.int64}[addends.dtype.itemsize]
    info = np.iinfo(itype)
    i = addends.view(itype)
    key = i ^ ((i >> (info.bits - 1)) & info.max)
    key = np.where(np.isnan(addends), info.max if kind == "max" else info.min, key).astype(itype)
    out = np.asarray(red(key, axis=0))
    return (out ^ ((out >> (info.bits - 1)) & info.max)).astype(itype).view(addends.dtype)


@functools.lru_cache(maxsize=4096)
def layout_of(plc: Placement, nd_sbp: tuple, shape: tuple[int, ...]) -> Layout:
    return Layout(plc, nd_sbp, shape)
