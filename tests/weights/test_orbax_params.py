"""Orbax params in both layouts gemma reads: its own nested save and the flat layout Google
publishes its checkpoints in, read straight into the shards the one table gives them."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding

from gemmalab.model import mesh, presets, sharding
from gemmalab.weights import orbax_params, sources

# The MoE's experts over the expert axis, the dense models over fsdp.
MESHES = {"gemma3-tiny": {"data": 2, "fsdp": 4}, "gemma4-tiny": {"data": 2, "fsdp": 4},
          "gemma4-tiny-moe": {"data": 2, "fsdp": 2, "expert": 2}}


def _save_flat(params, path):
    """``params`` as Google's released checkpoints lay them out (gemma's own converter)."""
    from gemma.gm.ckpts import _checkpoint

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, _checkpoint._nested_to_flat(params))
        checkpointer.wait_until_finished()


@pytest.mark.parametrize("layout", ["nested", "flat"])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_a_checkpoint_is_read_whole_into_the_tables_shards(name, layout, tmp_path):
    """Every weight comes back where the model looks for it (the flat reader drops Gemma 4's
    expert and router ``w`` levels unless put back), equal, on its sharding."""
    model = presets.build_model(presets.model_config(name, 64), param_dtype=jnp.float32)
    params = presets.init_params(model, seed=0, sample_length=8)
    path = str(tmp_path / "params")
    if layout == "nested":
        orbax_params.save_params(params, path)
    else:
        _save_flat(params, path)
    device_mesh = mesh.make_mesh(MESHES[name], jax.devices())
    shardings = sharding.param_sharding(params, device_mesh)
    target = jax.tree.map(lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                                   sharding=where),
                          params, shardings)

    loaded = sources.load(sources.resolve(path, name, tmp_path), target)

    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for (keypath, want), got, where in zip(jax.tree_util.tree_leaves_with_path(params),
                                           jax.tree.leaves(loaded), jax.tree.leaves(shardings),
                                           strict=True):
        assert isinstance(got.sharding, NamedSharding), keypath
        assert got.sharding.spec == where.spec, keypath
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(keypath))
    if name == "gemma4-tiny-moe":  # the experts really are split over the expert axis
        experts = loaded["layer_0"]["mlp"]["gating_einsum"]["w"]
        assert experts.sharding.spec[0] == "expert"
        assert experts.addressable_shards[0].data.shape[0] == experts.shape[0] // 2
