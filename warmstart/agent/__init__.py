"""The Kubernetes node agent (a privileged DaemonSet): watches its node's pods, drives the node mechanics."""
