"""Node mechanics, no Kubernetes: CRIU, the CUDA checkpoint API, sandboxes, capture, restore, staging."""
