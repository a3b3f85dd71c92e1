"""LoRA: low-rank adapters on gemma's own ``gm.nn.LoRA``, with PEFT's scaling and a module choice.

The adapted layer computes ``W x + scale * einsum(x, a, b)`` with ``scale = alpha / rank`` (PEFT's
``lora_alpha / r``); gemma's wrapper has no scale and adapts every layer, so ``LoRAModel``
subclasses it to add both. Parameter names stay gemma's (``.../q_einsum/_LoRAEinsum_0/lora/a``,
``.../mlp/_LoRAEinsum_linear/lora/b``), so ``gemma.peft.split_params`` / ``merge_params`` apply.

In training the state holds only the adapters (``split``); the base weights are a separate,
frozen tree in the compute dtype (``join`` puts them back together for the forward pass).
``merge`` folds the adapters into an ordinary gemma params tree.

Gemma 4 (``gemmalab.model.gemma4``) has its own ``Einsum`` class, which gemma's LoRA does not
match (it would add no adapter at all), and experts that are no ``Einsum``: both are adapted here.
Every projection ``lora_modules`` names gets one adapter, but for

- the router (``mlp/router_logits``, ``EXCLUDED``): nothing trains it towards balance (the
  balance loss is only reported), so a router update could drift every token to a few experts;
  its ``[D, E]`` weight is small besides (E=128 for 26B-A4B), where rank 16 is an eighth of it;
- the projection into the per-layer embeddings (``embedder/per_layer_model_projection``,
  ``EXCLUDED``): part of the input's encoding, as the embedding LoRA leaves frozen, scaled by
  ``D**-0.5`` inside its ``Einsum`` (an adapter added after that scale would need it undone to
  merge and to export); each block's gate and projection of the per-layer input do train
  (``lora_modules='all'``: they are neither attention nor the MLP);
- the keys and values of KV-sharing layers (``unread_projections``): computed, never read.

The experts get adapters of their own, ``a [E, in, r]`` and ``b [E, r, out]`` (gate|up's ``out``
as ``2, H``), computed on the tokens routed to each expert with ``ragged_dot`` on the factors
(``_LoRAExperts`` wraps ``gemma4.experts_class().weights``; ``experts.ragged_product``),
never as a dense ``[E, ...]`` update.

Beside the adapters a few embedding rows may train (PEFT's ``trainable_token_indices``): a
pretrained base has barely trained its chat-turn tokens, and LoRA alone never changes an
embedding, so a fine-tuned model could not learn to end its turn. The adapter tree then holds
``TOKEN_ROWS``: one ``[tokens, embed]`` update added to those rows of the (tied) embedding, zero
at first; the token ids travel with the wrapped model (``token_ids``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

from gemmalab import gemma_lib
from gemmalab.config import LORA_MODULES
from gemmalab.model import gemma4, quantization

# The weight update ``a x b`` as each adapted weight's einsum: the weight's subscripts are those
# of its module's einsum in gemma (``gm/nn/_modules.py``), ``a`` holds the input dimensions and
# the rank ``r``, ``b`` the rank and the output dimensions (``gemma.peft``'s decomposition).
DELTA_EINSUMS = {
    "q_einsum": "dr,rnh->ndh",  # 'BTD,NDH->BTNH'
    "kv_einsum": "dr,rckh->ckdh",  # 'BSD,CKDH->CBSKH': k and v share a
    "qkv_einsum": "dr,rsnh->sndh",  # 'BTD,SNDH->SBTNH'
    "attn_vec_einsum": "nhr,rd->nhd",  # 'BTNH,NHD->BTD'
    "gating_einsum": "fr,rnh->nhf",  # '...F,NHF->...NH' (transposed gating, Gemma 3)
    "linear": "hr,rf->hf",  # '...H,HF->...F'
    # Gemma 4 (gemma/gm/nn/gemma4/_modules.py): global layers whose values are their keys, and
    # each block's gate into and projection out of its per-layer input. Its dense MLP's layout
    # is Gemma 3's transposed one above.
    "k_einsum": "dr,rkh->kdh",  # 'BSD,KDH->BSKH'
    "per_layer_input_gate": "dr,rp->dp",  # '...D,DP->...P'
    "per_layer_projection": "pr,rd->pd",  # '...P,PD->...D'
    # Its experts (``_LoRAExperts``): gate|up [E, 2, H, D], down [E, H, D], one update each.
    "experts_gating": "edr,erch->echd",
    "experts_linear": "ehr,erd->ehd",
}
# Projections never adapted, by module name, whatever ``lora_modules`` says (see the docstring).
EXCLUDED = ("router_logits", "per_layer_model_projection")
# The modules each ``lora_modules`` choice adapts: under ``attn``; under ``mlp`` (Gemma 3's MLP,
# Gemma 4's dense MLP or its experts) or ``mlp2`` (the dense MLP beside Gemma 4's experts).
_CHOSEN = {"attention": ("attn",), "mlp": ("mlp", "mlp2")}
# gemma's wrappers of an Einsum and gemmalab's of a set of experts, named after the weight.
_WRAPPER = re.compile(r"_LoRA(Einsum|Experts)_(.+)")
_EXPERT_MODULES = {"gating_einsum": "experts_gating", "linear": "experts_linear"}
TOKEN_ROWS = "token_rows"  # the adapter tree's key of the trained embedding rows' update


def scale(rank: int, alpha: float | None) -> float:
    """``alpha / rank``; ``alpha`` None means ``rank`` (scale 1, gemma's own LoRA)."""
    return 1.0 if alpha is None else alpha / rank


def wrap(model: Any, *, rank: int, alpha: float | None, modules: str, dtype: Any,
         token_ids: tuple[int, ...] = (), mesh: Any = None) -> Any:
    """``model`` with LoRA adapters (``dtype``) on its attention, MLP or all projections, and
    the embedding rows of ``token_ids`` trained beside them. ``mesh``: the one the base weights
    are split over (``quantization.dequantizing``)."""
    lora_scale = scale(rank, alpha)
    # gemma jit-compiles Transformer.__call__ with the module as a static argument, so its trace
    # is reused for any equal module, whatever interceptor surrounds the call: an equal base
    # model would silently run the first LoRA configuration traced (its modules, rank, scale).
    # The wrapped copy carries the configuration in its fields, so each one traces anew.
    keyed = _keyed_class(type(model))(
        **{f.name: getattr(model, f.name) for f in dataclasses.fields(model)
           if f.init and f.name not in ("parent", "name")},
        lora_key=(rank, lora_scale, modules, str(dtype), tuple(token_ids), mesh))
    return _lora_classes()[0](rank=rank, model=keyed, dtype=dtype, scale=lora_scale,
                              modules=modules, token_ids=tuple(token_ids),
                              unread=unread_projections(model.config), mesh=mesh)


def unread_projections(model_config: Any) -> frozenset[tuple[str, ...]]:
    """The paths of the key/value projections whose output no layer reads: Gemma 4's
    KV-sharing layers attend with another layer's keys and values yet compute their own (their
    gradient is zero, and Hugging Face's Gemma 4 has no ``k_proj``/``v_proj`` there)."""
    if not gemma4.is_gemma4(model_config):
        return frozenset()
    return frozenset((f"layer_{i}", "attn", name)
                     for i, source in enumerate(gemma4.sharing_pattern(model_config))
                     if source != i for name in ("kv_einsum", "k_einsum"))


def token_ids(model: Any) -> tuple[int, ...]:
    """The ids whose embedding rows a LoRA model trains (() for any other model)."""
    return tuple(getattr(model, "token_ids", ()))


@functools.cache
def _keyed_class(model_class: type) -> type:
    class LoRAKeyed(model_class):
        lora_key: tuple = ()

    LoRAKeyed.__name__ = LoRAKeyed.__qualname__ = model_class.__name__
    return LoRAKeyed


@functools.cache
def _lora_classes() -> tuple[type, type]:
    import flax.linen as nn
    from gemma import peft
    from gemma.gm.nn import _layers, _lora

    gm = gemma_lib.gm()
    gemma4_layers = gemma4.modules()._layers
    experts_class = gemma4.experts_class()

    class _LoRAEinsum(_lora._LoRAEinsum):  # noqa: N801 - same name: flax names the params by it
        """gemma's LoRA einsum, its adapter's output scaled."""

        scale: float = 1.0

        @nn.compact
        def __call__(self, eqn: str, x: Any) -> Any:
            adapter = peft.LoRAEinsumAdapter(name="lora", rank=self.rank, dtype=self.dtype,
                                             einsum_str=eqn, shape=self.wrapped.shape)
            return self.wrapped(eqn, x) + self.scale * adapter(x)

    class _ExpertFactors(nn.Module):  # noqa: N801
        """Each expert's factors: ``a [E, in, r]`` drawn per expert as gemma draws ``a``, ``b
        [E, r, *out]`` zeros."""

        shape: tuple[int, ...]  # the experts' weight: [E, 2, H, D] (gate|up) or [E, H, D]
        rank: int
        dtype: Any

        @nn.compact
        def __call__(self) -> tuple[Any, Any]:
            experts, inputs, outputs = _expert_factor_dims(self.shape)
            a = self.param("a", nn.initializers.kaiming_uniform(batch_axis=(0,)),
                           (experts, inputs, self.rank), self.dtype)
            b = self.param("b", nn.initializers.zeros_init(),
                           (experts, self.rank, *outputs), self.dtype)
            return a, b

    class _LoRAExperts(nn.Module):  # noqa: N801 - flax names the params by it, as _LoRAEinsum
        """The experts' weights (``gemma4.experts_class().weights``) with their adapters'
        factors, which ``experts.ragged_product`` applies to the tokens routed to each."""

        wrapped: Any
        rank: int
        dtype: Any
        scale: float = 1.0

        @nn.compact
        def weights(self, after: Any) -> Any:
            a, b = _ExpertFactors(name="lora", shape=tuple(self.wrapped.shape), rank=self.rank,
                                  dtype=self.dtype)()
            return dataclasses.replace(self.wrapped.weights(after), a=a, b=b,
                                       lora_scale=self.scale)

    class LoRAModel(gm.nn.LoRA):
        """``gm.nn.LoRA`` with PEFT's scaling, adapting only ``modules``' projections (none of
        the ``unread`` paths)."""

        scale: float = 1.0
        modules: str = "all"
        token_ids: tuple[int, ...] = ()
        unread: frozenset[tuple[str, ...]] = frozenset()
        mesh: Any = None  # the one the base weights are split over

        @nn.compact
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # A free function, not a method: the interceptor would intercept a method call too.
            adapt = functools.partial(_adapt, rank=self.rank, dtype=self.dtype, scale=self.scale,
                                      modules=self.modules, unread=self.unread)
            # QLoRA: a quantized base weight dequantizes inside, once LoRA has wrapped its layer;
            # any base weight is read where its layer's input is (``frozen``).
            with peft.ModuleInterceptor(adapt), quantization.dequantizing(frozen=True,
                                                                          mesh=self.mesh):
                return self.model(*args, **kwargs)

    def _adapt(module: Any, *, rank: int, dtype: Any, scale: float, modules: str,
               unread: frozenset[tuple[str, ...]]) -> Any:
        einsum = isinstance(module, _layers.Einsum | gemma4_layers.Einsum)
        if not (einsum or isinstance(module, experts_class)) or not _selected(
                tuple(module.path), modules, unread):
            return module
        if not einsum:
            return _LoRAExperts(rank=rank, dtype=dtype, wrapped=module, scale=scale)
        if getattr(module, "w_scale", None) is not None:  # merge and export would miss it
            raise ValueError(f"LoRA on {'/'.join(module.path)}, an Einsum scaled by its "
                             "w_scale, is not supported: add it to lora.EXCLUDED")
        # As gemma's LoRA: the MLP's two einsums share a scope, so their wrappers are named.
        name = None if module.weight_name == "w" else f"_LoRAEinsum_{module.weight_name}"
        return _LoRAEinsum(name=name, rank=rank, dtype=dtype, wrapped=module, scale=scale)

    return LoRAModel, _LoRAEinsum


def _expert_factor_dims(shape: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
    """``(experts, input width, output dims)`` of an expert weight: gate|up ``[E, 2, H, D]``
    maps D to (2, H), down ``[E, H, D]`` maps H to D."""
    if len(shape) == 4:
        return shape[0], shape[3], (shape[1], shape[2])
    return shape[0], shape[1], (shape[2],)


def _selected(path: tuple[str, ...], modules: str,
              unread: frozenset[tuple[str, ...]] = frozenset()) -> bool:
    if modules not in LORA_MODULES:
        raise ValueError(f"lora_modules must be one of {LORA_MODULES}, not {modules!r}")
    if path[-1] in EXCLUDED or path in unread:
        return False
    return modules == "all" or any(name in path for name in _CHOSEN[modules])


def split(params: dict) -> tuple[dict, dict]:
    """``(base weights, adapters)`` of a LoRA model's params (``gemma.peft.split_params``)."""
    from gemma import peft

    base, adapters = peft.split_params(params)
    return base, adapters


def join(base: dict, adapters: dict, token_ids: tuple[int, ...] = ()) -> dict:
    """The LoRA model's params from the two trees ``split`` made (and the update of the rows of
    ``token_ids``, when the adapters hold one)."""
    from gemma import peft

    joined = peft.merge_params(base, {k: v for k, v in adapters.items() if k != TOKEN_ROWS})
    return _with_token_rows(joined, adapters, token_ids)


def _with_token_rows(params: dict, adapters: dict, token_ids: tuple[int, ...]) -> dict:
    import jax.numpy as jnp

    rows = adapters.get(TOKEN_ROWS)
    if rows is None:
        return params
    if rows.shape[0] != len(token_ids):
        raise ValueError(f"{rows.shape[0]} trained embedding rows for {len(token_ids)} token ids")
    embedding = params["embedder"]["input_embedding"]
    updated = embedding.at[jnp.asarray(token_ids)].add(rows.astype(embedding.dtype))
    return {**params, "embedder": {**params["embedder"], "input_embedding": updated}}


def adapted_weights(adapters: dict) -> list[tuple[tuple[str, ...], str, Any, Any]]:
    """``(weight path, module name, a, b)`` for each adapter in ``adapters``."""
    found = []

    def visit(tree: dict, path: tuple[str, ...]) -> None:
        for key, value in tree.items():
            if key == "lora":
                wrapper = _WRAPPER.fullmatch(path[-1])
                if wrapper is None:
                    raise ValueError(f"unexpected LoRA location {'/'.join(path)}")
                kind, named = wrapper.groups()
                # '_LoRAEinsum_0' wraps the module's 'w'; '_LoRAEinsum_linear' the MLP's 'linear';
                # '_LoRAExperts_0' the experts' 'w' (their modules told from the MLP's names).
                if kind == "Experts":
                    found.append(((*path[:-1], "w"), _EXPERT_MODULES[path[-2]], value["a"],
                                  value["b"]))
                elif named.isdigit():
                    found.append(((*path[:-1], "w"), path[-2], value["a"], value["b"]))
                else:
                    found.append(((*path[:-1], named), named, value["a"], value["b"]))
            elif isinstance(value, dict):
                visit(value, (*path, key))

    visit(adapters, ())
    return found


def delta(module: str, a: Any, b: Any, scale_: float) -> Any:
    """The weight update ``scale * a b`` laid out as the adapted weight."""
    import jax.numpy as jnp

    if module not in DELTA_EINSUMS:
        raise ValueError(f"no LoRA merge rule for {module}: add one to DELTA_EINSUMS")
    dtype = _at_least_float32(a.dtype, b.dtype)
    return scale_ * jnp.einsum(DELTA_EINSUMS[module], a.astype(dtype), b.astype(dtype))


def _at_least_float32(*dtypes: Any) -> Any:
    """float32, or float64 where a float64 tree is merged (its exactness checked to 1e-12)."""
    import jax.numpy as jnp

    wide = jnp.float32
    for dtype in dtypes:
        wide = jnp.promote_types(wide, dtype)
    return wide


def merge(base: dict, adapters: dict, scale_: float, dtype: Any = None,
          token_ids: tuple[int, ...] = ()) -> dict:
    """An ordinary gemma params tree: each adapted weight becomes ``w + scale * a b`` (and the
    rows of ``token_ids`` take their trained update).

    ``dtype``: of the merged tree (default: the base weights' own).
    """
    import jax

    # A copy of the dict structure; QLoRA's quantized base weights dequantized first.
    merged = quantization.dequantized(base)
    if TOKEN_ROWS in adapters:
        embedding = merged["embedder"]["input_embedding"]
        rows = {TOKEN_ROWS: adapters[TOKEN_ROWS].astype("float32")}
        merged = _with_token_rows({**merged, "embedder": {
            **merged["embedder"], "input_embedding": embedding.astype("float32")}}, rows,
            token_ids)
        merged["embedder"]["input_embedding"] = merged["embedder"]["input_embedding"].astype(
            dtype or embedding.dtype)
    for path, module, a, b in adapted_weights(adapters):
        parent = merged
        for key in path[:-1]:
            parent = parent[key]
        weight = parent[path[-1]]
        updated = weight.astype(_at_least_float32(weight.dtype)) + delta(module, a, b, scale_)
        parent[path[-1]] = updated.astype(dtype or weight.dtype)
    if dtype is not None:
        merged = jax.tree.map(lambda w: w.astype(dtype), merged)
    return merged


def abstract_adapters(model_config: Any, *, rank: int, modules: str, dtype: str,
                      token_rows: int = 0) -> dict:
    """The adapters' shapes and dtypes for a model config (traced, nothing allocated), with
    ``token_rows`` trained embedding rows."""
    import jax
    import jax.numpy as jnp

    adapters = _abstract_adapters(model_config, rank, modules, dtype)
    if not token_rows:
        return adapters
    rows = jax.ShapeDtypeStruct((token_rows, model_config.embed_dim), jnp.dtype(dtype))
    return {**adapters, TOKEN_ROWS: rows}


@functools.cache
def _abstract_adapters(model_config: Any, rank: int, modules: str, dtype: str) -> dict:
    import jax
    import jax.numpy as jnp

    model = wrap(_plain_model(model_config, dtype), rank=rank, alpha=None, modules=modules,
                 dtype=jnp.dtype(dtype))
    def init(key: Any) -> dict:  # a new function: jax caches traces of ``model.init`` by the
        # module's hash, which does not tell LoRA modules of different ``modules`` apart
        return model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]

    return split(jax.eval_shape(init, jax.random.key(0)))[1]


def init_adapters(model_config: Any, *, rank: int, modules: str, dtype: str, seed: int,
                  shardings: Any = None, token_rows: int = 0) -> dict:
    """Fresh adapters: ``a`` drawn (gemma's Kaiming-uniform), ``b`` zeros (and ``token_rows``
    zero row updates), so the adapted model starts equal to the base."""
    import jax
    import jax.numpy as jnp

    model = wrap(_plain_model(model_config, dtype), rank=rank, alpha=None, modules=modules,
                 dtype=jnp.dtype(dtype))

    @functools.partial(jax.jit, out_shardings=shardings)
    def draw(key: Any) -> dict:
        adapters = split(model.init(key, jnp.zeros((1, 8), jnp.int32))["params"])[1]
        if token_rows:
            adapters[TOKEN_ROWS] = jnp.zeros((token_rows, model_config.embed_dim),
                                             jnp.dtype(dtype))
        return adapters

    return draw(jax.random.key(seed))


def _plain_model(model_config: Any, dtype: str) -> Any:
    """gemma's Gemma 3 ``Transformer``, or gemmalab's Gemma 4 one, for ``model_config``."""
    import jax.numpy as jnp

    if gemma4.is_gemma4(model_config):
        return gemma4.transformer_class()(config=model_config, dtype=jnp.dtype(dtype))
    return gemma_lib.gm().nn.Transformer(config=model_config, dtype=jnp.dtype(dtype))
