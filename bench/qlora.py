"""QLoRA against LoRA on the real Gemma 3 270M (the embedded base), each format in its own process.

    .venv/bin/python bench/qlora.py --formats none int8 int4 nf4 --steps 30

Every run is ``make demo``'s recipe (LoRA rank 8 at lr 1e-3 on the embedded stories, 8 x 128,
bfloat16 compute) for ``--steps`` steps, with ``base_quantization`` the one thing that changes.
Per format: the held-out perplexity of the base alone before any training (the GGUF's Q4_K_M
weights dequantized, then quantized again: what the double quantization costs) and after the
steps, the frozen base's bytes, step time, useful tokens/s and the process's peak host memory.
Runs alternate in the given order; ``--rounds 2`` repeats the sequence (these machines are
noisy: compare within a round).

    .venv/bin/python bench/qlora.py --layouts --eval-stories 64

instead evaluates the base alone (no training, one process) under scale layouts other than
``gemmalab.model.quantization``'s: groups of 16/32/64 along the inputs or along the model
dimension, and asymmetric (min/max) int4: why the module groups 32 inputs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile


def run_one(fmt: str, steps: int, eval_stories: int) -> dict:
    import jax

    from gemmalab.config import TrainConfig
    from gemmalab.model import quantization, sharding
    from gemmalab.recipes import RECIPES
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig.flat(**{
            **RECIPES["demo"], "output_dir": output_dir, "max_steps": steps,
            "eval_every": steps, "max_eval_stories": eval_stories, "checkpoint_every": 0,
            "base_quantization": fmt})
        experiment = Experiment.prepare(config)
        frozen = experiment.weights.frozen
        leaves = jax.tree.leaves(frozen, is_leaf=quantization.is_quantized)
        base_bytes = sharding.shard_bytes(frozen)
        projection_bytes = sharding.shard_bytes([leaf for leaf in leaves
                                                 if quantization.is_quantized(leaf)])
        summary = experiment.train(progress=False)
    return {"format": fmt, "base_bytes": base_bytes, "quantized_bytes": projection_bytes,
            **{key: summary[key] for key in (
                "initial_eval_perplexity", "final_eval_perplexity", "initial_eval_loss",
                "final_eval_loss", "mean_step_time_s", "useful_tokens_per_s",
                "first_step_seconds", "peak_host_memory_gb")}}


LAYOUTS = {  # name: (qwix type, grouped along "input" or "model", group size, calibration)
    "int8, a scale per output channel": ("int8", "input", None, "absmax"),
    "int8, a scale per model-dimension row": ("int8", "model", None, "absmax"),
    "nf4, 64 along the model dimension": ("nf4", "model", 64, "absmax"),
    "nf4, 64 inputs": ("nf4", "input", 64, "absmax"),
    "nf4, 32 inputs (gemmalab)": ("nf4", "input", 32, "absmax"),
    "nf4, 16 inputs": ("nf4", "input", 16, "absmax"),
    "int4, 64 along the model dimension": ("int4", "model", 64, "absmax"),
    "int4, 32 inputs": ("int4", "input", 32, "absmax"),
    "int4 min/max, 32 inputs (gemmalab)": ("int4", "input", 32, "minmax"),
}


def layouts(eval_stories: int) -> None:
    """The base's held-out perplexity under each of ``LAYOUTS`` (dequantized, so any layout
    runs through the same model), against the unquantized base."""
    import jax
    import jax.numpy as jnp
    import qwix

    from gemmalab.config import FSDP_AXIS, TrainConfig
    from gemmalab.model import quantization, sharding
    from gemmalab.recipes import RECIPES
    from gemmalab.train.experiment import Experiment

    def requantized(params: dict, qtype: str, along: str, size: int | None, method: str):
        def one(path, leaf):
            rule = quantization.quantized_rule(path, leaf)
            if rule is None:
                return leaf
            axis = (quantization.INPUT_AXIS[rule] if along == "input"
                    else sharding.RULES[rule].index(FSDP_AXIS))
            packed = qwix.quantize(leaf.astype(jnp.float32), qtype,
                                   channelwise_axes=[a for a in range(leaf.ndim) if a != axis],
                                   tiled_axes={} if size is None else {axis: size},
                                   calibration_method=method)
            return qwix.dequantize(packed).astype(leaf.dtype)
        return jax.tree_util.tree_map_with_path(one, params)

    with tempfile.TemporaryDirectory() as output_dir:
        experiment = Experiment.prepare(TrainConfig.flat(**{
            **RECIPES["demo"], "output_dir": output_dir, "max_eval_stories": eval_stories}))
        base = experiment.weights.frozen
        reference = experiment.evaluate()["eval_perplexity"]
        print(f"held-out perplexity of the embedded 270M base on {eval_stories} stories, "
              "no training")
        print(f"| layout | perplexity | vs the base |\n|---|---|---|\n| none (bf16) | "
              f"{reference:.3f} | |")
        for name, layout in LAYOUTS.items():
            experiment.weights.frozen = requantized(base, *layout)
            perplexity = experiment.evaluate()["eval_perplexity"]
            print(f"| {name} | {perplexity:.3f} | {perplexity / reference - 1:+.1%} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "int4", "nf4"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-stories", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layouts", action="store_true",
                        help="the base's perplexity under other scale layouts, no training")
    args = parser.parse_args()
    if args.layouts:
        layouts(args.eval_stories)
        return
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.steps, args.eval_stories)))
        return
    rows = []
    for round_ in range(args.rounds):
        for fmt in args.formats:
            child = subprocess.run([sys.executable, __file__, "--one", fmt, "--steps",
                                    str(args.steps), "--eval-stories", str(args.eval_stories)],
                                   capture_output=True, text=True, check=False)
            lines = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
            if not lines:
                sys.exit(f"{fmt} failed:\n{child.stderr[-3000:]}")
            rows.append({"round": round_ + 1, **json.loads(lines[-1][len("RESULT "):])})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = {row["round"]: row for row in rows if row["format"] == "none"}
    print(f"demo recipe, {args.steps} steps of 8 x 128, LoRA r8; held-out perplexity on "
          f"{args.eval_stories} stories")
    print("| round | base | base MB | before training | after | vs LoRA | step s | useful tok/s "
          "| peak host GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        reference = base.get(row["round"])
        versus = (f"{row['final_eval_perplexity'] / reference['final_eval_perplexity'] - 1:+.2%}"
                  if reference else "")
        print(f"| {row['round']} | {row['format']} | {row['base_bytes'] / 1e6:,.0f} | "
              f"{row['initial_eval_perplexity']:.3f} | {row['final_eval_perplexity']:.3f} | "
              f"{versus} | {row['mean_step_time_s']:.2f} | {row['useful_tokens_per_s']:.0f} | "
              f"{row['peak_host_memory_gb']:.2f} |")


if __name__ == "__main__":
    main()
