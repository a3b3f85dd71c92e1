"""The install files agree with each other, and importing gemmalab has no side effects."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _locked_versions() -> dict[str, str]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return {p["name"]: p["version"] for p in lock["package"] if "version" in p}


def test_requirements_txt_matches_the_lock():
    locked = _locked_versions()
    pins = [line.split(";")[0].strip() for line in (ROOT / "requirements.txt").read_text()
            .splitlines() if "==" in line and not line.lstrip().startswith("#")]
    assert len(pins) > 100
    for pin in pins:
        name, version = pin.split("==")
        assert locked[name.lower().replace("_", "-")] == version, pin


def test_direct_dependencies_are_pinned_as_verified():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"].startswith(">=3.12")
    requirements = [d.split(";")[0].strip() for d in project["dependencies"]]  # no markers
    pinned = dict(d.split("==") for d in requirements if "==" in d)
    for name in ("gemma", "jax", "flax", "optax", "grain", "orbax-checkpoint", "sentencepiece",
                 "papermill", "kubernetes", "xprof"):
        assert name in pinned, name
    assert pinned["sentencepiece"] == "0.2.1"  # 0.2.3 clashes with tensorflow's protobuf
    locked = _locked_versions()
    for name, version in pinned.items():
        assert locked[name] == version, name


def test_environment_yml_installs_from_the_same_pins():
    text = (ROOT / "environment.yml").read_text()
    assert "python=3.12" in text and "-r requirements.txt" in text and "-e ." in text


def test_importing_gemmalab_is_cheap_and_side_effect_free():
    code = (
        "import sys, gemmalab.train.experiment, gemmalab.data.documents;"
        "import gemmalab.model.presets, gemmalab.data.tokenizer;"
        "import jax._src.distributed as d;"
        "assert 'gemma' not in sys.modules and 'tensorflow' not in sys.modules, 'gemma imported';"
        "assert d.global_state.client is None, 'jax.distributed initialised'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
