"""The demo's recipe, chosen by measurement: the embedded real base (Gemma 3 270M) fine-tuned on
the embedded stories at the demo's size, one recipe per process.

    .venv/bin/python bench/demo_recipe.py lora8-2e-4 lora8-1e-3 lora16-5e-4 full-5e-5

Each recipe trains 30 steps of 8 x 128 from the same base and data and prints a JSON row:
held-out perplexity before and after (32 stories), mean step time, peak host memory, wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

RECIPES = {
    "lora8-2e-4": {"lora_rank": 8, "learning_rate": 2e-4},  # PEFT's usual rate
    "lora8-1e-3": {"lora_rank": 8, "learning_rate": 1e-3},  # the preset's LoRA default
    "lora8-2e-3": {"lora_rank": 8, "learning_rate": 2e-3},
    "lora16-5e-4": {"lora_rank": 16, "learning_rate": 5e-4},
    "full-5e-5": {"lora_rank": 0, "learning_rate": 5e-5},
    "full-2e-5": {"lora_rank": 0, "learning_rate": 2e-5},  # the preset's default
}


def run_one(name: str, cache_dir: str) -> dict:
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    started = time.time()
    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig.flat(checkpoint="embedded:gemma3-270m", batch_size=8, maxlen=128,
                             max_steps=30, embedded_stories=2000, max_eval_stories=32,
                             eval_every=0, checkpoint_every=0, output_dir=output_dir,
                             cache_dir=cache_dir, **RECIPES[name])
        summary = Experiment.prepare(config).train(progress=False)
    return {"recipe": name, "initial_ppl": summary["initial_eval_perplexity"],
            "final_ppl": summary["final_eval_perplexity"],
            "step_s": summary["mean_step_time_s"], "peak_gb": summary["peak_host_memory_gb"],
            "wall_s": time.time() - started}


def main() -> int:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(run_one(sys.argv[2], sys.argv[3])))
        return 0
    names = sys.argv[1:] or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        print(f"unknown recipes {unknown}; choose from {list(RECIPES)}", file=sys.stderr)
        return 2
    from gemmalab.config import default_cache_dir

    for name in names:  # a process each: each peak memory is that recipe's alone
        out = subprocess.run([sys.executable, __file__, "--one", name, default_cache_dir()],
                             check=True, capture_output=True, text=True).stdout
        print(out.strip().splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
