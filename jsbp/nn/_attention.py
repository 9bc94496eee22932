"""Attention as two primitives the planner places: ``jsbp_attention`` (forward: the output and
the log-sum-exp of each query row) and ``jsbp_attention_bwd`` (the gradients of query, key and
value), tied by a ``jax.custom_vjp``.

Each has an SBP rule with, per placement axis, one way to run on each layout of its operands:

* ``B``: everything whole;
* batch: everything split along the batch dim;
* heads: query, key and value split along the heads dim (and the key/value heads, for grouped
  queries, when both divide evenly). From a sequence split, the planner reaches it by one
  all-to-all each way: DeepSpeed-Ulysses;
* gather: queries split along the sequence dim, key and value whole (the planner all-gathers
  them); the backward's key and value gradients come out partial sums;
* ring: query, key and value all split along the sequence dim; key/value blocks travel round
  the axis with collective-permutes and each device combines them by online softmax
  (``_kernels.ring_attention``). Only for self-attention lengths (T == S), on one axis.

The rules' ``LocalCost`` prices each: the attention FLOPs of the local blocks and, for the ring,
its collective-permutes, whose transfers overlap the block computations. Outside ``jsbp.jit`` the
primitives lower to the one-device kernels.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import batching, mlir

from .. import sbp as S
from .._layout import balanced, offsets
from ..rules import LocalCost, register_sbp_rule
from ..rules._common import mask_padding
from . import _kernels

PLANS = ("gather", "ring", "heads")

fwd_p = jcore.Primitive("jsbp_attention")
fwd_p.multiple_results = True
bwd_p = jcore.Primitive("jsbp_attention_bwd")
bwd_p.multiple_results = True


def _unpack(args, has_bias, has_mask):
    q, k, v, *rest = args
    bias = rest.pop(0) if has_bias else None
    mask = rest.pop(0) if has_mask else None
    return q, k, v, bias, mask, rest


def _fwd_impl(*args, scale, is_causal, plan, has_bias, has_mask):
    q, k, v, bias, mask, _ = _unpack(args, has_bias, has_mask)
    return list(_kernels.attention(q, k, v, bias, mask, scale=scale, is_causal=is_causal))


def _bwd_impl(*args, scale, is_causal, plan, has_bias, has_mask):
    q, k, v, bias, mask, (out, lse, dout) = _unpack(args, has_bias, has_mask)
    grads = _kernels.attention_bwd(
        q, k, v, bias, mask, out, lse, dout, scale=scale, is_causal=is_causal
    )
    return list(grads)


def _fwd_abstract(q, k, v, *_, **__):
    b, t, n, _ = q.shape
    return [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray((b, n, t), jnp.float32)]


def _bwd_abstract(q, k, v, *_, **__):
    return [jax.core.ShapedArray(x.shape, x.dtype) for x in (q, k, v)]


def _batched(impl):
    def rule(args, dims, **params):  # vmap: the one-device computation, vectorised
        axes = tuple(d if isinstance(d, int) else None for d in dims)
        outs = jax.vmap(functools.partial(impl, **params), in_axes=axes)(*args)
        return outs, [0] * len(outs)

    return rule


for _p, _impl, _abstract in ((fwd_p, _fwd_impl, _fwd_abstract), (bwd_p, _bwd_impl, _bwd_abstract)):
    _p.def_impl(_impl)
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=True))
    batching.primitive_batchers[_p] = _batched(_impl)


# -------------------------------------------------------------------------------------------
# differentiation
# -------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def attend(q, k, v, bias, mask, scale, is_causal, plan):
    """The attention output (the ``custom_vjp`` the public function calls)."""
    return _bind_fwd(q, k, v, bias, mask, scale, is_causal, plan)[0]


def _params(bias, mask, scale, is_causal, plan):
    return dict(
        scale=float(scale),
        is_causal=bool(is_causal),
        plan=plan,
        has_bias=bias is not None,
        has_mask=mask is not None,
    )


def _operands(q, k, v, bias, mask):
    return [x for x in (q, k, v, bias, mask) if x is not None]


def _bind_fwd(q, k, v, bias, mask, scale, is_causal, plan):
    return fwd_p.bind(
        *_operands(q, k, v, bias, mask), **_params(bias, mask, scale, is_causal, plan)
    )


def _attend_fwd(q, k, v, bias, mask, scale, is_causal, plan):
    # the array arguments arrive as ``jax.custom_derivatives.CustomVJPPrimal``s (symbolic zeros)
    learned_bias = bias is not None and bias.perturbed
    q, k, v, bias, mask = (None if x is None else x.value for x in (q, k, v, bias, mask))
    out, lse = _bind_fwd(q, k, v, bias, mask, scale, is_causal, plan)
    return out, ((q, k, v, bias, mask, out, lse), learned_bias)


def _attend_bwd(scale, is_causal, plan, res, dout):
    (q, k, v, bias, mask, out, lse), learned_bias = res
    if isinstance(dout, jax.custom_derivatives.SymbolicZero):
        return None, None, None, None, None
    if learned_bias:  # the bias is learned: differentiate the plain computation, bias included
        _, vjp = jax.vjp(
            lambda q, k, v, b: jax.nn.dot_product_attention(
                q, k, v, b, mask, scale=scale, is_causal=is_causal
            ),
            q,
            k,
            v,
            bias,
        )
        dq, dk, dv, dbias = vjp(dout)
        return dq, dk, dv, dbias, None
    dq, dk, dv = bwd_p.bind(
        *_operands(q, k, v, bias, mask),
        out,
        lse,
        dout,
        **_params(bias, mask, scale, is_causal, plan),
    )
    return dq, dk, dv, None, None


attend.defvjp(_attend_fwd, _attend_bwd, symbolic_zeros=True)


# -------------------------------------------------------------------------------------------
# SBP rules
# -------------------------------------------------------------------------------------------

B = S.broadcast


def _aux(x_shape, way):
    """The layout of a bias / mask (4-d, dims of 1 broadcast) under one way of running."""
    dim = {"batch": 0, "heads": 1, "gather": 2, "ring": 2}.get(way)
    return S.split(dim) if dim is not None and x_shape[dim] > 1 else B


def _axis_ways(ctx, bwd: bool):
    """{way: (input sbps, output sbps)} for one placement axis."""
    p = ctx.params
    shapes = ctx.in_shapes
    q_shape, k_shape = shapes[0], shapes[1]
    aux = shapes[3 : 3 + p["has_bias"] + p["has_mask"]]
    plan = p["plan"]
    ways = ["B", "batch", "heads", "gather", "ring"]
    if q_shape[1] != k_shape[1]:  # cross-attention lengths: no ring
        ways.remove("ring")
    if plan in ways:  # forced: that way on one axis at least (``_signatures``), B or batch else
        ways = ["B", "batch", plan]
    qkv = {
        "B": (B, B, B),
        "batch": (S.split(0),) * 3,
        "heads": (S.split(2),) * 3,
        "gather": (S.split(1), B, B),
        "ring": (S.split(1),) * 3,
    }
    row = {"B": B, "batch": S.split(0), "heads": S.split(1), "gather": S.split(2)}
    row["ring"] = row["gather"]
    out = {}
    for w in ways:
        ins = (*qkv[w], *(_aux(a, w) for a in aux))
        if not bwd:
            out[w] = ins, (qkv[w][0], row[w])
            continue
        ins = (*ins, qkv[w][0], row[w], qkv[w][0])  # out, lse, dout
        kv_grad = S.partial_sum if w == "gather" else qkv[w][1]
        out[w] = ins, (qkv[w][0], kv_grad, kv_grad)
    return out


def _signatures(bwd):
    def rule(ctx):
        q_shape, k_shape = ctx.in_shapes[0], ctx.in_shapes[1]
        per_axis = _axis_ways(ctx, bwd)

        def legal(combo):
            if sum(w in ("gather", "ring") for w in combo) > 1:
                return False  # the sequence is split on one axis at most
            heads = math.prod(n for w, n in zip(combo, ctx.hierarchy) if w == "heads")
            # grouped queries: each device's query heads need their own key/value heads
            grouped = q_shape[2] != k_shape[2]
            return heads == 1 or not grouped or not (q_shape[2] % heads or k_shape[2] % heads)

        combos = [
            c for c in itertools.product(list(per_axis), repeat=len(ctx.hierarchy)) if legal(c)
        ]
        forced = [c for c in combos if ctx.params["plan"] in c]
        for combo in forced or combos:  # a forced plan runs where it can
            sigs = [per_axis[w] for w in combo]
            n_in, n_out = len(sigs[0][0]), len(sigs[0][1])
            yield (
                tuple(tuple(s[0][i] for s in sigs) for i in range(n_in)),
                tuple(tuple(s[1][i] for s in sigs) for i in range(n_out)),
            )

    return rule


def _seq_axis(in_nd):
    """(axis, ring?) of the axis that splits the queries' sequence dim, or (None, False)."""
    q_nd, k_nd = in_nd[0], in_nd[1]
    for a, s in enumerate(q_nd):
        if s.is_split and s.dim == 1:
            return a, k_nd[a].is_split
    return None, False


def _local_shape(shape, nd, hierarchy):
    ways = [1] * len(shape)
    for a, s in enumerate(nd):
        if s.is_split:
            ways[s.dim] *= hierarchy[a]
    return [-(-n // w) for n, w in zip(shape, ways)]


@functools.lru_cache(maxsize=256)
def _ring_collectives(bwd, local_avals, n, starts, sizes, params):
    """((bytes one device sends, times it runs), ...) of each collective-permute of the ring
    kernel on local shards of ``local_avals`` (read off its trace: a permute in the ring's loop
    runs once per hop)."""
    p = dict(params)
    kernel = _kernels.ring_attention_bwd if bwd else _kernels.ring_attention
    fn = functools.partial(
        _ring_call,
        kernel,
        p["has_bias"],
        p["has_mask"],
        axis_name="ring",
        axis_size=n,
        starts=starts,
        sizes=sizes,
        scale=p["scale"],
        is_causal=p["is_causal"],
    )
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in local_avals]
    jaxpr = jax.make_jaxpr(fn, axis_env=[("ring", n)])(*structs).jaxpr
    out = []

    def walk(jx, times):
        for e in jx.eqns:
            if e.primitive.name == "ppermute":
                out.append((sum(v.aval.size * v.aval.dtype.itemsize for v in e.invars), times))
            inner = times * (e.params["length"] if e.primitive.name == "scan" else 1)
            for sub in _subjaxprs(e):
                walk(sub, inner)

    walk(jaxpr, 1)
    return tuple(out)


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def _ring_call(kernel, has_bias, has_mask, *args, **kw):
    q, k, v, bias, mask, rest = _unpack(args, has_bias, has_mask)
    return kernel(q, k, v, bias, mask, *rest, balance=kw["is_causal"], **kw)


def _cost(bwd):
    def cost(ctx, in_nd, out_nd):
        qb, qt, qn, h = _local_shape(ctx.in_shapes[0], in_nd[0], ctx.hierarchy)
        s_full = ctx.in_shapes[1][1]
        # QK^T and PV: 2 matmuls of 2 FLOPs per multiply-add; the backward recomputes P and
        # runs 4 more (dV, dP, dQ, dK)
        flops = (10.0 if bwd else 4.0) * qb * qn * qt * s_full * h
        a, ring = _seq_axis(in_nd)
        if a is None:
            split = {s.dim for s in in_nd[0] if s.is_split}
            note = "heads split" if 2 in split else "batch split" if split else "replicated"
            return LocalCost(flops, note=note)
        name = ctx.axis_names[a] if ctx.axis_names else str(a)
        if not ring:
            return LocalCost(flops, note=f"queries split over {name!r}, key/value whole")
        n = ctx.hierarchy[a]
        sizes = tuple(balanced(ctx.in_shapes[0][1], n))
        local = tuple(
            (tuple(_local_shape(x.shape, nd, ctx.hierarchy)), np.dtype(x.dtype))
            for x, nd in zip(ctx.in_avals, in_nd)
        )
        params = tuple(sorted(ctx.params.items()))
        sends = _ring_collectives(bwd, local, n, tuple(offsets(sizes)), sizes, params)
        colls = tuple(("collective-permute", b, times) for b, times in sends)
        if ctx.params["is_causal"] and qt % 2 == 0 and n > 1:
            # balanced causal ring: the diagonal block and n - 1 half blocks of the n
            flops *= (n + 1) / (2 * n)
        return LocalCost(flops, colls, overlapped=True, note=f"ring over {name!r}")

    return cost


def _local(bwd):
    def local(step, ins):
        p = step.eqn.params
        kw = dict(scale=p["scale"], is_causal=p["is_causal"])
        a, ring = _seq_axis([lay.nd_sbp for lay in step.in_layouts])
        plc = step.in_layouts[0].placement
        if a is not None:
            t = step.eqn.invars[0].aval.shape[1]
            sizes = balanced(t, plc.hierarchy[a])
            starts = offsets(sizes)
            name = plc.axis_names[a]
            i = lax.axis_index(name)
            # the padding at the end of an uneven block holds anything (NaN included): zeroed
            ins = [
                mask_padding(x, lay, (lay.nd_sbp[a].dim,), 0) if lay.nd_sbp[a].is_split else x
                for x, lay in zip(ins, step.in_layouts)
            ]
            if ring:
                kw.update(axis_name=name, axis_size=plc.hierarchy[a], starts=tuple(starts))
                kernel = _kernels.ring_attention_bwd if bwd else _kernels.ring_attention
                return list(
                    _ring_call(kernel, p["has_bias"], p["has_mask"], *ins, sizes=tuple(sizes), **kw)
                )
            kw.update(q_start=jnp.asarray(starts)[i], q_valid=jnp.asarray(sizes)[i])
        q, k, v, bias, mask, rest = _unpack(ins, p["has_bias"], p["has_mask"])
        f = _kernels.attention_bwd if bwd else _kernels.attention
        return list(f(q, k, v, bias, mask, *rest, **kw))

    return local


register_sbp_rule("jsbp_attention", nd=True, local=_local(False), cost=_cost(False))(
    _signatures(False)
)
register_sbp_rule("jsbp_attention_bwd", nd=True, local=_local(True), cost=_cost(True))(
    _signatures(True)
)
