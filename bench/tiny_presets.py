"""The tiny presets side by side: gemma3-tiny, gemma4-tiny (per-layer embeddings, shared keys and
values) and gemma4-tiny-moe (8 experts, top 2), each trained from random init at the same
settings in its own process, the presets interleaved over the rounds (this machine is noisy:
compare within a round).

    .venv/bin/python bench/tiny_presets.py --rounds 2 --steps 30

Each run prints a JSON row: parameters, mean step time (the steady steps), tokens/s, useful
tokens/s, data-wait share, the final train loss, peak host memory and the first step's time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

PRESETS = ("gemma3-tiny", "gemma4-tiny", "gemma4-tiny-moe")


def run_one(preset: str, steps: int, cache_dir: str) -> dict:
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig.flat(model=preset, batch_size=16, maxlen=256, max_steps=steps,
                                  eval_every=0, checkpoint_every=0, max_eval_stories=16,
                                  output_dir=output_dir, cache_dir=cache_dir)
        summary = Experiment.prepare(config).train(progress=False)
    return {"preset": preset, "params": summary["num_params"],
            "step_s": round(summary["mean_step_time_s"], 4),
            "tokens_per_s": round(summary["tokens_per_s"]),
            "useful_tokens_per_s": round(summary["useful_tokens_per_s"]),
            "data_wait_share": round(summary["data_wait_share"], 4),
            "first_step_s": round(summary["first_step_seconds"], 2),
            "final_train_loss": round(summary["final_train_loss"], 3),
            "peak_host_gb": round(summary["peak_host_memory_gb"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one preset
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.steps, args.cache_dir)))
        return
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tiny-presets-")
    for round_ in range(args.rounds):
        for preset in PRESETS:
            out = subprocess.run([sys.executable, __file__, "--one", preset, "--steps",
                                  str(args.steps), "--cache-dir", cache_dir],
                                 capture_output=True, text=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"round": round_, **row}), flush=True)


if __name__ == "__main__":
    main()
