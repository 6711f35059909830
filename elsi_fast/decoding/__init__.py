"""Speculative decoding with a trained draft (`speculative`), its acceptance-length evaluation,
live or replayed (`evaluation`), and experiments comparing drafts: cells (`experiments`), paired
statistics (`paired_stats`) and their tables (`experiment_report`); docs/experiments.md."""
