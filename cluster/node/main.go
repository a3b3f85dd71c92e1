// The local cluster's real CPU node: the kubelet of k8s.io/kubernetes, as cmd/kubelet links it
// (gemmalab/k8s/cluster/node.py starts it). One difference: the folder the kubelet makes at its
// start for the containers' legacy log links, /var/log/containers, is GEMMALAB_CONTAINER_LOGS_DIR
// instead, so that the node makes nothing outside the cluster's folder. (Its container runtime
// manager still links into /var/log/containers, which then does not exist: the link is not made,
// one logged error per container; the logs themselves are in the kubelet's podLogsDir.)
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"
	"k8s.io/kubernetes/pkg/kubelet"
)

func main() {
	if dir := os.Getenv("GEMMALAB_CONTAINER_LOGS_DIR"); dir != "" {
		kubelet.ContainerLogsDir = dir
	}
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
