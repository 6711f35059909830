"""Draft training: regenerated answers (`regenerate`, `self_instruct`, the vLLM worker script
`_vllm_generate`), training samples (`training_data`), cached target features (`feature_cache`)
and the training loop (`train`)."""
