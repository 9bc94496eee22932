"""Eager ops never recompile for a new Python scalar, and dropped ``jsbp.jit`` functions release
what they captured.

Python scalars in elementwise eager ops are weakly typed traced operands, as in ``jnp``: the
caches keep types and layouts, never values. Compilations are counted with JAX's own
``/jax/core/compile/backend_compile_duration`` event (one per XLA compilation).
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def compilations():
    """Counts XLA compilations in the block: ``with compilations() as n: ...; n[0]``."""
    n = [0]

    def listener(event, duration, **kwargs):
        if event == _COMPILE_EVENT:
            n[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield n
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def x():
    p = jsbp.placement("cpu", [0, 1, 2, 3])
    return jsbp.tensor(np.arange(24.0, dtype=np.float32).reshape(6, 4), placement=p, sbp="S(0)")


def test_a_schedule_of_scalars_compiles_once(x):
    """An SGD-like eager step with a new learning rate every step: after the first step, no
    compilation at all (it compiled one program per distinct float before)."""
    g = x * 0.5

    def step(w, lr):
        return w - lr * g

    w = step(x, 0.1)  # warm-up: compiles
    with compilations() as n:
        for i in range(20):
            w = step(w, 0.1 / (1 + i))
        w.numpy()
    assert n[0] == 0
    want = np.arange(24.0, dtype=np.float32).reshape(6, 4)
    g_np = want * 0.5
    want = want - np.float32(0.1) * g_np
    for i in range(20):
        want = want - np.float32(0.1 / (1 + i)) * g_np
    np.testing.assert_allclose(w.numpy(), want, rtol=1e-6)


@pytest.mark.parametrize(
    "op",
    [
        "add",
        "sub",
        "mul",
        "truediv",
        "pow",
        "radd",
        "rsub",
        "rmul",
        "rtruediv",
        "lt",
        "ge",
        "eq",
        "maximum",
        "where",
        "clip",
    ],
)
def test_every_elementwise_op_takes_a_new_float_without_compiling(x, op):
    fns = {
        "add": lambda t, s: t + s,
        "sub": lambda t, s: t - s,
        "mul": lambda t, s: t * s,
        "truediv": lambda t, s: t / s,
        "pow": lambda t, s: abs(t) ** s,
        "radd": lambda t, s: s + t,
        "rsub": lambda t, s: s - t,
        "rmul": lambda t, s: s * t,
        "rtruediv": lambda t, s: s / (t + 1),
        "lt": lambda t, s: t < s,
        "ge": lambda t, s: t >= s,
        "eq": lambda t, s: t == s,
        "maximum": lambda t, s: jsbp.numpy.maximum(t, s),
        "where": lambda t, s: jsbp.numpy.where(t > 3, t, s),
        "clip": lambda t, s: t.clip(s, 20.0),
    }
    jnp_fns = {
        **fns,
        "maximum": lambda t, s: jnp.maximum(t, s),
        "where": lambda t, s: jnp.where(t > 3, t, s),
        "clip": lambda t, s: jnp.clip(t, s, 20.0),
    }
    f = fns[op]
    f(x, 1.5)
    f(abs(x), 1.5)  # the abs program of "pow"
    with compilations() as n:
        outs = [f(x, 0.25 + i) for i in range(5)]
    assert n[0] == 0, op
    ref = jnp.asarray(x.numpy())
    for i, out in enumerate(outs):
        want = jnp_fns[op](ref, 0.25 + i)
        assert out.dtype == want.dtype, op
        np.testing.assert_allclose(out.numpy(), np.asarray(want), rtol=1e-6, err_msg=op)


def test_scalars_of_different_types_are_never_confused(x):
    """``1``, ``1.0``, ``True`` and ``-0.0`` share no program where they would differ: dtypes
    and values as ``jnp`` gives them, in any order of calls."""
    xi = x.astype(jnp.int32)
    xh = x.astype(jnp.float16)
    cases = [
        (xi, lambda t, s: t + s, [1, 1.0, True, 2, 2.5]),
        (xh, lambda t, s: t * s, [2, 2.0, np.float32(2.0), True]),
        (x, lambda t, s: 1 / (t * 0 + s), [0.0, -0.0, 0.0]),
        (xi, lambda t, s: t & s, [True, 1, 3]),
    ]
    for t, f, scalars in cases:
        ref = jnp.asarray(t.numpy())
        for s in scalars:
            got, want = f(t, s), f(ref, s)
            assert got.dtype == want.dtype, (s, got.dtype, want.dtype)
            np.testing.assert_array_equal(got.numpy(), np.asarray(want), err_msg=repr(s))


def test_integer_powers_stay_integer_pow(x):
    """``x ** 2`` with a Python int is ``lax.integer_pow`` on a jax.Array (exact squares); the
    eager op matches it bit for bit."""
    v = jnp.asarray(np.linspace(-3, 3, 24, dtype=np.float32).reshape(6, 4) * 1.1)
    t = jsbp.tensor(np.asarray(v), placement=x.placement, sbp="S(0)")
    for k in (2, 3, -1):
        np.testing.assert_array_equal((t**k).numpy(), np.asarray(v**k))


def test_ints_out_of_range_behave_as_in_jnp(x):
    """``uint8 + 300`` wraps as ``jnp``'s (jitted) add does; an int beyond JAX's default int
    raises ``OverflowError`` as ``jnp`` does."""
    xu = x.astype(jnp.uint8)
    np.testing.assert_array_equal((xu + 300).numpy(), np.asarray(jnp.asarray(xu.numpy()) + 300))
    with pytest.raises(OverflowError):
        jnp.asarray(x.astype(jnp.int32).numpy()) + 2**40
    with pytest.raises(OverflowError):
        (x.astype(jnp.int32) + 2**40).numpy()


def test_many_distinct_scalars_grow_no_cache(x):
    """500 distinct learning rates leave the eager caches as one rate does."""
    from jsbp import _ops

    (x * 0.5).numpy()
    before = len(_ops._CACHE)
    entries = sum(len(jf._cache) for jf in _ops._CACHE.values())
    for i in range(500):
        y = x * (1e-3 * i)
    y.numpy()
    assert len(_ops._CACHE) == before
    assert sum(len(jf._cache) for jf in _ops._CACHE.values()) == entries


def test_eager_programs_are_kept_least_recently_used_first(x, monkeypatch):
    """Static arguments that change every call (a reshape's sizes) keep at most
    ``EAGER_CACHE_SIZE`` programs; the one used last stays, the least recently used goes, and
    every value is right."""
    from jsbp import _ops

    monkeypatch.setattr(_ops, "EAGER_CACHE_SIZE", 4)
    _ops._CACHE.clear()
    want = x.numpy()
    n = want.size
    shapes = [(d, n // d) for d in (1, 2, 3, 4, 6) if n % d == 0]
    assert len(shapes) == 5, want.shape
    for shape in shapes:
        np.testing.assert_array_equal(x.reshape(shape).numpy(), want.reshape(shape))
        np.testing.assert_array_equal(x.reshape(shapes[0]).numpy(), want.reshape(shapes[0]))
        assert len(_ops._CACHE) <= 4
    kept = [k for k in _ops._CACHE if k[0] is jnp.reshape]
    assert len(kept) == 4 and len(_ops._CACHE) == 4, list(_ops._CACHE)
    sizes = {k[2] for k in kept}
    assert _statickey_of(shapes[0]) in sizes and _statickey_of(shapes[1]) not in sizes


def _statickey_of(shape):
    from jsbp._statickey import static_key

    return static_key((shape,))


def _captured_alive(make, n=10):
    refs = []
    p = jsbp.placement("cpu", [0, 1, 2, 3])
    x = jsbp.tensor(np.ones((4, 3), np.float32), placement=p, sbp="S(0)")
    for i in range(n):
        arr = jnp.arange(3.0) + i
        refs.append(weakref.ref(arr))
        f = make(arr)
        f(x).numpy()
        del f, arr
    gc.collect()
    return sum(r() is not None for r in refs)


def test_dropped_jit_functions_release_their_closures():
    """What a dropped ``jsbp.jit`` function captured is freed by one garbage collection, as for
    ``jax.jit`` (7 of 10 stayed alive before)."""
    assert _captured_alive(lambda arr: jsbp.jit(lambda t: t + arr.sum())) == 0


def test_dropped_jit_functions_release_their_closures_after_grad():
    """The same after ``jax.grad`` ran the function's backward program."""

    def make(arr):
        f = jsbp.jit(lambda t: (t * arr).sum())
        return lambda x: jax.grad(lambda t: f(t).to_jax())(x)

    assert _captured_alive(make) == 0


@pytest.mark.slow
def test_eager_scalars_benchmark_runs():
    """``benchmarks/eager_scalars.py`` runs and passes its own checks (schedule within 2x of the
    constant, both agreeing with plain ``jnp``); no timing is asserted here beyond the script's."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "eager_scalars.py"), "--steps", "20"],
        cwd=root,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "schedule / constant" in res.stdout


def test_numpy_scalars_keep_python_scalars_on_the_fast_path(x):
    """A numpy scalar or a bool operand (a strong 0-d array) has its own program and leaves the
    Python numbers' one on JAX's dispatch path."""
    from jsbp import _ops

    x * True
    x * 0.5
    x * np.float32(2.0)
    x * 2
    wrappers = {
        key[-1]: jf
        for key, jf in _ops._CACHE.items()
        if key[0] is jnp.multiply and key[1] == (0, 1)
    }
    assert wrappers[(float,)]._outer is not None and wrappers[(int,)]._outer is not None
    np.testing.assert_array_equal((x * np.float32(2.0)).numpy(), x.numpy() * np.float32(2.0))
    assert (
        x.astype(jnp.float16) * np.float32(2.0)
    ).dtype == jnp.float32  # a strong float32, as in jnp
