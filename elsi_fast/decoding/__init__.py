"""Speculative decoding with a trained draft (`speculative`) and its acceptance-length
evaluation (`evaluation`)."""
