"""Gemma 4, text only, on gemma's own modules (``gemma.gm.nn.gemma4``).

What gemmalab changes of gemma 4.0.1's model, and why:

- **The router reads the block's residual.** gemma 4.0.1 routes on the expert branch's input,
  already normalised by ``pre_ffw_norm``, then normalises it again; Hugging Face's Gemma 4 and
  later gemma route on ``router_norm`` of the residual itself. They agree only while every
  ``pre_ffw_norm`` scale is 1, so real 26B-A4B weights would route differently from the model
  they were trained as.
- **Exact top-k routing** (``jax.lax.top_k``): gemma's ``approx_max_k`` may miss an expert on
  TPU (recall target 0.95), and training should see the experts its loss is computed through.
- **The experts run expert-parallel** (``gemmalab.model.experts``): each device its own
  experts, on the tokens routed to them from every device (an all-to-all), where gemma's
  computation left XLA to gather every expert's weights onto every device. Their weights come
  from one method (``Experts.weights``, gemma's parameters), which LoRA
  (``gemmalab.model.lora``) wraps to add each expert's own factors, as it wraps gemma's
  ``Einsum`` for every other projection.
- **Router statistics** are sown (``ROUTER_COLLECTION``) for the step's metrics: each MoE
  layer's mean router probability per expert, its share of the routed tokens (from which
  the load-balancing loss is computed, ``router_metrics``) and the share of routed token
  copies dropped: none unless ``TrainConfig.expert_capacity_factor`` bounds what an expert
  shard receives.
- **Remat** keeps what Gemma 4's blocks need besides the residual: each layer's per-layer
  input and the keys and values a KV-sharing layer reads from the layer it shares with.

The presets (``gemmalab.model.presets``) build their configs here: the four published sizes
without their vision and audio towers, two tiny ones with every structural feature of their
family, and cut models (``TrainConfig.num_layers``) whose KV sharing still refers to layers
they have.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from gemmalab import gemma_lib
from gemmalab.model import quantization

ROUTER_COLLECTION = "router"  # the flax collection the MoE layers sow their statistics into

# The tiny presets keep Gemma 4's architecture at a size that trains in minutes on two cores.
# Dense (E2B's family): 4 sliding-window layers then 1 global one, twice; per-layer
# embeddings; the second half shares the keys and values of the first half's last local and
# global layers, with the double-width MLP E2B gives its sharing layers.
TINY_DENSE = dict(embed_dim=128, hidden_dim=512, num_heads=4, head_dim=32, num_kv_heads=1,
                  global_key_size=64, sliding_window_size=128, per_layer_input_dim=16,
                  override_kv_shared_ffw_hidden=1024)
TINY_DENSE_PATTERN_REPEATS = 2
TINY_DENSE_SHARED_FRACTION = 0.5
# Mixture of experts (26B-A4B's family): 5 local layers then 1 global one whose keys are its
# values (k_eq_v), 8 experts of which 2 run a token, beside a dense MLP.
TINY_MOE = dict(embed_dim=128, hidden_dim=256, moe_dense_hidden_dim=256, num_heads=4,
                head_dim=32, num_kv_heads=2, num_global_kv_heads=1, global_key_size=64,
                sliding_window_size=128, num_experts=8, expert_dim=64, top_k_experts=2)


def modules() -> Any:
    """gemma's Gemma 4 package with its submodules loaded (imported on first use: gemma pulls
    tensorflow). The package's ``__init__`` does not import ``_layers`` itself, so a fresh
    process must, whatever ran before."""
    gemma_lib.gm()
    from gemma.gm.nn import gemma4
    from gemma.gm.nn.gemma4 import _layers, _modules, _moe, _transformer  # noqa: F401

    return gemma4


def is_gemma4(config: Any) -> bool:
    """Whether a gemma ``TransformerConfig`` is Gemma 4's (else Gemma 3's), by its class's
    package (nothing imported)."""
    return type(config).__module__.startswith("gemma.gm.nn.gemma4")


def text_config(gemma_class: str, vocab_size: int | None = None) -> Any:
    """The config of ``gm.nn.<gemma_class>`` without its vision and audio towers."""
    config = getattr(gemma_lib.gm().nn, gemma_class).config
    changes = {} if vocab_size is None else {"num_embed": vocab_size}
    return dataclasses.replace(config, vision_encoder=None, audio_encoder=None,
                               use_bidirectional_attention=None, **changes)


def tiny_config(moe: bool, vocab_size: int) -> Any:
    """``gemma4-tiny`` (dense) or ``gemma4-tiny-moe``'s config for a ``vocab_size`` tokenizer."""
    from gemma.gm.nn.gemma4 import _config, _modules

    local, global_ = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
    if moe:
        base = text_config("Gemma4_26B_A4B", vocab_size)
        return dataclasses.replace(base, **TINY_MOE, attention_types=(local,) * 5 + (global_,))
    base = text_config("Gemma4_E2B", vocab_size)
    pattern = ((local,) * 4 + (global_,)) * TINY_DENSE_PATTERN_REPEATS
    return dataclasses.replace(
        base, **TINY_DENSE, attention_types=pattern,
        kv_cache_sharing_config=_config.KVCacheSharingConfig(
            frac_shared_layers=TINY_DENSE_SHARED_FRACTION, share_global=True, share_local=True))


def sharing_pattern(config: Any) -> list[int]:
    """For each layer, the layer whose keys and values it attends with (itself unless shared)."""
    from gemma.gm.nn.gemma4 import _config

    return _config.create_kv_cache_sharing_patterns(
        config.kv_cache_sharing_config, config.num_layers, config.attention_types)


def cut(config: Any, num_layers: int) -> Any:
    """``config``'s last ``num_layers`` layers (a cut model, ``TrainConfig.num_layers``).

    A layer that shares keys and values reads them from the last local and global layers
    before the shared ones. gemma places those by a fraction of the depth, so a cut keeps
    sharing only where its first layers still end on a local then a global layer: the share
    of sharing layers is the whole model's, rounded up to the next such boundary; with none
    left, no layer shares (and none has the sharing layers' wider MLP).
    """
    from gemma.gm.nn.gemma4 import _modules

    types = tuple(config.attention_types[-num_layers:])
    config = dataclasses.replace(config, attention_types=types)
    sharing = config.kv_cache_sharing_config
    if sharing is None:
        return config
    wanted = num_layers - int(round(sharing.frac_shared_layers * num_layers))
    boundaries = [u for u in range(max(wanted, 2), num_layers)
                  if types[u - 1] == _modules.AttentionType.GLOBAL
                  and types[u - 2] == _modules.AttentionType.LOCAL_SLIDING]
    if not boundaries:
        return dataclasses.replace(config, kv_cache_sharing_config=None,
                                   override_kv_shared_ffw_hidden=None)
    unshared = boundaries[0]
    # Half a layer short of the boundary: gemma truncates num_layers * (1 - fraction).
    fraction = (num_layers - unshared - 0.5) / num_layers
    config = dataclasses.replace(config, kv_cache_sharing_config=dataclasses.replace(
        sharing, frac_shared_layers=fraction))
    pattern = sharing_pattern(config)
    assert pattern[:unshared] == list(range(unshared)) and all(
        p < unshared for p in pattern[unshared:]), pattern
    return config


@functools.cache
def experts_class() -> type:
    """A set of experts' weights (the parameter ``w`` of gemma's ``_moe._Weight``: ``[E, 2, H,
    D]`` for gate|up, ``[E, H, D]`` for down).

    ``weights(after)``: them as the experts compute (``experts.ExpertWeights``), dequantized
    once ``after`` (the layer's input) exists. The weight is declared in that (compact) method,
    so that LoRA's wrapper of it can declare each expert's factors there too.
    """
    import flax.linen as nn

    from gemmalab.model.experts import ExpertWeights

    class Experts(nn.Module):
        shape: tuple[int, ...]

        @nn.compact
        def weights(self, after: Any) -> ExpertWeights:
            # QLoRA's quantized base dequantizes here, inside the block (quantization.py).
            return ExpertWeights(quantization.as_array(
                self.param("w", nn.initializers.normal(), self.shape), after=after))

    return Experts


@functools.cache
def transformer_class(remat_policy: str = "none") -> type:
    """gemma's Gemma 4 ``Transformer`` with gemmalab's router (see the module's docstring);
    with ``remat_policy`` ``"full"`` or ``"dots"``, its blocks rematerialised when training."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    gemma4 = modules()
    from gemma.gm.nn.gemma4 import _layers, _modules, _moe, _transformer

    from gemmalab.model.experts import routed_ffw

    experts = experts_class()

    class Router(_moe.MoERagged):
        """MoERagged routing on ``router_x`` (the residual) with exact top-k, sowing its
        statistics; its experts run expert-parallel over ``mesh`` (``experts.routed_ffw``) on
        ``Experts.weights`` (where LoRA adds each expert's factors)."""

        mesh: Any = None
        capacity_factor: float = 0.0  # TrainConfig.expert_capacity_factor

        def setup(self) -> None:  # gemma's, the expert weights as Experts (the same parameters)
            self.router_logits = _layers.Einsum(shape=(self.features, self.num_experts))
            self.gating_einsum = experts(
                shape=(self.num_experts, 2, self.hidden_dim, self.features))
            self.linear = experts(shape=(self.num_experts, self.hidden_dim, self.features))
            self.per_expert_scale = self.param("per_expert_scale", nn.initializers.ones,
                                               (self.num_experts,))
            self.router_scale = self.param("router_scale", nn.initializers.ones, (self.features,))
            self.router_norm = _layers.RMSNorm(with_scale=False)

        def _run_ffw_and_routing(self, x: Any, expert_choices: Any, expert_weights: Any) -> Any:
            # gemma's MoERagged computation, expert-parallel over the mesh (experts.py).
            combine = jnp.take_along_axis(expert_weights, expert_choices, axis=-1)
            out, dropped = routed_ffw(x, expert_choices, combine, self.gating_einsum.weights(x),
                                      self.linear.weights(x), self.per_expert_scale,
                                      mesh=self.mesh, capacity_factor=self.capacity_factor)
            self.sow(ROUTER_COLLECTION, "dropped", jax.lax.stop_gradient(dropped))
            return out

        def _router(self, router_logits: Any) -> tuple[Any, Any]:
            router_logits = router_logits.astype(jnp.float32)
            probs = jax.nn.softmax(router_logits, axis=-1)
            _, choices = jax.lax.top_k(router_logits, self.num_experts_per_datapoint)
            weights = probs / _moe._renormalization_factor(probs, choices)
            tokens = probs.shape[0] * probs.shape[1]
            routed = jax.nn.one_hot(choices, self.num_experts, dtype=jnp.float32).sum((0, 1, 2))
            self.sow(ROUTER_COLLECTION, "stats", jax.lax.stop_gradient(jnp.stack([
                probs.sum(axis=(0, 1)) / tokens,
                routed / (tokens * self.num_experts_per_datapoint)])))
            return weights, choices

        def __call__(self, x: Any, router_x: Any = None) -> Any:
            router_x = x if router_x is None else router_x
            router_input = self.router_norm(router_x)
            root_size = jax.lax.rsqrt(jnp.array(self.features, dtype=router_input.dtype))
            router_input = router_input * root_size * self.router_scale.astype(
                router_input.dtype)
            logits = self.router_logits("gsd,de->gse", router_input)
            weights, choices = self._router(logits)
            return self._run_ffw_and_routing(x, choices, weights)

    class Block(_modules.Block):
        mesh: Any = None  # the devices the experts are split over (experts.routed_ffw)
        capacity_factor: float = 0.0

        def _setup_moe(self) -> None:  # gemma's, with the Router as the expert branch
            self.pre_ffw2_norm = _layers.RMSNorm()
            self.mlp2 = _modules.FeedForward(features=self.embed_dim, hidden_dim=self.hidden_dim)
            self.post_ffw2_norm = _layers.RMSNorm() if self.use_post_ffw_norm else None
            self.pre_ffw_norm = _layers.RMSNorm()
            self.mlp = Router(features=self.embed_dim, hidden_dim=self.expert_dim,
                              num_experts=self.num_experts,
                              num_experts_per_datapoint=self.top_k_experts, mesh=self.mesh,
                              capacity_factor=self.capacity_factor)
            self.post_ffw1_norm = _layers.RMSNorm() if self.use_post_ffw_norm else None
            self.post_ffw_norm = _layers.RMSNorm() if self.use_post_ffw_norm else None

        def _forward_moe(self, attn_output: Any) -> Any:
            dense_out = self.mlp2(self.pre_ffw2_norm(attn_output))
            if self.post_ffw2_norm is not None:
                dense_out = self.post_ffw2_norm(dense_out)
            moe_out = self.mlp(self.pre_ffw_norm(attn_output), attn_output)
            if self.post_ffw1_norm is not None:
                moe_out = self.post_ffw1_norm(moe_out)
            outputs = dense_out + moe_out
            if self.post_ffw_norm is not None:
                outputs = self.post_ffw_norm(outputs)
            return outputs

    def run_block(block: Any, x: Any, positions: Any, mask: Any, per_layer: Any,
                  shared: Any) -> tuple[Any, Any]:
        return block(x, positions, None, mask, per_layer, kv_shared_cache=shared)

    policies = {"full": None, "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

    class Transformer(_transformer.Transformer):
        """Text-only Gemma 4 (``config.vision_encoder`` and ``audio_encoder`` None)."""

        remat: str = remat_policy
        mesh: Any = None  # a mixture's experts split over its expert axis (experts.py)
        capacity_factor: float = 0.0  # 0: dropless (experts.block_capacity)

        def setup(self) -> None:
            config = self.config
            if config.vision_encoder is not None or config.audio_encoder is not None:
                raise ValueError("gemmalab's Gemma 4 is text only: use gemma4.text_config")
            self.embedder = _modules.Embedder(
                vocab_size=config.num_embed, embed_dim=config.embed_dim, vision_proj_dim=None,
                per_layer_input_dim=config.per_layer_input_dim, num_layers=config.num_layers,
                audio_proj_dim=None)
            self.kv_cache_sharing_patterns = sharing_pattern(config)
            local = _modules.AttentionType.LOCAL_SLIDING
            self.blocks = [
                Block(name=f"layer_{i}", num_heads=config.num_heads,
                      num_kv_heads=config.num_kv_heads, embed_dim=config.embed_dim,
                      head_dim=config.head_dim,
                      hidden_dim=(config.moe_dense_hidden_dim if config.enable_moe
                                  else self._get_hidden_dim(layer_number=i)),
                      sliding_window_size=config.sliding_window_size,
                      use_post_attn_norm=config.use_post_attn_norm,
                      use_post_ffw_norm=config.use_post_ffw_norm,
                      attn_logits_soft_cap=config.attn_logits_soft_cap, attn_type=kind,
                      qk_norm_with_scale=config.qk_norm_with_scale,
                      num_global_kv_heads=config.num_global_kv_heads,
                      global_key_size=config.global_key_size,
                      k_eq_v_global=config.k_eq_v_global,
                      global_rope_proportion=config.global_rope_proportion,
                      local_rope_proportion=config.local_rope_proportion,
                      rope_base_frequency=(config.local_base_frequency if kind == local
                                           else config.global_base_frequency),
                      rope_scale_factor=(config.local_scale_factor if kind == local
                                         else config.global_scale_factor),
                      per_layer_input_dim=config.per_layer_input_dim,
                      enable_moe=config.enable_moe, num_experts=config.num_experts,
                      expert_dim=config.expert_dim, top_k_experts=config.top_k_experts,
                      mesh=self.mesh, capacity_factor=self.capacity_factor)
                for i, kind in enumerate(config.attention_types)]
            self.final_norm = _layers.RMSNorm()

        def _apply_attention(self, inputs: Any, cache: Any) -> tuple[Any, Any]:
            if self.remat == "none" or cache is not None:  # decoding: no backward pass
                return super()._apply_attention(inputs, cache)
            step = nn.remat(run_block, policy=policies[self.remat], prevent_cse=True)
            x, new_cache = inputs.embeddings, {}
            for i, block in enumerate(self.blocks):
                shared = (new_cache.get(f"layer_{self.kv_cache_sharing_patterns[i]}")
                          if self._kv_sharing_enabled(layer_number=i) else None)
                per_layer = (inputs.per_layer_inputs[..., i, :]
                             if self.config.per_layer_input_dim else None)
                new_cache[f"layer_{i}"], x = step(block, x, inputs.positions,
                                                  inputs.attention_mask, per_layer, shared)
            return self.final_norm(x), new_cache

    del gemma4
    return Transformer


def router_metrics(sown: Any) -> dict[str, Any]:
    """The step's router figures from the sown statistics, averaged over the MoE layers (each
    sows ``stats``, ``[2, E]``: mean router probability per expert and share of the routed
    tokens per expert; and ``dropped``, the share of its routed token copies dropped):

    - ``router_balance_loss``: Switch Transformer's load-balancing loss, ``E * sum_e f_e P_e``
      (1.0 when every expert gets its share, up to E when one takes every token);
    - ``router_max_load``: the busiest expert's share of the routed tokens times E (1.0:
      balanced);
    - ``router_dropped``: the share of routed token copies past an expert shard's capacity
      (``TrainConfig.expert_capacity_factor``; 0 dropless).

    Empty for a dense model."""
    import jax
    import jax.numpy as jnp

    named = jax.tree_util.tree_leaves_with_path(sown)
    stats = [leaf for path, leaf in named if _last_key(path) == "stats"]
    if not stats:
        return {}
    dropped = [leaf for path, leaf in named if _last_key(path) == "dropped"]
    layers = jnp.stack([jnp.reshape(leaf, (-1, 2, leaf.shape[-1])).mean(axis=0)
                        for leaf in stats])  # [layers, 2, E]
    experts = layers.shape[-1]
    probs, shares = layers[:, 0], layers[:, 1]
    return {"router_balance_loss": jnp.mean(experts * jnp.sum(probs * shares, axis=-1)),
            "router_max_load": jnp.mean(experts * jnp.max(shares, axis=-1)),
            "router_dropped": jnp.mean(jnp.stack([jnp.mean(leaf) for leaf in dropped]))
            if dropped else jnp.zeros(())}


def _last_key(path: tuple[Any, ...]) -> str | None:
    """The name a value was sown under (a sown value is a tuple: its index comes last)."""
    keys = [getattr(entry, "key", None) for entry in path]
    names = [key for key in keys if isinstance(key, str)]
    return names[-1] if names else None
