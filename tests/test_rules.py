"""Brute-force validation of every SBP rule, as DTensor's strategy validator does.

For every registered primitive there is a table entry below (``CASES``) that traces a small
representative equation with even and uneven shapes. For every signature its rule offers on the
placements (4,) and (2, 2), the equation runs on local shards under exactly that signature
(``jsbp._lower.forced_program``), and the declared output layout's logical value is compared
with the single-device result.

The inputs are adversarial on purpose:

* partial inputs (``P``, ``Pmax``, ``Pmin``) get random, non-trivial addends on every device (the
  logical value is their sum / max / min), so a rule that keeps ``P`` through a non-linear op fails;
* the padding at the end of uneven blocks is garbage (NaN for floats, a large sentinel for integers),
  so a reduction or contraction that forgets to mask it fails;
* the outputs are read back device by device with an independent NumPy geometry (``np.array_split``,
  outer axis first): every device that claims to hold a block must hold exactly that block, and
  devices that share an addend on a ``B`` axis must agree.

Compiles are the cost (tens of ms each), so all the signatures of many equations run in ONE
``shard_map`` program per batch; a batch that fails to build is re-run case by case, then signature
by signature, to name the culprit. ``JSBP_FULL=1`` adds the placements (8,), (2, 4) and a sample
of (2, 2, 2).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import random
import sys
import traceback
import zlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

import jsbp
from jsbp import _sbp
from jsbp._emit import run_program
from jsbp._lower import candidate_signatures, forced_program
from jsbp.rules import registered
from jsbp.rules.control import HANDLED_BY_COMPILER

FULL = os.environ.get("JSBP_FULL", "") not in ("", "0")

# The cost of the sweep is XLA compile time, not run time: skip the expensive backend passes.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

# -------------------------------------------------------------------------------------------
# the sample-input table: primitive name -> equations to trace
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arg:
    """An abstract example argument; ``dom`` says how to draw values (see ``_draw``)."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    dom: str | None = None


def f32(*shape, dom=None):
    return Arg(tuple(shape), "float32", dom)


def i32(*shape, dom=None):
    return Arg(tuple(shape), "int32", dom)


def u32(*shape, dom=None):
    return Arg(tuple(shape), "uint32", dom)


def boolean(*shape):
    return Arg(tuple(shape), "bool")


def c64(*shape):
    return Arg(tuple(shape), "complex64")


def key(*shape):
    return Arg(tuple(shape), "key")


@dataclasses.dataclass
class Case:
    prim: str
    fn: Callable
    args: tuple[Arg, ...]
    dom: dict[int, str]  # overrides for the traced equation's operands (by position)
    label: str

    @functools.cached_property
    def traced(self):
        return _extract(self)


CASES: dict[str, list[Case]] = {}


def case(prim: str, fn: Callable, *args: Arg, dom: dict[int, str] | None = None, label: str = ""):
    lst = CASES.setdefault(prim, [])
    shapes = "x".join(str(list(a.shape)) for a in args)
    lst.append(Case(prim, fn, args, dom or {}, label or f"{prim}#{len(lst)} {shapes}"))


# fmt: off
EVEN, UNEVEN, TINY = (8, 4), (7, 5), (3, 5)  # TINY: 3 over 4 devices leaves one block empty

# -- elementwise unary ----------------------------------------------------------------------
_UNARY_DOM = {
    "exp": None, "exp2": None, "log": "pos", "log1p": "pos", "expm1": None, "tanh": None,
    "logistic": None, "sqrt": "pos", "rsqrt": "pos", "cbrt": None, "sin": None, "cos": None,
    "tan": "unit", "asin": "unit", "acos": "unit", "atan": None, "sinh": None, "cosh": None,
    "asinh": None, "acosh": "gt1", "atanh": "unit", "abs": None, "sign": None, "floor": None,
    "ceil": None, "erf": None, "erfc": None, "erf_inv": "unit", "lgamma": "pos", "digamma": "pos",
    "is_finite": "special", "neg": None, "square": None, "bessel_i0e": None, "bessel_i1e": None,
}
_LAX_UNARY = {
    "exp": lax.exp, "exp2": lax.exp2, "log": lax.log, "log1p": lax.log1p, "expm1": lax.expm1,
    "tanh": lax.tanh, "logistic": lax.logistic, "sqrt": lax.sqrt, "rsqrt": lax.rsqrt,
    "cbrt": lax.cbrt, "sin": lax.sin, "cos": lax.cos, "tan": lax.tan, "asin": lax.asin,
    "acos": lax.acos, "atan": lax.atan, "sinh": lax.sinh, "cosh": lax.cosh, "asinh": lax.asinh,
    "acosh": lax.acosh, "atanh": lax.atanh, "abs": lax.abs, "sign": lax.sign, "floor": lax.floor,
    "ceil": lax.ceil, "erf": lax.erf, "erfc": lax.erfc, "erf_inv": lax.erf_inv,
    "lgamma": lax.lgamma, "digamma": lax.digamma, "is_finite": lax.is_finite, "neg": lax.neg,
    "square": lax.square, "bessel_i0e": lax.bessel_i0e, "bessel_i1e": lax.bessel_i1e,
}
for _name, _fn in _LAX_UNARY.items():
    for _shape in (EVEN, UNEVEN):
        case(_name, _fn, f32(*_shape, dom=_UNARY_DOM[_name]))
# primitives of newer JAX versions, traced where this JAX emits them (their rules are
# registered by name whatever the version)
NOT_IN_THIS_JAX: set[str] = set()
for _name, _fn, _dom in (
    ("one_minus_square", jax.grad(lambda x: jnp.tanh(x).sum()), None),  # JAX >= 0.11: d tanh
    ("log2", jnp.log2, "pos"),
):
    if any(e.primitive.name == _name for e in jax.make_jaxpr(_fn)(jnp.ones(EVEN, jnp.float32)).jaxpr.eqns):
        for _shape in (EVEN, UNEVEN):
            case(_name, _fn, f32(*_shape, dom=_dom))
    else:
        NOT_IN_THIS_JAX.add(_name)
case("neg", lax.neg, f32(*TINY))
case("abs", lax.abs, i32(*UNEVEN))
case("round", lambda x: lax.round(x, lax.RoundingMethod.TO_NEAREST_EVEN), f32(*UNEVEN, dom="wide"))
case("round", lax.round, f32(*EVEN, dom="wide"))
for _y in (1, 2, 3):
    case("integer_pow", lambda x, y=_y: lax.integer_pow(x, y), f32(*UNEVEN))
case("integer_pow", lambda x: lax.integer_pow(x, 1), f32(*TINY))
case("integer_pow", lambda x: lax.integer_pow(x, -2), f32(*EVEN, dom="pos"))
case("integer_pow", lambda x: lax.integer_pow(x, 3), i32(*UNEVEN))
case("reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), f32(*UNEVEN))
case("reduce_precision", lambda x: lax.reduce_precision(x, 8, 7), f32(*EVEN))
case("population_count", lax.population_count, i32(*UNEVEN))
case("population_count", lax.population_count, u32(*EVEN))
case("clz", lax.clz, i32(*UNEVEN))
case("clz", lax.clz, u32(*EVEN))
case("not", lax.bitwise_not, boolean(*UNEVEN))
case("not", lax.bitwise_not, i32(*EVEN))
case("stop_gradient", lax.stop_gradient, f32(*UNEVEN))
case("stop_gradient", lax.stop_gradient, f32(*TINY))
case("copy", jnp.copy, f32(*UNEVEN))
case("copy", jnp.copy, i32(*EVEN))
for _name, _fn in (("real", lax.real), ("imag", lax.imag), ("conj", lax.conj)):
    case(_name, _fn, c64(*UNEVEN))
    case(_name, _fn, c64(*EVEN))

# -- elementwise binary ------------------------------------------------------------------------
_LAX_BINARY = {
    "add": (lax.add, None, None), "sub": (lax.sub, None, None), "mul": (lax.mul, None, None),
    "div": (lax.div, None, "nonzero"), "rem": (lax.rem, None, "nonzero"),
    "pow": (lax.pow, "pos", None), "max": (lax.max, None, None), "min": (lax.min, None, None),
    "atan2": (lax.atan2, None, None), "nextafter": (lax.nextafter, None, None),
    "eq": (lax.eq, "coarse", "coarse"), "ne": (lax.ne, "coarse", "coarse"),
    "lt": (lax.lt, "coarse", "coarse"), "le": (lax.le, "coarse", "coarse"),
    "gt": (lax.gt, "coarse", "coarse"), "ge": (lax.ge, "coarse", "coarse"),
    "igamma": (lax.igamma, "pos", "pos"), "igammac": (lax.igammac, "pos", "pos"),
    "polygamma": (lax.polygamma, "order", "pos"), "zeta": (lax.zeta, "gt1", "pos"),
}
for _name, (_fn, _da, _db) in _LAX_BINARY.items():
    for _shape in (EVEN, UNEVEN):
        case(_name, _fn, f32(*_shape, dom=_da), f32(*_shape, dom=_db))
for _name in ("add", "sub", "mul", "max", "min"):
    case(_name, getattr(lax, _name), f32(*TINY), f32(*TINY))
for _name in ("div", "rem"):
    case(_name, getattr(lax, _name), i32(*UNEVEN), i32(*UNEVEN, dom="nonzero"))
case("add", lax.add, i32(*UNEVEN), i32(*UNEVEN))
case("sub", lax.sub, i32(*UNEVEN), i32(*UNEVEN))
case("max", lax.max, i32(*UNEVEN), i32(*UNEVEN))
case("add_any", lambda a, b: __import__("jax._src.ad_util", fromlist=["x"]).add_jaxvals_p.bind(a, b),
     f32(*UNEVEN), f32(*UNEVEN))
case("add_any", lambda a, b: __import__("jax._src.ad_util", fromlist=["x"]).add_jaxvals_p.bind(a, b),
     f32(*EVEN), f32(*EVEN))
for _name, _fn in (("and", lax.bitwise_and), ("or", lax.bitwise_or), ("xor", lax.bitwise_xor)):
    case(_name, _fn, i32(*UNEVEN), i32(*UNEVEN))
    case(_name, _fn, boolean(*EVEN), boolean(*EVEN))
for _name in ("shift_left", "shift_right_logical", "shift_right_arithmetic"):
    case(_name, getattr(lax, _name), i32(*UNEVEN), i32(*UNEVEN, dom="shift"))
    case(_name, getattr(lax, _name), u32(*EVEN), u32(*EVEN, dom="shift"))
case("eq", lax.eq, i32(*UNEVEN, dom="coarse"), i32(*UNEVEN, dom="coarse"))

# -- select_n, clamp, convert_element_type, bitcast ------------------------------------------------
case("select_n", lax.select_n, boolean(*UNEVEN), f32(*UNEVEN), f32(*UNEVEN))
case("select_n", lax.select_n, boolean(*EVEN), f32(*EVEN), f32(*EVEN))
case("select_n", lax.select_n, boolean(), f32(*UNEVEN), f32(*UNEVEN))
case("select_n", lax.select_n, i32(*UNEVEN, dom="idx:3"), f32(*UNEVEN), f32(*UNEVEN), f32(*UNEVEN))
case("clamp", lax.clamp, f32(dom="neg"), f32(*UNEVEN), f32(dom="pos"))
case("clamp", lax.clamp, f32(*EVEN), f32(*EVEN), f32(*EVEN))
case("clamp", lax.clamp, i32(), i32(*TINY), i32(dom="wide"))
case("select_n", lax.select_n, boolean(), i32(*UNEVEN), i32(*UNEVEN))
for _src, _dst in (("float32", "int32"), ("int32", "float32"), ("float32", "bool"), ("bool", "float32"),
                   ("float32", "float16"), ("float32", "bfloat16"), ("int32", "int8")):
    for _shape in (EVEN, UNEVEN):
        case("convert_element_type", lambda x, d=_dst: lax.convert_element_type(x, jnp.dtype(d)),
             Arg(_shape, _src, "wide" if _src == "float32" else None))
case("convert_element_type", lambda x: lax.convert_element_type(x, jnp.float32), Arg(TINY, "float16"))
for _dst in ("int32", "uint32", "int8", "uint16"):
    case("bitcast_convert_type", lambda x, d=_dst: lax.bitcast_convert_type(x, jnp.dtype(d)), f32(*UNEVEN))
case("bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.float32), i32(*EVEN))
case("bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.float32),
     Arg((7, 5, 2), "int16"))

# -- annotation-only primitives -------------------------------------------------------------------
# (sharding_constraint / reshard are layout requests the compiler handles: tests/test_interop.py)
case("name", lambda x: __import__("jax.ad_checkpoint", fromlist=["x"]).checkpoint_name(x, "h"), f32(*UNEVEN))
case("name", lambda x: __import__("jax.ad_checkpoint", fromlist=["x"]).checkpoint_name(x, "h"), f32(*EVEN))
case("optimization_barrier", lambda x: lax.optimization_barrier(x), f32(*UNEVEN))
case("optimization_barrier", lambda x, y: lax.optimization_barrier((x, y)), f32(*UNEVEN), f32(*TINY))

# -- reductions ---------------------------------------------------------------------------------
for _name, _fn in (("reduce_sum", lax.reduce_sum), ("reduce_max", lax.reduce_max),
                   ("reduce_min", lax.reduce_min), ("reduce_prod", lax.reduce_prod)):
    dom = "pos" if _name == "reduce_prod" else None
    for _shape in (EVEN, UNEVEN, TINY):
        for _axes in ((0,), (1,), (0, 1)):
            if _shape == TINY and _axes != (0,):
                continue
            case(_name, lambda x, a=_axes, f=_fn: f(x, a), f32(*_shape, dom=dom))
    case(_name, lambda x, f=_fn: f(x, (1,)), Arg((6, 7, 3), "float32", dom))
for _name, _fn in (("reduce_sum", lax.reduce_sum), ("reduce_max", lax.reduce_max),
                   ("reduce_min", lax.reduce_min)):
    case(_name, lambda x, f=_fn: f(x, (0,)), i32(*UNEVEN))
case("reduce_max", lambda x: lax.reduce_max(x, (0, 1)), f32(*UNEVEN, dom="neg"))  # padding != 0
case("reduce_min", lambda x: lax.reduce_min(x, (0, 1)), f32(*UNEVEN, dom="pos"))
for _name, _fn in (("reduce_and", lax.reduce_and), ("reduce_or", lax.reduce_or)):
    case(_name, lambda x, f=_fn: f(x, (0,)), boolean(*UNEVEN))
    case(_name, lambda x, f=_fn: f(x, (1,)), boolean(*EVEN))
case("reduce_xor", lambda x: lax.reduce_xor(x, (0,)), i32(*UNEVEN))
case("reduce_xor", lambda x: lax.reduce_xor(x, (1,)), i32(*EVEN))
for _name, _fn in (("argmax", lax.argmax), ("argmin", lax.argmin)):
    for _shape in (EVEN, UNEVEN, TINY):
        for _ax in (0, 1):
            case(_name, lambda x, a=_ax, f=_fn: f(x, a, jnp.int32), f32(*_shape))
for _name, _fn in (("cumsum", lax.cumsum), ("cumprod", lax.cumprod), ("cummax", lax.cummax),
                   ("cummin", lax.cummin), ("cumlogsumexp", lax.cumlogsumexp)):
    dom = "pos" if _name == "cumprod" else None
    for _shape in (EVEN, UNEVEN):
        for _ax in (0, 1):
            case(_name, lambda x, a=_ax, f=_fn: f(x, a), f32(*_shape, dom=dom))
    case(_name, lambda x, f=_fn: f(x, 0, reverse=True), f32(*UNEVEN, dom=dom))

# -- attention (jsbp.nn): query [b, t, heads, d], key/value [b, s, kv_heads, d] ------------------
def _attention_case(bwd, causal=True, bias=False, mask=False):
    from jsbp.nn import _attention

    def bind(*ops):
        params = dict(scale=0.5, is_causal=causal, plan=None, has_bias=bias, has_mask=mask)
        return (_attention.bwd_p if bwd else _attention.fwd_p).bind(*ops, **params)

    return bind


for _t, _n, _kv in ((8, 4, 4), (7, 4, 2)):
    _qkv = (f32(2, _t, _n, 4), f32(2, _t, _kv, 4), f32(2, _t, _kv, 4))
    case("jsbp_attention", _attention_case(False), *_qkv)
    case("jsbp_attention_bwd", _attention_case(True), *_qkv, f32(2, _t, _n, 4),
         f32(2, _n, _t), f32(2, _t, _n, 4))
case("jsbp_attention", _attention_case(False, False, True, True), f32(2, 7, 4, 4),
     f32(2, 7, 4, 4), f32(2, 7, 4, 4), f32(1, 4, 7, 7), boolean(2, 1, 1, 7))
case("jsbp_attention_bwd", _attention_case(True, False, True, True), f32(2, 7, 4, 4),
     f32(2, 7, 4, 4), f32(2, 7, 4, 4), f32(1, 4, 7, 7), boolean(2, 1, 1, 7), f32(2, 7, 4, 4),
     f32(2, 4, 7), f32(2, 7, 4, 4))

# -- contractions -------------------------------------------------------------------------------
_MM = (((1,), (0,)), ((), ()))
case("dot_general", lambda a, b: lax.dot_general(a, b, _MM), f32(8, 4), f32(4, 6))
case("dot_general", lambda a, b: lax.dot_general(a, b, _MM), f32(7, 5), f32(5, 3))
case("dot_general", lambda a, b: lax.dot_general(a, b, _MM), f32(3, 5), f32(5, 6))
case("dot_general", lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ()))), f32(7, 5), f32(5))
case("dot_general", lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), f32(4, 3, 4), f32(4, 4, 6))
case("dot_general", lambda a, b: lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,)))), f32(3, 5, 3), f32(3, 3, 2))
case("dot_general", lambda a, b: lax.dot_general(a, b, (((0, 2), (1, 0)), ((), ()))), f32(5, 3, 7), f32(7, 5, 2))
case("dot_general", lambda a, b: lax.dot_general(a, b, _MM), i32(7, 5), i32(5, 3))
_NCHW = ("NCHW", "OIHW", "NCHW")
case("conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_NCHW),
     f32(4, 4, 5, 5), f32(6, 4, 3, 3))
case("conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (2, 1), "VALID", dimension_numbers=_NCHW),
     f32(3, 5, 6, 5), f32(3, 5, 3, 2))
case("conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")),
     f32(5, 7, 3), f32(3, 3, 5))
case("conv_general_dilated",
     lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=_NCHW,
                                           feature_group_count=2),
     f32(3, 4, 5, 5), f32(6, 2, 3, 3))

# -- shape --------------------------------------------------------------------------------------
case("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (5, 7), (1,)), f32(7))
case("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (7, 5), (0, 1)), f32(7, 1))
case("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (3, 5), ()), f32())
case("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (8, 2, 4), (0, 2)), f32(8, 4))
case("broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (7, 5, 3), (0, 1)), f32(7, 5))
for _a, _b in (((8, 4), (32,)), ((8, 4), (2, 4, 4)), ((7, 5), (35,)), ((4, 6), (8, 3)),
               ((1, 8), (8,)), ((8,), (2, 4)), ((12,), (3, 4)), ((4, 6), (2, 12)), ((6, 4), (4, 6)),
               ((8, 4), (8, 2, 2)), ((2, 4, 4), (8, 4)), ((7, 5), (7, 5, 1)), ((8, 3), (4, 2, 3)),
               ((7, 5, 6), (7, 30)), ((7, 30), (7, 5, 6)), ((1, 7), (7,)), ((4, 7, 3), (2, 2, 7, 3)),
               ((3, 5), (3, 5, 1))):
    case("reshape", lambda x, s=_b: lax.reshape(x, s), f32(*_a))
case("reshape", lambda x: lax.reshape(x, (3, 3, 8, 1), dimensions=(0, 1, 3, 2, 4)), f32(3, 3, 1, 8, 1))
case("reshape", lambda x: lax.reshape(x, (4, 8), dimensions=(1, 0)), f32(8, 4))
case("reshape", lambda x: lax.reshape(x, (8, 12), dimensions=(2, 0, 1)), f32(4, 3, 8))
case("transpose", lambda x: lax.transpose(x, (1, 0)), f32(*UNEVEN))
case("transpose", lambda x: lax.transpose(x, (1, 0)), f32(*EVEN))
case("transpose", lambda x: lax.transpose(x, (2, 0, 1)), f32(3, 5, 4))
case("squeeze", lambda x: lax.squeeze(x, (1,)), f32(7, 1, 5))
case("squeeze", lambda x: lax.squeeze(x, (0, 2)), f32(1, 8, 1))
case("rev", lambda x: lax.rev(x, (0,)), f32(*UNEVEN))
case("rev", lambda x: lax.rev(x, (0, 1)), f32(*EVEN))
case("rev", lambda x: lax.rev(x, (1,)), f32(*TINY))
case("concatenate", lambda a, b: lax.concatenate([a, b], 0), f32(7, 5), f32(3, 5))
case("concatenate", lambda a, b: lax.concatenate([a, b], 1), f32(7, 5), f32(7, 2))
case("concatenate", lambda a, b, c: lax.concatenate([a, b, c], 1), f32(8, 4), f32(8, 4), f32(8, 1))
case("pad", lambda x, v: lax.pad(x, v, ((1, 2, 0), (0, 0, 0))), f32(*UNEVEN), f32())
case("pad", lambda x, v: lax.pad(x, v, ((0, 0, 0), (2, -1, 1))), f32(*UNEVEN), f32())
case("pad", lambda x, v: lax.pad(x, v, ((0, 0, 0), (0, 0, 0))), f32(*EVEN), f32())
case("slice", lambda x: lax.slice(x, (1, 0), (6, 5)), f32(*UNEVEN))
case("slice", lambda x: lax.slice(x, (0, 1), (8, 4), (1, 2)), f32(*EVEN))
case("slice", lambda x: lax.slice(x, (0, 0), (3, 4)), f32(*TINY))
case("split", lambda x: lax.split(x, (3, 4), 0), f32(*UNEVEN))
case("split", lambda x: lax.split(x, (2, 2), 1), f32(*EVEN))
case("dynamic_slice", lambda x, i, j: lax.dynamic_slice(x, (i, j), (3, 5)), f32(*UNEVEN), i32(dom="idx:5"), i32(dom="idx:1"))
case("dynamic_slice", lambda x, i, j: lax.dynamic_slice(x, (i, j), (8, 2)), f32(*EVEN), i32(dom="idx:1"), i32(dom="idx:3"))
case("dynamic_update_slice", lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j)),
     f32(*UNEVEN), f32(2, 5), i32(dom="idx:6"), i32(dom="idx:1"))
case("dynamic_update_slice", lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j)),
     f32(*EVEN), f32(8, 3), i32(dom="idx:1"), i32(dom="idx:2"))
case("iota", lambda: lax.broadcasted_iota(jnp.int32, UNEVEN, 0))
case("iota", lambda: lax.broadcasted_iota(jnp.float32, UNEVEN, 1))
case("iota", lambda: lax.broadcasted_iota(jnp.int32, EVEN, 0))
case("iota", lambda: lax.iota(jnp.int32, 7))
case("sort", lambda x: lax.sort(x, dimension=0), f32(*UNEVEN))
case("sort", lambda x: lax.sort(x, dimension=1), f32(*EVEN))
case("sort", lambda x, y: lax.sort((x, y), dimension=1, num_keys=1), f32(*UNEVEN), i32(*UNEVEN))
case("top_k", lambda x: lax.top_k(x, 2), f32(*UNEVEN))
case("top_k", lambda x: lax.top_k(x, 3), f32(*EVEN))
case("top_k", lambda x: lax.top_k(x, 2), f32(3, 7, 4))

# -- gather / scatter -------------------------------------------------------------------------------
case("gather", lambda t, i: t[i], f32(10, 6), i32(7), dom={1: "idx:10"})       # embedding lookup
case("gather", lambda t, i: t[i], f32(8, 4), i32(4, 3), dom={1: "idx:8"})
case("gather", lambda t, i: t[:, i], f32(7, 9), i32(5), dom={1: "idx:9"})      # gather along dim 1
case("gather", lambda t, i, j: t[i, j], f32(7, 5), i32(6), i32(6), dom={1: "idx:5"})
# out-of-range indices: clipped, or filled (NaN) — the vocab-parallel path must agree
case("gather", lambda t, i: jnp.take(t, i, axis=0, mode="clip"), f32(10, 6), i32(9), dom={1: "oob:10"})
case("gather", lambda t, i: jnp.take(t, i, axis=0, mode="fill"), f32(10, 6), i32(9), dom={1: "oob:10"})
case("gather", lambda t, i: jnp.take(t, i, axis=0, mode="fill", fill_value=-1), i32(7, 3), i32(9), dom={1: "oob:7"})
for _name, _meth in (("scatter-add", "add"), ("scatter-sub", "subtract"), ("scatter-mul", "multiply"),
                     ("scatter-min", "min"), ("scatter-max", "max"), ("scatter", "set")):
    idx = "perm:10" if _name == "scatter" else "idx:10"
    case(_name, lambda t, i, u, m=_meth: getattr(t.at[i], m)(u), f32(10, 6), i32(7), f32(7, 6), dom={1: idx})
    idx = "perm:8" if _name == "scatter" else "idx:8"
    case(_name, lambda t, i, u, m=_meth: getattr(t.at[i], m)(u), f32(8, 4), i32(4), f32(4, 4), dom={1: idx})
case("scatter-add", lambda t, i, u: t.at[i].add(u), f32(9, 5), i32(3, 3), f32(3, 3, 5), dom={1: "idx:9"})
case("scatter-add", lambda t, i, u: t.at[:, i].add(u), f32(7, 9), i32(5), f32(7, 5), dom={1: "idx:9"})
case("scatter-add", lambda t, i, u: t.at[i].add(u, mode="clip"), f32(10, 6), i32(9), f32(9, 6), dom={1: "oob:10"})
case("scatter-add", lambda t, i, u: t.at[i].add(u, mode="drop"), f32(10, 6), i32(9), f32(9, 6), dom={1: "oob:10"})
# batching dims (take_along_axis, as in cross-entropy on integer labels, and its gradient)
case("gather", lambda x, i: jnp.take_along_axis(x, i, axis=-1), f32(7, 5, 6), i32(7, 5, 1), dom={1: "idx:6"})
case("gather", lambda x, i: jnp.take_along_axis(x, i, axis=-1), f32(8, 4, 3), i32(8, 4, 2), dom={1: "idx:3"})
case("scatter-add", lambda x, i, u: jax.vjp(lambda y: jnp.take_along_axis(y, i, axis=-1), x)[1](u)[0],
     f32(7, 5, 6), i32(7, 5, 1), f32(7, 5, 1), dom={1: "idx:6"})
case("scatter", lambda x, i, u: lax.scatter(x, i, u, lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(2,), scatter_dims_to_operand_dims=(2,),
        operand_batching_dims=(0, 1), scatter_indices_batching_dims=(0, 1))),
     f32(7, 5, 6), i32(7, 5, 1), f32(7, 5), dom={1: "idx:6"})

# -- PRNG ---------------------------------------------------------------------------------------
case("random_seed", lambda s: jax.random.key(s), i32())
case("random_bits", lambda k: jax.random.bits(k, UNEVEN), key())
case("random_bits", lambda k: jax.random.bits(k, EVEN), key())
case("random_bits", lambda k: jax.vmap(lambda kk: jax.random.bits(kk, (3, 5)))(k), key(7))
case("random_bits", lambda k: jax.vmap(lambda kk: jax.random.bits(kk, (8,), jnp.uint8))(k), key(8))
case("random_gamma", lambda k, a: jax.random.gamma(k, a), key(), f32(*UNEVEN, dom="pos"))
case("random_gamma", lambda k, a: jax.vmap(lambda kk, aa: jax.random.gamma(kk, aa))(k, a),
     key(7), f32(7, 3, dom="pos"))
case("random_gamma", lambda k, a: jax.vmap(lambda kk, aa: jax.random.beta(kk, aa, aa))(k, a),
     key(8), f32(8, 2, dom="pos"))
case("random_split", lambda k: jax.random.split(k, 3), key())
case("random_fold_in", lambda k, d: jax.random.fold_in(k, d), key(), u32())
case("random_wrap", lambda d: jax.random.wrap_key_data(d), u32(7, 2))
case("random_wrap", lambda d: jax.random.wrap_key_data(d), u32(8, 3, 2))
case("random_unwrap", jax.random.key_data, key(7))
case("random_unwrap", jax.random.key_data, key(8, 3))
case("random_clone", jax.random.clone, key(7))
case("random_clone", jax.random.clone, key())


def _threefry(a, b, c, d):
    from jax._src.random.threefry2x32 import threefry2x32_p

    return threefry2x32_p.bind(a, b, c, d)


case("threefry2x32", _threefry, u32(*UNEVEN), u32(*UNEVEN), u32(*UNEVEN), u32(*UNEVEN))
case("threefry2x32", _threefry, u32(*EVEN), u32(*EVEN), u32(*EVEN), u32(*EVEN))
case("rng_bit_generator", lambda k: lax.rng_bit_generator(k, UNEVEN), u32(4))
case("rng_bit_generator", lambda k: lax.rng_bit_generator(k, EVEN), u32(4))

# -- JAX 0.10 shape / elementwise primitives (jnp.stack, jnp.select, jnp.unstack, jnp.tile) ----------
case("stack", lambda a, b: jnp.stack([a, b], 1), f32(*UNEVEN), f32(*UNEVEN))
case("stack", lambda a, b, c: jnp.stack([a, b, c], 0), f32(*EVEN), f32(*EVEN), f32(*EVEN))
case("stack", lambda a, b: jnp.stack([a, b], 2), f32(*TINY), f32(*TINY))
case("unstack", lambda a: jnp.unstack(a, axis=1), f32(*UNEVEN))
case("unstack", lambda a: jnp.unstack(a, axis=0), f32(*EVEN))
case("unstack", lambda a: jnp.unstack(a, axis=1), f32(3, 2, 5))
case("tile", lambda a: jnp.tile(a, (1, 3)), f32(*UNEVEN))
case("tile", lambda a: jnp.tile(a, (2, 1)), f32(*EVEN))
case("tile", lambda a: jnp.tile(a, (2, 1, 3)), f32(*TINY))
case("complex", lax.complex, f32(*UNEVEN), f32(*UNEVEN))
case("complex", lax.complex, f32(*EVEN), f32(*EVEN))
for _name in ("eq_to", "le_to", "lt_to"):
    _p = getattr(__import__("jax._src.lax.lax", fromlist=["x"]), _name + "_p")
    case(_name, _p.bind, f32(*UNEVEN, dom="special"), f32(*UNEVEN, dom="coarse"))
    case(_name, _p.bind, i32(*EVEN), i32(*EVEN))
case("le_to", lambda a, v: jnp.searchsorted(a, v), f32(6), f32(*UNEVEN))
case("platform_index", lambda x: lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos), f32(*UNEVEN))
_empty2 = __import__("jax._src.lax.lax", fromlist=["x"]).empty2
_device_space = __import__("jax._src.core", fromlist=["x"]).MemorySpace.Device
case("empty2", lambda x: x + _empty2(jnp.float32, memory_space=_device_space), f32(*UNEVEN))

# -- fft ------------------------------------------------------------------------------------------
case("fft", jnp.fft.fft, c64(*UNEVEN))
case("fft", jnp.fft.ifft, c64(*EVEN))
case("fft", jnp.fft.rfft, f32(*UNEVEN))
case("fft", jnp.fft.irfft, c64(*TINY))
case("fft", jnp.fft.fft2, c64(3, 4, 6))
case("fft", lambda x: jnp.fft.rfftn(x, axes=(1, 2)), f32(7, 4, 6))

# -- pooling (lax.reduce_window, flax.nnx.avg_pool / max_pool / min_pool) and its gradients --------
_RW = lax.reduce_window
_NINF = -float("inf")
for _name, _init, _op in (("reduce_window_sum", 0.0, lax.add), ("reduce_window_max", _NINF, lax.max),
                          ("reduce_window_min", float("inf"), lax.min)):
    case(_name, lambda x, i=_init, o=_op: _RW(x, i, o, (2, 1), (2, 1), "VALID"), f32(*EVEN))  # aligned
    case(_name, lambda x, i=_init, o=_op: _RW(x, i, o, (1, 3), (1, 1), "SAME"), f32(*UNEVEN, dom="neg"))
    case(_name, lambda x, i=_init, o=_op: _RW(x, i, o, (3, 1), (2, 1), "SAME"), f32(*TINY))
    case(_name, lambda x, i=_init, o=_op: _RW(x, i, o, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"), f32(2, 8, 4, 3))
case("reduce_window_sum", lambda x: _RW(x, 0.0, lax.add, (1, 2), (1, 1), [(0, 0), (1, 1)], base_dilation=(1, 2)),
     f32(*UNEVEN))
case("reduce_window_sum", lambda x: _RW(x, 0.0, lax.add, (2, 1), (1, 1), "VALID", window_dilation=(2, 1)),
     f32(*EVEN))
case("reduce_window_max", lambda x: _RW(x, jnp.iinfo(jnp.int32).min, lax.max, (1, 2), (1, 2), "VALID"),
     i32(*UNEVEN))
case("reduce_window", lambda x: _RW(x, 1.0, lax.mul, (2, 1), (2, 1), "VALID"), f32(*EVEN))
case("reduce_window", lambda x: _RW(x, 1.0, lax.mul, (1, 2), (1, 1), "SAME"), f32(*UNEVEN, dom="pos"))
case("reduce_window", lambda x, y: _RW((x, y), (0.0, 0.0), lambda a, b: (a[0] + b[0], lax.max(a[1], b[1])),
                                       (1, 3), (1, 1), "VALID"), f32(*UNEVEN), f32(*UNEVEN))


def _maxpool(window, strides, padding):
    return lambda y: _RW(y, _NINF, lax.max, window, strides, padding)


case("select_and_scatter_add", lambda x, g: jax.vjp(_maxpool((2, 1), (2, 1), "VALID"), x)[1](g)[0],
     f32(*EVEN), f32(4, 4))
case("select_and_scatter_add", lambda x, g: jax.vjp(_maxpool((1, 3), (1, 1), "SAME"), x)[1](g)[0],
     f32(*UNEVEN), f32(*UNEVEN))
case("select_and_scatter_add", lambda x, g: jax.vjp(_maxpool((3, 2), (2, 2), "SAME"), x)[1](g)[0],
     f32(*TINY), f32(2, 3))
case("select_and_gather_add", lambda x, t: jax.jvp(_maxpool((2, 1), (2, 1), "VALID"), (x,), (t,))[1],
     f32(*EVEN), f32(*EVEN))
case("select_and_gather_add", lambda x, t: jax.jvp(_maxpool((1, 3), (1, 1), "SAME"), (x,), (t,))[1],
     f32(*UNEVEN), f32(*UNEVEN))


def _select_and_scatter(window, strides, padding):
    from jax._src.lax.windowed_reductions import _select_and_scatter as sas

    return lambda x, s: sas(x, lax.ge, window, strides, padding, s, jnp.float32(0), lax.add)


case("select_and_scatter", _select_and_scatter((2, 1), (2, 1), ((0, 0), (0, 0))), f32(*EVEN), f32(4, 4))
case("select_and_scatter", _select_and_scatter((1, 3), (1, 1), ((0, 0), (1, 1))), f32(*UNEVEN), f32(*UNEVEN))

# -- grouped (depthwise) convolutions and their gradients (batch_group_count for the kernel's) ------


def _conv(dn, groups):
    return lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn,
                                                 feature_group_count=groups)


_NHWC = ("NHWC", "HWIO", "NHWC")
for _x, _w, _dn, _g in (((3, 4, 5, 5), (8, 1, 3, 3), _NCHW, 4), ((2, 5, 3, 8), (3, 3, 1, 8), _NHWC, 8),
                        ((5, 8, 3, 3), (8, 2, 3, 3), _NCHW, 4)):
    _f = _conv(_dn, _g)
    case("conv_general_dilated", _f, f32(*_x), f32(*_w))
    _out = jax.eval_shape(_f, jax.ShapeDtypeStruct(_x, jnp.float32),
                          jax.ShapeDtypeStruct(_w, jnp.float32)).shape
    # the input gradient (a grouped conv) and the kernel gradient (batch_group_count = groups)
    case("conv_general_dilated",
         lambda w, g, f=_f, xs=_x: jax.linear_transpose(lambda y: f(y, w), jnp.zeros(xs))(g)[0],
         f32(*_w), f32(*_out))
    case("conv_general_dilated",
         lambda x, g, f=_f, ws=_w: jax.linear_transpose(lambda v: f(x, v), jnp.zeros(ws))(g)[0],
         f32(*_x), f32(*_out))

# -- linear algebra (jax.lax.linalg, jnp.linalg) -------------------------------------------------
_LA = lax.linalg
case("cholesky", lambda x: _LA.cholesky(x, symmetrize_input=False), f32(7, 3, 3, dom="spd"))
case("cholesky", lambda x: _LA.cholesky(x, symmetrize_input=False), f32(8, 3, 3, dom="spd"))
case("cholesky", lambda x: _LA.cholesky(x, symmetrize_input=False), f32(4, 4, dom="spd"))
case("eigh", lambda x: _LA.eigh(x, symmetrize_input=False), f32(7, 3, 3, dom="spd"))
case("eigh", lambda x: _LA.eigh(x, symmetrize_input=False), f32(4, 4, dom="spd"))
case("svd", _LA.svd, f32(7, 3, 4))
case("svd", lambda x: _LA.svd(x, compute_uv=False), f32(3, 2, 4, 4))
case("qr", _LA.qr, f32(7, 4, 3))
case("qr", lambda x: _LA.qr(x, full_matrices=True), f32(8, 3, 3))
case("lu", _LA.lu, f32(7, 3, 3))
case("lu", _LA.lu, f32(4, 4))
# -- ragged_dot_general (lax.ragged_dot: a mixture of experts' grouped matmul) ----------------
_RD_ROWS_T = lax.RaggedDotDimensionNumbers(((([1], [2])), ([], [])), [0], [0])  # x @ w[g].T
_RD_CONTRACT = lax.RaggedDotDimensionNumbers(((([0], [0])), ([], [])), [0], [])  # -> [g, k, n]
case("ragged_dot_general", lax.ragged_dot, f32(8, 4), f32(4, 4, 3), i32(4, dom="sizes:8"))
case("ragged_dot_general", lax.ragged_dot, f32(7, 5), f32(5, 5, 3), i32(5, dom="sizes:7"))
case("ragged_dot_general", lax.ragged_dot, f32(3, 5), f32(3, 5, 2), i32(3, dom="sizes:3"))
case("ragged_dot_general", lambda x, w, g: lax.ragged_dot_general(x, w, g, _RD_ROWS_T),
     f32(7, 5), f32(5, 3, 5), i32(5, dom="sizes:7"))
case("ragged_dot_general", lambda x, y, g: lax.ragged_dot_general(x, y, g, _RD_CONTRACT),
     f32(8, 4), f32(8, 3), i32(4, dom="sizes:8"))
case("ragged_dot_general", lambda x, y, g: lax.ragged_dot_general(x, y, g, _RD_CONTRACT),
     f32(7, 5), f32(7, 3), i32(5, dom="sizes:7"))
case("ragged_dot_general", lambda x, y, g: lax.ragged_dot_general(x, y, g, _RD_CONTRACT),
     f32(3, 2), f32(3, 5), i32(3, dom="sizes:3"))

case("lu_pivots_to_permutation", lambda p: _LA.lu_pivots_to_permutation(p, 4), i32(7, 3, dom="idx:3"))
case("lu_pivots_to_permutation", lambda p: _LA.lu_pivots_to_permutation(p, 3), i32(3, dom="idx:3"))
case("eig", lambda x: _LA.eig(x, compute_left_eigenvectors=False), f32(7, 3, 3))
case("eig", lambda x: _LA.eig(x, compute_left_eigenvectors=False, compute_right_eigenvectors=False),
     f32(3, 3))
case("hessenberg", _LA.hessenberg, f32(7, 3, 3))
case("schur", _LA.schur, f32(3, 3, 3, dom="spd"))
case("tridiagonal", _LA.tridiagonal, f32(7, 3, 3, dom="spd"))
case("householder_product", _LA.householder_product, f32(7, 4, 3), f32(7, 3))
case("ormqr", lambda a, t, c: _LA.ormqr(a, t, c, left=True, transpose=False), f32(7, 4, 3), f32(7, 3), f32(7, 4, 2))
case("geqrf", lambda a: __import__("jax._src.lax.linalg", fromlist=["x"]).geqrf_p.bind(a), f32(7, 4, 3))
case("geqp3", lambda a, p: __import__("jax._src.lax.linalg", fromlist=["x"]).geqp3(a, p), f32(7, 4, 3),
     i32(7, 3, dom="idx:1"))
case("symmetric_product", _LA.symmetric_product, f32(7, 3, 4), f32(7, 3, 3))
case("cholesky_update", _LA.cholesky_update, f32(3, 3, dom="spd"), f32(3))
for _left, _lower, _a, _b in ((True, True, (7, 3, 3), (7, 3, 5)), (False, False, (5, 5), (7, 5)),
                              (True, False, (4, 4), (4, 8)), (False, True, (3, 2, 2), (3, 6, 2))):
    case("triangular_solve", lambda a, b, l=_left, lo=_lower: _LA.triangular_solve(a, b, left_side=l, lower=lo),
         f32(*_a, dom="wellcond"), f32(*_b))
case("tridiagonal_solve", _LA.tridiagonal_solve, f32(7, 4, dom="unit"), f32(7, 4, dom="gt1"),
     f32(7, 4, dom="unit"), f32(7, 4, 3))
case("tridiagonal_solve", _LA.tridiagonal_solve, f32(5, dom="unit"), f32(5, dom="gt1"),
     f32(5, dom="unit"), f32(5, 7))
# fmt: on


# -------------------------------------------------------------------------------------------
# tracing a case down to one equation
# -------------------------------------------------------------------------------------------


def _abstract(a: Arg):
    if a.dtype == "key":
        return jax.ShapeDtypeStruct(a.shape, jax.random.key(0).dtype)
    return jax.ShapeDtypeStruct(a.shape, jnp.dtype(a.dtype))


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def _find(jaxpr, prim, top_invars):
    for e in jaxpr.eqns:
        if e.primitive.name == prim:
            return e, top_invars
        for sub in _sub_jaxprs(e):
            # operands of a nested jaxpr are not the top-level arguments
            found = _find(sub, prim, [])
            if found is not None:
                return found
    return None


@dataclasses.dataclass
class Traced:
    closed: jcore.ClosedJaxpr  # one equation, every operand an input
    eqn: jcore.JaxprEqn
    doms: list[str | None]  # how to draw each operand
    consts: dict[int, np.ndarray]  # operands that were literals: their value

    @functools.cached_property
    def logical(self) -> list[np.ndarray]:
        """One logical value per operand, drawn once (seeded by the equation's text)."""
        rng = np.random.default_rng(zlib.crc32(str(self.eqn).encode()))
        return [
            _draw(rng, v.aval, self.doms[k], self.consts.get(k))
            for k, v in enumerate(self.eqn.invars)
        ]

    @property
    def reference(self) -> list[np.ndarray]:
        """The single-device result (as numpy; PRNG keys as their key data)."""
        if self._reference is None:
            _compute_references([self])
        return self._reference

    _reference: list | None = None

    def _reference_fn(self):
        def run(*xs):
            args = [
                jax.random.wrap_key_data(x) if _is_key(v.aval) else x
                for v, x in zip(self.eqn.invars, xs)
            ]
            outs = jcore.jaxpr_as_fun(self.closed)(*args)
            return [
                jax.random.key_data(o) if _is_key(v.aval) else o
                for v, o in zip(self.eqn.outvars, outs)
            ]

        return run


def _compute_references(traced: Sequence[Traced], chunk: int = 120):
    """Single-device results of many equations, many per compile (one device)."""
    todo = [t for t in traced if t._reference is None]
    for start in range(0, len(todo), chunk):
        part = todo[start : start + chunk]
        fns = [t._reference_fn() for t in part]

        def run_all(*flat, fns=fns, part=part):
            outs, pos = [], 0
            for fn, t in zip(fns, part):
                n = len(t.eqn.invars)
                outs.append(fn(*flat[pos : pos + n]))
                pos += n
            return outs

        dev = jax.devices()[0]
        args = [jax.device_put(x, dev) for t in part for x in t.logical]
        compiled = jax.jit(run_all).lower(*args).compile(compiler_options=_FAST_COMPILE)
        for t, outs in zip(part, compiled(*args)):
            t._reference = [np.asarray(o) for o in outs]


def _extract(c: Case) -> Traced:
    closed = jax.make_jaxpr(c.fn)(*[_abstract(a) for a in c.args])
    found = _find(closed.jaxpr, c.prim, list(closed.jaxpr.invars))
    assert found is not None, (
        f"{c.label}: traced to {[e.primitive.name for e in closed.jaxpr.eqns]}, not {c.prim}"
    )
    eqn, top = found
    invars, doms, consts = [], [], {}
    for k, v in enumerate(eqn.invars):
        nv = jcore.Var(v.aval)
        invars.append(nv)
        dom = None
        if isinstance(v, jcore.Literal):
            consts[k] = np.asarray(v.val)
        elif v in top:
            dom = c.args[top.index(v)].dom
        doms.append(c.dom.get(k, dom))
    outvars = [jcore.Var(v.aval) for v in eqn.outvars]
    new = eqn.replace(invars=invars, outvars=outvars)
    dbg = closed.jaxpr.debug_info._replace(arg_names=None, result_paths=None)
    jaxpr = jcore.Jaxpr([], invars, outvars, [new], debug_info=dbg)
    return Traced(jcore.ClosedJaxpr(jaxpr, []), new, doms, consts)


# -------------------------------------------------------------------------------------------
# an independent NumPy geometry of layouts
# -------------------------------------------------------------------------------------------


def _block_index(shape, hierarchy, nd, coord):
    """Index arrays (one per dim) of the block device ``coord`` holds; axes cut outer first."""
    idx = [np.arange(n) for n in shape]
    for a, s in enumerate(nd):
        if s.is_split:
            idx[s.dim] = np.array_split(idx[s.dim], hierarchy[a])[coord[a]]
    return idx


def _addend_key(nd, coord):
    return tuple(coord[a] for a, s in enumerate(nd) if s.is_partial)


def _partial_kind(nd):
    kinds = {s.reduce for s in nd if s.is_partial}
    return kinds.pop() if kinds else None


def _is_key(aval):
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def _np_dtype(aval):
    return np.dtype(np.uint32) if _is_key(aval) else np.dtype(aval.dtype)


def _data_shape(aval):
    return tuple(aval.shape) + ((2,) if _is_key(aval) else ())


def _draw(rng: np.random.Generator, aval, dom: str | None, const=None) -> np.ndarray:
    shape, dt = _data_shape(aval), _np_dtype(aval)
    if const is not None:
        return np.broadcast_to(np.asarray(const, dt), shape).copy()
    if dom and dom.startswith("idx:"):
        return rng.integers(0, int(dom[4:]), shape).astype(dt)
    if dom and dom.startswith("oob:"):  # some indices below 0 or past the end
        n = int(dom[4:])
        return rng.integers(-3, n + 3, shape).astype(dt)
    if dom and dom.startswith("sizes:"):  # group sizes of lax.ragged_dot: summing to m or m - 1
        m = int(dom[6:])
        return rng.multinomial(m - int(rng.integers(0, 2)), np.ones(shape[0]) / shape[0]).astype(dt)
    if dom and dom.startswith("perm:"):
        n = int(dom[5:])
        return rng.permutation(n)[: math.prod(shape)].reshape(shape).astype(dt)
    if dt == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(dt, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if np.issubdtype(dt, np.unsignedinteger):
        hi = 8 if dom == "shift" else np.iinfo(dt).max
        return rng.integers(0, hi, shape, dtype=np.uint64).astype(dt)
    if np.issubdtype(dt, np.integer):
        if dom == "shift":
            return rng.integers(0, 8, shape).astype(dt)
        if dom == "nonzero":
            return (rng.integers(1, 6, shape) * rng.choice([-1, 1], shape)).astype(dt)
        if dom == "wide":
            return rng.integers(-100, 100, shape).astype(dt)
        return rng.integers(-7, 8, shape).astype(dt)
    if dom in ("spd", "wellcond"):  # square matrices in the last two dims: a a^T + n I, a + n I
        n = shape[-1]
        a = rng.standard_normal(shape)
        a = a @ np.swapaxes(a, -1, -2) if dom == "spd" else a
        return (a + n * np.eye(n)).astype(dt)
    # floats
    if dom == "pos":
        x = rng.uniform(0.5, 2.0, shape)
    elif dom == "neg":
        x = -rng.uniform(0.5, 2.0, shape)
    elif dom == "unit":
        x = rng.uniform(-0.9, 0.9, shape)
    elif dom == "gt1":
        x = rng.uniform(1.1, 3.0, shape)
    elif dom == "wide":
        x = rng.uniform(-40.0, 40.0, shape)
    elif dom == "coarse":  # few distinct values, so comparisons see ties
        x = rng.integers(-2, 3, shape).astype(np.float64)
    elif dom == "order":
        x = rng.integers(0, 3, shape).astype(np.float64)
    elif dom == "nonzero":
        x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1, 1], shape)
    elif dom == "special":
        x = rng.standard_normal(shape)
        x.flat[::3] = np.inf
        x.flat[1::5] = np.nan
    else:
        x = rng.standard_normal(shape)
    return x.astype(dt)


def _inexact(dt) -> bool:
    return bool(jnp.issubdtype(dt, jnp.inexact))


def _garbage(dt: np.dtype):
    if _inexact(dt):
        return np.nan
    if dt == np.bool_:
        return True
    return np.iinfo(dt).max - 3


def _reduce(kind, addends: list[np.ndarray]) -> np.ndarray:
    if kind is None:
        return addends[0]
    st = np.stack(addends)
    if st.dtype == np.bool_:
        return {"sum": np.any, "max": np.any, "min": np.all}[kind](st, axis=0)
    return {"sum": np.sum, "max": np.max, "min": np.min}[kind](st, axis=0).astype(st.dtype)


def _addends(kind, value: np.ndarray, n: int, rng) -> list[np.ndarray]:
    """``n`` random, non-trivial addends whose sum (max, min) is ``value``."""
    if n == 1:
        return [value]
    dt = value.dtype
    if dt == np.bool_:  # a bool "sum" is an or (max), its min an and
        if kind == "min":
            return [value | (rng.random(value.shape) < 0.5) for _ in range(n - 1)] + [value]
        return [value & (rng.random(value.shape) < 0.5) for _ in range(n - 1)] + [value]
    if kind == "sum":
        if _inexact(dt):
            scale = (1 + 1j) if np.iscomplexobj(value) else 1.0
            rest = [(rng.standard_normal(value.shape) * scale).astype(dt) for _ in range(n - 1)]
        else:
            rest = [rng.integers(-5, 6, value.shape).astype(dt) for _ in range(n - 1)]
        first = (value - sum(rest)).astype(dt) if rest else value
        return [first] + rest
    # max / min: every addend at or below (above) the value, one of them equal to it per element
    sign = -1 if kind == "max" else 1
    owner = rng.integers(0, n, value.shape)
    out = []
    for i in range(n):
        noise = rng.integers(1, 4, value.shape).astype(dt)
        a = np.where(owner == i, value, value + sign * noise).astype(dt)
        out.append(a)
    return out


def _coords(hierarchy):
    return list(np.ndindex(*hierarchy))


def _make_input(placement, lay, aval, logical, rng):
    """The physical global array of one operand: random addends, garbage padding."""
    nd, hier = lay.nd_sbp, placement.hierarchy
    shape, dt = _data_shape(aval), _np_dtype(aval)
    keys = sorted({_addend_key(nd, c) for c in _coords(hier)})
    addends = dict(zip(keys, _addends(_partial_kind(nd), logical, len(keys), rng)))
    local_shape = tuple(lay.local_shape) + ((2,) if _is_key(aval) else ())
    phys_shape = tuple(lay.physical_shape) + ((2,) if _is_key(aval) else ())
    spec = tuple(lay.spec) + ((None,) if _is_key(aval) else ())
    sharding = jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec(*spec))
    where = sharding.devices_indices_map(phys_shape)  # JAX's own map: device -> its slice
    phys = np.empty(phys_shape, dtype=dt)
    for c in _coords(hier):
        idx = _block_index(shape[: len(aval.shape)], hier, nd, c)
        if _is_key(aval):
            idx = idx + [np.arange(2)]
        blk = addends[_addend_key(nd, c)][np.ix_(*idx)] if idx else addends[_addend_key(nd, c)]
        buf = np.full(local_shape, _garbage(dt), dtype=dt)
        buf[tuple(slice(0, len(i)) for i in idx)] = blk
        phys[where[placement.devices[c]]] = buf[None] if lay.partial_axes else buf
    arr = jax.device_put(phys, sharding)
    if _is_key(aval):
        arr = jax.jit(jax.random.wrap_key_data, out_shardings=lay.sharding)(arr)
    return arr


def _read_output(placement, lay, aval, arr, close) -> tuple[np.ndarray | None, str | None]:
    """The logical value the devices hold under ``lay``, or an error naming the first bad device."""
    if _is_key(aval):
        arr = jax.random.key_data(arr)
    nd, hier = lay.nd_sbp, placement.hierarchy
    shape = _data_shape(aval)
    coord_of = {d.id: c for c, d in np.ndenumerate(placement.devices)}
    sums: dict = {}
    seen: dict = {}
    for sh in arr.addressable_shards:
        c = coord_of[sh.device.id]
        data = np.asarray(sh.data)
        if lay.partial_axes:
            data = data[0]
        idx = _block_index(shape[: len(aval.shape)], hier, nd, c)
        if _is_key(aval):
            idx = idx + [np.arange(2)]
        blk = data[tuple(slice(0, len(i)) for i in idx)]
        k = _addend_key(nd, c)
        if k not in sums:
            sums[k] = np.zeros(shape, data.dtype)
            seen[k] = np.zeros(shape, bool)
        region = np.ix_(*idx) if idx else ()
        prev = seen[k][region]
        if prev.any() and not close(sums[k][region], blk):
            return (
                None,
                f"device {c} disagrees with another device holding the same block (a B axis)",
            )
        sums[k][region] = blk
        seen[k][region] = True
    for k, s in seen.items():
        if not s.all():
            return None, f"addend {k}: some elements are held by no device"
    keys = sorted(sums)
    return _reduce(_partial_kind(nd), [sums[k] for k in keys]), None


def _closeness(aval, eqn):
    """allclose for floats (loose when any operand is a 16-bit float: the addends of its partial
    inputs are rounded), exact for integers, bools and key data."""
    dt = _np_dtype(aval)
    if _inexact(dt):
        narrow = any(
            _inexact(_np_dtype(v.aval)) and _np_dtype(v.aval).itemsize <= 2
            for v in list(eqn.invars) + [v for v in eqn.outvars]
        )
        tol = 2e-2 if narrow else 1e-4
        return lambda a, b: (
            a.shape == b.shape
            and np.allclose(
                np.asarray(a, np.complex128 if np.iscomplexobj(a) else np.float64),
                np.asarray(b, np.complex128 if np.iscomplexobj(b) else np.float64),
                rtol=tol,
                atol=tol,
                equal_nan=True,
            )
        )
    return lambda a, b: a.shape == b.shape and np.array_equal(a, b)


# -------------------------------------------------------------------------------------------
# running signatures, many per compile
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Item:
    case: Case
    sig: tuple
    prog: object = None
    phys: list = None


def _sig_str(sig):
    ins, outs = sig
    return (
        f"({', '.join(_sbp.nd_str(x) for x in ins)}) -> ({', '.join(_sbp.nd_str(x) for x in outs)})"
    )


def _prepare(placement, item: Item, rng):
    t = item.case.traced
    ins, outs = item.sig
    item.prog = forced_program(placement, t.closed, ins, outs)
    item.phys = [
        _make_input(placement, lay, v.aval, x, rng)
        for lay, v, x in zip(item.prog.in_layouts, t.eqn.invars, t.logical)
    ]


def _run_batch(placement, items: Sequence[Item]):
    """Run every item's program in one jitted shard_map; returns the outputs per item."""
    in_specs, out_specs, counts = [], [], []
    for it in items:
        in_specs += [lay.spec for lay in it.prog.in_layouts]
        out_specs += [lay.spec for lay in it.prog.out_layouts]
        counts.append((len(it.prog.in_layouts), len(it.prog.out_layouts)))

    def body(*xs):
        outs, pos = [], 0
        for it, (ni, _) in zip(items, counts):
            loc = [
                x[0] if lay.partial_axes else x
                for x, lay in zip(xs[pos : pos + ni], it.prog.in_layouts)
            ]
            pos += ni
            res = run_program(it.prog, loc)
            outs += [o[None] if lay.partial_axes else o for o, lay in zip(res, it.prog.out_layouts)]
        return tuple(outs)

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=placement.mesh,
            in_specs=tuple(in_specs),
            out_specs=tuple(out_specs),
            check_vma=False,
        )
    )
    args = [p for it in items for p in it.phys]
    flat = fn.lower(*args).compile(compiler_options=_FAST_COMPILE)(*args)
    res, pos = [], 0
    for _, no in counts:
        res.append(list(flat[pos : pos + no]))
        pos += no
    return res


def _check(placement, item: Item, outs) -> str | None:
    t = item.case.traced
    for i, (lay, v, out, want) in enumerate(
        zip(item.prog.out_layouts, t.eqn.outvars, outs, t.reference)
    ):
        close = _closeness(v.aval, t.eqn)
        got, err = _read_output(placement, lay, v.aval, out, close)
        if err:
            return f"output {i}: {err}"
        if not close(got, want):
            bad = (
                np.argwhere(~np.isclose(got, want, equal_nan=True))
                if got.shape == want.shape and got.dtype.kind in "fc"
                else None
            )
            where = f" first bad index {tuple(bad[0])}" if bad is not None and len(bad) else ""
            return f"output {i}: wrong value{where}\n got  {np.array2string(got, threshold=40)}\n want {np.array2string(want, threshold=40)}"
    return None


def _validate(placement, items: list[Item]) -> dict[int, str]:
    """Errors by item position; batches that fail to build are bisected down to one signature."""
    errors: dict[int, str] = {}

    def go(idxs):
        try:
            outs = _run_batch(placement, [items[i] for i in idxs])
        except Exception as e:  # noqa: BLE001 - attribute the failure to one signature
            if len(idxs) == 1:
                msg = "".join(traceback.format_exception_only(type(e), e)).strip()
                msg = msg.split("\n--------------------")[0]
                errors[idxs[0]] = f"failed to run: {msg[:800]}"
                return
            half = len(idxs) // 2
            go(idxs[:half])
            go(idxs[half:])
            return
        for i, o in zip(idxs, outs):
            err = _check(placement, items[i], o)
            if err:
                errors[i] = err

    go(list(range(len(items))))
    return errors


# -------------------------------------------------------------------------------------------
# the sweep: one lazily computed result per placement, read by one test per primitive
# -------------------------------------------------------------------------------------------

PLACEMENTS = {"4": [0, 1, 2, 3], "2x2": [[0, 1], [2, 3]]}
FULL_PLACEMENTS = {
    "8": list(range(8)),
    "2x4": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "2x2x2": [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
}
SAMPLE_OFF_DIAGONAL = 3  # default run, 2-d placements: mixed signatures sampled per case
SAMPLE_3D = 12  # signatures per case on (2, 2, 2), where the product explodes
BATCH = 160  # programs per compile


def _sample(sigs, ndim: int, label: str, everything: bool):
    """Every signature on 1-d placements. On 2-d ones by default: every signature that is the same
    on all axes (hierarchical splits, partials over both axes) plus a seeded sample of mixed ones."""
    if ndim == 1 or (everything and ndim == 2):
        return sigs
    rnd = random.Random(zlib.crc32(label.encode()))
    if ndim >= 3:
        return sigs if len(sigs) <= SAMPLE_3D else rnd.sample(sigs, SAMPLE_3D)
    diag = [s for s in sigs if all(len(set(nd)) == 1 for nd in s[0] + s[1])]
    mixed = [s for s in sigs if s not in diag]
    return diag + (
        mixed if len(mixed) <= SAMPLE_OFF_DIAGONAL else rnd.sample(mixed, SAMPLE_OFF_DIAGONAL)
    )


def _worth_on_2d(c: Case) -> bool:
    """Default run on 2-d placements: the cases whose shapes split unevenly somewhere (stricter
    than the even ones, which (4,) covers); a primitive with no such case keeps all of its own."""

    def uneven(case):
        return any(n % 4 for a in case.args for n in a.shape) or not case.args

    return uneven(c) or not any(uneven(o) for o in CASES[c.prim])


@functools.cache
def _sweep(pname: str, prims: tuple[str, ...], everything: bool = FULL):
    """{primitive: (n signatures checked, [failure messages])} for some primitives on one placement."""
    ranks = {**PLACEMENTS, **FULL_PLACEMENTS}[pname]
    plc = jsbp.placement("cpu", ranks)
    rng = np.random.default_rng(0)
    items: list[Item] = []
    build_errors: dict[str, list[str]] = {}
    prims = tuple(p for p in prims if p in CASES and p in registered())
    _compute_references([c.traced for p in prims for c in CASES[p]])
    for prim in prims:
        for c in CASES[prim]:
            if plc.ndim > 1 and not everything and not _worth_on_2d(c):
                continue
            try:
                sigs = candidate_signatures(plc, c.traced.eqn)
            except Exception as e:  # noqa: BLE001
                build_errors.setdefault(prim, []).append(f"{c.label}: rule raised {e!r}")
                continue
            sigs = _sample(sigs, plc.ndim, c.label, everything)
            for s in sigs:
                it = Item(c, s)
                try:
                    _prepare(plc, it, rng)
                except Exception as e:  # noqa: BLE001
                    build_errors.setdefault(prim, []).append(f"{c.label} {_sig_str(s)}: {e!r}")
                    continue
                items.append(it)
    errors: dict[int, str] = {}
    for start in range(0, len(items), BATCH):
        chunk = list(range(start, min(start + BATCH, len(items))))
        sub = _validate(plc, [items[i] for i in chunk])
        errors.update({chunk[k]: v for k, v in sub.items()})
    out: dict[str, tuple[int, list[str]]] = {}
    for i, it in enumerate(items):
        n, errs = out.get(it.case.prim, (0, []))
        if i in errors:
            errs = errs + [f"{it.case.label} on {plc}: {_sig_str(it.sig)}\n  {errors[i]}"]
        out[it.case.prim] = (n + 1, errs)
    for prim, errs in build_errors.items():
        n, old = out.get(prim, (0, []))
        out[prim] = (n, old + errs)
    return out


VALIDATED = sorted(p for p in registered() if p not in {*HANDLED_BY_COMPILER, *NOT_IN_THIS_JAX})


def test_every_registered_primitive_has_a_validator():
    missing = [p for p in VALIDATED if p not in CASES]
    assert not missing, (
        f"SBP rules without a validator entry in tests/test_rules.py CASES: {missing}. "
        "Add a case that traces the primitive (see CONTRIBUTING.md)."
    )


def test_every_rule_has_a_docs_line():
    """docs/rules.md lists every supported primitive (a new rule comes with its line)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "rules.md").read_text()
    named = set(re.findall(r"`([a-z_0-9-]+)`", text))
    missing = sorted(p for p in list(registered()) + list(HANDLED_BY_COMPILER) if p not in named)
    assert not missing, f"primitives with a rule but no line in docs/rules.md: {missing}"


def test_compiler_handled_list_is_the_compilers():
    """control.HANDLED_BY_COMPILER (what docs and the registry report) is what the planner handles
    itself: calls it inlines, layout requests, loops, branches and linear solves."""
    from jsbp import _problem

    control = {"scan", "while", "cond", "custom_linear_solve"}
    assert set(HANDLED_BY_COMPILER) == set(_problem.CALLS | _problem.REQUESTS | control)
    assert not set(HANDLED_BY_COMPILER) & set(registered())


def test_every_case_traces_to_its_primitive():
    for prim, cases in CASES.items():
        for c in cases:
            assert c.traced.eqn.primitive.name == prim


# The list, by the primitive names JAX 0.10.2 really traces to.
# fmt: off
REQUIRED = {
    "dot_general": "dot_general", "add": "add", "add_any": "add_any", "sub": "sub", "mul": "mul",
    "div": "div", "neg": "neg", "integer_pow": "integer_pow", "pow": "pow", "sqrt": "sqrt",
    "rsqrt": "rsqrt", "exp": "exp", "log": "log", "tanh": "tanh", "max": "max", "min": "min",
    "abs": "abs", "sign": "sign", "square": "square", "eq": "eq", "lt": "lt", "ge": "ge",
    "is_finite": "is_finite", "select_n": "select_n", "convert_element_type": "convert_element_type",
    "stop_gradient": "stop_gradient", "broadcast_in_dim": "broadcast_in_dim", "reshape": "reshape",
    "transpose": "transpose", "reduce_sum": "reduce_sum", "reduce_max": "reduce_max",
    "gather": "gather", "scatter-add": "scatter-add", "conv_general_dilated": "conv_general_dilated",
    "reduce_min": "reduce_min", "reduce_prod": "reduce_prod", "argmax": "argmax", "argmin": "argmin",
    "cumsum": "cumsum", "concatenate": "concatenate", "pad": "pad", "slice": "slice",
    "dynamic_slice": "dynamic_slice", "dynamic_update_slice": "dynamic_update_slice", "iota": "iota",
    "squeeze": "squeeze", "rev": "rev", "clamp": "clamp", "erf": "erf", "logistic": "logistic",
    "log1p": "log1p", "expm1": "expm1", "rem": "rem", "sort": "sort",
    # jnp.expand_dims has no primitive of its own: it traces to broadcast_in_dim (or reshape)
    "expand_dims": "broadcast_in_dim",
    # the PRNG: new-style keys, old-style uint32 keys, the raw hash, and the bits -> float step
    "random_seed": "random_seed", "random_bits": "random_bits", "random_split": "random_split",
    "random_fold_in": "random_fold_in", "random_wrap": "random_wrap",
    "random_unwrap": "random_unwrap", "threefry2x32": "threefry2x32",
    "bitcast_convert_type": "bitcast_convert_type", "shift_right_logical": "shift_right_logical",
    "or": "or",
    # higher-order ones are the compiler's
    "jit": "jit", "custom_jvp_call": "custom_jvp_call", "custom_vjp_call": "custom_vjp_call",
    "remat": "checkpoint", "scan": "scan", "while": "while", "cond": "cond",
}
# fmt: on


def test_required_primitives_have_rules():
    have = set(registered()) | set(HANDLED_BY_COMPILER)
    missing = sorted(k for k, v in REQUIRED.items() if v not in have)
    assert not missing, f"primitives from the issue's list without an SBP rule: {missing}"


@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda x: jnp.expand_dims(x, 1), "broadcast_in_dim"),
        (jnp.square, "square"),
        (lambda x: jnp.clip(x, 0.0, 1.0), "max"),
        (lambda x: jax.nn.sigmoid(x), "logistic"),
        (lambda x: jax.random.normal(jax.random.key(0), x.shape), "random_bits"),
        (lambda x: jax.random.normal(jax.random.key(0), x.shape), "bitcast_convert_type"),
        (lambda x: jax.random.uniform(jax.random.PRNGKey(0), x.shape), "random_wrap"),
    ],
)
def test_required_names_are_the_traced_ones(fn, want):
    """The names in REQUIRED are what JAX really emits (so the list cannot silently go stale)."""
    closed = jax.make_jaxpr(fn)(jnp.ones((3, 4)))
    names = []

    def walk(j):
        for e in j.eqns:
            names.append(e.primitive.name)
            for s in _sub_jaxprs(e):
                walk(s)

    walk(closed.jaxpr)
    assert want in names
    assert want in registered()


def _groups(n_groups: int = 10) -> list[tuple[str, ...]]:
    """The validated primitives in groups of about equal work (one test, a few compiles each):
    tests, not primitives, are what pytest-xdist spreads over workers."""
    prims = [p for p in VALIDATED if p in CASES]
    total = sum(len(CASES[p]) for p in prims)
    groups, cur, acc = [], [], 0
    for p in prims:
        cur.append(p)
        acc += len(CASES[p])
        if acc >= total / n_groups:
            groups.append(tuple(cur))
            cur, acc = [], 0
    if cur and groups and acc < total / n_groups / 2:
        groups[-1] += tuple(cur)
    elif cur:
        groups.append(tuple(cur))
    return groups


GROUPS = _groups()


def _assert_group_valid(pname, group):
    results = _sweep(pname, group)
    errs = []
    for prim in group:
        n, e = results.get(prim, (0, []))
        if e:
            errs.append(f"{len(e)} wrong signature(s) of '{prim}':\n" + "\n".join(e[:6]))
        elif n == 0:
            errs.append(f"no signature of '{prim}' was checked on placement {pname}")
    assert not errs, "\n".join(errs)


@pytest.mark.parametrize("pname", list(PLACEMENTS))
@pytest.mark.parametrize("group", GROUPS, ids=[f"{g[0]}..{g[-1]}" for g in GROUPS])
def test_rules(group, pname):
    """Every signature of every rule in ``group`` gives the single-device value on ``pname``."""
    _assert_group_valid(pname, group)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="JSBP_FULL=1 runs the larger placements")
@pytest.mark.parametrize("pname", list(FULL_PLACEMENTS))
@pytest.mark.parametrize("group", GROUPS, ids=[f"{g[0]}..{g[-1]}" for g in GROUPS])
def test_rules_full(group, pname):
    _assert_group_valid(pname, group)


def test_validator_catches_a_wrong_rule(monkeypatch):
    """The sweep is not hollow: a rule that keeps P through exp, or forgets to mask padding, fails."""
    from jsbp.rules import _registry

    good_exp = _registry._RULES["exp"]

    def bad_exp(ctx):
        yield from good_exp.signatures(ctx)
        yield (jsbp.sbp.partial_sum,), (jsbp.sbp.partial_sum,)

    good_log = _registry._RULES["log"]

    def bad_log(ctx):  # log is not defined below 0: a partial max's pieces may be negative
        yield from good_log.signatures(ctx)
        yield (jsbp.sbp.partial_max,), (jsbp.sbp.partial_max,)

    good_sum = _registry._RULES["reduce_sum"]
    monkeypatch.setitem(_registry._RULES, "log", dataclasses.replace(good_log, signatures=bad_log))
    monkeypatch.setitem(_registry._RULES, "exp", dataclasses.replace(good_exp, signatures=bad_exp))
    monkeypatch.setitem(_registry._RULES, "reduce_sum", dataclasses.replace(good_sum, local=None))
    plc = jsbp.placement("cpu", [0, 1, 2, 3])
    rng = np.random.default_rng(1)
    items = []
    for c in (CASES["exp"][1], CASES["log"][1], CASES["reduce_sum"][3]):  # uneven shapes
        for s in candidate_signatures(plc, c.traced.eqn):
            it = Item(c, s)
            _prepare(plc, it, rng)
            items.append(it)
    errors = _validate(plc, items)
    bad = {(items[i].case.prim, _sig_str(items[i].sig)) for i in errors}
    assert ("exp", "((P)) -> ((P))") in bad
    assert ("log", "((Pmax)) -> ((Pmax))") in bad
    assert ("reduce_sum", "((S(0))) -> ((P))") in bad
    good = [it for i, it in enumerate(items) if i not in errors]
    assert any(it.case.prim == "exp" for it in good) and any(
        it.case.prim == "reduce_sum" for it in good
    )


def _check_now(prim: str, pname: str = "4") -> tuple[int, dict[str, str]]:
    """Validate every signature of ``prim``'s cases right now (uncached): (count, errors)."""
    plc = jsbp.placement("cpu", PLACEMENTS[pname])
    rng = np.random.default_rng(2)
    items = []
    for c in CASES[prim]:
        for sig in candidate_signatures(plc, c.traced.eqn):
            it = Item(c, sig)
            _prepare(plc, it, rng)
            items.append(it)
    errors = _validate(plc, items)
    return len(items), {
        f"{items[i].case.label}: {_sig_str(items[i].sig)}": e for i, e in errors.items()
    }


def test_contributing_worked_example(monkeypatch):
    """CONTRIBUTING.md's worked example runs as written, and its validator entry catches the bug
    the guide warns about (a forgotten padding mask)."""
    import pathlib
    import re

    from jsbp.rules import _registry

    monkeypatch.setattr(_registry, "_RULES", dict(_registry._RULES))  # the example registers a rule
    monkeypatch.setattr(sys.modules[__name__], "CASES", dict(CASES))
    text = (pathlib.Path(__file__).resolve().parents[1] / "CONTRIBUTING.md").read_text()
    rule_block, case_block = re.findall(r"```python\n(.*?)```", text, re.S)[:2]
    ns: dict = {}
    exec(compile(rule_block, "CONTRIBUTING.md", "exec"), ns)  # asserts P, no collectives, the value
    exec(
        compile(case_block, "CONTRIBUTING.md", "exec"),
        {"case": case, "f32": f32, "rowsum_p": ns["rowsum_p"]},
    )
    n, errors = _check_now("rowsum")
    assert n >= 9 and not errors, errors
    rule = _registry._RULES["rowsum"]
    monkeypatch.setitem(_registry._RULES, "rowsum", dataclasses.replace(rule, local=None))
    _, errors = _check_now("rowsum")
    assert any("(S(1))) -> ((P))" in k and "7, 5" in k for k in errors), errors


# primitives of jax.lax's own modules that run replicated on purpose (docs/rules.md, "Primitives
# without a rule"): tokens, stateful or ragged ops, staging markers, and two special-function
# internals that only their own gradients emit
_LAX_WITHOUT_RULE = {
    "after_all",
    "composite",
    "create_token",
    "dce_sink",
    "empty",
    "from_edtype",
    "mulhi",
    "reduce",
    "rng_uniform",
    "stage",
    "tie",
    "to_edtype",
    "igamma_grad_a",
    "regularized_incomplete_beta",
}


def test_every_lax_primitive_has_a_rule_or_is_listed():
    """Each primitive that ``jax.lax`` defines (its core, special-function and slicing modules)
    has a rule, a compiler handler, or is listed above. A newer JAX adds primitives (0.11:
    ``one_minus_square``, which ``jax.grad`` of ``tanh`` emits, and ``log2``): run on it, this
    names them, instead of models silently running them replicated."""
    from jax._src import core as jcore_src
    from jax._src.lax import lax as lax_core
    from jax._src.lax import slicing, special

    known = set(registered()) | set(HANDLED_BY_COMPILER) | _LAX_WITHOUT_RULE
    defined = {
        v.name
        for m in (lax_core, special, slicing)
        for v in vars(m).values()
        if isinstance(v, jcore_src.Primitive)
    }
    assert len(defined) > 100  # the modules were read
    new = sorted(defined - known)
    assert not new, (
        f"jax {jax.__version__} defines primitives jsbp has no rule for: {new}. Register a rule "
        "(jsbp/rules/, CONTRIBUTING.md) or add them to _LAX_WITHOUT_RULE with a line in docs/rules.md."
    )
