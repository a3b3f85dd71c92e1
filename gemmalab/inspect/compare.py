"""Base vs fine-tuned: samples side by side, held-out perplexity, and for instruction runs the
task metric (sample_compare.ipynb); several fine-tuned runs at once (a sweep's) side by side."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab import gemma_lib, storage
from gemmalab.config import TrainConfig
from gemmalab.data import chat, documents, packing
from gemmalab.data.chat import Conversation
from gemmalab.data.fact_matching import Reply, judge
from gemmalab.data.preparation import PreparedData, prepare_data
from gemmalab.errors import ConfigError, require
from gemmalab.inspect import reports
from gemmalab.inspect.sweep import run_dirs
from gemmalab.inspect.task_metric import score_summary
from gemmalab.model import mesh, presets, sampling, sharding
from gemmalab.plan.shapes import abstract_params
from gemmalab.train import optimization
from gemmalab.weights import orbax_params, sources


@dataclasses.dataclass(frozen=True)
class Contender:
    """A named set of weights for one model architecture."""

    name: str
    params: Any


@dataclasses.dataclass(frozen=True)
class Run:
    """What a finished training run left in its ``output_dir``."""

    output_dir: str
    config: TrainConfig
    summary: dict[str, Any]
    model: Any
    data: PreparedData


def _finished(output_dir: str, fix: str) -> tuple[dict[str, Any], TrainConfig]:
    """A finished run's ``summary.json`` and its config, or ``fix`` when it has none."""
    path = f"{output_dir}/summary.json"
    if not storage.exists(path):
        raise ConfigError("finetuned", f"no summary.json in {output_dir}", fix)
    summary = json.loads(storage.read_bytes(path))
    return summary, TrainConfig.from_dict(summary["params"])


def load_run(output_dir: str) -> Run:
    """Rebuild a run's config, model and data (tokenizer, eval split) from ``summary.json``."""
    summary, config = _finished(output_dir, "run notebooks/train.ipynb with this output_dir first")
    prepared = prepare_data(config)
    model = presets.build_model(presets.config_from_dict(summary["model_config"]),
                                param_dtype=jnp.dtype(config.model.param_dtype))
    return Run(output_dir=output_dir, config=config, summary=summary, model=model, data=prepared)


def load_runs(finetuned: str | Sequence[str]) -> list[Run]:
    """One run (its ``output_dir``) or several: a list of output_dirs, a glob
    (``runs/my-sweep/*``) or a sweep's directory. The first run's model, tokenizer and held-out
    split serve them all, so they must share model and tokenizer (a sweep's points do)."""
    dirs = list(run_dirs(finetuned).values())
    if not dirs:
        raise ConfigError("finetuned", "names no run", "give an output_dir, a list or a glob")
    first = load_run(dirs[0])
    runs = [first]
    for output_dir in dirs[1:]:
        summary, config = _finished(output_dir, "leave out runs that have not finished")
        for what, mine, theirs in (
            ("model", summary["model_config"], first.summary["model_config"]),
            (
                "tokenizer",
                (config.model.tokenizer, config.model.tokenizer_vocab_size, config.data.path),
                (
                    first.config.model.tokenizer,
                    first.config.model.tokenizer_vocab_size,
                    first.config.data.path,
                ),
            ),
        ):
            if mine != theirs:
                raise ConfigError("finetuned", f"{output_dir} has another {what} than "
                                  f"{first.output_dir}",
                                  "compare runs of one model and tokenizer (e.g. one sweep)")
        runs.append(Run(output_dir=output_dir, config=config, summary=summary, model=first.model,
                        data=first.data))
    return runs


def contenders_of(runs: Sequence[Run], base_checkpoint: str = "run") -> list[Contender]:
    """One run: its ``lineage``. Several: the first run's base, then every run, named by its
    directory (a sweep's point names)."""
    if len(runs) == 1:
        return lineage(runs[0], base_checkpoint)
    named = [Contender(run.output_dir.rstrip("/").rsplit("/", 1)[-1],
                       orbax_params.load_params(f"{run.output_dir}/params")) for run in runs]
    return [base_params(runs[0], base_checkpoint), *named]


def finetuned_params(run: Run) -> Contender:
    return Contender("fine-tuned", orbax_params.load_params(f"{run.output_dir}/params"))


def base_params(run: Run, checkpoint: str = "run", *, origin: TrainConfig | None = None
                ) -> Contender:
    """The weights the run started from (``"run"``), or any other checkpoint spec ('' = init),
    in any format the run's ``checkpoint`` takes (``gemmalab.weights.sources``). ``origin``:
    the config of the run that started from them (default ``run``'s): its ``checkpoint`` for
    ``"run"``, and its ``seed`` draws a random init."""
    origin = origin or run.config
    spec = origin.model.checkpoint if checkpoint == "run" else checkpoint
    resolved = sources.resolve(spec, run.config.model.preset, run.config.runtime.resolved_cache_dir)
    if not resolved.path:
        params = presets.init_params(run.model, seed=origin.trainer.seed,
                                     sample_length=origin.data.maxlen)
        return Contender("base (random init)", params)
    target = abstract_params(run.model.config, run.config.model.param_dtype)
    params = sources.load(
        resolved, target, text_only=presets.PRESETS[run.config.model.preset].multimodal
    )
    return Contender(f"base ({resolved.name})", params)


def lineage(run: Run, base_checkpoint: str = "run") -> list[Contender]:
    """The contenders a notebook compares: the base and the run (``base_params``,
    ``finetuned_params``); and when the run continues earlier runs (its ``checkpoint`` is
    another run's ``output_dir/params``, e.g. DPO after SFT), every stage: the first run's base,
    then each run in order, named by its objective (base vs SFT vs DPO)."""
    chain = [(run.output_dir, run.config)]
    while (parent := _parent_run(chain[-1][1].model.checkpoint)) is not None and len(chain) < 8:
        chain.append(parent)
    if base_checkpoint != "run" or len(chain) == 1:
        return [base_params(run, base_checkpoint), finetuned_params(run)]
    stages = [base_params(run, origin=chain[-1][1])]  # the first run's start (its seed's init)
    for output_dir, config in reversed(chain):
        stages.append(Contender(f"{config.trainer.objective.upper()} ({output_dir})",
                                orbax_params.load_params(f"{output_dir}/params")))
    return stages


def _parent_run(checkpoint: str) -> tuple[str, TrainConfig] | None:
    """``(output_dir, config)`` of the run whose ``params`` ``checkpoint`` names, else None."""
    path = checkpoint.rstrip("/")
    if not path.endswith("/params"):
        return None
    output_dir = path.removesuffix("/params")
    path = f"{output_dir}/summary.json"
    if not storage.exists(path):
        return None
    return output_dir, TrainConfig.from_dict(json.loads(storage.read_bytes(path))["params"])


def samples_table(run: Run, contenders: list[Contender], prompts: str | list[str], *,
                  max_new_tokens: int, temperature: float, top_p: float, seed: int,
                  chat: bool = False) -> reports.SamplesView:
    """Continuations of every prompt by every contender, greedy and top-p, side by side.

    ``.frame`` is the pandas table (rows: prompt x sampling, columns: contenders).
    """
    import pandas as pd

    prompts = sampling.checked_prompts(prompts, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p)
    require(len(set(prompts)) == len(prompts), "prompts", "repeats a prompt",
            "give each prompt once (the table has a row per prompt)")
    methods = {"greedy": {"temperature": 0.0},
               f"top-p {top_p} T={temperature}": {"temperature": temperature, "top_p": top_p}}
    compute = jnp.dtype(run.config.model.compute_dtype)
    rows, continuations, labels = [], [], []
    for contender in contenders:
        for method, settings in methods.items():
            produced = (chat_replies(run, contender, prompts, max_new_tokens=max_new_tokens,
                                     seed=seed, **settings) if chat
                        else sampling.continue_prompts(
                            run.model, contender.params, run.data.tokenizer, list(prompts),
                            max_new_tokens=max_new_tokens, compute_dtype=compute, seed=seed,
                            **settings))
            for continuation in produced:
                rows.append({"prompt": continuation.prompt, "sampling": method,
                             "model": contender.name, "continuation": continuation.text})
                continuations.append(continuation)
                labels.append(f"{contender.name} / {method}")
    frame = pd.DataFrame(rows).pivot(index=["prompt", "sampling"], columns="model",
                                     values="continuation")
    return reports.SamplesView(tuple(continuations), tuple(labels), frame)


def chat_replies(run: Run, contender: Contender, prompts: list[str], *, max_new_tokens: int,
                 seed: int, temperature: float = 0.0, top_p: float = 1.0
                 ) -> list[sampling.Continuation]:
    """Single-turn replies through gemma's chat template (for instruction-tuned checkpoints)."""
    gm = gemma_lib.gm()
    params = presets.cast_params(contender.params, run.config.model.compute_dtype)
    sampler = gm.text.ChatSampler(model=run.model, params=params, tokenizer=run.data.tokenizer,
                                  sampling=sampling.sampling_method(temperature, top_p),
                                  multi_turn=False,
                                  cache_length=sampling.SAMPLER_CACHE_LENGTH,
                                  max_out_length=max_new_tokens)
    return [sampling.Continuation(prompt, sampler.chat(prompt, rng=seed)) for prompt in prompts]


# ---------------------------------------------------------------------------------------------
# The task metric (instruction runs): does each reply contain what its instruction asked for?


@dataclasses.dataclass(frozen=True)
class TaskResult:
    # pandas, per contender: the shares of task_metric.SCORE_COLUMNS (instructions followed,
    # facts found, ended by itself, looped)
    scores: Any
    replies: reports.SamplesView  # every reply and its verdict (frame: instruction x contender)


def task_instructions(run: Run, count: int) -> list[Conversation]:
    """The first ``count`` held-out conversations that name facts ([] for story runs)."""
    if not run.data.corpus.conversational:
        return []
    rule = documents.SplitRule(run.config.data.eval_fraction, run.config.data.max_eval_stories)
    held_out = documents.heldout_conversations(
        run.data.corpus.path, rule, run.config.data.datacount, run.data.corpus.format
    )
    return list(itertools.islice((c for c in held_out if c.facts), count))


def task_metric(run: Run, contenders: list[Contender], instructions: list[Conversation], *,
                max_new_tokens: int, seed: int = 0) -> TaskResult:
    """Greedy replies (chat template, stop at ``<end_of_turn>``) to held-out instructions by each
    contender, judged by ``gemmalab.inspect.task_metric``: facts stated in the reply's own words
    (not copied from the instruction), ended by itself, no loop."""
    import pandas as pd

    markers = run.data.tokenizer_info.turn_markers
    prompts = [chat.prompt_text(c.prompt_turns, markers) for c in instructions]
    asked = [instruction_text(c) for c in instructions]
    facts = [c.facts or {} for c in instructions]
    compute = jnp.dtype(run.config.model.compute_dtype)
    scores, continuations, labels, columns = [], [], [], {}
    for contender in contenders:
        produced = sampling.continue_prompts(run.model, contender.params, run.data.tokenizer,
                                             prompts, max_new_tokens=max_new_tokens,
                                             compute_dtype=compute, seed=seed)
        replies = [Reply(c.text, prompt=a, ended=c.ended)
                   for c, a in zip(produced, asked, strict=True)]
        scores.append({"model": contender.name, **score_summary(replies, facts)})
        continuations += produced
        labels += [contender.name] * len(produced)
        columns[contender.name] = [r.text for r in replies]
        columns[f"{contender.name}: verdict"] = [
            judge(r, f).describe() for r, f in zip(replies, facts, strict=True)]
    frame = pd.DataFrame({"instruction": [c.prompt_turns[-1][1] for c in instructions],
                          "facts": [", ".join(f.values()) for f in facts], **columns})
    table = pd.DataFrame(scores).set_index("model")
    return TaskResult(table, reports.SamplesView(tuple(continuations), tuple(labels), frame))


def instruction_text(conversation: Conversation) -> str:
    """What the model was told (turn contents, no template markers): the text a reply must not
    copy its facts from."""
    return "\n".join(content for _, content in conversation.prompt_turns)


def chosen_replies_only(batches: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Preference pairs' eval batches with loss on the chosen replies alone (segments 2k+1; the
    rejected are 2k+2): the text a DPO run is tuned to write, as its ``eval_perplexity`` is."""
    return [{**batch, "loss_mask": batch["loss_mask"]
             * (batch["segment_ids"] % 2 == 1).astype(batch["loss_mask"].dtype)}
            for batch in batches]


def perplexity_table(run: Run, contenders: list[Contender]) -> Any:
    """Held-out (eval split) loss and perplexity under each contender (pandas); for preference
    data, of the chosen replies."""
    import pandas as pd

    device_mesh = mesh.make_mesh(run.config.runtime.mesh, num_slices=run.config.runtime.num_slices)
    batch_size = run.config.trainer.batch_size
    mesh.check_batch_size(batch_size, device_mesh)
    batches = packing.eval_batches(run.data.cache.eval, maxlen=run.config.data.maxlen,
                                   batch_size=batch_size, packing=run.config.data.packing,
                                   process_index=jax.process_index(),
                                   process_count=jax.process_count())
    if run.data.cache.eval.group == 2:
        batches = chosen_replies_only(batches)
    # One architecture: one placement and one compiled step serve every contender.
    shardings = sharding.param_sharding(contenders[0].params, device_mesh)
    step = optimization.make_eval_step(
        run.model, jnp.dtype(run.config.model.compute_dtype), device_mesh, shardings
    )
    rows = []
    for contender in contenders:
        params = jax.device_put(contender.params, shardings)
        held_out = optimization.evaluate(step, params, batches, device_mesh)
        rows.append({"model": contender.name, "eval loss": held_out["eval_loss"],
                     "perplexity": held_out["eval_perplexity"]})
    return pd.DataFrame(rows).set_index("model")


def perplexity_figure(table: Any) -> Any:
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5, 3))
    axis.bar(table.index, table["perplexity"],
             color=["tab:gray", *["tab:green"] * (len(table) - 1)])
    if len(table) > 2:  # a sweep's run names
        axis.tick_params(axis="x", labelrotation=30)
    axis.set_yscale("log")
    axis.set_ylabel("held-out perplexity (log scale)")
    for i, value in enumerate(table["perplexity"]):
        axis.annotate(f"{value:.2f}", (i, value), ha="center", va="bottom")
    figure.tight_layout()
    return figure
