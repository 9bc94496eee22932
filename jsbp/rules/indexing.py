"""gather / scatter: index-batch splits, split offset dims, and the vocab-parallel embedding
(a table split on the gathered dim gives P; its gradient scatter-adds into the split table)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from .._boxing import _device_index
from .._sbp import Split
from ._common import B, P, valid_mask
from ._registry import register_sbp_rule


def _gather_sigs(ctx):
    dn = ctx.params["dimension_numbers"]
    op_shape, idx_shape = ctx.in_shapes
    out_rank = len(ctx.out_shapes[0])
    slice_sizes = ctx.params["slice_sizes"]
    offset_dims = tuple(dn.offset_dims)
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
    batch_out = [d for d in range(out_rank) if d not in offset_dims]
    # indices batch dims (all but the last, the index vector) -> output batch dims; a batching
    # dim (take_along_axis) pairs with an operand dim, which is split with it
    for i in range(len(idx_shape) - 1):
        if i in idx_batching:
            yield (Split(op_batching[idx_batching.index(i)]), Split(i)), (Split(batch_out[i]),)
        else:
            yield (B, Split(i)), (Split(batch_out[i]),)
    # operand dims taken whole (not indexed, collapsed or batching) -> output offset dims
    kept = [
        d for d in range(len(op_shape)) if d not in dn.collapsed_slice_dims and d not in op_batching
    ]
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


def _localise(idx, lay, d, mode, n_global):
    """Global row indices -> this device's local rows along dim ``d``, and whether each is here.

    CLIP semantics are applied to the global index first, so an out-of-range index lands on the
    device that holds the edge row, exactly as on one device."""
    if mode == lax.GatherScatterMode.CLIP:
        idx = jnp.clip(idx, 0, max(n_global - 1, 0))
    off, n = _block_offsets(lay, d)
    local = idx - off.astype(idx.dtype)
    inside = (local >= 0) & (local < n.astype(idx.dtype))
    return local, inside, off


def _first_addend(lay):
    """True on the devices that hold addend 0 of a partial layout (all partial-axis coords 0)."""
    first = jnp.asarray(True)
    for a in lay.partial_axes:
        first = first & (lax.axis_index(lay.placement.axis_names[a]) == 0)
    return first


def _gather_local(st, ins):
    x, idx = ins
    params = dict(st.eqn.params)
    dn = params["dimension_numbers"]
    lay = st.in_layouts[0]
    mode = params["mode"]
    sizes = list(params["slice_sizes"])
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    for d, sp in enumerate(lay.splitters):
        if sp and d not in dn.start_index_map and d not in batching:
            sizes[d] = lay.local_shape[d]
    params["slice_sizes"] = tuple(sizes)
    vocab = [d for d in dn.start_index_map if lay.splitters[d]]
    fill_once = mode == lax.GatherScatterMode.FILL_OR_DROP and (vocab or lay.partial_axes)
    if not vocab and not fill_once:
        return st.eqn.primitive.bind(x, idx, **params)
    owner = _first_addend(lay)  # the one device (per output block) that contributes the fill value
    if vocab:
        # vocab parallel: each device answers the rows it holds with their value, all others
        # with 0; the sum over devices (P) is the gathered row
        (d,) = vocab
        local, inside, off = _localise(idx, lay, d, mode, lay.shape[d])
        params["mode"] = lax.GatherScatterMode.CLIP
        out = st.eqn.primitive.bind(x, jnp.clip(local, 0, max(lay.local_shape[d] - 1, 0)), **params)
        keep = inside[..., 0]
        owner = owner & (off == 0)
    else:
        out = st.eqn.primitive.bind(x, idx, **params)
        keep = None
    batch_out = [i for i in range(out.ndim) if i not in dn.offset_dims]
    shape = [1] * out.ndim
    for i, bo in enumerate(batch_out):
        shape[bo] = idx.shape[i]
    if keep is not None:
        out = jnp.where(keep.reshape(shape), out, jnp.zeros((), out.dtype))
    if fill_once:
        # an index outside the whole operand gives the fill value: one addend of P carries it
        slice_sizes = st.eqn.params["slice_sizes"]
        oob = jnp.zeros(idx.shape[:-1], bool)
        for k, od in enumerate(dn.start_index_map):
            g = idx[..., k]
            oob = oob | (g < 0) | (g > lay.shape[od] - slice_sizes[od])
        fill = jnp.asarray(params["fill_value"], out.dtype)
        out = jnp.where(oob.reshape(shape), jnp.where(owner, fill, jnp.zeros((), out.dtype)), out)
    return out


register_sbp_rule("gather", local=_gather_local)(_gather_sigs)


_ADDITIVE = ("scatter-add", "scatter-sub")


def _scatter_sigs(ctx):
    dn = ctx.params["dimension_numbers"]
    op_shape, idx_shape, upd_shape = ctx.in_shapes
    upd_window = tuple(dn.update_window_dims)
    upd_batch = [d for d in range(len(upd_shape)) if d not in upd_window]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    additive = ctx.primitive.name in _ADDITIVE
    for i, ud in enumerate(upd_batch):
        if i in idx_batching:
            # a batching dim (take_along_axis' gradient): operand, indices and updates split together
            od = op_batching[idx_batching.index(i)]
            yield (Split(od), Split(i), Split(ud)), (Split(od),)
        elif additive:
            # each device scatters its own updates into its own addend of the operand: P
            yield (P, Split(i), Split(ud)), (P,)
    if additive:
        # scatter-add is linear in (operand, updates) together
        yield (P, B, P), (P,)
    # operand split on the single scattered dim (the vocab-parallel gradient): every device
    # applies the updates that land in its rows
    if (
        len(dn.scatter_dims_to_operand_dims) == 1
        and dn.scatter_dims_to_operand_dims[0] in dn.inserted_window_dims
    ):
        d = dn.scatter_dims_to_operand_dims[0]
        yield (Split(d), B, B), (Split(d),)
    # operand dims that are window dims taken whole stay split with the update's window dim
    kept = [
        d for d in range(len(op_shape)) if d not in dn.inserted_window_dims and d not in op_batching
    ]
    for j, d in enumerate(kept):
        if d not in dn.scatter_dims_to_operand_dims and upd_shape[upd_window[j]] == op_shape[d]:
            yield (Split(d), B, Split(upd_window[j])), (Split(d),)
    yield (B, B, B), (B,)


def _clip_global(idx, eqn):
    """CLIP semantics on the global indices (before they are localised or dropped)."""
    dn = eqn.params["dimension_numbers"]
    op_shape = eqn.invars[0].aval.shape
    upd_shape = eqn.invars[2].aval.shape
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    kept = [
        d for d in range(len(op_shape)) if d not in dn.inserted_window_dims and d not in batching
    ]
    window = {d: upd_shape[w] for d, w in zip(kept, dn.update_window_dims)}
    cols = [
        jnp.clip(idx[..., k], 0, max(op_shape[od] - window.get(od, 1), 0))
        for k, od in enumerate(dn.scatter_dims_to_operand_dims)
    ]
    return jnp.stack(cols, axis=-1).astype(idx.dtype)


def _scatter_local(st, ins):
    x, idx, upd = ins
    params = dict(st.eqn.params)
    dn = params["dimension_numbers"]
    lay = st.in_layouts[0]
    drop = None  # index positions whose update must not be applied here
    vocab = [d for d in dn.scatter_dims_to_operand_dims if lay.splitters[d]]
    ilay = st.in_layouts[1]
    pad_mask = valid_mask(ilay, range(idx.ndim - 1), idx.ndim)
    if not vocab and pad_mask is None:
        return st.eqn.primitive.bind(x, idx, upd, **params)
    if params["mode"] == lax.GatherScatterMode.CLIP:
        idx = _clip_global(idx, st.eqn)
    if vocab:
        (d,) = vocab
        k = list(dn.scatter_dims_to_operand_dims).index(d)
        local, inside, _ = _localise(idx[..., k], lay, d, None, lay.shape[d])
        idx = idx.at[..., k].set(local)
        drop = ~inside
    # indices split with padding: the padded rows carry garbage updates; drop them
    if pad_mask is not None:
        pad = ~pad_mask[..., 0]
        drop = pad if drop is None else (drop | pad)
    big = jnp.asarray(max(x.shape, default=0) + 1, idx.dtype)
    idx = jnp.where(drop[..., None], big, idx)
    params["mode"] = lax.GatherScatterMode.FILL_OR_DROP
    return st.eqn.primitive.bind(x, idx, upd, **params)


for _name in ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max"):
    register_sbp_rule(_name, local=_scatter_local)(_scatter_sigs)
