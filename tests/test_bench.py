"""CPU smoke tests of the hand-run benchmarks in bench/ (their figures are not asserted: these
only prove they run and report what they claim)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


def test_accelerator_bench_reports_flops_and_mfu():
    import accelerator

    rows = accelerator.main(["--models", "gemma3-tiny", "--maxlens", "32", "--tokens", "256",
                             "--steps", "1", "--lora-ranks", "0", "--vocab", "512"])
    assert [(r["lora_rank"], r["maxlen"]) for r in rows] == [(0, 32)]
    for row in rows:
        assert "error" not in row, row
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 32 / row["step_s"])
        assert row["model_tflops_per_s"] > 0
        assert row["mfu"] is None  # CPUs have no known peak
