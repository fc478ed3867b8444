"""The Kubernetes contract shared by the operator and the agent: names, labels, phases, typed status."""
