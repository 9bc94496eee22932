"""``jsbp.explain``: the plan of a consistent-view function, one row per equation."""

from __future__ import annotations

import dataclasses
from collections import Counter

from . import _hooks, _sbp
from ._cost import estimate, local_costs
from ._program import iter_steps, subprograms
from .debug._collectives import COLLECTIVES

__all__ = ["explain", "Plan", "PlanRow", "BoxingRow"]


@dataclasses.dataclass(frozen=True)
class BoxingRow:
    """One inserted conversion: ``operand`` goes ``src -> dst`` with these collectives."""

    operand: int
    src: str
    dst: str
    collectives: tuple[str, ...]  # one entry per collective, e.g. ("all-gather",)
    axes: tuple[tuple[str, ...], ...]  # the placement axes of each move
    bytes_per_device: float
    shape: tuple[int, ...]
    reused: bool = False
    combined: int | None = None  # part of combined collective number ``combined`` (counted once)
    via: bool = False  # starts from the value's earlier conversion to ``src``, not from the value

    def __str__(self):
        kinds = "+".join(self.collectives) if self.collectives else "local"
        if self.reused:
            kinds = "reused"
        if self.combined is not None:
            kinds += f", combined #{self.combined}"
        if self.via:
            kinds += f", from the {self.src} copy"
        return (
            f"#{self.operand} {self.src}->{self.dst} [{kinds}] {_fmt_bytes(self.bytes_per_device)}"
        )


@dataclasses.dataclass(frozen=True)
class PlanRow:
    depth: int
    primitive: str
    inputs: tuple[str, ...]  # nd-sbp of each operand as it arrives
    signature: str  # "(S(0)), (B) -> (S(0))": the layouts the op runs on
    outputs: tuple[str, ...]
    boxings: tuple[BoxingRow, ...]
    note: str = ""  # "no rule: replicated" for a primitive without an SBP rule
    # collectives the op's own local implementation runs (``rules.LocalCost``: a ring)
    collectives: tuple[str, ...] = ()
    own_bytes: float = 0.0  # what those move per device (each one's bytes times its runs)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def _boxing_row(bx) -> BoxingRow:
    names = bx.src.placement.axis_names
    return BoxingRow(
        bx.operand,
        _sbp.nd_str(bx.src.nd_sbp),
        _sbp.nd_str(bx.dst.nd_sbp),
        tuple(bx.collectives),
        tuple(tuple(names[a] for a in m.axes) for m in bx.moves),
        float(bx.bytes_per_device),
        tuple(bx.src.shape),
        bx.reused,
        bx.group,
        bx.via,
    )


@dataclasses.dataclass
class Plan:
    """The plan: ``rows`` (one per equation), ``output_boxings``, totals, text and HTML forms."""

    rows: list[PlanRow]
    output_boxings: list[BoxingRow]
    placement: object
    # the cost model's figures (``jsbp._cost.Estimate``): predicted step time and peak bytes per
    # device (inputs + live intermediates); ``jsbp.debug.measured_bytes`` gives XLA's
    estimate: object = None

    def boxings(self) -> list[BoxingRow]:
        return [b for r in self.rows for b in r.boxings] + list(self.output_boxings)

    def collectives(self) -> dict[str, int]:
        """Collectives the plan inserts, by kind (comparable with ``debug.count_collectives``):
        the boxings of one combined collective count once, as the compiled program runs them."""
        out = dict.fromkeys(COLLECTIVES, 0)
        seen = set()
        for b in self.boxings():
            if b.combined is not None:
                if b.combined in seen:
                    continue
                seen.add(b.combined)
            for c in b.collectives:
                out[c] += 1
        for r in self.rows:
            for c in r.collectives:
                out[c] += 1
        return out

    @property
    def total_bytes_per_device(self) -> float:
        """Bytes per device the boxings and the ops' own collectives move (each once)."""
        return sum(b.bytes_per_device for b in self.boxings()) + sum(r.own_bytes for r in self.rows)

    def __str__(self):
        lines = [f"plan on {self.placement}"]
        header = f"{'op':<28} {'inputs':<34} {'signature':<40} boxing"
        lines.append(header)
        lines.append("-" * len(header))
        for r in self.rows:
            name = "  " * r.depth + r.primitive + (f" [{r.note}]" if r.note else "")
            own = ", ".join(f"{n} {k}" for k, n in Counter(r.collectives).items())
            own = [f"[own: {own}] {_fmt_bytes(r.own_bytes)}"] if own else []
            box = "; ".join([str(b) for b in r.boxings] + own)
            lines.append(f"{name:<28} {', '.join(r.inputs):<34} {r.signature:<40} {box}")
        for b in self.output_boxings:
            lines.append(f"{'(output)':<28} {b.src:<34} {'-> ' + b.dst:<40} {b}")
        c = {k: v for k, v in self.collectives().items() if v}
        lines.append(
            f"total: {sum(c.values())} collective(s) {c if c else ''}, "
            f"{_fmt_bytes(self.total_bytes_per_device)} per device"
        )
        if self.estimate is not None:
            e = self.estimate
            lines.append(
                f"predicted per device: peak {_fmt_bytes(e.peak_bytes)} (inputs {_fmt_bytes(e.input_bytes)} + "
                f"live intermediates {_fmt_bytes(e.activation_bytes)}), step {e.seconds * 1e3:.2f} ms (cost model)"
            )
        return "\n".join(lines)

    def _repr_html_(self):
        return _hooks.render_html("plan", self)  # a plain preformatted table without jsbp.viz


def plan_of_program(prog, placement) -> Plan:
    rows = []
    local = {id(st): lc for st, lc, _ in local_costs(prog)}
    for depth, st in iter_steps(prog):
        arriving = list(st.in_layouts)
        for bx in reversed(st.boxings):  # an operand's first boxing starts from what arrives
            arriving[bx.operand] = bx.src
        ins = tuple(_sbp.nd_str(l.nd_sbp) for l in arriving)
        sig = (
            ", ".join(_sbp.nd_str(l.nd_sbp) for l in st.in_layouts)
            + " -> "
            + ", ".join(_sbp.nd_str(l.nd_sbp) for l in st.out_layouts)
        )
        lc = local.get(id(st))
        note = "no rule: replicated" if st.rule is not None and st.rule.fallback else ""
        rows.append(
            PlanRow(
                depth,
                st.eqn.primitive.name,
                ins,
                sig,
                tuple(_sbp.nd_str(l.nd_sbp) for l in st.out_layouts),
                tuple(_boxing_row(b) for b in st.boxings),
                lc.note if lc is not None else note,
                tuple(k for k, _, _ in lc.collectives) if lc is not None else (),
                lc.moved_bytes if lc is not None else 0.0,
            )
        )
        for s in subprograms(st):
            for b in s.out_boxings:
                rows.append(
                    PlanRow(
                        depth + 1,
                        "(carry/branch out)",
                        (b and _sbp.nd_str(b.src.nd_sbp),),
                        "",
                        (_sbp.nd_str(b.dst.nd_sbp),),
                        (_boxing_row(b),),
                    )
                )

    return Plan(rows, [_boxing_row(b) for b in prog.out_boxings], placement, estimate(prog))


def explain(fn, *args) -> Plan:
    """The plan jsbp makes for ``fn(*args)``: per equation the operands' nd-sbps, the chosen
    signature and the boxing inserted (collectives, axes, bytes per device). ``str(plan)`` is a
    text table; in Jupyter the plan renders as HTML. ``plan.collectives()`` matches
    ``jsbp.debug.count_collectives(jsbp.jit(fn), *args)``.
    """
    from ._jit import JitFunction, jit

    jf = fn if isinstance(fn, JitFunction) else jit(fn)
    entry = jf.lower_program(*args)
    return plan_of_program(entry.program, entry.placement)
