"""LoRA's frozen base tied to each layer's input (``quantization.dequantizing(frozen=True)``)
against untied, on the CPU step: the embedded Gemma 3 270M's LoRA run, each arm in its own
process, rounds alternating.

    .venv/bin/python bench/frozen_tie.py --rounds 2 --steps 8

The tie is an optimization barrier between each frozen weight and the activation it multiplies:
on a TPU slice under fsdp it keeps XLA from gathering every layer's weights early (docs/gemma4.md,
the 31B; a weight the mesh splits is read through a data dependency too, never on one device).
On one CPU nothing is gathered; this measures what the barrier costs there. The arms differ in
that alone ("untied" enters ``dequantizing()`` without ``frozen``); both train the same packed
batches of the embedded stories (LoRA r8, batch 8 x 128, bfloat16 compute). Reported: median
step seconds (the first step, which compiles, left out), tokens/s, the first step's seconds,
peak RSS, and the losses of the last step (the barrier reorders, it does not change values).
"""

from __future__ import annotations

import resource
import statistics
import tempfile

import arms

ARMS = ("tied", "untied")


def run_one(arm: str, steps: int, batch: int, maxlen: int) -> dict:
    from gemmalab.model import quantization

    if arm == "untied":
        with_tie = quantization.dequantizing
        quantization.dequantizing = lambda frozen=False, mesh=None: with_tie()
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        experiment = Experiment.prepare(TrainConfig.flat(
            checkpoint="embedded:gemma3-270m", lora_rank=8, batch_size=batch, maxlen=maxlen,
            max_steps=steps + 1, eval_every=0, checkpoint_every=0, max_eval_stories=4,
            seed=0, output_dir=output_dir))
        experiment.train(progress=False)
    history = experiment.history
    times = [row["step_time_s"] for row in history[1:]]
    step_s = statistics.median(times)
    return {"arm": arm, "step_s": step_s, "tokens_per_s": batch * maxlen / step_s,
            "first_step_s": history[0]["step_time_s"],
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "last_loss": history[-1]["loss"]}


def main() -> None:
    args = arms.arguments(__doc__.splitlines()[0], ARMS, steps=8, maxlen=128)
    if arms.answered_one(args, run_one):
        return
    print("| round | arm | s / step | tokens/s | first step s | peak RSS GB | last loss |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for round_, arm, r in arms.alternate(__file__, ARMS, args.rounds, arms.child_args(args)):
        print(f"| {round_} | {arm} | {r['step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['first_step_s']:.1f} | {r['peak_rss_gb']:.1f} | {r['last_loss']:.6f} |",
              flush=True)


if __name__ == "__main__":
    main()
