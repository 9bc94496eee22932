"""Placements: a grid of devices (the *hierarchy*), backed by a ``jax.sharding.Mesh``."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from . import _hooks
from ._errors import PlacementError

__all__ = ["placement"]

_TYPE_ALIASES = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu", "rocm": "gpu"}


def _normalise_type(type_: str) -> str:
    if not isinstance(type_, str) or type_.lower() not in _TYPE_ALIASES:
        raise PlacementError(
            f"unknown device type {type_!r}; use one of 'cpu', 'gpu' (or 'cuda'), 'tpu'."
        )
    return _TYPE_ALIASES[type_.lower()]


@functools.cache
def _devices_of(type_: str) -> dict[int, jax.Device]:
    try:
        devs = jax.devices(type_)
    except RuntimeError:
        return {}
    return {d.id: d for d in devs}


def _ranks_array(ranks) -> np.ndarray:
    if isinstance(ranks, range):
        ranks = list(ranks)
    if isinstance(ranks, (int, np.integer)) and not isinstance(ranks, bool):
        ranks = [ranks]
    if isinstance(ranks, (str, bytes)):
        raise PlacementError(
            f"ranks {ranks!r} is a {type(ranks).__name__}; give JAX device ids as ints, e.g. [0, 1] "
            "or [[0, 1], [2, 3]]."
        )
    try:
        arr = np.array(ranks, dtype=object)
    except ValueError:
        raise PlacementError(
            f"ranks {ranks!r} are ragged; give a rectangular nested list of device ids, e.g. "
            "[[0, 1], [2, 3]]."
        ) from None
    if (
        arr.dtype == object
        and arr.size
        and any(isinstance(v, (list, tuple, np.ndarray)) for v in arr.flat)
    ):
        raise PlacementError(
            f"ranks {ranks!r} are ragged; every row must have the same number of device ids."
        )
    if arr.ndim == 0 or arr.size == 0:
        raise PlacementError(f"ranks {ranks!r} name no device; give at least one JAX device id.")
    out = np.empty(arr.shape, dtype=np.int64)
    for idx, v in np.ndenumerate(arr):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise PlacementError(
                f"ranks must be integer JAX device ids; got {v!r} ({type(v).__name__}) in {ranks!r}."
            )
        if abs(int(v)) >= 2**62:  # would overflow int64: certainly no device id
            raise PlacementError(
                f"ranks must be JAX device ids; {v!r} in {ranks!r} is none (devices: {_backends()})."
            )
        out[idx] = int(v)
    return out


class placement:  # noqa: N801 - lower-case like OneFlow's flow.placement
    """A grid of devices.

    ``placement("cpu", [0, 1, 2, 3])`` is a 1-d placement of 4 devices;
    ``placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))`` is a 2 x 2 grid whose outer axis
    is called ``dp``. Ranks are JAX device ids (``jax.Device.id``); their array shape is the
    hierarchy. ``"cuda"`` is a synonym of ``"gpu"``.
    """

    __slots__ = ("_type", "_ranks", "_axis_names", "_mesh", "_hash")

    def __init__(self, type: str, ranks, axis_names: Sequence[str] | None = None):  # noqa: A002
        t = _normalise_type(type)
        arr = _ranks_array(ranks)
        flat = arr.reshape(-1).tolist()
        dup = sorted({r for r in flat if flat.count(r) > 1})
        if dup:
            raise PlacementError(
                f"ranks {arr.tolist()} repeat device id(s) {dup}; each device may appear once."
            )
        known = _devices_of(t)
        if not known:
            raise PlacementError(
                f"no {t!r} devices are available to JAX here (backends: {_backends()}); "
                "choose a device type this machine has."
            )
        missing = [r for r in flat if r not in known]
        if missing:
            other = [
                r
                for r in missing
                if any(r in _devices_of(o) for o in ("cpu", "gpu", "tpu") if o != t)
            ]
            hint = f" (id(s) {other} belong to another device type)" if other else ""
            raise PlacementError(
                f"device id(s) {missing} are not {t!r} devices{hint}; valid {t} ids are "
                f"{sorted(known)}."
            )
        if axis_names is None:
            names = tuple(f"ax{i}" for i in range(arr.ndim))
        else:
            if isinstance(axis_names, str):
                axis_names = (axis_names,)
            names = tuple(axis_names)
            if len(names) != arr.ndim:
                raise PlacementError(
                    f"{len(names)} axis name(s) {names} for a placement of hierarchy {arr.shape} "
                    f"({arr.ndim} ax{'is' if arr.ndim == 1 else 'es'}); give one name per axis."
                )
            if not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
                raise PlacementError(f"axis names {names} must be distinct non-empty strings.")
        self._type = t
        self._ranks = arr
        self._ranks.flags.writeable = False
        self._axis_names = names
        self._mesh = None
        self._hash = hash((t, arr.shape, tuple(flat), names))

    @classmethod
    def all(cls, type: str, axis_names: Sequence[str] | None = None) -> placement:  # noqa: A002
        """Every device of ``type``, as a 1-d placement (ids in increasing order)."""
        t = _normalise_type(type)
        ids = sorted(_devices_of(t))
        if not ids:
            raise PlacementError(
                f"no {t!r} devices are available to JAX here (backends: {_backends()})."
            )
        return cls(t, ids, axis_names)

    # -- properties ------------------------------------------------------------------------
    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self) -> np.ndarray:
        return self._ranks

    @property
    def hierarchy(self) -> tuple[int, ...]:
        return tuple(self._ranks.shape)

    @property
    def ndim(self) -> int:
        return self._ranks.ndim

    @property
    def size(self) -> int:
        return int(self._ranks.size)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def devices(self) -> np.ndarray:
        """The ``jax.Device`` objects, in the hierarchy's shape."""
        known = _devices_of(self._type)
        return np.vectorize(lambda r: known[int(r)], otypes=[object])(self._ranks)

    @property
    def mesh(self) -> Mesh:
        if self._mesh is None:
            self._mesh = Mesh(self.devices, self._axis_names)
        return self._mesh

    def axis_size(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self._axis_names:
                raise PlacementError(
                    f"axis_size: {self} has no axis named {axis!r}; its axes are {list(self._axis_names)}."
                )
            return self.hierarchy[self._axis_names.index(axis)]
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise PlacementError(
                f"axis_size: give an axis name {list(self._axis_names)} or index 0..{self.ndim - 1} of "
                f"{self}; got {axis!r} ({type(axis).__name__})."
            )
        if not -self.ndim <= axis < self.ndim:
            raise PlacementError(
                f"axis_size: axis {axis} is out of range for {self}, which has {self.ndim} "
                f"ax{'is' if self.ndim == 1 else 'es'}; give 0..{self.ndim - 1} or a name in "
                f"{list(self._axis_names)}."
            )
        return self.hierarchy[axis]

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, placement):
            return NotImplemented
        return (
            self._hash == other._hash
            and self._type == other._type
            and self._axis_names == other._axis_names
            and self._ranks.shape == other._ranks.shape
            and bool(np.all(self._ranks == other._ranks))
        )

    def __hash__(self):
        return self._hash

    def __repr__(self):
        names = (
            ""
            if self._axis_names == tuple(f"ax{i}" for i in range(self.ndim))
            else f", axis_names={self._axis_names}"
        )
        return f"placement(type={self._type!r}, ranks={self._ranks.tolist()}{names})"

    def __str__(self):
        h = "x".join(str(n) for n in self.hierarchy)
        return f"{self._type}:{h}{list(self._axis_names)}"

    def __reduce__(self):
        return (placement, (self._type, self._ranks.tolist(), self._axis_names))

    def _repr_html_(self):
        return _hooks.render_html("placement", self)


def _backends() -> str:
    out = []
    for t in ("cpu", "gpu", "tpu"):
        if _devices_of(t):
            out.append(f"{t}: {len(_devices_of(t))} devices")
    return ", ".join(out) or "none"
