"""jsbp.viz's expert dispatch pictures.

The dispatch (``viz.expert_dispatch``) is checked against a hand-worked routing, and against an
oracle that follows each (token, choice) pair from the routing: its source device and its
expert's device from the balanced ``S(0)`` split written out here, and, with a capacity, the
kept mask computed with jnp the way ``dense_moe`` in ``tests/test_moe.py`` computes it (one-hot,
choice-major cumsum, ``pos < capacity``), group by group. Routings come from ``jax.lax.top_k`` on
a softmax, as a router's do.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_viz import assert_self_contained

import jsbp
from jsbp import viz

# 8 tokens on 4 devices (2 each), 8 experts (2 each: e2j, e2j+1 on device j), top-2
HAND = np.array([[0, 3], [0, 1], [0, 5], [7, 0], [2, 3], [2, 6], [6, 7], [7, 6]])


def route(tokens, experts, k, seed):
    logits = np.random.default_rng(seed).normal(size=(tokens, experts)).astype(np.float32)
    _, idx = jax.lax.top_k(jax.nn.softmax(jnp.asarray(logits), axis=-1), k)
    return idx  # a jax array [tokens, k]


def block_of(i, count, parts):
    """The part holding item ``i`` when ``count`` items are cut into ``parts`` contiguous
    parts, the first ``count % parts`` one longer."""
    q, r = divmod(count, parts)
    edges = np.cumsum([q + (p < r) for p in range(parts)])
    return int(np.searchsorted(edges, i, side="right"))


def kept_like_dense_moe(idx, experts, capacity, groups):
    """dense_moe's keep mask, group by group (groups may differ in size)."""
    t, k = idx.shape
    if capacity is None:
        return np.ones((t, k), bool)
    out = []
    group = np.array([block_of(i, t, groups) for i in range(t)])
    for g in range(groups):
        ig = jnp.asarray(idx[group == g])  # [s, k]
        s = ig.shape[0]
        mask = jax.nn.one_hot(ig, experts, dtype=jnp.float32)  # [s, k, e]
        m = jnp.swapaxes(mask, 0, 1).reshape(k * s, experts)
        pos = (jnp.cumsum(m, axis=0) - 1.0) * m
        pos = jnp.swapaxes(pos.reshape(k, s, experts), 0, 1)
        keep = mask * (pos < capacity)
        out.append(np.asarray(jnp.sum(keep, -1)) > 0)
    return np.concatenate(out).reshape(t, k)


def oracle(idx, devices, experts, capacity=None, groups=None):
    idx = np.asarray(idx)
    idx = idx[:, None] if idx.ndim == 1 else idx
    t, k = idx.shape
    kept = kept_like_dense_moe(idx, experts, capacity, devices if groups is None else groups)
    sent = np.zeros((devices, devices), int)
    dropped = np.zeros((devices, experts), int)
    received = np.zeros(experts, int)
    for i in range(t):
        src = block_of(i, t, devices)
        for c in range(k):
            e = int(idx[i, c])
            if kept[i, c]:
                sent[src, block_of(e, experts, devices)] += 1
                received[e] += 1
            else:
                dropped[src, e] += 1
    return sent, received, dropped


# -------------------------------------------------------------------------------------------
# the dispatch as data
# -------------------------------------------------------------------------------------------


def test_hand_routing_dropless():
    d = viz.expert_dispatch(HAND, 4, 8)
    assert d.token_blocks == ((0, 2), (2, 2), (4, 2), (6, 2))
    assert d.expert_blocks == ((0, 2), (2, 2), (4, 2), (6, 2))
    assert d.homes == (0, 0, 1, 1, 2, 2, 3, 3)
    assert d.sent == ((3, 1, 0, 0), (2, 0, 1, 1), (0, 3, 0, 1), (0, 0, 0, 4))
    assert d.received_per_expert == (4, 1, 2, 2, 0, 1, 3, 3)
    assert d.received == (5, 4, 1, 6) and d.sent_per_device == (4, 4, 4, 4)
    assert d.staying == (3, 0, 0, 4)
    assert d.total_dropped == 0 and d.capacity is None and d.slots is None
    assert (d.pairs, d.max_load, d.imbalance) == (16, 6, 1.5)
    # dispatch: off-diagonal column sums; combine: off-diagonal row sums
    assert d.bytes_per_device(10) == (20, 40, 10, 20)
    assert d.bytes_per_device(10, combine=True) == (10, 40, 40, 0)


def test_hand_routing_capacity_one():
    """One slot per expert in each device's group: each expert keeps one pair from each device
    (min(count, capacity) per source and expert: within a device's own group the order decides
    which tokens are dropped, not how many)."""
    d = viz.expert_dispatch(HAND, 4, 8, capacity=1)
    assert d.groups == d.token_blocks and d.slots == 4 * 8 * 1
    assert d.sent == ((2, 1, 0, 0), (1, 0, 1, 1), (0, 2, 0, 1), (0, 0, 0, 2))
    want = np.zeros((4, 8), int)
    want[0, 0] = want[1, 0] = want[2, 2] = want[3, 6] = want[3, 7] = 1
    np.testing.assert_array_equal(d.dropped, want)
    assert d.received_per_expert == (2, 1, 1, 2, 0, 1, 2, 2)
    assert d.dropped_per_device == (2, 1, 0, 2) and d.total_dropped == 5


def test_hand_routing_two_groups():
    """Groups across devices, where the order shows in the counts: in tokens 4..7, expert e6's
    slot goes to token 6's first choice (device 3), not to token 5's second (device 2), though
    token 5 comes first."""
    d = viz.expert_dispatch(HAND, 4, 8, capacity=1, groups=2)
    assert d.groups == ((0, 4), (4, 4))
    assert d.sent == ((2, 1, 0, 0), (0, 0, 1, 1), (0, 2, 0, 0), (0, 0, 0, 2))
    want = np.zeros((4, 8), int)
    want[0, 0], want[1, 0], want[2, 2], want[2, 6], want[3, 7], want[3, 6] = 1, 2, 1, 1, 1, 1
    np.testing.assert_array_equal(d.dropped, want)


CASES = [
    # (tokens, devices, experts, k, capacity, groups)
    (64, 4, 8, 2, None, None),
    (61, 4, 8, 2, None, None),
    (64, 8, 8, 1, None, None),
    (59, 8, 16, 2, None, None),
    (64, 4, 8, 2, 5, None),  # ceil(1.25 * 2 * 16 / 8)
    (61, 4, 8, 2, 4, None),  # uneven: groups of 16, 15, 15, 15
    (64, 8, 8, 1, 1, None),
    (61, 8, 16, 2, 2, None),
    (64, 8, 8, 2, 3, 4),  # groups across devices
    (61, 4, 8, 1, 2, 7),  # uneven groups, not aligned with the devices
]


@pytest.mark.parametrize("tokens,devices,experts,k,capacity,groups", CASES)
def test_against_the_oracle(tokens, devices, experts, k, capacity, groups):
    idx = route(tokens, experts, k, seed=tokens * 31 + devices + k)
    arg = idx[:, 0] if k == 1 else idx  # k = 1 given as [tokens]
    d = viz.expert_dispatch(arg, devices, experts, capacity=capacity, groups=groups)
    sent, received, dropped = oracle(idx, devices, experts, capacity, groups)
    np.testing.assert_array_equal(d.sent, sent)
    np.testing.assert_array_equal(d.received_per_expert, received)
    np.testing.assert_array_equal(d.dropped, dropped)
    assert (d.tokens, d.k, d.capacity) == (tokens, k, capacity)
    assert sum(d.received) + d.total_dropped == tokens * k
    np.testing.assert_array_equal(d.received, sent.sum(0))
    np.testing.assert_array_equal(
        d.dropped_per_device, dropped.reshape(devices, devices, -1).sum((0, 2))
    )
    assert d.imbalance == pytest.approx(sent.sum(0).max() / sent.sum(0).mean())
    off = sent - np.diag(np.diag(sent))
    np.testing.assert_array_equal(d.bytes_per_device(6), off.sum(0) * 6)
    np.testing.assert_array_equal(d.bytes_per_device(6, combine=True), off.sum(1) * 6)
    if capacity is not None:
        assert d.total_dropped > 0  # the capacities above are tight enough to drop


def test_uneven_experts_and_tokens():
    """Experts split like S(0) on an uneven dim: 6 over 4 devices are 2, 2, 1, 1; 3 over 4
    leave the last device none. 10 tokens over 4 devices: 3, 3, 2, 2."""
    idx = route(10, 6, 2, seed=1)
    d = viz.expert_dispatch(idx, 4, 6)
    assert d.token_blocks == ((0, 3), (3, 3), (6, 2), (8, 2))
    assert d.expert_blocks == ((0, 2), (2, 2), (4, 1), (5, 1))
    assert [list(d.experts_of(j)) for j in range(4)] == [[0, 1], [2, 3], [4], [5]]
    np.testing.assert_array_equal(d.sent, oracle(idx, 4, 6)[0])
    d = viz.expert_dispatch(route(10, 3, 2, seed=2), 4, 3)
    assert d.homes == (0, 1, 2) and list(d.experts_of(3)) == []
    assert d.received[3] == 0 and d.bytes_per_device(4)[3] == 0


def test_fewer_tokens_than_devices_and_large_capacity():
    d = viz.expert_dispatch(np.array([[1], [0], [3]]), 4, 4)
    assert d.token_blocks == ((0, 1), (1, 1), (2, 1), (3, 0))
    assert d.sent == ((0, 1, 0, 0), (1, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 0))
    idx = route(40, 8, 2, seed=3)
    assert viz.expert_dispatch(idx, 4, 8, capacity=80).sent == viz.expert_dispatch(idx, 4, 8).sent


def test_numpy_and_jax_give_the_same_dispatch():
    idx = route(32, 8, 2, seed=4)
    assert viz.expert_dispatch(idx, 4, 8, capacity=3) == viz.expert_dispatch(
        np.asarray(idx).astype(np.int64), 4, 8, capacity=3
    )


BAD = [
    (
        dict(expert_index=np.array([[0, 8]])),
        r"expert_index\[0, 1\] is 8, outside 0..3 for num_experts=4",
    ),
    (dict(expert_index=np.array([[-1, 0]])), r"expert_index\[0, 0\] is -1"),
    (
        dict(expert_index=np.zeros((2, 2, 2), int)),
        r"\[tokens\] \(top-1\) or \[tokens, k\].*\(2, 2, 2\)",
    ),
    (dict(expert_index=np.int32(3)), r"got shape \(\)"),
    (dict(expert_index=np.zeros((4, 0), int)), r"no choices per token"),
    (dict(expert_index=np.full((2, 2), 0.5)), r"integers.*float64.*not the probabilities"),
    (dict(devices=0), r"devices must be at least 1, got 0"),
    (dict(devices=2.5), r"devices must be an int, got 2.5"),
    (dict(num_experts=0), r"num_experts must be at least 1, got 0"),
    (dict(capacity=0), r"capacity must be at least 1, got 0"),
    (dict(capacity=1, groups=0), r"groups must be at least 1, got 0"),
]


@pytest.mark.parametrize("bad,match", BAD, ids=[m for _, m in BAD])
def test_bad_input_says_what_to_change(bad, match):
    kw = dict(expert_index=np.array([[0, 1], [2, 3]]), devices=2, num_experts=4) | bad
    args = (kw.pop("expert_index"), kw.pop("devices"), kw.pop("num_experts"))
    with pytest.raises(jsbp.SbpError, match=match):
        viz.expert_dispatch(*args, **kw)
    with pytest.raises(jsbp.SbpError, match=match):
        viz.expert_dispatch_text(*args, **kw)
    with pytest.raises(jsbp.SbpError, match=match):
        viz.expert_dispatch_html(*args, **kw)


def test_bad_bytes_per_token():
    with pytest.raises(jsbp.SbpError, match="bytes_per_token must be at least 0, got -4"):
        viz.expert_dispatch_html(HAND, 4, 8, bytes_per_token=-4)


# -------------------------------------------------------------------------------------------
# the pictures
# -------------------------------------------------------------------------------------------


def by(tree, cls, *keys):
    return {
        tuple(int(g.attrs[f"data-{k}"]) for k in keys): g for g in tree.root.find(f"jsbp-{cls}")
    }


@pytest.mark.parametrize("devices,capacity", [(4, None), (4, 1), (8, None), (8, 2)])
def test_html_draws_the_dispatch(devices, capacity):
    idx = HAND if devices == 4 else route(45, 16, 2, seed=5)
    experts = 8 if devices == 4 else 16
    d = viz.expert_dispatch(idx, devices, experts, capacity=capacity)
    html = viz.expert_dispatch_html(idx, devices, experts, capacity=capacity, bytes_per_token=8)
    tree = assert_self_contained(html)
    cells = by(tree, "dispatch-cell", "source", "dest")
    assert len(cells) == devices * devices
    for (i, j), g in cells.items():
        assert int(g.attrs["data-count"]) == d.sent[i][j]
        assert g.lines() == [str(d.sent[i][j])]
        assert ("jsbp-diagonal" in g.classes()) == (i == j) == (g.attrs["data-diagonal"] == "1")
        (rect,) = [n for n in g.iter() if n.tag == "rect"]
        assert (rect.attrs["fill"] == "none") == (d.sent[i][j] == 0)
        assert (rect.attrs.get("stroke-width") == "2.5") == (i == j)  # the diagonal's border
    dests = by(tree, "dispatch-dest", "device")
    assert len(dests) == devices
    for (j,), g in dests.items():
        assert g.attrs["data-experts"] == ",".join(map(str, d.experts_of(j)))
        o, s = d.expert_blocks[j]
        assert g.lines() == [f"d{j}", f"e{o}-e{o + s - 1}"]
    for (j,), g in by(tree, "dispatch-received", "device").items():
        assert int(g.attrs["data-count"]) == d.received[j]
        assert int(g.attrs["data-bytes"]) == d.bytes_per_device(8)[j]
        assert ("data-dropped" in g.attrs) == (capacity is not None)
        if capacity is not None:
            assert int(g.attrs["data-dropped"]) == d.dropped_per_device[j]
    sent = {
        k[0]: int(g.attrs["data-count"]) for k, g in by(tree, "dispatch-sent", "device").items()
    }
    assert sent == dict(enumerate(d.sent_per_device))
    bars = by(tree, "expert", "expert")
    assert {k[0]: int(g.attrs["data-count"]) for k, g in bars.items()} == dict(
        enumerate(d.received_per_expert)
    )
    for (x,), g in bars.items():
        assert g.lines() == [str(d.received_per_expert[x]), f"e{x}"]
    assert {k[0]: int(g.attrs["data-device"]) for k, g in bars.items()} == dict(enumerate(d.homes))
    labels = [n.all_text() for n in tree.root.iter() if n.tag == "text"]
    assert all(f"d{i}" in labels for i in range(devices))
    total = tree.root.find("jsbp-totals")[0].all_text()
    assert total.startswith(f"{sum(d.received)} of {d.pairs} pairs sent")
    assert (f"{d.total_dropped} dropped" in total) == (capacity is not None)
    title = tree.root.find("jsbp-title")[0].all_text()
    assert (
        title
        == f"expert dispatch · {d.tokens} tokens × top-2 over {devices} devices, {experts} experts"
    )


def test_html_without_experts_on_a_device():
    tree = assert_self_contained(viz.expert_dispatch_html(np.array([0, 1, 2, 2]), 4, 3))
    assert by(tree, "dispatch-dest", "device")[3,].lines() == ["d3", "none"]
    assert {g.attrs["data-device"] for g in tree.root.find("jsbp-expert")} == {"0", "1", "2"}
    rec = by(tree, "dispatch-received", "device")
    assert "data-bytes" not in rec[0,].attrs and "data-dropped" not in rec[0,].attrs


def test_text_snapshot():
    assert viz.expert_dispatch_text(HAND, 4, 8, capacity=1, bytes_per_token=512) == textwrap.dedent(
        """\
        expert dispatch · 8 tokens × top-2 over 4 devices, 8 experts
          tokens per device 2, 2, 2, 2; experts per device 2, 2, 2, 2 (both split as S(0))
          capacity 1 per expert in each of 4 groups (32 slots; one per device; first choices before second, earlier tokens first)
          source \\ dest     d0       d1     d2       d3     sent
          experts        e0-e1    e2-e3  e4-e5    e6-e7
          d0 t0:2          [2]        1      0        0        3
          d1 t2:4            1      [0]      1        1        3
          d2 t4:6            0        2    [0]        1        3
          d3 t6:8            0        0      0      [2]        2
          received           3        3      1        4       11
          dropped            2        1      0        2        5
          bytes in       512 B  1.5 KiB  512 B  1.0 KiB  3.5 KiB
          per expert: d0 e0:2 e1:1 · d1 e2:1 e3:2 · d2 e4:0 e5:1 · d3 e6:2 e7:2
          [n]: pairs whose expert is on their own device (they do not move)
          bytes in: from the other devices in the dispatch, 512 B per token
        total: 11 of 16 pairs sent, 7 to another device · load: max 4 (device 3), imbalance 1.45 · 5 dropped · dispatch: max 1.5 KiB received per device"""
    )


def test_text_dropless_uneven():
    lines = viz.expert_dispatch_text(route(10, 6, 1, seed=6)[:, 0], 4, 6).splitlines()
    assert (
        lines[1]
        == "  tokens per device 3, 3, 2, 2; experts per device 2, 2, 1, 1 (both split as S(0))"
    )
    assert lines[2] == "  dropless: every pair is sent"
    assert lines[4].split() == ["experts", "e0-e1", "e2-e3", "e4", "e5"]
    assert lines[5].split()[:2] == ["d0", "t0:3"] and lines[8].split()[:2] == ["d3", "t8:10"]
    assert lines[9].split()[0] == "received" and lines[9].split()[-1] == "10"
    assert not any(line.split()[:1] == ["dropped"] for line in lines)
    assert lines[-1].startswith("total: 10 of 10 pairs sent")


def test_text_groups_across_devices():
    lines = viz.expert_dispatch_text(HAND, 4, 8, capacity=1, groups=2).splitlines()
    assert lines[2] == (
        "  capacity 1 per expert in each of 2 groups (16 slots; first choices before second, "
        "earlier tokens first)"
    )
    assert [line.split()[-1] for line in lines[5:9]] == ["3", "2", "2", "2"]  # sent per device
    assert lines[10].split() == ["dropped", "3", "1", "0", "3", "7"]
