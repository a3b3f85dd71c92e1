"""The Dockerfile's images built here with buildah (gemmalab/k8s/cluster/image.py): what goes
into the local stand-in for python:3.12-slim-bookworm, the runc spec its runs get, and the built
cpu (and, when `make image-tpu` built it, tpu) image run as its user."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gemmalab.k8s.cluster import image

needs_builder = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("buildah") is None,
    reason="buildah builds and runs images as root (make test installs it there)")


def test_the_base_takes_the_interpreter_but_not_its_tests_bytecode_or_packages(tmp_path):
    prefix = tmp_path / "python"
    for relative in ("bin/python3.12", "bin/pip3", "bin/python", "lib/libpython3.12.so.1.0",
                     "lib/libpython3.12.a", "lib/python3.12/os.py",
                     "lib/python3.12/__pycache__/os.cpython-312.pyc",
                     "lib/python3.12/test/test_os.py", "lib/python3.12/site-packages/README.txt",
                     "lib/python3.12/site-packages/pip/__init__.py"):
        (prefix / relative).parent.mkdir(parents=True, exist_ok=True)
        (prefix / relative).write_text("x")
    assert [str(p) for p in image._python_files(prefix)] == [
        "bin/python3.12", "lib/libpython3.12.so.1.0", "lib/python3.12/os.py",
        "lib/python3.12/site-packages/README.txt"]
    # The base's name changes with any of its files.
    before = image.base_key(prefix)
    (prefix / "lib/python3.12/os.py").write_text("y")
    assert image.base_key(prefix) != before


def test_runs_get_the_images_user_command_and_no_rlimits():
    config = {"User": "1000:1000", "Entrypoint": ["python", "-m", "gemmalab.allocator"],
              "Cmd": ["papermill", "--help"], "Env": ["PATH=/opt/venv/bin:/usr/bin"],
              "WorkingDir": "/app"}
    spec = image.runtime_spec(config, "/rootfs", ["python", "-V"], {"X": "1"})
    process = spec["process"]
    assert process["user"] == {"uid": 1000, "gid": 1000}
    assert process["args"] == ["python", "-m", "gemmalab.allocator", "python", "-V"]
    assert process["env"] == ["PATH=/opt/venv/bin:/usr/bin", "X=1"] and process["cwd"] == "/app"
    # Setting either needs CAP_SYS_RESOURCE, which containers here lack.
    assert "rlimits" not in process and "oomScoreAdj" not in process
    assert image.runtime_spec(config, "/rootfs")["process"]["args"][-2:] == ["papermill",
                                                                          "--help"]


PROBE = """
import importlib.metadata, os, shutil, sys
import cv2, gemmalab, jax
from gemmalab import allocator
print(os.getuid(), importlib.metadata.version("gemmalab"), jax.devices()[0].platform)
print(gemmalab.__file__)
print(*[tool for tool in ("uv", "pip", "gcc", "cc", "make") if shutil.which(tool)])
print(allocator.library_path() is not None)
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
@needs_builder
def test_the_cpu_image_runs_gemmalab_as_its_user_without_build_tools():
    name = image.build_image("cpu")  # make test built it: buildah's layer cache
    done = image.run(name, ["python", "-c", PROBE], capture=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ids, location, tools, mimalloc = done.stdout.splitlines()[-4:]
    assert ids.split() == ["1000", image.project_version(), "cpu"]
    assert location == "/opt/venv/lib/python3.12/site-packages/gemmalab/__init__.py"
    assert tools == ""  # uv, pip and compilers stayed in the builder stages
    assert mimalloc == "True"  # it preloads: libatomic is in the image


@pytest.mark.slow
@needs_builder
def test_the_tpu_image_imports_libtpu():
    name = image.image_name("tpu")
    if not image.built(name):
        pytest.skip(f"{name} is not built here: make image-tpu")
    done = image.run(name, ["python", "-c", "import libtpu, jax; print(libtpu.__file__, "
                            "jax.__version__)"], capture=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.split()[-2]).name == "__init__.py"


def test_a_build_is_keyed_by_its_command_and_context_files(tmp_path):
    for name in image.CONTEXT:
        path = tmp_path / name
        if "." in name or name == "Dockerfile":
            path.write_text(name)
        else:
            (path / "sub").mkdir(parents=True)
            (path / "sub" / "module.py").write_text("x = 1\n")
    command = ["buildah", "bud", "--target", "cpu"]
    key = image.inputs_key(command, tmp_path)
    (tmp_path / "gemmalab" / "__pycache__").mkdir()
    (tmp_path / "gemmalab" / "__pycache__" / "module.cpython-312.pyc").write_bytes(b"\0")
    (tmp_path / "tests.py").write_text("outside the context")
    assert image.inputs_key(command, tmp_path) == key
    assert image.inputs_key([*command[:-1], "tpu"], tmp_path) != key
    (tmp_path / "gemmalab" / "sub" / "module.py").write_text("x = 2\n")
    assert image.inputs_key(command, tmp_path) != key
