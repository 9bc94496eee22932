"""examples/train_gpt.py: resume under another layout continues the same loss curve; pp= hands
off to the pipeline driver."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"


def _losses(*args):
    out = subprocess.run([sys.executable, str(SCRIPT), "--json", "--seed", "1", *args],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["step"]: r["loss"] for r in map(json.loads, out.stdout.splitlines())}


def test_resume_under_another_layout_continues_the_loss_curve(tmp_path):
    straight = _losses("--parallel", "dp=8", "--steps", "6")
    first = _losses("--parallel", "dp=8", "--steps", "3", "--save-every", "3", "--ckpt-dir", str(tmp_path))
    second = _losses("--parallel", "dp=2,tp=4", "--steps", "6", "--resume", str(tmp_path))
    assert sorted(first) == [0, 1, 2] and sorted(second) == [3, 4, 5]
    resumed = {**first, **second}
    for step, loss in straight.items():
        assert abs(resumed[step] - loss) <= 1e-5 * abs(loss), (step, resumed[step], loss)


def test_pipeline_parallel_needs_microbatches():
    out = subprocess.run([sys.executable, str(SCRIPT), "--parallel", "pp=2,dp=2,tp=2", "--steps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "--microbatches" in out.stderr


def test_train_gpt_under_the_launcher_matches_one_process():
    # 2 processes x 4 simulated CPU devices form the same 8-device dp=2,tp=4 placement
    cmd = [sys.executable, "-m", "jsbp.launch", "--nproc-per-node", "2", "--devices-per-process", "4",
           str(SCRIPT), "--json", "--seed", "1", "--parallel", "dp=2,tp=4", "--steps", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    per_rank: dict = {0: {}, 1: {}}
    for line in out.stdout.splitlines():
        if line.startswith("[rank ") and '"loss"' in line:
            rank = int(line[6:line.index("]")])
            rec = json.loads(line[line.index("{"):])
            per_rank[rank][rec["step"]] = rec["loss"]
    single = _losses("--parallel", "dp=2,tp=4", "--steps", "3")
    assert sorted(per_rank[0]) == sorted(per_rank[1]) == sorted(single) == [0, 1, 2]
    for step, loss in single.items():
        for rank in (0, 1):  # the same losses on both processes, equal to the 8-device run
            assert abs(per_rank[rank][step] - loss) <= 1e-5 * abs(loss)
