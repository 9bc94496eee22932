"""``make_train_step``: an ordinary NNX train step, compiled once per model structure by
``jsbp.jit`` with the layouts of a ``Strategy``.

The step is the usual one — ``loss, grads = value_and_grad(loss_fn)(model, batch)`` then
``optimizer.update(model, grads)`` — written once and run unchanged for every strategy. What the
strategy adds are layout annotations only:

* under ZeRO-3 each parameter is boxed from its stored (split) layout to its use layout just
  before the model reads it, with its gradient boxed back to the split (``to_global(p, sbp=use,
  grad_sbp=split)``: all-gather forward, reduce-scatter backward);
* every gradient is boxed to its strategy layout before the optimizer reads it (data parallel:
  ``P -> B``, one all-reduce; ZeRO-2/3: ``P -> S``, one reduce-scatter);
* every state leaf leaves the step in the layout it came in (``out_sbp``), so layouts never
  drift across steps;
* ``constrain`` calls inside the model follow the strategy's logical names.

With ``accum=k`` the batch carries ``k`` micro-batches on a leading dim; their gradients are
summed in a ``lax.scan`` (staying ``P`` under data parallelism, so the reduction happens once)
and the optimizer runs once per batch. With ``strategy=None`` the same step runs under plain
``jax.jit`` on one device — the reference every strategy is tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .._errors import SbpError
from .._jit import jit as sbp_jit
from .._sbp import broadcast as _sbp_broadcast
from .._tensor import GlobalTensor, is_key_dtype, tensor, to_global
from ._state import _is_global, _plain, _put, local_nbytes
from ._strategy import Strategy, activate, leaf_layouts

__all__ = ["make_train_step", "TrainStep"]


def _map_flat(state: nnx.State, fn: Callable[[tuple, Any], Any]) -> nnx.State:
    flat = list(nnx.to_flat_state(state))
    out = []
    for path, var in flat:
        out.append((path, var.replace(fn(path, var.get_value()))))
    return nnx.from_flat_state(out)


class TrainStep:
    """``step(model, optimizer, batch) -> loss``: one optimizer update, in place (like ``nnx.jit``).

    ``step.pure(graphdef)`` gives the functional form ``(state, batch) -> (state, loss)`` over
    ``nnx.split((model, optimizer))``; ``step.explain(...)`` and ``step.count_collectives(...)``
    report the plan and the compiled collectives of one step.
    """

    def __init__(self, loss_fn: Callable, strategy: Strategy | None = None, *, accum: int = 1):
        if strategy is not None and not isinstance(strategy, Strategy):
            raise SbpError(
                f"make_train_step: strategy must be a jsbp.flax.Strategy or None, got {strategy!r}."
            )
        if not isinstance(accum, int) or accum < 1:
            raise SbpError(f"make_train_step: accum must be a positive int, got {accum!r}.")
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.accum = accum
        self._cache: dict = {}

    # -- batches --------------------------------------------------------------------------------
    def put_batch(self, batch):
        """Lay a host batch out for this step: ``(N, ...)`` -> ``(accum, N // accum, ...)`` when
        accumulating, split over the data axis on the batch dim. Global tensors pass through."""

        def one(x):
            if _is_global(x):
                return x
            if is_key_dtype(getattr(x, "dtype", None)):  # a PRNG key in the batch: B, never cut
                if self.accum > 1:
                    raise SbpError(
                        "train step: a PRNG key in the batch cannot be cut into accum micro-batches; "
                        "pass an nnx.Rngs as step(model, optimizer, batch, rngs) instead."
                    )
                if self.strategy is None:
                    return x
                return tensor(x, placement=self.strategy.placement, sbp=_sbp_broadcast)
            x = np.asarray(x)
            if self.accum > 1:
                if x.shape[0] % self.accum:
                    raise SbpError(
                        f"train step: a batch of {x.shape[0]} rows cannot be cut into accum={self.accum} "
                        "equal micro-batches; make the batch size a multiple of accum."
                    )
                x = x.reshape((self.accum, x.shape[0] // self.accum) + x.shape[1:])
            if self.strategy is None:
                return jnp.asarray(x)
            nd = self.strategy.batch_sbp(x.ndim, accum=self.accum > 1)
            return tensor(x, placement=self.strategy.placement, sbp=nd)

        return jax.tree.map(one, batch, is_leaf=_is_global)

    # -- the logical step ------------------------------------------------------------------------
    def _grad_fn(self, plans):
        """``(params, rest, micro_batch) -> ((loss, rest), grads)`` with ZeRO-3's use boxing."""
        loss_fn, strategy = self.loss_fn, self.strategy
        zero3 = strategy is not None and strategy.zero >= 3

        def use(path, p):
            lay = plans[(0,) + path]
            return to_global(p, sbp=lay.use, grad_sbp=lay.grad)

        def make(mdef, rdef=None):
            def loss_of(params, rest, mb):
                if zero3:
                    params = _map_flat(params, use)
                before = {p: v.get_value() for p, v in nnx.to_flat_state(params)}
                # fresh Variables at this trace level: the model may mutate non-Param state in
                # place (BatchNorm statistics, RNG counts), returned below as the aux output
                rest, rstate = jax.tree.map(lambda v: v, rest)
                m = nnx.merge(mdef, params, rest)
                if rdef is None:
                    loss, rout = loss_fn(m, mb), None
                else:
                    r = nnx.merge(rdef, rstate)  # the call-time nnx.Rngs: its counts advance
                    loss, rout = loss_fn(m, mb, r), nnx.state(r)
                return loss, (nnx.state(m, nnx.Not(nnx.Param)), rout, _assigned(before, m))

            return jax.value_and_grad(loss_of, has_aux=True)

        return make

    def _logical(self, graphdef, plans, carry_sbp=None):
        accum, strategy = self.accum, self.strategy
        make_grad_fn = self._grad_fn(plans)

        def reduce_grad(path, g):
            if strategy is None:
                return g
            return to_global(g, sbp=plans[(0,) + path].grad)

        def pin(x, nd):
            return x if nd is None else to_global(x, sbp=nd)

        def update_shard(path, p):
            # ZeRO-1/2: each device updates its shard of a replicated parameter (the optimizer
            # state is split that way; the parameter's slice is local), and the updated
            # parameters go back to their stored layout as the step's outputs, gathered there as
            # combined all-gathers (gathering each update before adding it to the parameter gave
            # one all-gather per parameter)
            return to_global(p, sbp=strategy.zero_split(plans[(0,) + path].stored, np.shape(p)))

        def step(state, batch):
            model, optimizer, *rngs = nnx.merge(graphdef, state)
            mdef, params, rest = nnx.split(model, nnx.Param, ...)
            rdef, rstate = nnx.split(rngs[0]) if rngs else (None, None)
            rest = (rest, rstate)
            grad_fn = make_grad_fn(mdef, rdef)
            if accum == 1:
                (loss, (*rest, assigned)), grads = grad_fn(params, rest, batch)
            else:

                def body(carry, mb):
                    gsum, lsum, rest = carry
                    (loss_mb, (*rest, assigned)), g = grad_fn(params, rest, mb)
                    return (jax.tree.map(jnp.add, gsum, g), lsum + loss_mb, tuple(rest)), assigned

                # start the sums in the layouts one micro-batch's gradients have (P under data
                # parallelism), so they stay there through the loop and are reduced once after it
                g_nd, l_nd = carry_sbp if carry_sbp is not None else (None, None)
                zeros, tree = jax.tree.flatten(jax.tree.map(jnp.zeros_like, params))
                zeros = [pin(z, nd) for z, nd in zip(zeros, g_nd or [None] * len(zeros))]
                init = (
                    jax.tree.unflatten(tree, zeros),
                    pin(jnp.zeros((), jnp.float32), l_nd),
                    rest,
                )
                (gsum, lsum, rest), assigned = jax.lax.scan(body, init, batch)
                assigned = jax.tree.map(lambda a: a[-1], assigned)  # the last micro-batch's
                grads = jax.tree.map(lambda g: g / accum, gsum)
                loss = lsum / accum
            grads = _map_flat(grads, reduce_grad)
            nnx.update(model, rest[0])
            nnx.update(model, assigned)  # parameters the loss assigned in place, as nnx.grad does
            if rngs:
                nnx.update(rngs[0], rest[1])
            optimizer.update(model, grads)
            if strategy is not None and 1 <= strategy.zero <= 2:
                updated = nnx.All(
                    nnx.Param, getattr(optimizer, "wrt", nnx.Param)
                )  # not frozen ones
                nnx.update(model, _map_flat(nnx.state(model, updated), update_shard))
            return nnx.state((model, optimizer, *rngs)), loss

        if strategy is None:
            return step

        def traced(state, batch):
            with activate(strategy):
                return step(state, batch)

        return traced

    def _carry_sbp(self, graphdef, plans, state, batch):
        """The layouts of one micro-batch's gradients and loss, read from jsbp's plan of a probe
        (inference only, nothing is compiled)."""
        strategy = self.strategy
        make_grad_fn = self._grad_fn(plans)

        def probe(state, mb):
            with activate(strategy):
                model, _, *rngs = nnx.merge(graphdef, state)
                mdef, params, rest = nnx.split(model, nnx.Param, ...)
                rdef, rstate = nnx.split(rngs[0]) if rngs else (None, None)
                (loss, _), grads = make_grad_fn(mdef, rdef)(params, (rest, rstate), mb)
                return jax.tree.leaves(grads), loss

        def micro(x):
            return _zeros_like_micro(x, strategy.batch_sbp(x.ndim - 1), strategy.placement)

        mb = jax.tree.map(micro, batch, is_leaf=_is_global)
        entry = sbp_jit(probe).lower_program(state, mb)
        outs = [lay.nd_sbp for lay in entry.out_layouts]
        return outs[:-1], outs[-1]

    def _compiled(self, graphdef, state, batch):
        # one program per model structure and state layouts (the outputs keep the input layouts)
        key = (
            graphdef,
            tuple(
                x.sbp if _is_global(x) else None for x in jax.tree.leaves(state, is_leaf=_is_global)
            ),
        )
        fn = _lookup(self._cache, key)
        if fn is not None:
            return fn
        if self.strategy is None:
            fn = jax.jit(self._logical(graphdef, None))
        else:
            flat = list(nnx.to_flat_state(state))
            plans = leaf_layouts(flat, self.strategy)
            carry = self._carry_sbp(graphdef, plans, state, batch) if self.accum > 1 else None
            leaves = jax.tree.leaves(state, is_leaf=_is_global)
            out_sbp = [x.sbp if _is_global(x) else None for x in leaves] + [None]
            fn = sbp_jit(self._logical(graphdef, plans, carry), out_sbp=out_sbp)
        _store(self._cache, key, fn)
        return fn

    def pure(self, graphdef, state, batch):
        """The compiled functional step ``(state, batch) -> (state, loss)`` for
        ``graphdef, state = nnx.split((model, optimizer))`` and a batch from ``put_batch``."""
        return self._compiled(graphdef, state, batch)

    def _objects(self, model, optimizer, rngs):
        if rngs is None:
            return (model, optimizer)
        if not isinstance(rngs, nnx.Rngs):
            raise SbpError(
                f"train step: rngs must be an nnx.Rngs (e.g. nnx.Rngs(dropout=0)), got {type(rngs).__name__}; "
                "loss_fn(model, batch, rngs) receives it and its counts advance in place."
            )
        if self.strategy is not None and any(
            isinstance(v, GlobalTensor) and v.placement != self.strategy.placement
            for v in jax.tree.leaves(nnx.state(rngs), is_leaf=_is_global)
        ):
            raise SbpError("train step: rngs live on another placement than the strategy's.")
        return (model, optimizer, rngs)

    def _split(self, model, optimizer, rngs):
        objs = self._objects(model, optimizer, rngs)
        graphdef, state = nnx.split(objs)
        if rngs is not None and self.strategy is not None:
            state = _put_rngs(state, self.strategy)
        return objs, graphdef, state

    def __call__(self, model, optimizer, batch, rngs=None):
        """One update in place. With ``rngs`` (an ``nnx.Rngs``), ``loss_fn(model, batch, rngs)``
        receives it — pass it on, Flax's way: ``model(x, rngs=rngs)`` — and its counts advance,
        so the next step draws new keys (the same ones as on one device)."""
        objs, graphdef, state = self._split(model, optimizer, rngs)
        batch = self.put_batch(batch)
        fn = self._compiled(graphdef, state, batch)
        new_state, loss = fn(state, batch)
        nnx.update(objs, _plain_arrays_back(state, new_state))
        return loss

    # -- reports ----------------------------------------------------------------------------
    def explain(self, model, optimizer, batch, rngs=None):
        """``jsbp.explain`` of one step (the plan: every boxing and its collectives)."""
        from .._explain import explain

        if self.strategy is None:
            raise SbpError(
                "explain: this step has no strategy (it runs on one device with plain jax.jit)."
            )
        _, graphdef, state = self._split(model, optimizer, rngs)
        batch = self.put_batch(batch)
        return explain(self._compiled(graphdef, state, batch), state, batch)

    def memory(self, model, optimizer, batch, rngs=None) -> dict[str, int]:
        """Bytes per device of one step: ``state`` (model + optimizer state on the fullest device,
        from the local shards), XLA's figures for the compiled step (``jsbp.debug.measured_bytes``:
        ``in_place`` is the step with its state updated in place) and, for a strategy chosen by
        ``Strategy.auto``, the ``predicted`` peak and ``predicted_state``."""
        from .._cost import measured_bytes

        if self.strategy is None:
            raise SbpError(
                "memory: this step has no strategy (it runs on one device with plain jax.jit)."
            )
        _, graphdef, state = self._split(model, optimizer, rngs)
        batch = self.put_batch(batch)
        out = {"state": max(local_nbytes((model, optimizer)) or [0])}
        out.update(measured_bytes(self._compiled(graphdef, state, batch), state, batch))
        report = self.strategy.report
        if report is not None:
            out.update(
                predicted=report.chosen.estimate.peak_bytes, predicted_state=report.state_bytes
            )
        return out

    def count_collectives(self, model, optimizer, batch, rngs=None) -> dict[str, int]:
        """The collectives XLA emits for one step (``jsbp.debug.count_collectives``)."""
        from ..debug import count_collectives

        _, graphdef, state = self._split(model, optimizer, rngs)
        batch = self.put_batch(batch)
        return count_collectives(self._compiled(graphdef, state, batch), state, batch)


def _lookup(cache: dict, key):
    """``cache[key]`` or None. A model's ``GraphDef`` holds its static attributes, which need not
    hash (a ``@dataclass`` config on a module): such keys are found by ``==`` among the entries
    stored under ``_UNHASHABLE``, as ``jax.jit`` compares a static argument it cannot hash."""
    try:
        return cache.get(key)
    except TypeError:
        for k, v in cache.get(_UNHASHABLE, ()):
            if _same(k, key):
                return v
        return None


def _store(cache: dict, key, value) -> None:
    try:
        cache[key] = value
    except TypeError:
        cache.setdefault(_UNHASHABLE, []).append((key, value))


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an attribute whose == raises or is ambiguous (an array): not the same
        return False


_UNHASHABLE = object()  # the cache's list of (unhashable key, value) pairs


def _assigned(before: dict, model) -> nnx.State:
    """The parameters ``model``'s forward assigned in place (``nnx.SpectralNorm`` /
    ``nnx.WeightNorm`` write the normalised kernel back into the layer): ``nnx.grad`` writes such
    assignments back into the model before the optimizer reads it, so the step does too. Only
    the assigned leaves (a trace-time identity test), so the others keep their stored layouts."""
    out = [
        (p, v)
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if p in before and v.get_value() is not before[p]
    ]
    return nnx.from_flat_state(out)


def _plain_arrays_back(state, new_state):
    """``new_state`` with the plain arrays a module holds (attributes that are no ``Variable``:
    ``self.freqs = jnp.arange(...)``, ``nnx.WeightNorm``'s scales) plain again: the step returns
    them as B global tensors, and NNX would split a GlobalTensor attribute as a pytree node."""
    raw = {p for p, v in nnx.to_flat_state(state) if not isinstance(v, nnx.Variable)}
    if not raw:
        return new_state
    flat = [(p, _plain(v) if p in raw else v) for p, v in nnx.to_flat_state(new_state)]
    return nnx.from_flat_state(flat)


def _put_rngs(state, strategy):
    """The call-time ``nnx.Rngs`` (the last object of the state) on the strategy's placement, B:
    plain keys / counts are put there (in place), so later steps see global tensors."""
    b = (_sbp_broadcast,) * strategy.placement.ndim
    flat = list(nnx.to_flat_state(state))
    last = max(p[0] for p, _ in flat)
    out = []
    for path, var in flat:
        v = var.get_value()
        if path[0] == last and not isinstance(v, GlobalTensor):
            var = var.replace(_put(v, strategy.placement, b))
        out.append((path, var))
    return nnx.from_flat_state(out)


def _zeros_like_micro(x, nd, placement):
    """A zero global tensor shaped like one micro-batch of ``x`` (leading accum dim dropped)."""
    from .._tensor import zeros

    return zeros(tuple(x.shape[1:]), placement=placement, sbp=nd, dtype=x.dtype)


def make_train_step(
    loss_fn: Callable, strategy: Strategy | None = None, *, accum: int = 1
) -> TrainStep:
    """A train step for ``loss_fn(model, batch) -> scalar`` under ``strategy``.

    >>> step = make_train_step(loss_fn, strategy, accum=2)            # doctest: +SKIP
    >>> model, opt = jsbp.flax.shard((model, opt), strategy)          # doctest: +SKIP
    >>> loss = step(model, opt, batch)   # batch: host arrays or GlobalTensors  # doctest: +SKIP

    ``strategy=None`` runs the identical step under ``jax.jit`` on one device.
    """
    return TrainStep(loss_fn, strategy, accum=accum)
