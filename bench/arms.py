"""Benches that compare arms of one script, each arm in its own process, rounds alternating
(the order turns each round: these machines drift). A script runs itself with ``--one ARM``
and prints one ``RESULT {json}`` line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence


def alternate(script: str, arms: Sequence[str], rounds: int, args: Sequence[str],
              env: Mapping[str, str] | Callable[[str], Mapping[str, str]] | None = None
              ) -> Iterator[tuple[int, str, dict]]:
    """``(round, arm, result)`` of ``script --one ARM *args`` for each round (from 1) and arm;
    ``env``: every arm's environment, or a function of the arm (what a process must have as it
    starts, e.g. its malloc's options)."""
    for round_ in range(1, rounds + 1):
        for arm in arms if round_ % 2 else arms[::-1]:
            done = subprocess.run([sys.executable, script, "--one", arm, *args],
                                  capture_output=True, text=True, check=False,
                                  env=env(arm) if callable(env) else env)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{arm} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            yield round_, arm, json.loads(line[len("RESULT "):])


def arguments(description: str, arm_names: Sequence[str], *, steps: int, maxlen: int
              ) -> argparse.Namespace:
    """The benches' shared options: rounds, steps, batch and maxlen (``--one``: a child's arm)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--one", choices=arm_names, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--maxlen", type=int, default=maxlen)
    return parser.parse_args()


def answered_one(args: argparse.Namespace, run_one: Callable[[str, int, int, int], dict]
                 ) -> bool:
    """In a ``--one ARM`` child: run that arm and print its ``RESULT`` line (True); else False."""
    if not args.one:
        return False
    result = run_one(args.one, args.steps, args.batch_size, args.maxlen)
    print("RESULT " + json.dumps(result), flush=True)
    return True


def child_args(args: argparse.Namespace) -> list[str]:
    """What each arm's process is given: ``arguments``' steps, batch and maxlen."""
    return ["--steps", str(args.steps), "--batch-size", str(args.batch_size),
            "--maxlen", str(args.maxlen)]


def lora_loop(steps: int, batch: int, maxlen: int) -> dict:
    """The embedded Gemma 3 270M's LoRA r8 training loop (``Experiment.train``, its evaluations
    included) for ``steps`` timed steps after one that compiles, in this process: the median and
    mean step, each step's seconds, useful tokens/s over the timed steps, the process's peak RSS
    and system seconds (startup included), and the last step's loss."""
    import resource
    import statistics
    import tempfile

    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        experiment = Experiment.prepare(TrainConfig.flat(
            checkpoint="embedded:gemma3-270m", lora_rank=8, batch_size=batch, maxlen=maxlen,
            max_steps=steps + 1, eval_every=0, checkpoint_every=0, max_eval_stories=8, seed=0,
            output_dir=output_dir))
        experiment.train(progress=False)
    timed = experiment.history[1:]
    times = [row["step_time_s"] for row in timed]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"step_s": statistics.median(times), "mean_step_s": statistics.mean(times),
            "step_seconds": times,
            "useful_tokens_per_s": sum(row["useful_tokens"] for row in timed) / sum(times),
            "peak_rss_gb": usage.ru_maxrss / 2**20, "last_loss": experiment.history[-1]["loss"],
            "process_system_s": usage.ru_stime}
