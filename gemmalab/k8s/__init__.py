"""Run the training notebook on GKE: configuration, manifests, rendering and submission.

- ``config.ClusterConfig``: one validated description of a run (project, buckets, accelerator).
- ``manifests.build(config)``: a batch/v1 Job (one host) or a JobSet (several hosts, slices).
- ``jupyterhub.hub_values(config)``: Helm values for zero-to-jupyterhub.
- ``render.render(objects)``: multi-document YAML; ``standard``: the files in k8s/.
- ``client``: submit, watch, read logs and delete through the Kubernetes API.

Importing this package imports neither ``kubernetes`` nor anything heavy; the submodules that
build objects import the ``kubernetes`` client models.
"""

from gemmalab.k8s.config import ClusterConfig

__all__ = ["ClusterConfig"]
