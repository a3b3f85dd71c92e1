"""Shared fixtures, and the hooks of the notebook regression tests (``tests/notebooks/``).

Eight virtual CPU devices make every test exercise the data-parallel mesh.

One JAX compilation cache for the suite, kept across sessions on this machine and inherited by
the notebooks' kernels and worker processes (tests/helpers/compile_cache.py): many tests compile
the same step (a run, its crashed twin, its resumed twin, the notebook copies and their
deliberately broken variants), and the next `make test` compiles only what changed.
"""

import contextlib
import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The helpers' asserts report their operands, as the tests' own do.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers import xla_flags  # noqa: E402
from tests.helpers.compile_cache import suite_compile_cache  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(suite_compile_cache())
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# tests/<stage>/ mirrors gemmalab/<stage>/; tests/ and each stage folder are packages (the
# modules are tests.<stage>.test_*), and what test modules share is in tests/helpers/.
TESTS = Path(__file__).resolve().parent

import gemmalab  # noqa: E402
from gemmalab.data import corpus  # noqa: E402
from tests.notebook_regression import (  # noqa: E402, F401
    pytest_addoption,
    pytest_collect_file,
    pytest_configure,
)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop before any test when gemmalab is not this checkout's: a virtual environment linked
    in from another clone imports that clone's (its editable install), and every test would
    pass or fail on code that is not the one under test."""
    imported = Path(gemmalab.__file__).resolve().parent.parent
    if imported != TESTS.parent:
        pytest.exit(f"the tests import gemmalab from {imported}, not from this checkout "
                    f"({TESTS.parent}): the environment belongs to another clone. Fix: `make "
                    "env` here, for a .venv of this checkout's own", returncode=4)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One gemmalab cache (corpora, tokenizers, token caches) for the whole session."""
    return tmp_path_factory.mktemp("gemmalab-cache")


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory) -> Path:
    """A small TinyStories-format file from the embedded generator."""
    return corpus.write_corpus(tmp_path_factory.mktemp("data") / "stories.txt", 400, seed=1)


# --- the local Kubernetes (tests/k8s/test_k8s_cluster.py) ---------------------------------------

@dataclasses.dataclass
class LocalCluster:
    layout: Any  # gemmalab.k8s.cluster.stack.Layout
    api: Any  # kubernetes.client.ApiClient with the cluster's admin credentials

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        from gemmalab.k8s.cluster import stack

        return stack.kubectl(self.layout, *args, stdin=stdin)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """The local Kubernetes (``make cluster``), started once per session or the running one
    reused (and then left running)."""
    from kubernetes import config as k8s_config

    from gemmalab.k8s.cluster import stack

    layout = stack.Layout.default()
    already_running = (stack.running_components(layout) == stack.expected_components(layout)
                       and stack.api_ready(layout))
    stack.up(layout, log=lambda line: print(f"[cluster] {line}", flush=True))
    api = k8s_config.new_client_from_config(config_file=str(layout.kubeconfig))
    try:
        yield LocalCluster(layout, api)
    finally:
        api.close()
        if not already_running:  # a cluster the user started stays up
            stack.down(layout)


_namespaces = itertools.count()


@contextlib.contextmanager
def _namespace(cluster: LocalCluster) -> Iterator[str]:
    """A namespace with the runs' service account, removed afterwards (with its runs and its
    ClusterQueues, labelled gemmalab-test=<namespace>)."""
    from kubernetes import client

    name = f"t{int(time.time()) % 100000}-{next(_namespaces)}"
    core = client.CoreV1Api(cluster.api)
    core.create_namespace({"metadata": {"name": name}})
    core.create_namespaced_service_account(name, {"metadata": {"name": "gemmalab-runner"}})
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false")
    # ClusterQueues are cluster-scoped: the test's own go with it.
    cluster.kubectl("delete", "clusterqueues.kueue.x-k8s.io", "-l", f"gemmalab-test={name}",
                    "--ignore-not-found")


@pytest.fixture
def run_namespace(local_cluster: LocalCluster) -> Iterator[str]:
    """A namespace of the test's own (``_namespace``)."""
    with _namespace(local_cluster) as name:
        yield name


@pytest.fixture(scope="module")
def module_namespace(local_cluster: LocalCluster) -> Iterator[str]:
    """A namespace for a test file's runs (``_namespace``), which it names apart."""
    with _namespace(local_cluster) as name:
        yield name


@pytest.fixture(scope="module")
def cpu_node(local_cluster: LocalCluster) -> LocalCluster:
    """The local cluster, with its real CPU node (as root: skipped without it)."""
    from gemmalab.k8s.cluster import node, stack

    if "kubelet" not in stack.running_components(local_cluster.layout):
        pytest.skip(f"no CPU node: {node.disabled_reason(local_cluster.layout)}")
    return local_cluster


# --- parallel runs (``make test``: pytest-xdist workers) -------------------------------------
# A test file runs on one worker, top to bottom, so its module fixtures (a trained run, the real
# 6 GB base) are built once. The notebook copies run together, in their order: data prep builds
# the token cache that train reads, and train writes the run the later copies read. (A scheduler
# of our own: xdist 3.8's ``loadgroup`` cannot rename pytest 9's node ids.)
NOTEBOOK_COPIES = "tests/notebooks/"
# The tests against the local Kubernetes share one worker: one cluster started (or reused) once,
# and runs that never compete for its fake nodes.
LOCAL_CLUSTER_FILES = ("tests/k8s/test_k8s_cluster.py", "tests/k8s/test_k8s_client.py",
                       "tests/k8s/test_k8s_cpu_node.py", "tests/k8s/test_k8s_image.py",
                       "tests/k8s/test_k8s_node_runs.py")
# The longest first, so that no worker is left with a long one at the end while the others idle
# (``--no-loadscope-reorder`` keeps this order).
LONGEST_FIRST = ("local-cluster", "notebook-copies", "tests/model/test_attention.py",
                 "tests/test_plan.py", "tests/test_notebook_regression.py",
                 "tests/train/test_resume.py", "tests/test_notebooks.py",
                 "tests/train/test_real_base.py", "tests/model/test_sharding.py",
                 "tests/train/test_multiprocess.py",
                 "tests/model/test_lora_gemma4.py", "tests/model/test_gemma4.py",
                 "tests/test_lab.py", "tests/weights/test_export.py", "tests/model/test_lora.py",
                 "tests/weights/test_peft_gemma4.py", "tests/weights/test_hf_gemma4.py")


def worker_scope(nodeid: str) -> str:
    """What runs on one worker: the notebook copies together, the local cluster's tests
    together, else the test's file."""
    path = nodeid.split("::", 1)[0]
    if path in LOCAL_CLUSTER_FILES:
        return "local-cluster"
    return "notebook-copies" if path.startswith(NOTEBOOK_COPIES) else path


def pytest_collection_modifyitems(config, items):
    rank = {scope: i for i, scope in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(worker_scope(item.nodeid), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist: one process, no scheduler
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    return ByFile(config, log)
