"""Automatic parallelism: choose the nd-sbp of every input of a program under a memory budget.

``auto_layouts(fn, *args, placement=..., memory_budget=...)`` plans ``fn`` with jsbp's own
planner (``_compiler.infer``, used as a black box) for candidate input layouts and keeps the one
whose *estimated step time* is lowest among those whose *predicted peak bytes per device* fit the
budget. Both numbers come from the planned ``Program`` (``estimate``):

* **time** = collectives (bytes each device moves / link bandwidth + a fixed latency per
  collective; a combined group counts once) + compute (matmul / convolution FLOPs of the local
  shards / FLOP rate, plus the bytes every other op reads and writes / memory bandwidth). A value
  computed replicated is charged on every device: that is the redundant compute a layout choice
  trades against communication. The rates are a ``CostModel`` (defaults: simulated CPU devices).
* **memory** = the inputs' local bytes (held by the caller for the whole step) + the peak of the
  live intermediates, from a liveness walk over the planned steps in program order: a value is
  live from the step that makes it to its last use (forward residuals of a train step live until
  the backward reads them), a boxing's result and a nested body's own peak are live during their
  step. XLA may reorder and fuse, so this is an estimate; ``measured_bytes`` reads XLA's own
  figure for the compiled program.

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
from jax.extend import core as jcore

from . import _sbp
from ._compiler import Program, infer, subprograms
from ._errors import SbpError
from ._layout import Layout, layout_of, normalise_nd
from ._placement import placement as Placement
from ._tensor import GlobalTensor, tensor

__all__ = ["auto_layouts", "AutoLayouts", "CostModel", "Estimate", "estimate", "measured_bytes"]

NdSbp = tuple[_sbp.Sbp, ...]
B = _sbp.broadcast


# -------------------------------------------------------------------------------------------
# the cost model
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Rates that turn a planned program into an estimated step time (per device).

    The defaults are fitted (non-negative least squares on relative error, ``python
    benchmarks/auto.py --fit``) to the measured step times of the six hand-picked strategies on
    three model shapes, on 8 simulated CPU devices sharing a 2-core machine; there the devices
    share the cores and XLA fuses elementwise ops, so the rates are effective ones, not hardware
    peaks. On GPUs raise ``flop_rate`` / ``mem_bandwidth`` / ``link_bandwidth`` by orders of
    magnitude and lower ``latency`` to ~15 us (or fit them the same way)."""

    link_bandwidth: float = 2.0e8  # bytes / s a device sends or receives in a collective
    latency: float = 2.8e-4  # s per collective launch
    flop_rate: float = 1.1e10  # matmul / convolution FLOP / s per device
    mem_bandwidth: float = 2.5e10  # bytes / s per device that every other op reads + writes
    # bytes / s copied into / out of a combined collective's buffer (plain copies, the rate of
    # other memory-bound ops; not fitted)
    staging_bandwidth: float = 2.5e10


DEFAULT_COST = CostModel()


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one planned program (all figures per device)."""

    comm_bytes: float  # moved by collectives
    collectives: int  # collectives launched (a combined group counts once)
    flops: float  # matmul / convolution FLOPs of the local shards
    traffic: float  # bytes read + written by every other op on its local shards
    input_bytes: int  # the inputs' local bytes (parameters, optimizer state, batch)
    peak_bytes: int  # inputs + the peak of live intermediates
    seconds: float  # the step time the cost model predicts
    staging: float = 0.0  # bytes copied into and out of combined collectives' buffers

    @property
    def activation_bytes(self) -> int:
        return self.peak_bytes - self.input_bytes

    def __str__(self):
        return (
            f"{self.seconds * 1e3:.2f} ms predicted ({self.collectives} collectives, "
            f"{fmt_bytes(self.comm_bytes)} moved, {self.flops / 1e6:.1f} MFLOP), peak "
            f"{fmt_bytes(self.peak_bytes)} per device ({fmt_bytes(self.input_bytes)} inputs)"
        )


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"  # pragma: no cover


def _itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # a PRNG key dtype
        return getattr(dtype, "itemsize", 8)


def _local_bytes(lay: Layout, dtype) -> int:
    return math.prod(lay.local_shape) * _itemsize(dtype)


def _dot_flops(st) -> float:
    (lc, _), _ = st.eqn.params["dimension_numbers"]
    lhs = st.in_layouts[0].local_shape
    return 2.0 * math.prod(st.out_layouts[0].local_shape) * math.prod(lhs[d] for d in lc)


def _conv_flops(st) -> float:
    rhs = st.in_layouts[1].local_shape
    out_feature = st.eqn.params["dimension_numbers"].rhs_spec[0]
    per_out = math.prod(rhs) // max(rhs[out_feature], 1)
    return 2.0 * math.prod(st.out_layouts[0].local_shape) * per_out


def _compute(prog: Program, mult: float = 1.0) -> tuple[float, float]:
    """(matmul FLOPs, other ops' bytes touched) of ``prog`` on one device; scan bodies count
    ``length`` times."""
    flops = traffic = 0.0
    for st in prog.steps:
        subs = subprograms(st)
        if subs:
            inner = mult * (st.eqn.params.get("length", 1) if st.kind == "scan" else 1)
            if st.kind == "cond":  # one branch runs: charge the dearest
                parts = [_compute(s, inner) for s in subs]
                f, t = max(parts, key=lambda p: p[0] + p[1])
            else:
                f = t = 0.0
                for s in subs:
                    fs, ts = _compute(s, inner)
                    f, t = f + fs, t + ts
            flops, traffic = flops + f, traffic + t
            continue
        if st.kind != "prim":
            continue
        name = st.eqn.primitive.name
        if name == "dot_general":
            flops += mult * _dot_flops(st)
        elif name == "conv_general_dilated":
            flops += mult * _conv_flops(st)
        else:
            ins = sum(_local_bytes(l, v.aval.dtype) for l, v in zip(st.in_layouts, st.eqn.invars))
            outs = sum(_local_bytes(l, v.aval.dtype) for l, v in zip(st.out_layouts, st.eqn.outvars))
            traffic += mult * (ins + outs)
    return flops, traffic


def _boxings(prog: Program):
    """Every boxing of ``prog`` (nested programs included) with the dtype of the value it boxes."""
    for bx in prog.out_boxings:
        yield bx, prog.jaxpr.outvars[bx.operand].aval.dtype
    for st in prog.steps:
        for bx in st.boxings:
            yield bx, st.eqn.invars[bx.operand].aval.dtype
        for s in subprograms(st):
            yield from _boxings(s)


def _comm(prog: Program) -> tuple[float, int, float]:
    """(bytes moved, collectives launched, staging bytes) per device. A combined collective
    (``_combine``) copies its members into one buffer and back out: the full-size side of each
    member twice (a transpose to blocks-first and the concatenation, or the gathered rows and
    their reshape), the local side once."""
    nbytes, count, staging, groups = 0.0, 0, 0.0, set()
    for bx, dtype in _boxings(prog):
        if bx.reused:
            continue
        nbytes += bx.bytes_per_device
        if bx.group is not None:
            item = _itemsize(dtype)
            src, dst = math.prod(bx.src.local_shape) * item, math.prod(bx.dst.local_shape) * item
            staging += 2 * max(src, dst) + min(src, dst)
            if bx.group in groups:
                continue
            groups.add(bx.group)
        count += len(bx.collectives)
    return nbytes, count, staging


def _var_bytes(v, lay: Layout) -> int:
    return _local_bytes(lay, v.aval.dtype)


def _intermediate_peak(prog: Program, in_place=frozenset()) -> int:
    """Peak bytes of the values ``prog`` makes (its inputs excluded), walking its steps in order;
    the values in ``in_place`` take no room (written over an input they replace)."""
    steps = prog.steps
    end = len(steps)
    last: dict = {}
    for i, st in enumerate(steps):
        for v in st.eqn.invars:
            if not isinstance(v, jcore.Literal):
                last[v] = i
    for v in prog.jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            last[v] = end
    live, peak = 0, 0
    sizes: dict = {}
    for i, st in enumerate(steps):
        boxed = sum(_local_bytes(bx.dst, st.eqn.invars[bx.operand].aval.dtype)
                    for bx in st.boxings if not bx.reused and bx.operand < len(st.eqn.invars))
        made = 0
        for v, lay in zip(st.eqn.outvars, st.out_layouts):
            n = 0 if v in in_place else _var_bytes(v, lay)
            made += n
            if last.get(v, -1) > i:
                sizes[v] = n
        inner = max((_intermediate_peak(s) for s in subprograms(st)), default=0)
        if st.kind in ("scan", "while"):  # the stacked outputs stay while each step's body runs
            peak = max(peak, live + boxed + made + inner)
        else:  # a call or a cond runs its body once: its outputs are among the body's peak
            peak = max(peak, live + boxed + max(made, inner))
        live += sum(sizes.get(v, 0) for v in st.eqn.outvars)
        for v in st.eqn.invars:
            if not isinstance(v, jcore.Literal) and last.get(v) == i and v in sizes:
                live -= sizes.pop(v)
    return max(peak, live)


def _updates(prog: Program) -> frozenset:
    """Outputs that replace an input of the same layout and dtype (a train step's new parameters
    and optimizer state): the step updates its state in place, as with donated buffers."""
    free: dict = {}
    for v, lay in zip(prog.jaxpr.invars, prog.in_layouts):
        free.setdefault((lay, str(v.aval.dtype)), []).append(v)
    out = set()
    for v, lay in zip(prog.jaxpr.outvars, prog.out_layouts):
        if isinstance(v, jcore.Literal) or v in prog.jaxpr.invars:
            continue
        pool = free.get((lay, str(v.aval.dtype)))
        if pool:
            pool.pop()
            out.add(v)
    return frozenset(out)


def estimate(prog: Program, cost: CostModel = DEFAULT_COST) -> Estimate:
    """The cost model's figures for a planned program (see the module docstring)."""
    comm_bytes, count, staging = _comm(prog)
    flops, traffic = _compute(prog)
    inputs = sum(_var_bytes(v, lay) for v, lay in zip(prog.jaxpr.invars, prog.in_layouts))
    peak = inputs + _intermediate_peak(prog, _updates(prog))
    seconds = (comm_bytes / cost.link_bandwidth + count * cost.latency + flops / cost.flop_rate
               + traffic / cost.mem_bandwidth + staging / cost.staging_bandwidth)
    return Estimate(comm_bytes, count, flops, traffic, int(inputs), int(peak), seconds, staging)


def measured_bytes(fn, *args) -> dict[str, int]:
    """XLA's memory figures for the compiled per-device program of ``fn(*args)`` (``fn`` a
    ``jsbp.jit`` function), in bytes per device: ``arguments``, ``outputs``, ``temporaries``,
    ``peak`` (their sum: the step as compiled, a new copy of the state beside the old) and
    ``in_place`` (arguments + temporaries: the step with its outputs written over donated
    inputs, which is what ``estimate`` predicts). Compiles, runs nothing."""
    stats = fn.lower(*args).compile().memory_analysis()
    if stats is None:  # pragma: no cover - a backend without memory analysis
        return {}
    out = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
    }
    out["peak"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    # the same step with its state updated in place (outputs written over donated inputs): what
    # ``estimate``'s peak predicts
    out["in_place"] = out["arguments"] + out["temporaries"]
    return out


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
            sizes = [math.prod(a.shape) * _itemsize(t.dtype) for a in t.to_local()]
            held = sizes if held is None else [a + b for a, b in zip(held, sizes)]
        out = {"predicted": self.estimate.peak_bytes, "inputs": max(held or [0])}
        out.update(measured_bytes(jit(self.fn, out_sbp=self.out_sbp), *put))
        return out

    def __str__(self):
        nds = jax.tree_util.tree_leaves(self.layouts, is_leaf=_is_nd)
        rows = [
            (p, str(s), _sbp.nd_str(nd), fmt_bytes(_local_bytes(layout_of(self.placement, nd, s), d)))
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
        opts = [B] + [_sbp.split(d) for d in range(len(shape)) if shape[d] >= n and shape[d] % n == 0]
        per_axis.append(opts)
    out = []
    for nd in itertools.product(*per_axis):
        # two axes splitting one dim must leave it divisible by both together
        ok = all(shape[d] % math.prod(placement.hierarchy[a] for a, s in enumerate(nd)
                                      if s.is_split and s.dim == d) == 0
                 for d in range(len(shape)))
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
    arg_leaves = [[i for i, (p, _) in enumerate(path_leaves) if p[0].idx == k] for k in range(len(args))]
    fixed_nd = _fixed_index(fixed, paths, len(args), arg_leaves, placement, shapes)
    total = sum(math.prod(s) * _itemsize(d) for s, d in zip(shapes, dtypes))
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

    def plan(nds):
        lays = [layout_of(placement, nd, s) for nd, s in zip(nds, shapes)]
        spec = out_sbp(jax.tree_util.tree_unflatten(treedef, list(nds))) if callable(out_sbp) else out_sbp
        spec = _flat_out_sbp(spec, len(out_avals))
        out_nd = _out_nd_list(spec, len(out_avals), placement, [a.shape for a in out_avals])
        prog = infer(placement, closed.jaxpr, closed.consts, lays, out_nd)
        return estimate(prog, cost_model), spec

    cache: dict = {}

    def score(nds):
        nds = tuple(nds)
        hit = cache.get(nds)
        if hit is None:
            est, spec = plan(nds)
            over = 0 if budget is None else max(0, est.peak_bytes - budget)
            hit = cache[nds] = ((over, est.seconds, est.peak_bytes), est, spec)
        return hit

    cands = [[fixed_nd[i]] if i in fixed_nd else leaf_candidates(s, d, placement)
             for i, (s, d) in enumerate(zip(shapes, dtypes))]
    order = sorted(range(len(shapes)), key=lambda i: (-math.prod(shapes[i]) * _itemsize(dtypes[i]), i))
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
    finest = [fixed_nd.get(i, max(c, key=lambda nd: (_ways(nd, placement), -cands[i].index(nd))))
              for i, c in enumerate(cands)]
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
        jax.tree_util.tree_unflatten(treedef, cur), est, placement, spec, len(cache), paths, shapes,
        dtypes, budget, baseline, fn,
    )


def _flat_out_sbp(spec, n_out):
    """An ``out_sbp`` pytree (``None`` / nd-sbp / string leaves) as one entry per output."""
    if spec is None:
        return None
    leaves = jax.tree_util.tree_leaves(
        spec, is_leaf=lambda s: s is None or isinstance(s, (str, _sbp.Sbp)) or _is_nd(s))
    if len(leaves) == n_out:
        return list(leaves)
    return spec  # one nd-sbp for every output, or an error from jsbp.jit's own check


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3}


def parse_bytes(value, op: str) -> int | None:
    """``None`` / an int / ``"64MiB"`` / ``"1.5GB"`` -> bytes (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        s = value.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):]
        try:
            n = float(num)
        except ValueError:
            n = -1.0
        if unit in _UNITS and n > 0:
            return int(n * _UNITS[unit])
    raise SbpError(
        f"{op}: memory_budget={value!r} is not a positive number of bytes; pass an int or a string "
        "such as '64MiB' or '2GB'."
    )
