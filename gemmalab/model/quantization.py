"""QLoRA's frozen base: its projections stored quantized, dequantized inside each matmul.

``LoRAConfig.base_quantization`` picks the format (``FORMATS``); qwix (Google's JAX quantization
library, as tunix uses it) quantizes and dequantizes, and holds a weight as its ``QArray``:
``qvalue`` (the weight's shape, in the format's integer type) and ``scale``.

- ``int8``: one scale per output channel (the values a row of the matmul's contraction reads).
- ``int4`` and ``nf4`` (QLoRA's 4-bit NormalFloat): one scale per ``GROUP_SIZE`` inputs of each
  output channel (int4 also a zero point: ``CALIBRATION``), as llama.cpp's 4-bit blocks: a
  4-bit grid is too coarse for a whole row's range. 32, not bitsandbytes' 64: on the embedded
  270M, nf4 in groups of 64 / 32 / 16 inputs costs +24% / +18% / +9% held-out perplexity before
  training (docs/benchmarks/qlora.md), for 0.25 more bits a weight at 32 than at 64.
- Scales are held in the compute dtype, which is what a weight dequantizes to.

What stays in the compute dtype, and why:
- the embedding (``input_embedding``): a table a token's row is read from, and (tied) the output
  head, where the loss is most sensitive; LoRA may train some of its rows (``TOKEN_ROWS``);
- Gemma 4's per-layer embedding table, its projection into it, and the router of a mixture
  (small; the router decides which experts a token reaches);
- norms and scalars: vectors, a rounding error of the whole is nothing.

The frozen base reaches the model as a tree with ``QArray`` leaves; ``dequantizing`` is the flax
method interceptor that makes each of gemma's ``Einsum``s read its weight dequantized, inside
its block, tied to the activation it multiplies (so ``remat`` recomputes it and XLA cannot hoist
every block's to the step's start), and gemmalab's own experts dequantize theirs (``as_array``).
qwix quantizes and dequantizes, but for nf4's decoding, done here by selects (``as_array``
says why). The adapters keep their dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from gemmalab.config import BASE_QUANTIZATIONS
from gemmalab.errors import ConfigError
from gemmalab.model import sharding

FORMATS = BASE_QUANTIZATIONS
GROUP_SIZE = 32  # inputs per scale of int4 / nf4
# Sharding rules (gemmalab.model.sharding.RULES) of the weights quantized; every other weight
# (embedding tables, the router, Gemma 4's per-layer projection, norms) stays as it is.
QUANTIZED_RULES = ("q_einsum", "kv_einsum", "k_einsum", "attn_vec_einsum", "gating_einsum",
                   "linear", "experts_gating", "experts_linear", "per_layer_input_gate",
                   "per_layer_projection")
# The quantized value's type, by format (qwix's names); its bits, for the planner.
QTYPES = {"int8": "int8", "int4": "int4", "nf4": "nf4"}
# int4 maps each group's [min, max] onto its 16 levels (a zero point per scale), as GGUF's 4-bit
# blocks do: a symmetric grid leaves levels unused on a group's narrower side (on the 270M base
# +24% perplexity before training against +52%). int8's grid is fine enough to be symmetric;
# nf4's levels are its own.
CALIBRATION = {"int8": "absmax", "int4": "minmax", "nf4": "absmax"}
BITS = {"int8": 8, "int4": 4, "nf4": 4}


def qarray_class() -> type:
    from qwix import QArray

    return QArray


def is_quantized(leaf: Any) -> bool:
    """Whether ``leaf`` is a quantized weight (without importing qwix when none can be)."""
    return type(leaf).__name__ == "QArray" and hasattr(leaf, "qvalue")


# The axis each quantized weight's matmul contracts over (its inputs; for attention's output
# projection [heads, head_dim, embed] the head dimension, within each head), by rule. Its
# groups line up with those of a GGUF file (blocks along each row of the HF [out, in] matrix).
INPUT_AXIS = {"q_einsum": 1, "kv_einsum": 2, "k_einsum": 1, "attn_vec_einsum": 1,
              "gating_einsum": 2, "linear": 0, "experts_gating": 3, "experts_linear": 1,
              "per_layer_input_gate": 0, "per_layer_projection": 0}
assert set(INPUT_AXIS) == set(QUANTIZED_RULES)


def group_size(fmt: str, dim: int) -> int | None:
    """Inputs per scale: ``GROUP_SIZE`` for 4-bit formats (all ``dim`` if fewer), None (one
    scale for the whole input row) for int8."""
    if fmt == "int8":
        return None
    return min(GROUP_SIZE, dim)


def check_base(fmt: str, base: Any, sizes: Mapping[str, int]) -> None:
    """Each quantized weight of ``base`` (abstract) must cut into whole groups, and so must each
    device's share of its inputs where the mesh splits them (else its scales could not be cut
    as its values are): one line naming the parameter and the fix."""
    if fmt in ("none", "int8"):
        return
    import jax

    for path, leaf in jax.tree_util.tree_leaves_with_path(base):
        rule = quantized_rule(path, leaf)
        if rule is None:
            continue
        axis, name = INPUT_AXIS[rule], sharding.RULES[rule][INPUT_AXIS[rule]]
        dim, size = leaf.shape[axis], group_size(fmt, leaf.shape[axis])
        where = "/".join(sharding.dict_path(path))
        if dim % size:
            raise ConfigError("base_quantization", f"{where}'s {dim} inputs are not a multiple "
                              f"of {fmt}'s {size}-value groups", "use int8 (a scale a row)")
        ways = int(sizes.get(name, 1)) if name else 1
        if ways > 1 and dim % ways == 0 and (dim // ways) % size:
            fits = [n for n in range(1, ways) if (dim // size) % n == 0 and ways % n == 0]
            raise ConfigError("mesh", f"{name}={ways} cuts {where}'s {dim} inputs into pieces "
                              f"of {dim // ways}, not whole {fmt} groups of {size}",
                              f"use a {name} size that divides {dim // size}, e.g. {fits[-1]}, "
                              "or base_quantization='int8'")


def quantize_leaf(weight: Any, rule: str, fmt: str, scale_dtype: Any) -> Any:
    """``weight`` as ``fmt``'s ``QArray`` (see the module's docstring for the scales)."""
    import qwix

    axis = INPUT_AXIS[rule]
    others = tuple(a for a in range(weight.ndim) if a != axis)
    size = group_size(fmt, weight.shape[axis])
    tiled = {} if size is None else {axis: size}
    return qwix.quantize(weight, QTYPES[fmt], channelwise_axes=others, tiled_axes=tiled,
                         calibration_method=CALIBRATION[fmt], scale_dtype=scale_dtype)


def quantized_rule(path: tuple[Any, ...], leaf: Any) -> str | None:
    """The rule of a weight ``quantize_base`` quantizes, or None for one it leaves whole."""
    rule = sharding.rule_name(path, np.ndim(leaf))
    return rule if rule in QUANTIZED_RULES else None


def quantize_base(params: Any, fmt: str, scale_dtype: Any, device_mesh: Any = None) -> Any:
    """``params`` with its projections quantized to ``fmt`` (the others as they are), one
    weight at a time, each into the shards the table gives its ``qvalue`` and ``scale``: a
    large base is never held twice over. ``fmt`` "none": ``params`` unchanged."""
    import jax

    if fmt == "none":
        return params
    scale_dtype = np.dtype(scale_dtype).name

    def one(path: tuple[Any, ...], leaf: Any) -> Any:
        rule = quantized_rule(path, leaf)
        if rule is None:
            return leaf
        if device_mesh is None:  # traced (abstract_base) or unsharded
            return quantize_leaf(leaf, rule, fmt, scale_dtype)
        specs = (sharding.weight_spec(path, leaf.shape, device_mesh),
                 sharding.weight_spec(path, _scale_shape(leaf.shape, rule, fmt), device_mesh))
        return _quantizer(rule, fmt, scale_dtype, device_mesh, specs)(leaf)

    return jax.tree_util.tree_map_with_path(one, params)


def _scale_shape(shape: tuple[int, ...], rule: str, fmt: str) -> tuple[int, ...]:
    axis = INPUT_AXIS[rule]
    size = group_size(fmt, shape[axis])
    return tuple((dim // size if size else 1) if a == axis else dim
                 for a, dim in enumerate(shape))


@functools.cache
def _quantizer(rule: str, fmt: str, scale_dtype: str, device_mesh: Any, specs: tuple) -> Any:
    """One weight's quantization, compiled once per rule, format and placement."""
    import jax
    from jax.sharding import NamedSharding

    qvalue, scale = (NamedSharding(device_mesh, spec) for spec in specs)
    zero_point = scale if CALIBRATION[fmt] == "minmax" else None  # (the scale's shape)
    out = qarray_class()(qvalue, scale, zero_point, QTYPES[fmt])
    return jax.jit(functools.partial(quantize_leaf, rule=rule, fmt=fmt, scale_dtype=scale_dtype),
                   out_shardings=out)


def abstract_base(params: Any, fmt: str, scale_dtype: Any) -> Any:
    """The quantized base's shapes and dtypes (``params``: abstract or concrete; nothing
    computed)."""
    import jax

    if fmt == "none":
        return params
    return jax.eval_shape(functools.partial(quantize_base, fmt=fmt, scale_dtype=scale_dtype),
                          params)


def as_array(weight: Any, after: Any = None, pinned: bool = False) -> Any:
    """``weight`` dequantized (to its scales' dtype) if quantized, else itself.

    ``after``: the activation the weight multiplies. The dequantization is then tied to it by
    an optimization barrier: it depends on nothing but the weights, and XLA would otherwise be
    free to compute every block's at the program's start and hold them all (libtpu's compile of
    Gemma 3 27B QLoRA: 66.7 GB of temporaries, the whole base dequantized).

    ``pinned`` (a weight the mesh splits): its scales and values are also read through a data
    dependency on ``after``: libtpu's optimized program keeps no barrier, and hoisted every
    layer's dequantized attention output projection of the Gemma 4 31B QLoRA step (nf4,
    ``fsdp 8``, 8 x 1,024) to the start: 13.53 GiB a chip, 10.80 pinned (the plan: 12.45)."""
    if not is_quantized(weight):
        return weight
    import qwix

    if after is not None:
        weight = tied(weight, after)
        if pinned:  # split over the mesh: libtpu drops the barrier (``_pinned``)
            weight = dataclasses.replace(weight, scale=_pinned(weight.scale, after),
                                         qvalue=_pinned_integers(weight.qvalue, after))
    if weight.qtype != "nf4":
        return qwix.dequantize(weight)
    return _nf4_dequantized(weight)


def tied(weight: Any, after: Any) -> Any:
    """``weight`` (any pytree) as a value that exists only once ``after`` does: an optimization
    barrier, so that XLA computes what derives from the weight alone (its dequantization, its
    gather from the devices it is split over) where ``after`` is used, not all blocks' at the
    program's start."""
    import jax

    weight, _ = jax.lax.optimization_barrier((weight, after))
    return weight


def _pinned(weight: Any, after: Any) -> Any:
    """``weight`` plus zero times one element of ``after``: a data dependency that, unlike a
    barrier, survives libtpu (its optimized program keeps no barrier, and a gather of a weight
    that depends on nothing else is scheduled wherever its scheduler likes: the 31B's every
    ``attn_vec_einsum`` at the step's start). Only for weights split over the mesh: on one CPU
    the elementwise pass over each weight made the 270M's LoRA step 45% slower. (A non-finite
    first element makes the weight non-finite: the step's loss would be so anyway.)"""
    zero = after.reshape(-1)[0].astype(weight.dtype) * 0
    return weight + zero


def _pinned_integers(values: Any, after: Any) -> Any:
    """``_pinned`` for integers, where ``x * 0`` folds to 0: or-ed with whether one element of
    ``after`` is NaN (false unless the step's loss would be NaN anyway)."""
    first = after.reshape(-1)[0]
    return values | (first != first).astype(values.dtype)


def _split(module: Any, weight: Any, mesh: Any) -> bool:
    """Whether the table splits an ``Einsum``'s weight over ``mesh``: it is then gathered."""
    if mesh is None:
        return False
    import jax

    path = tuple(jax.tree_util.DictKey(name) for name in (*module.path, module.weight_name))
    return any(axis is not None for axis in sharding.weight_spec(path, weight.shape, mesh))


def _nf4_dequantized(weight: Any) -> Any:
    """An nf4 weight dequantized by 15 selects over its 16 levels, elementwise: qwix's own
    decoding indexes its level table element by element, a gather XLA neither fuses nor keeps
    small (libtpu, Gemma 3 1B QLoRA: 3.0 GiB of program against 0.6 for int8)."""
    import jax.numpy as jnp
    from qwix._src.core import numerics
    from qwix._src.core import qarray as qwix_qarray

    dtype = weight.scale.dtype
    levels = numerics.get_nf4_buckets().astype(dtype)
    index = weight.qvalue.astype(jnp.int32)
    values = jnp.full(index.shape, levels[0], dtype)
    for level in range(1, 16):
        values = jnp.where(index == level, levels[level], values)
    return qwix_qarray.call_with_generic_broadcast(jnp.multiply, values, weight.scale)


def dequantized(params: Any) -> Any:
    """A params tree with every quantized weight dequantized (merge, export)."""
    import jax

    return jax.tree.map(as_array, params, is_leaf=is_quantized)


def cast(params: Any, dtype: Any) -> Any:
    """``params`` in ``dtype``: a quantized weight keeps its values and casts its scales (what
    it dequantizes to)."""
    import jax

    return jax.tree.map(lambda p: p.astype(dtype), params, is_leaf=is_quantized)


def element_count(params: Any) -> int:
    """The weights in ``params``, a quantized weight counted once (not its scales)."""
    import jax

    return int(sum((leaf.qvalue.size if is_quantized(leaf) else leaf.size)
                   for leaf in jax.tree.leaves(params, is_leaf=is_quantized)))


@contextlib.contextmanager
def dequantizing(frozen: bool = False, mesh: Any = None) -> Iterator[None]:
    """Within: gemma's ``Einsum``s whose weight is quantized compute with it dequantized.

    ``frozen``: the Einsums' weights do not train (a LoRA model's base): an unquantized one is
    then tied to its input too (``tied``), and one that ``mesh`` splits is also read through a
    data dependency on it (``_pinned``; a quantized one's scales and values, ``as_array``).
    Under fsdp XLA otherwise gathers a frozen weight whenever it likes: libtpu's compile of the
    Gemma 4 31B LoRA step (``fsdp 8``, 8 x 1,024) held some twenty layers' gathered gate|up
    weights at once (24.1 GiB a chip); tied, every layer's attention output projection (20.0);
    pinned too, 15.6 (the plan: 15.4). A weight that trains is left alone (no early gathers in
    the 31B's full fine-tuning cut to 4 and 8 layers, docs/gemma4.md).

    Nested, only the innermost acts: flax runs the outermost interceptor first, and one that
    computed an ``Einsum`` itself would hide the call from those inside it, such as LoRA's
    (``lora.LoRAModel`` installs this inside its module interceptor)."""
    import flax.linen as nn

    level = object()
    _LEVELS.append(level)
    try:
        with nn.intercept_methods(functools.partial(_dequantize_einsum, level=level,
                                                    frozen=frozen, mesh=mesh)):
            yield
    finally:
        _LEVELS.remove(level)


_LEVELS: list[object] = []  # the active ``dequantizing`` contexts, innermost last


@functools.cache
def _einsum_classes() -> tuple[type, ...]:
    from gemmalab import gemma_lib

    gemma_lib.gm()  # gemma's package first, as everywhere it is imported
    from gemma.gm.nn import _layers
    from gemma.gm.nn.gemma4 import _layers as gemma4_layers

    return _layers.Einsum, gemma4_layers.Einsum


def _dequantize_einsum(next_fun: Any, args: tuple, kwargs: dict, context: Any, *,
                       level: object, frozen: bool, mesh: Any) -> Any:
    module = context.module
    if (level is not _LEVELS[-1] or context.method_name != "__call__"
            or not isinstance(module, _einsum_classes())):
        return next_fun(*args, **kwargs)
    if not module.has_variable("params", module.weight_name):  # init: nothing quantized
        return next_fun(*args, **kwargs)
    weight = module.get_variable("params", module.weight_name)
    if isinstance(weight, dict):  # gemma 4's shared-scope MLP: {'w': weight}
        weight = weight.get("w", weight)
    quantized = is_quantized(weight)
    if not (quantized or frozen):
        return next_fun(*args, **kwargs)
    import jax.numpy as jnp

    eqn, x = (*args, *(kwargs[name] for name in ("eqn", "x") if name in kwargs))
    if quantized:
        weight = as_array(weight, after=x, pinned=_split(module, weight, mesh))
    elif _split(module, weight, mesh):
        weight = _pinned(tied(weight, x), x)
    else:
        weight = tied(weight, x)
    if getattr(module, "w_scale", None) is not None:
        weight = weight * module.w_scale
    return jnp.einsum(eqn, x, weight)
