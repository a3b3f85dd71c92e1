"""The training loop's peak RSS on mimalloc: 1 GiB arenas or one of 16 GiB, each step dispatched
while the last one runs or only once it has ended, on the embedded Gemma 3 270M's LoRA loop,
each arm in its own process on the training processes' allocator, rounds alternating.

    .venv/bin/python bench/loop_memory.py --maxlen 128 --rounds 2 --steps 10

XLA's CPU runtime allocates a step's temporaries as one block (1.72 GiB for the LoRA step at
8 x 128) and frees it as the step ends; mimalloc (``gemmalab.allocator``, kept memory) places
the next step's block where a freed one fits. Each block that lands elsewhere is fresh memory:
its first step faults it in (~2.3 s of system time a GiB on this VM) and the process keeps it.
The arms: mimalloc's own arenas (``arenas-1GiB``) or one (``arena-16GiB``), the loop a step
ahead (as on accelerators) or waiting for each step; ``arenas-1GiB-ahead`` was gemmalab before
docs/benchmarks/arena-reserve.md, ``arena-16GiB-waited`` is gemmalab on CPUs now. Reported per
process: the median and the mean step (the first, which pays for first touching the step's
block, left out), useful tokens/s over the timed steps, how many timed steps ran 1.3x the median
or more, peak RSS, and the last step's loss.
"""

from __future__ import annotations

import arms
from attention_blocks import arm_environment

ARMS = ("arenas-1GiB-ahead", "arenas-1GiB-waited", "arena-16GiB-ahead", "arena-16GiB-waited")


def environment(arm: str) -> dict[str, str]:
    """The training processes' allocator environment; the ``arenas-1GiB`` arms with mimalloc's
    own arena size in place of the one gemmalab sets."""
    env = arm_environment()
    if arm.startswith("arenas-1GiB"):
        env["MIMALLOC_ARENA_RESERVE"] = "1GiB"
    return env


def run_one(arm: str, steps: int, batch: int, maxlen: int) -> dict:
    from gemmalab.train import metrics

    if arm.endswith("-ahead"):  # the loop as accelerators run it: a step dispatched ahead
        class StepLogAhead(metrics.StepLog):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **{**kwargs, "wait_for_each_step": False})

        metrics.StepLog = StepLogAhead
    result = arms.lora_loop(steps, batch, maxlen)
    slow = sum(t >= 1.3 * result["step_s"] for t in result["step_seconds"])
    return {"arm": arm, **result, "slow_steps": slow}


def main() -> None:
    args = arms.arguments(__doc__.splitlines()[0], ARMS, steps=10, maxlen=128)
    if arms.answered_one(args, run_one):
        return
    print(f"batch {args.batch_size} x {args.maxlen}\n"
          "| round | arm | median s / step | mean s / step | steps >= 1.3x median | "
          "useful tokens/s | peak RSS GB | last loss |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for round_, arm, r in arms.alternate(__file__, ARMS, args.rounds, arms.child_args(args),
                                         env=environment):
        print(f"| {round_} | {arm} | {r['step_s']:.2f} | {r['mean_step_s']:.2f} | "
              f"{r['slow_steps']} | {r['useful_tokens_per_s']:,.0f} | {r['peak_rss_gb']:.2f} | "
              f"{r['last_loss']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
