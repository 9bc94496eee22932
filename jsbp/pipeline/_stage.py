"""One pipeline stage: a piece of an NNX model on its own sub-placement, run as ``jsbp.jit`` programs.

Per stage there are three consistent-view programs, each compiled once on the stage's placement
(so data and tensor parallelism inside the stage come from the layouts of its ``Strategy``):

* **forward** ``(params, rest, x[, targets]) -> (y, residuals)``: ``jax.vjp`` of the stage; the
  output is the activation for the next stage (the micro-batch loss on the last stage) and the
  *residuals* the backward needs — only those that are new buffers: residuals that are the
  stage's own parameters or its input are passed again to the backward instead of being copied;
* **backward** ``(params, rest, x, residuals, dy, gsum) -> (gsum + dparams, dx)``: the stored vjp
  applied to the cotangent; ``dx`` goes back to the previous stage and the parameter gradient is
  added to the running sum inside the program, in its own layout (``P`` over the data axis:
  nothing is reduced per micro-batch; the sum starts from zeros in that layout);
* **update** ``(state, grads) -> state``: the summed gradient is boxed once to the strategy's
  gradient layout (one all-reduce per parameter under data parallelism) and the stage's
  ``nnx.Optimizer`` applies one optax update. Every state leaf keeps its layout.

With ``remat=True`` the forward keeps nothing but the stage's input and the backward recomputes
the forward first (GPipe's re-materialisation): less memory, one more forward per micro-batch.

Activations and their gradients move between stages by ``to_global(placement=...)`` (boxing
across placements): between grids of the same shape the nd-sbp is kept and each device sends its
block to its counterpart; otherwise the value arrives in the receiving stage's batch layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from .. import _sbp
from .._errors import SbpError
from .._jit import jit as sbp_jit
from .._tensor import GlobalTensor, is_key_dtype, tensor, to_global
from ..flax import Strategy, leaf_layouts, shard, use_strategy
from ..flax import gather as gather_state

__all__ = ["Stage", "StageSpec", "Stash", "as_module", "grad_sbp", "make_programs", "make_update"]


def _is_global(x) -> bool:
    return isinstance(x, GlobalTensor)


def _leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree, is_leaf=_is_global)


def as_module(spec, index: int) -> nnx.Module:
    """A stage given as one NNX module, or as a list of modules applied in order (a layer range)."""
    if isinstance(spec, nnx.Module):
        return spec
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(m, nnx.Module) for m in spec):
        return nnx.Sequential(*spec)
    raise SbpError(
        f"pipeline: stage {index} is {type(spec).__name__} ({spec!r:.80}); give each stage as an nnx.Module "
        "or a non-empty list of nnx.Modules (a range of layers, applied in order)."
    )


def _itemsize(dtype) -> int:
    return dtype.itemsize if is_key_dtype(dtype) else np.dtype(dtype).itemsize


def local_nbytes(tree) -> int:
    """Bytes the global tensors of ``tree`` take on the fullest device of their placement."""
    total = 0
    for x in _leaves(tree):
        if _is_global(x):
            total += math.prod(x.layout.local_shape) * _itemsize(x.dtype)
    return total


@dataclasses.dataclass
class Stash:
    """What a stage keeps between a micro-batch's forward and its backward (its live activations)."""

    microbatch: int
    x: Any  # the stage input, when the backward reads it (None otherwise)
    t: Any  # the targets, on the last stage, when the backward reads them
    residuals: list  # new buffers saved by the forward
    program: Any  # the _Programs entry that made it (its backward knows how to read the stash)
    rest: Any = None  # the non-parameter state the forward ran with (RNG counts, statistics)

    def nbytes(self) -> int:
        return local_nbytes((self.x, self.t, self.residuals))


@dataclasses.dataclass
class _Programs:
    """The forward and backward programs of a stage for one argument signature."""

    fwd: Any
    bwd: Any
    meta: dict


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """Everything a stage's programs depend on besides its arguments' layouts (hashable), so that
    pipelines over the same structure — e.g. the same model under two schedules — share them."""

    graphdef: Any
    strategy: Strategy
    loss_fn: Callable
    first: bool
    last: bool
    remat: bool


_PROGRAMS: OrderedDict = OrderedDict()
_PROGRAMS_MAX = 64  # compiled programs kept (least recently used dropped first)


_UNHASHED: list = []  # (key, program) for keys that do not hash, found by ==, newest last


def _cached(key, make):
    """The program for ``key``, made once. A key holding a module's ``GraphDef`` need not hash
    (a ``@dataclass`` config stored on a module): such keys are compared with ``==``."""
    try:
        prog = _PROGRAMS.get(key)
    except TypeError:
        for i, (k, p) in enumerate(_UNHASHED):
            if _same(k, key):
                _UNHASHED.append(_UNHASHED.pop(i))
                return p
        prog = make()
        _UNHASHED.append((key, prog))
        del _UNHASHED[:-_PROGRAMS_MAX]
        return prog
    if prog is None:
        prog = _PROGRAMS[key] = make()
        while len(_PROGRAMS) > _PROGRAMS_MAX:
            _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
    return prog


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an == that raises or is ambiguous (an array attribute): not the same
        return False


def _signature(*trees) -> tuple:
    out = []
    for v in trees:
        leaves, treedef = jax.tree_util.tree_flatten(v, is_leaf=_is_global)
        out.append(
            (
                treedef,
                tuple(
                    (a.layout, a.dtype) if _is_global(a) else (np.shape(a), np.result_type(a))
                    for a in leaves
                ),
            )
        )
    return tuple(out)


def _shapes(tree) -> str:
    """``shape (4, 12) float32`` of one array, ``shapes [...]`` of a pytree (for messages)."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_global)
    parts = [f"{tuple(np.shape(v))} {getattr(v, 'dtype', np.result_type(v))}" for v in leaves]
    return f"shape {parts[0]}" if len(parts) == 1 else f"shapes [{', '.join(parts)}]"


def grad_sbp(param_sbp: tuple, strategy: Strategy) -> tuple:
    """The layout a parameter's gradient is summed in across micro-batches: the parameter's own,
    except ``P`` over the data axis where the parameter is broadcast (each data-parallel device
    holds an addend; they are reduced once per batch, by the update)."""
    a = strategy.data_axis
    if a is None:
        return param_sbp
    i = strategy.placement.axis_names.index(a)
    out = list(param_sbp)
    if out[i] is _sbp.broadcast:
        out[i] = _sbp.partial_sum
    return tuple(out)


def _apply(spec: StageSpec, params, rest, x, t):
    """The stage on one micro-batch: ``(output, its non-parameter state after the call)``. The model
    may update that state in place (Dropout's RNG counts, BatchNorm's statistics); it is read
    back and carried to the next micro-batch, as on one device micro-batch after micro-batch."""
    rest = jax.tree_util.tree_map(lambda v: v, rest)  # fresh Variables at this trace level
    m = nnx.merge(spec.graphdef, params, rest)
    y = m(x)
    new_rest = nnx.state(m, nnx.Not(nnx.Param))
    if spec.last:
        y = spec.loss_fn(y) if t is None else spec.loss_fn(y, t)
    return y, new_rest


def _vjp(spec: StageSpec, params, rest, x, t):
    """``(output, vjp, non-parameter state after the call)``."""
    if spec.first:  # the data is not differentiated (it may be integer tokens)
        return jax.vjp(lambda p: _apply(spec, p, rest, x, t), params, has_aux=True)
    return jax.vjp(lambda p, x_: _apply(spec, p, rest, x_, t), params, x, has_aux=True)


def make_programs(spec: StageSpec, params, rest, x) -> _Programs:
    """The forward and backward ``jsbp.jit`` programs of a stage (see the module docstring)."""
    meta: dict = {}

    def fwd(params, rest, x, t):
        with use_strategy(spec.strategy):
            y, vjp, new_rest = _vjp(spec, params, rest, x, t)
        if spec.remat:
            meta.update(x=True, t=True)
            return y, [], new_rest
        # the vjp is a pytree: its leaves are the residuals; keep only those that are new buffers
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        known: dict[int, tuple[str, int]] = {}
        for name, obj in (("p", params), ("s", rest), ("x", x), ("t", t)):
            for i, leaf in enumerate(jax.tree_util.tree_leaves(obj)):
                known.setdefault(id(leaf), (name, i))
        refs, residuals = [], []
        for leaf in leaves:
            if id(leaf) in known:
                refs.append(known[id(leaf)])
            else:
                refs.append(("r", len(residuals)))
                residuals.append(leaf)
        meta.update(
            tree=tree, refs=refs, x=any(k == "x" for k, _ in refs), t=any(k == "t" for k, _ in refs)
        )
        return y, residuals, new_rest

    def bwd(params, rest, x, t, residuals, dy, gsum):
        with use_strategy(spec.strategy):
            if spec.remat:  # recomputed from the state the forward saw: the same dropout masks
                _, vjp, _ = _vjp(spec, params, rest, x, t)
            else:
                src = {
                    "p": jax.tree_util.tree_leaves(params),
                    "s": jax.tree_util.tree_leaves(rest),
                    "x": jax.tree_util.tree_leaves(x),
                    "t": jax.tree_util.tree_leaves(t),
                    "r": residuals,
                }
                vjp = jax.tree_util.tree_unflatten(
                    meta["tree"], [src[k][i] for k, i in meta["refs"]]
                )
            cts = vjp(dy)
        gsum = jax.tree_util.tree_map(lambda a, b: a + b, gsum, cts[0])
        return gsum, (None if spec.first else cts[1])

    # the gradient sum leaves in the layout it came in (grad_sbp), whatever the inference prefers;
    # the input gradient (dx) keeps its inferred layout
    out_sbp = [grad_sbp(p.sbp, spec.strategy) for p in _leaves(params)]
    out_sbp += [] if spec.first else [None] * len(_leaves(x))
    # the state leaves the forward in the layouts it came in: the next micro-batch's forward is
    # the same program (the output and residuals before it keep their inferred layouts)
    rest_sbp = [v.sbp if _is_global(v) else None for v in _leaves(rest)]

    def fwd_out_sbp(tree):
        return [None] * (tree.num_leaves - len(rest_sbp)) + rest_sbp

    return _Programs(sbp_jit(fwd, out_sbp=fwd_out_sbp), sbp_jit(bwd, out_sbp=out_sbp), meta)


def _map_state(state, fn):
    flat = list(nnx.to_flat_state(state))
    return nnx.from_flat_state(
        [(path, var.replace(fn(path, var.get_value()))) for path, var in flat]
    )


def make_update(graphdef, state, strategy: Strategy):
    """The update program of a stage: box each summed gradient to the strategy's gradient layout
    (P -> B: one all-reduce per batch under data parallelism), then one ``nnx.Optimizer`` update;
    every state leaf leaves in the layout it came in."""
    lays = leaf_layouts(list(nnx.to_flat_state(state)), strategy)
    out_sbp = [x.sbp if _is_global(x) else None for x in _leaves(state)]

    def upd(state, grads):
        with use_strategy(strategy):
            model, opt = nnx.merge(graphdef, state)
            grads = _map_state(grads, lambda path, g: to_global(g, sbp=lays[(0,) + path].grad))
            opt.update(model, grads)
            return nnx.state((model, opt))

    return sbp_jit(upd, out_sbp=out_sbp)


class Stage:
    """Stage ``index`` of ``count``: its sharded module and optimizer, its programs, its gradient sum."""

    def __init__(
        self,
        index: int,
        count: int,
        module: nnx.Module,
        strategy: Strategy,
        tx,
        loss_fn: Callable,
        *,
        remat: bool = False,
    ):
        self.index, self.count = index, count
        self.first, self.last = index == 0, index == count - 1
        self.user_module = module
        self.strategy = strategy
        self.placement = strategy.placement
        self.remat = remat
        optimizer = nnx.Optimizer(module, tx, wrt=nnx.Param)
        self.module, self.optimizer = shard((module, optimizer), strategy)
        self.spec = StageSpec(
            nnx.graphdef(self.module), strategy, loss_fn, self.first, self.last, remat
        )
        self._grads = None
        self._zeros = None
        self._state = None
        self._y_sbp = None  # nd-sbp of this stage's output (where gradients coming back are put)

    # -- per step --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        _, params, rest = nnx.split(self.module, nnx.Param, ...)
        self._state = (params, rest)
        # the gradient sum starts from zeros in its own layout (made once: never written to)
        if self._zeros is None:
            self._zeros = jax.tree_util.tree_map(self._zero_grad, params, is_leaf=_is_global)
        self._grads = self._zeros

    def _zero_grad(self, p: GlobalTensor) -> GlobalTensor:
        sbp = grad_sbp(p.sbp, self.strategy)
        return tensor(np.zeros(p.shape, p.dtype), placement=self.placement, sbp=sbp)

    def put(self, tree):
        """A host micro-batch (or a global one) onto this stage, in the strategy's batch layout."""

        def one(x):
            if _is_global(x):
                return x.to_global(placement=self.placement, sbp=self.strategy.batch_sbp(x.ndim))
            x = np.asarray(x)
            return tensor(x, placement=self.placement, sbp=self.strategy.batch_sbp(x.ndim))

        return jax.tree_util.tree_map(one, tree, is_leaf=_is_global)

    def _box(self, x: GlobalTensor, fallback):
        """Move ``x`` here: keep its nd-sbp between same-shaped grids (a block-to-block copy)."""
        if x.placement == self.placement:
            return x
        same = x.placement.hierarchy == self.placement.hierarchy
        return x.to_global(placement=self.placement, sbp=x.sbp if same else fallback)

    def receive(self, y):
        """An activation from the previous stage."""
        return jax.tree_util.tree_map(
            lambda v: self._box(v, self.strategy.batch_sbp(v.ndim)) if _is_global(v) else v,
            y,
            is_leaf=_is_global,
        )

    def receive_grad(self, dy):
        """A gradient from the next stage, w.r.t. this stage's output."""
        sbps = iter(self._y_sbp or ())
        return jax.tree_util.tree_map(
            lambda v: (
                self._box(v, next(sbps, None) or self.strategy.batch_sbp(v.ndim))
                if _is_global(v)
                else v
            ),
            dy,
            is_leaf=_is_global,
        )

    def _programs_for(self, x, t) -> _Programs:
        params, rest = self._state
        key = ("stage", self.spec, _signature(params, rest, x, t))
        return _cached(key, lambda: make_programs(self.spec, params, rest, x))

    # -- actions -----------------------------------------------------------------------------
    def forward(self, microbatch: int, x, t=None):
        """Run the forward of one micro-batch; returns ``(y, stash)`` (``y`` is the loss on the last
        stage)."""
        params, rest = self._state
        prog = self._programs_for(x, t)
        try:
            y, residuals, new_rest = prog.fwd(params, rest, x, t)
        except SbpError:
            raise
        except (TypeError, ValueError) as e:  # JAX refused to trace the stage on these shapes
            raise self._input_error(x, t, e) from e
        self._state = (params, new_rest)  # the next micro-batch sees the advanced state
        if not self.last:
            self._y_sbp = [v.sbp for v in _leaves(y) if _is_global(v)]
        keep_x = x if prog.meta.get("x") else None
        keep_t = t if prog.meta.get("t") else None
        return y, Stash(microbatch, keep_x, keep_t, residuals, prog, rest)

    def _input_error(self, x, t, err: Exception) -> SbpError:
        """The error of a stage that cannot take what it was given: which stage gave it (or the
        micro-batch inputs), with the shapes, and JAX's own complaint."""
        what = (
            f"the micro-batch inputs of {_shapes(x)}"
            if self.first
            else f"stage {self.index - 1}'s output of {_shapes(x)}"
        )
        tgt = f" (targets {_shapes(t)})" if t is not None and self.last else ""
        fix = (
            f"make stage {self.index - 1}'s output match what stage {self.index} takes (or stage "
            f"{self.index}'s input size match stage {self.index - 1}'s output)"
            if not self.first
            else "give stage 0 inputs of the shape its first layer takes"
        )
        name = type(self.user_module).__name__
        return SbpError(
            f"pipeline: stage {self.index} ({name}) cannot take {what}{tgt}: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else err!r}; {fix}."
        )

    def backward(self, stash: Stash, dy):
        """Run the backward of one micro-batch from its stash; adds its parameter gradient to the
        running sum and returns the gradient w.r.t. the stage input (``None`` on the first stage)."""
        params, _ = self._state
        self._grads, dx = stash.program.bwd(
            params, stash.rest, stash.x, stash.t, stash.residuals, dy, self._grads
        )
        return dx

    def update(self) -> None:
        """One optimizer update with the gradients summed over the step's micro-batches."""
        if self._grads is None:
            raise SbpError(
                f"pipeline: stage {self.index} has no gradient to apply; call begin_step and run the backwards first."
            )
        nnx.update(self.module, self._state[1])  # the state after the step's last micro-batch
        fn, state = self._update_program()
        new_state = fn(state, self._grads)
        nnx.update((self.module, self.optimizer), new_state)
        self._grads = None
        self._state = None

    def _update_program(self):
        gd, state = nnx.split((self.module, self.optimizer))
        key = ("update", gd, self.strategy, _signature(state))
        return _cached(key, lambda: make_update(gd, state, self.strategy)), state

    def count_collectives(self, x, t, dy_of) -> tuple[dict, Any]:
        """Collectives of this stage's forward, backward and update programs for one micro-batch;
        runs the forward and one backward to get real arguments and leaves the gradient sum as it
        was. ``dy_of(y)``: the cotangent of the forward's output. Returns ``(counts, (y, dx))``.
        """
        from ..debug import count_collectives

        params, rest = self._state
        prog = self._programs_for(x, t)
        counts = {"forward": count_collectives(prog.fwd, params, rest, x, t)}
        y, stash = self.forward(0, x, t)
        dy = dy_of(y)
        saved = self._grads
        dx = self.backward(stash, dy)
        counts["backward"] = count_collectives(
            prog.bwd, params, rest, stash.x, stash.t, stash.residuals, dy, saved
        )
        fn, state = self._update_program()
        counts["update"] = count_collectives(fn, state, self._grads)
        self._grads = saved
        return counts, (y, dx)

    # -- state -------------------------------------------------------------------------------
    def gathered(self) -> nnx.Module:
        """The stage's module with plain (gathered) values."""
        return gather_state(self.module)

    def write_back(self) -> None:
        """Copy the trained values into the module the user gave (and so into their model)."""
        nnx.update(self.user_module, nnx.state(self.gathered()))

    def __repr__(self):
        return f"Stage({self.index}, placement={self.placement!r})"


def loss_seed(loss: GlobalTensor, microbatches: int):
    """The cotangent of one micro-batch loss: ``1 / m`` (the batch loss is the micro-batch mean)."""
    return np.asarray(1.0 / microbatches, dtype=np.dtype(loss.dtype))
