"""The GGUF export: a finished run as one llama.cpp gemma3 file, read back by gemmalab's own GGUF
import (``gemmalab.weights.gguf``), and its one-line refusals.

On the tiny preset (random weights, norm scales made non-zero, so a missing +1 or a swapped
tensor shows). Tolerances:

- norms (stored as 1 + w in f32, as llama.cpp's gemma3 reads them): float32's rounding of
  1 + w, |error| <= 2^-23 (1 + |w|);
- the other tensors: f32 exact; bf16 and f16 equal to numpy's round-to-nearest-even cast;
- q8_0: half a quantization step of each block of 32, plus the f16 rounding of that step times
  the largest code (step d = max |w| / 127 of the block, stored as f16 within 2^-11 d):
  |error| <= d / 2 + 127 * 2^-11 d.

That llama.cpp itself loads and runs the files is ``make llamacpp`` (bench/llamacpp_check.py,
docs/benchmarks/gguf-export.md).
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from gemmalab.errors import ConfigError
from gemmalab.model import lora, presets
from gemmalab.weights import export, gguf, gguf_export, gguf_vocab, hf_layout, orbax_params

VOCAB = 600
RANK, ALPHA = 4, 8
TEXTS = ["Once upon a time, there was a girl named Amy.", "  two  spaces\n\nand 12345 digits",
         "<start_of_turn>user\nHi<end_of_turn>\n", "café 🎉 ñ"]


def _fake_run(run_dir: Path, params, config, tokenizer_path, *, adapters=None, chat=False,
              **settings) -> Path:
    """A run's output_dir as a finished run leaves it (params/, LoRA: adapters/, summary.json,
    tokenizer.model); ``chat``: trained on chat data."""
    orbax_params.save_params(params, str(run_dir / "params"))
    if adapters is not None:
        orbax_params.save_params(adapters, str(run_dir / "adapters"))
    summary = {"model_config": presets.config_to_dict(config),
               "params": {"tokenizer": str(tokenizer_path), "checkpoint": "", **settings},
               "data": {"data_format": "chat"} if chat else {}}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    (run_dir / export.TOKENIZER_FILE).write_bytes(Path(tokenizer_path).read_bytes())
    return run_dir


def _expected(params, config) -> dict[str, np.ndarray]:
    """The params as Hugging Face tensors (what the import dequantizes into), by HF name."""
    return {t.name: t.values() for t in hf_layout.hf_tensors(params, config, "float32")}


def _assert_norm_close(got: np.ndarray, want: np.ndarray, name: str) -> None:
    """A norm read back: 1 + w rounded to float32, minus 1."""
    assert (np.abs(got - want) <= 2**-23 * (1 + np.abs(want))).all(), name


def _read_back(path: Path) -> dict[str, np.ndarray]:
    model = gguf.inspect(path)
    return {t.hf_name: gguf.dequantized(t) for t in model.tensors}


def test_f32_export_reads_back_exactly_and_states_the_shape(tiny, sp_model, tmp_path):
    config, params = tiny
    path = gguf_export.export_gguf(params, config, sp_model, tmp_path / "m.gguf",
                                   gguf_type="f32")
    got, want = _read_back(path), _expected(params, config)
    assert set(got) == set(want)
    for name, value in want.items():
        if value.ndim == 1:
            _assert_norm_close(got[name], value, name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    model = gguf.inspect(path)
    assert model.shape_fields() == {**{f: getattr(config, f) for f in
                                       gguf.SHAPE_KEYS.values()}, "num_embed": VOCAB}
    gguf.check_fits(model, config, "gemma3-tiny")
    fields = gguf.read_header(path).fields
    assert fields["general.architecture"] == "gemma3"
    assert fields["gemma3.attention.sliding_window_pattern"] == 6  # 5 local layers, 1 global
    assert fields["gemma3.rope.freq_base"] == config.global_base_frequency
    assert fields["gemma3.rope.freq_base_swa"] == config.local_base_frequency
    assert fields["gemma3.attention.value_length"] == config.head_dim
    assert fields["gemma3.context_length"] == 32_768
    assert abs(fields["gemma3.attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    assert "gemma3.final_logit_softcapping" not in fields  # Gemma 3 has none
    assert "output.weight" not in {t.name for t in model.tensors}  # tied to the embedding
    assert fields["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.chat_template" not in fields  # not a chat run


@pytest.mark.parametrize("gguf_type", ["bf16", "f16", "q8_0"])
def test_rounded_types_read_back_within_their_rounding(tiny, sp_model, tmp_path, gguf_type):
    import ml_dtypes

    config, params = tiny
    path = gguf_export.export_gguf(params, config, sp_model, tmp_path / "m.gguf",
                                   gguf_type=gguf_type)
    got, want = _read_back(path), _expected(params, config)
    kinds = {t.hf_name: t.quant_type for t in gguf.inspect(path).tensors}
    for name, value in want.items():
        if value.ndim == 1:  # norms (and every 1-D tensor) stay f32, as llama.cpp's converter
            assert kinds[name] == "F32", name
            _assert_norm_close(got[name], value, name)
            continue
        assert kinds[name] == gguf_type.upper(), name
        if gguf_type == "bf16":
            np.testing.assert_array_equal(got[name], value.astype(ml_dtypes.bfloat16)
                                          .astype(np.float32), err_msg=name)
        elif gguf_type == "f16":
            np.testing.assert_array_equal(got[name], value.astype(np.float16)
                                          .astype(np.float32), err_msg=name)
        else:
            blocks = value.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            bound = step * (0.5 + 127 * 2**-11) + 2**-24
            assert (np.abs(got[name].reshape(-1, 32) - blocks) <= bound).all(), name


def test_the_tokenizer_round_trips_through_the_file(tiny, sp_model, tmp_path):
    config, params = tiny
    path = gguf_export.export_gguf(params, config, sp_model, tmp_path / "m.gguf")
    original, rebuilt = spm.SentencePieceProcessor(), spm.SentencePieceProcessor()
    original.Load(str(sp_model))
    rebuilt.LoadFromSerializedProto(gguf_vocab.sentencepiece_proto(path))
    assert rebuilt.GetPieceSize() == original.GetPieceSize()
    for text in TEXTS:
        assert rebuilt.EncodeAsIds(text) == original.EncodeAsIds(text), text
    fields = gguf.read_header(path).fields
    types = np.asarray(fields["tokenizer.ggml.token_type"])
    tokens = fields["tokenizer.ggml.tokens"]
    for piece in ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"):
        assert types[tokens.index(piece)] == gguf_vocab.TokenType.CONTROL, piece
    assert types[tokens.index("[multimodal]")] == gguf_vocab.TokenType.USER_DEFINED


def test_a_lora_runs_merged_weights_export_from_the_cli(tiny, sp_model, tmp_path, capsys):
    import jax

    config, params = tiny
    adapters = lora.init_adapters(config, rank=RANK, modules="all", dtype="float32", seed=0)
    adapters = jax.tree.map(lambda a: np.full(a.shape, 0.05, np.float32), adapters)
    merged = lora.merge(params, adapters, ALPHA / RANK)
    run = _fake_run(tmp_path / "run", merged, config, sp_model, adapters=adapters, chat=True,
                    lora_rank=RANK, lora_alpha=ALPHA)
    assert export.main(["--run", str(run), "--format", "gguf", "--type", "f32", "--out",
                        str(tmp_path / "out")]) == 0
    path = tmp_path / "out" / "run-f32.gguf"
    assert str(path) in capsys.readouterr().out
    got = _read_back(path)
    for name, value in _expected(merged, config).items():
        if value.ndim == 1:
            _assert_norm_close(got[name], value, name)
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    fields = gguf.read_header(path).fields
    assert fields["tokenizer.chat_template"] == hf_layout.CHAT_TEMPLATE  # a chat run
    assert fields["tokenizer.ggml.tokens"][fields["tokenizer.ggml.eot_token_id"]] == \
        "<end_of_turn>"
    # An existing file: refused without --force, replaced with it.
    assert export.main(["--run", str(run), "--format", "gguf", "--type", "f32", "--out",
                        str(path)]) == 2
    assert capsys.readouterr().err.startswith("ConfigError: out: ")
    assert export.main(["--run", str(run), "--format", "gguf", "--type", "f32", "--out",
                        str(path), "--force"]) == 0


def _gemma4_run(tmp_path):
    """A finished Gemma 4 run as far as the export reads before refusing (no weights)."""
    run = tmp_path / "g4"
    (run / "params").mkdir(parents=True)
    config = presets.model_config("gemma4-tiny", VOCAB)
    (run / "summary.json").write_text(json.dumps(
        {"model_config": presets.config_to_dict(config), "params": {}}))
    return run


@pytest.mark.parametrize("case, parameter, message", [
    ("unknown type", "type", "unknown GGUF type 'q3'"),
    ("q4_k_m", "type", "llama-quantize"),
    ("gemma4", "model", "a Gemma 4 run"),
    ("exists", "out", "exists"),
    ("full disk", "out", "MB free"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny, sp_model, tmp_path, monkeypatch, case,
                                                  parameter, message):
    config, params = tiny
    run = _fake_run(tmp_path / "run", params, config, sp_model)
    out = tmp_path / "out"
    out.mkdir()
    kwargs = {"gguf_type": {"unknown type": "q3", "q4_k_m": "q4_k_m"}.get(case, "bf16")}
    if case == "gemma4":
        run = _gemma4_run(tmp_path)
    if case == "exists":
        (out / "run-bf16.gguf").write_text("mine")
    if case == "full disk":
        real = shutil.disk_usage
        monkeypatch.setattr(gguf_export.shutil, "disk_usage",
                            lambda p: real(p)._replace(free=1000))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ConfigError) as error:
        export.export_run(run, "gguf", out, **kwargs)
    assert error.value.parameter == parameter
    assert message in str(error.value) and "\n" not in str(error.value)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written
    if case == "exists":
        assert (out / "run-bf16.gguf").read_text() == "mine"


def test_the_file_size_bound_holds_and_is_close(tiny, sp_model, tmp_path):
    config, params = tiny
    vocabulary = gguf_vocab.gguf_vocabulary(sp_model.read_bytes())
    for gguf_type in ("bf16", "q8_0"):
        planned = gguf_export.plan_tensors(params, config, gguf_type, VOCAB)
        bound = gguf_export.file_size_bound(planned, vocabulary, None)
        path = gguf_export.export_gguf(params, config, sp_model, tmp_path / f"{gguf_type}.gguf",
                                       gguf_type=gguf_type)
        size = path.stat().st_size
        assert size <= bound <= size + gguf_export.HEADER_SLACK_BYTES, gguf_type


def test_rope_scaling_and_a_final_soft_cap_are_written_as_llamacpp_reads_them(tiny, sp_model,
                                                                             tmp_path):
    import dataclasses

    config, params = tiny
    scaled = dataclasses.replace(config, global_scale_factor=8.0, final_logit_softcap=30.0)
    path = gguf_export.export_gguf(params, scaled, sp_model, tmp_path / "m.gguf")
    fields = gguf.read_header(path).fields
    assert fields["gemma3.rope.scaling.type"] == "linear"
    assert fields["gemma3.rope.scaling.factor"] == 8.0  # the global layers' only (4B and up)
    assert fields["gemma3.context_length"] == 131_072
    assert fields["gemma3.final_logit_softcapping"] == 30.0


@pytest.mark.parametrize("change", [
    {"attn_logits_soft_cap": 50.0},
    {"local_scale_factor": 2.0},
    {"use_qk_norm": False},
    {"attention_types": "all local"},
])
def test_a_model_llamacpps_gemma3_cannot_compute_is_refused(tiny, sp_model, tmp_path, change):
    import dataclasses

    config, params = tiny
    if change.get("attention_types") == "all local":
        change = {"attention_types": (config.attention_types[0],) * config.num_layers}
    with pytest.raises(ConfigError) as error:
        gguf_export.export_gguf(params, dataclasses.replace(config, **change), sp_model,
                                tmp_path / "m.gguf")
    assert error.value.parameter in ("model", "model_config") and "\n" not in str(error.value)
    assert not list(tmp_path.iterdir())
