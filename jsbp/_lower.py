"""From a solved planning problem to the ``Program`` the emitter runs.

``lower`` turns an assignment (one candidate per node of a ``_problem.Problem``) into steps: each
node's equation with the layouts of its candidate and the boxings of its operands, a conversion
of one value to one layout made once (later readers reuse it, or convert from it where that is
cheaper than from the value as made), calls as nested programs over their inlined jaxprs, and the
outputs converted to the layouts asked of them. ``plan`` is the whole path: the jaxpr's dead code
dropped, the problem built, solved and lowered, reductions moved ahead of transposes and small
collectives combined.
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
    made: dict = {}  # id(value) -> the layouts it was converted to (the emitter's cache: shared by inlined calls)

    def lay(nd, aval):
        return layout_of(placement, tuple(nd), tuple(aval.shape))

    def moves(val, src, dst):
        from ._cost import itemsize

        return box_plan(src, dst, val.shape, hier, itemsize(val.aval.dtype))

    def box(i, val, literal: bool, src, dst) -> Boxing | None:
        if src == dst:
            return None
        best = Boxing(i, lay(src, val.aval), lay(dst, val.aval), moves(val, src, dst))
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
                best = Boxing(i, lay(h, val.aval), lay(dst, val.aval), moves(val, h, dst), via=True)
                cost = c
        held[dst] = None
        return best

    def layout_of_var(v):
        if isinstance(v, jcore.Literal):
            return lay(_b(placement), v.aval)
        return lay(prob.layout(prob.alias[v], choice), v.aval)

    def program(jx, jx_consts, in_lays, structure) -> Program:
        steps = []
        for item in structure:
            if item[0] == "node":
                u = item[1]
                n = prob.nodes[u]
                ins, outs = n.cands[choice[u]]
                boxings = []
                for i, (val, v, t) in enumerate(zip(n.operands, n.eqn.invars, ins)):
                    bx = box(i, val, isinstance(v, jcore.Literal), prob.layout(val, choice), t)
                    if bx is not None:
                        boxings.append(bx)
                steps.append(
                    Step(
                        n.eqn,
                        [lay(nd, v.aval) for nd, v in zip(ins, n.eqn.invars)],
                        [lay(nd, v.aval) for nd, v in zip(outs, n.eqn.outvars)],
                        boxings,
                        rule=n.rule,
                        kind=n.kind,
                    )
                )
            else:
                _, eqn, inner, inner_consts, sub = item
                cur = [layout_of_var(v) for v in eqn.invars]
                sub_prog = program(inner, inner_consts, cur, sub)
                steps.append(
                    Step(eqn, cur, list(sub_prog.out_layouts), [], sub=sub_prog, kind="call")
                )
        out_layouts = [layout_of_var(v) for v in jx.outvars]
        return Program(jx, list(jx_consts), list(in_lays), steps, out_layouts, [])

    prog = program(jaxpr, consts, in_layouts, prob.structure)
    out_made: dict = {}
    for i, (v, want) in enumerate(zip(jaxpr.outvars, out_nd or [None] * len(jaxpr.outvars))):
        cur = prog.out_layouts[i]
        if want is None or tuple(want) == cur.nd_sbp:
            continue
        val = prob.outvars[i]
        bx = Boxing(i, cur, lay(want, v.aval), moves(val, cur.nd_sbp, tuple(want)))
        if not isinstance(v, jcore.Literal):
            bx.reused = (id(val), tuple(want)) in out_made
            out_made[(id(val), tuple(want))] = None
        prog.out_boxings.append(bx)
        prog.out_layouts[i] = bx.dst
    return prog


def _b(placement):
    from ._sbp import broadcast

    return (broadcast,) * placement.ndim


def plan(placement, jaxpr, consts, in_layouts, out_nd=None, *, strict: bool = False) -> Program:
    """The planned program of ``jaxpr`` (see the module doc)."""
    from ._combine import combine_collectives
    from ._compiler import _dce, _reduce_before_transposes

    jaxpr = _dce(jaxpr)
    prob = build(placement, jaxpr, consts, in_layouts, out_nd, strict=strict)
    prog = lower(prob, solve(prob), jaxpr, consts, in_layouts, out_nd)
    _reduce_before_transposes(prog)
    combine_collectives(prog)
    return prog
