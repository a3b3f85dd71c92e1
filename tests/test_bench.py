"""CPU smoke tests of the hand-run benchmarks in bench/ (their figures are not asserted: these
only prove they run and report what they claim)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.numerics import REORDERED_BFLOAT16, REORDERED_FLOAT32, assert_close_to_scale

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(autouse=True)
def bench_importable(monkeypatch):
    """The bench scripts import each other by bare name (as ``python bench/x.py`` runs them,
    some adding bench/ to sys.path themselves): bench/ is importable during each test here, and
    sys.path is restored after it (bench's own additions too)."""
    monkeypatch.syspath_prepend(str(BENCH))


@pytest.mark.slow
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


@pytest.mark.slow
def test_gguf_import_bench_reports_phases_and_rates(tmp_path):
    import gguf_import

    results = gguf_import.main(["--workers", "1", "--dtypes", "bfloat16", "--rounds", "1",
                                "--no-extrapolation", "--work-dir", str(tmp_path / "work"),
                                "--out", str(tmp_path / "gguf_import.json")])
    (row,) = results["best"]
    assert (row["workers"], row["dtype"], row["weights"]) == (1, "bfloat16", 268_098_176)
    assert row["bytes"] == 2 * row["weights"]
    assert row["mb_per_s"] == pytest.approx(row["bytes"] / 1e6 / row["convert_s"])
    assert sum(row[f"{p.removesuffix('_s')}_share"] for p in ("dequantize_s", "cast_s",
                                                              "write_s")) == pytest.approx(1)
    assert row["load_s"] > 0 and len(results["effective_cores"]) == 1
    assert (tmp_path / "gguf_import.json").is_file()
    assert not list((tmp_path / "work").glob("cache-*"))


@pytest.mark.parametrize("form", ["forward", "layout"])
def test_embedding_gradient_bench_times_the_same_gradient_in_both_forms(form):
    """bench/embedding_gradient.py's "before" and the loss's form now give the embedding the
    same gradient, chunked, with LoRA's trained token rows and through a soft cap: formed in the
    forward pass against recomputed (the batch's summed loss), and the recompute's
    vocabulary-major logits against token-major ones in float32 (per segment)."""
    import embedding_gradient

    from gemmalab.model import cross_entropy

    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.bfloat16)
    embedding = jnp.asarray(rng.normal(size=(50, 8)), jnp.bfloat16)
    update = jnp.asarray(rng.normal(size=(2, 8)) * 0.1, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 50, (2, 10)))
    mask = jnp.asarray(rng.random((2, 10)) > 0.3)
    segments = jnp.asarray(np.repeat([[1, 1, 1, 2, 2, 3, 3, 3, 3, 0]], 2, 0))
    options = dict(softcap=5.0, max_logits=3 * 50 * 2, row_updates=(jnp.asarray([3, 7]), update))

    def gradient():
        def loss(e):
            if form == "forward":
                return cross_entropy.chunked_cross_entropy(hidden, e, targets, mask,
                                                           **options)[0] / 7.0
            sums, _ = cross_entropy.chunked_segment_nll(hidden, e, targets, mask, segments,
                                                        num_segments=3, **options)
            return jnp.sum(sums * jnp.asarray([1.0, -2.0, 0.5]))
        return jax.jit(jax.grad(loss))(embedding).astype(jnp.float32)

    now = gradient()
    with (embedding_gradient.recomputed() if form == "forward"
          else embedding_gradient.token_major()):
        before = gradient()
    assert float(jnp.abs(now).max()) > 0
    # bf16 gradients (other CPUs may round elsewhere): within two bf16 steps of the largest
    # element.
    np.testing.assert_allclose(now, before, rtol=1e-2, atol=float(jnp.abs(now).max()) / 128)


@pytest.mark.parametrize("max_logits", [1 << 20, 3 * 50 * 2])
def test_logits_widening_bench_times_the_same_gradient_both_ways(max_logits):
    """bench/logits_widening.py's "before" (one float32 widening shared with the log-sum-exp)
    gives the same gradients as the loss now, in one chunk and chunked, through a soft cap."""
    import logits_widening
    from loss_recompute import loss_part_replaced

    from gemmalab.model import cross_entropy

    rng = np.random.default_rng(3)
    hidden = jnp.asarray(rng.normal(size=(2, 10, 8)), jnp.bfloat16)
    embedding = jnp.asarray(rng.normal(size=(50, 8)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 50, (2, 10)))
    mask = jnp.asarray(rng.random((2, 10)) > 0.3)

    def gradients():
        def loss(h, e):
            return cross_entropy.chunked_cross_entropy(h, e, targets, mask, softcap=5.0,
                                                       max_logits=max_logits)[0]
        return [g.astype(jnp.float32) for g in jax.jit(jax.grad(loss, (0, 1)))(hidden,
                                                                                 embedding)]

    now = gradients()
    with loss_part_replaced("_logit_gradient", logits_widening.shared_widening):
        before = gradients()
    for a, b in zip(now, before, strict=True):
        assert float(jnp.abs(a).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=float(jnp.abs(a).max()) / 128)


def test_cpu_dot_forms_compute_the_same_products_in_each_form():
    """The embedding gradient's four forms are one matrix (two of them transposed), and so are
    the square products, the input gradients and the weight gradients in their two spellings:
    equal work timed."""
    import cpu_dot_forms

    table = {name: (fn, operands) for name, fn, operands, _ in
             cpu_dot_forms.forms(vocab=96, tokens=16, dim=8, size=32)}

    def run(prefix):
        (fn, operands), = [v for k, v in table.items() if k.startswith(prefix)]
        return jax.jit(fn)(*operands).astype(jnp.float32)

    # Products of bfloat16 summed in float32 in another order (another kernel on another CPU):
    # float32 rounding at the product's scale; rounded to bfloat16 after, a bfloat16 step.
    same_f32, same_bf16 = REORDERED_FLOAT32, REORDERED_BFLOAT16
    autodiff = run("embedding gradient tv,td->vd")
    assert autodiff.shape == (96, 8)
    assert_close_to_scale(run("embedding gradient g^T copied"), autodiff, same_f32)
    assert_close_to_scale(run("embedding gradient transposed: x^T copied").T, autodiff,
                          same_f32)
    assert_close_to_scale(run("embedding gradient transposed: x^T materialized").T, autodiff,
                          same_f32)
    assert_close_to_scale(run("square a.b^T"), run("square einsum mk,nk"), same_bf16)
    for contracted in (32, 8):
        assert_close_to_scale(
            run(f"its input gradient as autodiff emits it (dy.w^T, {contracted} contracted)"),
            run(f"the same written dy @ w.T ({contracted} contracted)"), same_bf16)
    for shape in ("w[8,32]", "w[32,8]"):
        assert_close_to_scale(run(f"its weight gradient td,tf->df ({shape}"),
                              run(f"the same, x^T materialized: dt,tf->df ({shape})"), same_bf16)
    loss_form = run("logits einsum td,vd->tv")
    assert_close_to_scale(run("logits x.E^T with E^T stored"), loss_form, same_f32)
    assert_close_to_scale(run("logits vocabulary-major").T, loss_form, same_f32)
    fn, operands = table["logits x.E^T"]
    seconds, gflops = cpu_dot_forms.rate(fn, *operands, flops=2.0 * 16 * 96 * 8, repeats=1)
    assert seconds > 0 and gflops == pytest.approx(2.0 * 16 * 96 * 8 / seconds / 1e9)


FAKE_SIDE = """
import json, sys
from vs_hf_peft_quality import Turns
side, steps, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
turns = Turns(2)
turns.ready()
for step in range(1, steps + 1):
    turns.before(step)
    with open(log, "a") as f:
        f.write(f"{side} {step}\\n")
    turns.after(step, step == steps)
print("RESULT " + json.dumps({"side": side, "steps": steps}))
"""


def test_time_to_quality_sides_take_turns_of_steps_and_split_held_out_text(tmp_path,
                                                                           monkeypatch):
    """Each side runs its steps only in its own turn (the other waits), to its end; and the
    validation split never holds a document of the held-out split, nor trains on one."""
    import vs_hf_peft_quality as quality

    script, log = tmp_path / "side.py", tmp_path / "steps.log"
    script.write_text(FAKE_SIDE)
    bench = str(Path(quality.__file__).parent)
    monkeypatch.setenv("PYTHONPATH", bench)
    monkeypatch.setattr(quality, "child_command", lambda args, side: [
        sys.executable, str(script), side, "5" if side == "peft" else "3", str(log)])
    results = quality.children_taking_turns(None)
    assert results == {"peft": {"side": "peft", "steps": 5},
                       "gemmalab": {"side": "gemmalab", "steps": 3}}
    assert log.read_text().split("\n")[:-1] == [
        "peft 1", "peft 2", "gemmalab 1", "gemmalab 2", "peft 3", "peft 4", "gemmalab 3",
        "peft 5"]

    texts = [f"document {i}" for i in range(400)]
    test = {t: quality.split_of(t, validation=False) for t in texts}
    validation = {t: quality.split_of(t, validation=True) for t in texts}
    assert 0.08 < sum(s == "held_out" for s in test.values()) / len(texts) < 0.22
    for text in texts:
        if test[text] == "held_out":
            assert validation[text] is None  # never seen while choosing a recipe
        else:
            assert validation[text] in ("train", "held_out")
    assert 0 < sum(s == "held_out" for s in validation.values()) < sum(
        s == "train" for s in validation.values())


def test_suite_phases_records_each_tests_compile_and_its_childrens_cpu(tmp_path):
    import suite_phases

    (tmp_path / "test_sample.py").write_text(
        "import subprocess, sys\n"
        "import jax, jax.numpy as jnp\n"
        "def chain(x):\n"
        "    for _ in range(50):\n"
        "        x = jnp.sin(x) @ x.T\n"
        "    return x\n"
        "def test_compiles():\n"
        "    jax.jit(chain)(jnp.ones((64, 64))).block_until_ready()\n"
        "def test_starts_a_process():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(range(10**7))'], check=True)\n")
    bench = Path(suite_phases.__file__).parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "suite_phases",
         "-o", "addopts=", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        env={**{k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"},
             "PYTHONPATH": str(bench), "SUITE_PHASES_DIR": str(tmp_path / "phases")},
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (tmp_path / "phases" / "main.jsonl").read_text().splitlines()
    compiled, started = (json.loads(line) for line in lines)
    assert compiled["test"].endswith("::test_compiles") and compiled["compile"] > 0
    assert compiled["trace"] > 0 and compiled["cpu_children"] == 0
    assert started["compile"] == 0 and started["cpu_children"] > 0.05
    text = suite_phases.report(tmp_path / "phases")
    assert "all 2 tests" in text and "::test_compiles" in text


def test_allocator_bench_runs_each_setting_turn_about_and_reports_the_ratio(monkeypatch, capsys):
    """bench/allocator.py (through huge_pages.compare): one process per setting and pair, in
    turn, each under its own environment; the ratio is glibc's median over mimalloc's."""
    import allocator
    import huge_pages

    from gemmalab import allocator as gemmalab_allocator

    if gemmalab_allocator.library_path() is None:
        pytest.skip("mimalloc is installed on Linux only")
    calls = []

    def fake_run(environment, lora_rank, maxlen, steps):
        on_mimalloc = "mimalloc" in environment.get("LD_PRELOAD", "")
        calls.append((on_mimalloc, lora_rank, maxlen, steps))
        return {"median_s": 3.0 if on_mimalloc else 6.0, "faults_per_step": 0.0,
                "system_s_per_step": 0.0, "peak_rss_gb": 1.0, "loss": 1.5,
                "compaction_stalls": 0}

    monkeypatch.setattr(huge_pages, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["allocator.py", "--modes", "lora", "--pairs", "2",
                                      "--steps", "3"])
    allocator.main()
    assert calls == [(False, 8, 128, 3), (True, 8, 128, 3)] * 2
    assert "**2.00x**" in capsys.readouterr().out


def test_llamacpp_check_applies_the_decided_token_rule_and_masks_perplexity():
    """bench/llamacpp_check.py's comparisons (llama.cpp itself runs in `make llamacpp` only)."""
    import llamacpp_check

    ours, margins = [5, 6, 7, 8], [2.0, 1.0, 0.1, 3.0]  # decided: the first two choices
    agree = llamacpp_check.decided_agreement(ours, margins, [5, 6, 9, 9], margin=0.5)
    assert (agree["decided_positions"], agree["ok"], agree["identical"],
            agree["first_difference"]) == (2, True, False, 2)
    assert not llamacpp_check.decided_agreement(ours, margins, [5, 4, 7, 8], 0.5)["ok"]
    logprobs = [[np.log(0.5), np.log(0.25)], [np.log(0.5)]]
    assert llamacpp_check.perplexity(logprobs, [[True, False], [True]]) == pytest.approx(2.0)


def test_jax_peers_bench_counts_useful_targets_and_pins_every_peer_package():
    """bench/vs_jax_peers.py: the peers' padded rows, their useful (loss-bearing) targets per
    batch, the held-out windows' target mask; and ``make peers``' files pin every package."""
    import vs_jax_peers

    docs = [[2, 5, 6, 1], [2, 7, 1], [2, 8, 9, 10, 11, 12, 1]]  # 4, 3 and 7 ids
    ids, mask, per_batch = vs_jax_peers.rows_for_budget(docs, batch=2, length=5, budget=6)
    assert ids.shape[1] == 5 and len(ids) % 2 == 0
    # each row: its first ``length`` ids, padding masked; targets: a row's real ids but its first
    assert per_batch == [int(mask[i:i + 2, 1:].sum()) for i in range(0, len(ids), 2)]
    order = np.random.default_rng(vs_jax_peers.SEED).permutation(len(docs))
    picked = [docs[order[i % len(docs)]] for i in range(len(ids))]  # shuffled, cycled
    assert [int(m.sum()) for m in mask] == [min(len(d), 5) for d in picked]
    assert sum(per_batch) >= 6
    assert not ids[~mask].any()
    batches = vs_jax_peers.held_out_batches([[2, 5, 6, 7, 8, 1]], maxlen=4)
    assert len(batches) == 1 and batches[0]["inputs"].shape == (vs_jax_peers.EVAL_BATCH, 4)
    # windows of maxlen + 1 ids: [2 5 6 7 8] then [8 1]: 4 + 1 targets, the filler rows none
    assert batches[0]["target_mask"].sum() == 5
    assert batches[0]["targets"][1, 0] == 1
    for kit in ("tunix", "keras-hub"):
        pins = (BENCH / "peers" / f"{kit}-requirements.txt").read_text().splitlines()
        packages = [line for line in pins if line and not line.startswith(("#", " "))]
        assert packages and all("==" in line for line in packages), kit
        assert any(line.startswith("jax==") for line in packages)
