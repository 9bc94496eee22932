"""dot_general and conv: the matmul signature table of OneFlow / Megatron; the decompositions
and solves of ``jax.lax.linalg`` (batch dims keep their splits).

(S(0), B) -> S(0); (B, S(1)) -> S(1); (S(1), S(0)) -> P; (P, B) -> P; (B, P) -> P; (B, B) -> B;
batch dims split together.
"""

from __future__ import annotations

import math

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
    total = math.prod(ctx.hierarchy)
    if bgroups == 1:
        yield (Split(lhs_spec[0]), B), (Split(out_spec[0]),)
    if groups == 1 and bgroups == 1:
        yield (B, Split(rhs_spec[0])), (Split(out_spec[1]),)
    if groups == 1:
        # contraction over the input features (with batch groups too: the kernel gradient of a
        # grouped conv contracts over the batch, which sits in the lhs feature dim)
        yield (Split(lhs_spec[1]), Split(rhs_spec[1])), (P,)
    # groups aligned with blocks: a device holding whole feature groups (the lhs features and the
    # kernel's output features of those groups) computes their output features alone
    if groups > 1 and groups % total == 0:
        yield (Split(lhs_spec[1]), Split(rhs_spec[0])), (Split(out_spec[1]),)
    # likewise whole batch groups (lhs batch dim) with their output features
    if bgroups > 1 and bgroups % total == 0:
        yield (Split(lhs_spec[0]), Split(rhs_spec[0])), (Split(out_spec[1]),)
    yield (P, B), (P,)
    yield (B, P), (P,)
    yield (B, B), (B,)


def _conv_local(st, ins):
    x, w = ins
    params = dict(st.eqn.params)
    dn = params["dimension_numbers"]
    lay = st.in_layouts[0]
    if params.get("feature_group_count", 1) > 1 and lay.splitters[dn.lhs_spec[1]]:
        # a split of whole groups: this device holds (local C / C) of them
        c = dn.lhs_spec[1]
        params["feature_group_count"] = (
            params["feature_group_count"] * lay.local_shape[c] // lay.shape[c]
        )
    else:
        x = mask_padding(x, lay, [dn.lhs_spec[1]], 0)
        w = mask_padding(w, st.in_layouts[1], [dn.rhs_spec[1]], 0)
    if params.get("batch_group_count", 1) > 1 and lay.splitters[dn.lhs_spec[0]]:
        n = dn.lhs_spec[0]
        params["batch_group_count"] = (
            params["batch_group_count"] * lay.local_shape[n] // lay.shape[n]
        )
    return st.eqn.primitive.bind(x, w, **params)


register_sbp_rule("conv_general_dilated", local=_conv_local)(_conv_sigs)


# -- decompositions and solves (jax.lax.linalg) -----------------------------------------------------
# The core rank of each operand (the trailing matrix / vector dims); every leading dim is a batch
# dim that all operands and results share, and keeps its split. The core dims are taken whole (B).
# fmt: off
CORE_RANKS = {
    "cholesky": (2,), "eig": (2,), "eigh": (2,), "hessenberg": (2,), "householder_product": (2, 1),
    "ormqr": (2, 1, 2), "lu": (2,), "lu_pivots_to_permutation": (1,), "geqrf": (2,),
    "geqp3": (2, 1), "qr": (2,), "schur": (2,), "svd": (2,), "symmetric_product": (2, 2),
    "triangular_solve": (2, 2), "tridiagonal": (2,), "tridiagonal_solve": (1, 1, 1, 2),
}
# fmt: on


def _batch_dims(ctx):
    return len(ctx.in_shapes[0]) - CORE_RANKS[ctx.primitive.name][0]


@register_sbp_rule(*CORE_RANKS)
def _linalg(ctx):
    n_in, n_out = len(ctx.in_avals), len(ctx.out_avals)
    nb = _batch_dims(ctx)
    for d in range(nb):
        yield (Split(d),) * n_in, (Split(d),) * n_out
    yield (B,) * n_in, (B,) * n_out
    name = ctx.primitive.name
    if name == "triangular_solve":
        # a x = b (left side): the columns of b are solved independently; x a = b: the rows
        left = ctx.params["left_side"]
        d = nb + 1 if left else nb
        yield (B, Split(d)), (Split(d),)
        yield (B, P), (P,)  # linear in b
    elif name == "tridiagonal_solve":
        yield (B, B, B, Split(nb + 1)), (Split(nb + 1),)  # the columns of b
        yield (B, B, B, P), (P,)


@register_sbp_rule("cholesky_update")
def _cholesky_update(ctx):
    yield (B, B), (B,)
