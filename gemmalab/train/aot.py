"""The exact memory plan: the train step compiled ahead of time by libtpu for a TPU topology,
with no chip attached, and its roofline.

``compile_plan`` / ``compile_plans`` (the caller's side) run this module in a subprocess that
loads libtpu (the calling process never loads the TPU runtime), and merge what it prints into
the analytic plans (``gemmalab.plan``); the subprocess's side is ``main``:

    python -m gemmalab.train.aot '{"requests": [{"config": {...}, "accelerator": "v6e:2x4"}, ...]}'

One JSON line per request on stdout, in order, each as soon as it is compiled. The plan cannot
compile the train step itself (it sits below the train stage), so the exact plan is here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from gemmalab.accelerators import Accelerator, parse_accelerator
from gemmalab.config import TrainConfig
from gemmalab.plan.exact import compile_environment, compiled_plan
from gemmalab.plan.memory import MemoryPlan, estimate
from gemmalab.plan.roofline import compiled_cost
from gemmalab.plan.shapes import (
    abstract_params,
    adapter_params,
    preference_segments_bound,
    vocab_size_hint,
)
from gemmalab.weights import resolution


def compile_plan(config: TrainConfig, accelerator: Accelerator | str, *,
                 timeout_s: float = 3600, price_per_chip_hour: float | None = None) -> MemoryPlan:
    """The exact plan: XLA's memory analysis of the step compiled by libtpu for the topology.

    Runs this module (the train stage's step, compiled ahead of time) in a subprocess that
    loads libtpu (CPU-only machines welcome); the analytic estimate rides along for comparison.
    The roofline then takes XLA's FLOPs and bytes accessed of the compiled step (which count a
    loop's body once: the loss's chunks and gradient accumulation's micro-batches are loops).
    """
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    return compile_plans([(config, accelerator)], timeout_s=timeout_s,
                         price_per_chip_hour=price_per_chip_hour)[0]


def compile_plans(targets: Sequence[tuple[TrainConfig, Accelerator | str]], *,
                  timeout_s: float = 3600, price_per_chip_hour: float | None = None
                  ) -> list[MemoryPlan]:
    """``compile_plan`` of each ``(config, accelerator)``, in one subprocess: libtpu's start-up
    (~25 s here) and the imports are paid once, not once a plan. Identical targets compile once.
    ``timeout_s`` bounds the whole subprocess."""
    targets = [(resolution.resolve(config).config,
                parse_accelerator(accelerator) if isinstance(accelerator, str) else accelerator)
               for config, accelerator in targets]
    # Validates every mesh, batch and the price first, instantly.
    analytics = [estimate(config, accelerator, price_per_chip_hour=price_per_chip_hour)
                 for config, accelerator in targets]
    env = compile_environment([accelerator for _, accelerator in targets])
    # The whole config: a field the compiled step depends on cannot be left out.
    requests = [{"config": config.to_dict(), "accelerator": accelerator.name}
                for config, accelerator in targets]
    keys = [json.dumps(request, sort_keys=True) for request in requests]
    distinct = list(dict.fromkeys(keys))
    argument = json.dumps({"requests": [requests[keys.index(key)] for key in distinct]})
    # This very module, by its own name (libtpu must load in a process of its own).
    result = subprocess.run([sys.executable, "-m", __spec__.name, argument],
                            env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        names = ", ".join(dict.fromkeys(accelerator.name for _, accelerator in targets))
        raise RuntimeError(f"compiling for {names} failed:\n{tail}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    compiled = dict(zip(distinct, (json.loads(line) for line in lines[-len(distinct):]),
                        strict=True))
    return [compiled_plan(analytic, compiled[key])
            for key, analytic in zip(keys, analytics, strict=True)]


def compile_step(config: TrainConfig, accelerator: Accelerator) -> dict[str, Any]:
    """Lower and compile the train step for the topology's devices: XLA's memory breakdown, its
    FLOP count, one device's bytes accessed and the seconds it took.

    ``config.trainer.objective == "dpo"``: the step with DPO's reference forward pass, the
    base model
    (no adapters) on the step's third argument: LoRA's frozen base, or in full fine-tuning a
    compute-dtype copy of the weights sharded like them. Its segments a row are
    ``plan.preference_segments_bound`` (no data is read here)."""
    config = resolution.resolve(config).config  # a run's choices, decided as it decides them
    import time

    import jax
    import jax.numpy as jnp
    import optax
    from jax.experimental import topologies

    from gemmalab.data import packing
    from gemmalab.model import lora, mesh, presets, quantization, sharding
    from gemmalab.train import optimization

    start = time.perf_counter()
    topology = topologies.get_topology_desc(platform="tpu", topology_name=accelerator.topology)
    device_mesh = mesh.make_mesh(
        config.runtime.mesh, topology.devices, num_slices=config.runtime.num_slices
    )
    model_config = presets.model_config(
        config.model.preset, vocab_size_hint(config.model), config.model.num_layers
    )
    model = presets.build_model(
        model_config,
        param_dtype=jnp.dtype(config.model.param_dtype),
        remat=config.model.remat,
        attention=config.model.attention,
        mesh=device_mesh,
        expert_capacity_factor=config.model.expert_capacity_factor,
    )
    base_model = model
    params = abstract_params(model_config, config.model.param_dtype)
    frozen = frozen_shardings = preference_settings = None
    dpo = config.trainer.objective == "dpo"
    if config.lora.rank or dpo:
        # LoRA's frozen base (also DPO's reference), or full fine-tuning DPO's reference copy:
        # the starting weights in the compute dtype, sharded like the params.
        base = abstract_params(model_config, config.model.compute_dtype)
        # QLoRA: its projections as the run holds them, quantized values and scales.
        base = quantization.abstract_base(base, config.lora.base_quantization,
                                          config.model.compute_dtype)
        frozen_shardings = sharding.param_sharding(base, device_mesh)
        frozen = jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                       sharding=where),
                              base, frozen_shardings)
    if config.lora.rank:  # the state: adapters; the base: a compute-dtype argument
        model = lora.wrap(model, rank=config.lora.rank, alpha=config.lora.alpha,
                          modules=config.lora.modules, dtype=jnp.dtype(config.model.param_dtype),
                          mesh=device_mesh)
        params = adapter_params(model_config, config.lora, config.model.param_dtype)
    if dpo:
        preference_settings = optimization.Preference.of(
            config.dpo, base_model, preference_segments_bound(config.data.maxlen),
            adapters=config.lora.enabled)
    schedule = optax.constant_schedule(1e-5)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.01, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    shardings = optimization.state_sharding(params, optimizer, device_mesh)
    abstract_state = optimization.abstract_state(params, optimizer, shardings)
    rows = jax.ShapeDtypeStruct((config.trainer.batch_size, config.data.maxlen), jnp.int32,
                                sharding=mesh.batch_sharding(device_mesh))
    batch = {name: rows for name in packing.FIELDS}
    step = optimization.make_train_step(
        model,
        optimizer,
        schedule,
        jnp.dtype(config.model.compute_dtype),
        device_mesh,
        shardings,
        grad_accum_steps=config.trainer.grad_accum_steps,
        frozen_shardings=frozen_shardings,
        preference_settings=preference_settings,
    )
    compiled = step.lower(abstract_state, batch, frozen).compile()
    memory = compiled.memory_analysis()
    cost = compiled_cost(compiled)
    breakdown = {
        "arguments": int(memory.argument_size_in_bytes),
        "outputs_not_aliased": int(memory.output_size_in_bytes - memory.alias_size_in_bytes),
        "temporaries": int(memory.temp_size_in_bytes),
        "code": int(memory.generated_code_size_in_bytes),
    }
    # cost_analysis counts one device's program; the step's FLOPs are every device's, its bytes
    # accessed (HBM reads and writes, the roofline's memory term) one device's.
    flops_per_device = float(cost.get("flops", 0.0))
    return {"breakdown": breakdown, "flops": flops_per_device * len(topology.devices),
            "flops_per_device": flops_per_device,
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> None:
    document = json.loads((sys.argv[1:] if argv is None else argv)[0])
    for request in document["requests"]:
        config = TrainConfig.flat(**request["config"])
        result = compile_step(config, parse_accelerator(request["accelerator"]))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
