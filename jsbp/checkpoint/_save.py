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

A save stopped in its own process before the commit (an error, a full disk, ``KeyboardInterrupt``)
undoes itself on process 0: the previous checkpoint goes back to ``<path>``, ``.jsbp-partial`` is
removed, the lock released. Before anything is written, process 0 checks that the file system
has room for the arrays' logical size, and in a multi-process run the processes check that they
all passed the same tree (``_check_same_tree``). The manifest records a ``save_id`` new with
every save, which ``load`` uses to tell that the checkpoint at a path was replaced while it read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
import uuid

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


def _pause_point(point: str) -> None:
    """A named point of the save sequence; does nothing.

    ``point`` is ``locked`` (the save lock is taken, nothing written yet), ``before_commit`` (the
    data is written, no commit record yet) or ``between_renames`` (an ``overwrite=True`` save has
    moved the old checkpoint aside). Tests replace this function (``monkeypatch.setattr``) to
    stop, kill or interrupt a save at a known point instead of after a guessed delay.
    """


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
        return GlobalTensor(
            data, layout_of(plc, (_sbp.broadcast,) * plc.ndim, tuple(data.shape))
        ), str(jax.random.key_impl(key))
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
    one, stays in place), for a leaf that cannot be saved (named by its path in the tree), if the
    processes of a multi-process run pass different trees (named by the first leaf that differs),
    and if the file system is full (naming the bytes the save needs). Whatever stops a save
    (an error, a full disk, ``KeyboardInterrupt``) before its commit leaves the previous checkpoint
    at ``path`` in place, removes what this save wrote and releases its lock.
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
    _check_same_tree(root, entries, arrays)
    needed = sum(int(a.nbytes) for a in arrays.values())

    with activity(f"jsbp.checkpoint.save({root!r})"):
        lock = _start(root, tmp, overwrite, needed)
        try:
            _write(root, tmp, old, entries, arrays, needed)
        finally:
            if lock is not None:
                _lock.release(root, lock)
    return root


def _start(root: str, tmp: str, overwrite: bool, needed: int) -> int | None:
    """Process 0 takes the save lock of ``root`` and prepares ``tmp``; every process learns
    whether that worked (and raises the same ``CheckpointError`` if not). Returns the lock (on
    process 0). Anything that stops process 0 here releases the lock it took."""
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
            _check_free_space(root, needed)
            os.makedirs(tmp)
            _pause_point("locked")
        except CheckpointError as e:
            error = str(e)
        except OSError as e:
            error = _disk_full(root, needed, e) or (
                f"save: preparing {tmp} failed: {type(e).__name__}: {e}"
            )
        except BaseException:  # KeyboardInterrupt, SystemExit: give everything back, then go
            if lock is not None:
                _abandon(root, tmp)
                _lock.release(root, lock)
            raise
        if error is not None and lock is not None:
            _abandon(root, tmp)
            _lock.release(root, lock)
            lock = None
    error = _sync.from_primary(error, f"start {root}")
    if error is not None:
        raise CheckpointError(error)
    return lock


def _write(root: str, tmp: str, old: str, entries: list, arrays: dict, needed: int) -> None:
    committed = False
    try:
        if arrays:
            _backend.write(os.path.join(tmp, _backend.STATE), arrays)
        _sync.barrier(f"data {root}")
        if _sync.is_primary():
            _pause_point("before_commit")
            files = _manifest.hash_files(tmp, _manifest.list_files(tmp), sync=True)
            body = {
                "format": _manifest.FORMAT,
                "version": _manifest.VERSION,
                "save_id": uuid.uuid4().hex,
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
                committed = True
                _manifest._fsync_dir(os.path.dirname(root))
                shutil.rmtree(old)
            else:
                os.rename(tmp, root)
                committed = True
                _manifest._fsync_dir(os.path.dirname(root))
    except BaseException as e:
        if _sync.is_primary() and not committed:
            _abandon(root, tmp)
        full = _disk_full(root, needed, e) if isinstance(e, Exception) else None
        if full is not None:
            raise CheckpointError(full) from e
        raise
    _sync.barrier(f"commit {root}")


def _abandon(root: str, tmp: str) -> None:
    """Undo an unfinished save: the previous checkpoint back at ``root``, ``tmp`` removed."""
    try:
        _recover(root)
    except OSError:
        pass
    shutil.rmtree(tmp, ignore_errors=True)


def _recover(root: str) -> None:
    """Repair what an ``overwrite=True`` save killed between its two renames left behind."""
    old = root + _manifest.OLD_SUFFIX
    if not os.path.isdir(old):
        return
    if os.path.isdir(root):
        shutil.rmtree(old)  # the new checkpoint was in place; only the cleanup was missed
    else:
        os.rename(old, root)  # the new one never arrived: put the previous one back


# -- a full disk ------------------------------------------------------------------------------

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_WORDS = (
    "No space left on device",
    "Disk quota exceeded",
    "ENOSPC",
    "RESOURCE_EXHAUSTED: No space",
)


def _free_bytes(root: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(root) or ".").free
    except OSError:
        return None


def _full_message(root: str, needed: int) -> str:
    free = _free_bytes(root)
    where = f"; {free:,} bytes are free there" if free is not None else ""
    return (
        f"save: the file system of {root} is full: this checkpoint needs about {needed:,} bytes "
        f"(the logical size of its arrays){where}. Nothing of this save was left behind and the "
        f"checkpoint at {root} (if any) is as it was. Free space or save to another file system."
    )


def _disk_full(root: str, needed: int, error: BaseException) -> str | None:
    """The message for ``error`` if it (or what caused it) says the disk is full, else None.

    Orbax and tensorstore wrap the ``OSError`` of a failed write in their own errors, so the
    chain of causes and the messages are searched."""
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return _full_message(root, needed)
        if any(w in str(e) for w in _FULL_WORDS):
            return _full_message(root, needed)
        e = e.__cause__ or e.__context__
    return None


def _check_free_space(root: str, needed: int) -> None:
    """Refuse a save that cannot fit before writing anything (process 0, on its file system)."""
    free = _free_bytes(root)
    if free is not None and free < needed:
        raise CheckpointError(_full_message(root, needed))


# -- every process saves the same tree --------------------------------------------------------


def _digest_array(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()[:16]


def _leaf_digests(entries: list, arrays: dict) -> list[str]:
    """One digest per leaf of what this process can vouch for: its manifest entry (path, kind,
    shape, dtype, placement, nd-sbp, a scalar's value), the content of an array this process
    holds whole, and the shards of a global tensor that other processes hold copies of."""
    out = []
    for e in entries:
        h = hashlib.sha256(json.dumps(e, sort_keys=True).encode())
        arr = arrays.get(e["name"])
        if isinstance(arr, np.ndarray):
            h.update(_digest_array(arr).encode())
        elif isinstance(arr, jax.Array):
            if arr.is_fully_addressable and e["kind"] != "global":
                h.update(_digest_array(arr).encode())
            else:
                for key, d in _replicated_shards(arr):
                    h.update(f"{key}={d};".encode())
        out.append(h.hexdigest()[:16])
    return out


def _replicated_shards(arr: jax.Array) -> list[tuple[str, str]]:
    """``(block, digest)`` of this process's copy of every block of ``arr`` that devices of more
    than one process hold (a ``B`` axis across processes)."""
    by_block: dict[str, set[int]] = {}
    for dev, idx in arr.sharding.devices_indices_map(tuple(arr.shape)).items():
        key = repr(tuple((s.start, s.stop) for s in idx))
        by_block.setdefault(key, set()).add(dev.process_index)
    out, done = [], set()
    for shard in arr.addressable_shards:
        key = repr(tuple((s.start, s.stop) for s in shard.index))
        if key in done or len(by_block.get(key, ())) < 2:
            continue
        done.add(key)
        out.append((key, _digest_array(shard.data)))
    return sorted(out)


def _check_same_tree(root: str, entries: list, arrays: dict) -> None:
    """In a multi-process run, raise ``CheckpointError`` on every process unless every process
    passed the same tree (see ``_leaf_digests``); nothing is written before this check."""
    if jax.process_count() == 1:
        return
    mine = _leaf_digests(entries, arrays)
    paths = [e["path"] for e in entries]
    every = _sync.allgather({"paths": paths, "digests": mine}, f"same tree {root}")
    ref = every[0]
    for rank, got in enumerate(every[1:], start=1):
        if got == ref:
            continue
        if got["paths"] != ref["paths"]:
            only0 = sorted(set(ref["paths"]) - set(got["paths"]))
            only_r = sorted(set(got["paths"]) - set(ref["paths"]))
            what = (
                f"their tree structures differ (only process 0 has {only0[:4] or 'nothing'}, "
                f"only process {rank} has {only_r[:4] or 'nothing'}"
                + (", or the leaves come in another order" if not only0 and not only_r else "")
                + ")"
            )
        else:
            k = next(i for i, (a, b) in enumerate(zip(ref["digests"], got["digests"])) if a != b)
            where = paths[k] or "the root (the tree is a single leaf)"
            what = (
                f"the leaf at {where} differs (its shape, dtype, layout, value, or the copy each "
                "process holds of a replicated block)"
            )
        raise CheckpointError(
            f"save: processes 0 and {rank} passed different trees to save({root!r}): {what}. "
            "Every process of a multi-process run must save the same tree (the same global "
            "tensors, and the same values for scalars and arrays each process holds); nothing "
            "was written."
        )
