"""The run's weights: what it trains and what it holds still, each with its shardings.

``TrainWeights`` is one object for both: ``state`` (the ``TrainState``: trainable params and the
optimizer's moments, what a checkpoint saves) and ``frozen``: the weights the steps read but
never update and a checkpoint never saves (read again on a resume). With LoRA that is the base
in the compute dtype (also DPO's reference, with the adapters off); in full fine-tuning DPO, the
starting weights in the compute dtype, the reference; else None. ``restore_or_init`` builds it,
straight into the shards of the mesh: from the newest checkpoint of the run, else from the
configured base (or random init).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab.config import LoRAConfig
from gemmalab.data import tokenizer as tokenizers
from gemmalab.errors import ConfigError
from gemmalab.model import lora, presets, quantization, sharding
from gemmalab.plan import shapes
from gemmalab.train import checkpoints, optimization
from gemmalab.weights import sources


@dataclasses.dataclass
class TrainWeights:
    """``state`` and its shardings; ``frozen`` (LoRA's base, or full fine-tuning DPO's
    reference; else None) and its shardings; ``adapted``: ``state`` holds LoRA adapters over
    ``frozen``. ``start_step`` > 0 when the state was restored from a checkpoint."""

    state: optimization.TrainState
    state_shardings: optimization.TrainState
    frozen: Any = None
    frozen_shardings: Any = None
    adapted: bool = False
    start_step: int = 0

    @property
    def trainable_params(self) -> int:
        return presets.parameter_count(self.state.params)

    @property
    def adapter_params(self) -> int:
        """LoRA's share of the model's weights (0 without)."""
        return self.trainable_params if self.adapted else 0

    @property
    def num_params(self) -> int:
        """Every weight of the model (with LoRA: base and adapters; not DPO's reference)."""
        base = presets.parameter_count(self.frozen) if self.adapted else 0
        return self.trainable_params + base

    def inference_params(self, lora_scale: float, param_dtype: Any, model: Any,
                         dtype: Any = None) -> Any:
        """An ordinary gemma params tree of the base model (with LoRA: the adapters of ``model``
        merged into the base with ``lora_scale``, in ``dtype``, default ``param_dtype``)."""
        if not self.adapted:
            return self.state.params
        return lora.merge(self.frozen, self.state.params, lora_scale,
                          dtype=dtype or jnp.dtype(param_dtype), token_ids=lora.token_ids(model))

    def bytes_per_device(self) -> dict[str, int]:
        """summary.json's "params_bytes_per_device" and "optimizer_bytes_per_device"."""
        return {"params_bytes_per_device": (sharding.shard_bytes(self.state.params)
                                            + sharding.shard_bytes(self.frozen or {})),
                "optimizer_bytes_per_device": sharding.shard_bytes(self.state.opt_state)}


@dataclasses.dataclass(frozen=True)
class StartingWeights:
    """The weights a run starts from: ``checkpoint``'s (``preset``'s shapes), read straight into
    their shards, or with none (``checkpoint.path`` empty) ``model``'s random init from ``seed``,
    traced on rows of ``sample_length``."""

    model: Any  # the base gemma model (LoRA's adapters are not part of it)
    checkpoint: sources.ResolvedCheckpoint
    preset: str
    seed: int
    sample_length: int

    def read(self, dtype: Any, device_mesh: Any, expected: Any) -> Any:
        """The weights in ``dtype``, created or read directly into their shards on
        ``device_mesh`` (``expected``: the params' abstract tree)."""
        shardings = sharding.param_sharding(expected, device_mesh)
        if not self.checkpoint.path:
            return presets.init_params(self.model, seed=self.seed,
                                       sample_length=self.sample_length, shardings=shardings)
        mismatch = ConfigError(
            "checkpoint",
            f"{self.checkpoint.name} does not match {self.preset}'s parameter shapes",
            "pick the checkpoint made for this model",
        )
        target = jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, dtype,
                                                                       sharding=where),
                              expected, shardings)
        try:
            loaded = sources.load(self.checkpoint, target,
                                  text_only=presets.PRESETS[self.preset].multimodal,
                                  progress=jax.process_index() == 0)
        except (ValueError, KeyError) as error:  # the checkpoint's tree does not fit the model's
            raise mismatch from error
        if jax.tree.structure(loaded) != jax.tree.structure(expected) or any(
                a.shape != b.shape for a, b in zip(jax.tree.leaves(loaded),
                                                   jax.tree.leaves(expected), strict=True)):
            raise mismatch
        return jax.tree.map(lambda p: p.astype(dtype), loaded)

    def frozen(self, param_dtype: str, compute_dtype: str, device_mesh: Any,
               base_quantization: str = "none") -> tuple[Any, Any]:
        """The starting weights in the compute dtype (LoRA's base, DPO's reference), read (or
        drawn from ``seed``) into their shards, with QLoRA's projections then quantized
        (``base_quantization``); the same on a resume (quantizing is deterministic), so they
        are never checkpointed. Returns (weights, shardings)."""
        expected = shapes.abstract_params(self.model.config, param_dtype)
        dtype = jnp.dtype(compute_dtype)
        params = self.read(dtype, device_mesh, expected)
        params = jax.tree.map(lambda p: p.astype(dtype), params)  # random init: master dtype
        params = quantization.quantize_base(params, base_quantization, dtype, device_mesh)
        return params, sharding.param_sharding(params, device_mesh)


def restore_or_init(starting: StartingWeights, lora_config: LoRAConfig, optimizer: Any,
                    device_mesh: Any, saved: checkpoints.TrainCheckpoints, iterator: Any, *,
                    param_dtype: str, compute_dtype: str, resume: bool, keep_frozen: bool,
                    token_rows: int = 0) -> TrainWeights:
    """The run's weights on ``device_mesh``: the state restored from ``saved`` (and
    ``iterator`` moved to its data position) when ``resume``, else initialised from
    ``starting`` (with LoRA: fresh adapters of ``token_rows`` embedding rows over it); and,
    with LoRA or ``keep_frozen`` (full fine-tuning DPO's reference), the starting weights read
    again into their shards, frozen, in ``compute_dtype``."""
    start_step, state, shardings = _restored_or_initial_state(
        starting, lora_config, optimizer, device_mesh, saved, iterator,
        param_dtype=param_dtype, resume=resume, token_rows=token_rows)
    weights = TrainWeights(state=state, state_shardings=shardings, start_step=start_step,
                           adapted=lora_config.enabled)
    if lora_config.enabled or keep_frozen:
        weights.frozen, weights.frozen_shardings = starting.frozen(
            param_dtype, compute_dtype, device_mesh, lora_config.base_quantization)
    return weights


def record_frozen_weights(weights: TrainWeights, *, output_dir: str, values: dict[str, Any],
                          previous: dict[str, Any] | None, checkpoint_name: str) -> None:
    """A new run writes its record beside its checkpoints: ``values``
    (``checkpoints.resume_values``) and the digest of its frozen weights, which are read again
    on a resume, not checkpointed. A resumed run's frozen weights must be those it started
    with (``previous``: the record of the run it continues)."""
    digest = {} if weights.frozen is None else {FROZEN_DIGEST: weights_digest(weights.frozen)}
    if weights.start_step == 0:
        if jax.process_index() == 0:
            checkpoints.write_config(output_dir, {**values, **digest})
        return
    before, now = (previous or {}).get(FROZEN_DIGEST), digest.get(FROZEN_DIGEST)
    if before is None or before == now:  # runs from before the record existed pass
        return
    role = "LoRA base" if weights.adapted else "DPO reference"
    raise ConfigError(
        "checkpoint",
        f"{checkpoint_name or 'the random init'} now holds other weights than when the run in "
        f"{output_dir} started (its {role}, not checkpointed, digest {now} against {before})",
        "put the original weights back at that path, or use a new output_dir to start over "
        "from these",
    )


# The train config's record of the frozen weights (LoRA's base, DPO's reference) a run started
# with: they are read again on a resume, not checkpointed, so a changed file would change them.
FROZEN_DIGEST = "held_weights_digest"  # (the key runs have recorded since it was added)


# Two odd multipliers a leaf (``weights_digest``), and the elements a host block sums at once.
DIGEST_MULTIPLIERS = ((0x9E3779B1, 1), (0x85EBCA77, 3))
DIGEST_BLOCK = 1 << 22


def weights_digest(tree: Any) -> str:
    """A digest of a (sharded) weight tree's exact bits, the same under any mesh or process
    count: for each leaf, ``sum(bits[i] * (i * m + c))`` over its flat index ``i``, for both
    ``(m, c)`` of ``DIGEST_MULTIPLIERS``, in wrapping uint32 (exact and order-free, unlike a
    float sum).

    Summed on the host, one distinct shard at a time in blocks of ``DIGEST_BLOCK`` elements:
    a replicated leaf is read once, not once a device, and the temporaries stay small (a
    jit-compiled sum held uint32 copies of the 270M's embedding on each of 8 CPU devices:
    10 GB). The processes' partial sums are added up."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    sums = np.stack([_leaf_sums(leaf) for _, leaf in leaves])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sums = np.sum(np.asarray(multihost_utils.process_allgather(sums)), axis=0,
                      dtype=np.uint32)
    digest = hashlib.sha256()
    for (path, leaf), pair in zip(leaves, sums, strict=True):
        digest.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape}:".encode())
        digest.update(pair.astype(np.uint32).tobytes())
    return digest.hexdigest()[:16]


def _leaf_sums(leaf: Any) -> np.ndarray:
    """``[2]`` uint32: this process's share of a leaf's two sums (``weights_digest``)."""
    shape = tuple(np.shape(leaf))
    if isinstance(leaf, jax.Array):
        shards = [(s.index, s.data) for s in leaf.addressable_shards if s.replica_id == 0]
    else:
        shards = [(tuple(slice(None) for _ in shape), leaf)]
    total = np.zeros(2, np.uint32)
    for index, data in shards:
        total += _block_sums(np.asarray(data), index, shape)
    return total


def _block_sums(data: np.ndarray, index: tuple[slice, ...], shape: tuple[int, ...]
                ) -> np.ndarray:
    """A shard's two sums, with each element's flat index in the whole leaf."""
    data = data.reshape(data.shape or (1,))
    shape = shape or (1,)
    starts = [s.indices(n)[0] if isinstance(s, slice) else 0
              for s, n in zip(index or (slice(None),) * len(shape), shape, strict=True)]
    strides = np.cumprod((1, *shape[:0:-1]))[::-1].astype(np.uint32)
    # The flat index of every element of one leading row, relative to that row's start.
    within = np.zeros(data.shape[1:], np.uint32)
    for axis in range(1, data.ndim):
        along = (starts[axis] + np.arange(data.shape[axis], dtype=np.uint32)) * strides[axis]
        within = within + along.reshape((-1,) + (1,) * (data.ndim - axis - 1))
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[data.dtype.itemsize]
    rows_per_block = max(1, DIGEST_BLOCK // max(within.size, 1))
    total = np.zeros(2, np.uint32)
    for first in range(0, data.shape[0], rows_per_block):
        rows = data[first:first + rows_per_block]
        bits = rows.view(unsigned).astype(np.uint32)
        row_starts = (starts[0] + first + np.arange(len(rows), dtype=np.uint32)) * strides[0]
        flat = row_starts.reshape((-1,) + (1,) * (data.ndim - 1)) + within
        total += np.array([np.sum(bits * (flat * np.uint32(multiplier) + np.uint32(offset)),
                                  dtype=np.uint32)
                           for multiplier, offset in DIGEST_MULTIPLIERS], np.uint32)
    return total


def trained_token_ids(lora_config: LoRAConfig, info: Any, *, chat: bool, pretrained: bool
                      ) -> tuple[int, ...]:
    """The ids of ``lora_config.train_tokens`` (resolved: the chat turn tokens when LoRA
    fine-tunes a ``pretrained`` checkpoint on ``chat`` data); () without LoRA, where every
    embedding trains."""
    if not lora_config.enabled:
        return ()
    pieces = lora_config.train_tokens
    if pieces is None:  # the tokenizer's turn pieces (Gemma 3's or Gemma 4's)
        markers = info.turn_markers if chat and pretrained else None
        pieces = [markers.start, markers.end] if markers else []
    ids = tokenizers.piece_ids(info, pieces)
    unknown = [piece for piece, i in zip(pieces, ids, strict=True) if i is None]
    if unknown:
        raise ConfigError("lora_train_tokens", f"{unknown} are not pieces of the tokenizer "
                          f"{info.name}", "name single tokens, e.g. ['<end_of_turn>'], or []")
    return tuple(sorted(set(ids)))


def _restored_or_initial_state(starting: StartingWeights, lora_config: LoRAConfig,
                               optimizer: Any, device_mesh: Any,
                               saved: checkpoints.TrainCheckpoints, iterator: Any, *,
                               param_dtype: str, resume: bool, token_rows: int = 0
                               ) -> tuple[int, optimization.TrainState, optimization.TrainState]:
    """``(start step, state, its shardings)``: the newest readable checkpoint restored straight
    into its shards (and ``iterator`` moved to its data position), else the initial weights
    (with LoRA: fresh adapters; the base weights are not part of the state)."""
    model_config = starting.model.config
    # The same abstract trees the memory plan traced (cached per model config).
    expected = (shapes.adapter_params(model_config, lora_config, param_dtype, token_rows)
                if lora_config.enabled else shapes.abstract_params(model_config, param_dtype))
    shardings = optimization.state_sharding(expected, optimizer, device_mesh)
    abstract = optimization.abstract_state(expected, optimizer, shardings)
    restored = saved.restore_latest(abstract, iterator) if resume else None
    if restored:
        if jax.process_index() == 0:
            print(f"resumed from step {restored[0]} ({saved.directory}/{restored[0]})")
        return restored[0], restored[1], shardings
    if lora_config.enabled:
        params = lora.init_adapters(model_config, rank=lora_config.rank,
                                    modules=lora_config.modules, dtype=param_dtype,
                                    seed=starting.seed + 1, shardings=shardings.params,
                                    token_rows=token_rows)
    else:
        params = starting.read(jnp.dtype(param_dtype), device_mesh, expected)
    state, _ = optimization.init_state(params, optimizer, device_mesh)
    return 0, state, shardings
