"""mimalloc against glibc's malloc (with huge pages) under XLA's CPU runtime: the embedded 270M's
training step in alternating processes.

    .venv/bin/python bench/allocator.py                      # LoRA r8 and full, 8 x 128
    .venv/bin/python bench/allocator.py --modes lora --maxlens 512 --steps 3

XLA's CPU runtime allocates a step's large buffers as the step starts and frees them as it ends.
glibc hands every block above 32 MiB back to the kernel when it is freed, so each step the kernel
maps them anew and zeroes each page as it is first touched (the system CPU time below).
mimalloc keeps freed memory for reuse (``gemmalab.allocator``). A preloaded allocator is set as a
process starts, so each setting runs in processes of its own, ``--pairs`` of them, turn about;
each process times ``--steps`` steps after a compiling one (bench/huge_pages.py's ``child``).

Reports per setting the median step (the median of each process's median), the page faults and
system CPU seconds a step, the peak RSS, and the last loss (the same in both: where buffers live
moves no number).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from gemmalab import allocator

HUGE_PAGES_BENCH = Path(__file__).with_name("huge_pages.py")  # its --child times the steps


def settings() -> dict[str, dict[str, str]]:
    """Each setting's environment: glibc's malloc with huge pages (what the tests run on), and
    ``gemmalab.allocator``'s (what training processes run on)."""
    plain = {k: v for k, v in os.environ.items()
             if k not in ("GLIBC_TUNABLES", "LD_PRELOAD", allocator.OPT_OUT)
             and not k.startswith("MIMALLOC_")}
    glibc = {**plain, "GLIBC_TUNABLES": allocator.HUGE_PAGES}
    if allocator.library_path() is None:
        raise SystemExit("mimalloc is not installed here (Linux, `make env`)")
    return {"glibc, huge pages": glibc, "mimalloc": {**glibc, **allocator.environment(glibc)}}


def run(environment: dict[str, str], lora_rank: int, maxlen: int, steps: int) -> dict:
    command = [sys.executable, str(HUGE_PAGES_BENCH), "--child", str(lora_rank), "--maxlens",
               str(maxlen), "--steps", str(steps)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--maxlens", type=int, nargs="+", default=[128])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    environments = settings()
    print(f"{args.pairs} pairs of processes, turn about; {args.steps} timed steps each")
    print("| training | rows | malloc | s / step | each process's | faults / step "
          "| system s / step | peak RSS GB | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for training in args.modes:
        for maxlen in args.maxlens:
            rank = 8 if training == "lora" else 0
            results: dict[str, list[dict]] = {name: [] for name in environments}
            for _ in range(args.pairs):
                for name, environment in environments.items():
                    results[name].append(run(environment, rank, maxlen, args.steps))
            medians = {}
            for name, runs in results.items():
                medians[name] = statistics.median(r["median_s"] for r in runs)
                faults = statistics.median(r["faults_per_step"] for r in runs)
                system = statistics.median(r["system_s_per_step"] for r in runs)
                rss = max(r["peak_rss_gb"] for r in runs)
                each = ", ".join(f"{r['median_s']:.2f}" for r in runs)
                print(f"| {training} | 8 x {maxlen} | {name} | {medians[name]:.3f} | {each} | "
                      f"{faults:,.0f} | {system:.3f} | {rss:.1f} | {runs[-1]['loss']:.6f} |",
                      flush=True)
            before, after = medians.values()
            print(f"|  |  | **{before / after:.2f}x** |" + "  |" * 6, flush=True)


if __name__ == "__main__":
    main()
