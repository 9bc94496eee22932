"""The cost model: what a planned program costs per device, as it runs.

One object, ``CostModel``, turns a planned ``Program`` into an ``Estimate``; ``jsbp.explain``,
``auto_layouts`` and ``jsbp.flax.Strategy.auto`` read the same figures.

* **communication** = bytes each device moves / link bandwidth + a fixed latency per collective
  as the compiled program launches it: a combined collective (``_combine``) counts once, a loop
  body's collectives once per iteration (a ``while`` loop ``WHILE_TRIPS`` times);
* **compute** = matmul / convolution FLOPs of the local shards / FLOP rate, plus the bytes every
  other op reads and writes / memory bandwidth (a value computed replicated is charged on every
  device: the redundant compute a layout trades against communication);
* **memory** = the inputs' local bytes + the peak of the live intermediates, from a liveness walk
  over the planned steps in program order. XLA may reorder and fuse, so this is an estimate;
  ``measured_bytes`` reads XLA's own figure for the compiled program.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.extend import core as jcore

from ._errors import SbpError
from ._layout import Layout
from ._program import Program, subprograms, trips

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
    # s one more op takes to run inside the compiled program (each move of a conversion runs
    # one: a local slice, a zero-fill, a combined collective member's copies):
    # the step-time difference of programs with and without 100 extra slices, over 100
    # (``python benchmarks/boxing.py --op-launch``: 2.4-3.4 us on 8 simulated CPU devices)
    op_launch: float = 2.5e-6

    @property
    def latency_bytes(self) -> float:
        """One collective's latency as the bytes a device moves meanwhile (``latency`` times
        ``link_bandwidth``): the unit in which a conversion costs its bytes plus this much per
        collective."""
        return self.latency * self.link_bandwidth

    @property
    def op_bytes(self) -> float:
        """One more op's launch (``op_launch``) in the same byte-equivalents: what each move of a
        conversion costs besides the bytes it moves and its collective's latency."""
        return self.op_launch * self.link_bandwidth

    def local_seconds(self, lc) -> float:
        """Seconds one device spends in a rule's ``LocalCost``: its FLOPs at ``flop_rate``, its
        collectives' bytes at ``link_bandwidth`` and one ``latency`` each; transfers that overlap
        the FLOPs (``lc.overlapped``) cost only what the FLOPs do not hide."""
        compute = lc.flops / self.flop_rate
        comm = lc.moved_bytes / self.link_bandwidth
        both = max(compute, comm) if lc.overlapped else compute + comm
        return sum(n for _, _, n in lc.collectives) * self.latency + both


DEFAULT_COST = CostModel()


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What the cost model predicts for one planned program (all figures per device)."""

    comm_bytes: float  # moved by collectives (a loop body's once per iteration)
    collectives: (
        int  # collectives launched (a combined group once, a loop body's once per iteration)
    )
    flops: float  # matmul / convolution FLOPs of the local shards
    traffic: float  # bytes read + written by every other op on its local shards
    input_bytes: int  # the inputs' local bytes (parameters, optimizer state, batch)
    peak_bytes: int  # inputs + the peak of live intermediates
    seconds: float  # the step time the cost model predicts
    staging: float = 0.0  # bytes copied into and out of combined collectives' buffers
    compiled_collectives: int = 0  # collectives in the compiled program (what ``explain`` lists)

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


def itemsize(dtype) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # a PRNG key dtype
        return getattr(dtype, "itemsize", 8)


def local_bytes(lay: Layout, dtype) -> int:
    return math.prod(lay.local_shape) * itemsize(dtype)


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
    """(matmul FLOPs, other ops' bytes touched) of ``prog`` on one device; loop bodies count once
    per iteration (``trips``), a ``cond`` its dearest branch."""
    flops = traffic = 0.0
    for st in prog.steps:
        subs = subprograms(st)
        if subs:
            inner = mult * trips(st)
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
        lc = _local_cost(st)
        if lc is not None:
            flops += mult * lc.flops
        elif name == "dot_general":
            flops += mult * _dot_flops(st)
        elif name == "conv_general_dilated":
            flops += mult * _conv_flops(st)
        else:
            ins = sum(local_bytes(l, v.aval.dtype) for l, v in zip(st.in_layouts, st.eqn.invars))
            outs = sum(local_bytes(l, v.aval.dtype) for l, v in zip(st.out_layouts, st.eqn.outvars))
            traffic += mult * (ins + outs)
    return flops, traffic


def _local_cost(st):
    """The ``LocalCost`` of a step whose rule states one (``rules.LocalCost``), else None."""
    rule = st.rule
    if st.kind != "prim" or rule is None or rule.cost is None:
        return None
    return rule.local_cost(
        st.eqn,
        st.in_layouts[0].placement,
        [l.nd_sbp for l in st.in_layouts],
        [l.nd_sbp for l in st.out_layouts],
    )


def local_costs(prog: Program, times: int = 1):
    """(step, its ``LocalCost``, runs per step) for every step of ``prog`` whose rule states
    one, nested programs included (a loop body's once per iteration)."""
    for st in prog.steps:
        lc = _local_cost(st)
        if lc is not None:
            yield st, lc, times
        for sub in subprograms(st):
            yield from local_costs(sub, times * trips(st))


def _boxings(prog: Program, times: int = 1):
    """(boxing, dtype of the value it converts, runs per step) for every boxing of ``prog``,
    nested programs included (a loop body's once per iteration: ``trips``)."""
    for bx in prog.out_boxings:
        yield bx, prog.jaxpr.outvars[bx.operand].aval.dtype, times
    for st in prog.steps:
        for bx in st.boxings:
            yield bx, st.eqn.invars[bx.operand].aval.dtype, times
        for sub in subprograms(st):
            yield from _boxings(sub, times * trips(st))


def _comm(prog: Program) -> tuple[float, int, int, float]:
    """(bytes moved, collectives launched, collectives compiled, staging bytes) per device, a loop
    body's once per iteration (launched) or once (compiled). A combined collective (``_combine``)
    counts once, and copies its members into one buffer and back out: the full-size side of each
    member twice (a transpose to blocks-first and the concatenation, or the gathered rows and
    their reshape), the local side once."""
    nbytes, launched, compiled, staging, groups = 0.0, 0, 0, 0.0, set()
    for bx, dtype, times in _boxings(prog):
        if bx.reused:
            continue
        nbytes += times * bx.bytes_per_device
        if bx.group is not None:
            item = itemsize(dtype)
            src, dst = math.prod(bx.src.local_shape) * item, math.prod(bx.dst.local_shape) * item
            staging += times * (2 * max(src, dst) + min(src, dst))
            if bx.group in groups:
                continue
            groups.add(bx.group)
        n = 1 if bx.group is not None else len(bx.collectives)
        launched += times * n
        compiled += n
    for _, lc, times in local_costs(prog):
        nbytes += times * lc.moved_bytes
        launched += times * sum(n for _, _, n in lc.collectives)
        compiled += len(lc.collectives)
    return nbytes, launched, compiled, staging


def _var_bytes(v, lay: Layout) -> int:
    return local_bytes(lay, v.aval.dtype)


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
        boxed = sum(
            local_bytes(bx.dst, st.eqn.invars[bx.operand].aval.dtype)
            for bx in st.boxings
            if not bx.reused and bx.operand < len(st.eqn.invars)
        )
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
    comm_bytes, count, compiled, staging = _comm(prog)
    flops, traffic = _compute(prog)
    inputs = sum(_var_bytes(v, lay) for v, lay in zip(prog.jaxpr.invars, prog.in_layouts))
    peak = inputs + _intermediate_peak(prog, _updates(prog))
    hidden = 0.0  # transfers of rules' local implementations that run under their FLOPs
    for _, lc, times in local_costs(prog):
        if lc.overlapped:
            moved = lc.moved_bytes / cost.link_bandwidth
            hidden += times * min(lc.flops / cost.flop_rate, moved)
    seconds = (
        comm_bytes / cost.link_bandwidth
        - hidden
        + count * cost.latency
        + flops / cost.flop_rate
        + traffic / cost.mem_bandwidth
        + staging / cost.staging_bandwidth
    )
    return Estimate(
        comm_bytes, count, flops, traffic, int(inputs), int(peak), seconds, staging, compiled
    )


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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}


def parse_bytes(value, op: str) -> int | None:
    """``None`` / an int / ``"64MiB"`` / ``"1.5GB"`` -> bytes (``None`` stays ``None``)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    if isinstance(value, str):
        s = value.strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num) :]
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
