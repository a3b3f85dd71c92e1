"""gemmalab.allocator: which malloc a training process runs on, and the environment for it."""

import subprocess
import sys
from pathlib import Path

import pytest

from gemmalab import allocator
from gemmalab.errors import ConfigError

on_linux = pytest.mark.skipif(sys.platform != "linux", reason="mimalloc is preloaded on Linux")


@on_linux
def test_the_locked_wheel_provides_the_library():
    path = allocator.library_path()
    assert path is not None and path.is_file() and path.name.startswith("libmimalloc.so")


@on_linux
def test_a_library_that_cannot_be_preloaded_is_not_chosen(tmp_path):
    # The image's failure before libatomic1 was added: the preload fails, so the process would
    # run on glibc's malloc (or not start) while its environment names mimalloc.
    not_elf = tmp_path / "libmimalloc.so.3"
    not_elf.write_text("not a shared library\n")
    assert allocator.preloads(allocator.library_path())
    assert not allocator.preloads(not_elf)
    assert not allocator.preloads(tmp_path / "missing.so")


def fake_sysfs(root: Path, *, order: int | None = 9, balloon_features: str | None = "0110010",
               bound: bool = True) -> Path:
    """A /sys with free page reporting at ``order`` and a virtio balloon negotiating
    ``balloon_features`` (bit 5: free page reporting), beside a virtio disk; None: absent."""
    if order is not None:
        parameters = root / "module/page_reporting/parameters"
        parameters.mkdir(parents=True)
        (parameters / "page_reporting_order").write_text(f"{order}\n")
    devices = root / "bus/virtio/devices"
    for name, device, features in (("virtio0", "0x0002", "1" * 40),
                                   ("virtio1", "0x0005", balloon_features)):
        if features is None:
            continue
        (devices / name).mkdir(parents=True)
        (devices / name / "device").write_text(f"{device}\n")
        (devices / name / "features").write_text(features + "0" * 57 + "\n")
        if bound:
            (devices / name / "driver").mkdir()
    return root


def test_a_balloon_reporting_free_pages_is_a_hypervisor_taking_them(tmp_path):
    assert allocator.hypervisor_takes_freed_pages(fake_sysfs(tmp_path / "firecracker"))
    # Reporting off (an order no free list reaches), a balloon without the feature, none
    # bound, no balloon, no page reporting in the kernel, no /sys at all: an ordinary host.
    for name, settings in {"order": dict(order=allocator.MAX_PAGE_ORDER + 1),
                           "feature": dict(balloon_features="0110000"),
                           "unbound": dict(bound=False), "no-balloon": dict(balloon_features=None),
                           "no-reporting": dict(order=None)}.items():
        assert not allocator.hypervisor_takes_freed_pages(fake_sysfs(tmp_path / name,
                                                                     **settings)), name
    assert not allocator.hypervisor_takes_freed_pages(tmp_path / "nothing")


def test_auto_chooses_by_the_host_and_gemmalab_malloc_overrides(monkeypatch):
    monkeypatch.setattr(allocator, "hypervisor_takes_freed_pages", lambda: True)
    assert allocator.wants_mimalloc({}) and allocator.wants_mimalloc({allocator.CHOICE: "auto"})
    assert not allocator.wants_mimalloc({allocator.CHOICE: "system"})
    monkeypatch.setattr(allocator, "hypervisor_takes_freed_pages", lambda: False)
    assert not allocator.wants_mimalloc({})
    assert allocator.wants_mimalloc({allocator.CHOICE: "mimalloc"})
    with pytest.raises(ConfigError, match="GEMMALAB_MALLOC: unknown malloc 'jemalloc'"):
        allocator.wants_mimalloc({allocator.CHOICE: "jemalloc"})
    # On an ordinary host the default leaves glibc's malloc, with huge pages.
    assert allocator.environment({}) == {"GLIBC_TUNABLES": allocator.HUGE_PAGES}


@on_linux
def test_environment_preloads_mimalloc_with_its_options_and_keeps_what_is_set():
    library = str(allocator.library_path())
    chosen = {allocator.CHOICE: "mimalloc"}
    assert allocator.environment(chosen) == {"GLIBC_TUNABLES": allocator.HUGE_PAGES,
                                             "LD_PRELOAD": library, **allocator.OPTIONS}
    # Another preloaded library stays, after mimalloc; the user's own values win.
    mine = {**chosen, "LD_PRELOAD": "/opt/libother.so", "MIMALLOC_PURGE_DELAY": "0",
            "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert allocator.environment(mine) == {"LD_PRELOAD": f"{library}:/opt/libother.so",
                                           "MIMALLOC_ALLOW_LARGE_OS_PAGES": "1",
                                           "MIMALLOC_ARENA_RESERVE": "16GiB"}
    assert allocator.environment({**chosen, "LD_PRELOAD": library}) == {
        "GLIBC_TUNABLES": allocator.HUGE_PAGES, **allocator.OPTIONS}


def test_without_allocator_drops_what_it_sets_and_keeps_the_rest():
    mine = {"LD_PRELOAD": "/x.so", "MIMALLOC_PURGE_DELAY": "0", allocator.CHOICE: "system",
            "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/home/me"}
    assert allocator.without_allocator(mine) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
                                                 "HOME": "/home/me"}


def test_system_leaves_glibc_with_huge_pages():
    assert allocator.environment({allocator.CHOICE: "system"}) == {
        "GLIBC_TUNABLES": allocator.HUGE_PAGES}


@on_linux
def test_a_process_started_with_it_runs_jax_on_mimalloc():
    """The shell form (``python -m gemmalab.allocator``) gives the same variables, its command
    form runs a command with them, and a process so started maps mimalloc and computes as it
    does without."""
    chosen = {allocator.CHOICE: "mimalloc"}
    printed = subprocess.run([sys.executable, "-m", "gemmalab.allocator"], check=True,
                             capture_output=True, text=True, env=chosen).stdout
    variables = dict(line.split("=", 1) for line in printed.splitlines())
    assert variables == allocator.environment(chosen)
    program = ("import jax.numpy as jnp\n"
               "x = jnp.arange(1 << 20, dtype=jnp.float32)\n"
               "print('libmimalloc' in open('/proc/self/maps').read(), float(jnp.sum(x * x)))")
    results = [subprocess.run(command, check=True, capture_output=True, text=True,
                              env=env).stdout.split()
               for command, env in (([sys.executable, "-c", program], variables),
                                    ([sys.executable, "-m", "gemmalab.allocator",
                                      sys.executable, "-c", program], chosen),
                                    ([sys.executable, "-c", program], {}))]
    assert [mapped for mapped, _ in results] == ["True", "True", "False"]
    assert results[0][1] == results[1][1] == results[2][1]


def test_a_bad_choice_is_one_line_before_anything_runs():
    done = subprocess.run([sys.executable, "-m", "gemmalab.allocator", "true"],
                          capture_output=True, text=True, env={allocator.CHOICE: "tcmalloc"})
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip() == ("GEMMALAB_MALLOC: unknown malloc 'tcmalloc'. Fix: set it to "
                                   "one of ('auto', 'mimalloc', 'system')")


def test_the_cpu_image_runs_its_command_through_the_allocator_choice():
    """The Dockerfile's CPU stage chooses on the host it runs on: its command goes through
    ``python -m gemmalab.allocator``, and no malloc is pinned in its environment."""
    text = Path(__file__).resolve().parent.parent.joinpath("Dockerfile").read_text()
    cpu = text[text.index("FROM runtime AS cpu"):text.index("FROM runtime AS gpu")]
    assert 'ENTRYPOINT ["python", "-m", "gemmalab.allocator"]' in cpu
    assert "LD_PRELOAD" not in cpu and "MIMALLOC_" not in cpu
