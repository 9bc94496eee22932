"""Step directories for training loops: ``<dir>/step_<n>``, one complete checkpoint each.

A training script saves with ``save_step(dir, step, state)`` every K steps and resumes with::

    step = latest_step(dir)          # None when there is nothing to resume from
    if step is not None:
        state = load_step(dir, step, target)

Only committed checkpoints count as steps; a save that was killed half way (a
``step_<n>.jsbp-partial`` directory, or a ``step_<n>`` without a commit record) is skipped, with
a ``CheckpointWarning`` when it is newer than the step returned, so a crash during a save resumes
from the previous one.
"""

from __future__ import annotations

import os
import re
import shutil

from . import _manifest, _sync
from ._errors import CheckpointError, warn
from ._load import load
from ._save import save

__all__ = ["step_path", "all_steps", "latest_step", "save_step", "load_step"]

_STEP_RE = re.compile(r"^step_(\d+)$")
_ANY_RE = re.compile(r"^step_(\d+)(\.jsbp-partial|\.jsbp-old)?$")


def step_path(directory, step: int) -> str:
    """The checkpoint directory of ``step`` inside ``directory``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step must be a non-negative int, got {step!r}.")
    return os.path.join(os.path.abspath(os.fspath(directory)), f"step_{step}")


def _scan(directory) -> tuple[list[int], dict[int, str]]:
    """(complete steps, {step: why it is incomplete})."""
    root = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(root):
        return [], {}
    good, bad = set(), {}
    names = sorted(os.listdir(root))
    for name in names:
        m = _ANY_RE.match(name)
        if not m:
            continue
        step, suffix = int(m.group(1)), m.group(2)
        full = os.path.join(root, name)
        if suffix == _manifest.PARTIAL_SUFFIX:
            bad.setdefault(step, f"{full} is an interrupted save (no commit record)")
        elif suffix == _manifest.OLD_SUFFIX:
            if not os.path.isdir(os.path.join(root, f"step_{step}")):
                try:
                    _manifest.read(full)
                    good.add(step)  # load() falls back to it
                except CheckpointError:
                    pass
        else:
            try:
                _manifest.read(full)
                good.add(step)
            except CheckpointError as e:
                bad[step] = str(e)
    for s in good:
        bad.pop(s, None)
    return sorted(good), bad


def all_steps(directory) -> list[int]:
    """The steps with a complete checkpoint in ``directory``, ascending."""
    return _scan(directory)[0]


def latest_step(directory) -> int | None:
    """The newest step with a complete checkpoint in ``directory`` (``None`` if there is none).

    Interrupted or damaged saves newer than it are reported with a ``CheckpointWarning``.
    """
    good, bad = _scan(directory)
    latest = good[-1] if good else None
    newer = {s: why for s, why in bad.items() if latest is None or s > latest}
    if newer:
        warn(
            "skipping incomplete checkpoint(s) in "
            f"{os.path.abspath(os.fspath(directory))}: "
            + "; ".join(f"step {s}: {why}" for s, why in sorted(newer.items()))
            + (f". Resuming from step {latest}." if latest is not None else ".")
        )
    return latest


def save_step(
    directory, step: int, tree, *, keep: int | None = None, overwrite: bool = False
) -> str:
    """Save ``tree`` as step ``step`` in ``directory``; with ``keep``, then delete all but the
    newest ``keep`` complete steps. Returns the checkpoint's path."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"save_step: keep must be a positive int or None, got {keep!r}.")
    out = save(step_path(directory, step), tree, overwrite=overwrite)
    if keep is not None and _sync.is_primary():
        for s in all_steps(directory)[:-keep]:
            shutil.rmtree(step_path(directory, s), ignore_errors=True)
    _sync.barrier(f"keep {out}")
    return out


def load_step(directory, step: int, target=None, **kwargs):
    """``load(step_path(directory, step), target, **kwargs)``."""
    return load(step_path(directory, step), target, **kwargs)
