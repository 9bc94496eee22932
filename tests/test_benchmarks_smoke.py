"""benchmarks/compiler.py runs end to end (``--quick``) and prints every table row.

No timing assertions: the numbers depend on the machine and its load; this only checks that the
benchmark still runs against the current jsbp (both contenders agree with one device — the script
exits non-zero otherwise) and that its report has the rows the docs quote.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("flax")
pytest.importorskip("optax")


def _benchmark(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """Run ``benchmarks/<script> *args`` as a user would (from the repository root, with the
    script setting up its own 8 CPU devices)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_compiler_benchmark_quick_prints_its_tables():
    res = _benchmark("compiler.py", "--quick", timeout=1800)
    out = res.stdout
    assert res.returncode == 0, f"benchmark failed ({res.returncode}):\n{out}\n{res.stderr[-4000:]}"
    for header in (
        "## (a) train step",
        "## (b) first call",
        "## collectives per step",
        "## (c) eager add",
    ):
        assert header in out, header
    for layout in ("DP (dp=8)", "TP (tp=8)", "DPxTP (2x4)"):
        # one row in each of the step, first-call and collectives tables
        rows = [line for line in out.splitlines() if line.startswith(f"| {layout} |")]
        assert len(rows) >= 3, (layout, rows)
    assert "| jsbp `x + y` |" in out
    assert "| `jax.jit(jnp.add)(a, b)` |" in out
    assert "target(s) missed" in out


@pytest.mark.slow
def test_models_benchmark_one_case_prints_its_table():
    """benchmarks/models.py (issue 18's zoo, jsbp vs GSPMD) runs one model x layout end to end."""
    res = _benchmark(
        "models.py",
        "--models",
        "cnn",
        "--layouts",
        "dp8",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--program",
        timeout=600,
    )
    assert res.returncode == 0, f"benchmark failed ({res.returncode}):\n{res.stderr[-4000:]}"
    rows = [line for line in res.stdout.splitlines() if line.startswith("| cnn | dp8 |")]
    assert len(rows) == 1, res.stdout
    cells = rows[0].strip("|").split("|")
    # both programs timed alone too (jsbp's, GSPMD's), and their ratio
    assert len(cells) == 14 and float(cells[11]) > 0 and float(cells[12]) > 0, rows[0]
    assert float(cells[13]) == pytest.approx(float(cells[11]) / float(cells[12]), abs=0.01), rows[0]


@pytest.mark.slow
def test_auto_benchmark_one_shape_prints_its_table():
    """benchmarks/auto.py (issue 20: Strategy.auto vs the hand-picked strategies) runs one shape
    end to end; every strategy's first losses match one device (it exits non-zero otherwise)."""
    res = _benchmark("auto.py", "--only", "gpt", "--steps", "2", "--warmup", "1", timeout=1800)
    out = res.stdout
    assert res.returncode == 0, f"benchmark failed ({res.returncode}):\n{out}\n{res.stderr[-4000:]}"
    for row in (
        "| dp8 |",
        "| tp8 |",
        "| dp2_tp4 |",
        "| zero1 |",
        "| zero2 |",
        "| zero3 |",
        "| **auto**",
    ):
        assert row in out, row


def test_device_check_runs_and_compares_with_jax_jit():
    """benchmarks/device_check.py (the one-device path against plain jax.jit, for a lent GPU) runs
    on the CPU: jsbp.jit's losses and parameters agree with jax.jit (it exits non-zero
    otherwise) and every variant gets a row."""
    res = _benchmark("device_check.py", "--sizes", "small", "--steps", "2", timeout=600)
    out = res.stdout
    assert res.returncode == 0, (
        f"device check failed ({res.returncode}):\n{out}\n{res.stderr[-4000:]}"
    )
    for label in ("jax.jit", "jsbp"):
        assert any(
            line.startswith(f"small: {label} ") and "ms/step" in line for line in out.splitlines()
        ), label
    assert "all variants match jax.jit" in out


@pytest.mark.slow
def test_planner_benchmark_quick_prints_its_tables(tmp_path):
    """benchmarks/planner.py --quick plans a handful of programs: a row each beside its recorded
    plan (tests/data/plan_costs.json), the totals, and the planning-time rows; --json writes the
    same figures."""
    out_json = tmp_path / "planner.json"
    res = _benchmark("planner.py", "--quick", "--json", str(out_json), timeout=1200)
    out = res.stdout
    assert res.returncode == 0, f"benchmark failed ({res.returncode}):\n{out}\n{res.stderr[-4000:]}"
    for name in ("gpt DP", "tests matmul_zero", "tests tp"):
        rows = [line for line in out.splitlines() if line.startswith(f"| {name} |")]
        assert len(rows) == 1, (name, out)
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        assert len(cells) == 6 and cells[1] != "-", rows[0]  # a recorded plan to compare with
    assert "| **total** (6 programs) |" in out
    for blocks in (1, 4):
        assert any(line.startswith(f"| DPxTP (2x4) | {blocks} |") for line in out.splitlines())
    import json

    data = json.loads(out_json.read_text())
    assert len(data["programs"]) == 6 and data["totals"]["compared"] == 6
    assert [r["layers"] for r in data["timing"]] == [1, 4]


def test_attention_benchmark_runs_each_plan():
    """benchmarks/attention.py at one short length: a row per plan, the ring's collectives."""
    res = _benchmark("attention.py", "--lengths", "256", "--reps", "1", timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [r for r in res.stdout.splitlines() if r.startswith("| 256 |")]
    assert [r.split("|")[2].strip() for r in rows[:4]] == ["one device", "gather", "ring", "heads"]
    assert rows[4].split("|")[2].strip().startswith("chosen: ")
    assert "collective-permute" in rows[2] and "all-gather" not in rows[2]


def test_moe_benchmark_runs_both_plans():
    """benchmarks/moe.py at one small size: the planner's row and the gathered row (both checked
    against one device by the script)."""
    res = _benchmark("moe.py", "--tokens", "256", "--reps", "1", timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    rows = [r.split("|")[2].strip() for r in res.stdout.splitlines() if r.startswith("| 256 |")]
    assert rows == ["planner's choice", "gathered experts"]


def test_minigpt_benchmark_one_layout_prints_its_row():
    """benchmarks/minigpt.py (the Flax docs' miniGPT: jsbp against the tutorial's own
    explicit-sharding step) on one layout: its row (the script checks the two sides' losses
    against each other and exits non-zero where they differ)."""
    res = _benchmark("minigpt.py", "--layouts", "dp8", "--steps", "1", "--warmup", "0", timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    (row,) = [r.split("|") for r in res.stdout.splitlines() if r.startswith("| dp8 |")]
    jsbp_coll = [c.strip() for c in row[-2].split(",")]
    # one combined all-reduce of the gradients; nothing moves over the 'model' axis of one device
    assert "1 AR" in jsbp_coll and not any(c.endswith(("RS", "A2A")) for c in jsbp_coll), row
