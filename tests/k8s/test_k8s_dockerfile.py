"""The Dockerfile, read without Docker: stages, non-root final images, pins that match the lock."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from dataclasses import dataclass, field

from gemmalab.k8s import jupyterhub
from gemmalab.k8s.config import RUN_AS_USER
from tests.helpers.k8s import ROOT

FINAL = ("cpu", "gpu", "tpu")


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARGs and the stages, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line in filter(None, (line.strip() for line in text.splitlines())):
        keyword, _, arg = line.partition(" ")
        keyword, arg = keyword.upper(), " ".join(arg.split())
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+) AS (\S+)", arg, re.IGNORECASE)
            assert match, f"unnamed stage: FROM {arg}"
            current = stages[match[2]] = Stage(match[2], match[1])
        elif current is None:
            assert keyword == "ARG", line
            name, _, value = arg.partition("=")
            global_args[name] = value
        else:
            current.instructions.append((keyword, arg))
    return global_args, stages


GLOBAL_ARGS, STAGES = parse_dockerfile((ROOT / "Dockerfile").read_text())


def _arg(stage: str, name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in STAGES[stage].all("ARG") if a.startswith(name + "=")]
    return value


def _locked() -> dict[str, str]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return {p["name"]: p["version"] for p in lock["package"] if "version" in p}


def _ancestry(name: str) -> list[str]:
    chain = [name]
    while STAGES[chain[-1]].base in STAGES:
        chain.append(STAGES[chain[-1]].base)
    return chain


def test_stages_exist_and_tpu_is_the_default_target():
    assert {"python", "builder", "builder-tpu", "builder-gpu", "runtime", *FINAL} <= set(STAGES)
    assert list(STAGES)[-1] == "tpu"  # `docker build .` builds the TPU image
    assert GLOBAL_ARGS["PYTHON_IMAGE"].startswith("python:3.12-")


def test_final_images_run_as_the_non_root_user_of_the_manifests():
    runtime = " ".join(STAGES["runtime"].all("RUN"))
    assert f"--uid {RUN_AS_USER}" in runtime and f"--gid {RUN_AS_USER}" in runtime
    for name in FINAL:
        [user] = STAGES[name].all("USER")
        assert user.split(":")[0] not in ("root", "0") and user.split(":")[0] == str(RUN_AS_USER)
        assert STAGES[name].instructions[-1][0] in ("USER", "CMD")


# The one Debian package a final image installs: a runtime library (mimalloc's libatomic), its
# package lists removed in the same step.
RUNTIME_LIBRARIES = ("apt-get update && apt-get install --yes --no-install-recommends libatomic1 "
                     "&& rm -rf /var/lib/apt/lists/* && ")


def test_final_images_carry_no_build_tools():
    for name in FINAL:
        for stage in _ancestry(name):
            if stage.startswith("builder"):
                raise AssertionError(f"{name} is built on {stage}")
            for command in STAGES[stage].all("RUN"):
                rest = command.removeprefix(RUNTIME_LIBRARIES)
                assert not re.search(r"\b(apt-get|apk|gcc|make|uv|pip install)\b", rest), (
                    f"{stage}: RUN {command}")
        copies = STAGES[name].all("COPY")
        # The locked venv from a builder, then gemmalab's own layer from the project stage.
        venv = [c for c in copies if "/opt/venv" in c]
        assert venv[0].startswith("--from=builder") and venv[0].endswith(" /opt/venv /opt/venv")
        assert venv[1:] == ["--from=project /opt/project/ /opt/venv/lib/python3.12/site-packages/"]
    assert "pip uninstall" in " ".join(STAGES["runtime"].all("RUN"))
    assert any(c.startswith("notebooks/") for c in STAGES["runtime"].all("COPY"))


def test_dependencies_come_from_the_lock():
    builder = " ".join(STAGES["builder"].all("RUN"))
    assert "uv sync --frozen --no-dev --no-install-project" in builder
    assert not any(c.startswith("gemmalab") for c in STAGES["builder"].all("COPY"))
    # gemmalab alone, on top: nothing unlocked comes with it, and a change to it leaves the
    # dependency layer cached.
    [project] = STAGES["project"].all("RUN")
    assert "uv pip install" in project and "--no-deps" in project
    assert _ancestry("project")[:2] == ["project", "builder"]
    makefile = (ROOT / "Makefile").read_text()
    assert f"UV_VERSION := {_arg('builder', 'UV_VERSION')}" in makefile
    for stage in ("builder", "builder-tpu", "builder-gpu"):
        for command in STAGES[stage].all("RUN"):
            if "uv pip install" in command:
                assert "--constraint requirements.txt" in command


def test_accelerator_pins_match_the_project():
    locked = _locked()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"jax=={locked['jax']}" in pyproject["dependencies"]
    for stage, extra in (("builder-tpu", "tpu"), ("builder-gpu", "cuda12")):
        assert _arg(stage, "JAX_VERSION") == locked["jax"] == locked["jaxlib"]
        assert f'"jax[{extra}]==${{JAX_VERSION}}"' in " ".join(STAGES[stage].all("RUN"))
    # libtpu: the exact release jax[tpu] accepts (jax's metadata pins a series, e.g. 0.0.50.*).
    [series] = [r for r in importlib.metadata.requires("jax")
                if r.startswith("libtpu") and 'extra == "tpu"' in r]
    prefix = re.search(r"libtpu\s*==\s*([\d.]+)\.\*", series)[1]
    assert _arg("builder-tpu", "LIBTPU_VERSION").startswith(prefix + ".")
    # From PyPI, the release uv.lock holds (its tpu-compile group): no other index.
    assert _arg("builder-tpu", "LIBTPU_VERSION") == locked["libtpu"]
    assert "--find-links" not in " ".join(STAGES["builder-tpu"].all("RUN"))


def test_jupyterhub_matches_the_chart():
    assert _arg("builder", "JUPYTERHUB_VERSION") == "5.5.0"  # zero-to-jupyterhub 4.4.0's hub
    assert jupyterhub.CHART_VERSION == "4.4.0"


def test_dockerignore_keeps_the_context_small():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines  # allow-list
    for needed in ("pyproject.toml", "uv.lock", "requirements.txt", "README.md", "gemmalab/",
                   "notebooks/"):
        assert f"!{needed}" in lines
    copied = [path for s in STAGES.values() for c in s.all("COPY") if not c.startswith("--")
              for path in c.split()[:-1]]
    assert "uv.lock" in copied and "notebooks/" in copied
    for path in copied:
        assert f"!{path}" in lines, f"COPY {path} is excluded by .dockerignore"
