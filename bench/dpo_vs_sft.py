"""A DPO step against an SFT step on the same rows, side by side: seconds, XLA's memory, and the
memory planner's figure beside the compiled one.

    .venv/bin/python bench/dpo_vs_sft.py                              # the 270M, LoRA r8, 4 x 512
    .venv/bin/python bench/dpo_vs_sft.py --checkpoint "" --model gemma3-tiny --lora-rank 0

Both steps are compiled in one process from one DPO ``Experiment`` on the embedded preference
set: the SFT step is the same model, optimizer and weights without DPO's settings (next-token
NLL on the same rows' loss-bearing reply tokens), so the difference is DPO's own: the
reference's forward pass and the per-segment loss. The two alternate ``--rounds`` timed steps on
the same batch, each from its own copy of the state.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from gemmalab import plan
from gemmalab.config import EMBEDDED_INSTRUCTIONS, TrainConfig
from gemmalab.data import packing
from gemmalab.model import mesh
from gemmalab.train import optimization
from gemmalab.train.experiment import Experiment

sys.path.insert(0, os.path.dirname(__file__))
from cross_entropy import report  # noqa: E402  (bench/cross_entropy.py, beside this file)


def as_sft(config: TrainConfig) -> TrainConfig:
    """The same run as SFT (on instruction data: preference data is DPO's alone)."""
    return TrainConfig.flat(**{**config.to_dict(), "objective": "sft",
                          "data_path": EMBEDDED_INSTRUCTIONS})


def mib(size: float) -> str:
    return f"{size / 2**20:,.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="embedded:gemma3-270m")
    parser.add_argument("--model", default=None)
    parser.add_argument("--maxlen", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig.flat(objective="dpo", checkpoint=args.checkpoint, model=args.model,
                             lora_rank=args.lora_rank, batch_size=args.batch_size,
                             maxlen=args.maxlen, embedded_stories=args.pairs, max_steps=100,
                             eval_every=0, checkpoint_every=0, output_dir=output_dir)
        experiment = Experiment.prepare(config)
        weights = experiment.weights
        rows = jax.ShapeDtypeStruct((config.trainer.batch_size, config.data.maxlen), jnp.int32,
                                    sharding=mesh.batch_sharding(experiment.mesh))
        # SFT's step takes LoRA's base, or nothing in full fine-tuning (no reference copy).
        sft_held = weights.frozen
        sft = optimization.make_train_step(
            experiment.model, experiment.optimizer, experiment.schedule,
            experiment.compute_dtype, experiment.mesh, weights.state_shardings,
            frozen_shardings=weights.frozen_shardings)
        steps = {"sft": (sft.lower(weights.state, {name: rows for name in packing.FIELDS},
                                   sft_held).compile(), sft_held),
                 "dpo": (experiment.compile(), weights.frozen)}
        devices = plan.attached_accelerator(list(experiment.mesh.devices.flat))
        configs = {"sft": as_sft(config), "dpo": config}
        adapters = weights.trainable_params if weights.frozen is not None else 0
        batch = experiment.next_batch()
        states = {name: jax.tree.map(jnp.copy, weights.state) for name in steps}
        for name, (compiled, held) in steps.items():
            memory = compiled.memory_analysis()
            states[name], metrics = compiled(states[name], batch, held)
            planned = plan.estimate(configs[name], devices)
            flops = plan.model_flops(experiment.prepared.model_config,
                                     weights.num_params - adapters,
                                     batch_size=config.trainer.batch_size,
                                     maxlen=config.data.maxlen, lora=config.lora.enabled,
                                     dpo=name == "dpo", adapters=adapters)
            print(f"{name}: loss {float(metrics['loss']):.4f}, useful tokens "
                  f"{int(metrics['useful_tokens'])}, model {flops / 1e12:.3f} TFLOP; compiled: "
                  f"arguments {mib(memory.argument_size_in_bytes)}, temporaries "
                  f"{mib(memory.temp_size_in_bytes)}; planned {mib(planned.per_device_bytes)} ("
                  + ", ".join(f"{part} {mib(size)}" for part, size in planned.breakdown.items())
                  + ")")
        times = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, (compiled, held) in steps.items():
                started = time.perf_counter()
                states[name], metrics = compiled(states[name], batch, held)
                jax.block_until_ready(metrics)
                times[name].append(time.perf_counter() - started)
    tuning = f"LoRA r{config.lora.rank}" if config.lora.rank else "full fine-tuning"
    print(f"{config.model.preset} {config.trainer.batch_size} x {config.data.maxlen}, {tuning}, "
          f"{args.rounds} alternating rounds")
    report(times)


if __name__ == "__main__":
    main()
