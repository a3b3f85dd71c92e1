"""The host's measured matmul rate (a CPU run's ``cpu_mfu`` peak): measured once, then cached
under a key of what moves it."""

import json

import pytest

from gemmalab.accelerators import Accelerator
from gemmalab.train import host_peak

SIZE = 64  # tiny: the figure's plumbing, not its value
REAL_HOST_LOAD = host_peak.host_load
REAL_BUSY_ELSEWHERE = host_peak.busy_elsewhere


def never_measured(*args, **kwargs):
    raise AssertionError("measured again instead of reading the cache")


def counting(calls: list):
    def fake(dtype, size):
        calls.append((str(dtype), size))
        return 1e9
    return fake


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch):
    """The caching tests must not depend on what else loads this machine's cores."""
    monkeypatch.setattr(host_peak, "host_load", lambda: 0.0)
    monkeypatch.setattr(host_peak, "busy_elsewhere", lambda since, seconds: 0.0)


def test_a_figure_measured_on_a_busy_host_is_used_but_not_kept(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(host_peak, "measure", counting(calls))
    monkeypatch.setattr(host_peak, "host_load", lambda: 1.5)
    assert host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE) == 1e9
    assert not (tmp_path / "host_peak").exists()
    monkeypatch.setattr(host_peak, "host_load", lambda: 0.1)  # quiet again: measured and kept
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)
    assert len(calls) == 2 and len(list((tmp_path / "host_peak").iterdir())) == 1


def test_a_figure_measured_while_other_processes_ran_is_used_but_not_kept(tmp_path, monkeypatch):
    """The load average lags a minute: work that started just before is seen by what the CPUs
    did during the measurement."""
    calls = []
    monkeypatch.setattr(host_peak, "measure", counting(calls))
    monkeypatch.setattr(host_peak, "busy_elsewhere", lambda since, seconds: 0.45)
    assert host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE) == 1e9
    assert not (tmp_path / "host_peak").exists()
    monkeypatch.setattr(host_peak, "busy_elsewhere", lambda since, seconds: 0.02)
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)
    (path,) = (tmp_path / "host_peak").iterdir()
    assert json.loads(path.read_text())["busy_elsewhere"] == 0.02


def test_cpu_seconds_see_this_process_in_the_hosts_busy_time():
    """This process spins until it has run 0.2 CPU-seconds (however loaded the host): the host's
    busy seconds grow by at least as much (they include it), so ``busy_elsewhere`` can subtract
    it."""
    import time

    since, started = host_peak.cpu_seconds(), time.perf_counter()
    if since is None:
        pytest.skip("no /proc/stat")
    while host_peak.cpu_seconds()[1] - since[1] < 0.2:
        assert time.perf_counter() - started < 30, "this process got no CPU time"
    now = host_peak.cpu_seconds()
    own, host = now[1] - since[1], now[0] - since[0]
    assert host >= own - 0.05, (host, own)  # clock ticks: 10 ms each
    assert REAL_BUSY_ELSEWHERE(None, 1.0) == 0.0


def test_the_host_load_is_a_load_average_per_cpu():
    load = REAL_HOST_LOAD()
    assert isinstance(load, float) and 0 <= load < 1000


def test_a_measured_rate_is_positive_and_read_back_from_the_cache(tmp_path, monkeypatch):
    rate = host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)
    assert rate > 0
    (path,) = (tmp_path / "host_peak").iterdir()
    record = json.loads(path.read_text())
    assert record["flops_per_s"] == rate
    assert record["key"] == host_peak.host_key("bfloat16", SIZE)
    assert record["key"]["dtype"] == "bfloat16" and record["key"]["size"] == SIZE
    assert record["key"]["cpu_count"] >= record["key"]["usable_cpus"] >= 1
    assert record["measured_at"]
    monkeypatch.setattr(host_peak, "measure", never_measured)
    assert host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE) == rate


def test_another_dtype_size_or_xla_flags_is_measured_anew(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(host_peak, "measure", counting(calls))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)
    host_peak.matmul_flops_per_s("float32", tmp_path, size=SIZE)
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=2 * SIZE)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                       "--xla_cpu_max_isa=SSE4_2")
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)
    assert calls == [("bfloat16", SIZE), ("float32", SIZE), ("bfloat16", 2 * SIZE),
                     ("bfloat16", SIZE)]
    assert len(list((tmp_path / "host_peak").iterdir())) == 4
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    host_peak.matmul_flops_per_s("bfloat16", tmp_path, size=SIZE)  # the first key again
    assert len(calls) == 4


def test_a_damaged_or_foreign_cache_file_is_measured_again(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(host_peak, "measure", counting(calls))
    host_peak.matmul_flops_per_s("float32", tmp_path, size=SIZE)
    (path,) = (tmp_path / "host_peak").iterdir()
    record = json.loads(path.read_text())
    path.write_text("{not json")
    host_peak.matmul_flops_per_s("float32", tmp_path, size=SIZE)
    path.write_text(json.dumps({**record, "key": {**record["key"], "cpu": "another"}}))
    host_peak.matmul_flops_per_s("float32", tmp_path, size=SIZE)
    assert len(calls) == 3
    assert json.loads(path.read_text())["key"] == record["key"]  # rewritten


def test_only_single_process_cpu_runs_measure(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(host_peak, "measure", counting(calls))
    h200 = Accelerator("h200", 8, 141 << 30, 989e12)
    assert host_peak.of_run(h200, "bfloat16", tmp_path) is None
    # A GPU without a row in CHIPS (an A100: kind "gpu", as attached_accelerator names it).
    other_gpu = Accelerator("gpu", 1, 40 << 30, None)
    assert other_gpu.platform == "gpu"
    assert host_peak.of_run(other_gpu, "bfloat16", tmp_path) is None
    assert calls == []
    # Eight (simulated) CPU devices share the host's cores: the host's rate, not 8 times it.
    cpus = Accelerator("cpu", 8, 1 << 30, None)
    assert host_peak.of_run(cpus, "bfloat16", tmp_path) == 1e9
    assert calls == [("bfloat16", host_peak.SIZE)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_measurement_times_a_real_matmul(dtype):
    assert host_peak.measure(dtype, SIZE, repeats=2) > 0
