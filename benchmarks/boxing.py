"""Boxing benchmark: jsbp ``to_global`` against JAX's native paths and a plain copy.

Run from the repository root::

    python benchmarks/boxing.py            # 64 MiB float32 (4096 x 4096), 8 simulated CPU devices
    python benchmarks/boxing.py --quick    # 4 MiB (1024 x 1024), fewer repetitions
    python benchmarks/boxing.py --op-launch  # the cost model's op_launch only

For every 1-d conversion between S(0), S(1), B and P on 8 devices it times, interleaved in one run
(at least ``--reps`` rounds, the methods in a new random order each round, every call ended by
``block_until_ready``; times are medians, ratios medians of the per-round ratios):

* **jsbp**: ``x.to_global(sbp=dst)`` on a ``GlobalTensor`` (eager; its compiled program is cached).
* **native**: the fastest compiled JAX program for the same conversion. Every candidate is
  compiled and run once more to pick the fastest, which then joins the timed rounds:

  - ``reshard``: ``jax.jit(lambda a: jax.sharding.reshard(a, dst))`` on an Explicit-axis mesh;
  - ``out_shardings``: ``jax.jit(lambda a: a, out_shardings=dst)`` on an Auto-axis mesh;
  - P source: JAX 0.10.2 cannot reshard a partial-sum array to a split layout
    (``PartitionSpec(unreduced={axis})`` reshards to replicated only; to a split it raises
    ``ShardingTypeError``), so the native representation is jsbp's own: the stacked addends
    ``(8, *shape)`` sharded on dim 0, reduced by ``jax.jit(lambda a: a.sum(0), out_shardings=dst)``
    (``sum``: XLA emits an all-reduce and a slice). For P -> B the ``unreduced`` array resharded
    to replicated is a candidate too;
  - P destination: the same stacked addends, built by ``jnp.zeros((8, *shape)).at[0].set(a)``
    (``at0``: the value in addend 0) or by masking each device's own block into its addend
    (``mask``), jitted with ``out_shardings``.

* **device_put**: ``jax.device_put(a, dst)`` (non-partial layouts only). On one process it is not
  a compiled program: JAX reads the array to the host (``x._value``) and puts the pieces back, and
  on CPU the "device" buffers can alias that host memory (B -> S(0) returns views into the
  replica, no copy at all). Each call gets a fresh source, since a ``jax.Array`` keeps the host
  copy (``_npy_value``) and a reused one would skip the gather. It is timed because it is JAX's
  other native path, and reported in its own column because no compiled program (jsbp's or
  XLA's) can alias its input that way.
* **copy**: ``jax.jit(jnp.copy)`` of the destination-layout array: the memory floor of a compiled
  program (every device writes its output block once).

A second table measures the eager per-call time of ``to_global`` on an 8 x 8 tensor (cache hit)
against a jitted ``reshard`` call on the same small array.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec  # noqa: E402

import jsbp  # noqa: E402

SBPS = ("S(0)", "S(1)", "B", "P")
TARGET_NATIVE = 1.1
TARGET_P_TO_S0 = 0.3
TARGET_OVERHEAD = 1.5


def _spec(sbp: str, axis: str) -> PartitionSpec:
    """The PartitionSpec of a non-partial 1-d sbp (P uses the stacked-addend spec)."""
    return {
        "S(0)": PartitionSpec(axis, None),
        "S(1)": PartitionSpec(None, axis),
        "B": PartitionSpec(None, None),
        "P": PartitionSpec(axis, None, None),
    }[sbp]


def _timed(fn) -> float:
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    del out
    return dt


class Conversion:
    """The inputs and candidate programs of one (src, dst) conversion."""

    def __init__(self, src: str, dst: str, n: int, plc, auto_mesh, explicit_mesh):
        self.src, self.dst = src, dst
        k = plc.size
        self.x = jsbp.randn(n, n, key=0, placement=plc, sbp=src)
        phys = self.x.physical  # for P: the stacked addends (k, n, n) sharded on dim 0
        ax_a, ax_e = auto_mesh.axis_names[0], explicit_mesh.axis_names[0]
        a_auto = jax.device_put(phys, NamedSharding(auto_mesh, _spec(src, ax_a)))
        dst_auto = NamedSharding(auto_mesh, _spec(dst, ax_a))
        self.native: dict[str, callable] = {}
        # (make a source, put it): only between non-partial layouts, JAX has no P array to put
        self.device_put = None
        if src != "P" and dst != "P":
            a_exp = jax.device_put(phys, NamedSharding(explicit_mesh, _spec(src, ax_e)))
            dst_exp = NamedSharding(explicit_mesh, _spec(dst, ax_e))
            rs = jax.jit(lambda a: jax.sharding.reshard(a, dst_exp))
            ident = jax.jit(lambda a: a, out_shardings=dst_auto)
            self.native["reshard"] = lambda: rs(a_exp)
            self.native["out_shardings"] = lambda: ident(a_auto)
            # a fresh source for every call: a jax.Array caches the host copy device_put makes of
            # it (``_npy_value``), so a reused source would skip the gather to the host
            fresh = jax.jit(jnp.copy)
            self.device_put = (lambda: fresh(a_auto), lambda src: jax.device_put(src, dst_auto))
        elif src == "P":
            red = jax.jit(lambda a: a.sum(0), out_shardings=dst_auto)
            self.native["sum"] = lambda: red(a_auto)
            if dst == "B":
                a_exp = jax.device_put(phys, NamedSharding(explicit_mesh, _spec("P", ax_e)))
                unred = NamedSharding(explicit_mesh, PartitionSpec(None, None, unreduced={ax_e}))
                u = jax.jit(lambda a: a.sum(0), out_shardings=unred)(a_exp)
                rep = jax.jit(
                    lambda u: jax.sharding.reshard(
                        u, NamedSharding(explicit_mesh, PartitionSpec(None, None))
                    )
                )
                self.native["unreduced"] = lambda: rep(u)
        else:  # dst == "P": build the stacked addends
            at0 = jax.jit(
                lambda a: jnp.zeros((k,) + a.shape, a.dtype).at[0].set(a), out_shardings=dst_auto
            )
            self.native["at0"] = lambda: at0(a_auto)
            if src.startswith("S"):
                d = int(src[2])
                # the device whose block holds each index of dim d
                owner = jnp.asarray(np.repeat(np.arange(k), n // k))
                shp = [1, 1, 1]
                shp[1 + d] = n

                def mask(a):
                    keep = jnp.arange(k).reshape(k, 1, 1) == owner.reshape(shp)
                    return jnp.where(keep, a[None], jnp.zeros((), a.dtype))

                m = jax.jit(mask, out_shardings=dst_auto)
                self.native["mask"] = lambda: m(a_auto)
        y = self.x.to_global(sbp=dst)
        self.y_phys = y.physical
        cp = jax.jit(jnp.copy)
        self.copy = lambda: cp(self.y_phys)
        self.jsbp = lambda: self.x.to_global(sbp=dst).physical
        self.check(y)

    def check(self, y):
        """The conversion is exact (allclose for P): benchmarks never time a wrong answer."""
        want = self.x.numpy()
        got = y.numpy()
        if not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            raise SystemExit(f"jsbp {self.src}->{self.dst} gave a wrong value")

    def run(self, reps: int, budget_s: float) -> dict:
        """Median ms of jsbp, the best compiled native path, device_put and the copy.

        Every native candidate runs once to compile and once more to pick the fastest; then jsbp,
        that candidate, device_put and the copy run ``reps`` interleaved rounds (5 when they already
        took ``10 * budget_s`` seconds), and more (up to ``5 * reps``) while they took less than
        ``budget_s``.
        """
        for f in self.native.values():
            _timed(f)
        pick = {name: _timed(f) for name, f in self.native.items()}
        best = min(pick, key=pick.get)
        fns = {"jsbp": self.jsbp, "native": self.native[best], "copy": self.copy}
        setup = {}
        if self.device_put is not None:
            setup["device_put"], fns["device_put"] = self.device_put
        _timed(self.copy)  # compile (jsbp compiled in __init__, the native path above)
        for name, make in setup.items():
            _timed(lambda f=fns[name], make=make: f(make()))
        times = {name: [] for name in fns}
        names = list(fns)
        rng = random.Random(0)
        t_start, r = time.perf_counter(), 0
        while True:
            spent = time.perf_counter() - t_start
            slow = r >= 5 and spent > 10 * budget_s  # 5 rounds are enough when each takes seconds
            done = r >= reps and (spent > budget_s or r >= 5 * reps)
            if slow or done:
                break
            # arguments that must be fresh are made first, outside the timers; then the methods
            # run in a new random order, so that none always follows the same neighbour (a big
            # free or allocation just before a call slows it)
            args = {name: jax.block_until_ready(make()) for name, make in setup.items()}
            order = list(names)
            rng.shuffle(order)
            for name in order:
                if name in args:
                    arg = args.pop(name)
                    times[name].append(_timed(lambda f=fns[name], arg=arg: f(arg)))
                    del arg
                else:
                    times[name].append(_timed(fns[name]))
            r += 1
        out: dict = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        # ratios of calls made in the same round (back to back, so under the same load from
        # elsewhere on a shared machine): the median of these is steadier than a ratio of medians
        for name in names[1:]:
            out[f"jsbp/{name}"] = statistics.median(
                a / b for a, b in zip(times["jsbp"], times[name], strict=True)
            )
        out["best"] = best
        out["rounds"] = r
        return out


def bench_conversions(n: int, reps: int, plc, auto_mesh, explicit_mesh, only=None):
    rows = []
    for src in SBPS:
        for dst in SBPS:
            if src == dst or only and f"{src}->{dst}" not in only:
                continue
            conv = Conversion(src, dst, n, plc, auto_mesh, explicit_mesh)
            med = conv.run(reps, budget_s=4.0)
            del conv
            gc.collect()
            rows.append((f"{src} -> {dst}", med))
            dp = med.get("device_put")
            print(
                f"  {src:>4} -> {dst:<4} jsbp {med['jsbp']:8.2f} ms  {med['best']} {med['native']:.2f}"
                + (f"  device_put {dp:.2f}" if dp is not None else "")
                + f"  copy {med['copy']:.2f}"
                + f"  ({med['rounds']} rounds)",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _overhead_case(src: str, dst: str, reps: int, plc, explicit_mesh) -> tuple[float, float, float]:
    """Median microseconds per eager call (each waited for) of to_global and of a jitted reshard,
    and the median ratio of blocks run back to back."""
    ax_e = explicit_mesh.axis_names[0]
    x = jsbp.randn(8, 8, key=0, placement=plc, sbp=src)
    a = jax.device_put(x.physical, NamedSharding(explicit_mesh, _spec(src, ax_e)))
    target = NamedSharding(explicit_mesh, _spec(dst, ax_e))
    rs = jax.jit(lambda a: jax.sharding.reshard(a, target))
    fns = {"jsbp": lambda: x.to_global(sbp=dst).physical, "reshard": lambda: rs(a)}
    # every call is waited for: many programs with collectives in flight at once can starve
    # XLA:CPU's in-process rendezvous on a small machine. Many short alternating blocks, so that
    # a burst of load from elsewhere hits both sides alike.
    inner, rounds = 10, 10 * reps
    for f in fns.values():
        for _ in range(10 * inner):
            jax.block_until_ready(f())
    times = {k: [] for k in fns}
    for r in range(rounds):
        for name in ("jsbp", "reshard") if r % 2 == 0 else ("reshard", "jsbp"):
            f = fns[name]
            t0 = time.perf_counter()
            for _ in range(inner):
                jax.block_until_ready(f())
            times[name].append((time.perf_counter() - t0) / inner)
    ratio = statistics.median(a / b for a, b in zip(times["jsbp"], times["reshard"], strict=True))
    return statistics.median(times["jsbp"]) * 1e6, statistics.median(times["reshard"]) * 1e6, ratio


def bench_overhead(reps: int, plc, explicit_mesh):
    """Eager per-call time on an 8x8 tensor (cache hit): to_global vs a jitted reshard call."""
    rows = []
    for src, dst in (("S(0)", "B"), ("S(0)", "S(1)"), ("B", "S(0)")):
        rows.append((f"{src} -> {dst}", *_overhead_case(src, dst, reps, plc, explicit_mesh)))
    return rows


def op_launch(plc, reps: int, ops: int = 100) -> float:
    """Seconds one more op takes inside a compiled program (``jsbp.CostModel.op_launch``): the
    step time of a chain of ``ops`` small elementwise ops, each followed by a local slice of a
    replicated (16, 12) block (what a conversion B -> S runs), less the same chain without the
    slices, over ``ops``; each op is kept apart by an optimization barrier. Minimum over ``reps``
    rounds of 20 calls."""
    from jax.sharding import PartitionSpec as P

    axis = plc.mesh.axis_names[0]

    def chain(sliced):
        def body(x):
            for _ in range(ops):
                if sliced:
                    i = jax.lax.axis_index(axis) % 2 * 8
                    x = jax.lax.dynamic_slice_in_dim(jnp.concatenate([x, x]), i, 8, 0)
                x = jax.lax.optimization_barrier(jnp.sin(x))
            return x

        return jax.jit(
            jax.shard_map(body, mesh=plc.mesh, in_specs=P(), out_specs=P(), check_vma=False)
        )

    x = jnp.ones((8, 12), jnp.float32)
    fns = {s: chain(s) for s in (False, True)}
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for s, f in fns.items():
            f(x).block_until_ready()
            t = time.perf_counter()
            for _ in range(20):
                f(x).block_until_ready()
            best[s] = min(best[s], (time.perf_counter() - t) / 20)
    return (best[True] - best[False]) / ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="1024 x 1024 (4 MiB) and fewer repetitions"
    )
    ap.add_argument(
        "--n", type=int, default=None, help="the tensor is n x n float32 (default 4096)"
    )
    ap.add_argument(
        "--reps", type=int, default=None, help="timed rounds per conversion (default 7)"
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help='conversions to run, e.g. --only "P->S(0)" "S(1)->B" (default: all twelve)',
    )
    ap.add_argument("--no-overhead", action="store_true", help="skip the eager-call table")
    ap.add_argument(
        "--op-launch",
        action="store_true",
        help="only measure the cost model's op_launch (seconds one more op takes in a program)",
    )
    args = ap.parse_args(argv)
    n = args.n or (1024 if args.quick else 4096)
    reps = args.reps or (5 if args.quick else 7)

    devices = jax.devices()
    if len(devices) < 8:
        print(f"need 8 devices, JAX sees {len(devices)}", file=sys.stderr)
        return 1
    devices = devices[:8]
    plc = jsbp.placement(devices[0].platform, [d.id for d in devices])
    if args.op_launch:
        t = op_launch(plc, reps)
        print(
            f"op_launch: {t * 1e6:.2f} us per op (jsbp.CostModel default {jsbp.CostModel().op_launch * 1e6:g} us)"
        )
        return 0
    auto_mesh = plc.mesh
    explicit_mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,), devices=devices)

    mib = n * n * 4 / 2**20
    print(
        f"# jsbp boxing benchmark: {n} x {n} float32 ({mib:g} MiB), 1-d placement of 8 {devices[0].platform} devices"
    )
    print(
        f"# jax {jax.__version__}, numpy {np.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} CPU cores, medians of >= {reps} interleaved rounds"
    )
    only = {c.replace(" ", "") for c in args.only} if args.only else None
    rows = bench_conversions(n, reps, plc, auto_mesh, explicit_mesh, only)
    print()
    print(
        "| conversion | jsbp ms | native ms (compiled path) | jsbp / native | target "
        "| device_put ms | jsbp / device_put | copy ms | jsbp / copy |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    misses, slower_than_put = [], []
    for name, m in rows:
        target = TARGET_P_TO_S0 if name == "P -> S(0)" else TARGET_NATIVE
        r_nat, r_copy, r_dp = m["jsbp/native"], m["jsbp/copy"], m.get("jsbp/device_put")
        ok = r_nat <= target
        if not ok:
            misses.append(name)
        if r_dp is not None and r_dp > TARGET_NATIVE:
            slower_than_put.append(name)
        dps = f"{m['device_put']:.2f}" if r_dp is not None else "n/a"
        dpr = f"{r_dp:.2f}" if r_dp is not None else "n/a"
        print(
            f"| {name} | {m['jsbp']:.2f} | {m['native']:.2f} ({m['best']}) | {r_nat:.2f} "
            f"| <= {target} {'ok' if ok else 'MISSED'} | {dps} | {dpr} | {m['copy']:.2f} "
            f"| {r_copy:.2f} |"
        )
    print()
    print(
        "Times are medians over the rounds; ratios are medians of the per-round ratios "
        "(calls made back to back)."
    )
    print()
    orows = [] if args.no_overhead else bench_overhead(max(reps, 5), plc, explicit_mesh)
    if orows:
        print(
            "| eager call, 8 x 8 (cache hit) | jsbp to_global us | jitted reshard us | ratio "
            "| target |"
        )
        print("|---|---:|---:|---:|---|")
    for name, j, r, ratio in orows:
        ok = ratio <= TARGET_OVERHEAD
        if not ok:
            misses.append(f"eager {name}")
        print(
            f"| {name} | {j:.1f} | {r:.1f} | {ratio:.2f} | <= {TARGET_OVERHEAD} {'ok' if ok else 'MISSED'} |"
        )
    print()
    print(f"# targets missed (against the compiled native path): {', '.join(misses) or 'none'}")
    print(
        "# more than 1.1x slower than device_put's host round trip: "
        f"{', '.join(slower_than_put) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
