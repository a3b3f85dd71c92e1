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
    flops = flops_line(summary)
    if flops:
        lines.append(f"{'model FLOP/s':>16}: {flops}")
    lines.append(f"{'time':>16}: {summary['steps']} steps in {summary['train_seconds']:.1f} s")
    return "\n".join(lines)


def flops_line(summary: dict) -> str:
    """The achieved model FLOP/s against the peak: the devices' listed one (MFU), or on CPUs
    the host's measured matmul rate (``cpu_mfu``); "" for a summary without FLOP accounting."""
    achieved = summary.get("model_flops_per_s")
    if not achieved:
        return ""
    if summary.get("mfu") is not None:
        return (f"{_si(achieved)} = {summary['mfu']:.1%} MFU "
                f"(the devices' peak {_si(summary['peak_flops_per_s'])})")
    if summary.get("cpu_mfu") is not None:
        dtype = summary.get("params", {}).get("compute_dtype", "compute dtype")
        return (f"{_si(achieved)} = {summary['cpu_mfu']:.0%} of this host's {dtype} matmul "
                f"peak ({_si(summary['host_matmul_flops_per_s'])})")
    return _si(achieved)


def _si(value: float) -> str:
    """FLOP/s with a decimal prefix: 72 G, 1.2 T."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}"
    return f"{value:.3g}"


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
