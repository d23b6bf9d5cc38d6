"""Scripts that run inside vLLM's own Python (stdlib, vllm, torch, safetensors only): started as files, with this
folder on their path, never imported by eaglekit except `vllm_worker_common`."""
