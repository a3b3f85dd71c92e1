"""A fine-tuning run from config to saved params: what ``notebooks/train.ipynb`` drives.

``Experiment.prepare`` does every check that can fail on bad input before anything expensive
(tokenization, weight loading, compilation); ``train`` runs the loop; ``save`` writes the params.
The loop reads top to bottom; its collaborators do the rest:

- ``gemmalab.data.preparation``: corpus, tokenizer, token cache (``PreparedData``) and what the
  loop reads (``TrainingData``: batches, eval batches, step counts);
- ``gemmalab.train.params``: the trained and frozen weights with their shardings
  (``TrainWeights``), restored from a checkpoint or initialised;
- ``gemmalab.train.checkpoints``: the run's checkpoints and the resume checks;
- ``gemmalab.train.metrics``: rows, evaluations, startup seconds and FLOP accounting;
- ``gemmalab.train.tensorboard_log``: the same rows, the samples and the config for TensorBoard;
- ``gemmalab.train.host_peak``: on CPUs, the host's measured matmul rate (``cpu_mfu``'s peak);
- ``gemmalab.train.preemption``: SIGTERM becomes a checkpoint and ``Preempted``.
"""

from __future__ import annotations

import dataclasses
import resource
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab import storage
from gemmalab.accelerators import attached_accelerator, peak_device_bytes
from gemmalab.config import DPOConfig, TrainConfig
from gemmalab.data import chat as chat_template
from gemmalab.data import packing
from gemmalab.data.documents import CONVERSATIONAL
from gemmalab.data.preparation import PreparedData, TrainingData, prepare_tokens, training_data
from gemmalab.data_parallel import check_expert_axis
from gemmalab.errors import ConfigError, TrainingDiverged
from gemmalab.model import lora, mesh, presets, quantization, sampling
from gemmalab.plan.fit import require_fits
from gemmalab.plan.memory import MemoryPlan, estimate
from gemmalab.plan.roofline import model_flops
from gemmalab.plan.shapes import abstract_params, active_adapters, vocab_size_hint
from gemmalab.train import (
    checkpoints,
    compile_cache,
    host_peak,
    metrics,
    optimization,
    tensorboard_log,
)
from gemmalab.train.params import (
    StartingWeights,
    TrainWeights,
    record_frozen_weights,
    restore_or_init,
    trained_token_ids,
)
from gemmalab.train.preemption import Preempted, StopRequest
from gemmalab.weights import orbax_params, resolution, sources
from gemmalab.weights.export import TOKENIZER_FILE

FINAL_LOSS_WINDOW = 10


@dataclasses.dataclass
class Experiment:
    config: TrainConfig  # resolved: every choice the given config left open is decided
    resolved: dict[str, Any]  # what decided them (gemmalab.weights.resolution), in summary.json
    mesh: Any
    prepared: PreparedData  # corpus, tokenizer, token cache, model config
    data: TrainingData  # batches, eval batches, step counts, the data table
    # With LoRA (lora_rank > 0) ``model`` is the adapted ``base_model``; else the two are one.
    model: Any
    base_model: Any
    weights: TrainWeights
    optimizer: Any
    schedule: Any
    memory_plan: MemoryPlan
    checkpoints: checkpoints.TrainCheckpoints
    checkpoint_name: str  # the base: e.g. embedded:gemma3-270m, a path, or "" (random init)
    startup: metrics.Startup
    flops: metrics.FlopAccounting
    preference: optimization.Preference | None  # DPO's settings for the steps; None for SFT
    eval_step: Any
    # The run's TensorBoard event files (output_dir/tensorboard): the main process's, None
    # elsewhere or with tensorboard=False. A resumed run's old events past its start step are
    # dropped when they are opened (in ``prepare``).
    tensorboard: tensorboard_log.TensorBoardLog | None
    train_step: Any = None  # compiled by ``compile`` for this run's batch shape
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eval_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_digest: int = 0  # CRC32 of the last batch's local token rows
    checkpoint_seconds: list[float] = dataclasses.field(default_factory=list)  # blocking saves

    # -----------------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, config: TrainConfig) -> Experiment:
        """Validate everything, build data, tokenizer, model and state; compile nothing yet."""
        startup = metrics.Startup()
        # What the config leaves open (model, tokenizer, depth, batch, data set), decided from
        # the checkpoint; from here on everything reads the decided config.
        resolved = resolution.resolve(config)
        config = resolved.config
        storage.require_writable_directory("cache_dir", config.runtime.resolved_cache_dir)
        # First, so every compile of the run (init, steps, sampler) is read from or written to it.
        storage.require_writable_directory("compile_cache_dir",
                                           config.runtime.resolved_compile_cache_dir)
        compile_cache.enable(config.runtime.resolved_compile_cache_dir)
        device_mesh = mesh.make_mesh(config.runtime.mesh, num_slices=config.runtime.num_slices)
        mesh.check_batch_size(
            config.trainer.batch_size, device_mesh, config.trainer.grad_accum_steps
        )
        check_expert_axis(device_mesh.shape, config.model.preset,
                          config.model.expert_capacity_factor)
        if config.lora.base_quantization != "none":  # (traces the model's shapes)
            quantization.check_base(config.lora.base_quantization, abstract_params(
                presets.model_config(config.model.preset, vocab_size_hint(config.model),
                                     config.model.num_layers), config.model.param_dtype),
                device_mesh.shape)
        if storage.is_gcs(config.runtime.output_dir):
            storage.require_gcs_credentials("output_dir", config.runtime.output_dir)
        checkpoint = sources.resolve(
            config.model.checkpoint, config.model.preset, config.runtime.resolved_cache_dir
        )
        # Refused here, before the data is tokenized and the weights loaded.
        devices = attached_accelerator(list(device_mesh.devices.flat))
        memory_plan = (require_fits if config.runtime.check_memory else estimate)(config, devices)
        # The run's record beside its checkpoints; a resumed run's must match it.
        record = checkpoints.resume_values(config.to_dict())
        previous = checkpoints.previous_run(config.runtime.output_dir,
                                            resume=config.checkpoints.resume, values=record)
        # One checkpoint (trained weights and AdamW's two moments) and the final params.
        state_bytes = ((3 * memory_plan.trainable_params + memory_plan.num_params)
                       * jnp.dtype(config.model.param_dtype).itemsize)
        if jax.process_index() == 0:
            checkpoints.require_writable_room(config.runtime.output_dir, state_bytes)
        startup.phase("checks")
        # CPUs list no peak: their cpu_mfu is against this host's matmul rate, measured (once per
        # machine, cached) now, while nothing else runs: before the data's prefetch threads and
        # far from the first step's clock.
        host_rate = host_peak.of_run(devices, config.model.compute_dtype)
        startup.phase("host_peak")

        prepared = prepare_tokens(config.data, config.model, config.trainer,
                                  cache_dir=config.runtime.resolved_cache_dir)
        data = training_data(prepared, config.data, config.trainer)
        startup.phase("data")

        param_dtype = jnp.dtype(config.model.param_dtype)
        base_model = presets.build_model(prepared.model_config, param_dtype=param_dtype,
                                         remat=config.model.remat, attention=config.model.attention,
                                         mesh=device_mesh,
                                         expert_capacity_factor=config.model.expert_capacity_factor)
        token_ids = trained_token_ids(config.lora, prepared.tokenizer_info,
                                      chat=prepared.corpus.conversational,
                                      pretrained=bool(config.model.checkpoint))
        model = (lora.wrap(base_model, rank=config.lora.rank, alpha=config.lora.alpha,
                           modules=config.lora.modules, dtype=param_dtype, token_ids=token_ids,
                           mesh=device_mesh)
                 if config.lora.rank else base_model)
        peak_lr = config.optimizer.learning_rate or presets.default_learning_rate(
            config.model.preset, lora=config.lora.rank > 0, objective=config.trainer.objective)
        schedule = optimization.learning_rate_schedule(peak_lr, data.total_steps,
                                                       warmup_ratio=config.optimizer.warmup_ratio,
                                                       min_lr_ratio=config.optimizer.min_lr_ratio)
        optimizer = optimization.make_optimizer(
            schedule,
            weight_decay=config.optimizer.weight_decay,
            b1=config.optimizer.adam_b1,
            b2=config.optimizer.adam_b2,
            max_grad_norm=config.optimizer.max_grad_norm,
        )
        saved = checkpoints.TrainCheckpoints(
            config.runtime.output_dir, keep=config.checkpoints.keep
        )
        checkpoints.require_steps_ahead(saved, data.total_steps,
                                        resume=config.checkpoints.resume,
                                        by_max_steps=config.trainer.max_steps is not None)
        dpo = config.trainer.objective == "dpo"
        starting = StartingWeights(base_model, checkpoint, preset=config.model.preset,
                                   seed=config.trainer.seed, sample_length=config.data.maxlen)
        weights = restore_or_init(starting, config.lora, optimizer, device_mesh, saved,
                                  data.train_iterator, param_dtype=config.model.param_dtype,
                                  compute_dtype=config.model.compute_dtype,
                                  resume=previous is not None, keep_frozen=dpo,
                                  token_rows=len(token_ids))
        record_frozen_weights(weights, output_dir=config.runtime.output_dir, values=record,
                              previous=previous, checkpoint_name=checkpoint.name)
        jax.block_until_ready((weights.state, weights.frozen))
        startup.phase("model")

        adapters = weights.adapter_params
        flops = metrics.FlopAccounting.of_run(
            model_flops(prepared.model_config, weights.num_params - adapters,
                        batch_size=config.trainer.batch_size, maxlen=config.data.maxlen,
                        lora=config.lora.enabled, dpo=dpo,
                        adapters=(active_adapters(prepared.model_config, weights.state.params)
                                  if adapters else 0)),
            devices, host_peak_flops_per_s=host_rate)
        preference = _preference(config.trainer.objective, config.data.path, config.dpo,
                                 config.lora.enabled, base_model, data)
        eval_step = optimization.make_eval_step(model, jnp.dtype(config.model.compute_dtype),
                                                device_mesh, weights.state_shardings.params,
                                                weights.frozen_shardings, preference)
        board = tensorboard_log.for_run(
            config.runtime.output_dir, resume_step=weights.start_step, hparams=config.to_dict(),
            enabled=config.metrics.tensorboard and jax.process_index() == 0)
        return cls(config=config, resolved=resolved.to_dict(), mesh=device_mesh,
                   prepared=prepared, data=data, model=model, base_model=base_model,
                   weights=weights, optimizer=optimizer, schedule=schedule,
                   memory_plan=memory_plan, checkpoints=saved, checkpoint_name=checkpoint.name,
                   startup=startup, flops=flops, preference=preference, eval_step=eval_step,
                   tensorboard=board)

    # -----------------------------------------------------------------------------------------
    # What notebooks read.

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def tokenizer(self) -> Any:
        return self.prepared.tokenizer

    @property
    def num_params(self) -> int:
        """Every weight of the model (with LoRA: base and adapters)."""
        return self.weights.num_params

    @property
    def trainable_params(self) -> int:
        return self.weights.trainable_params

    @property
    def steps_per_epoch(self) -> int:
        return self.data.steps_per_epoch

    @property
    def total_steps(self) -> int:
        return self.data.total_steps

    @property
    def data_stats(self) -> dict[str, Any]:
        return self.data.stats

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.config.model.compute_dtype)

    def inference_params(self, dtype: Any = None) -> Any:
        """The current weights as an ordinary gemma params tree for ``base_model`` (with LoRA:
        the adapters merged into the base, in ``dtype``, default the master dtype)."""
        lora_config = self.config.lora
        return self.weights.inference_params(lora.scale(lora_config.rank, lora_config.alpha),
                                             self.config.model.param_dtype, self.model, dtype)

    def sample(self, prompts: str | list[str], *, chat: bool | None = None, **kwargs: Any
               ) -> sampling.Continuation | list[sampling.Continuation]:
        """Continue one prompt or several with the current weights (greedy by default).

        ``chat`` (default: whether the run trains on instruction/chat data) sends each prompt
        as a user turn in Gemma's chat template; the reply stops at ``<end_of_turn>``.
        """
        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if self.data_stats.get("data_format") in CONVERSATIONAL if chat is None else chat:
            markers = self.prepared.tokenizer_info.turn_markers
            prompts = [chat_template.user_prompt(p, markers) for p in prompts]
        # LoRA: merged straight into the compute dtype sampling runs in (no master-size copy).
        continuations = sampling.continue_prompts(
            self.base_model, self.inference_params(self.compute_dtype), self.tokenizer, prompts,
            compute_dtype=self.compute_dtype, **kwargs)
        if self.tensorboard is not None:  # at the step the weights are at: before or after
            step = self.history[-1]["step"] if self.history else self.weights.start_step
            self.tensorboard.samples(step, continuations)
        return continuations[0] if single else continuations

    # -----------------------------------------------------------------------------------------
    # The steps.

    def compile(self) -> Any:
        """Compile the state-donating step for this run's batch shape, once (``train`` calls it
        before the clock of the first step starts): ``state, metrics = train_step(state, batch,
        frozen)``. Compiled ahead of any batch, so the compile's seconds and XLA's FLOP count of
        the step are recorded."""
        if self.train_step is not None:
            return self.train_step
        weights, cfg = self.weights, self.config
        step = optimization.make_train_step(self.model, self.optimizer, self.schedule,
                                            self.compute_dtype, self.mesh,
                                            weights.state_shardings,
                                            grad_accum_steps=cfg.trainer.grad_accum_steps,
                                            skip_nonfinite=cfg.trainer.skip_nonfinite,
                                            frozen_shardings=weights.frozen_shardings,
                                            preference_settings=self.preference)
        started = time.perf_counter()
        rows = jax.ShapeDtypeStruct((cfg.trainer.batch_size, cfg.data.maxlen), jnp.int32,
                                    sharding=mesh.batch_sharding(self.mesh))
        batch = {name: rows for name in packing.FIELDS}
        self.train_step = step.lower(weights.state, batch, weights.frozen).compile()
        self.startup.record("compile", time.perf_counter() - started)
        self.flops.record_compiled(self.train_step)
        return self.train_step

    def next_batch(self) -> dict[str, Any]:
        """The next global batch, placed on the mesh (this process supplies its rows).

        ``batch_digest`` becomes a CRC32 of this process's token rows: metrics.jsonl records it
        per step, so two runs (e.g. one resumed, one not) can be shown to read the same data.
        """
        local = next(self.data.train_iterator)
        self.batch_digest = zlib.crc32(np.ascontiguousarray(local["tokens"]).tobytes())
        return mesh.global_batch(local, self.mesh)

    def evaluate(self) -> dict[str, float]:
        """Eval loss and perplexity (DPO: and the pairs' means) over the whole held-out split."""
        return optimization.evaluate(self.eval_step, self.weights.state.params,
                                     self.data.eval_batches, self.mesh, self.weights.frozen)

    # -----------------------------------------------------------------------------------------
    # The loop.

    def train(self, *, progress: bool = True) -> dict[str, Any]:
        """Run the steps from the start step to ``total_steps`` with periodic eval and
        checkpoints; write metrics and ``summary.json``. SIGTERM: save, then ``Preempted``."""
        cfg, weights = self.config, self.weights
        start_step = weights.start_step
        sink = metrics.MetricsSink(cfg.runtime.output_dir, enabled=self.is_main_process,
                                   resume_step=start_step or None, tensorboard=self.tensorboard)
        log = metrics.StepLog(
            sink,
            total_steps=self.total_steps,
            start_step=start_step,
            steps_per_epoch=self.steps_per_epoch,
            tokens_per_step=cfg.trainer.batch_size * cfg.data.maxlen,
            log_every=cfg.metrics.log_every,
            show=progress and self.is_main_process,
            nonfinite=self._diverged,
            flops_per_step=self.flops.model_flops_per_step,
            peak_flops_per_s=self.flops.peak_flops_per_s,
            host_peak_flops_per_s=self.flops.host_peak_flops_per_s,
            wait_for_each_step=mesh.platform(self.mesh) == "cpu",
        )
        self.history, self.eval_history = log.history, log.eval_history
        train_step = self.compile()  # now, before the clock of the first step starts
        # Decided by the step, not by file contents: every process must take the same branch
        # (evaluation is collective).
        if start_step == 0:
            eval_started = time.perf_counter()
            initial_eval = self._record_eval(0, log)
            self.startup.record("initial_eval", time.perf_counter() - eval_started)
        else:
            initial_eval = next((r for r in log.eval_history if r["step"] == 0),
                                {"step": 0, "eval_loss": float("nan"),
                                 "eval_perplexity": float("nan")})
        started = time.perf_counter()
        with StopRequest() as stop:
            for step in range(start_step + 1, self.total_steps + 1):
                wait_started = time.perf_counter()
                batch = self.next_batch()
                data_wait = time.perf_counter() - wait_started
                weights.state, step_metrics = train_step(weights.state, batch, weights.frozen)
                # One process: every step; several: a collective, so every log_every steps.
                stopping = ((jax.process_count() == 1 or step % cfg.metrics.log_every == 0)
                            and stop.agreed())
                saving = stopping or (cfg.checkpoints.every
                                      and step % cfg.checkpoints.every == 0)
                # A step a checkpoint claims has its row written first (durable).
                log.step(step, step_metrics, data_wait, self.batch_digest, durable=saving)
                if saving:
                    self._save_checkpoint(step)
                if stopping:
                    self.checkpoints.wait()
                    log.close()
                    raise Preempted(step, f"{self.checkpoints.directory}/{step}")
                if (cfg.metrics.eval_every and step % cfg.metrics.eval_every == 0
                        and step < self.total_steps):
                    self._record_eval(step, log)
        final_eval = self._record_eval(self.total_steps, log)  # the last step's row first
        train_seconds = (log.steps_ended or started) - started
        self.checkpoints.wait()
        if self.total_steps not in self.checkpoints.steps():
            self._save_checkpoint(self.total_steps)
            self.checkpoints.wait()
        self.summary = self._summary(initial_eval, final_eval, train_seconds)
        sink.write_json("summary.json", self.summary)
        log.close()
        return self.summary

    def _record_eval(self, step: int, log: metrics.StepLog) -> dict[str, Any]:
        return log.evaluation(step, self.evaluate)  # run once the last step is timed

    def _save_checkpoint(self, step: int) -> None:
        started = time.perf_counter()
        self.checkpoints.save(step, self.weights.state, self.data.train_iterator)
        self.checkpoint_seconds.append(time.perf_counter() - started)

    def _diverged(self, step: int, values: dict[str, float]) -> TrainingDiverged:
        saved = [s for s in self.checkpoints.steps() if s < step]
        where = (f"the last good checkpoint is {self.checkpoints.directory}/{saved[-1]} "
                 "(a restart resumes there)" if saved else "no checkpoint was saved before it")
        return TrainingDiverged(
            f"loss {values['loss']} and gradient norm {values['grad_norm']} at step {step}; "
            f"{where}. Fix: lower learning_rate, check the data, or set skip_nonfinite=True")

    def _summary(self, initial_eval: dict, final_eval: dict, train_seconds: float
                 ) -> dict[str, Any]:
        # Not the first step of the run, nor that of a resumption (each pays for warming up).
        steady = [r for r in self.history[1:] if not r.get(metrics.ATTEMPT_START)] or self.history
        steady_time = sum(r["step_time_s"] for r in steady)
        useful = sum(r["useful_tokens"] for r in steady)
        tokens = sum(r["tokens"] for r in steady)
        last = self.history[-FINAL_LOSS_WINDOW:]
        return {
            "steps": len(self.history),
            "steps_per_epoch": self.steps_per_epoch,
            "initial_train_loss": self.history[0]["loss"],
            "final_train_loss": float(np.mean([r["loss"] for r in last])),
            "initial_eval_loss": initial_eval["eval_loss"],
            "final_eval_loss": final_eval["eval_loss"],
            "initial_eval_perplexity": initial_eval["eval_perplexity"],
            "final_eval_perplexity": final_eval["eval_perplexity"],
            "objective": self.config.trainer.objective,
            # DPO: the held-out pairs' means (reward accuracy, margin, KL estimate, ...)
            **{f"{when}_{name}": record[name]
               for when, record in (("initial", initial_eval), ("final", final_eval))
               for name in record if name.startswith("eval_")
               and name not in ("eval_loss", "eval_perplexity")},
            "useful_tokens_per_s": useful / steady_time,
            "tokens_per_s": tokens / steady_time,
            "useful_token_share": useful / tokens,
            "mean_step_time_s": steady_time / len(steady),
            "data_wait_share": sum(r["data_wait_s"] for r in steady) / steady_time,
            "skipped_steps": int(sum(r.get("skipped", 0) for r in self.history)),
            "resumed_from_step": self.weights.start_step,
            "checkpoints_saved": len(self.checkpoint_seconds),
            "checkpoint_blocking_s": float(np.mean(self.checkpoint_seconds or [0.0])),
            "first_step_seconds": self.history[0]["step_time_s"],
            "train_seconds": train_seconds,
            **self.flops.summary(len(steady), steady_time),
            "startup": self.startup.summary(self.history, self.weights.start_step),
            "num_params": self.num_params,
            "trainable_params": self.trainable_params,
            "lora_token_ids": list(lora.token_ids(self.model)),
            "peak_host_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "mesh": mesh.mesh_shape(self.mesh),
            **self.weights.bytes_per_device(),
            # The analytic plan beside what the runtime saw (TPU/GPU report a peak; CPUs don't).
            "planned_bytes_per_device": self.memory_plan.per_device_bytes,
            "peak_device_bytes": peak_device_bytes(),
            "processes": jax.process_count(),
            "checkpoint": self.checkpoint_name,
            "tokenizer_vocab_size": self.prepared.tokenizer_info.vocab_size,
            "data": self.data_stats,
            "params": self.config.to_dict(),
            "resolved": self.resolved,
            "model_config": presets.config_to_dict(self.prepared.model_config),
        }

    # -----------------------------------------------------------------------------------------
    def save(self) -> str:
        """Write the final (master-dtype) params to ``output_dir/params`` and the tokenizer
        beside them (``tokenizer.model``: what an HF export ships); every process calls.

        With LoRA these are the merged weights (an ordinary gemma tree, what sampling and
        ``gm.ckpts.load_params`` read), and the adapters alone go to ``output_dir/adapters``.
        """
        path = f"{self.config.runtime.output_dir}/params"
        orbax_params.save_params(self.inference_params(), path)
        if self.weights.adapted:
            orbax_params.save_params(self.weights.state.params,
                                     f"{self.config.runtime.output_dir}/adapters")
        if self.is_main_process:
            storage.write_bytes(f"{self.config.runtime.output_dir}/{TOKENIZER_FILE}",
                                self.prepared.tokenizer_info.model_proto)
        return path


def _preference(objective: str, data_path: str, dpo: DPOConfig, adapters: bool, base_model: Any,
                data: TrainingData) -> optimization.Preference | None:
    """DPO's settings for the steps; None for SFT."""
    if objective != "dpo":
        return None
    if data.max_segments < 2:  # a cache of other data: no pair would ever count
        raise ConfigError("data_path", f"{data_path} was read without preference pairs",
                          "give objective='dpo' a preference JSONL file")
    return optimization.Preference.of(dpo, base_model, data.max_segments,
                                      adapters=adapters)
