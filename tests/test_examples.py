"""The examples run as a newcomer runs them: in a fresh process, from the repository root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # a fresh interpreter: the demo sets its own device count; keep the parent's CPU-only choice
    env.pop("JSBP_DEMO_REAL", None)
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_demo_runs_and_checks_against_numpy():
    res = _run("examples/demo.py")
    out = res.stdout
    assert res.returncode == 0, f"demo failed ({res.returncode}):\n{out}\n{res.stderr[-3000:]}"
    assert "8 simulated cpu devices" in out
    # placements: 1-d and a 2 x 4 grid
    assert "hierarchy (4,)" in out
    assert "hierarchy (2, 4), axis names ('dp', 'tp')" in out
    # the balanced splitter: 25 rows over 4 devices
    assert "sbp S(0)  on p: local shapes [(7, 3), (6, 3), (6, 3), (6, 3)]" in out
    assert "sbp B     on p: local shapes [(25, 3), (25, 3), (25, 3), (25, 3)]" in out
    # boxings name the collective they compiled to, and each matches numpy
    lines = out.splitlines()

    def row(prefix: str) -> str:
        hits = [ln for ln in lines if ln.strip().startswith(prefix)]
        assert len(hits) >= 1, f"no line starting with {prefix!r} in:\n{out}"
        return hits[0]

    assert "1 all-gather" in row("S(0) -> B on p")
    assert "1 all-to-all" in row("S(0) -> S(1) on p")
    assert "no communication" in row("B -> S(1) on p")
    assert "1 all-reduce" in row("P -> B on p")
    assert "1 reduce-scatter" in row("P -> S(0) on p")
    assert "all-reduce" not in row("P -> S(0) on p")
    assert "1 reduce-scatter" in row("(P, P) -> (S(0), S(0)) on q")
    assert "DOES NOT MATCH" not in out
    assert out.count("matches numpy") >= 12
    # the gradient comes back in the layout of x, with single-device values
    assert "jax.grad(loss)(x) is a GlobalTensor with sbp S(0)" in out
    assert "values vs jax.grad on one device: matches numpy" in out
    m = re.search(r"(\d+)/(\d+) checks match numpy", out)
    assert m and m.group(1) == m.group(2), out[-500:]


def test_demo_real_devices_flag_needs_eight():
    """--real uses JAX's own devices; on a machine with fewer than 8 it says so and exits 2."""
    env_platforms = os.environ.get("JAX_PLATFORMS", "")
    res = _run("examples/demo.py", "--real")
    if res.returncode == 0:  # a machine with 8 real devices (or 8 configured CPU devices)
        assert "8 real" in res.stdout
    else:
        assert res.returncode == 2, (env_platforms, res.stdout, res.stderr[-2000:])
        assert "This demo needs 8 devices" in res.stdout
