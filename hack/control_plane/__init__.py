"""The local Kubernetes control plane used by the integration tests and `hack/control-plane`."""
