"""Train a small character-level GPT (Flax NNX) in jsbp's consistent view.

    python examples/train_gpt.py                       # dp=2,tp=4 on 8 simulated CPU devices
    python examples/train_gpt.py --parallel dp=8 --zero 2
    python examples/train_gpt.py --parallel tp=8 --json --steps 20
    python examples/train_gpt.py --parallel none       # one device, plain jax.jit (the reference)
    python examples/train_gpt.py --parallel auto --memory-budget 64MiB   # jsbp chooses the layouts
    python examples/train_gpt.py --parallel cp=8 --seq-len 2048 --batch 4 --steps 5   # context parallel

The model is written once. Every parallelism is a ``jsbp.flax.Strategy`` — layouts only:

* parameters carry Flax logical axis names (``nnx.with_partitioning``) and the strategy maps
  them to placement axes: ``{"batch": "dp", "vocab": "tp", "heads": "tp", "mlp": "tp"}``.
  Q/K/V and the MLP's first linear are column-parallel (split on their output dim), the
  attention output and the MLP's second linear are row-parallel (split on their input dim), the
  token embedding is vocab-parallel (table split on the vocab dim: its lookup is a partial sum)
  and the head is vocab-parallel (logits split on the vocab dim, fed to a cross-entropy that
  never gathers them);
* ``jsbp.flax.constrain`` pins the residual stream to ``("batch", "seq", "embed")`` — broadcast
  over ``tp`` — which is Megatron's f/g pair: one all-reduce after each row-parallel layer in the
  forward, one after each column-parallel input in the backward, nothing between the pair;
* ``--parallel cp=N`` splits the sequence (``"seq"``) over ``cp``: attention runs as one
  ``jsbp.nn.dot_product_attention``, which the planner runs with key/value all-gathered, as a
  ring of collective-permutes or with the heads split by all-to-all (Ulysses), by cost;
* ``--sequence-parallel`` (with ``tp``) splits the residual stream along the sequence over
  ``tp`` as well (Megatron-SP): the row-parallel outputs are reduce-scattered and all-gathered
  before the next column-parallel input, the same bytes as the all-reduce, with the norms,
  dropout-free residual adds and their activations on 1/tp of the tokens;
* ``--zero`` splits optimizer state (1), gradients (2) and parameters (3) over ``dp``;
  ``--accum`` sums gradients over micro-batches and updates once per batch;
* ``--parallel auto`` lets ``jsbp.flax.Strategy.auto`` choose among all of these (every dp × tp
  grid of the devices, which logical names go to ``tp``, the ZeRO stage) the one with the lowest
  predicted step time whose predicted peak bytes per device fit ``--memory-budget``; it prints
  every candidate it planned and the chosen layouts.

Training is nanoGPT's recipe at a small size: adamw with a linear warmup and a cosine decay of the
learning rate (``--lr``, ``--warmup``, ``--decay-steps``), 600 steps of 32 sequences; the run ends
with a continuation of the corpus's first line sampled at temperature 0.8 from the top 10
characters with a fixed seed (the same model prints the same text).

With the same ``--seed`` every layout starts from the same parameters and sees the same batches,
so the losses agree with ``--parallel none`` to fp32 rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "tiny_corpus.txt"
DEFAULT_PARALLEL = "dp=2,tp=4"
PROMPT = "Shall I compare thee to a summer's day?\n"  # the corpus's first line; the model goes on
# training defaults, shared by the command line, train() and train_gpt_pipeline.py
STEPS = 600
BATCH = 32
LR = 1e-2  # peak learning rate
WARMUP = 10  # linear warmup steps
DECAY_STEPS = 600  # cosine decay to LR / 10 over this many steps (then flat); fixed, so --resume continues the curve


# ----------------------------------------------------------------------------------------------
# command line (parsed before JAX starts: the device count is fixed at backend start)
# ----------------------------------------------------------------------------------------------


AUTO_DEVICES = (
    8  # --parallel auto: devices to lay the model out on (simulated CPU devices by default)
)


AXES = ("dp", "tp", "cp", "pp")  # data, tensor, context (sequence) and pipeline parallelism


def parse_parallel(text: str) -> dict[str, int] | str:
    """``"dp=2,tp=4"`` -> ``{"dp": 2, "tp": 4}``; ``"none"`` -> ``{}``; ``"auto"`` -> ``"auto"``."""
    text = text.strip().lower()
    if text in ("", "none"):
        return {}
    if text == "auto":
        return "auto"
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, num = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES or not num.strip().isdigit() or int(num) < 1:
            raise SystemExit(
                f"--parallel: cannot read {part!r}; write e.g. dp=2,tp=4 (axes {', '.join(AXES)}) "
                "or none"
            )
        if name in out:
            raise SystemExit(f"--parallel: axis {name} given twice in {text!r}")
        out[name] = int(num)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parallel",
        default=DEFAULT_PARALLEL,
        help="'none', 'auto' (jsbp chooses the layouts on 8 devices) or comma-separated "
        "dp=N,tp=N,cp=N,pp=N whose product is the device count (default %(default)s)",
    )
    ap.add_argument(
        "--seq-len",
        type=int,
        default=GPTConfig.seq,
        help="tokens per sequence (default %(default)s)",
    )
    ap.add_argument(
        "--fused-attention",
        action="store_true",
        help="attention as one jsbp.nn.dot_product_attention (always with cp)",
    )
    ap.add_argument(
        "--memory-budget",
        default=None,
        help="with --parallel auto: bytes per device the predicted peak must fit, e.g. 64MiB (default: no limit)",
    )
    ap.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split the residual stream along the sequence over tp (Megatron-SP)",
    )
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage over dp")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=BATCH, help="sequences per optimizer step")
    ap.add_argument("--lr", type=float, default=LR, help="peak learning rate (default %(default)s)")
    ap.add_argument(
        "--warmup", type=int, default=WARMUP, help="linear warmup steps (default %(default)s)"
    )
    ap.add_argument(
        "--decay-steps",
        type=int,
        default=DECAY_STEPS,
        help="cosine decay of the learning rate to lr/10 over this many steps, then flat; "
        "independent of --steps so that --resume continues the same curve (default %(default)s)",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    ap.add_argument(
        "--microbatches", type=int, default=None, help="pipeline micro-batches (pp > 1)"
    )
    ap.add_argument(
        "--schedule",
        default="1f1b",
        choices=("1f1b", "gpipe", "interleaved"),
        help="pipeline schedule (pp > 1)",
    )
    ap.add_argument(
        "--save-every",
        type=int,
        default=0,
        help="save a checkpoint every K steps (with --ckpt-dir)",
    )
    ap.add_argument("--ckpt-dir", default=None, help="directory for --save-every checkpoints")
    ap.add_argument(
        "--resume",
        default=None,
        help="resume from the newest checkpoint in this directory (any --parallel)",
    )
    return ap


def configure_devices(n: int) -> None:
    """Ask for ``n`` simulated CPU devices, unless a backend already runs (then it must have them)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(n, 1))
    except RuntimeError:
        pass  # a backend is already up (e.g. under pytest): its devices are checked later


# ----------------------------------------------------------------------------------------------
# the model (written once, for one device)
# ----------------------------------------------------------------------------------------------

import jax  # noqa: E402  (importing jax does not start a backend)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jsbp  # noqa: E402
import jsbp.flax as jflax  # noqa: E402
import jsbp.nn  # noqa: E402

# the residual stream's logical dims: its sequence dim has a name of its own, which sequence
# parallelism maps to the tensor-parallel axis (the logits' sequence dim stays "seq")
ACT = ("batch", "act_seq", "embed")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 64
    d_model: int = 64
    n_heads: int = 8
    n_layers: int = 2
    d_mlp: int = 256
    # attention as one ``jsbp.nn.dot_product_attention`` (else written out: einsum, mask,
    # softmax, einsum); a sequence split over cp then runs it all-gathered, as a ring or by heads
    fused_attention: bool = False


def _w(names, std=0.02):
    return nnx.with_partitioning(nnx.initializers.normal(std), names)


def _zeros(names):
    return nnx.with_partitioning(nnx.initializers.zeros_init(), names)


def _ones(names):
    return nnx.with_partitioning(nnx.initializers.ones_init(), names)


def _linear(din, dout, names, rngs, std=0.02, bias=True):
    return nnx.Linear(
        din, dout, rngs=rngs, kernel_init=_w(names, std), bias_init=_zeros(names[1:]), use_bias=bias
    )


def _norm(d, rngs):
    return nnx.LayerNorm(d, rngs=rngs, scale_init=_ones(("embed",)), bias_init=_zeros(("embed",)))


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.fused = cfg.fused_attention
        self.q = _linear(d, d, ("embed", "heads"), rngs)  # column-parallel
        # no key bias: it adds a constant per query row, which the softmax cancels (zero gradient)
        self.k = _linear(d, d, ("embed", "heads"), rngs, bias=False)
        self.v = _linear(d, d, ("embed", "heads"), rngs)
        self.o = _linear(
            d, d, ("heads", "embed"), rngs, std=0.02 / math.sqrt(2 * cfg.n_layers)
        )  # row-parallel

    def __call__(self, x):
        b, t, d = x.shape
        h = self.n_heads
        q = self.q(x).reshape(b, t, h, d // h)
        k = self.k(x).reshape(b, t, h, d // h)
        v = self.v(x).reshape(b, t, h, d // h)
        if self.fused:
            return self.o(jsbp.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        s = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d // h)
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), s.shape)
        causal = jflax.constrain(causal, ("batch", "heads", None, None), grad_sbp=None)
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        a = jax.nn.softmax(s, axis=-1)
        y = jnp.einsum("bhts,bshd->bthd", a, v).reshape(b, t, d)
        return self.o(y)


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.fc = _linear(cfg.d_model, cfg.d_mlp, ("embed", "mlp"), rngs)  # column-parallel
        self.proj = _linear(
            cfg.d_mlp, cfg.d_model, ("mlp", "embed"), rngs, std=0.02 / math.sqrt(2 * cfg.n_layers)
        )

    def __call__(self, x):
        return self.proj(jax.nn.gelu(self.fc(x)))


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.ln1 = _norm(cfg.d_model, rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = _norm(cfg.d_model, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x):
        c = jflax.constrain
        x = x + c(self.attn(c(self.ln1(x), ACT)), ACT)
        return x + c(self.mlp(c(self.ln2(x), ACT)), ACT)


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Embed(
            cfg.vocab, cfg.d_model, rngs=rngs, embedding_init=_w(("vocab", "embed"))
        )
        self.wpe = nnx.Embed(
            cfg.seq, cfg.d_model, rngs=rngs, embedding_init=_w((None, "embed"), 0.01)
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = _norm(cfg.d_model, rngs)
        self.head = _linear(cfg.d_model, cfg.vocab, ("embed", "vocab"), rngs)  # vocab-parallel

    def __call__(self, tokens):
        t = tokens.shape[1]
        x = jflax.constrain(self.wte(tokens) + self.wpe(jnp.arange(t))[None], ACT)
        for block in self.blocks:
            x = block(x)
        return self.head(jflax.constrain(self.ln_f(x), ACT))


def loss_fn(model: GPT, batch):
    """Next-character cross-entropy; the logits stay split over the vocab under tensor parallelism."""
    logits = model(batch[:, :-1])
    return jflax.softmax_cross_entropy(logits, batch[:, 1:], ("batch", "seq", "vocab"))


def lr_schedule(lr: float = LR, warmup: int = WARMUP, decay_steps: int = DECAY_STEPS):
    """nanoGPT's schedule: linear warmup to ``lr``, cosine decay to ``lr / 10`` at ``decay_steps``."""
    warmup = max(0, min(warmup, decay_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=lr / (warmup + 1),
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(decay_steps, 1),
        end_value=lr / 10,
    )


def init(cfg: GPTConfig, seed: int, lr=None):
    """Model and optimizer on one device; the same ``seed`` gives the same parameters everywhere.
    ``lr`` is a constant or an optax schedule; ``None`` is ``lr_schedule()`` (the demo's defaults)."""
    if lr is None:
        lr = lr_schedule()
    with nnx.use_eager_sharding(False):
        model = GPT(cfg, nnx.Rngs(seed))
    optimizer = nnx.Optimizer(
        model, optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.01), wrt=nnx.Param
    )
    return model, optimizer


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


class Corpus:
    """Character-level tokens of a text file; the vocabulary is padded to a multiple of 8."""

    def __init__(self, path: Path = DATA):
        text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = np.array([self.index[c] for c in text], dtype=np.int32)
        self.vocab = -(-len(self.chars) // 8) * 8

    def batches(self, seed: int, batch: int, seq: int):
        """An endless stream of ``(batch, seq + 1)`` windows in an order fixed by ``seed``."""
        rng = np.random.default_rng(seed)
        hi = len(self.tokens) - seq - 1
        while True:
            starts = rng.integers(0, hi, size=batch)
            yield np.stack([self.tokens[s : s + seq + 1] for s in starts])

    def decode(self, ids) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids)


# ----------------------------------------------------------------------------------------------
# strategies: layouts only
# ----------------------------------------------------------------------------------------------

LOGICAL_AXES = {
    "batch": "dp",
    "vocab": "tp",
    "heads": "tp",
    "mlp": "tp",
    "embed": None,
    "seq": "cp",
    "act_seq": "cp",
}


def make_strategy(
    axes: dict[str, int], zero: int = 0, sequence_parallel: bool = False
) -> jflax.Strategy | None:
    """``{"dp": 2, "tp": 4}`` -> a Strategy on a (dp, tp) placement; ``{}`` -> None (one device).
    ``sequence_parallel``: the residual stream split along the sequence over ``tp`` (Megatron-SP:
    each row-parallel output reduce-scattered, all-gathered before the next column-parallel
    input, the norms and residual adds on 1/tp of the tokens)."""
    if "pp" in axes and axes["pp"] > 1:
        raise jsbp.SbpError(
            f"--parallel pp={axes['pp']}: pipeline parallelism is not yet supported by train_gpt.py "
            "(jsbp.pipeline is a separate issue); use dp and tp."
        )
    axes = {k: v for k, v in axes.items() if k != "pp"}
    if not axes:
        if zero:
            raise jsbp.SbpError(f"--zero {zero} needs a data-parallel axis (dp=N in --parallel).")
        return None
    n = math.prod(axes.values())
    devices = jax.devices()
    if len(devices) < n:
        raise jsbp.SbpError(f"--parallel {axes} needs {n} devices, JAX has {len(devices)}.")
    names = tuple(axes)
    ranks = np.array([d.id for d in devices[:n]]).reshape(tuple(axes.values()))
    plc = jsbp.placement(devices[0].platform, ranks, axis_names=names)
    logical = dict(LOGICAL_AXES)
    if sequence_parallel:
        if "tp" not in names or "cp" in names:
            raise jsbp.SbpError("--sequence-parallel needs a tp axis (and no cp) in --parallel.")
        logical["act_seq"] = "tp"
    logical = {k: v for k, v in logical.items() if v is None or v in names}
    return jflax.Strategy(plc, logical_axes=logical, zero=zero)


def auto_strategy(model, optimizer, batch, memory_budget=None, *, accum: int = 1, zero: int = 0):
    """``Strategy.auto`` on the first ``AUTO_DEVICES`` devices for this model, optimizer and a
    batch of the run's shape; ``strategy.report`` lists what it planned."""
    if zero:
        raise jsbp.SbpError(
            "--zero with --parallel auto: the ZeRO stage is part of what auto chooses; drop --zero."
        )
    devices = jax.devices()
    if len(devices) < AUTO_DEVICES:
        raise jsbp.SbpError(
            f"--parallel auto lays the model out on {AUTO_DEVICES} devices, JAX has {len(devices)}."
        )
    plc = jsbp.placement(devices[0].platform, [d.id for d in devices[:AUTO_DEVICES]])
    return jflax.Strategy.auto(
        plc,
        memory_budget,
        model=model,
        optimizer=optimizer,
        loss_fn=loss_fn,
        batch=batch,
        accum=accum,
    )


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    losses: list[float]
    model: GPT  # plain (gathered) NNX model
    step_fn: jflax.TrainStep
    sharded: tuple  # (model, optimizer) as trained
    seconds: float


def train(
    parallel: dict[str, int] | str = DEFAULT_PARALLEL,
    *,
    zero: int = 0,
    sequence_parallel: bool = False,
    accum: int = 1,
    steps: int = 10,
    seed: int = 0,
    batch: int = BATCH,
    lr: float = LR,
    warmup: int = WARMUP,
    decay_steps: int = DECAY_STEPS,
    cfg: GPTConfig | None = None,
    corpus: Corpus | None = None,
    on_step=None,
    on_start=None,
    save_every: int = 0,
    ckpt_dir: str | None = None,
    resume: str | None = None,
    memory_budget=None,
) -> Run:
    """Train ``steps`` optimizer steps; returns the per-step losses and the final (gathered) model.
    ``parallel="auto"``: ``Strategy.auto`` chooses the layouts (``memory_budget`` per device)."""
    if isinstance(parallel, str):
        parallel = parse_parallel(parallel)
    corpus = corpus or Corpus()
    cfg = cfg or GPTConfig(vocab=corpus.vocab)
    model, optimizer = init(cfg, seed, lr_schedule(lr, warmup, decay_steps))
    if parallel == "auto":
        strategy = auto_strategy(
            model,
            optimizer,
            next(corpus.batches(seed, batch, cfg.seq)),
            memory_budget,
            accum=accum,
            zero=zero,
        )
    else:
        strategy = make_strategy(parallel, zero, sequence_parallel)
    if strategy is not None:
        model, optimizer = jflax.shard((model, optimizer), strategy)
    step = jflax.make_train_step(loss_fn, strategy, accum=accum)
    data = corpus.batches(seed, batch, cfg.seq)
    start = 0
    if (
        resume is not None
    ):  # logical values come back in THIS run's layouts, whatever the saved ones
        import jsbp.checkpoint as ckpt

        start = ckpt.latest_step(resume)
        if start is None:
            raise jsbp.SbpError(f"--resume {resume}: no complete checkpoint in that directory")
        target = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        loaded = ckpt.load_step(resume, start, target)
        nnx.update(model, loaded["model"])
        nnx.update(optimizer, loaded["optimizer"])
        for _ in range(start):  # the same data order as an uninterrupted run
            next(data)
    if on_start is not None:
        on_start(step, model, optimizer, next(corpus.batches(seed, batch, cfg.seq)))
    losses = []
    t0 = time.perf_counter()
    for i in range(start, steps):
        loss = step(model, optimizer, next(data))
        value = float(loss.numpy() if isinstance(loss, jsbp.GlobalTensor) else loss)
        losses.append(value)
        if on_step is not None:
            on_step(i, value)
        if save_every and ckpt_dir and (i + 1) % save_every == 0:
            import jsbp.checkpoint as ckpt

            ckpt.save_step(
                ckpt_dir, i + 1, {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            )
    seconds = time.perf_counter() - t0
    plain = jflax.gather(model) if strategy is not None else model
    return Run(losses, plain, step, (model, optimizer), seconds)


def sample(
    model: GPT,
    corpus: Corpus,
    prompt: str,
    n: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 10,
    seed: int = 0,
) -> str:
    """Continuation of ``prompt`` on one device: nanoGPT's temperature sampling from the ``top_k``
    most likely characters, with a fixed ``seed`` (the same model gives the same text).
    ``temperature=0`` is greedy decoding."""
    seq = model.cfg.seq
    fwd = nnx.jit(lambda m, x: m(x))
    rng = np.random.default_rng(seed)
    ids = [corpus.index.get(c, 0) for c in prompt][-seq:]
    for _ in range(n):
        window = ids[-seq:]
        x = np.zeros((1, seq), np.int32)
        x[0, : len(window)] = window
        logits = np.asarray(
            fwd(model, jnp.asarray(x))[0, len(window) - 1, : len(corpus.chars)], np.float64
        )
        if temperature <= 0:
            ids.append(int(np.argmax(logits)))
            continue
        logits = logits / temperature
        if top_k is not None and top_k < len(logits):
            logits[logits < np.sort(logits)[-top_k]] = -np.inf
        p = np.exp(logits - logits.max())
        ids.append(int(rng.choice(len(p), p=p / p.sum())))
    return corpus.decode(ids)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    axes = parse_parallel(args.parallel)
    if (
        axes != "auto" and axes.get("pp", 1) > 1
    ):  # pipeline parallelism lives in its own driver (jsbp.pipeline)
        if args.microbatches is None:
            print("train_gpt.py: --parallel with pp > 1 needs --microbatches N", file=sys.stderr)
            return 2
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import train_gpt_pipeline

        fwd = [
            "--parallel",
            args.parallel,
            "--microbatches",
            str(args.microbatches),
            "--schedule",
            args.schedule,
            "--steps",
            str(args.steps),
            "--seed",
            str(args.seed),
            "--batch",
            str(args.batch),
            "--lr",
            str(args.lr),
            "--warmup",
            str(args.warmup),
            "--decay-steps",
            str(args.decay_steps),
        ]
        return train_gpt_pipeline.main(fwd + (["--json"] if args.json else []))
    if args.memory_budget is not None and axes != "auto":
        print("train_gpt.py: --memory-budget needs --parallel auto", file=sys.stderr)
        return 2
    if "WORLD_SIZE" in os.environ:  # started by python -m jsbp.launch (or torchrun-style variables)
        jsbp.distributed.initialize()
    elif axes == "auto":
        configure_devices(AUTO_DEVICES)
    else:
        configure_devices(math.prod(axes.values()) if axes else 1)
    out = sys.stderr if args.json else sys.stdout

    def show(text=""):
        print(text, file=out, flush=True)

    corpus = Corpus()
    fused = args.fused_attention or (axes != "auto" and axes.get("cp", 1) > 1)
    cfg = GPTConfig(vocab=corpus.vocab, seq=args.seq_len, fused_attention=fused)
    show(
        f"jsbp train_gpt: {len(corpus.tokens)} characters, vocab {len(corpus.chars)} (padded to {cfg.vocab}), "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    )

    def on_start(step, model, optimizer, batch):
        strategy = step.strategy
        if strategy is None:
            show("parallel: none (one device, plain jax.jit)")
            return
        if strategy.report is not None:  # --parallel auto: what was planned, what was chosen
            show(str(strategy.report))
            m = step.memory(model, optimizer, batch)
            show(
                f"measured per device: model + optimizer state {m['state'] / 2**20:.2f} MiB "
                f"(predicted {m['predicted_state'] / 2**20:.2f} MiB); XLA's peak of the step with its state "
                f"updated in place {m['in_place'] / 2**20:.2f} MiB (predicted {m['predicted'] / 2**20:.2f} MiB)\n"
            )
        show(f"{strategy}")
        show("\nparameter layouts:")
        show(jflax.describe(model))
        t = time.perf_counter()
        plan = step.explain(model, optimizer, batch)
        kinds = {k: v for k, v in plan.collectives().items() if v}
        show(
            f"\nplan: {sum(kinds.values())} collective(s) per step {kinds}, "
            f"{plan.total_bytes_per_device / 1024:.1f} KiB moved per device (planned in {time.perf_counter() - t:.1f}s)\n"
        )

    bar = None
    if not args.json:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", unit="step", file=sys.stdout)

    def on_step(i, loss):
        if args.json:
            print(json.dumps({"step": i, "loss": loss}), flush=True)
        else:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")

    t0 = time.perf_counter()
    try:
        run = train(
            axes,
            zero=args.zero,
            sequence_parallel=args.sequence_parallel,
            accum=args.accum,
            steps=args.steps,
            seed=args.seed,
            batch=args.batch,
            lr=args.lr,
            warmup=args.warmup,
            decay_steps=args.decay_steps,
            cfg=cfg,
            corpus=corpus,
            on_step=on_step,
            on_start=on_start,
            save_every=args.save_every,
            ckpt_dir=args.ckpt_dir,
            resume=args.resume,
            memory_budget=args.memory_budget,
        )
    except jsbp.SbpError as e:
        if bar is not None:
            bar.close()
        print(f"train_gpt.py: {e}", file=sys.stderr)
        return 2
    if bar is not None:
        bar.close()
    show(
        f"final loss {run.losses[-1]:.4f} after {args.steps} steps ({time.perf_counter() - t0:.1f}s total)"
    )
    if not args.json:
        show("sample (temperature 0.8, top-10, seed 0):\n" + sample(run.model, corpus, PROMPT, 160))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
