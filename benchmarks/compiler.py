"""Compiler benchmark: ``jsbp.jit`` against the same program written by hand in plain JAX.

Run from the repository root::

    python benchmarks/compiler.py            # full run (5-15 minutes on a loaded 2-core CPU)
    python benchmarks/compiler.py --quick    # tiny model, 3 samples: a smoke run, not for quoting

It sets up 8 simulated CPU devices itself (before JAX initialises) and measures, in one run,
interleaving the contenders and reporting medians (every timed call ends in ``block_until_ready``):

(a) **step**: one training step of a small Flax NNX transformer (pre-LN block, causal
    multi-head attention, GELU MLP, optax ``adamw``), the same Python ``train_step`` under

    * **jsbp**: ``jsbp.jit(train_step, out_sbp=<the input layouts>)`` on global tensors, every
      intermediate layout inferred by jsbp (no annotation inside the step);
    * **jsbp + hints**: the same, with ``jsbp.to_global`` annotations where the hand-written
      version has constraints (diagnostic: how much of a gap the inferred layouts explain);
    * **hand**: ``jax.jit(in_shardings=..., out_shardings=...)`` on ``NamedSharding`` s of a
      ``jax.sharding.Mesh``, with ``with_sharding_constraint`` on the residual stream, the
      Megatron MLP hidden activation and the gradients (each like its parameter);

    for three layouts on 8 devices: **DP** (dp=8: parameters and optimizer state replicated, the
    batch split), **TP** (tp=8, Megatron: q/k/v and the MLP up-projection column-parallel, the
    attention output and MLP down-projection row-parallel, the embedding split on its feature dim,
    the rest replicated, optimizer moments laid out like their parameters) and **DPxTP** (a 2 x 4
    grid: the batch split on ``dp``, the TP layout on ``tp``). Every contender is first checked
    against a one-device run. Target: jsbp/hand <= 1.05 (median of back-to-back sample ratios;
    the same ratio in process CPU time is printed as a load-robust cross-check).
(b) **first call**: trace + compile + one run of a freshly built step function, with
    ``jax.clear_caches()`` and jsbp's own memo caches emptied before each (a fresh process's
    first call). Target: jsbp/hand <= 1.5.
(c) **eager add**: ``x + y`` on two 64 x 64 float32 global tensors laid out S(0) on 8 devices
    (cache hit) against ``jax.jit(jnp.add)`` on the equivalent sharded ``jax.Array`` s, with the
    parts of the jsbp call timed alongside for attribution. Target: <= 2x (DTensor's is ~18x).

It also reports the collectives in each compiled step program (``jsbp.debug.count_collectives``
for jsbp, ``jsbp.debug.collectives_in_hlo`` of ``jitted.lower(*args).compile().as_text()`` for
hand) and the optimised-HLO instruction counts that differ.

``--profile`` adds a per-phase cProfile of one cold first call per layout and a cProfile of the
eager add (after all timed sections). ``--dump-hlo DIR`` writes every step program's optimised
HLO to DIR. Results: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextvars
import cProfile
import gc
import io
import os
import platform
import pstats
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import fmt_coll  # noqa: E402  (benchmarks/ is on sys.path)
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as PS  # noqa: E402

import jsbp  # noqa: E402

TARGET_STEP = 1.05
TARGET_FIRST = 1.5
TARGET_EAGER = 2.0

# -------------------------------------------------------------------------------------------
# the model: hand-written sharding hints are read from a context variable, so the jsbp run and
# the hand-written run execute exactly the same Python code (jsbp's hint is "none")
# -------------------------------------------------------------------------------------------

_HINT: contextvars.ContextVar = contextvars.ContextVar("hint", default=None)


def _hint(x, kind: str):
    """Apply the active layout hint (``kind``: "residual", "mlp_hidden" or "grad"); none for plain jsbp."""
    h = _HINT.get()
    return x if h is None else h(x, kind)


class Block(nnx.Module):
    def __init__(self, d, h, rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=h, in_features=d, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        t = x.shape[1]
        mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
        x = _hint(x + self.attn(self.ln1(x), mask=mask), "residual")
        hidden = _hint(jax.nn.gelu(self.up(self.ln2(x))), "mlp_hidden")
        return _hint(x + self.down(hidden), "residual")


class Transformer(nnx.Module):
    def __init__(self, vocab, d, h, layers, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, h, rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tok):
        x = _hint(self.embed(tok), "residual")
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_train_step(graphdef, state, tx, hint=None):
    """A fresh ``train_step(params, opt_state, tok) -> (loss, params, opt_state)`` function object."""

    def merge(p):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        return st

    def loss_fn(p, tok):
        model = nnx.merge(graphdef, merge(p))
        logits = model(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    def train_step(p, o, tok):
        token = _HINT.set(hint)
        try:
            loss, g = jax.value_and_grad(loss_fn)(p, tok)
            g = _hint(g, "grad")
            upd, o = tx.update(g, o, p)
            return loss, optax.apply_updates(p, upd), o
        finally:
            _HINT.reset(token)

    return train_step


# -------------------------------------------------------------------------------------------
# layouts
# -------------------------------------------------------------------------------------------


def tp_sbp(path: str) -> str:
    """Megatron layout of one parameter on a 1-d tensor-parallel axis (1-d sbp string)."""
    if "embed" in path:
        return "S(1)"  # (vocab, d): feature dim split
    if any(k in path for k in ("query", "key", "value")):
        return (
            "S(1)" if "kernel" in path else "S(0)"
        )  # kernel (d, heads, hd) / bias (heads, hd): heads split
    if "'out'" in path and "kernel" in path:
        return "S(0)"  # (heads, hd, d): row parallel
    if "'up'" in path:
        return "S(1)" if "kernel" in path else "S(0)"  # column parallel
    if "'down'" in path and "kernel" in path:
        return "S(0)"  # row parallel
    return "B"


def _spec_1d(s: str, ndim: int, axis: str):
    """PartitionSpec entries of a 1-d sbp string on ``axis`` for a rank-``ndim`` tensor."""
    out = [None] * ndim
    if s.startswith("S("):
        out[int(s[2:-1])] = axis
    return out


def _merge_specs(ndim, *parts):
    out = [None] * ndim
    for part in parts:
        for i, a in enumerate(part):
            if a is None:
                continue
            out[i] = (
                a if out[i] is None else (out[i] if isinstance(out[i], tuple) else (out[i],)) + (a,)
            )
    return PS(*out)


class Strategy:
    """One layout of the train step: jsbp global tensors and the equivalent hand-written shardings."""

    def __init__(self, name, grid, axis_names, param_sbp, batch_split_axis, tp_axis):
        self.name = name
        devs = np.array(jax.devices()[:8]).reshape(grid)
        ranks = np.vectorize(lambda d: d.id)(devs).tolist()
        self.placement = jsbp.placement("cpu", ranks, axis_names=axis_names)
        self.mesh = Mesh(devs, axis_names)
        self.axis_names = axis_names
        self.param_sbp = param_sbp  # path -> 1-d sbp string per axis (tuple, one per axis)
        self.batch_axis = batch_split_axis
        self.tp_axis = tp_axis

    # jsbp side
    def nd(self, per_axis):
        return per_axis if len(per_axis) > 1 else per_axis[0]

    def param_nd(self, path):
        return self.param_sbp(path)

    def tok_nd(self):
        return tuple("S(0)" if a == self.batch_axis else "B" for a in self.axis_names)

    # hand side
    def spec(self, per_axis, ndim):
        return _merge_specs(
            ndim, *[_spec_1d(s, ndim, a) for s, a in zip(per_axis, self.axis_names)]
        )

    def act_nd(self, kind):
        """Layout of an activation (batch, seq, feature) as per-axis 1-d sbp strings."""
        feat = {"residual": None, "mlp_hidden": 2}[kind]
        return tuple(
            "S(0)"
            if a == self.batch_axis
            else (f"S({feat})" if a == self.tp_axis and feat is not None else "B")
            for a in self.axis_names
        )


def strategies():
    def dp(path):
        return ("B",)

    def tp(path):
        return (tp_sbp(path),)

    def hybrid(path):
        return ("B", tp_sbp(path))

    return [
        Strategy("DP (dp=8)", (8,), ("dp",), dp, "dp", None),
        Strategy("TP (tp=8)", (8,), ("tp",), tp, None, "tp"),
        Strategy("DPxTP (2x4)", (2, 4), ("dp", "tp"), hybrid, "dp", "tp"),
    ]


# -------------------------------------------------------------------------------------------
# one strategy's contenders
# -------------------------------------------------------------------------------------------


def _keystr_paths(tree):
    return [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


class Case:
    def __init__(self, strat: Strategy, cfg):
        self.strat = strat
        vocab, d, h, layers, batch, seq = cfg
        model = Transformer(vocab, d, h, layers, rngs=nnx.Rngs(0))
        self.graphdef, self.state = nnx.split(model, nnx.Param)
        params = jax.tree_util.tree_map(np.asarray, self.state.to_pure_dict())
        # eps=1e-4: the attention key bias has an exactly-zero gradient (softmax is shift invariant);
        # any run sees ~1e-9 rounding noise there, which adamw's g / (|g| + eps) with the default
        # eps=1e-8 blows up to a full step; a larger eps keeps the parity check meaningful
        self.tx = optax.adamw(1e-3, eps=1e-4)
        opt = jax.tree_util.tree_map(np.asarray, self.tx.init(params))
        tok = np.random.default_rng(0).integers(0, vocab, size=(batch, seq + 1)).astype(np.int32)

        ppaths = _keystr_paths(params)
        player = {p: strat.param_nd(p) for p in ppaths}

        def opt_layout(path, v):
            # adam moments: like the parameter whose path ends theirs; the step count: replicated
            for p in ppaths:
                if path.endswith(p) and v.ndim > 0:
                    return player[p]
            return ("B",) * len(strat.axis_names)

        oleaves, otree = jax.tree_util.tree_flatten_with_path(opt)
        olayer = [opt_layout(jax.tree_util.keystr(kp), v) for kp, v in oleaves]
        pleaves, ptree = jax.tree_util.tree_flatten(params)
        play = [player[p] for p in ppaths]

        # jsbp global tensors
        plc = strat.placement
        self.gp = jax.tree_util.tree_unflatten(
            ptree, [jsbp.tensor(v, plc, strat.nd(lay)) for v, lay in zip(pleaves, play)]
        )
        self.go = jax.tree_util.tree_unflatten(
            otree, [jsbp.tensor(v, plc, strat.nd(lay)) for (_, v), lay in zip(oleaves, olayer)]
        )
        self.gtok = jsbp.tensor(tok, plc, strat.nd(strat.tok_nd()))
        loss_nd = ("B",) * len(strat.axis_names)
        self.p_nd = jax.tree_util.tree_unflatten(ptree, play)
        self.out_sbp = (
            [strat.nd(loss_nd)]
            + [strat.nd(lay) for lay in play]
            + [strat.nd(lay) for lay in olayer]
        )

        # hand-written shardings
        mesh = strat.mesh
        psh = [NamedSharding(mesh, strat.spec(lay, v.ndim)) for v, lay in zip(pleaves, play)]
        osh = [NamedSharding(mesh, strat.spec(lay, v.ndim)) for (_, v), lay in zip(oleaves, olayer)]
        tsh = NamedSharding(mesh, strat.spec(strat.tok_nd(), 2))
        self.p_sh = jax.tree_util.tree_unflatten(ptree, psh)
        self.o_sh = jax.tree_util.tree_unflatten(otree, osh)
        self.t_sh = tsh
        self.loss_sh = NamedSharding(mesh, PS())
        self.hp = jax.tree_util.tree_unflatten(
            ptree, [jax.device_put(v, s) for v, s in zip(pleaves, psh)]
        )
        self.ho = jax.tree_util.tree_unflatten(
            otree, [jax.device_put(v, s) for (_, v), s in zip(oleaves, osh)]
        )
        self.htok = jax.device_put(tok, tsh)
        self.ref = (params, opt, tok)

    def hand_hint(self):
        """``with_sharding_constraint`` s: residual stream, Megatron MLP hidden, gradients like params."""
        strat, mesh, p_sh = self.strat, self.strat.mesh, self.p_sh

        def h(x, kind):
            if kind == "grad":
                return jax.lax.with_sharding_constraint(x, p_sh)
            return jax.lax.with_sharding_constraint(
                x, NamedSharding(mesh, strat.spec(strat.act_nd(kind), x.ndim))
            )

        return h

    def jsbp_hint(self):
        """The same hints as ``jsbp.to_global`` annotations (activation gradients keep the layout)."""
        strat, p_nd = self.strat, self.p_nd

        def h(x, kind):
            if kind == "grad":
                return jax.tree_util.tree_map(
                    lambda g, nd: jsbp.to_global(g, sbp=strat.nd(nd)),
                    x,
                    p_nd,
                    is_leaf=lambda v: isinstance(v, tuple),
                )
            nd = strat.nd(strat.act_nd(kind))
            return jsbp.to_global(x, sbp=nd, grad_sbp=nd)

        return h

    # fresh compiled functions (new Python function objects: no tracing cache is shared)
    def jsbp_fn(self, hinted=False):
        hint = self.jsbp_hint() if hinted else None
        return jsbp.jit(
            make_train_step(self.graphdef, self.state, self.tx, hint=hint), out_sbp=self.out_sbp
        )

    def hand_fn(self):
        step = make_train_step(self.graphdef, self.state, self.tx, hint=self.hand_hint())
        shard = (self.p_sh, self.o_sh, self.t_sh)
        return jax.jit(step, in_shardings=shard, out_shardings=(self.loss_sh, self.p_sh, self.o_sh))

    def jsbp_args(self):
        return self.gp, self.go, self.gtok

    def hand_args(self):
        return self.hp, self.ho, self.htok

    def check(self, fns: dict):
        """Every contender computes the same step as one device (benchmarks never time wrong answers)."""
        ref_step = jax.jit(make_train_step(self.graphdef, self.state, self.tx))  # one device
        ref_loss, ref_p, _ = jax.device_get(ref_step(*self.ref))
        refs = jax.tree_util.tree_leaves(ref_p)
        is_gt = lambda x: isinstance(x, jsbp.GlobalTensor)  # noqa: E731
        for name, f in fns.items():
            if name.startswith("jsbp"):
                loss, newp, _ = f(*self.jsbp_args())
                loss = loss.numpy()
                got = [x.numpy() for x in jax.tree_util.tree_leaves(newp, is_leaf=is_gt)]
                # layouts are a fixed point: outputs feed the next step without re-tracing
                for x, g in zip(
                    jax.tree_util.tree_leaves(newp, is_leaf=is_gt),
                    jax.tree_util.tree_leaves(self.gp, is_leaf=is_gt),
                ):
                    if x.layout != g.layout:
                        raise SystemExit(
                            f"{self.strat.name}: {name} changed a parameter layout: {g.layout} -> {x.layout}"
                        )
            else:
                loss, newp, _ = f(*self.hand_args())
                got = [np.asarray(x) for x in jax.tree_util.tree_leaves(newp)]
            if not np.allclose(np.asarray(loss), ref_loss, rtol=1e-4, atol=1e-5):
                raise SystemExit(
                    f"{self.strat.name}: {name} loss {loss} != single-device {ref_loss}"
                )
            for r, x in zip(refs, got):
                if not np.allclose(x, r, rtol=1e-3, atol=1e-5):
                    raise SystemExit(
                        f"{self.strat.name}: {name}: updated parameters differ from one device"
                    )


# -------------------------------------------------------------------------------------------
# timing helpers
# -------------------------------------------------------------------------------------------


def _timed(fn) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def interleaved(
    fns: dict, reps: int, inner: int = 1, warmup: int = 2
) -> dict[str, dict[str, list[float]]]:
    """Per-call seconds of each contender: ``{"wall": [...], "cpu": [...]}`` with ``reps`` samples
    each (a sample is the mean of ``inner`` back-to-back calls); the order alternates every rep.

    ``cpu`` is this process's CPU time (all threads): it does not grow while other processes hold
    the cores, so it is a load-robust second view of the same work."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            for _ in range(inner):
                jax.block_until_ready(fns[n]())
    times = {n: {"wall": [], "cpu": []} for n in names}
    for r in range(reps):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            f = fns[n]
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(inner):
                # every call is waited for: many programs with collectives in flight at once can
                # starve XLA:CPU's in-process rendezvous on a small machine
                jax.block_until_ready(f())
            t1, c1 = time.perf_counter(), time.process_time()
            times[n]["wall"].append((t1 - t0) / inner)
            times[n]["cpu"].append((c1 - c0) / inner)
    return times


def med(ts):
    return statistics.median(ts)


def paired_ratio(num: list[float], den: list[float]) -> float:
    """Median over repetitions of num[r] / den[r]: samples taken back to back share the load."""
    return statistics.median(a / b for a, b in zip(num, den))


def _spread(ts):
    """Interquartile range / median, as a noise indicator."""
    q = statistics.quantiles(ts, n=4) if len(ts) >= 4 else [min(ts), 0, max(ts)]
    return (q[2] - q[0]) / statistics.median(ts)


def clear_jsbp_caches() -> int:
    """Empty jsbp's module-level memo caches (boxing plans, layouts, ...): a fresh process's state.

    Eager-op wrappers are left alone; the step does not use them."""
    n = 0
    for name, mod in list(sys.modules.items()):
        if name == "jsbp" or name.startswith("jsbp."):
            for obj in list(vars(mod).values()):
                clear = getattr(obj, "cache_clear", None)
                if callable(clear):
                    clear()
                    n += 1
    return n


def first_call_times(case: Case, reps: int, cold_jsbp: bool = True) -> dict[str, list[float]]:
    """Trace + compile + first run of a fresh step function; JAX's caches (and, with
    ``cold_jsbp``, jsbp's memo caches) are emptied before each: a fresh process's first call."""
    builders = {
        "jsbp": lambda: case.jsbp_fn()(*case.jsbp_args()),
        "jsbp+hints": lambda: case.jsbp_fn(hinted=True)(*case.jsbp_args()),
        "hand": lambda: case.hand_fn()(*case.hand_args()),
    }
    names = list(builders)
    times = {n: [] for n in names}
    for r in range(reps):
        for n in names if r % 2 == 0 else names[::-1]:
            jax.clear_caches()
            if cold_jsbp:
                clear_jsbp_caches()
            gc.collect()
            times[n].append(_timed(builders[n]))
    return times


# (label, file suffix, function name) of the phases of a first call, read from cProfile
_PHASES = (
    ("jsbp: trace the step to a jaxpr (`_jit._trace`)", "jsbp/_jit.py", "_trace"),
    ("jsbp: planning (`_lower.plan`)", "jsbp/_lower.py", "plan"),
    ("jsbp: replay on shards + boxing, inside shard_map (`_jit.body`)", "jsbp/_jit.py", "body"),
    ("jax: trace the hand-written step (`jit` trace)", "jax/_src/pjit.py", "_trace_for_jit"),
    (
        "jax: lower to StableHLO (`lower_jaxpr_to_module`)",
        "jax/_src/interpreters/mlir.py",
        "lower_jaxpr_to_module",
    ),
    (
        "XLA: compile (`backend_compile_and_load`)",
        "jax/_src/compiler.py",
        "backend_compile_and_load",
    ),
)


def first_call_phases(case: Case) -> dict[str, dict[str, float]]:
    """cProfile of one cold first call per contender: seconds (cumulative) in each phase."""
    out = {}
    for name, run in (
        ("jsbp", lambda: case.jsbp_fn()(*case.jsbp_args())),
        ("hand", lambda: case.hand_fn()(*case.hand_args())),
    ):
        jax.clear_caches()
        gc.collect()
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        jax.block_until_ready(run())
        pr.disable()
        total = time.perf_counter() - t0
        stats = pstats.Stats(pr).stats  # {(file, line, fn): (cc, nc, tt, ct, callers)}
        row = {"total (under cProfile)": total}
        for label, suffix, fn in _PHASES:
            # outermost entries only: a recursive function's cumtime already includes inner calls
            ct = max(
                (v[3] for (f, _, n), v in stats.items() if n == fn and f.endswith(suffix)),
                default=0.0,
            )
            row[label] = ct
        out[name] = row
    return out


def compiled_program(case: Case, name: str, f) -> tuple[dict, str]:
    """(collectives, optimised HLO text) of one contender's step program."""
    if name.startswith("jsbp"):
        counts = jsbp.debug.count_collectives(f, *case.jsbp_args())
        text = f.lower(*case.jsbp_args()).compile().as_text()
    else:
        text = f.lower(*case.hand_args()).compile().as_text()
        counts = jsbp.debug.collectives_in_hlo(text)
    return counts, text


def _op_histogram(hlo: str) -> dict[str, int]:
    """Instruction opcodes of an optimised HLO module (all computations), for diffing programs."""
    import re

    hist: dict[str, int] = {}
    for m in re.finditer(
        r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^)]*\)|\S+)\s+([a-z][\w\-]*)\(", hlo, re.M
    ):
        hist[m.group(1)] = hist.get(m.group(1), 0) + 1
    return hist


# -------------------------------------------------------------------------------------------
# eager add
# -------------------------------------------------------------------------------------------


EAGER_ADD = "jsbp `x + y`"
EAGER_BASE = "`jax.jit(jnp.add)(a, b)`"


def eager_case() -> tuple[dict, dict]:
    """(contenders, breakdown): ``x + y`` on global tensors against jitted ``jnp.add``, and the
    parts of the jsbp call timed on their own (for attribution)."""
    plc = jsbp.placement("cpu", list(range(8)), axis_names=("x",))
    mesh = Mesh(np.array(jax.devices()[:8]), ("x",))
    sh = NamedSharding(mesh, PS("x", None))
    rng = np.random.default_rng(1)
    xv, yv = rng.standard_normal((2, 64, 64)).astype(np.float32)
    x, y = jsbp.tensor(xv, plc, "S(0)"), jsbp.tensor(yv, plc, "S(0)")
    a, b = jax.device_put(xv, sh), jax.device_put(yv, sh)
    add = jax.jit(jnp.add)
    z = x + y
    assert z.sbp == (jsbp.sbp.split(0),), z.sbp
    np.testing.assert_allclose(z.numpy(), xv + yv, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(add(a, b)), xv + yv, rtol=1e-6)
    fns = {
        EAGER_ADD: lambda: (x + y).physical,
        EAGER_BASE: lambda: add(a, b),
        "`a + b` (jax eager)": lambda: a + b,
    }
    # the parts of the call, through public API: the same add as a jsbp.jit function (no eager
    # dispatch), and its compiled program alone (jax.jit-style ``lower``) on the same arrays
    jf = jsbp.jit(jnp.add)
    compiled = jf.lower(x, y).compile()
    xp, yp = x.physical, y.physical
    parts = {
        "`jsbp.jit(jnp.add)(x, y)` (no eager dispatch)": lambda: jf(x, y).physical,
        "compiled program alone `jsbp.jit(jnp.add).lower(x, y).compile()(xp, yp)`": lambda: (
            compiled(xp, yp)
        ),
    }
    return fns, parts


def _profile(fn, n, top=18, sort="tottime") -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        jax.block_until_ready(fn())
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(sort).print_stats(top)
    return s.getvalue()


# -------------------------------------------------------------------------------------------
# main
# -------------------------------------------------------------------------------------------


CONTENDERS = ("jsbp", "jsbp+hints", "hand")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true", help="tiny model, few repetitions (a smoke run)"
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed step samples per contender (default 31 of 3 steps each; quick 3 of 1)",
    )
    ap.add_argument(
        "--first-reps",
        type=int,
        default=None,
        help="cold first calls per contender (default 3, quick 1)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print cProfiles of the eager add and of a jsbp first call",
    )
    ap.add_argument(
        "--dump-hlo", default=None, help="write every compiled step program's HLO to this folder"
    )
    ap.add_argument("--layers", type=int, default=1, help="transformer blocks (default 1)")
    args = ap.parse_args(argv)
    quick = args.quick
    # vocab, d_model, heads, layers, batch, seq
    cfg = (64, 32, 8, args.layers, 8, 8) if quick else (256, 64, 8, args.layers, 16, 32)
    reps = args.reps or (3 if quick else 31)
    step_inner = 1 if quick else 3
    first_reps = args.first_reps or (1 if quick else 3)

    if len(jax.devices()) < 8:
        print(f"need 8 devices, JAX sees {len(jax.devices())}", file=sys.stderr)
        return 1
    vocab, d, h, layers, batch, seq = cfg
    print(
        f"# jsbp compiler benchmark: 8 simulated CPU devices (jax {jax.__version__}, flax {__import__('flax').__version__}, "
        f"optax {optax.__version__}, python {platform.python_version()}, {os.cpu_count()} CPU cores)"
    )
    print(
        f"# command: python benchmarks/compiler.py{' ' + ' '.join(sys.argv[1:]) if argv is None and sys.argv[1:] else ''}"
    )
    print(
        f"# model: vocab {vocab}, d_model {d}, {h} heads, {layers} block(s), MLP 4x; batch {batch} x seq {seq}; "
        "optax adamw; float32"
    )
    print(
        f"# medians of {reps} interleaved step repetitions, {first_reps} cold first call(s) per contender",
        flush=True,
    )

    step_rows, first_rows, coll_rows, diffs, phase_rows = [], [], [], [], []
    for strat in strategies():
        case = Case(strat, cfg)
        fns = {
            "jsbp": case.jsbp_fn(),
            "jsbp+hints": case.jsbp_fn(hinted=True),
            "hand": case.hand_fn(),
        }
        case.check(fns)
        counts, texts = {}, {}
        for name, f in fns.items():
            counts[name], texts[name] = compiled_program(case, name, f)
        coll_rows.append((strat.name, counts))
        hists = {k: _op_histogram(t) for k, t in texts.items()}
        diffs.append((strat.name, hists))
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            tag = strat.name.split()[0].lower()
            for name, text in texts.items():
                with open(
                    os.path.join(args.dump_hlo, f"{tag}_{name.replace('+', '_')}.hlo.txt"), "w"
                ) as fh:
                    fh.write(text)
        del texts
        ja, ha = case.jsbp_args(), case.hand_args()
        calls = {
            n: (lambda f=f, a=ja: f(*a)) if n.startswith("jsbp") else (lambda f=f, a=ha: f(*a))
            for n, f in fns.items()
        }
        t = interleaved(calls, reps, inner=step_inner)
        step_rows.append((strat.name, t))
        print(
            f"  step  {strat.name:<12} "
            + "  ".join(f"{k} {med(v['wall']) * 1e3:7.2f} ms" for k, v in t.items()),
            file=sys.stderr,
            flush=True,
        )
        ft = first_call_times(case, first_reps, cold_jsbp=not quick)
        first_rows.append((strat.name, {k: med(v) for k, v in ft.items()}))
        print(
            f"  first {strat.name:<12} " + "  ".join(f"{k} {med(v):7.2f} s" for k, v in ft.items()),
            file=sys.stderr,
            flush=True,
        )
        if args.profile:
            phase_rows.append((strat.name, first_call_phases(case)))
        del case, fns, calls
        gc.collect()

    efns, eparts = eager_case()
    inner = 30 if quick else 200
    # contenders and the parts of the jsbp call in one interleaved set: same load for all
    et = interleaved({**efns, **eparts}, max(reps, 9), inner=inner, warmup=1)
    eager_med = {k: med(v["wall"]) for k, v in et.items() if k in efns}
    part_med = {k: med(v["wall"]) for k, v in et.items() if k in eparts}
    eager_ratio = paired_ratio(et[EAGER_ADD]["wall"], et[EAGER_BASE]["wall"])

    misses = 0
    print()
    print("## (a) train step, steady state\n")
    print(
        "ms per step: median wall time. Ratios to hand-written: median over repetitions of the "
        "ratio of back-to-back samples (wall), and the same for process CPU time (load-robust).\n"
    )
    print(
        "| layout | jsbp ms | jsbp + hints ms | hand-written ms | jsbp / hand | (jsbp + hints) / hand "
        f"| CPU-time ratios (jsbp, hints) | target <= {TARGET_STEP} | noise IQR/median (jsbp, hints, hand) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|---|")
    for name, t in step_rows:
        m = {k: med(v["wall"]) for k, v in t.items()}
        sp = {k: _spread(v["wall"]) for k, v in t.items()}
        r = paired_ratio(t["jsbp"]["wall"], t["hand"]["wall"])
        rh = paired_ratio(t["jsbp+hints"]["wall"], t["hand"]["wall"])
        rc = paired_ratio(t["jsbp"]["cpu"], t["hand"]["cpu"])
        rhc = paired_ratio(t["jsbp+hints"]["cpu"], t["hand"]["cpu"])
        ok = r <= TARGET_STEP
        misses += not ok
        verdict = f"{'met' if ok else 'MISSED'} (hints: {'met' if rh <= TARGET_STEP else 'missed'})"
        print(
            f"| {name} | {m['jsbp'] * 1e3:.2f} | {m['jsbp+hints'] * 1e3:.2f} | {m['hand'] * 1e3:.2f} "
            f"| {r:.2f} | {rh:.2f} | {rc:.2f}, {rhc:.2f} | {verdict} "
            f"| {sp['jsbp']:.0%}, {sp['jsbp+hints']:.0%}, {sp['hand']:.0%} |"
        )
    print()
    print("## (b) first call: trace + compile + one step (s)\n")
    print(
        "A fresh step function per call, `jax.clear_caches()` before each"
        + (
            " (--quick: jsbp's own memo caches stay warm)."
            if quick
            else " and jsbp's memo caches (boxing plans, layouts) emptied: a fresh process's first call."
        )
        + "\n"
    )
    print(
        f"| layout | jsbp | jsbp + hints | hand-written | jsbp / hand | (jsbp + hints) / hand | target <= {TARGET_FIRST} |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for name, m in first_rows:
        r, rh = m["jsbp"] / m["hand"], m["jsbp+hints"] / m["hand"]
        ok = r <= TARGET_FIRST
        misses += not ok
        verdict = (
            f"{'met' if ok else 'MISSED'} (hints: {'met' if rh <= TARGET_FIRST else 'missed'})"
        )
        print(
            f"| {name} | {m['jsbp']:.2f} | {m['jsbp+hints']:.2f} | {m['hand']:.2f} | {r:.2f} | {rh:.2f} | {verdict} |"
        )
    print()
    if phase_rows:
        print(
            "## first call by phase (cProfile cumulative seconds, one cold call each; jsbp / hand)\n"
        )
        labels = list(phase_rows[0][1]["jsbp"])
        print("| phase | " + " | ".join(name for name, _ in phase_rows) + " |")
        print("|---|" + "---:|" * len(phase_rows))
        for lab in labels:
            cells = [f"{ph['jsbp'][lab]:.2f} / {ph['hand'][lab]:.2f}" for _, ph in phase_rows]
            print(f"| {lab} | " + " | ".join(cells) + " |")
        print()
    print("## collectives per step (compiled programs)\n")
    print("| layout | jsbp | jsbp + hints | hand-written |")
    print("|---|---|---|---|")
    for name, c in coll_rows:
        print(
            f"| {name} | {fmt_coll(c['jsbp'])} | {fmt_coll(c['jsbp+hints'])} | {fmt_coll(c['hand'])} |"
        )
    print()
    print("## (c) eager add, 64 x 64 float32, S(0) on 8 devices, cache hit (us per call)\n")
    print(
        "us per call: median wall time; ratio: median of back-to-back ratios to the jitted add "
        "(the parts of the jsbp call are timed alone, for attribution).\n"
    )
    print(f"| call | us | / jitted jnp.add | target <= {TARGET_EAGER} |")
    print("|---|---:|---:|---|")
    for k, v in eager_med.items():
        tgt = ""
        ratio = paired_ratio(et[k]["wall"], et[EAGER_BASE]["wall"])
        if k == EAGER_ADD:
            ok = eager_ratio <= TARGET_EAGER
            misses += not ok
            tgt = "met" if ok else "MISSED"
        print(f"| {k} | {v * 1e6:.1f} | {ratio:.2f} | {tgt} |")
    for k, v in part_med.items():
        ratio = paired_ratio(et[k]["wall"], et[EAGER_BASE]["wall"])
        print(f"| part of the jsbp call: {k} | {v * 1e6:.1f} | {ratio:.2f} | |")
    print()
    print(
        "## optimised HLO: instruction counts that differ from hand-written (jsbp / jsbp + hints / hand)\n"
    )
    print("| layout | instructions (all computations) |")
    print("|---|---|")
    for name, hs in diffs:
        keys = sorted(set().union(*hs.values()))
        row = [
            f"{k} {hs['jsbp'].get(k, 0)}/{hs['jsbp+hints'].get(k, 0)}/{hs['hand'].get(k, 0)}"
            for k in keys
            if not hs["jsbp"].get(k, 0) == hs["jsbp+hints"].get(k, 0) == hs["hand"].get(k, 0)
        ]
        tot = "/".join(str(sum(hs[c].values())) for c in CONTENDERS)
        print(f"| {name} | total {tot}; " + "; ".join(row) + " |")
    print()
    if args.profile:
        print("## cProfile: eager `x + y` (jsbp), 2000 calls, by own time\n")
        print(_profile(efns[EAGER_ADD], 2000, top=25))
    print(
        f"# {misses} target(s) missed; timings taken on a shared, loaded 2-core machine (see noise column)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
