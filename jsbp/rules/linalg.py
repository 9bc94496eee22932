"""dot_general and conv: the matmul signature table of OneFlow / Megatron.

(S(0), B) -> S(0); (B, S(1)) -> S(1); (S(1), S(0)) -> P; (P, B) -> P; (B, P) -> P; (B, B) -> B;
batch dims split together.
"""

from __future__ import annotations

from .._sbp import Split
from ._common import B, P, mask_padding
from ._registry import register_sbp_rule


def _dot_sigs(ctx):
    (lc, rc), (lb, rb) = ctx.params["dimension_numbers"]
    ls, rs = ctx.in_shapes
    nb = len(lb)
    lfree = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rs)) if d not in rc and d not in rb]
    for i, (a, b) in enumerate(zip(lb, rb)):
        yield (Split(a), Split(b)), (Split(i),)
    for j, d in enumerate(lfree):
        yield (Split(d), B), (Split(nb + j),)
    for j, d in enumerate(rfree):
        yield (B, Split(d)), (Split(nb + len(lfree) + j),)
    for a, b in zip(lc, rc):
        yield (Split(a), Split(b)), (P,)
    yield (P, B), (P,)
    yield (B, P), (P,)
    yield (B, B), (B,)


def _dot_local(st, ins):
    x, y = ins
    (lc, rc), _ = st.eqn.params["dimension_numbers"]
    x = mask_padding(x, st.in_layouts[0], lc, 0)
    y = mask_padding(y, st.in_layouts[1], rc, 0)
    return st.eqn.primitive.bind(x, y, **st.eqn.params)


register_sbp_rule("dot_general", local=_dot_local)(_dot_sigs)


def _conv_sigs(ctx):
    dn = ctx.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    groups = ctx.params.get("feature_group_count", 1)
    bgroups = ctx.params.get("batch_group_count", 1)
    if bgroups == 1:
        yield (Split(lhs_spec[0]), B), (Split(out_spec[0]),)
    if groups == 1 and bgroups == 1:
        yield (B, Split(rhs_spec[0])), (Split(out_spec[1]),)
        yield (Split(lhs_spec[1]), Split(rhs_spec[1])), (P,)
    yield (P, B), (P,)
    yield (B, P), (P,)
    yield (B, B), (B,)


def _conv_local(st, ins):
    x, w = ins
    dn = st.eqn.params["dimension_numbers"]
    x = mask_padding(x, st.in_layouts[0], [dn.lhs_spec[1]], 0)
    w = mask_padding(w, st.in_layouts[1], [dn.rhs_spec[1]], 0)
    return st.eqn.primitive.bind(x, w, **st.eqn.params)


register_sbp_rule("conv_general_dilated", local=_conv_local)(_conv_sigs)
