"""The tutorial's training loop, re-expressed on gemmalab's model and data for side-by-side runs.

What it keeps from the tutorial (that is the point of the comparison): each story is tokenized
inside the loader every epoch, without BOS/EOS, truncated to ``maxlen`` and padded with id 0; one
story per row; targets are the row shifted left with a 0 appended; the loss is the unmasked mean
over every position (padding included); the weights are bfloat16 and AdamW updates them directly
(no fp32 master copy, no warmup, no clipping); the model builds its own causal/padding mask.

Used by ``bench/vs_tutorial.py`` (step and tokens/s) and ``bench/time_to_quality.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

SEPARATOR = "<|endoftext|>"


def read_stories(path: str) -> list[str]:
    """Every non-blank story of a TinyStories-format file (the tutorial reads it whole)."""
    with open(path, encoding="utf-8") as f:
        return [s for s in f.read().split(SEPARATOR) if s.strip()]


class PaddedStories:
    """grain data source: story ``i`` tokenized on each read, cut to ``maxlen``, padded with 0."""

    def __init__(self, stories: list[str], tokenizer: Any, maxlen: int):
        self.stories, self.tokenizer, self.maxlen = stories, tokenizer, maxlen

    def __len__(self) -> int:
        return len(self.stories)

    def __getitem__(self, index: int) -> np.ndarray:
        ids = self.tokenizer.encode(self.stories[index])[:self.maxlen]
        row = np.zeros(self.maxlen, np.int32)
        row[:len(ids)] = ids
        return row


def batches(stories: list[str], tokenizer: Any, *, maxlen: int, batch_size: int,
            seed: int = 0) -> Any:
    """An endless iterator of ``[batch_size, maxlen]`` token rows (grain's DataLoader with no
    worker processes or prefetch, as the tutorial builds it; shuffled per epoch here)."""
    import grain.python as pygrain

    source = PaddedStories(stories, tokenizer, maxlen)
    sampler = pygrain.IndexSampler(len(source), shuffle=True, seed=seed,
                                   shard_options=pygrain.NoSharding(), num_epochs=None)
    loader = pygrain.DataLoader(data_source=source, sampler=sampler, worker_count=0,
                                operations=[pygrain.Batch(batch_size, drop_remainder=True)])
    return iter(loader)


def init_state(model: Any, params: Any, learning_rate: float) -> train_state.TrainState:
    """bfloat16 weights under plain AdamW, as the tutorial trains them."""
    weights = jax.tree.map(lambda p: jnp.asarray(p, jnp.bfloat16), params)
    return train_state.TrainState.create(apply_fn=model.apply, params=weights,
                                         tx=optax.adamw(learning_rate))


@dataclasses.dataclass
class Beside:
    """The tutorial's loop set up beside a gemmalab run (``beside``)."""

    state: train_state.TrainState
    next_batch: Callable[[], jax.Array]  # the next [rows, maxlen] token batch, on the device
    stories: int  # in the corpus file it reads


def beside(lab: Any, *, batch_size: int, learning_rate: float) -> Beside:
    """The tutorial's loop on what the ``gemmalab.train.experiment.Experiment`` ``lab`` trains: its
    model config and initial weights (in bfloat16), its corpus file (every story, read whole)
    and tokenizer, rows of its ``maxlen``."""
    from gemmalab.model import presets

    stories = read_stories(lab.data_stats["corpus_path"])
    model = presets.build_model(lab.prepared.model_config, param_dtype=jnp.bfloat16)
    rows = batches(stories, lab.tokenizer, maxlen=lab.config.data.maxlen, batch_size=batch_size)
    return Beside(state=init_state(model, lab.weights.state.params, learning_rate),
                  next_batch=lambda: jax.device_put(np.asarray(next(rows), np.int32)),
                  stories=len(stories))


@functools.partial(jax.jit, donate_argnums=(0,))
def train_step(state: train_state.TrainState, tokens: jax.Array
               ) -> tuple[train_state.TrainState, dict[str, jax.Array]]:
    """One step: mean cross-entropy over every position of the shifted rows, then AdamW."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)

    def loss_fn(params: Any) -> jax.Array:
        logits = state.apply_fn({"params": params}, tokens).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    # Useful targets: real next tokens (not padding), what gemmalab's rows count as loss-bearing.
    return state.apply_gradients(grads=grads), {"loss": loss,
                                                "useful_tokens": jnp.sum(targets > 0)}
