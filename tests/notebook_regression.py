"""Notebook regression tests: nbval runs the copies in ``tests/notebooks/``; this compares.

nbval compares outputs for exact equality, which only holds on the CPU that wrote the copies:
another vector width, FMA or not, or another reduction order moves the last digits of every
loss. Here an output must match its stored copy as follows:

- text (streams, ``text/plain``, ``text/html``, error names and messages), after the sanitizers
  of ``sanitize.cfg``, is split into numbers with a decimal point or exponent and everything
  else. Everything else (words, integers, table layout, column names) must be identical;
- each such number may move by ``rtol`` relative, plus one unit of its last printed digit (the
  copy and the new run may round a value on either side of a boundary);
- an output carrying model continuations (``gemmalab/samples`` in its metadata, from
  ``gemmalab.inspect.reports.SamplesView``) is compared through them: labels and prompts exactly,
  texts on the part both runs decided with a clear margin (see ``gemmalab.model.sampling``); the
  rendering
  itself is covered by unit tests.

The tolerance is ``--nbval-rtol`` (default ``DEFAULT_RTOL``), or ``nbval-rtol=X`` as a cell tag.
``tests/conftest.py`` imports the hooks below; elsewhere load them with
``-p tests.notebook_regression`` and pass ``--nbval-tolerant`` to collect notebooks outside
``tests/notebooks/``.
"""

from __future__ import annotations

import dataclasses
import difflib
import html
import math
import re
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from nbval.plugin import IPyNbCell, IPyNbFile

from gemmalab.inspect.reports import SAMPLES_METADATA_KEY

# The notebook copies run in float32: CPU-to-CPU spread of their losses measured ~1e-8 relative
# (SSE4.2 vs AVX, 1 vs 2 threads). 1e-4 leaves ~4 orders of magnitude; a real regression (the
# loss mask dropped, the learning rate doubled) moves losses by 1e-3 .. 1e-1.
DEFAULT_RTOL = 1e-4

NUMBER = re.compile(r"((?<![\w.])[-+]?(?:\d+\.\d*|\.\d+)(?:[eE][-+]?\d+)?(?!\w)"
                    r"|(?<![\w.])[-+]?\d+[eE][-+]?\d+(?!\w))")
NOTEBOOK_COPIES = Path(__file__).resolve().parent / "notebooks"
RTOL_TAG = re.compile(r"^nbval-rtol=(.+)$")
MAX_REPORTED = 8


@dataclasses.dataclass(frozen=True)
class Moved:
    """A number that moved by more than the tolerance."""

    context: str
    stored: str
    now: str
    relative: float
    allowed: float

    def __str__(self) -> str:
        return (f"{self.context!r}: {self.stored} -> {self.now} (moved {self.relative:.1e} "
                f"relative; allowed {self.allowed:.1e})")


def last_digit_unit(number: str) -> float:
    """One unit in the last printed place: 0.001 for '5.867', 1e-06 for '6.9e-05'."""
    mantissa, _, exponent = number.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def compare_numbers(stored: str, now: str, rtol: float) -> tuple[bool, float, float]:
    """Whether two printed numbers agree within ``rtol`` and their printing precision."""
    a, b = float(stored), float(now)
    scale = max(abs(a), abs(b))
    allowed = rtol * scale + max(last_digit_unit(stored), last_digit_unit(now))
    relative = abs(a - b) / scale if scale else 0.0
    # (1 + 1e-9): 5.868 - 5.867 is 0.0010000000000003 in binary floating point.
    ok = abs(a - b) <= allowed * (1 + 1e-9) or (math.isnan(a) and math.isnan(b))
    return ok, relative, allowed / scale if scale else allowed


def compare_text(stored: str, now: str, rtol: float) -> list[str]:
    """Problems between a stored text and a new one (empty: they agree)."""
    stored_parts, now_parts = NUMBER.split(stored), NUMBER.split(now)
    if stored_parts[0::2] != now_parts[0::2]:
        return [text_diff(stored, now)]
    moved = []
    offset = 0
    for i, (a, b) in enumerate(zip(stored_parts, now_parts, strict=True)):
        if i % 2 == 1:
            ok, relative, allowed = compare_numbers(a, b, rtol)
            if not ok:
                moved.append(Moved(line_at(stored, offset), a, b, relative, allowed))
        offset += len(a)
    return [str(m) for m in moved]


def line_at(text: str, offset: int) -> str:
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    line = text[start: end if end >= 0 else len(text)].strip()
    return line if len(line) <= 120 else line[:117] + "..."


def text_diff(stored: str, now: str) -> str:
    """The first lines that differ beyond their numbers, as a short unified diff."""
    diff = difflib.unified_diff(stored.splitlines(), now.splitlines(), "stored", "now",
                                lineterm="", n=0)
    lines = list(diff)[2:14]
    return "text differs beyond its numbers:\n    " + "\n    ".join(lines)


def compare_samples(stored: list[dict[str, Any]], now: list[dict[str, Any]]) -> list[str]:
    """Continuations agree on labels and prompts, and on the part both runs decided."""
    if [(s["label"], s["prompt"]) for s in stored] != [(n["label"], n["prompt"]) for n in now]:
        return [f"different continuations: stored {[(s['label'], s['prompt']) for s in stored]}"
                f", now {[(n['label'], n['prompt']) for n in now]}"]
    problems = []
    for s, n in zip(stored, now, strict=True):
        name = f"{s['label'] or 'continuation'} of {s['prompt']!r}"
        common = min(len(s["decided"]), len(n["decided"]))
        if s["text"][:common] != n["text"][:common]:
            problems.append(f"{name}: the decided part differs: stored {s['text'][:common]!r}, "
                            f"now {n['text'][:common]!r}")
        elif s["complete"] and n["complete"] and s["text"] != n["text"]:
            problems.append(f"{name}: stored {s['text']!r}, now {n['text']!r}")
    return problems


def flatten(outputs: list[Any], skip: tuple[str, ...], sanitize: Any) -> dict[str, list[Any]]:
    """Outputs as {kind: [values]} (nbval's layout); continuations as their records."""
    flat: dict[str, list[Any]] = defaultdict(list)
    for output in outputs:
        kind = output.get("output_type")
        samples = (output.get("metadata") or {}).get(SAMPLES_METADATA_KEY)
        if samples is not None:
            flat[SAMPLES_METADATA_KEY].append(samples)
        elif kind == "stream":
            flat[f"stream {output['name']}"].append(sanitize(output["text"]))
        elif kind == "error":
            flat["error"].append(sanitize(f"{output['ename']}: {output['evalue']}"))
        else:
            for mime, value in (output.get("data") or {}).items():
                if mime not in skip:
                    flat[mime].append(sanitize(value) if isinstance(value, str) else value)
    return flat


def compare_flat(stored: dict[str, list[Any]], now: dict[str, list[Any]], rtol: float
                 ) -> list[str]:
    if set(stored) != set(now):
        return [f"different kinds of output: stored {sorted(stored)}, now {sorted(now)}"]
    # text/plain first: a table's numbers then show once, not again in its HTML.
    for kind in sorted(stored, key=lambda k: (k != "text/plain", k)):
        if len(stored[kind]) != len(now[kind]):
            return [f"{kind}: {len(stored[kind])} output(s) stored, {len(now[kind])} now"]
        for a, b in zip(stored[kind], now[kind], strict=True):
            if kind == SAMPLES_METADATA_KEY:
                problems = compare_samples(a, b)
            elif isinstance(a, str) and isinstance(b, str):
                problems = compare_text(html.unescape(a) if kind == "text/html" else a,
                                        html.unescape(b) if kind == "text/html" else b, rtol)
            else:
                problems = [] if a == b else [f"stored {a!r}, now {b!r}"]
            if problems:
                return [f"{kind}: {p}" for p in problems]
    return []


class TolerantCell(IPyNbCell):
    """A notebook cell run by nbval and compared by ``compare_flat``."""

    def compare_outputs(self, test: list[Any], ref: list[Any], skip_compare: Any = None) -> bool:
        skip = skip_compare or self.parent.skip_compare
        problems = compare_flat(flatten(ref, skip, self.sanitize),
                                flatten(test, skip, self.sanitize), self.rtol())
        self.comparison_traceback = []
        if problems:
            shown = problems[:MAX_REPORTED]
            more = len(problems) - len(shown)
            self.comparison_traceback.append(
                f"{self.fspath.basename} cell {self.cell_num} differs from its stored copy:\n  "
                + "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else ""))
        return not problems

    def rtol(self) -> float:
        for tag in self.cell.metadata.get("tags", []):
            match = RTOL_TAG.match(tag)
            if match:
                return float(match.group(1))
        return self.config.getoption("nbval_rtol")


# What the copies write beside themselves (train.ipynb's run, profile.ipynb's trace). Each pass
# starts without them: a run directory holding checkpoints would be resumed, not trained again.
RUN_OUTPUTS = ("nbval-run", "nbval-profile", "nbval-export")
_CLEANED: set[Path] = set()


class TolerantNotebook(IPyNbFile):
    """nbval's notebook collector, yielding ``TolerantCell`` items (marked slow)."""

    def setup(self) -> None:
        directory = self.path.parent
        if directory not in _CLEANED:
            _CLEANED.add(directory)
            for name in RUN_OUTPUTS:
                shutil.rmtree(directory / name, ignore_errors=True)
        super().setup()

    def collect(self):
        for cell in super().collect():
            item = TolerantCell.from_parent(self, name=cell.name, cell_num=cell.cell_num,
                                            cell=cell.cell, options=cell.options)
            item.add_marker(pytest.mark.slow)
            yield item


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("nbval")
    group.addoption("--nbval-rtol", type=float, default=DEFAULT_RTOL,
                    help=f"relative tolerance for printed numbers (default {DEFAULT_RTOL})")
    group.addoption("--nbval-tolerant", action="store_true",
                    help="check any collected .ipynb like tests/notebooks/ (tolerant nbval)")


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "slow: end-to-end tests (notebooks, several processes)")


def pytest_collect_file(file_path: Path, parent: Any) -> Any:
    """tests/notebooks/*.ipynb (or, with --nbval-tolerant, any notebook) under tolerant nbval;
    ``--nbval`` instead gives nbval's own exact comparison."""
    option = parent.config.option
    if file_path.suffix != ".ipynb" or option.nbval or option.nbval_lax:
        return None
    if option.nbval_tolerant or file_path.parent == NOTEBOOK_COPIES:
        return TolerantNotebook.from_parent(parent, path=file_path)
    return None
