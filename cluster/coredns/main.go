// The local cluster's DNS for the CPU node's pods (gemmalab/k8s/cluster/node.py writes its
// Corefile): CoreDNS with only the plugins that Corefile uses. CoreDNS's own main registers all
// ~60 (the cloud providers' SDKs among them), which took 12 min of a cold build on 2 cores.
package main

import (
	"fmt"
	"os"

	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
)

func main() {
	// In CoreDNS's own order (core/dnsserver/zdirectives.go): the order plugins run in.
	if err := dnsserver.SetDirectives([]string{"bind", "errors", "kubernetes"}); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	coremain.Run()
}
