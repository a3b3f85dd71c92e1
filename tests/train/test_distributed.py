import jax
import pytest

from gemmalab.errors import ConfigError
from gemmalab.train import distributed


@pytest.fixture
def calls(monkeypatch):
    recorded = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: recorded.append(kw))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES", "JAX_PLATFORMS"):
        monkeypatch.delenv(name, raising=False)
    return recorded


def test_single_host_does_nothing(calls, monkeypatch):
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost")
    assert distributed.initialize() is False and calls == []


def test_explicit_coordinator(calls, monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "trainer-0.trainer:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    assert distributed.initialize() is True
    assert calls == [{"coordinator_address": "trainer-0.trainer:1234", "num_processes": 4,
                      "process_id": 2}]


@pytest.mark.parametrize(("name", "value"), [("TPU_WORKER_HOSTNAMES", "h0,h1"),
                                             ("MEGASCALE_NUM_SLICES", "2")])
def test_tpu_jobsets_use_jax_cluster_detection(calls, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert distributed.initialize() is True and calls == [{}]


@pytest.mark.parametrize("platforms", ["cuda,cpu", "tpu,cpu", "gpu"])
def test_a_pod_without_its_accelerator_stops_instead_of_training_on_the_cpu(
        calls, monkeypatch, platforms):
    """JAX skips cuda silently where it sees no NVIDIA device; these tests run on the CPU."""
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    requested = platforms.split(",")[0]
    with pytest.raises(ConfigError, match=rf"^JAX_PLATFORMS: asks for {requested} first, but "
                       rf"JAX found no {requested} device and would run on the cpu\. Fix: "):
        distributed.initialize()


@pytest.mark.parametrize("platforms", ["cpu", "", "cpu,cuda"])
def test_a_cpu_run_goes_on(calls, monkeypatch, platforms):
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    assert distributed.initialize() is False


def test_profiler_server_only_when_the_pod_asks(monkeypatch):
    from gemmalab.inspect import profiling

    started = []
    monkeypatch.setattr(profiling, "_server_port", None)
    monkeypatch.setattr(jax.profiler, "start_server", started.append)
    monkeypatch.delenv("GEMMALAB_PROFILER_PORT", raising=False)
    assert profiling.serve_if_requested() is None and started == []
    monkeypatch.setenv("GEMMALAB_PROFILER_PORT", "9002")
    assert profiling.serve_if_requested() == 9002 and started == [9002]
    assert profiling.serve_if_requested() == 9002 and started == [9002]  # once per process
