"""The emitter: a planned ``Program`` run on local shards, inside one ``shard_map`` body.

``run_program`` runs the steps and the combined collectives in the order ``_combine`` gave them
(else step by step): before each step its operands' boxings (``_boxing.run_plan``; a conversion
of one value to one layout is made once and reused, a ``via`` boxing starts from an earlier
conversion), then the step: a primitive by its rule's local implementation or by binding it on
the local, padded shards; a call, loop body or branch by running its nested program.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from ._boxing import run_plan
from ._combine import group_members, run_group
from ._program import Program, Step, scan_counts, solve_reads


def _apply_boxings(vals, boxings, invars=None, cache=None):
    for bx in boxings:
        key = None
        if invars is not None and not isinstance(invars[bx.operand], jcore.Literal):
            key = (invars[bx.operand], bx.dst.nd_sbp)
            if key in cache:
                vals[bx.operand] = cache[key]
                continue
        if bx.via:  # start from the earlier conversion of the value to ``src``
            vals[bx.operand] = cache[(invars[bx.operand], bx.src.nd_sbp)]
        vals[bx.operand], _ = run_plan(vals[bx.operand], bx.moves, bx.src)
        if key is not None:
            cache[key] = vals[bx.operand]
    return vals


def run_program(
    prog: Program, local_inputs: list, cache: dict | None = None, alias: dict | None = None
) -> list:
    """Run ``prog`` on local shards, in the order ``prog.order`` gives (``_combine``: the steps and
    the combined collectives, each run once its operands exist), else step by step.
    ``cache``/``alias``: shared with the caller for inlined calls."""
    env: dict = {}
    for v, c in zip(prog.jaxpr.constvars, prog.consts):
        env[v] = jnp.asarray(c)
    for v, x in zip(prog.jaxpr.invars, local_inputs):
        env[v] = x

    def read(v):
        if isinstance(v, jcore.Literal):
            return jnp.asarray(v.val, dtype=v.aval.dtype) if hasattr(v.aval, "dtype") else v.val
        return env[v]

    cache = {} if cache is None else cache
    alias = {} if alias is None else alias

    def key(v):
        while v in alias:
            v = alias[v]
        return v

    members = group_members(prog)  # combined collective -> [(boxing, the value it converts)]
    order = prog.order if prog.order is not None else [("step", k) for k in range(len(prog.steps))]
    for kind, k in order:
        if kind == "group":
            outs = run_group(prog.in_layouts[0].placement, [(bx, read(v)) for bx, v in members[k]])
            for (bx, v), y in zip(members[k], outs):
                cache[(key(v), bx.dst.nd_sbp)] = y  # read by the members' steps and later reuses
            continue
        st = prog.steps[k]
        keys = [v if isinstance(v, jcore.Literal) else key(v) for v in st.eqn.invars]
        ins = [read(v) for v in st.eqn.invars]
        for bx in st.boxings:
            if bx.group is not None:
                ins[bx.operand] = cache[(keys[bx.operand], bx.dst.nd_sbp)]
        ins = _apply_boxings(ins, [bx for bx in st.boxings if bx.group is None], keys, cache)
        if st.kind == "call":
            for sub_v, outer in zip(st.sub.jaxpr.invars, keys):
                if not isinstance(outer, jcore.Literal):
                    alias[sub_v] = outer
            outs = run_program(st.sub, ins, cache, alias)
            _alias_outputs(alias, st.eqn.outvars, st.sub.jaxpr.outvars)
        else:
            outs = _EMIT[st.kind](st, ins)
        for v, o in zip(st.eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = o
    outs = [read(v) for v in prog.jaxpr.outvars]
    keys = [v if isinstance(v, jcore.Literal) else key(v) for v in prog.jaxpr.outvars]
    for bx in prog.out_boxings:
        if bx.group is not None:
            outs[bx.operand] = cache[(keys[bx.operand], bx.dst.nd_sbp)]
    return _apply_boxings(outs, [bx for bx in prog.out_boxings if bx.group is None], keys, cache)


def _alias_outputs(alias, outer_outs, inner_outs):
    """An inlined call's results are its inner values: same boxing cache keys."""
    for o, i in zip(outer_outs, inner_outs):
        if not isinstance(o, jcore.DropVar) and not isinstance(i, jcore.Literal) and o is not i:
            alias[o] = i


def _emit_prim(st: Step, ins):
    rule = st.rule
    eqn = st.eqn
    if rule.local is not None:
        outs = rule.local(st, ins)
    else:
        outs = eqn.primitive.bind(*ins, **eqn.params)
    if not eqn.primitive.multiple_results:
        outs = [outs]
    return list(outs)


def _emit_annotate(st, ins):
    return ins


def _emit_scan(st, ins):
    p = st.eqn.params
    nc, nk = scan_counts(p)
    consts, init, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
    sub = st.sub

    def body(carry, x):
        out = run_program(sub, list(consts) + list(carry) + list(x))
        return out[:nk], out[nk:]

    carry, ys = lax.scan(
        body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return list(carry) + list(ys)


def _emit_while(st, ins):
    p = st.eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
    cond, body = st.sub
    out = lax.while_loop(
        lambda c: run_program(cond, list(cconsts) + list(c))[0],
        lambda c: run_program(body, list(bconsts) + list(c)),
        list(init),
    )
    return list(out)


def _emit_cond(st, ins):
    idx, ops = ins[0], ins[1:]
    fns = [(lambda *a, s=s: run_program(s, list(a))) for s in st.sub]
    return list(lax.switch(idx, fns, *ops))


def _emit_linear_solve(st, ins):
    return run_program(st.sub, [ins[i] for i in solve_reads(st.eqn)])


_EMIT = {
    "prim": _emit_prim,
    "annotate": _emit_annotate,
    "linear_solve": _emit_linear_solve,
    "scan": _emit_scan,
    "while": _emit_while,
    "cond": _emit_cond,
}
