"""Full fine-tuning vs LoRA, side by side: step time and peak memory of real runs.

    .venv/bin/python bench/lora_vs_full.py --models gemma3-270m gemma3-1b --ranks 8 16

Each configuration is a whole ``Experiment`` (the embedded corpus, random base weights: the
cost of a step does not depend on their values) in its own process, so each peak host memory
is that run's alone. Prints a markdown table: trainable parameters, mean steady step time (the
first step, which compiles, excluded), its ratio to full fine-tuning, peak host memory and the
memory planner's per-device figure for the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def run_one(settings: dict) -> dict:
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig.flat(output_dir=output_dir, tokenize_workers=1, eval_every=0,
                             max_eval_stories=4, embedded_stories=400, checkpoint_every=0,
                             **settings)
        experiment = Experiment.prepare(config)
        summary = experiment.train(progress=False)
    return {key: summary[key] for key in (
        "num_params", "trainable_params", "mean_step_time_s", "first_step_seconds",
        "peak_host_memory_gb", "planned_bytes_per_device", "tokens_per_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=["gemma3-270m", "gemma3-1b"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--maxlen", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))))
        return

    print(f"batch {args.batch_size} x {args.maxlen}, {args.steps} steps, bfloat16 compute, "
          "float32 master weights")
    print("| model | training | trainable params | step (s) | vs full | peak host GiB | "
          "planned GiB |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        full_step = None
        for rank in (0, *args.ranks):
            settings = dict(model=model, lora_rank=rank, batch_size=args.batch_size,
                            maxlen=args.maxlen, max_steps=args.steps)
            child = subprocess.run([sys.executable, __file__, "--one", json.dumps(settings)],
                                   capture_output=True, text=True, check=False)
            line = next((x for x in child.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(f"| {model} | rank {rank} | failed: {child.stderr.strip()[-300:]} |")
                continue
            result = json.loads(line[len("RESULT "):])
            full_step = full_step or result["mean_step_time_s"]
            name = f"LoRA r{rank}" if rank else "full"
            print(f"| {model} | {name} | {result['trainable_params']:,} | "
                  f"{result['mean_step_time_s']:.2f} | "
                  f"{result['mean_step_time_s'] / full_step:.2f} | "
                  f"{result['peak_host_memory_gb']:.2f} | "
                  f"{result['planned_bytes_per_device'] / 2**30:.2f} |", flush=True)


if __name__ == "__main__":
    main()
