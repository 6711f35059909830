"""Target models: loading (`loading`, `catalog`, `llama2c`), the toy targets trained here
(`toy_targets`), hidden-state capture by forward hooks (`capture`) and the native decode-time
runtime (`target_runtime`)."""
