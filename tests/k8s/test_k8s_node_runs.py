"""train.ipynb really run by the local cluster's CPU node, from the image built here
(``make image``'s cpu target, loaded into the node's containerd), with the manifests GKE gets but
for the CPU profile: a queued 1-host Job, a 2-host JobSet that trains as one JAX job, a
preempted JobSet that resumes, and bad input failing in one line. Needs root and buildah (else
the cluster has no CPU node: skipped).

The tiny preset, cut to 2 layers, float32, on a tokenizer trained here and put in /data. The
2-host runs read ``pairs.txt``, where every training story is there twice in a row: the text
format deals train stories to processes in turn, so each of the 2 processes trains on exactly
the stories of ``once.txt`` (the held-out stories are the same in both files). Each process's
local batch of 4 is then the 1-host run's batch of 4, and the 2-host global batch of 8 is that
batch twice: the same token-weighted loss and gradient, so the losses must agree to float32
summation order.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from kubernetes import client as k8s

from gemmalab.data import corpus, documents
from gemmalab.data.tokenizer import train_local_tokenizer
from gemmalab.k8s import client, launch, manifests
from gemmalab.k8s.cluster import image
from gemmalab.k8s.config import DATA_MOUNT, ClusterConfig, local_volumes
from gemmalab.weights import orbax_params
from tests.helpers.k8s import make_queue, wait_for, workload_admitted
from tests.helpers.numerics import REORDERED_FLOAT32

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

STORIES = 300
HELD_OUT = 4  # the first 200 documents of either file hold them: positions 49, 99, 149, 199
STEPS = 120  # enough for an eviction to land mid-run (~0.1 s a step)
EVICT_AFTER = 10
RUN_TIMEOUT_S = 900
TRAIN = dict(recipe="tiny", num_layers=2, maxlen=64, max_steps=STEPS, eval_every=0,
             log_every=1, tokenize_workers=1, seed=5, compute_dtype="float32", max_new_tokens=4,
             max_eval_stories=HELD_OUT, checkpoint_every=0)


@pytest.fixture(scope="module")
def cpu_image(cpu_node) -> str:
    """The cpu image (built once per machine, a cached rebuild otherwise), in the node."""
    name = image.build_image("cpu")
    return image.load_into_node(name, cpu_node.layout)


def write_stories(path: Path, stories: list[str]) -> Path:
    path.write_text("".join(f"{story}\n{corpus.SEPARATOR}\n" for story in stories))
    path.chmod(0o644)
    return path


@pytest.fixture(scope="module")
def data(cpu_node) -> dict[str, str]:
    """``once.txt``, ``pairs.txt`` and their tokenizer in the node's /data folder; the paths
    the pods see."""
    folder = local_volumes()[0] / f"test-{uuid.uuid4().hex[:8]}"
    folder.mkdir(mode=0o755)
    stories = list(corpus.generate_stories(STORIES + HELD_OUT, seed=3))
    held_out, train = stories[:HELD_OUT], stories[HELD_OUT:]
    rule = documents.SplitRule(eval_fraction=0.02, max_eval_stories=HELD_OUT)

    def layout(train_stories: list[str]) -> list[str]:
        evals, trains, out = iter(held_out), iter(train_stories), []
        for i in range(len(train_stories) + HELD_OUT):
            out.append(next(evals) if rule.is_eval(i) else next(trains))
        return out

    write_stories(folder / "once.txt", layout(train))
    write_stories(folder / "pairs.txt", layout([s for story in train for s in (story, story)]))
    tokenizer = train_local_tokenizer(train, folder / "tokenizer.model", vocab_size=600)
    tokenizer.chmod(0o644)
    inside = f"{DATA_MOUNT}/{folder.name}"
    yield {"once": f"{inside}/once.txt", "pairs": f"{inside}/pairs.txt",
           "tokenizer": f"{inside}/tokenizer.model"}
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def outputs_of(job_name: str) -> Path:
    return local_volumes()[1] / job_name


def submit(cluster, namespace: str, job_name: str, params: dict[str, Any], **fields: Any
           ) -> ClusterConfig:
    config = ClusterConfig(job_name=job_name, namespace=namespace, accelerator="cpu",
                           params=params, **fields)
    client.submit(manifests.build(config), api_client=cluster.api)
    return config


def finish(cluster, namespace: str, job_name: str) -> client.RunOutcome:
    return launch.watch(job_name, namespace, timeout_s=RUN_TIMEOUT_S, poll_s=2,
                        api_client=cluster.api)


def metrics(job_name: str) -> list[dict[str, Any]]:
    return launch.read_jsonl(str(outputs_of(job_name) / "metrics.jsonl"))


def losses(job_name: str) -> np.ndarray:
    return np.asarray([row["loss"] for row in metrics(job_name)])


@pytest.fixture(scope="module")
def run_names():
    """Unique job names (the outputs folder is shared by every namespace); removed after."""
    names: list[str] = []

    def name(stem: str) -> str:
        names.append(f"{stem}-{uuid.uuid4().hex[:6]}")
        return names[-1]

    yield name
    for job in names:
        folder = outputs_of(job)
        if folder.is_dir():
            import shutil

            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def one_host(cpu_node, cpu_image, data, module_namespace, run_names) -> str:
    """The 1-host reference: batch 4 of once.txt, through a Kueue LocalQueue whose
    ClusterQueue has the CPU node's flavor."""
    queue = make_queue(cpu_node, module_namespace, {"cpu": 1}, accelerator="cpu")
    job = run_names("one")
    submit(cpu_node, module_namespace, job, {**TRAIN, "batch_size": 4, "data_path": data["once"],
                                             "tokenizer": data["tokenizer"]}, queue=queue)
    outcome = finish(cpu_node, module_namespace, job)
    assert outcome.state == "Succeeded", (outcome, client.tail_logs(
        job, module_namespace, api_client=cpu_node.api))
    assert workload_admitted(cpu_node, module_namespace, job)
    return job


def two_host_params(data: dict[str, str]) -> dict[str, Any]:
    return {**TRAIN, "batch_size": 8, "data_path": data["pairs"], "tokenizer": data["tokenizer"]}


@pytest.fixture(scope="module")
def two_hosts(cpu_node, cpu_image, data, module_namespace, run_names) -> str:
    job = run_names("two")
    submit(cpu_node, module_namespace, job, two_host_params(data), num_nodes=2)
    outcome = finish(cpu_node, module_namespace, job)
    assert outcome.state == "Succeeded", (outcome, client.tail_logs(
        job, module_namespace, api_client=cpu_node.api))
    return job


def test_a_queued_one_host_job_writes_what_make_demo_writes(cpu_node, one_host,
                                                            module_namespace):
    folder = outputs_of(one_host)
    for written in ("train.ipynb", "metrics.jsonl", "summary.json", "params"):
        assert (folder / written).exists(), sorted(p.name for p in folder.iterdir())
    assert [row["step"] for row in metrics(one_host)] == list(range(1, STEPS + 1))
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["processes"] == 1
    executed = json.loads((folder / "train.ipynb").read_text())
    assert executed["metadata"]["papermill"]["exception"] is None
    # papermill's cell output reaches the pod's log (--log-output), read through the API server.
    log = "\n".join(client.tail_logs(one_host, module_namespace, tail_lines=400,
                                     api_client=cpu_node.api).values())
    assert "Executing notebook" in log or "Ending Cell" in log, log[-2000:]


def test_two_hosts_train_as_one_jax_job_with_the_one_hosts_losses(one_host, two_hosts):
    folder = outputs_of(two_hosts)
    for host in (0, 1):  # each host's executed notebook
        executed = json.loads((folder / f"train-slice0-host{host}.ipynb").read_text())
        assert executed["metadata"]["papermill"]["exception"] is None
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["steps"] == STEPS
    # float32, sums over 8 rows on 2 processes vs 4 rows on 1: another order only.
    np.testing.assert_allclose(losses(two_hosts), losses(one_host), rtol=REORDERED_FLOAT32)


def test_a_preempted_two_host_jobset_resumes_and_ends_bitwise_equal(
        cpu_node, two_hosts, data, module_namespace, run_names):
    job = run_names("evicted")
    submit(cpu_node, module_namespace, job, two_host_params(data), num_nodes=2)
    wait_for("training to be under way", lambda: len(metrics(job)) >= EVICT_AFTER,
             RUN_TIMEOUT_S, poll_s=0.1)
    core = k8s.CoreV1Api(cpu_node.api)
    first = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(
        module_namespace, label_selector=f"{manifests.INSTANCE_LABEL}={job}").items}
    victim = sorted(first)[-1]
    core.create_namespaced_pod_eviction(victim, module_namespace, k8s.V1Eviction(
        metadata=k8s.V1ObjectMeta(name=victim, namespace=module_namespace)))
    outcome = finish(cpu_node, module_namespace, job)
    assert outcome.state == "Succeeded", (outcome, client.tail_logs(
        job, module_namespace, api_client=cpu_node.api))
    now = {p.metadata.uid for p in core.list_namespaced_pod(
        module_namespace, label_selector=f"{manifests.INSTANCE_LABEL}={job}").items}
    assert now and not now & set(first.values()), "the JobSet did not restart its pods"
    folder = outputs_of(job)
    rows = metrics(job)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # every step, once
    summary = json.loads((folder / "summary.json").read_text())
    resumed = summary["resumed_from_step"]
    assert EVICT_AFTER <= resumed < STEPS, resumed
    # The checkpoint saved in the grace period, resumed: the uninterrupted run's final params.
    stopped = orbax_params.load_params(str(folder / "params"))
    straight = orbax_params.load_params(str(outputs_of(two_hosts) / "params"))
    assert jax.tree.structure(stopped) == jax.tree.structure(straight)
    for a, b in zip(jax.tree.leaves(stopped), jax.tree.leaves(straight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case", ["missing data file", "outputs not writable"])
def test_bad_input_in_the_pod_fails_in_one_line(cpu_node, cpu_image, data, module_namespace,
                                                run_names, tmp_path_factory, case):
    job = run_names("bad")
    params = {**TRAIN, "batch_size": 4, "tokenizer": data["tokenizer"],
              "data_path": data["once"]}
    fields: dict[str, Any] = {}
    if case == "missing data file":
        params["data_path"] = data["once"].replace("once.txt", "absent.txt")
        expected = "ConfigError: data_path:"
    else:
        readonly = tmp_path_factory.mktemp("readonly-outputs")
        readonly.chmod(0o755)  # root's: uid 1000 cannot write
        fields["local_outputs_dir"] = str(readonly)
        expected = "ConfigError: outputs_bucket:"
    submit(cpu_node, module_namespace, job, params, **fields)
    outcome = finish(cpu_node, module_namespace, job)
    assert outcome.state == "Failed"
    log = "\n".join(client.tail_logs(job, module_namespace, tail_lines=200,
                                     api_client=cpu_node.api).values())
    lines = [line for line in log.splitlines() if line.startswith(expected)]
    assert lines, log[-3000:]
    assert lines[-1] in outcome.message, outcome
