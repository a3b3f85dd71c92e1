"""Shared fixtures, and the hooks of the notebook regression tests (``tests/notebooks/``).

Eight virtual CPU devices make every test exercise the data-parallel mesh.

One JAX compilation cache per test session, inherited by the notebooks' kernels and worker
processes: many tests compile the same step (a run, its crashed twin, its resumed twin, the
notebook copies and their deliberately broken variants); a cache hit skips XLA's compile. A
session's own directory, so another session (e.g. other CPU flags) never reads its executables.
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _COMPILATION_CACHE = tempfile.mkdtemp(prefix="gemmalab-test-jax-cache-")
    atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# tests/<stage>/ mirrors gemmalab/<stage>/. Test modules reuse helpers across those folders
# (e.g. model/test_lora.py resumes runs with train/test_resume.py's helpers): each folder is on
# the path, as pytest's default import mode puts a test module's own folder there.
TESTS = Path(__file__).resolve().parent
STAGE_FOLDERS = ("data", "inspect", "k8s", "model", "train", "weights")
sys.path[:0] = [str(TESTS / folder) for folder in STAGE_FOLDERS]

import socket  # noqa: E402

import pytest  # noqa: E402
from notebook_regression import (  # noqa: E402, F401
    pytest_addoption,
    pytest_collect_file,
    pytest_configure,
)

from gemmalab.data import corpus  # noqa: E402

PROMPT = "Once upon a time, there was a girl named Amy."


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One gemmalab cache (corpora, tokenizers, token caches) for the whole session."""
    return tmp_path_factory.mktemp("gemmalab-cache")


@pytest.fixture(scope="session")
def stories_file(tmp_path_factory) -> Path:
    """A small TinyStories-format file from the embedded generator."""
    return corpus.write_corpus(tmp_path_factory.mktemp("data") / "stories.txt", 400, seed=1)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_text(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# --- parallel runs (``make test``: pytest-xdist, ``--dist loadgroup``) ------------------------
# A test file runs on one worker, top to bottom, so its module fixtures (a trained run, the real
# 6 GB base) are built once. The notebook copies run in one group, in their order: data prep
# builds the token cache that train reads, and train writes the run the later copies read.
NOTEBOOK_COPIES = TESTS / "notebooks"


# The longest groups start first (``--no-loadscope-reorder`` keeps this order), so that no
# worker is left with a long one at the end while the others idle.
LONGEST_FIRST = ("notebook-copies", "model/test_attention.py", "test_plan.py",
                 "test_notebook_regression.py", "train/test_resume.py", "test_notebooks.py",
                 "train/test_real_base.py", "model/test_sharding.py", "train/test_multiprocess.py",
                 "test_lab.py", "weights/test_export.py", "model/test_lora.py")


def xdist_group(item) -> str:
    path = Path(item.path)
    return "notebook-copies" if path.parent == NOTEBOOK_COPIES else \
        path.relative_to(TESTS).as_posix()


def pytest_collection_modifyitems(config, items):
    rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(xdist_group(item), len(rank)))  # stable: file order
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group(item)))
