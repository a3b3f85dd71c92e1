"""What to change when a run does not fit: the first change that does (``suggest_fit``), the
run's other layouts, the fewest chips that would hold it, the refusal naming the fix
(``require_fits``, what ``train.ipynb`` applies) and the table of what fits on 1-32 chips.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gemmalab.accelerators import CHIPS, GIB, Accelerator, parse_accelerator, topology_chips
from gemmalab.config import EXPERT_COUNTS, REMAT_POLICIES, TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.plan.memory import MemoryPlan, estimate
from gemmalab.weights import resolution


def suggest_fit(config: TrainConfig, accelerator: Accelerator) -> tuple[dict[str, Any], MemoryPlan
                                                                        ] | None:
    """The first change that fits, and its plan, trying more micro-batches, then full remat,
    then both again with fsdp over every chip; None if nothing on this many chips does."""
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    candidates: list[dict[str, Any]] = []
    for mesh_shape in _unique([config.runtime.mesh, *spread_meshes(config.model.preset)]):
        # Not "dots": compiled for TPU it saved nothing over "none" (docs/scaling.md).
        for remat in dict.fromkeys((config.model.remat, "full")):
            accum = config.trainer.grad_accum_steps
            while True:
                candidates.append({"mesh": mesh_shape, "remat": remat, "grad_accum_steps": accum})
                accum *= 2
                if accum > config.trainer.batch_size:
                    break
    for change in candidates:
        candidate = config.replace(**change)
        try:
            plan = estimate(candidate, accelerator)
        except ConfigError:  # e.g. the batch does not split that many ways
            continue
        if plan.fits:
            return {k: v for k, v in change.items() if config.to_dict()[k] != v}, plan
    return None


def layouts(config: TrainConfig, accelerator: Accelerator) -> list[MemoryPlan]:
    """The run's plan under its own mesh and under fsdp over every chip, each remat policy."""
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    plans = []
    for mesh_shape in _unique([config.runtime.mesh, *spread_meshes(config.model.preset)]):
        for remat in REMAT_POLICIES:
            try:
                plans.append(estimate(config.replace(mesh=mesh_shape, remat=remat),
                                      accelerator))
            except ConfigError:  # the batch does not split over this layout
                continue
    return plans


def spread_meshes(preset_name: str) -> list[dict[str, int]]:
    """The layouts that spread a model's weights over every chip: fsdp, and for a mixture of
    experts also its experts over an ``expert`` axis (alone, or with fsdp splitting the rest;
    a layout whose axis does not divide the experts or the chips is skipped by the caller)."""
    if not EXPERT_COUNTS.get(preset_name):
        return [{"fsdp": -1}]
    return [{"fsdp": -1}, {"expert": -1}, *({"expert": n, "fsdp": -1} for n in (2, 4, 8))]


def _unique(items: list[Any]) -> list[Any]:
    return [item for i, item in enumerate(items) if item not in items[:i]]


TABLE_MODELS = ("gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")
GEMMA4_TABLE_MODELS = ("gemma4-e2b", "gemma4-e4b", "gemma4-31b", "gemma4-26b-a4b")


# libtpu topology names of a slice of n chips: one chip, and the catalogue's slices.
TOPOLOGIES = {kind: {1: chip.one_chip, **{topology_chips(shape): shape for shape in chip.slices}}
              for kind, chip in CHIPS.items() if chip.slices}


def fit_table(kind: str = "v6e", chip_counts: tuple[int, ...] = (1, 4, 8, 16, 32),
              maxlens: tuple[int, ...] = (256, 2048), batch_size: int = 32,
              models: tuple[str, ...] = TABLE_MODELS, lora_rank: int = 0
              ) -> list[dict[str, Any]]:
    """For each model x slice x maxlen: the first layout that fits (in ``suggest_fit``'s order,
    from plain data parallelism), or the most frugal one's size when none does."""
    rows = []
    for model in models:
        for maxlen in maxlens:
            row: dict[str, Any] = {"model": model, "maxlen": maxlen}
            for chips in chip_counts:
                shape = TOPOLOGIES[kind][chips] if kind in TOPOLOGIES else chips
                accelerator = parse_accelerator(f"{kind}:{shape}")
                config = TrainConfig.flat(model=model, tokenizer=model.split("-")[0],
                                          maxlen=maxlen, batch_size=max(batch_size, chips),
                                          lora_rank=lora_rank)
                first = estimate(config, accelerator)
                found = (({}, first) if first.fits else suggest_fit(config, accelerator))
                if found:
                    change, fitted = found
                    layout = _layout_words(fitted)
                    row[f"{chips} chips"] = f"{layout}: {fitted.per_device_bytes / GIB:.1f} GiB"
                else:
                    frugal = estimate(config.replace(mesh={"fsdp": -1}, remat="full",
                        grad_accum_steps=config.trainer.batch_size // chips), accelerator)
                    row[f"{chips} chips"] = f"no ({frugal.per_device_bytes / GIB:.0f} GiB)"
            rows.append(row)
    return rows


def _layout_words(memory_plan: MemoryPlan) -> str:
    words = [f"{axis} {size}" for axis, size in memory_plan.mesh.items() if size > 1]
    if memory_plan.remat != "none":
        words.append(f"remat {memory_plan.remat}")
    if memory_plan.grad_accum_steps > 1:
        words.append(f"accum {memory_plan.grad_accum_steps}")
    return ", ".join(words) or "1 chip"


def chips_needed(config: TrainConfig, accelerator: Accelerator) -> int | None:
    """The fewest chips (powers of two, up to 4096) of this kind on which the most frugal layout
    fits: fsdp over every chip, full remat, one row per device."""
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    chips = accelerator.chips * 2
    while chips <= 4096:
        frugal = config.replace(mesh={"fsdp": -1}, remat="full", num_slices=1,
                                     batch_size=chips, grad_accum_steps=1)
        if estimate(frugal, dataclasses.replace(accelerator, chips=chips, topology="")).fits:
            return chips
        chips *= 2
    return None


def require_fits(config: TrainConfig, accelerator: Accelerator) -> MemoryPlan:
    """The analytic plan, or a one-line ``ConfigError`` naming the change that fits."""
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    plan = estimate(config, accelerator)
    if plan.fits:
        return plan
    where = (f"{accelerator.kind} device" if accelerator.platform != "cpu"
             else "CPU device (host memory shared by the local devices)")
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in plan.breakdown.items() if v >= GIB / 10)
    problem = (
        f"{config.model.preset} needs ~{plan.per_device_bytes / GIB:.1f} GiB per device ({parts}) "
        f"but a {where} has {plan.usable_bytes / GIB:.1f} GiB usable"
    )
    override = "or set check_memory=False to run anyway"
    found = suggest_fit(config, accelerator)
    if found:
        change, fitted = found
        words = ", ".join(f"{k}={v!r}" for k, v in change.items())
        raise ConfigError(next(iter(change)), problem,
                          f"use {words} (~{fitted.per_device_bytes / GIB:.1f} GiB), {override}")
    needed = chips_needed(config, accelerator)
    more = f"about {needed} chips of this kind" if needed else "a larger accelerator"
    raise ConfigError("mesh", problem, f"nothing fits on {accelerator.chips} device(s): use "
                      f"{more} with mesh={{'fsdp': -1}} and remat='full', {override}")
