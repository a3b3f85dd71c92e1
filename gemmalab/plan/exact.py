"""The exact plan's libtpu: where the TPU compiler is, the environment a compile-only process
loads it with, and the ``MemoryPlan`` a compiled step's numbers make.

The compile itself is the train stage's (``gemmalab.train.aot``: the real train step, lowered
with abstract inputs and compiled for the topology in a subprocess of its own), which imports the
plan; no module here imports it back (only the command line's ``--exact`` calls it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemmalab.accelerators import Accelerator
from gemmalab.errors import ConfigError
from gemmalab.plan.memory import MemoryPlan


def find_libtpu() -> str | None:
    """libtpu.so: ``$GEMMALAB_LIBTPU``, ``$TPU_LIBRARY_PATH``, the checkout's ``.libtpu/`` (``make
    libtpu``), or an installed ``libtpu`` package (TPU images)."""
    import importlib.util

    for variable in ("GEMMALAB_LIBTPU", "TPU_LIBRARY_PATH"):
        path = os.environ.get(variable)
        if path and Path(path).is_file():
            return path
    checkout = Path(__file__).resolve().parents[2] / ".libtpu" / "libtpu" / "libtpu.so"
    if checkout.is_file():
        return str(checkout)
    spec = importlib.util.find_spec("libtpu")
    if spec and spec.origin and (Path(spec.origin).parent / "libtpu.so").is_file():
        return str(Path(spec.origin).parent / "libtpu.so")
    return None


def compile_environment(accelerators: Sequence[Accelerator]) -> dict[str, str]:
    """The environment of a process that compiles for these TPU topologies with libtpu; a
    one-line ``ConfigError`` for a target that is no TPU, or where libtpu is not installed."""
    for accelerator in accelerators:
        if accelerator.platform != "tpu":
            raise ConfigError("exact", f"the exact plan compiles for TPUs, not {accelerator.kind}",
                              "use exact=False (the analytic estimate) for GPUs")
    library = find_libtpu()
    if library is None:
        raise ConfigError("exact", "libtpu (the TPU compiler) is not installed",
                          "run `make libtpu`, or set GEMMALAB_LIBTPU to a libtpu.so")
    # Compile-only: no chip is opened, so several planners may run at once (libtpu otherwise
    # takes a machine-wide lock meant for processes that drive real chips).
    return {**os.environ, "JAX_PLATFORMS": "cpu", "TPU_LIBRARY_PATH": library,
            "TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": "", "TPU_SKIP_MDS_QUERY": "1",
            "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def compiled_plan(analytic: MemoryPlan, step: dict[str, Any]) -> MemoryPlan:
    """The exact plan: ``analytic`` with a compiled step's numbers (``breakdown``, ``flops``,
    ``bytes_accessed``, ``seconds``: ``gemmalab.train.aot.compile_step``), the estimate riding
    along for comparison. The roofline then takes XLA's FLOPs and bytes accessed (which count a
    loop's body once: the loss's chunks and gradient accumulation's micro-batches are loops)."""
    return dataclasses.replace(
        analytic, method="compiled", breakdown=step["breakdown"], flops_per_step=step["flops"],
        traffic={"xla_bytes_accessed": int(step["bytes_accessed"])},
        compile_seconds=step["seconds"], analytic=analytic)
