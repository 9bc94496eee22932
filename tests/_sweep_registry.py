"""The op sweep's registry: >= 300 functions from jax.numpy, jax.nn, jax.lax, jax.random, optax.

Each entry is an ``Op`` (see ``_sweep_cases``): the function, its inputs (domain, dtype, whether
the function is linear in it), the shape sets and dtypes it is swept over, and optionally a
second variant ``fn2`` (different constants) for the "called twice in one program" check.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.scipy.special as jss
import optax
from _sweep_cases import (
    ALL,
    BINARY_SHAPES,
    BOOLS,
    EMPTYBLK,
    EVEN,
    FLOATC,
    FLOATS,
    INTBOOL,
    INTS,
    ND2_NONEMPTY,
    ND2_SHAPES,
    NONEMPTY_SHAPES,
    NUM,
    REALNUM,
    UNARY_SHAPES,
    UNEVEN2,
    UNEVEN3,
    ZERO1,
    ZERO2,
    Arg,
    Op,
    same,
)
from jax import lax

OPS: list[Op] = []

A = Arg()
LIN = Arg(linear=True)


def add(name, fn, args, shapes, dtypes=("float32",), fn2=None, tag="", tol=None):
    OPS.append(Op(name, fn, tuple(args), tuple(shapes), tuple(dtypes), fn2, tag, tol))


def unary(
    name,
    fn,
    dom="any",
    dtypes=FLOATS,
    shapes=UNARY_SHAPES,
    fn2=None,
    linear=False,
    tag="",
    tol=None,
):
    add(name, fn, [Arg(dom, linear=linear)], shapes, dtypes, fn2, tag, tol)


def binary(
    name,
    fn,
    doms=("any", "any"),
    dtypes=FLOATS,
    shapes=BINARY_SHAPES,
    fn2=None,
    linear=(False, False),
    tag="",
    tol=None,
):
    add(name, fn, [Arg(d, linear=li) for d, li in zip(doms, linear)], shapes, dtypes, fn2, tag, tol)


def last(x):
    return x.ndim - 1


# ----------------------------------------------------------------------------------------------
# jax.numpy: elementwise unary

for nm, dom, dts, lin in [
    ("abs", "any", NUM, False),
    ("absolute", "any", REALNUM, False),
    ("negative", "any", NUM, True),
    ("positive", "any", NUM, True),
    ("sign", "any", NUM, False),
    ("floor", "any", FLOATS, False),
    ("ceil", "any", FLOATS, False),
    ("round", "any", FLOATS, False),
    ("rint", "any", FLOATS, False),
    ("trunc", "any", FLOATS, False),
    ("exp", "any", FLOATC, False),
    ("exp2", "any", FLOATS, False),
    ("expm1", "any", FLOATS, False),
    ("log", "pos", FLOATC, False),
    ("log2", "pos", FLOATS, False),
    ("log10", "pos", FLOATS, False),
    ("log1p", "pos", FLOATS, False),
    ("sqrt", "pos", FLOATC, False),
    ("cbrt", "any", FLOATS, False),
    ("square", "any", NUM, False),
    ("reciprocal", "pos", FLOATC, False),
    ("sin", "any", FLOATC, False),
    ("cos", "any", FLOATC, False),
    ("tan", "small", FLOATS, False),
    ("arcsin", "unit", FLOATS, False),
    ("arccos", "unit", FLOATS, False),
    ("arctan", "any", FLOATS, False),
    ("sinh", "any", FLOATS, False),
    ("cosh", "any", FLOATS, False),
    ("tanh", "any", FLOATC, False),
    ("arcsinh", "any", FLOATS, False),
    ("arccosh", "gt1", FLOATS, False),
    ("arctanh", "unit", FLOATS, False),
    ("deg2rad", "any", FLOATS, True),
    ("rad2deg", "any", FLOATS, True),
    ("degrees", "any", FLOATS, True),
    ("radians", "any", FLOATS, True),
    ("isnan", "any", FLOATC, False),
    ("isinf", "any", FLOATS, False),
    ("isfinite", "any", FLOATC, False),
    ("signbit", "any", REALNUM, False),
    ("sinc", "any", FLOATS, False),
    ("i0", "any", ("float32",), False),
    ("conj", "any", ("float32", "complex64"), True),
    ("conjugate", "any", ("float32", "complex64"), True),
    ("real", "any", ("float32", "complex64"), True),
    ("imag", "any", ("float32", "complex64"), True),
    ("angle", "any", ("float32", "complex64"), False),
    ("fabs", "any", FLOATS, False),
    ("spacing", "pos", ("float32",), False),
    ("arccosh", "gt1", ("float32",), False),
]:
    f = getattr(jnp, nm)
    if any(o.name == f"jnp.{nm}" for o in OPS):
        continue
    unary(f"jnp.{nm}", f, dom, dts, linear=lin)

unary(
    "jnp.nan_to_num",
    lambda x: jnp.nan_to_num(jnp.log(x)),
    "any",
    fn2=lambda x: jnp.nan_to_num(jnp.log(x), neginf=-7.0, nan=3.0),
)
unary("jnp.frexp", jnp.frexp, "any", ("float32",))
unary("jnp.modf", jnp.modf, "any", FLOATS)
unary("jnp.logical_not", jnp.logical_not, dtypes=("bool", "int32", "float32"))
unary("jnp.invert", jnp.invert, dtypes=INTBOOL)
unary("jnp.bitwise_not", jnp.bitwise_not, dtypes=INTBOOL)
unary("jnp.bitwise_count", jnp.bitwise_count, dtypes=INTS)
unary("jnp.iscomplex", jnp.iscomplex, dtypes=("complex64", "float32"))
unary("jnp.isreal", jnp.isreal, dtypes=("complex64", "float32"))
unary("jnp.isneginf", lambda x: jnp.isneginf(jnp.log(x + 1)), "any")
unary("jnp.isposinf", lambda x: jnp.isposinf(1 / x), "any")
unary(
    "jnp.astype",
    lambda x: x.astype(jnp.int32),
    dtypes=("float32", "bool"),
    fn2=lambda x: x.astype(jnp.float16),
)
unary(
    "jnp.clip",
    lambda x: jnp.clip(x, -1.0, 2.0),
    dtypes=REALNUM,
    fn2=lambda x: jnp.clip(x, 0.5, 1.0),
)
unary("jnp.power[scalar]", lambda x: jnp.power(x, 3), dtypes=REALNUM, fn2=lambda x: jnp.power(x, 2))
unary("jnp.multiply[scalar]", lambda x: x * 3, dtypes=NUM, linear=True, fn2=lambda x: x * -2)
unary("jnp.copy", jnp.copy, dtypes=ALL, linear=True)
unary("jnp.array", lambda x: jnp.array(x), dtypes=ALL, linear=True)
unary(
    "jnp.asarray", lambda x: jnp.asarray(x, jnp.float32), dtypes=("int32", "float32"), linear=True
)
unary("jnp.zeros_like", jnp.zeros_like, dtypes=ALL)
unary("jnp.ones_like", jnp.ones_like, dtypes=ALL)
unary("jnp.full_like", lambda x: jnp.full_like(x, 2), dtypes=ALL, fn2=lambda x: jnp.full_like(x, 5))
unary(
    "jnp.empty_like", lambda x: jnp.empty_like(x).shape and jnp.zeros_like(x), dtypes=("float32",)
)

# jax.scipy.special (elementwise)
unary("jss.erf", jss.erf, "any", FLOATS)
unary("jss.erfc", jss.erfc, "any", ("float32",))
unary("jss.erfinv", jss.erfinv, "unit", ("float32",))
unary("jss.expit", jss.expit, "any", FLOATS)
unary("jss.logit", jss.logit, "prob", ("float32",))
unary("jss.gammaln", jss.gammaln, "pos", ("float32",), tol=(1e-4, 1e-5))
unary("jss.digamma", jss.digamma, "pos", ("float32",), tol=(1e-4, 1e-4))
unary("jss.ndtr", jss.ndtr, "any", ("float32",))
unary("jss.ndtri", jss.ndtri, "prob", ("float32",), tol=(1e-4, 1e-5))
unary("jss.log_ndtr", jss.log_ndtr, "any", ("float32",))
unary("jss.entr", jss.entr, "prob", ("float32",))
unary("jss.i0e", jss.i0e, "any", ("float32",))
unary("jss.i1", jss.i1, "any", ("float32",))
unary(
    "jss.logsumexp",
    lambda x: jss.logsumexp(x, axis=0),
    "any",
    fn2=lambda x: jss.logsumexp(x),
    shapes=NONEMPTY_SHAPES,
)
binary("jss.xlogy", jss.xlogy, ("any", "pos"), ("float32",))
binary("jss.xlog1py", jss.xlog1py, ("any", "pos"), ("float32",))

# ----------------------------------------------------------------------------------------------
# jax.numpy: elementwise binary (with broadcasting)

for nm, doms, dts, lin in [
    ("add", ("any", "any"), NUM, (True, True)),
    ("subtract", ("any", "any"), NUM, (True, True)),
    ("multiply", ("any", "any"), NUM, (True, True)),
    ("divide", ("any", "pos"), FLOATC, (True, False)),
    ("true_divide", ("any", "pos"), FLOATS, (True, False)),
    ("floor_divide", ("any", "pos"), REALNUM, (False, False)),
    ("mod", ("any", "pos"), REALNUM, (False, False)),
    ("remainder", ("any", "pos"), REALNUM, (False, False)),
    ("fmod", ("any", "pos"), REALNUM, (False, False)),
    ("power", ("pos", "small"), FLOATS, (False, False)),
    ("float_power", ("pos", "small"), ("float32",), (False, False)),
    ("maximum", ("any", "any"), REALNUM, (False, False)),
    ("minimum", ("any", "any"), REALNUM, (False, False)),
    ("fmax", ("any", "any"), FLOATS, (False, False)),
    ("fmin", ("any", "any"), FLOATS, (False, False)),
    ("arctan2", ("any", "any"), FLOATS, (False, False)),
    ("hypot", ("any", "any"), FLOATS, (False, False)),
    ("copysign", ("any", "any"), FLOATS, (False, False)),
    ("nextafter", ("any", "any"), ("float32",), (False, False)),
    ("logaddexp", ("any", "any"), FLOATS, (False, False)),
    ("logaddexp2", ("any", "any"), FLOATS, (False, False)),
    ("heaviside", ("any", "any"), FLOATS, (False, False)),
    ("equal", ("any", "any"), ALL, (False, False)),
    ("not_equal", ("any", "any"), ALL, (False, False)),
    ("less", ("any", "any"), REALNUM, (False, False)),
    ("less_equal", ("any", "any"), REALNUM, (False, False)),
    ("greater", ("any", "any"), REALNUM, (False, False)),
    ("greater_equal", ("any", "any"), REALNUM, (False, False)),
    ("isclose", ("any", "any"), FLOATS, (False, False)),
    ("logical_and", ("any", "any"), ("bool", "int32", "float32"), (False, False)),
    ("logical_or", ("any", "any"), ("bool", "int32", "float32"), (False, False)),
    ("logical_xor", ("any", "any"), ("bool", "int32", "float32"), (False, False)),
    ("bitwise_and", ("any", "any"), INTBOOL, (False, False)),
    ("bitwise_or", ("any", "any"), INTBOOL, (False, False)),
    ("bitwise_xor", ("any", "any"), INTBOOL, (False, False)),
    ("left_shift", ("any", "shift"), INTS, (False, False)),
    ("right_shift", ("any", "shift"), INTS, (False, False)),
    ("gcd", ("any", "any"), INTS, (False, False)),
    ("lcm", ("any", "any"), INTS, (False, False)),
    ("divmod", ("any", "pos"), ("float32", "int32"), (False, False)),
    ("ldexp", ("any", "shift"), ("float32",), (False, False)),
]:
    f = getattr(jnp, nm)
    if nm == "ldexp":
        add("jnp.ldexp", f, [Arg("any", linear=True), Arg("shift", dtype="int32")], BINARY_SHAPES)
        continue
    binary(f"jnp.{nm}", f, doms, dts, linear=lin)

add(
    "jnp.where",
    lambda c, a, b: jnp.where(c, a, b),
    [Arg(dtype="bool"), Arg(linear=True), Arg(linear=True)],
    same(UNARY_SHAPES, 3),
    REALNUM,
)
unary(
    "jnp.where[1arg-const]",
    lambda x: jnp.where(x > 0, x, 0.0),
    fn2=lambda x: jnp.where(x > 1, -x, 2.0),
)
add(
    "jnp.select",
    lambda a, b: jnp.select([a > 1, a < -1], [a, b], default=0.5),
    [A, A],
    same(UNARY_SHAPES, 2),
    fn2=lambda a, b: jnp.select([b > 0], [a * 2], default=-1.0),
)
binary("jnp.clip[array-bounds]", lambda x, lo: jnp.clip(x, lo, lo + 1.0))
add(
    "jnp.polyval",
    lambda c, x: jnp.polyval(c, x),
    [Arg(), Arg("small")],
    (((4,), EVEN), ((3,), UNEVEN3), ((2,), ZERO2)),
)
add(
    "jnp.interp",
    lambda x, xp, fp: jnp.interp(x, jnp.sort(xp), fp),
    [Arg(), Arg(), Arg(linear=True)],
    (((7, 5), (9,), (9,)), ((3,), (6,), (6,)), ((0,), (5,), (5,))),
)
binary(
    "jnp.vdot",
    jnp.vdot,
    shapes=((EVEN, EVEN), (UNEVEN3, UNEVEN3), (EMPTYBLK, EMPTYBLK), (ZERO2, ZERO2)),
    linear=(True, True),
    dtypes=("float32", "complex64"),
)

# ----------------------------------------------------------------------------------------------
# reductions


def red(name, f, fn2=None, dts=FLOATS, shapes=UNARY_SHAPES, dom="any", linear=False, tol=None):
    unary(name, f, dom, dts, shapes, fn2=fn2, linear=linear, tol=tol)


red("jnp.sum", lambda x: jnp.sum(x, axis=0), lambda x: jnp.sum(x), NUM, linear=True)
red(
    "jnp.mean",
    lambda x: jnp.mean(x, axis=last(x)),
    lambda x: jnp.mean(x, axis=0, keepdims=True),
    FLOATC,
    NONEMPTY_SHAPES,
    linear=True,
)
red("jnp.var", lambda x: jnp.var(x, axis=0), lambda x: jnp.var(x), FLOATS, NONEMPTY_SHAPES)
red(
    "jnp.std",
    lambda x: jnp.std(x, axis=last(x)),
    lambda x: jnp.std(x, ddof=1),
    FLOATS,
    NONEMPTY_SHAPES,
)
red("jnp.max", lambda x: jnp.max(x, axis=0), lambda x: jnp.max(x), REALNUM, NONEMPTY_SHAPES)
red("jnp.min", lambda x: jnp.min(x, axis=last(x)), lambda x: jnp.min(x), REALNUM, NONEMPTY_SHAPES)
red(
    "jnp.amax",
    lambda x: jnp.amax(x, axis=0, initial=-1.0),
    lambda x: jnp.amax(x, initial=10.0),
    ("float32",),
)
red(
    "jnp.amin",
    lambda x: jnp.amin(x, axis=0, keepdims=True),
    lambda x: jnp.amin(x),
    ("float32", "int32"),
    NONEMPTY_SHAPES,
)
red(
    "jnp.prod",
    lambda x: jnp.prod(x, axis=0),
    lambda x: jnp.prod(x, axis=last(x)),
    ("float32", "int32"),
    dom="near1",
)
red(
    "jnp.argmax", lambda x: jnp.argmax(x, axis=0), lambda x: jnp.argmax(x), REALNUM, NONEMPTY_SHAPES
)
red(
    "jnp.argmin",
    lambda x: jnp.argmin(x, axis=last(x)),
    lambda x: jnp.argmin(x),
    REALNUM,
    NONEMPTY_SHAPES,
)
red("jnp.any", lambda x: jnp.any(x > 1, axis=0), lambda x: jnp.any(x > 2.5), ("float32",))
red("jnp.all", lambda x: jnp.all(x > -2, axis=0), lambda x: jnp.all(x > -3.5), ("float32",))
red("jnp.any[bool]", lambda x: jnp.any(x, axis=0), lambda x: jnp.any(x), BOOLS)
red("jnp.all[bool]", lambda x: jnp.all(x, axis=last(x)), lambda x: jnp.all(x), BOOLS)
red(
    "jnp.cumsum",
    lambda x: jnp.cumsum(x, axis=0),
    lambda x: jnp.cumsum(x, axis=last(x)),
    NUM,
    linear=True,
)
red(
    "jnp.cumprod",
    lambda x: jnp.cumprod(x, axis=0),
    lambda x: jnp.cumprod(x),
    ("float32",),
    dom="near1",
    tol=(1e-5, 1e-5),
)
red(
    "jnp.cumulative_sum",
    lambda x: jnp.cumulative_sum(x, axis=0),
    lambda x: jnp.cumulative_sum(x, axis=0, include_initial=True),
    ("float32", "int32"),
    linear=True,
)
red(
    "jnp.cumulative_prod",
    lambda x: jnp.cumulative_prod(x, axis=last(x)),
    None,
    ("float32",),
    dom="near1",
)
red(
    "jnp.nansum",
    lambda x: jnp.nansum(jnp.log(x), axis=0),
    lambda x: jnp.nansum(jnp.log(x)),
    ("float32",),
)
red(
    "jnp.nanmean",
    lambda x: jnp.nanmean(jnp.log(x), axis=0),
    lambda x: jnp.nanmean(jnp.log(x)),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.nanmax",
    lambda x: jnp.nanmax(jnp.log(x), axis=0),
    lambda x: jnp.nanmax(jnp.log(x) * 2),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.nanmin",
    lambda x: jnp.nanmin(jnp.sqrt(x), axis=0),
    lambda x: jnp.nanmin(jnp.sqrt(x)),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.nanvar",
    lambda x: jnp.nanvar(jnp.log(x), axis=0),
    lambda x: jnp.nanvar(jnp.log(x)),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.nanstd",
    lambda x: jnp.nanstd(jnp.sqrt(x), axis=0),
    lambda x: jnp.nanstd(jnp.sqrt(x)),
    ("float32",),
    NONEMPTY_SHAPES,
)
red("jnp.nanprod", lambda x: jnp.nanprod(jnp.sqrt(x), axis=0), None, ("float32",), dom="any")
red(
    "jnp.nanargmax",
    lambda x: jnp.nanargmax(jnp.log(x), axis=0),
    lambda x: jnp.nanargmax(x),
    ("float32",),
    ((EVEN,), (UNEVEN2,), (UNEVEN3,)),
    dom="pos",
)
red(
    "jnp.nanargmin",
    lambda x: jnp.nanargmin(x, axis=0),
    lambda x: jnp.nanargmin(x),
    ("float32",),
    NONEMPTY_SHAPES,
)
red("jnp.nancumsum", lambda x: jnp.nancumsum(jnp.log(x), axis=0), None, ("float32",))
red("jnp.nancumprod", lambda x: jnp.nancumprod(x, axis=0), None, ("float32",), dom="near1")
red(
    "jnp.ptp",
    lambda x: jnp.ptp(x, axis=0),
    lambda x: jnp.ptp(x),
    ("float32", "int32"),
    NONEMPTY_SHAPES,
)
red(
    "jnp.median",
    lambda x: jnp.median(x, axis=0),
    lambda x: jnp.median(x),
    ("float32",),
    NONEMPTY_SHAPES,
)
red("jnp.nanmedian", lambda x: jnp.nanmedian(x, axis=0), None, ("float32",), NONEMPTY_SHAPES)
red(
    "jnp.quantile",
    lambda x: jnp.quantile(x, 0.3, axis=0),
    lambda x: jnp.quantile(x, 0.75),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.percentile",
    lambda x: jnp.percentile(x, 40.0, axis=0),
    lambda x: jnp.percentile(x, 90.0),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.average",
    lambda x: jnp.average(x, axis=0),
    lambda x: jnp.average(x),
    ("float32",),
    NONEMPTY_SHAPES,
    linear=True,
)
red(
    "jnp.count_nonzero",
    lambda x: jnp.count_nonzero(x > 0, axis=0),
    lambda x: jnp.count_nonzero(x),
    ("float32", "int32"),
)
red("jnp.linalg.norm", lambda x: jnp.linalg.norm(x, axis=0), lambda x: jnp.linalg.norm(x), FLOATC)
red(
    "jnp.linalg.norm[ord1]",
    lambda x: jnp.linalg.norm(x, ord=1, axis=0),
    lambda x: jnp.linalg.norm(x, ord=jnp.inf, axis=0),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.linalg.norm[fro]",
    lambda x: jnp.linalg.norm(x, "fro", axis=(0, 1)),
    None,
    ("float32",),
    ND2_SHAPES,
)
red(
    "jnp.linalg.vector_norm",
    lambda x: jnp.linalg.vector_norm(x, axis=last(x)),
    lambda x: jnp.linalg.vector_norm(x, ord=3),
    ("float32",),
)
red(
    "jnp.linalg.matrix_norm",
    lambda x: jnp.linalg.matrix_norm(x),
    lambda x: jnp.linalg.matrix_norm(x, ord=1),
    ("float32",),
    ND2_NONEMPTY,
)
red(
    "jnp.trace",
    lambda x: jnp.trace(x),
    lambda x: jnp.trace(x, offset=1),
    ("float32", "int32"),
    ND2_SHAPES,
    linear=True,
)
red(
    "jnp.diff",
    lambda x: jnp.diff(x, axis=0),
    lambda x: jnp.diff(x, n=2),
    ("float32", "int32"),
    NONEMPTY_SHAPES,
    linear=True,
)
red("jnp.ediff1d", jnp.ediff1d, None, ("float32",), NONEMPTY_SHAPES, linear=True)
red(
    "jnp.trapezoid",
    lambda x: jnp.trapezoid(x, axis=0),
    lambda x: jnp.trapezoid(x, dx=0.5),
    ("float32",),
    NONEMPTY_SHAPES,
    linear=True,
)
red(
    "jnp.histogram",
    lambda x: jnp.histogram(x, bins=5, range=(-3, 3)),
    lambda x: jnp.histogram(x, bins=3, range=(-1, 1)),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.bincount",
    lambda x: jnp.bincount(x.ravel(), length=10),
    lambda x: jnp.bincount(x.ravel(), length=5),
    ("int32",),
    NONEMPTY_SHAPES,
    dom="nonneg",
)
red("jnp.sort", lambda x: jnp.sort(x, axis=0), lambda x: jnp.sort(x), REALNUM)
red(
    "jnp.argsort",
    lambda x: jnp.argsort(x, axis=0, stable=True),
    lambda x: jnp.argsort(x, descending=True, stable=True),
    REALNUM,
)
red(
    "jnp.partition",
    lambda x: jnp.partition(x, 1, axis=0),
    lambda x: jnp.partition(x, 2),
    ("float32",),
    ((EVEN,), (UNEVEN3,), (UNEVEN2,), (EMPTYBLK,)),
)
red(
    "jnp.argpartition",
    lambda x: jnp.sort(jnp.take_along_axis(x, jnp.argpartition(x, 1, axis=0)[:2], axis=0), axis=0),
    None,
    ("float32",),
    ((EVEN,), (UNEVEN3,), (UNEVEN2,), (EMPTYBLK,)),
)
red(
    "jnp.lexsort",
    lambda x: jnp.lexsort((x[0], x[1])),
    lambda x: jnp.lexsort((x[-1], x[0])),
    ("int32",),
    ((EVEN,), (UNEVEN2,), ((2, 9),)),
)
red(
    "jnp.unique_values[size]",
    lambda x: jnp.unique(x, size=6, fill_value=0),
    None,
    ("int32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.nonzero[size]",
    lambda x: jnp.nonzero(x > 0, size=5),
    lambda x: jnp.nonzero(x > 1, size=3, fill_value=-1),
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.argwhere[size]", lambda x: jnp.argwhere(x > 0, size=4), None, ("float32",), NONEMPTY_SHAPES
)
red(
    "jnp.flatnonzero[size]",
    lambda x: jnp.flatnonzero(x > 0, size=4),
    None,
    ("float32",),
    NONEMPTY_SHAPES,
)
red(
    "jnp.cov",
    lambda x: jnp.cov(x),
    None,
    ("float32",),
    ((EVEN,), (UNEVEN2,), ((3, 9),)),
    tol=(1e-4, 1e-5),
)
red(
    "jnp.corrcoef",
    lambda x: jnp.corrcoef(x),
    None,
    ("float32",),
    ((EVEN,), (UNEVEN2,)),
    tol=(1e-4, 1e-5),
)
red("jnp.round[decimals]", lambda x: jnp.round(x, 1), lambda x: jnp.round(x, 0), ("float32",))

add(
    "jnp.searchsorted",
    lambda a, v: jnp.searchsorted(jnp.sort(a), v),
    [Arg(), Arg()],
    (((9,), EVEN), ((8,), UNEVEN3), ((4,), ZERO1)),
    REALNUM,
    fn2=lambda a, v: jnp.searchsorted(jnp.sort(a), v, side="right"),
)
add(
    "jnp.digitize",
    lambda x, b: jnp.digitize(x, jnp.sort(b)),
    [A, A],
    ((EVEN, (5,)), (UNEVEN3, (4,)), (ZERO2, (3,))),
)
add(
    "jnp.average[weights]",
    lambda x, w: jnp.average(x, axis=0, weights=w),
    [LIN, Arg("pos")],
    (((8, 4), (8,)), ((7, 5), (7,)), ((3, 5), (3,))),
)

# ----------------------------------------------------------------------------------------------
# shape ops

sh = functools.partial(unary, dtypes=ALL, linear=True)
sh(
    "jnp.reshape",
    lambda x: jnp.reshape(x, (-1,)),
    shapes=UNARY_SHAPES,
    fn2=lambda x: jnp.reshape(x, x.shape[::-1] + (1,)),
)
sh("jnp.ravel", jnp.ravel)
sh("jnp.transpose", jnp.transpose, fn2=lambda x: jnp.transpose(x, tuple(range(1, x.ndim)) + (0,)))
sh("jnp.swapaxes", lambda x: jnp.swapaxes(x, 0, 1), shapes=ND2_SHAPES)
sh("jnp.moveaxis", lambda x: jnp.moveaxis(x, 0, -1), shapes=ND2_SHAPES)
sh("jnp.expand_dims", lambda x: jnp.expand_dims(x, 0), fn2=lambda x: jnp.expand_dims(x, -1))
sh("jnp.squeeze", lambda x: jnp.squeeze(x[None], 0), fn2=lambda x: jnp.squeeze(x[..., None]))
sh("jnp.tile", lambda x: jnp.tile(x, 2), fn2=lambda x: jnp.tile(x, (2,) + (1,) * x.ndim))
sh("jnp.repeat", lambda x: jnp.repeat(x, 2, axis=0), fn2=lambda x: jnp.repeat(x, 3))
sh("jnp.flip", lambda x: jnp.flip(x, 0), fn2=lambda x: jnp.flip(x))
sh("jnp.fliplr", jnp.fliplr, shapes=ND2_SHAPES)
sh("jnp.flipud", jnp.flipud)
sh("jnp.roll", lambda x: jnp.roll(x, 2, axis=0), fn2=lambda x: jnp.roll(x, -1))
sh("jnp.rot90", jnp.rot90, shapes=ND2_SHAPES, fn2=lambda x: jnp.rot90(x, 3))
sh(
    "jnp.pad",
    lambda x: jnp.pad(x, 1),
    fn2=lambda x: jnp.pad(x, [(2, 0)] + [(0, 1)] * (x.ndim - 1), constant_values=1),
)
unary(
    "jnp.pad[edge]",
    lambda x: jnp.pad(x, 2, mode="edge"),
    shapes=NONEMPTY_SHAPES,
    dtypes=("float32", "int32"),
    linear=True,
)
unary(
    "jnp.pad[reflect]",
    lambda x: jnp.pad(x, 1, mode="reflect"),
    shapes=((EVEN,), (UNEVEN3,), (UNEVEN2,)),
    dtypes=("float32",),
    linear=True,
)
unary(
    "jnp.pad[wrap]",
    lambda x: jnp.pad(x, 2, mode="wrap"),
    shapes=NONEMPTY_SHAPES,
    dtypes=("float32",),
    linear=True,
)
sh(
    "jnp.broadcast_to",
    lambda x: jnp.broadcast_to(x, (2,) + x.shape),
    fn2=lambda x: jnp.broadcast_to(x[None], (3,) + x.shape),
)
sh("jnp.atleast_1d", jnp.atleast_1d)
sh("jnp.atleast_2d", jnp.atleast_2d)
sh("jnp.atleast_3d", jnp.atleast_3d)
sh("jnp.diagonal", jnp.diagonal, shapes=ND2_SHAPES, fn2=lambda x: jnp.diagonal(x, offset=1))
sh(
    "jnp.diag",
    lambda x: jnp.diag(x.reshape(-1)[:5]),
    shapes=NONEMPTY_SHAPES,
    fn2=lambda x: jnp.diag(x.reshape(-1)[:3], k=1),
)
sh(
    "jnp.diag[extract]",
    lambda x: jnp.diag(x),
    shapes=((EVEN,), (UNEVEN2,), (EMPTYBLK,), (ZERO2,)),
    fn2=lambda x: jnp.diag(x, k=-1),
)
sh("jnp.triu", jnp.triu, shapes=ND2_SHAPES, fn2=lambda x: jnp.triu(x, 1))
sh("jnp.tril", jnp.tril, shapes=ND2_SHAPES, fn2=lambda x: jnp.tril(x, -1))
sh("x[slice]", lambda x: x[1:3], fn2=lambda x: x[::-2])
sh("x[int]", lambda x: x[1], shapes=NONEMPTY_SHAPES, fn2=lambda x: x[-1])
sh("x[...,int]", lambda x: x[..., 0], shapes=NONEMPTY_SHAPES, fn2=lambda x: x[..., -1])
sh("x[None,::2]", lambda x: x[None, ::2], fn2=lambda x: x[1::3, None])
sh("x.T", lambda x: x.T, fn2=lambda x: x.T[::-1])
sh("x.mT", lambda x: x.mT, shapes=ND2_SHAPES)
sh("x.at[].set", lambda x: x.at[1].set(0), shapes=NONEMPTY_SHAPES, fn2=lambda x: x.at[0].set(x[-1]))
unary(
    "x.at[].add",
    lambda x: x.at[1:3].add(1),
    shapes=UNARY_SHAPES,
    dtypes=NUM,
    fn2=lambda x: x.at[0].add(x[-1]) if x.shape[0] else x,
)
unary(
    "x.at[].mul",
    lambda x: x.at[::2].mul(2),
    shapes=NONEMPTY_SHAPES,
    dtypes=REALNUM,
    linear=True,
    fn2=lambda x: x.at[-1].mul(3),
)
unary(
    "x.at[].min",
    lambda x: x.at[1:].min(0),
    shapes=NONEMPTY_SHAPES,
    dtypes=REALNUM,
    fn2=lambda x: x.at[0].min(1),
)
unary(
    "x.at[].max",
    lambda x: x.at[1:].max(0),
    shapes=NONEMPTY_SHAPES,
    dtypes=REALNUM,
    fn2=lambda x: x.at[0].max(1),
)
unary(
    "x.at[].get",
    lambda x: x.at[jnp.array([2, 0])].get(),
    shapes=NONEMPTY_SHAPES,
    dtypes=ALL,
    linear=True,
    fn2=lambda x: x.at[jnp.array([0, 0, 1])].get(),
)
unary(
    "jnp.delete",
    lambda x: jnp.delete(x, 1, axis=0),
    shapes=NONEMPTY_SHAPES,
    dtypes=("float32",),
    linear=True,
    fn2=lambda x: jnp.delete(x, 0, axis=0),
)
unary(
    "jnp.insert",
    lambda x: jnp.insert(x, 1, 5, axis=0),
    shapes=NONEMPTY_SHAPES,
    dtypes=("float32",),
    fn2=lambda x: jnp.insert(x, 0, -1, axis=0),
)
unary(
    "jnp.split",
    lambda x: jnp.split(x, [1, 2], axis=0),
    shapes=NONEMPTY_SHAPES,
    dtypes=ALL,
    linear=True,
    fn2=lambda x: jnp.split(x, [2], axis=0),
)
unary(
    "jnp.array_split",
    lambda x: jnp.array_split(x, 2, axis=0),
    shapes=UNARY_SHAPES,
    dtypes=("float32",),
    linear=True,
    fn2=lambda x: jnp.array_split(x, 3, axis=-1),
)
unary(
    "jnp.hsplit", lambda x: jnp.hsplit(x, [1]), shapes=ND2_SHAPES, dtypes=("float32",), linear=True
)
unary(
    "jnp.vsplit",
    lambda x: jnp.vsplit(x, [1]),
    shapes=ND2_NONEMPTY,
    dtypes=("float32",),
    linear=True,
)
unary(
    "jnp.meshgrid",
    lambda x: jnp.meshgrid(x.ravel()[:3], x.ravel()[-4:]),
    shapes=NONEMPTY_SHAPES,
    dtypes=("float32",),
)
unary(
    "jnp.resize",
    lambda x: jnp.resize(x, (4, 6)),
    shapes=NONEMPTY_SHAPES,
    dtypes=("float32",),
    fn2=lambda x: jnp.resize(x, (11,)),
)
unary(
    "jnp.take",
    lambda x: jnp.take(x, jnp.array([2, 0, 1]), axis=0),
    shapes=NONEMPTY_SHAPES,
    dtypes=ALL,
    linear=True,
    fn2=lambda x: jnp.take(x, jnp.array([0, -1]), axis=last(x)),
)

add(
    "jnp.concatenate",
    lambda a, b: jnp.concatenate([a, b], axis=0),
    [LIN, LIN],
    same(UNARY_SHAPES, 2),
    ALL,
    fn2=lambda a, b: jnp.concatenate([b, a, b], axis=-1),
)
for nm, f in [
    ("jnp.stack", lambda a, b: jnp.stack([a, b])),
    ("jnp.hstack", lambda a, b: jnp.hstack([a, b])),
    ("jnp.vstack", lambda a, b: jnp.vstack([a, b])),
    ("jnp.dstack", lambda a, b: jnp.dstack([a, b])),
    ("jnp.column_stack", lambda a, b: jnp.column_stack([a, b])),
    ("jnp.append", lambda a, b: jnp.append(a, b, axis=0)),
]:
    add(nm, f, [LIN, LIN], same(UNARY_SHAPES, 2), ALL)
add(
    "jnp.broadcast_arrays",
    lambda a, b: jnp.broadcast_arrays(a, b),
    [LIN, LIN],
    ((EVEN, (4,)), (UNEVEN3, (7, 1)), (ZERO2, (3,))),
    ALL,
)
add(
    "jnp.take_along_axis",
    lambda x, i: jnp.take_along_axis(x, i, axis=0),
    [LIN, Arg("idx<0,3>", dtype="int32")],
    ((EVEN, (3, 4)), (UNEVEN2, (2, 5)), (UNEVEN3, (4, 7, 3)), (EMPTYBLK, (0, 5))),
    ("float32", "int32"),
    fn2=lambda x, i: jnp.take_along_axis(x, jnp.flip(i), axis=0),
)
add(
    "jnp.take[array-idx]",
    lambda x, i: jnp.take(x, i, axis=0),
    [LIN, Arg("idx<-3,3>", dtype="int32")],
    ((EVEN, (6,)), (UNEVEN2, (2, 3)), (UNEVEN3, (5,)), (EMPTYBLK, (0,))),
    ("float32", "int32", "bool"),
)
add(
    "x[idx-array]",
    lambda x, i: x[i],
    [LIN, Arg("idx<0,3>", dtype="int32")],
    ((EVEN, (6,)), (UNEVEN2, (2, 3)), (UNEVEN3, (5,)), (EMPTYBLK, (0,))),
    ("float32",),
    fn2=lambda x, i: x[:, i[:1].ravel()] if x.ndim > 1 else x[i],
)
add(
    "x.at[idx].set",
    lambda x, i, v: x.at[i].set(v),
    [A, Arg("idx<0,3>", dtype="int32"), A],
    ((EVEN, (3,), (3, 4)), (UNEVEN2, (2,), (2, 5)), (EMPTYBLK, (0,), (0, 5))),
    ("float32", "int32"),
)
add(
    "x.at[idx].add",
    lambda x, i, v: x.at[i].add(v),
    [LIN, Arg("idx<0,3>", dtype="int32"), LIN],
    ((EVEN, (3,), (3, 4)), (UNEVEN2, (5,), (5, 5)), (EMPTYBLK, (0,), (0, 5))),
    ("float32", "int32"),
)
add(
    "jnp.choose",
    lambda i, a, b: jnp.choose(i, [a, b], mode="clip"),
    [Arg("idx<0,2>", dtype="int32"), LIN, LIN],
    same(UNARY_SHAPES, 3),
)
add(
    "jnp.piecewise",
    lambda x: jnp.piecewise(x, [x < 0, x >= 0], [lambda t: -t, lambda t: t * 2]),
    [A],
    UNARY_SHAPES,
    fn2=lambda x: jnp.piecewise(x, [x < 1], [0.0, 1.0]),
)
add("jnp.kron", jnp.kron, [LIN, LIN], (((2, 3), (3, 2)), ((3, 1), (2, 5)), ((0, 2), (2, 2))))

# ----------------------------------------------------------------------------------------------
# contractions

MM2 = ((EVEN, (4, 6)), (UNEVEN2, (5, 3)), (EMPTYBLK, (5, 0)), (ZERO2, (3, 4)))
MM = (
    (EVEN, (4, 6)),
    (UNEVEN2, (5, 3)),
    (UNEVEN3, (3, 6)),
    (EMPTYBLK, (5, 0)),
    (ZERO2, (3, 4)),
    ((5,), (5, 7)),
)
add(
    "jnp.matmul",
    jnp.matmul,
    [LIN, LIN],
    MM,
    ("float32", "int32", "bfloat16", "complex64"),
    fn2=lambda a, b: a @ (b * 2),
)
add("jnp.dot", jnp.dot, [LIN, LIN], MM, ("float32", "int32", "float16"))
add("x@w", lambda a, b: a @ b, [LIN, LIN], MM[:4])
add(
    "jnp.einsum[ij,jk]",
    lambda a, b: jnp.einsum("ij,jk->ik", a, b),
    [LIN, LIN],
    ((EVEN, (4, 6)), (UNEVEN2, (5, 3)), (EMPTYBLK, (5, 0))),
    ("float32", "int32"),
    fn2=lambda a, b: jnp.einsum("ij,jk->ki", a, b),
)
add(
    "jnp.einsum[bij,bjk]",
    lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
    [LIN, LIN],
    (((5, 7, 3), (5, 3, 2)), ((2, 4, 4), (2, 4, 4)), ((3, 0, 2), (3, 2, 5))),
)
add(
    "jnp.einsum[ij->j]",
    lambda a: jnp.einsum("ij->j", a),
    [LIN],
    ((EVEN,), (UNEVEN2,), (EMPTYBLK,), (ZERO2,)),
    fn2=lambda a: jnp.einsum("ij->", a),
)
add(
    "jnp.einsum[i,i]",
    lambda a, b: jnp.einsum("i,i->", a, b),
    [LIN, LIN],
    (((8,), (8,)), ((7,), (7,)), ((3,), (3,)), ((0,), (0,))),
)
add(
    "jnp.einsum[outer]",
    lambda a, b: jnp.einsum("i,j->ij", a, b),
    [LIN, LIN],
    (((8,), (5,)), ((7,), (3,)), ((0,), (2,))),
)
add(
    "jnp.tensordot",
    lambda a, b: jnp.tensordot(a, b, axes=1),
    [LIN, LIN],
    MM2,
    fn2=lambda a, b: jnp.tensordot(a, b, axes=([1], [0])),
)
add(
    "jnp.tensordot[2axes]",
    lambda a, b: jnp.tensordot(a, b, axes=2),
    [LIN, LIN],
    (((5, 7, 3), (7, 3)), ((8, 4), (8, 4)), ((3, 5), (3, 5))),
)
add(
    "jnp.outer",
    jnp.outer,
    [LIN, LIN],
    (((8,), (4,)), ((7,), (5,)), ((3,), (0,)), ((2, 3), (3,))),
    ("float32", "int32"),
)
add(
    "jnp.inner",
    jnp.inner,
    [LIN, LIN],
    ((EVEN, (3, 4)), (UNEVEN2, (5,)), ((7,), (7,)), (ZERO2, (2, 3))),
    ("float32", "int32"),
)
add("jnp.matvec", jnp.matvec, [LIN, LIN], ((EVEN, (4,)), (UNEVEN2, (5,)), (EMPTYBLK, (5,))))
add("jnp.vecdot", jnp.vecdot, [LIN, LIN], ((EVEN, EVEN), (UNEVEN3, UNEVEN3), (EMPTYBLK, (5,))))
add("jnp.linalg.matmul", jnp.linalg.matmul, [LIN, LIN], MM[:4])
add("jnp.linalg.vecdot", jnp.linalg.vecdot, [LIN, LIN], ((EVEN, EVEN), (UNEVEN2, UNEVEN2)))
add("jnp.linalg.tensordot", lambda a, b: jnp.linalg.tensordot(a, b, axes=1), [LIN, LIN], MM[:3])
add("jnp.linalg.outer", jnp.linalg.outer, [LIN, LIN], (((8,), (4,)), ((7,), (5,))))
add("jnp.cross", jnp.cross, [A, A], (((8, 3), (8, 3)), ((5, 3), (3,)), ((0, 3), (0, 3))))
add(
    "jnp.convolve",
    jnp.convolve,
    [LIN, LIN],
    (((8,), (3,)), ((7,), (2,)), ((3,), (3,))),
    fn2=lambda a, b: jnp.convolve(a, b, mode="same"),
)
add(
    "jnp.correlate",
    lambda a, b: jnp.correlate(a, b, mode="full"),
    [LIN, LIN],
    (((8,), (3,)), ((7,), (2,))),
    fn2=lambda a, b: jnp.correlate(a, b),
)
add("jnp.polymul", jnp.polymul, [LIN, LIN], (((4,), (3,)), ((7,), (2,))))
add(
    "jnp.linalg.multi_dot",
    lambda a, b, c: jnp.linalg.multi_dot([a, b, c]),
    [LIN, LIN, LIN],
    (((8, 4), (4, 6), (6, 3)), ((7, 5), (5, 3), (3, 2))),
)
add("jnp.linalg.trace", jnp.linalg.trace, [LIN], ND2_SHAPES)
add("jnp.linalg.diagonal", jnp.linalg.diagonal, [LIN], ND2_SHAPES)
add("jnp.linalg.matrix_transpose", jnp.linalg.matrix_transpose, [LIN], ND2_SHAPES)

# linalg decompositions / fft (expected to raise today)
SQ = (((4, 4),), ((5, 5),), ((3, 3),))
add("jnp.linalg.det", jnp.linalg.det, [A], SQ, tol=(1e-4, 1e-4))
add("jnp.linalg.inv", lambda a: jnp.linalg.inv(a + 10 * jnp.eye(a.shape[0])), [A], SQ)
add(
    "jnp.linalg.solve",
    lambda a, b: jnp.linalg.solve(a + 10 * jnp.eye(a.shape[0]), b),
    [A, A],
    (((4, 4), (4, 2)), ((5, 5), (5, 3))),
)
add(
    "jnp.linalg.cholesky",
    lambda a: jnp.linalg.cholesky(a @ a.T + jnp.eye(a.shape[0])),
    [A],
    SQ,
    tol=(1e-4, 1e-4),
)
add("jnp.linalg.qr", lambda a: jnp.abs(jnp.linalg.qr(a)[1]), [A], SQ, tol=(1e-4, 1e-4))
add("jnp.linalg.svd", lambda a: jnp.linalg.svd(a, compute_uv=False), [A], SQ, tol=(1e-4, 1e-4))
add("jnp.linalg.eigh", lambda a: jnp.linalg.eigh(a + a.T)[0], [A], SQ, tol=(1e-4, 1e-4))
add(
    "jnp.linalg.slogdet",
    lambda a: jnp.linalg.slogdet(a + 10 * jnp.eye(a.shape[0])),
    [A],
    SQ,
    tol=(1e-4, 1e-4),
)
add("jnp.fft.fft", jnp.fft.fft, [LIN], NONEMPTY_SHAPES, tol=(1e-4, 1e-4))
add("jnp.fft.rfft", jnp.fft.rfft, [LIN], NONEMPTY_SHAPES, tol=(1e-4, 1e-4))
add("jnp.fft.ifft", jnp.fft.ifft, [LIN], NONEMPTY_SHAPES, tol=(1e-4, 1e-4))

# ----------------------------------------------------------------------------------------------
# jax.nn

for nm, lin in [
    ("relu", False),
    ("relu6", False),
    ("silu", False),
    ("swish", False),
    ("sigmoid", False),
    ("log_sigmoid", False),
    ("soft_sign", False),
    ("softplus", False),
    ("sparse_plus", False),
    ("sparse_sigmoid", False),
    ("elu", False),
    ("celu", False),
    ("selu", False),
    ("leaky_relu", False),
    ("hard_sigmoid", False),
    ("hard_silu", False),
    ("hard_swish", False),
    ("hard_tanh", False),
    ("mish", False),
    ("squareplus", False),
    ("tanh", False),
    ("identity", True),
]:
    unary(f"jax.nn.{nm}", getattr(jax.nn, nm), dtypes=FLOATS, linear=lin)
unary("jax.nn.gelu", jax.nn.gelu, fn2=lambda x: jax.nn.gelu(x, approximate=False))
unary(
    "jax.nn.softmax",
    lambda x: jax.nn.softmax(x, axis=-1),
    fn2=lambda x: jax.nn.softmax(x, axis=0),
    shapes=NONEMPTY_SHAPES,
)
unary(
    "jax.nn.log_softmax",
    lambda x: jax.nn.log_softmax(x, axis=-1),
    fn2=lambda x: jax.nn.log_softmax(x, axis=0),
    shapes=NONEMPTY_SHAPES,
)
unary(
    "jax.nn.logsumexp",
    lambda x: jax.nn.logsumexp(x, axis=-1),
    fn2=lambda x: jax.nn.logsumexp(x, axis=0, keepdims=True),
    shapes=NONEMPTY_SHAPES,
)
unary(
    "jax.nn.standardize",
    lambda x: jax.nn.standardize(x, axis=-1),
    fn2=lambda x: jax.nn.standardize(x, axis=0, epsilon=0.1),
    shapes=NONEMPTY_SHAPES,
    tol=(1e-4, 1e-4),
)
unary(
    "jax.nn.glu",
    lambda x: jax.nn.glu(x, axis=-1),
    shapes=((EVEN,), ((6, 10),), ((2, 6),)),
    fn2=lambda x: jax.nn.glu(x, axis=0),
)
unary(
    "jax.nn.one_hot",
    lambda x: jax.nn.one_hot(x, 10),
    "nonneg",
    INTS,
    fn2=lambda x: jax.nn.one_hot(x, 5, axis=0),
)
unary(
    "jax.nn.leaky_relu[slope]",
    lambda x: jax.nn.leaky_relu(x, 0.3),
    fn2=lambda x: jax.nn.leaky_relu(x, 0.05),
)
unary("jax.nn.elu[alpha]", lambda x: jax.nn.elu(x, 0.5), fn2=lambda x: jax.nn.elu(x, 2.0))
unary("jax.nn.log1mexp", lambda x: jax.nn.log1mexp(x), dom="pos")
if hasattr(jax.nn, "logmeanexp"):
    unary("jax.nn.logmeanexp", lambda x: jax.nn.logmeanexp(x, axis=-1), shapes=NONEMPTY_SHAPES)
add(
    "jax.nn.dot_product_attention",
    lambda q, k, v: jax.nn.dot_product_attention(q, k, v),
    [A, A, A],
    (((2, 4, 2, 8), (2, 6, 2, 8), (2, 6, 2, 8)), ((1, 5, 4, 4), (1, 5, 4, 4), (1, 5, 4, 4))),
    fn2=lambda q, k, v: (
        jax.nn.dot_product_attention(q, k, v, is_causal=True)
        if q.shape[1] == k.shape[1]
        else jax.nn.dot_product_attention(q, k, v, scale=0.5)
    ),
    tol=(1e-4, 1e-5),
)

# ----------------------------------------------------------------------------------------------
# jax.lax

for nm, dom, dts, lin in [
    ("neg", "any", NUM, True),
    ("abs", "any", REALNUM, False),
    ("sign", "any", FLOATS, False),
    ("exp", "any", FLOATS, False),
    ("exp2", "any", ("float32",), False),
    ("expm1", "any", ("float32",), False),
    ("log", "pos", FLOATS, False),
    ("log1p", "pos", ("float32",), False),
    ("sin", "any", FLOATS, False),
    ("cos", "any", FLOATS, False),
    ("tan", "small", ("float32",), False),
    ("asin", "unit", ("float32",), False),
    ("acos", "unit", ("float32",), False),
    ("atan", "any", ("float32",), False),
    ("sinh", "any", ("float32",), False),
    ("cosh", "any", ("float32",), False),
    ("tanh", "any", FLOATS, False),
    ("asinh", "any", ("float32",), False),
    ("acosh", "gt1", ("float32",), False),
    ("atanh", "unit", ("float32",), False),
    ("logistic", "any", FLOATS, False),
    ("sqrt", "pos", FLOATS, False),
    ("rsqrt", "pos", FLOATS, False),
    ("cbrt", "any", ("float32",), False),
    ("erf", "any", ("float32",), False),
    ("erfc", "any", ("float32",), False),
    ("erf_inv", "unit", ("float32",), False),
    ("lgamma", "pos", ("float32",), False),
    ("digamma", "pos", ("float32",), False),
    ("floor", "any", FLOATS, False),
    ("ceil", "any", FLOATS, False),
    ("round", "any", ("float32",), False),
    ("is_finite", "any", FLOATS, False),
    ("square", "any", NUM, False),
    ("real", "any", ("complex64",), True),
    ("imag", "any", ("complex64",), True),
    ("conj", "any", ("complex64",), True),
    ("population_count", "any", INTS, False),
    ("clz", "any", INTS, False),
    ("not", "any", INTBOOL, False),
    ("stop_gradient", "any", ALL, True),
]:
    f = getattr(lax, nm if nm != "not" else "bitwise_not")
    unary(
        f"lax.{nm if nm != 'not' else 'bitwise_not'}",
        f,
        dom,
        dts,
        linear=lin,
        tol=(2e-5, 1e-5) if nm in ("lgamma", "digamma") else None,
    )

SAME2 = same(UNARY_SHAPES, 2)
for nm, doms, dts, lin in [
    ("add", ("any", "any"), NUM, (True, True)),
    ("sub", ("any", "any"), NUM, (True, True)),
    ("mul", ("any", "any"), NUM, (True, True)),
    ("div", ("any", "pos"), REALNUM, (True, False)),
    ("rem", ("any", "pos"), REALNUM, (False, False)),
    ("max", ("any", "any"), REALNUM, (False, False)),
    ("min", ("any", "any"), REALNUM, (False, False)),
    ("pow", ("pos", "small"), FLOATS, (False, False)),
    ("atan2", ("any", "any"), ("float32",), (False, False)),
    ("nextafter", ("any", "any"), ("float32",), (False, False)),
    ("eq", ("any", "any"), ALL, (False, False)),
    ("ne", ("any", "any"), ALL, (False, False)),
    ("lt", ("any", "any"), REALNUM, (False, False)),
    ("le", ("any", "any"), REALNUM, (False, False)),
    ("gt", ("any", "any"), REALNUM, (False, False)),
    ("ge", ("any", "any"), REALNUM, (False, False)),
    ("bitwise_and", ("any", "any"), INTBOOL, (False, False)),
    ("bitwise_or", ("any", "any"), INTBOOL, (False, False)),
    ("bitwise_xor", ("any", "any"), INTBOOL, (False, False)),
    ("shift_left", ("any", "shift"), INTS, (False, False)),
    ("shift_right_logical", ("any", "shift"), INTS, (False, False)),
    ("shift_right_arithmetic", ("any", "shift"), INTS, (False, False)),
    ("complex", ("any", "any"), ("float32",), (True, True)),
]:
    binary(f"lax.{nm}", getattr(lax, nm), doms, dts, SAME2, linear=lin)

unary(
    "lax.integer_pow",
    lambda x: lax.integer_pow(x, 3),
    dtypes=REALNUM,
    fn2=lambda x: lax.integer_pow(x, 2),
)
unary(
    "lax.convert_element_type",
    lambda x: lax.convert_element_type(x, jnp.int32),
    dtypes=("float32", "bfloat16", "bool"),
    fn2=lambda x: lax.convert_element_type(x, jnp.float16),
)
unary(
    "lax.bitcast_convert_type",
    lambda x: lax.bitcast_convert_type(x, jnp.int32),
    dtypes=("float32",),
    fn2=lambda x: lax.bitcast_convert_type(x, jnp.uint32),
)
unary(
    "lax.reduce_precision",
    lambda x: lax.reduce_precision(x, exponent_bits=5, mantissa_bits=3),
    fn2=lambda x: lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7),
)
add("lax.clamp", lambda lo, x, hi: lax.clamp(lo, x, hi), [A, A, A], same(UNARY_SHAPES, 3), REALNUM)
unary(
    "lax.clamp[scalar]",
    lambda x: lax.clamp(-1.0, x, 1.5),
    dtypes=("float32",),
    fn2=lambda x: lax.clamp(0.0, x, 0.5),
)
add(
    "lax.select_n",
    lambda c, a, b: lax.select_n(c, a, b),
    [Arg(dtype="bool"), LIN, LIN],
    same(UNARY_SHAPES, 3),
    REALNUM,
)
add(
    "lax.select_n[int]",
    lambda c, a, b, d: lax.select_n(c, a, b, d),
    [Arg("idx<0,3>", dtype="int32"), LIN, LIN, LIN],
    same(NONEMPTY_SHAPES, 4),
)
add(
    "lax.dot_general",
    lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ()))),
    [LIN, LIN],
    MM2,
    ("float32", "int32", "bfloat16"),
)
add(
    "lax.dot_general[batch]",
    lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))),
    [LIN, LIN],
    (((5, 7, 3), (5, 3, 2)), ((4, 2, 4), (4, 4, 6)), ((0, 2, 3), (0, 3, 2))),
)
add("lax.dot", lax.dot, [LIN, LIN], MM2)
add(
    "lax.batch_matmul",
    lax.batch_matmul,
    [LIN, LIN],
    (((5, 7, 3), (5, 3, 2)), ((4, 2, 4), (4, 4, 6))),
)

for nm, f, f2, dts, shp, lin in [
    (
        "reduce_sum",
        lambda x: lax.reduce_sum(x, (0,)),
        lambda x: lax.reduce_sum(x, tuple(range(x.ndim))),
        NUM,
        UNARY_SHAPES,
        True,
    ),
    (
        "reduce_max",
        lambda x: lax.reduce_max(x, (0,)),
        lambda x: lax.reduce_max(x, tuple(range(x.ndim))),
        REALNUM,
        UNARY_SHAPES,
        False,
    ),
    ("reduce_min", lambda x: lax.reduce_min(x, (x.ndim - 1,)), None, REALNUM, UNARY_SHAPES, False),
    (
        "reduce_prod",
        lambda x: lax.reduce_prod(x, (0,)),
        None,
        ("float32", "int32"),
        UNARY_SHAPES,
        False,
    ),
    (
        "reduce_and",
        lambda x: lax.reduce_and(x, (0,)),
        lambda x: lax.reduce_and(x, tuple(range(x.ndim))),
        INTBOOL,
        UNARY_SHAPES,
        False,
    ),
    ("reduce_or", lambda x: lax.reduce_or(x, (0,)), None, INTBOOL, UNARY_SHAPES, False),
    ("reduce_xor", lambda x: lax.reduce_xor(x, (0,)), None, INTBOOL, UNARY_SHAPES, False),
    (
        "argmax",
        lambda x: lax.argmax(x, 0, jnp.int32),
        lambda x: lax.argmax(x, x.ndim - 1, jnp.int32),
        REALNUM,
        NONEMPTY_SHAPES,
        False,
    ),
    ("argmin", lambda x: lax.argmin(x, 0, jnp.int32), None, REALNUM, NONEMPTY_SHAPES, False),
    (
        "cumsum",
        lambda x: lax.cumsum(x, 0),
        lambda x: lax.cumsum(x, x.ndim - 1, reverse=True),
        NUM,
        UNARY_SHAPES,
        True,
    ),
    (
        "cumprod",
        lambda x: lax.cumprod(x, 0),
        lambda x: lax.cumprod(x, 0, reverse=True),
        ("float32",),
        UNARY_SHAPES,
        False,
    ),
    (
        "cummax",
        lambda x: lax.cummax(x, 0),
        lambda x: lax.cummax(x, x.ndim - 1, reverse=True),
        REALNUM,
        UNARY_SHAPES,
        False,
    ),
    ("cummin", lambda x: lax.cummin(x, 0), None, REALNUM, UNARY_SHAPES, False),
    ("cumlogsumexp", lambda x: lax.cumlogsumexp(x, 0), None, ("float32",), UNARY_SHAPES, False),
    (
        "sort",
        lambda x: lax.sort(x, 0),
        lambda x: lax.sort(x, x.ndim - 1),
        REALNUM,
        UNARY_SHAPES,
        False,
    ),
    (
        "top_k",
        lambda x: lax.top_k(x, 2),
        lambda x: lax.top_k(-x, 1),
        ("float32", "int32"),
        ((EVEN,), (UNEVEN3,), (UNEVEN2,), (EMPTYBLK,), ((5, 0, 2),)),
        False,
    ),
    (
        "rev",
        lambda x: lax.rev(x, (0,)),
        lambda x: lax.rev(x, tuple(range(x.ndim))),
        ALL,
        UNARY_SHAPES,
        True,
    ),
    (
        "transpose",
        lambda x: lax.transpose(x, tuple(reversed(range(x.ndim)))),
        None,
        ALL,
        UNARY_SHAPES,
        True,
    ),
    ("reshape", lambda x: lax.reshape(x, (x.size,)), None, ALL, UNARY_SHAPES, True),
    (
        "expand_dims",
        lambda x: lax.expand_dims(x, (0,)),
        lambda x: lax.expand_dims(x, (x.ndim,)),
        ALL,
        UNARY_SHAPES,
        True,
    ),
    ("squeeze", lambda x: lax.squeeze(x[None], (0,)), None, ALL, UNARY_SHAPES, True),
    (
        "broadcast_in_dim",
        lambda x: lax.broadcast_in_dim(x, (2,) + x.shape, tuple(range(1, x.ndim + 1))),
        None,
        ALL,
        UNARY_SHAPES,
        True,
    ),
    ("broadcast", lambda x: lax.broadcast(x, (3,)), None, ("float32",), UNARY_SHAPES, True),
    (
        "slice",
        lambda x: lax.slice(x, (1,) + (0,) * (x.ndim - 1), x.shape),
        lambda x: lax.slice(x, (0,) * x.ndim, x.shape, (2,) * x.ndim),
        ALL,
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "slice_in_dim",
        lambda x: lax.slice_in_dim(x, 1, 3, axis=0),
        lambda x: lax.slice_in_dim(x, 0, 2, axis=x.ndim - 1),
        ("float32",),
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "index_in_dim",
        lambda x: lax.index_in_dim(x, 1, axis=0),
        lambda x: lax.index_in_dim(x, 0, axis=x.ndim - 1, keepdims=False),
        ("float32",),
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "dynamic_slice",
        lambda x: lax.dynamic_slice(x, (1,) + (0,) * (x.ndim - 1), (2,) + x.shape[1:]),
        lambda x: lax.dynamic_slice(x, (0,) * x.ndim, (1,) * x.ndim),
        ("float32", "int32"),
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "dynamic_slice_in_dim",
        lambda x: lax.dynamic_slice_in_dim(x, 1, 2, axis=0),
        None,
        ("float32",),
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "dynamic_index_in_dim",
        lambda x: lax.dynamic_index_in_dim(x, 2, axis=0),
        lambda x: lax.dynamic_index_in_dim(x, 0, axis=0, keepdims=False),
        ("float32",),
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "pad",
        lambda x: lax.pad(x, 0.0, [(1, 2, 0)] * x.ndim),
        lambda x: lax.pad(x, 1.0, [(0, 0, 1)] * x.ndim),
        ("float32",),
        UNARY_SHAPES,
        False,
    ),
    (
        "pad[negative]",
        lambda x: lax.pad(x, 0.0, [(-1, 1, 0)] + [(0, 0, 0)] * (x.ndim - 1)),
        None,
        ("float32",),
        NONEMPTY_SHAPES,
        True,
    ),
    (
        "collapse",
        lambda x: lax.collapse(x, 0, 2) if x.ndim > 1 else x,
        None,
        ("float32",),
        UNARY_SHAPES,
        True,
    ),
    (
        "reduce_precision[bf16]",
        lambda x: lax.reduce_precision(x, 8, 7),
        None,
        ("float32",),
        UNARY_SHAPES,
        False,
    ),
    (
        "iota",
        lambda x: x + lax.broadcasted_iota(jnp.float32, x.shape, 0),
        lambda x: x * lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1),
        ("float32",),
        UNARY_SHAPES,
        False,
    ),
]:
    unary(f"lax.{nm}", f, dtypes=dts, shapes=shp, fn2=f2, linear=lin)

add(
    "lax.concatenate",
    lambda a, b: lax.concatenate([a, b], 0),
    [LIN, LIN],
    SAME2,
    ALL,
    fn2=lambda a, b: lax.concatenate([b, a], a.ndim - 1),
)
add(
    "lax.dynamic_update_slice",
    lambda x, u: lax.dynamic_update_slice(x, u, (1,) + (0,) * (x.ndim - 1)),
    [LIN, LIN],
    ((EVEN, (2, 4)), (UNEVEN3, (3, 7, 3)), (UNEVEN2, (1, 5)), (EMPTYBLK, (1, 2))),
    ("float32", "int32"),
)
add(
    "lax.dynamic_slice[traced-idx]",
    lambda x, i: lax.dynamic_slice_in_dim(x, i[0], 2, axis=0),
    [LIN, Arg("idx<0,4>", dtype="int32")],
    ((EVEN, (2,)), (UNEVEN3, (2,)), (UNEVEN2, (1,))),
)
add(
    "lax.conv_general_dilated",
    lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"),
    [LIN, LIN],
    (((2, 3, 8, 8), (4, 3, 3, 3)), ((3, 2, 7, 5), (2, 2, 3, 3))),
    fn2=lambda x, w: lax.conv_general_dilated(x, w, (2, 1), "VALID"),
    tol=(1e-4, 1e-4),
)
add(
    "lax.conv",
    lambda x, w: lax.conv(x, w, (1, 1), "VALID"),
    [LIN, LIN],
    (((2, 3, 8, 8), (4, 3, 3, 3)), ((5, 2, 7, 5), (2, 2, 2, 2))),
    tol=(1e-4, 1e-4),
)
add(
    "lax.conv_general_dilated[nhwc]",
    lambda x, w: lax.conv_general_dilated(
        x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")
    ),
    [LIN, LIN],
    (((4, 9, 3), (3, 3, 2)), ((5, 7, 2), (2, 2, 4))),
    tol=(1e-4, 1e-4),
)
unary(
    "lax.reduce_window",
    lambda x: lax.reduce_window(x, 0.0, lax.add, (2,) * x.ndim, (1,) * x.ndim, "VALID"),
    shapes=((EVEN,), (UNEVEN2,), (UNEVEN3,)),
    linear=True,
)
unary(
    "lax.cond",
    lambda x: lax.cond(True, lambda t: t * 2, lambda t: t - 1, x),
    linear=False,
    fn2=lambda x: lax.cond(False, lambda t: t * 2, lambda t: t - 1, x),
)
unary(
    "lax.cond[traced]", lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), shapes=NONEMPTY_SHAPES
)
unary(
    "lax.fori_loop",
    lambda x: lax.fori_loop(0, 3, lambda i, t: t * 0.5 + 1.0, x),
    fn2=lambda x: lax.fori_loop(0, 2, lambda i, t: t - i, x),
)
unary(
    "lax.scan",
    lambda x: lax.scan(lambda c, r: (c + r, c * 2), jnp.zeros(x.shape[1:], x.dtype), x),
    shapes=NONEMPTY_SHAPES,
    linear=True,
)
unary("lax.map", lambda x: lax.map(jnp.sum, x), shapes=NONEMPTY_SHAPES, linear=True)
unary(
    "lax.while_loop",
    lambda x: lax.while_loop(lambda t: t[0] < 3, lambda t: (t[0] + 1, t[1] * 2), (0, x))[1],
    linear=True,
)
unary(
    "jax.vmap",
    lambda x: jax.vmap(jnp.sum)(x),
    shapes=NONEMPTY_SHAPES,
    linear=True,
    fn2=lambda x: jax.vmap(lambda r: r * r)(x),
)
unary(
    "jax.grad",
    lambda x: jax.grad(lambda t: jnp.sum(jnp.sin(t) * t))(x),
    fn2=lambda x: jax.grad(lambda t: jnp.sum(t**3))(x),
)
unary("jax.checkpoint", lambda x: jax.checkpoint(lambda t: jnp.sin(t) * 2)(x))
unary(
    "jax.jit[nested]",
    lambda x: jax.jit(lambda t: jnp.exp(t) + 1)(x),
    fn2=lambda x: jax.jit(lambda t: jnp.exp(t) + 1)(x * 2),
)

# ----------------------------------------------------------------------------------------------
# jax.random (keys as B / S(0) uint32 inputs, or created inside)

KEY = Arg("key", dtype="uint32", layouts=("B", "S(0)"))
KS = ((2,),)


def rnd(name, fn, fn2=None, shapes=UNARY_SHAPES, dtypes=("float32",), lin=False):
    """x + (or *) random draws with x's shape: the random slice each device draws must match."""
    add(name, fn, [KEY, Arg(linear=lin)], tuple(((2,), s[0]) for s in shapes), dtypes, fn2)


rnd("jax.random.normal", lambda k, x: x + jax.random.normal(k, x.shape))
rnd("jax.random.uniform", lambda k, x: x * jax.random.uniform(k, x.shape, minval=-1.0, maxval=2.0))
rnd("jax.random.bernoulli", lambda k, x: jnp.where(jax.random.bernoulli(k, 0.3, x.shape), x, 0.0))
rnd(
    "jax.random.categorical",
    lambda k, x: jax.random.categorical(k, x, axis=-1),
    shapes=NONEMPTY_SHAPES,
)
rnd("jax.random.randint", lambda k, x: x + jax.random.randint(k, x.shape, 0, 10).astype(x.dtype))
rnd(
    "jax.random.truncated_normal",
    lambda k, x: x + jax.random.truncated_normal(k, -1.0, 1.0, x.shape),
)
rnd("jax.random.gumbel", lambda k, x: x + jax.random.gumbel(k, x.shape))
rnd("jax.random.exponential", lambda k, x: x + jax.random.exponential(k, x.shape))
rnd("jax.random.laplace", lambda k, x: x + jax.random.laplace(k, x.shape))
rnd("jax.random.logistic", lambda k, x: x + jax.random.logistic(k, x.shape))
rnd("jax.random.cauchy", lambda k, x: x + jax.random.cauchy(k, x.shape))
rnd("jax.random.rademacher", lambda k, x: x * jax.random.rademacher(k, x.shape, dtype=jnp.float32))
rnd("jax.random.bits", lambda k, x: jax.random.bits(k, x.shape) ^ x.astype(jnp.uint32))
rnd("jax.random.gamma", lambda k, x: x + jax.random.gamma(k, 2.0, x.shape), shapes=NONEMPTY_SHAPES)
rnd(
    "jax.random.beta",
    lambda k, x: x + jax.random.beta(k, 2.0, 3.0, x.shape),
    shapes=NONEMPTY_SHAPES,
)
rnd(
    "jax.random.poisson",
    lambda k, x: x + jax.random.poisson(k, 3.0, x.shape).astype(x.dtype),
    shapes=NONEMPTY_SHAPES,
)
rnd(
    "jax.random.permutation",
    lambda k, x: jax.random.permutation(k, x, axis=0),
    shapes=NONEMPTY_SHAPES,
)
rnd(
    "jax.random.choice",
    lambda k, x: jax.random.choice(k, x, (3,), replace=True),
    shapes=NONEMPTY_SHAPES,
)
rnd(
    "jax.random.split",
    lambda k, x: x + jax.random.normal(jax.random.split(k)[1], x.shape),
    lambda k, x: x + jax.random.uniform(jax.random.split(k, 3)[2], x.shape),
)
rnd(
    "jax.random.fold_in",
    lambda k, x: x + jax.random.normal(jax.random.fold_in(k, 7), x.shape),
    lambda k, x: x + jax.random.normal(jax.random.fold_in(k, 8), x.shape),
)
rnd(
    "jax.random.dirichlet",
    lambda k, x: x + jax.random.dirichlet(k, jnp.ones(x.shape[-1]), x.shape[:-1]),
    shapes=NONEMPTY_SHAPES,
)
rnd(
    "jax.random.orthogonal",
    lambda k, x: x + jax.random.orthogonal(k, x.shape[-1]).sum(),
    shapes=NONEMPTY_SHAPES,
)
rnd(
    "jax.random.multivariate_normal",
    lambda k, x: (
        x
        + jax.random.multivariate_normal(
            k, jnp.zeros(x.shape[-1]), jnp.eye(x.shape[-1]), x.shape[:-1]
        )
    ),
    shapes=NONEMPTY_SHAPES,
)


unary(
    "jax.random.key",
    lambda x: x + jax.random.normal(jax.random.key(0), x.shape),
    fn2=lambda x: x + jax.random.normal(jax.random.key(1), x.shape),
    linear=True,
)
unary(
    "jax.random.PRNGKey",
    lambda x: x * jax.random.uniform(jax.random.PRNGKey(3), x.shape),
    fn2=lambda x: x * jax.random.uniform(jax.random.PRNGKey(4), x.shape),
    linear=True,
)
unary(
    "jax.random.bernoulli[inside]",
    lambda x: jnp.where(jax.random.bernoulli(jax.random.key(0), 0.5, x.shape), x, -x),
    fn2=lambda x: jnp.where(jax.random.bernoulli(jax.random.key(1), 0.5, x.shape), x, -x),
)
unary(
    "jax.random.key_data",
    lambda x: x + jax.random.key_data(jax.random.key(5)).sum().astype(x.dtype),
)
unary(
    "jax.random.wrap_key_data",
    lambda x: (
        x + jax.random.normal(jax.random.wrap_key_data(jnp.array([0, 9], jnp.uint32)), x.shape)
    ),
)

# ----------------------------------------------------------------------------------------------
# optax losses

LOG = ((EVEN,), (UNEVEN2,), (EMPTYBLK,), (UNEVEN3,))
PAIR = same(LOG, 2)
add(
    "optax.softmax_cross_entropy",
    optax.losses.softmax_cross_entropy,
    [A, Arg("prob")],
    PAIR,
    tol=(1e-5, 1e-5),
)
add(
    "optax.safe_softmax_cross_entropy",
    optax.losses.safe_softmax_cross_entropy,
    [A, Arg("prob")],
    PAIR,
)
add(
    "optax.softmax_cross_entropy_with_integer_labels",
    optax.losses.softmax_cross_entropy_with_integer_labels,
    [A, Arg("idx<0,3>", dtype="int32")],
    ((EVEN, (8,)), (UNEVEN2, (7,)), (EMPTYBLK, (3,)), (UNEVEN3, (5, 7))),
)
add(
    "optax.sigmoid_binary_cross_entropy",
    optax.losses.sigmoid_binary_cross_entropy,
    [A, Arg("prob")],
    PAIR,
)
add(
    "optax.sigmoid_focal_loss",
    optax.losses.sigmoid_focal_loss,
    [A, Arg("prob")],
    PAIR,
    fn2=lambda a, b: optax.losses.sigmoid_focal_loss(a, b, alpha=0.25, gamma=1.0),
)
add("optax.poly_loss_cross_entropy", optax.losses.poly_loss_cross_entropy, [A, Arg("prob")], PAIR)
add("optax.l2_loss", optax.losses.l2_loss, [A, A], PAIR)
add("optax.squared_error", optax.losses.squared_error, [A, A], PAIR)
add(
    "optax.huber_loss",
    optax.losses.huber_loss,
    [A, A],
    PAIR,
    fn2=lambda a, b: optax.losses.huber_loss(a, b, delta=0.5),
)
add("optax.log_cosh", optax.losses.log_cosh, [A, A], PAIR)
add(
    "optax.cosine_similarity",
    optax.losses.cosine_similarity,
    [A, A],
    PAIR,
    fn2=lambda a, b: optax.losses.cosine_similarity(a, b, epsilon=0.1),
)
add("optax.cosine_distance", optax.losses.cosine_distance, [A, A], PAIR)
add("optax.kl_divergence", optax.losses.kl_divergence, [A, Arg("prob")], PAIR)
add(
    "optax.kl_divergence_with_log_targets",
    optax.losses.kl_divergence_with_log_targets,
    [A, A],
    PAIR,
)
add("optax.convex_kl_divergence", optax.losses.convex_kl_divergence, [A, Arg("prob")], PAIR)
add("optax.hinge_loss", optax.losses.hinge_loss, [A, Arg("small")], PAIR)
add("optax.perceptron_loss", optax.losses.perceptron_loss, [A, Arg("small")], PAIR)
add(
    "optax.multiclass_hinge_loss",
    optax.losses.multiclass_hinge_loss,
    [A, Arg("idx<0,3>", dtype="int32")],
    ((EVEN, (8,)), (UNEVEN2, (7,)), (EMPTYBLK, (3,))),
)
add(
    "optax.multiclass_perceptron_loss",
    optax.losses.multiclass_perceptron_loss,
    [A, Arg("idx<0,3>", dtype="int32")],
    ((EVEN, (8,)), (UNEVEN2, (7,))),
)
add(
    "optax.smooth_labels",
    lambda y: optax.losses.smooth_labels(y, 0.1),
    [Arg("prob", linear=True)],
    LOG,
    fn2=lambda y: optax.losses.smooth_labels(y, 0.3),
)
add(
    "optax.sparsemax_loss",
    lambda a, y: optax.losses.sparsemax_loss(a, y),
    [A, Arg("idx<0,2>", dtype="int32")],
    PAIR,
)
add(
    "optax.ntxent",
    lambda e, y: optax.losses.ntxent(e, y),
    [A, Arg("idx<0,3>", dtype="int32")],
    ((EVEN, (8,)), (UNEVEN2, (7,))),
    tol=(1e-4, 1e-4),
)
add("optax.triplet_margin_loss", optax.losses.triplet_margin_loss, [A, A, A], same(LOG, 3))
add(
    "optax.dice_loss",
    lambda a, b: optax.losses.dice_loss(a, b),
    [A, Arg("prob")],
    (((8, 4), (8, 4)), ((7, 5), (7, 5))),
)
add(
    "optax.generalized_kl_divergence",
    optax.losses.generalized_kl_divergence,
    [Arg("pos"), Arg("pos")],
    PAIR,
)
add("optax.ranking_softmax_loss", optax.losses.ranking_softmax_loss, [A, Arg("prob")], PAIR)


def registry() -> list[Op]:
    return OPS


def function_names() -> set[str]:
    """Distinct public functions (variants of one function count once)."""
    return {o.name.split("[")[0] for o in OPS}
