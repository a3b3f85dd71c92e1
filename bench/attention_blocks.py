"""Attention in causal blocks of queries (``attention="blocked"``, the CPU default) against
gemma's own, on the CPU step: the embedded Gemma 3 270M's LoRA run, each arm in its own process
on the training processes' allocator, rounds alternating.

    .venv/bin/python bench/attention_blocks.py --maxlen 512 --rounds 2 --steps 4

gemma's attention computes every query's scores against every key of the row and masks what it
may not see; "blocked" computes the same arithmetic (dtypes, mask value, softmax) on blocks of
``attention.BLOCK_ROWS`` queries, each against the keys before its last row only (and within the
window on local layers). Both arms train the same packed batches of the embedded stories (LoRA
r8, bfloat16 compute). Reported: median step seconds (the first, which compiles, left out),
tokens/s, the median step's ``cpu_mfu``, peak RSS, and the last step's loss (the arms sum in
another order: equal to bf16 rounding, not bit for bit).
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
from pathlib import Path

import arms

ARMS = ("gemma", "blocked")


def run_one(arm: str, steps: int, batch: int, maxlen: int) -> dict:
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        experiment = Experiment.prepare(TrainConfig.flat(
            checkpoint="embedded:gemma3-270m", lora_rank=8, batch_size=batch, maxlen=maxlen,
            attention=arm, max_steps=steps + 1, eval_every=0, checkpoint_every=0,
            max_eval_stories=4, seed=0, output_dir=output_dir))
        experiment.train(progress=False)
    rows = sorted(experiment.history[1:], key=lambda row: row["step_time_s"])
    middle = rows[len(rows) // 2]
    step_s = statistics.median(row["step_time_s"] for row in rows)
    return {"arm": arm, "step_s": step_s, "tokens_per_s": batch * maxlen / step_s,
            "cpu_mfu": middle.get("cpu_mfu"),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "last_loss": experiment.history[-1]["loss"]}


def arm_environment() -> dict[str, str]:
    """What a training process gets (``gemmalab.allocator``), with this checkout importable."""
    from gemmalab import allocator

    plain = allocator.without_allocator(os.environ)
    return {**plain, **allocator.environment(plain),
            "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def main() -> None:
    args = arms.arguments(__doc__.splitlines()[0], ARMS, steps=4, maxlen=512)
    if arms.answered_one(args, run_one):
        return
    print(f"batch {args.batch_size} x {args.maxlen}\n"
          "| round | arm | s / step | tokens/s | cpu_mfu | peak RSS GB | last loss |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for round_, arm, r in arms.alternate(__file__, ARMS, args.rounds, arms.child_args(args),
                                         env=arm_environment()):
        mfu = "-" if r["cpu_mfu"] is None else f"{r['cpu_mfu']:.2f}"
        print(f"| {round_} | {arm} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | {mfu} | "
              f"{r['peak_rss_gb']:.1f} | {r['last_loss']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
