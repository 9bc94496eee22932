"""The README's tour runs as written, and .ci/run runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tour_code():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    return blocks[0]


def test_readme_tour_runs(capsys):
    code = _tour_code().replace(
        'jax.config.update("jax_num_cpu_devices", 8)', ""
    )  # conftest did it
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert [a.shape for a in ns["x"].to_local()] == [(7, 3), (6, 3), (6, 3), (6, 3)]
    assert str(ns["s"].sbp[0]) == "P"
    out = ns["out"]
    import numpy as np

    ref = np.tanh(ns["x"].numpy() @ ns["w1"].numpy()) @ ns["w2"].numpy()
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert "dot_general" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^(pip install .*pytest.*?)\s+#", readme, flags=re.M)
    assert m, "README quick start has no test command"
    assert m.group(1).strip() in (ROOT / ".ci" / "run").read_text()
