"""`warmstart serve`, the one-machine mode: what runs (worker_spec), the identities learnt from cold
starts (identity_cache), plain workers without sandboxes (workers), starting workers on this machine
(local_node) and the command line (cli)."""
