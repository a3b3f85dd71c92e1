"""Gemma 4 in ``make interop``: gemmalab's tiny Gemma 4 presets against transformers' own
``Gemma4ForCausalLM`` (called by ``bench/interop.py``; the helpers also make the torch-free
fixtures, ``bench/make_hf_gemma4_fixture.py``).

For ``gemma4-tiny`` (dense: per-layer embeddings, the last 5 of 10 layers sharing keys and values,
their double-width MLP) and ``gemma4-tiny-moe`` (8 experts, top 2, a dense MLP beside them, keys
as values on the global layer), 2 rows of 200 tokens (over the 128-token window), float32 on
both sides, HF with ``attn_implementation="eager"``:

1. export: gemmalab's random params -> ``export_hf`` -> ``from_pretrained``: logits;
2. import: HF's own model, every parameter and ``layer_scalar`` drawn in torch ->
   ``save_pretrained`` (no keys and values on its sharing layers) -> ``load_hf_params``: gemma's
   logits against HF's;
3. greedy: transformers' ``generate`` (its KV-cache path) against gemma's greedy loop, 24 tokens,
   on the model of 1 and on that of 2;
4. conditioning: the export again with the query-norm scales near 1, where the two libraries'
   float32 logits are set against the float64 ones (gemma's, under ``jax.enable_x64``).

Why the query-norm scales are drawn small in 1-3: Gemma 4 does not scale its attention logits
(HF's ``scaling = 1.0``); its trained query norms do. With norm scales near 1, a random model's
logits reach ~sqrt(head_dim) times Gemma 3's, the softmax is near one-hot, and float32 rounding
alone moves either library's final logits by 1e-4 to 4e-4 from the float64 result (check 4:
gemma and HF alike), as much as the 1e-4 the check asks. So the query-norm scales are drawn around
``head_dim ** -0.5`` (the scaling Gemma 3 applies, folded into the norm), still random per entry;
check 4 keeps them near 1 and shows both libraries there as far from float64 as rounding puts
either one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PRESETS = ("gemma4-tiny", "gemma4-tiny-moe")
SEQ_LEN = 200
GREEDY_PROMPT, GREEDY_STEPS = 12, 24
NORM_NOISE = 0.3  # as the Gemma 3 check: 1-D scales 1 + N(0, 0.3), so a swapped one shows


def random_scales(params: dict, seed: int, *, scaled_queries: bool = True) -> dict:
    """gemmalab's params with every 1-D weight (norm scales, ``skip_scale``, router and expert
    scales) drawn around 1, the query norms around ``head_dim ** -0.5`` when
    ``scaled_queries`` (see the module's docstring)."""
    import jax

    rng = np.random.default_rng(seed)

    def draw(path: Any, w: Any) -> Any:
        if w.ndim != 1:
            return w
        value = 1.0 + rng.normal(0, NORM_NOISE, w.shape)
        if scaled_queries and "query_norm" in jax.tree_util.keystr(path):
            value *= w.shape[0] ** -0.5
        return value.astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, params)


def gemma_model(name: str, vocab: int, seed: int = 0, *, scaled_queries: bool = True
                ) -> tuple[Any, Any, dict]:
    """A preset's config, model and random float32 params (``random_scales`` on top)."""
    import jax.numpy as jnp

    from gemmalab.model import presets

    config = presets.model_config(name, vocab)
    model = presets.build_model(config, param_dtype=jnp.float32)
    params = presets.init_params(model, seed=seed, sample_length=8)
    return config, model, random_scales(params, seed, scaled_queries=scaled_queries)


def gemma_logits(model: Any, params: dict, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(model.apply({"params": params}, tokens).logits, np.float32)


def draw_hf_weights(model: Any, seed: int, *, round_to_bfloat16: bool = False) -> None:
    """Every parameter and ``layer_scalar`` of an HF Gemma 4 drawn anew (HF's own init leaves
    norms at one and weights at std 0.02): weights N(0, 1/fan_in), 1-D scales 1 + N(0, 0.3),
    query norms scaled by ``head_dim ** -0.5``. ``round_to_bfloat16``: values exact in two
    bytes (the fixtures store them so)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    per_layer = getattr(model.config, "hidden_size_per_layer_input", 0) or 1
    weights = dict(model.named_parameters())  # the tied lm_head is the embedding, once
    weights.update((n, b) for n, b in model.named_buffers() if n.endswith("layer_scalar"))
    with torch.no_grad():
        for name, tensor in weights.items():
            if tensor.ndim == 1:
                value = 1 + NORM_NOISE * torch.randn(tensor.shape, generator=generator)
                if name.endswith("self_attn.q_norm.weight"):
                    value *= tensor.shape[0] ** -0.5
            else:
                # embed_tokens_per_layer's rows hold every layer's P entries, each scaled by
                # sqrt(P) on input; every other weight's last axis is its input.
                fan_in = per_layer if "embed_tokens_per_layer" in name else tensor.shape[-1]
                value = torch.randn(tensor.shape, generator=generator) * fan_in ** -0.5
            if round_to_bfloat16:
                value = value.to(torch.bfloat16)
            tensor.copy_(value.to(tensor.dtype))


def hf_model(model_dir: Path) -> Any:
    import torch
    import transformers

    model = transformers.Gemma4ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def hf_logits(model: Any, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation (its KV cache; no stop token, ``steps`` new tokens)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps,
                             do_sample=False, top_p=None, top_k=None)
    return out[0].tolist()


def gemma_greedy(model: Any, params: dict, prompt: list[int], steps: int) -> list[int]:
    """gemma's greedy continuation: one causal forward pass of a fixed length per token (one
    compile; the positions after the current one cannot reach it through a causal mask)."""
    import jax
    import jax.numpy as jnp

    length = len(prompt) + steps
    causal = jnp.tril(jnp.ones((1, length, length), bool))
    positions = jnp.arange(length)[None]
    forward = jax.jit(lambda tokens: model.apply(
        {"params": params}, tokens, positions=positions, attention_mask=causal).logits)
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(prompt)] = prompt
    for t in range(len(prompt), length):
        ids[0, t] = int(np.argmax(np.asarray(forward(ids))[0, t - 1]))
    return ids[0].tolist()


def greedy(results: dict, label: str, hf: Any, model: Any, params: dict, prompt: list[int]
           ) -> None:
    by_hf = hf_greedy(hf, prompt, GREEDY_STEPS)
    by_gemma = gemma_greedy(model, params, prompt, GREEDY_STEPS)
    same = by_hf == by_gemma
    results[label] = {"hf": by_hf, "gemma": by_gemma,
                      "distinct_new_tokens": len(set(by_hf[len(prompt):])), "ok": same}
    print(f"{label}: {GREEDY_STEPS} tokens identical: {same} "
          f"({len(set(by_hf[len(prompt):]))} distinct)")


def conditioning(name: str, vocab: int, tokens: np.ndarray, sp_path: Path, out: Path
                 ) -> dict[str, float]:
    """With the query-norm scales near 1: how far each library's float32 logits are from the
    float64 ones, and from each other. The float64 reference is gemma's under
    ``jax.enable_x64`` (HF's Gemma 4 keeps its norms and softmax in float32 whatever the model's
    dtype, so it has none); a mapping error would put HF far from it, rounding alone as near as
    gemma's own float32 result."""
    import jax
    import jax.numpy as jnp

    from gemmalab.model import presets
    from gemmalab.weights import hf_layout

    config, model, params = gemma_model(name, vocab, seed=2, scaled_queries=False)
    hf_layout.export_hf(params, config, sp_path, out, dtype="float32")
    gemma32 = gemma_logits(model, params, tokens).astype(np.float64)
    hf32 = hf_logits(hf_model(out), tokens).astype(np.float64)
    with jax.enable_x64(True):
        wide_model = presets.build_model(config, param_dtype=jnp.float64)
        wide = jax.tree.map(lambda w: jnp.asarray(w, jnp.float64), params)
        gemma64 = np.asarray(wide_model.apply({"params": wide}, jnp.asarray(tokens)).logits)

    def diff(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a - b)))

    return {"gemma_vs_hf_float32": diff(gemma32, hf32),
            "gemma_float32_vs_float64": diff(gemma32, gemma64),
            "hf_float32_vs_float64": diff(hf32, gemma64)}


def gemma4_pieces(sp_path: Path, out: Path) -> Path:
    """A copy of a local SentencePiece model whose turn pieces are Gemma 4's (``<|turn>``,
    ``<turn|>`` where Gemma 3's ``<start_of_turn>``, ``<end_of_turn>`` were)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sp_path.read_bytes())
    renamed = {"<start_of_turn>": "<|turn>", "<end_of_turn>": "<turn|>"}
    for piece in proto.pieces:
        piece.piece = renamed.get(piece.piece, piece.piece)
    out.write_bytes(proto.SerializeToString())
    return out


def tokenizer_check(results: dict, params_and_config: tuple[dict, Any], sp_path: Path,
                    out: Path) -> None:
    """``AutoTokenizer`` on an export whose tokenizer has Gemma 4's turn pieces: the same ids as
    SentencePiece, Gemma 4's chat template and stop tokens."""
    import sentencepiece as spm
    import transformers

    from gemmalab.weights import hf_layout

    params, config = params_and_config
    pieces = gemma4_pieces(sp_path, out / "gemma4-tokenizer.model")
    hf_layout.export_hf(params, config, pieces, out / "gemma4-tokenizer-hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "gemma4-tokenizer-hf")
    processor = spm.SentencePieceProcessor(model_file=str(pieces))
    text = "Once upon a time\n<|turn>user\nHi<turn|>\n"
    same = tokenizer(text)["input_ids"] == [processor.bos_id(), *processor.EncodeAsIds(text)]
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
        tokenize=False, add_generation_prompt=True)
    want = ("<bos><|turn>system\nBe brief<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\nHello"
            "<turn|>\n<|turn>user\nBye<turn|>\n<|turn>model\n")
    stops = tokenizer.convert_ids_to_tokens(
        transformers.GenerationConfig.from_pretrained(out / "gemma4-tokenizer-hf").eos_token_id)
    results["gemma4 tokenizer"] = {"same_ids": same, "chat": chat, "stops": stops,
                                   "ok": same and chat == want and stops == ["<eos>", "<turn|>"]}
    print(f"gemma4 tokenizer: same ids as SentencePiece: {same}; chat template {chat!r}; "
          f"stops {stops}")


def run(results: dict, out: Path, sp_path: Path, vocab: int, tolerance: float,
        check: Callable[..., None]) -> None:
    """The four checks above for each tiny Gemma 4 preset, into ``results``."""
    import jax

    from gemmalab.weights import hf_layout

    rng = np.random.default_rng(0)
    tokens = rng.integers(3, vocab, size=(2, SEQ_LEN)).astype(np.int32)
    tokens[:, 0] = 2  # BOS
    for seed, name in enumerate(PRESETS):
        config, model, params = gemma_model(name, vocab, seed=seed)
        exported = out / f"{name}-hf"
        hf_layout.export_hf(params, config, sp_path, exported, dtype="float32")
        hf = hf_model(exported)
        check(results, f"{name}: gemmalab export -> HF", hf_logits(hf, tokens),
              gemma_logits(model, params, tokens), tolerance)

        prompt = tokens[0, :GREEDY_PROMPT].tolist()
        greedy(results, f"{name}: greedy, export", hf, model, params, prompt)

        draw_hf_weights(hf, seed=10 + seed)
        saved = out / f"{name}-saved-by-transformers"
        hf.save_pretrained(saved)
        abstract = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, np.float32), params)
        imported = hf_layout.load_hf_params(saved, abstract)
        check(results, f"{name}: HF save_pretrained -> gemmalab", hf_logits(hf, tokens),
              gemma_logits(model, imported, tokens), tolerance)
        greedy(results, f"{name}: greedy, import", hf, model, imported, prompt)

        figures = conditioning(name, vocab, tokens, sp_path, out / f"{name}-query-norms-near-1")
        # HF is no further from the float64 result than float32 rounding puts gemma.
        ok = figures["hf_float32_vs_float64"] <= 2 * figures["gemma_float32_vs_float64"]
        results[f"{name}: query norms near 1"] = {**figures, "ok": ok}
        print(f"{name}: query norms near 1: " + ", ".join(
            f"{k} {v:.1e}" for k, v in figures.items()) + f" {'ok' if ok else 'FAIL'}")
        if seed == 0:
            tokenizer_check(results, (params, config), sp_path, out)
