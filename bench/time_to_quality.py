"""Time to quality: training seconds until held-out bits-per-byte reach a level, gemmalab's
defaults against the tutorial's loop on the same model and data.

    .venv/bin/python bench/time_to_quality.py --seconds 200

Both train the gemma3-tiny preset from the same random init on the embedded stories, with the
same tokenizer, rows of ``--maxlen`` and (unless ``--tutorial-batch`` says otherwise) the same
rows a step: gemmalab's default batch. gemmalab runs its defaults (packed
rows, loss masks, BOS/EOS, warmup + cosine at the preset's peak learning rate, fp32 master
weights); the tutorial's loop (``bench/tutorial_loop.py``) runs as the tutorial wrote it, at the
same peak learning rate held constant (its own 2e-5 suits a pretrained checkpoint and barely
moves a random init). The loops alternate every ``--chunk`` seconds of training, so a noisy host
slows both alike; evaluation time is not training time.

Quality is bits per byte on stories neither has seen (a corpus generated with another seed):
the summed negative log-likelihood of each story's tokens after its first, over the story's UTF-8
bytes. Both predict the same tokens (gemmalab's format gives BOS as context; the tutorial's has
none): the scores compare even across tokenizers.

Reports the tutorial's bits-per-byte at the end of its budget, the seconds each loop needed to
reach it (interpolated between evaluations), their ratio, and both at equal time.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import tutorial_loop  # noqa: E402 - bench/ is not a package

from gemmalab.config import TrainConfig  # noqa: E402
from gemmalab.data import corpus
from gemmalab.data.tokenizer import BOS_ID
from gemmalab.model import presets
from gemmalab.train.experiment import Experiment


class BitsPerByte:
    """Held-out bits per byte of a model's weights, as described in the module docstring."""

    def __init__(self, model: Any, stories: list[str], tokenizer: Any, *, maxlen: int,
                 batch: int = 64):
        self.model = model
        ids = [tokenizer.encode(s) for s in stories]
        kept = [(s, t) for s, t in zip(stories, ids, strict=True) if 2 <= len(t) <= maxlen]
        self.bytes = sum(len(s.encode("utf-8")) for s, _ in kept)
        self.stories = len(kept)
        self.rows = {}
        for bos in (False, True):
            seqs = [([BOS_ID] if bos else []) + t for _, t in kept]
            inputs = np.zeros((len(seqs), maxlen), np.int32)
            targets = np.zeros_like(inputs)
            mask = np.zeros(inputs.shape, np.float32)
            for i, seq in enumerate(seqs):
                n = len(seq) - 1
                inputs[i, :n], targets[i, :n] = seq[:-1], seq[1:]
                mask[i, int(bos):n] = 1.0  # never the first token: the tutorial can't predict it
            pad = -len(seqs) % batch
            self.rows[bos] = [np.pad(a, ((0, pad), (0, 0)))
                              for a in (inputs, targets, mask)]
        self.batch = batch
        self._nll = jax.jit(self._nll_sum)

    def _nll_sum(self, params: Any, tokens: jax.Array, targets: jax.Array, mask: jax.Array
                 ) -> jax.Array:
        params = presets.cast_params(params, jnp.bfloat16)
        logits = self.model.apply({"params": params}, tokens).logits.astype(jnp.float32)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
        return jnp.sum(nll * mask)

    def __call__(self, params: Any, *, bos: bool) -> float:
        inputs, targets, mask = self.rows[bos]
        total = 0.0
        for start in range(0, len(inputs), self.batch):
            part = slice(start, start + self.batch)
            total += float(self._nll(params, inputs[part], targets[part], mask[part]))
        return total / math.log(2) / self.bytes


class Contender:
    """A training loop advanced a few seconds at a time, with its (seconds, bpb) timeline."""

    def __init__(self, name: str, step: Any, next_batch: Any, state: Any, params: Any,
                 max_steps: int, bos: bool):
        self.name, self.step, self.next_batch, self.state = name, step, next_batch, state
        self.params, self.max_steps, self.bos = params, max_steps, bos
        self.seconds, self.steps, self.timeline = 0.0, 0, []

    def train_for(self, seconds: float) -> None:
        started = time.perf_counter()
        while self.steps < self.max_steps and time.perf_counter() - started < seconds:
            self.state, metrics = self.step(self.state, self.next_batch())
            jax.block_until_ready(metrics)  # steps dispatch asynchronously: wait for each
            self.steps += 1
        self.seconds += time.perf_counter() - started

    def evaluate(self, bpb: BitsPerByte) -> None:
        self.timeline.append((self.seconds, bpb(self.params(self.state), bos=self.bos)))


def seconds_to_reach(timeline: list[tuple[float, float]], level: float) -> float | None:
    """First time the bpb curve crosses ``level``, linearly interpolated between evaluations."""
    previous = (0.0, float("inf"))
    for seconds, value in timeline:
        if value <= level:
            if math.isinf(previous[1]):
                return seconds
            share = (previous[1] - level) / (previous[1] - value)
            return previous[0] + share * (seconds - previous[0])
        previous = (seconds, value)
    return None


def value_at(timeline: list[tuple[float, float]], seconds: float) -> float:
    """bpb at ``seconds`` of training, interpolated (the last value past the end)."""
    times = [t for t, _ in timeline]
    return float(np.interp(seconds, times, [v for _, v in timeline]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=200, help="training budget per loop")
    parser.add_argument("--chunk", type=float, default=10, help="seconds per turn, per eval")
    parser.add_argument("--batch", type=int, default=None, help="default: the model's")
    parser.add_argument("--tutorial-batch", type=int, default=None,
                        help="rows per step of the tutorial's loop (default: gemmalab's)")
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--heldout", type=int, default=300, help="held-out stories")
    parser.add_argument("--cache-dir", default="")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE,...",
                        help="another gemmalab contender with TrainConfig overrides, e.g. "
                        "'bs32:batch_size=32' (repeatable): a recipe sweep in the same run")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="time_to_quality_")
    config = TrainConfig.flat(batch_size=args.batch, maxlen=args.maxlen, eval_every=0,
                         checkpoint_every=0, resume=False, output_dir=f"{workdir}/run",
                         cache_dir=args.cache_dir)
    lab = Experiment.prepare(config)
    peak_lr = presets.default_learning_rate(config.model.preset, lora=False)
    heldout_path = corpus.embedded_corpus_path(config.runtime.resolved_cache_dir / "corpus",
                                               args.heldout, seed=config.trainer.seed + 1000)
    bpb = BitsPerByte(lab.base_model, tutorial_loop.read_stories(str(heldout_path)),
                      lab.tokenizer, maxlen=args.maxlen)

    tutorial_batch = args.tutorial_batch or config.trainer.batch_size
    setup = tutorial_loop.beside(lab, batch_size=tutorial_batch, learning_rate=peak_lr)
    tutorial = Contender("tutorial", tutorial_loop.train_step, setup.next_batch, setup.state,
                         lambda state: state.params, max_steps=10**9, bos=False)
    print(f"{config.model.preset}, batch {config.trainer.batch_size} x {args.maxlen} (tutorial: "
          f"{tutorial_batch}), peak LR {peak_lr:g}; held out: "
          f"{bpb.stories} stories, {bpb.bytes:,} bytes; gemmalab's schedule: "
          f"{lab.total_steps} steps", flush=True)
    contenders = [tutorial, lab_contender("gemmalab", lab)]
    for spec in args.variant:
        name, _, fields = spec.partition(":")
        overrides = {k: ast.literal_eval(v) for k, v in
                     (item.split("=", 1) for item in fields.split(",") if item)}
        variant = Experiment.prepare(dataclasses.replace(
            config, output_dir=f"{workdir}/{name}", **overrides))
        contenders.append(lab_contender(name, variant))
    for contender in contenders:  # compile outside the clock, then start both at bpb(init)
        contender.state, _ = contender.step(contender.state, contender.next_batch())
        contender.steps = 1
        contender.evaluate(bpb)
        contender.timeline[-1] = (0.0, contender.timeline[-1][1])
    while any(c.seconds < args.seconds and c.steps < c.max_steps for c in contenders):
        for contender in contenders:
            if contender.seconds < args.seconds and contender.steps < contender.max_steps:
                contender.train_for(min(args.chunk, args.seconds - contender.seconds))
                contender.evaluate(bpb)
        print("  " + ", ".join(f"{c.name} {c.seconds:.0f} s/{c.steps} steps: "
                               f"{c.timeline[-1][1]:.3f} bpb" for c in contenders), flush=True)

    level = tutorial.timeline[-1][1]
    tutorial_reach = seconds_to_reach(tutorial.timeline, level)
    rows = []
    for contender in contenders:
        reach = seconds_to_reach(contender.timeline, level)
        rows.append({"loop": contender.name, "steps": contender.steps,
                     f"bpb at {args.seconds:.0f} s": contender.timeline[-1][1],
                     f"seconds to {level:.3f} bpb": reach,
                     "sooner than the tutorial": tutorial_reach / reach if reach else None,
                     "tutorial's bpb then": value_at(tutorial.timeline, reach) if reach else None})
    import pandas as pd

    print(pd.DataFrame(rows).set_index("loop").to_markdown(floatfmt=".3f"))


def lab_contender(name: str, lab: Experiment) -> Contender:
    """A gemmalab run driven step by step (its compiled step, its prefetched batches)."""
    step = lab.compile()
    return Contender(name, lambda state, batch: step(state, batch, lab.weights.frozen),
                     lab.next_batch, lab.weights.state, lambda state: state.params,
                     max_steps=lab.total_steps, bos=True)


if __name__ == "__main__":
    main()
