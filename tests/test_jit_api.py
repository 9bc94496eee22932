"""``jsbp.jit`` accepts what ``jax.jit`` accepts, with ``jax.jit``'s meaning: keyword arguments at
call time, ``static_argnums`` (negative too) / ``static_argnames``, ``donate_argnums`` /
``donate_argnames``, a ``jsbp.jit`` function called inside another, recursion, ``.lower`` and
``.trace``. Every result is compared with ``jax.jit`` of the same function on one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsbp
from jsbp.debug import count_collectives


@pytest.fixture
def plc():
    return jsbp.placement("cpu", [0, 1, 2, 3])


def _g(v, plc, s):
    return jsbp.tensor(np.asarray(v, np.float32), placement=plc, sbp=s)


X = np.arange(20.0, dtype=np.float32).reshape(5, 4) / 7  # uneven over 4 devices
W = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)


def f(a, b, *, scale=1.0, mode="mul", extra=None):
    y = jnp.tanh(a @ b)
    y = y * scale if mode == "mul" else y + scale
    if extra is not None:
        y = y + extra["bias"].sum()
    return y


def test_keyword_arguments_at_call_time(plc):
    x, w = _g(X, plc, "S(0)"), _g(W, plc, "B")
    bias = _g(np.arange(3.0), plc, "S(0)")
    g = jsbp.jit(f)
    ref = jax.jit(f)
    cases = [
        ((x,), dict(b=w)),
        ((x, w), dict(scale=2.5)),
        ((), dict(a=x, b=w, extra={"bias": bias}, scale=0.5)),
    ]
    for args, kwargs in cases:
        got = g(*args, **kwargs)
        plain = lambda v: jnp.asarray(v.numpy()) if isinstance(v, jsbp.GlobalTensor) else v  # noqa: E731
        want = ref(
            *map(plain, args),
            **jax.tree_util.tree_map(
                plain, kwargs, is_leaf=lambda v: isinstance(v, jsbp.GlobalTensor)
            ),
        )
        np.testing.assert_allclose(got.numpy(), np.asarray(want), rtol=1e-6)


def test_a_new_keyword_scalar_is_no_new_program(plc):
    x, w = _g(X, plc, "S(0)"), _g(W, plc, "B")
    g = jsbp.jit(f)
    g(x, w, scale=1.0)
    for s in (0.5, 2.0, -0.0, 3.25):
        np.testing.assert_allclose(
            g(x, w, scale=s).numpy(), np.asarray(jax.jit(f)(X, W, scale=s)), rtol=1e-6
        )
    assert len(g._cache) == 1


def test_static_argnames_by_keyword_and_by_position(plc):
    x, w = _g(X, plc, "S(0)"), _g(W, plc, "B")
    g = jsbp.jit(f, static_argnames=("mode",))
    np.testing.assert_allclose(
        g(x, w, mode="add", scale=2.0).numpy(),
        np.asarray(f(X, W, mode="add", scale=2.0)),
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        g(x, w, mode="mul", scale=2.0).numpy(),
        np.asarray(f(X, W, mode="mul", scale=2.0)),
        rtol=1e-6,
    )

    def h(a, n, b):
        return a * n + b.sum()

    by_name = jsbp.jit(h, static_argnames="n")  # n is positional-or-keyword: static by position too
    assert by_name.static_argnums == (1,)
    for n in (2, 3):
        np.testing.assert_allclose(by_name(x, n, w).numpy(), X * n + W.sum(), rtol=1e-6)
        np.testing.assert_allclose(by_name(x, b=w, n=n).numpy(), X * n + W.sum(), rtol=1e-6)
    by_num = jsbp.jit(h, static_argnums=1)
    assert by_num.static_argnames == ("n",)
    np.testing.assert_allclose(by_num(x, n=4, b=w).numpy(), X * 4 + W.sum(), rtol=1e-6)


def test_static_values_are_typed(plc):
    """A static argument is keyed by type and value: ``1``, ``1.0`` and ``True`` are three
    programs (``h`` branches on the type)."""
    x = _g(X, plc, "S(0)")
    g = jsbp.jit(
        lambda a, k: a * 2 if isinstance(k, bool) else (a + k if isinstance(k, int) else a - k),
        static_argnames="k",
    )
    np.testing.assert_allclose(g(x, k=1).numpy(), X + 1, rtol=1e-6)
    np.testing.assert_allclose(g(x, k=1.0).numpy(), X - 1, rtol=1e-6)
    np.testing.assert_allclose(g(x, k=True).numpy(), X * 2, rtol=1e-6)


def test_negative_static_argnums(plc):
    x, w = _g(X, plc, "S(0)"), _g(W, plc, "B")

    def h(a, b, n):
        return (a @ b) ** n

    g = jsbp.jit(h, static_argnums=-1)
    ref = jax.jit(h, static_argnums=-1)
    for n in (1, 2, 3):
        np.testing.assert_allclose(g(x, w, n).numpy(), np.asarray(ref(X, W, n)), rtol=1e-5)
    assert len(g._cache) == 3


@pytest.mark.parametrize("how", ["argnums", "argnames", "negative"])
def test_donated_buffers_are_deleted_as_jax_does(plc, how):
    """A donated global tensor's buffer goes to the program and is deleted, as ``jax.jit``
    deletes a donated ``jax.Array``; the others stay; the result is right."""

    def h(a, b):
        return a * 2 + b

    kw = {
        "argnums": dict(donate_argnums=0),
        "argnames": dict(donate_argnames="a"),
        "negative": dict(donate_argnums=-2),
    }[how]
    ref_in = jax.device_put(jnp.asarray(X), jax.sharding.NamedSharding(plc.mesh, jax.P()))
    ref_b = jax.device_put(jnp.asarray(X), jax.sharding.NamedSharding(plc.mesh, jax.P()))
    jax.jit(h, **kw)(ref_in, ref_b)
    for layout in ("S(0)", "S(1)", "B", "P"):
        a, b = _g(X, plc, layout), _g(X, plc, "B")
        out = jsbp.jit(h, **kw)(a, b)
        np.testing.assert_allclose(out.numpy(), X * 3, rtol=1e-6)
        # jax.jit donates for a non-negative number or a name; a negative donate_argnums
        # donates nothing there (jax 0.10), and so here
        assert a.physical.is_deleted() == ref_in.is_deleted() == (how != "negative")
        assert not b.physical.is_deleted() and not ref_b.is_deleted()


def test_donation_by_keyword_argument(plc):
    g = jsbp.jit(lambda a, b: a - b, donate_argnames="b")
    a, b = _g(X, plc, "S(0)"), _g(X, plc, "S(0)")
    np.testing.assert_allclose(g(a, b=b).numpy(), np.zeros_like(X))
    assert b.physical.is_deleted() and not a.physical.is_deleted()


def test_static_and_donated_at_once_is_an_error():
    with pytest.raises(jsbp.SbpError, match="both static and donated"):
        jsbp.jit(lambda a, b: a, static_argnums=1, donate_argnames="b")


def test_a_jsbp_jit_function_inside_another(plc):
    """The inner function becomes part of the outer program (it used to raise "needs at least
    one GlobalTensor argument"); its ``out_sbp`` is a layout annotation there."""
    x, w = _g(X, plc, "S(0)"), _g(W, plc, "B")
    inner = jsbp.jit(lambda a: jnp.tanh(a), out_sbp="B")
    outer = jsbp.jit(lambda a, b: inner(a) @ b)
    np.testing.assert_allclose(
        outer(x, w).numpy(), np.asarray(jnp.tanh(X) @ W), rtol=1e-5, atol=1e-6
    )
    assert count_collectives(outer, x, w)["all-gather"] == 1  # the annotation's S(0) -> B
    plain_inner = jsbp.jit(lambda a, b: a @ b)
    outer2 = jsbp.jit(lambda a, b: plain_inner(a, b=b) * 2)
    np.testing.assert_allclose(
        outer2(x, w).numpy(), np.asarray(jnp.asarray(X) @ W * 2), rtol=1e-5, atol=1e-6
    )
    assert sum(count_collectives(outer2, x, w).values()) == 0


def test_recursion(plc):
    x = _g(X, plc, "S(0)")
    rec = jsbp.jit(lambda a, n: a if n == 0 else rec(jnp.sin(a), n - 1), static_argnums=1)
    want = X
    for _ in range(3):
        want = np.sin(want)
    np.testing.assert_allclose(rec(x, 3).numpy(), want, rtol=1e-6)

    @jsbp.jit
    def fact(a, *, n):
        return a if n <= 1 else n * fact(a, n=n - 1)

    fact = jsbp.jit(fact.__wrapped__, static_argnames="n")
    np.testing.assert_allclose(fact(x, n=4).numpy(), X * 24, rtol=1e-6)


def test_lower_and_trace_take_the_call_arguments(plc):
    x, w = _g(X, plc, "S(0)"), _g(W, plc, "B")
    g = jsbp.jit(f, static_argnames="mode")
    traced = g.trace(x, w, scale=2.0, mode="add")
    assert isinstance(traced, jax.stages.Traced)
    assert "tanh" in str(traced.jaxpr)
    compiled = g.lower(x, b=w, scale=2.0).compile()
    assert compiled.as_text()
    assert count_collectives(g, x, w, scale=2.0) == count_collectives(g, x, b=w, scale=3.0)


def test_decorator_with_arguments(plc):
    @jsbp.jit(static_argnames="k", donate_argnums=0)
    def h(a, k):
        return a * k

    a = _g(X, plc, "S(0)")
    np.testing.assert_allclose(h(a, k=3).numpy(), X * 3, rtol=1e-6)
    assert a.physical.is_deleted()
