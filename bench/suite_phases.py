"""Where the test suite's time goes, test by test: a pytest plugin, and its report.

    PYTHONPATH=bench .venv/bin/pytest -p suite_phases -n 2 tests/model/test_sharding.py
    .venv/bin/python bench/suite_phases.py          # the report of what the run recorded

Each test (setup, call and teardown together) records its wall time, the CPU seconds of its own
process and of the processes it started and waited for (papermill kernels, libtpu compiles,
multi-process runs), and the seconds JAX reports for its phases in that process
(``jax.monitoring``): XLA's backend compile, tracing, lowering to MLIR, and compiles saved by
the persistent cache, and XLA's compile seconds by the name of the function compiled
(``compiled``). One JSON line a test, a file per pytest-xdist worker, in
``$SUITE_PHASES_DIR`` (default ``runs/suite-phases``; a run appends: remove it to start over).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import time
from pathlib import Path

import pytest

DIRECTORY = os.environ.get("SUITE_PHASES_DIR", "runs/suite-phases")
COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
SAVED = "/jax/compilation_cache/compile_time_saved_sec"
PHASES = {"compile": COMPILE, "trace": TRACE, "lower": LOWER, "cache_saved": SAVED}

_seconds: collections.Counter = collections.Counter()
_compiled: collections.Counter = collections.Counter()
_listening = False


def _record(event: str, duration: float, fun_name: str | None = None, **_) -> None:
    _seconds[event] += duration
    if event == COMPILE and fun_name:
        _compiled[fun_name] += duration


def _listen() -> None:
    global _listening
    if not _listening:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_record)
        _listening = True


def _cpu_seconds() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _listen()
    before = dict(_seconds)
    compiled_before = dict(_compiled)
    own, children = _cpu_seconds()
    started = time.perf_counter()
    yield
    wall = time.perf_counter() - started
    own_after, children_after = _cpu_seconds()
    record = {"test": item.nodeid, "wall": round(wall, 2), "cpu": round(own_after - own, 2),
              "cpu_children": round(children_after - children, 2)}
    record.update({name: round(_seconds[event] - before.get(event, 0.0), 4)
                   for name, event in PHASES.items()})
    record["compiled"] = {name: round(seconds - compiled_before.get(name, 0.0), 3)
                          for name, seconds in _compiled.items()
                          if seconds - compiled_before.get(name, 0.0) >= 0.05}
    path = Path(DIRECTORY) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def report(directory: str | os.PathLike = DIRECTORY, top: int = 25) -> str:
    """The slowest tests and the totals, as text."""
    records = [json.loads(line) for path in sorted(Path(directory).glob("*.jsonl"))
               for line in path.read_text().splitlines()]
    if not records:
        raise SystemExit(f"nothing recorded in {directory}: run pytest -p suite_phases first")
    columns = ("wall", "cpu", "cpu_children", *PHASES)
    lines = ["  ".join(f"{name:>12}" for name in columns) + "  test"]
    for record in sorted(records, key=lambda r: -r["wall"])[:top]:
        lines.append("  ".join(f"{record[name]:12.1f}" for name in columns)
                     + f"  {record['test']}")
    totals = {name: sum(r[name] for r in records) for name in columns}
    lines.append("  ".join(f"{totals[name]:12.1f}" for name in columns)
                 + f"  all {len(records)} tests")
    by_function: collections.Counter = collections.Counter()
    compiles: collections.Counter = collections.Counter()
    for record in records:
        for name, seconds in record.get("compiled", {}).items():
            by_function[name] += seconds
            compiles[name] += 1
    if by_function:
        lines += ["", "XLA compile seconds by function (tests that compiled it)"]
        lines += [f"{seconds:12.1f}  {compiles[name]:5d}  {name}"
                  for name, seconds in by_function.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=DIRECTORY)
    parser.add_argument("--top", type=int, default=25)
    arguments = parser.parse_args()
    print(report(arguments.directory, arguments.top))
