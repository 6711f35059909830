"""The end-to-end experiment on the toy targets: run from the repository root as
`python -m bench.e2e.<name>`; see README.md beside this file."""
