"""Attention at long maxlen: gemma's own, or a fused kernel in its place, same weights.

gemma's ``Attention`` materialises ``[B, L, N, L]`` scores and reads a ``[B, L, L]`` mask: at
maxlen >= 1024 they dominate the step's time and memory. Here the model stays gemma's (its
modules, parameter names and jit); ``transformer_class`` subclasses its Transformer so that,
when it runs without a KV cache, a flax method interceptor computes ``Attention.__call__`` with
``attend``: the module's own q/kv/output einsums (so LoRA's wrappers still apply), its q/k
RMSNorms, gemma's RoPE with the layer's base frequency and scale factor, the
``query_pre_attn_scalar`` and soft cap, then a kernel that takes segment ids and a causal
(global layers) or causal sliding-window (local layers) mask instead of a dense mask:

- ``"dot_product"``: ``jax.nn.dot_product_attention``, cuDNN's fused kernel on GPUs that accept
  the case (XLA's otherwise, e.g. on CPUs or in float32);
- ``"splash"``: the Pallas TPU splash-attention kernel (interpreted off TPUs: slow, for tests);
- ``"blocked"``: gemma's own arithmetic (its dtypes, mask value and softmax) on blocks of
  ``BLOCK_ROWS`` queries, each against only the keys it can see: those before its last row, and
  within the window on a local layer. A causal row of 512 computes 5/8 of gemma's scores, a
  local layer of 2,048 (window 512) 27% (``blocked_score_share``). On CPUs, where nothing is
  fused, that is the work saved (bench/attention_blocks.py).

``"auto"`` means splash on TPUs, dot_product on GPUs, blocked on CPUs.

The segment ids travel in gemma's ``attention_mask`` argument as a ``[B, L, 1]`` column marking
where each segment starts (``segment_starts``): it passes gemma's type checks, jit and remat
untouched, and the ``[B, L, L]`` mask is never built. Padding (segment 0) becomes a segment of
its own: real tokens never see it, and its own outputs bear no loss. A dense mask (the sampler,
``model.init``) or a KV cache sends the call to gemma's code as before.

The kernels' sliding window counts row indices where gemma's counts ``positions``: they agree
when positions rise by one within a segment, as gemmalab's packed and padded rows have them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from typing import Any

from gemmalab.config import ATTENTION_IMPLS
from gemmalab.errors import ConfigError

# Splash's key/value blocks are multiples of the TPU's 128 lanes: rows are padded up to one.
SPLASH_LANES = 128
# Largest splash block (queries and keys): 512 is MaxText's choice for v5e/v6e.
SPLASH_BLOCKS = (512, 256, 128)
# Queries per block of "blocked" attention.
BLOCK_ROWS = 128


@dataclasses.dataclass(frozen=True)
class Kernel:
    """Which fused kernel runs attention, for which devices. Hashable: it is part of the model's
    static fields, so switching kernels re-traces gemma's jit-compiled ``__call__``."""

    name: str  # "dot_product" | "splash" | "blocked"
    platform: str  # "cpu" | "gpu" | "tpu": of the devices the step runs on
    mesh: Any = None  # jax Mesh: splash runs on each device's rows under shard_map
    block_rows: int = BLOCK_ROWS  # "blocked": queries per block

    @property
    def interpret(self) -> bool:
        """Splash off a TPU: Pallas' interpreter (exact, slow)."""
        return self.platform != "tpu"


def resolve(name: str, platform: str) -> str:
    """The implementation ``name`` (``ATTENTION_IMPLS``) means on ``platform``."""
    if name not in ATTENTION_IMPLS:
        raise ConfigError("attention", f"unknown implementation {name!r}",
                          f"use one of {ATTENTION_IMPLS}")
    if name != "auto":
        return name
    return {"tpu": "splash", "gpu": "dot_product"}.get(platform, "blocked")


def implementation(name: str, platform: str, model_config: Any) -> str:
    """What computes a model's attention on ``platform``: ``resolve``'s choice, but gemma's own
    for Gemma 4, whose attention no kernel here reads (``presets.build_model``)."""
    from gemmalab.model import gemma4

    return "gemma" if gemma4.is_gemma4(model_config) else resolve(name, platform)


def score_share(implementation: str, length: int) -> float:
    """The share of a row's ``length x length`` scores that ``implementation`` computes and
    keeps for the backward pass (splash keeps none: its callers count that apart); a causal
    row's for "blocked", whose local layers compute fewer."""
    if implementation != "blocked":
        return 1.0
    return blocked_score_share(length, BLOCK_ROWS, None)


def kernel_for(name: str, *, platform: str, mesh: Any = None,
               soft_cap: float | None = None) -> Kernel | None:
    """The fused kernel ``name`` resolves to on ``platform``; None for gemma's own attention.

    ``soft_cap``: the model's ``attn_logits_soft_cap`` (Gemma 2 has one, Gemma 3 none).
    """
    chosen = resolve(name, platform)
    if chosen == "dot_product" and soft_cap is not None:
        if name == "auto":  # nothing fused takes a soft cap on this platform
            return None
        raise ConfigError("attention", "dot_product has no attention-logit soft cap and this "
                          f"model caps them at {soft_cap}", "use 'splash' (TPU) or 'gemma'")
    if chosen == "splash" and platform != "tpu":
        warnings.warn(f"attention='splash' on {platform}: Pallas interprets the TPU kernel, "
                      "exact but very slow", stacklevel=2)
    return None if chosen == "gemma" else Kernel(chosen, platform, mesh)


@functools.cache
def transformer_class(base: type) -> type:
    """``base`` (gemma's Transformer or a subclass) whose attention runs ``self.attention``'s
    kernel while no KV cache is used; None: gemma's own attention."""
    import flax.linen as nn

    class FusedAttention(base):
        attention: Kernel | None = None

        def _apply_attention(self, inputs: Any, cache: Any) -> tuple[Any, Any]:
            if cache is not None or self.attention is None:  # decoding: gemma's own
                return super()._apply_attention(inputs, cache)
            with nn.intercept_methods(functools.partial(_intercept, kernel=self.attention)):
                return super()._apply_attention(inputs, cache)

    # As lora._keyed_class: the class keeps gemma's name (its repr, the sampler's messages).
    FusedAttention.__name__ = FusedAttention.__qualname__ = base.__name__
    return FusedAttention


def kernel_of(model: Any) -> Kernel | None:
    """The fused kernel of a model from ``transformer_class``, LoRA-wrapped or not; None for
    gemma's own attention."""
    while model is not None:
        if isinstance(getattr(model, "attention", None), Kernel):
            return model.attention
        model = getattr(model, "model", None)  # gm.nn.LoRA wraps the Transformer as .model
    return None


def segment_starts(segment_ids: Any) -> Any:
    """``[B, L, 1]`` bool: where each segment (padding included) starts; what a model with a
    fused kernel takes as ``attention_mask``."""
    import jax.numpy as jnp

    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
    return jnp.concatenate([first, changed], axis=1)[..., None]


def segments_from_starts(starts: Any) -> Any:
    """``[B, L]`` int32 ids (1, 2, ...) from ``segment_starts``' column."""
    import jax.numpy as jnp

    return jnp.cumsum(starts[..., 0], axis=-1, dtype=jnp.int32)


@functools.cache
def _attention_signature() -> inspect.Signature:
    from gemma.gm.nn import _modules

    return inspect.signature(_modules.Attention.__call__)


def _intercept(next_fun: Any, args: tuple, kwargs: dict, context: Any, *, kernel: Kernel
               ) -> Any:
    from gemma.gm.nn import _modules

    module = context.module
    if not isinstance(module, _modules.Attention) or context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    call = _attention_signature().bind(module, *args, **kwargs).arguments
    x, mask = call["x"], call["attn_mask"]
    # A dense [B, L, L] mask (the sampler's scorer, model.init) or a cache: gemma's own code.
    if call["cache"] is not None or mask.shape[-1] == x.shape[1]:
        return next_fun(*args, **kwargs)
    return None, attend(module, x, call["segment_pos"], segments_from_starts(mask), kernel)


def attend(module: Any, x: Any, positions: Any, segment_ids: Any, kernel: Kernel) -> Any:
    """gemma 3's ``Attention.__call__`` without a cache, its scores computed by ``kernel``.

    Every step but the scores is the module's own (``gm/nn/_modules.py``), in its order.
    """
    from gemma.gm.math import _positional_embeddings
    from gemma.gm.nn import _modules

    if module.use_qkv_einsum:
        query, key, value = module.qkv_einsum("BTD,SNDH->SBTNH", x)
    else:
        query = module.q_einsum("BTD,NDH->BTNH", x)
        key, value = module.kv_einsum("BSD,CKDH->CBSKH", x)
    if module.use_qk_norm:
        query = module._query_norm(query)
        key = module._key_norm(key)
    rope = functools.partial(_positional_embeddings.apply_rope, positions=positions,
                             base_frequency=module.rope_base_frequency,
                             scale_factor=module.rope_scale_factor)
    query = rope(query) * module.query_pre_attn_scalar
    key = rope(key)
    window = None
    if module.attn_type == _modules.AttentionType.LOCAL_SLIDING:
        if module.sliding_window_size is None:
            raise ValueError("Sliding_window_size must be set if Local Sliding attention type")
        window = module.sliding_window_size
    scores = {"splash": _splash, "dot_product": _dot_product, "blocked": _blocked}[kernel.name]
    encoded = scores(query, key, value, segment_ids, window=window,
                     soft_cap=module.attn_logits_soft_cap, kernel=kernel)
    return module.attn_vec_einsum("BTNH,NHD->BTD", encoded)


def _dot_product(query: Any, key: Any, value: Any, segment_ids: Any, *, window: int | None,
                 soft_cap: float | None, kernel: Kernel) -> Any:
    """``jax.nn.dot_product_attention``: cuDNN on GPUs where it takes the case, else XLA's.

    The segments still need a ``[B, 1, L, L]`` mask here (the public API has no segment ids);
    causality and the window are the kernel's own flags.
    """
    import jax

    if soft_cap is not None:  # kernel_for refuses it; a hand-built Kernel might not
        raise ConfigError("attention", "dot_product has no attention-logit soft cap",
                          "use 'splash' (TPU) or 'gemma'")
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    options = dict(mask=same, scale=1.0, is_causal=True,  # the query is already scaled
                   local_window_size=None if window is None else (window - 1, 0))
    if kernel.platform == "gpu":
        try:
            return jax.nn.dot_product_attention(query, key, value, implementation="cudnn",
                                                **options)
        except (ValueError, NotImplementedError, RuntimeError):
            pass  # cuDNN refuses this dtype, head size or version: XLA's below
    return jax.nn.dot_product_attention(query, key, value, implementation="xla", **options)


def blocks(length: int, block_rows: int, window: int | None) -> list[tuple[int, int, int]]:
    """``(first query, end of queries, first key)`` of each block of ``block_rows`` queries of
    a row of ``length``; a block's keys end where its queries do (causal). With a ``window``
    a query sees itself and the ``window - 1`` keys before it."""
    spans = []
    for start in range(0, length, block_rows):
        end = min(start + block_rows, length)
        spans.append((start, end, 0 if window is None else max(0, start - window + 1)))
    return spans


def blocked_score_share(length: int, block_rows: int, window: int | None) -> float:
    """The share of gemma's ``length x length`` scores that ``"blocked"`` computes."""
    return sum((end - start) * (end - first) for start, end, first in
               blocks(length, block_rows, window)) / length ** 2


def _blocked(query: Any, key: Any, value: Any, segment_ids: Any, *, window: int | None,
             soft_cap: float | None, kernel: Kernel) -> Any:
    """gemma's scores, mask and softmax (``gm/nn/_modules.py``: its dtypes, its ``K_MASK``),
    block by block of queries (``blocks``); ``[B, L, heads, H]`` queries, ``[B, L, kv_heads,
    H]`` keys and values. A key another block would need is never masked inside one, so each
    query's softmax is over exactly gemma's keys."""
    import jax
    import jax.numpy as jnp
    from gemma.gm.nn import _modules

    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    rows = jnp.arange(length)
    outputs = []
    for start, end, first in blocks(length, kernel.block_rows, window):
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", grouped[:, start:end], key[:, first:end])
        logits = logits.reshape(batch, end - start, heads, end - first)
        if soft_cap is not None:
            logits = jnp.tanh(logits / soft_cap) * soft_cap
        seen = (segment_ids[:, start:end, None] == segment_ids[:, None, first:end]) & (
            rows[start:end, None] >= rows[None, first:end])
        if window is not None:
            seen &= rows[start:end, None] - rows[None, first:end] < window
        logits = jnp.where(seen[:, :, None, :], logits, _modules.K_MASK)
        probs = jax.nn.softmax(logits, axis=-1).astype(key.dtype)
        probs = probs.reshape(batch, end - start, kv_heads, heads // kv_heads, end - first)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value[:, first:end])
        outputs.append(encoded.reshape(batch, end - start, heads, head_dim))
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=1)


def _splash(query: Any, key: Any, value: Any, segment_ids: Any, *, window: int | None,
            soft_cap: float | None, kernel: Kernel) -> Any:
    """Splash attention on ``[B, L, heads, H]`` queries, ``[B, L, kv_heads, H]`` keys/values."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    batch, length, heads, _ = query.shape
    padded = -(-length // SPLASH_LANES) * SPLASH_LANES
    if padded != length:  # a segment id of 0 is no real one: the extra keys are never seen
        extra = ((0, 0), (0, padded - length))
        query, key, value = (jnp.pad(t, (*extra, (0, 0), (0, 0))) for t in (query, key, value))
        segment_ids = jnp.pad(segment_ids, extra)
    # The kernel's layout: heads before the sequence.
    query, key, value = (t.transpose(0, 2, 1, 3) for t in (query, key, value))

    def rows(query: Any, key: Any, value: Any, segment_ids: Any) -> Any:
        attention = _splash_kernel(query.shape[1], padded, window, soft_cap, kernel.interpret)

        def row(q: Any, k: Any, v: Any, s: Any) -> Any:
            return attention(q, k, v, segment_ids=sa.SegmentIds(q=s, kv=s))

        return jax.vmap(row)(query, key, value, segment_ids)

    specs = _shard_specs(kernel.mesh, batch, heads, key.shape[1])
    if specs is not None:  # a Mosaic kernel is not partitioned by XLA: each device its rows
        qkv, ids = specs
        rows = jax.shard_map(rows, mesh=kernel.mesh, in_specs=(qkv, qkv, qkv, ids),
                             out_specs=qkv, check_vma=False)
    return rows(query, key, value, segment_ids).transpose(0, 2, 1, 3)[:, :length]


def _splash_kernel(heads: int, length: int, window: int | None, soft_cap: float | None,
                   interpret: bool) -> Any:
    """The kernel for one row of ``heads`` x ``length``: causal, within ``window`` if given.

    gemma's window keeps keys with ``|position difference| < window``; with causality that is
    the ``window - 1`` keys before the query and itself. Not cached: the kernel holds its block
    tables as arrays of the trace that made it (splash caches the tables' numpy work itself).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    shape = (length, length)
    mask = (sa.CausalMask(shape) if window is None or window >= length
            else sa.LocalMask(shape, (window - 1, 0), 0))
    block = next(b for b in SPLASH_BLOCKS if length % b == 0)
    sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          use_fused_bwd_kernel=True)
    return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), head_shards=1, q_seq_shards=1,
                              block_sizes=sizes, attn_logits_soft_cap=soft_cap,
                              interpret=interpret)


def _shard_specs(mesh: Any, batch: int, heads: int, kv_heads: int) -> tuple[Any, Any] | None:
    """shard_map's specs for ``[B, heads, L, H]`` and ``[B, L]``: rows over the data axes,
    heads over the tensor axis where both head counts split; None on one device."""
    from jax.sharding import PartitionSpec

    from gemmalab.config import TENSOR_AXIS
    from gemmalab.model.mesh import BATCH_AXES

    if mesh is None or mesh.size == 1:
        return None
    row_axes = tuple(a for a in BATCH_AXES if a in mesh.shape and mesh.shape[a] > 1)
    ways = math.prod(mesh.shape[a] for a in row_axes)
    rows = row_axes if row_axes and batch % ways == 0 else None  # else every device all rows
    tensor = mesh.shape.get(TENSOR_AXIS, 1)
    split = TENSOR_AXIS if tensor > 1 and heads % tensor == 0 and kv_heads % tensor == 0 else None
    return PartitionSpec(rows, split, None, None), PartitionSpec(rows, None)
