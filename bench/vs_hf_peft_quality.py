"""Time to quality on the real base: the training seconds gemmalab's defaults need to reach the
held-out perplexity transformers + PEFT reaches after ``--peft-steps`` steps of its usual recipe.

    make interop   # once: torch, transformers and peft into .interop/ (never into .venv)
    .venv/bin/python bench/vs_hf_peft_quality.py --site-packages .interop --out runs/vs-peft-quality

- The model, tokenizer and LoRA shape are ``vs_hf_peft``'s: the embedded Gemma 3 270M base (the
  GGUF, exported to HF for transformers), its own vocabulary, rank 8 on all seven projections.
- The prose: English written by people, found offline: the long descriptions of the installed
  Python packages and the prose paragraphs of Python's own reference manual (``pydoc_data``),
  in documents of 50-700 tokens. A fixed share (by a hash of each text) is held out: neither
  side trains on it.
- Held-out perplexity: the mean NLL over every target of the held-out documents, cut into
  ``maxlen`` windows, the same windows and float32 forward passes on both sides.
- transformers + PEFT, the recipe of ``transformers.Trainer``'s defaults: AdamW at lr 2e-4, no
  weight decay, linear decay to 0 with no warmup, gradients clipped at 1.0; windows of the
  training documents padded to each batch's longest, padding out of the loss.
- gemmalab: its defaults for a LoRA run of the same length (packed rows, bfloat16 compute, the
  preset's LoRA rate, 1e-3 for the 270M, with 5% warmup and cosine decay, alpha = rank) through
  ``Experiment``'s own step and batches; only the held-out evaluation in between is added (and
  not timed). ``--gemmalab-lr 2e-4`` runs it at PEFT's rate instead.

Training seconds are the steps' own (data included), the first step (compile or warm-up) left
out on both sides. Both sides run in one invocation, in two processes that take turns of
``--turns`` steps (so both see the same machine); ``--turns 0`` runs PEFT to its end, then
gemmalab until it reaches PEFT's final loss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import vs_hf_peft

HELD_OUT_SHARE = 0.15
EVAL_BATCH = 8


class Turns:
    """Both sides' processes take turns, ``block`` steps each, so that both see the same machine:
    a shared VM's speed moves by up to 2x within minutes, and a run of one side after the other
    would measure the host's mood as much as the loops. ``block`` 0: no turns (run straight)."""

    def __init__(self, block: int):
        self.block = block

    def ready(self) -> None:
        """Loaded and compiled: the parent starts the turns once both sides are."""
        if self.block:
            print("READY", flush=True)

    def before(self, step: int) -> None:
        if self.block and (step - 1) % self.block == 0 and sys.stdin.readline().strip() != "go":
            raise SystemExit("the parent went away")

    def after(self, step: int, last: bool) -> None:
        if self.block and step % self.block == 0 and not last:  # the last turn ends in RESULT
            print("TURN", flush=True)


def manual_documents() -> list[str]:
    """Prose paragraphs of Python's reference manual, grouped by topic (code, grammar and
    tables left out: their lines are indented or mostly symbols)."""
    from pydoc_data.topics import topics

    documents = []
    for name in sorted(topics):
        paragraphs = []
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            lines = paragraph.splitlines()
            if not lines or any(line.startswith(" ") for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            letters = sum(c.isalpha() or c.isspace() for c in text) / max(len(text), 1)
            if len(text) > 80 and letters > 0.9 and text.isascii():
                paragraphs.append(text)
        for start in range(0, len(paragraphs), 6):  # a document: up to six paragraphs
            documents.append("\n\n".join(paragraphs[start:start + 6]))
    return documents


def held_out(text: str, salt: str = "") -> bool:
    digest = hashlib.sha256((salt + text).encode()).hexdigest()
    return int(digest[:8], 16) / 2**32 < HELD_OUT_SHARE


def split_of(text: str, validation: bool) -> str | None:
    """``held_out`` or ``train``; with ``validation`` the held-out documents are left out and a
    salted share of the training documents is held out in their place (for choosing a recipe
    without looking at the documents its figure is measured on)."""
    if not validation:
        return "held_out" if held_out(text) else "train"
    if held_out(text):
        return None
    return "held_out" if held_out(text, salt="validation:") else "train"


def prepare(out: Path, cache_dir: Path, validation: bool = False) -> dict:
    """The train corpus (gemmalab's text format), both splits tokenized, the HF export."""
    from gemmalab.config import TrainConfig
    from gemmalab.train.experiment import Experiment
    from gemmalab.weights import hf_layout

    out.mkdir(parents=True, exist_ok=True)
    experiment = Experiment.prepare(TrainConfig.flat(
        checkpoint="embedded:gemma3-270m", cache_dir=str(cache_dir), lora_rank=vs_hf_peft.RANK,
        output_dir=str(out / "export-run"), max_steps=1, embedded_stories=200))
    tokenizer = experiment.tokenizer
    splits: dict[str, list[list[int]]] = {"train": [], "held_out": []}
    texts: list[str] = []
    for text in sorted(set(vs_hf_peft.prose_documents() + manual_documents())):
        ids = [2, *tokenizer.encode(text), 1]
        split = split_of(text, validation)
        if split and vs_hf_peft.MIN_TOKENS <= len(ids) - 2 <= vs_hf_peft.MAX_TOKENS:
            splits[split].append(ids)
            if split == "train":
                texts.append(text)
    (out / "prose.txt").write_text("".join(f"{t}\n<|endoftext|>\n" for t in texts),
                                   encoding="utf-8")
    (out / "splits.json").write_text(json.dumps(splits))
    if not (out / "hf").exists():
        hf_layout.export_hf(experiment.weights.frozen, experiment.prepared.model_config,
                            experiment.prepared.tokenizer_info.model_proto, out / "hf",
                            dtype="bfloat16")
    return {name: {"documents": len(docs), "tokens": sum(map(len, docs))}
            for name, docs in splits.items()}


def held_out_rows(out: Path, maxlen: int) -> list[list[int]]:
    return vs_hf_peft.windows(json.loads((out / "splits.json").read_text())["held_out"], maxlen)


def run_peft(out: Path, batch: int, maxlen: int, steps: int, every: int, dtype: str,
             turns: Turns) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM.from_pretrained(
        out / "hf", dtype=getattr(torch, dtype), attn_implementation="sdpa")
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=vs_hf_peft.RANK, lora_alpha=vs_hf_peft.ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=vs_hf_peft.LEARNING_RATE, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / steps)
    rows = vs_hf_peft.windows(json.loads((out / "splits.json").read_text())["train"], maxlen)
    evaluation = held_out_rows(out, maxlen)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()

    padded = vs_hf_peft.padded

    def held_out_loss() -> float:
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(evaluation), EVAL_BATCH):
                inputs, labels, attention = padded(evaluation[start:start + EVAL_BATCH])
                logits = model(input_ids=inputs, attention_mask=attention).logits.float()
                total += float(torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                    reduction="sum"))
                count += int((labels != -100).sum())
        model.train()
        return total / count

    curve = [{"step": 0, "seconds": 0.0, "held_out_loss": held_out_loss()}]
    seconds = useful = 0.0
    model.train()
    turns.ready()
    for step in range(1, steps + 1):
        turns.before(step)
        picked = [rows[order[((step - 1) * batch + i) % len(rows)]] for i in range(batch)]
        begin = time.perf_counter()
        inputs, labels, attention = padded(picked)
        logits = model(input_ids=inputs, attention_mask=attention).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - begin
        if step > 1:  # the first step warms up
            seconds += elapsed
            useful += int((labels != -100).sum())
        print(f"peft step {step}: {elapsed:.1f} s, loss {loss.item():.3f}", file=sys.stderr,
              flush=True)
        if step % every == 0 or step == steps:
            curve.append({"step": step, "seconds": seconds, "held_out_loss": held_out_loss()})
            print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
        turns.after(step, step == steps)
    return {"curve": curve, "useful_tokens_per_s": useful / seconds}


def run_gemmalab(out: Path, cache_dir: Path, batch: int, maxlen: int, steps: int, every: int,
                 target: float | None, turns: Turns, learning_rate: float | None = None) -> dict:
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    from gemmalab.config import TrainConfig
    from gemmalab.data import packing
    from gemmalab.train import optimization
    from gemmalab.train.experiment import Experiment

    with tempfile.TemporaryDirectory() as output_dir:
        experiment = Experiment.prepare(TrainConfig.flat(
            checkpoint="embedded:gemma3-270m", cache_dir=str(cache_dir),
            data_path=str(out / "prose.txt"), batch_size=batch, maxlen=maxlen,
            lora_rank=vs_hf_peft.RANK, max_steps=steps, eval_every=0, checkpoint_every=0,
            max_eval_stories=8, output_dir=output_dir, learning_rate=learning_rate))
        weights = experiment.weights
        evaluate_step = optimization.make_eval_step(
            experiment.model, jnp.float32, experiment.mesh, weights.state_shardings.params,
            weights.frozen_shardings)
        rows = held_out_rows(out, maxlen)
        batches = []
        for start in range(0, len(rows), EVAL_BATCH):
            picked = rows[start:start + EVAL_BATCH]
            picked += [[0, 0]] * (EVAL_BATCH - len(picked))  # whole batches; a row of padding
            fields = {name: np.zeros((EVAL_BATCH, maxlen), np.int32) for name in packing.FIELDS}
            for i, row in enumerate(picked):
                n = len(row) - 1
                real = i < len(rows) - start
                fields["tokens"][i, :n], fields["targets"][i, :n] = row[:-1], row[1:]
                fields["loss_mask"][i, :n] = fields["segment_ids"][i, :n] = int(real)
                fields["positions"][i, :n] = np.arange(n)
            batches.append(fields)

        def held_out_loss() -> float:
            return optimization.evaluate(evaluate_step, weights.state.params, batches,
                                         experiment.mesh, weights.frozen)["eval_loss"]

        train_step = experiment.compile()
        curve = [{"step": 0, "seconds": 0.0, "held_out_loss": held_out_loss()}]
        seconds = useful = 0.0
        turns.ready()
        for step in range(1, steps + 1):
            turns.before(step)
            begin = time.perf_counter()
            batch_ = experiment.next_batch()
            weights.state, metrics = train_step(weights.state, batch_, weights.frozen)
            loss = float(metrics["loss"])  # waits for the step
            elapsed = time.perf_counter() - begin
            if step > 1:
                seconds += elapsed
                useful += float(metrics["useful_tokens"])
            print(f"gemmalab step {step}: {elapsed:.1f} s, loss {loss:.3f}", file=sys.stderr,
                  flush=True)
            if step % every == 0 or step == steps:
                curve.append({"step": step, "seconds": seconds, "held_out_loss": held_out_loss()})
                print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
                if target is not None and curve[-1]["held_out_loss"] <= target:
                    break  # reached: the rest of the schedule is not needed for the figure
            turns.after(step, step == steps)
        jax.block_until_ready(weights.state)
    return {"curve": curve, "useful_tokens_per_s": useful / max(seconds, 1e-9)}


def child_command(args: argparse.Namespace, side: str, target: float | None = None) -> list[str]:
    return [sys.executable, __file__, "--one", side, "--out", str(args.out), "--cache-dir",
            str(args.cache_dir), "--site-packages", str(args.site_packages),
            "--peft-steps", str(args.peft_steps), "--gemmalab-steps", str(args.gemmalab_steps),
            "--every", str(args.every), "--batch-size", str(args.batch_size), "--maxlen",
            str(args.maxlen), "--peft-dtype", args.peft_dtype, "--turns", str(args.turns)] + (
                ["--target", repr(target)] if target is not None else []) + (
                ["--gemmalab-lr", repr(args.gemmalab_lr)] if args.gemmalab_lr else [])


def result_of(side: str, stdout: str) -> dict:
    line = next((x for x in stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{side} failed:\n{stdout[-3000:]}")
    return json.loads(line[len("RESULT "):])


def child(args: argparse.Namespace, side: str, target: float | None = None) -> dict:
    """One side alone, to its end."""
    done = subprocess.run(child_command(args, side, target), stdout=subprocess.PIPE, text=True,
                          check=False)
    return result_of(side, done.stdout)


def children_taking_turns(args: argparse.Namespace) -> dict[str, dict]:
    """Both sides at once, each waiting for its turn of ``--turns`` steps (``Turns``); both load
    and compile side by side, untimed."""
    running = {side: subprocess.Popen(child_command(args, side), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
               for side in ("peft", "gemmalab")}
    for side, process in running.items():
        if not any(line.startswith("READY") for line in process.stdout):
            raise SystemExit(f"{side} ended before its first step: its log is above")
    results: dict[str, dict] = {}
    while running:
        for side, process in list(running.items()):
            process.stdin.write("go\n")
            process.stdin.flush()
            turn_ended = False
            for line in process.stdout:
                if line.startswith("TURN"):
                    turn_ended = True
                    break
                if line.startswith("RESULT "):
                    results[side] = result_of(side, line)
                    break
            if side in results:
                process.wait()
                del running[side]
            elif not turn_ended:
                raise SystemExit(f"{side} ended without a result: its log is above")
    return results


def seconds_to_reach(curve: list[dict], target: float) -> float | None:
    return next((point["seconds"] for point in curve if point["held_out_loss"] <= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=["gemmalab", "peft"], help=argparse.SUPPRESS)
    parser.add_argument("--target", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--site-packages", type=Path, default=Path(".interop"))
    parser.add_argument("--out", type=Path, default=Path("runs/vs-peft-quality"))
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--maxlen", type=int, default=128)
    parser.add_argument("--peft-steps", type=int, default=100)
    parser.add_argument("--gemmalab-steps", type=int, default=100,
                        help="the length of gemmalab's run (its schedule); it stops once it "
                        "reaches PEFT's held-out loss")
    parser.add_argument("--gemmalab-lr", type=float, default=None,
                        help="gemmalab's peak learning rate (default: its own for the preset)")
    parser.add_argument("--every", type=int, default=10, help="steps between held-out evals")
    parser.add_argument("--validation", action="store_true",
                        help="prepare --out with a validation split of the training documents "
                        "held out instead (the held-out documents left out): for choosing a "
                        "recipe")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--turns", type=int, default=5,
                        help="steps a side runs before the other takes its turn; 0: PEFT to its "
                        "end, then gemmalab until it reaches PEFT's loss")
    parser.add_argument("--peft-dtype", default="float32", choices=["bfloat16", "float32"],
                        help="torch's weights and compute (float32 on CPUs without bf16 units)")
    args = vs_hf_peft.resolved(parser.parse_args())
    if args.one:
        turns = Turns(args.turns)
        if args.one == "peft":
            result = run_peft(args.out, args.batch_size, args.maxlen, args.peft_steps,
                              args.every, args.peft_dtype, turns)
        else:
            result = run_gemmalab(args.out, args.cache_dir, args.batch_size, args.maxlen,
                                  args.gemmalab_steps, args.every, args.target, turns,
                                  args.gemmalab_lr)
        print("RESULT " + json.dumps(result))
        return

    if (args.out / "splits.json").exists() and (args.out / "hf").exists():
        print("prepared before:", args.out, flush=True)
    else:
        print("prepare:", json.dumps(prepare(args.out, args.cache_dir, args.validation)),
              flush=True)
    if args.prepare_only:
        return
    if args.turns:
        results = children_taking_turns(args)
        peft_result, gemmalab_result = results["peft"], results["gemmalab"]
        target = peft_result["curve"][-1]["held_out_loss"]
    else:
        peft_result = child(args, "peft")
        target = peft_result["curve"][-1]["held_out_loss"]
        gemmalab_result = child(args, "gemmalab", target)
    reached = seconds_to_reach(gemmalab_result["curve"], target)
    peft_seconds = peft_result["curve"][-1]["seconds"]
    report = {"target_held_out_loss": target, "target_perplexity": math.exp(target),
              "peft_seconds": peft_seconds, "gemmalab_seconds": reached,
              "ratio": peft_seconds / reached if reached else None,
              "peft": peft_result, "gemmalab": gemmalab_result}
    (args.out / "vs_hf_peft_quality.json").write_text(json.dumps(report, indent=1))
    print(f"\nbatch {args.batch_size} x {args.maxlen}, {os.cpu_count()} cores, torch in "
          f"{args.peft_dtype}; held-out loss every {args.every} steps")
    print("| loop | step | training s | held-out loss | held-out perplexity |")
    print("|---|---|---|---|---|")
    for side, result in (("peft", peft_result), ("gemmalab", gemmalab_result)):
        for point in result["curve"]:
            print(f"| {side} | {point['step']} | {point['seconds']:.0f} | "
                  f"{point['held_out_loss']:.4f} | {math.exp(point['held_out_loss']):.2f} |")
    verdict = (f"{report['ratio']:.2f}x" if reached else
               f"not reached in {args.gemmalab_steps} steps")
    print(f"\nPEFT after {args.peft_steps} steps: held-out perplexity {math.exp(target):.2f} in "
          f"{peft_seconds:.0f} s of training; gemmalab reaches it in "
          f"{reached if reached is None else round(reached)} s: {verdict}")


if __name__ == "__main__":
    main()
