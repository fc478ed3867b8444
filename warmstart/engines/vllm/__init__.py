"""The vLLM engine (the optional `warmstart[vllm]` extra): options, identity, request driver, the adapter."""
