"""Write ``tests/fixtures/hf_gemma3_tiny.json``: what the real transformers and peft save for a
Gemma 3 of gemmalab's tiny preset's dimensions (names, shapes, dtypes and config files).

    make interop   # installs torch, transformers, peft, safetensors into .interop/, then:
    .venv/bin/python bench/make_hf_fixture.py --site-packages .interop

``tests/weights/test_export.py`` checks gemmalab's exports against it without torch. The dimensions
below are mapped by hand from the preset's gemma ``TransformerConfig`` (independently of
``gemmalab.weights.export``), then:

- ``Gemma3ForCausalLM(Gemma3TextConfig(...))`` in bfloat16, ``save_pretrained`` (safetensors):
  its ``config.json`` and every tensor's name, shape and dtype in ``model.safetensors``;
- ``peft.get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=<all seven>))``,
  ``save_pretrained``: its ``adapter_config.json`` and the tensors of
  ``adapter_model.safetensors`` (what ``get_peft_model_state_dict`` returns).

The versions of torch, transformers, peft and safetensors used are recorded in the file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

VOCAB = 600  # as the tests: a SentencePiece model trained on a small corpus
RANK, ALPHA = 4, 8
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf_gemma3_tiny.json"


def tiny_text_config_kwargs() -> dict:
    from gemma.gm.nn import _modules

    from gemmalab.model import presets

    cfg = presets.model_config("gemma3-tiny", VOCAB)
    return dict(
        vocab_size=cfg.num_embed, hidden_size=cfg.embed_dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        sliding_window=cfg.sliding_window_size, query_pre_attn_scalar=cfg.head_dim,
        layer_types=["sliding_attention" if t == _modules.AttentionType.LOCAL_SLIDING
                     else "full_attention" for t in cfg.attention_types],
        rope_theta=cfg.global_base_frequency, rope_local_base_freq=cfg.local_base_frequency,
        max_position_embeddings=32_768)


def safetensors_layout(path: Path) -> dict[str, dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: {"shape": list(f.get_slice(name).get_shape()),
                       "dtype": f.get_slice(name).get_dtype()} for name in sorted(f.keys())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site-packages", default=".interop",
                        help="where torch/transformers/peft are installed (appended to sys.path)")
    args = parser.parse_args()
    sys.path.append(str(Path(args.site_packages).resolve()))

    import peft
    import safetensors
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(**tiny_text_config_kwargs())
    model = transformers.Gemma3ForCausalLM(config).to(torch.bfloat16)
    fixture: dict = {"produced_by": "bench/make_hf_fixture.py",
                     "versions": {"torch": torch.__version__,
                                  "transformers": transformers.__version__,
                                  "peft": peft.__version__, "safetensors": safetensors.__version__},
                     "vocab_size": VOCAB, "lora_rank": RANK, "lora_alpha": ALPHA}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/base")
        fixture["hf_config"] = json.loads(Path(f"{tmp}/base/config.json").read_text())
        fixture["hf_tensors"] = safetensors_layout(Path(f"{tmp}/base/model.safetensors"))
        lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGET_MODULES,
                               task_type="CAUSAL_LM")
        peft_model = peft.get_peft_model(model, lora)
        state = peft.get_peft_model_state_dict(peft_model)
        fixture["peft_state_dict"] = {k: list(v.shape) for k, v in sorted(state.items())}
        peft_model.save_pretrained(f"{tmp}/adapter")
        fixture["peft_adapter_config"] = json.loads(
            Path(f"{tmp}/adapter/adapter_config.json").read_text())
        fixture["peft_tensors"] = safetensors_layout(
            Path(f"{tmp}/adapter/adapter_model.safetensors"))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT} ({len(fixture['hf_tensors'])} base tensors, "
          f"{len(fixture['peft_tensors'])} adapter tensors)")


if __name__ == "__main__":
    main()
