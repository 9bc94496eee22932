"""Every test gets 8 simulated CPU devices, configured once, before JAX starts a backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)

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
