"""A fine-tuning run from config to saved params: what ``notebooks/train.ipynb`` drives.

``Experiment.prepare`` does every check that can fail on bad input before anything expensive
(tokenization, weight loading, compilation); ``train`` runs the loop; ``save`` writes the params.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab import (
    checkpoints,
    compile_cache,
    data,
    lora,
    mesh,
    metrics,
    models,
    plan,
    sampling,
    sharding,
    storage,
    training,
)
from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError, TrainingDiverged
from gemmalab.preemption import Preempted, StopRequest
from gemmalab.weights import sources

FINAL_LOSS_WINDOW = 10


@dataclasses.dataclass
class Experiment:
    config: TrainConfig
    mesh: Any
    tokenizer: Any
    tokenizer_info: Any
    model_config: Any
    model: Any
    state: training.TrainState
    state_shardings: training.TrainState
    optimizer: Any
    schedule: Any
    compute_dtype: Any
    train_iterator: Any
    eval_batches: list[dict[str, np.ndarray]]
    total_steps: int
    steps_per_epoch: int
    data_stats: dict[str, Any]
    checkpoint_name: str
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eval_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    memory_plan: plan.MemoryPlan | None = None
    checkpoints: checkpoints.TrainCheckpoints | None = None
    start_step: int = 0  # > 0 when resumed from a checkpoint
    batch_digest: int = 0  # CRC32 of the last batch's local token rows
    checkpoint_seconds: list[float] = dataclasses.field(default_factory=list)  # blocking saves
    # LoRA (lora_rank > 0): ``model`` is the adapted model, ``state.params`` its adapters and
    # ``frozen_params`` the base weights (compute dtype) of ``base_model``.
    base_model: Any = None
    frozen_params: Any = None
    frozen_shardings: Any = None
    # Seconds spent before the first step, by phase (summary.json's "startup").
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    compiled_flops_per_step: float | None = None  # XLA's count for the compiled step

    # -----------------------------------------------------------------------------------------
    @classmethod
    def prepare(cls, config: TrainConfig) -> Experiment:
        """Validate everything, build data, tokenizer, model and state; compile nothing yet."""
        started = time.perf_counter()
        startup = {"before_prepare_s": _seconds_since_process_start(),
                   "prepare_started_at": time.time()}
        # First, so every compile of the run (init, steps, sampler) is read from or written to it.
        compile_cache.enable(config.resolved_cache_dir)
        device_mesh = mesh.make_mesh(config.mesh, num_slices=config.num_slices)
        mesh.check_batch_size(config.batch_size, device_mesh, config.grad_accum_steps)
        if storage.is_gcs(config.output_dir):
            storage.require_gcs_credentials("output_dir", config.output_dir)
        checkpoint = sources.resolve(config.checkpoint, config.model, config.resolved_cache_dir)
        # Refused here, before the data is tokenized and the weights loaded.
        devices = plan.attached_accelerator(list(device_mesh.devices.flat))
        memory_plan = (plan.require_fits if config.check_memory else plan.estimate)(config, devices)
        previous = _previous_run(config)
        # One checkpoint (trained weights and AdamW's two moments) and the final params.
        state_bytes = ((3 * memory_plan.trainable_params + memory_plan.num_params)
                       * jnp.dtype(config.param_dtype).itemsize)
        if jax.process_index() == 0:
            checkpoints.require_writable_room(config.output_dir, state_bytes)
        startup["checks_s"] = time.perf_counter() - started
        prepared = prepare_data(config)
        cache, corpus, info, tokenizer = (prepared.cache, prepared.corpus, prepared.tokenizer_info,
                                          prepared.tokenizer)
        model_config = prepared.model_config
        windows = data.WindowSource(cache.train, config.maxlen)
        fill = data.packed_fill(windows, seed=config.seed) if config.packing else 1.0
        # Every process must count the same steps: totals and the mean fill of all shards.
        local = np.asarray([windows.num_targets, len(windows), round(fill * 1e6)], np.int64)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = np.asarray(multihost_utils.process_allgather(local)).reshape(-1, 3)
            local = np.asarray([*local[:, :2].sum(0), local[:, 2].mean()])
        per_epoch = data.steps_per_epoch(int(local[0]), int(local[1]),
                                         batch_size=config.batch_size, maxlen=config.maxlen,
                                         packing=config.packing, fill=float(local[2]) / 1e6)
        total_steps = (config.max_steps if config.max_steps is not None
                       else per_epoch * config.num_epochs)

        rows_per_process = config.batch_size // jax.process_count()
        iterator = data.train_batches(cache.train, maxlen=config.maxlen,
                                      rows_per_process=rows_per_process, packing=config.packing,
                                      seed=config.seed)
        evals = data.eval_batches(cache.eval, maxlen=config.maxlen, batch_size=config.batch_size,
                                  packing=config.packing, process_index=jax.process_index(),
                                  process_count=jax.process_count())
        stats = {"tokenizer": info.name, **data.data_stats(corpus, cache, windows),
                 "packed_fill": round(fill, 4)}

        startup["data_s"] = time.perf_counter() - started - startup["checks_s"]
        param_dtype = jnp.dtype(config.param_dtype)
        base_model = models.build_model(model_config, param_dtype=param_dtype, remat=config.remat,
                                        attention=config.attention, mesh=device_mesh)
        token_ids = trained_token_ids(config, info, chat=corpus.format == data.CHAT)
        model = (lora.wrap(base_model, rank=config.lora_rank, alpha=config.lora_alpha,
                           modules=config.lora_modules, dtype=param_dtype, token_ids=token_ids)
                 if config.lora_rank else base_model)
        peak_lr = config.learning_rate or models.default_learning_rate(config.model,
                                                                       lora=config.lora_rank > 0)
        schedule = training.learning_rate_schedule(peak_lr, total_steps,
                                                   warmup_ratio=config.warmup_ratio,
                                                   min_lr_ratio=config.min_lr_ratio)
        optimizer = training.make_optimizer(schedule, weight_decay=config.weight_decay,
                                            b1=config.adam_b1, b2=config.adam_b2,
                                            max_grad_norm=config.max_grad_norm)
        saved = checkpoints.TrainCheckpoints(config.output_dir, keep=config.keep_checkpoints)
        start_step, state, shardings = _restored_or_initial_state(
            config, base_model, optimizer, device_mesh, checkpoint, saved, iterator,
            resume=previous is not None, token_rows=len(token_ids))
        frozen, frozen_shardings = None, None
        if config.lora_rank:
            frozen, frozen_shardings = _frozen_base(config, base_model, checkpoint, device_mesh)
        jax.block_until_ready((state, frozen))
        startup["model_s"] = (time.perf_counter() - started - startup["checks_s"]
                              - startup["data_s"])
        return cls(config=config, mesh=device_mesh, tokenizer=tokenizer, tokenizer_info=info,
                   model_config=model_config, model=model, base_model=base_model,
                   frozen_params=frozen, frozen_shardings=frozen_shardings, state=state,
                   state_shardings=shardings, optimizer=optimizer,
                   schedule=schedule, compute_dtype=jnp.dtype(config.compute_dtype),
                   train_iterator=iterator, eval_batches=evals, total_steps=total_steps,
                   steps_per_epoch=per_epoch, data_stats=stats, checkpoint_name=checkpoint.name,
                   memory_plan=memory_plan, checkpoints=saved, start_step=start_step,
                   startup=startup)

    # -----------------------------------------------------------------------------------------
    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    @property
    def num_params(self) -> int:
        """Every weight of the model (with LoRA: base and adapters)."""
        return self.trainable_params + models.parameter_count(self.frozen_params or {})

    @property
    def trainable_params(self) -> int:
        return models.parameter_count(self.state.params)

    def inference_params(self, dtype: Any = None) -> Any:
        """The current weights as an ordinary gemma params tree for ``base_model`` (with LoRA:
        the adapters merged into the base, in ``dtype``, default the master dtype)."""
        if self.frozen_params is None:
            return self.state.params
        return lora.merge(self.frozen_params, self.state.params,
                          lora.scale(self.config.lora_rank, self.config.lora_alpha),
                          dtype=dtype or jnp.dtype(self.config.param_dtype),
                          token_ids=lora.token_ids(self.model))

    def sample(self, prompts: str | list[str], *, chat: bool | None = None, **kwargs: Any
               ) -> sampling.Continuation | list[sampling.Continuation]:
        """Continue one prompt or several with the current weights (greedy by default).

        ``chat`` (default: whether the run trains on instruction/chat data) sends each prompt
        as a user turn in Gemma's chat template; the reply stops at ``<end_of_turn>``.
        """
        from gemmalab import chat as chat_template

        single = isinstance(prompts, str)
        prompts = [prompts] if single else list(prompts)
        if self.data_stats.get("data_format") == data.CHAT if chat is None else chat:
            prompts = [chat_template.user_prompt(p) for p in prompts]
        # LoRA: merged straight into the compute dtype sampling runs in (no master-size copy).
        continuations = sampling.continue_prompts(
            self.base_model, self.inference_params(self.compute_dtype), self.tokenizer, prompts,
            compute_dtype=self.compute_dtype, **kwargs)
        return continuations[0] if single else continuations

    @functools.cached_property
    def train_step(self) -> Any:
        """The state-donating step, compiled (on first use) for this run's batch shape:
        ``state, metrics = train_step(state, batch, frozen_params)``. Compiled ahead of any
        batch, so the compile's seconds and XLA's FLOP count of the step are recorded."""
        step = training.make_train_step(self.model, self.optimizer, self.schedule,
                                        self.compute_dtype, self.mesh, self.state_shardings,
                                        grad_accum_steps=self.config.grad_accum_steps,
                                        skip_nonfinite=self.config.skip_nonfinite,
                                        frozen_shardings=self.frozen_shardings)
        started = time.perf_counter()
        rows = jax.ShapeDtypeStruct((self.config.batch_size, self.config.maxlen), jnp.int32,
                                    sharding=mesh.batch_sharding(self.mesh))
        batch = {name: rows for name in data.BATCH_FIELDS}
        compiled = step.lower(self.state, batch, self.frozen_params).compile()
        self.startup["compile_s"] = time.perf_counter() - started
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        # One device's program: the step's FLOPs are every device's.
        self.compiled_flops_per_step = float((cost or {}).get("flops", 0.0)) * jax.device_count()
        return compiled

    @functools.cached_property
    def model_flops_per_step(self) -> float:
        """The step's model FLOPs (6 per weight per token plus attention; ``plan.model_flops``):
        what MFU is measured against."""
        adapters = self.trainable_params if self.frozen_params is not None else 0
        return plan.model_flops(self.model_config, self.num_params - adapters, self.config,
                                adapters=adapters)

    @functools.cached_property
    def peak_flops_per_s(self) -> float | None:
        """Dense bf16 peak of all the run's devices; None where unknown (CPUs)."""
        devices = plan.attached_accelerator(list(self.mesh.devices.flat))
        return devices.peak_flops * devices.chips if devices.peak_flops else None

    def next_batch(self) -> dict[str, Any]:
        """The next global batch, placed on the mesh (this process supplies its rows).

        ``batch_digest`` becomes a CRC32 of this process's token rows: metrics.jsonl records it
        per step, so two runs (e.g. one resumed, one not) can be shown to read the same data.
        """
        local = next(self.train_iterator)
        self.batch_digest = zlib.crc32(np.ascontiguousarray(local["tokens"]).tobytes())
        return mesh.global_batch(local, self.mesh)

    @functools.cached_property
    def eval_step(self) -> Any:
        return training.make_eval_step(self.model, self.compute_dtype, self.mesh,
                                       self.state_shardings.params, self.frozen_shardings)

    def evaluate(self) -> tuple[float, float]:
        """Eval loss and perplexity over the whole held-out split."""
        return training.evaluate(self.eval_step, self.state.params, self.eval_batches, self.mesh,
                                 self.frozen_params)

    def _save_checkpoint(self, step: int) -> None:
        started = time.perf_counter()
        self.checkpoints.save(step, self.state, self.train_iterator)
        self.checkpoint_seconds.append(time.perf_counter() - started)

    def _diverged(self, step: int, values: dict[str, float]) -> TrainingDiverged:
        saved = [s for s in self.checkpoints.steps() if s < step]
        where = (f"the last good checkpoint is {self.checkpoints.directory}/{saved[-1]} "
                 "(a restart resumes there)" if saved else "no checkpoint was saved before it")
        return TrainingDiverged(
            f"loss {values['loss']} and gradient norm {values['grad_norm']} at step {step}; "
            f"{where}. Fix: lower learning_rate, check the data, or set skip_nonfinite=True")

    def _record_eval(self, step: int, log: metrics.StepLog) -> dict[str, Any]:
        return log.evaluation(step, *self.evaluate())

    def train(self, *, progress: bool = True) -> dict[str, Any]:
        """Run the steps from ``start_step`` to ``total_steps`` with periodic eval and
        checkpoints; write metrics and ``summary.json``. SIGTERM: save, then ``Preempted``."""
        cfg = self.config
        sink = metrics.MetricsSink(cfg.output_dir, enabled=self.is_main_process,
                                   resume_step=self.start_step or None)
        log = metrics.StepLog(sink, total_steps=self.total_steps, start_step=self.start_step,
                              steps_per_epoch=self.steps_per_epoch,
                              tokens_per_step=cfg.batch_size * cfg.maxlen,
                              log_every=cfg.log_every, show=progress and self.is_main_process,
                              nonfinite=self._diverged, flops_per_step=self.model_flops_per_step,
                              peak_flops_per_s=self.peak_flops_per_s)
        self.history, self.eval_history = log.history, log.eval_history
        train_step = self.train_step  # compiled now, before the clock of the first step starts
        # Decided by the step, not by file contents: every process must take the same branch
        # (evaluation is collective).
        if self.start_step == 0:
            eval_started = time.perf_counter()
            initial_eval = self._record_eval(0, log)
            self.startup["initial_eval_s"] = time.perf_counter() - eval_started
        else:
            initial_eval = next((r for r in log.eval_history if r["step"] == 0),
                                {"step": 0, "eval_loss": float("nan"),
                                 "eval_perplexity": float("nan")})
        started = time.perf_counter()
        with StopRequest() as stop:
            for step in range(self.start_step + 1, self.total_steps + 1):
                wait_started = time.perf_counter()
                batch = self.next_batch()
                data_wait = time.perf_counter() - wait_started
                self.state, step_metrics = train_step(self.state, batch, self.frozen_params)
                log.step(step, step_metrics, data_wait, self.batch_digest)
                # One process: every step; several: a collective, so every log_every steps.
                stopping = ((jax.process_count() == 1 or step % cfg.log_every == 0)
                            and stop.agreed())
                if stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                    log.settle()  # the step's row is on disk before the checkpoint claims it
                    self._save_checkpoint(step)
                if stopping:
                    self.checkpoints.wait()
                    log.close()
                    raise Preempted(step, f"{self.checkpoints.directory}/{step}")
                if cfg.eval_every and step % cfg.eval_every == 0 and step < self.total_steps:
                    log.settle()
                    self._record_eval(step, log)
        log.settle()
        train_seconds = time.perf_counter() - started
        final_eval = self._record_eval(self.total_steps, log)
        self.checkpoints.wait()
        if self.total_steps not in self.checkpoints.steps():
            self._save_checkpoint(self.total_steps)
            self.checkpoints.wait()
        self.summary = self._summary(initial_eval, final_eval, train_seconds)
        sink.write_json("summary.json", self.summary)
        log.close()
        return self.summary

    def _summary(self, initial_eval: dict, final_eval: dict, train_seconds: float
                 ) -> dict[str, Any]:
        steady = self.history[1:] or self.history  # step 1 includes compilation
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
            "useful_tokens_per_s": useful / steady_time,
            "tokens_per_s": tokens / steady_time,
            "useful_token_share": useful / tokens,
            "mean_step_time_s": steady_time / len(steady),
            "data_wait_share": sum(r["data_wait_s"] for r in steady) / steady_time,
            "skipped_steps": int(sum(r.get("skipped", 0) for r in self.history)),
            "resumed_from_step": self.start_step,
            "checkpoints_saved": len(self.checkpoint_seconds),
            "checkpoint_blocking_s": float(np.mean(self.checkpoint_seconds or [0.0])),
            "first_step_seconds": self.history[0]["step_time_s"],
            "train_seconds": train_seconds,
            # Model FLOPs (plan.model_flops) against the devices' dense bf16 peak; XLA's own
            # count beside it as a cross-check (it misses loop bodies run more than once, and
            # counts what remat recomputes).
            "model_flops_per_step": self.model_flops_per_step,
            "compiled_flops_per_step": self.compiled_flops_per_step,
            "model_flops_per_s": self.model_flops_per_step * len(steady) / steady_time,
            "peak_flops_per_s": self.peak_flops_per_s,
            "mfu": (self.model_flops_per_step * len(steady) / steady_time / self.peak_flops_per_s
                    if self.peak_flops_per_s else None),
            "startup": self._startup_summary(),
            "num_params": self.num_params,
            "trainable_params": self.trainable_params,
            "lora_token_ids": list(lora.token_ids(self.model)),
            "peak_host_memory_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "mesh": mesh.mesh_shape(self.mesh),
            "params_bytes_per_device": (sharding.shard_bytes(self.state.params)
                                        + sharding.shard_bytes(self.frozen_params or {})),
            "optimizer_bytes_per_device": sharding.shard_bytes(self.state.opt_state),
            # The analytic plan beside what the runtime saw (TPU/GPU report a peak; CPUs don't).
            "planned_bytes_per_device": self.memory_plan.per_device_bytes,
            "peak_device_bytes": plan.peak_device_bytes(),
            "processes": jax.process_count(),
            "checkpoint": self.checkpoint_name,
            "tokenizer_vocab_size": self.tokenizer_info.vocab_size,
            "data": self.data_stats,
            "params": self.config.to_dict(),
            "model_config": models.config_to_dict(self.model_config),
        }

    def _startup_summary(self) -> dict[str, float | None]:
        """Seconds by phase until the end of the first training step (of this process)."""
        out = dict(self.startup)
        first = next((r for r in self.history if r["step"] == self.start_step + 1), None)
        before = out.get("before_prepare_s")
        started_at = out.pop("prepare_started_at", None)
        if first is not None and before is not None and started_at is not None:
            out["to_first_step_s"] = before + first["time"] - started_at
        return out

    def save(self) -> str:
        """Write the final (master-dtype) params to ``output_dir/params``; every process calls.

        With LoRA these are the merged weights (an ordinary gemma tree, what sampling and
        ``gm.ckpts.load_params`` read), and the adapters alone go to ``output_dir/adapters``.
        """
        path = f"{self.config.output_dir}/params"
        checkpoints.save_params(self.inference_params(), path)
        if self.frozen_params is not None:
            checkpoints.save_params(self.state.params, f"{self.config.output_dir}/adapters")
        return path


def trained_token_ids(config: TrainConfig, info: Any, *, chat: bool) -> tuple[int, ...]:
    """The ids of ``lora_train_tokens`` (resolved: the chat turn tokens when LoRA fine-tunes a
    pretrained checkpoint on chat data); () without LoRA, where every embedding trains."""
    from gemmalab import tokenizer as tokenizers
    from gemmalab.config import CHAT_TURN_TOKENS

    if not config.lora_rank:
        return ()
    pieces = config.lora_train_tokens
    if pieces is None:
        pieces = list(CHAT_TURN_TOKENS) if chat and config.checkpoint else []
    ids = tokenizers.piece_ids(info, pieces)
    unknown = [piece for piece, i in zip(pieces, ids, strict=True) if i is None]
    if unknown:
        raise ConfigError("lora_train_tokens", f"{unknown} are not pieces of the tokenizer "
                          f"{info.name}", "name single tokens, e.g. ['<end_of_turn>'], or []")
    return tuple(sorted(set(ids)))


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """Corpus, tokenizer and token cache for a config: shared by training, data prep, sampling."""

    corpus: data.Corpus
    tokenizer: Any
    tokenizer_info: Any
    cache: data.TokenCache
    model_config: Any


def prepare_data(config: TrainConfig) -> PreparedData:
    """Validate the data and tokenizer parameters, then load or build the token cache.

    A second call with the same data parameters (e.g. data_prep.ipynb then train.ipynb) reuses
    the cached tokenizer and tokens.
    """
    cache_dir = config.resolved_cache_dir
    corpus = data.resolve_corpus(config.data_path, cache_dir=cache_dir,
                                 embedded_stories=config.embedded_stories, seed=config.seed,
                                 skip_bad_records=config.skip_bad_records)
    rule = data.SplitRule(config.eval_fraction, config.max_eval_stories,
                          jax.process_index(), jax.process_count())
    tokenizer, info = _load_tokenizer_everywhere(config, corpus, rule)
    model_config = models.model_config(config.model, info.vocab_size)
    if info.vocab_size > model_config.num_embed:
        raise ConfigError("tokenizer", f"its vocabulary ({info.vocab_size}) is larger than "
                          f"{config.model}'s embedding ({model_config.num_embed})",
                          "use the model's own tokenizer ('gemma3') or model='gemma3-tiny'")
    cache = data.load_or_build_token_cache(
        corpus, info, rule=rule, datacount=config.datacount, cache_dir=cache_dir,
        workers=config.tokenize_workers, train_on_prompt=config.train_on_prompt)
    return PreparedData(corpus=corpus, tokenizer=tokenizer, tokenizer_info=info, cache=cache,
                        model_config=model_config)


def _load_tokenizer_everywhere(config: TrainConfig, corpus: data.Corpus, rule: data.SplitRule
                               ) -> tuple[Any, Any]:
    """Load (or train, on process 0 only, then share) the tokenizer."""
    from gemmalab import tokenizer as tokenizers

    def load(stories_allowed: bool):
        stories = (data.training_stories(corpus.path, rule, config.datacount)
                   if stories_allowed else None)
        return tokenizers.load_tokenizer(
            config.tokenizer, cache_dir=config.resolved_cache_dir, training_stories=stories,
            vocab_size=config.tokenizer_vocab_size, corpus_fingerprint=corpus.fingerprint)

    if config.tokenizer != "local" or jax.process_count() == 1:
        return load(True)
    # Several processes: one trains, the others receive the identical model over JAX's runtime.
    from jax.experimental import multihost_utils

    proto = load(True)[1].model_proto if jax.process_index() == 0 else b""
    size = int(multihost_utils.broadcast_one_to_all(np.int64(len(proto))))
    buffer = np.frombuffer(proto.ljust(size, b"\0"), np.uint8)
    proto = bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer)))
    path = tokenizers.local_tokenizer_path(config.resolved_cache_dir, corpus.fingerprint,
                                           config.tokenizer_vocab_size)
    if jax.process_index() != 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(proto)
    multihost_utils.sync_global_devices("gemmalab-tokenizer")
    return load(False)


def _seconds_since_process_start() -> float | None:
    """How long this Python process (e.g. the notebook's kernel) ran before now."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a figure for the summary, never worth failing a run
        return None


def _resume_values(config: TrainConfig) -> dict[str, Any]:
    return {**config.to_dict(), "processes": jax.process_count()}


def _previous_run(config: TrainConfig) -> dict[str, Any] | None:
    """The checkpointed run in ``output_dir`` that this one continues, checked to match."""
    stored = checkpoints.stored_config(config.output_dir)
    if stored is not None and not config.resume:
        raise ConfigError("resume", f"{config.output_dir} holds the checkpoints of an earlier "
                          "run", "use resume=True to continue it, or a new output_dir")
    if stored is None and not config.resume and not checkpoints.is_empty_dir(config.output_dir):
        raise ConfigError("resume", f"resume=False but {config.output_dir} is not empty",
                          "use a new or empty output_dir")
    if stored is not None:
        checkpoints.check_resumable(_resume_values(config), stored, config.output_dir)
    return stored


def _restored_or_initial_state(config: TrainConfig, base_model: Any, optimizer: Any,
                               device_mesh: Any, checkpoint: sources.ResolvedCheckpoint,
                               saved: checkpoints.TrainCheckpoints, iterator: Any, *, resume: bool,
                               token_rows: int = 0
                               ) -> tuple[int, training.TrainState, training.TrainState]:
    """``(start step, state, its shardings)``: the newest readable checkpoint restored straight
    into its shards (and ``iterator`` moved to its data position), else the initial weights
    (with LoRA: fresh adapters; the base weights are not part of the state)."""
    param_dtype = jnp.dtype(config.param_dtype)
    # The same abstract trees the memory plan traced (cached per model config).
    expected = (plan.adapter_params(base_model.config, config, token_rows) if config.lora_rank
                else plan.abstract_params(base_model.config, config.param_dtype))
    shardings = training.state_sharding(expected, optimizer, device_mesh)
    abstract = training.abstract_state(expected, optimizer, shardings)
    restored = saved.restore_latest(abstract, iterator) if resume else None
    if restored:
        if jax.process_index() == 0:
            print(f"resumed from step {restored[0]} ({saved.directory}/{restored[0]})")
        return restored[0], restored[1], shardings
    if config.lora_rank:
        params = lora.init_adapters(base_model.config, rank=config.lora_rank,
                                    modules=config.lora_modules, dtype=config.param_dtype,
                                    seed=config.seed + 1, shardings=shardings.params,
                                    token_rows=token_rows)
    else:
        params = _initial_params(base_model, checkpoint, config, param_dtype, device_mesh,
                                 expected)
    state, _ = training.init_state(params, optimizer, device_mesh)
    if jax.process_index() == 0:
        checkpoints.write_config(config.output_dir, _resume_values(config))
    return 0, state, shardings


def _frozen_base(config: TrainConfig, base_model: Any, checkpoint: sources.ResolvedCheckpoint,
                 device_mesh: Any) -> tuple[Any, Any]:
    """LoRA's base weights in the compute dtype, read (or drawn from ``seed``) into their
    shards; the same on a resume, so they are never checkpointed. Returns (weights, shardings)."""
    expected = plan.abstract_params(base_model.config, config.param_dtype)
    compute_dtype = jnp.dtype(config.compute_dtype)
    params = _initial_params(base_model, checkpoint, config, compute_dtype, device_mesh, expected)
    params = jax.tree.map(lambda p: p.astype(compute_dtype), params)  # random init: master dtype
    return params, sharding.param_sharding(params, device_mesh)


def _initial_params(model: Any, checkpoint: sources.ResolvedCheckpoint, config: TrainConfig,
                    param_dtype: Any, device_mesh: Any, expected: Any) -> Any:
    """Initial weights, created or read directly into their shards on ``device_mesh``
    (``expected``: the params' abstract tree)."""
    shardings = sharding.param_sharding(expected, device_mesh)
    if not checkpoint.path:
        return models.init_params(model, seed=config.seed, sample_length=config.maxlen,
                                  shardings=shardings)
    mismatch = ConfigError("checkpoint", f"{checkpoint.name} does not match {config.model}'s "
                           "parameter shapes", "pick the checkpoint made for this model")
    target = jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, param_dtype,
                                                                   sharding=where),
                          expected, shardings)
    try:
        loaded = sources.load(checkpoint, target,
                              text_only=models.PRESETS[config.model].multimodal,
                              progress=jax.process_index() == 0)
    except (ValueError, KeyError) as error:  # the checkpoint's tree does not fit the model's
        raise mismatch from error
    if jax.tree.structure(loaded) != jax.tree.structure(expected) or any(
            a.shape != b.shape for a, b in zip(jax.tree.leaves(loaded),
                                               jax.tree.leaves(expected), strict=True)):
        raise mismatch
    return jax.tree.map(lambda p: p.astype(param_dtype), loaded)
