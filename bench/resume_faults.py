"""Kill a training run again and again; it must end exactly where an uninterrupted run ends.

    .venv/bin/python bench/resume_faults.py --cycles 8 --seed 0

Runs the tiny preset three ways, each start a fresh process (as a restarted pod would be):
1. uninterrupted, saving only at the end; 2. uninterrupted, saving every ``--every`` steps (the
checkpoint overhead, side by side with 1); 3. the faulty run: ``--cycles`` starts each killed at a
random step with SIGKILL or SIGTERM (some while a checkpoint is being written), then a start left
to finish. Reports kills survived, steps recomputed per kill (at most ``--every``), batches
repeated or skipped (by the per-step CRC32 of the tokens; must be 0) and the largest difference of
the final params to run 2's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PREEMPTED = 143


def worker(config_json: str) -> int:
    """One start of the run: train (resuming if there are checkpoints), save the params."""
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment
    from gemmalab.train.preemption import Preempted

    experiment = Experiment.prepare(TrainConfig.flat(**json.loads(config_json)))
    try:
        experiment.train(progress=False)
    except Preempted as stop:
        print(stop, flush=True)
        return PREEMPTED
    experiment.save()
    return 0


def start(config: dict) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rows(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def saving(output_dir: Path) -> bool:
    """A checkpoint is being written (Orbax's temporary directory exists)."""
    directory = output_dir / "checkpoints"
    return directory.exists() and any("tmp" in p.name for p in directory.iterdir())


def run_to_end(config: dict) -> tuple[float, str]:
    began = time.perf_counter()
    process = start(config)
    log = process.communicate()[0]
    if process.returncode != 0:
        raise SystemExit(f"run failed:\n{log[-3000:]}")
    return time.perf_counter() - began, log


def summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def _resumed_from(log: str) -> int:
    found = re.search(r"resumed from step (\d+)", log)
    return int(found.group(1)) if found else 0


def params_difference(a: Path, b: Path) -> float:
    import jax
    import numpy as np

    from gemmalab.weights import orbax_params

    left, right = orbax_params.load_params(str(a)), orbax_params.load_params(str(b))
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(left), jax.tree.leaves(right), strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=5, help="checkpoint_every")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()
    if args.worker:
        sys.exit(worker(args.worker))

    rng = random.Random(args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="resume-faults-"))
    shutil.rmtree(workdir, ignore_errors=True)
    base = dict(embedded_stories=2000, tokenizer_vocab_size=600, batch_size=16, maxlen=128,
                max_steps=args.steps, eval_every=0, log_every=1, seed=3,
                compute_dtype="float32", cache_dir=str(workdir / "cache"), tokenize_workers=1)
    run_to_end({**base, "output_dir": str(workdir / "warmup"), "max_steps": 2})  # caches

    timings = {}
    for name, every in (("end-only", 0), ("reference", args.every)):
        config = {**base, "output_dir": str(workdir / name), "checkpoint_every": every}
        timings[name] = (run_to_end(config)[0], summary(workdir / name))

    faulty = workdir / "faulty"
    config = {**base, "output_dir": str(faulty), "checkpoint_every": args.every}
    kills, restored, during_save = [], [], 0
    for cycle in range(args.cycles):
        process = start(config)
        done_before = len(rows(faulty))
        # A few steps past the restart (some before, some after the next save), never so close
        # to the end that the run could finish first.
        target = min(done_before + rng.randint(2, 3 * args.every), args.steps - 8)
        kind = rng.choice([signal.SIGKILL, signal.SIGTERM])
        mid_save = cycle % 3 == 2  # every third kill aims at a save in progress
        while process.poll() is None:
            reached = len(rows(faulty))
            if reached >= target and (not mid_save or saving(faulty) or reached >= target + 3):
                break
            time.sleep(0.01)
        if process.poll() is not None:
            raise SystemExit("the run ended before it could be killed; use more --steps")
        during_save += saving(faulty)
        reached = len(rows(faulty))
        process.send_signal(kind)
        log = process.communicate()[0]
        if kind == signal.SIGTERM and process.returncode != PREEMPTED:
            raise SystemExit(f"SIGTERM did not end in a save and exit {PREEMPTED}:\n{log[-2000:]}")
        restored.append(_resumed_from(log))
        kills.append((kind.name, reached))
        print(f"start {cycle + 1}: resumed from {restored[-1]}, {kind.name} after step {reached}",
              flush=True)
    restored.append(_resumed_from(run_to_end(config)[1]))
    # A kill after step r, restored at step s by the next start: r - s steps ran twice.
    # (A SIGTERM stops a step or two after the one observed, and saves there: 0 recomputed.)
    recomputed = [max(0, reached - restored[i + 1]) for i, (_, reached) in enumerate(kills)]
    history = rows(faulty)
    reference_rows = rows(workdir / "reference")
    digests = [r["batch_crc32"] for r in history]
    expected = [r["batch_crc32"] for r in reference_rows]
    repeated = abs(len(digests) - len(expected)) + sum(
        a != b for a, b in zip(digests, expected, strict=False))
    losses_equal = [r["loss"] for r in history] == [r["loss"] for r in reference_rows]
    difference = params_difference(faulty / "params", workdir / "reference" / "params")

    end_only, with_saves = timings["end-only"][1], timings["reference"][1]
    print(json.dumps({
        "command": " ".join(sys.argv),
        "kills": len(kills), "sigkill": sum(k == "SIGKILL" for k, _ in kills),
        "sigterm": sum(k == "SIGTERM" for k, _ in kills), "killed_during_a_save": during_save,
        "steps_recomputed_per_kill": recomputed, "max_recomputed": max(recomputed, default=0),
        "checkpoint_every": args.every,
        "batches_repeated_or_skipped": repeated, "losses_identical": losses_equal,
        "final_params_max_abs_difference": difference,
        "mean_step_s_saving_only_at_end": end_only["mean_step_time_s"],
        "mean_step_s_saving_every": with_saves["mean_step_time_s"],
        "step_time_ratio": with_saves["mean_step_time_s"] / end_only["mean_step_time_s"],
        "checkpoint_blocking_s": with_saves["checkpoint_blocking_s"],
        "checkpoints_saved": with_saves["checkpoints_saved"],
    }, indent=1))


if __name__ == "__main__":
    main()
