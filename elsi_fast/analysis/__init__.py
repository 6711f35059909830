"""The layer analysis: prompts (`prompts`), options (`analysis_options`), the streaming pass
(`analyze`) and its resumable state (`pass_state`, `prompt_store`), set entropy (`set_entropy`),
layer selection (`selection`) and its result (`report`). Every module imports on first use:
`elsi_fast.analyze` is the pass's entry point."""
