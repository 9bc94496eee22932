"""jsbp.viz's ring schedule pictures and the plan's ring rows.

The schedule (``viz.ring_schedule``) is plain Python; it is checked three ways: cell by cell for
4 devices, as an exact tiling of the (causal) attention matrix for several ``n``, and against
the kernel itself: its layout tables and zig-zag permutations, the permutes of its trace, and the
blocks it really computes (a callback on its block update records, per device, which query and
key chunks each executed step touches).
"""

from __future__ import annotations

import textwrap
import types
from collections import Counter

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_viz import assert_self_contained, parse

import jsbp
from jsbp import viz
from jsbp.nn import _kernels

MODES = {
    "plain": dict(causal=False, balance=False),
    "causal": dict(causal=True, balance=False),
    "balanced": dict(causal=True, balance=True),
}


def cells_of(s):
    return [c for row in s.cells for c in row]


# -------------------------------------------------------------------------------------------
# the schedule on 4 devices
# -------------------------------------------------------------------------------------------


def test_schedule_4_not_causal():
    s = viz.ring_schedule(4)
    assert not s.causal and not s.zigzag and s.chunks == 4
    assert s.holds == ((0,), (1,), (2,), (3,))
    assert [[c.source for c in row] for row in s.cells] == [
        [0, 3, 2, 1],
        [1, 0, 3, 2],
        [2, 1, 0, 3],
        [3, 2, 1, 0],
    ]
    assert all(c.work == "full" and not c.diagonal for c in cells_of(s))
    assert s.cells[2][1].keys == (1,) and s.cells[2][1].queries == (2,)
    assert s.work() == (4, 4, 4, 4)
    assert s.ring_pairs == ((0, 1), (1, 2), (2, 3), (3, 0))
    assert (s.steps, s.ring_permutes, s.zig_permutes, s.permutes) == (4, 3, 0, 3)


def test_schedule_4_causal():
    s = viz.ring_schedule(4, causal=True)
    assert [[c.words() for c in row] for row in s.cells] == [
        ["diagonal", "skip", "skip", "skip"],
        ["diagonal", "full", "skip", "skip"],
        ["diagonal", "full", "full", "skip"],
        ["diagonal", "full", "full", "full"],
    ]
    assert s.work() == (1, 2, 3, 4)  # the busiest device does n blocks, the idlest 1
    assert s.cells[3][2].source == 1 and s.cells[3][2].keys == (1,)
    assert s.cells[0][1].keys == () and s.cells[0][1].blocks == 0
    assert s.permutes == 3
    # balance without causal changes nothing
    assert viz.ring_schedule(4, balance=True) == viz.ring_schedule(4)


def test_schedule_4_balanced():
    s = viz.ring_schedule(4, causal=True, balance=True)
    assert s.zigzag and s.chunks == 8
    assert s.holds == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert [[c.words() for c in row] for row in s.cells] == [
        ["diagonal", "half: queries c7", "half: queries c7", "half: queries c7"],
        ["diagonal", "half: keys c0", "half: queries c6", "half: queries c6"],
        ["diagonal", "half: keys c1", "half: keys c0", "half: queries c5"],
        ["diagonal", "half: keys c2", "half: keys c1", "half: keys c0"],
    ]
    c = s.cells[0][1]  # device 0 against device 3's chunks c3, c4: only its late chunk c7
    assert (c.source, c.keys, c.queries, c.blocks) == (3, (3, 4), (7,), 0.5)
    c = s.cells[1][1]  # device 1 against device 0's first chunk c0, all its queries
    assert (c.source, c.keys, c.queries, c.blocks) == (0, (0,), (1, 6), 0.5)
    assert s.work() == (2.5,) * 4  # balanced: equal work on every device
    assert s.zig_pairs == (((0, 0), (1, 2), (2, 3), (3, 1)), ((0, 1), (1, 3), (2, 2), (3, 0)))
    assert (s.ring_permutes, s.zig_permutes, s.permutes) == (3, 4, 7)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("mode", list(MODES))
def test_schedule_tiles_the_attention_matrix(n, mode):
    """Every (query chunk, key chunk) pair the attention needs is computed exactly once; pairs
    above the diagonal only inside the diagonal blocks (masked there); equal work when balanced."""
    s = viz.ring_schedule(n, **MODES[mode])
    m = s.chunks
    seen = Counter()
    for c in cells_of(s):
        assert c.source == (c.device - c.step) % n
        assert set(c.keys) <= set(s.holds[c.source]) and set(c.queries) <= set(s.holds[c.device])
        pairs = [(q, k) for q in c.queries for k in c.keys]
        assert len(pairs) * 1.0 == c.blocks * len(s.holds[0]) ** 2
        for q, k in pairs:
            seen[q, k] += 1
            if s.causal and k > q:
                assert c.diagonal, (c, q, k)
    assert set(seen.values()) == {1}
    need = {(q, k) for q in range(m) for k in range(m) if k <= q or not s.causal}
    assert need <= set(seen)
    work = s.work()
    assert len(work) == n and all(len(row) == n for row in s.cells)
    if s.causal and not s.zigzag:
        assert (max(work), min(work)) == (n, 1)
    elif s.zigzag:
        assert set(work) == {1 + (n - 1) / 2}
    else:
        assert set(work) == {n}
    assert s.zigzag == (mode == "balanced" and n > 1)


# -------------------------------------------------------------------------------------------
# the schedule agrees with the kernel
# -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
@pytest.mark.parametrize("zig", [False, True])
def test_holds_and_zig_pairs_are_the_kernels(n, zig):
    L = 4
    starts, sizes = tuple(range(0, n * L, L)), (L,) * n
    pos, ok, _ = _kernels._layout(n, L, starts, sizes, zig)
    assert ok.all()
    s = viz.ring_schedule(n, causal=True, balance=zig)
    chunk = L // 2 if zig else L
    assert tuple(tuple(sorted(set((p // chunk).tolist()))) for p in pos) == s.holds
    if zig:
        assert tuple(tuple(p) for p in _kernels._zig_perms(n)) == s.zig_pairs


def _permutes(jaxpr, times=1, out=None):
    """[(perm, times it runs)] of the ppermutes of a jaxpr, in order (a scan runs its body
    ``length`` times)."""
    out = [] if out is None else out
    for e in jaxpr.eqns:
        if e.primitive.name == "ppermute":
            out.append((tuple(tuple(p) for p in e.params["perm"]), times))
        inner = times * (e.params["length"] if e.primitive.name == "scan" else 1)
        for v in e.params.values():
            for x in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(x, jax.extend.core.ClosedJaxpr):
                    _permutes(x.jaxpr, inner, out)
                elif isinstance(x, jax.extend.core.Jaxpr):
                    _permutes(x, inner, out)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_permutes_are_the_kernels(mode):
    """The forward kernel's trace: the zig-zag permutes in, the ring permute once per step
    after the first, the inverse zig-zag permutes out."""
    n, L = 4, 4
    s = viz.ring_schedule(n, **MODES[mode])
    x = jax.ShapeDtypeStruct((1, L, 2, 4), np.float32)

    def f(q, k, v):
        return _kernels.ring_attention(
            q,
            k,
            v,
            axis_name="x",
            axis_size=n,
            starts=tuple(range(0, n * L, L)),
            sizes=(L,) * n,
            is_causal=s.causal,
            balance=MODES[mode]["balance"],
        )

    perms = _permutes(jax.make_jaxpr(f, axis_env=[("x", n)])(x, x, x).jaxpr)
    ring = [t for p, t in perms if p == s.ring_pairs]
    assert sum(ring) == s.ring_permutes
    zig = [(p, t) for p, t in perms if p != s.ring_pairs]
    if s.zigzag:
        back = tuple(tuple((b, a) for a, b in pairs) for pairs in s.zig_pairs)
        assert zig == [(p, 1) for p in s.zig_pairs + back]
    else:
        assert zig == []
    assert sum(t for _, t in perms) == s.permutes  # one dtype: K and V packed together


@pytest.mark.parametrize("mode", ["causal", "balanced", "plain"])
def test_blocks_the_kernel_computes_are_the_schedules(mode, monkeypatch):
    """Run the forward ring on 4 devices with its block update and its skip recorded: per
    device, the (query chunks, key chunks) of every executed update and the number of skips are
    the schedule's cells."""
    n, L = 4, 4
    s = viz.ring_schedule(n, **MODES[mode])
    chunk = L // 2 if s.zigzag else L
    seen = []
    update, skip = _kernels._fwd_update, _kernels._fwd_skip

    def record(kind):
        def cb(i, qpos, kpos):
            seen.append(
                (
                    int(i),
                    kind,
                    tuple(sorted(set((np.asarray(qpos) // chunk).tolist()))),
                    tuple(sorted(set((np.asarray(kpos) // chunk).tolist()))),
                )
            )

        return cb

    def spy_update(state, q5, k, v, b5, m5, scale, causal, qpos, qok, kpos, kok):
        jax.debug.callback(record("work"), lax.axis_index("x"), qpos, kpos)
        return update(state, q5, k, v, b5, m5, scale, causal, qpos, qok, kpos, kok)

    def spy_skip(state, v, kvalid):
        z = jax.numpy.zeros((1,), jax.numpy.int32)
        jax.debug.callback(record("skip"), lax.axis_index("x"), z, z)
        return skip(state, v, kvalid)

    monkeypatch.setattr(_kernels, "_fwd_update", spy_update)
    monkeypatch.setattr(_kernels, "_fwd_skip", spy_skip)
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    kw = dict(
        axis_name="x",
        axis_size=n,
        starts=tuple(range(0, n * L, L)),
        sizes=(L,) * n,
        is_causal=s.causal,
        balance=MODES[mode]["balance"],
    )
    seq = P(None, "x")
    f = jax.jit(
        jax.shard_map(
            lambda q, k, v: _kernels.ring_attention(q, k, v, **kw)[0],
            mesh=mesh,
            in_specs=(seq, seq, seq),
            out_specs=seq,
        )
    )
    x = np.random.default_rng(0).normal(size=(1, n * L, 2, 4)).astype(np.float32)
    jax.block_until_ready(f(x, x, x))
    jax.effects_barrier()
    for i in range(n):
        got = sorted((q, k) for d, kind, q, k in seen if d == i and kind == "work")
        want = sorted((c.queries, c.keys) for c in s.cells[i] if c.work != "skip")
        assert got == want, (i, got, want)
        skips = sum(1 for d, kind, _, _ in seen if d == i and kind == "skip")
        assert skips == sum(1 for c in s.cells[i] if c.work == "skip")


# -------------------------------------------------------------------------------------------
# the pictures
# -------------------------------------------------------------------------------------------


def ring_cells(html):
    tree = assert_self_contained(html)
    return tree, {
        (int(g.attrs["data-device"]), int(g.attrs["data-step"])): g
        for g in tree.root.find("jsbp-ring-cell")
    }


@pytest.mark.parametrize("mode", list(MODES))
def test_html_draws_the_schedule(mode):
    s = viz.ring_schedule(4, **MODES[mode])
    html = viz.ring_schedule_html(4, **MODES[mode])
    assert "<script" not in html.lower() and "http" not in html.replace(
        'xmlns="http://www.w3.org/2000/svg"', ""
    )
    tree, cells = ring_cells(html)
    assert len(cells) == 16
    for c in cells_of(s):
        g = cells[c.device, c.step]
        a = g.attrs
        assert int(a["data-source"]) == c.source and a["data-work"] == c.work
        assert a["data-diagonal"] == str(int(c.diagonal))
        assert a["data-keys"] == ",".join(f"c{k}" for k in c.keys)
        assert float(a["data-blocks"]) == c.blocks
        assert g.lines()[0] == f"K/V {c.source}" and g.lines()[-1] == c.words()
        assert ("stroke-dasharray" in str([n.attrs for n in g.iter()])) == (c.work == "skip")
    work = {
        int(g.attrs["data-device"]): float(g.attrs["data-blocks"])
        for g in tree.root.find("jsbp-ring-work")
    }
    assert work == dict(enumerate(s.work()))
    assert len(tree.root.find("jsbp-permute")) == 3
    total = tree.root.find("jsbp-totals")[0].all_text()
    assert total.startswith("4 steps · 3 collective-permutes of K/V")
    if mode == "balanced":
        assert "+ 2 into the zig-zag order + 2 back" in total
        assert total.endswith("2.5 blocks of work on every device")
    elif mode == "causal":
        assert total.endswith("busiest 4 (device 3), idlest 1 (device 0)")
    else:
        assert total.endswith("4 blocks of work on every device")


def test_html_one_device_and_bad_n():
    tree, cells = ring_cells(viz.ring_schedule_html(1, causal=True, balance=True))
    assert list(cells) == [(0, 0)] and not tree.root.find("jsbp-permute")
    assert "no collective-permute" in tree.root.find("jsbp-totals")[0].all_text()
    with pytest.raises(ValueError, match="at least 1"):
        viz.ring_schedule(0)


def test_text_balanced_snapshot():
    assert viz.ring_schedule_text(4, causal=True, balance=True) == textwrap.dedent(
        """\
        ring attention schedule on 4 devices · causal, balanced (zig-zag)
          the sequence in 8 half-chunks c0..c7; device i holds c(i) and c(7-i) of query, key and value
          device  holds  step 0   step 1     step 2     step 3    blocks
          0       c0,c7  0 diag → 3 ½ q:c7 → 2 ½ q:c7 → 1 ½ q:c7  2.5
          1       c1,c6  1 diag → 0 ½ k:c0 → 3 ½ q:c6 → 2 ½ q:c6  2.5
          2       c2,c5  2 diag → 1 ½ k:c1 → 0 ½ k:c0 → 3 ½ q:c5  2.5
          3       c3,c4  3 diag → 2 ½ k:c2 → 1 ½ k:c1 → 0 ½ k:c0  2.5
          cell: the device the K/V block started on, then the work: full, skip,
                diag (the diagonal block, causal mask inside), ½ q:/k: (half a block: only
                those query / key chunks)
          → collective-permute: every device passes its K/V block to device i+1 (mod n)
        total: 4 steps · 3 collective-permutes of K/V + 2 into the zig-zag order + 2 back · 2.5 blocks of work on every device"""
    )


def test_text_causal_and_plain():
    lines = viz.ring_schedule_text(4, causal=True).splitlines()
    assert lines[0] == "ring attention schedule on 4 devices · causal"
    assert lines[3].split() == [
        "0",
        "c0",
        "0",
        "diag",
        "→",
        "3",
        "skip",
        "→",
        "2",
        "skip",
        "→",
        "1",
        "skip",
        "1",
    ]
    assert lines[6].split()[-1] == "4"
    assert lines[-1].endswith("busiest 4 (device 3), idlest 1 (device 0)")
    plain = viz.ring_schedule_text(4, balance=True).splitlines()
    assert plain[0].endswith("not causal, balance has no effect without causal")
    assert plain[4].split() == [
        "1",
        "c1",
        "1",
        "full",
        "→",
        "0",
        "full",
        "→",
        "3",
        "full",
        "→",
        "2",
        "full",
        "4",
    ]


# -------------------------------------------------------------------------------------------
# plans: a row's note and its own collectives
# -------------------------------------------------------------------------------------------


def test_plan_of_ring_attention_shows_the_ring():
    p = jsbp.placement("cpu", [0, 1, 2, 3], axis_names=("x",))
    rng = np.random.default_rng(0)
    q, k, v = (
        jsbp.tensor(rng.normal(size=(1, 16, 2, 4)).astype(np.float32), p, "S(1)") for _ in range(3)
    )
    f = jsbp.jit(
        lambda q, k, v: jsbp.nn.dot_product_attention(q, k, v, is_causal=True, plan="ring")
    )
    plan = jsbp.explain(f, q, k, v)
    (i,) = [i for i, r in enumerate(plan.rows) if r.primitive == "jsbp_attention"]
    row = plan.rows[i]
    assert row.note == "ring over 'x'" and row.collectives
    assert set(row.collectives) == {"collective-permute"}
    n_own = len(row.collectives)

    text = viz.plan_text(plan)
    lines = text.splitlines()
    assert lines[1].split()[-2:] == ["op", "runs"]
    line = lines[2 + i]
    assert line.startswith("*") and "jsbp_attention [ring over 'x']" in line
    assert line.endswith(f"collective-permute ×{n_own}")
    assert lines[-1].startswith("total: ") and f"collective-permute ×{n_own}" in lines[-1]

    html = viz.plan_html(plan)
    assert html == plan._repr_html_()
    tree = assert_self_contained(html)
    rows = tree.root.find("jsbp-row")
    assert len(rows) == len(plan.rows)
    ring = rows[i]
    assert "jsbp-own-collectives" in ring.classes() and "jsbp-boxed" not in ring.classes()
    assert int(ring.attrs["data-collectives"]) == n_own
    assert [n.all_text() for n in ring.find("jsbp-note")] == ["ring over 'x'"]
    assert [n.all_text() for n in ring.find("jsbp-op-runs")] == [f"collective-permute ×{n_own}"]
    want = {k: v for k, v in plan.collectives().items() if v}
    assert sum(int(r.attrs["data-collectives"]) for r in rows) == sum(want.values())
    assert f"collective-permute ×{want['collective-permute']}" in (
        tree.root.find("jsbp-totals")[0].all_text()
    )


def test_plan_rows_without_the_new_fields_still_render():
    old = types.SimpleNamespace(
        primitive="add",
        inputs=("(S(0))", "(S(0))"),
        signature="(S(0)), (S(0)) -> (S(0))",
        boxings=(),
    )
    ring = {
        "primitive": "ring_op",
        "inputs": ["(S(0))"],
        "signature": "(S(0)) -> (S(0))",
        "note": "ring over 'x'",
        # LocalCost-style entries: (kind, bytes, times)
        "collectives": [("collective-permute", 128.0, 3), ("collective-permute", 64.0, 1)],
    }
    rows, totals = viz._plan.normalise_plan([old, ring])
    assert rows[0].note == "" and rows[0].collectives == () and not rows[0].runs_collective
    assert rows[1].collectives == ("collective-permute",) * 2 and rows[1].runs_collective
    assert totals["collectives"] == {"collective-permute": 2}
    assert viz.plan_text([old]).splitlines()[0].split()[-1] == "bytes/device"  # no new column
    text = viz.plan_text([old, ring]).splitlines()
    assert text[0].split()[-2:] == ["op", "runs"]
    assert text[1].rstrip().endswith("-") and text[2].startswith("*")
    assert text[2].endswith("collective-permute ×2")
    tree = parse(viz.plan_html([old]))
    assert not tree.root.find("jsbp-op-runs")
