"""``load``: read a checkpoint onto the placements and nd-sbps a target asks for.

Every tensor is read straight into the *storage layout* of its target (the even, partial-free
layout closest to it, see ``_storage``): each device reads only its own block from the files.
Then it is boxed on the target placement to the target nd-sbp, which from an even layout is
local slicing, zero-filling (for ``P``), or one all-to-all per axis that moves an uneven split.
Nothing depends on the layout or device count the checkpoint was saved with.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path

from .. import _sbp
from .._layout import Layout, layout_of, normalise_nd
from .._placement import placement as Placement
from .._tensor import GlobalTensor, is_key_dtype, zeros
from ..distributed._heartbeat import activity
from . import _backend, _manifest, _sync
from ._errors import CheckpointError, warn
from ._lock import LOCK_SUFFIX
from ._spec import TensorSpec
from ._storage import describe_placement_json, placement_from_json, storage_layout

__all__ = ["load", "Rule"]

Rule = Callable[[str, tuple], Any]
"""A load rule: ``rule(path, shape) -> (placement, sbp)`` for every saved global tensor, where
``path`` is the leaf's path in the saved tree as ``jax.tree_util.keystr`` writes it (e.g.
``"['params']['kernel']"``) and ``shape`` its logical shape. It may also return a ``TensorSpec``
or ``None`` (load the tensor on its saved placement and nd-sbp). Leaves that were not global
tensors come back as they were saved (numpy as numpy, jax arrays on the first local device,
scalars as scalars)."""


def _is_target_leaf(x) -> bool:
    return isinstance(x, (GlobalTensor, TensorSpec, jax.ShapeDtypeStruct))


def _dtype(name: str) -> np.dtype:
    return np.dtype(jnp.dtype(name))


def _fmt(shape, dtype) -> str:
    return f"shape {tuple(shape)} {np.dtype(dtype).name}"


@dataclasses.dataclass
class _Plan:
    """How one saved leaf becomes one loaded leaf."""

    entry: dict
    kind: str  # "global", "jax", "numpy", "scalar"
    layout: Layout | None = None
    sharding: Any = None
    numpy_scalar: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.get("shape", ()))

    @property
    def dtype(self) -> np.dtype:
        return _dtype(self.entry["dtype"])

    @property
    def has_data(self) -> bool:
        return self.kind != "scalar" and self.entry["kind"] != "scalar" and 0 not in self.shape

    def request(self):
        if self.kind == "global":
            st = storage_layout(self.layout)
            return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=st.sharding)
        if self.kind == "jax":
            return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)
        return np.zeros(self.shape, self.dtype)

    def finish(self, arr):
        out = self._finish(arr)
        impl = self.entry.get("prng_impl")
        if impl is None:
            return out
        if isinstance(out, GlobalTensor):  # a typed PRNG key array again: always B
            plc = out.placement
            b = (_sbp.broadcast,) * plc.ndim
            key = jax.random.wrap_key_data(out.to_global(sbp=b).physical, impl=impl)
            return GlobalTensor(key, layout_of(plc, b, tuple(key.shape)))
        return jax.random.wrap_key_data(jnp.asarray(out), impl=impl)

    def _finish(self, arr):
        e = self.entry
        if self.kind == "scalar":
            return e["value"]
        if self.kind == "global":
            lay = self.layout
            if arr is None:
                return zeros(lay.shape, placement=lay.placement, sbp=lay.nd_sbp, dtype=self.dtype)
            return GlobalTensor(arr, storage_layout(lay)).to_global(sbp=lay.nd_sbp)
        if self.kind == "jax":
            if arr is None:
                return jax.device_put(np.zeros(self.shape, self.dtype), self.sharding)
            return arr
        out = np.zeros(self.shape, self.dtype) if arr is None else np.asarray(arr)
        return out[()] if self.numpy_scalar else out


def _where(path: str) -> str:
    """A tree path for messages (the root of a tree that is a single leaf has the empty path)."""
    return path or "the root (the tree is a single leaf)"


def _mismatch(root, e, shape, dtype) -> CheckpointError:
    saved = _dtype(e["dtype"])
    x64 = ""
    if (
        tuple(e["shape"]) == tuple(shape)
        and np.dtype(jax.dtypes.canonicalize_dtype(saved)) == dtype != saved
    ):
        x64 = (
            f" It was saved under jax_enable_x64; JAX makes {dtype.name} of {saved.name} here "
            "(x64 is off): enable x64 before loading, or load it as numpy (a numpy target leaf) "
            "and cast it yourself."
        )
    return CheckpointError(
        f"load: the leaf at {_where(e['path'])} in checkpoint {root} was saved with "
        f"{_fmt(e['shape'], e['dtype'])}, but the target expects {_fmt(shape, dtype)}. "
        "Make the target match the checkpoint (or cast after loading)." + x64
    )


def _key_target(root: str, e: dict, t):
    """A typed PRNG key target read as a target for the key's saved data (``B``; ``finish`` wraps
    it again). A key target for data that was no key, or the reverse, is a mismatch."""
    dt = getattr(t, "dtype", None)
    is_key = dt is not None and is_key_dtype(dt)
    if not is_key and "prng_impl" not in e:
        return t
    if not is_key or "prng_impl" not in e:
        raise CheckpointError(
            f"load: the leaf at {_where(e['path'])} in checkpoint {root} was saved "
            f"{'as a PRNG key array' if 'prng_impl' in e else 'as ' + _fmt(e['shape'], e['dtype'])}, but the "
            f"target there is {'a PRNG key array' if is_key else 'no PRNG key array'}; give a matching target."
        )
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(t.shape, dt))
    if isinstance(t, (GlobalTensor, TensorSpec)):
        plc = t.layout.placement
        return TensorSpec(tuple(data.shape), data.dtype, plc, (_sbp.broadcast,) * plc.ndim)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(t, "sharding", None))


def _plan_for_target(root: str, e: dict, t) -> _Plan:
    """The plan for saved entry ``e`` given one target leaf ``t``."""
    path = _where(e["path"])
    if e["kind"] == "scalar":
        if isinstance(t, (bool, int, float)) and type(t).__name__ == e["pytype"]:
            return _Plan(e, "scalar")
        raise CheckpointError(
            f"load: the leaf at {path} in checkpoint {root} was saved as the Python {e['pytype']} "
            f"{e['value']!r}, but the target there is {type(t).__name__} {repr(t)[:60]}; give a "
            f"{e['pytype']} in the target."
        )
    t = _key_target(root, e, t)
    if isinstance(t, (GlobalTensor, TensorSpec)):
        shape, dtype, lay = tuple(t.shape), np.dtype(t.dtype), t.layout
        kind = "global"
    elif isinstance(t, (jax.ShapeDtypeStruct, jax.Array)):
        shape, dtype, lay, kind = tuple(t.shape), np.dtype(t.dtype), None, "jax"
    elif isinstance(t, (np.ndarray, np.generic)):
        shape, dtype, lay, kind = tuple(np.shape(t)), np.asarray(t).dtype, None, "numpy"
    else:
        raise CheckpointError(
            f"load: the target leaf at {path} is a {type(t).__name__} ({repr(t)[:60]}), but the "
            f"checkpoint {root} holds an array there ({_fmt(e['shape'], e['dtype'])}). Give a "
            "global tensor, a jsbp.checkpoint.TensorSpec, a jax.ShapeDtypeStruct / jax.Array or a "
            "numpy array."
        )
    if shape != tuple(e["shape"]) or dtype != _dtype(e["dtype"]):
        raise _mismatch(root, e, shape, dtype)
    if kind != "numpy":
        _check_x64(root, e)
    if kind == "jax":
        sharding = getattr(t, "sharding", None) or jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]
        )
        return _Plan(e, "jax", sharding=sharding)
    return _Plan(e, kind, layout=lay, numpy_scalar=isinstance(t, np.generic))


def _check_x64(root: str, e: dict) -> None:
    """A 64-bit leaf is loaded as a jax / global tensor only where JAX holds 64 bits (x64 on):
    never cast silently to the 32-bit type JAX would make of it."""
    saved = _dtype(e["dtype"])
    held = np.dtype(jax.dtypes.canonicalize_dtype(saved))
    if held != saved:
        raise CheckpointError(
            f"load: the leaf at {_where(e['path'])} in checkpoint {root} was saved as "
            f"{saved.name} (under jax_enable_x64), but JAX holds it as {held.name} here "
            "(jax_enable_x64 is off), so it would lose precision. Enable x64 before loading "
            "(jax.config.update('jax_enable_x64', True)), or load it as numpy (a numpy target "
            f"leaf) and cast it yourself (e.g. to {held.name})."
        )


def _plan_as_saved(root: str, e: dict) -> _Plan:
    kind = e["kind"]
    if kind == "scalar":
        return _Plan(e, "scalar")
    if kind == "numpy":
        return _Plan(e, "numpy", numpy_scalar=e.get("numpy_scalar", False))
    _check_x64(root, e)
    if kind == "jax":
        return _Plan(e, "jax", sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
    try:
        plc = placement_from_json(e["placement"])
    except ValueError as err:
        raise CheckpointError(
            f"load: the tensor at {_where(e['path'])} in checkpoint {root} was saved on placement "
            f"{describe_placement_json(e['placement'])}, which cannot be built here ({err}). Pass a "
            "target (a tree of global tensors / TensorSpecs, or a rule) to choose where it goes."
        ) from None
    shape = tuple(e["shape"])
    return _Plan(e, "global", layout=layout_of(plc, normalise_nd(e["sbp"], shape, plc), shape))


def _plan_from_rule(root: str, e: dict, rule: Rule | None) -> _Plan:
    if rule is None or e["kind"] != "global":
        return _plan_as_saved(root, e)
    shape = tuple(e["shape"])
    got = rule(e["path"], shape)
    if got is None:
        return _plan_as_saved(root, e)
    if isinstance(got, TensorSpec):
        return _plan_for_target(root, e, got)
    try:
        plc, sbp = got
    except (TypeError, ValueError):
        raise CheckpointError(
            f"load: the rule returned {got!r} for {_where(e['path'])} (shape {shape}); a rule returns "
            "(placement, sbp), a TensorSpec, or None."
        ) from None
    if not isinstance(plc, Placement):
        raise CheckpointError(
            f"load: the rule returned placement {plc!r} for {_where(e['path'])}; give a jsbp.placement."
        )
    return _plan_for_target(root, e, TensorSpec(shape, _dtype(e["dtype"]), plc, sbp))


def _resolve(root: str, *, quiet: bool = False) -> str:
    """``root``, or its ``.jsbp-old`` twin if an overwrite was killed between its renames."""
    old = root + _manifest.OLD_SUFFIX
    if not os.path.isdir(root) and os.path.isdir(old):
        if quiet:
            return old
        warn(
            f"{root} is missing but {old} holds the checkpoint an interrupted save(overwrite=True) "
            "was replacing; loading that one (the next save to this path puts it back in place)."
        )
        return old
    return root


def _is_rule(target) -> bool:
    if not callable(target) or _is_target_leaf(target):
        return False
    leaves = jax.tree_util.tree_leaves(target)
    return len(leaves) == 1 and leaves[0] is target


def load(path, target=None, *, strict: bool = True, verify: bool = True):
    """Load the checkpoint at ``path``, putting every tensor where ``target`` says.

    ``target`` is one of

    * a pytree shaped like the saved one whose leaves are global tensors (their placement, sbp,
      shape and dtype are used, not their values), ``TensorSpec``s, ``jax.ShapeDtypeStruct``s or
      ``jax.Array``s (loaded as jax arrays with that sharding), numpy arrays (loaded as numpy) or
      Python scalars; the result has the target's tree structure;
    * a rule ``rule(path, shape) -> (placement, sbp)`` (see ``Rule``); the result is rebuilt as
      nested dicts / lists from the saved paths;
    * ``None``: every leaf as it was saved (global tensors on their saved placement and nd-sbp).

    Shapes and dtypes must match the checkpoint exactly; a mismatch, a target path the checkpoint
    does not have, or (with ``strict``) a saved path the target does not ask for raises
    ``CheckpointError`` naming the path. With ``verify`` (the default) every data file is checked
    against the SHA-256 in the commit record before anything is read; ``verify=False`` checks
    only that the files exist with the right sizes.

    A load that runs while another thread, process or job replaces the checkpoint
    (``save(..., overwrite=True)``) returns one whole checkpoint, the previous or the new, never
    a mix: after reading, it checks that the commit it read the manifest of is still the one at
    ``path`` (its directory and its manifest's save id) and reads again if not. A path replaced
    on every attempt (8) raises ``CheckpointError``.
    """
    asked = os.path.abspath(os.fspath(path))
    with activity(f"jsbp.checkpoint.load({asked!r})"):
        return _load_retrying(asked, target, strict, verify)


class _Replaced(Exception):
    """The checkpoint at a path was replaced while a load read it (internal: the load retries)."""


def _load_retrying(asked: str, target, strict: bool, verify: bool):
    for attempt in range(_ATTEMPTS):
        root = _resolve(asked)
        try:
            return _load_from(root, target, strict, verify)
        except _Replaced:
            time.sleep(0.05 * (attempt + 1))
            continue
        except (CheckpointError, OSError) as e:
            # a save replacing this checkpoint while we read it: read the new one
            if (
                attempt + 1 < _ATTEMPTS
                and jax.process_count() == 1
                and _being_replaced(asked, root)
            ):
                time.sleep(0.05 * (attempt + 1))
                continue
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"load: reading checkpoint {root} failed: {type(e).__name__}: {e}"
            ) from e
    raise CheckpointError(
        f"load: the checkpoint at {asked} was replaced {_ATTEMPTS} times while it was being read "
        "(a save with overwrite=True of that path keeps running); nothing was returned. Load it "
        "when no save replaces it, or save each version to its own path (save_step)."
    )


_ATTEMPTS = 8


def _being_replaced(asked: str, root: str) -> bool:
    """A save holds ``asked`` or moved its checkpoint since we resolved ``root``."""
    return (
        os.path.exists(asked + LOCK_SUFFIX)
        or not os.path.isdir(root)
        or _resolve(asked, quiet=True) != root
    )


def _identity(root: str) -> tuple | None:
    """Which commit ``root`` holds now: its directory's inode and its manifest's digest (every
    save records a new id in its manifest, so two saves never share a digest)."""
    try:
        st = os.stat(root)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, _manifest.stored_digest(root))


def _check_unchanged(root: str, before: tuple | None, digest: str) -> None:
    """Raise ``_Replaced`` (on every process) if the commit at ``root`` is not the one whose
    manifest was read (``before``, ``digest``): then the data read may come from two
    checkpoints, and the load starts again."""
    same = before is not None and before[2] == digest and _identity(root) == before
    if not all(_sync.allgather(same, f"unchanged {root}")):
        raise _Replaced(root)


def _load_from(root: str, target, strict: bool, verify: bool):
    before = _identity(root)
    body, digest = _manifest.read_with_digest(root)
    _manifest.verify_files(root, body, checksums=verify)
    leaves = body["leaves"]

    rebuild_tree = target is None or _is_rule(target)
    if rebuild_tree:
        plans = [_plan_from_rule(root, e, target) for e in leaves]
    else:
        saved = {e["path"]: e for e in leaves}
        flat, treedef = tree_flatten_with_path(target, is_leaf=_is_target_leaf)
        paths = [keystr(kp) for kp, _ in flat]
        missing = [p for p in paths if p not in saved]
        extra = sorted(set(saved) - set(paths)) if strict else []
        if missing or extra:
            msg = f"load: the target tree does not match checkpoint {root}."
            if missing:
                msg += f" The target asks for {len(missing)} path(s) the checkpoint does not have: {_few(missing)}."
            if extra:
                msg += f" The checkpoint has {len(extra)} path(s) the target does not ask for: {_few(extra)} (pass strict=False to skip them)."
            msg += f" Saved paths: {_few(sorted(saved))}."
            raise CheckpointError(msg)
        plans = [_plan_for_target(root, saved[p], t) for p, (_, t) in zip(paths, flat)]

    requests = {p.entry["name"]: p.request() for p in plans if p.has_data}
    got = {}
    if requests:
        state = os.path.join(root, _backend.STATE)
        try:
            got = _backend.read(state, requests)
        # orbax / tensorstore failing under an intact manifest (e.g. verify=False on bad data)
        except Exception as err:
            raise CheckpointError(
                f"load: reading the data of checkpoint {root} from {state} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        jax.block_until_ready(list(got.values()))
    # everything was read from one commit only if that commit is still the one at ``root``
    _check_unchanged(root, before, digest)
    outs = [p.finish(got.get(p.entry["name"])) for p in plans]
    if rebuild_tree:
        return _manifest.rebuild([(p.entry["keys"], o) for p, o in zip(plans, outs)])
    return treedef.unflatten(outs)


def _few(items: list[str], n: int = 6) -> str:
    shown = ", ".join(items[:n])
    return shown + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def info(path) -> list[dict]:
    """What a checkpoint holds, without reading data: one dict per leaf with ``path``, ``kind``
    and, for arrays, ``shape``, ``dtype`` (and for global tensors the ``placement`` and ``sbp``
    they were saved from). Raises ``CheckpointError`` if the checkpoint is missing or incomplete."""
    root = _resolve(os.path.abspath(os.fspath(path)))
    body = _manifest.read(root)
    out = []
    for e in body["leaves"]:
        d = {"path": e["path"], "kind": e["kind"]}
        if e["kind"] == "scalar":
            d["value"] = e["value"]
        else:
            d["shape"], d["dtype"] = tuple(e["shape"]), _dtype(e["dtype"])
        if e["kind"] == "global":
            d["placement"] = describe_placement_json(e["placement"])
            d["sbp"] = e["sbp"]
        out.append(d)
    return out


def verify(path) -> None:
    """Check the checkpoint at ``path`` completely (commit record, every file's size and SHA-256)
    without loading it; raises ``CheckpointError`` naming what is wrong."""
    root = os.path.abspath(os.fspath(path))
    body = _manifest.read(root)
    _manifest.verify_files(root, body, checksums=True)
