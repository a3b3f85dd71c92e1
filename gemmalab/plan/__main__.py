"""``python -m gemmalab.plan``: a run's plan as JSON on stdout (its summary and roofline lines on
stderr), or with ``--table`` the markdown table of what fits on 1-32 chips.

    python -m gemmalab.plan   # the training notebook's default run (the demo recipe) on a v6e chip
    python -m gemmalab.plan --model gemma3-1b --accelerator h200:8 --mesh '{"fsdp": -1}'
    python -m gemmalab.plan --table --accelerator v6e
"""

from __future__ import annotations

import json
import sys

from gemmalab.accelerators import parse_accelerator
from gemmalab.config import BASE_QUANTIZATIONS, OBJECTIVES, TINY_PRESETS, TrainConfig
from gemmalab.plan.fit import fit_table
from gemmalab.plan.memory import estimate


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gemmalab.plan",
                                     description="Per-device memory of a gemmalab training run, "
                                     "and its roofline time (an upper bound on speed).")
    # A run's fields, unset unless given: the plan is of the run train.ipynb would make of the
    # same parameters (no --recipe, --model or --checkpoint: the demo recipe, LoRA on the 270M).
    unset = argparse.SUPPRESS
    parser.add_argument("--recipe", default="", help="a gemmalab.recipes name ('': the default)")
    parser.add_argument("--model", default=unset, help="a preset (default: the recipe's)")
    parser.add_argument("--checkpoint", default=unset)
    parser.add_argument("--accelerator", default="v6e")
    parser.add_argument("--mesh", default=unset, type=json.loads,
                        help='JSON, e.g. \'{"fsdp": -1}\'')
    parser.add_argument("--batch-size", type=int, default=unset)
    parser.add_argument("--maxlen", type=int, default=unset)
    parser.add_argument("--remat", default=unset)
    parser.add_argument("--grad-accum-steps", type=int, default=unset)
    parser.add_argument("--lora-rank", type=int, default=unset, help="0: full fine-tuning")
    parser.add_argument("--lora-modules", default=unset)
    parser.add_argument("--base-quantization", default=unset, choices=BASE_QUANTIZATIONS,
                        help="QLoRA (with --lora-rank): the frozen base stored quantized")
    parser.add_argument("--objective", default=unset, choices=OBJECTIVES,
                        help="dpo: also the reference model's forward pass (and weights)")
    parser.add_argument("--datacount", type=int, default=unset,
                        help="examples in the run, for its length (None: unknown)")
    parser.add_argument("--num-epochs", type=int, default=unset)
    parser.add_argument("--max-steps", type=int, default=unset, help="the run's steps instead")
    parser.add_argument("--price-per-chip-hour", type=float, default=None,
                        help="what one chip costs an hour: the roofline run's cost")
    parser.add_argument("--exact", action="store_true", help="compile with libtpu (TPU only)")
    parser.add_argument("--table", action="store_true",
                        help="markdown: what fits on 1-32 chips of --accelerator's kind")
    args = vars(parser.parse_args(argv))
    accelerator, price = args.pop("accelerator"), args.pop("price_per_chip_hour")
    exact, table = args.pop("exact"), args.pop("table")
    if table:
        rows = fit_table(parse_accelerator(accelerator).kind, lora_rank=args.get("lora_rank", 0))
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(str(v) for v in row.values()) + " |")
        return
    model = args.get("model")
    if model and not args.get("checkpoint") and model not in TINY_PRESETS:
        # A named model's random init would read a corpus tokenizer's vocabulary: plan its own.
        args.setdefault("tokenizer", model.split("-")[0])
    config = TrainConfig.from_parameters(args)
    make_plan = estimate
    if exact:  # the command line's one use of the train stage, which compiles the step
        from gemmalab.train.aot import compile_plan as make_plan
    plan = make_plan(config, accelerator, price_per_chip_hour=price)
    print(json.dumps(plan.to_dict(), indent=2))
    print(plan.summary_line(), plan.roofline_line(), sep="\n", file=sys.stderr)


if __name__ == "__main__":
    main()
