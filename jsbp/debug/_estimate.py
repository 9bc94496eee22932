"""What jsbp's cost model predicts for one call of a consistent-view function."""

from __future__ import annotations

from .._cost import DEFAULT_COST, CostModel, Estimate
from .._cost import estimate as _estimate_program


def estimate(fn, *args, cost: CostModel | None = None) -> Estimate:
    """The cost model's ``Estimate`` of the plan ``fn(*args)`` runs, per device.

    ``fn`` is a ``jsbp.jit`` function (a ``jsbp.flax`` step's ``pure(...)`` is one) or a plain
    function of global tensors, which is compiled with ``jsbp.jit`` as ``jsbp.explain`` does. The
    estimate is the one ``jsbp.auto_layouts`` and ``jsbp.flax.Strategy.auto`` rank plans by:
    ``comm_bytes`` moved by collectives and ``collectives`` launched (a combined group counts once,
    a loop body's once per iteration), ``compiled_collectives`` (what ``jsbp.explain`` lists),
    ``flops`` and memory ``traffic`` of the local shards, ``input_bytes`` and ``peak_bytes``
    (inputs + live intermediates, the state updated in place), and ``seconds``, the step time the
    rates of ``cost`` (``jsbp.CostModel()`` by default) give. ``fn`` is planned, not compiled by
    XLA and not run; compare ``peak_bytes`` with ``measured_bytes(fn, *args)["in_place"]``.

    >>> jsbp.debug.estimate(step, state, batch).collectives  # doctest: +SKIP
    2
    """
    lower_program = getattr(fn, "lower_program", None)
    if lower_program is None:
        from .._jit import jit

        lower_program = jit(fn).lower_program
    return _estimate_program(lower_program(*args).program, DEFAULT_COST if cost is None else cost)
