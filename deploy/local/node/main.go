// Command kube-node is kubelet, kube-controller-manager, kube-scheduler and kube-proxy in one
// binary, the upstream mains of k8s.io/kubernetes cmd/<name>, chosen by the first argument
// (`kube-node kubelet --config=...`). One binary links the shared code once (about 107 MB against
// four of 60-110 MB each). Built by `python -m workshop node fetch` into ~/.cache/xidstream/kube-<version>/
// for the single-node cluster of xidstream/localnode.py; never commit it.
package main

import (
	"context"
	"fmt"
	"os"
	_ "time/tzdata" // CronJob time zones, as the upstream controller-manager main

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	commands := map[string]func() *cobra.Command{
		"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
		"kube-controller-manager": controllermanager.NewControllerManagerCommand,
		"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
		"kube-proxy":              proxy.NewProxyCommand,
	}
	if len(os.Args) < 2 || commands[os.Args[1]] == nil {
		fmt.Fprintln(os.Stderr, "usage: kube-node kubelet|kube-controller-manager|kube-scheduler|kube-proxy [flags]")
		os.Exit(2)
	}
	command := commands[os.Args[1]]()
	os.Args = append(os.Args[:1], os.Args[2:]...)
	os.Exit(cli.Run(command))
}
