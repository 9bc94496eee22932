"""Put NNX objects (models, ``nnx.Optimizer``) on a placement and take them off again.

``shard`` returns ordinary NNX objects whose ``Variable`` values are ``GlobalTensor`` s laid out
by a ``Strategy``; ``gather`` returns ordinary NNX objects holding plain logical ``jax.Array`` s
(on the default device), e.g. for evaluation or saving. ``layouts`` / ``describe`` /
``local_nbytes`` report what each device holds.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from .. import _sbp
from .._errors import SbpError
from .._tensor import GlobalTensor, is_key_dtype, tensor
from ._strategy import (
    Strategy,
    _is_array,
    _is_var,
    _shape,
    _value,
    derived_sbp,
    leaf_layouts,
    path_str,
)

__all__ = [
    "shard",
    "gather",
    "layouts",
    "describe",
    "local_nbytes",
    "leaf_layouts",
    "path_str",
    "derived_sbp",
]


def _replace(var, value):
    """``var`` holding ``value`` (a plain array leaf is replaced by ``value`` itself)."""
    return var.replace(value) if _is_var(var) else value


def _put(value, placement, nd):
    if not _is_array(value):  # a pytree of arrays (or none) in one Variable
        return jax.tree.map(lambda x: _put(x, placement, nd), value)
    if isinstance(value, GlobalTensor):
        return value.to_global(placement=placement, sbp=nd)
    return tensor(value, placement=placement, sbp=nd)  # a typed PRNG key array becomes B


def _split(tree):
    if isinstance(tree, nnx.State):
        return None, tree
    return nnx.split(tree)


def _join(graphdef, state):
    return state if graphdef is None else nnx.merge(graphdef, state)


def shard(tree, strategy: Strategy):
    """Lay ``tree`` (an NNX module, an ``nnx.Optimizer``, a tuple of them, or an ``nnx.State``)
    out on ``strategy.placement``; returns the same kind of object with ``GlobalTensor`` values.

    Shard a model and its optimizer together — ``model, opt = shard((model, opt), strategy)`` —
    so that shared references are kept and moments find their parameters.
    """
    if not isinstance(strategy, Strategy):
        raise SbpError(f"shard: strategy must be a jsbp.flax.Strategy, got {strategy!r}.")
    graphdef, state = _split(tree)
    flat = list(nnx.to_flat_state(state))
    lays = leaf_layouts(flat, strategy)
    plc = strategy.placement
    # a plain array a module holds (not a Variable) stays a plain array: NNX would split a
    # GlobalTensor attribute as a pytree node; inside a step it is a constant, B
    new = [
        (path, var.replace(_put(_value(var), plc, lays[path].stored)) if _is_var(var) else var)
        for path, var in flat
    ]
    return _join(graphdef, nnx.from_flat_state(new))


def gather(tree):
    """The logical values of a sharded NNX object as an ordinary one (plain ``jax.Array`` s)."""
    graphdef, state = _split(tree)
    flat = list(nnx.to_flat_state(state))
    new = []
    for path, var in flat:
        new.append((path, _replace(var, jax.tree.map(_plain, _value(var), is_leaf=_is_global))))
    return _join(graphdef, nnx.from_flat_state(new))


def _is_global(x) -> bool:
    """Whether ``x`` is a global tensor (``is_leaf`` for walking a state with them)."""
    return isinstance(x, GlobalTensor)


def _plain(v):
    """A global tensor as a plain array (a key array as the host's), anything else as it is."""
    if isinstance(v, GlobalTensor):
        return v.numpy() if is_key_dtype(v.dtype) else jax.numpy.asarray(v.numpy())
    return v


def _flat_globals(tree):
    """``(path, array)`` of every leaf; a Variable holding a pytree gives one per leaf."""
    _, state = _split(tree)
    out = []
    for path, var in nnx.to_flat_state(state):
        v = _value(var)
        if _is_array(v):
            out.append((path, v))
            continue
        for kp, leaf in jax.tree_util.tree_flatten_with_path(v, is_leaf=_is_global)[0]:
            out.append((path + tuple(getattr(k, "idx", getattr(k, "key", k)) for k in kp), leaf))
    return out


def layouts(tree) -> dict[str, str]:
    """``{path: nd-sbp}`` of every ``GlobalTensor`` leaf (``'B'`` style strings)."""
    return {
        path_str(p): _sbp.nd_str(v.sbp)
        for p, v in _flat_globals(tree)
        if isinstance(v, GlobalTensor)
    }


def describe(tree) -> str:
    """A table: path, logical shape, nd-sbp, local shape on the first device."""
    rows = []
    for p, v in _flat_globals(tree):
        if isinstance(v, GlobalTensor):
            lay = v.layout
            rows.append((path_str(p), str(v.shape), _sbp.nd_str(v.sbp), str(lay.local_shape)))
        else:
            rows.append((path_str(p), str(_shape(v)), "(plain)", ""))
    if not rows:
        return "(no state)"
    w = [max(len(r[i]) for r in rows + [("path", "shape", "sbp", "local")]) for i in range(4)]
    head = f"{'path':<{w[0]}}  {'shape':<{w[1]}}  {'sbp':<{w[2]}}  local"
    lines = [head, "-" * len(head)]
    lines += [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def local_nbytes(tree, *, include_scalars: bool = True) -> list[int]:
    """Bytes each device of the placement holds for ``tree`` (from ``to_local`` shapes, padding
    excluded), in placement order."""
    totals: list[int] | None = None
    for _, v in _flat_globals(tree):
        if not isinstance(v, GlobalTensor):
            continue
        if not include_scalars and not v.shape:
            continue
        item = v.dtype.itemsize if is_key_dtype(v.dtype) else np.dtype(v.dtype).itemsize
        sizes = [int(np.prod(x.shape)) * item for x in v.to_local()]
        totals = sizes if totals is None else [a + b for a, b in zip(totals, sizes)]
    return totals or []
