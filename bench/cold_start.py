"""Cold start: seconds from starting ``notebooks/train.ipynb`` under papermill to the end of its
first training step, by phase, for a first run (empty cache) and the runs after it.

    .venv/bin/python bench/cold_start.py --runs 2

Each run: ``papermill notebooks/train.ipynb -p max_steps 1 -p eval_every 0`` with a fresh
output_dir and one shared ``cache_dir`` (empty before the first run: corpus generation,
tokenizer training, tokenization and every compile happen then; later runs read them back,
compiled steps included, from JAX's persistent compilation cache). The phases come from the run's
``summary.json`` ("startup"): kernel start to ``Experiment.prepare``, checks (this is where gemma,
and through it TensorFlow, is imported), data, model init, the train step's compile, the initial
evaluation; "to first step" is kernel start to the end of step 1 (the notebook samples once
before training: that is in it too).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PHASES = ("before_prepare_s", "checks_s", "data_s", "model_s", "compile_s", "initial_eval_s",
          "to_first_step_s")


def run_once(cache_dir: Path, output_dir: Path) -> dict[str, float]:
    output_dir.mkdir(parents=True)
    started = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "papermill"),
                    str(REPO / "notebooks/train.ipynb"), str(output_dir / "train.ipynb"),
                    "-p", "max_steps", "1", "-p", "eval_every", "0",
                    "-p", "cache_dir", str(cache_dir), "-p", "output_dir", str(output_dir),
                    "--log-level", "ERROR", "--no-progress-bar"],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    startup = json.loads((output_dir / "summary.json").read_text())["startup"]
    return {"papermill_s": wall, **{k: startup.get(k, float("nan")) for k in PHASES}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--cache-dir", default="", help="default: a new empty directory")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cold_start_"))
    cache_dir = Path(args.cache_dir) if args.cache_dir else work / "cache"
    rows = []
    for index in range(args.runs):
        row = run_once(cache_dir, work / f"run{index}")
        rows.append({"run": "first" if index == 0 else f"again ({index + 1})", **row})
        print(json.dumps(rows[-1]), flush=True)

    import pandas as pd

    print(pd.DataFrame(rows).set_index("run").to_markdown(floatfmt=".1f"))


if __name__ == "__main__":
    main()
