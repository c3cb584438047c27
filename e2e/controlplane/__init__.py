"""A real Kubernetes control plane for the tests: etcd + kube-apiserver + kube-controller-manager.

The Go module beside this file pins one Kubernetes release; :mod:`e2e.controlplane.cluster`
builds its commands once into a cache outside the repository and starts them on 127.0.0.1.
``python -m e2e.controlplane build|up|info`` (``make cluster``, ``make cluster-up``).
"""
