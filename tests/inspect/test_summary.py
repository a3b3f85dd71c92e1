"""``python -m gemmalab.inspect.summary``: a run's headline figures, the FLOP/s against a peak."""

from gemmalab.inspect.summary import flops_line, format_summary

SUMMARY = {"initial_eval_loss": 6.9, "final_eval_loss": 5.2, "initial_eval_perplexity": 990.0,
           "final_eval_perplexity": 181.0, "initial_train_loss": 6.9, "final_train_loss": 5.5,
           "useful_tokens_per_s": 690.0, "useful_token_share": 0.999, "tokens_per_s": 691.0,
           "steps": 12, "train_seconds": 10.9, "model_flops_per_s": 7.2e10, "mfu": None,
           "peak_flops_per_s": None, "cpu_mfu": 0.7347, "host_matmul_flops_per_s": 9.8e10,
           "params": {"compute_dtype": "bfloat16"}}


def test_a_cpu_run_shows_its_share_of_the_host_matmul_peak():
    text = format_summary(SUMMARY)
    assert "model FLOP/s: 72 G = 73% of this host's bfloat16 matmul peak (98 G)" in text


def test_an_accelerator_run_shows_its_mfu():
    summary = {**SUMMARY, "model_flops_per_s": 3.7e14, "mfu": 0.4, "peak_flops_per_s": 9.18e14,
               "cpu_mfu": None, "host_matmul_flops_per_s": None}
    assert flops_line(summary) == "370 T = 40.0% MFU (the devices' peak 918 T)"


def test_older_summaries_without_a_peak_or_flops_still_print():
    old = {k: v for k, v in SUMMARY.items()
           if k not in ("cpu_mfu", "host_matmul_flops_per_s", "mfu", "peak_flops_per_s")}
    assert flops_line(old) == "72 G"
    old.pop("model_flops_per_s")
    assert "model FLOP/s" not in format_summary(old)
