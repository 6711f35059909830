"""Serving engines (vLLM, SGLang, llama.cpp): each engine's layer-id conventions (`layer_ids`), the
serving configs a report writes (`serving`), the vLLM environment (`vllm_env`) and the llama-server
client (`llamacpp_server`). Imports no other wing, so light modules (the CLI) may read it freely."""
