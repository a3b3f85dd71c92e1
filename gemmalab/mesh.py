"""The one place that builds the device mesh and places batches on it.

Today: a data-parallel axis over every device of every process. FSDP/tensor/multislice axes
will be added here, so callers only ever see ``make_mesh`` and the shardings below.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemmalab.errors import ConfigError

DATA_AXIS = "data"


def make_mesh(devices: list[Any] | None = None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[DATA_AXIS]


def check_batch_size(batch_size: int, mesh: Mesh) -> None:
    size = data_parallel_size(mesh)
    if batch_size % size:
        lower, upper = batch_size // size * size, -(-batch_size // size) * size
        suggestion = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise ConfigError("batch_size", f"{batch_size} is not divisible by the data-parallel size "
                          f"{size} ({jax.process_count()} process(es) x "
                          f"{jax.local_device_count()} device(s))", f"use e.g. {suggestion}")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble each process's rows into one global array sharded over the data axis."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
