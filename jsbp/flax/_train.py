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
from .._tensor import GlobalTensor, tensor, to_global
from ._state import leaf_layouts
from ._strategy import Strategy, activate

__all__ = ["make_train_step", "TrainStep"]


def _is_global(x):
    return isinstance(x, GlobalTensor)


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
    def _logical(self, graphdef, plans):
        loss_fn, accum, strategy = self.loss_fn, self.accum, self.strategy
        zero3 = strategy is not None and strategy.zero >= 3

        def use(path, p):
            if not zero3:
                return p
            lay = plans[(0,) + path]
            return to_global(p, sbp=lay.use, grad_sbp=lay.grad)

        def reduce_grad(path, g):
            if strategy is None:
                return g
            return to_global(g, sbp=plans[(0,) + path].grad)

        def step(state, batch):
            model, optimizer = nnx.merge(graphdef, state)
            mdef, params, rest = nnx.split(model, nnx.Param, ...)

            def loss_of(params, rest, mb):
                params = _map_flat(params, use)
                m = nnx.merge(mdef, params, rest)
                loss = loss_fn(m, mb)
                return loss, nnx.state(m, nnx.Not(nnx.Param))

            grad_fn = jax.value_and_grad(loss_of, has_aux=True)
            if accum == 1:
                (loss, rest), grads = grad_fn(params, rest, batch)
            else:

                def body(carry, mb):
                    gsum, lsum, rest = carry
                    (loss_mb, rest), g = grad_fn(params, rest, mb)
                    return (jax.tree.map(jnp.add, gsum, g), lsum + loss_mb, rest), None

                zeros = jax.tree.map(jnp.zeros_like, params)
                (gsum, lsum, rest), _ = jax.lax.scan(
                    body, (zeros, jnp.zeros((), jnp.float32), rest), batch
                )
                grads = jax.tree.map(lambda g: g / accum, gsum)
                loss = lsum / accum
            grads = _map_flat(grads, reduce_grad)
            nnx.update(model, rest)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

        if strategy is None:
            return step

        def traced(state, batch):
            with activate(strategy):
                return step(state, batch)

        return traced

    def _compiled(self, graphdef, state):
        key = graphdef
        fn = self._cache.get(key)
        if fn is not None:
            return fn
        if self.strategy is None:
            fn = jax.jit(self._logical(graphdef, None))
        else:
            flat = list(nnx.to_flat_state(state))
            plans = leaf_layouts(flat, self.strategy)
            leaves = jax.tree.leaves(state, is_leaf=_is_global)
            out_sbp = [x.sbp if _is_global(x) else None for x in leaves] + [None]
            fn = sbp_jit(self._logical(graphdef, plans), out_sbp=out_sbp)
        self._cache[key] = fn
        return fn

    def pure(self, graphdef, state):
        """The compiled functional step for ``nnx.split((model, optimizer))``'s graphdef."""
        return self._compiled(graphdef, state)

    def __call__(self, model, optimizer, batch):
        graphdef, state = nnx.split((model, optimizer))
        fn = self._compiled(graphdef, state)
        new_state, loss = fn(state, self.put_batch(batch))
        nnx.update((model, optimizer), new_state)
        return loss

    # -- reports ----------------------------------------------------------------------------
    def explain(self, model, optimizer, batch):
        """``jsbp.explain`` of one step (the plan: every boxing and its collectives)."""
        from .._explain import explain

        if self.strategy is None:
            raise SbpError(
                "explain: this step has no strategy (it runs on one device with plain jax.jit)."
            )
        graphdef, state = nnx.split((model, optimizer))
        return explain(self._compiled(graphdef, state), state, self.put_batch(batch))

    def count_collectives(self, model, optimizer, batch) -> dict[str, int]:
        """The collectives XLA emits for one step (``jsbp.debug.count_collectives``)."""
        from ..debug import count_collectives

        graphdef, state = nnx.split((model, optimizer))
        return count_collectives(self._compiled(graphdef, state), state, self.put_batch(batch))


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
