"""Sweeps: one training run per point of a grid (or a list of parameter sets), each with its own
name and ``output_dir``, queued on GKE (one Job/JobSet per point) or run here one after another.

    python -m gemmalab.k8s sweep --name lr-rank --queue gemmalab \\
        -y "learning_rate: [1e-4, 2e-4]" -y "lora_rank: [8, 16]" > sweep.yaml

A ``-y`` entry is YAML mapping parameter names to *lists of values*; the grid is the cartesian
product over all entries. ``--points FILE.yaml`` gives a list of parameter sets instead (each a
mapping); with both, every listed set is crossed with the grid. Fixed values go through ``-p``.
Every point is validated as a run of its own before anything is rendered or started.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gemmalab.errors import ConfigError, require
from gemmalab.k8s.config import (
    MAX_NAME,
    ClusterConfig,
    check_notebook_params,
    is_dns_1035_label,
)
from gemmalab.k8s.notebook import NOTEBOOK, REPO_ROOT, encode_parameter, load_yaml

MAX_POINTS_WITHOUT_YES = 16  # a bigger sweep needs --yes (yes=True): it is easy to type 4 x 4 x 4


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: its name (Job/JobSet name, output directory) and parameters."""

    name: str
    values: Mapping[str, Any]  # what this point sets (the swept parameters)
    params: Mapping[str, Any]  # the fixed parameters plus ``values``: what the notebook gets
    output_dir: str


# ---- the grid --------------------------------------------------------------------------------


def parse_grid(entries: Sequence[str | Mapping[str, Any]]) -> dict[str, list[Any]]:
    """``-y`` entries (YAML text or mappings) as one ``{name: [values]}``, in the given order."""
    grid: dict[str, list[Any]] = {}
    for entry in entries:
        mapping = load_yaml(entry) if isinstance(entry, str) else entry
        require(isinstance(mapping, Mapping) and bool(mapping), "sweep",
                f"{entry!r} is not a YAML mapping of parameters to lists",
                'write e.g. -y "learning_rate: [1e-4, 2e-4]"')
        for name, values in mapping.items():
            require(name not in grid, f"sweep.{name}", "is swept twice",
                    "give each parameter one -y entry")
            require(isinstance(values, list) and bool(values), f"sweep.{name}",
                    f"{values!r} is not a non-empty list of values",
                    f"write [{values!r}], or pass a fixed value with -p {name} VALUE")
            grid[str(name)] = list(values)
    return grid


def load_points(source: str | Path | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A list of parameter sets: a YAML file holding a list of mappings, or the list itself."""
    if isinstance(source, str | Path):
        path = Path(source)
        require(path.is_file(), "points", f"no file {str(path)!r}",
                "give a YAML file with a list of parameter sets, e.g. - {lora_rank: 8}")
        source = load_yaml(path.read_text(encoding="utf-8"))
    require(isinstance(source, list) and all(isinstance(p, Mapping) for p in source),
            "points", "is not a list of parameter mappings",
            "write a YAML list such as [{learning_rate: 1e-4, lora_rank: 8}, {lora_rank: 16}]")
    return [dict(p) for p in source]


def expand(grid: Mapping[str, Sequence[Any]],
           points: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Every point: each listed set crossed with the grid's cartesian product."""
    names = list(grid)
    combos = [dict(zip(names, values, strict=True))
              for values in itertools.product(*(grid[n] for n in names))]
    bases = [dict(p) for p in points] or [{}]
    expanded = []
    for base in bases:
        for combo in combos:
            clash = sorted(set(base) & set(combo))
            require(not clash, f"sweep.{clash[0]}" if clash else "sweep",
                    "is both in --points and in a -y grid", "give it in one of them")
            expanded.append({**base, **combo})
    return expanded


def sweep_values(grid: Mapping[str, Sequence[Any]] | Sequence[str] = (),
                 points: str | Path | Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The points of a grid (one mapping, or ``-y`` texts) and/or a list of parameter sets (or
    its YAML file): what the CLI and launch.ipynb pass to ``cluster_sweep``/``local_sweep``."""
    entries = [e for e in ([grid] if isinstance(grid, Mapping) else list(grid)) if e]
    if not entries and not points:
        return []  # no sweep (expand would give one empty point: a second run of the same job)
    return expand(parse_grid(entries), load_points(points) if points else ())


def check_size(count: int, yes: bool) -> None:
    require(count >= 1, "sweep", "has no points", "give -y NAME: [values] or --points FILE")
    require(count <= MAX_POINTS_WITHOUT_YES or yes, "sweep",
            f"{count} points are more than {MAX_POINTS_WITHOUT_YES}",
            "pass --yes (yes=True) to launch them all, or narrow the grid")


# ---- names -----------------------------------------------------------------------------------


def _abbreviations(names: Sequence[str]) -> dict[str, str]:
    """Short, distinct labels for parameter names: initials (lr), else the first two letters
    of each word (lera, lora), else the whole name."""
    for width in (1, 2, None):
        labels = {n: "".join(w[:width] for w in n.lower().split("_") if w) for n in names}
        if len(set(labels.values())) == len(labels):
            return labels
    return {n: n.lower().replace("_", "") for n in names}


def _value_slug(value: Any) -> str:
    """A value as DNS-label characters: 1e-4, 2p5e-5, 0p9, true, gemma3-1b; "" if it has none."""
    if isinstance(value, bool) or value is None:
        text = str(value).lower()
    elif isinstance(value, float):
        if value != 0 and not 1e-2 <= abs(value) < 1e5:
            mantissa, exponent = f"{abs(value):.6e}".split("e")
            text = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        else:
            text = f"{abs(value):g}"
        text = f"m{text}" if value < 0 else text
    elif isinstance(value, int) and value < 0:
        text = f"m{-value}"
    elif isinstance(value, int | str):
        text = str(value)
    else:  # lists and mappings: the index names the point
        return ""
    slug = "".join(c if c.isascii() and c.isalnum() else "p" if c == "." else "-"
                   for c in text.lower())
    return "-".join(part for part in slug.split("-") if part)


def point_names(base: str, values: Sequence[Mapping[str, Any]], limit: int = MAX_NAME
                ) -> list[str]:
    """``<base>-<index>``, plus the point's values (``-lera1e-4-lora8``) when they fit in
    ``limit`` characters for every point; the index alone keeps names unique and valid."""
    width = len(str(len(values) - 1))
    indexed = [f"{base}-{i:0{width}d}" for i in range(len(values))]
    require(len(indexed[-1]) <= limit, "job_name",
            f"{base!r} leaves no room for the point index ({len(indexed[-1])} > {limit})",
            f"shorten it by {len(indexed[-1]) - limit} characters")
    swept = [n for n in dict.fromkeys(k for v in values for k in v)]
    labels = _abbreviations(swept)
    named = []
    for name, point in zip(indexed, values, strict=True):
        parts = [f"{labels[k]}{_value_slug(point[k])}" for k in swept if k in point]
        named.append("-".join([name, *parts]).rstrip("-"))
    if all(len(n) <= limit for n in named) and all(_value_slug(p[k]) for p in values for k in p):
        return named
    return indexed


# ---- on the cluster --------------------------------------------------------------------------


def cluster_sweep(template: ClusterConfig | Mapping[str, Any],
                  values: Sequence[Mapping[str, Any]], *, yes: bool = False
                  ) -> list[ClusterConfig]:
    """One ClusterConfig per point: ``template``'s fields (a ClusterConfig or its fields:
    ``job_name`` is the base name, ``params`` the fixed parameters, ``queue`` shared by all)
    with the point's values on top.

    Every point is built (so validated: names, TrainConfig, batch vs devices) before the caller
    renders any; the first bad one raises a ConfigError naming the point.
    """
    check_size(len(values), yes)
    if isinstance(template, ClusterConfig):
        template = {f.name: getattr(template, f.name) for f in dataclasses.fields(template)}
    base = ClusterConfig(**template)  # the base name and the shared fields, checked once
    limit = MAX_NAME - (len(base.longest_pod_name) - len(base.job_name))
    names = point_names(base.job_name, values, limit)
    configs = []
    for name, point in zip(names, values, strict=True):
        fields = {**template, "job_name": name, "params": {**base.params, **point}}
        configs.append(_named(name, lambda f=fields: ClusterConfig(**f)))
    return configs


def _named(point: str, build: Callable[[], Any]) -> Any:
    try:
        return build()
    except ConfigError as e:
        raise ConfigError(f"{e.parameter} (sweep point {point})", e.problem, e.fix) from None


# ---- here, one after another -----------------------------------------------------------------


def local_sweep(name: str, params: Mapping[str, Any], values: Sequence[Mapping[str, Any]], *,
                output_root: str = "", yes: bool = False,
                notebook: str = NOTEBOOK) -> list[Point]:
    """The points of a sweep run on this machine: each writes to ``<output_root>/<point>``
    (default ``runs/<name>``). Every point is validated as a run before any starts."""
    check_size(len(values), yes)
    require(is_dns_1035_label(name), "job_name",
            f"{name!r} is not a DNS-1035 label",
            "use lowercase letters, digits and '-', starting with a letter")
    root = (output_root or f"runs/{name}").rstrip("/")
    points = []
    for point_name, point in zip(point_names(name, values), values, strict=True):
        merged = {**params, **point}
        _named(point_name, lambda m=merged: check_notebook_params(
            m, notebook, managed=("output_dir",), managed_by="the sweep",
            managed_fix=f"leave it out: each point writes to {root}/<point name>"))
        points.append(Point(point_name, dict(point), merged, f"{root}/{point_name}"))
    return points


def papermill_command(point: Point, notebook: str = NOTEBOOK) -> list[str]:
    """The headless papermill command of one point (the notebook written into its output_dir)."""
    argv = [sys.executable, "-m", "gemmalab.headless", str(REPO_ROOT / notebook),
            f"{point.output_dir}/train.ipynb", "-p", "output_dir", point.output_dir]
    for name in sorted(point.params):
        argv += encode_parameter(name, point.params[name])
    return [*argv, "--no-progress-bar"]


def write_index(points: Sequence[Point], path: str | Path) -> None:
    """``sweep.json``: each point's name, values and output_dir (what the summary table reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"points": [
        {"name": p.name, "values": dict(p.values), "output_dir": p.output_dir} for p in points]},
        indent=1) + "\n", encoding="utf-8")


def run_local(points: Sequence[Point], *, notebook: str = NOTEBOOK,
              runner: Callable[[list[str]], int] | None = None,
              log: Callable[[str], None] = print) -> dict[str, int]:
    """Run the points one after another (papermill, headless); a failed point does not stop the
    others. Returns each point's exit status; ``sweep.json`` is written next to the points."""
    if not points:
        return {}
    run = runner or (lambda argv: subprocess.run(argv, check=False).returncode)
    write_index(points, Path(points[0].output_dir).parent / "sweep.json")
    statuses = {}
    for i, point in enumerate(points, 1):
        Path(point.output_dir).mkdir(parents=True, exist_ok=True)
        log(f"[{i}/{len(points)}] {point.name}: {json.dumps(dict(point.values))}")
        statuses[point.name] = run(papermill_command(point, notebook))
        if statuses[point.name]:
            log(f"[{i}/{len(points)}] {point.name} failed (exit {statuses[point.name]}); "
                f"see {point.output_dir}/train.ipynb")
    return statuses
