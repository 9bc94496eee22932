"""``GlobalTensor``: a logical value with a placement and an nd-sbp.

A registered pytree: one ``jax.Array`` leaf (the physical array, see ``_layout``) plus static
metadata (the ``Layout``). It passes through ``jax.jit``, ``jax.grad`` and Flax state unchanged.

Cotangent convention: the cotangent of a global tensor's leaf is read with the *same* layout as
the primal (for P: any addends whose sum is the gradient). Every jsbp function that reads or
writes leaves (boxing, ``to_jax``, ``tensor``) has a custom VJP that keeps to it, so
``jax.grad`` with respect to global tensors returns global tensors with correct values.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from . import _hooks, _sbp, _trace
from ._boxing import make_local_boxer, sum_dtype
from ._errors import PlacementError, SbpError
from ._interop import meshless, portable_key
from ._layout import Layout, balanced, layout_of, normalise_nd, offsets
from ._placement import placement as Placement
from ._statickey import static_key

__all__ = [
    "GlobalTensor",
    "tensor",
    "zeros",
    "ones",
    "full",
    "arange",
    "randn",
    "rand",
    "from_local",
    "manual_seed",
]


def _numeric(dtype) -> bool:
    """bool or a number type, ml_dtypes' too (numpy files bfloat16 and the float8 types under the
    kind letter 'V', with void and structured types)."""
    try:
        return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))
    except TypeError:
        return False


def _canonical_dtype(dtype):
    try:
        dt = np.dtype(dtype)
        if dt.kind in "OSUMmV" and not jnp.issubdtype(dt, jnp.number):  # objects, strings, times
            raise TypeError(dt)
        return jax.dtypes.canonicalize_dtype(dt)
    except (TypeError, ValueError):
        raise SbpError(
            f"dtype {dtype!r} is not a numeric data type jsbp can hold; give e.g. jnp.float32, "
            "'float32', jnp.int32 or bool."
        ) from None


def is_key_dtype(dtype) -> bool:
    """A typed PRNG key array's dtype (``key<fry>``): such a tensor is always ``B``."""
    try:
        return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    except TypeError:
        return False


def _key_tensor(key, placement, sbp, op) -> GlobalTensor:
    """A typed PRNG key array as a global tensor: always ``B`` (a key array is never split; a
    split or partial request is read as ``B``), the same key on every device."""
    if not isinstance(placement, Placement):
        raise PlacementError(f"{op}: placement must be a jsbp.placement, got {placement!r}.")
    lay = layout_of(placement, (_sbp.broadcast,) * placement.ndim, tuple(key.shape))
    if isinstance(key, jax.core.Tracer):
        return GlobalTensor(key, lay)
    return GlobalTensor(jax.device_put(key, lay.sharding), lay)


@jax.tree_util.register_pytree_node_class
class GlobalTensor:
    """A logical tensor laid out on a placement. Build one with ``jsbp.tensor`` & co."""

    __slots__ = ("_value", "_layout")
    __array_priority__ = 1000  # numpy defers to our reflected operators

    def __init__(self, value, layout: Layout):
        self._value = value
        self._layout = layout

    # -- pytree -----------------------------------------------------------------------------
    def tree_flatten(self):
        return (self._value,), self._layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        obj = object.__new__(cls)
        obj._value = children[0]
        obj._layout = layout
        return obj

    # -- metadata -----------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def physical(self) -> jax.Array:
        """The padded physical ``jax.Array`` (see ``jsbp._layout``); mostly for experts."""
        return self._value

    @property
    def shape(self) -> tuple[int, ...]:
        return self._layout.shape

    @property
    def ndim(self) -> int:
        return len(self._layout.shape)

    @property
    def size(self) -> int:
        return math.prod(self._layout.shape)

    @property
    def dtype(self):
        return self._value.dtype

    @property
    def placement(self) -> Placement:
        return self._layout.placement

    @property
    def sbp(self) -> tuple[_sbp.Sbp, ...]:
        return self._layout.nd_sbp

    def __repr__(self):
        lay = self._layout
        try:
            dt = np.dtype(self.dtype).name
        except TypeError:
            dt = str(self.dtype)
        return f"GlobalTensor(shape={lay.shape}, dtype={dt}, placement={lay.placement!r}, sbp={_sbp.nd_str(lay.nd_sbp)})"

    def _repr_html_(self):
        return _hooks.render_html("tensor", self)

    # -- conversions ----------------------------------------------------------------------------
    def to_global(
        self, placement: Placement | None = None, sbp=None, *, grad_sbp=None
    ) -> GlobalTensor:
        """Box to ``placement`` / ``sbp`` (either may be None: keep it). Returns self if unchanged.

        ``grad_sbp`` sets the layout the gradient of the result is converted to in the backward
        pass before it flows back to this tensor (OneFlow's Megatron "f"/"g" idiom).
        """
        if is_key_dtype(self.dtype):  # keys stay B; only the placement can change
            if placement is None or placement == self.placement:
                return self
            return _key_tensor(self.to_local()[0], placement, sbp, "to_global")
        if placement is None and grad_sbp is None:
            hit = _eager_boxer(self, sbp)
            if hit is not None:
                return GlobalTensor(hit[1](self._value), hit[0])
        return to_global(self, placement, sbp, grad_sbp=grad_sbp)

    def to_local(self) -> list[jax.Array]:
        """This process's local arrays, one per device of the placement, in placement order.

        For a partial layout each is that device's addend. Padding is sliced off.
        """
        _check_global(self, "to_local")  # e.g. GlobalTensor.to_local(array) through a tree map
        lay = self._layout
        if isinstance(self._value, jax.core.Tracer):
            raise SbpError(
                f"to_local() reads concrete device buffers; it cannot run under a JAX transformation "
                f"(the tensor of {lay.describe()} is a tracer here). Call it outside jax.jit / jax.grad."
            )
        by_dev = {s.device: s for s in self._value.addressable_shards}
        out = []
        for dev, blk in zip(lay.placement.devices.reshape(-1), lay.blocks):
            shard = by_dev.get(dev)
            if shard is None:
                continue
            data = shard.data
            if lay.partial_axes:
                data = data[0]
            idx = tuple(slice(0, s) for _, s in blk)
            out.append(data[idx] if data.shape != tuple(s for _, s in blk) else data)
        return out

    def numpy(self) -> np.ndarray:
        """The full logical value as a numpy array (partials reduced), on every process."""
        if isinstance(self._value, jax.core.Tracer):
            raise SbpError(
                f"numpy() needs a concrete value; the tensor of {self._layout.describe()} is a tracer "
                "here. Use x.to_jax() inside traced code."
            )
        lay = self._layout
        if is_key_dtype(self.dtype):  # numpy cannot hold keys: the key array (B: one device's copy)
            return self.to_local()[0]
        if math.prod(lay.shape) == 0:  # nothing to read (and see _empty: the shards may be odd)
            return np.zeros(lay.shape, self.dtype)
        if jax.process_count() == 1:
            return lay.decode(np.asarray(self._value))
        spans_all_processes = _hooks.multiprocess_fn("spans_all_processes")
        one_device_per_process = _hooks.multiprocess_fn("one_device_per_process")
        # several processes: collective, decided on global facts so every process takes one path
        if spans_all_processes(lay.placement.devices.flat):
            full = self.to_global(sbp=tuple(_sbp.broadcast for _ in lay.nd_sbp))
        else:  # some process owns no device here: bring the value to one device of every process
            full = self.to_global(
                placement=one_device_per_process(lay.placement.type), sbp=_sbp.broadcast
            )
        shard = full._value.addressable_shards[0]
        return np.asarray(shard.data)[tuple(slice(0, n) for n in lay.shape)]

    def to_jax(self) -> jax.Array:
        """The logical value as a ``jax.Array`` with the equivalent ``NamedSharding``
        (``jsbp.named_sharding``): no copy for even S / B layouts, ``P`` as an ``unreduced`` spec;
        an uneven layout raises (JAX cannot hold uneven blocks). Under a JAX transformation
        (jax.jit / jax.grad) it is the plain logical value (differentiable, padding removed,
        partials reduced)."""
        from ._interop import to_jax_array, under_transformation

        if isinstance(self._value, jax.core.Tracer) or under_transformation():
            # a concrete tensor read inside a transformation (one not differentiated by
            # jax.grad, a closed-over one) is the same plain value, on the placement's own mesh:
            # mixed with the traced ones there, JAX sees one mesh
            return decode(self._value, self._layout)

        return to_jax_array(self)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out.astype(dtype) if dtype is not None else out

    def __format__(self, spec: str) -> str:
        """As a ``jax.Array``: a 0-d tensor formats as its value (``f"{loss:.4f}"``); a non-empty
        spec on another shape is numpy's (which refuses most); no spec is ``str(x)``."""
        if not spec:
            return str(self)
        value = self._item("format") if self.ndim == 0 else self.numpy()
        return format(value, spec)

    def __reduce__(self):
        """Pickles as its logical value, placement and nd-sbp (a ``jax.Array`` pickles as its
        value); unpickling lays the value out again on the same placement (a ``P`` tensor as its
        sum in one addend). For a tensor spread over several processes, or a PRNG key array,
        use ``jsbp.checkpoint``."""
        lay = self._layout
        if isinstance(self._value, jax.core.Tracer):
            raise SbpError(
                f"cannot pickle the global tensor of {lay.describe()}: it is a tracer here (inside jax.jit / "
                "jax.grad / jsbp.jit). Pickle concrete tensors, or save them with jsbp.checkpoint.save."
            )
        if is_key_dtype(self.dtype) or not self._value.is_fully_addressable:
            what = (
                "a PRNG key array" if is_key_dtype(self.dtype) else "spread over several processes"
            )
            raise SbpError(
                f"cannot pickle the global tensor of {lay.describe()}: it is {what}. Use "
                "jsbp.checkpoint.save(path, tree) / jsbp.checkpoint.load(path, ...) instead."
            )
        return (_unpickle, (self.numpy(), lay.placement, lay.nd_sbp))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d global tensor")
        return self.shape[0]

    # -- Python's questions, answered as a jax.Array answers them ---------------------------------
    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d global tensor")
        return (self[i] for i in range(self.shape[0]))

    def _item(self, what: str):
        """The one element of a size-1 tensor as a numpy scalar (for ``bool`` / ``float`` / ...)."""
        if isinstance(self._value, jax.core.Tracer):
            raise SbpError(
                f"{what}() of the global tensor of {self._layout.describe()} needs a concrete value, but it "
                "is a tracer here (inside jax.jit / jax.grad / jsbp.jit). Use jnp.where / lax.cond on the "
                "value instead of Python control flow."
            )
        if self.size != 1:
            if what == "bool":
                raise ValueError(
                    f"The truth value of a global tensor of shape {self.shape} is ambiguous (it has "
                    f"{self.size} elements); use x.any() or x.all()."
                )
            raise TypeError(
                f"only size-1 global tensors can be converted to Python scalars with {what}(); this one "
                f"has shape {self.shape}."
            )
        return self.numpy().reshape(())[()]

    def __bool__(self):
        return bool(self._item("bool"))

    def __float__(self):
        return float(self._item("float"))

    def __int__(self):
        return int(self._item("int"))

    def __complex__(self):
        return complex(self._item("complex"))

    def __index__(self):
        if not jnp.issubdtype(self.dtype, jnp.integer):
            raise TypeError(
                f"only integer global tensors can be used as an index; this one is {np.dtype(self.dtype).name}."
            )
        return int(self._item("index"))


def _unpickle(value, placement, nd_sbp) -> GlobalTensor:
    return tensor(value, placement=placement, sbp=nd_sbp)


def _check_global(x, op: str) -> GlobalTensor:
    if not isinstance(x, GlobalTensor):
        raise SbpError(
            f"{op} needs a jsbp GlobalTensor, got {type(x).__name__}"
            + (f" of shape {tuple(np.shape(x))}" if hasattr(x, "shape") else "")
            + "; make one with jsbp.tensor(data, placement=..., sbp=...) or jsbp.from_local(...)."
        )
    return x


# -------------------------------------------------------------------------------------------
# encode / decode between the logical jax value and the physical array (jit-able, differentiable)
# -------------------------------------------------------------------------------------------


def _dim_index_table(lay: Layout, d: int):
    """For every physical position along dim d: (logical index, valid?)."""
    L = lay.local_shape[d]
    h = lay.placement.hierarchy
    sp = lay.splitters[d]
    K = lay.ways(d)
    idx = np.zeros(L * K, dtype=np.int64)
    valid = np.zeros(L * K, dtype=bool)
    for b in range(K):
        # block index -> coords on the splitting axes (mixed radix, outer first)
        rem, coords = b, []
        for a in reversed(sp):
            coords.append(rem % h[a])
            rem //= h[a]
        coords = coords[::-1]
        off, size = 0, lay.shape[d]
        for a, c in zip(sp, coords):
            sizes = balanced(size, h[a])
            off += offsets(sizes)[c]
            size = sizes[c]
        idx[b * L : b * L + size] = off + np.arange(size)
        valid[b * L : b * L + size] = True
    return idx, valid


def _encode_raw(value, lay: Layout):
    x = value
    for d in range(len(lay.shape)):
        if lay.ways(d) > 1 and lay.shape[d] % lay.ways(d) != 0:
            idx, valid = _dim_index_table(lay, d)
            x = jnp.take(x, jnp.asarray(idx, jnp.int32), axis=d, mode="clip")
            shp = [1] * x.ndim
            shp[d] = idx.shape[0]
            x = jnp.where(jnp.asarray(valid).reshape(shp), x, jnp.zeros((), x.dtype))
    if lay.partial_axes:
        n = lay.n_addends
        ident = {"sum": 0, "max": None, "min": None}[lay.partial_kind]
        if ident == 0:
            x = jnp.concatenate([x[None], jnp.zeros((n - 1,) + x.shape, x.dtype)], axis=0)
        else:  # max / min of copies is the value itself
            x = jnp.broadcast_to(x[None], (n,) + x.shape)
    return x


def _decode_raw(phys, lay: Layout):
    x = phys
    if lay.partial_axes:
        if lay.partial_kind == "sum":  # 16-bit floats: summed in float32, rounded once
            x = jnp.sum(x, axis=0, dtype=sum_dtype(x.dtype)).astype(x.dtype)
        else:
            x = (jnp.max if lay.partial_kind == "max" else jnp.min)(x, axis=0)
    for d in range(len(lay.shape)):
        if lay.ways(d) > 1 and lay.shape[d] % lay.ways(d) != 0:
            idx, valid = _dim_index_table(lay, d)
            pos = np.zeros(lay.shape[d], dtype=np.int64)
            pos[idx[valid]] = np.nonzero(valid)[0]
            x = jnp.take(x, jnp.asarray(pos, jnp.int32), axis=d, mode="clip")
    return x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def encode(value, lay: Layout):
    return _encode_raw(value, lay)


def _encode_fwd(value, lay):
    return _encode_raw(value, lay), None


def _encode_bwd(lay, _, ct):
    return (_decode_raw(ct, lay),)


encode.defvjp(_encode_fwd, _encode_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def decode(phys, lay: Layout):
    return _decode_raw(phys, lay)


def _decode_fwd(phys, lay):
    return _decode_raw(phys, lay), None


def _decode_bwd(lay, _, ct):
    return (_encode_raw(ct, lay),)


decode.defvjp(_decode_fwd, _decode_bwd)


@functools.lru_cache(maxsize=1024)
def _encode_jit(lay: Layout):
    return meshless(jax.jit(lambda v: _encode_raw(v, lay), out_shardings=lay.sharding))


# -------------------------------------------------------------------------------------------
# boxing on leaves
# -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _same_placement_boxer(src: Layout, dst: Layout, dtype):
    body, moves = make_local_boxer(src, dst, dtype)
    fn = jax.shard_map(
        body, mesh=src.placement.mesh, in_specs=(src.spec,), out_specs=dst.spec, check_vma=False
    )
    return meshless(jax.jit(fn)), moves


def _empty(lay: Layout, dtype):
    """The physical array of a zero-size tensor, built on the host.

    ``jax.jit`` outputs of zero-size arrays can carry shards of the *global* shape (8x0x4 on every
    device instead of 2x0x4), which ``device_put`` and ``np.asarray`` then reject; a host array put
    with the layout's sharding has the right shards. There is no data to move anyway.
    """
    return jax.device_put(np.zeros(lay.physical_shape, dtype), lay.sharding)


def _box_raw(phys, src: Layout, dst: Layout):
    if src == dst:
        return phys
    if math.prod(src.shape) == 0 and not isinstance(phys, jax.core.Tracer):
        return _empty(dst, phys.dtype)
    if src.placement == dst.placement:
        fn, _ = _same_placement_boxer(src, dst, np.dtype(phys.dtype))
        return fn(phys)
    return _cross_placement(phys, src, dst)


def _cross_placement(phys, src: Layout, dst: Layout):
    if isinstance(phys, jax.core.Tracer):
        raise SbpError(
            f"to_global: moving a tensor of {src.describe()} from {src.placement!r} to {dst.placement!r} is an eager "
            "operation; inside jax.jit / jsbp.jit every tensor must stay on one placement. Box across "
            "placements outside the traced function."
        )
    sp, dp = src.placement, dst.placement
    # several processes: JAX cannot device_put between device sets of different processes, so
    # blocks travel by collective-permute over the union of both placements (jsbp.distributed)
    multi = not (phys.is_fully_addressable and dst.sharding.is_fully_addressable)
    if sp.hierarchy == dp.hierarchy:
        # same grid shape: move blocks device-to-device, keeping the layout, then box on dst
        mid = layout_of(dp, src.nd_sbp, src.shape)
        if multi and set(sp.devices.flat) != set(dp.devices.flat):
            send_blocks = _hooks.multiprocess_fn("send_blocks")
            moved = send_blocks(phys, list(sp.devices.flat), mid.sharding, mid.physical_shape)
            return _box_raw(moved, mid, dst)
        return _box_raw(jax.device_put(phys, mid.sharding), mid, dst)
    # different grid: gather to B on src, copy the replicated value over, slice on dst
    allb = tuple(_sbp.broadcast for _ in range(sp.ndim))
    full = _box_raw(phys, src, layout_of(sp, allb, src.shape))
    dst_b = layout_of(dp, tuple(_sbp.broadcast for _ in range(dp.ndim)), src.shape)
    if multi:
        send_blocks = _hooks.multiprocess_fn("send_blocks")
        nearest_sources = _hooks.multiprocess_fn("nearest_sources")
        moved = send_blocks(full, nearest_sources(sp, dp), dst_b.sharding, dst_b.physical_shape)
        return _box_raw(moved, dst_b, dst)
    local = full.addressable_shards[0].data
    moved = jax.make_array_from_callback(
        dst_b.physical_shape, dst_b.sharding, lambda idx: local[idx] if local.ndim else local
    )
    return _box_raw(moved, dst_b, dst)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def box(phys, src: Layout, dst: Layout, grad: Layout | None):
    """Convert a physical array from layout ``src`` to ``dst`` (differentiable)."""
    return _box_raw(phys, src, dst)


def _box_fwd(phys, src, dst, grad):
    return _box_raw(phys, src, dst), None


def _box_bwd(src, dst, grad, _, ct):
    g = ct
    if grad is not None and grad != dst:
        g = _box_raw(g, dst, grad)
        return (_box_raw(g, grad, src),)
    return (_box_raw(g, dst, src),)


box.defvjp(_box_fwd, _box_bwd)


# Eager ``x.to_global(sbp=...)`` on x's own placement is the hot path of eager code. A hit here
# replaces parsing, two cache lookups that hash Layouts, and the checks of ``to_global`` with one
# dict lookup; it is keyed by the source layout's id (the entry keeps the layout alive and is
# only used when it holds that very object), the sbp as spelled, and the dtype.
_EAGER_BOXERS: dict = {}


def _eager_boxer(x: GlobalTensor, sbp):
    """(dst layout, compiled boxer) remembered for an eager ``x.to_global(sbp=sbp)``, or None."""
    value = x._value
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        hit = _EAGER_BOXERS.get((id(x._layout), sbp, getattr(value, "dtype", None)))
    except TypeError:  # an unhashable spelling of the sbp (a list)
        return None
    if hit is None or hit[0] is not x._layout:
        return None
    if _trace.current_tracer() is not None:  # inside jsbp.jit: the compiler handles to_global
        return None
    return hit[1], hit[2]


def _remember_eager_boxer(x: GlobalTensor, sbp, dst: Layout) -> None:
    lay = x._layout
    if dst.placement != lay.placement or dst == lay or math.prod(lay.shape) == 0:
        return
    dtype = x._value.dtype
    try:
        key = (id(lay), sbp, dtype)
        hash(key)
    except TypeError:
        return
    if len(_EAGER_BOXERS) >= 4096:
        _EAGER_BOXERS.clear()
    fn, _ = _same_placement_boxer(lay, dst, np.dtype(dtype))
    _EAGER_BOXERS[key] = (lay, dst, fn)


@functools.lru_cache(maxsize=4096)
def _to_global_nd_cached(sbp, shape, plc):
    return normalise_nd(sbp, shape, plc, op="to_global")


def _to_global_nd(sbp, shape, plc):
    """``normalise_nd`` for ``to_global``, cached: parsing "S(0)" is a third of an eager call's
    Python time. Unhashable spellings (lists) take the uncached path; errors are never cached."""
    try:
        hash(sbp)
    except TypeError:
        return normalise_nd(sbp, shape, plc, op="to_global")
    return _to_global_nd_cached(sbp, shape, plc)


def target_layout(lay: Layout, placement, sbp, op: str) -> Layout:
    """The layout ``to_global(placement, sbp)`` asks for (None keeps the current one)."""
    plc = lay.placement if placement is None else placement
    if not isinstance(plc, Placement):
        raise PlacementError(f"{op}: placement must be a jsbp.placement, got {plc!r}.")
    if sbp is None:
        if plc.ndim != lay.placement.ndim:
            raise SbpError(
                f"{op}: the tensor of {lay.describe()} moves to a {plc.ndim}-d placement {plc}; "
                "its sbp cannot be kept, so pass sbp= with one entry per axis of the new placement."
            )
        return layout_of(plc, lay.nd_sbp, lay.shape)
    nd = (
        _to_global_nd(sbp, lay.shape, plc)
        if op == "to_global"
        else normalise_nd(sbp, lay.shape, plc, op=op)
    )
    return layout_of(plc, nd, lay.shape)


def to_global(x, placement=None, sbp=None, *, grad_sbp=None) -> GlobalTensor:
    """Box ``x`` to ``placement`` / ``sbp``; see ``GlobalTensor.to_global``.

    Inside ``jsbp.jit`` (where values are logical arrays) it annotates the layout of ``x`` instead.
    """
    from ._trace import current_tracer

    if not isinstance(x, GlobalTensor) and current_tracer() is not None:
        return current_tracer().annotate(x, placement, sbp, grad_sbp)
    if (
        not isinstance(x, GlobalTensor)
        and placement is None
        and sbp is not None
        and hasattr(x, "shape")
    ):
        # a layout annotation in code that also runs on one device (no jsbp.jit): nothing to do
        return x
    if not isinstance(x, GlobalTensor):
        if placement is None or sbp is None:
            _check_global(x, "to_global")
        return tensor(x, placement=placement, sbp=sbp)
    lay = x._layout
    dst = target_layout(lay, placement, sbp, "to_global")
    plc = dst.placement
    grad = None
    if grad_sbp is not None:
        grad = layout_of(
            plc, normalise_nd(grad_sbp, lay.shape, plc, op="to_global(grad_sbp=)"), lay.shape
        )
    if dst == lay and grad is None:
        return x
    from ._trace import current_tracer  # the compiler's hook: honour layouts inside jsbp.jit

    tr = current_tracer()
    if tr is not None:
        return tr.to_global(x, dst, grad)
    if not isinstance(
        x._value, jax.core.Tracer
    ):  # eager, nothing to differentiate: skip custom_vjp
        if placement is None and grad_sbp is None:
            _remember_eager_boxer(x, sbp, dst)
        return GlobalTensor(_box_raw(x._value, lay, dst), dst)
    return GlobalTensor(box(x._value, lay, dst, grad), dst)


# -------------------------------------------------------------------------------------------
# factories
# -------------------------------------------------------------------------------------------

_SEED = [0, 0]


def manual_seed(seed: int) -> None:
    """Seed the key used by ``randn`` / ``rand`` when no ``key`` is given."""
    _SEED[0], _SEED[1] = int(seed), 0


def _next_key():
    key = jax.random.fold_in(jax.random.key(_SEED[0]), _SEED[1])
    _SEED[1] += 1
    return key


def _layout_for(shape, placement, sbp, op, dtype=None) -> Layout:
    if not isinstance(placement, Placement):
        raise PlacementError(
            f"{op}: placement must be a jsbp.placement (e.g. jsbp.placement('cpu', [0, 1])), got {placement!r}."
        )
    if sbp is None:
        raise SbpError(f"{op}: pass sbp= (one SBP per placement axis, e.g. sbp.split(0) or 'B').")
    lay = layout_of(
        placement, normalise_nd(sbp, shape, placement, op=op), tuple(int(s) for s in shape)
    )
    if dtype is not None:
        _check_fits(lay, dtype, op)
    return lay


def _memory_limit(placement: Placement) -> int | None:
    """Bytes all devices of ``placement`` can hold together, if known: their allocators' limits,
    else (CPU devices share it) the host's physical memory."""
    try:
        stats = [d.memory_stats() for d in placement.devices.flat]
        if all(s and "bytes_limit" in s for s in stats):
            return sum(int(s["bytes_limit"]) for s in stats)
    except Exception:  # a backend without memory statistics
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_fits(lay: Layout, dtype, op: str) -> None:
    """An ``SbpError`` for a tensor its devices cannot hold, before XLA tries (and aborts the
    process). Stored bytes: the physical array, padding and partial addends included."""
    need = math.prod(lay.physical_shape) * np.dtype(dtype).itemsize
    limit = _memory_limit(lay.placement)
    if limit is not None and need > limit:
        raise SbpError(
            f"{op}: a {np.dtype(dtype).name} tensor of {lay.describe()} needs {need:,} bytes on its devices, more than the {limit:,} they have; use a smaller "
            "shape, a narrower dtype, or split it over more devices."
        )


def _check_int_range(np_arr: np.ndarray, dtype, op: str) -> None:
    """An ``SbpError`` where converting integers to ``dtype`` would wrap (64-bit data with
    ``jax_enable_x64`` off, or an explicit narrower ``dtype=``): JAX would raise or wrap silently."""
    dt = np.dtype(dtype)
    if np_arr.size == 0 or np_arr.dtype.kind not in "biu" or dt.kind not in "iu":
        return
    info = np.iinfo(dt)
    lo, hi = int(np_arr.min()), int(np_arr.max())
    if lo < info.min or hi > info.max:
        raise SbpError(
            f"{op}: the values range over [{lo}, {hi}], which does not fit {dt.name} "
            f"([{info.min}, {info.max}]); pass dtype= a wider type (64-bit types need "
            "jax.config.update('jax_enable_x64', True)) or reduce the values."
        )


def _shape_args(shape, op) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    out = []
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise SbpError(f"{op}: shape entries must be non-negative ints, got {tuple(shape)}.")
        out.append(int(s))
    return tuple(out)


def _from_logical(value, lay: Layout) -> GlobalTensor:
    if isinstance(value, jax.core.Tracer):
        return GlobalTensor(encode(value, lay), lay)
    return GlobalTensor(_encode_jit(lay)(value), lay)


def tensor(data, placement: Placement = None, sbp=None, *, dtype=None) -> GlobalTensor:
    """A global tensor whose logical value is ``data`` (numpy / jax array / nested list / scalar).

    With ``sbp=P`` the value is put on the first device and zeros elsewhere.
    """
    if isinstance(data, GlobalTensor):
        out = data.to_global(placement, sbp)
        return out if dtype is None else out.astype(dtype)
    if isinstance(data, jax.Array) and is_key_dtype(data.dtype) and dtype is None:
        if placement is None and isinstance(
            getattr(data, "sharding", None), jax.sharding.NamedSharding
        ):
            from ._interop import layout_of_array

            placement = layout_of_array(data)[0].placement
        return _key_tensor(data, placement, sbp, "tensor")
    if isinstance(data, jax.Array) and not isinstance(data, jax.core.Tracer):
        if isinstance(data.sharding, jax.sharding.NamedSharding) and (
            placement is None or data.sharding.spec.unreduced
        ):
            return _from_named(data, placement, sbp, dtype)
        arr = data
    elif isinstance(data, jax.core.Tracer):
        arr = data
    else:
        try:
            np_arr = np.asarray(data)
        except OverflowError as e:
            raise SbpError(
                f"tensor: cannot make a tensor from {type(data).__name__} {data!r}: {e}."
            ) from None
        except ValueError:
            ragged = _ragged_at(data)
            if ragged is None:
                raise
            raise SbpError(
                f"tensor: the argument data is a ragged nested {type(data).__name__}: {ragged}, so it has no "
                "rectangular shape. Give data as a nested list whose rows at each depth have one length "
                "(or a numpy / jax array), e.g. [[1, 2], [3, 4]]."
            ) from None
        if np_arr.dtype == object:
            big = [
                v
                for v in np.ravel(np.asarray(data, dtype=object))
                if isinstance(v, int) and abs(v) >= 2**63
            ]
            why = f" ({big[0]} does not fit a 64-bit integer)" if big else ""
            raise SbpError(
                f"tensor: cannot make a tensor from {type(data).__name__} {data!r}{why}."
            )
        target = _canonical_dtype(np_arr.dtype if dtype is None else dtype)
        _check_int_range(np_arr, target, "tensor")
        arr = np_arr.astype(target, copy=False)
    if dtype is not None and isinstance(arr, jax.Array):
        arr = arr.astype(_canonical_dtype(dtype))
    lay = _layout_for(np.shape(arr), placement, sbp, "tensor", arr.dtype)
    if not isinstance(arr, jax.core.Tracer) and not isinstance(arr, jax.Array):
        if lay.is_even and not lay.partial_axes:
            return GlobalTensor(jax.device_put(arr, lay.sharding), lay)
        phys = lay.encode(arr)
        return GlobalTensor(
            jax.make_array_from_callback(
                phys.shape, lay.sharding, lambda i: phys[i], dtype=phys.dtype
            ),
            lay,
        )
    return _from_logical(arr, lay)


def _ragged_at(data, path="data"):
    """Where a nested list stops being rectangular, in words (None where it does not)."""
    if not isinstance(data, (list, tuple)):
        return None
    seqs = [isinstance(x, (list, tuple, np.ndarray)) for x in data]
    if any(seqs) and not all(seqs):
        i, j = seqs.index(True), seqs.index(False)
        return f"{path}[{i}] is a sequence but {path}[{j}] is a scalar"
    if not any(seqs):
        return None
    shapes = [np.shape(x) if isinstance(x, np.ndarray) else (len(x),) for x in data]
    if len({s[0] for s in shapes}) > 1:
        lens = [s[0] for s in shapes]
        j = next(k for k, n in enumerate(lens) if n != lens[0])
        return f"{path}[0] has length {lens[0]} but {path}[{j}] has length {lens[j]}"
    for i, x in enumerate(data):
        found = _ragged_at(x, f"{path}[{i}]") if not isinstance(x, np.ndarray) else None
        if found is not None:
            return found
    return None


def _from_named(arr: jax.Array, placement, sbp, dtype) -> GlobalTensor:
    """``jsbp.tensor(arr)`` of a ``jax.Array`` with a ``NamedSharding``: placement and nd-sbp read
    from the sharding (``unreduced`` is P), built from its shards on the devices (the same buffers
    for even S / B); then boxed to ``placement`` / ``sbp`` where given."""
    from ._interop import layout_of_array, physical_from_array

    lay, _ = layout_of_array(arr)
    if lay.is_even or lay.partial_axes:
        out = GlobalTensor(physical_from_array(arr, lay), lay)
    else:  # JAX's own uneven blocks are not jsbp's balanced ones: re-cut on the devices
        out = _from_logical(arr, lay)
    out = out if placement is None and sbp is None else out.to_global(placement, sbp)
    return out if dtype is None else out.astype(dtype)


@functools.lru_cache(maxsize=1024)
def _filled(lay: Layout, dtype, fill, key):
    """``key``: the fill's ``static_key`` (``0.0 == -0.0`` and ``1 == True`` hash alike)."""

    def make():
        return _encode_raw(jnp.full(lay.shape, fill, dtype), lay)

    return meshless(jax.jit(make, out_shardings=lay.sharding))


def full(shape, value, placement=None, sbp=None, *, dtype=None) -> GlobalTensor:
    """A tensor of ``shape`` filled with ``value``."""
    shape = _shape_args((shape,) if isinstance(shape, (int, np.integer)) else tuple(shape), "full")
    lay = _layout_for(shape, placement, sbp, "full")
    if not (
        isinstance(value, (int, float, complex, np.number, np.bool_))
        or (hasattr(value, "dtype") and np.ndim(value) == 0 and _numeric(value.dtype))
    ):
        raise SbpError(
            f"full: the fill value must be a number or a 0-d numeric array, got {value!r} "
            f"({type(value).__name__}); e.g. jsbp.full((2, 3), 1.5, placement=..., sbp=...)."
        )
    if dtype is None:  # like jnp.full: the value's own dtype, Python scalars as jnp's defaults
        dtype = (
            value.dtype if hasattr(value, "dtype") else jnp.result_type(value)
        )  # (x64: float64, int64)
    dt = _canonical_dtype(dtype)
    _check_fits(lay, dt, "full")
    if math.prod(shape) == 0:
        return GlobalTensor(_empty(lay, dt), lay)
    fill = value.item() if hasattr(value, "item") else value
    return GlobalTensor(_filled(lay, dt, fill, static_key(fill))(), lay)


def zeros(*shape, placement=None, sbp=None, dtype=None) -> GlobalTensor:
    """``jnp.zeros``: float32 by default (float64 under ``jax_enable_x64``)."""
    return full(_shape_args(shape, "zeros"), 0.0, placement, sbp, dtype=dtype)


def ones(*shape, placement=None, sbp=None, dtype=None) -> GlobalTensor:
    """``jnp.ones``: float32 by default (float64 under ``jax_enable_x64``)."""
    return full(_shape_args(shape, "ones"), 1.0, placement, sbp, dtype=dtype)


def arange(*args, placement=None, sbp=None, dtype=None) -> GlobalTensor:
    """``jnp.arange(*args)`` as a global tensor."""
    bad = [
        a
        for a in args
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (int, float, np.number))
    ]
    if not 1 <= len(args) <= 3 or bad:
        raise SbpError(
            f"arange: give 1 to 3 numbers (stop | start, stop | start, stop, step), got {args!r}; "
            "e.g. jsbp.arange(8, placement=..., sbp=...)."
        )
    try:
        value = np.arange(*args)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise SbpError(f"arange{args!r}: {e}; use a non-zero step and a finite range.") from None
    return tensor(value, placement, sbp, dtype=dtype)


@functools.lru_cache(maxsize=1024)
def _random(lay: Layout, kind: str, dtype):
    def make(key):
        fn = jax.random.normal if kind == "normal" else jax.random.uniform
        return _encode_raw(fn(key, lay.shape, dtype), lay)

    return meshless(jax.jit(make, out_shardings=lay.sharding))


def _random_tensor(kind, shape, key, placement, sbp, dtype, op):
    shape = _shape_args(shape, op)
    if dtype is None:  # as jax.random: the default float (float64 under jax_enable_x64)
        dtype = float
    if not jnp.issubdtype(
        _canonical_dtype(dtype), jnp.floating if kind != "normal" else jnp.inexact
    ):
        raise SbpError(
            f"{op}: dtype {np.dtype(dtype).name} is not a floating{' or complex' if kind == 'normal' else ''} "
            "dtype; give e.g. dtype=jnp.float32 (and .astype(...) the result if integers are wanted)."
        )
    lay = _layout_for(shape, placement, sbp, op, _canonical_dtype(dtype))
    if key is None:
        key = _next_key()
    elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        key = jax.random.key(int(key))
    elif not (
        isinstance(key, (jax.Array, np.ndarray))
        and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or key.dtype == np.uint32)
    ):
        raise SbpError(
            f"{op}: key must be an int seed or a JAX PRNG key (jax.random.key(0)), got {key!r} "
            f"({type(key).__name__})."
        )
    if math.prod(shape) == 0:
        return GlobalTensor(_empty(lay, _canonical_dtype(dtype)), lay)
    return GlobalTensor(_random(lay, kind, _canonical_dtype(dtype))(portable_key(key)), lay)


def randn(*shape, key=None, placement=None, sbp=None, dtype=None) -> GlobalTensor:
    """Standard normal values that depend only on ``key`` and ``shape`` (never on the layout);
    ``jax.random.normal``'s: float32 by default (float64 under ``jax_enable_x64``)."""
    return _random_tensor("normal", shape, key, placement, sbp, dtype, "randn")


def rand(*shape, key=None, placement=None, sbp=None, dtype=None) -> GlobalTensor:
    """Uniform [0, 1) values that depend only on ``key`` and ``shape``; ``jax.random.uniform``'s:
    float32 by default (float64 under ``jax_enable_x64``)."""
    return _random_tensor("uniform", shape, key, placement, sbp, dtype, "rand")


def from_local(locals_: Sequence, placement: Placement = None, sbp=None) -> GlobalTensor:
    """A global tensor from one local array per device of ``placement`` that this process owns.

    The logical shape is inferred from the local shapes along split dims. With ``B`` the first
    device's value is the truth; with ``P`` each local is one addend.
    """
    if not isinstance(placement, Placement):
        raise PlacementError(f"from_local: placement must be a jsbp.placement, got {placement!r}.")
    nd_raw = _sbp.parse_nd(sbp, placement.ndim) if sbp is not None else None
    if nd_raw is None:
        raise SbpError("from_local: pass sbp= (one SBP per placement axis).")
    devices = list(placement.devices.reshape(-1))
    coords = list(np.ndindex(*placement.hierarchy))
    local_idx = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if isinstance(locals_, (str, bytes)) or not isinstance(
        locals_, (Sequence, np.ndarray, jax.Array)
    ):
        raise SbpError(
            f"from_local: locals must be a list of arrays, one per device of {placement} this process "
            f"owns; got {type(locals_).__name__} {locals_!r:.60}."
        )
    locals_ = list(locals_)
    if len(locals_) != len(local_idx):
        raise SbpError(
            f"from_local: got {len(locals_)} local arrays but this process owns {len(local_idx)} "
            f"device(s) of {placement}; give one array per owned device, in placement order."
        )
    arrs = [np.asarray(a) if not isinstance(a, jax.Array) else a for a in locals_]
    for a, raw in zip(arrs, locals_):
        if not _numeric(a.dtype):  # strings, objects, None
            raise SbpError(
                f"from_local: local {raw!r:.60} ({type(raw).__name__}) is not a numeric array; give "
                f"one numpy / jax array (or nested list of numbers) per owned device of {placement}."
            )
    shapes = {local_idx[i]: tuple(np.shape(a)) for i, a in enumerate(arrs)}
    dtypes = {np.dtype(a.dtype) for a in arrs}
    if len(dtypes) > 1:
        raise SbpError(
            f"from_local: local arrays on {placement} have different dtypes {sorted(str(d) for d in dtypes)}; "
            "all locals must share one dtype."
        )
    if jax.process_count() > 1:
        # collective on every process (even one owning no device of the placement, which learns
        # the shapes and dtype here): the others' local shapes come over JAX's key-value store
        gather_local_meta = _hooks.multiprocess_fn("gather_local_meta")
        shapes, common = gather_local_meta(shapes, dtypes.pop() if dtypes else None, len(devices))
        dtypes = {common}
    ranks_ = {len(s) for s in shapes.values()}
    if len(ranks_) != 1:
        raise SbpError(
            f"from_local: local arrays have different ranks {sorted(ranks_)} on {placement}."
        )
    rank = ranks_.pop()
    nd = normalise_nd(nd_raw, (0,) * rank, placement, op="from_local")
    # infer the logical shape: along a split dim, sum the blocks of devices that differ only there
    logical = []
    for d in range(rank):
        sp = [a for a, x in enumerate(nd) if x.is_split and x.dim == d]
        if not sp:
            logical.append(shapes[0][d])
            continue
        tot = 0
        for i, c in enumerate(coords):
            if all(c[a] == 0 for a in range(placement.ndim) if a not in sp):
                tot += shapes[i][d]
        logical.append(tot)
    lay = layout_of(placement, nd, tuple(logical))
    for i, c in enumerate(coords):
        want = tuple(s for _, s in lay.block(c))
        if shapes[i] != want:
            raise SbpError(
                f"from_local: device {placement.ranks.reshape(-1)[i]} (coordinate {c}) holds shape "
                f"{shapes[i]}, but a logical tensor of shape {tuple(logical)} with sbp {_sbp.nd_str(nd)} on "
                f"{placement} gives it {want} (balanced split). Fix the local shapes or the sbp."
            )
    dtype = dtypes.pop()
    # B axes: device with coordinate 0 on every broadcast axis is the truth
    b_axes = [a for a, x in enumerate(nd) if x.is_broadcast]
    by_coord = {coords[j]: arrs[n] for n, j in enumerate(local_idx)}
    singles = []
    for n, j in enumerate(local_idx):
        c = coords[j]
        src_c = tuple(0 if a in b_axes else c[a] for a in range(placement.ndim))
        a = by_coord.get(src_c, arrs[n])
        a = jnp.asarray(a)
        pad = [(0, L - s) for L, s in zip(lay.local_shape, a.shape)]
        if any(p for _, p in pad):
            a = jnp.pad(a, pad)
        if lay.partial_axes:
            a = a[None]
        singles.append(jax.device_put(a, devices[j]))
    # a process owning none of the devices has no singles to take the dtype from
    phys = jax.make_array_from_single_device_arrays(
        lay.physical_shape,
        lay.sharding,
        singles,
        dtype=None if singles else _canonical_dtype(dtype),
    )
    return GlobalTensor(phys, lay)
