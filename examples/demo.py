"""A five-minute walk through jsbp's consistent view.

    python examples/demo.py            # 8 simulated CPU devices (no GPU needed)
    python examples/demo.py --real     # the machine's own devices instead (or JSBP_DEMO_REAL=1)

You write a program for one logical tensor; jsbp keeps it on many devices. A *placement* says
which devices (a grid of them), an *SBP* per grid axis says how the tensor is laid out on them:
S(d) splits dim d, B broadcasts (every device holds it all), P holds partial sums (every device
holds a full-shape addend; the value is their sum). Changing the layout is *boxing*, and each
boxing uses the cheapest collective for the change.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

_T0 = time.perf_counter()


def _parse_args(argv):
    ap = argparse.ArgumentParser(description="A walk through jsbp's consistent view.")
    ap.add_argument(
        "--real",
        action="store_true",
        default=os.environ.get("JSBP_DEMO_REAL", "") not in ("", "0"),
        help="use the machine's own devices (needs 8) instead of 8 simulated CPU devices; "
        "JSBP_DEMO_REAL=1 does the same",
    )
    return ap.parse_args(argv)


ARGS = _parse_args(sys.argv[1:])

# The device count must be set before JAX starts a backend, so before anything touches devices.
if not ARGS.real:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if not ARGS.real:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jsbp  # noqa: E402

np.set_printoptions(precision=3, suppress=True, linewidth=100)
CHECKS: list[bool] = []


def section(title: str) -> None:
    print()
    print(title)
    print("=" * len(title))


def nd(s) -> str:
    """An nd-sbp in the short form used in plans: S(0) on a 1-d placement, (S(0), B) on a grid."""
    return str(s[0]) if len(s) == 1 else "(" + ", ".join(str(x) for x in s) + ")"


def used(counts: dict) -> str:
    """The collectives a compiled program contains, e.g. '1 all-gather', or 'no communication'."""
    parts = [f"{n} {name}{'s' if n > 1 else ''}" for name, n in counts.items() if n]
    return ", ".join(parts) if parts else "no communication"


def check(ok: bool) -> str:
    CHECKS.append(bool(ok))
    return "matches numpy" if ok else "DOES NOT MATCH numpy"


def main() -> int:
    devices = jax.devices()
    if len(devices) < 8:
        print(
            f"This demo needs 8 devices; JAX sees {len(devices)} ({devices[0].platform}). "
            "Run it without --real to use 8 simulated CPU devices."
        )
        return 2
    kind = devices[0].platform
    ids = [d.id for d in devices[:8]]
    how = "real" if ARGS.real else "simulated"
    print(f"jsbp {jsbp.__version__} on JAX {jax.__version__}: 8 {how} {kind} devices")

    # ------------------------------------------------------------------------------------------
    section("1. Placements: which devices, arranged as a grid")
    p = jsbp.placement(kind, ids[:4])
    q = jsbp.placement(kind, [ids[:4], ids[4:8]], axis_names=("dp", "tp"))
    print(f"p = {p!r}")
    print(f"    hierarchy {p.hierarchy}, axis names {p.axis_names}")
    print(f"q = {q!r}")
    print(
        f"    hierarchy {q.hierarchy}, axis names {q.axis_names}: 2 rows ('dp') x 4 columns ('tp')"
    )

    # ------------------------------------------------------------------------------------------
    section("2. Global tensors: one logical value, local pieces on devices")
    value = np.arange(25 * 3, dtype=np.float32).reshape(25, 3)
    print("value = np.arange(75).reshape(25, 3)  (the logical tensor every program sees)")
    for s in ("S(0)", "S(1)", "B"):
        x = jsbp.tensor(value, placement=p, sbp=s)
        shapes = [tuple(a.shape) for a in x.to_local()]
        print(f"  sbp {s:<5} on p: local shapes {shapes}")
    print("  S(0) cuts 25 rows over 4 devices with OneFlow's balanced splitter: 7, 6, 6, 6")

    addends = [np.full((2, 3), float(i + 1), np.float32) for i in range(4)]
    y = jsbp.from_local(addends, placement=p, sbp="P")
    shapes = [tuple(a.shape) for a in y.to_local()]
    print(f"  sbp P     on p: local shapes {shapes}, device i holds an addend full of i+1")
    print("    y.numpy() is the sum of the addends, 1+2+3+4 = 10:")
    print(textwrap.indent(str(y.numpy()), "      "))
    print(f"    {check(np.all(y.numpy() == 10))}")

    big = np.arange(25 * 10, dtype=np.float32).reshape(25, 10)
    g = jsbp.tensor(big, placement=q, sbp=("S(0)", "S(1)"))
    print(
        f"  a (25, 10) tensor with sbp {nd(g.sbp)} on the 2x4 grid q: 'dp' splits rows, 'tp' columns"
    )
    locs = iter(g.to_local())
    for r in range(2):
        row = "  ".join(f"{tuple(next(locs).shape)!s:<8}" for _ in range(4))
        print(f"    dp={r}: {row}".rstrip())

    # ------------------------------------------------------------------------------------------
    section("3. Boxing: change the layout, jsbp picks the collective")
    small = big
    large = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    cases = [
        (p, small, "S(0)", "B"),
        (p, small, "S(0)", "S(1)"),
        (p, small, "B", "S(1)"),
        (p, small, "P", "B"),
        (p, small, "P", "S(0)"),
        (p, small, "B", "P"),
        (q, large, ("P", "P"), ("S(0)", "S(0)")),
        (q, large, ("S(0)", "S(1)"), ("B", "B")),
        (q, large, ("S(0)", "S(1)"), ("S(1)", "S(0)")),
        (q, small, ("S(0)", "S(1)"), ("B", "B")),
    ]
    print(f"  {'conversion':<34} {'tensor':<11} {'collectives in the compiled program':<36} value")
    for plc, value_, src, dst in cases:
        x = jsbp.tensor(value_, placement=plc, sbp=src)
        box = lambda t, dst=dst: t.to_global(sbp=dst)  # noqa: E731
        counts = jsbp.debug.count_collectives(box, x)
        z = box(x)
        got = z.numpy()
        ok = np.allclose(got, value_, atol=1e-5) if "P" in str(src) else np.array_equal(got, value_)
        label = f"{nd(x.sbp)} -> {nd(z.sbp)} on {'p' if plc is p else 'q'}"
        size = "x".join(map(str, value_.shape))
        print(f"  {label:<34} {size:<11} {used(counts):<36} {check(ok)}")
    print(
        "  P -> S is one reduce-scatter (never an all-reduce and a slice); B -> S and B -> P are local."
    )
    print(
        "  On the grid, axes that change the same way share one collective. The planner weighs bytes"
    )
    print(
        "  against a fixed cost per collective: for the tiny 25x10 tensor one all-reduce (after a free"
    )
    print("  zero-fill to P) is cheaper than two all-gathers.")

    # ------------------------------------------------------------------------------------------
    section("4. Gradients flow through boxing")
    w = np.linspace(-1.0, 1.0, 25 * 3, dtype=np.float32).reshape(25, 3)
    x = jsbp.tensor(value, placement=p, sbp="S(0)")

    def loss(t):
        full = t.to_global(sbp="B").to_jax()  # boxing: all-gather
        return jnp.sum(jnp.tanh(full / 50.0) * w)

    grad = jax.grad(loss)(x)
    want = jax.grad(lambda v: jnp.sum(jnp.tanh(v / 50.0) * w))(jnp.asarray(value))
    print("  loss(x) = sum(tanh(x.to_global(sbp='B') / 50) * w)   with x: sbp S(0) on p")
    print(
        f"  jax.grad(loss)(x) is a {type(grad).__name__} with sbp {nd(grad.sbp)} (the layout of x)"
    )
    print(f"  local gradient shapes {[tuple(a.shape) for a in grad.to_local()]}")
    print(
        f"  values vs jax.grad on one device: {check(np.allclose(grad.numpy(), np.asarray(want), atol=1e-6))}"
    )
    print(
        f"  the whole forward + backward program: {used(jsbp.debug.count_collectives(jax.grad(loss), x))}"
    )
    print(
        "  (the backward of this all-gather needs no communication: the gradient of the broadcast"
    )
    print("  copy is the same on every device, so each device keeps its own rows)")

    # ------------------------------------------------------------------------------------------
    section("Summary")
    n_ok = sum(CHECKS)
    print(f"{n_ok}/{len(CHECKS)} checks match numpy; demo took {time.perf_counter() - _T0:.1f} s")
    print("Next: README.md (the tour, jsbp.jit, jsbp.explain), python examples/train_gpt.py")
    return 0 if all(CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
