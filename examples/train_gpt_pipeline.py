"""Train the character-level GPT of ``train_gpt.py`` with pipeline parallelism (``jsbp.pipeline``).

    python examples/train_gpt_pipeline.py --parallel pp=2,dp=2,tp=2 --microbatches 4 --schedule 1f1b
    python examples/train_gpt_pipeline.py --parallel pp=2,dp=2,tp=2 --microbatches 4 --schedule gpipe
    python examples/train_gpt_pipeline.py --parallel pp=4,dp=2 --microbatches 8 --steps 20 --check

The model, data and optimizer are ``train_gpt.py``'s, unchanged. The model is cut into ``pp``
contiguous stages — the embeddings, the transformer blocks and the head, as evenly as possible —
and each stage lives on its own ``dp x tp`` sub-placement, with ``train_gpt.py``'s logical axis
mapping inside it (vocab-parallel embedding and head, Megatron attention and MLP). Each step cuts
the batch into ``--microbatches`` micro-batches, runs the schedule, and applies one adamw update,
so the losses equal ``train_gpt.py --parallel none`` to fp32 rounding (``--check`` compares them).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_gpt as base  # noqa: E402  (train_gpt imports JAX but starts no backend)

DEFAULT_PARALLEL = "pp=2,dp=2,tp=2"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--parallel",
        default=DEFAULT_PARALLEL,
        help="comma-separated pp=N,dp=N,tp=N; pp x dp x tp devices (default %(default)s)",
    )
    ap.add_argument(
        "--microbatches",
        type=int,
        required=True,
        help="micro-batches per batch (required: the batch size must be a multiple of it)",
    )
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved"))
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=base.BATCH, help="sequences per optimizer step")
    ap.add_argument(
        "--lr", type=float, default=base.LR, help="peak learning rate (default %(default)s)"
    )
    ap.add_argument(
        "--warmup", type=int, default=base.WARMUP, help="linear warmup steps (default %(default)s)"
    )
    ap.add_argument(
        "--decay-steps",
        type=int,
        default=base.DECAY_STEPS,
        help="cosine decay of the learning rate to lr/10 over this many steps (default %(default)s)",
    )
    ap.add_argument(
        "--check", action="store_true", help="also train on one device and compare the losses"
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per step on stdout")
    return ap


import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jsbp  # noqa: E402
import jsbp.flax as jflax  # noqa: E402
import jsbp.pipeline as jpp  # noqa: E402


class Embed(nnx.Module):
    """The first piece of the GPT: token and position embeddings (shared with the model)."""

    def __init__(self, gpt: base.GPT):
        self.wte, self.wpe = gpt.wte, gpt.wpe

    def __call__(self, tokens):
        t = tokens.shape[1]
        return jflax.constrain(self.wte(tokens) + self.wpe(jnp.arange(t))[None], base.ACT)


class Head(nnx.Module):
    """The last piece: final norm and the vocab-parallel head (shared with the model)."""

    def __init__(self, gpt: base.GPT):
        self.ln_f, self.head = gpt.ln_f, gpt.head

    def __call__(self, x):
        return self.head(jflax.constrain(self.ln_f(x), base.ACT))


def stage_parts(gpt: base.GPT, stages: int) -> list[list[nnx.Module]]:
    """``[Embed, *blocks, Head]`` cut into ``stages`` contiguous, near-equal ranges."""
    parts = [Embed(gpt), *gpt.blocks, Head(gpt)]
    if stages > len(parts):
        raise jsbp.SbpError(
            f"the pipeline needs {stages} stages (pp, times 2 chunks per rank when interleaved) but the model "
            f"has only {len(parts)} pieces (embeddings, {len(gpt.blocks)} blocks, head); use fewer stages."
        )
    sizes = [len(parts) // stages + (1 if i < len(parts) % stages else 0) for i in range(stages)]
    out, start = [], 0
    for n in sizes:
        out.append(parts[start : start + n])
        start += n
    return out


def next_char_loss(logits, targets):
    return jflax.softmax_cross_entropy(logits, targets, ("batch", "seq", "vocab"))


def make_pipeline(gpt, tx, axes: dict[str, int], microbatches: int, schedule: str) -> jpp.Pipeline:
    pp = axes.get("pp", 1)
    inner = {k: v for k, v in axes.items() if k != "pp"}
    chunks = 2 if schedule == "interleaved" else 1
    placements = jpp.stage_placements(pp, axes=inner or None)
    logical = {k: v for k, v in base.LOGICAL_AXES.items() if v is None or v in inner}
    return jpp.Pipeline(
        stage_parts(gpt, pp * chunks),
        next_char_loss,
        tx,
        microbatches=microbatches,
        schedule=schedule,
        placements=placements,
        logical_axes=logical,
    )


def train(
    parallel: str | dict = DEFAULT_PARALLEL,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    steps: int = 10,
    seed: int = 0,
    batch: int = base.BATCH,
    lr: float = base.LR,
    warmup: int = base.WARMUP,
    decay_steps: int = base.DECAY_STEPS,
    cfg: base.GPTConfig | None = None,
    corpus: base.Corpus | None = None,
    on_step=None,
):
    """Train ``steps`` steps; returns ``(losses, pipeline, model)`` with the trained values in ``model``."""
    axes = base.parse_parallel(parallel) if isinstance(parallel, str) else dict(parallel)
    if axes.get("pp", 1) < 2:
        raise jsbp.SbpError(
            f"--parallel {axes}: this example is for pipelines; give pp=2 or more "
            "(train_gpt.py runs dp and tp alone)."
        )
    corpus = corpus or base.Corpus()
    cfg = cfg or base.GPTConfig(vocab=corpus.vocab)
    # the optimizer only lends its optax transform (adamw with train_gpt.py's learning-rate schedule)
    model, optimizer = base.init(cfg, seed, base.lr_schedule(lr, warmup, decay_steps))
    pipe = make_pipeline(model, optimizer.tx, axes, microbatches, schedule)
    losses = []
    for i, tokens in zip(range(steps), corpus.batches(seed, batch, cfg.seq)):
        loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
        losses.append(loss)
        if on_step is not None:
            on_step(i, loss, pipe)
    pipe.write_back()
    return losses, pipe, model


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    axes = base.parse_parallel(args.parallel)
    base.configure_devices(math.prod(axes.values()))
    out = sys.stderr if args.json else sys.stdout

    def show(text=""):
        print(text, file=out, flush=True)

    corpus = base.Corpus()
    cfg = base.GPTConfig(vocab=corpus.vocab)

    def on_step(i, loss, pipe):
        if i == 0:
            show(f"{pipe}")
            show(f"stage placements: {[p.ranks.tolist() for p in pipe.placements]}")
            show("\nfirst step:\n" + pipe.last_record.text() + "\n")
        if args.json:
            print(json.dumps({"step": i, "loss": loss}), flush=True)
        elif i % 10 == 0 or i == args.steps - 1:
            show(f"step {i:4d}  loss {loss:.4f}")

    t0 = time.perf_counter()
    losses, pipe, model = train(
        axes,
        microbatches=args.microbatches,
        schedule=args.schedule,
        steps=args.steps,
        seed=args.seed,
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        decay_steps=args.decay_steps,
        cfg=cfg,
        corpus=corpus,
        on_step=on_step,
    )
    rec = pipe.last_record
    show(
        f"final loss {losses[-1]:.4f} after {args.steps} steps ({time.perf_counter() - t0:.1f}s); "
        f"bubble {rec.schedule.bubble_fraction:.1%}, measured peak live micro-batches per stage {rec.peak_live}"
    )
    if args.check:
        ref = base.train(
            "none",
            steps=args.steps,
            seed=args.seed,
            batch=args.batch,
            lr=args.lr,
            warmup=args.warmup,
            decay_steps=args.decay_steps,
            cfg=cfg,
            corpus=corpus,
        )
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses))
        show(
            f"one device: final loss {ref.losses[-1]:.4f}; largest relative loss difference {worst:.1e}"
        )
        if worst > 1e-5:
            show("MISMATCH: the pipeline does not reproduce the one-device losses")
            return 1
    if not args.json:
        show(
            "sample (temperature 0.8, top-10, seed 0):\n"
            + base.sample(model, corpus, base.PROMPT, 160)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
