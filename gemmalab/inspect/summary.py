"""Print a run's headline figures: ``python -m gemmalab.inspect.summary runs/demo/summary.json``."""

from __future__ import annotations

import json
import sys

HEADLINE = (
    ("eval loss", "initial_eval_loss", "final_eval_loss", "{:.3f}"),
    ("eval perplexity", "initial_eval_perplexity", "final_eval_perplexity", "{:.2f}"),
    ("train loss", "initial_train_loss", "final_train_loss", "{:.3f}"),
)


def format_summary(summary: dict) -> str:
    lines = [f"{name:>16}: {fmt.format(summary[a])} -> {fmt.format(summary[b])}"
             for name, a, b, fmt in HEADLINE]
    lines.append(f"{'throughput':>16}: {summary['useful_tokens_per_s']:,.0f} useful tokens/s "
                 f"({summary['useful_token_share']:.1%} of "
                 f"{summary['tokens_per_s']:,.0f} tokens/s)")
    lines.append(f"{'time':>16}: {summary['steps']} steps in {summary['train_seconds']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gemmalab.inspect.summary RUN_DIR/summary.json", file=sys.stderr)
        return 2
    with open(args[0]) as f:
        print(format_summary(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
