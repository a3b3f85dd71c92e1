"""A fine-tuned run's GGUF export run by the real llama.cpp (node-llama-cpp's prebuilt CPU build),
against gemmalab's own model. ``make llamacpp`` installs node-llama-cpp into .llamacpp/ first.

    .venv/bin/python bench/llamacpp_check.py --run runs/demo [--chat-run runs/chat] \\
        --node-dir .llamacpp --out runs/llamacpp

For each type (bf16, q8_0) the run is exported by the CLI's path (``export.export_run``: a LoRA
run's merged weights), then llama.cpp (bench/llamacpp/check.mjs):

1. loads the file (its architecture, vocabulary size, special tokens as it reads them);
2. continues the demo prompt greedily: its tokens must equal gemmalab's (float32) on every
   position gemmalab decides, i.e. up to the first whose top-2 logit margin is below
   ``--margin`` (the decided-token rule of gemmalab.model.sampling and the notebook tests);
3. scores the run's held-out rows (its eval split, one window per row, no packing): its
   perplexity must be within 1% (bf16) or 3% (q8_0) of gemmalab's own eval code's (float32
   compute) on the same tokens;
4. tokenizes public parity strings (ASCII, unicode, whitespace runs, digits, code, emoji): the
   same ids as the run's SentencePiece tokenizer (what gemmalab trains and samples with);
5. with ``--chat-run``: that chat run's export carries Gemma's chat template; llama.cpp's own
   Jinja engine renders sample conversations and tokenizes them (special pieces parsed): the
   same ids as gemmalab's prompt (BOS + the chat template's text, gemmalab.data.chat).

Writes ``<out>/llamacpp.json``; exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

PROMPT = "Once upon a time, there was a girl named Amy."  # the demo's (notebooks/train.ipynb)
PERPLEXITY_TOLERANCE = {"bf16": 0.01, "q8_0": 0.03, "f16": 0.01, "f32": 0.01}
# Tokenizer parity strings: public texts whose Gemma 3 ids tests/weights/test_gguf_vocab.py holds
# from Google's tokenizer, and a few more kinds of text.
PARITY_TEXTS = [
    "Hello, world!",
    "The capital of France is",
    "1+1=2",
    "def foo():\n    return 42",
    "I'm don't can't",
    "Hello 你好",
    "  spaces  and\ttabs",
    "emoji: 🎉🚀",
    "Ünïcödé façade naïve — “quotes” …",
    "日本語のテキストと한국어",
    "3.14159 and 2,718,281 and 0x1F",
    "\n\n\n    indented\n\t\ttabs   trailing   ",
    "for (int i = 0; i < n; ++i) { x[i] *= 2; }  // C++",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag",
]
CHAT_CONVERSATIONS = [
    [{"role": "user", "content": "Write a story about a cat named Tom."}],
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "model", "content": "4."},
     {"role": "user", "content": "And times 3?"}],
]


def gemmalab_side(run_dir: Path, max_new_tokens: int) -> dict:
    """gemmalab's greedy continuation (tokens, margins), held-out rows and perplexity, all in
    float32 compute on the run's params."""
    import jax
    import jax.numpy as jnp
    import sentencepiece as spm

    from gemmalab.data import packing
    from gemmalab.inspect import compare
    from gemmalab.model import mesh, sharding
    from gemmalab.train import optimization
    from gemmalab.weights import orbax_params

    run = compare.load_run(str(run_dir))
    params = jax.tree.map(lambda w: jnp.asarray(w, jnp.float32),
                          orbax_params.load_params(str(run_dir / "params")))
    processor = spm.SentencePieceProcessor()
    processor.Load(str(run_dir / "tokenizer.model"))
    model = run.model

    # Greedy, teacher-forced on a fixed length (one compilation), with each choice's margin.
    prompt = [processor.bos_id(), *processor.EncodeAsIds(PROMPT)]
    length = 128
    assert len(prompt) + max_new_tokens <= length

    @jax.jit
    def logits_at(ids, last):
        causal = jnp.tril(jnp.ones((length, length), bool))[None]
        out = model.apply({"params": params}, ids, positions=jnp.arange(length)[None],
                          attention_mask=causal).logits[0]
        return out[last].astype(jnp.float32)

    stops = {processor.eos_id(), processor.PieceToId("<end_of_turn>")}
    ids = np.zeros((1, length), np.int32)
    ids[0, :len(prompt)] = prompt
    generated, margins = [], []
    for step in range(max_new_tokens):
        row = np.asarray(logits_at(jnp.asarray(ids), len(prompt) + step - 1))
        top2 = np.partition(row, -2)[-2:]
        token = int(np.argmax(row))
        generated.append(token)
        margins.append(float(top2[1] - top2[0]))
        ids[0, len(prompt) + step] = token
        if token in stops:
            break

    # Held-out rows: the eval split, one window per row (llama.cpp scores one sequence each).
    config = run.config
    batches = packing.eval_batches(run.data.cache.eval, maxlen=config.data.maxlen,
                                   batch_size=config.trainer.batch_size, packing=False)
    sequences, masks = [], []
    for batch in batches:
        for tokens, targets, mask in zip(batch["tokens"], batch["targets"], batch["loss_mask"],
                                         strict=True):
            if not mask.any():  # a padding row
                continue
            real = int(np.flatnonzero(mask)[-1]) + 1  # targets past the last loss are padding
            sequences.append([*tokens[:real].tolist(), int(targets[real - 1])])
            masks.append(mask[:real].astype(bool).tolist())
    device_mesh = mesh.make_mesh(config.runtime.mesh)
    shardings = sharding.param_sharding(params, device_mesh)
    perplexities = {}
    for dtype in ("float32", config.model.compute_dtype):
        step = optimization.make_eval_step(model, jnp.dtype(dtype), device_mesh, shardings)
        held_out = optimization.evaluate(step, jax.device_put(params, shardings), batches,
                                         device_mesh)
        perplexities[dtype] = held_out["eval_perplexity"]
    return {"prompt": prompt, "generated": generated, "margins": margins,
            "sequences": sequences, "masks": masks, "perplexity": perplexities,
            "scored_tokens": int(sum(sum(m) for m in masks)),
            "parity": [processor.EncodeAsIds(text) for text in PARITY_TEXTS],
            "decoded": processor.DecodeIds(generated)}


def chat_prompts(run_dir: Path) -> list[list[int]]:
    """gemmalab's prompt ids for CHAT_CONVERSATIONS: BOS + the chat template's text
    (gemmalab.data.chat.prompt_text), encoded by the run's tokenizer as the sampler does."""
    import sentencepiece as spm

    from gemmalab.data import chat

    processor = spm.SentencePieceProcessor()
    processor.Load(str(run_dir / "tokenizer.model"))
    markers = chat.markers_of(processor)
    return [[processor.bos_id(), *processor.EncodeAsIds(chat.prompt_text(
        [(m["role"], m["content"]) for m in conversation], markers))]
        for conversation in CHAT_CONVERSATIONS]


def llamacpp(node_dir: Path, request: dict, work: Path, name: str, threads: int) -> dict:
    """One request to bench/llamacpp/check.mjs (copied next to node-llama-cpp's node_modules,
    where node resolves its import)."""
    script = node_dir / "check.mjs"
    shutil.copyfile(Path(__file__).parent / "llamacpp" / "check.mjs", script)
    request_path, result_path = work / f"{name}-request.json", work / f"{name}-result.json"
    request_path.write_text(json.dumps({"threads": threads, **request}))
    started = time.perf_counter()
    subprocess.run(["node", str(script.resolve()), str(request_path.resolve()),
                    str(result_path.resolve())], check=True, cwd=node_dir)
    result = json.loads(result_path.read_text())
    result["wall_seconds"] = time.perf_counter() - started
    return result


def decided_agreement(ours: list[int], margins: list[float], theirs: list[int],
                      margin: float) -> dict:
    """The decided-token rule: gemmalab's choices up to the first one that won by less than
    ``margin`` logits; llama.cpp's tokens must equal them there."""
    weak = [i for i, m in enumerate(margins) if m < margin]
    decided = weak[0] if weak else len(ours)
    same = theirs[:decided] == ours[:decided]
    first_difference = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
                             if a != b), None)
    return {"decided_positions": decided, "equal_on_decided": same,
            "identical": ours == theirs, "first_difference": first_difference, "ok": same}


def perplexity(logprobs: list[list[float]], masks: list[list[bool]]) -> float:
    total = sum(-lp for row, mask in zip(logprobs, masks, strict=True)
                for lp, m in zip(row, mask, strict=True) if m)
    count = sum(sum(mask) for mask in masks)
    return math.exp(total / count)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="runs/demo", help="a finished (fine-tuned) run")
    parser.add_argument("--chat-run", help="a finished chat run: its chat template is checked")
    parser.add_argument("--node-dir", default=".llamacpp", help="where node-llama-cpp is installed")
    parser.add_argument("--out", default="runs/llamacpp")
    parser.add_argument("--types", default="bf16,q8_0")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--margin", type=float, default=0.5,
                        help="logits gemmalab's greedy choice must win by to count as decided")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from gemmalab.weights import export

    run, out, node_dir = Path(args.run), Path(args.out), Path(args.node_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {"command": " ".join(sys.argv), "run": str(run),
                     "python": platform.python_version(), "types": {}}
    # gemmalab's side is kept in <out> for a rerun on the same run (`make llamacpp` starts afresh).
    cached = out / "gemmalab-side.json"
    key = [str(run.resolve()), (run / "summary.json").stat().st_mtime_ns, args.max_new_tokens]
    if cached.is_file() and json.loads(cached.read_text())["key"] == key:
        ours = json.loads(cached.read_text())
    else:
        print("gemmalab: greedy continuation, held-out perplexity, tokenization ...", flush=True)
        ours = gemmalab_side(run, args.max_new_tokens)
        cached.write_text(json.dumps({"key": key, **ours}))
    results["gemmalab"] = {k: ours[k] for k in ("prompt", "generated", "margins", "perplexity",
                                                "scored_tokens", "decoded")}
    results["gemmalab"]["rows"] = len(ours["sequences"])
    reference = ours["perplexity"]["float32"]
    for gguf_type in args.types.split(","):
        timings: dict = {}
        (path,) = export.export_run(run, "gguf", out, gguf_type=gguf_type, force=True,
                                    timings=timings)
        print(f"{gguf_type}: {path}, {timings['bytes'] / 1e6:.1f} MB in "
              f"{timings['seconds']:.2f} s; llama.cpp ...", flush=True)
        theirs = llamacpp(node_dir, {
            "model": str(Path(path).resolve()), "tokenize": PARITY_TEXTS,
            "greedy": {"prompt": ours["prompt"], "max_new_tokens": args.max_new_tokens,
                       "stops": [1, 106]},
            "score": ours["sequences"], "context_size": 256}, out, gguf_type, args.threads)
        ppl = perplexity(theirs["score"], ours["masks"])
        tolerance = PERPLEXITY_TOLERANCE[gguf_type]
        row = {
            "file": path, "MB": round(timings["bytes"] / 1e6, 1),
            "export_seconds": round(timings["seconds"], 2),
            "export_MB_per_s": round(timings["bytes"] / 1e6 / timings["seconds"], 1),
            "loaded": {"architecture": theirs["architecture"], "vocab_size": theirs["vocab_size"],
                       "vocabulary_type": theirs["vocabulary_type"],
                       "bos": theirs["bos"], "eos": theirs["eos"], "eot": theirs["eot"],
                       "train_context_size": theirs["train_context_size"],
                       "load_seconds": round(theirs["load_seconds"], 2),
                       "ok": (theirs["architecture"], theirs["vocabulary_type"]) == ("gemma3",
                                                                                    "spm")},
            "greedy": {"tokens": theirs["greedy"]["tokens"],
                       **decided_agreement(ours["generated"], ours["margins"],
                                           theirs["greedy"]["tokens"], args.margin)},
            "perplexity": {"llama.cpp": ppl, "gemmalab float32": reference,
                           "relative difference": ppl / reference - 1, "tolerance": tolerance,
                           "ok": abs(ppl / reference - 1) <= tolerance,
                           "score_seconds": round(theirs["score_seconds"], 1)},
            "tokenizer": {"strings": len(PARITY_TEXTS),
                          "equal": sum(a == b for a, b in zip(theirs["tokenize"], ours["parity"],
                                                              strict=True)),
                          "differ": [t for t, a, b in zip(PARITY_TEXTS, theirs["tokenize"],
                                                          ours["parity"], strict=True) if a != b]},
            "llama_cpp": theirs["llama_cpp"],
        }
        row["tokenizer"]["ok"] = not row["tokenizer"]["differ"]
        row["ok"] = all(row[k]["ok"] for k in ("loaded", "greedy", "perplexity", "tokenizer"))
        results["types"][gguf_type] = row
        print(json.dumps({k: v for k, v in row.items() if k != "greedy"}, indent=1), flush=True)
        print(f"greedy: {row['greedy']}", flush=True)
    if args.chat_run:
        results["chat"] = chat_check(Path(args.chat_run), out, node_dir, args.threads)
        print(f"chat: {results['chat']}", flush=True)
    results["seconds"] = round(time.perf_counter() - started, 1)
    checks = [*results["types"].values(), results.get("chat", {"ok": True})]
    results["ok"] = all(check["ok"] for check in checks)
    (out / "llamacpp.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"{'all checks hold' if results['ok'] else 'FAILED'}; {results['seconds']} s; "
          f"wrote {out / 'llamacpp.json'}")
    return 0 if results["ok"] else 1


def chat_check(run: Path, out: Path, node_dir: Path, threads: int) -> dict:
    """The chat run's export: llama.cpp renders its template and tokenizes the result."""
    from gemmalab.weights import export

    (path,) = export.export_run(run, "gguf", out / "chat", gguf_type="bf16", force=True)
    theirs = llamacpp(node_dir, {"model": str(Path(path).resolve()), "chat": CHAT_CONVERSATIONS,
                                 "context_size": 256}, out, "chat", threads)
    ours = chat_prompts(run)
    rendered = theirs.get("chat") or []
    equal = [r["tokens"] == o for r, o in zip(rendered, ours, strict=False)]
    return {"file": path, "template_in_file": theirs["chat_template_present"],
            "conversations": len(CHAT_CONVERSATIONS), "equal": sum(equal),
            "rendered": [r["text"] for r in rendered], "eot": theirs["eot"],
            "ok": theirs["chat_template_present"] and len(equal) == len(ours) and all(equal)}


if __name__ == "__main__":
    sys.exit(main())
