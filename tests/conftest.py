"""Every test gets 8 simulated CPU devices, configured once, before JAX starts a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

import sys  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

FULL = os.environ.get("JSBP_FULL") == "1"


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` cases run only with JSBP_FULL=1 (the default run samples them)."""
    if FULL:
        return
    skip = pytest.mark.skip(reason="slow: set JSBP_FULL=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _draws_of_its_own(request):
    """A test module's shared generator (``RNG``, read by its ``rand``; ``test_plan_loops``
    uses ``test_compiler``'s) restarts for every test from a seed of the test's id: a test draws the
    same values whichever tests ran before it in its worker (``pytest -n``, ``-k``, reruns)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    for name, mod in list(sys.modules.items()):
        if name.startswith("test_") and isinstance(getattr(mod, "RNG", None), np.random.Generator):
            mod.RNG = np.random.default_rng(seed)
