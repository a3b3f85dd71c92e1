"""``python -m gemmalab.plan``: a run's plan as JSON on stdout (its summary and roofline lines on
stderr), or with ``--table`` the markdown table of what fits on 1-32 chips.

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
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--accelerator", default="v6e")
    parser.add_argument("--mesh", default=None, help='JSON, e.g. \'{"fsdp": -1}\'')
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--maxlen", type=int, default=256)
    parser.add_argument("--remat", default="none")
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full fine-tuning")
    parser.add_argument("--lora-modules", default="all")
    parser.add_argument("--base-quantization", default="none", choices=BASE_QUANTIZATIONS,
                        help="QLoRA (with --lora-rank): the frozen base stored quantized")
    parser.add_argument("--objective", default="sft", choices=OBJECTIVES,
                        help="dpo: also the reference model's forward pass (and weights)")
    parser.add_argument("--datacount", type=int, default=None,
                        help="examples in the run, for its length (None: unknown)")
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="the run's steps instead")
    parser.add_argument("--price-per-chip-hour", type=float, default=None,
                        help="what one chip costs an hour: the roofline run's cost")
    parser.add_argument("--exact", action="store_true", help="compile with libtpu (TPU only)")
    parser.add_argument("--table", action="store_true",
                        help="markdown: what fits on 1-32 chips of --accelerator's kind")
    args = parser.parse_args(argv)
    if args.table:
        rows = fit_table(parse_accelerator(args.accelerator).kind, lora_rank=args.lora_rank)
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(str(v) for v in row.values()) + " |")
        return
    config = TrainConfig.flat(model=args.model, mesh=json.loads(args.mesh) if args.mesh else None,
                         batch_size=args.batch_size, maxlen=args.maxlen, remat=args.remat,
                         grad_accum_steps=args.grad_accum_steps, lora_rank=args.lora_rank,
                         lora_modules=args.lora_modules, objective=args.objective,
                         base_quantization=args.base_quantization,
                         datacount=args.datacount,
                         num_epochs=args.num_epochs, max_steps=args.max_steps,
                         tokenizer=("local" if args.model in TINY_PRESETS
                                    else args.model.split("-")[0]))
    make_plan = estimate
    if args.exact:  # the command line's one use of the train stage, which compiles the step
        from gemmalab.train.aot import compile_plan as make_plan
    plan = make_plan(config, args.accelerator, price_per_chip_hour=args.price_per_chip_hour)
    print(json.dumps(plan.to_dict(), indent=2))
    print(plan.summary_line(), plan.roofline_line(), sep="\n", file=sys.stderr)


if __name__ == "__main__":
    main()
