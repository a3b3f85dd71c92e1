"""gemmalab.allocator: the environment that puts a training process on mimalloc."""

import subprocess
import sys

import pytest

from gemmalab import allocator

on_linux = pytest.mark.skipif(sys.platform != "linux", reason="mimalloc is preloaded on Linux")


@on_linux
def test_the_locked_wheel_provides_the_library():
    path = allocator.library_path()
    assert path is not None and path.is_file() and path.name.startswith("libmimalloc.so")


@on_linux
def test_environment_preloads_mimalloc_with_its_options_and_keeps_what_is_set():
    library = str(allocator.library_path())
    assert allocator.environment({}) == {"GLIBC_TUNABLES": allocator.HUGE_PAGES,
                                         "LD_PRELOAD": library, **allocator.OPTIONS}
    # Another preloaded library stays, after mimalloc; the user's own values win.
    mine = {"LD_PRELOAD": "/opt/libother.so", "MIMALLOC_PURGE_DELAY": "0",
            "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert allocator.environment(mine) == {"LD_PRELOAD": f"{library}:/opt/libother.so",
                                           "MIMALLOC_ALLOW_LARGE_OS_PAGES": "1"}
    assert allocator.environment({"LD_PRELOAD": library}) == {
        "GLIBC_TUNABLES": allocator.HUGE_PAGES, **allocator.OPTIONS}


def test_without_allocator_drops_what_it_sets_and_keeps_the_rest():
    mine = {"LD_PRELOAD": "/x.so", "MIMALLOC_PURGE_DELAY": "0", allocator.OPT_OUT: "system",
            "GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/home/me"}
    assert allocator.without_allocator(mine) == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
                                                 "HOME": "/home/me"}


def test_opting_out_leaves_glibc_with_huge_pages():
    assert allocator.environment({allocator.OPT_OUT: "system"}) == {
        "GLIBC_TUNABLES": allocator.HUGE_PAGES}


@on_linux
def test_a_process_started_with_it_runs_jax_on_mimalloc():
    """The shell form (``python -m gemmalab.allocator``) gives the same variables, and a
    process started with them maps mimalloc and computes as it does without."""
    printed = subprocess.run([sys.executable, "-m", "gemmalab.allocator"], check=True,
                             capture_output=True, text=True, env={}).stdout
    variables = dict(line.split("=", 1) for line in printed.splitlines())
    assert variables == allocator.environment({})
    program = ("import jax.numpy as jnp\n"
               "x = jnp.arange(1 << 20, dtype=jnp.float32)\n"
               "print('libmimalloc' in open('/proc/self/maps').read(), float(jnp.sum(x * x)))")
    results = [subprocess.run([sys.executable, "-c", program], check=True, capture_output=True,
                              text=True, env=env).stdout.split()
               for env in (variables, {})]
    assert [mapped for mapped, _ in results] == ["True", "False"]
    assert results[0][1] == results[1][1]


def test_the_cpu_image_preloads_the_same_library_with_the_same_options():
    """The Dockerfile's CPU stage spells the environment out (its venv at /opt/venv): it must
    name the wheel's library and the options ``gemmalab.allocator`` sets."""
    from pathlib import Path

    text = Path(__file__).resolve().parent.parent.joinpath("Dockerfile").read_text()
    cpu = text[text.index("FROM runtime AS cpu"):text.index("FROM runtime AS gpu")]
    values = dict(part.strip().rstrip("\\").strip().split("=", 1)
                  for part in cpu.split("ENV ", 1)[1].split("\nUSER")[0].splitlines())
    assert values["LD_PRELOAD"] == (
        f"/opt/venv/lib/python3.12/site-packages/{allocator.LIBRARY}")
    assert {k: values[k] for k in allocator.OPTIONS} == allocator.OPTIONS
    assert values["GLIBC_TUNABLES"] == allocator.HUGE_PAGES
