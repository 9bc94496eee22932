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
from flax import nnx
from jax.sharding import PartitionSpec

from .. import _sbp
from .._errors import SbpError
from .._layout import normalise_nd
from .._placement import placement as Placement
from .._tensor import GlobalTensor, is_key_dtype

__all__ = [
    "Strategy",
    "LeafLayouts",
    "constrain",
    "active_strategy",
    "leaf_layouts",
    "path_str",
    "derived_sbp",
]

NdSbp = tuple[_sbp.Sbp, ...]

B = _sbp.broadcast

LogicalAxes = Mapping[str, "str | Sequence[str] | None"]
"""Logical axis name -> the placement axis (or axes) that split a dim with that name; ``None``
or a missing name means the dim is not split (broadcast)."""


_AUTO: list = []
"""``Strategy.auto``'s search, ``jsbp.flax._auto.auto_strategy``, registered by that module when it
is imported (``jsbp.flax`` imports it): ``_auto`` builds on this module, so this module does not
import it."""


@dataclasses.dataclass(frozen=True)
class LeafLayouts:
    """The layouts of one state leaf under a strategy.

    ``stored``: how the leaf lives between steps. ``use``: the layout a parameter is boxed to
    before the model reads it (differs from ``stored`` only under ZeRO-3). ``grad``: the layout a
    parameter's gradient is reduced to before the optimizer sees it. ``source``: where the
    layout comes from (the ``param_sbp`` pattern, the logical names, the parameter an optimizer
    state follows or derives its layout from, or why it is ``B``), as ``Strategy.table`` shows it.
    """

    kind: str  # "param" | "opt" | "other"
    stored: NdSbp
    use: NdSbp
    grad: NdSbp
    source: str = dataclasses.field(default="", compare=False)


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
            try:
                parsed.append((rx, _sbp.parse_nd(nd, self.placement.ndim)))
            except SbpError as e:
                raise SbpError(
                    f"Strategy: param_sbp pattern {pat!r} gives the nd-sbp {nd!r}, which does not fit "
                    f"{self.placement} (axes {self.placement.axis_names}): {e} Write one SBP per placement "
                    f"axis for {pat!r}, e.g. {tuple('B' for _ in self.placement.axis_names)!r}."
                ) from None
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
        cls,
        placement: Placement,
        memory_budget=None,
        *,
        model,
        optimizer,
        loss_fn,
        batch,
        accum: int = 1,
        cost_model=None,
    ) -> Strategy:
        """Choose a strategy for ``model`` / ``optimizer`` / ``loss_fn`` on ``placement``'s
        devices: the cheapest (estimated step time: collectives + compute) whose predicted peak
        bytes per device fit ``memory_budget`` (bytes, or a string such as ``"64MiB"``; ``None``:
        no limit). Candidates: every ``dp × tp`` grid of the devices; tensor parallelism over the
        model's logical axis names (or its largest weights' dims), expert parallelism among them;
        sequence and context parallelism over the names of ``constrain``-ed activations (a
        sequence dim); names split over ``dp`` beside the batch (experts); ZeRO 0-3 over ``dp``;
        see ``jsbp.flax._auto``. ``batch`` is one host batch (shapes only are read). The returned
        strategy's ``report`` lists every candidate with its estimate; its placement is a
        ``dp`` / ``tp`` grid of the same devices.

        >>> s = jflax.Strategy.auto(p, "64MiB", model=model, optimizer=opt, loss_fn=loss_fn, batch=b)  # doctest: +SKIP
        >>> print(s.report); model, opt = jflax.shard((model, opt), s)                                 # doctest: +SKIP

        Raises ``SbpError`` when no candidate fits the budget, naming the smallest peak found.
        """
        if not _AUTO:  # jsbp.flax imports jsbp.flax._auto, which registers its search here
            raise SbpError(
                "Strategy.auto: import jsbp.flax (its _auto module registers the search)."
            )
        return _AUTO[0](
            placement,
            memory_budget,
            model=model,
            optimizer=optimizer,
            loss_fn=loss_fn,
            batch=batch,
            accum=accum,
            cost_model=cost_model,
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
        return self._base(path, shape, names)[0]

    def _base(self, path: str, shape: Sequence[int], names) -> tuple[NdSbp, str]:
        """``base_sbp`` and where it comes from (``LeafLayouts.source``)."""
        for rx, nd in self.param_sbp:
            if rx.search(path):
                try:
                    out = normalise_nd(
                        nd, tuple(shape), self.placement, op=f"Strategy(param_sbp) for {path!r}"
                    )
                except SbpError as e:
                    raise SbpError(f"{e} (pattern {rx.pattern!r} matched {path!r})") from None
                return out, f"param_sbp {rx.pattern!r}"
        dn = dim_names(names, len(shape), path)
        if dn:
            return self.sbp_for_names(dn, shape), f"names {dn}"
        return (B,) * self.placement.ndim, "B (no rule, no names)"

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
        source = "given"
        if base is None:
            base, source = self._base(path, shape, names)
        z = self.zero_split(base, shape) if self.zero else base
        if kind == "param":
            return LeafLayouts(
                kind, z if self.zero >= 3 else base, base, z if self.zero >= 2 else base, source
            )
        if kind == "opt" and len(shape) > 0:
            return LeafLayouts(kind, z, z, z, source)
        return LeafLayouts(kind, base, base, base, source)

    def table(self, tree) -> str:
        """A text table of every state leaf of ``tree`` (an NNX module, ``nnx.Optimizer``, tuple of
        them or ``nnx.State``; sharded or not) under this strategy: path, shape, kind, the
        stored / use / gradient nd-sbp and where the layout comes from (``LeafLayouts.source``:
        the ``param_sbp`` pattern, the logical names, the parameter an optimizer state follows or
        derives its layout from, or why it is ``B``)."""
        state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
        flat = list(nnx.to_flat_state(state))
        lays = leaf_layouts(flat, self)
        rows = [("path", "shape", "kind", "stored", "use", "grad", "from")]
        for path, var in flat:
            lay = lays[path]
            v = _value(var)
            rows.append(
                (
                    path_str(path),
                    str(_shape(v)) if _is_array(v) else "(pytree)",
                    lay.kind,
                    _sbp.nd_str(lay.stored),
                    _sbp.nd_str(lay.use),
                    _sbp.nd_str(lay.grad),
                    lay.source,
                )
            )
        w = [max(len(r[i]) for r in rows) for i in range(6)]
        lines = ["  ".join(f"{c:<{w[i]}}" for i, c in enumerate(r[:6])) + "  " + r[6] for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)


# -------------------------------------------------------------------------------------------
# the leaves of an NNX state and their layouts
# -------------------------------------------------------------------------------------------

Path = tuple[Any, ...]


def path_str(path: Sequence[Any]) -> str:
    """``('blocks', 0, 'fc', 'kernel')`` -> ``'blocks/0/fc/kernel'`` (what ``param_sbp`` regexes see)."""
    return "/".join(str(getattr(k, "key", k)) for k in path)


def _kind(var) -> str:
    if isinstance(var, nnx.Param):
        return "param"
    if isinstance(var, nnx.OptState):
        return "opt"
    return "other"


def _names(var):
    try:
        return var.get_metadata().get("out_sharding")
    except AttributeError:  # pragma: no cover - very old Variable types
        return None


def _value(var):
    """A state leaf's value: a ``Variable``'s, or the leaf itself when a module holds a plain array
    (``self.freqs = jnp.arange(...)``, ``nnx.WeightNorm``'s scales)."""
    if hasattr(var, "get_value"):
        return var.get_value()
    return var.value if isinstance(var, nnx.Variable) else var


def _is_var(var) -> bool:
    return isinstance(var, nnx.Variable)


def _shape(value) -> tuple[int, ...]:
    return tuple(np.shape(value))


def _is_array(value) -> bool:
    """Whether a ``Variable`` holds one array (else a pytree of them: optax's ``MaskedNode`` in
    the state of ``optax.masked`` / ``multi_transform`` / muon, sm3's list of accumulators)."""
    return isinstance(value, (GlobalTensor, jax.Array, np.ndarray, np.generic, int, float, complex))


def leaf_layouts(flat: Sequence[tuple[Path, Any]], strategy: Strategy) -> dict[Path, LeafLayouts]:
    """The ``LeafLayouts`` of every leaf of a flat NNX state under ``strategy``.

    Optimizer state whose path ends with a parameter's path follows that parameter: "moments
    follow their parameter". A state shaped like its parameter takes the parameter's base layout;
    a state of another shape (``optax.adafactor``'s factored ``v_row`` / ``v_col``) takes the
    splits of the parameter's dims it keeps (:func:`derived_sbp`), else ``B`` — never the
    parameter's ``param_sbp`` rule read against the wrong shape. Each leaf's ``source`` says
    which. Other leaves follow the strategy's path patterns and logical names.
    """
    params = {}
    for path, var in flat:
        if _kind(var) == "param":
            params[path] = var
    # every suffix of a parameter path (at least two keys) -> that parameter, if unambiguous
    by_suffix: dict[Path, Path | None] = {}
    for path in params:
        for k in range(len(path) - 1):
            suf = path[k:]
            if len(suf) < 2:
                continue
            by_suffix[suf] = None if (suf in by_suffix and by_suffix[suf] != path) else path
    base_of: dict[Path, tuple] = {}
    source_of: dict[Path, str] = {}
    for path, var in params.items():
        base_of[path], source_of[path] = strategy._base(
            path_str(path), _shape(_value(var)), _names(var)
        )
    out: dict[Path, LeafLayouts] = {}
    b = (_sbp.broadcast,) * strategy.placement.ndim
    for path, var in flat:
        kind = _kind(var)
        if not _is_array(_value(var)):  # a pytree of arrays in one Variable: each leaf B
            out[path] = LeafLayouts(kind, b, b, b, "B (a pytree of arrays)")
            continue
        shape = _shape(_value(var))
        base = base_of.get(path)
        names = _names(var)
        source = source_of.get(path)
        if kind == "opt":
            for k in range(len(path) - 1):
                p = by_suffix.get(path[k:])
                if p is not None:
                    pshape = _shape(_value(params[p]))
                    if pshape == shape:
                        base, source = base_of[p], f"follows {path_str(p)}"
                    else:  # its parameter's names (Flax copies them) describe other dims
                        base, kept = derived_sbp(base_of[p], pshape, shape)
                        source = (
                            f"B: shaped {shape}, unlike {path_str(p)} {pshape}"
                            if kept is None
                            else f"derived from {path_str(p)} {pshape} (keeps dims {kept})"
                        )
                    break
            # a copy of a parameter's metadata on a smaller leaf (adafactor's v_row)
            if names is not None and _meta_rank(names) > len(shape):
                names = None
        if is_key_dtype(getattr(_value(var), "dtype", None)):  # RNG keys: always B, never split
            out[path] = LeafLayouts(kind, b, b, b, "B (a PRNG key)")
            continue
        lay = strategy.leaf_layouts(kind, path_str(path), shape, names, base=base)
        if source is not None:
            lay = dataclasses.replace(lay, source=source)
        out[path] = lay
    return out


def derived_sbp(
    nd: tuple, pshape: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[tuple, tuple | None]:
    """The layout of a state of ``shape`` derived from its parameter's layout ``nd`` (shape
    ``pshape``): ``(layout, kept)`` where ``kept`` are the parameter dims the state keeps, in order.

    A state keeps parameter dims when its shape is the parameter's with some dims dropped
    (adafactor's ``v_row`` drops the last dim, ``v_col`` the one before it) or with some dims
    reduced to 1 in place (``keepdims``). The state takes the splits of the dims it keeps (a split
    of a dropped dim becomes ``B``). When the dims it keeps are ambiguous (a square kernel's
    ``v_row`` and ``v_col`` have one shape) and the candidates give different layouts, or no
    embedding exists (adafactor's ``(1,)`` placeholders), the state is ``B`` and ``kept`` is None.
    """
    b = (_sbp.broadcast,) * len(nd)
    cands: list[tuple[int, ...]] = []
    if len(shape) == len(pshape):  # keepdims: every dim equal, or 1 where the parameter's is not
        if all(s == q or s == 1 for s, q in zip(shape, pshape)):
            cands.append(tuple(d for d, (s, q) in enumerate(zip(shape, pshape)) if s == q))
    elif len(shape) < len(pshape):  # dims dropped: every embedding of shape in pshape, in order

        def embed(i: int, j: int, acc: tuple[int, ...]):
            if len(cands) > 16:
                return
            if i == len(shape):
                cands.append(acc)
                return
            for d in range(j, len(pshape) - (len(shape) - i) + 1):
                if pshape[d] == shape[i]:
                    embed(i + 1, d + 1, acc + (d,))

        embed(0, 0, ())
    layouts = set()
    for kept in cands:
        layouts.add(
            tuple(
                _sbp.Split(kept.index(x.dim) if len(shape) != len(pshape) else x.dim)
                if x.is_split and x.dim in kept
                else (b[0] if x.is_split else x)
                for x in nd
            )
        )
    if len(layouts) != 1 or len(cands) > 16:
        return b, None
    out = layouts.pop()
    if any(x.is_partial for x in out):  # a state is never a partial sum
        return b, None
    return out, cands[0]


def _meta_rank(meta) -> int:
    """How many dims an ``out_sharding`` metadata value names (0 when it names none)."""
    if isinstance(meta, jax.sharding.Sharding):
        meta = getattr(meta, "spec", None)
    if meta is None:
        return 0
    if isinstance(meta, str):
        return 1
    return len(meta) if isinstance(meta, (tuple, list)) else 0


# -------------------------------------------------------------------------------------------
# activations: constrain(x, logical names) inside a model
# -------------------------------------------------------------------------------------------

_state = threading.local()


def active_strategy() -> Strategy | None:
    """The strategy whose step is being traced (``None`` outside a jsbp train step)."""
    return getattr(_state, "strategy", None)


@contextlib.contextmanager
def _bound(name: str, value):
    """Inside, this thread's ``_state.<name>`` is ``value``; nests."""
    prev = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield value
    finally:
        setattr(_state, name, prev)


def activate(strategy: Strategy | None):
    return _bound("strategy", strategy)


def constrain(x, names: Sequence[str | None] | None = None, *, sbp=None, grad_sbp="same"):
    """Pin the layout of an activation by its logical dim names (or an explicit ``sbp``).

    Inside a step traced by ``jsbp.flax.make_train_step`` (or under ``jsbp.flax.use_strategy``)
    this is ``jsbp.to_global(x, sbp=..., grad_sbp=...)`` with the nd-sbp the strategy gives these
    names; by default the gradient is pinned to the same layout, which is exactly Megatron's f/g
    pair (a B activation after a row-parallel layer: forward all-reduce; a B input of a
    column-parallel layer: backward all-reduce). Without an active strategy (one device, plain
    ``jax.jit``) it returns ``x`` unchanged, so the model runs anywhere.

    >>> h = constrain(self.ln1(x), ("batch", "seq", "embed"))  # doctest: +SKIP

    Under ``constrain_with(fn)`` every call is ``fn(x, names, sbp=sbp, grad_sbp=grad_sbp)`` instead.
    """
    seen = getattr(_state, "names_seen", None)
    if seen is not None and names is not None:
        seen.add(tuple(names))
    replaced = getattr(_state, "constrain_with", None)
    if replaced is not None:
        return replaced(x, names, sbp=sbp, grad_sbp=grad_sbp)
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


def recording_names(seen: set):
    """Inside, the logical names of every ``constrain`` call are added to ``seen`` (tuples, one
    per call): the activation names ``Strategy.auto`` may map to an axis. Per thread."""
    return _bound("names_seen", seen)


def constrain_with(fn):
    """Inside, every ``constrain(x, names, sbp=, grad_sbp=)`` call (the model's, the losses') is
    ``fn(x, names, sbp=sbp, grad_sbp=grad_sbp)``: run a model written with ``constrain`` under
    another partitioner, e.g. pinning each activation with ``jax.lax.with_sharding_constraint``
    for GSPMD (``benchmarks/models.py``'s baselines). Per thread; nests."""
    return _bound("constrain_with", fn)


@contextlib.contextmanager
def use_strategy(strategy: Strategy | None):
    """Make ``constrain`` inside models follow ``strategy`` while tracing your own ``jsbp.jit``."""
    with activate(strategy):
        yield strategy
