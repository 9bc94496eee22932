"""A table of bad inputs (issue 19 item 4): each raises exactly ``jsbp.SbpError`` or
``jsbp.PlacementError`` (never a raw Python / JAX error) with a message that names the op, the
shape / placement / sbp involved, and what to change.

Each row is ``(id, call, error type, regex)``; ``call`` takes the namespace ``E`` of ready-made
placements and tensors of ``_env``. The regex is searched in the message (``re.S``).
"""

from __future__ import annotations

import re
import types

import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp import sbp
from jsbp.rules import _registry

S, Pl = jsbp.SbpError, jsbp.PlacementError


def _env():
    p = jsbp.placement("cpu", [0, 1, 2, 3])
    q = jsbp.placement("cpu", [[0, 1], [2, 3]], axis_names=("dp", "tp"))
    r = jsbp.placement("cpu", [4, 5, 6, 7])
    x = jsbp.tensor(np.ones((4, 6), np.float32), placement=p, sbp="S(0)")
    return types.SimpleNamespace(
        p=p,
        q=q,
        r=r,
        x=x,
        y=jsbp.tensor(np.ones((4, 5), np.float32), placement=p, sbp="S(0)"),
        xr=jsbp.tensor(np.ones((4, 6), np.float32), placement=r, sbp="B"),
        v=jsbp.tensor(np.arange(8.0, dtype=np.float32), placement=p, sbp="B"),
    )


@pytest.fixture(scope="module")
def env():
    return _env()


def ones(e, sbp_, shape=(4, 6), placement=None):
    return jsbp.tensor(np.ones(shape, np.float32), placement=placement or e.p, sbp=sbp_)


# -- a private primitive, so malformed rules never touch the real ones ------------------------
def _probe_primitive():
    from jax.extend.core import Primitive

    prim = Primitive("jsbp_bad_inputs_probe")
    prim.def_abstract_eval(lambda a: a)
    prim.def_impl(lambda a: a)
    return prim


_PROBE = _probe_primitive()


def with_rule(rule, *, nd=False):
    """Run the probe primitive under jsbp.jit with ``rule`` as its SBP rule."""

    def call(e):
        old = _registry._RULES.get(_PROBE.name)
        jsbp.register_sbp_rule(_PROBE.name, nd=nd)(rule)
        try:
            return jsbp.jit(lambda a: _PROBE.bind(a))(e.x)
        finally:
            if old is None:
                _registry._RULES.pop(_PROBE.name, None)
            else:
                _registry._RULES[_PROBE.name] = old

    return call


ROWS = [
    # ---- SBP values -----------------------------------------------------------------------
    ("sbp-bytes", lambda e: ones(e, b"B"), S, r"b'B'.*bytes.*give a str such as 'B'"),
    ("sbp-bytes-nd", lambda e: ones(e, (b"B", "B"), placement=e.q), S, r"b'B'.*bytes"),
    ("sbp-garbage-str", lambda e: ones(e, "Q"), S, r"'Q'.*valid forms are.*S\(<int>\)"),
    ("sbp-bad-split", lambda e: ones(e, "S(x)"), S, r"'S\(x\)'.*valid forms"),
    ("sbp-int", lambda e: ones(e, 3), S, r"3 \(int\).*nd-sbp|3 \(int\).*SBP"),
    ("sbp-float-in-tuple", lambda e: ones(e, (1.5,)), S, r"1\.5 \(float\).*valid forms"),
    (
        "sbp-unbalanced",
        lambda e: ones(e, "(S(0), B", placement=e.q),
        S,
        r"unbalanced parentheses.*\(S\(0\), B\)",
    ),
    (
        "sbp-too-many",
        lambda e: ones(e, ("S(0)", "B")),
        S,
        r"2 entries.*placement has 1 axis.*one SBP per placement axis",
    ),
    ("sbp-too-few", lambda e: ones(e, "S(0)", placement=e.q), S, r"1 entry.*placement has 2 axes"),
    (
        "sbp-mixed-partials",
        lambda e: ones(e, ("P", "Pmax"), placement=e.q),
        S,
        r"mixes partial kinds",
    ),
    (
        "sbp-split-out-of-range",
        lambda e: ones(e, "S(2)"),
        S,
        r"split dim 2.*shape \(4, 6\).*valid split dims",
    ),
    (
        "sbp-split-neg-out-of-range",
        lambda e: ones(e, "S(-3)"),
        S,
        r"split dim -3.*shape \(4, 6\).*valid split dims",
    ),
    (
        "sbp-split-scalar",
        lambda e: jsbp.tensor(1.0, placement=e.p, sbp="S(0)"),
        S,
        r"a scalar cannot be split; use B or P",
    ),
    ("sbp-parse-bytes", lambda e: sbp.parse(b"S(0)"), S, r"bytes.*give a str"),
    ("sbp-parse-none", lambda e: sbp.parse(None), S, r"None \(NoneType\).*valid forms"),
    # ---- placements -----------------------------------------------------------------------
    (
        "ranks-huge",
        lambda e: jsbp.placement("cpu", [2**70]),
        Pl,
        r"JAX device ids.*1180591620717411303424",
    ),
    (
        "ranks-str",
        lambda e: jsbp.placement("cpu", "01"),
        Pl,
        r"'01' is a str.*ints, e\.g\. \[0, 1\]",
    ),
    ("ranks-bytes", lambda e: jsbp.placement("cpu", b"01"), Pl, r"is a bytes.*ints"),
    ("ranks-empty", lambda e: jsbp.placement("cpu", []), Pl, r"name no device.*at least one"),
    (
        "ranks-ragged",
        lambda e: jsbp.placement("cpu", [[0, 1], [2]]),
        Pl,
        r"\[\[0, 1\], \[2\]\].*ragged",
    ),
    (
        "ranks-repeat",
        lambda e: jsbp.placement("cpu", [0, 1, 1]),
        Pl,
        r"repeat device id\(s\) \[1\]",
    ),
    ("ranks-unknown", lambda e: jsbp.placement("cpu", [0, 99]), Pl, r"\[99\].*valid cpu ids are"),
    ("ranks-negative", lambda e: jsbp.placement("cpu", [0, -1]), Pl, r"\[-1\].*valid cpu ids are"),
    (
        "ranks-float",
        lambda e: jsbp.placement("cpu", [0, 1.5]),
        Pl,
        r"integer JAX device ids.*1\.5 \(float\)",
    ),
    (
        "ranks-bool",
        lambda e: jsbp.placement("cpu", [True]),
        Pl,
        r"integer JAX device ids.*True \(bool\)",
    ),
    ("ranks-none", lambda e: jsbp.placement("cpu", [None]), Pl, r"integer JAX device ids.*None"),
    ("axis-size-name", lambda e: e.q.axis_size("zz"), Pl, r"no axis named 'zz'.*\['dp', 'tp'\]"),
    ("axis-size-index", lambda e: e.q.axis_size(5), Pl, r"axis 5 is out of range.*2 axes.*0\.\.1"),
    ("axis-size-neg", lambda e: e.q.axis_size(-3), Pl, r"axis -3 is out of range"),
    (
        "axis-size-float",
        lambda e: e.q.axis_size(1.5),
        Pl,
        r"axis name \['dp', 'tp'\] or index 0\.\.1.*1\.5 \(float\)",
    ),
    ("axis-size-none", lambda e: e.q.axis_size(None), Pl, r"got None \(NoneType\)"),
    (
        "tensor-placement-str",
        lambda e: jsbp.tensor([1.0], placement="cpu", sbp="B"),
        Pl,
        r"placement",
    ),
    # ---- from_local -----------------------------------------------------------------------
    (
        "from-local-strings",
        lambda e: jsbp.from_local(["a", "b", "c", "d"], placement=e.p, sbp="S(0)"),
        S,
        r"from_local: local 'a' \(str\) is not a numeric array",
    ),
    (
        "from-local-objects",
        lambda e: jsbp.from_local([object()] * 4, placement=e.p, sbp="S(0)"),
        S,
        r"from_local: local <object.*\(object\) is not a numeric array",
    ),
    (
        "from-local-nones",
        lambda e: jsbp.from_local([None] * 4, placement=e.p, sbp="S(0)"),
        S,
        r"from_local: local None \(NoneType\) is not a numeric array",
    ),
    (
        "from-local-none",
        lambda e: jsbp.from_local(None, placement=e.p, sbp="S(0)"),
        S,
        r"from_local: locals must be a list of arrays.*got NoneType",
    ),
    (
        "from-local-one-string",
        lambda e: jsbp.from_local("abcd", placement=e.p, sbp="S(0)"),
        S,
        r"locals must be a list.*got str",
    ),
    (
        "from-local-count",
        lambda e: jsbp.from_local([np.ones(2)] * 3, placement=e.p, sbp="S(0)"),
        S,
        r"got 3 local arrays.*owns 4 device\(s\)",
    ),
    (
        "from-local-dtypes",
        lambda e: jsbp.from_local(
            [np.ones(2, np.float32)] * 3 + [np.ones(2, np.int32)], placement=e.p, sbp="S(0)"
        ),
        S,
        r"different dtypes.*share one dtype",
    ),
    (
        "from-local-ranks",
        lambda e: jsbp.from_local([np.ones(2)] * 3 + [np.ones((2, 1))], placement=e.p, sbp="S(0)"),
        S,
        r"different ranks \[1, 2\]",
    ),
    (
        "from-local-placement",
        lambda e: jsbp.from_local([np.ones(2)] * 4, placement="cpu", sbp="S(0)"),
        Pl,
        r"from_local: placement must be a jsbp\.placement",
    ),
    (
        "from-local-no-sbp",
        lambda e: jsbp.from_local([np.ones(2)] * 4, placement=e.p),
        S,
        r"from_local: pass sbp=",
    ),
    # ---- constructors / dtypes ------------------------------------------------------------
    (
        "dtype-notatype",
        lambda e: jsbp.zeros(4, placement=e.p, sbp="B", dtype="notatype"),
        S,
        r"dtype 'notatype' is not a numeric data type.*jnp\.float32",
    ),
    (
        "dtype-str",
        lambda e: jsbp.tensor([1.0], placement=e.p, sbp="B", dtype=str),
        S,
        r"is not a numeric data type",
    ),
    (
        "dtype-object",
        lambda e: jsbp.ones(2, placement=e.p, sbp="B", dtype=object),
        S,
        r"is not a numeric data type",
    ),
    (
        "astype-notatype",
        lambda e: e.x.astype("notatype"),
        S,
        r"'notatype' is not a numeric data type",
    ),
    (
        "tensor-object",
        lambda e: jsbp.tensor([object()], placement=e.p, sbp="B"),
        S,
        r"tensor: cannot make a tensor from list",
    ),
    (
        "tensor-huge-int",
        lambda e: jsbp.tensor([2**70], placement=e.p, sbp="B"),
        S,
        r"does not fit a 64-bit integer",
    ),
    (
        "full-str-value",
        lambda e: jsbp.full((2,), "x", placement=e.p, sbp="B"),
        S,
        r"full: the fill value must be a number.*'x' \(str\)",
    ),
    (
        "arange-str",
        lambda e: jsbp.arange("a", placement=e.p, sbp="B"),
        S,
        r"arange: give 1 to 3 numbers.*\('a',\)",
    ),
    (
        "arange-none",
        lambda e: jsbp.arange(placement=e.p, sbp="B"),
        S,
        r"arange: give 1 to 3 numbers.*\(\)",
    ),
    (
        "arange-four",
        lambda e: jsbp.arange(1, 2, 3, 4, placement=e.p, sbp="B"),
        S,
        r"arange: give 1 to 3 numbers",
    ),
    (
        "arange-zero-step",
        lambda e: jsbp.arange(0, 4, 0, placement=e.p, sbp="B"),
        S,
        r"arange\(0, 4, 0\).*non-zero step",
    ),
    (
        "randn-int",
        lambda e: jsbp.randn(4, key=0, placement=e.p, sbp="B", dtype=jnp.int32),
        S,
        r"randn: dtype int32 is not a floating or complex dtype.*jnp\.float32",
    ),
    (
        "rand-int",
        lambda e: jsbp.rand(4, key=0, placement=e.p, sbp="B", dtype=jnp.int32),
        S,
        r"rand: dtype int32 is not a floating dtype",
    ),
    (
        "rand-complex",
        lambda e: jsbp.rand(4, key=0, placement=e.p, sbp="B", dtype=jnp.complex64),
        S,
        r"rand: dtype complex64 is not a floating dtype",
    ),
    (
        "randn-key-str",
        lambda e: jsbp.randn(4, key="k", placement=e.p, sbp="B"),
        S,
        r"randn: key must be an int seed or a JAX PRNG key",
    ),
    # ---- eager ops on global tensors ------------------------------------------------------
    (
        "add-shapes",
        lambda e: e.x + e.y,
        S,
        r"add on global tensors.*shape \(4, 6\).*shape \(4, 5\).*incompatible shapes.*Change the operands' shapes",
    ),
    ("sub-shapes", lambda e: e.x - e.y, S, r"subtract on global tensors.*\(4, 6\).*\(4, 5\)"),
    (
        "matmul-shapes",
        lambda e: e.x @ e.y,
        S,
        r"matmul on global tensors.*shape \(4, 6\) on cpu:4.*sbp \(S\(0\)\).*shape \(4, 5\)",
    ),
    ("dot-shapes", lambda e: e.x.dot(e.y), S, r"dot on global tensors.*\(4, 6\).*\(4, 5\)"),
    (
        "reshape-size",
        lambda e: e.x.reshape(5, 5),
        S,
        r"reshape on global tensors.*shape \(4, 6\).*\(5, 5\)",
    ),
    (
        "reshape-two-minus-one",
        lambda e: e.x.reshape(-1, -1),
        S,
        r"reshape on global tensors.*shape \(4, 6\)",
    ),
    (
        "numpy-reshape",
        lambda e: jsbp.numpy.reshape(e.x, (7,)),
        S,
        r"reshape on global tensors.*shape \(4, 6\)",
    ),
    ("sum-axis", lambda e: e.x.sum(axis=5), S, r"sum on global tensors.*shape \(4, 6\)"),
    (
        "transpose-repeat",
        lambda e: e.x.transpose(0, 0),
        S,
        r"transpose on global tensors.*shape \(4, 6\)",
    ),
    (
        "jnp-outside-jit",
        lambda e: jnp.sin(e.x),
        S,
        r"jax\.numpy.*GlobalTensor \(shape \(4, 6\).*outside jsbp\.jit.*jsbp\.numpy",
    ),
    (
        "jit-out-sbp-one-entry-on-2d",
        lambda e: jsbp.jit(lambda a: (a.sum(), a.mean()), out_sbp="B")(
            ones(e, ("B", "B"), placement=e.q)
        ),
        S,
        r"out_sbp='B'.*1 entry but the placement has 2 axes.*one SBP per placement axis",
    ),
    ("jnp-add-outside-jit", lambda e: jnp.add(e.x, 1), S, r"outside jsbp\.jit.*jsbp\.numpy\.<fn>"),
    (
        "closed-over",
        lambda e: jsbp.jit(lambda a: a + e.v)(e.x),
        S,
        r"GlobalTensor \(shape \(8,\).*closed over.*Pass it as an argument",
    ),
    ("two-placements", lambda e: e.x + e.xr, Pl, r"placement"),
    ("to-global-split", lambda e: e.x.to_global(sbp="S(5)"), S, r"split dim 5.*shape \(4, 6\)"),
    ("to-global-placement-str", lambda e: e.x.to_global(placement="cpu"), Pl, r"placement"),
    # ---- rules ----------------------------------------------------------------------------
    (
        "register-function",
        lambda e: jsbp.register_sbp_rule(jnp.add),
        S,
        r"the function 'add'.*primitive name.*make_jaxpr",
    ),
    ("register-nothing", lambda e: jsbp.register_sbp_rule(), S, r"name at least one JAX primitive"),
    ("register-int", lambda e: jsbp.register_sbp_rule(3), S, r"3 \(int\).*JAX primitive name"),
    ("register-empty-name", lambda e: jsbp.register_sbp_rule(""), S, r"JAX primitive name"),
    ("register-not-callable", lambda e: jsbp.register_sbp_rule(_PROBE.name)(42), S, r"42 \(int\)"),
    (
        "register-bad-local",
        lambda e: jsbp.register_sbp_rule(_PROBE.name, local=3),
        S,
        r"local= must be callable",
    ),
    (
        "rule-bad-string",
        with_rule(lambda ctx: iter([(("Q",), ("Q",))])),
        S,
        r"SBP rule for 'jsbp_bad_inputs_probe'.*malformed signature.*'Q'.*CONTRIBUTING",
    ),
    (
        "rule-object",
        with_rule(lambda ctx: iter([((object(),), (sbp.broadcast,))])),
        S,
        r"malformed signature.*\(object\) is not an SBP",
    ),
    (
        "rule-not-pair",
        with_rule(lambda ctx: iter([(sbp.broadcast,)])),
        S,
        r"malformed signature.*a pair \(inputs, outputs\)",
    ),
    ("rule-returns-none", with_rule(lambda ctx: None), S, r"returned None"),
    ("rule-returns-int", with_rule(lambda ctx: 5), S, r"not iterable"),
    (
        "rule-inputs-not-tuple",
        with_rule(lambda ctx: iter([(5, (sbp.broadcast,))])),
        S,
        r"5 is not a tuple of SBPs",
    ),
    (
        "rule-nd-flat",
        with_rule(lambda ctx: iter([((sbp.broadcast,), (sbp.broadcast,))]), nd=True),
        S,
        r"is not an nd-sbp",
    ),
]


@pytest.mark.parametrize(
    ("call", "err", "pattern"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_bad_input(env, call, err, pattern):
    with pytest.raises(Exception) as info:
        call(env)
    assert type(info.value) is err, f"raised {type(info.value).__name__}: {info.value}"
    assert re.search(pattern, str(info.value), re.S), str(info.value)


def test_table_size():
    assert len(ROWS) >= 60
    assert len({r[0] for r in ROWS}) == len(ROWS)


def test_strings_in_rules_are_read_as_sbps(env):
    """A rule may yield strings ("S(0)", "B"): they are read as SBPs (what used to fail with
    "'str' object has no attribute 'is_split'")."""
    out = with_rule(lambda ctx: iter([(("S(0)",), ("S(0)",)), (("B",), "B")]))
    try:
        out(env)
    except jsbp.SbpError as e:  # the probe has no lowering: only a failure past the rule is fine
        assert "malformed" not in str(e)
    except Exception as e:  # noqa: BLE001
        assert "is_split" not in str(e) and "malformed" not in str(e)
