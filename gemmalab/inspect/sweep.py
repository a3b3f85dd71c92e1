"""A sweep's runs side by side: one row per point, its swept parameters and headline figures from
its ``summary.json``. ``python -m gemmalab.inspect.sweep runs/my-sweep`` prints the table.

``runs`` is any of: a sweep's directory (its ``sweep.json``, written by ``gemmalab.k8s sweep
--local``), a glob of run directories (``runs/my-sweep/*``), a list of run directories (local,
a GCS FUSE mount or ``gs://``), or ``{name: directory}``.
"""

from __future__ import annotations

import glob
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gemmalab import storage
from gemmalab.errors import ConfigError

# summary.json key -> column
HEADLINE = {
    "steps": "steps",
    "final_train_loss": "train loss",
    "final_eval_loss": "eval loss",
    "final_eval_perplexity": "eval perplexity",
    "useful_tokens_per_s": "useful tokens/s",
    "train_seconds": "train s",
}
SWEEP_INDEX = "sweep.json"


def run_dirs(runs: str | Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    """``{name: output_dir}`` of every run ``runs`` names (see the module's docstring)."""
    if isinstance(runs, Mapping):
        return {str(k): str(v) for k, v in runs.items()}
    if isinstance(runs, str):
        index = f"{runs.rstrip('/')}/{SWEEP_INDEX}"
        if storage.exists(index):
            points = json.loads(storage.read_bytes(index))["points"]
            # The points are the index's siblings: found wherever the sweep was copied.
            return {p["name"]: f"{runs.rstrip('/')}/{p['name']}" for p in points}
        if glob.has_magic(runs):
            found = sorted(p for p in glob.glob(runs) if Path(p).is_dir())
            if not found:
                raise ConfigError("runs", f"{runs!r} matches no directory",
                                  "give a sweep's directory, a glob of run directories or a list")
            return {Path(p).name: p for p in found}
        runs = [runs]
    return {Path(str(r).rstrip("/")).name: str(r) for r in runs}


def read_summary(output_dir: str) -> dict[str, Any] | None:
    path = f"{output_dir.rstrip('/')}/summary.json"
    return json.loads(storage.read_bytes(path)) if storage.exists(path) else None


def swept_parameters(summaries: Sequence[Mapping[str, Any]]) -> list[str]:
    """The run parameters that differ between the summaries (output_dir aside), in field order."""
    params = [s.get("params", {}) for s in summaries]
    names = list(dict.fromkeys(k for p in params for k in p))
    return [n for n in names if n not in ("output_dir", "cache_dir")
            and len({json.dumps(p.get(n), sort_keys=True, default=str) for p in params}) > 1]


def summary_table(runs: str | Sequence[str] | Mapping[str, str]) -> Any:
    """pandas, one row per run (index: its name): the parameters that differ between the runs,
    the headline figures, and ``status`` ("done", or "no summary.json" while a run is still
    going or after it failed)."""
    import pandas as pd

    dirs = run_dirs(runs)
    summaries = {name: read_summary(d) for name, d in dirs.items()}
    done = [s for s in summaries.values() if s is not None]
    swept = swept_parameters(done)
    rows = []
    for name, summary in summaries.items():
        row: dict[str, Any] = {"run": name}
        params = (summary or {}).get("params", {})
        row.update({p: params.get(p) for p in swept})
        row.update({column: (summary or {}).get(key) for key, column in HEADLINE.items()})
        row["status"] = "done" if summary is not None else "no summary.json"
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m gemmalab.inspect.sweep SWEEP_DIR | 'RUNS/*' | RUN_DIR...",
              file=sys.stderr)
        return 2
    try:
        table = summary_table(args[0] if len(args) == 1 else args)
    except ConfigError as e:
        print(f"ConfigError: {e}", file=sys.stderr)
        return 2
    print(table.to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
