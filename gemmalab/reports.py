"""Tables (pandas) and plots (matplotlib) that the notebooks show."""

from __future__ import annotations

from typing import Any

SUMMARY_ROWS = (
    "steps", "initial_train_loss", "final_train_loss", "initial_eval_loss", "final_eval_loss",
    "initial_eval_perplexity", "final_eval_perplexity", "tokens_per_s", "useful_tokens_per_s",
    "useful_token_share", "mean_step_time_s", "data_wait_share", "first_step_seconds",
    "train_seconds", "num_params", "peak_host_memory_gb", "devices",
)


def summary_table(summary: dict[str, Any]) -> Any:
    """The run's headline figures as a one-column DataFrame."""
    import pandas as pd

    rows = {k: summary[k] for k in SUMMARY_ROWS if k in summary}
    return pd.DataFrame({"value": pd.Series(rows, dtype=object)}).rename_axis("metric")


def data_table(stats: dict[str, Any]) -> Any:
    import pandas as pd

    return pd.DataFrame({"value": pd.Series(stats, dtype=object)}).rename_axis("data")


def samples_table(prompt: str, before: str, after: str) -> Any:
    import pandas as pd

    return pd.DataFrame({"prompt": [prompt], "before training": [before],
                         "after training": [after]}).T.rename(columns={0: "text"})


def loss_figure(history: list[dict[str, Any]], eval_history: list[dict[str, Any]]) -> Any:
    """Train loss per step and eval loss at each evaluation, on one axis."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 3.5))
    axis.plot([r["step"] for r in history], [r["loss"] for r in history], label="train", lw=1)
    axis.plot([r["step"] for r in eval_history], [r["eval_loss"] for r in eval_history], "o-",
              label="eval")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats/token)")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    return figure
