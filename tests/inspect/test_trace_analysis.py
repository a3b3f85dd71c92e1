"""Reading a real JAX profiler trace back offline: op table, step breakdown, UI command."""

import os
import re
import time
from pathlib import Path

import pytest

from gemmalab.errors import ConfigError
from gemmalab.inspect import trace_analysis as ta

STEPS = 3
SLEEP_MS = 30.0  # the deliberate "data wait" at the start of every step
XLA_OP = re.compile(r"dot|fusion|all-reduce|reduce|convolution|copy")


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """A trace of a data-parallel MLP training step on the 8 virtual CPU devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((len(jax.devices()),), ("data",))

    def loss(params, x, y):
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] - y) ** 2)

    @jax.jit
    def train_step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), value

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.device_put({"w1": jax.random.normal(k1, (64, 256)) * 0.1,
                             "b1": jnp.zeros(256),
                             "w2": jax.random.normal(k2, (256, 16)) * 0.1}, replicated)
    x = jax.device_put(jax.random.normal(k3, (512, 64)), batch)
    y = jax.device_put(jnp.zeros((512, 16)), batch)
    params, value = train_step(params, x, y)  # compile outside the trace
    value.block_until_ready()

    directory = tmp_path_factory.mktemp("trace")
    jax.profiler.start_trace(str(directory))
    try:
        for step in range(STEPS):
            with jax.profiler.StepTraceAnnotation("train", step_num=step):
                time.sleep(SLEEP_MS / 1e3)
                params, value = train_step(params, x, y)
                value.block_until_ready()
    finally:
        jax.profiler.stop_trace()
    return directory


@pytest.fixture(scope="module")
def xplane(logdir) -> Path:
    return ta.find_xplane(logdir)


def test_find_xplane_finds_the_capture(logdir, xplane):
    assert xplane.name.endswith(".xplane.pb")
    assert xplane.parent.parent == logdir / "plugins" / "profile"


def test_find_xplane_picks_the_newest_run(tmp_path):
    runs = tmp_path / "plugins" / "profile"
    old, new = runs / "2026_01_01_00_00_00" / "h.xplane.pb", runs / "run_b" / "h.xplane.pb"
    for i, path in enumerate((new, old)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
        os.utime(path, (1_000_000 * (2 - i), 1_000_000 * (2 - i)))
    assert ta.find_xplane(tmp_path) == new


def test_find_xplane_on_an_empty_dir_names_profile_dir(tmp_path):
    with pytest.raises(ConfigError) as error:
        ta.find_xplane(tmp_path)
    assert error.value.parameter == "profile_dir"
    assert "profile_dir" in str(error.value)


def test_op_stats_lists_the_xla_ops(xplane):
    table = ta.op_stats(xplane, top=5)
    assert list(table.columns) == list(ta.OP_COLUMNS)
    assert 0 < len(table) <= 5
    assert table["share"].between(0, 1).all() and table["share"].sum() <= 1 + 1e-9
    assert table["self_time_us"].is_monotonic_decreasing
    assert (table["occurrences"] >= STEPS).all()
    assert XLA_OP.search(table["operation"].iloc[0]), table
    assert set(table["host_or_device"]) == {"Device"}
    # CPU: xprof's framework_op_stats has only IDLE, so the raw XLA:CPU op events are used
    assert table.attrs["source"].startswith("raw trace events")
    everything = ta.op_stats(xplane, top=1000)
    assert everything["share"].sum() == pytest.approx(1.0)
    assert everything["operation"].str.contains("dot").any()


def test_op_stats_accepts_the_logdir_and_checks_top(logdir, xplane):
    assert len(ta.op_stats(logdir, top=2)) == 2
    with pytest.raises(ConfigError, match="top"):
        ta.op_stats(xplane, top=0)


def test_step_breakdown_shows_the_host_gap(xplane):
    steps = ta.step_breakdown(xplane)
    assert list(steps.columns) == list(ta.STEP_COLUMNS)
    assert steps["step"].tolist() == list(range(STEPS))
    assert set(steps["name"]) == {"train"}
    assert (steps["host_wait_ms"] >= SLEEP_MS).all(), steps
    assert (steps["device_compute_ms"] > 0).all(), steps
    parts = steps[["device_compute_ms", "host_dispatch_ms", "host_wait_ms"]].sum(axis=1)
    assert parts.to_numpy() == pytest.approx(steps["step_time_ms"].to_numpy())
    assert steps["start_ms"].is_monotonic_increasing and steps["start_ms"].iloc[0] == 0
    assert steps.attrs["device"] == "cpu"
    with pytest.raises(ConfigError, match="StepTraceAnnotation"):
        ta.step_breakdown(xplane, step_name="eval")


def test_xprof_step_table_agrees_on_step_time(xplane):
    ours = ta.step_breakdown(xplane)
    theirs = ta.xprof_step_table(xplane)
    assert theirs["name"].tolist() == [f"train {i}" for i in range(STEPS)]
    assert {"step_time_ms", "device_compute_ms", "host_compute_ms"} <= set(theirs.columns)
    assert theirs["step_time_ms"].to_numpy() == pytest.approx(
        ours["step_time_ms"].to_numpy(), abs=1e-3)
    assert theirs.attrs["properties"]["hardware_type"] == "CPU_ONLY"


def test_op_stats_uses_xprof_device_ops_when_there_are_some(xplane, monkeypatch):
    import pandas as pd

    columns = ["rank", "host_or_device", "type", "operation", "occurrences", "total_time",
               "avg_time", "total_self_time", "avg_self_time"]
    rows = [[1, "Device", "dot_general", "jit(step)/dot_general", 10, 900.0, 90.0, 600.0, 60.0],
            [2, "Device", "tanh", "jit(step)/tanh", 10, 200.0, 20.0, 200.0, 20.0],
            [3, "Host", "PjitFunction", "step", 10, 500.0, 50.0, 300.0, 30.0],
            [4, "Device", "IDLE", "IDLE", 0, 0.0, 0.0, 0.0, 0.0]]
    table = pd.DataFrame(rows, columns=columns)
    monkeypatch.setattr(ta, "xprof_tables", lambda *a, **k: [table, table])

    device = ta.op_stats(xplane)
    assert device["operation"].tolist() == ["jit(step)/dot_general", "jit(step)/tanh"]
    assert device["share"].tolist() == pytest.approx([0.75, 0.25])
    assert device.attrs["source"] == "xprof framework_op_stats"
    both = ta.op_stats(xplane, include_host=True)
    assert both["host_or_device"].tolist() == ["Device", "Host", "Device"]
    assert both.groupby("host_or_device")["share"].sum().to_dict() == pytest.approx(
        {"Device": 1.0, "Host": 1.0})


def test_step_breakdown_on_an_accelerator_trace(tmp_path):
    """A synthetic GPU-style XSpace: device time comes from the device plane."""
    from jax.profiler import ProfileData

    ms = 1_000_000_000  # picoseconds
    text = f"""
    planes {{ id: 1 name: "/host:CPU"
      lines {{ id: 1 name: "python" timestamp_ns: 5000
        events {{ metadata_id: 1 offset_ps: 0 duration_ps: {10 * ms}
                  stats {{ metadata_id: 1 int64_value: 7 }} }}
        events {{ metadata_id: 2 offset_ps: {1 * ms} duration_ps: {1 * ms} }}
      }}
      event_metadata {{ key: 1 value {{ id: 1 name: "train" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "PjitFunction(step)" }} }}
      stat_metadata {{ key: 1 value {{ id: 1 name: "step_num" }} }}
    }}
    planes {{ id: 2 name: "/device:GPU:0"
      lines {{ id: 1 name: "Stream #7(Compute)" timestamp_ns: 5000
        events {{ metadata_id: 1 offset_ps: {2 * ms} duration_ps: {3 * ms}
                  stats {{ metadata_id: 1 str_value: "dot.1" }} }}
        events {{ metadata_id: 2 offset_ps: {5 * ms} duration_ps: {1 * ms}
                  stats {{ metadata_id: 1 str_value: "loop_fusion" }} }}
      }}
      event_metadata {{ key: 1 value {{ id: 1 name: "sm90_gemm_kernel" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "loop_fusion_kernel" }} }}
      stat_metadata {{ key: 1 value {{ id: 1 name: "hlo_op" }} }}
    }}
    """
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    (run / "gpu-host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(text))

    steps = ta.step_breakdown(tmp_path)
    assert steps.attrs["device"] == "accelerator"
    row = steps.iloc[0]
    assert row["step"] == 7 and row["step_time_ms"] == pytest.approx(10)
    assert row["device_compute_ms"] == pytest.approx(4)
    assert row["host_dispatch_ms"] == pytest.approx(1)
    assert row["host_wait_ms"] == pytest.approx(5)
    assert row["device_share"] == pytest.approx(0.4)


def test_plot_op_stats_draws_one_bar_per_op(xplane):
    from matplotlib.figure import Figure

    table = ta.op_stats(xplane, top=4)
    figure = ta.plot_op_stats(table)
    assert isinstance(figure, Figure)
    (axis,) = figure.axes
    assert len(axis.patches) == len(table)
    assert axis.get_yticklabels()[0].get_text() == table["operation"].iloc[0]


def test_xprof_command_names_logdir_and_port(logdir):
    command = ta.xprof_command(logdir)
    assert command.startswith("xprof ")
    assert f"--logdir {Path(logdir).resolve()}" in command and "--port 9001" in command
    assert "--port 8123" in ta.xprof_command(str(logdir), port=8123)
    assert ta.xprof_command("gs://bucket/run").startswith("xprof --logdir gs://bucket/run")
    with pytest.raises(ConfigError, match="port"):
        ta.xprof_command(logdir, port=0)


@pytest.fixture(scope="module")
def scoped_trace(tmp_path_factory) -> tuple[Path, str]:
    """A trace of a step whose ops sit under the loss's and the optimizer's named scopes, with
    its compiled HLO: a large logits matmul, a small model matmul, an update."""
    import jax
    import jax.numpy as jnp

    from gemmalab.model.cross_entropy import LOSS_SCOPE, token_nll
    from gemmalab.train.optimization import OPTIMIZER_SCOPE

    def step(w, embedding, x, targets):
        def loss(w):
            hidden = jnp.tanh(x @ w)
            with jax.named_scope(LOSS_SCOPE):
                return jnp.sum(token_nll(hidden @ embedding.T, targets))
        value, grad = jax.value_and_grad(loss)(w)
        with jax.named_scope(OPTIMIZER_SCOPE):
            return w - 0.1 * grad, value

    keys = jax.random.split(jax.random.key(0), 3)
    w = jax.random.normal(keys[0], (64, 64)) * 0.1
    embedding = jax.random.normal(keys[1], (4096, 64))
    x = jax.random.normal(keys[2], (256, 64))
    targets = jnp.arange(256) % 4096
    compiled = jax.jit(step).lower(w, embedding, x, targets).compile()
    jax.block_until_ready(compiled(w, embedding, x, targets))
    directory = tmp_path_factory.mktemp("scoped")
    jax.profiler.start_trace(str(directory))
    try:
        for step_num in range(STEPS):
            with jax.profiler.StepTraceAnnotation("train", step_num=step_num):
                w, value = compiled(w, embedding, x, targets)
                value.block_until_ready()
    finally:
        jax.profiler.stop_trace()
    return ta.find_xplane(directory), compiled.as_text()


def test_time_by_part_places_each_op_by_its_scope_and_dot(scoped_trace):
    xplane, hlo = scoped_trace
    parts = ta.time_by_part(xplane, hlo, steps=STEPS)
    assert tuple(parts.columns) == ta.PART_COLUMNS
    by_part = dict(zip(parts["part"], parts["ms_per_step"], strict=True))
    for part in ("loss: logits matmuls", "loss: softmax, casts, rest", "optimizer",
                 "model matmuls (projections, MLP)"):
        assert by_part.get(part, 0) > 0, (part, by_part)
    # The logits matmuls (256 x 64 x 4096, forward and backward) outweigh the model's 64 x 64.
    assert by_part["loss: logits matmuls"] > by_part["model matmuls (projections, MLP)"]
    assert parts["share"].sum() == pytest.approx(1.0)
    # Every traced op is counted once: the parts add up to the op table's total.
    everything = ta.op_stats(xplane, top=1_000_000)
    assert parts["ms_per_step"].sum() * STEPS * 1e3 == pytest.approx(
        everything["self_time_us"].sum(), rel=1e-9)
    assert parts["operations"].sum() == len(everything)


def test_time_by_part_names_a_missing_hlo_and_steps(scoped_trace):
    xplane, hlo = scoped_trace
    with pytest.raises(ConfigError, match="hlo_text"):
        ta.time_by_part(xplane, "not hlo", steps=STEPS)
    with pytest.raises(ConfigError, match="steps"):
        ta.time_by_part(xplane, hlo, steps=0)
    # Ops of another program than the one given are set apart, not misplaced.
    other = ta.time_by_part(xplane, "HloModule other\nENTRY main {\n}\n", steps=STEPS)
    assert list(other["part"]) == ["other programs"]


def test_hlo_instructions_read_tuple_shapes_and_name_collectives():
    dot_meta = 'metadata={op_name="jit(step)/cross_entropy/dot_general"}'
    reduce_meta = 'metadata={op_name="jit(step)/optimizer/add"}'
    hlo = "\n".join([
        "HloModule step",
        "fused_computation.1 {",
        "  p0 = f32[4,8]{1,0} parameter(0)",
        f"  ROOT dot.3 = f32[4,4]{{1,0}} dot(p0, p0), lhs_contracting_dims={{1}}, {dot_meta}",
        "}",
        "ENTRY main {",
        "  p = f32[4,8]{1,0} parameter(0)",
        "  fusion.1 = f32[4,4]{1,0} fusion(p), kind=kOutput, calls=fused_computation.1",
        f"  ROOT all-reduce.71 = (f32[4,4]{{1,0}}, f32[]) all-reduce(fusion.1, p), {reduce_meta}",
        "}"])
    found = ta._hlo_instructions(hlo)
    assert found["fusion.1"] == ("jit(step)/cross_entropy/dot_general", "dot")
    assert found["all-reduce.71"] == ("jit(step)/optimizer/add", "collective")
    assert ta._part_of(*found["fusion.1"]) == "loss: logits matmuls"
    assert ta._part_of(*found["all-reduce.71"]).startswith("collectives")
