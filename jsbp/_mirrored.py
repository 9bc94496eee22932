"""The mirrored view: run a function on every device's own local arrays (OneFlow's
``mirrored_view``, TensorFlow's ``MirroredStrategy``).

``jsbp.mirrored(fn, placement=p)`` returns a function that takes **lists** — one entry per device
of ``p``, in placement order — and returns lists. Inside, ``fn`` sees one device's entry, as plain
local arrays; it can only combine devices through ``jsbp.all_reduce`` / ``jsbp.mirrored_mean``
(typically to average gradients), so the mirrored view is data parallelism and nothing else.

Conversions to the consistent view are the core's own: ``jsbp.from_local(list, placement=p,
sbp="S(0)")`` turns a mirrored list into a global tensor (concatenated along dim 0, or ``"B"`` /
``"P"``), and ``x.to_local()`` turns a global tensor into a mirrored list. A ``GlobalTensor``
passed to a mirrored function is read as its ``to_local()`` list.

The whole call is one ``shard_map`` under ``jax.jit``: each device's entry is one block of a
global array, so lists of device-resident arrays (what a mirrored function returns) go in and
come out without copies.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._errors import PlacementError, SbpError
from ._interop import meshless
from ._placement import placement as Placement
from ._tensor import GlobalTensor

__all__ = ["mirrored", "MirroredFunction", "all_reduce", "mirrored_mean"]

_state = threading.local()

_REDUCERS = {"sum": jax.lax.psum, "mean": jax.lax.pmean, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _current():
    return getattr(_state, "placement", None)


def all_reduce(x, op: str = "sum", *, axis: str | Sequence[str] | None = None):
    """Reduce ``x`` (a pytree) across the devices of the enclosing mirrored function.

    ``op``: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``. ``axis``: the placement axes to reduce
    over (default all). Every device gets the result. Outside a mirrored function ``x`` may be a
    mirrored list (one entry per device): the reduction of its entries is returned as one value.
    """
    if op not in _REDUCERS:
        raise SbpError(f"all_reduce: op must be one of {sorted(_REDUCERS)}, got {op!r}.")
    plc = _current()
    if plc is None:
        if isinstance(x, list) and x:
            stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(a) for a in xs]), *x)
            red = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
            return jax.tree.map(lambda a: jnp.asarray(red(a, axis=0)), stacked)
        raise SbpError(
            "all_reduce / mirrored_mean combine devices inside a function run by jsbp.mirrored(fn, placement=...); "
            f"here there is none, and {type(x).__name__} is not a mirrored list to reduce."
        )
    names = plc.axis_names
    if axis is None:
        axes = tuple(names)
    else:
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        bad = [a for a in axes if a not in names]
        if bad:
            raise SbpError(f"all_reduce: axis {bad} is not an axis of {plc} (axes {names}).")
    fn = _REDUCERS[op]
    return jax.tree.map(lambda a: fn(a, axes), x)


def mirrored_mean(x, *, axis: str | Sequence[str] | None = None):
    """``all_reduce(x, "mean")``: the average over devices (e.g. of gradients), on every device."""
    return all_reduce(x, "mean", axis=axis)


class MirroredFunction:
    """A function run on each device's local arrays; see ``jsbp.mirrored``."""

    def __init__(self, fn, placement: Placement):
        if not isinstance(placement, Placement):
            raise PlacementError(
                f"jsbp.mirrored: placement must be a jsbp.placement, got {placement!r}."
            )
        self.fn = fn
        self.placement = placement
        self._devices = list(placement.devices.reshape(-1))
        self._axes = tuple(placement.axis_names)
        self._cache: dict = {}
        functools.update_wrapper(self, fn)

    # -- lists <-> global arrays --------------------------------------------------------------
    def _stack_list(self, entries: list, i: int):
        n = len(self._devices)
        if len(entries) != n:
            raise SbpError(
                f"{self.__name__}: argument {i} is a list of {len(entries)} entries, but {self.placement} has "
                f"{n} devices; a mirrored argument has one entry per device, in placement order."
            )
        flat = [jax.tree.flatten(e) for e in entries]
        tree = flat[0][1]
        for k, (_, t) in enumerate(flat):
            if t != tree:
                raise SbpError(
                    f"{self.__name__}: argument {i}: entry {k} has structure {t}, entry 0 has {tree}."
                )
        out = []
        for j in range(len(flat[0][0])):
            leaves = [f[0][j] for f in flat]
            shapes = {tuple(np.shape(x)) for x in leaves}
            if len(shapes) != 1:
                raise SbpError(
                    f"{self.__name__}: argument {i}, leaf {j}: devices hold shapes {sorted(shapes)}; the mirrored "
                    "view runs one program on every device, so every entry must have the same shape "
                    "(split the batch evenly, e.g. with np.array_split on a multiple of the device count)."
                )
            out.append(self._to_global(leaves))
        return tree, out

    def _to_global(self, leaves):
        local = tuple(np.shape(leaves[0]))
        n = len(self._devices)
        spec = PartitionSpec(self._axes)
        sharding = NamedSharding(self.placement.mesh, spec)
        pieces = []
        for x, dev in zip(leaves, self._devices):
            if not local:
                x = (
                    jnp.reshape(x, (1,))
                    if isinstance(x, jax.Array)
                    else np.reshape(np.asarray(x), (1,))
                )
            if not (isinstance(x, jax.Array) and x.devices() == {dev}):
                x = jax.device_put(x, dev)
            pieces.append(x)
        shape = (n,) if not local else (n * local[0],) + local[1:]
        return jax.make_array_from_single_device_arrays(shape, sharding, pieces)

    def _from_global(self, arr, scalar: bool):
        by_dev = {s.device: s.data for s in arr.addressable_shards}
        out = [by_dev[d] for d in self._devices if d in by_dev]
        return [o.reshape(()) for o in out] if scalar else out

    # -- call --------------------------------------------------------------------------------
    def _compiled(self, kinds, trees, in_local):
        key = (kinds, trees, in_local)
        entry = self._cache.get(key)
        if entry is not None:
            return entry
        plc, axes, fn = self.placement, self._axes, self.fn
        out_info: dict = {}

        def body(*flat):
            args, pos = [], 0
            for kind, tree, locs in zip(kinds, trees, in_local):
                nleaf = tree.num_leaves
                leaves = list(flat[pos : pos + nleaf])
                pos += nleaf
                if kind == "m":
                    leaves = [x.reshape(()) if not shp else x for x, shp in zip(leaves, locs)]
                args.append(jax.tree.unflatten(tree, leaves))
            prev = getattr(_state, "placement", None)
            _state.placement = plc
            try:
                out = fn(*args)
            finally:
                _state.placement = prev
            leaves, tree = jax.tree.flatten(out)
            leaves = [jnp.asarray(x) for x in leaves]
            out_info["tree"] = tree
            out_info["scalar"] = [x.ndim == 0 for x in leaves]
            return tuple(x.reshape((1,)) if x.ndim == 0 else x for x in leaves)

        in_specs = []
        for kind, tree in zip(kinds, trees):
            spec = PartitionSpec(axes) if kind == "m" else PartitionSpec()
            in_specs += [spec] * tree.num_leaves
        sm = jax.shard_map(
            body,
            mesh=plc.mesh,
            in_specs=tuple(in_specs),
            out_specs=PartitionSpec(axes),
            check_vma=False,
        )
        entry = (meshless(jax.jit(sm)), out_info)  # runs whatever jax.set_mesh(...) is active
        self._cache[key] = entry
        return entry

    def _prepare(self, args):
        kinds, trees, flat, in_local = [], [], [], []
        for i, a in enumerate(args):
            if isinstance(a, GlobalTensor):
                if a.placement != self.placement:
                    raise PlacementError(
                        f"{self.__name__}: argument {i} lives on {a.placement}, the mirrored function on {self.placement}."
                    )
                a = a.to_local()
            if isinstance(a, list):
                tree, leaves = self._stack_list(a, i)
                kinds.append("m")
                in_local.append(tuple(tuple(np.shape(e)) for e in jax.tree.leaves(a[0])))
            else:
                leaves, tree = jax.tree.flatten(a)
                rep = NamedSharding(self.placement.mesh, PartitionSpec())
                leaves = [jax.device_put(jnp.asarray(x), rep) for x in leaves]
                kinds.append("b")
                in_local.append(tuple(tuple(np.shape(x)) for x in leaves))
            trees.append(tree)
            flat += leaves
        fn, info = self._compiled(tuple(kinds), tuple(trees), tuple(in_local))
        return fn, info, flat

    def __call__(self, *args):
        fn, info, flat = self._prepare(args)
        outs = fn(*flat)
        per_leaf = [self._from_global(o, s) for o, s in zip(outs, info["scalar"])]
        n = len(per_leaf[0]) if per_leaf else len(self._devices)
        entries = [jax.tree.unflatten(info["tree"], [pl[k] for pl in per_leaf]) for k in range(n)]
        # a tuple of outputs comes back as a tuple of lists (OneFlow returns one list per output)
        if entries and isinstance(entries[0], tuple) and not hasattr(entries[0], "_fields"):
            return tuple([e[j] for e in entries] for j in range(len(entries[0])))
        return entries

    def lower(self, *args):
        """``jax.jit``-style lowering of one call (used by ``jsbp.debug.count_collectives``)."""
        fn, _, flat = self._prepare(args)
        return fn.lower(*flat)


def mirrored(fn=None, *, placement: Placement):
    """Run ``fn`` on each device's local arrays (the mirrored view; data parallel only).

    Every list argument has one entry per device of ``placement`` (placement order) and is
    mirrored: device ``i`` sees entry ``i``. Other arguments (and their pytrees) are broadcast:
    every device sees the same value. Results come back as a list with one entry per device, or
    a tuple of such lists when ``fn`` returns a tuple. Devices talk only through
    ``jsbp.all_reduce`` / ``jsbp.mirrored_mean`` inside ``fn``.

    >>> step = jsbp.mirrored(train_step, placement=p)                  # doctest: +SKIP
    >>> params, losses = step(params, images_list, labels_list)        # lists in, lists out  # doctest: +SKIP
    """
    if fn is None:
        return functools.partial(mirrored, placement=placement)
    return MirroredFunction(fn, placement)
