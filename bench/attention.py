"""Attention at long maxlen: gemma's own attention against the fused kernels, step time and memory.

    .venv/bin/python bench/attention.py                         # this machine, then libtpu AOT
    .venv/bin/python bench/attention.py --maxlens 256,1024 --no-aot    # part 1 only

Part 1, on this machine's devices: the full train step (forward, backward, AdamW) of
``--model`` (gemma3-tiny on a CPU, gemma3-270m on an accelerator) at each maxlen, the tokens
per step held constant (rows = ``--tokens`` / maxlen),
on packed rows (stories of 64-512 tokens, the row's end padded), gemma's attention against the
platform's fused kernel (CPU: dot_product with XLA's implementation; GPU: dot_product, cuDNN;
TPU: splash). Step time is the median of ``--steps`` after the compile; memory is XLA's
compiled temporaries (``memory_analysis``), the same figure on any backend.

Part 2, without a chip: the train step of ``--aot-model`` compiled by libtpu for each of
``--topologies`` (``gemmalab.train.aot.compile_plan``), gemma against splash, its temporaries.
Skipped where libtpu is not installed (``make libtpu``).

Prints markdown tables (docs/benchmarks/attention.md).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab import plan
from gemmalab.config import TrainConfig
from gemmalab.errors import ConfigError
from gemmalab.model import mesh, presets
from gemmalab.train import aot, optimization

MIB = 1 << 20
# The kernel the fused column runs on each platform (gemmalab.model.attention.resolve's "auto").
FUSED = {"cpu": "dot_product", "gpu": "dot_product", "tpu": "splash"}


def packed_rows(rows: int, maxlen: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows of stories 64-512 tokens long, positions restarting at each, the end padded."""
    rng = np.random.default_rng(seed)
    segment_ids = np.zeros((rows, maxlen), np.int32)
    positions = np.zeros((rows, maxlen), np.int32)
    for row in range(rows):
        start, number = 0, 1
        while True:
            size = int(rng.integers(64, 513))
            if start + size > maxlen:
                size = maxlen - start if number == 1 else 0  # one story at least, cut
            if size == 0:
                break
            segment_ids[row, start:start + size] = number
            positions[row, start:start + size] = np.arange(size)
            start, number = start + size, number + 1
    real = segment_ids > 0
    tokens = np.where(real, rng.integers(3, vocab, (rows, maxlen)), 0).astype(np.int32)
    return {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": segment_ids,
            "positions": positions, "loss_mask": real.astype(np.int32)}


def measure(config, attention: str, batch: dict[str, np.ndarray], compute_dtype: str,
            steps: int) -> tuple[float, int]:
    """``(median step seconds, compiled temporaries in bytes)`` of the train step."""
    device_mesh = mesh.make_mesh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # splash interpreted off TPU
        model = presets.build_model(config, param_dtype=jnp.float32, attention=attention,
                                    mesh=device_mesh)
    params = presets.init_params(model, seed=0, sample_length=8)
    schedule = optimization.learning_rate_schedule(1e-4, 1000, warmup_ratio=0.0, min_lr_ratio=1.0)
    optimizer = optimization.make_optimizer(schedule, weight_decay=0.0, b1=0.9, b2=0.95,
                                            max_grad_norm=1.0)
    state, shardings = optimization.init_state(params, optimizer, device_mesh)
    step = optimization.make_train_step(model, optimizer, schedule, jnp.dtype(compute_dtype),
                                        device_mesh, shardings)
    batch = mesh.global_batch(batch, device_mesh)
    compiled = step.lower(state, batch, None).compile()
    temporaries = int(compiled.memory_analysis().temp_size_in_bytes)
    state, metrics = compiled(state, batch, None)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        state, metrics = compiled(state, batch, None)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - started)
    return statistics.median(times), temporaries


def local_table(args: argparse.Namespace) -> None:
    platform = jax.default_backend()
    fused = FUSED.get(platform, "dot_product")
    # A CPU takes the tiny preset and short rows (~3 min on 2 cores); an accelerator the
    # 270M model up to 8192 tokens a row.
    on_cpu = platform == "cpu"
    args.model = args.model or ("gemma3-tiny" if on_cpu else "gemma3-270m")
    args.tokens = args.tokens or (2048 if on_cpu else 16384)
    args.maxlens = args.maxlens or ([256, 512, 1024, 2048] if on_cpu else
                                    [256, 1024, 2048, 4096, 8192])
    vocab = args.vocab if args.model == "gemma3-tiny" else plan.GEMMA3_VOCAB
    config = presets.model_config(args.model, vocab)
    print(f"\n{args.model}, {args.tokens} tokens per step, {args.compute_dtype}, "
          f"{jax.device_count()} x {jax.devices()[0].device_kind} ({platform}); gemma vs "
          f"{fused}\n")
    print(f"| maxlen | rows | gemma s/step | {fused} s/step | speed-up | gemma temp MiB | "
          f"{fused} temp MiB |")
    print("|---|---|---|---|---|---|---|")
    for maxlen in args.maxlens:
        rows = max(1, args.tokens // maxlen)
        batch = packed_rows(rows, maxlen, vocab)
        (base_s, base_mem), (fused_s, fused_mem) = (
            measure(config, name, batch, args.compute_dtype, args.steps)
            for name in ("gemma", fused))
        print(f"| {maxlen} | {rows} | {base_s:.3f} | {fused_s:.3f} | {base_s / fused_s:.2f}x | "
              f"{base_mem / MIB:,.0f} | {fused_mem / MIB:,.0f} |", flush=True)


def aot_table(args: argparse.Namespace) -> None:
    if plan.find_libtpu() is None:
        print("\n(libtpu not installed: no TPU compile; `make libtpu`)")
        return
    print(f"\n{args.aot_model}, {args.aot_tokens} tokens per step, bfloat16 compute, compiled "
          "by libtpu (no chip): the step's temporaries\n")
    print("| topology | maxlen | rows | gemma temp GiB | splash temp GiB | splash / gemma | "
          "compile s (gemma, splash) |")
    print("|---|---|---|---|---|---|---|")
    for topology in args.topologies:
        for maxlen in args.aot_maxlens:
            rows = max(1, args.aot_tokens // maxlen)
            cells, temporaries, seconds = {}, {}, {}
            for name in ("gemma", "splash"):
                config = TrainConfig.flat(model=args.aot_model, tokenizer="gemma3", maxlen=maxlen,
                                     batch_size=rows, compute_dtype="bfloat16", attention=name)
                try:
                    compiled = aot.compile_plan(config, topology)
                except (ConfigError, RuntimeError) as error:
                    cells[name], seconds[name] = failure(str(error)), "-"
                    continue
                temporaries[name] = compiled.breakdown["temporaries"]
                cells[name] = f"{temporaries[name] / 2**30:.2f}"
                seconds[name] = f"{compiled.compile_seconds:.0f}"
            ratio = (f"{temporaries['splash'] / temporaries['gemma']:.2f}"
                     if len(temporaries) == 2 else "-")
            print(f"| {topology} | {maxlen} | {rows} | {cells['gemma']} | {cells['splash']} | "
                  f"{ratio} | {seconds['gemma']}, {seconds['splash']} |", flush=True)


def failure(message: str) -> str:
    """A table cell for a compile that failed: libtpu's out-of-memory figures, if that is it."""
    found = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", message)
    if found:
        return f"does not fit: {found.group(1)} > {found.group(2)} HBM"
    return "failed: " + message.strip().splitlines()[-1][:60]


def main() -> None:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: tiny on CPU, else 270m")
    parser.add_argument("--vocab", type=int, default=2048, help="gemma3-tiny's vocabulary")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per step (default: 2048 on CPU, else 16384)")
    parser.add_argument("--maxlens", type=ints, default=None,
                        help="default: 256-2048 on CPU, else 256-8192")
    parser.add_argument("--compute-dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-local", action="store_true", help="skip part 1")
    parser.add_argument("--no-aot", action="store_true", help="skip part 2")
    parser.add_argument("--aot-model", default="gemma3-270m")
    parser.add_argument("--aot-tokens", type=int, default=16384)
    parser.add_argument("--aot-maxlens", type=ints, default=[256, 1024, 4096, 8192])
    parser.add_argument("--topologies", type=lambda s: s.split(","), default=["v6e:1x1"])
    args = parser.parse_args()
    started = time.perf_counter()
    if not args.no_local:
        local_table(args)
    if not args.no_aot:
        aot_table(args)
    print(f"\n({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
