"""A planned program: each equation of a jaxpr with the layouts it runs on and the boxings of its
operands (``Step``), nested programs for calls, loop bodies and branches (``Program``).

The planner (``_lower.plan``) makes one; the emitter (``_emit.run_program``) runs it inside
one ``shard_map``; ``jsbp.explain``, the cost model (``_cost``) and ``auto_layouts`` read it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._boxing import Move
from ._layout import Layout


@dataclasses.dataclass
class Boxing:
    """The conversion of operand ``operand`` of a step (or of output ``operand`` of a program)
    from ``src`` to ``dst``: the boxing planner's ``moves``, one collective or local move each."""

    operand: int
    src: Layout
    dst: Layout
    moves: tuple[Move, ...]
    reused: bool = (
        False  # the same value was already boxed to ``dst`` earlier: no new communication
    )
    via: bool = (
        False  # converts an earlier conversion of the value (to ``src``), not the value itself
    )
    group: int | None = None  # runs inside combined collective ``group`` (``_combine``)

    @property
    def collectives(self) -> list[str]:
        return [] if self.reused else [m.collective for m in self.moves if m.collective]

    @property
    def bytes_per_device(self) -> float:
        return 0.0 if self.reused else sum(m.bytes_per_device for m in self.moves)


@dataclasses.dataclass
class Step:
    """One equation of the program with its chosen signature and the boxing of its inputs."""

    eqn: Any
    in_layouts: list[Layout]  # the layouts the op runs on (after boxing)
    out_layouts: list[Layout]
    boxings: list[Boxing]
    rule: Any = None
    sub: Any = None  # for call-like / control-flow: nested Program(s) and extra data
    kind: str = "prim"  # prim | call | scan | while | cond | annotate | linear_solve


@dataclasses.dataclass
class Program:
    """A jaxpr with the layouts of its inputs and outputs, one ``Step`` per equation, and the
    conversions of its outputs to the layouts asked of them."""

    jaxpr: Any
    consts: list
    in_layouts: list[Layout]
    steps: list[Step]
    out_layouts: list[Layout]
    out_boxings: list[Boxing]  # boxing of outputs to requested layouts (may be empty)
    # value -> the layout its readers are served from (``_Inference.hubs``: the global planner's)
    hubs: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    # the order of the top-level steps and combined collectives (``_combine``); None: step by step
    order: list | None = dataclasses.field(default=None, repr=False, compare=False)


def scan_counts(params) -> tuple[int, int]:
    """How many operands of a ``scan`` equation are constants and how many the carry: the
    ``num_consts`` / ``num_carry`` parameters up to JAX 0.10; from 0.11 the flat tree ``ft_in``
    of (constants, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


WHILE_TRIPS = 16
"""The trip count the planner and the cost model assume for a ``while`` loop (unknown before it
runs): a loop body's values, work and conversions count this many times."""


def subprograms(st: Step) -> list[Program]:
    """The programs nested in a step (a call's, a scan / loop body, cond branches)."""
    subs = st.sub if isinstance(st.sub, (list, tuple)) else ([st.sub] if st.sub is not None else [])
    return [s for s in subs if isinstance(s, Program)]


def iter_steps(prog: Program, depth=0):
    """Yield (depth, step) for every step, nested programs included."""
    for st in prog.steps:
        yield depth, st
        for s in subprograms(st):
            yield from iter_steps(s, depth + 1)


def solve_reads(eqn) -> list[int]:
    """The operands of a ``custom_linear_solve`` equation its ``solve`` jaxpr reads: that jaxpr's
    constants, then the right-hand side."""
    lens = eqn.params["const_lengths"]
    start = lens.matvec + lens.vecmat
    return [*range(start, start + lens.solve), *range(sum(lens), len(eqn.invars))]


def trips(st: Step) -> int:
    """How many times the nested programs of ``st`` run per run of ``st``: a ``scan``'s
    ``length``, ``WHILE_TRIPS`` for a ``while`` (its trip count is known only when it runs), once
    for the rest (a call; a ``cond`` runs one of its branches once)."""
    if st.kind == "scan":
        return st.eqn.params["length"]
    return WHILE_TRIPS if st.kind == "while" else 1


def boxings_of(prog: Program, loops: bool = False, times: int = 1):
    """(boxing, how many times it runs) for every boxing of ``prog``, nested programs included:
    once each, or (``loops``) a loop body's once per iteration (a ``scan``'s ``length``,
    ``WHILE_TRIPS`` for a ``while``)."""
    for bx in prog.out_boxings:
        yield bx, times
    for st in prog.steps:
        for bx in st.boxings:
            yield bx, times
        for sub in subprograms(st):
            yield from boxings_of(sub, loops, times * (trips(st) if loops else 1))
