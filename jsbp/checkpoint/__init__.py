"""Checkpoints of global tensors that survive a change of layout.

``save(path, tree)`` writes a pytree of global tensors (and jax / numpy arrays, Python scalars,
NNX states) by *logical* value with orbax-checkpoint: partial sums reduced, padding never
written, each process writing only its own shards, atomically (a commit record with checksums is
written last). ``load(path, target)`` puts every tensor on the placement and nd-sbp that
``target`` gives (a tree of global tensors or ``TensorSpec``s, or a rule), whatever layout and
device count it was saved with. See ``docs/checkpoint.md``.
"""

from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointWarning as CheckpointWarning
from ._load import Rule as Rule
from ._load import info as info
from ._load import load as load
from ._load import verify as verify
from ._save import save as save
from ._spec import TensorSpec as TensorSpec
from ._steps import all_steps as all_steps
from ._steps import latest_step as latest_step
from ._steps import load_step as load_step
from ._steps import save_step as save_step
from ._steps import step_path as step_path
