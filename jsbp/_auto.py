"""Automatic parallelism: choose the nd-sbp of every input of a program under a memory budget.

``auto_layouts(fn, *args, placement=..., memory_budget=...)`` plans ``fn`` with jsbp's own
planner (``_lower.plan``, used as a black box) for candidate input layouts and keeps the one
whose *estimated step time* is lowest among those whose *predicted peak bytes per device* fit the
budget. Both numbers come from the cost model (``_cost.estimate``) of the planned ``Program``.

The search is a deterministic coordinate descent: start from every input ``B`` (plus ``fixed``),
then, leaf by leaf from the largest, try each candidate nd-sbp (per placement axis ``B`` or an
even ``S(dim)``) and keep the best; repeat while something changes (at most ``sweeps`` times).
The traced program is reused, only the inference runs per candidate. ``jsbp.flax.Strategy.auto``
searches a structured space instead (data / tensor parallelism, ZeRO stages) with the same
``estimate``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from . import _sbp
from ._cost import (
    DEFAULT_COST,
    CostModel,
    Estimate,
    estimate,
    fmt_bytes,
    itemsize,
    local_bytes,
    measured_bytes,
    parse_bytes,
)
from ._errors import SbpError
from ._layout import layout_of, normalise_nd
from ._lower import plan
from ._placement import placement as Placement
from ._tensor import GlobalTensor, tensor

__all__ = ["auto_layouts", "AutoLayouts"]

NdSbp = tuple[_sbp.Sbp, ...]
B = _sbp.broadcast


# -------------------------------------------------------------------------------------------
# the core search: auto_layouts
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AutoLayouts:
    """What ``auto_layouts`` chose.

    ``layouts``: the arguments' structure with one nd-sbp (a tuple of ``Sbp``) per leaf.
    ``estimate``: the chosen plan's ``Estimate``. ``out_sbp``: the ``out_sbp`` to compile ``fn``
    with (``jsbp.jit(fn, out_sbp=result.out_sbp)``; ``None`` when not asked). ``tried``: how many
    layout assignments were planned. ``put(*args)`` lays the arguments out as chosen;
    ``measure(*args)`` compiles the step and sets the predicted peak beside the measured bytes;
    ``str(result)`` is a table of every leaf.
    """

    layouts: Any
    estimate: Estimate
    placement: Placement
    out_sbp: Any
    tried: int
    paths: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[Any]
    memory_budget: int | None
    baseline: Estimate  # every free input B (the start of the search)
    fn: Any = dataclasses.field(default=None, repr=False)

    def put(self, *args):
        """``args`` as global tensors in the chosen layouts (a global tensor is re-boxed)."""
        leaves, tree = jax.tree_util.tree_flatten(args, is_leaf=_is_global)
        nds = jax.tree_util.tree_leaves(self.layouts, is_leaf=_is_nd)
        out = []
        for x, nd in zip(leaves, nds):
            if isinstance(x, GlobalTensor):
                out.append(x.to_global(placement=self.placement, sbp=nd))
            else:
                out.append(tensor(x, placement=self.placement, sbp=nd))
        return jax.tree_util.tree_unflatten(tree, out)

    def measure(self, *args) -> dict[str, int]:
        """Predicted against measured bytes per device for ``fn(*args)`` in the chosen layouts:
        ``predicted`` (the estimate's peak), ``inputs`` (the largest per-device sum of the
        arguments' local shards, measured with ``to_local``) and XLA's figures for the compiled
        step (``measured_bytes``: compare ``in_place`` with ``predicted``). Compiles ``fn``."""
        from ._jit import jit

        put = self.put(*args)
        held = None
        for t in jax.tree_util.tree_leaves(put, is_leaf=_is_global):
            sizes = [math.prod(a.shape) * itemsize(t.dtype) for a in t.to_local()]
            held = sizes if held is None else [a + b for a, b in zip(held, sizes)]
        out = {"predicted": self.estimate.peak_bytes, "inputs": max(held or [0])}
        out.update(measured_bytes(jit(self.fn, out_sbp=self.out_sbp), *put))
        return out

    def __str__(self):
        nds = jax.tree_util.tree_leaves(self.layouts, is_leaf=_is_nd)
        rows = [
            (
                p,
                str(s),
                _sbp.nd_str(nd),
                fmt_bytes(local_bytes(layout_of(self.placement, nd, s), d)),
            )
            for p, s, nd, d in zip(self.paths, self.shapes, nds, self.dtypes)
        ]
        head = ("leaf", "shape", "sbp", "local bytes")
        w = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
        lines = [f"auto_layouts on {self.placement} ({self.tried} layout assignments planned)"]
        lines.append("  ".join(h.ljust(n) for h, n in zip(head, w)))
        lines.append("-" * len(lines[-1]))
        lines += ["  ".join(c.ljust(n) for c, n in zip(r, w)) for r in rows]
        budget = "none" if self.memory_budget is None else fmt_bytes(self.memory_budget)
        lines.append(f"chosen:   {self.estimate}; budget {budget}")
        lines.append(f"baseline: {self.baseline} (every free input B)")
        return "\n".join(lines)


def _is_global(x):
    return isinstance(x, GlobalTensor)


def _is_nd(x):
    return isinstance(x, tuple) and all(isinstance(s, _sbp.Sbp) for s in x)


def _leaf_meta(x):
    if isinstance(x, GlobalTensor):
        return tuple(x.shape), x.dtype
    if isinstance(x, jax.ShapeDtypeStruct):
        return tuple(x.shape), x.dtype
    if isinstance(x, (int, float, complex, bool)):
        return (), np.asarray(x).dtype
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return tuple(np.shape(x)), dtype


def leaf_candidates(shape, dtype, placement: Placement) -> list[NdSbp]:
    """The nd-sbps ``auto_layouts`` tries for a leaf: per axis ``B`` or ``S(dim)`` for every dim
    the axis's size divides evenly (outer axes first, ``B`` first). Keys and scalars: ``B`` only."""
    if not shape or jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return [(B,) * placement.ndim]
    per_axis = []
    for n in placement.hierarchy:
        opts = [B] + [
            _sbp.split(d) for d in range(len(shape)) if shape[d] >= n and shape[d] % n == 0
        ]
        per_axis.append(opts)
    out = []
    for nd in itertools.product(*per_axis):
        # two axes splitting one dim must leave it divisible by both together
        ok = all(
            shape[d]
            % math.prod(
                placement.hierarchy[a] for a, s in enumerate(nd) if s.is_split and s.dim == d
            )
            == 0
            for d in range(len(shape))
        )
        if ok:
            out.append(tuple(nd))
    return out


def _ways(nd, placement) -> int:
    return math.prod(n for n, s in zip(placement.hierarchy, nd) if s.is_split)


def _fixed_index(fixed, paths, n_args, arg_leaves, placement, shapes) -> dict[int, NdSbp]:
    out: dict[int, NdSbp] = {}
    for key, nd in (fixed or {}).items():
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < n_args:
                raise SbpError(
                    f"auto_layouts: fixed={{{key!r}: ...}} names argument {key}, but fn takes {n_args} "
                    "argument(s); use an argument index or a leaf path."
                )
            idx = arg_leaves[key]
        elif isinstance(key, str) and key in paths:
            idx = [paths.index(key)]
        else:
            raise SbpError(
                f"auto_layouts: fixed={{{key!r}: ...}} names no input leaf. Name a leaf by its path "
                f"(one of {paths[:12]}{' ...' if len(paths) > 12 else ''}) or an argument by its index."
            )
        for i in idx:
            out[i] = normalise_nd(nd, shapes[i], placement, op=f"auto_layouts(fixed[{key!r}])")
    return out


def auto_layouts(
    fn: Callable,
    *args,
    placement: Placement,
    memory_budget: int | str | None = None,
    fixed: Mapping | None = None,
    out_sbp: Callable | Any = None,
    cost_model: CostModel = DEFAULT_COST,
    sweeps: int = 2,
) -> AutoLayouts:
    """Choose the nd-sbp of every input leaf of ``fn(*args)`` on ``placement``.

    ``args``: the arguments as arrays, ``jax.ShapeDtypeStruct`` s or global tensors (only shapes
    and dtypes are read). ``memory_budget``: bytes per device (an int or ``"64MiB"``) that the
    predicted peak — inputs + live intermediates — must fit; ``None``: no limit. ``fixed``: leaves
    whose layout is given, ``{path or argument index: nd-sbp}``, paths as ``jax.tree_util.keystr``
    writes them (``"[0]['w']"``). ``out_sbp``: what ``jsbp.jit(fn, out_sbp=...)`` gets, or a
    function of the chosen layouts (the arguments' structure) returning it — a train step returns
    its state in the layouts it came in: ``out_sbp=lambda lay: (lay[0], lay[1], None)``.

    Returns an ``AutoLayouts``: ``.layouts`` (the arguments' structure, one nd-sbp per leaf),
    ``.estimate`` (predicted step time and peak bytes), ``.put(*args)``, ``.out_sbp``,
    ``.measure(*args)`` (predicted against measured bytes per device).

    >>> r = jsbp.auto_layouts(step, params, opt, batch, placement=p, memory_budget="64MiB")  # doctest: +SKIP
    >>> f = jsbp.jit(step, out_sbp=r.out_sbp); f(*r.put(params, opt, batch))                  # doctest: +SKIP

    Raises ``SbpError`` when no assignment fits the budget (naming the smallest peak found) and
    for a ``fixed`` key that names no leaf.
    """
    from ._jit import _dtype, _out_nd_list, _trace

    if not isinstance(placement, Placement):
        raise SbpError(f"auto_layouts: placement must be a jsbp.placement, got {placement!r}.")
    budget = parse_bytes(memory_budget, "auto_layouts")
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(args, is_leaf=_is_global)
    if not path_leaves:
        raise SbpError("auto_layouts: fn has no array arguments to lay out.")
    paths = [jax.tree_util.keystr(p) for p, _ in path_leaves]
    metas = [_leaf_meta(x) for _, x in path_leaves]
    shapes = [m[0] for m in metas]
    dtypes = [_dtype(m[1]) for m in metas]
    arg_leaves = [
        [i for i, (p, _) in enumerate(path_leaves) if p[0].idx == k] for k in range(len(args))
    ]
    fixed_nd = _fixed_index(fixed, paths, len(args), arg_leaves, placement, shapes)
    total = sum(math.prod(s) * itemsize(d) for s, d in zip(shapes, dtypes))
    if budget is not None and budget < total / placement.size:
        raise SbpError(
            f"auto_layouts: memory_budget={fmt_bytes(budget)} per device is less than the inputs alone "
            f"need split evenly over the {placement.size} devices of {placement} ({fmt_bytes(total)} / "
            f"{placement.size} = {fmt_bytes(total / placement.size)}), so no layout fits. Raise the budget "
            "to at least that (plus room for intermediates) or use more devices."
        )

    b_lays = [layout_of(placement, (B,) * placement.ndim, s) for s in shapes]
    closed, _, _ = _trace(fn, treedef, (), b_lays, dtypes, placement)
    out_avals = closed.out_avals

    def plan_of(nds):
        lays = [layout_of(placement, nd, s) for nd, s in zip(nds, shapes)]
        spec = (
            out_sbp(jax.tree_util.tree_unflatten(treedef, list(nds)))
            if callable(out_sbp)
            else out_sbp
        )
        spec = _flat_out_sbp(spec, len(out_avals))
        out_nd = _out_nd_list(spec, len(out_avals), placement, [a.shape for a in out_avals])
        prog = plan(placement, closed.jaxpr, closed.consts, lays, out_nd)
        return estimate(prog, cost_model), spec

    cache: dict = {}

    def score(nds):
        nds = tuple(nds)
        hit = cache.get(nds)
        if hit is None:
            est, spec = plan_of(nds)
            over = 0 if budget is None else max(0, est.peak_bytes - budget)
            hit = cache[nds] = ((over, est.seconds, est.peak_bytes), est, spec)
        return hit

    cands = [
        [fixed_nd[i]] if i in fixed_nd else leaf_candidates(s, d, placement)
        for i, (s, d) in enumerate(zip(shapes, dtypes))
    ]
    order = sorted(
        range(len(shapes)), key=lambda i: (-math.prod(shapes[i]) * itemsize(dtypes[i]), i)
    )
    # moves: a group of leaves of one shape and dtype at once (a parameter and its optimizer
    # moments), largest first, then each leaf alone
    groups: dict = {}
    for i in order:
        if len(cands[i]) > 1:
            groups.setdefault((shapes[i], str(dtypes[i])), []).append(i)
    moves = [g for g in groups.values() if len(g) > 1] + [[i] for i in order if len(cands[i]) > 1]

    def descend(cur, key=lambda sc: sc):
        for _ in range(max(1, sweeps)):
            changed = False
            for idx in moves:
                best_nds, best = [cur[i] for i in idx], key(score(cur)[0])
                for nd in cands[idx[0]]:
                    if all(cur[i] == nd for i in idx):
                        continue
                    trial = list(cur)
                    for i in idx:
                        trial[i] = nd
                    s = key(score(trial)[0])
                    if s < best:
                        best_nds, best = [nd] * len(idx), s
                if any(cur[i] != nd for i, nd in zip(idx, best_nds)):
                    for i, nd in zip(idx, best_nds):
                        cur[i] = nd
                    changed = True
            if not changed:
                break
        return cur

    # two seeds: every free leaf B (no communication, most memory), and every free leaf split as
    # finely as its candidates allow (least memory); under a budget also a descent that ignores
    # it (the fastest plan may fit). The best assignment planned on any path wins.
    start = [fixed_nd.get(i, (B,) * placement.ndim) for i in range(len(shapes))]
    baseline = score(start)[1]
    finest = [
        fixed_nd.get(i, max(c, key=lambda nd: (_ways(nd, placement), -cands[i].index(nd))))
        for i, c in enumerate(cands)
    ]
    descend(list(start))
    descend(finest)
    if budget is not None:
        descend(list(start), key=lambda sc: sc[1:])
    cur = list(min(cache, key=lambda nds: cache[nds][0]))
    (over, _, peak), est, spec = score(cur)
    if over:
        raise SbpError(
            f"auto_layouts: no layout of fn's inputs on {placement} fits memory_budget="
            f"{fmt_bytes(budget)} per device: the smallest predicted peak found is {fmt_bytes(peak)} "
            f"({fmt_bytes(est.input_bytes)} inputs + {fmt_bytes(est.activation_bytes)} intermediates). "
            "Raise the budget to at least that, use more devices, or shrink the batch."
        )
    return AutoLayouts(
        jax.tree_util.tree_unflatten(treedef, cur),
        est,
        placement,
        spec,
        len(cache),
        paths,
        shapes,
        dtypes,
        budget,
        baseline,
        fn,
    )


def _flat_out_sbp(spec, n_out):
    """An ``out_sbp`` pytree (``None`` / nd-sbp / string leaves) as one entry per output."""
    if spec is None:
        return None
    leaves = jax.tree_util.tree_leaves(
        spec, is_leaf=lambda s: s is None or isinstance(s, (str, _sbp.Sbp)) or _is_nd(s)
    )
    if len(leaves) == n_out:
        return list(leaves)
    return spec  # one nd-sbp for every output, or an error from jsbp.jit's own check
