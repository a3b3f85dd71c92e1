"""How a batch splits over the devices: the one check (and message) of a batch that does not.

The batch is split over the mesh's ``data``, ``fsdp`` and ``expert`` axes (``BATCH_AXES``), and
each device's share again into ``grad_accum_steps`` micro-batches. The run
(``gemmalab.model.mesh``), the plan (``gemmalab.plan``) and the cluster config
(``gemmalab.k8s.config``) check it here, before any expensive work starts. Part of the ground:
imports only ``gemmalab.config`` and ``gemmalab.errors``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from gemmalab.config import DATA_AXIS, EXPERT_AXIS, EXPERT_COUNTS, FSDP_AXIS
from gemmalab.errors import ConfigError

# The batch is split over every axis that holds different examples.
BATCH_AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS)


def batch_ways(sizes: Mapping[str, int]) -> int:
    """How many ways a mesh of these axis sizes splits the batch."""
    return math.prod(int(sizes.get(axis, 1)) for axis in BATCH_AXES)


def check_batch_split(batch_size: int, ways: int, grad_accum_steps: int = 1, *,
                      where: str) -> None:
    """Every one of ``ways`` data-parallel ways gets the same rows in each of the
    ``grad_accum_steps`` micro-batches; else a one-line ``ConfigError("batch_size", ...)``
    naming the nearest batches that split. ``where``: the mesh or cluster the ways come from."""
    size = ways * grad_accum_steps
    if batch_size % size == 0:
        return
    lower, upper = batch_size // size * size, -(-batch_size // size) * size
    nearest = f"{upper}" if lower == 0 else f"{lower} or {upper}"
    accum = f" x {grad_accum_steps} micro-batches" if grad_accum_steps > 1 else ""
    raise ConfigError("batch_size", f"{batch_size} is not divisible by the {ways} data-parallel "
                      f"ways{accum} of {where}", f"use a multiple of {size}, e.g. {nearest}")


def check_expert_axis(sizes: Mapping[str, int], model: str, capacity_factor: float = 0.0
                      ) -> None:
    """An ``expert`` axis splits a mixture's experts (``EXPERT_COUNTS``) evenly, and splits
    nothing in a dense model: one line naming ``mesh`` otherwise; a capacity factor bounds what
    that axis exchanges, so it needs one. The run, the plan and the cluster config check it
    here."""
    ways = int(sizes.get(EXPERT_AXIS, 1))
    if ways == 1:
        if capacity_factor:
            raise ConfigError("expert_capacity_factor", "bounds the tokens an expert axis "
                              "exchanges, and mesh has none", "leave it 0, or add an 'expert' "
                              "axis to mesh")
        return
    experts = EXPERT_COUNTS.get(model, 0)
    if not experts:
        raise ConfigError("mesh", f"an expert axis of {ways} splits nothing: {model} has no "
                          "experts", "drop 'expert' from mesh (give its devices to data or fsdp)")
    if experts % ways:
        fits = [n for n in range(2, experts + 1) if experts % n == 0 and n <= ways * 2]
        raise ConfigError("mesh", f"the expert axis ({ways}) does not divide {model}'s "
                          f"{experts} experts", f"use an expert size that divides {experts}, "
                          f"e.g. {fits[-1] if fits else 1}")
