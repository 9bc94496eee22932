"""jsbp.viz: the pictures say what the layout really is.

The HTML is parsed with the stdlib parser: one tile per distinct block with the right devices and
sizes (checked against ``to_local()`` shapes and against an independent balanced-split oracle),
partial sums drawn as stacked addends, nd legends and device grids present, nothing external. Text
renderings are compared with small exact snapshots.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys
import textwrap
from html.parser import HTMLParser

import numpy as np
import pytest

import jsbp
from jsbp import viz
from jsbp._boxing import Move
from jsbp._layout import layout_of, normalise_nd
from jsbp.debug import count_collectives

# -------------------------------------------------------------------------------------------
# parsing the HTML
# -------------------------------------------------------------------------------------------

_VOID = {"br", "img", "input", "meta", "link", "hr", "rect", "polygon", "path", "line", "circle"}


@dataclasses.dataclass
class Node:
    tag: str
    attrs: dict
    children: list = dataclasses.field(default_factory=list)
    text: list = dataclasses.field(default_factory=list)

    def classes(self):
        return self.attrs.get("class", "").split()

    def iter(self):
        yield self
        for c in self.children:
            yield from c.iter()

    def all_text(self):
        return "".join(self.text) + "".join(c.all_text() for c in self.children if c.tag != "title")

    def lines(self):
        """The visible SVG text lines of this node (one per <text>)."""
        return [n.all_text() for n in self.iter() if n.tag == "text"]

    def find(self, cls=None, tag=None):
        return [
            n
            for n in self.iter()
            if (cls is None or cls in n.classes()) and (tag is None or n.tag == tag)
        ]


class _Tree(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = Node("#root", {})
        self.stack = [self.root]
        self.tags = []

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.tags.append((tag, node.attrs))
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        node = Node(tag, dict(attrs))
        self.tags.append((tag, node.attrs))
        self.stack[-1].children.append(node)

    def handle_endtag(self, tag):
        if tag in _VOID:
            return
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return
        raise AssertionError(f"unbalanced </{tag}>")

    def handle_data(self, data):
        self.stack[-1].text.append(data)


def parse(html: str) -> _Tree:
    tree = _Tree()
    tree.feed(html)
    tree.close()
    assert len(tree.stack) == 1, f"unclosed tags: {[n.tag for n in tree.stack[1:]]}"
    return tree


def assert_self_contained(html: str):
    tree = parse(html)
    for tag, attrs in tree.tags:
        assert tag not in ("script", "iframe", "link", "img", "object", "embed", "style"), tag
        for k, v in attrs.items():
            assert not k.startswith("on"), f"event handler {k} on <{tag}>"
            if k in ("src", "href", "xlink:href"):
                raise AssertionError(f"external reference {k}={v!r} on <{tag}>")
            if k == "xmlns":
                continue
            assert "url(" not in (v or "") and "http" not in (v or ""), (tag, k, v)
    assert "@import" not in html and "<script" not in html.lower()
    return tree


def tiles(html: str):
    """[(rows, cols, devices, layers, size, lines, classes)] of every tile, in drawing order."""
    tree = assert_self_contained(html)
    out = []
    for g in tree.root.find("jsbp-tile"):
        a = g.attrs
        out.append(
            dict(
                rows=a.get("data-rows"),
                cols=a.get("data-cols"),
                devices=[int(d) for d in a["data-devices"].split()],
                layers=int(a["data-layers"]),
                size=a["data-size"],
                lines=g.lines(),
                title="".join(t.all_text() for t in g.children if t.tag == "title"),
                classes=g.classes(),
                cards=len(g.find("jsbp-card", "polygon")),
            )
        )
    return out


# -------------------------------------------------------------------------------------------
# an independent oracle for the blocks: OneFlow's balanced splitter, applied outer axis first
# -------------------------------------------------------------------------------------------


def oracle_blocks(shape, nd, hierarchy):
    """{flat device index: ((offset, size) per dim)} computed from scratch."""
    out = {}
    for i, coord in enumerate(itertools.product(*(range(k) for k in hierarchy))):
        blk = []
        for d, n in enumerate(shape):
            off, size = 0, n
            for a, s in enumerate(nd):
                if s.startswith("S") and int(s[2:-1]) == d:
                    k = hierarchy[a]
                    q, r = divmod(size, k)
                    sizes = [q + 1 if j < r else q for j in range(k)]
                    off += sum(sizes[: coord[a]])
                    size = sizes[coord[a]]
            blk.append((off, size))
        out[i] = tuple(blk)
    return out


def placement_of(hierarchy, names=None):
    n = math.prod(hierarchy)
    return jsbp.placement("cpu", np.arange(n).reshape(hierarchy), axis_names=names)


# -------------------------------------------------------------------------------------------
# tensors
# -------------------------------------------------------------------------------------------


def test_uneven_split_tiles_match_local_shards():
    p = placement_of((4,))
    x = jsbp.tensor(np.arange(175.0, dtype=np.float32).reshape(25, 7), placement=p, sbp="S(0)")
    got = tiles(viz.tensor_html(x))
    assert [t["rows"] for t in got] == ["0:7", "7:13", "13:19", "19:25"]
    assert [t["cols"] for t in got] == ["0:7"] * 4
    assert [t["devices"] for t in got] == [[0], [1], [2], [3]]
    assert [t["size"] for t in got] == ["7×7", "6×7", "6×7", "6×7"]
    locals_ = x.to_local()
    for t, loc in zip(got, locals_):
        assert t["size"] == "×".join(map(str, loc.shape))
        assert t["lines"][0] == f"d{t['devices'][0]}" and t["lines"][-1] == t["size"]
        assert "jsbp-partial" not in t["classes"] and t["layers"] == 1


def test_repr_html_hooks_use_viz():
    p = placement_of((2, 4), ("dp", "tp"))
    x = jsbp.ones(5, 6, placement=p, sbp=("S(0)", "S(1)"))
    assert x._repr_html_() == viz.tensor_html(x)
    assert p._repr_html_() == viz.placement_html(p)
    got = tiles(x._repr_html_())
    assert len(got) == 8
    by_dev = {t["devices"][0]: t["size"] for t in got}
    for r, loc in zip(p.ranks.reshape(-1).tolist(), x.to_local()):
        assert by_dev[r] == "×".join(map(str, loc.shape))


def test_empty_shards_are_drawn_and_marked():
    p = placement_of((4,))
    x = jsbp.ones(3, placement=p, sbp="S(0)")
    got = tiles(viz.tensor_html(x))
    assert [t["cols"] for t in got] == ["0:1", "1:2", "2:3", "3:3"]
    assert all(t["rows"] is None for t in got)  # 1-d: one row of tiles
    assert [t["size"] for t in got] == ["1", "1", "1", "0"]
    assert ["jsbp-empty" in t["classes"] for t in got] == [False, False, False, True]
    assert " ".join(got[3]["lines"]) == "d3 0 empty"  # wrapped to the narrow tile


def test_broadcast_is_one_tile_shared_by_all_devices():
    p = placement_of((4,))
    x = jsbp.ones(6, 5, placement=p, sbp="B")
    (t,) = tiles(viz.tensor_html(x))
    assert t["devices"] == [0, 1, 2, 3] and t["layers"] == 1 and t["size"] == "6×5"
    assert t["lines"][0] == "d0 d1 d2 d3"
    svg = parse(viz.tensor_html(x)).root.find("jsbp-tile")[0]
    stripes = [n for n in svg.iter() if n.tag == "rect" and "rgba" in n.attrs.get("fill", "")]
    assert len(stripes) == 4  # one colour stripe per device sharing the tile


def test_partial_sum_is_drawn_as_stacked_addends():
    p = placement_of((4,))
    x = jsbp.from_local(
        [np.full((2, 3), float(i), np.float32) for i in range(4)], placement=p, sbp="P"
    )
    html = viz.tensor_html(x)
    (t,) = tiles(html)
    assert "jsbp-partial" in t["classes"]
    assert t["layers"] == 4 and t["cards"] == 3  # front card + three back cards
    assert t["lines"][0] == "P: sum of 4"
    assert "d0 / + d1 / + d2 / + d3" in t["title"]
    tree = parse(html)
    assert tree.root.find("jsbp-partial-note")[0].all_text() == "4 stacked addends (sum)"


def test_partial_max_words():
    p = placement_of((2,))
    x = jsbp.ones(2, 2, placement=p, sbp="B").to_global(sbp="Pmax")
    (t,) = tiles(viz.tensor_html(x))
    assert t["title"].endswith("Pmax: max of 2 / d0 / · d1 / 2×2")


def test_nd_placement_legend_and_device_grid():
    p = placement_of((2, 4), ("dp", "tp"))
    x = jsbp.ones(5, 6, placement=p, sbp=("P", "S(1)"))
    html = viz.tensor_html(x)
    tree = assert_self_contained(html)
    legend = tree.root.find("jsbp-legend-row")
    assert [r.attrs["data-axis"] for r in legend] == ["0", "1"]
    cells = [[c.all_text() for c in r.children] for r in legend]
    assert cells[0][:4] == ["0", "dp", "2", "P"] and cells[1][:4] == ["1", "tp", "4", "S(1)"]
    assert "partial sum: 2 addends" in cells[0][4]
    assert cells[1][4] == "cuts dim 1: 6 -> 2, 2, 1, 1"
    devices = tree.root.find("jsbp-device")
    assert [(d.attrs["data-device"], d.attrs["data-coord"]) for d in devices] == [
        (str(r), f"{i},{j}") for i in range(2) for j in range(4) for r in [p.ranks[i, j]]
    ]
    heads = tree.root.find("jsbp-devices")[0].lines()[:2]
    assert heads == ["→ tp (4): S(1)", "↓ dp (2): P"]
    got = tiles(html)
    assert [t["cols"] for t in got] == ["0:2", "2:4", "4:5", "5:6"]
    assert [t["devices"] for t in got] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(t["layers"] == 2 and "jsbp-partial" in t["classes"] for t in got)
    assert got[2]["lines"] == ["P: sum of 2", "d2", "+ d6", "5×1"]


def test_three_d_placement_device_blocks():
    p = placement_of((2, 2, 2), ("pp", "dp", "tp"))
    lay = layout_of(p, normalise_nd(("S(0)", "S(1)", "B"), (16, 12), p), (16, 12))
    tree = assert_self_contained(viz.tensor_html(lay))
    heads = tree.root.find("jsbp-devices")[0].lines()
    assert heads[:3] == ["→ tp (2): B", "↓ dp (2): S(1)", "▦ pp (2): S(0): one block per index"]
    assert "pp=0" in heads and "pp=1" in heads
    assert len(tree.root.find("jsbp-legend-row")) == 3
    got = tiles(viz.tensor_html(lay))
    assert [t["devices"] for t in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert {t["size"] for t in got} == {"8×6"}


CASES_1D = ["S(0)", "S(1)", "B", "P"]
CASES_2D = [(a, b) for a in CASES_1D for b in CASES_1D]


@pytest.mark.parametrize("hierarchy", [(4,), (3,), (2, 4), (2, 2), (2, 2, 2)])
@pytest.mark.parametrize("shape", [(8, 8), (25, 7), (3, 5), (0, 4)])
def test_tiles_cover_the_tensor_exactly(hierarchy, shape):
    """Every nd-sbp: tiles partition the drawn tensor; each device sits in exactly one tile, whose
    rectangle is the device's block (oracle); B devices share layers, P devices stack."""
    p = placement_of(hierarchy)
    for nd in itertools.product(CASES_1D, repeat=len(hierarchy)):
        lay = layout_of(p, normalise_nd(nd, shape, p), shape)
        got = tiles(viz.tensor_html(lay))
        blocks = oracle_blocks(shape, nd, hierarchy)
        covered = np.zeros(shape, dtype=np.int64)
        seen = []
        for t in got:
            r0, r1 = map(int, t["rows"].split(":"))
            c0, c1 = map(int, t["cols"].split(":"))
            covered[r0:r1, c0:c1] += 1
            assert t["size"] == f"{r1 - r0}×{c1 - c0}"
            for dev in t["devices"]:
                assert blocks[dev] == ((r0, r1 - r0), (c0, c1 - c0)), (nd, dev, t)
            n_partial = math.prod(k for k, s in zip(hierarchy, nd) if s == "P")
            n_copies = math.prod(k for k, s in zip(hierarchy, nd) if s == "B")
            assert t["layers"] == n_partial, (nd, t)
            if r1 > r0 and c1 > c0:
                assert len(t["devices"]) == n_partial * n_copies
            else:  # devices whose blocks are empty at the same place share the empty tile
                assert len(t["devices"]) % (n_partial * n_copies) == 0
                assert "jsbp-empty" in t["classes"]
            assert ("jsbp-partial" in t["classes"]) == ("P" in nd)
            seen += t["devices"]
        assert sorted(seen) == list(range(math.prod(hierarchy))), nd
        assert (covered == 1).all(), nd


def test_three_d_tensor_dims():
    p = placement_of((2, 4), ("dp", "tp"))
    x = jsbp.ones(4, 6, 8, placement=p, sbp=("S(0)", "S(2)"))
    default = tiles(viz.tensor_html(x))  # the split dims (0, 2)
    assert len(default) == 8 and default[0]["rows"] == "0:2" and default[0]["cols"] == "0:2"
    assert all(len(t["devices"]) == 1 for t in default)
    assert "drawing dims (0, 2), dims [1] are not drawn" in viz.tensor_html(x)
    side = tiles(viz.tensor_html(x, dims=(1, 2)))  # dim 0 is hidden: two slices per tile
    assert [t["cols"] for t in side] == ["0:2", "2:4", "4:6", "6:8"]
    assert [t["rows"] for t in side] == ["0:6"] * 4
    assert side[1]["devices"] == [1, 5] and side[1]["layers"] == 2
    assert side[1]["lines"][:2] == ["dim0 0:2: d1", "dim0 2:4: d5"]
    row = tiles(viz.tensor_html(x, dims=(2,)))
    assert [t["cols"] for t in row] == ["0:2", "2:4", "4:6", "6:8"] and row[0]["rows"] is None
    neg = tiles(viz.tensor_html(x, dims=(-2, -1)))
    assert [t["cols"] for t in neg] == [t["cols"] for t in side]
    for bad in [(0, 0), (0, 3), (0, 1, 2), "x"]:
        with pytest.raises(jsbp.SbpError, match="dims"):
            viz.tensor_html(x, dims=bad)


def test_scalar_is_one_tile():
    p = placement_of((4,))
    (t,) = tiles(viz.tensor_html(jsbp.full((), 3.0, placement=p, sbp="B")))
    assert t["rows"] is None and t["cols"] is None and t["size"] == "scalar"
    assert t["devices"] == [0, 1, 2, 3]


def test_placement_html():
    p = placement_of((2, 4), ("dp", "tp"))
    tree = assert_self_contained(viz.placement_html(p))
    devs = tree.root.find("jsbp-device")
    assert [int(d.attrs["data-device"]) for d in devs] == list(range(8))
    assert [d.lines()[0] for d in devs] == [f"d{i}" for i in range(8)]
    rows = [[c.all_text() for c in r.children] for r in tree.root.find(tag="tr")[1:]]
    assert rows == [["0", "dp", "2"], ["1", "tp", "4"]]


def test_colours_are_theme_safe():
    """Text and strokes follow the page's colour; fills are translucent (light and dark themes)."""
    p = placement_of((2, 4), ("dp", "tp"))
    html = viz.tensor_html(jsbp.ones(5, 6, placement=p, sbp=("P", "S(1)")))
    tree = parse(html)
    for tag, attrs in tree.tags:
        if tag == "text":
            assert attrs["fill"] == "currentColor"
        if "stroke" in attrs:
            assert attrs["stroke"] == "currentColor"
        fill = attrs.get("fill")
        if fill and fill not in ("none", "currentColor"):
            alpha = float(fill.rsplit(",", 1)[1].rstrip(")"))
            assert 0 < alpha < 1, fill
        style = attrs.get("style", "")
        assert (
            "color:#" not in style
            and "background:#" not in style
            and "background:white" not in style
        )


# -------------------------------------------------------------------------------------------
# boxing
# -------------------------------------------------------------------------------------------


def steps(html):
    tree = assert_self_contained(html)
    return [
        (s.attrs["data-axes"], s.attrs["data-collective"], float(s.attrs["data-bytes"]))
        for s in tree.root.find("jsbp-step")
    ], tree


def test_boxing_all_gather_uneven():
    p = placement_of((4,))
    x = jsbp.tensor(np.arange(175.0, dtype=np.float32).reshape(25, 7), placement=p, sbp="S(0)")
    got, tree = steps(viz.boxing_html(x, "B"))
    # each device receives the 3 blocks it does not hold: 700 B total, a quarter of it held
    assert got == [("0", "all-gather", 525.0)]
    figs = tree.root.find("jsbp-layout")
    assert len(figs) == 2
    before = [t for t in figs[0].find("jsbp-tile")]
    after = [t for t in figs[1].find("jsbp-tile")]
    assert [t.attrs["data-size"] for t in before] == ["7×7", "6×7", "6×7", "6×7"]
    assert [t.attrs["data-devices"] for t in after] == ["0 1 2 3"]
    assert (
        tree.root.find("jsbp-totals")[0].all_text()
        == "1 collective (all-gather ×1) · 525 B received per device"
    )
    fn = lambda t: t.to_global(sbp="B")
    assert count_collectives(fn, x)["all-gather"] == 1


def test_boxing_nd_steps_match_the_compiled_program():
    p = placement_of((2, 4), ("dp", "tp"))
    x = jsbp.ones(8, 8, placement=p, sbp=("S(0)", "S(1)"))
    got, tree = steps(viz.boxing_html(x, ("S(1)", "B")))
    kinds = [c for _, c, _ in got if c != "none"]
    counts = count_collectives(lambda t: t.to_global(sbp=("S(1)", "B")), x)
    assert sorted(kinds) == sorted(k for k, n in counts.items() for _ in range(n))
    assert len(tree.root.find("jsbp-layout")) == len(got) + 1
    assert len(tree.root.find("jsbp-step-row")) == len(got)


def test_boxing_partial_to_broadcast_shows_local_steps():
    p = placement_of((2, 4), ("dp", "tp"))
    x = jsbp.ones(5, 6, placement=p, sbp=("P", "S(1)"))
    got, tree = steps(viz.boxing_html(x, ("B", "B")))
    assert got == [("1", "none", 0.0), ("0,1", "all-reduce", 210.0)]
    texts = [s.all_text() for s in tree.root.find("jsbp-badge")]
    assert texts == ["zero-fill", "all-reduce"]
    mid = tree.root.find("jsbp-layout")[1].find("jsbp-tile")
    assert len(mid) == 1 and mid[0].attrs["data-layers"] == "8"


def test_boxing_nothing_to_do_and_cross_placement():
    p = placement_of((4,))
    x = jsbp.ones(4, 4, placement=p, sbp="S(0)")
    got, tree = steps(viz.boxing_html(x))
    assert got == [] and "nothing to do" in tree.root.find("jsbp-totals")[0].all_text()
    q = jsbp.placement("cpu", [4, 5, 6, 7])
    got, _ = steps(viz.boxing_html(x, placement=q))
    assert got == [("", "none", 16.0)]  # each device sends its 1x4 float32 block
    r = jsbp.placement("cpu", [4, 5])
    got, tree = steps(viz.boxing_html(x, "S(1)", placement=r))
    assert [c for _, c, _ in got] == ["all-gather", "none", "none"]
    after = tree.root.find("jsbp-layout")[-1].find("jsbp-tile")
    assert [t.attrs["data-devices"] for t in after] == ["4", "5"]
    with pytest.raises(jsbp.PlacementError, match="placement=p"):
        viz.boxing_html(x, q)


def test_boxing_steps_are_the_planners_moves():
    from jsbp._boxing import plan

    p = placement_of((2, 2))
    for src, dst in itertools.product(CASES_2D, repeat=2):
        a = layout_of(p, normalise_nd(src, (6, 5), p), (6, 5))
        b = layout_of(p, normalise_nd(dst, (6, 5), p), (6, 5))
        st = viz.boxing_steps(a, dst)  # a Layout: 4-byte items
        moves = plan(a.nd_sbp, b.nd_sbp, (6, 5), (2, 2), 4)
        assert [(s.axes, s.collective, s.bytes_per_device) for s in st] == [
            (m.axes, m.collective, m.bytes_per_device) for m in moves
        ]
        if st:
            assert st[0].before == a and st[-1].after == b


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_boxing_steps_count_bytes_at_the_width_they_move(dtype):
    """A 16-bit float's partial sums are reduced in float32 (one rounding): the pictures' bytes
    are those the collectives carry, as ``explain`` and the planner count them; a gather moves
    the 16-bit values themselves."""
    import jax.numpy as jnp

    p = placement_of((4,))
    x32 = jsbp.ones(16, 8, placement=p, sbp="P")
    x16 = jsbp.ones(16, 8, placement=p, sbp="P", dtype=getattr(jnp, dtype))
    for dst in ("B", "S(0)"):  # all-reduce, reduce-scatter
        wide, got = viz.boxing_steps(x32, dst), viz.boxing_steps(x16, dst)
        assert [s.collective for s in got] == [s.collective for s in wide]
        assert [s.bytes_per_device for s in got] == [s.bytes_per_device for s in wide]
        lines = lambda t: [ln for ln in t.splitlines() if ln.startswith(("  1.", "  total"))]
        assert lines(viz.boxing_text(x16, dst)) == lines(viz.boxing_text(x32, dst))
    s32 = jsbp.ones(16, 8, placement=p, sbp="S(0)")
    s16 = jsbp.ones(16, 8, placement=p, sbp="S(0)", dtype=getattr(jnp, dtype))
    (g32,), (g16,) = viz.boxing_steps(s32, "B"), viz.boxing_steps(s16, "B")
    assert g16.collective == "all-gather" and g16.bytes_per_device == g32.bytes_per_device / 2


# -------------------------------------------------------------------------------------------
# plans (duck-typed; jsbp.explain will feed these)
# -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    primitive: str
    inputs: tuple
    signature: str
    boxings: tuple = ()


PLAN = [  # the same interface three ways: a mapping, an object with a tuple entry, one with a Move
    {"primitive": "dot_general", "in_sbps": ["(S(0))", "(B)"], "signature": "(S(0), B) -> S(0)"},
    Row("reduce_sum", (("S(0)",),), "(S(0)) -> P", (("all-reduce", (0,), 2048.0),)),
    Row(
        "add",
        ((jsbp.sbp.broadcast,), (jsbp.sbp.split(0),)),
        "(S(0), S(0)) -> S(0)",
        (Move((0,), jsbp.sbp.broadcast, jsbp.sbp.split(0), None, 0.0),),
    ),
]


def test_plan_text_snapshot():
    assert viz.plan_text(PLAN) == textwrap.dedent(
        """\
           #  primitive    inputs       signature             boxing             bytes/device
           1  dot_general  (S(0)), (B)  (S(0), B) -> S(0)     -                  -
        *  2  reduce_sum   (S(0))       (S(0)) -> P           all-reduce on [0]  2.0 KiB
           3  add          (B), (S(0))  (S(0), S(0)) -> S(0)  local on [0]       0 B
        total: 3 equations · 2 with boxing · all-reduce ×1 · 2.0 KiB received per device"""
    )


def test_plan_html_rows_and_totals():
    tree = assert_self_contained(viz.plan_html({"rows": PLAN}))
    rows = tree.root.find("jsbp-row")
    assert len(rows) == 3
    assert ["jsbp-boxed" in r.classes() for r in rows] == [False, True, False]
    assert ["jsbp-local-boxing" in r.classes() for r in rows] == [False, False, True]
    assert [r.attrs["data-collectives"] for r in rows] == ["0", "1", "0"]
    assert [n.all_text() for n in rows[1].find(tag="b")] == ["all-reduce on [0]"]
    assert (
        tree.root.find("jsbp-totals")[0]
        .all_text()
        .startswith("3 equations · 2 with boxing · all-reduce ×1")
    )
    given = viz.plan_text(
        {"rows": PLAN, "totals": {"bytes_per_device": 4096, "collectives": {"all-gather": 2}}}
    )
    assert (
        given.splitlines()[-1]
        == "total: 3 equations · 2 with boxing · all-gather ×2 · 4.0 KiB received per device"
    )
    with pytest.raises(TypeError, match="signature"):
        viz.plan_text([{"primitive": "add", "inputs": []}])


def test_explain_plan_renders():
    """``jsbp.explain``'s plan is a plan of this interface; its HTML repr is ``plan_html``."""
    m = placement_of((2, 4), ("dp", "tp"))
    x = jsbp.ones(8, 16, placement=m, sbp=("S(0)", "B"))
    w = jsbp.ones(16, 8, placement=m, sbp=("B", "S(1)"))
    plan = jsbp.explain(lambda x, w: jsbp.to_global(x @ w, sbp=("B", "B")), x, w)
    html = plan._repr_html_()
    assert html == viz.plan_html(plan)
    tree = assert_self_contained(html)
    rows = tree.root.find("jsbp-row")
    assert len(rows) == len(plan.rows) + len(plan.output_boxings)
    want = {k: v for k, v in plan.collectives().items() if v}
    assert sum(want.values()) >= 1
    assert sum(int(r.attrs["data-collectives"]) for r in rows) == sum(want.values())
    n_boxed = sum(1 for r in plan.rows if any(b.collectives for b in r.boxings))
    assert len(tree.root.find("jsbp-boxed")) == n_boxed + sum(
        1 for b in plan.output_boxings if b.collectives
    )
    what = ", ".join(f"{k} ×{v}" for k, v in sorted(want.items()))
    assert what in tree.root.find("jsbp-totals")[0].all_text()
    text = viz.plan_text(plan)
    assert text.splitlines()[0] == f"plan on {m}"
    body = text.splitlines()[2:-1]
    assert len(body) == len(plan.rows) + len(plan.output_boxings)
    for line, r in zip(body, plan.rows):
        assert r.primitive in line and line.startswith("*") == any(b.collectives for b in r.boxings)


# -------------------------------------------------------------------------------------------
# text snapshots
# -------------------------------------------------------------------------------------------


def test_tensor_text_snapshot_uneven():
    p = placement_of((4,))
    x = jsbp.zeros(25, 7, placement=p, sbp="S(0)")
    assert viz.tensor_text(x) == textwrap.dedent(
        """\
        GlobalTensor float32[25, 7] on cpu:4['ax0'] · sbp (S(0))
          ax0 (4): S(0)  cuts dim 0: 25 -> 7, 6, 6, 6
        rows: dim 0 · columns: dim 1
                0:7
              ┌─────┐
          0:7 │ d0  │
              │ 7×7 │
              ├─────┤
         7:13 │ d1  │
              │ 6×7 │
              ├─────┤
        13:19 │ d2  │
              │ 6×7 │
              ├─────┤
        19:25 │ d3  │
              │ 6×7 │
              └─────┘"""
    )


def test_tensor_text_snapshot_nd_partial():
    p = placement_of((2, 2), ("dp", "tp"))
    x = jsbp.zeros(3, 5, placement=p, sbp=("P", "S(1)"))
    assert viz.tensor_text(x) == textwrap.dedent(
        """\
        GlobalTensor float32[3, 5] on cpu:2x2['dp', 'tp'] · sbp (P, S(1))
          dp (2): P     partial sum: 2 addends, the value is their sum
          tp (2): S(1)  cuts dim 1: 5 -> 3, 2
        rows: dim 0 · columns: dim 1
                  0:3           3:5
            ┌─────────────┬─────────────┐
        0:3 │ P: sum of 2 │ P: sum of 2 │
            │ d0          │ d1          │
            │ + d2        │ + d3        │
            │ 3×3         │ 3×2         │
            └─────────────┴─────────────┘"""
    )


def test_tensor_text_snapshot_row_and_scalar():
    p = placement_of((4,))
    assert viz.tensor_text(jsbp.zeros(3, placement=p, sbp="S(0)")).splitlines()[3:] == [
        "  0:1   1:2   2:3     3:3",
        "┌─────┬─────┬─────┬─────────┐",
        "│ d0  │ d1  │ d2  │ d3      │",
        "│ 1   │ 1   │ 1   │ 0 empty │",
        "└─────┴─────┴─────┴─────────┘",
    ]
    assert viz.tensor_text(jsbp.zeros((), placement=placement_of((2,)), sbp="B")).splitlines()[
        2:
    ] == [
        "scalar",
        "┌────────┐",
        "│ d0 d1  │",
        "│ scalar │",
        "└────────┘",
    ]


def test_boxing_text_snapshot():
    p = placement_of((2,))
    x = jsbp.zeros(3, 2, placement=p, sbp="S(0)")
    assert viz.boxing_text(x, "S(1)") == textwrap.dedent(
        """\
        boxing float32[3, 2] on cpu:2['ax0']: (S(0)) -> (S(1))
          1. ax0 (2): S(0) -> S(1)  all-to-all  6 B/device
          total: 1 collective (all-to-all ×1) · 6 B received per device
        before: (S(0)) on cpu:2['ax0']
          ax0 (2): S(0)  cuts dim 0: 3 -> 2, 1
              0:2
            ┌─────┐
        0:2 │ d0  │
            │ 2×2 │
            ├─────┤
        2:3 │ d1  │
            │ 1×2 │
            └─────┘
        after: (S(1)) on cpu:2['ax0']
          ax0 (2): S(1)  cuts dim 1: 2 -> 1, 1
              0:1   1:2
            ┌─────┬─────┐
        0:3 │ d0  │ d1  │
            │ 3×1 │ 3×1 │
            └─────┴─────┘"""
    )


def test_placement_text_snapshot():
    p = placement_of((2, 2, 2), ("pp", "dp", "tp"))
    assert viz.placement_text(p) == textwrap.dedent(
        """\
        placement cpu:2x2x2['pp', 'dp', 'tp']: pp (2), dp (2), tp (2)
          pp=0
          d0 d1
          d2 d3
          pp=1
          d4 d5
          d6 d7"""
    )


# -------------------------------------------------------------------------------------------
# packaging rules
# -------------------------------------------------------------------------------------------


def test_core_does_not_import_viz_and_viz_needs_no_matplotlib():
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jsbp
        assert "jsbp.viz" not in sys.modules, "the core imported jsbp.viz"
        import jsbp.viz
        p = jsbp.placement.all("cpu")
        jsbp.viz.tensor_html(jsbp._layout.layout_of(p, jsbp._layout.normalise_nd("S(0)", (4, 4), p), (4, 4)))
        assert "matplotlib" not in sys.modules, "jsbp.viz imported matplotlib"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
