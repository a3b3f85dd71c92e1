"""gemmalab.k8s.run_notebook before papermill starts: the run's output folder must take a file,
else one line naming the outputs bucket, also left as the container's termination message."""

from gemmalab.k8s import run_notebook


def test_an_output_folder_that_cannot_be_made_stops_in_one_line(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "outputs"
    blocker.write_text("a file where the bucket's folder should be\n")
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")
    monkeypatch.setattr(run_notebook, "TERMINATION_LOG", termination_log)
    monkeypatch.setenv(run_notebook.OUTPUT_DIR_VARIABLE, str(blocker / "my-run"))

    assert run_notebook.main(["train.ipynb", "out.ipynb"]) == run_notebook.CONFIG_EXIT_CODE

    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("ConfigError: outputs_bucket: this pod (uid ")
    assert f"{blocker / 'my-run'}" in line and "Fix: " in line
    assert termination_log.read_text() == line + "\n"


def test_a_termination_message_is_written_only_where_kubernetes_gave_a_file(tmp_path):
    run_notebook.write_termination_message("ConfigError: x", tmp_path / "absent")
    assert not (tmp_path / "absent").exists()
    path = tmp_path / "termination-log"
    path.write_text("")
    run_notebook.write_termination_message("ConfigError: data_path: no such file", path)
    assert path.read_text() == "ConfigError: data_path: no such file\n"


def test_papermill_and_its_kernel_get_the_allocators_choice(tmp_path, monkeypatch):
    started = {}

    class Started:
        def __init__(self, argv, preexec_fn, env):
            started.update(argv=argv, env=env)

        def wait(self):
            return 0

    monkeypatch.setattr(run_notebook.subprocess, "Popen", Started)
    monkeypatch.delenv(run_notebook.OUTPUT_DIR_VARIABLE, raising=False)
    monkeypatch.setenv("GEMMALAB_MALLOC", "system")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert run_notebook.main(["train.ipynb", "out.ipynb"]) == 0
    assert started["env"]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert started["argv"][-3:] == [run_notebook.AS_PAPERMILL, "train.ipynb", "out.ipynb"]
    monkeypatch.setenv("GEMMALAB_MALLOC", "jemalloc")  # a bad choice: one line, nothing started
    started.clear()
    assert run_notebook.main(["train.ipynb", "out.ipynb"]) == run_notebook.CONFIG_EXIT_CODE
    assert not started
