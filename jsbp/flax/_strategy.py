"""``Strategy``: a parallelism written as layouts — which nd-sbp every parameter, optimizer state,
gradient and activation has on one placement.

Nothing about the model changes between strategies. A strategy says, for each value:

* **parameters**: by path pattern (``param_sbp``: regex -> nd-sbp, first match wins) or by the
  logical axis names Flax already stores on each ``nnx.Param`` (``out_sharding`` metadata, set with
  ``nnx.with_partitioning``) mapped to placement axes (``logical_axes``: ``{"mlp": "tp"}`` means
  "a dim named ``mlp`` is split over axis ``tp``"); everything else is broadcast;
* **optimizer moments** follow their parameter (their paths end with the parameter's path and
  Flax copies the parameter's metadata onto them);
* **ZeRO** over the data axis rewrites the stored / gradient layouts: stage 1 splits optimizer
  state, stage 2 also reduces gradients straight to that split (reduce-scatter), stage 3 also
  stores parameters split and gathers them just before use;
* **activations**: ``constrain(x, ("batch", "seq", "embed"))`` inside a model maps the same logical
  names to an nd-sbp (Flax's ``with_logical_constraint`` idiom) and is a no-op on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .. import _sbp
from .._errors import SbpError
from .._layout import normalise_nd
from .._placement import placement as Placement

__all__ = ["Strategy", "LeafLayouts", "constrain", "active_strategy"]

NdSbp = tuple[_sbp.Sbp, ...]

B = _sbp.broadcast

LogicalAxes = Mapping[str, "str | Sequence[str] | None"]
"""Logical axis name -> the placement axis (or axes) that split a dim with that name; ``None``
or a missing name means the dim is not split (broadcast)."""


@dataclasses.dataclass(frozen=True)
class LeafLayouts:
    """The layouts of one state leaf under a strategy.

    ``stored``: how the leaf lives between steps. ``use``: the layout a parameter is boxed to
    before the model reads it (differs from ``stored`` only under ZeRO-3). ``grad``: the layout a
    parameter's gradient is reduced to before the optimizer sees it.
    """

    kind: str  # "param" | "opt" | "other"
    stored: NdSbp
    use: NdSbp
    grad: NdSbp


def _as_axes(v) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(v)


def _entry_name(e, path, meta):
    if e is None or isinstance(e, str):
        return e
    if isinstance(e, (tuple, list)) and all(isinstance(x, str) for x in e):
        return tuple(e)
    if e is PartitionSpec.UNCONSTRAINED:
        return None
    raise SbpError(
        f"Strategy: {path!r} has sharding metadata {meta!r}, whose entry {e!r} is neither a name, "
        "None nor a tuple of names."
    )


def dim_names(meta, rank: int, path: str = "value") -> tuple | None:
    """One logical name (or ``None``, or a tuple of names) per dim from any form Flax stores in a
    ``Variable``'s ``out_sharding`` metadata: a tuple / list of names, a ``PartitionSpec``
    (shorter than the rank, as JAX allows: the rest is unsplit), a ``NamedSharding`` (its spec;
    its mesh axis names are read as the placement's axes of the same names) or a single name.
    ``None`` when there is none."""
    if meta is None:
        return None
    m = meta
    if isinstance(m, jax.sharding.Sharding):
        m = getattr(m, "spec", None)
        if m is None:
            return None
    if isinstance(m, str):
        m = (m,)
    if isinstance(m, PartitionSpec):
        m = tuple(m)
    if not isinstance(m, (tuple, list)):
        raise SbpError(
            f"Strategy: {path!r} has sharding metadata {meta!r} ({type(meta).__name__}); give logical "
            "names (a tuple of str / None), a PartitionSpec or a NamedSharding."
        )
    names = tuple(_entry_name(e, path, meta) for e in m)
    if len(names) > rank:
        raise SbpError(
            f"Strategy: {path!r} has {rank} dim{'s' if rank != 1 else ''} but its sharding metadata "
            f"{meta!r} names {len(names)}."
        )
    if not any(n is not None for n in names):
        return None
    return names + (None,) * (rank - len(names))


@dataclasses.dataclass(frozen=True, eq=False)
class Strategy:
    """How a model is laid out on ``placement``; see the module docstring.

    >>> p = jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("dp", "tp"))  # doctest: +SKIP
    >>> s = Strategy(p, logical_axes={"batch": "dp", "mlp": "tp", "vocab": "tp"}, zero=1)  # doctest: +SKIP

    ``data_axis`` is the axis the batch is split over (and that ZeRO splits state over); by
    default the axis ``"batch"`` maps to, else an axis named ``"dp"``, else none.
    """

    placement: Placement
    logical_axes: Any = dataclasses.field(default_factory=dict)
    param_sbp: Any = ()
    data_axis: str | None = None
    zero: int = 0
    # what Strategy.auto planned and chose (an AutoReport); None for a strategy written by hand
    report: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.placement, Placement):
            raise SbpError(f"Strategy: placement must be a jsbp.placement, got {self.placement!r}.")
        names = self.placement.axis_names
        la = dict(self.logical_axes or {})
        for k, v in la.items():
            for a in _as_axes(v):
                if a not in names:
                    raise SbpError(
                        f"Strategy: logical axis {k!r} maps to placement axis {a!r}, but {self.placement} "
                        f"has axes {names}. Map it to one of those or to None."
                    )
        object.__setattr__(
            self, "logical_axes", tuple(sorted((k, _as_axes(v)) for k, v in la.items()))
        )
        rules = self.param_sbp.items() if isinstance(self.param_sbp, Mapping) else self.param_sbp
        parsed = []
        for pat, nd in rules:
            try:
                rx = re.compile(pat)
            except re.error as e:
                raise SbpError(
                    f"Strategy: param_sbp pattern {pat!r} is not a valid regex ({e})."
                ) from None
            parsed.append((rx, _sbp.parse_nd(nd, self.placement.ndim)))
        object.__setattr__(self, "param_sbp", tuple(parsed))
        data_axis = self.data_axis
        if data_axis is None:
            batch = dict(self.logical_axes).get("batch", ())
            if len(batch) == 1:
                data_axis = batch[0]
            elif "dp" in names:
                data_axis = "dp"
        if data_axis is not None and data_axis not in names:
            raise SbpError(
                f"Strategy: data_axis={data_axis!r} is not an axis of {self.placement} (axes {names})."
            )
        object.__setattr__(self, "data_axis", data_axis)
        if self.zero not in (0, 1, 2, 3):
            raise SbpError(f"Strategy: zero must be 0, 1, 2 or 3, got {self.zero!r}.")
        if self.zero and data_axis is None:
            raise SbpError(
                f"Strategy: ZeRO-{self.zero} splits state over the data-parallel axis, but none is known on "
                f"{self.placement}; pass data_axis= or name an axis 'dp'."
            )

    def _key(self):
        return (
            self.placement,
            self.logical_axes,
            tuple((r.pattern, nd) for r, nd in self.param_sbp),
            self.data_axis,
            self.zero,
        )

    def __eq__(self, other):
        return isinstance(other, Strategy) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        la = {k: (v[0] if len(v) == 1 else v) for k, v in self.logical_axes if v}
        rules = [(r.pattern, _sbp.nd_str(nd)) for r, nd in self.param_sbp]
        return (
            f"Strategy(placement={self.placement!r}, logical_axes={la}, param_sbp={rules}, "
            f"data_axis={self.data_axis!r}, zero={self.zero})"
        )

    @classmethod
    def auto(
        cls, placement: Placement, memory_budget=None, *, model, optimizer, loss_fn, batch,
        accum: int = 1, cost_model=None,
    ) -> Strategy:
        """Choose a strategy for ``model`` / ``optimizer`` / ``loss_fn`` on ``placement``'s
        devices: the cheapest (estimated step time: collectives + compute) whose predicted peak
        bytes per device fit ``memory_budget`` (bytes, or a string such as ``"64MiB"``; ``None``:
        no limit). Candidates: every ``dp × tp`` grid of the devices, tensor parallelism over the
        model's logical axis names (or its largest weights' dims), ZeRO 0-3 over ``dp``; see
        ``jsbp.flax._auto``. ``batch`` is one host batch (shapes only are read). The returned
        strategy's ``report`` lists every candidate with its estimate; its placement is a
        ``dp`` / ``tp`` grid of the same devices.

        >>> s = jflax.Strategy.auto(p, "64MiB", model=model, optimizer=opt, loss_fn=loss_fn, batch=b)  # doctest: +SKIP
        >>> print(s.report); model, opt = jflax.shard((model, opt), s)                                 # doctest: +SKIP

        Raises ``SbpError`` when no candidate fits the budget, naming the smallest peak found.
        """
        from .._cost import DEFAULT_COST
        from ._auto import auto_strategy

        return auto_strategy(
            placement, memory_budget, model=model, optimizer=optimizer, loss_fn=loss_fn,
            batch=batch, accum=accum, cost_model=cost_model or DEFAULT_COST,
        )

    # -- logical names ------------------------------------------------------------------------
    @property
    def axis_map(self) -> dict[str, tuple[str, ...]]:
        return dict(self.logical_axes)

    def _axes_of(self, name) -> tuple[str, ...]:
        """The placement axes that split a dim named ``name``: its ``logical_axes`` entry; else,
        for a name that is a placement axis's own (a mesh axis name in a ``PartitionSpec``), that
        axis; else none. A tuple of names (a ``PartitionSpec`` entry over several axes) gives the
        axes of each name, in placement order."""
        if name is None:
            return ()
        if isinstance(name, (tuple, list)):
            axes = {a for n in name for a in self._axes_of(n)}
            return tuple(a for a in self.placement.axis_names if a in axes)
        amap = self.axis_map
        if name in amap:
            return amap[name]
        return (name,) if name in self.placement.axis_names else ()

    def sbp_for_names(
        self, names: Sequence[str | None], shape: Sequence[int] | None = None
    ) -> NdSbp:
        """The nd-sbp of a value whose dims carry these logical names (``None``: unnamed).

        A name maps through ``logical_axes``; a name no entry maps that is a placement axis's
        name (as in ``PartitionSpec("dp", None)``) is that axis; any other name is not split."""
        plc = self.placement
        nd: list[_sbp.Sbp] = [B] * plc.ndim
        for d, name in enumerate(names):
            for a in self._axes_of(name):
                i = plc.axis_names.index(a)
                if nd[i] is not B:
                    raise SbpError(
                        f"Strategy: logical names {tuple(names)} put two dims on placement axis {a!r} "
                        f"(dims {nd[i].dim} and {d}); one axis can split only one dim of a tensor."
                    )
                nd[i] = _sbp.Split(d)
        out = tuple(nd)
        if shape is not None:
            out = normalise_nd(out, tuple(shape), plc, op="Strategy")
        return out

    def batch_sbp(self, ndim: int, *, accum: bool = False) -> NdSbp:
        """Layout of a batch: split over the data axis on dim 0 (dim 1 under accumulation)."""
        nd = [B] * self.placement.ndim
        if self.data_axis is not None and ndim > int(accum):
            nd[self.placement.axis_names.index(self.data_axis)] = _sbp.Split(1 if accum else 0)
        return tuple(nd)

    # -- state leaves -------------------------------------------------------------------------
    def base_sbp(
        self, path: str, shape: Sequence[int], names: Sequence[str | None] | None
    ) -> NdSbp:
        """The strategy's layout for a leaf, before ZeRO: first matching ``param_sbp`` pattern,
        else its logical names, else broadcast."""
        for rx, nd in self.param_sbp:
            if rx.search(path):
                try:
                    return normalise_nd(
                        nd, tuple(shape), self.placement, op=f"Strategy(param_sbp) for {path!r}"
                    )
                except SbpError as e:
                    raise SbpError(f"{e} (pattern {rx.pattern!r} matched {path!r})") from None
        names = dim_names(names, len(shape), path)
        if names:
            return self.sbp_for_names(names, shape)
        return (B,) * self.placement.ndim

    def zero_split(self, nd: NdSbp, shape: Sequence[int]) -> NdSbp:
        """``nd`` with the data axis turned from B into a split of one free dim (ZeRO).

        The dim is the first one not split by another axis whose size divides evenly over the
        data axis, else the largest free dim; a tensor with no free dim (or a scalar) keeps B.
        """
        if self.data_axis is None:
            return nd
        a = self.placement.axis_names.index(self.data_axis)
        if nd[a] is not B:
            return nd
        n = self.placement.hierarchy[a]
        taken = {x.dim for x in nd if x.is_split}
        free = [d for d in range(len(shape)) if d not in taken and shape[d] >= n]
        if not free:
            return nd
        even = [d for d in free if shape[d] % n == 0]
        dim = even[0] if even else max(free, key=lambda d: shape[d])
        out = list(nd)
        out[a] = _sbp.Split(dim)
        return tuple(out)

    def leaf_layouts(
        self, kind: str, path: str, shape: Sequence[int], names=None, base: NdSbp | None = None
    ) -> LeafLayouts:
        base = self.base_sbp(path, shape, names) if base is None else base
        z = self.zero_split(base, shape) if self.zero else base
        if kind == "param":
            return LeafLayouts(
                kind, z if self.zero >= 3 else base, base, z if self.zero >= 2 else base
            )
        if kind == "opt" and len(shape) > 0:
            return LeafLayouts(kind, z, z, z)
        return LeafLayouts(kind, base, base, base)


# -------------------------------------------------------------------------------------------
# activations: constrain(x, logical names) inside a model
# -------------------------------------------------------------------------------------------

_state = threading.local()


def active_strategy() -> Strategy | None:
    """The strategy whose step is being traced (``None`` outside a jsbp train step)."""
    return getattr(_state, "strategy", None)


@contextlib.contextmanager
def activate(strategy: Strategy | None):
    prev = getattr(_state, "strategy", None)
    _state.strategy = strategy
    try:
        yield strategy
    finally:
        _state.strategy = prev


def constrain(x, names: Sequence[str | None] | None = None, *, sbp=None, grad_sbp="same"):
    """Pin the layout of an activation by its logical dim names (or an explicit ``sbp``).

    Inside a step traced by ``jsbp.flax.make_train_step`` (or under ``jsbp.flax.use_strategy``)
    this is ``jsbp.to_global(x, sbp=..., grad_sbp=...)`` with the nd-sbp the strategy gives these
    names; by default the gradient is pinned to the same layout, which is exactly Megatron's f/g
    pair (a B activation after a row-parallel layer: forward all-reduce; a B input of a
    column-parallel layer: backward all-reduce). Without an active strategy (one device, plain
    ``jax.jit``) it returns ``x`` unchanged, so the model runs anywhere.

    >>> h = constrain(self.ln1(x), ("batch", "seq", "embed"))  # doctest: +SKIP
    """
    strategy = active_strategy()
    if strategy is None:
        return x
    from .._trace import current_tracer

    if current_tracer() is None:
        return x
    from .._tensor import to_global

    shape = tuple(np.shape(x))
    if sbp is None:
        if names is None:
            raise SbpError("constrain: pass the logical names of x's dims, or sbp=.")
        if len(names) != len(shape):
            raise SbpError(
                f"constrain: {len(names)} names {tuple(names)} for a value of shape {shape}."
            )
        nd = strategy.sbp_for_names(names, shape)
    else:
        nd = normalise_nd(sbp, shape, strategy.placement, op="constrain")
    g = nd if isinstance(grad_sbp, str) and grad_sbp == "same" else grad_sbp
    return to_global(x, sbp=nd, grad_sbp=g)


@contextlib.contextmanager
def use_strategy(strategy: Strategy | None):
    """Make ``constrain`` inside models follow ``strategy`` while tracing your own ``jsbp.jit``."""
    with activate(strategy):
        yield strategy
