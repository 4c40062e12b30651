"""Test control plane: real kube-apiserver, etcd, controllers and kwok."""
