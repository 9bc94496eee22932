"""Moving device blocks between placements whose devices belong to different processes.

JAX moves an array to a sharding over the *same* device set with a compiled reshard, but between
different device sets of different processes it needs cross-host transfer servers, which CPU
backends (and many GPU setups) do not start. jsbp does not need them: it compiles one
``shard_map`` over the *union* of both device sets, where each move is a ``collective-permute``
(``lax.ppermute``) on that union mesh, and then views the received blocks as an array on the
destination sharding. Every process that owns a device of the union runs it; the others skip it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["send_blocks", "nearest_sources", "one_device_per_process", "spans_all_processes"]

_AXIS = "jsbp_union"


def _device_map(type_: str) -> dict[int, jax.Device]:
    return {d.id: d for d in jax.devices(type_)}


@functools.lru_cache(maxsize=256)
def _permute_fn(
    union_ids: tuple[int, ...], type_: str, rounds: tuple[tuple[tuple[int, int], ...], ...]
):
    devs = _device_map(type_)
    mesh = Mesh(np.array([devs[i] for i in union_ids]), (_AXIS,))

    def body(x):
        me = lax.axis_index(_AXIS)
        out = x
        for perm in rounds:
            got = lax.ppermute(x, _AXIS, perm=list(perm))
            dests = jnp.asarray([d for _, d in perm], jnp.int32)
            out = jnp.where(jnp.any(dests == me), got, out)
        return out

    spec = PartitionSpec(_AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)
    return jax.jit(fn), NamedSharding(mesh, spec)


def _rounds(pairs: list[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Split (source, destination) pairs into permutations: each source sends once per round."""
    rounds: list[list[tuple[int, int]]] = []
    used: list[set[int]] = []
    for s, d in pairs:
        for r, u in zip(rounds, used):
            if s not in u:
                r.append((s, d))
                u.add(s)
                break
        else:
            rounds.append([(s, d)])
            used.append({s})
    return tuple(tuple(r) for r in rounds)


def send_blocks(
    arr: jax.Array, sources: list, sharding: NamedSharding, shape: tuple[int, ...]
) -> jax.Array:
    """A new array of global ``shape`` on ``sharding`` whose block on the i-th device of the
    sharding's mesh (row-major) is ``arr``'s block on device ``sources[i]``.

    Every block of ``arr`` and of the result has the same shape. Collective over the processes
    that own a device of ``arr`` or of ``sharding``.
    """
    dst = list(sharding.mesh.devices.reshape(-1))
    dtype = arr.dtype
    block = sharding.shard_shape(shape)
    src_devs = (
        list(arr.sharding.mesh.devices.reshape(-1))
        if hasattr(arr.sharding, "mesh")
        else list(arr.sharding.device_set)
    )
    union = list(dict.fromkeys(src_devs + dst))
    pos = {d: i for i, d in enumerate(union)}
    pairs = [(pos[s], pos[d]) for s, d in zip(sources, dst) if s != d]
    me = jax.process_index()
    local = {s.device: s.data for s in arr.addressable_shards}
    if pairs and any(d.process_index == me for d in union):
        fn, u_sharding = _permute_fn(tuple(d.id for d in union), union[0].platform, _rounds(pairs))
        pieces = []
        for d in union:
            if d.process_index != me:
                continue
            b = local.get(d)
            if b is None:
                b = jax.device_put(jnp.zeros(block, dtype), d)
            pieces.append(b.reshape((1,) + tuple(block)))
        u_arr = jax.make_array_from_single_device_arrays(
            (len(union),) + tuple(block), u_sharding, pieces
        )
        local = {s.device: s.data[0] for s in fn(u_arr).addressable_shards}
    blocks = [local[d] for d in dst if d.process_index == me]
    return jax.make_array_from_single_device_arrays(shape, sharding, blocks, dtype=dtype)


def spans_all_processes(devices) -> bool:
    """True when every process owns at least one of ``devices``."""
    return {d.process_index for d in devices} == set(range(jax.process_count()))


def one_device_per_process(type_: str):
    """A 1-d jsbp placement of the lowest-id ``type_`` device of every process (process order)."""
    from .._placement import placement

    first: dict[int, int] = {}
    for d in jax.devices(type_):
        first[d.process_index] = min(first.get(d.process_index, d.id), d.id)
    return placement(type_, [first[p] for p in sorted(first)])


def nearest_sources(src_placement, dst_placement) -> list:
    """For every device of ``dst_placement`` (row-major), a device of ``src_placement`` to copy a
    replicated value from: itself if it is in both, else one of its own process, else the source
    devices in turn (so the copies spread over them)."""
    src = list(src_placement.devices.flat)
    in_src = set(src)
    by_process: dict[int, list] = {}
    for d in src:
        by_process.setdefault(d.process_index, []).append(d)
    out, turn = [], 0
    local_turn: dict[int, int] = {}
    for d in dst_placement.devices.flat:
        if d in in_src:
            out.append(d)
        elif d.process_index in by_process:
            mine = by_process[d.process_index]
            t = local_turn.get(d.process_index, 0)
            local_turn[d.process_index] = t + 1
            out.append(mine[t % len(mine)])
        else:
            out.append(src[turn % len(src)])
            turn += 1
    return out
