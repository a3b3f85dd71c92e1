// One binary for the local control plane: kube-apiserver, kube-controller-manager, kube-scheduler
// and kubectl, chosen by the first argument. Linking them together builds the shared Kubernetes
// packages once instead of four times (gemmalab/k8s/local_cluster.py builds and starts it).
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	commands := map[string]func() *cobra.Command{
		"kube-apiserver":          apiserver.NewAPIServerCommand,
		"kube-controller-manager": controllermanager.NewControllerManagerCommand,
		"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
		"kubectl":                 kubectl.NewDefaultKubectlCommand,
	}
	if len(os.Args) < 2 || commands[os.Args[1]] == nil {
		fmt.Fprintln(os.Stderr, "usage: kube {kube-apiserver|kube-controller-manager|kube-scheduler|kubectl} [flags]")
		os.Exit(2)
	}
	command := commands[os.Args[1]]()
	os.Args = os.Args[1:]
	os.Exit(cli.Run(command))
}
