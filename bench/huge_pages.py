"""Huge pages for XLA's CPU buffers: the embedded 270M's training step with glibc's malloc asking
the kernel for transparent huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``) and without,
in alternating processes.

    .venv/bin/python bench/huge_pages.py            # LoRA r8 and full fine-tuning, 8 x 128

XLA's CPU runtime allocates a step's large buffers (logits, activations, gradients) afresh each
step. glibc serves every allocation above 32 MiB with its own ``mmap`` and unmaps it when
freed, so the kernel faults the next step's buffers in again, 4 KiB at a time (and zeroes each
page). With ``hugetlb=1`` glibc marks those mappings ``MADV_HUGEPAGE``: 2 MiB pages wherever
the kernel's transparent huge pages are enabled (``madvise`` or ``always`` in
``/sys/kernel/mm/transparent_hugepage/enabled``). The variable is read when a process starts,
so each setting runs in processes of its own (``--pairs`` of them, turn about).

Reports per setting the median step (the median of each process's median), the minor page
faults and system CPU seconds a step, the peak RSS, and the last loss (equal in both: the
setting moves no number).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gemmalab.allocator import HUGE_PAGES

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def child(lora_rank: int, maxlen: int, steps: int) -> None:
    """One process: time ``steps`` training steps after a compiling one; print a JSON line."""
    import jax

    sys.path.insert(0, os.path.dirname(__file__))
    from loss_recompute import bench_config  # bench/loss_recompute.py, beside this file

    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        config = bench_config(lora_rank=lora_rank, batch_size=8, maxlen=maxlen,
                              output_dir=output_dir)
        experiment = Experiment.prepare(config)
        weights = experiment.weights
        batch = experiment.next_batch()
        state, metrics = experiment.compile()(weights.state, batch, weights.frozen)
        jax.block_until_ready(metrics)
        before = resource.getrusage(resource.RUSAGE_SELF)
        stalls = _compaction_stalls()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            state, metrics = experiment.compile()(state, batch, weights.frozen)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_SELF)
        stalls = _compaction_stalls() - stalls
    print(json.dumps({
        "median_s": statistics.median(times), "loss": float(metrics["loss"]),
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "system_s_per_step": (after.ru_stime - before.ru_stime) / steps,
        "peak_rss_gb": after.ru_maxrss / 2**20, "compaction_stalls": stalls}))


def _compaction_stalls() -> int:
    """The kernel's count of allocations that waited for memory compaction (machine-wide)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        name, value = line.split()
        if name == "compact_stall":
            return int(value)
    return 0


def run(environment: dict[str, str], lora_rank: int, maxlen: int, steps: int) -> dict:
    """One child process under ``environment``: its JSON line."""
    command = [sys.executable, __file__, "--child", str(lora_rank), "--maxlens", str(maxlen),
               "--steps", str(steps)]
    result = subprocess.run(command, env=environment, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def compare(environments: dict[str, dict[str, str]], column: str, args: argparse.Namespace
            ) -> None:
    """Each of ``args.modes`` x ``args.maxlens`` in ``args.pairs`` rounds of one process per
    setting, turn about: a table row per setting and the first's median over the last's.
    Also bench/allocator.py's."""
    print(f"| training | rows | {column} | s / step | each process's | faults / step "
          "| system s / step | compaction stalls | peak RSS GB | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
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
                stalls = sum(r["compaction_stalls"] for r in runs)
                print(f"| {training} | 8 x {maxlen} | {name} | {medians[name]:.3f} | {each} | "
                      f"{faults:,.0f} | {system:.3f} | {stalls} | {rss:.1f} | "
                      f"{runs[-1]['loss']:.6f} |", flush=True)
            first, *_, last = medians.values()
            print(f"|  |  | **{first / last:.2f}x** |" + "  |" * 7, flush=True)


def arguments(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--maxlens", type=int, nargs="+", default=[128])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = arguments(__doc__.splitlines()[0])
    if args.child is not None:
        return child(args.child, args.maxlens[0], args.steps)
    mode = THP_MODE.read_text().strip() if THP_MODE.exists() else "unknown"
    print(f"transparent huge pages: {mode}; {args.pairs} pairs of processes, turn about")
    off = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    compare({"off": off, "on": {**off, "GLIBC_TUNABLES": HUGE_PAGES}}, "huge pages", args)


if __name__ == "__main__":
    main()
