"""The held weights' digest: exact, and the same under any mesh."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

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


def test_the_digest_is_its_documented_formula_in_any_block_size(monkeypatch):
    """Each leaf's sums are ``sum(bits[i] * (i * m + c))`` in wrapping uint32, whatever the
    host's block size (so the digests earlier runs recorded stay valid)."""
    rng = np.random.default_rng(0)
    tree = {"matrix": jnp.asarray(rng.normal(size=(40, 24)), jnp.bfloat16),
            "vector": jnp.asarray(rng.normal(size=(50,)), jnp.float32), "scalar": jnp.float32(2.5)}
    device_mesh = mesh.make_mesh({"fsdp": 4, "tensor": 2})
    placed = {"matrix": jax.device_put(tree["matrix"],
                                       NamedSharding(device_mesh, PartitionSpec("fsdp", "tensor"))),
              "vector": jax.device_put(tree["vector"], NamedSharding(device_mesh, PartitionSpec())),
              "scalar": tree["scalar"]}

    def formula(leaf: jax.Array) -> bytes:
        values = np.asarray(leaf).reshape(-1)
        bits = values.view({2: np.uint16, 4: np.uint32}[values.itemsize]).astype(np.uint64)
        index = np.arange(bits.size, dtype=np.uint64)
        return np.array([int(np.sum(bits * ((index * m + c) % 2**32))) % 2**32
                         for m, c in params.DIGEST_MULTIPLIERS], np.uint32).tobytes()

    expected = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        expected.update(f"{jax.tree_util.keystr(path)}:{leaf.dtype}:{leaf.shape}:".encode())
        expected.update(formula(leaf))
    for block in (1 << 22, 5, 1):
        monkeypatch.setattr(params, "DIGEST_BLOCK", block)
        assert params.weights_digest(placed) == expected.hexdigest()[:16]
