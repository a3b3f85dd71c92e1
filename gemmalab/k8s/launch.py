"""What launch.ipynb does after submitting: wait for the run to end, then read its metrics."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from gemmalab import storage
from gemmalab.k8s import client as k8s_client
from gemmalab.k8s.config import ClusterConfig


def watch(job_name: str, namespace: str = "default", *, timeout_s: float = 1800,
          poll_s: float = 15, on_change: Callable[[dict[str, str]], None] | None = None,
          api_client: Any = None) -> k8s_client.RunOutcome:
    """Poll until the run's Job or JobSet has ended, or ``timeout_s`` passed; returns its outcome
    (``client.run_outcome``: Succeeded, Failed or NotFound, with the condition's reason and
    message) or state ``Running`` at the deadline.

    A failed pod does not end the watch: the run's failure policy may retry it (a preempted
    host, a JobSet restart). ``on_change`` is called with ``{pod: phase}`` whenever the phases
    change (the notebook prints them).
    """
    deadline = time.monotonic() + timeout_s
    last: dict[str, str] | None = None
    while True:
        phases = k8s_client.pod_phases(job_name, namespace, api_client=api_client)
        if phases != last and on_change is not None:
            on_change(phases)
        last = phases
        outcome = k8s_client.run_outcome(job_name, namespace, api_client=api_client)
        if outcome is not None:
            return outcome
        if time.monotonic() >= deadline:
            return k8s_client.RunOutcome("Running", "", f"still going after {timeout_s:.0f} s")
        time.sleep(poll_s)


def run_states(job_names: Iterable[str], namespace: str = "default", *,
               api_client: Any = None) -> dict[str, str]:
    """``client.run_state`` of each run (a sweep's points: the notebook adds them to its
    table): Queued, Running, Succeeded, Failed or NotFound."""
    return {name: k8s_client.run_state(name, namespace, api_client=api_client)
            for name in job_names}


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Records of a run's ``metrics.jsonl``/``eval.jsonl`` (local, GCS FUSE mount or gs://)."""
    if not storage.exists(path):
        return []
    text = storage.read_bytes(path).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


OUTPUTS_ROOT_FIX = ("set outputs_root to a folder that holds the runs' outputs (on JupyterHub: "
                    "/outputs, the bucket's GCS FUSE mount), or give this machine credentials and "
                    "network access to the bucket")


def outputs_root(given: str, config: ClusterConfig, *, read: bool = True) -> str:
    """Where launch.ipynb finds its runs' outputs: ``given``, else where ``config``'s pods write
    them: the outputs bucket, or on the local cluster's CPU node its folder standing for it.
    When it will ``read`` them, refused in one line naming ``outputs_root`` if they cannot be
    read from here."""
    if given:
        root = given
    elif config.is_cpu:
        root = config.resolved_local_volumes()[1]
    else:
        root = f"gs://{config.resolved_outputs_bucket}"
    if read:
        storage.require_reachable("outputs_root", root, fix=OUTPUTS_ROOT_FIX)
    return root.rstrip("/")


def run_metrics(run_dir: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) of the run writing to ``run_dir``, so far."""
    return read_jsonl(f"{run_dir}/metrics.jsonl"), read_jsonl(f"{run_dir}/eval.jsonl")
