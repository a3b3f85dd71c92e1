"""gemmalab against the JAX kits a user would pick instead: google-tunix (``PeftTrainer``, LoRA
through qwix) and keras-hub (``Gemma3CausalLM.enable_lora``, ``fit``), on the same XLA, weights,
documents, LoRA and optimizer, each kit in its own process, rounds alternating.

    make peers     # once: .peers/tunix and .peers/keras-hub, pinned venvs (never .venv)
    .venv/bin/python bench/vs_jax_peers.py --out runs/vs-jax-peers --corpora stories prose \
        --maxlens 128 512 --rounds 2

- The base: the embedded Gemma 3 270M as gemmalab loads it, written as a Hugging Face directory
  by gemmalab's own export (``hf_layout.export_hf``, bfloat16); each peer loads that directory
  with its own loader. The token ids are gemmalab's tokenizer's, the same vocabulary (the GGUF's)
  that the directory's ``tokenizer.model`` holds.
- The documents: the embedded stories, or real prose found offline (the long descriptions of
  the installed Python packages and the prose of Python's reference manual, as
  ``vs_hf_peft_quality``); BOS and EOS around each; 15% held out by a hash of the text.
- The same settings: LoRA rank 8 on all seven projections, scale 1 (alpha = rank), float32
  adapters and AdamW state (lr 1e-3 constant, b1 0.9, b2 0.95, weight decay 0.01, gradients
  clipped at 1.0: gemmalab's defaults less its schedule), bfloat16 compute, batch 8 x maxlen.
- gemmalab: ``Experiment`` as the notebook runs it: packed rows, its chunked loss, ``cpu_mfu``
  from its metrics. The peers: their usual input, one document per row (cut at ``maxlen``),
  padded, padding out of the loss; each pitfall handled as a user would (``run_tunix``,
  ``run_keras_hub``; docs/benchmarks/vs-jax-peers.md).

Each kit trains on the same number of useful (loss-bearing, non-padding) tokens, ``--steps``
full rows' worth: gemmalab's packed rows are nearly all useful, the peers' padded ones are not,
so they take more steps. Reported per kit: median s / step (the first step, which compiles, left
out), useful tokens / s, compile seconds (the first step less the median), peak RSS of the
process, and the held-out loss before and after (mean NLL over every target of the held-out
documents' windows, the same windows for every kit, bf16 forward passes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

KITS = ("gemmalab", "tunix", "keras-hub")
RANK = 8  # alpha = rank: scale 1
LEARNING_RATE, B1, B2, WEIGHT_DECAY, CLIP = 1e-3, 0.9, 0.95, 0.01, 1.0
EVAL_BATCH = 8
BOS, EOS = 2, 1
STORIES = 2000
HELD_OUT_IDS = 6500  # the held-out documents kept, in order, until they hold this many ids
SEED = 0
HERE = Path(__file__).resolve().parent


# -- shared by every kit (numpy and jax only: each peer's venv has both) -----------------------

def padded_rows(documents: list[list[int]], length: int) -> tuple[np.ndarray, np.ndarray]:
    """The peers' usual input: one document per row, its first ``length`` ids, padded with 0;
    and the mask of real ids."""
    ids = np.zeros((len(documents), length), np.int32)
    for i, doc in enumerate(documents):
        piece = doc[:length]
        ids[i, :len(piece)] = piece
    mask = np.zeros_like(ids, bool)
    for i, doc in enumerate(documents):
        mask[i, :min(len(doc), length)] = True
    return ids, mask


def rows_for_budget(documents: list[list[int]], batch: int, length: int, budget: int
                    ) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Whole batches of rows of ``length`` ids, one shuffled document each (cycled), until
    their targets (a row's ids but its first) reach ``budget``; and each batch's targets."""
    order = np.random.default_rng(SEED).permutation(len(documents))
    picked, useful = [], 0
    while useful < budget or len(picked) % batch:
        doc = documents[order[len(picked) % len(order)]]
        picked.append(doc)
        useful += min(len(doc), length) - 1
    ids, mask = padded_rows(picked, length)
    per_batch = mask[:, 1:].reshape(-1, batch * (length - 1)).sum(axis=1)
    return ids, mask, [int(n) for n in per_batch]


def held_out_batches(documents: list[list[int]], maxlen: int) -> list[dict[str, np.ndarray]]:
    """The held-out documents cut into windows of ``maxlen + 1`` ids, in batches of
    ``EVAL_BATCH`` (the last one filled with empty rows): inputs, targets, the target mask."""
    windows = [doc[s:s + maxlen + 1] for doc in documents for s in range(0, len(doc) - 1, maxlen)]
    windows = [w for w in windows if len(w) > 1]
    windows += [[0]] * (-len(windows) % EVAL_BATCH)
    ids, mask = padded_rows(windows, maxlen + 1)
    return [{"inputs": ids[s:s + EVAL_BATCH, :-1], "input_mask": mask[s:s + EVAL_BATCH, :-1],
             "targets": ids[s:s + EVAL_BATCH, 1:], "target_mask": mask[s:s + EVAL_BATCH, 1:]}
            for s in range(0, len(ids), EVAL_BATCH)]


def mean_nll(logits_of, batches: list[dict[str, np.ndarray]]) -> float:
    """Mean NLL over every masked target; ``logits_of(batch)`` gives ``[B, L, V]`` logits."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def summed(logits, targets, mask):
        logits = logits.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - picked
        return jnp.sum(nll * mask)

    total = count = 0.0
    for batch in batches:
        total += float(summed(logits_of(batch), batch["targets"], batch["target_mask"]))
        count += float(batch["target_mask"].sum())
    return total / count


@contextlib.contextmanager
def compiles_counted(at_least_s: float = 1.0):
    """The XLA compiles of at least ``at_least_s`` seconds while the block runs (a list of their
    seconds): the train step's, and its recompiles."""
    import jax

    seconds: list[float] = []
    counting = [True]

    def heard(event: str, duration: float, **_: object) -> None:
        if (counting[0] and event == "/jax/core/compile/backend_compile_duration"
                and duration >= at_least_s):
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(heard)
    try:
        yield seconds
    finally:
        counting[0] = False


def step_figures(step_seconds: list[float], batch_useful: list[int]) -> dict:
    """Median step (the first, which compiles, left out), compile seconds (the first step less
    the median), useful tokens / s over the timed steps (``batch_useful``: each step's targets,
    the first ``len(step_seconds)`` of them timed), the process's peak RSS."""
    print("step seconds:", " ".join(f"{t:.2f}" for t in step_seconds), file=sys.stderr)
    timed = step_seconds[1:]
    median = statistics.median(timed)
    return {"steps": len(batch_useful), "step_s": median,
            "compile_s": step_seconds[0] - median, "useful_tokens": sum(batch_useful),
            "useful_tokens_per_s": sum(batch_useful[1:len(step_seconds)]) / sum(timed),
            "peak_rss_gb": high_water_gb()}


def high_water_gb() -> float:
    """This process's peak RSS so far, GB (``ru_maxrss``: the kernel's ``VmHWM``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# -- gemmalab ------------------------------------------------------------------------------------

def run_gemmalab(job: dict) -> dict:
    import tempfile

    from gemmalab.config import TrainConfig
    from gemmalab.data import packing
    from gemmalab.train import optimization
    from gemmalab.train.experiment import Experiment

    batch, maxlen = job["batch"], job["maxlen"]
    with tempfile.TemporaryDirectory() as output_dir:
        experiment = Experiment.prepare(TrainConfig.flat(
            checkpoint="embedded:gemma3-270m", cache_dir=job["cache_dir"],
            data_path=job["train_text"], batch_size=batch, maxlen=maxlen, lora_rank=RANK,
            learning_rate=LEARNING_RATE, warmup_ratio=0.0, min_lr_ratio=1.0,
            weight_decay=WEIGHT_DECAY, adam_b1=B1, adam_b2=B2, max_grad_norm=CLIP,
            max_steps=math.ceil(job["budget"] / (batch * maxlen)), eval_every=0,
            checkpoint_every=0, max_eval_stories=8, seed=SEED, output_dir=output_dir))
        weights = experiment.weights
        marks = {"hwm_prepared_gb": high_water_gb()}

        def held_out_loss() -> float:
            batches = []
            for b in job["held_out"]:
                fields = {name: np.zeros((EVAL_BATCH, maxlen), np.int32)
                          for name in packing.FIELDS}
                fields["tokens"], fields["targets"] = b["inputs"], b["targets"]
                fields["loss_mask"] = fields["segment_ids"] = b["target_mask"].astype(np.int32)
                fields["positions"] = np.tile(np.arange(maxlen, dtype=np.int32), (EVAL_BATCH, 1))
                batches.append(fields)
            return optimization.evaluate(experiment.eval_step, weights.state.params, batches,
                                         experiment.mesh, weights.frozen)["eval_loss"]

        before = held_out_loss()
        marks["hwm_held_out_gb"] = high_water_gb()
        summary = experiment.train(progress=False)
        marks["hwm_trained_gb"] = high_water_gb()
        after = held_out_loss()
    history = experiment.history
    figures = step_figures([r["step_time_s"] for r in history],
                           [int(r["useful_tokens"]) for r in history])
    # The step is compiled ahead of the first (``Experiment.compile``): its own seconds.
    figures["compile_s"] = summary["startup"]["compile_s"]
    flops = summary["model_flops_per_step"] / figures["step_s"]
    return {**figures, **marks, "held_out_before": before, "held_out_after": after,
            "cpu_mfu": flops / summary["host_matmul_flops_per_s"],
            "cpu_mfu_mean_step": summary["cpu_mfu"],
            "useful_share": summary["useful_token_share"]}


def place(module, mesh) -> None:
    """Every array of an nnx module (the model, the optimizer) put on ``mesh`` by its partition
    spec, as tunix's examples do, so that the step's inputs keep one placement from step 1 on."""
    import jax
    from flax import nnx

    state = nnx.state(module)
    specs = nnx.get_partition_spec(state)
    nnx.update(module, jax.device_put(state, jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec), specs)))


# -- tunix ---------------------------------------------------------------------------------------

def run_tunix(job: dict) -> dict:
    """``PeftTrainer`` on tunix's Gemma 3 loaded from the HF directory, LoRA through qwix. The
    pitfalls, handled: the step is compiled twice (the adapters and AdamW's state gain a device
    placement after step 1) unless they are placed on a mesh first, so it all runs under one;
    the default loss builds a one-hot ``[B, L, 262k]`` float32 array, so the loss is replaced by
    the integer-label form; adapters (and so AdamW's state) take the base's bfloat16, so they are
    cast to float32; k and v share one einsum, so one adapter (a shared A) covers both."""
    import jax
    import jax.numpy as jnp
    import optax
    import qwix
    from flax import nnx
    from tunix.models.gemma3 import model as gemma3_model
    from tunix.models.gemma3 import params_safetensors
    from tunix.sft import peft_trainer, utils

    batch, maxlen = job["batch"], job["maxlen"]
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    config = gemma3_model.ModelConfig.gemma3_270m()
    # What a user turns on to fit longer rows: tunix recomputes each block (or each decoder
    # layer) in the backward pass instead of keeping its activations.
    config.remat_config = gemma3_model.RematConfig[job["remat"].upper()]
    base = params_safetensors.create_model_from_safe_tensors(job["hf"], config, mesh,
                                                             dtype=jnp.bfloat16)
    provider = qwix.LoraProvider(
        module_path=".*q_einsum|.*kv_einsum|.*attn_vec_einsum|.*gate_proj|.*up_proj|.*down_proj",
        rank=RANK, alpha=float(RANK))
    with mesh:
        model = qwix.apply_lora_to_model(base, provider, **base.get_model_input())
        adapters = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.tree.map(lambda a: a.astype(jnp.float32), adapters))
    if job["place"]:
        place(model, mesh)

    def inputs_of(tokens, mask):
        return {"input_tokens": tokens, "input_mask": mask,
                "positions": utils.build_positions_from_mask(mask),
                "attention_mask": utils.make_causal_attn_mask(mask)}

    def loss_fn(model, input_tokens, input_mask, positions, attention_mask):
        logits, _ = model(input_tokens, positions, None, attention_mask)
        targets, weights = input_tokens[:, 1:], input_mask[:, 1:]
        nll = optax.softmax_cross_entropy_with_integer_labels(
            logits[:, :-1].astype(jnp.float32), targets)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1)

    optimizer = optax.chain(optax.clip_by_global_norm(CLIP),
                            optax.adamw(LEARNING_RATE, b1=B1, b2=B2, weight_decay=WEIGHT_DECAY))
    trainer = peft_trainer.PeftTrainer(model, optimizer, peft_trainer.TrainingConfig(
        eval_every_n_steps=10**9, max_inflight_computations=1, pbar_description=None))
    if job["place"]:
        place(trainer.optimizer, mesh)
    trainer = trainer.with_loss_fn(loss_fn).with_gen_model_input_fn(
        lambda x: inputs_of(x.input_tokens, x.input_mask))
    # tunix's loss shifts the row: a row of ``maxlen`` ids has ``maxlen - 1`` targets.
    ids, mask, batch_useful = rows_for_budget(job["train"], batch, maxlen, job["budget"])
    ticks: list[float] = []

    def batches():
        for start in range(0, len(ids), batch):
            ticks.append(time.perf_counter())
            yield peft_trainer.TrainingInput(input_tokens=ids[start:start + batch],
                                             input_mask=mask[start:start + batch])
        ticks.append(time.perf_counter())

    @nnx.jit
    def logits_fn(model, tokens, mask):
        inputs = inputs_of(tokens, mask)
        return model(tokens, inputs["positions"], None, inputs["attention_mask"])[0]

    def logits_of(b):
        return logits_fn(model, jnp.asarray(b["inputs"]), jnp.asarray(b["input_mask"]))

    with mesh:
        before = mean_nll(logits_of, job["held_out"])
        with compiles_counted() as compiles:
            trainer.train(batches())
        jax.block_until_ready(nnx.state(model))
        ticks.append(time.perf_counter())
        after = mean_nll(logits_of, job["held_out"])
    # One step in flight: between two batches' requests, step k - 1 runs and step k is sent
    # (the first interval: the compile). The last step, which ends with the trainer's close,
    # is not timed.
    gaps = np.diff(ticks[:-1]).tolist()
    return {**step_figures([gaps[0] + gaps[1], *gaps[2:]], batch_useful),
            "held_out_before": before, "held_out_after": after, "step_compiles": len(compiles),
            "useful_share": sum(batch_useful) / (len(ids) * (maxlen - 1))}


# -- keras-hub -----------------------------------------------------------------------------------

def run_keras_hub(job: dict) -> dict:
    """``Gemma3CausalLM`` from the HF directory, ``enable_lora`` on all seven projections,
    ``fit`` under the ``mixed_bfloat16`` policy on JAX. The pitfalls, handled: the default loss
    averages over padding too (its mean divides by every position), so the loss reduces with
    ``mean_with_sample_weight`` and the padding's weight is 0; ``fit`` reports running means, so
    steps are timed by a callback; LoRA's init is unseeded unless ``keras.utils.set_random_seed``;
    keras-hub imports TensorFlow (tensorflow-text) even on JAX."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    import keras_hub

    keras.utils.set_random_seed(SEED)
    keras.config.set_dtype_policy("mixed_bfloat16")
    batch, maxlen = job["batch"], job["maxlen"]
    lm = keras_hub.models.Gemma3CausalLM.from_preset(job["hf"], preprocessor=None)
    lm.backbone.enable_lora(RANK, target_layer_names=[
        "query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"])
    lm.compile(
        optimizer=keras.optimizers.AdamW(LEARNING_RATE, beta_1=B1, beta_2=B2, epsilon=1e-8,
                                         weight_decay=WEIGHT_DECAY, global_clipnorm=CLIP),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                        reduction="mean_with_sample_weight"),
        weighted_metrics=[])
    ids, mask, batch_useful = rows_for_budget(job["train"], batch, maxlen + 1, job["budget"])
    ticks: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if not ticks:
                ticks.append(time.perf_counter())

        def on_train_batch_end(self, step, logs=None):
            ticks.append(time.perf_counter())

    def logits_of(b):
        return lm({"token_ids": b["inputs"], "padding_mask": b["input_mask"]}, training=False)

    before = mean_nll(logits_of, job["held_out"])
    with compiles_counted() as compiles:
            lm.fit(x={"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}, y=ids[:, 1:],
               sample_weight=mask[:, 1:].astype("float32"), batch_size=batch, epochs=1,
               shuffle=False, callbacks=[Clock()], verbose=0)
    after = mean_nll(logits_of, job["held_out"])
    return {**step_figures(np.diff(ticks).tolist(), batch_useful),
            "held_out_before": before, "held_out_after": after, "step_compiles": len(compiles),
            "useful_share": sum(batch_useful) / (len(ids) * maxlen)}


RUNS = {"gemmalab": run_gemmalab, "tunix": run_tunix, "keras-hub": run_keras_hub}


# -- the driver (gemmalab's .venv) ---------------------------------------------------------------

def prepare(out: Path, cache_dir: str) -> None:
    """The HF export of the embedded base, and each corpus's documents split in two (ids)."""
    sys.path.insert(0, str(HERE))
    import vs_hf_peft
    import vs_hf_peft_quality

    from gemmalab.config import TrainConfig
    from gemmalab.data import corpus
    from gemmalab.train.experiment import Experiment
    from gemmalab.weights import hf_layout

    out.mkdir(parents=True, exist_ok=True)
    experiment = Experiment.prepare(TrainConfig.flat(
        checkpoint="embedded:gemma3-270m", cache_dir=cache_dir, lora_rank=RANK, max_steps=1,
        embedded_stories=200, output_dir=str(out / "export-run")))
    hf_layout.export_hf(experiment.weights.frozen, experiment.prepared.model_config,
                        experiment.prepared.tokenizer_info.model_proto, out / "hf",
                        dtype="bfloat16")
    texts = {"stories": list(corpus.generate_stories(STORIES, seed=SEED)),
             "prose": [t for t in sorted(set(vs_hf_peft.prose_documents()
                                              + vs_hf_peft_quality.manual_documents()))
                       if vs_hf_peft.MIN_TOKENS <= len(experiment.tokenizer.encode(t))
                       <= vs_hf_peft.MAX_TOKENS]}
    for name, documents in texts.items():
        split = {"train": [], "held_out": []}
        for text in documents:
            part = "held_out" if vs_hf_peft_quality.held_out(text) else "train"
            split[part].append(text)
        # gemmalab reads text (its own format); the peers read the same documents' ids.
        (out / f"{name}.txt").write_text("".join(f"{t}\n<|endoftext|>\n" for t in split["train"]),
                                        encoding="utf-8")
        ids = {part: [[BOS, *experiment.tokenizer.encode(t), EOS] for t in texts_]
               for part, texts_ in split.items()}
        (out / f"{name}.json").write_text(json.dumps(ids))
        print(f"{name}: " + ", ".join(f"{part} {len(d)} documents, {sum(map(len, d))} ids"
                                      for part, d in ids.items()), flush=True)


def kit_python(kit: str) -> str:
    if kit == "gemmalab":
        return sys.executable
    python = Path(".peers") / kit / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `make peers` first")
    return str(python)


def kit_environment(kit: str) -> dict[str, str]:
    """gemmalab's process gets what its training processes get (``gemmalab.allocator``: on
    this kind of VM mimalloc; ``GEMMALAB_MALLOC=system`` for glibc); the peers glibc's malloc."""
    from gemmalab import allocator

    plain = allocator.without_allocator(os.environ)
    if kit == "gemmalab":
        if allocator.CHOICE in os.environ:
            plain[allocator.CHOICE] = os.environ[allocator.CHOICE]
        return {**plain, **allocator.environment(plain), "PYTHONPATH": str(HERE.parent)}
    return {**plain, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}


def run_kit(args: argparse.Namespace, kit: str, corpus_name: str, maxlen: int) -> dict:
    job = {"kit": kit, "hf": str(args.out / "hf"), "cache_dir": args.cache_dir,
           "train_text": str(args.out / f"{corpus_name}.txt"),
           "documents": str(args.out / f"{corpus_name}.json"), "batch": args.batch_size,
           "maxlen": maxlen, "budget": args.steps * args.batch_size * maxlen,
           "place": not args.tunix_unplaced, "remat": args.tunix_remat}
    path = args.out / "job.json"
    path.write_text(json.dumps(job))
    done = subprocess.run([kit_python(kit), __file__, "--one", str(path)], capture_output=True,
                          text=True, check=False, env=kit_environment(kit))
    (args.out / f"{kit}-{corpus_name}-{maxlen}.log").write_text(done.stdout + done.stderr)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{kit} {corpus_name} {maxlen} failed (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def one(job_path: Path) -> None:
    """A child: one kit's run, its figures on a ``RESULT`` line."""
    job = json.loads(job_path.read_text())
    ids = json.loads(Path(job["documents"]).read_text())
    job["train"] = ids["train"]
    kept = np.cumsum([len(doc) for doc in ids["held_out"]]) <= HELD_OUT_IDS
    job["held_out"] = held_out_batches([d for d, k in zip(ids["held_out"], kept, strict=True) if k],
                                       job["maxlen"])
    result = RUNS[job["kit"]](job)
    print("RESULT " + json.dumps({k: float(v) for k, v in result.items()}), flush=True)


def table(results: list[dict]) -> str:
    lines = ["| corpus | maxlen | round | kit | s / step | useful tokens/s | useful share | "
             "compile s | peak RSS GB | held-out loss before -> after | cpu_mfu |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        mfu = f"{r['cpu_mfu']:.2f}" if "cpu_mfu" in r else ""
        lines.append(
            f"| {r['corpus']} | {r['maxlen']} | {r['round']} | {r['kit']} | {r['step_s']:.2f} | "
            f"{r['useful_tokens_per_s']:,.0f} | {r['useful_share']:.0%} | {r['compile_s']:.0f} | "
            f"{r['peak_rss_gb']:.1f} | {r['held_out_before']:.3f} -> {r['held_out_after']:.3f} | "
            f"{mfu} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("runs/vs-jax-peers"))
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--kits", nargs="+", default=list(KITS), choices=KITS)
    parser.add_argument("--corpora", nargs="+", default=["stories", "prose"],
                        choices=["stories", "prose"])
    parser.add_argument("--maxlens", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8,
                        help="the useful-token budget of every kit, in full rows' worth of steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tunix-unplaced", action="store_true",
                        help="tunix as shipped: the model and optimizer not placed on the mesh")
    parser.add_argument("--tunix-remat", choices=["none", "block", "decoder"], default="none",
                        help="tunix's activation recompute (its ModelConfig.remat_config), which "
                             "a user turns on when a batch does not fit")
    args = parser.parse_args()
    if args.one:
        return one(args.one)
    args.out = args.out.resolve()
    if args.cache_dir is None:
        from gemmalab.config import default_cache_dir

        args.cache_dir = str(default_cache_dir())
    if not (args.out / "hf" / "config.json").exists():
        subprocess.run([sys.executable, __file__, "--prepare", "--out", str(args.out),
                        "--cache-dir", args.cache_dir], check=True,
                       env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    results = []
    for corpus_name in args.corpora:
        for maxlen in args.maxlens:
            for round_ in range(args.rounds):
                kits = args.kits if round_ % 2 == 0 else args.kits[::-1]
                for kit in kits:
                    got = run_kit(args, kit, corpus_name, maxlen)
                    load = os.getloadavg()[0]  # over the last minute of the kit's run
                    results.append({"corpus": corpus_name, "maxlen": maxlen, "round": round_,
                                    "kit": kit, "load_1min": load, **got})
                    print(json.dumps(results[-1]), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    if "--prepare" in sys.argv:
        at = sys.argv.index
        prepare(Path(sys.argv[at("--out") + 1]), sys.argv[at("--cache-dir") + 1])
    else:
        main()
