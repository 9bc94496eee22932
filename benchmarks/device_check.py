"""On a machine with an accelerator (a lent GPU): does jsbp's one-device path match plain JAX there,
and what does it cost?

    python benchmarks/device_check.py [--steps 40] [--sizes small,medium] [--precision highest] [--json FILE]

For each GPT size (``examples/train_gpt.py``'s model, nanoGPT's adamw recipe) it trains the same
steps twice from the same parameters and batches: ``jsbp.flax.make_train_step(loss_fn, None)``
(plain ``jax.jit``, the reference) and the same step under a ``Strategy`` on a one-device placement
of the default backend's first device (``jsbp.jit``). It prints the largest difference of the first five losses, the loss
after the timed steps (on a batch of the first five), the largest parameter difference, and the
median step times measured interleaved in one run (ratios,
not absolute times, are what to compare). It exits non-zero if a difference exceeds the tolerance.

At the platform's default precision a GPU multiplies float32 matrices in TF32, and two programs
that differ only in how XLA fuses them round differently; over 48 adamw steps that reaches ~3e-4
of the small model's loss (H100, JAX 0.11.2), more than the tolerance. Hence ``--precision
highest`` by default: there the two paths agree to ~2e-7.

It runs anywhere; on simulated CPU devices it checks the same things more slowly.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

from _common import interleaved_medians  # noqa: E402

SIZES = {  # name -> GPTConfig fields (vocab from the corpus)
    "small": dict(seq=64, d_model=64, n_heads=8, n_layers=2, d_mlp=256),
    "medium": dict(seq=128, d_model=512, n_heads=8, n_layers=4, d_mlp=2048),
}
BATCH = {"small": 32, "medium": 32}
TOL = 2e-4  # relative, on losses: XLA may fuse the same program differently on either side
LR = 1e-3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per variant")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--sizes", default=",".join(SIZES), help="comma-separated, of: " + ", ".join(SIZES)
    )
    ap.add_argument(
        "--precision",
        default="highest",
        choices=("highest", "default"),
        help="float32 matmul precision: highest (the check is exact to rounding) or the "
        "platform's default (TF32 on recent NVIDIA GPUs: the timings users see)",
    )
    args = ap.parse_args(argv)

    import jax

    if args.precision == "highest":
        jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    import train_gpt as tg
    from flax import nnx

    import jsbp
    import jsbp.flax as jflax

    dev = jax.devices()[0]
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, device {dev.device_kind}, "
        f"matmul precision {args.precision}",
        flush=True,
    )
    corpus = tg.Corpus()
    results, bad = [], []
    for name in args.sizes.split(","):
        fields = SIZES[name]
        cfg = tg.GPTConfig(vocab=corpus.vocab, **fields)
        data = corpus.batches(0, BATCH[name], cfg.seq)
        batches = [next(data) for _ in range(6)]
        strategy = jflax.Strategy(
            jsbp.placement(dev.platform, [dev.id], axis_names=("dp",)),
            logical_axes={k: v for k, v in tg.LOGICAL_AXES.items() if v in (None, "dp")},
        )

        def variant(use_jsbp, cfg=cfg, strategy=strategy, batches=batches):
            model, opt = tg.init(cfg, 0, LR)
            if not use_jsbp:
                step = jflax.make_train_step(tg.loss_fn, None)
            else:
                model, opt = jflax.shard((model, opt), strategy)
                step = jflax.make_train_step(tg.loss_fn, strategy)
            losses = []
            for b in batches[:5]:  # the first step plans and compiles
                loss = step(model, opt, b)
                losses.append(float(loss.numpy() if isinstance(loss, jsbp.GlobalTensor) else loss))
            return step, (model, opt), losses

        names = ("jax.jit", "jsbp")
        made = [variant(False), variant(True)]

        def runner(step):
            def fn(state, b):
                return state, step(state[0], state[1], b)

            return fn

        ref_losses = made[0][2]
        for label, (_, _, losses) in zip(names[1:], made[1:]):
            d = max(abs(a - r) / max(abs(r), 1e-6) for a, r in zip(losses, ref_losses))
            print(
                f"{name}: {label} losses vs jax.jit, largest relative difference {d:.2e}",
                flush=True,
            )
            if d > TOL:
                bad.append(f"{name} {label} losses {d:.2e}")
        times, states = interleaved_medians(
            [runner(m[0]) for m in made],
            [m[1] for m in made],
            [batches[5]] * 3,
            args.steps,
            warmup=3,
        )
        loss_of = jax.jit(tg.loss_fn)
        plains = [
            model if label == "jax.jit" else jflax.gather(model)
            for label, (model, _) in zip(names, states)
        ]
        ref_params = jax.tree.leaves(nnx.state(plains[0], nnx.Param))
        ref_final = float(loss_of(plains[0], batches[4]))  # a batch of the first five
        row = {"size": name, "config": fields, "batch": BATCH[name]}
        for label, plain, t in zip(names, plains, times):
            final = float(loss_of(plain, batches[4]))
            d_loss = abs(final - ref_final) / abs(ref_final)
            # an adamw step moves an element by about lr whatever its gradient's size, so rounding
            # that flips a tiny gradient's sign shows as ~lr: the difference is reported in lr units
            d_par = (
                max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(r))))
                    for a, r in zip(jax.tree.leaves(nnx.state(plain, nnx.Param)), ref_params)
                )
                / LR
            )
            row[label] = {
                "step_ms": t,
                "ratio": t / times[0],
                "final_loss": final,
                "final_loss_rel_diff": d_loss,
                "param_max_diff_in_lr": d_par,
            }
            print(
                f"{name}: {label:12s} {t:8.3f} ms/step  x{t / times[0]:.3f}  final loss {final:.6f} "
                f"({d_loss:.1e} from jax.jit), params within {d_par:.2f} lr",
                flush=True,
            )
            if d_loss > TOL:
                bad.append(f"{name} {label} final loss {d_loss:.2e}")
        results.append(row)
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(
                {
                    "jax": jax.__version__,
                    "device": dev.device_kind,
                    "precision": args.precision,
                    "results": results,
                },
                indent=1,
            )
        )
    if bad:
        print("MISMATCH: " + "; ".join(bad))
        return 1
    print("all variants match jax.jit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
