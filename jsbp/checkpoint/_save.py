"""``save``: write a pytree of global tensors by logical value, atomically.

The sequence (all processes call ``save`` with the same tree)::

    <path>.jsbp-lock                process 0 takes the save lock (see ``_lock``): a second
                                    save of the same path raises CheckpointError at once
    <path>.jsbp-partial/            created empty by process 0
    <path>.jsbp-partial/state/      orbax writes the data; every process its own shards
    <path>.jsbp-partial/jsbp_manifest.json
                                    process 0 hashes every file, then writes the commit record
    <path>                          process 0 renames the finished directory into place

A save killed at any point before the last rename leaves ``<path>`` as it was (the previous
checkpoint, or nothing) and a ``.jsbp-partial`` directory without a commit record, which
``load`` refuses with a clear message. With ``overwrite=True`` the old checkpoint is first moved
to ``<path>.jsbp-old`` and deleted only after the new one is in place; a save killed between the
two renames is repaired by the next ``save`` or ``load`` of that path. The lock is released
after the last rename; a lock left by a killed save is taken over by the next one.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from .. import _sbp
from .._layout import layout_of
from .._tensor import GlobalTensor, is_key_dtype
from ..distributed._heartbeat import activity
from . import _backend, _lock, _manifest, _sync
from ._errors import CheckpointError
from ._storage import placement_to_json, storage_layout

__all__ = ["save"]

PAUSE_ENV = "JSBP_CHECKPOINT_TEST_PAUSE"
"""Test hook: ``<point>:<sentinel file>``. When set, ``save`` touches the sentinel file at
``<point>`` (``locked``: the save lock is taken, nothing written yet; ``before_commit``: data
written, no commit record yet; ``between_renames``: an ``overwrite=True`` save has moved the old
checkpoint aside) and then sleeps until it is killed (``<point>:<sentinel>:<seconds>``: sleeps that
long and goes on).
Used by the tests that kill a save half way; never set it otherwise."""


def _pause_point(point: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    if not spec or spec.split(":", 1)[0] != point:
        return
    _, sentinel, *seconds = spec.split(":")
    with open(sentinel, "w") as f:
        f.write(str(os.getpid()))
    if seconds:  # ``<point>:<sentinel>:<seconds>``: hold on that long, then go on
        time.sleep(float(seconds[0]))
        return
    while True:  # pragma: no cover - the test kills us here
        time.sleep(1)


def is_leaf(x) -> bool:
    return isinstance(x, GlobalTensor)


_UNSUPPORTED = (
    "save: the leaf at {path} is a {type} ({value}); a checkpoint holds global tensors, jax / numpy "
    "arrays and Python bool / int / float scalars. Convert it, or keep it out of the saved tree."
)


def _key_data(leaf):
    """A typed PRNG key array (global or jax) as its key data (``uint32``, the impl's trailing
    dims added) and the impl's name; ``None`` for any other leaf. Keys are saved as their data."""
    if not isinstance(leaf, (GlobalTensor, jax.Array)) or not is_key_dtype(leaf.dtype):
        return None
    if isinstance(leaf, GlobalTensor):
        key = leaf.to_global(sbp=(_sbp.broadcast,) * leaf.placement.ndim).physical
        data = jax.random.key_data(key)
        plc = leaf.placement
        return GlobalTensor(data, layout_of(plc, (_sbp.broadcast,) * plc.ndim, tuple(data.shape))), str(
            jax.random.key_impl(key)
        )
    return jax.random.key_data(leaf), str(jax.random.key_impl(leaf))


def _entry(i: int, kp, leaf) -> tuple[dict, object | None]:
    """The manifest entry of one leaf and the array to hand to orbax (or None)."""
    keyed = None if isinstance(leaf, jax.core.Tracer) else _key_data(leaf)
    if keyed is not None:
        e, arr = _entry(i, kp, keyed[0])
        e["prng_impl"] = keyed[1]  # load wraps the data again with this impl
        return e, arr
    path = keystr(kp) or "the root (the tree is a single leaf)"
    e = {"path": keystr(kp), "keys": [_manifest.encode_key(k) for k in kp], "name": f"leaf_{i:05d}"}
    if isinstance(leaf, GlobalTensor):
        if isinstance(leaf.physical, jax.core.Tracer):
            raise CheckpointError(
                f"save: the global tensor at {path} is a tracer; save concrete values, outside "
                "jax.jit / jax.grad."
            )
        lay = leaf.layout
        e.update(
            kind="global",
            shape=list(lay.shape),
            dtype=np.dtype(leaf.dtype).name,
            placement=placement_to_json(lay.placement),
            sbp=_sbp.nd_str(lay.nd_sbp),
        )
        if leaf.size == 0:
            return e, None
        st = storage_layout(lay)
        e["stored_sbp"] = _sbp.nd_str(st.nd_sbp)
        arr = leaf.to_global(sbp=st.nd_sbp).physical
        assert tuple(arr.shape) == lay.shape, (arr.shape, lay)
        return e, arr
    if isinstance(leaf, jax.Array):
        if isinstance(leaf, jax.core.Tracer):
            raise CheckpointError(f"save: the leaf at {path} is a tracer; save concrete values.")
        e.update(kind="jax", shape=list(leaf.shape), dtype=np.dtype(leaf.dtype).name)
        return e, (leaf if leaf.size else None)
    if isinstance(leaf, (np.ndarray, np.generic)):
        arr = np.asarray(leaf)
        if arr.dtype == object:
            raise CheckpointError(
                _UNSUPPORTED.format(
                    path=path, type="numpy object array", value=f"shape {arr.shape}"
                )
            )
        e.update(
            kind="numpy",
            shape=list(arr.shape),
            dtype=arr.dtype.name,
            numpy_scalar=isinstance(leaf, np.generic),
        )
        return e, (arr if arr.size else None)
    if isinstance(leaf, (bool, int, float)):
        e.update(kind="scalar", value=leaf, pytype=type(leaf).__name__)
        return e, None
    raise CheckpointError(
        _UNSUPPORTED.format(path=path, type=type(leaf).__name__, value=repr(leaf)[:80])
    )


def save(path, tree, *, overwrite: bool = False) -> str:
    """Save ``tree`` (global tensors, jax / numpy arrays, scalars; NNX states) at ``path``.

    Tensors are written by logical value: partial sums are reduced, padding is never written, and
    each process writes only the shards its devices own. The save is atomic (see the module doc):
    ``path`` only ever holds a complete checkpoint. Returns the absolute path.

    Raises ``CheckpointError`` if ``path`` exists and ``overwrite`` is false, if another save of
    ``path`` is running (one save of a path at a time; the other one's checkpoint, or the previous
    one, stays in place), or for a leaf that cannot be saved (named by its path in the tree).
    """
    root = os.path.abspath(os.fspath(path))
    tmp, old = root + _manifest.PARTIAL_SUFFIX, root + _manifest.OLD_SUFFIX
    flat, _ = tree_flatten_with_path(tree, is_leaf=is_leaf)
    entries, arrays = [], {}
    for i, (kp, leaf) in enumerate(flat):
        e, arr = _entry(i, kp, leaf)
        entries.append(e)
        if arr is not None:
            arrays[e["name"]] = arr
    if (os.path.isdir(root) or os.path.isdir(old)) and not overwrite:
        raise CheckpointError(
            f"save: a checkpoint already exists at {root}; pass overwrite=True to replace it "
            "(or save to a new path, e.g. with jsbp.checkpoint.save_step)."
        )
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(f"save: {root} exists and is not a directory.")

    with activity(f"jsbp.checkpoint.save({root!r})"):
        lock = _start(root, tmp, overwrite)
        try:
            _write(root, tmp, old, entries, arrays)
        finally:
            if lock is not None:
                _lock.release(root, lock)
    return root


def _start(root: str, tmp: str, overwrite: bool) -> int | None:
    """Process 0 takes the save lock of ``root`` and prepares ``tmp``; every process learns
    whether that worked (and raises the same ``CheckpointError`` if not). Returns the lock (on
    process 0)."""
    lock, error = None, None
    if _sync.is_primary():
        try:
            lock = _lock.acquire(root)
            if not overwrite and os.path.isdir(root):  # saved by another save meanwhile
                raise CheckpointError(
                    f"save: a checkpoint already exists at {root}; pass overwrite=True to replace "
                    "it (or save to a new path, e.g. with jsbp.checkpoint.save_step)."
                )
            _recover(root)
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)  # left by an earlier interrupted save of this path
            os.makedirs(tmp)
            _pause_point("locked")
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = f"save: preparing {tmp} failed: {type(e).__name__}: {e}"
        if error is not None and lock is not None:
            _lock.release(root, lock)
            lock = None
    error = _sync.from_primary(error, f"start {root}")
    if error is not None:
        raise CheckpointError(error)
    return lock


def _write(root: str, tmp: str, old: str, entries: list, arrays: dict) -> None:
    if arrays:
        _backend.write(os.path.join(tmp, _backend.STATE), arrays)
    _sync.barrier(f"data {root}")
    if _sync.is_primary():
        _pause_point("before_commit")
        files = _manifest.hash_files(tmp, _manifest.list_files(tmp), sync=True)
        body = {
            "format": _manifest.FORMAT,
            "version": _manifest.VERSION,
            "created_unix": time.time(),
            "jax_version": jax.__version__,
            "process_count": jax.process_count(),
            "leaves": entries,
            "files": files,
        }
        _manifest.write(tmp, body)
        if os.path.isdir(root):
            os.rename(root, old)
            _pause_point("between_renames")
            os.rename(tmp, root)
            _manifest._fsync_dir(os.path.dirname(root))
            shutil.rmtree(old)
        else:
            os.rename(tmp, root)
            _manifest._fsync_dir(os.path.dirname(root))
    _sync.barrier(f"commit {root}")


def _recover(root: str) -> None:
    """Repair what an ``overwrite=True`` save killed between its two renames left behind."""
    old = root + _manifest.OLD_SUFFIX
    if not os.path.isdir(old):
        return
    if os.path.isdir(root):
        shutil.rmtree(old)  # the new checkpoint was in place; only the cleanup was missed
    else:
        os.rename(old, root)  # the new one never arrived: put the previous one back
