"""Where ``profiling.capture`` puts its trace: the run's TensorBoard directory unless told."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from gemmalab.inspect import profiling
from gemmalab.inspect import trace_analysis as ta


def a_run(output_dir):
    """The few things ``capture`` uses of an ``Experiment``, around a trivial jitted step."""

    @jax.jit
    def train_step(state, batch, held):
        state = state + jnp.sum(batch)
        return state, {"loss": state}

    return SimpleNamespace(config=SimpleNamespace(runtime=SimpleNamespace(
                               output_dir=str(output_dir))),
                           weights=SimpleNamespace(state=jnp.zeros(()), frozen=None),
                           compile=lambda: train_step, next_batch=lambda: jnp.ones(4))


def test_a_capture_goes_beside_the_runs_tensorboard_curves_unless_told(tmp_path):
    run = a_run(tmp_path / "run")
    capture = profiling.capture(run, warmup_steps=1, profile_steps=2)
    assert capture.logdir == f"{tmp_path}/run/tensorboard"
    xplane = ta.find_xplane(capture.logdir)
    assert xplane.parent.parent == tmp_path / "run" / "tensorboard" / "plugins" / "profile"
    assert [s["loss"] for s in capture.steps] == [8.0, 12.0]  # after 1 warm-up step of 4
    elsewhere = profiling.capture(run, logdir=str(tmp_path / "traces"), warmup_steps=1,
                                  profile_steps=1)
    assert elsewhere.logdir == str(tmp_path / "traces")
    assert ta.find_xplane(tmp_path / "traces").name.endswith(".xplane.pb")
