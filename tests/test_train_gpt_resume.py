"""examples/train_gpt.py: resume under another layout continues the same loss curve; pp= hands
off to the pipeline driver."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def _losses(*args):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", "--seed", "1", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["step"]: r["loss"] for r in map(json.loads, out.stdout.splitlines())}


def test_resume_under_another_layout_continues_the_loss_curve(tmp_path):
    # issue 7: 10 steps straight vs 5 steps, save, resume under another layout, 5 more
    straight = _losses("--parallel", "dp=8", "--steps", "10")
    first = _losses(
        "--parallel", "dp=8", "--steps", "5", "--save-every", "5", "--ckpt-dir", str(tmp_path)
    )
    second = _losses("--parallel", "dp=2,tp=4", "--steps", "10", "--resume", str(tmp_path))
    assert sorted(first) == list(range(5)) and sorted(second) == list(range(5, 10))
    resumed = {**first, **second}
    for step, loss in straight.items():
        assert abs(resumed[step] - loss) <= 1e-5 * abs(loss), (step, resumed[step], loss)


def test_pipeline_parallel_needs_microbatches():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--parallel", "pp=2,dp=2,tp=2", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 2 and "--microbatches" in out.stderr


def test_train_gpt_under_the_launcher_matches_one_process():
    # 2 processes x 4 simulated CPU devices form the same 8-device dp=2,tp=4 placement
    cmd = [
        sys.executable,
        "-m",
        "jsbp.launch",
        "--nproc-per-node",
        "2",
        "--devices-per-process",
        "4",
        str(SCRIPT),
        "--json",
        "--seed",
        "1",
        "--parallel",
        "dp=2,tp=4",
        "--steps",
        "3",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    per_rank: dict = {0: {}, 1: {}}
    for line in out.stdout.splitlines():
        if line.startswith("[rank ") and '"loss"' in line:
            rank = int(line[6 : line.index("]")])
            rec = json.loads(line[line.index("{") :])
            per_rank[rank][rec["step"]] = rec["loss"]
    single = _losses("--parallel", "dp=2,tp=4", "--steps", "3")
    assert sorted(per_rank[0]) == sorted(per_rank[1]) == sorted(single) == [0, 1, 2]
    for step, loss in single.items():
        for rank in (0, 1):  # the same losses on both processes, equal to the 8-device run
            assert abs(per_rank[rank][step] - loss) <= 1e-5 * abs(loss)


def test_pipeline_layouts_from_the_command_line_match_one_device():
    # issue 8's example: pp=2 x dp=2 x tp=2, 4 micro-batches, both schedules
    single = _losses("--parallel", "none", "--steps", "3")
    for schedule in ("1f1b", "gpipe"):
        piped = _losses(
            "--parallel",
            "pp=2,dp=2,tp=2",
            "--microbatches",
            "4",
            "--schedule",
            schedule,
            "--steps",
            "3",
        )
        assert sorted(piped) == [0, 1, 2]
        for step, loss in single.items():
            assert abs(piped[step] - loss) <= 1e-5 * abs(loss), (schedule, step, piped[step], loss)
