"""Params as Orbax checkpoints, readable by ``gm.ckpts.load_params`` (and Google's own).
"""

from __future__ import annotations

import os
from typing import Any

from gemmalab import gemma_lib, storage


def absolute_path(path: str) -> str:
    return path if storage.is_gcs(path) else os.path.abspath(path)


def save_params(params: Any, path: str) -> str:
    """Write ``params`` to ``path`` (replacing an earlier save) and wait until it is complete.

    Every JAX process must call this (Orbax coordinates multi-host writes). Waiting matters:
    an asynchronous save left running when the process exits is unloadable.
    """
    import orbax.checkpoint as ocp

    path = absolute_path(path)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path, params, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    return path


def leaf_names(path: str) -> set[str]:
    """The names in the params tree saved at ``path``, read from its metadata (no weight is
    read)."""
    import jax
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        tree = checkpointer.metadata(absolute_path(path))
    tree = getattr(tree, "item_metadata", tree)  # newer orbax wraps the tree
    return {str(getattr(entry, "key", entry)) for keypath, _ in
            jax.tree_util.tree_flatten_with_path(tree)[0] for entry in keypath}


def load_params(path: str, *, text_only: bool = False, target: Any = None) -> Any:
    """Read params written by ``save_params`` or published by Google (``gm.ckpts``).

    ``target``: a tree of ``jax.ShapeDtypeStruct`` with shardings, like the model's params.
    Each process then reads only its devices' shards, straight into place and in the target
    dtype: no process or device holds the whole model. (gemma 4.0.1's own ``sharding=``
    argument fails on its internal tree type; a target works.)
    """
    gm = gemma_lib.gm()

    params = gm.ckpts.load_params(absolute_path(path), text_only=text_only, params=target)
    return params if target is None else _nest_like(params, target)


def _nest_like(params: Any, target: Any) -> Any:
    """``params`` with the ``{'w': ...}`` levels ``target`` has and they lost.

    gemma's reader of the flat layout (how Google publishes its checkpoints) drops the ``w``
    under every ``mlp/`` name, which is right for Gemma 3's dense MLP (its weights sit directly
    in ``mlp``) and wrong for Gemma 4's mixture, whose experts and router keep a ``w`` each:
    read back, ``mlp/gating_einsum/w`` would arrive as ``mlp/gating_einsum``.
    """
    if isinstance(target, dict):
        if not isinstance(params, dict):
            if set(target) == {"w"}:
                return {"w": _nest_like(params, target["w"])}
            return params
        return {key: _nest_like(params[key], target[key]) if key in target else params[key]
                for key in params}
    return params
