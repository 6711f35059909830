"""Engine integration checks (llama.cpp, vLLM): run from the repository root as
`python -m bench.integration.<name>`; see README.md beside this file."""
