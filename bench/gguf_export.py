"""The GGUF export on the real Gemma 3 270M: speed, file sizes per type, and the untouched embedded
base written and read back by gemmalab's own GGUF import.

    .venv/bin/python bench/gguf_export.py --out runs/gguf-export [--types f32,bf16,q8_0]

The embedded base (google/gemma-3-270m as llama.cpp's Q4_K_M, read by gemmalab into float32) is
exported once per type; each file is then read back by ``gemmalab.weights.gguf`` (``inspect``,
``dequantized``: the import's own path) and compared with the weights it was written from: the
largest absolute difference per kind of tensor against each type's rounding bound (f32: norms
within float32's rounding of 1 + w, the rest exact; bf16/f16: numpy's cast; q8_0: half a step of
the block plus the f16 rounding of its scale, as tests/weights/test_gguf_export.py states). The
file's vocabulary must be the embedded file's, bit for bit. Writes ``<out>/gguf-export.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np


def within_rounding(got: np.ndarray, want: np.ndarray, kind: str, norm: bool) -> bool:
    if norm or kind == "F32":
        return bool((np.abs(got - want) <= 2**-23 * (1 + np.abs(want))).all())
    if kind == "BF16":
        import ml_dtypes

        return bool((got == want.astype(ml_dtypes.bfloat16).astype(np.float32)).all())
    if kind == "F16":
        return bool((got == want.astype(np.float16).astype(np.float32)).all())
    blocks = want.reshape(-1, 32)
    step = np.abs(blocks).max(axis=1, keepdims=True) / 127
    return bool((np.abs(got.reshape(-1, 32) - blocks) <= step * (0.5 + 127 * 2**-11)
                 + 2**-24).all())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/gguf-export")
    parser.add_argument("--types", default="f32,bf16,q8_0")
    parser.add_argument("--cache-dir", default="", help="gemmalab's cache (default: its own)")
    args = parser.parse_args()

    import jax

    from gemmalab.config import default_cache_dir
    from gemmalab.model import presets
    from gemmalab.plan.shapes import abstract_params
    from gemmalab.weights import gguf, gguf_export, gguf_vocab, hf_layout, sources

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(args.cache_dir or default_cache_dir())
    resolved = sources.resolve("embedded:gemma3-270m", "gemma3-270m", cache_dir)
    base_file = Path(resolved.path)
    proto = gguf_vocab.sentencepiece_proto(base_file)
    config = presets.model_config("gemma3-270m", 262_144)
    params = jax.tree.map(lambda w: np.asarray(w, np.float32),
                          sources.load(resolved, abstract_params(config, "float32"),
                                       progress=False))
    want = {t.name: t.values() for t in hf_layout.hf_tensors(params, config, "float32")}
    base_fields = gguf.read_header(base_file).fields
    results: dict = {"command": " ".join(sys.argv), "python": platform.python_version(),
                     "base": str(base_file), "types": {}}
    for gguf_type in args.types.split(","):
        timings: dict = {}
        path = gguf_export.export_gguf(params, config, proto, out / f"gemma3-270m-{gguf_type}.gguf",
                                       gguf_type=gguf_type, force=True, timings=timings)
        started = time.perf_counter()
        model = gguf.inspect(path)
        worst: dict[str, float] = {}
        ok = True
        for tensor in model.tensors:
            got = gguf.dequantized(tensor)
            expected = want[tensor.hf_name]
            kind = "norm" if tensor.is_norm else tensor.hf_name.split(".")[-2]
            worst[kind] = max(worst.get(kind, 0.0), float(np.max(np.abs(got - expected))))
            ok &= within_rounding(got, expected, tensor.quant_type, tensor.is_norm)
        fields = gguf.read_header(path).fields
        vocabulary_same = all(
            list(fields[key]) == list(base_fields[key]) for key in (
                "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"))
        row = {"MB": round(timings["bytes"] / 1e6, 1), "seconds": round(timings["seconds"], 2),
               "MB_per_s": round(timings["bytes"] / 1e6 / timings["seconds"], 1),
               "read_back_seconds": round(time.perf_counter() - started, 1),
               "tensor_types": model.quant_types, "max_abs_difference": worst,
               "within_rounding": ok, "vocabulary_equals_the_embedded_files": vocabulary_same}
        row["ok"] = ok and vocabulary_same
        results["types"][gguf_type] = row
        print(gguf_type, json.dumps(row), flush=True)
        path.unlink()  # hundreds of MB each: the figures are what is kept
    results["ok"] = all(row["ok"] for row in results["types"].values())
    (out / "gguf-export.json").write_text(json.dumps(results, indent=1) + "\n")
    print("all within rounding" if results["ok"] else "FAILED")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
