"""The held weights' digest: exact, and the same under any mesh."""

import jax
import jax.numpy as jnp
import numpy as np

from gemmalab.model import mesh, presets, sharding
from gemmalab.train import params


def test_the_digest_is_the_same_on_any_mesh_and_sees_one_bit():
    config = presets.model_config("gemma3-tiny", 256)
    model = presets.build_model(config, param_dtype=jnp.bfloat16)
    tree = presets.init_params(model, seed=0, sample_length=8)
    digests = set()
    for axes in ({"data": -1}, {"fsdp": -1}, {"data": 2, "fsdp": 4}):
        device_mesh = mesh.make_mesh(axes)
        placed = jax.device_put(tree, sharding.param_sharding(tree, device_mesh))
        digests.add(params.weights_digest(placed))
    assert len(digests) == 1
    # One weight one ulp up, or two weights swapped: another digest.
    leaves, structure = jax.tree.flatten(tree)
    first = np.asarray(leaves[0]).copy()
    first.reshape(-1).view(np.uint16)[7] += 1  # the bfloat16 next up (or down, if negative)
    bumped = jax.tree.unflatten(structure, [jnp.asarray(first), *leaves[1:]])
    swapped_values = np.asarray(leaves[0]).copy().reshape(-1)
    swapped_values[[0, 1]] = swapped_values[[1, 0]]
    assert swapped_values[0] != swapped_values[1]
    swapped = jax.tree.unflatten(structure, [jnp.asarray(swapped_values.reshape(first.shape)),
                                             *leaves[1:]])
    others = {params.weights_digest(bumped), params.weights_digest(swapped)}
    assert len(others) == 2 and not others & digests
