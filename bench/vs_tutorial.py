"""gemmalab's training loop against the tutorial's, side by side in one process.

    .venv/bin/python bench/vs_tutorial.py --batch 16 --steps 20 --rounds 2

Same model (gemma3-tiny, the local 2,048-piece tokenizer), same random init, same embedded
stories, same rows x maxlen per step. Each loop runs its own data path inline, as it would in a
notebook: the tutorial's tokenizes every story in the loader (``bench/tutorial_loop.py``),
gemmalab's reads packed rows from its token cache through a prefetching iterator. Timed steps
exclude the first ``--warmup`` (compilation); loops alternate ``--rounds`` times so drift on a
noisy machine hits both alike.

Reports per loop: step time, tokens/s (row positions), useful tokens/s (targets that are real
next tokens: gemmalab's loss-bearing ones, the tutorial's non-padding ones), the useful share,
and the share of wall time spent waiting for data; CPU seconds per step (all of the process's
threads: the figure to trust when other work shares the host); then gemmalab / tutorial ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import tutorial_loop  # noqa: E402 - bench/ is not a package

from gemmalab.config import TrainConfig  # noqa: E402
from gemmalab.train.experiment import Experiment


@dataclasses.dataclass
class Timing:
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # every thread of this process: robust to other load on the host
    data_seconds: float = 0.0
    steps: int = 0
    tokens: int = 0
    useful: float = 0.0

    def add(self, other: Timing) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def row(self, name: str) -> dict[str, float | str]:
        return {"loop": name, "step_s": self.seconds / self.steps,
                "cpu_s_per_step": self.cpu_seconds / self.steps,
                "tokens_per_s": self.tokens / self.seconds,
                "useful_tokens_per_s": self.useful / self.seconds,
                "useful_share": self.useful / self.tokens,
                "data_wait_share": self.data_seconds / self.seconds}


def run_steps(next_batch, step, state, *, steps: int, warmup: int, row_tokens: int
              ) -> tuple[Timing, object]:
    """``warmup`` untimed steps, then ``steps`` timed ones (data fetch included)."""
    for _ in range(warmup):
        state, metrics = step(state, next_batch())
    jax.block_until_ready(state)
    timing, useful = Timing(steps=steps, tokens=steps * row_tokens), []
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fetch = time.perf_counter()
        batch = next_batch()
        timing.data_seconds += time.perf_counter() - fetch
        state, metrics = step(state, batch)
        useful.append(metrics["useful_tokens"])
    jax.block_until_ready(metrics)
    timing.seconds = time.perf_counter() - started
    timing.cpu_seconds = time.process_time() - cpu_started
    timing.useful = float(sum(np.asarray(jax.device_get(useful), np.float64)))
    return timing, state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-dir", default="", help="gemmalab cache_dir ('' = the default)")
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="vs_tutorial_")
    config = TrainConfig.flat(batch_size=args.batch, maxlen=args.maxlen, eval_every=0,
                         checkpoint_every=0, resume=False, max_steps=10**6,
                         output_dir=f"{workdir}/run", cache_dir=args.cache_dir)
    lab = Experiment.prepare(config)
    tutorial = tutorial_loop.beside(lab, batch_size=args.batch,
                                    learning_rate=lab.schedule(config.trainer.max_steps // 2))
    tutorial_state = tutorial.state
    row_tokens = args.batch * args.maxlen
    print(f"{config.model.preset} ({lab.num_params:,} params), batch {args.batch} x {args.maxlen}, "
          f"{tutorial.stories:,} stories, {jax.device_count()} x {jax.devices()[0].device_kind}")

    totals = {"tutorial": Timing(), "gemmalab": Timing()}
    for round_index in range(args.rounds):
        warmup = args.warmup if round_index == 0 else 0
        timing, tutorial_state = run_steps(
            tutorial.next_batch, tutorial_loop.train_step, tutorial_state, steps=args.steps,
            warmup=warmup, row_tokens=row_tokens)
        totals["tutorial"].add(timing)
        timing, lab.weights.state = run_steps(
            lab.next_batch, lambda s, b: lab.compile()(s, b, lab.weights.frozen),
            lab.weights.state, steps=args.steps, warmup=warmup, row_tokens=row_tokens)
        totals["gemmalab"].add(timing)

    import pandas as pd

    table = pd.DataFrame([t.row(name) for name, t in totals.items()]).set_index("loop")
    print(table.to_markdown(floatfmt=",.3f"))
    tutorial, lab_row = table.loc["tutorial"], table.loc["gemmalab"]
    useful = lab_row.useful_tokens_per_s / tutorial.useful_tokens_per_s
    raw = lab_row.tokens_per_s / tutorial.tokens_per_s
    cpu = tutorial.cpu_s_per_step / lab_row.cpu_s_per_step
    print(f"\ngemmalab / tutorial: useful tokens/s {useful:.2f}x, tokens/s per row position "
          f"{raw:.2f}x, row positions per CPU second {cpu:.2f}x")

if __name__ == "__main__":
    main()
