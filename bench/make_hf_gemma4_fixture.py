"""Write ``tests/fixtures/hf_gemma4_tiny.json`` and ``hf_gemma4_tiny_moe.json``: transformers' own
Gemma 4, dense and mixture of experts, with the tensors ``save_pretrained`` wrote, its logits and
its greedy tokens, so that ``tests/weights/test_hf_gemma4.py`` proves gemmalab's import and export
mapping without torch.

    make interop   # installs torch, transformers, peft, safetensors into .interop/, then:
    .venv/bin/python bench/make_hf_gemma4_fixture.py --site-packages .interop

Each model has its tiny preset's structure (``gemma4-tiny``: per-layer embeddings, the last 5 of
10 layers sharing keys and values with a double-width MLP; ``gemma4-tiny-moe``: 8 experts, top 2,
a dense MLP beside them, keys as values on the global layer) at widths small enough to store
every weight (each drawn by ``interop_gemma4.draw_hf_weights``, rounded to bfloat16 so that two
bytes hold it exactly). The ``Gemma4TextConfig`` is written out by hand below from those widths,
independently of ``gemmalab.weights.hf_gemma4.hf_config``, which the test compares with it. The
logits are of 2 rows of 12 tokens, three times the 4-token sliding window.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
VOCAB, SEQ_LEN, WINDOW = 64, 12, 4
GREEDY_PROMPT, GREEDY_STEPS = 6, 10

# gemma's widths (dataclasses.replace on the preset's config) and the same, by hand, as HF's.
MICRO = {
    "gemma4-tiny": (
        dict(embed_dim=16, hidden_dim=16, override_kv_shared_ffw_hidden=32, num_heads=2,
             head_dim=8, num_kv_heads=1, global_key_size=16, per_layer_input_dim=4,
             sliding_window_size=WINDOW),
        dict(hidden_size=16, intermediate_size=16, use_double_wide_mlp=True,
             num_attention_heads=2, head_dim=8, num_key_value_heads=1, global_head_dim=16,
             hidden_size_per_layer_input=4, vocab_size_per_layer_input=VOCAB,
             sliding_window=WINDOW, num_hidden_layers=10, num_kv_shared_layers=5,
             layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
             max_position_embeddings=131_072)),
    "gemma4-tiny-moe": (
        dict(embed_dim=16, hidden_dim=16, moe_dense_hidden_dim=16, num_heads=4, head_dim=8,
             num_kv_heads=2, num_global_kv_heads=1, global_key_size=16,
             sliding_window_size=WINDOW, num_experts=8, expert_dim=8, top_k_experts=2),
        dict(hidden_size=16, intermediate_size=16, num_attention_heads=4, head_dim=8,
             num_key_value_heads=2, attention_k_eq_v=True, num_global_key_value_heads=1,
             global_head_dim=16, hidden_size_per_layer_input=0,
             vocab_size_per_layer_input=VOCAB, sliding_window=WINDOW,
             num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"],
             enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=8,
             max_position_embeddings=262_144)),
}


def encode(array: np.ndarray, dtype: str) -> dict:
    import ml_dtypes

    numpy_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    values = np.asarray(array, np.float32).astype(numpy_dtype)
    assert np.array_equal(values.astype(np.float32), np.asarray(array, np.float32))
    return {"shape": list(values.shape), "dtype": dtype,
            "data": base64.b64encode(values.tobytes()).decode()}


def fixture(name: str, versions: dict) -> dict:
    import interop_gemma4
    import torch
    import transformers
    from safetensors.numpy import load_file

    from gemmalab.model import presets

    gemma_widths, hf_widths = MICRO[name]
    config = dataclasses.replace(presets.model_config(name, VOCAB), **gemma_widths)
    hf_config = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, final_logit_softcapping=30.0, **hf_widths)
    model = transformers.Gemma4ForCausalLM(hf_config).eval()
    interop_gemma4.draw_hf_weights(model, seed=len(name), round_to_bfloat16=True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, VOCAB, size=(2, SEQ_LEN))
    tokens[:, 0] = 2  # BOS
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits.numpy()
    prompt = tokens[0, :GREEDY_PROMPT].tolist()
    greedy = interop_gemma4.hf_greedy(model, prompt, GREEDY_STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved_config = json.loads((Path(tmp) / "config.json").read_text())
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
    return {"produced_by": "bench/make_hf_gemma4_fixture.py", "versions": versions,
            "preset": name, "gemma_config": presets.config_to_dict(config),
            "hf_config": saved_config,
            "tensors": {k: encode(v, "bfloat16") for k, v in sorted(tensors.items())},
            "tokens": tokens.tolist(), "hf_logits": encode(logits, "float32"),
            "greedy": {"prompt": prompt, "hf": greedy}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site-packages", default=".interop",
                        help="where torch/transformers/peft are installed (appended to sys.path)")
    args = parser.parse_args()
    sys.path.append(str(Path(args.site_packages).resolve()))

    import safetensors
    import torch
    import torch._dynamo  # noqa: F401 - loads triton's LLVM before jaxlib's (the reverse aborts)
    import transformers

    torch.manual_seed(0)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "safetensors": safetensors.__version__}
    for name in MICRO:
        out = FIXTURES / f"hf_{name.replace('-', '_')}.json"
        value = fixture(name, versions)
        out.write_text(json.dumps(value, indent=1, sort_keys=True) + "\n")
        print(f"wrote {out} ({len(value['tensors'])} tensors, {out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
