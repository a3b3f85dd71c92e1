// The pod sandboxes' first process on the local cluster's CPU node, as Kubernetes' pause.c: it
// holds the pod's namespaces, reaps the orphans that land on it (it is the pod's PID 1 when the
// pod shares its process namespace) and exits on SIGINT or SIGTERM. Built static (CGO off) and
// packed as the image gemmalab.local/pause by gemmalab/k8s/cluster/images.py: the node imports
// it, as registry.k8s.io/pause cannot be pulled here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if os.Getpid() != 1 {
		os.Stderr.WriteString("Warning: pause should be the first process\n")
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for received := range signals {
		if received != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 || err != nil {
				break
			}
		}
	}
}
