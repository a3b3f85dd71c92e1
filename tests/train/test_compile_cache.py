"""JAX's persistent compilation cache in the run's cache_dir."""

import jax
import jax.numpy as jnp
import pytest
from jax._src import compilation_cache as jax_cache

from gemmalab.train import compile_cache


@pytest.fixture
def no_configured_cache():
    saved = {name: getattr(jax.config, name) for name in (
        "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def test_compiles_land_in_cache_dir_and_are_read_back(tmp_path, no_configured_cache):
    jnp.sin(jnp.ones(3)).block_until_ready()  # a compile before: JAX has decided "no cache"
    path = compile_cache.enable(tmp_path / "jax-compile")
    assert path.startswith(str(tmp_path / "jax-compile"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

    def f(x):
        return jnp.tanh(x @ x.T).sum() * 3.0

    jax.jit(f).lower(jnp.ones((7, 5))).compile()
    written = list((tmp_path / "jax-compile").rglob("*"))
    assert any(p.is_file() for p in written), "nothing was written to the cache"


def test_a_configured_cache_is_kept(tmp_path, no_configured_cache):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert compile_cache.enable(tmp_path / "other") == str(tmp_path / "mine")
    assert not (tmp_path / "other").exists()


def test_the_host_key_is_stable_and_names_the_machine():
    assert compile_cache.host_key() == compile_cache.host_key()
    assert "-" in compile_cache.host_key()


def test_the_suites_cache_is_kept_per_machine_kind_and_trimmed_oldest_first(tmp_path,
                                                                            monkeypatch):
    import os

    from tests.helpers import compile_cache as suite_cache

    monkeypatch.setenv("GEMMALAB_TEST_COMPILE_CACHE", str(tmp_path))
    folder = suite_cache.suite_compile_cache()
    assert folder == tmp_path / compile_cache.host_key()
    for age, name in enumerate(("newest", "middle", "oldest")):
        (folder / name).write_bytes(b"x" * 100)
        os.utime(folder / name, (1e9 - age, 1e9 - age))
    assert suite_cache.trim(folder, 250) == [folder / "oldest"]
    assert sorted(p.name for p in folder.iterdir()) == ["middle", "newest"]
    assert suite_cache.trim(folder, 200) == []
