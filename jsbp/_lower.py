"""From a solved planning problem to the ``Program`` the emitter runs.

``lower`` turns an assignment (one candidate per node of a ``_problem.Problem``) into steps: each
node's equation with the layouts of its candidate and the boxings of its operands, a conversion
of one value to one layout made once (later readers reuse it, or convert from it where that is
cheaper than from the value as made), calls as nested programs over their inlined jaxprs, and the
outputs converted to the layouts asked of them. ``plan`` is the whole path: the jaxpr's common
subexpressions merged (``_cse``) and its dead code dropped, the problem built, solved and
lowered, reductions moved ahead of transposes, small collectives combined, and a
``NoRuleWarning`` per primitive that ran replicated for want of a rule.
"""

from __future__ import annotations

import gc
import warnings

from jax.extend import core as jcore

from . import _sbp
from ._boxing import COLLECTIVE_LATENCY_BYTES, widening
from ._boxing import plan as box_plan
from ._combine import combine_collectives
from ._cost import itemsize
from ._cse import cse
from ._errors import NoRuleWarning
from ._layout import layout_of
from ._problem import Problem, build, fresh_vars, legal_signatures
from ._program import Boxing, Program, Step, iter_steps, solve_reads, subprograms
from ._solve import solve
from .rules import _registry


def lower(
    prob: Problem, choice: list[int], jaxpr, consts, in_layouts, out_nd=None, strict=False
) -> Program:
    """The program of ``choice`` (see the module doc)."""
    placement = prob.placement
    hier = placement.hierarchy

    def lay(nd, aval):
        return layout_of(placement, tuple(nd), tuple(aval.shape))

    def moves(aval, src, dst):
        size = itemsize(aval.dtype)
        return box_plan(src, dst, tuple(aval.shape), hier, size, widening(aval.dtype))

    hubs: dict = {}

    def hub(val, src):
        """The layout ``val`` is converted to first, its other wanted layouts cut from it where
        that is cheaper than from ``src`` (an all-reduce, then a local slice): the wanted layout
        that makes the conversions cheapest, or None (each from ``src``)."""
        if id(val) not in hubs:
            hubs[id(val)] = prob.spread(val, src, prob.wanted(val, choice))[1]
        return hubs[id(val)]

    def box(made, i, aval, val, src, dst) -> list[Boxing]:
        """Operand ``i`` (``val``, None for a literal) from ``src`` to ``dst``: its boxings (none,
        one, or the conversion to the value's hub then from it); ``made``: id(value) -> the
        layouts it was converted to in this scope (the emitter's conversion cache, shared by
        inlined calls)."""
        if src == dst:
            return []
        if val is None:
            return [Boxing(i, lay(src, aval), lay(dst, aval), moves(aval, src, dst))]
        held = made.setdefault(id(val), {})
        to = [dst]
        h = None if dst in held else hub(val, src)
        if h is not None and h != dst and h not in held:
            if prob.conversion(val, h, dst) < prob.conversion(val, src, dst):
                to = [h, dst]
        out = []
        for t in to:  # each made once: from ``src`` or from a layout made before, the cheaper
            best = Boxing(i, lay(src, aval), lay(t, aval), moves(aval, src, t), reused=t in held)
            if not best.reused:
                cost = prob.conversion(val, src, t)
                for h in held:
                    c = prob.conversion(val, h, t)
                    if c < cost:
                        best = Boxing(i, lay(h, aval), lay(t, aval), moves(aval, h, t), via=True)
                        cost = c
                held[t] = None
            out.append(best)
        return out

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
            src = _b(placement) if val is None else prob.layout(val, choice)  # a literal: B
            boxings += box(made, i, v.aval, val, src, tuple(nd))
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
                    mine = None if isinstance(v, jcore.Literal) else val
                    boxings += box(made, i, v.aval, mine, prob.layout(val, choice), t)
                ins_l = [lay(nd, v.aval) for nd, v in zip(ins, n.eqn.invars)]
                outs_l = [lay(nd, v.aval) for nd, v in zip(outs, n.eqn.outvars)]
                if choice[u] in n.local:  # the candidate runs as its own small program
                    local_jaxpr, local_consts = n.local[choice[u]]
                    sub_prog = _local_program(
                        placement, local_jaxpr, local_consts, ins_l, outs, strict
                    )
                    steps.append(Step(n.eqn, ins_l, outs_l, boxings, sub=sub_prog, kind="call"))
                    continue
                steps.append(Step(n.eqn, ins_l, outs_l, boxings, rule=n.rule, kind=n.kind))
            elif kind in ("call", "linear_solve"):  # (a solve reads some of its operands)
                _, eqn, inner, inner_consts, sub = item
                cur = [layout_of_var(v) for v in eqn.invars]
                reads = solve_reads(eqn) if kind == "linear_solve" else range(len(cur))
                sub_prog = program(inner, inner_consts, [cur[i] for i in reads], sub, made)
                steps.append(
                    Step(eqn, cur, list(sub_prog.out_layouts), [], sub=sub_prog, kind=kind)
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
                bconsts, wants_b = eqn.params["body_jaxpr"].consts, [held_out(u) for u in cs]
                body_prog = program(bj, bconsts, body_in, bsub, {}, wants_b)
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
            to_outputs(prog, wants, made)
        return prog

    def to_outputs(prog, wants, made):
        """Convert ``prog``'s outputs to ``wants`` (per output an nd-sbp or None), as ``box``
        converts operands: a layout the value was already converted to in this scope is reused."""
        for i, (v, want) in enumerate(zip(prog.jaxpr.outvars, wants)):
            cur = prog.out_layouts[i]
            if want is None or tuple(want) == cur.nd_sbp:
                continue
            val = None if isinstance(v, jcore.Literal) else prob.alias[v]
            bxs = box(made, i, v.aval, val, cur.nd_sbp, tuple(want))
            prog.out_boxings += bxs
            prog.out_layouts[i] = bxs[-1].dst

    prog = program(
        jaxpr, consts, in_layouts, prob.structure, {}, list(out_nd) if out_nd is not None else None
    )
    program = None  # (recursive: a cycle that would hold prob until the next collection)
    return prog


def _b(placement):
    return (_sbp.broadcast,) * placement.ndim


def _local_cost(placement, strict):
    """The price of a candidate run as its own small program (``_rewrite``): that program's
    least cost with its operand's and result's layouts fixed (planned without such candidates of
    its own: its reductions and scans run on the blocks it made)."""

    def price(jaxpr, consts, in_nd, out_nd):
        lays = [layout_of(placement, in_nd, tuple(v.aval.shape)) for v in jaxpr.invars]
        prob = build(placement, jaxpr, consts, lays, [out_nd], strict=strict)
        return prob.cost(solve(prob))

    return price


def _local_program(placement, jaxpr, consts, in_layouts, out_nds, strict) -> Program:
    """The planned program of a candidate that runs as its own small program, over fresh
    variables (each equation that chose it runs its own copy), as ``_local_cost`` priced it."""
    jaxpr = fresh_vars(jaxpr)
    prob = build(placement, jaxpr, consts, in_layouts, out_nds, strict=strict)
    return lower(prob, solve(prob), jaxpr, consts, in_layouts, out_nds, strict)


def plan(placement, jaxpr, consts, in_layouts, out_nd=None, *, strict: bool = False) -> Program:
    """The planned program of ``jaxpr`` (see the module doc). The cyclic garbage collector waits
    meanwhile: planning makes many small objects, which it would scan again and again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        jaxpr = _dce(cse(jaxpr))
        local = _local_cost(placement, strict)
        prob = build(placement, jaxpr, consts, in_layouts, out_nd, strict=strict, local=local)
        prog = lower(prob, solve(prob), jaxpr, consts, in_layouts, out_nd, strict)
        del prob  # (freed now, while the collector waits)
        _reduce_before_transposes(prog)
        combine_collectives(prog)
    finally:
        if enabled:
            gc.enable()
    _warn_replicated(prog, placement)
    return prog


def _reduce_before_transposes(prog: Program, seen=None) -> None:
    """Move the reduction of a partial value to before the ``transpose`` that feeds it.

    A weight gradient is ``dot_general`` (partial over the data axis) then ``transpose``; SBP
    inference keeps the transpose partial and reduces where the optimizer needs the value, so the
    program reads dot -> transpose -> all-reduce. The bytes are the same either way, but XLA
    cannot fold a transpose into a matmul whose result must be laid out for a collective: it
    copies both operands instead (XLA:CPU: one dot per weight left unfused, ~5 % of a DP step).
    Reducing first (dot -> all-reduce -> transpose) is what GSPMD emits. Rewritten only where the
    transpose's operand and result each have that single use, the operand is computed in the
    same program, and the moved boxing costs no more; nested programs likewise (each once: two
    loops of one body and layouts share its program, ``_body_program``)."""
    seen = set() if seen is None else seen
    if id(prog) in seen:
        return
    seen.add(id(prog))
    for st in prog.steps:
        for sub in subprograms(st):
            _reduce_before_transposes(sub, seen)
    uses: dict = {}
    produced = set()
    for k, st in enumerate(prog.steps):
        produced.update(v for v in st.eqn.outvars if not isinstance(v, jcore.DropVar))
        for i, v in enumerate(st.eqn.invars):
            if not isinstance(v, jcore.Literal):
                uses.setdefault(v, []).append((k, i))
    for v in prog.jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            uses.setdefault(v, []).append((None, None))
    for st in reversed(prog.steps):
        if st.kind != "prim" or st.eqn.primitive.name != "transpose" or st.boxings:
            continue
        (x,), (y,) = st.eqn.invars, st.eqn.outvars
        lin, lout = st.in_layouts[0], st.out_layouts[0]
        if not lin.partial_axes or x not in produced or len(uses.get(x, ())) != 1:
            continue
        y_uses = uses.get(y, ())
        if len(y_uses) != 1 or y_uses[0][0] is None:
            continue
        c, i = y_uses[0]
        consumer = prog.steps[c]
        mine = [b for b in consumer.boxings if b.operand == i]
        bx = mine[0] if len(mine) == 1 else None  # (not a conversion through a hub layout)
        if (
            bx is None
            or bx.reused
            or bx.via
            or any(bx.dst.nd_sbp[a].is_partial for a in lout.partial_axes)
        ):
            continue
        perm = st.eqn.params["permutation"]
        nd = tuple(_sbp.split(perm[x_.dim]) if x_.is_split else x_ for x_ in bx.dst.nd_sbp)
        new_in = layout_of(lin.placement, nd, lin.shape)
        moved = Boxing(
            0,
            lin,
            new_in,
            box_plan(
                lin.nd_sbp,
                nd,
                lin.shape,
                lin.placement.hierarchy,
                itemsize(x.aval.dtype),
                widening(x.aval.dtype),
            ),
        )
        if _moves_cost(moved.moves) > _moves_cost(bx.moves):
            continue
        st.boxings = [moved]
        st.in_layouts, st.out_layouts = [new_in], [bx.dst]
        consumer.boxings = [b for b in consumer.boxings if b is not bx]


def _moves_cost(moves) -> float:
    """Bytes per device plus a fixed latency per collective (what really moves)."""
    return sum(
        m.bytes_per_device + (COLLECTIVE_LATENCY_BYTES if m.collective else 0.0) for m in moves
    )


def _dce(jaxpr):
    """Drop equations whose results are unused (XLA would drop them and their collectives)."""
    try:
        from jax._src.interpreters import partial_eval as pe

        n_consts = len(jaxpr.constvars)
        flat = pe.convert_constvars_jaxpr(jaxpr) if n_consts else jaxpr
        new, _ = pe.dce_jaxpr(flat, [True] * len(flat.outvars), instantiate=True)
        return pe.convert_invars_to_constvars(new, n_consts) if n_consts else new
    except Exception:  # pragma: no cover - an internal API moved: plan without DCE
        return jaxpr


def _warn_replicated(prog: Program, placement) -> None:
    """One ``NoRuleWarning`` per primitive of ``prog`` that had no rule and ran replicated."""
    seen: dict = {}
    for _, st in iter_steps(prog):
        if st.kind == "prim" and st.rule is not None and st.rule.fallback:
            name = st.eqn.primitive.name
            shapes, nbytes = seen.get(name, ([], 0.0))
            shapes.append(", ".join(str(tuple(v.aval.shape)) for v in st.eqn.invars))
            seen[name] = (shapes, nbytes + sum(bx.bytes_per_device for bx in st.boxings))
    for name, (shapes, nbytes) in seen.items():
        warnings.warn(
            f"no SBP rule for JAX primitive '{name}' (operands of shape {'; '.join(shapes[:3])}"
            f"{' ...' if len(shapes) > 3 else ''}): it ran replicated on {placement}, its operands boxed to "
            f"B ({nbytes:,.0f} bytes received per device) and computed whole on every device. Register a "
            f"rule with @jsbp.register_sbp_rule('{name}') (CONTRIBUTING.md), or pass jsbp.jit(fn, "
            "strict=True) / JSBP_STRICT=1 to make this an error.",
            NoRuleWarning,
            stacklevel=6,  # the user's call of the jitted function
        )


def candidate_signatures(placement, eqn) -> list[tuple[tuple, tuple]]:
    """Every nd signature the rule of ``eqn`` offers on ``placement`` (after expansion)."""
    return legal_signatures(placement, _registry.get_rule(eqn.primitive.name), eqn)


def forced_program(placement, closed, in_nds, out_nds) -> Program:
    """A Program running the single equation of ``closed`` under the given signature."""
    (eqn,) = closed.jaxpr.eqns

    def lay(nd, aval):
        return layout_of(placement, tuple(nd), tuple(aval.shape))

    in_lays = [lay(nd, v.aval) for nd, v in zip(in_nds, eqn.invars)]
    out_lays = [lay(nd, v.aval) for nd, v in zip(out_nds, eqn.outvars)]
    st = Step(eqn, in_lays, out_lays, [], rule=_registry.get_rule(eqn.primitive.name))
    jaxpr_in = (
        [lay(nd, v.aval) for nd, v in zip(in_nds, closed.jaxpr.invars)]
        if closed.jaxpr.invars == eqn.invars
        else in_lays
    )
    return Program(closed.jaxpr, list(closed.consts), jaxpr_in, [st], out_lays, [])
