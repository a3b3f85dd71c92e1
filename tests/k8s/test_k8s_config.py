"""ClusterConfig: what a topology means in chips and hosts, and one-line errors for the rest."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from gemmalab.errors import ConfigError
from gemmalab.k8s import ClusterConfig, accelerators
from gemmalab.k8s.config import package_version
from gemmalab.k8s.notebook import encode_parameter, notebook_parameters, papermill_argv


@pytest.mark.parametrize(
    ("generation", "topology", "override", "chips", "per_host", "hosts", "label", "machine"),
    [
        ("v5e", "1x1", None, 1, 1, 1, "tpu-v5-lite-podslice", "ct5lp-hightpu-1t"),
        ("v5e", "2x2", None, 4, 4, 1, "tpu-v5-lite-podslice", "ct5lp-hightpu-4t"),
        ("v5e", "2x4", None, 8, 4, 2, "tpu-v5-lite-podslice", "ct5lp-hightpu-4t"),
        ("v5e", "2x4", 8, 8, 8, 1, "tpu-v5-lite-podslice", "ct5lp-hightpu-8t"),
        ("v6e", "1x1", None, 1, 1, 1, "tpu-v6e-slice", "ct6e-standard-1t"),
        ("v6e", "2x2", None, 4, 4, 1, "tpu-v6e-slice", "ct6e-standard-4t"),
        ("v6e", "2x4", None, 8, 4, 2, "tpu-v6e-slice", "ct6e-standard-4t"),
        ("v6e", "4x4", None, 16, 4, 4, "tpu-v6e-slice", "ct6e-standard-4t"),
        ("v6e", "16x16", None, 256, 4, 64, "tpu-v6e-slice", "ct6e-standard-4t"),
        ("v5p", "2x2x1", None, 4, 4, 1, "tpu-v5p-slice", "ct5p-hightpu-4t"),
        ("v5p", "2x2x2", None, 8, 4, 2, "tpu-v5p-slice", "ct5p-hightpu-4t"),
        ("v5p", "2x4x4", None, 32, 4, 8, "tpu-v5p-slice", "ct5p-hightpu-4t"),
    ],
)
def test_topology_derivations(generation, topology, override, chips, per_host, hosts, label,
                              machine):
    tpu = accelerators.tpu_slice(generation, topology, override)
    assert (tpu.chips, tpu.chips_per_host, tpu.hosts) == (chips, per_host, hosts)
    assert tpu.node_selector == {"cloud.google.com/gke-tpu-accelerator": label,
                                 "cloud.google.com/gke-tpu-topology": topology}
    assert tpu.machine_type == machine
    assert per_host in accelerators.TPU_GENERATIONS[generation].resources


def test_importing_the_package_builds_nothing_and_skips_kubernetes():
    code = ("import sys, gemmalab.k8s, gemmalab.k8s.config, gemmalab.k8s.accelerators;"
            "assert 'kubernetes' not in sys.modules, 'kubernetes imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cluster_derivations():
    config = ClusterConfig(accelerator="v6e", topology="2x4", num_slices=2,
                           params={"batch_size": 16})
    assert (config.hosts_per_slice, config.total_hosts, config.total_devices) == (2, 4, 16)
    assert config.multi_host and config.describe() == "2 x v6e 2x4"
    assert config.longest_pod_name == "gemma3-train-slice-1-1-abcde"
    gpu = ClusterConfig(accelerator="h200", num_nodes=2, params={"batch_size": 16})
    assert (gpu.total_hosts, gpu.devices_per_host, gpu.total_devices) == (2, 8, 16)
    assert gpu.node_selector == {"cloud.google.com/gke-accelerator": "nvidia-h200-141gb"}
    assert gpu.host_resources == accelerators.HostResources("168", "2160Gi")
    assert gpu.resolved_image.endswith(f"/gemmalab-gpu:{package_version()}")
    single = ClusterConfig()
    assert not single.multi_host and single.total_devices == 1
    assert single.resolved_data_bucket == "my-project-gemmalab-data"
    assert single.resolved_outputs_bucket == "my-project-gemmalab-outputs"
    assert single.google_service_account == "gemmalab-runner@my-project.iam.gserviceaccount.com"
    assert single.resolved_image == (
        f"us-east5-docker.pkg.dev/my-project/gemmalab/gemmalab-tpu:{package_version()}")


def test_the_config_is_frozen_and_its_params_too():
    config = ClusterConfig(params={"batch_size": 8})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.job_name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.params["batch_size"] = 9  # type: ignore[index]
    assert dataclasses.replace(config, project="acme-research").resolved_data_bucket == (
        "acme-research-gemmalab-data")


@pytest.mark.parametrize(
    ("fields", "parameter"),
    [
        ({"accelerator": "v4"}, "accelerator"),
        ({"accelerator": "v6e", "topology": "2x2x1"}, "topology"),
        ({"accelerator": "v5p", "topology": "2x2"}, "topology"),
        ({"accelerator": "v6e", "topology": "4x4", "chips_per_host": 8}, "chips_per_host"),
        ({"accelerator": "v6e", "topology": "2x4", "chips_per_host": 1}, "chips_per_host"),
        ({"accelerator": "v6e", "topology": "1x1", "num_slices": 2}, "num_slices"),
        ({"num_slices": 0}, "num_slices"),
        ({"num_nodes": 2}, "num_nodes"),
        ({"accelerator": "h200", "num_slices": 2}, "num_slices"),
        ({"accelerator": "h200", "gpus_per_node": 9}, "gpus_per_node"),
        ({"accelerator": "h100", "gpus_per_node": 4, "num_nodes": 2}, "gpus_per_node"),
        ({"params": [("batch_size", 64)]}, "params"),
        ({"params": {"output_dir": "/tmp/x"}}, "params.output_dir"),
        ({"params": {"not_a_parameter": 1}}, "params.not_a_parameter"),
        ({"params": {"model": "gemma4"}}, "params.model"),
        ({"params": {"batch_size": "64"}}, "params.batch_size"),
        ({"params": {"batch_size": 60}, "accelerator": "v6e", "topology": "2x4"},
         "params.batch_size"),
        ({"job_name": "Gemma_Train"}, "job_name"),
        ({"job_name": "1gemma"}, "job_name"),
        ({"job_name": "g" * 58}, "job_name"),  # + "-abcde" > 63
        ({"job_name": "g" * 48, "accelerator": "v6e", "topology": "2x4", "num_slices": 2},
         "job_name"),
        ({"namespace": "Team A"}, "namespace"),
        ({"project": "My Project"}, "project"),
        ({"region": "useast"}, "region"),
        ({"zone": "us-central1-a"}, "zone"),
        ({"service_account": "sa"}, "service_account"),
        ({"service_account": "jax_service_account"}, "service_account"),
        ({"data_bucket": "gs://data"}, "data_bucket"),
        ({"data_bucket": "shared", "outputs_bucket": "shared"}, "outputs_bucket"),
        ({"image": "gemmalab"}, "image"),
        ({"image": "us-docker.pkg.dev/p/r/gemmalab:latest"}, "image"),
        ({"termination_grace_period_s": -1}, "termination_grace_period_s"),
        ({"cache_size_gi": 0}, "cache_size_gi"),
        ({"active_deadline_s": 0}, "active_deadline_s"),
    ],
)
def test_impossible_configs_fail_with_one_line_naming_the_parameter(fields, parameter):
    with pytest.raises(ConfigError) as info:
        ClusterConfig(**fields)
    assert info.value.parameter == parameter
    message = str(info.value)
    assert message.startswith(f"{parameter}: ") and "Fix: " in message and "\n" not in message


def test_the_batch_error_suggests_a_batch_that_fits():
    with pytest.raises(ConfigError, match=r"params.batch_size: 100 is not divisible by the 16 "
                       r"data-parallel ways of 2 x v6e 2x4\. Fix: use a multiple of 16, e.g\. 96"):
        ClusterConfig(accelerator="v6e", topology="2x4", num_slices=2,
                      params={"batch_size": 100})
    # The notebook's default run's batch (the demo recipe's 8) is checked too.
    with pytest.raises(ConfigError, match="8 is not divisible by the 256 data-parallel ways"):
        ClusterConfig(accelerator="v6e", topology="16x16")


def test_valid_configs_pass():
    """The edges of what validation accepts, each meaning what it says."""
    v5p = ClusterConfig(accelerator="v5p", topology="2x2x2", params={"batch_size": 64})
    assert (v5p.total_hosts, v5p.total_devices, v5p.multi_host) == (2, 8, True)
    assert dict(v5p.params) == {"batch_size": 64}  # 64 splits over the 8 chips
    one_host = ClusterConfig(accelerator="v6e", topology="2x4", chips_per_host=8)
    assert (one_host.total_hosts, one_host.devices_per_host, one_host.multi_host) == (1, 8, False)
    assert one_host.tpu.machine_type == "ct6e-standard-8t"
    gpu = ClusterConfig(accelerator="h100", gpus_per_node=1, params={"learning_rate": 1e-4})
    assert gpu.is_gpu and (gpu.total_hosts, gpu.total_devices) == (1, 1)
    assert dict(gpu.params) == {"learning_rate": 1e-4}
    digest = "us-docker.pkg.dev/p/r/gemmalab@sha256:" + "a" * 64
    assert ClusterConfig(image=digest).resolved_image == digest
    # The pod name at the limit exactly (one more character is refused, above).
    assert len(ClusterConfig(job_name="g" * 57).longest_pod_name) == 63


def test_the_notebook_parameters_are_read_from_the_notebook():
    params = notebook_parameters()
    assert params is not None
    # A recipe ("": the default, demo unless a model or checkpoint is given) and the notebook's
    # own; every TrainConfig field is taken too (check_notebook_params), listed in the cell or not.
    assert set(params) == {"recipe", "prompt", "max_new_tokens"}
    assert params["recipe"] == "" and isinstance(params["max_new_tokens"], int)
    assert notebook_parameters("/nonexistent/train.ipynb") is None


def _papermill_parameters(argv: list[str], monkeypatch) -> dict:
    """What papermill's own command line makes of ``argv`` (execute_notebook is stubbed)."""
    import papermill.cli

    seen = {}
    monkeypatch.setattr(papermill.cli, "execute_notebook",
                        lambda **kwargs: seen.update(kwargs["parameters"]))
    monkeypatch.setattr(papermill.cli.logging, "basicConfig", lambda **kwargs: None)
    papermill.cli.papermill.main(argv, standalone_mode=False)
    return seen


def test_papermill_reads_back_exactly_the_values_given(monkeypatch):
    params = {"checkpoint": "123", "prompt": "None", "tokenizer": "1e5", "model": "gemma3-270m",
              "learning_rate": 2e-05, "datacount": None, "packing": False, "batch_size": 128,
              "data_path": "/data/a b.txt", "max_new_tokens": 0, "seed": -3,
              "listy": [1, "2", {"a": None}], "text": "-p looks like a flag"}
    argv = papermill_argv(notebook="in.ipynb", output_notebook="out.ipynb", output_dir="/o",
                          cache_dir="/c", compile_cache_dir="/o/.jax", params=params)
    parsed = _papermill_parameters(argv, monkeypatch)
    assert parsed == {**params, "output_dir": "/o", "cache_dir": "/c",
                      "compile_cache_dir": "/o/.jax"}
    assert encode_parameter("batch_size", 128) == ["-p", "batch_size", "128"]
    assert encode_parameter("checkpoint", "123") == ["-r", "checkpoint", "123"]
    with pytest.raises(ConfigError):
        encode_parameter("x", float("nan"))


def test_mesh_and_any_train_field_are_passed_and_checked_against_the_slice():
    from gemmalab.k8s import manifests

    config = ClusterConfig(accelerator="v6e", topology="2x4", num_slices=2,
                           params={"mesh": {"fsdp": -1}, "compute_dtype": "float32",
                                   "batch_size": 16})
    assert manifests.notebook_params(config)["num_slices"] == 2
    # tensor=2 leaves 4 data-parallel ways on the 8 chips of a v6e 2x4.
    with pytest.raises(ConfigError, match=r"^params\.batch_size: 6 is not divisible by the 4 "):
        ClusterConfig(accelerator="v6e", topology="2x4",
                      params={"mesh": {"data": -1, "tensor": 2}, "batch_size": 6})
    with pytest.raises(ConfigError, match=r"^params\.mesh: .* uses 3 devices but there are 8"):
        ClusterConfig(accelerator="v6e", topology="2x4", params={"mesh": {"data": 3}})


def test_a_gemma4_job_is_checked_like_a_gemma3_one():
    """``-p model gemma4-e4b -p checkpoint GEMMA4_E4B_PT``: resolved with Gemma 4's tokenizer;
    another generation's checkpoint refused by name before anything is submitted."""
    from gemmalab.k8s.config import check_notebook_params

    config, _ = check_notebook_params({"model": "gemma4-e4b", "checkpoint": "GEMMA4_E4B_PT",
                                       "lora_rank": 16})
    assert (config.model.preset, config.model.tokenizer) == ("gemma4-e4b", "gemma4")
    moe, _ = check_notebook_params({"checkpoint": "GEMMA4_26B_A4B_IT",
                                    "mesh": {"expert": 4, "fsdp": -1}})
    assert moe.model.preset == "gemma4-26b-a4b" and moe.runtime.mesh == {"expert": 4, "fsdp": -1}
    with pytest.raises(ConfigError, match="^params.checkpoint: GEMMA3_4B_PT does not fit model "
                                          "'gemma4-e4b'"):
        check_notebook_params({"model": "gemma4-e4b", "checkpoint": "GEMMA3_4B_PT"})
    with pytest.raises(ConfigError, match="^params.mesh: an expert axis of 8 splits nothing"):
        ClusterConfig(accelerator="v6e", topology="2x4",
                      params={"model": "gemma4-31b", "tokenizer": "gemma4", "batch_size": 8,
                              "mesh": {"expert": -1}})
    ClusterConfig(accelerator="v6e", topology="2x4",
                  params={"checkpoint": "GEMMA4_26B_A4B_IT", "batch_size": 8,
                          "mesh": {"expert": -1}})
