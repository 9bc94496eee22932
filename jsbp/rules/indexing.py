"""gather / scatter: index-batch splits, split offset dims, and the vocab-parallel embedding
(a table split on the gathered dim gives P; its gradient scatter-adds into the split table)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._boxing import _device_index
from .._sbp import Split
from ._common import B, P, mask_padding
from ._registry import register_sbp_rule


def _gather_sigs(ctx):
    dn = ctx.params["dimension_numbers"]
    op_shape, idx_shape = ctx.in_shapes
    out_rank = len(ctx.out_shapes[0])
    slice_sizes = ctx.params["slice_sizes"]
    offset_dims = tuple(dn.offset_dims)
    batch_out = [d for d in range(out_rank) if d not in offset_dims]
    if not tuple(getattr(dn, "operand_batching_dims", ())):
        # indices batch dims (all but the last, the index vector) -> output batch dims
        for i in range(len(idx_shape) - 1):
            yield (B, Split(i)), (Split(batch_out[i]),)
        # operand dims taken whole (not indexed, not collapsed) -> output offset dims
        kept = [d for d in range(len(op_shape)) if d not in dn.collapsed_slice_dims]
        for j, d in enumerate(kept):
            if d not in dn.start_index_map and slice_sizes[d] == op_shape[d]:
                yield (Split(d), B), (Split(offset_dims[j]),)
        # vocab parallel: table split on the single gathered, collapsed dim -> P
        if len(dn.start_index_map) == 1 and dn.start_index_map[0] in dn.collapsed_slice_dims:
            yield (Split(dn.start_index_map[0]), B), (P,)
    yield (B, B), (B,)
    yield (P, B), (P,)


def _block_offsets(lay, d):
    offs = np.array([blk[d][0] for blk in lay.blocks], dtype=np.int64)
    sizes = lay.valid_sizes(d)
    dev = _device_index(lay.placement)
    return jnp.asarray(offs, jnp.int32)[dev], jnp.asarray(sizes, jnp.int32)[dev]


def _gather_local(st, ins):
    x, idx = ins
    params = dict(st.eqn.params)
    dn = params["dimension_numbers"]
    lay = st.in_layouts[0]
    sizes = list(params["slice_sizes"])
    for d, sp in enumerate(lay.splitters):
        if sp and d not in dn.start_index_map:
            sizes[d] = lay.local_shape[d]
    params["slice_sizes"] = tuple(sizes)
    vocab = [d for d in dn.start_index_map if lay.splitters[d]]
    if not vocab:
        return st.eqn.primitive.bind(x, idx, **params)
    (d,) = vocab
    off, n = _block_offsets(lay, d)
    local = idx - off.astype(idx.dtype)
    inside = (local >= 0) & (local < n.astype(idx.dtype))
    out = st.eqn.primitive.bind(x, jnp.clip(local, 0, max(lay.local_shape[d] - 1, 0)), **params)
    keep = inside[..., 0]
    # out dims: batch dims follow idx batch dims, offset dims appended where dn.offset_dims says
    batch_out = [i for i in range(out.ndim) if i not in dn.offset_dims]
    shape = [1] * out.ndim
    for i, bo in enumerate(batch_out):
        shape[bo] = keep.shape[i]
    return jnp.where(keep.reshape(shape), out, jnp.zeros((), out.dtype))


register_sbp_rule("gather", local=_gather_local)(_gather_sigs)


def _scatter_sigs(ctx):
    dn = ctx.params["dimension_numbers"]
    op_shape, idx_shape, upd_shape = ctx.in_shapes
    upd_window = tuple(dn.update_window_dims)
    upd_batch = [d for d in range(len(upd_shape)) if d not in upd_window]
    name = ctx.primitive.name
    additive = name == "scatter-add" or name == "scatter_add"
    if not tuple(getattr(dn, "operand_batching_dims", ())):
        if additive:
            # each device scatters its own updates: operand P (zeros), result P
            for i, ud in enumerate(upd_batch):
                yield (P, Split(i), Split(ud)), (P,)
            # vocab-parallel gradient: the operand split on the single scattered dim
            if len(dn.scatter_dims_to_operand_dims) == 1 and dn.scatter_dims_to_operand_dims[0] in dn.inserted_window_dims:
                d = dn.scatter_dims_to_operand_dims[0]
                yield (Split(d), B, B), (Split(d),)
            yield (P, B, P), (P,)
        # operand dims that are window dims taken whole can stay split with the update's window dim
        kept = [d for d in range(len(op_shape)) if d not in dn.inserted_window_dims]
        for j, d in enumerate(kept):
            if d not in dn.scatter_dims_to_operand_dims and upd_shape[upd_window[j]] == op_shape[d]:
                yield (Split(d), B, Split(upd_window[j])), (Split(d),)
    yield (B, B, B), (B,)


def _scatter_local(st, ins):
    x, idx, upd = ins
    params = dict(st.eqn.params)
    dn = params["dimension_numbers"]
    lay = st.in_layouts[0]
    # padded (garbage) update rows of an uneven split must not reach valid operand rows
    upd_lay = st.in_layouts[2]
    upd_batch = [d for d in range(upd.ndim) if d not in dn.update_window_dims]
    if any(upd_lay.splitters[d] for d in upd_batch):
        upd = mask_padding(upd, upd_lay, upd_batch, 0)
        idx_lay = st.in_layouts[1]
        big = jnp.iinfo(idx.dtype).max
        idx = mask_padding(idx, idx_lay, range(idx.ndim - 1), big)
        params["mode"] = lax.GatherScatterMode.FILL_OR_DROP
    vocab = [d for d in dn.scatter_dims_to_operand_dims if lay.splitters[d]]
    if not vocab:
        return st.eqn.primitive.bind(x, idx, upd, **params)
    (d,) = vocab
    off, n = _block_offsets(lay, d)
    local = idx - off.astype(idx.dtype)
    inside = (local >= 0) & (local < n.astype(idx.dtype))
    # out-of-range rows are sent past the end and dropped
    big = jnp.asarray(lay.local_shape[d] + 1, idx.dtype)
    local = jnp.where(inside, local, big)
    params["mode"] = lax.GatherScatterMode.FILL_OR_DROP
    return st.eqn.primitive.bind(x, local, upd, **params)


for _name in ("scatter-add", "scatter_add", "scatter", "scatter-mul", "scatter_mul", "scatter-min",
              "scatter_min", "scatter-max", "scatter_max"):
    register_sbp_rule(_name, local=_scatter_local)(_scatter_sigs)
