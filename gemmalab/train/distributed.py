"""Join a multi-process JAX run when the notebook was launched as one process of it, and make
sure the process trains on the accelerator it was launched for.

Called explicitly at the top of the notebooks (never at import). On one host it does nothing.
"""

from __future__ import annotations

import os

import jax

from gemmalab.errors import ConfigError

# JAX_PLATFORMS' names for an accelerator, and the platform jax.default_backend() reports.
ACCELERATOR_PLATFORMS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}


def initialize() -> bool:
    """``jax.distributed.initialize`` when this process is one of several; True if it joined.

    - ``JAX_COORDINATOR_ADDRESS`` + ``JAX_NUM_PROCESSES`` + ``JAX_PROCESS_ID``: set by the GPU
      and local CPU JobSet manifests (and usable anywhere, e.g. two processes on one machine;
      with ``JAX_PLATFORMS=cpu`` over gloo).
    - ``TPU_WORKER_HOSTNAMES`` with several hosts, or ``MEGASCALE_NUM_SLICES`` > 1: a multi-host
      or multislice TPU JobSet on GKE; JAX's own cluster detection fills in the rest.
    """
    joined = _join()
    require_requested_accelerator()
    return joined


def _join() -> bool:
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        if env.get("JAX_PLATFORMS", "").split(",")[0].strip().lower() == "cpu":
            # CPU processes exchange their collectives over gloo (JAX's CPU default has none).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(env.get("JAX_NUM_PROCESSES", "1")),
                                   process_id=int(env.get("JAX_PROCESS_ID", "0")))
        return True
    tpu_hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(tpu_hosts) > 1 or int(env.get("MEGASCALE_NUM_SLICES", "1")) > 1:
        jax.distributed.initialize()
        return True
    return False


def require_requested_accelerator() -> None:
    """Refuse to go on when ``JAX_PLATFORMS`` names an accelerator first (the GKE manifests set
    ``cuda,cpu`` or ``tpu,cpu``) and JAX's default backend is another: JAX skips ``cuda``
    without a word when it sees no NVIDIA device, and the run would train on the CPU."""
    requested = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    expected = ACCELERATOR_PLATFORMS.get(requested)
    found = jax.default_backend() if expected else None
    if expected and found != expected:
        raise ConfigError("JAX_PLATFORMS", f"asks for {requested} first, but JAX found no "
                          f"{requested} device and would run on the {found}",
                          "check that the pod got its accelerators (its resource limits, the "
                          "node's drivers), or set JAX_PLATFORMS=cpu to run on the CPU")
