"""Op sweep (issue 16's net): >= 300 functions of jax.numpy / jax.nn / jax.lax / jax.random /
optax under ``jsbp.jit`` on global tensors, against the same function on one device.

Every case is one function on one placement ((4,) or (2, 2)), one layout per input (S(d) for
every dim, B, P with non-trivial addends), one shape set (even, uneven, an empty block,
zero-size) and one dtype; its program calls the function TWICE on different inputs (and with
different constants where the registry gives a second variant), so an inlined helper whose
second call returns the first call's values fails. Comparison: exact for int / bool, rtol =
atol = 1e-5 for float32 / complex64, 1e-2 for float16 / bfloat16 (see ``_sweep_cases``).

A case passes when the values match or when jsbp raises ``jsbp.SbpError`` (recorded with the
primitive it names); any other exception or a wrong value fails. Nothing is skipped or xfailed
to hide a failure.

The default run samples the cases (deterministically, by case id; at least one per function);
``JSBP_FULL=1`` runs all of them. ``python benchmarks/op_sweep_report.py`` runs the full sweep
and prints functions x cases with pass / raise / fail counts.
"""

from __future__ import annotations

import os

import pytest
from _sweep_cases import cases_for, log_result, run_case, sample_cases
from _sweep_registry import function_names, registry

DEFAULT_FRACTION = float(os.environ.get("JSBP_SWEEP_FRACTION", "0.02"))

_OPS = registry()
_CASES = [c for op in _OPS for c in cases_for(op)]
_SAMPLED = sample_cases(_CASES, DEFAULT_FRACTION)


def _param(case):
    marks = () if case.id in _SAMPLED else (pytest.mark.slow,)
    return pytest.param(case, id=case.id, marks=marks)


def test_registry_has_300_functions():
    names = function_names()
    assert len(names) >= 300, len(names)
    ids = [op.id for op in _OPS]
    assert len(ids) == len(set(ids)), "duplicate registry entries"
    case_ids = [c.id for c in _CASES]
    assert len(case_ids) == len(set(case_ids)), "duplicate case ids"


def test_every_function_is_in_the_default_sample():
    sampled_ops = {c.op.id for c in _CASES if c.id in _SAMPLED}
    assert sampled_ops == {op.id for op in _OPS}


@pytest.mark.parametrize("case", [_param(c) for c in _CASES])
def test_op(case):
    res = run_case(case)
    log_result(case, res)
    if res.status == "fail":
        pytest.fail(f"{case.id}: {res.detail}", pytrace=False)
    # "pass", or "raise": a clear jsbp.SbpError (raise instead of compute) is allowed
