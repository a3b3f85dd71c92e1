"""Two real JAX processes (jax.distributed over gloo on localhost), as on two TPU hosts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemmalab.data import documents
from gemmalab.train import params
from gemmalab.weights import orbax_params
from tests.helpers import free_port, xla_flags
from tests.helpers.numerics import REORDERED_FLOAT32

# Run as a module from the repository's root: it imports tests.helpers.
WORKER = ["-m", "tests.train.multiprocess_worker"]
ROOT = Path(__file__).resolve().parents[2]
# The suite's flags, two CPU devices a process.
WORKER_XLA_FLAGS = xla_flags(xla_force_host_platform_device_count="2")


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the workers' own limit is 600 s
def test_two_processes_share_one_global_batch(tmp_path, stories_file):
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": WORKER_XLA_FLAGS}
    workers = [subprocess.Popen([sys.executable, *WORKER, str(i), "2", str(port),
                                 str(stories_file), str(tmp_path)], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]

    assert [r["devices"] for r in results] == [4, 4]
    assert [r["local_devices"] for r in results] == [2, 2]
    # Each process tokenized only its own shard; together they are the whole train split.
    total = sum(1 for _ in documents.iter_stories(str(stories_file)))
    eval_docs = results[0]["eval_docs"]
    assert results[1]["eval_docs"] == eval_docs
    assert results[0]["train_docs"] + results[1]["train_docs"] == total - eval_docs
    assert abs(results[0]["train_docs"] - results[1]["train_docs"]) <= 1
    # One tokenizer (trained once, shared), one model: identical global metrics everywhere.
    assert results[0]["tokenizer"] == results[1]["tokenizer"]
    assert results[0]["losses"] == results[1]["losses"]
    assert len(results[0]["losses"]) == 6
    # Sharded state saved collectively at step 3, each process restoring its own shards and
    # its own data position: the resumed run's 6 losses are the uninterrupted run's.
    assert all(r["params_sharded"] for r in results)
    assert [r["resumed_from"] for r in results] == [3, 3]
    assert results[0]["resumed_losses"] == results[0]["losses"] == results[1]["resumed_losses"]
    assert results[0]["final_eval_loss"] == results[1]["final_eval_loss"]
    assert results[0]["final_eval_loss"] < results[0]["initial_eval_loss"]
    # Sampling (and scoring its margins) runs on every host alike.
    assert results[0]["sample"] == results[1]["sample"]
    assert results[0]["sample"]["text"].startswith(results[0]["sample"]["decided"])
    # Only process 0 wrote metrics; the Orbax save is collective and loadable.
    run = tmp_path / "run"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 6
    assert (run / "summary.json").exists()
    from gemma import gm

    params = gm.ckpts.load_params(results[0]["saved"])
    assert params["embedder"]["input_embedding"].shape[0] == 600


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the workers' own limit is 600 s
def test_fsdp_spanning_two_processes_matches_one_process(tmp_path):
    """fsdp=4 over 2 processes x 2 devices trains like fsdp=4 on one process's 4 devices, and
    its sharded Orbax save restores shard for shard."""
    import jax

    from tests.helpers.models import _train

    port = free_port()
    env = {**os.environ, "XLA_FLAGS": WORKER_XLA_FLAGS}
    workers = [subprocess.Popen([sys.executable, *WORKER, str(i), "2", str(port), "-",
                                 str(tmp_path), "fsdp"], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"fsdp{i}.json").read_text()) for i in range(2)]
    reference, _ = _train({"fsdp": -1}, jax.devices()[:4])
    for result in results:
        # float32, gloo sums in another order (observed 2.1e-7 relative at most); losses of one
        # sign and size: rtol is relative to their scale, as tests/model/test_sharding.py's.
        np.testing.assert_allclose(result["losses"], reference, rtol=REORDERED_FLOAT32)
        assert result["restored_equal"] and result["restored_sharding_equal"]
        rows, width = result["global_shape"]
        assert result["local_shard_shape"] == [rows, width // 4]
    # The held weights' digest of the sharded params is that of the same params in one process.
    saved = orbax_params.load_params(str(tmp_path / "fsdp-params"))
    assert results[0]["digest"] == results[1]["digest"] == params.weights_digest(saved)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the workers' own limit is 600 s
def test_two_processes_read_their_own_parquet_row_groups(tmp_path, stories_file):
    """Parquet dealt to two real processes: each builds its cache from the eval rows' row
    groups and its own contiguous share, they agree on the step counts, and each one's batch
    iterator resumes exactly."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stories = list(documents.iter_stories(str(stories_file)))
    for i, (a, b) in enumerate([(0, 150), (150, 260), (260, len(stories))]):
        pq.write_table(pa.table({"text": stories[a:b]}), tmp_path / f"train-{i}.parquet",
                       row_group_size=10)
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": WORKER_XLA_FLAGS}
    workers = [subprocess.Popen([sys.executable, *WORKER, str(i), "2", str(port),
                                 str(tmp_path / "train-*.parquet"), str(tmp_path), "data"],
                                env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
               for i in range(2)]
    outputs = [w.communicate(timeout=600)[0] for w in workers]
    for worker, output in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"data{i}.json").read_text()) for i in range(2)]

    assert [r["eval_docs"] for r in results] == [3, 3]  # rows 9, 19 and 29, on both
    assert results[0]["eval_tokens"] == results[1]["eval_tokens"]
    assert [r["train_docs"] for r in results] == [(len(stories) - 3) // 2,
                                                  len(stories) - 3 - (len(stories) - 3) // 2]
    assert [r["stories_read"] for r in results] == [len(stories)] * 2
    assert results[0]["steps_per_epoch"] == results[1]["steps_per_epoch"]
    assert results[0]["tokenizer"] == results[1]["tokenizer"]
    assert all(r["resumed_equal"] for r in results)
    # Process 0's share (198 train rows, the 3 eval rows among them) ends at row 200, process
    # 1's starts at row 201: each read whole row groups of 10 rows, the eval rows' (0 - 29) and
    # its share's, and only the row group 200 - 209 that both shares cross.
    half = (len(stories) - 3) // 2 + 3
    assert results[0]["rows_read"] == list(range(half + (-half) % 10))
    assert results[1]["rows_read"] == [*range(30), *range(half - half % 10, len(stories))]
