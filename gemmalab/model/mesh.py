"""The one place that builds the device mesh and places batches on it.

The mesh always has three named axes, ``data``, ``fsdp`` and ``tensor`` (size 1 when unused):
``data`` replicates the weights and splits the batch; ``fsdp`` splits the batch and the weights
(each device gathers a layer's weights when it needs them); ``tensor`` splits heads and widths
within each example. ``gemmalab.model.sharding`` says which weight dimension goes where.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemmalab.config import AXES, DATA_AXIS, resolve_mesh_shape
from gemmalab.data_parallel import BATCH_AXES, batch_ways, check_batch_split
from gemmalab.errors import ConfigError


def make_mesh(shape: Mapping[str, int] | None = None, devices: list[Any] | None = None, *,
              num_slices: int = 1) -> Mesh:
    """The mesh of ``devices`` (default: every device of every process) with ``shape``.

    With ``num_slices`` > 1 (multislice), ``shape`` describes one slice and the ``data`` axis
    is multiplied across slices: only data-parallel gradient sums cross the slow data-center
    network, fsdp and tensor traffic stays on each slice's own interconnect. Devices belong to
    the slice their ``slice_index`` says (TPU); devices without one (CPU, simulated) are dealt
    into ``num_slices`` consecutive groups.
    """
    from jax.experimental import mesh_utils

    devices = list(devices) if devices is not None else jax.devices()
    slices = _slices(devices, num_slices)
    sizes = resolve_mesh_shape(shape, len(slices[0]))
    grids = [mesh_utils.create_device_mesh([sizes[a] for a in AXES], group,
                                           allow_split_physical_axes=True) for group in slices]
    return Mesh(np.concatenate(grids, axis=AXES.index(DATA_AXIS)), AXES)


def _slices(devices: list[Any], num_slices: int) -> list[list[Any]]:
    if not isinstance(num_slices, int) or num_slices < 1 or len(devices) % num_slices:
        raise ConfigError("num_slices", f"{num_slices!r} does not divide {len(devices)} devices",
                          "use the number of TPU slices the job runs on (1 for one slice)")
    if all(getattr(d, "slice_index", None) is not None for d in devices):
        indices = sorted({d.slice_index for d in devices})
        if len(indices) != num_slices:
            raise ConfigError("num_slices", f"{num_slices} given but the devices are on "
                              f"{len(indices)} slice(s)", f"use num_slices={len(indices)}")
        return [[d for d in devices if d.slice_index == i] for i in indices]
    per_slice = len(devices) // num_slices
    return [devices[i * per_slice:(i + 1) * per_slice] for i in range(num_slices)]


def platform(mesh: Mesh | None) -> str:
    """The platform ("cpu", "gpu", "tpu") of ``mesh``'s devices; None: the default backend's
    (an ahead-of-time compile's mesh holds its target's devices, not this host's)."""
    return mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    return {axis: int(mesh.shape[axis]) for axis in mesh.axis_names}


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split."""
    return batch_ways(mesh.shape)


def check_batch_size(batch_size: int, mesh: Mesh, grad_accum_steps: int = 1) -> None:
    """Every device gets the same number of rows in each of the ``grad_accum_steps``."""
    check_batch_split(batch_size, data_parallel_size(mesh), grad_accum_steps,
                      where=f"mesh {mesh_shape(mesh)} ({jax.process_count()} process(es) x "
                      f"{jax.local_device_count()} device(s))")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` that split the batch (``BATCH_AXES``; a mesh built elsewhere may
    lack some)."""
    return tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh)))


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Assemble each process's rows into one global array split over the batch axes."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}
