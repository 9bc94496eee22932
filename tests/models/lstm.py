"""A character LSTM language model on ``nnx.RNN``: ``nnx.Embed`` -> ``nnx.RNN`` over an
``nnx.LSTMCell`` with recurrent dropout -> ``nnx.Linear`` head, next-token cross-entropy.

Recurrent dropout: the cell drops units of the hidden state it feeds back into its gates
(``nnx.Dropout`` inside the cell, holding its own ``rngs``); ``nnx.RNN`` scans the cell with
``nnx.scan``, carrying the dropout's RNG state from step to step, so every time step draws a new
mask. Input dropout sits on the embeddings.

Megatron over ``tp``: the eight gate projections are column-parallel (split on the hidden dim,
``kernel_metadata``), the head is vocab-parallel; the hidden state fed back each step is whole.
"""

from __future__ import annotations

from flax import nnx

import jsbp.flax as jflax

from . import part, token_stream

VOCAB, EMBED, HIDDEN, SEQ, BATCH, DROPOUT = 64, 16, 32, 8, 16, 0.2

RULES = {
    "logical_axes": {"hidden": "tp", "vocab": "tp", "embed": None},
    "param_sbp": [],
}


class DropoutLSTMCell(nnx.LSTMCell):
    """``nnx.LSTMCell`` whose recurrent input (the previous hidden state) goes through dropout."""

    def __init__(self, in_features, hidden_features, *, recurrent_dropout: float, rngs: nnx.Rngs):
        col = {"out_sharding": ("embed", "hidden")}
        super().__init__(
            in_features,
            hidden_features,
            kernel_metadata=col,
            recurrent_kernel_metadata={"out_sharding": (None, "hidden")},
            bias_metadata={"out_sharding": ("hidden",)},
            rngs=rngs,
        )
        self.recurrent_dropout = nnx.Dropout(recurrent_dropout, rngs=rngs)

    def __call__(self, carry, inputs):
        c, h = carry
        h = jflax.constrain(h, ("batch", None))  # the fed-back state is whole on every tp rank
        return super().__call__((c, self.recurrent_dropout(h)), inputs)


class LSTMLM(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(
            VOCAB,
            EMBED,
            embedding_init=part(nnx.initializers.normal(0.1), None, "embed"),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(DROPOUT, rngs=rngs)
        cell = DropoutLSTMCell(EMBED, HIDDEN, recurrent_dropout=DROPOUT, rngs=rngs)
        self.rnn = nnx.RNN(cell, rngs=rngs)
        self.head = nnx.Linear(
            HIDDEN,
            VOCAB,
            kernel_init=part(nnx.initializers.lecun_normal(), None, "vocab"),
            bias_init=part(nnx.initializers.zeros_init(), "vocab"),
            rngs=rngs,
        )

    def __call__(self, tokens):
        x = self.dropout(self.embed(tokens))
        h = self.rnn(jflax.constrain(x, ("batch", "seq", "embed")))
        return self.head(jflax.constrain(h, ("batch", "seq", None)))


def make(rngs: nnx.Rngs) -> LSTMLM:
    with nnx.use_eager_sharding(False):
        return LSTMLM(rngs=rngs)


def batch(seed: int):
    return token_stream(seed, VOCAB, BATCH, SEQ)


def loss_fn(model: LSTMLM, batch):
    logits = model(batch[:, :-1])
    return jflax.softmax_cross_entropy(logits, batch[:, 1:], ("batch", "seq", "vocab"))
