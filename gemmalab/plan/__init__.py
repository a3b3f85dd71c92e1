"""Will a run fit, and how long could it take? Per-device memory and a roofline time of a training
run, before renting the slice.

One description of the run (a ``TrainConfig``: model, mesh, batch, maxlen, remat, dtypes) and an
accelerator (``"v6e:2x4"``, ``"v5p:2x2x2"``, ``"h200:8"``: ``gemmalab.accelerators``) give a
``MemoryPlan`` two ways:

- ``estimate`` (``memory``), analytic and instant: weights, optimizer state and gradients from the
  real parameter shapes cut by the real sharding rules (``gemmalab.model.sharding``), activations
  from a per-token count of what the backward pass keeps for each remat policy, and the loss's
  logits chunk (with ``objective="dpo"`` also the reference model: its weights where full
  fine-tuning holds a copy, and its forward pass). It needs no accelerator and is what
  ``train.ipynb`` checks before loading weights (``require_fits``, ``fit``).
- the exact plan (TPU targets): the real train step, lowered with abstract inputs and compiled by
  libtpu for the topology, on a CPU-only machine; XLA's own memory analysis and FLOP count. The
  train stage compiles its step: ``gemmalab.train.aot.compile_plan`` (``compile_plans`` for
  several) runs it in a subprocess with libtpu from ``.libtpu/`` (``make libtpu``; ``exact``
  finds it), so the calling process never loads the TPU runtime.

Either plan also carries the step's HBM traffic per device (an analytic lower bound, or XLA's
``bytes accessed``) and so a roofline (``MemoryPlan.roofline``, ``roofline``): the step can take
no less than the larger of its FLOPs at the chip's peak and its bytes at the chip's HBM
bandwidth. That is an upper bound on speed (a floor on time), with the run's steps and, given a
price per chip-hour, its cost.

The modules, each importing only those before it (and the ground): ``shapes`` (the run's
tensors, abstract), ``roofline``, ``memory``, ``fit`` (what to change when it does not fit),
``exact`` (libtpu), ``__main__`` (``python -m gemmalab.plan``; with ``--exact`` it calls the train
stage's compile, the one place above the plan it reaches). This package re-exports the names
callers use.

May import: the ground and ``gemmalab.model``; never ``gemmalab.train``, which imports it.
"""

from gemmalab.accelerators import (
    ACCELERATOR_FIX,
    CHIPS,
    DEVICE_KINDS,
    GIB,
    Accelerator,
    Chip,
    attached_accelerator,
    host_memory_bytes,
    parse_accelerator,
    peak_device_bytes,
)
from gemmalab.plan.exact import compile_environment, compiled_plan, find_libtpu
from gemmalab.plan.fit import (
    GEMMA4_TABLE_MODELS,
    TABLE_MODELS,
    TOPOLOGIES,
    chips_needed,
    fit_table,
    layouts,
    require_fits,
    spread_meshes,
    suggest_fit,
)
from gemmalab.plan.memory import USABLE_FRACTION, MemoryPlan, estimate, resolved_mesh, write_json
from gemmalab.plan.roofline import (
    ROOFLINE_NOTE,
    Roofline,
    check_price,
    compiled_cost,
    model_flops,
    run_steps,
    traffic_bytes,
)
from gemmalab.plan.shapes import (
    BATCH_FIELD_COUNT,
    GEMMA3_VOCAB,
    PAIR_MIN_TARGETS,
    abstract_params,
    active_adapters,
    adapter_params,
    block_dims,
    layer_head_dims,
    matmul_params,
    preference_segments_bound,
    vocab_size_hint,
)

__all__ = [
    "ACCELERATOR_FIX", "BATCH_FIELD_COUNT", "CHIPS", "DEVICE_KINDS", "GEMMA3_VOCAB",
    "GEMMA4_TABLE_MODELS", "GIB", "PAIR_MIN_TARGETS", "ROOFLINE_NOTE", "TABLE_MODELS", "TOPOLOGIES",
    "USABLE_FRACTION", "Accelerator", "Chip", "MemoryPlan", "Roofline", "abstract_params",
    "active_adapters", "adapter_params", "attached_accelerator", "block_dims", "check_price",
    "chips_needed", "compile_environment", "compiled_cost", "compiled_plan", "estimate",
    "find_libtpu", "fit_table", "host_memory_bytes", "layer_head_dims", "layouts", "matmul_params",
    "model_flops", "parse_accelerator", "peak_device_bytes", "preference_segments_bound",
    "require_fits", "resolved_mesh", "run_steps", "spread_meshes", "suggest_fit", "traffic_bytes",
    "vocab_size_hint", "write_json",
]
