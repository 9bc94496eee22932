"""The training examples run as documented: examples/train_gpt.py (the README's first command) and
examples/train_lenet.py (both views). Long runs are gated on JSBP_FULL=1."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from _examples import load_example
from flax import nnx

import jsbp
import jsbp.flax as jflax

FULL = os.environ.get("JSBP_FULL", "") not in ("", "0")
ROOT = pathlib.Path(__file__).resolve().parents[1]


tg = load_example("train_gpt")
tl = load_example("train_lenet")


def _run_example(*args, timeout=600):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------------------------
# train_gpt.py
# ------------------------------------------------------------------------------------------------


def test_parallel_flag_parsing():
    assert tg.parse_parallel("none") == {}
    assert tg.parse_parallel("dp=2,tp=4") == {"dp": 2, "tp": 4}
    assert tg.parse_parallel(" TP=8 ") == {"tp": 8}
    assert tg.parse_parallel("dp=2,cp=4") == {"dp": 2, "cp": 4}
    for bad in ("dp2", "xp=2", "dp=0", "dp=2,dp=4", "dp=two"):
        with pytest.raises(SystemExit):
            tg.parse_parallel(bad)


def test_pipeline_axis_is_refused_clearly(capsys):
    with pytest.raises(jsbp.SbpError, match="pipeline parallelism is not yet supported"):
        tg.make_strategy({"pp": 2, "dp": 4})
    # the command line hands pp > 1 to the pipeline driver, which needs the micro-batch count
    assert tg.main(["--parallel", "pp=2,dp=4", "--steps", "1", "--json"]) == 2
    assert "needs --microbatches" in capsys.readouterr().err
    with pytest.raises(jsbp.SbpError, match="needs a data-parallel axis"):
        tg.make_strategy({}, zero=1)


def test_corpus_is_shipped_and_batches_depend_only_on_the_seed():
    corpus = tg.Corpus()
    assert len(corpus.tokens) > 4000 and corpus.vocab % 8 == 0 and corpus.vocab >= len(corpus.chars)
    a, b = tg.Corpus().batches(3, 4, 16), corpus.batches(3, 4, 16)
    for _ in range(3):
        np.testing.assert_array_equal(next(a), next(b))
    assert not np.array_equal(next(corpus.batches(3, 4, 16)), next(corpus.batches(4, 4, 16)))


def test_train_gpt_parallel_auto_matches_one_device(capsys):
    """--parallel auto: Strategy.auto chooses the layouts, they are printed with the report, and
    training matches one device (a small model, so the search and the steps stay quick)."""
    cfg = tg.GPTConfig(vocab=56, seq=16, d_model=32, n_heads=4, n_layers=1, d_mlp=64)
    run = tg.train("auto", steps=3, seed=1, batch=8, cfg=cfg, memory_budget="64MiB")
    report = run.step_fn.strategy.report
    assert report is not None and report.chosen.fits and report.memory_budget == 64 * 2**20
    assert max(jflax.local_nbytes(run.sharded)) == report.state_bytes
    ref = tg.train("none", steps=3, seed=1, batch=8, cfg=cfg)
    np.testing.assert_allclose(run.losses, ref.losses, rtol=1e-5)
    assert tg.parse_parallel(" AUTO ") == "auto"
    assert tg.main(["--parallel", "dp=8", "--memory-budget", "64MiB", "--steps", "1"]) == 2
    assert "--memory-budget needs --parallel auto" in capsys.readouterr().err
    with pytest.raises(jsbp.SbpError, match="the ZeRO stage is part of what auto chooses"):
        tg.train("auto", zero=2, steps=1, cfg=cfg)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the --parallel auto command line: set JSBP_FULL=1")
def test_train_gpt_cli_parallel_auto_prints_the_choice():
    out = _run_example(
        "examples/train_gpt.py",
        "--parallel",
        "auto",
        "--memory-budget",
        "64MiB",
        "--steps",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "Strategy.auto:" in out.stderr
        and "chosen:" in out.stderr
        and "memory budget 64.00 MiB" in out.stderr
    )
    assert (
        "parameter layouts:" in out.stderr
        and "measured per device: model + optimizer state" in out.stderr
    )
    losses = [json.loads(line)["loss"] for line in out.stdout.splitlines() if line.strip()]
    np.testing.assert_allclose(losses, tg.train("none", steps=2).losses, rtol=1e-5)


def test_train_gpt_cli_json_matches_one_device():
    """No --parallel: the default dp=2,tp=4 on 8 simulated devices (a fresh process), with --json;
    the losses equal the single-device run of the same seed (same parameters, same batches)."""
    out = _run_example("examples/train_gpt.py", "--steps", "3", "--json", "--seed", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(isinstance(r["loss"], float) for r in rows)
    # layouts and the plan go to stderr under --json
    assert "blocks/0/mlp/fc/kernel" in out.stderr and "(B, S(1))" in out.stderr
    assert "collective(s) per step" in out.stderr and "'dp': 2" not in out.stdout
    ref = tg.train("none", steps=3, seed=1)
    np.testing.assert_allclose([r["loss"] for r in rows], ref.losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the full README demo: set JSBP_FULL=1")
def test_train_gpt_readme_command_runs_with_no_flags():
    out = _run_example("examples/train_gpt.py")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "parameter layouts:" in out.stdout and "plan:" in out.stdout and "final loss" in out.stdout
    )
    final = float(out.stdout.split("final loss ")[1].split()[0])
    assert final < 2.8  # from ln(56) ~ 4.0 at the start


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="every CLI layout: set JSBP_FULL=1")
@pytest.mark.parametrize(
    "flags",
    [
        ["--parallel", "dp=8", "--zero", "3"],
        ["--parallel", "tp=8", "--accum", "2"],
        ["--parallel", "dp=4,tp=2", "--zero", "2", "--accum", "2"],
    ],
)
def test_train_gpt_cli_layouts_agree(flags):
    out = _run_example("examples/train_gpt.py", "--steps", "3", "--json", *flags)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in out.stdout.splitlines() if line.strip()]
    np.testing.assert_allclose(losses, tg.train("none", steps=3).losses, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# train_lenet.py
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    return tl.load_digits(0)


def test_lenet_views_give_the_same_parameters(digits):
    p = jsbp.placement("cpu", list(range(8)), axis_names=("dp",))
    steps = 15
    consistent, lc = tl.train_consistent(p, steps, data=digits)
    mirrored, lm = tl.train_mirrored(p, steps, data=digits)
    single, ls = tl.train_consistent(
        jsbp.placement("cpu", [0], axis_names=("dp",)), steps, data=digits
    )
    assert tl.max_param_diff(consistent, mirrored) < 1e-6
    assert tl.max_param_diff(consistent, single) < 1e-6
    np.testing.assert_allclose(lc, lm, rtol=1e-5)
    np.testing.assert_allclose(lc, ls, rtol=1e-5)
    assert lc[-1] < 0.7 * lc[0]
    # the models are ordinary NNX modules again
    assert isinstance(consistent, tl.LeNet) and isinstance(mirrored, tl.LeNet)
    assert not any(isinstance(x, jsbp.GlobalTensor) for x in jax.tree.leaves(nnx.state(consistent)))


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="300 steps per view: set JSBP_FULL=1")
def test_lenet_cli_reaches_95_percent_in_both_views():
    out = _run_example("examples/train_lenet.py", "--view", "both")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    accs = [
        float(line.rsplit("accuracy ", 1)[1].split()[0])
        for line in out.stdout.splitlines()
        if "test accuracy" in line
    ]
    assert len(accs) == 2 and min(accs) >= 0.95
    diff = float(out.stdout.split("over all parameters: ")[1].split()[0])
    assert diff < 1e-4
