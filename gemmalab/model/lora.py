"""LoRA: low-rank adapters on gemma's own ``gm.nn.LoRA``, with PEFT's scaling and a module choice.

The adapted layer computes ``W x + scale * einsum(x, a, b)`` with ``scale = alpha / rank`` (PEFT's
``lora_alpha / r``); gemma's wrapper has no scale and adapts every layer, so ``LoRAModel``
subclasses it to add both. Parameter names stay gemma's (``.../q_einsum/_LoRAEinsum_0/lora/a``,
``.../mlp/_LoRAEinsum_linear/lora/b``), so ``gemma.peft.split_params`` / ``merge_params`` apply.

In training the state holds only the adapters (``split``); the base weights are a separate,
frozen tree in the compute dtype (``join`` puts them back together for the forward pass).
``merge`` folds the adapters into an ordinary gemma params tree.

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
}
_WRAPPER = re.compile(r"_LoRAEinsum_(.+)")
TOKEN_ROWS = "token_rows"  # the adapter tree's key of the trained embedding rows' update


def scale(rank: int, alpha: float | None) -> float:
    """``alpha / rank``; ``alpha`` None means ``rank`` (scale 1, gemma's own LoRA)."""
    return 1.0 if alpha is None else alpha / rank


def wrap(model: Any, *, rank: int, alpha: float | None, modules: str, dtype: Any,
         token_ids: tuple[int, ...] = ()) -> Any:
    """``model`` with LoRA adapters (``dtype``) on its attention, MLP or all projections, and
    the embedding rows of ``token_ids`` trained beside them."""
    lora_scale = scale(rank, alpha)
    # gemma jit-compiles Transformer.__call__ with the module as a static argument, so its trace
    # is reused for any equal module, whatever interceptor surrounds the call: an equal base
    # model would silently run the first LoRA configuration traced (its modules, rank, scale).
    # The wrapped copy carries the configuration in its fields, so each one traces anew.
    keyed = _keyed_class(type(model))(
        **{f.name: getattr(model, f.name) for f in dataclasses.fields(model)
           if f.init and f.name not in ("parent", "name")},
        lora_key=(rank, lora_scale, modules, str(dtype), tuple(token_ids)))
    return _lora_classes()[0](rank=rank, model=keyed, dtype=dtype, scale=lora_scale,
                              modules=modules, token_ids=tuple(token_ids))


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

    class _LoRAEinsum(_lora._LoRAEinsum):  # noqa: N801 - same name: flax names the params by it
        """gemma's LoRA einsum, its adapter's output scaled."""

        scale: float = 1.0

        @nn.compact
        def __call__(self, eqn: str, x: Any) -> Any:
            adapter = peft.LoRAEinsumAdapter(name="lora", rank=self.rank, dtype=self.dtype,
                                             einsum_str=eqn, shape=self.wrapped.shape)
            return self.wrapped(eqn, x) + self.scale * adapter(x)

    class LoRAModel(gm.nn.LoRA):
        """``gm.nn.LoRA`` with PEFT's scaling, adapting only ``modules``' projections."""

        scale: float = 1.0
        modules: str = "all"
        token_ids: tuple[int, ...] = ()

        @nn.compact
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            # A free function, not a method: the interceptor would intercept a method call too.
            adapt = functools.partial(_adapt, rank=self.rank, dtype=self.dtype, scale=self.scale,
                                      modules=self.modules)
            with peft.ModuleInterceptor(adapt):
                return self.model(*args, **kwargs)

    def _adapt(module: Any, *, rank: int, dtype: Any, scale: float, modules: str) -> Any:
        if not isinstance(module, _layers.Einsum) or not _selected(module.path, modules):
            return module
        # As gemma's LoRA: the MLP's two einsums share a scope, so their wrappers are named.
        name = None if module.weight_name == "w" else f"_LoRAEinsum_{module.weight_name}"
        return _LoRAEinsum(name=name, rank=rank, dtype=dtype, wrapped=module, scale=scale)

    return LoRAModel, _LoRAEinsum


def _selected(path: tuple[str, ...], modules: str) -> bool:
    if modules not in LORA_MODULES:
        raise ValueError(f"lora_modules must be one of {LORA_MODULES}, not {modules!r}")
    return modules == "all" or {"attention": "attn", "mlp": "mlp"}[modules] in path


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
                named = wrapper.group(1)
                # '_LoRAEinsum_0' wraps the module's 'w'; '_LoRAEinsum_linear' the MLP's 'linear'.
                if named.isdigit():
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
    return scale_ * jnp.einsum(DELTA_EINSUMS[module], a.astype(jnp.float32),
                               b.astype(jnp.float32))


def merge(base: dict, adapters: dict, scale_: float, dtype: Any = None,
          token_ids: tuple[int, ...] = ()) -> dict:
    """An ordinary gemma params tree: each adapted weight becomes ``w + scale * a b`` (and the
    rows of ``token_ids`` take their trained update).

    ``dtype``: of the merged tree (default: the base weights' own).
    """
    import jax

    merged = jax.tree.map(lambda w: w, base)  # a copy of the dict structure
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
        updated = weight.astype("float32") + delta(module, a, b, scale_)
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

    base = gemma_lib.gm().nn.Transformer(config=model_config, dtype=jnp.dtype(dtype))
    model = wrap(base, rank=rank, alpha=None, modules=modules, dtype=jnp.dtype(dtype))
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

    base = gemma_lib.gm().nn.Transformer(config=model_config, dtype=jnp.dtype(dtype))
    model = wrap(base, rank=rank, alpha=None, modules=modules, dtype=jnp.dtype(dtype))

    @functools.partial(jax.jit, out_shardings=shardings)
    def draw(key: Any) -> dict:
        adapters = split(model.init(key, jnp.zeros((1, 8), jnp.int32))["params"])[1]
        if token_rows:
            adapters[TOKEN_ROWS] = jnp.zeros((token_rows, model_config.embed_dim),
                                             jnp.dtype(dtype))
        return adapters

    return draw(jax.random.key(seed))
