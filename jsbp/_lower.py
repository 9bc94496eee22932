"""From a solved planning problem to the ``Program`` the emitter runs.

``lower`` turns an assignment (one candidate per node of a ``_problem.Problem``) into steps: each
node's equation with the layouts of its candidate and the boxings of its operands, a conversion
of one value to one layout made once (later readers reuse it, or convert from it where that is
cheaper than from the value as made), calls as nested programs over their inlined jaxprs, and the
outputs converted to the layouts asked of them. ``plan`` is the whole path: the jaxpr's dead code
dropped, the problem built, solved and lowered, reductions moved ahead of transposes, small
collectives combined, and a ``NoRuleWarning`` per primitive that ran replicated for want of a
rule.
"""

from __future__ import annotations

from jax.extend import core as jcore

from ._boxing import plan as box_plan
from ._layout import layout_of
from ._problem import Problem, build
from ._program import Boxing, Program, Step
from ._solve import solve


def lower(prob: Problem, choice: list[int], jaxpr, consts, in_layouts, out_nd=None) -> Program:
    """The program of ``choice`` (see the module doc)."""
    placement = prob.placement
    hier = placement.hierarchy

    def lay(nd, aval):
        return layout_of(placement, tuple(nd), tuple(aval.shape))

    def moves(aval, src, dst):
        from ._cost import itemsize

        return box_plan(src, dst, tuple(aval.shape), hier, itemsize(aval.dtype))

    def box(made, i, val, literal: bool, src, dst) -> Boxing | None:
        """Operand ``i`` (``val``) from ``src`` to ``dst``; ``made``: id(value) -> the layouts it
        was converted to in this scope (the emitter's conversion cache, shared by inlined calls)."""
        if src == dst:
            return None
        best = Boxing(i, lay(src, val.aval), lay(dst, val.aval), moves(val.aval, src, dst))
        if literal:
            return best
        held = made.setdefault(id(val), {})
        if dst in held:
            best.reused = True
            return best
        cost = prob.conversion(val, src, dst)
        for h in held:
            c = prob.conversion(val, h, dst)
            if c < cost:
                best = Boxing(
                    i, lay(h, val.aval), lay(dst, val.aval), moves(val.aval, h, dst), via=True
                )
                cost = c
        held[dst] = None
        return best

    def layout_of_var(v):
        if isinstance(v, jcore.Literal):
            return lay(_b(placement), v.aval)
        return lay(prob.layout(prob.alias[v], choice), v.aval)

    def chosen(u):
        return prob.nodes[u].cands[choice[u]]

    def held_in(u):  # the layout a boundary node holds its operand(s) in
        return chosen(u)[0][0]

    def held_out(u):  # and the layout of the value it gives
        return chosen(u)[1][0]

    def operands_to(made, eqn, nds, first=0):
        """``eqn``'s operands from ``first`` on converted to ``nds``: (layouts, boxings)."""
        lays, boxings = [], []
        for i, (v, nd) in enumerate(zip(eqn.invars[first:], nds), first):
            val = prob.alias.get(v) if not isinstance(v, jcore.Literal) else None
            if val is None:  # a literal: B
                src = _b(placement)
                if tuple(nd) != src:
                    boxings.append(
                        Boxing(i, lay(src, v.aval), lay(nd, v.aval), moves(v.aval, src, nd))
                    )
            else:
                bx = box(made, i, val, False, prob.layout(val, choice), nd)
                if bx is not None:
                    boxings.append(bx)
            lays.append(lay(nd, v.aval))
        return lays, boxings

    def program(jx, jx_consts, in_lays, structure, made, wants=None) -> Program:
        steps = []
        for item in structure:
            kind = item[0]
            if kind == "node":
                u = item[1]
                n = prob.nodes[u]
                ins, outs = n.cands[choice[u]]
                boxings = []
                for i, (val, v, t) in enumerate(zip(n.operands, n.eqn.invars, ins)):
                    bx = box(
                        made, i, val, isinstance(v, jcore.Literal), prob.layout(val, choice), t
                    )
                    if bx is not None:
                        boxings.append(bx)
                ins_l = [lay(nd, v.aval) for nd, v in zip(ins, n.eqn.invars)]
                outs_l = [lay(nd, v.aval) for nd, v in zip(outs, n.eqn.outvars)]
                steps.append(Step(n.eqn, ins_l, outs_l, boxings, rule=n.rule, kind=n.kind))
            elif kind == "call":
                _, eqn, inner, inner_consts, sub = item
                cur = [layout_of_var(v) for v in eqn.invars]
                sub_prog = program(inner, inner_consts, cur, sub, made)
                steps.append(
                    Step(eqn, cur, list(sub_prog.out_layouts), [], sub=sub_prog, kind="call")
                )
            elif kind == "linear_solve":
                _, eqn, inner, inner_consts, sub, reads = item
                cur = [layout_of_var(v) for v in eqn.invars]
                sub_prog = program(inner, inner_consts, [cur[i] for i in reads], sub, made)
                steps.append(
                    Step(
                        eqn,
                        cur,
                        list(sub_prog.out_layouts),
                        [],
                        sub=(sub_prog, reads),
                        kind="linear_solve",
                    )
                )
            elif kind == "scan":
                _, eqn, body, bconsts, sub, ks, cs, xs, ys = item
                nds = (
                    [held_in(u) for u in ks] + [held_out(u) for u in cs] + [held_in(u) for u in xs]
                )
                lays, boxings = operands_to(made, eqn, nds)
                body_in = [lay(held_out(u), v.aval) for u, v in zip(ks + cs + xs, body.invars)]
                wants_b = [held_out(u) for u in cs] + [held_in(u) for u in ys]
                sub_prog = program(body, bconsts, body_in, sub, {}, wants_b)
                nk = len(cs)
                outs = lays[len(ks) : len(ks) + nk] + [
                    lay(held_out(u), v.aval) for u, v in zip(ys, eqn.outvars[nk:])
                ]
                steps.append(Step(eqn, lays, outs, boxings, sub=sub_prog, kind="scan"))
            elif kind == "while":
                _, eqn, (cj, csub, cks), (bj, bsub, bks), cs = item
                first = len(cks) + len(bks)
                nds = [held_in(u) for u in cks + bks] + [held_out(u) for u in cs]
                lays, boxings = operands_to(made, eqn, nds)
                carry = lays[first:]
                cond_in = [lay(held_out(u), v.aval) for u, v in zip(cks, cj.invars)] + carry
                body_in = [lay(held_out(u), v.aval) for u, v in zip(bks, bj.invars)] + carry
                cond_prog = program(
                    cj, eqn.params["cond_jaxpr"].consts, cond_in, csub, {}, [_b(placement)]
                )
                body_prog = program(
                    bj,
                    eqn.params["body_jaxpr"].consts,
                    body_in,
                    bsub,
                    {},
                    [held_out(u) for u in cs],
                )
                steps.append(
                    Step(eqn, lays, list(carry), boxings, sub=(cond_prog, body_prog), kind="while")
                )
            else:  # cond
                _, eqn, idx, ops, branches, rs = item
                lays, boxings = operands_to(made, eqn, [held_in(idx)] + [held_in(u) for u in ops])
                subs = [
                    program(bj, bc, lays[1:], bsub, {}, [held_out(u) for u in rs])
                    for bj, bc, bsub in branches
                ]
                steps.append(
                    Step(eqn, lays, list(subs[0].out_layouts), boxings, sub=subs, kind="cond")
                )
        prog = Program(
            jx, list(jx_consts), list(in_lays), steps, [layout_of_var(v) for v in jx.outvars], []
        )
        if wants is not None:
            to_outputs(prog, wants)
        return prog

    def to_outputs(prog, wants):
        """Convert ``prog``'s outputs to ``wants`` (per output an nd-sbp or None); an output
        repeated in one layout converts once."""
        out_made: dict = {}
        for i, (v, want) in enumerate(zip(prog.jaxpr.outvars, wants)):
            cur = prog.out_layouts[i]
            if want is None or tuple(want) == cur.nd_sbp:
                continue
            bx = Boxing(i, cur, lay(want, v.aval), moves(v.aval, cur.nd_sbp, tuple(want)))
            if not isinstance(v, jcore.Literal):
                bx.reused = (v, tuple(want)) in out_made
                out_made[(v, tuple(want))] = None
            prog.out_boxings.append(bx)
            prog.out_layouts[i] = bx.dst

    return program(
        jaxpr, consts, in_layouts, prob.structure, {}, list(out_nd) if out_nd is not None else None
    )


def _b(placement):
    from ._sbp import broadcast

    return (broadcast,) * placement.ndim


def plan(placement, jaxpr, consts, in_layouts, out_nd=None, *, strict: bool = False) -> Program:
    """The planned program of ``jaxpr`` (see the module doc)."""
    from ._combine import combine_collectives
    from ._compiler import _dce, _reduce_before_transposes, _warn_replicated

    jaxpr = _dce(jaxpr)
    prob = build(placement, jaxpr, consts, in_layouts, out_nd, strict=strict)
    prog = lower(prob, solve(prob), jaxpr, consts, in_layouts, out_nd)
    _reduce_before_transposes(prog)
    combine_collectives(prog)
    _warn_replicated(prog, placement)
    return prog
