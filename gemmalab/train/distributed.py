"""Join a multi-process JAX run when the notebook was launched as one process of it.

Called explicitly at the top of the notebooks (never at import). On one host it does nothing.
"""

from __future__ import annotations

import os

import jax


def initialize() -> bool:
    """``jax.distributed.initialize`` when this process is one of several; True if it joined.

    - ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``: set by the GPU
      JobSet manifests (and usable anywhere, e.g. two processes on one machine).
    - ``TPU_WORKER_HOSTNAMES`` with several hosts, or ``MEGASCALE_NUM_SLICES`` > 1: a multi-host
      or multislice TPU JobSet on GKE; JAX's own cluster detection fills in the rest.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(env.get("JAX_NUM_PROCESSES", "1")),
                                   process_id=int(env.get("JAX_PROCESS_ID", "0")))
        return True
    tpu_hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(tpu_hosts) > 1 or int(env.get("MEGASCALE_NUM_SLICES", "1")) > 1:
        jax.distributed.initialize()
        return True
    return False
