"""gemmalab.headless: papermill's command line, the kernel ended without its teardown, quiet
about training parameters."""

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from gemmalab import allocator


@pytest.mark.slow
def test_the_kernel_ends_without_its_teardown_and_parameters_still_apply(tmp_path):
    notebook = nbformat.v4.new_notebook()
    parameters = nbformat.v4.new_code_cell("marker = ''\nanswer = 0")
    parameters.metadata["tags"] = ["parameters"]
    notebook.cells = [parameters, nbformat.v4.new_code_cell(
        "import atexit, pathlib\n"
        "atexit.register(pathlib.Path(marker).write_text, 'teardown ran')\n"
        "import os\n"
        "mapped = 'libmimalloc' in open('/proc/self/maps').read()\n"
        "print('answer', answer, os.environ.get('GLIBC_TUNABLES'), mapped)")]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    source = tmp_path / "in.ipynb"
    nbformat.write(notebook, source)

    # mimalloc asked for by name: "auto" would choose by the host (gemmalab.allocator).
    environment = {**{k: v for k, v in os.environ.items()
                      if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}, allocator.CHOICE: "mimalloc"}

    def run(module: str, name: str) -> tuple[str, bool]:
        marker = tmp_path / f"{name}.marker"
        output = tmp_path / f"{name}.ipynb"
        # learning_rate: a TrainConfig field; answr: a name nothing reads.
        done = subprocess.run([sys.executable, "-m", module, str(source), str(output), "-p",
                               "marker", str(marker), "-p", "answer", "42", "-p", "learning_rate",
                               "0.1", "-p", "answr", "1", "--no-progress-bar"], check=True,
                              capture_output=True, text=True, cwd=tmp_path, env=environment)
        warned[name] = sorted(line.rsplit(" ", 1)[-1] for line in done.stderr.splitlines()
                              if "Passed unknown parameter" in line)
        printed = nbformat.read(output, as_version=4).cells[-1].outputs[0]["text"]
        return printed, marker.exists()

    warned = {}

    # Plain papermill: the kernel shuts down gracefully, so its atexit hooks run (the teardown
    # where ipykernel's pending-task traceback comes from). It reads no GEMMALAB_MALLOC.
    assert run("papermill", "graceful") == ("answer 42 None False\n", True)
    # The notebook's own output is all there; the kernel never ran its teardown. It allocates
    # with mimalloc (Linux, where the wheel is installed), else glibc's malloc with huge pages.
    on_mimalloc = allocator.library_path() is not None
    assert run("gemmalab.headless", "immediate") == (
        f"answer 42 glibc.malloc.hugetlb=1 {on_mimalloc}\n", False)
    # papermill notes both names the parameters cell lacks; headless only the one that is not a
    # training parameter (those notebooks read every TrainConfig field from their variables).
    assert warned == {"graceful": ["answr", "learning_rate"], "immediate": ["answr"]}


def test_a_failing_cell_is_reported_without_papermills_own_traceback(tmp_path):
    """A ConfigError in a cell is one line in the notebook; headless prints that, not the ~25
    lines of click and papermill frames the papermill command prints above it."""
    notebooks = Path(__file__).resolve().parent.parent / "notebooks"
    done = subprocess.run([sys.executable, "-m", "gemmalab.headless",
                           str(notebooks / "sample_compare.ipynb"), str(tmp_path / "out.ipynb"),
                           "-p", "max_new_token", "3", "--no-progress-bar"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" not in done.stderr
    assert done.stderr.rstrip().splitlines()[-1] == (
        "ConfigError: max_new_token: was passed to papermill but is not one of this notebook's "
        "parameters. Fix: did you mean max_new_tokens?")
