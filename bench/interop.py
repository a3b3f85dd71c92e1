"""gemmalab's exports loaded by the real transformers and peft on the CPU; logits against gemma's.

    make interop          # installs torch, transformers, peft, safetensors into .interop/ first
    .venv/bin/python bench/interop.py --site-packages .interop --out runs/interop [--run runs/demo]

On the tiny preset (random weights, norm scales and LoRA ``b`` made non-zero so every weight
matters), with a SentencePiece tokenizer trained on the embedded corpus:

1. ``export_hf`` (float32, then bfloat16, then sharded) -> ``Gemma3ForCausalLM.from_pretrained``:
   logits on the same tokens as gemma's model (rows longer than the sliding window, so the local
   layers' masks are exercised), max abs difference against ``--tolerance``;
2. ``export_peft`` -> ``PeftModel.from_pretrained`` on the HF base: logits against gemma's LoRA
   model (``gemmalab.model.lora``, scale alpha / rank);
3. the tokenizer files -> ``AutoTokenizer``: the same ids as SentencePiece, the chat template;
4. import back: the directory transformers itself saves (``save_pretrained``) read by
   ``load_hf_params`` equals the original params; the real ``safetensors`` reads our files;
5. with ``--run``: a finished run exported as the CLI does; transformers' greedy continuation of
   a prompt and its logits against gemma's;
6. Gemma 4 (``bench/interop_gemma4.py``): the tiny dense and mixture-of-experts presets exported
   to ``Gemma4ForCausalLM`` and HF's own saved back into gemmalab (logits, greedy tokens, float64),
   and a Gemma 4 tokenizer's chat template.

Exits non-zero if any figure is outside its tolerance; writes ``<out>/interop.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

VOCAB = 1024
RANK, ALPHA = 8, 16
SEQ_LEN = 200  # > the tiny preset's sliding window (128)
TEXT = "Once upon a time, there was a girl named Amy. She liked to play in the park."


def gemma_setup(out: Path):
    import jax
    import jax.numpy as jnp

    from gemmalab.data import corpus, documents, tokenizer
    from gemmalab.model import lora, presets

    stories = corpus.write_corpus(out / "stories.txt", 2000, seed=0)
    sp_path = tokenizer.train_local_tokenizer(documents.iter_stories(str(stories)),
                                              out / "tokenizer.model", vocab_size=VOCAB)
    config = presets.model_config("gemma3-tiny", VOCAB)
    model = presets.build_model(config, param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=8)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, w: (w + rng.normal(0, 0.3, w.shape).astype(np.float32)
                         if path[-1].key == "scale" else w), params)
    adapters = lora.init_adapters(config, rank=RANK, modules="all", dtype="float32", seed=1)
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, w: (rng.normal(0, 0.05, w.shape).astype(np.float32)
                         if path[-1].key == "b" else w), adapters)
    tokens = rng.integers(3, VOCAB, size=(2, SEQ_LEN)).astype(np.int32)
    tokens[:, 0] = 2  # BOS
    return config, model, params, adapters, tokens, sp_path


def gemma_logits(model, params, tokens) -> np.ndarray:
    return np.asarray(model.apply({"params": params}, tokens).logits, np.float32)


def hf_logits(model_dir: Path, tokens: np.ndarray, adapter_dir: Path | None = None):
    import torch
    import transformers

    model = transformers.Gemma3ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64))).logits
    return logits.float().numpy(), model


def bf16_rounded(params):
    import jax
    import ml_dtypes

    return jax.tree.map(lambda w: np.asarray(w).astype(ml_dtypes.bfloat16).astype(np.float32),
                        params)


def check(results: dict, name: str, got: np.ndarray, want: np.ndarray, tolerance: float, *,
          scaled: bool = False) -> None:
    """``scaled``: the tolerance is relative to the largest logit (a real model's logits reach
    ~50, and float32's rounding of them grows with it); else absolute."""
    diff = float(np.max(np.abs(got - want)))
    largest = float(np.max(np.abs(want)))
    allowed = tolerance * max(1.0, largest) if scaled else tolerance
    results[name] = {"max_abs_logit_diff": diff, "max_abs_logit": largest,
                     "tolerance": allowed, "ok": diff <= allowed}
    relative = f" = {tolerance:g} x max |logit|" if scaled else ""
    print(f"{name:<34} max |logit diff| {diff:.3e}  (max |logit| {largest:.2f}, "
          f"tolerance {allowed:g}{relative}) {'ok' if diff <= allowed else 'FAIL'}")


def tokenizer_checks(results: dict, hf_dir: Path, sp_path: Path) -> None:
    import sentencepiece as spm
    import transformers

    processor = spm.SentencePieceProcessor(model_file=str(sp_path))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = TEXT + "\n<start_of_turn>user\nHi<end_of_turn>\n"
    want = [processor.bos_id(), *processor.EncodeAsIds(text)]
    got = hf_tokenizer(text)["input_ids"]
    chat = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        tokenize=False, add_generation_prompt=False)
    results["tokenizer"] = {
        "class": type(hf_tokenizer).__name__, "same_ids": got == want,
        "chat": chat, "ok": got == want and chat == (
            "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello"
            "<end_of_turn>\n")}
    print(f"tokenizer {type(hf_tokenizer).__name__}: same ids as SentencePiece: {got == want}; "
          f"chat template {chat!r}")
    if got != want:
        print(f"  sentencepiece {want[:24]}\n  transformers  {got[:24]}")


def import_back(results: dict, hf_model, params, out: Path, ours: Path) -> None:
    import jax
    from safetensors.numpy import load_file

    from gemmalab.weights import hf_layout, safetensors_io

    saved_by_hf = out / "saved-by-transformers"
    hf_model.save_pretrained(saved_by_hf)
    abstract = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, np.float32), params)
    loaded = hf_layout.load_hf_params(saved_by_hf, abstract)
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True))
    by_library = load_file(str(ours / "model.safetensors"))
    by_us = safetensors_io.read_file(ours / "model.safetensors")
    readable = set(by_library) == set(by_us) and all(
        np.array_equal(by_library[k], by_us[k]) for k in by_us)
    results["import_back"] = {"transformers_saved_dir_equals_params": same,
                              "safetensors_library_reads_our_file": readable,
                              "ok": same and readable}
    print(f"import back: transformers' save_pretrained dir -> load_hf_params equal: {same}; "
          f"safetensors reads ours: {readable}")


def trained_run_check(results: dict, run_dir: Path, out: Path, tolerance: float) -> None:
    """A finished run exported by the CLI's path: transformers' greedy continuation of the
    demo prompt against gemma's (same stop tokens), and the logits along it."""
    import jax.numpy as jnp
    import torch
    import transformers

    from gemmalab.model import presets
    from gemmalab.weights import export, orbax_params

    hf_dir = out / "run-hf"
    export.export_run(run_dir, "hf", hf_dir, dtype="float32")
    summary = json.loads((run_dir / "summary.json").read_text())
    model = presets.build_model(presets.config_from_dict(summary["model_config"]),
                                param_dtype=jnp.float32)
    params = orbax_params.load_params(str(run_dir / "params"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    stops = json.loads((hf_dir / "generation_config.json").read_text())["eos_token_id"]
    prompt = tokenizer(TEXT.split(". ")[0] + ".")["input_ids"]
    hf_model = transformers.Gemma3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    with torch.no_grad():
        hf_ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                   top_p=None, top_k=None)[0].tolist()
    gemma_ids = list(prompt)
    for _ in range(24):
        step = int(np.argmax(gemma_logits(model, params, np.array([gemma_ids]))[0, -1]))
        gemma_ids.append(step)
        if step in stops:
            break
    with torch.no_grad():
        hf_along = hf_model(torch.tensor([gemma_ids])).logits.float().numpy()
    check(results, f"trained run {run_dir.name}: logits", hf_along,
          gemma_logits(model, params, np.array([gemma_ids])), tolerance, scaled=True)
    same = hf_ids == gemma_ids
    results["trained_run"] = {"run": str(run_dir), "same_greedy_tokens": same,
                              "text": tokenizer.decode(hf_ids), "ok": same}
    print(f"greedy continuation identical: {same}: {tokenizer.decode(hf_ids)!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site-packages", default=".interop",
                        help="where torch/transformers/peft are (appended to sys.path)")
    parser.add_argument("--out", default="runs/interop")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="max abs logit difference allowed (float32 on both sides)")
    parser.add_argument("--run", help="also export this finished run (e.g. runs/demo) and "
                        "compare transformers' greedy continuation with gemma's")
    parser.add_argument("--families", default="gemma3,gemma4",
                        help="which model families to check (comma-separated)")
    args = parser.parse_args()
    sys.path.append(str(Path(args.site_packages).resolve()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import peft
    import safetensors
    import torch
    import torch._dynamo  # noqa: F401 - loads triton's LLVM before jaxlib's (the reverse aborts)
    import transformers

    from gemmalab.model import lora
    from gemmalab.weights import hf_layout, peft_adapters

    torch.set_num_threads(2)
    started = time.perf_counter()
    families = set(args.families.split(","))
    config, model, params, adapters, tokens, sp_path = gemma_setup(out)
    results: dict = {"command": " ".join(sys.argv), "python": platform.python_version(),
                     "versions": {"torch": torch.__version__,
                                  "transformers": transformers.__version__,
                                  "peft": peft.__version__, "safetensors": safetensors.__version__},
                     "tokens": list(tokens.shape)}
    if "gemma4" in families:
        import interop_gemma4

        interop_gemma4.run(results, out, sp_path, VOCAB, args.tolerance, check)
    if "gemma3" not in families:
        return finish(results, out, started)
    want = gemma_logits(model, params, tokens)

    hf_layout.export_hf(params, config, sp_path, out / "hf-f32", dtype="float32")
    got, hf_model = hf_logits(out / "hf-f32", tokens)
    check(results, "hf float32 export", got, want, args.tolerance)

    hf_layout.export_hf(params, config, sp_path, out / "hf-bf16")
    got, _ = hf_logits(out / "hf-bf16", tokens)
    check(results, "hf bfloat16 export (vs rounded)", got,
          gemma_logits(model, bf16_rounded(params), tokens), args.tolerance)

    hf_layout.export_hf(params, config, sp_path, out / "hf-sharded", dtype="float32",
                        max_shard_bytes=500_000)
    got, _ = hf_logits(out / "hf-sharded", tokens)
    check(results, "hf sharded export", got, want, args.tolerance)

    lora_model = lora.wrap(model, rank=RANK, alpha=ALPHA, modules="all", dtype=np.float32)
    peft_adapters.export_peft(adapters, config, out / "peft", rank=RANK, alpha=ALPHA,
                              base_model_name_or_path=str(out / "hf-f32"))
    got, _ = hf_logits(out / "hf-f32", tokens, adapter_dir=out / "peft")
    check(results, "peft adapter on hf base", got,
          gemma_logits(lora_model, lora.join(params, adapters), tokens), args.tolerance)
    results["lora_delta_share"] = float(np.max(np.abs(
        gemma_logits(lora_model, lora.join(params, adapters), tokens) - want)))
    print(f"(the adapter moves gemma's logits by up to {results['lora_delta_share']:.2f})")

    tokenizer_checks(results, out / "hf-f32", sp_path)
    import_back(results, hf_model, params, out, out / "hf-f32")
    if args.run:
        trained_run_check(results, Path(args.run), out, args.tolerance)
    return finish(results, out, started)


def finish(results: dict, out: Path, started: float) -> int:
    """Write ``interop.json``; 0 if every check held."""
    results["seconds"] = round(time.perf_counter() - started, 1)
    ok = all(v.get("ok", True) for v in results.values() if isinstance(v, dict))
    results["ok"] = ok
    (out / "interop.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'all within tolerance' if ok else 'FAILED'}; {results['seconds']} s; "
          f"versions {results['versions']}; wrote {out / 'interop.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
