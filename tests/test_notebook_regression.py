"""The notebook regression tests pass on float noise and fail on real regressions, saying where."""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.notebook_regression import (
    DEFAULT_RTOL,
    compare_flat,
    compare_samples,
    compare_text,
    flatten,
    last_digit_unit,
)

TESTS = Path(__file__).resolve().parent
COPIES = TESTS / "notebooks"


@pytest.mark.parametrize(("number", "unit"), [
    ("5.867", 1e-3), ("6.9e-05", 1e-6), ("100.", 1.0), ("0.993627", 1e-6), ("1E+3", 1000.0)])
def test_last_digit_unit(number, unit):
    assert last_digit_unit(number) == pytest.approx(unit)


def test_float_noise_passes():
    stored = "initial_train_loss 6.916218\nstep 10/20: train loss 5.867, perplexity 154.42"
    # 6e-5 relative on the first; the second crosses a rounding boundary of its printed digits.
    assert compare_text(stored, stored.replace("6.916218", "6.915802"), 1e-4) == []
    assert compare_text(stored, stored.replace("5.867", "5.868"), 0.0) == []


def test_a_moved_number_is_named_with_its_line_and_its_change():
    stored = "metric value\ninitial_eval_loss 6.907239\nfinal_eval_loss 4.621169\nsteps 20"
    problems = compare_text(stored, stored.replace("4.621169", "4.652000"), DEFAULT_RTOL)
    assert problems == ["'final_eval_loss 4.621169': 4.621169 -> 4.652000 "
                        "(moved 6.6e-03 relative; allowed 1.0e-04)"]


@pytest.mark.parametrize(("old", "new"), [
    ("steps 20", "steps 21"),  # integers are exact
    ("1,554,944 parameters", "1,554,945 parameters"),
    ("devices 8 x cpu", "devices 8 x tpu"),  # words are exact
    ("loss 4.62", "loss 4.62 nan"),  # so is the count of numbers
    ("0.5", "-0.5"),
])
def test_everything_but_decimals_is_exact(old, new):
    (problem,) = compare_text(old, new, 1.0)
    assert problem.startswith("text differs beyond its numbers") or "moved" in problem


def test_html_entities_and_output_kinds():
    skip = ("metadata",)
    stored = [nbformat.v4.new_output("display_data", {"text/html": "<td>a &amp; b 1.000001</td>",
                                                      "text/plain": "a & b 1.000001"})]
    now = [nbformat.v4.new_output("display_data", {"text/html": "<td>a &amp; b 1.000002</td>",
                                                   "text/plain": "a & b 1.000002"})]
    assert compare_flat(flatten(stored, skip, str), flatten(now, skip, str), 1e-4) == []
    extra = [*now, nbformat.v4.new_output("stream", name="stderr", text="warning\n")]
    (problem,) = compare_flat(flatten(stored, skip, str), flatten(extra, skip, str), 1e-4)
    assert problem.startswith("different kinds of output")


def record(text, decided, complete=False, label="after training", prompt="Amy."):
    return {"label": label, "prompt": prompt, "text": text, "decided": decided,
            "complete": complete}


def test_continuations_compare_on_their_common_decided_part():
    stored = [record(" She ran home. She", " She ran home.")]
    # Past the decided part another CPU may pick another token.
    assert compare_samples(stored, [record(" She ran home. Tom", " She ran")]) == []
    (problem,) = compare_samples(stored, [record(" She sat home. She", " She sat home.")])
    assert "the decided part differs" in problem and "' She ran home.'" in problem
    assert compare_samples([record(" A.", " A.", True)], [record(" A. B.", " A. B.", True)])
    assert compare_samples(stored, [record(" She ran home. She", "", label="before")])


def test_sample_outputs_are_compared_through_their_records():
    skip = ("metadata",)
    metadata = {"gemmalab/samples": [record(" She ran. It", " She ran.")]}
    stored = [nbformat.v4.new_output("display_data", {"text/plain": "Amy. She ran. It"},
                                     metadata=metadata)]
    now_metadata = {"gemmalab/samples": [record(" She ran. He", " She ran.")]}
    now = [nbformat.v4.new_output("display_data", {"text/plain": "Amy. She ran. He"},
                                  metadata=now_metadata)]
    assert compare_flat(flatten(stored, skip, str), flatten(now, skip, str), 0.0) == []


def test_the_stored_copies_are_float32_and_their_greedy_samples_mostly_decided():
    """Copies regenerated in bfloat16 would decide little and drift more: refuse them."""
    train = nbformat.read(COPIES / "2_train.ipynb", as_version=4)
    injected = next(c for c in train.cells if "injected-parameters" in c.metadata.get("tags", []))
    assert 'compute_dtype = "float32"' in injected.source
    records = [r for path in sorted(COPIES.glob("*.ipynb"))
               for cell in nbformat.read(path, as_version=4).cells
               for output in cell.get("outputs", [])
               for r in output.get("metadata", {}).get("gemmalab/samples", [])]
    greedy = [r for r in records if "top-p" not in r["label"]]
    assert len(greedy) >= 9
    decided = sum(len(r["decided"]) for r in greedy) / sum(len(r["text"]) for r in greedy)
    assert decided > 0.8, decided


MUTANTS = {
    # The learning rate doubled (the tiny preset's default is 3e-3).
    "lr_doubled": "learning_rate = 6e-3",
    # The loss mask dropped: padding becomes a target, as in the tutorial.
    "mask_dropped": (
        "import gemmalab.model.cross_entropy as _loss\n"
        "_masked = _loss.chunked_cross_entropy\n"
        "_loss.chunked_cross_entropy = lambda hidden, embedding, targets, mask, **kw: "
        "_masked(hidden, embedding, targets, mask | True, **kw)"),
}


@pytest.mark.slow
@pytest.mark.timeout(1200)  # its pytest subprocess's limit is 900 s
def test_deliberate_regressions_fail_naming_the_cell_and_the_number(tmp_path):
    """The train copy, re-run with each regression injected into its parameters cell, fails;
    the report names the notebook, the cell, the row and how far its number moved."""
    for name, code in MUTANTS.items():
        notebook = nbformat.read(COPIES / "2_train.ipynb", as_version=4)
        injected = next(c for c in notebook.cells
                        if "injected-parameters" in c.metadata.get("tags", []))
        injected.source += "\n" + code + "\n"
        # A directory each: the kernel runs there, so each mutant trains its own nbval-run
        # (one run directory would be resumed by the second mutant, not trained again).
        (tmp_path / name).mkdir()
        nbformat.write(notebook, tmp_path / name / f"{name}.ipynb")
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}  # with the suite's XLA_FLAGS (conftest)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "tests.notebook_regression", "--nbval-tolerant", "--nbval-sanitize-with",
         str(COPIES / "sanitize.cfg"), "-o", "addopts=", "--rootdir", str(tmp_path),
         str(tmp_path)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    report = result.stdout + result.stderr
    assert result.returncode == 1, report
    for name in MUTANTS:
        assert f"{name}.ipynb cell 5 differs from its stored copy" in report, report
    lr_line = next(line for line in report.splitlines()
                   if "'final_train_loss" in line and "moved" in line)
    assert "relative; allowed 1.0e-04" in lr_line
    # Without the mask padding is scored: the eval loss drops far beyond the tolerance.
    assert any(line.strip().startswith("text/plain: 'final_eval_loss") and "moved" in line
               for line in report.split("mask_dropped.ipynb cell 5")[1].splitlines()[:9]), report
