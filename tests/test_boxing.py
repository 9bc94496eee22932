"""Boxing: every (src, dst) nd-sbp pair against the NumPy oracle, collective counts, gradients and
cross-placement moves.

The exhaustive grid is a few thousand compiled conversions, so the default run takes every pair for
the even shape on (4,) and (2, 2) and a seeded ~15% sample elsewhere; ``JSBP_FULL=1`` runs the rest
(marked ``slow``). The (2, 2, 2) grid is sampled in both modes.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _oracle import FULL, SBP_NAMES, check_global, global_from_oracle, make_value, nd_sbps, sample

import jsbp
from jsbp.debug import count_collectives

# -- the grid -------------------------------------------------------------------------------------

HIERARCHIES = {
    "4": (4,),
    "8": (8,),
    "2x2": (2, 2),
    "2x4": (2, 4),
    "2x2x2": (2, 2, 2),
}

SHAPES = {
    "even": None,  # per hierarchy, below
    "25x33": (25, 33),
    "13x17": (13, 17),
    "3x5": (3, 5),  # smaller than the axis: empty shards
    "8x0x4": (8, 0, 4),  # zero-size; S(1) is the zero dim
}

EVEN = {"4": (8, 8), "8": (16, 8), "2x2": (8, 8), "2x4": (16, 16), "2x2x2": (8, 8)}


def shape_of(hname: str, sname: str) -> tuple[int, ...]:
    return EVEN[hname] if sname == "even" else SHAPES[sname]


@functools.cache
def placement_of(hname: str) -> jsbp.placement:
    h = HIERARCHIES[hname]
    return jsbp.placement("cpu", np.arange(int(np.prod(h))).reshape(h))


def _all_cases():
    """(hname, sname, src, dst, default?) for every case of the grid."""
    out = []
    for hname, h in HIERARCHIES.items():
        nds = nd_sbps(len(h))
        pairs = [(s, d) for s in nds for d in nds]
        for sname in SHAPES:
            if hname == "2x2x2":
                chosen = sample(
                    pairs, 0.10, f"full-{hname}-{sname}"
                )  # "sampled set" even in full mode
                default = set(sample(chosen, 0.06, f"default-{hname}-{sname}"))
            elif sname == "even" and hname in ("4", "2x2"):
                chosen, default = pairs, set(pairs)
            else:
                chosen = pairs
                default = set(sample(pairs, 0.15, f"default-{hname}-{sname}"))
            for s, d in chosen:
                out.append((hname, sname, s, d, (s, d) in default))
    return out


ALL_CASES = _all_cases()
DEFAULT_CASES = [c[:4] for c in ALL_CASES if c[4]]
SLOW_CASES = [c[:4] for c in ALL_CASES if not c[4]]


def _case_id(c):
    hname, sname, s, d = c
    return f"{hname}-{sname}-{','.join(s)}->{','.join(d)}"


@functools.cache
def source(hname: str, sname: str, src: tuple[str, ...]):
    """The source tensor of a case (built once per worker): non-trivial P addends via from_local."""
    shape = shape_of(hname, sname)
    value = make_value(shape, seed=len(shape) * 7 + sum(shape))
    x = global_from_oracle(value, placement_of(hname), src, seed=3)
    check_global(x, value, src)  # the source itself is laid out as the oracle says
    return x, value


def _box_and_check(hname, sname, src, dst):
    x, value = source(hname, sname, src)
    y = x.to_global(sbp=dst)
    check_global(y, value, dst)
    if src == dst:
        assert y is x  # nothing changes: to_global returns the tensor itself
    # the source is untouched by boxing
    check_global(x, value, src)


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=_case_id)
def test_boxing_oracle(case):
    _box_and_check(*case)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="exhaustive grid: set JSBP_FULL=1")
@pytest.mark.parametrize("case", SLOW_CASES if FULL else [], ids=_case_id)
def test_boxing_oracle_full(case):
    _box_and_check(*case)


def test_grid_covers_the_issue():
    """The default sample really touches every placement, shape class and src/dst kind."""
    seen = {(h, s) for h, s, _, _ in DEFAULT_CASES}
    assert seen == {(h, s) for h in HIERARCHIES for s in SHAPES}
    for h in ("4", "2x2"):
        assert (
            sum(1 for c in DEFAULT_CASES if c[:2] == (h, "even"))
            == len(nd_sbps(len(HIERARCHIES[h]))) ** 2
        )
    kinds = {(s[0], d[0]) for h, _, s, d in DEFAULT_CASES if h == "2x4"}
    assert {("S(0)", "P"), ("P", "S(1)"), ("P", "B"), ("S(1)", "S(0)")} <= kinds
    assert len(SLOW_CASES) > len(DEFAULT_CASES)


def test_partial_sources_have_distinct_addends():
    """The oracle's P sources are not 'value on one device, zeros elsewhere'."""
    x, value = source("2x2", "25x33", ("P", "P"))
    locs = [np.asarray(a) for a in x.to_local()]
    assert not any(np.array_equal(locs[0], loc) for loc in locs[1:])
    assert all(np.any(loc != 0) for loc in locs)
    assert np.array_equal(np.sum(locs, axis=0), value)


# -- dtypes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.float16, jnp.bfloat16, np.uint8])
@pytest.mark.parametrize(
    "src,dst",
    [
        (("S(0)", "S(1)"), ("P", "B")),
        (("P", "S(1)"), ("S(1)", "S(0)")),
        (("B", "P"), ("S(0)", "S(0)")),
    ],
)
def test_boxing_other_dtypes(dtype, src, dst):
    value = make_value((13, 17), seed=5).astype(np.float32)
    if dtype == np.uint8:
        value = np.abs(value)
    value = value.astype(dtype)
    # uint8 addends wrap around, and so does psum: the sum is still exact
    x = global_from_oracle(value, placement_of("2x2"), src, seed=0)
    y = x.to_global(sbp=dst)
    assert y.dtype == x.dtype == np.dtype(dtype)
    check_global(y, value, dst)


@pytest.mark.parametrize("dst", ["S(0)", "S(1)", "B"])
def test_boxing_bool(dst):
    value = make_value((9, 6), seed=2) > 0
    x = jsbp.tensor(value, placement=placement_of("4"), sbp="S(1)")
    check_global(x.to_global(sbp=dst), value, (dst,))


def test_boxing_scalar():
    x = jsbp.tensor(np.float32(3.5), placement=placement_of("2x2"), sbp=("P", "B"))
    assert x.shape == ()
    y = x.to_global(sbp=("B", "B"))
    assert float(y.numpy()) == 3.5
    assert [float(a) for a in y.to_local()] == [3.5] * 4


# -- collective counts ----------------------------------------------------------------------------

NONE = {}


def _counts(x, dst, **kw):
    got = count_collectives(lambda t: t.to_global(sbp=dst, **kw), x)
    assert set(got) == {
        "all-gather",
        "all-reduce",
        "reduce-scatter",
        "all-to-all",
        "collective-permute",
    }
    return {k: v for k, v in got.items() if v}


ONE_D_COUNTS = [
    ("S(0)", "B", {"all-gather": 1}),
    ("S(1)", "B", {"all-gather": 1}),
    ("P", "B", {"all-reduce": 1}),
    ("P", "S(0)", {"reduce-scatter": 1}),  # never all-reduce + slice
    ("P", "S(1)", {"reduce-scatter": 1}),
    ("S(0)", "S(1)", {"all-to-all": 1}),
    ("S(1)", "S(0)", {"all-to-all": 1}),
    ("B", "S(0)", NONE),
    ("B", "S(1)", NONE),
    ("B", "P", NONE),
    ("S(0)", "P", NONE),
    ("S(1)", "P", NONE),
]


@pytest.mark.parametrize("hname", ["4", "8"])
@pytest.mark.parametrize("shape", [(16, 8), (25, 33), (3, 5)], ids=str)
@pytest.mark.parametrize(
    "src,dst,want", ONE_D_COUNTS, ids=lambda v: v if isinstance(v, str) else ""
)
def test_collectives_1d(hname, shape, src, dst, want):
    x = jsbp.zeros(shape, placement=placement_of(hname), sbp=src)
    assert _counts(x, dst) == want


@pytest.mark.parametrize("src,dst,_", ONE_D_COUNTS, ids=lambda v: v if isinstance(v, str) else "")
def test_collectives_zero_size_tensor(src, dst, _):
    x = jsbp.zeros((8, 0, 4), placement=placement_of("4"), sbp=src)
    assert _counts(x, dst) == NONE
    check_global(x.to_global(sbp=dst), np.zeros((8, 0, 4), np.float32), (dst,))


def _one_device_axis_cases():
    """Pairs on 2-d placements with an axis of one device: every pair whose change on that axis
    only (the others kept) on (4, 1) and (1, 4), plus a sample of the rest; all with JSBP_FULL=1."""
    out = []
    for grid in ((4, 1), (1, 4)):
        big = grid.index(4)
        pairs = [(s, d) for s in nd_sbps(2) for d in nd_sbps(2)]
        alone = [(s, d) for s, d in pairs if s[big] == d[big]]
        rest = [p for p in pairs if p not in alone]
        out += [
            (grid, s, d) for s, d in alone + (rest if FULL else sample(rest, 0.08, f"one-{grid}"))
        ]
    return out


@pytest.mark.parametrize(
    "grid,src,dst", _one_device_axis_cases(), ids=lambda v: ",".join(map(str, v))
)
def test_an_axis_of_one_device_moves_nothing(grid, src, dst):
    """On an axis of one device, S (one piece) and P (one addend) hold what B holds: a conversion
    runs exactly the collectives of the same conversion on the placement without that axis, so a
    change on that axis alone runs none (e.g. the Flax miniGPT tutorial's ('batch', 'model') mesh
    with one 'model' device: its kernels' S(1) over 'model' is the whole kernel)."""
    plc = jsbp.placement("cpu", np.arange(4).reshape(grid))
    big = grid.index(4)
    value = make_value((13, 17), seed=5)
    x = global_from_oracle(value, plc, src, seed=3)
    check_global(x.to_global(sbp=dst), value, dst)
    assert _counts(x, dst) == _line_counts(src[big], dst[big])


@functools.cache
def _line_counts(src, dst):
    return _counts(jsbp.zeros((13, 17), placement=placement_of("4"), sbp=src), dst)


TWO_D_EXACT = [
    # axes changing the same way share ONE collective over both axis names
    (("S(0)", "S(0)"), ("B", "B"), {"all-gather": 1}),
    (("S(1)", "S(1)"), ("B", "B"), {"all-gather": 1}),
    (("P", "P"), ("B", "B"), {"all-reduce": 1}),
    (("P", "P"), ("S(0)", "S(0)"), {"reduce-scatter": 1}),
    (("S(0)", "S(0)"), ("S(1)", "S(1)"), {"all-to-all": 1}),
    # one axis changes: one collective on it
    (("S(0)", "S(1)"), ("S(0)", "S(0)"), {"all-to-all": 1}),
    (("S(0)", "B"), ("B", "B"), {"all-gather": 1}),
    (("B", "S(0)"), ("B", "B"), {"all-gather": 1}),
    (("P", "S(0)"), ("B", "S(0)"), {"all-reduce": 1}),
    (("P", "P"), ("P", "B"), {"all-reduce": 1}),
    (("P", "P"), ("B", "P"), {"all-reduce": 1}),
    (("S(0)", "P"), ("S(0)", "S(1)"), {"reduce-scatter": 1}),
    # no communication at all
    (("B", "B"), ("S(0)", "S(1)"), NONE),
    (("B", "B"), ("P", "P"), NONE),
    (("B", "S(1)"), ("S(0)", "S(1)"), NONE),
    (("S(0)", "S(1)"), ("P", "P"), NONE),
]


@pytest.mark.parametrize("hname", ["2x2", "2x4"])
@pytest.mark.parametrize("shape", [(16, 16), (25, 33)], ids=str)
@pytest.mark.parametrize(
    "src,dst,want", TWO_D_EXACT, ids=lambda v: ",".join(v) if isinstance(v, tuple) else ""
)
def test_collectives_2d_exact(hname, shape, src, dst, want):
    x = jsbp.zeros(shape, placement=placement_of(hname), sbp=src)
    assert _counts(x, dst) == want


@pytest.mark.parametrize("hname", ["2x2", "2x4"])
@pytest.mark.parametrize("shape", [(8, 8), (25, 33), (512, 512)], ids=str)
def test_collectives_2d_swap_is_at_most_two(hname, shape):
    x = jsbp.zeros(shape, placement=placement_of(hname), sbp=("S(0)", "S(1)"))
    got = _counts(x, ("S(1)", "S(0)"))
    assert sum(got.values()) <= 2, got
    assert "collective-permute" not in got


@pytest.mark.parametrize(
    "src,dst,want",
    [
        (("S(0)",) * 3, ("B",) * 3, {"all-gather": 1}),
        (("P",) * 3, ("B",) * 3, {"all-reduce": 1}),
        (("P",) * 3, ("S(0)",) * 3, {"reduce-scatter": 1}),
        (("S(1)",) * 3, ("S(0)",) * 3, {"all-to-all": 1}),
        (("P", "P", "B"), ("B", "B", "B"), {"all-reduce": 1}),
        (("B",) * 3, ("S(0)", "S(1)", "P"), NONE),
    ],
    ids=lambda v: ",".join(v) if isinstance(v, tuple) else "",
)
def test_collectives_3d_shared(src, dst, want):
    x = jsbp.zeros((16, 12), placement=placement_of("2x2x2"), sbp=src)
    assert _counts(x, dst) == want


def _changed_axes(src, dst):
    return sum(1 for a, b in zip(src, dst) if a != b)


@pytest.mark.parametrize("hname", ["2x2", "2x4", "2x2x2"])
@pytest.mark.parametrize("shape", [(8, 8), (25, 33), (256, 192)], ids=str)
def test_planner_at_most_one_collective_per_changed_axis(hname, shape):
    """Every pair plans at most one collective per axis whose SBP changes (no compilation: the
    planner alone). Exhaustive on 2-d placements; the 4096 pairs of (2, 2, 2) are sampled unless
    JSBP_FULL=1 (planning them all takes ~30 s per shape)."""
    from jsbp._boxing import plan

    h = HIERARCHIES[hname]
    pairs = [(s, d) for s in nd_sbps(len(h)) for d in nd_sbps(len(h))]
    if len(h) == 3 and not FULL:
        pairs = sample(pairs, 0.08, f"planner-{shape}")
    for src, dst in pairs:
        s_nd, d_nd = tuple(map(jsbp.sbp.parse, src)), tuple(map(jsbp.sbp.parse, dst))
        moves = plan(s_nd, d_nd, shape, h, 4)
        n = sum(1 for m in moves if m.collective)
        assert n <= _changed_axes(src, dst), (src, dst, [str(m) for m in moves])
        assert (len(moves) == 0) == (src == dst)
        # every move really is one of the table's moves
        for m in moves:
            assert m.collective in (
                None,
                "all-gather",
                "all-reduce",
                "reduce-scatter",
                "all-to-all",
            )


@pytest.mark.parametrize("hname", ["2x2", "2x4", "2x2x2"])
@pytest.mark.parametrize("shape", [(8, 8), (25, 33)], ids=str)
def test_a_conversion_joins_a_combined_collective_iff_it_plans_one(hname, shape):
    """``combined_collective`` (what the planner prices as joinable) is the one move of the path
    ``plan`` runs where that move is an all-gather, a reduce-scatter or a sum all-reduce between
    even layouts, else nothing: every pair of 2-d layouts, from Pmax ones too; (2, 2, 2)
    sampled unless JSBP_FULL=1."""
    from jsbp._boxing import combined_collective, plan
    from jsbp._layout import layout_of

    h = HIERARCHIES[hname]
    names = (*SBP_NAMES, "Pmax")
    nds = [tuple(map(jsbp.sbp.parse, nd)) for nd in itertools.product(names, repeat=len(h))]
    nds = [nd for nd in nds if len({x.reduce for x in nd if x.is_partial}) <= 1]
    pairs = [
        (s, d) for s in nds for d in nds if not any(x.is_partial and x.reduce == "max" for x in d)
    ]
    if len(h) == 3 and not FULL:
        pairs = sample(pairs, 0.1, f"combined-{shape}")

    plc = placement_of(hname)

    def even(nd):
        return layout_of(plc, nd, shape).is_even

    joined = 0
    for src, dst in pairs:
        moves = [] if src == dst else plan(src, dst, shape, h, 4)
        want = ()
        if len(moves) == 1 and even(src) and even(dst):
            (mv,) = moves
            if mv.collective in ("all-gather", "reduce-scatter") or (
                mv.collective == "all-reduce" and mv.src.reduce == "sum"
            ):
                want = ((mv.collective, tuple(mv.axes)),)
        assert combined_collective(src, dst, shape, h, 4) == want, (src, dst, moves)
        joined += bool(want)
    assert joined > 0 or (len(h) == 3 and not FULL)  # (every sum all-reduce P -> B joins)


@pytest.mark.parametrize("hname", ["2x4", "2x2x2"])
def test_compiled_collectives_within_budget_sampled(hname):
    """The compiled program agrees with the plan: no more collectives than changed axes."""
    h = HIERARCHIES[hname]
    pairs = [(s, d) for s in nd_sbps(len(h)) for d in nd_sbps(len(h))]
    pairs = sample(pairs, 20 / len(pairs), f"budget-{hname}")
    for src, dst in pairs:
        x = jsbp.zeros((25, 33), placement=placement_of(hname), sbp=src)
        got = _counts(x, dst)
        assert sum(got.values()) <= _changed_axes(src, dst), (src, dst, got)
        assert "collective-permute" not in got


def test_plans_are_cached():
    from jsbp import _tensor

    x = jsbp.zeros(25, 33, placement=placement_of("2x2"), sbp=("S(0)", "P"))
    x.to_global(sbp=("B", "S(1)"))
    from jsbp import _boxing

    before = _tensor._same_placement_boxer.cache_info()
    plans = _boxing._frontier.cache_info()
    y = x.to_global(sbp=("B", "S(1)"))
    after = _tensor._same_placement_boxer.cache_info()
    # the second conversion builds nothing: no new program, no new plan (the eager fast path may
    # serve it before the program cache is even consulted)
    assert after.misses == before.misses and after.hits >= before.hits
    assert _boxing._frontier.cache_info().misses == plans.misses
    assert y.sbp == jsbp.sbp.parse_nd(("B", "S(1)"))


def _renamed(perm, nd):
    return tuple(jsbp.sbp.split(perm[x.dim]) if x.is_split else x for x in nd)


def test_pairs_that_differ_by_the_dims_numbers_are_searched_once():
    """Boxing's paths do not depend on which dims are split, only on the pattern: a pair is
    searched once in its renumbered form (``_boxing._renumbered``) and its paths renamed back.
    Every renaming of sampled rank-3 pairs on 2 x 4 plans the moves of one search at the same
    cost, each path a walk from its own source to its own destination (a path may pass through
    a dim neither end splits: any such dim serves)."""
    from jsbp import _boxing

    h = (2, 4)
    ndim = 3
    parse = lambda nd: tuple(map(jsbp.sbp.parse, nd))
    names = ("S(0)", "S(1)", "S(2)", "B", "P")
    nds = [parse(nd) for nd in itertools.product(names, repeat=2)]
    for src, dst in sample([(s, d) for s in nds for d in nds], 0.25, "renumbered"):
        _boxing._frontier.cache_clear()
        _boxing._reach.cache_clear()
        base = _boxing._frontier(src, dst, ndim, h)
        for perm in itertools.permutations(range(ndim)):
            a, b = _renamed(perm, src), _renamed(perm, dst)
            got = _boxing._frontier(a, b, ndim, h)
            assert [ab for ab, _ in got] == [ab for ab, _ in base], (src, dst, perm)
            for (_, p), (_, q) in zip(got, base):
                assert [(m.axes, m.collective, m.bytes_per_device) for m in p] == [
                    (m.axes, m.collective, m.bytes_per_device) for m in q
                ]
                state = list(a)
                for m in p:
                    assert all(state[ax] == m.src for ax in m.axes), (a, b, [str(m) for m in p])
                    for ax in m.axes:
                        state[ax] = m.dst
                assert tuple(state) == b, (a, b, [str(m) for m in p])
        assert _boxing._reach.cache_info().misses <= 1  # one search from the renumbered source


@pytest.mark.parametrize("h", [(8,), (2, 4), (2, 2, 2)], ids=str)
def test_a_pair_is_searched_at_its_split_dims_plus_one_free_dim_per_axis(h):
    """A path may pass through dims neither end splits (P -> S(free) -> B), but never holds more
    of them at once than the placement has axes, and such dims are alike: a rank-5 pair is
    searched at its split dims plus one free dim per axis (``_boxing._rank_searched``) and finds
    the paths and costs of the search over all five dims; its conversion lines are computed once
    for both ranks."""
    from jsbp import _boxing

    ndim = 5
    names = ("S(0)", "S(1)", "S(2)", "B", "P", "Pmax")
    nds = [
        nd
        for nd in (tuple(map(jsbp.sbp.parse, x)) for x in itertools.product(names, repeat=len(h)))
        if len({x.reduce for x in nd if x.is_partial}) <= 1
    ]

    def rank_of(s, d):  # the rank the pair is searched at
        return _boxing._rank_searched(len({x.dim for x in s + d if x.is_split}), h)

    pairs = [(s, d) for s in nds for d in nds if rank_of(s, d) < ndim]
    searched = 0
    for src, dst in sample(pairs, (1.0, 0.3, 0.1)[len(h) - 1], f"rank {h}"):
        every = _boxing._within_budget(_boxing._reach(src, ndim, h), dst, src, dst)
        if not every:
            every = _boxing._pareto(_boxing._search(src, dst, ndim, h))
        got = _boxing._frontier(src, dst, ndim, h)
        assert [ab for ab, _ in got] == [ab for ab, _ in every], (src, dst)
        for (_, p), (_, q) in zip(got, every):
            assert [(m.axes, m.collective, m.bytes_per_device) for m in p] == [
                (m.axes, m.collective, m.bytes_per_device) for m in q
            ]
        lines = _boxing.conversion_lines(src, dst, ndim, h, 1e6, 64.0)
        low = rank_of(src, dst)
        assert lines is _boxing.conversion_lines(src, dst, low, h, 1e6, 64.0)  # computed once
        searched += 1
    assert searched >= min(30, len(pairs))


# -- gradients through boxing --------------------------------------------------------------------

_GV = np.random.default_rng(11).standard_normal((13, 17)).astype(np.float32)
_GW = np.random.default_rng(12).standard_normal((13, 17)).astype(np.float32)
_GREF = np.asarray(jax.grad(lambda a: jnp.sum(jnp.sin(a) * _GW))(_GV))


def _grad_pairs():
    out = []
    for hname in ("4", "2x2"):
        nds = nd_sbps(len(HIERARCHIES[hname]))
        pairs = [(s, d) for s in nds for d in nds]
        chosen = pairs if hname == "4" else sample(pairs, 0.12, "grad-2x2")
        out += [(hname, s, d) for s, d in chosen]
    return out


@pytest.mark.parametrize(
    "hname,src,dst", _grad_pairs(), ids=lambda v: ",".join(v) if isinstance(v, tuple) else v
)
def test_grad_through_boxing(hname, src, dst):
    x = jsbp.tensor(_GV, placement=placement_of(hname), sbp=src)

    def loss(t):
        return jnp.sum(jnp.sin(t.to_global(sbp=dst).to_jax()) * _GW)

    g = jax.grad(loss)(x)
    assert isinstance(g, jsbp.GlobalTensor)
    assert g.placement == x.placement and g.sbp == x.sbp and g.shape == x.shape
    np.testing.assert_allclose(g.numpy(), _GREF, rtol=1e-5, atol=1e-5)
    # the value of the loss itself is the single-device value
    np.testing.assert_allclose(
        float(jax.jit(loss)(x)), float(jnp.sum(jnp.sin(_GV) * _GW)), rtol=1e-5
    )


@pytest.mark.parametrize(
    "src,mid",
    [
        (("P", "S(1)"), ("S(0)", "B")),
        (("S(0)", "S(1)"), ("S(1)", "P")),
        (("B", "P"), ("P", "S(0)")),
    ],
)
def test_grad_chain_of_boxings_uneven_2x4(src, mid):
    x = jsbp.tensor(_GV, placement=placement_of("2x4"), sbp=src)

    def loss(t):
        y = t.to_global(sbp=mid).to_global(sbp=("B", "B"))
        return jnp.sum(jnp.sin(y.to_jax()) * _GW)

    g = jax.jit(jax.grad(loss))(x)
    assert g.sbp == x.sbp
    np.testing.assert_allclose(g.numpy(), _GREF, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    "grad_sbp,want",
    [
        (None, {"all-gather": 1}),
        ("B", {"all-gather": 1}),  # B -> S(0) in the backward: a local slice
        ("P", {"all-gather": 1, "reduce-scatter": 1}),  # B -> P (zero-fill) -> S(0): reduce-scatter
        ("S(1)", {"all-gather": 1, "all-to-all": 1}),  # B -> S(1) -> S(0): all-to-all
    ],
)
def test_grad_sbp(jit, grad_sbp, want):
    x = jsbp.tensor(_GV, placement=placement_of("4"), sbp="S(0)")

    def loss(t):
        return jnp.sum(jnp.sin(t.to_global(sbp="B", grad_sbp=grad_sbp).to_jax()) * _GW)

    gfn = jax.grad(loss)
    g = (jax.jit(gfn) if jit else gfn)(x)
    assert g.sbp == x.sbp  # the gradient still comes back in x's own layout
    np.testing.assert_allclose(g.numpy(), _GREF, rtol=1e-5, atol=1e-5)
    assert _nonzero(count_collectives(gfn, x)) == want


def _nonzero(d):
    return {k: v for k, v in d.items() if v}


def test_grad_of_to_global_output_layout():
    """Differentiating w.r.t. the boxed tensor: the gradient has the boxed tensor's layout."""
    x = jsbp.tensor(_GV, placement=placement_of("2x2"), sbp=("S(0)", "S(1)"))

    def loss(y):
        return jnp.sum(jnp.sin(y.to_jax()) * _GW)

    y = x.to_global(sbp=("P", "B"))
    g = jax.grad(loss)(y)
    assert g.sbp == y.sbp
    np.testing.assert_allclose(g.numpy(), _GREF, rtol=1e-5, atol=1e-5)


# -- across placements ----------------------------------------------------------------------------


def _plc(ranks, names=None):
    return jsbp.placement("cpu", ranks, axis_names=names)


CROSS = [
    # disjoint device sets, same hierarchy
    ([0, 1, 2, 3], ("S(0)",), [4, 5, 6, 7], ("S(1)",)),
    ([0, 1, 2, 3], ("P",), [4, 5, 6, 7], ("B",)),
    ([0, 1, 2, 3], ("S(1)",), [4, 5, 6, 7], ("P",)),
    # same devices, permuted order
    ([0, 1, 2, 3], ("S(0)",), [3, 1, 2, 0], ("S(0)",)),
    # 1-d <-> 2-d
    (list(range(8)), ("S(0)",), [[0, 1, 2, 3], [4, 5, 6, 7]], ("S(1)", "P")),
    ([[0, 1], [2, 3]], ("P", "S(1)"), list(range(8)), ("S(0)",)),
    ([[0, 1], [2, 3]], ("S(0)", "S(1)"), [[4, 5], [6, 7]], ("S(1)", "S(0)")),
    # 1 device <-> many
    ([5], ("B",), [0, 1, 2, 3], ("S(0)",)),
    ([0, 1, 2, 3, 4, 5, 6, 7], ("P",), [3], ("B",)),
    ([[0, 1], [2, 3]], ("S(1)", "S(0)"), [6], ("S(0)",)),
    ([7], ("P",), [[0, 1], [2, 3]], ("P", "P")),
    # 2-d <-> 3-d
    (
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        ("S(0)", "S(1)"),
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
        ("S(1)", "P", "S(0)"),
    ),
]


@pytest.mark.parametrize("shape", [(13, 17), (3, 5), (16, 8), (8, 0, 4)], ids=str)
@pytest.mark.parametrize("src_r,src,dst_r,dst", CROSS, ids=lambda v: str(v).replace(" ", ""))
def test_cross_placement(shape, src_r, src, dst_r, dst):
    value = make_value(shape, seed=21)
    p, q = _plc(src_r), _plc(dst_r)
    x = global_from_oracle(value, p, src, seed=4)
    y = x.to_global(placement=q, sbp=dst)
    assert y.placement == q
    check_global(y, value, dst)
    check_global(x, value, src)  # the source is untouched
    # and back again
    check_global(y.to_global(placement=p, sbp=src), value, src)


def test_cross_placement_keeps_sbp_when_omitted():
    value = make_value((13, 17), seed=1)
    p, q = _plc([[0, 1], [2, 3]]), _plc([[7, 6], [5, 4]], ("a", "b"))
    x = global_from_oracle(value, p, ("S(1)", "P"))
    y = x.to_global(placement=q)
    assert y.placement == q and tuple(map(str, y.sbp)) == ("S(1)", "P")
    check_global(y, value, ("S(1)", "P"))
    locs = y.to_local()
    devs = [next(iter(a.devices())) for a in locs]
    assert [d.id for d in devs] == [7, 6, 5, 4]


def test_same_placement_object_equal_is_not_a_move():
    x = jsbp.zeros(4, 4, placement=_plc([0, 1]), sbp="S(0)")
    assert x.to_global(placement=_plc([0, 1])) is x
    assert x.to_global(placement=_plc([0, 1]), sbp="S(0)") is x
    assert x.to_global(sbp=[jsbp.sbp.split(-2)]) is x


# -- boxing under jax.jit -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    sample(DEFAULT_CASES, 24 / len(DEFAULT_CASES), "jit-cases"),
    ids=_case_id,
)
def test_boxing_under_jit_matches_oracle(case):
    hname, sname, src, dst = case
    x, value = source(hname, sname, src)
    y = jax.jit(lambda t: t.to_global(sbp=dst))(x)
    assert isinstance(y, jsbp.GlobalTensor)
    check_global(y, value, dst)


def test_grad_sbp_when_the_forward_layout_does_not_change():
    """to_global to the same sbp with grad_sbp= is not skipped: the backward still converts."""
    x = jsbp.tensor(_GV, placement=placement_of("2x2"), sbp=("S(0)", "P"))

    def loss(t):
        return jnp.sum(jnp.sin(t.to_global(sbp=("S(0)", "P"), grad_sbp=("B", "B")).to_jax()) * _GW)

    g = jax.grad(loss)(x)
    assert g.sbp == x.sbp
    np.testing.assert_allclose(g.numpy(), _GREF, rtol=1e-5, atol=1e-5)


def test_cross_placement_under_jit_is_a_clear_error():
    x = jsbp.zeros(4, 4, placement=_plc([[0, 1], [2, 3]]), sbp=("S(0)", "B"))
    q = _plc([[4, 5], [6, 7]])
    with pytest.raises(jsbp.SbpError, match=r"eager operation") as e:
        jax.jit(lambda t: t.to_global(placement=q))(x)
    assert "ranks=[[0, 1], [2, 3]]" in str(e.value) and "ranks=[[4, 5], [6, 7]]" in str(e.value)


@pytest.mark.parametrize("dst", [("B", "S(0)"), ("S(0)", "B"), ("S(0)", "S(1)"), ("S(1)", "S(1)")])
def test_slicing_a_replicated_value_needs_no_table_of_starts(dst):
    """B -> S on a 2-d placement is a local slice whose start is computed from the axis indices
    (a stride per axis), not read from a per-device table embedded in the program."""
    from jsbp._boxing import _axis_strides

    assert _axis_strides(np.array([0, 4, 8, 12] * 2), (2, 4)) == [0, 4]
    assert _axis_strides(np.array([0] * 4 + [8] * 4), (2, 4)) == [8, 0]
    assert _axis_strides(np.array([0, 1, 3, 4] * 2), (2, 4)) is None  # not affine: a table
    plc = jsbp.placement("cpu", [[0, 1, 2, 3], [4, 5, 6, 7]], axis_names=("dp", "tp"))
    value = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = jsbp.tensor(value, plc, ("B", "B"))
    f = jsbp.jit(lambda x: jsbp.to_global(x, sbp=dst))
    out = f(x)
    assert out.sbp == tuple(jsbp.sbp.parse(s) for s in dst)
    np.testing.assert_array_equal(out.numpy(), value)
    text = f.lower(x).as_text()
    assert "xi32>" not in "".join(ln for ln in text.splitlines() if "stablehlo.constant" in ln)
    assert sum(count_collectives(f, x).values()) == 0
