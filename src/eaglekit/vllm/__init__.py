"""The real vLLM in the loop, in its own Python: the engine (`engine`), `bench engine=vllm` (`bench`), capture
(`capture`, `regenerate`), the losslessness test (`distribution`), and the scripts that run inside vLLM's Python
(`workers/`: stdlib and vLLM only)."""
