"""Read a captured JAX profiler trace back offline and turn it into notebook tables.

A notebook captures a trace with ``jax.profiler.start_trace(logdir)`` ... ``stop_trace()``,
which writes ``logdir/plugins/profile/<run>/<host>.xplane.pb``. This module reads that file
without starting the XProf UI:

* :func:`op_stats` -- the operations that took the most time (xprof's ``framework_op_stats``
  tool on TPU/GPU; on CPU, where that tool reports only ``IDLE``, the XLA:CPU op events of
  the raw trace);
* :func:`time_by_part` -- the same ops grouped by part of the step (the loss's logits
  matmuls, the model's matmuls, LoRA, attention, norms, the optimizer), placed through the
  compiled step's HLO (each op's jax name stack);
* :func:`step_breakdown` -- per ``jax.profiler.StepTraceAnnotation`` step: step time, device
  compute, host time inside jitted calls and host time outside them (data wait);
* :func:`xprof_step_table` / :func:`xprof_tables` -- xprof's own tables as DataFrames;
* :func:`plot_op_stats` and :func:`xprof_command` for the notebook.

xprof (C++ converters) and jax are imported lazily inside the functions. Gotchas found in
xprof 2.24.2 and jax 0.12:

* ``xprof.convert.raw_to_tool_data.xspace_to_tool_data(paths, tool, params)`` returns
  ``(data, content_type)``; ``data`` is ``bytes`` (``str`` for ``trace_viewer``) holding
  Google-Charts DataTable JSON (``{"cols": [...], "rows": [{"c": [{"v": ...}]}], "p": {}}``)
  or a list of such tables, and ``None`` when the tool failed.
* The converters write caches next to the xplane (``ALL_HOSTS.op_stats_v2.pb``, HLO protos,
  ``*.SSTABLE`` for ``trace_viewer@``). The ``ALL_HOSTS`` cache is reused by the UI, so this
  module always passes every ``*.xplane.pb`` of the run (all hosts) and recomputes
  (``use_saved_result=False``) instead of trusting a cache built from fewer hosts.
* The C++ side logs dozens of ``I0000 ...`` lines to file descriptor 2 per call (Jupyter shows
  them); ``TF_CPP_MIN_LOG_LEVEL`` only helps if set before xprof is imported, so the calls
  here redirect fd 2 and attach the captured log to the error if a tool fails.
* Iterating ``jax.profiler.ProfileData`` event stats emits a ``DeprecationWarning`` from
  nanobind; under ``-W error`` the process aborts, so it is silenced around that code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sys
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gemmalab.errors import ConfigError, require

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

OP_COLUMNS = (
    "operation", "type", "host_or_device", "program", "occurrences", "self_time_us",
    "avg_self_time_us", "total_time_us", "share", "cumulative_share",
)
"""Columns of :func:`op_stats`.

* ``operation``: xprof's framework op name (TPU/GPU, e.g. ``jit(step)/dot_general``) or the
  HLO instruction name of an XLA:CPU op (``dot.1``, ``add_tanh_fusion``).
* ``type``: op category -- xprof's "Operation Type" or, on CPU, derived from the HLO name
  (``fusion`` for ``*fusion*``, otherwise the name without ``.N`` / ``wrapped_``: ``dot``,
  ``reduce-window``, ``all-reduce``...).
* ``host_or_device``: ``Device`` for ops of compiled XLA programs (XLA:CPU ops count as
  ``Device``: they run on JAX's CPU devices), ``Host`` for xprof's host-side framework ops
  (only with ``include_host=True``).
* ``program``: HLO module (``jit_step``) for ops read from raw events; ``""`` from xprof.
* ``occurrences``: executions, summed over devices and hosts.
* ``self_time_us``: total time in the op minus time in ops nested inside it, in us, summed
  over devices; ``avg_self_time_us`` = ``self_time_us / occurrences``.
* ``total_time_us``: total time including nested ops, in us.
* ``share``: ``self_time_us`` / total self time of all ops on the same side (host or device),
  idle excluded -- computed before the table is cut to ``top`` rows, so shares sum to <= 1.
* ``cumulative_share``: running sum of ``share`` down the table.
"""

STEP_COLUMNS = (
    "step", "name", "start_ms", "step_time_ms", "device_compute_ms", "host_dispatch_ms",
    "host_wait_ms", "device_share",
)
"""Columns of :func:`step_breakdown`; the three ``*_ms`` parts partition ``step_time_ms``.

* ``step``: ``step_num`` given to ``StepTraceAnnotation``; ``name``: its name (``train``).
* ``start_ms``: start of the step, in ms after the first step in the table started.
* ``step_time_ms``: wall time of the annotation span.
* ``device_compute_ms``: time within the span during which at least one device executed
  XLA code: the ``XLA Modules`` line of ``/device:*`` planes (TPU), else device events that
  carry an ``hlo_op``/``hlo_module`` stat (GPU kernels); on CPU-only traces the
  ``ThunkExecutor::Execute`` spans and the XLA:CPU op events on the host.
* ``host_dispatch_ms``: time with no device compute while the step's Python thread was
  inside a jitted call (``PjitFunction(...)``/``PmapFunction(...)``): argument handling,
  dispatch, and tracing/compilation on a cache miss.
* ``host_wait_ms``: the rest -- no device compute and the Python thread outside jitted calls:
  waiting for the next batch, Python bookkeeping, logging, sleeps. An upper bound on data
  wait.
* ``device_share``: ``device_compute_ms / step_time_ms``.

Device work is attributed to the step during which it ran, not the one that launched it.
"""

_JIT_CALL = re.compile(r"^(Pjit|Pmap)Function\(")
_HLO_STATS = ("hlo_op", "hlo_module")
_NOT_COMPUTE_LINES = ("Steps", "Framework", "Source", "TraceMe", "Launch", "Memcpy", "Counter")


def find_xplane(logdir: str | Path) -> Path:
    """The newest ``*.xplane.pb`` under ``logdir/plugins/profile/*/``."""
    profile_root = Path(logdir).expanduser() / "plugins" / "profile"
    candidates = list(profile_root.glob("*/*.xplane.pb"))
    if not candidates:
        raise ConfigError(
            "profile_dir",
            f"no *.xplane.pb under {profile_root}/*/",
            "pass the directory given to jax.profiler.start_trace() and call "
            "jax.profiler.stop_trace() before reading the trace",
        )
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, str(p)))


def xprof_command(logdir: str | Path, port: int = 9001, grpc_port: int | None = None) -> str:
    """The shell command that opens the XProf UI on ``logdir`` (the ``start_trace`` dir).

    ``xprof --logdir X --port P`` is the server form of the installed console script
    (``xprof server --logdir X --port P`` is equivalent); then browse to
    ``http://localhost:P/``. Every server also listens on gRPC port 50051 by default: give
    a second server on the same machine its own ``grpc_port``.
    """
    require(isinstance(port, int) and 0 < port < 65536, "port",
            f"{port!r} is not a TCP port", "use an integer in 1..65535, e.g. 9001")
    text = str(logdir)
    if "://" not in text:  # keep gs:// and other URLs as given
        text = str(Path(text).expanduser().resolve())
    command = f"xprof --logdir {shlex.quote(text)} --port {port}"
    if grpc_port is not None:
        command += f" --grpc_port {grpc_port}"
    return command


# ---------------------------------------------------------------------------------------------
# xprof tools


def xprof_tables(xplane: str | Path, tool: str,
                 params: dict[str, Any] | None = None) -> list[pd.DataFrame]:
    """Run an xprof tool that returns DataTable JSON and convert each table to a DataFrame.

    ``tool`` is e.g. ``framework_op_stats``, ``overview_page``, ``input_pipeline_analyzer``,
    ``hlo_stats``, ``kernel_stats``, ``roofline_model``. Column names are the DataTable column
    ids; each table's ``p`` properties are in ``df.attrs["properties"]``. Runs on all hosts of
    ``xplane``'s run (see the module docstring).
    """
    import pandas as pd

    raw = _run_tool(_resolve(xplane), tool, params or {})
    payload = json.loads(raw)
    tables = payload if isinstance(payload, list) else [payload]
    frames = []
    for table in tables:
        if not isinstance(table, dict) or "cols" not in table:
            continue
        ids = [c.get("id") or c.get("label") or f"col{i}" for i, c in enumerate(table["cols"])]
        rows = [[(cell or {}).get("v") for cell in row.get("c", [])]
                for row in table.get("rows", [])]
        frame = pd.DataFrame(rows, columns=ids) if rows else pd.DataFrame(columns=ids)
        frame.attrs["properties"] = dict(table.get("p") or {})
        frames.append(frame)
    return frames


def xprof_step_table(xplane: str | Path) -> pd.DataFrame:
    """xprof's own per-step time breakdown (``input_pipeline_analyzer`` step table), in ms.

    Rows are the annotated steps (``name`` like ``train 0``); columns are xprof's categories
    renamed to snake case (``device_compute_ms``, ``host_compute_ms``, ``infeed_ms``,
    ``compile_ms``, ``other_ms``, ``step_time_ms``...; TPU traces have ``tc_*`` columns).
    Meaningful on TPU/GPU; on CPU xprof sees no device, so everything in the step --
    including waiting for data -- lands in ``host_compute_ms`` (use :func:`step_breakdown`).
    The table's summary (averages, ``input_conclusion``) is in ``df.attrs["properties"]``.
    """
    import pandas as pd

    for frame in xprof_tables(xplane, "input_pipeline_analyzer"):
        if "stepnum" not in frame.columns:
            continue
        frame = frame.drop(columns=[c for c in frame.columns if c == "tooltip"])
        renamed = {c: _snake_ms(c) for c in frame.columns}
        renamed["stepnum"] = "name"
        properties = frame.attrs.get("properties", {})
        frame = frame.rename(columns=renamed)
        frame.attrs["properties"] = properties
        return frame.reset_index(drop=True)
    return pd.DataFrame(columns=["name", "step_time_ms"])


def _snake_ms(column: str) -> str:
    """``deviceComputeTimeMs`` -> ``device_compute_ms``; ``stepTimeMs`` -> ``step_time_ms``."""
    if column != "stepTimeMs":
        column = re.sub(r"TimeMs$", "Ms", column)
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", column).lower()


def _run_tool(xplane: Path, tool: str, params: dict[str, Any]) -> bytes | str:
    from xprof.convert import raw_to_tool_data

    paths = [str(p) for p in _session_xplanes(xplane)]
    options = {"use_saved_result": False, **params}
    with _native_stderr_captured() as log:
        data, _content_type = raw_to_tool_data.xspace_to_tool_data(paths, tool, options)
        if data is None:
            tail = log.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"xprof tool {tool!r} returned nothing for {paths}; log:\n{tail}")
    return data


def _session_xplanes(xplane: Path) -> list[Path]:
    """Every host's xplane of the run ``xplane`` belongs to."""
    return sorted(xplane.parent.glob("*.xplane.pb")) or [xplane]


class _Log:
    def __init__(self, file: Any):
        self._file = file

    def read(self) -> bytes:
        self._file.seek(0)
        return self._file.read()


@contextlib.contextmanager
def _native_stderr_captured() -> Iterator[_Log]:
    """Send what C++ code writes to file descriptor 2 to a temporary file for the duration."""
    with tempfile.TemporaryFile() as sink:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError):  # no real fd 2 (embedded interpreters): leave it alone
            yield _Log(sink)
            return
        os.dup2(sink.fileno(), 2)
        try:
            yield _Log(sink)
        finally:
            os.dup2(saved, 2)
            os.close(saved)


# ---------------------------------------------------------------------------------------------
# raw trace events


@dataclass
class _Trace:
    """What the analyses need from one or more XSpaces, in ns on the trace clock."""

    # (line key, name, step_num, start, end)
    steps: list[tuple[str, str, int, float, float]] = field(default_factory=list)
    jit_calls: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    device_busy: list[tuple[float, float]] = field(default_factory=list)
    # (program, op, start, end, line key)
    ops: list[tuple[str, str, float, float, str]] = field(default_factory=list)
    has_device_planes: bool = False


def _read_trace(paths: list[Path]) -> _Trace:
    from jax.profiler import ProfileData

    trace = _Trace()
    modules: list[tuple[float, float]] = []
    device_ops: list[tuple[str, str, float, float, str]] = []
    host_ops: list[tuple[str, str, float, float, str]] = []
    thunk_spans: list[tuple[float, float]] = []
    jit_calls: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with warnings.catch_warnings():
        # nanobind's stats types warn on first use; under -W error that aborts the process.
        warnings.simplefilter("ignore", DeprecationWarning)
        for index, path in enumerate(paths):
            data = ProfileData.from_file(str(path))
            for plane in data.planes:
                plane_name = plane.name
                is_device = plane_name.startswith("/device:")
                if not is_device and (not plane_name.startswith("/host:")
                                      or plane_name == "/host:metadata"):
                    continue
                for line in plane.lines:
                    key = f"{index}:{plane_name}:{line.name}"
                    if is_device:
                        _read_device_line(line, key, modules, device_ops)
                        continue
                    for event in line.events:
                        name, start, end = event.name, event.start_ns, event.end_ns
                        if _JIT_CALL.match(name):
                            jit_calls[key].append((start, end))
                            continue
                        if name == "ThunkExecutor::Execute":
                            thunk_spans.append((start, end))
                            continue
                        stats = dict(event.stats)
                        if "step_num" in stats:
                            trace.steps.append((key, name, int(stats["step_num"]), start, end))
                        elif "hlo_op" in stats:
                            host_ops.append((str(stats.get("hlo_module", "")),
                                             str(stats["hlo_op"]), start, end, key))
    trace.jit_calls = dict(jit_calls)
    trace.has_device_planes = bool(modules or device_ops)
    if trace.has_device_planes:
        trace.ops = device_ops
        trace.device_busy = modules or [(s, e) for _, _, s, e, _ in device_ops]
    else:  # CPU-only: XLA:CPU runs the compiled program on host threads
        trace.ops = host_ops
        trace.device_busy = thunk_spans + [(s, e) for _, _, s, e, _ in host_ops]
    trace.steps.sort(key=lambda s: s[3])
    return trace


def _read_device_line(line: Any, key: str, modules: list[tuple[float, float]],
                      ops: list[tuple[str, str, float, float, str]]) -> None:
    name = line.name
    if name == "XLA Modules":
        modules.extend((e.start_ns, e.end_ns) for e in line.events)
        return
    if any(word in name for word in _NOT_COMPUTE_LINES):
        return
    for event in line.events:
        stats = dict(event.stats)
        if name == "XLA Ops":
            ops.append((str(stats.get("hlo_module", "")), event.name,
                        event.start_ns, event.end_ns, key))
        elif any(s in stats for s in _HLO_STATS):
            op = str(stats.get("hlo_op", event.name))
            ops.append((str(stats.get("hlo_module", "")), op, event.start_ns, event.end_ns, key))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _covered(merged: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of ``[start, end]`` covered by the sorted, disjoint ``merged`` intervals."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in merged if s < end and e > start)


def _resolve(xplane: str | Path) -> Path:
    path = Path(xplane).expanduser()
    if path.is_dir():
        return find_xplane(path)
    require(path.is_file(), "xplane", f"{path} does not exist",
            "pass find_xplane(logdir) or the directory given to jax.profiler.start_trace()")
    return path


# ---------------------------------------------------------------------------------------------
# tables


def op_stats(xplane: str | Path, top: int = 20, *, include_host: bool = False) -> pd.DataFrame:
    """The ``top`` operations by total self time, largest first (columns: ``OP_COLUMNS``).

    ``xplane`` is a ``*.xplane.pb`` (or a ``start_trace`` logdir: its newest trace); all hosts
    of that run are included. Uses xprof's ``framework_op_stats`` device ops; when it has
    none (CPU traces: xprof reports only ``IDLE`` there) the XLA op events of the raw trace
    are aggregated instead. ``include_host`` adds xprof's host-side framework ops.
    ``df.attrs["source"]`` says which source was used, ``df.attrs["total_self_time_us"]``
    the denominators of ``share`` per side.
    """
    require(isinstance(top, int) and top > 0, "top", f"{top!r} is not a positive integer",
            "pass e.g. top=20")
    path = _resolve(xplane)
    frame = _xprof_op_stats(path, include_host)
    source = "xprof framework_op_stats"
    if frame is None:
        frame = _raw_op_stats(_read_trace(_session_xplanes(path)))
        source = "raw trace events (XLA op events)"
    totals = frame.groupby("host_or_device")["self_time_us"].sum()
    frame["share"] = (frame["self_time_us"] / frame["host_or_device"].map(totals)).fillna(0.0)
    frame = frame.sort_values("self_time_us", ascending=False, kind="stable").head(top).copy()
    frame["cumulative_share"] = frame.groupby("host_or_device")["share"].cumsum()
    frame = frame[list(OP_COLUMNS)].reset_index(drop=True)
    frame.attrs["source"] = source
    frame.attrs["total_self_time_us"] = {str(k): float(v) for k, v in totals.items()}
    return frame


PART_COLUMNS = ("part", "ms_per_step", "share", "operations")
"""Columns of :func:`time_by_part`."""


def time_by_part(xplane: str | Path, hlo_text: str, *, steps: int) -> pd.DataFrame:
    """Where a traced step's op time goes, by part of the step, largest first (columns:
    ``PART_COLUMNS``): the loss's logits matmuls and the rest of the loss (softmax, casts),
    the model's matmuls, LoRA's adapters, attention's scores/softmax/masks, norms, the
    optimizer, everything else.

    ``hlo_text``: the traced program's optimized HLO (``compiled.as_text()``, e.g.
    ``experiment.train_step.as_text()``): each traced op is looked up by its instruction name
    there, and placed by its ``op_name`` (the jax name stack: the loss's and the optimizer's
    named scopes, gemma's module path) and by whether it computes a dot. ``steps``: how many
    steps the trace holds (the op times are divided by it). Ops not in ``hlo_text`` (another
    program) are ``other programs``. ``share`` is of the summed op self time, which can exceed
    the step time where XLA runs independent ops at once.
    """
    import pandas as pd

    require(isinstance(steps, int) and steps > 0, "steps", f"{steps!r} is not a positive integer",
            "pass the number of traced steps, e.g. profile_steps")
    require(isinstance(hlo_text, str) and "ENTRY" in hlo_text, "hlo_text",
            "is not an optimized HLO module's text", "pass compiled.as_text() of the traced step")
    instructions = _hlo_instructions(hlo_text)
    ops = op_stats(xplane, top=1_000_000)
    ops = ops[ops["host_or_device"] == "Device"]
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, self_us in zip(ops["operation"], ops["self_time_us"], strict=True):
        found = instructions.get(name)
        part = "other programs" if found is None else _part_of(*found)
        times[part][0] += float(self_us)
        times[part][1] += 1
    total = sum(t for t, _ in times.values()) or 1.0
    frame = pd.DataFrame([{"part": part, "ms_per_step": t / 1e3 / steps, "share": t / total,
                           "operations": n} for part, (t, n) in times.items()],
                         columns=list(PART_COLUMNS))
    return frame.sort_values("ms_per_step", ascending=False, kind="stable").reset_index(drop=True)


# name = shape opcode(...): a tuple shape holds spaces, so the opcode is the first word before "("
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_DOTS = ("dot", "convolution")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "all-reduce-start", "all-gather-start", "collective-permute-start")


def _hlo_instructions(hlo_text: str) -> dict[str, tuple[str, str]]:
    """Every instruction of an HLO module's text: name -> (its op_name, "dot" where it or the
    computation it calls computes one, "collective", else its opcode). A fusion without an
    op_name of its own takes the most frequent one inside its computation."""
    computations: dict[str, list[tuple[str, str, str, str | None]]] = defaultdict(list)
    current = ""
    for line in hlo_text.splitlines():
        instruction = _INSTRUCTION.match(line)
        if instruction is None:
            header = _COMPUTATION.match(line)
            if header is not None:
                current = header.group(1)
            continue
        op_name, calls = _OP_NAME.search(line), _CALLS.search(line)
        computations[current].append((instruction.group(1), instruction.group(2),
                                      op_name.group(1) if op_name else "",
                                      calls.group(1) if calls else None))

    def inside(computation: str | None) -> tuple[str, bool]:
        body = computations.get(computation or "", [])
        names = [op_name for _, _, op_name, _ in body if op_name]
        dotted = any(opcode in _DOTS for _, opcode, _, _ in body)
        return (max(set(names), key=names.count) if names else ""), dotted

    found: dict[str, tuple[str, str]] = {}
    for body in computations.values():
        for name, opcode, op_name, calls in body:
            called_name, called_dot = inside(calls) if calls else ("", False)
            kind = ("dot" if opcode in _DOTS or called_dot else
                    "collective" if opcode in _COLLECTIVES else opcode)
            found[name] = (op_name or called_name, kind)
    return found


def _part_of(op_name: str, kind: str) -> str:
    from gemmalab.model.cross_entropy import LOSS_SCOPE
    from gemmalab.train.optimization import OPTIMIZER_SCOPE

    if kind == "collective":  # the gradients' all-reduce, fsdp's gathers: wherever they sit
        return "collectives (all-reduce, all-gather, ...)"
    is_dot = kind == "dot"
    path = set(re.split(r"[/()]", op_name))
    if LOSS_SCOPE in path:
        return "loss: logits matmuls" if is_dot else "loss: softmax, casts, rest"
    if OPTIMIZER_SCOPE in path:
        return "optimizer"
    if "lora" in path:  # gemma's LoRA module: the adapters' a and b
        return "LoRA adapters"
    if any(part.endswith("_norm") for part in path):
        return "norms"
    if "attn" in path and not any(part.endswith("_einsum") for part in path):
        return "attention: scores, softmax, masks"
    if is_dot:
        return "model matmuls (projections, MLP)"
    return "other (elementwise, copies, casts, gradients)"


def _xprof_op_stats(path: Path, include_host: bool) -> pd.DataFrame | None:
    import pandas as pd

    tables = [t for t in xprof_tables(path, "framework_op_stats")
              if {"host_or_device", "total_self_time"} <= set(t.columns)]
    if not tables:
        return None
    table = tables[-1]  # [include IDLE, exclude IDLE]
    table = table[(table["type"] != "IDLE") & (table["total_self_time"] > 0)]
    device = table["host_or_device"] == "Device"
    if not device.any():
        return None
    if not include_host:
        table = table[device]
    occurrences = table["occurrences"].astype(int)
    self_time = table["total_self_time"].astype(float)
    return pd.DataFrame({
        "operation": table["operation"].astype(str),
        "type": table["type"].astype(str),
        "host_or_device": table["host_or_device"].astype(str),
        "program": "",
        "occurrences": occurrences,
        "self_time_us": self_time,
        "avg_self_time_us": self_time / occurrences.clip(lower=1),
        "total_time_us": table["total_time"].astype(float),
    })


def _raw_op_stats(trace: _Trace) -> pd.DataFrame:
    import pandas as pd

    by_line: dict[str, list[tuple[str, str, float, float, str]]] = defaultdict(list)
    for op in trace.ops:
        by_line[op[4]].append(op)
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for ops in by_line.values():
        ops.sort(key=lambda o: (o[2], -o[3]))
        self_ns = [o[3] - o[2] for o in ops]
        stack: list[int] = []
        for i, (_, _, start, end, _) in enumerate(ops):
            while stack and ops[stack[-1]][3] <= start:
                stack.pop()
            if stack and end <= ops[stack[-1]][3]:  # nested in the op on top of the stack
                self_ns[stack[-1]] -= end - start
            stack.append(i)
        for (program, name, start, end, _), own in zip(ops, self_ns, strict=True):
            entry = sums[(program, name)]
            entry[0] += 1
            entry[1] += own
            entry[2] += end - start
    rows = [{
        "operation": name,
        "type": _hlo_category(name),
        "host_or_device": "Device",
        "program": program,
        "occurrences": int(count),
        "self_time_us": own / 1e3,
        "avg_self_time_us": own / 1e3 / count,
        "total_time_us": total / 1e3,
    } for (program, name), (count, own, total) in sums.items()]
    columns = [c for c in OP_COLUMNS if c not in ("share", "cumulative_share")]
    return pd.DataFrame(rows, columns=columns)


def _hlo_category(name: str) -> str:
    base = re.sub(r"\.\d+$", "", name)
    if "fusion" in base:
        return "fusion"
    return base.removeprefix("wrapped_")


def step_breakdown(xplane: str | Path, step_name: str | None = None) -> pd.DataFrame:
    """Per annotated step: step time split into device compute, dispatch and host wait.

    Steps are the ``jax.profiler.StepTraceAnnotation(name, step_num=i)`` spans of one host's
    trace (``xplane``, or a ``start_trace`` logdir: its newest trace); ``step_name`` keeps only
    steps with that name. Columns and their exact meaning: ``STEP_COLUMNS``. Computed from
    the raw trace events, so it works on CPU, GPU and TPU alike; see
    :func:`xprof_step_table` for xprof's own (TPU/GPU-oriented) categories.
    """
    import pandas as pd

    path = _resolve(xplane)
    trace = _read_trace([path])
    steps = [s for s in trace.steps if step_name is None or s[1] == step_name]
    if not steps:
        wanted = f"named {step_name!r} " if step_name else ""
        raise ConfigError(
            "xplane", f"{path} has no StepTraceAnnotation steps {wanted}".rstrip(),
            "wrap each training step in `with jax.profiler.StepTraceAnnotation('train', "
            "step_num=i):` while tracing")
    device = _union(trace.device_busy)
    origin = steps[0][3]
    rows = []
    for key, name, number, start, end in steps:
        span = end - start
        compute = _covered(device, start, end)
        busy = _covered(_union(trace.jit_calls.get(key, []) + trace.device_busy), start, end)
        rows.append({
            "step": number,
            "name": name,
            "start_ms": (start - origin) / 1e6,
            "step_time_ms": span / 1e6,
            "device_compute_ms": compute / 1e6,
            "host_dispatch_ms": max(0.0, busy - compute) / 1e6,
            "host_wait_ms": max(0.0, span - busy) / 1e6,
            "device_share": compute / span if span > 0 else 0.0,
        })
    frame = pd.DataFrame(rows, columns=list(STEP_COLUMNS))
    frame.attrs["device"] = "accelerator" if trace.has_device_planes else "cpu"
    return frame


def plot_op_stats(df: pd.DataFrame, title: str | None = None) -> Figure:
    """Horizontal bars of each op's ``share`` of self time, biggest on top."""
    from matplotlib.figure import Figure

    labels = [_shorten(str(op)) for op in df["operation"]]
    shares = [100.0 * float(s) for s in df["share"]]
    figure = Figure(figsize=(7.5, 1.2 + 0.32 * max(1, len(labels))))
    axis = figure.subplots()
    positions = list(range(len(labels)))
    axis.barh(positions, shares, color="tab:blue")
    axis.set_yticks(positions, labels, fontsize=8)
    axis.invert_yaxis()
    for y, share in zip(positions, shares, strict=True):
        axis.text(share, y, f" {share:.1f}%", va="center", fontsize=7)
    axis.set_xlabel("share of total op self time (%)")
    axis.set_xlim(0, max(shares, default=1.0) * 1.15 or 1.0)
    axis.set_title(title or f"Top {len(labels)} ops by self time")
    axis.grid(axis="x", alpha=0.3)
    figure.tight_layout()
    return figure


def _shorten(text: str, width: int = 48) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3):]
