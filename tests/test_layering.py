"""Layering: the core never imports the outer packages, and no module imports its importer.

The core (``_sbp``, ``_placement``, ``_layout``, ``_boxing``, ``_tensor``, ``_lower``, ``_jit``,
``rules`` and the other private modules) imports nothing from ``viz``, ``flax``, ``pipeline``,
``checkpoint``, ``distributed`` or ``launch``; those plug in through ``jsbp._hooks``. Every
``import`` / ``from ... import`` of every core module is checked, including ones inside functions,
and ``importlib.import_module("...")`` calls with a literal name.

No import circle anywhere in ``jsbp/`` (the same imports, function-level ones included): a
module's import graph is a DAG.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "jsbp"
OUTER = ("viz", "flax", "pipeline", "checkpoint", "distributed", "launch")


def core_modules() -> list[pathlib.Path]:
    files = sorted(PKG.glob("_*.py")) + sorted((PKG / "rules").rglob("*.py"))
    files += [PKG / "numpy.py", PKG / "sbp.py"]
    return [f for f in files if f.name != "__init__.py" or f.parent != PKG]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(importer: str, is_pkg: bool, level: int, module: str | None) -> str:
    """The absolute name of ``from <'.' * level><module> import ...`` in module ``importer``."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    base = base if is_pkg else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_names(path: pathlib.Path, src: str | None = None):
    """(line, absolute module name) for every import in ``path`` (or in ``src`` read as if it
    lived at ``path``); for ``from X import a``, both ``X`` and ``X.a`` (``a`` may be a
    submodule, e.g. ``from . import viz``)."""
    tree = ast.parse(path.read_text() if src is None else src, filename=str(path))
    me, is_pkg = module_name(path), path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom):
            base = resolve(me, is_pkg, node.level, node.module)
            yield node.lineno, base
            for a in node.names:
                yield node.lineno, f"{base}.{a.name}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            name = node.args[0].value
            if name.startswith("."):
                pkg = (
                    node.args[1].value
                    if len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    else me
                )
                name = resolve(
                    pkg, True, len(name) - len(name.lstrip(".")), name.lstrip(".") or None
                )
            yield node.lineno, name


def module_edges(path: pathlib.Path, modules, src: str | None = None) -> set[str]:
    """The jsbp modules ``path`` imports (function-level imports included): ``from X import a``
    is an edge to ``X.a`` when that is a module, else to ``X``; a name that is not a module is
    cut back to the module that defines it. The ``__init__`` of a package runs whenever one of
    its modules is imported, but that implicit import is not an edge (else every module would
    circle through its package's re-exports)."""
    out = set()
    tree = ast.parse(path.read_text() if src is None else src, filename=str(path))
    me, is_pkg = module_name(path), path.name == "__init__.py"
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom):
            base = resolve(me, is_pkg, node.level, node.module)
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            names = (
                [n for line, n in imported_names(path, ast.unparse(node))]
                if isinstance(node, (ast.Import, ast.Call))
                else []
            )
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != me and n.split(".")[0] == "jsbp":
                out.add(n)
    return out


def import_graph(overrides: dict | None = None) -> dict[str, set[str]]:
    """``{module: the jsbp modules it imports}`` for every module of ``jsbp/``; ``overrides``
    maps a module name to source text read in place of its file."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    overrides = overrides or {}
    return {m: module_edges(p, files, overrides.get(m)) for m, p in files.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle: the strongly connected components of more than one module (or a
    module importing itself), each sorted (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    out.append(sorted(comp))
    return out


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert not circles, (
        "import circles in jsbp/ (a module imports, maybe inside a function, a module that imports "
        "it): "
        + "; ".join(" <-> ".join(c) for c in circles)
        + ". Move what both need into the lower module, or let the lower one register a hook."
    )


def test_circle_finder_sees_function_level_imports():
    """The flax package's circle before it was cut: ``Strategy.auto`` imported ``_auto`` inside
    the method, and ``_auto`` imports ``_strategy``; ``Schedule.html`` imported ``_timeline``,
    which imported ``_schedule``."""
    strategy = "class Strategy:\n    def auto(self):\n        from ._auto import auto_strategy\n"
    timeline = "from ._schedule import Schedule\n"
    graph = import_graph({"jsbp.flax._strategy": strategy, "jsbp.pipeline._timeline": timeline})
    assert "jsbp.flax._auto" in graph["jsbp.flax._strategy"]
    circles = import_circles(graph)
    assert any({"jsbp.flax._auto", "jsbp.flax._strategy"} <= set(c) for c in circles)
    assert ["jsbp.pipeline._schedule", "jsbp.pipeline._timeline"] in circles
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}) == [
        ["a", "b", "c"],
        ["d"],
    ]
    # `from . import _sbp` is an edge to the module, `from .._tensor import tensor` to _tensor,
    # never to the package __init__ (which imports everything)
    edges = module_edges(
        PKG / "flax" / "_probe.py",
        {"jsbp", "jsbp._sbp", "jsbp._tensor"},
        "from .. import _sbp\nfrom .._tensor import tensor\n",
    )
    assert edges == {"jsbp._sbp", "jsbp._tensor"}


def is_outer(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[0] == "jsbp" and parts[1] in OUTER


def test_resolve():
    assert resolve("jsbp._tensor", False, 1, "viz") == "jsbp.viz"
    assert (
        resolve("jsbp.rules.shape", False, 2, "distributed._transfer")
        == "jsbp.distributed._transfer"
    )
    assert resolve("jsbp.rules", True, 1, "_common") == "jsbp.rules._common"
    assert resolve("jsbp.rules", True, 2, None) == "jsbp"
    assert is_outer("jsbp.viz.tensor_html") and is_outer("jsbp.launch")
    assert not is_outer("jsbp._viz") and not is_outer("jsbp.debug._collectives")


def test_walker_sees_imports_inside_functions():
    probe = PKG / "rules" / "_probe.py"  # never written: the source is parsed as if it lived there
    src = (
        "class C:\n    def f(self):\n        from .. import viz\n        from ..distributed import g\n"
        "def h():\n    import jsbp.flax\n    importlib.import_module('..launch', 'jsbp.rules')\n"
    )
    bad = {n for _, n in imported_names(probe, src) if is_outer(n)}
    assert bad == {"jsbp.viz", "jsbp.distributed", "jsbp.distributed.g", "jsbp.flax", "jsbp.launch"}
    # the code before this change: _tensor.py imported viz and distributed inside methods
    old = "def _repr_html_(self):\n    from .viz import tensor_html\n"
    assert {n for _, n in imported_names(PKG / "_tensor.py", old) if is_outer(n)} == {
        "jsbp.viz",
        "jsbp.viz.tensor_html",
    }


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_core_imports_no_outer_package(path):
    bad = sorted({(line, name) for line, name in imported_names(path) if is_outer(name)})
    assert not bad, (
        f"{path.relative_to(PKG.parent)} imports an outer package: "
        + ", ".join(f"line {line}: {name}" for line, name in bad)
        + ". The core must not import viz/flax/pipeline/checkpoint/distributed/launch: register "
        "what it needs in jsbp/_hooks.py from the outer package (or jsbp/__init__.py) instead."
    )


def test_core_list_is_complete():
    names = {module_name(p) for p in core_modules()}
    for m in (
        "jsbp._sbp",
        "jsbp._placement",
        "jsbp._layout",
        "jsbp._boxing",
        "jsbp._tensor",
        "jsbp._problem",
        "jsbp._solve",
        "jsbp._lower",
        "jsbp._emit",
        "jsbp._jit",
        "jsbp._explain",
        "jsbp.rules",
        "jsbp.rules._registry",
    ):
        assert m in names


def test_html_and_multiprocess_hooks_after_import_jsbp():
    """A fresh ``import jsbp`` (as in Jupyter): the reprs render the viz HTML without importing
    ``jsbp.viz`` first, and the multi-process helpers of ``jsbp.distributed`` are registered."""
    code = textwrap.dedent(
        """
        import os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax
        jax.config.update("jax_num_cpu_devices", 4)
        import jsbp
        assert "jsbp.viz" not in sys.modules  # still lazy
        p = jsbp.placement("cpu", [0, 1, 2, 3])
        x = jsbp.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], placement=p, sbp="S(0)")
        h = x._repr_html_()
        assert h.startswith("<div") and "jsbp-tensor" in h, h[:200]
        assert "jsbp-placement" in p._repr_html_()
        w = jsbp.tensor([[1.0], [2.0]], placement=p, sbp="B")
        plan = jsbp.explain(lambda a, b: a @ b, x, w)
        h = plan._repr_html_()
        assert h.startswith("<") and "<pre>" not in h[:20], h[:200]
        from jsbp import _hooks, viz
        assert x._repr_html_() == viz.tensor_html(x)
        assert plan._repr_html_() == viz.plan_html(plan)
        need = {"spans_all_processes", "one_device_per_process", "send_blocks",
                "nearest_sources", "gather_local_meta"}
        assert need <= set(_hooks.multiprocess), sorted(_hooks.multiprocess)
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_render_html_fallback_without_renderer(monkeypatch):
    from jsbp import _hooks

    monkeypatch.setattr(_hooks, "html_renderers", {})
    assert _hooks.render_html("tensor", "a<b") == "<pre>a&lt;b</pre>"

    def missing(obj):
        raise ImportError("no viz")

    monkeypatch.setattr(_hooks, "html_renderers", {"plan": missing})
    assert _hooks.render_html("plan", "t") == "<pre>t</pre>"
    monkeypatch.setattr(_hooks, "multiprocess", {})
    with pytest.raises(RuntimeError, match="send_blocks"):
        _hooks.multiprocess_fn("send_blocks")
