"""The commit record of a checkpoint: ``jsbp_manifest.json``, written last.

A checkpoint directory is complete if and only if its manifest exists and is intact. The manifest
lists every leaf of the saved tree (its path, kind, logical shape, dtype, and for global tensors
the placement and nd-sbp it was saved from, for information) and every data file with its size
and SHA-256, and a ``save_id`` new with every save. It carries a digest of its own body, so a
damaged manifest is detected too, and two manifests with the same digest are the same commit.

Layout of a checkpoint directory::

    <path>/
        jsbp_manifest.json      # written last: its presence is the commit
        state/                  # an orbax-checkpoint PyTree checkpoint (tensorstore, OCDBT)
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from ._errors import CheckpointError

MANIFEST = "jsbp_manifest.json"
FORMAT = "jsbp-checkpoint"
VERSION = 1
PARTIAL_SUFFIX = ".jsbp-partial"
OLD_SUFFIX = ".jsbp-old"

_CHUNK = 1 << 22


# -- tree paths ---------------------------------------------------------------------------


def encode_key(k) -> list:
    """A JSON form of one pytree key, enough to rebuild nested dicts / lists."""
    if isinstance(k, DictKey):
        key = k.key
        if isinstance(key, (str, int)) and not isinstance(key, bool):
            return ["dict", key]
        return ["dict", repr(key)]
    if isinstance(k, SequenceKey):
        return ["seq", k.idx]
    if isinstance(k, GetAttrKey):
        return ["attr", k.name]
    if isinstance(k, FlattenedIndexKey):
        return ["flat", k.key]
    return ["dict", str(k)]


def rebuild(keys_and_values: list[tuple[list, object]]):
    """Nested dicts (lists where the keys were sequence indices) from ``(encoded path, value)``
    pairs; a tree that was a single leaf comes back as that leaf."""
    if len(keys_and_values) == 1 and not keys_and_values[0][0]:
        return keys_and_values[0][1]
    root: dict = {}
    seq_ids: set[int] = set()
    if keys_and_values and keys_and_values[0][0] and keys_and_values[0][0][0][0] == "seq":
        seq_ids.add(id(root))
    for keys, value in keys_and_values:
        node = root
        for i, (_, key) in enumerate(keys[:-1]):
            if key not in node:
                node[key] = {}
                if keys[i + 1][0] == "seq":
                    seq_ids.add(id(node[key]))
            node = node[key]
        node[keys[-1][1]] = value
    return _lists(root, seq_ids)


def _lists(node, seq_ids: set[int]):
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v, seq_ids) for k, v in node.items()}
    if id(node) in seq_ids and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


# -- files --------------------------------------------------------------------------------


def _hash_file(full: str, sync: bool) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(full, "rb") as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            h.update(block)
        if sync:
            os.fsync(f.fileno())
    return os.path.getsize(full), h.hexdigest()


def list_files(root: str) -> list[str]:
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root).replace(os.sep, "/")
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def hash_files(root: str, rels: list[str], *, sync: bool = False) -> dict[str, dict]:
    """``{relative path: {"size", "sha256"}}``; also ``fsync``s each file when ``sync``."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, max(1, len(rels)))) as ex:
        res = list(ex.map(lambda r: _hash_file(os.path.join(root, r), sync), rels))
    return {r: {"size": s, "sha256": d} for r, (s, d) in zip(rels, res)}


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write(root: str, body: dict) -> None:
    """Write the manifest of ``root`` atomically (tmp file, fsync, rename, fsync dir)."""
    text = json.dumps({"jsbp_checkpoint": body, "sha256": _digest(body)}, sort_keys=True, indent=1)
    tmp = os.path.join(root, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, MANIFEST))
    _fsync_dir(root)


MISSING_HINT = (
    "A jsbp checkpoint is a directory written by jsbp.checkpoint.save; it is committed by writing "
    f"{MANIFEST} last, so a directory without it is a save that did not finish."
)


def read(root: str) -> dict:
    """The manifest body of the checkpoint at ``root``; ``CheckpointError`` if absent or damaged."""
    return read_with_digest(root)[0]


def stored_digest(root: str) -> str | None:
    """The SHA-256 the manifest of ``root`` records for its body (``None`` if unreadable): two
    reads that give the same digest read the same commit record (each save records a new id)."""
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            return json.load(f)["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_with_digest(root: str) -> tuple[dict, str]:
    """``read(root)`` and the digest of the body read (see ``stored_digest``)."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise CheckpointError(
            f"no checkpoint at {root}: it is a file, not a directory. A jsbp checkpoint is a "
            "directory written by jsbp.checkpoint.save; pass the checkpoint's directory."
        )
    if not os.path.isdir(root):
        hint = ""
        if os.path.isdir(root + PARTIAL_SUFFIX):
            hint = (
                f" An interrupted save was found at {root + PARTIAL_SUFFIX} (it has no commit record "
                "and cannot be loaded)."
            )
        raise CheckpointError(f"no checkpoint at {root}: the directory does not exist.{hint}")
    mpath = os.path.join(root, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(
            f"{root} is not a complete jsbp checkpoint: its commit record {mpath} is missing, so the "
            f"save that wrote it was interrupted (or it is not a jsbp checkpoint). {MISSING_HINT}"
        )
    try:
        with open(mpath) as f:
            doc = json.load(f)
        body, digest = doc["jsbp_checkpoint"], doc["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"the commit record {mpath} is damaged (cannot read it as a jsbp manifest: {e}); the "
            "checkpoint cannot be trusted."
        ) from None
    if _digest(body) != digest:
        raise CheckpointError(
            f"the commit record {mpath} is damaged: its content does not match its SHA-256; the "
            "checkpoint cannot be trusted."
        )
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointError(
            f"{mpath} is a {body.get('format')!r} manifest of version {body.get('version')!r}; this "
            f"jsbp reads {FORMAT!r} version {VERSION}."
        )
    return body, digest


def verify_files(root: str, body: dict, *, checksums: bool = True) -> None:
    """Check that every data file listed in the manifest is there, of the right size and hash."""
    files = body["files"]
    for rel, info in files.items():
        full = os.path.join(root, rel)
        if not os.path.isfile(full):
            raise CheckpointError(
                f"checkpoint {root} is damaged: the data file {full} listed in its commit record is "
                "missing."
            )
        size = os.path.getsize(full)
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint {root} is damaged: the data file {full} has {size} bytes, but "
                f"{info['size']} were written."
            )
    if not checksums:
        return
    got = hash_files(root, sorted(files))
    for rel, info in files.items():
        if got[rel]["sha256"] != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {root} is damaged: the data file {os.path.join(root, rel)} does not "
                f"match its SHA-256 from the commit record (the file changed after the save). "
                "Nothing was loaded."
            )
