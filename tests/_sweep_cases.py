"""The op sweep's machinery: input makers, layouts, one-device reference and the comparison.

The registry of functions lives in ``tests/_sweep_registry.py``; the pytest entry point is
``tests/test_op_sweep.py``; ``benchmarks/op_sweep_report.py`` runs everything and prints a table.

A *case* is one function, one placement, one layout (an nd-sbp per input), one shape set and one
dtype. Every case compiles ONE ``jsbp.jit`` program that calls the function twice, on two
different inputs, and, where the entry gives a variant with other constants (``fn2``), a third
time; it compares every result with the same calls on one device (plain ``jnp`` arrays, eager):

* int / bool / unsigned outputs: exactly;
* float32 / complex64: rtol = atol = 1e-5;
* float16 / bfloat16: looser (rtol = 1e-2, atol = 2e-2 times the largest magnitude in the
  reference output, at least 1), because one-device XLA and the per-shard program round
  intermediate results differently at that precision: a contraction over a split dim rounds
  each device's partial sum (P) to bfloat16 before the sum, and a linear op applied to P
  addends rounds each addend; where the output cancels (a 1.06 made of terms of 16) that is a
  few ulps of the terms, not of the result.

A case passes when the values match (dtype and shape included) or when ``jsbp.jit`` raises a
``jsbp.SbpError`` ("raise instead of compute"); any other exception or a wrong value fails.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _oracle import addend_id, coords, local_slice, partial_axes

import jsbp

# ----------------------------------------------------------------------------------------------
# registry entries


@dataclasses.dataclass(frozen=True)
class Arg:
    """One input of a function.

    domain: how values are drawn (see ``make_input``); dtype: None follows the case's dtype,
    otherwise fixed (e.g. int32 indices, uint32 keys); linear: the function is linear in this
    input (P keeps P under a correct rule); layouts: restrict the layouts (e.g. keys: B, S(0)).
    """

    domain: str = "any"
    dtype: str | None = None
    linear: bool = False
    layouts: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Op:
    name: str  # the public function, e.g. "jnp.sum"; variants share it and add a tag
    fn: Callable
    args: tuple[Arg, ...]
    shapes: tuple[tuple[tuple[int, ...], ...], ...]  # shape sets, one shape per input
    dtypes: tuple[str, ...] = ("float32",)
    fn2: Callable | None = None  # the second call (different constants); default fn
    tag: str = ""  # variant tag, part of the id
    tol: tuple[float, float] | None = None  # (rtol, atol) override for float32

    @property
    def id(self) -> str:
        return self.name + (f"[{self.tag}]" if self.tag else "")


# shape families -------------------------------------------------------------------------------

EVEN = (8, 4)
UNEVEN3 = (5, 7, 3)
UNEVEN2 = (7, 5)
EMPTYBLK = (3, 5)  # 3 over 4 devices: one block is empty
ZERO1 = (0,)
ZERO2 = (0, 3)

UNARY_SHAPES = tuple((s,) for s in (EVEN, UNEVEN3, UNEVEN2, EMPTYBLK, ZERO1, ZERO2))
NONEMPTY_SHAPES = tuple((s,) for s in (EVEN, UNEVEN3, UNEVEN2, EMPTYBLK))
ND2_SHAPES = tuple((s,) for s in (EVEN, UNEVEN3, UNEVEN2, EMPTYBLK, ZERO2))  # ndim >= 2
ND2_NONEMPTY = tuple((s,) for s in (EVEN, UNEVEN3, UNEVEN2, EMPTYBLK))
BINARY_SHAPES = (
    (EVEN, EVEN),
    (UNEVEN3, UNEVEN3),
    (UNEVEN2, (5,)),  # broadcasting
    (EMPTYBLK, (3, 1)),
    (ZERO2, ZERO2),
    (ZERO1, ZERO1),
)


def same(shapes, n):
    """Shape sets for an n-input function whose inputs all have one shape."""
    return tuple(tuple(s[0] for _ in range(n)) for s in shapes)


FLOATS = ("float32", "float16", "bfloat16")
FLOATC = ("float32", "float16", "bfloat16", "complex64")
NUM = ("float32", "int32", "float16", "bfloat16", "complex64")
REALNUM = ("float32", "int32", "float16", "bfloat16")
INTS = ("int32",)
BOOLS = ("bool",)
INTBOOL = ("int32", "bool")
ALL = ("float32", "int32", "bool", "float16", "bfloat16", "complex64")

# ----------------------------------------------------------------------------------------------
# inputs

_LOWP = ("float16", "bfloat16")


def _dyadic(rng, lo, hi, shape, den):
    """Values k/den in [lo, hi]: exact in every float dtype used, so partial addends sum exactly."""
    return rng.integers(int(lo * den), int(hi * den) + 1, size=shape) / den


def make_input(arg: Arg, shape, dtype: str, seed: int) -> np.ndarray:
    """The logical value of one input (numpy)."""
    dt = arg.dtype or dtype
    rng = np.random.default_rng(seed)
    dom = arg.domain
    den = 8 if dt in _LOWP else 64
    if dom == "key":
        return np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))
    if dt == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt in ("int32", "uint32", "int8"):
        lo, hi = {
            "any": (-9, 9),
            "pos": (1, 9),
            "nonneg": (0, 9),
            "shift": (0, 5),
            "idx": (0, 1),  # replaced by ``idx<n>`` below
        }.get(dom.split("<")[0], (-9, 9))
        m = re.fullmatch(r"idx<(-?\d+),(\d+)>", dom)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2)) - 1
        if dt == "uint32":
            lo = max(lo, 0)
        return rng.integers(lo, hi + 1, size=shape).astype(dt)
    lo, hi = {
        "any": (-3, 3),
        "pos": (0.25, 3),
        "unit": (-0.875, 0.875),
        "gt1": (1.125, 4),
        "prob": (0.0625, 0.9375),
        "small": (-1, 1),
        "near1": (0.5, 1.5),
    }[dom]
    v = _dyadic(rng, lo, hi, shape, den)
    if dt == "complex64":
        v = v + 1j * _dyadic(rng, lo, hi, shape, den)
        return v.astype(np.complex64)
    if dt == "bfloat16":
        return np.asarray(jnp.asarray(v, jnp.bfloat16))
    return v.astype(dt)


def _addends(value: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    """n full-shape addends summing exactly to ``value`` (dyadic / integer extras)."""
    rng = np.random.default_rng(seed)
    dt = value.dtype
    extras = []
    for _ in range(n - 1):
        if np.issubdtype(dt, np.integer):
            e = rng.integers(-20, 21, size=value.shape).astype(dt)
        elif dt == np.complex64:
            e = (
                _dyadic(rng, -2, 2, value.shape, 4) + 1j * _dyadic(rng, -2, 2, value.shape, 4)
            ).astype(dt)
        else:
            e = np.asarray(jnp.asarray(_dyadic(rng, -2, 2, value.shape, 2), dt))
        extras.append(e)
    if np.issubdtype(dt, np.integer):
        with np.errstate(over="ignore"):
            first = value - sum(extras, np.zeros_like(value))
    else:
        first = np.asarray(
            jnp.asarray(value) - sum((jnp.asarray(e) for e in extras), jnp.zeros_like(value))
        )
    return [first.astype(dt), *extras]


def make_global(value: np.ndarray, plc, nd: tuple[str, ...], seed: int):
    """A GlobalTensor holding ``value`` as ``nd``; partial layouts get non-trivial addends."""
    if "P" not in nd:
        return jsbp.tensor(value, placement=plc, sbp=nd)
    h = plc.hierarchy
    n = int(np.prod([h[a] for a in partial_axes(nd)]))
    adds = _addends(value, n, seed)
    locs = [local_slice(adds[addend_id(h, nd, c)], h, nd, c) for c in coords(h)]
    return jsbp.from_local(locs, placement=plc, sbp=nd)


# ----------------------------------------------------------------------------------------------
# layouts


def layout_options(arg: Arg, shape, dtype: str) -> list[str]:
    if arg.layouts is not None:
        return list(arg.layouts)
    dt = arg.dtype or dtype
    opts = [f"S({d})" for d in range(len(shape))] + ["B"]
    if dt != "bool":
        opts.append("P")
    return opts


def _dedupe(xs):
    out = []
    for x in xs:
        if x not in out:
            out.append(x)
    return out


def layouts_1d(opts: Sequence[list[str]], each: bool = True) -> list[tuple[tuple[str], ...]]:
    """Aligned combos (every input S(k) / B / P together) plus, with ``each``, every option of
    one input with the others at B: every layout of every input appears at least once."""
    n = max(len(o) for o in opts)
    combos = [tuple(o[k % len(o)] for o in opts) for k in range(n)]
    if each and len(opts) > 1:
        for i, o in enumerate(opts):
            for s in o:
                combos.append(
                    tuple(
                        s if j == i else ("B" if "B" in oj else oj[0]) for j, oj in enumerate(opts)
                    )
                )
    return [tuple((s,) for s in c) for c in _dedupe(combos)]


def _pairs(o: list[str]) -> list[tuple[str, str]]:
    n = len(o)
    return _dedupe([(o[k], o[(k + 1) % n]) for k in range(n)] + [(o[k], o[k]) for k in range(n)])


def layouts_2d(opts: Sequence[list[str]], limit: int | None = None):
    """nd-sbp pairs: per input, (o_k, o_k+1) and (o_k, o_k); aligned across inputs, plus each
    input's pairs with the others at (B, B)."""
    pairs = [_pairs(o) for o in opts]
    n = max(len(p) for p in pairs)
    combos = [tuple(p[k % len(p)] for p in pairs) for k in range(n)]
    if len(opts) > 1:
        for i, p in enumerate(pairs):
            for s in p[: max(2, len(p) // 2)]:
                combos.append(
                    tuple(
                        s if j == i else ("B", "B") if "B" in opts[j] else (opts[j][0],) * 2
                        for j in range(len(opts))
                    )
                )
    combos = _dedupe(combos)
    return combos[:limit] if limit else combos


# ----------------------------------------------------------------------------------------------
# cases


@dataclasses.dataclass(frozen=True)
class Case:
    op: Op
    plc: str  # "p4" or "p22"
    layout: tuple[tuple[str, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str

    @property
    def id(self) -> str:
        lay = "|".join(",".join(nd) for nd in self.layout).replace("(", "").replace(")", "")
        shp = "|".join("x".join(map(str, s)) or "scalar" for s in self.shapes)
        return f"{self.op.id}-{self.plc}-{lay}-{shp}-{self.dtype}"


def cases_for(op: Op) -> list[Case]:
    """Which (placement, layout, shape set, dtype) a function is swept over.

    Primary dtype (the first), first two shape sets (even, uneven): on (4,) every layout of every
    input (aligned combos, plus each option of one input with the others at B), on (2, 2) a
    window of P22_PER_SHAPE nd-sbp combos. Other shape sets (empty block, zero-size, broadcast):
    the aligned S(0) combo plus one rotating combo on (4,), and one rotating combo on (2, 2).
    Other dtypes: one uneven shape set, two aligned combos on (4,) and one on (2, 2). The
    windows rotate with the shape set / dtype so that, across them, the layouts are covered.
    """
    out = []
    for di, dtype in enumerate(op.dtypes):
        shape_sets = op.shapes if di == 0 else op.shapes[1:2] or op.shapes[:1]
        for si, shapes in enumerate(shape_sets):
            opts = [layout_options(a, s, dtype) for a, s in zip(op.args, shapes)]
            c1 = layouts_1d(opts, each=di == 0 and si < 2)
            c2 = layouts_2d(opts)
            if di == 0 and si < 2:
                w1, w2 = c1, _window(c2, si * P22_PER_SHAPE, P22_PER_SHAPE)
            elif (
                di == 0
            ):  # the aligned S(0) combo (empty blocks / zero-size along dim 0), alternating
                w1 = [c1[0]] if si % 2 == 0 else _window(c1, si, 1)
                w2 = _window(c2, 2 * P22_PER_SHAPE + si, 1)
            else:
                w1, w2 = _window(c1, di, 1), _window(c2, di + 3, 1)
            out += [Case(op, "p4", lay, shapes, dtype) for lay in w1]
            out += [Case(op, "p22", lay, shapes, dtype) for lay in w2]
    return out


def _window(combos, start, k):
    return _dedupe([combos[(start + j) % len(combos)] for j in range(min(k, len(combos)))])


P22_PER_SHAPE = 2


def sample_cases(cases: list[Case], fraction: float) -> set[str]:
    """Deterministic sample by case id (crc32), at least one case per function."""
    picked = {c.id for c in cases if zlib.crc32(c.id.encode()) % 10_000 < fraction * 10_000}
    have = {c.op.id for c in cases if c.id in picked}
    for c in cases:
        if c.op.id not in have:
            have.add(c.op.id)
            picked.add(c.id)
    return picked


# ----------------------------------------------------------------------------------------------
# running one case

_PLACEMENTS: dict[str, Any] = {}


def placement(name: str):
    if name not in _PLACEMENTS:
        _PLACEMENTS["p4"] = jsbp.placement("cpu", [0, 1, 2, 3])
        _PLACEMENTS["p22"] = jsbp.placement("cpu", [[0, 1], [2, 3]])
    return _PLACEMENTS[name]


def _tol(dtype, op: Op):
    if dtype in (jnp.float16, jnp.bfloat16) or str(dtype) in _LOWP:
        # an op whose float32 tolerance is looser than 1e-5 is ill-conditioned (standardize's
        # E[x^2] - E[x]^2): its low-precision tolerance widens by the same factor
        widen = max(1.0, op.tol[0] / 1e-5) if op.tol else 1.0
        return 1e-2 * widen, 1e-2 * widen
    return op.tol or (1e-5, 1e-5)


def _to_np(x):
    if isinstance(x, jsbp.GlobalTensor):
        return x.numpy()
    return np.asarray(x)


_PRIM = re.compile(r"primitive '([^']+)'")


@dataclasses.dataclass
class Result:
    status: str  # "pass" | "raise" | "fail"
    detail: str = ""
    primitive: str | None = None
    replicated: tuple[
        str, ...
    ] = ()  # primitives without a rule that ran replicated (NoRuleWarning)


def compare(got, want, op: Op, where: str) -> None:
    want_dt = np.asarray(want).dtype
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"{where}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want_dt}"
    if want.dtype == bool or np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        rtol, atol = _tol(want.dtype, op)
        if str(want.dtype) in _LOWP and want.size:  # scaled by the terms' magnitude (docstring)
            atol = (
                atol
                * 2
                * max(
                    1.0,
                    float(
                        np.nanmax(
                            np.abs(
                                np.where(
                                    np.isinf(want.astype(np.float32)), 0, want.astype(np.float32)
                                )
                            )
                        )
                    ),
                )
            )
        np.testing.assert_allclose(
            got.astype(np.complex128 if np.iscomplexobj(want) else np.float64),
            want.astype(np.complex128 if np.iscomplexobj(want) else np.float64),
            rtol=rtol,
            atol=atol,
            err_msg=where,
        )


def run_case(case: Case) -> Result:
    """Run one case; return pass / raise (SbpError) / fail (wrong value or other exception)."""
    op = case.op
    plc = placement(case.plc)
    n = len(op.args)
    base = zlib.crc32(case.id.encode()) % 1000
    va = [
        make_input(a, s, case.dtype, base + 11 * i)
        for i, (a, s) in enumerate(zip(op.args, case.shapes))
    ]
    vb = [
        make_input(a, s, case.dtype, base + 500 + 11 * i)
        for i, (a, s) in enumerate(zip(op.args, case.shapes))
    ]
    fn2 = op.fn2 or op.fn
    # one-device reference (a bad case definition errors here, not in jsbp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ja, jb = [jnp.asarray(v) for v in va], [jnp.asarray(v) for v in vb]
        want = (op.fn(*ja), op.fn(*jb)) + ((fn2(*jb),) if op.fn2 is not None else ())
    want_leaves = jax.tree_util.tree_leaves(want)
    try:  # building the inputs is jsbp too: any exception here (SbpError included) is a failure
        ga = [
            make_global(v, plc, nd, base + 3 * i) for i, (v, nd) in enumerate(zip(va, case.layout))
        ]
        gb = [
            make_global(v, plc, nd, base + 7 + 3 * i)
            for i, (v, nd) in enumerate(zip(vb, case.layout))
        ]
    except Exception as e:  # noqa: BLE001
        return Result(
            "fail", f"building the inputs: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
        )

    def prog(*xs):  # the same function twice on different inputs, then the second variant
        a, b = xs[:n], xs[n:]
        return (op.fn(*a), op.fn(*b)) + ((fn2(*b),) if op.fn2 is not None else ())

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jsbp.jit(prog)(*ga, *gb)
            got_leaves = jax.tree_util.tree_leaves(
                out, is_leaf=lambda x: isinstance(x, jsbp.GlobalTensor)
            )
            got_np = [_to_np(x) for x in got_leaves]
        nowarn = getattr(jsbp, "NoRuleWarning", ())
        replicated = tuple(
            sorted(
                {
                    m.group(1)
                    for w in caught
                    if nowarn and issubclass(w.category, nowarn)
                    for m in [_PRIM.search(str(w.message))]
                    if m
                }
            )
        )
    except jsbp.SbpError as e:
        m = _PRIM.search(str(e))
        return Result("raise", str(e).splitlines()[0][:300], m.group(1) if m else None)
    except Exception as e:  # noqa: BLE001 - any other exception is a failure
        return Result(
            "fail", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        )
    if len(got_leaves) != len(want_leaves):
        return Result(
            "fail", f"{len(got_leaves)} outputs, want {len(want_leaves)}", replicated=replicated
        )
    calls = ["first call", "second call (other input)", "third call (fn2, other constants)"]
    where = [
        f"{calls[k]}, output {j}"
        for k, part in enumerate(want)
        for j in range(len(jax.tree_util.tree_leaves(part)))
    ]
    try:
        for i, (g, w) in enumerate(zip(got_np, want_leaves)):
            compare(g, np.asarray(w), op, where[i])
    except AssertionError as e:
        return Result(
            "fail", "wrong value: " + " ".join(str(e).split())[:400], replicated=replicated
        )
    return Result("pass", replicated=replicated)


def log_result(case: Case, res: Result) -> None:
    path = os.environ.get("JSBP_SWEEP_LOG")
    if not path:
        return
    rec = {
        "id": case.id,
        "fn": case.op.name,
        "variant": case.op.id,
        "plc": case.plc,
        "dtype": case.dtype,
        "status": res.status,
        "primitive": res.primitive,
        "detail": res.detail,
        "replicated": list(res.replicated),
    }
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
