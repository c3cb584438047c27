//go:build tools

// The kind node image's programs (e2e/kind/images.py builds them) come from this module
// too, so one pin covers the test control plane and the kind nodes. Never compiled:
// the build tag only keeps their dependencies in go.mod and go.sum.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubeadm"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
