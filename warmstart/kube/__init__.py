"""How the operator and the node agent talk to the API server: one kubeconfig loader, one client (the
`kubernetes` package's dynamic client, every call with a request timeout) and one Event writer."""
