"""The loss's chunk on CPUs: 2^28 logits (what accelerators use) against 2^27 (the CPU default),
on the embedded Gemma 3 270M's LoRA training loop, each arm in its own process on the training
processes' allocator, rounds alternating.

    .venv/bin/python bench/loss_chunk.py --maxlen 128 --rounds 2 --steps 6

XLA's CPU runtime puts a step's temporaries in one block, allocated as the step starts and freed
as it ends. mimalloc's arenas keep freed blocks up to 2 GiB; the 270M's LoRA step at 8 x 128
with 2^28 logits a chunk needs 2.47 GiB, which mimalloc takes from the OS and hands back every
step, so each step faults all of it in again (docs/benchmarks/arena-bound.md). Reported per
process: the median and the mean step (the first, which compiles, left out), useful tokens/s
over the timed steps, peak RSS, the process's system CPU seconds (startup included), and the
last step's loss (the chunks sum in another order: equal to float32 rounding).
"""

from __future__ import annotations

import arms
from attention_blocks import arm_environment

ARMS = ("2^28", "2^27")


def run_one(arm: str, steps: int, batch: int, maxlen: int) -> dict:
    from gemmalab.model import cross_entropy

    cross_entropy.CPU_LOSS_CHUNK_LOGITS = 1 << int(arm.split("^")[1])  # before the step traces
    return {"arm": arm, **arms.lora_loop(steps, batch, maxlen)}


def main() -> None:
    args = arms.arguments(__doc__.splitlines()[0], ARMS, steps=6, maxlen=128)
    if arms.answered_one(args, run_one):
        return
    print(f"batch {args.batch_size} x {args.maxlen}\n"
          "| round | logits a chunk | median s / step | mean s / step | useful tokens/s | "
          "peak RSS GB | process system s | last loss |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for round_, arm, r in arms.alternate(__file__, ARMS, args.rounds, arms.child_args(args),
                                         env=arm_environment()):
        print(f"| {round_} | {arm} | {r['step_s']:.2f} | {r['mean_step_s']:.2f} | "
              f"{r['useful_tokens_per_s']:,.0f} | {r['peak_rss_gb']:.1f} | "
              f"{r['process_system_s']:.1f} | {r['last_loss']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
