"""A real Kubernetes on this machine to rehearse GKE runs on and to test against.

etcd (Debian's ``etcd-server``), kube-apiserver, kube-controller-manager, kube-scheduler and
kubectl from ``k8s.io/kubernetes``, the JobSet and Kueue controllers with their admission
webhooks, and kwok's fake nodes labelled and sized as GKE's TPU v6e nodes; as root also one real
CPU node, ``cpu-0`` (``node``: kubelet, containerd with Debian's runc and CNI plugins, CoreDNS;
its network in ``network``, images without a registry in ``images``). The Go programs are built
once per machine from the Go module proxy (``build``), everything listens on loopback or the
node's own bridge (``stack``), and ``python -m gemmalab.k8s.cluster up`` (``make cluster``)
prints the ``export KUBECONFIG=...`` line.
"""

from gemmalab.k8s.cluster.errors import ClusterError

__all__ = ["ClusterError"]
