"""The training notebook seen from outside: its papermill parameters and how to pass them."""

from __future__ import annotations

import ast
import functools
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from gemmalab.errors import ConfigError

NOTEBOOK = "notebooks/train.ipynb"  # relative to the repository root and to the image's WORKDIR
REPO_ROOT = Path(__file__).resolve().parents[2]

# Values papermill's `-p name value` turns into something other than the string itself.
_SPECIAL_WORDS = ("True", "False", "None")


class _Yaml12Floats(yaml.SafeLoader):
    """PyYAML follows YAML 1.1, where ``1e-4`` (no dot) is a string; here it is the float that
    papermill's ``-p`` and YAML 1.2 make of it."""


_Yaml12Floats.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$"
               r"|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """A parameter value or a ``-y`` mapping as YAML (``128`` a number, ``'128'`` a string,
    ``1e-4`` a float)."""
    return yaml.load(text, Loader=_Yaml12Floats)  # noqa: S506 (a SafeLoader subclass)


@functools.cache
def notebook_parameters(path: str | Path = REPO_ROOT / NOTEBOOK) -> dict[str, Any] | None:
    """Names and default values of the cell tagged ``parameters``; None if the file is absent.

    Inside the container image the package is installed away from the notebooks, so callers
    treat None as "cannot check" rather than as an error.
    """
    path = Path(path)
    if not path.is_file():
        return None
    notebook = json.loads(path.read_text(encoding="utf-8"))
    for cell in notebook["cells"]:
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            source = "".join(cell["source"])
            defaults: dict[str, Any] = {}
            for node in ast.parse(source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                        node.targets[0], ast.Name):
                    defaults[node.targets[0].id] = ast.literal_eval(node.value)
            return defaults
    raise ConfigError("notebook", f"{path} has no cell tagged 'parameters'",
                      "tag the notebook's parameter cell 'parameters' (papermill needs it)")


def _papermill_reads_as_other(text: str) -> bool:
    """True if papermill's ``-p`` would turn this string into a bool, None, int or float."""
    if text in _SPECIAL_WORDS:
        return True
    for parse in (int, float):
        try:
            parse(text)
        except ValueError:
            continue
        return True
    return False


def encode_parameter(name: str, value: Any) -> list[str]:
    """papermill arguments that make the notebook see exactly ``value`` for ``name``.

    ``-p`` resolves ``True``/``False``/``None``/numbers and leaves other text as a string, so it
    is used for those. A string that ``-p`` would misread (``"123"``, ``"None"``) goes through
    ``-r`` (raw string); lists and dicts go through ``-y`` as one YAML mapping.
    """
    if value is None or isinstance(value, bool):
        return ["-p", name, str(value)]
    if isinstance(value, int):
        return ["-p", name, str(value)]
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"params.{name}", f"{value} is not a finite number",
                              "pass a finite value")
        return ["-p", name, repr(value)]
    if isinstance(value, str):
        return ["-r" if _papermill_reads_as_other(value) else "-p", name, value]
    if isinstance(value, list | tuple | dict):
        text = yaml.safe_dump({name: _plain(value)}, default_flow_style=True, sort_keys=True,
                              width=10**6).strip()
        return ["-y", text]
    raise ConfigError(f"params.{name}", f"{type(value).__name__} values cannot be passed to a "
                      "notebook", "use a string, number, bool, None, list or dict")


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{type(value).__name__} is not YAML-serialisable")


def papermill_argv(*, notebook: str, output_notebook: str, output_dir: str, cache_dir: str,
                   compile_cache_dir: str, params: Mapping[str, Any]) -> list[str]:
    """Arguments after ``papermill``: input, output, the managed paths, then the user's params."""
    argv = [notebook, output_notebook, "-p", "output_dir", output_dir, "-p", "cache_dir",
            cache_dir, "-p", "compile_cache_dir", compile_cache_dir]
    for name in sorted(params):
        argv += encode_parameter(name, params[name])
    return argv + ["--log-output", "--no-progress-bar", "--request-save-on-cell-execute"]
